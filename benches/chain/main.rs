//! The outbox relay against the rate the payments example accepts payments, and the backlog a
//! broker outage leaves: `cargo bench --bench chain --all-features`.
//!
//! The chain is the one users deploy: `examples/payments.rs` (each `POST /payments` a `202`
//! and an outbox message in the request's transaction), its dispatcher charging
//! `examples/payment_provider.rs` over HTTP and then publishing a "payment succeeded" event to
//! RabbitMQ or NATS JetStream through the same outbox. Both examples run as processes, built by
//! the bench with its own profile and features (`CHAIN_BENCH_BUILD=0` skips that).
//!
//! For each database and broker:
//!
//! 1. **Accept**: payments with no dispatcher (`DISPATCHERS=0`), so the outbox only fills,
//!    and `CHAIN_BENCH_CONNECTIONS` clients (default 32) posting new payments back to back:
//!    the payments accepted per second after a second of warm-up, over
//!    `CHAIN_BENCH_ACCEPT_SECS` (default 10).
//! 2. **Relay**: payments started again on that backlog with `CHAIN_BENCH_DISPATCHERS`
//!    dispatchers (default 1, the example's) and no new load: the backlog's payments per
//!    second until every charge and every event is delivered, counted in the outbox and
//!    checked at the broker. The figure is relay / accept.
//! 3. **Outage** (skipped when `CHAIN_BENCH_OUTAGE_SECS` is 0; default 600): a fresh outbox
//!    under a steady load of `CHAIN_BENCH_LOAD_FRACTION` (default 0.1) of the accept rate
//!    measured in step 1 (a load the relay outruns while it competes with the load for the
//!    machine: at 0.25 on two cores it did not, and no backlog drained), the broker reached through a proxy of the bench's own. After
//!    `CHAIN_BENCH_STEADY_SECS` (default 20) of steady state, the proxy cuts the broker off for
//!    `CHAIN_BENCH_OUTAGE_SECS`, then restores it while the load goes on: the backlog (pending
//!    messages) at the broker's return, and the time until it is back to the steady state's
//!    largest (bounded by `CHAIN_BENCH_DRAIN_LIMIT_SECS`, default twice the outage plus 60 s).
//!
//! `CHAIN_BENCH_STORES` (default `postgres,sqlite`; PostgreSQL needs the `postgres` feature,
//! `TEST_POSTGRES_URL`, default `postgres://postgres@127.0.0.1:5432/test`, in a schema of the
//! run's own) and `CHAIN_BENCH_BROKERS` (default `rabbitmq,nats`, the machine's brokers on
//! their default ports, under names of the run's own) choose the combinations.

mod apps;
mod load;
mod proxy;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use apps::{Counts, Database, Events, Process};
use load::Load;
use proxy::Proxy;

struct Settings {
    stores: Vec<String>,
    brokers: Vec<String>,
    connections: usize,
    accept: Duration,
    dispatchers: usize,
    outage: Duration,
    load_fraction: f64,
    steady: Duration,
    drain_limit: Duration,
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn list(name: &str, default: &str) -> Vec<String> {
    std::env::var(name)
        .unwrap_or_else(|_| default.into())
        .split(',')
        .map(|s| s.trim().to_lowercase())
        .filter(|s| !s.is_empty())
        .collect()
}

impl Settings {
    fn from_env() -> Self {
        let outage = Duration::from_secs(env_or("CHAIN_BENCH_OUTAGE_SECS", 600));
        Self {
            stores: list("CHAIN_BENCH_STORES", "postgres,sqlite"),
            brokers: list("CHAIN_BENCH_BROKERS", "rabbitmq,nats"),
            connections: env_or("CHAIN_BENCH_CONNECTIONS", 32),
            accept: Duration::from_secs(env_or("CHAIN_BENCH_ACCEPT_SECS", 10)),
            dispatchers: env_or("CHAIN_BENCH_DISPATCHERS", 1),
            outage,
            load_fraction: env_or("CHAIN_BENCH_LOAD_FRACTION", 0.1),
            steady: Duration::from_secs(env_or("CHAIN_BENCH_STEADY_SECS", 20)),
            drain_limit: Duration::from_secs(env_or(
                "CHAIN_BENCH_DRAIN_LIMIT_SECS",
                outage.as_secs() * 2 + 60,
            )),
        }
    }
}

/// One combination's names, processes and database.
struct Run {
    ns: String,
    broker: String,
    db: Database,
    provider: Process,
    _dir: tempfile::TempDir,
}

impl Run {
    async fn new(store: &str, broker: &str, step: &str) -> Self {
        let ns = format!("chain{}{store}{broker}{step}", std::process::id());
        let dir = tempfile::tempdir().expect("tempdir");
        let provider_db = dir.path().join("provider.db").display().to_string();
        let provider = Process::start(
            "payment_provider",
            &[("PROVIDER_DATABASE", provider_db.as_str())],
        )
        .await;
        Self {
            db: Database::new(store, &ns).await,
            ns,
            broker: broker.to_owned(),
            provider,
            _dir: dir,
        }
    }

