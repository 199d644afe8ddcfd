//! Claim → execute → record: the one path every intent takes.
//!
//! [`IdempotencyLayer`](crate::IdempotencyLayer) is a thin HTTP adapter over an [`Engine`].
//! Background jobs, reconciliation tasks and manual replays call the same engine directly
//! (R16), so a job and an HTTP request that share a scoped key still execute the business once:
//!
//! ```
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use axum_idempotency::{Engine, Fingerprinter, IdempotencyKey, Outcome, Scope, SqliteStore, Store, Tx};
//! use sqlx::Sqlite;
//!
//! let store = SqliteStore::new(sqlx::SqlitePool::connect("sqlite::memory:").await?);
//! store.migrate().await?;
//! let engine = Engine::new(store);
//!
//! let key: IdempotencyKey = "invoice-2026-11-alice".parse()?;
//! let scope = Scope::new("billing-job", "RUN", "monthly-invoice", key);
//! let fingerprint = Fingerprinter::new().fingerprint_value("monthly-invoice", br#"{"month":"2026-11"}"#);
//!
//! let first = engine
//!     .run(&scope, fingerprint, |mut tx: Tx<Sqlite>| async move {
//!         sqlx::query("SELECT 1").execute(&mut *tx).await.map(|_| "invoiced").map_err(|_| "failed")
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
//! 2. Otherwise a transaction begins and claims the key with an insert against the table's
//!    unique key (never check-then-insert). A key the engine has not seen lately is claimed
//!    without that read first, since it is most likely new; if it turns out taken, the record
//!    is read in the claim's transaction and answers as in step 1. A concurrent duplicate's
//!    claim blocks on the key until the first transaction ends, bounded by
//!    [`Engine::wait_for_in_flight`]; it then replays, claims (the first rolled back), or gives
//!    up with [`Rejection::InProgress`].
//! 3. The work runs with that same transaction (the [`Tx`] handed to it). Its response is
//!    buffered and classified ([`Classification`]):
//!    - completed (2xx/3xx): the response is stored and committed together with the work's writes;
//!    - failed permanently (most 4xx): the writes are rolled back, the response is stored and
//!      replayed from then on, so the client stops;
//!    - retryable (5xx, 408, 429, a panic, a response too large to store): everything is rolled
//!      back, no record remains, and the same key executes afresh next time.
//!
//! The transactional part is never cancelled halfway: if a client hangs up mid-request, what is
//! left of it moves to a task of its own and completes there, so no pooled connection is left
//! inside an open transaction.

use std::any::Any;
use std::collections::hash_map::RandomState;
use std::fmt;
use std::future::Future;
use std::hash::BuildHasher;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::response::IntoResponse;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use http_body_util::{BodyExt, Limited};
use sqlx::Transaction;
use tokio::sync::watch;
use tracing::Instrument;

use crate::cache::ReplayCache;
use crate::error::{Error, Rejection};
use crate::fingerprint::{Fingerprint, Verbatim};
use crate::recent::RecentKeys;
use crate::record::{Record, RecordState, StoredResponse};
use crate::scope::{IdempotencyContext, Scope, ScopedKey};
use crate::store::{LeaseClaim, NewRecord, Opened, Store};
use crate::tx::{Tx, TxSlot};

/// The header a replayed response carries.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// What to do with a response, decided from its status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Classification {
    /// Store the response and commit the work.
    Completed,
    /// Roll the work back, but store the response and replay it: the refusal is final.
    FailedPermanent,
    /// Roll everything back and keep no record: the client may retry with the same key.
    Retryable,
}

impl Classification {
    /// The default rule: 2xx/3xx complete; 408, 429 and 5xx are retryable; other 4xx are final.
    pub fn of_status(status: StatusCode) -> Self {
        if status.is_success() || status.is_redirection() {
            Self::Completed
        } else if status.is_client_error()
            && status != StatusCode::REQUEST_TIMEOUT
            && status != StatusCode::TOO_MANY_REQUESTS
        {
            Self::FailedPermanent
        } else {
            Self::Retryable
        }
    }
}

