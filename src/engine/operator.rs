//! What an operator may do to one record, through the engine and never through the table: look
//! it up for a support case, and let it go when it is stuck or wrong. Both take the whole
//! [`Scope`] (principal, method, route and key), so a record is reached only by someone who
//! names whose it is; the client's key alone reaches nothing.

use bytes::Bytes;

use super::Engine;
use crate::Backend;
use crate::error::Error;
use crate::record::RecordState;
use crate::scope::Scope;

/// What the store holds under one scoped key, as [`Engine::lookup`] reports it.
#[derive(Debug)]
#[non_exhaustive]
pub enum Lookup {
    /// No live record: the key was never used in this scope, its record expired, or it was
    /// forgotten. The next request with it executes.
    Absent,
    /// Work under the key has not finished: a request still inside its transaction is not
    /// visible yet, so this is leased work (a job) whose lease holder is at work or whose
    /// lease has not run out yet.
    InFlight,
    /// A final outcome, completed or refused for good: the response every retry is replayed,
    /// as stored (without the `Idempotent-Replayed` header a replay adds).
    Final(http::Response<Bytes>),
}

impl<DB: Backend> Engine<DB> {
    /// Reads the committed record under `scope` for an operator, for example to answer a
    /// support case ("was my order placed, and what did you answer?"). Logged at `INFO` with
    /// the key's digest, never the key or the stored body.
    pub async fn lookup(&self, scope: &Scope) -> Result<Lookup, Error> {
        let key = scope.scoped_key();
        let record = self.store.lookup(&key).await?;
        let lookup = match record {
            None => Lookup::Absent,
            Some(record) if record.is_expired(self.store.clock().now()) => Lookup::Absent,
            Some(record) => match (record.state, record.response) {
                (RecordState::Completed | RecordState::FailedPermanent, Some(stored)) => {
                    Lookup::Final(stored.to_response())
                }
                _ => Lookup::InFlight,
            },
        };
        let found = match &lookup {
            Lookup::Absent => "absent",
            Lookup::InFlight => "in_flight",
            Lookup::Final(_) => "final",
        };
        tracing::info!(
            key = %key,
            method = scope.method(),
            route = scope.route(),
            found,
            "operator looked up an idempotency record"
        );
        Ok(lookup)
    }

    /// Deletes the record under `scope` whatever its state, so the next request with its key
    /// executes afresh: the explicit way to let go of a record that is stuck (leased work
    /// whose holder is gone for good) or wrong (a stored answer that must not be replayed).
    /// Returns whether there was a record.
    ///
    /// The action is logged at `WARN` with the key's digest, the method, the route and
    /// `reason` (say who asked and why: a ticket number), never the key. This engine's
    /// [replay cache](Self::cache_replays) forgets the record at once; other instances that
    /// keep one replay it until it expires or is evicted, so restart them, or leave the cache
    /// off where operators forget records. A request still inside the claim's transaction
    /// holds the key's row: the delete waits for it to end, then deletes what it committed.
    pub async fn forget(&self, scope: &Scope, reason: &str) -> Result<bool, Error> {
        let key = scope.scoped_key();
        let deleted = self.store.forget(&key).await?;
        if let Some(cache) = &self.settings.cache {
            cache.remove(&key);
        }
        tracing::warn!(
            key = %key,
            method = scope.method(),
            route = scope.route(),
            reason,
            deleted,
            "operator forgot an idempotency record"
        );
        Ok(deleted)
    }
}
