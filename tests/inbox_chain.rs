//! The orders example consuming payment events from real RabbitMQ and NATS JetStream, as real
//! processes over SQLite and PostgreSQL: dedupe by payment id, kill -9 between commit and ack,
//! a redelivery storm across two consumer processes, and the whole chain from `POST /payments`.
//!
//! Every test uses broker names of its own (`BROKER_NAMESPACE`) and deletes them at the end.
//! An unreachable broker fails the test.

mod common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use async_nats::jetstream;
use axum_idempotency::client::{Backoff, IdempotentRetryLayer};
use bytes::Bytes;
use common::example_db::{Db, ExampleDatabase as Database};
use common::process::{self, Http, Process};
use common::{nats, rabbitmq};
use http::{Request, StatusCode};
use http_body_util::BodyExt as _;
use http_body_util::Full;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeleteOptions};
use lapin::{BasicProperties, Connection};
use serde_json::{Value, json};
use tower::{Layer as _, ServiceExt as _};

#[derive(Clone, Copy, Debug)]
enum Kind {
    RabbitMq,
    Nats,
}

/// One test's broker names and a publisher for them.
struct Broker {
    kind: Kind,
    ns: String,
    amqp: Option<Connection>,
    js: Option<jetstream::Context>,
}

impl Broker {
    async fn new(kind: Kind) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let ns = format!(
            "t{}x{}x{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .subsec_nanos()
        );
        let (amqp, js) = match kind {
            Kind::RabbitMq => (Some(rabbitmq::connect().await), None),
            Kind::Nats => (None, Some(nats::connect().await)),
        };
        Self { kind, ns, amqp, js }
    }

    fn url(&self) -> &'static str {
        match self.kind {
            Kind::RabbitMq => rabbitmq::URL,
            Kind::Nats => nats::URL,
        }
    }

    fn queue(&self) -> String {
        format!("{}.orders.payment-succeeded", self.ns)
    }

    fn stream(&self, name: &str) -> String {
        format!("{}_{name}", self.ns.to_uppercase())
    }

    /// Publishes one raw event under `message_id`, confirmed by the broker.
    async fn publish(&self, message_id: &str, payload: &[u8]) {
        match self.kind {
            Kind::RabbitMq => {
                let channel = self.amqp.as_ref().unwrap().create_channel().await.unwrap();
                channel
                    .confirm_select(ConfirmSelectOptions::default())
                    .await
                    .unwrap();
                let confirm = channel
                    .basic_publish(
                        format!("{}.payments", self.ns).into(),
                        "payment.succeeded".into(),
                        BasicPublishOptions::default(),
                        payload,
                        BasicProperties::default()
                            .with_message_id(message_id.into())
                            .with_delivery_mode(2),
                    )
                    .await
                    .unwrap()
                    .await
                    .unwrap();
                assert!(confirm.is_ack());
                let _ = channel.close(200, "done".into()).await;
            }
            Kind::Nats => {
                let mut headers = async_nats::HeaderMap::new();
                headers.insert(async_nats::header::NATS_MESSAGE_ID, message_id);
                self.js
                    .as_ref()
                    .unwrap()
                    .publish_with_headers(
                        format!("{}.payments.succeeded", self.ns),
                        headers,
                        Bytes::copy_from_slice(payload),
                    )
                    .await
                    .unwrap()
                    .await
                    .unwrap();
            }
        }
    }

    /// How many dead letters are waiting.
    async fn dead_letters(&self) -> u64 {
        match self.kind {
            Kind::RabbitMq => {
                let channel = self.amqp.as_ref().unwrap().create_channel().await.unwrap();
                let dead = format!("{}.dead", self.queue());
                u64::from(rabbitmq::waiting(&channel, &dead).await)
            }
            Kind::Nats => {
                let js = self.js.as_ref().unwrap();
                nats::messages(js, &self.stream("ORDERS_DEAD")).await
            }
        }
    }

    /// Whether nothing is left to deliver or to ack.
    async fn drained(&self) -> bool {
        match self.kind {
            Kind::RabbitMq => {
                let channel = self.amqp.as_ref().unwrap().create_channel().await.unwrap();
                let mut waiting = 0;
                for queue in [self.queue(), format!("{}.retry", self.queue())] {
                    waiting += rabbitmq::waiting(&channel, &queue).await;
                }
                waiting == 0
            }
            Kind::Nats => {
                let stream = self
                    .js
                    .as_ref()
                    .unwrap()
                    .get_stream(self.stream("PAYMENTS"))
                    .await
                    .unwrap();
                let mut consumer: jetstream::consumer::PullConsumer =
                    stream.get_consumer("orders").await.unwrap();
                let info = consumer.info().await.unwrap();
                info.num_pending == 0 && info.num_ack_pending == 0
            }
        }
    }

    /// Deletes the orders queue or durable consumer from outside, as an operator or a broker
    /// policy might.
    async fn delete_consumer(&self) {
        match self.kind {
            Kind::RabbitMq => {
                let channel = self.amqp.as_ref().unwrap().create_channel().await.unwrap();
                channel
                    .queue_delete(self.queue().into(), QueueDeleteOptions::default())
                    .await
                    .unwrap();
            }
            Kind::Nats => {
                let js = self.js.as_ref().unwrap();
                let stream = js.get_stream(self.stream("PAYMENTS")).await.unwrap();
                stream.delete_consumer("orders").await.unwrap();
            }
        }
    }

    async fn cleanup(self) {
        match self.kind {
            Kind::RabbitMq => {
                let connection = self.amqp.as_ref().unwrap();
                let channel = connection.create_channel().await.unwrap();
                let queues = [
                    self.queue(),
                    format!("{}.retry", self.queue()),
                    format!("{}.dead", self.queue()),
                ];
                rabbitmq::delete(&channel, queues, &format!("{}.payments", self.ns)).await;
            }
            Kind::Nats => {
                let js = self.js.as_ref().unwrap();
                let streams = ["PAYMENTS", "ORDERS_DEAD"].map(|stream| self.stream(stream));
                nats::delete(js, streams).await;
            }
        }
    }
}

