//! The databases this crate keeps its tables in: the public, sealed [`Backend`], and behind it
//! one crate-private trait, [`Storage`], and one module per database (`postgres/`, `mysql/`,
//! `sqlite/`) that implements it for its concrete sqlx type: everything the crate does there
//! (claiming keys, keeping records and dedupe keys, leases, purging, the outbox's table,
//! migrating).
//!
//! What every database runs alike (binding the same values to its own statement text, reading
//! a row back, running the migrations) is written once, in macros ([`alike`], [`bound`],
//! [`migrate::runner`], and the outbox's in [`outbox`]), and expanded in each database's module,
//! where the types are concrete: no generic code has to spell out what a database can encode or
//! decode. What differs is the database's own code, in its own folder: how it claims a key,
//! begins the claim's transaction and commits the record, and how it leases due messages.

#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
use std::borrow::Cow;
use std::future::Future;
use std::time::Duration;

use sqlx::error::DatabaseError;
use sqlx::{Pool, Transaction};

use crate::backoff::Backoff;
use crate::clock::Millis;
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::record::{NewRecord, Record, RecordState, StoredResponse};

mod claim;
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
mod literal;
mod migrate;
#[cfg(feature = "mysql")]
pub(crate) mod mysql;
#[cfg(feature = "outbox")]
mod outbox;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

#[cfg(feature = "outbox")]
pub(crate) use outbox::{Claim, ClaimedMessage, Handed, Lease, Settlement, Topics};

pub(crate) use migrate::MigrationError;
pub(crate) use sealed::Storage;

/// A database this crate keeps its tables in: `sqlx::Sqlite`, `sqlx::Postgres` and
/// `sqlx::MySql` (MySQL 8 and MariaDB), each behind the cargo feature of its name.
///
/// It is the one type parameter of the crate's generic types, as in sqlx:
/// [`Store<Postgres>`](crate::Store) (alias `PgStore`),
/// [`IdempotencyLayer<Postgres>`](crate::IdempotencyLayer), [`Engine<Postgres>`](crate::Engine)
/// and [`Tx<Postgres>`](crate::Tx). Code of your own that is generic over the backend bounds
/// its parameter with `DB: Backend`.
#[cfg_attr(
    feature = "outbox",
    doc = "\nThe outbox's `Outbox<Postgres>` takes it too."
)]
///
/// The trait is sealed: how each database claims a key, leases work or keeps outbox messages is
/// internal to this crate and may change in any release without a change to this trait.
pub trait Backend: Storage {}

#[cfg(feature = "sqlite")]
impl Backend for sqlx::Sqlite {}
#[cfg(feature = "postgres")]
impl Backend for sqlx::Postgres {}
#[cfg(feature = "mysql")]
impl Backend for sqlx::MySql {}

/// Who holds a key after a claim.
// `pub` for the sealed trait's signatures; the module is private, so no user can reach it.
#[allow(unreachable_pub)]
#[derive(Debug)]
pub enum Claimed<DB: sqlx::Database> {
    /// This claim: the transaction holding it.
    Ours(Transaction<'static, DB>),
    /// Another intent's committed record.
    Theirs(Record),
    /// A live dedupe key, claimed without a record.
    Held,
}

/// How a purge paces itself beside live traffic: it deletes `batch` records a statement, so it
/// never holds long locks, and after each statement rests `rest` times as long as the statement
/// took, so the requests keep most of the database's time.
#[allow(unreachable_pub)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PurgePace {
    /// How many expired records one purge statement deletes at most.
    pub(crate) batch: u32,
    /// How many times a statement's duration the purge rests after it.
    pub(crate) rest: u32,
}

impl PurgePace {
    /// A thousand records a statement, and a rest as long as the statement: the purge holds a
    /// connection at most about half the time.
    pub(crate) const DEFAULT: Self = Self {
        batch: 1000,
        rest: 1,
    };
}

mod sealed {
    // `pub` inside a private module is the sealed-trait idiom: `Backend` names it as a
    // supertrait while no one outside the crate can implement or call it.
    #![allow(unreachable_pub)]

