//! The broker senders through an outage: the test's own forwarder stands between each sender
//! and the shared broker, and is pointed at a dead address to cut the link (open connections
//! are reset, new ones accepted and reset at once, as behind a load balancer whose broker is
//! down) and back to restore it. Every name on the shared brokers is the test's own.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use axum_idempotency::outbox::{OutboxRecord, SendOutcome, Sender};
use common::logs::Captured;
use common::sends::{RabbitTarget, delivered_once_back, nats_sender, record, send_promptly};
use common::vip::{Vip, dead_address};
use common::{nats, rabbitmq};
use tokio::time::Instant;

/// Cuts the link under `sender`, then checks that its sends are unavailable, promptly and
/// every time, and that once the link is back a send is delivered.
async fn through_an_outage(
    vip: &Vip,
    broker: SocketAddr,
    sender: &impl Sender,
    record: &OutboxRecord,
) {
    let delivered = sender.send(record).await;
    assert!(
        matches!(delivered, SendOutcome::Delivered { .. }),
        "{delivered:?}"
    );

    vip.move_to(dead_address().await);
    // The reset reaches the client at once; give its I/O a moment to see it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let outage = Instant::now();
    while outage.elapsed() < Duration::from_secs(3) {
        let outcome = send_promptly(sender, record).await;
        assert!(
            matches!(outcome, SendOutcome::Unavailable { after: None, .. }),
            "{outcome:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    vip.move_to(broker);
    delivered_once_back(sender, record).await;
}

/// The sender's reconnecting task runs on the test's current-thread runtime, so the
/// subscriber set for this thread sees its lines (lapin's I/O thread is not watched here).
#[tokio::test]
async fn rabbitmq_sends_during_an_outage_are_unavailable_and_one_warning_and_one_info_are_logged() {
    let captured = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(captured.clone())
        .with_max_level(tracing::Level::INFO)
        .with_ansi(false)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let broker: SocketAddr = rabbitmq::ADDRESS.parse().unwrap();
    let vip = Vip::start(broker).await;
    let target = RabbitTarget::connect(vip.addr, "?heartbeat=5", "outbox.outage").await;
    let (record, _dir) = record("payment.succeeded").await;

    through_an_outage(&vip, broker, &target.sender, &record).await;

    assert_eq!(captured.lines("RabbitMQ sender lost its connection"), 1);
    assert_eq!(captured.lines("RabbitMQ sender reconnected"), 1);
    assert_eq!(captured.lines("could not reconnect"), 0);

    target.delete().await;
}

#[tokio::test]
async fn nats_sends_during_an_outage_are_unavailable_and_deliver_once_it_is_back() {
    let broker: SocketAddr = nats::ADDRESS.parse().unwrap();
    let vip = Vip::start(broker).await;
    let (sender, stream) = nats_sender(vip.addr, "OUTBOX_OUTAGE").await;
    let (record, _dir) = record("payment.succeeded").await;

    through_an_outage(&vip, broker, &sender, &record).await;

    nats::delete(&nats::connect().await, [&stream]).await;
}
