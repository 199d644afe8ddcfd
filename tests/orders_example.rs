//! The `orders` example as a real process, on SQLite, PostgreSQL and MariaDB.

mod common;

use bytes::Bytes;
use common::example_db::{Db, ExampleDatabase as Database};
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

    /// `POST /orders` with `body` sent as written, for numbers `serde_json` would respell.
    async fn raw(&self, token: &str, key: &str, body: &str) -> Answer {
        let request = Request::post(format!("{}/orders", self.process.url))
            .header("authorization", format!("Bearer {token}"))
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_owned())))
            .expect("request");
        self.http.call(request).await
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

/// Runs `scenario` on the example started on a database of its own, then drops the database.
async fn run_on<F, Fut>(db: Db, scenario: F)
where
    F: FnOnce(Orders) -> Fut,
    Fut: Future<Output = ()>,
{
    let database = Database::new(db).await;
    scenario(Orders::start(&database.url).await).await;
    database.cleanup().await;
}

/// What a column cannot hold (a NUL, which PostgreSQL refuses; a currency longer than MariaDB's
/// column), a control character anywhere in the currency or the sku, and skus that only look
/// like a product are final 400s on every backend, decided before any SQL, never a 500 the
/// client would retry forever nor a control character stored and echoed back.
async fn unstorable_input_and_lookalike_skus_are_final_400s(orders: Orders) {
    let long = "E".repeat(100_000);
    let cases = [
        ("widget", "EUR\u{0}"),
        ("widget", "EU\nR"),
        ("widget", "\tEUR"),
        ("widget", "EUR\u{1b}"),
        ("widget", "EUR\u{7f}"),
        ("widget", "EUR\u{85}"),
        ("widget", long.as_str()),
        ("widget", "EURO-DOLLAR"),
        ("widget", ""),
        (long.as_str(), "EUR"),
        ("wid\u{0}get", "EUR"),
        ("widget\n", "EUR"),
        ("wid\rget", "EUR"),
        ("\u{1b}widget", "EUR"),
        ("widget\u{9f}", "EUR"),
        ("WIDGET", "EUR"),
        ("Widget", "EUR"),
        ("widget ", "EUR"),
        (" widget", "EUR"),
    ];
    for (sku, currency) in cases {
        let body = json!({ "sku": sku, "quantity": 1, "amount": 12.5, "currency": currency });
        let key = key("unstorable");
        let refused = orders
            .place("alice-token", Some(&key), Some(body.clone()))
            .await;
        let what = format!("sku {:.20?} currency {:.20?}", sku, currency);
        assert_eq!(refused.status, StatusCode::BAD_REQUEST, "{what}");
        assert_eq!(refused.json()["code"], "invalid_order", "{what}");
        let again = orders.place("alice-token", Some(&key), Some(body)).await;
        assert!(replayed(&again), "final, so replayed: {what}");
    }
    for sku in ["WIDGET", "Widget", "widget "] {
        let answer = orders
            .place("alice-token", Some(&key("sku")), Some(order(sku, 1)))
            .await;
        assert_eq!(answer.json()["detail"], "unknown sku", "{sku:?}");
    }
    // Tokens match exactly too: MariaDB's default collation would take this one for alice's.
    let shouting = orders
        .place("ALICE-TOKEN", Some(&key("token")), Some(order("widget", 1)))
        .await;
    assert_eq!(shouting.status, StatusCode::UNAUTHORIZED);
    assert_eq!(
        orders
            .send("GET", "/orders", "alice-token", None, None)
            .await
            .json(),
        json!([]),
        "nothing was written"
    );
}

