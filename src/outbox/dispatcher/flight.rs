//! All of a message's I/O, from its claim to its recorded outcome: the claim that leases it,
//! its lookup and its send through the [`Sender`], and the writes that begin its attempt, renew
//! its lease, give it back and settle it. What each step leads to is decided in
//! [`decide`](super::decide); when each runs, in [`Window`](super::window::Window).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::decide::{self, Attempted, Policy, Step};
use super::metrics;
use crate::Backend;
use crate::backend::{Claim, ClaimedMessage as Claimed, Lease, Settlement, Topics};
use crate::backoff::random_u64;
use crate::clock::Millis;
use crate::outbox::store::check;
use crate::outbox::wake::Settling;
use crate::outbox::{
    Error, LookupOutcome, Message, MessageId, Outbox, OutboxRecord, SendOutcome, Sender,
};
use crate::tx::AfterCommit;

/// What a write reports: the messages whose lease it still found.
pub(super) type Written = Result<Vec<MessageId>, sqlx::Error>;
/// What a send ends with: the outcome to record, `None` when the lease was lost before it.
pub(super) type Sent = Result<Option<Finished>, sqlx::Error>;

/// A message's outcome, and the follow-ups a delivery enqueues in the transaction that records
/// it (see [`Sender::follow_ups`]).
pub(super) struct Finished {
    pub(super) attempted: Attempted,
    pub(super) follow_ups: Vec<Message>,
}

impl From<Attempted> for Finished {
    fn from(attempted: Attempted) -> Self {
        Self {
            attempted,
            follow_ups: Vec::new(),
        }
    }
}

/// The outbox and the sender a dispatcher works with, and how its calls are bounded.
pub(crate) struct Flight<DB: Backend, S> {
    pub(super) outbox: Outbox<DB>,
    sender: Arc<S>,
    pub(super) policy: Policy,
    pub(super) send_timeout: Duration,
    pub(super) lease: Duration,
}

impl<DB: Backend, S: Sender> Flight<DB, S> {
    pub(super) fn new(outbox: Outbox<DB>, sender: S, policy: Policy) -> Self {
        Self {
            outbox,
            sender: Arc::new(sender),
            policy,
            send_timeout: Duration::from_secs(30),
            lease: Duration::from_secs(15),
        }
    }

    /// The sender's signal that its client reconnected, if it has one.
    pub(super) fn reconnected(&self) -> Option<watch::Receiver<u64>> {
        self.sender.reconnected().map(|signal| signal.subscribe())
    }

    /// How often the leases held are renewed: every third of a lease, so a renewal that is
    /// late or fails once still comes before the lease runs out.
    pub(super) fn renewal_interval(&self) -> Duration {
        self.lease / 3
    }

    /// The time by the outbox's clock: every decision about a message is made at it.
    pub(super) fn now(&self) -> Millis {
        self.outbox.now()
    }

    /// When a lease taken or renewed at `now` runs out.
    pub(super) fn lease_until(&self, now: Millis) -> Millis {
        now.after(self.lease)
    }

    /// Leases up to `limit` due messages of `topics`, beginning the attempts of those sent
    /// now; `probe` asks whether anything is due first, where that is cheaper than a claim
    /// finding nothing.
    pub(super) async fn claim(
        &self,
        limit: usize,
        probe: bool,
        topics: &Topics,
    ) -> (Claim, Result<Vec<Claimed>, sqlx::Error>) {
        let now = self.now();
        let claim = Claim {
            now,
            lease_until: self.lease_until(now),
            token: lease_token(),
            limit: i64::try_from(limit).unwrap_or(i64::MAX),
            max_attempts: i64::from(self.policy.max_attempts),
            probe,
        };
        let _turn = self.outbox.write_turn().await;
        DB::claim_due(self.outbox.pool(), self.outbox.clock(), claim, topics).await
    }

    /// Takes a claimed message through what it needs (a lookup, a send, or failing for good)
    /// and returns the outcome to record; `None` when the lease was lost before sending.
    pub(super) async fn deliver(&self, claimed: Claimed, token: i64) -> Sent {
        let Claimed {
            mut record,
            attempt_begun,
        } = claimed;
        let mut looked_up = false;
        loop {
            let now = self.now();
            match decide::before_send(&self.policy, &record, attempt_begun, looked_up, now) {
                Step::LookUp => {
                    looked_up = true;
                    if let Some(finished) = self.look_up(&record).await {
                        return Ok(Some(finished));
                    }
                }
                Step::GiveUp(attempted) => return Ok(Some(report(&record, attempted).into())),
                Step::BeginAttempt => {
                    if !self.begin_attempt(record.id, token, now).await? {
                        tracing::warn!(message = %record.id, "outbox lease lost before sending");
                        return Ok(None);
                    }
                    record.attempts += 1;
                    record.outcome_unknown = true;
                    break;
                }
                Step::Send => break,
            }
        }
        Ok(Some(self.send(record).await))
    }

