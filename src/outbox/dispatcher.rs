//! The background task that delivers committed messages and records every outcome.

pub(crate) mod decide;
mod flight;
mod metrics;
mod window;

use std::fmt;
use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use super::wake::Listen;
use super::{Error, Outbox, Sender};
use crate::Backend;
use crate::backoff::Backoff;
use decide::Policy;
use flight::Flight;
use window::{Found, Window};

/// Delivers outbox messages through a [`Sender`]: claims due messages under a lease, calls the
/// sender, and records delivered, retry-later or failed.
///
/// Run as many dispatchers as you like, in one process or many: a message is leased by one
/// claim at a time, renewed while its send runs, and a dispatcher that dies mid-send loses
/// its lease within [`lease`](Self::lease) (15 s by default), after which another one looks
/// the message up (or resends it with the same downstream key).
///
/// Each dispatcher keeps up to [`batch_size`](Self::batch_size) sends in flight, and up to twice as
/// many more messages claimed and waiting for a free slot, so a finished send is followed by the
/// next at once rather than after a claim's round trip. Its database work is batched: the claim
/// that leases messages also records their attempts (so a crash right after it still leads to a
/// lookup, never to a blind resend), the outcomes that finish together are recorded in one write,
/// and the leases held are renewed in one write. On SQLite, the dispatchers of one [`Outbox`] (and
/// its clones) write one at a time, queueing in the process rather than in SQLite's lock wait.
///
/// A running dispatcher takes the messages its process commits on the handler's
/// [`Tx`](crate::Tx) straight from the commit, already leased to it, and sends them at once
/// with no claim; the dispatchers of one [`Outbox`] and its clones also share its wake signal,
/// which such a commit raises when none of them has room, so they pick the message up at once
/// however long their [`poll_interval`](Self::poll_interval). See [`Outbox::wake`] for
/// messages enqueued on transactions of your own.
///
/// ```no_run
/// # use axum_idempotency::outbox::{Dispatcher, Outbox, OutboxRecord, SendOutcome, Sender};
/// # struct Provider;
/// # impl Sender for Provider {
/// #     async fn send(&self, _: &OutboxRecord) -> SendOutcome { unimplemented!() }
/// # }
/// # async fn run(outbox: Outbox<sqlx::Sqlite>) {
/// use std::time::Duration;
///
/// let dispatcher = Dispatcher::new(outbox, Provider)
///     .poll_interval(Duration::from_millis(500))
///     .max_attempts(10);
/// let task = tokio::spawn(dispatcher.run(async {
///     let _ = tokio::signal::ctrl_c().await;
/// }));
/// // … serve …
/// task.await.ok();
/// # }
/// ```
pub struct Dispatcher<DB: Backend, S> {
    flight: Flight<DB, S>,
    listen: Listen,
    poll_interval: Duration,
    batch_size: u32,
}

impl<DB: Backend, S: Sender> Dispatcher<DB, S> {
    /// A dispatcher for `outbox` delivering through `sender`, with the defaults below.
    #[must_use]
    pub fn new(outbox: Outbox<DB>, sender: S) -> Self {
        let policy = Policy {
            max_attempts: 10,
            backoff: Backoff::exponential(Duration::from_secs(1), Duration::from_secs(300)),
            lookup_grace: Duration::from_secs(60),
            give_up_after: Duration::from_secs(6 * 60 * 60),
            probe_backoff: Backoff::exponential(Duration::from_secs(1), Duration::from_secs(10)),
        };
        Self {
            flight: Flight::new(outbox, sender, policy),
            listen: Listen::default(),
            poll_interval: Duration::from_secs(1),
            batch_size: 16,
        }
    }

    /// How long to sleep when no message is due; default 1 s. A commit that enqueued on the
    /// handler's [`Tx`](crate::Tx), or [`Outbox::wake`], cuts the sleep short; the interval is
    /// what bounds the wait for messages nothing woke the dispatcher for (those of other
    /// processes, unless it [listens](Self::listen) on PostgreSQL), and the retry of a claim
    /// that failed.
    #[must_use]
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// How many sends the dispatcher keeps in flight at once; default 16. It claims up to
    /// twice as many more ahead, which wait for a free slot (and are given back uncounted at
    /// shutdown), and claims again once a batch is free, so a slow send holds one slot, not a
    /// whole batch. Messages whose outcome is being recorded still hold their lease, so a
    /// dispatcher holds at most four times this many leases. A dispatcher delivers at most
    /// this many messages per round trip of its destination: where a broker's publisher
    /// confirm takes 3 ms, 16 is about 5,000 messages a second. Raise it where a backlog must
    /// drain faster, as far as the destination takes the load.
    #[must_use]
    pub fn batch_size(mut self, size: u32) -> Self {
        self.batch_size = size.max(1);
        self
    }

