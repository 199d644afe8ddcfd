//! MySQL and MariaDB (10.6+ for `SKIP LOCKED`): like PostgreSQL, concurrent dispatchers skip
//! each other's locked rows. Without `UPDATE … RETURNING`, a claim reads the due rows with
//! `FOR UPDATE SKIP LOCKED` and leases them in the same short transaction.

use sqlx::mysql::MySqlConnection;
use sqlx::{MySql, Pool};

use super::private::{Claim, Ops, Settlement};
use super::{Backend, record_from_row};
use crate::outbox::{DownstreamKey, Message, MessageId, Record};

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

impl Ops for MySql {
    async fn migrate(pool: &Pool<Self>) -> Result<(), sqlx::Error> {
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

    async fn insert(
        conn: &mut MySqlConnection,
        message: &Message,
        now: i64,
    ) -> Result<Option<MessageId>, sqlx::Error> {
        // A duplicate key only undoes this statement in InnoDB, not the caller's transaction.
        let inserted = sqlx::query(
            "INSERT INTO idempotency_outbox
                 (topic, downstream_key, payload, status, created_at, next_attempt_at)
             VALUES (?, ?, ?, 'pending', ?, ?)",
        )
        .bind(message.topic())
        .bind(message.key().as_str())
        .bind(message.payload())
        .bind(now)
        .bind(now)
        .execute(conn)
        .await;
        match inserted {
            Ok(done) => {
                let id = i64::try_from(done.last_insert_id()).map_err(|e| {
                    sqlx::Error::Decode(format!("outbox id out of range: {e}").into())
                })?;
                Ok(Some(MessageId::from(id)))
            }
            Err(sqlx::Error::Database(e)) if e.is_unique_violation() => Ok(None),
            Err(e) => Err(e),
        }
    }

    async fn fetch_by_id(
        conn: &mut MySqlConnection,
        id: MessageId,
    ) -> Result<Option<Record>, sqlx::Error> {
        let row = sqlx::query(
            "SELECT id, topic, downstream_key, payload, status, attempts, outcome_unknown,
                    receipt, last_error, created_at, next_attempt_at, last_attempt_at, finished_at
             FROM idempotency_outbox WHERE id = ?",
        )
        .bind(id.get())
        .fetch_optional(conn)
        .await?;
        row.as_ref().map(record_from_row).transpose()
    }

    async fn fetch_by_key(
        conn: &mut MySqlConnection,
        key: &DownstreamKey,
    ) -> Result<Option<Record>, sqlx::Error> {
        let row = sqlx::query(
            "SELECT id, topic, downstream_key, payload, status, attempts, outcome_unknown,
                    receipt, last_error, created_at, next_attempt_at, last_attempt_at, finished_at
             FROM idempotency_outbox WHERE downstream_key = ?",
        )
        .bind(key.as_str())
        .fetch_optional(conn)
        .await?;
        row.as_ref().map(record_from_row).transpose()
    }

    async fn claim(pool: &Pool<Self>, claim: Claim) -> Result<Vec<Record>, sqlx::Error> {
        let mut tx = pool.begin().await?;
        let rows = sqlx::query(
            "SELECT id, topic, downstream_key, payload, status, attempts, outcome_unknown,
                    receipt, last_error, created_at, next_attempt_at, last_attempt_at, finished_at
             FROM idempotency_outbox
             WHERE status = 'pending' AND next_attempt_at <= ?
               AND (lease_expires_at IS NULL OR lease_expires_at <= ?)
             ORDER BY next_attempt_at, id
             LIMIT ?
             FOR UPDATE SKIP LOCKED",
        )
        .bind(claim.now)
        .bind(claim.now)
        .bind(claim.limit)
        .fetch_all(&mut *tx)
        .await?;
        let records = rows
            .iter()
            .map(record_from_row)
            .collect::<Result<Vec<_>, _>>()?;
        for record in &records {
            sqlx::query(
                "UPDATE idempotency_outbox SET lease_expires_at = ?, lease_token = ? WHERE id = ?",
            )
            .bind(claim.lease_until)
            .bind(claim.token)
            .bind(record.id.get())
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(records)
    }

    async fn begin_attempt(
        pool: &Pool<Self>,
        id: MessageId,
        token: i64,
        now: i64,
    ) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(
            "UPDATE idempotency_outbox
             SET attempts = attempts + 1, last_attempt_at = ?, outcome_unknown = TRUE
             WHERE id = ? AND lease_token = ?",
        )
        .bind(now)
        .bind(id.get())
        .bind(token)
        .execute(pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn settle(
        pool: &Pool<Self>,
        id: MessageId,
        token: i64,
        settlement: &Settlement,
    ) -> Result<bool, sqlx::Error> {
        // Releasing the lease always changes the row, so MySQL's "changed rows" count is 1
        // exactly when the lease was still ours.
        let done = sqlx::query(
            "UPDATE idempotency_outbox
             SET status = ?, receipt = ?, last_error = ?, outcome_unknown = ?,
                 next_attempt_at = ?, finished_at = ?,
                 lease_expires_at = NULL, lease_token = NULL
             WHERE id = ? AND lease_token = ?",
        )
        .bind(settlement.status.as_str())
        .bind(settlement.receipt.as_deref())
        .bind(settlement.last_error.as_deref())
        .bind(settlement.outcome_unknown)
        .bind(settlement.next_attempt_at)
        .bind(settlement.finished_at)
        .bind(id.get())
        .bind(token)
        .execute(pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }
}
