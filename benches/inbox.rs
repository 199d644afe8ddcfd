//! Throughput of the inbox consumer against a hand-written dedupe consumer, on JetStream, on
//! SQLite and PostgreSQL: `cargo bench --bench inbox --all-features`.
//!
//! Four consumers read the same number of messages from fresh streams, the same number at a
//! time, with the same pull batch: *bare* only acks; *plain* inserts one row in a transaction,
//! commits, then acks, with no dedupe; *dedupe* is what a careful user writes by hand: in one
//! transaction it inserts the message id into a processed-ids table (its primary key makes a
//! duplicate insert nothing, and a duplicate is rolled back and acked), inserts the same row,
//! commits, then acks; *inbox* claims the message's business key in the transaction it inserts
//! the same row in, commits, then acks; *inbox, batched* is the same consumer applying up to
//! `INBOX_BENCH_BATCH` (default 16) of the messages in hand in one transaction. The figure
//! that matters is inbox / dedupe, what the inbox costs over the dedupe a user would otherwise
//! write; plain and bare are context. The
//! consumers with a database are also run without a broker (rows committed by tasks fed from
//! memory), which splits the price into the database's part and the consumer's.
//!
//! The databases: SQLite (a WAL file in a temporary directory) always, PostgreSQL when the
//! bench is built with the `postgres` feature (`TEST_POSTGRES_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`, in a schema of its own). `INBOX_BENCH_DATABASES`
//! (default `sqlite,postgres`) narrows that to a list.
//!
//! Each round runs every scenario once, in turn, so a change in the machine's load hits them
//! alike; the medians of the rounds are printed with the range of the per-round ratios, and
//! beside each rate the CPU time a message cost this process (the consumer, and SQLite, which
//! runs in it) and the NATS server. Every consumer runs in the same task on the runtime's
//! workers, as a service runs its consumers.
//! `INBOX_BENCH_MESSAGES` (default 2000), `INBOX_BENCH_CONCURRENCY` (default 8),
//! `INBOX_BENCH_ROUNDS` (default 3).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::pull, stream};
use axum_idempotency::inbox::nats::NatsConsumer;
use axum_idempotency::inbox::{Delivery, Failure, Inbox, Verdict};
use axum_idempotency::{Backend, Store, Tx};
use bytes::Bytes;
use futures_util::StreamExt;
use tokio::sync::Notify;

const NATS: &str = "nats://127.0.0.1:4222";
const INSERT: &str = "INSERT INTO effects (key) VALUES ($1)";
/// The hand-written dedupe's claim: a row for a new id, nothing for a processed one.
const PROCESSED: &str =
    "INSERT INTO processed (id) VALUES ($1) ON CONFLICT DO NOTHING RETURNING id";
/// Publishes awaited at most at once: the client holds back a publish past its own limit of
/// unconfirmed ones (5 000 by default) until one is confirmed, so the bench must await them
/// as it goes or hang on a larger run.
const PUBLISH_WINDOW: usize = 1000;

// Shared with the benches that also time other processes by id; this one does not.
#[allow(dead_code)]
#[path = "common/proc_times.rs"]
mod proc_times;

/// One scenario's run: messages a second, and the CPU time a message cost this process (the
/// consumer, and SQLite, which runs in it) and the NATS server.
#[derive(Clone, Copy)]
struct Run {
    rate: f64,
    own_us: f64,
    broker_us: f64,
}

/// The timed part of a scenario, from its start: the wall clock and the CPU times [`Run`]
/// reports.
struct Timer {
    started: Instant,
    own: Duration,
    broker: Duration,
}

impl Timer {
    fn start() -> Self {
        Self {
            started: Instant::now(),
            own: proc_times::own(),
            broker: proc_times::of_name("nats-server"),
        }
    }

    fn stop(self, messages: usize) -> Run {
        let wall = self.started.elapsed();
        let per_message = |spent: Duration| spent.as_secs_f64() * 1e6 / messages as f64;
        Run {
            rate: messages as f64 / wall.as_secs_f64(),
            own_us: per_message(proc_times::own().saturating_sub(self.own)),
            broker_us: per_message(proc_times::of_name("nats-server").saturating_sub(self.broker)),
        }
    }
}

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

