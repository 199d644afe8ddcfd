//! Leases: a claim committed on its own, for work that cannot live inside one transaction.
//! Its holder renews it; once it runs out another caller may take over, asking a recovery hook
//! first whether the work in fact completed.

use std::future::Future;
use std::time::Duration;

use axum::response::{IntoResponse, Response};
use tokio::sync::watch;

use super::execute::held;
use super::outcome::{Answer, Classification, Execution, Logged, Outcome};
use super::{Engine, RunError};
use crate::Backend;
use crate::backend::Claimed;
use crate::backoff::random_u64;
use crate::clock::Millis;
use crate::error::{Error, Rejection};
use crate::fingerprint::Fingerprint;
use crate::record::{LeaseClaim, NewRecord, RecordState};
use crate::scope::{Scope, ScopedKey};

impl<DB: Backend> Engine<DB> {
    /// Runs `work` once for `scope` under a lease, for work that cannot live inside one
    /// transaction (a job calling other systems, a long reconciliation).
    ///
    /// The claim is committed as `processing` with a lease of `lease`, renewed every third of
    /// it while `work` runs; duplicates meanwhile get [`Rejection::InProgress`]. If the holder
    /// dies, its lease runs out and the next caller takes the claim over; before redoing the work
    /// it asks `recover` whether the work in fact completed (look the effect up downstream:
    /// querying beats a blind redo). `Some(response)` is recorded as the outcome without running
    /// `work`; `None` runs it. The outcome is recorded only while the lease is still held; a
    /// holder that lost its lease gets [`Rejection::LeaseLost`]. The work has no transaction
    /// of its own: what it does outside the database is its own to make safe.
    ///
    /// # Errors
    ///
    /// As for [`run`](Self::run), the [`RunError`] says why no outcome was recorded: the
    /// engine refused ([`RunError::Rejected`]: a live lease of another holder, a key holding
    /// another intent, a lost lease), the store failed ([`RunError::Store`]), or the work
    /// answered a retryable failure or panicked ([`RunError::Failed`], [`RunError::Panicked`]),
    /// and the lease was let go so the next caller runs it afresh.
    ///
    #[cfg_attr(feature = "sqlite", doc = "```")]
    #[cfg_attr(not(feature = "sqlite"), doc = "```ignore")]
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// use axum_idempotency::{Engine, Fingerprinter, Outcome, Scope, SqliteStore};
    ///
    /// let store = SqliteStore::new(sqlx::SqlitePool::connect("sqlite::memory:").await?);
    /// store.migrate().await?;
    /// let engine = Engine::new(store);
    /// let scope = Scope::new("reconciler", "RUN", "settle-day", "2026-12-01".parse()?);
    /// let fingerprint = Fingerprinter::new().fingerprint_value("settle-day", b"{}");
    ///
    /// let done = engine
    ///     .run_leased(
    ///         &scope,
    ///         fingerprint,
    ///         Duration::from_secs(30),
    ///         || async { None::<&'static str> }, // ask the bank whether the day was settled
    ///         |lease| async move {
    ///             assert!(!lease.is_lost());
    ///             "settled"
    ///         },
    ///     )
    ///     .await?;
    /// assert_eq!(done.outcome, Outcome::Executed);
    /// # Ok(()) }
    /// # tokio::runtime::Runtime::new().unwrap().block_on(run()).unwrap();
    /// ```
    pub async fn run_leased<C, CF, CR, W, WF, WR>(
        &self,
        scope: &Scope,
        fingerprint: Fingerprint,
        lease: Duration,
        recover: C,
        work: W,
    ) -> Result<Execution, RunError>
    where
        C: FnOnce() -> CF + Send + 'static,
        CF: Future<Output = Option<CR>> + Send,
        CR: IntoResponse,
        W: FnOnce(Lease) -> WF + Send + 'static,
        WF: Future<Output = WR> + Send,
        WR: IntoResponse,
    {
        let engine = self.clone();
        let answer: Answer = self
            .supervise(
                scope,
                fingerprint,
                move |key, scope, fingerprint| async move {
                    engine
                        .execute_leased(key, &scope, fingerprint, lease, recover, work)
                        .await
                },
            )
            .await;
        answer.result
    }

    async fn execute_leased<C, CF, CR, W, WF, WR>(
        &self,
        key: ScopedKey,
        scope: &Scope,
        fingerprint: Fingerprint,
        lease: Duration,
        recover: C,
        work: W,
    ) -> Answer
    where
        C: FnOnce() -> CF,
        CF: Future<Output = Option<CR>>,
        CR: IntoResponse,
        W: FnOnce(Lease) -> WF,
        WF: Future<Output = WR>,
        WR: IntoResponse,
    {
        let owner = lease_owner();
        let claim_at = move |now: Millis| LeaseClaim {
            owner,
            until: now.after(lease),
        };
        let taken_over = match self.take_lease(key, scope, fingerprint, claim_at).await {
            Ok(taken_over) => taken_over,
            Err(answer) => return answer,
        };

        let (lost_tx, lost_rx) = watch::channel(false);
        let _renewer = self.keep_renewed(key, lease, claim_at, lost_tx);
        let found = match taken_over {
            true => recover().await.map(IntoResponse::into_response),
            false => None,
        };
        let recovered = found.is_some();
        let response = match found {
            Some(found) => found,
            None => work(Lease { lost: lost_rx }).await.into_response(),
        };
        self.finish_lease(key, owner, response, recovered).await
    }

