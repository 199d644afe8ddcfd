//! Every backend's conformance run: a fresh isolated database, a test app served on a loopback
//! port, and an HTTP client.

use super::names::unique;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{post, put};
use axum::{Json, Router};
use axum_idempotency::{IdempotencyLayer, Principal, Store, Tx};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use sqlx::{ColumnIndex, Database, Decode, Encode, Executor, IntoArguments, Pool, Row, Type};

/// What each backend provides to the suite.
pub(crate) trait Backend: Database + axum_idempotency::Backend {
    const EFFECTS_DDL: &'static str;
    const INSERT_EFFECT: &'static str;
    const COUNT_EFFECTS: &'static str;
    /// A store on `pool`.
    fn store(pool: Pool<Self>) -> Store<Self> {
        Store::new(pool)
    }
    /// A pool on a database (or schema, or file) of its own, with no tables yet.
    fn fresh(max_connections: u32) -> impl Future<Output = Isolated<Self>> + Send;
    /// A second pool on the same isolated database: a second app instance.
    fn another_pool(
        isolated: &Isolated<Self>,
        max_connections: u32,
    ) -> impl Future<Output = Pool<Self>> + Send;
    /// Removes the isolated database (schema, database or file) once its pools are closed, so
    /// a run leaves nothing behind on the shared servers.
    fn dispose(isolated: Isolated<Self>) -> impl Future<Output = ()> + Send;
}

/// An isolated database and how to reach it again.
pub(crate) struct Isolated<DB: Database> {
    pub(crate) pool: Pool<DB>,
    pub(crate) url: String,
}

pub(crate) trait Db: Backend {
    fn insert_effect<'a>(
        conn: &'a mut Self::Connection,
        label: &'a str,
    ) -> impl Future<Output = sqlx::Result<i64>> + Send + 'a;
    fn count_effects<'a>(
        pool: &'a Pool<Self>,
        label: &'a str,
    ) -> impl Future<Output = i64> + Send + 'a;
    fn count_records(pool: &Pool<Self>) -> impl Future<Output = i64> + Send + '_;
    /// Deletes every record behind the layer's back, as an operator might by hand.
    fn delete_records(pool: &Pool<Self>) -> impl Future<Output = ()> + Send + '_;
    fn create_effects_table(pool: &Pool<Self>) -> impl Future<Output = ()> + Send + '_;
}

impl<DB> Db for DB
where
    DB: Backend,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'c> &'c Pool<DB>: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    usize: ColumnIndex<DB::Row>,
    i64: for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB> + Type<DB>,
    String: for<'q> Encode<'q, DB> + Type<DB>,
{
    async fn insert_effect<'a>(
        conn: &'a mut Self::Connection,
        label: &'a str,
    ) -> sqlx::Result<i64> {
        sqlx::query(DB::INSERT_EFFECT)
            .bind(label.to_owned())
            .fetch_one(conn)
            .await?
            .try_get(0)
    }

    async fn count_effects<'a>(pool: &'a Pool<Self>, label: &'a str) -> i64 {
        sqlx::query(DB::COUNT_EFFECTS)
            .bind(label.to_owned())
            .fetch_one(pool)
            .await
            .and_then(|row| row.try_get(0))
            .expect("count effects")
    }

    async fn create_effects_table(pool: &Pool<Self>) {
        // Two instances on one database both try; the loser finds the table there.
        let _ = sqlx::raw_sql(DB::EFFECTS_DDL).execute(pool).await;
    }

    async fn count_records(pool: &Pool<Self>) -> i64 {
        sqlx::query("SELECT COUNT(*) FROM idempotency_records")
            .fetch_one(pool)
            .await
            .and_then(|row| row.try_get(0))
            .expect("count records")
    }

    async fn delete_records(pool: &Pool<Self>) {
        sqlx::query("DELETE FROM idempotency_records")
            .execute(pool)
            .await
            .expect("delete records");
    }
}

#[cfg(feature = "sqlite")]
impl Backend for sqlx::Sqlite {
    const EFFECTS_DDL: &'static str =
        "CREATE TABLE effects (id INTEGER PRIMARY KEY AUTOINCREMENT, label TEXT NOT NULL)";
    const INSERT_EFFECT: &'static str = "INSERT INTO effects (label) VALUES (?1) RETURNING id";
    const COUNT_EFFECTS: &'static str = "SELECT COUNT(*) FROM effects WHERE label = ?1";

    async fn fresh(max_connections: u32) -> Isolated<Self> {
        let path = std::env::temp_dir().join(format!("{}.db", unique("axum_idempotency")));
        let url = format!("sqlite://{}", path.display());
        let pool = sqlite_pool(&url, max_connections, true).await;
        Isolated { pool, url }
    }

