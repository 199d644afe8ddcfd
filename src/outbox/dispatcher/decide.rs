//! What the dispatcher decides about a message, apart from doing it: whether a claimed message
//! is looked up, sent or failed for good, what a send's or a lookup's outcome makes of it, and
//! when an unavailable destination is probed next.
//!
//! Plain functions over a message's record, an outcome and the time, which is passed in: no
//! I/O and no clock reads, so that they can be tested, and explored, without a database. The
//! only draw is the backoffs' jitter.

use std::time::{Duration, UNIX_EPOCH};

use crate::backend::{ClaimedMessage as Claimed, Settlement};
use crate::backoff::Backoff;
use crate::clock::Millis;
use crate::outbox::{LookupOutcome, OutboxRecord, SendOutcome, Status};

/// The dispatcher's settings that its decisions depend on.
#[derive(Debug, Clone)]
pub(crate) struct Policy {
    /// Attempts after which a message that did not go through fails for good.
    pub(crate) max_attempts: u32,
    /// Age after which a message that is still not delivered fails for good.
    pub(crate) give_up_after: Duration,
    /// The wait before a message is sent again.
    pub(crate) backoff: Backoff,
    /// After an unknown outcome, how long a lookup finding nothing is not trusted.
    pub(crate) lookup_grace: Duration,
    /// The wait between probes of an unavailable destination.
    pub(crate) probe_backoff: Backoff,
}

/// The next step for a claimed message before its send.
#[derive(Debug)]
pub(crate) enum Step {
    /// Its last outcome is unknown: ask the downstream first.
    LookUp,
    /// It fails for good: this is the outcome to record.
    GiveUp(Attempted),
    /// Count an attempt under its lease, then send.
    BeginAttempt,
    /// Send: its attempt is already counted.
    Send,
}

/// What an attempt leads to: the outcome to record, whether it found the destination out of
/// reach, and why the message failed for good if it did.
#[derive(Debug)]
pub(crate) struct Attempted {
    pub(crate) settlement: Settlement,
    pub(crate) outage: Option<Outage>,
    pub(crate) gave_up: Option<GiveUp>,
}

impl From<Settlement> for Attempted {
    fn from(settlement: Settlement) -> Self {
        Self {
            settlement,
            outage: None,
            gave_up: None,
        }
    }
}

/// A destination that could not be reached, as one send found it.
#[derive(Debug)]
pub(crate) struct Outage {
    /// The destination's `Retry-After`, if it gave one.
    pub(crate) after: Option<Duration>,
    pub(crate) reason: String,
}

/// Why a message failed for good.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GiveUp {
    /// The downstream refused it.
    Rejected,
    /// Its attempts ran out.
    Attempts,
    /// Its time budget ran out.
    Budget,
}

/// What to do with a claimed message before its send, at `now`: `attempt_begun` when its
/// claim began the attempt (its last outcome was known), `looked_up` once a lookup of an
/// unknown outcome found nothing to settle.
pub(crate) fn before_send(
    policy: &Policy,
    record: &OutboxRecord,
    attempt_begun: bool,
    looked_up: bool,
    now: Millis,
) -> Step {
    let last = record.last_error.as_deref();
    if attempt_begun {
        // The attempt the claim began is never made if the budget ran out: not counted.
        return match past_budget(policy, record, now, last) {
            Some(reason) => Step::GiveUp(give_up(
                GiveUp::Budget,
                record.attempts.saturating_sub(1),
                reason,
                now,
            )),
            None => Step::Send,
        };
    }
    // An unknown outcome is looked up before anything else: it may have been delivered.
    if record.outcome_unknown && !looked_up {
        return Step::LookUp;
    }
    if let Some(reason) = past_budget(policy, record, now, last) {
        return Step::GiveUp(give_up(GiveUp::Budget, record.attempts, reason, now));
    }
    if record.attempts >= policy.max_attempts {
        let reason = out_of_attempts(record, record.outcome_unknown, last);
        return Step::GiveUp(give_up(GiveUp::Attempts, record.attempts, reason, now));
    }
    Step::BeginAttempt
}

