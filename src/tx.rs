//! The request's transaction, as an extractor.
//!
//! Under [`IdempotencyLayer`](crate::IdempotencyLayer) a keyed request runs inside one
//! database transaction that already holds the claim on its key. A handler reaches that
//! transaction by taking a [`Tx`] argument; whatever it writes through it commits together with
//! the stored response, or rolls back together with the claim.
//!
#![cfg_attr(feature = "sqlite", doc = "```")]
#![cfg_attr(not(feature = "sqlite"), doc = "```ignore")]
//! use axum::{Json, http::StatusCode};
//! use axum_idempotency::{Tx, TxError};
//! use sqlx::Sqlite;
//!
//! async fn create_order(mut tx: Tx<Sqlite>, Json(sku): Json<String>) -> Result<StatusCode, TxError> {
//!     sqlx::query("INSERT INTO orders (sku) VALUES (?)")
//!         .bind(sku)
//!         .execute(&mut tx)
//!         .await?;
//!     Ok(StatusCode::CREATED)
//! }
//! ```
//!
//! # Conflicts are run again
//!
//! Under concurrency a database may abort a transaction to resolve a conflict with another: a
//! serialization failure (PostgreSQL at `SERIALIZABLE` or `REPEATABLE READ`, distributed SQL),
//! a deadlock, a Galera certification conflict. Nothing of such an attempt stands, so the layer
//! rolls it back and runs the request again with the same buffered request, a bounded number of
//! times with jittered pauses, within its deadline; if a duplicate committed meanwhile, the
//! re-run replays its answer. A conflict at `COMMIT` is run again the same way. The client
//! never sees the abort; only when the attempts run out does it get a retryable
//! `503 idempotency_conflict`.
//!
//! For a conflict in one of the handler's own statements to be run again, the layer must learn
//! of it: return the statement's error as a [`TxError`], which `?` converts from any
//! `sqlx::Error`, as above. An application error type of your own keeps this by holding a
//! `TxError` and answering with its response:
//!
//! ```
//! use axum::response::{IntoResponse, Response};
//! use axum_idempotency::TxError;
//!
//! enum AppError {
//!     OutOfStock,
//!     Database(TxError),
//! }
//!
//! impl From<sqlx::Error> for AppError {
//!     fn from(error: sqlx::Error) -> Self {
//!         Self::Database(error.into())
//!     }
//! }
//!
//! impl IntoResponse for AppError {
//!     fn into_response(self) -> Response {
//!         match self {
//!             Self::OutOfStock => (axum::http::StatusCode::CONFLICT, "out of stock").into_response(),
//!             Self::Database(error) => error.into_response(),
//!         }
//!     }
//! }
//! ```
//!
//! Any other database error answers a retryable `500 idempotency_internal_error`, its details
//! logged and never shown to the client.
//!
//! `Tx` has no `commit`: the layer resolves the transaction after the handler, because the
//! response record must be written into it first. Requests that carry no key (a `GET`, say)
//! get a transaction too, begun lazily when a handler first asks for it, committed after a
//! 2xx/3xx response and rolled back otherwise.
//!
//! Keep a `Tx` inside the handler. One still held elsewhere when the handler returns (moved into
//! a spawned task, say) cannot be committed; the layer then rolls the attempt back and answers
//! 500 `idempotency_transaction_held`, rather than skipping the commit in silence.
//!
//! # Two databases of one driver
//!
//! A `Tx<Sqlite>` is taken from the innermost SQLite layer around the route. Where two layers
//! of one driver wrap a route, on two pools (two databases, two schemas), give each a marker
//! type of your own with [`IdempotencyLayer::tx_marker`](crate::IdempotencyLayer::tx_marker)
//! and name it in the handler's `Tx`: `Tx<Sqlite, Ledger>` is the transaction of the layer
//! marked `Ledger`, whatever else wraps the route. A marker that no layer around the route
//! has answers 500 `idempotency_layer_missing`, naming the marker.
//!
#![cfg_attr(feature = "sqlite", doc = "```")]
#![cfg_attr(not(feature = "sqlite"), doc = "```ignore")]
//! use axum::{Router, http::StatusCode, routing::post};
//! use axum_idempotency::{IdempotencyLayer, SqliteStore, Tx, TxError};
//! use sqlx::{Sqlite, SqlitePool};
//!
//! /// The ledger's database.
//! struct Ledger;
//! /// The audit trail's database.
//! struct Audit;
//!
//! async fn transfer(
//!     mut ledger: Tx<Sqlite, Ledger>,
//!     mut audit: Tx<Sqlite, Audit>,
//! ) -> Result<StatusCode, TxError> {
//!     sqlx::query("INSERT INTO entries (cents) VALUES (1250)").execute(&mut ledger).await?;
//!     sqlx::query("INSERT INTO events (what) VALUES ('transfer')").execute(&mut audit).await?;
//!     Ok(StatusCode::CREATED)
//! }
//!
//! # async fn run() -> Result<(), sqlx::Error> {
//! let ledger = SqliteStore::new(SqlitePool::connect("sqlite://ledger.db").await?);
//! let audit = SqliteStore::new(SqlitePool::connect("sqlite://audit.db").await?);
//! let app: Router = Router::new()
//!     .route("/transfers", post(transfer))
//!     .route_layer(IdempotencyLayer::new(ledger).tx_marker::<Ledger>().allow_anonymous())
//!     .route_layer(IdempotencyLayer::new(audit).tx_marker::<Audit>().allow_anonymous());
//! # let _ = app; Ok(()) }
//! ```
//!
//! Each layer claims the key in its own database and commits on its own: the two commits are
//! not one atomic step. The marker only chooses the transaction; jobs and inbox handlers get
//! the engine's own `Tx<DB>`, unmarked.

