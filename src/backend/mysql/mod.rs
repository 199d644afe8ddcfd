//! MySQL and MariaDB (InnoDB): for teams whose database is already one of them.
//!
//! A claim is always a call of the schema's procedure `axum_idempotency_claim_v1`, the one place
//! its statements are written. The procedure begins the transaction, sets the session's
//! `innodb_lock_wait_timeout` to the claim's bound, claims with a plain `INSERT` (looking at the
//! key's row only when there is one: a live record refuses the claim, an expired one is replaced),
//! restores the setting, and either returns with the key held or rolls back and signals: nothing is
//! left open when the key is not ours.

use std::time::Duration;

use sqlx::error::DatabaseError;
use sqlx::mysql::{MySqlConnection, MySqlDatabaseError, MySqlRow};
use sqlx::{AssertSqlSafe, MySql, Pool, Row, Transaction};

use super::claim::fused_then_rounds;
use super::literal::{Statement, Syntax};
use super::migrate::{self, runner};
#[cfg(feature = "outbox")]
use super::outbox::{
    Claim, ClaimedMessage, Handed, Lease, Settlement, Topics, claiming, outbox_alike,
    outbox_decoder,
};
use super::{Claimed, PurgePace, Storage, alike, bound, identity_values, lifetime_values};
#[cfg(feature = "outbox")]
use crate::clock::Clock;
use crate::clock::Millis;
use crate::error::Error;
#[cfg(feature = "outbox")]
use crate::message::{Message, MessageId, OutboxRecord};
use crate::record::{NewRecord, StoredResponse};
use crate::scope::ScopedKey;

bound!(MySql);
runner!(MySql);
#[cfg(feature = "outbox")]
outbox_decoder!(MySql);

#[cfg(feature = "outbox")]
mod outbox_sql;

/// InnoDB's "lock wait timeout exceeded".
const LOCK_WAIT_TIMEOUT: u16 = 1205;

/// InnoDB's "deadlock found", and "record has changed since last read" (MariaDB with
/// `innodb_snapshot_isolation`, the analogue of a serialization failure): the transaction was
/// rolled back.
const CONFLICT_ERRORS: [u16; 2] = [1213, 1020];

/// "PROCEDURE … already exists": another migrator created the claim procedure between this
/// one's `DROP PROCEDURE IF EXISTS` and its `CREATE PROCEDURE`.
const PROCEDURE_EXISTS: u16 = 1304;

/// The largest `innodb_lock_wait_timeout` the server accepts, in seconds.
const MAX_LOCK_WAIT_SECS: i64 = 1_073_741_824;

/// What the claim procedure signals when a live record holds the key.
const TAKEN: &str = "45I01";

/// `innodb_lock_wait_timeout` for a bound: whole seconds only, and 0 is not accepted, so it is
/// rounded up and no duplicate gives up early.
pub(crate) fn lock_wait_secs(lock_wait: Duration) -> i64 {
    let secs = lock_wait.as_millis().div_ceil(1000);
    i64::try_from(secs).map_or(MAX_LOCK_WAIT_SECS, |secs| secs.clamp(1, MAX_LOCK_WAIT_SECS))
}

/// Whether the claim failed because a live record holds the key.
fn taken(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(error) if error.code().as_deref() == Some(TAKEN))
}

/// The claim: a call of the schema's claim procedure with the key, the scope, the fingerprint,
/// the times, the lease and the lock-wait bound. The record's state and response are not part
/// of it: the claim writes the row in flight, and [`record_update`] completes it. So the call
/// stays small whatever the response, and is always written out.
fn claim_call<'a>(record: &'a NewRecord<'a>, lock_wait: Duration) -> AssertSqlSafe<String> {
    let mut call = Statement::new(Syntax::MySql);
    call.sql("CALL axum_idempotency_claim_v1(");
    identity_values(&mut call, record);
    lifetime_values(&mut call, record)
        .int8(lock_wait_secs(lock_wait))
        .sql(")");
    call.inline("", "")
}

