//! The inbox on real databases (SQLite, PostgreSQL, MariaDB) and real brokers (RabbitMQ, NATS
//! JetStream): rollback of a failed handler, concurrent deliveries of one key, expiry, jittered
//! retries, poison messages dead-lettered after their attempts (their reason logged and kept
//! in a header) and replayed once after the fix.
//!
//! Every test uses broker names and a database of its own and deletes both at the end. An
//! unreachable broker or database fails the test.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use async_nats::jetstream;
use axum_idempotency::Tx;
use axum_idempotency::inbox::nats::NatsConsumer;
use axum_idempotency::inbox::rabbitmq::RabbitMqConsumer;
use axum_idempotency::inbox::{Delivery, Failure, Inbox, ReplayReport, Verdict};
use bytes::Bytes;
use common::logs::Captured;
use lapin::BasicProperties;
use lapin::options::{BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use sqlx::{Database, Pool};

mod common;

use axum_idempotency::Store;
use common::{Backend, Isolated, nats, rabbitmq, unique};

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

/// A database of its own with the `effects` table and a migrated store; `DB::dispose` it at
/// the end.
async fn setup<DB: TestDb>() -> (Isolated<DB>, Store<DB>)
where
    for<'c> &'c Pool<DB>: sqlx::Executor<'c, Database = DB>,
{
    let db = DB::fresh(8).await;
    sqlx::raw_sql(DB::CREATE).execute(&db.pool).await.unwrap();
    let store = DB::store(db.pool.clone());
    store.migrate().await.unwrap();
    (db, store)
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
    let (db, store) = setup::<DB>().await;
    let pool = db.pool.clone();
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
        .handle(Delivery::new("p-1").with_message_id("m-1"), write_then_fail)
        .await;
    assert!(matches!(verdict, Verdict::Retry { .. }), "{verdict:?}");
    assert_eq!(count(&pool, "SELECT COUNT(*) FROM effects").await, 0);
    assert_eq!(
        count(&pool, "SELECT COUNT(*) FROM idempotency_inbox").await,
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
    let again = Delivery::new("p-1").with_message_id("m-1").with_attempt(2);
    assert_eq!(inbox.handle(again.clone(), apply).await, Verdict::Applied);
    assert_eq!(inbox.handle(again, apply).await, Verdict::Duplicate);
    assert_eq!(count(&pool, "SELECT COUNT(*) FROM effects").await, 1);
    let stats = inbox.stats();
    assert_eq!(
        (stats.processed, stats.duplicates, stats.retried, stats.dead),
        (1, 1, 1, 0)
    );
    DB::dispose(db).await;
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
    let (db, store) = setup::<DB>().await;
    let pool = db.pool.clone();
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
        inbox.handle(Delivery::new("p-9").with_message_id("m-1"), slow),
        inbox.handle(Delivery::new("p-9").with_message_id("m-2"), slow),
    );
    let mut verdicts = [a, b];
    verdicts.sort_by_key(|v| format!("{v:?}"));
    assert_eq!(verdicts, [Verdict::Applied, Verdict::Duplicate]);
    assert_eq!(count(&pool, "SELECT COUNT(*) FROM effects").await, 1);
    DB::dispose(db).await;
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
    let (db, store) = setup::<DB>().await;
    let pool = db.pool.clone();
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
            let connection = Arc::new(rabbitmq::connect().await);
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
            let waiting = || async { rabbitmq::waiting(&channel, &dead).await };
            eventually(|| async { waiting().await == 1 }).await;
            running.abort();
            assert_eq!(attempts.load(Ordering::SeqCst), 3, "dead after 3 attempts");
            assert_eq!(count(&pool, "SELECT COUNT(*) FROM effects").await, 0);
            assert!(!inbox.is_applied(&Delivery::new("p-poison")).await.unwrap());

            fixed.store(true, Ordering::SeqCst);
            report = consumer.replay_dead(handler.clone(), 100).await.unwrap();
            again = consumer.replay_dead(handler, 100).await.unwrap();
            assert_eq!(waiting().await, 0);
            delete_rabbitmq(&queue, &exchange).await;
        }
        Kind::Nats => {
            let js = nats::connect().await;
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
            let waiting = || async { nats::messages(&js, &dead_stream).await };
            eventually(|| async { waiting().await == 1 }).await;
            running.abort();
            assert_eq!(attempts.load(Ordering::SeqCst), 3, "dead after 3 attempts");
            assert_eq!(count(&pool, "SELECT COUNT(*) FROM effects").await, 0);
            assert!(!inbox.is_applied(&Delivery::new("p-poison")).await.unwrap());

            fixed.store(true, Ordering::SeqCst);
            report = consumer.replay_dead(handler.clone(), 100).await.unwrap();
            again = consumer.replay_dead(handler, 100).await.unwrap();
            assert_eq!(waiting().await, 0);
            nats::delete(&js, [&stream, &dead_stream]).await;
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
    DB::dispose(db).await;
}

/// Deletes the queues and the exchange a RabbitMQ test declared, on a connection of its own:
/// lapin closes a whole connection when the broker's cancel-ok for a consumer being dropped
/// arrives after it stopped waiting for one, which deleting the queue under that consumer can
/// cause, so the test's own connection may be gone by now.
async fn delete_rabbitmq(queue: &str, exchange: &str) {
    let connection = rabbitmq::connect().await;
    let channel = connection.create_channel().await.unwrap();
    let queues = [
        queue.to_owned(),
        format!("{queue}.retry"),
        format!("{queue}.dead"),
    ];
    rabbitmq::delete(&channel, queues, exchange).await;
    let _ = connection.close(200, "cleaned up".into()).await;
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

// ------------------------------------------------------------------ batches

/// Inserts the delivery's key into `effects`; returns how many rows its transaction saw there
/// before, and how many a connection of its own saw committed.
async fn insert_seeing<DB: TestDb>(
    tx: &mut Tx<DB>,
    pool: &Pool<DB>,
    key: String,
) -> Result<(i64, i64), Failure>
where
    for<'c> &'c Pool<DB>: sqlx::Executor<'c, Database = DB>,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    i64: for<'r> sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
    for<'q> <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    let in_tx: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM effects")
        .fetch_one(&mut **tx)
        .await
        .map_err(|e| Failure::retryable(e.to_string()))?;
    let committed: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM effects")
        .fetch_one(pool)
        .await
        .map_err(|e| Failure::retryable(e.to_string()))?;
    sqlx::query(DB::INSERT)
        .bind(key)
        .execute(&mut **tx)
        .await
        .map_err(|e| Failure::retryable(e.to_string()))?;
    Ok((in_tx, committed))
}

/// A batch claims its keys and runs its handlers in one transaction that commits once: each
/// handler sees the writes of those before it, and nothing is visible outside until the end.
/// A key applied before, a key twice in the batch and a malformed delivery are each answered
/// on their own, without running a handler.
async fn a_batch_applies_in_one_transaction_and_skips_what_was_applied<DB: TestDb>()
where
    for<'c> &'c Pool<DB>: sqlx::Executor<'c, Database = DB>,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    i64: for<'r> sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
    for<'q> <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    let (db, store) = setup::<DB>().await;
    let pool = db.pool.clone();
    let inbox = Inbox::new("orders", store).key_by(by_payload);
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let apply = {
        let (pool, seen) = (pool.clone(), Arc::clone(&seen));
        move |mut tx: Tx<DB>, delivery: Delivery| {
            let (pool, seen) = (pool.clone(), Arc::clone(&seen));
            async move {
                let key = by_payload(&delivery)?;
                let saw = insert_seeing(&mut tx, &pool, key.clone()).await?;
                seen.lock().unwrap().push((key, saw));
                Ok(())
            }
        }
    };
    let first = Delivery::new("p-0").with_message_id("m-0");
    assert_eq!(inbox.handle(first, apply.clone()).await, Verdict::Applied);
    seen.lock().unwrap().clear();

    let batch = [
        Delivery::new("p-1").with_message_id("m-1"),
        Delivery::new("p-0").with_message_id("m-0b"),
        Delivery::new("p-2").with_message_id("m-2"),
        Delivery::new(vec![0xff_u8]).with_message_id("m-bad"),
        Delivery::new("p-1").with_message_id("m-1b"),
        Delivery::new("p-3").with_message_id("m-3"),
    ];
    let verdicts = inbox.handle_batch(&batch, apply).await;
    assert_eq!(verdicts[0], Verdict::Applied);
    assert_eq!(verdicts[1], Verdict::Duplicate, "applied before the batch");
    assert_eq!(verdicts[2], Verdict::Applied);
    assert!(
        matches!(verdicts[3], Verdict::Dead { .. }),
        "{:?}",
        verdicts[3]
    );
    assert_eq!(
        verdicts[4],
        Verdict::Duplicate,
        "applied earlier in the batch"
    );
    assert_eq!(verdicts[5], Verdict::Applied);
    // One transaction: each handler saw the ones before it, and nothing of the batch was
    // committed while it ran (only the key applied before it).
    let seen = seen.lock().unwrap().clone();
    assert_eq!(
        seen,
        [
            ("p-1".to_owned(), (1, 1)),
            ("p-2".to_owned(), (2, 1)),
            ("p-3".to_owned(), (3, 1)),
        ]
    );
    assert_eq!(count(&pool, "SELECT COUNT(*) FROM effects").await, 4);
    assert_eq!(
        count(&pool, "SELECT COUNT(*) FROM idempotency_inbox").await,
        4
    );
    let stats = inbox.stats();
    assert_eq!((stats.processed, stats.duplicates, stats.dead), (4, 2, 1));
    DB::dispose(db).await;
}