/// Amounts are kept in cents: each echoes as the number it was sent as (`10` as `10.0`, as
/// the example always answered), and one finer than a cent or too large is a final 400.
async fn amounts_are_exact_cents(orders: Orders) {
    let echoes = [
        ("0.1", "0.1"),
        ("0.2", "0.2"),
        ("0.3", "0.3"),
        ("10", "10.0"),
        ("12.50", "12.5"),
        ("1e2", "100.0"),
        ("1.25E1", "12.5"),
        ("1250e-2", "12.5"),
        ("0.07", "0.07"),
        ("1234567890.99", "1234567890.99"),
        ("9999999999999.99", "9999999999999.99"),
    ];
    for (sent, echoed) in echoes {
        let body = format!(r#"{{"sku":"widget","quantity":1,"amount":{sent},"currency":"EUR"}}"#);
        let answer = orders.raw("alice-token", &key("amount"), &body).await;
        assert_eq!(answer.status, StatusCode::CREATED, "{sent}");
        let text = String::from_utf8_lossy(&answer.body).into_owned();
        assert!(
            text.contains(&format!(r#""amount":{echoed},"#)),
            "{sent} echoed as {text}"
        );
        let id = answer.json()["id"].as_i64().expect("id");
        let stored = orders
            .send("GET", &format!("/orders/{id}"), "alice-token", None, None)
            .await;
        assert!(
            String::from_utf8_lossy(&stored.body).contains(&format!(r#""amount":{echoed},"#)),
            "{sent} read back"
        );
    }
    for sent in [
        "0.001",
        "12.345",
        "0.30000000000000004",
        // Read as a float it would be 0.1: amounts are read digit for digit.
        "0.1000000000000000001",
        "10000000000000",
        "1e20",
        "0",
        "-5",
    ] {
        let body = format!(r#"{{"sku":"widget","quantity":1,"amount":{sent},"currency":"EUR"}}"#);
        let answer = orders.raw("alice-token", &key("amount"), &body).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{sent}");
        assert_eq!(answer.json()["code"], "invalid_order", "{sent}");
    }
}

#[tokio::test]
async fn orders_example_keeps_the_contract_on_sqlite() {
    run_on(Db::Sqlite, the_contract_holds).await;
}

#[tokio::test]
async fn orders_example_replays_out_of_stock_on_sqlite() {
    run_on(Db::Sqlite, out_of_stock_is_final_and_replayed).await;
}

#[tokio::test]
async fn orders_example_refuses_unstorable_input_and_lookalike_skus_on_sqlite() {
    run_on(
        Db::Sqlite,
        unstorable_input_and_lookalike_skus_are_final_400s,
    )
    .await;
}

#[tokio::test]
async fn orders_example_keeps_amounts_in_exact_cents_on_sqlite() {
    run_on(Db::Sqlite, amounts_are_exact_cents).await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn orders_example_keeps_the_contract_on_postgres() {
    run_on(Db::Postgres, the_contract_holds).await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn orders_example_replays_out_of_stock_on_postgres() {
    run_on(Db::Postgres, out_of_stock_is_final_and_replayed).await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn orders_example_refuses_unstorable_input_and_lookalike_skus_on_postgres() {
    run_on(
        Db::Postgres,
        unstorable_input_and_lookalike_skus_are_final_400s,
    )
    .await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn orders_example_keeps_amounts_in_exact_cents_on_postgres() {
    run_on(Db::Postgres, amounts_are_exact_cents).await;
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn orders_example_keeps_the_contract_on_mysql() {
    run_on(Db::Mariadb, the_contract_holds).await;
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn orders_example_replays_out_of_stock_on_mysql() {
    run_on(Db::Mariadb, out_of_stock_is_final_and_replayed).await;
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn orders_example_refuses_unstorable_input_and_lookalike_skus_on_mysql() {
    run_on(
        Db::Mariadb,
        unstorable_input_and_lookalike_skus_are_final_400s,
    )
    .await;
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn orders_example_keeps_amounts_in_exact_cents_on_mysql() {
    run_on(Db::Mariadb, amounts_are_exact_cents).await;
}

/// The example's own 4xx are problem+json with codes of its own, never `idempotency_*`, and a
/// body that does not fit an order is a 400, not axum's 422 (the crate's reused-key status); so
/// is a path id that is not a number.
#[tokio::test]
async fn orders_example_answers_its_own_body_errors_as_problem_json_on_sqlite() {
    let database = Database::new(Db::Sqlite).await;
    let orders = Orders::start(&database.url).await;
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
        assert_eq!(answer.json()["title"], status.canonical_reason().unwrap());
    }
    let not_an_id = orders
        .send("GET", "/orders/abc", "alice-token", None, None)
        .await;
    assert_eq!(not_an_id.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        not_an_id.headers["content-type"],
        "application/problem+json"
    );
    assert_eq!(not_an_id.json()["code"], "invalid_id");
}

/// A client that never finishes its request head loses its connection after the read timeout
/// (5 s), rather than holding it for ever; the server goes on answering others.
#[tokio::test]
async fn orders_example_drops_a_connection_whose_request_head_never_ends() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let database = Database::new(Db::Sqlite).await;
    let orders = Orders::start(&database.url).await;
    let address = orders.process.url.trim_start_matches("http://");
    let mut slow = tokio::net::TcpStream::connect(address)
        .await
        .expect("connect");
    slow.write_all(b"GET /orders HTTP/1.1\r\nhost: example\r\n")
        .await
        .expect("a partial head");
    let started = std::time::Instant::now();
    let mut rest = Vec::new();
    tokio::time::timeout(
        std::time::Duration::from_secs(15),
        slow.read_to_end(&mut rest),
    )
    .await
    .expect("the server closes the connection within 15 s")
    .ok();
    assert!(started.elapsed() >= std::time::Duration::from_secs(4));
    let listed = orders
        .send("GET", "/orders", "alice-token", None, None)
        .await;
    assert_eq!(listed.status, StatusCode::OK);
}