async fn orders(database: &Database, broker: &Broker, env: &[(&str, &str)]) -> Process {
    let mut all = vec![
        ("DATABASE_URL", database.url.as_str()),
        ("BROKER_URL", broker.url()),
        ("BROKER_NAMESPACE", broker.ns.as_str()),
        ("ORDERS_CONSUMER_BACKOFF_MS", "50"),
        ("ORDERS_CONSUMER_ACK_WAIT_SECS", "3"),
        ("ORDERS_CONSUMER_STATS_MS", "200"),
    ];
    all.extend_from_slice(env);
    Process::start("orders", &all).await
}

async fn place_order(http: &Http, orders: &Process, key: &str, amount: f64) -> i64 {
    let request = Request::post(format!("{}/orders", orders.url))
        .header("authorization", "Bearer alice-token")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(
            json!({ "sku": "widget", "quantity": 1, "amount": amount, "currency": "EUR" })
                .to_string(),
        )))
        .unwrap();
    let answer = http.call(request).await;
    assert_eq!(answer.status, StatusCode::CREATED);
    answer.json()["id"].as_i64().unwrap()
}

async fn order(http: &Http, orders: &Process, id: i64) -> Value {
    let request = Request::get(format!("{}/orders/{id}", orders.url))
        .header("authorization", "Bearer alice-token")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let answer = http.call(request).await;
    assert_eq!(answer.status, StatusCode::OK);
    answer.json()
}

async fn ship(http: &Http, orders: &Process, id: i64, key: &str) {
    let request = Request::post(format!("{}/orders/{id}/ship", orders.url))
        .header("authorization", "Bearer alice-token")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::new()))
        .unwrap();
    let answer = http.call(request).await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(answer.json()["status"], "shipped");
}

async fn all_orders(http: &Http, orders: &Process) -> Vec<Value> {
    let request = Request::get(format!("{}/orders", orders.url))
        .header("authorization", "Bearer alice-token")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let answer = http.call(request).await;
    assert_eq!(answer.status, StatusCode::OK);
    answer.json().as_array().unwrap().clone()
}

