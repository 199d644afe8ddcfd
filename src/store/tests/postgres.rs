//! `PgStore` against the real PostgreSQL server: how a claim waits for a concurrent claimer of
//! its key, and that it leaves the session's own `lock_timeout` to the handler.

use std::time::{Duration, Instant};

use sqlx::PgConnection;

use super::{
    BeganClaim, PgSchema, Steps, completed, finished, now_ms, protocol_of, record, scope,
    until_a_session_waits_for_a_lock, until_no_session_holds_an_advisory_lock,
};
use crate::error::Error;
use crate::key::IdempotencyKey;
use crate::record::RecordState;
use crate::scope::Scope;
use crate::store::PgStore;

/// A store on a fresh schema whose connections all run with `lock_timeout = 37s`, a value no
/// claim bound uses: seeing it inside a claim transaction means the session's setting is back.
async fn store(schema: &PgSchema, connections: u32) -> Steps<sqlx::Postgres> {
    let store = PgStore::new(schema.pool(connections).await);
    store.migrate().await.unwrap();
    let mut opened = Vec::new();
    for _ in 0..connections {
        let mut conn = store.pool().acquire().await.unwrap();
        sqlx::raw_sql("SET lock_timeout = '37s'")
            .execute(&mut *conn)
            .await
            .unwrap();
        opened.push(conn);
    }
    protocol_of(&store)
}

async fn lock_timeout(conn: &mut PgConnection) -> String {
    sqlx::query_scalar("SELECT current_setting('lock_timeout')")
        .fetch_one(conn)
        .await
        .unwrap()
}

#[tokio::test]
async fn uncontended_claim_leaves_the_sessions_lock_timeout_to_the_handler() {
    let schema = PgSchema::create().await;
    let store = store(&schema, 1).await;
    let key = scope("k-uncontended");
    let claim = record(&key, "a", RecordState::Processing, None, now_ms(), 60_000);
    let wait = Duration::from_millis(250);

    let mut tx = store.begin(wait).await.unwrap();
    assert!(store.claim(&mut tx, &claim, wait).await.unwrap());
    assert_eq!(lock_timeout(&mut tx).await, "37s");
    store.commit_record(tx, &claim).await.unwrap();

    let mut again = store.begin(wait).await.unwrap();
    assert!(
        !store.claim(&mut again, &claim, wait).await.unwrap(),
        "a live record keeps the key"
    );
    let found = store.find(&mut again, &key.scoped_key()).await.unwrap();
    assert_eq!(
        found.map(|record| record.state),
        Some(RecordState::Processing)
    );
    drop(again);
    schema.drop(store.pool()).await;
}

#[tokio::test]
async fn duplicate_of_an_in_flight_claim_is_busy_once_its_own_wait_runs_out() {
    let schema = PgSchema::create().await;
    let store = store(&schema, 2).await;
    let key = scope("k-busy");
    let claim = record(&key, "a", RecordState::Processing, None, now_ms(), 60_000);
    let mut holder = store.begin(Duration::from_secs(1)).await.unwrap();
    assert!(
        store
            .claim(&mut holder, &claim, Duration::from_secs(1))
            .await
            .unwrap()
    );

    let wait = Duration::from_millis(300);
    let mut waiter = store.begin(wait).await.unwrap();
    let started = Instant::now();
    let outcome = store.claim(&mut waiter, &claim, wait).await;
    let waited = started.elapsed();
    assert!(matches!(outcome, Err(Error::Busy)), "{outcome:?}");
    assert!(waited >= wait, "gave up after {waited:?}");
    assert!(
        waited < Duration::from_secs(5),
        "waited {waited:?}: the session's 37 s applied, not the claim's bound"
    );
    drop(waiter);
    holder.rollback().await.unwrap();
    schema.drop(store.pool()).await;
}

#[tokio::test]
async fn duplicate_queued_behind_an_original_that_rolls_back_claims_with_the_sessions_timeout() {
    let schema = PgSchema::create().await;
    let store = store(&schema, 2).await;
    let key = scope("k-rolled-back");
    let claim = record(&key, "a", RecordState::Processing, None, now_ms(), 60_000);
    let mut holder = store.begin(Duration::from_secs(1)).await.unwrap();
    assert!(
        store
            .claim(&mut holder, &claim, Duration::from_secs(1))
            .await
            .unwrap()
    );
    let original = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        holder.rollback().await.unwrap();
    });

    let wait = Duration::from_secs(10);
    let mut waiter = store.begin(wait).await.unwrap();
    let started = Instant::now();
    assert!(store.claim(&mut waiter, &claim, wait).await.unwrap());
    assert!(
        started.elapsed() >= Duration::from_millis(250),
        "claimed after {:?}, while the original still held the key",
        started.elapsed()
    );
    assert_eq!(lock_timeout(&mut waiter).await, "37s");
    store.commit_record(waiter, &claim).await.unwrap();
    original.await.unwrap();

    let records: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idempotency_records")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(records, 1);
    schema.drop(store.pool()).await;
}

