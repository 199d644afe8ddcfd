//! A broker sender's sends as the dispatcher makes them: a stored message to send, and a send
//! that must answer promptly.

use std::net::SocketAddr;
use std::time::Duration;

use axum_idempotency::outbox::{
    DownstreamKey, Message, NatsSender, OutboxRecord, RabbitMqSender, SendOutcome, Sender,
};
use tokio::time::Instant;

use super::sqlite::TempOutbox;

/// How long a send may take while the broker is away: it must not wait for the broker.
pub(crate) const PROMPT: Duration = Duration::from_secs(3);

/// A stored outbox message of `topic`, as the dispatcher hands it to a sender, and the
/// outbox it is stored in.
pub(crate) async fn record(topic: &str) -> (OutboxRecord, TempOutbox) {
    let outbox = TempOutbox::new().await;
    let key = DownstreamKey::new(super::unique("outage")).unwrap();
    let message = Message::json(topic, key, &serde_json::json!({ "amount": 1250 })).unwrap();
    (outbox.record(message).await, outbox)
}

/// One send, which must end within [`PROMPT`].
pub(crate) async fn send_promptly(sender: &impl Sender, record: &OutboxRecord) -> SendOutcome {
    let started = Instant::now();
    let outcome = tokio::time::timeout(PROMPT, sender.send(record))
        .await
        .unwrap_or_else(|_| panic!("a send during the outage took over {PROMPT:?}"));
    assert!(started.elapsed() < PROMPT);
    outcome
}

/// Sends `record` until it is delivered, each send answering unavailable until then; panics
/// unless that happens within 20 s of the call, the broker being back.
pub(crate) async fn delivered_once_back(sender: &impl Sender, record: &OutboxRecord) {
    let back = Instant::now();
    loop {
        match send_promptly(sender, record).await {
            SendOutcome::Delivered { .. } => return,
            SendOutcome::Unavailable { .. } => {}
            other => panic!("after the broker's return: {other:?}"),
        }
        assert!(
            back.elapsed() < Duration::from_secs(20),
            "not delivered within 20 s of the broker's return"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A NATS sender reaching the shared server at `addr`, routing `payment.succeeded` to a
/// stream of its own named from `prefix`; and the stream's name, for the test to delete.
pub(crate) async fn nats_sender(addr: SocketAddr, prefix: &str) -> (NatsSender, String) {
    let stream = super::unique(prefix);
    let subject = format!("{stream}.paid");
    let sender = NatsSender::connect(&format!("nats://{addr}"))
        .await
        .unwrap()
        .route("payment.succeeded", subject.as_str());
    sender
        .declare_stream(&stream, [format!("{stream}.>")])
        .await
        .unwrap();
    (sender, stream)
}

/// A RabbitMQ sender reaching the shared broker at `addr` (`query` ends its URI: `?heartbeat=5`,
/// or empty for the sender's default), on an exchange of its own with a queue bound for
/// `payment.succeeded`.
pub(crate) struct RabbitTarget {
    pub(crate) sender: RabbitMqSender,
    channel: lapin::Channel,
    exchange: String,
    queue: String,
}

impl RabbitTarget {
    pub(crate) async fn connect(addr: SocketAddr, query: &str, prefix: &str) -> Self {
        let exchange = super::unique(prefix);
        let queue = super::unique(prefix);
        let uri = format!("amqp://guest:guest@{addr}/%2f{query}");
        let sender = RabbitMqSender::connect(&uri, exchange.as_str())
            .await
            .unwrap();
        sender.declare().await.unwrap();
        let channel = super::rabbitmq::connect()
            .await
            .create_channel()
            .await
            .unwrap();
        super::rabbitmq::bind_queue(&channel, &queue, &exchange, "payment.succeeded", true).await;
        Self {
            sender,
            channel,
            exchange,
            queue,
        }
    }

    /// Deletes the test's queue and exchange.
    pub(crate) async fn delete(self) {
        super::rabbitmq::delete(&self.channel, [&self.queue], &self.exchange).await;
    }
}
