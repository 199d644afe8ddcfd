//! Errors the outbox reports to the application (for operators; never shown to clients).

use super::DownstreamKey;
use crate::backend::MigrationError;

/// An outbox operation that did not complete.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The database refused or lost the operation; the caller's transaction should roll back.
    #[error("outbox database operation failed")]
    Database(#[from] sqlx::Error),
    /// [`Outbox::migrate`](super::Outbox::migrate) did not complete: a version's script failed
    /// (the message names the version and the database's error), or the lock that serialises
    /// migrators was not granted.
    #[error("outbox migration failed: {0}")]
    Migration(String),
    /// The downstream key is already enqueued with another topic or payload: two different
    /// intents were given the same key, and sending either would be wrong for the other.
    #[error("downstream key {0} is already enqueued with another topic or payload")]
    KeyReused(DownstreamKey),
    /// The message's [ordering key](super::Message::ordering_key) is empty or longer than 255
    /// characters; nothing was written.
    #[error("an ordering key must be 1-255 characters")]
    InvalidOrderingKey,
    /// The message's [topic](super::Message::topic) is empty or longer than 255 characters;
    /// nothing was written.
    #[error("a topic must be 1-255 characters")]
    InvalidTopic,
}

// Mapped as the store's `Error` maps it: a database failure stays one, the rest is a migration
// error whose text says which version failed, or that the lock was not granted.
impl From<MigrationError> for Error {
    fn from(error: MigrationError) -> Self {
        match error {
            MigrationError::Sql(error) => Self::Database(error),
            failed => Self::Migration(failed.to_string()),
        }
    }
}
