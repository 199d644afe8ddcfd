//! What idempotency costs over HTTP, measured side by side in one run.
//!
//! Real axum servers on loopback, driven by a hyper client load generator in the same process
//! (separate runtimes). Every scenario is measured in the same run as its baseline, interleaved
//! round by round (each round starting one scenario later), because the machine is shared and
//! noisy: the ratios are the result, the absolute numbers drift.
//!
//! Sections besides throughput: `round-trips` counts statements, wire round trips and pool pings
//! per request through a TCP proxy; `latency` sends sequential requests on one connection (what
//! one client waits, with no queueing behind others); `latency-1ms` does the same through a
//! proxy that holds every chunk to and from the database for `BENCH_DELAY_MS` (PostgreSQL and
//! MariaDB), which is what a user of a database one network hop away sees; `scale` (opt-in)
//! fills the records table with `BENCH_SCALE` rows and measures the layer at that size and
//! while `purge_expired()` deletes the expired ones under load.
//!
//! Settings (environment):
//! - `BENCH_BACKENDS` (default `sqlite,postgres,mysql`): backends to run; one whose cargo feature
//!   is not compiled in is skipped, and the run says so.
//! - `BENCH_SECS` (default 1) seconds per scenario per round, `BENCH_ROUNDS` (default 15),
//!   `BENCH_CONNECTIONS` (default 32). Many short rounds rather than a few long ones: a burst
//!   of contention from the machine's neighbours then lands on every scenario in turn instead
//!   of on one of them.
//! - `BENCH_TRIPS` (default 200): sequential requests over which round trips are counted.
//! - `BENCH_BIG` (default 256): concurrent 1 MiB requests for the memory test.
//! - `BENCH_SOAK_SECS` (default 45) and `BENCH_SOAK_REQUESTS` (default 1000000): the soak run
//!   stops at whichever comes first.
//! - `BENCH_TEST_BEFORE_ACQUIRE` (default `true`, sqlx's default): whether the pools ping a
//!   connection each time they hand it out.
//! - `BENCH_ONLY` (default: all): a comma-separated list of scenarios to measure, the others
//!   are skipped (to profile one scenario; ratios need their baselines measured too). The
//!   sections `layer-storm`, `round-trips`, `latency`, `latency-1ms`, `scale`, `soak` and
//!   `memory` are named the same way; a section, once in, measures all of its scenarios.
//! - `BENCH_DELAY_MS` (default 1, fractions allowed): what the `latency-1ms` section's proxy adds
//!   in each direction between the app's pool and the database.
//! - `BENCH_SCALE` (default unset: the `scale` section is skipped): records in the table for the
//!   `scale` section on PostgreSQL, e.g. `10000000`. SQLite and MariaDB get the smaller of it
//!   and 10^6, unless `BENCH_SCALE_SMALL` sets their count.
//! - `BENCH_SCALE_EXPIRED` (default: the smaller of 10^6 and a tenth of the records): how many of
//!   the `scale` section's records are already expired, for `purge_expired()` to delete.
//! - `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`): the PostgreSQL server;
//!   the run creates a schema of its own there and drops it at the end.
//! - `MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`): the MySQL/MariaDB server; the run
//!   creates a database of its own there and drops it at the end.
//! - `BENCH_PEER` (default `true`): also measure the peer crate `axum-idempotent` on the same
//!   order handler (`peer-*` rows on PostgreSQL, `noop-peer-*` rows). The run builds
//!   `benches/peer` (`cargo build --release`, target dir `target/peer`), starts it as a child
//!   process on the PostgreSQL schema and stops it at the end; it needs the `postgres` backend.
//!   Where the build or the start fails, the run says why and goes on without it.
//! - `BENCH_PEER_STORE` (default `auto`): the peer's session store, `redis`, `postgres`, or
//!   `auto` (Redis where the server runs ruts' scripts, which need Redis 7.4, else PostgreSQL).
//! - `BENCH_PEER_REDIS` (default `redis://127.0.0.1:6379`): the Redis server for the peer.
//! - `BENCH_PEER_KEYING` (default `header`): the peer keys on the `Idempotency-Key` header
//!   (`header`) or on a hash of method, target, headers and body (`hash`).

use std::error::Error;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::http::{HeaderValue, Request, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Runtime;
use tokio::sync::Barrier;
use tracing::subscriber::Interest;
use tracing::{Event, Metadata, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt};

type BoxError = Box<dyn Error + Send + Sync>;

const TTL_MS: i64 = 24 * 3600 * 1000;

/// How long the memory test sends 1 MiB bodies on each route: long enough for every
/// connection to have several requests in flight one after another.
const MEMORY_RUN: Duration = Duration::from_secs(3);
const STORM: usize = 64;
/// The replay cache's budget where a scenario turns it on.
const CACHE_BYTES: usize = 64 * 1024 * 1024;
const ORDER_BODY: &str = r#"{"sku":"widget","qty":3}"#;

struct Settings {
    backends: Vec<String>,
    secs: f64,
    rounds: usize,
    conns: usize,
    trips: usize,
    big: usize,
    soak_secs: f64,
    soak_requests: u64,
    test_before_acquire: bool,
    delay: Duration,
    scale: Option<u64>,
    scale_small: Option<u64>,
    scale_expired: Option<u64>,
    #[cfg(feature = "postgres")]
    database_url: String,
    #[cfg(feature = "mysql")]
    mysql_url: String,
    peer: bool,
    // The peer runs on PostgreSQL only.
    #[cfg(feature = "postgres")]
    peer_store: String,
    #[cfg(feature = "postgres")]
    peer_redis: String,
    #[cfg(feature = "postgres")]
    peer_keying: String,
}

fn env_opt<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    env_opt(name).unwrap_or(default)
}

