//! The transactional outbox's dispatch: messages the app commits, two dispatchers that claim
//! them under a lease, look them up, send and settle them through the dispatcher's own
//! decisions ([`decide`]), and a downstream that takes each message's effect.
//!
//! Time is whole ticks, passed to the decisions as [`Millis`]. Work takes no time: a tick
//! passes only when no dispatcher can act and something waits for the clock (a lease to run
//! out, a lookup grace to end, a stalled dispatcher), so in the default bounds every wait is
//! one a fault caused, and the time budget, past the clock's horizon, is never reached. The
//! [late](Outbox::late) bounds also let a tick pass while work waits (a slow dispatcher or
//! database), with a budget of a few ticks: messages then outlive it, a lookup may run past
//! it, and the downstream's retention against the budget decides whether a resend takes
//! effect again. A message that fails past its budget ends as designed, and so does one
//! that waits behind it for an operator. The model's backoffs wait nothing (see
//! [`Outbox::policy`]).
//!
//! The database is trusted to do what the outbox's statements ask of it, and is played here
//! as their effect, not as SQL:
//! - a claim takes a committed pending message that is due, whose lease is free or ran out,
//!   and, for a message with an ordering key, behind no earlier message of its key that is
//!   pending (leased or not) or failed; it leases the message under a new token and, when its
//!   last outcome is known and it has attempts left, begins an attempt (one more attempt,
//!   outcome unknown, last attempt now), all in one atomic write;
//! - beginning an attempt, renewing a lease and settling an outcome each write only while the
//!   row's lease token is the writer's (the lease may have run out, if no claim took it over);
//!   a settle releases the lease;
//! - ids follow commit order within an ordering key (the enqueue's key lock).
//!
//! A dispatcher is the [window](crate::outbox::Dispatcher)'s behaviour, one send slot wide:
//! it claims, starts one message at a time (the others wait for the slot), renews the leases
//! it holds as time passes, records every outcome, and pauses its topic on an outage (one
//! topic here): it then claims only a probe, when [`decide::next_probe`] says, gives its
//! waiting messages back ([`decide::given_back`]) and resumes once a probe gets an answer.
//! Faults, up to a bound: a dispatcher crashes (it restarts holding nothing; a request it had
//! sent may still arrive), stalls (it stops renewing and acting until its leases ran out, then
//! goes on as if nothing happened), a send's answer is lost (the request may or may not have
//! arrived: the outcome is unknown), or the downstream asks for a retry. Outages (the
//! downstream unreachable, nothing done) have a bound of their own. A request arrives within
//! the tick it was sent, so within the lookup grace of its attempt. A refusal (the downstream's
//! final answer, explored in bounds of its own) fails the message for good by design, and
//! holds the later messages of its key.
//!
//! The downstream takes a request's effect, unless it deduplicates and already holds the
//! message's downstream key within its retention (then it answers delivered again); a lookup
//! finds the key within the retention.

use std::time::Duration;

use stateright::{Model, Property};

use crate::backend::{ClaimedMessage, Settlement};
use crate::backoff::Backoff;
use crate::clock::Millis;
use crate::outbox::dispatcher::decide::{self, Attempted, Policy, Step};
use crate::outbox::{DownstreamKey, LookupOutcome, MessageId, OutboxRecord, SendOutcome, Status};

/// One tick of the model's clock.
const TICK: Duration = Duration::from_secs(1);
/// The model's epoch, in milliseconds since the Unix epoch.
const T0_MS: i64 = 1_000_000_000_000;
/// A lease lasts this many ticks unless renewed.
const LEASE: u8 = 1;
/// After an unknown outcome, a lookup that finds nothing within this many ticks of the
/// attempt is not trusted.
const GRACE: u32 = 1;
/// The clock never passes this tick: a bound on the exploration that no run of the default
/// bounds reaches before every message is settled (time passes only for waits that faults
/// cause).
const HORIZON: u8 = 11;

