//! Where records live: [`SqliteStore`], [`PgStore`] and [`MySqlStore`].
//!
//! Records sit in their own table, `idempotency_records`, keyed by the SHA-256 digest of the
//! scoped key, so a client's key can never touch a business row or another record's fields.
//! A store is a handle on the pool the handlers write through: the claim, the handler's rows
//! and the stored response share one transaction of that pool.
//!
//! Create the tables with `migrate()` at start-up; it is safe to call from several instances
//! at once. The SQL it runs ships in the repository under `migrations/<backend>/`, for teams
//! that prefer their own migration tool.
//!
//! Expired records are purged explicitly, never implicitly: call `purge_expired()` from a job
//! of your own, or let `spawn_purger(every)` do it on an interval. Both delete in small
//! batches, so no statement holds long locks, and rest after each batch at least as long as it
//! took, so a purge beside live traffic takes at most about half of one connection's time. An
//! expired record that has not been purged yet is already treated as absent, and its key as a
//! new intent.
//!
//! How a backend claims a key (statements, lock waits, error codes) is internal to this crate
//! and may change in any release without a change to these types.

#[cfg(any(feature = "postgres", feature = "mysql"))]
mod literal;
mod protocol;
mod sql;

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;
#[cfg(test)]
mod tests;

#[cfg(feature = "mysql")]
pub use mysql::MySqlStore;
#[cfg(feature = "postgres")]
pub use postgres::PgStore;
#[cfg(feature = "sqlite")]
pub use sqlite::SqliteStore;

pub(crate) use protocol::{BeganClaim, LeaseClaim, NewRecord, Opened, Protocol};

/// A store an [`Engine`](crate::Engine) or an [`IdempotencyLayer`](crate::IdempotencyLayer)
/// keeps records in: [`SqliteStore`], [`PgStore`] or [`MySqlStore`], each behind the cargo
/// feature of its database's name.
///
/// The trait is sealed and has nothing to call: it names the stores this crate implements.
pub trait Store: sealed::Backend {}

pub(crate) mod sealed {
    #![allow(unreachable_pub)] // Reachable only as the supertrait of `Store`.

    use super::Protocol;

    /// What a public store type is underneath: its database and the protocol the engine
    /// drives.
    pub trait Backend: Clone + Send + Sync + 'static {
        /// The sqlx database the records (and the handlers' writes) live in.
        type Database: sqlx::Database;
        /// The protocol the engine drives.
        type Protocol: Protocol<Database = Self::Database>;

        /// The protocol the engine drives.
        fn protocol(&self) -> &Self::Protocol;
    }
}

/// Declares one public store type over [`sql::SqlStore`]: its inherent methods are the whole
/// of what a user calls, the same for every backend.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
macro_rules! store_type {
    ($(#[$doc:meta])* $name:ident($database:ty)) => {
        $(#[$doc])*
        #[derive(Debug, Clone)]
        pub struct $name(crate::store::sql::SqlStore<$database>);

        impl $name {
            /// A store on `pool`, the same pool the handlers' writes go to.
            pub fn new(pool: sqlx::Pool<$database>) -> Self {
                Self(crate::store::sql::SqlStore::new(pool))
            }

            /// The pool this store and the handlers' transactions use.
            pub fn pool(&self) -> &sqlx::Pool<$database> {
                crate::store::Protocol::pool(&self.0)
            }

            /// Creates or upgrades the store's tables; a no-op when they are current. Safe to
            /// call from several instances at once: they migrate one after the other.
            pub async fn migrate(&self) -> Result<(), crate::Error> {
                crate::store::Protocol::migrate(&self.0).await
            }

            /// Deletes every record expired by now; returns how many it deleted.
            ///
            /// It deletes in batches, a thousand records at a time, and after each batch
            /// rests as long as the batch took. On SQLite, where every claim waits for the one
            /// write lock a batch holds, a batch is 250 records. On MySQL a batch is 250
            /// records and the rest twice as long, because InnoDB finishes a delete in the
            /// background after the statement returns. Beside live traffic a purge therefore
            /// holds a connection at most about half the time (a third on MySQL), and the
            /// requests' tail latency stays close to what it is without a purge; a large
            /// backlog takes at least twice as long to clear as back-to-back deletes would
            /// (several times on SQLite and MySQL). The pace is the same whether the call comes from
            /// [`spawn_purger`](Self::spawn_purger) or from a job of your own, since both run
            /// beside the service. To clear a backlog faster while the service is stopped,
            /// delete from `idempotency_records` where `expires_at` (milliseconds since the
            /// Unix epoch) is past, in SQL of your own.
            pub async fn purge_expired(&self) -> Result<u64, crate::Error> {
                crate::store::Protocol::purge_expired(&self.0).await
            }

            /// Spawns a task that purges expired records every `every`, logging what it
            /// deleted and any failure, and going on. Abort the returned handle to stop it.
            ///
            /// Each run is a paced [`purge_expired`](Self::purge_expired); one that outlasts
            /// `every` delays the next rather than overlapping it.
            pub fn spawn_purger(&self, every: std::time::Duration) -> tokio::task::JoinHandle<()> {
                self.0.spawn_purger(every)
            }
        }

        impl crate::store::sealed::Backend for $name {
            type Database = $database;
            type Protocol = crate::store::sql::SqlStore<$database>;

            fn protocol(&self) -> &Self::Protocol {
                &self.0
            }
        }

        impl crate::store::Store for $name {}
    };
}
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
use store_type;
