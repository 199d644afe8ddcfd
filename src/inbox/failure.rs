//! Why a delivery was not applied, and what becomes of it then.

use crate::tx::TxError;

/// Why a handler (or a key function) did not apply a delivery.
///
/// `?` converts a statement's `sqlx::Error` (or a [`TxError`]): a conflict
/// abort becomes [`Failure::Conflict`], run again at once like a request under the layer;
/// an error that says the database cannot be reached (a broken or refused connection, a pool
/// that gave no connection in time, a server shutting down) is [`Failure::Unavailable`]; any
/// other database error is [`Failure::Retryable`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// Worth another attempt later (a lock timeout, a downstream that refused this request).
    Retryable(String),
    /// The consumer's own database, or a dependency it cannot work without, cannot be reached
    /// right now: an outage, not a fault of the delivery. Retried until it passes, never counted
    /// as an attempt and never dead-lettered (see the [module docs](super#outages)).
    Unavailable(String),
    /// Will never succeed as it is (malformed, refers to nothing): dead-letter it.
    Permanent(String),
    /// The database aborted the transaction to resolve a conflict with a concurrent one (a
    /// serialization failure, a deadlock, a certification conflict): nothing of it stands and
    /// the delivery is run again at once, a bounded number of times, before it counts as a
    /// retryable failure.
    Conflict(String),
}

impl From<TxError> for Failure {
    fn from(error: TxError) -> Self {
        if error.is_conflict() {
            Self::Conflict(error.to_string())
        } else if error.is_unreachable() {
            Self::Unavailable(error.to_string())
        } else {
            Self::Retryable(error.to_string())
        }
    }
}

impl From<sqlx::Error> for Failure {
    fn from(error: sqlx::Error) -> Self {
        TxError::from(error).into()
    }
}

impl Failure {
    /// A failure worth retrying.
    pub fn retryable(reason: impl Into<String>) -> Self {
        Self::Retryable(reason.into())
    }

    /// A failure that retrying cannot fix.
    pub fn permanent(reason: impl Into<String>) -> Self {
        Self::Permanent(reason.into())
    }

    /// An outage: the consumer's database or a dependency cannot be reached right now.
    pub fn unavailable(reason: impl Into<String>) -> Self {
        Self::Unavailable(reason.into())
    }
}

/// What becomes of a delivery whose handler (or key function, or store) failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fate {
    /// The database aborted the transaction on a conflict: run the handler again at once.
    Rerun,
    /// Deliver it again after the backoff; this attempt counts.
    Retry,
    /// An outage: deliver it again after the outage backoff, counting no attempt.
    Pause,
    /// Dead-letter it.
    Dead,
}

/// The inbox's rule, apart from any I/O: a permanent failure dies at once; an outage is waited
/// out however long it lasts, since the delivery is not at fault; any other failure is retried
/// until the attempts run out (at once on an operator's replay, which is a single attempt).
/// A conflict abort is run again at once inside one attempt; once the engine's reruns run out,
/// [`settled`] counts it as a retryable failure.
pub(crate) fn fate(failure: &Failure, attempt: u32, max_attempts: u32, replay: bool) -> Fate {
    match failure {
        Failure::Conflict(_) => Fate::Rerun,
        Failure::Permanent(_) => Fate::Dead,
        Failure::Unavailable(_) => Fate::Pause,
        Failure::Retryable(_) if replay || attempt >= max_attempts => Fate::Dead,
        Failure::Retryable(_) => Fate::Retry,
    }
}

/// The fate of a failure the engine handed back once the delivery's transaction ended, with
/// the failure it is counted as: a conflict abort whose reruns ran out spends one attempt, as
/// a retryable failure.
pub(crate) fn settled(
    failure: Failure,
    attempt: u32,
    max_attempts: u32,
    replay: bool,
) -> (Fate, Failure) {
    let failure = match failure {
        Failure::Conflict(reason) => Failure::Retryable(reason),
        failure => failure,
    };
    (fate(&failure, attempt, max_attempts, replay), failure)
}

impl Failure {
    pub(super) fn reason(&self) -> &str {
        match self {
            Self::Retryable(reason)
            | Self::Unavailable(reason)
            | Self::Permanent(reason)
            | Self::Conflict(reason) => reason,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_conflict_whose_reruns_ran_out_spends_an_attempt() {
        let conflict = || Failure::Conflict("serialization failure".into());
        assert_eq!(fate(&conflict(), 1, 2, false), Fate::Rerun);
        assert_eq!(settled(conflict(), 1, 2, false).0, Fate::Retry);
        assert_eq!(settled(conflict(), 2, 2, false).0, Fate::Dead);
        let outage = Failure::unavailable("down");
        assert_eq!(settled(outage, 9, 2, false).0, Fate::Pause);
    }
}
