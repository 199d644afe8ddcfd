//! MySQL and MariaDB (InnoDB): for teams whose database is already one of them.

use std::time::Duration;

use sqlx::error::DatabaseError;
use sqlx::mysql::{MySqlDatabaseError, MySqlRow};
use sqlx::{MySql, Row};

use super::literal::Syntax;
use super::protocol::{NewRecord, PurgePace};
use super::sql::{Dialect, FinishForm, finish_text, record_literals};
use crate::record::{RecordState, StoredResponse};
use crate::scope::ScopedKey;

impl super::Records for MySql {
    type Protocol = super::sql::SqlStore<MySql>;
}

/// InnoDB's "lock wait timeout exceeded".
const LOCK_WAIT_TIMEOUT: u16 = 1205;

/// InnoDB's "deadlock found", and "record has changed since last read" (MariaDB with
/// `innodb_snapshot_isolation`, the analogue of a serialization failure): the transaction was
/// rolled back.
const CONFLICT_ERRORS: [u16; 2] = [1213, 1020];

/// The largest `innodb_lock_wait_timeout` the server accepts, in seconds.
const MAX_LOCK_WAIT_SECS: u64 = 1_073_741_824;

/// What the claim procedure signals when a live record holds the key.
const TAKEN: &str = "45I01";

/// `innodb_lock_wait_timeout` for a bound: whole seconds only, and 0 is not accepted, so it is
/// rounded up and no duplicate gives up early.
fn lock_wait_secs(lock_wait: Duration) -> u64 {
    let secs = lock_wait
        .as_millis()
        .div_ceil(1000)
        .clamp(1, u128::from(MAX_LOCK_WAIT_SECS));
    // Clamped to a u64 just above.
    u64::try_from(secs).unwrap_or(MAX_LOCK_WAIT_SECS)
}

