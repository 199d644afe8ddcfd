//! The payments → provider, payments → broker → orders chain as real processes, converging by
//! itself through the outage of one of its dependencies while payments keep coming.
//!
//! The contract: on PostgreSQL and SQLite (and here MariaDB too), with RabbitMQ and NATS, under
//! steady load, the provider unreachable for 10 minutes, the broker down for 10 minutes, the
//! payments database or the orders database unreachable for 2 minutes: no accepted payment
//! fails, each is charged exactly once and applied once in orders, nothing is dead-lettered,
//! and the backlog is drained within 60 s of the dependency's return.
//!
//! Scaled: the outage, the settings that wait it out (the outbox's probe backoff cap and the
//! inbox's outage backoff cap, at the contract's 30 s rather than the examples' 10 s, the
//! harder case) and the 60 s bound are shortened by one factor: 1/15 for
//! the provider and the broker (40 s down, 2 s caps, drained within 4 s) and 1/4 for the
//! databases (30 s down, 7.5 s caps, within 15 s). For the broker the dispatcher's send
//! timeout is scaled too (5 s to 333 ms): a sender that waits for a broker that is down spends
//! one attempt per timeout. The rest stays at the examples' defaults, which fail a message after
//! its 10th failed attempt: 10 to 20 s of an outage counted in attempts. The broker clients'
//! reconnection backoff (at most 5 s, fixed in the crate) does not scale, so the broker's bound
//! adds it.
//!
//! Each dependency is taken away by a [`Plug`] of the test's own between it and the apps: the
//! provider and the broker refuse connections (a service down), a database drops them and
//! resets new ones (a partition). An SQLite database, a file with no link to cut, is taken away
//! by a connection of the test's own holding its write lock (`BEGIN EXCLUSIVE`), as a stuck
//! process or a long backup does: every write waits out its lock wait and fails. The shared
//! services are never stopped.

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum_idempotency::client::{Attempts, Backoff, IdempotentRetryLayer};
use bytes::Bytes;
use common::example_db::{Db, ExampleDatabase as Database};
use common::link::Plug;
use common::process::{Http, Process};
use http::Request;
use http_body_util::{BodyExt as _, Full};
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use tower::{Layer as _, ServiceExt as _};

#[derive(Clone, Copy, Debug)]
enum Kind {
    RabbitMq,
    Nats,
}

impl Kind {
    /// The shared broker's address.
    fn addr(self) -> SocketAddr {
        match self {
            Kind::RabbitMq => SocketAddr::from(([127, 0, 0, 1], 5672)),
            Kind::Nats => SocketAddr::from(([127, 0, 0, 1], 4222)),
        }
    }

    fn url(self, addr: SocketAddr) -> String {
        match self {
            Kind::RabbitMq => format!("amqp://guest:guest@{addr}/%2f"),
            Kind::Nats => format!("nats://{addr}"),
        }
    }
}

/// The dependency taken away.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Outage {
    Provider,
    Broker,
    PaymentsDb,
    OrdersDb,
}

/// An outage as the test runs it: the contract's, shortened with the settings and the bound.
struct Scaled {
    /// How long the dependency is away.
    outage: Duration,
    /// The probe and outage backoff caps, scaled from the contract's 30 s (the examples
    /// default to 10 s).
    cap: Duration,
    /// How soon after the return the backlog must be drained (60 s in the contract).
    drain: Duration,
    /// The dispatcher's send timeout (5 s by default), where the outage is met by waiting it
    /// out: a send to a broker that is down did so before the broker senders answered
    /// `Unavailable` at once.
    send_timeout: Option<Duration>,
    /// The orders consumer's first retry backoff (1 s by default), which its failed attempts
    /// double up to its five: scaled, a lock wait counted as an attempt spends them as fast as
    /// a full-length outage would.
    backoff: Duration,
}

