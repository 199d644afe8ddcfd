//! The inbox on RabbitMQ (AMQP 0-9-1, through lapin).
//!
//! [`RabbitMqConsumer`] consumes one durable queue, runs each delivery through the [`Inbox`],
//! and acknowledges only after the inbox's transaction has ended. It declares, idempotently:
//!
//! - the queue (`{queue}`), a **quorum** queue, bound to the exchanges given with
//!   [`bind`](RabbitMqConsumer::bind) (topic exchanges, durable; one that already exists is used
//!   as it is, whatever its settings);
//! - `{queue}.retry`, the delay queue: a retried delivery is republished there with a
//!   per-message TTL equal to its backoff, and the broker dead-letters it back to `{queue}` when
//!   the TTL runs out. This needs no plugin (plain RabbitMQ 3.10+). Per-message TTLs expire at
//!   the head of the queue only, so a long backoff can hold shorter ones behind it for at most
//!   the backoff cap;
//! - `{queue}.dead`, where dead letters wait for an operator
//!   ([`replay_dead`](RabbitMqConsumer::replay_dead)). Each carries why it died in the header
//!   **`x-inbox-reason`** (the reason is also logged at `WARN`; a replay that fails again
//!   rewrites it). The quorum queue dead-letters there too if the broker's own delivery limit
//!   is ever reached; such a copy has no `x-inbox-reason`.
//!
//! The attempt count is the sum of a header the consumer maintains on retried copies
//! (`x-inbox-attempts`) and the quorum queue's `x-delivery-count` (redeliveries after a
//! consumer died or a channel closed), plus one.
//!
//! An outage of the consumer's own database ([`Verdict::Unavailable`]) is no attempt: the
//! delivery goes through `{queue}.retry` like a retry, with its attempt count unchanged, and
//! never back to the queue with a `nack`, which would count toward the quorum queue's delivery
//! limit and so end in `{queue}.dead`. Meanwhile the consumer pauses: the deliveries it holds
//! wait out the outage backoff before they are handled, so the outage is probed once per
//! backoff by each of the [`concurrency`](RabbitMqConsumer::concurrency) slots rather than
//! hit by every delivery in the queue. A delivery whose consumer died is redelivered
//! as soon as the broker notices the closed connection: at once when the process dies, within
//! about two heartbeat intervals when its host vanishes (`connect` asks for a 10 s heartbeat
//! unless the URI sets `?heartbeat=…`, which keeps that under 30 s; the server's default is
//! 60 s).
//!
//! # When the broker goes away
//!
//! A consumer made with [`connect`](RabbitMqConsumer::connect) keeps its URI and reconnects by
//! itself when its connection or channel is lost (a broker restarted, a network cut): it waits
//! a jittered backoff (up to 100 ms, doubling to at most 5 s, so that many consumers do not
//! come back at the same instant), connects again, declares its queues again (a broker that
//! lost them gets them back; one that kept them keeps them as they are) and consumes on. It
//! tries for as long as it runs, logging each failed attempt at `WARN`. A call to the broker
//! that has no answer within 30 s (an ack, a retried copy's publish and its confirm, a
//! channel's setup), or a connection found lost while no delivery arrives, counts as a lost
//! connection too, so a consumer never waits for ever on a link that is gone. Deliveries whose
//! ack was lost with the connection come back from the broker, and the inbox finds their claim:
//! nothing is lost, and nothing is applied twice. A consumer made with
//! [`new`](RabbitMqConsumer::new) on a connection of the caller's returns the error instead.
//! Either way, a queue deleted from outside (the broker cancels the consumer) ends
//! [`run`](RabbitMqConsumer::run) with `Ok(())`: that is not an outage to wait out.
//!
//! ```no_run
//! # #[cfg(feature = "sqlite")]
//! # async fn run(store: axum_idempotency::SqliteStore) -> Result<(), Box<dyn std::error::Error>> {
//! use axum_idempotency::inbox::{Delivery, Failure, Inbox};
//! use axum_idempotency::inbox::rabbitmq::RabbitMqConsumer;
//! use axum_idempotency::Tx;
//!
//! let inbox = Inbox::new("orders", store);
//! let uri = "amqp://127.0.0.1:5672/%2f?heartbeat=10";
//! let consumer = RabbitMqConsumer::connect(inbox, uri, "orders.payment-succeeded")
//!     .await?
//!     .bind("payments", "payment.succeeded")
//!     .concurrency(4);
//! consumer.declare().await?;
//! consumer
//!     .run(|_tx: Tx<sqlx::Sqlite>, _delivery: Delivery| async { Ok::<_, Failure>(()) })
//!     .await?;
//! # Ok(()) }
//! ```

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicNackOptions, BasicPublishOptions,
    BasicQosOptions, ConfirmSelectOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection};

