//! The chain's processes (the payments example, its provider and the orders example that
//! applies its events), the databases they run on, and the broker names of one run.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// The examples this bench drives, built with the bench's own profile and features, so the
/// library is compiled once for both.
pub(crate) fn build_examples() {
    if std::env::var("CHAIN_BENCH_BUILD").as_deref() == Ok("0") {
        return;
    }
    let features: Vec<&str> = [
        ("sqlite", cfg!(feature = "sqlite")),
        ("postgres", cfg!(feature = "postgres")),
        ("mysql", cfg!(feature = "mysql")),
        ("outbox", cfg!(feature = "outbox")),
        ("inbox", cfg!(feature = "inbox")),
        ("rabbitmq", cfg!(feature = "rabbitmq")),
        ("nats", cfg!(feature = "nats")),
        ("client", cfg!(feature = "client")),
        ("reqwest", cfg!(feature = "reqwest")),
        ("metrics", cfg!(feature = "metrics")),
        ("test-util", cfg!(feature = "test-util")),
    ]
    .into_iter()
    .filter_map(|(name, on)| on.then_some(name))
    .collect();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = std::process::Command::new(cargo)
        .args(["build", "--profile", "bench", "--example", "payments"])
        .args(["--example", "payment_provider", "--example", "orders"])
        .args(["--features", &features.join(",")])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .expect("cargo runs");
    assert!(status.success(), "building the examples failed");
}

fn example(name: &str) -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target"));
    let path = target.join("release").join("examples").join(name);
    assert!(path.exists(), "{} is missing", path.display());
    path
}

/// A running example, killed when dropped.
pub(crate) struct Process {
    child: Child,
    pub(crate) url: String,
    /// The last `consumer stats …` line it printed (orders with `ORDERS_CONSUMER_STATS_MS`).
    stats: Arc<Mutex<String>>,
}

impl Process {
    pub(crate) async fn start(name: &str, env: &[(&str, &str)]) -> Self {
        let mut command = Command::new(example(name));
        command
            .env("BIND", "127.0.0.1:0")
            .env(
                "RUST_LOG",
                std::env::var("CHAIN_BENCH_LOG").unwrap_or_else(|_| "error".into()),
            )
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        let mut child = command.spawn().expect("spawn an example");
        let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let url = tokio::time::timeout(Duration::from_secs(30), async {
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(rest) = line.split("listening on ").nth(1) {
                    return rest
                        .split_whitespace()
                        .next()
                        .unwrap_or_default()
                        .to_owned();
                }
            }
            panic!("{name} exited before listening");
        })
        .await
        .expect("the example listens within 30 s");
        let stats = Arc::new(Mutex::new(String::new()));
        let last = Arc::clone(&stats);
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                if line.starts_with("consumer stats") {
                    *last.lock().expect("stats") = line;
                }
            }
        });
        Self { child, url, stats }
    }

    /// Its process id, for its CPU time.
    pub(crate) fn pid(&self) -> Vec<u32> {
        self.child.id().into_iter().collect()
    }

    /// The inbox's counters as orders last printed them.
    pub(crate) fn stats(&self) -> String {
        self.stats.lock().expect("stats").clone()
    }

    /// SIGTERM, then waits for the exit: the requests in flight are answered, the dispatchers
    /// stop.
    pub(crate) async fn stop(mut self) {
        if let Some(pid) = self.child.id() {
            let _ = std::process::Command::new("kill")
                .arg("-TERM")
                .arg(pid.to_string())
                .status();
        }
        if tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }
}

/// The outbox's rows still to be delivered, and those given up.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Counts {
    pub(crate) pending: u64,
    /// Pending charges: the payments not yet charged.
    pub(crate) pending_charges: u64,
    pub(crate) failed: u64,
}

/// What the bench polls: only the pending and failed rows, through the outbox's
/// `(status, next_attempt_at)` index. A count of every row (the delivered ones too, which the
/// example never purges) scanned the whole table at each poll and slowed the relay it measured.
const COUNTS: &str = "SELECT topic, status, COUNT(*) FROM idempotency_outbox \
     WHERE status IN ('pending', 'failed') GROUP BY topic, status";

/// The last id (the bound unused: one binding for both statements).
const LAST_ID: &str = "SELECT COALESCE(MAX(id), $1) FROM idempotency_outbox";
const PENDING_UP_TO: &str = "SELECT COUNT(*) FROM (SELECT 1 FROM idempotency_outbox \
     WHERE status = 'pending' AND id <= $1 ORDER BY status, next_attempt_at LIMIT 1) AS first";