impl Settings {
    fn from_env() -> Self {
        Self {
            backends: std::env::var("BENCH_BACKENDS")
                .unwrap_or_else(|_| "sqlite,postgres,mysql".into())
                .split(',')
                .map(|s| s.trim().to_owned())
                .filter(|s| !s.is_empty())
                .collect(),
            secs: env_or("BENCH_SECS", 1.0),
            rounds: env_or("BENCH_ROUNDS", 15),
            conns: env_or("BENCH_CONNECTIONS", 32),
            trips: env_or("BENCH_TRIPS", 200),
            big: env_or("BENCH_BIG", 256),
            soak_secs: env_or("BENCH_SOAK_SECS", 45.0),
            soak_requests: env_or("BENCH_SOAK_REQUESTS", 1_000_000),
            test_before_acquire: env_or("BENCH_TEST_BEFORE_ACQUIRE", true),
            delay: Duration::from_secs_f64(env_or("BENCH_DELAY_MS", 1.0_f64).max(0.0) / 1000.0),
            scale: env_opt("BENCH_SCALE"),
            scale_small: env_opt("BENCH_SCALE_SMALL"),
            scale_expired: env_opt("BENCH_SCALE_EXPIRED"),
            #[cfg(feature = "postgres")]
            database_url: std::env::var("DATABASE_URL")
                .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into()),
            #[cfg(feature = "mysql")]
            mysql_url: std::env::var("MYSQL_URL")
                .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into()),
            peer: env_or("BENCH_PEER", true),
            #[cfg(feature = "postgres")]
            peer_store: std::env::var("BENCH_PEER_STORE").unwrap_or_else(|_| "auto".into()),
            #[cfg(feature = "postgres")]
            peer_redis: std::env::var("BENCH_PEER_REDIS")
                .unwrap_or_else(|_| "redis://127.0.0.1:6379".into()),
            #[cfg(feature = "postgres")]
            peer_keying: std::env::var("BENCH_PEER_KEYING").unwrap_or_else(|_| "header".into()),
        }
    }

    fn duration(&self) -> Duration {
        Duration::from_secs_f64(self.secs)
    }

    /// The records the scale section fills on `backend` and how many of them are expired, or
    /// `None` without `BENCH_SCALE`. SQLite and MariaDB are capped lower by default: a single
    /// writer and a slower bulk insert would make their fill the whole run.
    fn scale_of(&self, backend: &str) -> Option<(u64, u64)> {
        let scale = self.scale?;
        let rows = if backend == "postgres" {
            scale
        } else {
            self.scale_small.unwrap_or(scale.min(1_000_000))
        };
        let expired = self
            .scale_expired
            .unwrap_or((rows / 10).min(1_000_000))
            .min(rows);
        Some((rows, expired))
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

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
        mod $module {
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

// ---------------------------------------------------------------------------------------------
// Scale: a records table filled server-side with rows that look like real completed records.

type Exec = Box<dyn Fn(&Runtime, String) -> Result<u64, BoxError>>;
type PurgeFuture = std::pin::Pin<Box<dyn Future<Output = Result<u64, BoxError>> + Send>>;

/// What the scale section does to one backend's records table.
struct Records {
    /// Runs one SQL statement on the backend's pool; the rows it affected.
    exec: Exec,
    /// The store's own `purge_expired()`, to spawn while the load runs.
    purge: Box<dyn Fn() -> PurgeFuture>,
    dialect: &'static Dialect,
}

/// How one backend's SQL spells the filler rows.
struct Dialect {
    /// A row source of the integers `lo..hi` as a column `i`.
    series: fn(u64, u64) -> String,
    /// A 32-byte key digest for row `i`, as the store's SHA-256 of a scoped key would be.
    digest: &'static str,
    /// A literal of these bytes.
    blob: fn(&[u8]) -> String,
    analyze: &'static str,
}

/// Rows per filler INSERT: bounded transactions (undo, WAL) whatever `BENCH_SCALE` is. MySQL's
/// series is a two-way cross join of 0..999, which caps a statement at 10^6 rows.
const FILL_CHUNK: u64 = 100_000;

#[cfg(feature = "postgres")]
const POSTGRES_FILL: Dialect = Dialect {
    series: |lo, hi| format!("generate_series({lo}::bigint, {}::bigint) AS s(i)", hi - 1),
    digest: "sha256(int8send(i))",
    blob: |bytes| format!("decode('{}', 'hex')", hex::encode(bytes)),
    analyze: "ANALYZE idempotency_records",
};

// A recursive CTE of 1000 rows, joined with itself: MariaDB stops recursion at 1000 iterations
// by default (max_recursive_iterations), MySQL 8 likewise (cte_max_recursion_depth).
#[cfg(feature = "mysql")]
const MYSQL_FILL: Dialect = Dialect {
    series: |lo, hi| {
        format!(
            "(WITH RECURSIVE d(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM d WHERE n < 999) \
             SELECT {lo} + a.n + 1000 * b.n AS i FROM d a, d b \
             WHERE b.n <= {} AND a.n + 1000 * b.n < {}) AS s",
            (hi - lo - 1) / 1000,
            hi - lo
        )
    },
    digest: "UNHEX(SHA2(i, 256))",
    blob: |bytes| format!("X'{}'", hex::encode(bytes)),
    analyze: "ANALYZE TABLE idempotency_records",
};

#[cfg(feature = "sqlite")]
const SQLITE_FILL: Dialect = Dialect {
    series: |lo, hi| {
        format!(
            "(WITH RECURSIVE s(i) AS (SELECT {lo} UNION ALL SELECT i + 1 FROM s WHERE i < {}) \
             SELECT i FROM s)",
            hi - 1
        )
    },
    digest: "randomblob(32)",
    blob: |bytes| format!("X'{}'", hex::encode(bytes)),
    analyze: "ANALYZE",
};

/// The INSERT of filler rows `lo..hi`: completed 201s of `POST /layer` with the store's header
/// encoding and a small body, so the table's pages hold what real records would. Rows below
/// `expired` expired an hour ago or more; the others expire within the retention from `now`,
/// spread over its last hour, so the expiry index is ordered as a real table's would be.
fn filler_insert(dialect: &Dialect, lo: u64, hi: u64, expired: u64, now: i64) -> String {
    use sha2::{Digest, Sha256};

    let mut headers = Vec::new();
    for field in [&b"content-type"[..], b"application/json"] {
        headers.extend_from_slice(&u32::try_from(field.len()).unwrap_or(0).to_be_bytes());
        headers.extend_from_slice(field);
    }
    let expires = format!(
        "CASE WHEN i < {expired} THEN {} - i ELSE {} - i % 3600000 END",
        now - 3_600_000,
        now + TTL_MS
    );
    format!(
        "INSERT INTO idempotency_records (key_digest, principal, method, route, fingerprint, \
         state, status, headers, body, created_at, expires_at) \
         SELECT {}, NULL, 'POST', '/layer', {}, 'completed', 201, {}, {}, {expires} - {TTL_MS}, \
         {expires} FROM {}",
        dialect.digest,
        (dialect.blob)(&Sha256::digest(ORDER_BODY.as_bytes())),
        (dialect.blob)(&headers),
        (dialect.blob)(br#"{"id":1}"#),
        (dialect.series)(lo, hi),
    )
}

// ---------------------------------------------------------------------------------------------
// Counting: statements (sqlx's own statement log) and wire round trips (a counting TCP proxy).

static COUNTING: AtomicBool = AtomicBool::new(false);
static STATEMENTS: AtomicU64 = AtomicU64::new(0);

/// Counts sqlx's per-statement events (target `sqlx::query`) while [`COUNTING`] is on. Every
/// other callsite is disabled for good, so the engine's spans cost what they cost with no
/// subscriber at all.
struct StatementCounter;

impl<S: Subscriber> tracing_subscriber::Layer<S> for StatementCounter {
    fn register_callsite(&self, metadata: &'static Metadata<'static>) -> Interest {
        if metadata.target() == "sqlx::query" {
            Interest::sometimes()
        } else {
            Interest::never()
        }
    }

    fn enabled(&self, metadata: &Metadata<'_>, _ctx: Context<'_, S>) -> bool {
        metadata.target() == "sqlx::query" && COUNTING.load(Ordering::Relaxed)
    }

    fn on_event(&self, _event: &Event<'_>, _ctx: Context<'_, S>) {
        STATEMENTS.fetch_add(1, Ordering::Relaxed);
    }
}

/// What one database proxy saw: exchanges answered (pings apart) while [`COUNTING`] is on, and
/// how long it actually held the chunks it forwarded.
#[derive(Default)]
struct Wire {
    trips: AtomicU64,
    pings: AtomicU64,
    chunks: AtomicU64,
    held_us: AtomicU64,
}

impl Wire {
    fn mean_hold_ms(&self) -> f64 {
        let chunks = self.chunks.load(Ordering::Relaxed).max(1);
        self.held_us.load(Ordering::Relaxed) as f64 / chunks as f64 / 1000.0
    }
}

/// What the client's last chunk before the server's answer was.
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod exchange {
    pub(super) const NONE: u8 = 0;
    pub(super) const QUERY: u8 = 1;
    pub(super) const PING: u8 = 2;
}

/// Whether a client chunk is a pool's connection test and nothing else: PostgreSQL's lone Sync
/// (sqlx's `ping()`), or MySQL's COM_PING packet (sequence 0, payload 0x0e). A heuristic on
/// one read's bytes, not a protocol parser: a ping that shared a read with other messages
/// counts as a round trip, and it relies on sqlx sending the ping alone and waiting for it.
#[cfg(any(feature = "postgres", feature = "mysql"))]
fn is_ping(chunk: &[u8]) -> bool {
    const POSTGRES_SYNC: [u8; 5] = [b'S', 0, 0, 0, 4];
    const MYSQL_PING: [u8; 5] = [1, 0, 0, 0, 0x0e];
    chunk == POSTGRES_SYNC || chunk == MYSQL_PING
}

/// A TCP proxy to the database that counts round trips and can add latency. A round trip is
/// an answer from the server after the client has sent something: pipelined messages
/// (Parse/Bind/Execute/Sync in one flight) count once, as they cost one network wait. It reads
/// no protocol beyond [`is_ping`], so it counts MySQL's exchanges the same way as PostgreSQL's.
/// With a `delay`, every chunk is held that long in each direction, as on a network hop.
///
/// Blocking threads rather than tasks: tokio's timer rounds a 1 ms sleep up to the next
/// millisecond tick (1 to 2 ms), a thread's sleep is within tens of microseconds.
#[cfg(any(feature = "postgres", feature = "mysql"))]
fn db_proxy(upstream: SocketAddr, delay: Duration, wire: Arc<Wire>) -> std::io::Result<SocketAddr> {
    use std::net::{Shutdown, TcpListener, TcpStream};
    use std::sync::atomic::AtomicU8;

    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else {
                continue;
            };
            let wire = Arc::clone(&wire);
            std::thread::spawn(move || {
                let Ok(server) = TcpStream::connect(upstream) else {
                    let _ = client.shutdown(Shutdown::Both);
                    return;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let (Ok(client_read), Ok(server_read)) = (client.try_clone(), server.try_clone())
                else {
                    return;
                };
                let awaiting = Arc::new(AtomicU8::new(exchange::NONE));
                let sent = Arc::clone(&awaiting);
                let up_wire = Arc::clone(&wire);
                let up = std::thread::spawn(move || {
                    relay(client_read, server, delay, &up_wire, |chunk| {
                        // Marked on arrival, before forwarding, so the answer cannot overtake
                        // the mark. A ping never downgrades a query still awaiting its answer.
                        if is_ping(chunk) {
                            let _ = sent.compare_exchange(
                                exchange::NONE,
                                exchange::PING,
                                Ordering::SeqCst,
                                Ordering::SeqCst,
                            );
                        } else {
                            sent.store(exchange::QUERY, Ordering::SeqCst);
                        }
                    });
                });
                relay(server_read, client, delay, &wire, |_| {
                    let counter = match awaiting.swap(exchange::NONE, Ordering::SeqCst) {
                        exchange::QUERY => Some(&wire.trips),
                        exchange::PING => Some(&wire.pings),
                        _ => None,
                    };
                    if let Some(counter) = counter.filter(|_| COUNTING.load(Ordering::Relaxed)) {
                        counter.fetch_add(1, Ordering::Relaxed);
                    }
                });
                let _ = up.join();
            });
        }
    });
    Ok(addr)
}

/// Copies `from` to `to` until either end closes, calling `seen` on each chunk as it arrives
/// and writing it `delay` after its arrival. A writer thread keeps the chunks in order, and
/// each waits only for its own due time: one that arrived while an earlier one was held has
/// already served part of its delay, so a burst is not delayed once per chunk.
#[cfg(any(feature = "postgres", feature = "mysql"))]
fn relay(
    mut from: std::net::TcpStream,
    mut to: std::net::TcpStream,
    delay: Duration,
    wire: &Arc<Wire>,
    mut seen: impl FnMut(&[u8]),
) {
    use std::io::{Read, Write};

    let (queue, held) = std::sync::mpsc::channel::<(Instant, Vec<u8>)>();
    let wire = Arc::clone(wire);
    let writer = std::thread::spawn(move || {
        for (arrived, chunk) in held {
            std::thread::sleep((arrived + delay).saturating_duration_since(Instant::now()));
            let held_us = u64::try_from(arrived.elapsed().as_micros()).unwrap_or(u64::MAX);
            wire.chunks.fetch_add(1, Ordering::Relaxed);
            wire.held_us.fetch_add(held_us, Ordering::Relaxed);
            if to.write_all(&chunk).is_err() {
                break;
            }
        }
        let _ = to.shutdown(std::net::Shutdown::Write);
    });
    let mut buf = vec![0_u8; 64 * 1024];
    while let Ok(n @ 1..) = from.read(&mut buf) {
        let arrived = Instant::now();
        seen(&buf[..n]);
        if queue.send((arrived, buf[..n].to_vec())).is_err() {
            break;
        }
    }
    drop(queue);
    let _ = writer.join();
}

/// The order app on a pool of 4 that reaches the database through a [`db_proxy`] with `delay`.
/// `at` gives the pool's connect options for the proxy's port.
#[cfg(any(feature = "postgres", feature = "mysql"))]
async fn proxied_app<DB: sqlx::Database>(
    upstream: SocketAddr,
    delay: Duration,
    test_before_acquire: bool,
    at: impl Fn(u16) -> <DB::Connection as sqlx::Connection>::Options,
    router: fn(sqlx::Pool<DB>) -> Router,
) -> Result<(SocketAddr, Arc<Wire>), BoxError> {
    let wire = Arc::new(Wire::default());
    let proxy = db_proxy(upstream, delay, Arc::clone(&wire))?;
    let pool = sqlx::pool::PoolOptions::<DB>::new()
        .max_connections(4)
        .test_before_acquire(test_before_acquire)
        .connect_with(at(proxy.port()))
        .await?;
    Ok((serve(router(pool)).await?, wire))
}

// ---------------------------------------------------------------------------------------------
// Memory.

fn status_kib(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
}

/// Peak RSS since the last reset: VmHWM after resetting it through `clear_refs` where the
/// kernel allows that, else the maximum of VmRSS sampled every 5 ms.
struct PeakRss {
    resettable: bool,
    sampled: Arc<AtomicU64>,
}

impl PeakRss {
    fn start() -> Self {
        let resettable = std::fs::write("/proc/self/clear_refs", "5").is_ok();
        let sampled = Arc::new(AtomicU64::new(0));
        let max = Arc::clone(&sampled);
        std::thread::spawn(move || {
            loop {
                if let Some(rss) = status_kib("VmRSS:") {
                    max.fetch_max(rss, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        Self {
            resettable,
            sampled,
        }
    }

    fn reset(&self) {
        if self.resettable {
            let _ = std::fs::write("/proc/self/clear_refs", "5");
        }
        self.sampled
            .store(status_kib("VmRSS:").unwrap_or(0), Ordering::Relaxed);
    }

    fn peak_mib(&self) -> f64 {
        let sampled = self.sampled.load(Ordering::Relaxed);
        let peak = if self.resettable {
            status_kib("VmHWM:").unwrap_or(0).max(sampled)
        } else {
            sampled
        };
        peak as f64 / 1024.0
    }

    fn source(&self) -> &'static str {
        if self.resettable {
            "VmHWM (reset per scenario via /proc/self/clear_refs)"
        } else {
            "max VmRSS sampled every 5 ms"
        }
    }
}

fn rss_mib() -> f64 {
    status_kib("VmRSS:").unwrap_or(0) as f64 / 1024.0
}

// ---------------------------------------------------------------------------------------------
// Load generation.

#[derive(Clone, Copy, PartialEq)]
enum Keys {
    /// No `Idempotency-Key` header.
    None,
    /// A key never sent before on every request.
    Fresh,
    /// One key for the whole scenario, so every request after the first replays.
    Fixed,
}

#[derive(Clone)]
struct Plan {
    addr: SocketAddr,
    path: &'static str,
    body: Bytes,
    keys: Keys,
    key_prefix: String,
    conns: usize,
    duration: Duration,
    /// Stop after this many requests in total (the soak run).
    limit: Option<u64>,
    record_latency: bool,
    /// Session cookies, one per client: connection `i` sends cookie `i % len`; none if empty.
    cookies: Arc<[HeaderValue]>,
    /// Stop once this is set, before `duration` is up (the load that runs alongside a purge).
    stop: Option<Arc<AtomicBool>>,
}

#[derive(Default)]
struct Sample {
    requests: u64,
    unexpected: u64,
    elapsed: Duration,
    latencies_us: Vec<u32>,
    peak_mib: f64,
}

impl Sample {
    fn merge(&mut self, other: Sample) {
        self.requests += other.requests;
        self.unexpected += other.unexpected;
        self.elapsed += other.elapsed;
        self.latencies_us.extend(other.latencies_us);
        self.peak_mib = self.peak_mib.max(other.peak_mib);
    }

    fn rps(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    fn percentile_ms(&mut self, q: f64) -> f64 {
        if self.latencies_us.is_empty() {
            return 0.0;
        }
        self.latencies_us.sort_unstable();
        let i = ((self.latencies_us.len() as f64 * q) as usize).min(self.latencies_us.len() - 1);
        f64::from(self.latencies_us[i]) / 1000.0
    }

    fn max_ms(&self) -> f64 {
        f64::from(self.latencies_us.iter().copied().max().unwrap_or(0)) / 1000.0
    }

    /// Requests, throughput and tail latency in a line.
    fn summary(&mut self) -> String {
        let p99 = self.percentile_ms(0.99);
        format!(
            "{} requests in {:.1} s, {:.0} req/s, p99 {p99:.2} ms, max {:.2} ms, {} non-2xx",
            self.requests,
            self.elapsed.as_secs_f64(),
            self.rps(),
            self.max_ms(),
            self.unexpected
        )
    }

    /// Requests that took longer than `limit`.
    fn over(&self, limit: Duration) -> usize {
        let limit = u32::try_from(limit.as_micros()).unwrap_or(u32::MAX);
        self.latencies_us.iter().filter(|&&us| us > limit).count()
    }
}

type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

async fn connect(addr: SocketAddr) -> Result<Sender, BoxError> {
    let stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    Ok(sender)
}

async fn send(
    sender: &mut Sender,
    path: &str,
    body: &Bytes,
    key: Option<&str>,
    cookie: Option<&HeaderValue>,
) -> Result<StatusCode, BoxError> {
    let mut request = Request::post(path)
        .header(header::HOST, "127.0.0.1")
        .header(header::CONTENT_TYPE, "application/json");
    if let Some(key) = key {
        request = request.header("idempotency-key", HeaderValue::from_str(key)?);
    }
    if let Some(cookie) = cookie {
        request = request.header(header::COOKIE, cookie);
    }
    let request = request.body(Full::new(body.clone()))?;
    sender.ready().await?;
    let response = sender.send_request(request).await?;
    let status = response.status();
    response.into_body().collect().await?;
    Ok(status)
}

/// Runs `plan.conns` connections, each sending requests back to back until the time is up.
async fn drive(plan: &Plan, progress: Option<Arc<AtomicU64>>) -> Result<Sample, BoxError> {
    let started = Instant::now();
    let deadline = started + plan.duration;
    let total = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::with_capacity(plan.conns);
    for worker in 0..plan.conns {
        let plan = plan.clone();
        let total = Arc::clone(&total);
        let progress = progress.clone();
        workers.push(tokio::spawn(async move {
            let mut sender = connect(plan.addr).await?;
            let mut sample = Sample::default();
            let cookie = plan
                .cookies
                .get(worker % plan.cookies.len().max(1))
                .cloned();
            let fixed = format!("{}-fixed", plan.key_prefix);
            let mut seq = 0_u64;
            let stopped = || {
                plan.stop
                    .as_ref()
                    .is_some_and(|s| s.load(Ordering::Relaxed))
            };
            while Instant::now() < deadline && !stopped() {
                if let Some(limit) = plan.limit
                    && total.fetch_add(1, Ordering::Relaxed) >= limit
                {
                    break;
                }
                let key = match plan.keys {
                    Keys::None => None,
                    Keys::Fresh => Some(format!("{}-{worker}-{seq}", plan.key_prefix)),
                    Keys::Fixed => Some(fixed.clone()),
                };
                seq += 1;
                let sent = Instant::now();
                let status = send(
                    &mut sender,
                    plan.path,
                    &plan.body,
                    key.as_deref(),
                    cookie.as_ref(),
                )
                .await?;
                if plan.record_latency {
                    sample
                        .latencies_us
                        .push(u32::try_from(sent.elapsed().as_micros()).unwrap_or(u32::MAX));
                }
                sample.requests += 1;
                if !status.is_success() {
                    sample.unexpected += 1;
                }
                if let Some(progress) = &progress {
                    progress.fetch_add(1, Ordering::Relaxed);
                }
            }
            Ok::<_, BoxError>(sample)
        }));
    }
    let mut merged = Sample::default();
    for worker in workers {
        merged.merge(worker.await??);
    }
    merged.elapsed = started.elapsed();
    Ok(merged)
}

/// `STORM` connections send the same fresh key at the same moment, round after round. They are
/// one client retrying, so they share the plan's first session cookie.
async fn storm(plan: &Plan) -> Result<(Sample, u64), BoxError> {
    const STOP: u64 = u64::MAX;
    let start = Arc::new(Barrier::new(STORM + 1));
    let done = Arc::new(Barrier::new(STORM + 1));
    let round = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::with_capacity(STORM);
    for _ in 0..STORM {
        let (plan, start, done, round) = (
            plan.clone(),
            Arc::clone(&start),
            Arc::clone(&done),
            Arc::clone(&round),
        );
        workers.push(tokio::spawn(async move {
            let mut sender = connect(plan.addr).await;
            let mut sample = Sample::default();
            loop {
                start.wait().await;
                let r = round.load(Ordering::SeqCst);
                if r == STOP {
                    break;
                }
                // A failed connection still takes part in the barriers, or the storm hangs.
                if let Ok(sender) = sender.as_mut() {
                    let key = format!("{}-storm-{r}", plan.key_prefix);
                    let sent = Instant::now();
                    let cookie = plan.cookies.first();
                    match send(sender, plan.path, &plan.body, Some(&key), cookie).await {
                        Ok(status) if status.is_success() => {}
                        _ => sample.unexpected += 1,
                    }
                    sample
                        .latencies_us
                        .push(u32::try_from(sent.elapsed().as_micros()).unwrap_or(u32::MAX));
                    sample.requests += 1;
                }
                done.wait().await;
            }
            let _ = sender?;
            Ok::<_, BoxError>(sample)
        }));
    }
    let started = Instant::now();
    let mut rounds = 0_u64;
    loop {
        let stop = started.elapsed() >= plan.duration;
        round.store(if stop { STOP } else { rounds }, Ordering::SeqCst);
        start.wait().await;
        if stop {
            break;
        }
        done.wait().await;
        rounds += 1;
    }
    let mut merged = Sample::default();
    for worker in workers {
        merged.merge(worker.await??);
    }
    merged.elapsed = started.elapsed();
    Ok((merged, rounds))
}

/// Statements, and wire round trips and pings per request, over `n` sequential requests on one
/// connection.
async fn count_per_request(
    addr: SocketAddr,
    path: &'static str,
    keys: Keys,
    prefix: &str,
    n: usize,
    wire: Option<&Wire>,
) -> Result<(f64, Option<(f64, f64)>), BoxError> {
    let body = Bytes::from_static(ORDER_BODY.as_bytes());
    let mut sender = connect(addr).await?;
    let key = |i: usize| match keys {
        Keys::None => None,
        Keys::Fresh => Some(format!("{prefix}-{i}")),
        Keys::Fixed => Some(format!("{prefix}-fixed")),
    };
    // Warm up: connections opened, statements prepared, the replayed record written.
    for i in 0..20 {
        send(&mut sender, path, &body, key(i).as_deref(), None).await?;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    STATEMENTS.store(0, Ordering::SeqCst);
    if let Some(wire) = wire {
        wire.trips.store(0, Ordering::SeqCst);
        wire.pings.store(0, Ordering::SeqCst);
    }
    COUNTING.store(true, Ordering::SeqCst);
    for i in 20..20 + n {
        let status = send(&mut sender, path, &body, key(i).as_deref(), None).await?;
        if !status.is_success() {
            return Err(format!("{path}: {status} while counting").into());
        }
    }
    // The pool tests a connection as it takes it back, after the response: wait for that too.
    tokio::time::sleep(Duration::from_millis(300)).await;
    COUNTING.store(false, Ordering::SeqCst);
    let statements = STATEMENTS.load(Ordering::SeqCst) as f64 / n as f64;
    let per_request = |counter: &AtomicU64| counter.load(Ordering::SeqCst) as f64 / n as f64;
    let trips = wire.map(|w| (per_request(&w.trips), per_request(&w.pings)));
    Ok((statements, trips))
}

// ---------------------------------------------------------------------------------------------
// Servers and backends.

async fn serve(router: Router) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, router).await {
            eprintln!("server failed: {error}");
        }
    });
    Ok(addr)
}

type CountOrders = Box<dyn Fn(&Runtime) -> Result<i64, BoxError>>;

struct Backend {
    name: &'static str,
    addr: SocketAddr,
    /// The same app on a pool that goes through the counting proxy, where there is a wire.
    counting_addr: SocketAddr,
    wire: Option<Arc<Wire>>,
    /// The same app on a pool whose every chunk to and from the database is held
    /// `BENCH_DELAY_MS` (where there is a wire and `latency-1ms` is in the run).
    delayed: Option<(SocketAddr, Arc<Wire>)>,
    orders: CountOrders,
    records: Records,
    note: String,
    /// The peer crate's server on this backend's database (PostgreSQL only).
    peer: Option<Peer>,
}

#[cfg(feature = "sqlite")]
fn sqlite_backend(
    server: &Runtime,
    dir: &std::path::Path,
    test_before_acquire: bool,
) -> Result<Backend, BoxError> {
    use sqlx::sqlite::{
        SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous,
    };
    let options = SqliteConnectOptions::new()
        .filename(dir.join("bench.db"))
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Normal);
    server.block_on(async {
        let pool = SqlitePoolOptions::new()
            .max_connections(8)
            .test_before_acquire(test_before_acquire)
            .connect_with(options)
            .await?;
        sqlx::raw_sql(sqlite_app::SCHEMA).execute(&pool).await?;
        axum_idempotency::SqliteStore::new(pool.clone()).migrate().await?;
        let addr = serve(sqlite_app::router(pool.clone())).await?;
        let records = sqlite_app::records(pool.clone(), &SQLITE_FILL);
        let orders: CountOrders = Box::new(move |rt: &Runtime| {
            let pool = pool.clone();
            rt.block_on(async move {
                Ok(sqlx::query_scalar("SELECT COUNT(*) FROM orders")
                    .fetch_one(&pool)
                    .await?)
            })
        });
        Ok(Backend {
            name: "sqlite",
            addr,
            counting_addr: addr,
            wire: None,
            delayed: None,
            orders,
            records,
            peer: None,
            note: format!(
                "file in a temp dir, WAL, synchronous=NORMAL, pool of 8, test_before_acquire={test_before_acquire}"
            ),
        })
    })
}

#[cfg(feature = "postgres")]
fn postgres_backend(
    server: &Runtime,
    url: &str,
    run: &str,
    test_before_acquire: bool,
    delay: Duration,
) -> Result<Backend, BoxError> {
    use std::str::FromStr;

    use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
    let schema = format!("bench_http_{run}");
    let base = PgConnectOptions::from_str(url)?;
    server.block_on(async {
        let admin = PgPoolOptions::new()
            .max_connections(1)
            .connect_with(base.clone())
            .await?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
            .execute(&admin)
            .await?;
        let options = base.clone().options([("search_path", schema.as_str())]);
        let pool = PgPoolOptions::new()
            .max_connections(16)
            .test_before_acquire(test_before_acquire)
            .connect_with(options.clone())
            .await?;
        sqlx::raw_sql(postgres_app::SCHEMA).execute(&pool).await?;
        axum_idempotency::PgStore::new(pool.clone())
            .migrate()
            .await?;
        let addr = serve(postgres_app::router(pool.clone())).await?;

        let upstream = tokio::net::lookup_host((base.get_host(), base.get_port()))
            .await?
            .next()
            .ok_or("cannot resolve the database host")?;
        let at = |port: u16| options.clone().host("127.0.0.1").port(port);
        let (counting_addr, wire) = proxied_app(
            upstream,
            Duration::ZERO,
            test_before_acquire,
            at,
            postgres_app::router,
        )
        .await?;
        let delayed = if wanted("latency-1ms") {
            Some(
                proxied_app(
                    upstream,
                    delay,
                    test_before_acquire,
                    at,
                    postgres_app::router,
                )
                .await?,
            )
        } else {
            None
        };
        let records = postgres_app::records(pool.clone(), &POSTGRES_FILL);

        let orders: CountOrders = Box::new(move |rt: &Runtime| {
            let pool = pool.clone();
            rt.block_on(async move {
                Ok(sqlx::query_scalar("SELECT COUNT(*) FROM orders")
                    .fetch_one(&pool)
                    .await?)
            })
        });
        Ok(Backend {
            name: "postgres",
            addr,
            counting_addr,
            wire: Some(wire),
            delayed,
            orders,
            records,
            peer: None,
            note: format!(
                "server on loopback, schema {schema}, pool of 16, sqlx defaults otherwise"
            ),
        })
    })
}

#[cfg(feature = "postgres")]
fn drop_postgres_schema(server: &Runtime, url: &str, run: &str) -> Result<(), BoxError> {
    server.block_on(async {
        let admin = sqlx::PgPool::connect(url).await?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS bench_http_{run} CASCADE"
        )))
        .execute(&admin)
        .await?;
        Ok(())
    })
}

