//! Claim → execute → record: the one path every intent takes.
//!
//! [`IdempotencyLayer`](crate::IdempotencyLayer) is a thin HTTP adapter over an [`Engine`].
//! Background jobs, reconciliation tasks and manual replays call the same engine directly
//! through its public API, so a job and an HTTP request that share a scoped key still execute the business once:
//!
#![cfg_attr(feature = "sqlite", doc = "```")]
#![cfg_attr(not(feature = "sqlite"), doc = "```ignore")]
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use axum_idempotency::{Engine, Fingerprinter, IdempotencyKey, Outcome, Scope, SqliteStore, Tx, TxError};
//! use sqlx::Sqlite;
//!
//! let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?;
//! sqlx::query("CREATE TABLE invoices (month TEXT)").execute(&pool).await?;
//! let store = SqliteStore::new(pool);
//! store.migrate().await?;
//! let engine = Engine::new(store);
//!
//! let key: IdempotencyKey = "invoice-2026-11-alice".parse()?;
//! let scope = Scope::new("billing-job", "RUN", "monthly-invoice", key);
//! let fingerprint = Fingerprinter::new().fingerprint_value("monthly-invoice", br#"{"month":"2026-11"}"#);
//!
//! let first = engine
//!     .run(&scope, fingerprint, |mut tx: Tx<Sqlite>| async move {
//!         sqlx::query("INSERT INTO invoices (month) VALUES ('2026-11')")
//!             .execute(&mut *tx)
//!             .await?;
//!         // A failure stays an error: as a `TxError`, a conflict abort runs the work again and
//!         // any other error rolls it back, records nothing and comes back as
//!         // `RunError::Failed`. Turned into a value of its own (a `&str`, say) it would be a
//!         // 200, recorded as done and replayed.
//!         Ok::<_, TxError>("invoiced")
//!     })
//!     .await?;
//! assert_eq!(first.outcome, Outcome::Executed);
//!
//! let again = engine.run(&scope, fingerprint, |_tx: Tx<Sqlite>| async { "never runs" }).await?;
//! assert_eq!(again.outcome, Outcome::Replayed);
//! assert_eq!(again.response.body().as_ref(), b"invoiced");
//! # Ok(()) }
//! # tokio::runtime::Runtime::new().unwrap().block_on(run()).unwrap();
//! ```
//!
//! # What happens to one intent
//!
//! 1. A committed, unexpired record under the scoped key answers with the stored outcome: a
//!    replay if the fingerprint matches, [`Rejection::KeyReused`] if it does not. For a key this
//!    engine has handled lately (a likely retry) it is one indexed read, before any transaction.
//! 2. Otherwise a transaction begins and claims the key: it takes the key for itself alone
//!    (a lock on PostgreSQL and SQLite, the record's row on MySQL) and checks that no live
//!    record holds it. A key the engine has not seen lately is claimed without a read first,
//!    since it is most likely new; if it turns out taken, the record is read and answers as in
//!    step 1. A concurrent duplicate's claim blocks on the key until the first transaction
//!    ends, bounded by [`Engine::wait_for_in_flight`]; it then replays, claims (the first
//!    rolled back), or gives up with [`Rejection::InProgress`].
//! 3. The work runs with that same transaction (the [`Tx`] handed to it). Its response is
//!    buffered and classified ([`Classification`]):
//!    - completed (2xx/3xx): the record, response and all, is written once and committed
//!      together with the work's writes; the table's unique key has the last word there, and a
//!      record that got under the key meanwhile rolls the attempt back and replays instead;
//!    - failed permanently (most 4xx): the writes are rolled back, the response is stored and
//!      replayed from then on, so the client stops;
//!    - retryable (5xx, 408, 429, a panic, a response too large to store): everything is rolled
//!      back, no record remains, and the same key executes afresh next time.
//!
//! The transactional part is never cancelled halfway: if a client hangs up mid-request, what is
//! left of it moves to a task of its own and completes there, so no pooled connection is left
//! inside an open transaction.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::response::IntoResponse;
use http::{HeaderName, StatusCode};
use tracing::Instrument;

use crate::Backend;
#[cfg(feature = "test-util")]
use crate::clock::ManualClock;
use crate::error::Rejection;
use crate::fingerprint::{Fingerprint, Verbatim};
use crate::scope::{IdempotencyContext, Scope, ScopedKey};
use crate::store::Store;
use crate::tx::{Tx, TxSlot};

#[cfg(feature = "inbox")]
mod batch;
mod cache;
mod claim;
pub(crate) mod decide;
mod execute;
mod lease;
mod metrics;
mod operator;
mod outcome;
mod recent;
mod replay;
mod run_error;
mod uncancelled;
mod verdict;

