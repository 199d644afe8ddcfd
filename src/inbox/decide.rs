//! How the inbox reaches a delivery's verdict: its key claimed, its handler run in the claim's
//! transaction, and what becomes of a failure.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;

use super::failure::{Fate, fate, settled};
use super::{CONSUME, DEAD, Delivery, Failure, Inbox, LOG_TARGET, Verdict};
use crate::Backend;
use crate::backend::is_unreachable;
use crate::engine::{self, Answer, BatchFailed, Outcome, RunError};
use crate::error::{Error, Rejection};
use crate::tx::Tx;

impl<DB: Backend> Inbox<DB> {
    pub(super) async fn decide<F, Fut>(
        &self,
        delivery: &Delivery,
        mut handler: F,
        replay: bool,
    ) -> Verdict
    where
        F: FnMut(Tx<DB>, Delivery) -> Fut + Send + 'static,
        Fut: Future<Output = Result<(), Failure>> + Send + 'static,
    {
        let (key, scope) = match self.claimable(delivery) {
            Ok(claimable) => claimable,
            Err(failure) => return self.failed(delivery, None, failure, replay).await,
        };
        let message = delivery.clone();
        let (attempt, max_attempts) = (delivery.attempt(), self.max_attempts);
        let answer = self
            .engine
            .run_verdict(&scope, self.fingerprint(), move |tx| {
                let applied = handler(tx, message.clone());
                async move { verdict_of(applied.await, attempt, max_attempts, replay) }
            })
            .await;
        self.conclude(delivery, &key, answer, replay).await
    }

    /// The verdicts of several deliveries, in their order: those that can be claimed are
    /// applied in one transaction; if it commits nothing, each is decided alone.
    pub(super) async fn decide_batch<F, Fut>(
        &self,
        deliveries: &[Delivery],
        handler: F,
    ) -> Vec<Verdict>
    where
        F: FnMut(Tx<DB>, Delivery) -> Fut + Clone + Send + 'static,
        Fut: Future<Output = Result<(), Failure>> + Send + 'static,
    {
        let mut verdicts = Vec::with_capacity(deliveries.len());
        let (mut batched, mut scopes) = (Vec::new(), Vec::new());
        for (index, delivery) in deliveries.iter().enumerate() {
            match self.claimable(delivery) {
                Ok((_, scope)) => {
                    batched.push(index);
                    scopes.push(scope);
                    verdicts.push(None);
                }
                Err(failure) => {
                    verdicts.push(Some(self.failed(delivery, None, failure, false).await))
                }
            }
        }
        if batched.len() > 1 {
            let messages: Vec<Delivery> = batched.iter().map(|&i| deliveries[i].clone()).collect();
            let mut work = handler.clone();
            let batch = self
                .engine
                .run_batch(scopes, self.fingerprint(), move |index, tx| {
                    work(tx, messages[index].clone())
                })
                .await;
            match self
                .batch_verdicts(&deliveries[batched[0]], batched.len(), batch)
                .await
            {
                Some(batch) => {
                    for (&index, verdict) in batched.iter().zip(batch) {
                        verdicts[index] = Some(verdict);
                    }
                }
                None => tracing::debug!(
                    target: LOG_TARGET,
                    consumer = %self.name,
                    deliveries = batched.len(),
                    "inbox batch rolled back; its deliveries are applied one by one"
                ),
            }
        }
        let mut decided = Vec::with_capacity(deliveries.len());
        for (delivery, verdict) in deliveries.iter().zip(verdicts) {
            decided.push(match verdict {
                Some(verdict) => verdict,
                None => self.decide(delivery, handler.clone(), false).await,
            });
        }
        decided
    }

