//! The payments → broker → orders chain as real processes, recovering from the loss of one
//! link, with the time it takes measured and bounded by 30 s.
//!
//! - `payments` killed with SIGKILL while its charges are in flight, behind a proxy that drops
//!   half the provider's answers, then started again: its outbox leases run out (15 s by
//!   default), each charge is looked up before any resend, and every payment is charged once
//!   and applied once (on the machine's brokers, with broker names of the test's own).
//! - A private broker (a `nats-server` with JetStream, a RabbitMQ node of the test's own, never
//!   the machine's shared ones) stopped and started again on the same port and data while
//!   payments are posted: orders' consumer and payments' outbox sender reconnect by
//!   themselves, and every payment is still charged once and applied once.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::brokers::{PrivateNats, PrivateRabbitMq};
use common::example_db::{Db, ExampleDatabase as Database};
use common::process::{Http, Process};
use http::{Request, StatusCode};
use http_body_util::Full;
use serde_json::json;

/// The bound: the chain shows every payment within this long of the restart.
const CONVERGENCE: Duration = Duration::from_secs(30);

#[derive(Clone, Copy, Debug)]
enum Kind {
    RabbitMq,
    Nats,
}

/// A namespace for the test's broker names (`BROKER_NAMESPACE`), unique on a shared broker.
fn namespace() -> String {
    common::unique("t").replace('_', "x")
}

/// The three processes of the chain and what they run on.
struct Chain {
    dir: tempfile::TempDir,
    http: Http,
    broker_url: String,
    ns: String,
    provider: Process,
    /// What payments calls the provider through: the provider itself, or a lossy proxy.
    provider_url: String,
    payments_db: Database,
    orders_db: Database,
    payments: Option<Process>,
    orders: Process,
    order_id: i64,
}

