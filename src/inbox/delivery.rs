//! One message as the broker delivered it.

use std::fmt;

use bytes::Bytes;

/// One message as the broker delivered it, handed to the key function and the handler.
#[derive(Clone, PartialEq, Eq)]
pub struct Delivery {
    payload: Bytes,
    message_id: Option<String>,
    attempt: u32,
}

impl Delivery {
    /// A delivery of `payload`, first attempt, without a message id.
    pub fn new(payload: impl Into<Bytes>) -> Self {
        Self {
            payload: payload.into(),
            message_id: None,
            attempt: 1,
        }
    }

    /// Sets the broker's message id (RabbitMQ `message_id`, NATS `Nats-Msg-Id`), read back
    /// with [`message_id`](Self::message_id).
    #[must_use]
    pub fn with_message_id(mut self, id: impl Into<String>) -> Self {
        self.message_id = Some(id.into());
        self
    }

    /// Sets which attempt this is, counting from 1 (the broker's delivery count), read back
    /// with [`attempt`](Self::attempt).
    #[must_use]
    pub fn with_attempt(mut self, attempt: u32) -> Self {
        self.attempt = attempt.max(1);
        self
    }

    /// The message body.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// The broker's message id, if the message had one.
    pub fn message_id(&self) -> Option<&str> {
        self.message_id.as_deref()
    }

    /// Which attempt this is, from 1.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }
}

impl fmt::Debug for Delivery {
    // The payload may hold personal data: only its size is shown.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Delivery")
            .field("message_id", &self.message_id)
            .field("attempt", &self.attempt)
            .field("payload_len", &self.payload.len())
            .finish()
    }
}
