//! What a handler's `Tx` answers when it is misused or when the outbox refuses a message: a
//! route without the layer is told the fix, and `?` on an enqueue keeps the crate's answers.
//! And which transaction it is where two layers of one driver wrap a route: each marker's own.

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::routing::post;
use axum_idempotency::outbox::{DownstreamKey, Message, Outbox};
use axum_idempotency::{IdempotencyLayer, SqliteStore, Tx, TxError};
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;
use sqlx::{Sqlite, SqlitePool};
use tower::ServiceExt;

mod common;

async fn pool() -> SqlitePool {
    // One connection: every handle of the pool sees the same in-memory database.
    sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(1)
        .connect("sqlite::memory:")
        .await
        .unwrap()
}

/// The idempotency store on `pool`, migrated, beside the app's table that `create` makes.
async fn store_with(pool: &SqlitePool, create: &'static str) -> SqliteStore {
    sqlx::query(create).execute(pool).await.unwrap();
    let store = SqliteStore::new(pool.clone());
    store.migrate().await.unwrap();
    store
}

/// A keyed `POST` of `body` to `path`: the status and the JSON body, if any.
async fn call(app: &Router, path: &str, key: &str, body: &'static str) -> (StatusCode, Value) {
    let request = Request::post(path)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from(body))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (status, body)
}