    /// Renews the lease every third of it until dropped; tells `lost` once a renewal fails.
    fn keep_renewed(
        &self,
        key: ScopedKey,
        lease: Duration,
        claim_at: impl Fn(Millis) -> LeaseClaim + Send + 'static,
        lost: watch::Sender<bool>,
    ) -> AbortOnDrop {
        let store = self.store.clone();
        let clock = self.store.clock().clone();
        AbortOnDrop(tokio::spawn(async move {
            let mut tick = tokio::time::interval((lease / 3).max(Duration::from_millis(10)));
            tick.tick().await;
            loop {
                tick.tick().await;
                if !matches!(
                    store.renew_lease(&key, claim_at(clock.now())).await,
                    Ok(true)
                ) {
                    let _ = lost.send(true);
                    return;
                }
            }
        }))
    }

    /// Records the leased work's response as the key's outcome while the lease is still
    /// `owner`'s, or lets the lease go for a retryable one.
    async fn finish_lease(
        &self,
        key: ScopedKey,
        owner: [u8; 16],
        response: Response,
        recovered: bool,
    ) -> Answer {
        let store = &self.store;
        let response = match self.buffer(response).await {
            Ok(response) => response,
            Err(rejection) => {
                let _ = store.release_lease(&key, owner).await;
                return Answer::reject(rejection, Logged::Retryable);
            }
        };
        let state = match self.classification(response.status()) {
            Classification::Completed => RecordState::Completed,
            Classification::FailedPermanent => RecordState::FailedPermanent,
            Classification::Retryable => {
                if let Err(error) = store.release_lease(&key, owner).await {
                    return Answer::store_failed(error);
                }
                // Leases serve jobs only: no client is there to be handed the failed answer.
                return Answer::reject(RunError::Failed(response), Logged::Retryable);
            }
        };
        let stored = self.storable(&response);
        match store.finish_leased(&key, owner, state, &stored).await {
            Ok(true) if recovered => {
                Answer::respond(response, Outcome::Recovered, Logged::Recovered)
            }
            Ok(true) => Answer::respond(response, Outcome::Executed, Logged::Executed),
            Ok(false) => Answer::reject(Rejection::LeaseLost, Logged::LeaseLost),
            Err(error) => Answer::store_failed(error),
        }
    }

    /// Claims `key` under a lease: a fresh claim committed as processing, or the takeover of a
    /// lease that ran out (`Ok(true)`). Any other state of the key is the answer itself.
    async fn take_lease(
        &self,
        key: ScopedKey,
        scope: &Scope,
        fingerprint: Fingerprint,
        claim_at: impl Fn(Millis) -> LeaseClaim,
    ) -> Result<bool, Answer> {
        let store = &self.store;
        let now = self.store.clock().now();
        match store.lookup(&key).await {
            Err(error) => Err(Answer::store_failed(error)),
            Ok(Some(record)) if !record.is_expired(now) => {
                let lease_ran_out = record.state == RecordState::Processing
                    && record.fingerprint == fingerprint
                    && record.lease_expires_at.is_some_and(|until| until <= now);
                if !lease_ran_out {
                    return Err(self.answer_stored(key, record, fingerprint, None));
                }
                match store.take_over_lease(&key, claim_at(now), now).await {
                    Ok(true) => Ok(true),
                    Ok(false) => Err(Answer::in_flight()),
                    Err(error) => Err(Answer::store_failed(error)),
                }
            }
            Ok(_) => {
                let record = NewRecord {
                    lease: Some(claim_at(now)),
                    ..self.new_record(key, scope, fingerprint, RecordState::Processing)
                };
                match self.claim(&record, None).await {
                    Ok(Claimed::Ours(tx)) => match store.commit_record(tx, &record).await {
                        Ok(()) => Ok(false),
                        // Another caller's claim committed first: it holds the lease now.
                        Err(Error::Conflict) => Err(Answer::in_flight()),
                        Err(error) => Err(Answer::store_failed(error)),
                    },
                    Ok(Claimed::Theirs(record)) => {
                        Err(self.answer_stored(key, record, fingerprint, None))
                    }
                    Ok(Claimed::Held) => Err(held()),
                    Err(rejection) => Err(Answer::reject(rejection, Logged::InFlight)),
                }
            }
        }
    }
}

/// Leased work is told through this when its lease was lost (another worker took over).
#[derive(Debug, Clone)]
pub struct Lease {
    lost: watch::Receiver<bool>,
}

impl Lease {
    /// Whether the lease was lost: the work should stop, its outcome will not be recorded.
    pub fn is_lost(&self) -> bool {
        *self.lost.borrow()
    }

    /// Resolves once the lease is lost, e.g. to `select!` against the work.
    pub async fn lost(&mut self) {
        let _ = self.lost.wait_for(|lost| *lost).await;
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// An id for one lease holder: 128 random bits, unique per call, not a secret. Drawn rather
/// than derived from the time, which a test's clock may hold still.
fn lease_owner() -> [u8; 16] {
    let mut owner = [0; 16];
    owner[..8].copy_from_slice(&random_u64().to_be_bytes());
    owner[8..].copy_from_slice(&random_u64().to_be_bytes());
    owner
}
