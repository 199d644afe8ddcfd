//! What the dispatcher reports through the `metrics` facade when the `metrics` feature is on;
//! nothing at all without it. The names and labels are documented in the guide's operations
//! chapter; labels carry a fixed set of names, never a topic or a key.

use super::decide::GiveUp;

/// Messages that failed for good, labelled with why: `rejected`, `attempts` or `budget`.
#[cfg(feature = "metrics")]
const FAILED: &str = "idempotency_outbox_failed_total";
/// Destinations (a dispatcher's topics) paused right now because they are unavailable, summed
/// over the process's dispatchers; each probes its destination with one message at a time.
#[cfg(feature = "metrics")]
const PAUSED: &str = "idempotency_outbox_paused_destinations";

/// Counts one message that failed for good.
pub(super) fn failed(why: GiveUp) {
    #[cfg(feature = "metrics")]
    {
        let why = match why {
            GiveUp::Rejected => "rejected",
            GiveUp::Attempts => "attempts",
            GiveUp::Budget => "budget",
        };
        ::metrics::counter!(FAILED, "reason" => why).increment(1);
    }
    #[cfg(not(feature = "metrics"))]
    let _ = why;
}

/// One more destination paused (`true`) or one resumed (`false`).
pub(super) fn paused(paused: bool) {
    #[cfg(feature = "metrics")]
    {
        let gauge = ::metrics::gauge!(PAUSED);
        if paused {
            gauge.increment(1.0);
        } else {
            gauge.decrement(1.0);
        }
    }
    #[cfg(not(feature = "metrics"))]
    let _ = paused;
}