#[tokio::test]
async fn duplicate_queued_behind_an_original_that_commits_finds_its_record() {
    let schema = PgSchema::create().await;
    let store = store(&schema, 2).await;
    let key = scope("k-committed");
    let now = now_ms();
    let claim = record(&key, "a", RecordState::Processing, None, now, 60_000);
    let mut holder = store.begin(Duration::from_secs(1)).await.unwrap();
    assert!(
        store
            .claim(&mut holder, &claim, Duration::from_secs(1))
            .await
            .unwrap()
    );
    let original = tokio::spawn({
        let (store, key) = (store.clone(), key.clone());
        async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            let claim = record(&key, "a", RecordState::Processing, None, now, 60_000);
            store.commit_record(holder, &claim).await.unwrap();
        }
    });

    let wait = Duration::from_secs(10);
    let mut waiter = store.begin(wait).await.unwrap();
    let started = Instant::now();
    assert!(!store.claim(&mut waiter, &claim, wait).await.unwrap());
    assert!(started.elapsed() >= Duration::from_millis(250));
    let found = store.find(&mut waiter, &key.scoped_key()).await.unwrap();
    assert_eq!(
        found.map(|record| record.state),
        Some(RecordState::Processing)
    );
    original.await.unwrap();
    drop(waiter);
    schema.drop(store.pool()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn expired_lease_is_taken_over_only_after_asking_recovery() {
    let schema = PgSchema::create().await;
    let store = PgStore::new(schema.pool(16).await);
    store.migrate().await.unwrap();
    let pool = store.pool().clone();
    super::lease::expired_lease_is_taken_over_only_after_asking_recovery(store).await;
    schema.drop(&pool).await;
}

/// Whether the pool's connection runs its next statement in a transaction begun earlier, and
/// its `lock_timeout`. A simple query, so that a statement outside a transaction starts its own
/// transaction at the statement's own start.
async fn session_state(store: &Steps<sqlx::Postgres>) -> (bool, String) {
    use sqlx::Row;
    let row =
        sqlx::raw_sql("SELECT now() <> statement_timestamp(), current_setting('lock_timeout')")
            .fetch_one(store.pool())
            .await
            .unwrap();
    (row.get(0), row.get(1))
}

#[tokio::test]
async fn a_claim_sent_with_begin_takes_a_fresh_key_and_leaves_a_refused_session_idle() {
    let schema = PgSchema::create().await;
    let store = store(&schema, 1).await;
    let principal = "o'brien\\'); DROP TABLE idempotency_records; -- $$ \u{fe0f}";
    let route = "/orders/'*/";
    let key = Scope::new(
        principal,
        "POST",
        route,
        "k-fused".parse::<IdempotencyKey>().unwrap(),
    );
    let now = now_ms();
    let claim = record(&key, "a", RecordState::Processing, None, now, 60_000);

    let BeganClaim::Ours(mut tx) = store
        .begin_claimed(&claim, Duration::from_secs(1))
        .await
        .unwrap()
    else {
        panic!("a fresh key is claimed");
    };
    assert_eq!(lock_timeout(&mut tx).await, "37s");
    store
        .commit_record(tx, &finished(&claim, &completed("one")))
        .await
        .unwrap();
    assert_eq!(session_state(&store).await, (false, "37s".to_owned()));
    let stored: (String, String, String) = sqlx::query_as(
        "SELECT principal, route, state FROM idempotency_records WHERE key_digest = $1",
    )
    .bind(key.scoped_key().digest().to_vec())
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(
        stored,
        (
            principal.to_owned(),
            route.to_owned(),
            "completed".to_owned()
        )
    );

    let duplicate = record(&key, "b", RecordState::Processing, None, now + 1, 60_000);
    let outcome = store
        .begin_claimed(&duplicate, Duration::from_secs(1))
        .await
        .unwrap();
    assert!(matches!(outcome, BeganClaim::Taken), "{outcome:?}");
    assert_eq!(
        session_state(&store).await,
        (false, "37s".to_owned()),
        "a refused claim leaves no transaction open and the session's bound in place"
    );
    let found = store.lookup(&key.scoped_key()).await.unwrap().unwrap();
    assert_eq!(found.fingerprint, claim.fingerprint);
    assert_eq!(found.response.unwrap().body.as_ref(), b"one");
    schema.drop(store.pool()).await;
}

#[tokio::test]
async fn a_claim_sent_with_begin_replaces_an_expired_record_through_the_schemas_functions() {
    let schema = PgSchema::create().await;
    let store = store(&schema, 1).await;
    let (version, functions): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT MAX(version) FROM idempotency_schema_versions), \
         (SELECT COUNT(*) FROM pg_proc WHERE pronamespace = current_schema()::regnamespace AND prokind = 'p' \
          AND proname IN ('axum_idempotency_lock_v1', 'axum_idempotency_record_v1'))",
    )
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!((version, functions), (1, 2));

    let now = now_ms();
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
    store.commit_record(tx, &expired).await.unwrap();
    let fresh = record(&old, "new", RecordState::Processing, None, now, 60_000);
    let BeganClaim::Ours(tx) = store
        .begin_claimed(&fresh, Duration::from_secs(1))
        .await
        .unwrap()
    else {
        panic!("an expired record is replaced");
    };
    store
        .commit_record(tx, &finished(&fresh, &completed("new")))
        .await
        .unwrap();
    let found = store.lookup(&old.scoped_key()).await.unwrap().unwrap();
    assert_eq!(found.state, RecordState::Completed);
    assert_eq!(found.fingerprint, fresh.fingerprint);
    assert_eq!(found.response.unwrap().body.as_ref(), b"new");
    let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idempotency_records")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(rows, 1);
    schema.drop(store.pool()).await;
}