/// The record's outcome written into the row its claim inserted.
fn record_update<'a>(record: &'a NewRecord<'a>) -> Statement<'a> {
    let response = record.response;
    let mut update = Statement::new(Syntax::MySql);
    update
        .sql("UPDATE idempotency_records SET state = ")
        .text(record.state.as_str())
        .sql(", status = ")
        .opt_int4(response.map(|response| i32::from(response.status.as_u16())))
        .sql(", headers = ")
        .opt_bytes(response.map(StoredResponse::encode_headers))
        .sql(", body = ")
        .opt_bytes(response.map(|response| &response.body[..]))
        .sql(" WHERE key_digest = ")
        .bytes(&record.key.digest()[..]);
    update
}

/// Begins a transaction that already holds the claim on `record`'s key: the procedure's call is
/// the statement that begins it. `None`, with nothing left open, when a live record holds the
/// key.
pub(crate) async fn begin_claimed<'a>(
    pool: &'a Pool<MySql>,
    record: &'a NewRecord<'a>,
    lock_wait: Duration,
) -> Result<Option<Transaction<'static, MySql>>, Error> {
    match pool.begin_with(claim_call(record, lock_wait)).await {
        Ok(tx) => Ok(Some(tx)),
        Err(error) if taken(&error) => Ok(None),
        Err(error) => Err(classify(error)),
    }
}

impl Storage for MySql {
    alike!();

    // InnoDB finishes a delete after the statement returns: its purge threads remove the
    // delete-marked rows and index entries in the background, beside the requests. Smaller
    // batches and a longer rest leave room for that work.
    const PURGE_PACE: PurgePace = PurgePace {
        batch: 250,
        rest: 2,
    };

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

