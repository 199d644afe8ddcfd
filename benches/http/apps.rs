//! The servers under test: the order app on each backend (`/bare`, `/manual`, `/layer`) and
//! the middleware alone on an empty handler (`/noop…`).

use std::net::SocketAddr;

use axum::Router;
use axum::body::Bytes;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use tokio::net::TcpListener;
use tokio::runtime::Runtime;

#[cfg(feature = "sqlite")]
use crate::BoxError;
use crate::fill::{Dialect, Records};
use crate::order::{TTL_MS, now_ms};

/// The replay cache's budget where a scenario turns it on.
pub(crate) const CACHE_BYTES: usize = 64 * 1024 * 1024;

fn created(id: i64) -> Response {
    (
        StatusCode::CREATED,
        [(header::CONTENT_TYPE, "application/json")],
        format!("{{\"id\":{id}}}"),
    )
        .into_response()
}

fn failed(status: StatusCode) -> Response {
    status.into_response()
}

#[derive(serde::Deserialize)]
struct Order {
    sku: String,
    qty: i32,
}

/// The order-creating app for one backend: `/bare`, `/manual` and `/layer` (under the layer).
macro_rules! order_app {
    (
        $module:ident, $db:ty, $store:ty,
        manual_begin = $begin:literal,
        schema = $schema:literal,
        insert_order = $insert:literal,
        manual_claim = $claim:literal,
        manual_finish = $finish:literal $(,)?
    ) => {
        pub(crate) mod $module {
            use super::*;
            use axum::extract::State;
            use axum::http::HeaderMap;
            use axum_idempotency::{IdempotencyLayer, Tx};
            use sha2::{Digest, Sha256};
            use sqlx::Pool;

            type Db = $db;

            pub(crate) const SCHEMA: &str = $schema;

            pub(crate) fn router(pool: Pool<Db>) -> Router {
                let layer = IdempotencyLayer::new(<$store>::new(pool.clone())).allow_anonymous();
                let cached = Router::new()
                    .route("/layer-cached", post(layer_order))
                    .route_layer(layer.clone().cache_replays(CACHE_BYTES));
                Router::new()
                    .route("/layer", post(layer_order))
                    .route_layer(layer)
                    .merge(cached)
                    .route("/bare", post(bare))
                    .route("/manual", post(manual))
                    .with_state(pool)
            }

            /// The scale section's access to this app's database: SQL on its pool, and the
            /// purge of the store the layer uses.
            pub(crate) fn records(pool: Pool<Db>, dialect: &'static Dialect) -> Records {
                let store = <$store>::new(pool.clone());
                Records {
                    exec: Box::new(move |rt: &Runtime, sql: String| {
                        let pool = pool.clone();
                        rt.block_on(async move {
                            let done = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                                .execute(&pool)
                                .await?;
                            Ok(done.rows_affected())
                        })
                    }),
                    purge: Box::new(move || {
                        let store = store.clone();
                        Box::pin(async move { Ok(store.purge_expired().await?) })
                    }),
                    dialect,
                }
            }

            async fn bare(State(pool): State<Pool<Db>>, body: Bytes) -> Response {
                let Ok(order) = serde_json::from_slice::<Order>(&body) else {
                    return failed(StatusCode::BAD_REQUEST);
                };
                let result: Result<i64, sqlx::Error> = async {
                    let mut tx = pool.begin().await?;
                    let id = sqlx::query_scalar($insert)
                        .bind(order.sku)
                        .bind(order.qty)
                        .fetch_one(&mut *tx)
                        .await?;
                    tx.commit().await?;
                    Ok(id)
                }
                .await;
                result.map_or_else(|_| failed(StatusCode::INTERNAL_SERVER_ERROR), created)
            }

            /// The claim and the response record by hand: claim on the unique key, insert the
            /// order, store the response, commit. No read before the claim, no replay path.
            async fn manual(
                State(pool): State<Pool<Db>>,
                headers: HeaderMap,
                body: Bytes,
            ) -> Response {
                let Some(key) = headers
                    .get("idempotency-key")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned)
                else {
                    return failed(StatusCode::BAD_REQUEST);
                };
                let Ok(order) = serde_json::from_slice::<Order>(&body) else {
                    return failed(StatusCode::BAD_REQUEST);
                };
                let fingerprint = Sha256::digest(&body).to_vec();
                let result: Result<Option<i64>, sqlx::Error> = async {
                    let now = now_ms();
                    let mut tx = pool.begin_with($begin).await?;
                    let claimed = sqlx::query($claim)
                        .bind(&key)
                        .bind(fingerprint)
                        .bind(now)
                        .bind(now + TTL_MS)
                        .execute(&mut *tx)
                        .await?
                        .rows_affected()
                        == 1;
                    if !claimed {
                        tx.rollback().await?;
                        return Ok(None);
                    }
                    let id: i64 = sqlx::query_scalar($insert)
                        .bind(order.sku)
                        .bind(order.qty)
                        .fetch_one(&mut *tx)
                        .await?;
                    sqlx::query($finish)
                        .bind(201_i32)
                        .bind(b"content-type: application/json".to_vec())
                        .bind(format!("{{\"id\":{id}}}").into_bytes())
                        .bind(&key)
                        .execute(&mut *tx)
                        .await?;
                    tx.commit().await?;
                    Ok(Some(id))
                }
                .await;
                match result {
                    Ok(Some(id)) => created(id),
                    Ok(None) => failed(StatusCode::CONFLICT),
                    Err(_) => failed(StatusCode::INTERNAL_SERVER_ERROR),
                }
            }

            async fn layer_order(mut tx: Tx<Db>, body: Bytes) -> Response {
                let Ok(order) = serde_json::from_slice::<Order>(&body) else {
                    return failed(StatusCode::BAD_REQUEST);
                };
                let id = sqlx::query_scalar($insert)
                    .bind(order.sku)
                    .bind(order.qty)
                    .fetch_one(&mut *tx)
                    .await;
                id.map_or_else(|_| failed(StatusCode::INTERNAL_SERVER_ERROR), created)
            }
        }
    };
}

