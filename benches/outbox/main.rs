//! Throughput of the outbox relay (messages committed by the handler → confirmed by the broker)
//! against a bare publisher sending the same messages straight to the broker, in one run, on
//! SQLite and PostgreSQL × RabbitMQ and NATS JetStream: `cargo bench --bench outbox
//! --all-features` (at least `outbox,rabbitmq,nats`; PostgreSQL with `postgres`).
//!
//! What each figure is:
//!
//! - `relay`: N messages are first committed the way a handler commits them, one message per
//!   transaction (`begin`, [`Outbox::enqueue`], `commit`) by `OUTBOX_BENCH_PRODUCERS` concurrent
//!   tasks; that phase is timed on its own (`commit msg/s`). Then a [`Dispatcher`] built with the
//!   user's defaults (`Dispatcher::new(outbox, sender)`, the pool with sqlx's defaults) starts,
//!   and the clock runs until the broker has confirmed all N (RabbitMQ publisher confirms,
//!   JetStream publish acks, counted as the sender returns them) **and** the outbox table
//!   shows all N delivered (the dispatcher's settle committed). relay msg/s = N / that time.
//! - `bare`: the same N messages (the same 64-hex message ids, the same payload sizes, the same
//!   AMQP properties and `mandatory` flag, the same `Nats-Msg-Id` header) published by a plain
//!   client that waits for the same confirmation of each. It may keep as many publishes in
//!   flight as the relay may: a dispatcher keeps at most `batch_size` sends in flight (a
//!   sliding window it refills with claims as sends finish), so the bare publisher keeps
//!   `batch_size × dispatchers` publishes in flight, as a sliding window too, each waiting for
//!   its own confirm.
//! - `live` (end to end): the producers commit while the dispatcher runs, waking it after each
//!   commit as the docs recommend; the clock runs from the first commit to the last delivery
//!   recorded, so it is bounded by the slower of the two sides.
//! - `relay, no broker`: the relay to a sender that confirms at once without publishing, which
//!   leaves the dispatcher's own database work (claims, attempts, settlements): where it is
//!   close to `relay`, the database side is what limits the relay, not the broker.
//!
//! - `latency` (PostgreSQL only, see [`latency`]): commit → delivered per message, requests
//!   through the idempotency layer enqueuing on their `Tx` at half the producers' top rate,
//!   one dispatcher with the defaults woken by the commits alone; p50 and p99 against 5 ms and
//!   50 ms.
//!
//! Every run is verified before its figure counts: the outbox holds N delivered messages with
//! N attempts in all (no resend), and the broker holds exactly the N expected message ids (the
//! queue's depth is N and a consumer reads back each id once; the stream holds N messages and
//! an ordered consumer reads back each id once). The queue or stream is emptied after each run
//! and every run uses message ids of its own, so JetStream's duplicate window never drops one.
//! A run that fails verification marks its row `invalid` and the bench exits with an error.
//!
//! Rounds are interleaved (`relay, bare, live, no broker`, the next round starting one scenario
//! later) and
//! the table reports medians, because the machine is shared and noisy: the ratios are the
//! result, the absolute numbers drift.
//!
//! Settings (environment):
//! - `OUTBOX_BENCH_MESSAGES` (default 5000) messages per run.
//! - `OUTBOX_BENCH_ROUNDS` (default 3) runs of each scenario.
//! - `OUTBOX_BENCH_PRODUCERS` (default 8) concurrent committing tasks.
//! - `OUTBOX_BENCH_PAYLOAD` (default 256) payload bytes per message (a JSON object).
//! - `OUTBOX_BENCH_LIVE` (default `true`): also measure the end-to-end `live` scenario.
//! - `OUTBOX_BENCH_THROUGHPUT` (default `true`): measure the throughput rows above.
//! - `OUTBOX_BENCH_LATENCY` (default `true`): measure `latency` on PostgreSQL with each broker
//!   (`OUTBOX_BENCH_MESSAGES` messages, `OUTBOX_BENCH_PRODUCERS` tasks for the top rate).
//! - `OUTBOX_BENCH_TUNED` (default `64x1`): one more row per store and broker with
//!   `batch_size` × dispatchers as given (`BATCHxDISPATCHERS`; `0` or empty for none), the
//!   other settings at their defaults and the bare window sized to match. On SQLite the tuned
//!   dispatchers also get an `Outbox` on a pool of one connection of their own (handlers
//!   enqueue on their own transaction's connection, so the outbox's pool serves only the
//!   dispatchers): SQLite has one writer, and the app pool's connections would only queue for
//!   it in SQLite's busy handler, which sleeps between tries.
//! - `OUTBOX_BENCH_POOL` (default: sqlx's default, 10): the app pool's size.
//! - `OUTBOX_BENCH_STORES` (default `sqlite,postgres`), `OUTBOX_BENCH_BROKERS` (default
//!   `rabbitmq,nats`): what to run.
//! - `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`), `AMQP_URL` (default
//!   `amqp://guest:guest@127.0.0.1:5672/%2f`), `NATS_URL` (default `nats://127.0.0.1:4222`).
//!   The run makes a PostgreSQL schema, a RabbitMQ exchange and queue and a JetStream stream of
//!   its own (named after the process id) and deletes them at the end.

