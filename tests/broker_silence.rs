//! The broker senders through a link gone silent, as when the broker's host loses power or a
//! partition sends no reset: the test's own proxy between each sender and the shared broker
//! passes no byte while silent and keeps every connection open. A publish then waits out its
//! ack and is an unknown outcome, which the dispatcher counts as an attempt, so the sender
//! must find the link out soon and answer that the broker is unavailable, an outage, until it
//! is back. Every name on the shared brokers is the test's own.
//!
//! A binary of its own: the outage suite counts the senders' log lines through a subscriber
//! of its thread, and these sends would log the same lines from other threads meanwhile.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use axum_idempotency::outbox::{SendOutcome, Sender};
use common::sends::{RabbitTarget, delivered_once_back, nats_sender, record, send_promptly};
use common::silent::FaultProxy;
use common::{nats, rabbitmq};
use tokio::time::Instant;

/// The examples' send timeout (the dispatcher's default is 30 s): a send the dispatcher waits
/// no longer for is an unknown outcome.
const SEND_TIMEOUT: Duration = Duration::from_secs(5);

/// Sends through `proxy` silenced until a send answers unavailable, which must come within
/// `within` with at most `unknown` unknown outcomes (or sends past the send timeout) before
/// it; then the link heals and a send is delivered.
async fn found_out_and_waited_out(
    proxy: &FaultProxy,
    sender: &impl Sender,
    within: Duration,
    unknown: usize,
) {
    let (record, _dir) = record("payment.succeeded").await;
    let delivered = sender.send(&record).await;
    assert!(
        matches!(delivered, SendOutcome::Delivered { .. }),
        "{delivered:?}"
    );

    proxy.blackhole(true);
    let silent = Instant::now();
    let mut unknowns = 0;
    loop {
        match tokio::time::timeout(SEND_TIMEOUT, sender.send(&record)).await {
            Ok(SendOutcome::Unavailable { .. }) => break,
            Ok(SendOutcome::Unknown { .. }) | Err(_) => unknowns += 1,
            Ok(other) => panic!("while the link is silent: {other:?}"),
        }
        assert!(
            silent.elapsed() < within,
            "still not found out after {:?} of silence ({unknowns} unknown outcomes)",
            silent.elapsed()
        );
    }
    assert!(
        unknowns <= unknown,
        "{unknowns} unknown outcomes before the outage was found"
    );
    // Found out, every send is an outage, answered at once.
    for _ in 0..5 {
        let outcome = send_promptly(sender, &record).await;
        assert!(
            matches!(outcome, SendOutcome::Unavailable { .. }),
            "{outcome:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    proxy.blackhole(false);
    delivered_once_back(sender, &record).await;
}

/// NATS: the client made by `connect` pings every 5 s and drops the connection as stale on
/// its third ping with two unanswered, within 15 s: three sends of 5 s fill that time, and a
/// fourth begun just before the stale ping is still in flight when the link is dropped, so
/// up to four unknown outcomes. With async-nats' default pings (every minute) it took up to
/// three minutes: five unknown outcomes and no outage in 25 s.
#[tokio::test]
async fn a_silent_nats_link_is_found_out_and_waited_out_as_an_outage() {
    let broker: SocketAddr = nats::ADDRESS.parse().unwrap();
    let proxy = FaultProxy::start(&broker.to_string()).await;
    let (sender, stream) = nats_sender(proxy.addr, "OUTBOX_SILENT").await;

    found_out_and_waited_out(&proxy, &sender, Duration::from_secs(25), 4).await;

    nats::delete(&nats::connect().await, [&stream]).await;
}

/// RabbitMQ: the connection's heartbeat (10 s unless the URI sets one) finds the link out,
/// within about 20 s.
#[tokio::test]
async fn a_silent_rabbitmq_link_is_found_out_and_waited_out_as_an_outage() {
    let broker: SocketAddr = rabbitmq::ADDRESS.parse().unwrap();
    let proxy = FaultProxy::start(&broker.to_string()).await;
    let target = RabbitTarget::connect(proxy.addr, "", "outbox.silent").await;

    found_out_and_waited_out(&proxy, &target.sender, Duration::from_secs(40), 6).await;

    target.delete().await;
}