    use super::*;
    #[cfg(feature = "outbox")]
    use crate::backend::outbox::Handed;
    #[cfg(feature = "outbox")]
    use crate::clock::Clock;
    #[cfg(feature = "outbox")]
    use crate::message::{DownstreamKey, Message, MessageId, OutboxRecord};
    use crate::record::LeaseClaim;
    use crate::scope::ScopedKey;

    /// What the crate does in one database, implemented once per concrete sqlx type: the
    /// records and dedupe keys first, then (with the `outbox` feature) the outbox's table.
    ///
    /// The records' guarantees: a claim gives its transaction the key alone (a concurrent
    /// claimer of the same key waits for that transaction to end, no longer than the claim's
    /// bound, and a live record refuses the claim); [`commit_record`](Storage::commit_record)
    /// writes the record and commits, where the table's unique key has the last word (a live
    /// record under the key, however it got there, fails the commit as [`Error::Conflict`] and
    /// nothing of the transaction stands; an expired record is replaced atomically); a wait
    /// that runs out surfaces as [`Error::Busy`], a deadlock or serialization failure as
    /// [`Error::Conflict`].
    pub trait Storage: sqlx::Database {
        /// How [`purge_batch`](Storage::purge_batch) is paced: its limit, and the rest after
        /// each statement.
        const PURGE_PACE: PurgePace = PurgePace::DEFAULT;

        /// Whether one lock guards every write of the database (SQLite), so that a lock wait
        /// that ran out means another writer holds the whole database, not only the key.
        const ONE_WRITE_LOCK: bool = false;

        /// Creates or upgrades the records' tables; a no-op when they are current. Safe to call
        /// from several instances at once.
        fn migrate_records(
            pool: &Pool<Self>,
        ) -> impl Future<Output = Result<(), MigrationError>> + Send;

        /// Fails with [`Error::SchemaOutdated`] while the records' schema is older than this
        /// code.
        fn check_schema(pool: &Pool<Self>) -> impl Future<Output = Result<(), Error>> + Send;

        /// Claims `record`'s key, in `begun` if given (a transaction from
        /// [`begin`](Storage::begin)), else as this database claims a new key best; or reads
        /// the live record that holds it. Waits for a concurrent claimer within `wait` in all.
        fn claim_record<'a>(
            pool: &'a Pool<Self>,
            record: &'a NewRecord<'a>,
            wait: Duration,
            begun: Option<Transaction<'static, Self>>,
        ) -> impl Future<Output = Result<Claimed<Self>, Error>> + Send + 'a;

        /// Begins a transaction whose lock waits (the claim's wait for a concurrent duplicate)
        /// are bounded by `lock_wait`.
        fn begin(
            pool: &Pool<Self>,
            lock_wait: Duration,
        ) -> impl Future<Output = Result<Transaction<'static, Self>, Error>> + Send;

