//! SQLite databases of a test's own, each a file in a temporary directory, and an outbox on
//! one.

use std::path::Path;

use sqlx::SqlitePool;

/// A pool on the SQLite file `name` in `dir`, created if missing.
pub(crate) async fn file_pool(dir: &Path, name: &str) -> SqlitePool {
    let url = format!("sqlite://{}?mode=rwc", dir.join(name).display());
    SqlitePool::connect(&url).await.expect("a SQLite file")
}

/// An outbox, migrated, on a SQLite file of its own that lives as long as this value.
#[cfg(feature = "outbox")]
pub(crate) struct TempOutbox {
    pub(crate) outbox: axum_idempotency::outbox::Outbox<sqlx::Sqlite>,
    pub(crate) pool: SqlitePool,
    _dir: tempfile::TempDir,
}

#[cfg(feature = "outbox")]
impl TempOutbox {
    pub(crate) async fn new() -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let pool = file_pool(dir.path(), "outbox.db").await;
        let outbox = axum_idempotency::outbox::Outbox::new(pool.clone());
        outbox.migrate().await.unwrap();
        Self {
            outbox,
            pool,
            _dir: dir,
        }
    }

    /// Enqueues `message` outside any business transaction.
    pub(crate) async fn enqueue(
        &self,
        message: axum_idempotency::outbox::Message,
    ) -> axum_idempotency::outbox::MessageId {
        let mut conn = self.pool.acquire().await.unwrap();
        self.outbox.enqueue(&mut conn, message).await.unwrap()
    }

    /// Enqueues `message` and gives back its stored record, as the dispatcher hands it to a
    /// sender.
    pub(crate) async fn record(
        &self,
        message: axum_idempotency::outbox::Message,
    ) -> axum_idempotency::outbox::OutboxRecord {
        let id = self.enqueue(message).await;
        self.outbox.status(id).await.unwrap().unwrap()
    }
}
