//! When to try again: exponential backoff with full jitter.

use std::time::Duration;

/// Full jitter (a uniform delay between zero and the exponential bound) spreads the retries of
/// many messages that failed together, so a downstream recovering from an outage is not hit by
/// all of them at the same instant.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Backoff {
    pub(crate) base: Duration,
    pub(crate) cap: Duration,
}

impl Backoff {
    /// The delay before the attempt that follows attempt number `attempt` (1-based), never
    /// shorter than the downstream's `retry_after`.
    pub(crate) fn delay(&self, attempt: u32, retry_after: Option<Duration>) -> Duration {
        let exponent = attempt.saturating_sub(1).min(31);
        let bound = self.base.saturating_mul(1 << exponent).min(self.cap);
        let bound_millis = u64::try_from(bound.as_millis()).unwrap_or(u64::MAX);
        let jittered = Duration::from_millis(fastrand::u64(0..=bound_millis));
        jittered.max(retry_after.unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delay_stays_within_the_exponential_bound_and_the_cap() {
        let backoff = Backoff {
            base: Duration::from_millis(100),
            cap: Duration::from_secs(1),
        };
        for _ in 0..200 {
            assert!(backoff.delay(1, None) <= Duration::from_millis(100));
            assert!(backoff.delay(3, None) <= Duration::from_millis(400));
            assert!(backoff.delay(40, None) <= Duration::from_secs(1));
        }
    }

    #[test]
    fn retry_after_is_a_lower_bound() {
        let backoff = Backoff {
            base: Duration::from_millis(10),
            cap: Duration::from_millis(10),
        };
        let after = Duration::from_secs(30);
        assert_eq!(backoff.delay(1, Some(after)), after);
    }
}
