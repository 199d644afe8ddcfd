//! The orders side of the chain: payment events from the broker, applied once per payment id.
//!
//! `BROKER_URL=amqp://…` (feature `rabbitmq`) consumes the durable queue
//! `orders.payment-succeeded` bound to the topic exchange `payments` (routing key
//! `payment.succeeded`); `nats://…` (feature `nats`) the durable consumer `orders` on the stream
//! `PAYMENTS`. Dead letters go to `orders.payment-succeeded.dead` or the stream `ORDERS_DEAD`;
//! `orders replay-dead` replays them once and exits. A broker that goes away and comes back is
//! waited out: the consumer reconnects by itself. Should the consumer stop (its queue or durable
//! consumer deleted from outside), the process exits 1 for its supervisor to restart it, and the
//! restart declares what is missing again.
//!
//! Tuning: `ORDERS_CONSUMER_CONCURRENCY` (default 16 transactions at once),
//! `ORDERS_CONSUMER_BATCH` (default 16 deliveries in one transaction: a delivery mostly waits
//! for its commit's flush, and a batch shares one; a backlog left by an outage drains several
//! times faster), `ORDERS_CONSUMER_MAX_ATTEMPTS` (5),
//! `ORDERS_CONSUMER_BACKOFF_MS` (1000), `ORDERS_CONSUMER_ACK_WAIT_SECS` (NATS, 10), and
//! `ORDERS_CONSUMER_OUTAGE_MAX_MS` (10 000): while the orders database is unreachable the
//! consumer pauses, at most this long at a time, spending no attempt, so an outage of any
//! length dead-letters nothing and the consumer resumes within this long of its end.
//! `BROKER_NAMESPACE` prefixes every broker name (a shared broker, tests). For tests:
//! `ORDERS_CONSUMER_FAIL_PERCENT` makes that share of attempts write and then fail,
//! `ORDERS_FAILPOINT=after-commit` freezes the process after its first commit, before the ack,
//! and `ORDERS_CONSUMER_STATS_MS` prints the inbox's counters that often.

use std::fmt::Display;
use std::time::Duration;

use axum_idempotency::inbox::{Delivery, Failure, Inbox, ReplayReport, Verdict};
use axum_idempotency::{Store, Tx};
use serde::Deserialize;
use serde_json::Value;

use crate::common::{Cents, Decimal, Error, broker_name, setting};
use crate::db::{Arg, Backend};

/// Starts consuming payment events with an inbox on `store`, or with `replay-dead` replays
/// the dead letters and exits. Fails at once if the broker cannot be reached, so a
/// misconfigured process does not serve without consuming.
pub(crate) async fn spawn<DB: Backend>(store: Store<DB>, broker_url: &str) -> Result<(), Error> {
    let fail_percent: u32 = setting("ORDERS_CONSUMER_FAIL_PERCENT", 0)?;
    let handler = move |tx: Tx<DB>, delivery| apply(tx, delivery, fail_percent);
    let backoff = Duration::from_millis(setting("ORDERS_CONSUMER_BACKOFF_MS", 1000)?);
    let outage = Duration::from_millis(setting("ORDERS_CONSUMER_OUTAGE_MAX_MS", 10_000)?);
    // Keyed by the payment id, not the message id: a payment applies once whatever its
    // message ids.
    let mut inbox = Inbox::new("orders", store)
        .key_by(|delivery: &Delivery| Ok(parse(delivery.payload())?.0))
        .max_attempts(setting("ORDERS_CONSUMER_MAX_ATTEMPTS", 5)?)
        .backoff(backoff, Duration::from_secs(60))
        .outage_backoff(outage.min(Duration::from_secs(1)), outage);
    if std::env::var("ORDERS_FAILPOINT").as_deref() == Ok("after-commit") {
        inbox = inbox.on_verdict(freeze_after_commit);
    }
    if let Ok(every) = std::env::var("ORDERS_CONSUMER_STATS_MS") {
        let (every, inbox) = (Duration::from_millis(every.parse()?), inbox.clone());
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let stats = inbox.stats();
                println!(
                    "consumer stats processed={} duplicates={} retried={} dead={}",
                    stats.processed, stats.duplicates, stats.retried, stats.dead
                );
            }
        });
    }
    let replay = std::env::args().any(|arg| arg == "replay-dead");
    let concurrency: u16 = setting("ORDERS_CONSUMER_CONCURRENCY", 16)?;
    let batch: u16 = setting("ORDERS_CONSUMER_BATCH", 16)?;
    // The URL may carry credentials: only its scheme is printed.
    let scheme = broker_url.split(':').next().unwrap_or_default();
    match scheme {
        #[cfg(feature = "rabbitmq")]
        "amqp" | "amqps" => {
            use axum_idempotency::inbox::rabbitmq::RabbitMqConsumer;
            // Its 10 s heartbeat (unless the URL sets one): a consumer host that vanishes
            // without closing its socket is noticed, and its deliveries redelivered, within 30 s.
            let queue = broker_name("orders.payment-succeeded");
            let consumer = RabbitMqConsumer::connect(inbox, broker_url, queue)
                .await?
                .bind(broker_name("payments"), "payment.succeeded")
                .concurrency(concurrency)
                .batch(batch);
            consumer.declare().await?;
            if replay {
                replayed(consumer.replay_dead(handler, usize::MAX).await?);
            }
            run(consumer.run(handler));
        }
        #[cfg(feature = "nats")]
        "nats" => {
            use axum_idempotency::inbox::nats::NatsConsumer;
            let ack_wait = Duration::from_secs(setting("ORDERS_CONSUMER_ACK_WAIT_SECS", 10)?);
            let consumer =
                NatsConsumer::connect(inbox, broker_url, broker_name("PAYMENTS"), "orders")
                    .await?
                    .stream_subjects([broker_name("payments.>")])
                    .filter_subject(broker_name("payments.succeeded"))
                    .dead_letters(broker_name("ORDERS_DEAD"), broker_name("orders.dead"))
                    .ack_wait(ack_wait)
                    .concurrency(usize::from(concurrency))
                    .batch(usize::from(batch));
            consumer.declare().await?;
            if replay {
                replayed(consumer.replay_dead(handler, usize::MAX).await?);
            }
            run(consumer.run(handler));
        }
        other => {
            let error = format!("BROKER_URL {other:?} is not built in (features rabbitmq, nats)");
            return Err(error.into());
        }
    }
    println!("orders consuming payment events ({scheme})");
    Ok(())
}

