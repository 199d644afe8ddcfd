//! An outbox [`Sender`] for an HTTP API that deduplicates by `Idempotency-Key`.

use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;
use std::time::SystemTime;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderName, HeaderValue, RETRY_AFTER};
use http::{HeaderMap, Method, Request, Response, StatusCode, Uri};
use http_body::Body;
use http_body_util::{BodyExt, Full, Limited};
use tower::{Service, ServiceExt};

use super::{LookupOutcome, OutboxRecord, SendOutcome, Sender};

type BoxError = Box<dyn StdError + Send + Sync>;

/// Delivers each outbox message as a `POST` to an HTTP API (a payment provider, an SMS
/// gateway), with the message's [downstream key](OutboxRecord::downstream_key) as its
/// `Idempotency-Key`, and can look a message up by that key before a resend.
///
/// It sends the payload as it is, with `Content-Type: application/json` unless a
/// [`header`](Self::header) says otherwise, through any tower HTTP client (hyper-util's
/// `Client` is one; the dispatcher's send timeout bounds each call, body included). The
/// answer becomes a [`SendOutcome`]:
///
/// | answer | outcome |
/// |---|---|
/// | `2xx` | delivered; the receipt is the string or number at [`receipt`](Self::receipt) in the JSON body (default `/id`), else the status |
/// | `429`, `503` | unavailable, never probed again before the answer's `Retry-After` (seconds or a date) |
/// | `408` | retry, never before the answer's `Retry-After` |
/// | `409` with a `Retry-After`, or with this crate's problem document for a key still in flight (`code` `idempotency_request_in_progress`, or its `type`, from a server of any version) | retry, never before the answer's `Retry-After`: the key's first request is still running |
/// | any other `409` | rejected for good: the downstream's answer to this request (a business conflict) |
/// | any other `5xx` | unknown: the request may have been applied, so it is looked up first |
/// | any other status | rejected for good, with the status and the start of the body |
/// | no connection: refused, or reset, timed out or unresolved while connecting | unavailable: the request never left |
/// | any other transport error | unknown |
///
/// A downstream whose answers mean something else (a `423` while an account is migrated, a
/// `409` that is always worth another attempt) gets its own rules with
/// [`classify`](Self::classify), consulted before this table.
///
/// Whether a request left is known from hyper-util's client, which tells an error while
/// connecting from one later; with another client, only a refused connection counts as
/// unsent.
///
/// Without [`lookup_url`](Self::lookup_url), an unknown outcome is resent at once under the
/// same key, which is safe with an API that deduplicates by it. With it, the dispatcher first
/// asks `GET` on that URL: `200` is found (the receipt read as above), `404` not found,
/// anything else a failed lookup, asked again later. An answer's body is read up to 1 MiB; a
/// longer one counts as cut off.
///
/// ```
/// # #[cfg(feature = "sqlite")]
/// # async fn run(outbox: axum_idempotency::outbox::Outbox<sqlx::Sqlite>) {
/// use axum_idempotency::outbox::{Dispatcher, HttpSender};
/// use http::{HeaderValue, Uri, header::AUTHORIZATION};
/// use hyper_util::client::legacy::Client;
/// use hyper_util::rt::TokioExecutor;
///
/// let client = Client::builder(TokioExecutor::new()).build_http();
/// let url = Uri::from_static("http://127.0.0.1:4000/charges");
/// let provider = HttpSender::new(client, url)
///     .header(AUTHORIZATION, HeaderValue::from_static("Bearer sk_test_123"))
///     .lookup_url("http://127.0.0.1:4000/charges?key={key}");
/// tokio::spawn(Dispatcher::new(outbox, provider).run(std::future::pending()));
/// # }
/// ```
#[derive(Clone)]
pub struct HttpSender<C> {
    client: C,
    url: Uri,
    headers: HeaderMap,
    lookup: Option<String>,
    receipt: String,
    classify: Option<Classify>,
}

/// The user's rules for answers, asked before the default table.
type Classify = Arc<dyn Fn(StatusCode, &HeaderMap, &[u8]) -> Option<SendOutcome> + Send + Sync>;

impl<C> fmt::Debug for HttpSender<C> {
    /// Header values are left out: they usually hold the API's credentials.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpSender")
            .field("url", &self.url)
            .field("headers", &self.headers.keys().collect::<Vec<_>>())
            .field("lookup", &self.lookup)
            .field("receipt", &self.receipt)
            .field("classify", &self.classify.is_some())
            .finish_non_exhaustive()
    }
}

impl<C> HttpSender<C> {
    /// A sender that posts every message to `url` through `client`.
    pub fn new(client: C, url: Uri) -> Self {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        Self {
            client,
            url,
            headers,
            lookup: None,
            receipt: "/id".into(),
            classify: None,
        }
    }

    /// Sends `name: value` with every request (lookups included), replacing a header of that
    /// name set before: the API's credentials, or another `Content-Type`.
    #[must_use]
    pub fn header(mut self, name: HeaderName, value: HeaderValue) -> Self {
        self.headers.insert(name, value);
        self
    }