    /// The verdicts of a batch that committed, or of one that met an outage: each of its
    /// deliveries waits the outage out, with one pause for them all. `None` when its deliveries
    /// must each be decided alone to learn which failed, and how.
    async fn batch_verdicts(
        &self,
        first: &Delivery,
        count: usize,
        batch: Result<Vec<bool>, BatchFailed<Failure>>,
    ) -> Option<Vec<Verdict>> {
        let outage = match batch {
            Ok(applied) => {
                let verdict = |ran| {
                    if ran {
                        Verdict::Applied
                    } else {
                        Verdict::Duplicate
                    }
                };
                return Some(applied.into_iter().map(verdict).collect());
            }
            Err(BatchFailed::Work(failure @ Failure::Unavailable(_))) => failure,
            // Where the database has one write lock, a batch that waited past the bound for it
            // met another writer holding the whole database, as each delivery alone would;
            // elsewhere, a key still in flight, whose delivery alone learns what to do.
            Err(BatchFailed::Store(Error::Busy)) => {
                match waited_out(DB::ONE_WRITE_LOCK, Duration::ZERO) {
                    Err(failure) => failure,
                    Ok(_) => return None,
                }
            }
            Err(BatchFailed::Store(Error::Database(error))) if is_unreachable(&error) => {
                self.not_applied(RunError::Store(Error::Database(error)))
            }
            // A statement or the commit refused: which delivery's doing it was, only each
            // alone can tell.
            Err(BatchFailed::Store(_) | BatchFailed::Work(_) | BatchFailed::Broken) => {
                return None;
            }
        };
        Some(vec![self.failed(first, None, outage, false).await; count])
    }

    /// The delivery's business key and the scope it is claimed under.
    fn claimable(&self, delivery: &Delivery) -> Result<(String, crate::Scope), Failure> {
        let key = (self.key)(delivery)?;
        let scope = self.scope(CONSUME, &key)?;
        Ok((key, scope))
    }

    /// The verdict for the engine's answer: the handler's failure came back with it, typed.
    async fn conclude(
        &self,
        delivery: &Delivery,
        key: &str,
        answer: Answer<Failure>,
        replay: bool,
    ) -> Verdict {
        let failure = match (answer.result, answer.failure) {
            (Ok(execution), _) if execution.outcome == Outcome::Replayed => {
                return Verdict::Duplicate;
            }
            // The handler failed and its work was rolled back.
            (_, Some(failure)) => failure,
            (Ok(_), None) => return Verdict::Applied,
            (Err(RunError::Rejected(Rejection::InProgress { retry_after })), _) => {
                match waited_out(DB::ONE_WRITE_LOCK, retry_after) {
                    Ok(verdict) => return verdict,
                    Err(failure) => failure,
                }
            }
            (Err(error), _) => self.not_applied(error),
        };
        self.failed(delivery, Some(key), failure, replay).await
    }

    /// The failure of a delivery the engine could not apply.
    fn not_applied(&self, error: RunError) -> Failure {
        let (failure, rejection) = failure_of(error);
        tracing::warn!(target: LOG_TARGET, consumer = %self.name, error = %rejection, "inbox could not apply a delivery");
        failure
    }

    pub(super) async fn failed(
        &self,
        delivery: &Delivery,
        key: Option<&str>,
        failure: Failure,
        replay: bool,
    ) -> Verdict {
        let attempt = delivery.attempt();
        match settled(failure, attempt, self.max_attempts, replay) {
            (Fate::Pause, Failure::Unavailable(reason)) => {
                let outages = self.counters.outage();
                let after = self.outage_backoff.delay(outages.saturating_add(1));
                tracing::warn!(
                    target: LOG_TARGET,
                    consumer = %self.name,
                    message_id = delivery.message_id(),
                    reason = %reason,
                    pause_ms = u64::try_from(after.as_millis()).unwrap_or(u64::MAX),
                    "inbox paused: the consumer's database or a dependency is unreachable; \
                     the delivery comes back without counting an attempt"
                );
                Verdict::Unavailable { after, reason }
            }
            (Fate::Dead, Failure::Permanent(reason)) => self.dead(delivery, key, reason).await,
            (Fate::Dead, failure) => {
                let reason = format!("{} (attempt {attempt})", failure.reason());
                self.dead(delivery, key, reason).await
            }
            _ => Verdict::Retry {
                after: self.backoff.delay(attempt),
            },
        }
    }

