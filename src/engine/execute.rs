//! The work in the claim's transaction: run it, then, as its verdict says, commit the record
//! with the work's writes, record a final refusal alone, or roll everything back.

use std::future::Future;
use std::time::{Duration, Instant};

use axum::response::Response;
use bytes::Bytes;
use http_body_util::{BodyExt, Limited};

use super::metrics::{self, ClaimResult};
use super::outcome::{Answer, Logged, Outcome};
use super::{Engine, RunError, Verdict, decide};
use sqlx::Transaction;

use crate::Backend;
use crate::backend::{Claimed, is_conflict_abort};
use crate::backoff::Backoff;
use crate::error::{Error, Rejection};
use crate::fingerprint::{Fingerprint, Verbatim};
use crate::record::{NewRecord, RecordState};
use crate::scope::{IdempotencyContext, Scope, ScopedKey};
use crate::store::Opened;
use crate::tx::TxSlot;

/// One intent as the engine attempts it: what it claims and records under, and what it has
/// learned of the key so far.
pub(super) struct Attempt<'a> {
    key: ScopedKey,
    scope: &'a Scope,
    fingerprint: Fingerprint,
    /// The request as sent, kept with its record in the replay cache (taken once kept).
    request: Option<Verbatim>,
    /// The key's earlier record had expired: the intent is logged as `expired`.
    expired: bool,
}

impl<'a> Attempt<'a> {
    pub(super) fn new(
        key: ScopedKey,
        scope: &'a Scope,
        fingerprint: Fingerprint,
        request: Option<Verbatim>,
    ) -> Self {
        Self {
            key,
            scope,
            fingerprint,
            request,
            expired: false,
        }
    }
}

impl<DB: Backend> Engine<DB> {
    /// Claims, runs the work and records its verdict, running it again while the database
    /// aborts its transaction on conflicts.
    pub(super) async fn execute<F, Fut, E>(
        &self,
        mut attempt: Attempt<'_>,
        mut work: F,
    ) -> Answer<E>
    where
        F: FnMut(TxSlot<DB>, IdempotencyContext) -> Fut,
        Fut: Future<Output = Verdict<E>>,
    {
        let mut begun = match self.open_recent(&mut attempt).await {
            Ok(begun) => begun,
            Err(answer) => return answer,
        };
        let mut round = 1;
        loop {
            match self.attempt(&mut attempt, &mut work, begun.take()).await {
                Attempted::Answered(answer) => return answer,
                Attempted::Conflicted if decide::run_again(round) => {
                    tracing::debug!(
                        attempt = round,
                        "the transaction was aborted on a conflict; running it again"
                    );
                }
                Attempted::Conflicted => break,
            }
            tokio::time::sleep(CONFLICT_BACKOFF.delay(round)).await;
            round += 1;
        }
        tracing::warn!(
            attempts = decide::CONFLICT_ATTEMPTS,
            "the transaction kept conflicting with concurrent ones; answered 503"
        );
        Answer::reject(Rejection::Conflict, Logged::Retryable)
    }

