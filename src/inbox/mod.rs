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
//! use axum_idempotency::{SqliteStore, Tx};
//! use sqlx::Sqlite;
//!
//! let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?;
//! sqlx::query("CREATE TABLE paid (payment_id TEXT)").execute(&pool).await?;
//! let store = SqliteStore::new(pool);
//! store.migrate().await?;
//!
//! // The payment id inside the event is the business key, whatever message carries it.
//! let inbox = Inbox::new("orders", store).key_by(|delivery: &Delivery| {
//!     let event: serde_json::Value = serde_json::from_slice(delivery.payload())
//!         .map_err(|_| Failure::permanent("not JSON"))?;
//!     event["payment_id"].as_str().map(str::to_owned).ok_or_else(|| Failure::permanent("no payment_id"))
//! });
//! let apply = |mut tx: Tx<Sqlite>, delivery: Delivery| async move {
//!     sqlx::query("INSERT INTO paid (payment_id) VALUES ('p-1')")
//!         .execute(&mut *tx)
//!         .await
//!         .map_err(|e| Failure::retryable(e.to_string()))?;
//!     Ok(())
//! };
//!
//! let event = br#"{"payment_id":"p-1","order_id":7}"#;
//! let first = inbox.handle(Delivery::new(event.to_vec()).message_id("m-1"), apply).await;
//! let again = inbox.handle(Delivery::new(event.to_vec()).message_id("m-2"), apply).await;
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
//! - [`Failure::Permanent`] (malformed payload, an order that does not exist): rolled back and
//!   dead-lettered at once ([`Verdict::Dead`]).
//!
//! A dead-lettered delivery leaves its business key unclaimed and records the failure in a
//! scope of its own (its own transaction, same engine), so that once the cause is fixed, an
//! operator's replay of the dead letter (`replay_dead` on the broker adapters), or a fresh copy
//! arriving from the broker, goes through the very same claim and applies once.
//!
//! Two deliveries of one key at the same time: the second waits (bounded by
//! [`Inbox::wait_for_in_flight`]) on the first's claim, then skips as a duplicate; past the
//! wait it is retried later, never run twice.
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
//! guaranteed: retries, several consumers and concurrency reorder deliveries. The dedupe
//! records are kept by default; a record purged before the broker stops redelivering (its ack
//! wait and retry horizon) or before publishers stop resending (the outbox's retry horizon)
//! would let a late copy apply again, so [`Inbox::retention`] must exceed both.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::response::IntoResponse;
use bytes::Bytes;
use http::StatusCode;
use sha2::{Digest, Sha256};

use crate::Backend;
use crate::backoff::Backoff;
use crate::engine::{Classification, Engine, Lookup, Outcome};
use crate::error::{Error, Rejection};
use crate::fingerprint::{Fingerprint, Fingerprinter};
use crate::key::IdempotencyKey;
use crate::scope::Scope;
use crate::store::Store;
use crate::tx::{Tx, TxError, conflict_aborted};

#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;

/// One message as the broker delivered it, handed to the key function and the handler.
#[derive(Clone, PartialEq, Eq)]
pub struct Delivery {
    payload: Bytes,
    message_id: Option<String>,
    attempt: u32,
}

impl Delivery {
    /// A delivery of `payload`, first attempt, without a message id.
    pub fn new(payload: impl Into<Bytes>) -> Self {
        Self {
            payload: payload.into(),
            message_id: None,
            attempt: 1,
        }
    }

    /// Sets the broker's message id (RabbitMQ `message_id`, NATS `Nats-Msg-Id`).
    #[must_use]
    pub fn message_id(mut self, id: impl Into<String>) -> Self {
        self.message_id = Some(id.into());
        self
    }

    /// Sets which attempt this is, counting from 1 (the broker's delivery count).
    #[must_use]
    pub fn attempt(mut self, attempt: u32) -> Self {
        self.attempt = attempt.max(1);
        self
    }

    /// The message body.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// The broker's message id, if the message had one.
    pub fn id(&self) -> Option<&str> {
        self.message_id.as_deref()
    }

