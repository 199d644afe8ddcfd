//! The background task that delivers committed messages and records every outcome.

mod metrics;
mod window;

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::backend::{Claim, Claimed, Settlement};
use super::status::{duration_millis, from_millis, now_millis, to_millis};
use super::wake::Listen;
use super::{Error, LookupOutcome, Outbox, OutboxRecord, SendOutcome, Sender, Status};
use crate::Backend;
use crate::backoff::{Backoff, random_u64};
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
/// The dispatchers of one [`Outbox`] and its clones share its wake signal: a message enqueued on
/// the handler's [`Tx`](crate::Tx) wakes them when its transaction commits, so they pick it up
/// at once however long their [`poll_interval`](Self::poll_interval); see
/// [`Outbox::wake`] for messages enqueued on transactions of your own.
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
    outbox: Outbox<DB>,
    sender: Arc<S>,
    listen: Listen,
    poll_interval: Duration,
    batch_size: u32,
    max_attempts: u32,
    backoff: Backoff,
    send_timeout: Duration,
    lease: Duration,
    lookup_grace: Duration,
    give_up_after: Duration,
    probe_backoff: Backoff,
}

impl<DB: Backend, S: Sender> Dispatcher<DB, S> {
    /// A dispatcher for `outbox` delivering through `sender`, with the defaults below.
    #[must_use]
    pub fn new(outbox: Outbox<DB>, sender: S) -> Self {
        Self {
            outbox,
            sender: Arc::new(sender),
            listen: Listen::default(),
            poll_interval: Duration::from_secs(1),
            batch_size: 16,
            max_attempts: 10,
            backoff: Backoff::exponential(Duration::from_secs(1), Duration::from_secs(300)),
            send_timeout: Duration::from_secs(30),
            lease: Duration::from_secs(15),
            lookup_grace: Duration::from_secs(60),
            give_up_after: Duration::from_secs(6 * 60 * 60),
            probe_backoff: Backoff::exponential(Duration::from_secs(1), Duration::from_secs(30)),
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
    /// dispatcher holds at most four times this many leases.
    #[must_use]
    pub fn batch_size(mut self, size: u32) -> Self {
        self.batch_size = size.max(1);
        self
    }

    /// After how many attempts a message that still did not go through fails for good;
    /// default 10. An attempt is a send the destination answered without doing the work
    /// ([`SendOutcome::Retry`]) or whose outcome is unknown; an outage
    /// ([`SendOutcome::Unavailable`]) is not one, however long it lasts, so this cap stops a
    /// poison message, never an intent caught in an outage. The time budget,
    /// [`give_up_after`](Self::give_up_after), bounds the rest.
    #[must_use]
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// The wait before a message is sent again, never shorter than a `Retry-After` the sender
    /// reports; default [`Backoff::exponential`]`(1 s, 5 min)`. The same type as the
    /// client's `RetryPolicy::backoff` takes.
    #[must_use]
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// How long one sender call (or lookup) may take before its outcome counts as unknown;
    /// default 30 s.
    #[must_use]
    pub fn send_timeout(mut self, timeout: Duration) -> Self {
        self.send_timeout = timeout;
        self
    }

    /// How long a claim holds a message unless renewed; default 15 s, at least 1 s. A live
    /// dispatcher renews it every third of that while it looks a message up or sends it, so a
    /// slow downstream never lets another dispatcher overtake it; one that dies frees its
    /// messages within this long, and the next claim looks each up before any resend.
    #[must_use]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease.max(MIN_LEASE);
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
        self.lookup_grace = grace;
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
        self.give_up_after = budget;
        self
    }

    /// The wait between probes of a destination that is unavailable: one message is sent, and
    /// the others wait, until one answers; default [`Backoff::exponential`]`(1 s, 30 s)`, never
    /// earlier than the destination's `Retry-After`. Those waits spend the time budget, not the
    /// messages' attempts. A sender that knows when its client has reconnected (see
    /// [`Sender::reconnected`]) cuts the wait short: the next probe goes as soon as it says so.
    #[must_use]
    pub fn probe_backoff(mut self, backoff: Backoff) -> Self {
        self.probe_backoff = backoff;
        self
    }

    /// Delivers messages until `shutdown` completes.
    ///
    /// Sends run in a sliding window of [`batch_size`](Self::batch_size): as sends finish, the
    /// dispatcher starts the messages it claimed ahead and claims more, and it records outcomes
    /// in batches while other sends go on. Shutdown is graceful: the sends in hand are finished
    /// and recorded (each bounded by the send timeout), the messages claimed but not yet sent
    /// are given back without counting an attempt, and no more messages are claimed. Database
    /// errors are logged and retried after the poll interval; they never end the loop.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) {
        let mut shutdown = std::pin::pin!(shutdown);
        // Subscribed before the first claim, so a commit after that claim's read is seen.
        let mut woken = self.outbox.wake_signal().subscribe();
        let heard = self.listen.start(self.poll_interval);
        let mut window = Window::new(&self);
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
                // The outbox's sender lives as long as `self.outbox`: this never fails.
                _ = woken.changed(), if !stopping => window.wake(),
                () = heard.notified(), if !stopping => window.wake(),
                () = sleep_until(rest), if rest.is_some() => resting = None,
            }
        }
    }

    /// Claims one batch of due messages, delivers them concurrently and records each outcome;
    /// returns how many were claimed. For jobs and tests that drive delivery themselves.
    pub async fn run_once(&self) -> Result<usize, Error> {
        let mut window = Window::new(self);
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

    /// Leases up to `limit` due messages, beginning the attempts of those sent now; `probe`
    /// asks whether anything is due first, where that is cheaper than a claim finding nothing.
    async fn claim(&self, limit: usize, probe: bool) -> (Claim, Result<Vec<Claimed>, sqlx::Error>) {
        let now = now_millis();
        let claim = Claim {
            now,
            lease_until: now.saturating_add(duration_millis(self.lease)),
            // Any bit pattern is a token: all 64 random bits are kept, the sign included.
            token: i64::from_ne_bytes(random_u64().to_ne_bytes()),
            limit: i64::try_from(limit).unwrap_or(i64::MAX),
            max_attempts: i64::from(self.max_attempts),
            probe,
        };
        let _turn = self.outbox.write_turn().await;
        DB::claim_due(self.outbox.pool(), claim).await
    }

    /// Decides what a claimed message needs (a lookup, a send, or failing for good), does it,
    /// and returns the outcome to record; `None` when the lease was lost before sending.
    async fn deliver(
        &self,
        claimed: Claimed,
        token: i64,
    ) -> Result<Option<Attempted>, sqlx::Error> {
        let Claimed {
            mut record,
            attempt_begun,
        } = claimed;
        let mut looked_up = false;
        loop {
            let now = now_millis();
            match self.before_send(&record, attempt_begun, looked_up, now) {
                Step::LookUp => {
                    looked_up = true;
                    if let Some(settlement) = self.look_up(&record).await {
                        return Ok(Some(settlement.into()));
                    }
                }
                Step::GiveUp {
                    why,
                    attempts,
                    reason,
                } => return Ok(Some(Self::give_up(&record, attempts, why, reason).into())),
                Step::BeginAttempt => {
                    let begun = {
                        let _turn = self.outbox.write_turn().await;
                        DB::begin_attempt(self.outbox.pool(), record.id, token, now).await?
                    };
                    if !begun {
                        tracing::warn!(message = %record.id, "outbox lease lost before sending");
                        return Ok(None);
                    }
                    record.attempts += 1;
                    record.outcome_unknown = true;
                    break;
                }
                Step::Send => break,
            }
        }

        // A message claimed ahead of a free send slot waited after its claim began the
        // attempt; the attempt starts now, and its outcome records so.
        let started = now_millis();
        record.last_attempt_at = Some(from_millis(started));
        let outcome = self
            .bounded(self.sender.send(&record))
            .await
            .unwrap_or_else(|| SendOutcome::Unknown {
                reason: format!("no answer within {:?}", self.send_timeout),
            });
        let mut attempted = self.settle_outcome(&record, outcome, now_millis());
        attempted.settlement.last_attempt_at = Some(started);
        Ok(Some(attempted))
    }

    /// What one send's outcome makes of the message.
    fn settle_outcome(&self, record: &OutboxRecord, outcome: SendOutcome, now: i64) -> Attempted {
        let attempts = record.attempts;
        match outcome {
            SendOutcome::Delivered { receipt } => delivered(receipt, now, attempts).into(),
            SendOutcome::Rejected { reason } => {
                Self::give_up(record, attempts, GiveUp::Rejected, reason).into()
            }
            // An outage is not an attempt: the one begun is given back, and the message stays
            // due for the destination's next probe.
            SendOutcome::Unavailable { after, reason } => {
                let reason = format!("unavailable: {reason}");
                if let Some(reason) = self.past_budget(record, now, Some(&reason)) {
                    let attempts = attempts.saturating_sub(1);
                    return Self::give_up(record, attempts, GiveUp::Budget, reason).into();
                }
                let at = now.saturating_add(duration_millis(after.unwrap_or_default()));
                Attempted {
                    settlement: retry_at(
                        at,
                        Some(reason.clone()),
                        false,
                        attempts.saturating_sub(1),
                    ),
                    outage: Some(Outage { after, reason }),
                }
            }
            SendOutcome::Retry { after, reason } => {
                if attempts >= self.max_attempts {
                    let reason = Self::out_of_attempts(record, false, Some(&reason));
                    return Self::give_up(record, attempts, GiveUp::Attempts, reason).into();
                }
                if let Some(reason) = self.past_budget(record, now, Some(&reason)) {
                    return Self::give_up(record, attempts, GiveUp::Budget, reason).into();
                }
                let at = now.saturating_add(self.delay(attempts, after));
                retry_at(at, Some(reason), false, attempts).into()
            }
            // Even on the last attempt or past the budget: the next claim looks it up before
            // deciding to fail.
            SendOutcome::Unknown { reason } => {
                let at = now.saturating_add(self.delay(attempts, None));
                retry_at(at, Some(reason), true, attempts).into()
            }
        }
    }

    /// What to do with a claimed message before its send, at `now`: `attempt_begun` when its
    /// claim began the attempt (its last outcome was known), `looked_up` once a lookup of an
    /// unknown outcome found nothing to settle. A plain decision, with no I/O.
    fn before_send(
        &self,
        record: &OutboxRecord,
        attempt_begun: bool,
        looked_up: bool,
        now: i64,
    ) -> Step {
        let last = record.last_error.as_deref();
        if attempt_begun {
            // The attempt the claim began is never made if the budget ran out: not counted.
            return match self.past_budget(record, now, last) {
                Some(reason) => Step::GiveUp {
                    why: GiveUp::Budget,
                    attempts: record.attempts.saturating_sub(1),
                    reason,
                },
                None => Step::Send,
            };
        }
        // An unknown outcome is looked up before anything else: it may have been delivered.
        if record.outcome_unknown && !looked_up {
            return Step::LookUp;
        }
        if let Some(reason) = self.past_budget(record, now, last) {
            return Step::GiveUp {
                why: GiveUp::Budget,
                attempts: record.attempts,
                reason,
            };
        }
        if record.attempts >= self.max_attempts {
            return Step::GiveUp {
                why: GiveUp::Attempts,
                attempts: record.attempts,
                reason: Self::out_of_attempts(record, record.outcome_unknown, last),
            };
        }
        Step::BeginAttempt
    }

    /// Why `record` is past its time budget at `now`, if it is; `last` is the last error seen.
    fn past_budget(&self, record: &OutboxRecord, now: i64, last: Option<&str>) -> Option<String> {
        let since = record.requeued_at.unwrap_or(record.created_at);
        let age = now.saturating_sub(to_millis(since));
        (age >= duration_millis(self.give_up_after)).then(|| {
            let last = last.unwrap_or("no error recorded");
            format!(
                "gave up after {:?}, the time budget; last: {last}",
                self.give_up_after
            )
        })
    }

    /// Why a message out of attempts fails; `unknown` when its last outcome is.
    fn out_of_attempts(record: &OutboxRecord, unknown: bool, last: Option<&str>) -> String {
        let last = last.unwrap_or("no error recorded");
        if unknown {
            format!(
                "gave up after {} attempts; the last one's outcome is unknown: {last}",
                record.attempts
            )
        } else {
            format!("gave up after {} attempts: {last}", record.attempts)
        }
    }

    /// Fails `record` for good: logged at `ERROR` and counted, so that an operator hears of
    /// every message that needs a decision.
    fn give_up(record: &OutboxRecord, attempts: u32, why: GiveUp, reason: String) -> Settlement {
        tracing::error!(
            message = %record.id,
            topic = %record.topic,
            attempts,
            %reason,
            "outbox message failed for good; requeue it once the cause is fixed"
        );
        metrics::failed(why);
        failed(reason, attempts)
    }

    /// Asks the downstream about a message whose last outcome is unknown; the outcome to
    /// record, or `None` when the message is to be sent again.
    async fn look_up(&self, record: &OutboxRecord) -> Option<Settlement> {
        let found = self.bounded(self.sender.lookup(record)).await;
        let now = now_millis();
        match found {
            Some(LookupOutcome::Found { receipt }) => {
                // An earlier attempt's outcome was unknown; the downstream has it, so the
                // effect happened once and nothing is resent.
                tracing::info!(
                    id = record.id.get(),
                    topic = %record.topic,
                    attempts = record.attempts,
                    "outbox message found delivered by a lookup; not resent"
                );
                Some(delivered(receipt, now, record.attempts))
            }
            Some(LookupOutcome::NotFound) => {
                let last = record.last_attempt_at.map_or(0, to_millis);
                let grace_ends = last.saturating_add(duration_millis(self.lookup_grace));
                (now < grace_ends)
                    .then(|| retry_at(grace_ends, record.last_error.clone(), true, record.attempts))
            }
            Some(LookupOutcome::Unsupported) => None,
            Some(LookupOutcome::Failed { reason }) => {
                let at = now.saturating_add(self.delay(record.attempts, None));
                let error = format!("lookup failed: {reason}");
                Some(retry_at(at, Some(error), true, record.attempts))
            }
            None => {
                let at = now.saturating_add(self.delay(record.attempts, None));
                Some(retry_at(
                    at,
                    Some("lookup timed out".to_owned()),
                    true,
                    record.attempts,
                ))
            }
        }
    }

    /// The wait before the next probe of an unavailable destination, never shorter than its
    /// `Retry-After`.
    fn probe_wait(&self, probes: u32, outage: &Outage) -> Duration {
        let wait = self.probe_backoff.delay(probes);
        wait.max(outage.after.unwrap_or_default())
    }

    /// How often the leases held are renewed: every third of a lease, so a renewal that is
    /// late or fails once still comes before the lease runs out.
    fn renewal_interval(&self) -> Duration {
        self.lease / 3
    }

    async fn bounded<T>(&self, call: impl Future<Output = T>) -> Option<T> {
        tokio::time::timeout(self.send_timeout, call).await.ok()
    }

    fn delay(&self, attempt: u32, retry_after: Option<Duration>) -> i64 {
        let wait = self.backoff.delay(attempt);
        duration_millis(wait.max(retry_after.unwrap_or_default()))
    }
}