#[cfg(feature = "sqlite")]
order_app!(
    sqlite_app,
    sqlx::Sqlite,
    axum_idempotency::SqliteStore,
    manual_begin = "BEGIN IMMEDIATE",
    schema =
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, sku TEXT NOT NULL, qty INTEGER NOT NULL);
        CREATE TABLE manual_claims (key TEXT PRIMARY KEY NOT NULL, fingerprint BLOB NOT NULL,
            state TEXT NOT NULL, status INTEGER, headers BLOB, body BLOB,
            created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL) WITHOUT ROWID;
        CREATE INDEX manual_claims_expires_at ON manual_claims (expires_at);",
    insert_order = "INSERT INTO orders (sku, qty) VALUES (?1, ?2) RETURNING id",
    manual_claim = "INSERT INTO manual_claims (key, fingerprint, state, created_at, expires_at)
        VALUES (?1, ?2, 'processing', ?3, ?4) ON CONFLICT (key) DO NOTHING",
    manual_finish =
        "UPDATE manual_claims SET state = 'completed', status = ?1, headers = ?2, body = ?3
        WHERE key = ?4",
);

#[cfg(feature = "postgres")]
order_app!(
    postgres_app,
    sqlx::Postgres,
    axum_idempotency::PgStore,
    manual_begin = "BEGIN",
    schema =
        "CREATE TABLE orders (id BIGSERIAL PRIMARY KEY, sku TEXT NOT NULL, qty INTEGER NOT NULL);
        CREATE TABLE manual_claims (key TEXT PRIMARY KEY, fingerprint BYTEA NOT NULL,
            state TEXT NOT NULL, status INTEGER, headers BYTEA, body BYTEA,
            created_at BIGINT NOT NULL, expires_at BIGINT NOT NULL);
        CREATE INDEX manual_claims_expires_at ON manual_claims (expires_at);",
    insert_order = "INSERT INTO orders (sku, qty) VALUES ($1, $2) RETURNING id",
    manual_claim = "INSERT INTO manual_claims (key, fingerprint, state, created_at, expires_at)
        VALUES ($1, $2, 'processing', $3, $4) ON CONFLICT (key) DO NOTHING",
    manual_finish =
        "UPDATE manual_claims SET state = 'completed', status = $1, headers = $2, body = $3
        WHERE key = $4",
);