    /// Records the failure through the engine, in its own transaction and a scope of its own,
    /// logs it, then tells the adapter to dead-letter the delivery.
    async fn dead(&self, delivery: &Delivery, key: Option<&str>, reason: String) -> Verdict {
        if let Some(Ok(scope)) = key.map(|key| self.scope(DEAD, key)) {
            let note = Bytes::from(reason.clone());
            let recorded: Answer = self
                .failures
                .run_verdict(&scope, self.fingerprint(), move |_tx: Tx<DB>| {
                    let note = note.clone();
                    async move { engine::Verdict::Refuse(refusal(note)) }
                })
                .await;
            if let Err(error) = recorded.result {
                // The dead letter is still written: losing the note beats looping on it.
                let error = error.into_rejection();
                tracing::warn!(target: LOG_TARGET, consumer = %self.name, %error, "could not record an inbox failure");
            }
        }
        // Operators look for why here or in the dead letter's header; the payload (and the
        // business key, read from it) may hold personal data and stay out of the log.
        tracing::warn!(
            target: LOG_TARGET,
            consumer = %self.name,
            message_id = delivery.message_id(),
            attempt = delivery.attempt(),
            reason = %reason,
            "inbox dead-lettered a delivery"
        );
        Verdict::Dead { reason }
    }
}

/// The failure of a delivery the engine could not apply, and the rejection it logs: a store
/// that failed before, around or after the handler is the consumer's database out of reach.
pub(crate) fn failure_of(error: RunError) -> (Failure, Rejection) {
    let panicked = matches!(error, RunError::Panicked);
    let store_failed = matches!(error, RunError::Store(_));
    let rejection = error.into_rejection();
    let failure = match rejection {
        // A bug, which attempts bound like any failure.
        _ if panicked => {
            Failure::retryable(format!("not applied, the handler panicked: {rejection}"))
        }
        // A claim, a commit or a rollback that could not reach the database: the consumer's
        // own database is out, which is no fault of the delivery.
        _ if store_failed => Failure::unavailable(format!("not applied: {rejection}")),
        Rejection::Internal => Failure::unavailable(format!("not applied: {rejection}")),
        Rejection::Conflict => Failure::Conflict(format!("not applied: {rejection}")),
        _ => Failure::retryable(format!("not applied: {rejection}")),
    };
    (failure, rejection)
}

/// What a claim that waited past the inbox's wait for the key means. Where the database has
/// one write lock (SQLite), another writer (a stuck process, a backup) holds the whole
/// database, which no delivery can get past: an outage. Elsewhere another delivery of the key
/// still holds its claim: come back later and find its outcome, rather than run the handler
/// beside it.
pub(crate) fn waited_out(one_write_lock: bool, retry_after: Duration) -> Result<Verdict, Failure> {
    if one_write_lock {
        return Err(Failure::unavailable(
            "not applied: another writer held the database's write lock past the wait",
        ));
    }
    Ok(Verdict::Retry { after: retry_after })
}

/// What the engine does with the transaction of one call of the handler.
pub(crate) fn verdict_of(
    applied: Result<(), Failure>,
    attempt: u32,
    max_attempts: u32,
    replay: bool,
) -> engine::Verdict<Failure> {
    let failure = match applied {
        // The claim keeps the key alone: there is no response to store.
        Ok(()) => return engine::Verdict::Commit(http::Response::default()),
        Err(failure) => failure,
    };
    match fate(&failure, attempt, max_attempts, replay) {
        // A conflict abort: the engine runs the handler again, as it does for a request under
        // the layer.
        Fate::Rerun => engine::Verdict::Conflict,
        // Rolled back like any failure; a dead one is logged and counted as `dead`, since it
        // will not come back as a retry.
        fate => engine::Verdict::RollBack {
            response: http::Response::default(),
            failure,
            dead: fate == Fate::Dead,
        },
    }
}

/// A dead letter's note as the engine stores it: a record holds a response, so the note is
/// the body of a final refusal. Nothing is decided from its status.
fn refusal(note: Bytes) -> http::Response<Bytes> {
    let mut response = http::Response::new(note);
    *response.status_mut() = StatusCode::UNPROCESSABLE_ENTITY;
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_store_that_failed_is_an_outage_and_a_spent_conflict_a_conflict() {
        let store = RunError::Store(Error::Database(sqlx::Error::PoolTimedOut));
        assert!(matches!(failure_of(store).0, Failure::Unavailable(_)));
        let conflict = RunError::Rejected(Rejection::Conflict);
        assert!(matches!(failure_of(conflict).0, Failure::Conflict(_)));
        assert!(matches!(
            failure_of(RunError::Panicked).0,
            Failure::Retryable(_)
        ));
    }
}
