//! The outbox's queries, run once for every backend: the binds, the execution and the row
//! decoding, with only the SQL text and the claim and id strategies taken from the dialect.

use sqlx::{ColumnIndex, Decode, Encode, Executor, IntoArguments, Pool, Row, Type};

use serde::Serialize;

use super::private::{BatchSql, Claim, ClaimSql, Claimed, Dialect, Lease, NewId, Ops, Settlement};
use crate::migrate;
use crate::outbox::status::{from_millis, now_millis};
use crate::outbox::{DownstreamKey, Error, Message, MessageId, OutboxRecord, Status};

impl<DB> Ops for DB
where
    DB: Dialect,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    usize: ColumnIndex<DB::Row>,
    &'static str: ColumnIndex<DB::Row>,
    i64: for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB> + Type<DB>,
    bool: for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB> + Type<DB>,
    String: for<'r> Decode<'r, DB> + Type<DB>,
    Vec<u8>: for<'r> Decode<'r, DB> + Type<DB>,
    Option<i64>: for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB> + Type<DB>,
    for<'a> &'a str: Encode<'a, DB> + Type<DB>,
    for<'a> &'a [u8]: Encode<'a, DB> + Type<DB>,
    for<'a> Option<&'a str>: Encode<'a, DB> + Type<DB>,
{
    async fn migrate(pool: &Pool<Self>) -> Result<(), Error> {
        let schema = migrate::Schema {
            // Apart from the records' versions, so the two schemas evolve independently.
            versions_table: "idempotency_outbox_schema_versions",
            scripts: DB::MIGRATIONS,
            begin: DB::MIGRATION_BEGIN,
            lock: DB::MIGRATION_LOCK,
            unlock: DB::MIGRATION_UNLOCK,
            lock_granted: DB::migration_locked,
            record: DB::MIGRATION_RECORD,
        };
        // The same errors as the store's `migrate`.
        migrate::apply(pool, &schema)
            .await
            .map_err(|failure| match failure {
                migrate::Failure::Sql(error) => Error::Database(error),
                migrate::Failure::Script { version, source } => {
                    Error::Migration(format!("version {version}: {source}"))
                }
                migrate::Failure::LockRefused => Error::Migration(
                    "the lock that serialises outbox migrations was not granted".into(),
                ),
            })
    }

    async fn insert(
        conn: &mut DB::Connection,
        message: &Message,
        now: i64,
    ) -> Result<Option<MessageId>, sqlx::Error> {
        if let (Some(lock), Some(key)) = (DB::ORDER_LOCK, message.ordering()) {
            sqlx::query(lock).bind(key).execute(&mut *conn).await?;
        }
        let query = sqlx::query(DB::INSERT)
            .bind(message.topic())
            .bind(message.key().as_str())
            .bind(message.payload())
            .bind(now)
            .bind(now)
            .bind(message.ordering());
        let id = match DB::NEW_ID {
            NewId::Returning => match query.fetch_optional(conn).await? {
                Some(row) => Some(row.try_get::<i64, _>(0)?),
                None => None,
            },
            NewId::LastInsertId(last_insert_id) => match query.execute(conn).await {
                Ok(done) => Some(i64::try_from(last_insert_id(&done)).map_err(|e| {
                    sqlx::Error::Decode(format!("outbox id out of range: {e}").into())
                })?),
                Err(sqlx::Error::Database(e)) if e.is_unique_violation() => None,
                Err(e) => return Err(e),
            },
        };
        Ok(id.map(MessageId::from))
    }

    async fn fetch_by_id(
        conn: &mut DB::Connection,
        id: MessageId,
    ) -> Result<Option<OutboxRecord>, sqlx::Error> {
        let row = sqlx::query(DB::FETCH_BY_ID)
            .bind(id.get())
            .fetch_optional(conn)
            .await?;
        row.as_ref().map(record_from_row).transpose()
    }

    async fn fetch_by_key(
        conn: &mut DB::Connection,
        key: &DownstreamKey,
    ) -> Result<Option<OutboxRecord>, sqlx::Error> {
        let row = sqlx::query(DB::FETCH_BY_KEY)
            .bind(key.as_str())
            .fetch_optional(conn)
            .await?;
        row.as_ref().map(record_from_row).transpose()
    }

    const ONE_WRITER: bool = DB::ONE_WRITER;

    async fn claim(pool: &Pool<Self>, claim: Claim) -> (Claim, Result<Vec<Claimed>, sqlx::Error>) {
        // One connection for the probe and the statements after it: each acquire from the pool
        // costs a round trip of its own (the pool pings the connection it hands out).
        let mut conn = match pool.acquire().await {
            Ok(conn) => conn,
            Err(error) => return (claim, Err(error)),
        };
        let claim = claim.at(now_millis());
        let claimed = async {
            if let Some(probe) = DB::CLAIM_PROBE.filter(|_| claim.probe) {
                let due: bool = sqlx::query_scalar(probe)
                    .bind(claim.now)
                    .fetch_one(&mut *conn)
                    .await?;
                if !due {
                    return Ok(Vec::new());
                }
            }
            let update = |sql, limit: i64| {
                sqlx::query(sql)
                    .bind(claim.lease_until)
                    .bind(claim.token)
                    .bind(claim.now)
                    .bind(limit)
                    .bind(claim.max_attempts)
            };
            match DB::CLAIM {
                ClaimSql::OneStatement(sql) => {
                    let rows = update(sql, claim.limit).fetch_all(&mut *conn).await?;
                    rows.iter()
                        .map(|row| {
                            Ok(Claimed {
                                record: record_from_row(row)?,
                                attempt_begun: row.try_get("attempt_begun")?,
                            })
                        })
                        .collect()
                }
                ClaimSql::TwoStatements { hold, begin } => {
                    let mut claimed = Vec::new();
                    for row in update(hold, claim.limit).fetch_all(&mut *conn).await? {
                        claimed.push(Claimed {
                            record: record_from_row(&row)?,
                            attempt_begun: false,
                        });
                    }
                    let left = claim.limit.saturating_sub(claimed.len() as i64);
                    if left > 0 {
                        for row in update(begin, left).fetch_all(&mut *conn).await? {
                            claimed.push(Claimed {
                                record: record_from_row(&row)?,
                                attempt_begun: true,
                            });
                        }
                    }
                    Ok(claimed)
                }
                ClaimSql::LockThenLease {
                    select,
                    hold,
                    begin,
                } => {
                    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
                    let rows = sqlx::query(select)
                        .bind(claim.now)
                        .bind(claim.now)
                        .bind(claim.limit)
                        .fetch_all(&mut *tx)
                        .await?;
                    let mut claimed = Vec::with_capacity(rows.len());
                    for row in &rows {
                        let mut record = record_from_row(row)?;
                        let attempt_begun = !record.outcome_unknown
                            && i64::from(record.attempts) < claim.max_attempts;
                        let lease = if attempt_begun {
                            sqlx::query(begin)
                                .bind(claim.lease_until)
                                .bind(claim.token)
                                .bind(claim.now)
                        } else {
                            sqlx::query(hold).bind(claim.lease_until).bind(claim.token)
                        };
                        lease.bind(record.id.get()).execute(&mut *tx).await?;
                        if attempt_begun {
                            // What `begin` wrote, so the record matches the row.
                            record.attempts += 1;
                            record.outcome_unknown = true;
                            record.last_attempt_at = Some(from_millis(claim.now));
                        }
                        claimed.push(Claimed {
                            record,
                            attempt_begun,
                        });
                    }
                    tx.commit().await?;
                    Ok(claimed)
                }
            }
        }
        .await;
        (claim, claimed)
    }

    async fn begin_attempt(
        pool: &Pool<Self>,
        id: MessageId,
        token: i64,
        now: i64,
    ) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(DB::BEGIN_ATTEMPT)
            .bind(now)
            .bind(id.get())
            .bind(token)
            .execute(pool)
            .await?;
        Ok(DB::rows_affected(&done) == 1)
    }

    async fn renew_leases(
        pool: &Pool<Self>,
        leases: &[Lease],
        until: i64,
    ) -> Result<Vec<MessageId>, sqlx::Error> {
        still_held(pool, DB::RENEW_LEASES, leases, Some(until)).await
    }

    async fn release_unsent(
        pool: &Pool<Self>,
        leases: &[Lease],
    ) -> Result<Vec<MessageId>, sqlx::Error> {
        still_held(pool, DB::RELEASE_UNSENT, leases, None).await
    }

    async fn purge_finished(
        pool: &Pool<Self>,
        before: i64,
        limit: i64,
    ) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(DB::PURGE_FINISHED)
            .bind(before)
            .bind(limit)
            .execute(pool)
            .await?;
        Ok(DB::rows_affected(&done))
    }

    async fn advance(
        pool: &Pool<Self>,
        topic: &str,
        from: i64,
        to: i64,
    ) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(DB::ADVANCE)
            .bind(to)
            .bind(from)
            .bind(topic)
            .execute(pool)
            .await?;
        Ok(DB::rows_affected(&done))
    }

    async fn requeue(pool: &Pool<Self>, id: MessageId, now: i64) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(DB::REQUEUE)
            .bind(now)
            .bind(id.get())
            .execute(pool)
            .await?;
        Ok(DB::rows_affected(&done) == 1)
    }

    async fn skip(pool: &Pool<Self>, id: MessageId, now: i64) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(DB::SKIP)
            .bind(now)
            .bind(id.get())
            .execute(pool)
            .await?;
        Ok(DB::rows_affected(&done) == 1)
    }

    async fn fetch_blocker(
        conn: &mut DB::Connection,
        id: MessageId,
    ) -> Result<Option<OutboxRecord>, sqlx::Error> {
        let row = sqlx::query(DB::FETCH_BLOCKER)
            .bind(id.get())
            .bind(id.get())
            .fetch_optional(conn)
            .await?;
        row.as_ref().map(record_from_row).transpose()
    }

    async fn settle(
        pool: &Pool<Self>,
        outcomes: &[(Lease, Settlement)],
    ) -> Result<Vec<MessageId>, sqlx::Error> {
        if outcomes.is_empty() {
            return Ok(Vec::new());
        }
        match DB::SETTLE {
            BatchSql::Json(sql) => {
                let rows: Vec<_> = outcomes
                    .iter()
                    .map(|(lease, settlement)| Outcome::new(*lease, settlement))
                    .collect();
                let ids = sqlx::query_scalar::<_, i64>(sql)
                    .bind(json(&rows)?.as_str())
                    .fetch_all(pool)
                    .await?;
                Ok(ids.into_iter().map(MessageId::from).collect())
            }
            BatchSql::PerRow(sql) => {
                let mut tx = pool.begin().await?;
                let mut settled = Vec::with_capacity(outcomes.len());
                for (lease, settlement) in outcomes {
                    let done = sqlx::query(sql)
                        .bind(settlement.status.as_str())
                        .bind(settlement.receipt.as_deref())
                        .bind(settlement.last_error.as_deref())
                        .bind(i64::from(settlement.attempts))
                        .bind(settlement.outcome_unknown)
                        .bind(settlement.next_attempt_at)
                        .bind(settlement.finished_at)
                        .bind(settlement.last_attempt_at)
                        .bind(lease.id.get())
                        .bind(lease.token)
                        .execute(&mut *tx)
                        .await?;
                    if DB::rows_affected(&done) == 1 {
                        settled.push(lease.id);
                    }
                }
                tx.commit().await?;
                Ok(settled)
            }
        }
    }
}

