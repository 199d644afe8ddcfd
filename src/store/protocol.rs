//! The steps the engine drives a store through. Crate-private: no store outside this crate
//! could honour them, since a claim lives in the handler's own sqlx transaction.

// Reachable only through the sealed `Backend`, so `pub` here names nothing a user can reach.
#![allow(unreachable_pub)]

use std::future::Future;
use std::time::{Duration, Instant};

use sqlx::{Database, Pool, Transaction};

use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::record::{Millis, Record, RecordState, StoredResponse};
use crate::scope::{Scope, ScopedKey};

/// How a purge paces itself beside live traffic: it deletes `batch` records a statement, so it
/// never holds long locks, and after each statement rests `rest` times as long as the statement
/// took, so the requests keep most of the database's time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PurgePace {
    /// How many expired records one purge statement deletes at most.
    pub batch: u32,
    /// How many times a statement's duration the purge rests after it.
    pub rest: u32,
}

impl PurgePace {
    /// A thousand records a statement, and a rest as long as the statement: the purge holds a
    /// connection at most about half the time.
    pub const DEFAULT: Self = Self {
        batch: 1000,
        rest: 1,
    };
}

/// A record about to be written by a claim.
#[derive(Debug)]
pub struct NewRecord<'a> {
    /// The record's primary key.
    pub key: ScopedKey,
    /// The scope it belongs to, stored in clear for operators (the raw key is not).
    pub scope: &'a Scope,
    /// The request's fingerprint.
    pub fingerprint: Fingerprint,
    /// `Processing` for a claim before the handler runs, or a final state.
    pub state: RecordState,
    /// The response, for a final state.
    pub response: Option<&'a StoredResponse>,
    pub created_at: Millis,
    pub expires_at: Millis,
    /// For a claim that outlives its transaction: the holder and when its lease runs out.
    pub lease: Option<LeaseClaim>,
}

/// The holder of a lease and when the lease runs out unless renewed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseClaim {
    /// An id unique to one holder, so only it can renew, finish or release the claim.
    pub owner: [u8; 16],
    pub until: Millis,
}

/// What [`Protocol::open`] found under a key.
#[derive(Debug)]
pub enum Opened<DB: Database> {
    /// A live record holds the key: answer from it.
    Live(Record),
    /// No live record: a transaction is begun to claim the key in.
    Claimable {
        tx: Transaction<'static, DB>,
        /// Whether an expired record is being replaced.
        expired: bool,
    },
}

/// What [`Protocol::begin_claimed`] did.
#[derive(Debug)]
pub enum BeganClaim<DB: Database> {
    /// The transaction is begun and holds the claim.
    Ours(Transaction<'static, DB>),
    /// A live record holds the key. Nothing was left open.
    Taken,
    /// The backend cannot send this claim with the statement that begins its transaction:
    /// begin, then claim.
    Unfused,
}

/// Storage for idempotency records, inside the handler's own database.
///
/// A backend implements these steps so that:
/// - a [`claim`](Protocol::claim) gives its transaction the key alone: a concurrent claimer of
///   the same key waits for that transaction to end, no longer than its `lock_wait` (bounded by
///   the claim statement itself, or for the whole transaction by [`begin`](Protocol::begin), as
///   the backend can), and a live record refuses the claim. Whether the claim writes a row or
///   only takes a lock is the backend's choice;
/// - [`commit_record`](Protocol::commit_record) writes the record and commits, where the table's
///   unique key has the last word: a live record under the key, however it got there, fails the
///   commit as [`Error::Conflict`] and nothing of the transaction stands. An expired record is
///   replaced atomically;
/// - a wait that runs out surfaces as [`Error::Busy`], a deadlock or serialization failure as
///   [`Error::Conflict`].
pub trait Protocol: Clone + Send + Sync + 'static {
    /// The sqlx database the records (and the handler's writes) live in.
    type Database: Database;

    /// The protocol on `pool`'s database.
    fn on(pool: Pool<Self::Database>) -> Self;

    /// The pool transactions are begun from.
    fn pool(&self) -> &Pool<Self::Database>;

    /// Creates or upgrades the tables; a no-op when they are current. Safe to call from several
    /// instances at once.
    fn migrate(&self) -> impl Future<Output = Result<(), Error>> + Send;

    /// Reads a committed record outside any transaction: the fast path for replays.
    fn lookup(&self, key: &ScopedKey)
    -> impl Future<Output = Result<Option<Record>, Error>> + Send;

