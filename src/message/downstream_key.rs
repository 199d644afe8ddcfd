//! The idempotency key the downstream sees on every attempt of one message.

use std::fmt;

use sha2::{Digest, Sha256};

use crate::scope::ScopedKey;

/// The idempotency key the downstream sees on every attempt of one message.
///
/// Derived, never random: the same request (its scoped key digest), the same topic and the same
/// discriminator always give the same key, so a resend after a crash, a timeout or a replayed
/// background job carries exactly the key of the first attempt and a deduplicating downstream
/// applies the effect once.
///
/// The key is 64 lowercase hex characters, which fits every provider's key limits (Stripe allows
/// 255) and the crate's own key protocol.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DownstreamKey(String);

impl DownstreamKey {
    /// Derives the key of one side effect of an idempotent request.
    ///
    /// `scoped_key` is the request's ([`IdempotencyContext::scoped_key`]), so two users or two
    /// routes never share downstream keys. `discriminator` names the side
    /// effect within the request (`"charge"`, `"receipt-email"`) so one request may enqueue several
    /// messages, each with its own stable key.
    ///
    /// The key outlives the request's record: a client that reuses its idempotency key for
    /// another request once the record has expired gets the same downstream key, and
    /// [`Outbox::enqueue`](crate::outbox::Outbox::enqueue) refuses the other payload with
    /// [`Error::KeyReused`](crate::outbox::Error::KeyReused). Answer that as the layer answers a
    /// reused key, with the final [`Rejection::KeyReused`](crate::Rejection::KeyReused) (422),
    /// not a 5xx the client would retry in vain.
    ///
    /// ```
    /// use axum_idempotency::Scope;
    /// use axum_idempotency::outbox::DownstreamKey;
    ///
    /// // In a handler, `IdempotencyContext::scoped_key()`.
    /// let scoped_key = Scope::new("alice", "POST", "/payments", "k1".parse()?).scoped_key();
    /// let first = DownstreamKey::for_request(scoped_key, "payments.charge", "charge");
    /// let retry = DownstreamKey::for_request(scoped_key, "payments.charge", "charge");
    /// assert_eq!(first, retry);
    /// assert_ne!(first, DownstreamKey::for_request(scoped_key, "payments.charge", "refund"));
    /// # Ok::<(), axum_idempotency::KeyError>(())
    /// ```
    ///
    /// [`IdempotencyContext::scoped_key`]: crate::IdempotencyContext::scoped_key
    #[must_use]
    pub fn for_request(scoped_key: ScopedKey, topic: &str, discriminator: &str) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(b"axum-idempotency/outbox/v1");
        // Length prefixes keep ("ab", "c") and ("a", "bc") apart.
        for part in [scoped_key.to_hex().as_str(), topic, discriminator] {
            hasher.update((part.len() as u64).to_be_bytes());
            hasher.update(part.as_bytes());
        }
        Self(hex::encode(hasher.finalize()))
    }

    /// Uses a key the caller already has, for work that does not come from an HTTP request: a
    /// nightly job keyed by its date, a reconciliation keyed by the order id.
    ///
    /// The key must be 1–255 visible ASCII characters (0x21–0x7E), the same protocol as
    /// `Idempotency-Key`, so it can be sent in an HTTP header as it is.
    pub fn new(key: impl Into<String>) -> Result<Self, InvalidDownstreamKey> {
        let key = key.into();
        crate::key_syntax::check_key(key.as_bytes()).map_err(|_| InvalidDownstreamKey)?;
        Ok(Self(key))
    }

    /// Rebuilds a key read back from the outbox table, which only ever holds validated keys.
    pub(crate) fn from_stored(key: String) -> Self {
        Self(key)
    }

    /// The key as the downstream must receive it.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for DownstreamKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A caller-given downstream key that is empty, longer than 255 characters or not visible ASCII.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a downstream key must be 1-255 visible ASCII characters")]
pub struct InvalidDownstreamKey;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_key_depends_on_every_part_without_ambiguity() {
        let key = |k: &str| {
            let key = k.parse().expect("a valid key");
            crate::Scope::new("alice", "POST", "/payments", key).scoped_key()
        };
        let base = DownstreamKey::for_request(key("k1"), "ab", "c");
        assert_eq!(base, DownstreamKey::for_request(key("k1"), "ab", "c"));
        assert_ne!(base, DownstreamKey::for_request(key("k1"), "a", "bc"));
        assert_ne!(base, DownstreamKey::for_request(key("k1"), "ab", "d"));
        assert_ne!(base, DownstreamKey::for_request(key("k2"), "ab", "c"));
        assert_eq!(base.as_str().len(), 64);
    }

    #[test]
    fn caller_keys_follow_the_header_protocol() {
        assert!(DownstreamKey::new("job-2024-05-01").is_ok());
        assert_eq!(DownstreamKey::new(""), Err(InvalidDownstreamKey));
        assert_eq!(DownstreamKey::new("has space"), Err(InvalidDownstreamKey));
        assert_eq!(
            DownstreamKey::new("x".repeat(256)),
            Err(InvalidDownstreamKey)
        );
        assert!(DownstreamKey::new("x".repeat(255)).is_ok());
    }
}
