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

use std::collections::HashSet;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::pull, stream};
use axum_idempotency::Backend;
use axum_idempotency::outbox::{
    DispatchWaker, Dispatcher, DownstreamKey, LookupOutcome, Message, NatsSender, Outbox,
    OutboxRecord, RabbitMqSender, SendOutcome, Sender,
};
use bytes::Bytes;
use futures_util::{FutureExt, StreamExt};
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions,
    ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
    QueuePurgeOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, ExchangeKind};
use sqlx::Pool;
use tokio::sync::oneshot;

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
    DownstreamKey::for_request(&format!("{run}/{n}"), TOPIC, "event")
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

/// What the bench needs of a database beyond the crate's public API: emptying the outbox between
/// runs and reading how many messages are delivered.
trait Store: Backend {
    const LABEL: &'static str;
    fn clear(pool: &Pool<Self>) -> impl Future<Output = ()> + Send;
    /// Delivered messages and the attempts spent on them.
    fn delivered(pool: &Pool<Self>) -> impl Future<Output = (i64, i64)> + Send;
}

const DELIVERED: &str = "SELECT COUNT(*), CAST(COALESCE(SUM(attempts), 0) AS BIGINT) \
     FROM idempotency_outbox WHERE status = 'delivered'";

impl Store for sqlx::Sqlite {
    const LABEL: &'static str = "SQLite";
    async fn clear(pool: &Pool<Self>) {
        sqlx::query("DELETE FROM idempotency_outbox")
            .execute(pool)
            .await
            .expect("empty the outbox");
    }
    async fn delivered(pool: &Pool<Self>) -> (i64, i64) {
        sqlx::query_as(DELIVERED)
            .fetch_one(pool)
            .await
            .expect("count delivered")
    }
}

#[cfg(feature = "postgres")]
impl Store for sqlx::Postgres {
    const LABEL: &'static str = "PostgreSQL";
    async fn clear(pool: &Pool<Self>) {
        // TRUNCATE rather than DELETE: no dead tuples left for the next run's claims to skip.
        sqlx::query("TRUNCATE idempotency_outbox")
            .execute(pool)
            .await
            .expect("empty the outbox");
    }
    async fn delivered(pool: &Pool<Self>) -> (i64, i64) {
        sqlx::query_as(DELIVERED)
            .fetch_one(pool)
            .await
            .expect("count delivered")
    }
}

/// A broker with a destination of this run's own that holds what is published until verified.
enum Broker {
    RabbitMq {
        connection: Arc<lapin::Connection>,
        channel: lapin::Channel,
        exchange: String,
        queue: String,
    },
    Nats {
        js: jetstream::Context,
        stream: String,
        subject: String,
    },
}

