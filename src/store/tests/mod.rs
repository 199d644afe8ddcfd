//! The store protocol against real databases: how a claim waits, replaces, purges and reports
//! a busy or deadlocked key, below the engine. These drive the store's steps and its backend's
//! directly, which are crate-private, so they live here rather than in `tests/`.
//!
//! Each test works in a schema (PostgreSQL), database (MariaDB/MySQL) or file (SQLite) of its
//! own, dropped at its end, so tests run in parallel. The servers are found at
//! `TEST_POSTGRES_URL` and `TEST_MYSQL_URL`.

#![cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]

use std::sync::atomic::{AtomicUsize, Ordering};

use std::time::Duration;

use sqlx::Transaction;

use crate::{
    Backend,
    backend::Claimed,
    clock::Millis,
    error::Error,
    fingerprint::Fingerprinter,
    key::IdempotencyKey,
    record::{NewRecord, Record, RecordState, StoredResponse},
    scope::{Scope, ScopedKey},
    store::{Keep, Opened, Store},
};

mod large;
mod lease;
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
mod schema;
#[cfg(feature = "sqlite")]
mod sqlite;

/// A name no other test (or earlier run) uses.
fn unique(prefix: &str) -> String {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    format!(
        "{prefix}_{}_{}_{}",
        std::process::id(),
        now_ms() % 1_000_000_000,
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// The steps of a public store and of its backend, as the engine and the backend's own claim
/// drive them.
fn protocol_of<DB: Backend>(store: &Store<DB>) -> Steps<DB> {
    Steps {
        store: store.clone(),
    }
}

/// A store's steps, and its backend's below it, under the names the tests use.
struct Steps<DB: Backend> {
    store: Store<DB>,
}

impl<DB: Backend> Clone for Steps<DB> {
    fn clone(&self) -> Self {
        protocol_of(&self.store)
    }
}

impl<DB: Backend> Steps<DB> {
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    fn pool(&self) -> &sqlx::Pool<DB> {
        self.store.pool()
    }

    #[cfg(feature = "mysql")]
    async fn migrate(&self) -> Result<(), Error> {
        self.store.migrate().await
    }

    async fn lookup(&self, key: &ScopedKey) -> Result<Option<Record>, Error> {
        self.store.lookup(key).await
    }

    async fn open(
        &self,
        key: &ScopedKey,
        now: Millis,
        wait: Duration,
    ) -> Result<Opened<DB>, Error> {
        self.store.open(key, now, wait).await
    }

    /// The store's claim of a record, as the engine makes it.
    async fn claimed(&self, record: &NewRecord<'_>, wait: Duration) -> Result<Claimed<DB>, Error> {
        self.store.claim(record, Keep::Record, wait, None).await
    }

    async fn begin(&self, wait: Duration) -> Result<Transaction<'static, DB>, Error> {
        DB::begin(self.store.pool(), wait).await
    }

    /// The backend's claim in a begun transaction.
    async fn claim(
        &self,
        conn: &mut DB::Connection,
        record: &NewRecord<'_>,
        wait: Duration,
    ) -> Result<bool, Error> {
        DB::claim_in(conn, record, wait).await
    }

    async fn find(
        &self,
        conn: &mut DB::Connection,
        key: &ScopedKey,
    ) -> Result<Option<Record>, Error> {
        DB::find(conn, key).await
    }

    async fn commit_record(
        &self,
        tx: Transaction<'static, DB>,
        record: &NewRecord<'_>,
    ) -> Result<(), Error> {
        self.store.commit_record(tx, record).await
    }

    #[cfg(feature = "mysql")]
    async fn purge_expired_batch(&self, now: Millis, limit: u32) -> Result<u64, Error> {
        DB::purge_batch(self.store.pool(), now, limit).await
    }

    #[cfg(feature = "mysql")]
    async fn purge_expired(&self) -> Result<u64, Error> {
        self.store.purge_expired().await
    }
}

/// What a claim sent with the statement that begins its transaction did.
#[cfg(any(feature = "postgres", feature = "mysql"))]
#[derive(Debug)]
enum BeganClaim<DB: sqlx::Database> {
    /// The transaction is begun and holds the claim.
    Ours(Transaction<'static, DB>),
    /// A live record holds the key. Nothing was left open.
    Taken,
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl<DB: sqlx::Database> BeganClaim<DB> {
    fn of(began: Option<Transaction<'static, DB>>) -> Self {
        began.map_or(Self::Taken, Self::Ours)
    }
}

#[cfg(feature = "postgres")]
impl Steps<sqlx::Postgres> {
    async fn begin_claimed(
        &self,
        record: &NewRecord<'_>,
        wait: Duration,
    ) -> Result<BeganClaim<sqlx::Postgres>, Error> {
        let began = crate::backend::postgres::begin_claimed(self.store.pool(), record, wait).await;
        began.map(BeganClaim::of)
    }
}

#[cfg(feature = "mysql")]
impl Steps<sqlx::MySql> {
    async fn begin_claimed(
        &self,
        record: &NewRecord<'_>,
        wait: Duration,
    ) -> Result<BeganClaim<sqlx::MySql>, Error> {
        let began = crate::backend::mysql::begin_claimed(self.store.pool(), record, wait).await;
        began.map(BeganClaim::of)
    }
}

/// Milliseconds since the epoch, as records keep time.
fn now_ms() -> i64 {
    Millis::now().column()
}

/// Alice's `POST /orders` under `key`.
fn scope(key: &str) -> Scope {
    Scope::new(
        "alice",
        "POST",
        "/orders",
        key.parse::<IdempotencyKey>().unwrap(),
    )
}

/// A record of `scope` whose fingerprint stands for `intent`, living `ttl_ms` from `created_at_ms`.
fn record<'a>(
    scope: &'a Scope,
    intent: &str,
    state: RecordState,
    response: Option<&'a StoredResponse>,
    created_at_ms: i64,
    ttl_ms: i64,
) -> NewRecord<'a> {
    NewRecord {
        key: scope.scoped_key(),
        scope,
        fingerprint: Fingerprinter::new().fingerprint_value("test", intent.as_bytes()),
        state,
        response,
        created_at: Millis::from_column(created_at_ms),
        expires_at: Millis::from_column(created_at_ms + ttl_ms),
        lease: None,
    }
}

/// `claim` completed with `response`, as the engine commits it.
fn finished<'a>(claim: &NewRecord<'a>, response: &'a StoredResponse) -> NewRecord<'a> {
    NewRecord {
        state: RecordState::Completed,
        response: Some(response),
        ..*claim
    }
}

/// A final response with `body`, as a handler's 201 is stored.
fn completed(body: &'static str) -> StoredResponse {
    StoredResponse {
        status: http::StatusCode::CREATED,
        headers: http::HeaderMap::new(),
        body: body.into(),
    }
}

/// A PostgreSQL schema of the test's own, reached through `search_path`.
#[cfg(feature = "postgres")]
struct PgSchema {
    name: String,
}

#[cfg(feature = "postgres")]
impl PgSchema {
    fn url() -> String {
        std::env::var("TEST_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
    }

    async fn create() -> Self {
        let name = unique("t");
        let admin = sqlx::PgPool::connect(&Self::url())
            .await
            .unwrap_or_else(|e| panic!("PostgreSQL at {} is unreachable: {e}", Self::url()));
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {name}")))
            .execute(&admin)
            .await
            .unwrap();
        admin.close().await;
        Self { name }
    }

    async fn pool(&self, max_connections: u32) -> sqlx::PgPool {
        let options = Self::url()
            .parse::<sqlx::postgres::PgConnectOptions>()
            .unwrap()
            .options([("search_path", self.name.as_str())])
            // So a test can find its own sessions in `pg_stat_activity`.
            .application_name(&self.name);
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(max_connections)
            .connect_with(options)
            .await
            .unwrap()
    }

    /// The name its sessions carry as `application_name`.
    fn name(&self) -> String {
        self.name.clone()
    }

    /// Closes `pool` (every transaction on it must be over) and drops the schema.
    async fn drop(self, pool: &sqlx::PgPool) {
        pool.close().await;
        let admin = sqlx::PgPool::connect(&Self::url()).await.unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA {} CASCADE",
            self.name
        )))
        .execute(&admin)
        .await
        .unwrap();
        admin.close().await;
    }
}

