//! SQLite: embedded, one file, no server.
//!
//! SQLite has one writer at a time, so a claim's transaction begins `IMMEDIATE`, taking the
//! write lock up front and waiting for it within the claim's bound (`busy_timeout`). That lock
//! is the key's lock: holding it, the claim reads whether a live record holds the key, and the
//! record is written once, complete, in the call that commits. Every call into the database is
//! a hop to the connection's worker thread, and each hop made while the write lock is held keeps
//! every other writer waiting; so is every statement SQLite has to compile afresh. The record
//! therefore travels with `COMMIT` as one prepared statement, compiled once per connection, and
//! the claim's read is a prepared statement of its own.

use std::time::Duration;

use sqlx::error::DatabaseError;
use sqlx::sqlite::SqliteConnection;
use sqlx::{Pool, Sqlite, Transaction};

use super::claim::rounds;
use super::literal::{Statement, Syntax};
use super::migrate::{self, runner};
#[cfg(feature = "outbox")]
use super::outbox::{
    Claim, ClaimedMessage, Handed, Topics, claiming, json_batches, outbox_alike, outbox_decoder,
};
use super::{Claimed, PurgePace, Storage, alike, bound, record_values};
#[cfg(feature = "outbox")]
use crate::clock::Clock;
use crate::clock::Millis;
use crate::error::Error;
#[cfg(feature = "outbox")]
use crate::message::{Message, MessageId};
use crate::record::NewRecord;
use crate::scope::ScopedKey;

bound!(Sqlite);
runner!(Sqlite);
#[cfg(feature = "outbox")]
outbox_decoder!(Sqlite);

#[cfg(feature = "outbox")]
mod outbox_sql;

/// SQLite's extended code for a violated primary key, SQLITE_CONSTRAINT_PRIMARYKEY.
const CONSTRAINT_PRIMARY_KEY: &str = "1555";

/// Whether the record's insert failed because a record holds the key.
fn record_exists(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(error)
        if error.code().as_deref() == Some(CONSTRAINT_PRIMARY_KEY))
}

/// `PRAGMA busy_timeout` for `lock_wait`, then `BEGIN IMMEDIATE`: the wait for the write lock,
/// which is the wait for a concurrent claimer, is bounded by `lock_wait`.
fn begin_immediate(lock_wait: Duration) -> Statement<'static> {
    let mut begin = Statement::new(Syntax::Sqlite);
    begin
        .sql("PRAGMA busy_timeout = ")
        .int8(busy_timeout(lock_wait))
        .sql("; BEGIN IMMEDIATE");
    begin
}

/// `busy_timeout` in milliseconds for a wait of `lock_wait`.
fn busy_timeout(lock_wait: Duration) -> i64 {
    i64::try_from(lock_wait.as_millis())
        .unwrap_or(i64::MAX)
        .clamp(1, i64::from(i32::MAX))
}

/// `PRAGMA busy_timeout` for `lock_wait`, then a deferred `BEGIN`: the transaction takes the
/// write lock at its first write, waiting for it within `lock_wait`.
fn begin_deferred(lock_wait: Duration) -> Statement<'static> {
    let mut begin = Statement::new(Syntax::Sqlite);
    begin
        .sql("PRAGMA busy_timeout = ")
        .int8(busy_timeout(lock_wait))
        .sql("; BEGIN");
    begin
}

/// Inserts the record. The claim has removed an expired record under the key, so the plain
/// insert fails only on a record the work itself wrote there, leaving the transaction open for
/// the caller to roll back.
fn record_insert<'a>(record: &'a NewRecord<'a>) -> Statement<'a> {
    let mut write = Statement::new(Syntax::Sqlite);
    write.sql(
        "INSERT INTO idempotency_records (key_digest, principal, method, route, \
         fingerprint, state, status, headers, body, created_at, expires_at, lease_owner, \
         lease_expires_at) VALUES (",
    );
    record_values(&mut write, record);
    write.sql(")");
    write
}

impl Storage for Sqlite {
    alike!();

    // Every claim waits for the one write lock while a batch holds it: a short batch keeps that
    // wait within the busy handler's first few naps.
    const ONE_WRITE_LOCK: bool = true;

    const PURGE_PACE: PurgePace = PurgePace {
        batch: 250,
        ..PurgePace::DEFAULT
    };