        /// Claims `record`'s key in the transaction `conn` is in, waiting up to `lock_wait`
        /// for a concurrent claimer. Returns `false`, holding nothing, when a live record holds
        /// the key. The claim is the first statement of a transaction from
        /// [`begin`](Storage::begin): MySQL's claim procedure begins a transaction of its own,
        /// which commits whatever came before.
        fn claim_in<'a>(
            conn: &'a mut Self::Connection,
            record: &'a NewRecord<'a>,
            lock_wait: Duration,
        ) -> impl Future<Output = Result<bool, Error>> + Send + 'a;

        /// Begins a transaction that holds `key` as a dedupe key alone: no record, no
        /// response, only the key and when it expires, in `idempotency_inbox`. The key's row is
        /// written now, in that transaction, replacing a row expired at `now`, so it commits or
        /// rolls back with the work. `None`, with nothing left open, when a live row holds the
        /// key. A concurrent claimer is waited for up to `lock_wait` ([`Error::Busy`] past it);
        /// a deadlock or serialization failure is [`Error::Conflict`].
        fn claim_key<'a>(
            pool: &'a Pool<Self>,
            key: &'a ScopedKey,
            now: Millis,
            expires_at: Millis,
            lock_wait: Duration,
        ) -> impl Future<Output = Result<Option<Transaction<'static, Self>>, Error>> + Send + 'a;

        /// Claims `key` as a dedupe key in the transaction `conn` is in, as
        /// [`claim_key`](Storage::claim_key) does in a transaction of its own: `false`, the
        /// transaction unharmed, when a live row holds the key. Several keys claimed in one
        /// transaction commit, or roll back, together.
        fn claim_key_in<'a>(
            conn: &'a mut Self::Connection,
            key: &'a ScopedKey,
            now: Millis,
            expires_at: Millis,
            lock_wait: Duration,
        ) -> impl Future<Output = Result<bool, Error>> + Send + 'a;

        /// Writes `record` under the key claimed in `tx` and commits, in one exchange with the
        /// database where it can. [`Error::Conflict`] when a live record holds the key: the
        /// transaction is then rolled back, the work's writes with it.
        fn commit_record<'a>(
            tx: Transaction<'static, Self>,
            record: &'a NewRecord<'a>,
        ) -> impl Future<Output = Result<(), Error>> + Send + 'a;

        /// Reads the record under `key` on `conn`.
        fn find<'a>(
            conn: &'a mut Self::Connection,
            key: &'a ScopedKey,
        ) -> impl Future<Output = Result<Option<Record>, Error>> + Send + 'a;

        /// Whether a committed [`claim_key`](Storage::claim_key) holds `key` and is live at
        /// `now`.
        fn key_held<'a>(
            pool: &'a Pool<Self>,
            key: &'a ScopedKey,
            now: Millis,
        ) -> impl Future<Output = Result<bool, Error>> + Send + 'a;

        /// Extends a lease held by `lease.owner` to `lease.until`; `false` if it is no longer
        /// held.
        fn renew_lease<'a>(
            pool: &'a Pool<Self>,
            key: &'a ScopedKey,
            lease: LeaseClaim,
        ) -> impl Future<Output = Result<bool, Error>> + Send + 'a;

        /// Takes over a processing record whose lease ran out by `now`; `false` if the lease is
        /// still live or someone else took it first.
        fn take_over_lease<'a>(
            pool: &'a Pool<Self>,
            key: &'a ScopedKey,
            lease: LeaseClaim,
            now: Millis,
        ) -> impl Future<Output = Result<bool, Error>> + Send + 'a;

        /// Records the outcome of leased work and ends the lease; `false` if the lease was
        /// lost.
        fn finish_leased<'a>(
            pool: &'a Pool<Self>,
            key: &'a ScopedKey,
            owner: [u8; 16],
            state: RecordState,
            response: &'a StoredResponse,
        ) -> impl Future<Output = Result<bool, Error>> + Send + 'a;

        /// Deletes the claim of leased work that failed retryably; `false` if the lease was
        /// lost.
        fn release_lease<'a>(
            pool: &'a Pool<Self>,
            key: &'a ScopedKey,
            owner: [u8; 16],
        ) -> impl Future<Output = Result<bool, Error>> + Send + 'a;

        /// Deletes the record under `key`, whatever its state; `false` if there was none.
        fn forget<'a>(
            pool: &'a Pool<Self>,
            key: &'a ScopedKey,
        ) -> impl Future<Output = Result<bool, Error>> + Send + 'a;

        /// Deletes up to `limit` records and dedupe keys expired at `now`; returns how many it
        /// deleted.
        fn purge_batch(
            pool: &Pool<Self>,
            now: Millis,
            limit: u32,
        ) -> impl Future<Output = Result<u64, Error>> + Send;

        /// Whether the database takes one writer at a time, so a dispatcher's own writes are
        /// better queued in the process than in the database's lock wait.
        #[cfg(feature = "outbox")]
        const ONE_WRITER: bool = false;

        /// Applies the outbox's schema versions not yet applied; safe when run by two
        /// instances at once.
        #[cfg(feature = "outbox")]
        fn migrate_outbox(
            pool: &Pool<Self>,
        ) -> impl Future<Output = Result<(), MigrationError>> + Send;

        /// Inserts a pending message, after taking its ordering key's lock if it has one;
        /// `None` when its downstream key is already present. A message `handed` to a
        /// dispatcher is written leased to it, its first attempt begun, as its claim would.
        #[cfg(feature = "outbox")]
        fn insert(
            conn: &mut Self::Connection,
            message: &Message,
            now: Millis,
            handed: Option<Handed>,
        ) -> impl Future<Output = Result<Option<MessageId>, sqlx::Error>> + Send;

        /// Reads one message by id.
        #[cfg(feature = "outbox")]
        fn fetch_by_id(
            conn: &mut Self::Connection,
            id: MessageId,
        ) -> impl Future<Output = Result<Option<OutboxRecord>, sqlx::Error>> + Send;

        /// Reads one message by downstream key.
        #[cfg(feature = "outbox")]
        fn fetch_by_key(
            conn: &mut Self::Connection,
            key: &DownstreamKey,
        ) -> impl Future<Output = Result<Option<OutboxRecord>, sqlx::Error>> + Send;

        /// The message that holds `id` back in its key's order, if any.
        #[cfg(feature = "outbox")]
        fn fetch_blocker(
            conn: &mut Self::Connection,
            id: MessageId,
        ) -> impl Future<Output = Result<Option<OutboxRecord>, sqlx::Error>> + Send;

        /// Leases due messages of `topics`, skipping those another dispatcher holds, and
        /// begins the attempts of those sent now (see [`Claim`]); returns the claim as made,
        /// at the time it had its connection (see [`Claim::at`]).
        #[cfg(feature = "outbox")]
        fn claim_due(
            pool: &Pool<Self>,
            clock: &Clock,
            claim: Claim,
            topics: &Topics,
        ) -> impl Future<Output = (Claim, Result<Vec<ClaimedMessage>, sqlx::Error>)> + Send;

        /// Records that the sender is about to be called on a message the claim did not begin
        /// an attempt for (a resend after a lookup): one more attempt, outcome unknown until
        /// settled, so a crash during the call leads to a lookup, not a blind resend. `false`
        /// when the lease was lost to another dispatcher.
        #[cfg(feature = "outbox")]
        fn begin_attempt(
            pool: &Pool<Self>,
            id: MessageId,
            token: i64,
            now: Millis,
        ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

        /// Extends the `leases` to `until`; returns the messages whose lease still held.
        #[cfg(feature = "outbox")]
        fn renew_leases(
            pool: &Pool<Self>,
            leases: &[Lease],
            until: Millis,
        ) -> impl Future<Output = Result<Vec<MessageId>, sqlx::Error>> + Send;

        /// Gives back `leases` of messages claimed with an attempt begun but never sent, as if
        /// the claim had not begun it: one attempt fewer, the last outcome known again, no
        /// `last_attempt_at` when no attempt is left, the lease released. Returns the messages
        /// given back.
        #[cfg(feature = "outbox")]
        fn release_unsent(
            pool: &Pool<Self>,
            leases: &[Lease],
        ) -> impl Future<Output = Result<Vec<MessageId>, sqlx::Error>> + Send;

        /// Writes outcomes and releases their leases, in one write, inside the transaction
        /// `conn` is in, if any; returns the messages whose lease still held (the others were
        /// left as they were).
        #[cfg(feature = "outbox")]
        fn settle(
            conn: &mut Self::Connection,
            outcomes: &[(Lease, Settlement)],
        ) -> impl Future<Output = Result<Vec<MessageId>, sqlx::Error>> + Send;

        /// Deletes up to `limit` delivered or skipped messages finished before `before`.
        #[cfg(feature = "outbox")]
        fn purge_finished(
            pool: &Pool<Self>,
            before: Millis,
            limit: i64,
        ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

        /// Puts a failed message back to pending, due now, its attempts counted afresh; `false`
        /// when it is not failed.
        #[cfg(feature = "outbox")]
        fn requeue(
            pool: &Pool<Self>,
            id: MessageId,
            now: Millis,
        ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

        /// Sets a failed message aside as skipped, finished now; `false` when it is not
        /// failed.
        #[cfg(feature = "outbox")]
        fn skip(
            pool: &Pool<Self>,
            id: MessageId,
            now: Millis,
        ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;
    }
}

/// The trait items of [`Storage`] every database runs alike, for the database whose `impl` it
/// is expanded in. The statements are that module's constants: `FIND` (parameter key_digest;
/// columns state, fingerprint, status, headers, body, created_at, expires_at,
/// lease_expires_at), `KEY_HELD` (key_digest, now: a row when a live dedupe key is held),
/// `RENEW_LEASE` (lease_expires_at, key_digest, lease_owner), `TAKE_OVER_LEASE` (lease_owner,
/// lease_expires_at, key_digest, now), `FINISH_LEASED` (state, status, headers, body,
/// key_digest, lease_owner), `RELEASE_LEASE` (key_digest, lease_owner), `FORGET` (key_digest),
/// `PURGE` and `PURGE_KEYS` (now, limit), `VERSIONS_TABLE_EXISTS` (a count, 0 or 1) and the
/// migration `SCHEMA`; its functions `classify` (the crate's error for a database error),
/// `migration_raced` (whether a migration collided with a concurrent one) and `apply` (the
/// migration runner, from [`migrate::runner`]).
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
macro_rules! alike {
    () => {
        async fn migrate_records(
            pool: &sqlx::Pool<Self>,
        ) -> Result<(), $crate::backend::MigrationError> {
            $crate::backend::migrate_retrying(|| apply(pool, &SCHEMA), migration_raced).await
        }

        async fn check_schema(pool: &sqlx::Pool<Self>) -> Result<(), $crate::error::Error> {
            use sqlx::Row as _;
            let mut conn = pool.acquire().await?;
            let exists: i64 = sqlx::query(VERSIONS_TABLE_EXISTS)
                .fetch_one(&mut *conn)
                .await?
                .try_get(0)?;
            let found = if exists == 0 {
                0
            } else {
                let version: Option<i64> = sqlx::query($crate::backend::VERSIONS)
                    .fetch_one(&mut *conn)
                    .await?
                    .try_get(0)?;
                version.unwrap_or(0)
            };
            $crate::backend::schema_verdict(found, &SCHEMA)
        }

        async fn find<'a>(
            conn: &'a mut Self::Connection,
            key: &'a $crate::scope::ScopedKey,
        ) -> Result<Option<$crate::record::Record>, $crate::error::Error> {
            use sqlx::Row as _;
            let row = sqlx::query(FIND)
                .bind(key.digest().to_vec())
                .fetch_optional(conn)
                .await
                .map_err(classify)?;
            let Some(row) = row else { return Ok(None) };
            $crate::backend::record_from_columns($crate::backend::RecordColumns {
                state: row.try_get(0)?,
                fingerprint: row.try_get(1)?,
                status: row.try_get(2)?,
                headers: row.try_get(3)?,
                body: row.try_get(4)?,
                expires_at: row.try_get(6)?,
                lease_expires_at: row.try_get(7)?,
            })
            .map(Some)
        }

        async fn key_held<'a>(
            pool: &'a sqlx::Pool<Self>,
            key: &'a $crate::scope::ScopedKey,
            now: $crate::clock::Millis,
        ) -> Result<bool, $crate::error::Error> {
            let row = sqlx::query(KEY_HELD)
                .bind(key.digest().to_vec())
                .bind(now.column())
                .fetch_optional(pool)
                .await
                .map_err(classify)?;
            Ok(row.is_some())
        }

        async fn renew_lease<'a>(
            pool: &'a sqlx::Pool<Self>,
            key: &'a $crate::scope::ScopedKey,
            lease: $crate::record::LeaseClaim,
        ) -> Result<bool, $crate::error::Error> {
            let done = sqlx::query(RENEW_LEASE)
                .bind(lease.until.column())
                .bind(key.digest().to_vec())
                .bind(lease.owner.to_vec())
                .execute(pool)
                .await
                .map_err(classify)?;
            Ok(done.rows_affected() == 1)
        }

        async fn take_over_lease<'a>(
            pool: &'a sqlx::Pool<Self>,
            key: &'a $crate::scope::ScopedKey,
            lease: $crate::record::LeaseClaim,
            now: $crate::clock::Millis,
        ) -> Result<bool, $crate::error::Error> {
            let done = sqlx::query(TAKE_OVER_LEASE)
                .bind(lease.owner.to_vec())
                .bind(lease.until.column())
                .bind(key.digest().to_vec())
                .bind(now.column())
                .execute(pool)
                .await
                .map_err(classify)?;
            Ok(done.rows_affected() == 1)
        }

        async fn finish_leased<'a>(
            pool: &'a sqlx::Pool<Self>,
            key: &'a $crate::scope::ScopedKey,
            owner: [u8; 16],
            state: $crate::record::RecordState,
            response: &'a $crate::record::StoredResponse,
        ) -> Result<bool, $crate::error::Error> {
            let done = sqlx::query(FINISH_LEASED)
                .bind(state.as_str().to_owned())
                .bind(i32::from(response.status.as_u16()))
                .bind(response.encode_headers())
                .bind(response.body.to_vec())
                .bind(key.digest().to_vec())
                .bind(owner.to_vec())
                .execute(pool)
                .await
                .map_err(classify)?;
            Ok(done.rows_affected() == 1)
        }

        async fn release_lease<'a>(
            pool: &'a sqlx::Pool<Self>,
            key: &'a $crate::scope::ScopedKey,
            owner: [u8; 16],
        ) -> Result<bool, $crate::error::Error> {
            let done = sqlx::query(RELEASE_LEASE)
                .bind(key.digest().to_vec())
                .bind(owner.to_vec())
                .execute(pool)
                .await
                .map_err(classify)?;
            Ok(done.rows_affected() == 1)
        }

        async fn forget<'a>(
            pool: &'a sqlx::Pool<Self>,
            key: &'a $crate::scope::ScopedKey,
        ) -> Result<bool, $crate::error::Error> {
            let done = sqlx::query(FORGET)
                .bind(key.digest().to_vec())
                .execute(pool)
                .await
                .map_err(classify)?;
            Ok(done.rows_affected() == 1)
        }

        async fn purge_batch(
            pool: &sqlx::Pool<Self>,
            now: $crate::clock::Millis,
            limit: u32,
        ) -> Result<u64, $crate::error::Error> {
            let records = sqlx::query(PURGE)
                .bind(now.column())
                .bind(i64::from(limit))
                .execute(pool)
                .await
                .map_err(classify)?
                .rows_affected();
            // The batch's room left over goes to the inbox's keys: one batch still deletes at
            // most `limit` rows, and a short batch still means both tables are clear.
            let room = u64::from(limit).saturating_sub(records);
            if room == 0 {
                return Ok(records);
            }
            let keys = sqlx::query(PURGE_KEYS)
                .bind(now.column())
                .bind(i64::try_from(room).unwrap_or(i64::MAX))
                .execute(pool)
                .await
                .map_err(classify)?
                .rows_affected();
            Ok(records + keys)
        }
    };
}
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
use alike;

