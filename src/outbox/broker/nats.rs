//! An outbox [`Sender`] that publishes to NATS JetStream with `Nats-Msg-Id`.

use std::collections::HashMap;

use async_nats::HeaderMap;
use async_nats::connection::State;
use async_nats::jetstream::Context;
use async_nats::jetstream::context::PublishErrorKind;

use crate::outbox::{OutboxRecord, Reconnected, SendOutcome, Sender};

/// Publishes outbox messages to JetStream, waiting for the stream's ack on every attempt.
///
/// The message's [downstream key](OutboxRecord::downstream_key) travels as `Nats-Msg-Id`, so the
/// stream's own duplicate window drops a resend (an ack lost in transit, a dispatcher that
/// died after publishing) and consumers see the message once; past that window, the consumer
/// side's dedupe (see the `inbox` module) still applies it once. Keep the stream's duplicate
/// window (2 minutes by default) above the dispatcher's send timeout plus its backoff, so the
/// usual resends fall inside it. The subject is the message's topic, or what
/// [`route`](Self::route) maps it to.
///
/// A server that restarts is waited out: the async-nats client reconnects by itself (a sender
/// made with [`connect`](Self::connect) with a jittered backoff, up to 100 ms doubling to 5 s,
/// and it tells the dispatcher when it is connected again, which then probes the paused
/// subjects at once; see [`Sender::reconnected`]). That client pings the server every 5 s and
/// drops a connection gone silent (a server host that lost power, a partition that sends no
/// reset) within about 15 s: with async-nats' default of a minute it took up to three, each
/// publish meanwhile waiting out its ack, an unknown outcome that counts as an attempt (give a
/// client of your own the same, `ConnectOptions::ping_interval`). While the client is not
/// connected, a send publishes nothing and answers [`SendOutcome::Unavailable`] at once (a
/// publish queued then would leave whenever the client is back); so does a publish that no
/// stream answers (no responders: no stream captures the subject, or its stream has no leader)
/// and one the client could not queue in time. A publish whose ack does not come (within the
/// JetStream context's timeout, 5 s by default) is an unknown outcome, sent again later with
/// the same `Nats-Msg-Id`.
///
/// ```no_run
/// # async fn run(outbox: axum_idempotency::outbox::Outbox<sqlx::Sqlite>) -> Result<(), async_nats::Error> {
/// use axum_idempotency::outbox::{Dispatcher, NatsSender};
///
/// let sender = NatsSender::connect("nats://127.0.0.1:4222")
///     .await?
///     .route("payment.succeeded", "payments.succeeded");
/// sender.declare_stream("PAYMENTS", ["payments.>"]).await?;
/// tokio::spawn(Dispatcher::new(outbox, sender).run(std::future::pending()));
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct NatsSender {
    jetstream: Context,
    routes: HashMap<String, String>,
    /// Raised on each connection of the sender's own client.
    reconnected: Option<Reconnected>,
}

impl NatsSender {
    /// A sender publishing through `jetstream`.
    pub fn new(jetstream: Context) -> Self {
        Self {
            jetstream,
            routes: HashMap::new(),
            reconnected: None,
        }
    }

    /// A sender on a client of its own, connected to `url` now (an unreachable server fails
    /// here), that reconnects by itself with a jittered backoff and says so to the dispatcher
    /// (see [`Sender::reconnected`]).
    pub async fn connect(url: &str) -> Result<Self, async_nats::ConnectError> {
        let reconnected = Reconnected::new();
        let signal = reconnected.clone();
        let client = crate::broker::nats_options()
            .event_callback(move |event| {
                let signal = signal.clone();
                async move {
                    if matches!(event, async_nats::Event::Connected) {
                        signal.raise();
                    }
                }
            })
            .connect(url)
            .await?;
        let mut sender = Self::new(async_nats::jetstream::new(client));
        sender.reconnected = Some(reconnected);
        Ok(sender)
    }

    /// Creates the stream `name` capturing `subjects`, unless a stream of that name exists: one
    /// made beforehand (by the consumer side, or by an operator with other settings) is used as
    /// it is. Idempotent: call it at start, before the first message is sent.
    pub async fn declare_stream<I, T>(
        &self,
        name: &str,
        subjects: I,
    ) -> Result<(), async_nats::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<String>,
    {
        let config = async_nats::jetstream::stream::Config {
            name: name.to_owned(),
            subjects: subjects.into_iter().map(Into::into).collect(),
            ..Default::default()
        };
        self.jetstream.get_or_create_stream(config).await?;
        Ok(())
    }

    /// Publishes messages of `topic` on `subject` (default: the topic itself).
    #[must_use]
    pub fn route(mut self, topic: impl Into<String>, subject: impl Into<String>) -> Self {
        self.routes.insert(topic.into(), subject.into());
        self
    }
}

impl Sender for NatsSender {
    async fn send(&self, message: &OutboxRecord) -> SendOutcome {
        let subject = self
            .routes
            .get(&message.topic)
            .cloned()
            .unwrap_or_else(|| message.topic.clone());
        let state = self.jetstream.client().connection_state();
        if state != State::Connected {
            return SendOutcome::Unavailable {
                after: None,
                reason: format!("the NATS client is not connected ({state})"),
            };
        }
        let mut headers = HeaderMap::new();
        headers.insert(
            async_nats::header::NATS_MESSAGE_ID,
            message.downstream_key.as_str(),
        );
        let published = self
            .jetstream
            .publish_with_headers(subject, headers, message.payload.clone().into())
            .await;
        let ack = match published {
            Ok(ack) => ack,
            // Not handed to the connection in time, or the connection went meanwhile: nothing
            // left. (Other errors here are the client's own refusals: a subject it rejects,
            // too many acks pending, a payload over the server's maximum.)
            Err(error)
                if error.kind() == PublishErrorKind::TimedOut
                    || self.jetstream.client().connection_state() != State::Connected =>
            {
                return SendOutcome::Unavailable {
                    after: None,
                    reason: format!("publish failed: {error}"),
                };
            }
            Err(error) => {
                return SendOutcome::Retry {
                    after: None,
                    reason: format!("publish failed: {error}"),
                };
            }
        };
        match ack.await {
            Ok(ack) => SendOutcome::Delivered {
                receipt: format!("{}:{}", ack.stream, ack.sequence),
            },
            // No responders: the server answered that no stream took it, so nothing was stored.
            Err(error) if error.kind() == PublishErrorKind::StreamNotFound => {
                SendOutcome::Unavailable {
                    after: None,
                    reason: format!("no stream took it: {error}"),
                }
            }
            // Possibly stored: a resend with the same Nats-Msg-Id is dropped by the stream if so.
            Err(error) => SendOutcome::Unknown {
                reason: format!("no ack from the stream: {error}"),
            },
        }
    }

    fn reconnected(&self) -> Option<Reconnected> {
        self.reconnected.clone()
    }
}
