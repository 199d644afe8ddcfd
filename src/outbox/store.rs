//! The outbox table as the application sees it: create it, enqueue into it, read it back.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use sqlx::Pool;

use super::handoff::{Handoff, Reserved};
use super::wake::{Notify, Wake};
use super::{DownstreamKey, EnqueueTarget, Error, Message, MessageId, OutboxRecord};
use crate::Backend;
#[cfg(feature = "test-util")]
use crate::ManualClock;
use crate::backend::ClaimedMessage;
use crate::backend::Lease;
use crate::clock::{Clock, Millis};
use crate::message::valid_name;

/// The default [`Outbox::retention`]: a week, long past any client's retries of the request
/// that enqueued a message.
const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);
/// Rows per purge statement.
const PURGE_BATCH: i64 = 500;

/// Handle on the `idempotency_outbox` table of one database; cheap to clone.
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use axum_idempotency::outbox::{DownstreamKey, Message, Outbox};
/// use sqlx::SqlitePool;
///
/// let pool = SqlitePool::connect("sqlite:app.db?mode=rwc").await?;
/// let outbox = Outbox::new(pool.clone());
/// outbox.migrate().await?;
///
/// let mut tx = pool.begin().await?;
/// // … the business writes, in `tx` …
/// let key = DownstreamKey::new("nightly-report-2024-05-01")?;
/// let id = outbox.enqueue(&mut tx, Message::new("reports", key, "payload")).await?;
/// tx.commit().await?; // only now can a dispatcher see the message
/// outbox.wake(); // a transaction of your own: the dispatchers are told after its commit
///
/// let record = outbox.status(id).await?;
/// # Ok(()) }
/// ```
///
/// # Waking the dispatchers
///
/// The [`Dispatcher`](super::Dispatcher)s of an outbox and of its clones share one wake
/// signal. A message enqueued on the handler's [`Tx`](crate::Tx) (`outbox.enqueue(&mut tx,
/// …)`) reaches them as soon as whatever commits that transaction (the layer, the engine, the
/// inbox) has committed it, never before: handed to one of them, which sends it at once with
/// no claim, or, where none has room, by a wake and a claim (see [the module's
/// docs](super#waking-the-dispatchers)). A message enqueued on a transaction of your own
/// needs [`wake`](Self::wake) after its commit. Other processes find it at their next poll,
/// unless they listen (PostgreSQL, below).
#[cfg_attr(
    feature = "postgres",
    doc = "\nOn PostgreSQL, [`notify_on_commit`](Self::notify_on_commit) and \
           [`Dispatcher::listen`](super::Dispatcher::listen) wake the dispatchers of every \
           process."
)]
pub struct Outbox<DB: Backend> {
    pool: Pool<DB>,
    // One purge at a time per outbox (and its clones): two would only race for the same rows.
    purging: Arc<tokio::sync::Mutex<()>>,
    retention: Duration,
    // The dispatchers' writes, one at a time on a database with one writer.
    writing: Arc<tokio::sync::Mutex<()>>,
    wake: Wake,
    handoff: Handoff,
    notify: Option<Notify<DB>>,
    /// What "now" is for enqueuing, delivery, retries, leases, budgets and the purge: the
    /// wall clock, or a test's.
    clock: Clock,
}

impl<DB: Backend> Outbox<DB> {
    /// An outbox whose table lives in `pool`'s database.
    #[must_use]
    pub fn new(pool: Pool<DB>) -> Self {
        Self {
            pool,
            purging: Arc::default(),
            writing: Arc::default(),
            retention: DEFAULT_RETENTION,
            wake: Wake::new(),
            handoff: Handoff::default(),
            notify: None,
            clock: Clock::System,
        }
    }

    /// Creates the outbox's table, or upgrades it to this version's schema: applies the schema
    /// versions not yet recorded in `idempotency_outbox_schema_versions`.
    ///
    /// Idempotent, and safe when several instances of the app start at the same time.
    pub async fn migrate(&self) -> Result<(), Error> {
        DB::migrate_outbox(&self.pool).await.map_err(Error::from)
    }

