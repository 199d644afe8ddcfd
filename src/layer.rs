//! The tower adapter: [`IdempotencyLayer`] and its [`IdempotencyService`].
//!
//! The layer reads the `Idempotency-Key`, takes the principal from a verified source, buffers
//! the body (bounded), fingerprints the request and hands the rest to the [`Engine`]. Add it
//! with [`Router::route_layer`](axum::Router::route_layer) so the matched route template is known;
//! under `Router::layer` the concrete path stands in for it.
//!
//! ```
//! use std::time::Duration;
//! use axum::{Router, routing::post};
//! use axum_idempotency::{IdempotencyLayer, SqliteStore, Tx};
//! use sqlx::Sqlite;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! async fn create(mut tx: Tx<Sqlite>) -> &'static str {
//!     # let _ = &mut tx;
//!     "created"
//! }
//!
//! let store = SqliteStore::new(sqlx::SqlitePool::connect("sqlite::memory:").await?);
//! let app: Router = Router::new()
//!     .route("/orders", post(create))
//!     .route_layer(
//!         IdempotencyLayer::new(store)
//!             .allow_anonymous()
//!             .retention(Duration::from_secs(24 * 3600))
//!             .wait_for_in_flight(Duration::from_secs(5))
//!             .ignore_json_fields(["/request_time", "/trace_id"]),
//!     );
//! # let _ = app; Ok(()) }
//! ```
//!
//! # What a handler under the layer must not do
//!
//! A keyed request's claim holds one connection of the store's pool, inside a transaction,
//! from before the handler runs until its response is recorded. The handler must do its
//! database work through that transaction ([`Tx`](crate::Tx)) and must **not take a second
//! connection from the same pool** while it runs: not directly, not through an extractor
//! (an authentication extractor that looks the caller up is the usual culprit). Under a burst
//! every connection ends up holding a claim whose handler waits for another connection, and
//! nothing moves until the pool's acquire timeout. The layer hands over what it already
//! extracted: with [`principal`](IdempotencyLayer::principal) the handler takes the caller as
//! [`Extension<P>`](axum::Extension), and [`IdempotencyContext`](crate::IdempotencyContext)
//! gives the scope. [`max_concurrent_claims`](IdempotencyLayer::max_concurrent_claims) keeps
//! connections free for the rest of the app during such a burst.
//!
//! # Time bound
//!
//! Every keyed request is answered within the layer's [`deadline`](IdempotencyLayer::deadline)
//! (ten seconds unless set): when the database is silent, the client gets `503
//! idempotency_timeout` with `Retry-After` and retries with the same key, which replays the
//! attempt if it committed after all.

use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{FromRequestParts, MatchedPath};
use axum::response::{IntoResponse, Response};
use http::request::Parts;
use http::{HeaderName, Method, Request, StatusCode};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tokio::sync::Semaphore;
use tower::ServiceExt;
use tower_layer::Layer;
use tower_service::Service;

use crate::engine::{Classification, Engine, Intent, Uncancelled, into_body_response};
use crate::error::Rejection;
use crate::fingerprint::{Fingerprint, Fingerprinter, Verbatim};
use crate::key::IdempotencyKey;
use crate::scope::{Principal, Scope};
use crate::store::{Protocol, Store};
use crate::tx::TxSlot;

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;
/// Finds the principal of a request: `Ok(None)` when the caller was refused, `Err` when the
/// source failed in a way a retry may cure.
type PrincipalFn = Arc<
    dyn for<'a> Fn(&'a mut Parts) -> BoxFuture<'a, Result<Option<String>, Rejection>> + Send + Sync,
>;

/// The default [`IdempotencyLayer::deadline`].
const DEFAULT_DEADLINE: Duration = Duration::from_secs(10);

/// The default header name, `Idempotency-Key`.
pub const IDEMPOTENCY_KEY: HeaderName = crate::key_syntax::KEY_HEADER;

