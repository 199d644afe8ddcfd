//! Payments that charge the provider exactly once, whatever fails in between.
//!
//! ```text
//! cargo run --example payment_provider &
//! cargo run --example payments --features outbox
//! curl -i -X POST http://127.0.0.1:3001/payments -H 'Authorization: Bearer alice-token' \
//!      -H 'Idempotency-Key: 6d1c8a52-3f0e-4b7a-9c2d-5e8f1a4b7c90' -H 'Content-Type: application/json' \
//!      -d '{"order_id":"1","amount":12.5,"currency":"EUR","payee":"acme"}'
//! curl -i http://127.0.0.1:3001/payments/1 -H 'Authorization: Bearer alice-token'
//! ```
//!
//! `POST /payments` never calls the provider: it enqueues the charge in the outbox inside the
//! request's transaction, the one that holds the idempotency claim, and answers `202` with
//! `{ id, status: "pending" }`. A dispatcher sends the charge after the commit, with a
//! downstream key derived from the request's scoped key, so retries, resends and crashes reach
//! the provider as one charge. `GET /payments/{id}` shows `pending`, `succeeded` (with the
//! provider's `charge_id`) or `failed` (with the `reason`). The outbox message is the payment's
//! only record (its id, what was asked and by whom, what became of it), so the example has no
//! table of its own and never purges delivered messages.
//!
//! A payment is a final `400 invalid_payment`, never charged, unless its `order_id` is an integer
//! or a string of digits (what the orders example can apply), its `amount` a positive number of
//! at most two decimals below 10^13, its `currency` three capital letters and its `payee` 1 to
//! 255 printable characters. `amount` is read digit for digit as sent, never as a float, and
//! shown in one form, as the orders example does: `12.5`, `12.05`, `10.0` for `10` or `1e1`. A
//! body that is not JSON is `400 malformed_json`, one without a JSON content type `415
//! unsupported_media_type`, an id in a path that is not an integer `400 invalid_id`, and a
//! payment of another user, or none, `404 not_found`: problem+json like the orders example's,
//! from the same code (`common/mod.rs`).
//!
//! Environment: `BIND` (default `127.0.0.1:3001`), `DATABASE_URL` (default `sqlite:payments.db`;
//! `postgres://…` with `--features postgres`, `mysql://…` with `--features mysql`),
//! `DATABASE_MAX_CONNECTIONS` (default 10 on SQLite, 16 otherwise),
//! `PROVIDER_URL` (default `http://127.0.0.1:4000`), `PROVIDER_LOOKUP=off` (resend on an unknown
//! outcome without looking the charge up first), `DISPATCHERS` (default 1; 0 only accepts
//! payments), `OUTBOX_BATCH_SIZE` (64 sends in flight per dispatcher: a broker's publisher
//! confirm takes milliseconds, and the dispatcher's default of 16 would leave the relay
//! waiting on them), and `OUTBOX_POLL_MS`, `OUTBOX_SEND_TIMEOUT_MS`, `OUTBOX_LEASE_MS` (15 000: how
//! soon a dead dispatcher's message is taken over), `OUTBOX_LOOKUP_GRACE_MS`,
//! `OUTBOX_MAX_ATTEMPTS`, `OUTBOX_BACKOFF_MS` for the dispatcher. An outage of the provider
//! or the broker (refused, unreachable, 503, 429, connection down) spends no attempt: the
//! destination is probed with one message at a time, at most `OUTBOX_PROBE_MAX_MS` (10 000)
//! apart, and its backlog resumes at full speed once it answers. Only `OUTBOX_GIVE_UP_AFTER_MS`
//! (21 600 000: 6 hours) fails a payment caught in an outage, so a provider or broker down for
//! minutes, or hours, fails none, and each goes within about 10 s of its return.
//!
//! With `BROKER_URL=amqp://…` (`--features rabbitmq`) or `nats://…` (`--features nats`), each
//! succeeded payment also publishes, through the same outbox, the event `{"payment_id",
//! "order_id", "amount", "currency"}` that the orders example consumes: RabbitMQ topic exchange
//! `payments`, routing key `payment.succeeded`; NATS stream `PAYMENTS`, subject
//! `payments.succeeded`. `BROKER_NAMESPACE` prefixes those names (a shared broker, tests).
//!
//! Users: `Authorization: Bearer alice-token` or `bob-token`; anything else is 401. It stops on
//! SIGTERM as on Ctrl-C, after answering the requests in flight and stopping the dispatchers.

