//! The service a route is wrapped in: the key, the principal, the body, then the engine.

use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::MatchedPath;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::Request;
use http::request::Parts;
use http_body::Body as _;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tokio::time::Instant;
use tower::ServiceExt;
use tower_service::Service;

use super::IdempotencyLayer;
use super::principal::BoxFuture;
use crate::Backend;
use crate::engine::{Classification, Intent, RunError, Uncancelled};
use crate::error::Rejection;
use crate::fingerprint::{Fingerprint, Fingerprinter, Verbatim};
use crate::key::IdempotencyKey;
use crate::scope::Scope;
use crate::tx::{TxSlot, TxSlots};

/// A keyed request as the layer received it, body buffered, for the engine to compare with its
/// key's record and to hand back for the handler.
struct Received {
    fingerprinter: Fingerprinter,
    parts: Parts,
    body: Bytes,
}

impl Intent for Received {
    fn fingerprint(&self) -> Fingerprint {
        self.fingerprinter.fingerprint(&self.parts, &self.body)
    }

    fn verbatim(&self) -> Option<Verbatim> {
        self.fingerprinter.verbatim(&self.parts, &self.body)
    }

    fn is(&self, kept: &Verbatim) -> bool {
        kept.matches(&self.fingerprinter, &self.parts, &self.body)
    }
}

/// The service [`IdempotencyLayer`] wraps a route in.
pub struct IdempotencyService<S, DB: Backend> {
    inner: S,
    // One shared count to bump per request, rather than one per store, engine and config.
    layer: Arc<IdempotencyLayer<DB>>,
}

impl<S, DB: Backend> IdempotencyService<S, DB> {
    pub(super) fn new(inner: S, layer: IdempotencyLayer<DB>) -> Self {
        Self {
            inner,
            layer: Arc::new(layer),
        }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the service this one wraps.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone, DB: Backend> Clone for IdempotencyService<S, DB> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            layer: Arc::clone(&self.layer),
        }
    }
}

impl<S, DB: Backend> fmt::Debug for IdempotencyService<S, DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("layer", &self.layer)
            .finish_non_exhaustive()
    }
}

/// The response future of [`IdempotencyService`]: the handler's answer, a replay, or the
/// problem the layer answered with.
pub struct ResponseFuture {
    inner: BoxFuture<'static, Result<Response, Infallible>>,
}

impl Future for ResponseFuture {
    type Output = Result<Response, Infallible>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl fmt::Debug for ResponseFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<S, DB> Service<Request<Body>> for IdempotencyService<S, DB>
where
    DB: Backend,
    S: Service<Request<Body>, Error = Infallible> + Clone + Send + 'static,
    S::Response: IntoResponse,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // The inner service is readied in `call` (on the clone that will be used), as axum's
        // own middleware does; routes are always ready.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let inner = self.inner.clone();
        let layer = Arc::clone(&self.layer);
        ResponseFuture {
            inner: Box::pin(async move {
                Ok(match layer.handle(inner, request).await {
                    Ok(response) => response,
                    Err(rejection) => {
                        // The engine logs every request it saw; these never reached it.
                        if rejection.is_before_claim() {
                            tracing::info!(
                                status = rejection.status().as_u16(),
                                code = rejection.code(),
                                "idempotent request rejected before its claim"
                            );
                        }
                        rejection.into_response()
                    }
                })
            }),
        }
    }
}

/// What is left of the layer's deadline for one keyed request.
#[derive(Clone, Copy)]
struct Deadline {
    started: Instant,
    limit: Option<Duration>,
}

impl Deadline {
    fn remaining(self) -> Option<Duration> {
        self.limit
            .map(|limit| limit.saturating_sub(self.started.elapsed()))
    }
}

