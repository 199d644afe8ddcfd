//! The inbox: a broker that delivers each message at least once, two consumers that claim its
//! business key in the handler's transaction and acknowledge after the commit, an operator who
//! replays dead letters, and a database that keeps the dedupe keys and the business writes.
//!
//! The broker is trusted to keep a message until it is acknowledged: a delivery whose consumer
//! crashed, or that the broker lost track of (a closed channel, an ack wait that ran out while
//! the handler still runs), is queued again with one more delivery counted, and may go to the
//! other consumer. A retry or an outage is settled as RabbitMQ's adapter does it, a copy stored
//! first (its attempt counted for a retry, its count unchanged for an outage) and the original
//! acknowledged next, so a crash in between leaves both; NATS's `Nak` and its outage kept in
//! hand are among the orders explored. A dead letter is stored before the original is
//! acknowledged, and a replay that does not apply leaves it there. An acknowledgement from a
//! consumer the broker no longer counts as the message's holder may change nothing (RabbitMQ's
//! delivery tag died with its channel) or settle the message all the same (a JetStream ack
//! names the message, whichever delivery sends it): both are explored. The
//! broker's delivery count cannot tell a crash from a lost channel, so both spend an attempt,
//! as does a lock wait on the key's other delivery that runs out (the adapters count every
//! retry); an outage spends none.
//!
//! The database is trusted as in the HTTP model: the claim inserts the key in the handler's
//! transaction, a second claim waits on its lock, a commit is atomic, a crash rolls back and
//! frees the lock. A commit that cannot be confirmed may or may not have happened. Keys are kept
//! (the inbox's default retention), so nothing expires here.

use std::time::Duration;

use stateright::{Model, Property};

use crate::engine::decide::run_again;
use crate::engine::{RunError, Verdict as Ending};
use crate::error::{Error, Rejection};
use crate::inbox::Failure;
use crate::inbox::decide::{failure_of, verdict_of, waited_out};
use crate::inbox::failure::{Fate, settled};

/// The bounds of one exploration.
#[derive(Debug, Clone)]
pub(super) struct Inbox {
    /// Consumers (inbox instances) on the same queue.
    consumers: usize,
    /// The messages published, one set per start of the exploration.
    published: Vec<Vec<Message>>,
    /// Faults in all: crashes, lost deliveries, lock waits that run out, outages, retryable
    /// failures and conflict aborts. Past them, the system runs without faults.
    faults: u8,
    /// The inbox's `max_attempts`.
    max_attempts: u8,
    /// Dead letters an operator replays, in all.
    replays: u8,
    /// The database has one write lock (SQLite): a lock wait that runs out is any writer
    /// holding the whole database, not only the key's other delivery.
    one_write_lock: bool,
    /// A deliberately broken inbox, to show a property able to fail.
    broken: Option<Broken>,
}

/// Broken inboxes, each of which some property must catch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Broken {
    /// The adapter acknowledges once the handler answered, before the commit.
    AckBeforeCommit,
    /// The dedupe key is checked before the handler and inserted after its commit, in a
    /// transaction of its own.
    KeyApart,
    /// An outage is handed to the decisions as a retryable failure, counting an attempt.
    OutageCounted,
    /// On a database with one write lock, a lock wait that runs out is decided as if another
    /// delivery of the key held it: a retry, counting an attempt.
    WriteLockCounted,
}

/// A published message: its business key, and whether it can ever apply (a malformed message
/// or an unknown order fails for good).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Message {
    key: usize,
    valid: bool,
}

impl Inbox {
    /// The default bounds, or the deeper ones under `MODEL_DEPTH=deep`. Two attempts are
    /// enough for a valid message to spend them all within the faults.
    pub(super) fn new() -> Self {
        let deep = super::deep();
        let valid = |key| Message { key, valid: true };
        Self {
            consumers: 2,
            published: vec![
                // A duplicate publish: two messages carry one business key.
                vec![valid(0), valid(0)],
                // A message alone with its key, beside one that can never apply.
                vec![
                    valid(0),
                    Message {
                        key: 1,
                        valid: false,
                    },
                ],
            ],
            faults: if deep { 4 } else { 3 },
            max_attempts: 2,
            replays: 1,
            one_write_lock: false,
            broken: None,
        }
    }