    /// Which attempt this is, from 1.
    pub fn attempts(&self) -> u32 {
        self.attempt
    }
}

impl fmt::Debug for Delivery {
    // The payload may hold personal data: only its size is shown.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Delivery")
            .field("message_id", &self.message_id)
            .field("attempt", &self.attempt)
            .field("payload_len", &self.payload.len())
            .finish()
    }
}

/// Why a handler (or a key function) did not apply a delivery.
///
/// `?` converts a statement's `sqlx::Error` (or a [`TxError`]): a conflict
/// abort becomes [`Failure::Conflict`], run again at once like a request under the layer;
/// any other database error is [`Failure::Retryable`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// Worth another attempt later (a lock timeout, a downstream that is down).
    Retryable(String),
    /// Will never succeed as it is (malformed, refers to nothing): dead-letter it.
    Permanent(String),
    /// The database aborted the transaction to resolve a conflict with a concurrent one (a
    /// serialization failure, a deadlock, a certification conflict): nothing of it stands and
    /// the delivery is run again at once, a bounded number of times, before it counts as a
    /// retryable failure.
    Conflict(String),
}

impl From<TxError> for Failure {
    fn from(error: TxError) -> Self {
        if error.is_conflict() {
            Self::Conflict(error.to_string())
        } else {
            Self::Retryable(error.to_string())
        }
    }
}

impl From<sqlx::Error> for Failure {
    fn from(error: sqlx::Error) -> Self {
        TxError::from(error).into()
    }
}

impl Failure {
    /// A failure worth retrying.
    pub fn retryable(reason: impl Into<String>) -> Self {
        Self::Retryable(reason.into())
    }

    /// A failure that retrying cannot fix.
    pub fn permanent(reason: impl Into<String>) -> Self {
        Self::Permanent(reason.into())
    }
}

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

/// Counters since the inbox was created (shared by its clones).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Deliveries applied (handler ran and committed).
    pub processed: u64,
    /// Deliveries skipped because their business key was applied before.
    pub duplicates: u64,
    /// Deliveries rolled back and sent back for another attempt.
    pub retried: u64,
    /// Deliveries dead-lettered.
    pub dead: u64,
}

#[derive(Default)]
struct Counters {
    processed: AtomicU64,
    duplicates: AtomicU64,
    retried: AtomicU64,
    dead: AtomicU64,
}

type KeyFn = Arc<dyn Fn(&Delivery) -> Result<String, Failure> + Send + Sync>;
type Observer = Arc<dyn Fn(&Delivery, &Verdict) + Send + Sync>;