/// How an intent was answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// The work ran now and its outcome was committed (completed or failed permanently).
    Executed,
    /// A stored outcome was replayed; the work did not run.
    Replayed,
    /// The work ran but its outcome was retryable, so everything was rolled back.
    RolledBack,
    /// A lease that had run out was taken over and the recovery hook found the work done: its
    /// answer was recorded without running the work again.
    Recovered,
}

/// The response to an intent and how it was obtained.
#[derive(Debug)]
pub struct Execution {
    /// The response: as the work produced it, or as stored (plus `Idempotent-Replayed: true`).
    pub response: http::Response<Bytes>,
    /// Whether it was executed, replayed or rolled back.
    pub outcome: Outcome,
}

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
    ttl: Duration,
    wait: Duration,
    max_response_body: usize,
    classify: Classifier,
    replayed_headers: Vec<HeaderName>,
    cache: Option<ReplayCache>,
    recent: RecentKeys,
}

/// Runs intents exactly once per scoped key, on a [`Store`]. Cheap to clone.
pub struct Engine<S> {
    store: S,
    settings: Arc<Settings>,
}

impl<S: Clone> Clone for Engine<S> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            settings: Arc::clone(&self.settings),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for Engine<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Engine")
            .field("store", &self.store)
            .field("ttl", &self.settings.ttl)
            .field("wait_for_in_flight", &self.settings.wait)
            .field("max_response_body", &self.settings.max_response_body)
            .field("replay_cache", &self.settings.cache)
            .finish_non_exhaustive()
    }
}

/// Headers never stored for replay unless asked for by [`Engine::replay_header`]: they belong
/// to the first exchange (cookies, dates) or to the connection, not to the resource.
const UNREPLAYED: [HeaderName; 11] = [
    header::SET_COOKIE,
    header::DATE,
    header::CONTENT_LENGTH,
    header::CONNECTION,
    header::TRANSFER_ENCODING,
    header::TE,
    header::TRAILER,
    header::UPGRADE,
    header::PROXY_AUTHENTICATE,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
];

impl<S: Store> Engine<S> {
    /// An engine with the defaults: 24 h retention, a 5 s wait for in-flight duplicates,
    /// responses up to 1 MiB stored, [`Classification::of_status`].
    pub fn new(store: S) -> Self {
        Self {
            store,
            settings: Arc::new(Settings {
                ttl: Duration::from_secs(24 * 3600),
                wait: Duration::from_secs(5),
                max_response_body: 1024 * 1024,
                classify: Arc::new(Classification::of_status),
                replayed_headers: Vec::new(),
                cache: None,
                recent: RecentKeys::new(),
            }),
        }
    }

    fn settings_mut(&mut self) -> &mut Settings {
        Arc::make_mut(&mut self.settings)
    }

