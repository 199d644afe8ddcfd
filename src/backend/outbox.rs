//! The outbox's part of every backend: the words the dispatcher and the backends share (a
//! claim, a claimed message, a lease, a settlement), and what every database runs alike, in the
//! macros [`outbox_alike`] and [`json_batches`], expanded in each database's `impl`.

// `pub` for the sealed trait's signatures; the module is private, so no user can reach them.
#![allow(unreachable_pub)]
// Without a database the macros are never expanded: the outbox then only has to compile.
#![cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
    allow(unused_macros, unused_imports)
)]

use std::future::Future;

#[cfg(any(feature = "postgres", feature = "sqlite"))]
use serde::Serialize;

use crate::clock::{Clock, Millis};
use crate::message::{DownstreamKey, MessageId, OutboxRecord, Status};

/// A claim: the first due, unleased messages up to `limit` get `token` and a lease until
/// `lease_until`, so no other dispatcher takes them before then. In the same write, each one
/// that is sent now (its last outcome known, fewer than `max_attempts` attempts made) begins
/// an attempt: one more attempt, outcome unknown until settled, `last_attempt_at` = `now`.
#[derive(Debug, Clone, Copy)]
pub struct Claim {
    pub now: Millis,
    pub lease_until: Millis,
    pub token: i64,
    pub limit: i64,
    pub max_attempts: i64,
    /// Whether to probe for due messages first, where the database probes: not when the
    /// previous claim found all it asked for, as more are then likely due and the probe would
    /// cost a statement. Where the database plans a backlog's claim differently (PostgreSQL's
    /// JIT), `false` also says a backlog is likely; its claim lets the topics take turns.
    pub probe: bool,
}

impl Claim {
    /// The same claim made at `now`: one that waited for a connection (a pool in use, a
    /// database coming back) leases from when it runs, not from when it was asked for, or its
    /// leases could be over before the dispatcher has them, and its next claim would take the
    /// same messages again.
    #[must_use]
    pub fn at(self, now: Millis) -> Self {
        let lease = self.lease_until.column().saturating_sub(self.now.column());
        Self {
            now,
            lease_until: Millis::from_column(now.column().saturating_add(lease)),
            ..self
        }
    }

    /// Whether a message with this history is sent now, so the claim begins its attempt: its
    /// last outcome is known and it has attempts left.
    #[cfg(feature = "mysql")]
    pub fn begins(&self, record: &OutboxRecord) -> bool {
        !record.outcome_unknown && i64::from(record.attempts) < self.max_attempts
    }
}

/// Which topics' messages a claim takes: a dispatcher leaves its paused destinations alone,
/// and claims a paused one's probe on its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Topics {
    /// Every topic but these, the paused ones (none: every topic).
    Except(Vec<String>),
    /// This topic only: a paused destination's probe.
    Only(String),
}

impl Topics {
    /// The topics the claim leaves out.
    #[cfg(feature = "sqlite")]
    pub fn skipped(&self) -> &[String] {
        match self {
            Self::Except(skipped) => skipped,
            Self::Only(_) => &[],
        }
    }

    /// The one topic the claim takes, if it takes only one.
    #[cfg(feature = "sqlite")]
    pub fn only(&self) -> Option<&str> {
        match self {
            Self::Except(_) => None,
            Self::Only(topic) => Some(topic),
        }
    }

    /// The topics left out, as the JSON array SQLite's claims take.
    #[cfg(feature = "sqlite")]
    pub fn skipped_json(&self) -> Result<String, sqlx::Error> {
        serde_json::to_string(self.skipped()).map_err(|error| sqlx::Error::Encode(error.into()))
    }
}

/// A message a claim leased: its row as the claim left it, and whether the claim began an
/// attempt (if not, its last outcome is unknown and it is looked up first, or it has used up
/// its attempts).
#[derive(Debug, Clone)]
pub struct ClaimedMessage {
    pub record: OutboxRecord,
    pub attempt_begun: bool,
}

/// The lease a message is inserted with when a dispatcher of the enqueuing process takes it
/// at the commit, in place of a claim: the dispatcher's token and the lease's expiry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Handed {
    pub token: i64,
    pub until: Millis,
}

/// A lease a dispatcher holds: the message and the token of the claim that leased it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Lease {
    pub id: MessageId,
    pub token: i64,
}

/// The columns an attempt's outcome writes; the lease is always released with it.
#[derive(Debug, Clone)]
pub struct Settlement {
    pub status: Status,
    pub receipt: Option<String>,
    pub last_error: Option<String>,
    /// The attempts counted once it is written: the claim's count, or one fewer where the
    /// attempt the claim began turned out to be an outage, which is not an attempt.
    pub attempts: u32,
    pub outcome_unknown: bool,
    pub next_attempt_at: Millis,
    pub finished_at: Option<Millis>,
    /// When the attempt's send started, where the claim began the attempt earlier (a message
    /// claimed ahead of a free send slot): it replaces the claim's time, so a lookup grace
    /// counts from the send. `None` leaves `last_attempt_at` as it is.
    pub last_attempt_at: Option<Millis>,
}