fn delivered(receipt: String, now: i64, attempts: u32) -> Settlement {
    Settlement {
        status: Status::Delivered,
        receipt: Some(receipt),
        last_error: None,
        attempts,
        outcome_unknown: false,
        next_attempt_at: now,
        finished_at: Some(now),
        last_attempt_at: None,
    }
}

fn failed(reason: String, attempts: u32) -> Settlement {
    let now = now_millis();
    Settlement {
        status: Status::Failed,
        receipt: None,
        last_error: Some(reason),
        attempts,
        outcome_unknown: false,
        next_attempt_at: now,
        finished_at: Some(now),
        last_attempt_at: None,
    }
}

fn retry_at(
    at: i64,
    last_error: Option<String>,
    outcome_unknown: bool,
    attempts: u32,
) -> Settlement {
    Settlement {
        status: Status::Pending,
        receipt: None,
        last_error,
        attempts,
        outcome_unknown,
        next_attempt_at: at,
        finished_at: None,
        last_attempt_at: None,
    }
}

/// What an attempt leads to: the outcome to record, and whether it found the destination out
/// of reach.
pub(super) struct Attempted {
    settlement: Settlement,
    outage: Option<Outage>,
}

impl From<Settlement> for Attempted {
    fn from(settlement: Settlement) -> Self {
        Self {
            settlement,
            outage: None,
        }
    }
}

