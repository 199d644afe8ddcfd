//! The guide: everything past the first request, one chapter per page.
//!
//! The crate docs and the README get a newcomer to a first replayed request: the README's
//! "Use it" section, the repository's `examples/basic.rs`, is a complete service to copy, and
//! `examples/chain/orders` a fuller app. These chapters are for the developer wiring the layer
//! into a real service and for the operator running it. They hold no code of the crate, only documentation; the
//! examples in them are compiled as doctests.
//!
//! A few words recur. The **principal** is the caller your authentication verified (a user id,
//! never a header the client asserts). A key's **scope** is the principal, the method and the
//! route template together: the same key in another scope is another key. To **claim** a key
//! is to insert its row, which a unique constraint lets only one request insert, inside the
//! transaction the handler then writes through; the winner runs, every other request with the
//! key reads the winner's record. The **intent** is what the request asks for (method, path,
//! query and body); **intent-neutral** fields, such as a trace id, are left out of it. A
//! **lease** is a claim with an expiry its holder renews, for work that outlives one
//! transaction.
//!
//! The chapters, in reading order:
//!
//! - [`layer`]: putting the layer on a router, every builder option and its default, serving
//!   it in production (timeouts, shutdown).
//! - [`orders`]: the README's session with the `orders` example, continued, and the
//!   example's files and settings.
//! - [`protocol`]: the protocol at a glance, what is final and what is retryable, replay, and
//!   the guarantees' limits.
//! - [`backends`]: SQLite, PostgreSQL, MySQL and MariaDB; migrations; how each one waits.
//! - [`distributed`]: CockroachDB, YugabyteDB, TiDB and Vitess, on paper: what the crate needs
//!   from an engine, and where each one stands.
//! - [`jobs`]: background jobs and manual replays on the same claim as HTTP requests.
#![cfg_attr(
    feature = "outbox",
    doc = "- [`outbox`]: calls to other systems, sent once after the commit (feature `outbox`)."
)]
#![cfg_attr(
    not(feature = "outbox"),
    doc = "- `outbox` (feature `outbox`): calls to other systems, sent once after the commit."
)]
#![cfg_attr(
    feature = "inbox",
    doc = "- [`inbox`]: message consumers that apply each business key once, and the payments → \
           broker → orders example chain (feature `inbox`)."
)]
#![cfg_attr(
    not(feature = "inbox"),
    doc = "- `inbox` (feature `inbox`): message consumers that apply each business key once, \
           and the payments → broker → orders example chain."
)]
#![cfg_attr(
    feature = "client",
    doc = "- [`client`]: the caller's half, one key per logical call (feature `client`)."
)]
#![cfg_attr(
    not(feature = "client"),
    doc = "- `client` (feature `client`): the caller's half, one key per logical call."
)]
//! - [`operations`]: purging, metrics and what to alert on, logs, support cases, letting a
//!   record go.
//! - [`performance`]: what a new key and a replay cost, and how to make replays cheaper.
//! - [`clusters`]: a MariaDB Galera cluster with an app instance per node: the settings that
//!   matter, what a lost node costs.
//! - [`failover`]: what a PostgreSQL failover (a standby promoted) means for the contract, with
//!   synchronous and with asynchronous replication.
//! - [`proven`]: what the protocol's checked model explores, under which assumptions and bounds.

/// # Putting the layer on a router
///
/// Add [`IdempotencyLayer`](crate::IdempotencyLayer) with
/// [`Router::route_layer`](axum::Router::route_layer), so the matched route template
/// (`/orders/{id}/ship`) scopes the key; under `Router::layer` the concrete path stands in for
/// it. Handlers write through the [`Tx`](crate::Tx) extractor: the claim, their rows and the
/// stored response are one transaction.
///
/// The example below builds such a router on an in-memory SQLite database, to show every part
/// in one place; it serves nothing. For a program that serves, read the README's "Use it"
/// section, the repository's `examples/basic.rs` (graceful shutdown, a header read timeout),
/// and `examples/chain/orders` (all three backends).
///
#[cfg_attr(feature = "sqlite", doc = "```")]
#[cfg_attr(not(feature = "sqlite"), doc = "```ignore")]
/// use std::borrow::Cow;
/// use std::time::Duration;
///
/// use axum::extract::FromRequestParts;
/// use axum::http::{StatusCode, header, request::Parts};
/// use axum::response::IntoResponse;
/// use axum::{Extension, Json, Router, routing::post};
/// use axum_idempotency::{IdempotencyLayer, Principal, SqliteStore, Tx, TxError};
/// use serde_json::json;
/// use sqlx::Sqlite;
///
/// /// The caller as your authentication proved it.
/// #[derive(Clone)]
/// struct AuthUser {
///     id: String,
/// }
///
/// impl<S: Send + Sync> FromRequestParts<S> for AuthUser {
///     type Rejection = StatusCode;
///
///     async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
///         // A real app verifies a token or a session here.
///         match parts.headers.get(header::AUTHORIZATION) {
///             Some(_) => Ok(AuthUser { id: "alice".into() }),
///             None => Err(StatusCode::UNAUTHORIZED),
///         }
///     }
/// }
///
/// impl Principal for AuthUser {
///     fn principal_id(&self) -> Cow<'_, str> {
///         Cow::Borrowed(&self.id)
///     }
/// }
///
/// // The layer hands over the caller it verified; extracting `AuthUser` again would take a
/// // second connection from the pool while the claim holds one.
/// async fn create_order(
///     Extension(user): Extension<AuthUser>,
///     mut tx: Tx<Sqlite>,
///     Json(order): Json<serde_json::Value>,
/// ) -> Result<impl IntoResponse, TxError> {
///     let id: i64 = sqlx::query_scalar("INSERT INTO orders (user_id, sku) VALUES (?, ?) RETURNING id")
///         .bind(&user.id)
///         .bind(order["sku"].as_str())
///         .fetch_one(&mut *tx) // the claim's transaction
///         .await?; // a conflict abort is run again, any other error is a retryable 500
///     Ok((
///         StatusCode::CREATED,
///         [(header::LOCATION, format!("/orders/{id}"))],
///         Json(json!({ "id": id, "status": "created" })),
///     ))
/// }
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?;
/// let store = SqliteStore::new(pool);
/// store.migrate().await?; // the crate's own tables
/// store.spawn_purger(Duration::from_secs(60)); // deletes expired records in batches
///
/// let app: Router = Router::new()
///     .route("/orders", post(create_order))
///     .route_layer(
///         IdempotencyLayer::new(store)
///             .principal::<AuthUser>()
///             .retention(Duration::from_secs(24 * 3600))
///             .wait_for_in_flight(Duration::from_secs(5))
///             .ignore_json_fields(["/request_time", "/trace_id"]),
///     );
/// # let _ = app; Ok(()) }
/// ```
///
/// The principal, the caller a key is scoped to, is the *verified* caller: an extractor that
/// authenticates
/// ([`principal`](crate::IdempotencyLayer::principal),
/// [`principal_with_state`](crate::IdempotencyLayer::principal_with_state)) or an extension
/// your authentication middleware inserted
/// ([`principal_extension`](crate::IdempotencyLayer::principal_extension)). Never a header the
/// client asserts: that would let one caller name another's scope and read their replays.
///
/// # Builder options
///
/// | method | default | what it does |
/// |---|---|---|
/// | `.principal::<P>()` / `.principal_with_state::<P, S>(state)` | none | take the principal from extractor `P` (your auth); a rejection → 401 |
/// | `.principal_extension::<P>()` | none | take the principal from a request extension set by auth middleware |
/// | `.allow_anonymous()` | off | requests without a principal share the anonymous scope (only where that is safe) |
/// | `.header_name(name)` | `Idempotency-Key` | the header the key is read from |
/// | `.keyed_methods([..])` | `POST`, `PATCH` | which methods take a key |
/// | `.allow_missing_key()` | off (key required) | keyed methods without a key run unprotected instead of 400 |
/// | `.retention(d)` | 24 h | how long a record counts; then its key is a new intent |
/// | `.wait_for_in_flight(d)` | 5 s | how long a duplicate waits for its original before 409 |
/// | `.deadline(d)` / `.without_deadline()` | 10 s | the longest a keyed request takes, from the layer receiving its head: a body not received by then is `408 idempotency_body_timeout` (the connection is closed), an answer not ready by then `503 idempotency_timeout` (keep it above the in-flight wait) |
/// | `.max_concurrent_claims(n)` | unbounded | at most `n` keyed requests hold a claim (a pooled connection) at once; set it below the pool's size |
/// | `.ignore_json_fields([..])` | none | JSON Pointers left out of the fingerprint (`/request_time`, `/trace_id`) |
/// | `.include_headers([..])` | none | request headers that join the fingerprint |
/// | `.max_request_body(n)` | 1 MiB | larger bodies → 413 before any claim |
/// | `.max_response_body(n)` | 1 MiB | larger responses are rolled back (500) rather than stored half |
/// | `.classify(f)` | 2xx/3xx completed, 408/429/5xx retryable, other 4xx final | what is stored, replayed or rolled back |
/// | `.replay_header(name)` | none | also store and replay `Set-Cookie` or `Date` |
/// | `.cache_replays(bytes)` | off | keep final records in memory so their replays cost no database read (see [`performance`]) |
///
/// Each method's own documentation on [`IdempotencyLayer`](crate::IdempotencyLayer) has the
/// details.
///
/// # What a handler under the layer must not do
///
/// A keyed request's claim holds one pooled connection, inside a transaction, from before the
/// handler runs until its answer is recorded. The handler does its database work through `Tx`
/// and must **not take a second connection from the same pool**: not directly, not through an
/// extractor that queries the database (an authentication extractor is the usual one). Under a
/// burst every connection ends up holding a claim whose handler waits for another, and nothing
/// moves until the pool's acquire timeout. Take the caller as `Extension<P>` (the layer inserts
/// what `.principal::<P>()` extracted, so `P` must be `Clone`) and the scope as
/// [`IdempotencyContext`](crate::IdempotencyContext). `.max_concurrent_claims(n)` with `n` below
/// the pool's size keeps connections free for authentication, reads and requests without a key.
///
/// # Timeouts, outages and shutdown
///
/// - Every keyed request is answered within the layer's `.deadline(..)` (default 10 s). When the
///   database is silent, the client gets `503 idempotency_timeout` with `Retry-After` and
///   retries with the same key. The attempt is not abandoned mid-transaction: it finishes in a
///   task of its own, and the retry replays it if it committed, or gets `409` while it still
///   runs. Nothing commits that the retry would execute again. Requests of the methods that
///   take no key get the same bound; a keyed method sent without a key under
///   `.allow_missing_key()` does not (its retry after a late commit would run it twice).
/// - The deadline counts the time the client takes to send its body: a client that trickles
///   its body gets `408 idempotency_body_timeout` by the deadline and its connection is
///   closed, so a slow client holds neither a connection nor a claim for long. A body whose
///   declared `Content-Length` is over `.max_request_body(..)` is refused with `413` at once,
///   before any of it is read. The head of a request comes before the layer sees anything, so
///   bound it in the server (a header read timeout, below).
/// - Set the pool's acquire timeout below the deadline (the `orders` example uses 3 s with
///   `PoolOptions::acquire_timeout`), so a pool that cannot reach its database fails fast.
/// - An authentication extractor that fails for a reason other than refusing the caller (its
///   rejection is a 5xx, 408 or 429) gets `503 idempotency_principal_unavailable` with
///   `Retry-After`, never a final `401`.
/// - Stop on SIGTERM (what Kubernetes and systemd send) as on Ctrl-C, so the requests in flight
///   are answered before the process exits. Register the handlers before serving: until then
///   SIGTERM's default action ends the process.
/// - Set a read timeout for request heads (below), so a client that sends its headers slowly,
///   or never finishes them, cannot hold a connection. The layer's deadline starts once the
///   head has arrived: keyed requests are then answered within it, slow body or not.
///
/// ```no_run
/// # async fn run(listener: tokio::net::TcpListener, app: axum::Router) -> std::io::Result<()> {
/// use tokio::signal::unix::{SignalKind, signal};
///
/// let mut terminate = signal(SignalKind::terminate())?;
/// let mut interrupt = signal(SignalKind::interrupt())?;
/// let shutdown = async move {
///     tokio::select! {
///         _ = terminate.recv() => {}
///         _ = interrupt.recv() => {}
///     }
/// };
/// axum::serve(listener, app).with_graceful_shutdown(shutdown).await
/// # }
/// ```
///
/// **The header read timeout.** hyper has one (`header_read_timeout`, 30 s by default), but it
/// only acts when the connection builder has a timer, and `axum::serve` sets none: under it, a
/// request head may take for ever. Serve with the `axum-server` crate instead
/// (`axum-server = "0.9"`; the signal below needs tokio's `signal` feature), which installs a
/// timer itself and drains connections on `Handle::graceful_shutdown`, as the README's "Use it"
/// program and the examples do. HTTP/1 only: there the timeout also closes a connection that
/// sends nothing, where in auto mode the wait for a first byte has none. (With hyper's own
/// builders, give them `.timer(hyper_util::rt::TokioTimer::new())` first.)
///
/// ```no_run
/// # async fn run(listener: std::net::TcpListener, app: axum::Router) -> std::io::Result<()> {
/// use std::time::Duration;
///
/// use tokio::signal::unix::{SignalKind, signal};
///
/// let mut terminate = signal(SignalKind::terminate())?;
/// let handle = axum_server::Handle::new();
/// let stop = handle.clone();
/// tokio::spawn(async move {
///     terminate.recv().await;
///     stop.graceful_shutdown(None); // stops accepting, answers the requests in flight
/// });
/// let mut server = axum_server::from_tcp(listener)?.http1_only().handle(handle);
/// server
///     .http_builder()
///     .http1()
///     .header_read_timeout(Duration::from_secs(5));
/// server.serve(app.into_make_service()).await
/// # }
/// ```
pub mod layer {}