    /// After how many attempts a message that still did not go through fails for good;
    /// default 10. An attempt is a send the destination answered without doing the work
    /// ([`SendOutcome::Retry`](super::SendOutcome::Retry)) or whose outcome is unknown; an
    /// outage ([`SendOutcome::Unavailable`](super::SendOutcome::Unavailable)) is not one,
    /// however long it lasts, so this cap stops a poison message, never an intent caught in an
    /// outage. The time budget, [`give_up_after`](Self::give_up_after), bounds the rest.
    #[must_use]
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.flight.policy.max_attempts = attempts.max(1);
        self
    }

    /// The wait before a message is sent again, never shorter than a `Retry-After` the sender
    /// reports; default [`Backoff::exponential`]`(1 s, 5 min)`. The same type as the
    /// client's `RetryPolicy::backoff` takes.
    #[must_use]
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.flight.policy.backoff = backoff;
        self
    }

    /// How long one sender call (or lookup) may take before its outcome counts as unknown;
    /// default 30 s.
    #[must_use]
    pub fn send_timeout(mut self, timeout: Duration) -> Self {
        self.flight.send_timeout = timeout;
        self
    }

    /// How long a claim holds a message unless renewed; default 15 s, at least 1 s. A live
    /// dispatcher renews it every third of that while it looks a message up or sends it, so a
    /// slow downstream never lets another dispatcher overtake it; one that dies frees its
    /// messages within this long, and the next claim looks each up before any resend.
    #[must_use]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.flight.lease = lease.max(MIN_LEASE);
        self
    }

    /// After an unknown outcome, how long a lookup that finds nothing is trusted less than the
    /// possibility that the attempt is still running at the downstream: within the grace the
    /// dispatcher waits, after it the message is resent; default 60 s. It counts from the
    /// attempt's `last_attempt_at`: when its send started, once its outcome is recorded; the
    /// claim's time when the dispatcher died before that, which for a message that waited for
    /// a send slot is earlier than its send by that wait (milliseconds while sends are quick,
    /// at most about two send timeouts).
    #[must_use]
    pub fn lookup_grace(mut self, grace: Duration) -> Self {
        self.flight.policy.lookup_grace = grace;
        self
    }

    /// How long after it was enqueued a message that is still not delivered fails for good;
    /// default 6 hours. Outages spend this budget, not attempts.
    ///
    /// It must stay shorter than the time the downstream remembers an idempotency key (24
    /// hours at Stripe) and than the consumers' deduplication retention (`Inbox::retention`):
    /// a message resent after the downstream forgot its key takes effect a second time. Six
    /// hours outlasts the outages a destination usually has, and leaves a day's key retention
    /// four times as long. A message past the budget whose last outcome is unknown is looked up
    /// first (when the sender can) and fails only if the downstream does not hold it.
    #[must_use]
    pub fn give_up_after(mut self, budget: Duration) -> Self {
        self.flight.policy.give_up_after = budget;
        self
    }

    /// The wait between probes of a destination that is unavailable: one message is sent, and
    /// the others wait, until one answers; default [`Backoff::exponential`]`(1 s, 10 s)`, never
    /// earlier than the destination's `Retry-After`. Those waits spend the time budget, not the
    /// messages' attempts. The cap is how long a destination that is back may wait for its
    /// next probe, time its backlog does not drain; a probe is one message, so a short cap
    /// costs the destination little even over hours. A sender that knows when its client has
    /// reconnected (see [`Sender::reconnected`]) cuts the wait short: the next probe goes as
    /// soon as it says so.
    #[must_use]
    pub fn probe_backoff(mut self, backoff: Backoff) -> Self {
        self.flight.policy.probe_backoff = backoff;
        self
    }

    /// Delivers messages until `shutdown` completes.
    ///
    /// Sends run in a sliding window of [`batch_size`](Self::batch_size): as sends finish, the
    /// dispatcher starts the messages it claimed ahead and claims more, and it records outcomes
    /// in batches while other sends go on. Shutdown is graceful: the sends in hand are finished
    /// and recorded (each bounded by the send timeout), the messages claimed but not yet sent
    /// are given back without counting an attempt, as are those a commit hands to the
    /// dispatcher once it has begun to stop, and no more messages are claimed. Database
    /// errors are logged and retried after the poll interval; they never end the loop.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) {
        let mut shutdown = std::pin::pin!(shutdown);
        // Subscribed before the first claim, so a commit after that claim's read is seen.
        let mut woken = self.flight.outbox.wake_signal().subscribe();
        let heard = self.listen.start(self.poll_interval);
        let mut window = Window::new(&self.flight, self.batch_size)
            .probing()
            .handing();
        let mut stopping = false;
        // Set when a claim found less than it asked for (nothing more is due) or failed: no
        // claim before a wake or this time. A wake is taken in at once, even while claims are
        // under way: they may have read the table before its commit, so it is owed a claim
        // that starts after it, which no claim finding little may rest it away.
        let mut resting: Option<Instant> = None;
        loop {
            if !stopping && (resting.is_none() || window.woken()) {
                resting = None;
                window.refill();
            }
            window.settle();
            if stopping && window.is_empty() {
                return;
            }
            let rest = resting.filter(|_| !stopping);
            tokio::select! {
                biased;
                () = &mut shutdown, if !stopping => {
                    stopping = true;
                    window.stop();
                }
                event = window.next() => match window.handle(event) {
                    // Found all it asked for: more is likely due, even if a claim that ran
                    // alongside found less.
                    Some(Ok(Found { claimed, asked })) if claimed >= asked => resting = None,
                    Some(Ok(_)) => resting = Some(Instant::now() + self.poll_interval),
                    None => {}
                    Some(Err(error)) => {
                        tracing::warn!(%error, "outbox claim failed; retrying after the poll interval");
                        resting = Some(Instant::now() + self.poll_interval);
                    }
                },
                // The outbox's sender lives as long as the outbox: this never fails.
                _ = woken.changed(), if !stopping => window.wake(),
                () = heard.notified(), if !stopping => window.wake(),
                () = sleep_until(rest), if rest.is_some() => resting = None,
            }
        }
    }

    /// Claims one batch of due messages, delivers them concurrently and records each outcome;
    /// returns how many were claimed. For jobs and tests that drive delivery themselves.
    pub async fn run_once(&self) -> Result<usize, Error> {
        let mut window = Window::new(&self.flight, self.batch_size);
        window.claim(self.batch_size as usize);
        let mut claimed = 0;
        loop {
            window.settle();
            if window.is_empty() {
                return Ok(claimed);
            }
            let event = window.next().await;
            match window.handle(event) {
                Some(Err(error)) => return Err(error.into()),
                Some(Ok(found)) => claimed = found.claimed,
                None => {}
            }
        }
    }
}

