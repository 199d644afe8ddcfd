//! The outbox relay against the rate the payments example accepts payments, and the backlog a
//! broker outage leaves: `cargo bench --bench chain --all-features`.
//!
//! The chain is the one users deploy: `examples/chain/payments.rs` (each `POST /payments` a `202`
//! and an outbox message in the request's transaction), its dispatcher charging
//! `examples/chain/payment_provider.rs` over HTTP and then publishing a "payment succeeded" event to
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
//!    checked at the broker. The figure is relay / accept, target ≥ 3. Where the relay's time
//!    goes is printed beside it: the CPU time per payment of payments, the provider, the
//!    PostgreSQL backends serving payments, the broker, the bench and the whole machine, and
//!    the outbox rows written per payment (PostgreSQL's table statistics).
//! 3. **Outage**, off by default (it lasts the outage and more): `CHAIN_BENCH_OUTAGE_SECS=600`
//!    runs the contract's 10 minutes, of the broker or, with `CHAIN_BENCH_OUTAGE_OF=provider`,
//!    of the provider; `CHAIN_BENCH_OUTAGE_OF=payments-db` or `orders-db` with
//!    `CHAIN_BENCH_OUTAGE_SECS=120` runs the contract's 2 minutes of one app's database
//!    (PostgreSQL: its connections through the proxy, dropped and refused; SQLite: its write
//!    lock held by a connection of the bench's own). The whole chain: the orders example too,
//!    consuming the events into a database of its own, with the payments spread over 16 orders.
//!    A fresh outbox under a steady load of `CHAIN_BENCH_LOAD_FRACTION` (default 0.1) of the
//!    accept rate measured in step 1 (a load the relay outruns while it competes with the load
//!    for the machine: at 0.25 on two cores it did not, and no backlog drained), both apps
//!    reaching the broker (or payments reaching the provider, or an app its database) through a
//!    proxy of the bench's own. After `CHAIN_BENCH_STEADY_SECS` (default 20) of steady state,
//!    the proxy cuts that dependency off for `CHAIN_BENCH_OUTAGE_SECS`, then restores it while
//!    the load goes on. Printed: the backlog (pending outbox messages, and accepted payments
//!    not yet applied in orders) at its peak and at the return; the time until the dispatcher's
//!    first event after the return reaches the broker, until every message the outbox held at
//!    the return is delivered, and until every payment accepted before the return is applied
//!    (target: both within 60 s), and for comparison until the outbox is back to its steady
//!    state's largest backlog (looked at every 5 s), each bounded by
//!    `CHAIN_BENCH_DRAIN_LIMIT_SECS` (default twice the outage plus 60 s); then, with the load
//!    stopped and everything delivered, the payments failed, the provider's charges and their
//!    distinct keys, and orders' applied rows and distinct payments (charged once and applied
//!    once when all of these match the accepted count).
//!
//! The examples log at `CHAIN_BENCH_LOG` (their `RUST_LOG`; default `error`).
//!
//! `CHAIN_BENCH_STORES` (default `postgres,sqlite`; PostgreSQL needs the `postgres` feature,
//! `TEST_POSTGRES_URL`, default `postgres://postgres@127.0.0.1:5432/test`, in a schema of the
//! run's own) and `CHAIN_BENCH_BROKERS` (default `rabbitmq,nats`, the machine's brokers on
//! their default ports, under names of the run's own) choose the combinations.