    /// Writes `message` as pending on `target`, inside whatever transaction `target` is in.
    ///
    /// Pass the handler's [`Tx`](crate::Tx) (`&mut tx`): the message then commits or rolls
    /// back with the business rows, no dispatcher can see it before the commit, and the
    /// commit hands it to one of this outbox's dispatchers in this process, or wakes them.
    /// On a transaction or connection of your own, call [`wake`](Self::wake) after its commit
    /// (see [`EnqueueTarget`]).
    ///
    /// Enqueuing a message whose downstream key is already present returns the existing
    /// message's id when topic and payload are the same (a replayed job enqueues nothing new),
    /// and [`Error::KeyReused`] when they differ.
    ///
    /// A message with an [ordering key](Message::ordering_key) holds that key until
    /// `target`'s transaction ends, so that ids follow commit order within a key (see [Order
    /// per key](super#order-per-key)); an invalid ordering key is
    /// [`Error::InvalidOrderingKey`], and an invalid topic [`Error::InvalidTopic`].
    pub async fn enqueue(
        &self,
        target: impl EnqueueTarget<DB>,
        message: Message,
    ) -> Result<MessageId, Error> {
        check(&message)?;
        let mut target = target;
        // Where the crate commits the transaction, a dispatcher of this process with room takes
        // the message at the commit; a key's order needs a claim's check.
        let now = self.now();
        let reserved = if target.commits_here() && message.ordering().is_none() {
            self.handoff.reserve(now)
        } else {
            None
        };
        let handed = reserved.as_ref().map(Reserved::handed);
        let conn = target.connection();
        if let Some(id) = DB::insert(conn, &message, now, handed).await? {
            if let Some(notify) = self.notify {
                notify(conn).await?;
            }
            match reserved {
                Some(reserved) => {
                    let claimed = ClaimedMessage {
                        record: message.handed_over(id, now.into()),
                        attempt_begun: true,
                    };
                    let outbox = self.clone();
                    target.after_commit(move || {
                        if let Some(lease) = reserved.hand(claimed) {
                            tokio::spawn(async move { outbox.release_unheard(lease).await });
                        }
                    });
                }
                None => {
                    let wake = self.wake.clone();
                    target.after_commit(move || wake.wake());
                }
            }
            return Ok(id);
        }
        match DB::fetch_by_key(conn, message.key()).await? {
            Some(existing)
                if existing.topic == message.topic() && existing.payload == message.payload() =>
            {
                Ok(existing.id)
            }
            _ => Err(Error::KeyReused(message.key().clone())),
        }
    }

    /// The message with this id, as last recorded.
    pub async fn status(&self, id: MessageId) -> Result<Option<OutboxRecord>, Error> {
        let mut conn = self.pool.acquire().await?;
        Ok(DB::fetch_by_id(&mut conn, id).await?)
    }

    /// The message with this downstream key, as last recorded.
    pub async fn status_by_key(&self, key: &DownstreamKey) -> Result<Option<OutboxRecord>, Error> {
        let mut conn = self.pool.acquire().await?;
        Ok(DB::fetch_by_key(&mut conn, key).await?)
    }

    /// How long a delivered or skipped message is kept, for its status and its downstream
    /// key's deduplication (7 days unless set). Keep it at least as long as a caller may still
    /// ask for a message's status, and longer than a client may retry the request that
    /// enqueued it: a retry after the purge finds the request's record, if that is still kept,
    /// and never enqueues again.
    #[must_use]
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// Deletes the delivered and skipped messages that finished longer ago than the
    /// [`retention`](Self::retention), a bounded batch per statement (so no statement holds
    /// many locks), until none is left; returns how many.
    ///
    /// Pending and failed messages are never purged. A purge already running on this outbox
    /// (or a clone) makes this call return `Ok(0)` at once.
    ///
    /// ```
    /// # async fn run(outbox: axum_idempotency::outbox::Outbox<sqlx::Sqlite>) -> Result<(), axum_idempotency::outbox::Error> {
    /// use std::time::Duration;
    /// let purged = outbox.retention(Duration::from_secs(3 * 24 * 3600)).purge_expired().await?;
    /// # let _ = purged; Ok(()) }
    /// ```
    pub async fn purge_expired(&self) -> Result<u64, Error> {
        let Ok(_running) = self.purging.try_lock() else {
            return Ok(0);
        };
        let before = self.now().before(self.retention);
        let mut purged = 0;
        loop {
            let deleted = DB::purge_finished(&self.pool, before, PURGE_BATCH).await?;
            purged += deleted;
            if deleted < PURGE_BATCH.unsigned_abs() {
                return Ok(purged);
            }
        }
    }