    async fn another_pool(isolated: &Isolated<Self>, max_connections: u32) -> Pool<Self> {
        sqlite_pool(&isolated.url, max_connections, false).await
    }

    async fn dispose(isolated: Isolated<Self>) {
        isolated.pool.close().await;
        let path = isolated.url.trim_start_matches("sqlite://");
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{path}{suffix}"));
        }
    }
}

#[cfg(feature = "sqlite")]
async fn sqlite_pool(url: &str, max: u32, create: bool) -> sqlx::SqlitePool {
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode};
    let options = url
        .parse::<SqliteConnectOptions>()
        .expect("sqlite url")
        .create_if_missing(create)
        .journal_mode(SqliteJournalMode::Wal);
    sqlx::pool::PoolOptions::new()
        .max_connections(max)
        .connect_with(options)
        .await
        .expect("open sqlite")
}

#[cfg(feature = "postgres")]
pub(crate) fn postgres_url() -> String {
    std::env::var("TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

#[cfg(feature = "postgres")]
impl Backend for sqlx::Postgres {
    const EFFECTS_DDL: &'static str =
        "CREATE TABLE effects (id BIGSERIAL PRIMARY KEY, label TEXT NOT NULL)";
    const INSERT_EFFECT: &'static str = "INSERT INTO effects (label) VALUES ($1) RETURNING id";
    const COUNT_EFFECTS: &'static str = "SELECT COUNT(*) FROM effects WHERE label = $1";

    async fn fresh(max_connections: u32) -> Isolated<Self> {
        let schema = unique("t");
        let admin = sqlx::PgPool::connect(&postgres_url())
            .await
            .unwrap_or_else(|e| panic!("PostgreSQL at {} is unreachable: {e}", postgres_url()));
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
            .execute(&admin)
            .await
            .expect("create schema");
        admin.close().await;
        Isolated {
            pool: pg_pool(&schema, max_connections).await,
            url: schema,
        }
    }

    async fn another_pool(isolated: &Isolated<Self>, max_connections: u32) -> Pool<Self> {
        pg_pool(&isolated.url, max_connections).await
    }

    async fn dispose(isolated: Isolated<Self>) {
        isolated.pool.close().await;
        let admin = sqlx::PgPool::connect(&postgres_url())
            .await
            .expect("connect postgres");
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA {} CASCADE",
            isolated.url
        )))
        .execute(&admin)
        .await
        .expect("drop schema");
        admin.close().await;
    }
}

#[cfg(feature = "postgres")]
async fn pg_pool(schema: &str, max: u32) -> sqlx::PgPool {
    use sqlx::postgres::PgConnectOptions;
    let options = postgres_url()
        .parse::<PgConnectOptions>()
        .expect("postgres url")
        .options([("search_path", schema)])
        // Lets a test find this schema's sessions in pg_stat_activity.
        .application_name(schema);
    sqlx::pool::PoolOptions::new()
        .max_connections(max)
        .connect_with(options)
        .await
        .expect("connect postgres")
}

#[cfg(feature = "mysql")]
pub(crate) fn mysql_url() -> String {
    std::env::var("TEST_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

#[cfg(feature = "mysql")]
impl Backend for sqlx::MySql {
    const EFFECTS_DDL: &'static str = "CREATE TABLE effects \
        (id BIGINT AUTO_INCREMENT PRIMARY KEY, label TEXT NOT NULL) ENGINE = InnoDB";
    // RETURNING on INSERT is MariaDB's (10.5+); MySQL 8 would need LAST_INSERT_ID() instead.
    const INSERT_EFFECT: &'static str = "INSERT INTO effects (label) VALUES (?) RETURNING id";
    const COUNT_EFFECTS: &'static str = "SELECT COUNT(*) FROM effects WHERE label = ?";

    async fn fresh(max_connections: u32) -> Isolated<Self> {
        use sqlx::Connection;
        let database = unique("idem");
        let mut admin = sqlx::MySqlConnection::connect(&mysql_url())
            .await
            .unwrap_or_else(|e| panic!("MariaDB/MySQL at {} is unreachable: {e}", mysql_url()));
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}")))
            .execute(&mut admin)
            .await
            .expect("create database");
        let _ = admin.close().await;
        Isolated {
            pool: mysql_pool(&database, max_connections).await,
            url: database,
        }
    }

    async fn another_pool(isolated: &Isolated<Self>, max_connections: u32) -> Pool<Self> {
        mysql_pool(&isolated.url, max_connections).await
    }

    async fn dispose(isolated: Isolated<Self>) {
        use sqlx::Connection;
        isolated.pool.close().await;
        let mut admin = sqlx::MySqlConnection::connect(&mysql_url())
            .await
            .expect("connect mysql");
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE {}",
            isolated.url
        )))
        .execute(&mut admin)
        .await
        .expect("drop database");
        let _ = admin.close().await;
    }
}