mod broker;
mod latency;
mod report;
mod run;
mod store;

use std::panic::AssertUnwindSafe;

use axum_idempotency::outbox::DownstreamKey;
use futures_util::FutureExt;

use broker::Broker;
use latency::Latency;
use report::{print, print_latency};
use run::{Row, measure_store};

/// The routing key (RabbitMQ) and the topic every message carries.
const TOPIC: &str = "outbench.event";
/// `Dispatcher::new`'s documented `batch_size`: the default row sizes the bare window by it.
const DEFAULT_BATCH: u32 = 16;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn env_list(name: &str, default: &str) -> Vec<String> {
    std::env::var(name)
        .unwrap_or_else(|_| default.to_owned())
        .split(',')
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect()
}

struct Settings {
    messages: usize,
    rounds: usize,
    producers: usize,
    payload: usize,
    live: bool,
    throughput: bool,
    // Latency is measured on PostgreSQL only.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    latency: bool,
}

/// The dispatcher settings of one table row.
#[derive(Clone, Copy)]
struct Profile {
    /// `None`: `Dispatcher::new`'s default, not set at all.
    batch: Option<u32>,
    dispatchers: usize,
    /// The dispatchers' `Outbox` on a pool of this many connections of its own, rather than
    /// on the app's pool the handlers commit through.
    own_pool: Option<u32>,
}

impl Profile {
    /// What the bare publisher may keep in flight: what the dispatchers send concurrently.
    fn window(self) -> usize {
        self.batch.unwrap_or(DEFAULT_BATCH) as usize * self.dispatchers
    }

    fn label(self) -> String {
        let mut label = match self.batch {
            None => "defaults".to_owned(),
            Some(batch) => format!("batch_size {batch} × {} dispatcher(s)", self.dispatchers),
        };
        if let Some(size) = self.own_pool {
            label.push_str(&format!(", own pool of {size}"));
        }
        label
    }
}

fn key(run: &str, n: usize) -> DownstreamKey {
    DownstreamKey::new(format!("{run}-{n}-event")).expect("a valid key")
}

/// A JSON object of exactly `size` bytes (or the smallest that holds `n`).
fn payload(n: usize, size: usize) -> Vec<u8> {
    let head = format!("{{\"event\":\"order.paid\",\"order\":{n},\"pad\":\"");
    let pad = size.saturating_sub(head.len() + 2);
    let mut bytes = head.into_bytes();
    bytes.resize(bytes.len() + pad, b'x');
    bytes.extend_from_slice(b"\"}");
    bytes
}

/// sqlx's pool defaults, unless `OUTBOX_BENCH_POOL` sets the size.
fn pool_options<DB: sqlx::Database>() -> sqlx::pool::PoolOptions<DB> {
    let options = sqlx::pool::PoolOptions::new();
    match std::env::var("OUTBOX_BENCH_POOL")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        Some(size) => options.max_connections(size),
        None => options,
    }
}

/// The defaults, and the tuned row `OUTBOX_BENCH_TUNED` asks for (`BATCHxDISPATCHERS`, `0` or
/// empty for none), its dispatchers on a pool of `own_pool` connections of their own if given.
fn profiles(own_pool: Option<u32>) -> Vec<Profile> {
    let mut profiles = vec![Profile {
        batch: None,
        dispatchers: 1,
        own_pool: None,
    }];
    let spec = std::env::var("OUTBOX_BENCH_TUNED").unwrap_or_else(|_| "64x1".into());
    let (batch, dispatchers) = spec.split_once('x').unwrap_or((spec.as_str(), "1"));
    let batch = batch.trim().parse().ok().filter(|&b: &u32| b > 0);
    let dispatchers = dispatchers.trim().parse().ok().filter(|&d: &usize| d > 0);
    if let (Some(batch), Some(dispatchers)) = (batch, dispatchers) {
        profiles.push(Profile {
            batch: Some(batch),
            dispatchers,
            own_pool,
        });
    }
    profiles
}

