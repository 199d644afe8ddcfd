//! A small payment provider to charge against: the downstream of the `payments` example.
//!
//! ```text
//! cargo run --example payment_provider
//! ```
//!
//! Charges are kept in an SQLite file (`PROVIDER_DATABASE`, default `payment_provider.db`), so
//! they survive restarts. Its log is synced as SQLite advises for WAL mode (`synchronous =
//! NORMAL`): a killed provider loses no charge, and only a power loss could lose the last ones.
//! A sync at every charge made the provider, not the payments' relay, the chain's bottleneck.
//! `BIND` sets the address (default `127.0.0.1:4000`).
//!
//! - `POST /charges` with `Idempotency-Key` and `{ "amount", "currency", "payee" }` → `201` with
//!   the new charge, or `200` with the charge made earlier under the same key.
//! - `GET /charges?key=…` → the charge made with that key, or `404`.
//! - `GET /admin/charges` → every charge and how many `POST /charges` arrived, for tests.
//!
//! `PROVIDER_IDEMPOTENCY=off` makes it a provider without idempotency: every POST charges anew
//! (the key is only kept as a reference the lookup can find).
//!
//! Faults, drawn at random for each new charge (env) or forced for one request (header). A
//! `*_RATE` is a probability per new charge, from `0` (never) to `1` (every charge): `0.2` hits
//! one charge in five on average.
//!
//! | env | header | effect |
//! |---|---|---|
//! | `FAULT_LATENCY_MS` (ms, default 0), `FAULT_LATENCY_RATE` (default 1) | `X-Fault-Latency-Ms: N` | answer N ms later |
//! | `FAULT_503_RATE` (default 0), `FAULT_RETRY_AFTER` (s, default 1) | `X-Fault: 503` | 503 with `Retry-After`, no charge |
//! | `FAULT_DROP_RATE` (default 0) | `X-Fault: drop` | charge, then drop the connection unanswered |
//!
//! A repeated key that finds its charge is always answered, so a resend recovers from a drop. A
//! setting that does not parse stops the provider at start, rather than being ignored.

#[allow(
    dead_code,
    unused_imports,
    unused_macros,
    reason = "shared by the examples; the provider has no database to choose"
)]
mod common;

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::extract::{Extension, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use common::{Error, setting};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::SqlitePool;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tower::ServiceExt;

#[derive(Clone)]
struct App {
    db: SqlitePool,
    idempotent: bool,
    faults: Arc<Faults>,
    posts: Arc<AtomicU64>,
}

struct Faults {
    latency: Duration,
    latency_rate: f64,
    unavailable_rate: f64,
    retry_after_secs: u64,
    drop_rate: f64,
}

impl Faults {
    fn from_env() -> Result<Self, Error> {
        Ok(Self {
            latency: Duration::from_millis(setting("FAULT_LATENCY_MS", 0)?),
            latency_rate: setting("FAULT_LATENCY_RATE", 1.0)?,
            unavailable_rate: setting("FAULT_503_RATE", 0.0)?,
            retry_after_secs: setting("FAULT_RETRY_AFTER", 1)?,
            drop_rate: setting("FAULT_DROP_RATE", 0.0)?,
        })
    }
}

/// Closes the connection the request came on, without an answer.
#[derive(Clone)]
struct DropConnection(Arc<Notify>);

#[derive(Deserialize)]
struct NewCharge {
    /// Kept as the text it came as, a number or a string: never read as a float.
    amount: Box<serde_json::value::RawValue>,
    currency: String,
    payee: String,
}

#[derive(Serialize)]
struct Charge {
    id: String,
    amount: String,
    currency: String,
    payee: String,
    idempotency_key: Option<String>,
}

type ChargeRow = (String, String, String, String, Option<String>);

impl From<ChargeRow> for Charge {
    fn from((id, amount, currency, payee, idempotency_key): ChargeRow) -> Self {
        Self {
            id,
            amount,
            currency,
            payee,
            idempotency_key,
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    common::init_logging();
    let bind = setting("BIND", "127.0.0.1:4000".to_owned())?;
    let file = setting("PROVIDER_DATABASE", "payment_provider.db".to_owned())?;
    let options = SqliteConnectOptions::new()
        .filename(&file)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Normal);
    let db = SqlitePool::connect_with(options).await?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS charges (
             id TEXT PRIMARY KEY,
             dedupe_key TEXT UNIQUE,
             idempotency_key TEXT,
             amount TEXT NOT NULL,
             currency TEXT NOT NULL,
             payee TEXT NOT NULL
         );
         CREATE INDEX IF NOT EXISTS charges_by_key ON charges (idempotency_key);",
    )
    .execute(&db)
    .await?;

    let app = App {
        db,
        idempotent: std::env::var("PROVIDER_IDEMPOTENCY").as_deref() != Ok("off"),
        faults: Arc::new(Faults::from_env()?),
        posts: Arc::new(AtomicU64::new(0)),
    };
    let router = Router::new()
        .route("/charges", post(create_charge).get(find_charge))
        .route("/admin/charges", get(list_charges))
        .with_state(app.clone());

    let listener = TcpListener::bind(&bind).await?;
    println!(
        "payment provider listening on http://{} (idempotency {})",
        listener.local_addr()?,
        if app.idempotent { "on" } else { "off" }
    );
    serve(listener, router).await
}

/// Serves connections one by one rather than through `axum::serve`, so a handler can drop its
/// own connection (the "charged, but the answer never arrived" fault).
async fn serve(listener: TcpListener, router: Router) -> Result<(), Error> {
    loop {
        let (stream, _) = listener.accept().await?;
        let router = router.clone();
        tokio::spawn(async move {
            let drop_it = DropConnection(Arc::new(Notify::new()));
            let service = TowerToHyperService::new(tower::service_fn({
                let drop_it = drop_it.clone();
                move |mut request: Request<hyper::body::Incoming>| {
                    request.extensions_mut().insert(drop_it.clone());
                    let router = router.clone();
                    async move {
                        let request = request.map(axum::body::Body::new);
                        Ok::<_, Infallible>(router.oneshot(request).await.into_response())
                    }
                }
            }));
            // A timer, so that hyper's header read timeout applies: a client that never
            // finishes its request head does not hold its connection for ever.
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(Duration::from_secs(5))
                .serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                _ = connection => {}
                () = drop_it.0.notified() => {}
            }
        });
    }
}

