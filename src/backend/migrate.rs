//! Versioned schema migrations: one runner for every schema the crate owns, written once in
//! [`runner`] and expanded in each database's module.
//!
//! Each schema (the records', the outbox's) keeps its applied versions in a table of its own,
//! so they evolve apart. A run takes the backend's migration lock first, so instances starting
//! at once migrate one after the other and the later ones find nothing to do. A version once
//! released is never edited; a change is a new version.

use sqlx::Database;

use crate::error::Error;

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

/// Why a migration did not complete: the one error of the runner, for every schema. The store's
/// [`Error`] and the outbox's error each map it the same way, a database failure as the
/// database's error, the others as a migration error that this type's text describes.
///
/// Nothing of a failed version was applied where the database runs DDL in transactions;
/// elsewhere the failing version's script stands as far as it got, and the next run starts
/// that version again.
// `pub` for the sealed trait's signatures; the module is private, so no user can reach it.
#[allow(unreachable_pub)]
#[derive(Debug, thiserror::Error)]
pub enum MigrationError {
    /// The database failed outside a version's script.
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
    /// A version's script failed.
    #[error("version {version}: {source}")]
    Script {
        /// The version whose script failed.
        version: i64,
        /// What the database said.
        source: sqlx::Error,
    },
    /// The lock that serialises migrators was not granted in time.
    #[error("the lock that serialises migrators was not granted")]
    LockRefused,
}

impl From<MigrationError> for Error {
    fn from(error: MigrationError) -> Self {
        match error {
            MigrationError::Sql(error) => Self::Database(error),
            failed => Self::Migration(failed.to_string()),
        }
    }
}

/// `async fn apply(pool, schema) -> Result<(), MigrationError>` for `$db`: applies `schema`'s
/// versions newer than the recorded one, on one connection of `pool`. Written once here,
/// expanded in each database's module, where the types are concrete.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
macro_rules! runner {
    ($db:ty) => {
        async fn apply(
            pool: &sqlx::Pool<$db>,
            schema: &$crate::backend::migrate::Schema<$db>,
        ) -> Result<(), $crate::backend::MigrationError> {
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
        ) -> Result<(), $crate::backend::MigrationError> {
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
                    return Err($crate::backend::MigrationError::LockRefused);
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
                    .map_err(|source| $crate::backend::MigrationError::Script {
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