#[derive(Clone)]
struct Config {
    header: HeaderName,
    keyed_methods: Vec<Method>,
    allow_missing_key: bool,
    principal: Option<PrincipalFn>,
    allow_anonymous: bool,
    max_request_body: usize,
    fingerprinter: Fingerprinter,
    deadline: Option<Duration>,
    claims: Option<Arc<Semaphore>>,
}

/// Makes the routes it wraps idempotent (see the [module docs](self) and the crate docs).
pub struct IdempotencyLayer<St> {
    engine: Engine<St>,
    config: Arc<Config>,
}

impl<St: Clone> Clone for IdempotencyLayer<St> {
    fn clone(&self) -> Self {
        Self {
            engine: self.engine.clone(),
            config: Arc::clone(&self.config),
        }
    }
}

impl<St: fmt::Debug> fmt::Debug for IdempotencyLayer<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("engine", &self.engine)
            .field("header", &self.config.header)
            .field("keyed_methods", &self.config.keyed_methods)
            .field("allow_missing_key", &self.config.allow_missing_key)
            .field("principal", &self.config.principal.is_some())
            .field("allow_anonymous", &self.config.allow_anonymous)
            .field("max_request_body", &self.config.max_request_body)
            .field("fingerprinter", &self.config.fingerprinter)
            .field("deadline", &self.config.deadline)
            .field(
                "max_concurrent_claims",
                &self.config.claims.as_ref().map(|_| "bounded"),
            )
            .finish()
    }
}

impl<St: Store> IdempotencyLayer<St> {
    /// A layer on `store` with the defaults: key required on `POST` and `PATCH`, request bodies
    /// up to 1 MiB, no principal source (so keyed requests answer 401 until one is set with
    /// [`principal`](Self::principal) and friends, or [`allow_anonymous`](Self::allow_anonymous)
    /// is chosen), and the [`Engine`] defaults.
    pub fn new(store: St) -> Self {
        Self::from_engine(Engine::new(store))
    }

    /// A layer over an existing engine, sharing its settings with jobs that use it.
    pub fn from_engine(engine: Engine<St>) -> Self {
        Self {
            engine,
            config: Arc::new(Config {
                header: IDEMPOTENCY_KEY,
                keyed_methods: vec![Method::POST, Method::PATCH],
                allow_missing_key: false,
                principal: None,
                allow_anonymous: false,
                max_request_body: 1024 * 1024,
                fingerprinter: Fingerprinter::new(),
                deadline: Some(DEFAULT_DEADLINE),
                claims: None,
            }),
        }
    }

    /// The engine behind this layer, for jobs that must share its claim logic.
    pub fn engine(&self) -> &Engine<St> {
        &self.engine
    }

    fn config_mut(&mut self) -> &mut Config {
        Arc::make_mut(&mut self.config)
    }

    fn with_principal(mut self, source: PrincipalFn) -> Self {
        self.config_mut().principal = Some(source);
        self
    }

    /// Takes the principal from extractor `P` (for example the app's own auth extractor).
    ///
    /// On a keyed request the extracted `P` is inserted into the request's extensions, so the
    /// handler takes it with [`Extension<P>`](axum::Extension) instead of running `P` again.
    /// Do that when `P` reads a database: the claim's transaction already holds a connection
    /// of the pool, and a handler that waits for a second one can deadlock the whole pool
    /// under a burst (every connection holding a claim whose handler waits for another).
    ///
    /// How `P`'s rejection is answered depends on its status: a 5xx, 408 or 429 (the
    /// extractor failed, for instance its database is down) is `503
    /// idempotency_principal_unavailable` with `Retry-After`, retryable; any other status
    /// (a refusal such as 401 or 403) is `401 idempotency_principal_missing`, final.
    #[must_use]
    pub fn principal<P>(self) -> Self
    where
        P: FromRequestParts<()> + Principal + Clone + Send + Sync + 'static,
    {
        self.principal_with_state::<P, ()>(())
    }

