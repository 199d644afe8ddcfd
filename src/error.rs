//! Errors: [`Rejection`] is what a client sees, [`Error`] is what an operator sees.
//!
//! Every rejection renders as `application/problem+json` (RFC 9457) with a distinct `type`
//! and a stable `code` member that client code can match on:
//!
//! | case | status | `code` |
//! |---|---|---|
//! | key required but missing | 400 | `idempotency_key_missing` |
//! | key malformed (empty, too long, bad characters, several values) | 400 | `idempotency_key_invalid` |
//! | no verified principal on a scoped route (the principal source refused the caller) | 401 | `idempotency_principal_missing` |
//! | the principal source failed for another reason (its database is down, a pool timed out) | 503 + `Retry-After` | `idempotency_principal_unavailable` |
//! | same scoped key, different intent | 422 | `idempotency_key_reused` |
//! | same scoped key still in flight after the wait | 409 + `Retry-After` | `idempotency_request_in_progress` |
//! | leased work lost its lease to another worker (jobs only) | 409 | `idempotency_lease_lost` |
//! | request body over the layer's limit | 413 | `idempotency_body_too_large` |
//! | request body could not be read (the client went away mid-body) | 400 | `idempotency_body_unreadable` |
//! | request body not received within the layer's deadline (the connection is closed) | 408 + `Retry-After` | `idempotency_body_timeout` |
//! | handler response over the storable limit (rolled back) | 500 | `idempotency_response_too_large` |
//! | a `Tx` was still held when the handler returned (rolled back) | 500 | `idempotency_transaction_held` |
//! | the store failed or the handler panicked (rolled back) | 500 + `Retry-After` | `idempotency_internal_error` |
//! | no answer within the layer's deadline (the database is silent or saturated) | 503 + `Retry-After` | `idempotency_timeout` |
//! | the database kept aborting the transaction on conflicts with concurrent ones, past the re-runs | 503 + `Retry-After` | `idempotency_conflict` |
//! | a `Tx` extracted on a route no layer of its database wraps (a router mistake; the detail names the fix) | 500 | `idempotency_layer_missing` |
//!
//! The 5xx are retryable with the same key: nothing of the attempt was committed, or, after
//! `idempotency_timeout`, whatever still commits is what the retry replays. Database details
//! never reach the client; they are logged through `tracing`.
//!
//! Every `code` the crate sets starts with `idempotency_` and every `type` is a link into these
//! docs, so a client tells the crate's answers from its application's own errors by that prefix.
//!
//! The `type` links to the rejection's description in the docs of the version that answered,
//! for example
//! `https://docs.rs/axum-idempotency/0.1.0/axum_idempotency/error/enum.Rejection.html#variant.KeyReused`,
//! so what it points at never changes under a running server. Client code matches the `code`,
//! which is the same in every version; code that reads the `type` matches its fragment
//! (`#variant.KeyReused`), never the version in the path. This crate's own client and the
//! outbox's HTTP sender recognise a server of any version that way.

use std::time::Duration;

use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};
use serde::Serialize;

use crate::key::KeyError;

/// The crate's error for operators: what went wrong below the HTTP contract.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The database failed.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// A lock wait ran out: another transaction still holds what this one needs. Transient.
    #[error("the database is busy: a lock wait ran out")]
    Busy,
    /// The database rolled this transaction back to resolve a deadlock or a serialization
    /// conflict. Transient; trying again at once is safe.
    #[error("the transaction was rolled back by a deadlock or serialization conflict")]
    Conflict,
    /// A stored record could not be read back.
    #[error("corrupt idempotency record: {0}")]
    CorruptRecord(String),
    /// A schema migration failed.
    #[error("migration failed: {0}")]
    Migration(String),
    /// The store's tables are older than this release needs, or were never created: no keyed
    /// request can succeed until they are migrated. Call the store's `migrate()` at start-up;
    /// a team applying the scripts under `migrations/<backend>/` with its own tool applies
    /// them up to `expected` and records each version in `idempotency_schema_versions`.
    #[error(
        "the idempotency schema is at version {found}, this release needs version {expected}: \
         call Store::migrate()"
    )]
    SchemaOutdated {
        /// The newest version recorded in the database; 0 when it was never migrated.
        found: i64,
        /// The version this release needs.
        expected: i64,
    },
}

