//! The work in the claim's transaction: run it, buffer and classify its response, then commit
//! the record with the work's writes, record a final refusal alone, or roll everything back.

use std::future::Future;
use std::time::Instant;

use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http_body_util::{BodyExt, Limited};

use super::Engine;
use super::claim::Claim;
use super::metrics::{self, ClaimResult};
use super::outcome::{Answer, Classification, Logged, Outcome};
use crate::Backend;
use crate::error::{Error, Rejection};
use crate::fingerprint::{Fingerprint, Verbatim};
use crate::record::RecordState;
use crate::scope::{IdempotencyContext, Scope, ScopedKey};
use crate::store::{NewRecord, Opened, Protocol};
use crate::tx::TxSlot;

impl<DB: Backend> Engine<DB> {
    pub(super) async fn execute<F, Fut, R>(
        &self,
        key: ScopedKey,
        scope: &Scope,
        fingerprint: Fingerprint,
        request: Option<Verbatim>,
        work: F,
    ) -> Answer
    where
        F: FnOnce(TxSlot<DB>, IdempotencyContext) -> Fut,
        Fut: Future<Output = R>,
        R: IntoResponse,
    {
        // A key this instance has handled lately is likely a retry: one read answers it without
        // a transaction, on the connection that, for a key not yet taken, goes on to claim it.
        // Any other key is likely new and is claimed at once, saving the read (see `recent`).
        let (begun, expired) = if self.settings.recent.saw(&key) {
            let started = Instant::now();
            let opened = self
                .store
                .protocol()
                .open(&key, self.settings.clock.now(), self.settings.wait)
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
        let record = self.new_record(key, scope, fingerprint, RecordState::Processing);
        let mut tx = match self.claim(&record, begun).await {
            Ok(Claim::Ours(tx)) => tx,
            Ok(Claim::Theirs(record)) => {
                return self.answer_stored(key, record, fingerprint, request);
            }
            Err(rejection @ Rejection::InProgress { .. }) => {
                return Answer::reject(rejection, Logged::InFlight);
            }
            Err(rejection) => return Answer::reject(rejection, Logged::Retryable),
        };

        let slot = TxSlot::ready(tx);
        let context = IdempotencyContext::with_key(scope.clone(), key);
        let response = work(slot.clone(), context).await.into_response();
        let response = self.buffer(response).await;
        tx = match slot.take_back() {
            Ok(Some(tx)) => tx,
            Ok(None) | Err(_) => {
                tracing::error!("a Tx was still held when the work returned; rolled back");
                return Answer::reject(Rejection::TransactionHeld, Logged::Retryable);
            }
        };
        let response = match response {
            Ok(response) => response,
            Err(rejection) => return Answer::reject(rejection, Logged::Retryable),
        };

        match self.classification(response.status()) {
            Classification::Completed => {
                let stored = self.storable(&response);
                let committed = self.store.protocol().commit_finished(
                    tx,
                    &key,
                    RecordState::Completed,
                    &stored,
                );
                if let Err(error) = committed.await {
                    return Answer::store_failed(error);
                }
                self.remember(&record, RecordState::Completed, &stored, request);
                let logged = if expired {
                    Logged::Expired
                } else {
                    Logged::Executed
                };
                Answer::respond(response, Outcome::Executed, logged)
            }
            Classification::FailedPermanent => {
                // Undo the work's writes by ending its transaction, then record the refusal in
                // a fresh one. A duplicate that claimed in between ran the work itself; its
                // outcome is the key's outcome, and this request answers with it.
                if let Err(error) = tx.rollback().await {
                    return Answer::store_failed(error);
                }
                let stored = self.storable(&response);
                let record = NewRecord {
                    response: Some(&stored),
                    ..self.new_record(key, scope, fingerprint, RecordState::FailedPermanent)
                };
                match self.claim(&record, None).await {
                    Ok(Claim::Ours(tx)) => {
                        if let Err(error) = tx.commit().await {
                            return Answer::store_failed(error);
                        }
                        self.remember(&record, RecordState::FailedPermanent, &stored, request);
                        Answer::respond(response, Outcome::Executed, Logged::FailedPermanent)
                    }
                    Ok(Claim::Theirs(record)) => {
                        self.answer_stored(key, record, fingerprint, request)
                    }
                    Err(rejection) => Answer::reject(rejection, Logged::Retryable),
                }
            }
            Classification::Retryable => {
                if let Err(error) = tx.rollback().await {
                    return Answer::store_failed(error);
                }
                Answer::respond(response, Outcome::RolledBack, Logged::Retryable)
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