    /// Like [`principal`](Self::principal), for an extractor that needs the app's state.
    #[must_use]
    pub fn principal_with_state<P, T>(self, state: T) -> Self
    where
        P: FromRequestParts<T> + Principal + Clone + Send + Sync + 'static,
        T: Clone + Send + Sync + 'static,
    {
        self.with_principal(Arc::new(move |parts| {
            let state = state.clone();
            Box::pin(async move {
                match P::from_request_parts(parts, &state).await {
                    Ok(principal) => {
                        let id = principal.principal_id().into_owned();
                        parts.extensions.insert(principal);
                        Ok(Some(id))
                    }
                    Err(rejection) => {
                        let status = rejection.into_response().status();
                        if is_transient(status) {
                            tracing::warn!(%status, "the principal extractor failed; answered as retryable");
                            Err(Rejection::PrincipalUnavailable)
                        } else {
                            Ok(None)
                        }
                    }
                }
            })
        }))
    }

    /// Takes the principal from a request extension of type `P`, inserted by authentication
    /// middleware that runs before this layer.
    #[must_use]
    pub fn principal_extension<P>(self) -> Self
    where
        P: Principal + Clone + Send + Sync + 'static,
    {
        self.with_principal(Arc::new(|parts| {
            let principal = parts
                .extensions
                .get::<P>()
                .map(|p| p.principal_id().into_owned());
            Box::pin(async move { Ok(principal) })
        }))
    }

    /// Lets requests without a principal use the anonymous scope, shared by every anonymous
    /// caller. Only for routes where that is safe: anyone who learns a key can replay its
    /// response. Without this, a missing principal is a 401.
    #[must_use]
    pub fn allow_anonymous(mut self) -> Self {
        self.config_mut().allow_anonymous = true;
        self
    }

