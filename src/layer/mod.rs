//! The tower adapter: [`IdempotencyLayer`] and its [`IdempotencyService`].
//!
//! The layer reads the `Idempotency-Key`, takes the principal from a verified source, buffers
//! the body (bounded), fingerprints the request and hands the rest to the [`Engine`]. Add it
//! with [`Router::route_layer`](axum::Router::route_layer) so the matched route template is known;
//! under `Router::layer` the concrete path stands in for it.
//!
#![cfg_attr(feature = "sqlite", doc = "```")]
#![cfg_attr(not(feature = "sqlite"), doc = "```ignore")]
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

mod principal;
mod service;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, Method, StatusCode};
use tokio::sync::Semaphore;
use tower_layer::Layer;

use crate::Backend;
use crate::engine::{Classification, Engine};
use crate::fingerprint::Fingerprinter;
use crate::store::Store;
use crate::tx::Marker;

pub use service::{IdempotencyService, ResponseFuture};

use principal::PrincipalFn;

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
    marker: Marker,
}

/// Makes the routes it wraps idempotent (see the [module docs](self) and the crate docs).
pub struct IdempotencyLayer<DB: Backend> {
    engine: Engine<DB>,
    config: Arc<Config>,
}

impl<DB: Backend> Clone for IdempotencyLayer<DB> {
    fn clone(&self) -> Self {
        Self {
            engine: self.engine.clone(),
            config: Arc::clone(&self.config),
        }
    }
}

impl<DB: Backend, S> Layer<S> for IdempotencyLayer<DB> {
    type Service = IdempotencyService<S, DB>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService::new(inner, self.clone())
    }
}

impl<DB: Backend> fmt::Debug for IdempotencyLayer<DB> {
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
            .field("tx_marker", &self.config.marker)
            .finish()
    }
}

impl<DB: Backend> IdempotencyLayer<DB> {
    /// A layer on `store` with the defaults: key required on `POST` and `PATCH`, request bodies
    /// up to 1 MiB, no principal source (so keyed requests answer 401 until one is set with
    /// [`principal`](Self::principal) and friends, or [`allow_anonymous`](Self::allow_anonymous)
    /// is chosen), and the [`Engine`] defaults.
    pub fn new(store: Store<DB>) -> Self {
        Self::from_engine(Engine::new(store))
    }

    /// A layer over an existing engine, sharing its settings with jobs that use it.
    pub fn from_engine(engine: Engine<DB>) -> Self {
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
                marker: Marker::default(),
            }),
        }
    }

    /// The engine behind this layer, for jobs that must share its claim logic.
    pub fn engine(&self) -> &Engine<DB> {
        &self.engine
    }

    fn config_mut(&mut self) -> &mut Config {
        Arc::make_mut(&mut self.config)
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
    #[must_use]
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.config_mut().deadline = Some(deadline);
        self
    }

    /// Lets keyed requests wait for their answer as long as the database takes, with no
    /// [`deadline`](Self::deadline).
    #[must_use]
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
    #[must_use]
    pub fn max_concurrent_claims(mut self, claims: usize) -> Self {
        self.config_mut().claims = Some(Arc::new(Semaphore::new(claims.max(1))));
        self
    }

    /// Hands the request's transaction out as [`Tx<DB, M>`](crate::Tx) rather than `Tx<DB>`,
    /// so a route under two layers of one driver (two pools: two databases, two schemas) gets
    /// each layer's own: `M` is a type of your own that names the database. See
    /// [two databases of one driver](crate::tx#two-databases-of-one-driver).
    ///
    /// Without it the layer's `Tx` is unmarked, and a route under two unmarked layers of one
    /// driver gets the innermost one's.
    #[must_use]
    pub fn tx_marker<M: 'static>(mut self) -> Self {
        self.config_mut().marker = Marker::of::<M>();
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

    /// See [`Engine::timed_by`]: the layer's records age only when the test moves `clock`.
    #[cfg(feature = "test-util")]
    #[must_use]
    pub fn timed_by(mut self, clock: crate::ManualClock) -> Self {
        self.engine = self.engine.timed_by(clock);
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
