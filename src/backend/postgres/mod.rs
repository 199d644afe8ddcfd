//! PostgreSQL: the production backend, for many app instances sharing one database.
//!
//! A claim is a call of the schema's procedure `axum_idempotency_lock_v1`: it takes the key's
//! transaction-scoped advisory lock, at once when it is free, else waiting with the wait bounded by
//! `lock_timeout` set for the wait alone, and raises a violation of the primary key, the "taken"
//! error, when a live record holds the key. It writes only to delete an expired record under the
//! key: the record is written once, complete, by a plain insert in `axum_idempotency_record_v1`, in
//! the exchange that commits, where the primary key has the last word. The statements themselves
//! are written once, in `migrations/postgres/0001_store.sql`; PL/pgSQL keeps their plans for the
//! session, so the server parses and plans one call per step, not the statements.

use std::time::Duration;

#[cfg(feature = "outbox")]
use sqlx::Row;
use sqlx::error::DatabaseError;
use sqlx::{AssertSqlSafe, PgConnection, Pool, Postgres, Transaction};

use super::claim::fused_then_rounds;
use super::literal::{Statement, Syntax};
use super::migrate::{self, runner};
#[cfg(feature = "outbox")]
use super::outbox::{
    self as outbox, Claim, ClaimedMessage, Handed, Lease, Settlement, Topics, claiming,
    outbox_alike, outbox_decoder,
};
use super::{Claimed, Storage, alike, bound, record_values};
#[cfg(feature = "outbox")]
use crate::clock::Clock;
use crate::clock::Millis;
use crate::error::Error;
#[cfg(feature = "outbox")]
use crate::message::{Message, MessageId};
use crate::record::{NewRecord, StoredResponse};
use crate::scope::ScopedKey;

bound!(Postgres);
runner!(Postgres);
#[cfg(feature = "outbox")]
outbox_decoder!(Postgres);

#[cfg(feature = "outbox")]
mod outbox_sql;

/// The largest response (headers and body) a record's statement writes into its text: past it,
/// the text (twice the bytes, in hexadecimal) costs the database more parsing than the exchange
/// it saves, and the statement is sent with its values bound.
const INLINE_RESPONSE_LIMIT: usize = 64 * 1024;

/// Whether a statement carrying `response` is written with its values in its text.
fn inline_fits(response: Option<&StoredResponse>) -> bool {
    response.is_none_or(|response| response.stored_len() <= INLINE_RESPONSE_LIMIT)
}

/// The primary key's constraint, which the claim procedure violates on purpose when a live
/// record holds the key.
const PRIMARY_KEY: &str = "idempotency_records_pkey";

/// The inbox keys' primary key: a plain claim of a key that has a row violates it.
const KEYS_PRIMARY_KEY: &str = "idempotency_inbox_pkey";

/// Whether a dedupe key's plain insert found a row under the key.
fn key_taken(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(error)
        if error.code().as_deref() == Some("23505") && error.constraint() == Some(KEYS_PRIMARY_KEY))
}

/// `lock_timeout` in milliseconds for a wait of `lock_wait`: at least 1 (0 would mean no bound)
/// and at most i32::MAX, the setting's own limit.
fn lock_wait_ms(lock_wait: Duration) -> i64 {
    i64::try_from(lock_wait.as_millis())
        .map_or(i64::from(i32::MAX), |ms| ms.min(i64::from(i32::MAX)))
        .max(1)
}

/// `claim`, its wait for a concurrent claimer bounded by `lock_wait`, then `after`. The bound is
/// set for the transaction and set back to the server's default before the handler runs, so
/// the handler's own statements wait as the connection's configuration says (a `lock_timeout`
/// set by a session `SET` of the application's own is not restored; one set in the server's,
/// role's or database's configuration or the connection's options is).
fn bounded(claim: &Statement<'_>, lock_wait: Duration, after: &str) -> AssertSqlSafe<String> {
    let claim = claim.inline("", "; SET LOCAL lock_timeout TO DEFAULT");
    AssertSqlSafe(format!(
        "SET LOCAL lock_timeout = {}; {}{after}",
        lock_wait_ms(lock_wait),
        claim.0
    ))
}

/// A dedupe key's row: its digest and when it expires.
fn key_insert(key: &ScopedKey, expires_at: Millis) -> Statement<'_> {
    let mut insert = Statement::new(Syntax::Postgres);
    insert
        .sql("INSERT INTO idempotency_inbox (key_digest, expires_at) VALUES (")
        .bytes(&key.digest()[..])
        .int8(expires_at.column())
        .sql(")");
    insert
}