/// The bounds of one exploration.
#[derive(Debug, Clone)]
pub(super) struct Outbox {
    /// Messages the app commits, in id order.
    messages: usize,
    /// The first this many share one ordering key; the others have none.
    keyed: usize,
    /// Dispatchers claiming from the one table.
    dispatchers: usize,
    /// Crashes, stalls, lost answers and retries in all. Past them, nothing fails.
    faults: u8,
    /// Sends that find the downstream unreachable.
    outages: u8,
    /// Sends the downstream refuses for good.
    refusals: u8,
    /// Whether a fault may stall a dispatcher past its leases.
    stalls: bool,
    /// Ticks that may pass while a dispatcher has work: a slow dispatcher or database.
    delays: u8,
    /// Whether the downstream deduplicates by downstream key.
    dedupe: bool,
    /// How many ticks the downstream remembers a downstream key.
    retention: u8,
    policy: Policy,
    /// A deliberately broken protocol, to show a property able to fail.
    broken: Option<Broken>,
}

/// Broken protocols, each of which some property must catch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Broken {
    /// An outage is settled as a retry: it spends an attempt.
    OutageCounted,
    /// After an unknown outcome the message is resent without a lookup, to a downstream that
    /// does not deduplicate (one that relies on lookups, as the guide allows).
    ResendWithoutLookup,
    /// A settle writes whatever the row's lease token: a dispatcher that lost its lease
    /// records its outcome over the new holder's.
    UnfencedSettle,
    /// The claim passes over an earlier message of the key while it is leased (in flight).
    OrderIgnoresInFlight,
    /// The claim passes over an earlier message of the key that failed for good.
    OrderIgnoresFailed,
}

impl Outbox {
    /// The default bounds, or the deeper ones when asked for.
    pub(super) fn new() -> Self {
        let deep = super::deep();
        let faults = if deep { 3 } else { 2 };
        // A third message, without a key, beside two faults explores past 20 GB.
        Self {
            messages: 2,
            keyed: 2,
            dispatchers: 2,
            faults,
            outages: 2,
            refusals: 0,
            stalls: true,
            delays: 0,
            dedupe: true,
            // Past the horizon: with no delays, the budget is never spent.
            retention: HORIZON + 2,
            policy: Self::policy(faults, HORIZON + 1),
            broken: None,
        }
    }

    /// The same bounds with `broken`'s protocol (and the downstream it needs to show).
    pub(super) fn broken(mut self, broken: Broken) -> Self {
        self.broken = Some(broken);
        if broken == Broken::ResendWithoutLookup {
            self = self.without_dedupe();
        }
        self
    }

    /// A downstream that keeps no key and relies on lookups. It takes a stalled dispatcher's
    /// late send a second time (the outbox's documented limit), so dispatchers do not stall.
    pub(super) fn without_dedupe(mut self) -> Self {
        self.dedupe = false;
        self.stalls = false;
        self
    }

    /// A downstream that may refuse a message for good: the message fails at once and holds
    /// the later messages of its key for an operator.
    pub(super) fn refusing(mut self) -> Self {
        self.refusals = 1;
        self
    }

    /// Messages without an ordering key: nothing orders them, and each goes out on its own.
    /// Their interleavings are many more than a key's: one fault and one outage keep the
    /// exploration to seconds.
    pub(super) fn unkeyed(mut self) -> Self {
        self.keyed = 0;
        self.faults = 1;
        self.outages = 1;
        self.policy = Self::policy(self.faults, HORIZON + 1);
        self
    }

    /// Time that passes while dispatchers have work, so that messages outlive their time
    /// budget of `budget` ticks, and a downstream that remembers keys `retention` ticks. Past
    /// its budget a message may fail: that is the budget's purpose.
    pub(super) fn late(mut self, budget: u8, retention: u8) -> Self {
        self.outages = 0;
        self.delays = 1;
        self.retention = retention;
        self.policy = Self::policy(self.faults, budget);
        self
    }

    fn is(&self, broken: Broken) -> bool {
        self.broken == Some(broken)
    }

    /// The dispatcher's settings in ticks. The backoffs are zero: their draws are random, and
    /// a zero wait makes a message due again at once, which allows every schedule a longer
    /// wait allows (a dispatcher may claim it later), so the model explores a superset. An
    /// attempt per fault, and one more: attempts never run out while faults last.
    fn policy(faults: u8, budget: u8) -> Policy {
        let none = Backoff::exponential(Duration::ZERO, Duration::ZERO);
        Policy {
            max_attempts: u32::from(faults) + 1,
            give_up_after: TICK * budget.into(),
            backoff: none,
            lookup_grace: TICK * GRACE,
            probe_backoff: none,
        }
    }

    fn keyed(&self, message: usize) -> bool {
        message < self.keyed
    }
}

