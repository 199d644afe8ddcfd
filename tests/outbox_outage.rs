//! The broker senders through an outage: the test's own forwarder stands between each sender
//! and the shared broker, and is pointed at a dead address to cut the link (open connections
//! are reset, new ones accepted and reset at once, as behind a load balancer whose broker is
//! down) and back to restore it. Every name on the shared brokers is the test's own.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use axum_idempotency::outbox::{
    DownstreamKey, Message, NatsSender, OutboxRecord, RabbitMqSender, SendOutcome, Sender,
};
use common::logs::Captured;
use common::silent::FaultProxy;
use common::sqlite::TempOutbox;
use common::vip::{Vip, dead_address};
use common::{nats, rabbitmq};
use tokio::time::Instant;

/// How long a send may take while the broker is away: it must not wait for the broker.
const PROMPT: Duration = Duration::from_secs(3);
/// The examples' send timeout (the dispatcher's default is 30 s): a send the dispatcher waits
/// no longer for is an unknown outcome.
const SEND_TIMEOUT: Duration = Duration::from_secs(5);

/// A stored outbox message of `topic`, as the dispatcher hands it to a sender, and the
/// outbox it is stored in.
async fn record(topic: &str) -> (OutboxRecord, TempOutbox) {
    let outbox = TempOutbox::new().await;
    let key = DownstreamKey::new(common::unique("outage")).unwrap();
    let message = Message::json(topic, key, &serde_json::json!({ "amount": 1250 })).unwrap();
    (outbox.record(message).await, outbox)
}

