//! The SQL every backend runs, written once and generic over the backend's [`Dialect`].

// Reachable only through the sealed `Backend`, so `pub` here names nothing a user can reach.
#![allow(unreachable_pub)]

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use sqlx::error::DatabaseError;
use sqlx::{
    ColumnIndex, Database, Decode, Encode, Executor, IntoArguments, Pool, Row, Transaction, Type,
};
use tokio::sync::OnceCell;

#[cfg(any(feature = "postgres", feature = "mysql"))]
use super::literal::{Literals, Syntax};
use super::protocol::{BeganClaim, LeaseClaim, NewRecord, Opened, Protocol, PurgePace};
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

/// The table `migrate` records applied versions in.
const VERSIONS: &str = "SELECT MAX(version) FROM idempotency_schema_versions";

/// One backend's SQL and error vocabulary.
pub trait Dialect: Database {
    /// Ordered schema migrations: (version, SQL script).
    const MIGRATIONS: &'static [(i64, &'static str)];
    /// Begins the migration transaction, serialised against other instances migrating at once.
    const MIGRATION_BEGIN: &'static str;
    /// Run first in the migration transaction to serialise concurrent migrators, if the begin
    /// statement does not already.
    const MIGRATION_LOCK: Option<&'static str>;
    /// Releases the lock [`MIGRATION_LOCK`](Dialect::MIGRATION_LOCK) took, when that lock belongs
    /// to the session rather than the transaction (where DDL commits implicitly, a transaction
    /// cannot hold it). Run after the migration, whatever its outcome.
    const MIGRATION_UNLOCK: Option<&'static str> = None;
    /// Records an applied migration. Parameters: version, applied_at.
    const MIGRATION_RECORD: &'static str;
    /// Whether `idempotency_schema_versions` exists, as a count (0 or 1): an unmigrated
    /// database has nothing to read a version from.
    const VERSIONS_TABLE_EXISTS: &'static str;
    /// Parameters: key_digest, principal, method, route, fingerprint, state, status, headers,
    /// body, created_at, expires_at, lease_owner, lease_expires_at, and then
    /// [`claim_lock_wait`](Dialect::claim_lock_wait) and [`key_lock`](Dialect::key_lock) where
    /// the dialect gives them.
    const CLAIM: &'static str;
    /// A claim tried first, which never waits: it takes the [`key_lock`](Dialect::key_lock)
    /// without waiting and claims only under it. Every claim holds that lock until its
    /// transaction ends, so while it is free no uncommitted claim of the key exists to wait
    /// for, and the statement needs no lock-wait bound; while it is held, [`CLAIM`](Dialect::CLAIM)
    /// waits for it, bounded. The unique key still decides who owns the key: the lock only
    /// keeps the uncontended claim from paying for the bound. Parameters as for `CLAIM`, without
    /// the lock-wait bound; the row it returns is read by [`try_claimed`](Dialect::try_claimed).
    const TRY_CLAIM: Option<&'static str> = None;
    /// Parameter: key_digest. Columns: state, fingerprint, status, headers, body, created_at,
    /// expires_at, lease_expires_at.
    const FIND: &'static str;
    /// Run right after [`CLAIM`](Dialect::CLAIM), whatever its outcome, where the lock-wait bound
    /// set by [`begin_statement`](Dialect::begin_statement) would outlive the claim: it gives the
    /// handler's own statements, and the pooled connection's next user, their usual bound back.
    const LIFT_LOCK_WAIT: Option<&'static str> = None;
    /// Parameters: state, status, headers, body, key_digest.
    const FINISH: &'static str;
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

    /// Whether the row [`MIGRATION_LOCK`](Dialect::MIGRATION_LOCK) returned says the lock was
    /// granted: a lock with a timeout reports the timeout there, not as an error.
    fn migration_locked(_row: &Self::Row) -> bool {
        true
    }

    /// The statement that begins a claim transaction with its lock wait bounded; `None` for a
    /// plain `BEGIN`, where [`CLAIM`](Dialect::CLAIM) bounds its own wait.
    fn begin_statement(lock_wait: Duration) -> Option<String>;

    /// The lock-wait bound passed to [`CLAIM`](Dialect::CLAIM) as its last parameter, for a
    /// dialect whose claim statement bounds its own wait.
    fn claim_lock_wait(_lock_wait: Duration) -> Option<String> {
        None
    }

    /// The number of the transaction-scoped lock [`TRY_CLAIM`](Dialect::TRY_CLAIM) and
    /// [`CLAIM`](Dialect::CLAIM) take for `key`, for a dialect that has `TRY_CLAIM`.
    fn key_lock(_key: &ScopedKey) -> Option<i64> {
        None
    }

    /// What the row [`TRY_CLAIM`](Dialect::TRY_CLAIM) returned says: whether it took the key,
    /// or `None` when another transaction holds the key's lock.
    fn try_claimed(_row: &Self::Row) -> Result<Option<bool>, sqlx::Error> {
        Ok(None)
    }

    /// The statements that claim `record` and begin its transaction in one exchange (see
    /// [`Protocol::begin_claimed`]), with the record's values as [`Literals`]; `None` where
    /// the backend cannot. They must leave no transaction open when the key is not theirs,
    /// and fail with an error [`fused_taken`](Dialect::fused_taken) recognises when a live
    /// record holds it.
    fn fused_claim(_record: &NewRecord<'_>, _lock_wait: Duration) -> Option<String> {
        None
    }

    /// Whether the error a [`fused_claim`](Dialect::fused_claim) failed with means a live record
    /// holds the key.
    fn fused_taken(_error: &dyn DatabaseError) -> bool {
        false
    }

    /// The statements that write the outcome into the claimed record and commit, in one
    /// exchange, written as [`Literals`] like [`FINISH`](Dialect::FINISH)'s parameters; `None`
    /// where the backend cannot. They may leave an empty transaction begun, for the rollback
    /// the dropped `Transaction` then sends with the pool's next statement.
    fn fused_finish(
        _key: &ScopedKey,
        _state: RecordState,
        _response: &StoredResponse,
    ) -> Option<String> {
        None
    }

    /// Whether the error means "a lock wait ran out".
    fn is_busy(error: &dyn DatabaseError) -> bool;

    /// Whether the error means the database rolled the transaction back to resolve a deadlock
    /// or a serialization conflict.
    fn is_conflict(_error: &dyn DatabaseError) -> bool {
        false
    }

    /// How many rows a statement affected.
    fn rows_affected(result: &Self::QueryResult) -> u64;

    /// Whether the claim statement took the key.
    fn claimed(result: &Self::QueryResult) -> bool {
        Self::rows_affected(result) == 1
    }
}