    /// How long a record counts (default 24 h). After that its key is a new intent.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.settings_mut().ttl = ttl;
        self
    }

    /// How long a duplicate waits for its in-flight original before answering
    /// [`Rejection::InProgress`] (default 5 s). The wait is the database's own lock wait.
    pub fn wait_for_in_flight(mut self, wait: Duration) -> Self {
        self.settings_mut().wait = wait;
        self
    }

    /// The largest response body stored for replay (default 1 MiB). A larger response is
    /// rolled back and answered with [`Rejection::ResponseTooLarge`].
    pub fn max_response_body(mut self, bytes: usize) -> Self {
        self.settings_mut().max_response_body = bytes;
        self
    }

    /// Replaces the rule that classifies responses (default [`Classification::of_status`]).
    pub fn classify<F>(mut self, classify: F) -> Self
    where
        F: Fn(StatusCode) -> Classification + Send + Sync + 'static,
    {
        self.settings_mut().classify = Arc::new(classify);
        self
    }

    /// Stores and replays a header that is left out by default (`Set-Cookie`, `Date`).
    /// Hop-by-hop headers and `Content-Length` are never replayed.
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
    /// ```
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use axum_idempotency::{Engine, SqliteStore};
    ///
    /// let store = SqliteStore::new(sqlx::SqlitePool::connect("sqlite::memory:").await?);
    /// let engine = Engine::new(store).cache_replays(16 * 1024 * 1024);
    /// # let _ = engine;
    /// # Ok(()) }
    /// ```
    pub fn cache_replays(mut self, max_bytes: usize) -> Self {
        self.settings_mut().cache = Some(ReplayCache::new(
            u64::try_from(max_bytes).unwrap_or(u64::MAX),
        ));
        self
    }

    /// The store this engine writes to.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The retention of records.
    pub fn retention(&self) -> Duration {
        self.settings.ttl
    }

    /// Runs `work` once for `scope` with the transaction that holds the claim, or answers
    /// from the stored outcome. See the [module docs](self).
    pub async fn run<F, Fut, R>(
        &self,
        scope: &Scope,
        fingerprint: Fingerprint,
        work: F,
    ) -> Result<Execution, Rejection>
    where
        F: FnOnce(Tx<S::Database>) -> Fut + Send + 'static,
        Fut: Future<Output = R> + Send + 'static,
        R: IntoResponse,
    {
        self.run_in_slot(scope, fingerprint, move |_, slot, _context| async move {
            match slot.into_tx() {
                Ok(tx) => work(tx).await.into_response(),
                Err(_) => Rejection::TransactionHeld.into_response(),
            }
        })
        .await
    }

    /// [`run`](Self::run) for the layer: `work` gets the intent back (the request it carries)
    /// with a transaction slot and the request's context.
    pub(crate) async fn run_in_slot<I, F, Fut, R>(
        &self,
        scope: &Scope,
        intent: I,
        work: F,
    ) -> Result<Execution, Rejection>
    where
        I: Intent,
        F: FnOnce(I, TxSlot<S::Database>, IdempotencyContext) -> Fut + Send + 'static,
        Fut: Future<Output = R> + Send + 'static,
        R: IntoResponse,
    {
        self.supervise(scope, intent, |key, scope, intent| {
            // Cloned only here: a replay answered from the cache never needs its own engine.
            let engine = self.clone();
            async move {
                let fingerprint = intent.fingerprint();
                let request = match engine.settings.cache {
                    Some(_) => intent.verbatim(),
                    None => None,
                };
                engine
                    .execute(key, &scope, fingerprint, request, move |slot, context| {
                        work(intent, slot, context)
                    })
                    .await
            }
        })
        .await
    }

    /// Runs `work` once for `scope` under a lease, for work that cannot live inside one
    /// transaction (a job calling other systems, a long reconciliation).
    ///
    /// The claim is committed as `processing` with a lease of `lease`, renewed every third of
    /// it while `work` runs; duplicates meanwhile get [`Rejection::InProgress`]. If the holder
    /// dies, its lease runs out and the next caller takes the claim over; before redoing the work
    /// it asks `recover` whether the work in fact completed (look the effect up downstream:
    /// querying beats a blind redo). `Some(response)` is recorded as the outcome without running
    /// `work`; `None` runs it. The outcome is recorded only while the lease is still held; a
    /// holder that lost its lease gets [`Rejection::LeaseLost`]. The work has no transaction
    /// of its own: what it does outside the database is its own to make safe.
    ///
    /// ```
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// use axum_idempotency::{Engine, Fingerprinter, Outcome, Scope, SqliteStore, Store};
    ///
    /// let store = SqliteStore::new(sqlx::SqlitePool::connect("sqlite::memory:").await?);
    /// store.migrate().await?;
    /// let engine = Engine::new(store);
    /// let scope = Scope::new("reconciler", "RUN", "settle-day", "2026-12-01".parse()?);
    /// let fingerprint = Fingerprinter::new().fingerprint_value("settle-day", b"{}");
    ///
    /// let done = engine
    ///     .run_leased(
    ///         &scope,
    ///         fingerprint,
    ///         Duration::from_secs(30),
    ///         || async { None::<&'static str> }, // ask the bank whether the day was settled
    ///         |lease| async move {
    ///             assert!(!lease.is_lost());
    ///             "settled"
    ///         },
    ///     )
    ///     .await?;
    /// assert_eq!(done.outcome, Outcome::Executed);
    /// # Ok(()) }
    /// # tokio::runtime::Runtime::new().unwrap().block_on(run()).unwrap();
    /// ```
    pub async fn run_leased<C, CF, CR, W, WF, WR>(
        &self,
        scope: &Scope,
        fingerprint: Fingerprint,
        lease: Duration,
        recover: C,
        work: W,
    ) -> Result<Execution, Rejection>
    where
        C: FnOnce() -> CF + Send + 'static,
        CF: Future<Output = Option<CR>> + Send,
        CR: IntoResponse,
        W: FnOnce(Lease) -> WF + Send + 'static,
        WF: Future<Output = WR> + Send,
        WR: IntoResponse,
    {
        let engine = self.clone();
        self.supervise(
            scope,
            fingerprint,
            move |key, scope, fingerprint| async move {
                engine
                    .execute_leased(key, &scope, fingerprint, lease, recover, work)
                    .await
            },
        )
        .await
    }

    async fn execute_leased<C, CF, CR, W, WF, WR>(
        &self,
        key: ScopedKey,
        scope: &Scope,
        fingerprint: Fingerprint,
        lease: Duration,
        recover: C,
        work: W,
    ) -> (Result<Execution, Rejection>, &'static str)
    where
        C: FnOnce() -> CF,
        CF: Future<Output = Option<CR>>,
        CR: IntoResponse,
        W: FnOnce(Lease) -> WF,
        WF: Future<Output = WR>,
        WR: IntoResponse,
    {
        let owner = lease_owner();
        let lease_ms = i64::try_from(lease.as_millis()).unwrap_or(i64::MAX);
        let claim_at = move |now: i64| LeaseClaim {
            owner,
            until_ms: now.saturating_add(lease_ms),
        };
        let now = now_ms();
        let taken_over = match self.store.lookup(&key).await {
            Err(error) => return internal(error),
            Ok(Some(record)) if !record.is_expired(now) => {
                let lease_ran_out = record.state == RecordState::Processing
                    && record.fingerprint == fingerprint
                    && record.lease_expires_at_ms.is_some_and(|until| until <= now);
                if !lease_ran_out {
                    return self.answer_stored(key, record, fingerprint, None);
                }
                match self.store.take_over_lease(&key, claim_at(now), now).await {
                    Ok(true) => true,
                    Ok(false) => return (Err(IN_PROGRESS), "in_flight"),
                    Err(error) => return internal(error),
                }
            }
            Ok(_) => {
                let record = NewRecord {
                    lease: Some(claim_at(now)),
                    ..self.new_record(key, scope, fingerprint, RecordState::Processing)
                };
                let claim = self.claim(&record, None).await;
                match claim {
                    Ok(Claim::Ours(tx)) => {
                        if let Err(error) = tx.commit().await {
                            return internal(error);
                        }
                        false
                    }
                    Ok(Claim::Theirs(record)) => {
                        return self.answer_stored(key, record, fingerprint, None);
                    }
                    Err(rejection) => return (Err(rejection), "in_flight"),
                }
            }
        };

        let (lost_tx, lost_rx) = watch::channel(false);
        let store = self.store.clone();
        let _renewer = AbortOnDrop(tokio::spawn(async move {
            let mut tick = tokio::time::interval((lease / 3).max(Duration::from_millis(10)));
            tick.tick().await;
            loop {
                tick.tick().await;
                if !matches!(store.renew_lease(&key, claim_at(now_ms())).await, Ok(true)) {
                    let _ = lost_tx.send(true);
                    return;
                }
            }
        }));
        let found = match taken_over {
            true => recover().await.map(IntoResponse::into_response),
            false => None,
        };
        let recovered = found.is_some();
        let response = match found {
            Some(found) => found,
            None => work(Lease { lost: lost_rx }).await.into_response(),
        };
        let (parts, body) = response.into_parts();
        let body = match Limited::new(body, self.settings.max_response_body)
            .collect()
            .await
        {
            Ok(collected) => collected.to_bytes(),
            Err(_) => {
                let _ = self.store.release_lease(&key, owner).await;
                return (Err(Rejection::ResponseTooLarge), "retryable");
            }
        };
        let response = http::Response::from_parts(parts, body);
        let state = match (self.settings.classify)(response.status()) {
            Classification::Completed => RecordState::Completed,
            Classification::FailedPermanent => RecordState::FailedPermanent,
            Classification::Retryable => {
                if let Err(error) = self.store.release_lease(&key, owner).await {
                    return internal(error);
                }
                return (
                    Ok(Execution {
                        response,
                        outcome: Outcome::RolledBack,
                    }),
                    "retryable",
                );
            }
        };
        match self
            .store
            .finish_leased(&key, owner, state, &self.storable(&response))
            .await
        {
            Ok(true) if recovered => (
                Ok(Execution {
                    response,
                    outcome: Outcome::Recovered,
                }),
                "recovered",
            ),
            Ok(true) => (
                Ok(Execution {
                    response,
                    outcome: Outcome::Executed,
                }),
                "executed",
            ),
            Ok(false) => (Err(Rejection::LeaseLost), "lease_lost"),
            Err(error) => internal(error),
        }
    }

    async fn execute<F, Fut, R>(
        &self,
        key: ScopedKey,
        scope: &Scope,
        fingerprint: Fingerprint,
        request: Option<Verbatim>,
        work: F,
    ) -> (Result<Execution, Rejection>, &'static str)
    where
        F: FnOnce(TxSlot<S::Database>, IdempotencyContext) -> Fut,
        Fut: Future<Output = R>,
        R: IntoResponse,
    {
        // A key this instance has handled lately is likely a retry: one read answers it without
        // a transaction, on the connection that, for a key not yet taken, goes on to claim it.
        // Any other key is likely new and is claimed at once, saving the read (see `recent`).
        let (begun, expired) = if self.settings.recent.saw(&key) {
            match self.store.open(&key, now_ms(), self.settings.wait).await {
                Ok(Opened::Live(record)) => {
                    return self.answer_stored(key, record, fingerprint, request);
                }
                Ok(Opened::Claimable { tx, expired }) => (Some(tx), expired),
                Err(Error::Busy | Error::Conflict) => return (Err(IN_PROGRESS), "in_flight"),
                Err(error) => return internal(error),
            }
        } else {
            (None, false)
        };
        let record = self.new_record(key, scope, fingerprint, RecordState::Processing);
        let mut tx = match self.claim(&record, begun).await {
            Ok(Claim::Ours(tx)) => tx,
            Ok(Claim::Theirs(record)) => {
                return self.answer_stored(key, record, fingerprint, request);
            }
            Err(rejection) => {
                let outcome = if matches!(rejection, Rejection::InProgress { .. }) {
                    "in_flight"
                } else {
                    "retryable"
                };
                return (Err(rejection), outcome);
            }
        };

        let slot = TxSlot::ready(tx);
        let context = IdempotencyContext::with_key(scope.clone(), key);
        let response = work(slot.clone(), context).await.into_response();
        let (parts, body) = response.into_parts();
        let body = Limited::new(body, self.settings.max_response_body)
            .collect()
            .await;
        tx = match slot.take_back() {
            Ok(Some(tx)) => tx,
            Ok(None) | Err(_) => {
                tracing::error!("a Tx was still held when the work returned; rolled back");
                return (Err(Rejection::TransactionHeld), "retryable");
            }
        };
        let body = match body {
            Ok(collected) => collected.to_bytes(),
            Err(error) => {
                tracing::warn!(%error, limit = self.settings.max_response_body,
                    "response body too large to store or unreadable; rolled back");
                return (Err(Rejection::ResponseTooLarge), "retryable");
            }
        };
        let response = http::Response::from_parts(parts, body);

        match (self.settings.classify)(response.status()) {
            Classification::Completed => {
                let stored = self.storable(&response);
                let committed = async {
                    self.store
                        .finish(&mut tx, &key, RecordState::Completed, &stored)
                        .await?;
                    tx.commit().await.map_err(Error::from)
                };
                if let Err(error) = committed.await {
                    return internal(error);
                }
                self.remember(&record, RecordState::Completed, &stored, request);
                let outcome = if expired { "expired" } else { "executed" };
                (
                    Ok(Execution {
                        response,
                        outcome: Outcome::Executed,
                    }),
                    outcome,
                )
            }
            Classification::FailedPermanent => {
                // Undo the work's writes by ending its transaction, then record the refusal in
                // a fresh one. A duplicate that claimed in between ran the work itself; its
                // outcome is the key's outcome, and this request answers with it.
                if let Err(error) = tx.rollback().await {
                    return internal(error);
                }
                let stored = self.storable(&response);
                let record = NewRecord {
                    response: Some(&stored),
                    ..self.new_record(key, scope, fingerprint, RecordState::FailedPermanent)
                };
                match self.claim(&record, None).await {
                    Ok(Claim::Ours(tx)) => {
                        if let Err(error) = tx.commit().await {
                            return internal(error);
                        }
                        self.remember(&record, RecordState::FailedPermanent, &stored, request);
                        (
                            Ok(Execution {
                                response,
                                outcome: Outcome::Executed,
                            }),
                            "failed_permanent",
                        )
                    }
                    Ok(Claim::Theirs(record)) => {
                        self.answer_stored(key, record, fingerprint, request)
                    }
                    Err(rejection) => (Err(rejection), "retryable"),
                }
            }
            Classification::Retryable => {
                if let Err(error) = tx.rollback().await {
                    return internal(error);
                }
                (
                    Ok(Execution {
                        response,
                        outcome: Outcome::RolledBack,
                    }),
                    "retryable",
                )
            }
        }
    }

    /// A record for `scope` created now, expiring after the retention.
    fn new_record<'a>(
        &self,
        key: ScopedKey,
        scope: &'a Scope,
        fingerprint: Fingerprint,
        state: RecordState,
    ) -> NewRecord<'a> {
        let now = now_ms();
        NewRecord {
            key,
            scope,
            fingerprint,
            state,
            response: None,
            lease: None,
            created_at_ms: now,
            expires_at_ms: now
                .saturating_add(i64::try_from(self.settings.ttl.as_millis()).unwrap_or(i64::MAX)),
        }
    }

    /// Claims the record's key in `begun` (or a transaction begun now), or reads the live
    /// record that holds it.
    async fn claim(
        &self,
        record: &NewRecord<'_>,
        mut begun: Option<Transaction<'static, S::Database>>,
    ) -> Result<Claim<S::Database>, Rejection> {
        // Another round settles the two races a claim can lose without an answer: the record
        // vanished between the failed claim and the read (purged as it expired), or the
        // database picked this transaction as a deadlock victim (InnoDB does when an original
        // rolls back under waiting duplicates). The victim's transaction is gone; claiming again
        // queues it behind the winner like any duplicate.
        for _ in 0..3 {
            let mut tx = match begun.take() {
                Some(tx) => tx,
                None => match self.store.begin(self.settings.wait).await {
                    Ok(tx) => tx,
                    Err(Error::Conflict) => continue,
                    Err(error) => return Err(busy_or_internal(error)),
                },
            };
            match self.store.claim(&mut tx, record, self.settings.wait).await {
                Ok(true) => return Ok(Claim::Ours(tx)),
                Ok(false) => {}
                Err(Error::Conflict) => continue,
                Err(error) => return Err(busy_or_internal(error)),
            }
            match self.store.find(&mut tx, &record.key).await {
                Ok(Some(existing)) => return Ok(Claim::Theirs(existing)),
                Ok(None) | Err(Error::Conflict) => {}
                Err(error) => return Err(busy_or_internal(error)),
            }
        }
        Err(IN_PROGRESS)
    }

    /// Answers from a record read from the store, and keeps it for the next replay when the
    /// replay cache is on, with `request` when that is the same intent.
    fn answer_stored(
        &self,
        key: ScopedKey,
        record: Record,
        fingerprint: Fingerprint,
        request: Option<Verbatim>,
    ) -> (Result<Execution, Rejection>, &'static str) {
        let same_intent = record.fingerprint == fingerprint;
        let answer = answer_existing(&record, same_intent);
        if let Some(cache) = &self.settings.cache {
            cache.insert(key, record, request.filter(|_| same_intent), now_ms());
        }
        answer
    }

    /// Keeps the outcome this engine has just committed for `record` and the `request` it
    /// answers, when the replay cache is on.
    fn remember(
        &self,
        record: &NewRecord<'_>,
        state: RecordState,
        response: &StoredResponse,
        request: Option<Verbatim>,
    ) {
        if let Some(cache) = &self.settings.cache {
            let kept = Record {
                state,
                fingerprint: record.fingerprint,
                response: Some(response.clone()),
                created_at_ms: record.created_at_ms,
                expires_at_ms: record.expires_at_ms,
                lease_expires_at_ms: None,
            };
            cache.insert(record.key, kept, request, now_ms());
        }
    }

    /// Runs one intent's future to completion even if the caller goes away ([`Uncancelled`]),
    /// inside its tracing span, and logs the outcome; a panic in it surfaces as
    /// [`Rejection::Internal`]. A final record held by the replay cache answers at once,
    /// without a store access, and without a fingerprint when the attempt is the very request
    /// the record was kept with.
    async fn supervise<I, F, Fut>(
        &self,
        scope: &Scope,
        intent: I,
        run: F,
    ) -> Result<Execution, Rejection>
    where
        I: Intent,
        F: FnOnce(ScopedKey, Scope, I) -> Fut,
        Fut: Future<Output = (Result<Execution, Rejection>, &'static str)> + Send + 'static,
    {
        let key = scope.scoped_key();
        let span = tracing::info_span!(
            "idempotency",
            key = %key,
            method = scope.method(),
            route = scope.route(),
            outcome = tracing::field::Empty,
        );
        let cached = self
            .settings
            .cache
            .as_ref()
            .and_then(|cache| cache.get(&key, now_ms()));
        let (result, outcome) = match cached {
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
                        (Err(Rejection::Internal), "retryable")
                    }
                }
            }
        };
        span.record("outcome", outcome);
        let _enter = span.enter();
        tracing::info!(outcome, "idempotent request");
        result
    }

    fn storable(&self, response: &http::Response<Bytes>) -> StoredResponse {
        let mut headers = HeaderMap::new();
        // Headers the response itself names in `Connection` are hop-by-hop too.
        let named_by_connection: Vec<String> = response
            .headers()
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(|v| v.trim().to_ascii_lowercase())
            .collect();
        for (name, value) in response.headers() {
            let opted_in = self.settings.replayed_headers.contains(name)
                && !matches!(
                    *name,
                    header::CONTENT_LENGTH | header::CONNECTION | header::TRANSFER_ENCODING
                );
            let excluded =
                UNREPLAYED.contains(name) || named_by_connection.iter().any(|n| n == name.as_str());
            if opted_in || !excluded {
                headers.append(name.clone(), value.clone());
            }
        }
        StoredResponse {
            status: response.status(),
            headers,
            body: response.body().clone(),
        }
    }
}

