//! The dispatcher's sends in flight and when the database writes around them run; the writes
//! and the sends themselves are the [`Flight`]'s, what each outcome means is `decide`'s.
//!
//! Up to `batch_size` sends run at once; a claim refills the window as they finish rather than
//! after the last of a batch, so the downstream is never left idle while the dispatcher waits for
//! its slowest send. Claims run up to two batches ahead of the free send slots: a slot that frees
//! starts the next claimed message at once instead of waiting for a claim's round trip, which
//! otherwise bounds the relay to a batch per (claim + send) rather than per send. The writes are
//! batched: one claim leases many messages and begins their attempts, one settle records every
//! outcome that finished meanwhile, one renewal extends every lease held. At most two claims, one
//! settle and one renewal run at a time; on a database with one writer they queue in the process,
//! not in the database's lock wait.
//!
//! Messages also arrive without a claim: a commit of this process hands over what it enqueued,
//! written leased to this window (see `handoff`). The window takes them as a claim's messages,
//! while fewer than two batches wait for a send slot.
//!
//! A destination found unavailable pauses its topic alone: the claims leave the topic out, so
//! its messages wait in the database untouched however many there are, and the other topics
//! keep flowing. A claim of its own, for one message of the topic, takes the probe when the
//! probe backoff says; the probe's answer resumes the topic, whose messages the next claims
//! then take at full speed. A probe that finds the destination still unavailable is the only
//! message written meanwhile, its attempt not counted. The messages of the topic held when it
//! paused (claimed with others, waiting for a send slot) go back once, due as they were.
//!
//! Nothing here can reorder two messages of one ordering key: a claim never hands out a
//! message while an earlier one of its key is still pending, and each way a held message goes
//! back (given back when its topic pauses or at shutdown, settled for a retry) writes it
//! pending again, so it keeps its key's later messages in the database until it is delivered.

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use tokio::sync::watch;
use tokio::time::Instant;

use super::decide::{self, Attempted, Outage};
use super::flight::{Flight, Sent, Written, lease_token};
use super::metrics;
use super::sleep_until;
use crate::Backend;
use crate::backend::{Claim, ClaimedMessage as Claimed, Lease, Settlement, Topics};
use crate::clock::Millis;
use crate::outbox::handoff::{Counter, Handover};
use crate::outbox::{Message, Sender};

type Op<'d, T> = Pin<Box<dyn Future<Output = T> + Send + 'd>>;

/// What the dispatcher knows of a message it holds a lease on, from its claim until its
/// outcome is recorded. Kept by lease, not by message: a message given back due now (a retry
/// at once, one of a topic that just paused, which its probe may take) can be claimed again by
/// another of the dispatcher's claims before the write that gave it back is reported, and the
/// old lease's report must not touch the new one.
struct Held {
    /// The lease's expiry as last written.
    until: Millis,
    /// Its outcome is being written: a renewal that no longer finds the lease raced the settle.
    settling: bool,
    /// Another dispatcher took it over; its outcome is not recorded.
    lost: bool,
}

/// Something that finished.
pub(super) enum Event {
    Claimed(Claim, Topics, Result<Vec<Claimed>, sqlx::Error>),
    Sent(Lease, String, Sent),
    Settled(Vec<Lease>, Written),
    Renewed(Vec<Lease>, Millis, Written),
    Released(Vec<Lease>, Written),
    /// A commit of this process handed a message over, leased to this window.
    Handed(Handover),
    RenewalDue,
    /// The sender's client reconnected.
    Reconnected,
    /// A paused topic's probe is due.
    ProbeDue,
}

/// A topic whose destination is unavailable. The claims leave it out; its messages wait in
/// the database, as they were, until a probe gets an answer.
struct Paused {
    since: Instant,
    /// How many sends found it unavailable: the first outage, then each probe.
    probes: u32,
    /// When the next probe may be claimed, by the outbox's clock.
    until: Millis,
    /// The destination's `Retry-After` when it last said it was unavailable, if it gave one.
    retry_after: Option<Duration>,
    probe: Probe,
}

