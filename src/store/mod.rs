//! Where records live: [`Store`], named by its aliases `SqliteStore`, `PgStore` and
//! `MySqlStore`, each behind the cargo feature of its database's name.
//!
//! Records sit in their own table, `idempotency_records`, keyed by the SHA-256 digest of the
//! scoped key, so a client's key can never touch a business row or another record's fields.
//! A store is a handle on the pool the handlers write through: the claim, the handler's rows
//! and the stored response share one transaction of that pool.
//!
//! Create the tables with `migrate()` at start-up; it is safe to call from several instances
//! at once. The SQL it runs ships in the repository under `migrations/<backend>/`, for teams
//! that prefer their own migration tool (which must then record the versions it applied in
//! `idempotency_schema_versions`: a store checks them on first use and refuses an outdated
//! schema with `Error::SchemaOutdated`).
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

#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
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

pub(crate) use protocol::{BeganClaim, LeaseClaim, NewRecord, Opened, Protocol};

use std::fmt;

use sqlx::Pool;

use crate::backend::Backend;
use crate::error::Error;
use crate::record::Clock;

/// Records in SQLite: embedded, one file, no server.
///
/// SQLite has one writer at a time, so every claim transaction begins `IMMEDIATE`: it takes the
/// write lock up front and waits for it within the layer's in-flight bound (`busy_timeout`). A
/// duplicate therefore queues behind its original and then replays it. Use WAL mode (as below)
/// so replays and reads go on while a writer works. On SQLite a wait that runs out cannot tell
/// the duplicate's original from any other writer; either way the answer is 409
/// `idempotency_request_in_progress`, retryable with the same key.
///
/// ```
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use std::str::FromStr;
/// use axum_idempotency::{IdempotencyLayer, SqliteStore};
/// use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool};
///
/// let options = SqliteConnectOptions::from_str("sqlite::memory:")?
///     .journal_mode(SqliteJournalMode::Wal);
/// let store = SqliteStore::new(SqlitePool::connect_with(options).await?);
/// store.migrate().await?;
/// let layer = IdempotencyLayer::new(store).allow_anonymous();
/// # let _ = layer;
/// # Ok(()) }
/// # tokio::runtime::Runtime::new().unwrap().block_on(run()).unwrap();
/// ```
#[cfg(feature = "sqlite")]
pub type SqliteStore = Store<sqlx::Sqlite>;

/// Records in PostgreSQL: the production backend, for many app instances sharing one database.
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use axum_idempotency::{IdempotencyLayer, PgStore};
///
/// let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/test").await?;
/// let store = PgStore::new(pool);
/// store.migrate().await?;
/// let layer = IdempotencyLayer::new(store).allow_anonymous();
/// # let _ = layer;
/// # Ok(()) }
/// ```
#[cfg(feature = "postgres")]
pub type PgStore = Store<sqlx::Postgres>;

/// Records in MySQL 8 or MariaDB, in an InnoDB table.
///
/// A duplicate of an in-flight request waits on the original's row lock for at most the
/// layer's in-flight bound, set as `innodb_lock_wait_timeout`. That setting takes whole
/// seconds, so the bound is rounded up to the next second (at least 1 s): a duplicate never
/// gives up sooner than configured, and may wait up to a second longer. The connection's own
/// setting is restored right after the claim, for the handler's statements and for the pool.
///
/// Keep the server's `max_allowed_packet` above the layer's `max_response_body` (1 MiB by
/// default), or storing a large response fails.
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use axum_idempotency::{IdempotencyLayer, MySqlStore};
///
/// let pool = sqlx::MySqlPool::connect("mysql://root@127.0.0.1:3306/test").await?;
/// let store = MySqlStore::new(pool);
/// store.migrate().await?;
/// let layer = IdempotencyLayer::new(store).allow_anonymous();
/// # let _ = layer;
/// # Ok(()) }
/// ```
#[cfg(feature = "mysql")]
pub type MySqlStore = Store<sqlx::MySql>;

/// The records table in one database, on the pool the handlers write through: the claim, the
/// handler's rows and the stored response share one transaction of that pool. Cheap to clone.
///
/// Name it by its alias: `SqliteStore`, `PgStore` or `MySqlStore`.
pub struct Store<DB: Backend> {
    protocol: DB::Protocol,
    /// What "now" is for retention, leases and the purge: the wall clock, or a test's.
    clock: Clock,
}

impl<DB: Backend> Store<DB> {
    /// A store on `pool`, the same pool the handlers' writes go to.
    pub fn new(pool: Pool<DB>) -> Self {
        Self {
            protocol: DB::Protocol::on(pool),
            clock: Clock::System,
        }
    }

    /// The pool this store and the handlers' transactions use.
    pub fn pool(&self) -> &Pool<DB> {
        self.protocol.pool()
    }