/// `$command` on the savepoint a claim inside a begun transaction runs under.
macro_rules! savepoint {
    ($command:literal) => {
        concat!($command, " axum_idempotency_claim")
    };
}

/// Whether the claim failed because a live record holds the key.
fn taken(error: &sqlx::Error) -> bool {
    // unique_violation, on the records' own primary key
    matches!(error, sqlx::Error::Database(error)
        if error.code().as_deref() == Some("23505") && error.constraint() == Some(PRIMARY_KEY))
}

/// The claim: a call of the schema's lock procedure with the key, the time a live record must
/// outlast, the key's lock and the bound on waiting for it.
fn claim_call<'a>(record: &'a NewRecord<'a>, lock_wait: Duration) -> Statement<'a> {
    let mut call = Statement::new(Syntax::Postgres);
    // `lock_timeout` takes at most i32::MAX milliseconds.
    let wait_ms = i64::try_from(lock_wait.as_millis())
        .map_or(i64::from(i32::MAX), |ms| ms.min(i64::from(i32::MAX)));
    call.sql("CALL axum_idempotency_lock_v1(")
        .bytes(&record.key.digest()[..])
        .int8(record.created_at.column())
        .int8(key_lock(&record.key))
        .int8(wait_ms)
        .sql(")");
    call
}

/// The record: a call of the schema's record procedure, a plain insert planned once per session.
fn record_call<'a>(record: &'a NewRecord<'a>) -> Statement<'a> {
    let mut call = Statement::new(Syntax::Postgres);
    call.sql("CALL axum_idempotency_record_v1(");
    record_values(&mut call, record);
    call.sql(")");
    call
}

/// The number of the transaction-scoped advisory lock every claim of `key` takes. The
/// one-number form: a lock space of its own, apart from the two-number locks apps often use,
/// and 64 bits of the digest make two in-flight keys sharing a number vanishingly rare (they
/// would only queue one behind the other). The lock procedure mixes in the table's oid, so
/// the same key in another schema's table takes another lock.
fn key_lock(key: &ScopedKey) -> i64 {
    let [a, b, c, d, e, f, g, h, ..] = *key.digest();
    i64::from_be_bytes([a, b, c, d, e, f, g, h])
}

/// Begins a transaction that already holds the claim on `record`'s key, in the one exchange
/// that begins it; `None`, with nothing left open, when a live record holds the key.
///
/// Sent as one simple query, the claim comes *before* `BEGIN`: the call runs in the implicit
/// transaction of its query, which `BEGIN` turns into the transaction the handler goes on in,
/// the advisory lock with it. If the call fails, the server rolls the implicit transaction
/// back and skips `BEGIN`, so a refused claim leaves the connection idle, with nothing to
/// roll back.
pub(crate) async fn begin_claimed<'a>(
    pool: &'a Pool<Postgres>,
    record: &'a NewRecord<'a>,
    lock_wait: Duration,
) -> Result<Option<Transaction<'static, Postgres>>, Error> {
    let claim = claim_call(record, lock_wait).inline("", "; BEGIN");
    match pool.begin_with(claim).await {
        Ok(tx) => Ok(Some(tx)),
        Err(error) if taken(&error) => Ok(None),
        Err(error) => Err(classify(error)),
    }
}

/// Runs one of the outbox's batched writes with its values written in, as a simple query, and
/// answers the ids it wrote. A prepared statement keeps the plan it settled on after its first
/// runs: planned on a new outbox's few pages, and never planned again where the table is not
/// analyzed (autovacuum off or behind), a settle scanned the whole table at each call once it
/// had grown (16 ms a settle at 100,000 rows). Written in, the statement is planned at each run
/// for the table as it is then.
#[cfg(feature = "outbox")]
async fn batched(
    conn: &mut PgConnection,
    statement: &Statement<'_>,
) -> Result<Vec<MessageId>, sqlx::Error> {
    let rows = sqlx::raw_sql(statement.inline("", ""))
        .fetch_all(conn)
        .await?;
    rows.iter()
        .map(|row| row.try_get::<i64, _>(0).map(MessageId::from))
        .collect()
}