/// Where a paused topic's probe is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Probe {
    /// Claimed at `until`.
    Waiting,
    /// Its claim is on its way.
    Claiming,
    /// Being sent under this lease.
    Sending(Lease),
}

/// What a finished claim found.
#[derive(Debug, Clone, Copy)]
pub(super) struct Found {
    pub(super) claimed: usize,
    pub(super) asked: usize,
}

/// A dispatcher's messages from their claim to their recorded outcome: which are sent when,
/// which wait, which go back, and which writes run. Their I/O is the [`Flight`]'s.
pub(super) struct Window<'d, DB: Backend, S> {
    flight: &'d Flight<DB, S>,
    /// How many sends run at once.
    batch: usize,
    held: HashMap<Lease, Held>,
    sends: FuturesUnordered<Op<'d, (Lease, String, Sent)>>,
    /// Claimed messages waiting for a send slot, oldest first; their leases are held and
    /// renewed like those being sent.
    ready: VecDeque<(Lease, Claimed)>,
    /// Outcomes waiting for the settle in progress to finish.
    outcomes: Vec<(Lease, Settlement)>,
    /// The follow-ups of the delivered messages among them, enqueued by the same settle.
    follow_ups: Vec<Message>,
    claims: FuturesUnordered<Op<'d, Event>>,
    /// How many messages the claims in progress may still bring.
    asked: usize,
    /// The last claim found all it asked for, so more are likely due.
    busy: bool,
    settling: Option<Op<'d, Event>>,
    renewing: Option<Op<'d, Event>>,
    releasing: FuturesUnordered<Op<'d, Event>>,
    /// Shutting down: messages a claim brings that find no free slot are given back.
    stopping: bool,
    /// Claims the probes of paused topics; a window of a single claim does not.
    probing: bool,
    next_renewal: Instant,
    /// Paused topics; a sender may serve several destinations, one per topic.
    paused: HashMap<String, Paused>,
    /// The sender's signal that its client reconnected, if it has one.
    reconnected: Option<watch::Receiver<u64>>,
    /// Messages were made due (a commit, a topic resumed) that no claim has looked for yet:
    /// claim without resting.
    woken: bool,
    /// Where the commits of this process hand their messages to this window, if they do.
    counter: Option<Counter>,
}

impl<'d, DB: Backend, S: Sender> Window<'d, DB, S> {
    pub(super) fn new(flight: &'d Flight<DB, S>, batch_size: u32) -> Self {
        Self {
            flight,
            batch: batch_size as usize,
            held: HashMap::new(),
            sends: FuturesUnordered::new(),
            ready: VecDeque::new(),
            outcomes: Vec::new(),
            follow_ups: Vec::new(),
            claims: FuturesUnordered::new(),
            asked: 0,
            busy: false,
            settling: None,
            renewing: None,
            releasing: FuturesUnordered::new(),
            stopping: false,
            probing: false,
            next_renewal: Instant::now() + flight.renewal_interval(),
            paused: HashMap::new(),
            reconnected: flight.reconnected(),
            woken: false,
            counter: None,
        }
    }

    /// Takes the messages the commits of this process hand over, up to a batch of them not yet
    /// started (see `handoff`).
    #[must_use]
    pub(super) fn handing(mut self) -> Self {
        let handoff = self.flight.outbox.handoff();
        self.counter = Some(handoff.open(lease_token(), self.flight.lease, self.batch));
        self
    }

    /// Probes the topics that pause at their probe backoff's time (or when the sender's client
    /// reconnects), and resumes them once one answers; without it, as for a single claim, a
    /// topic that pauses stays paused for the window's life.
    #[must_use]
    pub(super) fn probing(mut self) -> Self {
        self.probing = true;
        self
    }

    /// Whether messages were made due (a commit, a paused topic resumed) that no claim started
    /// since has looked for: the dispatcher claims for them rather than resting.
    pub(super) fn woken(&self) -> bool {
        self.woken
    }

    /// Messages were committed: the next claim is for them, even with claims under way.
    pub(super) fn wake(&mut self) {
        self.woken = true;
    }

