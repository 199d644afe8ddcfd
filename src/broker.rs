//! Connecting to a broker, for the inbox's consumers and the outbox's senders alike: one
//! bounded attempt, and the jittered wait between attempts after a connection is lost.

use std::time::Duration;

use crate::backoff::Backoff;

/// The wait between attempts to reconnect: short at first, for a broker that restarts in
/// seconds; jittered, so that a fleet of clients does not come back at one instant; capped,
/// so that a broker back after a long outage is found within 5 s.
pub(crate) const RECONNECT: Backoff =
    Backoff::exponential(Duration::from_millis(100), Duration::from_secs(5));

/// A RabbitMQ connection attempt that has not finished by then is abandoned and tried again
/// (a host that drops packets would otherwise hold it for the system's TCP timeout).
#[cfg(feature = "rabbitmq")]
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// One connection attempt to RabbitMQ at `uri`, bounded by [`CONNECT_TIMEOUT`], with a 10 s
/// heartbeat unless `uri` sets one (`?heartbeat=…`): a broker host that vanishes without closing
/// its sockets is then noticed within about 20 s, where the broker's own default (60 s) takes
/// minutes.
#[cfg(feature = "rabbitmq")]
pub(crate) async fn rabbitmq(uri: &str) -> Result<lapin::Connection, lapin::Error> {
    let uri = with_heartbeat(uri);
    let connecting = lapin::Connection::connect(&uri, lapin::ConnectionProperties::default());
    within(CONNECT_TIMEOUT, "no connection", connecting).await
}

/// `call` (a lapin call), failed as timed out unless it finished within `limit`: lapin answers
/// a call queued just as its connection's I/O loop ends never, neither done nor failed.
#[cfg(feature = "rabbitmq")]
pub(crate) async fn within<T>(
    limit: Duration,
    what: &str,
    call: impl Future<Output = Result<T, lapin::Error>>,
) -> Result<T, lapin::Error> {
    match tokio::time::timeout(limit, call).await {
        Ok(done) => done,
        Err(_) => Err(lapin::Error::from(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("{what} within {limit:?}"),
        ))),
    }
}

/// Declares `exchange` on `connection` as a durable topic exchange, unless it exists: one made
/// beforehand, by the other side or by an operator with other settings, is used as it is.
#[cfg(feature = "rabbitmq")]
pub(crate) async fn declare_exchange(
    connection: &lapin::Connection,
    exchange: &str,
) -> Result<(), lapin::Error> {
    use lapin::options::ExchangeDeclareOptions;
    use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
    use lapin::types::FieldTable;
    use lapin::{ErrorKind, ExchangeKind};

    // Declared outright rather than probed first: the broker refuses a probe for a missing
    // exchange by closing the channel, which lapin logs as an error, and a missing exchange is
    // what every first start finds. One that exists with other settings is refused the same
    // way, and kept.
    let channel = connection.create_channel().await?;
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    let declared = channel
        .exchange_declare(
            exchange.into(),
            ExchangeKind::Topic,
            durable,
            FieldTable::default(),
        )
        .await;
    match declared {
        Ok(()) => {
            let _ = channel.close(200, "declared".into()).await;
            Ok(())
        }
        Err(error)
            if matches!(error.kind(), ErrorKind::ProtocolError(refusal)
                if *refusal.kind() == AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED)) =>
        {
            Ok(())
        }
        Err(error) => Err(error),
    }
}

/// `uri` asking for a 10 s heartbeat, unless it asks for one already.
#[cfg(feature = "rabbitmq")]
fn with_heartbeat(uri: &str) -> String {
    match uri.split_once('?') {
        Some((_, query)) if query.split('&').any(|pair| pair.starts_with("heartbeat=")) => {
            uri.to_owned()
        }
        Some((_, "")) => format!("{uri}heartbeat=10"),
        Some(_) => format!("{uri}&heartbeat=10"),
        None => format!("{uri}?heartbeat=10"),
    }
}

/// A NATS client connected to `url` now, which reconnects by itself after the
/// [`RECONNECT`] backoff (async-nats' own default waits alike for every client) and drops a
/// connection gone silent within three [`NATS_PING`]s.
#[cfg(feature = "nats")]
pub(crate) async fn nats(url: &str) -> Result<async_nats::Client, async_nats::ConnectError> {
    nats_options().connect(url).await
}

/// How often a NATS client pings the server. async-nats drops the connection as stale on its
/// third ping with two still unanswered, and reconnects: by its default of a minute, a link gone
/// silent (a server host that lost power, a partition that sends no reset) went unnoticed for
/// up to three minutes, while every publish waited out its ack and counted as an attempt of
/// unknown outcome. Within 15 s the client knows it is not connected, and the sender answers
/// that the broker is unavailable, which is an outage, not an attempt.
#[cfg(feature = "nats")]
const NATS_PING: Duration = Duration::from_secs(5);

/// The options [`nats`] connects with, for a client that adds its own (an event callback).
#[cfg(feature = "nats")]
pub(crate) fn nats_options() -> async_nats::ConnectOptions {
    async_nats::ConnectOptions::new()
        .ping_interval(NATS_PING)
        .reconnect_delay_callback(|attempts| {
            RECONNECT.delay(u32::try_from(attempts).unwrap_or(u32::MAX))
        })
}

#[cfg(all(test, feature = "rabbitmq"))]
mod tests {
    use super::with_heartbeat;

    #[test]
    fn a_heartbeat_is_asked_for_unless_the_uri_sets_one() {
        let base = "amqp://guest:guest@127.0.0.1:5672/%2f";
        assert_eq!(with_heartbeat(base), format!("{base}?heartbeat=10"));
        assert_eq!(
            with_heartbeat(&format!("{base}?")),
            format!("{base}?heartbeat=10")
        );
        let framed = format!("{base}?frame_max=8192");
        assert_eq!(with_heartbeat(&framed), format!("{framed}&heartbeat=10"));
        let own = format!("{base}?frame_max=8192&heartbeat=30");
        assert_eq!(with_heartbeat(&own), own);
    }
}