    /// The same bounds on a database with one write lock, as SQLite has.
    pub(super) fn one_write_lock(mut self) -> Self {
        self.one_write_lock = true;
        self
    }

    /// The same bounds with `broken` in place of the inbox's own behaviour.
    pub(super) fn broken(mut self, broken: Broken) -> Self {
        self.broken = Some(broken);
        self
    }

    /// Whether this exploration runs the broken variant `broken`.
    fn is(&self, broken: Broken) -> bool {
        self.broken == Some(broken)
    }

    /// How many business keys the published messages use.
    fn keys(&self) -> usize {
        self.published
            .iter()
            .flatten()
            .map(|m| m.key + 1)
            .max()
            .unwrap_or(0)
    }
}

/// Where the broker has a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Queued {
    /// Waiting for a consumer; `attempts` deliveries counted so far.
    Ready { attempts: u8 },
    /// Delivered to `consumer`, not yet acknowledged; `replay` when an operator's replay took
    /// it from the dead-letter queue.
    InHand {
        consumer: usize,
        attempts: u8,
        replay: bool,
    },
    /// Acknowledged: the broker is done with it.
    Acked,
    /// In the dead-letter queue, until an operator replays it.
    DeadLetter,
}

/// A message and what became of it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct Sent {
    message: Message,
    queued: Queued,
    /// Attempts it spent through no outage: retryable failures, lock waits that ran out,
    /// deliveries lost with a consumer or by the broker. What an outage must never add to.
    spent: u8,
    /// A copy is in the dead-letter queue.
    dead: bool,
    /// A copy to come back later was stored: the message lives on in it.
    copied: bool,
}

/// One delivery a consumer holds: the message, and which attempt the broker counted it as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Held {
    message: usize,
    attempt: u8,
    /// An operator's replay of a dead letter: one attempt, any failure keeps it dead.
    replay: bool,
}

/// A consumer, with the delivery it is at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Consumer {
    /// Free for the next delivery.
    Idle,
    /// About to claim the key, in the engine's conflict-rerun `round`.
    Claiming { held: Held, round: u8 },
    /// Waiting on the key's lock, held by the other consumer's transaction.
    Waiting { held: Held, round: u8 },
    /// The claim is in the transaction; the handler runs.
    Working { held: Held, round: u8 },
    /// The handler applied the message; the commit is next.
    Committing { held: Held, round: u8 },
    /// The business writes committed apart; the dedupe key is inserted next.
    Recording { held: Held },
    /// The transaction ended with `verdict`; the broker is told next.
    Settling { held: Held, verdict: Settle },
    /// Its copy is stored (delayed, or a dead letter); the original is acknowledged next.
    Acking { held: Held },
}

/// What the adapter tells the broker, as it does for each of the inbox's verdicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Settle {
    /// Applied or duplicate: acknowledge.
    Ack,
    /// Redeliver later, this attempt counted.
    Retry,
    /// Redeliver later, counting no attempt (an outage).
    Outage,
    /// Store a copy in the dead-letter queue, then acknowledge.
    Dead,
}

/// What the handler answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Handler {
    /// `Ok(())`: the business write is in the transaction.
    Applied,
    /// A failure worth another attempt later (a downstream timed out).
    Retryable,
    /// The consumer's database could not be reached.
    Unavailable,
    /// Malformed, or about an order that does not exist: what an invalid message answers.
    Permanent,
    /// The database aborted the transaction on a conflict.
    Conflict,
}

impl Handler {
    /// The handler's answer as the inbox receives it.
    fn result(self) -> Result<(), Failure> {
        match self {
            Self::Applied => Ok(()),
            Self::Retryable => Err(Failure::retryable("a downstream timed out")),
            Self::Unavailable => Err(Failure::unavailable("the database is unreachable")),
            Self::Permanent => Err(Failure::permanent("no such order")),
            Self::Conflict => Err(Failure::Conflict("serialization failure".into())),
        }
    }
}