    /// Spawns a task that purges expired messages every `every`, logging what it deleted and
    /// any failure, and going on. Abort the returned handle to stop it.
    ///
    /// Each run is a [`purge_expired`](Self::purge_expired); one that outlasts `every` delays
    /// the next rather than overlapping it.
    pub fn spawn_purger(&self, every: Duration) -> tokio::task::JoinHandle<()> {
        let outbox = self.clone();
        tokio::spawn(async move {
            let mut interval = tokio::time::interval(every);
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                interval.tick().await;
                match outbox.purge_expired().await {
                    Ok(0) => {}
                    Ok(deleted) => tracing::info!(deleted, "purged finished outbox messages"),
                    Err(error) => tracing::warn!(%error, "purging outbox messages failed"),
                }
            }
        })
    }

    /// Puts a failed message back to pending, due now, with its attempts and its time budget
    /// counted afresh, once the cause of its failure is fixed. `false` when it is not failed (pending,
    /// delivered, or unknown). Its downstream key is unchanged, so a downstream that did see
    /// an earlier attempt still applies it once; if its last outcome was unknown, the next
    /// attempt looks it up first.
    pub async fn requeue(&self, id: MessageId) -> Result<bool, Error> {
        Ok(DB::requeue(&self.pool, id, self.now()).await?)
    }

    /// Sets a failed message aside for good, as [`Status::Skipped`], so that the later
    /// messages of its [ordering key](Message::ordering_key) go on without it; `false` when it
    /// is not failed. It is never sent again: skip only a message whose effect is no longer
    /// wanted or was brought about another way, and [`requeue`](Self::requeue) one that
    /// should still happen.
    ///
    /// ```
    /// # async fn run(outbox: axum_idempotency::outbox::Outbox<sqlx::Sqlite>, id: axum_idempotency::outbox::MessageId) -> Result<(), axum_idempotency::outbox::Error> {
    /// // The order's "paid" event failed for good, and the order was settled by hand:
    /// // its "refunded" event may go.
    /// if let Some(blocker) = outbox.blocked_by(id).await? {
    ///     outbox.skip(blocker.id).await?;
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// [`Status::Skipped`]: super::Status::Skipped
    pub async fn skip(&self, id: MessageId) -> Result<bool, Error> {
        Ok(DB::skip(&self.pool, id, self.now()).await?)
    }

    /// The message that holds `id` back, if one does: the first message enqueued before it
    /// with the same [ordering key](Message::ordering_key) that is still pending (due,
    /// waiting for a retry, or being sent) or failed. `None` for a message without an ordering
    /// key, for one first in its key's line, and for an unknown id.
    ///
    /// A failed blocker waits for an operator: [`requeue`](Self::requeue) it, or
    /// [`skip`](Self::skip) it.
    pub async fn blocked_by(&self, id: MessageId) -> Result<Option<OutboxRecord>, Error> {
        let mut conn = self.pool.acquire().await?;
        Ok(DB::fetch_blocker(&mut conn, id).await?)
    }

    /// Makes the [`Dispatcher`](super::Dispatcher)s of this outbox and its clones in this
    /// process poll now: call it after committing a transaction of your own that enqueued.
    /// Messages enqueued on the handler's [`Tx`](crate::Tx) need no call.
    ///
    /// Never call it before the commit: a dispatcher woken then finds nothing yet, and the
    /// message waits for its next poll. A wake that comes while a dispatcher is busy (claims
    /// under way may have read the table before the commit) makes it claim again as soon as
    /// it has room, whatever those claims find.
    ///
    /// ```
    /// # fn run(outbox: axum_idempotency::outbox::Outbox<sqlx::Sqlite>) {
    /// // … `tx.commit().await?` of a transaction that enqueued …
    /// outbox.wake();
    /// # }
    /// ```
    pub fn wake(&self) {
        self.wake.wake();
    }

    /// Reads the time from `clock` instead of the wall clock, for this outbox, its clones made
    /// from now on and their [`Dispatcher`](super::Dispatcher)s: enqueue times, due times,
    /// retries, leases, lookup graces, time budgets and the purge's retention move only when
    /// the test moves it. Give the same clock to the engine or layer
    /// ([`Engine::timed_by`](crate::Engine::timed_by)) and records and messages age together.
    /// For tests.
    ///
    /// Only what is stored is timed by it: a dispatcher still sleeps its poll interval, and
    /// renews its leases and bounds its sends, in real time.
    ///
    /// ```
    /// # fn run(pool: sqlx::SqlitePool) {
    /// use std::time::SystemTime;
    /// use axum_idempotency::ManualClock;
    /// use axum_idempotency::outbox::Outbox;
    ///
    /// let clock = ManualClock::new(SystemTime::now());
    /// let outbox = Outbox::new(pool).timed_by(clock.clone());
    /// # let _ = outbox;
    /// # }
    /// ```
    #[cfg(feature = "test-util")]
    #[must_use]
    pub fn timed_by(mut self, clock: ManualClock) -> Self {
        self.clock = clock.into();
        self
    }

    pub(crate) fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    /// The time by this outbox's clock.
    pub(crate) fn now(&self) -> Millis {
        self.clock.now()
    }

    /// The clock this outbox and its dispatchers read.
    pub(crate) fn clock(&self) -> &Clock {
        &self.clock
    }

    pub(crate) fn wake_signal(&self) -> &Wake {
        &self.wake
    }

    /// Where a commit hands its messages to this outbox's dispatchers in this process.
    pub(crate) fn handoff(&self) -> &Handoff {
        &self.handoff
    }

    /// Gives back a committed message whose dispatcher stopped before taking it from its desk,
    /// its attempt not counted, and wakes the dispatchers: otherwise it waits out the lease it
    /// was written with before any dispatcher may claim it.
    async fn release_unheard(&self, lease: Lease) {
        let released = {
            let _turn = self.write_turn().await;
            DB::release_unsent(&self.pool, &[lease]).await
        };
        match released {
            Ok(_) => self.wake(),
            Err(error) => tracing::warn!(
                message = %lease.id,
                %error,
                "outbox message handed to a dispatcher that had stopped was not given back; \
                 it is sent once its lease runs out"
            ),
        }
    }

    /// Waits for the dispatchers' turn to write, on a database that takes one writer at a time
    /// (SQLite): the dispatchers of this outbox and its clones then queue here, in order,
    /// rather than in SQLite's busy handler, which sleeps between its tries.
    pub(crate) async fn write_turn(&self) -> Option<tokio::sync::MutexGuard<'_, ()>> {
        if DB::ONE_WRITER {
            Some(self.writing.lock().await)
        } else {
            None
        }
    }
}

