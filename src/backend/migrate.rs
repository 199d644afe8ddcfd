//! Versioned schema migrations: one runner for every schema the crate owns, written once in
//! [`runner`] and expanded in each database's module.
//!
//! Each schema (the records', the outbox's) keeps its applied versions in a table of its own,
//! so they evolve apart. A run takes the backend's migration lock first, so instances starting
//! at once migrate one after the other and the later ones find nothing to do. A version once
//! released is never edited; a change is a new version.

use sqlx::Database;

/// One schema and how its backend migrates it.
#[allow(missing_debug_implementations)]
pub(crate) struct Schema<DB: Database> {
    /// The table its applied versions are recorded in (a constant, never input).
    pub(crate) versions_table: &'static str,
    /// (version, SQL script), oldest first.
    pub(crate) scripts: &'static [(i64, &'static str)],
    /// Begins the migration transaction.
    pub(crate) begin: &'static str,
    /// Run first in that transaction to serialise concurrent migrators, where `begin` does not.
    pub(crate) lock: Option<&'static str>,
    /// Releases a lock `lock` took for the session rather than the transaction (where DDL
    /// commits implicitly, a transaction cannot hold it); run after the migration, whatever
    /// its outcome.
    pub(crate) unlock: Option<&'static str>,
    /// Whether the row `lock` returned says the lock was granted: a lock with a timeout reports
    /// the timeout there, not as an error.
    pub(crate) lock_granted: fn(&DB::Row) -> bool,
    /// Records an applied version. Parameters: version, applied_at.
    pub(crate) record: &'static str,
}

/// Why a migration did not complete. Nothing of a failed version was applied where the
/// database runs DDL in transactions; elsewhere the failing version's script stands as far as
/// it got, and the next run starts that version again.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The database failed outside a version's script.
    Sql(sqlx::Error),
    /// A version's script failed.
    Script { version: i64, source: sqlx::Error },
    /// The lock that serialises migrators was not granted in time.
    LockRefused,
}

impl From<sqlx::Error> for Failure {
    fn from(error: sqlx::Error) -> Self {
        Self::Sql(error)
    }
}

/// `async fn apply(pool, schema) -> Result<(), Failure>` for `$db`: applies `schema`'s versions
/// newer than the recorded one, on one connection of `pool`. Written once here, expanded in
/// each database's module, where the types are concrete.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
macro_rules! runner {
    ($db:ty) => {
        async fn apply(
            pool: &sqlx::Pool<$db>,
            schema: &$crate::backend::migrate::Schema<$db>,
        ) -> Result<(), $crate::backend::migrate::Failure> {
            // One connection throughout: a session lock is released by the session that took
            // it.
            let mut conn = pool.acquire().await?;
            let applied = apply_on(&mut conn, schema).await;
            if let Some(unlock) = schema.unlock
                && let Err(error) = sqlx::raw_sql(unlock).execute(&mut *conn).await
            {
                // The session may still hold the lock; ending it releases the lock, pooling it
                // would not.
                conn.close_on_drop();
                applied?;
                return Err(error.into());
            }
            applied
        }

        async fn apply_on(
            conn: &mut <$db as sqlx::Database>::Connection,
            schema: &$crate::backend::migrate::Schema<$db>,
        ) -> Result<(), $crate::backend::migrate::Failure> {
            use sqlx::{Connection as _, Row as _};
            // Wrapped: a bare `&'static str` here makes the future fail `Send` checks once
            // spawned.
            let mut tx = conn.begin_with(sqlx::AssertSqlSafe(schema.begin)).await?;
            if let Some(lock) = schema.lock {
                let granted = sqlx::query(lock).fetch_optional(&mut *tx).await?;
                if granted
                    .as_ref()
                    .is_some_and(|row| !(schema.lock_granted)(row))
                {
                    return Err($crate::backend::migrate::Failure::LockRefused);
                }
            }
            // The table name is one of the crate's constants, never input.
            let table = schema.versions_table;
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "CREATE TABLE IF NOT EXISTS {table} \
                 (version BIGINT PRIMARY KEY, applied_at BIGINT NOT NULL)"
            )))
            .execute(&mut *tx)
            .await?;
            let current: Option<i64> = sqlx::query(sqlx::AssertSqlSafe(format!(
                "SELECT MAX(version) FROM {table}"
            )))
            .fetch_one(&mut *tx)
            .await?
            .try_get(0)?;
            let current = current.unwrap_or(0);
            for &(version, script) in schema.scripts {
                if version <= current {
                    continue;
                }
                sqlx::raw_sql(script)
                    .execute(&mut *tx)
                    .await
                    .map_err(|source| $crate::backend::migrate::Failure::Script {
                        version,
                        source,
                    })?;
                sqlx::query(schema.record)
                    .bind(version)
                    .bind($crate::clock::Millis::now().column())
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
            Ok(())
        }
    };
}
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub(super) use runner;