/// Runs a statement on each of `leases` (binding `until` first, when given, as a renewal
/// does) and answers the ids whose lease was still held, so the statement took effect.
async fn still_held<DB>(
    pool: &Pool<DB>,
    batch: BatchSql,
    leases: &[Lease],
    until: Option<i64>,
) -> Result<Vec<MessageId>, sqlx::Error>
where
    DB: Dialect,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    usize: ColumnIndex<DB::Row>,
    i64: for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB> + Type<DB>,
    for<'a> &'a str: Encode<'a, DB> + Type<DB>,
{
    if leases.is_empty() {
        return Ok(Vec::new());
    }
    match batch {
        BatchSql::Json(sql) => {
            let held: Vec<_> = leases.iter().map(|lease| Held::from(*lease)).collect();
            let mut query = sqlx::query_scalar::<_, i64>(sql);
            if let Some(until) = until {
                query = query.bind(until);
            }
            let ids = query.bind(json(&held)?.as_str()).fetch_all(pool).await?;
            Ok(ids.into_iter().map(MessageId::from).collect())
        }
        BatchSql::PerRow(sql) => {
            let mut tx = pool.begin().await?;
            let mut held = Vec::with_capacity(leases.len());
            for lease in leases {
                let mut query = sqlx::query(sql);
                if let Some(until) = until {
                    query = query.bind(until);
                }
                let done = query
                    .bind(lease.id.get())
                    .bind(lease.token)
                    .execute(&mut *tx)
                    .await?;
                if DB::rows_affected(&done) == 1 {
                    held.push(lease.id);
                }
            }
            tx.commit().await?;
            Ok(held)
        }
    }
}