use super::{Delivery, Failure, Inbox, Pause, ReplayReport, Verdict};
use crate::Backend;
use crate::broker;
use crate::tx::Tx;

/// The header a retried copy carries: attempts made before it.
const ATTEMPTS: &str = "x-inbox-attempts";
/// The header a quorum queue sets on a redelivery: earlier deliveries of this copy.
const DELIVERY_COUNT: &str = "x-delivery-count";
/// The header a dead letter carries: why it died.
const REASON: &str = "x-inbox-reason";
/// A consumer that ran this long before it failed starts its reconnection backoff over.
const STEADY: Duration = Duration::from_secs(10);
/// A call to the broker (an ack, a copy published and confirmed, a channel set up) that has
/// not finished by then is taken for a lost connection, and the consumer reconnects.
const BROKER_CALL: Duration = Duration::from_secs(30);
/// How often a consuming channel's connection is checked: a connection lost without a word
/// to the consumer's stream ends the consuming within this long.
const WATCH: Duration = Duration::from_secs(1);

/// A delivery as the inbox sees it, with the headers and the attempts made that its retried
/// copy would carry.
struct Received {
    headers: FieldTable,
    /// Attempts before this one: those the retried copies counted, and this copy's own
    /// redeliveries (a consumer that died, a channel that closed).
    before: u32,
    message: Delivery,
}

impl Received {
    fn of(delivery: &lapin::message::Delivery) -> Self {
        let headers = delivery.properties.headers().clone().unwrap_or_default();
        let before =
            header_count(&headers, ATTEMPTS).saturating_add(header_count(&headers, DELIVERY_COUNT));
        let mut message =
            Delivery::new(delivery.data.clone()).with_attempt(before.saturating_add(1));
        if let Some(id) = delivery.properties.message_id() {
            message = message.with_message_id(id.as_str());
        }
        Self {
            headers,
            before,
            message,
        }
    }
}

/// Consumes a RabbitMQ queue through an [`Inbox`]. See the [module docs](self).
pub struct RabbitMqConsumer<DB: Backend> {
    inbox: Inbox<DB>,
    connection: Arc<Connection>,
    /// Where to connect again when the connection is lost; `None` for a caller's connection.
    uri: Option<String>,
    queue: String,
    bindings: Vec<(String, String)>,
    concurrency: u16,
    batch: u16,
}

impl<DB: Backend> fmt::Debug for RabbitMqConsumer<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitMqConsumer")
            .field("inbox", &self.inbox)
            .field("queue", &self.queue)
            .field("bindings", &self.bindings)
            .field("concurrency", &self.concurrency)
            .field("batch", &self.batch)
            .field("reconnects", &self.uri.is_some())
            .finish_non_exhaustive()
    }
}

impl<DB: Backend> RabbitMqConsumer<DB> {
    /// A consumer of `queue` on the caller's `connection`, handling 4 deliveries at a time.
    /// When that connection is lost, [`run`](Self::run) returns the error: use
    /// [`connect`](Self::connect) for a consumer that reconnects by itself.
    pub fn new(inbox: Inbox<DB>, connection: Arc<Connection>, queue: impl Into<String>) -> Self {
        Self {
            inbox,
            connection,
            uri: None,
            queue: queue.into(),
            bindings: Vec::new(),
            concurrency: 4,
            batch: 1,
        }
    }