impl<DB: Backend> Clone for Outbox<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            purging: Arc::clone(&self.purging),
            retention: self.retention,
            writing: Arc::clone(&self.writing),
            wake: self.wake.clone(),
            handoff: self.handoff.clone(),
            notify: self.notify,
            clock: self.clock.clone(),
        }
    }
}

#[cfg(feature = "postgres")]
impl Outbox<sqlx::Postgres> {
    /// Also wakes the dispatchers of other processes: each enqueue issues PostgreSQL's
    /// `NOTIFY` in its transaction, which PostgreSQL delivers only when that transaction
    /// commits (several messages of one transaction make one notification), to the
    /// dispatchers built with [`Dispatcher::listen`](super::Dispatcher::listen). Off by
    /// default.
    ///
    /// It does not pass a transaction-mode pooler (PgBouncer's `pool_mode = transaction`, and
    /// the poolers that work alike): the notification is sent, but a listener behind such a
    /// pooler hears nothing, and its dispatchers fall back to polling. Listening dispatchers
    /// connect to the database directly or through a session-mode pooler. Each commit that
    /// notifies also takes PostgreSQL's notification queue lock briefly, which serializes the
    /// commits that notify.
    ///
    /// ```
    /// # fn run(pool: sqlx::PgPool) {
    /// use axum_idempotency::outbox::Outbox;
    ///
    /// let outbox = Outbox::new(pool).notify_on_commit();
    /// # let _ = outbox;
    /// # }
    /// ```
    #[must_use]
    pub fn notify_on_commit(mut self) -> Self {
        self.notify = Some(super::wake::pg_notify);
        self
    }
}

impl<DB: Backend> fmt::Debug for Outbox<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Outbox").finish_non_exhaustive()
    }
}

/// Whether `message` can be enqueued: its topic and ordering key are valid.
pub(crate) fn check(message: &Message) -> Result<(), Error> {
    if !valid_name(message.topic()) {
        return Err(Error::InvalidTopic);
    }
    if message.ordering().is_some_and(|key| !valid_name(key)) {
        return Err(Error::InvalidOrderingKey);
    }
    Ok(())
}
