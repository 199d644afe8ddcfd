//! The `orders` example as a real process, on SQLite and on PostgreSQL.

mod common;

use bytes::Bytes;
use common::process::{Answer, Http, Process};
use http::{Request, StatusCode};
use http_body_util::Full;
use serde_json::{Value, json};

struct Orders {
    process: Process,
    http: Http,
}

impl Orders {
    async fn start(database_url: &str) -> Self {
        let process = Process::start("orders", &[("DATABASE_URL", database_url)]).await;
        Self {
            process,
            http: Http::new(),
        }
    }

    async fn send(
        &self,
        method: &str,
        path: &str,
        token: &str,
        key: Option<&str>,
        body: Option<Value>,
    ) -> Answer {
        let mut request = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.process.url))
            .header("authorization", format!("Bearer {token}"));
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        let body = match body {
            Some(body) => {
                request = request.header("content-type", "application/json");
                Bytes::from(body.to_string())
            }
            None => Bytes::new(),
        };
        self.http
            .call(request.body(Full::new(body)).expect("request"))
            .await
    }
}

impl Orders {
    /// `POST /orders` as the holder of `token`.
    async fn place(&self, token: &str, key: Option<&str>, body: Option<Value>) -> Answer {
        self.send("POST", "/orders", token, key, body).await
    }
}