/// `ORDERS_FAILPOINT=after-commit`: committed, not acked; frozen here until the test kills the
/// process.
fn freeze_after_commit(_: &Delivery, verdict: &Verdict) {
    if *verdict == Verdict::Applied {
        println!("failpoint after-commit reached");
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
}

/// Runs the consumer in the background. It ends only when it can consume no more (its queue
/// or durable consumer deleted; a lost connection is reconnected): then the process exits 1,
/// for a supervisor to restart it, rather than serve orders without applying their payments.
fn run<E: Display>(consumer: impl Future<Output = Result<(), E>> + Send + 'static) {
    tokio::spawn(async move {
        let cause = match consumer.await {
            Ok(()) => "the broker ended its deliveries (queue or durable consumer deleted?)".into(),
            Err(error) => error.to_string(),
        };
        tracing::error!(%cause, "the payment consumer stopped; exiting, a restart declares it again");
        std::process::exit(1);
    });
}

/// Reports an operator's replay and ends the process: `replay-dead` is a one-off command.
fn replayed(report: ReplayReport) -> ! {
    println!(
        "replayed dead letters: applied={} duplicates={} still_dead={}",
        report.applied, report.duplicates, report.still_dead
    );
    std::process::exit(0)
}

/// A payment event as the payments example publishes it.
#[derive(Deserialize)]
struct Event {
    payment_id: String,
    /// An integer or a string of digits.
    order_id: Value,
    amount: Decimal,
    /// Required, though orders keep the currency they were placed in.
    #[serde(rename = "currency")]
    _currency: String,
}

/// An event's payment id, order id and amount. A malformed event, or one the tables cannot
/// hold, is a permanent failure: dead-lettered at once rather than retried.
fn parse(payload: &[u8]) -> Result<(String, i64, Cents), Failure> {
    let event: Event = serde_json::from_slice(payload)
        .map_err(|e| Failure::permanent(format!("malformed event: {e}")))?;
    let id = &event.payment_id;
    if id.is_empty() || id.chars().count() > 255 || id.contains(char::is_control) {
        return Err(Failure::permanent(
            "payment_id must be 1 to 255 printable characters",
        ));
    }
    let order_id = match &event.order_id {
        Value::Number(n) => n.as_i64(),
        Value::String(s) if s.bytes().all(|b| b.is_ascii_digit()) => s.parse().ok(),
        _ => None,
    };
    let order_id = order_id.ok_or(Failure::permanent(
        "order_id must be an integer or a string of digits",
    ))?;
    let amount = Cents::parse(&event.amount);
    let amount = amount.ok_or(Failure::permanent("amount must be a number of whole cents"))?;
    Ok((event.payment_id, order_id, amount))
}

/// Applies one event in the inbox's transaction, the one that holds the claim on its payment
/// id: that claim, not a unique key in `order_payments`, applies it once.
///
/// The order is paid once its payments cover its amount, shipped or not. `status` is set
/// before `paid_total`: MySQL reads a column already assigned in the same UPDATE, the others
/// read the old row; in this order all three compare with the old total.
async fn apply<DB: Backend>(
    mut tx: Tx<DB>,
    delivery: Delivery,
    fail_percent: u32,
) -> Result<(), Failure> {
    let (payment_id, order_id, amount) = parse(delivery.payload())?;
    let (order, amount) = (Arg::Int(order_id), Arg::Int(amount.0));
    let pay = "UPDATE orders SET status = CASE WHEN paid_total + ? >= amount THEN 'paid' \
        ELSE status END, paid_total = paid_total + ? WHERE id = ?";
    // `?` makes a conflict abort `Failure::Conflict`, run again at once, an unreachable
    // database `Failure::Unavailable`, waited out without counting an attempt, and any other
    // database error a retryable failure the broker redelivers later.
    if DB::execute(&mut tx, pay, &[amount, amount, order]).await? == 0 {
        return Err(Failure::permanent(format!(
            "order {order_id} does not exist"
        )));
    }
    let insert = "INSERT INTO order_payments (order_id, payment_id, amount) VALUES (?, ?, ?)";
    DB::execute(&mut tx, insert, &[order, Arg::Text(&payment_id), amount]).await?;
    if fail_percent > 0 && fastrand::u32(0..100) < fail_percent {
        // Written, then failed: the rollback must leave neither the row nor the claim.
        return Err(Failure::retryable("injected failure"));
    }
    Ok(())
}