#[cfg(feature = "inbox")]
pub(crate) use batch::BatchFailed;
pub use lease::Lease;
pub use operator::Lookup;
#[cfg_attr(not(feature = "inbox"), allow(unused_imports))]
pub(crate) use outcome::Answer;
pub use outcome::{Classification, Execution, Outcome};
pub use run_error::RunError;
pub(crate) use uncancelled::Uncancelled;
#[cfg_attr(not(feature = "inbox"), allow(unused_imports))]
pub(crate) use verdict::Verdict;

use cache::ReplayCache;
use execute::Attempt;
use outcome::Logged;
use recent::RecentKeys;
use replay::answer_existing;

/// The header a replayed response carries.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

type Classifier = Arc<dyn Fn(StatusCode) -> Classification + Send + Sync>;

/// An attempt as the engine compares it with the record its key holds.
pub(crate) trait Intent: Send + 'static {
    /// Its fingerprint, computed only when a comparison needs it.
    fn fingerprint(&self) -> Fingerprint;

    /// Its fingerprinted parts as sent, kept with its record in the replay cache.
    fn verbatim(&self) -> Option<Verbatim>;

    /// Whether it is, byte for byte, the attempt `kept` was copied from.
    fn is(&self, kept: &Verbatim) -> bool;
}

/// An attempt known only by its fingerprint, such as a job's.
impl Intent for Fingerprint {
    fn fingerprint(&self) -> Fingerprint {
        *self
    }

    fn verbatim(&self) -> Option<Verbatim> {
        None
    }

    fn is(&self, _kept: &Verbatim) -> bool {
        false
    }
}

#[derive(Clone)]
struct Settings {
    retention: Duration,
    wait: Duration,
    max_response_body: usize,
    classify: Classifier,
    replayed_headers: Vec<HeaderName>,
    cache: Option<ReplayCache>,
    recent: RecentKeys,
    /// Claims keep the key alone (see [`Engine::keys_only`]).
    keys_only: bool,
}

/// Runs intents exactly once per scoped key, on a [`Store`]. Cheap to clone.
pub struct Engine<DB: Backend> {
    store: Store<DB>,
    settings: Arc<Settings>,
}

impl<DB: Backend> Clone for Engine<DB> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            settings: Arc::clone(&self.settings),
        }
    }
}

