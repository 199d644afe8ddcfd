//! The broker adapters' pause while the consumer's database is out.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

/// A broker adapter's pause while the consumer's database or a dependency is out: after a
/// [`Verdict::Unavailable`](super::Verdict::Unavailable), no delivery is handled before its backoff has passed, so that an
/// outage costs one try per backoff instead of one failure per delivery the broker has.
/// Shared by the deliveries one consumer handles at once.
#[cfg_attr(not(any(feature = "rabbitmq", feature = "nats")), allow(dead_code))]
#[derive(Debug, Default)]
pub(crate) struct Pause {
    until: Mutex<Option<tokio::time::Instant>>,
}

#[cfg_attr(not(any(feature = "rabbitmq", feature = "nats")), allow(dead_code))]
impl Pause {
    /// Takes no new delivery for `after` from now (a pause already running longer stands).
    pub(crate) fn hold(&self, after: Duration) {
        let until = tokio::time::Instant::now() + after;
        let mut slot = self.until.lock().unwrap_or_else(PoisonError::into_inner);
        if slot.is_none_or(|current| current < until) {
            *slot = Some(until);
        }
    }

    /// Waits out the pause as it stands now. A pause extended meanwhile is not waited for
    /// again: each delivery waits at most one backoff here, so one kept unacknowledged in the
    /// meantime never outlives the broker's patience.
    pub(crate) async fn wait(&self) {
        let until = *self.until.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(until) = until {
            tokio::time::sleep_until(until).await;
        }
    }
}
