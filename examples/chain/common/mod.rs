//! What the example apps share: settings, the database they run on, serving until a signal,
//! their problem+json answers, and amounts of money.
//!
//! Each example includes this file as a module of its own (`#[path = "../common/mod.rs"]`), so
//! an item only some of them use is dead code in the others.

use std::time::Duration;

use axum::Router;
use axum::extract::rejection::{JsonRejection, PathRejection};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum_idempotency::TxError;
use serde::de::{self, Deserializer};
use serde::ser::{self, Serializer};
use serde::{Deserialize, Serialize};
use serde_json::json;
use serde_json::value::RawValue;
use tokio::signal::unix::{SignalKind, signal};

pub(crate) type Error = Box<dyn std::error::Error + Send + Sync>;

/// Logs to stderr at `RUST_LOG`'s levels (`info` by default).
pub(crate) fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env();
    let filter = filter.unwrap_or_else(|_| "info".into());
    tracing_subscriber::fmt().with_env_filter(filter).init();
}

/// The setting `name`, or `default` when unset; a value that does not parse stops the example.
pub(crate) fn setting<T: std::str::FromStr>(name: &str, default: T) -> Result<T, Error>
where
    T::Err: std::error::Error + Send + Sync + 'static,
{
    std::env::var(name).map_or(Ok(default), |value| Ok(value.parse()?))
}

/// Runs `$run::<DB>(options, $args…)` on the database `DATABASE_URL` names (`$default` when
/// unset): `sqlite:…`, `postgres://…` (feature `postgres`) or `mysql://…` (feature `mysql`). An
/// SQLite file is created if missing and runs in WAL mode, so readers never wait for a writer.
macro_rules! on_database {
    ($default:expr, $run:ident($($arg:expr),*)) => {{
        let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| $default.into());
        match url.split(':').next().unwrap_or_default() {
            #[cfg(feature = "sqlite")]
            "sqlite" => {
                use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode};
                let options = url.parse::<SqliteConnectOptions>()?.create_if_missing(true);
                let options = options.journal_mode(SqliteJournalMode::Wal);
                $run::<sqlx::Sqlite>(options $(, $arg)*).await
            }
            #[cfg(feature = "postgres")]
            "postgres" | "postgresql" => $run::<sqlx::Postgres>(url.parse()? $(, $arg)*).await,
            #[cfg(feature = "mysql")]
            "mysql" | "mariadb" => $run::<sqlx::MySql>(url.parse()? $(, $arg)*).await,
            other => {
                Err(format!("DATABASE_URL {other:?} is not built in (see --features)").into())
            }
        }
    }};
}
pub(crate) use on_database;

/// Serves `app` on `BIND` (`default_bind` when unset) until SIGTERM (what Kubernetes and
/// systemd send) or Ctrl-C, then answers the requests in flight. `banner` names the app in the
/// line that says where it listens.
pub(crate) async fn serve(app: Router, default_bind: &str, banner: &str) -> Result<(), Error> {
    // Listening for signals before the address is printed: a signal sent as soon as the
    // server is up is never met by the default action (an abrupt exit).
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let handle = axum_server::Handle::new();
    let stop = handle.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = terminate.recv() => {}
            _ = interrupt.recv() => {}
        }
        stop.graceful_shutdown(None);
    });
    let listener = std::net::TcpListener::bind(setting("BIND", default_bind.to_owned())?)?;
    println!("{banner} listening on http://{}", listener.local_addr()?);
    // axum-server, because `axum::serve` has no header read timeout: a client that never
    // finishes its request head would hold its connection for ever. HTTP/1 only, whose timeout
    // runs from the connection's first moment. A failed accept (out of file descriptors, say)
    // only pauses the accept loop.
    let mut server = axum_server::from_tcp(listener)?
        .http1_only()
        .handle(handle)
        .accept_error_handler(|_, error| tracing::warn!(%error, "could not accept a connection"));
    let timeout = Duration::from_secs(5);
    server.http_builder().http1().header_read_timeout(timeout);
    Ok(server.serve(app.into_make_service()).await?)
}

/// A broker name in the test namespace `BROKER_NAMESPACE`, if any: `t1.payments`, and for
/// NATS streams (upper case) `T1_PAYMENTS`.
pub(crate) fn broker_name(name: &str) -> String {
    match std::env::var("BROKER_NAMESPACE") {
        Ok(ns) if !ns.is_empty() && name.starts_with(char::is_uppercase) => {
            format!("{}_{name}", ns.to_uppercase())
        }
        Ok(ns) if !ns.is_empty() => format!("{ns}.{name}"),
        _ => name.to_owned(),
    }
}

/// What a handler answers instead of its result.
pub(crate) enum Problem {
    /// The example's own refusals (status, `code`, detail), as problem+json like the crate's,
    /// with the status's reason phrase as `title`. Their `code`s never start with
    /// `idempotency_` and their `type` is `about:blank`, so a client tells them from the
    /// crate's answers without reading the status alone.
    Refused(StatusCode, &'static str, &'static str),
    /// A statement failed. The layer runs a conflict abort again, a downstream key taken by
    /// another request is final; anything else is a retryable 500, its details logged, never
    /// shown.
    Failed(TxError),
    /// Anything else that failed: logged, answered as a retryable 500.
    Internal(Error),
}

