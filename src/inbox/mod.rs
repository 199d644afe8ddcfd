//! Message consumers that apply each business effect once: the inbox.
//!
//! Brokers deliver at least once. A consumer that is not idempotent turns every redelivery
//! (a lost ack, a consumer that died, a publisher that resent) into a second effect. The inbox
//! makes a consumer safe the way the layer makes an HTTP handler safe: for each delivery it
//! claims the message's **business key** in the transaction the handler writes through, with the
//! same claim [`Engine`] as HTTP requests and jobs use, commits, and only **then** lets the
//! broker adapter acknowledge. A redelivery, or another message carrying the same business key
//! under a new message id, finds the claim and is acknowledged without running the handler.
//!
//! ```
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use axum_idempotency::inbox::{Delivery, Failure, Inbox, Verdict};
//! use axum_idempotency::{SqliteStore, Tx, TxError};
//! use sqlx::Sqlite;
//!
//! // Database code shared with the HTTP handlers returns `TxError`, as they do.
//! async fn record_payment(tx: &mut Tx<Sqlite>, payment_id: &str) -> Result<(), TxError> {
//!     sqlx::query("INSERT INTO paid (payment_id) VALUES (?)")
//!         .bind(payment_id)
//!         .execute(&mut **tx)
//!         .await?;
//!     Ok(())
//! }
//!
//! let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?;
//! sqlx::query("CREATE TABLE paid (payment_id TEXT)").execute(&pool).await?;
//! let store = SqliteStore::new(pool);
//! store.migrate().await?;
//!
//! // The payment id inside the event is the business key, whatever message carries it.
//! fn payment_id(delivery: &Delivery) -> Result<String, Failure> {
//!     let event: serde_json::Value = serde_json::from_slice(delivery.payload())
//!         .map_err(|_| Failure::permanent("not JSON"))?;
//!     event["payment_id"].as_str().map(str::to_owned).ok_or_else(|| Failure::permanent("no payment_id"))
//! }
//!
//! let inbox = Inbox::new("orders", store).key_by(payment_id);
//! let apply = |mut tx: Tx<Sqlite>, delivery: Delivery| async move {
//!     // `?` sorts a database error, a `TxError` or an `sqlx::Error`: a conflict abort is
//!     // `Failure::Conflict`, run again at once; an unreachable database is
//!     // `Failure::Unavailable`, an outage that never counts as an attempt; anything else is
//!     // `Failure::Retryable`. A failure of your own choosing in its place would lose that.
//!     record_payment(&mut tx, &payment_id(&delivery)?).await?;
//!     Ok(())
//! };
//!
//! let event = br#"{"payment_id":"p-1","order_id":7}"#;
//! let first = inbox.handle(Delivery::new(event.to_vec()).with_message_id("m-1"), apply).await;
//! let again = inbox.handle(Delivery::new(event.to_vec()).with_message_id("m-2"), apply).await;
//! assert_eq!(first, Verdict::Applied);
//! assert_eq!(again, Verdict::Duplicate); // same payment, another message id: skipped
//! # Ok(()) }
//! # tokio::runtime::Runtime::new().unwrap().block_on(run()).unwrap();
//! ```
//!
//! # Business key or message id
//!
//! Dedupe by the business key the effect is about (a payment id, an order id plus a step):
//! a publisher that resends the same event under a new message id (a retried outbox send on a
//! broker without deduplication, a replay from an archive, a second publisher) still applies
//! once. A message id only catches redeliveries of one message. Consumers that have no business
//! key keep the default, [`Inbox::key_by_message_id`].
//!
//! # Outcomes
//!
//! The handler answers `Ok(())` or a [`Failure`]:
//!
//! - `Ok(())`: the claim and the handler's writes commit together; [`Verdict::Applied`].
//! - [`Failure::Retryable`] (a deadlock, a downstream timeout): everything is rolled back, no
//!   record remains, and the broker redelivers after a backoff ([`Verdict::Retry`]) — until the
//!   delivery's attempt count reaches [`Inbox::max_attempts`], when it is dead-lettered. The
//!   backoff is drawn at random below a ceiling that doubles per attempt
//!   ([`Inbox::backoff`]), so consumers that failed together in one outage do not all come
//!   back at the same instant.
//! - [`Failure::Unavailable`] (the consumer's own database or a dependency cannot be reached):
//!   an outage, see [below](#outages). Rolled back, redelivered, never dead-lettered.
//! - [`Failure::Permanent`] (malformed payload, an order that does not exist): rolled back and
//!   dead-lettered at once ([`Verdict::Dead`]).
//!
//! A dead letter is logged at `WARN` with its reason, counted in [`Stats::dead`], and the
//! engine's own log line and `idempotency_requests_total` counter (feature `metrics`) label it
//! `outcome="dead"`, never `retryable`: an alert on rising retries is not set off by deliveries
//! that can never apply.
//!
//! # Outages
//!
//! A delivery that fails because the consumer's own database (or a dependency it cannot work
//! without) is unreachable is not at fault, and the same delivery applies once the outage is
//! over. So it is retried for as long as the outage lasts, and never dead-lettered for it:
//! [`Verdict::Unavailable`], counted in [`Stats::unavailable`] and never as an attempt, neither
//! against [`Inbox::max_attempts`] nor against the broker's delivery count. The wait is drawn
//! at random below a ceiling that doubles per outage met in a row, at most 10 s
//! ([`Inbox::outage_backoff`]), and the broker adapters pause meanwhile, as the outbox's
//! dispatcher does: they take no new delivery until the wait has passed, instead of failing
//! every delivery the broker holds on the same outage.
//!
//! What counts as an outage: a handler's [`Failure::Unavailable`], which `?` makes of a database
//! error that says the database cannot be reached (a broken or refused connection, TLS, a pool
//! that gave no connection in time or was closed, SQLSTATE class `08` or a server shutting
//! down); the inbox's own store failing to claim, commit or roll back; and on SQLite, whose one
//! write lock guards the whole file, that lock held by another writer past
//! [`Inbox::wait_for_in_flight`] (a stuck process, a long backup). A handler that panics is a
//! bug, not an outage: it counts as a retryable failure.
//!
//! A dead-lettered delivery leaves its business key unclaimed and records the failure in a
//! scope of its own (its own transaction, same engine), so that once the cause is fixed, an
//! operator's replay of the dead letter (`replay_dead` on the broker adapters), or a fresh copy
//! arriving from the broker, goes through the very same claim and applies once.
//!
//! Two deliveries of one key at the same time: the second waits (bounded by
//! [`Inbox::wait_for_in_flight`]) on the first's claim, then skips as a duplicate; past the
//! wait it is retried later, never run twice (on SQLite, where that wait is for the database's
//! one write lock, as an outage).
//!
//! # Batches
//!
//! A delivery's cost is mostly its commit's wait for the disk. [`Inbox::handle_batch`] (and
//! `batch(n)` on the broker adapters) applies several deliveries in one transaction, with one
//! commit, and falls back to one transaction each when any of them fails, so the verdicts are
//! those [`Inbox::handle`] would give.
//!
//! # Where a dead letter's reason is
//!
//! Each dead-lettered delivery is logged at `WARN` with the consumer's name, the message id,
//! the attempt and the reason (never the payload, which may hold personal data). The broker
//! adapters also keep the reason with the dead letter, in a header: `x-inbox-reason` on
//! RabbitMQ, `Inbox-Reason` on NATS.
//!
//! # Guarantees and their limits
//!
//! At-least-once delivery plus a claim in the handler's transaction gives **one effect per
//! business key** for everything the handler writes through its [`Tx`]. Calls the handler makes
//! outside that transaction are not covered (write them to the outbox instead). Ordering is not
//! guaranteed: retries, several consumers and concurrency reorder deliveries.
//!
//! # Retention
//!
//! One rule joins the two ends of the chain: **the inbox's record retention
//! ([`Inbox::retention`]) must exceed the publishers' time budget, the outbox's time budget
//! (`Dispatcher::give_up_after`, 6 h by default), plus the broker's redelivery horizon** (its
//! ack wait, the retry delays, how long a message may wait in the queue). A publisher may
//! resend an event for as long as its budget lets it, and the broker may hand a copy over
//! later still; a copy that arrives after its key's record was purged applies again. The
//! dedupe records are kept by default, which satisfies the rule whatever the budgets; set a
//! retention only with both horizons in hand.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::Backend;
use crate::backoff::Backoff;
use crate::engine::Engine;
use crate::error::Error;
use crate::fingerprint::{Fingerprint, Fingerprinter};
use crate::key::IdempotencyKey;
use crate::scope::Scope;
use crate::store::Store;
use crate::tx::Tx;