    // A claim is the first statement of its transaction, so the procedure's own
    // `START TRANSACTION` commits an empty one and goes on in its place. When the key is taken
    // the procedure has rolled back: the caller reads the winner's record outside a
    // transaction, and the `ROLLBACK` its dropped `Transaction` sends is silent.
    async fn claim_in<'a>(
        conn: &'a mut MySqlConnection,
        record: &'a NewRecord<'a>,
        lock_wait: Duration,
    ) -> Result<bool, Error> {
        match sqlx::raw_sql(claim_call(record, lock_wait))
            .execute(conn)
            .await
        {
            Ok(_) => Ok(true),
            Err(error) if taken(&error) => Ok(false),
            Err(error) => Err(classify(error)),
        }
    }

    // Here the claim's row is the key's lock: a session lock such as `GET_LOCK` holds on one
    // node of a Galera cluster only, and a locking read of an absent row takes a gap lock that
    // concurrent claimers all get, then deadlock on. So the row is written twice, as the claim
    // and with the outcome.
    //
    // The record and the `COMMIT` go as two commands, never as one multi-statement query. On
    // a Galera cluster a transaction aborted for a replicated one must fail its `COMMIT`;
    // sent in one query with the record's `UPDATE`, that `COMMIT` was sometimes answered OK
    // for a transaction the cluster had rolled back (MariaDB 10.11, galera-4: about one
    // contended storm in a hundred), and the client got an answer whose writes were gone.
    // Sent apart, the abort is reported (1213) and the request runs again.
    async fn commit_record<'a>(
        mut tx: Transaction<'static, Self>,
        record: &'a NewRecord<'a>,
    ) -> Result<(), Error> {
        // A statement of its own, so it is prepared once per connection and sent with its
        // values bound: the server does not parse it again, and no value is written out.
        bound(&record_update(record))
            .execute(&mut *tx)
            .await
            .map_err(classify)?;
        tx.commit().await.map_err(classify)
    }

    async fn claim_key<'a>(
        pool: &'a Pool<Self>,
        key: &'a ScopedKey,
        now: Millis,
        expires_at: Millis,
        lock_wait: Duration,
    ) -> Result<Option<Transaction<'static, Self>>, Error> {
        let mut tx = pool.begin().await.map_err(classify)?;
        if Self::claim_key_in(&mut tx, key, now, expires_at, lock_wait).await? {
            return Ok(Some(tx));
        }
        tx.rollback().await.map_err(classify)?;
        Ok(None)
    }

    // The wait for a concurrent claimer is the insert's wait for the key's row, bounded by the
    // session's `innodb_lock_wait_timeout`, set for the claim alone and restored whatever its
    // outcome, before the handler runs.
    async fn claim_key_in<'a>(
        conn: &'a mut MySqlConnection,
        key: &'a ScopedKey,
        now: Millis,
        expires_at: Millis,
        lock_wait: Duration,
    ) -> Result<bool, Error> {
        sqlx::raw_sql(AssertSqlSafe(format!(
            "SET @axum_idempotency_wait = @@SESSION.innodb_lock_wait_timeout, \
             SESSION innodb_lock_wait_timeout = {}",
            lock_wait_secs(lock_wait)
        )))
        .execute(&mut *conn)
        .await
        .map_err(classify)?;
        let claimed = insert_key(conn, key, now, expires_at).await;
        sqlx::raw_sql("SET SESSION innodb_lock_wait_timeout = @axum_idempotency_wait")
            .execute(&mut *conn)
            .await
            .map_err(classify)?;
        claimed
    }

    #[cfg(feature = "outbox")]
    outbox_alike!();

    #[cfg(feature = "outbox")]
    async fn insert(
        conn: &mut MySqlConnection,
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
        // A duplicate key only undoes this statement in InnoDB, not the caller's transaction.
        let inserted = sqlx::query(outbox_sql::INSERT)
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
            .execute(conn)
            .await;
        match inserted {
            Ok(done) => i64::try_from(done.last_insert_id())
                .map(|id| Some(MessageId::from(id)))
                .map_err(|e| sqlx::Error::Decode(format!("outbox id out of range: {e}").into())),
            Err(sqlx::Error::Database(e)) if e.is_unique_violation() => Ok(None),
            Err(e) => Err(e),
        }
    }

    // Without `UPDATE … RETURNING`: in one transaction, lock the due rows, then lease each,
    // beginning the attempts of those sent now.
    #[cfg(feature = "outbox")]
    async fn claim_due(
        pool: &Pool<Self>,
        clock: &Clock,
        claim: Claim,
        topics: &Topics,
    ) -> (Claim, Result<Vec<ClaimedMessage>, sqlx::Error>) {
        claiming(pool, clock, claim, |mut conn, claim| async move {
            let mut tx = sqlx::Connection::begin(&mut *conn).await?;
            let due = match topics {
                Topics::Except(skipped) if skipped.is_empty() && claim.probe => {
                    due_locked(&mut tx, &claim, None).await?
                }
                // Past paused topics' backlogs, and a backlog's claims too, the topics taking
                // turns: each one's first due message, then each one's second, and so on. A
                // destination's backlog (a broker back after an outage) then delays the other
                // topics' new messages by one claim, not by the whole backlog, though it is
                // older.
                Topics::Except(skipped) => {
                    let mut due = Vec::new();
                    for topic in pending_topics(&mut tx).await? {
                        if !skipped.contains(&topic) {
                            let of_topic = due_locked(&mut tx, &claim, Some(&topic)).await?;
                            due.extend(
                                of_topic
                                    .into_iter()
                                    .filter(|record| !skipped.contains(&record.topic))
                                    .enumerate(),
                            );
                        }
                    }
                    due.sort_by_key(|(turn, record)| (*turn, record.next_attempt_at, record.id));
                    due.truncate(usize::try_from(claim.limit).unwrap_or(usize::MAX));
                    due.into_iter().map(|(_, record)| record).collect()
                }
                Topics::Only(topic) => {
                    let mut due = due_locked(&mut tx, &claim, Some(topic)).await?;
                    due.retain(|record| record.topic == *topic);
                    due
                }
            };
            let mut claimed = Vec::with_capacity(due.len());
            for record in due {
                claimed.push(lease_locked(&mut tx, record, &claim).await?);
            }
            tx.commit().await?;
            Ok(claimed)
        })
        .await
    }

    #[cfg(feature = "outbox")]
    async fn renew_leases(
        pool: &Pool<Self>,
        leases: &[Lease],
        until: Millis,
    ) -> Result<Vec<MessageId>, sqlx::Error> {
        per_lease(pool, outbox_sql::RENEW_LEASES, leases, Some(until)).await
    }

    #[cfg(feature = "outbox")]
    async fn release_unsent(
        pool: &Pool<Self>,
        leases: &[Lease],
    ) -> Result<Vec<MessageId>, sqlx::Error> {
        per_lease(pool, outbox_sql::RELEASE_UNSENT, leases, None).await
    }

    // Without `UPDATE … RETURNING`, a batch could only say how many leases held, not which;
    // one statement per lease counts the rows it matched (CLIENT_FOUND_ROWS), 1 exactly when
    // the lease was still ours.
    #[cfg(feature = "outbox")]
    async fn settle(
        conn: &mut MySqlConnection,
        outcomes: &[(Lease, Settlement)],
    ) -> Result<Vec<MessageId>, sqlx::Error> {
        if outcomes.is_empty() {
            return Ok(Vec::new());
        }
        // One statement per message, committed once; a savepoint inside a caller's transaction.
        let mut tx = sqlx::Connection::begin(conn).await?;
        let mut settled = Vec::with_capacity(outcomes.len());
        for (lease, settlement) in outcomes {
            let done = sqlx::query(outbox_sql::SETTLE)
                .bind(settlement.status.as_str())
                .bind(settlement.receipt.as_deref())
                .bind(settlement.last_error.as_deref())
                .bind(i64::from(settlement.attempts))
                .bind(settlement.outcome_unknown)
                .bind(settlement.next_attempt_at.column())
                .bind(settlement.finished_at.map(Millis::column))
                .bind(settlement.last_attempt_at.map(Millis::column))
                .bind(lease.id.get())
                .bind(lease.token)
                .execute(&mut *tx)
                .await?;
            if done.rows_affected() == 1 {
                settled.push(lease.id);
            }
        }
        tx.commit().await?;
        Ok(settled)
    }
}

