//! Payments that charge the provider exactly once, whatever fails in between.
//!
//! ```text
//! cargo run --example payment_provider &
//! cargo run --example payments --features outbox
//! curl -i -X POST http://127.0.0.1:3001/payments \
//!      -H 'Authorization: Bearer alice-token' -H 'Idempotency-Key: 6d1c8a52-…' \
//!      -H 'Content-Type: application/json' \
//!      -d '{"order_id":"o-1","amount":12.5,"currency":"EUR","payee":"acme"}'
//! ```
//!
//! `POST /payments` never calls the provider. It writes the payment and an outbox message in
//! the request's transaction — the one that also holds the idempotency claim — and answers
//! `202 Accepted` with `{ id, status: "pending" }`. A dispatcher task sends the charge after the
//! commit with a downstream key derived from the request's scoped key, so retries, resends and
//! crashes all reach the provider as one charge. `GET /payments/{id}` shows `pending`,
//! `succeeded` (with the provider's charge id) or `failed` (with the reason).
//!
//! Environment: `BIND` (default `127.0.0.1:3001`), `DATABASE_URL` (default
//! `sqlite:payments.db`; `postgres://…` switches), `PROVIDER_URL` (default
//! `http://127.0.0.1:4000`), `DISPATCHERS` (dispatcher tasks, default 1; 0 only accepts
//! payments), `PROVIDER_LOOKUP=off` (resend on an unknown outcome without looking the charge up
//! first), and `OUTBOX_POLL_MS`, `OUTBOX_SEND_TIMEOUT_MS`, `OUTBOX_LOOKUP_GRACE_MS`,
//! `OUTBOX_MAX_ATTEMPTS`, `OUTBOX_BACKOFF_MS` to tune the dispatcher.
//!
//! With `BROKER_URL=amqp://…` (`--features rabbitmq`) or `nats://…` (`--features nats`), each
//! succeeded payment also publishes, through the same outbox, the event
//! `{"payment_id", "order_id", "amount", "currency"}` (order id as given when the payment was
//! created) with a downstream key of its own as the message id: RabbitMQ topic exchange
//! `payments`, routing key `payment.succeeded`; NATS stream `PAYMENTS` (subjects `payments.>`),
//! subject `payments.succeeded`. `BROKER_NAMESPACE` prefixes those names (for tests).
//!
//! Users: `Authorization: Bearer alice-token` (alice) or `bob-token` (bob); anything else is 401.

use std::borrow::Cow;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{FromRequestParts, Path, State};
use axum::http::request::Parts;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router, middleware};
use axum_idempotency::Backend;
use axum_idempotency::outbox::{
    Backoff, DispatchWaker, Dispatcher, DownstreamKey, LookupOutcome, Message, MessageId, Outbox,
    OutboxRecord, SendOutcome, Sender, Status,
};
use axum_idempotency::{
    IDEMPOTENCY_KEY, IdempotencyContext, IdempotencyLayer, Principal, SqliteStore, Store, Tx,
};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Deserialize;
use serde_json::{Value, json};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{ColumnIndex, Database, Decode, Encode, Executor, IntoArguments, Pool, Row, Type};
use tokio::sync::watch;

const CHARGE_TOPIC: &str = "payments.charge";
/// The outbox topic of the events announcing a succeeded payment.
const EVENT_TOPIC: &str = "payment.succeeded";

