//! Transactional outbox: external side effects that happen once, after the commit, with a
//! stable downstream idempotency key.
//!
//! A handler that calls a payment provider directly charges twice when its transaction fails to
//! commit after the call, or when the client's retry runs the handler again. The database can
//! only protect its own writes, so the call becomes a write: [`Outbox::enqueue`] stores the
//! message in the handler's own transaction, next to the business rows and the idempotency
//! claim. A rolled-back request leaves no message; a committed one leaves exactly one, however
//! often the client retries (the retry replays the stored response and enqueues nothing).
//!
//! A [`Dispatcher`] — a task you spawn, as many as you like — then delivers committed messages
//! through your [`Sender`] and records each outcome in the message's [`OutboxRecord`]:
//!
//! - **delivered**, with what the downstream answered (a charge id);
//! - **retry later**, with exponential backoff and full jitter, never before a `Retry-After`;
//! - **unknown** (timeout, reset, a dispatcher that died mid-send): before resending, the
//!   dispatcher asks the sender to [look the message up](Sender::lookup) — found means
//!   delivered; not found within the lookup grace means wait, the first attempt may still be
//!   running; not found after it means resend;
//! - **failed** for good after a refusal or `max_attempts` attempts.
//!
//! Nothing is dropped silently: the app reads the outcome with [`Outbox::status`] or
//! [`Outbox::status_by_key`].
//!
//! # What it guarantees
//!
//! Delivery is **at least once**, and every attempt of a message carries the same
//! [`DownstreamKey`], derived from the request's scoped idempotency key. Where the downstream
//! deduplicates by that key (as payment providers do with `Idempotency-Key`), the effect happens
//! **exactly once**. Where it does not, a lookup by key before each resend closes the gap.
//!
//! # Example
//!
//! ```no_run
//! use axum_idempotency::outbox::{
//!     Dispatcher, DownstreamKey, Message, Outbox, OutboxRecord, SendOutcome, Sender,
//! };
//! use sqlx::SqlitePool;
//!
//! struct Provider;
//!
//! impl Sender for Provider {
//!     async fn send(&self, message: &OutboxRecord) -> SendOutcome {
//!         // POST message.payload with `Idempotency-Key: {message.downstream_key}` …
//!         SendOutcome::Delivered { receipt: "ch_123".into() }
//!     }
//! }
//!
//! # async fn run(scoped_key_digest: &str) -> Result<(), Box<dyn std::error::Error>> {
//! let pool = SqlitePool::connect("sqlite:payments.db?mode=rwc").await?;
//! let outbox = Outbox::new(pool.clone());
//! outbox.migrate().await?;
//! tokio::spawn(Dispatcher::new(outbox.clone(), Provider).run(std::future::pending()));
//!
//! // A transaction of your own here; in a handler, the request's `Tx` (`&mut tx`), whose
//! // commit wakes the dispatchers by itself.
//! let mut tx = pool.begin().await?;
//! let key = DownstreamKey::for_request(scoped_key_digest, "charges", "charge");
//! let charge = serde_json::json!({ "amount": "12.50", "currency": "EUR" });
//! let id = outbox.enqueue(&mut tx, Message::json("charges", key, &charge)?).await?;
//! tx.commit().await?;
//! outbox.wake();
//! # Ok(()) }
//! ```
//!
//! # Waking the dispatchers
//!
//! A dispatcher sleeps [`poll_interval`](Dispatcher::poll_interval) when nothing is due, but a
//! commit that enqueued wakes the dispatchers of its outbox (and its clones) in its process at
//! once, with no code of yours: a message enqueued on the handler's [`Tx`](crate::Tx) is
//! announced by whatever commits that transaction (the layer, [`Engine::run`](crate::Engine::run),
//! the inbox), only after the commit succeeded. On a transaction of your own, call
//! [`Outbox::wake`] after its commit (see [`EnqueueTarget`]). Dispatchers in other processes
//! find the message at their next poll; on PostgreSQL, `Outbox::notify_on_commit` and
//! `Dispatcher::listen` wake them too, through `LISTEN/NOTIFY`, unless a transaction-mode
//! pooler sits between them and the database.
//!
//! For an HTTP API that deduplicates by `Idempotency-Key` (most payment providers do),
//! [`HttpSender`] is that sender, with an optional lookup by key.
//!
//! # Brokers
//!
//! With the `rabbitmq` or `nats` feature, `RabbitMqSender` and `NatsSender` publish messages
//! to a broker (an event per committed business change), the downstream key as the broker's
//! message id (`message_id`, `Nats-Msg-Id`); the `inbox` module is their consumer side.
//!
//! # Operators
//!
//! [`Outbox::requeue`] puts a failed message back once its cause is fixed, and
//! [`Outbox::purge_delivered`] deletes delivered rows past a retention in bounded batches.
//!
//! # Backends
//!
//! SQLite, PostgreSQL and MySQL/MariaDB (10.6+), each behind its cargo feature, share one table
//! layout (`idempotency_outbox`), created and upgraded by [`Outbox::migrate`], which records the
//! applied versions in `idempotency_outbox_schema_versions`; the SQL it runs ships under
//! `migrations/<backend>/outbox/` for teams that prefer their own migration tool. PostgreSQL and
//! MySQL claim with `FOR UPDATE SKIP LOCKED`, so dispatchers on many hosts never pick the same
//! message; SQLite's single writer gives the same guarantee. Timestamps come from the clock of
//! the process writing them; dispatchers on several hosts assume clocks kept in sync.

mod backend;
#[cfg(any(feature = "rabbitmq", feature = "nats"))]
mod broker;
mod dispatcher;
mod error;
mod http;
mod message;
mod sender;
mod status;
mod store;
mod wake;

pub use crate::backoff::Backoff;
pub(crate) use backend::Ops;
#[cfg(feature = "nats")]
pub use broker::NatsSender;
#[cfg(feature = "rabbitmq")]
pub use broker::RabbitMqSender;
pub use dispatcher::{DispatchWaker, Dispatcher};
pub use error::Error;
pub use http::HttpSender;
pub use message::{DownstreamKey, InvalidDownstreamKey, Message};
pub use sender::{LookupOutcome, SendOutcome, Sender};
pub use status::{MessageId, OutboxRecord, Status};
pub use store::Outbox;
pub use wake::EnqueueTarget;
