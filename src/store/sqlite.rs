//! SQLite: the embedded default, one file, no server.

use std::time::Duration;

use sqlx::Sqlite;
use sqlx::error::DatabaseError;

use super::protocol::PurgePace;
use super::sql::Dialect;

impl super::Records for Sqlite {
    type Protocol = super::sql::SqlStore<Sqlite>;
}

impl Dialect for Sqlite {
    const MIGRATIONS: &'static [(i64, &'static str)] = &[
        (1, include_str!("../../migrations/sqlite/0001_records.sql")),
        (2, include_str!("../../migrations/sqlite/0002_leases.sql")),
    ];
    // The write lock taken up front serialises concurrent migrators.
    const MIGRATION_BEGIN: &'static str = "BEGIN IMMEDIATE";
    const MIGRATION_LOCK: Option<&'static str> = None;
    const MIGRATION_RECORD: &'static str =
        "INSERT INTO idempotency_schema_versions (version, applied_at) VALUES (?1, ?2)";
    const VERSIONS_TABLE_EXISTS: &'static str = "SELECT COUNT(*) FROM sqlite_master \
        WHERE type = 'table' AND name = 'idempotency_schema_versions'";
    const CLAIM: &'static str = "INSERT INTO idempotency_records \
        (key_digest, principal, method, route, fingerprint, state, status, headers, body, created_at, expires_at, lease_owner, lease_expires_at) \
        VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13) \
        ON CONFLICT (key_digest) DO UPDATE SET \
        principal = excluded.principal, method = excluded.method, route = excluded.route, \
        fingerprint = excluded.fingerprint, state = excluded.state, status = excluded.status, \
        headers = excluded.headers, body = excluded.body, created_at = excluded.created_at, \
        expires_at = excluded.expires_at, lease_owner = excluded.lease_owner, \
        lease_expires_at = excluded.lease_expires_at \
        WHERE idempotency_records.expires_at <= excluded.created_at";
    const FIND: &'static str = "SELECT state, fingerprint, status, headers, body, created_at, expires_at, lease_expires_at \
        FROM idempotency_records WHERE key_digest = ?1";
    const FINISH: &'static str = "UPDATE idempotency_records \
        SET state = ?1, status = ?2, headers = ?3, body = ?4 WHERE key_digest = ?5";
    const PURGE: &'static str = "DELETE FROM idempotency_records WHERE key_digest IN \
        (SELECT key_digest FROM idempotency_records WHERE expires_at <= ?1 LIMIT ?2)";
    // Every claim waits for the one write lock while a batch holds it: a short batch keeps that
    // wait within the busy handler's first few naps.
    const PURGE_PACE: PurgePace = PurgePace {
        batch: 250,
        ..PurgePace::DEFAULT
    };

    const RENEW_LEASE: &'static str = "UPDATE idempotency_records SET lease_expires_at = ?1 \
        WHERE key_digest = ?2 AND lease_owner = ?3 AND state = 'processing'";
    const TAKE_OVER_LEASE: &'static str = "UPDATE idempotency_records SET lease_owner = ?1, lease_expires_at = ?2 \
        WHERE key_digest = ?3 AND state = 'processing' AND lease_expires_at <= ?4";
    const FINISH_LEASED: &'static str = "UPDATE idempotency_records \
        SET state = ?1, status = ?2, headers = ?3, body = ?4, lease_owner = NULL, lease_expires_at = NULL \
        WHERE key_digest = ?5 AND lease_owner = ?6";
    const RELEASE_LEASE: &'static str = "DELETE FROM idempotency_records \
        WHERE key_digest = ?1 AND lease_owner = ?2 AND state = 'processing'";
    const FORGET: &'static str = "DELETE FROM idempotency_records WHERE key_digest = ?1";

    fn begin_statement(lock_wait: Duration) -> Option<String> {
        Some(format!(
            "PRAGMA busy_timeout = {}; BEGIN IMMEDIATE",
            lock_wait.as_millis().clamp(1, i32::MAX as u128)
        ))
    }

    fn rows_affected(result: &Self::QueryResult) -> u64 {
        result.rows_affected()
    }

    fn is_busy(error: &dyn DatabaseError) -> bool {
        // SQLITE_BUSY and SQLITE_LOCKED, with their extended codes.
        error
            .code()
            .and_then(|code| code.parse::<i32>().ok())
            .is_some_and(|code| matches!(code & 0xff, 5 | 6))
    }
}