/// `fn bound(statement) -> Query`: `statement` with its values bound, to run as a prepared
/// statement on `$db`.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
macro_rules! bound {
    ($db:ty) => {
        fn bound<'q>(
            statement: &$crate::backend::literal::Statement<'_>,
        ) -> sqlx::query::Query<'q, $db, <$db as sqlx::Database>::Arguments> {
            use $crate::backend::literal::Value;
            let (sql, values) = statement.bound();
            // Room for every value up front: the arguments would otherwise grow a few times
            // per record.
            let mut arguments = <$db as sqlx::Database>::Arguments::default();
            sqlx::Arguments::reserve(&mut arguments, values.len(), statement.weight());
            values.into_iter().fold(
                sqlx::query_with(sql, arguments),
                |query, value| match value {
                    // Borrowed: each value is encoded as it is bound, and PostgreSQL's and
                    // MySQL's encoders copy it straight into the message.
                    Value::Bytes(bytes) => query.bind(bytes.as_deref()),
                    Value::Text(text) => query.bind(text.as_deref()),
                    Value::Int4(int) => query.bind(*int),
                    Value::Int8(int) => query.bind(*int),
                },
            )
        }
    };
}
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
use bound;

/// The newest version `migrate` recorded for the records' schema.
const VERSIONS: &str = "SELECT MAX(version) FROM idempotency_schema_versions";