    /// A consumer of `queue` on a connection of its own to `uri`, handling 4 deliveries at a
    /// time. It connects now, so a wrong URI or an unreachable broker fails here, and later
    /// reconnects by itself whenever the connection is lost (see the
    /// [module docs](self#when-the-broker-goes-away)). Its heartbeat is 10 s unless the URI
    /// sets one (`?heartbeat=…`), so that a vanished broker host is noticed within about 20 s.
    pub async fn connect(
        inbox: Inbox<DB>,
        uri: &str,
        queue: impl Into<String>,
    ) -> Result<Self, lapin::Error> {
        let connection = broker::rabbitmq(uri).await?;
        let mut consumer = Self::new(inbox, Arc::new(connection), queue);
        consumer.uri = Some(uri.to_owned());
        Ok(consumer)
    }

    /// Binds the queue to the topic exchange `exchange` with `routing_key` on
    /// [`declare`](Self::declare).
    #[must_use]
    pub fn bind(mut self, exchange: impl Into<String>, routing_key: impl Into<String>) -> Self {
        self.bindings.push((exchange.into(), routing_key.into()));
        self
    }

    /// How many transactions apply deliveries at once (default 4).
    #[must_use]
    pub fn concurrency(mut self, transactions: u16) -> Self {
        self.concurrency = transactions.max(1);
        self
    }

    /// Applies up to `deliveries` of the deliveries in hand in one transaction (default 1),
    /// through [`Inbox::handle_batch`]: one commit for them all, which is what bounds a
    /// consumer whose database syncs each commit. A batch takes what has arrived, never
    /// waiting to fill, so a lone delivery is applied at once. The channel's prefetch is
    /// `concurrency × deliveries`. On SQLite a batch holds the database's one write lock
    /// while all of its handlers run: keep them quick, or the batch small.
    #[must_use]
    pub fn batch(mut self, deliveries: u16) -> Self {
        self.batch = deliveries.max(1);
        self
    }

    /// The queue dead letters go to: `{queue}.dead`.
    pub fn dead_letter_queue(&self) -> String {
        format!("{}.dead", self.queue)
    }

    fn retry_queue(&self) -> String {
        format!("{}.retry", self.queue)
    }

    /// Declares the exchanges, the queue and its retry and dead-letter queues, and the
    /// bindings. Idempotent; safe to run from every instance at start.
    pub async fn declare(&self) -> Result<(), lapin::Error> {
        self.declare_on(&self.connection).await
    }

