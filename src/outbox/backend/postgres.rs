//! PostgreSQL: many dispatchers, on many hosts, share the table. A claim locks the due rows it
//! picks with `FOR UPDATE SKIP LOCKED`, so concurrent claims never wait on each other nor pick
//! the same row, and writes a lease that outlives the claim's short transaction.

use sqlx::{Pool, Postgres};

use super::private::{ClaimSql, Dialect, NewId};
use super::{Backend, record_columns};

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

impl Dialect for Postgres {
    // ON CONFLICT rather than catching the unique violation: an error would abort the caller's
    // whole transaction.
    const INSERT: &'static str = "INSERT INTO idempotency_outbox
            (topic, downstream_key, payload, status, created_at, next_attempt_at)
        VALUES ($1, $2, $3, 'pending', $4, $5)
        ON CONFLICT (downstream_key) DO NOTHING
        RETURNING id";
    const NEW_ID: NewId<Self> = NewId::Returning;
    const FETCH_BY_ID: &'static str = concat!(
        "SELECT ",
        record_columns!(),
        " FROM idempotency_outbox WHERE id = $1"
    );
    const FETCH_BY_KEY: &'static str = concat!(
        "SELECT ",
        record_columns!(),
        " FROM idempotency_outbox WHERE downstream_key = $1"
    );
    const CLAIM: ClaimSql = ClaimSql::UpdateReturning {
        probe: None,
        update: concat!(
            "UPDATE idempotency_outbox SET lease_expires_at = $1, lease_token = $2
             WHERE id IN (
                 SELECT id FROM idempotency_outbox
                 WHERE status = 'pending' AND next_attempt_at <= $3
                   AND (lease_expires_at IS NULL OR lease_expires_at <= $3)
                 ORDER BY next_attempt_at, id
                 LIMIT $4
                 FOR UPDATE SKIP LOCKED)
             RETURNING ",
            record_columns!()
        ),
    };
    const BEGIN_ATTEMPT: &'static str = "UPDATE idempotency_outbox
        SET attempts = attempts + 1, last_attempt_at = $1, outcome_unknown = TRUE
        WHERE id = $2 AND lease_token = $3";
    const PURGE_DELIVERED: &'static str = "DELETE FROM idempotency_outbox WHERE id IN (
        SELECT id FROM idempotency_outbox WHERE status = 'delivered' AND finished_at < $1
        ORDER BY finished_at LIMIT $2)";
    const REQUEUE: &'static str = "UPDATE idempotency_outbox
        SET status = 'pending', attempts = 0, next_attempt_at = $1, finished_at = NULL,
            lease_expires_at = NULL, lease_token = NULL
        WHERE id = $2 AND status = 'failed'";
    const SETTLE: &'static str = "UPDATE idempotency_outbox
        SET status = $1, receipt = $2, last_error = $3, outcome_unknown = $4,
            next_attempt_at = $5, finished_at = $6,
            lease_expires_at = NULL, lease_token = NULL
        WHERE id = $7 AND lease_token = $8";

    async fn create_table(pool: &Pool<Self>) -> Result<(), sqlx::Error> {
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

    fn rows_affected(result: &Self::QueryResult) -> u64 {
        result.rows_affected()
    }
}
