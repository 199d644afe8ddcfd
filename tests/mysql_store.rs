//! `MySqlStore` against the real MariaDB server, through the layer. The store driven directly
//! (claims, lock waits, purges, migrations) is tested inside the crate, in `src/store/tests/`.
//!
//! Each test creates a database of its own and drops it at the end, so tests run in parallel.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{Request, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use axum_idempotency::{Classification, IdempotencyLayer, MySqlStore, Tx};
use http_body_util::BodyExt;
use sqlx::mysql::{MySqlPool, MySqlPoolOptions};
use sqlx::{Connection, MySql};
use tower::ServiceExt;

mod common;

use common::{App, Backend, Db, Reply, second_instance, serve, unique};
use serde_json::json;

const SERVER: &str = "mysql://root@127.0.0.1:3306";

/// A database of the test's own, dropped by [`TestDb::drop`].
struct TestDb {
    name: String,
}

impl TestDb {
    async fn create() -> Self {
        let name = common::unique("idem");
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

async fn count(pool: &MySqlPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
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
    layer: impl FnOnce(IdempotencyLayer<MySql>) -> IdempotencyLayer<MySql>,
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
        |l| l.retention(Duration::from_millis(1)),
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
    one.dispose().await;
    two.dispose().await;
    <MySql as Backend>::dispose(isolated).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_queued_behind_a_rolled_back_original_execute_once_more_without_5xx() {
    let isolated = <MySql as Backend>::fresh(8).await;
    // The first execution is classified retryable (rolled back), so a queued duplicate takes
    // the key over while the others wait on it.
    let attempts = Arc::new(AtomicUsize::new(0));
    let first_rolls_back = |attempts: Arc<AtomicUsize>| {
        move |layer: IdempotencyLayer<MySql>| {
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
    one.dispose().await;
    two.dispose().await;
    <MySql as Backend>::dispose(isolated).await;
}
