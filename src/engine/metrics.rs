//! What the engine reports through the `metrics` facade when the `metrics` feature is on;
//! nothing at all without it. The names and labels are documented in the guide's operations
//! chapter. Labels carry only the outcome's name: never a key, a digest, a principal or a
//! route, so their cardinality stays fixed whatever the traffic.

use std::time::Duration;

use super::outcome::Logged;

/// One counter for every intent the engine answers, labelled with its logged outcome.
#[cfg(feature = "metrics")]
pub(super) const REQUESTS: &str = "idempotency_requests_total";
/// The time a claim took, labelled with what it found: long `taken` claims are duplicates
/// that waited for their in-flight original.
#[cfg(feature = "metrics")]
pub(super) const CLAIM_SECONDS: &str = "idempotency_claim_seconds";

/// What a claim found under its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ClaimResult {
    /// The key was free (or expired) and is now held by this claim.
    Claimed,
    /// Another intent's record holds the key, possibly after waiting for it to commit.
    Taken,
    /// The wait for an in-flight original ran out.
    Busy,
    /// The store failed.
    Failed,
}

impl ClaimResult {
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    fn as_str(self) -> &'static str {
        match self {
            Self::Claimed => "claimed",
            Self::Taken => "taken",
            Self::Busy => "busy",
            Self::Failed => "failed",
        }
    }
}

/// Counts one answered intent.
pub(super) fn answered(logged: Logged) {
    #[cfg(feature = "metrics")]
    ::metrics::counter!(REQUESTS, "outcome" => logged.as_str()).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = logged;
}

/// Records how long one claim took and what it found.
pub(super) fn claimed(result: ClaimResult, took: Duration) {
    #[cfg(feature = "metrics")]
    ::metrics::histogram!(CLAIM_SECONDS, "result" => result.as_str()).record(took.as_secs_f64());
    #[cfg(not(feature = "metrics"))]
    let _ = (result, took);
}