/// The authenticated caller; the idempotency layer scopes keys to it.
#[derive(Clone, Debug)]
struct AuthUser(&'static str);

impl<S: Send + Sync> FromRequestParts<S> for AuthUser {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        let token = parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.strip_prefix("Bearer "));
        match token {
            Some("alice-token") => Ok(Self("alice")),
            Some("bob-token") => Ok(Self("bob")),
            _ => Err(problem(
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

/// The SQL that differs between the databases this example runs on; the queries themselves
/// are portable (SQLite accepts `$1` placeholders too).
trait PaymentsDb: Backend {
    const SCHEMA: &'static str;
}

impl PaymentsDb for sqlx::Sqlite {
    const SCHEMA: &'static str = "CREATE TABLE IF NOT EXISTS payments (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        owner TEXT NOT NULL,
        order_id TEXT NOT NULL,
        amount TEXT NOT NULL,
        currency TEXT NOT NULL,
        payee TEXT NOT NULL,
        outbox_id BIGINT NOT NULL
    )";
}

#[cfg(feature = "postgres")]
impl PaymentsDb for sqlx::Postgres {
    const SCHEMA: &'static str = "CREATE TABLE IF NOT EXISTS payments (
        id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        owner TEXT NOT NULL,
        order_id TEXT NOT NULL,
        amount TEXT NOT NULL,
        currency TEXT NOT NULL,
        payee TEXT NOT NULL,
        outbox_id BIGINT NOT NULL
    )";
}

struct AppState<DB: PaymentsDb> {
    pool: Pool<DB>,
    outbox: Outbox<DB>,
}

impl<DB: PaymentsDb> Clone for AppState<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            outbox: self.outbox.clone(),
        }
    }
}

#[derive(Deserialize)]
struct NewPayment {
    /// A string or an integer, passed on to the event unchanged.
    order_id: Value,
    amount: Value,
    currency: String,
    payee: String,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()))
        .init();
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "sqlite:payments.db".into());
    if url.starts_with("postgres") {
        #[cfg(feature = "postgres")]
        {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(16)
                .connect(&url)
                .await?;
            let store = axum_idempotency::PgStore::new(pool.clone());
            store.migrate().await?;
            return serve(pool, store).await;
        }
        #[cfg(not(feature = "postgres"))]
        return Err("DATABASE_URL is postgres://…, build with --features postgres".into());
    } else {
        let options = SqliteConnectOptions::from_str(&url)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal);
        let pool = SqlitePoolOptions::new().connect_with(options).await?;
        let store = SqliteStore::new(pool.clone());
        store.migrate().await?;
        serve(pool, store).await
    }
}

async fn serve<DB>(pool: Pool<DB>, store: Store<DB>) -> Result<(), Box<dyn std::error::Error>>
where
    DB: PaymentsDb,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> <DB as Database>::Arguments: IntoArguments<DB>,
    for<'e> &'e Pool<DB>: Executor<'e, Database = DB>,
    for<'q> String: Encode<'q, DB> + Type<DB>,
    for<'q> i64: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'r> String: Decode<'r, DB>,
    &'static str: ColumnIndex<DB::Row>,
    usize: ColumnIndex<DB::Row>,
{
    let outbox = Outbox::new(pool.clone());
    outbox.migrate().await?;
    sqlx::query(DB::SCHEMA).execute(&pool).await?;

    let broker = match std::env::var("BROKER_URL") {
        Ok(url) if !url.is_empty() => Some(Arc::new(Broker::connect(&url).await?)),
        _ => None,
    };
    let (stop, stopped) = watch::channel(false);
    let mut dispatchers = Vec::new();
    let mut wakers = Vec::new();
    for _ in 0..env_or("DISPATCHERS", 1u32) {
        let sender = Routed {
            provider: provider(),
            broker: broker.clone(),
            outbox: outbox.clone(),
            pool: pool.clone(),
        };
        let dispatcher = dispatcher(outbox.clone(), sender);
        wakers.push(dispatcher.waker());
        let mut stopped = stopped.clone();
        dispatchers.push(tokio::spawn(dispatcher.run(async move {
            let _ = stopped.wait_for(|stop| *stop).await;
        })));
    }

    let state = AppState { pool, outbox };
    let app = Router::new()
        .route("/payments", post(create_payment::<DB>))
        .route_layer(IdempotencyLayer::new(store).principal::<AuthUser>())
        // Outside the idempotency layer, so it runs after the commit: a dispatcher woken
        // earlier would find nothing to send yet.
        .route_layer(middleware::map_response(move |response: Response| {
            let wakers = wakers.clone();
            async move {
                if response.status() == StatusCode::ACCEPTED {
                    wakers.iter().for_each(DispatchWaker::wake);
                }
                response
            }
        }))
        .route("/payments/{id}", get(show_payment::<DB>))
        .with_state(state);

    let bind = std::env::var("BIND").unwrap_or_else(|_| "127.0.0.1:3001".into());
    let shutdown = shutdown_signal()?;
    let listener = tokio::net::TcpListener::bind(&bind).await?;
    println!("payments listening on http://{}", listener.local_addr()?);
    // SIGTERM (Kubernetes, systemd) and Ctrl-C alike: stop accepting, answer every request in
    // flight, then stop the dispatchers and exit 0.
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await?;
    let _ = stop.send(true);
    for dispatcher in dispatchers {
        let _ = dispatcher.await;
    }
    Ok(())
}