impl Chain {
    /// Starts the provider (with `provider_env`), orders and payments, and places the order
    /// every payment will be for. `lossy` puts a proxy dropping half the provider's answers
    /// between payments and the provider.
    async fn start(broker_url: String, db: Db, provider_env: &[(&str, &str)], lossy: bool) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let ns = namespace();
        let provider_db = dir.path().join("provider.db").display().to_string();
        let mut env = vec![("PROVIDER_DATABASE", provider_db.as_str())];
        env.extend_from_slice(provider_env);
        let provider = Process::start("payment_provider", &env).await;
        let provider_url = if lossy {
            let upstream = provider.url.trim_start_matches("http://").parse().unwrap();
            let (proxy, _) = common::lossy::spawn_lossy_proxy(upstream, 50).await;
            format!("http://{proxy}")
        } else {
            provider.url.clone()
        };
        let payments_db = Database::new(db).await;
        let orders_db = Database::new(db).await;
        let orders = Process::start(
            "orders",
            &[
                ("DATABASE_URL", &orders_db.url),
                ("BROKER_URL", &broker_url),
                ("BROKER_NAMESPACE", &ns),
                ("ORDERS_CONSUMER_STATS_MS", "200"),
            ],
        )
        .await;
        let mut chain = Self {
            dir,
            http: Http::new(),
            broker_url,
            ns,
            provider,
            provider_url,
            payments_db,
            orders_db,
            payments: None,
            orders,
            order_id: 0,
        };
        chain.payments = Some(chain.start_payments().await);
        chain.order_id = chain.place_order().await;
        chain
    }

    /// Starts payments on the chain's database, with the example's default outbox settings
    /// (a 15 s lease, a 10 s lookup grace) except a shorter poll.
    async fn start_payments(&self) -> Process {
        Process::start(
            "payments",
            &[
                ("DATABASE_URL", &self.payments_db.url),
                ("PROVIDER_URL", &self.provider_url),
                ("BROKER_URL", &self.broker_url),
                ("BROKER_NAMESPACE", &self.ns),
                ("OUTBOX_POLL_MS", "100"),
            ],
        )
        .await
    }

    fn payments_url(&self) -> String {
        self.payments.as_ref().expect("payments runs").url.clone()
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
        assert_eq!(answer.status, StatusCode::CREATED);
        answer.json()["id"].as_i64().unwrap()
    }

    /// The payment ids applied to the order, as many times as each was applied.
    async fn applied(&self) -> Vec<String> {
        let request = Request::get(format!("{}/orders/{}", self.orders.url, self.order_id))
            .header("authorization", "Bearer alice-token")
            .body(Full::new(Bytes::new()))
            .unwrap();
        let Ok(answer) = self.http.try_call(request).await else {
            return Vec::new();
        };
        let order = answer.json();
        order["payments"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| p["payment_id"].as_str().map(str::to_owned))
            .collect()
    }

    /// A payment as payments shows it (status, and the reason of a failure), for diagnosis.
    async fn payment(&self, id: &str) -> String {
        let Some(payments) = &self.payments else {
            return "payments is not running".into();
        };
        let request = Request::get(format!("{}/payments/{id}", payments.url))
            .header("authorization", "Bearer alice-token")
            .body(Full::new(Bytes::new()))
            .unwrap();
        match self.http.try_call(request).await {
            Ok(answer) => String::from_utf8_lossy(&answer.body).into_owned(),
            Err(error) => error,
        }
    }

    /// How many charge requests the provider received, and how many charges it made.
    async fn provider_counts(&self) -> (u64, u64) {
        let request = Request::get(format!("{}/admin/charges", self.provider.url))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let listed = self.http.call(request).await.json();
        let count = |field: &str| listed[field].as_u64().unwrap_or_default();
        (count("posts"), count("count"))
    }

    /// Charges at the provider, by idempotency key.
    async fn charges(&self) -> HashMap<String, usize> {
        let request = Request::get(format!("{}/admin/charges", self.provider.url))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let listed = self.http.call(request).await.json();
        let mut keys = HashMap::new();
        for charge in listed["charges"].as_array().unwrap() {
            let key = charge["idempotency_key"].as_str().unwrap_or_default();
            *keys.entry(key.to_owned()).or_insert(0) += 1;
        }
        assert_eq!(
            listed["count"].as_u64(),
            Some(keys.values().sum::<usize>() as u64)
        );
        keys
    }

    /// Waits (at most `CONVERGENCE` plus a margin, to measure a miss) until every payment in
    /// `created` is applied; returns how long that took from `since`.
    async fn converged(&self, created: &[String], since: Instant) -> Duration {
        let deadline = since + CONVERGENCE + Duration::from_secs(15);
        loop {
            let applied = self.applied().await;
            if created.iter().all(|id| applied.contains(id)) {
                return since.elapsed();
            }
            if Instant::now() >= deadline {
                let mut states = Vec::new();
                for id in created {
                    states.push(self.payment(id).await);
                }
                panic!(
                    "not converged: {} of {} payments applied; payments: {states:?}",
                    applied.len(),
                    created.len()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Every payment charged once and applied once: nothing lost, nothing twice.
    async fn assert_exactly_once(&self, created: &[String]) {
        // Let a late duplicate, if there were one, show up before counting.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let charges = self.charges().await;
        assert_eq!(charges.len(), created.len(), "charges: {charges:?}");
        assert!(
            charges.values().all(|n| *n == 1),
            "charged twice: {charges:?}"
        );
        let mut applied = self.applied().await;
        applied.sort();
        let mut expected = created.to_vec();
        expected.sort();
        assert_eq!(applied, expected, "each payment applied exactly once");
    }

    async fn stop(self, shared_broker: bool) {
        self.orders.kill().await;
        if let Some(payments) = self.payments {
            payments.kill().await;
        }
        self.provider.kill().await;
        if shared_broker {
            common::brokers::delete_namespace(&self.broker_url, &self.ns).await;
        }
        self.payments_db.cleanup().await;
        self.orders_db.cleanup().await;
        drop(self.dir);
    }
}

/// Posts one payment of 12.5 for `order_id` under `key`; the status, and the payment's id
/// when accepted.
async fn pay(
    http: &Http,
    payments: &str,
    key: &str,
    order_id: i64,
) -> Result<(u16, Option<String>), String> {
    let body = json!({ "order_id": order_id, "amount": 12.5, "currency": "EUR", "payee": "acme" });
    let request = Request::post(format!("{payments}/payments"))
        .header("authorization", "Bearer alice-token")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let answer = http.try_call(request).await?;
    let id = (answer.status == StatusCode::ACCEPTED)
        .then(|| answer.json()["id"].as_i64().map(|id| id.to_string()))
        .flatten();
    Ok((answer.status.as_u16(), id))
}

// ---------------------------------------------------------------------------------------------

/// SIGKILL while charges are in flight (each takes the provider 1.5 s; half the answers are
/// dropped on the way back), then a restart on the same database: within 30 s of the restart
/// every payment is charged once at the provider and applied once in orders.
async fn payments_killed_mid_charge_converges_within_30_s_of_its_restart(kind: Kind, db: Db) {
    let url = match kind {
        Kind::RabbitMq => common::rabbitmq::URL,
        Kind::Nats => common::nats::URL,
    };
    let provider_env = [("FAULT_LATENCY_MS", "1500"), ("FAULT_LATENCY_RATE", "1")];
    let mut chain = Chain::start(url.to_owned(), db, &provider_env, true).await;
    let mut created = Vec::new();
    for n in 0..8 {
        let key = format!("{}-pay-{n}", chain.ns);
        let (status, id) = pay(&chain.http, &chain.payments_url(), &key, chain.order_id)
            .await
            .expect("payments answers");
        assert_eq!(status, 202);
        created.push(id.expect("an accepted payment has an id"));
    }
    // Killed while at least three charges are at the provider, received and not yet made
    // (each takes it 1.5 s): their messages are leased by the process that dies, so the
    // restart must wait out the leases and look each charge up before any resend.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut in_flight = 0;
    while in_flight < 3 {
        assert!(
            Instant::now() < deadline,
            "the charges did not reach the provider"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
        let (received, made) = chain.provider_counts().await;
        in_flight = received.saturating_sub(made);
    }
    chain.payments.take().expect("payments runs").kill().await;
    let charged_before = chain.charges().await.len();
    let applied_before = chain.applied().await.len();

    chain.payments = Some(chain.start_payments().await);
    let restarted = Instant::now();
    let recovery = chain.converged(&created, restarted).await;
    eprintln!(
        "payments SIGKILLed mid-charge ({kind:?}, {db:?}): {in_flight} charges in flight, \
         {charged_before} of {} charged and {applied_before} applied at the kill; the chain \
         converged {recovery:.1?} after the restart",
        created.len()
    );
    chain.assert_exactly_once(&created).await;
    assert!(
        recovery <= CONVERGENCE,
        "converged {recovery:?} after the restart, over {CONVERGENCE:?}"
    );
    chain.stop(true).await;
}

/// A private broker to restart.
enum Private {
    Nats(PrivateNats),
    RabbitMq(PrivateRabbitMq),
}

impl Private {
    async fn start(kind: Kind) -> Self {
        match kind {
            Kind::Nats => Self::Nats(PrivateNats::start().await),
            Kind::RabbitMq => Self::RabbitMq(PrivateRabbitMq::start().await),
        }
    }

    fn url(&self) -> String {
        match self {
            Self::Nats(nats) => nats.url(),
            Self::RabbitMq(rabbit) => rabbit.url(),
        }
    }

    async fn stop(&mut self) {
        match self {
            Self::Nats(nats) => nats.stop().await,
            Self::RabbitMq(rabbit) => rabbit.stop().await,
        }
    }

    async fn start_again(&mut self) {
        match self {
            Self::Nats(nats) => nats.start_again().await,
            Self::RabbitMq(rabbit) => rabbit.start_again().await,
        }
    }
}

/// What the load saw: each answer's status (0 for no answer) and the payments accepted.
#[derive(Default)]
struct Load {
    statuses: BTreeMap<u16, usize>,
    created: Vec<String>,
}

/// The warnings a process logged, by message (fields left out), with their counts.
fn warnings(process: &Process) -> BTreeMap<String, usize> {
    let mut seen = BTreeMap::new();
    for line in process.output.lock().unwrap().iter() {
        let line = strip_colours(line);
        if let Some((_, rest)) = line.split_once(" WARN ") {
            // `target: message field=…`: the message, up to its first field.
            let message = rest.split_once(": ").map_or(rest, |(_, m)| m);
            let words = message.split(' ').take_while(|word| !word.contains('='));
            let message = words.collect::<Vec<_>>().join(" ");
            *seen.entry(message).or_insert(0) += 1;
        }
    }
    seen
}

/// The line without the terminal colour codes tracing's formatter puts around levels.
fn strip_colours(line: &str) -> String {
    let mut plain = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // An escape sequence runs to its final letter (`m` for colours).
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            plain.push(c);
        }
    }
    plain
}

/// Payments posted one after another, every 50 ms, until `stop` is set.
fn post_payments(chain: &Chain, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<Load> {
    let (payments, ns, order_id) = (chain.payments_url(), chain.ns.clone(), chain.order_id);
    tokio::spawn(async move {
        let http = Http::new();
        let mut load = Load::default();
        let mut n = 0;
        while !stop.load(Ordering::Relaxed) {
            n += 1;
            let answer = pay(&http, &payments, &format!("{ns}-load-{n}"), order_id).await;
            match answer {
                Ok((status, id)) => {
                    *load.statuses.entry(status).or_insert(0) += 1;
                    load.created.extend(id);
                }
                Err(_) => *load.statuses.entry(0).or_insert(0) += 1,
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        load
    })
}

/// Payments posted throughout; the broker stopped for 3 s, then started again on the same
/// port and data. Orders and payments keep running (they reconnect by themselves), and
/// within 30 s of the broker's return every payment is charged once and applied once.
async fn a_restarted_broker_is_waited_out_and_the_chain_converges_within_30_s(kind: Kind) {
    let mut broker = Private::start(kind).await;
    let mut chain = Chain::start(broker.url(), Db::Sqlite, &[], false).await;
    let stop = Arc::new(AtomicBool::new(false));
    let load = post_payments(&chain, Arc::clone(&stop));
    // Flowing before the outage: some payments applied already.
    let deadline = Instant::now() + Duration::from_secs(20);
    while chain.applied().await.len() < 5 {
        assert!(
            Instant::now() < deadline,
            "the chain did not flow before the restart"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let down = Instant::now();
    broker.stop().await;
    let stopping = down.elapsed();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let starting = Instant::now();
    broker.start_again().await;
    let back = Instant::now();
    let (outage, starting) = (back - down, back - starting);
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::Relaxed);
    let load = load.await.unwrap();
    let convergence = chain.converged(&load.created, back).await;

    eprintln!(
        "{kind:?} restarted under load: down {outage:.1?} (stopping {stopping:.1?}, 3 s, \
         starting {starting:.1?}); POST /payments \
         answers {:?}; {} payments; converged {convergence:.1?} after the broker's return",
        load.statuses,
        load.created.len()
    );
    eprintln!(
        "  warnings: orders {:?}; payments {:?}",
        warnings(&chain.orders),
        chain.payments.as_ref().map(warnings)
    );
    let payments_alive = chain.payments.as_mut().is_some_and(|p| !p.has_exited());
    assert!(payments_alive, "payments exited");
    assert!(
        !chain.orders.has_exited(),
        "orders exited instead of reconnecting"
    );
    // Accepting a payment needs no broker: every post was accepted, outage or not.
    assert_eq!(
        load.statuses.keys().collect::<Vec<_>>(),
        [&202],
        "{:?}",
        load.statuses
    );
    chain.assert_exactly_once(&load.created).await;
    let stats = chain.orders.last_line("consumer stats").unwrap_or_default();
    eprintln!("  orders' {stats}");
    assert!(
        convergence <= CONVERGENCE,
        "converged {convergence:?} after the broker's return, over {CONVERGENCE:?}"
    );
    chain.stop(false).await;
    broker.stop().await;
}

macro_rules! bounded {
    ($scenario:ident: $($name:ident => ($($arg:expr),*);)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                tokio::time::timeout(Duration::from_secs(150), $scenario($($arg),*))
                    .await
                    .expect("bounded to 150 s");
            }
        )*
    };
}

bounded! { payments_killed_mid_charge_converges_within_30_s_of_its_restart:
    rabbitmq_sqlite_payments_killed_mid_charge_converges_within_30_s => (Kind::RabbitMq, Db::Sqlite);
    nats_sqlite_payments_killed_mid_charge_converges_within_30_s => (Kind::Nats, Db::Sqlite);
}
#[cfg(feature = "postgres")]
bounded! { payments_killed_mid_charge_converges_within_30_s_of_its_restart:
    rabbitmq_postgres_payments_killed_mid_charge_converges_within_30_s => (Kind::RabbitMq, Db::Postgres);
    nats_postgres_payments_killed_mid_charge_converges_within_30_s => (Kind::Nats, Db::Postgres);
}
bounded! { a_restarted_broker_is_waited_out_and_the_chain_converges_within_30_s:
    a_restarted_nats_server_is_waited_out_and_the_chain_converges_within_30_s => (Kind::Nats);
    a_restarted_rabbitmq_node_is_waited_out_and_the_chain_converges_within_30_s => (Kind::RabbitMq);
}