    async fn begin(
        pool: &Pool<Self>,
        lock_wait: Duration,
    ) -> Result<Transaction<'static, Self>, Error> {
        pool.begin_with(begin_immediate(lock_wait).inline("", ""))
            .await
            .map_err(classify)
    }

    // The claim is a read in the begun transaction: sent with `BEGIN`, it could not be a
    // prepared statement, and compiling it afresh costs more than the hop it saves. So every
    // claim begins, then claims.
    async fn claim_record<'a>(
        pool: &'a Pool<Self>,
        record: &'a NewRecord<'a>,
        wait: Duration,
        begun: Option<Transaction<'static, Self>>,
    ) -> Result<Claimed<Self>, Error> {
        rounds(pool, record, wait, begun).await
    }

    // The transaction holds the write lock, so nothing can change under the read. A new key,
    // the common case, finds no row and leaves the record's insert nothing to remove first; an
    // expired record is removed here, in the claim's transaction, which a rollback restores.
    async fn claim_in<'a>(
        conn: &'a mut SqliteConnection,
        record: &'a NewRecord<'a>,
        _lock_wait: Duration,
    ) -> Result<bool, Error> {
        let live: Option<bool> = sqlx::query_scalar(
            "SELECT expires_at > ?2 FROM idempotency_records WHERE key_digest = ?1",
        )
        .bind(&record.key.digest()[..])
        .bind(record.created_at.column())
        .fetch_optional(&mut *conn)
        .await
        .map_err(classify)?;
        match live {
            None => Ok(true),
            Some(true) => Ok(false),
            Some(false) => {
                sqlx::query("DELETE FROM idempotency_records WHERE key_digest = ?1")
                    .bind(&record.key.digest()[..])
                    .execute(conn)
                    .await
                    .map_err(classify)?;
                Ok(true)
            }
        }
    }

    // A dedupe key needs no read under the write lock: the transaction begins deferred and the
    // key's insert, its first statement, takes the lock (as a hand-written dedupe's would), so
    // the lock is held from the claim to the commit and not a call longer. An expired row is
    // replaced by the same statement; a live one makes it change nothing.
    async fn claim_key<'a>(
        pool: &'a Pool<Self>,
        key: &'a ScopedKey,
        now: Millis,
        expires_at: Millis,
        lock_wait: Duration,
    ) -> Result<Option<Transaction<'static, Self>>, Error> {
        let mut tx = pool
            .begin_with(begin_deferred(lock_wait).inline("", ""))
            .await
            .map_err(classify)?;
        if Self::claim_key_in(&mut tx, key, now, expires_at, lock_wait).await? {
            return Ok(Some(tx));
        }
        tx.rollback().await.map_err(classify)?;
        Ok(None)
    }

    // The transaction holds the database's write lock from its first write (a batch's, from
    // its `BEGIN IMMEDIATE`), so the wait for it is the `busy_timeout` its `BEGIN` set.
    async fn claim_key_in<'a>(
        conn: &'a mut SqliteConnection,
        key: &'a ScopedKey,
        now: Millis,
        expires_at: Millis,
        _lock_wait: Duration,
    ) -> Result<bool, Error> {
        let claimed = sqlx::query(
            "INSERT INTO idempotency_inbox (key_digest, expires_at) VALUES (?1, ?2) \
             ON CONFLICT (key_digest) DO UPDATE SET expires_at = excluded.expires_at \
             WHERE idempotency_inbox.expires_at <= ?3",
        )
        .bind(&key.digest()[..])
        .bind(expires_at.column())
        .bind(now.column())
        .execute(conn)
        .await
        .map_err(classify)?;
        Ok(claimed.rows_affected() == 1)
    }

    // The record is sent with `COMMIT`, in one call. sqlx ends a `Transaction` only by a
    // statement of its own: dropped, it has its worker roll back, which must find a transaction
    // or the connection's count of open transactions goes wrong. `BEGIN` after `COMMIT` opens an
    // empty, deferred transaction for that rollback; it takes no lock, and the rollback runs
    // after the answer, when no writer waits on this connection.
    async fn commit_record<'a>(
        mut tx: Transaction<'static, Self>,
        record: &'a NewRecord<'a>,
    ) -> Result<(), Error> {
        let mut write = record_insert(record);
        write.sql("; COMMIT; BEGIN");
        match bound(&write).execute(&mut *tx).await {
            Ok(_) => Ok(()),
            // Only a write to the key by the work itself gets here: the write lock kept every
            // other claimer out since the claim.
            Err(error) if record_exists(&error) => Err(Error::Conflict),
            Err(error) => Err(classify(error)),
        }
    }

    #[cfg(feature = "outbox")]
    outbox_alike!();
    #[cfg(feature = "outbox")]
    json_batches!();

    #[cfg(feature = "outbox")]
    const ONE_WRITER: bool = true;

    #[cfg(feature = "outbox")]
    async fn insert(
        conn: &mut SqliteConnection,
        message: &Message,
        now: Millis,
        handed: Option<Handed>,
    ) -> Result<Option<MessageId>, sqlx::Error> {
        // The single writer already orders the ids of one key as their transactions commit.
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

    // Probed first, unless the previous claim found all it asked for: an UPDATE takes the
    // write lock even when it matches nothing. Then `HOLD` leases the first due messages that
    // are not sent now, and `BEGIN` those that are, up to what is left of the limit.
    #[cfg(feature = "outbox")]
    async fn claim_due(
        pool: &Pool<Self>,
        clock: &Clock,
        claim: Claim,
        topics: &Topics,
    ) -> (Claim, Result<Vec<ClaimedMessage>, sqlx::Error>) {
        claiming(pool, clock, claim, |mut conn, claim| async move {
            let skipped = topics.skipped_json()?;
            let only = topics.only();
            // Past paused topics' backlogs by the topic index, and a backlog's claims too, so
            // that the topics take turns; the due index otherwise.
            let skipping =
                !topics.skipped().is_empty() || (!claim.probe && topics.only().is_none());
            let (probe, hold, begin) = if skipping {
                (
                    outbox_sql::CLAIM_PROBE_SKIPPING,
                    outbox_sql::CLAIM_HOLD_SKIPPING,
                    outbox_sql::CLAIM_BEGIN_SKIPPING,
                )
            } else {
                (
                    outbox_sql::CLAIM_PROBE,
                    outbox_sql::CLAIM_HOLD,
                    outbox_sql::CLAIM_BEGIN,
                )
            };
            if claim.probe {
                let query = sqlx::query_scalar(probe)
                    .bind(claim.now.column())
                    .bind(skipped.as_str());
                let query = if skipping { query } else { query.bind(only) };
                let due: bool = query.fetch_one(&mut *conn).await?;
                if !due {
                    return Ok(Vec::new());
                }
            }
            let update = |sql, limit: i64| {
                let query = sqlx::query(sql)
                    .bind(claim.lease_until.column())
                    .bind(claim.token)
                    .bind(claim.now.column())
                    .bind(limit)
                    .bind(claim.max_attempts)
                    .bind(skipped.as_str());
                if skipping { query } else { query.bind(only) }
            };
            let mut claimed = Vec::new();
            for row in update(hold, claim.limit).fetch_all(&mut *conn).await? {
                claimed.push(ClaimedMessage {
                    record: outbox_record(&row)?,
                    attempt_begun: false,
                });
            }
            let left = claim.limit.saturating_sub(claimed.len() as i64);
            if left > 0 {
                for row in update(begin, left).fetch_all(&mut *conn).await? {
                    claimed.push(ClaimedMessage {
                        record: outbox_record(&row)?,
                        attempt_begun: true,
                    });
                }
            }
            Ok(claimed)
        })
        .await
    }
}

