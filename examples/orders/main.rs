//! An order API made safe to retry: `cargo run --example orders`.
//!
//! Settings: `DATABASE_URL` (an SQLite file by default; `postgres://…` with `--features
//! postgres`, `mysql://…` with `--features mysql`), `BIND` (default 127.0.0.1:3000),
//! `IDEMPOTENCY_TTL_SECS` (how long keys live, default 24 h) and `DATABASE_MAX_CONNECTIONS`
//! (default 10). `BROKER_URL=amqp://…` (`--features rabbitmq`) or `nats://…` (`--features
//! nats`) also consumes payment events and applies each payment once (see `consumer.rs`).
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
use axum_idempotency::{IdempotencyLayer, Principal, Store, Tx, TxError};
use db::Arg::{Int, Text};
use db::{Backend, Cents};
use serde::Deserialize;
use serde_json::json;
use sqlx::pool::PoolOptions;
use sqlx::{Connection, Pool};
use tokio::signal::unix::{SignalKind, signal};

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env();
    let filter = filter.unwrap_or_else(|_| "info".into());
    tracing_subscriber::fmt().with_env_filter(filter).init();
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "sqlite://orders.db".into());
    let app = match url.split(':').next().unwrap_or_default() {
        "sqlite" => {
            use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode};
            let options = url.parse::<SqliteConnectOptions>()?.create_if_missing(true);
            app::<sqlx::Sqlite>(options.journal_mode(SqliteJournalMode::Wal)).await?
        }
        #[cfg(feature = "postgres")]
        "postgres" | "postgresql" => app::<sqlx::Postgres>(url.parse()?).await?,
        #[cfg(feature = "mysql")]
        "mysql" | "mariadb" => app::<sqlx::MySql>(url.parse()?).await?,
        other => {
            return Err(format!("DATABASE_URL {other:?} is not built in (see --features)").into());
        }
    };
    serve(app).await
}

/// Connects to the database, creates the example's tables, and returns the routes behind the
/// idempotency layer; with `BROKER_URL` set it also starts the payment consumer.
async fn app<DB: Backend>(
    database: <DB::Connection as Connection>::Options,
) -> Result<Router, Error> {
    let pool_size = setting("DATABASE_MAX_CONNECTIONS", 10)?;
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

/// Serves `app` on `BIND` until SIGTERM or Ctrl-C, then answers the requests in flight.
async fn serve(app: Router) -> Result<(), Error> {
    // Listening for signals before the address is printed: a signal sent as soon as the
    // server is up is never met by the default action (an abrupt exit).
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let handle = axum_server::Handle::new();
    let stop = handle.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = terminate.recv() => {}
            _ = interrupt.recv() => {}
        }
        stop.graceful_shutdown(None);
    });
    let bind = std::env::var("BIND").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let listener = std::net::TcpListener::bind(&bind)?;
    let address = listener.local_addr()?;
    println!("orders example listening on http://{address}");
    // axum-server, because `axum::serve` has no header read timeout: a client that never
    // finishes its request head would hold its connection for ever. A failed accept (out of
    // file descriptors, say) only pauses the accept loop.
    let mut server = axum_server::from_tcp(listener)?
        .http1_only()
        .handle(handle)
        .accept_error_handler(|_, error| tracing::warn!(%error, "could not accept a connection"));
    let timeout = Duration::from_secs(5);
    server.http_builder().http1().header_read_timeout(timeout);
    Ok(server.serve(app.into_make_service()).await?)
}

/// The setting `name`, or `default` when unset; a value that does not parse stops the example.
fn setting<T: std::str::FromStr>(name: &str, default: T) -> Result<T, Error>
where
    T::Err: std::error::Error + Send + Sync + 'static,
{
    std::env::var(name).map_or(Ok(default), |value| Ok(value.parse()?))
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
    amount: serde_json::Number,
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

/// What a handler answers instead of its result.
enum Problem {
    /// The example's own refusals (status, `code`, detail), as problem+json like the crate's.
    /// Their `code`s never start with `idempotency_` and their `type` is `about:blank`, so a
    /// client tells them from the crate's answers without reading the status alone.
    Refused(StatusCode, &'static str, &'static str),
    /// A statement failed. The layer runs a conflict abort again; anything else is a retryable
    /// 500, its details logged, never shown.
    Database(TxError),
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
fn bad_request(code: &'static str, detail: &'static str) -> Problem {
    Problem::Refused(StatusCode::BAD_REQUEST, code, detail)
}

fn invalid(detail: &'static str) -> Problem {
    bad_request("invalid_order", detail)
}

impl From<JsonRejection> for Problem {
    /// A body that parses but does not fit is 400 like any other invalid order, never axum's
    /// 422, which a client reading only the status would take for a reused key.
    fn from(rejection: JsonRejection) -> Self {
        match rejection {
            JsonRejection::MissingJsonContentType(_) => Problem::Refused(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                "send the order as application/json",
            ),
            JsonRejection::JsonDataError(_) => {
                invalid("the order needs sku, quantity, amount and currency of the right types")
            }
            _ => bad_request("malformed_json", "the body is not valid JSON"),
        }
    }
}

impl From<PathRejection> for Problem {
    fn from(_: PathRejection) -> Self {
        bad_request("invalid_id", "the id must be an integer")
    }
}

impl From<sqlx::Error> for Problem {
    fn from(error: sqlx::Error) -> Self {
        Problem::Database(error.into())
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let (status, code, detail) = match self {
            Problem::Refused(status, code, detail) => (status, code, detail),
            Problem::Database(error) => return error.into_response(),
        };
        let title = status.canonical_reason();
        let body = json!({ "type": "about:blank", "title": title, "status": status.as_u16(),
            "code": code, "detail": detail });
        let content_type = (header::CONTENT_TYPE, "application/problem+json");
        (status, [content_type], body.to_string()).into_response()
    }
}
