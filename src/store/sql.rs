//! What every backend runs alike, generic over its [`Dialect`]: reading a record, the leases,
//! forgetting, purging, migrating. How a backend claims a key, begins the claim's transaction
//! and writes the outcome is its own algorithm, its [`ClaimPath`], in its own file.

// Reachable only through the sealed `Backend`, so `pub` here names nothing a user can reach.
#![allow(unreachable_pub)]

#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
use std::borrow::Cow;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use sqlx::error::DatabaseError;
use sqlx::{
    ColumnIndex, Database, Decode, Encode, Executor, IntoArguments, Pool, Row, Transaction, Type,
};
use tokio::sync::OnceCell;

#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
use super::literal::{Statement, Value};
use super::protocol::{BeganClaim, LeaseClaim, NewRecord, Opened, Protocol, PurgePace};
use crate::backoff::Backoff;
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::migrate;
use crate::record::{Millis, Record, RecordState, StoredResponse};
use crate::scope::ScopedKey;

/// The records table of one database, driven through [`Protocol`].
#[derive(Debug)]
pub struct SqlStore<DB: Database> {
    pool: Pool<DB>,
    /// Set once the schema is known to be current, by a check or a migration, and shared by
    /// the store's clones: the check costs one look at the database per store, not per request.
    schema_current: Arc<OnceCell<()>>,
}

impl<DB: Database> Clone for SqlStore<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            schema_current: self.schema_current.clone(),
        }
    }
}

/// How many times `migrate` runs in all when concurrent migrators collide.
const MIGRATE_ATTEMPTS: u32 = 6;

/// The pause before migrating again after a collision, jittered so the migrators part.
const MIGRATE_BACKOFF: Backoff =
    Backoff::exponential(Duration::from_millis(50), Duration::from_secs(2));

/// Whether a migration failed because another migrator did the same work at the same time.
fn raced_migrator<DB: Dialect>(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db)
        if DB::is_conflict(db.as_ref())
            || db.is_unique_violation()
            || DB::is_created_meanwhile(db.as_ref()))
}

/// The table `migrate` records applied versions in.
const VERSIONS: &str = "SELECT MAX(version) FROM idempotency_schema_versions";

/// One backend's statements that every backend runs alike, and its error vocabulary.
pub trait Dialect: Database {
    /// How `migrate` creates and upgrades the records' schema on this backend.
    const SCHEMA: migrate::Schema<Self>;
    /// Whether `idempotency_schema_versions` exists, as a count (0 or 1): an unmigrated
    /// database has nothing to read a version from.
    const VERSIONS_TABLE_EXISTS: &'static str;
    /// Parameter: key_digest. Columns: state, fingerprint, status, headers, body, created_at,
    /// expires_at, lease_expires_at.
    const FIND: &'static str;
    /// Parameters: now, limit.
    const PURGE: &'static str;
    /// How [`PURGE`](Dialect::PURGE) is paced: its limit, and the rest after each statement.
    const PURGE_PACE: PurgePace = PurgePace::DEFAULT;
    /// Parameters: lease_expires_at, key_digest, lease_owner.
    const RENEW_LEASE: &'static str;
    /// Parameters: lease_owner, lease_expires_at, key_digest, now.
    const TAKE_OVER_LEASE: &'static str;
    /// Parameters: state, status, headers, body, key_digest, lease_owner.
    const FINISH_LEASED: &'static str;
    /// Parameters: key_digest, lease_owner.
    const RELEASE_LEASE: &'static str;
    /// Parameters: key_digest.
    const FORGET: &'static str;
    /// Deletes up to a limit of expired dedupe keys. Parameters: now, limit.
    const PURGE_KEYS: &'static str;
    /// A row when a live dedupe key is held. Parameters: key_digest, now.
    const KEY_HELD: &'static str;

    /// Whether the error means "a lock wait ran out".
    fn is_busy(error: &dyn DatabaseError) -> bool;

    /// Whether the error means the database rolled the transaction back to resolve a deadlock
    /// or a serialization conflict.
    fn is_conflict(error: &dyn DatabaseError) -> bool;