/// The broker's messages, the consumers and the database.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct State {
    sent: Vec<Sent>,
    consumers: Vec<Consumer>,
    /// Committed dedupe keys.
    keys: Vec<bool>,
    /// The consumer whose open transaction holds each key's claim.
    locks: Vec<Option<usize>>,
    /// Committed business writes per key.
    writes: Vec<u8>,
    faults_left: u8,
    replays_left: u8,
}

/// One step of the broker, a consumer or the database; the faults among them are bounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Action {
    Deliver { message: usize, consumer: usize },
    Replay { message: usize, consumer: usize },
    Claim(usize),
    LockFreed(usize),
    LockWaitRunsOut(usize),
    ClaimUnreachable(usize),
    Handle { consumer: usize, handler: Handler },
    Commit(usize),
    CommitUnconfirmed { consumer: usize, committed: bool },
    Record(usize),
    Settle(usize),
    SettleStale(usize),
    Ack(usize),
    Crash(usize),
    LoseDelivery(usize),
}

/// What a valid message's handler answers when a fault strikes it.
const FAULTY_ANSWERS: [Handler; 3] = [Handler::Retryable, Handler::Unavailable, Handler::Conflict];

impl Model for Inbox {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let keys = self.keys();
        self.published
            .iter()
            .map(|messages| State {
                sent: messages
                    .iter()
                    .map(|&message| Sent {
                        message,
                        queued: Queued::Ready { attempts: 0 },
                        spent: 0,
                        dead: false,
                        copied: false,
                    })
                    .collect(),
                consumers: vec![Consumer::Idle; self.consumers],
                keys: vec![false; keys],
                locks: vec![None; keys],
                writes: vec![0; keys],
                faults_left: self.faults,
                replays_left: self.replays,
            })
            .collect()
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        let fault = state.faults_left > 0;
        // Idle consumers are alike: delivering to the first is delivering to any.
        let idle = state.consumers.iter().position(|c| *c == Consumer::Idle);
        for (message, sent) in state.sent.iter().enumerate() {
            match sent.queued {
                Queued::Ready { .. } => {
                    if let Some(consumer) = idle {
                        actions.push(Action::Deliver { message, consumer });
                    }
                }
                Queued::DeadLetter if state.replays_left > 0 => {
                    if let Some(consumer) = idle {
                        actions.push(Action::Replay { message, consumer });
                    }
                }
                Queued::InHand { .. } if fault => actions.push(Action::LoseDelivery(message)),
                Queued::InHand { .. } | Queued::Acked | Queued::DeadLetter => {}
            }
        }
        for (consumer, c) in state.consumers.iter().enumerate() {
            match *c {
                Consumer::Idle => continue,
                Consumer::Claiming { .. } => {
                    actions.push(Action::Claim(consumer));
                    if fault {
                        actions.push(Action::ClaimUnreachable(consumer));
                    }
                }
                Consumer::Waiting { held, .. } => {
                    if state.locks[state.sent[held.message].message.key].is_none() {
                        actions.push(Action::LockFreed(consumer));
                    }
                    if fault {
                        actions.push(Action::LockWaitRunsOut(consumer));
                    }
                }
                Consumer::Working { held, .. } => {
                    answers(state, consumer, held, actions);
                }
                Consumer::Committing { .. } => {
                    actions.push(Action::Commit(consumer));
                    if fault {
                        for committed in [false, true] {
                            actions.push(Action::CommitUnconfirmed {
                                consumer,
                                committed,
                            });
                        }
                    }
                }
                Consumer::Recording { .. } => actions.push(Action::Record(consumer)),
                Consumer::Settling { held, verdict } => {
                    actions.push(Action::Settle(consumer));
                    if stale_settles(state, consumer, held, verdict) {
                        actions.push(Action::SettleStale(consumer));
                    }
                }
                Consumer::Acking { .. } => actions.push(Action::Ack(consumer)),
            }
            if fault {
                actions.push(Action::Crash(consumer));
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Deliver { message, consumer } => take(&mut s, message, consumer, false)?,
            Action::Replay { message, consumer } => take(&mut s, message, consumer, true)?,
            Action::Claim(consumer)
            | Action::LockFreed(consumer)
            | Action::LockWaitRunsOut(consumer)
            | Action::ClaimUnreachable(consumer) => self.claiming(&mut s, consumer, action)?,
            Action::Handle { consumer, .. }
            | Action::Commit(consumer)
            | Action::CommitUnconfirmed { consumer, .. }
            | Action::Record(consumer) => self.working(&mut s, consumer, action)?,
            Action::Settle(consumer) => {
                let Consumer::Settling { held, verdict } = s.consumers[consumer] else {
                    return None;
                };
                s.consumers[consumer] = settle(&mut s, consumer, held, verdict);
            }
            Action::SettleStale(consumer) => {
                let Consumer::Settling { held, verdict } = s.consumers[consumer] else {
                    return None;
                };
                if verdict == Settle::Dead {
                    dead_letter(&mut s, held.message);
                }
                s.sent[held.message].queued = Queued::Acked;
                s.consumers[consumer] = Consumer::Idle;
            }
            Action::Ack(consumer) => {
                let Consumer::Acking { held } = s.consumers[consumer] else {
                    return None;
                };
                acknowledge(&mut s, consumer, held.message);
                s.consumers[consumer] = Consumer::Idle;
            }
            Action::Crash(consumer) => {
                s.faults_left -= 1;
                release(&mut s, consumer);
                if let Some(message) = holding(&s, consumer) {
                    requeue_lost(&mut s.sent[message]);
                }
                s.consumers[consumer] = Consumer::Idle;
            }
            Action::LoseDelivery(message) => {
                s.faults_left -= 1;
                requeue_lost(&mut s.sent[message]);
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(APPLIED_ONCE, |_, s: &State| {
                s.writes.iter().all(|&w| w <= 1)
            }),
            Property::always(NO_DEAD_LETTER_FOR_AN_OUTAGE, |model: &Inbox, s: &State| {
                s.sent.iter().all(|sent| {
                    !sent.dead || !sent.message.valid || sent.spent >= model.max_attempts
                })
            }),
            Property::always(EVERY_MESSAGE_SETTLED, |model: &Inbox, s: &State| {
                let mut next = Vec::new();
                model.actions(s, &mut next);
                !next.is_empty() || settled_all(s)
            }),
            Property::sometimes("every valid message applied and acknowledged", |_, s| {
                settled_all(s) && s.sent.iter().all(|sent| !sent.dead)
            }),
        ]
    }
}

/// Each business key is applied at most once (the dedupe keys are kept).
pub(super) const APPLIED_ONCE: &str = "each business key is applied once";
/// A valid message is dead-lettered only once it spent its attempts; outages spend none.
pub(super) const NO_DEAD_LETTER_FOR_AN_OUTAGE: &str =
    "a valid message is never dead-lettered for an outage";
/// Once faults stop, every message is acknowledged and every valid one's key applied, unless
/// it spent its attempts and was dead-lettered.
pub(super) const EVERY_MESSAGE_SETTLED: &str =
    "every valid message ends applied and acknowledged once faults stop";

/// Every message acknowledged or resting in the dead-letter queue, and every valid one's key
/// applied, or the message dead-lettered, or living on in a copy.
fn settled_all(s: &State) -> bool {
    s.sent.iter().all(|sent| {
        matches!(sent.queued, Queued::Acked | Queued::DeadLetter)
            && (!sent.message.valid || sent.dead || sent.copied || s.keys[sent.message.key])
    })
}

impl Inbox {
    /// A step of `consumer`'s claim: it claims, waits on the lock, gives up waiting, or finds
    /// the database out of reach.
    fn claiming(&self, s: &mut State, consumer: usize, action: Action) -> Option<()> {
        let (Consumer::Claiming { held, round } | Consumer::Waiting { held, round }) =
            s.consumers[consumer]
        else {
            return None;
        };
        s.consumers[consumer] = match action {
            Action::Claim(_) | Action::LockFreed(_) => self.claim(s, consumer, held, round),
            Action::LockWaitRunsOut(_) => {
                s.faults_left -= 1;
                // With one write lock, any writer may be what held it: an outage, whatever
                // the decision makes of it. With a lock per key, the key's other delivery still
                // holds it, and the attempt the broker counts is spent.
                if !self.one_write_lock {
                    s.sent[held.message].spent += 1;
                }
                let one_write_lock = self.one_write_lock && !self.is(Broken::WriteLockCounted);
                let verdict = match waited_out(one_write_lock, Duration::from_secs(1)) {
                    // A retry without a failure's fate; the broker counts the attempt.
                    Ok(_) => Settle::Retry,
                    Err(failure) => self.conclude(s, held, failure),
                };
                Consumer::Settling { held, verdict }
            }
            Action::ClaimUnreachable(_) => {
                s.faults_left -= 1;
                let verdict = self.conclude(s, held, store_failed());
                Consumer::Settling { held, verdict }
            }
            _ => return None,
        };
        Some(())
    }