    /// Looks a message up with `GET` on `url`, where `{key}` stands for the downstream key
    /// (percent-encoded). Needed when the API does not deduplicate by `Idempotency-Key`; none by
    /// default.
    #[must_use]
    pub fn lookup_url(mut self, url: impl Into<String>) -> Self {
        self.lookup = Some(url.into());
        self
    }

    /// Where the receipt is in a `2xx` JSON body, as a JSON pointer (RFC 6901); `/id` by
    /// default.
    #[must_use]
    pub fn receipt(mut self, pointer: impl Into<String>) -> Self {
        self.receipt = pointer.into();
        self
    }

    /// Classifies answers by `rules` first: an answer they map to `Some(outcome)` ends that
    /// way, one they map to `None` follows the [default table](Self). Given the status, the
    /// headers and the body (up to 1 MiB) of each answer to a send, not to a lookup. A second
    /// call replaces the first one's rules.
    ///
    /// ```
    /// use std::time::Duration;
    /// use axum_idempotency::outbox::{HttpSender, SendOutcome};
    /// use http::{StatusCode, Uri};
    /// use hyper_util::client::legacy::Client;
    /// use hyper_util::rt::TokioExecutor;
    ///
    /// let client = Client::builder(TokioExecutor::new()).build_http();
    /// let url = Uri::from_static("http://127.0.0.1:4000/charges");
    /// // This provider answers 423 while it migrates an account: nothing was done, try later.
    /// let provider = HttpSender::new(client, url).classify(|status, _headers, _body| {
    ///     (status == StatusCode::LOCKED).then(|| SendOutcome::Retry {
    ///         after: Some(Duration::from_secs(60)),
    ///         reason: "account being migrated".into(),
    ///     })
    /// });
    /// # let _: HttpSender<hyper_util::client::legacy::Client<_, http_body_util::Full<bytes::Bytes>>> = provider;
    /// ```
    #[must_use]
    pub fn classify<F>(mut self, rules: F) -> Self
    where
        F: Fn(StatusCode, &HeaderMap, &[u8]) -> Option<SendOutcome> + Send + Sync + 'static,
    {
        self.classify = Some(Arc::new(rules));
        self
    }

    /// The outcome of an answer to a send: the user's rules, else the default table.
    fn outcome(&self, status: StatusCode, headers: &HeaderMap, body: &[u8]) -> SendOutcome {
        if let Some(outcome) = self
            .classify
            .as_ref()
            .and_then(|rules| rules(status, headers, body))
        {
            return outcome;
        }
        let after = || crate::backoff::retry_after(headers, SystemTime::now());
        let reason = format!("answered {status}");
        match status.as_u16() {
            200..=299 => SendOutcome::Delivered {
                receipt: self.receipt_of(status, body),
            },
            429 | 503 => SendOutcome::Unavailable {
                after: after(),
                reason,
            },
            408 => retry(after(), reason),
            // The Idempotency-Key draft's answer while the key's first request runs; nothing
            // marks it but a `Retry-After` or the problem document, so any other 409 is the
            // downstream's verdict on this request.
            409 if headers.contains_key(RETRY_AFTER)
                || crate::backoff::is_in_progress_conflict(body) =>
            {
                retry(after(), reason)
            }
            // Possibly applied before the failure: only a lookup or a resend with the same key
            // can tell.
            500..=599 => SendOutcome::Unknown { reason },
            _ => rejected(format!("{reason}: {}", excerpt(body))),
        }
    }

    /// The receipt in `body`, or the status when the body has none.
    fn receipt_of(&self, status: StatusCode, body: &[u8]) -> String {
        let json = serde_json::from_slice::<serde_json::Value>(body).ok();
        match json.as_ref().and_then(|json| json.pointer(&self.receipt)) {
            Some(serde_json::Value::String(text)) => text.clone(),
            Some(number @ serde_json::Value::Number(_)) => number.to_string(),
            _ => status.to_string(),
        }
    }
}

/// What the API answered: its status, headers and body.
type Answer = (StatusCode, HeaderMap, Bytes);

impl<C, B> HttpSender<C>
where
    C: Service<Request<Full<Bytes>>, Response = Response<B>> + Clone + Send + Sync + 'static,
    C::Future: Send,
    C::Error: Into<BoxError>,
    B: Body + Send,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    /// Makes one call. `Err((sent, reason))`, where `sent` is false when the request certainly
    /// never left (no connection was made).
    async fn call(&self, request: Request<Full<Bytes>>) -> Result<Answer, (bool, String)> {
        let response = match self.client.clone().oneshot(request).await {
            Ok(response) => response,
            Err(error) => {
                let error: BoxError = error.into();
                return Err((!never_sent(&*error), causes(&*error)));
            }
        };
        let (parts, body) = response.into_parts();
        match Limited::new(body, MAX_ANSWER).collect().await {
            Ok(body) => Ok((parts.status, parts.headers, body.to_bytes())),
            Err(error) => Err((true, format!("answer cut off: {error}"))),
        }
    }

    /// A request with the sender's headers.
    fn request(&self, method: Method, uri: Uri, body: Bytes) -> Request<Full<Bytes>> {
        let mut request = Request::new(Full::new(body));
        *request.method_mut() = method;
        *request.uri_mut() = uri;
        *request.headers_mut() = self.headers.clone();
        request
    }
}

