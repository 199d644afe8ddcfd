//! PostgreSQL: the production backend, for many app instances sharing one database.

use std::time::Duration;

use sqlx::error::DatabaseError;
use sqlx::postgres::PgRow;
use sqlx::{Postgres, Row};

use super::literal::Syntax;
use super::protocol::NewRecord;
use super::sql::{Dialect, FinishForm, finish_text, record_literals};
use crate::record::{RecordState, StoredResponse};
use crate::scope::ScopedKey;

impl super::Records for Postgres {
    type Protocol = super::sql::SqlStore<Postgres>;
}

/// The records table's columns, in the order every claim writes them.
macro_rules! record_columns {
    () => {
        "(key_digest, principal, method, route, fingerprint, state, status, headers, body, \
        created_at, expires_at, lease_owner, lease_expires_at)"
    };
}

/// A claim's conflict clause: an expired record is replaced in the same statement, under its
/// row lock; a live one is left alone.
macro_rules! replace_expired {
    () => {
        "ON CONFLICT (key_digest) DO UPDATE SET \
        principal = EXCLUDED.principal, method = EXCLUDED.method, route = EXCLUDED.route, \
        fingerprint = EXCLUDED.fingerprint, state = EXCLUDED.state, status = EXCLUDED.status, \
        headers = EXCLUDED.headers, body = EXCLUDED.body, created_at = EXCLUDED.created_at, \
        expires_at = EXCLUDED.expires_at, lease_owner = EXCLUDED.lease_owner, \
        lease_expires_at = EXCLUDED.lease_expires_at \
        WHERE r.expires_at <= EXCLUDED.created_at"
    };
}

/// The primary key's constraint, which a claim sent with `BEGIN` violates on purpose when a
/// live record holds the key.
const PRIMARY_KEY: &str = "idempotency_records_pkey";

