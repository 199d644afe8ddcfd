//! A commit's messages handed straight to a dispatcher of the same process, with no claim.
//!
//! A message enqueued on a [`Tx`](crate::Tx) is written leased to a running dispatcher of its
//! outbox, its first attempt begun, exactly as that dispatcher's claim would have left it; once
//! the transaction commits, the message itself goes to the dispatcher, which sends it at once.
//! The commit is then followed by the send, not by a wake, a claim's round trip and a second
//! write to the row. Nothing else changes: the lease fences the dispatcher's outcome as a
//! claim's would, and a dispatcher that dies before sending leaves a row that any dispatcher
//! claims once the lease has run out, looking it up before a resend as after a crash mid-send.
//! A dispatcher that stops gives back what it holds, and a commit whose dispatcher stopped
//! after the message's insert gives it back itself, so neither waits out its lease.
//!
//! Only where a dispatcher has room: each takes at most a batch of hand-overs it has not yet
//! started, and a message that finds none free (or has an ordering key, whose order only a
//! claim can check) is written pending and woken for, as before.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::mpsc;

use crate::backend::{ClaimedMessage, Handed, Lease};
use crate::clock::Millis;

/// The dispatchers of one outbox (and its clones) in this process that take hand-overs.
#[derive(Clone, Default)]
pub(crate) struct Handoff(Arc<Mutex<Desks>>);

#[derive(Default)]
struct Desks {
    /// Where the next reservation starts looking, so several dispatchers share the work.
    next: usize,
    /// Numbers the desks, so a closing one removes its own.
    opened: u64,
    open: Vec<Desk>,
}

/// A dispatcher's end that commits hand messages to.
struct Desk {
    number: u64,
    token: i64,
    lease: Duration,
    sender: mpsc::Sender<Handover>,
    closed: Closed,
}

/// Whether a desk has closed. A hand-over sends while holding it, and a closing dispatcher
/// sets it before taking what was sent: each message is then either taken by the dispatcher
/// or returned to its commit, never both, never neither.
type Closed = Arc<Mutex<bool>>;

/// A committed message for a dispatcher, and when the lease it was written with runs out.
pub(crate) struct Handover {
    pub(crate) message: ClaimedMessage,
    pub(crate) until: Millis,
}

/// Room for one message at a dispatcher, taken before the insert so the row can be written
/// leased to it; dropped unused when the transaction rolls back.
pub(crate) struct Reserved {
    permit: mpsc::OwnedPermit<Handover>,
    handed: Handed,
    closed: Closed,
}

impl Reserved {
    /// The lease to write the message with.
    pub(crate) fn handed(&self) -> Handed {
        self.handed
    }

    /// Gives the committed message to the dispatcher. Returns its lease when that dispatcher
    /// has stopped taking hand-overs meanwhile, for the caller to release.
    pub(crate) fn hand(self, message: ClaimedMessage) -> Option<Lease> {
        let lease = Lease {
            id: message.record.id,
            token: self.handed.token,
        };
        let until = self.handed.until;
        let closed = self.closed.lock().unwrap_or_else(PoisonError::into_inner);
        // A permit still sends once its desk has closed, and a closed desk is read no more:
        // sent there, the message would wait out its lease unsent.
        if *closed {
            return Some(lease);
        }
        self.permit.send(Handover { message, until });
        None
    }
}

impl Handoff {
    /// Room at one of the dispatchers, if any has it, for a message enqueued at `now`.
    pub(crate) fn reserve(&self, now: Millis) -> Option<Reserved> {
        let mut desks = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let count = desks.open.len();
        for turn in 0..count {
            let at = (desks.next + turn) % count;
            let desk = &desks.open[at];
            if let Ok(permit) = desk.sender.clone().try_reserve_owned() {
                let handed = Handed {
                    token: desk.token,
                    until: now.after(desk.lease),
                };
                let reserved = Reserved {
                    permit,
                    handed,
                    closed: Arc::clone(&desk.closed),
                };
                desks.next = at + 1;
                return Some(reserved);
            }
        }
        None
    }

