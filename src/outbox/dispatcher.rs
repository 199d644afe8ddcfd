//! The background task that delivers committed messages and records every outcome.

use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use futures_util::future::join_all;
use tokio::sync::Notify;

use super::backend::{Claim, Settlement};
use super::status::{duration_millis, now_millis, to_millis};
use super::{Error, LookupOutcome, MessageId, Outbox, OutboxRecord, SendOutcome, Sender, Status};
use crate::Backend;
use crate::backoff::{Backoff, random_u64};

/// Delivers outbox messages through a [`Sender`]: claims due messages under a lease, calls the
/// sender, and records delivered, retry-later or failed.
///
/// Run as many dispatchers as you like, in one process or many: a message is leased by one
/// claim at a time, renewed while its send runs, and a dispatcher that dies mid-send loses
/// its lease within [`lease`](Self::lease) (15 s by default), after which another one looks
/// the message up (or resends it with the same downstream key).
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
/// let waker = dispatcher.waker(); // call waker.wake() after a commit that enqueued
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
    wake: Arc<Notify>,
    poll_interval: Duration,
    batch_size: u32,
    max_attempts: u32,
    backoff: Backoff,
    send_timeout: Duration,
    lease: Duration,
    lookup_grace: Duration,
}

impl<DB: Backend, S: Sender> Dispatcher<DB, S> {
    /// A dispatcher for `outbox` delivering through `sender`, with the defaults below.
    #[must_use]
    pub fn new(outbox: Outbox<DB>, sender: S) -> Self {
        Self {
            outbox,
            sender: Arc::new(sender),
            wake: Arc::new(Notify::new()),
            poll_interval: Duration::from_secs(1),
            batch_size: 16,
            max_attempts: 10,
            backoff: Backoff::exponential(Duration::from_secs(1), Duration::from_secs(300)),
            send_timeout: Duration::from_secs(30),
            lease: Duration::from_secs(15),
            lookup_grace: Duration::from_secs(60),
        }
    }

    /// How long to sleep when no message is due; default 1 s. A [`waker`](Self::waker) cuts
    /// the sleep short.
    #[must_use]
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// How many messages one claim leases and sends concurrently; default 16.
    #[must_use]
    pub fn batch_size(mut self, size: u32) -> Self {
        self.batch_size = size.max(1);
        self
    }

    /// After how many sender calls a message that still did not go through fails for good;
    /// default 10.
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
    /// dispatcher waits, after it the message is resent; default 60 s.
    #[must_use]
    pub fn lookup_grace(mut self, grace: Duration) -> Self {
        self.lookup_grace = grace;
        self
    }

    /// A handle that makes the running dispatcher poll now instead of at the end of its sleep.
    ///
    /// Wake it after the commit of a transaction that enqueued: woken earlier, it finds
    /// nothing yet and the message waits for the next poll.
    pub fn waker(&self) -> DispatchWaker {
        DispatchWaker(self.wake.clone())
    }

