//! The outbox's SQL, behind one sealed trait the outbox and the dispatcher are generic over.
//! Every query runs once, generically, in [`sql`]; a backend file only states its dialect: the
//! SQL text, how it creates the table, and how it claims and numbers messages. Adding a
//! database means one file here implementing `Dialect`, and the crate's `Backend` for it.

use std::future::Future;

use sqlx::Pool;

use super::{DownstreamKey, Error, Message, MessageId, OutboxRecord, Status};

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
mod sql;
#[cfg(feature = "sqlite")]
mod sqlite;

pub(crate) use private::Ops;
pub(crate) use private::{Claim, Claimed, Lease, Settlement};

/// The columns every read selects, under the names the one row decoder reads them by. A macro,
/// not a constant, so each backend can `concat!` it into its SQL text at compile time.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
macro_rules! record_columns {
    () => {
        "id, topic, downstream_key, payload, status, attempts, outcome_unknown, receipt, \
         last_error, created_at, next_attempt_at, last_attempt_at, finished_at, requeued_at, \
         ordering_key"
    };
}
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
use record_columns;

/// The claim's ordering rule, for the message row named `$message`: a message without an
/// ordering key is always free to go; one with a key only when no earlier message (lower id) of
/// that key is pending (due, waiting for a retry, or leased and in flight) or failed. Only the
/// first unfinished message of a key can pass, so a claim takes at most one per key, and no
/// two dispatchers hold messages of one key at once.
///
/// The subquery is a plain read, even inside a statement that locks with `FOR UPDATE SKIP
/// LOCKED`: a locking clause covers the rows of its own `FROM`, not a subquery's, so an earlier
/// message another dispatcher has locked is still seen, and still holds the later ones back
/// (`tests/outbox.rs` pins this on PostgreSQL and MariaDB). Its snapshot may be older than the
/// rows the claim locks; that only errs towards waiting, as a message of a key never turns
/// from finished to pending, and no earlier id of a key commits after a later one (see
/// `Dialect::ORDER_LOCK`).
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
macro_rules! in_key_order {
    ($message:literal) => {
        concat!(
            "(",
            $message,
            ".ordering_key IS NULL OR NOT EXISTS (SELECT 1 FROM idempotency_outbox AS earlier \
             WHERE earlier.ordering_key = ",
            $message,
            ".ordering_key AND earlier.id < ",
            $message,
            ".id AND earlier.status IN ('pending', 'failed')))"
        )
    };
}
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
use in_key_order;

mod private {
    use super::*;

    /// A claim: the first due, unleased messages up to `limit` get `token` and a lease until
    /// `lease_until`, so no other dispatcher takes them before then. In the same write, each one
    /// that is sent now (its last outcome known, fewer than `max_attempts` attempts made) begins
    /// an attempt: one more attempt, outcome unknown until settled, `last_attempt_at` = `now`.
    #[allow(unreachable_pub)]
    #[derive(Debug, Clone, Copy)]
    pub struct Claim {
        pub now: i64,
        pub lease_until: i64,
        pub token: i64,
        pub limit: i64,
        pub max_attempts: i64,
        /// Whether to run the dialect's `CLAIM_PROBE` first: not when the previous claim found
        /// all it asked for, as more are then likely due and the probe would cost a statement.
        pub probe: bool,
    }

    impl Claim {
        /// The same claim made at `now`: one that waited for a connection (a pool in use, a
        /// database coming back) leases from when it runs, not from when it was asked for,
        /// or its leases could be over before the dispatcher has them, and its next claim
        /// would take the same messages again.
        #[must_use]
        pub fn at(self, now: i64) -> Self {
            let lease = self.lease_until.saturating_sub(self.now);
            Self {
                now,
                lease_until: now.saturating_add(lease),
                ..self
            }
        }
    }

    /// A message a claim leased: its row as the claim left it, and whether the claim began an
    /// attempt (if not, its last outcome is unknown and it is looked up first, or it has
    /// used up its attempts).
    #[allow(unreachable_pub)]
    #[derive(Debug, Clone)]
    pub struct Claimed {
        pub record: OutboxRecord,
        pub attempt_begun: bool,
    }

