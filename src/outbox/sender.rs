//! The user's side of delivery: how a message reaches the downstream, and how to ask it later.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::{Message, OutboxRecord};

/// Delivers outbox messages to a downstream (a payment provider, an SMS gateway, a broker).
///
/// The dispatcher calls [`send`](Sender::send) with the stored message; the implementation must
/// pass [`OutboxRecord::downstream_key`] to the downstream as its idempotency key on every attempt,
/// which is what makes a resend harmless. Each call is bounded by the dispatcher's send timeout;
/// a call that runs past it counts as [`SendOutcome::Unknown`].
///
/// ```
/// use axum_idempotency::outbox::{OutboxRecord, SendOutcome, Sender};
///
/// struct Log;
///
/// impl Sender for Log {
///     async fn send(&self, message: &OutboxRecord) -> SendOutcome {
///         println!("{} {}", message.topic, message.downstream_key);
///         SendOutcome::Delivered { receipt: "logged".into() }
///     }
/// }
/// ```
pub trait Sender: Send + Sync + 'static {
    /// Makes one attempt and says how it ended.
    fn send(&self, message: &OutboxRecord) -> impl Future<Output = SendOutcome> + Send;

    /// Asks the downstream whether it already holds the effect of `message`, found by its
    /// downstream key.
    ///
    /// Called before resending a message whose last attempt ended without a definite answer.
    /// Downstreams that deduplicate by key need no lookup (the default answers
    /// [`LookupOutcome::Unsupported`] and the dispatcher simply resends); for those that do not,
    /// the lookup is what keeps a resend from doing the work twice.
    fn lookup(&self, message: &OutboxRecord) -> impl Future<Output = LookupOutcome> + Send {
        let _ = message;
        std::future::ready(LookupOutcome::Unsupported)
    }

    /// The messages that `message`'s delivery leads to (the event that announces a charge),
    /// given the `receipt` the downstream answered with.
    ///
    /// Asked each time `message` is found delivered, by its send or by a lookup. What it
    /// returns is enqueued in the transaction that records `message` delivered, so the
    /// delivery is never recorded without its follow-ups, and the commit hands them to this
    /// dispatcher, as a handler's commit does. The default has none.
    ///
    /// Derive each follow-up's downstream key from `message.downstream_key`: a delivery found
    /// again (by a lookup after a crash) makes the same follow-ups, and one whose key is
    /// already enqueued is not enqueued again. The first one stands, even where its payload
    /// differs (logged as a warning). A follow-up with an invalid topic or ordering key is an
    /// error. An error leaves `message`'s outcome unknown, as a timeout would: it is looked up
    /// (or resent with its key) later and counts as an attempt, and this is asked again.
    ///
    /// ```
    /// use axum_idempotency::outbox::{DownstreamKey, Message, OutboxRecord, SendOutcome, Sender};
    ///
    /// struct Provider;
    ///
    /// impl Sender for Provider {
    ///     async fn send(&self, message: &OutboxRecord) -> SendOutcome {
    ///         SendOutcome::Delivered { receipt: "ch_123".into() }
    ///     }
    ///
    ///     fn follow_ups(
    ///         &self,
    ///         charge: &OutboxRecord,
    ///         receipt: &str,
    ///     ) -> Result<Vec<Message>, Box<dyn std::error::Error + Send + Sync>> {
    ///         let key = DownstreamKey::new(format!("charged-{}", charge.downstream_key))?;
    ///         let event = serde_json::json!({ "charge": receipt });
    ///         Ok(vec![Message::json("payment-events", key, &event)?])
    ///     }
    /// }
    /// ```
    fn follow_ups(
        &self,
        message: &OutboxRecord,
        receipt: &str,
    ) -> Result<Vec<Message>, Box<dyn std::error::Error + Send + Sync>> {
        let _ = (message, receipt);
        Ok(Vec::new())
    }

    /// The signal this sender raises when its client has reconnected, if it has one: the
    /// dispatcher then probes the destinations it paused for an outage at once, instead of at
    /// the next probe its [`probe_backoff`](super::Dispatcher::probe_backoff) allows, which
    /// after a long outage is up to that backoff's cap away. The default has none, and the
    /// probes alone find a destination back. The broker senders made with `connect` (features
    /// `rabbitmq`, `nats`) have one.
    fn reconnected(&self) -> Option<Reconnected> {
        None
    }
}