/// # The `orders` example, continued
///
/// The README's "Try it" section starts the repository's `orders` example (`cargo run --example
/// orders`, on a fresh SQLite file `orders.db`) and runs a session against it: Alice orders two
/// widgets, her retry is replayed, the same key with another quantity is refused with `422`, Bob
/// buys the last gadget and Alice's order for one is refused with `409` `out_of_stock`. The
/// session goes on here, in the same terminal; `tests/readme.rs` runs both parts, in this order,
/// against the example, so neither can drift.
///
/// Had her client retried anyway, the refusal is replayed, even if stock came back meanwhile:
///
/// ```sh
/// curl -si -X POST localhost:3000/orders -H 'authorization: Bearer alice-token' \
///   -H 'idempotency-key: 6d1c8a52-2f7e-4a8e-9b1e-0c3f1d6f2a91' \
///   -H 'content-type: application/json' \
///   -d '{"sku":"gadget","quantity":1,"amount":30,"currency":"EUR"}'
/// ```
///
/// ```text
/// HTTP/1.1 409 Conflict
/// content-type: application/problem+json
/// idempotent-replayed: true
///
/// {"code":"out_of_stock","detail":"not enough stock left for this order","status":409,"title":"Conflict","type":"about:blank"}
/// ```
///
/// Bob's order ships. A retry of his original request still answers as it did at creation: the
/// replay is the answer he was given, not the order's state now:
///
/// ```sh
/// curl -si -X POST localhost:3000/orders/2/ship -H 'authorization: Bearer bob-token' \
///   -H 'idempotency-key: 3e8f2d4a-1b6c-4f0e-8a7d-9c2b5e1f4a30'
/// ```
///
/// ```text
/// HTTP/1.1 200 OK
/// content-type: application/json
///
/// {"id":2,"status":"shipped","sku":"gadget","quantity":1,"amount":30.0,"currency":"EUR","payments":[],"paid_total":0.0}
/// ```
///
/// ```sh
/// curl -si -X POST localhost:3000/orders -H 'authorization: Bearer bob-token' \
///   -H 'idempotency-key: 0c5b1f9e-7a44-4b8e-93d2-5e1a6f0b2c77' \
///   -H 'content-type: application/json' \
///   -d '{"sku":"gadget","quantity":1,"amount":30,"currency":"EUR"}'
/// ```
///
/// ```text
/// HTTP/1.1 201 Created
/// content-type: application/json
/// location: /orders/2
/// idempotent-replayed: true
///
/// {"id":2,"status":"created","sku":"gadget","quantity":1,"amount":30.0,"currency":"EUR","payments":[],"paid_total":0.0}
/// ```
///
/// A request that changes something must carry a key:
///
/// ```sh
/// curl -si -X POST localhost:3000/orders -H 'authorization: Bearer alice-token' \
///   -H 'content-type: application/json' \
///   -d '{"sku":"widget","quantity":1,"amount":6.25,"currency":"EUR"}'
/// ```
///
/// ```text
/// HTTP/1.1 400 Bad Request
/// content-type: application/problem+json
///
/// {"type":"https://docs.rs/axum-idempotency/0.1.0/axum_idempotency/error/enum.Rejection.html#variant.KeyMissing","title":"Idempotency key missing","status":400,"detail":"this request requires an Idempotency-Key header","code":"idempotency_key_missing"}
/// ```
///
/// The example's whole code is in three files under `examples/chain/orders/`, about 840 lines:
/// `main.rs` the HTTP API, served through axum-server (a request head must arrive within 5 s;
/// SIGTERM or Ctrl-C answers the requests in flight, then exits 0), `db.rs` its tables and how
/// it runs the same SQL on the three databases, and `consumer.rs` a consumer of payment events
/// (see [the inbox chapter](https://docs.rs/axum-idempotency/latest/axum_idempotency/guide/inbox/index.html)). It reads
/// `DATABASE_URL` (`sqlite://orders.db` by default; a `postgres://` URL with
/// `--features postgres`, a `mysql://` URL with `--features mysql`), `BIND` (default
/// `127.0.0.1:3000`) and `IDEMPOTENCY_TTL_SECS` (how long keys live, default 24 h). On
/// PostgreSQL, for example:
///
/// ```sh
/// DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres cargo run --example orders --features postgres
/// ```
pub mod orders {}

/// # The protocol at a glance
///
/// | question | answer |
/// |---|---|
/// | Who makes the key? | The **client**, once per logical operation, *before* the first attempt, and sends it unchanged on every retry. Use a long random value: a UUIDv4, or 128 or more random bits as base64url. The crate's `client` feature does this for Rust clients. |
/// | Which header? | `Idempotency-Key`, bare (`k1`) or as a Structured-Field string (`"k1"`): the same key. 1–255 visible ASCII characters (0x21–0x7E), one value. `POST` and `PATCH` need one by default. |
/// | What is the key's scope? | The **verified caller** (from your authentication, never a header the client asserts), the method and the **route template** (`/orders/{id}/ship`). Bob reusing Alice's key gets his own execution; the same key on two routes names two intents. No verified caller (your authentication refused it): `401`; your authentication *failed* (its database is down): a retryable `503`. |
/// | Same key, same intent? | The first response again, byte for byte: status, body and stored headers (`Location` included), plus `Idempotent-Replayed: true`, even after the resource changed. `Set-Cookie`, `Date` and hop-by-hop headers are not replayed. |
/// | Same key, different intent? | `422` `idempotency_key_reused`; nothing is executed, neither with the old parameters nor the new. The intent is the method, the path, the query and the canonical body, minus fields the server declared intent-neutral. |
/// | How do I query a request still in flight? | Send it again with the same key and body. A retry waits (5 s by default) for the first to finish and replays its answer; if the first failed retryably, the retry executes. Past the wait: `409` `idempotency_request_in_progress` with `Retry-After`: try again later, same key. |
/// | What is final, what is retryable? | 2xx/3xx and 4xx answers (invalid input, forbidden, out of stock) are final: stored and replayed, stop retrying. 5xx, 408, 429 and the in-progress `409` are retryable with the same key: nothing of the failed attempt was kept. |
/// | How long do keys live? | 24 hours by default (the server's `.retention(..)`). After that the key is a new intent. Expired records are deleted by the store's purge. |
///
/// Every 5xx is retryable with the same key: nothing of the attempt was kept, or the retry replays
/// it. Every `code` the crate sets starts with `idempotency_`; give your own errors codes without
/// that prefix (the `orders` example answers `invalid_order`, `malformed_json`, `invalid_id`,
/// `out_of_stock`, all problem+json), so a client never has to guess from the status alone. The full list is in the
/// [`error`](crate::error) module.
///
/// # What is stored, what is replayed, what is rolled back
///
/// The handler's response is buffered and classified by its status
/// ([`Classification::of_status`](crate::Classification::of_status), replaceable with
/// `.classify(..)`):
///
/// - **completed** (2xx, 3xx): the response is stored and committed with the handler's writes,
///   and replayed to every retry with `Idempotent-Replayed: true`;
/// - **failed for good** (most 4xx: 400, 401, 403, 404, 409 from the handler such as
///   `out_of_stock`, 410, 422): the handler's writes are rolled back, the answer is stored and
///   replayed; the client should stop;
/// - **retryable** (5xx, 408, 429, a panic, a response too large to store): everything is
///   rolled back and no record remains, so a retry with the same key executes afresh.
///
/// The intent a key is bound to is the method, the concrete path, the query (parameters in any
/// order) and the canonical body: JSON key order, whitespace and number spelling do not matter
/// (`12.5 == 12.50 == 1.25e1`, but `12.500000001` differs), and fields declared intent-neutral
/// with `.ignore_json_fields(..)` are left out. Another intent under the same key is refused
/// with 422 and never executed. The [`fingerprint`](crate::fingerprint) module has the exact
/// rules.
///
/// A replay reproduces the status, the body bytes and the stored headers (`Location` and
/// multi-valued headers intact), even after the resource changed: an order shipped later still
/// replays its creation-time `201`. `Set-Cookie`, `Date`, `Content-Length` and hop-by-hop
/// headers are not replayed unless opted in with `.replay_header(..)`.
///
/// Every rejection is `application/problem+json` with a distinct `type` and a `code`: see
/// [`error`](crate::error) for the table.
///
/// # Guarantees and limits
///
/// - **Exactly once** for everything written through [`Tx`](crate::Tx): the claim, the
///   business rows and the response record are one transaction. Duplicates (sequential,
///   concurrent, across app instances sharing a database) never run the handler twice, save
///   for one narrow race on PostgreSQL at `REPEATABLE READ` or `SERIALIZABLE` in which a
///   duplicate's run is rolled back (see "Isolation levels" under Backends).
/// - **Not** exactly once by itself: calls to other systems made from the handler (payment
///   channels, SMS, webhooks). Write them to the outbox (feature `outbox`) so they are sent
///   after the commit with a stable downstream key.
/// - The handler's work is never cancelled halfway: if the client hangs up first, what is left
///   of it moves to a task of its own and completes there, so no pooled connection is left
///   inside an open transaction. Its outcome is replayed to the retry.
/// - A transaction the database aborts on a conflict with a concurrent one (a serialization
///   failure at `SERIALIZABLE`, a deadlock, a Galera certification conflict) is run again by
///   the layer with the buffered request, so the client never sees the abort: handlers return
///   their statements' errors as [`TxError`](crate::TxError) (see
///   [the `tx` module](crate::tx#conflicts-are-run-again)).
/// - Responses are buffered (bounded) to be stored; streaming responses (server-sent events)
///   do not belong under the layer.
/// - Time is the application's clock (records and outbox messages keep milliseconds since the
///   epoch): keep hosts in sync. Tests replace it with one `ManualClock` (feature `test-util`),
///   given to `timed_by(..)` on the layer or the engine and on the outbox: moving it ages
///   records and messages together, with no sleeping through retention, retries or budgets.
pub mod protocol {}