    /// A lease a dispatcher holds: the message and the token of the claim that leased it.
    #[allow(unreachable_pub)]
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct Lease {
        pub id: MessageId,
        pub token: i64,
    }

    /// The columns an attempt's outcome writes; the lease is always released with it.
    #[allow(unreachable_pub)]
    #[derive(Debug, Clone)]
    pub struct Settlement {
        pub status: Status,
        pub receipt: Option<String>,
        pub last_error: Option<String>,
        /// The attempts counted once it is written: the claim's count, or one fewer where the
        /// attempt the claim began turned out to be an outage, which is not an attempt.
        pub attempts: u32,
        pub outcome_unknown: bool,
        pub next_attempt_at: i64,
        pub finished_at: Option<i64>,
        /// When the attempt's send started, where the claim began the attempt earlier (a
        /// message claimed ahead of a free send slot): it replaces the claim's time, so a
        /// lookup grace counts from the send. `None` leaves `last_attempt_at` as it is.
        pub last_attempt_at: Option<i64>,
    }

    /// How an insert learns the new message's id.
    #[allow(unreachable_pub)]
    #[derive(Debug, Clone, Copy)]
    pub enum NewId<DB: sqlx::Database> {
        /// `INSERT … ON CONFLICT DO NOTHING RETURNING id`: no row when the key is present.
        Returning,
        /// A plain `INSERT` whose unique violation means the key is present; the id is read
        /// from the statement's result.
        LastInsertId(fn(&DB::QueryResult) -> u64),
    }

    /// How a claim leases due messages and begins the attempts of those sent now.
    #[allow(unreachable_pub)]
    #[derive(Debug, Clone, Copy)]
    pub enum ClaimSql {
        /// One `UPDATE … RETURNING` leases the rows, begins the attempts and returns
        /// `record_columns!()` as it left them, and `attempt_begun`. Parameters: lease_until,
        /// token, now, limit, max_attempts.
        OneStatement(&'static str),
        /// Two `UPDATE … RETURNING`s, each sound on its own: `hold` leases those of the first
        /// `limit` due messages that are not sent now and changes nothing else; `begin` leases
        /// the first due messages that are sent now, up to what is left of the limit, and begins
        /// their attempts. Parameters of both: lease_until, token, now, limit, max_attempts;
        /// columns: `record_columns!()` as each left them.
        TwoStatements {
            hold: &'static str,
            begin: &'static str,
        },
        /// In one transaction, `select` locks the due rows (parameters: now, now, limit;
        /// columns: `record_columns!()`), then each is leased by `begin` if it is sent now
        /// (parameters: lease_until, token, now, id), else by `hold` (parameters: lease_until,
        /// token, id).
        LockThenLease {
            select: &'static str,
            hold: &'static str,
            begin: &'static str,
        },
    }