#[tokio::main]
async fn main() {
    // `cargo test --benches` runs this with `--bench`-less arguments; only a real bench run
    // measures.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    // The dispatcher reports lease losses and failed claims through tracing only. sqlx's
    // slow-statement warnings are left out by default: under SQLite's lock contention they
    // come by the dozen and would bury the dispatcher's (`RUST_LOG` brings them back).
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,sqlx::query=error".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let settings = Settings {
        messages: env_or("OUTBOX_BENCH_MESSAGES", 5000usize).max(1),
        rounds: env_or("OUTBOX_BENCH_ROUNDS", 3usize).max(1),
        producers: env_or("OUTBOX_BENCH_PRODUCERS", 8usize).max(1),
        payload: env_or("OUTBOX_BENCH_PAYLOAD", 256usize),
        live: env_or("OUTBOX_BENCH_LIVE", true),
        throughput: env_or("OUTBOX_BENCH_THROUGHPUT", true),
        latency: env_or("OUTBOX_BENCH_LATENCY", true),
    };
    let tag = std::process::id();
    let mut brokers = Vec::new();
    for broker in env_list("OUTBOX_BENCH_BROKERS", "rabbitmq,nats") {
        match broker.as_str() {
            "rabbitmq" => brokers.push(Broker::rabbitmq(tag).await),
            "nats" => brokers.push(Broker::nats(tag).await),
            other => eprintln!("unknown broker {other:?} skipped (rabbitmq, nats)"),
        }
    }
    let (mut rows, mut latencies) = (Vec::new(), Vec::new());
    // Caught so the queues, streams and schema of this run are deleted whatever happens.
    let measuring = measure_stores(&brokers, &settings, tag, &mut rows, &mut latencies);
    let measured = AssertUnwindSafe(measuring).catch_unwind().await;
    for broker in brokers {
        broker.delete().await;
    }
    if let Err(panic) = measured {
        std::panic::resume_unwind(panic);
    }
    if settings.throughput {
        print(&rows, &settings);
    }
    print_latency(&latencies, &settings);
    if rows.iter().any(|row| !row.errors.is_empty())
        || latencies.iter().any(|row| !row.errors.is_empty())
    {
        std::process::exit(1);
    }
}

// The latencies are measured on PostgreSQL only.
#[cfg_attr(not(feature = "postgres"), allow(unused_variables, clippy::ptr_arg))]
async fn measure_stores(
    brokers: &[Broker],
    settings: &Settings,
    tag: u32,
    rows: &mut Vec<Row>,
    latencies: &mut Vec<Latency>,
) {
    for store in env_list("OUTBOX_BENCH_STORES", "sqlite,postgres") {
        match store.as_str() {
            "sqlite" if !settings.throughput => {}
            "sqlite" => {
                let dir = tempfile::tempdir().expect("tempdir");
                let options = sqlx::sqlite::SqliteConnectOptions::new()
                    .filename(dir.path().join("outbox.db"))
                    .create_if_missing(true)
                    .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal);
                let pool = pool_options::<sqlx::Sqlite>()
                    .connect_with(options)
                    .await
                    .expect("SQLite");
                // SQLite has one writer: the tuned dispatcher writes through one connection of
                // its own instead of queueing several in the busy handler.
                let profiles = profiles(Some(1));
                measure_store(&pool, brokers, &profiles, settings, tag, rows).await;
                pool.close().await;
            }
            #[cfg(feature = "postgres")]
            "postgres" => {
                let url = std::env::var("DATABASE_URL")
                    .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
                let admin = sqlx::PgPool::connect(&url).await.expect("PostgreSQL");
                let schema = format!("outbench_{tag}");
                sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                    "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}"
                )))
                .execute(&admin)
                .await
                .expect("create the schema");
                let options = url
                    .parse::<sqlx::postgres::PgConnectOptions>()
                    .expect("DATABASE_URL")
                    .options([("search_path", schema.as_str())]);
                let measured = AssertUnwindSafe(async {
                    let pool = pool_options::<sqlx::Postgres>()
                        .connect_with(options)
                        .await
                        .expect("PostgreSQL");
                    if settings.throughput {
                        measure_store(&pool, brokers, &profiles(None), settings, tag, rows).await;
                    }
                    if settings.latency {
                        for broker in brokers {
                            let measured = latency::measure(&pool, broker, settings, tag).await;
                            eprintln!(
                                "measured latency {} × {}: p50 {:?}, p99 {:?}",
                                measured.store,
                                measured.broker,
                                measured.quantile(0.5),
                                measured.quantile(0.99)
                            );
                            latencies.push(measured);
                        }
                    }
                    pool.close().await;
                })
                .catch_unwind()
                .await;
                let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
                    .execute(&admin)
                    .await;
                if let Err(panic) = measured {
                    std::panic::resume_unwind(panic);
                }
            }
            other => eprintln!("store {other:?} skipped (sqlite, postgres; see --features)"),
        }
    }
}
