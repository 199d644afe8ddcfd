//! The retry loop shared by both front doors (the tower layer and the reqwest middleware).

use std::future::Future;

use http::HeaderMap;
use tokio::time::Instant;

use super::policy::{self, RetryPolicy};

/// How one attempt ended, as its front door classified it.
pub(crate) enum Attempt<R, E> {
    /// An answer the caller gets as it is.
    Final(R),
    /// An answer or failure worth another try; kept in case it turns out to be the last.
    Retryable(Result<R, E>),
}

/// Runs `attempt` until it gives a final answer or the policy says stop, and returns what the
/// last attempt left with the number of attempts made. Each attempt is cut off at its time
/// budget, which then counts as the failure `timed_out` makes.
pub(crate) async fn retry<R, E, F, Fut>(
    policy: &RetryPolicy,
    retry_allowed: bool,
    headers: impl Fn(&R) -> &HeaderMap,
    timed_out: impl Fn() -> E,
    mut attempt: F,
) -> (Result<R, E>, u32)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Attempt<R, E>>,
{
    let started = Instant::now();
    let mut attempts = 0;
    loop {
        attempts += 1;
        let budget = policy.attempt_budget(started.elapsed());
        let outcome = match tokio::time::timeout(budget, attempt()).await {
            Ok(Attempt::Final(answer)) => return (Ok(answer), attempts),
            Ok(Attempt::Retryable(outcome)) => outcome,
            Err(_elapsed) => Err(timed_out()),
        };
        let retry_after = outcome
            .as_ref()
            .ok()
            .and_then(|answer| policy::retry_after(headers(answer), std::time::SystemTime::now()));
        let wait = retry_allowed
            .then(|| policy.next_wait(attempts, retry_after, started.elapsed()))
            .flatten();
        let Some(wait) = wait else {
            return (outcome, attempts);
        };
        // Let go of the failed answer (and its connection) before sleeping.
        drop(outcome);
        tracing::debug!(attempts, ?wait, "retrying with the same idempotency key");
        tokio::time::sleep(wait).await;
    }
}
