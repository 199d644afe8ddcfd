//! What the work decided about its transaction: the one thing the engine needs to know of it.

use axum::response::Response;
use bytes::Bytes;

use super::Engine;
use super::decide::{self, Ending};
use crate::Backend;
use crate::error::Rejection;
use crate::tx::ConflictAborted;

/// The work's decision about the transaction it ran in, with what the engine keeps of it.
/// `F` is the work's own account of a failure, handed back to its caller untouched (the
/// inbox's `Failure`; nothing for a response, which says it all).
#[derive(Debug)]
pub(crate) enum Verdict<F = ()> {
    /// Commit the work's writes, with `response` as the key's outcome.
    Commit(http::Response<Bytes>),
    /// Roll the writes back, but store `response` and replay it: the refusal is final.
    Refuse(http::Response<Bytes>),
    /// Roll everything back and keep no record: the same key runs afresh next time.
    RollBack {
        response: http::Response<Bytes>,
        failure: F,
        /// The work will not be retried (the inbox's dead letters): logged and counted as
        /// `dead` rather than `retryable`, so an alert on rising retries is not set off.
        dead: bool,
    },
    /// The database aborted the transaction on a conflict: nothing of it stands, run it again.
    Conflict,
    /// The work's answer cannot be kept: everything is rolled back and the intent refused.
    Abandon(Rejection),
}

impl<DB: Backend> Engine<DB> {
    /// The verdict of work that answers with a response: buffered, then classified by its
    /// status.
    pub(super) async fn judge(&self, response: Response) -> Verdict {
        if response.extensions().get::<ConflictAborted>().is_some() {
            return Verdict::Conflict;
        }
        let response = match self.buffer(response).await {
            Ok(response) => response,
            Err(rejection) => return Verdict::Abandon(rejection),
        };
        match decide::ending(
            self.classification(response.status()),
            self.settings.keys_only,
        ) {
            Ending::Commit => Verdict::Commit(response),
            Ending::Refuse => Verdict::Refuse(response),
            Ending::RollBack => Verdict::RollBack {
                response,
                failure: (),
                dead: false,
            },
        }
    }
}