    /// Creates or upgrades the store's tables; a no-op when they are current. Safe to call from
    /// several instances at once: they migrate one after the other.
    pub async fn migrate(&self) -> Result<(), Error> {
        self.protocol.migrate().await
    }

    /// Deletes every record and inbox key expired by now; returns how many it deleted.
    ///
    /// It deletes in batches, a thousand records at a time, and after each batch rests as long
    /// as the batch took. On SQLite, where every claim waits for the one write lock a batch
    /// holds, a batch is 250 records. On MySQL a batch is 250 records and the rest twice as
    /// long, because InnoDB finishes a delete in the background after the statement returns.
    /// Beside live traffic a purge therefore holds a connection at most about half the time (a
    /// third on MySQL), and the requests' tail latency stays close to what it is without a
    /// purge; a large backlog takes at least twice as long to clear as back-to-back deletes
    /// would (several times on SQLite and MySQL). The pace is the same whether the call comes
    /// from [`spawn_purger`](Self::spawn_purger) or from a job of your own, since both run
    /// beside the service. To clear a backlog faster while the service is stopped, delete from
    /// `idempotency_records` and `idempotency_inbox` (the inbox's keys) where `expires_at`
    /// (milliseconds since the Unix epoch) is past, in SQL of your own.
    pub async fn purge_expired(&self) -> Result<u64, Error> {
        self.protocol.purge_expired(self.clock.now()).await
    }

    /// Spawns a task that purges expired records every `every`, logging what it deleted and any
    /// failure, and going on. Abort the returned handle to stop it.
    ///
    /// Each run is a paced [`purge_expired`](Self::purge_expired); one that outlasts `every`
    /// delays the next rather than overlapping it.
    pub fn spawn_purger(&self, every: std::time::Duration) -> tokio::task::JoinHandle<()> {
        let store = self.clone();
        tokio::spawn(async move {
            let mut interval = tokio::time::interval(every);
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                interval.tick().await;
                match store.purge_expired().await {
                    Ok(0) => {}
                    Ok(deleted) => tracing::info!(deleted, "purged expired idempotency records"),
                    Err(error) => {
                        tracing::warn!(%error, "purging expired idempotency records failed")
                    }
                }
            }
        })
    }

    /// The protocol the engine drives.
    pub(crate) fn protocol(&self) -> &DB::Protocol {
        &self.protocol
    }

    /// The clock this store and the engines on it read.
    pub(crate) fn clock(&self) -> &Clock {
        &self.clock
    }

    /// Reads the time from `clock` from now on, for this handle and its later clones.
    #[cfg(feature = "test-util")]
    pub(crate) fn set_clock(&mut self, clock: Clock) {
        self.clock = clock;
    }
}

impl<DB: Backend> Clone for Store<DB> {
    fn clone(&self) -> Self {
        Self {
            protocol: self.protocol.clone(),
            clock: self.clock.clone(),
        }
    }
}

impl<DB: Backend> fmt::Debug for Store<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Store").field("pool", self.pool()).finish()
    }
}

pub(crate) use sealed::Records;

/// Whether `error` says the database cannot be reached right now rather than that a statement
/// failed: the connection broke or was refused (I/O, TLS), no connection could be had in time,
/// the pool was closed, or the server reported a connection failure or its own shutdown
/// (SQLSTATE class `08`, `57P01`–`57P03`). Nothing about the work is wrong; the same work
/// succeeds once the database is back, so callers treat it as an outage, not as an attempt.
pub(crate) fn is_unreachable(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(database) => database.code().is_some_and(|code| {
            code.starts_with("08") || matches!(&*code, "57P01" | "57P02" | "57P03")
        }),
        _ => false,
    }
}

/// Whether the database aborted the transaction `error` came from to resolve a conflict with a
/// concurrent one (a serialization failure, a deadlock, a Galera certification conflict), as
/// the backends in this build recognise it; SQLite, one writer at a time, has no such aborts.
/// Such a transaction is gone, and running it again is safe.
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql")),
    allow(unused_variables)
)]
pub(crate) fn is_conflict_abort(error: &sqlx::Error) -> bool {
    let Some(database) = error.as_database_error() else {
        return false;
    };
    #[cfg(feature = "postgres")]
    if <sqlx::Postgres as sql::Dialect>::is_conflict(database) {
        return true;
    }
    #[cfg(feature = "mysql")]
    if <sqlx::MySql as sql::Dialect>::is_conflict(database) {
        return true;
    }
    false
}

mod sealed {
    // `pub` inside a private module is the sealed-trait idiom: `Backend` names it as a
    // supertrait while no one outside the crate can implement or call it.
    #![allow(unreachable_pub)]

    use super::Protocol;

    /// How a database keeps idempotency records: the protocol the engine drives.
    pub trait Records: sqlx::Database {
        /// The records table's protocol on this database.
        type Protocol: Protocol<Database = Self>;
    }
}