    /// Nothing held, nothing being written: a shutdown may return.
    pub(super) fn is_empty(&self) -> bool {
        self.held.is_empty()
            && self.claims.is_empty()
            && self.settling.is_none()
            && self.renewing.is_none()
            && self.releasing.is_empty()
    }

    /// For a shutdown: gives back the messages still waiting for a send slot without counting
    /// the attempts their claim began, so the next dispatcher sends them as first sent. Those
    /// claimed for a lookup or to fail had nothing begun: their rows are written back as the
    /// claim found them, lease released.
    pub(super) fn stop(&mut self) {
        self.stopping = true;
        let left = self
            .counter
            .as_mut()
            .map(Counter::close)
            .unwrap_or_default();
        for handover in left {
            self.handed(handover);
        }
        self.give_back();
    }

    /// Gives back the messages waiting for a send slot, their attempts not counted.
    fn give_back(&mut self) {
        let mut unsent = Vec::new();
        for (lease, message) in std::mem::take(&mut self.ready) {
            if message.attempt_begun {
                unsent.push(lease);
            } else {
                self.put_back(lease, message);
            }
        }
        if unsent.is_empty() {
            return;
        }
        for lease in &unsent {
            if let Some(held) = self.held.get_mut(lease) {
                held.settling = true;
            }
        }
        let flight = self.flight;
        self.releasing.push(Box::pin(async move {
            let written = flight.release_unsent(&unsent).await;
            Event::Released(unsent, written)
        }));
    }

    /// Claims as many messages as there is room for (the send slots and two batches waiting
    /// for them), once a batch is free: a claim per freed slot would cost a write per message
    /// again, and the messages waiting keep the slots busy meanwhile. A second claim may start
    /// while one is on its way (one at a time where the database has one writer), so slots
    /// freed meanwhile do not wait for the first claim's round trip.
    pub(super) fn refill(&mut self) {
        let batch = self.batch;
        let queued = self.sends.len() + self.ready.len() + self.asked;
        // Messages whose outcome waits to be written still hold a lease; a database slower
        // than the sends must not let them pile up without bound.
        let room = (3 * batch)
            .saturating_sub(queued)
            .min((4 * batch).saturating_sub(self.held.len() + self.asked));
        let concurrent = if DB::ONE_WRITER { 1 } else { 2 };
        if self.claims.len() < concurrent && room >= batch {
            self.claim(room);
        }
    }

    /// Starts a claim of up to `limit` messages of the topics not paused; it covers every
    /// wake before it.
    pub(super) fn claim(&mut self, limit: usize) {
        let probe = !self.busy;
        self.woken = false;
        let topics = Topics::Except(self.paused.keys().cloned().collect());
        self.claim_of(topics, limit, probe);
    }

    fn claim_of(&mut self, topics: Topics, limit: usize, probe: bool) {
        let flight = self.flight;
        self.asked += limit;
        self.claims.push(Box::pin(async move {
            let (claim, claimed) = flight.claim(limit, probe, &topics).await;
            Event::Claimed(claim, topics, claimed)
        }));
    }

    /// Claims the probe of each paused topic whose probe is due: one message of that topic
    /// alone, which the claims of the others never take.
    fn claim_probes(&mut self) {
        if self.stopping || !self.probing {
            return;
        }
        let now = self.flight.now();
        let mut due = Vec::new();
        for (topic, paused) in &mut self.paused {
            if paused.probe == Probe::Waiting && paused.until <= now {
                paused.probe = Probe::Claiming;
                due.push(topic.clone());
            }
        }
        for topic in due {
            // Asking first whether one is due costs a statement a probe rarely saves.
            self.claim_of(Topics::Only(topic), 1, false);
        }
    }

    /// When the next paused topic's probe is due, if one waits for its time.
    fn next_probe(&self) -> Option<Instant> {
        let until = self
            .paused
            .values()
            .filter(|paused| paused.probe == Probe::Waiting)
            .map(|paused| paused.until)
            .min()?;
        Some(Instant::now() + self.flight.now().until(until))
    }