/// Why a request was not executed (or not answered as executed): the client-facing half.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Rejection {
    /// The route requires an `Idempotency-Key` and the request had none.
    #[error("this request requires an Idempotency-Key header")]
    KeyMissing,
    /// The `Idempotency-Key` header was malformed.
    #[error("{0}")]
    KeyInvalid(#[from] KeyError),
    /// No verified principal was found for a scoped route: the principal source refused the
    /// caller (its rejection was a 4xx other than 408 or 429), or none is configured.
    #[error("the request carries no verified identity to scope its idempotency key to")]
    PrincipalMissing,
    /// The principal source failed without refusing the caller (its rejection was a 5xx, 408
    /// or 429: its database is down, a pool timed out). Retryable: nothing was claimed.
    #[error("the caller's identity could not be verified right now; try again")]
    PrincipalUnavailable,
    /// No answer was ready within the layer's [deadline](crate::IdempotencyLayer::deadline).
    /// Retryable, with the same key for a keyed request: if the attempt still commits, the
    /// retry replays it; if it is still running, the retry is told it is in progress.
    #[error(
        "the request could not be answered in time; retry it, with the same idempotency key if it had one"
    )]
    Timeout,
    /// The key was already used for a request with a different intent.
    #[error("this idempotency key was already used for a different request")]
    KeyReused,
    /// A request with the same key is still being processed.
    #[error("a request with this idempotency key is still in progress")]
    InProgress {
        /// When the client should try again.
        retry_after: Duration,
    },
    /// The request body exceeded the layer's limit.
    #[error("the request body exceeds the limit of {limit} bytes")]
    BodyTooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// Leased work lost its lease to another worker; the outcome is that worker's to record.
    #[error("the lease on this idempotency key was lost to another worker")]
    LeaseLost,
    /// The request body could not be read, typically because the client went away.
    #[error("the request body could not be read")]
    BodyUnreadable,
    /// The client had not sent its whole body by the layer's
    /// [deadline](crate::IdempotencyLayer::deadline). Retryable with the same key: nothing was
    /// claimed. The connection is closed, since the rest of the body was never read.
    #[error("the request body did not arrive in time; send it again with the same idempotency key")]
    BodyTimeout,
    /// The handler's response exceeded the storable limit; the attempt was rolled back.
    #[error("the response was too large to store; nothing was committed")]
    ResponseTooLarge,
    /// A [`Tx`](crate::Tx) was still held when the handler returned; the attempt was rolled back.
    #[error(
        "the request's transaction was still held when the handler returned; nothing was committed"
    )]
    TransactionHeld,
    /// The store failed or the handler panicked; the attempt was rolled back.
    #[error("the request could not be processed; nothing was committed")]
    Internal,
    /// The database kept aborting the request's transaction to resolve conflicts with
    /// concurrent ones (serialization failures, deadlocks, certification conflicts), and the
    /// attempts to run it again ran out. Retryable with the same key: nothing was committed.
    #[error(
        "the request kept conflicting with concurrent ones; nothing was committed, retry it with the same idempotency key"
    )]
    Conflict,
    /// A [`Tx`](crate::Tx) was extracted on a route that no [`IdempotencyLayer`] of its
    /// database (and of its marker, if it has one) wraps: a mistake in the router, which a
    /// retry cannot cure. Add the layer with [`Router::route_layer`](axum::Router::route_layer),
    /// on a store of the same database, marked with
    /// [`tx_marker`](crate::IdempotencyLayer::tx_marker) where the `Tx` names a marker.
    ///
    /// [`IdempotencyLayer`]: crate::IdempotencyLayer
    #[error("{}", layer_missing(database, *marker))]
    LayerMissing {
        /// The database of the `Tx` (as sqlx names it).
        database: &'static str,
        /// The marker type the `Tx` names (its type name); `None` for an unmarked `Tx<DB>`.
        marker: Option<&'static str>,
    },
}

/// Everything a rejection's answer is made of, written once per variant.
struct Description {
    status: StatusCode,
    code: &'static str,
    variant: &'static str,
    title: &'static str,
}

impl Rejection {
    /// The HTTP status of this rejection.
    pub fn status(&self) -> StatusCode {
        self.describe().status
    }