pub(crate) mod decide;
mod delivery;
pub(crate) mod failure;
#[cfg(feature = "nats")]
pub mod nats;
mod pause;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
mod stats;

pub use delivery::Delivery;
pub use failure::Failure;
#[cfg_attr(
    not(any(feature = "rabbitmq", feature = "nats")),
    allow(unused_imports)
)]
pub(crate) use pause::Pause;
use stats::Counters;
pub use stats::Stats;

/// What the broker adapter does with a delivery once the inbox is done with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Applied now and committed: acknowledge.
    Applied,
    /// Its business key was applied before: acknowledge without running the handler again.
    Duplicate,
    /// Rolled back: redeliver no sooner than `after`.
    Retry {
        /// The backoff before the next attempt.
        after: Duration,
    },
    /// The consumer's database or a dependency could not be reached ([`Failure::Unavailable`]):
    /// nothing was committed. Deliver it again no sooner than `after` **without counting an
    /// attempt** (neither the inbox's nor the broker's), and take no new deliveries meanwhile.
    Unavailable {
        /// The backoff before the next try ([`Inbox::outage_backoff`]).
        after: Duration,
        /// What could not be reached.
        reason: String,
    },
    /// Failed for good (or out of attempts): dead-letter it, then acknowledge.
    Dead {
        /// Why. Logged at `WARN` when the delivery is dead-lettered, and kept with the dead
        /// letter in the header `x-inbox-reason` (RabbitMQ) or `Inbox-Reason` (NATS).
        reason: String,
    },
}

