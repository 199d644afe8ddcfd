//! Conformance suite of the outbox: every test runs against real SQLite, PostgreSQL and MySQL
//! databases (each in its own file, schema or database), with a scripted downstream that
//! records every call the dispatcher makes.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum_idempotency::outbox;
use axum_idempotency::outbox::{
    Backoff, Dispatcher, DownstreamKey, LookupOutcome, Message, Outbox, OutboxRecord, SendOutcome,
    Sender, Status,
};
use axum_idempotency::{Backend, Scope};
use sqlx::Pool;
use tokio::sync::Notify;

mod common;

mod databases {
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    use std::str::FromStr;

    #[cfg(any(feature = "postgres", feature = "mysql"))]
    use sqlx::ConnectOptions;
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool};

    #[cfg(any(feature = "postgres", feature = "mysql"))]
    fn unique_name() -> String {
        crate::common::unique("outbox")
    }

    pub(crate) struct SqliteDb {
        pub(crate) pool: SqlitePool,
        _dir: tempfile::TempDir,
    }

    pub(crate) async fn sqlite() -> SqliteDb {
        let dir = tempfile::tempdir().unwrap();
        let options = SqliteConnectOptions::new()
            .filename(dir.path().join("outbox.db"))
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal);
        let pool = SqlitePool::connect_with(options).await.unwrap();
        SqliteDb { pool, _dir: dir }
    }

    #[cfg(feature = "postgres")]
    pub(crate) async fn postgres() -> (sqlx::PgPool, String) {
        use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
        let url = std::env::var("TEST_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        let schema = unique_name();
        let mut admin = PgConnectOptions::from_str(&url)
            .unwrap()
            .connect()
            .await
            .unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
            .execute(&mut admin)
            .await
            .unwrap();
        let options = PgConnectOptions::from_str(&url)
            .unwrap()
            .options([("search_path", schema.as_str())]);
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .connect_with(options)
            .await
            .unwrap();
        (pool, schema)
    }

    #[cfg(feature = "postgres")]
    pub(crate) async fn drop_postgres(pool: sqlx::PgPool, schema: String) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
            .execute(&pool)
            .await
            .unwrap();
        pool.close().await;
    }

    #[cfg(feature = "mysql")]
    pub(crate) async fn mysql() -> (sqlx::MySqlPool, String) {
        use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
        let url = std::env::var("TEST_MYSQL_URL")
            .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
        let database = unique_name();
        let mut admin = MySqlConnectOptions::from_str(&url)
            .unwrap()
            .connect()
            .await
            .unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}")))
            .execute(&mut admin)
            .await
            .unwrap();
        let options = MySqlConnectOptions::from_str(&url)
            .unwrap()
            .database(&database);
        let pool = MySqlPoolOptions::new()
            .max_connections(8)
            .connect_with(options)
            .await
            .unwrap();
        (pool, database)
    }

    #[cfg(feature = "mysql")]
    pub(crate) async fn drop_mysql(pool: sqlx::MySqlPool, database: String) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP DATABASE {database}")))
            .execute(&pool)
            .await
            .unwrap();
        pool.close().await;
    }
}

/// Instantiates every generic test below once per backend.
macro_rules! conformance {
    ($($test:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    let db = crate::databases::sqlite().await;
                    super::$test(db.pool.clone()).await;
                }
            )*
        }

        #[cfg(feature = "postgres")]
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    let (pool, schema) = crate::databases::postgres().await;
                    super::$test(pool.clone()).await;
                    crate::databases::drop_postgres(pool, schema).await;
                }
            )*
        }

        #[cfg(feature = "mysql")]
        mod mysql {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    let (pool, database) = crate::databases::mysql().await;
                    super::$test(pool.clone()).await;
                    crate::databases::drop_mysql(pool, database).await;
                }
            )*
        }
    };
}

conformance!(
    rolled_back_enqueue_is_never_sent,
    uncommitted_message_is_invisible_to_dispatchers,
    committed_message_is_delivered_once_with_its_key,
    same_intent_enqueued_twice_is_one_message,
    same_key_with_other_payload_is_rejected,
    retry_after_is_honoured,
    gives_up_after_max_attempts_and_says_why,
    rejection_fails_without_retrying,
    unknown_outcome_found_by_lookup_is_delivered_without_resending,
    unknown_outcome_not_found_waits_for_the_grace_then_resends_with_same_key,
    failing_lookup_never_resends,
    unknown_outcome_without_lookup_resends_with_same_key,
    crashed_dispatcher_lease_expires_then_message_is_looked_up,
    slow_send_keeps_its_lease_by_renewing_it,
    two_dispatchers_deliver_each_message_exactly_once,
    migrate_is_idempotent_and_safe_when_run_concurrently,
    a_migration_that_stopped_before_recording_its_version_completes_on_the_next_run,
    failed_message_is_requeued_through_the_api_and_delivered_with_its_key,
    purge_deletes_only_finished_rows_past_retention,
    a_claim_records_the_attempt_before_the_send,
    a_message_out_of_attempts_fails_without_another_send,
    fast_sends_go_on_while_a_slow_one_runs,
    shutdown_records_the_sends_in_hand_and_claims_no_more,
    a_batched_settle_writes_each_outcome_only_under_its_own_lease,
    renewals_racing_settles_report_no_lost_lease,
    a_claim_that_waited_for_a_connection_leases_from_when_it_ran,
    a_message_claimed_ahead_and_unsent_at_shutdown_is_not_charged_an_attempt,
    the_lookup_grace_counts_from_the_send_not_the_claim,
    an_outage_is_not_an_attempt,
    an_outage_pauses_the_destination_and_probes_one_message_at_a_time,
    a_paused_topic_waits_untouched_while_other_topics_flow,
    a_backlog_of_one_topic_delays_the_others_by_a_claim_not_by_the_backlog,
    a_message_gives_up_at_its_time_budget_and_says_why,
    messages_of_one_ordering_key_arrive_in_enqueue_order_one_at_a_time_through_faults,
    a_failed_message_holds_its_key_until_requeued_or_skipped,
    a_message_waiting_for_a_retry_holds_back_only_its_own_key,
    an_earlier_message_locked_by_another_claim_still_holds_its_key_back,
    enqueues_of_one_ordering_key_commit_in_id_order,
    an_ordering_key_must_be_1_to_255_characters,
    a_topic_must_be_1_to_255_characters,
    a_request_that_enqueued_wakes_the_dispatchers_when_the_layer_commits,
    a_commit_hands_its_messages_to_a_dispatcher_of_its_own_process,
    a_handed_message_whose_dispatcher_died_is_looked_up_once_its_lease_runs_out,
    a_commit_handed_to_a_dispatcher_that_stopped_meanwhile_is_sent_at_once_by_another,
    a_rolled_back_request_sends_nothing_and_a_job_of_its_own_wakes_with_outbox_wake,
    a_delivery_enqueues_its_follow_ups_with_its_outcome_and_hands_them_over,
    a_follow_up_that_cannot_be_made_leaves_the_delivery_unknown_until_a_lookup_makes_it,
);

/// A downstream whose answers are scripted and whose calls are recorded.
#[derive(Clone, Default)]
struct Downstream(Arc<Inner>);

#[derive(Default)]
struct Inner {
    sends: Mutex<Vec<(String, u32)>>,
    lookups: Mutex<Vec<String>>,
    send_script: Mutex<VecDeque<SendOutcome>>,
    lookup_script: Mutex<VecDeque<LookupOutcome>>,
    lookup_default: Mutex<Option<LookupOutcome>>,
    hang: AtomicBool,
    max_delay_ms: AtomicU64,
    delay_ms: AtomicU64,
    delay_ms_by_key: Mutex<HashMap<String, u64>>,
    entered: Notify,
    /// While set, every send answers `Unavailable` after `delay_ms`.
    down: AtomicBool,
    in_flight: AtomicU64,
    /// The most sends in flight at once since the counter was last reset.
    most_in_flight: AtomicU64,
}

impl Downstream {
    fn answering(outcomes: impl IntoIterator<Item = SendOutcome>) -> Self {
        let downstream = Self::default();
        downstream.0.send_script.lock().unwrap().extend(outcomes);
        downstream
    }

    fn looking_up(self, outcomes: impl IntoIterator<Item = LookupOutcome>) -> Self {
        self.0.lookup_script.lock().unwrap().extend(outcomes);
        self
    }

    fn always_looking_up(self, outcome: LookupOutcome) -> Self {
        *self.0.lookup_default.lock().unwrap() = Some(outcome);
        self
    }

    fn sends(&self) -> Vec<(String, u32)> {
        self.0.sends.lock().unwrap().clone()
    }

    fn lookups(&self) -> Vec<String> {
        self.0.lookups.lock().unwrap().clone()
    }
}

impl Sender for Downstream {
    async fn send(&self, message: &OutboxRecord) -> SendOutcome {
        self.0
            .sends
            .lock()
            .unwrap()
            .push((message.downstream_key.to_string(), message.attempts));
        self.0.entered.notify_one();
        let in_flight = self.0.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.0.most_in_flight.fetch_max(in_flight, Ordering::SeqCst);
        let outcome = self.answer(message).await;
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
        outcome
    }

    async fn lookup(&self, message: &OutboxRecord) -> LookupOutcome {
        self.0
            .lookups
            .lock()
            .unwrap()
            .push(message.downstream_key.to_string());
        let scripted = self.0.lookup_script.lock().unwrap().pop_front();
        scripted
            .or_else(|| self.0.lookup_default.lock().unwrap().clone())
            .unwrap_or(LookupOutcome::Unsupported)
    }
}

impl Downstream {
    async fn answer(&self, message: &OutboxRecord) -> SendOutcome {
        if self.0.hang.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        let by_key = self
            .0
            .delay_ms_by_key
            .lock()
            .unwrap()
            .get(message.downstream_key.as_str())
            .copied();
        let delay = by_key.unwrap_or_else(|| self.0.delay_ms.load(Ordering::SeqCst));
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        let max_delay = self.0.max_delay_ms.load(Ordering::SeqCst);
        if max_delay > 0 {
            tokio::time::sleep(Duration::from_millis(fastrand_delay(max_delay))).await;
        }
        if self.0.down.load(Ordering::SeqCst) {
            return SendOutcome::Unavailable {
                after: None,
                reason: "connection refused".into(),
            };
        }
        let scripted = self.0.send_script.lock().unwrap().pop_front();
        scripted.unwrap_or_else(|| SendOutcome::Delivered {
            receipt: format!("receipt-{}", message.id),
        })
    }
}

fn fastrand_delay(max: u64) -> u64 {
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    u64::from(nanos) % max
}

fn key(discriminator: &str) -> DownstreamKey {
    let key = "k1".parse().expect("a valid key");
    let scoped_key = Scope::new("alice", "POST", "/payments", key).scoped_key();
    DownstreamKey::for_request(scoped_key, "charges", discriminator)
}

fn charge(discriminator: &str, amount: &str) -> Message {
    Message::json(
        "charges",
        key(discriminator),
        &serde_json::json!({ "amount": amount, "currency": "EUR" }),
    )
    .unwrap()
}

async fn outbox<DB: Backend>(pool: &Pool<DB>) -> Outbox<DB> {
    let outbox = Outbox::new(pool.clone());
    outbox.migrate().await.unwrap();
    outbox
}

/// A dispatcher that retries at once, so tests step through attempts with `run_once`.
fn dispatcher<DB: Backend>(
    outbox: &Outbox<DB>,
    downstream: &Downstream,
) -> Dispatcher<DB, Downstream> {
    Dispatcher::new(outbox.clone(), downstream.clone())
        .backoff(Backoff::exponential(Duration::ZERO, Duration::ZERO))
        .probe_backoff(Backoff::exponential(Duration::ZERO, Duration::ZERO))
        .lookup_grace(Duration::ZERO)
        .send_timeout(Duration::from_secs(5))
}

async fn enqueue_committed<DB: Backend>(pool: &Pool<DB>, outbox: &Outbox<DB>, message: Message) {
    let mut tx = pool.begin().await.unwrap();
    outbox.enqueue(&mut tx, message).await.unwrap();
    tx.commit().await.unwrap();
}

async fn record<DB: Backend>(outbox: &Outbox<DB>, discriminator: &str) -> OutboxRecord {
    outbox
        .status_by_key(&key(discriminator))
        .await
        .unwrap()
        .unwrap()
}

async fn rolled_back_enqueue_is_never_sent<DB: Backend>(pool: Pool<DB>) {
    let outbox = outbox(&pool).await;
    let downstream = Downstream::default();
    let mut tx = pool.begin().await.unwrap();
    outbox.enqueue(&mut tx, charge("c", "12.50")).await.unwrap();
    tx.rollback().await.unwrap();

    assert_eq!(
        dispatcher(&outbox, &downstream).run_once().await.unwrap(),
        0
    );
    assert!(downstream.sends().is_empty());
    assert_eq!(outbox.status_by_key(&key("c")).await.unwrap(), None);
}

async fn uncommitted_message_is_invisible_to_dispatchers<DB: Backend>(pool: Pool<DB>) {
    let outbox = outbox(&pool).await;
    let downstream = Downstream::default();
    let dispatcher = dispatcher(&outbox, &downstream);
    let mut tx = pool.begin().await.unwrap();
    outbox.enqueue(&mut tx, charge("c", "12.50")).await.unwrap();

    assert_eq!(dispatcher.run_once().await.unwrap(), 0);
    tx.commit().await.unwrap();
    assert_eq!(dispatcher.run_once().await.unwrap(), 1);
    assert_eq!(downstream.sends().len(), 1);
}

async fn committed_message_is_delivered_once_with_its_key<DB: Backend>(pool: Pool<DB>) {
    let outbox = outbox(&pool).await;
    let downstream = Downstream::default();
    let dispatcher = dispatcher(&outbox, &downstream);
    let mut tx = pool.begin().await.unwrap();
    let id = outbox.enqueue(&mut tx, charge("c", "12.50")).await.unwrap();
    tx.commit().await.unwrap();

    let pending = outbox.status(id).await.unwrap().unwrap();
    assert_eq!(pending.status, Status::Pending);
    assert_eq!(pending.attempts, 0);

    assert_eq!(dispatcher.run_once().await.unwrap(), 1);
    assert_eq!(dispatcher.run_once().await.unwrap(), 0);

    assert_eq!(downstream.sends(), vec![(key("c").to_string(), 1)]);
    let delivered = outbox.status(id).await.unwrap().unwrap();
    assert_eq!(delivered.status, Status::Delivered);
    assert_eq!(
        delivered.receipt.as_deref(),
        Some(format!("receipt-{id}").as_str())
    );
    assert_eq!(delivered.attempts, 1);
    assert!(delivered.finished_at.is_some());
    let payload: serde_json::Value = delivered.payload_json().unwrap();
    assert_eq!(payload["amount"], "12.50");
    assert_eq!(
        outbox.status_by_key(&key("c")).await.unwrap(),
        Some(delivered)
    );
}