#[cfg(feature = "mysql")]
fn mysql_backend(
    server: &Runtime,
    url: &str,
    run: &str,
    test_before_acquire: bool,
    delay: Duration,
) -> Result<Backend, BoxError> {
    use std::str::FromStr;

    use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
    let database = format!("bench_http_{run}");
    let base = MySqlConnectOptions::from_str(url)?;
    server.block_on(async {
        let admin = MySqlPoolOptions::new()
            .max_connections(1)
            .connect_with(base.clone())
            .await?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}")))
            .execute(&admin)
            .await?;
        let options = base.clone().database(&database);
        let pool = MySqlPoolOptions::new()
            .max_connections(16)
            .test_before_acquire(test_before_acquire)
            .connect_with(options.clone())
            .await?;
        sqlx::raw_sql(mysql_app::SCHEMA).execute(&pool).await?;
        axum_idempotency::MySqlStore::new(pool.clone()).migrate().await?;
        let addr = serve(mysql_app::router(pool.clone())).await?;

        let upstream = tokio::net::lookup_host((base.get_host(), base.get_port()))
            .await?
            .next()
            .ok_or("cannot resolve the database host")?;
        let at = |port: u16| options.clone().host("127.0.0.1").port(port);
        let (counting_addr, wire) = proxied_app(
            upstream,
            Duration::ZERO,
            test_before_acquire,
            at,
            mysql_app::router,
        )
        .await?;
        let delayed = if wanted("latency-1ms") {
            Some(proxied_app(upstream, delay, test_before_acquire, at, mysql_app::router).await?)
        } else {
            None
        };
        let records = mysql_app::records(pool.clone(), &MYSQL_FILL);

        let orders: CountOrders = Box::new(move |rt: &Runtime| {
            let pool = pool.clone();
            rt.block_on(async move {
                Ok(sqlx::query_scalar("SELECT COUNT(*) FROM orders")
                    .fetch_one(&pool)
                    .await?)
            })
        });
        Ok(Backend {
            name: "mysql",
            addr,
            counting_addr,
            wire: Some(wire),
            delayed,
            orders,
            records,
            peer: None,
            note: format!(
                "MariaDB server on loopback, database {database}, pool of 16, sqlx defaults otherwise"
            ),
        })
    })
}

