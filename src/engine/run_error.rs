//! Why a run ended without an execution to show for it, by cause.

use bytes::Bytes;

use crate::error::{Error, Rejection};

/// Why [`Engine::run`](super::Engine::run) or [`Engine::run_leased`](super::Engine::run_leased)
/// has no execution to return. Nothing of the work was committed (no outcome recorded) in any
/// case; [`is_retryable`](Self::is_retryable) says whether running it again under the same key
/// may succeed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// The engine refused the intent: its key holds another intent's outcome
    /// ([`Rejection::KeyReused`]), its original is still at work ([`Rejection::InProgress`]),
    /// the database kept aborting the transaction ([`Rejection::Conflict`]), the work's
    /// answer could not be kept ([`Rejection::ResponseTooLarge`], [`Rejection::TransactionHeld`]),
    /// or leased work lost its lease to another holder ([`Rejection::LeaseLost`]).
    #[error(transparent)]
    Rejected(#[from] Rejection),
    /// The idempotency store failed (to claim, commit or roll back): the database is likely
    /// out of reach.
    #[error("the idempotency store failed; nothing was committed")]
    Store(#[source] Error),
    /// The work answered with a retryable failure (a 5xx, 408 or 429 by the engine's
    /// [classification](super::Engine::classify)): its writes were rolled back and no record
    /// kept (leased work lets its lease go), so the same key runs afresh next time. The work's
    /// response is kept here.
    #[error("the work failed with {}; nothing was committed", .0.status())]
    Failed(http::Response<Bytes>),
    /// The work panicked: its writes were rolled back and no record kept.
    #[error("the work panicked; nothing was committed")]
    Panicked,
}

impl RunError {
    /// Whether running the intent again under the same key may succeed: a failure of the
    /// store or of the work, or a rejection that invites a retry (one with a
    /// [`retry_after`](Rejection::retry_after)). A key reused for another intent never does.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Rejected(rejection) => rejection.retry_after().is_some(),
            Self::Store(_) | Self::Failed(_) | Self::Panicked => true,
        }
    }

    /// The rejection an HTTP client is answered with for this error: a failure of the store
    /// or a panic is [`Rejection::Internal`].
    pub(crate) fn into_rejection(self) -> Rejection {
        match self {
            Self::Rejected(rejection) => rejection,
            Self::Store(_) | Self::Failed(_) | Self::Panicked => Rejection::Internal,
        }
    }
}
