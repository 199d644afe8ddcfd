//! The engine's metrics, read back from a recorder after real requests through the layer on
//! SQLite: one counter per answered outcome, and the claim latency by what the claim found.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::Path;
use axum::http::{Request, StatusCode};
use axum::response::Response;
use axum::routing::post;
use axum::{Extension, Router};
use axum_idempotency::{IdempotencyLayer, Principal, SqliteStore, Tx};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use sqlx::Sqlite;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
use tokio::sync::Notify;
use tower::ServiceExt;

#[derive(Clone)]
struct User(&'static str);

impl Principal for User {
    fn principal_id(&self) -> Cow<'_, str> {
        Cow::Borrowed(self.0)
    }
}

/// Lets the test hold a request inside its handler, and know when it got there.
#[derive(Default)]
struct Gate {
    entered: Notify,
    release: Notify,
}

/// Answers with the status named in the path; `/hold/...` first waits until released.
async fn answer(
    Path(status): Path<u16>,
    Extension(gate): Extension<Arc<Gate>>,
    tx: Tx<Sqlite>,
    request: Request<Body>,
) -> Response {
    if request.uri().path().starts_with("/hold") {
        gate.entered.notify_one();
        gate.release.notified().await;
    }
    drop(tx);
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    Response::builder()
        .status(status)
        .body(Body::from(format!("answered {status}")))
        .unwrap_or_default()
}

fn app(store: SqliteStore, retention: Duration, gate: Arc<Gate>) -> Router {
    Router::new()
        .route("/status/{code}", post(answer))
        .route("/hold/{code}", post(answer))
        .route_layer(
            IdempotencyLayer::new(store)
                .principal_extension::<User>()
                .retention(retention)
                .wait_for_in_flight(Duration::from_millis(200)),
        )
        .layer(Extension(User("alice-principal")))
        .layer(Extension(gate))
}

async fn send(app: &Router, path: &str, key: &str, body: &'static str) -> StatusCode {
    let request = Request::post(path)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from(body))
        .expect("request");
    app.clone()
        .oneshot(request)
        .await
        .expect("infallible")
        .status()
}

/// Counter values and histogram sample counts, by metric name and label values.
fn read(snapshotter: &Snapshotter) -> HashMap<(String, Vec<String>), u64> {
    let mut seen = HashMap::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let labels = key
            .key()
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        let n = match value {
            DebugValue::Counter(n) => n,
            DebugValue::Histogram(samples) => samples.len() as u64,
            DebugValue::Gauge(_) => continue,
        };
        seen.insert((key.key().name().to_owned(), labels), n);
    }
    seen
}

fn get(seen: &HashMap<(String, Vec<String>), u64>, name: &str, label: &str) -> u64 {
    seen.get(&(name.to_owned(), vec![label.to_owned()]))
        .copied()
        .unwrap_or(0)
}

// One test only: the recorder is process-global, and the counts below are exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_outcome_is_counted_and_every_claim_timed() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder
        .install()
        .expect("the only recorder of this test binary");

    let dir = tempfile::tempdir().expect("temp dir");
    let options = SqliteConnectOptions::new()
        .filename(dir.path().join("metrics.db"))
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal);
    let pool = SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .expect("sqlite pool");
    let store = SqliteStore::new(pool);
    store.migrate().await.expect("migrate");
    let gate = Arc::new(Gate::default());
    let app = app(store.clone(), Duration::from_secs(3600), gate.clone());

    // Executed, replayed, then the same key for another intent.
    assert_eq!(
        send(&app, "/status/201", "k-exec", "1").await,
        StatusCode::CREATED
    );
    assert_eq!(
        send(&app, "/status/201", "k-exec", "1").await,
        StatusCode::CREATED
    );
    assert_eq!(
        send(&app, "/status/201", "k-exec", "2").await,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    // A final refusal and a retryable failure.
    assert_eq!(
        send(&app, "/status/404", "k-final", "1").await,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        send(&app, "/status/503", "k-retry", "1").await,
        StatusCode::SERVICE_UNAVAILABLE
    );
    // A second instance (its own engine, the same table) finds the key taken by its claim.
    let other = self::app(store.clone(), Duration::from_secs(3600), gate.clone());
    assert_eq!(
        send(&other, "/status/201", "k-exec", "1").await,
        StatusCode::CREATED
    );

    // A duplicate of work in flight waits, then gives up with 409.
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, "/hold/200", "k-held", "1").await }
    });
    // The first holds the claim once its handler runs.
    gate.entered.notified().await;
    assert_eq!(
        send(&app, "/hold/200", "k-held", "1").await,
        StatusCode::CONFLICT
    );
    gate.release.notify_one();
    assert_eq!(first.await.expect("first"), StatusCode::OK);

    // A record past its retention: the key is a new intent.
    let short = self::app(store, Duration::from_millis(50), gate);
    assert_eq!(
        send(&short, "/status/201", "k-expire", "1").await,
        StatusCode::CREATED
    );
    tokio::time::sleep(Duration::from_millis(120)).await;
    assert_eq!(
        send(&short, "/status/201", "k-expire", "1").await,
        StatusCode::CREATED
    );

    let seen = read(&snapshotter);
    let requests = "idempotency_requests_total";
    let expected = [
        ("outcome=executed", 3), // k-exec, k-held, k-expire's first
        ("outcome=replayed", 2), // k-exec again, on this instance and on the other
        ("outcome=mismatch", 1),
        ("outcome=failed_permanent", 1),
        ("outcome=retryable", 1),
        ("outcome=in_flight", 1),
        ("outcome=expired", 1),
    ];
    for (label, count) in expected {
        assert_eq!(get(&seen, requests, label), count, "{label} in {seen:?}");
    }

    let claims = "idempotency_claim_seconds";
    // k-exec, k-final (twice: the claim, then the refusal's record), k-retry, k-held,
    // k-expire's first; the expired record's replacement claimed in the transaction its read
    // began, which is also timed.
    assert!(get(&seen, claims, "result=claimed") >= 6, "{seen:?}");
    assert_eq!(get(&seen, claims, "result=taken"), 1, "{seen:?}");
    assert_eq!(get(&seen, claims, "result=busy"), 1, "{seen:?}");

    // Labels name outcomes only: never a key, a principal or a route.
    for (name, labels) in seen.keys() {
        let text = format!("{name} {labels:?}");
        for secret in ["k-", "alice", "/status", "/hold"] {
            assert!(!text.contains(secret), "{secret} leaked into {text}");
        }
    }
}
