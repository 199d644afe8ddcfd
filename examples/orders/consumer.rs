//! The orders side of the chain: payment events from the broker, applied once per payment id.
//!
//! `BROKER_URL=amqp://…` (feature `rabbitmq`) consumes the durable queue
//! `orders.payment-succeeded`, bound to the topic exchange `payments` with routing key
//! `payment.succeeded`; dead letters go to `orders.payment-succeeded.dead`.
//! `BROKER_URL=nats://…` (feature `nats`) consumes the durable consumer `orders` on the stream
//! `PAYMENTS` (subjects `payments.>`), filter `payments.succeeded`; dead letters go to the
//! stream `ORDERS_DEAD` (subjects `orders.dead.>`). `orders replay-dead` replays the dead
//! letters once and exits.
//!
//! Tuning: `ORDERS_CONSUMER_CONCURRENCY` (default 4), `ORDERS_CONSUMER_MAX_ATTEMPTS` (5),
//! `ORDERS_CONSUMER_BACKOFF_MS` (1000), `ORDERS_CONSUMER_ACK_WAIT_SECS` (NATS, 30).
//! For tests: `BROKER_NAMESPACE` prefixes every broker name (`t1.payments`, `T1_PAYMENTS`),
//! `ORDERS_CONSUMER_FAIL_PERCENT` makes that share of attempts write and then fail
//! (retryable), `ORDERS_FAILPOINT=after-commit` freezes the process after the first commit,
//! before its ack (to be killed), and `ORDERS_CONSUMER_STATS_MS` prints the inbox's counters.

use axum_idempotency::Tx;
use axum_idempotency::inbox::{Delivery, Failure};
use serde_json::Value;

use crate::db::{Arg, Backend, Cents};

/// Starts consuming payment events with an inbox on `$store`, or with `replay-dead` replays
/// the dead letters and exits. Fails at once if the broker cannot be reached, so a
/// misconfigured process does not serve without consuming. A macro for the reason given at
/// `serve_on!`: the inbox and the broker adapters have a type per backend.
macro_rules! spawn {
    ($store:expr, $broker_url:expr) => {{
        use axum_idempotency::inbox::{Delivery, Inbox, ReplayReport, Verdict};
        use std::time::Duration;
        use $crate::consumer::{Event, apply, name};
        use $crate::setting;
        let fail_percent: u32 = setting("ORDERS_CONSUMER_FAIL_PERCENT", 0)?;
        let handler = move |tx, delivery| apply(tx, delivery, fail_percent);
        let backoff = Duration::from_millis(setting("ORDERS_CONSUMER_BACKOFF_MS", 1000)?);
        let mut inbox = Inbox::new("orders", $store)
            .key_by(|delivery: &Delivery| Ok(Event::parse(delivery.payload())?.payment_id))
            .max_attempts(setting("ORDERS_CONSUMER_MAX_ATTEMPTS", 5)?)
            .backoff(backoff, Duration::from_secs(60));
        if std::env::var("ORDERS_FAILPOINT").as_deref() == Ok("after-commit") {
            inbox = inbox.on_verdict(|_, verdict| {
                if *verdict == Verdict::Applied {
                    // Committed, not acked: frozen here until the test kills the process.
                    println!("failpoint after-commit reached");
                    loop {
                        std::thread::sleep(Duration::from_secs(3600));
                    }
                }
            });
        }
        if let Ok(every) = std::env::var("ORDERS_CONSUMER_STATS_MS") {
            let (inbox, every) = (inbox.clone(), Duration::from_millis(every.parse()?));
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(every).await;
                    let s = inbox.stats();
                    let (processed, duplicates, retried, dead) = (s.processed, s.duplicates, s.retried, s.dead);
                    println!("consumer stats processed={processed} duplicates={duplicates} retried={retried} dead={dead}");
                }
            });
        }
        let replay = std::env::args().any(|arg| arg == "replay-dead");
        let concurrency: u16 = setting("ORDERS_CONSUMER_CONCURRENCY", 4)?;
        let report: Option<ReplayReport> = match $broker_url.split(':').next().unwrap_or_default() {
            #[cfg(feature = "rabbitmq")]
            "amqp" | "amqps" => {
                use axum_idempotency::inbox::rabbitmq::RabbitMqConsumer;
                // A 10 s heartbeat: a consumer host that vanishes without closing its socket
                // is noticed, and its unacked deliveries redelivered, within 30 s.
                let url = match ($broker_url.contains("heartbeat="), $broker_url.contains('?')) {
                    (true, _) => $broker_url.to_owned(),
                    (false, true) => format!("{}&heartbeat=10", $broker_url),
                    (false, false) => format!("{}?heartbeat=10", $broker_url),
                };
                let connection = lapin::Connection::connect(&url, Default::default()).await?;
                let queue = name("orders.payment-succeeded");
                let consumer = RabbitMqConsumer::new(inbox, std::sync::Arc::new(connection), queue)
                    .bind(name("payments"), "payment.succeeded")
                    .concurrency(concurrency);
                consumer.declare().await?;
                if replay {
                    Some(consumer.replay_dead(handler, usize::MAX).await?)
                } else {
                    tokio::spawn(async move {
                        let ended = consumer.run(handler).await;
                        // The channel or the connection closed: exit, for a supervisor to restart.
                        tracing::error!(?ended, "the payment consumer stopped");
                        std::process::exit(1);
                    });
                    None
                }
            }
            #[cfg(feature = "nats")]
            "nats" => {
                use axum_idempotency::inbox::nats::NatsConsumer;
                let jetstream = async_nats::jetstream::new(async_nats::connect($broker_url).await?);
                let ack_wait = Duration::from_secs(setting("ORDERS_CONSUMER_ACK_WAIT_SECS", 30)?);
                let stream = name("PAYMENTS");
                let consumer = NatsConsumer::new(inbox, jetstream, stream, "orders")
                    .stream_subjects([name("payments.>")])
                    .filter_subject(name("payments.succeeded"))
                    .dead_letters(name("ORDERS_DEAD"), name("orders.dead"))
                    .ack_wait(ack_wait)
                    .concurrency(usize::from(concurrency));
                consumer.declare().await?;
                if replay {
                    Some(consumer.replay_dead(handler, usize::MAX).await?)
                } else {
                    tokio::spawn(async move {
                        let ended = consumer.run(handler).await;
                        tracing::error!(?ended, "the payment consumer stopped");
                        std::process::exit(1);
                    });
                    None
                }
            }
            other => return Err(format!("BROKER_URL {other:?} is not built in (features rabbitmq, nats)").into()),
        };
        if let Some(report) = report {
            // `replay-dead` is a one-off command.
            let (applied, duplicates, still_dead) = (report.applied, report.duplicates, report.still_dead);
            println!("replayed dead letters: applied={applied} duplicates={duplicates} still_dead={still_dead}");
            std::process::exit(0);
        }
        // The URL may carry credentials: only its scheme is printed.
        let scheme = $broker_url.split(':').next().unwrap_or_default();
        println!("orders consuming payment events ({scheme})");
    }};
}
pub(crate) use spawn;

