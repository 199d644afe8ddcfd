//! The inbox on real databases (SQLite, PostgreSQL) and real brokers (RabbitMQ, NATS
//! JetStream): rollback of a failed handler, concurrent deliveries of one key, poison messages
//! dead-lettered after their attempts and replayed once after the fix.
//!
//! Every test uses broker names and a schema of its own and deletes the broker names at the
//! end. An unreachable broker or database fails the test.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use async_nats::jetstream;
use axum_idempotency::Tx;
use axum_idempotency::inbox::nats::NatsConsumer;
use axum_idempotency::inbox::rabbitmq::RabbitMqConsumer;
use axum_idempotency::inbox::{Delivery, Failure, Inbox, ReplayReport, Verdict};
use bytes::Bytes;
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeleteOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection};
use sqlx::{Database, Pool};

mod common;

use axum_idempotency::Store;
use common::{Backend, unique};

const AMQP: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
const NATS: &str = "nats://127.0.0.1:4222";

/// A database with an `effects` table, and the inbox's store on it.
trait TestDb: Backend {
    const CREATE: &'static str;
    const INSERT: &'static str;
}

impl TestDb for sqlx::Sqlite {
    const CREATE: &'static str = "CREATE TABLE effects (payment_id TEXT NOT NULL)";
    const INSERT: &'static str = "INSERT INTO effects (payment_id) VALUES ($1)";
}

#[cfg(feature = "postgres")]
impl TestDb for sqlx::Postgres {
    const CREATE: &'static str = "CREATE TABLE effects (payment_id TEXT NOT NULL)";
    const INSERT: &'static str = "INSERT INTO effects (payment_id) VALUES ($1)";
}

#[cfg(feature = "mysql")]
impl TestDb for sqlx::MySql {
    const CREATE: &'static str = "CREATE TABLE effects (payment_id VARCHAR(255) NOT NULL)";
    const INSERT: &'static str = "INSERT INTO effects (payment_id) VALUES (?)";
}

async fn setup<DB: TestDb>() -> (Pool<DB>, Store<DB>)
where
    for<'c> &'c Pool<DB>: sqlx::Executor<'c, Database = DB>,
{
    let pool = DB::fresh(8).await.pool;
    sqlx::raw_sql(DB::CREATE).execute(&pool).await.unwrap();
    let store = DB::store(pool.clone());
    store.migrate().await.unwrap();
    (pool, store)
}

