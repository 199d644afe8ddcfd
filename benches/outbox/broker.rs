//! The brokers: a destination of the run's own, the crate's senders, the bare publisher.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::pull, stream};
use axum_idempotency::outbox::{
    DownstreamKey, LookupOutcome, NatsSender, OutboxRecord, RabbitMqSender, SendOutcome, Sender,
};
use bytes::Bytes;
use futures_util::StreamExt;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions,
    ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
    QueuePurgeOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, ExchangeKind};

use crate::TOPIC;

/// A broker with a destination of this run's own that holds what is published until verified.
pub(crate) enum Broker {
    RabbitMq {
        connection: Arc<lapin::Connection>,
        channel: lapin::Channel,
        exchange: String,
        queue: String,
    },
    Nats {
        js: jetstream::Context,
        stream: String,
        subject: String,
    },
}

impl Broker {
    pub(crate) async fn rabbitmq(tag: u32) -> Self {
        let url = std::env::var("AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
        let connection = lapin::Connection::connect(&url, Default::default())
            .await
            .expect("RabbitMQ must be reachable (AMQP_URL)");
        let channel = connection.create_channel().await.expect("channel");
        let (exchange, queue) = (format!("outbench.{tag}"), format!("outbench.{tag}.events"));
        // Durable, with persistent messages (the sender's delivery mode 2): a confirm then
        // means the broker has the message on disk, as in production.
        channel
            .exchange_declare(
                exchange.as_str().into(),
                ExchangeKind::Direct,
                ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("declare the exchange");
        channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("declare the queue");
        channel
            .queue_bind(
                queue.as_str().into(),
                exchange.as_str().into(),
                TOPIC.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("bind the queue");
        Self::RabbitMq {
            connection: Arc::new(connection),
            channel,
            exchange,
            queue,
        }
    }

    pub(crate) async fn nats(tag: u32) -> Self {
        let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
        let js = jetstream::new(
            async_nats::connect(&url)
                .await
                .expect("NATS must be reachable (NATS_URL)"),
        );
        let (stream, subject) = (format!("OUTBENCH_{tag}"), format!("outbench_{tag}.events"));
        js.create_stream(stream::Config {
            name: stream.clone(),
            subjects: vec![subject.clone()],
            ..Default::default()
        })
        .await
        .expect("create the stream");
        Self::Nats {
            js,
            stream,
            subject,
        }
    }

    pub(crate) fn name(&self) -> &'static str {
        match self {
            Self::RabbitMq { .. } => "RabbitMQ",
            Self::Nats { .. } => "NATS",
        }
    }

    /// The crate's sender for this broker, wired as a user wires it, counting into `confirmed`;
    /// with `nowhere`, a sender that publishes nothing.
    pub(crate) async fn sender(&self, confirmed: Arc<AtomicUsize>, nowhere: bool) -> Publish {
        let to = match self {
            _ if nowhere => PublishTo::Nowhere,
            Self::RabbitMq {
                connection,
                exchange,
                ..
            } => PublishTo::RabbitMq(
                RabbitMqSender::with_connection(connection.clone(), exchange.clone())
                    .await
                    .expect("RabbitMQ sender"),
            ),
            Self::Nats { js, subject, .. } => {
                PublishTo::Nats(NatsSender::new(js.clone()).route(TOPIC, subject.clone()))
            }
        };
        Publish {
            to,
            confirmed,
            acks: None,
        }
    }

    /// Publishes `messages` straight to the broker, `window` at a time, each waiting for its
    /// confirm; returns the time from the first publish to the last confirm.
    pub(crate) async fn bare(
        &self,
        messages: &[(DownstreamKey, Vec<u8>)],
        window: usize,
    ) -> Duration {
        let failed = AtomicUsize::new(0);
        let failed = &failed;
        let elapsed = match self {
            Self::RabbitMq {
                connection,
                exchange,
                ..
            } => {
                // A channel of its own in confirm mode, as the relay's sender has.
                let channel = connection.create_channel().await.expect("channel");
                channel
                    .confirm_select(ConfirmSelectOptions::default())
                    .await
                    .expect("confirm mode");
                let confirming = &channel;
                let started = Instant::now();
                futures_util::stream::iter(messages)
                    .for_each_concurrent(window, |(key, payload)| async move {
                        let properties = BasicProperties::default()
                            .with_message_id(key.as_str().into())
                            .with_delivery_mode(2);
                        let confirmed = async {
                            let confirm = confirming
                                .basic_publish(
                                    exchange.as_str().into(),
                                    TOPIC.into(),
                                    BasicPublishOptions {
                                        mandatory: true,
                                        ..Default::default()
                                    },
                                    payload,
                                    properties,
                                )
                                .await?;
                            let confirmation = confirm.await?;
                            Ok::<_, lapin::Error>(
                                confirmation.is_ack() && confirmation.take_message().is_none(),
                            )
                        };
                        if !matches!(confirmed.await, Ok(true)) {
                            failed.fetch_add(1, Ordering::Relaxed);
                        }
                    })
                    .await;
                let elapsed = started.elapsed();
                let _ = channel.close(200, "done".into()).await;
                elapsed
            }
            Self::Nats { js, subject, .. } => {
                let started = Instant::now();
                futures_util::stream::iter(messages)
                    .for_each_concurrent(window, |(key, payload)| async move {
                        let mut headers = async_nats::HeaderMap::new();
                        headers.insert(async_nats::header::NATS_MESSAGE_ID, key.as_str());
                        let acked = async {
                            let ack = js
                                .publish_with_headers(
                                    subject.clone(),
                                    headers,
                                    Bytes::copy_from_slice(payload),
                                )
                                .await?;
                            Ok::<_, async_nats::Error>(!ack.await?.duplicate)
                        };
                        if !matches!(acked.await, Ok(true)) {
                            failed.fetch_add(1, Ordering::Relaxed);
                        }
                    })
                    .await;
                started.elapsed()
            }
        };
        let failed = failed.load(Ordering::Relaxed);
        if failed > 0 {
            // Verification reports the shortfall; this says where it came from.
            eprintln!("bare publisher: {failed} publishes not confirmed");
        }
        elapsed
    }

    /// Checks that the broker holds exactly the `expected` message ids, each once, then empties
    /// the destination for the next run.
    pub(crate) async fn verify_and_empty(&self, expected: &HashSet<String>) -> Result<(), String> {
        let wanted = expected.len();
        let mut seen = HashSet::with_capacity(wanted);
        let mut duplicates = 0;
        let held = match self {
            Self::RabbitMq { channel, queue, .. } => {
                let depth = channel
                    .queue_declare(
                        queue.as_str().into(),
                        QueueDeclareOptions {
                            passive: true,
                            ..Default::default()
                        },
                        FieldTable::default(),
                    )
                    .await
                    .map_err(|e| format!("queue depth: {e}"))?
                    .message_count() as usize;
                // Only what the queue holds is read, so a shortfall cannot hang the read.
                let mut consumer = channel
                    .basic_consume(
                        queue.as_str().into(),
                        "outbench-verify".into(),
                        BasicConsumeOptions {
                            no_ack: true,
                            ..Default::default()
                        },
                        FieldTable::default(),
                    )
                    .await
                    .map_err(|e| format!("consume: {e}"))?;
                for _ in 0..depth {
                    let delivery = tokio::time::timeout(Duration::from_secs(10), consumer.next())
                        .await
                        .map_err(|_| "the queue stopped delivering".to_owned())?
                        .ok_or("the consumer ended")?
                        .map_err(|e| format!("delivery: {e}"))?;
                    let id = delivery
                        .properties
                        .message_id()
                        .as_ref()
                        .map(|id| id.as_str().to_owned())
                        .unwrap_or_default();
                    if !seen.insert(id) {
                        duplicates += 1;
                    }
                }
                channel
                    .basic_cancel("outbench-verify".into(), Default::default())
                    .await
                    .map_err(|e| format!("cancel: {e}"))?;
                channel
                    .queue_purge(queue.as_str().into(), QueuePurgeOptions::default())
                    .await
                    .map_err(|e| format!("purge: {e}"))?;
                depth
            }
            Self::Nats { js, stream, .. } => {
                let mut handle = js
                    .get_stream(stream)
                    .await
                    .map_err(|e| format!("stream: {e}"))?;
                let held = handle
                    .info()
                    .await
                    .map_err(|e| format!("stream info: {e}"))?
                    .state
                    .messages as usize;
                let consumer = handle
                    .create_consumer(pull::OrderedConfig::default())
                    .await
                    .map_err(|e| format!("ordered consumer: {e}"))?;
                let mut messages = consumer
                    .messages()
                    .await
                    .map_err(|e| format!("read back: {e}"))?;
                for _ in 0..held {
                    let message = tokio::time::timeout(Duration::from_secs(10), messages.next())
                        .await
                        .map_err(|_| "the stream stopped delivering".to_owned())?
                        .ok_or("the consumer ended")?
                        .map_err(|e| format!("read back: {e}"))?;
                    let id = message
                        .headers
                        .as_ref()
                        .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
                        .map(|id| id.as_str().to_owned())
                        .unwrap_or_default();
                    if !seen.insert(id) {
                        duplicates += 1;
                    }
                }
                drop(messages);
                handle.purge().await.map_err(|e| format!("purge: {e}"))?;
                held
            }
        };
        let missing = expected.difference(&seen).count();
        let foreign = seen.difference(expected).count();
        if held != wanted || missing > 0 || foreign > 0 || duplicates > 0 {
            return Err(format!(
                "{}: held {held} for {wanted} sent ({missing} missing, {foreign} unexpected, \
                 {duplicates} duplicates)",
                self.name()
            ));
        }
        Ok(())
    }

    pub(crate) async fn delete(self) {
        match self {
            Self::RabbitMq {
                channel,
                exchange,
                queue,
                connection,
            } => {
                let _ = channel
                    .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                    .await;
                let _ = channel
                    .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
                    .await;
                let _ = connection.close(0, "bench done".into()).await;
            }
            Self::Nats { js, stream, .. } => {
                let _ = js.delete_stream(&stream).await;
            }
        }
    }
}

/// The crate's broker senders behind one type, counting the confirms they return so the bench
/// knows when the broker has them all without polling the database meanwhile.
pub(crate) struct Publish {
    to: PublishTo,
    confirmed: Arc<AtomicUsize>,
    /// When each send began, and when each confirmation came back.
    acks: Option<(Acks, Acks)>,
}

/// An instant per message, by downstream key.
pub(crate) type Acks = Arc<Mutex<HashMap<String, Instant>>>;

impl Publish {
    /// Also records when each send began, in `sends`, and when its confirmation came back, in
    /// `acks`.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn recording(mut self, sends: Acks, acks: Acks) -> Self {
        self.acks = Some((sends, acks));
        self
    }
}

enum PublishTo {
    RabbitMq(RabbitMqSender),
    Nats(NatsSender),
    /// Confirms at once without publishing: what is left is the dispatcher's own work.
    Nowhere,
}

impl Sender for Publish {
    async fn send(&self, message: &OutboxRecord) -> SendOutcome {
        if let Some((sends, _)) = &self.acks {
            let at = Instant::now();
            let key = message.downstream_key.as_str().to_owned();
            sends.lock().expect("sends").insert(key, at);
        }
        let outcome = match &self.to {
            PublishTo::RabbitMq(sender) => sender.send(message).await,
            PublishTo::Nats(sender) => sender.send(message).await,
            PublishTo::Nowhere => SendOutcome::Delivered {
                receipt: String::new(),
            },
        };
        if matches!(outcome, SendOutcome::Delivered { .. }) {
            if let Some((_, acks)) = &self.acks {
                let at = Instant::now();
                let key = message.downstream_key.as_str().to_owned();
                acks.lock().expect("acks").insert(key, at);
            }
            self.confirmed.fetch_add(1, Ordering::Relaxed);
        }
        outcome
    }

    async fn lookup(&self, message: &OutboxRecord) -> LookupOutcome {
        match &self.to {
            PublishTo::RabbitMq(sender) => sender.lookup(message).await,
            PublishTo::Nats(sender) => sender.lookup(message).await,
            PublishTo::Nowhere => LookupOutcome::Unsupported,
        }
    }
}