/// [`batched`] for a write whose only value is its JSON array, written between `with` and
/// `rest`.
#[cfg(feature = "outbox")]
async fn around_json(
    conn: &mut PgConnection,
    [with, rest]: [&'static str; 2],
    json: String,
) -> Result<Vec<MessageId>, sqlx::Error> {
    let mut statement = Statement::new(Syntax::Postgres);
    statement.sql(with).text(json).sql(rest);
    batched(conn, &statement).await
}

impl Storage for Postgres {
    alike!();

    async fn claim_record<'a>(
        pool: &'a Pool<Self>,
        record: &'a NewRecord<'a>,
        wait: Duration,
        begun: Option<Transaction<'static, Self>>,
    ) -> Result<Claimed<Self>, Error> {
        let fused = begin_claimed(pool, record, wait);
        fused_then_rounds(pool, record, wait, begun, fused).await
    }

    // The claim procedure bounds its own wait, so the transaction begins plainly.
    async fn begin(
        pool: &Pool<Self>,
        _lock_wait: Duration,
    ) -> Result<Transaction<'static, Self>, Error> {
        pool.begin().await.map_err(classify)
    }

    // Inside a begun transaction the procedure's "taken" error would abort the transaction the
    // caller goes on to read the winner's record in, so the call runs under a savepoint, rolled
    // back to when the key is taken and released at once when it is ours.
    async fn claim_in<'a>(
        conn: &'a mut PgConnection,
        record: &'a NewRecord<'a>,
        lock_wait: Duration,
    ) -> Result<bool, Error> {
        let sql = claim_call(record, lock_wait).inline(
            concat!(savepoint!("SAVEPOINT"), "; "),
            concat!("; ", savepoint!("RELEASE SAVEPOINT")),
        );
        match sqlx::raw_sql(sql).execute(&mut *conn).await {
            Ok(_) => Ok(true),
            Err(error) if taken(&error) => {
                sqlx::raw_sql(savepoint!("ROLLBACK TO SAVEPOINT"))
                    .execute(&mut *conn)
                    .await
                    .map_err(classify)?;
                Ok(false)
            }
            Err(error) => Err(classify(error)),
        }
    }

    // The common case, a new key, is one exchange: the key's plain insert comes before `BEGIN`,
    // in the implicit transaction that `BEGIN` turns into the handler's, as the record's claim
    // does. Any row under the key fails it and leaves the connection idle; only then does a
    // second transaction find out whether that row is live or expired, replacing it if expired
    // (the primary key decides there too, and waits for a concurrent claimer within the bound).
    async fn claim_key<'a>(
        pool: &'a Pool<Self>,
        key: &'a ScopedKey,
        now: Millis,
        expires_at: Millis,
        lock_wait: Duration,
    ) -> Result<Option<Transaction<'static, Self>>, Error> {
        let insert = key_insert(key, expires_at);
        match pool
            .begin_with(bounded(&insert, lock_wait, "; BEGIN"))
            .await
        {
            Ok(tx) => return Ok(Some(tx)),
            Err(error) if key_taken(&error) => {}
            Err(error) => return Err(classify(error)),
        }
        let mut tx = pool.begin().await.map_err(classify)?;
        if Self::claim_key_in(&mut tx, key, now, expires_at, lock_wait).await? {
            return Ok(Some(tx));
        }
        tx.rollback().await.map_err(classify)?;
        Ok(None)
    }

    // An upsert that changes nothing on a live row, rather than the plain insert, whose
    // failure would abort the transaction and every key claimed in it before.
    async fn claim_key_in<'a>(
        conn: &'a mut PgConnection,
        key: &'a ScopedKey,
        now: Millis,
        expires_at: Millis,
        lock_wait: Duration,
    ) -> Result<bool, Error> {
        let mut replace = key_insert(key, expires_at);
        replace
            .sql(
                " ON CONFLICT (key_digest) DO UPDATE SET expires_at = EXCLUDED.expires_at \
                 WHERE idempotency_inbox.expires_at <= ",
            )
            .int8(now.column());
        let replaced = sqlx::raw_sql(bounded(&replace, lock_wait, ""))
            .execute(conn)
            .await
            .map_err(classify)?;
        Ok(replaced.rows_affected() == 1)
    }

    // The record is sent with `COMMIT`, in one exchange. sqlx ends a `Transaction` only by a
    // statement of its own: dropped, it queues a `ROLLBACK`, which would find no transaction
    // and make the server log a warning. `BEGIN` after `COMMIT` opens an empty transaction for
    // that `ROLLBACK` to end; it travels with the ping the pool tests a returned connection
    // with, so it costs the server two trivial statements and the client no wait. A record too
    // large to write out is sent with its values bound, and committed by sqlx.
    async fn commit_record<'a>(
        mut tx: Transaction<'static, Self>,
        record: &'a NewRecord<'a>,
    ) -> Result<(), Error> {
        let call = record_call(record);
        let written = if inline_fits(record.response) {
            sqlx::raw_sql(call.inline("", "; COMMIT; BEGIN"))
                .execute(&mut *tx)
                .await
                .map(drop)
        } else {
            match bound(&call).execute(&mut *tx).await {
                Ok(_) => tx.commit().await,
                Err(error) => Err(error),
            }
        };
        match written {
            Ok(()) => Ok(()),
            // Only a claim that bypassed the key's lock, or a snapshot older than the lock's
            // previous holder's commit, gets here: running the transaction again replays.
            Err(error) if taken(&error) => Err(Error::Conflict),
            Err(error) => Err(classify(error)),
        }
    }

    #[cfg(feature = "outbox")]
    outbox_alike!();
    #[cfg(feature = "outbox")]
    async fn renew_leases(
        pool: &Pool<Self>,
        leases: &[Lease],
        until: Millis,
    ) -> Result<Vec<MessageId>, sqlx::Error> {
        if leases.is_empty() {
            return Ok(Vec::new());
        }
        let held = outbox::held(leases)?;
        let [with, set, rest] = outbox_sql::RENEW_LEASES;
        let mut renewal = Statement::new(Syntax::Postgres);
        renewal
            .sql(with)
            .text(held)
            .sql(set)
            .int8(until.column())
            .sql(rest);
        batched(&mut *pool.acquire().await?, &renewal).await
    }

    #[cfg(feature = "outbox")]
    async fn release_unsent(
        pool: &Pool<Self>,
        leases: &[Lease],
    ) -> Result<Vec<MessageId>, sqlx::Error> {
        if leases.is_empty() {
            return Ok(Vec::new());
        }
        let held = outbox::held(leases)?;
        around_json(
            &mut *pool.acquire().await?,
            outbox_sql::RELEASE_UNSENT,
            held,
        )
        .await
    }

    #[cfg(feature = "outbox")]
    async fn settle(
        conn: &mut PgConnection,
        outcomes: &[(Lease, Settlement)],
    ) -> Result<Vec<MessageId>, sqlx::Error> {
        if outcomes.is_empty() {
            return Ok(Vec::new());
        }
        let outcomes = outbox::outcomes(outcomes)?;
        around_json(conn, outbox_sql::SETTLE, outcomes).await
    }

    // ON CONFLICT rather than catching the unique violation: an error would abort the caller's
    // whole transaction.
    #[cfg(feature = "outbox")]
    async fn insert(
        conn: &mut PgConnection,
        message: &Message,
        now: Millis,
        handed: Option<Handed>,
    ) -> Result<Option<MessageId>, sqlx::Error> {
        if let Some(key) = message.ordering() {
            sqlx::query(outbox_sql::ORDER_LOCK)
                .bind(key)
                .execute(&mut *conn)
                .await?;
        }
        let id: Option<i64> = sqlx::query_scalar(outbox_sql::INSERT)
            .bind(message.topic())
            .bind(message.key().as_str())
            .bind(message.payload())
            .bind(now.column())
            .bind(now.column())
            .bind(message.ordering())
            .bind(i64::from(handed.is_some()))
            .bind(handed.is_some())
            .bind(handed.map(|_| now.column()))
            .bind(handed.map(|handed| handed.token))
            .bind(handed.map(|handed| handed.until.column()))
            .fetch_optional(conn)
            .await?;
        Ok(id.map(MessageId::from))
    }

    // One statement leases the due rows, begins the attempts of those sent now and returns
    // them as it left them.
    #[cfg(feature = "outbox")]
    async fn claim_due(
        pool: &Pool<Self>,
        clock: &Clock,
        claim: Claim,
        topics: &Topics,
    ) -> (Claim, Result<Vec<ClaimedMessage>, sqlx::Error>) {
        claiming(pool, clock, claim, |mut conn, claim| async move {
            // A backlog's claims let the topics take turns (see the statement).
            let sql = match topics {
                Topics::Except(skipped) if skipped.is_empty() && claim.probe => outbox_sql::CLAIM,
                Topics::Except(_) => outbox_sql::CLAIM_SKIPPING,
                Topics::Only(_) => outbox_sql::CLAIM_TOPIC,
            };
            let query = sqlx::query(sql)
                .bind(claim.lease_until.column())
                .bind(claim.token)
                .bind(claim.now.column())
                .bind(claim.limit)
                .bind(claim.max_attempts);
            let query = match topics {
                Topics::Except(skipped) => query.bind(skipped),
                Topics::Only(topic) => query.bind(topic),
            };
            // A claim after one that found all it asked for likely faces a backlog, and the
            // planner costs a backlog's claim high enough to compile it (see the statement).
            let begin = if claim.probe {
                outbox_sql::BEGIN_CLAIM
            } else {
                outbox_sql::BEGIN_BACKLOG_CLAIM
            };
            let mut tx =
                sqlx::Connection::begin_with(&mut *conn, sqlx::AssertSqlSafe(begin)).await?;
            let rows = query.fetch_all(&mut *tx).await?;
            tx.commit().await?;
            rows.iter()
                .map(|row| {
                    Ok(ClaimedMessage {
                        record: outbox_record(row)?,
                        attempt_begun: row.try_get("attempt_begun")?,
                    })
                })
                .collect()
        })
        .await
    }
}