const SCHEMA: migrate::Schema<Sqlite> = migrate::Schema {
    versions_table: "idempotency_schema_versions",
    scripts: &[(1, include_str!("../../../migrations/sqlite/0001_store.sql"))],
    // The write lock taken up front serialises concurrent migrators.
    begin: "BEGIN IMMEDIATE",
    lock: None,
    unlock: None,
    lock_granted: |_| true,
    record: "INSERT INTO idempotency_schema_versions (version, applied_at) VALUES (?1, ?2)",
};
const VERSIONS_TABLE_EXISTS: &str = "SELECT COUNT(*) FROM sqlite_master \
        WHERE type = 'table' AND name = 'idempotency_schema_versions'";
const FIND: &str = "SELECT state, fingerprint, status, headers, body, created_at, expires_at, lease_expires_at \
        FROM idempotency_records WHERE key_digest = ?1";
const PURGE: &str = "DELETE FROM idempotency_records WHERE key_digest IN \
        (SELECT key_digest FROM idempotency_records WHERE expires_at <= ?1 LIMIT ?2)";

const RENEW_LEASE: &str = "UPDATE idempotency_records SET lease_expires_at = ?1 \
        WHERE key_digest = ?2 AND lease_owner = ?3 AND state = 'processing'";
const TAKE_OVER_LEASE: &str = "UPDATE idempotency_records SET lease_owner = ?1, lease_expires_at = ?2 \
        WHERE key_digest = ?3 AND state = 'processing' AND lease_expires_at <= ?4";
const FINISH_LEASED: &str = "UPDATE idempotency_records \
        SET state = ?1, status = ?2, headers = ?3, body = ?4, lease_owner = NULL, lease_expires_at = NULL \
        WHERE key_digest = ?5 AND lease_owner = ?6";
const RELEASE_LEASE: &str = "DELETE FROM idempotency_records \
        WHERE key_digest = ?1 AND lease_owner = ?2 AND state = 'processing'";
const FORGET: &str = "DELETE FROM idempotency_records WHERE key_digest = ?1";
const PURGE_KEYS: &str = "DELETE FROM idempotency_inbox WHERE key_digest IN \
        (SELECT key_digest FROM idempotency_inbox WHERE expires_at <= ?1 LIMIT ?2)";
const KEY_HELD: &str = "SELECT 1 FROM idempotency_inbox WHERE key_digest = ?1 AND expires_at > ?2";

/// Whether the error means "a lock wait ran out": SQLITE_BUSY and SQLITE_LOCKED, with their
/// extended codes.
fn is_busy(error: &dyn DatabaseError) -> bool {
    error
        .code()
        .and_then(|code| code.parse::<i32>().ok())
        .is_some_and(|code| matches!(code & 0xff, 5 | 6))
}

/// SQLite, one writer at a time, aborts no transaction on a conflict, and its migrators queue
/// on the write lock.
fn no_conflict(_error: &dyn DatabaseError) -> bool {
    false
}

/// Whether a migration failed because another migrator did the same work at the same time.
fn migration_raced(error: &dyn DatabaseError) -> bool {
    no_conflict(error)
}

/// The crate's error for a database error.
fn classify(error: sqlx::Error) -> Error {
    super::classify(error, is_busy, no_conflict)
}
