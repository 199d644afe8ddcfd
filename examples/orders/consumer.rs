//! The orders side of the chain: payment events from the broker, applied once per payment id.
//!
//! `BROKER_URL=amqp://…` (feature `rabbitmq`) consumes the durable queue
//! `orders.payment-succeeded`, bound to the topic exchange `payments` with routing key
//! `payment.succeeded`; dead letters go to `orders.payment-succeeded.dead`.
//! `BROKER_URL=nats://…` (feature `nats`) consumes the durable consumer `orders` on the stream
//! `PAYMENTS` (subjects `payments.>`), filter `payments.succeeded`; dead letters go to the
//! stream `ORDERS_DEAD` (subjects `orders.dead.>`).
//!
//! Tuning: `ORDERS_CONSUMER_CONCURRENCY` (default 4), `ORDERS_CONSUMER_MAX_ATTEMPTS` (5),
//! `ORDERS_CONSUMER_BACKOFF_MS` (1000), `ORDERS_CONSUMER_ACK_WAIT_SECS` (NATS, 30).
//! For tests: `BROKER_NAMESPACE` prefixes every broker name (`t1.payments`, `T1_PAYMENTS`),
//! `ORDERS_CONSUMER_FAIL_PERCENT` makes that share of attempts write and then fail
//! (retryable), `ORDERS_FAILPOINT=after-commit` freezes the process after the first commit,
//! before its ack (to be killed), and `ORDERS_CONSUMER_STATS_MS` prints the inbox's counters.

use std::time::Duration;

use axum_idempotency::inbox::{Delivery, Failure, Inbox, Verdict};
use axum_idempotency::{Store, Tx};
use serde_json::Value;

use crate::db::OrdersDb;

/// A payment event as the payments example publishes it.
struct PaymentSucceeded {
    payment_id: String,
    order_id: i64,
    amount: f64,
}