    /// Starts the waiting messages that the free send slots take, oldest first. One whose lease
    /// was lost meanwhile is not sent: its new holder looks it up first.
    fn start_sends(&mut self) {
        while self.sends.len() < self.batch {
            let Some((lease, message)) = self.ready.pop_front() else {
                return;
            };
            self.start_send(lease, message);
        }
    }

    /// Sends one claimed message, unless its lease was lost meanwhile: its new holder looks it
    /// up first.
    fn start_send(&mut self, lease: Lease, message: Claimed) {
        if self.held.get(&lease).is_none_or(|held| held.lost) {
            self.held.remove(&lease);
            self.probe_lost(lease, &message.record.topic);
            return;
        }
        let flight = self.flight;
        self.sends.push(Box::pin(async move {
            let topic = message.record.topic.clone();
            (lease, topic, flight.deliver(message, lease.token).await)
        }));
    }

    /// Queues a claimed message for a send slot, unless its topic paused after its claim
    /// began: then it goes back, due as it was, for the probe or the topic's resumption.
    fn admit(&mut self, lease: Lease, message: Claimed) {
        if self.paused.contains_key(&message.record.topic) {
            self.put_back(lease, message);
        } else {
            self.ready.push_back((lease, message));
        }
    }

    /// Gives a claimed message back to the database unsent, due as it was, the attempt its
    /// claim began not counted.
    fn put_back(&mut self, lease: Lease, message: Claimed) {
        let due = Millis::from(message.record.next_attempt_at);
        self.outcomes
            .push((lease, decide::given_back(message, due)));
    }

    /// Learns from a finished send whether its topic's destination is reachable: an outage
    /// pauses the topic, a probe that got an answer resumes it.
    fn observe(&mut self, lease: Lease, topic: &str, attempted: &Attempted) {
        let probing = self
            .paused
            .get(topic)
            .is_some_and(|p| p.probe == Probe::Sending(lease));
        let Some(outage) = &attempted.outage else {
            if probing {
                self.resume(topic);
            }
            return;
        };
        let now = self.flight.now();
        match self.paused.get_mut(topic) {
            None => self.pause(topic, outage, now),
            Some(paused) if probing => {
                paused.probes += 1;
                paused.retry_after = outage.after;
                paused.until =
                    decide::next_probe(&self.flight.policy, paused.probes, outage.after, now);
                paused.probe = Probe::Waiting;
                tracing::debug!(topic, probes = paused.probes, reason = %outage.reason, "outbox destination still unreachable");
            }
            // Sent before the pause began.
            Some(_) => {}
        }
    }

    /// Pauses `topic`, whose destination a send found unavailable at `now`: the claims leave it
    /// out from now on, and its messages waiting for a send slot go back, due as they were.
    fn pause(&mut self, topic: &str, outage: &Outage, now: Millis) {
        tracing::warn!(
            topic,
            reason = %outage.reason,
            "outbox paused: destination unreachable; probing it with one message until it answers"
        );
        metrics::paused(true);
        self.paused.insert(
            topic.to_owned(),
            Paused {
                since: Instant::now(),
                probes: 1,
                until: decide::next_probe(&self.flight.policy, 1, outage.after, now),
                retry_after: outage.after,
                probe: Probe::Waiting,
            },
        );
        let (held_back, ready) = std::mem::take(&mut self.ready)
            .into_iter()
            .partition(|(_, message)| message.record.topic == topic);
        self.ready = ready;
        for (lease, message) in held_back {
            self.put_back(lease, message);
        }
    }

    /// A probe claim that ended with no message to send (none of its topic due, or the claim
    /// failed): the next one is claimed after the probe backoff.
    fn no_probe(&mut self, topic: &str) {
        if let Some(paused) = self.paused.get_mut(topic) {
            paused.probe = Probe::Waiting;
            let (probes, after) = (paused.probes, paused.retry_after);
            paused.until =
                decide::next_probe(&self.flight.policy, probes, after, self.flight.now());
        }
    }

