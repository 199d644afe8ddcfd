//! The layer: configuration shared by every service it wraps.

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, Method, StatusCode};
use tower_layer::Layer;

use super::{Backoff, IdempotentRetry, RetryPolicy};
use crate::key_syntax::KEY_HEADER;

/// Wraps an HTTP client so every keyed call gets one idempotency key, reused on each retry.
///
/// See the [module docs](super) for what is retried and an example.
#[derive(Debug, Clone)]
pub struct IdempotentRetryLayer {
    config: Arc<Config>,
}

#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) policy: RetryPolicy,
    pub(crate) header_name: HeaderName,
    pub(crate) keyed_methods: Vec<Method>,
    pub(crate) max_request_body: usize,
}

impl Default for IdempotentRetryLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl IdempotentRetryLayer {
    /// A layer with the defaults: keys on `POST` and `PATCH` in `Idempotency-Key`, request bodies
    /// up to 1 MiB, and [`RetryPolicy::default`].
    #[must_use]
    pub fn new() -> Self {
        Self {
            config: Arc::new(Config {
                policy: RetryPolicy::default(),
                header_name: KEY_HEADER,
                keyed_methods: vec![Method::POST, Method::PATCH],
                max_request_body: 1024 * 1024,
            }),
        }
    }

    #[cfg(feature = "reqwest")]
    pub(crate) fn into_config(self) -> Arc<Config> {
        self.config
    }

    fn config(&mut self) -> &mut Config {
        Arc::make_mut(&mut self.config)
    }

    /// The header that carries the key. Default `Idempotency-Key`.
    #[must_use]
    pub fn header_name(mut self, name: HeaderName) -> Self {
        self.config().header_name = name;
        self
    }

    /// The methods that get a key (and are then retried with it). Default `POST` and `PATCH`.
    ///
    /// Requests with other methods are retried without a key when HTTP defines their method as
    /// idempotent (`GET`, `HEAD`, `PUT`, `DELETE`, `OPTIONS`, `TRACE`) and sent exactly once
    /// otherwise, unless the caller attaches a [`ClientKey`](super::ClientKey) or the header.
    #[must_use]
    pub fn keyed_methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.config().keyed_methods = methods.into_iter().collect();
        self
    }

    /// The largest request body, in bytes, the layer buffers so it can resend it. Default 1 MiB.
    /// A larger body fails the call before anything is sent.
    #[must_use]
    pub fn max_request_body(mut self, bytes: usize) -> Self {
        self.config().max_request_body = bytes;
        self
    }

    /// Replaces the whole retry policy.
    #[must_use]
    pub fn policy(mut self, policy: RetryPolicy) -> Self {
        self.config().policy = policy;
        self
    }

    /// See [`RetryPolicy::max_attempts`]. Default 5.
    #[must_use]
    pub fn max_attempts(self, attempts: u32) -> Self {
        self.map_policy(|policy| policy.max_attempts(attempts))
    }

    /// See [`RetryPolicy::deadline`]. Default 30 s.
    #[must_use]
    pub fn deadline(self, deadline: Duration) -> Self {
        self.map_policy(|policy| policy.deadline(deadline))
    }

    /// See [`RetryPolicy::attempt_timeout`]. Default 10 s.
    #[must_use]
    pub fn attempt_timeout(self, timeout: Duration) -> Self {
        self.map_policy(|policy| policy.attempt_timeout(timeout))
    }

    /// See [`RetryPolicy::backoff`].
    #[must_use]
    pub fn backoff(self, backoff: Backoff) -> Self {
        self.map_policy(|policy| policy.backoff(backoff))
    }

    /// See [`RetryPolicy::retry_status_if`].
    #[must_use]
    pub fn retry_status_if(self, retry: fn(StatusCode) -> bool) -> Self {
        self.map_policy(|policy| policy.retry_status_if(retry))
    }

    fn map_policy(mut self, change: impl FnOnce(RetryPolicy) -> RetryPolicy) -> Self {
        let config = self.config();
        config.policy = change(config.policy.clone());
        self
    }
}

impl<S> Layer<S> for IdempotentRetryLayer {
    type Service = IdempotentRetry<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotentRetry::new(inner, Arc::clone(&self.config))
    }
}
