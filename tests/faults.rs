//! The faults retries exist for: a burst far above the pool size, a database killed and
//! restarted under load, a database link gone silent, SIGTERM under load.
//!
//! The layer-level tests drive `IdempotencyLayer` directly; the others run the `orders` example
//! as a real process (build it first: `cargo test --all-features` does). Restarts and kills use
//! private database instances started here, and silence a TCP proxy of this file's own; the
//! machine's shared databases are never stopped. Each test prints what it measured (see it with
//! `--nocapture`).

mod common;

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::process::{Answer, Http, Process};
use common::silent::FaultProxy;
use common::unique;
use http::{Request, StatusCode, header};
use http_body_util::Full;
use serde_json::{Value, json};

// ---------------------------------------------------------------------------------------------
// The layer itself
// ---------------------------------------------------------------------------------------------

mod layer {
    use std::borrow::Cow;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    use axum::body::Body;
    use axum::extract::FromRequestParts;
    use axum::http::request::Parts;
    use axum::routing::{get, post};
    use axum::{Extension, Router};
    use axum_idempotency::{IdempotencyLayer, Principal, SqliteStore, Tx};
    use http::{Request, StatusCode, header};
    use http_body_util::BodyExt;
    use sqlx::Sqlite;
    use tower::ServiceExt;

    /// A caller named by the `x-caller` header; `db-down` stands for an extractor whose
    /// database failed, `slow` for one whose database does not answer.
    #[derive(Clone)]
    struct Caller(String);