    /// Sends a message whose attempt is counted, and decides what its outcome makes of it.
    async fn send(&self, mut record: OutboxRecord) -> Finished {
        // A message claimed ahead of a free send slot waited after its claim began the
        // attempt; the attempt starts now, and its outcome records so.
        let started = self.now();
        record.last_attempt_at = Some(started.into());
        let mut outcome = self
            .bounded(self.sender.send(&record))
            .await
            .unwrap_or_else(|| SendOutcome::Unknown {
                reason: format!("no answer within {:?}", self.send_timeout),
            });
        let mut follow_ups = Vec::new();
        if let SendOutcome::Delivered { receipt } = &outcome {
            match self.follow_ups(&record, receipt) {
                Ok(made) => follow_ups = made,
                Err(reason) => outcome = SendOutcome::Unknown { reason },
            }
        }
        let mut attempted = decide::settle_outcome(&self.policy, &record, outcome, self.now());
        attempted.settlement.last_attempt_at = Some(started);
        Finished {
            attempted: report(&record, attempted),
            follow_ups,
        }
    }

    /// Asks the downstream about a message whose last outcome is unknown; the outcome to
    /// record, or `None` when the message is to be sent again.
    async fn look_up(&self, record: &OutboxRecord) -> Option<Finished> {
        let mut found = self.bounded(self.sender.lookup(record)).await;
        let mut follow_ups = Vec::new();
        if let Some(LookupOutcome::Found { receipt }) = &found {
            tracing::info!(
                id = record.id.get(),
                topic = %record.topic,
                attempts = record.attempts,
                "outbox message found delivered by a lookup; not resent"
            );
            match self.follow_ups(record, receipt) {
                Ok(made) => follow_ups = made,
                Err(reason) => found = Some(LookupOutcome::Failed { reason }),
            }
        }
        let settlement = decide::after_lookup(&self.policy, record, found, self.now())?;
        Some(Finished {
            attempted: settlement.into(),
            follow_ups,
        })
    }

    /// The follow-ups of a delivered message, each valid to enqueue; the reason to leave its
    /// outcome unknown when the sender could not make them.
    fn follow_ups(&self, record: &OutboxRecord, receipt: &str) -> Result<Vec<Message>, String> {
        let made = self
            .sender
            .follow_ups(record, receipt)
            .map_err(|error| format!("delivered; follow-ups not made: {error}"))?;
        if let Some(error) = made.iter().find_map(|message| check(message).err()) {
            return Err(format!("delivered; follow-up not valid: {error}"));
        }
        Ok(made)
    }

    /// Counts an attempt under the lease `token`; `false` when the lease was lost.
    async fn begin_attempt(
        &self,
        id: MessageId,
        token: i64,
        now: Millis,
    ) -> Result<bool, sqlx::Error> {
        let _turn = self.outbox.write_turn().await;
        DB::begin_attempt(self.outbox.pool(), id, token, now).await
    }

    /// Records the outcomes of the messages leased as given, and enqueues the follow-ups of
    /// those delivered in the same transaction.
    pub(super) async fn settle(
        &self,
        outcomes: &[(Lease, Settlement)],
        follow_ups: Vec<Message>,
    ) -> Written {
        let _turn = self.outbox.write_turn().await;
        let pool = self.outbox.pool();
        if follow_ups.is_empty() {
            return DB::settle(&mut *pool.acquire().await?, outcomes).await;
        }
        let mut tx = pool.begin().await?;
        let settled = DB::settle(&mut tx, outcomes).await?;
        // Enqueued whether or not the settle still found the lease: the delivery happened, and
        // the holder that took the message over makes the same follow-ups, which add nothing.
        let mut after_commit = AfterCommit::default();
        for message in follow_ups {
            let settling = Settling {
                tx: &mut tx,
                after_commit: &mut after_commit,
            };
            match self.outbox.enqueue(settling, message).await {
                Ok(_) => {}
                Err(Error::Database(error)) => return Err(error),
                // Made again by a later finding of the same delivery, with another payload:
                // the first one was enqueued, and is the one that goes.
                Err(error) => tracing::warn!(%error, "outbox follow-up not enqueued"),
            }
        }
        tx.commit().await?;
        after_commit.run();
        Ok(settled)
    }

    /// Extends `leases` until `until`.
    pub(super) async fn renew(&self, leases: &[Lease], until: Millis) -> Written {
        let _turn = self.outbox.write_turn().await;
        DB::renew_leases(self.outbox.pool(), leases, until).await
    }

    /// Gives back messages whose claim began an attempt never made, the attempt not counted.
    pub(super) async fn release_unsent(&self, leases: &[Lease]) -> Written {
        let _turn = self.outbox.write_turn().await;
        DB::release_unsent(self.outbox.pool(), leases).await
    }

    async fn bounded<T>(&self, call: impl Future<Output = T>) -> Option<T> {
        tokio::time::timeout(self.send_timeout, call).await.ok()
    }
}

/// A new lease's token, fencing what its holder writes. Any bit pattern is a token: all 64
/// random bits are kept, the sign included.
pub(super) fn lease_token() -> i64 {
    i64::from_ne_bytes(random_u64().to_ne_bytes())
}

/// A message that failed for good is logged at `ERROR` and counted, so that an operator hears
/// of every message that needs a decision.
fn report(record: &OutboxRecord, attempted: Attempted) -> Attempted {
    if let Some(why) = attempted.gave_up {
        let settlement = &attempted.settlement;
        tracing::error!(
            message = %record.id,
            topic = %record.topic,
            attempts = settlement.attempts,
            reason = %settlement.last_error.as_deref().unwrap_or_default(),
            "outbox message failed for good; requeue it once the cause is fixed"
        );
        metrics::failed(why);
    }
    attempted
}