    /// A probe that ended without an answer of the destination (its lease or its write was
    /// lost): another is claimed at once.
    fn probe_lost(&mut self, lease: Lease, topic: &str) {
        if let Some(paused) = self.paused.get_mut(topic)
            && paused.probe == Probe::Sending(lease)
        {
            paused.probe = Probe::Waiting;
            paused.until = self.flight.now();
        }
    }

    /// The destination answered the probe: the claims take its topic again, at once.
    fn resume(&mut self, topic: &str) {
        let Some(paused) = self.paused.remove(topic) else {
            return;
        };
        tracing::info!(
            topic,
            paused_for = ?paused.since.elapsed(),
            probes = paused.probes,
            "outbox resumed: destination reachable again"
        );
        metrics::paused(false);
        self.woken = true;
    }

    /// The sender's client reconnected: each paused topic whose probe waits is probed now
    /// rather than at its backoff's time.
    fn probe_now(&mut self) {
        let now = self.flight.now();
        for (topic, paused) in &mut self.paused {
            if paused.probe == Probe::Waiting && paused.until > now {
                tracing::debug!(
                    topic,
                    "outbox destination's client reconnected; probing it now"
                );
                paused.until = now;
            }
        }
        self.claim_probes();
    }

    /// Starts writing the outcomes that finished, unless a settle is still running (they go
    /// with the next one).
    pub(super) fn settle(&mut self) {
        if self.settling.is_some() || self.outcomes.is_empty() {
            return;
        }
        let outcomes = std::mem::take(&mut self.outcomes);
        let follow_ups = std::mem::take(&mut self.follow_ups);
        for (lease, _) in &outcomes {
            if let Some(held) = self.held.get_mut(lease) {
                held.settling = true;
            }
        }
        let flight = self.flight;
        self.settling = Some(Box::pin(async move {
            let written = flight.settle(&outcomes, follow_ups).await;
            Event::Settled(
                outcomes.into_iter().map(|(lease, _)| lease).collect(),
                written,
            )
        }));
    }

    fn renew(&mut self) {
        let flight = self.flight;
        self.next_renewal = Instant::now() + flight.renewal_interval();
        let until = flight.lease_until(flight.now());
        // Only leases the renewal moves later: one claimed this very millisecond needs none.
        let leases: Vec<_> = self
            .held
            .iter()
            .filter(|(_, held)| !held.settling && !held.lost && held.until < until)
            .map(|(&lease, _)| lease)
            .collect();
        if leases.is_empty() {
            return;
        }
        self.renewing = Some(Box::pin(async move {
            let written = flight.renew(&leases, until).await;
            Event::Renewed(leases, until, written)
        }));
    }

    /// Waits for the next thing to finish; pending forever when nothing runs.
    pub(super) async fn next(&mut self) -> Event {
        let renewal_due = !self.held.is_empty() && self.renewing.is_none();
        let paused = !self.paused.is_empty();
        let probe = self.next_probe().filter(|_| self.probing && !self.stopping);

        tokio::select! {
            Some(event) = self.claims.next(), if !self.claims.is_empty() => event,
            event = finish(&mut self.settling) => event,
            event = finish(&mut self.renewing) => event,
            Some(event) = self.releasing.next(), if !self.releasing.is_empty() => event,
            Some((lease, topic, sent)) = self.sends.next(), if !self.sends.is_empty() => {
                Event::Sent(lease, topic, sent)
            }
            () = tokio::time::sleep_until(self.next_renewal), if renewal_due => Event::RenewalDue,
            () = sleep_until(probe), if probe.is_some() => Event::ProbeDue,
            () = raised(&mut self.reconnected), if paused => Event::Reconnected,
            Some(handover) = handover(&mut self.counter), if self.takes_handovers() => {
                Event::Handed(handover)
            }
        }
    }