/// A MariaDB/MySQL database of the test's own.
#[cfg(feature = "mysql")]
struct MySqlDatabase {
    name: String,
}

#[cfg(feature = "mysql")]
impl MySqlDatabase {
    fn server() -> sqlx::mysql::MySqlConnectOptions {
        let url = std::env::var("TEST_MYSQL_URL")
            .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
        url.parse().unwrap()
    }

    async fn create() -> Self {
        use sqlx::Connection;
        let name = unique("idem");
        let mut admin = sqlx::MySqlConnection::connect_with(&Self::server())
            .await
            .expect("MariaDB must be reachable at TEST_MYSQL_URL");
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut admin)
            .await
            .unwrap();
        let _ = admin.close().await;
        Self { name }
    }

    fn options(&self) -> sqlx::mysql::MySqlConnectOptions {
        Self::server().database(&self.name)
    }

    /// A connection of its own, outside any pool.
    async fn connect(&self) -> sqlx::MySqlConnection {
        use sqlx::Connection;
        sqlx::MySqlConnection::connect_with(&self.options())
            .await
            .unwrap()
    }

    async fn pool(&self, max_connections: u32) -> sqlx::MySqlPool {
        sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(max_connections)
            .connect_with(self.options())
            .await
            .unwrap()
    }

    async fn drop(self) {
        use sqlx::Connection;
        let mut admin = sqlx::MySqlConnection::connect_with(&Self::server())
            .await
            .unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP DATABASE {}", self.name)))
            .execute(&mut admin)
            .await
            .unwrap();
        let _ = admin.close().await;
    }
}

/// Waits until one of the sessions named `application` (a [`PgSchema`]'s) waits for a lock
/// another session holds.
#[cfg(feature = "postgres")]
async fn until_a_session_waits_for_a_lock(application: &str) {
    until_sessions(
        application,
        "SELECT COUNT(*) > 0 FROM pg_stat_activity
         WHERE application_name = $1 AND wait_event_type = 'Lock'",
    )
    .await;
}

/// Waits until none of the sessions named `application` holds an advisory lock. The server
/// reports a failed statement before it rolls its transaction back, so a client can be told
/// of the failure while the transaction's locks are still held.
#[cfg(feature = "postgres")]
async fn until_no_session_holds_an_advisory_lock(application: &str) {
    until_sessions(
        application,
        "SELECT COUNT(*) = 0 FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
         WHERE a.application_name = $1 AND l.locktype = 'advisory' AND l.granted",
    )
    .await;
}

/// Polls `condition`, a query of one boolean bound to `application`, until it holds.
#[cfg(feature = "postgres")]
async fn until_sessions(application: &str, condition: &'static str) {
    use sqlx::Connection;
    let mut watcher = sqlx::PgConnection::connect(&PgSchema::url()).await.unwrap();
    loop {
        let holds: bool = sqlx::query_scalar(condition)
            .bind(application)
            .fetch_one(&mut watcher)
            .await
            .unwrap();
        if holds {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}
