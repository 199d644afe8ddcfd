//! How long to wait before trying again: exponential backoff with full jitter, shared by the
//! client's retries, the outbox's redeliveries and the inbox's retried deliveries so all spread
//! their load the same way.

use std::hash::{BuildHasher, RandomState};
use std::time::Duration;

/// Exponential backoff with full jitter: before retry `n` the wait is drawn uniformly from
/// `0..=min(cap, base × 2ⁿ⁻¹)`.
///
/// Full jitter (rather than a fixed exponential wait) matters when many callers failed
/// together: their retries spread over the whole window instead of arriving at a recovering
/// server at the same instant.
///
#[cfg_attr(any(feature = "client", feature = "outbox"), doc = "```")]
#[cfg_attr(not(any(feature = "client", feature = "outbox")), doc = "```ignore")]
/// use std::time::Duration;
/// # #[cfg(feature = "client")]
/// use axum_idempotency::client::Backoff;
/// # #[cfg(all(feature = "outbox", not(feature = "client")))]
/// # use axum_idempotency::outbox::Backoff;
///
/// // Up to 200 ms before the first retry, 400 ms before the second, … never more than 10 s.
/// let backoff = Backoff::exponential(Duration::from_millis(200), Duration::from_secs(10));
/// # let _ = backoff;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
}

impl Default for Backoff {
    /// Base 100 ms, cap 5 s: the client's default. The outbox's dispatcher sets its own.
    fn default() -> Self {
        Self::exponential(Duration::from_millis(100), Duration::from_secs(5))
    }
}

impl Backoff {
    /// Waits drawn from `0..=base` before the first retry, doubling the ceiling each time up to
    /// `cap`.
    #[must_use]
    pub const fn exponential(base: Duration, cap: Duration) -> Self {
        Self { base, cap }
    }

    /// The longest wait before the retry that follows attempt number `attempts` (1-based).
    fn ceiling(&self, attempts: u32) -> Duration {
        let doublings = attempts.saturating_sub(1).min(32);
        self.base
            .saturating_mul(2_u32.saturating_pow(doublings))
            .min(self.cap)
    }

    /// A wait drawn for the retry that follows attempt number `attempts` (1-based).
    pub(crate) fn delay(&self, attempts: u32) -> Duration {
        let ceiling = self.ceiling(attempts).as_nanos();
        let nanos = ceiling * u128::from(random_u64()) / u128::from(u64::MAX);
        Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
    }
}

/// A random number for jitter and lease tokens, which need spread, not secrecy.
///
/// The operating system's generator first; should it fail, std's per-process random hasher
/// keys, so a retry never goes without jitter and two dispatchers never share a fixed token.
pub(crate) fn random_u64() -> u64 {
    getrandom::u64().unwrap_or_else(|_| {
        // Each `RandomState` gets fresh keys, so hashing the clock yields a new value per call.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |elapsed| elapsed.as_nanos());
        RandomState::new().hash_one(nanos)
    })
}

/// The wait a `Retry-After` header asks for: delta-seconds or an HTTP-date (a date already past
/// means "now"). `None` when absent or unreadable. The client's retries and the outbox's HTTP
/// sender read it alike.
#[cfg(any(feature = "client", feature = "outbox"))]
pub(crate) fn retry_after(
    headers: &http::HeaderMap,
    now: std::time::SystemTime,
) -> Option<Duration> {
    let text = headers
        .get(http::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim();
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        // An absurdly long delta saturates rather than failing: the deadline bounds it anyway.
        return Some(Duration::from_secs(text.parse().unwrap_or(u64::MAX)));
    }
    let date = httpdate::parse_http_date(text).ok()?;
    Some(date.duration_since(now).unwrap_or(Duration::ZERO))
}

/// The `code` member of the server's problem document for a duplicate still in flight.
#[cfg(any(feature = "client", feature = "outbox"))]
const IN_PROGRESS_CODE: &str = "idempotency_request_in_progress";

/// How that document's `type` begins: the crate's docs on docs.rs, of any version.
#[cfg(any(feature = "client", feature = "outbox"))]
const TYPE_PREFIX: &str = "https://docs.rs/axum-idempotency/";

/// How that document's `type` ends: the docs anchor of `Rejection::InProgress`. The version and
/// the page between prefix and anchor differ from one server's version to another's.
#[cfg(any(feature = "client", feature = "outbox"))]
const IN_PROGRESS_ANCHOR: &str = "#variant.InProgress";