async fn create_charge(
    State(app): State<App>,
    Extension(drop_connection): Extension<DropConnection>,
    headers: HeaderMap,
    Json(charge): Json<NewCharge>,
) -> Result<Response, Response> {
    app.posts.fetch_add(1, Ordering::SeqCst);
    let key = headers
        .get("idempotency-key")
        .and_then(|value| value.to_str().ok())
        .map(str::to_owned);
    let forced = headers
        .get("x-fault")
        .and_then(|value| value.to_str().ok())
        .unwrap_or("");
    let forced_latency = headers
        .get("x-fault-latency-ms")
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse().ok())
        .map(Duration::from_millis);

    if app.idempotent
        && let Some(key) = &key
        && let Some(existing) = by_dedupe_key(&app.db, key).await?
    {
        return Ok((StatusCode::OK, Json(existing)).into_response());
    }

    let faults = &app.faults;
    let latency = forced_latency.or_else(|| {
        (!faults.latency.is_zero() && fastrand::f64() < faults.latency_rate)
            .then_some(faults.latency)
    });
    if let Some(latency) = latency {
        tokio::time::sleep(latency).await;
    }
    if forced == "503" || fastrand::f64() < faults.unavailable_rate {
        let retry_after = faults.retry_after_secs.to_string();
        return Ok((
            StatusCode::SERVICE_UNAVAILABLE,
            [(header::RETRY_AFTER, retry_after)],
            Json(json!({ "error": "temporarily unavailable" })),
        )
            .into_response());
    }

    let amount = serde_json::from_str::<String>(charge.amount.get())
        .unwrap_or_else(|_| charge.amount.get().to_owned());
    let id = format!("ch_{:016x}", fastrand::u64(..));
    let dedupe_key = if app.idempotent { key.clone() } else { None };
    let inserted = sqlx::query(
        "INSERT INTO charges (id, dedupe_key, idempotency_key, amount, currency, payee)
         VALUES ($1, $2, $3, $4, $5, $6)
         ON CONFLICT (dedupe_key) DO NOTHING",
    )
    .bind(&id)
    .bind(&dedupe_key)
    .bind(&key)
    .bind(&amount)
    .bind(&charge.currency)
    .bind(&charge.payee)
    .execute(&app.db)
    .await
    .map_err(internal)?;
    if inserted.rows_affected() == 0
        && let Some(key) = &key
        && let Some(existing) = by_dedupe_key(&app.db, key).await?
    {
        // A concurrent request with the same key charged first.
        return Ok((StatusCode::OK, Json(existing)).into_response());
    }

    if forced == "drop" || fastrand::f64() < faults.drop_rate {
        tracing::info!(%id, "charged; dropping the connection before answering");
        drop_connection.0.notify_one();
        std::future::pending::<()>().await;
    }
    let created = Charge {
        id,
        amount,
        currency: charge.currency,
        payee: charge.payee,
        idempotency_key: key,
    };
    Ok((StatusCode::CREATED, Json(created)).into_response())
}

#[derive(Deserialize)]
struct KeyQuery {
    key: String,
}

async fn find_charge(
    State(app): State<App>,
    Query(query): Query<KeyQuery>,
) -> Result<Response, Response> {
    let found: Option<ChargeRow> = sqlx::query_as(
        "SELECT id, amount, currency, payee, idempotency_key FROM charges
         WHERE idempotency_key = $1 ORDER BY rowid LIMIT 1",
    )
    .bind(&query.key)
    .fetch_optional(&app.db)
    .await
    .map_err(internal)?;
    Ok(match found {
        Some(charge) => Json(Charge::from(charge)).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({ "error": "no such charge" })),
        )
            .into_response(),
    })
}

async fn list_charges(State(app): State<App>) -> Result<Response, Response> {
    let charges: Vec<ChargeRow> = sqlx::query_as(
        "SELECT id, amount, currency, payee, idempotency_key FROM charges ORDER BY rowid",
    )
    .fetch_all(&app.db)
    .await
    .map_err(internal)?;
    let charges: Vec<Charge> = charges.into_iter().map(Charge::from).collect();
    Ok(Json(json!({
        "count": charges.len(),
        "posts": app.posts.load(Ordering::SeqCst),
        "charges": charges,
    }))
    .into_response())
}

async fn by_dedupe_key(db: &SqlitePool, key: &str) -> Result<Option<Charge>, Response> {
    let found: Option<ChargeRow> = sqlx::query_as(
        "SELECT id, amount, currency, payee, idempotency_key FROM charges WHERE dedupe_key = $1",
    )
    .bind(key)
    .fetch_optional(db)
    .await
    .map_err(internal)?;
    Ok(found.map(Charge::from))
}

fn internal(error: sqlx::Error) -> Response {
    tracing::error!(%error, "provider database error");
    (
        StatusCode::INTERNAL_SERVER_ERROR,
        Json(json!({ "error": "internal" })),
    )
        .into_response()
}