    /// A step of `consumer`'s work in the claim's transaction: the handler answers, the commit
    /// goes through or goes unconfirmed, or (broken) the key is inserted apart.
    fn working(&self, s: &mut State, consumer: usize, action: Action) -> Option<()> {
        s.consumers[consumer] = match (action, s.consumers[consumer]) {
            (Action::Handle { handler, .. }, Consumer::Working { held, round }) => {
                if handler != Handler::Applied && s.sent[held.message].message.valid {
                    s.faults_left -= 1;
                }
                self.handled(s, consumer, held, round, handler)
            }
            (Action::Commit(_), Consumer::Committing { held, .. }) => {
                self.commit(s, consumer, held)
            }
            (Action::CommitUnconfirmed { committed, .. }, Consumer::Committing { held, .. }) => {
                s.faults_left -= 1;
                if committed {
                    self.commit(s, consumer, held);
                } else {
                    release(s, consumer);
                }
                let verdict = self.conclude(s, held, store_failed());
                Consumer::Settling { held, verdict }
            }
            (Action::Record(_), Consumer::Recording { held }) => {
                s.keys[s.sent[held.message].message.key] = true;
                ack(held)
            }
            _ => return None,
        };
        Some(())
    }

    /// One claim of `held`'s key: the database's part (the lock, the committed key), then what
    /// the engine answers: a held key is a duplicate, acknowledged without the handler.
    fn claim(&self, s: &mut State, consumer: usize, held: Held, round: u8) -> Consumer {
        let key = s.sent[held.message].message.key;
        if self.is(Broken::KeyApart) {
            return if s.keys[key] {
                ack(held)
            } else {
                Consumer::Working { held, round }
            };
        }
        if s.locks[key].is_some_and(|holder| holder != consumer) {
            return Consumer::Waiting { held, round };
        }
        if s.keys[key] {
            return ack(held);
        }
        s.locks[key] = Some(consumer);
        Consumer::Working { held, round }
    }