/// The route name business keys are claimed under (message ids get their own).
const BY_BUSINESS_KEY: &str = "business-key";
const BY_MESSAGE_ID: &str = "message-id";
/// The verbs a business key is claimed under, and its dead letter's note recorded under.
const CONSUME: &str = "CONSUME";
const DEAD: &str = "DEAD";
/// "Keep": long enough to outlive any broker's or publisher's retry horizon.
const KEEP: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
/// The engine speaks in responses; the inbox tells it only commit (record the key) or roll back
/// (keep no record). A handler's failure itself travels back typed, beside the response.
const COMMIT: StatusCode = StatusCode::NO_CONTENT;
const ROLL_BACK: StatusCode = StatusCode::SERVICE_UNAVAILABLE;

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
            .field("engine", &self.engine)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend> Inbox<DB> {
    /// An inbox for the consumer `name`, keeping its claims in `store`.
    ///
    /// The name scopes the keys, as principal and route scope HTTP keys: two consumers
    /// applying the same event each apply it once. Defaults: dedupe by message id, 5 attempts,
    /// a backoff of up to 1 s doubling to at most 60 s, records kept, a 5 s wait on an in-flight
    /// duplicate.
    pub fn new(name: impl Into<String>, store: Store<DB>) -> Self {
        let name: String = name.into();
        // Only a commit counts as done: a permanent failure must leave the key unclaimed so that
        // a replay after the fix goes through the same claim (see the module docs).
        let engine = Engine::new(store.clone())
            .retention(KEEP)
            .classify(|status| {
                if status == COMMIT {
                    Classification::Completed
                } else {
                    Classification::Retryable
                }
            });
        Self {
            name: name.into(),
            engine,
            failures: Engine::new(store).retention(KEEP),
            key: Arc::new(|delivery: &Delivery| {
                delivery
                    .id()
                    .map(str::to_owned)
                    .ok_or_else(|| Failure::permanent("the message has no message id"))
            }),
            route: BY_MESSAGE_ID,
            max_attempts: 5,
            backoff: Backoff::exponential(Duration::from_secs(1), Duration::from_secs(60)),
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
                .id()
                .map(str::to_owned)
                .ok_or_else(|| Failure::permanent("the message has no message id"))
        });
        inbox.route = BY_MESSAGE_ID;
        inbox
    }

    /// The attempt at which a retryable failure is dead-lettered instead (default 5).
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

    /// How long dedupe records are kept (default: kept). Must exceed the broker's redelivery
    /// horizon and the publishers' retry horizon, or a late copy applies again.
    ///
    /// Expired records stay in the table until the store purges them:
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

    /// Counts of processed, duplicate, retried and dead deliveries so far.
    pub fn stats(&self) -> Stats {
        let c = &self.counters;
        Stats {
            processed: c.processed.load(Ordering::Relaxed),
            duplicates: c.duplicates.load(Ordering::Relaxed),
            retried: c.retried.load(Ordering::Relaxed),
            dead: c.dead.load(Ordering::Relaxed),
        }
    }

    /// Whether the delivery's business key has been applied: a committed claim exists and has
    /// not expired (see [`retention`](Self::retention)). It reads through the engine's
    /// [`look_up`](Engine::look_up), so it is logged as that is, with the key's digest only.
    pub async fn is_applied(&self, delivery: &Delivery) -> Result<bool, Error> {
        let Ok(key) = (self.key)(delivery) else {
            return Ok(false);
        };
        let Ok(scope) = self.scope(CONSUME, &key) else {
            return Ok(false);
        };
        // The inbox's engine keeps a record only for a commit: any final record is applied.
        Ok(matches!(
            self.engine.look_up(&scope).await?,
            Lookup::Final(_)
        ))
    }

    /// Runs `handler` for one delivery unless its business key was applied before, and says
    /// what the broker adapter must do with it. Never panics on the delivery's content.
    pub async fn handle<F, Fut>(&self, delivery: Delivery, handler: F) -> Verdict
    where
        F: FnMut(Tx<DB>, Delivery) -> Fut + Send + 'static,
        Fut: Future<Output = Result<(), Failure>> + Send + 'static,
    {
        let verdict = self.decide(&delivery, handler, false).await;
        self.count(&verdict);
        if let Some(observe) = &self.observer {
            observe(&delivery, &verdict);
        }
        verdict
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
            self.counters.processed.fetch_add(1, Ordering::Relaxed);
        }
        verdict
    }

    async fn decide<F, Fut>(&self, delivery: &Delivery, handler: F, replay: bool) -> Verdict
    where
        F: FnMut(Tx<DB>, Delivery) -> Fut + Send + 'static,
        Fut: Future<Output = Result<(), Failure>> + Send + 'static,
    {
        let key = match (self.key)(delivery) {
            Ok(key) => key,
            Err(failure) => return self.failed(delivery, None, failure, replay).await,
        };
        let scope = match self.scope(CONSUME, &key) {
            Ok(scope) => scope,
            Err(failure) => return self.failed(delivery, None, failure, replay).await,
        };
        // The handler's failure comes back here typed; the engine only learns whether to
        // commit. A slot rather than a channel: the engine calls the handler again when the
        // database aborted its transaction on a conflict, and the last call's failure counts.
        let reported: Arc<Mutex<Option<Failure>>> = Arc::default();
        let report = Arc::clone(&reported);
        let mut handler = handler;
        let message = delivery.clone();
        let run = self
            .engine
            .run(&scope, self.fingerprint(), move |tx| {
                let applied = handler(tx, message.clone());
                let report = Arc::clone(&report);
                async move {
                    match applied.await {
                        Ok(()) => COMMIT.into_response(),
                        Err(failure) => {
                            // A conflict abort: the engine runs the handler again, as it does
                            // for a request under the layer.
                            let rerun = matches!(failure, Failure::Conflict(_));
                            // No one reads it if the caller went away meanwhile: the rollback
                            // stands either way, and the broker redelivers.
                            *report.lock().unwrap_or_else(PoisonError::into_inner) = Some(failure);
                            if rerun {
                                conflict_aborted()
                            } else {
                                ROLL_BACK.into_response()
                            }
                        }
                    }
                }
            })
            .await;
        match run {
            Ok(execution) => match execution.outcome {
                Outcome::Replayed => Verdict::Duplicate,
                Outcome::RolledBack => {
                    let failure = reported
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .take()
                        .unwrap_or_else(|| {
                            Failure::retryable("the handler's transaction was rolled back")
                        });
                    self.failed(delivery, Some(&key), failure, replay).await
                }
                _ => Verdict::Applied,
            },
            Err(Rejection::InProgress { retry_after }) => {
                // Another delivery of the key still holds the claim past the wait: come back
                // later and find its outcome, rather than run the handler beside it.
                Verdict::Retry { after: retry_after }
            }
            Err(rejection) => {
                // The store failed or the handler panicked: nothing was committed.
                tracing::warn!(consumer = %self.name, error = %rejection, "inbox could not apply a delivery");
                let failure = Failure::retryable(format!("not applied: {rejection}"));
                self.failed(delivery, Some(&key), failure, replay).await
            }
        }
    }

    async fn failed(
        &self,
        delivery: &Delivery,
        key: Option<&str>,
        failure: Failure,
        replay: bool,
    ) -> Verdict {
        let attempt = delivery.attempts();
        match failure {
            Failure::Permanent(reason) => self.dead(delivery, key, reason).await,
            Failure::Retryable(reason) | Failure::Conflict(reason)
                if replay || attempt >= self.max_attempts =>
            {
                let reason = format!("{reason} (attempt {attempt})");
                self.dead(delivery, key, reason).await
            }
            Failure::Retryable(_) | Failure::Conflict(_) => Verdict::Retry {
                after: self.backoff.delay(attempt),
            },
        }
    }

    /// Records the failure through the engine, in its own transaction and a scope of its own,
    /// logs it, then tells the adapter to dead-letter the delivery.
    async fn dead(&self, delivery: &Delivery, key: Option<&str>, reason: String) -> Verdict {
        if let Some(Ok(scope)) = key.map(|key| self.scope(DEAD, key)) {
            let body = reason.clone();
            // The engine's record format is a response; nothing is decided from its status.
            let recorded = self
                .failures
                .run(&scope, self.fingerprint(), move |_tx: Tx<DB>| {
                    let body = body.clone();
                    async move { (StatusCode::UNPROCESSABLE_ENTITY, body) }
                })
                .await;
            if let Err(error) = recorded {
                // The dead letter is still written: losing the note beats looping on it.
                tracing::warn!(consumer = %self.name, %error, "could not record an inbox failure");
            }
        }
        // Operators look for why here or in the dead letter's header; the payload (and the
        // business key, read from it) may hold personal data and stay out of the log.
        tracing::warn!(
            consumer = %self.name,
            message_id = delivery.id(),
            attempt = delivery.attempts(),
            reason = %reason,
            "inbox dead-lettered a delivery"
        );
        Verdict::Dead { reason }
    }

    fn count(&self, verdict: &Verdict) {
        let counter = match verdict {
            Verdict::Applied => &self.counters.processed,
            Verdict::Duplicate => &self.counters.duplicates,
            Verdict::Retry { .. } => &self.counters.retried,
            Verdict::Dead { .. } => &self.counters.dead,
        };
        counter.fetch_add(1, Ordering::Relaxed);
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
