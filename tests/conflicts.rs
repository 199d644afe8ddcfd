//! Transactions the database aborts on a conflict with a concurrent one are run again by the
//! layer, so the client never sees the abort: distinct keys buying from one contended stock row,
//! on PostgreSQL at `SERIALIZABLE` (serialization failures) and on MariaDB with shared locks
//! taken before the update (deadlocks). The stock is never oversold, every request gets a final
//! answer on its first try, and the handler ran more often than there were requests: the aborts
//! happened, and were absorbed.
//!
//! Duplicates of a request still in flight wait for it and replay its answer whatever the
//! isolation level the server runs transactions at: a claim that must start over because its
//! snapshot predates the original's commit is no reason to answer "in progress". The same key
//! in two schemas of one PostgreSQL database is two keys: neither waits for the other.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum_idempotency::{IdempotencyLayer, Store, Tx, TxError};
use common::{Backend, Db, Reply, serve, unique};
use sqlx::Pool;

const STOCK: i64 = 25;
const BUYERS: usize = 40;

/// What the storm left: statuses of the first tries, handler runs, and the rows.
struct Storm {
    statuses: Vec<StatusCode>,
    runs: usize,
    stock_left: i64,
    bought: i64,
    records: i64,
}

impl Storm {
    fn check(&self) {
        let created = self
            .statuses
            .iter()
            .filter(|s| **s == StatusCode::CREATED)
            .count();
        let refused = self
            .statuses
            .iter()
            .filter(|s| **s == StatusCode::CONFLICT)
            .count();
        assert_eq!(
            created + refused,
            BUYERS,
            "every first try is final (201 or 409 out of stock), none 5xx: {:?}",
            self.statuses
        );
        assert_eq!(created as i64, STOCK, "all the stock is sold");
        assert_eq!(self.stock_left, 0, "never oversold");
        assert_eq!(self.bought, STOCK, "one purchase row per 201");
        assert_eq!(self.records, BUYERS as i64, "one record per key");
        assert!(
            self.runs > BUYERS,
            "aborted transactions were run again ({} runs for {BUYERS} requests)",
            self.runs
        );
    }
}

/// Fires `BUYERS` keyed purchases at once, each under a key of its own.
async fn storm(app: Router) -> Vec<StatusCode> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<bytes::Bytes>>();
    let start = Arc::new(tokio::sync::Barrier::new(BUYERS));
    let requests = (0..BUYERS).map(|_| {
        let client = client.clone();
        let start = Arc::clone(&start);
        async move {
            let request = http::Request::post(format!("http://{addr}/buy"))
                .header("idempotency-key", unique("buyer"))
                .body(http_body_util::Full::new(bytes::Bytes::new()))
                .expect("request");
            start.wait().await;
            client.request(request).await.expect("answer").status()
        }
    });
    let statuses = futures_util::future::join_all(requests).await;
    server.abort();
    statuses
}

