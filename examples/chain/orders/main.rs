//! An order API made safe to retry: `cargo run --example orders`.
//!
//! Settings: `DATABASE_URL` (an SQLite file by default; `postgres://…` with `--features
//! postgres`, `mysql://…` with `--features mysql`), `BIND` (default 127.0.0.1:3000),
//! `IDEMPOTENCY_TTL_SECS` (how long keys live, default 24 h) and `DATABASE_MAX_CONNECTIONS`
//! (default 20: the consumer's 16 deliveries at once leave 4 to the API).
//! `BROKER_URL=amqp://…` (`--features rabbitmq`) or `nats://…` (`--features nats`) also
//! consumes payment events and applies each payment once (see `consumer.rs`).
//!
//! It stops on SIGTERM (what Kubernetes and systemd send) as on Ctrl-C: it stops accepting,
//! answers every request already in flight, then exits 0. A connection whose request head
//! takes over 5 s is closed. The README's "Try it" section is a session to paste.
//!
//! `POST /orders` (an `Idempotency-Key` required) answers `201` with the order and its `Location`.
//! Its refusals are final, so the layer stores and replays them under the key, and are problem+json
//! with a `code` of the example's own: `400 invalid_order` when the quantity is below 1, the amount
//! is not a positive number of whole cents below 10000000000000, the currency is not 1 to 8
//! printable characters, the sku is not exactly one of the catalog's (`widget`, `gadget`: no other
//! case, no spaces), or a field is missing or of the wrong type. A control character (NUL, a
//! newline, an escape, DEL or a C1 control) in the currency or the sku is refused so on every
//! backend alike, before any SQL: never a retryable 500, never stored and echoed back. A body that
//! is not JSON is `400 malformed_json`, one without a JSON content type
//! `415 unsupported_media_type`, and an order the stock cannot cover `409 out_of_stock`.
//! An id in a path that is not an integer is `400 invalid_id`; an order of another user, or none,
//! `404 not_found`. These answers, the payments example's and their problem shape (`title` the
//! status's reason phrase) are one rule, in `common/mod.rs`.
//!
//! Amounts are read digit for digit as the JSON number sent, never as a float (so
//! `0.1000000000000000001` is finer than a cent, not `0.1`), and kept in cents; every answer
//! writes them in one form, whatever form they came in: `12.5`, `12.05`, `10.0` for `10`, `12.50`
//! or `1e1`, as the payments example does.

#[path = "../common/mod.rs"]
#[allow(dead_code, reason = "shared by the examples, each using part of it")]
mod common;
#[cfg(any(feature = "rabbitmq", feature = "nats"))]
mod consumer;
mod db;

use std::borrow::Cow;
use std::time::Duration;

use axum::extract::rejection::{JsonRejection, PathRejection};
use axum::extract::{FromRequestParts, Path};
use axum::http::{Method, StatusCode, header, request::Parts};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Extension, Json, Router};
use axum_idempotency::{IdempotencyLayer, Principal, Store, Tx};
use common::{Cents, Decimal, Error, Problem, serve, setting};
use db::Arg::{Int, Text};
use db::Backend;
use serde::Deserialize;
use serde_json::json;
use sqlx::pool::PoolOptions;
use sqlx::{Connection, Pool};

#[tokio::main]
async fn main() -> Result<(), Error> {
    common::init_logging();
    let app = common::on_database!("sqlite://orders.db", app())?;
    serve(app, "127.0.0.1:3000", "orders example").await
}