/// # Backends
///
/// | feature | store | notes |
/// |---|---|---|
/// | `sqlite` | `SqliteStore` | embedded; claims begin `IMMEDIATE` with `busy_timeout` set from the wait, and the write lock is the key's lock: the claim reads whether a live record holds the key (and deletes an expired one, if there is one), and the record is written once, in one prepared statement with `COMMIT`; use WAL. A wait that runs out cannot tell the original from another writer: 409 either way. |
/// | `postgres` | `PgStore` | many app instances on one database; a claim is sent with `BEGIN` as a call of the schema's procedure `axum_idempotency_lock_v1`, which takes the key's advisory lock and writes nothing (it deletes an expired record under the key, if there is one); a duplicate of an in-flight claim waits on that lock, bounded by `lock_timeout`, set for the wait only and restored for the handler in the same message; the record is written once, with `COMMIT` |
/// | `mysql` | `MySqlStore` | MySQL 8 and MariaDB; see below |
///
/// **Isolation levels.** The layer works at whatever isolation level the server or the pool
/// makes the default; duplicates of a request in flight wait for it and replay its answer at
/// each. At `READ COMMITTED` (PostgreSQL's default) a duplicate that waited for the original's
/// lock goes on in its transaction and reads the original's record there. At `REPEATABLE READ`
/// or `SERIALIZABLE` its snapshot predates the original's commit, so the PostgreSQL claim ends
/// that transaction with a serialization failure (`40001`) rather than let it decide on what
/// it cannot see; the engine then reads the record outside any transaction, and replays it, or,
/// when the original left none (it failed retryably), claims again, round after round while
/// `wait_for_in_flight` lasts, before answering `409`. One narrow race remains at those levels:
/// a duplicate that took its snapshot just before the original committed, and found the key's
/// lock free just after, runs the handler in a transaction that cannot commit (the record the
/// original left fails it on the primary key). Nothing it wrote through [`Tx`](crate::Tx)
/// stands, outbox messages included, and the attempt is run again and replays; only a call the
/// handler made to another system directly was made twice. MySQL and MariaDB (default
/// `REPEATABLE READ`) wait on the record's row, whose locking reads see the latest commit at
/// every level; tested at `SERIALIZABLE` as well. SQLite transactions are serializable, one
/// writer at a time.
///
/// Your own sqlx must be the same major version as this crate's (0.9), since the handler's
/// transaction is an sqlx transaction, and axum must be 0.8.
///
/// The store's `migrate()` creates and upgrades the crate's tables (`idempotency_records`,
/// `idempotency_inbox`, `idempotency_schema_versions`) and, on PostgreSQL and MySQL, the
/// procedures its claims call; a second call is a no-op and concurrent callers serialise.
///
/// **Schema versions.** The schema is numbered, one script per version and backend, under
/// `migrations/<backend>/` in the package (`0001_store.sql` is version 1, the schema this
/// release needs; the outbox's own, numbered apart, are under `migrations/<backend>/outbox/`).
/// `migrate()` records each version it applies in `idempotency_schema_versions` (`version`,
/// `applied_at` in milliseconds since the Unix epoch) and applies only the versions newer than
/// the newest recorded, in order. A released version is never edited: a release that changes
/// the schema adds the next version's script, which upgrades the previous version's tables in
/// place, and a procedure whose behaviour changes gets a new name (`…_v2` beside `…_v1`), so
/// instances still running the older release keep calling theirs during a rolling upgrade.
/// Teams that apply migrations with their own tool apply the scripts in order and record each
/// version in `idempotency_schema_versions` the same way. A store checks that table once, on
/// first use: against a schema that was never migrated, or is older than the crate expects,
/// every keyed request fails with `Error::SchemaOutdated` (logged at `ERROR` with the versions
/// found and expected, answered as a retryable `500`) until `migrate()` has run.
///
/// # MySQL and MariaDB
///
/// Enable the `mysql` feature and hand the store the pool your handlers use:
///
/// ```no_run
/// # #[cfg(feature = "mysql")]
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use axum_idempotency::{IdempotencyLayer, MySqlStore};
///
/// let pool = sqlx::MySqlPool::connect("mysql://app@db.internal/shop").await?;
/// let store = MySqlStore::new(pool);
/// store.migrate().await?; // once at start-up; safe from several instances at once
/// let layer = IdempotencyLayer::new(store).allow_anonymous();
/// # let _ = layer; Ok(()) }
/// ```
///
/// Records live in the table `idempotency_records` (InnoDB, `utf8mb4_bin`) of the connection's
/// database; applied schema versions in `idempotency_schema_versions`. MySQL commits DDL
/// implicitly, so a transaction cannot serialise two instances migrating at once: `migrate`
/// holds the named lock `axum_idempotency.migrate:<md5 of the database name>` (`GET_LOCK`) on
/// one session for the whole migration, releases it after, and fails after waiting an hour
/// for it; the outbox's `migrate` does the same with `axum_idempotency.outbox:<md5 of the
/// database name>`, so apps on other databases of the server never wait for each other. The
/// scripts are safe to run twice (`IF NOT EXISTS`, `DROP PROCEDURE IF EXISTS`).
///
/// **The claim procedure.** The schema includes the stored procedure
/// `axum_idempotency_claim_v1`. A new key's claim calls it in place of `BEGIN`: it begins the
/// transaction and claims the key in the one exchange, so the layer adds no round trip before
/// the handler runs. Creating it needs the `CREATE ROUTINE` privilege, calling it `EXECUTE`
/// (both come with `ALL` on the database). The claim's values are written into the `CALL` as
/// hexadecimal literals (`X'…'`), so no principal, route or body can change the statement.
///
/// **The in-flight wait.** A duplicate of a request still in flight waits on the original's
/// row lock, bounded by `innodb_lock_wait_timeout`, which takes whole seconds only: the
/// layer's `wait_for_in_flight` is rounded **up** to the next second, at least 1 s (200 ms
/// waits 1 s, 1.5 s waits 2 s). A duplicate never gives up sooner than configured, and may
/// wait up to a second longer. The setting is made for the claim only: the session's own
/// value is saved before the claim and restored right after it, whatever its outcome.
///
/// **Errors.** InnoDB's lock wait timeout (1205) answers 409 `idempotency_request_in_progress`
/// with `Retry-After`. A deadlock (1213) or, on MariaDB with `innodb_snapshot_isolation`,
/// "record has changed since last read" (1020) means InnoDB rolled the claim back; the engine
/// reads the key's record afresh and replays it if one was committed meanwhile, else claims
/// again (at least three rounds, more while `wait_for_in_flight` lasts), so a duplicate InnoDB
/// picked as a victim still waits for the new winner and replays it. PostgreSQL's deadlocks and
/// serialization failures are treated the same way. The business never runs twice.
///
/// **Sizes.** `headers` and `body` are `LONGBLOB`; the real ceiling is the server's
/// `max_allowed_packet` (16 MiB by default on MariaDB, 64 MiB on MySQL 8), which must stay
/// above the largest response you store.
///
/// **Buffer pool.** The records table is clustered on the key's digest, so claims insert at
/// random places in it and the whole table is hot. Give InnoDB a buffer pool that holds it
/// (`innodb_buffer_pool_size`; records of small responses take a few hundred bytes each):
/// measured at a million records, a 128 MiB pool (MariaDB's package default) served new keys
/// at 0.78 of the empty table's rate and purged about 700 expired records a second under load,
/// a 2 GiB pool at 0.93 and about 2 400 a second.
///
/// **MySQL 8 and MariaDB.** The store uses only SQL both accept, and is tested on MariaDB
/// 10.11:
///
/// - The claim is `INSERT … ON DUPLICATE KEY UPDATE` with `VALUES(col)`, which MySQL 8.0.20+
///   flags as deprecated (warning 1287) in favour of a row alias MariaDB does not have. It
///   still works on MySQL 8.0 and 8.4.
/// - The claim tells "claimed" from "key held" through `LAST_INSERT_ID`, because sqlx connects
///   with `CLIENT_FOUND_ROWS`.
/// - Text columns use `utf8mb4_bin`, so comparisons are the same whatever the server's default
///   collation.
/// - MySQL 9 has not been tried.
pub mod backends {}

/// # Distributed SQL, on paper
///
/// Nothing in this chapter has been run. CockroachDB, YugabyteDB, TiDB and Vitess could not be
/// installed where the crate is built and tested, and it ships no store for them. What follows is
/// the crate's own SQL read against what each project's documentation and issue tracker say, with
/// the version each fact was stated for. Check your version, and test, before you rely on any of
/// it.
///
/// ## What the crate needs from an engine
///
/// Two things are essential:
///
/// - **A unique key enforced inside the handler's transaction.** A claim inserts the key's row
///   under the primary key of `idempotency_records`, in the transaction the handler writes through
///   and the response is stored by. That primary key, not a lock, decides which request owns an
///   idempotency key, and the claim, the business rows and the record commit together or not at
///   all. An engine, or a sharding layer, that enforces the key only within a shard, or can commit
///   part of a transaction without the rest, breaks exactly this.
/// - **Conflicts reported as aborts the crate knows.** The layer runs a transaction again (up to
///   twelve attempts, jittered pauses) when the database aborted it with SQLSTATE `40001` or
///   `40P01` over the PostgreSQL protocol, or error `1213` or `1020` over MySQL's: in the claim, in
///   a handler statement returned as [`TxError`](crate::TxError), or at `COMMIT`. Any other code
///   for the same event is answered `500 idempotency_internal_error`: safe to retry with the same
///   key, but the client sees it.
///
/// One thing is an optimisation. On PostgreSQL each claim first takes the key's transaction-scoped
/// advisory lock (`pg_try_advisory_xact_lock`, else `pg_advisory_xact_lock`), so a duplicate of an
/// in-flight request queues behind the original for at most `wait_for_in_flight`. Advisory locks
/// belong to the whole database, so the lock's number mixes in the records table's oid: the same
/// key in two schemas (two apps or tenants on one database) takes two locks. `migrate()` takes
/// an advisory lock (PostgreSQL) or `GET_LOCK` (MySQL) so that two instances migrate one after the
/// other. Without them duplicates still resolve on the key, by waiting on its row or by being
/// aborted and run again. Where an engine lacks the functions, the calls fail, so a port leaves
/// them out.
///
/// The rest is how the stores happen to be written, and a port would replace it:
///
/// - PostgreSQL: the claim is the PL/pgSQL procedure `axum_idempotency_lock_v1` (`PERFORM`,
///   `set_config` on `lock_timeout`, `current_setting('transaction_isolation')`, `FOUND`, and
///   `RAISE unique_violation` naming the primary key's constraint), the record
///   `axum_idempotency_record_v1` (a plain `INSERT`). The
///   claim is sent as `CALL …; BEGIN` in one simple query, so `BEGIN` turns the call's implicit
///   transaction into the handler's; inside an open transaction it runs under a `SAVEPOINT`. A
///   wait that runs out is `55P03`. An engine whose advisory locks are missing or not shared by
///   every node must keep a row as the key's lock instead, as the MySQL store does.
/// - MySQL: the claim is the stored procedure `axum_idempotency_claim_v1`, which begins the
///   transaction itself, sets `innodb_lock_wait_timeout` for the claim, runs a plain `INSERT`
///   with a `CONTINUE HANDLER` for the duplicate key (then a read, and an `UPDATE` of an expired
///   row checked with `ROW_COUNT()`), and on a taken key rolls back and `SIGNAL`s. `migrate()`
///   creates it with `CREATE PROCEDURE`.
/// - The outbox and inbox pick rows with `FOR UPDATE SKIP LOCKED`, which was not checked against
///   these engines.
///
/// ## Where each engine stands
///
/// **CockroachDB** speaks the PostgreSQL protocol and runs `SERIALIZABLE` unless a transaction asks
/// for `READ COMMITTED` ([isolation][crdb-rc]). Contention reaches the client as `40001` "restart
/// transaction" errors ([retry errors][crdb-retry]), which the layer runs again; a commit whose
/// outcome the cluster cannot tell fails with `40003` ([ambiguous][crdb-40003]), answered 500, and
/// the retry then replays or runs afresh. Statements sent in one simple query share an implicit
/// transaction that `BEGIN` upgrades ([batches][crdb-batch]), the default since v22.2
/// ([release note][crdb-batch-222]), as the claim expects. PL/pgSQL arrived in v23.2
/// ([limitations][crdb-limits]), but `PERFORM` and `FOUND`, both in the claim function, were still
/// unimplemented when read ([statements][crdb-perform], [`FOUND`][crdb-found]), so the function
/// would not be created as written. The advisory-lock functions were for years missing or stubs
/// that lock nothing ([stubs][crdb-stubs]); transaction-scoped ones were merged in 2026
/// ([change][crdb-xact]) and are tracked on the 26.3 release branch, where a lock taken under a
/// savepoint outlives `ROLLBACK TO SAVEPOINT` ([report][crdb-savepoint]): a duplicate would wait a
/// little longer, no worse. **Works with changes**: the claim function ported, and the lock calls
/// left out before 26.3.
///
/// **YugabyteDB** (YSQL) reuses PostgreSQL's query layer, PL/pgSQL ([PL/pgSQL][yb-plpgsql]) and
/// savepoints ([transactions][yb-txn]) included. Its effective default isolation is Snapshot
/// (`REPEATABLE READ`); `READ COMMITTED` takes a flag, on by default only for new universes of
/// v2025.2 or later deployed with its own tools ([isolation][yb-iso]). Conflicts abort with
/// `40001`, deadlocks with `40P01` ([errors][yb-errors]). Advisory locks, transaction-scoped ones
/// included, exist from v2.25.1 behind `ysql_yb_enable_advisory_locks` ([locks][yb-locks]), which
/// the current reference lists as on by default ([flag][yb-flag]); third-party notes disagree on
/// the release that turned it on, and where it is off the calls fail, and every claim with them.
/// `lock_timeout`, which bounds a duplicate's wait, applies to advisory locks from v2.25.2
/// ([change][yb-lock-timeout]); row-lock waits ignore it and honour only `statement_timeout`
/// ([report][yb-row-timeout]). **Should work as it is** on a release with advisory locks on, and
/// v2.25.2 or later for a bounded wait.
///
/// **TiDB** speaks the MySQL protocol; its isolation is Snapshot Isolation, reported as
/// `REPEATABLE READ` ([isolation][tidb-iso]). It has no stored procedures in any version
/// ([compatibility][tidb-compat]), so `migrate()` fails at `CREATE PROCEDURE` and no claim can run.
/// In pessimistic mode, the default since v3.0.8, a deadlock is `1213` and a lock wait that runs
/// out is `1205` under `innodb_lock_wait_timeout` ([pessimistic][tidb-pess]), the codes the MySQL
/// store handles; optimistic transactions report write conflicts at `COMMIT` under TiDB's own
/// codes such as `9007` ([errors][tidb-errors]), which the layer answers 500. `GET_LOCK` holds
/// cluster-wide, with timeouts from 1 s to 1 h ([locks][tidb-locks]); savepoints exist from v6.2
/// ([savepoints][tidb-savepoint]). **Does not work today**; it would take a claim written as plain
/// statements after `BEGIN`, run in pessimistic mode.
///
/// **Vitess** shards MySQL, and a unique key is enforced within each shard. A single-shard
/// transaction is InnoDB's (`REPEATABLE READ`), a multi-shard one `READ COMMITTED`; `CALL` works
/// only on an unsharded keyspace or a targeted shard, and the procedure may not change the
/// transaction's state; `CREATE PROCEDURE` must go to MySQL directly
/// ([compatibility][vitess-compat]). The claim procedure begins and rolls back transactions, so it
/// cannot run there. The default transaction mode, `MULTI`, commits across shards best-effort,
/// without atomicity; `TWOPC` makes the commit atomic but not isolated, and needs semi-sync
/// replication ([transactions][vitess-2pc]). `GET_LOCK` goes to one shard on a reserved connection
/// ([locks][vitess-locks]). No source found says whether InnoDB's `1213` reaches the client
/// unchanged. **Does not work today**; a port could, if the records and every request's business
/// rows live in one unsharded keyspace, or under `TWOPC`.
///
/// | engine | default isolation | conflict aborts | advisory / named locks | the shipped claim | standing |
/// |---|---|---|---|---|---|
/// | CockroachDB | `SERIALIZABLE` | `40001`, run again; `40003` answered 500 | transaction-scoped on the 26.3 branch, stubs before | no: `PERFORM`, `FOUND` | works with a ported claim function |
/// | YugabyteDB (YSQL) | Snapshot | `40001`, `40P01`, run again | from v2.25.1, behind a flag | yes | should work with advisory locks on |
/// | TiDB | `REPEATABLE READ` (snapshot), pessimistic | `1213`, `1205` handled; optimistic codes not | `GET_LOCK`, 1 s to 1 h | no: no procedures | needs a claim without a procedure |
/// | Vitess | `REPEATABLE READ` per shard | InnoDB's; passing through unconfirmed | `GET_LOCK`, one shard | no: `CALL` may not begin or end transactions | needs a port, and one shard or `TWOPC` |
///
/// [crdb-rc]: https://www.cockroachlabs.com/docs/stable/read-committed
/// [crdb-retry]: https://www.cockroachlabs.com/docs/stable/transaction-retry-error-reference
/// [crdb-40003]: https://github.com/cockroachdb/cockroach/commit/4550dac6c4afced94e484d9da6ba03cfbab9873c
/// [crdb-batch]: https://github.com/cockroachdb/cockroach/pull/76834
/// [crdb-batch-222]: https://github.com/cockroachdb/docs/pull/15836
/// [crdb-limits]: https://www.cockroachlabs.com/docs/v23.2/known-limitations
/// [crdb-perform]: https://github.com/cockroachdb/cockroach/issues/117744
/// [crdb-found]: https://github.com/cockroachdb/cockroach/issues/122306
/// [crdb-stubs]: https://github.com/cockroachdb/cockroach/issues/13546
/// [crdb-xact]: https://github.com/cockroachdb/cockroach/pull/168353
/// [crdb-savepoint]: https://github.com/cockroachdb/cockroach/issues/173479
/// [yb-plpgsql]: https://docs.yugabyte.com/stable/api/ysql/user-defined-subprograms-and-anon-blocks/language-plpgsql-subprograms/
/// [yb-txn]: https://docs.yugabyte.com/stable/develop/learn/transactions/acid-transactions-ysql/
/// [yb-iso]: https://docs.yugabyte.com/stable/explore/transactions/isolation-levels/
/// [yb-errors]: https://docs.yugabyte.com/stable/develop/learn/transactions/transactions-errorcodes-ysql/
/// [yb-locks]: https://docs.yugabyte.com/stable/explore/transactions/explicit-locking/
/// [yb-flag]: https://docs.yugabyte.com/stable/reference/configuration/yb-master/
/// [yb-lock-timeout]: https://github.com/yugabyte/yugabyte-db/releases/tag/2.25.2.0-b321
/// [yb-row-timeout]: https://github.com/yugabyte/yugabyte-db/issues/29549
/// [tidb-iso]: https://docs.pingcap.com/tidb/stable/transaction-isolation-levels
/// [tidb-compat]: https://docs.pingcap.com/tidb/stable/mysql-compatibility
/// [tidb-pess]: https://docs.pingcap.com/tidb/stable/pessimistic-transaction
/// [tidb-errors]: https://docs.pingcap.com/tidb/stable/error-codes
/// [tidb-locks]: https://docs.pingcap.com/tidb/stable/locking-functions
/// [tidb-savepoint]: https://docs.pingcap.com/tidb/stable/sql-statement-savepoint
/// [vitess-compat]: https://vitess.io/docs/22.0/reference/compatibility/mysql-compatibility/
/// [vitess-2pc]: https://vitess.io/docs/22.0/reference/features/distributed-transaction/
/// [vitess-locks]: https://github.com/vitessio/vitess/issues/6367
pub mod distributed {}