/// Whether a `409` body is this crate's "same key still in flight" problem document (its
/// `code`, or its `type`), from a server of any version of the crate: only the parts that
/// every version shares are compared. The client's retries and the outbox's HTTP sender read
/// it alike.
#[cfg(any(feature = "client", feature = "outbox"))]
pub(crate) fn is_in_progress_conflict(body: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Problem<'a> {
        // Borrowed where it can be, owned where the JSON escapes a character (`\/`).
        #[serde(borrow)]
        code: Option<std::borrow::Cow<'a, str>>,
        #[serde(borrow, rename = "type")]
        kind: Option<std::borrow::Cow<'a, str>>,
    }
    serde_json::from_slice::<Problem<'_>>(body).is_ok_and(|problem| {
        problem.code.as_deref() == Some(IN_PROGRESS_CODE)
            || problem.kind.is_some_and(|kind| {
                kind.starts_with(TYPE_PREFIX) && kind.ends_with(IN_PROGRESS_ANCHOR)
            })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ceiling_doubles_up_to_the_cap_and_draws_stay_below_it() {
        let backoff = Backoff::exponential(Duration::from_millis(100), Duration::from_millis(700));
        let ceilings: Vec<_> = (1..=5).map(|n| backoff.ceiling(n).as_millis()).collect();
        assert_eq!(ceilings, [100, 200, 400, 700, 700]);
        let draws: Vec<_> = (0..200).map(|_| backoff.delay(3)).collect();
        assert!(draws.iter().all(|d| *d <= Duration::from_millis(400)));
        // Full jitter spreads the waits: 200 draws all on one side would be a broken RNG.
        assert!(draws.iter().any(|d| *d < Duration::from_millis(200)));
        assert!(draws.iter().any(|d| *d > Duration::from_millis(200)));
    }

    #[cfg(any(feature = "client", feature = "outbox"))]
    #[test]
    fn an_in_progress_conflict_is_known_by_its_code_or_its_type() {
        let by_code =
            br#"{"type":"https://example.test/p","code":"idempotency_request_in_progress"}"#;
        assert!(is_in_progress_conflict(by_code));
        let by_type = br#"{"type":"https:\/\/docs.rs\/axum-idempotency\/0.1.0\/axum_idempotency\/error\/enum.Rejection.html#variant.InProgress"}"#;
        assert!(is_in_progress_conflict(by_type));
        let lease = br#"{"type":"https://docs.rs/axum-idempotency/0.1.0/axum_idempotency/error/enum.Rejection.html#variant.LeaseLost","code":"idempotency_lease_lost"}"#;
        assert!(!is_in_progress_conflict(lease));
        assert!(!is_in_progress_conflict(br#"{"code":"out_of_stock"}"#));
        let elsewhere = br#"{"type":"https://example.test/errors#variant.InProgress"}"#;
        assert!(!is_in_progress_conflict(elsewhere));
    }

    #[cfg(any(feature = "client", feature = "outbox"))]
    #[test]
    fn an_in_progress_conflict_is_known_from_a_server_of_another_version() {
        // A later server may sit elsewhere in its docs; its answer carries no `code` here so
        // the type alone must be read.
        for version in ["0.1.0", "0.2.3", "1.0.0-rc.1"] {
            for page in ["error/enum.Rejection.html", "enum.Rejection.html"] {
                let body = format!(
                    r#"{{"type":"https://docs.rs/axum-idempotency/{version}/axum_idempotency/{page}#variant.InProgress"}}"#
                );
                assert!(is_in_progress_conflict(body.as_bytes()), "{body}");
            }
        }
    }

    #[cfg(all(feature = "server", any(feature = "client", feature = "outbox")))]
    #[test]
    fn this_versions_in_progress_type_is_known_without_its_code() {
        let ours = crate::error::Rejection::InProgress {
            retry_after: Duration::from_secs(1),
        };
        let body = serde_json::to_vec(&serde_json::json!({ "type": ours.problem_type() }))
            .expect("a JSON document");
        assert!(is_in_progress_conflict(&body));
    }

    #[test]
    fn a_huge_attempt_count_stays_at_the_cap() {
        let backoff = Backoff::exponential(Duration::from_millis(100), Duration::from_secs(1));
        for _ in 0..200 {
            assert!(backoff.delay(40) <= Duration::from_secs(1));
            assert!(backoff.delay(u32::MAX) <= Duration::from_secs(1));
        }
    }

    #[test]
    fn a_zero_backoff_never_waits() {
        let backoff = Backoff::exponential(Duration::ZERO, Duration::ZERO);
        assert_eq!(backoff.delay(1), Duration::ZERO);
    }
}