async fn publish(js: &jetstream::Context, subject: &str, messages: usize) {
    let mut acks = Vec::with_capacity(PUBLISH_WINDOW);
    for n in 0..messages {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(
            async_nats::header::NATS_MESSAGE_ID,
            format!("m-{n}").as_str(),
        );
        acks.push(
            js.publish_with_headers(subject.to_owned(), headers, Bytes::from(format!("p-{n}")))
                .await
                .expect("publish"),
        );
        if acks.len() == PUBLISH_WINDOW || n + 1 == messages {
            for ack in acks.drain(..) {
                ack.await.expect("stream ack");
            }
        }
    }
}

/// A fresh stream holding `messages` messages, and a pull consumer on it.
async fn filled(
    js: &jetstream::Context,
    name: &str,
    messages: usize,
) -> jetstream::consumer::PullConsumer {
    let stream = js
        .get_or_create_stream(stream::Config {
            name: name.to_owned(),
            subjects: vec![format!("{name}.>")],
            ..Default::default()
        })
        .await
        .expect("stream");
    publish(js, &format!("{name}.events"), messages).await;
    stream
        .get_or_create_consumer(
            "consumer",
            pull::Config {
                durable_name: Some("consumer".into()),
                ..Default::default()
            },
        )
        .await
        .expect("consumer")
}

async fn bare(js: &jetstream::Context, name: &str, messages: usize, concurrency: usize) -> Run {
    let consumer = filled(js, name, messages).await;
    let timer = Timer::start();
    consumer
        .stream()
        .max_messages_per_batch(concurrency)
        .messages()
        .await
        .expect("messages")
        .take(messages)
        .for_each_concurrent(concurrency, |message| async move {
            let _ = message.expect("message").ack().await;
        })
        .await;
    let run = timer.stop(messages);
    let _ = js.delete_stream(name).await;
    run
}

/// A consumer without dedupe that still writes: one insert committed per message, then the
/// ack. The gap between it and the inbox is the price of the dedupe.
async fn plain<DB>(
    js: &jetstream::Context,
    pool: sqlx::Pool<DB>,
    name: &str,
    messages: usize,
    concurrency: usize,
) -> Run
where
    DB: Backend,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    let consumer = filled(js, name, messages).await;
    let timer = Timer::start();
    consumer
        .stream()
        .max_messages_per_batch(concurrency)
        .messages()
        .await
        .expect("messages")
        .take(messages)
        .for_each_concurrent(concurrency, |message| {
            let pool = pool.clone();
            async move {
                let message = message.expect("message");
                let key = String::from_utf8_lossy(&message.payload).into_owned();
                insert_committed(&pool, key).await;
                let _ = message.ack().await;
            }
        })
        .await;
    let run = timer.stop(messages);
    let _ = js.delete_stream(name).await;
    run
}

async fn insert_committed<DB>(pool: &sqlx::Pool<DB>, key: String)
where
    DB: Backend,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    let mut tx = pool.begin().await.expect("begin");
    sqlx::query(INSERT)
        .bind(key)
        .execute(&mut *tx)
        .await
        .expect("insert");
    tx.commit().await.expect("commit");
}

/// The hand-written dedupe: the processed id and the business row in one transaction; a
/// processed id inserts nothing, and the transaction is rolled back. Returns whether the
/// message was applied.
async fn dedupe_committed<DB>(pool: &sqlx::Pool<DB>, id: String, key: String) -> bool
where
    DB: Backend,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    let mut tx = pool.begin().await.expect("begin");
    let new = sqlx::query(PROCESSED)
        .bind(id)
        .fetch_optional(&mut *tx)
        .await
        .expect("processed id")
        .is_some();
    if !new {
        tx.rollback().await.expect("rollback");
        return false;
    }
    sqlx::query(INSERT)
        .bind(key)
        .execute(&mut *tx)
        .await
        .expect("insert");
    tx.commit().await.expect("commit");
    true
}

