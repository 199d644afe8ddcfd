//! The peer crate `axum-idempotent` on the HTTP benchmark's order handler.
//!
//! `cargo bench --bench http` builds this binary, starts it and drives it with the same load
//! generator and the same SQL as its own `bare` handler, in the PostgreSQL schema the benchmark
//! created. It prints one line on stdout, `listening <addr> <store description>`, or
//! `unavailable <reason>` and exits with status 2.
//!
//! Routes:
//! - `POST /session` starts a session (writes a `user` field) and returns its cookie:
//!   axum-idempotent caches only for requests that already carry a session.
//! - `POST /bare`: the order handler with no layer, so the benchmark can tell the cost of
//!   running in another process from the cost of the layer.
//! - `POST /peer`: the order handler under `IdempotentLayer`, on the session store below.
//! - `POST /noop` and `POST /noop-peer`: an empty handler without and with `IdempotentLayer`,
//!   the latter on ruts' in-memory moka store (the nearest to no store a cached request gets).
//!
//! Settings (environment):
//! - `PEER_DATABASE_URL` (required) and `PEER_SCHEMA` (required): where the `orders` table is.
//! - `PEER_LISTEN` (default `127.0.0.1:0`).
//! - `PEER_STORE` (default `auto`): `redis`, `postgres`, or `auto` (Redis where the server
//!   supports ruts' store, else PostgreSQL).
//! - `PEER_REDIS_URL` (default `redis://127.0.0.1:6379`).
//! - `PEER_KEYING` (default `header`): `header` keys on the `Idempotency-Key` header
//!   (required), `hash` on a hash of method, target, headers and body.
//! - `PEER_TEST_BEFORE_ACQUIRE` (default `true`): the pool's ping before handing out a
//!   connection, as in the benchmark.

use std::error::Error;
use std::io::Write;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum_idempotent::{IdempotentLayer, IdempotentOptions};
use fred::prelude::{Builder, ClientLike, Config};
use ruts::store::SessionStore;
use ruts::store::Ttl;
use ruts::store::moka::MokaStore;
use ruts::store::postgres::{PostgresStore, PostgresStoreBuilder};
use ruts::store::redis::RedisStore;
use ruts::{CookieOptions, Id, Session, SessionLayer};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tower_cookies::CookieManagerLayer;

type BoxError = Box<dyn Error + Send + Sync>;

/// As long as the benchmark's own layer keeps a record, so nothing expires during a run.
const TTL_SECS: i64 = 24 * 3600;
const COOKIE: &str = "session";