/// A message's row, as the claims and writes leave it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Row {
    status: Status,
    attempts: u8,
    unknown: bool,
    created: u8,
    due: u8,
    last_attempt: Option<u8>,
    /// Claims so far: the last one's number is the lease token.
    claims: u8,
    /// The lease token and its expiry.
    lease: Option<(u8, u8)>,
}

/// What a write of a settlement sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Written {
    status: Status,
    attempts: u8,
    unknown: bool,
    due: u8,
    last_attempt: Option<u8>,
}

/// Where a held message is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Stage {
    /// Before its send: `begun` when its claim began the attempt, `looked_up` once a lookup
    /// found nothing to settle.
    Deciding { begun: bool, looked_up: bool },
    /// Its attempt is counted; the request goes next.
    Sending,
    /// Its outcome waits to be written.
    Settling(Written),
}

/// A message a dispatcher holds a lease on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Hold {
    message: usize,
    token: u8,
    /// The lease's expiry as last written.
    until: u8,
    /// It has the send slot (its lookup or send runs).
    started: bool,
    stage: Stage,
    /// The row as the claim returned it, and as this dispatcher changed it since.
    seen: Row,
}

/// A topic paused for an outage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Paused {
    /// Sends that found it unavailable.
    probes: u8,
    /// When the next probe may be claimed.
    until: u8,
    /// The probe's lease, while one is held.
    probe: Option<(usize, u8)>,
}

/// A dispatcher: the leases it holds and whether it runs.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct Dispatcher {
    /// Sorted by message and token, so that equal states are equal.
    holds: Vec<Hold>,
    /// Neither renews nor acts until its leases ran out.
    stalled: bool,
    paused: Option<Paused>,
}

/// The table, the dispatchers, the downstream and the faults left.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct State {
    /// The clock, in ticks.
    now: u8,
    /// The committed messages' rows, in id order.
    rows: Vec<Row>,
    dispatchers: Vec<Dispatcher>,
    /// Requests sent whose sender is no longer waiting for them (sorted): they may still
    /// arrive within the tick.
    orphans: Vec<usize>,
    /// When the downstream last took each message's effect, which it remembers for its
    /// retention.
    applied: Vec<Option<u8>>,
    /// Every effect the downstream took, in order.
    effects: Vec<usize>,
    /// A settle turned a delivered message back.
    regressed: bool,
    faults_left: u8,
    outages_left: u8,
    refusals_left: u8,
    /// The messages the downstream refused (sorted): their failure is its answer.
    refused: Vec<usize>,
    delays_left: u8,
}

/// How the downstream takes a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Answer {
    /// It takes the effect (or holds it already) and says so.
    Done,
    /// Reached, not done: retry later (a fault).
    Busy,
    /// Unreachable: nothing done (an outage).
    Down,
    /// Reached, and refused for good: nothing done.
    Refuse,
}

/// One step of the app, a dispatcher, the downstream or the clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Action {
    /// The app commits the next message.
    Commit(usize),
    Claim {
        dispatcher: usize,
        message: usize,
    },
    Step {
        dispatcher: usize,
        hold: usize,
    },
    Send {
        dispatcher: usize,
        hold: usize,
        answer: Answer,
    },
    /// The request leaves and its answer is lost.
    LoseAnswer {
        dispatcher: usize,
        hold: usize,
    },
    Settle {
        dispatcher: usize,
        hold: usize,
    },
    Crash(usize),
    Stall(usize),
    /// A request whose sender stopped waiting arrives.
    Arrive(usize),
    /// Time passes for what waits on it.
    Tick,
    /// Time passes while work waits.
    Delay,
}

