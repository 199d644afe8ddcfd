//! `MySqlStore` against the real MariaDB server: migrations, and how a claim takes, replaces,
//! waits for and purges records.

use std::time::Duration;

use sqlx::Connection;
use sqlx::mysql::MySqlPool;

use super::{
    BeganClaim, MySqlDatabase as TestDb, Steps, completed, finished, now_ms, protocol_of, record,
    scope,
};
use crate::clock::Millis;
use crate::error::Error;
use crate::key::IdempotencyKey;
use crate::record::RecordState;
use crate::scope::Scope;
use crate::store::MySqlStore;

/// A store on `db`, migrated, over a pool of eight, driven as the engine drives it.
async fn migrated(db: &TestDb) -> Steps<sqlx::MySql> {
    let store = MySqlStore::new(db.pool(8).await);
    store.migrate().await.unwrap();
    protocol_of(&store)
}

async fn count(pool: &MySqlPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

// ---------------------------------------------------------------- migrations

#[tokio::test]
async fn migrate_twice_is_a_no_op() {
    let db = TestDb::create().await;
    let store = MySqlStore::new(db.pool(2).await);
    store.migrate().await.unwrap();
    store.migrate().await.unwrap();
    let pool = store.pool();
    assert_eq!(
        count(pool, "SELECT COUNT(*) FROM idempotency_schema_versions").await,
        1
    );
    assert_eq!(
        count(pool, "SELECT MAX(version) FROM idempotency_schema_versions").await,
        1
    );
    assert_eq!(
        count(
            pool,
            "SELECT COUNT(*) FROM information_schema.routines \
             WHERE routine_schema = DATABASE() AND routine_name = 'axum_idempotency_claim_v1'"
        )
        .await,
        1
    );
    let engine: String = sqlx::query_scalar(
        "SELECT engine FROM information_schema.tables \
         WHERE table_schema = DATABASE() AND table_name = 'idempotency_records'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(engine, "InnoDB");
    db.drop().await;
}

#[tokio::test]
async fn concurrent_migrations_from_separate_instances_all_succeed_once() {
    let db = TestDb::create().await;
    let mut stores = Vec::new();
    for _ in 0..4 {
        stores.push(MySqlStore::new(db.pool(2).await));
    }
    let results = futures_util::future::join_all(stores.iter().map(MySqlStore::migrate)).await;
    for result in results {
        result.unwrap();
    }
    let pool = stores[0].pool();
    assert_eq!(
        count(pool, "SELECT COUNT(*) FROM idempotency_schema_versions").await,
        1
    );
    // The session lock is released, not left on a pooled connection: another session takes it.
    let taken: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT GET_LOCK({LOCK_NAME}, 0)"
    )))
    .fetch_one(&db.pool(1).await)
    .await
    .unwrap();
    assert_eq!(taken, Some(1));
    db.drop().await;
}

const LOCK_NAME: &str = "CONCAT('axum_idempotency.migrate:', MD5(DATABASE()))";

#[tokio::test]
async fn migrate_waits_for_the_instance_holding_the_migration_lock() {
    let db = TestDb::create().await;
    let mut holder = db.connect().await;
    let taken: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT GET_LOCK({LOCK_NAME}, 0)"
    )))
    .fetch_one(&mut holder)
    .await
    .unwrap();
    assert_eq!(taken, Some(1));

    let store = MySqlStore::new(db.pool(1).await);
    let migrating = tokio::spawn({
        let store = store.clone();
        async move { store.migrate().await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !migrating.is_finished(),
        "migrate went ahead without the lock"
    );
    let tables: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE()",
    )
    .fetch_one(&mut holder)
    .await
    .unwrap();
    assert_eq!(tables, 0);

    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DO RELEASE_LOCK({LOCK_NAME})")))
        .execute(&mut holder)
        .await
        .unwrap();
    migrating.await.unwrap().unwrap();
    assert_eq!(
        count(
            store.pool(),
            "SELECT COUNT(*) FROM idempotency_schema_versions"
        )
        .await,
        1
    );
    holder.close().await.unwrap();
    db.drop().await;
}

// ---------------------------------------------------------------- the store itself