#[cfg(feature = "mysql")]
fn drop_mysql_database(server: &Runtime, url: &str, run: &str) -> Result<(), BoxError> {
    server.block_on(async {
        let admin = sqlx::MySqlPool::connect(url).await?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS bench_http_{run}"
        )))
        .execute(&admin)
        .await?;
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// The peer crate: axum-idempotent, served by benches/peer in a child process.

/// The running peer server; dropping it stops the process.
struct Peer {
    child: std::process::Child,
    addr: SocketAddr,
    /// What the peer says about its store and keying.
    store: String,
    /// One session per load-generator connection: axum-idempotent caches only within a session.
    cookies: Arc<[HeaderValue]>,
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Builds and starts the peer on the PostgreSQL schema of this run. The error is the reason to
/// print when it cannot run.
#[cfg(feature = "postgres")]
fn start_peer(settings: &Settings, client: &Runtime, run: &str) -> Result<Peer, String> {
    use std::io::BufRead;
    use std::process::{Command, Stdio};

    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let target = root.join("target").join("peer");
    // Its own target dir: the one of this bench may still be locked by the cargo running it.
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    eprintln!("[peer] building benches/peer (axum-idempotent)…");
    let built = Command::new(&cargo)
        .args(["build", "--release", "--quiet", "--manifest-path"])
        .arg(root.join("benches/peer/Cargo.toml"))
        .arg("--target-dir")
        .arg(&target)
        .stdout(Stdio::null())
        .status()
        .map_err(|e| format!("cannot run {cargo}: {e}"))?;
    if !built.success() {
        return Err(format!("`cargo build` of benches/peer failed ({built})"));
    }
    let mut child = Command::new(target.join("release/axum-idempotency-bench-peer"))
        .env("PEER_DATABASE_URL", &settings.database_url)
        .env("PEER_SCHEMA", format!("bench_http_{run}"))
        .env("PEER_STORE", &settings.peer_store)
        .env("PEER_REDIS_URL", &settings.peer_redis)
        .env("PEER_KEYING", &settings.peer_keying)
        .env(
            "PEER_TEST_BEFORE_ACQUIRE",
            settings.test_before_acquire.to_string(),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start the peer binary: {e}"))?;
    let mut line = String::new();
    if let Some(stdout) = child.stdout.take() {
        let _ = std::io::BufReader::new(stdout).read_line(&mut line);
    }
    let started = line
        .trim()
        .strip_prefix("listening ")
        .and_then(|rest| rest.split_once(' '))
        .and_then(|(addr, store)| Some((addr.parse::<SocketAddr>().ok()?, store.to_owned())));
    let Some((addr, store)) = started else {
        let _ = child.kill();
        let _ = child.wait();
        let why = line
            .trim()
            .strip_prefix("unavailable ")
            .unwrap_or(line.trim());
        return Err(format!("the peer did not start: {why}"));
    };
    let mut peer = Peer {
        child,
        addr,
        store,
        cookies: Arc::from([]),
    };
    let cookies = client
        .block_on(peer_sessions(addr, settings.conns.max(1)))
        .map_err(|e| format!("the peer could not start sessions: {e}"))?;
    peer.cookies = cookies.into();
    Ok(peer)
}

/// Starts `n` sessions on the peer and returns their `Cookie` header values.
#[cfg(feature = "postgres")]
async fn peer_sessions(addr: SocketAddr, n: usize) -> Result<Vec<HeaderValue>, BoxError> {
    let mut sender = connect(addr).await?;
    let mut cookies = Vec::with_capacity(n);
    for _ in 0..n {
        let request = Request::post("/session")
            .header(header::HOST, "127.0.0.1")
            .body(Full::new(Bytes::new()))?;
        sender.ready().await?;
        let response = sender.send_request(request).await?;
        let status = response.status();
        let cookie = response
            .headers()
            .get(header::SET_COOKIE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .map(HeaderValue::from_str)
            .transpose()?;
        let body = response.into_body().collect().await?.to_bytes();
        match cookie {
            Some(cookie) if status.is_success() => cookies.push(cookie),
            _ => {
                return Err(
                    format!("POST /session: {status} {}", String::from_utf8_lossy(&body)).into(),
                );
            }
        }
    }
    Ok(cookies)
}

/// The middleware alone: an empty handler with and without the layer, 1 KiB JSON bodies. The
/// layer needs a store; it is SQLite on tmpfs (`/dev/shm` where it exists), WAL, no fsync,
/// pool of 8 without the pre-acquire ping: the nearest to no database a keyed request can get.
#[cfg(feature = "sqlite")]
fn noop_app(server: &Runtime, dir: &std::path::Path) -> Result<SocketAddr, BoxError> {
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

fn json_body(len: usize) -> Bytes {
    let head = r#"{"customer":"c-42","items":[{"sku":"widget","qty":3},{"sku":"gadget","qty":1}],"sku":"widget","qty":3,"note":""#;
    let tail = "\"}";
    let pad = len.saturating_sub(head.len() + tail.len());
    let mut body = String::with_capacity(len);
    body.push_str(head);
    body.extend(std::iter::repeat_n('x', pad));
    body.push_str(tail);
    Bytes::from(body)
}

// ---------------------------------------------------------------------------------------------
// Report.

struct Row {
    group: String,
    scenario: String,
    conns: usize,
    sample: Sample,
    note: String,
}

struct Ratio {
    what: String,
    /// `None` when the baseline was left out by `BENCH_ONLY`.
    value: Option<f64>,
    target: Option<Target>,
}

#[derive(Clone, Copy)]
enum Target {
    AtLeast(f64),
    AtMost(f64),
}

impl Target {
    /// The target column and the met column of a table row for `value`.
    fn verdict(target: Option<Self>, value: f64) -> (String, &'static str) {
        let (text, met) = match target {
            Some(Self::AtLeast(t)) => (format!("≥ {t:.2}"), value >= t),
            Some(Self::AtMost(t)) => (format!("≤ {t:.2}"), value <= t),
            None => return ("–".into(), ""),
        };
        (text, if met { "yes" } else { "**no**" })
    }
}

#[derive(Default)]
struct Report {
    rows: Vec<Row>,
    /// Sequential requests on one connection (`latency`, `latency-1ms`).
    latency: Vec<Row>,
    ratios: Vec<Ratio>,
    trips: Vec<String>,
    /// Table rows of the scale section.
    scale: Vec<String>,
    notes: Vec<String>,
    memory: Vec<String>,
    soak: Vec<String>,
}

impl Report {
    fn rps(&self, group: &str, scenario: &str) -> Option<f64> {
        self.rows
            .iter()
            .find(|r| r.group == group && r.scenario == scenario)
            .map(|r| r.sample.rps())
    }

    fn latency_p50(&mut self, group: &str, scenario: &str) -> Option<f64> {
        self.latency
            .iter_mut()
            .find(|r| r.group == group && r.scenario == scenario)
            .map(|r| r.sample.percentile_ms(0.50))
    }

    /// A ratio of two scenarios, `None` where `BENCH_ONLY` skipped them. One whose numerator
    /// was skipped is left out of the table; one whose baseline was skipped is listed without
    /// a value, so the table says which figure is missing rather than showing a 0 or NaN.
    fn push_ratio(
        &mut self,
        what: String,
        of: Option<f64>,
        over: Option<f64>,
        target: Option<Target>,
    ) {
        if let Some(of) = of {
            self.ratios.push(Ratio {
                what,
                value: over.map(|over| of / over),
                target,
            });
        }
    }

    fn ratio(&mut self, group: &str, what: &str, over: &str, target: Option<Target>) {
        let (of, by) = (self.rps(group, what), self.rps(group, over));
        self.push_ratio(format!("{group}: {what} / {over}"), of, by, target);
    }

    /// `what`'s p50 over `over`'s at one connection; `label` names the comparison.
    fn latency_ratio(
        &mut self,
        group: &str,
        what: &str,
        over: &str,
        target: Option<Target>,
        label: &str,
    ) {
        let (of, by) = (self.latency_p50(group, what), self.latency_p50(group, over));
        self.push_ratio(
            format!("{group}, 1 connection: {what} p50 / {over} p50{label}"),
            of,
            by,
            target,
        );
    }

    /// One row of the scale table; `check` is the target and whether it is met.
    fn scale_row(&mut self, backend: &str, figure: &str, value: String, check: (String, &str)) {
        let (target, met) = check;
        self.scale.push(format!(
            "| {backend} | {figure} | {value} | {target} | {met} |"
        ));
    }

    fn print_rows(title: &str, rows: &mut [Row]) {
        if rows.is_empty() {
            return;
        }
        println!("\n## {title}\n");
        println!(
            "| backend | scenario | conns | requests | req/s | p50 ms | p99 ms | peak RSS MiB | non-2xx | note |"
        );
        println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---|");
        for row in rows {
            let (p50, p99) = (
                row.sample.percentile_ms(0.50),
                row.sample.percentile_ms(0.99),
            );
            println!(
                "| {} | {} | {} | {} | {:.0} | {:.2} | {:.2} | {:.1} | {} | {} |",
                row.group,
                row.scenario,
                row.conns,
                row.sample.requests,
                row.sample.rps(),
                p50,
                p99,
                row.sample.peak_mib,
                row.sample.unexpected,
                row.note
            );
        }
    }

    fn print(&mut self) {
        Self::print_rows("Throughput and latency", &mut self.rows);
        Self::print_rows(
            "Latency at one connection (sequential requests)",
            &mut self.latency,
        );
        if !self.ratios.is_empty() {
            println!("\n## Ratios (same run)\n");
            println!("| ratio | measured | target | met |");
            println!("|---|---:|---:|---|");
        }
        for ratio in &self.ratios {
            let (measured, target, met) = match ratio.value {
                Some(value) => {
                    let (target, met) = Target::verdict(ratio.target, value);
                    (format!("{value:.2}"), target, met)
                }
                None => {
                    let (target, _) = Target::verdict(ratio.target, f64::NAN);
                    ("– (baseline skipped)".to_owned(), target, "")
                }
            };
            println!("| {} | {measured} | {target} | {met} |", ratio.what);
        }
        if !self.trips.is_empty() {
            println!("\n## Database work per request\n");
            println!(
                "| backend | scenario | statements logged by sqlx / req | round trips / req (excluding pings) | pings / req | all exchanges / req |"
            );
            println!("|---|---|---:|---:|---:|---:|");
            for line in &self.trips {
                println!("{line}");
            }
        }
        if !self.scale.is_empty() {
            println!("\n## Scale: a large records table\n");
            println!("| backend | figure | value | target | met |");
            println!("|---|---|---|---:|---|");
            for line in &self.scale {
                println!("{line}");
            }
        }
        for (title, lines) in [
            ("Soak: RSS over a long run", &self.soak),
            ("Memory: concurrent 1 MiB requests", &self.memory),
            ("Notes", &self.notes),
        ] {
            if !lines.is_empty() {
                println!("\n## {title}\n");
                for line in lines {
                    println!("{line}");
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------

fn main() -> Result<(), BoxError> {
    let settings = Settings::from_env();
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(StatementCounter))?;
    let server = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("bench-server")
        .enable_all()
        .build()?;
    let client = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("bench-load")
        .enable_all()
        .build()?;
    let run = format!("{}_{}", std::process::id(), now_ms());
    let peak = PeakRss::start();
    let mut report = Report::default();
    let dir = std::env::temp_dir().join(format!("axum-idempotency-bench-{run}"));
    std::fs::create_dir_all(&dir)?;

    println!(
        "# cargo bench --bench http — {} s × {} rounds per scenario, {} connections",
        settings.secs, settings.rounds, settings.conns
    );
    let mut backends = Vec::new();
    // A listed backend is either set up below or the run stops with its error, so "used" is
    // "listed and built in".
    let listed = |name: &str| settings.backends.iter().any(|b| b == name);
    let postgres_used = cfg!(feature = "postgres") && listed("postgres");
    let mysql_used = cfg!(feature = "mysql") && listed("mysql");
    for name in &settings.backends {
        match name.as_str() {
            #[cfg(feature = "sqlite")]
            "sqlite" => backends.push(sqlite_backend(&server, &dir, settings.test_before_acquire)?),
            #[cfg(feature = "postgres")]
            "postgres" => {
                backends.push(postgres_backend(
                    &server,
                    &settings.database_url,
                    &run,
                    settings.test_before_acquire,
                    settings.delay,
                )?);
            }
            #[cfg(feature = "mysql")]
            "mysql" => {
                backends.push(mysql_backend(
                    &server,
                    &settings.mysql_url,
                    &run,
                    settings.test_before_acquire,
                    settings.delay,
                )?);
            }
            #[cfg(not(feature = "sqlite"))]
            "sqlite" => report.notes.push(skipped_feature(name)),
            #[cfg(not(feature = "postgres"))]
            "postgres" => report.notes.push(skipped_feature(name)),
            #[cfg(not(feature = "mysql"))]
            "mysql" => report.notes.push(skipped_feature(name)),
            other => report
                .notes
                .push(format!("- {other}: skipped, unknown backend.")),
        }
    }

    match peer_or_reason(&settings, &client, &run, postgres_used) {
        Ok(peer) => {
            report.notes.push(format!(
                "- peer: axum-idempotent 0.6 on the same order handler and SQL, served by \
                 benches/peer in a child process (tokio, 2 workers, pool of 16 on the same \
                 schema): {}. Each of the {} connections carries a session of its own \
                 (the layer caches only within a session); the storm's 64 share one. \
                 `peer-bare` is the same handler in that process without layers. Peak RSS \
                 of the peer rows is this process's (the load generator's), not the peer's.",
                peer.store, settings.conns
            ));
            if let Some(backend) = backends.iter_mut().find(|b| b.name == "postgres") {
                backend.peer = Some(peer);
            }
        }
        Err(why) => {
            eprintln!("[peer] skipped: {why}");
            report
                .notes
                .push(format!("- peer (axum-idempotent): skipped, {why}."));
        }
    }
    for backend in &backends {
        run_backend(
            &settings,
            &server,
            &client,
            &peak,
            &run,
            backend,
            &mut report,
        )?;
        run_latency(&settings, &client, &peak, &run, backend, &mut report)?;
    }
    #[cfg(feature = "sqlite")]
    run_noop(
        &settings,
        &server,
        &client,
        &peak,
        &run,
        backends.iter().find_map(|b| b.peer.as_ref()),
        &mut report,
    )?;
    // The soak before the memory test: RSS in the soak is then not inflated by the memory test's
    // 1 MiB allocations, which the allocator keeps.
    if let Some(backend) = backends
        .iter()
        .find(|b| b.name == "postgres")
        .or(backends.first())
        .filter(|_| wanted("soak"))
    {
        run_soak(&settings, &client, &run, backend, &mut report)?;
    }
    if let Some(backend) = backends.first().filter(|_| wanted("memory")) {
        run_big_bodies(&settings, &client, &peak, &run, backend, &mut report)?;
    }
    // Last: the filled table would weigh on every scenario after it.
    if settings.scale.is_some() && wanted("scale") {
        for backend in &backends {
            run_scale(
                &settings,
                &server,
                &client,
                &peak,
                &run,
                backend,
                &mut report,
            )?;
        }
    }

    for backend in &backends {
        report
            .notes
            .push(format!("- {}: {}.", backend.name, backend.note));
    }
    report.notes.push(
        "- Statements are sqlx's own `sqlx::query` events, counted by a tracing layer; sqlx does \
         not log transaction control on SQLite (BEGIN, COMMIT) nor a custom BEGIN on PostgreSQL; \
         on MySQL it logs both. \
         Wire round trips are counted by a TCP proxy between the pool and the server (PostgreSQL \
         or MariaDB): one per answer that follows a client send. Pool pings (sqlx tests a \
         connection when it hands it out, if `test_before_acquire`, and again when it takes it \
         back) are counted apart: the proxy takes a client chunk that is a lone PostgreSQL Sync \
         or a lone MySQL COM_PING for a ping, a heuristic on the bytes of one read. A ping that \
         carries the ROLLBACK sqlx queues for a dropped transaction (PostgreSQL, under the \
         layer) shares one read with it and is counted as a round trip: compare \
         `all exchanges`. Both over sequential requests on one connection, after a warm-up."
            .into(),
    );
    report.notes.push(format!(
        "- Peak RSS is the whole process (servers and load generator): {}.",
        peak.source()
    ));
    report.print();

    let _ = std::fs::remove_dir_all(&dir);
    // The peer holds connections to the schema: stopped first.
    for backend in &mut backends {
        drop(backend.peer.take());
    }
    #[cfg(feature = "postgres")]
    if postgres_used {
        drop_postgres_schema(&server, &settings.database_url, &run)?;
    }
    #[cfg(feature = "mysql")]
    if mysql_used {
        drop_mysql_database(&server, &settings.mysql_url, &run)?;
    }
    let _ = (postgres_used, mysql_used);
    Ok(())
}

/// The peer server, or why this run goes without it.
fn peer_or_reason(
    settings: &Settings,
    client: &Runtime,
    run: &str,
    postgres_used: bool,
) -> Result<Peer, String> {
    if !settings.peer {
        return Err("BENCH_PEER=false".into());
    }
    if !postgres_used {
        return Err("it runs on PostgreSQL and the postgres backend is not in this run".into());
    }
    #[cfg(feature = "postgres")]
    return start_peer(settings, client, run);
    #[cfg(not(feature = "postgres"))]
    {
        let _ = (client, run);
        Err("this build lacks the `postgres` feature".into())
    }
}

#[cfg(not(all(feature = "sqlite", feature = "postgres", feature = "mysql")))]
fn skipped_feature(name: &str) -> String {
    format!("- {name}: skipped, this build lacks the `{name}` feature (add `--features {name}`).")
}

/// Runs a duplicate storm on `plan` and returns its sample, how many keys it stormed and how
/// many orders the backend's table gained meanwhile.
fn measure_storm(
    server: &Runtime,
    client: &Runtime,
    peak: &PeakRss,
    backend: &Backend,
    plan: &Plan,
) -> Result<(Sample, u64, i64), BoxError> {
    let before = (backend.orders)(server)?;
    peak.reset();
    let (mut sample, keys) = client.block_on(storm(plan))?;
    sample.peak_mib = peak.peak_mib();
    let executed = (backend.orders)(server)? - before;
    Ok((sample, keys, executed))
}

/// Whether `BENCH_ONLY` leaves this scenario (or section) in.
fn wanted(scenario: &str) -> bool {
    std::env::var("BENCH_ONLY").map_or(true, |only| only.split(',').any(|o| o.trim() == scenario))
}

/// The peer's process without its layer (`base`'s path there), and `path` under its layer with
/// fresh keys and with one key, named by `names` in that order.
fn peer_plans(
    peer: &Peer,
    base: &Plan,
    path: &'static str,
    names: [&'static str; 3],
) -> [(&'static str, Plan); 3] {
    let on_peer = Plan {
        addr: peer.addr,
        cookies: Arc::clone(&peer.cookies),
        ..base.clone()
    };
    let [bare, fresh, replay] = names;
    [
        (bare, on_peer.clone()),
        (
            fresh,
            Plan {
                path,
                keys: Keys::Fresh,
                ..on_peer.clone()
            },
        ),
        (
            replay,
            Plan {
                path,
                keys: Keys::Fixed,
                ..on_peer
            },
        ),
    ]
}

/// Measures `plans` (the `include`d ones) round after round, for `BENCH_ROUNDS` rounds of
/// `plan.duration` each; `None` for a plan left out, so that no empty sample reaches a table.
fn measure_rounds(
    settings: &Settings,
    client: &Runtime,
    peak: &PeakRss,
    plans: &[(&str, Plan)],
    include: fn(&str) -> bool,
) -> Result<Vec<Option<Sample>>, BoxError> {
    let mut samples: Vec<Sample> = plans.iter().map(|_| Sample::default()).collect();
    for round in 0..settings.rounds {
        // Each round starts one scenario later, so no scenario always follows the same one
        // (a checkpoint or WAL growth left by a write-heavy neighbour lands on all in turn).
        for step in 0..plans.len() {
            let index = (step + round) % plans.len();
            let (name, plan) = &plans[index];
            if !include(name) {
                continue;
            }
            let total = &mut samples[index];
            let mut plan = plan.clone();
            plan.key_prefix = format!("{}-{name}-r{round}", plan.key_prefix);
            if plan.keys == Keys::Fixed {
                // One key for all rounds: only the very first request executes.
                plan.key_prefix = format!("{}-{name}", plans[0].1.key_prefix);
            }
            // Warm up off the clock (connections, prepared statements, the replayed record).
            let mut warm = plan.clone();
            warm.duration = Duration::from_millis(300);
            warm.key_prefix = format!("{}-warm", plan.key_prefix);
            if plan.keys == Keys::Fixed {
                warm.key_prefix = plan.key_prefix.clone();
            }
            client.block_on(drive(&warm, None))?;
            peak.reset();
            let mut sample = client.block_on(drive(&plan, None))?;
            sample.peak_mib = peak.peak_mib();
            total.merge(sample);
        }
    }
    Ok(plans
        .iter()
        .zip(samples)
        .map(|((name, _), sample)| include(name).then_some(sample))
        .collect())
}

/// The order app's scenarios: name, route, keys.
const ORDER_SCENARIOS: [(&str, &str, Keys); 4] = [
    ("bare", "/bare", Keys::None),
    ("manual", "/manual", Keys::Fresh),
    ("layer-fresh", "/layer", Keys::Fresh),
    ("layer-replay", "/layer", Keys::Fixed),
];

/// The order app at `addr`, `conns` connections sending orders for `BENCH_SECS` a round.
fn order_load(settings: &Settings, addr: SocketAddr, key_prefix: String, conns: usize) -> Plan {
    Plan {
        addr,
        path: "/bare",
        body: Bytes::from_static(ORDER_BODY.as_bytes()),
        keys: Keys::None,
        key_prefix,
        conns,
        duration: settings.duration(),
        limit: None,
        record_latency: true,
        cookies: Arc::from([]),
        stop: None,
    }
}

/// [`ORDER_SCENARIOS`] on `base`, those `include` keeps.
fn order_plans(base: &Plan, include: fn(&str) -> bool) -> Vec<(&'static str, Plan)> {
    ORDER_SCENARIOS
        .into_iter()
        .filter(|(name, _, _)| include(name))
        .map(|(name, path, keys)| {
            let plan = Plan {
                path,
                keys,
                ..base.clone()
            };
            (name, plan)
        })
        .collect()
}

fn run_backend(
    settings: &Settings,
    server: &Runtime,
    client: &Runtime,
    peak: &PeakRss,
    run: &str,
    backend: &Backend,
    report: &mut Report,
) -> Result<(), BoxError> {
    let name = backend.name;
    let peer = backend.peer.as_ref();
    eprintln!("[{name}] throughput…");
    let base = order_load(
        settings,
        backend.addr,
        format!("{run}-{name}"),
        settings.conns,
    );
    let mut plans = order_plans(&base, |_| true);
    plans.push((
        "layer-replay-cached",
        Plan {
            path: "/layer-cached",
            keys: Keys::Fixed,
            ..base.clone()
        },
    ));
    if let Some(peer) = peer {
        plans.extend(peer_plans(
            peer,
            &base,
            "/peer",
            ["peer-bare", "peer-fresh", "peer-replay"],
        ));
    }
    let samples = measure_rounds(settings, client, peak, &plans, wanted)?;
    for ((scenario, _), sample) in plans.iter().zip(samples) {
        let Some(sample) = sample else { continue };
        let note = match *scenario {
            "peer-bare" => "axum-idempotent's process, no layer",
            "peer-fresh" => "axum-idempotent, new keys",
            "peer-replay" => "axum-idempotent, one key per session",
            _ => "",
        };
        report.rows.push(Row {
            group: name.into(),
            scenario: (*scenario).into(),
            conns: settings.conns,
            sample,
            note: note.into(),
        });
    }

    let storm_plan = Plan {
        path: "/layer",
        duration: settings.duration().mul_f64(settings.rounds as f64),
        key_prefix: format!("{run}-{name}-storm"),
        ..base.clone()
    };
    if wanted("layer-storm") {
        eprintln!("[{name}] storm…");
        let (sample, keys, executed) = measure_storm(server, client, peak, backend, &storm_plan)?;
        report.rows.push(Row {
            group: name.into(),
            scenario: "layer-storm".into(),
            conns: STORM,
            sample,
            note: format!("{keys} keys × {STORM} duplicates; orders inserted: {executed}"),
        });
    }

    if let Some(peer) = peer.filter(|_| wanted("peer-storm")) {
        eprintln!("[{name}] peer storm…");
        let peer_storm = Plan {
            addr: peer.addr,
            path: "/peer",
            cookies: Arc::clone(&peer.cookies),
            key_prefix: format!("{run}-{name}-peer-storm"),
            ..storm_plan
        };
        let (sample, keys, executed) = measure_storm(server, client, peak, backend, &peer_storm)?;
        report.rows.push(Row {
            group: name.into(),
            scenario: "peer-storm".into(),
            conns: STORM,
            sample,
            note: format!(
                "axum-idempotent: {keys} keys × {STORM} duplicates in one session; \
                 orders inserted: {executed}"
            ),
        });
    }

    report.ratio(name, "manual", "bare", None);
    report.ratio(name, "layer-fresh", "manual", Some(Target::AtLeast(1.0)));
    let fresh_target = match name {
        "postgres" => Some(Target::AtLeast(0.8)),
        "mysql" => Some(Target::AtLeast(0.7)),
        _ => None,
    };
    report.ratio(name, "layer-fresh", "bare", fresh_target);
    report.ratio(name, "layer-replay", "bare", Some(Target::AtLeast(1.5)));
    report.ratio(name, "layer-replay-cached", "bare", None);
    if peer.is_some() {
        report.ratio(name, "peer-bare", "bare", None);
        report.ratio(name, "peer-fresh", "bare", None);
        report.ratio(name, "peer-replay", "bare", None);
        report.ratio(name, "peer-fresh", "peer-bare", None);
        report.ratio(name, "peer-replay", "peer-bare", None);
        report.ratio(name, "layer-fresh", "peer-fresh", None);
        report.ratio(name, "layer-replay", "peer-replay", None);
    }

    if !wanted("round-trips") {
        return Ok(());
    }
    eprintln!("[{name}] counting round trips…");
    let wire = backend.wire.as_deref();
    for (scenario, path, keys) in ORDER_SCENARIOS {
        let prefix = format!("{run}-{name}-count-{scenario}");
        let (statements, trips) = client.block_on(count_per_request(
            backend.counting_addr,
            path,
            keys,
            &prefix,
            settings.trips,
            wire,
        ))?;
        let (trips, pings, total) = trips.map_or_else(
            || ("– (in-process)".into(), "–".into(), "–".into()),
            |(trips, pings)| {
                (
                    format!("{trips:.2}"),
                    format!("{pings:.2}"),
                    format!("{:.2}", trips + pings),
                )
            },
        );
        report.trips.push(format!(
            "| {name} | {scenario} | {statements:.2} | {trips} | {pings} | {total} |"
        ));
    }
    Ok(())
}

/// [`ORDER_SCENARIOS`] as sequential requests on one connection, with nothing queued behind
/// another client's request: what one caller waits. On loopback (`latency`), and through the
/// delay proxy (`latency-1ms`), where each database round trip costs the network's.
fn run_latency(
    settings: &Settings,
    client: &Runtime,
    peak: &PeakRss,
    run: &str,
    backend: &Backend,
    report: &mut Report,
) -> Result<(), BoxError> {
    let name = backend.name;
    let delay_ms = settings.delay.as_secs_f64() * 1000.0;
    let links = [
        ("latency", Some(backend.addr), name.to_owned(), ""),
        (
            "latency-1ms",
            backend.delayed.as_ref().map(|(addr, _)| *addr),
            format!("{name} +{delay_ms} ms each way"),
            " (what a user on a cloud database sees)",
        ),
    ];
    for (section, addr, group, label) in links {
        let Some(addr) = addr.filter(|_| wanted(section)) else {
            continue;
        };
        eprintln!("[{name}] {section}…");
        let base = order_load(settings, addr, format!("{run}-{name}-{section}"), 1);
        let plans = order_plans(&base, |_| true);
        let samples = measure_rounds(settings, client, peak, &plans, |_| true)?;
        for ((scenario, _), sample) in plans.iter().zip(samples) {
            let Some(sample) = sample else { continue };
            report.latency.push(Row {
                group: group.clone(),
                scenario: (*scenario).into(),
                conns: 1,
                sample,
                note: String::new(),
            });
        }
        // The target is the network databases'; SQLite's figure is there to compare with.
        let target = (name != "sqlite").then_some(Target::AtMost(1.15));
        report.latency_ratio(&group, "layer-fresh", "bare", target, label);
    }
    if let Some((_, wire)) = backend.delayed.as_ref().filter(|_| wanted("latency-1ms")) {
        report.notes.push(format!(
            "- {name}, latency-1ms: the proxy held each of {} chunks {:.3} ms on average \
             (`BENCH_DELAY_MS` = {delay_ms}), in each direction.",
            wire.chunks.load(Ordering::Relaxed),
            wire.mean_hold_ms()
        ));
    }
    Ok(())
}

/// The layer's wait for an in-flight duplicate, `Engine::new`'s default, which the apps keep.
const IN_FLIGHT_WAIT: Duration = Duration::from_secs(5);

/// How long the load alongside `purge_expired()` may run at most, should the purge not end.
const PURGE_LOAD_CAP: Duration = Duration::from_secs(3600);

/// The layer on an empty records table and on one of `BENCH_SCALE` rows, then
/// `purge_expired()` of the expired ones while layer-fresh load runs, against the same load
/// without it for `BENCH_SECS` × `BENCH_ROUNDS` just before (before, so that the vacuum or purge
/// work the deletes leave behind cannot slow the baseline and flatter the ratio).
fn run_scale(
    settings: &Settings,
    server: &Runtime,
    client: &Runtime,
    peak: &PeakRss,
    run: &str,
    backend: &Backend,
    report: &mut Report,
) -> Result<(), BoxError> {
    let Some((rows, expired)) = settings.scale_of(backend.name) else {
        return Ok(());
    };
    let name = backend.name;
    let records = &backend.records;
    let exec = |sql: String| (records.exec)(server, sql);
    let base = order_load(
        settings,
        backend.addr,
        format!("{run}-{name}-scale"),
        settings.conns,
    );
    let layer = |scenario: &str| scenario.starts_with("layer");
    // Interleaved like every other measurement, so the two sizes see the same kind of noise.
    let measure = |size: &str| -> Result<Vec<(&'static str, Sample)>, BoxError> {
        let base = Plan {
            key_prefix: format!("{}-{size}", base.key_prefix),
            ..base.clone()
        };
        let plans = order_plans(&base, layer);
        let samples = measure_rounds(settings, client, peak, &plans, |_| true)?;
        Ok(plans
            .iter()
            .zip(samples)
            .filter_map(|((scenario, _), sample)| Some((*scenario, sample?)))
            .collect())
    };

    // What the run's earlier scenarios left would otherwise be the "empty" table.
    exec("DELETE FROM idempotency_records".into())?;
    eprintln!("[{name}] scale: the layer on an empty records table…");
    let empty = measure("empty")?;

    eprintln!("[{name}] scale: filling {rows} records ({expired} expired)…");
    let now = now_ms();
    let started = Instant::now();
    let mut filled = 0;
    for lo in (0..rows).step_by(usize::try_from(FILL_CHUNK)?) {
        let hi = (lo + FILL_CHUNK).min(rows);
        filled += exec(filler_insert(records.dialect, lo, hi, expired, now))?;
    }
    let fill = started.elapsed();
    let started = Instant::now();
    exec(records.dialect.analyze.into())?;
    let analyze = started.elapsed();
    let none = || ("–".to_owned(), "");
    report.scale_row(
        name,
        "records filled (expired / live)",
        format!("{filled} ({expired} / {})", rows - expired),
        none(),
    );
    report.scale_row(
        name,
        &format!("fill: INSERT … SELECT, {FILL_CHUNK} rows a statement"),
        format!(
            "{:.1} s ({:.0} rows/s)",
            fill.as_secs_f64(),
            filled as f64 / fill.as_secs_f64().max(1e-9)
        ),
        none(),
    );
    report.scale_row(
        name,
        "ANALYZE",
        format!("{:.1} s", analyze.as_secs_f64()),
        none(),
    );

    eprintln!("[{name}] scale: the layer at {rows} records…");
    let full = measure("full")?;
    for ((scenario, mut small), (_, mut large)) in empty.into_iter().zip(full) {
        for (size, sample) in [("empty table", &mut small), ("full table", &mut large)] {
            report.scale_row(
                name,
                &format!("{scenario}, {size}"),
                sample.summary(),
                none(),
            );
        }
        let ratio = large.rps() / small.rps().max(1e-9);
        report.scale_row(
            name,
            &format!("{scenario} req/s, {rows} records / empty"),
            format!("{ratio:.2}"),
            Target::verdict(Some(Target::AtLeast(0.9)), ratio),
        );
    }

    let load = Plan {
        path: "/layer",
        keys: Keys::Fresh,
        duration: settings.duration().mul_f64(settings.rounds as f64),
        ..base.clone()
    };
    eprintln!("[{name}] scale: layer-fresh without a purge…");
    let mut quiet = client.block_on(drive(
        &Plan {
            key_prefix: format!("{}-quiet", load.key_prefix),
            ..load.clone()
        },
        None,
    ))?;
    eprintln!("[{name}] scale: layer-fresh while purge_expired() runs…");
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::clone(&stop);
    let purge = (records.purge)();
    let purging = server.spawn(async move {
        let started = Instant::now();
        let purged = purge.await;
        done.store(true, Ordering::Relaxed);
        (purged, started.elapsed())
    });
    let during = client.block_on(drive(
        &Plan {
            key_prefix: format!("{}-purge", load.key_prefix),
            duration: PURGE_LOAD_CAP,
            stop: Some(stop),
            ..load
        },
        None,
    ));
    let (purged, took) = server.block_on(purging)?;
    let (purged, mut during) = (purged?, during?);

    report.scale_row(
        name,
        "purge_expired(): rows purged, duration, rate",
        format!(
            "{purged} in {:.2} s ({:.0} rows/s)",
            took.as_secs_f64(),
            purged as f64 / took.as_secs_f64().max(1e-9)
        ),
        none(),
    );
    for (what, sample) in [
        ("without a purge", &mut quiet),
        ("during the purge", &mut during),
    ] {
        report.scale_row(
            name,
            &format!("layer-fresh, {} conns, {what}", settings.conns),
            sample.summary(),
            none(),
        );
    }
    let ratio = during.percentile_ms(0.99) / quiet.percentile_ms(0.99).max(1e-9);
    report.scale_row(
        name,
        "layer-fresh p99, during the purge / without",
        format!("{ratio:.2}"),
        Target::verdict(Some(Target::AtMost(1.5)), ratio),
    );
    let late = during.over(IN_FLIGHT_WAIT);
    report.scale_row(
        name,
        &format!(
            "max latency during the purge vs the in-flight wait ({} s)",
            IN_FLIGHT_WAIT.as_secs()
        ),
        format!(
            "max {:.2} ms; {late} requests past the wait",
            during.max_ms()
        ),
        (
            "none past it".into(),
            if late == 0 { "yes" } else { "**no**" },
        ),
    );
    Ok(())
}

#[cfg(feature = "sqlite")]
fn run_noop(
    settings: &Settings,
    server: &Runtime,
    client: &Runtime,
    peak: &PeakRss,
    run: &str,
    peer: Option<&Peer>,
    report: &mut Report,
) -> Result<(), BoxError> {
    eprintln!("[noop] throughput…");
    let shm = std::path::Path::new("/dev/shm");
    let dir = if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
    .join(format!("axum-idempotency-bench-{run}"));
    std::fs::create_dir_all(&dir)?;
    let addr = noop_app(server, &dir);
    let addr = addr?;
    let base = Plan {
        addr,
        path: "/noop",
        body: json_body(1024),
        keys: Keys::None,
        key_prefix: format!("{run}-noop"),
        conns: settings.conns,
        duration: settings.duration(),
        limit: None,
        record_latency: true,
        cookies: Arc::from([]),
        stop: None,
    };
    let mut plans = vec![
        ("noop", base.clone()),
        (
            "noop-layer-nokey",
            Plan {
                path: "/noop-optional",
                ..base.clone()
            },
        ),
        (
            "noop-layer-replay-cached",
            Plan {
                path: "/noop-layer-cached",
                keys: Keys::Fixed,
                ..base.clone()
            },
        ),
        (
            "noop-layer-replay",
            Plan {
                path: "/noop-layer",
                keys: Keys::Fixed,
                ..base.clone()
            },
        ),
        (
            "noop-layer-fresh",
            Plan {
                path: "/noop-layer",
                keys: Keys::Fresh,
                ..base.clone()
            },
        ),
    ];
    if let Some(peer) = peer {
        plans.extend(peer_plans(
            peer,
            &base,
            "/noop-peer",
            ["noop-peer-bare", "noop-peer-fresh", "noop-peer-replay"],
        ));
    }
    let samples = measure_rounds(settings, client, peak, &plans, wanted)?;
    let notes = [
        "no layer",
        "layer, no key (allow_missing_key): pass-through",
        "layer with .cache_replays, one key: parse, buffer, fingerprint, replay from memory",
        "layer, one key: parse, buffer, fingerprint, 1 indexed read (tmpfs SQLite), replay",
        "layer, new keys: full claim/record on tmpfs SQLite",
        "axum-idempotent's process, no layer",
        "axum-idempotent, new keys: 1 read, handler, 1 write (in-memory moka store)",
        "axum-idempotent, one key per session: 1 read (in-memory moka store), replay",
    ];
    for (((scenario, _), sample), note) in plans.iter().zip(samples).zip(notes) {
        let Some(sample) = sample else { continue };
        report.rows.push(Row {
            group: "noop 1 KiB".into(),
            scenario: (*scenario).into(),
            conns: settings.conns,
            sample,
            note: note.into(),
        });
    }
    report.ratio(
        "noop 1 KiB",
        "noop-layer-replay-cached",
        "noop",
        Some(Target::AtLeast(0.8)),
    );
    report.ratio(
        "noop 1 KiB",
        "noop-layer-replay",
        "noop",
        Some(Target::AtLeast(0.8)),
    );
    report.ratio(
        "noop 1 KiB",
        "noop-layer-fresh",
        "noop",
        Some(Target::AtLeast(0.8)),
    );
    report.ratio("noop 1 KiB", "noop-layer-nokey", "noop", None);
    if peer.is_some() {
        report.ratio("noop 1 KiB", "noop-peer-bare", "noop", None);
        report.ratio("noop 1 KiB", "noop-peer-replay", "noop-peer-bare", None);
        report.ratio("noop 1 KiB", "noop-peer-fresh", "noop-peer-bare", None);
        report.ratio(
            "noop 1 KiB",
            "noop-layer-replay-cached",
            "noop-peer-replay",
            None,
        );
        report.ratio("noop 1 KiB", "noop-layer-replay", "noop-peer-replay", None);
        report.ratio("noop 1 KiB", "noop-layer-fresh", "noop-peer-fresh", None);
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

fn run_big_bodies(
    settings: &Settings,
    client: &Runtime,
    peak: &PeakRss,
    run: &str,
    backend: &Backend,
    report: &mut Report,
) -> Result<(), BoxError> {
    const MIB: usize = 1024 * 1024;
    eprintln!("[memory] {} concurrent 1 MiB requests…", settings.big);
    let body = json_body(MIB);
    let name = backend.name;
    report.memory.push(format!(
        "{} connections, each sending 1 MiB JSON bodies (the layer's default limit is 1 MiB) \
         back to back for {} s, on {name}:\n",
        settings.big,
        MEMORY_RUN.as_secs()
    ));
    report
        .memory
        .push("| route | requests | non-2xx | RSS before MiB | peak RSS MiB | peak − before, MiB per in-flight request |".into());
    report.memory.push("|---|---:|---:|---:|---:|---:|".into());
    for (label, path, keys) in [
        ("bare", "/bare", Keys::None),
        ("layer-fresh", "/layer", Keys::Fresh),
    ] {
        let plan = Plan {
            addr: backend.addr,
            path,
            body: body.clone(),
            keys,
            key_prefix: format!("{run}-{name}-big-{label}"),
            conns: settings.big,
            duration: MEMORY_RUN,
            limit: None,
            record_latency: false,
            cookies: Arc::from([]),
            stop: None,
        };
        let before = rss_mib();
        peak.reset();
        let sample = client.block_on(drive(&plan, None))?;
        let top = peak.peak_mib();
        report.memory.push(format!(
            "| {label} | {} | {} | {before:.1} | {top:.1} | {:.2} |",
            sample.requests,
            sample.unexpected,
            (top - before) / settings.big as f64
        ));
    }
    Ok(())
}

fn run_soak(
    settings: &Settings,
    client: &Runtime,
    run: &str,
    backend: &Backend,
    report: &mut Report,
) -> Result<(), BoxError> {
    let name = backend.name;
    eprintln!(
        "[soak] layer-fresh on {name}, up to {} requests or {} s…",
        settings.soak_requests, settings.soak_secs
    );
    let plan = Plan {
        addr: backend.addr,
        path: "/layer",
        body: Bytes::from_static(ORDER_BODY.as_bytes()),
        keys: Keys::Fresh,
        key_prefix: format!("{run}-{name}-soak"),
        conns: settings.conns,
        duration: Duration::from_secs_f64(settings.soak_secs),
        limit: Some(settings.soak_requests),
        // Recording latencies would itself grow memory by 4 bytes a request.
        record_latency: false,
        cookies: Arc::from([]),
        stop: None,
    };
    let progress = Arc::new(AtomicU64::new(0));
    let watched = Arc::clone(&progress);
    let finished = Arc::new(AtomicBool::new(false));
    let stop = Arc::clone(&finished);
    let every = Duration::from_secs_f64((settings.soak_secs / 10.0).max(0.5));
    let sampler = std::thread::spawn(move || {
        let mut points = vec![(0, rss_mib())];
        while !stop.load(Ordering::Relaxed) {
            std::thread::sleep(every);
            points.push((watched.load(Ordering::Relaxed), rss_mib()));
        }
        points
    });
    let sample = client.block_on(drive(&plan, Some(progress)));
    finished.store(true, Ordering::Relaxed);
    let points = sampler.join().map_err(|_| "the RSS sampler panicked")?;
    let sample = sample?;
    report.soak.push(format!(
        "layer-fresh on {name}, {} connections: {} requests in {:.0} s ({:.0} req/s), {} non-2xx \
         (target 1000000 requests; `BENCH_SOAK_SECS` / `BENCH_SOAK_REQUESTS` set the length).\n",
        settings.conns,
        sample.requests,
        sample.elapsed.as_secs_f64(),
        sample.rps(),
        sample.unexpected
    ));
    report.soak.push("| requests so far | VmRSS MiB |".into());
    report.soak.push("|---:|---:|".into());
    for (requests, rss) in &points {
        report.soak.push(format!("| {requests} | {rss:.1} |"));
    }
    // Growth between the first sample after warm-up (10 %) and the last.
    if let (Some(first), Some(last)) = (points.get(1), points.last())
        && last.0 > first.0
    {
        let per_100k = (last.1 - first.1) / (last.0 - first.0) as f64 * 100_000.0;
        report.soak.push(format!(
            "\nGrowth from {} to {} requests: {:+.1} MiB ({per_100k:+.2} MiB per 100k requests).",
            first.0,
            last.0,
            last.1 - first.1
        ));
    }
    Ok(())
}