fn replayed(answer: &Answer) -> bool {
    answer
        .headers
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

fn order(sku: &str, quantity: i64) -> Value {
    json!({ "sku": sku, "quantity": quantity, "amount": 12.5, "currency": "EUR" })
}

fn key(name: &str) -> String {
    common::unique(name)
}

async fn the_contract_holds(orders: Orders) {
    let create = key("create");
    let created = orders
        .place("alice-token", Some(&create), Some(order("widget", 2)))
        .await;
    assert_eq!(created.status, StatusCode::CREATED);
    let id = created.json()["id"].as_i64().expect("id");
    assert_eq!(created.headers["location"], format!("/orders/{id}"));
    assert_eq!(created.json()["status"], "created");

    let shipped = orders
        .send(
            "POST",
            &format!("/orders/{id}/ship"),
            "alice-token",
            Some(&key("ship")),
            None,
        )
        .await;
    assert_eq!(shipped.status, StatusCode::OK);
    assert_eq!(shipped.json()["status"], "shipped");

    let replay = orders
        .place("alice-token", Some(&create), Some(order("widget", 2)))
        .await;
    assert!(replayed(&replay));
    assert_eq!(replay.status, StatusCode::CREATED);
    assert_eq!(
        replay.body, created.body,
        "the creation-time answer, although the order has shipped since"
    );
    assert_eq!(replay.headers["location"], format!("/orders/{id}"));

    let now = orders
        .send("GET", &format!("/orders/{id}"), "alice-token", None, None)
        .await;
    assert_eq!(now.json()["status"], "shipped");
    let foreign = orders
        .send("GET", &format!("/orders/{id}"), "bob-token", None, None)
        .await;
    assert_eq!(foreign.status, StatusCode::NOT_FOUND);

    let reused = orders
        .place("alice-token", Some(&create), Some(order("widget", 3)))
        .await;
    assert_eq!(reused.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(reused.json()["code"], "idempotency_key_reused");

    let invalid = key("invalid");
    let bad = orders
        .place("alice-token", Some(&invalid), Some(order("widget", 0)))
        .await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    assert!(replayed(
        &orders
            .place("alice-token", Some(&invalid), Some(order("widget", 0)))
            .await
    ));
    let unknown = orders
        .place("alice-token", Some(&key("sku")), Some(order("nothing", 1)))
        .await;
    assert_eq!(unknown.status, StatusCode::BAD_REQUEST);

    let stranger = orders
        .place("mallory-token", Some(&key("x")), Some(order("widget", 1)))
        .await;
    assert_eq!(stranger.status, StatusCode::UNAUTHORIZED);

    let article = std::process::id() as i64 * 1000 + (id % 1000);
    let path = format!("/articles/{article}/like");
    let first = orders.send("PUT", &path, "bob-token", None, None).await;
    let second = orders.send("PUT", &path, "bob-token", None, None).await;
    assert_eq!(
        first.json(),
        json!({ "article_id": article, "liked": true, "likes": 1 })
    );
    assert_eq!(
        second.json(),
        first.json(),
        "a repeated like changes nothing"
    );
    let unliked = orders.send("DELETE", &path, "bob-token", None, None).await;
    assert_eq!(
        unliked.json(),
        json!({ "article_id": article, "liked": false, "likes": 0 })
    );
}

async fn out_of_stock_is_final_and_replayed(orders: Orders) {
    let first = orders
        .place("bob-token", Some(&key("g1")), Some(order("gadget", 1)))
        .await;
    assert_eq!(first.status, StatusCode::CREATED, "the one gadget in stock");
    let refused_key = key("g2");
    let refused = orders
        .place("bob-token", Some(&refused_key), Some(order("gadget", 1)))
        .await;
    assert_eq!(refused.status, StatusCode::CONFLICT);
    assert_eq!(refused.json()["code"], "out_of_stock");
    let again = orders
        .place("bob-token", Some(&refused_key), Some(order("gadget", 1)))
        .await;
    assert!(replayed(&again));
    assert_eq!(again.body, refused.body);
}

fn sqlite_url() -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().expect("tempdir");
    let url = format!("sqlite://{}", dir.path().join("orders.db").display());
    (dir, url)
}

#[tokio::test]
async fn orders_example_keeps_the_contract_on_sqlite() {
    let (_dir, url) = sqlite_url();
    the_contract_holds(Orders::start(&url).await).await;
}

#[tokio::test]
async fn orders_example_replays_out_of_stock_on_sqlite() {
    let (_dir, url) = sqlite_url();
    out_of_stock_is_final_and_replayed(Orders::start(&url).await).await;
}

#[cfg(feature = "postgres")]
async fn postgres_url() -> String {
    let base = std::env::var("TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let schema = common::unique("orders");
    let admin = sqlx::PgPool::connect(&base)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {base} is unreachable: {e}"));
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&admin)
        .await
        .expect("schema");
    format!("{base}?options=-c%20search_path%3D{schema}")
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn orders_example_keeps_the_contract_on_postgres() {
    the_contract_holds(Orders::start(&postgres_url().await).await).await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn orders_example_replays_out_of_stock_on_postgres() {
    out_of_stock_is_final_and_replayed(Orders::start(&postgres_url().await).await).await;
}

#[cfg(feature = "mysql")]
async fn mysql_url() -> String {
    use sqlx::Connection;
    let base = std::env::var("TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
    let database = common::unique("orders");
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
    format!("{server}/{database}")
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn orders_example_keeps_the_contract_on_mysql() {
    the_contract_holds(Orders::start(&mysql_url().await).await).await;
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn orders_example_replays_out_of_stock_on_mysql() {
    out_of_stock_is_final_and_replayed(Orders::start(&mysql_url().await).await).await;
}

/// The example's own 4xx are problem+json with codes of its own, never `idempotency_*`, and a
/// body that does not fit an order is a 400, not axum's 422 (the crate's reused-key status).
#[tokio::test]
async fn orders_example_answers_its_own_body_errors_as_problem_json_on_sqlite() {
    let (_dir, url) = sqlite_url();
    let orders = Orders::start(&url).await;
    let cases: [(&str, &str, &str, StatusCode, &str); 3] = [
        (
            "application/json",
            "bad-json",
            "{\"sku\":",
            StatusCode::BAD_REQUEST,
            "malformed_json",
        ),
        (
            "application/json",
            "bad-fields",
            "{\"sku\":\"widget\",\"quantity\":\"two\",\"amount\":1,\"currency\":\"EUR\"}",
            StatusCode::BAD_REQUEST,
            "invalid_order",
        ),
        (
            "text/plain",
            "bad-type",
            "{}",
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
        ),
    ];
    for (content_type, name, body, status, code) in cases {
        let request = Request::post(format!("{}/orders", orders.process.url))
            .header("authorization", "Bearer alice-token")
            .header("idempotency-key", key(name))
            .header("content-type", content_type)
            .body(Full::new(Bytes::from(body)))
            .expect("request");
        let answer = orders.http.call(request).await;
        assert_eq!(answer.status, status, "{body}");
        assert_eq!(answer.headers["content-type"], "application/problem+json");
        assert_eq!(answer.json()["code"], code);
    }
}