    async fn declare_on(&self, connection: &Connection) -> Result<(), lapin::Error> {
        for (exchange, _) in &self.bindings {
            broker::declare_exchange(connection, exchange).await?;
        }
        let channel = connection.create_channel().await?;
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        let mut main = FieldTable::default();
        main.insert("x-queue-type".into(), long_string("quorum"));
        main.insert("x-dead-letter-exchange".into(), long_string(""));
        main.insert(
            "x-dead-letter-routing-key".into(),
            long_string(&self.dead_letter_queue()),
        );
        channel
            .queue_declare(self.queue.as_str().into(), durable, main)
            .await?;
        let mut retry = FieldTable::default();
        retry.insert("x-dead-letter-exchange".into(), long_string(""));
        retry.insert("x-dead-letter-routing-key".into(), long_string(&self.queue));
        channel
            .queue_declare(self.retry_queue().into(), durable, retry)
            .await?;
        channel
            .queue_declare(
                self.dead_letter_queue().into(),
                durable,
                FieldTable::default(),
            )
            .await?;
        for (exchange, routing_key) in &self.bindings {
            channel
                .queue_bind(
                    self.queue.as_str().into(),
                    exchange.as_str().into(),
                    routing_key.as_str().into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await?;
        }
        let _ = channel.close(200, "declared".into()).await;
        Ok(())
    }

    /// Consumes until the broker cancels the consumer (its queue was deleted: `Ok(())`).
    ///
    /// A lost channel or connection is waited out and consumed again by a consumer made
    /// with [`connect`](Self::connect); one made with [`new`](Self::new) returns the error,
    /// for the caller to reconnect or exit. Each delivery is acknowledged after the inbox's
    /// transaction ended: applied and duplicates at once, retries once their delayed copy is
    /// confirmed by the broker, dead letters once their copy in the dead-letter queue is.
    pub async fn run<H, Fut>(self, handler: H) -> Result<(), lapin::Error>
    where
        H: Fn(Tx<DB>, Delivery) -> Fut + Clone + Send + Sync + 'static,
        Fut: Future<Output = Result<(), Failure>> + Send + 'static,
    {
        let mut connection = Arc::clone(&self.connection);
        let mut failures = 0;
        loop {
            let started = tokio::time::Instant::now();
            let error = match self.consume(&connection, handler.clone()).await {
                Ok(()) => return Ok(()),
                Err(error) => error,
            };
            let Some(uri) = &self.uri else {
                return Err(error);
            };
            tracing::warn!(
                consumer = %self.inbox.name(),
                %error,
                "RabbitMQ consumer lost its channel or connection; reconnecting"
            );
            // A consumer refused again at once (its consume denied, say) backs off further
            // each time instead of looping; one that consumed for a while starts over.
            failures = if started.elapsed() < STEADY {
                failures + 1
            } else {
                1
            };
            connection = self.reconnect(uri, connection, failures).await;
            tracing::info!(consumer = %self.inbox.name(), "RabbitMQ consumer reconnected");
        }
    }

    /// A connection to consume on again, after a jittered backoff per attempt: the old one if
    /// only its channel was lost, else a new one; either way with the queues declared again,
    /// since a broker that lost them would otherwise refuse the consumer.
    async fn reconnect(&self, uri: &str, old: Arc<Connection>, failures: u32) -> Arc<Connection> {
        let mut attempt = failures.saturating_sub(1);
        loop {
            attempt = attempt.saturating_add(1);
            tokio::time::sleep(broker::RECONNECT.delay(attempt)).await;
            let connection = if old.status().connected() {
                Arc::clone(&old)
            } else {
                match broker::rabbitmq(uri).await {
                    Ok(connection) => Arc::new(connection),
                    Err(error) => {
                        tracing::warn!(consumer = %self.inbox.name(), attempt, %error, "RabbitMQ reconnection failed");
                        continue;
                    }
                }
            };
            match broker::within(BROKER_CALL, "no declaration", self.declare_on(&connection)).await
            {
                Ok(()) => return connection,
                Err(error) => {
                    tracing::warn!(consumer = %self.inbox.name(), attempt, %error, "declaring after a reconnection failed");
                }
            }
        }
    }

    /// Consumes on one connection until the consumer is cancelled (`Ok`) or a channel or
    /// connection error ends it. Deliveries in hand are finished first, so no handler is
    /// abandoned mid-transaction; their acks fail with the channel and the broker redelivers
    /// them, to find their claims.
    async fn consume<H, Fut>(&self, connection: &Connection, handler: H) -> Result<(), lapin::Error>
    where
        H: Fn(Tx<DB>, Delivery) -> Fut + Clone + Send + Sync + 'static,
        Fut: Future<Output = Result<(), Failure>> + Send + 'static,
    {
        let setup = async {
            let channel = connection.create_channel().await?;
            channel
                .basic_qos(
                    self.concurrency.saturating_mul(self.batch),
                    BasicQosOptions::default(),
                )
                .await?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await?;
            let consumer = channel
                .basic_consume(
                    self.queue.as_str().into(),
                    format!("{}-{}", self.inbox.name(), std::process::id()).into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await?;
            Ok((channel, consumer))
        };
        let (channel, consumer) = broker::within(BROKER_CALL, "no consumer", setup).await?;
        let failed = std::sync::Mutex::new(None);
        let pause = Pause::default();
        let lost = std::sync::atomic::AtomicBool::new(false);
        // The stream ends when its channel closes, as a rule; should lapin not say so, the
        // watch ends it, so that the consumer reconnects rather than wait for ever.
        let watch = async {
            while connection.status().connected() && channel.status().connected() {
                tokio::time::sleep(WATCH).await;
            }
            lost.store(true, std::sync::atomic::Ordering::Relaxed);
        };
        consumer
            .take_until(watch)
            .ready_chunks(usize::from(self.batch))
            .for_each_concurrent(usize::from(self.concurrency), |chunk| {
                let handler = handler.clone();
                let channel = channel.clone();
                let failed = &failed;
                let pause = &pause;
                let this = self;
                async move {
                    let mut deliveries = Vec::with_capacity(chunk.len());
                    let mut received = Ok(());
                    for delivery in chunk {
                        match delivery {
                            Ok(delivery) => deliveries.push(delivery),
                            Err(error) => received = Err(error),
                        }
                    }
                    let processed = this.process(&channel, deliveries, pause, handler).await;
                    if let Err(error) = received.and(processed) {
                        tracing::warn!(consumer = %this.inbox.name(), %error, "RabbitMQ delivery not settled");
                        let mut slot = failed.lock().unwrap_or_else(|p| p.into_inner());
                        slot.get_or_insert(error);
                    }
                }
            })
            .await;
        let error = failed.into_inner().unwrap_or_else(|p| p.into_inner());
        match error {
            Some(error) => Err(error),
            None if lost.into_inner() => Err(lapin::Error::from(std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                "the consuming channel's connection was lost",
            ))),
            None => Ok(()),
        }
    }

    /// Applies `deliveries`, in one transaction when there are several, and settles each.
    async fn process<H, Fut>(
        &self,
        channel: &Channel,
        deliveries: Vec<lapin::message::Delivery>,
        pause: &Pause,
        handler: H,
    ) -> Result<(), lapin::Error>
    where
        H: Fn(Tx<DB>, Delivery) -> Fut + Clone + Send + 'static,
        Fut: Future<Output = Result<(), Failure>> + Send + 'static,
    {
        let received: Vec<Received> = deliveries.iter().map(Received::of).collect();
        // While the consumer's database is out, deliveries wait here (unacknowledged, held
        // from other consumers) rather than each fail on it in turn.
        pause.wait().await;
        let verdicts = match received.as_slice() {
            [] => Vec::new(),
            [one] => vec![self.inbox.handle(one.message.clone(), handler).await],
            several => {
                let messages: Vec<Delivery> = several.iter().map(|r| r.message.clone()).collect();
                self.inbox.handle_batch(&messages, handler).await
            }
        };
        // Every delivery is settled, whatever became of the others: one left unsettled would
        // hold a place in the channel's prefetch until the channel closed.
        let settles =
            deliveries
                .iter()
                .zip(received)
                .zip(verdicts)
                .map(|((delivery, received), verdict)| {
                    self.settle(channel, delivery, received, verdict, pause)
                });
        futures_util::future::join_all(settles)
            .await
            .into_iter()
            .collect()
    }

    /// Tells the broker what became of `delivery`.
    async fn settle(
        &self,
        channel: &Channel,
        delivery: &lapin::message::Delivery,
        received: Received,
        verdict: Verdict,
        pause: &Pause,
    ) -> Result<(), lapin::Error> {
        let Received {
            headers,
            before,
            message,
        } = received;
        match verdict {
            Verdict::Applied | Verdict::Duplicate => {
                let ack = delivery.acker.ack(BasicAckOptions::default());
                broker::within(BROKER_CALL, "no ack", ack).await?;
            }
            Verdict::Retry { after } => {
                self.retry_later(channel, delivery, headers, message.attempt(), after)
                    .await?;
            }
            Verdict::Unavailable { after, .. } => {
                // An outage counts no attempt: the copy carries the count this delivery came
                // with. It goes through the delay queue rather than back with a `nack`, which
                // would raise the quorum queue's delivery count toward its delivery limit,
                // past which the broker itself dead-letters the message.
                pause.hold(after);
                self.retry_later(channel, delivery, headers, before, after)
                    .await?;
            }
            Verdict::Dead { reason } => {
                let mut headers = headers;
                headers.insert(REASON.into(), long_string(&reason));
                let properties = delivery.properties.clone().with_headers(headers);
                self.forward(channel, delivery, &self.dead_letter_queue(), properties)
                    .await?;
            }
        }
        Ok(())
    }

    /// Sends `delivery` through the delay queue, to come back after `after` counting `attempts`
    /// attempts made.
    async fn retry_later(
        &self,
        channel: &Channel,
        delivery: &lapin::message::Delivery,
        headers: FieldTable,
        attempts: u32,
        after: Duration,
    ) -> Result<(), lapin::Error> {
        let mut headers = headers.inner().clone();
        // The copy is a new message whose own redeliveries the broker counts afresh; the ones
        // of this copy are in `attempts` already.
        headers.remove(DELIVERY_COUNT);
        headers.insert(ATTEMPTS.into(), AMQPValue::LongUInt(attempts));
        let properties = delivery
            .properties
            .clone()
            .with_headers(FieldTable::from(headers))
            .with_expiration(after.as_millis().max(1).to_string().into());
        self.forward(channel, delivery, &self.retry_queue(), properties)
            .await
    }

    /// Publishes a copy of `delivery` to `queue` and acks the original once the broker
    /// confirmed the copy; a copy not confirmed leaves the original to be redelivered.
    async fn forward(
        &self,
        channel: &Channel,
        delivery: &lapin::message::Delivery,
        queue: &str,
        properties: BasicProperties,
    ) -> Result<(), lapin::Error> {
        let forwarding = async {
            let confirmed = channel
                .basic_publish(
                    "".into(),
                    queue.into(),
                    BasicPublishOptions::default(),
                    &delivery.data,
                    properties.with_delivery_mode(2),
                )
                .await?
                .await?;
            if confirmed.is_ack() {
                delivery.acker.ack(BasicAckOptions::default()).await?;
            } else {
                let requeue = BasicNackOptions {
                    requeue: true,
                    ..BasicNackOptions::default()
                };
                delivery.acker.nack(requeue).await?;
            }
            Ok(())
        };
        broker::within(BROKER_CALL, "no forward", forwarding).await
    }

    /// Replays up to `limit` dead letters through the same claim as live deliveries, for an
    /// operator once the cause is fixed. Each is one attempt: applied (or found applied
    /// already) → removed from the dead-letter queue; failed again → put back at its tail with
    /// the new reason. Dead letters that arrive meanwhile are left for the next call.
    pub async fn replay_dead<H, Fut>(
        &self,
        handler: H,
        limit: usize,
    ) -> Result<ReplayReport, lapin::Error>
    where
        H: Fn(Tx<DB>, Delivery) -> Fut + Clone + Send + Sync + 'static,
        Fut: Future<Output = Result<(), Failure>> + Send + 'static,
    {
        let channel = self.connection.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        let dead = self.dead_letter_queue();
        let waiting = channel
            .queue_declare(
                dead.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await?
            .message_count();
        let mut report = ReplayReport::default();
        let limit = limit.min(usize::try_from(waiting).unwrap_or(usize::MAX));
        for _ in 0..limit {
            let Some(got) = channel
                .basic_get(dead.as_str().into(), BasicGetOptions::default())
                .await?
            else {
                break;
            };
            let delivery = got.delivery;
            let mut message = Delivery::new(delivery.data.clone());
            if let Some(id) = delivery.properties.message_id() {
                message = message.with_message_id(id.as_str());
            }
            match self.inbox.replay(message, handler.clone()).await {
                Verdict::Applied => {
                    report.applied += 1;
                    delivery.acker.ack(BasicAckOptions::default()).await?;
                }
                Verdict::Duplicate => {
                    report.duplicates += 1;
                    delivery.acker.ack(BasicAckOptions::default()).await?;
                }
                verdict @ (Verdict::Retry { .. }
                | Verdict::Unavailable { .. }
                | Verdict::Dead { .. }) => {
                    report.still_dead += 1;
                    let mut properties = delivery.properties.clone();
                    if let Verdict::Dead { reason } = verdict {
                        let mut headers = properties.headers().clone().unwrap_or_default();
                        headers.insert(REASON.into(), long_string(&reason));
                        properties = properties.with_headers(headers);
                    }
                    self.forward(&channel, &delivery, &dead, properties).await?;
                }
            }
        }
        let _ = channel.close(200, "replayed".into()).await;
        Ok(report)
    }
}

fn long_string(value: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(value))
}

/// A non-negative count from a header, whatever integer type the writer chose; 0 if absent.
fn header_count(headers: &FieldTable, name: &str) -> u32 {
    let value = headers.inner().get(&ShortString::from(name));
    let count: i128 = match value {
        Some(AMQPValue::ShortShortInt(v)) => (*v).into(),
        Some(AMQPValue::ShortShortUInt(v)) => (*v).into(),
        Some(AMQPValue::ShortInt(v)) => (*v).into(),
        Some(AMQPValue::ShortUInt(v)) => (*v).into(),
        Some(AMQPValue::LongInt(v)) => (*v).into(),
        Some(AMQPValue::LongUInt(v)) => (*v).into(),
        Some(AMQPValue::LongLongInt(v)) => (*v).into(),
        _ => 0,
    };
    u32::try_from(count.max(0)).unwrap_or(u32::MAX)
}
