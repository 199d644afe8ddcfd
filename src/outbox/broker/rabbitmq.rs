//! An outbox [`Sender`] that publishes to a RabbitMQ exchange with publisher confirms.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Channel, Connection};
use tokio::sync::Mutex;

use crate::broker;
use crate::outbox::{OutboxRecord, Reconnected, SendOutcome, Sender};

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
/// A send that finds the connection down answers [`SendOutcome::Unavailable`] at once,
/// without waiting for the broker: the dispatcher pauses the exchange and probes it, and no
/// message spends an attempt on the outage. A sender made with [`connect`](Self::connect)
/// keeps its URI and reconnects by itself meanwhile, in the background, with a jittered
/// backoff between attempts (up to 100 ms, doubling to at most 5 s); it logs one warning when
/// it finds the connection lost and one info line when it is back, and each failed attempt
/// only at debug level. Once it is back it tells the dispatcher, which then probes the paused
/// exchange at once rather than at its next probe (see [`Sender::reconnected`]). A sender made with [`with_connection`](Self::with_connection) on the
/// caller's connection only opens new channels on it, and answers unavailable while that
/// connection is down.
///
/// A publish whose confirm is lost with the connection is an unknown outcome: it is sent
/// again later under the same message id, and the inbox applies it once.
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
    // channel), its connection after that is lost, if the sender has a URI; shared with the
    // task that reconnects, which holds it weakly so a dropped sender ends that task.
    link: Arc<Mutex<Link>>,
    uri: Option<String>,
    exchange: String,
    routes: HashMap<String, String>,
    /// Raised by the reconnecting task when the connection is back.
    reconnected: Reconnected,
}

/// The connection a sender publishes on, and its channel in confirm mode.
struct Link {
    connection: Arc<Connection>,
    channel: Channel,
    /// Set while a task reconnects: since when, and why the last attempt failed.
    down: Option<Down>,
}

/// An outage as the reconnecting task sees it.
struct Down {
    since: Instant,
    last_error: String,
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
    /// every send is [unavailable](SendOutcome::Unavailable).
    pub async fn with_connection(
        connection: Arc<Connection>,
        exchange: impl Into<String>,
    ) -> Result<Self, lapin::Error> {
        let channel = confirming_channel(&connection).await?;
        Ok(Self {
            link: Arc::new(Mutex::new(Link {
                connection,
                channel,
                down: None,
            })),
            uri: None,
            exchange: exchange.into(),
            routes: HashMap::new(),
            reconnected: Reconnected::new(),
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

    /// The channel to publish on: the current one, or a new one on a live connection. With
    /// the connection down, `Err` at once, after starting the reconnecting task if the sender
    /// has a URI and none runs yet: a send never waits for the broker to come back.
    async fn channel(&self) -> Result<Channel, String> {
        let mut link = self.link.lock().await;
        if link.channel.status().connected() {
            return Ok(link.channel.clone());
        }
        if link.connection.status().connected() {
            // Bounded: a connection whose broker just vanished still looks alive until the
            // heartbeat notices, and a send must not sit out the dispatcher's send timeout.
            let opened = tokio::time::timeout(OPEN_CHANNEL, confirming_channel(&link.connection));
            return match opened.await {
                Ok(Ok(channel)) => {
                    link.channel = channel.clone();
                    Ok(channel)
                }
                Ok(Err(error)) => Err(format!("no RabbitMQ channel: {error}")),
                Err(_) => Err(format!("no RabbitMQ channel within {OPEN_CHANNEL:?}")),
            };
        }
        let Some(uri) = &self.uri else {
            return Err("the RabbitMQ connection is down".into());
        };
        if let Some(down) = &link.down {
            return Err(format!(
                "the RabbitMQ connection is down for {:?}, reconnecting: {}",
                down.since.elapsed(),
                down.last_error
            ));
        }
        tracing::warn!(
            exchange = %self.exchange,
            "RabbitMQ sender lost its connection; sends are unavailable until it is back"
        );
        link.down = Some(Down {
            since: Instant::now(),
            last_error: "connection lost".into(),
        });
        tokio::spawn(reconnect(
            Arc::downgrade(&self.link),
            uri.clone(),
            self.exchange.clone(),
            self.reconnected.clone(),
        ));
        Err("the RabbitMQ connection is down, reconnecting".into())
    }
}

/// How long a send waits for a new channel on a connection that looks alive.
const OPEN_CHANNEL: Duration = Duration::from_secs(2);

/// Connects `link` again to `uri`, with a jittered backoff between attempts, until it is back
/// (then raises `back`) or the sender is gone. One task per outage: the sender starts it
/// only when none runs.
///
/// The schedule is this loop's alone. lapin's own automatic recovery stays off (this crate's
/// connections use lapin's default properties): it would retry on its own schedule, logging
/// each failed attempt at error level, then give up for good after its 16 attempts, where an
/// outage of any length must end in a reconnection; and it would replay pending confirms on the
/// new connection, where this sender needs a lost confirm to read as an unknown outcome. Each
/// attempt here is one short-lived lapin connection, and lapin logs one error line for an
/// attempt the broker's host accepts and then closes (its connection backoff allows no retry),
/// so the attempts are spaced by a backoff that grows over the whole outage.
async fn reconnect(link: Weak<Mutex<Link>>, uri: String, exchange: String, back: Reconnected) {
    let mut attempt = 0;
    loop {
        attempt += 1;
        let reconnected = async {
            let connection = Arc::new(broker::rabbitmq(&uri).await?);
            let channel = confirming_channel(&connection).await?;
            Ok::<_, lapin::Error>((connection, channel))
        };
        let result = reconnected.await;
        let Some(link) = link.upgrade() else {
            return;
        };
        let mut link = link.lock().await;
        match result {
            Ok((connection, channel)) => {
                let down_for = link.down.take().map(|down| down.since.elapsed());
                tracing::info!(%exchange, attempts = attempt, ?down_for, "RabbitMQ sender reconnected");
                link.connection = connection;
                link.channel = channel;
                back.raise();
                return;
            }
            Err(error) => {
                tracing::debug!(%exchange, attempt, %error, "RabbitMQ sender could not reconnect yet");
                if let Some(down) = &mut link.down {
                    down.last_error = error.to_string();
                }
            }
        }
        drop(link);
        tokio::time::sleep(broker::RECONNECT.delay(attempt)).await;
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
            Err(reason) => {
                return SendOutcome::Unavailable {
                    after: None,
                    reason,
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
            // Never reached the broker's socket: certainly not published, and the channel or its
            // connection is gone (the next send finds out which).
            Err(error) => {
                return SendOutcome::Unavailable {
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
            // The broker answered: not an outage, an attempt that did not take.
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

    /// Only a sender that reconnects by itself (made with [`connect`](Self::connect)) knows
    /// when its connection is back.
    fn reconnected(&self) -> Option<Reconnected> {
        self.uri.as_ref().map(|_| self.reconnected.clone())
    }
}