/// The largest response a claim or a finish writes into its statement's text: past it, the
/// text (twice the bytes, in hexadecimal) costs the database more parsing than the exchange
/// it saves.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(super) const FUSED_RESPONSE_LIMIT: usize = 64 * 1024;

/// The record's columns, in the order of [`Dialect::CLAIM`]'s parameters, as literals; `None`
/// when its response is too large to write into a statement.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(super) fn record_literals(record: &NewRecord<'_>, syntax: Syntax) -> Option<Literals> {
    let mut values = Literals::new(syntax);
    values
        .bytes(record.key.digest())
        .opt_text(record.scope.principal().map(readable).as_deref())
        .text(&readable(record.scope.method()))
        .text(&readable(record.scope.route()))
        .bytes(record.fingerprint.as_bytes())
        .text(record.state.as_str());
    match record.response {
        Some(response) => {
            let headers = response.encode_headers();
            if headers.len() + response.body.len() > FUSED_RESPONSE_LIMIT {
                return None;
            }
            values
                .int(i64::from(response.status.as_u16()))
                .bytes(&headers)
                .bytes(&response.body);
        }
        None => {
            values.null().null().null();
        }
    }
    values
        .int(record.created_at.column())
        .int(record.expires_at.column())
        .opt_bytes(record.lease.as_ref().map(|lease| &lease.owner[..]))
        .opt_int(record.lease.map(|lease| lease.until.column()));
    Some(values)
}

