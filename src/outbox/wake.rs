//! How a commit that enqueued reaches the dispatchers: the outbox's wake signal, shared by all
//! of its dispatchers in the process, and, on PostgreSQL, `NOTIFY` for the other processes.

use std::fmt;
use std::sync::Arc;

use sqlx::{Database, Transaction};
use tokio::sync::watch;

use crate::tx::AfterCommit;
use crate::{Backend, Tx};

/// The wake signal of one outbox and its clones. A watch channel rather than a `Notify`: a
/// wake reaches every dispatcher, and one that is busy when it comes still sees it; each
/// dispatcher then owes the wake a claim that starts after it (a claim under way may have read
/// the table before the commit), and does not rest until it has started one.
#[derive(Clone)]
pub(crate) struct Wake(Arc<watch::Sender<()>>);

impl Wake {
    pub(crate) fn new() -> Self {
        Self(Arc::new(watch::Sender::new(())))
    }

    /// Makes every dispatcher of the outbox poll now, or as soon as it rests.
    pub(crate) fn wake(&self) {
        self.0.send_replace(());
    }

    /// A dispatcher's end of the signal; wakes from before the call are not seen by it.
    pub(crate) fn subscribe(&self) -> watch::Receiver<()> {
        self.0.subscribe()
    }
}

impl fmt::Debug for Wake {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Wake")
            .field("dispatchers", &self.0.receiver_count())
            .finish()
    }
}

/// Where [`Outbox::enqueue`](super::Outbox::enqueue) writes a message: the handler's
/// [`Tx`], or a transaction or connection of your own.
///
/// - `&mut Tx<DB>` (the request's transaction under the layer, a job's under
///   [`Engine::run`](crate::Engine::run), a consumer's under the inbox): whatever commits it
///   hands the message to a dispatcher of the outbox in this process, or wakes them, once the
///   commit has succeeded, with no code of yours.
/// - `&mut sqlx::Transaction<'_, DB>`, `&mut sqlx::pool::PoolConnection<DB>` or a bare
///   connection (`&mut SqliteConnection`, `&mut PgConnection`, `&mut MySqlConnection`): the
///   crate cannot see the commit, so call [`Outbox::wake`](super::Outbox::wake) after it, or
///   the message waits for the dispatchers' next poll.
///
/// Pass the `Tx` itself (`&mut tx`), not the connection it dereferences to (`&mut *tx`): the
/// connection writes the same message, but no longer knows it belongs to a `Tx`.
///
/// The trait is sealed: these are the only places a message can be written to.
///
#[cfg_attr(feature = "sqlite", doc = "```")]
#[cfg_attr(not(feature = "sqlite"), doc = "```ignore")]
/// # async fn run(outbox: axum_idempotency::outbox::Outbox<sqlx::Sqlite>, pool: sqlx::SqlitePool) -> Result<(), Box<dyn std::error::Error>> {
/// use axum_idempotency::outbox::{DownstreamKey, Message};
///
/// // A job with a transaction of its own: it wakes the dispatchers itself, after the commit.
/// let mut tx = pool.begin().await?;
/// let key = DownstreamKey::new("nightly-report-2024-05-01")?;
/// outbox.enqueue(&mut tx, Message::new("reports", key, "payload")).await?;
/// tx.commit().await?;
/// outbox.wake();
/// # Ok(()) }
/// ```
pub trait EnqueueTarget<DB: Backend>: private::Target<DB> {}

impl<DB: Backend, T: private::Target<DB>> EnqueueTarget<DB> for T {}

use private::Target;

mod private {
    use super::*;

    /// A connection to write on, and whether the commit of its transaction can be waited for.
    #[allow(unreachable_pub)]
    pub trait Target<DB: Database>: Send {
        fn connection(&mut self) -> &mut DB::Connection;

        /// Whether the crate commits the transaction, so [`after_commit`](Self::after_commit)
        /// runs its action.
        fn commits_here(&self) -> bool {
            false
        }

        /// Runs `action` once the transaction has committed, where the crate commits it;
        /// elsewhere it is dropped, and the caller wakes after its own commit.
        fn after_commit(&mut self, action: impl FnOnce() + Send + 'static) {
            drop(action);
        }
    }
}

impl<DB: Backend, M> Target<DB> for &mut Tx<DB, M> {
    fn connection(&mut self) -> &mut DB::Connection {
        self
    }

    fn commits_here(&self) -> bool {
        true
    }

    fn after_commit(&mut self, action: impl FnOnce() + Send + 'static) {
        Tx::after_commit(self, action);
    }
}

/// A dispatcher's settle transaction, which the crate commits: the follow-ups of the messages
/// it records delivered are handed over, or announced, once it has.
pub(crate) struct Settling<'a, DB: Database> {
    pub(crate) tx: &'a mut Transaction<'static, DB>,
    pub(crate) after_commit: &'a mut AfterCommit,
}

impl<DB: Backend> Target<DB> for Settling<'_, DB> {
    fn connection(&mut self) -> &mut DB::Connection {
        self.tx
    }

    fn commits_here(&self) -> bool {
        true
    }

    fn after_commit(&mut self, action: impl FnOnce() + Send + 'static) {
        self.after_commit.push(action);
    }
}

impl<DB: Backend> Target<DB> for &mut Transaction<'_, DB> {
    fn connection(&mut self) -> &mut DB::Connection {
        self
    }
}

impl<DB: Backend> Target<DB> for &mut sqlx::pool::PoolConnection<DB> {
    fn connection(&mut self) -> &mut DB::Connection {
        self
    }
}