use std::any::TypeId;
use std::fmt;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use axum::extract::FromRequestParts;
use axum::response::{IntoResponse, Response};
use http::request::Parts;
use sqlx::{Database, Pool, Transaction};

use crate::Backend;
use crate::error::Rejection;
use crate::store::{is_conflict_abort, is_unreachable};

/// A handle on the request's database transaction (see the [module docs](crate::tx)).
///
/// Used like a `sqlx::Transaction`: `query.execute(&mut tx)` (or `&mut *tx`, the connection it
/// dereferences to).
///
/// `M` is the marker of the layer it comes from, for a route under two layers of one driver
/// (see [two databases of one driver](crate::tx#two-databases-of-one-driver)); unmarked layers
/// and the engine give `Tx<DB>`.
pub struct Tx<DB: Backend, M = ()> {
    slot: TxSlot<DB>,
    // Always `Some` until `Drop` hands the transaction back to the slot.
    tx: Option<Transaction<'static, DB>>,
    // `fn() -> M`: a marker is a name, so `Tx` is `Send` and `Sync` whatever `M` is.
    marker: PhantomData<fn() -> M>,
}

impl<DB: Backend, M> Tx<DB, M> {
    pub(crate) fn take(slot: TxSlot<DB>, tx: Transaction<'static, DB>) -> Self {
        Self {
            slot,
            tx: Some(tx),
            marker: PhantomData,
        }
    }

    /// Runs `action` once this transaction has committed, never before and never after a
    /// rollback: what was written becomes visible to others only at the commit, so anything
    /// that tells them to look (the outbox waking its dispatchers) must wait for it.
    #[cfg_attr(not(feature = "outbox"), allow(dead_code))]
    pub(crate) fn after_commit(&mut self, action: impl FnOnce() + Send + 'static) {
        self.slot.after_commit(action);
    }

    fn transaction(&self) -> &Transaction<'static, DB> {
        self.tx
            .as_ref()
            .expect("Tx holds its transaction until dropped")
    }

    fn transaction_mut(&mut self) -> &mut Transaction<'static, DB> {
        self.tx
            .as_mut()
            .expect("Tx holds its transaction until dropped")
    }
}

impl<DB: Backend, M> Deref for Tx<DB, M> {
    type Target = DB::Connection;

    fn deref(&self) -> &Self::Target {
        self.transaction()
    }
}

impl<DB: Backend, M> DerefMut for Tx<DB, M> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.transaction_mut()
    }
}

