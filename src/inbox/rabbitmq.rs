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
//! consumer died or a channel closed), plus one. A delivery whose consumer died is redelivered
//! as soon as the broker notices the closed connection: at once when the process dies, within
//! about two heartbeat intervals when its host vanishes (connect with `?heartbeat=10` in the
//! URI to keep that under 30 s; the server's default is 60 s).
//!
//! ```no_run
//! # #[cfg(feature = "sqlite")]
//! # async fn run(store: axum_idempotency::SqliteStore) -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use axum_idempotency::inbox::{Delivery, Failure, Inbox};
//! use axum_idempotency::inbox::rabbitmq::RabbitMqConsumer;
//! use axum_idempotency::Tx;
//!
//! let connection = lapin::Connection::connect("amqp://127.0.0.1:5672", Default::default()).await?;
//! let inbox = Inbox::new("orders", store);
//! let consumer = RabbitMqConsumer::new(inbox, Arc::new(connection), "orders.payment-succeeded")
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

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicNackOptions, BasicPublishOptions,
    BasicQosOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ExchangeKind};

use super::{Delivery, Failure, Inbox, ReplayReport, Verdict};
use crate::Backend;
use crate::tx::Tx;

/// The header a retried copy carries: attempts made before it.
const ATTEMPTS: &str = "x-inbox-attempts";
/// The header a dead letter carries: why it died.
const REASON: &str = "x-inbox-reason";

/// Consumes a RabbitMQ queue through an [`Inbox`]. See the [module docs](self).
pub struct RabbitMqConsumer<DB: Backend> {
    inbox: Inbox<DB>,
    connection: Arc<Connection>,
    queue: String,
    bindings: Vec<(String, String)>,
    concurrency: u16,
}

impl<DB: Backend> fmt::Debug for RabbitMqConsumer<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitMqConsumer")
            .field("inbox", &self.inbox)
            .field("queue", &self.queue)
            .field("bindings", &self.bindings)
            .field("concurrency", &self.concurrency)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend> RabbitMqConsumer<DB> {
    /// A consumer of `queue` on `connection`, handling 4 deliveries at a time.
    pub fn new(inbox: Inbox<DB>, connection: Arc<Connection>, queue: impl Into<String>) -> Self {
        Self {
            inbox,
            connection,
            queue: queue.into(),
            bindings: Vec::new(),
            concurrency: 4,
        }
    }

    /// Binds the queue to the topic exchange `exchange` with `routing_key` on
    /// [`declare`](Self::declare).
    #[must_use]
    pub fn bind(mut self, exchange: impl Into<String>, routing_key: impl Into<String>) -> Self {
        self.bindings.push((exchange.into(), routing_key.into()));
        self
    }

    /// How many deliveries are handled at once (default 4); also the channel's prefetch.
    #[must_use]
    pub fn concurrency(mut self, deliveries: u16) -> Self {
        self.concurrency = deliveries.max(1);
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
        for (exchange, _) in &self.bindings {
            // A passive declare accepts the exchange as it is (a publisher may have made it
            // with other settings); its failure closes the channel, hence a fresh one.
            let probe = self.connection.create_channel().await?;
            let exists = probe
                .exchange_declare(
                    exchange.as_str().into(),
                    ExchangeKind::Topic,
                    ExchangeDeclareOptions {
                        passive: true,
                        ..ExchangeDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await
                .is_ok();
            if !exists {
                let channel = self.connection.create_channel().await?;
                channel
                    .exchange_declare(
                        exchange.as_str().into(),
                        ExchangeKind::Topic,
                        ExchangeDeclareOptions {
                            durable: true,
                            ..ExchangeDeclareOptions::default()
                        },
                        FieldTable::default(),
                    )
                    .await?;
                let _ = channel.close(200, "declared".into()).await;
            } else {
                let _ = probe.close(200, "declared".into()).await;
            }
        }
        let channel = self.connection.create_channel().await?;
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

    /// Consumes until the channel or the connection closes (then returns the error, so the
    /// caller can reconnect or exit). Each delivery is acknowledged after the inbox's
    /// transaction ended: applied and duplicates at once, retries once their delayed copy is
    /// confirmed by the broker, dead letters once their copy in the dead-letter queue is.
    pub async fn run<H, Fut>(self, handler: H) -> Result<(), lapin::Error>
    where
        H: Fn(Tx<DB>, Delivery) -> Fut + Clone + Send + Sync + 'static,
        Fut: Future<Output = Result<(), Failure>> + Send + 'static,
    {
        let channel = self.connection.create_channel().await?;
        channel
            .basic_qos(self.concurrency, BasicQosOptions::default())
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
        let failed = std::sync::Mutex::new(None);
        consumer
            .for_each_concurrent(usize::from(self.concurrency), |delivery| {
                let handler = handler.clone();
                let channel = channel.clone();
                let failed = &failed;
                let this = &self;
                async move {
                    let outcome = match delivery {
                        Ok(delivery) => this.process(&channel, delivery, handler).await,
                        Err(error) => Err(error),
                    };
                    if let Err(error) = outcome {
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
            None => Ok(()),
        }
    }

    async fn process<H, Fut>(
        &self,
        channel: &Channel,
        delivery: lapin::message::Delivery,
        handler: H,
    ) -> Result<(), lapin::Error>
    where
        H: Fn(Tx<DB>, Delivery) -> Fut + Send + 'static,
        Fut: Future<Output = Result<(), Failure>> + Send + 'static,
    {
        let headers = delivery.properties.headers().clone().unwrap_or_default();
        let attempt = 1u32
            .saturating_add(header_count(&headers, ATTEMPTS))
            .saturating_add(header_count(&headers, "x-delivery-count"));
        let mut message = Delivery::new(delivery.data.clone()).attempt(attempt);
        if let Some(id) = delivery.properties.message_id() {
            message = message.message_id(id.as_str());
        }
        let verdict = self.inbox.handle(message, handler).await;
        match verdict {
            Verdict::Applied | Verdict::Duplicate => {
                delivery.acker.ack(BasicAckOptions::default()).await?;
            }
            Verdict::Retry { after } => {
                let mut headers = headers;
                headers.insert(ATTEMPTS.into(), AMQPValue::LongUInt(attempt));
                let properties = delivery
                    .properties
                    .clone()
                    .with_headers(headers)
                    .with_expiration(after.as_millis().max(1).to_string().into());
                self.forward(channel, &delivery, &self.retry_queue(), properties)
                    .await?;
            }
            Verdict::Dead { reason } => {
                let mut headers = headers;
                headers.insert(REASON.into(), long_string(&reason));
                let properties = delivery.properties.clone().with_headers(headers);
                self.forward(channel, &delivery, &self.dead_letter_queue(), properties)
                    .await?;
            }
        }
        Ok(())
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
            delivery
                .acker
                .nack(BasicNackOptions {
                    requeue: true,
                    ..BasicNackOptions::default()
                })
                .await?;
        }
        Ok(())
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
                message = message.message_id(id.as_str());
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
                verdict @ (Verdict::Retry { .. } | Verdict::Dead { .. }) => {
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
