//! Claiming a key for the transaction the work then runs in: the key is held by that
//! transaction alone, and a claim that finds it taken reads the record instead. How is the
//! store's business (see `Store::claim`); the engine only counts and names the outcome.

use std::time::Instant;

use sqlx::Transaction;

use super::metrics::{self, ClaimResult};
use super::outcome::IN_PROGRESS;
use super::{Engine, RunError};
use crate::Backend;
use crate::backend::Claimed;
use crate::error::{Error, Rejection};
use crate::fingerprint::Fingerprint;
use crate::record::{NewRecord, RecordState};
use crate::scope::{Scope, ScopedKey};
use crate::store::Keep;

impl<DB: Backend> Engine<DB> {
    /// A record for `scope` created now, expiring after the retention.
    pub(super) fn new_record<'a>(
        &self,
        key: ScopedKey,
        scope: &'a Scope,
        fingerprint: Fingerprint,
        state: RecordState,
    ) -> NewRecord<'a> {
        let now = self.store.clock().now();
        NewRecord {
            key,
            scope,
            fingerprint,
            state,
            response: None,
            lease: None,
            created_at: now,
            expires_at: now.after(self.settings.retention),
        }
    }

    /// Claims the record's key in `begun` (or a transaction begun now), or reads the live
    /// record that holds it.
    pub(super) async fn claim(
        &self,
        record: &NewRecord<'_>,
        begun: Option<Transaction<'static, DB>>,
    ) -> Result<Claimed<DB>, RunError> {
        let started = Instant::now();
        let keep = if self.settings.keys_only {
            Keep::Key
        } else {
            Keep::Record
        };
        let claim = self
            .store
            .claim(record, keep, self.settings.wait, begun)
            .await
            .map_err(busy_or_internal);
        let result = match &claim {
            Ok(Claimed::Ours(_)) => ClaimResult::Claimed,
            Ok(Claimed::Theirs(_) | Claimed::Held) => ClaimResult::Taken,
            Err(RunError::Rejected(Rejection::InProgress { .. })) => ClaimResult::Busy,
            Err(_) => ClaimResult::Failed,
        };
        metrics::claimed(result, started.elapsed());
        claim
    }
}

/// A lock wait that ran out is the key's original at work; anything else is the store failing.
fn busy_or_internal(error: Error) -> RunError {
    match error {
        Error::Busy | Error::Conflict => IN_PROGRESS.into(),
        error => {
            tracing::error!(%error, "idempotency store failed");
            RunError::Store(error)
        }
    }
}