mod apps;
mod cpu;
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
    outage_of: Dependency,
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
        let outage = Duration::from_secs(env_or("CHAIN_BENCH_OUTAGE_SECS", 0));
        Self {
            stores: list("CHAIN_BENCH_STORES", "postgres,sqlite"),
            brokers: list("CHAIN_BENCH_BROKERS", "rabbitmq,nats"),
            connections: env_or("CHAIN_BENCH_CONNECTIONS", 32),
            accept: Duration::from_secs(env_or("CHAIN_BENCH_ACCEPT_SECS", 10)),
            dispatchers: env_or("CHAIN_BENCH_DISPATCHERS", 1),
            outage,
            outage_of: match std::env::var("CHAIN_BENCH_OUTAGE_OF").as_deref() {
                Ok("provider") => Dependency::Provider,
                Ok("payments-db") => Dependency::PaymentsDb,
                Ok("orders-db") => Dependency::OrdersDb,
                _ => Dependency::Broker,
            },
            load_fraction: env_or("CHAIN_BENCH_LOAD_FRACTION", 0.1),
            steady: Duration::from_secs(env_or("CHAIN_BENCH_STEADY_SECS", 20)),
            drain_limit: Duration::from_secs(env_or(
                "CHAIN_BENCH_DRAIN_LIMIT_SECS",
                outage.as_secs() * 2 + 60,
            )),
        }
    }
}

/// What the outage cuts off.
#[derive(Clone, Copy)]
enum Dependency {
    /// The broker, for both apps.
    Broker,
    /// The provider, for payments' dispatcher.
    Provider,
    /// The payments database, for payments.
    PaymentsDb,
    /// The orders database, for orders.
    OrdersDb,
}

impl Dependency {
    fn describe(self, store: &str) -> &'static str {
        match (self, store) {
            (Dependency::Broker, _) => "the broker (both apps)",
            (Dependency::Provider, _) => "the provider (payments' dispatcher)",
            (Dependency::PaymentsDb, "sqlite") => "the payments database (its write lock held)",
            (Dependency::PaymentsDb, _) => "the payments database (its connections cut)",
            (Dependency::OrdersDb, "sqlite") => "the orders database (its write lock held)",
            (Dependency::OrdersDb, _) => "the orders database (its connections cut)",
        }
    }
}

/// How the outage step takes a dependency away and gives it back.
enum Cut {
    /// The apps' connections to it run through the bench's proxy.
    Link(Proxy),
    /// An SQLite database, a file with no link to cut: the bench's own connection holds its
    /// write lock meanwhile.
    WriteLock(String, Option<sqlx::SqliteConnection>),
}

impl Cut {
    /// The cut for `db`, and the URL the app reaches it at.
    async fn database(db: &Database) -> (Self, String) {
        match db.server() {
            Some(server) => {
                let proxy = Proxy::start(server).await;
                let url = db.url_via(proxy.addr);
                (Cut::Link(proxy), url)
            }
            None => (
                Cut::WriteLock(db.url().to_owned(), None),
                db.url().to_owned(),
            ),
        }
    }

    async fn cut(&mut self) {
        match self {
            Cut::Link(proxy) => proxy.cut(),
            Cut::WriteLock(url, held) => {
                *held = Some(Database::hold_write_lock_at(url).await);
            }
        }
    }

    async fn restore(&mut self) {
        match self {
            Cut::Link(proxy) => proxy.restore(),
            Cut::WriteLock(_, held) => {
                if let Some(conn) = held.take() {
                    Database::release(conn).await;
                }
            }
        }
    }
}