/// A consumer deduping by hand: [`dedupe_committed`] with the message's id (the stream's name
/// before it, as the inbox scopes its keys by its name), then the ack.
async fn dedupe<DB>(
    js: &jetstream::Context,
    pool: sqlx::Pool<DB>,
    name: &str,
    messages: usize,
    concurrency: usize,
) -> Run
where
    DB: Backend,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    let consumer = filled(js, name, messages).await;
    let timer = Timer::start();
    consumer
        .stream()
        .max_messages_per_batch(concurrency)
        .messages()
        .await
        .expect("messages")
        .take(messages)
        .for_each_concurrent(concurrency, |message| {
            let pool = pool.clone();
            async move {
                let message = message.expect("message");
                let id = message
                    .headers
                    .as_ref()
                    .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
                    .map(|id| format!("{name}/{}", id.as_str()))
                    .expect("a message id");
                let key = String::from_utf8_lossy(&message.payload).into_owned();
                assert!(dedupe_committed(&pool, id, key).await, "a fresh message");
                let _ = message.ack().await;
            }
        })
        .await;
    let run = timer.stop(messages);
    let _ = js.delete_stream(name).await;
    run
}

fn keyed_inbox<DB: Backend>(name: &str, store: Store<DB>) -> Inbox<DB> {
    Inbox::new(name.to_owned(), store).key_by(|d: &Delivery| {
        String::from_utf8(d.payload().to_vec()).map_err(|_| Failure::permanent("not UTF-8"))
    })
}

async fn apply<DB>(mut tx: Tx<DB>, delivery: Delivery) -> Result<(), Failure>
where
    DB: Backend,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    let key = String::from_utf8_lossy(delivery.payload()).into_owned();
    sqlx::query(INSERT)
        .bind(key)
        .execute(&mut *tx)
        .await
        .map_err(|e| Failure::retryable(e.to_string()))?;
    Ok(())
}

async fn inbox<DB>(
    js: &jetstream::Context,
    store: Store<DB>,
    name: &str,
    messages: usize,
    concurrency: usize,
    batch: usize,
) -> Run
where
    DB: Backend,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    // Told when the last verdict is in, just before its ack, as the other consumers end when
    // their last ack is written; polling for it cost a wake-up a millisecond that they do not
    // pay.
    let done = Arc::new(Notify::new());
    let seen = Arc::new(AtomicUsize::new(0));
    let inbox = keyed_inbox(name, store).on_verdict({
        let done = done.clone();
        move |_, _| {
            if seen.fetch_add(1, Ordering::Relaxed) + 1 == messages {
                done.notify_one();
            }
        }
    });
    let consumer = NatsConsumer::new(inbox, js.clone(), name, "inbox")
        .stream_subjects([format!("{name}.>")])
        .dead_letters(format!("{name}_DEAD"), format!("{name}dead"))
        .concurrency(concurrency)
        .batch(batch);
    consumer.declare().await.expect("declare");
    publish(js, &format!("{name}.events"), messages).await;
    let timer = Timer::start();
    // Run in this task, as the other consumers are.
    tokio::select! {
        ended = consumer.run(apply::<DB>) => panic!("the inbox consumer ended: {ended:?}"),
        () = done.notified() => {}
    }
    let run = timer.stop(messages);
    let _ = js.delete_stream(name).await;
    let _ = js.delete_stream(format!("{name}_DEAD")).await;
    run
}

/// The plain consumer's work without a broker: inserts committed by `concurrency` tasks.
async fn plain_direct<DB>(
    pool: sqlx::Pool<DB>,
    name: &str,
    messages: usize,
    concurrency: usize,
) -> Run
where
    DB: Backend,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    let timer = Timer::start();
    futures_util::stream::iter(0..messages)
        .for_each_concurrent(concurrency, |n| {
            let pool = pool.clone();
            async move { insert_committed(&pool, format!("{name}-{n}")).await }
        })
        .await;
    timer.stop(messages)
}

/// The hand-written dedupe's work without a broker.
async fn dedupe_direct<DB>(
    pool: sqlx::Pool<DB>,
    name: &str,
    messages: usize,
    concurrency: usize,
) -> Run
where
    DB: Backend,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    let timer = Timer::start();
    futures_util::stream::iter(0..messages)
        .for_each_concurrent(concurrency, |n| {
            let pool = pool.clone();
            async move {
                let applied =
                    dedupe_committed(&pool, format!("{name}/m-{n}"), format!("{name}-{n}")).await;
                assert!(applied, "a fresh message");
            }
        })
        .await;
    timer.stop(messages)
}