/// # Jobs and manual replays use the same path
///
/// Background jobs, reconciliation and admin replays go through the same claim as HTTP
/// requests, never a side door into the tables.
/// [`IdempotencyLayer::engine`](crate::IdempotencyLayer::engine) (or
/// [`Engine::new`](crate::Engine::new)) gives an [`Engine`](crate::Engine);
/// [`Engine::run`](crate::Engine::run) runs a closure once per scoped key with the transaction
/// that holds the claim, or replays the stored outcome. A job racing an HTTP request on the
/// same principal, method, route and key executes the business once. When nothing was
/// committed, the run fails with a [`RunError`](crate::RunError) that names the cause: the
/// engine refused the intent, the store failed, or the work itself failed (a retryable
/// response, a panic); `is_retryable()` says whether another run under the key may succeed.
/// Work that must outlive
/// one transaction takes a [`Lease`](crate::Lease): a claim with an expiry that its holder
/// renews while it works; only once it has expired may another worker take the work over, and
/// a recovery hook first asks whether the work in fact completed. The [`engine`](crate::engine) module has a
/// complete example.
pub mod jobs {}

/// # External side effects: the outbox
///
/// The layer protects the database's own writes. A call to a payment provider inside the
/// handler is not protected: if the commit fails after the call, or a retry runs the handler
/// again, the customer is charged twice. Don't call out from the handler: **enqueue** the call
/// with [`Outbox::enqueue`](crate::outbox::Outbox::enqueue) on the handler's
/// [`Tx`](crate::Tx), and let a [`Dispatcher`](crate::outbox::Dispatcher) deliver committed
/// messages through your [`Sender`](crate::outbox::Sender).
///
/// ```
/// use axum::extract::State;
/// use axum::http::StatusCode;
/// use axum::response::{IntoResponse, Response};
/// use axum_idempotency::outbox::{self, DownstreamKey, Message, Outbox};
/// use axum_idempotency::{IdempotencyContext, Tx, TxError};
/// use sqlx::Sqlite;
///
/// async fn create_payment(
///     State(outbox): State<Outbox<Sqlite>>,
///     context: IdempotencyContext,
///     mut tx: Tx<Sqlite>,
/// ) -> Result<StatusCode, Response> {
///     // The payment row is inserted here, with `&mut *tx`.
///     // The same request's retries derive the same downstream key.
///     let key = DownstreamKey::for_request(context.scoped_key(), "charges", "charge");
///     let charge = serde_json::json!({ "amount": 12.5, "currency": "EUR" });
///     let message = Message::json("charges", key, &charge).map_err(internal)?;
///     match outbox.enqueue(&mut tx, message).await {
///         Ok(_) => Ok(StatusCode::ACCEPTED), // committed with the payment row, sent after
///         // A conflict abort is run again, any other database error is a retryable 500.
///         Err(outbox::Error::Database(error)) => Err(TxError::from(error).into_response()),
///         Err(error) => Err(internal(error)),
///     }
/// }
///
/// /// A retryable 500: rolled back, never stored, so the client's retry runs afresh.
/// fn internal(error: impl std::fmt::Display) -> Response {
///     tracing::error!(%error, "the payment could not be enqueued");
///     StatusCode::INTERNAL_SERVER_ERROR.into_response()
/// }
/// ```
///
/// Delivery is at least once, and every attempt carries the same downstream key. (On
/// PostgreSQL a dispatcher's claim of a message, a lease, commits without waiting for the disk,
/// which keeps it off the message's way to its destination: a server crash may lose a claim
/// as if its lease had run out, and the message is then sent again under its key.) Where the
/// downstream deduplicates by that key (as payment providers do) the effect happens exactly
/// once; where it does not, implement [`Sender::lookup`](crate::outbox::Sender::lookup) so the
/// dispatcher looks the key up before any resend. For an HTTP API,
/// [`HttpSender`](crate::outbox::HttpSender) is that sender: it posts each message with the
/// key as `Idempotency-Key`, turns the answer (`2xx`, `429` and `Retry-After`, `5xx`, a refused
/// connection) into the outcome the dispatcher acts on, and looks a message up by its key on
/// the URL you give it.
///
/// Messages go out concurrently, in no particular order. Where order matters (an order's
/// "paid" before its "refunded"), give them the same
/// [`Message::ordering_key`](crate::outbox::Message::ordering_key), the order id: they are then
/// delivered in commit order, one in flight per key, and a message that waits for a retry
/// holds back only its own key. A message of the key that **fails for good holds the key**:
/// the later ones wait until an operator [requeues](crate::outbox::Outbox::requeue) it or
/// [skips](crate::outbox::Outbox::skip) it, and
/// [`Outbox::blocked_by`](crate::outbox::Outbox::blocked_by) names it from any message behind
/// it. The outbox module's [Order per key](crate::outbox#order-per-key) has the details.
///
/// The [`outbox`](crate::outbox) module documents the dispatcher's
/// options, the outcomes a sender reports and the backends; the `payments` example in the
/// repository is a complete app with a provider and a broker behind one outbox.
///
/// Enqueue on the `Tx` itself (`&mut tx`, as above): the layer's commit then wakes the
/// outbox's dispatchers in this process, and the message goes out within a few milliseconds
/// rather than at the next poll. A job that enqueues on a transaction of its own calls
/// [`Outbox::wake`](crate::outbox::Outbox::wake) after its commit. Dispatchers of other
/// processes poll; on PostgreSQL, an outbox built with `notify_on_commit()` and dispatchers
/// built with `listen()` wake them through `LISTEN/NOTIFY`. That does not pass a
/// transaction-mode pooler (PgBouncer's `pool_mode = transaction`): behind one, no
/// notification arrives and the dispatchers only poll. Each listening dispatcher holds one
/// connection of its own.
///
/// # Outages: what the outbox waits out
///
/// An intent the API accepted must end done, however long its destination is away. The
/// dispatcher therefore tells an outage from an attempt:
///
/// - **An outage** is a destination that cannot be reached or says it cannot take work now:
///   connection refused or reset before the request left, a DNS or connect timeout, a broker
///   connection that is down, `503`, `429`. The sender reports
///   [`SendOutcome::Unavailable`](crate::outbox::SendOutcome::Unavailable). It spends none of
///   the message's attempts. The dispatcher pauses that destination (the message's topic: one
///   sender may serve several, and the others keep flowing): its claims leave the topic out, so
///   its messages wait in the database untouched however large the backlog grows, and it
///   probes the destination with one real message at a time, claimed on its own, on a jittered
///   backoff ([`Dispatcher::probe_backoff`](crate::outbox::Dispatcher::probe_backoff), 1 s
///   doubling to 10 s, never earlier than a `Retry-After`). A probe that finds the destination
///   still away is the only message written meanwhile, due again later, its attempt not
///   counted. The first probe that gets an answer resumes the topic at full speed. While a
///   topic is paused, a claim of the other topics finds them through an index of pending
///   messages by topic and reads none of the paused topic's, so it costs about what a claim
///   costs with nothing paused, however large the backlog. (This is why a topic, like an
///   ordering key, is 1–255 characters: MySQL indexes no longer text.) Once the destination
///   is back, its backlog drains alongside the other topics rather than ahead of them: while
///   claims find more due messages than they take, the topics take turns in each claim (each
///   one's oldest due message, then each one's second, and so on), so a message of another
///   topic waits about one claim, not the whole backlog, though the backlog is older.
///   A sender that knows when its client has reconnected says so
///   ([`Sender::reconnected`](crate::outbox::Sender::reconnected)), and the dispatcher then
///   probes at once rather than at the next probe, which after a long outage is up to 10 s
///   away: the broker senders made with `connect` do, so their topics drain as soon as the
///   client is back (within 5 s of the broker's return, their reconnection backoff's cap).
///   A pause is one `WARN` line ("outbox paused: destination unreachable"), its end one
///   `INFO` line, not one line per message.
/// - **How long a backlog takes.** An outage of length `T` under a load of `L` messages per
///   second leaves `T × L` messages, which drain at the relay's rate less the load:
///   `T × L / (relay − L)`. Size the relay for the longest outage you must absorb, not for the
///   steady load: more dispatchers (in one process or several), a larger
///   [`batch_size`](crate::outbox::Dispatcher::batch_size), and cores for the database and the
///   broker. In this crate's repository, `cargo bench --bench chain --all-features` measures
///   the relay, and with `CHAIN_BENCH_OUTAGE_SECS` an outage's drain, on your machine;
///   `BENCHMARKS.md` has the figures of a two-core one.
/// - **An attempt** is a send the destination answered without doing the work (a `Retry`, such
///   as a `409` for a key still in flight) or whose outcome is unknown (a timeout after the
///   request left). Attempts stay capped by
///   [`Dispatcher::max_attempts`](crate::outbox::Dispatcher::max_attempts) (10), so a poison
///   message stops; a refusal (`Rejected`) fails at once.
/// - **The time budget.** A message that is still not delivered
///   [`give_up_after`](crate::outbox::Dispatcher::give_up_after) its enqueue (6 hours by
///   default) fails for good, outages included. The rule for choosing it: **the budget must be
///   shorter than the time the downstream keeps idempotency keys (Stripe: 24 hours) and than the
///   consumers' deduplication retention
///   ([`Inbox::retention`](crate::inbox::Inbox::retention))**. A message resent after the
///   downstream forgot its key, or an event delivered after the consumer purged its record,
///   takes effect a second time. Six hours outlasts the outages a provider or a broker usually
///   has and leaves a day's key retention four times as long.
/// - **A message that fails says why**: in its record's `last_error` ("gave up after 6h, the time
///   budget; last: unavailable: …", "gave up after 10 attempts: …", or the refusal), in an
///   `ERROR` line with its id and topic, and in the `idempotency_outbox_failed_total` counter
///   (labels below). [`Outbox::requeue`](crate::outbox::Outbox::requeue) puts it back once the
///   cause is fixed, its attempts and its budget counted afresh (from the record's
///   `requeued_at`), its downstream key unchanged.
#[cfg(feature = "outbox")]
pub mod outbox {}

