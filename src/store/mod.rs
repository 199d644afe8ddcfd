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

#[cfg(test)]
mod tests;

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::{Pool, Transaction};
use tokio::sync::OnceCell;

use crate::backend::{Backend, Claimed, PurgePace};
use crate::clock::{Clock, Millis};
use crate::error::Error;
use crate::record::{LeaseClaim, NewRecord, Record, RecordState, StoredResponse};
use crate::scope::ScopedKey;

pub(crate) use crate::backend::{is_conflict_abort, is_unreachable};

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
    pool: Pool<DB>,
    /// Set once the schema is known to be current, by a check or a migration, and shared by
    /// the store's clones: the check costs one look at the database per store, not per request.
    schema_current: Arc<OnceCell<()>>,
    /// What "now" is for retention, leases and the purge: the wall clock, or a test's.
    clock: Clock,
}

impl<DB: Backend> Store<DB> {
    /// A store on `pool`, the same pool the handlers' writes go to.
    pub fn new(pool: Pool<DB>) -> Self {
        Self {
            pool,
            schema_current: Arc::default(),
            clock: Clock::System,
        }
    }

    /// The pool this store and the handlers' transactions use.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    /// Creates or upgrades the store's tables; a no-op when they are current. Safe to call from
    /// several instances at once: they migrate one after the other.
    pub async fn migrate(&self) -> Result<(), Error> {
        DB::migrate_records(&self.pool).await?;
        // Already set by a check that passed, or being set by one now: either way it is true.
        let _ = self.schema_current.set(());
        Ok(())
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
        self.schema_current().await?;
        let now = self.clock.now();
        let PurgePace { batch: limit, rest } = DB::PURGE_PACE;
        let mut total = 0;
        loop {
            let started = Instant::now();
            let deleted = DB::purge_batch(&self.pool, now, limit).await?;
            total += deleted;
            if deleted < u64::from(limit) {
                return Ok(total);
            }
            tokio::time::sleep(started.elapsed() * rest).await;
        }
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
            pool: self.pool.clone(),
            schema_current: self.schema_current.clone(),
            clock: self.clock.clone(),
        }
    }
}

impl<DB: Backend> fmt::Debug for Store<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Store").field("pool", self.pool()).finish()
    }
}

/// What [`Store::open`] found under a key.
#[derive(Debug)]
pub(crate) enum Opened<DB: sqlx::Database> {
    /// A live record holds the key: answer from it.
    Live(Record),
    /// No live record: a transaction is begun to claim the key in.
    Claimable {
        tx: Transaction<'static, DB>,
        /// Whether an expired record is being replaced.
        expired: bool,
    },
}

/// What a claim keeps under its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Keep {
    /// A record, written with the outcome when the claim's transaction commits.
    Record,
    /// The key alone, as a dedupe key: no record, no response (see `Engine::keys_only`).
    Key,
}

/// How many times a dedupe key's claim runs in all while the database picks it as a deadlock
/// victim.
const KEY_CLAIM_ATTEMPTS: u32 = 3;

/// The steps the engine drives: each checks the schema first where it is the first use of the
/// store, and leaves the how to the database's backend.
impl<DB: Backend> Store<DB> {
    /// Fails with [`Error::SchemaOutdated`] while the schema is older than this code: every
    /// claim would fail on a missing table, column or function, and a client would retry in
    /// vain. Checked on the store's first use, and again on each use until it passes, so a
    /// migration run meanwhile by another instance is noticed without a restart.
    async fn schema_current(&self) -> Result<(), Error> {
        if self.schema_current.initialized() {
            return Ok(());
        }
        self.schema_current
            .get_or_try_init(|| DB::check_schema(&self.pool))
            .await
            .copied()
    }

    /// Reads a committed record outside any transaction: the fast path for replays.
    pub(crate) async fn lookup(&self, key: &ScopedKey) -> Result<Option<Record>, Error> {
        self.schema_current().await?;
        let mut conn = self.pool.acquire().await?;
        DB::find(&mut conn, key).await
    }

    /// Reads the record under `key` and, unless it is live at `now`, begins a transaction to
    /// claim the key in, its lock waits bounded by `wait`.
    pub(crate) async fn open(
        &self,
        key: &ScopedKey,
        now: Millis,
        wait: Duration,
    ) -> Result<Opened<DB>, Error> {
        match self.lookup(key).await? {
            Some(record) if !record.is_expired(now) => Ok(Opened::Live(record)),
            // The read's connection went back to the pool and the claim's transaction takes
            // one afresh, through sqlx's public API: beginning on the very connection needs a
            // call sqlx hides from its docs. The extra checkout is paid only here, for a key
            // this instance saw lately that holds no live record: a retry after a retryable
            // failure.
            found => Ok(Opened::Claimable {
                tx: DB::begin(&self.pool, wait).await?,
                expired: found.is_some(),
            }),
        }
    }