impl Outage {
    fn scaled(self) -> Scaled {
        match self {
            // 10 minutes, 30 s caps, 60 s: divided by 15.
            Outage::Provider => Scaled {
                outage: Duration::from_secs(40),
                cap: Duration::from_secs(2),
                drain: Duration::from_secs(4),
                send_timeout: None,
                backoff: Duration::from_millis(1_000 / 15),
            },
            // The same, plus the broker clients' reconnection backoff cap, which is not scaled.
            Outage::Broker => Scaled {
                outage: Duration::from_secs(40),
                cap: Duration::from_secs(2),
                drain: Duration::from_secs(4 + 5),
                send_timeout: Some(Duration::from_millis(5_000 / 15)),
                backoff: Duration::from_millis(1_000 / 15),
            },
            // 2 minutes, 30 s caps, 60 s: divided by 4.
            Outage::PaymentsDb | Outage::OrdersDb => Scaled {
                outage: Duration::from_secs(30),
                cap: Duration::from_millis(7_500),
                drain: Duration::from_secs(15),
                send_timeout: None,
                backoff: Duration::from_millis(1_000 / 4),
            },
        }
    }
}

/// A namespace for the test's broker names (`BROKER_NAMESPACE`), unique on a shared broker.
fn namespace() -> String {
    common::unique("t").replace('_', "x")
}

/// `host:port` of a database URL (`postgres://user@host:port/db?…`).
fn authority(url: &str) -> SocketAddr {
    let rest = url.split_once('@').expect("a user in the URL").1;
    let host = rest.split(['/', '?']).next().unwrap_or_default();
    host.parse().expect("a numeric host:port")
}

/// What takes the dependency away: a plug on its link, or the write lock of an SQLite file.
enum Away {
    Plug(Plug),
    Lock {
        url: String,
        holder: tokio::sync::Mutex<Option<sqlx::SqliteConnection>>,
    },
}

impl Away {
    async fn take(&self) {
        match self {
            Away::Plug(plug) => plug.unplug(),
            Away::Lock { url, holder } => {
                use sqlx::Connection as _;
                let mut connection = sqlx::SqliteConnection::connect(url).await.unwrap();
                // Waits for a writer of the apps' to finish, within sqlx's 5 s lock wait.
                sqlx::raw_sql("BEGIN EXCLUSIVE")
                    .execute(&mut connection)
                    .await
                    .expect("the SQLite write lock");
                *holder.lock().await = Some(connection);
            }
        }
    }

    async fn give_back(&self) {
        match self {
            Away::Plug(plug) => plug.plug_in(),
            Away::Lock { holder, .. } => {
                use sqlx::Connection as _;
                let mut connection = holder.lock().await.take().expect("the lock held");
                sqlx::raw_sql("ROLLBACK")
                    .execute(&mut connection)
                    .await
                    .unwrap();
                connection.close().await.unwrap();
            }
        }
    }
}

/// The three processes of the chain, what takes one dependency away, and the order every
/// payment is for.
struct Chain {
    dir: tempfile::TempDir,
    http: Http,
    broker_url: String,
    ns: String,
    away: Away,
    provider: Process,
    payments: Process,
    orders: Process,
    payments_db: Database,
    orders_db: Database,
    order_id: i64,
}