async fn count<DB: Database>(pool: &Pool<DB>, sql: &'static str) -> i64
where
    for<'c> &'c Pool<DB>: sqlx::Executor<'c, Database = DB>,
    i64: for<'r> sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
    for<'q> <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
{
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

fn by_payload(delivery: &Delivery) -> Result<String, Failure> {
    std::str::from_utf8(delivery.payload())
        .map(str::to_owned)
        .map_err(|_| Failure::permanent("not UTF-8"))
}

// ------------------------------------------------------------------ broker-agnostic core

async fn a_handler_that_writes_then_fails_leaves_no_row_and_no_record<DB: TestDb>()
where
    for<'c> &'c Pool<DB>: sqlx::Executor<'c, Database = DB>,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    i64: for<'r> sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
    for<'q> <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    let (pool, store) = setup::<DB>().await;
    let inbox = Inbox::new("orders", store).key_by(by_payload);
    let write_then_fail = |mut tx: Tx<DB>, delivery: Delivery| async move {
        let key = by_payload(&delivery)?;
        sqlx::query(DB::INSERT)
            .bind(key)
            .execute(&mut *tx)
            .await
            .map_err(|e| Failure::retryable(e.to_string()))?;
        Err(Failure::retryable("downstream timed out"))
    };
    let verdict = inbox
        .handle(Delivery::new("p-1").message_id("m-1"), write_then_fail)
        .await;
    assert!(matches!(verdict, Verdict::Retry { .. }), "{verdict:?}");
    assert_eq!(count(&pool, "SELECT COUNT(*) FROM effects").await, 0);
    assert_eq!(
        count(&pool, "SELECT COUNT(*) FROM idempotency_records").await,
        0,
        "a retryable failure must leave no dedupe record"
    );
    assert!(!inbox.is_applied(&Delivery::new("p-1")).await.unwrap());

    // The next attempt runs afresh and applies once.
    let apply = |mut tx: Tx<DB>, delivery: Delivery| async move {
        sqlx::query(DB::INSERT)
            .bind(by_payload(&delivery)?)
            .execute(&mut *tx)
            .await
            .map_err(|e| Failure::retryable(e.to_string()))?;
        Ok(())
    };
    let again = Delivery::new("p-1").message_id("m-1").attempt(2);
    assert_eq!(inbox.handle(again.clone(), apply).await, Verdict::Applied);
    assert_eq!(inbox.handle(again, apply).await, Verdict::Duplicate);
    assert_eq!(count(&pool, "SELECT COUNT(*) FROM effects").await, 1);
    let stats = inbox.stats();
    assert_eq!(
        (stats.processed, stats.duplicates, stats.retried, stats.dead),
        (1, 1, 1, 0)
    );
}

async fn two_deliveries_of_one_key_at_once_apply_once<DB: TestDb>()
where
    for<'c> &'c Pool<DB>: sqlx::Executor<'c, Database = DB>,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    i64: for<'r> sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
    for<'q> <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    let (pool, store) = setup::<DB>().await;
    let inbox = Inbox::new("orders", store).key_by(by_payload);
    let slow = |mut tx: Tx<DB>, delivery: Delivery| async move {
        sqlx::query(DB::INSERT)
            .bind(by_payload(&delivery)?)
            .execute(&mut *tx)
            .await
            .map_err(|e| Failure::retryable(e.to_string()))?;
        tokio::time::sleep(Duration::from_millis(300)).await;
        Ok(())
    };
    let (a, b) = tokio::join!(
        inbox.handle(Delivery::new("p-9").message_id("m-1"), slow),
        inbox.handle(Delivery::new("p-9").message_id("m-2"), slow),
    );
    let mut verdicts = [a, b];
    verdicts.sort_by_key(|v| format!("{v:?}"));
    assert_eq!(verdicts, [Verdict::Applied, Verdict::Duplicate]);
    assert_eq!(count(&pool, "SELECT COUNT(*) FROM effects").await, 1);
}

#[tokio::test]
async fn sqlite_a_handler_that_writes_then_fails_leaves_no_row_and_no_record() {
    a_handler_that_writes_then_fails_leaves_no_row_and_no_record::<sqlx::Sqlite>().await;
}