    /// The handler answered: its transaction ends as `verdict_of` decides.
    fn handled(
        &self,
        s: &mut State,
        consumer: usize,
        held: Held,
        round: u8,
        handler: Handler,
    ) -> Consumer {
        let attempt = u32::from(held.attempt);
        let max_attempts = u32::from(self.max_attempts);
        match verdict_of(handler.result(), attempt, max_attempts, held.replay) {
            Ending::Commit(_) => {
                if self.is(Broken::AckBeforeCommit) {
                    acknowledge(s, consumer, held.message);
                }
                Consumer::Committing { held, round }
            }
            Ending::Conflict => {
                release(s, consumer);
                if run_again(u32::from(round)) {
                    return Consumer::Claiming {
                        held,
                        round: round + 1,
                    };
                }
                let (failure, _) = failure_of(RunError::Rejected(Rejection::Conflict));
                let verdict = self.conclude(s, held, failure);
                Consumer::Settling { held, verdict }
            }
            Ending::RollBack { failure, .. } => {
                release(s, consumer);
                let verdict = self.conclude(s, held, failure);
                Consumer::Settling { held, verdict }
            }
            Ending::Refuse(_) | Ending::Abandon(_) => {
                unreachable!("the inbox's handler never refuses nor abandons")
            }
        }
    }