/// Listens for SIGTERM (what Kubernetes and systemd send) and SIGINT (Ctrl-C) from now on; the
/// future resolves on the first of them. Registered before the address is printed, so a signal
/// sent as soon as the server is up is never met by the default action (an abrupt exit).
fn shutdown_signal() -> std::io::Result<impl Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = terminate.recv() => {}
            _ = interrupt.recv() => {}
        }
    })
}

fn provider() -> Provider {
    Provider {
        client: Client::builder(TokioExecutor::new()).build_http(),
        base: std::env::var("PROVIDER_URL").unwrap_or_else(|_| "http://127.0.0.1:4000".into()),
        lookup: std::env::var("PROVIDER_LOOKUP").as_deref() != Ok("off"),
    }
}

fn dispatcher<DB: PaymentsDb, S: Sender>(outbox: Outbox<DB>, sender: S) -> Dispatcher<DB, S> {
    let millis = |name, default| Duration::from_millis(env_or(name, default));
    Dispatcher::new(outbox, sender)
        .poll_interval(millis("OUTBOX_POLL_MS", 500))
        .send_timeout(millis("OUTBOX_SEND_TIMEOUT_MS", 5_000))
        .lookup_grace(millis("OUTBOX_LOOKUP_GRACE_MS", 10_000))
        .max_attempts(env_or("OUTBOX_MAX_ATTEMPTS", 10))
        .backoff(Backoff::exponential(
            millis("OUTBOX_BACKOFF_MS", 200),
            Duration::from_secs(10),
        ))
}

