//! The dispatcher after a broker outage: messages paused by it go as soon as the sender's
//! client has reconnected, not at the next probe. The test's own forwarder stands between each
//! sender and the shared broker, and is pointed at a dead address to cut the link and back to
//! restore it. Apart from `outbox_outage`: these senders log from the runtime's worker threads,
//! which would race that suite's per-thread log capture for the same lines.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use axum_idempotency::outbox::{
    Backoff, Dispatcher, DownstreamKey, Message, RabbitMqSender, Sender, Status,
};
use common::sends::nats_sender;
use common::sqlite::TempOutbox;
use common::vip::{Vip, dead_address};
use common::{nats, rabbitmq};
use tokio::time::Instant;

/// A probe backoff of an hour: after an outage, only the sender's word that it reconnected can
/// explain a delivery within `DRAINED` of the broker's return.
const PROBE_CAP: Duration = Duration::from_secs(3600);

/// Far below `PROBE_CAP`, and above the senders' reconnection backoff (at most 5 s) with room.
const DRAINED: Duration = Duration::from_secs(30);

/// Messages of `topic` enqueued while the link under `sender` is cut pause the dispatcher; once
/// the link is back, they are delivered as soon as the sender has reconnected, not at the
/// dispatcher's next probe.
async fn drains_once_the_sender_reconnects(
    vip: &Vip,
    broker: SocketAddr,
    sender: impl Sender,
    topic: &str,
) {
    let temp = TempOutbox::new().await;
    let outbox = &temp.outbox;
    let dispatcher = Dispatcher::new(outbox.clone(), sender)
        .poll_interval(Duration::from_millis(200))
        .probe_backoff(Backoff::exponential(PROBE_CAP, PROBE_CAP));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(dispatcher.run(async {
        let _ = stopped.await;
    }));

    vip.move_to(dead_address().await);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut ids = Vec::new();
    for n in 0..5 {
        let key = DownstreamKey::new(common::unique(&format!("drain{n}"))).unwrap();
        let message = Message::json(topic, key, &serde_json::json!({ "amount": n })).unwrap();
        ids.push(temp.enqueue(message).await);
    }
    outbox.wake();
    // Paused: a send found the broker unreachable.
    loop {
        let record = outbox.status(ids[0]).await.unwrap().unwrap();
        if record
            .last_error
            .as_deref()
            .is_some_and(|error| error.starts_with("unavailable"))
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Long enough for the sender to fail a few reconnection attempts.
    tokio::time::sleep(Duration::from_secs(2)).await;

    vip.move_to(broker);
    let back = Instant::now();
    for id in ids {
        loop {
            let record = outbox.status(id).await.unwrap().unwrap();
            if record.status == Status::Delivered {
                break;
            }
            assert!(
                back.elapsed() < DRAINED,
                "not delivered within {DRAINED:?} of the broker's return: {record:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let _ = stop.send(());
    running.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_messages_paused_by_an_outage_go_as_soon_as_the_sender_reconnects() {
    let broker: SocketAddr = rabbitmq::ADDRESS.parse().unwrap();
    let admin = rabbitmq::connect().await;
    let exchange = common::unique("outbox.drain");
    let queue = common::unique("outbox.drain");
    let vip = Vip::start(broker).await;
    let sender = RabbitMqSender::connect(
        &format!("amqp://guest:guest@{}/%2f?heartbeat=5", vip.addr),
        exchange.as_str(),
    )
    .await
    .unwrap();
    sender.declare().await.unwrap();
    let channel = admin.create_channel().await.unwrap();
    rabbitmq::bind_queue(&channel, &queue, &exchange, "payment.succeeded", false).await;

    drains_once_the_sender_reconnects(&vip, broker, sender, "payment.succeeded").await;

    rabbitmq::delete(&channel, [&queue], &exchange).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_messages_paused_by_an_outage_go_as_soon_as_the_client_reconnects() {
    let broker: SocketAddr = nats::ADDRESS.parse().unwrap();
    let vip = Vip::start(broker).await;
    let (sender, stream) = nats_sender(vip.addr, "OUTBOX_DRAIN").await;

    drains_once_the_sender_reconnects(&vip, broker, sender, "payment.succeeded").await;

    nats::delete(&nats::connect().await, [&stream]).await;
}