/// # Consumers: the inbox (features `inbox`, `rabbitmq`, `nats`)
///
/// Brokers deliver at least once: a lost ack, a consumer that died, a publisher that resent all
/// bring a message back. The inbox makes a consumer apply each **business key** once, the way the
/// layer makes a handler run each request once:
///
/// ```no_run
/// # #[cfg(all(feature = "rabbitmq", feature = "sqlite"))]
/// # async fn run(store: axum_idempotency::SqliteStore) -> Result<(), Box<dyn std::error::Error>> {
/// # use axum_idempotency::Tx;
/// # use axum_idempotency::inbox::rabbitmq::RabbitMqConsumer;
/// # use axum_idempotency::inbox::{Delivery, Failure, Inbox};
/// # use sqlx::Sqlite;
/// # fn payment_id_of(payload: &[u8]) -> Result<String, Failure> {
/// #     let event: serde_json::Value =
/// #         serde_json::from_slice(payload).map_err(|_| Failure::permanent("not JSON"))?;
/// #     event["payment_id"].as_str().map(str::to_owned).ok_or_else(|| Failure::permanent("no payment_id"))
/// # }
/// let inbox = Inbox::new("orders", store)                      // the consumer's name scopes its keys
///     .key_by(|d: &Delivery| payment_id_of(d.payload()))        // the business key, not the message id
///     .max_attempts(5);
/// let uri = "amqp://127.0.0.1:5672/%2f?heartbeat=10";
/// let consumer = RabbitMqConsumer::connect(inbox, uri, "orders.payment-succeeded") // reconnects
///     .await?
///     .bind("payments", "payment.succeeded")
///     .concurrency(4)                                           // transactions at once
///     .batch(16);                                               // deliveries per transaction
/// consumer.declare().await?;
/// consumer.run(|mut tx: Tx<Sqlite>, delivery: Delivery| async move {
///     // Apply the event here, with `&mut *tx`.
///     Ok::<_, Failure>(())
/// }).await?;
/// # Ok(()) }
/// ```
///
/// For each delivery the inbox begins a transaction, claims the key with the same engine as HTTP
/// requests and jobs (scoped by the consumer's name), runs the handler with that transaction,
/// commits, and only **then** the adapter acks. A redelivery, or the same event under another
/// message id, finds the claim and is acked without running the handler; a copy arriving while
/// the first is still running waits for it (bounded) and then skips. `NatsConsumer` does the same
/// on a JetStream durable pull consumer.
///
/// **Batches.** A delivery's cost is mostly its commit's wait for the disk. With `.batch(n)` the
/// adapter hands up to `n` of the deliveries it holds to `Inbox::handle_batch`, which claims each
/// key and runs each handler in **one** transaction and commits once: on a database that syncs
/// each commit, a backlog (the one a broker or database outage leaves) drains several times
/// faster. A batch takes what has arrived and never waits to fill, so a lone delivery is applied
/// at once. If any handler in it fails, or the commit does, nothing of it stands and each
/// delivery is applied alone, so one bad delivery fails only itself; an unreachable database
/// pauses the whole batch as one outage. A handler may then run more than once for a delivery,
/// which is harmless for what it writes through `Tx` (rolled back) and one more reason to keep
/// its effects there.
///
/// **Why the business key.** A message id only catches redeliveries of one message. A publisher
/// that resends the event under a new id (an outbox retry on a broker without deduplication, a
/// second publisher, a replay from an archive) still carries the same payment id. Consumers with no
/// business key can keep the default, the message id.
///
/// **Failures.** The handler returns `Failure::Retryable` (rolled back; redelivered after a backoff
/// drawn at random below a ceiling that doubles per attempt, so consumers that failed together in
/// one outage come back spread out: NATS `Nak` with a delay, RabbitMQ a per-message-TTL delay queue
/// `{queue}.retry` that dead-letters back, no plugin needed) or `Failure::Permanent` (rolled back;
/// dead-lettered at once). Retryable failures are dead-lettered too once the attempt count reaches
/// `max_attempts` (NATS: the broker's delivery count; RabbitMQ: the quorum queue's
/// `x-delivery-count` plus an `x-inbox-attempts` header kept on retried copies). A poison message
/// never loops and never blocks the messages behind it. Dead letters wait in `{queue}.dead`
/// (RabbitMQ) or the stream `{DURABLE}_DEAD` (NATS), each with its reason in the header
/// `x-inbox-reason` (RabbitMQ) or `Inbox-Reason` (NATS); the reason is also logged at `WARN` with
/// the consumer's name, the message id and the attempt, never the payload. The failure is recorded
/// through the engine in a scope of its own, and the business key stays unclaimed, so `replay_dead`
/// after the fix (or a fresh copy from the broker) applies it through the same claim, once. A dead
/// letter is counted in `stats().dead` and labelled `outcome="dead"` in the engine's log line and
/// metrics, never `retryable`.
///
/// **Outages are not attempts.** A delivery that fails because the consumer's own database (or a
/// dependency) is unreachable is retried for as long as the outage lasts and never dead-lettered:
/// `?` turns a database error that says so (a broken or refused connection, a pool timeout) into
/// `Failure::Unavailable`, a handler may return `Failure::unavailable(..)` for a dependency, and
/// the inbox's own store failing to claim or commit counts the same, as does, on SQLite, the
/// database's one write lock held by another writer past `wait_for_in_flight` (a stuck process, a
/// long backup: no delivery can be applied until it lets go). It counts no attempt, neither
/// the inbox's nor the broker's (RabbitMQ: through `{queue}.retry` with the count unchanged,
/// never a `nack` toward the quorum queue's delivery limit; NATS: kept in hand with progress acks,
/// never `Nak`ed toward a `max_deliver`), and the consumer pauses meanwhile, as the outbox's
/// dispatcher does, for a jittered backoff of at most 10 s (`Inbox::outage_backoff`).
///
/// **Guarantees and limits.** At-least-once delivery plus the claim in the handler's transaction
/// gives one effect per business key for what the handler writes through `Tx`; calls it makes to
/// other systems are not covered (use the outbox). **Ordering is not guaranteed**: retries,
/// concurrency and several consumers reorder deliveries; a handler that needs order must check it
/// (a version column, a state machine). Dedupe records are kept by default. **One rule for both
/// ends:** the inbox's retention (`Inbox::retention`) must exceed the publishers' time budget, the
/// outbox's time budget (`Dispatcher::give_up_after`, 6 h by default), plus the broker's
/// redelivery horizon, or a late copy would apply again. `inbox.stats()` counts processed,
/// duplicate, retried, unavailable (outages) and dead deliveries; `inbox.is_applied(&delivery)`
/// says whether a key's unexpired claim exists. The inbox keeps no response, only each applied
/// key (its digest and expiry) in the table `idempotency_inbox`, claimed by one plain insert in
/// the handler's transaction, as a hand-written dedupe table would be. The store that keeps
/// HTTP records keeps the inbox's keys, and its `purge_expired` or `spawn_purger` deletes the
/// expired ones of both.
///
/// # When the broker goes away
///
/// A broker that restarts or is briefly out of reach is waited out by consumers and outbox
/// senders alike, without a process restart: nothing is lost, nothing is applied twice, and
/// the chain catches up within seconds of the broker's return. The suite restarts a private
/// `nats-server` and a private RabbitMQ node under load (`tests/chain_recovery.rs`): every
/// payment posted meanwhile was applied within about 3 s (NATS) and 4 to 7 s (RabbitMQ) of
/// the broker's return.
///
/// - **RabbitMQ.** `RabbitMqConsumer::connect(inbox, uri, queue)` and
///   `RabbitMqSender::connect(uri, exchange)` keep the URI and reconnect by themselves, for as
///   long as they run, waiting a jittered backoff between attempts (up to 100 ms, the ceiling
///   doubling to 5 s, so a fleet does not come back at one instant; the consumer logs each
///   failed attempt at `WARN`). The consumer first finishes the deliveries in hand: their acks are
///   lost with the connection, the broker redelivers them, and the inbox finds their claims
///   and skips them. It then declares its queues again (a broker that lost them gets them
///   back) and consumes on. The sender reconnects in the background, logging one `WARN` when
///   it finds the connection lost and one `INFO` when it is back; meanwhile every send answers
///   unavailable at once, and a publish whose confirm was lost with the connection is an
///   unknown outcome, sent again later under the same `message_id`. On a connection of your own
///   (`RabbitMqConsumer::new`, `RabbitMqSender::with_connection`) neither reconnects: `run`
///   returns the error, and sends are unavailable while the connection is down. Both ask for a 10 s heartbeat unless the URI
///   sets one (`?heartbeat=…`), so a broker host that vanishes without closing its sockets is
///   noticed within about 20 s; on a connection of your own, put `?heartbeat=10` in its URI.
/// - **NATS.** The async-nats client reconnects by itself, for as long as it runs, and a
///   JetStream pull consumer asks for messages again once reconnected, so `NatsConsumer` and
///   `NatsSender` go on as they are. Made with `NatsConsumer::connect(inbox, url, stream,
///   durable)` and `NatsSender::connect(url)`, their client waits the same jittered backoff
///   between attempts as RabbitMQ's (a client of your own waits async-nats' default: the same
///   for every client, doubling from nothing to 4 s), and pings the server every 5 s, so a
///   server host that vanishes without closing its sockets is noticed within about 15 s (a
///   client of your own pings once a minute and takes up to three: set
///   `ConnectOptions::ping_interval`; until then each publish waits out its ack, an unknown
///   outcome, which counts as an attempt). While the client is disconnected a send publishes
///   nothing and answers unavailable. A publish whose ack is lost in the outage is an unknown
///   outcome, sent again later with the same `Nats-Msg-Id`, which the stream's duplicate window
///   drops; a message whose ack was lost comes back after the ack wait and is skipped as a
///   duplicate.
/// - **The outbox's attempts.** A send that finds the broker away is
///   [`Unavailable`](crate::outbox::SendOutcome::Unavailable): it spends none of the message's
///   attempts, however long the outage lasts; the dispatcher pauses the destination and probes
///   it until it answers. A refusal from a broker that is up (a RabbitMQ nack, a message no
///   queue is bound for) is a retry and does count.
/// - **Deleted, not restarted.** Durable queues, streams and consumers survive a restart. A
///   queue or durable consumer deleted from outside is not an outage to wait out: `run` ends
///   (`Ok(())` when RabbitMQ cancels the consumer; on NATS the pull stream ends with "consumer
///   deleted"), and the `orders` example exits 1 for its supervisor to restart it, which
///   declares them again.
///
/// # What a broker's acknowledgement survives
///
/// The outbox marks a message delivered when the broker acknowledged the publish: RabbitMQ's
/// publisher confirm (the sender publishes persistent and `mandatory`, so a confirm means a
/// queue took it), JetStream's publish ack. From then on the message is the broker's to keep;
/// the outbox never sends it again. What the acknowledgement survives is the broker's setting,
/// not the crate's:
///
/// - **JetStream.** A file-storage stream acknowledges a publish once it is written, before it
///   is on disk: by default the server syncs every 2 minutes (`sync_interval` in its
///   `jetstream` configuration). A killed `nats-server` process loses nothing (the operating
///   system still has the write); a power loss or kernel crash of its host can erase what was
///   acknowledged since the last sync, and with it messages the outbox marked delivered.
///   `sync_interval: always` syncs each write before the ack, at a cost in throughput. With
///   replicas (`num_replicas: 3`) an ack means a quorum of servers has the message, so one
///   host that loses power loses nothing the others hold; without `always`, a power loss of
///   several at once (a rack, a data centre) or one host's crash combined with pauses or
///   partitions can still erase acknowledged messages, as Jepsen's analysis of NATS 2.12.1
///   (December 2025) showed. `NatsSender::declare_stream` makes a stream with the defaults
///   (file storage, one replica); a stream made beforehand with other settings is used as it
///   is.
/// - **RabbitMQ.** A persistent message routed to a quorum queue is confirmed once a majority
///   of the queue's replicas has written it to disk (fsync): it survives a process kill and,
///   with three replicas, the power loss of any one host. The inbox's `RabbitMqConsumer`
///   declares quorum queues. A classic durable queue writes persistent messages to disk too,
///   but may confirm one before it is synced (or without writing it at all, once a consumer
///   has taken and acked it): a process kill loses nothing confirmed, a host's power loss can
///   erase the last messages it confirmed. A message that is not persistent, or routed to a
///   queue that is not durable, survives neither.
///
/// A message erased after its acknowledgement is not resent by the outbox: it reads as
/// delivered, with the broker's receipt. Where that matters, choose the settings that sync
/// before acknowledging, or keep the receipts to compare with what the consumers applied.
///
/// # The example chain: payments → broker → orders
///
/// The repository's `payments` example publishes one `payment.succeeded` event per succeeded
/// charge through its outbox, the charge's [follow-up](crate::outbox::Sender::follow_ups),
/// enqueued in the transaction that records the charge delivered (`RabbitMqSender`: publisher confirms, the downstream key as
/// `message_id`; `NatsSender`: the key as `Nats-Msg-Id`, so the stream's duplicate window
/// drops resends), and the `orders` example consumes them through the inbox, dedupes by
/// payment id, and shows `payments`, `paid_total` and `status` on `GET /orders/{id}`.
///
/// Start the three processes, each in a terminal of its own, in a clone of the repository
/// (RabbitMQ at `127.0.0.1:5672` with its default `guest` user; for NATS JetStream, use
/// `BROKER_URL=nats://127.0.0.1:4222` and the feature `nats` in place of `rabbitmq`):
///
/// ```sh
/// cargo run --example payment_provider
/// ```
///
/// ```sh
/// BROKER_URL=amqp://guest:guest@127.0.0.1:5672/%2f cargo run --example orders --features rabbitmq
/// ```
///
/// ```sh
/// BROKER_URL=amqp://guest:guest@127.0.0.1:5672/%2f cargo run --example payments --features outbox,rabbitmq
/// ```
///
/// The provider listens on `127.0.0.1:4000`, `orders` on `127.0.0.1:3000` and `payments` on
/// `127.0.0.1:3001`, each on an SQLite file of its own in the current directory
/// (`payment_provider.db`, `orders.db`, `payments.db`: delete them to start over). Both apps
/// know the users `alice` (`alice-token`) and `bob` (`bob-token`).
///
/// What the apps declare on the broker is durable and stays there when they stop: the exchange
/// `payments` and the queues `orders.payment-succeeded`, `orders.payment-succeeded.retry` and
/// `orders.payment-succeeded.dead` (NATS: the streams `PAYMENTS` and `ORDERS_DEAD`). On a
/// broker that others use too, give `orders` (its `replay-dead` included) and `payments` the
/// same `BROKER_NAMESPACE`, say `BROKER_NAMESPACE=demo`: every name then starts with it
/// (`demo.payments`, `DEMO_PAYMENTS`), and those are the names to delete afterwards.
///
/// Alice orders two widgets: `201 Created` with `"id":1` on a fresh `orders.db`.
///
/// ```sh
/// curl -si -X POST localhost:3000/orders -H 'authorization: Bearer alice-token' \
///   -H 'idempotency-key: 4b0f6c1e-2a9d-4e3b-8c7a-5d1e0f9a2b64' \
///   -H 'content-type: application/json' \
///   -d '{"sku":"widget","quantity":2,"amount":12.5,"currency":"EUR"}'
/// ```
///
/// She pays it. `POST /payments` takes a key and the JSON body
/// `{"order_id", "amount", "currency", "payee"}`: `order_id` is the id of an existing order,
/// as an integer or a string of digits (`1` or `"1"`), `amount` a positive number, `currency`
/// three capital letters, `payee` who is paid. It answers `202 Accepted`,
/// `{"id":1,"status":"pending"}` and `location: /payments/1`: the payment is recorded, and
/// the charge is sent after the commit.
///
/// ```sh
/// curl -si -X POST localhost:3001/payments -H 'authorization: Bearer alice-token' \
///   -H 'idempotency-key: 9e2d7a41-6c3b-4f8e-a1d5-0b7c3e9f2a18' \
///   -H 'content-type: application/json' \
///   -d '{"order_id":1,"amount":12.5,"currency":"EUR","payee":"acme"}'
/// ```
///
/// A moment later the payment shows `"status":"succeeded"` with the provider's `charge_id`,
/// and the order shows `"status":"paid"`, `"payments":[{"payment_id":"1","amount":12.5}]` and
/// `"paid_total":12.5`. An order is paid once the payments applied to it reach its amount,
/// shipped or not. The same payment command again replays the `202` and charges nothing.
///
/// ```sh
/// curl -s localhost:3001/payments/1 -H 'authorization: Bearer alice-token'
/// curl -s localhost:3000/orders/1 -H 'authorization: Bearer alice-token'
/// ```
///
/// **A payment for an unknown order.** `payments` does not know the orders: a payment for
/// order 2, which does not exist yet, is accepted (`202`) and charged like any other. Its id
/// is 3, not 2: a payment's id is its outbox message's, and the first payment's event took 2.
/// The
/// `orders` consumer finds no order 2, so it never applies the event and does not retry it
/// either: it dead-letters it at once, to the queue `orders.payment-succeeded.dead` (NATS: the
/// stream `ORDERS_DEAD`), where it waits for an operator. An `order_id` that is neither an
/// integer nor a string of digits, such as `"o-1"`, is refused by `payments` itself with `400`
/// `invalid_payment`, before anything is charged.
///
/// ```sh
/// curl -si -X POST localhost:3001/payments -H 'authorization: Bearer alice-token' \
///   -H 'idempotency-key: 1c7e5a39-8b2f-4d6a-9e0c-3a4b5f6d7e82' \
///   -H 'content-type: application/json' \
///   -d '{"order_id":2,"amount":30,"currency":"EUR","payee":"acme"}'
/// ```
///
/// **Replaying dead letters.** Once the cause is fixed (here: order 2 comes to exist),
/// `replay-dead` applies the dead letters through the same claim, once each, prints what it
/// did (`replayed dead letters: applied=1 duplicates=0 still_dead=0`) and exits; the serving
/// `orders` process keeps running. Order 2 then shows `"status":"paid"`.
///
/// ```sh
/// curl -si -X POST localhost:3000/orders -H 'authorization: Bearer alice-token' \
///   -H 'idempotency-key: 5f3a9c27-0d4e-4b6f-8a1c-7e2b9d0f6a43' \
///   -H 'content-type: application/json' \
///   -d '{"sku":"widget","quantity":4,"amount":30,"currency":"EUR"}'
/// BROKER_URL=amqp://guest:guest@127.0.0.1:5672/%2f cargo run --example orders --features rabbitmq -- replay-dead
/// curl -s localhost:3000/orders/2 -H 'authorization: Bearer alice-token'
/// ```
///
/// A broker restarted under the chain is waited out: `orders` and `payments` reconnect by
/// themselves and catch up (see [When the broker goes away](#when-the-broker-goes-away)).
/// If its consumer stops (the queue or the durable consumer deleted from outside), `orders`
/// logs why and exits with status 1, so a supervisor restarts it and the restart declares what
/// it consumes again.
#[cfg(feature = "inbox")]
pub mod inbox {}