    /// How a write that concerns many leased messages at once (a renewal, a settlement) runs.
    #[allow(unreachable_pub)]
    #[derive(Debug, Clone, Copy)]
    pub enum BatchSql {
        /// One statement for all of them, the messages passed as a JSON array of objects; it
        /// returns the id of each message whose lease still held (and was written).
        Json(&'static str),
        /// One statement per message, all in one transaction; a message whose lease still held
        /// is one affected row.
        PerRow(&'static str),
    }

    /// One backend's SQL; the execution lives once, in `sql`, which implements [`Ops`] for
    /// every dialect. Sealed the same way as [`Ops`].
    #[allow(unreachable_pub)]
    pub trait Dialect: sqlx::Database {
        /// Parameters: topic, downstream_key, payload, created_at, next_attempt_at,
        /// ordering_key.
        const INSERT: &'static str;
        /// Run before inserting a message with an ordering key, in the caller's transaction:
        /// holds the key until that transaction ends, so two transactions enqueuing for one key
        /// take their ids in the order they commit, and a later id of a key is never visible
        /// before an earlier one. `None` where the database's single writer already does.
        /// Parameter: ordering_key.
        const ORDER_LOCK: Option<&'static str> = None;
        /// How [`INSERT`](Dialect::INSERT) reports the new id.
        const NEW_ID: NewId<Self>;
        /// Parameter: id. Columns: `record_columns!()`.
        const FETCH_BY_ID: &'static str;
        /// Parameter: downstream_key. Columns: `record_columns!()`.
        const FETCH_BY_KEY: &'static str;
        /// The first pending or failed message with the ordering key of a message and a lower
        /// id. Parameters: id, id. Columns: `record_columns!()`.
        const FETCH_BLOCKER: &'static str;
        /// Run before a claim to tell whether anything is due, where a claim that finds
        /// nothing still costs something (a lock). Parameter: now.
        const CLAIM_PROBE: Option<&'static str> = None;
        /// How due messages are leased.
        const CLAIM: ClaimSql;
        /// Whether the database takes one writer at a time, so a dispatcher's own writes are
        /// better queued in the process than in the database's lock wait.
        const ONE_WRITER: bool = false;
        /// Parameters: last_attempt_at, id, lease_token.
        const BEGIN_ATTEMPT: &'static str;
        /// Extends held leases. `Json`: parameters lease_until and the array of `{id, token}`;
        /// `PerRow`: parameters lease_until, id, lease_token.
        const RENEW_LEASES: BatchSql;
        /// Gives back unsent messages whose attempt the claim began, as if it had not: one
        /// attempt fewer, the last outcome known again, no `last_attempt_at` when no attempt is
        /// left, the lease released. `Json`: one parameter, the array of `{id, token}`;
        /// `PerRow`: parameters id, lease_token.
        const RELEASE_UNSENT: BatchSql;
        /// Writes outcomes and releases the leases; a null `last_attempt_at` keeps the
        /// column's value. `Json`: one parameter, the array of `{id, token, status, receipt,
        /// last_error, attempts, outcome_unknown, next_attempt_at, finished_at, last_attempt_at}`;
        /// `PerRow`: parameters status, receipt, last_error, attempts, outcome_unknown, next_attempt_at,
        /// finished_at, last_attempt_at, id, lease_token.
        const SETTLE: BatchSql;

        /// The outbox's schema migrations, oldest first: (version, SQL script). A version once
        /// released is never edited; a schema change is a new version.
        const MIGRATIONS: &'static [(i64, &'static str)];
        /// Begins the migration transaction.
        const MIGRATION_BEGIN: &'static str;
        /// Run first in the migration transaction to serialise concurrent migrators, where
        /// [`MIGRATION_BEGIN`](Dialect::MIGRATION_BEGIN) does not already.
        const MIGRATION_LOCK: Option<&'static str> = None;
        /// Releases a lock [`MIGRATION_LOCK`](Dialect::MIGRATION_LOCK) took for the session
        /// rather than the transaction; run after the migration, whatever its outcome.
        const MIGRATION_UNLOCK: Option<&'static str> = None;
        /// Records an applied version. Parameters: version, applied_at.
        const MIGRATION_RECORD: &'static str;

        /// Whether the row [`MIGRATION_LOCK`](Dialect::MIGRATION_LOCK) returned says the lock
        /// was granted: a lock with a timeout reports the timeout there, not as an error.
        fn migration_locked(_row: &Self::Row) -> bool {
            true
        }

        /// Deletes delivered and skipped messages finished before a time, a bounded batch per
        /// statement. Parameters: finished_before, limit.
        const PURGE_FINISHED: &'static str;
        /// Puts a failed message back to pending, due now, its attempts counted afresh; the
        /// unknown-outcome flag stays, so a resend still looks the message up first.
        /// Parameters: now, id.
        const REQUEUE: &'static str;
        /// Sets a failed message aside as skipped, finished now. Parameters: now, id.
        const SKIP: &'static str;
        /// Moves the pending messages of a topic due at one time to another. Parameters: the
        /// new time, the time they were due, the topic.
        const ADVANCE: &'static str;

        /// How many rows a statement affected.
        fn rows_affected(result: &Self::QueryResult) -> u64;
    }

