//! Exactly-once effects for retried HTTP requests in [axum](https://docs.rs/axum/0.8).
//!
//! Clients time out and retry, gateways replay, users double-click. `axum-idempotency` makes
//! each of those arrive as one business intent with the effect and the answer of exactly one
//! execution. Add an [`IdempotencyLayer`] to a router; handlers write through the [`Tx`]
//! extractor, inside the very transaction that claims the request's key (inserts the key's
//! row, which a unique constraint lets only one request insert), so the claim, the business
//! rows and the stored response commit or roll back together.
//!
#![cfg_attr(feature = "sqlite", doc = "```")]
#![cfg_attr(not(feature = "sqlite"), doc = "```ignore")]
//! use std::time::Duration;
//! use axum::{Json, Router, body::Body, http::{Request, StatusCode}, routing::post};
//! use axum_idempotency::{IdempotencyLayer, SqliteStore, Tx, TxError};
//! use sqlx::Sqlite;
//! use tower::ServiceExt;
//!
//! async fn create_order(
//!     mut tx: Tx<Sqlite>,
//!     Json(sku): Json<String>,
//! ) -> Result<(StatusCode, String), TxError> {
//!     let id: i64 = sqlx::query_scalar("INSERT INTO orders (sku) VALUES (?) RETURNING id")
//!         .bind(sku)
//!         .fetch_one(&mut *tx)
//!         .await?; // an error is never stored: a retryable 500, or run again on a conflict
//!     Ok((StatusCode::CREATED, format!("order {id}")))
//! }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?;
//! sqlx::query("CREATE TABLE orders (id INTEGER PRIMARY KEY, sku TEXT)").execute(&pool).await?;
//! let store = SqliteStore::new(pool);
//! store.migrate().await?;
//!
//! let app = Router::new()
//!     .route("/orders", post(create_order))
//!     .route_layer(
//!         IdempotencyLayer::new(store)
//!             .allow_anonymous() // a real app scopes keys with `.principal::<AuthUser>()`
//!             .retention(Duration::from_secs(24 * 3600)),
//!     );
//!
//! let request = || {
//!     Request::post("/orders")
//!         .header("content-type", "application/json")
//!         .header("idempotency-key", "8e03978e-40d5-43e8-bc93-6894a57f9324")
//!         .body(Body::from(r#""widget""#))
//!         .unwrap()
//! };
//! let first = app.clone().oneshot(request()).await?;
//! let retry = app.oneshot(request()).await?;
//! assert_eq!(first.status(), StatusCode::CREATED);
//! assert_eq!(retry.status(), StatusCode::CREATED);
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! # Ok(()) }
//! # tokio::runtime::Runtime::new().unwrap().block_on(run()).unwrap();
//! ```
//!
//! # The protocol in brief
//!
//! - The **client** makes the key: a long random value (a UUIDv4, or 128+ random bits in
//!   base64url) created before the first attempt and sent unchanged in `Idempotency-Key` on
//!   every retry. 1–255 visible ASCII characters, bare or as a structured-field string.
//! - A key is **scoped** to the principal (the caller your authentication verified, never a
//!   header the client asserts), the method and the route template.
//! - Same key, same intent: the first response again, byte for byte, with
//!   `Idempotent-Replayed: true`. Same key, different intent: 422 `idempotency_key_reused`.
//! - Same key while the first is still running: the duplicate waits (bounded), then replays;
//!   past the wait it gets 409 `idempotency_request_in_progress` with `Retry-After`.
//! - Records live 24 h by default ([`IdempotencyLayer::retention`]); then the key is a new
//!   intent.
//!
//! # How a request flows through the crate
//!
//! One request walks the modules top to bottom: [`layer`] (the tower adapter) reads the
//! [`key`], builds the [`scope`] from the verified principal, method and route, and computes
//! the [`fingerprint`] of the request; the [`engine`] claims the scoped key, runs the handler
//! with the [`tx`] extractor inside the claim's transaction and records the response, or
//! replays the stored one; the [`store`] keeps records in SQL. [`error`] holds what clients and
//! operators are told. Jobs enter at the [`Engine`], with the same claim. Behind features:
//! `outbox` (external side effects sent after commit with a stable downstream key), `inbox`
//! (message consumers that apply each business key once, acking after the commit) and `client`
//! (the caller's half: one key per logical call, reused on every retry). No database is on by
//! default: a build compiles the ones it names (`sqlite`, `postgres`, `mysql`) and no other.
//!
//! | feature | what it adds |
//! |---|---|
//! | `server` (default) | the server half: the layer, the engine, the stores; off for a client-only build |
//! | `sqlite` | `SqliteStore` |
//! | `postgres` | `PgStore` |
//! | `mysql` | `MySqlStore` (MySQL 8, MariaDB) |
//! | `outbox` | the `outbox` module: `Outbox`, `Dispatcher`, `Sender`, `HttpSender` for HTTP APIs |
//! | `client` | the `client` module: `IdempotentRetryLayer` for tower HTTP clients |
//! | `test-util` | `ManualClock`, and `timed_by(..)` on the engine, the layer and the outbox: one time that tests move for records and messages |
//! | `reqwest` | `client::IdempotentRetryMiddleware` for `reqwest-middleware` |
//! | `inbox` | the `inbox` module: `Inbox`, a consumer that dedupes deliveries by business key |
//! | `rabbitmq` | `inbox` + `inbox::rabbitmq::RabbitMqConsumer` (lapin); with `outbox`, `outbox::RabbitMqSender` |
//! | `nats` | `inbox` + `inbox::nats::NatsConsumer` (async-nats JetStream); with `outbox`, `outbox::NatsSender` |
//! | `metrics` | counters and a claim latency histogram through the `metrics` facade |
//!
//! # Further reading
//!
//! The example above runs in memory. The README's "Use it" section, the repository's
//! `examples/basic.rs`, is a complete service on a SQLite file, and `examples/chain/orders` a
//! fuller app on any of the three databases. The [`guide`] takes it from here: every builder
//! option, the backends and their waits, jobs, the outbox and the client, running it in
//! production (purging, metrics and alerts, support cases, letting a record go) and
//! performance.