/// Replays a final record for the same intent; refuses another intent; reports work still
/// in flight.
fn answer_existing(
    record: &Record,
    same_intent: bool,
) -> (Result<Execution, Rejection>, &'static str) {
    if !same_intent {
        return (Err(Rejection::KeyReused), "mismatch");
    }
    match (record.state, &record.response) {
        (RecordState::Completed | RecordState::FailedPermanent, Some(stored)) => {
            let mut response = stored.to_response();
            response
                .headers_mut()
                .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
            (
                Ok(Execution {
                    response,
                    outcome: Outcome::Replayed,
                }),
                "replayed",
            )
        }
        _ => (Err(IN_PROGRESS), "in_flight"),
    }
}

/// Leased work is told through this when its lease was lost (another worker took over).
#[derive(Debug, Clone)]
pub struct Lease {
    lost: watch::Receiver<bool>,
}

impl Lease {
    /// Whether the lease was lost: the work should stop, its outcome will not be recorded.
    pub fn is_lost(&self) -> bool {
        *self.lost.borrow()
    }

    /// Resolves once the lease is lost, e.g. to `select!` against the work.
    pub async fn lost(&mut self) {
        let _ = self.lost.wait_for(|lost| *lost).await;
    }
}

/// A future that is never cancelled halfway: it runs in the caller's task, and if the caller
/// drops it before it is done (a client hanging up mid-request), what is left of it moves to a
/// task of its own and finishes there, so no transaction is abandoned mid-statement. Unlike
/// spawning every request, the common case costs no task and no cross-thread wake-up. A panic
/// while it is polled here is caught and returned as `Err`.
pub(crate) struct Uncancelled<F: Future + Send + 'static> {
    future: Option<Pin<Box<F>>>,
}