/// Connects to the database, creates the example's tables, and returns the routes behind the
/// idempotency layer; with `BROKER_URL` set it also starts the payment consumer.
async fn app<DB: Backend>(
    database: <DB::Connection as Connection>::Options,
) -> Result<Router, Error> {
    let pool_size = setting("DATABASE_MAX_CONNECTIONS", 20)?;
    // A connection is waited for at most 3 s, well within the layer's 10 s deadline: with the
    // database down or the pool run dry, a request fails fast and retryably.
    let pool = PoolOptions::<DB>::new()
        .max_connections(pool_size)
        .acquire_timeout(Duration::from_secs(3))
        .connect_with(database)
        .await?;
    DB::create_tables(&pool).await?;
    let store = Store::new(pool.clone());
    store.migrate().await?;
    store.spawn_purger(Duration::from_secs(60));
    if let Ok(broker) = std::env::var("BROKER_URL")
        && !broker.is_empty()
    {
        // The consumer claims payment ids in the same store as the HTTP keys: one claim path.
        #[cfg(any(feature = "rabbitmq", feature = "nats"))]
        consumer::spawn(store.clone(), &broker).await?;
        #[cfg(not(any(feature = "rabbitmq", feature = "nats")))]
        return Err("BROKER_URL needs --features rabbitmq or nats".into());
    }
    // Keys are scoped to the user the bearer token proves, never to a header the client
    // asserts. The layer hands that user to keyed handlers (`Extension<AuthUser>`), so they
    // never look it up again on a second connection while the claim holds one. Claims leave
    // two connections free for authentication and reads during a burst.
    let retention = Duration::from_secs(setting("IDEMPOTENCY_TTL_SECS", 24 * 3600)?);
    let idempotency = IdempotencyLayer::new(store)
        .principal_with_state::<AuthUser, _>(pool.clone())
        .max_concurrent_claims(pool_size.saturating_sub(2).max(1) as usize)
        .deadline(Duration::from_secs(10))
        .retention(retention)
        .wait_for_in_flight(Duration::from_secs(5))
        .ignore_json_fields(["/request_time", "/trace_id"]);
    let routes = Router::new()
        .route("/orders", post(create_order::<DB>).get(list_orders::<DB>))
        .route("/orders/{id}", get(get_order::<DB>))
        .route("/orders/{id}/ship", post(ship_order::<DB>))
        // Likes need no key: the unique (user, article) pair is the natural idempotency key.
        .route("/articles/{id}/like", put(like::<DB>).delete(like::<DB>));
    Ok(routes.route_layer(idempotency).with_state(pool))
}

/// A caller proven by `Authorization: Bearer <token>` against the users table.
///
/// Extracting it takes a connection from the pool, so handlers of keyed routes take the one the
/// idempotency layer extracted (`Extension<AuthUser>`) instead.
#[derive(Clone, Copy)]
struct AuthUser {
    id: i64,
}

impl Principal for AuthUser {
    fn principal_id(&self) -> Cow<'_, str> {
        Cow::Owned(self.id.to_string())
    }
}

impl<DB: Backend> FromRequestParts<Pool<DB>> for AuthUser {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, pool: &Pool<DB>) -> Result<Self, Problem> {
        let header = parts.headers.get(header::AUTHORIZATION);
        let token = header.and_then(|value| value.to_str().ok()?.strip_prefix("Bearer "));
        let token = token.ok_or(UNAUTHORIZED)?;
        let sql = "SELECT id FROM users WHERE token = ?";
        let id = DB::int(&mut *pool.acquire().await?, sql, &[Text(token)]).await?;
        id.map(|id| AuthUser { id }).ok_or(UNAUTHORIZED)
    }
}

#[derive(Deserialize)]
struct OrderRequest {
    sku: String,
    quantity: i64,
    /// Read as written, not as a float, and kept in cents: see `Cents::parse`.
    amount: Decimal,
    currency: String,
}