/// What one send's outcome, known at `now`, makes of the message; `record.attempts` counts
/// the attempt that sent it.
pub(crate) fn settle_outcome(
    policy: &Policy,
    record: &OutboxRecord,
    outcome: SendOutcome,
    now: Millis,
) -> Attempted {
    let attempts = record.attempts;
    match outcome {
        SendOutcome::Delivered { receipt } => delivered(receipt, now, attempts).into(),
        SendOutcome::Rejected { reason } => give_up(GiveUp::Rejected, attempts, reason, now),
        SendOutcome::Unavailable { after, reason } => outage(policy, record, after, reason, now),
        SendOutcome::Retry { after, reason } => {
            if attempts >= policy.max_attempts {
                let reason = out_of_attempts(record, false, Some(&reason));
                return give_up(GiveUp::Attempts, attempts, reason, now);
            }
            if let Some(reason) = past_budget(policy, record, now, Some(&reason)) {
                return give_up(GiveUp::Budget, attempts, reason, now);
            }
            let at = now.after(delay(policy, attempts, after));
            retry_at(at, Some(reason), false, attempts).into()
        }
        // Even on the last attempt or past the budget: the next claim looks it up before
        // deciding to fail.
        SendOutcome::Unknown { reason } => {
            let at = now.after(delay(policy, attempts, None));
            retry_at(at, Some(reason), true, attempts).into()
        }
    }
}

/// An outage is not an attempt: the one begun is given back, and the message stays due for
/// the destination's next probe, unless its time budget ran out.
fn outage(
    policy: &Policy,
    record: &OutboxRecord,
    after: Option<Duration>,
    reason: String,
    now: Millis,
) -> Attempted {
    let attempts = record.attempts.saturating_sub(1);
    let reason = format!("unavailable: {reason}");
    if let Some(reason) = past_budget(policy, record, now, Some(&reason)) {
        return give_up(GiveUp::Budget, attempts, reason, now);
    }
    let at = now.after(after.unwrap_or_default());
    Attempted {
        settlement: retry_at(at, Some(reason.clone()), false, attempts),
        outage: Some(Outage { after, reason }),
        gave_up: None,
    }
}

/// What a lookup of a message whose last outcome is unknown makes of it, at `now`: the
/// outcome to record, or `None` when the message is to be sent again. `found` is `None` when
/// the lookup got no answer in time.
pub(crate) fn after_lookup(
    policy: &Policy,
    record: &OutboxRecord,
    found: Option<LookupOutcome>,
    now: Millis,
) -> Option<Settlement> {
    let attempts = record.attempts;
    let again = || now.after(delay(policy, attempts, None));
    match found {
        // The downstream has it: the effect happened once and nothing is resent.
        Some(LookupOutcome::Found { receipt }) => Some(delivered(receipt, now, attempts)),
        Some(LookupOutcome::NotFound) => {
            let last = Millis::from(record.last_attempt_at.unwrap_or(UNIX_EPOCH));
            let grace_ends = last.after(policy.lookup_grace);
            (now < grace_ends)
                .then(|| retry_at(grace_ends, record.last_error.clone(), true, attempts))
        }
        Some(LookupOutcome::Unsupported) => None,
        Some(LookupOutcome::Failed { reason }) => {
            let error = format!("lookup failed: {reason}");
            Some(retry_at(again(), Some(error), true, attempts))
        }
        None => {
            let error = "lookup timed out".to_owned();
            Some(retry_at(again(), Some(error), true, attempts))
        }
    }
}

/// When a paused destination is probed next, after `probes` sends found it unavailable: the
/// probe backoff's wait from `now`, never before the destination's `Retry-After`, if the last
/// one gave it.
pub(crate) fn next_probe(
    policy: &Policy,
    probes: u32,
    retry_after: Option<Duration>,
    now: Millis,
) -> Millis {
    let wait = policy.probe_backoff.delay(probes);
    now.after(wait.max(retry_after.unwrap_or_default()))
}

/// A claimed message given back unsent, due at `until`: the attempt its claim began is not
/// counted.
pub(crate) fn given_back(message: Claimed, until: Millis) -> Settlement {
    let Claimed {
        record,
        attempt_begun,
    } = message;
    // An attempt is begun only for a message whose last outcome is known.
    let (attempts, unknown) = if attempt_begun {
        (record.attempts.saturating_sub(1), false)
    } else {
        (record.attempts, record.outcome_unknown)
    };
    retry_at(until, record.last_error, unknown, attempts)
}