#[tokio::test]
async fn a_claim_sent_with_begin_waits_for_an_in_flight_duplicate_then_is_busy() {
    let schema = PgSchema::create().await;
    let store = store(&schema, 2).await;
    let key = scope("k-fused-busy");
    let claim = record(&key, "a", RecordState::Processing, None, now_ms(), 60_000);
    let BeganClaim::Ours(holder) = store
        .begin_claimed(&claim, Duration::from_secs(1))
        .await
        .unwrap()
    else {
        panic!("a fresh key is claimed");
    };

    let wait = Duration::from_millis(300);
    let started = Instant::now();
    let outcome = store.begin_claimed(&claim, wait).await;
    let waited = started.elapsed();
    assert!(matches!(outcome, Err(Error::Busy)), "{outcome:?}");
    assert!(waited >= wait, "gave up after {waited:?}");
    assert!(waited < Duration::from_secs(5), "waited {waited:?}");
    assert_eq!(session_state(&store).await, (false, "37s".to_owned()));
    drop(holder);
    schema.drop(store.pool()).await;
}

#[tokio::test]
async fn an_unmigrated_store_names_the_fix_until_migrated() {
    let schema = PgSchema::create().await;
    let pool = schema.pool(2).await;
    super::schema::an_unmigrated_store_names_the_fix_until_migrated(PgStore::new(pool.clone()), 1)
        .await;
    schema.drop(&pool).await;
}

#[tokio::test]
async fn an_outdated_schema_is_reported_until_it_is_current() {
    let schema = PgSchema::create().await;
    let pool = schema.pool(2).await;
    super::schema::an_outdated_schema_is_reported_until_it_is_current(
        PgStore::new(pool.clone()),
        1,
    )
    .await;
    schema.drop(&pool).await;
}

#[tokio::test]
async fn a_record_too_large_to_write_out_is_claimed_with_bound_values() {
    let schema = PgSchema::create().await;
    let store = PgStore::new(schema.pool(2).await);
    store.migrate().await.unwrap();
    let pool = store.pool().clone();
    super::large::a_record_too_large_to_write_out_is_claimed_with_bound_values(store).await;
    schema.drop(&pool).await;
}

