//! What a handler enqueues: a topic, a payload, the downstream idempotency key and an optional
//! ordering key.

use std::time::SystemTime;

use serde::Serialize;

use super::{DownstreamKey, MessageId, OutboxRecord, Status};

/// One external side effect, written to the outbox in the caller's transaction.
///
/// ```
/// use axum_idempotency::outbox::{DownstreamKey, Message};
///
/// let key = DownstreamKey::new("charge-order-42").expect("a valid key");
/// let message = Message::json(
///     "payments.charge",
///     key,
///     &serde_json::json!({ "amount": "12.50", "currency": "EUR" }),
/// )?;
/// assert_eq!(message.topic(), "payments.charge");
/// # Ok::<(), serde_json::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    topic: String,
    key: DownstreamKey,
    payload: Vec<u8>,
    ordering_key: Option<String>,
}

impl Message {
    /// A message with an opaque payload; the [`Sender`](crate::outbox::Sender) decides what it
    /// means. The topic must be 1–255 characters:
    /// [`Outbox::enqueue`](crate::outbox::Outbox::enqueue) refuses another with
    /// [`Error::InvalidTopic`](crate::outbox::Error::InvalidTopic).
    #[must_use]
    pub fn new(topic: impl Into<String>, key: DownstreamKey, payload: impl Into<Vec<u8>>) -> Self {
        Self {
            topic: topic.into(),
            key,
            payload: payload.into(),
            ordering_key: None,
        }
    }

    /// Delivers this message after every message enqueued earlier with the same ordering key,
    /// and only once each of those is delivered (or skipped by an operator): for example the
    /// order id, so that "paid" never overtakes "created" and "refunded" never overtakes
    /// "paid". Messages of one key go out one at a time, across all dispatchers; messages of
    /// other keys, and those without one, go on concurrently. Without it (the default) a
    /// message is sent as soon as it is due, in no particular order with the others.
    ///
    /// The key is compared byte for byte, across topics, and must be 1–255 characters:
    /// [`Outbox::enqueue`](crate::outbox::Outbox::enqueue) refuses another with
    /// [`Error::InvalidOrderingKey`](crate::outbox::Error::InvalidOrderingKey). [Order per
    /// key](crate::outbox#order-per-key) says what the order means and what holds a key back.
    ///
    /// ```
    /// use axum_idempotency::outbox::{DownstreamKey, Message};
    ///
    /// let key = DownstreamKey::new("order-1042-refunded")?;
    /// // Enqueued after the order's "paid" message, delivered after it.
    /// let refund = Message::new("orders.refunded", key, r#"{"order":1042}"#).ordering_key("1042");
    /// # let _ = refund;
    /// # Ok::<(), axum_idempotency::outbox::InvalidDownstreamKey>(())
    /// ```
    #[must_use]
    pub fn ordering_key(mut self, key: impl Into<String>) -> Self {
        self.ordering_key = Some(key.into());
        self
    }

    /// A message whose payload is `payload` serialized as JSON.
    pub fn json<T: Serialize + ?Sized>(
        topic: impl Into<String>,
        key: DownstreamKey,
        payload: &T,
    ) -> Result<Self, serde_json::Error> {
        Ok(Self::new(topic, key, serde_json::to_vec(payload)?))
    }

    /// The topic the sender routes on.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The key every attempt of this message carries.
    pub fn key(&self) -> &DownstreamKey {
        &self.key
    }

    /// The payload bytes.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// The ordering key given with [`ordering_key`](Self::ordering_key), if any.
    pub(crate) fn ordering(&self) -> Option<&str> {
        self.ordering_key.as_deref()
    }

    /// The record of this message as it is written at `now` with its id `id`, leased and its
    /// first attempt begun (see `Outbox::enqueue`'s hand-over).
    pub(crate) fn handed_over(self, id: MessageId, now: SystemTime) -> OutboxRecord {
        OutboxRecord {
            id,
            topic: self.topic,
            downstream_key: self.key,
            payload: self.payload,
            status: Status::Pending,
            attempts: 1,
            outcome_unknown: true,
            receipt: None,
            last_error: None,
            created_at: now,
            next_attempt_at: now,
            last_attempt_at: Some(now),
            finished_at: None,
            requeued_at: None,
            ordering_key: self.ordering_key,
        }
    }
}

/// The longest topic or ordering key, in characters: MySQL's indexed columns hold 255.
const MAX_NAME_CHARS: usize = 255;

/// Whether `name` is a topic or an ordering key every backend stores and compares as given.
pub(crate) fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.chars().count() <= MAX_NAME_CHARS
}