    /// The longest a keyed request waits for its answer (default ten seconds), counted from
    /// the moment the layer starts finding its principal, without the time the client takes
    /// to send its body. Past it the client gets `503
    /// idempotency_timeout` with `Retry-After`: the database is silent or saturated.
    ///
    /// Requests of the other methods (`GET`, `PUT`, `DELETE`, …, which take no key) are held
    /// to the same bound, counted from when the layer receives them: retrying them is safe by
    /// their HTTP semantics. A keyed method sent without a key under
    /// [`allow_missing_key`](Self::allow_missing_key) is not bounded: its retry after a late commit would
    /// run it twice.
    ///
    /// The attempt itself is not cut short: its transaction goes on in a task of its own and
    /// commits or rolls back there, so the client's retry with the same key either replays
    /// what committed or is told the request is still in progress (409). Nothing commits that
    /// a retry would execute a second time.
    ///
    /// Keep it above [`wait_for_in_flight`](Self::wait_for_in_flight), or duplicates waiting
    /// for their original are answered 503 rather than replayed. The pool's own acquire timeout
    /// (sqlx's `PoolOptions::acquire_timeout`, 30 s by default) is best set below it, so a
    /// pool that has run dry fails fast and is answered as retryable too.
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.config_mut().deadline = Some(deadline);
        self
    }

    /// Lets keyed requests wait for their answer as long as the database takes, with no
    /// [`deadline`](Self::deadline).
    pub fn without_deadline(mut self) -> Self {
        self.config_mut().deadline = None;
        self
    }

    /// Lets at most `claims` keyed requests hold a claim (and with it a pooled connection) at
    /// once; the others queue, within the [`deadline`](Self::deadline), before touching the
    /// pool. Unbounded by default.
    ///
    /// Set it below the pool's size so that the rest of the app (authentication, reads,
    /// requests without a key) always finds a connection during a burst of keyed requests.
    /// Clones of this layer share the bound; layers built separately bound separately.
    pub fn max_concurrent_claims(mut self, claims: usize) -> Self {
        self.config_mut().claims = Some(Arc::new(Semaphore::new(claims.max(1))));
        self
    }

    /// The header the key is read from (default `Idempotency-Key`).
    #[must_use]
    pub fn header_name(mut self, name: HeaderName) -> Self {
        self.config_mut().header = name;
        self
    }

    /// The methods that take a key (default `POST` and `PATCH`). Other methods pass through,
    /// still with a lazily begun transaction for [`Tx`](crate::Tx).
    #[must_use]
    pub fn keyed_methods<I>(mut self, methods: I) -> Self
    where
        I: IntoIterator<Item = Method>,
    {
        self.config_mut().keyed_methods = methods.into_iter().collect();
        self
    }

    /// Lets keyed methods run without a key, unprotected, instead of answering 400
    /// `idempotency_key_missing`. A key that is present is still enforced.
    #[must_use]
    pub fn allow_missing_key(mut self) -> Self {
        self.config_mut().allow_missing_key = true;
        self
    }

    /// The largest request body accepted (default 1 MiB); larger ones are answered 413
    /// `idempotency_body_too_large` before anything is claimed.
    #[must_use]
    pub fn max_request_body(mut self, bytes: usize) -> Self {
        self.config_mut().max_request_body = bytes;
        self
    }

    /// JSON Pointers (RFC 6901) of intent-neutral body fields left out of the fingerprint,
    /// such as a request timestamp or a trace id.
    #[must_use]
    pub fn ignore_json_fields<I, T>(mut self, pointers: I) -> Self
    where
        I: IntoIterator<Item = T>,
        T: Into<String>,
    {
        let config = self.config_mut();
        config.fingerprinter = config.fingerprinter.clone().ignore_json_fields(pointers);
        self
    }

    /// Request headers that join the fingerprint (none by default); see
    /// [`Fingerprinter::include_headers`].
    #[must_use]
    pub fn include_headers<I>(mut self, names: I) -> Self
    where
        I: IntoIterator<Item = HeaderName>,
    {
        let config = self.config_mut();
        config.fingerprinter = config.fingerprinter.clone().include_headers(names);
        self
    }

    /// How long a record counts (default 24 h); see [`Engine::retention`].
    #[must_use]
    pub fn retention(mut self, retention: Duration) -> Self {
        self.engine = self.engine.retention(retention);
        self
    }

    /// See [`Engine::cache_replays`]: replays this instance has seen are answered from memory.
    #[must_use]
    pub fn cache_replays(mut self, max_bytes: usize) -> Self {
        self.engine = self.engine.cache_replays(max_bytes);
        self
    }

    /// See [`Engine::clock`]: the layer's records age only when the test moves `clock`.
    #[cfg(feature = "test-util")]
    #[must_use]
    pub fn clock(mut self, clock: crate::ManualClock) -> Self {
        self.engine = self.engine.clock(clock);
        self
    }

    /// See [`Engine::wait_for_in_flight`].
    #[must_use]
    pub fn wait_for_in_flight(mut self, wait: Duration) -> Self {
        self.engine = self.engine.wait_for_in_flight(wait);
        self
    }

    /// See [`Engine::max_response_body`].
    #[must_use]
    pub fn max_response_body(mut self, bytes: usize) -> Self {
        self.engine = self.engine.max_response_body(bytes);
        self
    }

    /// See [`Engine::classify`].
    #[must_use]
    pub fn classify<F>(mut self, classify: F) -> Self
    where
        F: Fn(StatusCode) -> Classification + Send + Sync + 'static,
    {
        self.engine = self.engine.classify(classify);
        self
    }

    /// See [`Engine::replay_header`].
    #[must_use]
    pub fn replay_header(mut self, name: HeaderName) -> Self {
        self.engine = self.engine.replay_header(name);
        self
    }
}

impl<St: Store, S> Layer<S> for IdempotencyLayer<St> {
    type Service = IdempotencyService<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService {
            inner,
            layer: Arc::new(self.clone()),
        }
    }
}