impl Broker {
    async fn rabbitmq(tag: u32) -> Self {
        let url = std::env::var("AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
        let connection = lapin::Connection::connect(&url, Default::default())
            .await
            .expect("RabbitMQ must be reachable (AMQP_URL)");
        let channel = connection.create_channel().await.expect("channel");
        let (exchange, queue) = (format!("outbench.{tag}"), format!("outbench.{tag}.events"));
        // Durable, with persistent messages (the sender's delivery mode 2): a confirm then
        // means the broker has the message on disk, as in production.
        channel
            .exchange_declare(
                exchange.as_str().into(),
                ExchangeKind::Direct,
                ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("declare the exchange");
        channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("declare the queue");
        channel
            .queue_bind(
                queue.as_str().into(),
                exchange.as_str().into(),
                TOPIC.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("bind the queue");
        Self::RabbitMq {
            connection: Arc::new(connection),
            channel,
            exchange,
            queue,
        }
    }

    async fn nats(tag: u32) -> Self {
        let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
        let js = jetstream::new(
            async_nats::connect(&url)
                .await
                .expect("NATS must be reachable (NATS_URL)"),
        );
        let (stream, subject) = (format!("OUTBENCH_{tag}"), format!("outbench_{tag}.events"));
        js.create_stream(stream::Config {
            name: stream.clone(),
            subjects: vec![subject.clone()],
            ..Default::default()
        })
        .await
        .expect("create the stream");
        Self::Nats {
            js,
            stream,
            subject,
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Self::RabbitMq { .. } => "RabbitMQ",
            Self::Nats { .. } => "NATS",
        }
    }

    /// The crate's sender for this broker, wired as a user wires it, counting into `confirmed`;
    /// with `nowhere`, a sender that publishes nothing.
    async fn sender(&self, confirmed: Arc<AtomicUsize>, nowhere: bool) -> Publish {
        let to = match self {
            _ if nowhere => PublishTo::Nowhere,
            Self::RabbitMq {
                connection,
                exchange,
                ..
            } => PublishTo::RabbitMq(
                RabbitMqSender::with_connection(connection.clone(), exchange.clone())
                    .await
                    .expect("RabbitMQ sender"),
            ),
            Self::Nats { js, subject, .. } => {
                PublishTo::Nats(NatsSender::new(js.clone()).route(TOPIC, subject.clone()))
            }
        };
        Publish { to, confirmed }
    }

    /// Publishes `messages` straight to the broker, `window` at a time, each waiting for its
    /// confirm; returns the time from the first publish to the last confirm.
    async fn bare(&self, messages: &[(DownstreamKey, Vec<u8>)], window: usize) -> Duration {
        let failed = AtomicUsize::new(0);
        let failed = &failed;
        let elapsed = match self {
            Self::RabbitMq {
                connection,
                exchange,
                ..
            } => {
                // A channel of its own in confirm mode, as the relay's sender has.
                let channel = connection.create_channel().await.expect("channel");
                channel
                    .confirm_select(ConfirmSelectOptions::default())
                    .await
                    .expect("confirm mode");
                let confirming = &channel;
                let started = Instant::now();
                futures_util::stream::iter(messages)
                    .for_each_concurrent(window, |(key, payload)| async move {
                        let properties = BasicProperties::default()
                            .with_message_id(key.as_str().into())
                            .with_delivery_mode(2);
                        let confirmed = async {
                            let confirm = confirming
                                .basic_publish(
                                    exchange.as_str().into(),
                                    TOPIC.into(),
                                    BasicPublishOptions {
                                        mandatory: true,
                                        ..Default::default()
                                    },
                                    payload,
                                    properties,
                                )
                                .await?;
                            let confirmation = confirm.await?;
                            Ok::<_, lapin::Error>(
                                confirmation.is_ack() && confirmation.take_message().is_none(),
                            )
                        };
                        if !matches!(confirmed.await, Ok(true)) {
                            failed.fetch_add(1, Ordering::Relaxed);
                        }
                    })
                    .await;
                let elapsed = started.elapsed();
                let _ = channel.close(200, "done".into()).await;
                elapsed
            }
            Self::Nats { js, subject, .. } => {
                let started = Instant::now();
                futures_util::stream::iter(messages)
                    .for_each_concurrent(window, |(key, payload)| async move {
                        let mut headers = async_nats::HeaderMap::new();
                        headers.insert(async_nats::header::NATS_MESSAGE_ID, key.as_str());
                        let acked = async {
                            let ack = js
                                .publish_with_headers(
                                    subject.clone(),
                                    headers,
                                    Bytes::copy_from_slice(payload),
                                )
                                .await?;
                            Ok::<_, async_nats::Error>(!ack.await?.duplicate)
                        };
                        if !matches!(acked.await, Ok(true)) {
                            failed.fetch_add(1, Ordering::Relaxed);
                        }
                    })
                    .await;
                started.elapsed()
            }
        };
        let failed = failed.load(Ordering::Relaxed);
        if failed > 0 {
            // Verification reports the shortfall; this says where it came from.
            eprintln!("bare publisher: {failed} publishes not confirmed");
        }
        elapsed
    }

    /// Checks that the broker holds exactly the `expected` message ids, each once, then empties
    /// the destination for the next run.
    async fn verify_and_empty(&self, expected: &HashSet<String>) -> Result<(), String> {
        let wanted = expected.len();
        let mut seen = HashSet::with_capacity(wanted);
        let mut duplicates = 0;
        let held = match self {
            Self::RabbitMq { channel, queue, .. } => {
                let depth = channel
                    .queue_declare(
                        queue.as_str().into(),
                        QueueDeclareOptions {
                            passive: true,
                            ..Default::default()
                        },
                        FieldTable::default(),
                    )
                    .await
                    .map_err(|e| format!("queue depth: {e}"))?
                    .message_count() as usize;
                // Only what the queue holds is read, so a shortfall cannot hang the read.
                let mut consumer = channel
                    .basic_consume(
                        queue.as_str().into(),
                        "outbench-verify".into(),
                        BasicConsumeOptions {
                            no_ack: true,
                            ..Default::default()
                        },
                        FieldTable::default(),
                    )
                    .await
                    .map_err(|e| format!("consume: {e}"))?;
                for _ in 0..depth {
                    let delivery = tokio::time::timeout(Duration::from_secs(10), consumer.next())
                        .await
                        .map_err(|_| "the queue stopped delivering".to_owned())?
                        .ok_or("the consumer ended")?
                        .map_err(|e| format!("delivery: {e}"))?;
                    let id = delivery
                        .properties
                        .message_id()
                        .as_ref()
                        .map(|id| id.as_str().to_owned())
                        .unwrap_or_default();
                    if !seen.insert(id) {
                        duplicates += 1;
                    }
                }
                channel
                    .basic_cancel("outbench-verify".into(), Default::default())
                    .await
                    .map_err(|e| format!("cancel: {e}"))?;
                channel
                    .queue_purge(queue.as_str().into(), QueuePurgeOptions::default())
                    .await
                    .map_err(|e| format!("purge: {e}"))?;
                depth
            }
            Self::Nats { js, stream, .. } => {
                let mut handle = js
                    .get_stream(stream)
                    .await
                    .map_err(|e| format!("stream: {e}"))?;
                let held = handle
                    .info()
                    .await
                    .map_err(|e| format!("stream info: {e}"))?
                    .state
                    .messages as usize;
                let consumer = handle
                    .create_consumer(pull::OrderedConfig::default())
                    .await
                    .map_err(|e| format!("ordered consumer: {e}"))?;
                let mut messages = consumer
                    .messages()
                    .await
                    .map_err(|e| format!("read back: {e}"))?;
                for _ in 0..held {
                    let message = tokio::time::timeout(Duration::from_secs(10), messages.next())
                        .await
                        .map_err(|_| "the stream stopped delivering".to_owned())?
                        .ok_or("the consumer ended")?
                        .map_err(|e| format!("read back: {e}"))?;
                    let id = message
                        .headers
                        .as_ref()
                        .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
                        .map(|id| id.as_str().to_owned())
                        .unwrap_or_default();
                    if !seen.insert(id) {
                        duplicates += 1;
                    }
                }
                drop(messages);
                handle.purge().await.map_err(|e| format!("purge: {e}"))?;
                held
            }
        };
        let missing = expected.difference(&seen).count();
        let foreign = seen.difference(expected).count();
        if held != wanted || missing > 0 || foreign > 0 || duplicates > 0 {
            return Err(format!(
                "{}: held {held} for {wanted} sent ({missing} missing, {foreign} unexpected, \
                 {duplicates} duplicates)",
                self.name()
            ));
        }
        Ok(())
    }

    async fn delete(self) {
        match self {
            Self::RabbitMq {
                channel,
                exchange,
                queue,
                connection,
            } => {
                let _ = channel
                    .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                    .await;
                let _ = channel
                    .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
                    .await;
                let _ = connection.close(0, "bench done".into()).await;
            }
            Self::Nats { js, stream, .. } => {
                let _ = js.delete_stream(&stream).await;
            }
        }
    }
}

/// The crate's broker senders behind one type, counting the confirms they return so the bench
/// knows when the broker has them all without polling the database meanwhile.
struct Publish {
    to: PublishTo,
    confirmed: Arc<AtomicUsize>,
}

enum PublishTo {
    RabbitMq(RabbitMqSender),
    Nats(NatsSender),
    /// Confirms at once without publishing: what is left is the dispatcher's own work.
    Nowhere,
}

impl Sender for Publish {
    async fn send(&self, message: &OutboxRecord) -> SendOutcome {
        let outcome = match &self.to {
            PublishTo::RabbitMq(sender) => sender.send(message).await,
            PublishTo::Nats(sender) => sender.send(message).await,
            PublishTo::Nowhere => SendOutcome::Delivered {
                receipt: String::new(),
            },
        };
        if matches!(outcome, SendOutcome::Delivered { .. }) {
            self.confirmed.fetch_add(1, Ordering::Relaxed);
        }
        outcome
    }

    async fn lookup(&self, message: &OutboxRecord) -> LookupOutcome {
        match &self.to {
            PublishTo::RabbitMq(sender) => sender.lookup(message).await,
            PublishTo::Nats(sender) => sender.lookup(message).await,
            PublishTo::Nowhere => LookupOutcome::Unsupported,
        }
    }
}

/// The app's pool, the outbox handlers enqueue into through it, and the outbox the dispatchers
/// run on (the same one, or one on a pool of their own).
struct Tables<DB: Backend> {
    pool: Pool<DB>,
    outbox: Outbox<DB>,
    dispatching: Outbox<DB>,
}

/// Commits `n` messages of `run`, one per transaction as a handler does, from `producers`
/// concurrent tasks, waking `wakers` after each commit; returns the time taken.
async fn produce<DB: Store>(
    tables: &Tables<DB>,
    run: &str,
    settings: &Settings,
    wakers: Vec<DispatchWaker>,
) -> Duration {
    let (n, producers, size) = (
        settings.messages,
        settings.producers.max(1),
        settings.payload,
    );
    let (run, wakers): (Arc<str>, Arc<[DispatchWaker]>) = (run.into(), wakers.into());
    let started = Instant::now();
    let tasks: Vec<_> = (0..producers)
        .map(|p| {
            let (outbox, pool) = (tables.outbox.clone(), tables.pool.clone());
            let (run, wakers) = (run.clone(), wakers.clone());
            tokio::spawn(async move {
                for i in (p..n).step_by(producers) {
                    let message = Message::new(TOPIC, key(&run, i), payload(i, size));
                    let mut tx = pool.begin().await.expect("begin");
                    outbox.enqueue(&mut *tx, message).await.expect("enqueue");
                    tx.commit().await.expect("commit");
                    wakers.iter().for_each(DispatchWaker::wake);
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("a producer panicked");
    }
    started.elapsed()
}

/// Starts the profile's dispatchers and waits until the broker has confirmed and the outbox has
/// recorded all of `settings.messages`; with `live`, the producers commit run `live` meanwhile;
/// with `nowhere`, the dispatchers send to a sender that publishes nothing. Returns the time
/// from the dispatchers' start to the last delivery recorded.
async fn relay<DB: Store>(
    tables: &Tables<DB>,
    broker: &Broker,
    profile: Profile,
    settings: &Settings,
    live: Option<&str>,
    nowhere: bool,
) -> Result<Duration, String> {
    let n = settings.messages;
    let confirmed = Arc::new(AtomicUsize::new(0));
    let (mut dispatchers, mut wakers, mut stops) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..profile.dispatchers {
        let sender = broker.sender(confirmed.clone(), nowhere).await;
        let mut dispatcher = Dispatcher::new(tables.dispatching.clone(), sender);
        if let Some(batch) = profile.batch {
            dispatcher = dispatcher.batch_size(batch);
        }
        wakers.push(dispatcher.waker());
        let (stop, stopped) = oneshot::channel::<()>();
        stops.push(stop);
        dispatchers.push(dispatcher.run(async {
            let _ = stopped.await;
        }));
    }
    let started = Instant::now();
    let running: Vec<_> = dispatchers.into_iter().map(tokio::spawn).collect();
    let producing = async {
        if let Some(run) = live {
            produce(tables, run, settings, wakers).await;
        }
    };
    // Generous: a relay this slow is a finding in itself, but the run must still end.
    let deadline = started + Duration::from_secs(60) + Duration::from_millis(10 * n as u64);
    let delivered = async {
        while confirmed.load(Ordering::Relaxed) < n {
            if Instant::now() > deadline {
                return Err(format!(
                    "only {} of {n} confirmed in {:?}",
                    confirmed.load(Ordering::Relaxed),
                    started.elapsed()
                ));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // Confirmed by the broker; what remains is the dispatcher recording the last outcomes.
        loop {
            let (count, _) = DB::delivered(&tables.pool).await;
            if count as usize >= n {
                return Ok(started.elapsed());
            }
            if Instant::now() > deadline {
                return Err(format!("only {count} of {n} recorded delivered"));
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    };
    let ((), elapsed) = tokio::join!(producing, delivered);
    for stop in stops {
        let _ = stop.send(());
    }
    for task in running {
        task.await.expect("a dispatcher panicked");
    }
    let elapsed = elapsed?;
    let (count, attempts) = DB::delivered(&tables.pool).await;
    if count as usize != n || attempts as usize != n {
        return Err(format!(
            "the outbox shows {count} delivered after {attempts} attempts, for {n} messages"
        ));
    }
    Ok(elapsed)
}

#[derive(Debug, Clone, Copy)]
enum Scenario {
    Relay,
    Bare,
    Live,
    /// The relay without a broker: the dispatcher's database work alone.
    Nowhere,
}

/// One table row's measurements, every round's.
struct Row {
    store: &'static str,
    broker: &'static str,
    profile: Profile,
    commit: Vec<f64>,
    relay: Vec<f64>,
    bare: Vec<f64>,
    live: Vec<f64>,
    nowhere: Vec<f64>,
    errors: Vec<String>,
}

fn median(values: &[f64]) -> Option<f64> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => None,
        len if len % 2 == 1 => Some(sorted[len / 2]),
        len => Some((sorted[len / 2 - 1] + sorted[len / 2]) / 2.0),
    }
}

/// Measures one row; `nowhere` adds the broker-less relay (once per store and profile is
/// enough: it does not depend on the broker).
async fn measure<DB: Store>(
    pool: &Pool<DB>,
    broker: &Broker,
    profile: Profile,
    settings: &Settings,
    tag: u32,
    nowhere: bool,
) -> Row {
    let outbox = Outbox::new(pool.clone());
    let own_pool = match profile.own_pool {
        Some(size) => Some(
            sqlx::pool::PoolOptions::<DB>::new()
                .max_connections(size)
                .connect_with((*pool.connect_options()).clone())
                .await
                .expect("the dispatchers' pool"),
        ),
        None => None,
    };
    let tables = Tables {
        pool: pool.clone(),
        dispatching: own_pool.clone().map_or_else(|| outbox.clone(), Outbox::new),
        outbox,
    };
    let n = settings.messages;
    let mut row = Row {
        store: DB::LABEL,
        broker: broker.name(),
        profile,
        commit: Vec::new(),
        relay: Vec::new(),
        bare: Vec::new(),
        live: Vec::new(),
        nowhere: Vec::new(),
        errors: Vec::new(),
    };
    let mut scenarios = vec![Scenario::Relay, Scenario::Bare];
    if settings.live {
        scenarios.push(Scenario::Live);
    }
    if nowhere {
        scenarios.push(Scenario::Nowhere);
    }
    for round in 0..settings.rounds {
        for turn in 0..scenarios.len() {
            let scenario = scenarios[(round + turn) % scenarios.len()];
            // Ids of this run only: JetStream's duplicate window must never drop a message
            // another run already sent.
            let run = format!(
                "{tag}/{}/{}/{}/{round}/{scenario:?}",
                DB::LABEL,
                broker.name(),
                profile.label()
            );
            let expected: HashSet<String> = match scenario {
                Scenario::Nowhere => HashSet::new(),
                _ => (0..n).map(|i| key(&run, i).as_str().to_owned()).collect(),
            };
            let measured = match scenario {
                Scenario::Bare => {
                    // Built before the clock starts: the relay's messages are built by the
                    // producers, outside its timing too.
                    let messages: Vec<_> = (0..n)
                        .map(|i| (key(&run, i), payload(i, settings.payload)))
                        .collect();
                    let elapsed = broker.bare(&messages, profile.window()).await;
                    Ok((&mut row.bare, elapsed))
                }
                Scenario::Relay => {
                    DB::clear(pool).await;
                    let committing = produce(&tables, &run, settings, Vec::new()).await;
                    row.commit.push(n as f64 / committing.as_secs_f64());
                    relay(&tables, broker, profile, settings, None, false)
                        .await
                        .map(|elapsed| (&mut row.relay, elapsed))
                }
                Scenario::Live => {
                    DB::clear(pool).await;
                    relay(&tables, broker, profile, settings, Some(&run), false)
                        .await
                        .map(|elapsed| (&mut row.live, elapsed))
                }
                Scenario::Nowhere => {
                    DB::clear(pool).await;
                    produce(&tables, &run, settings, Vec::new()).await;
                    relay(&tables, broker, profile, settings, None, true)
                        .await
                        .map(|elapsed| (&mut row.nowhere, elapsed))
                }
            };
            let verified = broker.verify_and_empty(&expected).await;
            match (measured, verified) {
                (Ok((figures, elapsed)), Ok(())) => {
                    figures.push(n as f64 / elapsed.as_secs_f64());
                }
                (Err(error), _) | (_, Err(error)) => row.errors.push(format!(
                    "{} × {} ({}), {scenario:?} round {round}: {error}",
                    DB::LABEL,
                    broker.name(),
                    profile.label()
                )),
            }
        }
    }
    if let Some(own_pool) = own_pool {
        own_pool.close().await;
    }
    row
}

async fn measure_store<DB: Store>(
    pool: &Pool<DB>,
    brokers: &[Broker],
    profiles: &[Profile],
    settings: &Settings,
    tag: u32,
    rows: &mut Vec<Row>,
) {
    Outbox::new(pool.clone())
        .migrate()
        .await
        .expect("migrate the outbox");
    for (index, broker) in brokers.iter().enumerate() {
        for &profile in profiles {
            let row = measure(pool, broker, profile, settings, tag, index == 0).await;
            eprintln!(
                "measured {} × {} ({}): relay {:?}, bare {:?} msg/s",
                row.store,
                row.broker,
                profile.label(),
                row.relay.iter().map(|v| v.round()).collect::<Vec<_>>(),
                row.bare.iter().map(|v| v.round()).collect::<Vec<_>>()
            );
            rows.push(row);
        }
    }
}

fn rate(value: Option<f64>) -> String {
    value.map_or_else(|| "–".to_owned(), |v| format!("{v:.0}"))
}

fn print(rows: &[Row], settings: &Settings) {
    println!(
        "\n## Outbox relay against a bare publisher\n\n{} messages of {} bytes per run, \
         medians of {} rounds\n",
        settings.messages, settings.payload, settings.rounds
    );
    println!(
        "| store | broker | dispatcher | bare msg/s | relay msg/s | relay / bare | target | met |"
    );
    println!("|---|---|---|---:|---:|---:|---:|---|");
    for row in rows {
        let (bare, relay) = (median(&row.bare), median(&row.relay));
        let ratio = bare.zip(relay).map(|(bare, relay)| relay / bare);
        let met = match ratio {
            _ if !row.errors.is_empty() => "invalid",
            Some(ratio) if ratio >= 0.5 => "yes",
            Some(_) => "**no**",
            None => "–",
        };
        println!(
            "| {} | {} | {} | {} | {} | {} | ≥ 0.50 | {met} |",
            row.store,
            row.broker,
            row.profile.label(),
            rate(bare),
            rate(relay),
            ratio.map_or_else(|| "–".to_owned(), |r| format!("{r:.2}"))
        );
    }
    println!(
        "\n## Committing, and end to end\n\n`commit`: the producers alone ({} concurrent, one \
         message per transaction, no dispatcher running); `live`: producers and dispatcher \
         together, first commit to last delivery recorded; `relay, no broker`: the relay to a \
         sender that confirms at once (the dispatcher's database work alone; measured with the \
         first broker, `–` on the others)\n",
        settings.producers
    );
    println!(
        "| store | broker | dispatcher | commit msg/s | relay, no broker msg/s | live msg/s | \
         live / bare |"
    );
    println!("|---|---|---|---:|---:|---:|---:|");
    for row in rows {
        let (bare, live) = (median(&row.bare), median(&row.live));
        println!(
            "| {} | {} | {} | {} | {} | {} | {} |",
            row.store,
            row.broker,
            row.profile.label(),
            rate(median(&row.commit)),
            rate(median(&row.nowhere)),
            rate(live),
            bare.zip(live)
                .map_or_else(|| "–".to_owned(), |(b, l)| format!("{:.2}", l / b))
        );
    }
    let errors: Vec<_> = rows.iter().flat_map(|row| &row.errors).collect();
    if !errors.is_empty() {
        println!("\n## Runs that failed verification (not counted)\n");
        for error in errors {
            println!("- {error}");
        }
    }
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
    let mut rows = Vec::new();
    // Caught so the queues, streams and schema of this run are deleted whatever happens.
    let measured = AssertUnwindSafe(measure_stores(&brokers, &settings, tag, &mut rows))
        .catch_unwind()
        .await;
    for broker in brokers {
        broker.delete().await;
    }
    if let Err(panic) = measured {
        std::panic::resume_unwind(panic);
    }
    print(&rows, &settings);
    if rows.iter().any(|row| !row.errors.is_empty()) {
        std::process::exit(1);
    }
}

async fn measure_stores(brokers: &[Broker], settings: &Settings, tag: u32, rows: &mut Vec<Row>) {
    for store in env_list("OUTBOX_BENCH_STORES", "sqlite,postgres") {
        match store.as_str() {
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
                    measure_store(&pool, brokers, &profiles(None), settings, tag, rows).await;
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
