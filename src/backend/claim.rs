//! How a claim settles the races it can lose without an answer, the same on every database:
//! rounds of begin, claim and read, until the key is ours or its holder's record is read. A
//! database that can send its claim with the statement that begins its transaction tries that
//! first ([`fused_then_rounds`]).

#[cfg(any(feature = "postgres", feature = "mysql"))]
use std::future::Future;
use std::time::{Duration, Instant};

use sqlx::{Pool, Transaction};

use super::{Claimed, Storage};
use crate::backoff::Backoff;
use crate::error::Error;
use crate::record::{NewRecord, Record};

/// How many rounds a claim gets even when its wait has run out: enough to settle a race it
/// lost without an answer.
const MIN_ROUNDS: u32 = 3;

/// The shortest wait a later round's claim is given, so a round begun at the end of the bound
/// still gets the key when it is free or about to be.
const MIN_LOCK_WAIT: Duration = Duration::from_millis(1);

/// The pause before another round: jittered, so duplicates that start over together part, and
/// short, since each has already waited for the key.
const ROUND_BACKOFF: Backoff =
    Backoff::exponential(Duration::from_millis(2), Duration::from_millis(100));

/// The claim of a database that sends it with the statement that begins its transaction:
/// `fused` is that exchange (`Some` holding the key, `None` when a live record holds it), and
/// a new key then costs no exchange beyond the transaction's own. Whatever it cannot settle
/// goes on in [`rounds`], as does a claim in a transaction already `begun`.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(super) async fn fused_then_rounds<DB: Storage>(
    pool: &Pool<DB>,
    record: &NewRecord<'_>,
    wait: Duration,
    begun: Option<Transaction<'static, DB>>,
    fused: impl Future<Output = Result<Option<Transaction<'static, DB>>, Error>>,
) -> Result<Claimed<DB>, Error> {
    if begun.is_none() {
        match fused.await {
            Ok(Some(tx)) => return Ok(Claimed::Ours(tx)),
            Ok(None) => {
                let mut conn = pool.acquire().await?;
                // Purged as it expired since: claim again, the usual way.
                if let Some(existing) = DB::find(&mut conn, &record.key).await? {
                    return Ok(Claimed::Theirs(existing));
                }
            }
            Err(Error::Conflict) => {
                if let Some(existing) = committed_meanwhile(pool, record).await? {
                    return Ok(Claimed::Theirs(existing));
                }
            }
            Err(error) => return Err(error),
        }
    }
    rounds(pool, record, wait, begun).await
}

/// Claims in rounds of begin (unless `begun`), claim and read, within `wait` in all.
///
/// Another round settles the races a claim can lose without an answer: the record vanished
/// between the failed claim and the read (purged as it expired), the database picked this
/// transaction as a deadlock victim (InnoDB does when an original rolls back under waiting
/// duplicates), or, at REPEATABLE READ or SERIALIZABLE, the claim waited for the key's original
/// and its snapshot, older than the original's commit, cannot tell what the original left. The
/// transaction is gone in each case; the outcome the claim waited for is read afresh, and
/// failing that, claiming again queues it behind whoever holds the key now, like any
/// duplicate. Rounds go on while the wait lasts, so duplicates that queued on one key and come
/// back together do not use up a fixed count among themselves, each meeting the others' brief
/// holds of the key. [`Error::Busy`] once the wait and the rounds have run out.
pub(super) async fn rounds<DB: Storage>(
    pool: &Pool<DB>,
    record: &NewRecord<'_>,
    wait: Duration,
    mut begun: Option<Transaction<'static, DB>>,
) -> Result<Claimed<DB>, Error> {
    // None: a wait too long to count to, which never runs out.
    let deadline = Instant::now().checked_add(wait);
    let mut round: u32 = 0;
    loop {
        round = round.saturating_add(1);
        if round > 1 {
            let waited_out = deadline.is_some_and(|deadline| Instant::now() >= deadline);
            if round > MIN_ROUNDS && waited_out {
                return Err(Error::Busy);
            }
            tokio::time::sleep(ROUND_BACKOFF.delay(round - 1)).await;
        }
        // Later rounds wait only for what is left of the bound, so a duplicate's claim never
        // waits much past it in all.
        let lock_wait = deadline
            .map_or(wait, |deadline| {
                deadline.saturating_duration_since(Instant::now())
            })
            .max(MIN_LOCK_WAIT);
        let tx = match begun.take() {
            Some(tx) => tx,
            None => match DB::begin(pool, lock_wait).await {
                Ok(tx) => tx,
                Err(Error::Conflict) => continue,
                Err(error) => return Err(error),
            },
        };
        if let Some(claimed) = round_in(pool, record, tx, lock_wait).await? {
            return Ok(claimed);
        }
    }
}

/// One round's claim and read in `tx`; `None` when another round must settle it.
async fn round_in<DB: Storage>(
    pool: &Pool<DB>,
    record: &NewRecord<'_>,
    mut tx: Transaction<'static, DB>,
    lock_wait: Duration,
) -> Result<Option<Claimed<DB>>, Error> {
    match DB::claim_in(&mut tx, record, lock_wait).await {
        Ok(true) => return Ok(Some(Claimed::Ours(tx))),
        Ok(false) => {}
        Err(Error::Conflict) => {
            // Ended now, so the key's lock this transaction may hold is let go before the read
            // rather than when the connection is next used.
            let _ = tx.rollback().await;
            return Ok(committed_meanwhile(pool, record)
                .await?
                .map(Claimed::Theirs));
        }
        Err(error) => return Err(error),
    }
    match DB::find(&mut tx, &record.key).await {
        Ok(Some(existing)) => Ok(Some(Claimed::Theirs(existing))),
        Ok(None) | Err(Error::Conflict) => Ok(None),
        Err(error) => Err(error),
    }
}

/// The live record under the key, read outside any transaction after a claim had to start
/// over: a fresh read sees what the original the claim waited for committed.
async fn committed_meanwhile<DB: Storage>(
    pool: &Pool<DB>,
    record: &NewRecord<'_>,
) -> Result<Option<Record>, Error> {
    let mut conn = pool.acquire().await?;
    let found = DB::find(&mut conn, &record.key).await?;
    Ok(found.filter(|found| !found.is_expired(record.created_at)))
}
