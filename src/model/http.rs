//! One key under the layer: clients that send one intent and retry it, two app instances
//! that claim, run and record it through the engine's decisions, and a database that keeps
//! records, business rows and the key's lock.
//!
//! The database is trusted to do what the stores ask of it: a claim inserts the key's row in
//! the work's transaction, so a second claim waits on its lock until the first commits (then
//! finds its record) or rolls back (then claims); a commit is atomic; a crash rolls back the
//! open transaction and frees the lock. A record expires at the end of its retention, after
//! which the key is a new intent: each retention period is an epoch.

use std::collections::BTreeSet;

use stateright::{Model, Property};

use crate::engine::Classification;
use crate::engine::decide::{self, Ending, Existing};
use crate::record::RecordState;

/// The bounds of one exploration.
#[derive(Debug, Clone)]
pub(super) struct Http {
    /// Clients sending the same intent with the same key.
    clients: usize,
    /// App instances serving them.
    instances: usize,
    /// Faults in all: crashes, dropped connections, lock waits that run out, retryable answers
    /// and conflict aborts. Past them, the system runs without faults.
    faults: u8,
    /// Records that expire at the end of their retention.
    expiries: u8,
    /// A deliberately broken protocol, to show a property able to fail.
    broken: Option<Broken>,
}

/// Broken protocols, each of which some property must catch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Broken {
    /// The claim reads the key, then inserts its record at commit, overwriting: no unique
    /// constraint and no lock.
    CheckThenInsert,
    /// The claim takes no lock: the record is inserted at commit, and the unique constraint
    /// turns the loser's commit into a rollback.
    InsertAtCommit,
    /// A final refusal is recorded by overwriting the key's record instead of claiming it.
    RefusalOverwrites,
    /// The business writes commit first and the record follows in a transaction of its own.
    RecordApart,
    /// A retryable failure is recorded and replayed like a final refusal.
    RetryableRecorded,
    /// The claim commits an in-flight record on its own before the work runs.
    ClaimCommittedApart,
}

impl Http {
    pub(super) fn new() -> Self {
        let deep = super::deep();
        Self {
            clients: if deep { 3 } else { 2 },
            instances: 2,
            faults: if deep { 3 } else { 2 },
            expiries: 1,
            broken: None,
        }
    }

    pub(super) fn broken(mut self, broken: Broken) -> Self {
        self.broken = Some(broken);
        self
    }

    fn is(&self, broken: Broken) -> bool {
        self.broken == Some(broken)
    }

    /// The claim holds the key's lock until its transaction ends.
    fn locks(&self) -> bool {
        !matches!(
            self.broken,
            Some(Broken::CheckThenInsert | Broken::InsertAtCommit)
        )
    }

    /// How many requests a client sends in all: one, and one retry per fault that can cost it
    /// an answer, and one more to read an answer a retry replays.
    fn sends(&self) -> u8 {
        self.faults * 2 + 2
    }
}