/// # The caller's half: one key per logical call
///
/// A retried request is only safe if it carries the key of the first attempt. With the
/// `client` feature, [`IdempotentRetryLayer`](crate::client::IdempotentRetryLayer) wraps a
/// tower HTTP client: it makes one key per call before the first attempt (192 random bits from
/// the OS, 32 URL-safe characters), resends the same key and body on every retry, retries only
/// what is retryable (connection errors, timeouts, 408, 429, 5xx, and the in-progress 409),
/// honours `Retry-After`, and stops at a deadline. The `reqwest` feature offers the same as
/// `reqwest-middleware` middleware.
///
/// A client program needs these dependencies (`default-features = false` leaves the server
/// half, sqlx and axum out of the build):
///
/// ```toml
/// [dependencies]
/// axum-idempotency = { version = "0.1", default-features = false, features = ["client"] }
/// bytes = "1"
/// http = "1"
/// http-body-util = "0.1"
/// hyper-util = { version = "0.1", features = ["client-legacy", "http1", "tokio"] }
/// tokio = { version = "1", features = ["macros", "rt-multi-thread"] }
/// tower = { version = "0.5", features = ["util"] }
/// ```
///
/// and places an order through hyper-util's client like this:
///
/// ```no_run
/// use std::time::Duration;
///
/// use axum_idempotency::client::{ClientKey, IdempotentRetryLayer};
/// use bytes::Bytes;
/// use http_body_util::{BodyExt as _, Full};
/// use hyper_util::client::legacy::Client;
/// use hyper_util::rt::TokioExecutor;
/// use tower::{Layer as _, ServiceExt as _};
///
/// #[tokio::main]
/// async fn main() -> Result<(), Box<dyn std::error::Error>> {
///     let http = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
///     let client = IdempotentRetryLayer::new()
///         .max_attempts(5)
///         .deadline(Duration::from_secs(30))
///         .layer(http);
///
///     let request = http::Request::post("http://127.0.0.1:3000/orders")
///         .header("authorization", "Bearer alice-token")
///         .header("content-type", "application/json")
///         .body(Full::new(Bytes::from_static(br#"{"sku":"widget","quantity":2}"#)))?;
///     // One key for this call, made before the first attempt and sent on every retry.
///     let response = client.oneshot(request).await?;
///     let key = response.extensions().get::<ClientKey>().cloned();
///     let status = response.status();
///     let body = response.into_body().collect().await?.to_bytes();
///     println!("{status} with key {key:?}: {}", String::from_utf8_lossy(&body));
///     Ok(())
/// }
/// ```
///
/// When it gives up with an error, the server may still have executed an attempt whose answer
/// was lost: retry later with the error's key, never a fresh one. The [`client`](crate::client)
/// module documents it in full.
#[cfg(feature = "client")]
pub mod client {}