/// The inbox's work without a broker: deliveries handed to `Inbox::handle` by `concurrency`
/// tasks.
async fn inbox_direct<DB>(store: Store<DB>, name: &str, messages: usize, concurrency: usize) -> Run
where
    DB: Backend,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    let inbox = keyed_inbox(name, store);
    let timer = Timer::start();
    futures_util::stream::iter(0..messages)
        .for_each_concurrent(concurrency, |n| {
            let inbox = inbox.clone();
            async move {
                let delivery = Delivery::new(format!("{name}-{n}"));
                assert_eq!(inbox.handle(delivery, apply::<DB>).await, Verdict::Applied);
            }
        })
        .await;
    timer.stop(messages)
}

/// One database's runs over the rounds: through the broker, and without it.
#[derive(Default)]
struct Rates {
    plain: Vec<Run>,
    dedupe: Vec<Run>,
    inbox: Vec<Run>,
    inbox_batched: Vec<Run>,
    plain_direct: Vec<Run>,
    dedupe_direct: Vec<Run>,
    inbox_direct: Vec<Run>,
}

impl Rates {
    async fn round<DB>(
        &mut self,
        js: &jetstream::Context,
        store: &Store<DB>,
        name: &str,
        messages: usize,
        concurrency: usize,
        batch: usize,
    ) where
        DB: Backend,
        for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
        for<'q> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
        for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    {
        let pool = store.pool().clone();
        let (m, c) = (messages, concurrency);
        self.plain
            .push(plain(js, pool.clone(), &format!("{name}_PLAIN"), m, c).await);
        self.dedupe
            .push(dedupe(js, pool.clone(), &format!("{name}_DEDUPE"), m, c).await);
        self.inbox
            .push(inbox(js, store.clone(), &format!("{name}_INBOX"), m, c, 1).await);
        self.inbox_batched
            .push(inbox(js, store.clone(), &format!("{name}_BATCHED"), m, c, batch).await);
        self.plain_direct
            .push(plain_direct(pool.clone(), &format!("{name}_PLAIN_DIRECT"), m, c).await);
        self.dedupe_direct
            .push(dedupe_direct(pool, &format!("{name}_DEDUPE_DIRECT"), m, c).await);
        self.inbox_direct
            .push(inbox_direct(store.clone(), &format!("{name}_INBOX_DIRECT"), m, c).await);
    }

    fn print(&self, database: &str) {
        let row = |label: &str, runs: &[Run]| format!("{database:<11} {}", line(label, runs));
        println!("{}", row("plain insert + ack:", &self.plain));
        println!(
            "{}  dedupe / plain {}",
            row("hand-written dedupe:", &self.dedupe),
            ratios(&self.dedupe, &self.plain)
        );
        println!(
            "{}  inbox / dedupe {}  inbox / plain {}",
            row("inbox consumer:", &self.inbox),
            ratios(&self.inbox, &self.dedupe),
            ratios(&self.inbox, &self.plain)
        );
        println!(
            "{}  inbox / dedupe {}  inbox / plain {}",
            row("inbox, batched:", &self.inbox_batched),
            ratios(&self.inbox_batched, &self.dedupe),
            ratios(&self.inbox_batched, &self.plain)
        );
        println!("{}", row("no broker, plain:", &self.plain_direct));
        println!(
            "{}  dedupe / plain {}",
            row("no broker, dedupe:", &self.dedupe_direct),
            ratios(&self.dedupe_direct, &self.plain_direct)
        );
        println!(
            "{}  inbox / dedupe {}  inbox / plain {}",
            row("no broker, inbox:", &self.inbox_direct),
            ratios(&self.inbox_direct, &self.dedupe_direct),
            ratios(&self.inbox_direct, &self.plain_direct)
        );
    }
}

/// A scenario's medians: its rate, and the CPU time a message cost (this process: consumer and
/// SQLite; the NATS server).
fn line(label: &str, runs: &[Run]) -> String {
    let of = |field: fn(&Run) -> f64| median(&runs.iter().map(field).collect::<Vec<_>>());
    format!(
        "{label:<22} {:>6.0} msg/s  cpu/msg {:>4.0} µs + NATS {:>3.0} µs",
        of(|r| r.rate),
        of(|r| r.own_us),
        of(|r| r.broker_us)
    )
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    if sorted.len().is_multiple_of(2) {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    } else {
        sorted[mid]
    }
}

