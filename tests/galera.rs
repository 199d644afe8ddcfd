//! The contract on a three-node MariaDB Galera cluster with an app instance on each node:
//! duplicates stormed across the nodes execute once and replay byte for byte, a contended
//! stock is never oversold, and a node killed with SIGKILL under load costs only retryable
//! answers, within a bound, with every key still executed exactly once.
//!
//! The cluster is this binary's own (see `common::galera`), started from nothing and removed at
//! the end. The figures each scenario measured are printed (`--nocapture` shows them).

mod common;

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum_idempotency::{IdempotencyLayer, MySqlStore, Tx, TxError};
use bytes::Bytes;
use common::galera::Cluster;
use common::unique;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use serde_json::json;
use sqlx::{Connection, MySql, MySqlPool};

const DATABASE: &str = "shop";
const STOCK: i64 = 20;

/// Handler runs on one app instance, aborted ones included.
#[derive(Clone, Default)]
struct Runs(Arc<AtomicUsize>);

/// One order per execution; its id comes back in the body.
async fn order(State(runs): State<Runs>, mut tx: Tx<MySql>) -> Result<Response, TxError> {
    runs.0.fetch_add(1, Ordering::SeqCst);
    let id: i64 = sqlx::query_scalar("INSERT INTO orders (placed) VALUES (1) RETURNING id")
        .fetch_one(&mut *tx)
        .await?;
    Ok((
        StatusCode::CREATED,
        [("location", format!("/orders/{id}"))],
        axum::Json(json!({ "id": id, "status": "created" })),
    )
        .into_response())
}

/// Buys one unit of the single contended stock row, or refuses for good when none is left.
async fn buy(State(runs): State<Runs>, mut tx: Tx<MySql>) -> Result<Response, TxError> {
    runs.0.fetch_add(1, Ordering::SeqCst);
    let stock: i64 = sqlx::query_scalar("SELECT stock FROM stock WHERE id = 1 FOR UPDATE")
        .fetch_one(&mut *tx)
        .await?;
    if stock < 1 {
        return Ok((
            StatusCode::CONFLICT,
            axum::Json(json!({ "code": "out_of_stock" })),
        )
            .into_response());
    }
    sqlx::query("UPDATE stock SET stock = stock - 1 WHERE id = 1")
        .execute(&mut *tx)
        .await?;
    let id: i64 = sqlx::query_scalar("INSERT INTO purchases (item) VALUES (1) RETURNING id")
        .fetch_one(&mut *tx)
        .await?;
    Ok((StatusCode::CREATED, axum::Json(json!({ "purchase": id }))).into_response())
}