async fn create_payment<DB>(
    State(state): State<AppState<DB>>,
    user: AuthUser,
    context: IdempotencyContext,
    mut tx: Tx<DB>,
    Json(payment): Json<NewPayment>,
) -> Response
where
    DB: PaymentsDb,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> <DB as Database>::Arguments: IntoArguments<DB>,
    for<'q> String: Encode<'q, DB> + Type<DB>,
    for<'q> i64: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    usize: ColumnIndex<DB::Row>,
{
    let amount = match &payment.amount {
        Value::Number(n) if n.as_f64().is_some_and(|a| a > 0.0) => n.to_string(),
        _ => return invalid("amount must be a positive number"),
    };
    if payment.currency.len() != 3 || !payment.currency.bytes().all(|b| b.is_ascii_uppercase()) {
        return invalid("currency must be a three-letter ISO 4217 code such as EUR");
    }
    let order_id = match &payment.order_id {
        Value::String(id) if !id.trim().is_empty() => id.clone(),
        Value::Number(id) if id.is_i64() || id.is_u64() => id.to_string(),
        _ => return invalid("order_id must be a non-empty string or an integer"),
    };
    if payment.payee.trim().is_empty() {
        return invalid("order_id and payee are required");
    }

    // Derived from the request's scoped key, so every retry of this intent carries the same
    // key downstream.
    let downstream_key =
        DownstreamKey::for_request(&context.scoped_key_digest(), CHARGE_TOPIC, "charge");
    let charge = json!({
        "order_id": payment.order_id,
        "amount": amount,
        "currency": payment.currency,
        "payee": payment.payee,
    });
    let message = match Message::json(CHARGE_TOPIC, downstream_key, &charge) {
        Ok(message) => message,
        Err(error) => return internal(&error.to_string()),
    };
    let outbox_id = match state.outbox.enqueue(&mut tx, message).await {
        Ok(id) => id,
        Err(error) => return internal(&error.to_string()),
    };
    let id: Result<i64, _> = sqlx::query_scalar(
        "INSERT INTO payments (owner, order_id, amount, currency, payee, outbox_id)
         VALUES ($1, $2, $3, $4, $5, $6) RETURNING id",
    )
    .bind(user.0.to_owned())
    .bind(order_id)
    .bind(amount)
    .bind(payment.currency)
    .bind(payment.payee)
    .bind(outbox_id.get())
    .fetch_one(&mut *tx)
    .await;
    let id = match id {
        Ok(id) => id,
        Err(error) => return internal(&error.to_string()),
    };
    (
        StatusCode::ACCEPTED,
        [(header::LOCATION, format!("/payments/{id}"))],
        Json(json!({ "id": id, "status": "pending" })),
    )
        .into_response()
}

async fn show_payment<DB>(
    State(state): State<AppState<DB>>,
    user: AuthUser,
    Path(id): Path<i64>,
) -> Response
where
    DB: PaymentsDb,
    for<'e> &'e Pool<DB>: Executor<'e, Database = DB>,
    for<'q> <DB as Database>::Arguments: IntoArguments<DB>,
    for<'q> String: Encode<'q, DB> + Type<DB>,
    for<'q> i64: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'r> String: Decode<'r, DB>,
    &'static str: ColumnIndex<DB::Row>,
{
    let row = sqlx::query(
        "SELECT order_id, amount, currency, payee, outbox_id FROM payments
         WHERE id = $1 AND owner = $2",
    )
    .bind(id)
    .bind(user.0.to_owned())
    .fetch_optional(&state.pool)
    .await;
    let row = match row {
        Ok(Some(row)) => row,
        Ok(None) => return problem(StatusCode::NOT_FOUND, "not_found", "no such payment"),
        Err(error) => return internal(&error.to_string()),
    };
    let field = |name: &'static str| row.try_get::<String, _>(name).unwrap_or_default();
    let mut body = json!({
        "id": id,
        "order_id": field("order_id"),
        // Kept as the exact decimal text it was sent as; answered as the number it is.
        "amount": serde_json::from_str::<Value>(&field("amount")).unwrap_or(Value::Null),
        "currency": field("currency"),
        "payee": field("payee"),
    });
    let outbox_id = MessageId::from(row.try_get::<i64, _>("outbox_id").unwrap_or_default());
    match state.outbox.status(outbox_id).await {
        Ok(Some(record)) => match record.status {
            Status::Pending => body["status"] = "pending".into(),
            Status::Delivered => {
                body["status"] = "succeeded".into();
                body["charge_id"] = record.receipt.into();
            }
            Status::Failed => {
                body["status"] = "failed".into();
                body["reason"] = record.last_error.into();
            }
        },
        Ok(None) => return internal("the payment's outbox message is missing"),
        Err(error) => return internal(&error.to_string()),
    }
    Json(body).into_response()
}

/// Charges through the provider's HTTP API, with the downstream key as `Idempotency-Key`.
struct Provider {
    client: Client<HttpConnector, Full<Bytes>>,
    base: String,
    lookup: bool,
}