/// Why a message failed for good.
#[derive(Debug, Clone, Copy)]
pub(super) enum GiveUp {
    /// The downstream refused it.
    Rejected,
    /// Its attempts ran out.
    Attempts,
    /// Its time budget ran out.
    Budget,
}

/// The next step for a claimed message before its send.
#[derive(Debug)]
enum Step {
    /// Its last outcome is unknown: ask the downstream first.
    LookUp,
    /// It fails for good, with this many attempts counted.
    GiveUp {
        why: GiveUp,
        attempts: u32,
        reason: String,
    },
    /// Count an attempt under its lease, then send.
    BeginAttempt,
    /// Send: its attempt is already counted.
    Send,
}

/// A destination that could not be reached, as one send found it.
pub(super) struct Outage {
    after: Option<Duration>,
    reason: String,
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
        self.listen = Listen::postgres(self.outbox.pool().connect_options());
        self
    }
}

impl<DB: Backend, S> fmt::Debug for Dispatcher<DB, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Dispatcher")
            .field("poll_interval", &self.poll_interval)
            .field("batch_size", &self.batch_size)
            .field("max_attempts", &self.max_attempts)
            .field("backoff", &self.backoff)
            .field("send_timeout", &self.send_timeout)
            .field("lease", &self.lease)
            .field("lookup_grace", &self.lookup_grace)
            .field("give_up_after", &self.give_up_after)
            .field("probe_backoff", &self.probe_backoff)
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