/// An app instance on one node.
struct Instance {
    addr: SocketAddr,
    pool: MySqlPool,
    runs: Runs,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for Instance {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// A pool as an app would make it, with nothing set for Galera: the layer needs no session
/// setting there (see the guide's `clusters` chapter). The acquire timeout is below the layer's
/// deadline, so while the cluster stalls over a lost node a request waiting for a connection
/// is answered as retryable before the deadline.
async fn pool(url: &str) -> MySqlPool {
    sqlx::pool::PoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(3))
        .connect(url)
        .await
        .unwrap_or_else(|e| panic!("connect {url}: {e}"))
}

/// Migrates (all instances at once, as a rolling start does) and serves the app on each node.
async fn instances(cluster: &Cluster) -> Vec<Instance> {
    let pools = futures_util::future::join_all(
        (0..3).map(|i| async move { pool(&cluster.url(i, DATABASE)).await }),
    )
    .await;
    let migrated = futures_util::future::join_all(
        pools
            .iter()
            .map(|pool| async move { MySqlStore::new(pool.clone()).migrate().await }),
    )
    .await;
    for (i, result) in migrated.into_iter().enumerate() {
        result.unwrap_or_else(|e| panic!("migrate on node {}: {e}", i + 1));
    }
    for pool in &pools {
        settle(pool).await;
        assert_eq!(
            count(pool, "SELECT COUNT(*) FROM idempotency_schema_versions").await,
            1,
            "each version recorded once, seen on every node"
        );
    }
    let mut served = Vec::new();
    for pool in pools {
        let runs = Runs::default();
        let layer = IdempotencyLayer::new(MySqlStore::new(pool.clone())).allow_anonymous();
        let app = Router::new()
            .route("/orders", post(order))
            .route("/buy", post(buy))
            .route_layer(layer)
            .with_state(runs.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let server = tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
        served.push(Instance {
            addr,
            pool,
            runs,
            server,
        });
    }
    served
}

/// An answer as the client saw it, or the transport's failure.
#[derive(Debug, Clone)]
struct Answer {
    status: Option<StatusCode>,
    replayed: bool,
    body: Bytes,
}

impl Answer {
    fn label(&self) -> String {
        self.status
            .map_or_else(|| "no answer".to_owned(), |s| s.as_u16().to_string())
    }

    /// Final for the client: stop retrying (R12).
    fn is_final(&self) -> bool {
        self.status.is_some_and(|s| {
            !(s.is_server_error()
                || s == StatusCode::CONFLICT && self.code() == "idempotency_request_in_progress")
        })
    }

    fn code(&self) -> String {
        serde_json::from_slice::<serde_json::Value>(&self.body)
            .ok()
            .and_then(|body| body["code"].as_str().map(str::to_owned))
            .unwrap_or_default()
    }
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

fn client() -> HttpClient {
    Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(5))
        .build_http()
}

async fn send(client: &HttpClient, addr: SocketAddr, path: &str, key: &str) -> Answer {
    let request = http::Request::post(format!("http://{addr}{path}"))
        .header("idempotency-key", key)
        .body(Full::new(Bytes::new()))
        .expect("request");
    let sent = tokio::time::timeout(Duration::from_secs(30), async {
        let response = client.request(request).await.ok()?;
        let (parts, body) = response.into_parts();
        let body = body.collect().await.ok()?.to_bytes();
        Some((parts, body))
    })
    .await
    .ok()
    .flatten();
    match sent {
        Some((parts, body)) => Answer {
            status: Some(parts.status),
            replayed: parts
                .headers
                .get("idempotent-replayed")
                .is_some_and(|v| v == "true"),
            body,
        },
        None => Answer {
            status: None,
            replayed: false,
            body: Bytes::new(),
        },
    }
}

fn histogram<'a>(answers: impl IntoIterator<Item = &'a Answer>) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for answer in answers {
        *counts.entry(answer.label()).or_default() += 1;
    }
    counts
}

