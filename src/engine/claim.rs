//! Claiming a key for the transaction the work then runs in: the key is held by that
//! transaction alone, and a claim that finds it taken reads the record instead. The record is
//! written when the transaction commits, where the table's unique key has the last word.

use std::time::{Duration, Instant};

use sqlx::Transaction;

use super::metrics::{self, ClaimResult};
use super::outcome::IN_PROGRESS;
use super::{Engine, RunError};
use crate::Backend;
use crate::backoff::Backoff;
use crate::error::{Error, Rejection};
use crate::fingerprint::Fingerprint;
use crate::record::{Record, RecordState};
use crate::scope::{Scope, ScopedKey};
use crate::store::{BeganClaim, NewRecord, Protocol};

/// Who holds a key after a claim.
pub(super) enum Claim<DB: sqlx::Database> {
    /// This claim: the transaction holding it.
    Ours(Transaction<'static, DB>),
    /// Another intent's committed record.
    Theirs(Record),
    /// A live dedupe key, claimed without a record (see [`Engine::keys_only`]).
    Held,
}

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
    ) -> Result<Claim<DB>, RunError> {
        let started = Instant::now();
        let claim = if self.settings.keys_only {
            self.claim_key(record).await
        } else {
            self.claim_rounds(record, begun).await
        };
        let result = match &claim {
            Ok(Claim::Ours(_)) => ClaimResult::Claimed,
            Ok(Claim::Theirs(_) | Claim::Held) => ClaimResult::Taken,
            Err(RunError::Rejected(Rejection::InProgress { .. })) => ClaimResult::Busy,
            Err(_) => ClaimResult::Failed,
        };
        metrics::claimed(result, started.elapsed());
        claim
    }

    /// Claims the record's key alone, as a dedupe key; a deadlock victim claims again.
    async fn claim_key(&self, record: &NewRecord<'_>) -> Result<Claim<DB>, RunError> {
        let store = self.store.protocol();
        for _ in 0..3 {
            let claimed = store
                .claim_key(
                    &record.key,
                    record.created_at,
                    record.expires_at,
                    self.settings.wait,
                )
                .await;
            match claimed {
                Ok(Some(tx)) => return Ok(Claim::Ours(tx)),
                Ok(None) => return Ok(Claim::Held),
                Err(Error::Conflict) => {}
                Err(error) => return Err(busy_or_internal(error)),
            }
        }
        Err(IN_PROGRESS.into())
    }

    async fn claim_rounds(
        &self,
        record: &NewRecord<'_>,
        mut begun: Option<Transaction<'static, DB>>,
    ) -> Result<Claim<DB>, RunError> {
        let store = self.store.protocol();
        // None: a wait too long to count to, which never runs out.
        let deadline = Instant::now().checked_add(self.settings.wait);
        // Another round settles the races a claim can lose without an answer: the record
        // vanished between the failed claim and the read (purged as it expired), the database
        // picked this transaction as a deadlock victim (InnoDB does when an original rolls back
        // under waiting duplicates), or, at REPEATABLE READ or SERIALIZABLE, the claim waited for
        // the key's original and its snapshot, older than the original's commit, cannot tell
        // what the original left. The transaction is gone in each case; the outcome the claim
        // waited for is read afresh, and failing that, claiming again queues it behind whoever
        // holds the key now, like any duplicate. Rounds go on while the wait lasts, so duplicates
        // that queued on one key and come back together do not use up a fixed count among
        // themselves, each meeting the others' brief holds of the key.
        if begun.is_none() {
            // The claim travels with the statement that begins its transaction, where the
            // backend can: a new key then costs no exchange beyond the transaction's own.
            match store.begin_claimed(record, self.settings.wait).await {
                Ok(BeganClaim::Ours(tx)) => return Ok(Claim::Ours(tx)),
                Ok(BeganClaim::Taken) => match store.lookup(&record.key).await {
                    Ok(Some(existing)) => return Ok(Claim::Theirs(existing)),
                    // Purged as it expired since: claim again, the usual way.
                    Ok(None) => {}
                    Err(error) => return Err(busy_or_internal(error)),
                },
                Ok(BeganClaim::Unfused) => {}
                Err(Error::Conflict) => {
                    if let Some(existing) = self.committed_meanwhile(record).await? {
                        return Ok(Claim::Theirs(existing));
                    }
                }
                Err(error) => return Err(busy_or_internal(error)),
            }
        }
        let mut round: u32 = 0;
        loop {
            round = round.saturating_add(1);
            if round > 1 {
                let waited_out = deadline.is_some_and(|deadline| Instant::now() >= deadline);
                if round > MIN_ROUNDS && waited_out {
                    return Err(IN_PROGRESS.into());
                }
                tokio::time::sleep(ROUND_BACKOFF.delay(round - 1)).await;
            }
            // Later rounds wait only for what is left of the bound, so a duplicate's claim never
            // waits much past it in all.
            let lock_wait = deadline
                .map_or(self.settings.wait, |deadline| {
                    deadline.saturating_duration_since(Instant::now())
                })
                .max(MIN_LOCK_WAIT);
            let mut tx = match begun.take() {
                Some(tx) => tx,
                None => match store.begin(lock_wait).await {
                    Ok(tx) => tx,
                    Err(Error::Conflict) => continue,
                    Err(error) => return Err(busy_or_internal(error)),
                },
            };
            match store.claim(&mut tx, record, lock_wait).await {
                Ok(true) => return Ok(Claim::Ours(tx)),
                Ok(false) => {}
                Err(Error::Conflict) => {
                    // Ended now, so the key's lock this transaction may hold is let go before
                    // the read rather than when the connection is next used.
                    let _ = tx.rollback().await;
                    if let Some(existing) = self.committed_meanwhile(record).await? {
                        return Ok(Claim::Theirs(existing));
                    }
                    continue;
                }
                Err(error) => return Err(busy_or_internal(error)),
            }
            match store.find(&mut tx, &record.key).await {
                Ok(Some(existing)) => return Ok(Claim::Theirs(existing)),
                Ok(None) | Err(Error::Conflict) => {}
                Err(error) => return Err(busy_or_internal(error)),
            }
        }
    }

    /// The live record under the key, read outside any transaction after a claim had to start
    /// over: a fresh read sees what the original the claim waited for committed.
    async fn committed_meanwhile(
        &self,
        record: &NewRecord<'_>,
    ) -> Result<Option<Record>, RunError> {
        match self.store.protocol().lookup(&record.key).await {
            Ok(found) => Ok(found.filter(|found| !found.is_expired(record.created_at))),
            Err(error) => Err(busy_or_internal(error)),
        }
    }
}

/// How many rounds a claim gets even when its wait has run out: enough to settle a race it
/// lost without an answer.
const MIN_ROUNDS: u32 = 3;

/// The shortest wait a later round's claim is given, so a round begun at the end of the bound
/// still gets the key when it is free or about to be.
const MIN_LOCK_WAIT: Duration = Duration::from_millis(1);

/// The pause before another round: jittered, so duplicates that start over together part, and
/// short, since each has already waited for the key.
const ROUND_BACKOFF: Backoff =
    Backoff::exponential(Duration::from_millis(2), Duration::from_millis(100));

/// A lock wait that ran out is the key's original at work; anything else is the store failing.
pub(super) fn busy_or_internal(error: Error) -> RunError {
    match error {
        Error::Busy | Error::Conflict => IN_PROGRESS.into(),
        error => {
            tracing::error!(%error, "idempotency store failed");
            RunError::Store(error)
        }
    }
}