    /// A key this instance has handled lately is likely a retry: one read answers it without
    /// a transaction, on the connection that, for a key not yet taken, goes on to claim it
    /// (the transaction returned). Any other key is likely new and is claimed at once, saving
    /// the read (see `recent`). Dedupe keys are never read back: there is no record to answer
    /// from.
    async fn open_recent<E>(
        &self,
        attempt: &mut Attempt<'_>,
    ) -> Result<Option<Transaction<'static, DB>>, Answer<E>> {
        if self.settings.keys_only || !self.settings.recent.saw(&attempt.key) {
            return Ok(None);
        }
        let started = Instant::now();
        let opened = self
            .store
            .open(&attempt.key, self.store.clock().now(), self.settings.wait)
            .await;
        match opened {
            Ok(Opened::Live(record)) => Err(self.answer_stored(
                attempt.key,
                record,
                attempt.fingerprint,
                attempt.request.take(),
            )),
            Ok(Opened::Claimable { tx, expired }) => {
                attempt.expired = expired;
                Ok(Some(tx))
            }
            Err(Error::Busy | Error::Conflict) => {
                // The claim transaction this read begins waited for the key's original.
                metrics::claimed(ClaimResult::Busy, started.elapsed());
                Err(Answer::in_flight())
            }
            Err(error) => Err(Answer::store_failed(error)),
        }
    }

    /// One attempt: claim, run the work in the claim's transaction, and settle its verdict; or
    /// learn that the database aborted the transaction on a conflict, leaving nothing behind.
    async fn attempt<F, Fut, E>(
        &self,
        attempt: &mut Attempt<'_>,
        work: &mut F,
        begun: Option<Transaction<'static, DB>>,
    ) -> Attempted<E>
    where
        F: FnMut(TxSlot<DB>, IdempotencyContext) -> Fut,
        Fut: Future<Output = Verdict<E>>,
    {
        let (key, fingerprint) = (attempt.key, attempt.fingerprint);
        let record = self.new_record(key, attempt.scope, fingerprint, RecordState::Processing);
        let tx = match self.claim(&record, begun).await {
            Ok(Claimed::Ours(tx)) => tx,
            Ok(Claimed::Theirs(record)) => {
                let request = attempt.request.take();
                return Attempted::Answered(self.answer_stored(key, record, fingerprint, request));
            }
            Ok(Claimed::Held) => return Attempted::Answered(held()),
            Err(error @ RunError::Rejected(Rejection::InProgress { .. })) => {
                return Attempted::Answered(Answer::reject(error, Logged::InFlight));
            }
            Err(error) => return Attempted::Answered(Answer::reject(error, Logged::Retryable)),
        };

        let slot = TxSlot::ready(tx);
        let context = IdempotencyContext::with_key(attempt.scope.clone(), key);
        let verdict = work(slot.clone(), context).await;
        let Ok(Some(tx)) = slot.take_back() else {
            tracing::error!("a Tx was still held when the work returned; rolled back");
            return Attempted::Answered(Answer::reject(
                Rejection::TransactionHeld,
                Logged::Retryable,
            ));
        };
        self.settle(attempt, &record, tx, &slot, verdict).await
    }

    /// Ends the claim's transaction as the work's verdict says, and records the outcome.
    async fn settle<E>(
        &self,
        attempt: &mut Attempt<'_>,
        record: &NewRecord<'_>,
        tx: Transaction<'static, DB>,
        slot: &TxSlot<DB>,
        verdict: Verdict<E>,
    ) -> Attempted<E> {
        match verdict {
            Verdict::Conflict => {
                // The database has already undone the transaction (or will at this rollback);
                // its failure changes nothing, the attempt is simply run again.
                let _ = tx.rollback().await;
                Attempted::Conflicted
            }
            Verdict::Abandon(rejection) => {
                Attempted::Answered(Answer::reject(rejection, Logged::Retryable))
            }
            // The claim wrote the key's row: committing the work keeps it.
            Verdict::Commit(response) if self.settings.keys_only => {
                self.commit_key(tx, slot, response).await
            }
            Verdict::Commit(response) => self.commit(attempt, record, tx, slot, response).await,
            Verdict::Refuse(response) => self.refuse(attempt, tx, response).await,
            Verdict::RollBack {
                response,
                failure,
                dead,
            } => {
                if let Err(error) = tx.rollback().await {
                    return Attempted::Answered(Answer::store_failed(error));
                }
                let logged = if dead {
                    Logged::Dead
                } else {
                    Logged::Retryable
                };
                Attempted::Answered(Answer::rolled_back(response, failure, logged))
            }
        }
    }

    /// Commits the claim of a dedupe key with the work's writes.
    async fn commit_key<E>(
        &self,
        tx: Transaction<'static, DB>,
        slot: &TxSlot<DB>,
        response: http::Response<Bytes>,
    ) -> Attempted<E> {
        match tx.commit().await {
            Ok(()) => slot.take_after_commit().run(),
            Err(error) if is_conflict_abort(&error) => return Attempted::Conflicted,
            Err(error) => return Attempted::Answered(Answer::store_failed(error)),
        }
        Attempted::Answered(Answer::respond(
            response,
            Outcome::Executed,
            Logged::Executed,
        ))
    }

    /// Writes the completed record, response and all, and commits it with the work's writes.
    async fn commit<E>(
        &self,
        attempt: &mut Attempt<'_>,
        record: &NewRecord<'_>,
        tx: Transaction<'static, DB>,
        slot: &TxSlot<DB>,
        response: http::Response<Bytes>,
    ) -> Attempted<E> {
        let stored = self.storable(&response);
        let completed = NewRecord {
            state: RecordState::Completed,
            response: Some(&stored),
            ..*record
        };
        match self.store.commit_record(tx, &completed).await {
            // Only now can others see the work's writes, so only now is it told.
            Ok(()) => slot.take_after_commit().run(),
            Err(Error::Conflict) => return Attempted::Conflicted,
            Err(error) => return Attempted::Answered(Answer::store_failed(error)),
        }
        self.remember(
            record,
            RecordState::Completed,
            &stored,
            attempt.request.take(),
        );
        let logged = if attempt.expired {
            Logged::Expired
        } else {
            Logged::Executed
        };
        Attempted::Answered(Answer::respond(response, Outcome::Executed, logged))
    }

    /// Undoes the work's writes by ending its transaction, then records the refusal in a fresh
    /// one. A duplicate that claimed in between ran the work itself; its outcome is the key's
    /// outcome, and this intent answers with it.
    async fn refuse<E>(
        &self,
        attempt: &mut Attempt<'_>,
        tx: Transaction<'static, DB>,
        response: http::Response<Bytes>,
    ) -> Attempted<E> {
        if let Err(error) = tx.rollback().await {
            return Attempted::Answered(Answer::store_failed(error));
        }
        let (key, fingerprint) = (attempt.key, attempt.fingerprint);
        let stored = self.storable(&response);
        let record = NewRecord {
            response: Some(&stored),
            ..self.new_record(
                key,
                attempt.scope,
                fingerprint,
                RecordState::FailedPermanent,
            )
        };
        let answer = match self.claim(&record, None).await {
            Ok(Claimed::Ours(tx)) => {
                match self.store.commit_record(tx, &record).await {
                    Ok(()) => {}
                    Err(Error::Conflict) => return Attempted::Conflicted,
                    Err(error) => return Attempted::Answered(Answer::store_failed(error)),
                }
                let request = attempt.request.take();
                self.remember(&record, RecordState::FailedPermanent, &stored, request);
                Answer::respond(response, Outcome::Executed, Logged::FailedPermanent)
            }
            Ok(Claimed::Theirs(record)) => {
                self.answer_stored(key, record, fingerprint, attempt.request.take())
            }
            Ok(Claimed::Held) => held(),
            Err(error) => Answer::reject(error, Logged::Retryable),
        };
        Attempted::Answered(answer)
    }

    /// Reads the work's response body into memory, up to the largest body stored for replay.
    /// A larger (or unreadable) body cannot be replayed faithfully, so the work is answered as
    /// retryable and rolled back.
    pub(super) async fn buffer(
        &self,
        response: Response,
    ) -> Result<http::Response<Bytes>, Rejection> {
        let (parts, body) = response.into_parts();
        match Limited::new(body, self.settings.max_response_body)
            .collect()
            .await
        {
            Ok(collected) => Ok(http::Response::from_parts(parts, collected.to_bytes())),
            Err(error) => {
                tracing::warn!(%error, limit = self.settings.max_response_body,
                    "response body too large to store or unreadable; rolled back");
                Err(Rejection::ResponseTooLarge)
            }
        }
    }
}

/// The answer for a key a live dedupe key holds: replayed, with nothing stored to replay.
pub(super) fn held<E>() -> Answer<E> {
    Answer::respond(
        http::Response::new(Bytes::new()),
        Outcome::Replayed,
        Logged::Replayed,
    )
}

/// The pause before running an aborted transaction again: jittered, so the transactions that
/// conflicted do not meet again at once, and short, since each has already waited for its
/// lock or its commit.
const CONFLICT_BACKOFF: Backoff =
    Backoff::exponential(Duration::from_millis(5), Duration::from_millis(400));

/// How one attempt ended.
enum Attempted<E> {
    /// With the answer for the client.
    Answered(Answer<E>),
    /// The database aborted its transaction on a conflict: nothing of it stands.
    Conflicted,
}