    // `pub` inside a private module is the sealed-trait idiom: `Backend` can name it as a
    // supertrait while no one outside the crate can implement or call it.
    #[allow(unreachable_pub)]
    pub trait Ops: sqlx::Database {
        /// Applies the schema versions not yet applied; safe when run by two instances at once.
        fn migrate(pool: &Pool<Self>) -> impl Future<Output = Result<(), Error>> + Send;

        /// Inserts a pending message, after taking its ordering key's lock if it has one;
        /// `None` when its downstream key is already present.
        fn insert(
            conn: &mut Self::Connection,
            message: &Message,
            now: i64,
        ) -> impl Future<Output = Result<Option<MessageId>, sqlx::Error>> + Send;

        /// Reads one message by id.
        fn fetch_by_id(
            conn: &mut Self::Connection,
            id: MessageId,
        ) -> impl Future<Output = Result<Option<OutboxRecord>, sqlx::Error>> + Send;

        /// Reads one message by downstream key.
        fn fetch_by_key(
            conn: &mut Self::Connection,
            key: &DownstreamKey,
        ) -> impl Future<Output = Result<Option<OutboxRecord>, sqlx::Error>> + Send;

        /// Whether the database takes one writer at a time.
        const ONE_WRITER: bool;

        /// Leases due messages, skipping those another dispatcher holds, and begins the
        /// attempts of those sent now (see [`Claim`]); returns the claim as made, at the time
        /// it had its connection (see [`Claim::at`]).
        fn claim(
            pool: &Pool<Self>,
            claim: Claim,
        ) -> impl Future<Output = (Claim, Result<Vec<Claimed>, sqlx::Error>)> + Send;

        /// Records that the sender is about to be called on a message the claim did not begin
        /// an attempt for (a resend after a lookup): one more attempt, outcome unknown until
        /// settled, so a crash during the call leads to a lookup, not a blind resend. `false`
        /// when the lease was lost to another dispatcher.
        fn begin_attempt(
            pool: &Pool<Self>,
            id: MessageId,
            token: i64,
            now: i64,
        ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

        /// Extends the `leases` to `until`; returns the messages whose lease still held.
        fn renew_leases(
            pool: &Pool<Self>,
            leases: &[Lease],
            until: i64,
        ) -> impl Future<Output = Result<Vec<MessageId>, sqlx::Error>> + Send;

        /// Gives back `leases` of messages claimed with an attempt begun but never sent, so
        /// the attempt is not counted (see [`Claim`]); returns the messages given back.
        fn release_unsent(
            pool: &Pool<Self>,
            leases: &[Lease],
        ) -> impl Future<Output = Result<Vec<MessageId>, sqlx::Error>> + Send;

        /// Deletes up to `limit` delivered or skipped messages finished before `before`.
        fn purge_finished(
            pool: &Pool<Self>,
            before: i64,
            limit: i64,
        ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

        /// Makes the pending messages of `topic` due at `from` due at `to` instead; returns
        /// how many moved. For a paused topic whose destination is back before its next probe:
        /// its messages were given back due at that probe.
        fn advance(
            pool: &Pool<Self>,
            topic: &str,
            from: i64,
            to: i64,
        ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

        /// Puts a failed message back to pending; `false` when it is not failed.
        fn requeue(
            pool: &Pool<Self>,
            id: MessageId,
            now: i64,
        ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

        /// Sets a failed message aside as skipped; `false` when it is not failed.
        fn skip(
            pool: &Pool<Self>,
            id: MessageId,
            now: i64,
        ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

        /// The message that holds `id` back in its key's order, if any.
        fn fetch_blocker(
            conn: &mut Self::Connection,
            id: MessageId,
        ) -> impl Future<Output = Result<Option<OutboxRecord>, sqlx::Error>> + Send;

        /// Writes outcomes and releases their leases, in one write; returns the messages whose
        /// lease still held (the others were left as they were).
        fn settle(
            pool: &Pool<Self>,
            outcomes: &[(Lease, Settlement)],
        ) -> impl Future<Output = Result<Vec<MessageId>, sqlx::Error>> + Send;
    }
}
