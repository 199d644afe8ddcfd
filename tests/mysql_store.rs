//! `MySqlStore` against the real MariaDB server, directly and through the layer.
//!
//! Each test creates a database of its own and drops it at the end, so tests run in parallel.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{Request, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use axum_idempotency::{
    Classification, Error, IdempotencyLayer, MySqlStore, RecordState, Store, StoredResponse, Tx,
};
use http_body_util::BodyExt;
use sqlx::mysql::{MySqlPool, MySqlPoolOptions};
use sqlx::{Connection, MySql};
use tower::ServiceExt;

mod common;

use common::{App, Backend, Db, Reply, now_ms, record, scope, second_instance, serve, unique};
use serde_json::json;

const SERVER: &str = "mysql://root@127.0.0.1:3306";

/// A database of the test's own, dropped by [`TestDb::drop`].
struct TestDb {
    name: String,
}

impl TestDb {
    async fn create() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let name = format!(
            "idem_{}_{nanos}_{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let mut admin = sqlx::MySqlConnection::connect(&format!("{SERVER}/test"))
            .await
            .expect("MariaDB must be reachable at 127.0.0.1:3306");
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut admin)
            .await
            .unwrap();
        Self { name }
    }

    fn url(&self) -> String {
        format!("{SERVER}/{}", self.name)
    }

    async fn pool(&self, max_connections: u32) -> MySqlPool {
        MySqlPoolOptions::new()
            .max_connections(max_connections)
            .connect(&self.url())
            .await
            .unwrap()
    }

    async fn store(&self) -> MySqlStore {
        let store = MySqlStore::new(self.pool(8).await);
        store.migrate().await.unwrap();
        store
    }

    async fn drop(self) {
        let mut admin = sqlx::MySqlConnection::connect(&format!("{SERVER}/test"))
            .await
            .unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP DATABASE {}", self.name)))
            .execute(&mut admin)
            .await
            .unwrap();
    }
}

fn completed(body: &'static str) -> StoredResponse {
    StoredResponse {
        status: StatusCode::CREATED,
        headers: http::HeaderMap::new(),
        body: body.into(),
    }
}

async fn count(pool: &MySqlPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

// ---------------------------------------------------------------- migrations

#[tokio::test]
async fn migrate_twice_is_a_no_op() {
    let db = TestDb::create().await;
    let store = MySqlStore::new(db.pool(2).await);
    store.migrate().await.unwrap();
    store.migrate().await.unwrap();
    let pool = store.pool();
    assert_eq!(
        count(pool, "SELECT COUNT(*) FROM idempotency_schema_versions").await,
        1
    );
    assert_eq!(
        count(pool, "SELECT MAX(version) FROM idempotency_schema_versions").await,
        1
    );
    let engine: String = sqlx::query_scalar(
        "SELECT engine FROM information_schema.tables \
         WHERE table_schema = DATABASE() AND table_name = 'idempotency_records'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(engine, "InnoDB");
    db.drop().await;
}

#[tokio::test]
async fn concurrent_migrations_from_separate_instances_all_succeed_once() {
    let db = TestDb::create().await;
    let mut stores = Vec::new();
    for _ in 0..4 {
        stores.push(MySqlStore::new(db.pool(2).await));
    }
    let results = futures_util::future::join_all(stores.iter().map(Store::migrate)).await;
    for result in results {
        result.unwrap();
    }
    let pool = stores[0].pool();
    assert_eq!(
        count(pool, "SELECT COUNT(*) FROM idempotency_schema_versions").await,
        1
    );
    // The session lock is released, not left on a pooled connection: another session takes it.
    let taken: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT GET_LOCK({LOCK_NAME}, 0)"
    )))
    .fetch_one(&db.pool(1).await)
    .await
    .unwrap();
    assert_eq!(taken, Some(1));
    db.drop().await;
}

const LOCK_NAME: &str = "CONCAT('axum_idempotency.migrate:', MD5(DATABASE()))";

