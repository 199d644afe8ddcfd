//! Which answers are worth another attempt with the same key, and how long to wait first.

use std::time::Duration;

use http::StatusCode;

use crate::backoff::Backoff;
pub(crate) use crate::backoff::{is_in_progress_conflict, retry_after};

/// When a call is tried again, and when it stops.
///
/// The defaults follow the crate's retry classification: connection errors, timeouts, `408`,
/// `429`, every `5xx` and a `409` whose problem document says `idempotency_request_in_progress`
/// are retried with the same key; every other answer, including the other `4xx` (`400`, `401`,
/// `403`, `404`, `422`, a business `409` such as `out_of_stock`), is final and returned at once.
///
/// ```
/// use std::time::Duration;
/// use axum_idempotency::client::{Backoff, RetryPolicy};
///
/// let policy = RetryPolicy::default()
///     .max_attempts(8)
///     .deadline(Duration::from_secs(60))
///     .backoff(Backoff::exponential(Duration::from_millis(200), Duration::from_secs(10)));
/// # let _ = policy;
/// ```
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    max_attempts: u32,
    deadline: Duration,
    attempt_timeout: Option<Duration>,
    backoff: Backoff,
    retry_status: fn(StatusCode) -> bool,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 5,
            deadline: Duration::from_secs(30),
            attempt_timeout: Some(Duration::from_secs(10)),
            backoff: Backoff::default(),
            retry_status: is_transient_status,
        }
    }
}

impl RetryPolicy {
    /// How many attempts one call may make in all, the first included. Default 5; at least 1.
    #[must_use]
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// The time one call may take from its first attempt to its answer, waits included.
    /// Default 30 s. No retry starts whose wait would end past it; an attempt still running
    /// when it passes is abandoned.
    #[must_use]
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// How long a single attempt may run before it counts as a timeout (and is retried).
    /// Default 10 s.
    #[must_use]
    pub fn attempt_timeout(mut self, timeout: Duration) -> Self {
        self.attempt_timeout = Some(timeout);
        self
    }

    /// Lets each attempt run until the deadline, for inner clients that enforce their own timeout.
    #[must_use]
    pub fn no_attempt_timeout(mut self) -> Self {
        self.attempt_timeout = None;
        self
    }

    /// The wait between attempts when the answer carries no `Retry-After`.
    /// Default [`Backoff::default`].
    #[must_use]
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// Replaces the test for statuses that are retried (default [`is_transient_status`]: `408`,
    /// `429` and `5xx`). A `409` in-progress answer is retried whatever this says, because it is
    /// the idempotency protocol's own "try again later".
    #[must_use]
    pub fn retry_status_if(mut self, retry: fn(StatusCode) -> bool) -> Self {
        self.retry_status = retry;
        self
    }

    pub(crate) fn classify(&self, status: StatusCode) -> Verdict {
        if status == StatusCode::CONFLICT {
            Verdict::InspectConflict
        } else if (self.retry_status)(status) {
            Verdict::Retry
        } else {
            Verdict::Final
        }
    }

    /// The time left for one attempt that starts `elapsed` after the call began.
    pub(crate) fn attempt_budget(&self, elapsed: Duration) -> Duration {
        let remaining = self.deadline.saturating_sub(elapsed);
        self.attempt_timeout
            .map_or(remaining, |timeout| timeout.min(remaining))
    }

    /// How long to wait before attempt number `attempts + 1`, or `None` when the call must stop
    /// with what it has: attempts used up, or the wait would run past the deadline.
    pub(crate) fn next_wait(
        &self,
        attempts: u32,
        retry_after: Option<Duration>,
        elapsed: Duration,
    ) -> Option<Duration> {
        if attempts >= self.max_attempts {
            return None;
        }
        let wait = retry_after.unwrap_or_else(|| self.backoff.delay(attempts));
        (elapsed.saturating_add(wait) < self.deadline).then_some(wait)
    }
}

/// The retry classification's default for statuses: `408 Request Timeout`,
/// `429 Too Many Requests` and every `5xx` are transient.
pub fn is_transient_status(status: StatusCode) -> bool {
    status == StatusCode::REQUEST_TIMEOUT
        || status == StatusCode::TOO_MANY_REQUESTS
        || status.is_server_error()
}

/// What a status alone says about retrying.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    Final,
    Retry,
    /// A `409` is final unless its body is the in-progress problem document.
    InspectConflict,
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderMap, HeaderValue, header::RETRY_AFTER};
    use std::time::SystemTime;

    fn headers_with_retry_after(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(RETRY_AFTER, HeaderValue::from_str(value).unwrap());
        headers
    }

    #[test]
    fn statuses_follow_the_retry_classification() {
        let policy = RetryPolicy::default();
        for status in [408, 429, 500, 502, 503, 504] {
            let status = StatusCode::from_u16(status).unwrap();
            assert_eq!(policy.classify(status), Verdict::Retry, "{status}");
        }
        for status in [200, 201, 204, 301, 400, 401, 403, 404, 413, 422] {
            let status = StatusCode::from_u16(status).unwrap();
            assert_eq!(policy.classify(status), Verdict::Final, "{status}");
        }
        assert_eq!(
            policy.classify(StatusCode::CONFLICT),
            Verdict::InspectConflict
        );
    }

    #[test]
    fn only_the_in_progress_problem_makes_a_conflict_retryable() {
        let in_progress = br#"{"type":"t","status":409,"code":"idempotency_request_in_progress"}"#;
        assert!(is_in_progress_conflict(in_progress));
        assert!(!is_in_progress_conflict(br#"{"code":"out_of_stock"}"#));
        assert!(!is_in_progress_conflict(br#"{"title":"conflict"}"#));
        assert!(!is_in_progress_conflict(b"idempotency_request_in_progress"));
        assert!(!is_in_progress_conflict(b""));
    }

    #[test]
    fn retry_after_reads_delta_seconds_and_http_dates() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(
            retry_after(&headers_with_retry_after("2"), now),
            Some(Duration::from_secs(2))
        );
        let in_ten = httpdate::fmt_http_date(now + Duration::from_secs(10));
        assert_eq!(
            retry_after(&headers_with_retry_after(&in_ten), now),
            Some(Duration::from_secs(10))
        );
        let past = httpdate::fmt_http_date(now - Duration::from_secs(10));
        assert_eq!(
            retry_after(&headers_with_retry_after(&past), now),
            Some(Duration::ZERO)
        );
        assert_eq!(retry_after(&headers_with_retry_after("soon"), now), None);
        assert_eq!(retry_after(&headers_with_retry_after("-1"), now), None);
        assert_eq!(retry_after(&HeaderMap::new(), now), None);
    }

    #[test]
    fn the_call_stops_at_max_attempts_and_before_the_deadline() {
        let policy = RetryPolicy::default()
            .max_attempts(3)
            .deadline(Duration::from_secs(10));
        let two = Some(Duration::from_secs(2));
        assert_eq!(policy.next_wait(1, two, Duration::ZERO), two);
        assert_eq!(policy.next_wait(2, two, Duration::from_secs(7)), two);
        assert_eq!(policy.next_wait(3, two, Duration::ZERO), None);
        assert_eq!(policy.next_wait(1, two, Duration::from_secs(8)), None);
        assert_eq!(
            policy.attempt_budget(Duration::from_secs(5)),
            Duration::from_secs(5)
        );
        assert_eq!(
            policy.attempt_budget(Duration::ZERO),
            Duration::from_secs(10)
        );
    }
}