/// Polls `check` until it holds, at most `within`.
async fn eventually<F, Fut>(within: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + within;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn event(payment_id: &str, order_id: Value, amount: f64) -> Vec<u8> {
    json!({ "payment_id": payment_id, "order_id": order_id, "amount": amount, "currency": "EUR" })
        .to_string()
        .into_bytes()
}

fn payment_ids(order: &Value) -> Vec<String> {
    order["payments"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["payment_id"].as_str().unwrap().to_owned())
        .collect()
}

/// Counters from the last stats line a consumer printed: processed, duplicates, retried, dead.
fn stats(process: &Process) -> [u64; 4] {
    let line = process.last_line("consumer stats").unwrap_or_default();
    let mut out = [0; 4];
    for (i, name) in ["processed=", "duplicates=", "retried=", "dead="]
        .iter()
        .enumerate()
    {
        out[i] = line
            .split(name)
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
    }
    out
}

// ---------------------------------------------------------------------------------------------

async fn one_payment_applies_once_whatever_its_message_ids(kind: Kind, db: Db) {
    let broker = Broker::new(kind).await;
    let database = Database::new(db).await;
    let http = Http::new();
    let orders = orders(&database, &broker, &[]).await;
    let id = place_order(&http, &orders, &format!("{}-order", broker.ns), 0.3).await;

    let fresh = order(&http, &orders, id).await;
    assert_eq!(fresh["payments"], json!([]));
    assert_eq!(fresh["paid_total"], json!(0.0));
    // Shipped before it is paid: paying it in full still makes it "paid".
    ship(&http, &orders, id, &format!("{}-ship", broker.ns)).await;

    // The same payment under three message ids, then a second payment (order id as digits).
    for message_id in ["m-1", "m-2", "m-3"] {
        broker
            .publish(message_id, &event("p-1", json!(id), 0.1))
            .await;
    }
    broker
        .publish("m-4", &event("p-2", json!(id.to_string()), 0.2))
        .await;
    // Poison: an unknown order and malformed JSON go to the dead letters, never applied.
    broker
        .publish("m-5", &event("p-3", json!(999_999_999), 5.0))
        .await;
    broker.publish("m-6", b"{not json").await;

    eventually(Duration::from_secs(20), "both payments applied", || async {
        order(&http, &orders, id).await["payments"]
            .as_array()
            .is_some_and(|p| p.len() >= 2)
    })
    .await;
    eventually(Duration::from_secs(20), "two dead letters", || async {
        broker.dead_letters().await == 2
    })
    .await;
    eventually(Duration::from_secs(20), "queue drained", || async {
        broker.drained().await
    })
    .await;
    let paid = order(&http, &orders, id).await;
    let mut ids = payment_ids(&paid);
    ids.sort();
    assert_eq!(ids, ["p-1", "p-2"], "{paid}");
    // In cents, 0.1 + 0.2 is 0.3 exactly: the total covers the amount.
    assert_eq!(paid["paid_total"], json!(0.3));
    assert_eq!(paid["status"], "paid");
    orders.kill().await;
    broker.cleanup().await;
    database.cleanup().await;
}

async fn killed_between_commit_and_ack_skips_the_redelivery(kind: Kind, db: Db) {
    let broker = Broker::new(kind).await;
    let database = Database::new(db).await;
    let http = Http::new();
    let setup = orders(&database, &broker, &[]).await;
    let id = place_order(&http, &setup, &format!("{}-order", broker.ns), 10.0).await;
    setup.kill().await;

    let doomed = orders(&database, &broker, &[("ORDERS_FAILPOINT", "after-commit")]).await;
    broker.publish("m-1", &event("p-1", json!(id), 10.0)).await;
    doomed
        .wait_for_line("failpoint after-commit reached", Duration::from_secs(20))
        .await;
    doomed.kill().await; // SIGKILL: committed, never acked

    let restarted = orders(&database, &broker, &[]).await;
    // The broker redelivers (RabbitMQ on the closed connection, NATS after the ack wait);
    // the restarted consumer finds the claim and skips it.
    eventually(Duration::from_secs(30), "redelivery skipped", || async {
        stats(&restarted)[1] >= 1
    })
    .await;
    eventually(Duration::from_secs(20), "queue drained", || async {
        broker.drained().await
    })
    .await;
    let paid = order(&http, &restarted, id).await;
    assert_eq!(payment_ids(&paid), ["p-1"], "{paid}");
    assert_eq!(stats(&restarted)[0], 0, "the handler ran again");
    restarted.kill().await;
    broker.cleanup().await;
    database.cleanup().await;
}

async fn two_consumers_under_a_redelivery_storm_apply_each_payment_once(
    kind: Kind,
    db: Db,
    payments: usize,
) {
    let broker = Broker::new(kind).await;
    let database = Database::new(db).await;
    let http = Http::new();
    let storm = [
        ("ORDERS_CONSUMER_FAIL_PERCENT", "30"),
        ("ORDERS_CONSUMER_MAX_ATTEMPTS", "100"),
        ("ORDERS_CONSUMER_CONCURRENCY", "8"),
        ("ORDERS_CONSUMER_ACK_WAIT_SECS", "2"),
    ];
    let first = orders(&database, &broker, &storm).await;
    let second = orders(&database, &broker, &storm).await;
    let mut order_ids = Vec::new();
    for n in 0..5 {
        order_ids.push(place_order(&http, &first, &format!("{}-order-{n}", broker.ns), 1e9).await);
    }
    // Every payment twice, under two message ids, interleaved.
    let started = std::time::Instant::now();
    let mut published = 0;
    for copy in 0..2 {
        for p in 0..payments {
            let order_id = order_ids[p % order_ids.len()];
            broker
                .publish(
                    &format!("m-{p}-{copy}"),
                    &event(&format!("p-{p}"), json!(order_id), 1.0),
                )
                .await;
            published += 1;
        }
    }
    let count = || async {
        let orders = all_orders(&http, &first).await;
        orders.iter().map(|o| payment_ids(o).len()).sum::<usize>()
    };
    eventually(Duration::from_secs(50), "every payment applied", || async {
        count().await >= payments
    })
    .await;
    eventually(Duration::from_secs(20), "queue drained", || async {
        broker.drained().await
    })
    .await;
    // Let the counters print once more after the last ack.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let elapsed = started.elapsed();

    let mut seen = std::collections::HashMap::new();
    for order in all_orders(&http, &first).await {
        for id in payment_ids(&order) {
            *seen.entry(id).or_insert(0) += 1;
        }
    }
    assert_eq!(seen.len(), payments);
    assert!(seen.values().all(|n| *n == 1), "a payment applied twice");
    let (a, b) = (stats(&first), stats(&second));
    let deliveries: u64 = a.iter().chain(b.iter()).sum();
    eprintln!(
        "storm {kind:?}/{db:?}: published {published} messages ({payments} payments x2), \
         deliveries seen {deliveries} (applied {}, duplicates {}, retried {}, dead {}), \
         effects {} in {elapsed:.1?}",
        a[0] + b[0],
        a[1] + b[1],
        a[2] + b[2],
        a[3] + b[3],
        seen.len()
    );
    assert_eq!(a[3] + b[3], 0, "nothing should die with 100 attempts");
    assert_eq!(a[0] + b[0], payments as u64, "applied count");
    first.kill().await;
    second.kill().await;
    broker.cleanup().await;
    database.cleanup().await;
}

async fn the_chain_charges_once_and_applies_the_payment_once(kind: Kind) {
    let broker = Broker::new(kind).await;
    let orders_db = Database::new(Db::Sqlite).await;
    let dir = tempfile::tempdir().unwrap();
    let http = Http::new();
    let provider_db = dir.path().join("provider.db").display().to_string();
    // Half the charges are made and then their answer dropped: the outbox looks them up.
    let provider = Process::start(
        "payment_provider",
        &[
            ("PROVIDER_DATABASE", &provider_db),
            ("FAULT_DROP_RATE", "0.5"),
        ],
    )
    .await;
    let payments_db = format!("sqlite:{}", dir.path().join("payments.db").display());
    let payments = Process::start(
        "payments",
        &[
            ("DATABASE_URL", &payments_db),
            ("PROVIDER_URL", &provider.url),
            ("BROKER_URL", broker.url()),
            ("BROKER_NAMESPACE", &broker.ns),
            ("OUTBOX_POLL_MS", "100"),
            ("OUTBOX_BACKOFF_MS", "50"),
            ("OUTBOX_LOOKUP_GRACE_MS", "200"),
        ],
    )
    .await;
    let orders = orders(&orders_db, &broker, &[]).await;
    let order_id = place_order(&http, &orders, &format!("{}-order", broker.ns), 37.5).await;

    // Three payments through a proxy that loses half the answers after forwarding the
    // request; the client layer retries each with the key it made for it.
    let upstream: std::net::SocketAddr =
        payments.url.trim_start_matches("http://").parse().unwrap();
    let (proxy, dropped) = common::lossy::spawn_lossy_proxy(upstream, 50).await;
    let client = IdempotentRetryLayer::new()
        .max_attempts(12)
        .backoff(Backoff::exponential(
            Duration::from_millis(10),
            Duration::from_millis(100),
        ))
        .layer(
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<Full<Bytes>>(),
        );
    let mut created = Vec::new();
    for _ in 0..3 {
        let request = Request::post(format!("http://{proxy}/payments"))
            .header("authorization", "Bearer alice-token")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(
                json!({ "order_id": order_id, "amount": 12.5, "currency": "EUR", "payee": "acme" })
                    .to_string(),
            )))
            .unwrap();
        let response = client.clone().oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::ACCEPTED);
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let body: Value = serde_json::from_slice(&body).unwrap();
        created.push(body["id"].as_i64().unwrap().to_string());
    }
    assert!(
        dropped.load(Ordering::Relaxed) >= 1,
        "the proxy should have lost answers"
    );

    eventually(Duration::from_secs(40), "the order is paid", || async {
        order(&http, &orders, order_id).await["status"] == "paid"
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let paid = order(&http, &orders, order_id).await;
    let mut applied = payment_ids(&paid);
    applied.sort();
    created.sort();
    assert_eq!(applied, created, "{paid}");
    assert!(
        paid["payments"]
            .as_array()
            .unwrap()
            .iter()
            .all(|p| p["amount"] == json!(12.5))
    );
    assert_eq!(paid["paid_total"], json!(37.5));
    let charges = http
        .call(
            Request::get(format!("{}/admin/charges", provider.url))
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await
        .json();
    assert_eq!(charges["count"], 3);
    orders.kill().await;
    payments.kill().await;
    provider.kill().await;
    broker.cleanup().await;
    orders_db.cleanup().await;
}

/// Runs `orders replay-dead` once, as an operator would, and returns what it printed.
async fn replay_dead(database: &Database, broker: &Broker) -> String {
    let output = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::process::Command::new(process::example("orders"))
            .arg("replay-dead")
            .env("BIND", "127.0.0.1:0")
            .env("RUST_LOG", "warn")
            .env("DATABASE_URL", &database.url)
            .env("BROKER_URL", broker.url())
            .env("BROKER_NAMESPACE", &broker.ns)
            .output(),
    )
    .await
    .expect("replay-dead is bounded")
    .unwrap();
    assert!(output.status.success(), "replay-dead failed: {output:?}");
    String::from_utf8_lossy(&output.stdout).into_owned()
}

async fn an_event_for_a_missing_order_is_dead_lettered_then_replayed_once(kind: Kind) {
    let broker = Broker::new(kind).await;
    let database = Database::new(Db::Sqlite).await;
    let http = Http::new();
    let orders = orders(&database, &broker, &[]).await;
    let first = place_order(&http, &orders, &format!("{}-order-1", broker.ns), 5.0).await;

    // The event overtook its order: permanent failure, dead-lettered, nothing applied.
    broker
        .publish("m-1", &event("p-early", json!(first + 1), 5.0))
        .await;
    eventually(Duration::from_secs(20), "dead-lettered", || async {
        broker.dead_letters().await == 1
    })
    .await;

    // The cause goes away (the order now exists); the operator replays the dead letters.
    let second = place_order(&http, &orders, &format!("{}-order-2", broker.ns), 5.0).await;
    assert_eq!(second, first + 1);
    assert_eq!(order(&http, &orders, second).await["payments"], json!([]));
    let replayed = replay_dead(&database, &broker).await;
    assert!(
        replayed.contains("applied=1 duplicates=0 still_dead=0"),
        "{replayed}"
    );
    let again = replay_dead(&database, &broker).await;
    assert!(
        again.contains("applied=0 duplicates=0 still_dead=0"),
        "{again}"
    );
    assert_eq!(broker.dead_letters().await, 0);
    let paid = order(&http, &orders, second).await;
    assert_eq!(payment_ids(&paid), ["p-early"], "{paid}");
    assert_eq!(paid["status"], "paid");
    orders.kill().await;
    broker.cleanup().await;
    database.cleanup().await;
}

/// The queue or durable consumer deleted from outside: the process can consume no more, so it
/// exits non-zero (its supervisor restarts it, and the restart declares them again) rather
/// than serve orders whose payments would never be applied.
async fn a_deleted_queue_or_consumer_stops_the_orders_process(kind: Kind) {
    let broker = Broker::new(kind).await;
    let database = Database::new(Db::Sqlite).await;
    let http = Http::new();
    let orders = orders(&database, &broker, &[]).await;
    // Consuming for sure: a payment was applied.
    let id = place_order(&http, &orders, &format!("{}-order", broker.ns), 1.0).await;
    broker.publish("m-1", &event("p-1", json!(id), 1.0)).await;
    eventually(Duration::from_secs(20), "the payment applied", || async {
        order(&http, &orders, id).await["status"] == "paid"
    })
    .await;

    broker.delete_consumer().await;
    let output = orders.output.clone();
    let status = orders.exit_status(Duration::from_secs(20)).await;
    assert_eq!(status.code(), Some(1), "{status}");
    // Its last words say why, for the operator reading the log.
    eventually(Duration::from_secs(5), "the reason logged", || async {
        let lines = output.lock().unwrap();
        lines
            .iter()
            .any(|line| line.contains("the payment consumer stopped"))
    })
    .await;
    broker.cleanup().await;
    database.cleanup().await;
}

macro_rules! on_each {
    ($scenario:ident: $($name:ident => ($($arg:expr),*);)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                tokio::time::timeout(Duration::from_secs(60), $scenario($($arg),*))
                    .await
                    .expect("bounded to 60 s");
            }
        )*
    };
}