    impl Principal for Caller {
        fn principal_id(&self) -> Cow<'_, str> {
            Cow::Borrowed(&self.0)
        }
    }

    impl<S: Send + Sync> FromRequestParts<S> for Caller {
        type Rejection = StatusCode;

        async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, StatusCode> {
            match parts.headers.get("x-caller").and_then(|v| v.to_str().ok()) {
                Some("db-down") => Err(StatusCode::INTERNAL_SERVER_ERROR),
                Some("pool-timeout") => Err(StatusCode::SERVICE_UNAVAILABLE),
                Some("forbidden") => Err(StatusCode::FORBIDDEN),
                Some("slow") => {
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    Ok(Self("slow".into()))
                }
                Some(name) => Ok(Self(name.into())),
                None => Err(StatusCode::UNAUTHORIZED),
            }
        }
    }

    struct App {
        router: Router,
        pool: sqlx::SqlitePool,
        running: Arc<Running>,
        _dir: tempfile::TempDir,
    }

    /// How many handlers of one app run at once, and the most there ever were.
    #[derive(Default)]
    struct Running {
        now: AtomicUsize,
        most: AtomicUsize,
    }

    /// `POST /effects`: waits the milliseconds its body names, writes one row through the
    /// claim's transaction, answers 201 naming the caller it was handed by the layer.
    async fn app(
        configure: impl FnOnce(IdempotencyLayer<Sqlite>) -> IdempotencyLayer<Sqlite>,
    ) -> App {
        let dir = tempfile::tempdir().expect("tempdir");
        let pool = crate::common::sqlite::file_pool(dir.path(), "faults.db").await;
        sqlx::query("CREATE TABLE effects (who TEXT NOT NULL)")
            .execute(&pool)
            .await
            .expect("schema");
        let store = SqliteStore::new(pool.clone());
        store.migrate().await.expect("migrate");
        let layer = configure(IdempotencyLayer::new(store).principal::<Caller>());
        let running = Arc::new(Running::default());
        let router = Router::new()
            .route("/effects", post(effect))
            .route(
                "/slow",
                get(|| async {
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    "late"
                }),
            )
            .route_layer(layer)
            .layer(Extension(Arc::clone(&running)));
        App {
            router,
            pool,
            running,
            _dir: dir,
        }
    }

    async fn effect(
        Extension(caller): Extension<Caller>,
        Extension(running): Extension<Arc<Running>>,
        mut tx: Tx<Sqlite>,
        body: String,
    ) -> (StatusCode, String) {
        let now = running.now.fetch_add(1, Ordering::SeqCst) + 1;
        running.most.fetch_max(now, Ordering::SeqCst);
        let millis = body.trim().parse().unwrap_or(0);
        tokio::time::sleep(Duration::from_millis(millis)).await;
        running.now.fetch_sub(1, Ordering::SeqCst);
        match sqlx::query("INSERT INTO effects (who) VALUES (?)")
            .bind(&caller.0)
            .execute(&mut *tx)
            .await
        {
            Ok(_) => (StatusCode::CREATED, format!("created for {}", caller.0)),
            Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, String::new()),
        }
    }

    struct Reply {
        status: StatusCode,
        headers: http::HeaderMap,
        body: String,
    }

    impl Reply {
        fn code(&self) -> String {
            serde_json::from_str::<serde_json::Value>(&self.body)
                .ok()
                .and_then(|v| v["code"].as_str().map(str::to_owned))
                .unwrap_or_default()
        }
    }

    async fn post_effect(app: &App, caller: Option<&str>, key: &str, millis: u64) -> Reply {
        let mut request = Request::post("/effects").header("idempotency-key", key);
        if let Some(caller) = caller {
            request = request.header("x-caller", caller);
        }
        let request = request
            .body(Body::from(millis.to_string()))
            .expect("request");
        let response = app
            .router
            .clone()
            .oneshot(request)
            .await
            .expect("infallible");
        let (parts, body) = response.into_parts();
        let body = body.collect().await.expect("body").to_bytes();
        Reply {
            status: parts.status,
            headers: parts.headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        }
    }

    async fn effects(app: &App) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM effects")
            .fetch_one(&app.pool)
            .await
            .expect("count")
    }

    #[tokio::test]
    async fn a_failing_principal_extractor_is_a_retryable_503_never_a_401() {
        let app = app(|layer| layer).await;
        for caller in ["db-down", "pool-timeout"] {
            let reply = post_effect(&app, Some(caller), "k-unavailable", 0).await;
            assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE, "{caller}");
            assert_eq!(reply.code(), "idempotency_principal_unavailable");
            assert_eq!(reply.headers[header::RETRY_AFTER], "1");
            assert_eq!(
                reply.headers[header::CONTENT_TYPE],
                "application/problem+json"
            );
        }
        assert_eq!(effects(&app).await, 0, "nothing ran");
        // A refusal stays final.
        for caller in [None, Some("forbidden")] {
            let reply = post_effect(&app, caller, "k-refused", 0).await;
            assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
            assert_eq!(reply.code(), "idempotency_principal_missing");
            assert!(!reply.headers.contains_key(header::RETRY_AFTER));
        }
    }

    #[tokio::test]
    async fn the_handler_receives_the_principal_the_layer_extracted() {
        let app = app(|layer| layer).await;
        let reply = post_effect(&app, Some("alice"), "k-ext", 0).await;
        assert_eq!(reply.status, StatusCode::CREATED);
        assert_eq!(reply.body, "created for alice");
    }

    #[tokio::test]
    async fn past_the_deadline_the_answer_is_retryable_and_the_retry_replays_the_late_commit() {
        let app = app(|layer| {
            layer
                .deadline(Duration::from_millis(300))
                .wait_for_in_flight(Duration::from_millis(100))
        })
        .await;
        let started = Instant::now();
        let first = post_effect(&app, Some("alice"), "k-late", 1500).await;
        let took = started.elapsed();
        assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(first.code(), "idempotency_timeout");
        assert_eq!(first.headers[header::RETRY_AFTER], "1");
        assert!(
            took < Duration::from_millis(1000),
            "answered after {took:?}"
        );

        // The attempt goes on by itself: a retry (same key, same body) meanwhile is told it is
        // in progress.
        let meanwhile = post_effect(&app, Some("alice"), "k-late", 1500).await;
        assert!(
            meanwhile.status == StatusCode::CONFLICT
                || meanwhile.status == StatusCode::SERVICE_UNAVAILABLE,
            "{} {}",
            meanwhile.status,
            meanwhile.body
        );

        tokio::time::sleep(Duration::from_millis(1800)).await;
        let retry = post_effect(&app, Some("alice"), "k-late", 1500).await;
        assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.body);
        assert_eq!(retry.headers["idempotent-replayed"], "true");
        assert_eq!(
            effects(&app).await,
            1,
            "the late commit is the only execution"
        );
    }

    #[tokio::test]
    async fn a_principal_extractor_that_hangs_is_cut_off_at_the_deadline() {
        let app = app(|layer| layer.deadline(Duration::from_millis(200))).await;
        let started = Instant::now();
        let reply = post_effect(&app, Some("slow"), "k-slow", 0).await;
        assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(reply.code(), "idempotency_timeout");
        assert!(started.elapsed() < Duration::from_secs(2));
    }

    #[tokio::test]
    async fn a_request_without_a_key_is_held_to_the_deadline_too() {
        let app = app(|layer| layer.deadline(Duration::from_millis(300))).await;
        let started = Instant::now();
        let request = Request::get("/slow").body(Body::empty()).expect("request");
        let response = app
            .router
            .clone()
            .oneshot(request)
            .await
            .expect("infallible");
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()[header::RETRY_AFTER], "1");
        assert!(started.elapsed() < Duration::from_secs(1));
    }

    #[tokio::test]
    async fn max_concurrent_claims_bounds_the_handlers_running_at_once() {
        let app = app(|layer| layer.max_concurrent_claims(2)).await;
        let replies = futures_util::future::join_all((0..8).map(|i| {
            let app = &app;
            async move { post_effect(app, Some("bob"), &format!("k-bound-{i}"), 50).await }
        }))
        .await;
        assert!(replies.iter().all(|r| r.status == StatusCode::CREATED));
        assert!(app.running.most.load(Ordering::SeqCst) <= 2);
        assert_eq!(effects(&app).await, 8);
    }
}

