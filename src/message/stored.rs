//! What the app can read back about a message: its id, its status and its delivery history.

use std::fmt;
use std::time::SystemTime;

use serde::de::DeserializeOwned;

use super::DownstreamKey;

/// The outbox row id of an enqueued message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MessageId(i64);

impl MessageId {
    /// The id as stored, for keeping it in the app's own tables.
    pub fn get(self) -> i64 {
        self.0
    }
}

impl From<i64> for MessageId {
    fn from(id: i64) -> Self {
        Self(id)
    }
}

impl fmt::Display for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Where a message stands.
///
/// A pending message is retried until it is `Delivered` or `Failed`, so nothing leaves the
/// outbox without a recorded outcome. `Delivered` and `Skipped` are final; `Failed` is final
/// unless an operator requeues or skips it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    /// Not delivered yet: waiting for its first attempt, for a retry, or for a lookup.
    Pending,
    /// The downstream accepted it; [`OutboxRecord::receipt`] holds what it answered.
    Delivered,
    /// Given up on: rejected by the downstream or out of attempts; [`OutboxRecord::last_error`]
    /// says why. A failed message with an [ordering key](OutboxRecord::ordering_key) holds the
    /// later messages of its key back until an operator requeues or skips it.
    Failed,
    /// Failed, then set aside by an operator ([`Outbox::skip`]) so that the later messages of
    /// its ordering key go on; never sent again.
    ///
    /// [`Outbox::skip`]: crate::outbox::Outbox::skip
    Skipped,
}

impl Status {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Delivered => "delivered",
            Self::Failed => "failed",
            Self::Skipped => "skipped",
        }
    }

    pub(crate) fn parse(stored: &str) -> Option<Self> {
        match stored {
            "pending" => Some(Self::Pending),
            "delivered" => Some(Self::Delivered),
            "failed" => Some(Self::Failed),
            "skipped" => Some(Self::Skipped),
            _ => None,
        }
    }
}

/// One outbox message as stored, with its delivery history.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxRecord {
    /// The row id.
    pub id: MessageId,
    /// The topic given at enqueue time.
    pub topic: String,
    /// The key every attempt carries.
    pub downstream_key: DownstreamKey,
    /// The payload given at enqueue time.
    pub payload: Vec<u8>,
    /// Where the message stands.
    pub status: Status,
    /// How many times the sender was called (lookups do not count).
    pub attempts: u32,
    /// Whether the last attempt ended without a definite answer (timeout, reset, crash), so a
    /// lookup runs before any resend.
    pub outcome_unknown: bool,
    /// What the downstream answered on delivery (for example a provider's charge id).
    pub receipt: Option<String>,
    /// Why the last attempt did not deliver, or why the message failed for good.
    pub last_error: Option<String>,
    /// When the message was enqueued.
    pub created_at: SystemTime,
    /// When the next attempt (or lookup) is due, for a pending message.
    pub next_attempt_at: SystemTime,
    /// When the sender was last called. Between a claim and the recording of the attempt's
    /// outcome it is the claim's time, a little before the send for a message that waits for
    /// a send slot.
    pub last_attempt_at: Option<SystemTime>,
    /// When the message became delivered, failed or skipped.
    pub finished_at: Option<SystemTime>,
    /// When an operator last put it back after it failed ([`Outbox::requeue`]); its time
    /// budget counts from then.
    ///
    /// [`Outbox::requeue`]: crate::outbox::Outbox::requeue
    pub requeued_at: Option<SystemTime>,
    /// The [ordering key](super::Message::ordering_key) given at enqueue time. While an earlier
    /// message of the same key is pending or failed, this one waits behind it, however due:
    /// [`Outbox::blocked_by`] names that message.
    ///
    /// [`Outbox::blocked_by`]: crate::outbox::Outbox::blocked_by
    pub ordering_key: Option<String>,
}

impl OutboxRecord {
    /// The payload parsed as JSON, for messages built with [`Message::json`](super::Message::json).
    pub fn payload_json<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_slice(&self.payload)
    }
}