    /// Claims `record`'s key, keeping what `keep` says, in `begun` (from [`open`](Self::open))
    /// if given; or reads the live record that holds it. A concurrent claimer is waited for
    /// within `wait` ([`Error::Busy`] past it). How is the database's own algorithm.
    pub(crate) async fn claim(
        &self,
        record: &NewRecord<'_>,
        keep: Keep,
        wait: Duration,
        begun: Option<Transaction<'static, DB>>,
    ) -> Result<Claimed<DB>, Error> {
        self.schema_current().await?;
        match keep {
            Keep::Record => DB::claim_record(&self.pool, record, wait, begun).await,
            Keep::Key => self.claim_key(record, wait).await,
        }
    }

    /// Claims the record's key alone, as a dedupe key; a deadlock victim claims again.
    async fn claim_key(
        &self,
        record: &NewRecord<'_>,
        wait: Duration,
    ) -> Result<Claimed<DB>, Error> {
        for _ in 0..KEY_CLAIM_ATTEMPTS {
            let claimed = DB::claim_key(
                &self.pool,
                &record.key,
                record.created_at,
                record.expires_at,
                wait,
            )
            .await;
            match claimed {
                Ok(Some(tx)) => return Ok(Claimed::Ours(tx)),
                Ok(None) => return Ok(Claimed::Held),
                Err(Error::Conflict) => {}
                Err(error) => return Err(error),
            }
        }
        Err(Error::Conflict)
    }

    /// Begins a transaction to claim several dedupe keys in, one after another
    /// ([`claim_key_in`](Self::claim_key_in)), its lock waits bounded by `wait`.
    #[cfg(feature = "inbox")]
    pub(crate) async fn begin_keys(
        &self,
        wait: Duration,
    ) -> Result<Transaction<'static, DB>, Error> {
        self.schema_current().await?;
        DB::begin(&self.pool, wait).await
    }

    /// Claims `record`'s key as a dedupe key in the transaction `conn` is in; `false`, the
    /// transaction unharmed, when a live key holds it.
    #[cfg(feature = "inbox")]
    pub(crate) async fn claim_key_in(
        &self,
        conn: &mut DB::Connection,
        record: &NewRecord<'_>,
        wait: Duration,
    ) -> Result<bool, Error> {
        DB::claim_key_in(
            conn,
            &record.key,
            record.created_at,
            record.expires_at,
            wait,
        )
        .await
    }

    /// Writes `record` under the key claimed in `tx` and commits. [`Error::Conflict`] when a
    /// live record holds the key: the transaction is then rolled back, the work's writes with
    /// it.
    pub(crate) async fn commit_record(
        &self,
        tx: Transaction<'static, DB>,
        record: &NewRecord<'_>,
    ) -> Result<(), Error> {
        DB::commit_record(tx, record).await
    }

    /// Whether a committed dedupe key holds `key` and is live at `now`.
    #[cfg(feature = "inbox")]
    pub(crate) async fn key_held(&self, key: &ScopedKey, now: Millis) -> Result<bool, Error> {
        self.schema_current().await?;
        DB::key_held(&self.pool, key, now).await
    }

    /// Extends a lease held by `lease.owner` to `lease.until`; `false` if it is no longer held.
    pub(crate) async fn renew_lease(
        &self,
        key: &ScopedKey,
        lease: LeaseClaim,
    ) -> Result<bool, Error> {
        DB::renew_lease(&self.pool, key, lease).await
    }

    /// Takes over a processing record whose lease ran out by `now`; `false` if the lease is
    /// still live or someone else took it first.
    pub(crate) async fn take_over_lease(
        &self,
        key: &ScopedKey,
        lease: LeaseClaim,
        now: Millis,
    ) -> Result<bool, Error> {
        DB::take_over_lease(&self.pool, key, lease, now).await
    }

    /// Records the outcome of leased work and ends the lease; `false` if the lease was lost.
    pub(crate) async fn finish_leased(
        &self,
        key: &ScopedKey,
        owner: [u8; 16],
        state: RecordState,
        response: &StoredResponse,
    ) -> Result<bool, Error> {
        DB::finish_leased(&self.pool, key, owner, state, response).await
    }

    /// Deletes the claim of leased work that failed retryably; `false` if the lease was lost.
    pub(crate) async fn release_lease(
        &self,
        key: &ScopedKey,
        owner: [u8; 16],
    ) -> Result<bool, Error> {
        DB::release_lease(&self.pool, key, owner).await
    }

    /// Deletes the record under `key`, whatever its state: an operator's explicit decision.
    /// `false` if there was none.
    pub(crate) async fn forget(&self, key: &ScopedKey) -> Result<bool, Error> {
        self.schema_current().await?;
        DB::forget(&self.pool, key).await
    }
}
