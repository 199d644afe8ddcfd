//! The second front door: the same policy as `reqwest-middleware` middleware.

use http::Extensions;
use reqwest::{Request, Response, ResponseBuilderExt as _};
use reqwest_middleware::{Middleware, Next};

use super::body::ResponseBody;
use super::error::{Error, ErrorKind};
use super::layer::{Config, IdempotentRetryLayer};
use super::policy::{self, Verdict};
use super::retry::{Attempt, retry};
use super::service::CONFLICT_PEEK_LIMIT;
use super::{Attempts, ClientKey};

/// [`IdempotentRetryLayer`]'s behaviour for [`reqwest_middleware`] clients: one key per logical
/// call, the same key and body on every retry, the same retry policy.
///
/// Configure it with the layer's builder:
///
/// ```
/// use axum_idempotency::client::{IdempotentRetryLayer, IdempotentRetryMiddleware};
///
/// let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
///     .with(IdempotentRetryMiddleware::from(
///         IdempotentRetryLayer::new().max_attempts(5),
///     ))
///     .build();
/// # let _ = client;
/// ```
///
/// The response carries [`ClientKey`] and [`Attempts`] in its extensions. Errors of this
/// middleware (body too large, a streaming body that cannot be resent, timeouts) arrive as
/// [`reqwest_middleware::Error::Middleware`] holding an [`Error`]; errors of the last attempt
/// from reqwest itself arrive unchanged.
#[derive(Debug, Clone)]
pub struct IdempotentRetryMiddleware {
    config: std::sync::Arc<Config>,
}

impl Default for IdempotentRetryMiddleware {
    fn default() -> Self {
        Self::from(IdempotentRetryLayer::new())
    }
}

impl From<IdempotentRetryLayer> for IdempotentRetryMiddleware {
    fn from(layer: IdempotentRetryLayer) -> Self {
        Self {
            config: layer.into_config(),
        }
    }
}

type MiddlewareResult = reqwest_middleware::Result<Response>;

#[async_trait::async_trait]
impl Middleware for IdempotentRetryMiddleware {
    async fn handle(
        &self,
        mut request: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> MiddlewareResult {
        let config = &self.config;
        let refuse = |kind, key: &Option<ClientKey>| {
            reqwest_middleware::Error::middleware(Error::new(kind, None).with_call(key.clone(), 0))
        };
        let key = key_for(config, extensions, &mut request)
            .map_err(reqwest_middleware::Error::middleware)?;
        // A streaming body has no bytes to resend; everything else is already in memory.
        let body_len = match request.body() {
            None => 0,
            Some(body) => match body.as_bytes() {
                Some(bytes) => bytes.len(),
                None => return Err(refuse(ErrorKind::RequestBody, &key)),
            },
        };
        if body_len > config.max_request_body {
            return Err(refuse(ErrorKind::RequestBodyTooLarge, &key));
        }
        let retry_allowed = key.is_some() || request.method().is_idempotent();

        let (outcome, attempts) = retry(
            &config.policy,
            retry_allowed,
            Response::headers,
            || reqwest_middleware::Error::middleware(Error::new(ErrorKind::Timeout, None)),
            || {
                attempt(
                    config,
                    request.try_clone(),
                    extensions.clone(),
                    next.clone(),
                )
            },
        )
        .await;
        match outcome {
            Ok(mut response) => {
                if let Some(key) = key {
                    response.extensions_mut().insert(key);
                }
                response.extensions_mut().insert(Attempts(attempts));
                Ok(response)
            }
            Err(error) => Err(error),
        }
    }
}

/// The same choice of key as the tower door: extension, header, or a fresh one.
fn key_for(
    config: &Config,
    extensions: &Extensions,
    request: &mut Request,
) -> Result<Option<ClientKey>, Error> {
    let header_name = &config.header_name;
    let key = if let Some(key) = extensions.get::<ClientKey>() {
        Some(key.clone())
    } else if let Some(value) = request.headers().get(header_name) {
        let key = ClientKey::from_header(value)
            .map_err(|e| Error::new(ErrorKind::InvalidKey, Some(e.into())))?;
        Some(key)
    } else if config.keyed_methods.contains(request.method()) {
        let key = ClientKey::generate()
            .map_err(|e| Error::new(ErrorKind::KeyGeneration, Some(e.into())))?;
        Some(key)
    } else {
        None
    };
    if let Some(key) = &key {
        request
            .headers_mut()
            .insert(header_name.clone(), key.header_value());
    }
    Ok(key)
}

/// Sends one attempt down the rest of the middleware stack and classifies the answer.
async fn attempt(
    config: &Config,
    request: Option<Request>,
    mut extensions: Extensions,
    next: Next<'_>,
) -> Attempt<Response, reqwest_middleware::Error> {
    // `handle` made sure the body is in memory, so the request always clones.
    let Some(request) = request else {
        let error = Error::new(ErrorKind::RequestBody, None);
        return Attempt::Retryable(Err(reqwest_middleware::Error::middleware(error)));
    };
    let response = match next.run(request, &mut extensions).await {
        Ok(response) => response,
        Err(error) => return Attempt::Retryable(Err(error)),
    };
    match config.policy.classify(response.status()) {
        Verdict::Final => Attempt::Final(response),
        Verdict::Retry => Attempt::Retryable(Ok(response)),
        Verdict::InspectConflict => inspect_conflict(response).await,
    }
}

/// Reads the start of a `409` through the shared peeking body and rebuilds the response so the
/// caller still gets every byte.
async fn inspect_conflict(response: Response) -> Attempt<Response, reqwest_middleware::Error> {
    let url = response.url().clone();
    let (mut parts, body) = http::Response::from(response).into_parts();
    let (complete, body) = match ResponseBody::peek(Box::pin(body), CONFLICT_PEEK_LIMIT).await {
        Ok(peeked) => peeked,
        Err(error) => return Attempt::Retryable(Err(error.into())),
    };
    // The URL travels in an extension only reqwest's own builder can set.
    if let Ok(carrier) = http::Response::builder().url(url).body(()) {
        parts.extensions.extend(carrier.into_parts().0.extensions);
    }
    let response = Response::from(http::Response::from_parts(parts, reqwest::Body::wrap(body)));
    if complete.is_some_and(|bytes| policy::is_in_progress_conflict(&bytes)) {
        Attempt::Retryable(Ok(response))
    } else {
        Attempt::Final(response)
    }
}