#[allow(dead_code, reason = "shared by the examples, each using part of it")]
mod common;

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::rejection::{JsonRejection, PathRejection};
use axum::extract::{FromRequestParts, Path, State};
use axum::http::{StatusCode, header, request::Parts};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use axum_idempotency::outbox::{self, Backoff, Dispatcher, DownstreamKey};
use axum_idempotency::outbox::{HttpSender, LookupOutcome, Message, MessageId, Outbox};
use axum_idempotency::outbox::{OutboxRecord, SendOutcome, Sender, Status};
use axum_idempotency::{Backend, IdempotencyContext, IdempotencyLayer, Principal, Store, Tx};
use common::{Cents, Decimal, Error, Problem, serve, setting};
use hyper_util::client::legacy::{Client, connect::HttpConnector};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sqlx::{Connection, pool::PoolOptions};

/// The outbox topics: charges for the provider, events for the broker.
const CHARGE_TOPIC: &str = "payments.charge";
const EVENT_TOPIC: &str = "payment.succeeded";

#[tokio::main]
async fn main() -> Result<(), Error> {
    common::init_logging();
    common::on_database!("sqlite:payments.db", run())
}

/// Serves the API until SIGTERM (Kubernetes, systemd) or Ctrl-C, then stops the dispatchers:
/// the requests in flight may still wake them.
async fn run<DB: Backend>(database: <DB::Connection as Connection>::Options) -> Result<(), Error> {
    // SQLite writes one transaction at a time: more connections would only queue.
    let pool_size = setting(
        "DATABASE_MAX_CONNECTIONS",
        if DB::NAME == "SQLite" { 10 } else { 16 },
    )?;
    let pool = PoolOptions::<DB>::new()
        .max_connections(pool_size)
        .connect_with(database)
        .await?;
    let store = Store::new(pool.clone());
    store.migrate().await?;
    let outbox = Outbox::new(pool.clone());
    outbox.migrate().await?;
    let broker = match std::env::var("BROKER_URL") {
        Ok(url) if !url.is_empty() => Some(Arc::new(Broker::connect(&url).await?)),
        _ => None,
    };
    // The provider deduplicates by `Idempotency-Key`; the lookup covers one that does not.
    let base = setting("PROVIDER_URL", "http://127.0.0.1:4000".to_owned())?;
    let client = Client::builder(hyper_util::rt::TokioExecutor::new()).build_http();
    let mut provider = HttpSender::new(client, format!("{base}/charges").parse()?);
    if std::env::var("PROVIDER_LOOKUP").as_deref() != Ok("off") {
        provider = provider.lookup_url(format!("{base}/charges?key={{key}}"));
    }
    let millis =
        |name: &str, default| Ok::<_, Error>(Duration::from_millis(setting(name, default)?));
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut dispatchers = Vec::new();
    for _ in 0..setting("DISPATCHERS", 1)? {
        let routed = Routed {
            provider: provider.clone(),
            broker: broker.clone(),
        };
        let backoff = millis("OUTBOX_BACKOFF_MS", 200)?;
        let probe = millis("OUTBOX_PROBE_MAX_MS", 10_000)?;
        let dispatcher = Dispatcher::new(outbox.clone(), routed)
            .poll_interval(millis("OUTBOX_POLL_MS", 500)?)
            .batch_size(setting("OUTBOX_BATCH_SIZE", 64)?)
            .send_timeout(millis("OUTBOX_SEND_TIMEOUT_MS", 5_000)?)
            .lease(millis("OUTBOX_LEASE_MS", 15_000)?)
            .lookup_grace(millis("OUTBOX_LOOKUP_GRACE_MS", 10_000)?)
            .max_attempts(setting("OUTBOX_MAX_ATTEMPTS", 10)?)
            .backoff(Backoff::exponential(backoff, Duration::from_secs(10)))
            .give_up_after(millis("OUTBOX_GIVE_UP_AFTER_MS", 6 * 3_600_000)?)
            .probe_backoff(Backoff::exponential(
                probe.min(Duration::from_secs(1)),
                probe,
            ));
        let mut stopped = stopped.clone();
        let shutdown = async move { drop(stopped.wait_for(|stop| *stop).await) };
        dispatchers.push(tokio::spawn(dispatcher.run(shutdown)));
    }
    let app = Router::new()
        .route("/payments", post(create::<DB>))
        .route_layer(IdempotencyLayer::new(store).principal::<AuthUser>())
        .route("/payments/{id}", get(show::<DB>))
        .with_state(outbox);
    serve(app, "127.0.0.1:3001", "payments").await?;
    let _ = stop.send(true);
    for dispatcher in dispatchers {
        let _ = dispatcher.await;
    }
    Ok(())
}