/// The columns every read selects, under the names the one row decoder reads them by. A macro,
/// not a constant, so each backend can `concat!` it into its SQL text at compile time.
macro_rules! record_columns {
    () => {
        "id, topic, downstream_key, payload, status, attempts, outcome_unknown, receipt, \
         last_error, created_at, next_attempt_at, last_attempt_at, finished_at, requeued_at, \
         ordering_key"
    };
}
pub(super) use record_columns;

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
/// from finished to pending, and no earlier id of a key commits after a later one (see each
/// backend's `ORDER_LOCK`).
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
pub(super) use in_key_order;

/// A message's columns as every read selects them (`record_columns!()`).
pub(super) struct OutboxColumns {
    pub(super) id: i64,
    pub(super) topic: String,
    pub(super) downstream_key: String,
    pub(super) payload: Vec<u8>,
    pub(super) status: String,
    pub(super) attempts: i64,
    pub(super) outcome_unknown: bool,
    pub(super) receipt: Option<String>,
    pub(super) last_error: Option<String>,
    pub(super) created_at: i64,
    pub(super) next_attempt_at: i64,
    pub(super) last_attempt_at: Option<i64>,
    pub(super) finished_at: Option<i64>,
    pub(super) requeued_at: Option<i64>,
    pub(super) ordering_key: Option<String>,
}

impl OutboxColumns {
    /// The message the columns hold; an unknown status fails to decode.
    pub(super) fn into_record(self) -> Result<OutboxRecord, sqlx::Error> {
        let status = Status::parse(&self.status).ok_or_else(|| sqlx::Error::ColumnDecode {
            index: "status".into(),
            source: format!("unknown outbox status {:?}", self.status).into(),
        })?;
        let time = |millis| Millis::from_column(millis).into();
        Ok(OutboxRecord {
            id: MessageId::from(self.id),
            topic: self.topic,
            downstream_key: DownstreamKey::from_stored(self.downstream_key),
            payload: self.payload,
            status,
            attempts: u32::try_from(self.attempts).unwrap_or(u32::MAX),
            outcome_unknown: self.outcome_unknown,
            receipt: self.receipt,
            last_error: self.last_error,
            created_at: time(self.created_at),
            next_attempt_at: time(self.next_attempt_at),
            last_attempt_at: self.last_attempt_at.map(time),
            finished_at: self.finished_at.map(time),
            requeued_at: self.requeued_at.map(time),
            ordering_key: self.ordering_key,
        })
    }
}

/// `fn outbox_record(row) -> Result<OutboxRecord, sqlx::Error>` for `$db`: every backend
/// selects the same columns under the same names, so one decoder serves them all.
macro_rules! outbox_decoder {
    ($db:ty) => {
        fn outbox_record(
            row: &<$db as sqlx::Database>::Row,
        ) -> Result<$crate::message::OutboxRecord, sqlx::Error> {
            use sqlx::Row as _;
            $crate::backend::outbox::OutboxColumns {
                id: row.try_get("id")?,
                topic: row.try_get("topic")?,
                downstream_key: row.try_get("downstream_key")?,
                payload: row.try_get("payload")?,
                status: row.try_get("status")?,
                attempts: row.try_get("attempts")?,
                outcome_unknown: row.try_get("outcome_unknown")?,
                receipt: row.try_get("receipt")?,
                last_error: row.try_get("last_error")?,
                created_at: row.try_get("created_at")?,
                next_attempt_at: row.try_get("next_attempt_at")?,
                last_attempt_at: row.try_get("last_attempt_at")?,
                finished_at: row.try_get("finished_at")?,
                requeued_at: row.try_get("requeued_at")?,
                ordering_key: row.try_get("ordering_key")?,
            }
            .into_record()
        }
    };
}
pub(super) use outbox_decoder;