impl Dialect for MySql {
    const MIGRATIONS: &'static [(i64, &'static str)] = &[
        (1, include_str!("../../migrations/mysql/0001_records.sql")),
        (2, include_str!("../../migrations/mysql/0002_claim.sql")),
    ];
    const MIGRATION_BEGIN: &'static str = "BEGIN";
    // DDL commits implicitly, so the transaction cannot serialise two instances migrating at
    // once; a named lock held by the session can. Lock names are server-wide, so the name
    // carries the database (hashed: names stop at 64 characters), and apps on other databases
    // of the same server do not queue behind each other. MariaDB has no "wait forever" (a
    // negative timeout returns NULL at once), so the wait is an hour, after which migrate fails.
    const MIGRATION_LOCK: Option<&'static str> =
        Some("SELECT GET_LOCK(CONCAT('axum_idempotency.migrate:', MD5(DATABASE())), 3600)");
    const MIGRATION_UNLOCK: Option<&'static str> =
        Some("DO RELEASE_LOCK(CONCAT('axum_idempotency.migrate:', MD5(DATABASE())))");
    const MIGRATION_RECORD: &'static str =
        "INSERT INTO idempotency_schema_versions (version, applied_at) VALUES (?, ?)";
    const VERSIONS_TABLE_EXISTS: &'static str = "SELECT COUNT(*) FROM information_schema.tables \
        WHERE table_schema = DATABASE() AND table_name = 'idempotency_schema_versions'";
    // ON DUPLICATE KEY UPDATE rather than INSERT IGNORE: it replaces an expired record in the
    // same statement, under the row's exclusive lock, so duplicates queue behind an in-flight
    // claim. INSERT IGNORE takes a shared lock, so two duplicates of an expired record that
    // both go on to replace it deadlock on the upgrade; and IGNORE turns unrelated errors
    // (a value too long, say) into warnings. Either way, when an in-flight original rolls
    // back, InnoDB turns its waiters' locks into gap locks and waiters that then insert may
    // deadlock: `is_busy` makes the victims answer 409, and their retry replays.
    //
    // The affected-rows count cannot tell a claim from a live record: sqlx connects with
    // CLIENT_FOUND_ROWS, so an insert counts 1, a replaced row 2, and a row left as it was 1
    // as well (it would be 0 without the flag). Leaving a live record alone therefore also
    // sets LAST_INSERT_ID, which the OK packet reports and which is 0 otherwise on a table
    // without AUTO_INCREMENT: that is what `claimed` reads.
    //
    // Every column tests the old expires_at, so expires_at is assigned last. VALUES() is
    // deprecated since MySQL 8.0.20 in favour of a row alias, which MariaDB lacks.
    const CLAIM: &'static str = "INSERT INTO idempotency_records \
        (key_digest, principal, method, route, fingerprint, state, status, headers, body, created_at, expires_at, lease_owner, lease_expires_at) \
        VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) \
        ON DUPLICATE KEY UPDATE \
        principal = IF(expires_at <= VALUES(created_at), VALUES(principal), principal), \
        method = IF(expires_at <= VALUES(created_at), VALUES(method), method), \
        route = IF(expires_at <= VALUES(created_at), VALUES(route), route), \
        fingerprint = IF(expires_at <= VALUES(created_at), VALUES(fingerprint), fingerprint), \
        state = IF(expires_at <= VALUES(created_at), VALUES(state), state), \
        status = IF(expires_at <= VALUES(created_at), VALUES(status), status), \
        headers = IF(expires_at <= VALUES(created_at), VALUES(headers), headers), \
        body = IF(expires_at <= VALUES(created_at), VALUES(body), body), \
        created_at = IF(expires_at <= VALUES(created_at), VALUES(created_at), created_at), \
        lease_owner = IF(expires_at <= VALUES(created_at), VALUES(lease_owner), lease_owner), \
        lease_expires_at = IF(expires_at <= VALUES(created_at), VALUES(lease_expires_at), lease_expires_at), \
        expires_at = IF(expires_at <= VALUES(created_at), VALUES(expires_at), LAST_INSERT_ID(expires_at))";
    // Restores the setting saved by `begin_statement`: a session variable outlives the
    // transaction, unlike PostgreSQL's transaction-local one.
    const LIFT_LOCK_WAIT: Option<&'static str> =
        Some("SET SESSION innodb_lock_wait_timeout = @axum_idempotency_lock_wait");
    const FIND: &'static str = "SELECT state, fingerprint, status, headers, body, created_at, expires_at, lease_expires_at \
        FROM idempotency_records WHERE key_digest = ?";
    const FINISH: &'static str = "UPDATE idempotency_records \
        SET state = ?, status = ?, headers = ?, body = ? WHERE key_digest = ?";
    // A claim that replaced an expired record while this waited for the row moved its
    // expires_at index entry out of range, so the replacement survives without a re-check.
    const PURGE: &'static str =
        "DELETE FROM idempotency_records WHERE expires_at <= ? ORDER BY expires_at LIMIT ?";
    // InnoDB finishes a delete after the statement returns: its purge threads remove the
    // delete-marked rows and index entries in the background, beside the requests. Smaller
    // batches and a longer rest leave room for that work.
    const PURGE_PACE: PurgePace = PurgePace {
        batch: 250,
        rest: 2,
    };

    // sqlx's CLIENT_FOUND_ROWS makes an UPDATE count the rows it matched, changed or not, so a
    // renewal to the same expiry still reports its one row.
    const RENEW_LEASE: &'static str = "UPDATE idempotency_records SET lease_expires_at = ? \
        WHERE key_digest = ? AND lease_owner = ? AND state = 'processing'";
    const FORGET: &'static str = "DELETE FROM idempotency_records WHERE key_digest = ?";
    const TAKE_OVER_LEASE: &'static str = "UPDATE idempotency_records SET lease_owner = ?, lease_expires_at = ? \
        WHERE key_digest = ? AND state = 'processing' AND lease_expires_at <= ?";
    const FINISH_LEASED: &'static str = "UPDATE idempotency_records \
        SET state = ?, status = ?, headers = ?, body = ?, lease_owner = NULL, lease_expires_at = NULL \
        WHERE key_digest = ? AND lease_owner = ?";
    const RELEASE_LEASE: &'static str = "DELETE FROM idempotency_records \
        WHERE key_digest = ? AND lease_owner = ? AND state = 'processing'";

    fn begin_statement(lock_wait: Duration) -> Option<String> {
        let secs = lock_wait_secs(lock_wait);
        Some(format!(
            "SET @axum_idempotency_lock_wait = @@SESSION.innodb_lock_wait_timeout; \
             SET SESSION innodb_lock_wait_timeout = {secs}; BEGIN"
        ))
    }

    // The procedure (schema version 2) begins the transaction, claims, and either returns with
    // the key held or rolls back and signals: nothing is left open when the key is not ours.
    fn fused_claim(record: &NewRecord<'_>, lock_wait: Duration) -> Option<String> {
        let values = record_literals(record, Syntax::MySql)?;
        Some(format!(
            "CALL axum_idempotency_claim_v1({}, {})",
            values.as_str(),
            lock_wait_secs(lock_wait)
        ))
    }

    fn fused_taken(error: &dyn DatabaseError) -> bool {
        error.code().as_deref() == Some(TAKEN)
    }

    // No `BEGIN` follows: a `ROLLBACK` with no transaction open is silent on MySQL. The one the
    // dropped `Transaction` queues still costs an exchange of its own, because sqlx's MySQL
    // driver waits for its answer before the pool's release ping; it is sent after the response
    // is committed, off the request's path.
    fn fused_finish(
        key: &ScopedKey,
        state: RecordState,
        response: &StoredResponse,
    ) -> Option<String> {
        finish_text(
            key,
            state,
            response,
            Syntax::MySql,
            FinishForm::Update,
            "; COMMIT",
        )
    }

    fn migration_locked(row: &MySqlRow) -> bool {
        // 1 granted, 0 timed out, NULL failed.
        matches!(row.try_get::<Option<i64>, _>(0), Ok(Some(1)))
    }

    fn rows_affected(result: &Self::QueryResult) -> u64 {
        result.rows_affected()
    }

    fn claimed(result: &Self::QueryResult) -> bool {
        result.rows_affected() > 0 && result.last_insert_id() == 0
    }

    fn is_busy(error: &dyn DatabaseError) -> bool {
        error
            .try_downcast_ref::<MySqlDatabaseError>()
            .is_some_and(|error| error.number() == LOCK_WAIT_TIMEOUT)
    }

    fn is_conflict(error: &dyn DatabaseError) -> bool {
        error
            .try_downcast_ref::<MySqlDatabaseError>()
            .is_some_and(|error| CONFLICT_ERRORS.contains(&error.number()))
    }
}
