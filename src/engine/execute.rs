//! The work in the claim's transaction: run it, buffer and classify its response, then commit
//! the record with the work's writes, record a final refusal alone, or roll everything back.

use std::future::Future;
use std::time::{Duration, Instant};

use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http_body_util::{BodyExt, Limited};

use super::Engine;
use super::claim::Claim;
use super::metrics::{self, ClaimResult};
use super::outcome::{Answer, Classification, DeadLetter, Logged, Outcome};
use sqlx::Transaction;

use crate::Backend;
use crate::backoff::Backoff;
use crate::error::{Error, Rejection};
use crate::fingerprint::{Fingerprint, Verbatim};
use crate::record::RecordState;
use crate::scope::{IdempotencyContext, Scope, ScopedKey};
use crate::store::{NewRecord, Opened, Protocol, is_conflict_abort};
use crate::tx::{ConflictAborted, TxSlot};

impl<DB: Backend> Engine<DB> {
    pub(super) async fn execute<F, Fut, R>(
        &self,
        key: ScopedKey,
        scope: &Scope,
        fingerprint: Fingerprint,
        request: Option<Verbatim>,
        mut work: F,
    ) -> Answer
    where
        F: FnMut(TxSlot<DB>, IdempotencyContext) -> Fut,
        Fut: Future<Output = R>,
        R: IntoResponse,
    {
        // A key this instance has handled lately is likely a retry: one read answers it without
        // a transaction, on the connection that, for a key not yet taken, goes on to claim it.
        // Any other key is likely new and is claimed at once, saving the read (see `recent`).
        // Dedupe keys are never read back: there is no record to answer from.
        let (mut begun, expired) = if !self.settings.keys_only && self.settings.recent.saw(&key) {
            let started = Instant::now();
            let opened = self
                .store
                .protocol()
                .open(&key, self.store.clock().now(), self.settings.wait)
                .await;
            match opened {
                Ok(Opened::Live(record)) => {
                    return self.answer_stored(key, record, fingerprint, request);
                }
                Ok(Opened::Claimable { tx, expired }) => (Some(tx), expired),
                Err(Error::Busy | Error::Conflict) => {
                    // The claim transaction this read begins waited for the key's original.
                    metrics::claimed(ClaimResult::Busy, started.elapsed());
                    return Answer::in_flight();
                }
                Err(error) => return Answer::store_failed(error),
            }
        } else {
            (None, false)
        };
        let mut request = request;
        for attempt in 1..=CONFLICT_ATTEMPTS {
            if attempt > 1 {
                tokio::time::sleep(CONFLICT_BACKOFF.delay(attempt - 1)).await;
            }
            let attempted = self
                .attempt(
                    key,
                    scope,
                    fingerprint,
                    &mut request,
                    &mut work,
                    begun.take(),
                    expired,
                )
                .await;
            match attempted {
                Attempted::Answered(answer) => return answer,
                Attempted::Conflicted => {
                    tracing::debug!(
                        attempt,
                        "the transaction was aborted on a conflict; running it again"
                    );
                }
            }
        }
        tracing::warn!(
            attempts = CONFLICT_ATTEMPTS,
            "the transaction kept conflicting with concurrent ones; answered 503"
        );
        Answer::reject(Rejection::Conflict, Logged::Retryable)
    }

