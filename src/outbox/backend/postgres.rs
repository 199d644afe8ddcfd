//! PostgreSQL: many dispatchers, on many hosts, share the table. A claim locks the due rows it
//! picks with `FOR UPDATE SKIP LOCKED`, so concurrent claims never wait on each other nor pick
//! the same row, and writes a lease that outlives the claim's short transaction.

use sqlx::postgres::PgConnection;
use sqlx::{Pool, Postgres};

use super::private::{Claim, Ops, Settlement};
use super::{Backend, record_from_row};
use crate::outbox::{DownstreamKey, Message, MessageId, Record};

/// Key of the advisory lock that serialises concurrent `migrate()` calls: `CREATE TABLE IF NOT
/// EXISTS` alone races in PostgreSQL (both sessions see no table, one fails on the catalog's
/// unique index).
const MIGRATE_LOCK: i64 = 0x6178_6f75_7462_6f78;

const SCHEMA: [&str; 2] = [
    "CREATE TABLE IF NOT EXISTS idempotency_outbox (
        id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        topic TEXT NOT NULL,
        downstream_key TEXT NOT NULL UNIQUE,
        payload BYTEA NOT NULL,
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
    )",
    "CREATE INDEX IF NOT EXISTS idempotency_outbox_due
        ON idempotency_outbox (status, next_attempt_at)",
];

impl Backend for Postgres {}

impl Ops for Postgres {
    async fn migrate(pool: &Pool<Self>) -> Result<(), sqlx::Error> {
        let mut tx = pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(MIGRATE_LOCK)
            .execute(&mut *tx)
            .await?;
        for statement in SCHEMA {
            sqlx::query(statement).execute(&mut *tx).await?;
        }
        tx.commit().await
    }

    async fn insert(
        conn: &mut PgConnection,
        message: &Message,
        now: i64,
    ) -> Result<Option<MessageId>, sqlx::Error> {
        // ON CONFLICT rather than catching the unique violation: an error would abort the
        // caller's whole transaction.
        let id: Option<i64> = sqlx::query_scalar(
            "INSERT INTO idempotency_outbox
                 (topic, downstream_key, payload, status, created_at, next_attempt_at)
             VALUES ($1, $2, $3, 'pending', $4, $4)
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
        conn: &mut PgConnection,
        id: MessageId,
    ) -> Result<Option<Record>, sqlx::Error> {
        let row = sqlx::query(
            "SELECT id, topic, downstream_key, payload, status, attempts, outcome_unknown,
                    receipt, last_error, created_at, next_attempt_at, last_attempt_at, finished_at
             FROM idempotency_outbox WHERE id = $1",
        )
        .bind(id.get())
        .fetch_optional(conn)
        .await?;
        row.as_ref().map(record_from_row).transpose()
    }

    async fn fetch_by_key(
        conn: &mut PgConnection,
        key: &DownstreamKey,
    ) -> Result<Option<Record>, sqlx::Error> {
        let row = sqlx::query(
            "SELECT id, topic, downstream_key, payload, status, attempts, outcome_unknown,
                    receipt, last_error, created_at, next_attempt_at, last_attempt_at, finished_at
             FROM idempotency_outbox WHERE downstream_key = $1",
        )
        .bind(key.as_str())
        .fetch_optional(conn)
        .await?;
        row.as_ref().map(record_from_row).transpose()
    }

    async fn claim(pool: &Pool<Self>, claim: Claim) -> Result<Vec<Record>, sqlx::Error> {
        let rows = sqlx::query(
            "UPDATE idempotency_outbox SET lease_expires_at = $1, lease_token = $2
             WHERE id IN (
                 SELECT id FROM idempotency_outbox
                 WHERE status = 'pending' AND next_attempt_at <= $3
                   AND (lease_expires_at IS NULL OR lease_expires_at <= $3)
                 ORDER BY next_attempt_at, id
                 LIMIT $4
                 FOR UPDATE SKIP LOCKED)
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
             SET attempts = attempts + 1, last_attempt_at = $1, outcome_unknown = TRUE
             WHERE id = $2 AND lease_token = $3",
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
             SET status = $1, receipt = $2, last_error = $3, outcome_unknown = $4,
                 next_attempt_at = $5, finished_at = $6,
                 lease_expires_at = NULL, lease_token = NULL
             WHERE id = $7 AND lease_token = $8",
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