/// Word from a [`Sender`] that a destination it found unavailable may be reachable again,
/// raised when its client has reconnected (see [`Sender::reconnected`]).
///
/// A sender keeps one, raises it each time its connection is back, and hands out a clone;
/// clones share the signal. A raise that finds a destination still down costs one probe.
///
/// ```
/// use axum_idempotency::outbox::{OutboxRecord, Reconnected, SendOutcome, Sender};
///
/// struct Gateway {
///     reconnected: Reconnected,
/// }
///
/// impl Sender for Gateway {
///     async fn send(&self, message: &OutboxRecord) -> SendOutcome {
///         SendOutcome::Delivered { receipt: message.downstream_key.to_string() }
///     }
///
///     fn reconnected(&self) -> Option<Reconnected> {
///         Some(self.reconnected.clone())
///     }
/// }
///
/// // In the task that brings the gateway's connection back:
/// # let gateway = Gateway { reconnected: Reconnected::new() };
/// gateway.reconnected.raise();
/// ```
#[derive(Debug, Clone)]
pub struct Reconnected(Arc<watch::Sender<u64>>);

impl Reconnected {
    /// A signal no one has raised yet.
    #[must_use]
    pub fn new() -> Self {
        Self(Arc::new(watch::Sender::new(0)))
    }

    /// Says that the connection is back: the dispatchers of this sender probe their paused
    /// destinations now.
    pub fn raise(&self) {
        self.0
            .send_modify(|raised| *raised = raised.wrapping_add(1));
    }

    /// A receiver that sees the raises from now on.
    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.0.subscribe()
    }
}

impl Default for Reconnected {
    fn default() -> Self {
        Self::new()
    }
}

/// How one attempt ended, as the sender classifies the downstream's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SendOutcome {
    /// Done; `receipt` is kept in the record (a charge id, a message id).
    Delivered {
        /// What the downstream answered.
        receipt: String,
    },
    /// The destination could not be reached, or said it cannot take work now: connection
    /// refused or reset before the request left, a DNS or connect timeout, a broker connection
    /// that is down, `503`, `429`. Nothing was done, and this is an outage, not an attempt: it
    /// consumes none of the message's attempts, and the dispatcher pauses this destination,
    /// probing it with one message at a time on a jittered backoff (at most about 30 s) until
    /// it answers, then resumes at full speed.
    Unavailable {
        /// The downstream's `Retry-After`, if it gave one; the next probe is never earlier.
        after: Option<Duration>,
        /// Kept in the record's `last_error`.
        reason: String,
    },
    /// Reached, and definitely not done, but worth another attempt later (`408`, a `409` that
    /// says the key's first request is still running). Counts as an attempt.
    Retry {
        /// The downstream's `Retry-After`, if it gave one; the next attempt is never earlier.
        after: Option<Duration>,
        /// Kept in the record's `last_error`.
        reason: String,
    },
    /// May or may not have happened (timeout, connection reset after the request was sent). The
    /// next attempt looks the message up first when the sender supports lookups.
    Unknown {
        /// Kept in the record's `last_error`.
        reason: String,
    },
    /// Refused for good (invalid request, card declined); the message fails without retrying.
    Rejected {
        /// Kept in the record's `last_error`.
        reason: String,
    },
}

/// The answer of a [`Sender::lookup`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LookupOutcome {
    /// The downstream holds the effect; the message becomes delivered with this receipt.
    Found {
        /// What the downstream holds (a charge id).
        receipt: String,
    },
    /// The downstream has no trace of it. Once the last attempt is older than the lookup grace
    /// the message is resent; before that the dispatcher waits, since that attempt may still be
    /// in progress at the downstream.
    NotFound,
    /// The sender cannot look messages up; the dispatcher resends, relying on the downstream key.
    Unsupported,
    /// The lookup itself failed; the dispatcher asks again later and does not resend meanwhile.
    Failed {
        /// Kept in the record's `last_error`.
        reason: String,
    },
}