/// How a finish sent with `COMMIT` writes the outcome into the record.
#[cfg(any(feature = "postgres", feature = "mysql"))]
#[derive(Debug, Clone, Copy)]
pub(super) enum FinishForm {
    /// [`Dialect::FINISH`] with its values written in.
    #[cfg(feature = "mysql")]
    Update,
    /// A call of the schema's finish function, named here, with the key's digest, the state,
    /// the status, the headers and the body as arguments.
    #[cfg(feature = "postgres")]
    Call(&'static str),
}

/// The statement that writes the outcome, in `form`, followed by `tail` (the statements that
/// commit); `None` when the response is too large to write into a statement.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(super) fn finish_text(
    key: &ScopedKey,
    state: RecordState,
    response: &StoredResponse,
    syntax: Syntax,
    form: FinishForm,
    tail: &'static str,
) -> Option<String> {
    let headers = response.encode_headers();
    if headers.len() + response.body.len() > FUSED_RESPONSE_LIMIT {
        return None;
    }
    let status = i64::from(response.status.as_u16());
    let mut sql = Literals::new(syntax);
    match form {
        #[cfg(feature = "mysql")]
        FinishForm::Update => sql
            .sql("UPDATE idempotency_records SET state = ")
            .text(state.as_str())
            .sql(", status = ")
            .int(status)
            .sql(", headers = ")
            .bytes(&headers)
            .sql(", body = ")
            .bytes(&response.body)
            .sql(" WHERE key_digest = ")
            .bytes(key.digest()),
        #[cfg(feature = "postgres")]
        FinishForm::Call(function) => sql
            .sql(function)
            .sql("(")
            .bytes(key.digest())
            .text(state.as_str())
            .int(status)
            .bytes(&headers)
            .bytes(&response.body)
            .sql(")"),
    };
    sql.sql(tail);
    Some(sql.into_string())
}

/// A scope's text as the records table shows it to people: NUL, which PostgreSQL's `text`
/// cannot hold, becomes U+FFFD on every backend alike. The key's digest covers the exact text,
/// so two scopes that differ only there still never share a record.
fn readable(text: &str) -> Cow<'_, str> {
    if text.contains('\0') {
        Cow::Owned(text.replace('\0', "\u{fffd}"))
    } else {
        Cow::Borrowed(text)
    }
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