/// How many times `migrate` runs in all when concurrent migrators collide.
const MIGRATE_ATTEMPTS: u32 = 6;

/// The pause before migrating again after a collision, jittered so the migrators part.
const MIGRATE_BACKOFF: Backoff =
    Backoff::exponential(Duration::from_millis(50), Duration::from_secs(2));

/// Runs `run`, the records' migration, again while it collides with a concurrent migrator (as
/// a duplicate key, or as `raced` says).
///
/// Where the migration lock is not shared by every server that takes writes (a Galera cluster:
/// `GET_LOCK` holds on one node only), instances migrating at once through different nodes can
/// race: one's version row or procedure collides with another's, as a conflict abort, a
/// duplicate key or an object created meanwhile. The scripts are safe to run twice, so the
/// loser runs the migration again and finds the versions the winner recorded.
async fn migrate_retrying<Fut>(
    mut run: impl FnMut() -> Fut,
    raced: fn(&dyn DatabaseError) -> bool,
) -> Result<(), MigrationError>
where
    Fut: Future<Output = Result<(), MigrationError>>,
{
    let mut attempt = 1;
    loop {
        let applied = run().await;
        let collided = match &applied {
            Err(MigrationError::Sql(error) | MigrationError::Script { source: error, .. }) => {
                matches!(error, sqlx::Error::Database(db)
                    if db.is_unique_violation() || raced(db.as_ref()))
            }
            _ => false,
        };
        if !collided || attempt == MIGRATE_ATTEMPTS {
            return applied;
        }
        tracing::debug!(
            attempt,
            "a concurrent migration won a race; migrating again"
        );
        tokio::time::sleep(MIGRATE_BACKOFF.delay(attempt)).await;
        attempt += 1;
    }
}