// `key` is a reserved word in MySQL, hence the backquotes. The manual claim is INSERT IGNORE: a
// duplicate reports 0 rows even with sqlx's CLIENT_FOUND_ROWS. Its BEGIN bounds the lock wait
// the way the store's does (one round trip, the SET and BEGIN sent together), without saving
// and restoring the old value: nothing else uses these pools.
#[cfg(feature = "mysql")]
order_app!(
    mysql_app,
    sqlx::MySql,
    axum_idempotency::MySqlStore,
    manual_begin = "SET SESSION innodb_lock_wait_timeout = 5; BEGIN",
    schema = "CREATE TABLE orders (id BIGINT AUTO_INCREMENT PRIMARY KEY, sku VARCHAR(64) NOT NULL,
            qty INT NOT NULL) ENGINE = InnoDB;
        CREATE TABLE manual_claims (`key` VARCHAR(255) PRIMARY KEY, fingerprint VARBINARY(32) NOT NULL,
            state VARCHAR(16) NOT NULL, status INT, headers BLOB, body BLOB,
            created_at BIGINT NOT NULL, expires_at BIGINT NOT NULL,
            INDEX manual_claims_expires_at (expires_at)) ENGINE = InnoDB;",
    insert_order = "INSERT INTO orders (sku, qty) VALUES (?, ?) RETURNING id",
    manual_claim = "INSERT IGNORE INTO manual_claims (`key`, fingerprint, state, created_at, expires_at)
        VALUES (?, ?, 'processing', ?, ?)",
    manual_finish =
        "UPDATE manual_claims SET state = 'completed', status = ?, headers = ?, body = ?
        WHERE `key` = ?",
);

pub(crate) async fn serve(router: Router) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, router).await {
            eprintln!("server failed: {error}");
        }
    });
    Ok(addr)
}

/// The middleware alone: an empty handler with and without the layer, 1 KiB JSON bodies. The
/// layer needs a store; it is SQLite on tmpfs (`/dev/shm` where it exists), WAL, no fsync,
/// pool of 8 without the pre-acquire ping: the nearest to no database a keyed request can get.
#[cfg(feature = "sqlite")]
pub(crate) fn noop_app(server: &Runtime, dir: &std::path::Path) -> Result<SocketAddr, BoxError> {
    use axum_idempotency::{IdempotencyLayer, SqliteStore};
    use sqlx::sqlite::{
        SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous,
    };

    async fn noop(_body: Bytes) -> StatusCode {
        StatusCode::OK
    }

    let options = SqliteConnectOptions::new()
        .filename(dir.join("noop.db"))
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Off);
    server.block_on(async {
        let pool = SqlitePoolOptions::new()
            .max_connections(8)
            .test_before_acquire(false)
            .connect_with(options)
            .await?;
        let store = SqliteStore::new(pool);
        store.migrate().await?;
        let layer = IdempotencyLayer::new(store).allow_anonymous();
        let keyed = Router::new()
            .route("/noop-layer", post(noop))
            .route_layer(layer.clone());
        let cached = Router::new()
            .route("/noop-layer-cached", post(noop))
            .route_layer(layer.clone().cache_replays(CACHE_BYTES));
        let optional = Router::new()
            .route("/noop-optional", post(noop))
            .route_layer(layer.allow_missing_key());
        let router = Router::new()
            .route("/noop", post(noop))
            .merge(keyed)
            .merge(cached)
            .merge(optional);
        Ok(serve(router).await?)
    })
}
