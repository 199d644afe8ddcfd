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
//! use axum_idempotency::Tx;
//! use sqlx::Sqlite;
//!
//! async fn create_order(mut tx: Tx<Sqlite>, Json(sku): Json<String>) -> Result<StatusCode, StatusCode> {
//!     sqlx::query("INSERT INTO orders (sku) VALUES (?)")
//!         .bind(sku)
//!         .execute(&mut *tx)
//!         .await
//!         .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
//!     Ok(StatusCode::CREATED)
//! }
//! ```
//!
//! `Tx` has no `commit`: the layer resolves the transaction after the handler, because the
//! response record must be written into it first. Requests that carry no key (a `GET`, say)
//! get a transaction too, begun lazily when a handler first asks for it, committed after a
//! 2xx/3xx response and rolled back otherwise.
//!
//! Keep a `Tx` inside the handler. One still held elsewhere when the handler returns (moved into
//! a spawned task, say) cannot be committed; the layer then rolls the attempt back and answers
//! 500 `idempotency_transaction_held`, rather than skipping the commit in silence.

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use axum::extract::FromRequestParts;
use http::request::Parts;
use sqlx::{Database, Pool, Transaction};

use crate::error::Rejection;

/// A handle on the request's database transaction (see the [module docs](crate::tx)).
///
/// Dereferences to the database connection, so it is used exactly like a
/// `sqlx::Transaction`: `query.execute(&mut *tx)`.
pub struct Tx<DB: Database> {
    slot: TxSlot<DB>,
    // Always `Some` until `Drop` hands the transaction back to the slot.
    tx: Option<Transaction<'static, DB>>,
}

impl<DB: Database> Tx<DB> {
    pub(crate) fn take(slot: TxSlot<DB>, tx: Transaction<'static, DB>) -> Self {
        Self { slot, tx: Some(tx) }
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

impl<DB: Database> Deref for Tx<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &Self::Target {
        self.transaction()
    }
}

impl<DB: Database> DerefMut for Tx<DB> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.transaction_mut()
    }
}

impl<DB: Database> Drop for Tx<DB> {
    fn drop(&mut self) {
        if let Some(tx) = self.tx.take() {
            *self.slot.lock() = SlotState::Ready(tx);
        }
    }
}

impl<DB: Database> fmt::Debug for Tx<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tx").field("database", &DB::NAME).finish()
    }
}

impl<DB: Database, S: Send + Sync> FromRequestParts<S> for Tx<DB> {
    type Rejection = Rejection;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let Some(slot) = parts.extensions.get::<TxSlot<DB>>().cloned() else {
            tracing::error!(
                "Tx<{}> extracted on a route without IdempotencyLayer for that database",
                DB::NAME
            );
            return Err(Rejection::Internal);
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

/// The request extension a [`Tx`] is taken from and handed back to.
pub(crate) struct TxSlot<DB: Database>(Arc<Mutex<SlotState<DB>>>);

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
        Self(Arc::new(Mutex::new(SlotState::Ready(tx))))
    }

    pub(crate) fn lazy(pool: Pool<DB>) -> Self {
        Self(Arc::new(Mutex::new(SlotState::Lazy(pool))))
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
    pub(crate) fn into_tx(self) -> Result<Tx<DB>, StillHeld> {
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
        // A panic while the lock was held cannot leave the state half-written (every change is
        // one assignment), so a poisoned lock is still sound to use.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<DB: Database> Clone for TxSlot<DB> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}