/// [`Error::SchemaOutdated`] when `found`, the newest version recorded, is older than the last
/// of `schema`: every claim would fail on a missing table, column or function, and a client
/// would retry in vain.
fn schema_verdict<DB: sqlx::Database>(
    found: i64,
    schema: &migrate::Schema<DB>,
) -> Result<(), Error> {
    let expected = schema.scripts.last().map_or(0, |&(version, _)| version);
    if found >= expected {
        return Ok(());
    }
    tracing::error!(
        found,
        expected,
        "the idempotency schema is outdated; call Store::migrate() at start-up"
    );
    Err(Error::SchemaOutdated { found, expected })
}

/// A record's columns as `FIND` reads them.
struct RecordColumns {
    state: String,
    fingerprint: Vec<u8>,
    status: Option<i32>,
    headers: Option<Vec<u8>>,
    body: Option<Vec<u8>>,
    expires_at: i64,
    lease_expires_at: Option<i64>,
}

/// The record the columns hold, or [`Error::CorruptRecord`].
fn record_from_columns(columns: RecordColumns) -> Result<Record, Error> {
    let state = RecordState::parse(&columns.state)?;
    let fingerprint = <[u8; 32]>::try_from(columns.fingerprint.as_slice())
        .map(Fingerprint::from)
        .map_err(|_| Error::CorruptRecord("fingerprint length".into()))?;
    let response = match (columns.status, columns.headers, columns.body) {
        (Some(status), Some(headers), Some(body)) => Some(StoredResponse {
            status: u16::try_from(status)
                .ok()
                .and_then(|s| http::StatusCode::from_u16(s).ok())
                .ok_or_else(|| Error::CorruptRecord(format!("status {status}")))?,
            headers: StoredResponse::decode_headers(&headers)?,
            body: body.into(),
        }),
        _ => None,
    };
    Ok(Record {
        state,
        fingerprint,
        response,
        expires_at: Millis::from_column(columns.expires_at),
        lease_expires_at: columns.lease_expires_at.map(Millis::from_column),
    })
}