/// Why `record` is past its time budget at `now`, if it is; `last` is the last error seen.
fn past_budget(
    policy: &Policy,
    record: &OutboxRecord,
    now: Millis,
    last: Option<&str>,
) -> Option<String> {
    let since = Millis::from(record.requeued_at.unwrap_or(record.created_at));
    (now >= since.after(policy.give_up_after)).then(|| {
        let last = last.unwrap_or("no error recorded");
        format!(
            "gave up after {:?}, the time budget; last: {last}",
            policy.give_up_after
        )
    })
}

/// Why a message out of attempts fails; `unknown` when its last outcome is.
fn out_of_attempts(record: &OutboxRecord, unknown: bool, last: Option<&str>) -> String {
    let last = last.unwrap_or("no error recorded");
    if unknown {
        format!(
            "gave up after {} attempts; the last one's outcome is unknown: {last}",
            record.attempts
        )
    } else {
        format!("gave up after {} attempts: {last}", record.attempts)
    }
}

/// The wait before attempt `attempt + 1`, never shorter than `retry_after`.
fn delay(policy: &Policy, attempt: u32, retry_after: Option<Duration>) -> Duration {
    let wait = policy.backoff.delay(attempt);
    wait.max(retry_after.unwrap_or_default())
}

fn give_up(why: GiveUp, attempts: u32, reason: String, now: Millis) -> Attempted {
    Attempted {
        settlement: Settlement {
            status: Status::Failed,
            receipt: None,
            last_error: Some(reason),
            attempts,
            outcome_unknown: false,
            next_attempt_at: now,
            finished_at: Some(now),
            last_attempt_at: None,
        },
        outage: None,
        gave_up: Some(why),
    }
}

fn delivered(receipt: String, now: Millis, attempts: u32) -> Settlement {
    Settlement {
        status: Status::Delivered,
        receipt: Some(receipt),
        last_error: None,
        attempts,
        outcome_unknown: false,
        next_attempt_at: now,
        finished_at: Some(now),
        last_attempt_at: None,
    }
}