impl Sender for Provider {
    async fn send(&self, message: &OutboxRecord) -> SendOutcome {
        let request = http::Request::post(format!("{}/charges", self.base))
            .header(header::CONTENT_TYPE, "application/json")
            .header(IDEMPOTENCY_KEY, message.downstream_key.as_str())
            .body(Full::new(Bytes::from(message.payload.clone())));
        let request = match request {
            Ok(request) => request,
            Err(error) => {
                return SendOutcome::Rejected {
                    reason: error.to_string(),
                };
            }
        };
        let response = match self.client.request(request).await {
            Ok(response) => response,
            // Refused before anything was sent: certainly not charged.
            Err(error) if error.is_connect() => {
                return SendOutcome::Retry {
                    after: None,
                    reason: format!("provider unreachable: {error}"),
                };
            }
            Err(error) => {
                return SendOutcome::Unknown {
                    reason: format!("no answer from the provider: {error}"),
                };
            }
        };
        let status = response.status();
        let retry_after = response
            .headers()
            .get(header::RETRY_AFTER)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.parse().ok())
            .map(Duration::from_secs);
        let body = match response.into_body().collect().await {
            Ok(body) => body.to_bytes(),
            Err(error) => {
                return SendOutcome::Unknown {
                    reason: format!("answer cut off: {error}"),
                };
            }
        };
        match status.as_u16() {
            200 | 201 => match charge_id(&body) {
                Some(receipt) => SendOutcome::Delivered { receipt },
                None => SendOutcome::Unknown {
                    reason: "unreadable charge in the answer".into(),
                },
            },
            429 | 503 => SendOutcome::Retry {
                after: retry_after,
                reason: format!("provider answered {status}"),
            },
            // A 500 may come after the charge was written: only a lookup or a resend with the
            // same key can tell.
            500..=599 => SendOutcome::Unknown {
                reason: format!("provider answered {status}"),
            },
            _ => SendOutcome::Rejected {
                reason: format!(
                    "provider refused the charge ({status}): {}",
                    String::from_utf8_lossy(&body)
                ),
            },
        }
    }

    async fn lookup(&self, message: &OutboxRecord) -> LookupOutcome {
        if !self.lookup {
            return LookupOutcome::Unsupported;
        }
        let request = http::Request::get(format!(
            "{}/charges?key={}",
            self.base, message.downstream_key
        ))
        .body(Full::new(Bytes::new()));
        let request = match request {
            Ok(request) => request,
            Err(error) => {
                return LookupOutcome::Failed {
                    reason: error.to_string(),
                };
            }
        };
        let response = match self.client.request(request).await {
            Ok(response) => response,
            Err(error) => {
                return LookupOutcome::Failed {
                    reason: error.to_string(),
                };
            }
        };
        let status = response.status();
        let body = match response.into_body().collect().await {
            Ok(body) => body.to_bytes(),
            Err(error) => {
                return LookupOutcome::Failed {
                    reason: error.to_string(),
                };
            }
        };
        match (status, charge_id(&body)) {
            (StatusCode::OK, Some(receipt)) => LookupOutcome::Found { receipt },
            (StatusCode::NOT_FOUND, _) => LookupOutcome::NotFound,
            _ => LookupOutcome::Failed {
                reason: format!("lookup answered {status}"),
            },
        }
    }
}

/// What the dispatcher sends through: charges to the provider, events to the broker. A charge
/// the provider confirms (sent or found by lookup) enqueues its event in the same outbox, keyed
/// by the charge's own key, so however often that happens the event is enqueued once.
struct Routed<DB: PaymentsDb> {
    provider: Provider,
    broker: Option<Arc<Broker>>,
    outbox: Outbox<DB>,
    pool: Pool<DB>,
}