/// The authenticated caller; the idempotency layer scopes keys to it.
#[derive(Clone, Debug)]
struct AuthUser(&'static str);

impl<S: Send + Sync> FromRequestParts<S> for AuthUser {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Problem> {
        let header = parts.headers.get(header::AUTHORIZATION);
        match header.and_then(|value| value.to_str().ok()?.strip_prefix("Bearer ")) {
            Some("alice-token") => Ok(Self("alice")),
            Some("bob-token") => Ok(Self("bob")),
            _ => Err(Problem::Refused(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "a valid bearer token is required",
            )),
        }
    }
}

impl Principal for AuthUser {
    fn principal_id(&self) -> Cow<'_, str> {
        Cow::Borrowed(self.0)
    }
}

#[derive(Deserialize)]
struct NewPayment {
    order_id: Value,
    amount: Decimal,
    currency: String,
    payee: String,
}

impl NewPayment {
    /// The charge to enqueue for `customer`, or the rule the payment breaks. Everything is
    /// checked before anything is written or charged: what the provider or the orders example
    /// cannot take is a final 400, never a retryable 500.
    fn check(self, customer: &str) -> Result<Charge, &'static str> {
        let Some(amount @ Cents(1..)) = Cents::parse(&self.amount) else {
            return Err(
                "amount must be a positive number with at most two decimals, below 10000000000000",
            );
        };
        let currency = &self.currency;
        if currency.len() != 3 || !currency.bytes().all(|b| b.is_ascii_uppercase()) {
            return Err("currency must be a three-letter ISO 4217 code such as EUR");
        }
        let digits = |id: &str| id.bytes().all(|b| b.is_ascii_digit()) && id.parse::<i64>().is_ok();
        match &self.order_id {
            Value::Number(id) if id.is_i64() => {}
            Value::String(id) if digits(id) => {}
            _ => return Err("order_id must be an integer or a string of digits"),
        }
        let payee = &self.payee;
        if payee.trim().is_empty()
            || payee.chars().count() > 255
            || payee.contains(char::is_control)
        {
            return Err("payee must be 1 to 255 printable characters");
        }
        Ok(Charge {
            order_id: self.order_id,
            amount,
            currency: self.currency,
            payee: self.payee,
            customer: customer.to_owned(),
        })
    }
}

/// A payment as its outbox message keeps it: the body of the charge (the provider reads the
/// amount, currency and payee) and what `GET` and the event show.
#[derive(Serialize, Deserialize)]
struct Charge {
    /// An integer or a string of digits, passed on to the event unchanged.
    order_id: Value,
    amount: Cents,
    currency: String,
    payee: String,
    /// Who asked for it: nobody else is shown it.
    customer: String,
}