/// A keyed request as the layer received it, body buffered, for the engine to compare with its
/// key's record and to hand back for the handler.
struct Received {
    fingerprinter: Fingerprinter,
    parts: Parts,
    body: bytes::Bytes,
}

impl Intent for Received {
    fn fingerprint(&self) -> Fingerprint {
        self.fingerprinter.fingerprint(&self.parts, &self.body)
    }

    fn verbatim(&self) -> Option<Verbatim> {
        self.fingerprinter.verbatim(&self.parts, &self.body)
    }

    fn is(&self, kept: &Verbatim) -> bool {
        kept.matches(&self.fingerprinter, &self.parts, &self.body)
    }
}

/// The service [`IdempotencyLayer`] wraps a route in.
pub struct IdempotencyService<S, St> {
    inner: S,
    // One shared count to bump per request, rather than one per store, engine and config.
    layer: Arc<IdempotencyLayer<St>>,
}

impl<S: Clone, St> Clone for IdempotencyService<S, St> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            layer: Arc::clone(&self.layer),
        }
    }
}

impl<S, St: fmt::Debug> fmt::Debug for IdempotencyService<S, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("layer", &self.layer)
            .finish_non_exhaustive()
    }
}

impl<S, St> Service<Request<Body>> for IdempotencyService<S, St>
where
    St: Store,
    S: Service<Request<Body>, Error = Infallible> + Clone + Send + 'static,
    S::Response: IntoResponse,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // The inner service is readied in `call` (on the clone that will be used), as axum's
        // own middleware does; routes are always ready.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let inner = self.inner.clone();
        let layer = Arc::clone(&self.layer);
        Box::pin(async move {
            Ok(match layer.handle(inner, request).await {
                Ok(response) => response,
                Err(rejection) => rejection.into_response(),
            })
        })
    }
}

impl<St: Store> IdempotencyLayer<St> {
    async fn handle<S>(&self, inner: S, request: Request<Body>) -> Result<Response, Rejection>
    where
        S: Service<Request<Body>, Error = Infallible> + Send + 'static,
        S::Response: IntoResponse,
        S::Future: Send + 'static,
    {
        let config = &self.config;
        let (mut parts, body) = request.into_parts();
        let key = if config.keyed_methods.contains(&parts.method) {
            IdempotencyKey::from_headers(&parts.headers, &config.header)?
        } else {
            None
        };
        let Some(key) = key else {
            let keyed = config.keyed_methods.contains(&parts.method);
            if keyed && !config.allow_missing_key {
                return Err(Rejection::KeyMissing);
            }
            let passed = self.pass_through(inner, Request::from_parts(parts, body));
            // The other methods (GET, PUT, DELETE, …) are bounded too: retrying them is safe by
            // their HTTP semantics even if the attempt still commits after the 503. A keyed
            // method sent without a key is not: a retry after a late commit would run it twice,
            // so it waits for its outcome instead.
            if keyed {
                return Ok(passed.await);
            }
            return within(config.deadline, passed).await;
        };

        // The deadline covers finding the principal (its extractor may wait on the database)
        // and the engine, not the time the client takes to send its body.
        let started = tokio::time::Instant::now();
        let principal = match &config.principal {
            Some(source) => within(config.deadline, source(&mut parts)).await??,
            None => None,
        };
        let remaining = config
            .deadline
            .map(|deadline| deadline.saturating_sub(started.elapsed()));
        if principal.is_none() && !config.allow_anonymous {
            return Err(Rejection::PrincipalMissing);
        }
        let route = parts
            .extensions
            .get::<MatchedPath>()
            .map_or_else(|| parts.uri.path().to_owned(), |m| m.as_str().to_owned());

        let bytes = match Limited::new(body, config.max_request_body).collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(error) if error.downcast_ref::<LengthLimitError>().is_some() => {
                return Err(Rejection::BodyTooLarge {
                    limit: config.max_request_body,
                });
            }
            Err(error) => {
                tracing::debug!(%error, "could not read the request body");
                return Err(Rejection::BodyUnreadable);
            }
        };
        let method = parts.method.as_str().to_owned();
        let scope = match principal {
            Some(principal) => Scope::new(principal, method, route, key),
            None => Scope::anonymous(method, route, key),
        };