impl<DB> Routed<DB>
where
    DB: PaymentsDb,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'e> &'e Pool<DB>: Executor<'e, Database = DB>,
    for<'q> <DB as Database>::Arguments: IntoArguments<DB>,
    for<'q> i64: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'r> String: Decode<'r, DB> + Type<DB>,
    &'static str: ColumnIndex<DB::Row>,
{
    /// Enqueues the "payment succeeded" event of a delivered charge.
    async fn announce(&self, charge: &OutboxRecord) -> Result<(), String> {
        if self.broker.is_none() {
            return Ok(());
        }
        let row = sqlx::query("SELECT id, amount, currency FROM payments WHERE outbox_id = $1")
            .bind(charge.id.get())
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| e.to_string())?
            .ok_or("no payment for this charge")?;
        let id: i64 = row.try_get("id").map_err(|e| e.to_string())?;
        let amount: String = row.try_get("amount").map_err(|e| e.to_string())?;
        let currency: String = row.try_get("currency").map_err(|e| e.to_string())?;
        let amount: Value = serde_json::from_str(&amount).map_err(|e| e.to_string())?;
        let sent: Value = charge.payload_json().map_err(|e| e.to_string())?;
        let event = json!({
            "payment_id": id.to_string(),
            "order_id": sent["order_id"],
            "amount": amount,
            "currency": currency,
        });
        let key = DownstreamKey::new(format!("payment-succeeded-{}", charge.downstream_key))
            .map_err(|e| e.to_string())?;
        let message = Message::json(EVENT_TOPIC, key, &event).map_err(|e| e.to_string())?;
        let mut conn = self.pool.acquire().await.map_err(|e| e.to_string())?;
        self.outbox
            .enqueue(&mut conn, message)
            .await
            .map_err(|e| e.to_string())?;
        Ok(())
    }
}

impl<DB> Sender for Routed<DB>
where
    DB: PaymentsDb,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'e> &'e Pool<DB>: Executor<'e, Database = DB>,
    for<'q> <DB as Database>::Arguments: IntoArguments<DB>,
    for<'q> i64: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'r> String: Decode<'r, DB> + Type<DB>,
    &'static str: ColumnIndex<DB::Row>,
{
    async fn send(&self, message: &OutboxRecord) -> SendOutcome {
        if message.topic == EVENT_TOPIC {
            return match &self.broker {
                Some(broker) => broker.send(message).await,
                None => SendOutcome::Retry {
                    after: None,
                    reason: "no BROKER_URL configured".into(),
                },
            };
        }
        let outcome = self.provider.send(message).await;
        if let SendOutcome::Delivered { .. } = &outcome
            && let Err(reason) = self.announce(message).await
        {
            // Charged, event not enqueued: a resend with the same key finds the charge again.
            return SendOutcome::Retry {
                after: None,
                reason: format!("charged; event not enqueued: {reason}"),
            };
        }
        outcome
    }

    async fn lookup(&self, message: &OutboxRecord) -> LookupOutcome {
        if message.topic == EVENT_TOPIC {
            return LookupOutcome::Unsupported;
        }
        let found = self.provider.lookup(message).await;
        if let LookupOutcome::Found { .. } = &found
            && let Err(reason) = self.announce(message).await
        {
            return LookupOutcome::Failed {
                reason: format!("charged; event not enqueued: {reason}"),
            };
        }
        found
    }
}

/// The broker the events go to, declared at start (idempotently).
enum Broker {
    #[cfg(feature = "rabbitmq")]
    RabbitMq(axum_idempotency::outbox::RabbitMqSender),
    #[cfg(feature = "nats")]
    Nats(axum_idempotency::outbox::NatsSender),
}