impl<C, B> Sender for HttpSender<C>
where
    C: Service<Request<Full<Bytes>>, Response = Response<B>> + Clone + Send + Sync + 'static,
    C::Future: Send,
    C::Error: Into<BoxError>,
    B: Body + Send,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    async fn send(&self, message: &OutboxRecord) -> SendOutcome {
        let payload = Bytes::from(message.payload.clone());
        let mut request = self.request(Method::POST, self.url.clone(), payload);
        // A downstream key is visible ASCII, always a valid header value.
        if let Ok(key) = HeaderValue::try_from(message.downstream_key.as_str()) {
            request.headers_mut().insert(IDEMPOTENCY_KEY, key);
        }
        match self.call(request).await {
            Ok((status, headers, body)) => self.outcome(status, &headers, &body),
            Err((false, reason)) => SendOutcome::Unavailable {
                after: None,
                reason: format!("unreachable: {reason}"),
            },
            Err((true, reason)) => SendOutcome::Unknown {
                reason: format!("no answer: {reason}"),
            },
        }
    }

    async fn lookup(&self, message: &OutboxRecord) -> LookupOutcome {
        let Some(template) = &self.lookup else {
            return LookupOutcome::Unsupported;
        };
        let url = template.replace("{key}", &percent_encode(message.downstream_key.as_str()));
        let Ok(uri) = Uri::try_from(url.as_str()) else {
            return LookupOutcome::Failed {
                reason: format!("the lookup URL {url:?} does not parse"),
            };
        };
        let request = self.request(Method::GET, uri, Bytes::new());
        match self.call(request).await {
            Ok((StatusCode::OK, _, body)) => LookupOutcome::Found {
                receipt: self.receipt_of(StatusCode::OK, &body),
            },
            Ok((StatusCode::NOT_FOUND, _, _)) => LookupOutcome::NotFound,
            Ok((status, _, _)) => LookupOutcome::Failed {
                reason: format!("lookup answered {status}"),
            },
            Err((_, reason)) => LookupOutcome::Failed { reason },
        }
    }
}

/// How much of an answer's body is read: receipts and refusals are small, and an endless body
/// must not hold the dispatcher's memory.
const MAX_ANSWER: usize = 1 << 20;

const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

fn retry(after: Option<std::time::Duration>, reason: String) -> SendOutcome {
    SendOutcome::Retry { after, reason }
}

fn rejected(reason: String) -> SendOutcome {
    SendOutcome::Rejected { reason }
}

/// Whether `error` says no connection was made, so nothing was sent: hyper-util's client
/// failed while connecting (refused, reset or timed out before the request was written, a
/// name that does not resolve), or, from any client, the connection was refused.
fn never_sent(error: &(dyn StdError + 'static)) -> bool {
    let mut cause = Some(error);
    while let Some(error) = cause {
        let connecting = error
            .downcast_ref::<hyper_util::client::legacy::Error>()
            .is_some_and(hyper_util::client::legacy::Error::is_connect);
        let refused = error
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused);
        if connecting || refused {
            return true;
        }
        cause = error.source();
    }
    false
}

/// `error` and its causes, for the record's `last_error`: hyper-util's own message names only
/// the phase ("client error (Connect)"), its causes say what happened.
fn causes(error: &(dyn StdError + 'static)) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(error) = cause {
        text.push_str(": ");
        text.push_str(&error.to_string());
        cause = error.source();
    }
    text
}

/// The start of a refusal's body, for the record's `last_error`.
fn excerpt(body: &[u8]) -> String {
    String::from_utf8_lossy(body).chars().take(200).collect()
}

/// `text` with every byte but RFC 3986's unreserved ones percent-encoded, for a query or a path.
fn percent_encode(text: &str) -> String {
    let mut encoded = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            encoded.push(char::from(byte));
        } else {
            encoded.push_str(&format!("%{byte:02X}"));
        }
    }
    encoded
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_percent_encoded_for_the_lookup_url() {
        assert_eq!(percent_encode("a-Z_0.~"), "a-Z_0.~");
        assert_eq!(percent_encode("a&b=c#d%e f"), "a%26b%3Dc%23d%25e%20f");
    }

    #[test]
    fn the_receipt_is_read_at_the_pointer_or_is_the_status() {
        let sender = HttpSender::new((), Uri::from_static("http://x/")).receipt("/charge/id");
        let status = StatusCode::CREATED;
        assert_eq!(
            sender.receipt_of(status, br#"{"charge":{"id":"ch_1"}}"#),
            "ch_1"
        );
        assert_eq!(sender.receipt_of(status, br#"{"charge":{"id":42}}"#), "42");
        assert_eq!(sender.receipt_of(status, b"not json"), "201 Created");
    }
}
