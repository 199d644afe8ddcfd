//! Throughput of the inbox consumer against a bare consumer that acks without dedupe, on the
//! same JetStream stream and the same number of messages: `cargo bench --bench inbox
//! --features nats,postgres`. Each delivery of the inbox claims its key, inserts one row and
//! commits before the ack; the bare consumer only acks. Prints messages per second and the
//! ratio. `INBOX_BENCH_MESSAGES` (default 2000), `INBOX_BENCH_CONCURRENCY` (default 8).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::pull, stream};
use axum_idempotency::inbox::nats::NatsConsumer;
use axum_idempotency::inbox::{Delivery, Failure, Inbox};
use axum_idempotency::{Store, Tx};
use bytes::Bytes;
use futures_util::StreamExt;

const NATS: &str = "nats://127.0.0.1:4222";

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

async fn publish(js: &jetstream::Context, subject: &str, messages: usize) {
    let mut acks = Vec::with_capacity(messages);
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
    }
    for ack in acks {
        ack.await.expect("stream ack");
    }
}

async fn bare(js: &jetstream::Context, name: &str, messages: usize, concurrency: usize) -> f64 {
    let stream = js
        .get_or_create_stream(stream::Config {
            name: name.to_owned(),
            subjects: vec![format!("{name}.>")],
            ..Default::default()
        })
        .await
        .expect("stream");
    publish(js, &format!("{name}.events"), messages).await;
    let consumer: jetstream::consumer::PullConsumer = stream
        .get_or_create_consumer(
            "bare",
            pull::Config {
                durable_name: Some("bare".into()),
                ..Default::default()
            },
        )
        .await
        .expect("consumer");
    let acked = AtomicU64::new(0);
    let started = Instant::now();
    let messages_stream = consumer
        .stream()
        .max_messages_per_batch(concurrency)
        .messages()
        .await
        .expect("messages");
    messages_stream
        .take(messages)
        .for_each_concurrent(concurrency, |message| {
            let acked = &acked;
            async move {
                if let Ok(message) = message {
                    let _ = message.ack().await;
                    acked.fetch_add(1, Ordering::Relaxed);
                }
            }
        })
        .await;
    let elapsed = started.elapsed().as_secs_f64();
    let _ = js.delete_stream(name).await;
    acked.load(Ordering::Relaxed) as f64 / elapsed
}

/// A consumer without dedupe that still writes: one insert committed per message, then the
/// ack. The gap between it and the inbox is the price of the claim itself.
async fn plain<DB>(
    js: &jetstream::Context,
    pool: sqlx::Pool<DB>,
    insert: &'static str,
    name: &str,
    messages: usize,
    concurrency: usize,
) -> f64
where
    DB: axum_idempotency::Backend,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    let stream = js
        .get_or_create_stream(stream::Config {
            name: name.to_owned(),
            subjects: vec![format!("{name}.>")],
            ..Default::default()
        })
        .await
        .expect("stream");
    publish(js, &format!("{name}.events"), messages).await;
    let consumer: jetstream::consumer::PullConsumer = stream
        .get_or_create_consumer(
            "plain",
            pull::Config {
                durable_name: Some("plain".into()),
                ..Default::default()
            },
        )
        .await
        .expect("consumer");
    let started = Instant::now();
    let messages_stream = consumer
        .stream()
        .max_messages_per_batch(concurrency)
        .messages()
        .await
        .expect("messages");
    messages_stream
        .take(messages)
        .for_each_concurrent(concurrency, |message| {
            let pool = pool.clone();
            async move {
                if let Ok(message) = message {
                    let mut tx = pool.begin().await.expect("begin");
                    let key = String::from_utf8_lossy(&message.payload).into_owned();
                    sqlx::query(insert)
                        .bind(key)
                        .execute(&mut *tx)
                        .await
                        .expect("insert");
                    tx.commit().await.expect("commit");
                    let _ = message.ack().await;
                }
            }
        })
        .await;
    let elapsed = started.elapsed().as_secs_f64();
    let _ = js.delete_stream(name).await;
    messages as f64 / elapsed
}