impl Model for Outbox {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let idle = Dispatcher {
            holds: Vec::new(),
            stalled: false,
            paused: None,
        };
        vec![State {
            now: 0,
            rows: Vec::new(),
            dispatchers: vec![idle; self.dispatchers],
            orphans: Vec::new(),
            applied: vec![None; self.messages],
            effects: Vec::new(),
            regressed: false,
            faults_left: self.faults,
            outages_left: self.outages,
            refusals_left: self.refusals,
            refused: Vec::new(),
            delays_left: self.delays,
        }]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        self.work(state, actions);
        if state.now < HORIZON {
            // Work takes no time: the clock moves only for what waits on it, or for a delay.
            if !actions.is_empty() && state.delays_left > 0 {
                actions.push(Action::Delay);
            } else if actions.is_empty() && waits(state) {
                actions.push(Action::Tick);
            }
        }
        if state.rows.len() < self.messages {
            actions.push(Action::Commit(state.rows.len()));
        }
        for (orphan, message) in state.orphans.iter().enumerate() {
            // Two requests for one message arrive alike.
            if orphan == 0 || state.orphans[orphan - 1] != *message {
                actions.push(Action::Arrive(orphan));
            }
        }
        if state.faults_left > 0 {
            for (dispatcher, d) in state.dispatchers.iter().enumerate() {
                if !d.holds.is_empty() {
                    actions.push(Action::Crash(dispatcher));
                    if self.stalls && !d.stalled {
                        actions.push(Action::Stall(dispatcher));
                    }
                }
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            // Commits come in id order: the action names the message for the trace.
            Action::Commit(_) => s.rows.push(Row {
                status: Status::Pending,
                attempts: 0,
                unknown: false,
                created: s.now,
                due: s.now,
                last_attempt: None,
                claims: 0,
                lease: None,
            }),
            Action::Claim {
                dispatcher,
                message,
            } => self.claim(&mut s, dispatcher, message),
            Action::Step { dispatcher, hold } => self.step(&mut s, dispatcher, hold),
            Action::Send {
                dispatcher,
                hold,
                answer,
            } => self.send(&mut s, dispatcher, hold, answer),
            Action::LoseAnswer { dispatcher, hold } => {
                s.faults_left -= 1;
                let message = s.dispatchers[dispatcher].holds[hold].message;
                s.orphans.push(message);
                s.orphans.sort_unstable();
                let outcome = SendOutcome::Unknown {
                    reason: "no answer".to_owned(),
                };
                self.answered(&mut s, dispatcher, hold, outcome);
            }
            Action::Settle { dispatcher, hold } => self.settle(&mut s, dispatcher, hold),
            Action::Crash(dispatcher) => crash(&mut s, dispatcher),
            Action::Stall(dispatcher) => {
                s.faults_left -= 1;
                s.dispatchers[dispatcher].stalled = true;
            }
            Action::Arrive(orphan) => {
                let message = s.orphans.remove(orphan);
                self.take(&mut s, message);
            }
            Action::Tick => tick(&mut s),
            Action::Delay => {
                s.delays_left -= 1;
                tick(&mut s);
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(ONE_EFFECT, |_, s: &State| {
                s.effects
                    .iter()
                    .enumerate()
                    .all(|(i, m)| !s.effects[..i].contains(m))
            }),
            Property::always(KEY_ORDER, |model: &Outbox, s: &State| {
                s.effects.iter().enumerate().all(|(i, &m)| {
                    !model.keyed(m) || (0..m).all(|earlier| s.effects[..i].contains(&earlier))
                })
            }),
            Property::always(DELIVERED_FINAL, |_, s: &State| !s.regressed),
            Property::always(EVERY_MESSAGE_DELIVERED, |model: &Outbox, s: &State| {
                let mut next = Vec::new();
                model.actions(s, &mut next);
                !next.is_empty() || model.all_ended(s)
            }),
            Property::sometimes("every message delivered", |model: &Outbox, s: &State| {
                model.all_delivered(s)
            }),
        ]
    }
}

/// No downstream key takes effect twice.
pub(super) const ONE_EFFECT: &str = "at most one downstream effect per downstream key";
/// Messages of one ordering key take effect in commit order.
pub(super) const KEY_ORDER: &str = "a key's messages take effect in commit order";
/// A message recorded delivered stays delivered.
pub(super) const DELIVERED_FINAL: &str = "a recorded delivery is final";
/// Once faults stop, every message ends delivered (or failed past its budget where time outlived
/// it, or refused by the downstream, or held behind such a message): none fails for an outage
/// or for lack of attempts, no key stays held by a lease.
pub(super) const EVERY_MESSAGE_DELIVERED: &str = "every message is delivered once faults stop";

impl Outbox {
    fn all_delivered(&self, s: &State) -> bool {
        s.rows.len() == self.messages && s.rows.iter().all(|r| r.status == Status::Delivered)
    }

