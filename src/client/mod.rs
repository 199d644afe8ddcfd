//! The client half: one idempotency key per logical call, reused on every retry.
//!
//! The server can only make a retried request safe if the retry carries the key of the first
//! attempt. [`IdempotentRetryLayer`] wraps any tower HTTP client (`Service<http::Request<_>>`,
//! such as hyper-util's `Client`) and does that for you:
//!
//! - For each call whose method is keyed (`POST` and `PATCH` unless you say otherwise) it makes a
//!   key before the first attempt — 192 bits from the operating system's CSPRNG as URL-safe
//!   base64 — and sends it in `Idempotency-Key`. A key the caller brings is used instead: a
//!   [`ClientKey`] request extension (e.g. derived from the caller's own order id) or the header
//!   already set.
//! - Every retry sends the **same** key and the **same** body: the body is buffered once (up to
//!   [`max_request_body`](IdempotentRetryLayer::max_request_body)) and resent.
//! - It retries only what is safe and useful to retry: connection errors, timeouts, `408`,
//!   `429`, `5xx`, and `409` with the problem `code` `idempotency_request_in_progress`, or a
//!   `type` into this crate's docs ending `#variant.InProgress` (the server, of whichever version of this
//!   crate, is still running the first attempt). Every other answer is final and returned at
//!   once: `400`, `401`, `403`, `404`, `422` (key reused with a different request — a bug in the
//!   caller), and a business `409` such as `out_of_stock`.
//! - It waits as `Retry-After` says (seconds or an HTTP-date), otherwise exponential backoff with
//!   full jitter, and stops after [`max_attempts`](IdempotentRetryLayer::max_attempts) or at the
//!   call's [`deadline`](IdempotentRetryLayer::deadline), returning the last answer it got.
//! - The response carries the key used ([`ClientKey`]) and the number of attempts
//!   ([`Attempts`]) as extensions, for your logs; a failed call's [`Error`] carries both too.
//!
//! # What the caller must know
//!
//! A call that ends in an [`Error`] after attempts were sent may still have been executed by the
//! server: its answer was lost. If the operation still matters, retry it later with the key
//! from [`Error::key`] — never with a new key, which the server would treat as a second order.
//! For the same reason, one key means one intent: do not reuse a [`ClientKey`] for a different
//! request (the server answers `422`).
//!
//! Requests with methods that are not keyed are retried without a key when HTTP defines the
//! method as idempotent (`GET`, `PUT`, `DELETE`, …) and sent exactly once otherwise.
//!
//! # Example
//!
//! ```no_run
//! use std::time::Duration;
//!
//! use axum_idempotency::client::{Attempts, ClientKey, IdempotentRetryLayer};
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use tower::{Layer as _, ServiceExt as _};
//!
//! # async fn place_order(
//! #     http: impl tower::Service<
//! #         http::Request<Full<Bytes>>,
//! #         Response = http::Response<http_body_util::Empty<Bytes>>,
//! #         Error = std::io::Error,
//! #         Future: Send,
//! #     > + Clone + Send + 'static,
//! # ) -> Result<(), Box<dyn std::error::Error>> {
//! // `http` is your tower HTTP client, e.g. hyper_util::client::legacy::Client.
//! let client = IdempotentRetryLayer::new()
//!     .max_attempts(5)
//!     .deadline(Duration::from_secs(30))
//!     .layer(http);
//!
//! let request = http::Request::post("http://127.0.0.1:3000/orders")
//!     .header("authorization", "Bearer alice-token")
//!     .header("content-type", "application/json")
//!     .body(Full::new(Bytes::from_static(br#"{"sku":"widget","quantity":1}"#)))?;
//! let response = client.oneshot(request).await?;
//!
//! let key = response.extensions().get::<ClientKey>();
//! let attempts = response.extensions().get::<Attempts>();
//! println!("{} with key {key:?} after {attempts:?}", response.status());
//! # Ok(())
//! # }
//! ```
//!
//! Callers with their own identity for the operation attach it, so a restarted process retries
//! with the same key:
//!
//! ```
//! use axum_idempotency::client::ClientKey;
//!
//! let mut request = http::Request::post("http://127.0.0.1:3000/orders").body(()).unwrap();
//! request.extensions_mut().insert(ClientKey::new("order-7f3a9c").unwrap());
//! ```

mod body;
mod error;
mod key;
mod layer;
#[cfg(feature = "reqwest")]
mod middleware;
mod policy;
mod retry;
mod service;

pub use crate::backoff::Backoff;
pub use body::ResponseBody;
pub use error::{BoxError, Error, ErrorKind};
pub use key::{ClientKey, InvalidClientKey};
pub use layer::IdempotentRetryLayer;
#[cfg(feature = "reqwest")]
pub use middleware::IdempotentRetryMiddleware;
pub use policy::{RetryPolicy, is_transient_status};
pub use service::{Attempts, IdempotentRetry, ResponseFuture};