fn classify<DB: Dialect>(error: sqlx::Error) -> Error {
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
        let expected = DB::MIGRATIONS.last().map_or(0, |&(version, _)| version);
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
    DB: Dialect,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    usize: ColumnIndex<DB::Row>,
    Vec<u8>: for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB> + Type<DB>,
    String: for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB> + Type<DB>,
    i64: for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB> + Type<DB>,
    i32: for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB> + Type<DB>,
    Option<Vec<u8>>: for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB> + Type<DB>,
    Option<String>: for<'q> Encode<'q, DB> + Type<DB>,
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
        let schema = migrate::Schema {
            versions_table: "idempotency_schema_versions",
            scripts: DB::MIGRATIONS,
            begin: DB::MIGRATION_BEGIN,
            lock: DB::MIGRATION_LOCK,
            unlock: DB::MIGRATION_UNLOCK,
            lock_granted: DB::migration_locked,
            record: DB::MIGRATION_RECORD,
        };
        migrate::apply(&self.pool, &schema)
            .await
            .map_err(|failure| match failure {
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
        let begun = match DB::begin_statement(lock_wait) {
            Some(statement) => self.pool.begin_with(sqlx::AssertSqlSafe(statement)).await,
            None => self.pool.begin().await,
        };
        begun.map_err(classify::<DB>)
    }

    async fn begin_claimed<'a>(
        &'a self,
        record: &'a NewRecord<'a>,
        lock_wait: Duration,
    ) -> Result<BeganClaim<DB>, Error> {
        self.schema_current().await?;
        let Some(statement) = DB::fused_claim(record, lock_wait) else {
            return Ok(BeganClaim::Unfused);
        };
        match self.pool.begin_with(sqlx::AssertSqlSafe(statement)).await {
            Ok(tx) => Ok(BeganClaim::Ours(tx)),
            Err(sqlx::Error::Database(error)) if DB::fused_taken(error.as_ref()) => {
                Ok(BeganClaim::Taken)
            }
            Err(error) => Err(classify::<DB>(error)),
        }
    }

    async fn commit_finished<'a>(
        &'a self,
        mut tx: Transaction<'static, DB>,
        key: &'a ScopedKey,
        state: RecordState,
        response: &'a StoredResponse,
    ) -> Result<(), Error> {
        match DB::fused_finish(key, state, response) {
            Some(statement) => {
                sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
                    .execute(&mut *tx)
                    .await
                    .map_err(classify::<DB>)?;
                // The statements committed; dropping the `Transaction` that still counts itself
                // open queues its rollback of the empty transaction they left, sent together
                // with the ping the pool tests a returned connection with.
                drop(tx);
                Ok(())
            }
            None => {
                self.finish(&mut tx, key, state, response).await?;
                tx.commit().await.map_err(Error::from)
            }
        }
    }

    async fn claim<'a>(
        &'a self,
        conn: &'a mut DB::Connection,
        record: &'a NewRecord<'a>,
        lock_wait: Duration,
    ) -> Result<bool, Error> {
        let (status, headers, body) = match record.response {
            Some(response) => (
                Some(i32::from(response.status.as_u16())),
                Some(response.encode_headers()),
                Some(response.body.to_vec()),
            ),
            None => (None, None, None),
        };
        let key_lock = DB::key_lock(&record.key);
        let bind_record = |sql| {
            sqlx::query(sql)
                .bind(record.key.digest().to_vec())
                .bind(record.scope.principal().map(|p| readable(p).into_owned()))
                .bind(readable(record.scope.method()).into_owned())
                .bind(readable(record.scope.route()).into_owned())
                .bind(record.fingerprint.as_bytes().to_vec())
                .bind(record.state.as_str().to_owned())
                .bind(status)
                .bind(headers.clone())
                .bind(body.clone())
                .bind(record.created_at.column())
                .bind(record.expires_at.column())
                .bind(record.lease.map(|lease| lease.owner.to_vec()))
                .bind(record.lease.map(|lease| lease.until.column()))
        };
        if let (Some(try_claim), Some(lock)) = (DB::TRY_CLAIM, key_lock) {
            let row = bind_record(try_claim)
                .bind(lock)
                .fetch_one(&mut *conn)
                .await
                .map_err(classify::<DB>)?;
            if let Some(claimed) = DB::try_claimed(&row)? {
                return Ok(claimed);
            }
        }
        let mut query = bind_record(DB::CLAIM);
        if let Some(bound) = DB::claim_lock_wait(lock_wait) {
            query = query.bind(bound);
        }
        if let Some(lock) = key_lock {
            query = query.bind(lock);
        }
        let claimed = query.execute(&mut *conn).await;
        let lifted = match DB::LIFT_LOCK_WAIT {
            Some(lift) => sqlx::raw_sql(lift).execute(&mut *conn).await.map(drop),
            None => Ok(()),
        };
        let claimed = DB::claimed(&claimed.map_err(classify::<DB>)?);
        lifted.map_err(classify::<DB>)?;
        Ok(claimed)
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

    async fn finish<'a>(
        &'a self,
        conn: &'a mut DB::Connection,
        key: &'a ScopedKey,
        state: RecordState,
        response: &'a StoredResponse,
    ) -> Result<(), Error> {
        sqlx::query(DB::FINISH)
            .bind(state.as_str().to_owned())
            .bind(i32::from(response.status.as_u16()))
            .bind(response.encode_headers())
            .bind(response.body.to_vec())
            .bind(key.digest().to_vec())
            .execute(conn)
            .await
            .map_err(classify::<DB>)?;
        Ok(())
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
        on_pool(&self.pool, query).await
    }
}