#[cfg(feature = "sqlite")]
impl Target<sqlx::Sqlite> for &mut sqlx::SqliteConnection {
    fn connection(&mut self) -> &mut sqlx::SqliteConnection {
        self
    }
}

#[cfg(feature = "postgres")]
impl Target<sqlx::Postgres> for &mut sqlx::PgConnection {
    fn connection(&mut self) -> &mut sqlx::PgConnection {
        self
    }
}

#[cfg(feature = "mysql")]
impl Target<sqlx::MySql> for &mut sqlx::MySqlConnection {
    fn connection(&mut self) -> &mut sqlx::MySqlConnection {
        self
    }
}

/// Issues the outbox's `NOTIFY` in the enqueuing transaction, on a database that has one.
pub(crate) type Notify<DB> =
    for<'c> fn(
        &'c mut <DB as Database>::Connection,
    ) -> futures_util::future::BoxFuture<'c, Result<(), sqlx::Error>>;

#[cfg(feature = "postgres")]
pub(crate) use postgres::{Listen, pg_notify};
#[cfg(not(feature = "postgres"))]
pub(crate) use unlistened::Listen;

#[cfg(not(feature = "postgres"))]
mod unlistened {
    use std::time::Duration;

    /// Without PostgreSQL a dispatcher hears only its own process: there is nothing to listen
    /// with, as the `Infallible` says.
    #[derive(Debug, Clone, Default)]
    pub(crate) struct Listen(Option<std::convert::Infallible>);

    impl Listen {
        pub(crate) fn start(&self, _retry: Duration) -> Heard {
            match self.0 {
                Some(never) => match never {},
                None => Heard,
            }
        }
    }

    pub(crate) struct Heard;

    impl Heard {
        pub(crate) async fn notified(&self) {
            std::future::pending().await
        }
    }
}

#[cfg(feature = "postgres")]
mod postgres {
    use std::sync::Arc;
    use std::time::Duration;

    use futures_util::future::BoxFuture;
    use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
    use tokio::sync::Notify;
    use tokio::task::JoinHandle;

    use crate::backoff::Backoff;

    /// The channel of every outbox of a database. PostgreSQL's notifications are per database,
    /// not per schema: outboxes in other schemas of it wake these dispatchers for nothing, which
    /// costs them a claim that finds nothing.
    const CHANNEL: &str = "axum_idempotency_outbox";

    /// Notifies the outbox's channel. PostgreSQL delivers it only if the transaction commits,
    /// and folds the notifications of one transaction into one.
    pub(crate) fn pg_notify(
        conn: &mut sqlx::PgConnection,
    ) -> BoxFuture<'_, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::raw_sql("NOTIFY axum_idempotency_outbox")
                .execute(conn)
                .await
                .map(drop)
        })
    }

    /// What a dispatcher listens with, if it listens: the database to connect to.
    #[derive(Debug, Clone, Default)]
    pub(crate) struct Listen(Option<Arc<PgConnectOptions>>);

    impl Listen {
        pub(crate) fn postgres(options: Arc<PgConnectOptions>) -> Self {
            Self(Some(options))
        }

        /// Starts listening, in a task that ends with the returned handle; after an error it
        /// connects again after `retry`, the dispatcher polling meanwhile.
        pub(crate) fn start(&self, retry: Duration) -> Heard {
            let Some(options) = self.0.clone() else {
                return Heard(None);
            };
            let heard = Arc::new(Notify::new());
            let task = tokio::spawn(listen(options, heard.clone(), retry));
            Heard(Some((heard, task)))
        }
    }

    /// The notifications a dispatcher hears, while it runs.
    pub(crate) struct Heard(Option<(Arc<Notify>, JoinHandle<()>)>);

    impl Heard {
        /// Returns once a notification came since the last call; never without a listener.
        pub(crate) async fn notified(&self) {
            match &self.0 {
                Some((heard, _)) => heard.notified().await,
                None => std::future::pending().await,
            }
        }
    }

    impl Drop for Heard {
        fn drop(&mut self) {
            if let Some((_, task)) = &self.0 {
                task.abort();
            }
        }
    }

    /// Listens on a connection of its own, so the app's pool loses none to it, and tells
    /// `heard` of every notification; never returns.
    async fn listen(options: Arc<PgConnectOptions>, heard: Arc<Notify>, retry: Duration) {
        // One connection, held as long as it lives: a listener that lets go of it misses what
        // is notified meanwhile.
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .max_lifetime(None)
            .idle_timeout(None)
            .connect_lazy_with((*options).clone());
        let backoff = Backoff::exponential(Duration::from_millis(100), retry.max(RETRY_FLOOR));
        let mut failures = 0;
        loop {
            let error = match subscribe(&pool).await {
                Ok(mut listener) => {
                    failures = 0;
                    // What was committed while nobody listened is found by this claim.
                    heard.notify_one();
                    loop {
                        match listener.try_recv().await {
                            Ok(Some(_)) => heard.notify_one(),
                            // Connected again at once; what was notified in between is lost.
                            Ok(None) => heard.notify_one(),
                            Err(error) => break error,
                        }
                    }
                }
                Err(error) => error,
            };
            failures += 1;
            tracing::warn!(%error,
                "the outbox dispatcher's LISTEN connection failed; polling until it is back");
            tokio::time::sleep(backoff.delay(failures)).await;
        }
    }

    async fn subscribe(pool: &sqlx::PgPool) -> Result<PgListener, sqlx::Error> {
        let mut listener = PgListener::connect_with(pool).await?;
        listener.listen(CHANNEL).await?;
        Ok(listener)
    }

    /// The shortest wait between two attempts to listen again.
    const RETRY_FLOOR: Duration = Duration::from_secs(1);
}