/// The charges up to an id: the payments accepted by the time it was the last.
const CHARGES_UP_TO: &str =
    "SELECT COUNT(*) FROM idempotency_outbox WHERE topic = 'payments.charge' AND id <= $1";
/// Orders' distinct payments applied among those whose charge id is up to a bound: the
/// payment id is the charge's message id.
const APPLIED_UP_TO: &str = "SELECT COUNT(DISTINCT payment_id) FROM order_payments \
     WHERE CAST(payment_id AS BIGINT) <= $1";

/// The delivered rows by topic (charges, events): a scan of the table, for the end of a step.
const DELIVERED: &str = "SELECT \
     COUNT(CASE WHEN topic = 'payments.charge' THEN 1 END), \
     COUNT(CASE WHEN topic <> 'payments.charge' THEN 1 END) \
     FROM idempotency_outbox WHERE status = 'delivered'";

fn tally(rows: Vec<(String, String, i64)>) -> Counts {
    let mut counts = Counts::default();
    for (topic, status, n) in rows {
        let n = u64::try_from(n).unwrap_or_default();
        match status.as_str() {
            "pending" if topic == "payments.charge" => {
                counts.pending += n;
                counts.pending_charges += n;
            }
            "pending" => counts.pending += n,
            _ => counts.failed += n,
        }
    }
    counts
}

/// Where a URL's host and port are: after the scheme's `//` and any user, up to the path.
fn authority(url: &str) -> (usize, usize) {
    let start = url.find("//").map_or(0, |at| at + 2);
    let end = url[start..].find('/').map_or(url.len(), |at| start + at);
    let start = url[start..end]
        .rfind('@')
        .map_or(start, |at| start + at + 1);
    (start, end)
}

/// A database of one run's own for payments, and a connection to read its outbox.
pub(crate) enum Database {
    Sqlite {
        url: String,
        _dir: tempfile::TempDir,
        pool: Option<sqlx::SqlitePool>,
    },
    #[cfg(feature = "postgres")]
    Postgres {
        url: String,
        admin: sqlx::PgPool,
        schema: String,
        pool: Option<sqlx::PgPool>,
    },
}

