//! Exactly-once effects for retried HTTP requests in [axum].
//!
//! Clients time out and retry, gateways replay, users double-click. `axum-idempotency` makes
//! each of those arrive as one business intent with the effect and the answer of exactly one
//! execution. Add an [`IdempotencyLayer`] to a router; handlers write through the [`Tx`]
//! extractor, inside the very transaction that claims the request's key, so the claim, the
//! business rows and the stored response commit or roll back together.
//!
//! ```
//! use std::time::Duration;
//! use axum::{Json, Router, body::Body, http::{Request, StatusCode}, routing::post};
//! use axum_idempotency::{IdempotencyLayer, SqliteStore, Store, Tx};
//! use sqlx::Sqlite;
//! use tower::ServiceExt;
//!
//! async fn create_order(mut tx: Tx<Sqlite>, Json(sku): Json<String>) -> (StatusCode, String) {
//!     let id: i64 = sqlx::query_scalar("INSERT INTO orders (sku) VALUES (?) RETURNING id")
//!         .bind(sku)
//!         .fetch_one(&mut *tx)
//!         .await
//!         .unwrap_or_default();
//!     (StatusCode::CREATED, format!("order {id}"))
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
//!             .ttl(Duration::from_secs(24 * 3600)),
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
//! - A key is **scoped** to the verified principal, the method and the route template.
//! - Same key, same intent: the first response again, byte for byte, with
//!   `Idempotent-Replayed: true`. Same key, different intent: 422 `idempotency_key_reused`.
//! - Same key while the first is still running: the duplicate waits (bounded), then replays;
//!   past the wait it gets 409 `idempotency_request_in_progress` with `Retry-After`.
//! - Records live 24 h by default ([`IdempotencyLayer::ttl`]); then the key is a new intent.
//!
//! Module by module: [`key`] parses the header, [`scope`] builds the scoped key,
//! [`fingerprint`] canonicalises the request, [`record`] holds states and stored responses,
//! [`store`] keeps records in SQL, [`engine`] runs claim → execute → record for HTTP and jobs
//! alike, [`layer`] adapts it to tower, [`tx`] is the transaction extractor, [`error`] the
//! rejections. Behind features: `outbox` (external side effects sent after commit with a stable
//! downstream key), `inbox` (message consumers that apply each business key once, acking
//! after the commit) and `client` (the caller's half: one key per logical call, reused on every
//! retry).
//!
//! | feature | what it adds |
//! |---|---|
//! | `sqlite` (default) | `SqliteStore` |
//! | `postgres` | `PgStore` |
//! | `mysql` | `MySqlStore` (MySQL 8, MariaDB) |
//! | `outbox` | the `outbox` module: `Outbox`, `Dispatcher`, `Sender` |
//! | `client` | the `client` module: `IdempotentRetryLayer` for tower HTTP clients |
//! | `reqwest` | `client::IdempotentRetryMiddleware` for `reqwest-middleware` |
//! | `inbox` | the `inbox` module: `Inbox`, a consumer that dedupes deliveries by business key |
//! | `rabbitmq` | `inbox` + `inbox::rabbitmq::RabbitMqConsumer` (lapin); with `outbox`, `outbox::RabbitMqSender` |
//! | `nats` | `inbox` + `inbox::nats::NatsConsumer` (async-nats JetStream); with `outbox`, `outbox::NatsSender` |

#![cfg_attr(docsrs, feature(doc_cfg))]

mod cache;
#[cfg(feature = "client")]
pub mod client;
pub mod engine;
pub mod error;
pub mod fingerprint;
#[cfg(feature = "inbox")]
pub mod inbox;
pub mod key;
pub mod layer;
#[cfg(feature = "outbox")]
pub mod outbox;
mod recent;
pub mod record;
pub mod scope;
pub mod store;
pub mod tx;

pub use engine::{Classification, Engine, Execution, IDEMPOTENT_REPLAYED, Lease, Outcome};
pub use error::{Error, Rejection};
pub use fingerprint::{Fingerprint, Fingerprinter, canonical_json};
pub use key::{IdempotencyKey, KeyError, MAX_KEY_LEN};
pub use layer::{IDEMPOTENCY_KEY, IdempotencyLayer, IdempotencyService};
pub use record::{Record, RecordState, StoredResponse};
pub use scope::{IdempotencyContext, Principal, Scope, ScopedKey};
#[cfg(feature = "mysql")]
pub use store::MySqlStore;
#[cfg(feature = "postgres")]
pub use store::PgStore;
#[cfg(feature = "sqlite")]
pub use store::SqliteStore;
pub use store::{Dialect, LeaseClaim, NewRecord, Opened, SqlStore, Store};
pub use tx::Tx;