    /// When a client should try again with the same key, for the rejections that invite it
    /// (sent as `Retry-After`); `None` for final ones and for misuse a retry cannot cure.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::InProgress { retry_after } => Some(*retry_after),
            // A transient fault: one second spreads the retries of a burst without making a
            // client wait long once the database is back.
            Self::PrincipalUnavailable
            | Self::Timeout
            | Self::BodyTimeout
            | Self::Internal
            | Self::Conflict => Some(Duration::from_secs(1)),
            _ => None,
        }
    }

    /// Answered by the layer before a claim, so the engine never saw (nor logged) the request.
    pub(crate) fn is_before_claim(&self) -> bool {
        matches!(
            self,
            Self::KeyMissing
                | Self::KeyInvalid(_)
                | Self::PrincipalMissing
                | Self::PrincipalUnavailable
                | Self::BodyTooLarge { .. }
                | Self::BodyUnreadable
                | Self::BodyTimeout
        )
    }

    /// The stable `code` member of the problem document.
    pub fn code(&self) -> &'static str {
        self.describe().code
    }

    fn describe(&self) -> Description {
        let (status, code, variant, title) = match self {
            Self::KeyMissing => (
                StatusCode::BAD_REQUEST,
                "idempotency_key_missing",
                "KeyMissing",
                "Idempotency key missing",
            ),
            Self::KeyInvalid(_) => (
                StatusCode::BAD_REQUEST,
                "idempotency_key_invalid",
                "KeyInvalid",
                "Idempotency key invalid",
            ),
            Self::PrincipalMissing => (
                StatusCode::UNAUTHORIZED,
                "idempotency_principal_missing",
                "PrincipalMissing",
                "Principal missing",
            ),
            Self::PrincipalUnavailable => (
                StatusCode::SERVICE_UNAVAILABLE,
                "idempotency_principal_unavailable",
                "PrincipalUnavailable",
                "Principal unavailable",
            ),
            Self::Timeout => (
                StatusCode::SERVICE_UNAVAILABLE,
                "idempotency_timeout",
                "Timeout",
                "Timed out",
            ),
            Self::KeyReused => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "idempotency_key_reused",
                "KeyReused",
                "Idempotency key reused",
            ),
            Self::InProgress { .. } => (
                StatusCode::CONFLICT,
                "idempotency_request_in_progress",
                "InProgress",
                "Request in progress",
            ),
            Self::LeaseLost => (
                StatusCode::CONFLICT,
                "idempotency_lease_lost",
                "LeaseLost",
                "Lease lost",
            ),
            Self::BodyTooLarge { .. } => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "idempotency_body_too_large",
                "BodyTooLarge",
                "Request body too large",
            ),
            Self::BodyUnreadable => (
                StatusCode::BAD_REQUEST,
                "idempotency_body_unreadable",
                "BodyUnreadable",
                "Request body unreadable",
            ),
            Self::BodyTimeout => (
                StatusCode::REQUEST_TIMEOUT,
                "idempotency_body_timeout",
                "BodyTimeout",
                "Request body timed out",
            ),
            Self::ResponseTooLarge => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "idempotency_response_too_large",
                "ResponseTooLarge",
                "Response too large to store",
            ),
            Self::TransactionHeld => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "idempotency_transaction_held",
                "TransactionHeld",
                "Transaction still held",
            ),
            Self::Internal => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "idempotency_internal_error",
                "Internal",
                "Internal error",
            ),
            Self::Conflict => (
                StatusCode::SERVICE_UNAVAILABLE,
                "idempotency_conflict",
                "Conflict",
                "Conflicts with concurrent requests",
            ),
            Self::LayerMissing { .. } => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "idempotency_layer_missing",
                "LayerMissing",
                "Idempotency layer missing",
            ),
        };
        Description {
            status,
            code,
            variant,
            title,
        }
    }
}

/// The page documenting [`Rejection`] in this version's docs on docs.rs; a problem's `type` is
/// this page with the variant's anchor, so a developer who follows it reads that rejection's
/// description as the answering server meant it. The version is in the path because
/// `/latest/` would change what an old server's answer links to with every release. The path
/// is the one rustdoc gives the type where it is defined (the `error` module): the crate
/// root's re-export is not inlined and has no page of its own.
const REJECTION_DOCS: &str = concat!(
    "https://docs.rs/axum-idempotency/",
    env!("CARGO_PKG_VERSION"),
    "/axum_idempotency/error/enum.Rejection.html"
);

/// What [`Rejection::LayerMissing`] says: the `Tx` asked for, and the layer that would give it.
fn layer_missing(database: &str, marker: Option<&str>) -> String {
    match marker {
        None => format!(
            "Tx<{database}> needs an IdempotencyLayer on a {database} store around the route; add one with Router::route_layer"
        ),
        Some(marker) => format!(
            "Tx<{database}, {marker}> needs an IdempotencyLayer on a {database} store with .tx_marker::<{marker}>() around the route; add one with Router::route_layer"
        ),
    }
}

/// The problem `type` of the variant named `variant`.
fn problem_type(variant: &str) -> String {
    format!("{REJECTION_DOCS}#variant.{variant}")
}

impl Rejection {
    /// The problem `type` this rejection is answered with.
    #[cfg(all(test, any(feature = "client", feature = "outbox")))]
    pub(crate) fn problem_type(&self) -> String {
        problem_type(self.describe().variant)
    }
}

/// The problem document. Written by hand rather than with a problem-details crate because
/// `http::Uri` cannot hold the fragment our `type` links to (the variant's rustdoc anchor).
#[derive(Serialize)]
struct Problem<'a> {
    r#type: String,
    title: &'a str,
    status: u16,
    detail: String,
    code: &'a str,
}

impl IntoResponse for Rejection {
    fn into_response(self) -> Response {
        let Description {
            status,
            code,
            variant,
            title,
        } = self.describe();
        let problem = Problem {
            r#type: problem_type(variant),
            title,
            status: status.as_u16(),
            detail: self.to_string(),
            code,
        };
        let body = serde_json::to_vec(&problem).unwrap_or_default();
        let mut response = (
            status,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/problem+json"),
            )],
            body,
        )
            .into_response();
        // A body left unread in part: the connection cannot carry another request, and closing
        // it is what frees the server from a client that keeps trickling.
        if matches!(self, Self::BodyTimeout | Self::BodyTooLarge { .. }) {
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        if let Some(retry_after) = self.retry_after() {
            let seconds = retry_after.as_secs().max(1);
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}