impl Database {
    // `name` names a PostgreSQL schema; an SQLite database is a file of its own.
    #[cfg_attr(not(feature = "postgres"), allow(unused_variables))]
    pub(crate) async fn new(kind: &str, name: &str) -> Self {
        match kind {
            "sqlite" => {
                let dir = tempfile::tempdir().expect("tempdir");
                let url = format!("sqlite://{}", dir.path().join("payments.db").display());
                Self::Sqlite {
                    url,
                    _dir: dir,
                    pool: None,
                }
            }
            #[cfg(feature = "postgres")]
            "postgres" => {
                let base = std::env::var("TEST_POSTGRES_URL")
                    .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
                let admin = sqlx::PgPool::connect(&base).await.expect("PostgreSQL");
                let schema = format!("t_{name}");
                sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                    "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}"
                )))
                .execute(&admin)
                .await
                .expect("schema");
                // Named after the schema, so the backends serving it can be found for their CPU
                // time.
                let url =
                    format!("{base}?options=-c%20search_path%3D{schema}&application_name={schema}");
                Self::Postgres {
                    url,
                    admin,
                    schema,
                    pool: None,
                }
            }
            other => panic!("no database {other:?} in this build (see --features)"),
        }
    }

    pub(crate) fn url(&self) -> &str {
        match self {
            Self::Sqlite { url, .. } => url,
            #[cfg(feature = "postgres")]
            Self::Postgres { url, .. } => url,
        }
    }

    /// The PostgreSQL server's address, where an app's connections can be sent through the
    /// bench's proxy; `None` for SQLite, a file with no link to cut.
    pub(crate) fn server(&self) -> Option<std::net::SocketAddr> {
        match self {
            Self::Sqlite { .. } => None,
            #[cfg(feature = "postgres")]
            Self::Postgres { url, .. } => {
                let (start, end) = authority(url);
                let authority = &url[start..end];
                let addr = if authority.contains(':') {
                    authority.to_owned()
                } else {
                    format!("{authority}:5432")
                };
                let addr = addr.replace("localhost", "127.0.0.1");
                Some(
                    addr.parse()
                        .expect("the PostgreSQL URL's host is an address"),
                )
            }
        }
    }

    /// The URL for an app that reaches the database at `addr` (the bench's proxy).
    pub(crate) fn url_via(&self, addr: std::net::SocketAddr) -> String {
        let url = self.url();
        let (start, end) = authority(url);
        format!("{}{addr}{}", &url[..start], &url[end..])
    }

    /// Holds the write lock of the SQLite database at `url` (`BEGIN EXCLUSIVE`) on a
    /// connection of the bench's own until the returned connection is given to
    /// [`release`](Self::release): every
    /// write of the apps waits out its lock wait and fails, as behind a stuck process or a
    /// long backup, while readers (WAL) go on.
    pub(crate) async fn hold_write_lock_at(url: &str) -> sqlx::SqliteConnection {
        use sqlx::Connection as _;
        let mut conn = sqlx::SqliteConnection::connect(url).await.expect("SQLite");
        sqlx::raw_sql("BEGIN EXCLUSIVE")
            .execute(&mut conn)
            .await
            .expect("the write lock");
        conn
    }

    /// Gives back a write lock taken by [`hold_write_lock_at`](Self::hold_write_lock_at).
    pub(crate) async fn release(mut conn: sqlx::SqliteConnection) {
        sqlx::raw_sql("ROLLBACK")
            .execute(&mut conn)
            .await
            .expect("the write lock given back");
    }

    /// Connects the bench's own pool, once.
    async fn connect(&mut self) {
        match self {
            Self::Sqlite { url, pool, .. } => {
                if pool.is_none() {
                    *pool = Some(sqlx::SqlitePool::connect(url).await.expect("SQLite"));
                }
            }
            #[cfg(feature = "postgres")]
            Self::Postgres { url, pool, .. } => {
                if pool.is_none() {
                    let options = sqlx::postgres::PgPoolOptions::new().max_connections(1);
                    *pool = Some(options.connect(url).await.expect("PostgreSQL"));
                }
            }
        }
    }

    /// The outbox's counts; zero before payments created its table.
    pub(crate) async fn counts(&mut self) -> Counts {
        self.connect().await;
        let rows = match self {
            Self::Sqlite { pool, .. } => {
                let pool = pool.as_ref().expect("connected");
                sqlx::query_as(COUNTS).fetch_all(pool).await
            }
            #[cfg(feature = "postgres")]
            Self::Postgres { pool, .. } => {
                let pool = pool.as_ref().expect("connected");
                sqlx::query_as(COUNTS).fetch_all(pool).await
            }
        };
        tally(rows.unwrap_or_default())
    }

    /// The outbox's last message id so far (0 before any): the messages up to it are those
    /// enqueued by then.
    pub(crate) async fn last_id(&mut self) -> i64 {
        self.scalar(LAST_ID, 0).await
    }

    /// Whether a message up to `id` is still pending. Through the due index, whose oldest
    /// entries they are while any is left: a poll that stops at the first one found.
    pub(crate) async fn pending_up_to(&mut self, id: i64) -> bool {
        self.scalar(PENDING_UP_TO, id).await > 0
    }

    /// The payments' charges up to `id` (the payments database).
    pub(crate) async fn charges_up_to(&mut self, id: i64) -> u64 {
        u64::try_from(self.scalar(CHARGES_UP_TO, id).await).unwrap_or_default()
    }

    /// The payments applied whose charge id is up to `id` (the orders database).
    pub(crate) async fn applied_up_to(&mut self, id: i64) -> u64 {
        u64::try_from(self.scalar(APPLIED_UP_TO, id).await).unwrap_or_default()
    }

    async fn scalar(&mut self, sql: &'static str, bound: i64) -> i64 {
        self.connect().await;
        let value: Result<i64, _> = match self {
            Self::Sqlite { pool, .. } => {
                let pool = pool.as_ref().expect("connected");
                sqlx::query_scalar(sql).bind(bound).fetch_one(pool).await
            }
            #[cfg(feature = "postgres")]
            Self::Postgres { pool, .. } => {
                let pool = pool.as_ref().expect("connected");
                sqlx::query_scalar(sql).bind(bound).fetch_one(pool).await
            }
        };
        value.unwrap_or_default()
    }

    /// The delivered charges and events.
    pub(crate) async fn delivered(&mut self) -> (u64, u64) {
        self.connect().await;
        let row: Result<(i64, i64), _> = match self {
            Self::Sqlite { pool, .. } => {
                let pool = pool.as_ref().expect("connected");
                sqlx::query_as(DELIVERED).fetch_one(pool).await
            }
            #[cfg(feature = "postgres")]
            Self::Postgres { pool, .. } => {
                let pool = pool.as_ref().expect("connected");
                sqlx::query_as(DELIVERED).fetch_one(pool).await
            }
        };
        let (charges, events) = row.unwrap_or_default();
        (
            u64::try_from(charges).unwrap_or_default(),
            u64::try_from(events).unwrap_or_default(),
        )
    }

    /// PostgreSQL only: the CPU time so far of the backends serving this database's clients
    /// but the bench (their pids are read now, so call it while they are connected), and
    /// the outbox's rows inserted, updated, updated in place (HOT: no index written) and
    /// deleted so far.
    pub(crate) async fn server_side(&mut self) -> Option<(Duration, [u64; 4])> {
        #[cfg(feature = "postgres")]
        if let Self::Postgres {
            admin,
            schema,
            pool,
            ..
        } = self
        {
            // The bench's own reader shares the name; its pid is left out.
            let own: Option<i32> = match pool {
                Some(pool) => sqlx::query_scalar("SELECT pg_backend_pid()")
                    .fetch_one(&*pool)
                    .await
                    .ok(),
                None => None,
            };
            let pids: Vec<i32> =
                sqlx::query_scalar("SELECT pid FROM pg_stat_activity WHERE application_name = $1")
                    .bind(schema.as_str())
                    .fetch_all(&*admin)
                    .await
                    .unwrap_or_default();
            let pids: Vec<u32> = pids
                .into_iter()
                .filter(|pid| Some(*pid) != own)
                .filter_map(|pid| u32::try_from(pid).ok())
                .collect();
            let tuples: (i64, i64, i64, i64) = sqlx::query_as(
                "SELECT n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del FROM pg_stat_user_tables \
                 WHERE schemaname = $1 AND relname = 'idempotency_outbox'",
            )
            .bind(schema.as_str())
            .fetch_one(&*admin)
            .await
            .unwrap_or_default();
            let count = |n: i64| u64::try_from(n).unwrap_or_default();
            return Some((
                crate::cpu::of_pids(&pids),
                [
                    count(tuples.0),
                    count(tuples.1),
                    count(tuples.2),
                    count(tuples.3),
                ],
            ));
        }
        None
    }

    /// Orders' applied payments: the rows in `order_payments` and their distinct payment ids
    /// (a payment applied twice makes the first larger); zero before orders created its tables.
    pub(crate) async fn applied(&mut self) -> (u64, u64) {
        const APPLIED: &str = "SELECT COUNT(*), COUNT(DISTINCT payment_id) FROM order_payments";
        let row: Result<(i64, i64), _> = match self {
            Self::Sqlite { url, pool, .. } => {
                if pool.is_none() {
                    *pool = sqlx::SqlitePool::connect(url).await.ok();
                }
                match pool {
                    Some(pool) => sqlx::query_as(APPLIED).fetch_one(&*pool).await,
                    None => Ok((0, 0)),
                }
            }
            #[cfg(feature = "postgres")]
            Self::Postgres { url, pool, .. } => {
                if pool.is_none() {
                    let options = sqlx::postgres::PgPoolOptions::new().max_connections(1);
                    *pool = Some(options.connect(url).await.expect("PostgreSQL"));
                }
                let pool = pool.as_ref().expect("connected");
                sqlx::query_as(APPLIED).fetch_one(pool).await
            }
        };
        let (rows, distinct) = row.unwrap_or_default();
        (
            u64::try_from(rows).unwrap_or_default(),
            u64::try_from(distinct).unwrap_or_default(),
        )
    }

    pub(crate) async fn cleanup(self) {
        match self {
            Self::Sqlite { pool, .. } => {
                if let Some(pool) = pool {
                    pool.close().await;
                }
            }
            #[cfg(feature = "postgres")]
            Self::Postgres {
                admin,
                schema,
                pool,
                ..
            } => {
                if let Some(pool) = pool {
                    pool.close().await;
                }
                let drop = format!("DROP SCHEMA IF EXISTS {schema} CASCADE");
                let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(drop))
                    .execute(&admin)
                    .await;
            }
        }
    }
}

