//! The outbox senders declare what they publish to on the shared RabbitMQ and NATS servers:
//! idempotently, and using as it is what someone made beforehand. Every name is the test's
//! own, deleted afterwards.

mod common;

use async_nats::jetstream::stream::Config;
use axum_idempotency::outbox::{NatsSender, RabbitMqSender};
use common::{nats, rabbitmq};
use lapin::options::ExchangeDeclareOptions;
use lapin::types::FieldTable;
use lapin::{Connection, ExchangeKind};

/// Whether `exchange` exists with exactly these settings: a declare with other ones fails.
async fn exchange_is(
    connection: &Connection,
    exchange: &str,
    kind: ExchangeKind,
    durable: bool,
) -> bool {
    let channel = connection.create_channel().await.unwrap();
    let options = ExchangeDeclareOptions {
        durable,
        ..ExchangeDeclareOptions::default()
    };
    let declared = channel.exchange_declare(exchange.into(), kind, options, FieldTable::default());
    declared.await.is_ok()
}

#[tokio::test]
async fn rabbitmq_sender_declares_a_durable_topic_exchange_once_and_keeps_an_existing_one() {
    let connection = rabbitmq::connect().await;
    let made_here = common::unique("outbox.declare");
    let sender = RabbitMqSender::connect(rabbitmq::URL, made_here.as_str())
        .await
        .unwrap();
    sender.declare().await.unwrap();
    sender.declare().await.unwrap();
    assert!(exchange_is(&connection, &made_here, ExchangeKind::Topic, true).await);

    // An operator's transient fanout exchange: the sender publishes to it as it is.
    let made_before = common::unique("outbox.declare");
    assert!(exchange_is(&connection, &made_before, ExchangeKind::Fanout, false).await);
    let sender = RabbitMqSender::connect(rabbitmq::URL, made_before.as_str())
        .await
        .unwrap();
    sender.declare().await.unwrap();
    assert!(exchange_is(&connection, &made_before, ExchangeKind::Fanout, false).await);

    let channel = connection.create_channel().await.unwrap();
    for exchange in [made_here, made_before] {
        rabbitmq::delete_exchange(&channel, &exchange).await;
    }
}

#[tokio::test]
async fn nats_sender_declares_its_stream_once_and_keeps_an_existing_one() {
    let jetstream = nats::connect().await;
    let made_here = common::unique("OUTBOX_DECLARE");
    let subject = format!("{made_here}.events.>");
    let sender = NatsSender::connect(nats::URL).await.unwrap();
    sender
        .declare_stream(&made_here, [subject.as_str()])
        .await
        .unwrap();
    sender
        .declare_stream(&made_here, [subject.as_str()])
        .await
        .unwrap();
    let stream = jetstream.get_stream(&made_here).await.unwrap();
    assert_eq!(stream.cached_info().config.subjects, [subject]);

    let made_before = common::unique("OUTBOX_DECLARE");
    let theirs = format!("{made_before}.theirs.>");
    let config = Config {
        name: made_before.clone(),
        subjects: vec![theirs.clone()],
        ..Config::default()
    };
    jetstream.create_stream(config).await.unwrap();
    let ours = format!("{made_before}.ours.>");
    sender.declare_stream(&made_before, [ours]).await.unwrap();
    let stream = jetstream.get_stream(&made_before).await.unwrap();
    assert_eq!(
        stream.cached_info().config.subjects,
        [theirs],
        "used as it is"
    );

    nats::delete(&jetstream, [made_here, made_before]).await;
}