/// Inserts a dedupe key's row in `tx`, or replaces the key's row if it expired by `now`; `false`
/// when a live row holds the key. The plain insert comes first, as for a record's claim, so a
/// new key costs no look at an existing row; a duplicate-key error leaves the transaction open.
async fn insert_key(
    tx: &mut MySqlConnection,
    key: &ScopedKey,
    now: Millis,
    expires_at: Millis,
) -> Result<bool, Error> {
    let inserted =
        sqlx::query("INSERT INTO idempotency_inbox (key_digest, expires_at) VALUES (?, ?)")
            .bind(&key.digest()[..])
            .bind(expires_at.column())
            .execute(&mut *tx)
            .await;
    match inserted {
        Ok(_) => Ok(true),
        Err(sqlx::Error::Database(error)) if error.is_unique_violation() => {
            // CLIENT_FOUND_ROWS: the row counts when it matched, so one means it had expired.
            let replaced = sqlx::query(
                "UPDATE idempotency_inbox SET expires_at = ? WHERE key_digest = ? AND expires_at <= ?",
            )
            .bind(expires_at.column())
            .bind(&key.digest()[..])
            .bind(now.column())
            .execute(tx)
            .await
            .map_err(classify)?;
            Ok(replaced.rows_affected() == 1)
        }
        Err(error) => Err(classify(error)),
    }
}

/// Whether the row `GET_LOCK` returned says the migration lock was granted: 1 granted, 0 timed
/// out, NULL failed.
fn migration_locked(row: &MySqlRow) -> bool {
    matches!(row.try_get::<Option<i64>, _>(0), Ok(Some(1)))
}