/// One combination's names, processes and database.
struct Run {
    ns: String,
    broker: String,
    db: Database,
    provider: Process,
    provider_db: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Run {
    async fn new(store: &str, broker: &str, step: &str) -> Self {
        let ns = format!("chain{}{store}{broker}{step}", std::process::id());
        let dir = tempfile::tempdir().expect("tempdir");
        let provider_db = dir.path().join("provider.db");
        let provider = Process::start(
            "payment_provider",
            &[(
                "PROVIDER_DATABASE",
                provider_db.display().to_string().as_str(),
            )],
        )
        .await;
        Self {
            db: Database::new(store, &ns).await,
            ns,
            broker: broker.to_owned(),
            provider,
            provider_db,
            _dir: dir,
        }
    }

    /// Payments on this run's database, provider and namespace, with `dispatchers`, its
    /// broker at `broker_url`.
    async fn payments(&self, broker_url: &str, dispatchers: usize) -> Process {
        self.payments_via(self.db.url(), broker_url, &self.provider.url, dispatchers)
            .await
    }

    /// [`payments`](Self::payments) reaching its database at `db_url` and the provider at
    /// `provider_url`.
    async fn payments_via(
        &self,
        db_url: &str,
        broker_url: &str,
        provider_url: &str,
        dispatchers: usize,
    ) -> Process {
        let dispatchers = dispatchers.to_string();
        Process::start(
            "payments",
            &[
                ("DATABASE_URL", db_url),
                ("PROVIDER_URL", provider_url),
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

/// CPU time of the relay's parts, read at its start and at its end.
struct Profile {
    payments: Duration,
    provider: Duration,
    /// PostgreSQL: its backends serving payments, and the outbox rows inserted, updated,
    /// updated in place (HOT) and deleted. None on SQLite, whose work is in payments' process.
    server: Option<(Duration, [u64; 4])>,
    broker: Duration,
    bench: Duration,
    machine: Duration,
}

impl Profile {
    async fn read(run: &mut Run, payments: &Process) -> Self {
        let broker = if run.broker == "rabbitmq" {
            "beam.smp"
        } else {
            "nats-server"
        };
        Self {
            payments: cpu::of_pids(&payments.pid()),
            provider: cpu::of_pids(&run.provider.pid()),
            server: run.db.server_side().await,
            broker: cpu::of_name(broker),
            bench: cpu::own(),
            machine: cpu::machine().0,
        }
    }

    /// What `payments` payments over `elapsed` cost each part, from `start` to `self`; the
    /// backends of the database are new with each payments process, so their time is all the
    /// step's.
    fn report(&self, start: &Self, payments: u64, elapsed: Duration) -> String {
        let per = |end: Duration, begin: Duration| {
            let used = end.saturating_sub(begin);
            format!(
                "{:.0} µs/payment ({:.0} % of a core)",
                used.as_secs_f64() * 1e6 / payments.max(1) as f64,
                used.as_secs_f64() * 100.0 / elapsed.as_secs_f64()
            )
        };
        let cores = cpu::machine().1;
        let mut report = format!(
            "payments {}; provider {}; broker {}; bench {}; machine {} of {cores} cores",
            per(self.payments, start.payments),
            per(self.provider, start.provider),
            per(self.broker, start.broker),
            per(self.bench, start.bench),
            per(self.machine, start.machine),
        );
        if let (Some((database, end)), Some((_, begin))) = (self.server, start.server) {
            let rows = |i: usize| end[i].saturating_sub(begin[i]) as f64 / payments.max(1) as f64;
            report += &format!(
                "; database backends {}; outbox rows per payment: {:.2} inserted, {:.2} \
                 updated ({:.2} in place, HOT), {:.2} deleted",
                per(database, Duration::ZERO),
                rows(0),
                rows(1),
                rows(2),
                rows(3),
            );
        }
        report
    }
}

/// Steps 1 and 2; returns the accept rate.
async fn accept_and_relay(settings: &Settings, store: &str, broker: &str) -> f64 {
    let mut run = Run::new(store, broker, "r").await;
    let direct = run.broker_url(run.upstream());
    let payments = run.payments(&direct, 0).await;
    let events = Events::watch(broker, &run.ns).await;
    let load = Load::new(&payments.url, &run.ns);
    let warmup = Duration::from_secs(1);
    let accept_start = Profile::read(&mut run, &payments).await;
    let accept = load
        .saturate(settings.connections, warmup, settings.accept)
        .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let accept_end = Profile::read(&mut run, &payments).await;
    payments.stop().await;
    let backlog = load.tally.accepted.load(Ordering::Relaxed);
    let refused = load.tally.refused.load(Ordering::Relaxed);
    let before = run.db.counts().await;
    // The tuple counters start from the accept step's inserts.
    tokio::time::sleep(Duration::from_secs(1)).await;

    let started = Instant::now();
    let payments = run.payments(&direct, settings.dispatchers).await;
    let start = Profile::read(&mut run, &payments).await;
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
    let elapsed = started.elapsed();
    // PostgreSQL publishes a backend's counters within a second of its transaction.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let end = Profile::read(&mut run, &payments).await;
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
        "{store:<8} {broker:<8} accept CPU: {}",
        accept_end.report(&accept_start, backlog, settings.accept + warmup)
    );
    println!(
        "{store:<8} {broker:<8} relay  {relay:>6.0} payments/s ({} dispatcher(s): every charge \
         delivered after {}, every event after {}; {} events at the broker, {} failed)  \
         relay / accept {:.2} (target ≥ 3: {})",
        settings.dispatchers,
        seconds(charged),
        seconds(delivered),
        at_broker,
        after.failed,
        relay / accept,
        if relay / accept >= 3.0 {
            "met"
        } else {
            "MISSED"
        },
    );
    println!(
        "{store:<8} {broker:<8} relay CPU: {}",
        end.report(&start, backlog, elapsed)
    );
    run.cleanup(events).await;
    accept
}

/// One look at the chain: the outbox's pending messages and the payments orders applied.
#[derive(Clone, Copy, Default)]
struct Sample {
    pending: u64,
    /// The pending charges: during a broker outage the provider stays up, so the contract
    /// wants these flowing.
    pending_charges: u64,
    /// Payments accepted and not applied yet, wherever they are (outbox, broker, consumer).
    unapplied: u64,
    /// Payments applied in orders.
    applied: u64,
}

impl Sample {
    /// Each backlog count raised to `now`'s where that is larger: the peak so far.
    fn raise_to(&mut self, now: &Sample) {
        self.pending = self.pending.max(now.pending);
        self.pending_charges = self.pending_charges.max(now.pending_charges);
        self.unapplied = self.unapplied.max(now.unapplied);
    }
}

async fn sample(run: &mut Run, orders_db: &mut Database, load: &Load) -> Sample {
    let accepted = load.tally.accepted.load(Ordering::Relaxed);
    let counts = run.db.counts().await;
    let (_, applied) = orders_db.applied().await;
    Sample {
        pending: counts.pending,
        pending_charges: counts.pending_charges,
        unapplied: accepted.saturating_sub(applied),
        applied,
    }
}

/// How often the outage step counts the whole backlog.
const LOOK: Duration = Duration::from_secs(5);

/// The deliveries orders has applied or dropped as duplicates, from the stats line it prints
/// each second: no query, so it can gate the exact count at every tick. Duplicates count: a
/// commit whose answer an outage cut off is applied, and its redelivery is then a duplicate.
fn processed(orders: &Process) -> u64 {
    orders
        .stats()
        .split_whitespace()
        .filter_map(|field| {
            field
                .strip_prefix("processed=")
                .or_else(|| field.strip_prefix("duplicates="))
        })
        .filter_map(|n| n.parse::<u64>().ok())
        .sum()
}

/// Step 3.
async fn outage(settings: &Settings, store: &str, broker: &str, accept: f64) {
    let mut run = Run::new(store, broker, "o").await;
    let mut orders_db = Database::new(store, &format!("{}ord", run.ns)).await;
    // Each app reaches what the outage does not cut directly; the cut one, through the cut.
    let mut through = run.broker_url(run.upstream());
    let mut provider_url = run.provider.url.clone();
    let mut payments_db_url = run.db.url().to_owned();
    let mut orders_db_url = orders_db.url().to_owned();
    let mut cut = match settings.outage_of {
        // Orders behind the same proxy: the broker is down for both apps.
        Dependency::Broker => {
            let proxy = Proxy::start(run.upstream()).await;
            through = run.broker_url(proxy.addr);
            Cut::Link(proxy)
        }
        Dependency::Provider => {
            let provider = provider_url
                .trim_start_matches("http://")
                .parse()
                .expect("the provider's address");
            let proxy = Proxy::start(provider).await;
            provider_url = format!("http://{}", proxy.addr);
            Cut::Link(proxy)
        }
        Dependency::PaymentsDb => {
            let (cut, url) = Cut::database(&run.db).await;
            payments_db_url = url;
            cut
        }
        Dependency::OrdersDb => {
            let (cut, url) = Cut::database(&orders_db).await;
            orders_db_url = url;
            cut
        }
    };
    let orders = Process::start(
        "orders",
        &[
            ("DATABASE_URL", &orders_db_url),
            ("BROKER_URL", &through),
            ("BROKER_NAMESPACE", &run.ns),
            ("ORDERS_CONSUMER_STATS_MS", "1000"),
        ],
    )
    .await;
    load::place_orders(&orders.url, &run.ns).await;
    let payments = run
        .payments_via(
            &payments_db_url,
            &through,
            &provider_url,
            settings.dispatchers,
        )
        .await;
    let events = Events::watch(broker, &run.ns).await;
    let load = Load::new(&payments.url, &run.ns);
    let rate = accept * settings.load_fraction;
    let (stop, loading) = load.paced(rate, settings.connections);

    let steady_end = Instant::now() + settings.steady;
    let (mut steady_max, mut samples, mut steady_sum) = (Sample::default(), 0, 0);
    while Instant::now() < steady_end {
        let now = sample(&mut run, &mut orders_db, &load).await;
        steady_max.raise_to(&now);
        steady_sum += now.pending;
        samples += 1;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let steady_accepted = load.tally.accepted.load(Ordering::Relaxed);

    cut.cut().await;
    let cut_at = Instant::now();
    let mut peak = Sample::default();
    let mut next_report = Duration::from_secs(60);
    // A look every few seconds: each counts the pending rows, hundreds of thousands by the end,
    // on the database the chain is draining into.
    while cut_at.elapsed() < settings.outage {
        tokio::time::sleep(LOOK.min(settings.outage.saturating_sub(cut_at.elapsed()))).await;
        let now = sample(&mut run, &mut orders_db, &load).await;
        peak.raise_to(&now);
        if cut_at.elapsed() >= next_report {
            eprintln!(
                "{store} {broker}: {} s into the outage, {} pending in the outbox ({} of them \
                 charges), {} accepted payments not applied",
                next_report.as_secs(),
                now.pending,
                now.pending_charges,
                now.unapplied,
            );
            next_report += Duration::from_secs(60);
        }
    }
    let at_return = sample(&mut run, &mut orders_db, &load).await;
    let backlog_last = run.db.last_id().await;
    let charges_then = run.db.charges_up_to(backlog_last).await;
    cut.restore().await;
    let restored = Instant::now();
    let (_, events_then) = run.db.delivered().await;
    let at_broker_then = events.count().await;

    // Drained: every message the outbox held at the return delivered (and, for comparison,
    // the outbox back to its steady state's largest backlog), and every payment accepted
    // before the return applied in orders: those whose charge's id is up to the outbox's last
    // id then. Counting all applied payments would not do: events of payments accepted after
    // the return are handed to the dispatcher at their commit and overtake the backlog.
    //
    // Each tick asks only what is cheap: the broker's count of events, and whether a pending
    // message is left from the return (one index probe). Counting the pending rows and the
    // applied payments scans hundreds of thousands of rows; done at each tick, it took about a
    // core of the database from the drain it measured. So the exact count of applied payments
    // runs once orders' own count of processed deliveries (the stats it prints) could reach
    // it, at most once a second, and a full look every few seconds.
    let (mut resumed, mut relayed, mut backlog_out, mut applied_all) = (None, None, None, None);
    let (mut next_look, mut next_exact) = (Duration::ZERO, Duration::ZERO);
    while restored.elapsed() < settings.drain_limit
        && (backlog_out.is_none() || applied_all.is_none())
    {
        let elapsed = restored.elapsed();
        if resumed.is_none() && events.count().await > at_broker_then {
            resumed = Some(elapsed);
        }
        if backlog_out.is_none() && !run.db.pending_up_to(backlog_last).await {
            backlog_out = Some(restored.elapsed());
        }
        if applied_all.is_none() && processed(&orders) >= charges_then && elapsed >= next_exact {
            next_exact = elapsed + Duration::from_secs(1);
            if orders_db.applied_up_to(backlog_last).await >= charges_then {
                applied_all = Some(restored.elapsed());
            }
        }
        if elapsed >= next_look {
            let now = sample(&mut run, &mut orders_db, &load).await;
            peak.raise_to(&now);
            if relayed.is_none() && now.pending <= steady_max.pending {
                relayed = Some(restored.elapsed());
            }
            eprintln!(
                "{store} {broker}: {} s after the return, {} pending in the outbox ({} of them \
                 charges), {} payments applied in all ({charges_then} accepted before it)",
                elapsed.as_secs(),
                now.pending,
                now.pending_charges,
                now.applied,
            );
            next_look = elapsed + LOOK;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    let _ = stop.send(true);
    let _ = loading.await;
    let accepted = load.tally.accepted.load(Ordering::Relaxed);
    let settled = Instant::now();
    let all = loop {
        if processed(&orders) >= accepted
            && !run.db.pending_up_to(i64::MAX).await
            && orders_db.applied().await.1 >= accepted
        {
            break Some(settled.elapsed());
        }
        if settled.elapsed() > settings.drain_limit {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    // A late duplicate, were there one, has a moment to show.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let end = run.db.counts().await;
    let (end_charges, end_events) = run.db.delivered().await;
    let (charges, charge_keys) = apps::charges(&run.provider_db).await;
    let (applied_rows, applied) = orders_db.applied().await;
    let at_broker = events.count().await;
    let stats = orders.stats();
    payments.stop().await;
    orders.stop().await;
    let within = |t: Option<Duration>| match t {
        Some(t) if t <= Duration::from_secs(60) => "met",
        _ => "MISSED",
    };
    println!(
        "{store:<8} {broker:<8} outage: load {rate:.0} payments/s ({} of accept; {} accepted in the \
         {} s of steady state, pending then {:.0} on average, {} at most ({} charges); {} at \
         most accepted and not applied)",
        settings.load_fraction,
        steady_accepted,
        settings.steady.as_secs(),
        steady_sum as f64 / f64::from(samples.max(1)),
        steady_max.pending,
        steady_max.pending_charges,
        steady_max.unapplied,
    );
    println!(
        "{store:<8} {broker:<8} outage: {} cut for {} s; at its return {} pending in the outbox \
         ({} of them charges) and {} accepted payments not applied ({} events delivered by \
         then); peak {} pending ({} charges), {} not applied",
        settings.outage_of.describe(store),
        settings.outage.as_secs(),
        at_return.pending,
        at_return.pending_charges,
        at_return.unapplied,
        events_then,
        peak.pending,
        peak.pending_charges,
        peak.unapplied,
    );
    println!(
        "{store:<8} {broker:<8} outage: after the return the dispatcher's first event reached \
         the broker after {}; every message pending at the return was delivered after {} \
         (target ≤ 60 s: {}); the outbox was back to its steady state's {} pending after {} \
         (looked at every {} s); the {charges_then} payments accepted before the return were \
         applied after {} (target ≤ 60 s: {})",
        seconds(resumed),
        seconds(backlog_out),
        within(backlog_out),
        steady_max.pending,
        seconds(relayed),
        LOOK.as_secs(),
        seconds(applied_all),
        within(applied_all),
    );
    println!(
        "{store:<8} {broker:<8} outage: {accepted} accepted in all ({} not, {} ticks late), all \
         delivered and applied {} after the load stopped; {} failed in the outbox; {charges} \
         charges for {charge_keys} payments at the provider ({end_charges} charges delivered); \
         {end_events} events delivered, {at_broker} at the broker; {applied_rows} applied for \
         {applied} payments in orders; orders' {stats}",
        load.tally.refused.load(Ordering::Relaxed),
        load.tally.late.load(Ordering::Relaxed),
        seconds(all),
        end.failed,
    );
    orders_db.cleanup().await;
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