/// The crate's error for a database error: a lock wait that ran out is [`Error::Busy`], a
/// deadlock or serialization failure [`Error::Conflict`], as the database's `busy` and
/// `conflict` recognise them.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
fn classify(
    error: sqlx::Error,
    busy: fn(&dyn DatabaseError) -> bool,
    conflict: fn(&dyn DatabaseError) -> bool,
) -> Error {
    match &error {
        sqlx::Error::Database(db) if conflict(db.as_ref()) => Error::Conflict,
        sqlx::Error::Database(db) if busy(db.as_ref()) => Error::Busy,
        _ => Error::Database(error),
    }
}

/// Whether `error` says the database cannot be reached right now rather than that a statement
/// failed: the connection broke or was refused (I/O, TLS), no connection could be had in time,
/// the pool was closed, or the server reported a connection failure or its own shutdown
/// (SQLSTATE class `08`, `57P01`–`57P03`). Nothing about the work is wrong; the same work
/// succeeds once the database is back, so callers treat it as an outage, not as an attempt.
pub(crate) fn is_unreachable(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(database) => database.code().is_some_and(|code| {
            code.starts_with("08") || matches!(&*code, "57P01" | "57P02" | "57P03")
        }),
        _ => false,
    }
}

/// Whether the database aborted the transaction `error` came from to resolve a conflict with a
/// concurrent one (a serialization failure, a deadlock, a Galera certification conflict), as
/// the backends in this build recognise it; SQLite, one writer at a time, has no such aborts.
/// Such a transaction is gone, and running it again is safe.
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql")),
    allow(unused_variables)
)]
pub(crate) fn is_conflict_abort(error: &sqlx::Error) -> bool {
    let Some(database) = error.as_database_error() else {
        return false;
    };
    #[cfg(feature = "postgres")]
    if postgres::is_conflict(database) {
        return true;
    }
    #[cfg(feature = "mysql")]
    if mysql::is_conflict(database) {
        return true;
    }
    false
}