/// The outbox's trait items of [`Storage`](super::Storage) every database runs alike, for the
/// database whose `impl` it is expanded in. The statements are that module's `outbox_sql`
/// constants: `FETCH_BY_ID` (id), `FETCH_BY_KEY` (downstream_key), `FETCH_BLOCKER` (id, id),
/// `BEGIN_ATTEMPT` (last_attempt_at, id, lease_token), `PURGE_FINISHED` (finished_before,
/// limit), `REQUEUE` and `SKIP` (now, id), and its migration `outbox_sql::SCHEMA`; rows are
/// read by its `outbox_record`.
macro_rules! outbox_alike {
    () => {
        async fn migrate_outbox(
            pool: &sqlx::Pool<Self>,
        ) -> Result<(), $crate::backend::MigrationError> {
            apply(pool, &outbox_sql::SCHEMA).await
        }

        async fn fetch_by_id(
            conn: &mut Self::Connection,
            id: $crate::message::MessageId,
        ) -> Result<Option<$crate::message::OutboxRecord>, sqlx::Error> {
            let row = sqlx::query(outbox_sql::FETCH_BY_ID)
                .bind(id.get())
                .fetch_optional(conn)
                .await?;
            row.as_ref().map(outbox_record).transpose()
        }

        async fn fetch_by_key(
            conn: &mut Self::Connection,
            key: &$crate::message::DownstreamKey,
        ) -> Result<Option<$crate::message::OutboxRecord>, sqlx::Error> {
            let row = sqlx::query(outbox_sql::FETCH_BY_KEY)
                .bind(key.as_str())
                .fetch_optional(conn)
                .await?;
            row.as_ref().map(outbox_record).transpose()
        }

        async fn fetch_blocker(
            conn: &mut Self::Connection,
            id: $crate::message::MessageId,
        ) -> Result<Option<$crate::message::OutboxRecord>, sqlx::Error> {
            let row = sqlx::query(outbox_sql::FETCH_BLOCKER)
                .bind(id.get())
                .bind(id.get())
                .fetch_optional(conn)
                .await?;
            row.as_ref().map(outbox_record).transpose()
        }

        async fn begin_attempt(
            pool: &sqlx::Pool<Self>,
            id: $crate::message::MessageId,
            token: i64,
            now: $crate::clock::Millis,
        ) -> Result<bool, sqlx::Error> {
            let done = sqlx::query(outbox_sql::BEGIN_ATTEMPT)
                .bind(now.column())
                .bind(id.get())
                .bind(token)
                .execute(pool)
                .await?;
            Ok(done.rows_affected() == 1)
        }

        async fn purge_finished(
            pool: &sqlx::Pool<Self>,
            before: $crate::clock::Millis,
            limit: i64,
        ) -> Result<u64, sqlx::Error> {
            let done = sqlx::query(outbox_sql::PURGE_FINISHED)
                .bind(before.column())
                .bind(limit)
                .execute(pool)
                .await?;
            Ok(done.rows_affected())
        }

        async fn requeue(
            pool: &sqlx::Pool<Self>,
            id: $crate::message::MessageId,
            now: $crate::clock::Millis,
        ) -> Result<bool, sqlx::Error> {
            let done = sqlx::query(outbox_sql::REQUEUE)
                .bind(now.column())
                .bind(id.get())
                .execute(pool)
                .await?;
            Ok(done.rows_affected() == 1)
        }

        async fn skip(
            pool: &sqlx::Pool<Self>,
            id: $crate::message::MessageId,
            now: $crate::clock::Millis,
        ) -> Result<bool, sqlx::Error> {
            let done = sqlx::query(outbox_sql::SKIP)
                .bind(now.column())
                .bind(id.get())
                .execute(pool)
                .await?;
            Ok(done.rows_affected() == 1)
        }
    };
}
pub(super) use outbox_alike;

/// The batched writes of [`Storage`](super::Storage) for SQLite, which takes the leases as a
/// JSON array in one prepared statement returning the ids whose lease still held: its
/// `outbox_sql` constants `RENEW_LEASES` (lease_until, the array of `{id, token}`),
/// `RELEASE_UNSENT` (the array of `{id, token}`) and `SETTLE` (the array of [`Outcome`]s).
/// PostgreSQL writes the same arrays in, planning each run afresh.
#[cfg(feature = "sqlite")]
macro_rules! json_batches {
    () => {
        async fn renew_leases(
            pool: &sqlx::Pool<Self>,
            leases: &[$crate::backend::outbox::Lease],
            until: $crate::clock::Millis,
        ) -> Result<Vec<$crate::message::MessageId>, sqlx::Error> {
            if leases.is_empty() {
                return Ok(Vec::new());
            }
            let held = $crate::backend::outbox::held(leases)?;
            let ids = sqlx::query_scalar::<_, i64>(outbox_sql::RENEW_LEASES)
                .bind(until.column())
                .bind(held.as_str())
                .fetch_all(pool)
                .await?;
            Ok(ids
                .into_iter()
                .map($crate::message::MessageId::from)
                .collect())
        }

        async fn release_unsent(
            pool: &sqlx::Pool<Self>,
            leases: &[$crate::backend::outbox::Lease],
        ) -> Result<Vec<$crate::message::MessageId>, sqlx::Error> {
            if leases.is_empty() {
                return Ok(Vec::new());
            }
            let held = $crate::backend::outbox::held(leases)?;
            let ids = sqlx::query_scalar::<_, i64>(outbox_sql::RELEASE_UNSENT)
                .bind(held.as_str())
                .fetch_all(pool)
                .await?;
            Ok(ids
                .into_iter()
                .map($crate::message::MessageId::from)
                .collect())
        }

        async fn settle(
            conn: &mut Self::Connection,
            outcomes: &[(
                $crate::backend::outbox::Lease,
                $crate::backend::outbox::Settlement,
            )],
        ) -> Result<Vec<$crate::message::MessageId>, sqlx::Error> {
            if outcomes.is_empty() {
                return Ok(Vec::new());
            }
            let outcomes = $crate::backend::outbox::outcomes(outcomes)?;
            let ids = sqlx::query_scalar::<_, i64>(outbox_sql::SETTLE)
                .bind(outcomes.as_str())
                .fetch_all(conn)
                .await?;
            Ok(ids
                .into_iter()
                .map($crate::message::MessageId::from)
                .collect())
        }
    };
}
#[cfg(feature = "sqlite")]
pub(super) use json_batches;

