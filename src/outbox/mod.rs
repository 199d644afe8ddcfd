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
//! - **delivered**, with what the downstream answered (a charge id), and in the same
//!   transaction the messages the delivery leads to, if the sender names any
//!   ([`Sender::follow_ups`]: the event that announces a charge);
//! - **unavailable**: the destination is out of reach or says so (refused, `503`, `429`, a
//!   broker connection down). An outage is not an attempt: the message's topic is paused and
//!   probed with one message at a time until it answers, then resumes at full speed;
//! - **retry later**, with exponential backoff and full jitter, never before a `Retry-After`;
//! - **unknown** (timeout, reset, a dispatcher that died mid-send): before resending, the
//!   dispatcher asks the sender to [look the message up](Sender::lookup) — found means
//!   delivered; not found within the lookup grace means wait, the first attempt may still be
//!   running; not found after it means resend;
//! - **failed** for good after a refusal, `max_attempts` attempts, or past its time budget
//!   ([`Dispatcher::give_up_after`], 6 hours by default), which must stay shorter than the
//!   downstream's key retention. Each is logged at `ERROR` with its reason.
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
//! # async fn run(scoped_key: axum_idempotency::ScopedKey) -> Result<(), Box<dyn std::error::Error>> {
//! let pool = SqlitePool::connect("sqlite:payments.db?mode=rwc").await?;
//! let outbox = Outbox::new(pool.clone());
//! outbox.migrate().await?;
//! tokio::spawn(Dispatcher::new(outbox.clone(), Provider).run(std::future::pending()));
//!
//! // A transaction of your own here; in a handler, the request's `Tx` (`&mut tx`), whose
//! // commit hands the message to a dispatcher by itself.
//! let mut tx = pool.begin().await?;
//! let key = DownstreamKey::for_request(scoped_key, "charges", "charge");
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
//! commit that enqueued reaches the dispatchers of its outbox (and its clones) in its process at
//! once, with no code of yours: a message enqueued on the handler's [`Tx`](crate::Tx) is
//! announced by whatever commits that transaction (the layer, [`Engine::run`](crate::Engine::run),
//! the inbox), only after the commit succeeded.
//!
//! Where a running dispatcher of the process has room (a batch of messages it has not started
//! yet), the message is not even announced: the insert writes it leased to that dispatcher,
//! its first attempt begun, as the dispatcher's claim would have, and the commit hands the
//! message itself over, to be sent at once. No claim runs for it: no round trip between the
//! commit and the send, and one write less per message. The lease protects it as a claim's
//! would: should that dispatcher die first, another one takes the message once the lease
//! ([`Dispatcher::lease`], 15 s by default) has run out, and looks it up before any resend.
//! Messages with an [ordering key](Message::ordering_key) are always claimed, since only a
//! claim checks their key's order; so are those of a paused destination, which the
//! dispatcher writes back untouched.
//!
//! On a transaction of your own, call
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
//! # Order per key
//!
//! By default messages go out concurrently, in no particular order: two events about one
//! order ("paid", then "refunded") may arrive either way round. Give them the same
//! [`Message::ordering_key`] (the order id) and they are delivered in commit order, one at a
//! time:
//!
//! - **Order.** Messages with one ordering key are sent in the order of their ids, and a
//!   message is first sent only once every earlier message of its key is delivered (or
//!   skipped). Ids follow commit order within a key: enqueuing a keyed message holds the key
//!   until the enqueuing transaction ends (PostgreSQL: a transaction-scoped advisory lock on
//!   the key's hash; MySQL/MariaDB: a row per key in `idempotency_outbox_order_locks`, locked
//!   for the transaction; SQLite: its single writer), so a second transaction enqueuing for
//!   the key waits for the first to commit or roll back. Enqueue inside a transaction, as a
//!   handler does: on a connection in autocommit mode the lock ends with its own statement.
//!   Keys are compared byte for byte and span topics; order between keys is not kept.
//! - **One in flight per key**, across all dispatchers: a claim only takes a keyed message
//!   when no earlier message of its key is pending (due, waiting for a retry, or in flight) or
//!   failed. Messages without a key, and other keys, keep their concurrency.
//! - **A retry holds back only its own key**: a message that waits for its retry, a lookup or
//!   a paused destination keeps the later messages of its key waiting, and nothing else.
//! - **A message that failed for good holds its key** until an operator decides:
//!   [`Outbox::requeue`] sends it again (first), [`Outbox::skip`] sets it aside as
//!   [`Status::Skipped`] so the next one goes. [`Outbox::blocked_by`] names the message a
//!   pending one waits behind, and [`OutboxRecord::ordering_key`] shows the key. Alert on
//!   failed messages: the dispatcher logs each at `ERROR`.
//!
//! What the downstream sees is at-least-once, as always: the first delivery of each message
//! comes in order, but a resend after an unknown outcome, or a send that a dispatcher kept
//! running after it lost its lease (stalled longer than [`Dispatcher::lease`]), may arrive
//! again later, after a later message of its key. It carries its own downstream key, so a
//! deduplicating consumer drops it. Messages waiting behind a failed one stay due, and every
//! claim passes over them: do not leave a busy key blocked for long.
//!
//! # Operators
//!
//! [`Outbox::requeue`] puts a failed message back once its cause is fixed, [`Outbox::skip`]
//! sets it aside so the later messages of its ordering key go on, and
//! [`Outbox::purge_expired`] (or [`Outbox::spawn_purger`]) deletes delivered and skipped rows
//! past the outbox's [retention](Outbox::retention) in bounded batches.
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

#[cfg(any(feature = "rabbitmq", feature = "nats"))]
mod broker;
pub(crate) mod dispatcher;
mod error;
mod handoff;
mod http;
mod sender;
mod store;
mod wake;

pub use crate::backoff::Backoff;
pub use crate::message::{
    DownstreamKey, InvalidDownstreamKey, Message, MessageId, OutboxRecord, Status,
};
#[cfg(feature = "nats")]
pub use broker::NatsSender;
#[cfg(feature = "rabbitmq")]
pub use broker::RabbitMqSender;
pub use dispatcher::Dispatcher;
pub use error::Error;
pub use http::HttpSender;
pub use sender::{LookupOutcome, Reconnected, SendOutcome, Sender};
pub use store::Outbox;
pub use wake::EnqueueTarget;