// ---------------------------------------------------------------------------------------------
// The orders example as a process
// ---------------------------------------------------------------------------------------------

const POOL: usize = 10;

fn order() -> Value {
    json!({ "sku": "widget", "quantity": 1, "amount": 12.5, "currency": "EUR" })
}

async fn start_orders(database_url: &str) -> Process {
    let pool = POOL.to_string();
    Process::start(
        "orders",
        &[
            ("DATABASE_URL", database_url),
            ("DATABASE_MAX_CONNECTIONS", &pool),
            ("RUST_LOG", "error"),
        ],
    )
    .await
}

struct Client {
    http: Http,
    url: String,
}

impl Client {
    fn new(url: &str) -> Arc<Self> {
        Arc::new(Self {
            http: Http::new(),
            url: url.to_owned(),
        })
    }

    /// `POST /orders` as alice with `key`; a transport failure or no answer within `limit`
    /// is an `Err`.
    async fn place(&self, key: &str, limit: Duration) -> Result<Answer, String> {
        let request = Request::post(format!("{}/orders", self.url))
            .header("authorization", "Bearer alice-token")
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(order().to_string())))
            .expect("request");
        match tokio::time::timeout(limit, self.http.try_call(request)).await {
            Ok(answered) => answered,
            Err(_) => Err(format!("no answer within {limit:?}")),
        }
    }

    /// The ids of alice's orders.
    async fn order_ids(&self) -> Vec<i64> {
        let request = Request::get(format!("{}/orders", self.url))
            .header("authorization", "Bearer alice-token")
            .body(Full::new(Bytes::new()))
            .expect("request");
        let answer = self.http.call(request).await;
        assert_eq!(answer.status, StatusCode::OK);
        answer
            .json()
            .as_array()
            .expect("a list")
            .iter()
            .map(|o| o["id"].as_i64().expect("id"))
            .collect()
    }
}

fn code(answer: &Answer) -> String {
    serde_json::from_slice::<Value>(&answer.body)
        .ok()
        .and_then(|v| v["code"].as_str().map(str::to_owned))
        .unwrap_or_default()
}

fn label(answer: &Result<Answer, String>) -> String {
    match answer {
        Ok(answer) => format!("{} {}", answer.status.as_u16(), code(answer)),
        Err(_) => "no answer".into(),
    }
}

