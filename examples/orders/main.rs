//! An order API made safe to retry: `cargo run --example orders`.
//!
//! SQLite file by default; `DATABASE_URL=postgres://…` (built with `--features postgres`) or
//! `mysql://…` (`--features mysql`) switches the backend. `BIND` sets the address (default
//! 127.0.0.1:3000), `IDEMPOTENCY_TTL_SECS` the retention of keys (default 24 h),
//! `DATABASE_MAX_CONNECTIONS` the pool's size (default 10).
//! `BROKER_URL=amqp://…` (`--features rabbitmq`) or `nats://…` (`--features nats`) also
//! consumes payment events and applies each payment once (see `consumer.rs`).
//!
//! It stops on SIGTERM (what Kubernetes and systemd send) as on Ctrl-C: it stops accepting,
//! answers every request already in flight, then exits 0.
//!
//! ```text
//! curl -i -X POST localhost:3000/orders -H 'authorization: Bearer alice-token' \
//!   -H 'idempotency-key: 9b1deb4d-3b7d-4bad-9bdd-2b0d7b3dcb6d' -H 'content-type: application/json' \
//!   -d '{"sku":"widget","quantity":2,"amount":12.5,"currency":"EUR"}'
//! ```

#[cfg(feature = "inbox")]
mod consumer;
mod db;

use std::borrow::Cow;
use std::time::Duration;

use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequestParts, Path};
use axum::http::{StatusCode, header, request::Parts};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Extension, Json, Router};
use axum_idempotency::{IdempotencyLayer, Principal, SqliteStore, Store, Tx};
use db::{NewOrder, Order, OrdersDb, StockError};
use serde::Deserialize;
use serde_json::json;
use sqlx::Pool;
use sqlx::pool::PoolOptions;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "sqlite://orders.db".into());
    let bind = std::env::var("BIND").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let ttl = match std::env::var("IDEMPOTENCY_TTL_SECS") {
        Ok(secs) => Duration::from_secs(secs.parse()?),
        Err(_) => Duration::from_secs(24 * 3600),
    };

    let pool_size = match std::env::var("DATABASE_MAX_CONNECTIONS") {
        Ok(size) => size.parse()?,
        Err(_) => 10,
    };
    let broker = std::env::var("BROKER_URL")
        .ok()
        .filter(|url| !url.is_empty());
    let broker = broker.as_deref();

    let app = match url.split(':').next().unwrap_or_default() {
        "sqlite" => {
            use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode};
            let options = url
                .parse::<SqliteConnectOptions>()?
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal);
            let pool = pool_options::<sqlx::Sqlite>(pool_size)
                .connect_with(options)
                .await?;
            let store = SqliteStore::new(pool.clone());
            store.migrate().await?;
            store.spawn_purger(PURGE_EVERY);
            app(pool, store, pool_size, ttl, broker).await?
        }
        #[cfg(feature = "postgres")]
        "postgres" | "postgresql" => {
            let pool = pool_options::<sqlx::Postgres>(pool_size)
                .connect(&url)
                .await?;
            let store = axum_idempotency::PgStore::new(pool.clone());
            store.migrate().await?;
            store.spawn_purger(PURGE_EVERY);
            app(pool, store, pool_size, ttl, broker).await?
        }
        #[cfg(feature = "mysql")]
        "mysql" | "mariadb" => {
            let pool = pool_options::<sqlx::MySql>(pool_size).connect(&url).await?;
            let store = axum_idempotency::MySqlStore::new(pool.clone());
            store.migrate().await?;
            store.spawn_purger(PURGE_EVERY);
            app(pool, store, pool_size, ttl, broker).await?
        }
        other => {
            return Err(
                format!("DATABASE_URL scheme {other:?} is not built in (see --features)").into(),
            );
        }
    };

    let shutdown = shutdown_signal()?;
    let listener = tokio::net::TcpListener::bind(&bind).await?;
    println!(
        "orders example listening on http://{}",
        listener.local_addr()?
    );
    // Requests in flight when the signal comes are answered before the process exits.
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await?;
    Ok(())
}

/// Listens for SIGTERM (what Kubernetes and systemd send) and SIGINT (Ctrl-C) from now on; the
/// future resolves on the first of them. Registered before the address is printed, so a signal
/// sent as soon as the server is up is never met by the default action (an abrupt exit).
fn shutdown_signal() -> std::io::Result<impl Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = terminate.recv() => {}
            _ = interrupt.recv() => {}
        }
    })
}

