//! What the bench needs of each database.

use axum_idempotency::Backend;
use sqlx::Pool;

/// What the bench needs of a database beyond the crate's public API: emptying the outbox between
/// runs and reading how many messages are delivered.
pub(crate) trait Store: Backend {
    const LABEL: &'static str;
    fn clear(pool: &Pool<Self>) -> impl Future<Output = ()> + Send;
    /// Delivered messages and the attempts spent on them.
    fn delivered(pool: &Pool<Self>) -> impl Future<Output = (i64, i64)> + Send;
}

const DELIVERED: &str = "SELECT COUNT(*), CAST(COALESCE(SUM(attempts), 0) AS BIGINT) \
     FROM idempotency_outbox WHERE status = 'delivered'";

/// Implements [`Store`] for one database, naming its concrete sqlx type (a generic impl would
/// need higher-ranked bounds); `$clear` is how it empties the outbox.
macro_rules! store {
    ($db:ty, $label:literal, $clear:literal) => {
        impl Store for $db {
            const LABEL: &'static str = $label;
            async fn clear(pool: &Pool<Self>) {
                sqlx::query($clear)
                    .execute(pool)
                    .await
                    .expect("empty the outbox");
            }
            async fn delivered(pool: &Pool<Self>) -> (i64, i64) {
                sqlx::query_as(DELIVERED)
                    .fetch_one(pool)
                    .await
                    .expect("count delivered")
            }
        }
    };
}

store!(sqlx::Sqlite, "SQLite", "DELETE FROM idempotency_outbox");
// TRUNCATE rather than DELETE: no dead tuples left for the next run's claims to skip.
#[cfg(feature = "postgres")]
store!(sqlx::Postgres, "PostgreSQL", "TRUNCATE idempotency_outbox");