impl Chain {
    async fn start(outage: Outage, kind: Kind, db: Db) -> Self {
        let scaled = outage.scaled();
        let dir = tempfile::tempdir().unwrap();
        let ns = namespace();
        let provider_db = dir.path().join("provider.db").display().to_string();
        let provider_env = [("PROVIDER_DATABASE", provider_db.as_str())];
        let (provider, payments_db, orders_db) = tokio::join!(
            Process::start("payment_provider", &provider_env),
            Database::new(db),
            Database::new(db)
        );
        let provider_addr: SocketAddr = provider.url.trim_start_matches("http://").parse().unwrap();
        let lock = |db: &Database| Away::Lock {
            url: db.url.clone(),
            holder: tokio::sync::Mutex::new(None),
        };
        let sqlite = matches!(db, Db::Sqlite);
        let away = match outage {
            Outage::Provider => Away::Plug(Plug::start_refusing(provider_addr).await),
            Outage::Broker => Away::Plug(Plug::start_refusing(kind.addr()).await),
            Outage::PaymentsDb if sqlite => lock(&payments_db),
            Outage::OrdersDb if sqlite => lock(&orders_db),
            Outage::PaymentsDb => Away::Plug(Plug::start(authority(&payments_db.url)).await),
            Outage::OrdersDb => Away::Plug(Plug::start(authority(&orders_db.url)).await),
        };
        let plugged = match &away {
            Away::Plug(plug) => Some(plug.addr),
            Away::Lock { .. } => None,
        };
        let through = |url: &str, taken: bool| match (taken, plugged) {
            (true, Some(plug)) => {
                let addr = authority(url);
                url.replacen(&format!("@{addr}"), &format!("@{plug}"), 1)
            }
            _ => url.to_owned(),
        };
        let provider_url = match (outage, plugged) {
            (Outage::Provider, Some(plug)) => format!("http://{plug}"),
            _ => provider.url.clone(),
        };
        let broker_addr = match (outage, plugged) {
            (Outage::Broker, Some(plug)) => plug,
            _ => kind.addr(),
        };
        let broker = kind.url(broker_addr);
        let cap = scaled.cap.as_millis().to_string();
        let backoff = scaled.backoff.as_millis().to_string();
        let send_timeout = scaled.send_timeout.map(|t| t.as_millis().to_string());
        let orders = Process::start(
            "orders",
            &[
                (
                    "DATABASE_URL",
                    &through(&orders_db.url, outage == Outage::OrdersDb),
                ),
                ("BROKER_URL", &broker),
                ("BROKER_NAMESPACE", &ns),
                ("ORDERS_CONSUMER_STATS_MS", "500"),
                ("ORDERS_CONSUMER_OUTAGE_MAX_MS", &cap),
                ("ORDERS_CONSUMER_BACKOFF_MS", &backoff),
            ],
        )
        .await;
        let payments_url = through(&payments_db.url, outage == Outage::PaymentsDb);
        let mut env = vec![
            ("DATABASE_URL", payments_url.as_str()),
            ("PROVIDER_URL", &provider_url),
            ("BROKER_URL", &broker),
            ("BROKER_NAMESPACE", &ns),
            ("OUTBOX_PROBE_MAX_MS", &cap),
        ];
        env.extend(
            send_timeout
                .as_deref()
                .map(|t| ("OUTBOX_SEND_TIMEOUT_MS", t)),
        );
        let payments = Process::start("payments", &env).await;
        let mut chain = Self {
            dir,
            http: Http::new(),
            broker_url: kind.url(kind.addr()),
            ns,
            away,
            provider,
            payments,
            orders,
            payments_db,
            orders_db,
            order_id: 0,
        };
        chain.order_id = chain.place_order().await;
        chain
    }

    async fn place_order(&self) -> i64 {
        let body = json!({ "sku": "widget", "quantity": 1, "amount": 1e9, "currency": "EUR" });
        let request = Request::post(format!("{}/orders", self.orders.url))
            .header("authorization", "Bearer alice-token")
            .header("idempotency-key", format!("{}-order", self.ns))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .unwrap();
        let answer = self.http.call(request).await;
        assert_eq!(answer.status, 201);
        answer.json()["id"].as_i64().unwrap()
    }

    /// The payment ids applied to the order, as many times as each was applied; empty while
    /// orders cannot answer.
    async fn applied(&self) -> Vec<String> {
        let request = Request::get(format!("{}/orders/{}", self.orders.url, self.order_id))
            .header("authorization", "Bearer alice-token")
            .body(Full::new(Bytes::new()))
            .unwrap();
        let answer = self.http.try_call(request).await;
        let Some(order) = answer.ok().filter(|a| a.status == 200).map(|a| a.json()) else {
            return Vec::new();
        };
        let payments = order["payments"].as_array().into_iter().flatten();
        payments
            .filter_map(|p| p["payment_id"].as_str().map(str::to_owned))
            .collect()
    }

    /// A payment as payments shows it.
    async fn payment(&self, id: &str) -> Value {
        let request = Request::get(format!("{}/payments/{id}", self.payments.url))
            .header("authorization", "Bearer alice-token")
            .body(Full::new(Bytes::new()))
            .unwrap();
        self.http.call(request).await.json()
    }