async fn inbox<DB>(
    js: &jetstream::Context,
    store: Store<DB>,
    insert: &'static str,
    name: &str,
    messages: usize,
    concurrency: usize,
) -> f64
where
    DB: axum_idempotency::Backend,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    let inbox = Inbox::new(name.to_owned(), store).key_by(|d: &Delivery| {
        String::from_utf8(d.payload().to_vec()).map_err(|_| Failure::permanent("not UTF-8"))
    });
    let consumer = NatsConsumer::new(inbox.clone(), js.clone(), name, "inbox")
        .stream_subjects([format!("{name}.>")])
        .dead_letters(format!("{name}_DEAD"), format!("{name}dead"))
        .concurrency(concurrency);
    consumer.declare().await.expect("declare");
    publish(js, &format!("{name}.events"), messages).await;
    let started = Instant::now();
    let running = tokio::spawn(consumer.run(
        move |mut tx: Tx<DB>, delivery: Delivery| async move {
            let key = String::from_utf8_lossy(delivery.payload()).into_owned();
            sqlx::query(insert)
                .bind(key)
                .execute(&mut *tx)
                .await
                .map_err(|e| Failure::retryable(e.to_string()))?;
            Ok(())
        },
    ));
    while inbox.stats().processed < messages as u64 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = started.elapsed().as_secs_f64();
    running.abort();
    let _ = js.delete_stream(name).await;
    let _ = js.delete_stream(format!("{name}_DEAD")).await;
    messages as f64 / elapsed
}

#[tokio::main]
async fn main() {
    // `cargo test --benches` runs this with `--bench`-less arguments; only a real bench run
    // measures.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let messages = env_or("INBOX_BENCH_MESSAGES", 2000);
    let concurrency = env_or("INBOX_BENCH_CONCURRENCY", 8);
    let js = jetstream::new(
        async_nats::connect(NATS)
            .await
            .expect("NATS must be reachable at 127.0.0.1:4222"),
    );
    let tag = std::process::id();
    let bare_rate = bare(&js, &format!("BENCH_BARE_{tag}"), messages, concurrency).await;
    println!("bare consumer (ack only):      {bare_rate:>8.0} msg/s");

    let dir = tempfile::tempdir().expect("tempdir");
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(dir.path().join("bench.db"))
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal);
    let sqlite = sqlx::SqlitePool::connect_with(options)
        .await
        .expect("sqlite");
    sqlx::query("CREATE TABLE effects (key TEXT NOT NULL)")
        .execute(&sqlite)
        .await
        .expect("table");
    let rate = plain(
        &js,
        sqlite.clone(),
        "INSERT INTO effects (key) VALUES ($1)",
        &format!("BENCH_SQLITE_PLAIN_{tag}"),
        messages,
        concurrency,
    )
    .await;
    println!(
        "plain insert + ack, SQLite:    {rate:>8.0} msg/s  ({:.2}x the bare consumer)",
        rate / bare_rate
    );
    let plain_sqlite = rate;
    let store = axum_idempotency::SqliteStore::new(sqlite);
    store.migrate().await.expect("migrate");
    let rate = inbox(
        &js,
        store,
        "INSERT INTO effects (key) VALUES ($1)",
        &format!("BENCH_SQLITE_{tag}"),
        messages,
        concurrency,
    )
    .await;
    println!(
        "inbox consumer, SQLite:        {rate:>8.0} msg/s  ({:.2}x the bare consumer, {:.2}x plain insert)",
        rate / bare_rate,
        rate / plain_sqlite
    );

    #[cfg(feature = "postgres")]
    {
        let url = std::env::var("TEST_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        let admin = sqlx::PgPool::connect(&url).await.expect("PostgreSQL");
        let schema = format!("t_{tag}_bench");
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}; \
             CREATE TABLE {schema}.effects (key TEXT NOT NULL)"
        )))
        .execute(&admin)
        .await
        .expect("schema");
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(16)
            .connect(&format!("{url}?options=-c%20search_path%3D{schema}"))
            .await
            .expect("PostgreSQL");
        let plain_pg = plain(
            &js,
            pool.clone(),
            "INSERT INTO effects (key) VALUES ($1)",
            &format!("BENCH_PG_PLAIN_{tag}"),
            messages,
            concurrency,
        )
        .await;
        println!(
            "plain insert + ack, PostgreSQL:{plain_pg:>8.0} msg/s  ({:.2}x the bare consumer)",
            plain_pg / bare_rate
        );
        let store = axum_idempotency::PgStore::new(pool);
        store.migrate().await.expect("migrate");
        let rate = inbox(
            &js,
            store,
            "INSERT INTO effects (key) VALUES ($1)",
            &format!("BENCH_PG_{tag}"),
            messages,
            concurrency,
        )
        .await;
        println!(
            "inbox consumer, PostgreSQL:    {rate:>8.0} msg/s  ({:.2}x the bare consumer, {:.2}x plain insert)",
            rate / bare_rate,
            rate / plain_pg
        );
        let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
            .execute(&admin)
            .await;
    }
}