/// A handler that fails rolls its batch back, and each delivery is then handled alone: the
/// others apply once, the bad one alone is dead-lettered, and no attempt of the good ones
/// is counted against them.
async fn a_failing_delivery_fails_only_itself_not_its_batch<DB: TestDb>()
where
    for<'c> &'c Pool<DB>: sqlx::Executor<'c, Database = DB>,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    i64: for<'r> sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
    for<'q> <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    let (db, store) = setup::<DB>().await;
    let pool = db.pool.clone();
    let inbox = Inbox::new("orders", store).key_by(by_payload);
    let runs = Arc::new(AtomicU32::new(0));
    let apply = {
        let runs = Arc::clone(&runs);
        move |mut tx: Tx<DB>, delivery: Delivery| {
            let runs = Arc::clone(&runs);
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                let key = by_payload(&delivery)?;
                sqlx::query(DB::INSERT)
                    .bind(key.clone())
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| Failure::retryable(e.to_string()))?;
                if key == "unknown-order" {
                    return Err(Failure::permanent("no such order"));
                }
                Ok(())
            }
        }
    };
    let batch = [
        Delivery::new("p-1").with_message_id("m-1"),
        Delivery::new("unknown-order").with_message_id("m-2"),
        Delivery::new("p-3").with_message_id("m-3"),
    ];
    let verdicts = inbox.handle_batch(&batch, apply).await;
    assert_eq!(verdicts[0], Verdict::Applied);
    assert_eq!(
        verdicts[1],
        Verdict::Dead {
            reason: "no such order".into()
        }
    );
    assert_eq!(verdicts[2], Verdict::Applied);
    assert_eq!(count(&pool, "SELECT COUNT(*) FROM effects").await, 2);
    assert_eq!(
        count(&pool, "SELECT COUNT(*) FROM idempotency_inbox").await,
        2
    );
    // The batch ran the first two before the failure, then each ran alone.
    assert_eq!(runs.load(Ordering::SeqCst), 5);
    let stats = inbox.stats();
    assert_eq!((stats.processed, stats.retried, stats.dead), (2, 0, 1));
    DB::dispose(db).await;
}

/// A batch that cannot reach its database is an outage for every delivery in it, each kept
/// for after a pause and none counted as an attempt or dead-lettered.
async fn a_batch_without_its_database_waits_the_outage_out<DB: TestDb>()
where
    for<'c> &'c Pool<DB>: sqlx::Executor<'c, Database = DB>,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    i64: for<'r> sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
    for<'q> <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    let (db, store) = setup::<DB>().await;
    let inbox = Inbox::new("orders", store).key_by(by_payload);
    db.pool.close().await;
    let apply = |mut tx: Tx<DB>, delivery: Delivery| async move {
        sqlx::query(DB::INSERT)
            .bind(by_payload(&delivery)?)
            .execute(&mut *tx)
            .await
            .map_err(|e| Failure::retryable(e.to_string()))?;
        Ok(())
    };
    let batch = [
        Delivery::new("p-1").with_message_id("m-1"),
        Delivery::new("p-2").with_message_id("m-2"),
        Delivery::new("p-3").with_message_id("m-3"),
    ];
    let verdicts = inbox.handle_batch(&batch, apply).await;
    for verdict in &verdicts {
        assert!(
            matches!(verdict, Verdict::Unavailable { .. }),
            "{verdict:?}"
        );
    }
    let stats = inbox.stats();
    assert_eq!((stats.unavailable, stats.retried, stats.dead), (3, 0, 0));
    DB::dispose(db).await;
}