    /// Every message is delivered, or failed past its time budget or on the downstream's
    /// refusal, or waits for an operator behind a message of its key that failed.
    fn all_ended(&self, s: &State) -> bool {
        let now = TICK * s.now.into();
        let failed = |m: usize| {
            let r = &s.rows[m];
            r.status == Status::Failed
                && (s.refused.binary_search(&m).is_ok()
                    || now >= TICK * r.created.into() + self.policy.give_up_after)
        };
        s.rows.len() == self.messages
            && (0..s.rows.len()).all(|m| {
                s.rows[m].status == Status::Delivered
                    || failed(m)
                    || (self.keyed(m) && (0..m).any(failed))
            })
    }

    /// The dispatchers' next steps, none of which waits for the clock.
    fn work(&self, s: &State, actions: &mut Vec<Action>) {
        for (dispatcher, d) in s.dispatchers.iter().enumerate() {
            if d.stalled {
                continue;
            }
            let claims = d
                .paused
                .is_none_or(|p| p.probe.is_none() && p.until <= s.now);
            if claims {
                for message in (0..s.rows.len()).filter(|&m| self.claimable(s, m)) {
                    actions.push(Action::Claim {
                        dispatcher,
                        message,
                    });
                }
            }
            let slot_taken = d.holds.iter().any(|h| h.started);
            for (hold, h) in d.holds.iter().enumerate() {
                match h.stage {
                    Stage::Deciding { .. } if h.started || !slot_taken => {
                        actions.push(Action::Step { dispatcher, hold });
                    }
                    Stage::Deciding { .. } => {}
                    Stage::Sending => {
                        let send = |answer| Action::Send {
                            dispatcher,
                            hold,
                            answer,
                        };
                        actions.push(send(Answer::Done));
                        if s.faults_left > 0 {
                            actions.push(send(Answer::Busy));
                            actions.push(Action::LoseAnswer { dispatcher, hold });
                        }
                        if s.outages_left > 0 {
                            actions.push(send(Answer::Down));
                        }
                        // A downstream that took the effect answers a resend with it.
                        let message = d.holds[hold].message;
                        if s.refusals_left > 0 && s.applied[message].is_none() {
                            actions.push(send(Answer::Refuse));
                        }
                    }
                    Stage::Settling(_) => actions.push(Action::Settle { dispatcher, hold }),
                }
            }
        }
    }

    /// Whether a claim at `s.now` takes `message`: the database's part of the claim.
    fn claimable(&self, s: &State, message: usize) -> bool {
        let row = &s.rows[message];
        let free = row.lease.is_none_or(|(_, until)| until <= s.now);
        let in_order = !self.keyed(message)
            || s.rows[..message]
                .iter()
                .enumerate()
                .filter(|(earlier, _)| self.keyed(*earlier))
                .all(|(_, r)| {
                    let in_flight = r.lease.is_some_and(|(_, until)| until > s.now);
                    !matches!(r.status, Status::Pending | Status::Failed)
                        || (self.is(Broken::OrderIgnoresInFlight) && in_flight)
                        || (self.is(Broken::OrderIgnoresFailed) && r.status == Status::Failed)
                });
        row.status == Status::Pending && row.due <= s.now && free && in_order
    }

    /// A claim by `dispatcher` of `message`: a new lease, and the attempt begun when the
    /// message is sent now.
    fn claim(&self, s: &mut State, dispatcher: usize, message: usize) {
        let now = s.now;
        let max_attempts = self.policy.max_attempts;
        let row = &mut s.rows[message];
        row.claims += 1;
        let token = row.claims;
        row.lease = Some((token, now + LEASE));
        let begun = !row.unknown && u32::from(row.attempts) < max_attempts;
        if begun {
            row.attempts += 1;
            row.unknown = true;
            row.last_attempt = Some(now);
        }
        let hold = Hold {
            message,
            token,
            until: now + LEASE,
            started: false,
            stage: Stage::Deciding {
                begun,
                looked_up: false,
            },
            seen: *row,
        };
        let d = &mut s.dispatchers[dispatcher];
        if let Some(paused) = &mut d.paused {
            paused.probe = Some((message, token));
        }
        d.holds.push(hold);
        d.holds.sort_unstable_by_key(|h| (h.message, h.token));
    }
}

impl Outbox {
    /// A held message's next step before its send, as [`decide::before_send`] says; a lookup
    /// runs at once, as the step's I/O.
    fn step(&self, s: &mut State, dispatcher: usize, hold: usize) {
        let now = s.now;
        let h = &mut s.dispatchers[dispatcher].holds[hold];
        h.started = true;
        let Stage::Deciding { begun, looked_up } = h.stage else {
            return;
        };
        let h = *h;
        let record = self.record(h.message, &h.seen);
        let looked_up = looked_up || self.is(Broken::ResendWithoutLookup);
        match decide::before_send(&self.policy, &record, begun, looked_up, at(now)) {
            Step::LookUp => {
                let found = self.lookup(s, h.message);
                match decide::after_lookup(&self.policy, &record, Some(found), at(now)) {
                    Some(settlement) => self.settling(s, dispatcher, hold, settlement.into()),
                    None => {
                        s.dispatchers[dispatcher].holds[hold].stage = Stage::Deciding {
                            begun,
                            looked_up: true,
                        };
                    }
                }
            }
            Step::GiveUp(attempted) => self.settling(s, dispatcher, hold, attempted),
            Step::BeginAttempt => {
                let row = &mut s.rows[h.message];
                if !fenced(row, &h) {
                    s.dispatchers[dispatcher].holds.remove(hold);
                    probe_lost(&mut s.dispatchers[dispatcher], &h, now);
                    return;
                }
                row.attempts += 1;
                row.unknown = true;
                row.last_attempt = Some(now);
                let h = &mut s.dispatchers[dispatcher].holds[hold];
                h.seen = *row;
                h.stage = Stage::Sending;
            }
            Step::Send => s.dispatchers[dispatcher].holds[hold].stage = Stage::Sending,
        }
    }

