//! PostgreSQL: many dispatchers, on many hosts, share the table. A claim locks the due rows it
//! picks with `FOR UPDATE SKIP LOCKED`, so concurrent claims never wait on each other nor pick
//! the same row, and writes a lease that outlives the claim's short transaction.

use sqlx::Postgres;

use super::private::{ClaimSql, Dialect, NewId};
use super::record_columns;

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
    const RENEW_LEASE: &'static str =
        "UPDATE idempotency_outbox SET lease_expires_at = $1 WHERE id = $2 AND lease_token = $3";
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
    const MIGRATIONS: &'static [(i64, &'static str)] = &[(
        1,
        include_str!("../../../migrations/postgres/outbox/0001_outbox.sql"),
    )];
    const MIGRATION_BEGIN: &'static str = "BEGIN";
    // `CREATE TABLE IF NOT EXISTS` alone races in PostgreSQL (both sessions see no table, one
    // fails on the catalog's unique index), so migrators queue on a transaction-scoped advisory
    // lock; the number is the outbox's own ("axoutbox" in ASCII), the same as before the schema
    // was versioned so an older instance starting alongside still queues on it.
    const MIGRATION_LOCK: Option<&'static str> =
        Some("SELECT pg_advisory_xact_lock(7023486169138753400)");
    const MIGRATION_RECORD: &'static str =
        "INSERT INTO idempotency_outbox_schema_versions (version, applied_at) VALUES ($1, $2)";

    fn rows_affected(result: &Self::QueryResult) -> u64 {
        result.rows_affected()
    }
}