/// `&mut tx` runs statements in the transaction, like `&mut *tx`: one impl per database, as
/// sqlx's own `Transaction` has, since a generic one sends the trait solver in circles through
/// the crate's generic store code.
macro_rules! executor_for_tx {
    ($feature:literal, $db:ty) => {
        #[cfg(feature = $feature)]
        impl<'c, M> sqlx::Executor<'c> for &'c mut Tx<$db, M> {
            type Database = $db;

            fn fetch_many<'e, 'q: 'e, E>(
                self,
                query: E,
            ) -> futures_core::stream::BoxStream<
                'e,
                Result<
                    sqlx::Either<
                        <$db as sqlx::Database>::QueryResult,
                        <$db as sqlx::Database>::Row,
                    >,
                    sqlx::Error,
                >,
            >
            where
                'c: 'e,
                E: 'q + sqlx::Execute<'q, $db>,
            {
                (&mut **self).fetch_many(query)
            }

            fn fetch_optional<'e, 'q: 'e, E>(
                self,
                query: E,
            ) -> futures_core::future::BoxFuture<
                'e,
                Result<Option<<$db as sqlx::Database>::Row>, sqlx::Error>,
            >
            where
                'c: 'e,
                E: 'q + sqlx::Execute<'q, $db>,
            {
                (&mut **self).fetch_optional(query)
            }

            fn prepare_with<'e>(
                self,
                sql: sqlx::SqlStr,
                parameters: &'e [<$db as sqlx::Database>::TypeInfo],
            ) -> futures_core::future::BoxFuture<
                'e,
                Result<<$db as sqlx::Database>::Statement, sqlx::Error>,
            >
            where
                'c: 'e,
            {
                (&mut **self).prepare_with(sql, parameters)
            }

            fn describe<'e>(
                self,
                sql: sqlx::SqlStr,
            ) -> futures_core::future::BoxFuture<'e, Result<sqlx::Describe<$db>, sqlx::Error>>
            where
                'c: 'e,
            {
                (&mut **self).describe(sql)
            }
        }
    };
}

executor_for_tx!("sqlite", sqlx::Sqlite);
executor_for_tx!("postgres", sqlx::Postgres);
executor_for_tx!("mysql", sqlx::MySql);

impl<DB: Backend, M> Drop for Tx<DB, M> {
    fn drop(&mut self) {
        if let Some(tx) = self.tx.take() {
            *self.slot.lock() = SlotState::Ready(tx);
        }
    }
}

impl<DB: Backend, M> fmt::Debug for Tx<DB, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tx")
            .field("database", &DB::NAME)
            .field("marker", &std::any::type_name::<M>())
            .finish()
    }
}

impl<DB: Backend, M: 'static, S: Send + Sync> FromRequestParts<S> for Tx<DB, M> {
    type Rejection = Rejection;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let marker = Marker::of::<M>();
        let found = parts
            .extensions
            .get::<TxSlots<DB>>()
            .and_then(|slots| slots.find(marker));
        let Some(slot) = found else {
            let missing = Rejection::LayerMissing {
                database: DB::NAME,
                marker: marker.name(),
            };
            tracing::error!("{missing}");
            return Err(missing);
        };
        let state = std::mem::replace(&mut *slot.lock(), SlotState::Taken);
        match state {
            SlotState::Ready(tx) => Ok(Tx::take(slot, tx)),
            SlotState::Lazy(pool) => match pool.begin().await {
                Ok(tx) => Ok(Tx::take(slot, tx)),
                Err(error) => {
                    *slot.lock() = SlotState::Lazy(pool);
                    tracing::error!(%error, "could not begin the request's transaction");
                    Err(Rejection::Internal)
                }
            },
            SlotState::Taken => {
                tracing::error!("a second Tx was extracted while the first is still held");
                Err(Rejection::TransactionHeld)
            }
        }
    }
}

/// A statement of the request's transaction failed: the handler's error for database work
/// through [`Tx`] (see the [module docs](crate::tx#conflicts-are-run-again)). `?` converts any
/// `sqlx::Error` into it, and, with the `outbox` feature, any error of `Outbox::enqueue`.
///
/// As a response, a conflict abort tells the layer to run the request again (the client never
/// sees it); a downstream key already enqueued for another intent is the final `422
/// idempotency_key_reused`; any other error is a retryable `500 idempotency_internal_error`,
/// logged with its details, which never reach the client.
#[derive(Debug)]
pub struct TxError(Cause);

#[derive(Debug)]
enum Cause {
    Database(sqlx::Error),
    /// An outbox error other than a database one.
    #[cfg(feature = "outbox")]
    Outbox(crate::outbox::Error),
}