    /// A request that gets an answer: the downstream takes it as `answer` says.
    fn send(&self, s: &mut State, dispatcher: usize, hold: usize, answer: Answer) {
        let message = s.dispatchers[dispatcher].holds[hold].message;
        let outcome = match answer {
            Answer::Done => {
                self.take(s, message);
                SendOutcome::Delivered {
                    receipt: "receipt".to_owned(),
                }
            }
            Answer::Busy => {
                s.faults_left -= 1;
                SendOutcome::Retry {
                    after: None,
                    reason: "busy".to_owned(),
                }
            }
            Answer::Down if self.is(Broken::OutageCounted) => {
                s.outages_left -= 1;
                SendOutcome::Retry {
                    after: None,
                    reason: "unavailable".to_owned(),
                }
            }
            Answer::Down => {
                s.outages_left -= 1;
                SendOutcome::Unavailable {
                    after: None,
                    reason: "unavailable".to_owned(),
                }
            }
            Answer::Refuse => {
                s.refusals_left -= 1;
                s.refused.push(message);
                s.refused.sort_unstable();
                SendOutcome::Rejected {
                    reason: "refused".to_owned(),
                }
            }
        };
        self.answered(s, dispatcher, hold, outcome);
    }

    /// What a send's `outcome` makes of the message, as [`decide::settle_outcome`] says.
    fn answered(&self, s: &mut State, dispatcher: usize, hold: usize, outcome: SendOutcome) {
        let now = at(s.now);
        let h = &mut s.dispatchers[dispatcher].holds[hold];
        // The attempt starts with its send, and its outcome records so.
        h.seen.last_attempt = Some(s.now);
        let record = self.record(h.message, &h.seen);
        let mut attempted = decide::settle_outcome(&self.policy, &record, outcome, now);
        attempted.settlement.last_attempt_at = Some(now);
        self.settling(s, dispatcher, hold, attempted);
    }

    /// The held message's outcome waits to be written; the send slot is free again, and the
    /// dispatcher learns whether the destination is reachable.
    fn settling(&self, s: &mut State, dispatcher: usize, hold: usize, attempted: Attempted) {
        let now = s.now;
        let d = &mut s.dispatchers[dispatcher];
        let h = &mut d.holds[hold];
        h.stage = Stage::Settling(written(&attempted.settlement));
        h.started = false;
        let lease = (h.message, h.token);
        let probing = d.paused.is_some_and(|p| p.probe == Some(lease));
        if attempted.outage.is_none() {
            if probing {
                d.paused = None;
            }
            return;
        }
        match &mut d.paused {
            None => {
                let until = decide::next_probe(&self.policy, 1, None, at(now));
                d.paused = Some(Paused {
                    probes: 1,
                    until: tick_of(until),
                    probe: None,
                });
                self.give_back(d);
            }
            Some(paused) if probing => {
                paused.probes += 1;
                let until = decide::next_probe(&self.policy, paused.probes.into(), None, at(now));
                paused.until = tick_of(until);
                paused.probe = None;
            }
            // Sent before the pause began.
            Some(_) => {}
        }
    }

