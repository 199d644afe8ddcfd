//! A PostgreSQL failover under keyed load: a primary and a hot standby of the test's own (the
//! standby streaming over a link with a few milliseconds of lag), the app reaching them through
//! a forwarder standing in for a virtual IP. Clients place orders, each retrying its key until a
//! final answer; the link is cut and the primary killed with SIGKILL, the standby promoted a
//! second later and the address moved to it. Afterwards the promoted server is asked what it
//! holds.
//!
//! - Synchronous replication: every acknowledged order is still there, every key made exactly
//!   one order and one record, and every answer during the switch was retryable and came within
//!   15 s.
//! - Asynchronous replication: acknowledged orders may be lost; the test counts them, and checks
//!   that each order and its record survive or vanish together.
//!
//! Each test prints what it measured (see it with `--nocapture`).

mod common;

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Json, Router};
use axum_idempotency::{
    IdempotencyContext, IdempotencyKey, IdempotencyLayer, PgStore, Principal, Scope, Tx, TxError,
};
use bytes::Bytes;
use common::pg_cluster::{PgCluster, Replication};
use common::process::{Answer, Http};
use common::vip::Vip;
use http::{Request, StatusCode};
use http_body_util::Full;
use serde_json::{Value, json};
use sqlx::Postgres;
use sqlx::postgres::PgPoolOptions;

/// The bound the contract sets on any answer while the database moves.
const ANSWER_BOUND: Duration = Duration::from_secs(15);
/// From the primary's death until the standby is promoted.
const DETECTION: Duration = Duration::from_secs(1);
/// Concurrent clients, each placing one order after another.
const CLIENTS: usize = 8;

/// The shop every order is placed by: the verified principal, as authentication would set it.
#[derive(Clone)]
struct Shop;

impl Principal for Shop {
    fn principal_id(&self) -> Cow<'_, str> {
        Cow::Borrowed("shop")
    }
}

/// `POST /orders`: one order row per execution, written through the claim's transaction and
/// tagged with the scoped key's digest, so the promoted server can be asked which key made it.
async fn place_order(
    mut tx: Tx<Postgres>,
    context: IdempotencyContext,
    Json(order): Json<Value>,
) -> Result<Response, TxError> {
    let sku = order["sku"].as_str().unwrap_or("widget").to_owned();
    let id: i64 =
        sqlx::query_scalar("INSERT INTO orders (request, sku) VALUES ($1, $2) RETURNING id")
            .bind(context.scoped_key().to_hex())
            .bind(&sku)
            .fetch_one(&mut *tx)
            .await?;
    Ok((
        StatusCode::CREATED,
        Json(json!({ "id": id, "sku": sku, "status": "created" })),
    )
        .into_response())
}

/// The app, served on a loopback port, its pool reaching the database through `database_url`.
async fn serve(database_url: &str) -> (String, tokio::task::JoinHandle<()>) {
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter("error")
        .try_init();
    // The acquire timeout sits below the layer's deadline (10 s): while no server answers, a
    // request waiting for a connection gets its retryable answer in time.
    let pool = PgPoolOptions::new()
        .max_connections(10)
        .acquire_timeout(Duration::from_secs(3))
        .connect(database_url)
        .await
        .expect("connect through the virtual address");
    let store = PgStore::new(pool.clone());
    store.migrate().await.expect("migrate");
    sqlx::query(
        "CREATE TABLE orders (id BIGSERIAL PRIMARY KEY, request TEXT NOT NULL, sku TEXT NOT NULL)",
    )
    .execute(&pool)
    .await
    .expect("orders table");
    let layer = IdempotencyLayer::new(store).principal_extension::<Shop>();
    let app = Router::new()
        .route("/orders", post(place_order))
        .route_layer(layer)
        .layer(Extension(Shop));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let server = tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
    (url, server)
}

/// The scoped key's digest of `key` as the app's orders and the layer's records carry it.
fn digest(key: &str) -> String {
    let key = IdempotencyKey::parse(key).expect("key");
    Scope::new("shop", "POST", "/orders", key)
        .scoped_key()
        .to_hex()
}

/// One attempt a client made.
struct Attempt {
    key: String,
    sent: Instant,
    took: Duration,
    answer: Result<Answer, String>,
}

impl Attempt {
    fn label(&self) -> String {
        match &self.answer {
            Ok(answer) => match json(answer)["code"].as_str() {
                Some(code) => format!("{} {code}", answer.status.as_u16()),
                None => answer.status.as_u16().to_string(),
            },
            Err(_) => "no answer".into(),
        }
    }

    fn created(&self) -> bool {
        self.answer
            .as_ref()
            .is_ok_and(|answer| answer.status == StatusCode::CREATED)
    }

    /// What a client retries with the same key: no answer, a 5xx, a timeout, a duplicate
    /// still in flight.
    fn retryable(&self) -> bool {
        match &self.answer {
            Err(_) => true,
            Ok(answer) => {
                answer.status.is_server_error()
                    || answer.status == StatusCode::REQUEST_TIMEOUT
                    || (answer.status == StatusCode::CONFLICT
                        && json(answer)["code"] == "idempotency_request_in_progress")
            }
        }
    }
}