        let received = Received {
            fingerprinter: config.fingerprinter.clone(),
            parts,
            body: bytes,
        };
        let run = async {
            // Held here until the outcome is recorded, and shared with the work: if the
            // deadline leaves the work running on its own, the permit stays taken until its
            // handler is done.
            let permit = match &config.claims {
                Some(claims) => match Arc::clone(claims).acquire_owned().await {
                    Ok(permit) => Some(Arc::new(permit)),
                    Err(_closed) => return Err(Rejection::Internal),
                },
                None => None,
            };
            let _held = permit.clone();
            self.engine
                .run_in_slot(&scope, received, move |received, slot, context| {
                    // Built here, not before: a replay answered from the cache never needs it.
                    let Received { parts, body, .. } = received;
                    let mut request = Request::from_parts(parts, Body::from(body));
                    request.extensions_mut().insert(context);
                    request.extensions_mut().insert(slot);
                    async move {
                        let _permit = permit;
                        match inner.oneshot(request).await {
                            Ok(response) => response.into_response(),
                            Err(never) => match never {},
                        }
                    }
                })
                .await
        };
        let execution = match within(remaining, run).await {
            Ok(ran) => ran?,
            Err(timeout) => {
                tracing::warn!(key = %scope.scoped_key(),
                    "no answer within the deadline; answered 503, the attempt finishes on its own");
                return Err(timeout);
            }
        };
        Ok(into_body_response(execution.response))
    }

    /// A request without a key: no claim, but `Tx` still works, resolved by the status.
    async fn pass_through<S>(&self, inner: S, mut request: Request<Body>) -> Response
    where
        S: Service<Request<Body>, Error = Infallible> + Send + 'static,
        S::Response: IntoResponse,
        S::Future: Send + 'static,
    {
        let slot = TxSlot::lazy(self.engine.store().protocol().pool().clone());
        request.extensions_mut().insert(slot.clone());
        // Never cancelled halfway, for the same reason as keyed requests: a client hanging up
        // must not abandon a transaction mid-statement.
        let handled = Uncancelled::new(async move {
            let response = match inner.oneshot(request).await {
                Ok(response) => response.into_response(),
                Err(never) => match never {},
            };
            let tx = match slot.take_back() {
                Ok(Some(tx)) => tx,
                Ok(None) => return response,
                Err(_) => {
                    tracing::error!("a Tx was still held when the handler returned; rolled back");
                    return Rejection::TransactionHeld.into_response();
                }
            };
            let status = response.status();
            let resolved = if status.is_success() || status.is_redirection() {
                tx.commit().await
            } else {
                tx.rollback().await
            };
            match resolved {
                Ok(()) => response,
                Err(error) => {
                    tracing::error!(%error, "resolving the request's transaction failed");
                    Rejection::Internal.into_response()
                }
            }
        });
        handled.await.unwrap_or_else(|_panic| {
            tracing::error!("the handler panicked; rolled back");
            Rejection::Internal.into_response()
        })
    }
}

/// `future`'s output, or [`Rejection::Timeout`] once `limit` has passed.
async fn within<F: Future>(limit: Option<Duration>, future: F) -> Result<F::Output, Rejection> {
    match limit {
        Some(limit) => tokio::time::timeout(limit, future)
            .await
            .map_err(|_elapsed| Rejection::Timeout),
        None => Ok(future.await),
    }
}

/// Whether an extractor's rejection with `status` is a failure a retry may cure rather than a
/// refusal of the caller: the same line the engine draws for handlers' answers.
fn is_transient(status: StatusCode) -> bool {
    status.is_server_error()
        || status == StatusCode::REQUEST_TIMEOUT
        || status == StatusCode::TOO_MANY_REQUESTS
}
