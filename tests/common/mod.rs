//! The one harness of the test binaries. Each binary takes the parts it uses, so the rest is
//! dead code there.
//!
//! - [`names`]: names for schemas, databases, queues and keys that no other test uses.
//! - [`backends`]: a fresh database per backend and a test app on it, for the conformance suite.
//! - [`example_db`]: a database of its own for one run of an example app.
//! - [`process`]: the examples run as real processes, and an HTTP client to talk to them.
//! - [`markdown`]: the fenced code blocks of the README.
//! - [`galera`]: a private three-node MariaDB Galera cluster, for the cluster suite.
//! - [`logs`]: the log lines a test's own subscriber writes.
//! - [`lossy`]: an in-memory idempotent server behind a proxy that loses answers, for the client.
//! - [`pg_cluster`]: a private PostgreSQL primary and hot standby, to kill and promote.
//! - [`link`]: a TCP link with a fixed lag between the two, cut when the primary dies; and a
//!   plug to pull between an app and what it depends on.
//! - [`vip`]: a TCP forwarder standing in for a virtual IP that moves between servers.
//! - [`brokers`]: a private NATS server and RabbitMQ node, to stop and start again.
//! - [`rabbitmq`], [`nats`]: the shared RabbitMQ and NATS JetStream, and cleaning up a test's
//!   names there.
//! - [`sqlite`]: SQLite files of a test's own, and an outbox on one.
//! - [`sends`]: a broker sender's sends as the dispatcher makes them.
//! - [`silent`]: a TCP proxy that can go silent, passing nothing while keeping connections open.

#![allow(dead_code, unreachable_pub, unused_imports)]

#[cfg(feature = "server")]
pub(crate) mod backends;
#[cfg(all(feature = "nats", feature = "rabbitmq"))]
pub(crate) mod brokers;
pub(crate) mod example_db;
#[cfg(feature = "mysql")]
pub(crate) mod galera;
pub(crate) mod link;
pub(crate) mod logs;
pub(crate) mod lossy;
pub(crate) mod markdown;
pub(crate) mod names;
#[cfg(feature = "nats")]
pub(crate) mod nats;
#[cfg(feature = "postgres")]
pub(crate) mod pg_cluster;
pub(crate) mod process;
#[cfg(feature = "rabbitmq")]
pub(crate) mod rabbitmq;
#[cfg(all(
    feature = "outbox",
    feature = "sqlite",
    feature = "nats",
    feature = "rabbitmq"
))]
pub(crate) mod sends;
pub(crate) mod silent;
#[cfg(feature = "server")]
pub(crate) mod sqlite;
pub(crate) mod vip;

#[cfg(feature = "server")]
pub(crate) use backends::*;
pub(crate) use names::unique;