/// One send, which must end within `PROMPT`.
async fn send_promptly(sender: &impl Sender, record: &OutboxRecord) -> SendOutcome {
    let started = Instant::now();
    let outcome = tokio::time::timeout(PROMPT, sender.send(record))
        .await
        .unwrap_or_else(|_| panic!("a send during the outage took over {PROMPT:?}"));
    assert!(started.elapsed() < PROMPT);
    outcome
}

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
    let back = Instant::now();
    loop {
        match send_promptly(sender, record).await {
            SendOutcome::Delivered { .. } => break,
            SendOutcome::Unavailable { .. } => {}
            other => panic!("after the outage: {other:?}"),
        }
        assert!(
            back.elapsed() < Duration::from_secs(20),
            "not delivered within 20 s of the broker's return"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
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
    let admin = rabbitmq::connect().await;
    let exchange = common::unique("outbox.outage");
    let queue = common::unique("outbox.outage");
    let vip = Vip::start(broker).await;
    let sender = RabbitMqSender::connect(
        &format!("amqp://guest:guest@{}/%2f?heartbeat=5", vip.addr),
        exchange.as_str(),
    )
    .await
    .unwrap();
    sender.declare().await.unwrap();
    let channel = admin.create_channel().await.unwrap();
    rabbitmq::bind_queue(&channel, &queue, &exchange, "payment.succeeded", true).await;
    let (record, _dir) = record("payment.succeeded").await;

    through_an_outage(&vip, broker, &sender, &record).await;

    assert_eq!(captured.lines("RabbitMQ sender lost its connection"), 1);
    assert_eq!(captured.lines("RabbitMQ sender reconnected"), 1);
    assert_eq!(captured.lines("could not reconnect"), 0);

    rabbitmq::delete(&channel, [&queue], &exchange).await;
}

#[tokio::test]
async fn nats_sends_during_an_outage_are_unavailable_and_deliver_once_it_is_back() {
    let broker: SocketAddr = nats::ADDRESS.parse().unwrap();
    let vip = Vip::start(broker).await;
    let stream = common::unique("OUTBOX_OUTAGE");
    let subject = format!("{stream}.paid");
    let sender = NatsSender::connect(&format!("nats://{}", vip.addr))
        .await
        .unwrap()
        .route("payment.succeeded", subject.as_str());
    sender
        .declare_stream(&stream, [format!("{stream}.>")])
        .await
        .unwrap();
    let (record, _dir) = record("payment.succeeded").await;

    through_an_outage(&vip, broker, &sender, &record).await;

    nats::delete(&nats::connect().await, [&stream]).await;
}

/// The link to NATS goes silent, as when the server's host loses power or a partition sends no
/// reset: nothing comes back and the connection stays open. A publish then waits out its ack
/// (5 s) and answers an unknown outcome, which the dispatcher counts as an attempt, so the
/// sender must find the link out soon and answer that the broker is unavailable, an outage,
/// until it is back. With async-nats' default pings (every minute, stale after three) that
/// took up to three minutes, ten attempts and more at the examples' settings.
#[tokio::test]
async fn a_silent_nats_link_is_found_out_and_waited_out_as_an_outage() {
    let broker: SocketAddr = nats::ADDRESS.parse().unwrap();
    let proxy = FaultProxy::start(&broker.to_string()).await;
    let stream = common::unique("OUTBOX_SILENT");
    let subject = format!("{stream}.paid");
    let sender = NatsSender::connect(&format!("nats://{}", proxy.addr))
        .await
        .unwrap()
        .route("payment.succeeded", subject.as_str());
    sender
        .declare_stream(&stream, [format!("{stream}.>")])
        .await
        .unwrap();
    let (record, _dir) = record("payment.succeeded").await;
    let delivered = sender.send(&record).await;
    assert!(
        matches!(delivered, SendOutcome::Delivered { .. }),
        "{delivered:?}"
    );

    proxy.blackhole(true);
    let silent = Instant::now();
    let mut unknown = 0;
    loop {
        match sender.send(&record).await {
            SendOutcome::Unavailable { .. } => break,
            SendOutcome::Unknown { .. } => unknown += 1,
            other => panic!("while the link is silent: {other:?}"),
        }
        assert!(
            silent.elapsed() < Duration::from_secs(25),
            "still not found out after {:?} of silence ({unknown} unknown outcomes)",
            silent.elapsed()
        );
    }
    assert!(
        unknown <= 3,
        "{unknown} unknown outcomes before the outage was found"
    );
    // Found out, every send is an outage, answered at once.
    for _ in 0..5 {
        let outcome = send_promptly(&sender, &record).await;
        assert!(
            matches!(outcome, SendOutcome::Unavailable { .. }),
            "{outcome:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    proxy.blackhole(false);
    let back = Instant::now();
    loop {
        match send_promptly(&sender, &record).await {
            SendOutcome::Delivered { .. } => break,
            SendOutcome::Unavailable { .. } => {}
            other => panic!("after the link healed: {other:?}"),
        }
        assert!(
            back.elapsed() < Duration::from_secs(20),
            "not delivered within 20 s of the link's return"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    nats::delete(&nats::connect().await, [&stream]).await;
}

/// The same silence under the RabbitMQ sender: its connection's heartbeat (10 s unless the URL
/// sets one) finds the link out, and sends answer that the broker is unavailable until it is
/// back. A send the dispatcher gives up on after its send timeout (5 s in the examples) is an
/// unknown outcome, an attempt: only a few may pass before the outage is known.
#[tokio::test]
async fn a_silent_rabbitmq_link_is_found_out_and_waited_out_as_an_outage() {
    let broker: SocketAddr = rabbitmq::ADDRESS.parse().unwrap();
    let admin = rabbitmq::connect().await;
    let exchange = common::unique("outbox.silent");
    let queue = common::unique("outbox.silent");
    let proxy = FaultProxy::start(&broker.to_string()).await;
    let sender = RabbitMqSender::connect(
        &format!("amqp://guest:guest@{}/%2f", proxy.addr),
        exchange.as_str(),
    )
    .await
    .unwrap();
    sender.declare().await.unwrap();
    let channel = admin.create_channel().await.unwrap();
    rabbitmq::bind_queue(&channel, &queue, &exchange, "payment.succeeded", true).await;
    let (record, _dir) = record("payment.succeeded").await;
    let delivered = sender.send(&record).await;
    assert!(
        matches!(delivered, SendOutcome::Delivered { .. }),
        "{delivered:?}"
    );

    proxy.blackhole(true);
    let silent = Instant::now();
    let mut unknown = 0;
    loop {
        match tokio::time::timeout(SEND_TIMEOUT, sender.send(&record)).await {
            Ok(SendOutcome::Unavailable { .. }) => break,
            Ok(SendOutcome::Unknown { .. }) | Err(_) => unknown += 1,
            Ok(other) => panic!("while the link is silent: {other:?}"),
        }
        assert!(
            silent.elapsed() < Duration::from_secs(40),
            "still not found out after {:?} of silence ({unknown} unknown outcomes)",
            silent.elapsed()
        );
    }
    eprintln!(
        "found out after {:?}, {unknown} unknown outcomes",
        silent.elapsed()
    );
    assert!(
        unknown <= 6,
        "{unknown} unknown outcomes before the outage was found"
    );

    proxy.blackhole(false);
    let back = Instant::now();
    loop {
        match send_promptly(&sender, &record).await {
            SendOutcome::Delivered { .. } => break,
            SendOutcome::Unavailable { .. } => {}
            other => panic!("after the link healed: {other:?}"),
        }
        assert!(
            back.elapsed() < Duration::from_secs(20),
            "not delivered within 20 s of the link's return"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    rabbitmq::delete(&channel, [&queue], &exchange).await;
}