/// The pool every backend uses. A connection is waited for at most three seconds, well within
/// the idempotency layer's ten-second deadline: when the database is down or the pool has run
/// dry, the request fails fast with a retryable answer instead of hanging.
fn pool_options<DB: sqlx::Database>(size: u32) -> PoolOptions<DB> {
    PoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(3))
}

/// How often expired idempotency records are deleted.
const PURGE_EVERY: Duration = Duration::from_secs(60);

/// The whole app for one backend: schema, idempotency layer, routes.
async fn app<DB>(
    pool: Pool<DB>,
    store: Store<DB>,
    pool_size: u32,
    ttl: Duration,
    broker: Option<&str>,
) -> Result<Router, Box<dyn std::error::Error>>
where
    DB: OrdersDb,
{
    DB::create_schema(&pool).await?;
    if let Some(broker) = broker {
        // The consumer claims payment ids in the same store as the HTTP keys: one claim path.
        #[cfg(feature = "inbox")]
        consumer::spawn(store.clone(), broker).await?;
        #[cfg(not(feature = "inbox"))]
        return Err(format!(
            "BROKER_URL ({} bytes) needs --features rabbitmq or nats",
            broker.len()
        )
        .into());
    }
    let state = AppState { pool };

    // Keys are scoped to the user the bearer token proves, never to a header the client asserts.
    // The layer hands that user to keyed handlers (`Extension<AuthUser>`), so they never look
    // it up again on a second connection while the claim holds one. Claims leave two
    // connections free for authentication and reads during a burst.
    let idempotency = IdempotencyLayer::new(store)
        .principal_with_state::<AuthUser, _>(state.clone())
        .max_concurrent_claims(pool_size.saturating_sub(2).max(1) as usize)
        .deadline(Duration::from_secs(10))
        .retention(ttl)
        .wait_for_in_flight(Duration::from_secs(5))
        .ignore_json_fields(["/request_time", "/trace_id"]);

    Ok(Router::new()
        .route("/orders", post(create_order::<DB>).get(list_orders::<DB>))
        .route("/orders/{id}", get(get_order::<DB>))
        .route("/orders/{id}/ship", post(ship_order::<DB>))
        // Likes need no key: the unique (user, article) pair is the natural idempotency key.
        .route("/articles/{id}/like", put(like::<DB>).delete(unlike::<DB>))
        .route_layer(idempotency)
        .with_state(state))
}

struct AppState<DB: sqlx::Database> {
    pool: Pool<DB>,
}

impl<DB: sqlx::Database> Clone for AppState<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
        }
    }
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

impl<DB: OrdersDb> FromRequestParts<AppState<DB>> for AuthUser {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState<DB>) -> Result<Self, ApiError> {
        let token = parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.strip_prefix("Bearer "))
            .ok_or(ApiError::Unauthorized)?;
        match DB::user_by_token(&state.pool, token).await? {
            Some(id) => Ok(AuthUser { id }),
            None => Err(ApiError::Unauthorized),
        }
    }
}

#[derive(Deserialize)]
struct OrderRequest {
    sku: String,
    quantity: i64,
    amount: f64,
    currency: String,
}

async fn create_order<DB: OrdersDb>(
    Extension(user): Extension<AuthUser>,
    mut tx: Tx<DB>,
    request: Result<Json<OrderRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(request) = request?;
    if request.quantity < 1 {
        return Err(ApiError::InvalidOrder("quantity must be at least 1"));
    }
    if !(request.amount.is_finite() && request.amount > 0.0) {
        return Err(ApiError::InvalidOrder("amount must be a positive number"));
    }
    DB::take_stock(&mut tx, &request.sku, request.quantity)
        .await
        .map_err(|e| match e {
            StockError::UnknownSku => ApiError::InvalidOrder("unknown sku"),
            StockError::OutOfStock => ApiError::OutOfStock,
            StockError::Db(e) => ApiError::Db(e),
        })?;
    let order = NewOrder {
        user_id: user.id,
        sku: &request.sku,
        quantity: request.quantity,
        amount: request.amount,
        currency: &request.currency,
    };
    let order = DB::insert_order(&mut tx, &order).await?;
    let location = format!("/orders/{}", order.id);
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(order),
    )
        .into_response())
}

