//! An outbox [`Sender`] that publishes to a RabbitMQ exchange with publisher confirms.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Channel, Connection};
use tokio::sync::Mutex;

use crate::outbox::{OutboxRecord, SendOutcome, Sender};

/// Publishes outbox messages to a RabbitMQ exchange, one confirmed publish per attempt.
///
/// The message's [downstream key](OutboxRecord::downstream_key) travels as the AMQP `message_id`,
/// the same on every attempt, so a consumer deduping by message id (or, better, by the
/// business key inside the payload, see the `inbox` module) applies a resend once. The
/// routing key is the message's topic, or what [`route`](Self::route) maps it to. Publishes
/// are persistent and `mandatory`: a message no queue is bound for yet is not counted as
/// delivered but retried later, and one the broker does not confirm is retried too.
///
/// ```no_run
/// # async fn run(outbox: axum_idempotency::outbox::Outbox<sqlx::Sqlite>) -> Result<(), lapin::Error> {
/// use std::sync::Arc;
/// use axum_idempotency::outbox::{Dispatcher, RabbitMqSender};
///
/// let connection = Arc::new(lapin::Connection::connect("amqp://127.0.0.1:5672", Default::default()).await?);
/// let sender = RabbitMqSender::connect(connection, "payments").await?
///     .route("payment.succeeded", "payment.succeeded");
/// tokio::spawn(Dispatcher::new(outbox, sender).run(std::future::pending()));
/// # Ok(()) }
/// ```
pub struct RabbitMqSender {
    connection: Arc<Connection>,
    // Replaced after the broker closes it (a failed publish closes an AMQP channel).
    channel: Mutex<Channel>,
    exchange: String,
    routes: HashMap<String, String>,
}

impl fmt::Debug for RabbitMqSender {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitMqSender")
            .field("exchange", &self.exchange)
            .field("routes", &self.routes)
            .finish_non_exhaustive()
    }
}

impl RabbitMqSender {
    /// A sender publishing to `exchange` on a channel of its own in confirm mode. The exchange
    /// must exist when messages are sent (the consumer side declares it).
    pub async fn connect(
        connection: Arc<Connection>,
        exchange: impl Into<String>,
    ) -> Result<Self, lapin::Error> {
        let channel = confirming_channel(&connection).await?;
        Ok(Self {
            connection,
            channel: Mutex::new(channel),
            exchange: exchange.into(),
            routes: HashMap::new(),
        })
    }

    /// Publishes messages of `topic` with `routing_key` (default: the topic itself).
    #[must_use]
    pub fn route(mut self, topic: impl Into<String>, routing_key: impl Into<String>) -> Self {
        self.routes.insert(topic.into(), routing_key.into());
        self
    }

    async fn channel(&self) -> Result<Channel, lapin::Error> {
        let mut channel = self.channel.lock().await;
        if !channel.status().connected() {
            *channel = confirming_channel(&self.connection).await?;
        }
        Ok(channel.clone())
    }
}

async fn confirming_channel(connection: &Connection) -> Result<Channel, lapin::Error> {
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok(channel)
}

impl Sender for RabbitMqSender {
    async fn send(&self, message: &OutboxRecord) -> SendOutcome {
        let channel = match self.channel().await {
            Ok(channel) => channel,
            Err(error) => {
                return SendOutcome::Retry {
                    after: None,
                    reason: format!("no RabbitMQ channel: {error}"),
                };
            }
        };
        let routing_key = self
            .routes
            .get(&message.topic)
            .map_or(message.topic.as_str(), String::as_str);
        let properties = BasicProperties::default()
            .with_message_id(message.downstream_key.as_str().into())
            .with_delivery_mode(2);
        let published = channel
            .basic_publish(
                self.exchange.as_str().into(),
                routing_key.into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &message.payload,
                properties,
            )
            .await;
        let confirm = match published {
            Ok(confirm) => confirm,
            // Never reached the broker's socket: certainly not published.
            Err(error) => {
                return SendOutcome::Retry {
                    after: None,
                    reason: format!("publish failed: {error}"),
                };
            }
        };
        match confirm.await {
            Ok(confirmation) if confirmation.is_ack() => match confirmation.take_message() {
                None => SendOutcome::Delivered {
                    receipt: message.downstream_key.to_string(),
                },
                Some(_) => SendOutcome::Retry {
                    after: None,
                    reason: format!("no queue is bound for {}/{routing_key} yet", self.exchange),
                },
            },
            Ok(_) => SendOutcome::Retry {
                after: None,
                reason: "the broker refused the message (nack)".into(),
            },
            // The publish left but its confirm was lost: a resend carries the same message id.
            Err(error) => SendOutcome::Unknown {
                reason: format!("no confirm: {error}"),
            },
        }
    }
}