impl Problem {
    /// The answer to a body axum's `Json` refused: `415 unsupported_media_type` (with `media`
    /// as detail) without a JSON content type, `400 malformed_json` for what is not JSON, and
    /// `invalid` for JSON that does not fit, never axum's 422, which a client reading only the
    /// status would take for a reused key.
    pub(crate) fn body(rejection: JsonRejection, media: &'static str, invalid: Self) -> Self {
        match rejection {
            JsonRejection::MissingJsonContentType(_) => Self::Refused(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                media,
            ),
            JsonRejection::JsonDataError(_) => invalid,
            _ => Self::Refused(
                StatusCode::BAD_REQUEST,
                "malformed_json",
                "the body is not valid JSON",
            ),
        }
    }
}

impl From<PathRejection> for Problem {
    fn from(_: PathRejection) -> Self {
        Self::Refused(
            StatusCode::BAD_REQUEST,
            "invalid_id",
            "the id must be an integer",
        )
    }
}

impl From<sqlx::Error> for Problem {
    fn from(error: sqlx::Error) -> Self {
        Self::Failed(error.into())
    }
}

#[cfg(feature = "outbox")]
impl From<axum_idempotency::outbox::Error> for Problem {
    fn from(error: axum_idempotency::outbox::Error) -> Self {
        Self::Failed(error.into())
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let (status, code, detail) = match self {
            Self::Refused(status, code, detail) => (status, code, detail),
            Self::Failed(error) => return error.into_response(),
            Self::Internal(error) => {
                tracing::error!(%error, "request failed");
                return axum_idempotency::Rejection::Internal.into_response();
            }
        };
        let body = json!({ "type": "about:blank", "title": status.canonical_reason(),
            "status": status.as_u16(), "code": code, "detail": detail });
        let content_type = [(header::CONTENT_TYPE, "application/problem+json")];
        (status, content_type, body.to_string()).into_response()
    }
}

/// A JSON number as the client wrote it, digit for digit: never read as a float, which would
/// round `0.1000000000000000001` to `0.1`.
pub(crate) struct Decimal(Box<RawValue>);

impl<'de> Deserialize<'de> for Decimal {
    /// Refuses any other JSON value, as a field of the wrong type.
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = Box::<RawValue>::deserialize(deserializer)?;
        if raw
            .get()
            .starts_with(|c: char| c == '-' || c.is_ascii_digit())
        {
            Ok(Self(raw))
        } else {
            Err(de::Error::invalid_type(
                de::Unexpected::Other(raw.get()),
                &"a number",
            ))
        }
    }
}

/// An amount of money in cents: sums and comparisons are exact.
///
/// On the wire it is a JSON number, read exactly as written (`12.50`, `1.25e1` and `12.5` are
/// the same amount) and written back in one form, whatever form it came in: the decimal with
/// one or two decimals, `12.5`, `12.05`, and `10` as `10.0`.
#[derive(Clone, Copy)]
pub(crate) struct Cents(pub(crate) i64);

impl Cents {
    /// The cents `number` is; `None` when negative, finer than a cent, or from 10^13 on (15
    /// digits of cents, all that a JSON number a client reads as a double carries exactly).
    pub(crate) fn parse(number: &Decimal) -> Option<Self> {
        let text = number.0.get();
        let (mantissa, exponent) = match text.split_once(['e', 'E']) {
            Some((mantissa, exponent)) => {
                let exponent = exponent.strip_prefix('+').unwrap_or(exponent);
                (mantissa, exponent.parse::<i64>().ok()?)
            }
            None => (text, 0),
        };
        let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
        let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
        if !digits(whole) || !digits(fraction) {
            return None;
        }
        let joined = format!("{whole}{fraction}");
        let significant = joined.trim_start_matches('0');
        if significant.is_empty() {
            return Some(Self(0));
        }
        // The amount is `significant` × 10^(exponent − decimals): in cents, two places more.
        let decimals = i64::try_from(fraction.len()).ok()?;
        let shift = exponent.checked_sub(decimals)?.checked_add(2)?;
        let mut kept = significant;
        if shift < 0 {
            // What lies beyond the cents must be zeros.
            let beyond = usize::try_from(shift.unsigned_abs()).ok()?;
            let (cents, rest) = significant.split_at(significant.len().checked_sub(beyond)?);
            if rest.bytes().any(|b| b != b'0') {
                return None;
            }
            kept = cents;
        }
        let zeros = u32::try_from(shift.max(0)).ok()?;
        if kept.len() + usize::try_from(zeros).ok()? > 15 {
            return None;
        }
        Some(Self(kept.parse::<i64>().ok()? * 10_i64.pow(zeros)))
    }
}

impl Serialize for Cents {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let (whole, cents) = (self.0 / 100, self.0 % 100);
        let text = if cents % 10 == 0 {
            format!("{whole}.{}", cents / 10)
        } else {
            format!("{whole}.{cents:02}")
        };
        RawValue::from_string(text)
            .map_err(ser::Error::custom)?
            .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Cents {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let number = Decimal::deserialize(deserializer)?;
        Self::parse(&number).ok_or_else(|| de::Error::custom("not an amount of whole cents"))
    }
}