#[tokio::test]
async fn sqlite_two_deliveries_of_one_key_at_once_apply_once() {
    two_deliveries_of_one_key_at_once_apply_once::<sqlx::Sqlite>().await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn postgres_a_handler_that_writes_then_fails_leaves_no_row_and_no_record() {
    a_handler_that_writes_then_fails_leaves_no_row_and_no_record::<sqlx::Postgres>().await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn postgres_two_deliveries_of_one_key_at_once_apply_once() {
    two_deliveries_of_one_key_at_once_apply_once::<sqlx::Postgres>().await;
}

// ------------------------------------------------------------------ poison on real brokers

#[derive(Clone, Copy, Debug)]
enum Kind {
    RabbitMq,
    Nats,
}

/// A poison message: its handler writes, then fails (retryable) until `fixed` is set. After
/// `max_attempts` it is dead-lettered with nothing written; once fixed, a replay applies it
/// once and a second replay finds nothing left.
async fn poison_is_dead_lettered_then_replayed_once<DB: TestDb>(kind: Kind)
where
    for<'c> &'c Pool<DB>: sqlx::Executor<'c, Database = DB>,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    i64: for<'r> sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
    for<'q> <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    let (pool, store) = setup::<DB>().await;
    let inbox = Inbox::new("orders", store)
        .key_by(by_payload)
        .max_attempts(3)
        .backoff(Duration::from_millis(20), Duration::from_millis(100));
    let fixed = Arc::new(AtomicBool::new(false));
    let attempts = Arc::new(AtomicU32::new(0));
    let handler = {
        let fixed = fixed.clone();
        let attempts = attempts.clone();
        move |mut tx: Tx<DB>, delivery: Delivery| {
            let fixed = fixed.load(Ordering::SeqCst);
            attempts.fetch_add(1, Ordering::SeqCst);
            async move {
                sqlx::query(DB::INSERT)
                    .bind(by_payload(&delivery)?)
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| Failure::retryable(e.to_string()))?;
                if fixed {
                    Ok(())
                } else {
                    Err(Failure::retryable("the order service is down"))
                }
            }
        }
    };
    let ns = unique("t");
    let report: ReplayReport;
    let again: ReplayReport;
    match kind {
        Kind::RabbitMq => {
            let connection = Arc::new(
                Connection::connect(AMQP, Default::default())
                    .await
                    .expect("RabbitMQ must be reachable at 127.0.0.1:5672"),
            );
            let queue = format!("{ns}.orders");
            let exchange = format!("{ns}.payments");
            let consumer = RabbitMqConsumer::new(inbox.clone(), connection.clone(), &queue)
                .bind(&exchange, "payment.succeeded");
            consumer.declare().await.unwrap();
            let running = tokio::spawn(
                RabbitMqConsumer::new(inbox.clone(), connection.clone(), &queue)
                    .run(handler.clone()),
            );
            let channel = connection.create_channel().await.unwrap();
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await
                .unwrap();
            channel
                .basic_publish(
                    exchange.as_str().into(),
                    "payment.succeeded".into(),
                    BasicPublishOptions::default(),
                    b"p-poison",
                    BasicProperties::default().with_message_id("m-1".into()),
                )
                .await
                .unwrap()
                .await
                .unwrap();
            let dead = consumer.dead_letter_queue();
            let waiting = || async {
                channel
                    .queue_declare(
                        dead.as_str().into(),
                        QueueDeclareOptions {
                            passive: true,
                            ..QueueDeclareOptions::default()
                        },
                        FieldTable::default(),
                    )
                    .await
                    .unwrap()
                    .message_count()
            };
            eventually(|| async { waiting().await == 1 }).await;
            running.abort();
            assert_eq!(attempts.load(Ordering::SeqCst), 3, "dead after 3 attempts");
            assert_eq!(count(&pool, "SELECT COUNT(*) FROM effects").await, 0);
            assert!(!inbox.is_applied(&Delivery::new("p-poison")).await.unwrap());

            fixed.store(true, Ordering::SeqCst);
            report = consumer.replay_dead(handler.clone(), 100).await.unwrap();
            again = consumer.replay_dead(handler, 100).await.unwrap();
            assert_eq!(waiting().await, 0);
            for q in [queue.clone(), format!("{queue}.retry"), dead.clone()] {
                let _ = channel
                    .queue_delete(q.into(), QueueDeleteOptions::default())
                    .await;
            }
            let _ = channel
                .exchange_delete(exchange.into(), ExchangeDeleteOptions::default())
                .await;
        }
        Kind::Nats => {
            let js = jetstream::new(
                async_nats::connect(NATS)
                    .await
                    .expect("NATS must be reachable at 127.0.0.1:4222"),
            );
            let stream = ns.to_uppercase();
            let dead_stream = format!("{stream}_DEAD");
            let make = || {
                NatsConsumer::new(inbox.clone(), js.clone(), &stream, "orders")
                    .stream_subjects([format!("{ns}.payments.>")])
                    .filter_subject(format!("{ns}.payments.succeeded"))
                    .dead_letters(&dead_stream, format!("{ns}.orders.dead"))
                    .ack_wait(Duration::from_secs(2))
            };
            let consumer = make();
            consumer.declare().await.unwrap();
            let running = tokio::spawn(make().run(handler.clone()));
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(async_nats::header::NATS_MESSAGE_ID, "m-1");
            js.publish_with_headers(
                format!("{ns}.payments.succeeded"),
                headers,
                Bytes::from_static(b"p-poison"),
            )
            .await
            .unwrap()
            .await
            .unwrap();
            let waiting = || async {
                let mut s = js.get_stream(&dead_stream).await.unwrap();
                s.info().await.unwrap().state.messages
            };
            eventually(|| async { waiting().await == 1 }).await;
            running.abort();
            assert_eq!(attempts.load(Ordering::SeqCst), 3, "dead after 3 attempts");
            assert_eq!(count(&pool, "SELECT COUNT(*) FROM effects").await, 0);
            assert!(!inbox.is_applied(&Delivery::new("p-poison")).await.unwrap());

            fixed.store(true, Ordering::SeqCst);
            report = consumer.replay_dead(handler.clone(), 100).await.unwrap();
            again = consumer.replay_dead(handler, 100).await.unwrap();
            assert_eq!(waiting().await, 0);
            let _ = js.delete_stream(&stream).await;
            let _ = js.delete_stream(&dead_stream).await;
        }
    }
    assert_eq!(
        (report.applied, report.duplicates, report.still_dead),
        (1, 0, 0),
        "{kind:?}"
    );
    assert_eq!(
        (again.applied, again.duplicates, again.still_dead),
        (0, 0, 0)
    );
    assert_eq!(count(&pool, "SELECT COUNT(*) FROM effects").await, 1);
    assert!(inbox.is_applied(&Delivery::new("p-poison")).await.unwrap());
    assert_eq!(inbox.stats().dead, 1);
}

