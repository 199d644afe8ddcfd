//! An outbox [`Sender`] that publishes to a RabbitMQ exchange with publisher confirms.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Channel, Connection};
use tokio::sync::Mutex;

use crate::broker;
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
/// # When the broker goes away
///
/// A sender made with [`connect`](Self::connect) keeps its URI and reconnects by itself: a
/// send that finds the connection lost connects again, with a jittered backoff between
/// attempts (up to 100 ms, doubling to at most 5 s), until the broker is back or the
/// dispatcher's send timeout ends the attempt (an unknown outcome: the message is sent again
/// later under the same message id, and the inbox applies it once). Sends waiting for the
/// broker spend the dispatcher's attempts slowly, one per send timeout plus backoff; give
/// event messages enough [`max_attempts`](crate::outbox::Dispatcher::max_attempts) to outlast
/// the longest broker outage you plan for. A sender made with
/// [`with_connection`](Self::with_connection) on the caller's connection only opens new
/// channels on it, and retries its sends while that connection is down.
///
/// ```no_run
/// # async fn run(outbox: axum_idempotency::outbox::Outbox<sqlx::Sqlite>) -> Result<(), lapin::Error> {
/// use axum_idempotency::outbox::{Dispatcher, RabbitMqSender};
///
/// let sender = RabbitMqSender::connect("amqp://127.0.0.1:5672/%2f?heartbeat=10", "payments").await?
///     .route("payment.succeeded", "payment.succeeded");
/// sender.declare().await?;
/// tokio::spawn(Dispatcher::new(outbox, sender).run(std::future::pending()));
/// # Ok(()) }
/// ```
pub struct RabbitMqSender {
    // Its channel is replaced after the broker closes it (a failed publish closes an AMQP
    // channel), its connection after that is lost, if the sender has a URI.
    link: Mutex<Link>,
    uri: Option<String>,
    exchange: String,
    routes: HashMap<String, String>,
}

/// The connection a sender publishes on, and its channel in confirm mode.
struct Link {
    connection: Arc<Connection>,
    channel: Channel,
}

impl fmt::Debug for RabbitMqSender {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitMqSender")
            .field("exchange", &self.exchange)
            .field("routes", &self.routes)
            .field("reconnects", &self.uri.is_some())
            .finish_non_exhaustive()
    }
}

impl RabbitMqSender {
    /// A sender publishing to `exchange` on a connection of its own to `uri`, which it opens
    /// now (a wrong URI or an unreachable broker fails here) and opens again whenever it is
    /// lost (see [above](Self#when-the-broker-goes-away)), with a 10 s heartbeat unless `uri`
    /// sets one (`?heartbeat=…`). The exchange must exist when messages are sent:
    /// [`declare`](Self::declare) it, or let the consumer side do so.
    pub async fn connect(uri: &str, exchange: impl Into<String>) -> Result<Self, lapin::Error> {
        let connection = Arc::new(broker::rabbitmq(uri).await?);
        let mut sender = Self::with_connection(connection, exchange).await?;
        sender.uri = Some(uri.to_owned());
        Ok(sender)
    }

    /// A sender publishing to `exchange` on a channel of its own, in confirm mode, on the
    /// caller's `connection`. It never opens another connection: while this one is down,
    /// every send is a retry.
    pub async fn with_connection(
        connection: Arc<Connection>,
        exchange: impl Into<String>,
    ) -> Result<Self, lapin::Error> {
        let channel = confirming_channel(&connection).await?;
        Ok(Self {
            link: Mutex::new(Link {
                connection,
                channel,
            }),
            uri: None,
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

    /// Declares the sender's exchange, a durable topic exchange, unless it exists: one made
    /// beforehand (by the consumer side, or by an operator with other settings) is used as it
    /// is. Idempotent: call it at start, before the first message is sent.
    pub async fn declare(&self) -> Result<(), lapin::Error> {
        let connection = Arc::clone(&self.link.lock().await.connection);
        broker::declare_exchange(&connection, &self.exchange).await
    }

    /// The channel to publish on: the current one, a new one on a live connection, or, with
    /// a URI, one on a new connection. Concurrent sends wait here for one reconnection
    /// rather than each opening a connection.
    async fn channel(&self) -> Result<Channel, lapin::Error> {
        let mut link = self.link.lock().await;
        if link.channel.status().connected() {
            return Ok(link.channel.clone());
        }
        let uri = match &self.uri {
            Some(uri) if !link.connection.status().connected() => uri,
            _ => {
                link.channel = confirming_channel(&link.connection).await?;
                return Ok(link.channel.clone());
            }
        };
        // The dispatcher's send timeout bounds this loop by dropping the send.
        let mut attempt = 0;
        loop {
            attempt += 1;
            let reconnected = async {
                let connection = Arc::new(broker::rabbitmq(uri).await?);
                let channel = confirming_channel(&connection).await?;
                Ok::<_, lapin::Error>(Link {
                    connection,
                    channel,
                })
            };
            match reconnected.await {
                Ok(new) => {
                    tracing::info!(exchange = %self.exchange, attempt, "RabbitMQ sender reconnected");
                    *link = new;
                    return Ok(link.channel.clone());
                }
                Err(error) => {
                    tracing::warn!(exchange = %self.exchange, attempt, %error, "RabbitMQ sender could not reconnect");
                }
            }
            tokio::time::sleep(broker::RECONNECT.delay(attempt)).await;
        }
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