#[tokio::test]
async fn claim_takes_a_fresh_key_and_not_a_live_one() {
    let db = TestDb::create().await;
    // One connection, so every claim below reuses the session the previous claim ran on.
    let store = protocol_of(&MySqlStore::new(db.pool(1).await));
    store.migrate().await.unwrap();
    let first = scope("k-live");
    let now = now_ms();

    let mut tx = store.begin(Duration::from_secs(1)).await.unwrap();
    let claim = record(&first, "a", RecordState::Processing, None, now, 60_000);
    assert!(
        store
            .claim(&mut tx, &claim, Duration::from_secs(1))
            .await
            .unwrap()
    );
    store
        .commit_record(tx, &finished(&claim, &completed("one")))
        .await
        .unwrap();

    let mut tx = store.begin(Duration::from_secs(1)).await.unwrap();
    let duplicate = record(&first, "b", RecordState::Processing, None, now + 1, 60_000);
    assert!(
        !store
            .claim(&mut tx, &duplicate, Duration::from_secs(1))
            .await
            .unwrap()
    );
    let found = store
        .find(&mut tx, &first.scoped_key())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(found.state, RecordState::Completed);
    assert_eq!(found.fingerprint, claim.fingerprint);
    assert_eq!(found.response.unwrap().body.as_ref(), b"one");
    drop(tx);

    // A fresh key on the session where the last claim found a live record is still claimed.
    let second = scope("k-fresh");
    let mut tx = store.begin(Duration::from_secs(1)).await.unwrap();
    let claim = record(&second, "c", RecordState::Processing, None, now, 60_000);
    assert!(
        store
            .claim(&mut tx, &claim, Duration::from_secs(1))
            .await
            .unwrap()
    );
    tx.commit().await.unwrap();
    assert_eq!(
        count(store.pool(), "SELECT COUNT(*) FROM idempotency_records").await,
        2
    );
    db.drop().await;
}

#[tokio::test]
async fn claim_replaces_an_expired_record_in_place() {
    let db = TestDb::create().await;
    let store = migrated(&db).await;
    let scope = scope("k-expired");
    let old = completed("old");
    let past = now_ms() - 10_000;

    let mut tx = store.begin(Duration::from_secs(1)).await.unwrap();
    let expired = record(
        &scope,
        "old",
        RecordState::Completed,
        Some(&old),
        past,
        1_000,
    );
    assert!(
        store
            .claim(&mut tx, &expired, Duration::from_secs(1))
            .await
            .unwrap()
    );
    tx.commit().await.unwrap();

    let now = now_ms();
    let mut tx = store.begin(Duration::from_secs(1)).await.unwrap();
    let fresh = record(&scope, "new", RecordState::Processing, None, now, 60_000);
    assert!(
        store
            .claim(&mut tx, &fresh, Duration::from_secs(1))
            .await
            .unwrap()
    );
    let found = store
        .find(&mut tx, &scope.scoped_key())
        .await
        .unwrap()
        .unwrap();
    tx.commit().await.unwrap();

    assert_eq!(found.state, RecordState::Processing);
    assert_eq!(found.fingerprint, fresh.fingerprint);
    assert!(found.response.is_none());
    // A record read back carries no creation time; the row does.
    let created_at_ms: i64 =
        sqlx::query_scalar("SELECT created_at FROM idempotency_records WHERE key_digest = ?")
            .bind(scope.scoped_key().digest().to_vec())
            .fetch_one(store.pool())
            .await
            .unwrap();
    assert_eq!(created_at_ms, now);
    assert_eq!(found.expires_at.column(), now + 60_000);
    assert_eq!(
        count(store.pool(), "SELECT COUNT(*) FROM idempotency_records").await,
        1
    );
    db.drop().await;
}

#[test]
fn lock_wait_is_rounded_up_to_whole_seconds() {
    for (wait, secs) in [(0, 1), (10, 1), (1000, 1), (1001, 2), (1500, 2), (5000, 5)] {
        assert_eq!(
            crate::backend::mysql::lock_wait_secs(Duration::from_millis(wait)),
            secs,
            "a wait of {wait} ms"
        );
    }
    assert_eq!(
        crate::backend::mysql::lock_wait_secs(Duration::MAX),
        1_073_741_824,
        "the server's largest"
    );
}

