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

impl Store for sqlx::Sqlite {
    const LABEL: &'static str = "SQLite";
    async fn clear(pool: &Pool<Self>) {
        sqlx::query("DELETE FROM idempotency_outbox")
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

#[cfg(feature = "postgres")]
impl Store for sqlx::Postgres {
    const LABEL: &'static str = "PostgreSQL";
    async fn clear(pool: &Pool<Self>) {
        // TRUNCATE rather than DELETE: no dead tuples left for the next run's claims to skip.
        sqlx::query("TRUNCATE idempotency_outbox")
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