impl<F: Future + Send + 'static> Uncancelled<F> {
    pub(crate) fn new(future: F) -> Self {
        Self {
            future: Some(Box::pin(future)),
        }
    }
}

impl<F> Future for Uncancelled<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    type Output = Result<F::Output, Box<dyn Any + Send>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(future) = self.future.as_mut() else {
            return Poll::Pending;
        };
        // The future is dropped right after a panic, never polled again, so whatever state the
        // panic left it in is not observed.
        let polled = std::panic::catch_unwind(AssertUnwindSafe(|| future.as_mut().poll(cx)));
        match polled {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(output)) => {
                self.future = None;
                Poll::Ready(Ok(output))
            }
            Err(panic) => {
                self.future = None;
                Poll::Ready(Err(panic))
            }
        }
    }
}

impl<F: Future + Send + 'static> Drop for Uncancelled<F> {
    fn drop(&mut self) {
        if let Some(future) = self.future.take()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            runtime.spawn(async move {
                future.await;
            });
        }
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// An id for one lease holder: unique per call, not a secret.
fn lease_owner() -> [u8; 16] {
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let seed = (
        CALLS.fetch_add(1, Ordering::Relaxed),
        now_ms(),
        std::process::id(),
    );
    let mut owner = [0; 16];
    owner[..8].copy_from_slice(&RandomState::new().hash_one(seed).to_be_bytes());
    owner[8..].copy_from_slice(&RandomState::new().hash_one(seed).to_be_bytes());
    owner
}