fn retry_at(
    at: Millis,
    last_error: Option<String>,
    outcome_unknown: bool,
    attempts: u32,
) -> Settlement {
    Settlement {
        status: Status::Pending,
        receipt: None,
        last_error,
        attempts,
        outcome_unknown,
        next_attempt_at: at,
        finished_at: None,
        last_attempt_at: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outbox::DownstreamKey;

    const HOUR: i64 = 60 * 60 * 1000;
    /// When the test messages were enqueued, in milliseconds since the epoch.
    const T0_MS: i64 = 1_000_000_000_000;
    const T0: Millis = Millis::from_column(T0_MS);

    /// `ms` milliseconds after `T0`.
    fn at(ms: i64) -> Millis {
        Millis::from_column(T0_MS + ms)
    }

    fn policy() -> Policy {
        Policy {
            max_attempts: 3,
            give_up_after: Duration::from_secs(6 * 60 * 60),
            // No jitter to speak of: a retry is due when its outcome is known.
            backoff: Backoff::exponential(Duration::ZERO, Duration::ZERO),
            lookup_grace: Duration::from_secs(60),
            probe_backoff: Backoff::exponential(Duration::from_secs(1), Duration::from_secs(30)),
        }
    }

    fn record(attempts: u32, outcome_unknown: bool) -> OutboxRecord {
        OutboxRecord {
            id: 7.into(),
            topic: "payments".to_owned(),
            downstream_key: DownstreamKey::from_stored("key".to_owned()),
            payload: Vec::new(),
            status: Status::Pending,
            attempts,
            outcome_unknown,
            receipt: None,
            last_error: Some("earlier".to_owned()),
            created_at: T0.into(),
            next_attempt_at: T0.into(),
            last_attempt_at: None,
            finished_at: None,
            requeued_at: None,
            ordering_key: None,
        }
    }

    fn gave_up(step: Step) -> (GiveUp, u32) {
        match step {
            Step::GiveUp(attempted) => {
                assert_eq!(attempted.settlement.status, Status::Failed);
                (
                    attempted.gave_up.expect("a reason"),
                    attempted.settlement.attempts,
                )
            }
            other => panic!("expected a give-up, got {other:?}"),
        }
    }

    #[test]
    fn an_attempt_the_claim_began_is_sent_within_the_budget() {
        let step = before_send(&policy(), &record(1, true), true, false, at(1));
        assert!(matches!(step, Step::Send));
    }

    #[test]
    fn an_attempt_the_claim_began_past_the_budget_fails_uncounted() {
        let step = before_send(&policy(), &record(2, true), true, false, at(6 * HOUR));
        assert_eq!(gave_up(step), (GiveUp::Budget, 1));
    }

    #[test]
    fn an_unknown_outcome_is_looked_up_first_even_past_every_limit() {
        let step = before_send(&policy(), &record(3, true), false, false, at(7 * HOUR));
        assert!(matches!(step, Step::LookUp));
    }

    #[test]
    fn a_lookup_that_found_nothing_leads_to_an_attempt() {
        let step = before_send(&policy(), &record(1, true), false, true, at(1));
        assert!(matches!(step, Step::BeginAttempt));
    }

    #[test]
    fn a_message_out_of_attempts_or_budget_fails_before_its_send() {
        let out = before_send(&policy(), &record(3, true), false, true, at(1));
        assert_eq!(gave_up(out), (GiveUp::Attempts, 3));
        let late = before_send(&policy(), &record(1, false), false, false, at(6 * HOUR));
        assert_eq!(gave_up(late), (GiveUp::Budget, 1));
    }

    #[test]
    fn the_budget_counts_from_a_requeue() {
        let mut requeued = record(1, false);
        requeued.requeued_at = Some(at(5 * HOUR).into());
        let step = before_send(&policy(), &requeued, false, false, at(6 * HOUR));
        assert!(matches!(step, Step::BeginAttempt));
    }

    #[test]
    fn a_delivery_settles_with_its_receipt() {
        let outcome = SendOutcome::Delivered {
            receipt: "r".to_owned(),
        };
        let attempted = settle_outcome(&policy(), &record(1, true), outcome, at(5));
        let settlement = attempted.settlement;
        assert_eq!(settlement.status, Status::Delivered);
        assert_eq!(settlement.receipt.as_deref(), Some("r"));
        assert_eq!(
            (settlement.attempts, settlement.finished_at),
            (1, Some(at(5)))
        );
        assert!(attempted.gave_up.is_none() && attempted.outage.is_none());
    }

    #[test]
    fn a_rejection_fails_for_good_at_once() {
        let outcome = SendOutcome::Rejected {
            reason: "no".to_owned(),
        };
        let attempted = settle_outcome(&policy(), &record(1, true), outcome, T0);
        assert_eq!(attempted.gave_up, Some(GiveUp::Rejected));
        assert_eq!(attempted.settlement.last_error.as_deref(), Some("no"));
    }

    #[test]
    fn an_outage_is_not_an_attempt_and_waits_for_retry_after() {
        let outcome = SendOutcome::Unavailable {
            after: Some(Duration::from_secs(5)),
            reason: "down".to_owned(),
        };
        let attempted = settle_outcome(&policy(), &record(3, true), outcome, T0);
        let settlement = &attempted.settlement;
        // The third attempt was the last, but an outage spends no attempt: still pending.
        assert_eq!(
            (settlement.status, settlement.attempts),
            (Status::Pending, 2)
        );
        assert_eq!(settlement.next_attempt_at, at(5_000));
        assert!(!settlement.outcome_unknown);
        assert!(attempted.outage.is_some() && attempted.gave_up.is_none());
    }

    #[test]
    fn an_outage_past_the_budget_fails_uncounted() {
        let outcome = SendOutcome::Unavailable {
            after: None,
            reason: "down".to_owned(),
        };
        let attempted = settle_outcome(&policy(), &record(2, true), outcome, at(6 * HOUR));
        assert_eq!(attempted.gave_up, Some(GiveUp::Budget));
        assert_eq!(attempted.settlement.attempts, 1);
        assert!(attempted.outage.is_none());
    }

    #[test]
    fn a_retry_is_due_no_earlier_than_retry_after() {
        let outcome = SendOutcome::Retry {
            after: Some(Duration::from_secs(2)),
            reason: "busy".to_owned(),
        };
        let attempted = settle_outcome(&policy(), &record(1, true), outcome, T0);
        let settlement = &attempted.settlement;
        assert_eq!(
            (settlement.status, settlement.attempts),
            (Status::Pending, 1)
        );
        assert_eq!(settlement.next_attempt_at, at(2_000));
        assert!(!settlement.outcome_unknown);
    }

    #[test]
    fn a_retry_on_the_last_attempt_or_past_the_budget_fails() {
        let retry = || SendOutcome::Retry {
            after: None,
            reason: "busy".to_owned(),
        };
        let last = settle_outcome(&policy(), &record(3, true), retry(), T0);
        assert_eq!(last.gave_up, Some(GiveUp::Attempts));
        assert_eq!(last.settlement.attempts, 3);
        let late = settle_outcome(&policy(), &record(1, true), retry(), at(6 * HOUR));
        assert_eq!(late.gave_up, Some(GiveUp::Budget));
    }

    #[test]
    fn an_unknown_outcome_stays_pending_even_on_the_last_attempt() {
        let outcome = SendOutcome::Unknown {
            reason: "timeout".to_owned(),
        };
        let attempted = settle_outcome(&policy(), &record(3, true), outcome, at(7 * HOUR));
        let settlement = &attempted.settlement;
        assert_eq!(
            (settlement.status, settlement.attempts),
            (Status::Pending, 3)
        );
        assert!(settlement.outcome_unknown && attempted.gave_up.is_none());
    }

    #[test]
    fn a_lookup_that_finds_the_message_settles_it_delivered() {
        let found = Some(LookupOutcome::Found {
            receipt: "r".to_owned(),
        });
        let settlement = after_lookup(&policy(), &record(2, true), found, T0).expect("settled");
        assert_eq!(
            (settlement.status, settlement.attempts),
            (Status::Delivered, 2)
        );
    }

    #[test]
    fn not_found_within_the_grace_waits_for_its_end_and_resends_after_it() {
        let mut sent = record(1, true);
        sent.last_attempt_at = Some(T0.into());
        let within = after_lookup(&policy(), &sent, Some(LookupOutcome::NotFound), at(1_000));
        let within = within.expect("waits");
        assert_eq!(within.next_attempt_at, at(60_000));
        assert!(within.outcome_unknown);
        let after = after_lookup(&policy(), &sent, Some(LookupOutcome::NotFound), at(60_000));
        assert!(after.is_none());
    }

    #[test]
    fn a_lookup_unsupported_resends_and_one_failed_or_timed_out_retries_unknown() {
        let unsupported = Some(LookupOutcome::Unsupported);
        assert!(after_lookup(&policy(), &record(1, true), unsupported, T0).is_none());
        let failed = Some(LookupOutcome::Failed {
            reason: "500".to_owned(),
        });
        for found in [failed, None] {
            let settlement = after_lookup(&policy(), &record(1, true), found, T0).expect("retry");
            assert_eq!(
                (settlement.status, settlement.attempts),
                (Status::Pending, 1)
            );
            assert!(settlement.outcome_unknown);
            assert!(
                settlement
                    .last_error
                    .is_some_and(|e| e.starts_with("lookup"))
            );
        }
    }

    #[test]
    fn probes_back_off_up_to_thirty_seconds_but_never_before_retry_after() {
        for probes in [1, 5, 50] {
            let probe = next_probe(&policy(), probes, None, T0);
            assert!(
                (T0..=at(30_000)).contains(&probe),
                "probe {probes} at {probe:?}"
            );
        }
        let long = Some(Duration::from_secs(90));
        assert!(next_probe(&policy(), 1, long, T0) >= at(90_000));
    }

    #[test]
    fn a_message_given_back_has_the_attempt_its_claim_began_uncounted() {
        let begun = Claimed {
            record: record(2, true),
            attempt_begun: true,
        };
        let settlement = given_back(begun, at(9));
        assert_eq!(
            (settlement.attempts, settlement.outcome_unknown),
            (1, false)
        );
        assert_eq!(settlement.next_attempt_at, at(9));
        let unknown = Claimed {
            record: record(2, true),
            attempt_begun: false,
        };
        let settlement = given_back(unknown, T0);
        assert_eq!((settlement.attempts, settlement.outcome_unknown), (2, true));
    }
}