impl<DB: Backend> IdempotencyLayer<DB> {
    /// The pipeline: the key, then (within the deadline) the principal, the body, the claim and
    /// the handler.
    async fn handle<S>(&self, inner: S, request: Request<Body>) -> Result<Response, Rejection>
    where
        S: Service<Request<Body>, Error = Infallible> + Clone + Send + 'static,
        S::Response: IntoResponse,
        S::Future: Send + 'static,
    {
        let config = &self.config;
        let (mut parts, body) = request.into_parts();
        let Some(key) = self.key_of(&parts)? else {
            return self
                .unclaimed(inner, Request::from_parts(parts, body))
                .await;
        };
        // A body declared larger than the limit (hyper reads `Content-Length` into the size
        // hint) is refused before anything waits for it.
        let limit = config.max_request_body;
        if body.size_hint().lower() > u64::try_from(limit).unwrap_or(u64::MAX) {
            return Err(Rejection::BodyTooLarge { limit });
        }
        // The deadline runs from here: finding the principal (its extractor may wait on the
        // database), the client sending its body (a slow one must not hold a connection and a
        // claim slot open-ended), and the engine.
        let deadline = Deadline {
            started: Instant::now(),
            limit: config.deadline,
        };
        let principal = self.principal_of(&mut parts, deadline).await?;
        let body = read_body(body, limit, deadline).await?;
        let route = parts
            .extensions
            .get::<MatchedPath>()
            .map_or_else(|| parts.uri.path().to_owned(), |m| m.as_str().to_owned());
        let method = parts.method.as_str().to_owned();
        let scope = match principal {
            Some(principal) => Scope::new(principal, method, route, key),
            None => Scope::anonymous(method, route, key),
        };
        let received = Received {
            fingerprinter: config.fingerprinter.clone(),
            parts,
            body,
        };
        match within(deadline.remaining(), self.claimed(inner, &scope, received)).await {
            Ok(ran) => Ok(ran?.map(Body::from)),
            Err(timeout) => {
                tracing::warn!(key = %scope.scoped_key(),
                    "no answer within the deadline; answered 503, the attempt finishes on its own");
                Err(timeout)
            }
        }
    }

    /// The request's key; `None` when it passes through unclaimed: a method the layer does not
    /// key, or a keyed one sent without a key where that is allowed.
    fn key_of(&self, parts: &Parts) -> Result<Option<IdempotencyKey>, Rejection> {
        let config = &self.config;
        if !config.keyed_methods.contains(&parts.method) {
            return Ok(None);
        }
        match IdempotencyKey::from_headers(&parts.headers, &config.header)? {
            Some(key) => Ok(Some(key)),
            None if config.allow_missing_key => Ok(None),
            None => Err(Rejection::KeyMissing),
        }
    }

    /// A request the layer does not claim, bounded by the deadline where a retry is safe.
    async fn unclaimed<S>(&self, inner: S, request: Request<Body>) -> Result<Response, Rejection>
    where
        S: Service<Request<Body>, Error = Infallible> + Send + 'static,
        S::Response: IntoResponse,
        S::Future: Send + 'static,
    {
        let keyed = self.config.keyed_methods.contains(request.method());
        let passed = self.pass_through(inner, request);
        // The other methods (GET, PUT, DELETE, …) are bounded too: retrying them is safe by
        // their HTTP semantics even if the attempt still commits after the 503. A keyed method
        // sent without a key is not: a retry after a late commit would run it twice, so it
        // waits for its outcome instead.
        if keyed {
            return Ok(passed.await);
        }
        within(self.config.deadline, passed).await
    }

    /// The caller, from the configured source; `None` for an anonymous request where that is
    /// allowed.
    async fn principal_of(
        &self,
        parts: &mut Parts,
        deadline: Deadline,
    ) -> Result<Option<String>, Rejection> {
        let principal = match &self.config.principal {
            Some(source) => within(deadline.remaining(), source(parts)).await??,
            None => None,
        };
        if principal.is_none() && !self.config.allow_anonymous {
            return Err(Rejection::PrincipalMissing);
        }
        Ok(principal)
    }