/// What a compliant client retries with the same key: a 409 in-progress, or a 5xx
/// problem document with `Retry-After`.
fn retryable(answer: &Answer) -> bool {
    let problem = answer
        .headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v == "application/problem+json");
    let retry_after = answer.headers.contains_key(header::RETRY_AFTER);
    match answer.status {
        StatusCode::CONFLICT => code(answer) == "idempotency_request_in_progress",
        status if status.is_server_error() => problem && retry_after,
        _ => false,
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

/// Ten times the pool's size of distinct keys at once: nearly all are created on the first
/// attempt, none is refused as unauthenticated.
async fn burst(backend: &str, database_url: &str) {
    let orders = start_orders(database_url).await;
    let client = Client::new(&orders.url);
    let total = POOL * 10;
    let started = Instant::now();
    let tasks: Vec<_> = (0..total)
        .map(|i| {
            let client = Arc::clone(&client);
            let key = unique(&format!("burst-{i}"));
            tokio::spawn(async move {
                let sent = Instant::now();
                let answer = client.place(&key, Duration::from_secs(60)).await;
                (answer, sent.elapsed())
            })
        })
        .collect();
    let mut latencies = Vec::new();
    let mut answers = BTreeMap::<String, usize>::new();
    let mut created = 0;
    for task in tasks {
        let (answer, took) = task.await.expect("task");
        latencies.push(took);
        *answers.entry(label(&answer)).or_default() += 1;
        if answer
            .as_ref()
            .is_ok_and(|a| a.status == StatusCode::CREATED)
        {
            created += 1;
        }
    }
    let elapsed = started.elapsed();
    latencies.sort();
    eprintln!(
        "faults: burst on {backend}: {total} distinct keys, pool {POOL}: {created}/{total} \
         ({:.0} %) 201 on the first attempt, p50 {:?}, p99 {:?}, max {:?}, all in {elapsed:?}; \
         answers {answers:?}",
        created as f64 * 100.0 / total as f64,
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
        latencies.last().copied().unwrap_or_default(),
    );
    assert!(
        created * 10 >= total * 9,
        "only {created}/{total} created on the first attempt: {answers:?}"
    );
    assert!(!answers.keys().any(|a| a.starts_with("401")), "{answers:?}");
    assert_eq!(client.order_ids().await.len(), created);
    orders.kill().await;
}

#[tokio::test]
async fn burst_of_ten_times_the_pool_is_served_on_sqlite() {
    let dir = tempfile::tempdir().expect("tempdir");
    let url = format!("sqlite://{}", dir.path().join("orders.db").display());
    burst("SQLite", &url).await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn burst_of_ten_times_the_pool_is_served_on_postgres() {
    let schema = SharedSchema::postgres().await;
    burst("PostgreSQL", &schema.url).await;
    schema.drop().await;
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn burst_of_ten_times_the_pool_is_served_on_mysql() {
    let schema = SharedSchema::mysql().await;
    burst("MariaDB", &schema.url).await;
    schema.drop().await;
}

/// One attempt a load worker made.
struct Attempt {
    key: String,
    sent: Instant,
    took: Duration,
    answer: Result<Answer, String>,
}

/// Workers placing orders with fresh keys, each retrying its key until it gets a final answer,
/// as a compliant client does.
struct Load {
    stop: Arc<AtomicBool>,
    workers: Vec<tokio::task::JoinHandle<Vec<Attempt>>>,
}

impl Load {
    fn start(client: &Arc<Client>, workers: usize, tag: &str) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let workers = (0..workers)
            .map(|w| {
                let client = Arc::clone(client);
                let stop = Arc::clone(&stop);
                let tag = unique(&format!("{tag}-{w}"));
                tokio::spawn(async move {
                    let mut attempts = Vec::new();
                    let mut n = 0;
                    while !stop.load(Ordering::SeqCst) {
                        n += 1;
                        let key = format!("{tag}-{n}");
                        // Each key is retried until final, even after the stop: no key is
                        // left undecided. Bounded, so a broken server fails the test.
                        for _ in 0..300 {
                            let sent = Instant::now();
                            let answer = client.place(&key, Duration::from_secs(30)).await;
                            let done = answer.as_ref().is_ok_and(|a| !retryable(a));
                            attempts.push(Attempt {
                                key: key.clone(),
                                sent,
                                took: sent.elapsed(),
                                answer,
                            });
                            if done {
                                break;
                            }
                            tokio::time::sleep(Duration::from_millis(200)).await;
                        }
                    }
                    attempts
                })
            })
            .collect();
        Self { stop, workers }
    }

    async fn finish(self) -> Vec<Attempt> {
        self.stop.store(true, Ordering::SeqCst);
        let mut all = Vec::new();
        for worker in self.workers {
            all.extend(worker.await.expect("worker"));
        }
        all
    }
}

/// Every key ended in exactly one order, and the orders table holds nothing else (but the
/// `probes`' orders).
async fn assert_each_key_made_one_order(
    client: &Client,
    attempts: &[Attempt],
    probes: &[i64],
) -> usize {
    let mut finals = BTreeMap::<&str, &Answer>::new();
    for attempt in attempts {
        if let Ok(answer) = &attempt.answer
            && !retryable(answer)
        {
            finals.insert(&attempt.key, answer);
        }
    }
    let keys: HashSet<&str> = attempts.iter().map(|a| a.key.as_str()).collect();
    assert_eq!(finals.len(), keys.len(), "every key got a final answer");
    let mut ids = HashSet::new();
    for (key, answer) in &finals {
        assert_eq!(
            answer.status,
            StatusCode::CREATED,
            "{key}: {}",
            code(answer)
        );
        ids.insert(answer.json()["id"].as_i64().expect("id"));
    }
    assert_eq!(ids.len(), keys.len(), "one order per key");
    let stored: HashSet<i64> = client.order_ids().await.into_iter().collect();
    ids.extend(probes);
    assert_eq!(stored, ids, "no order without a key's answer, none lost");
    keys.len()
}

fn histogram<'a>(attempts: impl Iterator<Item = &'a Attempt>) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for attempt in attempts {
        *counts.entry(label(&attempt.answer)).or_default() += 1;
    }
    counts
}