const SCHEMA: migrate::Schema<Postgres> = migrate::Schema {
    versions_table: "idempotency_schema_versions",
    scripts: &[(
        1,
        include_str!("../../../migrations/postgres/0001_store.sql"),
    )],
    begin: "BEGIN",
    // A transaction-scoped advisory lock: two instances starting at once migrate one after
    // the other, and the second finds nothing left to do. The number is this crate's own.
    lock: Some("SELECT pg_advisory_xact_lock(7351906218944770001)"),
    unlock: None,
    lock_granted: |_| true,
    record: "INSERT INTO idempotency_schema_versions (version, applied_at) VALUES ($1, $2)",
};
// Resolved through the search_path, as every other statement's tables are.
const VERSIONS_TABLE_EXISTS: &str = "SELECT COUNT(to_regclass('idempotency_schema_versions'))";
const FIND: &str = "SELECT state, fingerprint, status, headers, body, created_at, expires_at, lease_expires_at \
        FROM idempotency_records WHERE key_digest = $1";
// The outer expiry test is repeated on purpose: a claim that replaced an expired record
// while this DELETE waited for its row lock must survive the re-check.
const PURGE: &str = "DELETE FROM idempotency_records WHERE expires_at <= $1 \
        AND key_digest IN (SELECT key_digest FROM idempotency_records WHERE expires_at <= $1 LIMIT $2)";