impl<DB: Backend> fmt::Debug for Engine<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Engine")
            .field("store", &self.store)
            .field("retention", &self.settings.retention)
            .field("wait_for_in_flight", &self.settings.wait)
            .field("max_response_body", &self.settings.max_response_body)
            .field("replay_cache", &self.settings.cache)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend> Engine<DB> {
    /// An engine with the defaults: 24 h retention, a 5 s wait for in-flight duplicates,
    /// responses up to 1 MiB stored, [`Classification::of_status`].
    pub fn new(store: Store<DB>) -> Self {
        Self {
            store,
            settings: Arc::new(Settings {
                retention: Duration::from_secs(24 * 3600),
                wait: Duration::from_secs(5),
                max_response_body: 1024 * 1024,
                classify: Arc::new(Classification::of_status),
                replayed_headers: Vec::new(),
                cache: None,
                recent: RecentKeys::new(),
                keys_only: false,
            }),
        }
    }

    fn settings_mut(&mut self) -> &mut Settings {
        Arc::make_mut(&mut self.settings)
    }

    /// How long a record counts (default 24 h). After that its key is a new intent. Keep it
    /// longer than clients keep retrying one intent.
    #[must_use]
    pub fn retention(mut self, retention: Duration) -> Self {
        self.settings_mut().retention = retention;
        self
    }

    /// How long a duplicate waits for its in-flight original before answering
    /// [`Rejection::InProgress`] (default 5 s). The wait is the database's own lock wait.
    #[must_use]
    pub fn wait_for_in_flight(mut self, wait: Duration) -> Self {
        self.settings_mut().wait = wait;
        self
    }

    /// The largest response body stored for replay (default 1 MiB). A larger response is
    /// rolled back and answered with [`Rejection::ResponseTooLarge`].
    #[must_use]
    pub fn max_response_body(mut self, bytes: usize) -> Self {
        self.settings_mut().max_response_body = bytes;
        self
    }

    /// Replaces the rule that classifies responses (default [`Classification::of_status`]).
    #[must_use]
    pub fn classify<F>(mut self, classify: F) -> Self
    where
        F: Fn(StatusCode) -> Classification + Send + Sync + 'static,
    {
        self.settings_mut().classify = Arc::new(classify);
        self
    }

    /// Stores and replays a header that is left out by default (`Set-Cookie`, `Date`).
    /// Hop-by-hop headers and `Content-Length` are never replayed.
    #[must_use]
    pub fn replay_header(mut self, name: HeaderName) -> Self {
        self.settings_mut().replayed_headers.push(name);
        self
    }

    /// Keeps final records this engine has stored or read in memory, up to `max_bytes` of
    /// responses, so that replaying them costs no database read (off by default).
    ///
    /// Next to a record the layer keeps the request it was answered for, exactly as sent
    /// (bodies up to 64 KiB; its bytes count against `max_bytes`): a retry identical to it byte
    /// for byte is answered without canonicalising and hashing its body. Any other retry is
    /// compared by fingerprint as without the cache, so equivalent JSON still replays and
    /// another intent is still refused.
    ///
    /// A final record (completed or failed permanently) is never rewritten before it expires,
    /// so the copy answers as the table would, on every instance, with nothing to invalidate;
    /// entries are dropped at the record's expiry or evicted when the budget is full. A
    /// duplicate of work still in flight, or a key this instance has not seen, still goes to
    /// the store. The one thing the copy does not follow is a record deleted from the table by
    /// hand before it expires: the instance that holds it keeps replaying it until expiry or
    /// eviction (restart the instance, or leave the cache off, if operators delete records).
    ///
    #[cfg_attr(feature = "sqlite", doc = "```")]
    #[cfg_attr(not(feature = "sqlite"), doc = "```ignore")]
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use axum_idempotency::{Engine, SqliteStore};
    ///
    /// let store = SqliteStore::new(sqlx::SqlitePool::connect("sqlite::memory:").await?);
    /// let engine = Engine::new(store).cache_replays(16 * 1024 * 1024);
    /// # let _ = engine;
    /// # Ok(()) }
    /// ```
    #[must_use]
    pub fn cache_replays(mut self, max_bytes: usize) -> Self {
        self.settings_mut().cache = Some(ReplayCache::new(
            u64::try_from(max_bytes).unwrap_or(u64::MAX),
        ));
        self
    }

    /// Claims keep the key alone, in the store's table of dedupe keys, for work whose callers
    /// never read a stored response back (the inbox): a completed outcome commits the claim as
    /// it is, and a key found held is answered as replayed with an empty response, without a
    /// read. A failed permanent outcome is rolled back as a retryable one is, with no key kept.
    #[cfg_attr(not(feature = "inbox"), allow(dead_code))]
    #[must_use]
    pub(crate) fn keys_only(mut self) -> Self {
        self.settings_mut().keys_only = true;
        self
    }

    /// Reads the time from `clock` instead of the wall clock: retention, leases, the replay
    /// cache and the purge of this engine's store (`engine.store().purge_expired()`) then move
    /// only when the test moves it. Give the same clock to an outbox
    /// (`Outbox::timed_by`) and its messages age with the records. For tests.
    #[cfg(feature = "test-util")]
    #[must_use]
    pub fn timed_by(mut self, clock: ManualClock) -> Self {
        self.store.set_clock(clock.into());
        self
    }

    /// The store this engine writes to.
    pub fn store(&self) -> &Store<DB> {
        &self.store
    }

    /// How this engine classifies a response's status (see [`classify`](Self::classify)).
    pub(crate) fn classification(&self, status: StatusCode) -> Classification {
        (self.settings.classify)(status)
    }

    /// Runs `work` once for `scope` with the transaction that holds the claim, or answers
    /// from the stored outcome. See the [module docs](self).
    ///
    /// `work` may be called more than once: when the database aborts its transaction to resolve
    /// a conflict with a concurrent one (see [`TxError`](crate::TxError)), nothing of that call
    /// stands and it is called again with a fresh transaction.
    ///
    /// # Errors
    ///
    /// Nothing of the work was committed when this fails; the [`RunError`] says why: the
    /// engine refused the intent ([`RunError::Rejected`]), the store failed
    /// ([`RunError::Store`]), or the work itself failed, with a retryable response or a panic
    /// ([`RunError::Failed`], [`RunError::Panicked`]). [`RunError::is_retryable`] tells whether
    /// running it again under the same key may succeed.
    pub async fn run<F, Fut, R>(
        &self,
        scope: &Scope,
        fingerprint: Fingerprint,
        mut work: F,
    ) -> Result<Execution, RunError>
    where
        F: FnMut(Tx<DB>) -> Fut + Send + 'static,
        Fut: Future<Output = R> + Send + 'static,
        R: IntoResponse,
    {
        let judge = self.clone();
        self.run_verdict(scope, fingerprint, move |tx| {
            let worked = work(tx);
            let judge = judge.clone();
            async move { judge.judge(worked.await.into_response()).await }
        })
        .await
        .result
    }

    /// [`run`](Self::run) for work that gives its [`Verdict`] itself (the inbox), its failure
    /// handed back with the answer.
    pub(crate) async fn run_verdict<F, Fut, E>(
        &self,
        scope: &Scope,
        fingerprint: Fingerprint,
        mut work: F,
    ) -> Answer<E>
    where
        F: FnMut(Tx<DB>) -> Fut + Send + 'static,
        Fut: Future<Output = Verdict<E>> + Send + 'static,
        E: Send + 'static,
    {
        self.supervise(scope, fingerprint, |key, scope, fingerprint| {
            let engine = self.clone();
            async move {
                let attempt = Attempt::new(key, &scope, fingerprint, None);
                engine
                    .execute(attempt, move |slot, _context| {
                        let work = slot.into_tx().map(&mut work);
                        async move {
                            match work {
                                Ok(work) => work.await,
                                Err(_) => Verdict::Abandon(Rejection::TransactionHeld),
                            }
                        }
                    })
                    .await
            }
        })
        .await
    }

    /// [`run`](Self::run) for the layer: `work` gets the intent (the request it carries) with a
    /// transaction slot and the request's context, once per attempt, and its response is
    /// judged by its status. A retryable response is rolled back and comes back as
    /// [`RunError::Failed`], which holds it for the client.
    pub(crate) async fn run_in_slot<I, F, Fut, R>(
        &self,
        scope: &Scope,
        intent: I,
        work: F,
    ) -> Result<Execution, RunError>
    where
        I: Intent,
        F: FnMut(&I, TxSlot<DB>, IdempotencyContext) -> Fut + Send + 'static,
        Fut: Future<Output = R> + Send + 'static,
        R: IntoResponse,
    {
        let answer: Answer = self
            .supervise(scope, intent, |key, scope, intent| {
                // Cloned only here: a replay answered from the cache never needs its own engine.
                let engine = self.clone();
                async move {
                    let request = match engine.settings.cache {
                        Some(_) => intent.verbatim(),
                        None => None,
                    };
                    let attempt = Attempt::new(key, &scope, intent.fingerprint(), request);
                    let judge = engine.clone();
                    let mut work = work;
                    engine
                        .execute(attempt, move |slot, context| {
                            let worked = work(&intent, slot, context);
                            let judge = judge.clone();
                            async move { judge.judge(worked.await.into_response()).await }
                        })
                        .await
                }
            })
            .await;
        answer.result
    }

    /// Runs one intent's future to completion even if the caller goes away ([`Uncancelled`]),
    /// inside its tracing span, and logs the outcome; a panic in it surfaces as
    /// [`RunError::Panicked`]. A final record held by the replay cache answers at once,
    /// without a store access, and without a fingerprint when the attempt is the very request
    /// the record was kept with.
    async fn supervise<I, F, Fut, E>(&self, scope: &Scope, intent: I, run: F) -> Answer<E>
    where
        I: Intent,
        F: FnOnce(ScopedKey, Scope, I) -> Fut,
        Fut: Future<Output = Answer<E>> + Send + 'static,
        E: Send + 'static,
    {
        let key = scope.scoped_key();
        let span = span(&key, scope);
        let cached = self
            .settings
            .cache
            .as_ref()
            .and_then(|cache| cache.get(&key, self.store.clock().now()));
        let answer = match cached {
            Some(cached) => {
                let verbatim = cached.request.as_ref().is_some_and(|kept| intent.is(kept));
                let same_intent = verbatim || cached.record.fingerprint == intent.fingerprint();
                answer_existing(&cached.record, same_intent)
            }
            None => {
                let work = run(key, scope.clone(), intent).instrument(span.clone());
                match Uncancelled::new(work).await {
                    Ok(done) => done,
                    Err(_panic) => {
                        let _enter = span.enter();
                        tracing::error!("the idempotent work panicked; rolled back");
                        Answer::reject(RunError::Panicked, Logged::Retryable)
                    }
                }
            }
        };
        let _enter = span.enter();
        tracing::info!(outcome = answer.logged.as_str(), "idempotent request");
        metrics::answered(answer.logged);
        answer
    }
}

/// The span an intent's work and its outcome's log line run in.
fn span(key: &ScopedKey, scope: &Scope) -> tracing::Span {
    tracing::info_span!(
        "idempotency",
        key = %key,
        method = scope.method(),
        route = scope.route(),
    )
}