on_each! { one_payment_applies_once_whatever_its_message_ids:
    rabbitmq_sqlite_one_payment_applies_once_whatever_its_message_ids => (Kind::RabbitMq, Db::Sqlite);
    nats_sqlite_one_payment_applies_once_whatever_its_message_ids => (Kind::Nats, Db::Sqlite);
}
on_each! { killed_between_commit_and_ack_skips_the_redelivery:
    rabbitmq_sqlite_killed_between_commit_and_ack_skips_the_redelivery => (Kind::RabbitMq, Db::Sqlite);
    nats_sqlite_killed_between_commit_and_ack_skips_the_redelivery => (Kind::Nats, Db::Sqlite);
}
on_each! { two_consumers_under_a_redelivery_storm_apply_each_payment_once:
    rabbitmq_sqlite_two_consumers_under_a_redelivery_storm_apply_each_payment_once => (Kind::RabbitMq, Db::Sqlite, 150);
    nats_sqlite_two_consumers_under_a_redelivery_storm_apply_each_payment_once => (Kind::Nats, Db::Sqlite, 150);
}
on_each! { an_event_for_a_missing_order_is_dead_lettered_then_replayed_once:
    rabbitmq_an_event_for_a_missing_order_is_dead_lettered_then_replayed_once => (Kind::RabbitMq);
    nats_an_event_for_a_missing_order_is_dead_lettered_then_replayed_once => (Kind::Nats);
}
on_each! { a_deleted_queue_or_consumer_stops_the_orders_process:
    rabbitmq_a_deleted_queue_stops_the_orders_process => (Kind::RabbitMq);
    nats_a_deleted_durable_consumer_stops_the_orders_process => (Kind::Nats);
}
on_each! { the_chain_charges_once_and_applies_the_payment_once:
    rabbitmq_the_chain_charges_once_and_applies_the_payment_once => (Kind::RabbitMq);
    nats_the_chain_charges_once_and_applies_the_payment_once => (Kind::Nats);
}