/// What an operator's replay of dead letters did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReplayReport {
    /// Dead letters applied now, and removed.
    pub applied: u64,
    /// Dead letters whose business key had been applied meanwhile, removed without running.
    pub duplicates: u64,
    /// Dead letters that failed again and stay dead.
    pub still_dead: u64,
}

type KeyFn = Arc<dyn Fn(&Delivery) -> Result<String, Failure> + Send + Sync>;
type Observer = Arc<dyn Fn(&Delivery, &Verdict) + Send + Sync>;

/// The route name business keys are claimed under (message ids get their own).
const BY_BUSINESS_KEY: &str = "business-key";
const BY_MESSAGE_ID: &str = "message-id";
/// The verbs a business key is claimed under, and its dead letter's note recorded under.
const CONSUME: &str = "CONSUME";
const DEAD: &str = "DEAD";
/// The inbox's log lines name the inbox as their target, whichever of its parts writes them.
const LOG_TARGET: &str = module_path!();
/// "Keep": long enough to outlive any broker's or publisher's retry horizon.
const KEEP: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
/// An outage is waited out in steps of at most 10 s: one try per step does not hammer a
/// database that is coming back, and the step is how long the consumer may stay idle after
/// it is back, time in which its backlog does not drain.
const OUTAGE_BACKOFF: Backoff =
    Backoff::exponential(Duration::from_secs(1), Duration::from_secs(10));

/// The consumer side of the chain: dedupes deliveries by business key in the handler's
/// transaction. Cheap to clone; see the [module docs](self).
pub struct Inbox<DB: Backend> {
    name: Arc<str>,
    engine: Engine<DB>,
    failures: Engine<DB>,
    key: KeyFn,
    route: &'static str,
    max_attempts: u32,
    backoff: Backoff,
    outage_backoff: Backoff,
    observer: Option<Observer>,
    counters: Arc<Counters>,
}

impl<DB: Backend> Clone for Inbox<DB> {
    fn clone(&self) -> Self {
        Self {
            name: Arc::clone(&self.name),
            engine: self.engine.clone(),
            failures: self.failures.clone(),
            key: Arc::clone(&self.key),
            route: self.route,
            max_attempts: self.max_attempts,
            backoff: self.backoff,
            outage_backoff: self.outage_backoff,
            observer: self.observer.clone(),
            counters: Arc::clone(&self.counters),
        }
    }
}