const RENEW_LEASE: &str = "UPDATE idempotency_records SET lease_expires_at = $1 \
        WHERE key_digest = $2 AND lease_owner = $3 AND state = 'processing'";
const TAKE_OVER_LEASE: &str = "UPDATE idempotency_records SET lease_owner = $1, lease_expires_at = $2 \
        WHERE key_digest = $3 AND state = 'processing' AND lease_expires_at <= $4";
const FINISH_LEASED: &str = "UPDATE idempotency_records \
        SET state = $1, status = $2, headers = $3, body = $4, lease_owner = NULL, lease_expires_at = NULL \
        WHERE key_digest = $5 AND lease_owner = $6";
const RELEASE_LEASE: &str = "DELETE FROM idempotency_records \
        WHERE key_digest = $1 AND lease_owner = $2 AND state = 'processing'";
const FORGET: &str = "DELETE FROM idempotency_records WHERE key_digest = $1";
// The outer expiry test is repeated for the same reason as in `PURGE`.
const PURGE_KEYS: &str = "DELETE FROM idempotency_inbox WHERE expires_at <= $1 \
        AND key_digest IN (SELECT key_digest FROM idempotency_inbox WHERE expires_at <= $1 LIMIT $2)";
const KEY_HELD: &str = "SELECT 1 FROM idempotency_inbox WHERE key_digest = $1 AND expires_at > $2";

/// Whether the error means "a lock wait ran out".
fn is_busy(error: &dyn DatabaseError) -> bool {
    // lock_not_available
    error.code().as_deref() == Some("55P03")
}

/// Whether the database rolled the transaction back to resolve a deadlock or a serialization
/// conflict.
pub(super) fn is_conflict(error: &dyn DatabaseError) -> bool {
    // deadlock_detected, serialization_failure
    matches!(error.code().as_deref(), Some("40P01" | "40001"))
}

/// Whether a migration failed because another migrator did the same work at the same time.
fn migration_raced(error: &dyn DatabaseError) -> bool {
    is_conflict(error)
}

/// The crate's error for a database error.
fn classify(error: sqlx::Error) -> Error {
    super::classify(error, is_busy, is_conflict)
}