    /// Whether the error means a migration script's object was created by another migrator
    /// between the script's `DROP … IF EXISTS` and its `CREATE`.
    fn is_created_meanwhile(_error: &dyn DatabaseError) -> bool {
        false
    }

    /// How many rows a statement affected.
    fn rows_affected(result: &Self::QueryResult) -> u64;
}

/// How one backend claims a key, begins a claim's transaction and commits its record: the
/// steps of [`Protocol`] with the same names, each backend's own algorithm.
pub trait ClaimPath: Dialect {
    /// See [`Protocol::begin`].
    fn begin(
        pool: &Pool<Self>,
        lock_wait: Duration,
    ) -> impl Future<Output = Result<Transaction<'static, Self>, Error>> + Send;

    /// See [`Protocol::begin_claimed`].
    fn begin_claimed<'a>(
        pool: &'a Pool<Self>,
        record: &'a NewRecord<'a>,
        lock_wait: Duration,
    ) -> impl Future<Output = Result<BeganClaim<Self>, Error>> + Send + 'a;

    /// See [`Protocol::claim`].
    fn claim<'a>(
        conn: &'a mut Self::Connection,
        record: &'a NewRecord<'a>,
        lock_wait: Duration,
    ) -> impl Future<Output = Result<bool, Error>> + Send + 'a;

    /// See [`Protocol::commit_record`].
    fn commit_record<'a>(
        tx: Transaction<'static, Self>,
        record: &'a NewRecord<'a>,
    ) -> impl Future<Output = Result<(), Error>> + Send + 'a;

    /// See [`Protocol::claim_key`].
    fn claim_key<'a>(
        pool: &'a Pool<Self>,
        key: &'a ScopedKey,
        now: Millis,
        expires_at: Millis,
        lock_wait: Duration,
    ) -> impl Future<Output = Result<Option<Transaction<'static, Self>>, Error>> + Send + 'a;
}

/// The largest response (headers and body) a record's statement writes into its text: past it,
/// the text (twice the bytes, in hexadecimal) costs the database more parsing than the exchange
/// it saves, and the statement is sent with its values bound.
#[cfg(feature = "postgres")]
const INLINE_RESPONSE_LIMIT: usize = 64 * 1024;

/// Whether a statement carrying `response` is written with its values in its text.
#[cfg(feature = "postgres")]
pub(super) fn inline_fits(response: Option<&StoredResponse>) -> bool {
    response.is_none_or(|response| response.stored_len() <= INLINE_RESPONSE_LIMIT)
}

