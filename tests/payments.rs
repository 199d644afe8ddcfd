//! The payments example against the provider simulator, as real processes on loopback.
//!
//! Build the binaries first: `cargo build --examples --features outbox,postgres`.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::process::{Answer, Http, Process};
use http::{Request, StatusCode};
use http_body_util::Full;
use serde_json::{Value, json};

impl Http {
    async fn pay(&self, payments: &str, key: &str, payment: &Value) -> Answer {
        let request = Request::post(format!("{payments}/payments"))
            .header("authorization", "Bearer alice-token")
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(payment.to_string())))
            .unwrap();
        self.call(request).await
    }

    async fn payment(&self, payments: &str, id: i64) -> Value {
        let request = Request::get(format!("{payments}/payments/{id}"))
            .header("authorization", "Bearer alice-token")
            .body(Full::new(Bytes::new()))
            .unwrap();
        let answer = self.call(request).await;
        assert_eq!(answer.status, StatusCode::OK);
        answer.json()
    }

    async fn charges(&self, provider: &str) -> Value {
        let request = Request::get(format!("{provider}/admin/charges"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        self.call(request).await.json()
    }

    /// Waits until the payment is no longer pending and returns it.
    async fn settled(&self, payments: &str, id: i64) -> Value {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
        loop {
            let payment = self.payment(payments, id).await;
            if payment["status"] != "pending" {
                return payment;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "payment {id} still pending"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

fn payment(order: usize) -> Value {
    json!({ "order_id": order.to_string(), "amount": 12.5, "currency": "EUR", "payee": "acme" })
}

fn id_of(answer: &Answer) -> i64 {
    answer.json()["id"].as_i64().unwrap()
}

struct Scenario {
    dir: tempfile::TempDir,
    http: Http,
}

impl Scenario {
    fn new() -> Self {
        Self {
            dir: tempfile::tempdir().unwrap(),
            http: Http::new(),
        }
    }

    fn path(&self, file: &str) -> String {
        self.dir.path().join(file).to_string_lossy().into_owned()
    }

    async fn provider(&self, env: &[(&str, &str)]) -> Process {
        let database = self.path("provider.db");
        let mut env = env.to_vec();
        env.push(("PROVIDER_DATABASE", &database));
        Process::start("payment_provider", &env).await
    }

    /// Starts payments on this scenario's SQLite file; `env` overrides the defaults.
    async fn payments(&self, provider: &Process, env: &[(&str, &str)]) -> Process {
        let database = format!("sqlite:{}", self.path("payments.db"));
        self.payments_on(&database, provider, env).await
    }

    async fn payments_on(
        &self,
        database: &str,
        provider: &Process,
        env: &[(&str, &str)],
    ) -> Process {
        let mut all = vec![
            ("DATABASE_URL", database),
            ("PROVIDER_URL", provider.url.as_str()),
            ("OUTBOX_POLL_MS", "100"),
            ("OUTBOX_BACKOFF_MS", "50"),
        ];
        all.extend_from_slice(env);
        Process::start("payments", &all).await
    }
}

#[tokio::test]
async fn killed_after_commit_and_before_dispatch_charges_once_after_restart() {
    let scenario = Scenario::new();
    let http = &scenario.http;
    let provider = scenario.provider(&[]).await;
    let accepting = scenario.payments(&provider, &[("DISPATCHERS", "0")]).await;

    let first = http.pay(&accepting.url, "restart-key-1", &payment(1)).await;
    assert_eq!(first.status, StatusCode::ACCEPTED);
    assert_eq!(first.json()["status"], "pending");
    let id = id_of(&first);
    assert_eq!(first.headers["location"], format!("/payments/{id}"));
    accepting.kill().await;
    assert_eq!(http.charges(&provider.url).await["count"], 0);

    let restarted = scenario.payments(&provider, &[]).await;
    let settled = http.settled(&restarted.url, id).await;
    assert_eq!(settled["status"], "succeeded");
    // The amount comes back as the number it was sent as, not as text.
    assert_eq!(settled["amount"], json!(12.5));
    let missing = Request::get(format!("{}/payments/{}", restarted.url, id + 1000))
        .header("authorization", "Bearer alice-token")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let missing = http.call(missing).await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    assert_eq!(missing.headers["content-type"], "application/problem+json");
    assert_eq!(missing.json()["type"], "about:blank");
    assert_eq!(missing.json()["code"], "not_found");

    let charges = http.charges(&provider.url).await;
    assert_eq!(charges["count"], 1);
    assert_eq!(settled["charge_id"], charges["charges"][0]["id"]);

    let retry = http.pay(&restarted.url, "restart-key-1", &payment(1)).await;
    assert_eq!(retry.status, StatusCode::ACCEPTED);
    assert_eq!(retry.body, first.body);
    assert_eq!(retry.headers["idempotent-replayed"], "true");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(http.charges(&provider.url).await["count"], 1);
}

/// The example has no wake-up code of its own: the commit of the request that enqueued the
/// charge wakes its dispatcher, which polls only every 30 s, and the charge is made at once.
#[tokio::test]
async fn a_payment_is_charged_at_once_though_the_dispatcher_polls_every_30_s() {
    let scenario = Scenario::new();
    let http = &scenario.http;
    let provider = scenario.provider(&[]).await;
    let payments = scenario
        .payments(&provider, &[("OUTBOX_POLL_MS", "30000")])
        .await;
    // Its first claim found nothing: from now on it sleeps 30 s unless woken.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let accepted = http.pay(&payments.url, "wake-key-1", &payment(1)).await;
    assert_eq!(accepted.status, StatusCode::ACCEPTED);
    let committed = tokio::time::Instant::now();
    while http.charges(&provider.url).await["count"] != 1 {
        assert!(
            committed.elapsed() < Duration::from_secs(2),
            "not charged within 2 s of the answer"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn dropped_answer_is_resent_with_the_same_key_and_charged_once() {
    let scenario = Scenario::new();
    let http = &scenario.http;
    // Every new charge is made, then its connection dropped; a resend finds it by key.
    let provider = scenario.provider(&[("FAULT_DROP_RATE", "1")]).await;
    let payments = scenario
        .payments(&provider, &[("PROVIDER_LOOKUP", "off")])
        .await;

    let accepted = http.pay(&payments.url, "drop-key-1", &payment(1)).await;
    assert_eq!(accepted.status, StatusCode::ACCEPTED);
    let settled = http.settled(&payments.url, id_of(&accepted)).await;
    assert_eq!(settled["status"], "succeeded");

    let charges = http.charges(&provider.url).await;
    assert_eq!(charges["count"], 1);
    assert!(charges["posts"].as_u64().unwrap() >= 2, "{charges}");
    assert_eq!(settled["charge_id"], charges["charges"][0]["id"]);
}

#[tokio::test]
async fn provider_without_idempotency_is_looked_up_before_any_resend() {
    let scenario = Scenario::new();
    let http = &scenario.http;
    let provider = scenario
        .provider(&[("PROVIDER_IDEMPOTENCY", "off"), ("FAULT_DROP_RATE", "1")])
        .await;
    let payments = scenario
        .payments(&provider, &[("OUTBOX_LOOKUP_GRACE_MS", "300")])
        .await;

    let accepted = http.pay(&payments.url, "lookup-key-1", &payment(1)).await;
    let settled = http.settled(&payments.url, id_of(&accepted)).await;
    assert_eq!(settled["status"], "succeeded");

    let charges = http.charges(&provider.url).await;
    assert_eq!(charges["count"], 1);
    assert_eq!(charges["posts"], 1, "found by lookup, never resent");
    assert_eq!(settled["charge_id"], charges["charges"][0]["id"]);
}

#[tokio::test]
async fn hundred_payments_under_random_faults_with_two_dispatchers_charge_exactly_once() {
    let scenario = Scenario::new();
    let http = &scenario.http;
    let provider = scenario
        .provider(&[
            ("FAULT_503_RATE", "0.2"),
            ("FAULT_DROP_RATE", "0.2"),
            ("FAULT_LATENCY_MS", "1500"),
            ("FAULT_LATENCY_RATE", "0.15"),
            ("FAULT_RETRY_AFTER", "1"),
        ])
        .await;
    // Two processes on one database: two dispatchers competing for the same outbox rows.
    let tuning = [
        ("OUTBOX_SEND_TIMEOUT_MS", "1000"),
        ("OUTBOX_LOOKUP_GRACE_MS", "2000"),
        ("OUTBOX_MAX_ATTEMPTS", "50"),
    ];
    let first = scenario.payments(&provider, &tuning).await;
    let second = scenario.payments(&provider, &tuning).await;
    let servers = [first.url.as_str(), second.url.as_str()];

    let total = 100;
    let mut accepted = Vec::new();
    for chunk in (0..total).collect::<Vec<_>>().chunks(10) {
        let answers = futures_util::future::join_all(chunk.iter().map(|&n| async move {
            let key = format!("storm-key-{n}");
            let answer = http.pay(servers[n % 2], &key, &payment(n)).await;
            assert_eq!(answer.status, StatusCode::ACCEPTED);
            // The client's retry, on the other instance, gets the same answer.
            let retry = http.pay(servers[(n + 1) % 2], &key, &payment(n)).await;
            assert_eq!(retry.status, StatusCode::ACCEPTED);
            assert_eq!(retry.body, answer.body);
            id_of(&answer)
        }))
        .await;
        accepted.extend(answers);
    }

    let mut charge_ids = Vec::new();
    for &id in &accepted {
        let settled = http.settled(servers[0], id).await;
        assert_eq!(settled["status"], "succeeded", "{settled}");
        charge_ids.push(settled["charge_id"].as_str().unwrap().to_owned());
    }
    let charges = http.charges(&provider.url).await;
    assert_eq!(charges["count"], total, "{charges}");
    assert!(
        charges["posts"].as_u64().unwrap() > total as u64,
        "the faults forced resends"
    );
    let mut provider_ids: Vec<String> = charges["charges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|charge| charge["id"].as_str().unwrap().to_owned())
        .collect();
    provider_ids.sort();
    charge_ids.sort();
    assert_eq!(provider_ids, charge_ids);
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn on_postgres_killed_before_dispatch_charges_once_after_restart() {
    use sqlx::Connection;

    let base = std::env::var("TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let schema = format!("payments_{:016x}", fastrand::u64(..));
    let mut admin = sqlx::PgConnection::connect(&base).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&mut admin)
        .await
        .unwrap();
    let url = format!("{base}?options=-c%20search_path%3D{schema}");

    let scenario = Scenario::new();
    let http = &scenario.http;
    let provider = scenario.provider(&[("FAULT_DROP_RATE", "0.5")]).await;
    let env = |dispatchers| [("DATABASE_URL", url.clone()), ("DISPATCHERS", dispatchers)];
    let accepting_env = env("0".to_owned());
    let accepting_env: Vec<(&str, &str)> = accepting_env
        .iter()
        .map(|(k, v)| (*k, v.as_str()))
        .collect();
    let accepting = scenario.payments(&provider, &accepting_env).await;
    let first = http.pay(&accepting.url, "pg-key-1", &payment(1)).await;
    assert_eq!(first.status, StatusCode::ACCEPTED);
    accepting.kill().await;

    let serving_env = env("2".to_owned());
    let serving_env: Vec<(&str, &str)> =
        serving_env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let restarted = scenario.payments(&provider, &serving_env).await;
    let settled = http.settled(&restarted.url, id_of(&first)).await;
    assert_eq!(settled["status"], "succeeded");
    let retry = http.pay(&restarted.url, "pg-key-1", &payment(1)).await;
    assert_eq!(retry.body, first.body);
    assert_eq!(http.charges(&provider.url).await["count"], 1);

    restarted.kill().await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&mut admin)
        .await
        .unwrap();
}

/// What the orders example could not apply (an order id like `o-1`, an amount finer than a
/// cent) or a column could not hold (a NUL, 100,000 characters) is a final 400 before anything
/// is written or charged; a valid payment is charged once and shows its amount as sent.
async fn refuses_what_orders_cannot_apply_and_charges_the_rest_once(database: &str) {
    let scenario = Scenario::new();
    let http = &scenario.http;
    let provider = scenario.provider(&[]).await;
    let payments = scenario.payments_on(database, &provider, &[]).await;
    let long = "x".repeat(100_000);
    let refused = [
        json!({ "order_id": "o-1", "amount": 12.5, "currency": "EUR", "payee": "acme" }),
        json!({ "order_id": "", "amount": 12.5, "currency": "EUR", "payee": "acme" }),
        json!({ "order_id": 1.5, "amount": 12.5, "currency": "EUR", "payee": "acme" }),
        json!({ "order_id": "1".repeat(40), "amount": 12.5, "currency": "EUR", "payee": "acme" }),
        json!({ "order_id": 1, "amount": 12.345, "currency": "EUR", "payee": "acme" }),
        json!({ "order_id": 1, "amount": 0, "currency": "EUR", "payee": "acme" }),
        json!({ "order_id": 1, "amount": 12.5, "currency": "EU\u{0}", "payee": "acme" }),
        json!({ "order_id": 1, "amount": 12.5, "currency": long, "payee": "acme" }),
        json!({ "order_id": 1, "amount": 12.5, "currency": "EUR", "payee": "ac\u{0}me" }),
        json!({ "order_id": 1, "amount": 12.5, "currency": "EUR", "payee": long }),
        json!({ "order_id": 1, "amount": "12.5", "currency": "EUR", "payee": "acme" }),
    ];
    for (n, body) in refused.iter().enumerate() {
        let key = format!("refused-{n}");
        let answer = http.pay(&payments.url, &key, body).await;
        let what = format!("{:.80}", body.to_string());
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{what}");
        assert_eq!(answer.headers["content-type"], "application/problem+json");
        assert_eq!(answer.json()["code"], "invalid_payment", "{what}");
        let again = http.pay(&payments.url, &key, body).await;
        assert_eq!(
            again.headers["idempotent-replayed"], "true",
            "final: {what}"
        );
    }

    for (n, order_id) in [json!(7), json!("8")].into_iter().enumerate() {
        let body = json!({ "order_id": order_id, "amount": 0.1, "currency": "EUR", "payee": "acme-\u{e9}" });
        let accepted = http.pay(&payments.url, &format!("good-{n}"), &body).await;
        assert_eq!(accepted.status, StatusCode::ACCEPTED);
        let settled = http.settled(&payments.url, id_of(&accepted)).await;
        assert_eq!(settled["status"], "succeeded");
        assert_eq!(settled["amount"], json!(0.1));
        assert_eq!(settled["payee"], "acme-\u{e9}");
    }
    assert_eq!(
        http.charges(&provider.url).await["count"],
        2,
        "only the valid payments"
    );
    payments.kill().await;
    provider.kill().await;
}

/// Body and path errors are problem+json as in the orders example: malformed JSON, a body that
/// is not JSON, an amount finer than a cent, an id that is not a number. A whole amount reads
/// back as orders shows it.
#[tokio::test]
async fn answers_its_own_request_errors_as_problem_json_like_orders() {
    let scenario = Scenario::new();
    let http = &scenario.http;
    let provider = scenario.provider(&[]).await;
    let payments = scenario.payments(&provider, &[]).await;
    let cases = [
        (
            "application/json",
            "{\"order_id\":",
            StatusCode::BAD_REQUEST,
            "malformed_json",
        ),
        (
            "text/plain",
            "{}",
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
        ),
        // Read as a float the amount would be 0.1: it is read digit for digit, finer than a cent.
        (
            "application/json",
            r#"{"order_id":1,"amount":0.1000000000000000001,"currency":"EUR","payee":"acme"}"#,
            StatusCode::BAD_REQUEST,
            "invalid_payment",
        ),
    ];
    for (n, (content_type, body, status, code)) in cases.into_iter().enumerate() {
        let request = Request::post(format!("{}/payments", payments.url))
            .header("authorization", "Bearer alice-token")
            .header("idempotency-key", format!("body-{n}"))
            .header("content-type", content_type)
            .body(Full::new(Bytes::from(body)))
            .unwrap();
        let answer = http.call(request).await;
        assert_eq!(answer.status, status, "{body}");
        assert_eq!(answer.headers["content-type"], "application/problem+json");
        assert_eq!(answer.json()["code"], code);
        assert_eq!(answer.json()["title"], status.canonical_reason().unwrap());
    }
    let not_an_id = Request::get(format!("{}/payments/abc", payments.url))
        .header("authorization", "Bearer alice-token")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let not_an_id = http.call(not_an_id).await;
    assert_eq!(not_an_id.status, StatusCode::BAD_REQUEST);
    assert_eq!(not_an_id.json()["code"], "invalid_id");

    let whole = json!({ "order_id": 1, "amount": 10, "currency": "EUR", "payee": "acme" });
    let accepted = http.pay(&payments.url, "whole-amount", &whole).await;
    let shown = http.payment(&payments.url, id_of(&accepted)).await;
    assert_eq!(serde_json::to_string(&shown["amount"]).unwrap(), "10.0");
}

#[tokio::test]
async fn on_sqlite_refuses_what_orders_cannot_apply_and_charges_the_rest_once() {
    let dir = tempfile::tempdir().unwrap();
    let database = format!("sqlite:{}", dir.path().join("payments.db").display());
    refuses_what_orders_cannot_apply_and_charges_the_rest_once(&database).await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn on_postgres_refuses_what_orders_cannot_apply_and_charges_the_rest_once() {
    let base = std::env::var("TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let schema = common::unique("payments");
    let admin = sqlx::PgPool::connect(&base).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&admin)
        .await
        .unwrap();
    let url = format!("{base}?options=-c%20search_path%3D{schema}");
    refuses_what_orders_cannot_apply_and_charges_the_rest_once(&url).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&admin)
        .await
        .unwrap();
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn on_mariadb_refuses_what_orders_cannot_apply_and_charges_the_rest_once() {
    let base = std::env::var("TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
    let database = common::unique("payments");
    let admin = sqlx::MySqlPool::connect(&base).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}")))
        .execute(&admin)
        .await
        .unwrap();
    let server = base.rsplit_once('/').map_or(base.as_str(), |(s, _)| s);
    let url = format!("{server}/{database}");
    refuses_what_orders_cannot_apply_and_charges_the_rest_once(&url).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP DATABASE {database}")))
        .execute(&admin)
        .await
        .unwrap();
}

#[tokio::test]
async fn a_key_back_after_its_record_is_gone_with_another_payment_is_refused_finally() {
    let scenario = Scenario::new();
    let http = &scenario.http;
    let provider = scenario.provider(&[]).await;
    let payments = scenario.payments(&provider, &[]).await;
    let first = http.pay(&payments.url, "reused-key", &payment(1)).await;
    assert_eq!(first.status, StatusCode::ACCEPTED);
    let charged = http.settled(&payments.url, id_of(&first)).await;
    assert_eq!(charged["status"], "succeeded");

    // What the purge does once the record's retention has run out.
    let database = format!("sqlite:{}", scenario.path("payments.db"));
    let pool = sqlx::SqlitePool::connect(&database).await.unwrap();
    let purged = sqlx::query("DELETE FROM idempotency_records")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(purged.rows_affected(), 1);
    pool.close().await;

    // The key's charge downstream is taken by the first payment: a 5xx here would be retried
    // for ever, so the answer is the final 422 of a reused key, and it is kept for replays.
    for _ in 0..2 {
        let other = http.pay(&payments.url, "reused-key", &payment(2)).await;
        assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(other.json()["code"], "idempotency_key_reused");
    }
    let charges = http.charges(&provider.url).await;
    assert_eq!(charges["count"], 1, "{charges}");
}