/// On SQLite another writer holding the database's one write lock past the wait is an outage
/// for the whole batch at once, not a wait for each of its deliveries in turn.
#[tokio::test]
async fn sqlite_a_batch_behind_a_held_write_lock_waits_the_outage_out_at_once() {
    let (db, store) = setup::<sqlx::Sqlite>().await;
    let inbox = Inbox::new("orders", store)
        .key_by(by_payload)
        .wait_for_in_flight(Duration::from_millis(500));
    let mut holder = db.pool.acquire().await.unwrap();
    sqlx::raw_sql("BEGIN EXCLUSIVE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let apply = |mut tx: Tx<sqlx::Sqlite>, delivery: Delivery| async move {
        sqlx::query(<sqlx::Sqlite as TestDb>::INSERT)
            .bind(by_payload(&delivery)?)
            .execute(&mut *tx)
            .await?;
        Ok(())
    };
    let batch: Vec<Delivery> = (0..8)
        .map(|n| Delivery::new(format!("p-{n}")).with_message_id(format!("m-{n}")))
        .collect();
    let started = std::time::Instant::now();
    let verdicts = inbox.handle_batch(&batch, apply).await;
    let took = started.elapsed();
    for verdict in &verdicts {
        assert!(
            matches!(verdict, Verdict::Unavailable { .. }),
            "{verdict:?}"
        );
    }
    assert!(
        took < Duration::from_millis(2500),
        "the batch waited {took:?}: once per delivery, not once for all"
    );
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut *holder)
        .await
        .unwrap();
    drop(holder);
    let verdicts = inbox.handle_batch(&batch, apply).await;
    assert!(
        verdicts.iter().all(|v| *v == Verdict::Applied),
        "{verdicts:?}"
    );
    assert_eq!(count(&db.pool, "SELECT COUNT(*) FROM effects").await, 8);
    sqlx::Sqlite::dispose(db).await;
}

#[tokio::test]
async fn sqlite_a_batch_applies_in_one_transaction_and_skips_what_was_applied() {
    a_batch_applies_in_one_transaction_and_skips_what_was_applied::<sqlx::Sqlite>().await;
}

#[tokio::test]
async fn sqlite_a_failing_delivery_fails_only_itself_not_its_batch() {
    a_failing_delivery_fails_only_itself_not_its_batch::<sqlx::Sqlite>().await;
}