    /// Takes in what finished; a finished claim reports what it found.
    pub(super) fn handle(&mut self, event: Event) -> Option<Result<Found, sqlx::Error>> {
        match event {
            Event::Claimed(claim, Topics::Only(topic), claimed) => {
                self.probe_claimed(claim, &topic, claimed);
            }
            Event::Claimed(claim, Topics::Except(_), claimed) => {
                return Some(self.claimed(claim, claimed));
            }
            Event::Sent(lease, topic, sent) => self.sent(lease, &topic, sent),
            Event::Settled(leases, written) => self.settled(&leases, written),
            Event::Renewed(leases, until, written) => self.renewed(leases, until, written),
            Event::Released(leases, written) => {
                if let Err(error) = written {
                    // Their leases run out; the next claims look each message up before any
                    // resend, which finds it never sent.
                    tracing::warn!(messages = leases.len(), %error, "giving back unsent outbox messages failed");
                }
                for lease in &leases {
                    self.held.remove(lease);
                }
            }
            Event::Handed(handover) => {
                self.handed(handover);
                self.start_sends();
            }
            Event::RenewalDue => self.renew(),
            Event::Reconnected => self.probe_now(),
            Event::ProbeDue => self.claim_probes(),
        }
        None
    }

    /// Holds the leases a claim took and queues their messages for sending.
    fn claimed(
        &mut self,
        claim: Claim,
        claimed: Result<Vec<Claimed>, sqlx::Error>,
    ) -> Result<Found, sqlx::Error> {
        let asked = usize::try_from(claim.limit).unwrap_or(usize::MAX);
        self.asked = self.asked.saturating_sub(asked);
        let claimed = claimed.inspect_err(|_| self.busy = false)?;
        self.busy = claimed.len() >= asked;
        let found = Found {
            claimed: claimed.len(),
            asked,
        };
        for message in claimed {
            let lease = self.hold(&claim, &message);
            self.admit(lease, message);
        }
        self.start_sends();
        if self.stopping {
            self.stop();
        }
        Ok(found)
    }

    /// Holds the lease a claim took on `message`.
    fn hold(&mut self, claim: &Claim, message: &Claimed) -> Lease {
        self.hold_until(claim.token, claim.lease_until, message)
    }

    /// Holds the lease `token` has on `message` until `until`.
    fn hold_until(&mut self, token: i64, until: Millis, message: &Claimed) -> Lease {
        if self.held.is_empty() {
            // The first lease since the window was last empty: renew a third of a lease from
            // now, not at a tick left over from earlier work.
            self.next_renewal = Instant::now() + self.flight.renewal_interval();
        }
        let lease = Lease {
            id: message.record.id,
            token,
        };
        let held = Held {
            until,
            settling: false,
            lost: false,
        };
        self.held.insert(lease, held);
        lease
    }

    /// Whether the window takes more hand-overs: while fewer than two batches wait for a send
    /// slot. Those it leaves wait in the counter, where they take up the room commits would
    /// reserve, so that further messages are written pending and claimed instead.
    fn takes_handovers(&self) -> bool {
        !self.stopping && self.ready.len() < 2 * self.batch
    }

    /// Holds a message a commit handed over and queues it for sending, as a claim would have.
    /// The lease runs from the insert: one whose transaction stayed open so long that less than
    /// two renewal intervals are left is not sent, since a renewal might come too late to keep
    /// it; a claim takes it once the lease has run out, and looks it up before any resend.
    fn handed(&mut self, handover: Handover) {
        let Some(token) = self.counter.as_ref().map(Counter::token) else {
            return;
        };
        if self.flight.now().until(handover.until) <= 2 * self.flight.renewal_interval() {
            return;
        }
        let lease = self.hold_until(token, handover.until, &handover.message);
        self.admit(lease, handover.message);
    }

    /// Sends the probe a claim found for the paused `topic` ahead of the messages waiting for
    /// a slot: the sooner it answers, the sooner the topic resumes.
    fn probe_claimed(
        &mut self,
        claim: Claim,
        topic: &str,
        claimed: Result<Vec<Claimed>, sqlx::Error>,
    ) {
        self.asked = self.asked.saturating_sub(1);
        let message = match claimed.map(|found| found.into_iter().next()) {
            Ok(Some(message)) => message,
            Ok(None) => return self.no_probe(topic),
            Err(error) => {
                tracing::warn!(topic, %error, "claiming an outbox probe failed; retrying after the probe backoff");
                return self.no_probe(topic);
            }
        };
        let lease = self.hold(&claim, &message);
        match self.paused.get_mut(topic) {
            Some(paused) if !self.stopping => {
                paused.probe = Probe::Sending(lease);
                self.ready.push_front((lease, message));
                self.start_sends();
            }
            _ => {
                self.ready.push_back((lease, message));
                if self.stopping {
                    self.stop();
                }
            }
        }
    }