async fn create<DB: Backend>(
    State(outbox): State<Outbox<DB>>,
    user: AuthUser,
    context: IdempotencyContext,
    mut tx: Tx<DB>,
    payment: Result<Json<NewPayment>, JsonRejection>,
) -> Result<Response, Problem> {
    let Json(payment) = payment?;
    let charge = payment.check(user.0).map_err(invalid)?;
    // Derived from the request's scoped key, so every retry of this intent carries the same
    // key downstream.
    let key = DownstreamKey::for_request(context.scoped_key(), CHARGE_TOPIC, "charge");
    let message =
        Message::json(CHARGE_TOPIC, key, &charge).map_err(|e| Problem::Internal(e.into()))?;
    // On the request's `Tx`: its commit wakes the dispatchers, so the charge goes out at once.
    let id = outbox.enqueue(&mut tx, message).await?;
    let location = [(header::LOCATION, format!("/payments/{id}"))];
    let body = Json(json!({ "id": id.get(), "status": "pending" }));
    Ok((StatusCode::ACCEPTED, location, body).into_response())
}

async fn show<DB: Backend>(
    State(outbox): State<Outbox<DB>>,
    user: AuthUser,
    id: Result<Path<i64>, PathRejection>,
) -> Result<Response, Problem> {
    let Path(id) = id?;
    let not_found = || Problem::Refused(StatusCode::NOT_FOUND, "not_found", "no such payment");
    // Events share the outbox, and a payment is only shown to whoever made it.
    let record = outbox.status(MessageId::from(id)).await?;
    let record = record
        .filter(|r| r.topic == CHARGE_TOPIC)
        .ok_or_else(not_found)?;
    let charge: Charge = record.payload_json().map_err(|_| not_found())?;
    if charge.customer != user.0 {
        return Err(not_found());
    }
    let order_id = match charge.order_id {
        Value::String(id) => id,
        id => id.to_string(),
    };
    let (amount, currency, payee) = (charge.amount, charge.currency, charge.payee);
    let mut body = json!({ "id": id, "order_id": order_id, "amount": amount, "currency": currency, "payee": payee });
    match record.status {
        Status::Pending => body["status"] = "pending".into(),
        Status::Delivered => {
            body["status"] = "succeeded".into();
            body["charge_id"] = record.receipt.into();
        }
        // A skipped charge was set aside by an operator after it failed: never made either.
        Status::Failed | Status::Skipped => {
            body["status"] = "failed".into();
            body["reason"] = record.last_error.into();
        }
    }
    Ok(Json(body).into_response())
}

/// What the dispatcher sends through: charges to the provider, events to the broker. Each
/// charge the provider confirms (sent or found by lookup) has its event as a follow-up, which
/// the outbox enqueues in the transaction that records the charge delivered, keyed by the
/// charge's own key: however often the charge is confirmed, its event is enqueued once, and
/// never a charge recorded without it.
struct Routed {
    provider: HttpSender<Client<HttpConnector, http_body_util::Full<bytes::Bytes>>>,
    broker: Option<Arc<Broker>>,
}

impl Sender for Routed {
    async fn send(&self, message: &OutboxRecord) -> SendOutcome {
        if message.topic == EVENT_TOPIC {
            return match &self.broker {
                Some(broker) => broker.send(message).await,
                // An event enqueued by a run that had a broker: this process cannot reach one,
                // which is an outage of the destination, not a fault of the message. It waits,
                // spending none of its attempts, for a run started with BROKER_URL.
                None => SendOutcome::Unavailable {
                    after: None,
                    reason: "no BROKER_URL configured".into(),
                },
            };
        }
        self.provider.send(message).await
    }