/// Clients placing orders with fresh keys, each retrying its key until a final answer.
struct Load {
    stop: Arc<AtomicBool>,
    clients: Vec<tokio::task::JoinHandle<Vec<Attempt>>>,
}

impl Load {
    fn start(url: &str, run: &str) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let clients = (0..CLIENTS)
            .map(|c| {
                let (url, stop) = (url.to_owned(), Arc::clone(&stop));
                let prefix = format!("{run}-{c}");
                tokio::spawn(async move { place_orders(&url, &prefix, &stop).await })
            })
            .collect();
        Self { stop, clients }
    }

    async fn finish(self) -> Vec<Attempt> {
        self.stop.store(true, Ordering::SeqCst);
        let mut attempts = Vec::new();
        for client in self.clients {
            attempts.extend(client.await.expect("client"));
        }
        attempts
    }
}

async fn place_orders(url: &str, prefix: &str, stop: &AtomicBool) -> Vec<Attempt> {
    let http = Http::new();
    let mut attempts = Vec::new();
    let mut n = 0;
    while !stop.load(Ordering::SeqCst) {
        n += 1;
        let key = format!("{prefix}-{n}");
        // Retried until final even after the stop, so no key is left undecided; bounded, so a
        // server that never recovers fails the test instead of hanging it.
        let first = Instant::now();
        while first.elapsed() < Duration::from_secs(60) {
            let request = Request::post(format!("{url}/orders"))
                .header("idempotency-key", &key)
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from_static(br#"{"sku":"widget"}"#)))
                .expect("request");
            let sent = Instant::now();
            let answer = match tokio::time::timeout(ANSWER_BOUND * 2, http.try_call(request)).await
            {
                Ok(answer) => answer,
                Err(_) => Err("no answer".into()),
            };
            let attempt = Attempt {
                key: key.clone(),
                sent,
                took: sent.elapsed(),
                answer,
            };
            let retry = attempt.retryable();
            attempts.push(attempt);
            if !retry {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    attempts
}

/// What the promoted server holds for one key.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Held {
    orders: i64,
    /// Completed records: the stored answers a retry would replay.
    records: i64,
    /// The key's order, when it has exactly one.
    id: Option<i64>,
}

/// What the promoted server holds, per key digest.
async fn holdings(url: &str) -> HashMap<String, Held> {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(url)
        .await
        .expect("connect to the promoted server");
    let rows: Vec<(String, i64, i64, Option<i64>)> = sqlx::query_as(
        "SELECT request, COALESCE(o.n, 0), COALESCE(r.n, 0), o.id \
         FROM (SELECT request, COUNT(*) AS n, MIN(id) AS id FROM orders GROUP BY request) o \
         FULL JOIN (SELECT encode(key_digest, 'hex') AS request, COUNT(*) AS n \
                    FROM idempotency_records WHERE state = 'completed' GROUP BY 1) r \
         USING (request)",
    )
    .fetch_all(&pool)
    .await
    .expect("orders and records");
    pool.close().await;
    rows.into_iter()
        .map(|(request, orders, records, id)| {
            let id = id.filter(|_| orders == 1);
            (
                request,
                Held {
                    orders,
                    records,
                    id,
                },
            )
        })
        .collect()
}

fn json(answer: &Answer) -> Value {
    serde_json::from_slice(&answer.body).unwrap_or(Value::Null)
}

/// What one failover run saw.
struct Failover {
    attempts: Vec<Attempt>,
    /// Each key's last attempt, an index into `attempts`.
    finals: BTreeMap<String, usize>,
    /// What the promoted server holds per key digest.
    holdings: HashMap<String, Held>,
    /// From the kill until the first order created after the move.
    switch: (Instant, Instant),
}

impl Failover {
    /// Keys whose final answer was a 201, with the order id it named.
    fn acknowledged(&self) -> impl Iterator<Item = (&String, i64)> {
        self.finals
            .iter()
            .filter_map(|(key, &last)| match &self.attempts[last].answer {
                Ok(answer) if answer.status == StatusCode::CREATED => {
                    Some((key, json(answer)["id"].as_i64().expect("the order's id")))
                }
                _ => None,
            })
    }

    /// Acknowledged orders the promoted server does not have.
    fn lost(&self) -> Vec<(&String, i64)> {
        self.acknowledged()
            .filter(|(key, _)| self.held(key).orders == 0)
            .collect()
    }

    fn held(&self, key: &str) -> Held {
        self.holdings.get(&digest(key)).copied().unwrap_or_default()
    }

    /// Attempts answered after the kill and sent before the service was back.
    fn during_switch(&self) -> impl Iterator<Item = &Attempt> {
        let (down, back) = self.switch;
        self.attempts
            .iter()
            .filter(move |a| a.sent + a.took >= down && a.sent < back)
    }

    fn report(&self, replication: &str) {
        let mut histogram = BTreeMap::<String, usize>::new();
        for attempt in self.during_switch() {
            *histogram.entry(attempt.label()).or_default() += 1;
        }
        let longest = self.during_switch().map(|a| a.took).max();
        let together = self
            .holdings
            .values()
            .filter(|held| held.orders == held.records)
            .count();
        let ids: HashSet<i64> = self.holdings.values().filter_map(|held| held.id).collect();
        let reused = self
            .lost()
            .iter()
            .filter(|(_, id)| ids.contains(id))
            .count();
        eprintln!(
            "failover ({replication}): {} keys, {} acknowledged, {} lost ({reused} of their ids \
             now another order's); {together}/{} keys hold as many orders as records; switch \
             {:?}; answers during it {histogram:?}, longest {longest:?}; {} attempts in all",
            self.finals.len(),
            self.acknowledged().count(),
            self.lost().len(),
            self.holdings.len(),
            self.switch.1 - self.switch.0,
            self.attempts.len(),
        );
    }

    /// Every attempt was answered within the bound, and every key's final answer was a 201:
    /// what came during the switch was retryable, so no client stopped on it.
    fn assert_answers_retryable_and_bounded(&self) {
        let slow: Vec<_> = self
            .attempts
            .iter()
            .filter(|a| a.took > ANSWER_BOUND)
            .map(|a| (a.label(), a.took))
            .collect();
        assert!(
            slow.is_empty(),
            "answers slower than {ANSWER_BOUND:?}: {slow:?}"
        );
        let bare: Vec<_> = self
            .attempts
            .iter()
            .filter(|a| {
                a.answer.as_ref().is_ok_and(|answer| {
                    answer.status.is_server_error()
                        && !answer.headers.contains_key(http::header::RETRY_AFTER)
                })
            })
            .map(Attempt::label)
            .collect();
        assert!(bare.is_empty(), "5xx answers without Retry-After: {bare:?}");
        let wrong: Vec<_> = self
            .finals
            .iter()
            .map(|(key, &last)| (key, &self.attempts[last]))
            .filter(|(_, last)| !last.created())
            .map(|(key, last)| (key, last.label(), last.answer.as_ref().map(json)))
            .collect();
        assert!(wrong.is_empty(), "final answers other than 201: {wrong:?}");
    }

    /// No key holds more than one order, an order never stands without its record nor a record
    /// without its order, and the server holds nothing no client asked for.
    fn assert_orders_and_records_together(&self) {
        for (digest, held) in &self.holdings {
            assert!(held.orders <= 1, "{digest}: {held:?}");
            assert_eq!(held.orders, held.records, "{digest}: {held:?}");
        }
        let asked: HashSet<String> = self.finals.keys().map(|key| digest(key)).collect();
        let strays: Vec<_> = self
            .holdings
            .keys()
            .filter(|request| !asked.contains(*request))
            .collect();
        assert!(
            strays.is_empty(),
            "orders or records no key made: {strays:?}"
        );
    }
}

/// Runs keyed load, kills the primary, promotes the standby, moves the address to it, keeps the
/// load on a few seconds more, and collects what happened.
async fn failover(replication: Replication, run: &str) -> Failover {
    let cluster = PgCluster::start(replication).await;
    let vip = Vip::start(cluster.primary.addr()).await;
    let (url, server) = serve(&format!("postgres://postgres@{}/postgres", vip.addr)).await;
    let load = Load::start(&url, run);
    tokio::time::sleep(Duration::from_secs(2)).await;

    let down = Instant::now();
    cluster.kill_primary().await;
    // About as long as a failover manager takes to be sure the primary is gone: meanwhile the
    // address leads nowhere, and the app must answer retryably all the same.
    tokio::time::sleep(DETECTION).await;
    cluster.promote_standby().await;
    vip.move_to(cluster.standby.addr());
    let moved = Instant::now();
    eprintln!(
        "failover ({run}): primary killed, standby promoted and the address moved in {:?}",
        moved - down
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    let attempts = load.finish().await;
    server.abort();

    let back = attempts
        .iter()
        .filter(|a| a.sent >= moved && a.created())
        .map(|a| a.sent + a.took)
        .min()
        .expect("orders created after the move");
    let finals = attempts
        .iter()
        .enumerate()
        .map(|(i, attempt)| (attempt.key.clone(), i))
        .collect();
    let holdings = holdings(&cluster.standby.url()).await;
    Failover {
        attempts,
        finals,
        holdings,
        switch: (down, back),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn synchronous_standby_promoted_under_load_keeps_every_acknowledged_order() {
    let run = failover(Replication::Synchronous, "sync").await;
    run.report("synchronous");
    run.assert_answers_retryable_and_bounded();
    run.assert_orders_and_records_together();
    assert_eq!(run.lost(), Vec::new(), "acknowledged orders lost");
    for (key, id) in run.acknowledged() {
        let held = run.held(key);
        assert_eq!(
            (held.orders, held.records, held.id),
            (1, 1, Some(id)),
            "{key}: the acknowledged order and its record"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn asynchronous_standby_promoted_under_load_loses_orders_only_with_their_records() {
    let run = failover(Replication::Asynchronous, "async").await;
    run.report("asynchronous");
    run.assert_answers_retryable_and_bounded();
    run.assert_orders_and_records_together();
}
