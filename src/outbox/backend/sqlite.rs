//! SQLite: one writer at a time, so a claim is a single `UPDATE … RETURNING` that no other
//! dispatcher can interleave with; the lease still matters when a dispatcher dies mid-send.

use sqlx::sqlite::SqliteConnection;
use sqlx::{Pool, Sqlite};

use super::private::{Claim, Ops, Settlement};
use super::{Backend, record_from_row};
use crate::outbox::{DownstreamKey, Message, MessageId, Record};

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS idempotency_outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    topic TEXT NOT NULL,
    downstream_key TEXT NOT NULL UNIQUE,
    payload BLOB NOT NULL,
    status TEXT NOT NULL,
    attempts BIGINT NOT NULL DEFAULT 0,
    outcome_unknown BOOLEAN NOT NULL DEFAULT FALSE,
    receipt TEXT,
    last_error TEXT,
    created_at BIGINT NOT NULL,
    next_attempt_at BIGINT NOT NULL,
    last_attempt_at BIGINT,
    finished_at BIGINT,
    lease_expires_at BIGINT,
    lease_token BIGINT
);
CREATE INDEX IF NOT EXISTS idempotency_outbox_due
    ON idempotency_outbox (status, next_attempt_at);
";

impl Backend for Sqlite {}

impl Ops for Sqlite {
    async fn migrate(pool: &Pool<Self>) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(SCHEMA).execute(pool).await?;
        Ok(())
    }

    async fn insert(
        conn: &mut SqliteConnection,
        message: &Message,
        now: i64,
    ) -> Result<Option<MessageId>, sqlx::Error> {
        let id: Option<i64> = sqlx::query_scalar(
            "INSERT INTO idempotency_outbox
                 (topic, downstream_key, payload, status, created_at, next_attempt_at)
             VALUES (?1, ?2, ?3, 'pending', ?4, ?4)
             ON CONFLICT (downstream_key) DO NOTHING
             RETURNING id",
        )
        .bind(message.topic())
        .bind(message.key().as_str())
        .bind(message.payload())
        .bind(now)
        .fetch_optional(conn)
        .await?;
        Ok(id.map(MessageId::from))
    }

    async fn fetch_by_id(
        conn: &mut SqliteConnection,
        id: MessageId,
    ) -> Result<Option<Record>, sqlx::Error> {
        let row = sqlx::query(
            "SELECT id, topic, downstream_key, payload, status, attempts, outcome_unknown,
                    receipt, last_error, created_at, next_attempt_at, last_attempt_at, finished_at
             FROM idempotency_outbox WHERE id = ?1",
        )
        .bind(id.get())
        .fetch_optional(conn)
        .await?;
        row.as_ref().map(record_from_row).transpose()
    }

    async fn fetch_by_key(
        conn: &mut SqliteConnection,
        key: &DownstreamKey,
    ) -> Result<Option<Record>, sqlx::Error> {
        let row = sqlx::query(
            "SELECT id, topic, downstream_key, payload, status, attempts, outcome_unknown,
                    receipt, last_error, created_at, next_attempt_at, last_attempt_at, finished_at
             FROM idempotency_outbox WHERE downstream_key = ?1",
        )
        .bind(key.as_str())
        .fetch_optional(conn)
        .await?;
        row.as_ref().map(record_from_row).transpose()
    }

    async fn claim(pool: &Pool<Self>, claim: Claim) -> Result<Vec<Record>, sqlx::Error> {
        // An UPDATE takes the database's write lock even when it matches nothing; reading first
        // keeps an idle dispatcher from queueing behind (and stalling) the app's transactions.
        let due: bool = sqlx::query_scalar(
            "SELECT EXISTS (
                 SELECT 1 FROM idempotency_outbox
                 WHERE status = 'pending' AND next_attempt_at <= ?1
                   AND (lease_expires_at IS NULL OR lease_expires_at <= ?1))",
        )
        .bind(claim.now)
        .fetch_one(pool)
        .await?;
        if !due {
            return Ok(Vec::new());
        }
        let rows = sqlx::query(
            "UPDATE idempotency_outbox SET lease_expires_at = ?1, lease_token = ?2
             WHERE id IN (
                 SELECT id FROM idempotency_outbox
                 WHERE status = 'pending' AND next_attempt_at <= ?3
                   AND (lease_expires_at IS NULL OR lease_expires_at <= ?3)
                 ORDER BY next_attempt_at, id
                 LIMIT ?4)
             RETURNING id, topic, downstream_key, payload, status, attempts, outcome_unknown,
                    receipt, last_error, created_at, next_attempt_at, last_attempt_at, finished_at",
        )
        .bind(claim.lease_until)
        .bind(claim.token)
        .bind(claim.now)
        .bind(claim.limit)
        .fetch_all(pool)
        .await?;
        rows.iter().map(record_from_row).collect()
    }

    async fn begin_attempt(
        pool: &Pool<Self>,
        id: MessageId,
        token: i64,
        now: i64,
    ) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(
            "UPDATE idempotency_outbox
             SET attempts = attempts + 1, last_attempt_at = ?1, outcome_unknown = TRUE
             WHERE id = ?2 AND lease_token = ?3",
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
        let done = sqlx::query(
            "UPDATE idempotency_outbox
             SET status = ?1, receipt = ?2, last_error = ?3, outcome_unknown = ?4,
                 next_attempt_at = ?5, finished_at = ?6,
                 lease_expires_at = NULL, lease_token = NULL
             WHERE id = ?7 AND lease_token = ?8",
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