impl Broker {
    async fn connect(url: &str) -> Result<Self, Box<dyn std::error::Error>> {
        let namespace = std::env::var("BROKER_NAMESPACE").unwrap_or_default();
        #[cfg_attr(
            not(any(feature = "rabbitmq", feature = "nats")),
            allow(unused_variables)
        )]
        let dotted = |name: &str| match namespace.as_str() {
            "" => name.to_owned(),
            ns => format!("{ns}.{name}"),
        };
        match url.split(':').next().unwrap_or_default() {
            #[cfg(feature = "rabbitmq")]
            "amqp" | "amqps" => {
                use lapin::options::ExchangeDeclareOptions;
                use lapin::types::FieldTable;
                let connection =
                    Arc::new(lapin::Connection::connect(url, Default::default()).await?);
                let exchange = dotted("payments");
                // Used as it is if it exists (a passive declare), created durable otherwise.
                let probe = connection.create_channel().await?;
                let passive = ExchangeDeclareOptions {
                    passive: true,
                    ..ExchangeDeclareOptions::default()
                };
                let kind = lapin::ExchangeKind::Topic;
                if probe
                    .exchange_declare(
                        exchange.as_str().into(),
                        kind.clone(),
                        passive,
                        FieldTable::default(),
                    )
                    .await
                    .is_err()
                {
                    let durable = ExchangeDeclareOptions {
                        durable: true,
                        ..ExchangeDeclareOptions::default()
                    };
                    connection
                        .create_channel()
                        .await?
                        .exchange_declare(
                            exchange.as_str().into(),
                            kind,
                            durable,
                            FieldTable::default(),
                        )
                        .await?;
                }
                let sender =
                    axum_idempotency::outbox::RabbitMqSender::connect(connection, exchange)
                        .await?
                        .route(EVENT_TOPIC, "payment.succeeded");
                Ok(Self::RabbitMq(sender))
            }
            #[cfg(feature = "nats")]
            "nats" => {
                let jetstream = async_nats::jetstream::new(async_nats::connect(url).await?);
                let stream = match namespace.as_str() {
                    "" => "PAYMENTS".to_owned(),
                    ns => format!("{}_PAYMENTS", ns.to_uppercase()),
                };
                if jetstream.get_stream(&stream).await.is_err() {
                    jetstream
                        .get_or_create_stream(async_nats::jetstream::stream::Config {
                            name: stream,
                            subjects: vec![dotted("payments.>")],
                            ..Default::default()
                        })
                        .await
                        .map_err(|e| e.to_string())?;
                }
                let sender = axum_idempotency::outbox::NatsSender::new(jetstream)
                    .route(EVENT_TOPIC, dotted("payments.succeeded"));
                Ok(Self::Nats(sender))
            }
            other => Err(format!(
                "BROKER_URL scheme {other:?} is not built in (features rabbitmq, nats)"
            )
            .into()),
        }
    }

    async fn send(&self, message: &OutboxRecord) -> SendOutcome {
        match self {
            #[cfg(feature = "rabbitmq")]
            Self::RabbitMq(sender) => sender.send(message).await,
            #[cfg(feature = "nats")]
            Self::Nats(sender) => sender.send(message).await,
            #[cfg(not(any(feature = "rabbitmq", feature = "nats")))]
            _ => {
                let _ = message;
                unreachable!("no broker is built in")
            }
        }
    }
}

fn charge_id(body: &[u8]) -> Option<String> {
    let charge: Value = serde_json::from_slice(body).ok()?;
    charge["id"].as_str().map(str::to_owned)
}

fn env_or<T: FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(default)
}

fn problem(status: StatusCode, code: &str, detail: &str) -> Response {
    // `about:blank`: the status says what happened; `code` is this app's stable name for it.
    let body = json!({ "type": "about:blank", "title": status.canonical_reason(), "status": status.as_u16(), "code": code, "detail": detail });
    (
        status,
        [(header::CONTENT_TYPE, "application/problem+json")],
        body.to_string(),
    )
        .into_response()
}

fn invalid(detail: &str) -> Response {
    problem(StatusCode::BAD_REQUEST, "invalid_payment", detail)
}

fn internal(detail: &str) -> Response {
    // Details go to the log; the client gets a retryable 500 (the layer keeps no record of it).
    tracing::error!(detail, "payment request failed");
    problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal",
        "internal error",
    )
}