async fn same_intent_enqueued_twice_is_one_message<DB: Backend>(pool: Pool<DB>) {
    let outbox = outbox(&pool).await;
    let mut tx = pool.begin().await.unwrap();
    let first = outbox.enqueue(&mut tx, charge("c", "12.50")).await.unwrap();
    tx.commit().await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    let again = outbox.enqueue(&mut tx, charge("c", "12.50")).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(first, again);

    let downstream = Downstream::default();
    dispatcher(&outbox, &downstream).run_once().await.unwrap();
    assert_eq!(downstream.sends().len(), 1);
}

async fn same_key_with_other_payload_is_rejected<DB: Backend>(pool: Pool<DB>) {
    let outbox = outbox(&pool).await;
    enqueue_committed(&pool, &outbox, charge("c", "12.50")).await;

    let mut tx = pool.begin().await.unwrap();
    let reused = outbox.enqueue(&mut tx, charge("c", "99.00")).await;
    assert!(matches!(reused, Err(outbox::Error::KeyReused(k)) if k == key("c")));
    // The caller's transaction is still usable after the refusal.
    outbox.enqueue(&mut tx, charge("d", "1.00")).await.unwrap();
    tx.commit().await.unwrap();

    assert_eq!(
        record(&outbox, "c")
            .await
            .payload_json::<serde_json::Value>()
            .unwrap()["amount"],
        "12.50"
    );
    assert_eq!(record(&outbox, "d").await.status, Status::Pending);
}

async fn retry_after_is_honoured<DB: Backend>(pool: Pool<DB>) {
    let outbox = outbox(&pool).await;
    enqueue_committed(&pool, &outbox, charge("c", "12.50")).await;
    let downstream = Downstream::answering([SendOutcome::Retry {
        after: Some(Duration::from_secs(3600)),
        reason: "409 the key's first request is still running".into(),
    }]);
    let dispatcher = dispatcher(&outbox, &downstream);

    let before = SystemTime::now();
    assert_eq!(dispatcher.run_once().await.unwrap(), 1);
    assert_eq!(dispatcher.run_once().await.unwrap(), 0);

    let waiting = record(&outbox, "c").await;
    assert_eq!(waiting.status, Status::Pending);
    assert_eq!(waiting.attempts, 1);
    assert!(!waiting.outcome_unknown);
    assert_eq!(
        waiting.last_error.as_deref(),
        Some("409 the key's first request is still running")
    );
    assert!(waiting.next_attempt_at >= before + Duration::from_secs(3599));
    assert_eq!(downstream.sends().len(), 1);
}

async fn gives_up_after_max_attempts_and_says_why<DB: Backend>(pool: Pool<DB>) {
    let outbox = outbox(&pool).await;
    enqueue_committed(&pool, &outbox, charge("c", "12.50")).await;
    let unavailable = || SendOutcome::Retry {
        after: None,
        reason: "409 the key's first request is still running".into(),
    };
    let downstream =
        Downstream::answering([unavailable(), unavailable(), unavailable(), unavailable()]);
    let dispatcher = dispatcher(&outbox, &downstream).max_attempts(3);

    for _ in 0..3 {
        assert_eq!(dispatcher.run_once().await.unwrap(), 1);
    }
    assert_eq!(dispatcher.run_once().await.unwrap(), 0);

    let failed = record(&outbox, "c").await;
    assert_eq!(failed.status, Status::Failed);
    assert_eq!(failed.attempts, 3);
    assert_eq!(
        failed.last_error.as_deref(),
        Some("gave up after 3 attempts: 409 the key's first request is still running")
    );
    let attempts: Vec<u32> = downstream.sends().into_iter().map(|(_, n)| n).collect();
    assert_eq!(attempts, vec![1, 2, 3]);
}

async fn rejection_fails_without_retrying<DB: Backend>(pool: Pool<DB>) {
    let outbox = outbox(&pool).await;
    enqueue_committed(&pool, &outbox, charge("c", "12.50")).await;
    let downstream = Downstream::answering([SendOutcome::Rejected {
        reason: "card declined".into(),
    }]);
    let dispatcher = dispatcher(&outbox, &downstream);

    assert_eq!(dispatcher.run_once().await.unwrap(), 1);
    assert_eq!(dispatcher.run_once().await.unwrap(), 0);
    let failed = record(&outbox, "c").await;
    assert_eq!(failed.status, Status::Failed);
    assert_eq!(failed.last_error.as_deref(), Some("card declined"));
    assert_eq!(downstream.sends().len(), 1);
}

async fn unknown_outcome_found_by_lookup_is_delivered_without_resending<DB: Backend>(
    pool: Pool<DB>,
) {
    let outbox = outbox(&pool).await;
    enqueue_committed(&pool, &outbox, charge("c", "12.50")).await;
    let downstream = Downstream::answering([SendOutcome::Unknown {
        reason: "connection reset".into(),
    }])
    .looking_up([LookupOutcome::Found {
        receipt: "ch_found".into(),
    }]);
    let dispatcher = dispatcher(&outbox, &downstream);

    assert_eq!(dispatcher.run_once().await.unwrap(), 1);
    let unknown = record(&outbox, "c").await;
    assert_eq!(unknown.status, Status::Pending);
    assert!(unknown.outcome_unknown);
    assert_eq!(unknown.last_error.as_deref(), Some("connection reset"));

    assert_eq!(dispatcher.run_once().await.unwrap(), 1);
    let delivered = record(&outbox, "c").await;
    assert_eq!(delivered.status, Status::Delivered);
    assert_eq!(delivered.receipt.as_deref(), Some("ch_found"));
    assert_eq!(delivered.attempts, 1);
    assert_eq!(downstream.sends().len(), 1);
    assert_eq!(downstream.lookups(), vec![key("c").to_string()]);
}

async fn unknown_outcome_not_found_waits_for_the_grace_then_resends_with_same_key<DB: Backend>(
    pool: Pool<DB>,
) {
    let outbox = outbox(&pool).await;
    enqueue_committed(&pool, &outbox, charge("c", "12.50")).await;
    let downstream = Downstream::answering([SendOutcome::Unknown {
        reason: "timed out".into(),
    }])
    .always_looking_up(LookupOutcome::NotFound);
    let grace = Duration::from_millis(1500);
    let dispatcher = dispatcher(&outbox, &downstream).lookup_grace(grace);

    assert_eq!(dispatcher.run_once().await.unwrap(), 1);
    let sent_at = record(&outbox, "c").await.last_attempt_at.unwrap();

    // Looked up within the grace: not found, but the first attempt may still be running.
    assert_eq!(dispatcher.run_once().await.unwrap(), 1);
    let waiting = record(&outbox, "c").await;
    assert_eq!(waiting.status, Status::Pending);
    assert!(waiting.outcome_unknown);
    assert_eq!(waiting.next_attempt_at, sent_at + grace);
    assert_eq!(downstream.sends().len(), 1);
    assert_eq!(downstream.lookups().len(), 1);
    assert_eq!(dispatcher.run_once().await.unwrap(), 0);

    let until_due = waiting
        .next_attempt_at
        .duration_since(SystemTime::now())
        .unwrap_or_default();
    tokio::time::sleep(until_due + Duration::from_millis(50)).await;
    assert_eq!(dispatcher.run_once().await.unwrap(), 1);

    let delivered = record(&outbox, "c").await;
    assert_eq!(delivered.status, Status::Delivered);
    assert_eq!(downstream.lookups().len(), 2);
    assert_eq!(
        downstream.sends(),
        vec![(key("c").to_string(), 1), (key("c").to_string(), 2)]
    );
}

async fn failing_lookup_never_resends<DB: Backend>(pool: Pool<DB>) {
    let outbox = outbox(&pool).await;
    enqueue_committed(&pool, &outbox, charge("c", "12.50")).await;
    let downstream = Downstream::answering([SendOutcome::Unknown {
        reason: "timed out".into(),
    }])
    .always_looking_up(LookupOutcome::Failed {
        reason: "lookup returned 500".into(),
    });
    let dispatcher = dispatcher(&outbox, &downstream).max_attempts(2);

    for _ in 0..4 {
        dispatcher.run_once().await.unwrap();
    }
    let waiting = record(&outbox, "c").await;
    assert_eq!(waiting.status, Status::Pending);
    assert!(waiting.outcome_unknown);
    assert_eq!(
        waiting.last_error.as_deref(),
        Some("lookup failed: lookup returned 500")
    );
    assert_eq!(downstream.sends().len(), 1);
    assert_eq!(downstream.lookups().len(), 3);
}

async fn unknown_outcome_without_lookup_resends_with_same_key<DB: Backend>(pool: Pool<DB>) {
    let outbox = outbox(&pool).await;
    enqueue_committed(&pool, &outbox, charge("c", "12.50")).await;
    let downstream = Downstream::answering([SendOutcome::Unknown {
        reason: "connection reset".into(),
    }]);
    let dispatcher = dispatcher(&outbox, &downstream);

    assert_eq!(dispatcher.run_once().await.unwrap(), 1);
    assert_eq!(dispatcher.run_once().await.unwrap(), 1);
    assert_eq!(record(&outbox, "c").await.status, Status::Delivered);
    assert_eq!(
        downstream.sends(),
        vec![(key("c").to_string(), 1), (key("c").to_string(), 2)]
    );
}

async fn crashed_dispatcher_lease_expires_then_message_is_looked_up<DB: Backend>(pool: Pool<DB>) {
    let outbox = outbox(&pool).await;
    enqueue_committed(&pool, &outbox, charge("c", "12.50")).await;

    let stuck = Downstream::default();
    stuck.0.hang.store(true, Ordering::SeqCst);
    let lease = Duration::from_millis(1200);
    let crashing = dispatcher(&outbox, &stuck)
        .send_timeout(Duration::from_millis(500))
        .lease(lease);
    let task = tokio::spawn(async move { crashing.run_once().await });
    stuck.0.entered.notified().await;
    // Killed mid-send: nothing records the outcome, only the lease remains.
    task.abort();
    let _ = task.await;
    looked_up_once_the_lease_runs_out(&outbox, &outbox, "c", lease).await;
}

/// The message `discriminator`, its sender killed mid-send under a lease of `lease`: no claim
/// through `elsewhere` takes it while the lease holds; once it has run out, one takes it and
/// looks it up, finds it delivered, and records it so without resending.
async fn looked_up_once_the_lease_runs_out<DB: Backend>(
    outbox: &Outbox<DB>,
    elsewhere: &Outbox<DB>,
    discriminator: &str,
    lease: Duration,
) {
    let orphan = record(outbox, discriminator).await;
    assert_eq!(orphan.status, Status::Pending);
    assert!(orphan.outcome_unknown);
    assert_eq!(orphan.attempts, 1);

    let receipt = format!("ch_{discriminator}");
    let survivor = Downstream::default().looking_up([LookupOutcome::Found {
        receipt: receipt.clone(),
    }]);
    let taking_over = dispatcher(elsewhere, &survivor);
    assert_eq!(
        taking_over.run_once().await.unwrap(),
        0,
        "the lease still holds"
    );

    let leased_at = orphan.last_attempt_at.unwrap();
    let until_expiry = (leased_at + lease)
        .duration_since(SystemTime::now())
        .unwrap_or_default();
    tokio::time::sleep(until_expiry + Duration::from_millis(100)).await;
    assert_eq!(taking_over.run_once().await.unwrap(), 1);

    let delivered = record(outbox, discriminator).await;
    assert_eq!(delivered.status, Status::Delivered);
    assert_eq!(delivered.receipt, Some(receipt));
    assert!(
        survivor.sends().is_empty(),
        "found by lookup, so never resent"
    );
    assert_eq!(survivor.lookups(), vec![key(discriminator).to_string()]);
}