/// A broker name in the test namespace `BROKER_NAMESPACE`, if any: `t1.payments`, and for
/// NATS streams (upper case) `T1_PAYMENTS`.
#[cfg_attr(not(any(feature = "rabbitmq", feature = "nats")), allow(dead_code))]
pub(crate) fn name(name: &str) -> String {
    match std::env::var("BROKER_NAMESPACE") {
        Ok(ns) if !ns.is_empty() && name.starts_with(char::is_uppercase) => {
            format!("{}_{name}", ns.to_uppercase())
        }
        Ok(ns) if !ns.is_empty() => format!("{ns}.{name}"),
        _ => name.to_owned(),
    }
}

/// A payment event as the payments example publishes it.
pub(crate) struct Event {
    pub(crate) payment_id: String,
    order_id: i64,
    amount: Cents,
}

impl Event {
    /// A malformed event, or one the tables cannot hold, is a permanent failure: dead-lettered
    /// at once rather than retried.
    pub(crate) fn parse(payload: &[u8]) -> Result<Self, Failure> {
        let event: Value = serde_json::from_slice(payload)
            .map_err(|e| Failure::permanent(format!("malformed JSON: {e}")))?;
        let payment_id = match &event["payment_id"] {
            Value::String(id)
                if !id.is_empty()
                    && id.chars().count() <= 255
                    && !id.contains(char::is_control) =>
            {
                id.clone()
            }
            _ => {
                return Err(Failure::permanent(
                    "payment_id must be 1 to 255 printable characters",
                ));
            }
        };
        let order_id = match &event["order_id"] {
            Value::Number(n) => n.as_i64(),
            Value::String(s) if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) => {
                s.parse().ok()
            }
            _ => None,
        };
        let order_id = order_id.ok_or(Failure::permanent(
            "order_id must be an integer or a string of digits",
        ))?;
        let amount = event["amount"].as_number().and_then(Cents::parse);
        let amount = amount.ok_or(Failure::permanent("amount must be a number of whole cents"))?;
        if !event["currency"].is_string() {
            return Err(Failure::permanent("currency must be a string"));
        }
        Ok(Self {
            payment_id,
            order_id,
            amount,
        })
    }
}

/// Applies one event in the inbox's transaction, the one that holds the claim on its payment
/// id: that claim, not a unique key in `order_payments`, applies it once.
///
/// The order is paid once its payments cover its amount, shipped or not. `status` is set
/// before `paid_total`: MySQL reads a column already assigned in the same UPDATE, the others
/// read the old row; in this order all three compare with the old total.
pub(crate) async fn apply<DB: Backend>(
    mut tx: Tx<DB>,
    delivery: Delivery,
    fail_percent: u32,
) -> Result<(), Failure> {
    let event = Event::parse(delivery.payload())?;
    let retryable = |e: sqlx::Error| Failure::retryable(e.to_string());
    let (order, amount) = (Arg::Int(event.order_id), Arg::Int(event.amount.0));
    let pay = "UPDATE orders SET status = CASE WHEN paid_total + ? >= amount THEN 'paid' ELSE status END, \
        paid_total = paid_total + ? WHERE id = ?";
    if DB::execute(&mut tx, pay, &[amount, amount, order])
        .await
        .map_err(retryable)?
        == 0
    {
        return Err(Failure::permanent(format!(
            "order {} does not exist",
            event.order_id
        )));
    }
    let insert = "INSERT INTO order_payments (order_id, payment_id, amount) VALUES (?, ?, ?)";
    let args = [order, Arg::Text(&event.payment_id), amount];
    DB::execute(&mut tx, insert, &args)
        .await
        .map_err(retryable)?;
    if fail_percent > 0 && fastrand::u32(0..100) < fail_percent {
        // Written, then failed: the rollback must leave neither the row nor the claim.
        return Err(Failure::retryable("injected failure"));
    }
    Ok(())
}