    /// Reads the record under `key` and, unless it is live at `now`, begins a claim
    /// transaction (as [`begin`](Protocol::begin) does) on the same connection, saving a
    /// checkout per new key.
    fn open<'a>(
        &'a self,
        key: &'a ScopedKey,
        now: Millis,
        lock_wait: Duration,
    ) -> impl Future<Output = Result<Opened<Self::Database>, Error>> + Send + 'a;

    /// Begins a transaction whose lock waits (the claim's wait for a concurrent duplicate) are
    /// bounded by `lock_wait`.
    fn begin(
        &self,
        lock_wait: Duration,
    ) -> impl Future<Output = Result<Transaction<'static, Self::Database>, Error>> + Send;

    /// Begins a transaction that already holds the claim on `record`'s key, in the one
    /// exchange with the database that begins it, where the backend can. The claim keeps the
    /// guarantees of [`claim`](Protocol::claim): the unique key decides, a concurrent claimer
    /// is waited for up to `lock_wait` ([`Error::Busy`] past it), a deadlock or serialization
    /// failure is [`Error::Conflict`].
    fn begin_claimed<'a>(
        &'a self,
        record: &'a NewRecord<'a>,
        lock_wait: Duration,
    ) -> impl Future<Output = Result<BeganClaim<Self::Database>, Error>> + Send + 'a;

    /// Writes `record` under the key claimed in `tx` and commits, in one exchange with the
    /// database where the backend can. [`Error::Conflict`] when a live record holds the key:
    /// the transaction is then rolled back, the work's writes with it.
    fn commit_record<'a>(
        &'a self,
        tx: Transaction<'static, Self::Database>,
        record: &'a NewRecord<'a>,
    ) -> impl Future<Output = Result<(), Error>> + Send + 'a;

    /// Claims `record`'s key in the transaction `conn` is in (see the trait's docs), waiting
    /// up to `lock_wait` for a concurrent claimer. Returns `false`, holding nothing, when a
    /// live record holds the key. The claim is the first statement of a transaction from
    /// [`begin`](Protocol::begin): MySQL's claim procedure begins a transaction of its own,
    /// which commits whatever came before.
    fn claim<'a>(
        &'a self,
        conn: &'a mut <Self::Database as Database>::Connection,
        record: &'a NewRecord<'a>,
        lock_wait: Duration,
    ) -> impl Future<Output = Result<bool, Error>> + Send + 'a;

    /// Begins a transaction that holds `key` as a dedupe key alone: no record, no response, only
    /// the key and when it expires, in `idempotency_inbox`. The key's row is written now, in that
    /// transaction, replacing a row expired at `now`, so it commits or rolls back with the work.
    /// `None`, with nothing left open, when a live row holds the key. A concurrent claimer is
    /// waited for up to `lock_wait` ([`Error::Busy`] past it); a deadlock or serialization
    /// failure is [`Error::Conflict`].
    fn claim_key<'a>(
        &'a self,
        key: &'a ScopedKey,
        now: Millis,
        expires_at: Millis,
        lock_wait: Duration,
    ) -> impl Future<Output = Result<Option<Transaction<'static, Self::Database>>, Error>> + Send + 'a;

    /// Whether a committed [`claim_key`](Protocol::claim_key) holds `key` and is live at `now`.
    fn key_held<'a>(
        &'a self,
        key: &'a ScopedKey,
        now: Millis,
    ) -> impl Future<Output = Result<bool, Error>> + Send + 'a;

    /// Reads the record under `key` within the transaction.
    fn find<'a>(
        &'a self,
        conn: &'a mut <Self::Database as Database>::Connection,
        key: &'a ScopedKey,
    ) -> impl Future<Output = Result<Option<Record>, Error>> + Send + 'a;

    /// Extends a lease held by `lease.owner` to `lease.until`; `false` if it is no longer held.
    fn renew_lease<'a>(
        &'a self,
        key: &'a ScopedKey,
        lease: LeaseClaim,
    ) -> impl Future<Output = Result<bool, Error>> + Send + 'a;

    /// Takes over a processing record whose lease ran out by `now`; `false` if the lease is
    /// still live or someone else took it first.
    fn take_over_lease<'a>(
        &'a self,
        key: &'a ScopedKey,
        lease: LeaseClaim,
        now: Millis,
    ) -> impl Future<Output = Result<bool, Error>> + Send + 'a;

    /// Records the outcome of leased work and ends the lease; `false` if the lease was lost.
    fn finish_leased<'a>(
        &'a self,
        key: &'a ScopedKey,
        owner: [u8; 16],
        state: RecordState,
        response: &'a StoredResponse,
    ) -> impl Future<Output = Result<bool, Error>> + Send + 'a;

    /// Deletes the claim of leased work that failed retryably; `false` if the lease was lost.
    fn release_lease<'a>(
        &'a self,
        key: &'a ScopedKey,
        owner: [u8; 16],
    ) -> impl Future<Output = Result<bool, Error>> + Send + 'a;

    /// Deletes the record under `key`, whatever its state: an operator's explicit decision.
    /// `false` if there was none.
    fn forget<'a>(
        &'a self,
        key: &'a ScopedKey,
    ) -> impl Future<Output = Result<bool, Error>> + Send + 'a;

    /// Deletes up to `limit` records and dedupe keys expired at `now`; returns how many it
    /// deleted.
    fn purge_expired_batch(
        &self,
        now: Millis,
        limit: u32,
    ) -> impl Future<Output = Result<u64, Error>> + Send;

    /// How [`purge_expired`](Protocol::purge_expired) paces itself.
    fn purge_pace(&self) -> PurgePace {
        PurgePace::DEFAULT
    }

    /// Deletes every record expired at `now`, paced by [`purge_pace`](Protocol::purge_pace);
    /// returns the count.
    fn purge_expired(&self, now: Millis) -> impl Future<Output = Result<u64, Error>> + Send {
        async move {
            let PurgePace { batch: limit, rest } = self.purge_pace();
            let mut total = 0;
            loop {
                let started = Instant::now();
                let deleted = self.purge_expired_batch(now, limit).await?;
                total += deleted;
                if deleted < u64::from(limit) {
                    return Ok(total);
                }
                tokio::time::sleep(started.elapsed() * rest).await;
            }
        }
    }
}
