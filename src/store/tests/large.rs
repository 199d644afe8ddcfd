//! A record whose response is too large to write into a statement's text is written with its
//! values bound, taking a fresh key and leaving a live one as it was, with the transaction
//! still usable to read the winner: the same test on every backend.

use std::time::Duration;

use http::{HeaderMap, StatusCode};

use super::{now_ms, protocol_of, record, scope};
use crate::Backend;
use crate::backend::Claimed;
use crate::record::{RecordState, StoredResponse};
use crate::store::Store;

/// `store` is migrated.
pub(super) async fn a_record_too_large_to_write_out_is_claimed_with_bound_values<DB: Backend>(
    store: Store<DB>,
) {
    let protocol = protocol_of(&store);
    let wait = Duration::from_secs(1);
    let scope = scope("k-large");
    // Quotes and backslashes throughout, past the 64 KiB written into a statement's text.
    let refusal = StoredResponse {
        status: StatusCode::UNPROCESSABLE_ENTITY,
        headers: HeaderMap::new(),
        body: b"'\\".repeat(33 * 1024).into(),
    };
    let claim = record(
        &scope,
        "a",
        RecordState::FailedPermanent,
        Some(&refusal),
        now_ms(),
        60_000,
    );

    let Claimed::Ours(tx) = protocol.claimed(&claim, wait).await.expect("claim") else {
        panic!("a fresh key is taken");
    };
    protocol.commit_record(tx, &claim).await.expect("commit");

    let duplicate = record(&scope, "b", RecordState::Processing, None, now_ms(), 60_000);
    let mut tx = protocol.begin(wait).await.expect("begin");
    assert!(
        !protocol
            .claim(&mut tx, &duplicate, wait)
            .await
            .expect("claim"),
        "a live record keeps the key"
    );
    let found = protocol
        .find(&mut tx, &scope.scoped_key())
        .await
        .expect("the transaction still reads")
        .expect("the record");
    drop(tx);
    assert_eq!(found.state, RecordState::FailedPermanent);
    assert_eq!(found.fingerprint, claim.fingerprint);
    assert_eq!(found.response.expect("response").body, refusal.body);
}
