//! Lease takeover against a record a dead holder left behind, written through the protocol as
//! the holder wrote it: the same test on every backend.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use http::{Request, StatusCode};

use super::{now_ms, unique};
use crate::Backend;
use crate::clock::Millis;
use crate::engine::{Engine, Outcome, RunError};
use crate::error::Rejection;
use crate::fingerprint::{Fingerprint, Fingerprinter};
use crate::key::IdempotencyKey;
use crate::record::{LeaseClaim, NewRecord, RecordState};
use crate::scope::Scope;
use crate::store::Store;
use crate::tx::Tx;

/// A job's scope and fingerprint, chosen equal to those of `POST /effects` with
/// `{"label": label}` under that key.
fn job(label: &str) -> (String, Scope, Fingerprint) {
    let key = unique(label);
    let scope = Scope::new(
        "alice",
        "POST",
        "/effects",
        key.parse::<IdempotencyKey>().expect("key"),
    );
    let (parts, _) = Request::post("/effects")
        .header("content-type", "application/json")
        .body(())
        .expect("request")
        .into_parts();
    let body = serde_json::json!({ "label": label }).to_string();
    (
        key,
        scope,
        Fingerprinter::new().fingerprint(&parts, body.as_bytes()),
    )
}

/// Leaves behind what a lease holder that died would: a committed processing claim.
async fn abandoned_claim<DB: Backend>(
    engine: &Engine<DB>,
    scope: &Scope,
    fingerprint: Fingerprint,
    until_ms: i64,
) {
    let store = super::protocol_of(engine.store());
    let mut tx = store.begin(Duration::from_secs(1)).await.expect("begin");
    let now = until_ms - 1_000;
    let record = NewRecord {
        key: scope.scoped_key(),
        scope,
        fingerprint,
        state: RecordState::Processing,
        response: None,
        created_at: Millis::from_column(now),
        expires_at: Millis::from_column(now + 3_600_000),
        lease: Some(LeaseClaim {
            owner: [7; 16],
            until: Millis::from_column(until_ms),
        }),
    };
    assert!(
        store
            .claim(&mut tx, &record, Duration::from_secs(1))
            .await
            .expect("claim")
    );
    store.commit_record(tx, &record).await.expect("commit");
}

/// Run on a migrated `store`, by an engine with the defaults (those of a layer's engine).
pub(super) async fn expired_lease_is_taken_over_only_after_asking_recovery<DB: Backend>(
    store: Store<DB>,
) {
    let engine = Engine::new(store);
    let runs = Arc::new(AtomicUsize::new(0));

    // A live lease held by someone else: no takeover.
    let (_, live, fingerprint) = job("live");
    abandoned_claim(&engine, &live, fingerprint, now_ms() + 60_000).await;
    let busy = engine
        .run_leased(
            &live,
            fingerprint,
            Duration::from_secs(1),
            || async { None::<&str> },
            |_l| async { "never" },
        )
        .await;
    assert!(
        matches!(busy, Err(RunError::Rejected(Rejection::InProgress { .. }))),
        "{busy:?}"
    );

    // An expired lease whose work did complete downstream: recorded, not redone.
    let (_, done, fingerprint) = job("done");
    abandoned_claim(&engine, &done, fingerprint, now_ms() - 1).await;
    let counter = runs.clone();
    let recovered = engine
        .run_leased(
            &done,
            fingerprint,
            Duration::from_secs(1),
            || async { Some((StatusCode::CREATED, "found downstream")) },
            move |_l| async move {
                counter.fetch_add(1, Ordering::SeqCst);
                "redone"
            },
        )
        .await
        .expect("recovered");
    assert_eq!(recovered.outcome, Outcome::Recovered);
    assert_eq!(runs.load(Ordering::SeqCst), 0, "querying beat a blind redo");
    let replay = engine
        .run(&done, fingerprint, |_tx: Tx<DB>| async { "never" })
        .await
        .expect("replay");
    assert_eq!(replay.outcome, Outcome::Replayed);
    assert_eq!(replay.response.body().as_ref(), b"found downstream");

    // An expired lease whose work never happened: redone once.
    let (_, lost, fingerprint) = job("lost");
    abandoned_claim(&engine, &lost, fingerprint, now_ms() - 1).await;
    let counter = runs.clone();
    let redone = engine
        .run_leased(
            &lost,
            fingerprint,
            Duration::from_secs(1),
            || async { None::<&str> },
            move |_l| async move {
                counter.fetch_add(1, Ordering::SeqCst);
                "redone"
            },
        )
        .await
        .expect("redone");
    assert_eq!(redone.outcome, Outcome::Executed);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