    /// One attempt: claim, run the work in the claim's transaction, and record its outcome; or
    /// learn that the database aborted the transaction on a conflict, leaving nothing behind.
    #[allow(clippy::too_many_arguments)]
    async fn attempt<F, Fut, R>(
        &self,
        key: ScopedKey,
        scope: &Scope,
        fingerprint: Fingerprint,
        request: &mut Option<Verbatim>,
        work: &mut F,
        begun: Option<Transaction<'static, DB>>,
        expired: bool,
    ) -> Attempted
    where
        F: FnMut(TxSlot<DB>, IdempotencyContext) -> Fut,
        Fut: Future<Output = R>,
        R: IntoResponse,
    {
        let record = self.new_record(key, scope, fingerprint, RecordState::Processing);
        let mut tx = match self.claim(&record, begun).await {
            Ok(Claim::Ours(tx)) => tx,
            Ok(Claim::Theirs(record)) => {
                return Attempted::Answered(self.answer_stored(
                    key,
                    record,
                    fingerprint,
                    request.take(),
                ));
            }
            Ok(Claim::Held) => return Attempted::Answered(held()),
            Err(rejection @ Rejection::InProgress { .. }) => {
                return Attempted::Answered(Answer::reject(rejection, Logged::InFlight));
            }
            Err(rejection) => {
                return Attempted::Answered(Answer::reject(rejection, Logged::Retryable));
            }
        };

        let slot = TxSlot::ready(tx);
        let context = IdempotencyContext::with_key(scope.clone(), key);
        let response = work(slot.clone(), context).await.into_response();
        let conflicted = response.extensions().get::<ConflictAborted>().is_some();
        let response = self.buffer(response).await;
        tx = match slot.take_back() {
            Ok(Some(tx)) => tx,
            Ok(None) | Err(_) => {
                tracing::error!("a Tx was still held when the work returned; rolled back");
                return Attempted::Answered(Answer::reject(
                    Rejection::TransactionHeld,
                    Logged::Retryable,
                ));
            }
        };
        if conflicted {
            // The database has already undone the transaction (or will at this rollback); its
            // failure changes nothing, the attempt is simply run again.
            let _ = tx.rollback().await;
            return Attempted::Conflicted;
        }
        let response = match response {
            Ok(response) => response,
            Err(rejection) => {
                return Attempted::Answered(Answer::reject(rejection, Logged::Retryable));
            }
        };

        let classification = match self.classification(response.status()) {
            // A dedupe key has no response to keep a refusal in.
            Classification::FailedPermanent if self.settings.keys_only => Classification::Retryable,
            classification => classification,
        };
        match classification {
            // The claim wrote the key's row: committing the work keeps it.
            Classification::Completed if self.settings.keys_only => {
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
            Classification::Completed => {
                let stored = self.storable(&response);
                let completed = NewRecord {
                    state: RecordState::Completed,
                    response: Some(&stored),
                    ..record
                };
                match self.store.protocol().commit_record(tx, &completed).await {
                    // Only now can others see the work's writes, so only now is it told.
                    Ok(()) => slot.take_after_commit().run(),
                    Err(Error::Conflict) => return Attempted::Conflicted,
                    Err(error) => return Attempted::Answered(Answer::store_failed(error)),
                }
                self.remember(&record, RecordState::Completed, &stored, request.take());
                let logged = if expired {
                    Logged::Expired
                } else {
                    Logged::Executed
                };
                Attempted::Answered(Answer::respond(response, Outcome::Executed, logged))
            }
            Classification::FailedPermanent => {
                // Undo the work's writes by ending its transaction, then record the refusal in
                // a fresh one. A duplicate that claimed in between ran the work itself; its
                // outcome is the key's outcome, and this request answers with it.
                if let Err(error) = tx.rollback().await {
                    return Attempted::Answered(Answer::store_failed(error));
                }
                let stored = self.storable(&response);
                let record = NewRecord {
                    response: Some(&stored),
                    ..self.new_record(key, scope, fingerprint, RecordState::FailedPermanent)
                };
                let answer = match self.claim(&record, None).await {
                    Ok(Claim::Ours(tx)) => {
                        match self.store.protocol().commit_record(tx, &record).await {
                            Ok(()) => {}
                            Err(Error::Conflict) => return Attempted::Conflicted,
                            Err(error) => return Attempted::Answered(Answer::store_failed(error)),
                        }
                        self.remember(
                            &record,
                            RecordState::FailedPermanent,
                            &stored,
                            request.take(),
                        );
                        Answer::respond(response, Outcome::Executed, Logged::FailedPermanent)
                    }
                    Ok(Claim::Theirs(record)) => {
                        self.answer_stored(key, record, fingerprint, request.take())
                    }
                    Ok(Claim::Held) => held(),
                    Err(rejection) => Answer::reject(rejection, Logged::Retryable),
                };
                Attempted::Answered(answer)
            }
            Classification::Retryable => {
                if let Err(error) = tx.rollback().await {
                    return Attempted::Answered(Answer::store_failed(error));
                }
                let logged = if response.extensions().get::<DeadLetter>().is_some() {
                    Logged::Dead
                } else {
                    Logged::Retryable
                };
                Attempted::Answered(Answer::respond(response, Outcome::RolledBack, logged))
            }
        }
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
pub(super) fn held() -> Answer {
    Answer::respond(
        http::Response::new(Bytes::new()),
        Outcome::Replayed,
        Logged::Replayed,
    )
}

/// How many times a transaction the database aborts on conflicts is run in all.
const CONFLICT_ATTEMPTS: u32 = 12;

/// The pause before running an aborted transaction again: jittered, so the transactions that
/// conflicted do not meet again at once, and short, since each has already waited for its
/// lock or its commit.
const CONFLICT_BACKOFF: Backoff =
    Backoff::exponential(Duration::from_millis(5), Duration::from_millis(400));

/// How one attempt ended.
enum Attempted {
    /// With the answer for the client.
    Answered(Answer),
    /// The database aborted its transaction on a conflict: nothing of it stands.
    Conflicted,
}