/// Writes the record's columns as consecutive values: key_digest, principal, method, route,
/// fingerprint, state, status, headers, body, created_at, expires_at, lease_owner,
/// lease_expires_at.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
fn record_values<'a>(statement: &mut literal::Statement<'a>, record: &'a NewRecord<'a>) {
    let response = record.response;
    identity_values(statement, record)
        .text(record.state.as_str())
        .opt_int4(response.map(|response| i32::from(response.status.as_u16())))
        .opt_bytes(response.map(StoredResponse::encode_headers))
        .opt_bytes(response.map(|response| &response.body[..]));
    lifetime_values(statement, record);
}

/// Writes what names the record's intent: key_digest, principal, method, route, fingerprint.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
fn identity_values<'s, 'a>(
    statement: &'s mut literal::Statement<'a>,
    record: &'a NewRecord<'a>,
) -> &'s mut literal::Statement<'a> {
    statement
        .bytes(&record.key.digest()[..])
        .opt_text(record.scope.principal().map(readable))
        .text(readable(record.scope.method()))
        .text(readable(record.scope.route()))
        .bytes(&record.fingerprint.as_bytes()[..])
}

/// Writes how long the record lives and who leases it: created_at, expires_at, lease_owner,
/// lease_expires_at.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
fn lifetime_values<'s, 'a>(
    statement: &'s mut literal::Statement<'a>,
    record: &'a NewRecord<'a>,
) -> &'s mut literal::Statement<'a> {
    statement
        .int8(record.created_at.column())
        .int8(record.expires_at.column())
        .opt_bytes(record.lease.as_ref().map(|lease| &lease.owner[..]))
        .opt_int8(record.lease.map(|lease| lease.until.column()))
}

/// A scope's text as the records table shows it to people: NUL, which PostgreSQL's `text`
/// cannot hold, becomes U+FFFD on every backend alike. The key's digest covers the exact text,
/// so two scopes that differ only there still never share a record.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
fn readable(text: &str) -> Cow<'_, str> {
    if text.contains('\0') {
        Cow::Owned(text.replace('\0', "\u{fffd}"))
    } else {
        Cow::Borrowed(text)
    }
}