/// # Running it
///
/// ## Purging
///
/// Expired records are deleted explicitly, never implicitly: call the store's
/// `purge_expired()` from a job of your own, or let `spawn_purger(every)` run it on an
/// interval. Both delete in batches (a thousand records, 250 on SQLite and MySQL) so no
/// statement holds long locks, and rest after each batch as long as it took (twice as long on
/// MySQL, where InnoDB's purge threads finish each delete in the background), so a purge beside
/// live traffic takes at most about half of one connection's time. An expired record not yet
/// purged is already treated as absent: its key is a new intent.
///
/// On PostgreSQL, leave autovacuum on (the server's default) for the outbox's table, or
/// vacuum it yourself: each message is written three times (enqueued, leased, settled), and
/// the dead row versions of a long outage's backlog slow every claim and settle until a
/// vacuum clears them. In a 10-minute broker outage on a server with autovacuum off (about
/// 460,000 rows, 260,000 of them dead), a dispatcher's settle of a batch took 36–144 ms and
/// the charges, whose provider was up, fell behind their load; one `VACUUM ANALYZE` of the
/// table brought the settle back to 4–17 ms.
///
/// ## Logs
///
/// Each request the engine answers (every request past the layer's checks of key, principal
/// and body size) logs one `INFO` line, `idempotent request`, in a span carrying a
/// 12-hex-digit prefix of the scoped key's SHA-256 (`key`), the method and the route, with an
/// `outcome`: `executed`, `expired` (executed under a key whose old record had expired),
/// `failed_permanent`, `replayed`, `mismatch`, `in_flight`, `retryable`, `recovered`,
/// `lease_lost`, and for the inbox `dead` (a delivery rolled back and dead-lettered, never
/// retried). Never the key or a body. The database stores the SHA-256 of the scoped key,
/// not the key; principal, method and route are kept in clear for operators (a NUL in them,
/// which PostgreSQL's `text` cannot hold, is shown as U+FFFD on every backend; the digest
/// covers the exact text).
///
/// ## Metrics
///
/// With the `metrics` feature the engine reports through the
/// [`metrics`](https://docs.rs/metrics) facade, to whatever recorder the application installs
/// (nothing is recorded without one):
///
/// | name | kind | labels | what it counts |
/// |---|---|---|---|
/// | `idempotency_requests_total` | counter | `outcome` | every answered intent, by the outcome its log line reports (values above) |
/// | `idempotency_claim_seconds` | histogram | `result` | the time one claim took: `claimed` (the key was free), `taken` (another intent's record holds it, possibly after waiting for an in-flight original), `busy` (the wait ran out: 409), `failed` (the store failed) |
///
/// The labels carry only those fixed values: never a key, a digest, a principal or a route, so
/// the number of series stays fixed whatever the traffic. The outcomes map to the questions
/// operators ask: executions (`executed`, `expired`, `failed_permanent`), replays (`replayed`),
/// 422s (`mismatch`), in-flight 409s (`in_flight`), rollbacks the client retries
/// (`retryable`), inbox deliveries dead-lettered (`dead`; the failure's note, recorded in a
/// scope of its own, adds one `failed_permanent`). Duplicates that waited for their original show as `taken` claims with a
/// latency near the original's duration.
///
/// The outbox's dispatchers add two:
///
/// | name | kind | labels | what it counts |
/// |---|---|---|---|
/// | `idempotency_outbox_failed_total` | counter | `reason` | messages that failed for good: `rejected` (the downstream refused), `attempts` (out of attempts), `budget` (past the time budget) |
/// | `idempotency_outbox_paused_destinations` | gauge | none | destinations (a dispatcher's topics) paused right now because they are unavailable, summed over the process's dispatchers |
///
/// **Exporting.** Install any `metrics` exporter at start-up. For Prometheus,
/// `metrics-exporter-prometheus`'s `PrometheusBuilder::new().install()` serves them for
/// scraping. For OpenTelemetry, install a recorder that forwards the facade to a `Meter` of
/// your OpenTelemetry SDK's meter provider, such as `metrics-exporter-otel`'s
/// `OpenTelemetryRecorder::new(meter)` or `metrics-exporter-opentelemetry`; the provider's
/// OTLP exporter then ships them with the rest of your telemetry. Alternatively, serve the
/// Prometheus endpoint and let the OpenTelemetry Collector's Prometheus receiver scrape it.
///
/// **What to alert on.**
///
/// - `outcome="retryable"` rising: handlers or the database are failing (5xx, panics, store
///   errors); every one of those is an attempt the client must repeat.
/// - `outcome="dead"` above zero: the inbox dead-lettered deliveries that can never apply
///   (malformed, unknown, refused for good); look for their reasons in the `WARN` lines or the
///   dead letters' headers. An outage of the consumer's database is never counted here.
/// - `idempotency_outbox_failed_total` above zero: an accepted intent will not happen without
///   a person; the `ERROR` line and the record's `last_error` say why, and `requeue` resumes it.
/// - `idempotency_outbox_paused_destinations` above zero for longer than your downstream's
///   usual outages: messages are waiting and spending their time budget.
/// - `outcome="in_flight"` above zero for long: duplicates give up waiting, so originals take
///   longer than `wait_for_in_flight`, or locks are held (a slow handler, a long transaction).
///   `result="busy"` claims say the same from the claim's side.
/// - `outcome="mismatch"` rising: a client reuses keys for different requests, a bug on the
///   caller's side (or a field that should be declared intent-neutral).
/// - The claim latency's high percentiles for `result="claimed"`: the cost every new request
///   pays; a rise means database contention.
/// - A replay ratio (`replayed` over all) far from its usual value: retries storming after an
///   outage, or clients that stopped sending keys.
///
/// ## A support case: looking a record up
///
/// "Was my order placed, and what did you answer?" A record is reached only through its full
/// scope, the caller's principal together with method, route and key, never by the raw key
/// alone, so an operator must name whose record it is.
/// [`Engine::lookup`](crate::Engine::lookup) reads it (and logs that it did, with the key's
/// digest):
///
#[cfg_attr(feature = "sqlite", doc = "```")]
#[cfg_attr(not(feature = "sqlite"), doc = "```ignore")]
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use axum_idempotency::{Engine, IdempotencyKey, Lookup, Scope, SqliteStore};
///
/// # let store = SqliteStore::new(sqlx::SqlitePool::connect("sqlite::memory:").await?);
/// # store.migrate().await?;
/// let engine = Engine::new(store); // or `layer.engine()`
/// let key: IdempotencyKey = "1f0e7c52-8f1d-4d55-a8b3-0c7f6a2b9e41".parse()?;
/// let scope = Scope::new("alice", "POST", "/orders", key);
/// match engine.lookup(&scope).await? {
///     Lookup::Final(response) => println!("answered {}", response.status()),
///     Lookup::InFlight => println!("still at work"),
///     Lookup::Absent => println!("never received, expired or forgotten"),
///     _ => {}
/// }
/// # Ok(()) }
/// # tokio::runtime::Runtime::new().unwrap().block_on(run()).unwrap();
/// ```
///
/// ## Letting a record go
///
/// A record that is stuck (leased work whose holder is gone for good) or wrong (an answer that
/// must not be replayed any more) is let go with [`Engine::forget`](crate::Engine::forget): an
/// explicit operator action, through the engine, logged at `WARN` with the key's digest, the
/// method, the route and the reason you give. The next request with the key executes afresh.
/// Do not delete rows by hand: that bypasses the log and the replay cache.
///
#[cfg_attr(feature = "sqlite", doc = "```")]
#[cfg_attr(not(feature = "sqlite"), doc = "```ignore")]
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// # use axum_idempotency::{Engine, IdempotencyKey, Scope, SqliteStore};
/// # let store = SqliteStore::new(sqlx::SqlitePool::connect("sqlite::memory:").await?);
/// # store.migrate().await?;
/// # let engine = Engine::new(store);
/// # let key: IdempotencyKey = "1f0e7c52-8f1d-4d55-a8b3-0c7f6a2b9e41".parse()?;
/// # let scope = Scope::new("alice", "POST", "/orders", key);
/// let deleted = engine.forget(&scope, "ticket 4711: stored answer was wrong").await?;
/// # let _ = deleted; Ok(()) }
/// # tokio::runtime::Runtime::new().unwrap().block_on(run()).unwrap();
/// ```
pub mod operations {}

/// # Performance
///
/// A new key costs the claim and the response record inside the handler's own transaction,
/// and no read before the claim. On PostgreSQL and SQLite the record is written once, complete,
/// as the transaction commits: the claim itself only takes the key's lock (an advisory lock on
/// PostgreSQL, SQLite's write lock) and checks that no live record holds the key. On
/// PostgreSQL the claim is sent in the same message as `BEGIN` and the record in the same
/// message as `COMMIT`, so a request exchanges with the database exactly as often as the
/// handler's transaction alone would. Both are calls (`CALL`, which the server does not plan) of
/// two procedures the schema creates, `axum_idempotency_lock_v1` and
/// `axum_idempotency_record_v1`, whose statements' plans the server keeps for the session, so it
/// parses one call per message rather than the statements. sqlx ends a transaction only by a
/// statement of its own, so the record's message ends `COMMIT; BEGIN` and the pool's `ROLLBACK` of that empty transaction travels with the
/// ping sqlx sends when the connection goes back to the pool: two trivial statements for the
/// server, no wait for the client. On MySQL and MariaDB the claim's row stays the key's lock
/// (a session lock such as `GET_LOCK` holds on one Galera node only), written by a stored
/// procedure called in place of `BEGIN`, so the claim costs no exchange of its own; the
/// record's `UPDATE` is one exchange before `COMMIT`. It is not sent in one
/// query with `COMMIT`: on a Galera cluster that `COMMIT` was sometimes answered OK for a
/// transaction the cluster had rolled back (see [`clusters`]). Values written into
/// these statements are hexadecimal literals only, so no principal, route or body can change
/// them; responses over 64 KiB are stored with bound parameters, one exchange more.
///
/// A replay is one indexed read and no transaction when the key is one this instance handled
/// lately (the engine remembers the last few thousand keys, in 64 KiB, to tell a likely retry
/// from a likely first attempt); a retry that reaches an instance that has not seen its key
/// lately finds the key taken by its claim, which leaves nothing open, and reads the record:
/// one round trip more. Either way the claim relies only on the table's unique key.
///
/// The read-then-claim path reads on one pooled connection, gives it back, and begins the
/// claim's transaction through sqlx's public `Pool::begin`: one more pool checkout, only for
/// a retry of a key this instance saw lately that has no live record.
///
/// With `.cache_replays(bytes)` a replay this instance has already seen is answered from
/// memory, with no database read, and a retry that repeats the kept request byte for byte
/// skips the fingerprint too. A record deleted behind the engine's back is still replayed by
/// an instance that holds it; [`Engine::forget`](crate::Engine::forget) clears the cache of
/// the engine it is called on.
///
/// Build the pool with `.test_before_acquire(false)` to save sqlx's ping on every checkout.
///
/// **Memory for a large table.** The records are keyed by a digest, so each new key lands at
/// a random place in the table's primary key and the whole index stays hot. Keep it in the
/// database's memory: on PostgreSQL give `shared_buffers` room for the records table's
/// indexes (`pg_indexes_size('idempotency_records')`; about 1 GB at ten million records),
/// on MySQL and MariaDB give the buffer pool room for the whole table (see the MySQL section).
/// Measured at ten million records on PostgreSQL, new keys ran at 0.87–0.98 of the empty
/// table's rate with 128 MB of `shared_buffers`, and at 0.99 with 2 GB.
///
/// The repository's `cargo bench --bench http --all-features` measures the layer against a
/// plain transaction and a hand-written claim; its `BENCHMARKS.md` holds the last results and
/// the round trips counted per request.
pub mod performance {}

/// # PostgreSQL failover
///
/// The primary dies, a standby is promoted, and the database's address (a virtual IP, a DNS name, a
/// proxy) moves to it. What clients see depends on how the standby was fed.
///
/// **Orders and records move together.** The claim, the handler's writes and the stored response
/// commit as one transaction, so they reach a standby as one: a promoted standby holds a request's
/// business rows and its record, or neither. A retry after the failover either replays the stored
/// answer (the transaction reached the standby) or runs the request afresh (it did not). It never
/// finds a record without its order, which would replay an answer naming nothing, nor an order
/// without its record, which would run the order twice. This holds whatever the replication mode.
///
/// **Synchronous replication keeps every acknowledged order.** With the standby named in the
/// primary's `synchronous_standby_names` and `synchronous_commit = on` (or `remote_apply`), a
/// commit returns only once the standby has it, and the layer answers only after the commit. Every
/// 201 a client received names an order the promoted standby holds, and a retry of it replays. A
/// request whose commit was waiting for the standby when the primary died was never acknowledged:
/// its client got a retryable error, and its retry runs on the new primary. One execution per key,
/// acknowledged orders kept: the contract holds through the failover. With a single synchronous
/// standby, that standby's loss stops every commit on the primary (requests then get `503
/// idempotency_timeout` at the deadline, retryable); name two standbys (`ANY 1 (a, b)`) to ride out
/// the loss of one.
///
/// **Asynchronous replication can lose acknowledged orders.** A commit returns before the standby
/// has it. Orders acknowledged in the last moments before the crash may be missing on the promoted
/// standby, and their records with them. A client then holds a 201 for an order that no longer
/// exists; if it sends the key again (its answer was lost, say), the request runs afresh and makes
/// a new order, with a new id. The id a lost acknowledgement named can be handed out again, since
/// the sequence's progress replicates like any other write. Where that is unacceptable, use
/// synchronous replication; otherwise reconcile after an asynchronous failover (the old primary's
/// WAL, or the clients' acknowledgements, against the new primary). Never bring the old primary
/// back as it was: it may hold commits the new one lacks. Rebuild it from the new primary
/// (`pg_rewind` or a new base backup).
///
/// **During the switch every answer is retryable and bounded.** Connections to the dead primary
/// break; a request whose transaction was on one is rolled back and answered `500
/// idempotency_internal_error` with `Retry-After`. While the address leads nowhere, new connections
/// fail and requests get the same answer, or `503 idempotency_timeout` at the layer's
/// [`deadline`](crate::IdempotencyLayer::deadline) (10 s unless set) when the address is silent
/// rather than refusing. Set the pool's `acquire_timeout` below that deadline so a request waiting
/// for a connection is answered in time. The client retries with the same key (the crate's client
/// layer, feature `client`, does). Nothing needs restarting once the address moved: sqlx drops the
/// broken connections and opens new ones through the address, and `test_before_acquire` (on by
/// default) finds the broken idle ones before a request does.
///
/// **Replays kept in memory.** With [`cache_replays`](crate::IdempotencyLayer::cache_replays), an
/// instance answers retries it has seen from memory. After an asynchronous failover it may replay
/// an answer whose order the promoted database lost: restart the app instances (or
/// [`forget`](crate::Engine::forget) the affected keys) as part of such a failover.
///
/// **Measured.** The repository's `tests/failover.rs` runs a primary and a hot standby of its own,
/// the standby streaming over a link with 5 ms of one-way lag, and the app reaching the primary
/// through a forwarder standing in for the virtual IP. Eight clients place orders, each retrying
/// its key until a final answer. The test cuts the link, kills every process of the primary with
/// SIGKILL, waits a second, promotes the standby and moves the address, then compares the clients'
/// acknowledgements with what the promoted server holds. With synchronous replication, in seven
/// runs: no acknowledged order lost, one order and one record per key, every answer during the
/// switch other than a 201 a retryable 500 with `Retry-After`, the slowest within 0.35 s (earlier
/// runs by hand, with a slower switch, within 3.3 s). With asynchronous replication, in seven runs:
/// 3 to 42 of 1 100 to 1 550 acknowledged orders lost per run, each together with its record, never
/// one without the other; in two runs most of the lost ids (20 of 23, 31 of 42) had been given to
/// later orders.
pub mod failover {}