/// Answers that are neither a creation nor retryable: what would make a client stop wrongly.
fn finals_other_than_created(attempts: &[Attempt]) -> Vec<String> {
    attempts
        .iter()
        .filter(|a| match &a.answer {
            Ok(answer) => answer.status != StatusCode::CREATED && !retryable(answer),
            Err(_) => true,
        })
        .map(|a| label(&a.answer))
        .collect()
}

/// One new key placed every 50 ms until it is created: how long the app takes to serve again,
/// and the order it made.
async fn time_to_serve(client: &Client) -> (Duration, i64) {
    let back = Instant::now();
    let key = unique("probe");
    loop {
        let answer = client.place(&key, Duration::from_secs(30)).await;
        if let Ok(answer) = answer
            && answer.status == StatusCode::CREATED
        {
            return (back.elapsed(), answer.json()["id"].as_i64().expect("id"));
        }
        assert!(
            back.elapsed() < Duration::from_secs(30),
            "never served again"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A database killed under load and started again: only retryable answers meanwhile, one order
/// per key, served again soon after it is back.
async fn outage(backend: &str, database: &mut dyn PrivateDatabase) {
    let orders = start_orders(&database.url()).await;
    let client = Client::new(&orders.url);
    let load = Load::start(&client, 8, "outage");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let down = Instant::now();
    database.kill().await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    database.start().await;
    let back = Instant::now();
    let (serving, probe) = time_to_serve(&client).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let attempts = load.finish().await;

    let during = histogram(attempts.iter().filter(|a| a.sent >= down && a.sent < back));
    let slowest = attempts
        .iter()
        .filter(|a| a.sent >= down && a.sent < back)
        .map(|a| a.took)
        .max()
        .unwrap_or_default();
    let keys = assert_each_key_made_one_order(&client, &attempts, &[probe]).await;
    eprintln!(
        "faults: outage on {backend}: down {:?}; answers while down {during:?} (slowest {slowest:?}); \
         served again {serving:?} after it was back; {keys} keys, {} attempts, one order each",
        back - down,
        attempts.len(),
    );
    let wrong = finals_other_than_created(&attempts);
    assert!(
        wrong.is_empty(),
        "final answers a client would stop on: {wrong:?}"
    );
    assert!(
        serving <= Duration::from_secs(1),
        "served again only {serving:?} after the database was back"
    );
    orders.kill().await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn postgres_killed_under_load_gets_only_retryable_answers_and_one_order_per_key() {
    let mut database = PrivatePostgres::start().await;
    outage("PostgreSQL", &mut database).await;
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn mariadb_killed_under_load_gets_only_retryable_answers_and_one_order_per_key() {
    let mut database = PrivateMariaDb::start().await;
    outage("MariaDB", &mut database).await;
}

/// The database link goes silent for longer than the deadline, then heals: every request is
/// answered within the bound, retryably, and each key still executes once.
#[allow(dead_code)]
async fn blackhole(backend: &str, schema: SharedSchema) {
    // The server's address as the URL names it (`…@host:port/…`), to route through the proxy.
    let server = schema
        .url
        .split_once('@')
        .and_then(|(_, rest)| rest.split('/').next())
        .expect("a host:port in the test URL")
        .to_owned();
    let proxy = FaultProxy::start(&server).await;
    let url = schema.url.replacen(&server, &proxy.addr.to_string(), 1);
    assert_ne!(url, schema.url, "the test URL goes through the proxy");
    let orders = start_orders(&url).await;
    let client = Client::new(&orders.url);
    let load = Load::start(&client, 8, "blackhole");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let silent = Instant::now();
    proxy.blackhole(true);
    tokio::time::sleep(Duration::from_secs(12)).await;
    proxy.blackhole(false);
    let healed = Instant::now();
    let (serving, probe) = time_to_serve(&client).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let attempts = load.finish().await;

    let affected: Vec<&Attempt> = attempts
        .iter()
        .filter(|a| a.sent + a.took >= silent && a.sent < healed)
        .collect();
    let during = histogram(affected.iter().copied());
    let slowest = affected.iter().map(|a| a.took).max().unwrap_or_default();
    let keys = assert_each_key_made_one_order(&client, &attempts, &[probe]).await;
    eprintln!(
        "faults: blackhole on {backend}: silent {:?}; answers meanwhile {during:?}, slowest \
         {slowest:?} (bound 10 s); served again {serving:?} after it healed; {keys} keys, one \
         order each",
        healed - silent,
    );
    let wrong = finals_other_than_created(&attempts);
    assert!(
        wrong.is_empty(),
        "final answers a client would stop on: {wrong:?}"
    );
    assert!(
        slowest <= Duration::from_millis(10_500),
        "an answer took {slowest:?}"
    );
    orders.kill().await;
    schema.drop().await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn a_silent_postgres_link_is_answered_within_the_deadline_and_each_key_runs_once() {
    blackhole("PostgreSQL", SharedSchema::postgres().await).await;
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn a_silent_mariadb_link_is_answered_within_the_deadline_and_each_key_runs_once() {
    blackhole("MariaDB", SharedSchema::mysql().await).await;
}

/// SIGTERM while requests are in flight (held up by another process's SQLite write lock):
/// every one is answered, nothing half-written, exit 0.
#[tokio::test]
async fn sigterm_under_load_answers_every_request_in_flight_and_exits_zero() {
    use sqlx::Connection;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("orders.db");
    let url = format!("sqlite://{}", path.display());
    let mut orders = start_orders(&url).await;
    let client = Client::new(&orders.url);
    assert_eq!(
        client
            .place(&unique("warm"), Duration::from_secs(10))
            .await
            .expect("answer")
            .status,
        StatusCode::CREATED
    );

    let mut lock = sqlx::SqliteConnection::connect(&url).await.expect("sqlite");
    sqlx::raw_sql("BEGIN IMMEDIATE")
        .execute(&mut lock)
        .await
        .expect("write lock");
    let in_flight: Vec<_> = (0..8)
        .map(|i| {
            let client = Arc::clone(&client);
            tokio::spawn(async move {
                client
                    .place(&unique(&format!("term-{i}")), Duration::from_secs(20))
                    .await
            })
        })
        .collect();
    // Long enough for all eight to reach the claim's lock wait, well within its 5 s bound.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    orders.signal("TERM");
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(!orders.has_exited(), "it waits for the requests in flight");
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut lock)
        .await
        .expect("release");
    drop(lock);

    let mut answers = BTreeMap::<String, usize>::new();
    for request in in_flight {
        *answers
            .entry(label(&request.await.expect("task")))
            .or_default() += 1;
    }
    let status = orders.exit_status(Duration::from_secs(15)).await;
    eprintln!("faults: SIGTERM with 8 requests in flight: answers {answers:?}, exit {status}");
    assert_eq!(answers.get("201 "), Some(&8), "{answers:?}");
    assert_eq!(status.code(), Some(0));

    let mut check = sqlx::SqliteConnection::connect(&url).await.expect("sqlite");
    let count: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM orders")
        .fetch_one(&mut check)
        .await
        .expect("count");
    assert_eq!(
        count, 9,
        "the warm-up order and the eight in flight, nothing else"
    );
}

// ---------------------------------------------------------------------------------------------
// Databases: a schema on the shared servers, or a private instance that may be killed
// ---------------------------------------------------------------------------------------------

/// A schema (PostgreSQL) or database (MariaDB) of the shared server, dropped at the end.
#[allow(dead_code)]
struct SharedSchema {
    url: String,
    drop_sql: String,
    admin_url: String,
}

#[allow(dead_code)]
impl SharedSchema {
    #[cfg(feature = "postgres")]
    async fn postgres() -> Self {
        let base = std::env::var("TEST_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        let schema = unique("orders");
        let admin = sqlx::PgPool::connect(&base)
            .await
            .unwrap_or_else(|e| panic!("PostgreSQL at {base} is unreachable: {e}"));
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
            .execute(&admin)
            .await
            .expect("schema");
        admin.close().await;
        Self {
            url: format!("{base}?options=-c%20search_path%3D{schema}"),
            drop_sql: format!("DROP SCHEMA {schema} CASCADE"),
            admin_url: base,
        }
    }

    #[cfg(feature = "mysql")]
    async fn mysql() -> Self {
        use sqlx::Connection;
        let base = std::env::var("TEST_MYSQL_URL")
            .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
        let database = unique("orders");
        let mut admin = sqlx::MySqlConnection::connect(&base)
            .await
            .unwrap_or_else(|e| panic!("MariaDB/MySQL at {base} is unreachable: {e}"));
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}")))
            .execute(&mut admin)
            .await
            .expect("database");
        let server = base
            .rsplit_once('/')
            .map_or(base.as_str(), |(server, _)| server);
        Self {
            url: format!("{server}/{database}"),
            drop_sql: format!("DROP DATABASE {database}"),
            admin_url: base,
        }
    }

    async fn drop(self) {
        let sql = sqlx::AssertSqlSafe(self.drop_sql);
        #[cfg(feature = "postgres")]
        if self.admin_url.starts_with("postgres") {
            let admin = sqlx::PgPool::connect(&self.admin_url).await.expect("admin");
            sqlx::raw_sql(sql).execute(&admin).await.expect("drop");
            admin.close().await;
            return;
        }
        #[cfg(feature = "mysql")]
        {
            use sqlx::Connection;
            let mut admin = sqlx::MySqlConnection::connect(&self.admin_url)
                .await
                .expect("admin");
            sqlx::raw_sql(sql).execute(&mut admin).await.expect("drop");
        }
    }
}

/// A database server of the test's own, which it may kill and start again.
#[allow(dead_code)]
trait PrivateDatabase {
    fn url(&self) -> String;
    /// Kills the server abruptly (no clean shutdown).
    fn kill(&mut self) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send + '_>>;
    /// Starts it again on the same data and port; returns once it accepts connections.
    fn start(&mut self) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send + '_>>;
}

#[allow(dead_code)]
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

#[allow(dead_code)]
fn is_root() -> bool {
    std::process::Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).trim() == "0")
}

/// Runs a PostgreSQL tool; as root, as the `postgres` user (the server refuses to run as root).
#[cfg(feature = "postgres")]
fn pg_tool(tool: &str, args: &[&str]) -> std::process::Output {
    let bin = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL server binaries under /usr/lib/postgresql")
        .filter_map(|entry| entry.ok().map(|e| e.path().join("bin")))
        .filter(|bin| bin.join(tool).exists())
        .max()
        .expect("a PostgreSQL version with its tools")
        .join(tool);
    let mut command = if is_root() {
        let mut command = std::process::Command::new("runuser");
        command.args(["-u", "postgres", "--"]).arg(bin);
        command
    } else {
        std::process::Command::new(bin)
    };
    let output = command.args(args).output().expect("run a PostgreSQL tool");
    assert!(
        output.status.success(),
        "{tool} {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

#[cfg(feature = "postgres")]
struct PrivatePostgres {
    dir: tempfile::TempDir,
    port: u16,
}

#[cfg(feature = "postgres")]
impl PrivatePostgres {
    async fn start() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        if is_root() {
            let status = std::process::Command::new("chown")
                .args(["postgres:", &dir.path().display().to_string()])
                .status()
                .expect("chown");
            assert!(status.success());
        }
        let data = dir.path().join("data").display().to_string();
        pg_tool(
            "initdb",
            &[
                "-D",
                &data,
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
                "-E",
                "UTF8",
            ],
        );
        let mut database = Self {
            port: free_port(),
            dir,
        };
        database.run().await;
        database
    }

    fn data(&self) -> String {
        self.dir.path().join("data").display().to_string()
    }

    async fn run(&mut self) {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=60",
            self.port,
            self.dir.path().display()
        );
        let log = self.dir.path().join("log").display().to_string();
        let data = self.data();
        tokio::task::spawn_blocking(move || {
            pg_tool(
                "pg_ctl",
                &[
                    "-D", &data, "-l", &log, "-o", &options, "-w", "-t", "30", "start",
                ],
            )
        })
        .await
        .expect("pg_ctl start");
    }
}

#[cfg(feature = "postgres")]
impl PrivateDatabase for PrivatePostgres {
    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    fn kill(&mut self) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        // Immediate mode: every server process quits at once, no checkpoint, crash recovery on
        // the next start (a SIGKILL of the postmaster alone would leave its backends behind).
        let data = self.data();
        Box::pin(async move {
            tokio::task::spawn_blocking(move || {
                pg_tool("pg_ctl", &["-D", &data, "-m", "immediate", "-w", "stop"])
            })
            .await
            .expect("pg_ctl stop");
        })
    }

    fn start(&mut self) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(self.run())
    }
}

#[cfg(feature = "postgres")]
impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let data = self.data();
        // Already stopped is fine: this only makes sure nothing is left running.
        let _ = std::panic::catch_unwind(|| {
            pg_tool("pg_ctl", &["-D", &data, "-m", "immediate", "-w", "stop"])
        });
    }
}

