//! Outbox senders for message brokers, each behind its broker's cargo feature.

#[cfg(feature = "nats")]
mod nats;
#[cfg(feature = "rabbitmq")]
mod rabbitmq;

#[cfg(feature = "nats")]
pub use nats::NatsSender;
#[cfg(feature = "rabbitmq")]
pub use rabbitmq::RabbitMqSender;