#[derive(serde::Deserialize)]
struct Order {
    sku: String,
    qty: i32,
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn main() {
    let outcome = tokio::runtime::Builder::new_multi_thread()
        // The benchmark's own servers run on two workers; the same here keeps the comparison
        // about the layer, not the runtime.
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(BoxError::from)
        .and_then(|runtime| runtime.block_on(run()));
    if let Err(error) = outcome {
        println!("unavailable {error}");
        std::process::exit(2);
    }
}

async fn run() -> Result<(), BoxError> {
    let url = env("PEER_DATABASE_URL").ok_or("PEER_DATABASE_URL is not set")?;
    let schema = env("PEER_SCHEMA").ok_or("PEER_SCHEMA is not set")?;
    let listen: SocketAddr = env("PEER_LISTEN")
        .unwrap_or_else(|| "127.0.0.1:0".into())
        .parse()?;
    let test_before_acquire = env("PEER_TEST_BEFORE_ACQUIRE").is_none_or(|v| v != "false");
    let (options, keying) = match env("PEER_KEYING").as_deref() {
        None | Some("header") => (
            IdempotentOptions::default()
                .use_idempotency_key_header(Some("idempotency-key"), true)
                .expire_after(TTL_SECS),
            "key = Idempotency-Key header (required), body not read",
        ),
        Some("hash") => (
            IdempotentOptions::default().expire_after(TTL_SECS),
            "key = blake3 of method, target, headers and body",
        ),
        Some(other) => return Err(format!("unknown PEER_KEYING {other:?}").into()),
    };

    let connect = PgConnectOptions::from_str(&url)?.options([("search_path", schema.as_str())]);
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .test_before_acquire(test_before_acquire)
        .connect_with(connect)
        .await?;

    let noop = noop_routes(options.clone());
    let store_choice = env("PEER_STORE").unwrap_or_else(|| "auto".into());
    let redis_url = env("PEER_REDIS_URL").unwrap_or_else(|| "redis://127.0.0.1:6379".into());
    let (orders, store) = match store_choice.as_str() {
        "redis" => {
            let store = redis_store(&redis_url).await?;
            (
                order_routes(store, options, pool.clone()),
                redis_note(&redis_url),
            )
        }
        "postgres" => {
            let store = postgres_store(&pool, &schema).await?;
            (
                order_routes(store, options, pool.clone()),
                postgres_note(&schema),
            )
        }
        "auto" => match redis_store(&redis_url).await {
            Ok(store) => (
                order_routes(store, options, pool.clone()),
                redis_note(&redis_url),
            ),
            Err(why) => {
                let store = postgres_store(&pool, &schema).await?;
                let note = format!("{} (Redis store not usable: {why})", postgres_note(&schema));
                (order_routes(store, options, pool.clone()), note)
            }
        },
        other => return Err(format!("unknown PEER_STORE {other:?}").into()),
    };

    let router = Router::new()
        .route("/bare", post(bare))
        .route("/noop", post(noop_handler))
        .with_state(pool)
        .merge(orders)
        .merge(noop);
    let listener = tokio::net::TcpListener::bind(listen).await?;
    let addr = listener.local_addr()?;
    let mut stdout = std::io::stdout();
    writeln!(stdout, "listening {addr} {store}; {keying}")?;
    stdout.flush()?;
    axum::serve(listener, router).await?;
    Ok(())
}

fn redis_note(url: &str) -> String {
    format!("ruts RedisStore at {url} (one hash per session, a field per key)")
}

fn postgres_note(schema: &str) -> String {
    format!(
        "ruts PostgresStore, table {schema}.peer_sessions (a row per session and key), \
         on the handler's pool of 16"
    )
}

/// Connects and proves the server runs ruts' scripts: they call `HEXPIRE` (Redis 7.4), and
/// with an older server every write fails, so nothing would ever be replayed.
async fn redis_store(url: &str) -> Result<RedisStore, BoxError> {
    let pool = Builder::from_config(Config::from_url(url)?).build_pool(4)?;
    tokio::time::timeout(Duration::from_secs(3), pool.init())
        .await
        .map_err(|_| format!("no answer from {url} within 3 s"))??;
    let store = RedisStore::new(Arc::new(pool)).await?;
    let probe = Id::default();
    store
        .set(&probe, "probe", &1_u8, Ttl::new(1)?, None)
        .await
        .map_err(|e| {
            format!("a session write failed (ruts' scripts call HEXPIRE, Redis 7.4+): {e}")
        })?;
    store.delete(&probe).await?;
    Ok(store)
}

async fn postgres_store(pool: &PgPool, schema: &str) -> Result<PostgresStore, BoxError> {
    Ok(PostgresStoreBuilder::new(pool.clone())
        .schema_name(schema)?
        .table_name("peer_sessions")?
        .create_table(true)
        .build()
        .await?)
}

/// ruts' default cookie lives 10 minutes, and a cached response never outlives the cookie: the
/// cookie is given the record's TTL so a long run keeps replaying.
fn session_cookie() -> CookieOptions {
    CookieOptions::build()
        .name(COOKIE)
        .path("/")
        .max_age(TTL_SECS.unsigned_abs())
}

/// Layers from the outside in: cookies, session, idempotency — the order axum-idempotent
/// requires.
fn order_routes<T: SessionStore>(store: T, options: IdempotentOptions, pool: PgPool) -> Router {
    let cookies = session_cookie();
    Router::new()
        .route("/peer", post(bare))
        .route_layer(IdempotentLayer::<T>::new(options))
        .route("/session", post(start_session::<T>))
        .route_layer(SessionLayer::new(Arc::new(store)).with_cookie_options(cookies))
        .route_layer(CookieManagerLayer::new())
        .with_state(pool)
}

fn noop_routes(options: IdempotentOptions) -> Router {
    let cookies = session_cookie();
    Router::new()
        .route("/noop-peer", post(noop_handler))
        .route_layer(IdempotentLayer::<MokaStore>::new(options))
        .route_layer(
            SessionLayer::new(Arc::new(MokaStore::builder().build())).with_cookie_options(cookies),
        )
        .route_layer(CookieManagerLayer::new())
}

async fn start_session<T: SessionStore>(session: Session<T>) -> Response {
    let Ok(ttl) = Ttl::new(TTL_SECS) else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    match session.set("user", &"bench", ttl, None).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(error) => (StatusCode::SERVICE_UNAVAILABLE, error.to_string()).into_response(),
    }
}

/// The benchmark's `bare` handler: one order in a transaction of its own.
async fn bare(State(pool): State<PgPool>, body: Bytes) -> Response {
    let Ok(order) = serde_json::from_slice::<Order>(&body) else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let result: Result<i64, sqlx::Error> = async {
        let mut tx = pool.begin().await?;
        let id = sqlx::query_scalar("INSERT INTO orders (sku, qty) VALUES ($1, $2) RETURNING id")
            .bind(order.sku)
            .bind(order.qty)
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(id)
    }
    .await;
    match result {
        Ok(id) => (
            StatusCode::CREATED,
            [(header::CONTENT_TYPE, "application/json")],
            format!("{{\"id\":{id}}}"),
        )
            .into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

async fn noop_handler(_body: Bytes) -> StatusCode {
    StatusCode::OK
}