/// The provider's charges, read from its SQLite file: how many, and how many distinct
/// idempotency keys (one per payment; fewer than the charges means a payment charged twice).
pub(crate) async fn charges(provider_db: &Path) -> (u64, u64) {
    let url = format!("sqlite://{}?mode=ro", provider_db.display());
    let Ok(pool) = sqlx::SqlitePool::connect(&url).await else {
        return (0, 0);
    };
    let row: Result<(i64, i64), _> =
        sqlx::query_as("SELECT COUNT(*), COUNT(DISTINCT idempotency_key) FROM charges")
            .fetch_one(&pool)
            .await;
    pool.close().await;
    let (charges, keys) = row.unwrap_or_default();
    (
        u64::try_from(charges).unwrap_or_default(),
        u64::try_from(keys).unwrap_or_default(),
    )
}

pub(crate) const AMQP: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
pub(crate) const NATS: &str = "nats://127.0.0.1:4222";

/// The events that reached the broker under one run's namespace `ns`: on RabbitMQ a queue of
/// the bench's own bound to payments' exchange (bound before the first event is sent), on
/// NATS payments' stream.
pub(crate) enum Events {
    RabbitMq {
        connection: lapin::Connection,
        channel: lapin::Channel,
        ns: String,
    },
    Nats {
        js: async_nats::jetstream::Context,
        ns: String,
    },
}

