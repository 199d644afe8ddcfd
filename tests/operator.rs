//! An operator's two actions on one record, through the engine: look it up by its full scope,
//! and let it go so the key executes afresh.

use axum_idempotency::{
    Engine, Fingerprinter, IdempotencyKey, Lookup, Outcome, Scope, SqliteStore, Tx,
};
use sqlx::Sqlite;

async fn engine() -> Engine<Sqlite> {
    let pool = sqlx::SqlitePool::connect("sqlite::memory:")
        .await
        .expect("sqlite");
    let store = SqliteStore::new(pool);
    store.migrate().await.expect("migrate");
    // The cache is on so that forgetting is seen to reach it too.
    Engine::new(store).cache_replays(1024 * 1024)
}

fn scope(principal: &str) -> Scope {
    let key: IdempotencyKey = "support-case-key-0001".parse().expect("key");
    Scope::new(principal, "POST", "/orders", key)
}

#[tokio::test]
async fn lookup_reads_a_record_only_through_its_full_scope() {
    let engine = engine().await;
    let fingerprint = Fingerprinter::new().fingerprint_value("order", b"{}");
    let alice = scope("alice");
    engine
        .run(&alice, fingerprint, |_tx: Tx<Sqlite>| async {
            "order 7 placed"
        })
        .await
        .expect("runs");

    match engine.lookup(&alice).await.expect("look up") {
        Lookup::Final(response) => assert_eq!(response.body().as_ref(), b"order 7 placed"),
        other => panic!("expected the stored answer, got {other:?}"),
    }
    // The same key under another principal is another record: there is none.
    assert!(matches!(
        engine.lookup(&scope("bob")).await.expect("look up"),
        Lookup::Absent
    ));
}

#[tokio::test]
async fn forget_lets_the_key_execute_afresh() {
    let engine = engine().await;
    let fingerprint = Fingerprinter::new().fingerprint_value("order", b"{}");
    let alice = scope("alice");
    let first = engine
        .run(&alice, fingerprint, |_tx: Tx<Sqlite>| async {
            "wrong answer"
        })
        .await
        .expect("runs");
    assert_eq!(first.outcome, Outcome::Executed);

    // Another principal naming the same key cannot drop alice's record.
    assert!(
        !engine
            .forget(&scope("bob"), "ticket 1")
            .await
            .expect("forget")
    );
    assert!(engine.forget(&alice, "ticket 2").await.expect("forget"));
    assert!(matches!(
        engine.lookup(&alice).await.expect("look up"),
        Lookup::Absent
    ));

    let again = engine
        .run(&alice, fingerprint, |_tx: Tx<Sqlite>| async {
            "right answer"
        })
        .await
        .expect("runs");
    assert_eq!(again.outcome, Outcome::Executed);
    assert_eq!(again.response.body().as_ref(), b"right answer");
}

#[cfg(feature = "test-util")]
#[tokio::test]
async fn lookup_reads_time_from_the_engines_clock() {
    use std::time::{Duration, SystemTime};

    let clock = axum_idempotency::ManualClock::new(SystemTime::now());
    let engine = engine()
        .await
        .retention(Duration::from_secs(60))
        .timed_by(clock.clone());
    let fingerprint = Fingerprinter::new().fingerprint_value("order", b"{}");
    let alice = scope("alice");
    engine
        .run(&alice, fingerprint, |_tx: Tx<Sqlite>| async { "placed" })
        .await
        .expect("runs");
    assert!(matches!(
        engine.lookup(&alice).await.expect("look up"),
        Lookup::Final(_)
    ));

    // Past retention by the engine's clock, though not by the wall clock: the key is a new
    // intent, and the operator sees it as such.
    clock.advance(Duration::from_secs(61));
    assert!(matches!(
        engine.lookup(&alice).await.expect("look up"),
        Lookup::Absent
    ));
}

#[cfg(feature = "test-util")]
#[tokio::test]
async fn the_engines_store_purges_by_the_engines_clock() {
    use std::time::{Duration, SystemTime};

    let clock = axum_idempotency::ManualClock::new(SystemTime::now());
    let engine = engine()
        .await
        .retention(Duration::from_secs(60))
        .timed_by(clock.clone());
    let fingerprint = Fingerprinter::new().fingerprint_value("order", b"{}");
    engine
        .run(&scope("alice"), fingerprint, |_tx: Tx<Sqlite>| async {
            "placed"
        })
        .await
        .expect("runs");
    assert_eq!(engine.store().purge_expired().await.expect("purge"), 0);

    clock.advance(Duration::from_secs(61));
    assert_eq!(
        engine.store().purge_expired().await.expect("purge"),
        1,
        "expired by the engine's clock, though not by the wall clock"
    );
}