#[cfg(feature = "mysql")]
struct PrivateMariaDb {
    dir: tempfile::TempDir,
    port: u16,
    server: Option<std::process::Child>,
}

#[cfg(feature = "mysql")]
impl PrivateMariaDb {
    async fn start() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = dir.path().join("data");
        let mut install = tokio::process::Command::new("mariadb-install-db");
        install
            .arg("--no-defaults")
            .arg(format!("--datadir={}", data.display()))
            .args(["--auth-root-authentication-method=normal", "--skip-test-db"]);
        if is_root() {
            install.arg("--user=root");
        }
        let status = install
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .await
            .expect("mariadb-install-db");
        assert!(status.success(), "mariadb-install-db failed");
        let mut database = Self {
            dir,
            port: free_port(),
            server: None,
        };
        database.run().await;
        use sqlx::Connection;
        let mut admin = sqlx::MySqlConnection::connect(&format!(
            "mysql://root@127.0.0.1:{}/mysql",
            database.port
        ))
        .await
        .expect("admin");
        sqlx::raw_sql("CREATE DATABASE orders")
            .execute(&mut admin)
            .await
            .expect("database");
        database
    }

    async fn run(&mut self) {
        let dir = self.dir.path();
        let mut command = std::process::Command::new("mariadbd");
        command
            .arg("--no-defaults")
            .arg(format!("--datadir={}", dir.join("data").display()))
            .arg(format!("--port={}", self.port))
            .arg(format!("--socket={}", dir.join("sock").display()))
            .arg(format!("--log-error={}", dir.join("err").display()))
            .arg(format!("--pid-file={}", dir.join("pid").display()))
            .args([
                "--bind-address=127.0.0.1",
                "--skip-log-bin",
                "--innodb-buffer-pool-size=32M",
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        if is_root() {
            command.arg("--user=root");
        }
        self.server = Some(command.spawn().expect("mariadbd"));
        let url = format!("mysql://root@127.0.0.1:{}/mysql", self.port);
        let started = Instant::now();
        loop {
            use sqlx::Connection;
            if let Ok(connection) = sqlx::MySqlConnection::connect(&url).await {
                let _ = connection.close().await;
                return;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the private MariaDB did not start"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

#[cfg(feature = "mysql")]
impl PrivateDatabase for PrivateMariaDb {
    fn url(&self) -> String {
        format!("mysql://root@127.0.0.1:{}/orders", self.port)
    }

    fn kill(&mut self) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(async move {
            if let Some(mut server) = self.server.take() {
                let _ = server.kill(); // SIGKILL: no shutdown, InnoDB recovers on start
                let _ = tokio::task::spawn_blocking(move || server.wait()).await;
            }
        })
    }

    fn start(&mut self) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(self.run())
    }
}

#[cfg(feature = "mysql")]
impl Drop for PrivateMariaDb {
    fn drop(&mut self) {
        if let Some(mut server) = self.server.take() {
            let _ = server.kill();
            let _ = server.wait();
        }
    }
}

/// The payments example stops on SIGTERM as on Ctrl-C, and exits 0, even when the signal comes
/// the moment it says it is listening (its handler is registered before that line).
#[cfg(feature = "outbox")]
#[tokio::test]
async fn payments_example_exits_zero_on_sigterm() {
    let dir = tempfile::tempdir().expect("tempdir");
    let url = format!("sqlite:{}", dir.path().join("payments.db").display());
    let payments = Process::start("payments", &[("DATABASE_URL", &url)]).await;
    payments.signal("TERM");
    let status = payments.exit_status(Duration::from_secs(15)).await;
    assert_eq!(status.code(), Some(0), "{status}");
}