#![cfg_attr(docsrs, feature(doc_cfg))]
// The server half without a database (`server` or `outbox` alone) has nothing to keep records
// in: it only has to compile, and the storage code it carries is unused there.
#![cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
    allow(dead_code)
)]

#[cfg(feature = "server")]
mod backend;
#[cfg(any(feature = "server", feature = "client"))]
// The engine and the inbox use it without showing the type; the client and the outbox
// re-export it.
#[cfg_attr(
    not(any(feature = "client", feature = "outbox")),
    allow(unreachable_pub)
)]
mod backoff;
#[cfg(any(feature = "rabbitmq", feature = "nats"))]
mod broker;
#[cfg(feature = "client")]
pub mod client;
#[cfg(feature = "server")]
mod clock;
#[cfg(feature = "server")]
pub mod engine;
#[cfg(feature = "server")]
pub mod error;
#[cfg(feature = "server")]
pub mod fingerprint;
#[cfg(feature = "server")]
pub mod guide;
#[cfg(feature = "server")]
#[cfg(feature = "inbox")]
pub mod inbox;
#[cfg(feature = "server")]
pub mod key;
#[cfg(any(feature = "server", feature = "client"))]
mod key_syntax;
#[cfg(feature = "server")]
pub mod layer;
// The outbox's messages as data, below the outbox and the backend that stores them; shown
// through `outbox`.
#[cfg(feature = "outbox")]
mod message;
#[cfg(all(test, feature = "server"))]
mod model;
#[cfg(feature = "outbox")]
pub mod outbox;
#[cfg(feature = "server")]
mod record;
#[cfg(feature = "server")]
pub mod scope;
#[cfg(feature = "server")]
pub mod store;
#[cfg(feature = "server")]
pub mod tx;

#[cfg(feature = "server")]
pub use backend::Backend;
#[cfg(feature = "test-util")]
pub use clock::ManualClock;
#[cfg(feature = "server")]
pub use engine::{
    Classification, Engine, Execution, IDEMPOTENT_REPLAYED, Lease, Lookup, Outcome, RunError,
};
#[cfg(feature = "server")]
pub use error::{Error, Rejection};
#[cfg(feature = "server")]
pub use fingerprint::{Fingerprint, Fingerprinter, canonical_json};
#[cfg(feature = "server")]
pub use key::{IdempotencyKey, KeyError, MAX_KEY_LEN};
#[cfg(feature = "server")]
pub use layer::{IDEMPOTENCY_KEY, IdempotencyLayer, IdempotencyService};
#[cfg(feature = "server")]
pub use scope::{IdempotencyContext, Principal, Scope, ScopedKey};
#[cfg(feature = "mysql")]
pub use store::MySqlStore;
#[cfg(feature = "postgres")]
pub use store::PgStore;
#[cfg(feature = "sqlite")]
pub use store::SqliteStore;
#[cfg(feature = "server")]
pub use store::Store;
#[cfg(feature = "server")]
pub use tx::{Tx, TxError};