#[tokio::test]
async fn a_claim_leaves_the_sessions_own_lock_wait_to_the_handler() {
    let db = TestDb::create().await;
    let store = protocol_of(&MySqlStore::new(db.pool(1).await));
    store.migrate().await.unwrap();
    let setting = "SELECT @@SESSION.innodb_lock_wait_timeout";
    let mut conn = store.pool().acquire().await.unwrap();
    sqlx::raw_sql("SET SESSION innodb_lock_wait_timeout = 37")
        .execute(&mut *conn)
        .await
        .unwrap();
    drop(conn);

    for wait in [10, 1500, 5000] {
        let wait = Duration::from_millis(wait);
        let mut tx = store.begin(wait).await.unwrap();
        let key = scope(&format!("k-wait-{wait:?}"));
        let claim = record(&key, "a", RecordState::Processing, None, now_ms(), 60_000);
        assert!(store.claim(&mut tx, &claim, wait).await.unwrap());
        let (open, bound): (u64, u64) =
            sqlx::query_as("SELECT @@in_transaction, @@SESSION.innodb_lock_wait_timeout")
                .fetch_one(&mut *tx)
                .await
                .unwrap();
        assert_eq!(
            (open, bound),
            (1, 37),
            "the handler's statements run in the claim's transaction with the session's bound"
        );
        tx.commit().await.unwrap();
    }
    let pooled: u64 = sqlx::query_scalar(setting)
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(pooled, 37);
    assert_eq!(
        count(store.pool(), "SELECT COUNT(*) FROM idempotency_records").await,
        3
    );
    db.drop().await;
}

#[tokio::test]
async fn duplicate_of_an_in_flight_claim_is_busy_after_the_wait_and_the_bound_is_restored() {
    let db = TestDb::create().await;
    let store = migrated(&db).await;
    let scope = scope("k-in-flight");

    let mut holder = store.begin(Duration::from_secs(1)).await.unwrap();
    let claim = record(&scope, "a", RecordState::Processing, None, now_ms(), 60_000);
    assert!(
        store
            .claim(&mut holder, &claim, Duration::from_secs(1))
            .await
            .unwrap()
    );

    let mut waiter = store.begin(Duration::from_secs(1)).await.unwrap();
    let duplicate = record(&scope, "a", RecordState::Processing, None, now_ms(), 60_000);
    let outcome = store
        .claim(&mut waiter, &duplicate, Duration::from_secs(1))
        .await;
    assert!(matches!(outcome, Err(Error::Busy)), "{outcome:?}");
    let lifted: u64 = sqlx::query_scalar("SELECT @@SESSION.innodb_lock_wait_timeout")
        .fetch_one(&mut *waiter)
        .await
        .unwrap();
    assert_eq!(lifted, 50, "the server default");
    drop(waiter);
    holder.rollback().await.unwrap();
    db.drop().await;
}

/// A claim is the first statement of its transaction, so it can only deadlock against another
/// transaction's later statements (InnoDB's gap locks after an original rolls back under
/// waiting duplicates): what matters is how the deadlock is reported, pinned here on the
/// server's own error.
#[tokio::test]
async fn deadlocks_are_conflicts_not_errors() {
    let db = TestDb::create().await;
    let store = migrated(&db).await;
    sqlx::raw_sql(
        "CREATE TABLE cells (id INT PRIMARY KEY, n INT NOT NULL) ENGINE = InnoDB; \
        INSERT INTO cells VALUES (1, 0), (2, 0)",
    )
    .execute(store.pool())
    .await
    .unwrap();
    let mut first = store.begin(Duration::from_secs(10)).await.unwrap();
    let mut second = store.begin(Duration::from_secs(10)).await.unwrap();
    let update = |id: i32| sqlx::query("UPDATE cells SET n = n + 1 WHERE id = ?").bind(id);
    update(1).execute(&mut *first).await.unwrap();
    update(2).execute(&mut *second).await.unwrap();
    // Each now waits for the other's row: InnoDB detects the cycle and aborts one of them.
    let (one, two) = tokio::join!(
        update(2).execute(&mut *first),
        update(1).execute(&mut *second)
    );
    let outcomes = [one.map(drop), two.map(drop)]
        .map(|outcome| outcome.map_err(crate::backend::mysql::classify));
    assert_eq!(
        outcomes
            .iter()
            .filter(|r| matches!(r, Err(Error::Conflict)))
            .count(),
        1,
        "{outcomes:?}"
    );
    assert!(
        outcomes
            .iter()
            .all(|r| matches!(r, Ok(()) | Err(Error::Conflict))),
        "{outcomes:?}"
    );
    first.rollback().await.unwrap();
    second.rollback().await.unwrap();
    db.drop().await;
}