impl Dialect for Postgres {
    const MIGRATIONS: &'static [(i64, &'static str)] = &[
        (
            1,
            include_str!("../../migrations/postgres/0001_records.sql"),
        ),
        (2, include_str!("../../migrations/postgres/0002_leases.sql")),
        (3, include_str!("../../migrations/postgres/0003_claim.sql")),
    ];
    const MIGRATION_BEGIN: &'static str = "BEGIN";
    // A transaction-scoped advisory lock: two instances starting at once migrate one after the
    // other, and the second finds nothing left to do. The number is this crate's own.
    const MIGRATION_LOCK: Option<&'static str> =
        Some("SELECT pg_advisory_xact_lock(7351906218944770001)");
    const MIGRATION_RECORD: &'static str =
        "INSERT INTO idempotency_schema_versions (version, applied_at) VALUES ($1, $2)";
    // Resolved through the search_path, as every other statement's tables are.
    const VERSIONS_TABLE_EXISTS: &'static str =
        "SELECT COUNT(to_regclass('idempotency_schema_versions'))";
    // A claim first tries for its key's advisory lock without waiting (TRY_CLAIM): free, it
    // means no other transaction is claiming the key, so the insert cannot queue behind an
    // uncommitted row and needs no lock-wait bound. The `lock` CTE runs once, before the insert
    // reads from it; the row says whether the lock was free and whether the key was taken.
    const TRY_CLAIM: Option<&'static str> = Some(concat!(
        "WITH lock AS (SELECT pg_try_advisory_xact_lock($14) AS held), \
        claimed AS (INSERT INTO idempotency_records AS r ",
        record_columns!(),
        " SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13 FROM lock WHERE held ",
        replace_expired!(),
        " RETURNING 1) SELECT held, EXISTS (SELECT 1 FROM claimed) FROM lock",
    ));
    // Held, the lock belongs to an in-flight claim of the key (or, once in 2^64, of a key with
    // the same lock number): this statement waits for it, then claims. The statement bounds
    // its own wait, so the claim transaction begins with a plain `BEGIN` and the bound is part
    // of a prepared statement: the one-row subquery saves the session's `lock_timeout` (the
    // nested call runs first), sets the bound, and only then, as that call's argument is
    // ready, waits for the key's lock. RETURNING gives the handler's own statements the saved
    // value back once the key is ours. Both settings are transaction-local, so a claim that
    // returns no row leaves nothing behind past its transaction.
    const CLAIM: &'static str = concat!(
        "INSERT INTO idempotency_records AS r ",
        record_columns!(),
        " SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13 \
        FROM (SELECT pg_advisory_xact_lock(CASE WHEN set_config('lock_timeout', \
            $14 || left(set_config('axum_idempotency.lock_timeout', current_setting('lock_timeout'), true), 0), \
            true) IS NOT NULL THEN $15 END)) AS bound ",
        replace_expired!(),
        " RETURNING set_config('lock_timeout', current_setting('axum_idempotency.lock_timeout'), true)",
    );
    const FIND: &'static str = "SELECT state, fingerprint, status, headers, body, created_at, expires_at, lease_expires_at \
        FROM idempotency_records WHERE key_digest = $1";
    const FINISH: &'static str = "UPDATE idempotency_records \
        SET state = $1, status = $2, headers = $3, body = $4 WHERE key_digest = $5";
    // The outer expiry test is repeated on purpose: a claim that replaced an expired record
    // while this DELETE waited for its row lock must survive the re-check.
    const PURGE: &'static str = "DELETE FROM idempotency_records WHERE expires_at <= $1 \
        AND key_digest IN (SELECT key_digest FROM idempotency_records WHERE expires_at <= $1 LIMIT $2)";

    const RENEW_LEASE: &'static str = "UPDATE idempotency_records SET lease_expires_at = $1 \
        WHERE key_digest = $2 AND lease_owner = $3 AND state = 'processing'";
    const TAKE_OVER_LEASE: &'static str = "UPDATE idempotency_records SET lease_owner = $1, lease_expires_at = $2 \
        WHERE key_digest = $3 AND state = 'processing' AND lease_expires_at <= $4";
    const FINISH_LEASED: &'static str = "UPDATE idempotency_records \
        SET state = $1, status = $2, headers = $3, body = $4, lease_owner = NULL, lease_expires_at = NULL \
        WHERE key_digest = $5 AND lease_owner = $6";
    const RELEASE_LEASE: &'static str = "DELETE FROM idempotency_records \
        WHERE key_digest = $1 AND lease_owner = $2 AND state = 'processing'";
    const FORGET: &'static str = "DELETE FROM idempotency_records WHERE key_digest = $1";

    fn begin_statement(_lock_wait: Duration) -> Option<String> {
        None
    }

    // Sent as one simple query, the claim comes *before* `BEGIN`: the call runs in the implicit
    // transaction of its query, which `BEGIN` turns into the transaction the handler goes on in.
    // If the call fails, the server rolls the implicit transaction back and skips `BEGIN`, so a
    // refused claim leaves the connection idle, with nothing to roll back. The function (schema
    // version 3) takes the key's advisory lock as TRY_CLAIM and CLAIM do: at once when it is
    // free, else waiting, with the wait bounded by `lock_timeout` set for the claim alone; it
    // claims on the unique key, and raises a violation of the primary key, the "taken" error,
    // when a live record kept it. Its plans are kept for the session: the
    // server parses and plans the one call, not the claim's statements, on every request.
    fn fused_claim(record: &NewRecord<'_>, lock_wait: Duration) -> Option<String> {
        let values = record_literals(record, Syntax::Postgres)?;
        let lock = Self::key_lock(&record.key)?;
        let bound = Self::claim_lock_wait(lock_wait)?;
        Some(format!(
            "SELECT axum_idempotency_claim_v1({values}, {lock}, '{bound}'); BEGIN",
            values = values.as_str(),
        ))
    }

    fn fused_taken(error: &dyn DatabaseError) -> bool {
        // unique_violation, on the records' own primary key
        error.code().as_deref() == Some("23505") && error.constraint() == Some(PRIMARY_KEY)
    }

    // The finish function (schema version 3) is the plain `UPDATE`, planned once per session.
    // `BEGIN` after `COMMIT` leaves an empty transaction for the rollback the dropped
    // `Transaction` queues, so that rollback finds a transaction to end and the server logs no
    // warning.
    fn fused_finish(
        key: &ScopedKey,
        state: RecordState,
        response: &StoredResponse,
    ) -> Option<String> {
        finish_text(
            key,
            state,
            response,
            Syntax::Postgres,
            FinishForm::Call("SELECT axum_idempotency_finish_v1"),
            "; COMMIT; BEGIN",
        )
    }

    fn claim_lock_wait(lock_wait: Duration) -> Option<String> {
        // lock_timeout = 0 would mean "wait forever".
        Some(format!("{}ms", lock_wait.as_millis().max(1)))
    }

    fn key_lock(key: &ScopedKey) -> Option<i64> {
        // The one-number form: a lock space of its own, apart from the two-number locks apps
        // often use, and 64 bits of the digest make two in-flight keys sharing a number
        // vanishingly rare (they would only queue one behind the other).
        key.digest()
            .first_chunk::<8>()
            .map(|prefix| i64::from_be_bytes(*prefix))
    }

    fn try_claimed(row: &PgRow) -> Result<Option<bool>, sqlx::Error> {
        let held: bool = row.try_get(0)?;
        let claimed: bool = row.try_get(1)?;
        Ok(held.then_some(claimed))
    }

    fn rows_affected(result: &Self::QueryResult) -> u64 {
        result.rows_affected()
    }

    fn is_busy(error: &dyn DatabaseError) -> bool {
        // lock_not_available
        error.code().as_deref() == Some("55P03")
    }

    fn is_conflict(error: &dyn DatabaseError) -> bool {
        // deadlock_detected, serialization_failure
        matches!(error.code().as_deref(), Some("40P01" | "40001"))
    }
}