/// # MariaDB Galera clusters
///
/// The layer keeps its contract on a MariaDB Galera cluster (galera-4) with an app instance on
/// each node, every instance writing through its own node: one committed execution per key,
/// replays byte for byte, acknowledged answers kept when a node dies. Use the `mysql` feature
/// and hand each instance a pool on its node, as on a single server. The repository's
/// `tests/galera.rs` starts three nodes from nothing and checks all of this on every run.
///
/// # What happens to a key claimed on two nodes at once
///
/// Galera replicates a transaction when it commits, not before: a claim still in flight on
/// node A is invisible on node B. A duplicate that reaches B meanwhile claims the key there
/// too and **runs the handler**. Both transactions then reach `COMMIT`, where Galera certifies
/// them in one cluster-wide order: the first commits, the second is aborted with a deadlock
/// error (1213), and the layer runs that request again. The new attempt finds the winner's
/// record and replays it; if the winner's write has not been applied on B yet, the claim goes
/// through again, loses certification again, and is run once more after a short jittered
/// pause, until it sees the record. No client sees the abort.
///
/// So a handler can run more than once for a key, but only one run commits. Anything it does
/// outside its transaction (a call to another service, an e-mail) must go through the
/// crate's outbox (feature `outbox`, its own chapter), which sends only what committed.
///
/// Duplicates on the **same** node wait on the claim's row lock as on a single server, for
/// `wait_for_in_flight`, then replay.
///
/// # Handlers
///
/// - Return your statements' errors as [`TxError`](crate::TxError) (`?` does it). Galera
///   aborts a local transaction that stands in the way of a replicated one ("brute force
///   abort"); the abort surfaces as error 1213 on the transaction's next statement, and as a
///   `TxError` the layer runs the request again instead of answering 500.
/// - Row locks (`SELECT … FOR UPDATE`) hold on their node only. Across nodes, certification
///   decides: of two transactions writing the same row, the first to commit wins and the
///   other is aborted and run again, and then reads the winner's write. Read and write in the
///   one transaction, as on a single server, and a stock cannot be oversold.
/// - Every table needs a primary key; Galera certifies and applies rows by it. The crate's
///   tables have one.
/// - Under contention across nodes the layer runs a request up to 12 times; past that the
///   client gets a retryable `503 idempotency_conflict`. Routing all writes to one node (a
///   proxy such as MaxScale or HAProxy in front of the cluster) removes the conflicts between
///   nodes altogether.
///
/// # Settings that matter
///
/// | setting | value | why |
/// |---|---|---|
/// | `binlog_format` | `ROW` | Galera replicates rows |
/// | `innodb_autoinc_lock_mode` | `2` | required by Galera for `AUTO_INCREMENT` inserts from several nodes |
/// | `wsrep_sync_wait` | `0` (the default) on the layer's pool | the claim does not need it (above); see below for your own reads |
/// | `evs.suspect_timeout` (in `wsrep_provider_options`) | `PT5S` (the default) | how long commits stall when a node dies: keep the layer's deadline above it |
/// | `.deadline(..)` on the layer | 10 s (the default) | above the stall, so requests waiting through it still get their answer |
/// | the pool's `acquire_timeout` | below the deadline (3 s in the test) | a request waiting for a connection through the stall gets a retryable answer in time |
///
/// **`wsrep_sync_wait`** makes a statement wait until its node has applied everything the
/// cluster committed before it. The layer needs no such wait: a claim that misses another
/// node's record is caught at certification (above). Your own reads may need it: a
/// `GET /orders/{id}` sent to node B right after node A answered the `POST` finds nothing
/// until B has applied A's commit. Set it for those reads only, on the connection that makes
/// them (`SET SESSION wsrep_sync_wait = 1`, or a separate read pool with `after_connect`).
/// Setting it on every session of the layer's pool is not wrong, but buys little: measured,
/// fewer handler runs per duplicate (36–37 instead of 40–55 for 240 requests on 30 keys),
/// and every read waits for its node to catch up.
///
/// **The record and `COMMIT` are two commands.** On MariaDB 10.11 with galera-4, a `COMMIT`
/// sent in one multi-statement query with the statement before it was sometimes answered OK
/// for a transaction the cluster had aborted (about one contended storm in a hundred): the
/// client got a `201` whose writes were gone. The store therefore sends `COMMIT` on its own,
/// where the abort is reported (1213) and the layer runs the request again. Do the same in
/// your own code on Galera: never end a transaction with `…; COMMIT` in one query.
///
/// # `migrate` on a cluster
///
/// `migrate` serialises instances with `GET_LOCK`, which on Galera holds on one node only.
/// Instances starting at once through different nodes can therefore collide: on a version
/// row (a certification abort, 1213, or a duplicate key, 1062) or on the claim procedure,
/// created by another instance between this one's `DROP PROCEDURE IF EXISTS` and its
/// `CREATE PROCEDURE` (1304). `migrate` then runs again (up to six times, with jittered
/// pauses) and finds the versions the other instance recorded; the scripts are safe to run
/// twice. Measured with three instances migrating at once through three nodes: in each run
/// two of them collided and ran again, and all three succeeded.
///
/// # A node lost
///
/// With three nodes, losing one leaves a majority (a primary component) and the two others
/// go on; with two nodes, losing one stops both, so run three, or two and the arbitrator
/// `garbd`. Until the group has evicted the dead node, commits on the others wait:
/// `evs.suspect_timeout` (5 s by default). Measured with one of three nodes killed with
/// SIGKILL under load (90 keys started 25 ms apart, each client retrying retryable answers
/// with the same key at the next node every 100 ms): commits stalled 5.5–5.9 s; the instance
/// on the dead node answered `500 idempotency_internal_error` at once, the others answered
/// their waiting requests when the stall ended or `500` when the pool's acquire timeout
/// ran out first; every answer before a key's `201` was retryable, no key needed more than
/// three tries, the last key was final 7.7 s after the kill, and each of the 90 keys had
/// exactly one order. A commit acknowledged before the kill was certified by the cluster and
/// stays on the surviving nodes.
pub mod clusters {}

/// # What is proven
///
/// Tests and fault runs sample timings; a model checker explores all of them, up to a bound.
/// The repository's `src/model` holds a model of the protocol, explored by
/// [stateright](https://docs.rs/stateright) on every CI run. It is not a second description
/// of the protocol beside the code: the decisions it explores are the crate's own functions
/// (what a record a claim found means, how an answer ends its transaction, when a message is
/// sent, looked up, retried, paused or given up, when a delivery is retried or dead-lettered),
/// which the engine, the dispatcher and the inbox call too. A change to a decision changes
/// what the checker explores.
///
/// ## The models
///
/// - **Requests.** Clients send one intent with one key and retry it after any answer that is
///   not final, or after losing the connection; two app instances claim, run and record it; a
///   record expires at the end of its retention. Faults at every step: an instance crashes
///   (before the claim, after it, before the commit, after it, before the answer), a client
///   drops its connection, a lock wait runs out (409), the work answers retryable, the
///   database aborts the transaction on a conflict.
/// - **The outbox.** Messages committed with the business rows, some sharing an ordering key;
///   two dispatchers that claim with a lease, send, look up an unknown outcome and settle; a
///   downstream that deduplicates by the message's key within its retention. Faults: a
///   dispatcher crashes at any step (during a send too), a lease runs out and the other
///   dispatcher takes the message over, a send's outcome is unknown, the destination is
///   unreachable, or refuses the message for good. A commit that hands its message to a
///   dispatcher of its own process (written leased to it, its attempt begun) leaves the row
///   exactly as that dispatcher's claim would right after the commit, one of the orders
///   explored; messages with an ordering key are never handed over, since only a claim checks
///   their key's order. A delivery's follow-ups are new messages, committed with the settle
///   that records it delivered, and keyed by it so that finding the delivery again adds none;
///   follow-ups the sender cannot make leave the outcome unknown, one of the outcomes
///   explored.
/// - **The inbox.** A broker that redelivers until acknowledged; two consumers that claim the
///   business key in the handler's transaction and acknowledge after the commit. Faults: a
///   consumer crashes at any step (after the commit, before the acknowledgement too), its
///   database is unreachable, the handler fails, the database aborts on a conflict, a wait
///   for the key's lock runs out. It is explored twice: on a database with a lock per key,
///   and on one with a single write lock (SQLite), where a wait that runs out is an outage.
///
/// ## Properties
///
/// Each is checked in every state the bounds reach, and each has a deliberately broken
/// variant of the decisions, selected in a test, for which the checker must find a
/// counterexample (the test prints its trace): a property that cannot fail proves nothing.
///
/// | property | broken variant the checker refutes |
/// |---|---|
/// | at most one committed execution per scoped key within retention | a claim that checks, then inserts |
/// | a replay is identical to the first answer | a final refusal recorded by overwriting the key's record |
/// | a record exists if and only if its business writes committed | the record written in a transaction of its own |
/// | never a record for a rolled-back attempt | a retryable failure recorded like a final refusal |
/// | a duplicate never starts the business while the first is at work | a claim without the key's lock |
/// | every intent is answered once faults stop | an in-flight record committed apart from the work |
/// | at most one downstream effect per downstream key | a resend without a lookup after an unknown outcome, to a downstream that does not deduplicate |
/// | a key's messages take effect in commit order | a claim that ignores the key's message still in flight |
/// | a message that failed for good holds its key's later messages | a claim that passes over it |
/// | a recorded delivery is final | a settle without its lease-token check: a stalled dispatcher's stale outcome overwrites a delivery |
/// | every message is delivered once faults stop; none fails for an outage | an outage counted as an attempt |
/// | each business key is applied once by the inbox | the dedupe key checked before the handler and inserted after its commit |
/// | a valid message is never dead-lettered for an outage | an outage counted as an attempt; on one write lock, a lock wait that ran out counted as one |
/// | every valid message ends applied and acknowledged once faults stop | an acknowledgement before the commit |
///
/// Two more explorations pin the outbox's assumptions: a downstream whose retention is
/// shorter than the time budget takes a late resend's effect twice, and against a downstream
/// that does not deduplicate, lookups alone keep each message to one effect only while no
/// dispatcher stalls past its lease (a stalled dispatcher's late send takes effect again).
///
/// ## Assumptions
///
/// What the crate trusts and the models take as given:
///
/// - **The database** runs transactions atomically and durably: a commit is all or nothing and
///   stays committed; the key's lock (SQLite's write lock, PostgreSQL's advisory lock,
///   MySQL's row lock) is held by the claiming transaction until it ends, and a crashed
///   client's transaction is rolled back and its lock freed.
/// - **The broker** delivers a message at least once and redelivers what was not
///   acknowledged; what it acknowledged to a publisher it keeps (the inbox chapter's "What a
///   broker's acknowledgement survives" says when that holds).
/// - **The downstream** deduplicates by the key the outbox sends, for longer than the
///   outbox's time budget, and answers a lookup truthfully.
/// - **The clock** moves forward; leases and budgets are compared against it. Clock skew
///   between instances larger than a lease is outside the model.
///
/// ## Bounds
///
/// The default exploration is part of `cargo test` and takes about twenty seconds in a debug
/// build:
///
/// | model | bounds | unique states |
/// |---|---|---:|
/// | requests | 2 clients, 2 instances, 2 faults, 1 expiry | 78,334 |
/// | outbox | 2 messages of one ordering key, 2 dispatchers, 2 faults, 2 outages | 609,433 |
/// | outbox, time past the budget | as above, a budget of a few ticks | 188,017 |
/// | outbox, no ordering key | 2 messages without a key, 2 dispatchers, 1 fault, 1 outage | 124,169 |
/// | outbox, refusals | as the outbox, and the downstream may refuse a message for good | 1,153,722 |
/// | inbox | 2 consumers, 2 messages (one business key twice, or one that never applies), 3 faults, 1 replay | 561,182 |
/// | inbox, one write lock | as above, on a database with one write lock (SQLite) | 500,299 |
///
/// A deeper run, with more clients and faults (three clients and three faults for requests,
/// three faults for the outbox, four for the inbox: 68 million unique states in all, 30
/// million of them the outbox with refusals) explores for about three and a half minutes in a
/// release build on two cores, in a few gigabytes of memory:
///
/// ```text
/// MODEL_DEPTH=deep cargo test --release --all-features --lib model -- --nocapture
/// ```
///
/// Each model prints the states it explored and how long it took.
///
/// ## What the exploration found
///
/// No counterexample in the crate's decisions. Two behaviours it showed are by design and
/// worth knowing: an inbox delivery that waited for the same business key's other delivery
/// until the wait ran out spends an attempt (except on SQLite, where any writer may hold the
/// one write lock and a wait that runs out is an outage), and so does a delivery the broker
/// lost track of (a closed channel), since a broker's delivery count cannot tell that from a
/// consumer's crash. Neither loses an effect (the key is applied through its other delivery, or the
/// delivery runs again), but with a low `max_attempts` either can dead-letter a valid message
/// sooner than that many real failures would.
///
/// ## Outside the models
///
/// - Byzantine clients: a client that sends another intent under the same key is answered 422,
///   but a client that lies about its identity is your authentication's concern.
/// - A database that loses committed data (an asynchronous standby promoted; see
///   [`failover`]), or a broker that loses an acknowledged publish.
/// - A downstream that forgets keys before the outbox's time budget has run out: a late resend
///   is then a second effect; keep the budget shorter than its retention (the outbox chapter says
///   how).
/// - Liveness under endless faults: the models prove that intents complete once faults stop,
///   not while a dependency stays down.
pub mod proven {}