    /// Delivers messages until `shutdown` completes.
    ///
    /// Shutdown is graceful: the batch in hand is finished and recorded (each send bounded by
    /// the send timeout), then no more messages are claimed. Database errors are logged and
    /// retried after the poll interval; they never end the loop.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) {
        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            let batch_was_full = match self.run_once().await {
                Ok(claimed) => claimed >= self.batch_size as usize,
                Err(error) => {
                    tracing::warn!(%error, "outbox claim failed; retrying after the poll interval");
                    false
                }
            };
            if batch_was_full {
                if shutdown.as_mut().now_or_never().is_some() {
                    return;
                }
                continue;
            }
            tokio::select! {
                biased;
                () = &mut shutdown => return,
                () = self.wake.notified() => {}
                () = tokio::time::sleep(self.poll_interval) => {}
            }
        }
    }

    /// Claims one batch of due messages, delivers them concurrently and records each outcome;
    /// returns how many were claimed. For jobs and tests that drive delivery themselves.
    pub async fn run_once(&self) -> Result<usize, Error> {
        let now = now_millis();
        let claim = Claim {
            now,
            lease_until: now.saturating_add(duration_millis(self.lease)),
            // Any bit pattern is a token: all 64 random bits are kept, the sign included.
            token: i64::from_ne_bytes(random_u64().to_ne_bytes()),
            limit: i64::from(self.batch_size),
        };
        let claimed = DB::claim(self.outbox.pool(), claim).await?;
        let count = claimed.len();
        join_all(claimed.into_iter().map(|record| async move {
            let id = record.id;
            let delivered = self.renewing(id, claim.token, self.deliver(record, claim.token));
            if let Err(error) = delivered.await {
                // The lease runs out and another claim picks the message up again; the attempt
                // was recorded as outcome-unknown first, so that claim looks before resending.
                tracing::warn!(message = %id, %error, "recording an outbox outcome failed");
            }
        }))
        .await;
        Ok(count)
    }

    async fn deliver(&self, mut record: OutboxRecord, token: i64) -> Result<(), sqlx::Error> {
        let pool = self.outbox.pool();
        if record.outcome_unknown {
            let found = self.bounded(self.sender.lookup(&record)).await;
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
                    return self.settle(&record, token, delivered(receipt, now)).await;
                }
                Some(LookupOutcome::NotFound) => {
                    let last = record.last_attempt_at.map_or(0, to_millis);
                    let grace_ends = last.saturating_add(duration_millis(self.lookup_grace));
                    if now < grace_ends {
                        let wait = retry_at(grace_ends, record.last_error.clone(), true);
                        return self.settle(&record, token, wait).await;
                    }
                }
                Some(LookupOutcome::Unsupported) => {}
                Some(LookupOutcome::Failed { reason }) => {
                    let at = now.saturating_add(self.delay(record.attempts, None));
                    let error = format!("lookup failed: {reason}");
                    return self
                        .settle(&record, token, retry_at(at, Some(error), true))
                        .await;
                }
                None => {
                    let at = now.saturating_add(self.delay(record.attempts, None));
                    let error = "lookup timed out".to_owned();
                    return self
                        .settle(&record, token, retry_at(at, Some(error), true))
                        .await;
                }
            }
        }

        if record.attempts >= self.max_attempts {
            let last = record.last_error.as_deref().unwrap_or("no error recorded");
            let reason = if record.outcome_unknown {
                format!(
                    "gave up after {} attempts; the last one's outcome is unknown: {last}",
                    record.attempts
                )
            } else {
                format!("gave up after {} attempts: {last}", record.attempts)
            };
            return self.settle(&record, token, failed(reason)).await;
        }

        if !DB::begin_attempt(pool, record.id, token, now_millis()).await? {
            tracing::warn!(message = %record.id, "outbox lease lost before sending");
            return Ok(());
        }
        record.attempts += 1;
        record.outcome_unknown = true;

        let outcome = self
            .bounded(self.sender.send(&record))
            .await
            .unwrap_or_else(|| SendOutcome::Unknown {
                reason: format!("no answer within {:?}", self.send_timeout),
            });
        let now = now_millis();
        let settlement = match outcome {
            SendOutcome::Delivered { receipt } => delivered(receipt, now),
            SendOutcome::Rejected { reason } => failed(reason),
            SendOutcome::Retry { reason, .. } if record.attempts >= self.max_attempts => failed(
                format!("gave up after {} attempts: {reason}", record.attempts),
            ),
            SendOutcome::Retry { after, reason } => {
                let at = now.saturating_add(self.delay(record.attempts, after));
                retry_at(at, Some(reason), false)
            }
            // Even on the last attempt: the next claim looks it up before deciding to fail.
            SendOutcome::Unknown { reason } => {
                let at = now.saturating_add(self.delay(record.attempts, None));
                retry_at(at, Some(reason), true)
            }
        };
        self.settle(&record, token, settlement).await
    }

    /// Runs `work` on a leased message while renewing the lease every third of its length, so
    /// a lookup or a send that takes long keeps the message, and only a dispatcher that died
    /// loses it.
    async fn renewing<T>(&self, id: MessageId, token: i64, work: impl Future<Output = T>) -> T {
        let every = self.lease / 3;
        let renew = async {
            let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            loop {
                ticks.tick().await;
                let until = now_millis().saturating_add(duration_millis(self.lease));
                match DB::renew_lease(self.outbox.pool(), id, token, until).await {
                    Ok(true) => {}
                    Ok(false) => {
                        // Taken over: the outcome this attempt records will be refused, and the
                        // new holder looks the message up before any resend.
                        tracing::warn!(message = %id, "outbox lease lost while delivering");
                        return std::future::pending::<Infallible>().await;
                    }
                    Err(error) => {
                        tracing::warn!(message = %id, %error, "renewing an outbox lease failed");
                    }
                }
            }
        };
        tokio::select! {
            output = work => output,
            never = renew => match never {},
        }
    }

    async fn settle(
        &self,
        record: &OutboxRecord,
        token: i64,
        settlement: Settlement,
    ) -> Result<(), sqlx::Error> {
        if !DB::settle(self.outbox.pool(), record.id, token, &settlement).await? {
            tracing::warn!(message = %record.id, "outbox lease lost before recording the outcome");
        }
        Ok(())
    }

    async fn bounded<T>(&self, call: impl Future<Output = T>) -> Option<T> {
        tokio::time::timeout(self.send_timeout, call).await.ok()
    }

    fn delay(&self, attempt: u32, retry_after: Option<Duration>) -> i64 {
        let wait = self.backoff.delay(attempt);
        duration_millis(wait.max(retry_after.unwrap_or_default()))
    }
}

fn delivered(receipt: String, now: i64) -> Settlement {
    Settlement {
        status: Status::Delivered,
        receipt: Some(receipt),
        last_error: None,
        outcome_unknown: false,
        next_attempt_at: now,
        finished_at: Some(now),
    }
}

fn failed(reason: String) -> Settlement {
    let now = now_millis();
    Settlement {
        status: Status::Failed,
        receipt: None,
        last_error: Some(reason),
        outcome_unknown: false,
        next_attempt_at: now,
        finished_at: Some(now),
    }
}

fn retry_at(at: i64, last_error: Option<String>, outcome_unknown: bool) -> Settlement {
    Settlement {
        status: Status::Pending,
        receipt: None,
        last_error,
        outcome_unknown,
        next_attempt_at: at,
        finished_at: None,
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
            .finish_non_exhaustive()
    }
}

/// Makes a running [`Dispatcher`] poll now; cheap to clone.
#[derive(Debug, Clone)]
pub struct DispatchWaker(Arc<Notify>);

impl DispatchWaker {
    /// Asks for a poll; wakes of a dispatcher that is busy collapse into one poll after it.
    pub fn wake(&self) {
        self.0.notify_one();
    }
}

/// The shortest lease: renewals every third of it must fit a database round trip with room.
const MIN_LEASE: Duration = Duration::from_secs(1);