const SCHEMA: migrate::Schema<MySql> = migrate::Schema {
    versions_table: "idempotency_schema_versions",
    scripts: &[(1, include_str!("../../../migrations/mysql/0001_store.sql"))],
    begin: "BEGIN",
    // DDL commits implicitly, so the transaction cannot serialise two instances migrating
    // at once; a named lock held by the session can. Lock names are server-wide, so the
    // name carries the database (hashed: names stop at 64 characters), and apps on other
    // databases of the same server do not queue behind each other. MariaDB has no "wait
    // forever" (a negative timeout returns NULL at once), so the wait is an hour, after
    // which migrate fails.
    lock: Some("SELECT GET_LOCK(CONCAT('axum_idempotency.migrate:', MD5(DATABASE())), 3600)"),
    unlock: Some("DO RELEASE_LOCK(CONCAT('axum_idempotency.migrate:', MD5(DATABASE())))"),
    lock_granted: migration_locked,
    record: "INSERT INTO idempotency_schema_versions (version, applied_at) VALUES (?, ?)",
};
const VERSIONS_TABLE_EXISTS: &str = "SELECT COUNT(*) FROM information_schema.tables \
        WHERE table_schema = DATABASE() AND table_name = 'idempotency_schema_versions'";
const FIND: &str = "SELECT state, fingerprint, status, headers, body, created_at, expires_at, lease_expires_at \
        FROM idempotency_records WHERE key_digest = ?";
// A claim that replaced an expired record while this waited for the row moved its
// expires_at index entry out of range, so the replacement survives without a re-check.
const PURGE: &str =
    "DELETE FROM idempotency_records WHERE expires_at <= ? ORDER BY expires_at LIMIT ?";

// sqlx's CLIENT_FOUND_ROWS makes an UPDATE count the rows it matched, changed or not, so a
// renewal to the same expiry still reports its one row.
const RENEW_LEASE: &str = "UPDATE idempotency_records SET lease_expires_at = ? \
        WHERE key_digest = ? AND lease_owner = ? AND state = 'processing'";
const FORGET: &str = "DELETE FROM idempotency_records WHERE key_digest = ?";
const PURGE_KEYS: &str =
    "DELETE FROM idempotency_inbox WHERE expires_at <= ? ORDER BY expires_at LIMIT ?";
const KEY_HELD: &str = "SELECT 1 FROM idempotency_inbox WHERE key_digest = ? AND expires_at > ?";
const TAKE_OVER_LEASE: &str = "UPDATE idempotency_records SET lease_owner = ?, lease_expires_at = ? \
        WHERE key_digest = ? AND state = 'processing' AND lease_expires_at <= ?";
const FINISH_LEASED: &str = "UPDATE idempotency_records \
        SET state = ?, status = ?, headers = ?, body = ?, lease_owner = NULL, lease_expires_at = NULL \
        WHERE key_digest = ? AND lease_owner = ?";
const RELEASE_LEASE: &str = "DELETE FROM idempotency_records \
        WHERE key_digest = ? AND lease_owner = ? AND state = 'processing'";

/// Whether the error means "a lock wait ran out".
fn is_busy(error: &dyn DatabaseError) -> bool {
    error
        .try_downcast_ref::<MySqlDatabaseError>()
        .is_some_and(|error| error.number() == LOCK_WAIT_TIMEOUT)
}

/// Whether the database rolled the transaction back to resolve a deadlock or a conflict.
pub(super) fn is_conflict(error: &dyn DatabaseError) -> bool {
    error
        .try_downcast_ref::<MySqlDatabaseError>()
        .is_some_and(|error| CONFLICT_ERRORS.contains(&error.number()))
}

/// Whether a migration failed because another migrator did the same work at the same time: a
/// conflict, or the claim procedure created by another migrator between this one's
/// `DROP PROCEDURE IF EXISTS` and its `CREATE PROCEDURE`.
fn migration_raced(error: &dyn DatabaseError) -> bool {
    is_conflict(error)
        || error
            .try_downcast_ref::<MySqlDatabaseError>()
            .is_some_and(|error| error.number() == PROCEDURE_EXISTS)
}