impl<DB: Backend> fmt::Debug for Inbox<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Inbox")
            .field("name", &self.name)
            .field("dedupe", &self.route)
            .field("max_attempts", &self.max_attempts)
            .field("backoff", &self.backoff)
            .field("outage_backoff", &self.outage_backoff)
            .field("engine", &self.engine)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend> Inbox<DB> {
    /// An inbox for the consumer `name`, keeping its claims in `store`.
    ///
    /// The name scopes the keys, as principal and route scope HTTP keys: two consumers
    /// applying the same event each apply it once. Defaults: dedupe by message id, 5 attempts,
    /// a backoff of up to 1 s doubling to at most 60 s, an outage backoff of up to 1 s doubling
    /// to at most 10 s, records kept, a 5 s wait on an in-flight duplicate.
    pub fn new(name: impl Into<String>, store: Store<DB>) -> Self {
        let name: String = name.into();
        // Only a commit counts as done: a permanent failure must leave the key unclaimed so that
        // a replay after the fix goes through the same claim (see the module docs).
        // The claim keeps the key alone: no delivery ever reads a stored response back.
        let engine = Engine::new(store.clone()).keys_only().retention(KEEP);
        Self {
            name: name.into(),
            engine,
            failures: Engine::new(store).retention(KEEP),
            key: Arc::new(|delivery: &Delivery| {
                delivery
                    .message_id()
                    .map(str::to_owned)
                    .ok_or_else(|| Failure::permanent("the message has no message id"))
            }),
            route: BY_MESSAGE_ID,
            max_attempts: 5,
            backoff: Backoff::exponential(Duration::from_secs(1), Duration::from_secs(60)),
            outage_backoff: OUTAGE_BACKOFF,
            observer: None,
            counters: Arc::default(),
        }
    }

    /// Dedupes by the business key `key` finds in a delivery (recommended; see the module
    /// docs). A key function's [`Failure::Permanent`] (malformed JSON) dead-letters the delivery
    /// without a claim.
    #[must_use]
    pub fn key_by<F>(mut self, key: F) -> Self
    where
        F: Fn(&Delivery) -> Result<String, Failure> + Send + Sync + 'static,
    {
        self.key = Arc::new(key);
        self.route = BY_BUSINESS_KEY;
        self
    }

    /// Dedupes by the broker's message id (the default), for consumers with no business key.
    /// A delivery without a message id is dead-lettered.
    #[must_use]
    pub fn key_by_message_id(self) -> Self {
        let mut inbox = self.key_by(|delivery| {
            delivery
                .message_id()
                .map(str::to_owned)
                .ok_or_else(|| Failure::permanent("the message has no message id"))
        });
        inbox.route = BY_MESSAGE_ID;
        inbox
    }

    /// The attempt at which a retryable failure is dead-lettered instead (default 5). Outages
    /// ([`Failure::Unavailable`]) count as no attempt.
    #[must_use]
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// Backoff before a retry: a wait drawn at random from zero up to `base` doubled per attempt,
    /// at most `cap` (default 1 s, 60 s). The draw (full jitter) spreads the retries of many
    /// deliveries that failed together, say in one outage, instead of sending them all back at
    /// once.
    #[must_use]
    pub fn backoff(mut self, base: Duration, cap: Duration) -> Self {
        self.backoff = Backoff::exponential(base, cap.max(base));
        self
    }

    /// Backoff while the consumer's database or a dependency is unreachable
    /// ([`Failure::Unavailable`]): a wait drawn at random from zero up to `base` doubled per
    /// outage met in a row, at most `cap` (default 1 s, 10 s). The broker adapters take no new
    /// deliveries for that long, and the delivery comes back without counting an attempt; the
    /// cap bounds how long a consumer stays idle once the outage is over.
    #[must_use]
    pub fn outage_backoff(mut self, base: Duration, cap: Duration) -> Self {
        self.outage_backoff = Backoff::exponential(base, cap.max(base));
        self
    }

    /// How long dedupe records are kept (default: kept). Must exceed the publishers' time
    /// budget (how long an outbox keeps resending one message) plus the broker's redelivery
    /// horizon, or a late copy applies again (see the [module docs](self#retention)).
    ///
    /// Expired keys stay in the table `idempotency_inbox` until the store purges them:
    /// [`Store::purge_expired`] or [`Store::spawn_purger`] on the store the inbox was made with.
    #[must_use]
    pub fn retention(mut self, retention: Duration) -> Self {
        self.engine = self.engine.retention(retention);
        self.failures = self.failures.retention(retention);
        self
    }

    /// How long a delivery waits for an in-flight delivery of the same key (default 5 s)
    /// before it is retried later.
    #[must_use]
    pub fn wait_for_in_flight(mut self, wait: Duration) -> Self {
        self.engine = self.engine.wait_for_in_flight(wait);
        self
    }

    /// Calls `observe` with each delivery's verdict after its transaction ended and before the
    /// broker is told (metrics, logs, tests that stop a consumer between commit and ack).
    #[must_use]
    pub fn on_verdict<F>(mut self, observe: F) -> Self
    where
        F: Fn(&Delivery, &Verdict) + Send + Sync + 'static,
    {
        self.observer = Some(Arc::new(observe));
        self
    }

    /// The consumer's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Counts of processed, duplicate, retried, unavailable and dead deliveries so far.
    pub fn stats(&self) -> Stats {
        self.counters.snapshot()
    }

    /// Whether the delivery's business key has been applied: a committed claim exists and has
    /// not expired (see [`retention`](Self::retention)).
    pub async fn is_applied(&self, delivery: &Delivery) -> Result<bool, Error> {
        let Ok(key) = (self.key)(delivery) else {
            return Ok(false);
        };
        let Ok(scope) = self.scope(CONSUME, &key) else {
            return Ok(false);
        };
        let store = self.engine.store();
        // The inbox's engine keeps a key only for a commit: any live key is applied.
        store
            .key_held(&scope.scoped_key(), store.clock().now())
            .await
    }

    /// Runs `handler` for one delivery unless its business key was applied before, and says
    /// what the broker adapter must do with it. Never panics on the delivery's content.
    pub async fn handle<F, Fut>(&self, delivery: Delivery, handler: F) -> Verdict
    where
        F: FnMut(Tx<DB>, Delivery) -> Fut + Send + 'static,
        Fut: Future<Output = Result<(), Failure>> + Send + 'static,
    {
        let verdict = self.decide(&delivery, handler, false).await;
        self.counters.count(&verdict);
        if let Some(observe) = &self.observer {
            observe(&delivery, &verdict);
        }
        verdict
    }

    /// [`handle`](Self::handle) for several deliveries at once, their verdicts in the same
    /// order: their handlers run one after another in **one transaction**, which claims each
    /// business key and commits once. One commit, and one wait for the disk, serves them all,
    /// which is most of a delivery's cost on a database that syncs each commit (SQLite, a
    /// PostgreSQL with `synchronous_commit` on).
    ///
    /// A delivery whose key was applied before (or earlier in the batch) is a
    /// [`Verdict::Duplicate`], its handler not run. If any handler fails, or the commit does,
    /// nothing of the batch stands and each delivery is handled alone, as by `handle`, so a
    /// bad delivery fails only itself, and only its own failures count as attempts. Should the
    /// database be out of reach, every delivery is [`Verdict::Unavailable`] at once, with one
    /// pause for them all. A handler may therefore run more than once for one delivery: keep
    /// its effects in its [`Tx`], as always.
    ///
    /// The broker adapters batch the deliveries they hold when asked to (`batch`).
    pub async fn handle_batch<F, Fut>(&self, deliveries: &[Delivery], handler: F) -> Vec<Verdict>
    where
        F: FnMut(Tx<DB>, Delivery) -> Fut + Clone + Send + 'static,
        Fut: Future<Output = Result<(), Failure>> + Send + 'static,
    {
        let verdicts = self.decide_batch(deliveries, handler).await;
        for (delivery, verdict) in deliveries.iter().zip(&verdicts) {
            self.counters.count(verdict);
            if let Some(observe) = &self.observer {
                observe(delivery, verdict);
            }
        }
        verdicts
    }

    /// [`handle`](Self::handle) for an operator's replay of a dead letter: one attempt, the
    /// attempt count ignored; any failure keeps it dead.
    #[cfg_attr(not(any(feature = "rabbitmq", feature = "nats")), allow(dead_code))]
    pub(crate) async fn replay<F, Fut>(&self, delivery: Delivery, handler: F) -> Verdict
    where
        F: FnMut(Tx<DB>, Delivery) -> Fut + Send + 'static,
        Fut: Future<Output = Result<(), Failure>> + Send + 'static,
    {
        let verdict = self.decide(&delivery, handler, true).await;
        if matches!(verdict, Verdict::Applied) {
            self.counters.replayed();
        }
        verdict
    }

    fn scope(&self, verb: &str, key: &str) -> Result<Scope, Failure> {
        Ok(Scope::new(
            &*self.name,
            verb,
            self.route,
            idempotency_key(key)?,
        ))
    }

    /// One intent per key: the key is the identity, so payloads are not compared (a publisher
    /// may re-encode the same event).
    fn fingerprint(&self) -> Fingerprint {
        Fingerprinter::new().fingerprint_value("inbox", self.name.as_bytes())
    }
}

/// A business key as an [`IdempotencyKey`]: its SHA-256 in hex, so that any key (longer than the
/// header protocol allows, not ASCII, or spelled like a structured-field string) is usable and
/// two different keys never meet. The store keeps only a digest of the scope anyway.
fn idempotency_key(key: &str) -> Result<IdempotencyKey, Failure> {
    hex::encode(Sha256::digest(key.as_bytes()))
        .parse()
        .map_err(|_| Failure::permanent("the business key cannot be encoded"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn business_keys_spelled_alike_stay_apart() {
        // The header protocol would read `"k1"` as `k1`; business keys must not.
        let quoted = idempotency_key("\"k1\"").map(|k| k.as_str().to_owned());
        let bare = idempotency_key("k1").map(|k| k.as_str().to_owned());
        assert_ne!(quoted, bare);
        let long = "x".repeat(1000);
        assert!(idempotency_key(&long).is_ok());
        assert!(idempotency_key("zahlung-ü-1 ,2").is_ok());
    }
}