    /// Claims the key and runs the handler in its transaction, within the bound on concurrent
    /// claims; the response the client gets, stored, replayed or rolled back.
    async fn claimed<S>(
        &self,
        inner: S,
        scope: &Scope,
        received: Received,
    ) -> Result<http::Response<Bytes>, Rejection>
    where
        S: Service<Request<Body>, Error = Infallible> + Clone + Send + 'static,
        S::Response: IntoResponse,
        S::Future: Send + 'static,
    {
        // Held here until the outcome is recorded, and shared with the work: if the deadline
        // leaves the work running on its own, the permit stays taken until its handler is done.
        let permit = match &self.config.claims {
            Some(claims) => match Arc::clone(claims).acquire_owned().await {
                Ok(permit) => Some(Arc::new(permit)),
                Err(_closed) => return Err(Rejection::Internal),
            },
            None => None,
        };
        let _held = permit.clone();
        let marker = self.config.marker;
        match self
            .engine
            .run_in_slot(scope, received, move |received, slot, context| {
                // Built here, not before: a replay answered from the cache never needs it.
                // Built from copies, since a transaction aborted on a conflict runs again.
                let mut request =
                    Request::from_parts(received.parts.clone(), Body::from(received.body.clone()));
                request.extensions_mut().insert(context);
                TxSlots::hand_over(request.extensions_mut(), marker, slot);
                let inner = inner.clone();
                let permit = permit.clone();
                async move {
                    let _permit = permit;
                    match inner.oneshot(request).await {
                        Ok(response) => response.into_response(),
                        Err(never) => match never {},
                    }
                }
            })
            .await
        {
            Ok(execution) => Ok(execution.response),
            // Rolled back: the client gets the handler's own answer and may retry with the key.
            Err(RunError::Failed(response)) => Ok(response),
            Err(error) => Err(error.into_rejection()),
        }
    }

    /// A request without a key: no claim, but `Tx` still works, resolved by the status.
    async fn pass_through<S>(&self, inner: S, mut request: Request<Body>) -> Response
    where
        S: Service<Request<Body>, Error = Infallible> + Send + 'static,
        S::Response: IntoResponse,
        S::Future: Send + 'static,
    {
        let slot = TxSlot::lazy(self.engine.store().pool().clone());
        let engine = self.engine.clone();
        TxSlots::hand_over(request.extensions_mut(), self.config.marker, slot.clone());
        // Never cancelled halfway, for the same reason as keyed requests: a client hanging up
        // must not abandon a transaction mid-statement.
        let handled = Uncancelled::new(async move {
            let response = match inner.oneshot(request).await {
                Ok(response) => response.into_response(),
                Err(never) => match never {},
            };
            let tx = match slot.take_back() {
                Ok(Some(tx)) => tx,
                Ok(None) => return response,
                Err(_) => {
                    tracing::error!("a Tx was still held when the handler returned; rolled back");
                    return Rejection::TransactionHeld.into_response();
                }
            };
            // The same rule as for keyed requests: only a completed answer keeps its writes.
            let completed = engine.classification(response.status()) == Classification::Completed;
            let resolved = if completed {
                tx.commit().await
            } else {
                tx.rollback().await
            };
            match resolved {
                Ok(()) => {
                    // After a commit only: never for a rollback, whose writes nobody sees.
                    if completed {
                        slot.take_after_commit().run();
                    }
                    response
                }
                Err(error) => {
                    tracing::error!(%error, "resolving the request's transaction failed");
                    Rejection::Internal.into_response()
                }
            }
        });
        handled.await.unwrap_or_else(|_panic| {
            tracing::error!("the handler panicked; rolled back");
            Rejection::Internal.into_response()
        })
    }
}

/// The body, read within the deadline and at most `limit` bytes.
async fn read_body(body: Body, limit: usize, deadline: Deadline) -> Result<Bytes, Rejection> {
    let read = within(deadline.remaining(), Limited::new(body, limit).collect())
        .await
        .map_err(|_elapsed| Rejection::BodyTimeout)?;
    match read {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.downcast_ref::<LengthLimitError>().is_some() => {
            Err(Rejection::BodyTooLarge { limit })
        }
        Err(error) => {
            tracing::debug!(%error, "could not read the request body");
            Err(Rejection::BodyUnreadable)
        }
    }
}

/// `future`'s output, or [`Rejection::Timeout`] once `limit` has passed.
async fn within<F: Future>(limit: Option<Duration>, future: F) -> Result<F::Output, Rejection> {
    match limit {
        Some(limit) => tokio::time::timeout(limit, future)
            .await
            .map_err(|_elapsed| Rejection::Timeout),
        None => Ok(future.await),
    }
}