#[tokio::test]
async fn sqlite_a_batch_without_its_database_waits_the_outage_out() {
    a_batch_without_its_database_waits_the_outage_out::<sqlx::Sqlite>().await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn postgres_a_batch_applies_in_one_transaction_and_skips_what_was_applied() {
    a_batch_applies_in_one_transaction_and_skips_what_was_applied::<sqlx::Postgres>().await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn postgres_a_failing_delivery_fails_only_itself_not_its_batch() {
    a_failing_delivery_fails_only_itself_not_its_batch::<sqlx::Postgres>().await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn postgres_a_batch_without_its_database_waits_the_outage_out() {
    a_batch_without_its_database_waits_the_outage_out::<sqlx::Postgres>().await;
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn mariadb_a_batch_applies_in_one_transaction_and_skips_what_was_applied() {
    a_batch_applies_in_one_transaction_and_skips_what_was_applied::<sqlx::MySql>().await;
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn mariadb_a_failing_delivery_fails_only_itself_not_its_batch() {
    a_failing_delivery_fails_only_itself_not_its_batch::<sqlx::MySql>().await;
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn mariadb_a_batch_without_its_database_waits_the_outage_out() {
    a_batch_without_its_database_waits_the_outage_out::<sqlx::MySql>().await;
}

/// A burst through a broker adapter that batches: 30 payments, 10 of them published twice
/// under new message ids, and one poison message among them. Each payment applies once, the
/// copies are duplicates, the poison alone is dead-lettered, and the adapter did apply
/// deliveries together (a handler saw another delivery's write, not yet committed, in its
/// transaction).
async fn a_batching_consumer_applies_a_burst_once<DB: TestDb>(kind: Kind)
where
    for<'c> &'c Pool<DB>: sqlx::Executor<'c, Database = DB>,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    i64: for<'r> sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
    for<'q> <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    let (db, store) = setup::<DB>().await;
    let pool = db.pool.clone();
    let inbox = Inbox::new("orders", store).key_by(by_payload);
    let together = Arc::new(AtomicU32::new(0));
    let handler = {
        let (pool, together) = (pool.clone(), Arc::clone(&together));
        move |mut tx: Tx<DB>, delivery: Delivery| {
            let (pool, together) = (pool.clone(), Arc::clone(&together));
            async move {
                let key = by_payload(&delivery)?;
                if key == "p-poison" {
                    return Err(Failure::permanent("no such order"));
                }
                let (in_tx, committed) = insert_seeing(&mut tx, &pool, key).await?;
                if in_tx > committed {
                    together.fetch_add(1, Ordering::SeqCst);
                }
                Ok(())
            }
        }
    };
    let mut burst: Vec<(String, String)> = (0..30)
        .map(|n| (format!("p-{n}"), format!("m-{n}")))
        .collect();
    burst.extend((0..10).map(|n| (format!("p-{n}"), format!("m-{n}-again"))));
    burst.insert(17, ("p-poison".to_owned(), "m-poison".to_owned()));
    let ns = unique("t");
    let dead = match kind {
        Kind::RabbitMq => {
            let connection = Arc::new(rabbitmq::connect().await);
            let queue = format!("{ns}.orders");
            let exchange = format!("{ns}.payments");
            let make = || {
                RabbitMqConsumer::new(inbox.clone(), connection.clone(), &queue)
                    .bind(&exchange, "payment.succeeded")
                    .concurrency(2)
                    .batch(8)
            };
            let consumer = make();
            consumer.declare().await.unwrap();
            let channel = connection.create_channel().await.unwrap();
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await
                .unwrap();
            for (payment, id) in &burst {
                channel
                    .basic_publish(
                        exchange.as_str().into(),
                        "payment.succeeded".into(),
                        BasicPublishOptions::default(),
                        payment.as_bytes(),
                        BasicProperties::default().with_message_id(id.as_str().into()),
                    )
                    .await
                    .unwrap()
                    .await
                    .unwrap();
            }
            let running = tokio::spawn(make().run(handler));
            let dead_queue = consumer.dead_letter_queue();
            eventually(|| async {
                let stats = inbox.stats();
                stats.processed + stats.duplicates + stats.dead == 41
            })
            .await;
            let dead = rabbitmq::waiting(&channel, &dead_queue).await;
            running.abort();
            delete_rabbitmq(&queue, &exchange).await;
            u64::from(dead)
        }
        Kind::Nats => {
            let js = nats::connect().await;
            let stream = ns.to_uppercase();
            let dead_stream = format!("{stream}_DEAD");
            let make = || {
                NatsConsumer::new(inbox.clone(), js.clone(), &stream, "orders")
                    .stream_subjects([format!("{ns}.payments.>")])
                    .filter_subject(format!("{ns}.payments.succeeded"))
                    .dead_letters(&dead_stream, format!("{ns}.orders.dead"))
                    .concurrency(2)
                    .batch(8)
            };
            make().declare().await.unwrap();
            for (payment, id) in &burst {
                let mut headers = async_nats::HeaderMap::new();
                headers.insert(async_nats::header::NATS_MESSAGE_ID, id.as_str());
                js.publish_with_headers(
                    format!("{ns}.payments.succeeded"),
                    headers,
                    Bytes::from(payment.clone()),
                )
                .await
                .unwrap()
                .await
                .unwrap();
            }
            let running = tokio::spawn(make().run(handler));
            eventually(|| async {
                let stats = inbox.stats();
                stats.processed + stats.duplicates + stats.dead == 41
            })
            .await;
            let dead = nats::messages(&js, &dead_stream).await;
            running.abort();
            nats::delete(&js, [&stream, &dead_stream]).await;
            dead
        }
    };
    assert_eq!(dead, 1, "{kind:?}: the poison alone is dead-lettered");
    assert_eq!(
        count(&pool, "SELECT COUNT(*) FROM effects").await,
        30,
        "{kind:?}"
    );
    assert_eq!(
        count(&pool, "SELECT COUNT(DISTINCT payment_id) FROM effects").await,
        30,
        "{kind:?}"
    );
    let stats = inbox.stats();
    assert_eq!(
        (stats.processed, stats.duplicates, stats.dead),
        (30, 10, 1),
        "{kind:?}: {stats:?}"
    );
    assert!(
        together.load(Ordering::SeqCst) > 0,
        "{kind:?}: no delivery was applied in another's transaction"
    );
    DB::dispose(db).await;
}

#[tokio::test]
async fn rabbitmq_sqlite_a_batching_consumer_applies_a_burst_once() {
    a_batching_consumer_applies_a_burst_once::<sqlx::Sqlite>(Kind::RabbitMq).await;
}

#[tokio::test]
async fn nats_sqlite_a_batching_consumer_applies_a_burst_once() {
    a_batching_consumer_applies_a_burst_once::<sqlx::Sqlite>(Kind::Nats).await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn rabbitmq_postgres_a_batching_consumer_applies_a_burst_once() {
    a_batching_consumer_applies_a_burst_once::<sqlx::Postgres>(Kind::RabbitMq).await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn nats_postgres_a_batching_consumer_applies_a_burst_once() {
    a_batching_consumer_applies_a_burst_once::<sqlx::Postgres>(Kind::Nats).await;
}

// ------------------------------------------------------------------ expiry and backoff

/// Past the inbox's retention a dedupe record no longer counts: `is_applied` says so, the
/// store's purge deletes it, and the key applies again as a new intent (which is why the
/// default keeps records).
async fn an_expired_key_is_not_applied<DB: TestDb>()
where
    for<'c> &'c Pool<DB>: sqlx::Executor<'c, Database = DB>,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    i64: for<'r> sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
    for<'q> <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    let (db, store) = setup::<DB>().await;
    let pool = db.pool.clone();
    let inbox = Inbox::new("orders", store.clone())
        .key_by(by_payload)
        .retention(Duration::from_secs(1));
    let apply = |mut tx: Tx<DB>, delivery: Delivery| async move {
        sqlx::query(DB::INSERT)
            .bind(by_payload(&delivery)?)
            .execute(&mut *tx)
            .await
            .map_err(|e| Failure::retryable(e.to_string()))?;
        Ok(())
    };
    let delivery = Delivery::new("p-1").with_message_id("m-1");
    let unpurged = Delivery::new("p-2").with_message_id("m-2");
    for delivery in [&delivery, &unpurged] {
        assert_eq!(
            inbox.handle(delivery.clone(), apply).await,
            Verdict::Applied
        );
        assert!(inbox.is_applied(delivery).await.unwrap());
    }

    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert!(
        !inbox.is_applied(&delivery).await.unwrap(),
        "an expired record counted as applied"
    );
    // An expired key that was not purged yet is claimed again in place.
    assert_eq!(
        inbox.handle(unpurged.clone(), apply).await,
        Verdict::Applied
    );
    assert!(inbox.is_applied(&unpurged).await.unwrap());
    assert_eq!(
        inbox.handle(unpurged.clone(), apply).await,
        Verdict::Duplicate
    );
    assert_eq!(store.purge_expired().await.unwrap(), 1);
    assert_eq!(
        count(&pool, "SELECT COUNT(*) FROM idempotency_inbox").await,
        1
    );
    assert_eq!(
        inbox.handle(delivery.clone(), apply).await,
        Verdict::Applied
    );
    assert_eq!(count(&pool, "SELECT COUNT(*) FROM effects").await, 4);
    assert!(inbox.is_applied(&delivery).await.unwrap());
    DB::dispose(db).await;
}

#[tokio::test]
async fn sqlite_an_expired_key_is_not_applied() {
    an_expired_key_is_not_applied::<sqlx::Sqlite>().await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn postgres_an_expired_key_is_not_applied() {
    an_expired_key_is_not_applied::<sqlx::Postgres>().await;
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn mariadb_an_expired_key_is_not_applied() {
    an_expired_key_is_not_applied::<sqlx::MySql>().await;
}

/// A retry waits a random time from zero up to a ceiling that doubles per attempt until the
/// cap: many deliveries that failed at once come back spread out, not in lockstep.
#[tokio::test]
async fn retry_backoff_is_jittered_below_a_ceiling_that_doubles_to_the_cap() {
    let (db, store) = setup::<sqlx::Sqlite>().await;
    let inbox = Inbox::new("orders", store)
        .key_by(by_payload)
        .max_attempts(10)
        .backoff(Duration::from_millis(100), Duration::from_millis(400));
    let fail = |_tx: Tx<sqlx::Sqlite>, _delivery: Delivery| async {
        Err::<(), _>(Failure::retryable("the order service is down"))
    };
    let mut previous_ceiling = Duration::ZERO;
    for (attempt, ceiling) in [(1, 100), (2, 200), (3, 400), (4, 400), (6, 400)] {
        let ceiling = Duration::from_millis(ceiling);
        let mut waits = Vec::new();
        for n in 0..40 {
            let delivery = Delivery::new(format!("p-{n}")).with_attempt(attempt);
            match inbox.handle(delivery, fail).await {
                Verdict::Retry { after } => waits.push(after),
                other => panic!("attempt {attempt}: {other:?}"),
            }
        }
        assert!(
            waits.iter().all(|wait| *wait <= ceiling),
            "attempt {attempt}: a wait above {ceiling:?}: {waits:?}"
        );
        // 40 draws all in the upper half, or all equal, would mean no jitter.
        assert!(
            waits.iter().any(|wait| *wait < ceiling / 2),
            "attempt {attempt}: not jittered: {waits:?}"
        );
        let longest = waits.iter().max().copied().unwrap_or_default();
        if ceiling > previous_ceiling {
            assert!(
                longest > previous_ceiling,
                "attempt {attempt}: the ceiling did not grow past {previous_ceiling:?}: {waits:?}"
            );
        }
        previous_ceiling = ceiling;
    }
    assert_eq!(inbox.stats().retried, 200);
    sqlx::Sqlite::dispose(db).await;
}

/// A publisher made the exchange (RabbitMQ: not durable, the protocol's default) or the stream
/// (NATS: memory storage, a max age) before the consumer started: the consumer takes them as
/// they are and consumes.
async fn accepts_what_a_publisher_created_first(kind: Kind) {
    let (db, store) = setup::<sqlx::Sqlite>().await;
    let pool = db.pool.clone();
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
            let connection = Arc::new(rabbitmq::connect().await);
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
            delete_rabbitmq(&queue, &exchange).await;
        }
        Kind::Nats => {
            let js = nats::connect().await;
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
            nats::delete(&js, [stream.clone(), format!("{stream}_DEAD")]).await;
        }
    }
    assert_eq!(count(&pool, "SELECT COUNT(*) FROM effects").await, 1);
    sqlx::Sqlite::dispose(db).await;
}

#[tokio::test]
async fn rabbitmq_accepts_an_exchange_a_publisher_created_first() {
    accepts_what_a_publisher_created_first(Kind::RabbitMq).await;
}

#[tokio::test]
async fn nats_accepts_a_stream_a_publisher_created_first() {
    accepts_what_a_publisher_created_first(Kind::Nats).await;
}

// ------------------------------------------------------------------ where a dead letter's reason is

/// A refused delivery's reason is where an operator looks: in a `WARN` line naming the
/// consumer, the message id and the attempt (never the payload), and in the dead letter's
/// header (`x-inbox-reason` on RabbitMQ, `Inbox-Reason` on NATS).
///
/// The consumer runs on the test's current-thread runtime, so the subscriber set for this
/// thread sees its lines.
async fn a_dead_letter_reason_is_logged_and_kept_in_its_header(kind: Kind) {
    let captured = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(captured.clone())
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let (db, store) = setup::<sqlx::Sqlite>().await;
    let inbox = Inbox::new("orders-refusing", store).key_by(by_payload);
    let refuse = |_tx: Tx<sqlx::Sqlite>, _delivery: Delivery| async {
        Err::<(), _>(Failure::permanent("order 7 does not exist"))
    };
    let payload: &[u8] = b"p-personal-8c41d";
    let ns = unique("t");
    let header = match kind {
        Kind::RabbitMq => {
            let connection = Arc::new(rabbitmq::connect().await);
            let queue = format!("{ns}.orders");
            let exchange = format!("{ns}.payments");
            let consumer = RabbitMqConsumer::new(inbox.clone(), connection.clone(), &queue)
                .bind(&exchange, "payment.succeeded");
            consumer.declare().await.unwrap();
            let dead = consumer.dead_letter_queue();
            let running = tokio::spawn(consumer.run(refuse));
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
                    payload,
                    BasicProperties::default().with_message_id("m-refused-1".into()),
                )
                .await
                .unwrap()
                .await
                .unwrap();
            let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
            let got = loop {
                let got = channel
                    .basic_get(dead.as_str().into(), BasicGetOptions { no_ack: true })
                    .await
                    .unwrap();
                if got.is_some() {
                    break got;
                }
                assert!(tokio::time::Instant::now() < deadline, "not within 20 s");
                tokio::time::sleep(Duration::from_millis(50)).await;
            };
            running.abort();
            let header = got.and_then(|got| {
                let headers = got.delivery.properties.headers().clone()?;
                match headers.inner().get(&ShortString::from("x-inbox-reason")) {
                    Some(AMQPValue::LongString(reason)) => Some(reason.to_string()),
                    _ => None,
                }
            });
            delete_rabbitmq(&queue, &exchange).await;
            header
        }
        Kind::Nats => {
            let js = nats::connect().await;
            let stream = ns.to_uppercase();
            let dead_stream = format!("{stream}_DEAD");
            let consumer = NatsConsumer::new(inbox.clone(), js.clone(), &stream, "orders")
                .stream_subjects([format!("{ns}.payments.>")])
                .filter_subject(format!("{ns}.payments.succeeded"))
                .dead_letters(&dead_stream, format!("{ns}.orders.dead"));
            consumer.declare().await.unwrap();
            let running = tokio::spawn(consumer.run(refuse));
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(async_nats::header::NATS_MESSAGE_ID, "m-refused-1");
            js.publish_with_headers(
                format!("{ns}.payments.succeeded"),
                headers,
                Bytes::from_static(payload),
            )
            .await
            .unwrap()
            .await
            .unwrap();
            let dead_count = || async { nats::messages(&js, &dead_stream).await };
            eventually(|| async { dead_count().await == 1 }).await;
            running.abort();
            let mut dead = js.get_stream(&dead_stream).await.unwrap();
            let first = dead.info().await.unwrap().state.first_sequence;
            let letter = dead.get_raw_message(first).await.unwrap();
            let header = letter
                .headers
                .get("Inbox-Reason")
                .map(|reason| reason.as_str().to_owned());
            nats::delete(&js, [&stream, &dead_stream]).await;
            header
        }
    };
    assert_eq!(
        header.as_deref(),
        Some("order 7 does not exist"),
        "{kind:?}"
    );

    let logs = captured.text();
    let line = logs
        .lines()
        .find(|line| line.contains("inbox dead-lettered a delivery"))
        .unwrap_or_else(|| panic!("{kind:?}: no dead-letter line in:\n{logs}"));
    for part in [
        "WARN",
        "consumer=orders-refusing",
        "m-refused-1",
        "attempt=1",
        "order 7 does not exist",
    ] {
        assert!(line.contains(part), "{kind:?}: {part} missing in: {line}");
    }
    assert!(
        !logs.contains("p-personal-8c41d"),
        "{kind:?}: the payload leaked into the logs:\n{logs}"
    );
    assert_eq!(inbox.stats().dead, 1);
    sqlx::Sqlite::dispose(db).await;
}

#[tokio::test]
async fn rabbitmq_a_dead_letter_reason_is_logged_and_kept_in_its_header() {
    a_dead_letter_reason_is_logged_and_kept_in_its_header(Kind::RabbitMq).await;
}

#[tokio::test]
async fn nats_a_dead_letter_reason_is_logged_and_kept_in_its_header() {
    a_dead_letter_reason_is_logged_and_kept_in_its_header(Kind::Nats).await;
}

/// A handler that runs three times the ack wait: progress acks keep JetStream from
/// delivering its message again meanwhile, so it is applied once and never seen as a
/// duplicate or a retry.
#[tokio::test]
async fn nats_a_slow_handler_keeps_its_message_with_progress_acks() {
    let (db, store) = setup::<sqlx::Sqlite>().await;
    let ns = unique("slow").replace('-', "_");
    let stream = ns.to_uppercase();
    let js = nats::connect().await;
    let inbox = Inbox::new("orders", store).key_by(by_payload);
    let consumer = NatsConsumer::new(inbox.clone(), js.clone(), &stream, "orders")
        .stream_subjects([format!("{ns}.payments.>")])
        .dead_letters(format!("{stream}_DEAD"), format!("{ns}.orders.dead"))
        .ack_wait(Duration::from_secs(1));
    consumer.declare().await.unwrap();
    let slow = |mut tx: Tx<sqlx::Sqlite>, delivery: Delivery| async move {
        tokio::time::sleep(Duration::from_secs(3)).await;
        sqlx::query("INSERT INTO effects (payment_id) VALUES ($1)")
            .bind(String::from_utf8_lossy(delivery.payload()).into_owned())
            .execute(&mut *tx)
            .await
            .map_err(|e| Failure::retryable(e.to_string()))?;
        Ok(())
    };
    let running = tokio::spawn(consumer.run(slow));
    js.publish(
        format!("{ns}.payments.succeeded"),
        Bytes::from_static(b"p-slow"),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    eventually(|| async { inbox.stats().processed == 1 }).await;
    // A redelivery made while the handler ran would wait on its claim and end as a duplicate.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let stats = inbox.stats();
    running.abort();
    nats::delete(&js, [stream.clone(), format!("{stream}_DEAD")]).await;
    assert_eq!(
        (stats.processed, stats.duplicates, stats.retried),
        (1, 0, 0),
        "never delivered again while its handler ran: {stats:?}"
    );
    assert_eq!(count(&db.pool, "SELECT COUNT(*) FROM effects").await, 1);
    sqlx::Sqlite::dispose(db).await;
}

// ------------------------------------------------------------------ outages are not attempts

/// The settings of the outage tests: two attempts and a backoff of tens of milliseconds, so an
/// outage of a few seconds outlasts `max_attempts` × backoff many times over.
fn outage_inbox<DB: Backend>(store: Store<DB>) -> Inbox<DB> {
    Inbox::new("orders", store)
        .key_by(by_payload)
        .max_attempts(2)
        .backoff(Duration::from_millis(20), Duration::from_millis(50))
        .outage_backoff(Duration::from_millis(50), Duration::from_millis(300))
}

/// A pool on the schema of `db` that reaches PostgreSQL through `plug`, giving up on a
/// connection after 300 ms so that an unplugged link fails fast.
#[cfg(feature = "postgres")]
async fn pool_through(plug: &common::link::Plug, db: &Isolated<sqlx::Postgres>) -> sqlx::PgPool {
    let options = common::postgres_url()
        .parse::<sqlx::postgres::PgConnectOptions>()
        .unwrap()
        .host("127.0.0.1")
        .port(plug.addr.port())
        .options([("search_path", db.url.as_str())]);
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_millis(300))
        .connect_with(options)
        .await
        .unwrap()
}

/// The shared PostgreSQL's address, for a plug in front of it.
#[cfg(feature = "postgres")]
fn postgres_addr() -> std::net::SocketAddr {
    let options = common::postgres_url()
        .parse::<sqlx::postgres::PgConnectOptions>()
        .unwrap();
    let host = match options.get_host() {
        "localhost" => "127.0.0.1",
        host => host,
    };
    format!("{host}:{}", options.get_port()).parse().unwrap()
}

/// Applies the payment named by the payload; `?` sorts the database's errors.
async fn apply_payment<DB: TestDb>(mut tx: Tx<DB>, delivery: Delivery) -> Result<(), Failure>
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    sqlx::query(DB::INSERT)
        .bind(by_payload(&delivery)?)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// Delivers the payment `p-{n}` with [`apply_payment`] until it settles, as a broker adapter
/// drives it: a retry counts an attempt, an outage does not. Returns the attempt it settled
/// on, the outages it met, and its verdict when that was not `Applied`.
fn deliver_until_settled<DB: TestDb>(
    inbox: &Inbox<DB>,
    n: usize,
) -> tokio::task::JoinHandle<(u32, u32, Option<Verdict>)>
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    let inbox = inbox.clone();
    tokio::spawn(async move {
        let (mut attempt, mut outages) = (1, 0);
        loop {
            let delivery = Delivery::new(format!("p-{n}"))
                .with_message_id(format!("m-{n}"))
                .with_attempt(attempt);
            match inbox.handle(delivery, apply_payment).await {
                Verdict::Applied => return (attempt, outages, None),
                Verdict::Retry { after } => {
                    attempt += 1;
                    tokio::time::sleep(after).await;
                }
                Verdict::Unavailable { after, .. } => {
                    outages += 1;
                    tokio::time::sleep(after).await;
                }
                verdict => return (attempt, outages, Some(verdict)),
            }
        }
    })
}

/// SQLite has one write lock for the whole file: while another connection holds it (a stuck
/// process, a long backup) no delivery can be applied, whatever its key. Three deliveries meet
/// the lock for longer than two attempts and their backoff: each comes back as an outage that
/// pauses the consumer, never as an attempt, and each is applied once when the lock is let go.
#[tokio::test]
async fn sqlite_a_write_locked_database_is_an_outage_not_an_attempt() {
    use sqlx::Connection as _;

    let (db, store) = setup::<sqlx::Sqlite>().await;
    let inbox = outage_inbox(store).wait_for_in_flight(Duration::from_millis(100));
    let mut holder = sqlx::SqliteConnection::connect(&db.url).await.unwrap();
    sqlx::raw_sql("BEGIN EXCLUSIVE")
        .execute(&mut holder)
        .await
        .unwrap();

    let deliveries: Vec<_> = (1..=3).map(|n| deliver_until_settled(&inbox, n)).collect();
    tokio::time::sleep(Duration::from_secs(2)).await;
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut holder)
        .await
        .unwrap();
    holder.close().await.unwrap();
    for delivery in deliveries {
        let (attempt, outages, wrong) = tokio::time::timeout(Duration::from_secs(10), delivery)
            .await
            .expect("applied within 10 s of the lock's release")
            .unwrap();
        assert_eq!(wrong, None, "not applied");
        assert_eq!(attempt, 1, "the locked database spent attempts");
        assert!(outages >= 1, "the outage was not seen");
    }
    assert_eq!(count(&db.pool, "SELECT COUNT(*) FROM effects").await, 3);
    let stats = inbox.stats();
    assert_eq!(
        (stats.processed, stats.retried, stats.dead),
        (3, 0, 0),
        "{stats:?}"
    );
    sqlx::Sqlite::dispose(db).await;
}

/// The consumer's database is unreachable (the link to it cut) for longer than two attempts
/// and their backoff, while six deliveries arrive. Each comes back as an outage, never as an
/// attempt; once the link is back every one is applied exactly once and none was
/// dead-lettered. The deliveries are driven as a broker adapter drives them: a retry counts
/// an attempt, an outage does not.
#[cfg(feature = "postgres")]
#[tokio::test]
async fn postgres_an_unreachable_database_is_an_outage_not_an_attempt() {
    let (db, _) = setup::<sqlx::Postgres>().await;
    let plug = common::link::Plug::start(postgres_addr()).await;
    let inbox = outage_inbox(Store::new(pool_through(&plug, &db).await));

    plug.unplug();
    let deliveries: Vec<_> = (1..=6).map(|n| deliver_until_settled(&inbox, n)).collect();
    tokio::time::sleep(Duration::from_secs(3)).await;
    plug.plug_in();
    for delivery in deliveries {
        let (_, outages, wrong) = tokio::time::timeout(Duration::from_secs(20), delivery)
            .await
            .expect("applied within 20 s of the link's return")
            .unwrap();
        assert_eq!(wrong, None, "not applied");
        assert!(outages >= 1, "the outage was not seen");
    }

    // Exactly once: six rows, and every redelivery is a duplicate.
    assert_eq!(count(&db.pool, "SELECT COUNT(*) FROM effects").await, 6);
    assert_eq!(
        count(&db.pool, "SELECT COUNT(DISTINCT payment_id) FROM effects").await,
        6
    );
    for n in 1..=6 {
        let again = Delivery::new(format!("p-{n}")).with_message_id(format!("m-{n}-again"));
        assert_eq!(inbox.handle(again, apply_payment).await, Verdict::Duplicate);
    }
    let stats = inbox.stats();
    assert_eq!((stats.processed, stats.dead), (6, 0), "{stats:?}");
    assert!(stats.unavailable >= 6, "{stats:?}");
    drop(plug);
    sqlx::Postgres::dispose(db).await;
}

/// The same outage through a broker adapter, end to end: payments published while the
/// consumer's database is cut off for longer than two attempts and their backoff are all
/// applied once after it returns, and the dead-letter queue (stream) stays empty.
#[cfg(feature = "postgres")]
async fn an_unreachable_database_dead_letters_nothing(kind: Kind, batch: u16) {
    let (db, _) = setup::<sqlx::Postgres>().await;
    let plug = common::link::Plug::start(postgres_addr()).await;
    let inbox = outage_inbox(Store::new(pool_through(&plug, &db).await));
    let ns = unique("t");
    let payments: Vec<String> = (1..=5).map(|n| format!("p-{n}")).collect();
    plug.unplug();
    let dead = match kind {
        Kind::RabbitMq => {
            let connection = Arc::new(rabbitmq::connect().await);
            let queue = format!("{ns}.orders");
            let exchange = format!("{ns}.payments");
            let consumer = RabbitMqConsumer::new(inbox.clone(), connection.clone(), &queue)
                .bind(&exchange, "payment.succeeded")
                .concurrency(2)
                .batch(batch);
            consumer.declare().await.unwrap();
            let dead_queue = consumer.dead_letter_queue();
            let running = tokio::spawn(consumer.run(apply_payment));
            let channel = connection.create_channel().await.unwrap();
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await
                .unwrap();
            for (n, payment) in payments.iter().enumerate() {
                channel
                    .basic_publish(
                        exchange.as_str().into(),
                        "payment.succeeded".into(),
                        BasicPublishOptions::default(),
                        payment.as_bytes(),
                        BasicProperties::default().with_message_id(format!("m-{n}").into()),
                    )
                    .await
                    .unwrap()
                    .await
                    .unwrap();
            }
            tokio::time::sleep(Duration::from_secs(3)).await;
            plug.plug_in();
            // Every effect committed and every verdict counted: the consumer is stopped only
            // then, not between a commit and its verdict.
            eventually(|| async {
                count(&db.pool, "SELECT COUNT(*) FROM effects").await == 5
                    && inbox.stats().processed == 5
            })
            .await;
            running.abort();
            let dead = rabbitmq::waiting(&channel, &dead_queue).await;
            delete_rabbitmq(&queue, &exchange).await;
            u64::from(dead)
        }
        Kind::Nats => {
            let js = nats::connect().await;
            let stream = ns.to_uppercase();
            let dead_stream = format!("{stream}_DEAD");
            let consumer = NatsConsumer::new(inbox.clone(), js.clone(), &stream, "orders")
                .stream_subjects([format!("{ns}.payments.>")])
                .filter_subject(format!("{ns}.payments.succeeded"))
                .dead_letters(&dead_stream, format!("{ns}.orders.dead"))
                .ack_wait(Duration::from_secs(1))
                .concurrency(2)
                .batch(usize::from(batch));
            consumer.declare().await.unwrap();
            let running = tokio::spawn(consumer.run(apply_payment));
            for (n, payment) in payments.iter().enumerate() {
                let mut headers = async_nats::HeaderMap::new();
                headers.insert(
                    async_nats::header::NATS_MESSAGE_ID,
                    format!("m-{n}").as_str(),
                );
                js.publish_with_headers(
                    format!("{ns}.payments.succeeded"),
                    headers,
                    Bytes::from(payment.clone()),
                )
                .await
                .unwrap()
                .await
                .unwrap();
            }
            tokio::time::sleep(Duration::from_secs(3)).await;
            plug.plug_in();
            // Every effect committed and every verdict counted: the consumer is stopped only
            // then, not between a commit and its verdict.
            eventually(|| async {
                count(&db.pool, "SELECT COUNT(*) FROM effects").await == 5
                    && inbox.stats().processed == 5
            })
            .await;
            running.abort();
            let dead = nats::messages(&js, &dead_stream).await;
            nats::delete(&js, [&stream, &dead_stream]).await;
            dead
        }
    };
    assert_eq!(dead, 0, "{kind:?}: dead letters for an outage");
    assert_eq!(
        count(&db.pool, "SELECT COUNT(DISTINCT payment_id) FROM effects").await,
        5,
        "{kind:?}"
    );
    let stats = inbox.stats();
    assert_eq!((stats.processed, stats.dead), (5, 0), "{kind:?}: {stats:?}");
    assert!(stats.unavailable >= 1, "{kind:?}: {stats:?}");
    // In batches the consumer holds 2 × 4 deliveries, all five of them, and keeps each alive
    // while the outage lasts (three times the ack wait on NATS), those waiting for a
    // transaction too: none comes back as a copy. One at a time it holds two, and NATS' client
    // may have pulled more into its buffer, where no progress ack reaches them.
    if batch > 1 {
        assert_eq!(stats.duplicates, 0, "{kind:?}: {stats:?}");
    }
    drop(plug);
    sqlx::Postgres::dispose(db).await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn rabbitmq_postgres_an_unreachable_database_dead_letters_nothing() {
    an_unreachable_database_dead_letters_nothing(Kind::RabbitMq, 1).await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn rabbitmq_postgres_an_unreachable_database_dead_letters_nothing_in_batches() {
    an_unreachable_database_dead_letters_nothing(Kind::RabbitMq, 4).await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn nats_postgres_an_unreachable_database_dead_letters_nothing() {
    an_unreachable_database_dead_letters_nothing(Kind::Nats, 1).await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn nats_postgres_an_unreachable_database_dead_letters_nothing_in_batches() {
    an_unreachable_database_dead_letters_nothing(Kind::Nats, 4).await;
}

/// A delivery refused for good is dead-lettered at once, and everything that reports it says
/// `dead`: the verdict, the inbox's `WARN` line, `stats().dead`, and the engine's log line and
/// `idempotency_requests_total` counter; never `retryable`. A retryable failure on its last
/// attempt is dead too; one before its last attempt is a retry and still says `retryable`.
///
/// The recorder and the subscriber are this thread's, and the test's runtime runs on it alone.
#[cfg(feature = "metrics")]
#[tokio::test(flavor = "current_thread")]
async fn a_dead_letter_is_logged_and_counted_as_dead_not_retryable() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _recording = metrics::set_default_local_recorder(&recorder);
    let captured = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(captured.clone())
        .with_max_level(tracing::Level::INFO)
        .with_ansi(false)
        .finish();
    let _logging = tracing::subscriber::set_default(subscriber);
    // A snapshot drains the counters: each reads what was counted since the last, by outcome.
    let requests = || {
        let mut counted = std::collections::HashMap::<String, u64>::new();
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            if key.key().name() != "idempotency_requests_total" {
                continue;
            }
            if let (Some(outcome), DebugValue::Counter(n)) =
                (key.key().labels().find(|l| l.key() == "outcome"), value)
            {
                *counted.entry(outcome.value().to_owned()).or_default() += n;
            }
        }
        let of = |outcome: &str| counted.get(outcome).copied().unwrap_or(0);
        (of("dead"), of("retryable"))
    };

    let (db, store) = setup::<sqlx::Sqlite>().await;
    let inbox = Inbox::new("orders-metrics", store)
        .key_by(by_payload)
        .max_attempts(2);
    let refuse = |_tx: Tx<sqlx::Sqlite>, _delivery: Delivery| async {
        Err::<(), _>(Failure::permanent("order 7 does not exist"))
    };
    let verdict = inbox
        .handle(Delivery::new("p-1").with_message_id("m-1"), refuse)
        .await;
    assert_eq!(
        verdict,
        Verdict::Dead {
            reason: "order 7 does not exist".into()
        }
    );
    // One `dead` for the delivery, none `retryable`. (The failure's note, recorded in a scope
    // of its own, is a stored refusal: `failed_permanent`.)
    assert_eq!(requests(), (1, 0), "(dead, retryable)");
    let logs = captured.text();
    let engine_lines: Vec<_> = logs
        .lines()
        .filter(|line| line.contains("idempotent request"))
        .collect();
    assert!(
        engine_lines
            .iter()
            .any(|line| line.contains("outcome=\"dead\"") || line.contains("outcome=dead")),
        "no engine line says dead:\n{logs}"
    );
    assert!(
        !engine_lines.iter().any(|line| line.contains("retryable")),
        "an engine line says retryable:\n{logs}"
    );
    assert!(
        logs.lines()
            .any(|line| line.contains("WARN") && line.contains("inbox dead-lettered a delivery")),
        "no WARN line:\n{logs}"
    );

    // Retryable: a retry on attempt 1 (and labelled so), dead on the last attempt.
    let fail = |_tx: Tx<sqlx::Sqlite>, _delivery: Delivery| async {
        Err::<(), _>(Failure::retryable("the order service is down"))
    };
    let first = inbox
        .handle(Delivery::new("p-2").with_message_id("m-2"), fail)
        .await;
    assert!(matches!(first, Verdict::Retry { .. }), "{first:?}");
    assert_eq!(requests(), (0, 1), "(dead, retryable)");
    let last = inbox
        .handle(
            Delivery::new("p-2").with_message_id("m-2").with_attempt(2),
            fail,
        )
        .await;
    assert!(matches!(last, Verdict::Dead { .. }), "{last:?}");
    assert_eq!(requests(), (1, 0), "(dead, retryable)");
    let stats = inbox.stats();
    assert_eq!((stats.dead, stats.retried), (2, 1), "{stats:?}");
    sqlx::Sqlite::dispose(db).await;
}
