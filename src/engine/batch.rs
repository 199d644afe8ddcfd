//! Several dedupe keys claimed, and their work run, in one transaction that commits once: one
//! commit, one wait for the disk, for a batch of deliveries instead of one each.

use std::future::Future;
use std::time::Instant;

use tracing::Instrument;

use super::metrics::{self, ClaimResult};
use super::outcome::Logged;
use super::{Engine, Uncancelled};
use crate::Backend;
use crate::backend::is_conflict_abort;
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::record::RecordState;
use crate::scope::Scope;
use crate::tx::{AfterCommit, Tx, TxSlot};

/// Why a batch committed nothing. Whatever it was, none of its work stands.
#[derive(Debug)]
pub(crate) enum BatchFailed<E> {
    /// The store failed to begin, claim or commit.
    Store(Error),
    /// The work for one key failed: its own failure.
    Work(E),
    /// The work panicked, or kept its `Tx`.
    Broken,
}

impl<DB: Backend> Engine<DB> {
    /// Claims the key of each scope in one transaction, runs `work` (with the scope's index) in
    /// that transaction for each key it claimed, in the scopes' order, skips each key a live
    /// claim holds (or an earlier scope of the batch), and commits once. All or nothing: on
    /// any failure everything is rolled back and the caller decides what to run again. `Ok`
    /// says, per scope, whether its work ran and committed (`false`: the key was applied
    /// before). For a dedupe engine only.
    pub(crate) async fn run_batch<F, Fut, E>(
        &self,
        scopes: Vec<Scope>,
        fingerprint: Fingerprint,
        work: F,
    ) -> Result<Vec<bool>, BatchFailed<E>>
    where
        F: FnMut(usize, Tx<DB>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: Send + 'static,
    {
        debug_assert!(self.settings.keys_only, "batches claim dedupe keys only");
        let engine = self.clone();
        let (scopes, batch) = {
            let logged = scopes.clone();
            let run = async move { engine.batch(&scopes, fingerprint, work).await };
            (logged, Uncancelled::new(run).await)
        };
        let applied = match batch {
            Ok(Ok(applied)) => applied,
            Ok(Err(failed)) => return Err(failed),
            Err(_panic) => {
                tracing::error!("the idempotent work of a batch panicked; rolled back");
                return Err(BatchFailed::Broken);
            }
        };
        for (scope, &ran) in scopes.iter().zip(&applied) {
            let logged = if ran {
                Logged::Executed
            } else {
                Logged::Replayed
            };
            super::span(&scope.scoped_key(), scope).in_scope(|| {
                tracing::info!(outcome = logged.as_str(), "idempotent request");
            });
            metrics::answered(logged);
        }
        Ok(applied)
    }

    async fn batch<F, Fut, E>(
        &self,
        scopes: &[Scope],
        fingerprint: Fingerprint,
        mut work: F,
    ) -> Result<Vec<bool>, BatchFailed<E>>
    where
        F: FnMut(usize, Tx<DB>) -> Fut,
        Fut: Future<Output = Result<(), E>>,
    {
        let wait = self.settings.wait;
        let mut tx = self
            .store
            .begin_keys(wait)
            .await
            .map_err(BatchFailed::Store)?;
        // Every key is claimed before any work runs, and in digest order: two batches that
        // share keys (a redelivery beside its original) then queue for them in one order, and
        // none holds a key another needs while its work takes business locks (the row of an
        // order two payments are for), which would deadlock the two and undo both.
        let keys: Vec<_> = scopes.iter().map(Scope::scoped_key).collect();
        let mut order: Vec<usize> = (0..scopes.len()).collect();
        order.sort_by(|&a, &b| keys[a].digest().cmp(keys[b].digest()));
        let mut applied = vec![false; scopes.len()];
        for index in order {
            let record = self.new_record(
                keys[index],
                &scopes[index],
                fingerprint,
                RecordState::Processing,
            );
            let started = Instant::now();
            let claimed = self.store.claim_key_in(&mut tx, &record, wait).await;
            let result = match &claimed {
                Ok(true) => ClaimResult::Claimed,
                Ok(false) => ClaimResult::Taken,
                Err(Error::Busy) => ClaimResult::Busy,
                Err(_) => ClaimResult::Failed,
            };
            metrics::claimed(result, started.elapsed());
            match claimed {
                Ok(ours) => applied[index] = ours,
                Err(error) => return Err(rolled_back(tx, BatchFailed::Store(error)).await),
            }
        }
        let mut after_commit = AfterCommit::default();
        for (index, scope) in scopes.iter().enumerate() {
            if !applied[index] {
                continue;
            }
            let slot = TxSlot::ready(tx);
            let done = match slot.clone().into_tx() {
                Ok(handed) => {
                    let span = super::span(&keys[index], scope);
                    work(index, handed).instrument(span).await
                }
                Err(_) => return Err(BatchFailed::Broken),
            };
            tx = match slot.take_back() {
                Ok(Some(tx)) => tx,
                _ => {
                    tracing::error!("a Tx was still held when the work returned; rolled back");
                    return Err(BatchFailed::Broken);
                }
            };
            if let Err(failure) = done {
                return Err(rolled_back(tx, BatchFailed::Work(failure)).await);
            }
            after_commit.append(slot.take_after_commit());
        }
        tx.commit().await.map_err(|error| {
            BatchFailed::Store(if is_conflict_abort(&error) {
                Error::Conflict
            } else {
                error.into()
            })
        })?;
        after_commit.run();
        Ok(applied)
    }
}

/// `failed`, once `tx` is rolled back: ended now rather than by its drop, so that its locks
/// are gone before the batch's deliveries are claimed again one by one. Its own failure
/// changes nothing; the database undoes an unfinished transaction either way.
async fn rolled_back<DB: Backend, E>(
    tx: sqlx::Transaction<'static, DB>,
    failed: BatchFailed<E>,
) -> BatchFailed<E> {
    let _ = tx.rollback().await;
    failed
}