/// Storms `buy` on a migrated store over `pool`, then reads what the storm left through `count`
/// (one number from an SQL query on the same database).
async fn storm_and_count<DB, H, T, C, Fut>(pool: &Pool<DB>, buy: H, count: C) -> Storm
where
    DB: axum_idempotency::Backend,
    H: axum::handler::Handler<T, Arc<AtomicUsize>>,
    T: 'static,
    C: Fn(&'static str) -> Fut,
    Fut: std::future::Future<Output = i64>,
{
    let store = Store::new(pool.clone());
    store.migrate().await.expect("migrate");
    let runs = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route("/buy", post(buy))
        .route_layer(IdempotencyLayer::new(store).allow_anonymous())
        .with_state(Arc::clone(&runs));
    let statuses = storm(app).await;
    Storm {
        statuses,
        runs: runs.load(Ordering::SeqCst),
        stock_left: count("SELECT stock FROM stock WHERE id = 1").await,
        bought: count("SELECT COUNT(*) FROM bought").await,
        records: count("SELECT COUNT(*) FROM idempotency_records").await,
    }
}

/// How many duplicates meet the original in flight.
const DUPLICATES: usize = 40;

/// The connections of the app the duplicates meet the original through: enough for most of
/// them to queue on the key's lock at once.
const POOL: u32 = 32;

/// What a storm of duplicates of one in-flight request left.
struct InFlight {
    first: Reply,
    duplicates: Vec<Reply>,
    runs: usize,
    effects: i64,
    records: i64,
}

impl InFlight {
    /// Every duplicate got the original's answer replayed, and the business ran once.
    fn check(&self) {
        let first = &self.first;
        assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
        assert!(!first.replayed());
        let in_progress = self
            .duplicates
            .iter()
            .filter(|r| r.status == StatusCode::CONFLICT)
            .count();
        for reply in &self.duplicates {
            assert_eq!(
                reply.status, first.status,
                "every duplicate waited for the original ({in_progress} of {DUPLICATES} were \
                 answered in progress): {reply:?}"
            );
            assert!(reply.replayed(), "{reply:?}");
            assert_eq!(reply.body, first.body);
            assert_eq!(reply.headers["location"], first.headers["location"]);
        }
        assert_eq!(self.runs, 1, "the handler ran once");
        assert_eq!(self.effects, 1, "the business ran once");
        assert_eq!(self.records, 1, "one record");
    }
}

/// Sends a request whose handler holds its claim a while, then, once the handler runs, fires
/// `DUPLICATES` copies of it (same key, same body) at once, all through an app on `pool`.
async fn duplicates_of_an_in_flight_request<DB: Db>(pool: Pool<DB>) -> InFlight {
    let app = Arc::new(serve(pool, |layer| layer).await);
    let key = unique("in-flight");
    let payload = serde_json::json!({ "label": "in-flight", "sleep_ms": 300 }).to_string();
    let first = tokio::spawn({
        let (app, key, payload) = (Arc::clone(&app), key.clone(), payload.clone());
        async move {
            app.post("/effects", Some("alice"), Some(&key), &payload)
                .await
        }
    });
    while app.executions() == 0 && !first.is_finished() {
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    let start = Arc::new(tokio::sync::Barrier::new(DUPLICATES));
    let duplicates: Vec<_> = (0..DUPLICATES)
        .map(|_| {
            let (app, key, payload) = (Arc::clone(&app), key.clone(), payload.clone());
            let start = Arc::clone(&start);
            tokio::spawn(async move {
                start.wait().await;
                app.post("/effects", Some("alice"), Some(&key), &payload)
                    .await
            })
        })
        .collect();
    let first = first.await.expect("original");
    let mut replies = Vec::new();
    for duplicate in duplicates {
        replies.push(duplicate.await.expect("duplicate"));
    }
    let stormed = InFlight {
        first,
        duplicates: replies,
        runs: app.executions(),
        effects: DB::count_effects(&app.pool, "in-flight").await,
        records: DB::count_records(&app.pool).await,
    };
    app.pool.close().await;
    stormed
}

#[cfg(feature = "postgres")]
mod postgres {
    use super::*;
    use sqlx::Postgres;

    async fn buy(
        State(runs): State<Arc<AtomicUsize>>,
        mut tx: Tx<Postgres>,
    ) -> Result<Response, TxError> {
        runs.fetch_add(1, Ordering::SeqCst);
        let stock: i64 = sqlx::query_scalar("SELECT stock FROM stock WHERE id = 1")
            .fetch_one(&mut *tx)
            .await?;
        if stock < 1 {
            return Ok((StatusCode::CONFLICT, "out of stock").into_response());
        }
        sqlx::query("UPDATE stock SET stock = stock - 1 WHERE id = 1")
            .execute(&mut *tx)
            .await?;
        sqlx::query("INSERT INTO bought (n) VALUES (1)")
            .execute(&mut *tx)
            .await?;
        Ok((StatusCode::CREATED, "bought").into_response())
    }

    /// A pool on `isolated` whose every transaction, the claims' included, runs at
    /// SERIALIZABLE, as on a server with `default_transaction_isolation = serializable`.
    async fn serializable(isolated: &common::Isolated<Postgres>) -> Pool<Postgres> {
        at_isolation(isolated, "serializable", 16).await
    }

    /// A pool of `max` connections on `isolated` whose every transaction runs at `level`, as on
    /// a server whose `default_transaction_isolation` is set to it.
    async fn at_isolation(
        isolated: &common::Isolated<Postgres>,
        level: &str,
        max: u32,
    ) -> Pool<Postgres> {
        let options = common::postgres_url()
            .parse::<sqlx::postgres::PgConnectOptions>()
            .expect("url")
            .options([
                ("search_path", isolated.url.as_str()),
                ("default_transaction_isolation", level),
            ]);
        sqlx::pool::PoolOptions::new()
            .max_connections(max)
            .connect_with(options)
            .await
            .expect("connect")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_consumer_whose_statements_conflict_is_run_again_not_retried_later() {
        use axum_idempotency::inbox::{Delivery, Inbox, Verdict};

        let isolated = Postgres::fresh(2).await;
        let pool = serializable(&isolated).await;
        sqlx::raw_sql(
            "CREATE TABLE counter (id INT PRIMARY KEY, n BIGINT NOT NULL);
             INSERT INTO counter VALUES (1, 0);",
        )
        .execute(&pool)
        .await
        .expect("table");
        let store = Store::new(pool.clone());
        store.migrate().await.expect("migrate");
        let inbox = Inbox::new("counter", store)
            .key_by(|delivery| Ok(String::from_utf8_lossy(delivery.payload()).into_owned()));
        let runs = Arc::new(AtomicUsize::new(0));
        // A read-then-write of one row: concurrent deliveries abort each other at SERIALIZABLE,
        // and `?` turns the abort into `Failure::Conflict`.
        let handler = {
            let runs = Arc::clone(&runs);
            move |mut tx: Tx<Postgres>, _delivery: Delivery| {
                let runs = Arc::clone(&runs);
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    let n: i64 = sqlx::query_scalar("SELECT n FROM counter WHERE id = 1")
                        .fetch_one(&mut *tx)
                        .await?;
                    sqlx::query("UPDATE counter SET n = $1 WHERE id = 1")
                        .bind(n + 1)
                        .execute(&mut *tx)
                        .await?;
                    Ok(())
                }
            }
        };
        let start = Arc::new(tokio::sync::Barrier::new(BUYERS));
        let verdicts = futures_util::future::join_all((0..BUYERS).map(|i| {
            let (inbox, handler, start) = (inbox.clone(), handler.clone(), Arc::clone(&start));
            async move {
                start.wait().await;
                inbox
                    .handle(Delivery::new(format!("event-{i}")), handler)
                    .await
            }
        }))
        .await;
        let counted: i64 = sqlx::query_scalar("SELECT n FROM counter WHERE id = 1")
            .fetch_one(&pool)
            .await
            .expect("counter");
        let runs = runs.load(Ordering::SeqCst);
        pool.close().await;
        Postgres::dispose(isolated).await;
        assert!(
            verdicts.iter().all(|v| *v == Verdict::Applied),
            "every delivery applied on its first delivery: {verdicts:?}"
        );
        assert_eq!(counted, BUYERS as i64, "each delivery applied once");
        assert!(
            runs > BUYERS,
            "aborted deliveries were run again ({runs} runs)"
        );
    }

    async fn duplicates_at(level: &str) {
        let isolated = Postgres::fresh(2).await;
        let stormed =
            duplicates_of_an_in_flight_request(at_isolation(&isolated, level, POOL).await).await;
        Postgres::dispose(isolated).await;
        stormed.check();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn duplicates_of_an_in_flight_request_wait_and_replay_at_serializable() {
        duplicates_at("serializable").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn duplicates_of_an_in_flight_request_wait_and_replay_at_repeatable_read() {
        duplicates_at("repeatable read").await;
    }

    /// Two apps (or tenants) keep their records in two schemas of one database; the same
    /// client key reaching both is two intents, and neither waits for the other's.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn one_key_in_flight_in_two_schemas_of_one_database_runs_in_both_at_once() {
        use axum_idempotency::{Engine, Fingerprinter, Outcome, Scope};
        use std::time::Duration;

        let (one, two) = (Postgres::fresh(2).await, Postgres::fresh(2).await);
        let engine = |isolated: &common::Isolated<Postgres>| {
            Engine::new(Store::new(isolated.pool.clone()))
                .wait_for_in_flight(Duration::from_secs(30))
        };
        let (first, second) = (engine(&one), engine(&two));
        first.store().migrate().await.expect("migrate one");
        second.store().migrate().await.expect("migrate two");
        let scope = Scope::new(
            "alice",
            "POST",
            "/orders",
            unique("tenant-key").parse().expect("key"),
        );
        let fingerprint = Fingerprinter::new().fingerprint_value("order", b"same body");
        let (started, finished) = (
            Arc::new(tokio::sync::Notify::new()),
            Arc::new(tokio::sync::Notify::new()),
        );

        // The first holds its key until the second has run, or gives up after 20 s.
        let held = tokio::spawn({
            let (scope, started, finished) =
                (scope.clone(), Arc::clone(&started), Arc::clone(&finished));
            async move {
                first
                    .run(&scope, fingerprint, move |_tx: Tx<Postgres>| {
                        let (started, finished) = (Arc::clone(&started), Arc::clone(&finished));
                        async move {
                            started.notify_one();
                            let waited =
                                tokio::time::timeout(Duration::from_secs(20), finished.notified())
                                    .await;
                            if waited.is_ok() {
                                StatusCode::CREATED
                            } else {
                                StatusCode::CONFLICT
                            }
                        }
                    })
                    .await
            }
        });
        started.notified().await;
        let other = second
            .run(&scope, fingerprint, |_tx: Tx<Postgres>| async {
                StatusCode::CREATED
            })
            .await;
        finished.notify_one();
        let held = held.await.expect("first run");
        Postgres::dispose(one).await;
        Postgres::dispose(two).await;

        let other = other.expect("the second schema's run");
        assert_eq!(other.outcome, Outcome::Executed);
        let held = held.expect("the first schema's run");
        assert_eq!(
            held.response.status(),
            StatusCode::CREATED,
            "the second schema's run finished while the first held the key"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn serializable_storm_on_one_stock_row_is_never_oversold_and_never_5xx() {
        let isolated = Postgres::fresh(2).await;
        let pool = serializable(&isolated).await;
        sqlx::raw_sql(
            "CREATE TABLE stock (id INT PRIMARY KEY, stock BIGINT NOT NULL);
             CREATE TABLE bought (n INT NOT NULL);",
        )
        .execute(&pool)
        .await
        .expect("tables");
        sqlx::query("INSERT INTO stock VALUES (1, $1)")
            .bind(STOCK)
            .execute(&pool)
            .await
            .expect("stock");
        let result = storm_and_count(&pool, buy, |sql| {
            let pool = pool.clone();
            async move {
                sqlx::query_scalar::<_, i64>(sql)
                    .fetch_one(&pool)
                    .await
                    .expect(sql)
            }
        })
        .await;
        pool.close().await;
        Postgres::dispose(isolated).await;
        result.check();
    }
}

#[cfg(feature = "mysql")]
mod mariadb {
    use super::*;
    use sqlx::MySql;

    async fn buy(
        State(runs): State<Arc<AtomicUsize>>,
        mut tx: Tx<MySql>,
    ) -> Result<Response, TxError> {
        runs.fetch_add(1, Ordering::SeqCst);
        // The shared lock two buyers both hold before either updates: a classic deadlock,
        // which InnoDB resolves by aborting one of them.
        let stock: i64 =
            sqlx::query_scalar("SELECT stock FROM stock WHERE id = 1 LOCK IN SHARE MODE")
                .fetch_one(&mut *tx)
                .await?;
        if stock < 1 {
            return Ok((StatusCode::CONFLICT, "out of stock").into_response());
        }
        sqlx::query("UPDATE stock SET stock = stock - 1 WHERE id = 1")
            .execute(&mut *tx)
            .await?;
        sqlx::query("INSERT INTO bought (n) VALUES (1)")
            .execute(&mut *tx)
            .await?;
        Ok((StatusCode::CREATED, "bought").into_response())
    }

    /// Duplicates of an in-flight request on a pool whose every transaction runs at `level`, as
    /// on a server whose `transaction_isolation` is set to it.
    async fn duplicates_at(level: &'static str) {
        let isolated = MySql::fresh(2).await;
        let options = common::mysql_url()
            .parse::<sqlx::mysql::MySqlConnectOptions>()
            .expect("url")
            .database(&isolated.url);
        let pool = sqlx::pool::PoolOptions::<MySql>::new()
            .max_connections(POOL)
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                        "SET SESSION TRANSACTION ISOLATION LEVEL {level}"
                    )))
                    .execute(conn)
                    .await
                    .map(drop)
                })
            })
            .connect_with(options)
            .await
            .expect("connect");
        let stormed = duplicates_of_an_in_flight_request(pool).await;
        MySql::dispose(isolated).await;
        stormed.check();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn duplicates_of_an_in_flight_request_wait_and_replay_at_serializable() {
        duplicates_at("SERIALIZABLE").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn deadlocking_storm_on_one_stock_row_is_never_oversold_and_never_5xx() {
        let isolated = MySql::fresh(16).await;
        let pool = isolated.pool.clone();
        sqlx::raw_sql(
            "CREATE TABLE stock (id INT PRIMARY KEY, stock BIGINT NOT NULL) ENGINE=InnoDB;
             CREATE TABLE bought (n INT NOT NULL) ENGINE=InnoDB;",
        )
        .execute(&pool)
        .await
        .expect("tables");
        sqlx::query("INSERT INTO stock VALUES (1, ?)")
            .bind(STOCK)
            .execute(&pool)
            .await
            .expect("stock");
        let result = storm_and_count(&pool, buy, |sql| {
            let pool = pool.clone();
            async move {
                sqlx::query_scalar::<_, i64>(sql)
                    .fetch_one(&pool)
                    .await
                    .expect(sql)
            }
        })
        .await;
        MySql::dispose(isolated).await;
        result.check();
    }
}