    /// Takes a finished send's outcome to be written, unless the lease was lost meanwhile.
    fn sent(&mut self, lease: Lease, topic: &str, sent: Sent) {
        if let Ok(Some(finished)) = &sent {
            self.observe(lease, topic, &finished.attempted);
        } else {
            self.probe_lost(lease, topic);
        }
        match sent {
            Ok(Some(finished)) if !self.held.get(&lease).is_some_and(|h| h.lost) => {
                self.outcomes.push((lease, finished.attempted.settlement));
                self.follow_ups.extend(finished.follow_ups);
                self.start_sends();
                return;
            }
            // Taken over: the new holder looks the message up before any resend.
            Ok(Some(_) | None) => {}
            Err(error) => {
                // The lease runs out and another claim picks the message up again.
                tracing::warn!(message = %lease.id, %error, "recording an outbox attempt failed");
            }
        }
        self.held.remove(&lease);
        self.start_sends();
    }

    /// Lets go of the leases whose outcome was written.
    fn settled(&mut self, leases: &[Lease], written: Written) {
        match written {
            Ok(settled) => {
                let settled: HashSet<_> = settled.into_iter().collect();
                for lease in leases {
                    if !settled.contains(&lease.id) {
                        tracing::warn!(message = %lease.id, "outbox lease lost before recording the outcome");
                    }
                }
            }
            Err(error) => {
                // The leases run out and the next claims look each message up (its attempt
                // was recorded as outcome-unknown) before resending.
                tracing::warn!(messages = leases.len(), %error, "recording outbox outcomes failed");
            }
        }
        for lease in leases {
            self.held.remove(lease);
        }
    }

    /// Extends the leases a renewal found still held; one not found was taken over.
    fn renewed(&mut self, leases: Vec<Lease>, until: Millis, written: Written) {
        let renewed = match written {
            Ok(renewed) => renewed.into_iter().collect::<HashSet<_>>(),
            Err(error) => {
                tracing::warn!(%error, "renewing outbox leases failed");
                return;
            }
        };
        for lease in leases {
            let Some(held) = self.held.get_mut(&lease) else {
                continue;
            };
            if renewed.contains(&lease.id) {
                held.until = held.until.max(until);
            } else if !held.settling && !held.lost {
                // Not a settle of ours that got there first: another dispatcher took the
                // message over, and the outcome this attempt reaches is not recorded; the new
                // holder looks the message up before any resend.
                held.lost = true;
                tracing::warn!(message = %lease.id, "outbox lease lost while delivering");
            }
        }
    }
}

impl<DB: Backend, S> Drop for Window<'_, DB, S> {
    /// A dispatcher that stops while paused no longer counts as paused.
    fn drop(&mut self) {
        for _ in self.paused.drain() {
            metrics::paused(false);
        }
    }
}

/// Resolves when the sender raises its reconnection signal; pending forever without one.
async fn raised(signal: &mut Option<watch::Receiver<u64>>) {
    if let Some(signal) = signal
        && signal.changed().await.is_ok()
    {
        return;
    }
    std::future::pending().await
}

/// The next message handed over; pending forever without a counter.
async fn handover(counter: &mut Option<Counter>) -> Option<Handover> {
    match counter {
        Some(counter) => counter.next().await,
        None => std::future::pending().await,
    }
}

/// The output of the operation in `slot`, which it then empties; pending while it is empty.
async fn finish<T>(slot: &mut Option<Op<'_, T>>) -> T {
    match slot {
        Some(op) => {
            let output = op.await;
            *slot = None;
            output
        }
        None => std::future::pending().await,
    }
}
