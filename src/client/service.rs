//! The service: one logical call, one key, as many attempts as the policy allows.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response, request::Parts};
use http_body::Body;
use http_body_util::{BodyExt as _, Full, LengthLimitError, Limited};
use tower::ServiceExt as _;
use tower_service::Service;

use super::ClientKey;
use super::body::ResponseBody;
use super::error::{BoxError, Error, ErrorKind};
use super::layer::Config;
use super::policy::{self, RetryPolicy, Verdict};
use super::retry::{Attempt, retry};

/// The most of a `409` body read to find out whether it means "in progress". The server's problem
/// documents are a few hundred bytes; a larger body is a business answer and is passed on whole.
pub(crate) const CONFLICT_PEEK_LIMIT: usize = 16 * 1024;

/// Wraps an HTTP client service; built by [`IdempotentRetryLayer`](super::IdempotentRetryLayer).
///
/// The inner service receives each attempt as an `http::Request<Full<Bytes>>`, the request body
/// buffered once and resent unchanged. Responses come back with [`ClientKey`] and [`Attempts`] in
/// their extensions.
#[derive(Clone)]
pub struct IdempotentRetry<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> IdempotentRetry<S> {
    pub(crate) fn new(inner: S, config: Arc<Config>) -> Self {
        Self { inner, config }
    }
}

impl<S: fmt::Debug> fmt::Debug for IdempotentRetry<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotentRetry")
            .field("inner", &self.inner)
            .field("config", &self.config)
            .finish()
    }
}

/// How many attempts a call made, as a response extension (1 when the first answer was kept).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attempts(pub u32);

/// What one call ends with.
type CallResult<ResBody> = Result<Response<ResponseBody<ResBody>>, Error>;

/// The future returned by [`IdempotentRetry`].
pub struct ResponseFuture<ResBody> {
    inner: Pin<Box<dyn Future<Output = CallResult<ResBody>> + Send>>,
}

impl<ResBody> fmt::Debug for ResponseFuture<ResBody> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<ResBody> Future for ResponseFuture<ResBody> {
    type Output = CallResult<ResBody>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl<S, B, ResBody> Service<Request<B>> for IdempotentRetry<S>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
    ResBody: Body + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = Error;
    type Future = ResponseFuture<ResBody>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Every attempt waits for the inner service's readiness itself, so a failure to become
        // ready is retried like any other transport error.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let call = Call {
            inner: self.inner.clone(),
            config: Arc::clone(&self.config),
        };
        ResponseFuture {
            inner: Box::pin(call.run(request)),
        }
    }
}

struct Call<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S, ResBody> Call<S>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    ResBody: Body + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    async fn run<B>(self, request: Request<B>) -> CallResult<ResBody>
    where
        B: Body + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let (mut parts, body) = request.into_parts();
        let key = key_for(&self.config, &mut parts)?;
        let body = buffer(body, self.config.max_request_body)
            .await
            .map_err(|e| e.with_call(key.clone(), 0))?;
        let retry_allowed = key.is_some() || parts.method.is_idempotent();
        let policy = &self.config.policy;
        let inner = self.inner;

        let (outcome, attempts) = retry(
            policy,
            retry_allowed,
            Response::headers,
            || Error::new(ErrorKind::Timeout, None),
            move || {
                let request = Request::from_parts(parts.clone(), Full::new(body.clone()));
                attempt(inner.clone(), policy, request)
            },
        )
        .await;
        match outcome {
            Ok(response) => Ok(finish(response, key, attempts)),
            Err(failure) => Err(failure.with_call(key, attempts)),
        }
    }
}

/// The key for this call: the caller's (extension first, then header), else a fresh one for
/// keyed methods, else none. A key in hand is always sent in the configured header.
fn key_for(config: &Config, parts: &mut Parts) -> Result<Option<ClientKey>, Error> {
    let header_name = &config.header_name;
    let key = if let Some(key) = parts.extensions.get::<ClientKey>() {
        Some(key.clone())
    } else if let Some(value) = parts.headers.get(header_name) {
        let key = ClientKey::from_header(value)
            .map_err(|e| Error::new(ErrorKind::InvalidKey, Some(e.into())))?;
        Some(key)
    } else if config.keyed_methods.contains(&parts.method) {
        let key = ClientKey::generate()
            .map_err(|e| Error::new(ErrorKind::KeyGeneration, Some(e.into())))?;
        Some(key)
    } else {
        None
    };
    if let Some(key) = &key {
        parts
            .headers
            .insert(header_name.clone(), key.header_value());
    }
    Ok(key)
}

/// Sends one attempt and classifies the answer.
async fn attempt<S, ResBody>(
    mut inner: S,
    policy: &RetryPolicy,
    request: Request<Full<Bytes>>,
) -> Attempt<Response<ResponseBody<ResBody>>, Error>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>>,
    S::Error: Into<BoxError>,
    ResBody: Body,
    ResBody::Error: Into<BoxError>,
{
    let transport =
        |e: BoxError| Attempt::Retryable(Err(Error::new(ErrorKind::Transport, Some(e))));
    let response = async {
        let ready = inner.ready().await.map_err(Into::into)?;
        ready.call(request).await.map_err(Into::<BoxError>::into)
    };
    let (parts, body) = match response.await {
        Ok(response) => response.into_parts(),
        Err(e) => return transport(e),
    };
    match policy.classify(parts.status) {
        Verdict::Final => Attempt::Final(Response::from_parts(parts, ResponseBody::new(body))),
        Verdict::Retry => {
            Attempt::Retryable(Ok(Response::from_parts(parts, ResponseBody::new(body))))
        }
        Verdict::InspectConflict => {
            let (complete, body) =
                match ResponseBody::peek(Box::pin(body), CONFLICT_PEEK_LIMIT).await {
                    Ok(peeked) => peeked,
                    Err(e) => return transport(e.into()),
                };
            let response = Response::from_parts(parts, body);
            if complete.is_some_and(|bytes| policy::is_in_progress_conflict(&bytes)) {
                Attempt::Retryable(Ok(response))
            } else {
                Attempt::Final(response)
            }
        }
    }
}

/// Reads the whole request body once, so every attempt can resend it.
async fn buffer<B>(body: B, limit: usize) -> Result<Bytes, Error>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.is::<LengthLimitError>() => {
            Err(Error::new(ErrorKind::RequestBodyTooLarge, Some(error)))
        }
        Err(error) => Err(Error::new(ErrorKind::RequestBody, Some(error))),
    }
}

fn finish<ResBody>(
    mut response: Response<ResponseBody<ResBody>>,
    key: Option<ClientKey>,
    attempts: u32,
) -> Response<ResponseBody<ResBody>> {
    let extensions = response.extensions_mut();
    if let Some(key) = key {
        extensions.insert(key);
    }
    extensions.insert(Attempts(attempts));
    response
}