    /// The messages waiting for the send slot go back, due as they were, as
    /// [`decide::given_back`] says.
    fn give_back(&self, d: &mut Dispatcher) {
        for h in &mut d.holds {
            let Stage::Deciding { begun, .. } = h.stage else {
                continue;
            };
            if h.started {
                continue;
            }
            let record = self.record(h.message, &h.seen);
            let due = Millis::from(record.next_attempt_at);
            let claimed = ClaimedMessage {
                record,
                attempt_begun: begun,
            };
            h.stage = Stage::Settling(written(&decide::given_back(claimed, due)));
        }
    }

    /// The write of a held message's outcome, which releases its lease; only while the lease
    /// is still the holder's.
    fn settle(&self, s: &mut State, dispatcher: usize, hold: usize) {
        let h = s.dispatchers[dispatcher].holds.remove(hold);
        let Stage::Settling(w) = h.stage else {
            return;
        };
        let row = &mut s.rows[h.message];
        if !fenced(row, &h) && !self.is(Broken::UnfencedSettle) {
            return;
        }
        if row.status == Status::Delivered && w.status != Status::Delivered {
            s.regressed = true;
        }
        row.status = w.status;
        row.attempts = w.attempts;
        row.unknown = w.unknown;
        row.due = w.due;
        row.last_attempt = w.last_attempt.or(row.last_attempt);
        row.lease = None;
    }

    /// The downstream takes a request for `message`: its effect, unless it deduplicates and
    /// holds the message's key.
    fn take(&self, s: &mut State, message: usize) {
        if self.dedupe && self.retained(s, message) {
            return;
        }
        s.effects.push(message);
        s.applied[message] = Some(s.now);
    }

    /// Whether the downstream still holds `message`'s key.
    fn retained(&self, s: &State, message: usize) -> bool {
        s.applied[message].is_some_and(|at| s.now < at.saturating_add(self.retention))
    }

    fn lookup(&self, s: &State, message: usize) -> LookupOutcome {
        if self.retained(s, message) {
            LookupOutcome::Found {
                receipt: "receipt".to_owned(),
            }
        } else {
            LookupOutcome::NotFound
        }
    }
}

/// `dispatcher` crashes and restarts holding nothing: a request it had sent may still
/// arrive.
fn crash(s: &mut State, dispatcher: usize) {
    s.faults_left -= 1;
    let d = &mut s.dispatchers[dispatcher];
    for hold in d.holds.drain(..) {
        if hold.stage == Stage::Sending {
            s.orphans.push(hold.message);
        }
    }
    s.orphans.sort_unstable();
    d.stalled = false;
    d.paused = None;
}

/// Whether something waits for the clock: a message not yet due or leased, a stalled
/// dispatcher.
fn waits(s: &State) -> bool {
    s.dispatchers.iter().any(|d| d.stalled)
        || s.rows.iter().any(|r| {
            r.status == Status::Pending
                && (r.due > s.now || r.lease.is_some_and(|(_, until)| until > s.now))
        })
}

/// A tick passes: requests in flight have arrived or never will, and the live dispatchers
/// renew the leases they hold; a stalled one goes on once its leases ran out.
fn tick(s: &mut State) {
    s.now += 1;
    s.orphans.clear();
    let now = s.now;
    for d in &mut s.dispatchers {
        if d.stalled {
            d.stalled = d.holds.iter().any(|h| h.until > now);
            continue;
        }
        for h in &mut d.holds {
            let row = &mut s.rows[h.message];
            if fenced(row, h) {
                row.lease = Some((h.token, now + LEASE));
                h.until = now + LEASE;
            }
        }
    }
}

impl Outbox {
    /// `message`'s row as the crate reads it.
    fn record(&self, message: usize, row: &Row) -> OutboxRecord {
        OutboxRecord {
            id: MessageId::from(i64::try_from(message).unwrap_or(i64::MAX)),
            topic: "topic".to_owned(),
            downstream_key: DownstreamKey::from_stored(format!("message-{message}")),
            payload: Vec::new(),
            status: row.status,
            attempts: row.attempts.into(),
            outcome_unknown: row.unknown,
            receipt: None,
            last_error: None,
            created_at: at(row.created).into(),
            next_attempt_at: at(row.due).into(),
            last_attempt_at: row.last_attempt.map(|t| at(t).into()),
            finished_at: None,
            requeued_at: None,
            ordering_key: self.keyed(message).then(|| "order".to_owned()),
        }
    }
}

/// Whether `row` is still leased under `hold`'s token (whether or not the lease ran out).
fn fenced(row: &Row, hold: &Hold) -> bool {
    row.lease.is_some_and(|(token, _)| token == hold.token)
}

/// A probe that ended without an answer of the destination: another is claimed at once.
fn probe_lost(d: &mut Dispatcher, hold: &Hold, now: u8) {
    if let Some(paused) = &mut d.paused
        && paused.probe == Some((hold.message, hold.token))
    {
        paused.probe = None;
        paused.until = now;
    }
}

/// What a settlement writes, in ticks. Its error text and receipt decide nothing.
fn written(settlement: &Settlement) -> Written {
    Written {
        status: settlement.status,
        attempts: u8::try_from(settlement.attempts).unwrap_or(u8::MAX),
        unknown: settlement.outcome_unknown,
        due: tick_of(settlement.next_attempt_at),
        last_attempt: settlement.last_attempt_at.map(tick_of),
    }
}

/// Tick `tick` as the crate's time.
fn at(tick: u8) -> Millis {
    Millis::from_column(T0_MS + i64::from(tick) * 1000)
}

/// The first tick at or after `millis`.
fn tick_of(millis: Millis) -> u8 {
    let ticks = u64::try_from(millis.column() - T0_MS)
        .unwrap_or(0)
        .div_ceil(1000);
    u8::try_from(ticks).unwrap_or(u8::MAX)
}

#[cfg(test)]
mod tests {
    use super::super::{assert_breaks, assert_holds};
    use super::*;