    /// The handler's writes and the claimed key commit together (or, broken, the writes alone).
    fn commit(&self, s: &mut State, consumer: usize, held: Held) -> Consumer {
        let key = s.sent[held.message].message.key;
        s.writes[key] += 1;
        if self.is(Broken::KeyApart) {
            return Consumer::Recording { held };
        }
        s.keys[key] = true;
        release(s, consumer);
        ack(held)
    }

    /// What the adapter does with a delivery that failed with `failure`, as `settled` decides
    /// its fate; a genuine attempt is written in the message's ledger.
    fn conclude(&self, s: &mut State, held: Held, failure: Failure) -> Settle {
        if matches!(failure, Failure::Retryable(_) | Failure::Conflict(_)) {
            s.sent[held.message].spent += 1;
        }
        let failure = match failure {
            Failure::Unavailable(reason) if self.is(Broken::OutageCounted) => {
                Failure::Retryable(reason)
            }
            failure => failure,
        };
        let attempt = u32::from(held.attempt);
        match settled(failure, attempt, u32::from(self.max_attempts), held.replay) {
            (Fate::Pause, _) => Settle::Outage,
            (Fate::Dead, _) => Settle::Dead,
            (Fate::Retry | Fate::Rerun, _) => Settle::Retry,
        }
    }
}

/// The handler's possible answers for `held`: an invalid message fails for good, a valid
/// one applies, or, while faults last, fails as a fault would make it.
fn answers(s: &State, consumer: usize, held: Held, actions: &mut Vec<Action>) {
    if !s.sent[held.message].message.valid {
        actions.push(Action::Handle {
            consumer,
            handler: Handler::Permanent,
        });
        return;
    }
    actions.push(Action::Handle {
        consumer,
        handler: Handler::Applied,
    });
    if s.faults_left > 0 {
        for handler in FAULTY_ANSWERS {
            actions.push(Action::Handle { consumer, handler });
        }
    }
}

/// `consumer` takes `message` from its queue: a live delivery, or (`replay`) a dead letter an
/// operator replays, one attempt of its own.
fn take(s: &mut State, message: usize, consumer: usize, replay: bool) -> Option<()> {
    let attempts = match s.sent[message].queued {
        Queued::Ready { attempts } if !replay => attempts,
        Queued::DeadLetter if replay => {
            s.replays_left -= 1;
            0
        }
        _ => return None,
    };
    s.sent[message].queued = Queued::InHand {
        consumer,
        attempts,
        replay,
    };
    let held = Held {
        message,
        attempt: attempts + 1,
        replay,
    };
    s.consumers[consumer] = Consumer::Claiming { held, round: 1 };
    Some(())
}

/// The inbox's verdict `Applied` or `Duplicate`.
fn ack(held: Held) -> Consumer {
    Consumer::Settling {
        held,
        verdict: Settle::Ack,
    }
}

/// The failure the inbox makes of its store failing to claim or commit.
fn store_failed() -> Failure {
    failure_of(RunError::Store(Error::Database(sqlx::Error::PoolTimedOut))).0
}

/// The message `consumer` holds as the broker sees it.
fn holding(s: &State, consumer: usize) -> Option<usize> {
    s.sent
        .iter()
        .position(|sent| matches!(sent.queued, Queued::InHand { consumer: c, .. } if c == consumer))
}

/// Whether the broker still counts `consumer` as the holder of `message`: a delivery lost with
/// its channel cannot be settled through it.
fn holds(s: &State, consumer: usize, message: usize) -> bool {
    matches!(s.sent[message].queued, Queued::InHand { consumer: c, .. } if c == consumer)
}

/// The adapter settles `held` as `verdict` says: an acknowledgement at once, or first a copy
/// (RabbitMQ's delay queue, counting the attempts the verdict says; the dead-letter queue),
/// acknowledged once stored. A crash in between leaves the broker both.
fn settle(s: &mut State, consumer: usize, held: Held, verdict: Settle) -> Consumer {
    if !holds(s, consumer, held.message) {
        return Consumer::Idle;
    }
    let attempts = match verdict {
        Settle::Ack => {
            acknowledge(s, consumer, held.message);
            return Consumer::Idle;
        }
        // A replay that did not apply leaves the dead letter where it was.
        _ if held.replay => {
            s.sent[held.message].queued = Queued::DeadLetter;
            return Consumer::Idle;
        }
        Settle::Dead => {
            dead_letter(s, held.message);
            return Consumer::Acking { held };
        }
        Settle::Retry => held.attempt,
        Settle::Outage => held.attempt - 1,
    };
    let copy = Sent {
        queued: Queued::Ready { attempts },
        ..s.sent[held.message].clone()
    };
    s.sent.push(copy);
    s.sent[held.message].copied = true;
    Consumer::Acking { held }
}

/// Stores a copy of `message` in the dead-letter queue.
fn dead_letter(s: &mut State, message: usize) {
    let letter = Sent {
        queued: Queued::DeadLetter,
        dead: true,
        copied: false,
        ..s.sent[message].clone()
    };
    s.sent.push(letter);
    s.sent[message].dead = true;
}

/// Whether `consumer`'s acknowledgement (after a commit, or after a dead letter) may still
/// settle a message the broker has since queued again or handed to the other consumer, as a
/// JetStream ack may; on RabbitMQ it cannot (the plain `Settle`, which changes nothing then).
fn stale_settles(s: &State, consumer: usize, held: Held, verdict: Settle) -> bool {
    let live = matches!(
        s.sent[held.message].queued,
        Queued::Ready { .. } | Queued::InHand { replay: false, .. }
    );
    live && !held.replay
        && !holds(s, consumer, held.message)
        && matches!(verdict, Settle::Ack | Settle::Dead)
}

/// The broker forgets `message`, if `consumer` still holds it.
fn acknowledge(s: &mut State, consumer: usize, message: usize) {
    if holds(s, consumer, message) {
        s.sent[message].queued = Queued::Acked;
    }
}

/// The broker lost the delivery in hand (its consumer crashed, its channel closed, its ack
/// wait ran out): queued again, one delivery more counted; a replayed dead letter goes back
/// to the dead-letter queue.
fn requeue_lost(sent: &mut Sent) {
    match sent.queued {
        Queued::InHand { replay: true, .. } => sent.queued = Queued::DeadLetter,
        Queued::InHand { attempts, .. } => {
            sent.queued = Queued::Ready {
                attempts: attempts + 1,
            };
            sent.spent += 1;
        }
        Queued::Ready { .. } | Queued::Acked | Queued::DeadLetter => {}
    }
}

/// Ends `consumer`'s transaction: its claim's lock is freed and its uncommitted writes are gone.
fn release(s: &mut State, consumer: usize) {
    for lock in &mut s.locks {
        if *lock == Some(consumer) {
            *lock = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{assert_breaks, assert_holds};
    use super::*;

    #[test]
    fn the_inbox_keeps_every_property() {
        assert_holds("inbox", Inbox::new());
    }

    #[test]
    fn the_inbox_on_one_write_lock_keeps_every_property() {
        assert_holds("inbox, one write lock", Inbox::new().one_write_lock());
    }

    #[test]
    fn an_ack_before_the_commit_loses_a_message() {
        let model = Inbox::new().broken(Broken::AckBeforeCommit);
        assert_breaks("inbox, ack before commit", model, EVERY_MESSAGE_SETTLED);
    }

    #[test]
    fn a_dedupe_key_written_apart_applies_twice() {
        let model = Inbox::new().broken(Broken::KeyApart);
        assert_breaks("inbox, key apart", model, APPLIED_ONCE);
    }

    #[test]
    fn an_outage_counted_as_an_attempt_dead_letters_a_valid_message() {
        let model = Inbox::new().broken(Broken::OutageCounted);
        assert_breaks("inbox, outage counted", model, NO_DEAD_LETTER_FOR_AN_OUTAGE);
    }

    #[test]
    fn a_held_write_lock_counted_as_an_attempt_dead_letters_a_valid_message() {
        let model = Inbox::new()
            .one_write_lock()
            .broken(Broken::WriteLockCounted);
        assert_breaks(
            "inbox, write lock counted",
            model,
            NO_DEAD_LETTER_FOR_AN_OUTAGE,
        );
    }
}
