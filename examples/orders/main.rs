//! An order API made safe to retry: `cargo run --example orders`.
//!
//! SQLite file by default; `DATABASE_URL=postgres://…` (built with `--features postgres`) or
//! `mysql://…` (`--features mysql`) switches the backend. `BIND` sets the address (default
//! 127.0.0.1:3000), `IDEMPOTENCY_TTL_SECS` the retention of keys (default 24 h).
//! `BROKER_URL=amqp://…` (`--features rabbitmq`) or `nats://…` (`--features nats`) also
//! consumes payment events and applies each payment once (see `consumer.rs`).
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

use axum::extract::{FromRequestParts, Path};
use axum::http::{StatusCode, header, request::Parts};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use axum_idempotency::{IdempotencyLayer, Principal, SqlStore, Store, Tx};
use db::{NewOrder, Order, OrdersDb, StockError};
use serde::Deserialize;
use serde_json::json;
use sqlx::Pool;

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
            app(sqlx::SqlitePool::connect_with(options).await?, ttl, broker).await?
        }
        #[cfg(feature = "postgres")]
        "postgres" | "postgresql" => app(sqlx::PgPool::connect(&url).await?, ttl, broker).await?,
        #[cfg(feature = "mysql")]
        "mysql" | "mariadb" => app(sqlx::MySqlPool::connect(&url).await?, ttl, broker).await?,
        other => {
            return Err(
                format!("DATABASE_URL scheme {other:?} is not built in (see --features)").into(),
            );
        }
    };

    let listener = tokio::net::TcpListener::bind(&bind).await?;
    println!(
        "orders example listening on http://{}",
        listener.local_addr()?
    );
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            tokio::signal::ctrl_c().await.ok();
        })
        .await?;
    Ok(())
}

/// The whole app for one backend: schema, idempotency layer, routes.
async fn app<DB: OrdersDb>(
    pool: Pool<DB>,
    ttl: Duration,
    broker: Option<&str>,
) -> Result<Router, Box<dyn std::error::Error>>
where
    SqlStore<DB>: Store<Database = DB>,
{
    DB::create_schema(&pool).await?;
    let store = SqlStore::new(pool.clone());
    store.migrate().await?;
    store.spawn_purger(Duration::from_secs(60));
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
    let idempotency = IdempotencyLayer::new(store)
        .principal_with_state::<AuthUser, _>(state.clone())
        .ttl(ttl)
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
    user: AuthUser,
    mut tx: Tx<DB>,
    Json(request): Json<OrderRequest>,
) -> Result<Response, ApiError> {
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
    user: AuthUser,
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

/// The example's own errors, as problem+json like the crate's rejections.
enum ApiError {
    Unauthorized,
    InvalidOrder(&'static str),
    OutOfStock,
    NotFound,
    Db(sqlx::Error),
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
        (
            status,
            [(header::CONTENT_TYPE, "application/problem+json")],
            body.to_string(),
        )
            .into_response()
    }
}