async fn create_order<DB: Backend>(
    Extension(user): Extension<AuthUser>,
    mut tx: Tx<DB>,
    order: Result<Json<OrderRequest>, JsonRejection>,
) -> Result<Response, Problem> {
    let Json(order) = order?;
    if order.quantity < 1 {
        return Err(invalid("quantity must be at least 1"));
    }
    let amount = Cents::parse(&order.amount).filter(|amount| amount.0 > 0);
    let amount = amount.ok_or(invalid(
        "amount must be a positive number with at most two decimals, below 10000000000000",
    ))?;
    // What a column cannot hold is refused here, finally: in the database it would fail as a
    // 5xx, which the client would retry forever. The catalog is checked here too, so a sku
    // matches exactly on every backend (MySQL's default collation ignores case and spaces).
    let currency = order.currency.as_str();
    if currency.is_empty() || currency.chars().count() > 8 || currency.contains(char::is_control) {
        return Err(invalid("currency must be 1 to 8 printable characters"));
    }
    if !["widget", "gadget"].contains(&order.sku.as_str()) {
        return Err(invalid("unknown sku"));
    }
    let (sku, quantity) = (Text(&order.sku), Int(order.quantity));
    let take = "UPDATE products SET stock = stock - ? WHERE sku = ? AND stock >= ?";
    if DB::execute(&mut tx, take, &[quantity, sku, quantity]).await? == 0 {
        return Err(OUT_OF_STOCK);
    }
    let insert = "INSERT INTO orders (user_id, status, sku, quantity, amount, currency) \
        VALUES (?, 'created', ?, ?, ?, ?) RETURNING id";
    let args = [Int(user.id), sku, quantity, Int(amount.0), Text(currency)];
    let id = DB::int(&mut tx, insert, &args).await?;
    let id = id.ok_or(sqlx::Error::RowNotFound)?;
    // Read back as `GET /orders/{id}` shows it: one shape for both answers.
    let order = db::orders::<DB>(&mut tx, user.id, (id, id)).await?.pop();
    let order = order.ok_or(sqlx::Error::RowNotFound)?;
    let location = [(header::LOCATION, format!("/orders/{id}"))];
    Ok((StatusCode::CREATED, location, Json(order)).into_response())
}

async fn list_orders<DB: Backend>(user: AuthUser, mut tx: Tx<DB>) -> Result<Response, Problem> {
    let orders = db::orders::<DB>(&mut tx, user.id, (1, i64::MAX)).await?;
    Ok(Json(orders).into_response())
}

async fn get_order<DB: Backend>(
    user: AuthUser,
    mut tx: Tx<DB>,
    id: Result<Path<i64>, PathRejection>,
) -> Result<Response, Problem> {
    let Path(id) = id?;
    let order = db::orders::<DB>(&mut tx, user.id, (id, id)).await?.pop();
    Ok(Json(order.ok_or(NOT_FOUND)?).into_response())
}

async fn ship_order<DB: Backend>(
    Extension(user): Extension<AuthUser>,
    mut tx: Tx<DB>,
    id: Result<Path<i64>, PathRejection>,
) -> Result<Response, Problem> {
    let Path(id) = id?;
    let ship = "UPDATE orders SET status = 'shipped' WHERE user_id = ? AND id = ?";
    if DB::execute(&mut tx, ship, &[Int(user.id), Int(id)]).await? == 0 {
        return Err(NOT_FOUND);
    }
    get_order(user, tx, Ok(Path(id))).await
}

/// `PUT` likes the article, `DELETE` takes the like back.
async fn like<DB: Backend>(
    method: Method,
    user: AuthUser,
    mut tx: Tx<DB>,
    article_id: Result<Path<i64>, PathRejection>,
) -> Result<Response, Problem> {
    let Path(article_id) = article_id?;
    let liked = method == Method::PUT;
    let unlike = "DELETE FROM likes WHERE user_id = ? AND article_id = ?";
    let change = if liked { DB::ADD_LIKE } else { unlike };
    DB::execute(&mut tx, change, &[Int(user.id), Int(article_id)]).await?;
    let count = "SELECT COUNT(*) FROM likes WHERE article_id = ?";
    let likes = DB::int(&mut tx, count, &[Int(article_id)]).await?;
    Ok(Json(json!({ "article_id": article_id, "liked": liked, "likes": likes })).into_response())
}

const UNAUTHORIZED: Problem = Problem::Refused(
    StatusCode::UNAUTHORIZED,
    "unauthorized",
    "a valid bearer token is required",
);
const OUT_OF_STOCK: Problem = Problem::Refused(
    StatusCode::CONFLICT,
    "out_of_stock",
    "not enough stock left for this order",
);
const NOT_FOUND: Problem = Problem::Refused(StatusCode::NOT_FOUND, "not_found", "no such order");

/// A final 400: the same request will never succeed, so it is stored and replayed.
fn invalid(detail: &'static str) -> Problem {
    Problem::Refused(StatusCode::BAD_REQUEST, "invalid_order", detail)
}

impl From<JsonRejection> for Problem {
    fn from(rejection: JsonRejection) -> Self {
        let fields = "the order needs sku, quantity, amount and currency of the right types";
        Problem::body(
            rejection,
            "send the order as application/json",
            invalid(fields),
        )
    }
}