impl TxError {
    /// Whether the database aborted the transaction to resolve a conflict with a concurrent
    /// one (a serialization failure, a deadlock, a certification conflict): the request is run
    /// again.
    pub fn is_conflict(&self) -> bool {
        self.database_error().is_some_and(is_conflict_abort)
    }

    /// Whether the statement failed because the database could not be reached (a broken or
    /// refused connection, a pool that gave none in time): an outage, not the work's fault.
    #[cfg_attr(not(feature = "inbox"), allow(dead_code))]
    pub(crate) fn is_unreachable(&self) -> bool {
        self.database_error().is_some_and(is_unreachable)
    }

    /// The database's error, when the database failed the statement.
    pub fn database_error(&self) -> Option<&sqlx::Error> {
        match &self.0 {
            Cause::Database(error) => Some(error),
            #[cfg(feature = "outbox")]
            Cause::Outbox(_) => None,
        }
    }
}

impl From<sqlx::Error> for TxError {
    fn from(error: sqlx::Error) -> Self {
        Self(Cause::Database(error))
    }
}

#[cfg(feature = "outbox")]
impl From<crate::outbox::Error> for TxError {
    fn from(error: crate::outbox::Error) -> Self {
        match error {
            crate::outbox::Error::Database(error) => Self(Cause::Database(error)),
            other => Self(Cause::Outbox(other)),
        }
    }
}

impl fmt::Display for TxError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Cause::Database(error) => {
                write!(
                    f,
                    "a statement of the request's transaction failed: {error}"
                )
            }
            #[cfg(feature = "outbox")]
            Cause::Outbox(error) => write!(f, "enqueueing in the outbox failed: {error}"),
        }
    }
}

impl std::error::Error for TxError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.0 {
            Cause::Database(error) => Some(error),
            #[cfg(feature = "outbox")]
            Cause::Outbox(error) => Some(error),
        }
    }
}

impl IntoResponse for TxError {
    fn into_response(self) -> Response {
        if self.is_conflict() {
            tracing::debug!(error = %self, "the transaction was aborted on a conflict");
            return conflict_aborted();
        }
        // The key's record expired and the key came back with another intent: the downstream
        // key it was given is taken, so a retry can never succeed.
        #[cfg(feature = "outbox")]
        if let Cause::Outbox(crate::outbox::Error::KeyReused(key)) = &self.0 {
            tracing::warn!(%key, "the downstream key is already enqueued for another intent");
            return Rejection::KeyReused.into_response();
        }
        tracing::error!(error = %self, "a statement of the request's transaction failed");
        Rejection::Internal.into_response()
    }
}

/// Marks a response whose transaction the database aborted on a conflict.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ConflictAborted;

/// The answer of work whose transaction the database aborted on a conflict: marked so the
/// engine runs it again; should it reach a client anyway (a route without the layer), it says
/// what happened.
pub(crate) fn conflict_aborted() -> Response {
    let mut response = Rejection::Conflict.into_response();
    response.extensions_mut().insert(ConflictAborted);
    response
}

/// The request extension a [`Tx`] is taken from and handed back to, with what is to run once
/// its transaction has committed.
pub(crate) struct TxSlot<DB: Database>(Arc<Shared<DB>>);

struct Shared<DB: Database> {
    state: Mutex<SlotState<DB>>,
    after_commit: Mutex<AfterCommit>,
}

/// What to run once a transaction has committed; dropped unrun when it rolls back.
#[derive(Default)]
pub(crate) struct AfterCommit(Vec<Box<dyn FnOnce() + Send>>);

impl AfterCommit {
    /// Adds `action` to run after the commit, after those added before it.
    pub(crate) fn push(&mut self, action: impl FnOnce() + Send + 'static) {
        self.0.push(Box::new(action));
    }

    /// Adds the actions of `later` after these.
    #[cfg_attr(not(feature = "inbox"), allow(dead_code))]
    pub(crate) fn append(&mut self, mut later: AfterCommit) {
        self.0.append(&mut later.0);
    }

    /// Runs the actions, in the order they were registered. Call it only after a commit that
    /// succeeded.
    pub(crate) fn run(self) {
        for action in self.0 {
            action();
        }
    }
}