async fn count(pool: &MySqlPool, sql: &'static str) -> i64 {
    sqlx::query_scalar::<_, i64>(sql)
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// Waits until every node has applied what any node committed, so counts agree.
async fn settle(pool: &MySqlPool) {
    let mut conn = pool.acquire().await.expect("connection");
    sqlx::query("SET SESSION wsrep_sync_wait = 1")
        .execute(&mut *conn)
        .await
        .expect("sync wait");
    sqlx::query("SELECT 1")
        .execute(&mut *conn)
        .await
        .expect("synced read");
    sqlx::query("SET SESSION wsrep_sync_wait = 0")
        .execute(&mut *conn)
        .await
        .expect("sync wait off");
}

fn runs(apps: &[Instance]) -> usize {
    apps.iter()
        .map(|app| app.runs.0.load(Ordering::SeqCst))
        .sum()
}

const KEYS: usize = 30;
const DUPLICATES: usize = 8;

/// 30 keys × 8 duplicates, fired at once, each duplicate at the next node.
async fn duplicates_storm(apps: &[Instance]) {
    let client = client();
    let runs_before = runs(apps);
    let keys: Vec<String> = (0..KEYS).map(|_| unique("order")).collect();
    let start = Arc::new(tokio::sync::Barrier::new(KEYS * DUPLICATES));
    let requests = keys.iter().enumerate().flat_map(|(k, key)| {
        let client = &client;
        let start = Arc::clone(&start);
        (0..DUPLICATES).map(move |d| {
            let start = Arc::clone(&start);
            let addr = apps[(k + d) % 3].addr;
            async move {
                start.wait().await;
                (key.clone(), send(client, addr, "/orders", key).await)
            }
        })
    });
    let answers = futures_util::future::join_all(requests).await;
    let orders = count(&apps[0].pool, "SELECT COUNT(*) FROM orders").await;
    let first = histogram(answers.iter().map(|(_, a)| a));
    println!(
        "duplicates storm: first tries {first:?}; {orders} orders for {KEYS} keys; {} handler runs",
        runs(apps) - runs_before
    );
    for (key, answer) in &answers {
        assert_eq!(
            answer.status,
            Some(StatusCode::CREATED),
            "every first try is the key's 201, none 5xx or 409 ({key}): {first:?}"
        );
    }
    let mut by_key: HashMap<&str, Vec<&Answer>> = HashMap::new();
    for (key, answer) in &answers {
        by_key.entry(key).or_default().push(answer);
    }
    for (key, answers) in by_key {
        let executed = answers.iter().filter(|a| !a.replayed).count();
        assert_eq!(executed, 1, "one execution answered for {key}");
        assert!(
            answers.iter().all(|a| a.body == answers[0].body),
            "byte-identical replays for {key}"
        );
    }
    settle(&apps[1].pool).await;
    assert_eq!(orders, KEYS as i64, "one order per key");
    assert_eq!(
        count(&apps[2].pool, "SELECT COUNT(*) FROM orders").await,
        KEYS as i64,
        "every node holds the same orders"
    );
}

const BUYERS: usize = 36;

/// Stock storms in a row: an answer whose transaction the cluster in fact rolled back is rare
/// (it was about one storm in a hundred, before the store sent `COMMIT` on its own), so one
/// storm would seldom catch it.
const STOCK_ROUNDS: usize = 12;

/// Distinct keys buying from one stock row through all three nodes at once, in rounds, the
/// stock refilled before each.
async fn stock_storm(apps: &[Instance]) {
    let client = client();
    let runs_before = runs(apps);
    let mut all = Vec::new();
    let mut purchases = 0;
    for round in 0..STOCK_ROUNDS {
        let pool = &apps[0].pool;
        sqlx::query("UPDATE stock SET stock = ? WHERE id = 1")
            .bind(STOCK)
            .execute(pool)
            .await
            .expect("refill");
        sqlx::query("DELETE FROM purchases")
            .execute(pool)
            .await
            .expect("clear purchases");
        settle(pool).await;
        let start = Arc::new(tokio::sync::Barrier::new(BUYERS));
        let requests = (0..BUYERS).map(|b| {
            let client = &client;
            let start = Arc::clone(&start);
            let addr = apps[b % 3].addr;
            async move {
                let key = unique("buyer");
                start.wait().await;
                send(client, addr, "/buy", &key).await
            }
        });
        let answers = futures_util::future::join_all(requests).await;
        settle(pool).await;
        let left = count(pool, "SELECT stock FROM stock WHERE id = 1").await;
        let bought = count(pool, "SELECT COUNT(*) FROM purchases").await;
        let first = histogram(&answers);
        let created = answers
            .iter()
            .filter(|a| a.status == Some(StatusCode::CREATED))
            .count();
        let refused = answers
            .iter()
            .filter(|a| a.status == Some(StatusCode::CONFLICT) && a.code() == "out_of_stock")
            .count();
        assert_eq!(
            created + refused,
            BUYERS,
            "round {round}: every first try is final: 201, or 409 out of stock; none 5xx: \
             {first:?}"
        );
        assert_eq!(
            left, 0,
            "round {round}: all the stock is sold, never oversold"
        );
        assert_eq!(
            created as i64, STOCK,
            "round {round}: one 201 per unit sold, each of them committed ({bought} purchases)"
        );
        assert_eq!(bought, STOCK, "round {round}: one purchase per 201");
        all.extend(answers);
        purchases += bought;
    }
    println!(
        "stock storm: {STOCK_ROUNDS} rounds of {BUYERS} keys on a stock of {STOCK}: first tries \
         {:?}; {} purchases in all; {} handler runs",
        histogram(&all),
        purchases,
        runs(apps) - runs_before
    );
}

/// Keys in the SIGKILL scenario, started 25 ms apart.
const LOAD_KEYS: usize = 90;
/// How long a client keeps retrying one key.
const CLIENT_PATIENCE: Duration = Duration::from_secs(60);

/// What one client saw for one key: every answer, and when the last (final) one came.
struct Retried {
    answers: Vec<Answer>,
    finished: Instant,
}

/// Orders under load while node 3 is killed; clients retry retryable answers with the same
/// key at the next node until final.
async fn sigkill_under_load(cluster: &mut Cluster, apps: &[Instance]) {
    let client = client();
    let orders_before = count(&apps[0].pool, "SELECT COUNT(*) FROM orders").await;
    let load = (0..LOAD_KEYS).map(|k| {
        let client = client.clone();
        let addrs: Vec<SocketAddr> = apps.iter().map(|app| app.addr).collect();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(25 * k as u64)).await;
            let key = unique("load");
            let began = Instant::now();
            let mut answers = Vec::new();
            let mut node = k % 3;
            loop {
                let answer = send(&client, addrs[node], "/orders", &key).await;
                let done = answer.is_final();
                answers.push(answer);
                if done || began.elapsed() > CLIENT_PATIENCE {
                    break;
                }
                node = (node + 1) % 3;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Retried {
                answers,
                finished: Instant::now(),
            }
        })
    });
    let load: Vec<_> = load.collect();
    tokio::time::sleep(Duration::from_millis(25 * LOAD_KEYS as u64 / 3)).await;
    let killed_at = Instant::now();
    cluster.kill(2);
    let mut results = Vec::new();
    for task in load {
        results.push(task.await.expect("client task"));
    }
    let last_final = results
        .iter()
        .map(|r| r.finished.saturating_duration_since(killed_at))
        .max()
        .unwrap_or_default();
    settle(&apps[0].pool).await;
    let orders = count(&apps[0].pool, "SELECT COUNT(*) FROM orders").await - orders_before;
    let first = histogram(results.iter().map(|r| &r.answers[0]));
    let all = histogram(results.iter().flat_map(|r| &r.answers));
    let most_tries = results.iter().map(|r| r.answers.len()).max().unwrap_or(0);
    println!(
        "SIGKILL under load: first tries {first:?}; all answers {all:?}; {orders} orders for \
         {LOAD_KEYS} keys; at most {most_tries} tries for a key; the last key final \
         {last_final:?} after the kill; survivors {:?} {:?}",
        cluster.wsrep_state(0).await,
        cluster.wsrep_state(1).await,
    );
    for retried in &results {
        let last = retried.answers.last().expect("an answer");
        assert_eq!(
            last.status,
            Some(StatusCode::CREATED),
            "every key ends in its 201 within {CLIENT_PATIENCE:?}: {all:?}"
        );
        for answer in &retried.answers[..retried.answers.len() - 1] {
            assert!(
                !answer.is_final(),
                "before the 201 only retryable answers: {all:?}"
            );
        }
    }
    assert_eq!(orders, LOAD_KEYS as i64, "exactly one order per key");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_node_cluster_executes_each_key_once_and_survives_a_killed_node() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let started = Instant::now();
    let mut cluster = Cluster::start().await;
    println!("cluster of three synced in {:?}", started.elapsed());
    {
        let mut admin = sqlx::MySqlConnection::connect(&cluster.url(0, "mysql"))
            .await
            .expect("connect node 1");
        sqlx::raw_sql(
            "CREATE DATABASE shop;
             CREATE TABLE shop.orders (id BIGINT AUTO_INCREMENT PRIMARY KEY, placed INT NOT NULL) ENGINE=InnoDB;
             CREATE TABLE shop.stock (id INT PRIMARY KEY, stock BIGINT NOT NULL) ENGINE=InnoDB;
             CREATE TABLE shop.purchases (id BIGINT AUTO_INCREMENT PRIMARY KEY, item INT NOT NULL) ENGINE=InnoDB;",
        )
        .execute(&mut admin)
        .await
        .expect("schema");
        sqlx::query("INSERT INTO shop.stock VALUES (1, ?)")
            .bind(STOCK)
            .execute(&mut admin)
            .await
            .expect("stock");
    }
    let apps = instances(&cluster).await;
    println!("migrated from three instances at once");

    let phase = Instant::now();
    duplicates_storm(&apps).await;
    println!("duplicates storm took {:?}", phase.elapsed());
    let phase = Instant::now();
    stock_storm(&apps).await;
    println!("stock storm took {:?}", phase.elapsed());
    let phase = Instant::now();
    sigkill_under_load(&mut cluster, &apps).await;
    println!("SIGKILL scenario took {:?}", phase.elapsed());
    println!("whole test {:?}", started.elapsed());
}