#[tokio::test]
async fn a_new_keys_record_is_written_once_when_it_commits() {
    let schema = PgSchema::create().await;
    let store = store(&schema, 1).await;
    let key = scope("k-one-write");
    let claim = record(&key, "a", RecordState::Processing, None, now_ms(), 60_000);
    let BeganClaim::Ours(mut tx) = store
        .begin_claimed(&claim, Duration::from_secs(1))
        .await
        .unwrap()
    else {
        panic!("a fresh key is claimed");
    };
    let in_flight: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idempotency_records")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert_eq!(in_flight, 0, "the claim writes no row of its own");
    store
        .commit_record(tx, &finished(&claim, &completed("one")))
        .await
        .unwrap();
    // In a fresh table a row written once sits in the first slot of the first page; an insert
    // followed by an update leaves the live version in the second.
    let (slot, state): (String, String) =
        sqlx::query_as("SELECT ctid::text, state FROM idempotency_records")
            .fetch_one(store.pool())
            .await
            .unwrap();
    assert_eq!((slot.as_str(), state.as_str()), ("(0,1)", "completed"));
    assert_eq!(
        session_state(&store).await,
        (false, "37s".to_owned()),
        "the session is left idle, with its own bound"
    );
    schema.drop(store.pool()).await;
}

#[tokio::test]
async fn a_record_that_appeared_under_the_key_fails_the_commit_and_undoes_the_work() {
    let schema = PgSchema::create().await;
    let store = store(&schema, 2).await;
    sqlx::raw_sql("CREATE TABLE work (id INTEGER)")
        .execute(store.pool())
        .await
        .unwrap();
    let key = scope("k-appeared");
    let now = now_ms();
    let claim = record(&key, "a", RecordState::Processing, None, now, 60_000);
    let BeganClaim::Ours(mut tx) = store
        .begin_claimed(&claim, Duration::from_secs(1))
        .await
        .unwrap()
    else {
        panic!("a fresh key is claimed");
    };
    sqlx::query("INSERT INTO work VALUES (1)")
        .execute(&mut *tx)
        .await
        .unwrap();
    // Written without the key's lock, as nothing of this crate does: only the primary key is
    // left to decide.
    let intruder = record(&key, "b", RecordState::Processing, None, now, 60_000);
    let other = store.pool().begin().await.unwrap();
    store
        .commit_record(other, &finished(&intruder, &completed("theirs")))
        .await
        .unwrap();

    let outcome = store
        .commit_record(tx, &finished(&claim, &completed("ours")))
        .await;
    assert!(matches!(outcome, Err(Error::Conflict)), "{outcome:?}");
    let work: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM work")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(work, 0, "the work's writes are rolled back with the record");
    let found = store.lookup(&key.scoped_key()).await.unwrap().unwrap();
    assert_eq!(found.response.unwrap().body.as_ref(), b"theirs");
    schema.drop(store.pool()).await;
}

#[tokio::test]
async fn under_repeatable_read_a_claim_that_waited_is_run_again_and_then_sees_the_record() {
    let schema = PgSchema::create().await;
    let store = store(&schema, 2).await;
    // Every connection of the pool, as a server with that default would give.
    let mut opened = Vec::new();
    for _ in 0..2 {
        let mut conn = store.pool().acquire().await.unwrap();
        sqlx::raw_sql("SET default_transaction_isolation = 'repeatable read'")
            .execute(&mut *conn)
            .await
            .unwrap();
        opened.push(conn);
    }
    drop(opened);
    let key = scope("k-repeatable");
    let now = now_ms();
    let claim = record(&key, "a", RecordState::Processing, None, now, 60_000);
    let BeganClaim::Ours(holder) = store
        .begin_claimed(&claim, Duration::from_secs(1))
        .await
        .unwrap()
    else {
        panic!("a fresh key is claimed");
    };
    let original = tokio::spawn({
        let (store, key, application) = (store.clone(), key.clone(), schema.name());
        async move {
            // Only once the duplicate waits for the key's lock, its snapshot taken.
            until_a_session_waits_for_a_lock(&application).await;
            let claim = record(&key, "a", RecordState::Processing, None, now, 60_000);
            store
                .commit_record(holder, &finished(&claim, &completed("one")))
                .await
                .unwrap();
        }
    });

    let duplicate = record(&key, "a", RecordState::Processing, None, now + 1, 60_000);
    let waited = store
        .begin_claimed(&duplicate, Duration::from_secs(10))
        .await;
    assert!(
        matches!(waited, Err(Error::Conflict)),
        "its snapshot predates the original's commit: {waited:?}"
    );
    original.await.unwrap();
    // Run again once the duplicate's attempt has ended, as the engine's rerun follows its
    // rollback; before, the key's lock may still be held, which is a conflict again.
    until_no_session_holds_an_advisory_lock(&schema.name()).await;
    let again = store
        .begin_claimed(&duplicate, Duration::from_secs(10))
        .await
        .unwrap();
    assert!(matches!(again, BeganClaim::Taken), "{again:?}");
    schema.drop(store.pool()).await;
}