/// The crate's error for a database error.
pub(crate) fn classify(error: sqlx::Error) -> Error {
    super::classify(error, is_busy, is_conflict)
}

/// Locks the first due messages `claim` may take, of `topic` alone where given. Rows locked
/// and then not leased are released with the claim's transaction.
#[cfg(feature = "outbox")]
async fn due_locked(
    tx: &mut MySqlConnection,
    claim: &Claim,
    topic: Option<&str>,
) -> Result<Vec<OutboxRecord>, sqlx::Error> {
    let query = match topic {
        Some(topic) => sqlx::query(outbox_sql::CLAIM_SELECT_TOPIC).bind(topic),
        None => sqlx::query(outbox_sql::CLAIM_SELECT),
    };
    let rows = query
        .bind(claim.now.column())
        .bind(claim.now.column())
        .bind(claim.limit)
        .fetch_all(tx)
        .await?;
    rows.iter().map(outbox_record).collect()
}

/// The topics that have pending messages, in order, one index probe each.
#[cfg(feature = "outbox")]
async fn pending_topics(tx: &mut MySqlConnection) -> Result<Vec<String>, sqlx::Error> {
    let mut topics: Vec<String> = Vec::new();
    loop {
        let next = match topics.last() {
            Some(last) => sqlx::query_scalar(outbox_sql::NEXT_PENDING_TOPIC).bind(last.as_str()),
            None => sqlx::query_scalar(outbox_sql::FIRST_PENDING_TOPIC),
        };
        match next.fetch_optional(&mut *tx).await? {
            Some(topic) => topics.push(topic),
            None => return Ok(topics),
        }
    }
}

/// Leases `record`, a due message `claim` locked in `tx`: begins its attempt if it is sent
/// now, else only holds it.
#[cfg(feature = "outbox")]
async fn lease_locked(
    tx: &mut MySqlConnection,
    mut record: OutboxRecord,
    claim: &Claim,
) -> Result<ClaimedMessage, sqlx::Error> {
    let attempt_begun = claim.begins(&record);
    let lease = if attempt_begun {
        sqlx::query(outbox_sql::CLAIM_BEGIN)
            .bind(claim.lease_until.column())
            .bind(claim.token)
            .bind(claim.now.column())
    } else {
        sqlx::query(outbox_sql::CLAIM_HOLD)
            .bind(claim.lease_until.column())
            .bind(claim.token)
    };
    lease.bind(record.id.get()).execute(tx).await?;
    if attempt_begun {
        // What `CLAIM_BEGIN` wrote, so the record matches the row.
        record.attempts += 1;
        record.outcome_unknown = true;
        record.last_attempt_at = Some(claim.now.into());
    }
    Ok(ClaimedMessage {
        record,
        attempt_begun,
    })
}

/// Runs `sql` on each of `leases` (binding `until` first, when given, as a renewal does), all
/// in one transaction, and answers the ids whose lease was still held: one matched row.
#[cfg(feature = "outbox")]
async fn per_lease(
    pool: &Pool<MySql>,
    sql: &'static str,
    leases: &[Lease],
    until: Option<Millis>,
) -> Result<Vec<MessageId>, sqlx::Error> {
    if leases.is_empty() {
        return Ok(Vec::new());
    }
    let mut tx = pool.begin().await?;
    let mut held = Vec::with_capacity(leases.len());
    for lease in leases {
        let mut query = sqlx::query(sql);
        if let Some(until) = until {
            query = query.bind(until.column());
        }
        let done = query
            .bind(lease.id.get())
            .bind(lease.token)
            .execute(&mut *tx)
            .await?;
        if done.rows_affected() == 1 {
            held.push(lease.id);
        }
    }
    tx.commit().await?;
    Ok(held)
}