    /// Waits until every payment of `ids` is applied, at most `within` plus a margin (to
    /// measure a miss, or to report one); how long that took since `since`.
    async fn applied_all(&self, ids: &[String], since: Instant, within: Duration) -> Duration {
        let deadline = since + within + Duration::from_secs(20);
        loop {
            let applied = self.applied().await;
            if ids.iter().all(|id| applied.contains(id)) {
                return since.elapsed();
            }
            if Instant::now() >= deadline {
                let mut missing = Vec::new();
                for id in ids.iter().filter(|id| !applied.contains(id)).take(5) {
                    missing.push(self.payment(id).await);
                }
                panic!(
                    "not drained: {} of {} payments applied; missing, for instance: {missing:?}",
                    applied.len(),
                    ids.len()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until every payment posted before `back` has its final answer and, when
    /// accepted, is applied, at most `within` plus a margin; how long that took since `back`.
    async fn drained(&self, posts: &Posts, back: Instant, within: Duration) -> Duration {
        let deadline = back + within + Duration::from_secs(20);
        loop {
            let backlog: Vec<Posted> = {
                let posts = posts.lock().unwrap();
                posts.iter().filter(|p| p.at <= back).cloned().collect()
            };
            let answered = backlog.iter().all(|p| p.answer.is_some());
            let applied = self.applied().await;
            let ids: Vec<String> = backlog.iter().filter_map(accepted).collect();
            if answered && ids.iter().all(|id| applied.contains(id)) {
                return back.elapsed();
            }
            if Instant::now() >= deadline {
                let mut missing = Vec::new();
                for id in ids.iter().filter(|id| !applied.contains(id)).take(5) {
                    missing.push(self.payment(id).await);
                }
                let unanswered = backlog.iter().filter(|p| p.answer.is_none()).count();
                let unapplied = ids.iter().filter(|id| !applied.contains(id)).count();
                let dead = common::brokers::dead_letters(&self.broker_url, &self.ns).await;
                panic!(
                    "backlog not drained: of {} payments posted before the return, \
                     {unanswered} unanswered, {unapplied} of {} accepted not applied \
                     ({dead} dead letters); for instance: {missing:?}",
                    backlog.len(),
                    ids.len()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The provider's charges: how many `POST /charges` it received, and the idempotency key
    /// of each charge it made.
    async fn charges(&self) -> (u64, Vec<String>) {
        let request = Request::get(format!("{}/admin/charges", self.provider.url))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let listed = self.http.call(request).await.json();
        let charges = listed["charges"].as_array().unwrap().iter();
        let keys = charges.map(|c| c["idempotency_key"].as_str().unwrap_or_default().to_owned());
        (listed["posts"].as_u64().unwrap_or_default(), keys.collect())
    }

    async fn stop(self) {
        drop(self.away);
        self.orders.kill().await;
        self.payments.kill().await;
        self.provider.kill().await;
        common::brokers::delete_namespace(&self.broker_url, &self.ns).await;
        self.payments_db.cleanup().await;
        self.orders_db.cleanup().await;
        drop(self.dir);
    }
}

/// One payment the load posted: when, and its final answer once it has one.
#[derive(Clone)]
struct Posted {
    at: Instant,
    /// The final status (0: none) and, when accepted, the payment's id.
    answer: Option<(u16, Option<String>)>,
    /// Whether the client had to send it more than once.
    retried: bool,
}

/// Every payment the load posted so far.
type Posts = Arc<Mutex<Vec<Posted>>>;

/// One payment posted every 250 ms until `stop` is set, each in a task of its own with a key
/// of its own that the crate's client retries (connection errors, timeouts, 5xx, 429); returns
/// once every post has its final answer.
fn post_payments(chain: &Chain, posts: Posts, stop: Arc<AtomicBool>) -> JoinHandle<()> {
    let (url, ns, order_id) = (chain.payments.url.clone(), chain.ns.clone(), chain.order_id);
    let client = IdempotentRetryLayer::new()
        .max_attempts(1_000)
        .deadline(Duration::from_secs(120))
        .attempt_timeout(Duration::from_secs(10))
        .backoff(Backoff::exponential(
            Duration::from_millis(100),
            Duration::from_secs(2),
        ))
        .layer(
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<Full<Bytes>>(),
        );
    tokio::spawn(async move {
        let mut calls = tokio::task::JoinSet::new();
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        while !stop.load(Ordering::Relaxed) {
            tick.tick().await;
            let n = {
                let mut posts = posts.lock().unwrap();
                posts.push(Posted {
                    at: Instant::now(),
                    answer: None,
                    retried: false,
                });
                posts.len() - 1
            };
            let body =
                json!({ "order_id": order_id, "amount": 12.5, "currency": "EUR", "payee": "acme" });
            let request = Request::post(format!("{url}/payments"))
                .header("authorization", "Bearer alice-token")
                .header("idempotency-key", format!("{ns}-pay-{n}"))
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(body.to_string())))
                .unwrap();
            let (client, posts) = (client.clone(), Arc::clone(&posts));
            calls.spawn(async move {
                let (answer, retried) = match client.oneshot(request).await {
                    Ok(response) => {
                        let status = response.status().as_u16();
                        let attempts = response.extensions().get::<Attempts>().map(|a| a.0);
                        let body = response.into_body().collect().await.map(|b| b.to_bytes());
                        let id = (status == 202)
                            .then(|| serde_json::from_slice::<Value>(&body.ok()?).ok())
                            .flatten()
                            .and_then(|body| body["id"].as_i64())
                            .map(|id| id.to_string());
                        ((status, id), attempts.unwrap_or(1) > 1)
                    }
                    Err(_) => ((0, None), true),
                };
                let mut posts = posts.lock().unwrap();
                posts[n].answer = Some(answer);
                posts[n].retried = retried;
            });
        }
        while calls.join_next().await.is_some() {}
    })
}

/// The id of a payment the load posted, if it was accepted.
fn accepted(post: &Posted) -> Option<String> {
    post.answer.as_ref()?.1.clone()
}

/// Takes `outage`'s dependency away for its scaled length while payments keep coming, then
/// checks the contract: every payment accepted, charged once, applied once, none failed,
/// nothing dead-lettered, the backlog drained within the scaled bound of the return.
async fn the_chain_converges_through(outage: Outage, kind: Kind, db: Db) {
    let scaled = outage.scaled();
    let chain = Chain::start(outage, kind, db).await;
    let (posts, stop) = (Posts::default(), Arc::new(AtomicBool::new(false)));
    let load = post_payments(&chain, Arc::clone(&posts), Arc::clone(&stop));
    // Flowing before the outage: some payments applied already.
    let deadline = Instant::now() + Duration::from_secs(30);
    while chain.applied().await.len() < 5 {
        assert!(Instant::now() < deadline, "the chain did not flow");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    chain.away.take().await;
    tokio::time::sleep(scaled.outage).await;
    chain.away.give_back().await;
    let back = Instant::now();
    // The backlog: every payment posted before the return, waiting in the outbox, at the
    // broker, or in the client's retries. Steady load goes on meanwhile.
    let drained = chain.drained(&posts, back, scaled.drain).await;
    tokio::time::sleep_until((back + Duration::from_secs(3)).into()).await;
    stop.store(true, Ordering::Relaxed);
    load.await.unwrap();
    let posts = posts.lock().unwrap().clone();
    let all: Vec<String> = posts.iter().filter_map(accepted).collect();
    let backlog = posts.iter().filter(|p| p.at <= back).count();
    chain
        .applied_all(&all, Instant::now(), Duration::from_secs(10))
        .await;

    // Let a late duplicate, if there were one, show up before counting.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut states = BTreeMap::new();
    let mut charge_ids = Vec::new();
    for id in &all {
        let payment = chain.payment(id).await;
        let status = payment["status"].as_str().unwrap_or("?").to_owned();
        if status != "succeeded" && !states.contains_key(&status) {
            eprintln!("  the first payment {status}: {payment}");
        }
        *states.entry(status).or_insert(0) += 1;
        charge_ids.extend(payment["charge_id"].as_str().map(str::to_owned));
    }
    let (requests, mut keys) = chain.charges().await;
    let charged = keys.len();
    keys.sort();
    keys.dedup();
    let mut applied = chain.applied().await;
    applied.sort();
    let mut expected = all.clone();
    expected.sort();
    let mut statuses = BTreeMap::new();
    for post in &posts {
        let status = post.answer.as_ref().map_or(0, |(status, _)| *status);
        *statuses.entry(status).or_insert(0) += 1;
    }
    let retried = posts.iter().filter(|p| p.retried).count();
    let dead = common::brokers::dead_letters(&chain.broker_url, &chain.ns).await;
    let stats = chain.orders.last_line("consumer stats").unwrap_or_default();
    eprintln!(
        "{outage:?} down {:?} ({kind:?}, {db:?}): POST /payments answered {statuses:?} \
         ({retried} retried); {} accepted ({backlog} posted before the return), {states:?}; {charged} charged ({requests} POST /charges); \
         {} applied; {dead} dead letters; backlog drained {drained:.1?} after the return \
         (bound {:?}); orders' {stats}",
        scaled.outage,
        all.len(),
        applied.len(),
        scaled.drain,
    );

    assert_eq!(
        statuses.keys().collect::<Vec<_>>(),
        [&202],
        "every payment is accepted in the end: {statuses:?}"
    );
    assert_eq!(states.get("succeeded"), Some(&all.len()), "{states:?}");
    assert_eq!(charged, all.len(), "one charge per payment");
    assert_eq!(keys.len(), charged, "a payment charged twice");
    charge_ids.sort();
    charge_ids.dedup();
    assert_eq!(
        charge_ids.len(),
        all.len(),
        "each payment has a charge of its own"
    );
    assert_eq!(applied, expected, "each payment applied exactly once");
    assert_eq!(dead, 0, "dead letters");
    assert!(stats.contains(" dead=0"), "{stats}");
    if outage == Outage::OrdersDb {
        // Its database out of reach, the consumer pauses; no delivery spends an attempt.
        assert!(stats.contains(" retried=0"), "{stats}");
    }
    assert!(
        drained <= scaled.drain,
        "backlog drained {drained:?} after the return, over {:?}",
        scaled.drain
    );
    chain.stop().await;
}

macro_rules! scenarios {
    ($($(#[$attr:meta])* $name:ident => ($($arg:expr),*);)*) => {
        $(
            $(#[$attr])*
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                tokio::time::timeout(Duration::from_secs(150), the_chain_converges_through($($arg),*))
                    .await
                    .expect("bounded to 150 s");
            }
        )*
    };
}

scenarios! {
    #[cfg(feature = "postgres")]
    rabbitmq_postgres_the_chain_converges_through_a_provider_outage => (Outage::Provider, Kind::RabbitMq, Db::Postgres);
    nats_sqlite_the_chain_converges_through_a_provider_outage => (Outage::Provider, Kind::Nats, Db::Sqlite);
    #[cfg(feature = "postgres")]
    nats_postgres_the_chain_converges_through_a_broker_outage => (Outage::Broker, Kind::Nats, Db::Postgres);
    rabbitmq_sqlite_the_chain_converges_through_a_broker_outage => (Outage::Broker, Kind::RabbitMq, Db::Sqlite);
    #[cfg(feature = "postgres")]
    rabbitmq_postgres_the_chain_converges_through_a_payments_database_outage => (Outage::PaymentsDb, Kind::RabbitMq, Db::Postgres);
    #[cfg(feature = "postgres")]
    nats_postgres_the_chain_converges_through_an_orders_database_outage => (Outage::OrdersDb, Kind::Nats, Db::Postgres);
    nats_sqlite_the_chain_converges_through_a_payments_database_outage => (Outage::PaymentsDb, Kind::Nats, Db::Sqlite);
    rabbitmq_sqlite_the_chain_converges_through_an_orders_database_outage => (Outage::OrdersDb, Kind::RabbitMq, Db::Sqlite);
    #[cfg(feature = "mysql")]
    rabbitmq_mariadb_the_chain_converges_through_a_provider_outage => (Outage::Provider, Kind::RabbitMq, Db::Mariadb);
    #[cfg(feature = "mysql")]
    nats_mariadb_the_chain_converges_through_a_broker_outage => (Outage::Broker, Kind::Nats, Db::Mariadb);
    #[cfg(feature = "mysql")]
    nats_mariadb_the_chain_converges_through_a_payments_database_outage => (Outage::PaymentsDb, Kind::Nats, Db::Mariadb);
    #[cfg(feature = "mysql")]
    rabbitmq_mariadb_the_chain_converges_through_an_orders_database_outage => (Outage::OrdersDb, Kind::RabbitMq, Db::Mariadb);
}
