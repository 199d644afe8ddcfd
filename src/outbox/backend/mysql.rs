//! MySQL and MariaDB (10.6+ for `SKIP LOCKED`): like PostgreSQL, concurrent dispatchers skip
//! each other's locked rows. Without `UPDATE … RETURNING`, a claim reads the due rows with
//! `FOR UPDATE SKIP LOCKED` and leases them in the same short transaction.

use sqlx::mysql::MySqlQueryResult;
use sqlx::{MySql, Pool};

use super::private::{ClaimSql, Dialect, NewId};
use super::{Backend, record_columns};

/// Name of the server-wide lock that serialises concurrent `migrate()` calls.
const MIGRATE_LOCK: &str = "axum_idempotency_outbox_migrate";

// The key column is ASCII with a binary collation: keys are compared byte for byte, never
// case-folded, and 255 ASCII characters stay within InnoDB's index length limit.
const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS idempotency_outbox (
    id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    topic TEXT NOT NULL,
    downstream_key VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    payload LONGBLOB NOT NULL,
    status VARCHAR(16) NOT NULL,
    attempts BIGINT NOT NULL DEFAULT 0,
    outcome_unknown BOOLEAN NOT NULL DEFAULT FALSE,
    receipt TEXT NULL,
    last_error TEXT NULL,
    created_at BIGINT NOT NULL,
    next_attempt_at BIGINT NOT NULL,
    last_attempt_at BIGINT NULL,
    finished_at BIGINT NULL,
    lease_expires_at BIGINT NULL,
    lease_token BIGINT NULL,
    UNIQUE KEY idempotency_outbox_key (downstream_key),
    KEY idempotency_outbox_due (status, next_attempt_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4";

impl Backend for MySql {}

impl Dialect for MySql {
    const INSERT: &'static str = "INSERT INTO idempotency_outbox
            (topic, downstream_key, payload, status, created_at, next_attempt_at)
        VALUES (?, ?, ?, 'pending', ?, ?)";
    // A duplicate key only undoes this statement in InnoDB, not the caller's transaction.
    const NEW_ID: NewId<Self> = NewId::LastInsertId(MySqlQueryResult::last_insert_id);
    const FETCH_BY_ID: &'static str = concat!(
        "SELECT ",
        record_columns!(),
        " FROM idempotency_outbox WHERE id = ?"
    );
    const FETCH_BY_KEY: &'static str = concat!(
        "SELECT ",
        record_columns!(),
        " FROM idempotency_outbox WHERE downstream_key = ?"
    );
    const CLAIM: ClaimSql = ClaimSql::LockThenLease {
        select: concat!(
            "SELECT ",
            record_columns!(),
            " FROM idempotency_outbox
             WHERE status = 'pending' AND next_attempt_at <= ?
               AND (lease_expires_at IS NULL OR lease_expires_at <= ?)
             ORDER BY next_attempt_at, id
             LIMIT ?
             FOR UPDATE SKIP LOCKED"
        ),
        lease: "UPDATE idempotency_outbox SET lease_expires_at = ?, lease_token = ? WHERE id = ?",
    };
    const BEGIN_ATTEMPT: &'static str = "UPDATE idempotency_outbox
        SET attempts = attempts + 1, last_attempt_at = ?, outcome_unknown = TRUE
        WHERE id = ? AND lease_token = ?";
    // Releasing the lease always changes the row, so MySQL's "changed rows" count is 1 exactly
    // when the lease was still ours.
    // MySQL refuses LIMIT in an IN subquery but takes it on DELETE itself.
    const PURGE_DELIVERED: &'static str = "DELETE FROM idempotency_outbox
        WHERE status = 'delivered' AND finished_at < ? ORDER BY finished_at LIMIT ?";
    const REQUEUE: &'static str = "UPDATE idempotency_outbox
        SET status = 'pending', attempts = 0, next_attempt_at = ?, finished_at = NULL,
            lease_expires_at = NULL, lease_token = NULL
        WHERE id = ? AND status = 'failed'";
    const SETTLE: &'static str = "UPDATE idempotency_outbox
        SET status = ?, receipt = ?, last_error = ?, outcome_unknown = ?,
            next_attempt_at = ?, finished_at = ?,
            lease_expires_at = NULL, lease_token = NULL
        WHERE id = ? AND lease_token = ?";

    async fn create_table(pool: &Pool<Self>) -> Result<(), sqlx::Error> {
        // GET_LOCK belongs to the session, so everything runs on one connection.
        let mut conn = pool.acquire().await?;
        sqlx::query("SELECT GET_LOCK(?, 60)")
            .bind(MIGRATE_LOCK)
            .execute(&mut *conn)
            .await?;
        let created = sqlx::query(SCHEMA).execute(&mut *conn).await;
        sqlx::query("SELECT RELEASE_LOCK(?)")
            .bind(MIGRATE_LOCK)
            .execute(&mut *conn)
            .await?;
        created.map(|_| ())
    }

    fn rows_affected(result: &Self::QueryResult) -> u64 {
        result.rows_affected()
    }
}