#[tokio::test]
async fn purge_deletes_expired_records_in_batches_and_keeps_live_ones() {
    let db = TestDb::create().await;
    let store = migrated(&db).await;
    let past = now_ms() - 60_000;
    let mut tx = store.begin(Duration::from_secs(5)).await.unwrap();
    let stored = completed("x");
    for i in 0..2_500 {
        let scope = scope(&format!("k-purge-{i}"));
        let expired = record(
            &scope,
            "x",
            RecordState::Completed,
            Some(&stored),
            past,
            1_000,
        );
        assert!(
            store
                .claim(&mut tx, &expired, Duration::from_secs(5))
                .await
                .unwrap()
        );
    }
    for i in 0..3 {
        let scope = scope(&format!("k-keep-{i}"));
        let live = record(
            &scope,
            "x",
            RecordState::Completed,
            Some(&stored),
            now_ms(),
            60_000,
        );
        assert!(
            store
                .claim(&mut tx, &live, Duration::from_secs(5))
                .await
                .unwrap()
        );
    }
    tx.commit().await.unwrap();

    assert_eq!(
        store
            .purge_expired_batch(Millis::now(), 1000)
            .await
            .unwrap(),
        1000
    );
    assert_eq!(store.purge_expired().await.unwrap(), 1_500);
    assert_eq!(store.purge_expired().await.unwrap(), 0);
    assert_eq!(
        count(store.pool(), "SELECT COUNT(*) FROM idempotency_records").await,
        3
    );
    db.drop().await;
}

// ---------------------------------------------------------------- leases

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn expired_lease_is_taken_over_only_after_asking_recovery() {
    let db = TestDb::create().await;
    let store = MySqlStore::new(db.pool(16).await);
    store.migrate().await.unwrap();
    super::lease::expired_lease_is_taken_over_only_after_asking_recovery(store).await;
    db.drop().await;
}