async fn list_orders<DB: OrdersDb>(
    user: AuthUser,
    mut tx: Tx<DB>,
) -> Result<Json<Vec<Order>>, ApiError> {
    Ok(Json(DB::orders_of(&mut tx, user.id).await?))
}

async fn get_order<DB: OrdersDb>(
    user: AuthUser,
    mut tx: Tx<DB>,
    Path(id): Path<i64>,
) -> Result<Json<Order>, ApiError> {
    DB::order_of(&mut tx, user.id, id)
        .await?
        .map(Json)
        .ok_or(ApiError::NotFound)
}

async fn ship_order<DB: OrdersDb>(
    Extension(user): Extension<AuthUser>,
    mut tx: Tx<DB>,
    Path(id): Path<i64>,
) -> Result<Json<Order>, ApiError> {
    if !DB::ship(&mut tx, user.id, id).await? {
        return Err(ApiError::NotFound);
    }
    DB::order_of(&mut tx, user.id, id)
        .await?
        .map(Json)
        .ok_or(ApiError::NotFound)
}

async fn like<DB: OrdersDb>(
    user: AuthUser,
    tx: Tx<DB>,
    Path(id): Path<i64>,
) -> Result<Response, ApiError> {
    set_like(user, tx, id, true).await
}

async fn unlike<DB: OrdersDb>(
    user: AuthUser,
    tx: Tx<DB>,
    Path(id): Path<i64>,
) -> Result<Response, ApiError> {
    set_like(user, tx, id, false).await
}

async fn set_like<DB: OrdersDb>(
    user: AuthUser,
    mut tx: Tx<DB>,
    article_id: i64,
    liked: bool,
) -> Result<Response, ApiError> {
    let likes = DB::set_like(&mut tx, user.id, article_id, liked).await?;
    Ok(Json(json!({ "article_id": article_id, "liked": liked, "likes": likes })).into_response())
}

/// The example's own errors, as problem+json like the crate's rejections. Their `code`s never
/// start with `idempotency_`, and their `type` is `about:blank`, so a client tells them from
/// the crate's answers without reading the status alone.
enum ApiError {
    Unauthorized,
    InvalidOrder(&'static str),
    /// The body was not a JSON order: axum's `Json` rejection, re-dressed as problem+json.
    BadBody(JsonRejection),
    OutOfStock,
    NotFound,
    Db(sqlx::Error),
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        Self::BadBody(rejection)
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        Self::Db(e)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, code, detail) = match self {
            Self::Unauthorized => (
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "a valid bearer token is required",
            ),
            Self::InvalidOrder(detail) => (StatusCode::BAD_REQUEST, "invalid_order", detail),
            // A body that parses but does not fit is 400 like any other invalid order, never
            // axum's 422, which a client reading only the status would take for a reused key.
            Self::BadBody(JsonRejection::MissingJsonContentType(_)) => (
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                "send the order as application/json",
            ),
            Self::BadBody(JsonRejection::JsonDataError(_)) => (
                StatusCode::BAD_REQUEST,
                "invalid_order",
                "the order needs sku, quantity, amount and currency of the right types",
            ),
            Self::BadBody(_) => (
                StatusCode::BAD_REQUEST,
                "malformed_json",
                "the body is not valid JSON",
            ),
            Self::OutOfStock => (
                StatusCode::CONFLICT,
                "out_of_stock",
                "not enough stock left for this order",
            ),
            Self::NotFound => (StatusCode::NOT_FOUND, "not_found", "no such order"),
            Self::Db(error) => {
                // Logged for operators; the client learns only that it may retry.
                tracing::error!(%error, "database error");
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal_error",
                    "try again later",
                )
            }
        };
        let body = json!({ "type": "about:blank", "title": code, "status": status.as_u16(), "code": code, "detail": detail });
        let mut response = (
            status,
            [(header::CONTENT_TYPE, "application/problem+json")],
            body.to_string(),
        )
            .into_response();
        if status.is_server_error() {
            // Nothing was committed (the idempotency layer rolls a 5xx back): the client may
            // retry with the same key, after a short pause while the database recovers.
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        }
        response
    }
}