impl Events {
    /// Call it once payments has declared its exchange or stream.
    pub(crate) async fn watch(broker: &str, ns: &str) -> Self {
        match broker {
            "rabbitmq" => {
                use lapin::options::{QueueBindOptions, QueueDeclareOptions};
                let connection = lapin::Connection::connect(AMQP, Default::default())
                    .await
                    .expect("RabbitMQ");
                let channel = connection.create_channel().await.expect("channel");
                let queue = format!("{ns}.bench.events");
                channel
                    .queue_declare(
                        queue.as_str().into(),
                        QueueDeclareOptions::default(),
                        Default::default(),
                    )
                    .await
                    .expect("queue");
                channel
                    .queue_bind(
                        queue.as_str().into(),
                        format!("{ns}.payments").as_str().into(),
                        "payment.succeeded".into(),
                        QueueBindOptions::default(),
                        Default::default(),
                    )
                    .await
                    .expect("bind");
                Self::RabbitMq {
                    connection,
                    channel,
                    ns: ns.to_owned(),
                }
            }
            _ => {
                let client = async_nats::connect(NATS).await.expect("NATS");
                Self::Nats {
                    js: async_nats::jetstream::new(client),
                    ns: ns.to_owned(),
                }
            }
        }
    }

    /// How many events the broker holds.
    pub(crate) async fn count(&self) -> u64 {
        match self {
            Self::RabbitMq { channel, ns, .. } => {
                use lapin::options::QueueDeclareOptions;
                let passive = QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                };
                let queue = format!("{ns}.bench.events");
                channel
                    .queue_declare(queue.as_str().into(), passive, Default::default())
                    .await
                    .map(|q| u64::from(q.message_count()))
                    .unwrap_or_default()
            }
            Self::Nats { js, ns } => {
                let name = format!("{}_PAYMENTS", ns.to_uppercase());
                match js.get_stream(name).await {
                    Ok(mut stream) => stream.info().await.map(|i| i.state.messages).unwrap_or(0),
                    Err(_) => 0,
                }
            }
        }
    }

    /// Deletes what payments and the bench declared under the namespace.
    pub(crate) async fn cleanup(self) {
        match self {
            Self::RabbitMq {
                connection,
                channel,
                ns,
            } => {
                use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
                let queue = format!("{ns}.bench.events");
                let _ = channel
                    .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                    .await;
                // What orders declared, when the step ran it.
                let consumed = format!("{ns}.orders.payment-succeeded");
                for queue in [
                    consumed.clone(),
                    format!("{consumed}.retry"),
                    format!("{consumed}.dead"),
                ] {
                    let _ = channel
                        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                        .await;
                }
                let exchange = format!("{ns}.payments");
                let _ = channel
                    .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
                    .await;
                let _ = connection.close(200, "bench done".into()).await;
            }
            Self::Nats { js, ns } => {
                for stream in ["PAYMENTS", "ORDERS_DEAD"] {
                    let _ = js
                        .delete_stream(format!("{}_{stream}", ns.to_uppercase()))
                        .await;
                }
            }
        }
    }
}