async fn eventually<F, Fut>(mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !check().await {
        assert!(tokio::time::Instant::now() < deadline, "not within 20 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn rabbitmq_sqlite_poison_is_dead_lettered_then_replayed_once() {
    poison_is_dead_lettered_then_replayed_once::<sqlx::Sqlite>(Kind::RabbitMq).await;
}

#[tokio::test]
async fn nats_sqlite_poison_is_dead_lettered_then_replayed_once() {
    poison_is_dead_lettered_then_replayed_once::<sqlx::Sqlite>(Kind::Nats).await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn rabbitmq_postgres_poison_is_dead_lettered_then_replayed_once() {
    poison_is_dead_lettered_then_replayed_once::<sqlx::Postgres>(Kind::RabbitMq).await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn nats_postgres_poison_is_dead_lettered_then_replayed_once() {
    poison_is_dead_lettered_then_replayed_once::<sqlx::Postgres>(Kind::Nats).await;
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn mariadb_a_handler_that_writes_then_fails_leaves_no_row_and_no_record() {
    a_handler_that_writes_then_fails_leaves_no_row_and_no_record::<sqlx::MySql>().await;
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn mariadb_two_deliveries_of_one_key_at_once_apply_once() {
    two_deliveries_of_one_key_at_once_apply_once::<sqlx::MySql>().await;
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn rabbitmq_mariadb_poison_is_dead_lettered_then_replayed_once() {
    poison_is_dead_lettered_then_replayed_once::<sqlx::MySql>(Kind::RabbitMq).await;
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn nats_mariadb_poison_is_dead_lettered_then_replayed_once() {
    poison_is_dead_lettered_then_replayed_once::<sqlx::MySql>(Kind::Nats).await;
}

/// With a finite retention, an expired dedupe record is purged in batches and the key is a
/// new intent again (which is why the default keeps records).
#[tokio::test]
async fn sqlite_expired_dedupe_records_are_purged_in_batches() {
    let (pool, store) = setup::<sqlx::Sqlite>().await;
    let inbox = Inbox::new("orders", store)
        .key_by(by_payload)
        .retention(Duration::from_millis(1));
    let apply = |mut tx: Tx<sqlx::Sqlite>, delivery: Delivery| async move {
        sqlx::query(<sqlx::Sqlite as TestDb>::INSERT)
            .bind(by_payload(&delivery)?)
            .execute(&mut *tx)
            .await
            .map_err(|e| Failure::retryable(e.to_string()))?;
        Ok(())
    };
    for key in ["p-1", "p-2", "p-3"] {
        assert_eq!(
            inbox.handle(Delivery::new(key), apply).await,
            Verdict::Applied
        );
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(inbox.purge_expired(2).await.unwrap(), 2);
    assert_eq!(inbox.purge_expired(2).await.unwrap(), 1);
    assert_eq!(inbox.purge_expired(2).await.unwrap(), 0);
    assert_eq!(
        count(&pool, "SELECT COUNT(*) FROM idempotency_records").await,
        0
    );
    assert_eq!(
        inbox.handle(Delivery::new("p-1"), apply).await,
        Verdict::Applied
    );
}

/// A publisher made the exchange (RabbitMQ: not durable, the protocol's default) or the stream
/// (NATS: memory storage, a max age) before the consumer started: the consumer takes them as
/// they are and consumes.
async fn accepts_what_a_publisher_created_first(kind: Kind) {
    let (pool, store) = setup::<sqlx::Sqlite>().await;
    let inbox = Inbox::new("orders", store).key_by(by_payload);
    let apply = |mut tx: Tx<sqlx::Sqlite>, delivery: Delivery| async move {
        sqlx::query(<sqlx::Sqlite as TestDb>::INSERT)
            .bind(by_payload(&delivery)?)
            .execute(&mut *tx)
            .await
            .map_err(|e| Failure::retryable(e.to_string()))?;
        Ok(())
    };
    let ns = unique("t");
    match kind {
        Kind::RabbitMq => {
            let connection = Arc::new(
                Connection::connect(AMQP, Default::default())
                    .await
                    .expect("RabbitMQ must be reachable at 127.0.0.1:5672"),
            );
            let exchange = format!("{ns}.payments");
            let queue = format!("{ns}.orders");
            let channel = connection.create_channel().await.unwrap();
            channel
                .exchange_declare(
                    exchange.as_str().into(),
                    lapin::ExchangeKind::Topic,
                    lapin::options::ExchangeDeclareOptions::default(),
                    FieldTable::default(),
                )
                .await
                .unwrap();
            let consumer = RabbitMqConsumer::new(inbox.clone(), connection.clone(), &queue)
                .bind(&exchange, "payment.succeeded");
            consumer.declare().await.unwrap();
            let running = tokio::spawn(consumer.run(apply));
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await
                .unwrap();
            channel
                .basic_publish(
                    exchange.as_str().into(),
                    "payment.succeeded".into(),
                    BasicPublishOptions::default(),
                    b"p-1",
                    BasicProperties::default().with_message_id("m-1".into()),
                )
                .await
                .unwrap()
                .await
                .unwrap();
            eventually(|| async { inbox.stats().processed == 1 }).await;
            running.abort();
            for q in [
                queue.clone(),
                format!("{queue}.retry"),
                format!("{queue}.dead"),
            ] {
                let _ = channel
                    .queue_delete(q.into(), QueueDeleteOptions::default())
                    .await;
            }
            let _ = channel
                .exchange_delete(exchange.into(), ExchangeDeleteOptions::default())
                .await;
        }
        Kind::Nats => {
            let js = jetstream::new(
                async_nats::connect(NATS)
                    .await
                    .expect("NATS must be reachable at 127.0.0.1:4222"),
            );
            let stream = ns.to_uppercase();
            js.create_stream(jetstream::stream::Config {
                name: stream.clone(),
                subjects: vec![format!("{ns}.payments.>")],
                storage: jetstream::stream::StorageType::Memory,
                max_age: Duration::from_secs(600),
                ..Default::default()
            })
            .await
            .unwrap();
            let consumer = NatsConsumer::new(inbox.clone(), js.clone(), &stream, "orders")
                // Would differ from the stream's subjects if it were created here.
                .stream_subjects([format!("{ns}.other.>")])
                .filter_subject(format!("{ns}.payments.succeeded"))
                .dead_letters(format!("{stream}_DEAD"), format!("{ns}.orders.dead"));
            consumer.declare().await.unwrap();
            let running = tokio::spawn(consumer.run(apply));
            js.publish(
                format!("{ns}.payments.succeeded"),
                Bytes::from_static(b"p-1"),
            )
            .await
            .unwrap()
            .await
            .unwrap();
            eventually(|| async { inbox.stats().processed == 1 }).await;
            running.abort();
            let _ = js.delete_stream(&stream).await;
            let _ = js.delete_stream(format!("{stream}_DEAD")).await;
        }
    }
    assert_eq!(count(&pool, "SELECT COUNT(*) FROM effects").await, 1);
}

#[tokio::test]
async fn rabbitmq_accepts_an_exchange_a_publisher_created_first() {
    accepts_what_a_publisher_created_first(Kind::RabbitMq).await;
}

#[tokio::test]
async fn nats_accepts_a_stream_a_publisher_created_first() {
    accepts_what_a_publisher_created_first(Kind::Nats).await;
}
