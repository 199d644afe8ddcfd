//! What an intent ends as: the response, how it was obtained, and what the log says of it.

use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;

use super::RunError;
use crate::error::Rejection;

/// What to do with a response, decided from its status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Classification {
    /// Store the response and commit the work.
    Completed,
    /// Roll the work back, but store the response and replay it: the refusal is final.
    FailedPermanent,
    /// Roll everything back and keep no record: the client may retry with the same key.
    Retryable,
}

impl Classification {
    /// The default rule: 2xx/3xx complete; 408, 429 and 5xx are retryable; other 4xx are final.
    pub fn of_status(status: StatusCode) -> Self {
        if status.is_success() || status.is_redirection() {
            Self::Completed
        } else if status.is_client_error()
            && status != StatusCode::REQUEST_TIMEOUT
            && status != StatusCode::TOO_MANY_REQUESTS
        {
            Self::FailedPermanent
        } else {
            Self::Retryable
        }
    }
}

/// How an intent was answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// The work ran now and its outcome was committed (completed or failed permanently).
    Executed,
    /// A stored outcome was replayed; the work did not run.
    Replayed,
    /// A lease that had run out was taken over and the recovery hook found the work done: its
    /// answer was recorded without running the work again.
    Recovered,
}

/// The response to an intent and how it was obtained.
#[derive(Debug)]
pub struct Execution {
    /// The response: as the work produced it, or as stored (plus `Idempotent-Replayed: true`).
    pub response: http::Response<Bytes>,
    /// Whether it was executed, replayed or recovered.
    pub outcome: Outcome,
}

/// The `outcome` an intent's log line reports: the values operators filter on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Logged {
    /// Executed and committed.
    Executed,
    /// Executed under a key whose earlier record had expired.
    Expired,
    /// Executed and refused for good; the refusal is stored and replayed.
    FailedPermanent,
    Replayed,
    /// The key's record was made for another intent.
    Mismatch,
    /// The key's original is still at work.
    InFlight,
    /// Rolled back, or failed before anything was kept: the client retries with the same key.
    Retryable,
    /// A lease was taken over and the recovery hook found the work done.
    Recovered,
    LeaseLost,
    /// Rolled back for good: an inbox delivery that is dead-lettered rather than retried.
    Dead,
}

impl Logged {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Executed => "executed",
            Self::Expired => "expired",
            Self::FailedPermanent => "failed_permanent",
            Self::Replayed => "replayed",
            Self::Mismatch => "mismatch",
            Self::InFlight => "in_flight",
            Self::Retryable => "retryable",
            Self::Recovered => "recovered",
            Self::LeaseLost => "lease_lost",
            Self::Dead => "dead",
        }
    }
}

/// How one step of the engine answered an intent, with the outcome its log line reports and
/// the work's own failure when it rolled back.
#[derive(Debug)]
pub(crate) struct Answer<F = ()> {
    pub(crate) result: Result<Execution, RunError>,
    /// Read by the inbox, whose handlers fail with a `Failure` of their own.
    #[cfg_attr(not(feature = "inbox"), allow(dead_code))]
    pub(crate) failure: Option<F>,
    pub(crate) logged: Logged,
}

impl<F> Answer<F> {
    /// The intent is answered with `response`.
    pub(crate) fn respond(
        response: http::Response<Bytes>,
        outcome: Outcome,
        logged: Logged,
    ) -> Self {
        Self {
            result: Ok(Execution { response, outcome }),
            failure: None,
            logged,
        }
    }

    /// The work failed and was rolled back: [`RunError::Failed`] with its `response`, its
    /// `failure` handed back to the caller.
    pub(crate) fn rolled_back(response: http::Response<Bytes>, failure: F, logged: Logged) -> Self {
        Self {
            failure: Some(failure),
            ..Self::reject(RunError::Failed(response), logged)
        }
    }

    /// The intent is refused, or ended without an execution.
    pub(crate) fn reject(error: impl Into<RunError>, logged: Logged) -> Self {
        Self {
            result: Err(error.into()),
            failure: None,
            logged,
        }
    }

    /// The store failed: the work was rolled back and the client may retry.
    pub(crate) fn store_failed(error: impl Into<crate::Error>) -> Self {
        let error = error.into();
        tracing::error!(%error, "idempotency store failed; rolled back");
        Self::reject(RunError::Store(error), Logged::Retryable)
    }

    /// The key's original is still at work.
    pub(crate) fn in_flight() -> Self {
        Self::reject(IN_PROGRESS, Logged::InFlight)
    }
}

/// A lock wait that ran out means the key's original is still at work.
pub(crate) const IN_PROGRESS: Rejection = Rejection::InProgress {
    retry_after: Duration::from_secs(1),
};
