//! The backends: each database's pool, schema and order app, served on loopback, with the same
//! app behind the counting proxy and the delay proxy where there is a wire.

use std::net::SocketAddr;
use std::sync::Arc;
#[cfg(any(feature = "postgres", feature = "mysql"))]
use std::time::Duration;

#[cfg(any(feature = "postgres", feature = "mysql"))]
use axum::Router;
use tokio::runtime::Runtime;

use crate::BoxError;
#[cfg(feature = "mysql")]
use crate::apps::mysql_app;
#[cfg(feature = "postgres")]
use crate::apps::postgres_app;
use crate::apps::serve;
#[cfg(feature = "sqlite")]
use crate::apps::sqlite_app;
#[cfg(feature = "mysql")]
use crate::fill::MYSQL_FILL;
#[cfg(feature = "postgres")]
use crate::fill::POSTGRES_FILL;
use crate::fill::Records;
#[cfg(feature = "sqlite")]
use crate::fill::SQLITE_FILL;
use crate::peer::Peer;
use crate::proxy::Wire;
#[cfg(any(feature = "postgres", feature = "mysql"))]
use crate::proxy::db_proxy;
#[cfg(any(feature = "postgres", feature = "mysql"))]
use crate::settings::wanted;

type CountOrders = Box<dyn Fn(&Runtime) -> Result<i64, BoxError>>;

pub(crate) struct Backend {
    pub(crate) name: &'static str,
    pub(crate) addr: SocketAddr,
    /// The same app on a pool that goes through the counting proxy, where there is a wire.
    pub(crate) counting_addr: SocketAddr,
    pub(crate) wire: Option<Arc<Wire>>,
    /// The same app on a pool whose every chunk to and from the database is held
    /// `BENCH_DELAY_MS` (where there is a wire and `latency-1ms` is in the run).
    pub(crate) delayed: Option<(SocketAddr, Arc<Wire>)>,
    pub(crate) orders: CountOrders,
    pub(crate) records: Records,
    pub(crate) note: String,
    /// The peer crate's server on this backend's database (PostgreSQL only).
    pub(crate) peer: Option<Peer>,
}

#[cfg(feature = "sqlite")]
pub(crate) fn sqlite_backend(
    server: &Runtime,
    dir: &std::path::Path,
    test_before_acquire: bool,
) -> Result<Backend, BoxError> {
    use sqlx::sqlite::{
        SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous,
    };
    let options = SqliteConnectOptions::new()
        .filename(dir.join("bench.db"))
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Normal);
    server.block_on(async {
        let pool = SqlitePoolOptions::new()
            .max_connections(8)
            .test_before_acquire(test_before_acquire)
            .connect_with(options)
            .await?;
        sqlx::raw_sql(sqlite_app::SCHEMA).execute(&pool).await?;
        axum_idempotency::SqliteStore::new(pool.clone()).migrate().await?;
        let addr = serve(sqlite_app::router(pool.clone())).await?;
        let records = sqlite_app::records(pool.clone(), &SQLITE_FILL);
        let orders: CountOrders = Box::new(move |rt: &Runtime| {
            let pool = pool.clone();
            rt.block_on(async move {
                Ok(sqlx::query_scalar("SELECT COUNT(*) FROM orders")
                    .fetch_one(&pool)
                    .await?)
            })
        });
        Ok(Backend {
            name: "sqlite",
            addr,
            counting_addr: addr,
            wire: None,
            delayed: None,
            orders,
            records,
            peer: None,
            note: format!(
                "file in a temp dir, WAL, synchronous=NORMAL, pool of 8, test_before_acquire={test_before_acquire}"
            ),
        })
    })
}

#[cfg(feature = "postgres")]
pub(crate) fn postgres_backend(
    server: &Runtime,
    url: &str,
    run: &str,
    test_before_acquire: bool,
    delay: Duration,
) -> Result<Backend, BoxError> {
    use std::str::FromStr;

    use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
    let schema = format!("bench_http_{run}");
    let base = PgConnectOptions::from_str(url)?;
    server.block_on(async {
        let admin = PgPoolOptions::new()
            .max_connections(1)
            .connect_with(base.clone())
            .await?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
            .execute(&admin)
            .await?;
        let options = base.clone().options([("search_path", schema.as_str())]);
        let pool = PgPoolOptions::new()
            .max_connections(16)
            .test_before_acquire(test_before_acquire)
            .after_connect(|conn, _| Box::pin(crate::cpu::note_postgres_backend(conn)))
            .connect_with(options.clone())
            .await?;
        sqlx::raw_sql(postgres_app::SCHEMA).execute(&pool).await?;
        axum_idempotency::PgStore::new(pool.clone())
            .migrate()
            .await?;
        let addr = serve(postgres_app::router(pool.clone())).await?;

        let upstream = tokio::net::lookup_host((base.get_host(), base.get_port()))
            .await?
            .next()
            .ok_or("cannot resolve the database host")?;
        let at = |port: u16| options.clone().host("127.0.0.1").port(port);
        let (counting_addr, wire) = proxied_app(
            upstream,
            Duration::ZERO,
            test_before_acquire,
            at,
            postgres_app::router,
        )
        .await?;
        let delayed = if wanted("latency-1ms") {
            Some(
                proxied_app(
                    upstream,
                    delay,
                    test_before_acquire,
                    at,
                    postgres_app::router,
                )
                .await?,
            )
        } else {
            None
        };
        let records = postgres_app::records(pool.clone(), &POSTGRES_FILL);

        let orders: CountOrders = Box::new(move |rt: &Runtime| {
            let pool = pool.clone();
            rt.block_on(async move {
                Ok(sqlx::query_scalar("SELECT COUNT(*) FROM orders")
                    .fetch_one(&pool)
                    .await?)
            })
        });
        Ok(Backend {
            name: "postgres",
            addr,
            counting_addr,
            wire: Some(wire),
            delayed,
            orders,
            records,
            peer: None,
            note: format!(
                "server on loopback, schema {schema}, pool of 16, sqlx defaults otherwise"
            ),
        })
    })
}

