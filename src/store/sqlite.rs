//! SQLite: the embedded default, one file, no server.
//!
//! SQLite has one writer at a time, so a claim's transaction begins `IMMEDIATE`, taking the
//! write lock up front and waiting for it within the claim's bound (`busy_timeout`). That lock
//! is the claim: holding it, the transaction reads whether a live record holds the key, and
//! writes the record once, complete, just before it commits. The database runs in-process, so
//! sending the claim with `BEGIN` would save no round trip: it is a statement of its own.

use std::time::Duration;

use sqlx::error::DatabaseError;
use sqlx::sqlite::SqliteConnection;
use sqlx::{Pool, Sqlite, Transaction};

use super::literal::{Statement, Syntax};
use super::protocol::{BeganClaim, NewRecord, PurgePace};
use super::sql::{ClaimPath, Dialect, bound, classify, record_values};
use crate::error::Error;
use crate::migrate;

impl super::Records for Sqlite {
    type Protocol = super::sql::SqlStore<Sqlite>;
}

impl ClaimPath for Sqlite {
    async fn begin(
        pool: &Pool<Self>,
        lock_wait: Duration,
    ) -> Result<Transaction<'static, Self>, Error> {
        let millis = i64::try_from(lock_wait.as_millis())
            .unwrap_or(i64::MAX)
            .clamp(1, i64::from(i32::MAX));
        let mut begin = Statement::new(Syntax::Sqlite);
        begin
            .sql("PRAGMA busy_timeout = ")
            .int8(millis)
            .sql("; BEGIN IMMEDIATE");
        pool.begin_with(begin.inline("", ""))
            .await
            .map_err(classify::<Self>)
    }

    async fn begin_claimed<'a>(
        _pool: &'a Pool<Self>,
        _record: &'a NewRecord<'a>,
        _lock_wait: Duration,
    ) -> Result<BeganClaim<Self>, Error> {
        Ok(BeganClaim::Unfused)
    }

    // The transaction holds the write lock, so nothing can change under the read.
    async fn claim<'a>(
        conn: &'a mut SqliteConnection,
        record: &'a NewRecord<'a>,
        _lock_wait: Duration,
    ) -> Result<bool, Error> {
        let live: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM idempotency_records WHERE key_digest = ?1 AND expires_at > ?2",
        )
        .bind(&record.key.digest()[..])
        .bind(record.created_at.column())
        .fetch_one(conn)
        .await
        .map_err(classify::<Self>)?;
        Ok(live == 0)
    }

    // An expired record is replaced in the same statement; a live one is left alone, and then
    // nothing is committed.
    async fn commit_record<'a>(
        mut tx: Transaction<'static, Self>,
        record: &'a NewRecord<'a>,
    ) -> Result<(), Error> {
        let mut insert = Statement::new(Syntax::Sqlite);
        insert.sql(
            "INSERT INTO idempotency_records (key_digest, principal, method, route, \
             fingerprint, state, status, headers, body, created_at, expires_at, lease_owner, \
             lease_expires_at) VALUES (",
        );
        record_values(&mut insert, record);
        insert.sql(
            ") ON CONFLICT (key_digest) DO UPDATE SET \
             principal = excluded.principal, method = excluded.method, route = excluded.route, \
             fingerprint = excluded.fingerprint, state = excluded.state, status = excluded.status, \
             headers = excluded.headers, body = excluded.body, created_at = excluded.created_at, \
             expires_at = excluded.expires_at, lease_owner = excluded.lease_owner, \
             lease_expires_at = excluded.lease_expires_at \
             WHERE idempotency_records.expires_at <= excluded.created_at",
        );
        let written = bound(&insert)
            .execute(&mut *tx)
            .await
            .map_err(classify::<Self>)?;
        if written.rows_affected() == 0 {
            return Err(Error::Conflict);
        }
        tx.commit().await.map_err(classify::<Self>)
    }
}

impl Dialect for Sqlite {
    const SCHEMA: migrate::Schema<Self> = migrate::Schema {
        versions_table: "idempotency_schema_versions",
        scripts: &[
            (1, include_str!("../../migrations/sqlite/0001_records.sql")),
            (2, include_str!("../../migrations/sqlite/0002_leases.sql")),
        ],
        // The write lock taken up front serialises concurrent migrators.
        begin: "BEGIN IMMEDIATE",
        lock: None,
        unlock: None,
        lock_granted: |_| true,
        record: "INSERT INTO idempotency_schema_versions (version, applied_at) VALUES (?1, ?2)",
    };
    const VERSIONS_TABLE_EXISTS: &'static str = "SELECT COUNT(*) FROM sqlite_master \
        WHERE type = 'table' AND name = 'idempotency_schema_versions'";
    const FIND: &'static str = "SELECT state, fingerprint, status, headers, body, created_at, expires_at, lease_expires_at \
        FROM idempotency_records WHERE key_digest = ?1";
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

    fn is_conflict(_error: &dyn DatabaseError) -> bool {
        false
    }
}