/// `@@in_transaction` and the session's lock-wait bound, on the pool's one connection.
async fn session_state(pool: &MySqlPool) -> (u64, u64) {
    sqlx::query_as("SELECT @@in_transaction, @@SESSION.innodb_lock_wait_timeout")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_claim_sent_with_begin_takes_a_fresh_key_and_leaves_a_refused_session_as_it_was() {
    let db = TestDb::create().await;
    // One connection, so every step below runs on the session the previous one left.
    let store = protocol_of(&MySqlStore::new(db.pool(1).await));
    store.migrate().await.unwrap();
    sqlx::raw_sql("SET SESSION innodb_lock_wait_timeout = 37")
        .execute(store.pool())
        .await
        .unwrap();
    let first = Scope::new(
        "o'brien\\'); DROP TABLE idempotency_records; --",
        "POST",
        "/orders/'\0*/",
        "k-fused".parse::<IdempotencyKey>().unwrap(),
    );
    let now = now_ms();
    let claim = record(&first, "a", RecordState::Processing, None, now, 60_000);

    let BeganClaim::Ours(mut tx) = store
        .begin_claimed(&claim, Duration::from_secs(3))
        .await
        .unwrap()
    else {
        panic!("a fresh key is claimed");
    };
    let (open, bound): (u64, u64) =
        sqlx::query_as("SELECT @@in_transaction, @@SESSION.innodb_lock_wait_timeout")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
    assert_eq!(
        (open, bound),
        (1, 37),
        "the handler runs in the claim's transaction with the session's own bound"
    );
    store
        .commit_record(tx, &finished(&claim, &completed("one")))
        .await
        .unwrap();
    assert_eq!(session_state(store.pool()).await, (0, 37));
    let (principal, route, state): (String, String, String) = sqlx::query_as(
        "SELECT principal, route, state FROM idempotency_records WHERE key_digest = ?",
    )
    .bind(first.scoped_key().digest().to_vec())
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(
        (principal.as_str(), route.as_str(), state.as_str()),
        (
            "o'brien\\'); DROP TABLE idempotency_records; --",
            "/orders/'\u{fffd}*/",
            "completed"
        )
    );

    let duplicate = record(&first, "b", RecordState::Processing, None, now + 1, 60_000);
    let outcome = store
        .begin_claimed(&duplicate, Duration::from_secs(3))
        .await
        .unwrap();
    assert!(matches!(outcome, BeganClaim::Taken), "{outcome:?}");
    assert_eq!(
        session_state(store.pool()).await,
        (0, 37),
        "a refused claim leaves no transaction open and the bound restored"
    );
    let found = store.lookup(&first.scoped_key()).await.unwrap().unwrap();
    assert_eq!(found.fingerprint, claim.fingerprint);
    assert_eq!(found.response.unwrap().body.as_ref(), b"one");

    // An expired record is replaced in place.
    let old = scope("k-fused-expired");
    let old_response = completed("old");
    let expired = record(
        &old,
        "old",
        RecordState::Completed,
        Some(&old_response),
        now - 10_000,
        1_000,
    );
    let BeganClaim::Ours(tx) = store
        .begin_claimed(&expired, Duration::from_secs(1))
        .await
        .unwrap()
    else {
        panic!("a fresh key is claimed");
    };
    tx.commit().await.unwrap();
    let fresh = record(&old, "new", RecordState::Processing, None, now, 60_000);
    let BeganClaim::Ours(tx) = store
        .begin_claimed(&fresh, Duration::from_secs(1))
        .await
        .unwrap()
    else {
        panic!("an expired record is replaced");
    };
    tx.commit().await.unwrap();
    let found = store.lookup(&old.scoped_key()).await.unwrap().unwrap();
    assert_eq!(found.state, RecordState::Processing);
    assert_eq!(found.fingerprint, fresh.fingerprint);
    assert!(found.response.is_none());
    assert_eq!(
        count(store.pool(), "SELECT COUNT(*) FROM idempotency_records").await,
        2
    );
    db.drop().await;
}

#[tokio::test]
async fn a_claim_sent_with_begin_waits_for_an_in_flight_duplicate_then_is_busy() {
    let db = TestDb::create().await;
    let holder_store = migrated(&db).await;
    let waiter_store = protocol_of(&MySqlStore::new(db.pool(1).await));
    let scope = scope("k-fused-in-flight");
    let claim = record(&scope, "a", RecordState::Processing, None, now_ms(), 60_000);
    let BeganClaim::Ours(holder) = holder_store
        .begin_claimed(&claim, Duration::from_secs(1))
        .await
        .unwrap()
    else {
        panic!("a fresh key is claimed");
    };

    let started = std::time::Instant::now();
    let outcome = waiter_store
        .begin_claimed(&claim, Duration::from_millis(200))
        .await;
    assert!(matches!(outcome, Err(Error::Busy)), "{outcome:?}");
    // Rounded up to the whole second the server takes.
    assert!(started.elapsed() >= Duration::from_secs(1));
    assert_eq!(
        session_state(waiter_store.pool()).await,
        (0, 50),
        "the waiter's session is back to the server default, with nothing open"
    );
    drop(holder);
    db.drop().await;
}

#[tokio::test]
async fn an_unmigrated_store_names_the_fix_until_migrated() {
    let db = TestDb::create().await;
    super::schema::an_unmigrated_store_names_the_fix_until_migrated(
        MySqlStore::new(db.pool(2).await),
        1,
    )
    .await;
    db.drop().await;
}

#[tokio::test]
async fn an_outdated_schema_is_reported_until_it_is_current() {
    let db = TestDb::create().await;
    super::schema::an_outdated_schema_is_reported_until_it_is_current(
        MySqlStore::new(db.pool(2).await),
        1,
    )
    .await;
    db.drop().await;
}

#[tokio::test]
async fn a_record_too_large_to_write_out_is_claimed_with_bound_values() {
    let db = TestDb::create().await;
    let store = MySqlStore::new(db.pool(2).await);
    store.migrate().await.unwrap();
    super::large::a_record_too_large_to_write_out_is_claimed_with_bound_values(store).await;
    db.drop().await;
}