impl PaymentSucceeded {
    fn parse(payload: &[u8]) -> Result<Self, Failure> {
        let event: Value = serde_json::from_slice(payload)
            .map_err(|e| Failure::permanent(format!("malformed JSON: {e}")))?;
        let payment_id = match &event["payment_id"] {
            Value::String(id) if !id.is_empty() => id.clone(),
            _ => return Err(Failure::permanent("payment_id must be a non-empty string")),
        };
        let order_id = match &event["order_id"] {
            Value::Number(n) => n.as_i64(),
            Value::String(s) if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) => {
                s.parse().ok()
            }
            _ => None,
        }
        .ok_or_else(|| Failure::permanent("order_id must be an integer or a string of digits"))?;
        let amount = event["amount"]
            .as_f64()
            .filter(|a| a.is_finite() && *a >= 0.0)
            .ok_or_else(|| Failure::permanent("amount must be a non-negative number"))?;
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

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A broker name in the test namespace, if any: `t1.payments`.
#[cfg_attr(not(any(feature = "rabbitmq", feature = "nats")), allow(dead_code))]
fn dotted(name: &str) -> String {
    match std::env::var("BROKER_NAMESPACE") {
        Ok(ns) if !ns.is_empty() => format!("{ns}.{name}"),
        _ => name.to_owned(),
    }
}

/// A stream name in the test namespace, if any: `T1_PAYMENTS`.
#[cfg_attr(not(feature = "nats"), allow(dead_code))]
fn upper(name: &str) -> String {
    match std::env::var("BROKER_NAMESPACE") {
        Ok(ns) if !ns.is_empty() => format!("{}_{name}", ns.to_uppercase()),
        _ => name.to_owned(),
    }
}

/// Reports an operator's replay and ends the process: `replay-dead` is a one-off command.
#[cfg_attr(not(any(feature = "rabbitmq", feature = "nats")), allow(dead_code))]
fn replayed(report: axum_idempotency::inbox::ReplayReport) -> ! {
    println!(
        "replayed dead letters: applied={} duplicates={} still_dead={}",
        report.applied, report.duplicates, report.still_dead
    );
    std::process::exit(0)
}

/// Declares what the consumer uses and starts it in the background. Fails at once if the
/// broker cannot be reached, so a misconfigured process does not serve without consuming.
pub(crate) async fn spawn<DB>(
    store: Store<DB>,
    broker_url: &str,
) -> Result<(), Box<dyn std::error::Error>>
where
    DB: OrdersDb,
{
    let fail_percent: u32 = env_or("ORDERS_CONSUMER_FAIL_PERCENT", 0);
    let failpoint = std::env::var("ORDERS_FAILPOINT").ok();
    let mut inbox = Inbox::new("orders", store)
        .key_by(|delivery: &Delivery| Ok(PaymentSucceeded::parse(delivery.payload())?.payment_id))
        .max_attempts(env_or("ORDERS_CONSUMER_MAX_ATTEMPTS", 5))
        .backoff(
            Duration::from_millis(env_or("ORDERS_CONSUMER_BACKOFF_MS", 1000)),
            Duration::from_secs(60),
        );
    if failpoint.as_deref() == Some("after-commit") {
        inbox = inbox.on_verdict(|_, verdict| {
            if *verdict == Verdict::Applied {
                // Committed, not acked: the process stays frozen here until it is killed.
                println!("failpoint after-commit reached");
                loop {
                    std::thread::sleep(Duration::from_secs(3600));
                }
            }
        });
    }
    if let Some(every) = std::env::var("ORDERS_CONSUMER_STATS_MS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        let inbox = inbox.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(every)).await;
                let s = inbox.stats();
                println!(
                    "consumer stats processed={} duplicates={} retried={} dead={}",
                    s.processed, s.duplicates, s.retried, s.dead
                );
            }
        });
    }
    let handler = move |mut tx: Tx<DB>, delivery: Delivery| async move {
        let event = PaymentSucceeded::parse(delivery.payload())?;
        let applied = DB::apply_payment(&mut tx, event.order_id, &event.payment_id, event.amount)
            .await
            .map_err(|e| Failure::retryable(e.to_string()))?;
        if !applied {
            return Err(Failure::permanent(format!(
                "order {} does not exist",
                event.order_id
            )));
        }
        if fail_percent > 0 && fastrand::u32(0..100) < fail_percent {
            // Written, then failed: the rollback must leave neither the row nor the claim.
            return Err(Failure::retryable("injected failure"));
        }
        Ok(())
    };
    let concurrency: u16 = env_or("ORDERS_CONSUMER_CONCURRENCY", 4);
    #[cfg_attr(
        not(any(feature = "rabbitmq", feature = "nats")),
        allow(unused_variables)
    )]
    let replay = std::env::args().any(|arg| arg == "replay-dead");
    let started: Result<(), String> = match broker_url.split(':').next().unwrap_or_default() {
        #[cfg(feature = "rabbitmq")]
        "amqp" | "amqps" => {
            use axum_idempotency::inbox::rabbitmq::RabbitMqConsumer;
            // A 10 s heartbeat: a consumer host that vanishes without closing its socket is
            // noticed, and its unacked deliveries redelivered, within 30 s.
            let url = if broker_url.contains("heartbeat=") {
                broker_url.to_owned()
            } else if broker_url.contains('?') {
                format!("{broker_url}&heartbeat=10")
            } else {
                format!("{broker_url}?heartbeat=10")
            };
            let connection = lapin::Connection::connect(&url, Default::default()).await?;
            let consumer = RabbitMqConsumer::new(
                inbox,
                std::sync::Arc::new(connection),
                dotted("orders.payment-succeeded"),
            )
            .bind(dotted("payments"), "payment.succeeded")
            .concurrency(concurrency);
            consumer.declare().await?;
            if replay {
                let report = consumer.replay_dead(handler, usize::MAX).await?;
                replayed(report);
            }
            tokio::spawn(async move {
                let ended = consumer.run(handler).await;
                // A closed channel or connection: exit so a supervisor restarts the process.
                tracing::error!(?ended, "the payment consumer stopped");
                std::process::exit(1);
            });
            Ok(())
        }
        #[cfg(feature = "nats")]
        "nats" => {
            use axum_idempotency::inbox::nats::NatsConsumer;
            let client = async_nats::connect(broker_url).await?;
            let consumer = NatsConsumer::new(
                inbox,
                async_nats::jetstream::new(client),
                upper("PAYMENTS"),
                "orders",
            )
            .stream_subjects([dotted("payments.>")])
            .filter_subject(dotted("payments.succeeded"))
            .dead_letters(upper("ORDERS_DEAD"), dotted("orders.dead"))
            .ack_wait(Duration::from_secs(env_or(
                "ORDERS_CONSUMER_ACK_WAIT_SECS",
                30,
            )))
            .concurrency(usize::from(concurrency));
            consumer.declare().await.map_err(|e| e.to_string())?;
            if replay {
                let report = consumer
                    .replay_dead(handler, usize::MAX)
                    .await
                    .map_err(|e| e.to_string())?;
                replayed(report);
            }
            tokio::spawn(async move {
                let ended = consumer.run(handler).await;
                tracing::error!(?ended, "the payment consumer stopped");
                std::process::exit(1);
            });
            Ok(())
        }
        other => {
            let _ = (inbox, handler, concurrency);
            Err(format!(
                "BROKER_URL scheme {other:?} is not built in (features rabbitmq, nats)"
            ))
        }
    };
    started?;
    // The URL may carry credentials: only its scheme is printed.
    let scheme = broker_url.split(':').next().unwrap_or_default();
    println!("orders consuming payment events ({scheme})");
    Ok(())
}