    /// Payments on this run's database, provider and namespace, with `dispatchers`, its
    /// broker at `broker_url`.
    async fn payments(&self, broker_url: &str, dispatchers: usize) -> Process {
        let dispatchers = dispatchers.to_string();
        Process::start(
            "payments",
            &[
                ("DATABASE_URL", self.db.url()),
                ("PROVIDER_URL", &self.provider.url),
                ("BROKER_URL", broker_url),
                ("BROKER_NAMESPACE", &self.ns),
                ("DISPATCHERS", &dispatchers),
            ],
        )
        .await
    }

    fn upstream(&self) -> std::net::SocketAddr {
        let port = if self.broker == "rabbitmq" {
            5672
        } else {
            4222
        };
        std::net::SocketAddr::from(([127, 0, 0, 1], port))
    }

    fn broker_url(&self, addr: std::net::SocketAddr) -> String {
        if self.broker == "rabbitmq" {
            format!("amqp://guest:guest@{addr}/%2f")
        } else {
            format!("nats://{addr}")
        }
    }

    async fn cleanup(self, events: Events) {
        events.cleanup().await;
        self.db.cleanup().await;
    }
}

/// Polls the outbox until `done` holds of its counts or `limit` passes: when it held, if it did.
async fn until(
    db: &mut Database,
    since: Instant,
    limit: Duration,
    mut done: impl FnMut(&Counts) -> bool,
) -> Option<Duration> {
    loop {
        let counts = db.counts().await;
        if done(&counts) {
            return Some(since.elapsed());
        }
        if since.elapsed() > limit {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn seconds(time: Option<Duration>) -> String {
    time.map_or("not within the limit".into(), |t| {
        format!("{:.1} s", t.as_secs_f64())
    })
}

/// Steps 1 and 2; returns the accept rate.
async fn accept_and_relay(settings: &Settings, store: &str, broker: &str) -> f64 {
    let mut run = Run::new(store, broker, "r").await;
    let direct = run.broker_url(run.upstream());
    let payments = run.payments(&direct, 0).await;
    let events = Events::watch(broker, &run.ns).await;
    let load = Load::new(&payments.url, &run.ns);
    let warmup = Duration::from_secs(1);
    let accept = load
        .saturate(settings.connections, warmup, settings.accept)
        .await;
    payments.stop().await;
    let backlog = load.tally.accepted.load(Ordering::Relaxed);
    let refused = load.tally.refused.load(Ordering::Relaxed);
    let before = run.db.counts().await;

    let started = Instant::now();
    let payments = run.payments(&direct, settings.dispatchers).await;
    let limit = Duration::from_secs(600);
    // The relay has begun once the first charge left the pending rows (an event is enqueued
    // only when its charge is delivered, so no pending row at all means every event is out).
    let charged = until(&mut run.db, started, limit, |c| {
        c.pending_charges == 0 || c.failed > 0
    })
    .await;
    let delivered = until(&mut run.db, started, limit, |c| {
        c.pending == 0 || c.failed > 0
    })
    .await;
    let after = run.db.counts().await;
    let (charges, events_delivered) = run.db.delivered().await;
    assert_eq!(
        (charges, events_delivered),
        (backlog, backlog),
        "every payment relayed once"
    );
    let at_broker = events.count().await;
    payments.stop().await;
    let relay = delivered.map_or(0.0, |t| backlog as f64 / t.as_secs_f64());
    println!(
        "{store:<8} {broker:<8} accept {accept:>6.0} payments/s ({} connections, {} s after 1 s of \
         warm-up; {backlog} accepted in all, {refused} not, {} pending in the outbox)",
        settings.connections,
        settings.accept.as_secs(),
        before.pending,
    );
    println!(
        "{store:<8} {broker:<8} relay  {relay:>6.0} payments/s ({} dispatcher(s): every charge \
         delivered after {}, every event after {}; {} events at the broker, {} failed)  \
         relay / accept {:.2}",
        settings.dispatchers,
        seconds(charged),
        seconds(delivered),
        at_broker,
        after.failed,
        relay / accept,
    );
    run.cleanup(events).await;
    accept
}

/// Step 3.
async fn outage(settings: &Settings, store: &str, broker: &str, accept: f64) {
    let mut run = Run::new(store, broker, "o").await;
    let proxy = Proxy::start(run.upstream()).await;
    let payments = run
        .payments(&run.broker_url(proxy.addr), settings.dispatchers)
        .await;
    let events = Events::watch(broker, &run.ns).await;
    let load = Load::new(&payments.url, &run.ns);
    let rate = accept * settings.load_fraction;
    let (stop, loading) = load.paced(rate, settings.connections);

    let steady_end = Instant::now() + settings.steady;
    let (mut steady_max, mut samples, mut steady_sum) = (0, 0, 0);
    while Instant::now() < steady_end {
        let pending = run.db.counts().await.pending;
        steady_max = steady_max.max(pending);
        steady_sum += pending;
        samples += 1;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let steady_accepted = load.tally.accepted.load(Ordering::Relaxed);

    proxy.cut();
    let cut = Instant::now();
    let mut next_report = Duration::from_secs(60);
    while cut.elapsed() < settings.outage {
        tokio::time::sleep(Duration::from_millis(500)).await;
        if cut.elapsed() >= next_report {
            let counts = run.db.counts().await;
            eprintln!(
                "{store} {broker}: {} s into the outage, {} pending",
                next_report.as_secs(),
                counts.pending
            );
            next_report += Duration::from_secs(60);
        }
    }
    let at_return = run.db.counts().await;
    proxy.restore();
    let restored = Instant::now();
    let (_, events_then) = run.db.delivered().await;
    let pending_then = at_return.pending;
    let first_event = until(&mut run.db, restored, settings.drain_limit, |c| {
        c.pending < pending_then
    })
    .await;
    let mut next_report = Duration::from_secs(5);
    let drained = until(&mut run.db, restored, settings.drain_limit, |c| {
        if restored.elapsed() >= next_report {
            eprintln!(
                "{store} {broker}: {} s after the return, {} pending",
                next_report.as_secs(),
                c.pending,
            );
            next_report += Duration::from_secs(5);
        }
        c.pending <= steady_max
    })
    .await;

    let _ = stop.send(true);
    let _ = loading.await;
    let accepted = load.tally.accepted.load(Ordering::Relaxed);
    let all = until(&mut run.db, Instant::now(), Duration::from_secs(120), |c| {
        c.pending == 0
    })
    .await;
    let end = run.db.counts().await;
    let (end_charges, end_events) = run.db.delivered().await;
    let at_broker = events.count().await;
    payments.stop().await;
    println!(
        "{store:<8} {broker:<8} outage: load {rate:.0} payments/s ({} of accept; {} accepted in the \
         {} s of steady state, pending then {:.0} on average, {steady_max} at most)",
        settings.load_fraction,
        steady_accepted,
        settings.steady.as_secs(),
        steady_sum as f64 / f64::from(samples.max(1)),
    );
    println!(
        "{store:<8} {broker:<8} outage: broker cut for {} s; at its return {} pending ({} events \
         delivered by then); the pending rows first fell {} after the return; backlog back to \
         {steady_max} pending {} after the return",
        settings.outage.as_secs(),
        at_return.pending,
        events_then,
        seconds(first_event),
        seconds(drained),
    );
    println!(
        "{store:<8} {broker:<8} outage: {accepted} accepted in all ({} not, {} ticks late), \
         all delivered {} after the load stopped; {} charges and {} events delivered, {} events \
         at the broker, {} failed",
        load.tally.refused.load(Ordering::Relaxed),
        load.tally.late.load(Ordering::Relaxed),
        seconds(all),
        end_charges,
        end_events,
        at_broker,
        end.failed,
    );
    run.cleanup(events).await;
}

#[tokio::main]
async fn main() {
    // `cargo test --benches` runs this with `--bench`-less arguments; only a real bench run
    // measures.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let settings = Settings::from_env();
    apps::build_examples();
    for store in &settings.stores {
        for broker in &settings.brokers {
            let accept = accept_and_relay(&settings, store, broker).await;
            if !settings.outage.is_zero() {
                outage(&settings, store, broker, accept).await;
            }
        }
    }
}
