//! SQLite: one writer at a time, so a claim is a single `UPDATE … RETURNING` that no other
//! dispatcher can interleave with; the lease still matters when a dispatcher dies mid-send.

use sqlx::Sqlite;

use super::private::{ClaimSql, Dialect, NewId};
use super::record_columns;

impl Dialect for Sqlite {
    const INSERT: &'static str = "INSERT INTO idempotency_outbox
            (topic, downstream_key, payload, status, created_at, next_attempt_at)
        VALUES (?1, ?2, ?3, 'pending', ?4, ?5)
        ON CONFLICT (downstream_key) DO NOTHING
        RETURNING id";
    const NEW_ID: NewId<Self> = NewId::Returning;
    const FETCH_BY_ID: &'static str = concat!(
        "SELECT ",
        record_columns!(),
        " FROM idempotency_outbox WHERE id = ?1"
    );
    const FETCH_BY_KEY: &'static str = concat!(
        "SELECT ",
        record_columns!(),
        " FROM idempotency_outbox WHERE downstream_key = ?1"
    );
    const CLAIM: ClaimSql = ClaimSql::UpdateReturning {
        // An UPDATE takes the database's write lock even when it matches nothing; reading first
        // keeps an idle dispatcher from queueing behind (and stalling) the app's transactions.
        probe: Some(
            "SELECT EXISTS (
                 SELECT 1 FROM idempotency_outbox
                 WHERE status = 'pending' AND next_attempt_at <= ?1
                   AND (lease_expires_at IS NULL OR lease_expires_at <= ?1))",
        ),
        update: concat!(
            "UPDATE idempotency_outbox SET lease_expires_at = ?1, lease_token = ?2
             WHERE id IN (
                 SELECT id FROM idempotency_outbox
                 WHERE status = 'pending' AND next_attempt_at <= ?3
                   AND (lease_expires_at IS NULL OR lease_expires_at <= ?3)
                 ORDER BY next_attempt_at, id
                 LIMIT ?4)
             RETURNING ",
            record_columns!()
        ),
    };
    const RENEW_LEASE: &'static str =
        "UPDATE idempotency_outbox SET lease_expires_at = ?1 WHERE id = ?2 AND lease_token = ?3";
    const BEGIN_ATTEMPT: &'static str = "UPDATE idempotency_outbox
        SET attempts = attempts + 1, last_attempt_at = ?1, outcome_unknown = TRUE
        WHERE id = ?2 AND lease_token = ?3";
    const PURGE_DELIVERED: &'static str = "DELETE FROM idempotency_outbox WHERE id IN (
        SELECT id FROM idempotency_outbox WHERE status = 'delivered' AND finished_at < ?1
        ORDER BY finished_at LIMIT ?2)";
    const REQUEUE: &'static str = "UPDATE idempotency_outbox
        SET status = 'pending', attempts = 0, next_attempt_at = ?1, finished_at = NULL,
            lease_expires_at = NULL, lease_token = NULL
        WHERE id = ?2 AND status = 'failed'";
    const SETTLE: &'static str = "UPDATE idempotency_outbox
        SET status = ?1, receipt = ?2, last_error = ?3, outcome_unknown = ?4,
            next_attempt_at = ?5, finished_at = ?6,
            lease_expires_at = NULL, lease_token = NULL
        WHERE id = ?7 AND lease_token = ?8";
    const MIGRATIONS: &'static [(i64, &'static str)] = &[(
        1,
        include_str!("../../../migrations/sqlite/outbox/0001_outbox.sql"),
    )];
    // The write lock taken up front serialises concurrent migrators.
    const MIGRATION_BEGIN: &'static str = "BEGIN IMMEDIATE";
    const MIGRATION_RECORD: &'static str =
        "INSERT INTO idempotency_outbox_schema_versions (version, applied_at) VALUES (?1, ?2)";

    fn rows_affected(result: &Self::QueryResult) -> u64 {
        result.rows_affected()
    }
}