#[cfg(feature = "postgres")]
on_each! { one_payment_applies_once_whatever_its_message_ids:
    rabbitmq_postgres_one_payment_applies_once_whatever_its_message_ids => (Kind::RabbitMq, Db::Postgres);
    nats_postgres_one_payment_applies_once_whatever_its_message_ids => (Kind::Nats, Db::Postgres);
}
#[cfg(feature = "postgres")]
on_each! { killed_between_commit_and_ack_skips_the_redelivery:
    rabbitmq_postgres_killed_between_commit_and_ack_skips_the_redelivery => (Kind::RabbitMq, Db::Postgres);
    nats_postgres_killed_between_commit_and_ack_skips_the_redelivery => (Kind::Nats, Db::Postgres);
}
#[cfg(feature = "postgres")]
on_each! { two_consumers_under_a_redelivery_storm_apply_each_payment_once:
    rabbitmq_postgres_two_consumers_under_a_redelivery_storm_apply_each_payment_once => (Kind::RabbitMq, Db::Postgres, 300);
    nats_postgres_two_consumers_under_a_redelivery_storm_apply_each_payment_once => (Kind::Nats, Db::Postgres, 300);
}

#[cfg(feature = "mysql")]
on_each! { one_payment_applies_once_whatever_its_message_ids:
    rabbitmq_mariadb_one_payment_applies_once_whatever_its_message_ids => (Kind::RabbitMq, Db::Mariadb);
    nats_mariadb_one_payment_applies_once_whatever_its_message_ids => (Kind::Nats, Db::Mariadb);
}
#[cfg(feature = "mysql")]
on_each! { killed_between_commit_and_ack_skips_the_redelivery:
    rabbitmq_mariadb_killed_between_commit_and_ack_skips_the_redelivery => (Kind::RabbitMq, Db::Mariadb);
    nats_mariadb_killed_between_commit_and_ack_skips_the_redelivery => (Kind::Nats, Db::Mariadb);
}