enum Claim<DB: sqlx::Database> {
    Ours(Transaction<'static, DB>),
    Theirs(Record),
}

/// A lock wait that ran out means the key's original is still at work.
const IN_PROGRESS: Rejection = Rejection::InProgress {
    retry_after: Duration::from_secs(1),
};

fn busy_or_internal(error: Error) -> Rejection {
    match error {
        Error::Busy | Error::Conflict => IN_PROGRESS,
        error => {
            tracing::error!(%error, "idempotency store failed");
            Rejection::Internal
        }
    }
}

fn internal(error: impl Into<Error>) -> (Result<Execution, Rejection>, &'static str) {
    let error = error.into();
    tracing::error!(%error, "idempotency store failed; rolled back");
    (Err(Rejection::Internal), "retryable")
}

/// Milliseconds since the Unix epoch, the unit records keep time in.
pub(crate) fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

pub(crate) fn into_body_response(response: http::Response<Bytes>) -> axum::response::Response {
    response.map(Body::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn uncancelled_work_finishes_after_its_caller_is_dropped() {
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        let (done, finished) = tokio::sync::oneshot::channel();
        let work = Uncancelled::new(async move {
            let _ = released.await;
            let _ = done.send("finished");
        });
        // The caller gives up while the work is parked mid-way.
        let gave_up = tokio::time::timeout(Duration::from_millis(10), work).await;
        assert!(gave_up.is_err());
        let _ = release.send(());
        assert_eq!(finished.await, Ok("finished"));
    }

    #[tokio::test]
    async fn uncancelled_work_that_panics_is_an_error_not_an_unwind() {
        let outcome = Uncancelled::new(async {
            if now_ms() > 0 {
                panic!("handler bug");
            }
        })
        .await;
        assert!(outcome.is_err());
    }
}