async fn slow_send_keeps_its_lease_by_renewing_it<DB: Backend>(pool: Pool<DB>) {
    let outbox = outbox(&pool).await;
    enqueue_committed(&pool, &outbox, charge("slow", "3.00")).await;

    // The send takes more than twice the lease: only renewals keep the message with its
    // dispatcher.
    let slow = Downstream::default();
    slow.0.delay_ms.store(3_000, Ordering::SeqCst);
    let sending = dispatcher(&outbox, &slow)
        .send_timeout(Duration::from_secs(10))
        .lease(Duration::from_millis(1200));
    let task = tokio::spawn(async move { sending.run_once().await });
    slow.0.entered.notified().await;

    let other = Downstream::default().always_looking_up(LookupOutcome::NotFound);
    let rival = dispatcher(&outbox, &other).lease(Duration::from_millis(1200));
    while !task.is_finished() {
        assert_eq!(
            rival.run_once().await.unwrap(),
            0,
            "the live dispatcher's lease is renewed while it sends"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(task.await.unwrap().unwrap(), 1);
    assert_eq!(record(&outbox, "slow").await.status, Status::Delivered);
    assert_eq!(slow.sends().len(), 1);
    assert!(other.sends().is_empty() && other.lookups().is_empty());
}

async fn two_dispatchers_deliver_each_message_exactly_once<DB: Backend>(pool: Pool<DB>) {
    let outbox = outbox(&pool).await;
    let total = 40;
    for n in 0..total {
        enqueue_committed(&pool, &outbox, charge(&format!("c{n}"), "1.00")).await;
    }
    let downstream = Downstream::default();
    downstream.0.max_delay_ms.store(30, Ordering::SeqCst);

    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut runs = Vec::new();
    for _ in 0..2 {
        let mut stopped = stopped.clone();
        let dispatcher = dispatcher(&outbox, &downstream)
            .batch_size(4)
            .poll_interval(Duration::from_millis(20));
        runs.push(tokio::spawn(dispatcher.run(async move {
            let _ = stopped.wait_for(|stop| *stop).await;
        })));
    }

    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let mut delivered = 0;
        for n in 0..total {
            if record(&outbox, &format!("c{n}")).await.status == Status::Delivered {
                delivered += 1;
            }
        }
        if delivered == total {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "only {delivered} delivered"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.send(true).unwrap();
    for run in runs {
        tokio::time::timeout(Duration::from_secs(10), run)
            .await
            .expect("run() returns after shutdown")
            .unwrap();
    }

    let mut per_key: HashMap<String, usize> = HashMap::new();
    for (key, attempt) in downstream.sends() {
        assert_eq!(attempt, 1, "{key} was sent as attempt {attempt}");
        *per_key.entry(key).or_default() += 1;
    }
    assert_eq!(per_key.len(), total);
    assert!(per_key.values().all(|&sends| sends == 1), "{per_key:?}");
    for n in 0..total {
        assert_eq!(record(&outbox, &format!("c{n}")).await.attempts, 1);
    }
}

async fn migrate_is_idempotent_and_safe_when_run_concurrently<DB: Backend>(pool: Pool<DB>) {
    let first = Outbox::new(pool.clone());
    let second = Outbox::new(pool.clone());
    let (a, b) = tokio::join!(first.migrate(), second.migrate());
    a.unwrap();
    b.unwrap();
    enqueue_committed(&pool, &first, charge("c", "12.50")).await;
    first.migrate().await.unwrap();
    assert_eq!(record(&first, "c").await.status, Status::Pending);
}

/// The outbox's tables standing with no version recorded (a migration that stopped in between:
/// MySQL commits DDL as it goes) are migrated again as version 1, their messages kept;
/// migrating again applies nothing twice.
async fn a_migration_that_stopped_before_recording_its_version_completes_on_the_next_run<
    DB: Backend,
>(
    pool: Pool<DB>,
) where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
    i64: sqlx::Type<DB> + for<'r> sqlx::Decode<'r, DB>,
{
    let outbox = outbox(&pool).await;
    enqueue_committed(&pool, &outbox, charge("kept", "1.00")).await;
    sqlx::raw_sql("DROP TABLE idempotency_outbox_schema_versions")
        .execute(&pool)
        .await
        .unwrap();

    outbox.migrate().await.unwrap();
    outbox.migrate().await.unwrap();

    assert_eq!(record(&outbox, "kept").await.status, Status::Pending);
    let versions: Vec<i64> =
        sqlx::query_scalar("SELECT version FROM idempotency_outbox_schema_versions")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(versions, [1]);
}

async fn failed_message_is_requeued_through_the_api_and_delivered_with_its_key<DB: Backend>(
    pool: Pool<DB>,
) {
    let outbox = outbox(&pool).await;
    enqueue_committed(&pool, &outbox, charge("c", "12.50")).await;
    let downstream = Downstream::answering([
        SendOutcome::Rejected {
            reason: "account frozen".into(),
        },
        SendOutcome::Delivered {
            receipt: "ch_1".into(),
        },
    ]);
    let dispatcher = dispatcher(&outbox, &downstream);
    assert_eq!(dispatcher.run_once().await.unwrap(), 1);
    let failed = record(&outbox, "c").await;
    assert_eq!(failed.status, Status::Failed);

    // Only a failed message can be requeued; the cause fixed, it goes out with the same key.
    assert!(outbox.requeue(failed.id).await.unwrap());
    assert!(!outbox.requeue(failed.id).await.unwrap());
    let pending = record(&outbox, "c").await;
    assert_eq!((pending.status, pending.attempts), (Status::Pending, 0));
    assert_eq!(dispatcher.run_once().await.unwrap(), 1);
    let delivered = record(&outbox, "c").await;
    assert_eq!(delivered.status, Status::Delivered);
    assert_eq!(delivered.receipt.as_deref(), Some("ch_1"));
    assert!(!outbox.requeue(delivered.id).await.unwrap());
    let keys: Vec<String> = downstream.sends().into_iter().map(|(k, _)| k).collect();
    assert_eq!(keys, vec![key("c").to_string(); 2]);
}

async fn purge_deletes_only_finished_rows_past_retention<DB: Backend>(pool: Pool<DB>) {
    let outbox = outbox(&pool).await;
    for n in 0..7 {
        enqueue_committed(&pool, &outbox, charge(&format!("d{n}"), "1.00")).await;
    }
    let delivered = (0..7).map(|n| SendOutcome::Delivered {
        receipt: format!("ch_{n}"),
    });
    let downstream = Downstream::answering(delivered);
    let delivering = dispatcher(&outbox, &downstream);
    while delivering.run_once().await.unwrap() > 0 {}
    // One set aside by an operator, one failed, one pending.
    for key in ["skipped", "failed"] {
        enqueue_committed(&pool, &outbox, charge(key, "1.00")).await;
        let refusing = Downstream::answering([SendOutcome::Rejected {
            reason: "account frozen".into(),
        }]);
        assert_eq!(dispatcher(&outbox, &refusing).run_once().await.unwrap(), 1);
    }
    assert!(
        outbox
            .skip(record(&outbox, "skipped").await.id)
            .await
            .unwrap()
    );
    enqueue_committed(&pool, &outbox, charge("pending", "1.00")).await;

    // Nothing is old enough yet under a one-hour retention.
    let kept = outbox.clone().retention(Duration::from_secs(3600));
    assert_eq!(kept.purge_expired().await.unwrap(), 0);
    tokio::time::sleep(Duration::from_millis(20)).await;
    // The 7 delivered rows and the skipped one are gone; the failed and pending ones stay.
    let purging = outbox.clone().retention(Duration::ZERO);
    assert_eq!(purging.purge_expired().await.unwrap(), 8);
    assert_eq!(outbox.status_by_key(&key("d0")).await.unwrap(), None);
    assert_eq!(outbox.status_by_key(&key("skipped")).await.unwrap(), None);
    assert_eq!(record(&outbox, "failed").await.status, Status::Failed);
    assert_eq!(record(&outbox, "pending").await.status, Status::Pending);
}

/// The claim itself marks the attempt: a dispatcher that dies right after claiming leaves a
/// message the next claim looks up, never one it resends blindly.
async fn a_claim_records_the_attempt_before_the_send<DB: Backend>(pool: Pool<DB>) {
    let outbox = outbox(&pool).await;
    enqueue_committed(&pool, &outbox, charge("c", "12.50")).await;
    let stuck = Downstream::default();
    stuck.0.hang.store(true, Ordering::SeqCst);
    let sending = dispatcher(&outbox, &stuck);
    let before = SystemTime::now() - Duration::from_millis(1);
    let task = tokio::spawn(async move { sending.run_once().await });
    stuck.0.entered.notified().await;

    let sending = record(&outbox, "c").await;
    assert_eq!(sending.attempts, 1);
    assert!(sending.outcome_unknown);
    assert!(sending.last_attempt_at.unwrap() >= before);
    assert_eq!(stuck.sends(), vec![(key("c").to_string(), 1)]);
    task.abort();
    let _ = task.await;
}

/// A message that used up its attempts under a lower `max_attempts` fails at the claim's
/// dispatcher without one more send.
async fn a_message_out_of_attempts_fails_without_another_send<DB: Backend>(pool: Pool<DB>) {
    let outbox = outbox(&pool).await;
    enqueue_committed(&pool, &outbox, charge("c", "12.50")).await;
    let unavailable = || SendOutcome::Retry {
        after: None,
        reason: "409 the key's first request is still running".into(),
    };
    let downstream = Downstream::answering([unavailable(), unavailable()]);
    let patient = dispatcher(&outbox, &downstream).max_attempts(5);
    assert_eq!(patient.run_once().await.unwrap(), 1);
    assert_eq!(patient.run_once().await.unwrap(), 1);
    assert_eq!(record(&outbox, "c").await.attempts, 2);

    let strict = dispatcher(&outbox, &downstream).max_attempts(2);
    assert_eq!(strict.run_once().await.unwrap(), 1);
    let failed = record(&outbox, "c").await;
    assert_eq!(failed.status, Status::Failed);
    assert_eq!(failed.attempts, 2);
    assert_eq!(
        failed.last_error.as_deref(),
        Some("gave up after 2 attempts: 409 the key's first request is still running")
    );
    assert_eq!(downstream.sends().len(), 2);
}

/// Sends run in a sliding window: a slow send holds one slot, not the whole batch.
async fn fast_sends_go_on_while_a_slow_one_runs<DB: Backend>(pool: Pool<DB>) {
    let outbox = outbox(&pool).await;
    enqueue_committed(&pool, &outbox, charge("slow", "1.00")).await;
    let fast = 12;
    for n in 0..fast {
        enqueue_committed(&pool, &outbox, charge(&format!("f{n}"), "1.00")).await;
    }
    let downstream = Downstream::default();
    downstream
        .0
        .delay_ms_by_key
        .lock()
        .unwrap()
        .insert(key("slow").to_string(), 4_000);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = dispatcher(&outbox, &downstream)
        .batch_size(4)
        .send_timeout(Duration::from_secs(10));
    let task = tokio::spawn(running.run(async {
        let _ = stopped.await;
    }));

    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    for n in 0..fast {
        while record(&outbox, &format!("f{n}")).await.status != Status::Delivered {
            assert!(
                tokio::time::Instant::now() < deadline,
                "f{n} waited for the slow send"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    assert_eq!(record(&outbox, "slow").await.status, Status::Pending);
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("run() returns after shutdown")
        .unwrap();
    assert_eq!(record(&outbox, "slow").await.status, Status::Delivered);
    assert_eq!(downstream.sends().len(), fast + 1);
}

async fn shutdown_records_the_sends_in_hand_and_claims_no_more<DB: Backend>(pool: Pool<DB>) {
    let outbox = outbox(&pool).await;
    for n in 0..6 {
        enqueue_committed(&pool, &outbox, charge(&format!("c{n}"), "1.00")).await;
    }
    let downstream = Downstream::default();
    downstream.0.delay_ms.store(400, Ordering::SeqCst);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(dispatcher(&outbox, &downstream).batch_size(3).run(async {
        let _ = stopped.await;
    }));
    downstream.0.entered.notified().await;
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("run() returns after shutdown")
        .unwrap();

    let mut delivered = 0;
    for n in 0..6 {
        let message = record(&outbox, &format!("c{n}")).await;
        match message.status {
            Status::Delivered => {
                assert_eq!(message.attempts, 1);
                delivered += 1;
            }
            status => assert_eq!((status, message.attempts), (Status::Pending, 0)),
        }
    }
    assert_eq!(delivered, 3, "the window of 3 in hand, and no claim after");
    assert_eq!(downstream.sends().len(), 3);
}

/// Outcomes are written in batches, each still under its own message's lease: one taken over
/// mid-send is left to its new holder while the others are recorded.
async fn a_batched_settle_writes_each_outcome_only_under_its_own_lease<DB: Backend>(pool: Pool<DB>)
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    let outbox = outbox(&pool).await;
    for name in ["kept", "taken"] {
        enqueue_committed(&pool, &outbox, charge(name, "1.00")).await;
    }
    let downstream = Downstream::default();
    downstream.0.delay_ms.store(500, Ordering::SeqCst);
    let (captured, _guard) = capture_warnings();
    let take_over = async {
        downstream.0.entered.notified().await;
        // Another dispatcher's claim, as after an expired lease.
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "UPDATE idempotency_outbox SET lease_token = 7 WHERE downstream_key = '{}'",
            key("taken")
        )))
        .execute(&pool)
        .await
        .unwrap();
    };
    let sending = dispatcher(&outbox, &downstream);
    let (claimed, ()) = tokio::join!(sending.run_once(), take_over);
    assert_eq!(claimed.unwrap(), 2);

    let logs = captured.text();
    assert!(
        logs.contains("outbox lease lost before recording the outcome"),
        "{logs}"
    );
    assert_eq!(record(&outbox, "kept").await.status, Status::Delivered);
    let taken = record(&outbox, "taken").await;
    assert_eq!(taken.status, Status::Pending);
    assert!(taken.outcome_unknown, "its new holder looks it up first");
    assert_eq!(downstream.sends().len(), 2);
}

/// A renewal that misses a message because its settle got there first is not a lost lease.
async fn renewals_racing_settles_report_no_lost_lease<DB: Backend>(pool: Pool<DB>) {
    let outbox = outbox(&pool).await;
    let total = 24;
    for n in 0..total {
        enqueue_committed(&pool, &outbox, charge(&format!("c{n}"), "1.00")).await;
    }
    let downstream = Downstream::default();
    // Sends end around the renewals, which come every third of the one-second lease.
    downstream.0.max_delay_ms.store(700, Ordering::SeqCst);
    // The dispatcher runs in this test's own task, on this thread, so the subscriber sees it.
    let (captured, _guard) = capture_warnings();
    let all_delivered = async {
        loop {
            let mut delivered = 0;
            for n in 0..total {
                if record(&outbox, &format!("c{n}")).await.status == Status::Delivered {
                    delivered += 1;
                }
            }
            if delivered == total {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let running = dispatcher(&outbox, &downstream)
        .batch_size(6)
        .lease(Duration::from_secs(1));
    tokio::time::timeout(Duration::from_secs(60), running.run(all_delivered))
        .await
        .expect("all delivered");

    let logs = captured.text();
    assert!(!logs.contains("lease lost"), "{logs}");
    assert_eq!(downstream.sends().len(), total);
}

/// A claim asked for while the pool's only connection is busy (a pool in use, a database on
/// its way back) runs once the connection is free: its leases count from then, not from when
/// it was asked for, so they do not run out under the dispatcher's next claim, which would take
/// the same messages and send them a second time.
async fn a_claim_that_waited_for_a_connection_leases_from_when_it_ran<DB: Backend>(pool: Pool<DB>) {
    let checks = outbox(&pool).await;
    let total = 4;
    for n in 0..total {
        enqueue_committed(&pool, &checks, charge(&format!("c{n}"), "1.00")).await;
    }
    let one = sqlx::pool::PoolOptions::<DB>::new()
        .max_connections(1)
        .connect_with((*pool.connect_options()).clone())
        .await
        .unwrap();
    let busy = one.acquire().await.unwrap();
    let downstream = Downstream::default();
    // Longer than the lease: the messages stay ours only if their leases are renewed.
    downstream.0.delay_ms.store(1500, Ordering::SeqCst);
    let (captured, _guard) = capture_warnings();
    let freed = async {
        tokio::time::sleep(Duration::from_secs(2)).await;
        drop(busy);
    };
    let all_delivered = async {
        loop {
            let mut delivered = 0;
            for n in 0..total {
                if record(&checks, &format!("c{n}")).await.status == Status::Delivered {
                    delivered += 1;
                }
            }
            if delivered == total {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let running = dispatcher(&Outbox::new(one.clone()), &downstream)
        .poll_interval(Duration::from_millis(100))
        .lease(Duration::from_secs(1));
    let done = async {
        tokio::join!(freed, all_delivered);
    };
    tokio::time::timeout(Duration::from_secs(60), running.run(done))
        .await
        .expect("all delivered");

    let logs = captured.text();
    assert!(!logs.contains("lease lost"), "{logs}");
    assert_eq!(downstream.sends().len(), total, "{:?}", downstream.sends());
    for n in 0..total {
        assert_eq!(record(&checks, &format!("c{n}")).await.attempts, 1);
    }
    one.close().await;
}

/// Warnings logged on this thread from now until the guard is dropped. Only what runs in the
/// test's own task is seen, not what it spawns onto the runtime's other threads.
fn capture_warnings() -> (Captured, tracing::subscriber::DefaultGuard) {
    let captured = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(captured.clone())
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .finish();
    (captured, tracing::subscriber::set_default(subscriber))
}

/// Log lines written by the test's own subscriber.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl std::io::Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Captured;

    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

/// A dispatcher claims a batch ahead of its free send slots; those still waiting at shutdown
/// are given back as if never claimed, and the next dispatcher sends them as first attempts.
async fn a_message_claimed_ahead_and_unsent_at_shutdown_is_not_charged_an_attempt<DB: Backend>(
    pool: Pool<DB>,
) {
    let outbox = outbox(&pool).await;
    for name in ["a", "b"] {
        enqueue_committed(&pool, &outbox, charge(name, "1.00")).await;
    }
    let downstream = Downstream::default();
    downstream.0.delay_ms.store(300, Ordering::SeqCst);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(dispatcher(&outbox, &downstream).batch_size(1).run(async {
        let _ = stopped.await;
    }));
    downstream.0.entered.notified().await;
    let sent_key = downstream.sends()[0].0.clone();
    let (sent, waiting) = if sent_key == key("a").to_string() {
        ("a", "b")
    } else {
        ("b", "a")
    };
    let claimed_ahead = record(&outbox, waiting).await;
    assert_eq!(
        (claimed_ahead.attempts, claimed_ahead.outcome_unknown),
        (1, true),
        "claimed with the one sent, its attempt begun by the claim"
    );
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("run() returns after shutdown")
        .unwrap();

    assert_eq!(record(&outbox, sent).await.status, Status::Delivered);
    let given_back = record(&outbox, waiting).await;
    assert_eq!(given_back.status, Status::Pending);
    assert_eq!(given_back.attempts, 0);
    assert!(!given_back.outcome_unknown);
    assert_eq!(given_back.last_attempt_at, None);
    assert_eq!(downstream.sends(), vec![(key(sent).to_string(), 1)]);

    let next = Downstream::default();
    assert_eq!(dispatcher(&outbox, &next).run_once().await.unwrap(), 1);
    let delivered = record(&outbox, waiting).await;
    assert_eq!(
        (delivered.status, delivered.attempts),
        (Status::Delivered, 1)
    );
    assert_eq!(next.sends(), vec![(key(waiting).to_string(), 1)]);
    assert!(
        next.lookups().is_empty(),
        "never sent, so nothing to look up"
    );
}

/// A message claimed ahead waits for a send slot after its claim began the attempt; its
/// outcome records when the send started, and a lookup's grace counts from then.
async fn the_lookup_grace_counts_from_the_send_not_the_claim<DB: Backend>(pool: Pool<DB>) {
    let outbox = outbox(&pool).await;
    for name in ["a", "b"] {
        enqueue_committed(&pool, &outbox, charge(name, "1.00")).await;
    }
    let unknown = || SendOutcome::Unknown {
        reason: "timed out".into(),
    };
    let downstream =
        Downstream::answering([unknown(), unknown()]).always_looking_up(LookupOutcome::NotFound);
    downstream.0.delay_ms.store(600, Ordering::SeqCst);
    let grace = Duration::from_secs(30);
    let looking = || dispatcher(&outbox, &downstream).lookup_grace(grace);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    // The first may be looked up while the second is sent: it is due again at once.
    let task = tokio::spawn(looking().batch_size(1).run(async {
        let _ = stopped.await;
    }));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while downstream.sends().len() < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the second never sent"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("run() returns after shutdown")
        .unwrap();

    let (a, b) = (record(&outbox, "a").await, record(&outbox, "b").await);
    assert!(a.outcome_unknown && b.outcome_unknown);
    let (a_sent, b_sent) = (a.last_attempt_at.unwrap(), b.last_attempt_at.unwrap());
    let (first, second) = (a_sent.min(b_sent), a_sent.max(b_sent));
    assert!(
        second >= first + Duration::from_millis(550),
        "claimed together, the second's send waited for the first's slot: {first:?}, {second:?}"
    );

    looking().run_once().await.unwrap();
    for (name, sent_at) in [("a", a_sent), ("b", b_sent)] {
        let waiting = record(&outbox, name).await;
        assert_eq!(waiting.status, Status::Pending);
        assert_eq!(waiting.next_attempt_at, sent_at + grace, "{name}");
    }
    assert_eq!(downstream.sends().len(), 2);
}

/// However many times the destination is out of reach, the message keeps its attempts for
/// answers that refuse or fail the work: twelve outages under a cap of three still deliver.
async fn an_outage_is_not_an_attempt<DB: Backend>(pool: Pool<DB>) {
    let outbox = outbox(&pool).await;
    enqueue_committed(&pool, &outbox, charge("c", "12.50")).await;
    let unavailable = || SendOutcome::Unavailable {
        after: None,
        reason: "connection refused".into(),
    };
    let downstream = Downstream::answering((0..12).map(|_| unavailable()));
    let dispatcher = dispatcher(&outbox, &downstream).max_attempts(3);

    for _ in 0..12 {
        assert_eq!(dispatcher.run_once().await.unwrap(), 1);
        let waiting = record(&outbox, "c").await;
        assert_eq!(waiting.status, Status::Pending);
        assert_eq!(waiting.attempts, 0, "an outage counted as an attempt");
        assert!(!waiting.outcome_unknown);
        assert_eq!(
            waiting.last_error.as_deref(),
            Some("unavailable: connection refused")
        );
    }
    assert_eq!(dispatcher.run_once().await.unwrap(), 1);

    let delivered = record(&outbox, "c").await;
    assert_eq!(delivered.status, Status::Delivered);
    assert_eq!(delivered.attempts, 1);
    // Every call carried the same key and saw no attempt spent before it.
    let sends = downstream.sends();
    assert_eq!(sends.len(), 13);
    assert!(
        sends
            .iter()
            .all(|(k, n)| *k == key("c").to_string() && *n == 1)
    );
}

/// During an outage the dispatcher stops sending all but one message at a time, the probe, and
/// resumes at full speed once the destination answers: no message spends an attempt on it.
async fn an_outage_pauses_the_destination_and_probes_one_message_at_a_time<DB: Backend>(
    pool: Pool<DB>,
) {
    let outbox = outbox(&pool).await;
    let messages = 24;
    for n in 0..messages {
        enqueue_committed(&pool, &outbox, charge(&format!("m{n}"), "1.00")).await;
    }
    let downstream = Downstream::default();
    downstream.0.down.store(true, Ordering::SeqCst);
    downstream.0.delay_ms.store(20, Ordering::SeqCst);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = dispatcher(&outbox, &downstream)
        .batch_size(8)
        .max_attempts(2)
        .poll_interval(Duration::from_millis(50))
        .probe_backoff(Backoff::exponential(
            Duration::from_millis(100),
            Duration::from_millis(100),
        ));
    let task = tokio::spawn(running.run(async {
        let _ = stopped.await;
    }));

    // The first window's sends find the outage; from then on, one probe at a time.
    tokio::time::sleep(Duration::from_millis(300)).await;
    downstream.0.most_in_flight.store(0, Ordering::SeqCst);
    let calls_before = downstream.sends().len();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let probes = downstream.sends().len() - calls_before;
    assert_eq!(
        downstream.0.most_in_flight.load(Ordering::SeqCst),
        1,
        "a paused destination got more than one send at a time"
    );
    // Waits drawn from 0..=100 ms, each probe taking 20 ms: far fewer than a send per message
    // and retry, and at least a few.
    assert!(
        (3..=75).contains(&probes),
        "{probes} probes in 1.5 s of outage"
    );
    // None spent an attempt on the outage: a message claimed holds the one its claim began
    // only until it is sent as the probe or put back.
    for n in 0..messages {
        let waiting = record(&outbox, &format!("m{n}")).await;
        assert_eq!(waiting.status, Status::Pending, "m{n}");
        assert!(waiting.attempts <= 1, "m{n}: {waiting:?}");
    }

    downstream.0.down.store(false, Ordering::SeqCst);
    downstream.0.most_in_flight.store(0, Ordering::SeqCst);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let mut delivered = 0;
        for n in 0..messages {
            if record(&outbox, &format!("m{n}")).await.status == Status::Delivered {
                delivered += 1;
            }
        }
        if delivered == messages {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{delivered} of {messages} delivered 10 s after the destination came back"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Resumed at full speed: sends in parallel again.
    assert!(downstream.0.most_in_flight.load(Ordering::SeqCst) > 1);
    for n in 0..messages {
        assert_eq!(record(&outbox, &format!("m{n}")).await.attempts, 1);
    }
    let _ = stop.send(());
    task.await.unwrap();
}

/// A message of `topic` whose downstream key is `name`.
fn topic_message(topic: &str, name: String) -> Message {
    let key = DownstreamKey::new(name).unwrap();
    Message::json(topic, key, &serde_json::json!({ "amount": "1.00" })).unwrap()
}

/// A sender for two destinations, one per topic; the one of `PAUSED_TOPIC` can be made
/// unreachable. It records how many times each key was delivered.
#[derive(Clone, Default)]
struct TwoDestinations(Arc<TwoDestinationsInner>);

#[derive(Default)]
struct TwoDestinationsInner {
    /// While set, sends of `PAUSED_TOPIC` answer `Unavailable`.
    down: AtomicBool,
    refused: AtomicU64,
    deliveries: Mutex<HashMap<String, u32>>,
}

const PAUSED_TOPIC: &str = "refunds";

impl TwoDestinations {
    fn delivered(&self, prefix: &str) -> usize {
        let deliveries = self.0.deliveries.lock().unwrap();
        deliveries.keys().filter(|k| k.starts_with(prefix)).count()
    }
}

impl Sender for TwoDestinations {
    async fn send(&self, message: &OutboxRecord) -> SendOutcome {
        if message.topic == PAUSED_TOPIC && self.0.down.load(Ordering::SeqCst) {
            self.0.refused.fetch_add(1, Ordering::SeqCst);
            return SendOutcome::Unavailable {
                after: None,
                reason: "connection refused".into(),
            };
        }
        let key = message.downstream_key.to_string();
        *self.0.deliveries.lock().unwrap().entry(key).or_default() += 1;
        SendOutcome::Delivered {
            receipt: format!("receipt-{}", message.id),
        }
    }
}

/// What a dispatcher writes of a waiting message.
fn written(record: &OutboxRecord) -> impl PartialEq + std::fmt::Debug + use<> {
    (
        record.status,
        record.attempts,
        record.outcome_unknown,
        record.next_attempt_at,
        record.last_attempt_at,
        record.last_error.clone(),
    )
}

/// A destination that is down pauses its own topic alone: the other topics' messages are all
/// delivered meanwhile, and the paused topic's backlog waits in the database unwritten, but
/// for the probes, one message each; once the destination is back, each message of the
/// backlog is delivered once, no attempt spent on the outage.
async fn a_paused_topic_waits_untouched_while_other_topics_flow<DB: Backend>(pool: Pool<DB>) {
    let outbox = outbox(&pool).await;
    let (backlog, others) = (2_000, 200);
    let mut tx = pool.begin().await.unwrap();
    let mut paused_ids = Vec::new();
    // The backlog first: it is due before every message of the other topic.
    for n in 0..backlog {
        let refund = topic_message(PAUSED_TOPIC, format!("refund-{n}"));
        paused_ids.push(outbox.enqueue(&mut tx, refund).await.unwrap());
    }
    // Two other topics, interleaved: the claim that leaves the paused topic out merges them.
    for n in 0..others {
        let (topic, name) = if n % 2 == 0 {
            ("charges", format!("charge-{n}"))
        } else {
            ("invoices", format!("charge-invoice-{n}"))
        };
        outbox
            .enqueue(&mut tx, topic_message(topic, name))
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();

    let destinations = TwoDestinations::default();
    destinations.0.down.store(true, Ordering::SeqCst);
    let dispatcher = Dispatcher::new(outbox.clone(), destinations.clone())
        .batch_size(20)
        .poll_interval(Duration::from_millis(50))
        .backoff(Backoff::exponential(Duration::ZERO, Duration::ZERO))
        .probe_backoff(Backoff::exponential(
            Duration::from_millis(200),
            Duration::from_millis(400),
        ));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let started = tokio::time::Instant::now();
    let task = tokio::spawn(dispatcher.run(async {
        let _ = stopped.await;
    }));

    while destinations.delivered("charge-") < others {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{} of {others} messages of the other topics delivered in 10 s",
            destinations.delivered("charge-")
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Paused: the backlog waits as it is, but for one message per probe.
    let refused_before = destinations.0.refused.load(Ordering::SeqCst);
    let mut before = Vec::new();
    for &id in &paused_ids {
        before.push(written(&outbox.status(id).await.unwrap().unwrap()));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut rewritten = 0;
    for (&id, before) in paused_ids.iter().zip(&before) {
        let now = written(&outbox.status(id).await.unwrap().unwrap());
        if now != *before {
            rewritten += 1;
        }
    }
    let probes = destinations.0.refused.load(Ordering::SeqCst) - refused_before;
    assert!(
        rewritten <= probes,
        "{rewritten} of the paused topic's {backlog} messages written while paused, over {probes} probes"
    );
    // Probes wait a jittered backoff of at most 400 ms: a few per second, the two reads of
    // the backlog included, and far fewer than its messages.
    assert!(
        (1..=backlog as u64 / 20).contains(&probes),
        "{probes} probes while paused"
    );
    assert_eq!(destinations.delivered("refund-"), 0);

    destinations.0.down.store(false, Ordering::SeqCst);
    let back = tokio::time::Instant::now();
    while destinations.delivered("refund-") < backlog {
        assert!(
            back.elapsed() < Duration::from_secs(30),
            "{} of the {backlog} paused messages delivered 30 s after the destination came back",
            destinations.delivered("refund-")
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = stop.send(());
    task.await.unwrap();

    let deliveries = destinations.0.deliveries.lock().unwrap().clone();
    assert_eq!(deliveries.len(), backlog + others);
    assert!(
        deliveries.values().all(|&n| n == 1),
        "a message delivered twice"
    );
    for &id in &paused_ids {
        let delivered = outbox.status(id).await.unwrap().unwrap();
        assert_eq!(
            (delivered.status, delivered.attempts),
            (Status::Delivered, 1),
            "{delivered:?}"
        );
    }
}

/// A sender whose sends of `PAUSED_TOPIC` take a while (a broker working off the backlog it
/// missed while it was down); the others are at once.
#[derive(Clone, Default)]
struct SlowBacklog(TwoDestinations);

impl Sender for SlowBacklog {
    async fn send(&self, message: &OutboxRecord) -> SendOutcome {
        if message.topic == PAUSED_TOPIC {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.0.send(message).await
    }
}

/// One destination's backlog (a broker back after an outage) drains alongside the other
/// topics: their messages, though younger than the whole backlog, are delivered within a
/// claim or two, not after it.
async fn a_backlog_of_one_topic_delays_the_others_by_a_claim_not_by_the_backlog<DB: Backend>(
    pool: Pool<DB>,
) {
    let outbox = outbox(&pool).await;
    let (backlog, others) = (1_000, 20);
    let mut tx = pool.begin().await.unwrap();
    for n in 0..backlog {
        let refund = topic_message(PAUSED_TOPIC, format!("refund-{n}"));
        outbox.enqueue(&mut tx, refund).await.unwrap();
    }
    tx.commit().await.unwrap();

    // Ten sends of 20 ms at a time: the backlog takes two seconds at least.
    let sender = SlowBacklog::default();
    let dispatcher = Dispatcher::new(outbox.clone(), sender.clone())
        .batch_size(10)
        .poll_interval(Duration::from_millis(50));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(dispatcher.run(async {
        let _ = stopped.await;
    }));
    let started = tokio::time::Instant::now();
    let until = |prefix: &'static str, count: usize| {
        let sender = sender.clone();
        async move {
            while sender.0.delivered(prefix) < count {
                assert!(
                    started.elapsed() < Duration::from_secs(60),
                    "{} of {count} {prefix} messages delivered in 60 s",
                    sender.0.delivered(prefix)
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    until("refund-", 50).await;
    for n in 0..others {
        let charge = topic_message("charges", format!("charge-{n}"));
        enqueue_committed(&pool, &outbox, charge).await;
    }
    until("charge-", others).await;
    let drained = sender.0.delivered("refund-");
    assert!(
        drained < backlog / 2,
        "the other topic's {others} messages waited for {drained} of the backlog's {backlog}"
    );
    until("refund-", backlog).await;
    let _ = stop.send(());
    task.await.unwrap();
    let deliveries = sender.0.0.deliveries.lock().unwrap().clone();
    assert_eq!(deliveries.len(), backlog + others);
    assert!(
        deliveries.values().all(|&n| n == 1),
        "a message delivered twice"
    );
}

/// A message that cannot be delivered within its time budget fails for good, and its record
/// says why; an outage spends the budget, not attempts.
async fn a_message_gives_up_at_its_time_budget_and_says_why<DB: Backend>(pool: Pool<DB>) {
    let outbox = outbox(&pool).await;
    enqueue_committed(&pool, &outbox, charge("c", "12.50")).await;
    let downstream = Downstream::default();
    downstream.0.down.store(true, Ordering::SeqCst);
    let dispatcher = dispatcher(&outbox, &downstream).give_up_after(Duration::from_millis(400));

    assert_eq!(dispatcher.run_once().await.unwrap(), 1);
    assert_eq!(record(&outbox, "c").await.status, Status::Pending);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(dispatcher.run_once().await.unwrap(), 1);

    let failed = record(&outbox, "c").await;
    assert_eq!(failed.status, Status::Failed);
    assert_eq!(failed.attempts, 0);
    let reason = failed.last_error.unwrap();
    assert!(
        reason == "gave up after 400ms, the time budget; last: unavailable: connection refused",
        "{reason}"
    );
    // Requeued once the cause is fixed, it goes out with its key and its budget renewed.
    downstream.0.down.store(false, Ordering::SeqCst);
    assert!(outbox.requeue(failed.id).await.unwrap());
    assert_eq!(dispatcher.run_once().await.unwrap(), 1);
    assert_eq!(record(&outbox, "c").await.status, Status::Delivered);
}

/// One keyed message as the ordering tests enqueue it: its key and its place in the key's
/// line. Unkeyed messages carry no key.
fn ordered(key: Option<&str>, seq: usize) -> Message {
    let name = format!("{}-{seq}", key.unwrap_or("free"));
    let message = Message::json(
        "orders",
        DownstreamKey::new(common::unique(&name)).unwrap(),
        &serde_json::json!({ "key": key, "seq": seq }),
    )
    .unwrap();
    match key {
        Some(key) => message.ordering_key(key),
        None => message,
    }
}

/// A downstream that records, per ordering key, the order in which it first applied each
/// message, checks that no two sends of one key overlap, and (when `faulty`) answers at random
/// with retries, lost answers (applied or not), outages and delays.
#[derive(Clone, Default)]
struct OrderedDownstream(Arc<OrderedInner>);

#[derive(Default)]
struct OrderedInner {
    faulty: bool,
    /// Per ordering key ("" for none): the `seq`s in the order first applied.
    applied: Mutex<HashMap<String, Vec<u64>>>,
    /// The downstream keys applied at least once.
    seen: Mutex<std::collections::HashSet<String>>,
    /// Sends in flight per ordering key.
    in_flight: Mutex<HashMap<String, usize>>,
    /// Two sends of one key that overlapped.
    overlaps: Mutex<Vec<String>>,
    free_in_flight: AtomicU64,
    most_free_in_flight: AtomicU64,
    /// Downstream keys answered `Rejected` on their next send.
    reject: Mutex<std::collections::HashSet<String>>,
    /// Downstream keys answered `Retry` (in a minute) on their next send.
    retry: Mutex<std::collections::HashSet<String>>,
    sends: Mutex<Vec<String>>,
}

impl OrderedDownstream {
    fn faulty() -> Self {
        Self(Arc::new(OrderedInner {
            faulty: true,
            ..OrderedInner::default()
        }))
    }

    fn applied(&self, key: &str) -> Vec<u64> {
        self.0
            .applied
            .lock()
            .unwrap()
            .get(key)
            .cloned()
            .unwrap_or_default()
    }

    fn sends(&self) -> Vec<String> {
        self.0.sends.lock().unwrap().clone()
    }

    fn apply(&self, message: &OutboxRecord) {
        let key = message.downstream_key.to_string();
        if self.0.seen.lock().unwrap().insert(key) {
            let payload: serde_json::Value = message.payload_json().unwrap();
            let ordering = message.ordering_key.clone().unwrap_or_default();
            let seq = payload["seq"].as_u64().unwrap();
            self.0
                .applied
                .lock()
                .unwrap()
                .entry(ordering)
                .or_default()
                .push(seq);
        }
    }
}

impl Sender for OrderedDownstream {
    async fn send(&self, message: &OutboxRecord) -> SendOutcome {
        let key = message.downstream_key.to_string();
        self.0.sends.lock().unwrap().push(key.clone());
        let ordering = message.ordering_key.clone();
        match &ordering {
            Some(ordering) => {
                let mut in_flight = self.0.in_flight.lock().unwrap();
                let sends = in_flight.entry(ordering.clone()).or_default();
                *sends += 1;
                if *sends > 1 {
                    self.0.overlaps.lock().unwrap().push(ordering.clone());
                }
            }
            None => {
                let now = self.0.free_in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                self.0.most_free_in_flight.fetch_max(now, Ordering::SeqCst);
            }
        }
        let outcome = self.answer(message).await;
        match &ordering {
            Some(ordering) => {
                *self.0.in_flight.lock().unwrap().get_mut(ordering).unwrap() -= 1;
            }
            None => {
                self.0.free_in_flight.fetch_sub(1, Ordering::SeqCst);
            }
        }
        outcome
    }
}

impl OrderedDownstream {
    async fn answer(&self, message: &OutboxRecord) -> SendOutcome {
        let key = message.downstream_key.to_string();
        if self.0.reject.lock().unwrap().remove(&key) {
            return SendOutcome::Rejected {
                reason: "refused".into(),
            };
        }
        if self.0.retry.lock().unwrap().remove(&key) {
            return SendOutcome::Retry {
                after: Some(Duration::from_secs(60)),
                reason: "busy".into(),
            };
        }
        if !self.0.faulty {
            self.apply(message);
            return SendOutcome::Delivered { receipt: key };
        }
        tokio::time::sleep(Duration::from_millis(fastrand::u64(0..15))).await;
        match fastrand::u8(0..100) {
            0..15 => SendOutcome::Retry {
                after: None,
                reason: "busy".into(),
            },
            15..25 => SendOutcome::Unavailable {
                after: None,
                reason: "connection refused".into(),
            },
            // The answer is lost after the downstream applied the message: the resend is a
            // duplicate, which must not count as a later delivery.
            25..35 => {
                self.apply(message);
                SendOutcome::Unknown {
                    reason: "answer lost".into(),
                }
            }
            35..42 => SendOutcome::Unknown {
                reason: "request lost".into(),
            },
            _ => {
                self.apply(message);
                SendOutcome::Delivered { receipt: key }
            }
        }
    }
}

async fn enqueue_all<DB: Backend>(
    pool: &Pool<DB>,
    outbox: &Outbox<DB>,
    messages: Vec<Message>,
) -> Vec<outbox::MessageId> {
    let mut ids = Vec::new();
    for message in messages {
        let mut tx = pool.begin().await.unwrap();
        ids.push(outbox.enqueue(&mut tx, message).await.unwrap());
        tx.commit().await.unwrap();
    }
    ids
}

/// Two dispatchers, a downstream that retries, loses answers, goes away and answers late:
/// each key's messages are applied in the order they were enqueued, never two at once, while
/// messages without a key still go out side by side.
async fn messages_of_one_ordering_key_arrive_in_enqueue_order_one_at_a_time_through_faults<
    DB: Backend,
>(
    pool: Pool<DB>,
) {
    let outbox = outbox(&pool).await;
    let keys = ["order-1", "order-2", "order-3"];
    let per_key = 12;
    let free = 12;
    let mut messages = Vec::new();
    for seq in 0..per_key {
        for key in keys {
            messages.push(ordered(Some(key), seq));
        }
        if seq < free {
            messages.push(ordered(None, seq));
        }
    }
    let ids = enqueue_all(&pool, &outbox, messages).await;
    let downstream = OrderedDownstream::faulty();

    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut runs = Vec::new();
    for _ in 0..2 {
        let mut stopped = stopped.clone();
        let dispatcher = Dispatcher::new(outbox.clone(), downstream.clone())
            .backoff(Backoff::exponential(
                Duration::ZERO,
                Duration::from_millis(5),
            ))
            .probe_backoff(Backoff::exponential(
                Duration::ZERO,
                Duration::from_millis(5),
            ))
            .lookup_grace(Duration::ZERO)
            .max_attempts(100)
            .batch_size(4)
            .poll_interval(Duration::from_millis(10));
        runs.push(tokio::spawn(dispatcher.run(async move {
            let _ = stopped.wait_for(|stop| *stop).await;
        })));
    }

    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        let mut delivered = 0;
        for id in &ids {
            if outbox.status(*id).await.unwrap().unwrap().status == Status::Delivered {
                delivered += 1;
            }
        }
        if delivered == ids.len() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "only {delivered} of {} delivered",
            ids.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.send(true).unwrap();
    for run in runs {
        tokio::time::timeout(Duration::from_secs(10), run)
            .await
            .expect("run() returns after shutdown")
            .unwrap();
    }

    let in_order: Vec<u64> = (0..per_key as u64).collect();
    for key in keys {
        assert_eq!(downstream.applied(key), in_order, "order of {key}");
    }
    assert_eq!(downstream.applied("").len(), free);
    assert_eq!(*downstream.0.overlaps.lock().unwrap(), Vec::<String>::new());
    assert!(
        downstream.0.most_free_in_flight.load(Ordering::SeqCst) > 1,
        "messages without a key went one at a time"
    );
    // The faults did happen: more sends than messages.
    assert!(downstream.sends().len() > ids.len());
}

/// A message that failed for good holds the later messages of its key, and only those, until
/// an operator requeues it (it goes first) or skips it (the next one goes).
async fn a_failed_message_holds_its_key_until_requeued_or_skipped<DB: Backend>(pool: Pool<DB>) {
    let outbox = outbox(&pool).await;
    let messages = vec![
        ordered(Some("a"), 0),
        ordered(Some("a"), 1),
        ordered(Some("a"), 2),
        ordered(Some("b"), 0),
        ordered(Some("b"), 1),
    ];
    let keys: Vec<String> = messages.iter().map(|m| m.key().to_string()).collect();
    let ids = enqueue_all(&pool, &outbox, messages).await;
    let (a0, a1, a2) = (ids[0], ids[1], ids[2]);
    let downstream = OrderedDownstream::default();
    downstream.0.reject.lock().unwrap().insert(keys[0].clone());
    let dispatcher = Dispatcher::new(outbox.clone(), downstream.clone());

    // a0 fails; b's messages go on, one after the other.
    assert_eq!(dispatcher.run_once().await.unwrap(), 2);
    assert_eq!(dispatcher.run_once().await.unwrap(), 1);
    assert_eq!(dispatcher.run_once().await.unwrap(), 0);
    assert_eq!(downstream.applied("b"), [0, 1]);
    assert_eq!(downstream.applied("a"), Vec::<u64>::new());
    let failed = outbox.status(a0).await.unwrap().unwrap();
    assert_eq!(failed.status, Status::Failed);
    assert_eq!(failed.ordering_key.as_deref(), Some("a"));

    // `blocked_by` names the failed message, for each message behind it.
    for held in [a1, a2] {
        let blocker = outbox.blocked_by(held).await.unwrap().unwrap();
        assert_eq!((blocker.id, blocker.status), (a0, Status::Failed));
        assert_eq!(
            outbox.status(held).await.unwrap().unwrap().status,
            Status::Pending
        );
    }
    assert!(outbox.blocked_by(a0).await.unwrap().is_none());
    assert!(outbox.blocked_by(ids[4]).await.unwrap().is_none());

    // Requeued, it goes first, alone; then a1, which fails too.
    assert!(outbox.requeue(a0).await.unwrap());
    downstream.0.reject.lock().unwrap().insert(keys[1].clone());
    assert_eq!(dispatcher.run_once().await.unwrap(), 1);
    assert_eq!(downstream.applied("a"), [0]);
    assert_eq!(dispatcher.run_once().await.unwrap(), 1);
    assert_eq!(
        outbox.status(a1).await.unwrap().unwrap().status,
        Status::Failed
    );
    assert_eq!(outbox.blocked_by(a2).await.unwrap().unwrap().id, a1);
    assert_eq!(dispatcher.run_once().await.unwrap(), 0);

    // Skipped, a1 is never sent again, and a2 goes.
    assert!(
        !outbox.skip(a2).await.unwrap(),
        "only a failed message is skipped"
    );
    assert!(outbox.skip(a1).await.unwrap());
    assert!(!outbox.skip(a1).await.unwrap());
    assert!(!outbox.requeue(a1).await.unwrap());
    let skipped = outbox.status(a1).await.unwrap().unwrap();
    assert_eq!(skipped.status, Status::Skipped);
    assert!(skipped.finished_at.is_some());
    assert!(outbox.blocked_by(a2).await.unwrap().is_none());
    assert_eq!(dispatcher.run_once().await.unwrap(), 1);
    assert_eq!(downstream.applied("a"), [0, 2]);
    assert_eq!(
        downstream.sends().iter().filter(|k| **k == keys[1]).count(),
        1
    );
    assert!(
        !outbox.skip(a2).await.unwrap(),
        "a delivered message is not skipped"
    );
}

/// A message that waits for its retry holds its own key's later messages, and nothing else.
async fn a_message_waiting_for_a_retry_holds_back_only_its_own_key<DB: Backend>(pool: Pool<DB>) {
    let outbox = outbox(&pool).await;
    let messages = vec![
        ordered(Some("a"), 0),
        ordered(Some("a"), 1),
        ordered(Some("b"), 0),
        ordered(Some("b"), 1),
        ordered(None, 0),
        ordered(None, 1),
    ];
    let keys: Vec<String> = messages.iter().map(|m| m.key().to_string()).collect();
    let ids = enqueue_all(&pool, &outbox, messages).await;
    let downstream = OrderedDownstream::default();
    downstream.0.retry.lock().unwrap().insert(keys[0].clone());
    let dispatcher = Dispatcher::new(outbox.clone(), downstream.clone());

    // a0, b0 and both unkeyed go at once; a0 is told to come back in a minute.
    assert_eq!(dispatcher.run_once().await.unwrap(), 4);
    assert_eq!(dispatcher.run_once().await.unwrap(), 1);
    assert_eq!(dispatcher.run_once().await.unwrap(), 0);
    assert_eq!(downstream.applied("b"), [0, 1]);
    assert_eq!(downstream.applied("").len(), 2);
    assert_eq!(downstream.applied("a"), Vec::<u64>::new());

    let waiting = outbox.status(ids[0]).await.unwrap().unwrap();
    assert_eq!((waiting.status, waiting.attempts), (Status::Pending, 1));
    let held = outbox.status(ids[1]).await.unwrap().unwrap();
    assert_eq!((held.status, held.attempts), (Status::Pending, 0));
    assert_eq!(outbox.blocked_by(ids[1]).await.unwrap().unwrap().id, ids[0]);
}

/// SKIP LOCKED must not let a later message of a key overtake an earlier one that another
/// dispatcher's claim holds locked: the ordering rule reads the earlier row without locking,
/// so it sees it. Here the test holds that lock. (SQLite has no row locks; its single writer
/// runs one claim at a time.)
async fn an_earlier_message_locked_by_another_claim_still_holds_its_key_back<DB: Backend>(
    pool: Pool<DB>,
) where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
{
    if <DB as sqlx::Database>::NAME == "SQLite" {
        return;
    }
    let outbox = outbox(&pool).await;
    let messages = vec![
        ordered(Some("a"), 0),
        ordered(Some("a"), 1),
        ordered(Some("b"), 0),
    ];
    let ids = enqueue_all(&pool, &outbox, messages).await;
    let mut other_claim = pool.begin().await.unwrap();
    let lock = format!(
        "SELECT id FROM idempotency_outbox WHERE id = {} FOR UPDATE",
        ids[0].get()
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(lock))
        .execute(&mut *other_claim)
        .await
        .unwrap();

    let downstream = OrderedDownstream::default();
    let dispatcher = Dispatcher::new(outbox.clone(), downstream.clone());
    // a0 is skipped as locked; a1 waits behind it; b0 goes.
    assert_eq!(dispatcher.run_once().await.unwrap(), 1);
    assert_eq!(downstream.applied("b"), [0]);
    assert_eq!(downstream.applied("a"), Vec::<u64>::new());

    other_claim.rollback().await.unwrap();
    assert_eq!(dispatcher.run_once().await.unwrap(), 1);
    assert_eq!(dispatcher.run_once().await.unwrap(), 1);
    assert_eq!(downstream.applied("a"), [0, 1]);
}

/// Two transactions enqueuing for one key: the second waits for the first to end, so the
/// message committed first has the lower id and goes first.
async fn enqueues_of_one_ordering_key_commit_in_id_order<DB: Backend>(pool: Pool<DB>) {
    let outbox = outbox(&pool).await;
    let mut first = pool.begin().await.unwrap();
    let first_id = outbox
        .enqueue(&mut first, ordered(Some("a"), 0))
        .await
        .unwrap();

    let second = tokio::spawn({
        let (pool, outbox) = (pool.clone(), outbox.clone());
        async move {
            let mut tx = pool.begin().await.unwrap();
            let id = outbox
                .enqueue(&mut tx, ordered(Some("a"), 1))
                .await
                .unwrap();
            tx.commit().await.unwrap();
            id
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !second.is_finished(),
        "the second enqueue did not wait for the first"
    );
    first.commit().await.unwrap();
    let second_id = tokio::time::timeout(Duration::from_secs(10), second)
        .await
        .unwrap()
        .unwrap();
    assert!(first_id < second_id);
}

async fn an_ordering_key_must_be_1_to_255_characters<DB: Backend>(pool: Pool<DB>) {
    let outbox = outbox(&pool).await;
    let mut conn = pool.acquire().await.unwrap();
    for bad in [String::new(), "é".repeat(256)] {
        let message = ordered(None, 0).ordering_key(bad);
        assert!(matches!(
            outbox.enqueue(&mut conn, message).await,
            Err(outbox::Error::InvalidOrderingKey)
        ));
    }
    let longest = ordered(None, 1).ordering_key("é".repeat(255));
    let id = outbox.enqueue(&mut conn, longest).await.unwrap();
    let stored = outbox.status(id).await.unwrap().unwrap();
    assert_eq!(stored.ordering_key, Some("é".repeat(255)));
}

/// Every backend stores and indexes topics of up to 255 characters as given, and refuses
/// others before writing anything.
async fn a_topic_must_be_1_to_255_characters<DB: Backend>(pool: Pool<DB>) {
    let outbox = outbox(&pool).await;
    let mut conn = pool.acquire().await.unwrap();
    let message = |topic: String, name: &str| {
        Message::new(topic, DownstreamKey::new(name).unwrap(), "{}".as_bytes())
    };
    for (n, bad) in [String::new(), "é".repeat(256)].into_iter().enumerate() {
        assert!(matches!(
            outbox
                .enqueue(&mut conn, message(bad, &format!("bad-{n}")))
                .await,
            Err(outbox::Error::InvalidTopic)
        ));
    }
    let longest = message("é".repeat(255), "longest");
    let id = outbox.enqueue(&mut conn, longest).await.unwrap();
    let stored = outbox.status(id).await.unwrap().unwrap();
    assert_eq!(stored.topic, "é".repeat(255));
    for n in 0..2 {
        let key = DownstreamKey::new(format!("bad-{n}")).unwrap();
        assert!(outbox.status_by_key(&key).await.unwrap().is_none());
    }
}

/// End to end through a real broker: two dispatchers on PostgreSQL publish keyed messages to
/// RabbitMQ, each through a link of its own that keeps dropping every connection (publishes
/// lost, confirms lost, reconnects refused), and the consumer side finds each key's messages
/// in the queue in the order they were enqueued (a resend after a lost confirm is a duplicate
/// of a message already there, dropped by message id as the inbox does).
#[cfg(all(feature = "rabbitmq", feature = "postgres"))]
mod through_a_broker {
    use std::collections::{HashMap, HashSet};
    use std::net::SocketAddr;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use axum_idempotency::outbox::{
        Backoff, Dispatcher, Outbox, OutboxRecord, RabbitMqSender, SendOutcome, Sender, Status,
    };
    use lapin::options::BasicGetOptions;

    use crate::common::link::Plug;
    use crate::common::rabbitmq;

    /// The broker sender, a few milliseconds late at random, so the two dispatchers' sends
    /// interleave differently on every run.
    /// It counts the sends the faults spoiled.
    struct Jittered(RabbitMqSender, std::sync::Arc<AtomicUsize>);

    impl Sender for Jittered {
        async fn send(&self, message: &OutboxRecord) -> SendOutcome {
            tokio::time::sleep(Duration::from_millis(fastrand::u64(0..10))).await;
            let outcome = self.0.send(message).await;
            if !matches!(outcome, SendOutcome::Delivered { .. }) {
                self.1.fetch_add(1, Ordering::SeqCst);
            }
            outcome
        }
    }

    /// Drops every connection through `plug` every 100-300 ms, for 20-80 ms, until aborted;
    /// the first drop comes within 50 ms, so that a quick run still meets one.
    fn keep_dropping(plug: std::sync::Arc<Plug>) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut wait = fastrand::u64(10..50);
            loop {
                tokio::time::sleep(Duration::from_millis(wait)).await;
                wait = fastrand::u64(100..300);
                plug.unplug();
                tokio::time::sleep(Duration::from_millis(fastrand::u64(20..80))).await;
                plug.plug_in();
            }
        })
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn keyed_messages_reach_the_queue_in_enqueue_order_through_a_lossy_link() {
        let (pool, schema) = crate::databases::postgres().await;
        let outbox = Outbox::new(pool.clone());
        outbox.migrate().await.unwrap();
        let keys = ["order-1", "order-2", "order-3"];
        let per_key = 20;
        let mut messages = Vec::new();
        for seq in 0..per_key {
            for key in keys {
                messages.push(super::ordered(Some(key), seq));
            }
        }
        let ids = super::enqueue_all(&pool, &outbox, messages).await;

        let admin = rabbitmq::connect().await;
        let channel = admin.create_channel().await.unwrap();
        let exchange = crate::common::unique("outbox.order");
        let queue = crate::common::unique("outbox.order");
        let broker: SocketAddr = rabbitmq::ADDRESS.parse().unwrap();
        let mut plugs = Vec::new();
        let mut faults = Vec::new();
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let mut runs = Vec::new();
        let spoiled = std::sync::Arc::new(AtomicUsize::new(0));
        for n in 0..2 {
            let plug = std::sync::Arc::new(Plug::start(broker).await);
            let uri = format!("amqp://guest:guest@{}/%2f?heartbeat=5", plug.addr);
            let sender = RabbitMqSender::connect(&uri, exchange.as_str())
                .await
                .unwrap();
            if n == 0 {
                sender.declare().await.unwrap();
                rabbitmq::bind_queue(&channel, &queue, &exchange, "orders", false).await;
            }
            faults.push(keep_dropping(plug.clone()));
            plugs.push(plug);
            let mut stopped = stopped.clone();
            let dispatcher = Dispatcher::new(outbox.clone(), Jittered(sender, spoiled.clone()))
                .backoff(Backoff::exponential(
                    Duration::ZERO,
                    Duration::from_millis(20),
                ))
                .probe_backoff(Backoff::exponential(
                    Duration::from_millis(10),
                    Duration::from_millis(50),
                ))
                .send_timeout(Duration::from_secs(2))
                .max_attempts(1000)
                .batch_size(4)
                .poll_interval(Duration::from_millis(10));
            runs.push(tokio::spawn(dispatcher.run(async move {
                let _ = stopped.wait_for(|stop| *stop).await;
            })));
        }

        let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
        loop {
            let mut delivered = 0;
            for id in &ids {
                if outbox.status(*id).await.unwrap().unwrap().status == Status::Delivered {
                    delivered += 1;
                }
            }
            if delivered == ids.len() {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "only {delivered} of {} delivered",
                ids.len()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        stop.send(true).unwrap();
        for run in runs {
            tokio::time::timeout(Duration::from_secs(10), run)
                .await
                .expect("run() returns after shutdown")
                .unwrap();
        }
        for fault in faults {
            fault.abort();
        }

        // The consumer's side: every message in the queue, duplicates dropped by message id.
        let mut seen = HashSet::new();
        let mut order: HashMap<String, Vec<u64>> = HashMap::new();
        let mut copies = 0;
        while let Some(message) = channel
            .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            copies += 1;
            let id = message.properties.message_id().clone().unwrap().to_string();
            if !seen.insert(id) {
                continue;
            }
            let event: serde_json::Value = serde_json::from_slice(&message.data).unwrap();
            let key = event["key"].as_str().unwrap().to_owned();
            order
                .entry(key)
                .or_default()
                .push(event["seq"].as_u64().unwrap());
        }
        let in_order: Vec<u64> = (0..per_key as u64).collect();
        for key in keys {
            assert_eq!(
                order.get(key),
                Some(&in_order),
                "order of {key} ({copies} copies)"
            );
        }
        let spoiled = spoiled.load(Ordering::SeqCst);
        assert!(spoiled > 0, "the link dropped no send");

        rabbitmq::delete(&channel, [&queue], &exchange).await;
        crate::databases::drop_postgres(pool, schema).await;
    }
}

/// How soon a woken dispatcher must have sent: a few round trips, with room for a machine
/// shared with other builds, and far below the 30 s poll of the dispatchers below, which is
/// what a dispatcher nothing wakes would wait.
const WOKEN_WITHIN: Duration = Duration::from_secs(2);
const LONG_POLL: Duration = Duration::from_secs(30);

/// Runs a dispatcher with a 30 s poll until the returned sender is dropped or sent to; it has
/// made its first claim (which finds nothing) and sleeps once this returns.
async fn sleeping_dispatcher<DB: Backend>(
    dispatcher: Dispatcher<DB, Downstream>,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(dispatcher.poll_interval(LONG_POLL).run(async {
        let _ = stopped.await;
    }));
    tokio::time::sleep(Duration::from_millis(500)).await;
    (stop, run)
}

/// Waits until `downstream` was sent `sends` messages; panics after `within`.
async fn sent_within(downstream: &Downstream, sends: usize, within: Duration, what: &str) {
    let started = tokio::time::Instant::now();
    while downstream.sends().len() < sends {
        assert!(
            started.elapsed() < within,
            "{what}: not sent within {within:?} of the commit"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A handler that enqueues on the request's `Tx`, then answers `status`, after `linger` (the
/// transaction still open meanwhile).
async fn enqueue_in_handler<DB: Backend>(
    axum::extract::State((outbox, status, linger)): axum::extract::State<(
        Outbox<DB>,
        axum::http::StatusCode,
        Duration,
    )>,
    axum::extract::Path(id): axum::extract::Path<String>,
    mut tx: axum_idempotency::Tx<DB>,
) -> axum::http::StatusCode {
    outbox.enqueue(&mut tx, charge(&id, "12.50")).await.unwrap();
    tokio::time::sleep(linger).await;
    status
}

fn app<DB: Backend>(
    store: axum_idempotency::Store<DB>,
    outbox: &Outbox<DB>,
    status: axum::http::StatusCode,
    linger: Duration,
) -> axum::Router {
    axum::Router::new()
        .route(
            "/charges/{id}",
            axum::routing::post(enqueue_in_handler::<DB>),
        )
        // Without a key a request still gets a `Tx`, which the layer commits by the status.
        .route_layer(
            axum_idempotency::IdempotencyLayer::new(store)
                .allow_anonymous()
                .allow_missing_key(),
        )
        .with_state((outbox.clone(), status, linger))
}

async fn post(app: &axum::Router, id: &str, key: Option<&str>) -> axum::http::StatusCode {
    use tower::ServiceExt;
    let mut request = axum::http::Request::post(format!("/charges/{id}"));
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    let request = request.body(axum::body::Body::empty()).unwrap();
    app.clone().oneshot(request).await.unwrap().status()
}

/// A handler enqueues on its `Tx` and nothing else: the layer's commit wakes the dispatcher,
/// asleep for 30 s, and the message goes out at once, keyed request or not. The handler
/// lingers before answering, its transaction open: a dispatcher woken at the enqueue rather
/// than at the commit would find nothing and sleep through the message.
async fn a_request_that_enqueued_wakes_the_dispatchers_when_the_layer_commits<DB: Backend>(
    pool: Pool<DB>,
) {
    let store = axum_idempotency::Store::new(pool.clone());
    store.migrate().await.unwrap();
    let outbox = outbox(&pool).await;
    let downstream = Downstream::default();
    let (stop, run) = sleeping_dispatcher(dispatcher(&outbox, &downstream)).await;
    let app = app(
        store,
        &outbox,
        axum::http::StatusCode::ACCEPTED,
        Duration::from_millis(300),
    );

    let keyed = post(&app, "keyed", Some("6d1c8a52-3f0e-4b7a-9c2d-5e8f1a4b7c90")).await;
    assert_eq!(keyed, axum::http::StatusCode::ACCEPTED);
    sent_within(&downstream, 1, WOKEN_WITHIN, "keyed request").await;
    assert_eq!(downstream.sends()[0].0, key("keyed").to_string());

    let unkeyed = post(&app, "unkeyed", None).await;
    assert_eq!(unkeyed, axum::http::StatusCode::ACCEPTED);
    sent_within(&downstream, 2, WOKEN_WITHIN, "request without a key").await;
    assert_eq!(downstream.sends()[1].0, key("unkeyed").to_string());

    stop.send(()).unwrap();
    run.await.unwrap();
}

/// A message a request commits is handed to a dispatcher of the request's process, leased to
/// it by the insert: another process's dispatcher polling every few milliseconds never gets
/// it, where a claim after a wake would lose a good share of them to that poll. Requests that
/// roll back first give back the room they took at the dispatcher (it has room for one).
async fn a_commit_hands_its_messages_to_a_dispatcher_of_its_own_process<DB: Backend>(
    pool: Pool<DB>,
) {
    let store = axum_idempotency::Store::new(pool.clone());
    store.migrate().await.unwrap();
    let outbox = outbox(&pool).await;
    let (here, elsewhere) = (Downstream::default(), Downstream::default());
    let (stop, run) = sleeping_dispatcher(dispatcher(&outbox, &here).batch_size(1)).await;
    let (stop_elsewhere, stopped_elsewhere) = tokio::sync::oneshot::channel::<()>();
    let polling = dispatcher(&Outbox::new(pool.clone()), &elsewhere)
        .poll_interval(Duration::from_millis(5))
        .run(async {
            let _ = stopped_elsewhere.await;
        });
    let run_elsewhere = tokio::spawn(polling);

    let failing = app(
        store.clone(),
        &outbox,
        axum::http::StatusCode::INTERNAL_SERVER_ERROR,
        Duration::ZERO,
    );
    for n in 0..10 {
        let status = post(&failing, &format!("rolled-back-{n}"), None).await;
        assert_eq!(status, axum::http::StatusCode::INTERNAL_SERVER_ERROR);
    }
    let accepting = app(
        store,
        &outbox,
        axum::http::StatusCode::ACCEPTED,
        Duration::ZERO,
    );
    let requests = 20;
    for n in 0..requests {
        let status = post(&accepting, &format!("handed-{n}"), None).await;
        assert_eq!(status, axum::http::StatusCode::ACCEPTED);
        let started = tokio::time::Instant::now();
        while here.sends().len() + elsewhere.sends().len() <= n {
            assert!(started.elapsed() < WOKEN_WITHIN, "handed-{n} not sent");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    assert_eq!(
        elsewhere.sends(),
        [],
        "another process's dispatcher sent messages committed here"
    );
    let sent: Vec<_> = here.sends().into_iter().map(|(key, _)| key).collect();
    let expected: Vec<_> = (0..requests)
        .map(|n| key(&format!("handed-{n}")).to_string())
        .collect();
    assert_eq!(sent, expected);
    stop.send(()).unwrap();
    run.await.unwrap();
    stop_elsewhere.send(()).unwrap();
    run_elsewhere.await.unwrap();
}

/// Enqueues `message` in a job under `Engine::run` with the idempotency key `key`, on the
/// job's `Tx`, whose commit the engine makes.
async fn enqueue_in_job<DB: Backend>(
    store: axum_idempotency::Store<DB>,
    outbox: &Outbox<DB>,
    key: &str,
    message: Message,
) {
    let engine = axum_idempotency::Engine::new(store);
    let scope =
        axum_idempotency::Scope::new("nightly", "POST", "/jobs/charge", key.parse().unwrap());
    let outbox = outbox.clone();
    let ran = engine
        .run(
            &scope,
            axum_idempotency::Fingerprint::from([7; 32]),
            move |mut tx: axum_idempotency::Tx<DB>| {
                let (outbox, message) = (outbox.clone(), message.clone());
                async move {
                    outbox.enqueue(&mut tx, message).await.unwrap();
                    axum::http::StatusCode::CREATED
                }
            },
        )
        .await
        .unwrap();
    assert_eq!(ran.response.status(), axum::http::StatusCode::CREATED);
}

/// The dispatcher a commit handed its message to dies mid-send: the row was written leased to
/// it, its attempt begun, so no one sends it while the lease holds, and the next holder looks
/// it up before any resend, as after a claimed message's crash.
async fn a_handed_message_whose_dispatcher_died_is_looked_up_once_its_lease_runs_out<
    DB: Backend,
>(
    pool: Pool<DB>,
) {
    let store = axum_idempotency::Store::new(pool.clone());
    store.migrate().await.unwrap();
    let outbox = outbox(&pool).await;
    let stuck = Downstream::default();
    stuck.0.hang.store(true, Ordering::SeqCst);
    let lease = Duration::from_millis(1200);
    let crashing = dispatcher(&outbox, &stuck)
        .poll_interval(LONG_POLL)
        .lease(lease)
        .run(std::future::pending());
    let task = tokio::spawn(crashing);
    // Its first claim found nothing: it sleeps, and only a hand-over gets it to send.
    tokio::time::sleep(Duration::from_millis(300)).await;

    enqueue_in_job(
        store,
        &outbox,
        "2a0e7c52-8f1d-4d55-a8b3-0c7f6a2b9e41",
        charge("h", "4.00"),
    )
    .await;
    stuck.0.entered.notified().await;
    task.abort();
    let _ = task.await;
    assert_eq!(stuck.sends().len(), 1);
    // Another process's outbox: the one that took the hand-over is gone.
    looked_up_once_the_lease_runs_out(&outbox, &Outbox::new(pool.clone()), "h", lease).await;
}

/// A request's commit hands its message to a dispatcher that stopped while the request ran
/// (a rolling restart): the row was written leased to that dispatcher, so without being given
/// back it would wait out the lease, here a minute, before another dispatcher may send it. It
/// is sent at once, and as first sent: the attempt its hand-over began is not counted.
async fn a_commit_handed_to_a_dispatcher_that_stopped_meanwhile_is_sent_at_once_by_another<
    DB: Backend,
>(
    pool: Pool<DB>,
) {
    let store = axum_idempotency::Store::new(pool.clone());
    store.migrate().await.unwrap();
    let outbox = outbox(&pool).await;
    let (stopping, successor) = (Downstream::default(), Downstream::default());
    let (stop, run) =
        sleeping_dispatcher(dispatcher(&outbox, &stopping).lease(Duration::from_secs(60))).await;
    let app = app(
        store,
        &outbox,
        axum::http::StatusCode::ACCEPTED,
        Duration::from_millis(1500),
    );
    let request = tokio::spawn(async move { post(&app, "restarted", None).await });
    // The handler has enqueued, its message reserved at the dispatcher, and lingers.
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.send(()).unwrap();
    run.await.unwrap();
    let (stop_successor, stopped) = tokio::sync::oneshot::channel::<()>();
    let polling = dispatcher(&Outbox::new(pool.clone()), &successor)
        .poll_interval(Duration::from_millis(20))
        .run(async {
            let _ = stopped.await;
        });
    let run_successor = tokio::spawn(polling);

    assert_eq!(request.await.unwrap(), axum::http::StatusCode::ACCEPTED);
    sent_within(
        &successor,
        1,
        Duration::from_secs(5),
        "a message whose dispatcher stopped",
    )
    .await;
    assert_eq!(stopping.sends(), [], "the stopped dispatcher sent it");
    assert_eq!(successor.sends()[0].0, key("restarted").to_string());
    let delivered = record(&outbox, "restarted").await;
    assert_eq!(delivered.status, Status::Delivered);
    assert_eq!(delivered.attempts, 1, "the hand-over's attempt was counted");
    stop_successor.send(()).unwrap();
    run_successor.await.unwrap();
}

/// A request that rolls back leaves no message and wakes nobody into sending anything; a job
/// that enqueues on a transaction of its own wakes the dispatchers with `Outbox::wake` after
/// its commit; a job under `Engine::run` needs nothing, like a request.
async fn a_rolled_back_request_sends_nothing_and_a_job_of_its_own_wakes_with_outbox_wake<
    DB: Backend,
>(
    pool: Pool<DB>,
) {
    let store = axum_idempotency::Store::new(pool.clone());
    store.migrate().await.unwrap();
    let outbox = outbox(&pool).await;
    let downstream = Downstream::default();
    let (stop, run) = sleeping_dispatcher(dispatcher(&outbox, &downstream)).await;

    let failing = app(
        store.clone(),
        &outbox,
        axum::http::StatusCode::INTERNAL_SERVER_ERROR,
        Duration::ZERO,
    );
    let keyed = post(
        &failing,
        "rolled-back",
        Some("0f2c7a1e-5b3d-4e8f-9a6c-1d2e3f4a5b6c"),
    )
    .await;
    assert_eq!(keyed, axum::http::StatusCode::INTERNAL_SERVER_ERROR);
    let unkeyed = post(&failing, "rolled-back-too", None).await;
    assert_eq!(unkeyed, axum::http::StatusCode::INTERNAL_SERVER_ERROR);
    for rolled_back in ["rolled-back", "rolled-back-too"] {
        let found = outbox.status_by_key(&key(rolled_back)).await.unwrap();
        assert!(found.is_none(), "{rolled_back} left a message");
    }

    // Woken before its commit, the dispatcher would find nothing and sleep 30 s.
    let mut tx = pool.begin().await.unwrap();
    outbox
        .enqueue(&mut tx, charge("job", "1.00"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    outbox.wake();
    sent_within(&downstream, 1, WOKEN_WITHIN, "a job's own transaction").await;

    let job = charge("engine-job", "2.00");
    enqueue_in_job(store, &outbox, "1f0e7c52-8f1d-4d55-a8b3-0c7f6a2b9e41", job).await;
    sent_within(&downstream, 2, WOKEN_WITHIN, "a job under Engine::run").await;

    let sent: Vec<_> = downstream.sends().into_iter().map(|(key, _)| key).collect();
    assert_eq!(
        sent,
        [key("job").to_string(), key("engine-job").to_string()]
    );
    stop.send(()).unwrap();
    run.await.unwrap();
}

/// On PostgreSQL another process hears the commit: a dispatcher on an outbox of its own, on a
/// pool of its own, asleep for 30 s, listens; a commit through another pool's outbox that
/// notifies wakes it, with no wake in this process.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_in_another_process_wakes_a_listening_dispatcher_on_postgres() {
    let (pool, schema) = databases::postgres().await;
    let producing = outbox(&pool).await.notify_on_commit();
    // What another process would have: its own pool and its own outbox on the same tables.
    let elsewhere = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect_with((*pool.connect_options()).clone())
        .await
        .unwrap();
    let consuming = Outbox::new(elsewhere.clone());
    let downstream = Downstream::default();
    let (stop, run) = sleeping_dispatcher(dispatcher(&consuming, &downstream).listen()).await;

    let mut tx = pool.begin().await.unwrap();
    producing
        .enqueue(&mut tx, charge("elsewhere", "3.00"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    sent_within(&downstream, 1, WOKEN_WITHIN, "a commit of another process").await;

    // A transaction that rolls back notifies nobody, and leaves nothing to send.
    let mut tx = pool.begin().await.unwrap();
    producing
        .enqueue(&mut tx, charge("rolled-back", "4.00"))
        .await
        .unwrap();
    tx.rollback().await.unwrap();

    stop.send(()).unwrap();
    run.await.unwrap();
    assert_eq!(downstream.sends().len(), 1);
    elsewhere.close().await;
    databases::drop_postgres(pool, schema).await;
}

/// MySQL and MariaDB serialise outbox migrations with a named session lock, one per database.
#[cfg(feature = "mysql")]
mod mysql_migration_lock {
    use std::time::Duration;

    use axum_idempotency::outbox::{Error, Outbox};
    use sqlx::MySqlPool;
    use sqlx::pool::PoolConnection;

    /// The lock an outbox migration on the connection's database takes.
    const LOCK_NAME: &str = "CONCAT('axum_idempotency.outbox:', MD5(DATABASE()))";

    /// A session on `pool`'s database holding that database's outbox migration lock.
    async fn hold_lock(pool: &MySqlPool) -> PoolConnection<sqlx::MySql> {
        let mut holder = pool.acquire().await.unwrap();
        let taken: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT GET_LOCK({LOCK_NAME}, 0)"
        )))
        .fetch_one(&mut *holder)
        .await
        .unwrap();
        assert_eq!(taken, Some(1));
        holder
    }

    /// The connection id of the session waiting for a named lock on `database`, once there is
    /// one.
    async fn waiting_for_the_lock(admin: &MySqlPool, database: &str) -> i64 {
        for _ in 0..3000 {
            let waiting: Option<i64> = sqlx::query_scalar(
                "SELECT CAST(id AS SIGNED) FROM information_schema.processlist \
                 WHERE db = ? AND state LIKE '%user lock%'",
            )
            .bind(database)
            .fetch_optional(admin)
            .await
            .unwrap();
            if let Some(id) = waiting {
                return id;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("no migrator waited for the outbox migration lock of {database}");
    }

    async fn outbox_tables(pool: &MySqlPool) -> i64 {
        sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.tables \
             WHERE table_schema = DATABASE() AND table_name LIKE 'idempotency_outbox%'",
        )
        .fetch_one(pool)
        .await
        .unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn migrate_waits_for_an_instance_migrating_the_same_database_not_another() {
        let (pool, database) = crate::databases::mysql().await;
        let (other, other_database) = crate::databases::mysql().await;
        let mut holder = hold_lock(&pool).await;

        Outbox::new(other.clone()).migrate().await.unwrap();
        assert_eq!(outbox_tables(&other).await, 3);

        let migrating = tokio::spawn({
            let pool = pool.clone();
            async move { Outbox::new(pool).migrate().await }
        });
        waiting_for_the_lock(&other, &database).await;
        assert_eq!(outbox_tables(&pool).await, 0);
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DO RELEASE_LOCK({LOCK_NAME})")))
            .execute(&mut *holder)
            .await
            .unwrap();
        migrating.await.unwrap().unwrap();
        assert_eq!(outbox_tables(&pool).await, 3);

        drop(holder);
        crate::databases::drop_mysql(other, other_database).await;
        crate::databases::drop_mysql(pool, database).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lock_wait_cut_short_fails_migrate_with_a_migration_error() {
        let (pool, database) = crate::databases::mysql().await;
        let holder = hold_lock(&pool).await;
        let migrating = tokio::spawn({
            let pool = pool.clone();
            async move { Outbox::new(pool).migrate().await }
        });
        // Killed, the wait's GET_LOCK returns NULL rather than an error.
        let waiter = waiting_for_the_lock(&pool, &database).await;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("KILL QUERY {waiter}")))
            .execute(&pool)
            .await
            .unwrap();
        match migrating.await.unwrap() {
            Err(error @ Error::Migration(_)) => assert!(
                error.to_string().contains("lock") && error.to_string().contains("not granted"),
                "{error}"
            ),
            other => panic!("expected a migration error, got {other:?}"),
        }
        assert_eq!(outbox_tables(&pool).await, 0);

        drop(holder);
        crate::databases::drop_mysql(pool, database).await;
    }
}

/// Apart from `conformance!`'s list: the test needs the `test-util` feature's clock.
#[cfg(feature = "test-util")]
mod timed {
    use super::*;
    use axum_idempotency::{Engine, Fingerprint, Lookup, ManualClock, Outcome, Store, Tx};

    conformance!(one_manual_clock_ages_records_and_messages_together);

    /// A record and the message its job enqueued are aged by one `ManualClock`: moving it makes
    /// the message's retry due and then spends its time budget, and expires the record, with
    /// no waiting and no record or message timed by the wall clock.
    async fn one_manual_clock_ages_records_and_messages_together<DB: Backend>(pool: Pool<DB>) {
        let clock = ManualClock::new(SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000_000));
        let start = clock.now();
        let store = Store::new(pool.clone());
        store.migrate().await.unwrap();
        let engine = Engine::new(store)
            .retention(Duration::from_secs(3600))
            .timed_by(clock.clone());
        let outbox = outbox(&pool).await.timed_by(clock.clone());
        let busy = || SendOutcome::Retry {
            after: Some(Duration::from_secs(600)),
            reason: "busy".into(),
        };
        let downstream = Downstream::answering([busy(), busy()]);
        let dispatcher =
            dispatcher(&outbox, &downstream).give_up_after(Duration::from_secs(2 * 3600));

        let scope = Scope::new(
            "nightly",
            "POST",
            "/jobs/charge",
            "6b1d2f9e-3c4a-4e5b-8f7a-9d0c1b2a3e4f".parse().unwrap(),
        );
        let fingerprint = Fingerprint::from([3; 32]);
        let job_outbox = outbox.clone();
        let ran = engine
            .run(&scope, fingerprint, move |mut tx: Tx<DB>| {
                let outbox = job_outbox.clone();
                async move {
                    outbox
                        .enqueue(&mut tx, charge("timed", "3.00"))
                        .await
                        .unwrap();
                    axum::http::StatusCode::CREATED
                }
            })
            .await
            .unwrap();
        assert_eq!(ran.outcome, Outcome::Executed);

        // The first send is answered "busy, in ten minutes": due then by the clock.
        assert_eq!(dispatcher.run_once().await.unwrap(), 1);
        let message = outbox.status_by_key(&key("timed")).await.unwrap().unwrap();
        assert_eq!(message.created_at, start);
        assert_eq!(message.last_attempt_at, Some(start));
        assert_eq!(
            message.next_attempt_at,
            start + Duration::from_secs(600),
            "the retry is timed by the outbox's clock"
        );
        assert_eq!(dispatcher.run_once().await.unwrap(), 0, "not due yet");

        // Ten minutes later by the clock, and no later by the wall: the retry goes.
        clock.advance(Duration::from_secs(601));
        assert_eq!(dispatcher.run_once().await.unwrap(), 1);
        assert_eq!(downstream.sends().len(), 2);
        let again = engine
            .run(&scope, fingerprint, |_tx: Tx<DB>| async { "never runs" })
            .await
            .unwrap();
        assert_eq!(again.outcome, Outcome::Replayed, "the record still counts");

        // Past the record's retention (an hour) and the message's time budget (two hours).
        clock.advance(Duration::from_secs(2 * 3600));
        assert!(matches!(
            engine.lookup(&scope).await.unwrap(),
            Lookup::Absent
        ));
        assert_eq!(dispatcher.run_once().await.unwrap(), 1);
        let failed = outbox.status_by_key(&key("timed")).await.unwrap().unwrap();
        assert_eq!(failed.status, Status::Failed);
        assert!(
            failed
                .last_error
                .as_deref()
                .is_some_and(|error| error.contains("time budget")),
            "{:?}",
            failed.last_error
        );
        assert_eq!(failed.finished_at, Some(clock.now()));
        assert_eq!(
            downstream.sends().len(),
            2,
            "nothing is sent past the budget"
        );
        assert_eq!(engine.store().purge_expired().await.unwrap(), 1);
    }
}

/// A provider that announces each charge it takes with an event, keyed by the charge's key,
/// carrying the provider's receipt.
#[derive(Clone, Default)]
struct Announcing {
    downstream: Downstream,
    /// How many of the next follow-up requests fail.
    failing: Arc<AtomicU64>,
}

impl Sender for Announcing {
    async fn send(&self, message: &OutboxRecord) -> SendOutcome {
        self.downstream.send(message).await
    }

    async fn lookup(&self, message: &OutboxRecord) -> LookupOutcome {
        self.downstream.lookup(message).await
    }

    fn follow_ups(
        &self,
        message: &OutboxRecord,
        receipt: &str,
    ) -> Result<Vec<Message>, Box<dyn std::error::Error + Send + Sync>> {
        if message.topic != "charges" {
            return Ok(Vec::new());
        }
        let failing = self
            .failing
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if failing.is_ok() {
            return Err("event store full".into());
        }
        let event = serde_json::json!({ "charge": receipt });
        Ok(vec![Message::json(
            "events",
            event_key(&message.downstream_key),
            &event,
        )?])
    }
}

fn event_key(charge: &DownstreamKey) -> DownstreamKey {
    DownstreamKey::new(format!("event-{}", &charge.as_str()[..40])).unwrap()
}

/// Waits until the message with `key` is delivered; panics after `within`.
async fn delivered_within<DB: Backend>(
    outbox: &Outbox<DB>,
    key: &DownstreamKey,
    within: Duration,
) -> OutboxRecord {
    let started = tokio::time::Instant::now();
    loop {
        if let Some(record) = outbox.status_by_key(key).await.unwrap()
            && record.status == Status::Delivered
        {
            return record;
        }
        assert!(started.elapsed() < within, "{key} not delivered in time");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Each delivered charge enqueues its event in the transaction that records the charge
/// delivered, and that commit hands the event to the dispatcher: the dispatcher polls every
/// 30 s, so only the hand-over sends the events in time. An event already enqueued under its
/// key (with another payload) is not enqueued a second time.
async fn a_delivery_enqueues_its_follow_ups_with_its_outcome_and_hands_them_over<DB: Backend>(
    pool: Pool<DB>,
) {
    let outbox = outbox(&pool).await;
    let announcing = Announcing::default();
    let stale = Message::new("events", event_key(&key("charge-0")), "stale");
    enqueue_committed(&pool, &outbox, stale).await;
    for n in 0..5 {
        enqueue_committed(&pool, &outbox, charge(&format!("charge-{n}"), "1.00")).await;
    }
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let dispatcher = Dispatcher::new(outbox.clone(), announcing.clone()).poll_interval(LONG_POLL);
    let run = tokio::spawn(dispatcher.run(async {
        let _ = stopped.await;
    }));
    for n in 0..5 {
        let charge = delivered_within(&outbox, &key(&format!("charge-{n}")), WOKEN_WITHIN).await;
        let receipt = charge.receipt.clone().unwrap();
        let event = delivered_within(
            &outbox,
            &event_key(&key(&format!("charge-{n}"))),
            WOKEN_WITHIN,
        )
        .await;
        assert_eq!(event.attempts, 1);
        if n == 0 {
            assert_eq!(event.payload, b"stale", "the event enqueued first stands");
        } else {
            let payload: serde_json::Value = event.payload_json().unwrap();
            assert_eq!(payload, serde_json::json!({ "charge": receipt }));
        }
    }
    let mut sent: Vec<_> = announcing
        .downstream
        .sends()
        .into_iter()
        .map(|(key, _)| key)
        .collect();
    sent.sort();
    let mut expected: Vec<_> = (0..5)
        .flat_map(|n| {
            let charge = key(&format!("charge-{n}"));
            [charge.to_string(), event_key(&charge).to_string()]
        })
        .collect();
    expected.sort();
    assert_eq!(sent, expected, "each charge and each event sent once");
    stop.send(()).unwrap();
    run.await.unwrap();
}

/// The sender cannot make a delivered charge's follow-ups: the charge is not recorded
/// delivered without them, but as an unknown outcome, its attempt counted; the lookup that
/// finds it charged makes them, and the charge is never sent again.
async fn a_follow_up_that_cannot_be_made_leaves_the_delivery_unknown_until_a_lookup_makes_it<
    DB: Backend,
>(
    pool: Pool<DB>,
) {
    let outbox = outbox(&pool).await;
    let announcing = Announcing::default();
    announcing.failing.store(1, Ordering::SeqCst);
    let found = LookupOutcome::Found {
        receipt: "ch_found".into(),
    };
    let announcing = Announcing {
        downstream: announcing.downstream.always_looking_up(found),
        failing: announcing.failing,
    };
    enqueue_committed(&pool, &outbox, charge("charge", "1.00")).await;
    let dispatcher = Dispatcher::new(outbox.clone(), announcing.clone())
        .backoff(Backoff::exponential(Duration::ZERO, Duration::ZERO))
        .lookup_grace(Duration::ZERO);

    dispatcher.run_once().await.unwrap();
    let unknown = record(&outbox, "charge").await;
    assert_eq!(unknown.status, Status::Pending);
    assert!(unknown.outcome_unknown);
    assert_eq!(unknown.attempts, 1);
    let error = unknown.last_error.unwrap_or_default();
    assert!(
        error.contains("follow-ups not made: event store full"),
        "{error}"
    );
    let event_key = event_key(&key("charge"));
    assert!(outbox.status_by_key(&event_key).await.unwrap().is_none());

    dispatcher.run_once().await.unwrap();
    let charge = record(&outbox, "charge").await;
    assert_eq!(charge.status, Status::Delivered);
    assert_eq!(charge.receipt.as_deref(), Some("ch_found"));
    let event = outbox.status_by_key(&event_key).await.unwrap().unwrap();
    let payload: serde_json::Value = event.payload_json().unwrap();
    assert_eq!(payload, serde_json::json!({ "charge": "ch_found" }));
    assert_eq!(
        announcing.downstream.sends().len(),
        1,
        "the charge was sent once"
    );
    assert_eq!(announcing.downstream.lookups(), [key("charge").to_string()]);
}