#[cfg(feature = "mysql")]
async fn mysql_pool(database: &str, max: u32) -> sqlx::MySqlPool {
    use sqlx::mysql::MySqlConnectOptions;
    let options = mysql_url()
        .parse::<MySqlConnectOptions>()
        .expect("mysql url")
        .database(database);
    sqlx::pool::PoolOptions::new()
        .max_connections(max)
        .connect_with(options)
        .await
        .expect("connect mysql")
}

/// The verified caller, set by the test's auth middleware from `Authorization: Bearer <name>`.
#[derive(Clone)]
pub(crate) struct User(pub(crate) String);

impl Principal for User {
    fn principal_id(&self) -> std::borrow::Cow<'_, str> {
        self.0.as_str().into()
    }
}

async fn authenticate(mut request: Request, next: Next) -> Response {
    let user = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|name| User(name.to_owned()));
    if let Some(user) = user {
        request.extensions_mut().insert(user);
    }
    next.run(request).await
}

#[derive(Clone)]
pub(crate) struct AppState {
    pub(crate) executions: Arc<AtomicUsize>,
}

/// Counts an execution and writes its effect row through the request's transaction.
async fn execute<DB: Db>(state: &AppState, tx: &mut Tx<DB>, body: &Value) -> (i64, String) {
    state.executions.fetch_add(1, Ordering::SeqCst);
    let label = body["label"].as_str().unwrap_or("none").to_owned();
    let id = DB::insert_effect(tx, &label).await.expect("insert effect");
    (id, label)
}

/// Creates an effect row per execution and answers with headers a replay must reproduce.
async fn create_effect<DB: Db>(
    State(state): State<AppState>,
    mut tx: Tx<DB>,
    Json(body): Json<Value>,
) -> Response {
    let (id, label) = execute(&state, &mut tx, &body).await;
    if let Some(ms) = body["sleep_ms"].as_u64() {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let mut headers = HeaderMap::new();
    headers.insert(
        header::LOCATION,
        HeaderValue::from_str(&format!("/effects/{id}")).expect("location"),
    );
    headers.append(
        header::SET_COOKIE,
        HeaderValue::from_static("session=first-exchange-only"),
    );
    headers.append(header::LINK, HeaderValue::from_static("</a>; rel=\"a\""));
    headers.append(header::LINK, HeaderValue::from_static("</b>; rel=\"b\""));
    (
        StatusCode::CREATED,
        headers,
        Json(json!({ "id": id, "label": label, "status": "created" })),
    )
        .into_response()
}

/// Writes, then answers with the status in the path.
async fn fail_with<DB: Db>(
    State(state): State<AppState>,
    mut tx: Tx<DB>,
    Path(status): Path<u16>,
    Json(body): Json<Value>,
) -> Response {
    execute(&state, &mut tx, &body).await;
    let status = StatusCode::from_u16(status).expect("status");
    (
        status,
        Json(json!({ "code": "refused", "status": status.as_u16() })),
    )
        .into_response()
}

async fn panic_after_write<DB: Db>(
    State(state): State<AppState>,
    mut tx: Tx<DB>,
    Json(body): Json<Value>,
) -> Response {
    let (_, label) = execute(&state, &mut tx, &body).await;
    // Panics on a label's first execution only, as a crash would, so its retry can succeed.
    static CRASHED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let first = {
        let mut crashed = CRASHED
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let first = !crashed.contains(&label);
        crashed.push(label);
        first
    };
    if first {
        panic!("handler panicked after writing");
    }
    (StatusCode::CREATED, "ran to the end this time").into_response()
}

async fn hold_tx<DB: Db>(
    State(state): State<AppState>,
    mut tx: Tx<DB>,
    Json(body): Json<Value>,
) -> Response {
    execute(&state, &mut tx, &body).await;
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(500)).await;
        drop(tx);
    });
    (StatusCode::CREATED, "leaked the transaction").into_response()
}

async fn big_response<DB: Db>(
    State(state): State<AppState>,
    mut tx: Tx<DB>,
    Json(body): Json<Value>,
) -> Response {
    execute(&state, &mut tx, &body).await;
    (StatusCode::CREATED, vec![b'x'; 2 * 1024 * 1024]).into_response()
}

/// A served test app.
pub(crate) struct App<DB: Db> {
    pub(crate) addr: SocketAddr,
    pub(crate) executions: Arc<AtomicUsize>,
    pub(crate) pool: Pool<DB>,
    pub(crate) layer: IdempotencyLayer<DB>,
    client: Client<HttpConnector, Full<Bytes>>,
    server: tokio::task::JoinHandle<()>,
    /// The database the app was served on when it made its own (see [`serve_fresh`]).
    isolated: Option<Isolated<DB>>,
}