/// An answer, as the bytes a client gets: which attempt produced it, whether it was a final
/// refusal, and the retention period of its record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) struct Answer {
    attempt: u8,
    refused: bool,
    epoch: u8,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct Record {
    state: RecordState,
    answer: Option<Answer>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Instance {
    Idle,
    /// Claiming the key for `client`'s request, in the conflict-retry `round`.
    Claiming {
        client: usize,
        round: u8,
    },
    /// Waiting on the key's lock, held by another instance's transaction.
    Waiting {
        client: usize,
        round: u8,
    },
    /// The work runs in the claim's transaction.
    Working {
        client: usize,
        round: u8,
        attempt: u8,
    },
    /// The work's writes are undone; its final refusal is recorded next.
    Refusing {
        client: usize,
        answer: Answer,
    },
    /// The business writes committed apart from the record, which is written next.
    Recording {
        client: usize,
        answer: Answer,
    },
    /// The answer is on its way to the client.
    Answering {
        client: usize,
        answer: Reply,
    },
}

/// What a client is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Reply {
    /// An answer of the intent, executed now or replayed.
    Final(Answer),
    /// 409: the first is still at work.
    InFlight,
    /// 5xx: nothing was kept; retry.
    Retry,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct Client {
    /// The instance serving its current request.
    waiting_on: Option<usize>,
    sends_left: u8,
    done: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct State {
    record: Option<Record>,
    /// The instance whose open transaction holds the key's lock.
    lock: Option<usize>,
    /// Committed business writes: the attempt and the retention period they committed in.
    business: BTreeSet<(u8, u8)>,
    epoch: u8,
    instances: Vec<Instance>,
    clients: Vec<Client>,
    /// Every final answer a client got.
    answers: BTreeSet<Answer>,
    /// Attempts whose writes the engine must undo with no record: retryable answers, conflict
    /// aborts, crashes.
    undone: BTreeSet<u8>,
    attempts: u8,
    faults_left: u8,
    expiries_left: u8,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Action {
    Send {
        client: usize,
        instance: usize,
    },
    Claim(usize),
    LockFreed(usize),
    LockWaitRunsOut(usize),
    Work {
        instance: usize,
        answer: Classification,
    },
    ConflictAbort(usize),
    RecordRefusal(usize),
    RecordApart(usize),
    Answer(usize),
    Crash(usize),
    DropConnection(usize),
    Expire,
}

const WORK_ANSWERS: [Classification; 3] = [
    Classification::Completed,
    Classification::FailedPermanent,
    Classification::Retryable,
];

impl Model for Http {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            record: None,
            lock: None,
            business: BTreeSet::new(),
            epoch: 0,
            instances: vec![Instance::Idle; self.instances],
            clients: vec![
                Client {
                    waiting_on: None,
                    sends_left: self.sends(),
                    done: false,
                };
                self.clients
            ],
            answers: BTreeSet::new(),
            undone: BTreeSet::new(),
            attempts: 0,
            faults_left: self.faults,
            expiries_left: self.expiries,
        }]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        let fault = state.faults_left > 0;
        for (client, c) in state.clients.iter().enumerate() {
            if c.done || c.sends_left == 0 {
                continue;
            }
            match c.waiting_on {
                None => {
                    // Idle instances are alike: sending to the first is sending to any.
                    if let Some(instance) =
                        state.instances.iter().position(|i| *i == Instance::Idle)
                    {
                        actions.push(Action::Send { client, instance });
                    }
                }
                Some(_) if fault => actions.push(Action::DropConnection(client)),
                Some(_) => {}
            }
        }
        for (instance, i) in state.instances.iter().enumerate() {
            match i {
                Instance::Idle => continue,
                Instance::Claiming { .. } => actions.push(Action::Claim(instance)),
                Instance::Waiting { .. } => {
                    if state.lock.is_none() {
                        actions.push(Action::LockFreed(instance));
                    }
                    if fault {
                        actions.push(Action::LockWaitRunsOut(instance));
                    }
                }
                Instance::Working { .. } => {
                    for answer in WORK_ANSWERS {
                        if answer != Classification::Retryable || fault {
                            actions.push(Action::Work { instance, answer });
                        }
                    }
                    if fault {
                        actions.push(Action::ConflictAbort(instance));
                    }
                }
                Instance::Refusing { .. } => {
                    if !self.locks() || state.lock.is_none() {
                        actions.push(Action::RecordRefusal(instance));
                    }
                }
                Instance::Recording { .. } => actions.push(Action::RecordApart(instance)),
                Instance::Answering { .. } => actions.push(Action::Answer(instance)),
            }
            if fault {
                actions.push(Action::Crash(instance));
            }
        }
        let lasting = state
            .record
            .as_ref()
            .is_some_and(|r| r.state != RecordState::Processing);
        if state.expiries_left > 0 && lasting {
            actions.push(Action::Expire);
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Send { client, instance } => {
                s.clients[client].waiting_on = Some(instance);
                s.clients[client].sends_left -= 1;
                s.instances[instance] = Instance::Claiming { client, round: 1 };
            }
            Action::Claim(instance) | Action::LockFreed(instance) => {
                let (Instance::Claiming { client, round } | Instance::Waiting { client, round }) =
                    s.instances[instance]
                else {
                    return None;
                };
                s.instances[instance] = self.claim(&mut s, instance, client, round);
            }
            Action::LockWaitRunsOut(instance) => {
                let Instance::Waiting { client, .. } = s.instances[instance] else {
                    return None;
                };
                s.faults_left -= 1;
                s.instances[instance] = Instance::Answering {
                    client,
                    answer: Reply::InFlight,
                };
            }
            Action::Work { instance, answer } => self.work(&mut s, instance, answer)?,
            Action::ConflictAbort(instance) => conflict_abort(&mut s, instance)?,
            Action::RecordRefusal(instance) => self.record_refusal(&mut s, instance)?,
            Action::RecordApart(instance) => record_apart(&mut s, instance)?,
            Action::Answer(instance) => answer(&mut s, instance)?,
            Action::Crash(instance) => crash(&mut s, instance),
            Action::DropConnection(client) => {
                s.faults_left -= 1;
                s.clients[client].waiting_on = None;
            }
            Action::Expire => {
                s.expiries_left -= 1;
                s.record = None;
                s.epoch += 1;
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(ONE_EXECUTION, |_, s: &State| {
                (0..=s.epoch).all(|epoch| s.business.iter().filter(|b| b.1 == epoch).count() <= 1)
            }),
            Property::always(REPLAY_IDENTICAL, |_, s: &State| {
                s.answers
                    .iter()
                    .all(|a| s.answers.iter().all(|b| a.epoch != b.epoch || a == b))
            }),
            Property::always(RECORD_IFF_WRITES, |_, s: &State| {
                let completed = s
                    .record
                    .as_ref()
                    .and_then(|r| (r.state == RecordState::Completed).then_some(r.answer?.attempt));
                let written: Vec<u8> = s
                    .business
                    .iter()
                    .filter(|b| b.1 == s.epoch)
                    .map(|b| b.0)
                    .collect();
                written == completed.into_iter().collect::<Vec<_>>()
            }),
            Property::always(NO_RECORD_ROLLED_BACK, |_, s: &State| {
                s.record
                    .as_ref()
                    .and_then(|r| r.answer)
                    .is_none_or(|a| !s.undone.contains(&a.attempt))
            }),
            Property::always(ONE_AT_WORK, |_, s: &State| {
                s.instances
                    .iter()
                    .filter(|i| matches!(i, Instance::Working { .. }))
                    .count()
                    <= 1
            }),
            Property::always(EVERY_INTENT_ANSWERED, |model: &Http, s: &State| {
                let mut next = Vec::new();
                model.actions(s, &mut next);
                !next.is_empty() || s.clients.iter().all(|c| c.done)
            }),
            Property::sometimes("every client answered", |_, s: &State| {
                s.clients.iter().all(|c| c.done)
            }),
        ]
    }
}

/// At most one committed execution per key within a retention period.
pub(super) const ONE_EXECUTION: &str = "at most one committed execution per key";
/// Every final answer of a retention period is the first one, byte for byte.
pub(super) const REPLAY_IDENTICAL: &str = "a replay is identical to the first answer";
/// The key's completed record exists if and only if its business writes committed.
pub(super) const RECORD_IFF_WRITES: &str = "a record exists iff its business writes committed";
/// No record holds an attempt whose writes were rolled back (a refusal's are, on purpose).
pub(super) const NO_RECORD_ROLLED_BACK: &str = "never a record for a rolled-back attempt";
/// A duplicate never starts the business while the first is at work.
pub(super) const ONE_AT_WORK: &str = "a duplicate never starts while the first is at work";
/// Once faults stop, every client ends with an answer of its intent.
pub(super) const EVERY_INTENT_ANSWERED: &str = "every intent is answered once faults stop";

impl Http {
    /// One claim by `instance` for `client`: the database's part (the lock, the record), then
    /// the engine's decision on what it found.
    fn claim(&self, s: &mut State, instance: usize, client: usize, round: u8) -> Instance {
        if self.locks() && s.lock.is_some_and(|holder| holder != instance) {
            return Instance::Waiting { client, round };
        }
        if let Some(record) = &s.record {
            return Instance::Answering {
                client,
                answer: reply_from(record),
            };
        }
        s.attempts += 1;
        let attempt = s.attempts;
        if self.is(Broken::ClaimCommittedApart) {
            s.record = Some(Record {
                state: RecordState::Processing,
                answer: None,
            });
        } else if self.locks() {
            s.lock = Some(instance);
        }
        Instance::Working {
            client,
            round,
            attempt,
        }
    }

    /// The work answered, classified as `answer`: its transaction ends as the engine decides.
    fn end_work(
        &self,
        s: &mut State,
        instance: usize,
        client: usize,
        attempt: u8,
        answer: Classification,
    ) -> Instance {
        let ending = if self.is(Broken::RetryableRecorded) && answer == Classification::Retryable {
            Ending::Refuse
        } else {
            decide::ending(answer, false)
        };
        let epoch = s.epoch;
        let reply = |refused| Answer {
            attempt,
            refused,
            epoch,
        };
        match ending {
            Ending::Commit => {
                let answer = reply(false);
                if self.is(Broken::RecordApart) {
                    release(s, instance);
                    s.business.insert((attempt, s.epoch));
                    return Instance::Recording { client, answer };
                }
                if self.is(Broken::InsertAtCommit) && s.record.is_some() {
                    s.undone.insert(attempt);
                    let record = s.record.as_ref().map(reply_from);
                    return Instance::Answering {
                        client,
                        answer: record.unwrap_or(Reply::Retry),
                    };
                }
                s.business.insert((attempt, s.epoch));
                s.record = Some(Record {
                    state: RecordState::Completed,
                    answer: Some(answer),
                });
                release(s, instance);
                Instance::Answering {
                    client,
                    answer: Reply::Final(answer),
                }
            }
            Ending::Refuse => {
                release(s, instance);
                Instance::Refusing {
                    client,
                    answer: reply(true),
                }
            }
            Ending::RollBack => {
                release(s, instance);
                Instance::Answering {
                    client,
                    answer: Reply::Retry,
                }
            }
        }
    }
    /// The work of `instance` answered, classified as `answer`.
    fn work(&self, s: &mut State, instance: usize, answer: Classification) -> Option<()> {
        let Instance::Working {
            client, attempt, ..
        } = s.instances[instance]
        else {
            return None;
        };
        if answer == Classification::Retryable {
            s.faults_left -= 1;
            s.undone.insert(attempt);
        }
        s.instances[instance] = self.end_work(s, instance, client, attempt, answer);
        Some(())
    }

    /// The refusal of `instance`'s work is recorded in a fresh claim, unless a duplicate that
    /// claimed the key meanwhile recorded its own outcome, which is then the answer.
    fn record_refusal(&self, s: &mut State, instance: usize) -> Option<()> {
        let Instance::Refusing { client, answer } = s.instances[instance] else {
            return None;
        };
        // The refusal's record is written now, in the retention period it starts.
        let answer = Answer {
            epoch: s.epoch,
            ..answer
        };
        let reply = match &s.record {
            Some(record) if !self.is(Broken::RefusalOverwrites) => reply_from(record),
            _ => {
                s.record = Some(Record {
                    state: RecordState::FailedPermanent,
                    answer: Some(answer),
                });
                Reply::Final(answer)
            }
        };
        s.instances[instance] = Instance::Answering {
            client,
            answer: reply,
        };
        Some(())
    }
}

/// What a claim that found `record` answers, as the engine decides it (every client in the
/// model sends the same intent).
fn reply_from(record: &Record) -> Reply {
    match (
        decide::existing(record.state, record.answer.is_some(), true),
        record.answer,
    ) {
        (Existing::Replay, Some(answer)) => Reply::Final(answer),
        (Existing::KeyReused | Existing::Replay | Existing::InFlight, _) => Reply::InFlight,
    }
}

/// The database aborted `instance`'s transaction on a conflict: nothing of it stands, and the
/// engine decides whether to run it again.
fn conflict_abort(s: &mut State, instance: usize) -> Option<()> {
    let Instance::Working {
        client,
        round,
        attempt,
    } = s.instances[instance]
    else {
        return None;
    };
    s.faults_left -= 1;
    s.undone.insert(attempt);
    release(s, instance);
    s.instances[instance] = if decide::run_again(u32::from(round)) {
        Instance::Claiming {
            client,
            round: round + 1,
        }
    } else {
        Instance::Answering {
            client,
            answer: Reply::Retry,
        }
    };
    Some(())
}

/// The record that follows business writes committed apart is written.
fn record_apart(s: &mut State, instance: usize) -> Option<()> {
    let Instance::Recording { client, answer } = s.instances[instance] else {
        return None;
    };
    let answer = Answer {
        epoch: s.epoch,
        ..answer
    };
    s.record = Some(Record {
        state: RecordState::Completed,
        answer: Some(answer),
    });
    s.instances[instance] = Instance::Answering {
        client,
        answer: Reply::Final(answer),
    };
    Some(())
}

/// `instance`'s answer reaches its client, if the client is still listening.
fn answer(s: &mut State, instance: usize) -> Option<()> {
    let Instance::Answering { client, answer } = s.instances[instance] else {
        return None;
    };
    s.instances[instance] = Instance::Idle;
    let c = &mut s.clients[client];
    if c.waiting_on == Some(instance) {
        c.waiting_on = None;
        if let Reply::Final(answer) = answer {
            c.done = true;
            s.answers.insert(answer);
        }
    }
    Some(())
}

/// `instance` crashes: its transaction rolls back, its lock is freed, its client's connection
/// drops.
fn crash(s: &mut State, instance: usize) {
    s.faults_left -= 1;
    if let Instance::Working { attempt, .. } = s.instances[instance] {
        s.undone.insert(attempt);
    }
    release(s, instance);
    s.instances[instance] = Instance::Idle;
    for c in &mut s.clients {
        if c.waiting_on == Some(instance) {
            c.waiting_on = None;
        }
    }
}

/// Ends `instance`'s transaction: its lock is freed and its uncommitted writes are gone.
fn release(s: &mut State, instance: usize) {
    if s.lock == Some(instance) {
        s.lock = None;
    }
}

#[cfg(test)]
mod tests {
    use super::super::{assert_breaks, assert_holds};
    use super::*;

    #[test]
    fn the_http_protocol_keeps_every_property() {
        assert_holds("http", Http::new());
    }

    #[test]
    fn a_check_then_insert_claim_executes_twice() {
        let model = Http::new().broken(Broken::CheckThenInsert);
        assert_breaks("http, check then insert", model, ONE_EXECUTION);
    }

    #[test]
    fn a_refusal_that_overwrites_changes_a_replay() {
        let model = Http::new().broken(Broken::RefusalOverwrites);
        assert_breaks("http, refusal overwrites", model, REPLAY_IDENTICAL);
    }

    #[test]
    fn a_record_written_apart_can_outlive_or_miss_its_writes() {
        let model = Http::new().broken(Broken::RecordApart);
        assert_breaks("http, record apart", model, RECORD_IFF_WRITES);
    }

    #[test]
    fn a_recorded_retryable_failure_keeps_a_rolled_back_attempt() {
        let model = Http::new().broken(Broken::RetryableRecorded);
        assert_breaks("http, retryable recorded", model, NO_RECORD_ROLLED_BACK);
    }

    #[test]
    fn a_claim_without_a_lock_starts_a_duplicate() {
        let model = Http::new().broken(Broken::InsertAtCommit);
        assert_breaks("http, insert at commit", model, ONE_AT_WORK);
    }

    #[test]
    fn an_in_flight_record_committed_apart_strands_its_key() {
        let model = Http::new().broken(Broken::ClaimCommittedApart);
        assert_breaks("http, claim committed apart", model, EVERY_INTENT_ANSWERED);
    }
}