#[cfg(feature = "postgres")]
pub(crate) fn drop_postgres_schema(server: &Runtime, url: &str, run: &str) -> Result<(), BoxError> {
    server.block_on(async {
        let admin = sqlx::PgPool::connect(url).await?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS bench_http_{run} CASCADE"
        )))
        .execute(&admin)
        .await?;
        Ok(())
    })
}

#[cfg(feature = "mysql")]
pub(crate) fn mysql_backend(
    server: &Runtime,
    url: &str,
    run: &str,
    test_before_acquire: bool,
    delay: Duration,
) -> Result<Backend, BoxError> {
    use std::str::FromStr;

    use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
    let database = format!("bench_http_{run}");
    let base = MySqlConnectOptions::from_str(url)?;
    server.block_on(async {
        let admin = MySqlPoolOptions::new()
            .max_connections(1)
            .connect_with(base.clone())
            .await?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}")))
            .execute(&admin)
            .await?;
        let options = base.clone().database(&database);
        let pool = MySqlPoolOptions::new()
            .max_connections(16)
            .test_before_acquire(test_before_acquire)
            .connect_with(options.clone())
            .await?;
        sqlx::raw_sql(mysql_app::SCHEMA).execute(&pool).await?;
        axum_idempotency::MySqlStore::new(pool.clone()).migrate().await?;
        let addr = serve(mysql_app::router(pool.clone())).await?;

        let upstream = tokio::net::lookup_host((base.get_host(), base.get_port()))
            .await?
            .next()
            .ok_or("cannot resolve the database host")?;
        let at = |port: u16| options.clone().host("127.0.0.1").port(port);
        let (counting_addr, wire) = proxied_app(
            upstream,
            Duration::ZERO,
            test_before_acquire,
            at,
            mysql_app::router,
        )
        .await?;
        let delayed = if wanted("latency-1ms") {
            Some(proxied_app(upstream, delay, test_before_acquire, at, mysql_app::router).await?)
        } else {
            None
        };
        let records = mysql_app::records(pool.clone(), &MYSQL_FILL);

        let orders: CountOrders = Box::new(move |rt: &Runtime| {
            let pool = pool.clone();
            rt.block_on(async move {
                Ok(sqlx::query_scalar("SELECT COUNT(*) FROM orders")
                    .fetch_one(&pool)
                    .await?)
            })
        });
        Ok(Backend {
            name: "mysql",
            addr,
            counting_addr,
            wire: Some(wire),
            delayed,
            orders,
            records,
            peer: None,
            note: format!(
                "MariaDB server on loopback, database {database}, pool of 16, sqlx defaults otherwise"
            ),
        })
    })
}

#[cfg(feature = "mysql")]
pub(crate) fn drop_mysql_database(server: &Runtime, url: &str, run: &str) -> Result<(), BoxError> {
    server.block_on(async {
        let admin = sqlx::MySqlPool::connect(url).await?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS bench_http_{run}"
        )))
        .execute(&admin)
        .await?;
        Ok(())
    })
}

/// The order app on a pool of 4 that reaches the database through a [`db_proxy`] with `delay`.
/// `at` gives the pool's connect options for the proxy's port.
#[cfg(any(feature = "postgres", feature = "mysql"))]
async fn proxied_app<DB: sqlx::Database>(
    upstream: SocketAddr,
    delay: Duration,
    test_before_acquire: bool,
    at: impl Fn(u16) -> <DB::Connection as sqlx::Connection>::Options,
    router: fn(sqlx::Pool<DB>) -> Router,
) -> Result<(SocketAddr, Arc<Wire>), BoxError> {
    let wire = Arc::new(Wire::default());
    let proxy = db_proxy(upstream, delay, Arc::clone(&wire))?;
    let pool = sqlx::pool::PoolOptions::<DB>::new()
        .max_connections(4)
        .test_before_acquire(test_before_acquire)
        .connect_with(at(proxy.port()))
        .await?;
    Ok((serve(router(pool)).await?, wire))
}