/// The median of the per-round ratios (each measured in one round, under the same load) and
/// their range.
fn ratios(numerators: &[Run], denominators: &[Run]) -> String {
    let each: Vec<f64> = numerators
        .iter()
        .zip(denominators)
        .map(|(n, d)| n.rate / d.rate)
        .collect();
    let low = each.iter().copied().fold(f64::INFINITY, f64::min);
    let high = each.iter().copied().fold(0.0, f64::max);
    format!("{:.2} (rounds {low:.2}–{high:.2})", median(&each))
}

#[tokio::main]
async fn main() {
    // `cargo test --benches` runs this with `--bench`-less arguments; only a real bench run
    // measures.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    // On the runtime's workers, as a service runs its consumers, rather than on the thread
    // that blocks on `main`.
    tokio::spawn(bench()).await.expect("the bench panicked");
}

async fn bench() {
    let messages = env_or("INBOX_BENCH_MESSAGES", 2000);
    let concurrency = env_or("INBOX_BENCH_CONCURRENCY", 8);
    let rounds = env_or("INBOX_BENCH_ROUNDS", 3).max(1);
    let batch = env_or("INBOX_BENCH_BATCH", 16).max(1);
    let js = jetstream::new(
        async_nats::connect(NATS)
            .await
            .expect("NATS must be reachable at 127.0.0.1:4222"),
    );
    let tag = std::process::id();
    let databases = std::env::var("INBOX_BENCH_DATABASES")
        .unwrap_or_else(|_| "sqlite,postgres".into())
        .to_lowercase();
    let on = |database: &str| databases.split(',').any(|d| d.trim() == database);

    let dir = tempfile::tempdir().expect("tempdir");
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(dir.path().join("bench.db"))
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal);
    let sqlite = sqlx::SqlitePool::connect_with(options)
        .await
        .expect("sqlite");
    sqlx::raw_sql(
        "CREATE TABLE effects (key TEXT NOT NULL); CREATE TABLE processed (id TEXT PRIMARY KEY)",
    )
    .execute(&sqlite)
    .await
    .expect("tables");
    let sqlite = axum_idempotency::SqliteStore::new(sqlite);
    sqlite.migrate().await.expect("migrate");

    #[cfg(feature = "postgres")]
    let (admin, schema, postgres) = {
        let url = std::env::var("TEST_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        let admin = sqlx::PgPool::connect(&url).await.expect("PostgreSQL");
        let schema = format!("t_{tag}_bench");
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}; \
             CREATE TABLE {schema}.effects (key TEXT NOT NULL); \
             CREATE TABLE {schema}.processed (id TEXT PRIMARY KEY)"
        )))
        .execute(&admin)
        .await
        .expect("schema");
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(16)
            .connect(&format!("{url}?options=-c%20search_path%3D{schema}"))
            .await
            .expect("PostgreSQL");
        let store = axum_idempotency::PgStore::new(pool);
        store.migrate().await.expect("migrate");
        (admin, schema, store)
    };

    let mut bare_rates = Vec::new();
    let mut sqlite_rates = Rates::default();
    #[cfg(feature = "postgres")]
    let mut postgres_rates = Rates::default();
    for round in 0..rounds {
        let name = format!("BENCH_{tag}_{round}");
        bare_rates.push(bare(&js, &format!("{name}_BARE"), messages, concurrency).await);
        if on("sqlite") {
            let name = format!("{name}_SQLITE");
            sqlite_rates
                .round(&js, &sqlite, &name, messages, concurrency, batch)
                .await;
        }
        #[cfg(feature = "postgres")]
        if on("postgres") {
            let name = format!("{name}_PG");
            postgres_rates
                .round(&js, &postgres, &name, messages, concurrency, batch)
                .await;
        }
        eprintln!("round {} of {rounds} done", round + 1);
    }

    println!(
        "{messages} messages, {concurrency} at a time (batched: {concurrency} transactions of up to {batch}), medians of {rounds} rounds:"
    );
    println!("{:<11} {}", "", line("bare consumer (ack):", &bare_rates));
    if on("sqlite") {
        sqlite_rates.print("SQLite");
    }
    #[cfg(feature = "postgres")]
    {
        if on("postgres") {
            postgres_rates.print("PostgreSQL");
        }
        let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
            .execute(&admin)
            .await;
    }
}