#[cfg(any(feature = "postgres", feature = "sqlite"))]
/// `leases` as the JSON array of `{id, token}` a batched renewal or release takes.
pub(super) fn held(leases: &[Lease]) -> Result<String, sqlx::Error> {
    let held: Vec<_> = leases.iter().map(|lease| Held::from(*lease)).collect();
    json(&held)
}

#[cfg(any(feature = "postgres", feature = "sqlite"))]
/// `outcomes` as the JSON array a batched settle takes.
pub(super) fn outcomes(outcomes: &[(Lease, Settlement)]) -> Result<String, sqlx::Error> {
    let rows: Vec<_> = outcomes
        .iter()
        .map(|(lease, settlement)| Outcome::new(*lease, settlement))
        .collect();
    json(&rows)
}

/// Runs a claim: one connection for the probe and the statements after it (each acquire from
/// the pool costs a round trip of its own, the pool pings the connection it hands out), and the
/// claim made at the time `clock` reads once it has that connection (see [`Claim::at`]).
pub(super) async fn claiming<DB, Fut>(
    pool: &sqlx::Pool<DB>,
    clock: &Clock,
    claim: Claim,
    run: impl FnOnce(sqlx::pool::PoolConnection<DB>, Claim) -> Fut,
) -> (Claim, Result<Vec<ClaimedMessage>, sqlx::Error>)
where
    DB: sqlx::Database,
    Fut: Future<Output = Result<Vec<ClaimedMessage>, sqlx::Error>>,
{
    let conn = match pool.acquire().await {
        Ok(conn) => conn,
        Err(error) => return (claim, Err(error)),
    };
    let claim = claim.at(clock.now());
    (claim, run(conn, claim).await)
}
#[cfg(any(feature = "postgres", feature = "sqlite"))]
/// A lease as a batched renewal or release passes it.
#[derive(Serialize)]
struct Held {
    id: i64,
    token: i64,
}

#[cfg(any(feature = "postgres", feature = "sqlite"))]
impl From<Lease> for Held {
    fn from(lease: Lease) -> Self {
        Self {
            id: lease.id.get(),
            token: lease.token,
        }
    }
}

#[cfg(any(feature = "postgres", feature = "sqlite"))]
/// A settlement as a batched settle passes it; the field names are the dialects' JSON keys.
#[derive(Serialize)]
struct Outcome<'a> {
    id: i64,
    token: i64,
    status: &'static str,
    receipt: Option<&'a str>,
    last_error: Option<&'a str>,
    attempts: u32,
    outcome_unknown: bool,
    next_attempt_at: i64,
    finished_at: Option<i64>,
    last_attempt_at: Option<i64>,
}

#[cfg(any(feature = "postgres", feature = "sqlite"))]
impl<'a> Outcome<'a> {
    fn new(lease: Lease, settlement: &'a Settlement) -> Self {
        Self {
            id: lease.id.get(),
            token: lease.token,
            status: settlement.status.as_str(),
            receipt: settlement.receipt.as_deref(),
            last_error: settlement.last_error.as_deref(),
            attempts: settlement.attempts,
            outcome_unknown: settlement.outcome_unknown,
            next_attempt_at: settlement.next_attempt_at.column(),
            finished_at: settlement.finished_at.map(Millis::column),
            last_attempt_at: settlement.last_attempt_at.map(Millis::column),
        }
    }
}

#[cfg(any(feature = "postgres", feature = "sqlite"))]
fn json(value: &impl Serialize) -> Result<String, sqlx::Error> {
    serde_json::to_string(value).map_err(|error| sqlx::Error::Encode(error.into()))
}