#[cfg(feature = "postgres")]
impl<S: Sender> Dispatcher<sqlx::Postgres, S> {
    /// Also wakes on the commits of other processes: the dispatcher holds a connection of its
    /// own that `LISTEN`s for the notifications of outboxes built with
    /// [`Outbox::notify_on_commit`], and polls as soon as one arrives. Off by default.
    ///
    /// It costs one database connection per listening dispatcher, outside the outbox's pool.
    /// It needs a direct connection or a session-mode pooler: behind a transaction-mode pooler
    /// (PgBouncer's `pool_mode = transaction`) no notification arrives, and the dispatcher
    /// finds messages at its [`poll_interval`](Self::poll_interval) as without listening.
    /// When the connection fails, the dispatcher logs a warning and polls until it has
    /// listened again, which it tries after at most the poll interval (or a second); it then
    /// claims once, for what was notified meanwhile.
    ///
    /// ```
    /// # use axum_idempotency::outbox::{Dispatcher, Outbox, OutboxRecord, SendOutcome, Sender};
    /// # struct Provider;
    /// # impl Sender for Provider {
    /// #     async fn send(&self, _: &OutboxRecord) -> SendOutcome { unimplemented!() }
    /// # }
    /// # fn run(pool: sqlx::PgPool) {
    /// let outbox = Outbox::new(pool).notify_on_commit();
    /// let dispatcher = Dispatcher::new(outbox, Provider).listen();
    /// # let _ = dispatcher;
    /// # }
    /// ```
    #[must_use]
    pub fn listen(mut self) -> Self {
        self.listen = Listen::postgres(self.flight.outbox.pool().connect_options());
        self
    }
}

impl<DB: Backend, S> fmt::Debug for Dispatcher<DB, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Dispatcher")
            .field("poll_interval", &self.poll_interval)
            .field("batch_size", &self.batch_size)
            .field("max_attempts", &self.flight.policy.max_attempts)
            .field("backoff", &self.flight.policy.backoff)
            .field("send_timeout", &self.flight.send_timeout)
            .field("lease", &self.flight.lease)
            .field("lookup_grace", &self.flight.policy.lookup_grace)
            .field("give_up_after", &self.flight.policy.give_up_after)
            .field("probe_backoff", &self.flight.policy.probe_backoff)
            .finish_non_exhaustive()
    }
}

/// Sleeps until `deadline`; pending forever without one.
async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// The shortest lease: renewals every third of it must fit a database round trip with room.
const MIN_LEASE: Duration = Duration::from_secs(1);