/// A lease as a batched renewal or release passes it.
#[derive(Serialize)]
struct Held {
    id: i64,
    token: i64,
}

impl From<Lease> for Held {
    fn from(lease: Lease) -> Self {
        Self {
            id: lease.id.get(),
            token: lease.token,
        }
    }
}

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
            next_attempt_at: settlement.next_attempt_at,
            finished_at: settlement.finished_at,
            last_attempt_at: settlement.last_attempt_at,
        }
    }
}

fn json(value: &impl Serialize) -> Result<String, sqlx::Error> {
    serde_json::to_string(value).map_err(|error| sqlx::Error::Encode(error.into()))
}

/// Every backend selects the same columns under the same names, so one decoder serves them all.
fn record_from_row<'r, R>(row: &'r R) -> Result<OutboxRecord, sqlx::Error>
where
    R: Row,
    &'static str: ColumnIndex<R>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    bool: Decode<'r, R::Database> + Type<R::Database>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
{
    let status: String = row.try_get("status")?;
    let status = Status::parse(&status).ok_or_else(|| sqlx::Error::ColumnDecode {
        index: "status".into(),
        source: format!("unknown outbox status {status:?}").into(),
    })?;
    let attempts: i64 = row.try_get("attempts")?;
    Ok(OutboxRecord {
        id: MessageId::from(row.try_get::<i64, _>("id")?),
        topic: row.try_get("topic")?,
        downstream_key: DownstreamKey::from_stored(row.try_get("downstream_key")?),
        payload: row.try_get("payload")?,
        status,
        attempts: u32::try_from(attempts).unwrap_or(u32::MAX),
        outcome_unknown: row.try_get("outcome_unknown")?,
        receipt: row.try_get("receipt")?,
        last_error: row.try_get("last_error")?,
        created_at: from_millis(row.try_get("created_at")?),
        next_attempt_at: from_millis(row.try_get("next_attempt_at")?),
        last_attempt_at: row
            .try_get::<Option<i64>, _>("last_attempt_at")?
            .map(from_millis),
        finished_at: row
            .try_get::<Option<i64>, _>("finished_at")?
            .map(from_millis),
        requeued_at: row
            .try_get::<Option<i64>, _>("requeued_at")?
            .map(from_millis),
        ordering_key: row.try_get("ordering_key")?,
    })
}