    // The broker's client says when it is back, and the dispatcher probes the events' topic
    // at once; the provider is found back by the probes alone.
    fn reconnected(&self) -> Option<outbox::Reconnected> {
        self.broker.as_ref().and_then(|broker| broker.reconnected())
    }

    async fn lookup(&self, message: &OutboxRecord) -> LookupOutcome {
        if message.topic == EVENT_TOPIC {
            return LookupOutcome::Unsupported;
        }
        self.provider.lookup(message).await
    }

    /// The "payment succeeded" event of a charge the provider confirmed.
    fn follow_ups(&self, charge: &OutboxRecord, _receipt: &str) -> Result<Vec<Message>, Error> {
        if charge.topic == EVENT_TOPIC || self.broker.is_none() {
            return Ok(Vec::new());
        }
        let payment: Charge = charge.payload_json()?;
        let (order_id, amount, currency) = (payment.order_id, payment.amount, payment.currency);
        let event = json!({ "payment_id": charge.id.to_string(), "order_id": order_id, "amount": amount, "currency": currency });
        let key = DownstreamKey::new(format!("payment-succeeded-{}", charge.downstream_key))?;
        Ok(vec![Message::json(EVENT_TOPIC, key, &event)?])
    }
}

/// The broker the events go to. What they need is declared at start, idempotently; an exchange
/// or a stream that already exists is used as it is.
enum Broker {
    #[cfg(feature = "rabbitmq")]
    RabbitMq(outbox::RabbitMqSender),
    #[cfg(feature = "nats")]
    Nats(outbox::NatsSender),
}

impl Broker {
    async fn connect(url: &str) -> Result<Self, Error> {
        match url.split(':').next().unwrap_or_default() {
            #[cfg(feature = "rabbitmq")]
            "amqp" | "amqps" => {
                // It reconnects by itself whenever the broker comes back, and its 10 s
                // heartbeat notices a broker host that vanished within about 20 s.
                let sender =
                    outbox::RabbitMqSender::connect(url, common::broker_name("payments")).await?;
                sender.declare().await?;
                Ok(Self::RabbitMq(
                    sender.route(EVENT_TOPIC, "payment.succeeded"),
                ))
            }
            #[cfg(feature = "nats")]
            "nats" => {
                let sender = outbox::NatsSender::connect(url).await?;
                sender
                    .declare_stream(
                        &common::broker_name("PAYMENTS"),
                        [common::broker_name("payments.>")],
                    )
                    .await?;
                Ok(Self::Nats(sender.route(
                    EVENT_TOPIC,
                    common::broker_name("payments.succeeded"),
                )))
            }
            other => Err(
                format!("BROKER_URL {other:?} is not built in (features rabbitmq, nats)").into(),
            ),
        }
    }

    // Without a broker feature there is no broker, and nothing to send.
    #[cfg_attr(
        not(any(feature = "rabbitmq", feature = "nats")),
        allow(unused_variables)
    )]
    async fn send(&self, message: &OutboxRecord) -> SendOutcome {
        match *self {
            #[cfg(feature = "rabbitmq")]
            Self::RabbitMq(ref sender) => sender.send(message).await,
            #[cfg(feature = "nats")]
            Self::Nats(ref sender) => sender.send(message).await,
        }
    }

    fn reconnected(&self) -> Option<outbox::Reconnected> {
        match *self {
            #[cfg(feature = "rabbitmq")]
            Self::RabbitMq(ref sender) => sender.reconnected(),
            #[cfg(feature = "nats")]
            Self::Nats(ref sender) => sender.reconnected(),
        }
    }
}

fn invalid(detail: &'static str) -> Problem {
    Problem::Refused(StatusCode::BAD_REQUEST, "invalid_payment", detail)
}

impl From<JsonRejection> for Problem {
    fn from(rejection: JsonRejection) -> Self {
        let fields = "the payment needs order_id, amount, currency and payee of the right types";
        Problem::body(
            rejection,
            "send the payment as application/json",
            invalid(fields),
        )
    }
}