    /// Opens a desk for a dispatcher whose hand-overs are leased under `token` for `lease`,
    /// holding at most `room` not yet taken; it closes when the counter is dropped.
    pub(crate) fn open(&self, token: i64, lease: Duration, room: usize) -> Counter {
        let (sender, receiver) = mpsc::channel(room.max(1));
        let mut desks = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        desks.opened += 1;
        let number = desks.opened;
        let closed = Closed::default();
        desks.open.push(Desk {
            number,
            token,
            lease,
            sender,
            closed: Arc::clone(&closed),
        });
        Counter {
            handoff: self.clone(),
            number,
            token,
            receiver,
            closed,
        }
    }
}

/// A dispatcher's side of its desk: the messages handed to it.
pub(crate) struct Counter {
    handoff: Handoff,
    number: u64,
    token: i64,
    receiver: mpsc::Receiver<Handover>,
    closed: Closed,
}

impl Counter {
    /// The token the hand-overs are leased under.
    pub(crate) fn token(&self) -> i64 {
        self.token
    }

    /// The next message handed over; pending while there is none.
    pub(crate) async fn next(&mut self) -> Option<Handover> {
        self.receiver.recv().await
    }

    /// Takes no more hand-overs, and returns those already made.
    pub(crate) fn close(&mut self) -> Vec<Handover> {
        self.remove();
        *self.closed.lock().unwrap_or_else(PoisonError::into_inner) = true;
        self.receiver.close();
        let mut left = Vec::new();
        while let Ok(handover) = self.receiver.try_recv() {
            left.push(handover);
        }
        left
    }

    fn remove(&self) {
        let mut desks = self
            .handoff
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        desks.open.retain(|desk| desk.number != self.number);
    }
}

impl Drop for Counter {
    fn drop(&mut self) {
        self.remove();
        *self.closed.lock().unwrap_or_else(PoisonError::into_inner) = true;
    }
}

#[cfg(test)]
mod tests {
    use std::time::SystemTime;

    use super::*;
    use crate::message::{DownstreamKey, Message, MessageId};

    fn handed(id: i64) -> ClaimedMessage {
        let key = DownstreamKey::new(format!("k-{id}")).expect("a valid key");
        let now = SystemTime::now();
        ClaimedMessage {
            record: Message::new("t", key, "p").handed_over(MessageId::from(id), now),
            attempt_begun: true,
        }
    }

    #[test]
    fn room_is_taken_in_turn_and_given_back_by_a_rollback() {
        let handoff = Handoff::default();
        let now = Millis::now();
        assert!(handoff.reserve(now).is_none(), "no dispatcher, no room");
        let lease = Duration::from_secs(15);
        let mut first = handoff.open(1, lease, 1);
        let _second = handoff.open(2, lease, 1);

        let a = handoff.reserve(now).expect("room at the first");
        let b = handoff.reserve(now).expect("room at the second");
        assert_eq!((a.handed().token, b.handed().token), (1, 2));
        assert_eq!(a.handed().until, now.after(lease));
        assert!(handoff.reserve(now).is_none(), "both full");

        // A rollback drops its reservation: the room is back.
        drop(b);
        let again = handoff.reserve(now).expect("the second's room, given back");
        assert_eq!(again.handed().token, 2);

        a.hand(handed(7));
        let left = first.close();
        assert_eq!(left.len(), 1);
        assert_eq!(left[0].message.record.id, MessageId::from(7));
        assert_eq!(left[0].until, now.after(lease));
        // A closed desk takes no more.
        drop(again);
        let only = handoff.reserve(now).expect("the second's room");
        assert_eq!(only.handed().token, 2);
        assert!(handoff.reserve(now).is_none());
    }

    #[test]
    fn a_hand_over_after_its_dispatcher_stopped_is_returned_for_release() {
        let handoff = Handoff::default();
        let now = Millis::now();
        let mut desk = handoff.open(3, Duration::from_secs(15), 2);
        let before = handoff.reserve(now).expect("room");
        let after = handoff.reserve(now).expect("room");

        assert_eq!(before.hand(handed(1)), None, "taken at the open desk");
        let left = desk.close();
        assert_eq!(left.len(), 1);
        assert_eq!(
            after.hand(handed(2)),
            Some(Lease {
                id: MessageId::from(2),
                token: 3
            }),
            "a closed desk reads nothing more"
        );
    }
}