    #[test]
    fn the_outbox_keeps_every_property() {
        assert_holds("outbox", Outbox::new());
    }

    #[test]
    fn a_refused_message_fails_alone_and_holds_its_key() {
        assert_holds("outbox, refusals", Outbox::new().refusing());
    }

    #[test]
    fn a_claim_past_a_failed_message_breaks_its_keys_order() {
        let model = Outbox::new().refusing().broken(Broken::OrderIgnoresFailed);
        assert_breaks("outbox, order past a failed message", model, KEY_ORDER);
    }

    #[test]
    fn messages_without_a_key_are_each_delivered_once() {
        assert_holds("outbox, no ordering key", Outbox::new().unkeyed());
    }

    #[test]
    fn a_downstream_without_dedupe_is_kept_to_one_effect_by_lookups() {
        assert_holds("outbox, no dedupe", Outbox::new().without_dedupe());
    }

    #[test]
    fn a_message_past_its_budget_fails_and_takes_effect_once_within_a_longer_retention() {
        assert_holds("outbox, late", Outbox::new().late(3, 4));
    }

    #[test]
    fn a_retention_shorter_than_the_budget_takes_effect_twice() {
        let model = Outbox::new().late(3, 2);
        assert_breaks(
            "outbox, retention shorter than the budget",
            model,
            ONE_EFFECT,
        );
    }

    #[test]
    fn a_downstream_without_dedupe_takes_a_stalled_dispatchers_late_send_twice() {
        let model = Outbox {
            stalls: true,
            ..Outbox::new().without_dedupe()
        };
        assert_breaks("outbox, no dedupe, stalls", model, ONE_EFFECT);
    }

    #[test]
    fn an_outage_counted_as_an_attempt_fails_a_message() {
        let model = Outbox::new().broken(Broken::OutageCounted);
        assert_breaks("outbox, outage counted", model, EVERY_MESSAGE_DELIVERED);
    }

    #[test]
    fn a_resend_without_a_lookup_takes_effect_twice() {
        let model = Outbox::new().broken(Broken::ResendWithoutLookup);
        assert_breaks("outbox, resend without lookup", model, ONE_EFFECT);
    }

    #[test]
    fn an_unfenced_settle_undoes_a_delivery() {
        let model = Outbox::new().broken(Broken::UnfencedSettle);
        assert_breaks("outbox, unfenced settle", model, DELIVERED_FINAL);
    }

    #[test]
    fn a_claim_past_the_key_in_flight_reorders_it() {
        let model = Outbox::new().broken(Broken::OrderIgnoresInFlight);
        assert_breaks("outbox, order ignores in flight", model, KEY_ORDER);
    }
}
