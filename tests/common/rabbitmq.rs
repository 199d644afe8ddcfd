//! The shared RabbitMQ at 127.0.0.1:5672: a connection to it, a queue bound to an exchange,
//! and the deletion of what a test declared there.

use lapin::options::{
    ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Connection};

/// The shared broker, as its host and port.
pub(crate) const ADDRESS: &str = "127.0.0.1:5672";

/// The shared broker's URL.
pub(crate) const URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// A connection to the shared broker; an unreachable broker fails the test.
pub(crate) async fn connect() -> Connection {
    Connection::connect(URL, Default::default())
        .await
        .expect("RabbitMQ must be reachable at 127.0.0.1:5672")
}

/// Declares `queue` (deleted with its last consumer when `auto_delete`) and binds it to
/// `exchange` for `routing_key`. The exchange must exist.
pub(crate) async fn bind_queue(
    channel: &Channel,
    queue: &str,
    exchange: &str,
    routing_key: &str,
    auto_delete: bool,
) {
    let declare = QueueDeclareOptions {
        auto_delete,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue.into(), declare, FieldTable::default())
        .await
        .unwrap();
    channel
        .queue_bind(
            queue.into(),
            exchange.into(),
            routing_key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
}

/// How many messages wait in `queue`, which must exist.
pub(crate) async fn waiting(channel: &Channel, queue: &str) -> u32 {
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await
        .unwrap()
        .message_count()
}

/// Deletes `queues` and then `exchange`.
pub(crate) async fn delete<Q: AsRef<str>>(
    channel: &Channel,
    queues: impl IntoIterator<Item = Q>,
    exchange: &str,
) {
    for queue in queues {
        channel
            .queue_delete(queue.as_ref().into(), QueueDeleteOptions::default())
            .await
            .unwrap();
    }
    delete_exchange(channel, exchange).await;
}

/// Deletes `exchange`.
pub(crate) async fn delete_exchange(channel: &Channel, exchange: &str) {
    channel
        .exchange_delete(exchange.into(), ExchangeDeleteOptions::default())
        .await
        .unwrap();
}