/// The detail of `answer`, which must be a `500 idempotency_layer_missing`.
fn layer_missing_detail((status, problem): &(StatusCode, Value)) -> &str {
    assert_eq!(*status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(problem["code"], "idempotency_layer_missing");
    problem["detail"].as_str().unwrap()
}

#[tokio::test]
async fn a_tx_on_a_route_without_the_layer_is_answered_with_the_fix() {
    async fn charge(mut tx: Tx<Sqlite>) -> Result<StatusCode, TxError> {
        sqlx::query("SELECT 1").execute(&mut *tx).await?;
        Ok(StatusCode::CREATED)
    }
    let app = Router::new().route("/charges", post(charge));
    let answer = call(&app, "/charges", "k1", "{}").await;
    let detail = layer_missing_detail(&answer);
    assert!(
        detail.contains("IdempotencyLayer") && detail.contains("route_layer"),
        "the detail names the fix: {detail}"
    );
}

/// One charge per request, to a downstream key every request shares: the second request's key
/// is taken by another intent.
async fn charge(
    State(outbox): State<Outbox<Sqlite>>,
    mut tx: Tx<Sqlite>,
    body: String,
) -> Result<StatusCode, TxError> {
    // `&mut tx` itself is an executor, as `&mut *tx` is.
    sqlx::query("INSERT INTO charges (body) VALUES (?)")
        .bind(&body)
        .execute(&mut tx)
        .await?;
    let key = DownstreamKey::new("charge-shared").expect("a valid key");
    outbox
        .enqueue(&mut tx, Message::new("charges", key, body.into_bytes()))
        .await?;
    Ok(StatusCode::ACCEPTED)
}

#[tokio::test]
async fn an_enqueue_refused_for_a_reused_downstream_key_is_final_and_commits_nothing() {
    let pool = pool().await;
    let store = store_with(&pool, "CREATE TABLE charges (body TEXT NOT NULL)").await;
    let outbox = Outbox::new(pool.clone());
    outbox.migrate().await.unwrap();
    let app = Router::new()
        .route("/charges", post(charge))
        .route_layer(IdempotencyLayer::new(store).allow_anonymous())
        .with_state(outbox);

    let (first, _) = call(&app, "/charges", "k1", r#"{"amount":1}"#).await;
    assert_eq!(first, StatusCode::ACCEPTED);
    let (second, problem) = call(&app, "/charges", "k2", r#"{"amount":2}"#).await;
    assert_eq!(second, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(problem["code"], "idempotency_key_reused");
    let charges: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM charges")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(charges, 1, "the refused request's own write rolled back");
    // Final, so stored: a retry of the refused request replays the refusal.
    let (again, problem) = call(&app, "/charges", "k2", r#"{"amount":2}"#).await;
    assert_eq!(again, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(problem["code"], "idempotency_key_reused");
}

/// The ledger's database, as the handlers name it.
struct Ledger;
/// The audit trail's database.
struct Audit;

/// A SQLite file of its own with the idempotency tables and an `entries` table.
async fn database(dir: &tempfile::TempDir, name: &str) -> (SqlitePool, SqliteStore) {
    let pool = common::sqlite::file_pool(dir.path(), name).await;
    let store = store_with(&pool, "CREATE TABLE entries (note TEXT NOT NULL)").await;
    (pool, store)
}

async fn entries(pool: &SqlitePool) -> Vec<String> {
    sqlx::query_scalar("SELECT note FROM entries ORDER BY rowid")
        .fetch_all(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn two_layers_of_one_driver_each_hand_their_own_tx_to_the_handler() {
    async fn book(mut ledger: Tx<Sqlite, Ledger>) -> Result<StatusCode, TxError> {
        sqlx::query("INSERT INTO entries (note) VALUES ('booked')")
            .execute(&mut ledger)
            .await?;
        Ok(StatusCode::CREATED)
    }
    async fn transfer(
        mut ledger: Tx<Sqlite, Ledger>,
        mut audit: Tx<Sqlite, Audit>,
    ) -> Result<StatusCode, TxError> {
        sqlx::query("INSERT INTO entries (note) VALUES ('transferred')")
            .execute(&mut ledger)
            .await?;
        sqlx::query("INSERT INTO entries (note) VALUES ('transfer seen')")
            .execute(&mut audit)
            .await?;
        Ok(StatusCode::CREATED)
    }
    async fn note(mut audit: Tx<Sqlite, Audit>) -> Result<StatusCode, TxError> {
        sqlx::query("INSERT INTO entries (note) VALUES ('noted')")
            .execute(&mut audit)
            .await?;
        Ok(StatusCode::CREATED)
    }
    async fn misrouted(mut ledger: Tx<Sqlite, Ledger>) -> Result<StatusCode, TxError> {
        sqlx::query("INSERT INTO entries (note) VALUES ('misrouted')")
            .execute(&mut ledger)
            .await?;
        Ok(StatusCode::CREATED)
    }

    let dir = tempfile::tempdir().unwrap();
    let (ledger, ledger_store) = database(&dir, "ledger.db").await;
    let (audit, audit_store) = database(&dir, "audit.db").await;
    // `route_layer` wraps the routes added before it: `/book` and `/transfer` are under both
    // layers, the audit layer outermost, and `/note` and `/misrouted` under the audit one only.
    let app = Router::new()
        .route("/book", post(book))
        .route("/transfer", post(transfer))
        .route_layer(
            IdempotencyLayer::new(ledger_store)
                .allow_anonymous()
                .tx_marker::<Ledger>(),
        )
        .route("/note", post(note))
        .route("/misrouted", post(misrouted))
        .route_layer(
            IdempotencyLayer::new(audit_store)
                .allow_anonymous()
                .tx_marker::<Audit>(),
        );

    assert_eq!(call(&app, "/book", "k1", "").await.0, StatusCode::CREATED);
    assert_eq!(
        entries(&ledger).await,
        ["booked"],
        "the inner layer's Tx, not the outer one's"
    );
    assert!(entries(&audit).await.is_empty());

    assert_eq!(call(&app, "/note", "k2", "").await.0, StatusCode::CREATED);
    assert_eq!(entries(&audit).await, ["noted"]);

    assert_eq!(
        call(&app, "/transfer", "k3", "").await.0,
        StatusCode::CREATED
    );
    assert_eq!(entries(&ledger).await, ["booked", "transferred"]);
    assert_eq!(entries(&audit).await, ["noted", "transfer seen"]);
    // A retry replays: neither database is written again.
    assert_eq!(
        call(&app, "/transfer", "k3", "").await.0,
        StatusCode::CREATED
    );
    assert_eq!(entries(&ledger).await, ["booked", "transferred"]);
    assert_eq!(entries(&audit).await, ["noted", "transfer seen"]);

    // The audit layer's transaction is not handed out under the ledger's marker.
    let answer = call(&app, "/misrouted", "k4", "").await;
    let detail = layer_missing_detail(&answer);
    assert!(
        detail.contains("tx_marker::<") && detail.contains("Ledger>()"),
        "the detail names the marker: {detail}"
    );
    assert_eq!(entries(&ledger).await, ["booked", "transferred"]);
    assert_eq!(entries(&audit).await, ["noted", "transfer seen"]);
}