enum SlotState<DB: Database> {
    /// Not begun yet: a request without a key, whose handler may never need it.
    Lazy(Pool<DB>),
    Ready(Transaction<'static, DB>),
    /// Out in a `Tx`.
    Taken,
}

/// A `Tx` was still held when the transaction had to be resolved.
#[derive(Debug)]
pub(crate) struct StillHeld;

impl<DB: Database> TxSlot<DB> {
    pub(crate) fn ready(tx: Transaction<'static, DB>) -> Self {
        Self::with(SlotState::Ready(tx))
    }

    pub(crate) fn lazy(pool: Pool<DB>) -> Self {
        Self::with(SlotState::Lazy(pool))
    }

    fn with(state: SlotState<DB>) -> Self {
        Self(Arc::new(Shared {
            state: Mutex::new(state),
            after_commit: Mutex::new(AfterCommit::default()),
        }))
    }

    /// What the work asked to run after the commit; the caller runs it once its commit
    /// succeeded, and drops it otherwise.
    pub(crate) fn take_after_commit(&self) -> AfterCommit {
        std::mem::take(&mut *relock(&self.0.after_commit))
    }

    fn after_commit(&self, action: impl FnOnce() + Send + 'static) {
        relock(&self.0.after_commit).push(action);
    }

    /// Takes the transaction back for resolution; `None` if it was never begun.
    pub(crate) fn take_back(&self) -> Result<Option<Transaction<'static, DB>>, StillHeld> {
        match std::mem::replace(&mut *self.lock(), SlotState::Taken) {
            SlotState::Ready(tx) => Ok(Some(tx)),
            SlotState::Lazy(_) => Ok(None),
            SlotState::Taken => Err(StillHeld),
        }
    }

    /// Hands the transaction out as a `Tx`, for jobs that call the engine directly.
    pub(crate) fn into_tx(self) -> Result<Tx<DB>, StillHeld>
    where
        DB: Backend,
    {
        let state = std::mem::replace(&mut *self.lock(), SlotState::Taken);
        match state {
            SlotState::Ready(tx) => Ok(Tx::take(self, tx)),
            other => {
                *self.lock() = other;
                Err(StillHeld)
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, SlotState<DB>> {
        relock(&self.0.state)
    }
}

/// Locks `mutex`, poisoned or not: a panic while either lock of a slot was held cannot leave
/// its value half-written (every change is one assignment or one push), so it is still sound.
fn relock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl<DB: Database> Clone for TxSlot<DB> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

/// The marker type a layer hands its transaction out under: `()` unless set with
/// [`IdempotencyLayer::tx_marker`](crate::IdempotencyLayer::tx_marker).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct Marker {
    id: TypeId,
    name: &'static str,
}

impl Marker {
    pub(crate) fn of<M: ?Sized + 'static>() -> Self {
        Self {
            id: TypeId::of::<M>(),
            name: std::any::type_name::<M>(),
        }
    }

    /// The marker's type name; `None` for the unmarked `()`.
    fn name(self) -> Option<&'static str> {
        (self != Self::of::<()>()).then_some(self.name)
    }
}

impl Default for Marker {
    fn default() -> Self {
        Self::of::<()>()
    }
}

impl fmt::Debug for Marker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

/// The request extension the layers around a route leave their transactions in, one per
/// marker: a route under two layers of one driver finds each layer's own.
pub(crate) struct TxSlots<DB: Database>(Vec<(Marker, TxSlot<DB>)>);

impl<DB: Database> TxSlots<DB> {
    /// Leaves `slot` in `extensions` under `marker`, in place of what an outer layer with the
    /// same marker left there: the innermost layer's transaction is the handler's.
    pub(crate) fn hand_over(extensions: &mut http::Extensions, marker: Marker, slot: TxSlot<DB>) {
        let slots = extensions.get_or_insert_with(|| Self(Vec::new()));
        slots.0.retain(|(held, _)| *held != marker);
        slots.0.push((marker, slot));
    }

    fn find(&self, marker: Marker) -> Option<TxSlot<DB>> {
        self.0
            .iter()
            .find(|(held, _)| *held == marker)
            .map(|(_, slot)| slot.clone())
    }
}

impl<DB: Database> Clone for TxSlots<DB> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}
