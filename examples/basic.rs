//! The smallest complete service to copy: one route, `POST /orders`, made safe to retry.
//! `cargo run --example basic` serves it on `127.0.0.1:3000` (`BIND` changes that) with a
//! SQLite file, `basic.db` (`DATABASE_URL` changes that).

use std::borrow::Cow;
use std::time::Duration;

use axum::extract::FromRequestParts;
use axum::http::{StatusCode, header, request::Parts};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json, Router, routing::post};
use axum_idempotency::{IdempotencyLayer, Principal, SqliteStore, Tx, TxError};
use serde::Deserialize;
use serde_json::json;
use sqlx::Sqlite;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use tokio::signal::unix::{SignalKind, signal};

/// The caller. A placeholder for your real authentication: keys are scoped to the caller, so
/// it must be one your auth verified, never a user id the client merely asserts.
#[derive(Clone)]
struct AuthUser(String);

impl<S: Send + Sync> FromRequestParts<S> for AuthUser {
    type Rejection = StatusCode;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        match parts
            .headers
            .get(header::AUTHORIZATION)
            .map(|v| v.as_bytes())
        {
            Some(b"Bearer alice-token") => Ok(AuthUser("alice".into())),
            Some(b"Bearer bob-token") => Ok(AuthUser("bob".into())),
            _ => Err(StatusCode::UNAUTHORIZED),
        }
    }
}

impl Principal for AuthUser {
    fn principal_id(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}

#[derive(Deserialize)]
struct NewOrder {
    sku: String,
    quantity: i64,
}

// The caller comes from the layer, which already extracted it: a real auth extractor run again
// here could take a second pooled connection while the claim holds one, and stall the pool.
async fn create_order(
    Extension(user): Extension<AuthUser>,
    mut tx: Tx<Sqlite>,
    Json(order): Json<NewOrder>,
) -> Result<Response, TxError> {
    if order.quantity < 1 {
        // A 4xx is final: stored and replayed like a success, so the client stops retrying.
        return Ok((StatusCode::BAD_REQUEST, "quantity must be at least 1").into_response());
    }
    let sql = "INSERT INTO orders (user_id, sku, quantity) VALUES (?, ?, ?) RETURNING id";
    let id: i64 = sqlx::query_scalar(sql)
        .bind(&user.0)
        .bind(&order.sku)
        .bind(order.quantity)
        .fetch_one(&mut tx) // the claim's transaction: the order and its answer commit together
        .await?; // a failed write is never a 2xx: rolled back, and the client may retry
    let location = [(header::LOCATION, format!("/orders/{id}"))];
    let body = json!({"id": id, "status": "created", "sku": order.sku, "quantity": order.quantity});
    Ok((StatusCode::CREATED, location, Json(body)).into_response())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "sqlite://basic.db".into());
    let bind = std::env::var("BIND").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let options = url.parse::<SqliteConnectOptions>()?.create_if_missing(true);
    let pool = SqlitePoolOptions::new()
        .acquire_timeout(Duration::from_secs(3)) // fail fast, within the layer's 10 s deadline
        .connect_with(options.journal_mode(SqliteJournalMode::Wal)) // readers never wait
        .await?;
    // Migrations at start-up: the app's table, then the crate's own (a no-op when current).
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY,
         user_id TEXT NOT NULL, sku TEXT NOT NULL, quantity INTEGER NOT NULL)",
    )
    .execute(&pool)
    .await?;
    let store = SqliteStore::new(pool);
    store.migrate().await?;
    store.spawn_purger(Duration::from_secs(60)); // deletes records past their retention (24 h)
    let app = Router::new()
        .route("/orders", post(create_order))
        .route_layer(
            // route_layer, not layer: the route template, not the concrete path, scopes the key.
            IdempotencyLayer::new(store)
                .principal::<AuthUser>() // your auth extractor; a refusal answers 401
                .ignore_json_fields(["/trace_id"]), // fields that do not change what is asked
        );

    // Registered before serving: until then SIGTERM would end the process at once.
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let listener = std::net::TcpListener::bind(&bind)?;
    println!("listening on http://{}", listener.local_addr()?);
    let handle = axum_server::Handle::new();
    let stopping = handle.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = terminate.recv() => {}
            _ = interrupt.recv() => {}
        }
        stopping.graceful_shutdown(None); // no new connections; answer those in flight, exit
    });
    // axum-server, because `axum::serve` has no header read timeout: a client that never
    // finishes its request head would hold its connection for ever.
    let mut server = axum_server::from_tcp(listener)?.http1_only().handle(handle);
    server
        .http_builder()
        .http1()
        .header_read_timeout(Duration::from_secs(5));
    server.serve(app.into_make_service()).await?;
    Ok(())
}