impl<DB: Db> Drop for App<DB> {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl<DB: Db> App<DB> {
    /// Stops serving, closes the app's pool and removes the database the app made for
    /// itself, if it did. A test that panics never gets here and so keeps its database for a
    /// post-mortem.
    pub(crate) async fn dispose(mut self) {
        self.server.abort();
        self.pool.close().await;
        if let Some(isolated) = self.isolated.take() {
            DB::dispose(isolated).await;
        }
    }
}

/// Serves the test routes on a database of their own; [`App::dispose`] removes it.
pub(crate) async fn serve_fresh<DB: Db>(
    max_connections: u32,
    configure: impl FnOnce(IdempotencyLayer<DB>) -> IdempotencyLayer<DB>,
) -> App<DB> {
    let isolated = DB::fresh(max_connections).await;
    let mut app = serve(isolated.pool.clone(), configure).await;
    app.isolated = Some(isolated);
    app
}

/// Migrates, creates the effects table unless it exists, and serves the test routes.
pub(crate) async fn serve<DB: Db>(
    pool: Pool<DB>,
    configure: impl FnOnce(IdempotencyLayer<DB>) -> IdempotencyLayer<DB>,
) -> App<DB> {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let store = DB::store(pool.clone());
    store.migrate().await.expect("migrate");
    DB::create_effects_table(&pool).await;
    let layer = configure(IdempotencyLayer::new(store).principal_extension::<User>());
    let executions = Arc::new(AtomicUsize::new(0));
    let state = AppState {
        executions: executions.clone(),
    };
    let router = Router::new()
        .route("/effects", post(create_effect::<DB>))
        .route("/effects/{id}/touch", post(create_effect::<DB>))
        .route("/other", post(create_effect::<DB>))
        .route("/fail/{status}", post(fail_with::<DB>))
        .route("/panic", post(panic_after_write::<DB>))
        .route("/hold", post(hold_tx::<DB>))
        .route("/big", post(big_response::<DB>))
        .route("/unkeyed", put(create_effect::<DB>))
        .route("/unkeyed/fail/{status}", put(fail_with::<DB>))
        .route_layer(layer.clone())
        .layer(middleware::from_fn(authenticate))
        .with_state(state);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = tokio::spawn(async move {
        axum::serve(listener, router).await.expect("serve");
    });
    let client = Client::builder(TokioExecutor::new()).build_http();
    App {
        addr,
        executions,
        pool,
        layer,
        client,
        server,
        isolated: None,
    }
}

/// A response as the client saw it.
#[derive(Debug, Clone)]
pub(crate) struct Reply {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
}

impl Reply {
    /// Sends `request` and reads the whole answer.
    pub(crate) async fn receive(
        client: &Client<HttpConnector, Full<Bytes>>,
        request: hyper::Request<Full<Bytes>>,
    ) -> Self {
        let response = client.request(request).await.expect("send request");
        let (parts, body) = response.into_parts();
        let body = body.collect().await.expect("read body").to_bytes();
        Self {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    }

    pub(crate) fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    pub(crate) fn code(&self) -> String {
        self.json()["code"].as_str().unwrap_or_default().to_owned()
    }

    pub(crate) fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }
}

impl<DB: Db> App<DB> {
    pub(crate) fn executions(&self) -> usize {
        self.executions.load(Ordering::SeqCst)
    }

    /// `POST path` as `user` with `key`, a JSON body.
    pub(crate) async fn post(
        &self,
        path: &str,
        user: Option<&str>,
        key: Option<&str>,
        body: &str,
    ) -> Reply {
        let mut headers = vec![("content-type", "application/json".to_owned())];
        if let Some(user) = user {
            headers.push(("authorization", format!("Bearer {user}")));
        }
        if let Some(key) = key {
            headers.push(("idempotency-key", key.to_owned()));
        }
        self.send("POST", path, &headers, body.as_bytes().to_vec())
            .await
    }

    pub(crate) async fn send(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, String)],
        body: Vec<u8>,
    ) -> Reply {
        let mut request = hyper::Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", self.addr));
        for (name, value) in headers {
            request = request.header(*name, value);
        }
        let request = request.body(Full::new(Bytes::from(body))).expect("request");
        Reply::receive(&self.client, request).await
    }
}

/// A second instance of the app on its own pool over the same database.
pub(crate) async fn second_instance<DB: Db>(isolated: &Isolated<DB>) -> App<DB> {
    serve(DB::another_pool(isolated, 8).await, |layer| layer).await
}

pub(crate) fn body(label: &str) -> String {
    json!({ "label": label }).to_string()
}
