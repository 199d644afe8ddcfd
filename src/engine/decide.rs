//! What the engine decides about a key, apart from doing it: what a record a claim found means
//! for the intent, how the work's answer ends its transaction, and whether a transaction the
//! database aborted runs again.
//!
//! Plain functions over plain values: the engine calls them, and so does the protocol's checked
//! model, which explores every interleaving of them with claims, commits and crashes.

use super::outcome::Classification;
use crate::record::RecordState;

/// What the intent gets from a live record that holds its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Existing {
    /// The record's stored answer, replayed.
    Replay,
    /// The key's first intent is still at work: 409, retry later.
    InFlight,
    /// The key was used for another intent: 422.
    KeyReused,
}

/// What a live record for the key means for an intent: `same_intent` when the fingerprints
/// match, `stored` when the record holds an answer.
pub(crate) fn existing(state: RecordState, stored: bool, same_intent: bool) -> Existing {
    if !same_intent {
        return Existing::KeyReused;
    }
    match state {
        RecordState::Completed | RecordState::FailedPermanent if stored => Existing::Replay,
        _ => Existing::InFlight,
    }
}

/// How the work's transaction ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ending {
    /// The writes and the record with the answer commit together.
    Commit,
    /// The writes are undone; the answer is recorded alone and replayed.
    Refuse,
    /// Everything is undone and no record is kept: the same key runs afresh next time.
    RollBack,
}

/// How an answer classified as `classification` ends the work's transaction; `keys_only` when
/// the key is kept without a record, which has no answer to keep a refusal in.
pub(crate) fn ending(classification: Classification, keys_only: bool) -> Ending {
    match classification {
        Classification::Completed => Ending::Commit,
        Classification::FailedPermanent if !keys_only => Ending::Refuse,
        Classification::FailedPermanent | Classification::Retryable => Ending::RollBack,
    }
}

/// How many times a transaction the database aborts on conflicts is run in all.
pub(crate) const CONFLICT_ATTEMPTS: u32 = 12;

/// Whether the work runs again after the database aborted its transaction in `round`
/// (counted from 1): nothing of that round stands, so running it again is safe, up to a limit
/// past which the intent is answered 503.
pub(crate) fn run_again(round: u32) -> bool {
    round < CONFLICT_ATTEMPTS
}