/// Writes the record's columns as consecutive values: key_digest, principal, method, route,
/// fingerprint, state, status, headers, body, created_at, expires_at, lease_owner,
/// lease_expires_at.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(super) fn record_values<'a>(statement: &mut Statement<'a>, record: &'a NewRecord<'a>) {
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
pub(super) fn identity_values<'s, 'a>(
    statement: &'s mut Statement<'a>,
    record: &'a NewRecord<'a>,
) -> &'s mut Statement<'a> {
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
pub(super) fn lifetime_values<'s, 'a>(
    statement: &'s mut Statement<'a>,
    record: &'a NewRecord<'a>,
) -> &'s mut Statement<'a> {
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
pub(super) fn readable(text: &str) -> Cow<'_, str> {
    if text.contains('\0') {
        Cow::Owned(text.replace('\0', "\u{fffd}"))
    } else {
        Cow::Borrowed(text)
    }
}

/// `statement` with its values bound, to run as a prepared statement.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub(super) fn bound<'q, DB>(statement: &Statement<'_>) -> sqlx::query::Query<'q, DB, DB::Arguments>
where
    DB: Database,
    DB::Arguments: IntoArguments<DB>,
    for<'v> Option<&'v [u8]>: Encode<'v, DB> + Type<DB>,
    for<'v> Option<&'v str>: Encode<'v, DB> + Type<DB>,
    Option<i32>: for<'e> Encode<'e, DB> + Type<DB>,
    Option<i64>: for<'e> Encode<'e, DB> + Type<DB>,
{
    let (sql, values) = statement.bound();
    // Room for every value up front: the arguments would otherwise grow a few times per record.
    let mut arguments = DB::Arguments::default();
    sqlx::Arguments::reserve(&mut arguments, values.len(), statement.weight());
    values.into_iter().fold(
        sqlx::query_with(sql, arguments),
        |query, value| match value {
            // Borrowed: each value is encoded as it is bound, and PostgreSQL's and MySQL's
            // encoders copy it straight into the message.
            Value::Bytes(bytes) => query.bind(bytes.as_deref()),
            Value::Text(text) => query.bind(text.as_deref()),
            Value::Int4(int) => query.bind(*int),
            Value::Int8(int) => query.bind(*int),
        },
    )
}

/// Runs an autocommit statement on the pool; returns how many rows it affected.
async fn on_pool<DB>(
    pool: &Pool<DB>,
    query: sqlx::query::Query<'_, DB, DB::Arguments>,
) -> Result<u64, Error>
where
    DB: Dialect,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
{
    let result = query.execute(pool).await.map_err(classify::<DB>)?;
    Ok(DB::rows_affected(&result))
}

/// The newest schema version `migrate` recorded in the database, 0 when it never ran.
async fn schema_version<DB>(pool: &Pool<DB>) -> Result<i64, Error>
where
    DB: Dialect,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    usize: ColumnIndex<DB::Row>,
    i64: for<'r> Decode<'r, DB> + Type<DB>,
    Option<i64>: for<'r> Decode<'r, DB> + Type<DB>,
{
    let mut conn = pool.acquire().await?;
    let exists: i64 = sqlx::query(DB::VERSIONS_TABLE_EXISTS)
        .fetch_one(&mut *conn)
        .await?
        .try_get(0)?;
    if exists == 0 {
        return Ok(0);
    }
    let version: Option<i64> = sqlx::query(VERSIONS)
        .fetch_one(&mut *conn)
        .await?
        .try_get(0)?;
    Ok(version.unwrap_or(0))
}

/// The crate's error for a database error: a lock wait that ran out is [`Error::Busy`], a
/// deadlock or serialization failure [`Error::Conflict`].
pub(super) fn classify<DB: Dialect>(error: sqlx::Error) -> Error {
    match &error {
        sqlx::Error::Database(db) if DB::is_conflict(db.as_ref()) => Error::Conflict,
        sqlx::Error::Database(db) if DB::is_busy(db.as_ref()) => Error::Busy,
        _ => Error::Database(error),
    }
}

impl<DB> SqlStore<DB>
where
    DB: Dialect,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    usize: ColumnIndex<DB::Row>,
    i64: for<'r> Decode<'r, DB> + Type<DB>,
    Option<i64>: for<'r> Decode<'r, DB> + Type<DB>,
{
    /// Fails with [`Error::SchemaOutdated`] while the schema is older than this code: every
    /// claim would fail on a missing table, column or function, and a client would retry in
    /// vain. Checked on the store's first use, and again on each use until it passes, so a
    /// migration run meanwhile by another instance is noticed without a restart.
    async fn schema_current(&self) -> Result<(), Error> {
        if self.schema_current.initialized() {
            return Ok(());
        }
        let expected = DB::SCHEMA.scripts.last().map_or(0, |&(version, _)| version);
        self.schema_current
            .get_or_try_init(|| async {
                let found = schema_version(&self.pool).await?;
                if found >= expected {
                    return Ok(());
                }
                tracing::error!(
                    found,
                    expected,
                    "the idempotency schema is outdated; call Store::migrate() at start-up"
                );
                Err(Error::SchemaOutdated { found, expected })
            })
            .await
            .copied()
    }
}

impl<DB> Protocol for SqlStore<DB>
where
    DB: ClaimPath,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    usize: ColumnIndex<DB::Row>,
    Vec<u8>: for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB> + Type<DB>,
    String: for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB> + Type<DB>,
    i64: for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB> + Type<DB>,
    i32: for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB> + Type<DB>,
    Option<Vec<u8>>: for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB> + Type<DB>,
    Option<i64>: for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB> + Type<DB>,
    Option<i32>: for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB> + Type<DB>,
{
    type Database = DB;

    fn on(pool: Pool<DB>) -> Self {
        Self {
            pool,
            schema_current: Arc::default(),
        }
    }

    fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    async fn migrate(&self) -> Result<(), Error> {
        // Where the migration lock is not shared by every server that takes writes (a Galera
        // cluster: `GET_LOCK` holds on one node only), instances migrating at once through
        // different nodes can race: one's version row or procedure collides with another's, as
        // a conflict abort, a duplicate key or an object created meanwhile. The scripts are
        // safe to run twice, so the loser runs the migration again and finds the versions the
        // winner recorded.
        let mut attempt = 1;
        let applied = loop {
            let applied = migrate::apply(&self.pool, &DB::SCHEMA).await;
            let raced = match &applied {
                Err(
                    migrate::Failure::Sql(error) | migrate::Failure::Script { source: error, .. },
                ) => raced_migrator::<DB>(error),
                _ => false,
            };
            if !raced || attempt == MIGRATE_ATTEMPTS {
                break applied;
            }
            tracing::debug!(
                attempt,
                "a concurrent migration won a race; migrating again"
            );
            tokio::time::sleep(MIGRATE_BACKOFF.delay(attempt)).await;
            attempt += 1;
        };
        applied.map_err(|failure| match failure {
            migrate::Failure::Sql(error) => Error::Database(error),
            migrate::Failure::Script { version, source } => {
                Error::Migration(format!("version {version}: {source}"))
            }
            migrate::Failure::LockRefused => {
                Error::Migration("the lock that serialises migrators was not granted".into())
            }
        })?;
        // Already set by a check that passed, or being set by one now: either way it is true.
        let _ = self.schema_current.set(());
        Ok(())
    }

    async fn lookup(&self, key: &ScopedKey) -> Result<Option<Record>, Error> {
        self.schema_current().await?;
        let mut conn = self.pool.acquire().await?;
        self.find(&mut conn, key).await
    }

    async fn open<'a>(
        &'a self,
        key: &'a ScopedKey,
        now: Millis,
        lock_wait: Duration,
    ) -> Result<Opened<DB>, Error> {
        match self.lookup(key).await? {
            Some(record) if !record.is_expired(now) => Ok(Opened::Live(record)),
            // The read's connection went back to the pool and the claim's transaction takes
            // one afresh, through sqlx's public API: beginning on the very connection needs a
            // call sqlx hides from its docs. The extra checkout is paid only here, for a key
            // this instance saw lately that holds no live record: a retry after a retryable
            // failure.
            found => Ok(Opened::Claimable {
                tx: self.begin(lock_wait).await?,
                expired: found.is_some(),
            }),
        }
    }

    async fn begin(&self, lock_wait: Duration) -> Result<Transaction<'static, DB>, Error> {
        self.schema_current().await?;
        DB::begin(&self.pool, lock_wait).await
    }

    async fn begin_claimed<'a>(
        &'a self,
        record: &'a NewRecord<'a>,
        lock_wait: Duration,
    ) -> Result<BeganClaim<DB>, Error> {
        self.schema_current().await?;
        DB::begin_claimed(&self.pool, record, lock_wait).await
    }

    async fn commit_record<'a>(
        &'a self,
        tx: Transaction<'static, DB>,
        record: &'a NewRecord<'a>,
    ) -> Result<(), Error> {
        DB::commit_record(tx, record).await
    }

    async fn claim<'a>(
        &'a self,
        conn: &'a mut DB::Connection,
        record: &'a NewRecord<'a>,
        lock_wait: Duration,
    ) -> Result<bool, Error> {
        DB::claim(conn, record, lock_wait).await
    }

    async fn claim_key<'a>(
        &'a self,
        key: &'a ScopedKey,
        now: Millis,
        expires_at: Millis,
        lock_wait: Duration,
    ) -> Result<Option<Transaction<'static, DB>>, Error> {
        self.schema_current().await?;
        DB::claim_key(&self.pool, key, now, expires_at, lock_wait).await
    }

    async fn key_held<'a>(&'a self, key: &'a ScopedKey, now: Millis) -> Result<bool, Error> {
        self.schema_current().await?;
        let row = sqlx::query(DB::KEY_HELD)
            .bind(key.digest().to_vec())
            .bind(now.column())
            .fetch_optional(&self.pool)
            .await
            .map_err(classify::<DB>)?;
        Ok(row.is_some())
    }

    async fn find<'a>(
        &'a self,
        conn: &'a mut DB::Connection,
        key: &'a ScopedKey,
    ) -> Result<Option<Record>, Error> {
        let row = sqlx::query(DB::FIND)
            .bind(key.digest().to_vec())
            .fetch_optional(conn)
            .await
            .map_err(classify::<DB>)?;
        let Some(row) = row else { return Ok(None) };
        let state = RecordState::parse(&row.try_get::<String, _>(0)?)?;
        let fingerprint = <[u8; 32]>::try_from(row.try_get::<Vec<u8>, _>(1)?.as_slice())
            .map(Fingerprint::from)
            .map_err(|_| Error::CorruptRecord("fingerprint length".into()))?;
        let status: Option<i32> = row.try_get(2)?;
        let headers: Option<Vec<u8>> = row.try_get(3)?;
        let body: Option<Vec<u8>> = row.try_get(4)?;
        let response = match (status, headers, body) {
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
        Ok(Some(Record {
            state,
            fingerprint,
            response,
            expires_at: Millis::from_column(row.try_get(6)?),
            lease_expires_at: row.try_get::<Option<i64>, _>(7)?.map(Millis::from_column),
        }))
    }

    async fn renew_lease<'a>(
        &'a self,
        key: &'a ScopedKey,
        lease: LeaseClaim,
    ) -> Result<bool, Error> {
        let query = sqlx::query(DB::RENEW_LEASE)
            .bind(lease.until.column())
            .bind(key.digest().to_vec())
            .bind(lease.owner.to_vec());
        Ok(on_pool(&self.pool, query).await? == 1)
    }

    async fn take_over_lease<'a>(
        &'a self,
        key: &'a ScopedKey,
        lease: LeaseClaim,
        now: Millis,
    ) -> Result<bool, Error> {
        let query = sqlx::query(DB::TAKE_OVER_LEASE)
            .bind(lease.owner.to_vec())
            .bind(lease.until.column())
            .bind(key.digest().to_vec())
            .bind(now.column());
        Ok(on_pool(&self.pool, query).await? == 1)
    }

    async fn finish_leased<'a>(
        &'a self,
        key: &'a ScopedKey,
        owner: [u8; 16],
        state: RecordState,
        response: &'a StoredResponse,
    ) -> Result<bool, Error> {
        let query = sqlx::query(DB::FINISH_LEASED)
            .bind(state.as_str().to_owned())
            .bind(i32::from(response.status.as_u16()))
            .bind(response.encode_headers())
            .bind(response.body.to_vec())
            .bind(key.digest().to_vec())
            .bind(owner.to_vec());
        Ok(on_pool(&self.pool, query).await? == 1)
    }

    async fn release_lease<'a>(
        &'a self,
        key: &'a ScopedKey,
        owner: [u8; 16],
    ) -> Result<bool, Error> {
        let query = sqlx::query(DB::RELEASE_LEASE)
            .bind(key.digest().to_vec())
            .bind(owner.to_vec());
        Ok(on_pool(&self.pool, query).await? == 1)
    }

    async fn forget<'a>(&'a self, key: &'a ScopedKey) -> Result<bool, Error> {
        self.schema_current().await?;
        let query = sqlx::query(DB::FORGET).bind(key.digest().to_vec());
        Ok(on_pool(&self.pool, query).await? == 1)
    }

    fn purge_pace(&self) -> PurgePace {
        DB::PURGE_PACE
    }

    async fn purge_expired_batch(&self, now: Millis, limit: u32) -> Result<u64, Error> {
        self.schema_current().await?;
        let query = sqlx::query(DB::PURGE)
            .bind(now.column())
            .bind(i64::from(limit));
        let records = on_pool(&self.pool, query).await?;
        // The batch's room left over goes to the inbox's keys: one batch still deletes at most
        // `limit` rows, and a short batch still means both tables are clear.
        let room = u64::from(limit).saturating_sub(records);
        if room == 0 {
            return Ok(records);
        }
        let query = sqlx::query(DB::PURGE_KEYS)
            .bind(now.column())
            .bind(i64::try_from(room).unwrap_or(i64::MAX));
        Ok(records + on_pool(&self.pool, query).await?)
    }
}