#[tokio::test]
async fn migrate_waits_for_the_instance_holding_the_migration_lock() {
    let db = TestDb::create().await;
    let mut holder = sqlx::MySqlConnection::connect(&db.url()).await.unwrap();
    let taken: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT GET_LOCK({LOCK_NAME}, 0)"
    )))
    .fetch_one(&mut holder)
    .await
    .unwrap();
    assert_eq!(taken, Some(1));

    let store = MySqlStore::new(db.pool(1).await);
    let migrating = tokio::spawn({
        let store = store.clone();
        async move { store.migrate().await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !migrating.is_finished(),
        "migrate went ahead without the lock"
    );
    let tables: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE()",
    )
    .fetch_one(&mut holder)
    .await
    .unwrap();
    assert_eq!(tables, 0);

    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DO RELEASE_LOCK({LOCK_NAME})")))
        .execute(&mut holder)
        .await
        .unwrap();
    migrating.await.unwrap().unwrap();
    assert_eq!(
        count(
            store.pool(),
            "SELECT COUNT(*) FROM idempotency_schema_versions"
        )
        .await,
        1
    );
    holder.close().await.unwrap();
    db.drop().await;
}

// ---------------------------------------------------------------- the store itself

#[tokio::test]
async fn claim_takes_a_fresh_key_and_not_a_live_one() {
    let db = TestDb::create().await;
    // One connection, so every claim below reuses the session the previous claim ran on.
    let store = MySqlStore::new(db.pool(1).await);
    store.migrate().await.unwrap();
    let first = scope("k-live");
    let now = now_ms();

    let mut tx = store.begin(Duration::from_secs(1)).await.unwrap();
    let claim = record(&first, "a", RecordState::Processing, None, now, 60_000);
    assert!(
        store
            .claim(&mut tx, &claim, Duration::from_secs(1))
            .await
            .unwrap()
    );
    store
        .finish(
            &mut tx,
            &first.scoped_key(),
            RecordState::Completed,
            &completed("one"),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let mut tx = store.begin(Duration::from_secs(1)).await.unwrap();
    let duplicate = record(&first, "b", RecordState::Processing, None, now + 1, 60_000);
    assert!(
        !store
            .claim(&mut tx, &duplicate, Duration::from_secs(1))
            .await
            .unwrap()
    );
    let found = store
        .find(&mut tx, &first.scoped_key())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(found.state, RecordState::Completed);
    assert_eq!(found.fingerprint, claim.fingerprint);
    assert_eq!(found.response.unwrap().body.as_ref(), b"one");
    drop(tx);

    // A fresh key on the session where the last claim found a live record is still claimed.
    let second = scope("k-fresh");
    let mut tx = store.begin(Duration::from_secs(1)).await.unwrap();
    let claim = record(&second, "c", RecordState::Processing, None, now, 60_000);
    assert!(
        store
            .claim(&mut tx, &claim, Duration::from_secs(1))
            .await
            .unwrap()
    );
    tx.commit().await.unwrap();
    assert_eq!(
        count(store.pool(), "SELECT COUNT(*) FROM idempotency_records").await,
        2
    );
    db.drop().await;
}

#[tokio::test]
async fn claim_replaces_an_expired_record_in_place() {
    let db = TestDb::create().await;
    let store = db.store().await;
    let scope = scope("k-expired");
    let old = completed("old");
    let past = now_ms() - 10_000;

    let mut tx = store.begin(Duration::from_secs(1)).await.unwrap();
    let expired = record(
        &scope,
        "old",
        RecordState::Completed,
        Some(&old),
        past,
        1_000,
    );
    assert!(
        store
            .claim(&mut tx, &expired, Duration::from_secs(1))
            .await
            .unwrap()
    );
    tx.commit().await.unwrap();

    let now = now_ms();
    let mut tx = store.begin(Duration::from_secs(1)).await.unwrap();
    let fresh = record(&scope, "new", RecordState::Processing, None, now, 60_000);
    assert!(
        store
            .claim(&mut tx, &fresh, Duration::from_secs(1))
            .await
            .unwrap()
    );
    let found = store
        .find(&mut tx, &scope.scoped_key())
        .await
        .unwrap()
        .unwrap();
    tx.commit().await.unwrap();

    assert_eq!(found.state, RecordState::Processing);
    assert_eq!(found.fingerprint, fresh.fingerprint);
    assert!(found.response.is_none());
    assert_eq!(found.created_at_ms, now);
    assert_eq!(found.expires_at_ms, now + 60_000);
    assert_eq!(
        count(store.pool(), "SELECT COUNT(*) FROM idempotency_records").await,
        1
    );
    db.drop().await;
}

#[tokio::test]
async fn lock_wait_is_rounded_up_to_whole_seconds_and_restored_after_the_claim() {
    let db = TestDb::create().await;
    let store = MySqlStore::new(db.pool(1).await);
    store.migrate().await.unwrap();
    let setting = "SELECT @@SESSION.innodb_lock_wait_timeout";
    let mut conn = store.pool().acquire().await.unwrap();
    sqlx::raw_sql("SET SESSION innodb_lock_wait_timeout = 37")
        .execute(&mut *conn)
        .await
        .unwrap();
    drop(conn);

    for (wait, secs) in [(10, 1), (1000, 1), (1500, 2), (5000, 5)] {
        let mut tx = store.begin(Duration::from_millis(wait)).await.unwrap();
        let bound: u64 = sqlx::query_scalar(setting)
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        assert_eq!(bound, secs, "a wait of {wait} ms");
        let key = scope(&format!("k-wait-{wait}"));
        let claim = record(&key, "a", RecordState::Processing, None, now_ms(), 60_000);
        assert!(
            store
                .claim(&mut tx, &claim, Duration::from_millis(wait))
                .await
                .unwrap()
        );
        let lifted: u64 = sqlx::query_scalar(setting)
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        assert_eq!(
            lifted, 37,
            "the handler's statements get the session's own bound"
        );
        tx.commit().await.unwrap();
    }
    let pooled: u64 = sqlx::query_scalar(setting)
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(pooled, 37);
    db.drop().await;
}

#[tokio::test]
async fn duplicate_of_an_in_flight_claim_is_busy_after_the_wait_and_the_bound_is_restored() {
    let db = TestDb::create().await;
    let store = db.store().await;
    let scope = scope("k-in-flight");

    let mut holder = store.begin(Duration::from_secs(1)).await.unwrap();
    let claim = record(&scope, "a", RecordState::Processing, None, now_ms(), 60_000);
    assert!(
        store
            .claim(&mut holder, &claim, Duration::from_secs(1))
            .await
            .unwrap()
    );

    let mut waiter = store.begin(Duration::from_secs(1)).await.unwrap();
    let duplicate = record(&scope, "a", RecordState::Processing, None, now_ms(), 60_000);
    let outcome = store
        .claim(&mut waiter, &duplicate, Duration::from_secs(1))
        .await;
    assert!(matches!(outcome, Err(Error::Busy)), "{outcome:?}");
    let lifted: u64 = sqlx::query_scalar("SELECT @@SESSION.innodb_lock_wait_timeout")
        .fetch_one(&mut *waiter)
        .await
        .unwrap();
    assert_eq!(lifted, 50, "the server default");
    drop(waiter);
    holder.rollback().await.unwrap();
    db.drop().await;
}

#[tokio::test]
async fn deadlocked_claims_are_conflicts_not_errors() {
    let db = TestDb::create().await;
    let store = db.store().await;
    let (a, b) = (scope("k-dead-a"), scope("k-dead-b"));
    let now = now_ms();
    let claim_a = record(&a, "a", RecordState::Processing, None, now, 60_000);
    let claim_b = record(&b, "b", RecordState::Processing, None, now, 60_000);

    let mut first = store.begin(Duration::from_secs(10)).await.unwrap();
    let mut second = store.begin(Duration::from_secs(10)).await.unwrap();
    assert!(
        store
            .claim(&mut first, &claim_a, Duration::from_secs(10))
            .await
            .unwrap()
    );
    assert!(
        store
            .claim(&mut second, &claim_b, Duration::from_secs(10))
            .await
            .unwrap()
    );
    // Each now waits for the other's key: InnoDB detects the cycle and aborts one of them.
    let (one, two) = tokio::join!(
        store.claim(&mut first, &claim_b, Duration::from_secs(10)),
        store.claim(&mut second, &claim_a, Duration::from_secs(10))
    );
    let victims = [&one, &two]
        .iter()
        .filter(|r| matches!(r, Err(Error::Conflict)))
        .count();
    assert_eq!(victims, 1, "{one:?} {two:?}");
    assert!(
        [&one, &two]
            .iter()
            .all(|r| matches!(r, Ok(_) | Err(Error::Conflict))),
        "{one:?} {two:?}"
    );
    first.rollback().await.unwrap();
    second.rollback().await.unwrap();
    db.drop().await;
}

#[tokio::test]
async fn purge_deletes_expired_records_in_batches_and_keeps_live_ones() {
    let db = TestDb::create().await;
    let store = db.store().await;
    let past = now_ms() - 60_000;
    let mut tx = store.begin(Duration::from_secs(5)).await.unwrap();
    let stored = completed("x");
    for i in 0..2_500 {
        let scope = scope(&format!("k-purge-{i}"));
        let expired = record(
            &scope,
            "x",
            RecordState::Completed,
            Some(&stored),
            past,
            1_000,
        );
        assert!(
            store
                .claim(&mut tx, &expired, Duration::from_secs(5))
                .await
                .unwrap()
        );
    }
    for i in 0..3 {
        let scope = scope(&format!("k-keep-{i}"));
        let live = record(
            &scope,
            "x",
            RecordState::Completed,
            Some(&stored),
            now_ms(),
            60_000,
        );
        assert!(
            store
                .claim(&mut tx, &live, Duration::from_secs(5))
                .await
                .unwrap()
        );
    }
    tx.commit().await.unwrap();

    assert_eq!(
        store.purge_expired_batch(now_ms(), 1000).await.unwrap(),
        1000
    );
    assert_eq!(store.purge_expired().await.unwrap(), 1_500);
    assert_eq!(store.purge_expired().await.unwrap(), 0);
    assert_eq!(
        count(store.pool(), "SELECT COUNT(*) FROM idempotency_records").await,
        3
    );
    db.drop().await;
}

// ---------------------------------------------------------------- through the layer

const KEY: &str = "8e03978e-40d5-43e8-bc93-6894a57f9324";

async fn create_orders_table(pool: &MySqlPool) {
    sqlx::raw_sql(
        "CREATE TABLE orders (id BIGINT AUTO_INCREMENT PRIMARY KEY, body TEXT NOT NULL) \
         ENGINE = InnoDB",
    )
    .execute(pool)
    .await
    .unwrap();
}

/// Inserts an order, then holds the claim a while so duplicates arrive while it is in flight.
async fn create_order(
    State(hold): State<Duration>,
    mut tx: Tx<MySql>,
    body: String,
) -> axum::response::Response {
    let inserted = sqlx::query("INSERT INTO orders (body) VALUES (?)")
        .bind(body)
        .execute(&mut *tx)
        .await;
    let Ok(inserted) = inserted else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    tokio::time::sleep(hold).await;
    let id = inserted.last_insert_id();
    (
        StatusCode::CREATED,
        [("location", format!("/orders/{id}"))],
        format!("order {id}"),
    )
        .into_response()
}

fn app(
    store: MySqlStore,
    layer: impl FnOnce(IdempotencyLayer<MySqlStore>) -> IdempotencyLayer<MySqlStore>,
    hold: Duration,
) -> Router {
    Router::new()
        .route("/orders", post(create_order))
        .route_layer(layer(IdempotencyLayer::new(store).allow_anonymous()))
        .with_state(hold)
}

fn order_request(body: &'static str) -> Request<Body> {
    Request::post("/orders")
        .header("idempotency-key", KEY)
        .body(Body::from(body))
        .unwrap()
}

async fn body_of(response: axum::response::Response) -> Vec<u8> {
    response
        .into_body()
        .collect()
        .await
        .unwrap()
        .to_bytes()
        .to_vec()
}

#[tokio::test]
async fn layer_replays_the_first_response_and_runs_the_handler_once() {
    let db = TestDb::create().await;
    let store = db.store().await;
    create_orders_table(store.pool()).await;
    let app = app(store.clone(), |l| l, Duration::ZERO);

    let first = app.clone().oneshot(order_request("widget")).await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    assert!(first.headers().get("idempotent-replayed").is_none());
    let location = first.headers()["location"].clone();
    let first_body = body_of(first).await;

    let retry = app.oneshot(order_request("widget")).await.unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(retry.headers()["location"], location);
    assert_eq!(body_of(retry).await, first_body);
    assert_eq!(count(store.pool(), "SELECT COUNT(*) FROM orders").await, 1);
    db.drop().await;
}

#[tokio::test]
async fn layer_rejects_the_same_key_with_a_different_body_with_422() {
    let db = TestDb::create().await;
    let store = db.store().await;
    create_orders_table(store.pool()).await;
    let app = app(store.clone(), |l| l, Duration::ZERO);

    let first = app.clone().oneshot(order_request("widget")).await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    let other = app.oneshot(order_request("gadget")).await.unwrap();
    assert_eq!(other.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(other.headers()["content-type"], "application/problem+json");
    let problem: serde_json::Value = serde_json::from_slice(&body_of(other).await).unwrap();
    assert_eq!(problem["code"], "idempotency_key_reused");
    let bodies: Vec<String> = sqlx::query_scalar("SELECT body FROM orders")
        .fetch_all(store.pool())
        .await
        .unwrap();
    assert_eq!(bodies, ["widget"]);
    db.drop().await;
}

#[tokio::test]
async fn layer_treats_an_expired_key_as_a_new_intent() {
    let db = TestDb::create().await;
    let store = db.store().await;
    create_orders_table(store.pool()).await;
    let app = app(
        store.clone(),
        |l| l.ttl(Duration::from_millis(1)),
        Duration::ZERO,
    );

    let first = app.clone().oneshot(order_request("widget")).await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let again = app.oneshot(order_request("gadget")).await.unwrap();
    assert_eq!(again.status(), StatusCode::CREATED);
    assert!(again.headers().get("idempotent-replayed").is_none());
    assert_eq!(count(store.pool(), "SELECT COUNT(*) FROM orders").await, 2);
    // The expired record was replaced under the same key, not joined by a second one.
    assert_eq!(
        count(store.pool(), "SELECT COUNT(*) FROM idempotency_records").await,
        1
    );
    db.drop().await;
}

// ---------------------------------------------------------------- InnoDB under a storm

/// Sends `n` duplicates of one request at once, alternating between two app instances.
async fn storm(apps: [&App<MySql>; 2], key: &str, n: usize) -> Vec<Reply> {
    let payload = json!({ "label": "storm", "sleep_ms": 300 }).to_string();
    let requests = (0..n).map(|i| apps[i % 2].post("/effects", Some("alice"), Some(key), &payload));
    futures_util::future::join_all(requests).await
}

fn is_in_progress(reply: &Reply) -> bool {
    reply.status == StatusCode::CONFLICT && reply.code() == "idempotency_request_in_progress"
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_duplicates_across_two_pools_execute_once_without_5xx() {
    let isolated = <MySql as Backend>::fresh(8).await;
    let one = serve(isolated.pool.clone(), |layer| layer).await;
    let two = second_instance(&isolated).await;

    let replies = storm([&one, &two], &unique("storm"), 50).await;

    assert_eq!(<MySql as Db>::count_effects(&one.pool, "storm").await, 1);
    assert_eq!(one.executions() + two.executions(), 1);
    assert!(
        replies.iter().all(|r| !r.status.is_server_error()),
        "{replies:?}"
    );
    let first: Vec<_> = replies
        .iter()
        .filter(|r| !r.replayed() && !is_in_progress(r))
        .collect();
    assert_eq!(first.len(), 1, "{replies:?}");
    assert_eq!(first[0].status, StatusCode::CREATED);
    for reply in &replies {
        assert!(
            reply.status == StatusCode::CREATED || is_in_progress(reply),
            "{reply:?}"
        );
        if reply.replayed() {
            assert_eq!(reply.body, first[0].body);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_queued_behind_a_rolled_back_original_execute_once_more_without_5xx() {
    let isolated = <MySql as Backend>::fresh(8).await;
    // The first execution is classified retryable (rolled back), so a queued duplicate takes
    // the key over while the others wait on it.
    let attempts = Arc::new(AtomicUsize::new(0));
    let first_rolls_back = |attempts: Arc<AtomicUsize>| {
        move |layer: IdempotencyLayer<MySqlStore>| {
            layer
                .wait_for_in_flight(Duration::from_secs(30))
                .classify(move |status| {
                    if attempts.fetch_add(1, Ordering::SeqCst) == 0 {
                        Classification::Retryable
                    } else {
                        Classification::of_status(status)
                    }
                })
        }
    };
    let one = serve(
        isolated.pool.clone(),
        first_rolls_back(Arc::clone(&attempts)),
    )
    .await;
    let two = serve(
        <MySql as Backend>::another_pool(&isolated, 8).await,
        first_rolls_back(Arc::clone(&attempts)),
    )
    .await;

    let replies = storm([&one, &two], &unique("rollback"), 50).await;

    assert_eq!(<MySql as Db>::count_effects(&one.pool, "storm").await, 1);
    assert_eq!(
        one.executions() + two.executions(),
        2,
        "one rolled back, one committed"
    );
    assert_eq!(attempts.load(Ordering::SeqCst), 2);
    // When the original rolls back, InnoDB turns the waiters' locks on its row into gap locks,
    // and waiters that then insert deadlock; the engine claims again for the victims, which
    // then wait for the new winner and replay it.
    for reply in &replies {
        assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    }
}
