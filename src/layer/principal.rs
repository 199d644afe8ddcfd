//! Where the principal comes from: an extractor, or an extension set by authentication
//! middleware. A refusal is "no principal"; a failure a retry may cure is not.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use axum::extract::FromRequestParts;
use axum::response::IntoResponse;
use http::StatusCode;
use http::request::Parts;

use super::IdempotencyLayer;
use crate::Backend;
use crate::error::Rejection;
use crate::scope::Principal;

pub(super) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;
/// Finds the principal of a request: `Ok(None)` when the caller was refused, `Err` when the
/// source failed in a way a retry may cure.
pub(super) type PrincipalFn = Arc<
    dyn for<'a> Fn(&'a mut Parts) -> BoxFuture<'a, Result<Option<String>, Rejection>> + Send + Sync,
>;

impl<DB: Backend> IdempotencyLayer<DB> {
    fn with_principal(mut self, source: PrincipalFn) -> Self {
        self.config_mut().principal = Some(source);
        self
    }

    /// Takes the principal from extractor `P` (for example the app's own auth extractor).
    ///
    /// On a keyed request the extracted `P` is inserted into the request's extensions, so the
    /// handler takes it with [`Extension<P>`](axum::Extension) instead of running `P` again.
    /// Do that when `P` reads a database: the claim's transaction already holds a connection
    /// of the pool, and a handler that waits for a second one can deadlock the whole pool
    /// under a burst (every connection holding a claim whose handler waits for another).
    ///
    /// How `P`'s rejection is answered depends on its status: a 5xx, 408 or 429 (the
    /// extractor failed, for instance its database is down) is `503
    /// idempotency_principal_unavailable` with `Retry-After`, retryable; any other status
    /// (a refusal such as 401 or 403) is `401 idempotency_principal_missing`, final.
    #[must_use]
    pub fn principal<P>(self) -> Self
    where
        P: FromRequestParts<()> + Principal + Clone + Send + Sync + 'static,
    {
        self.principal_with_state::<P, ()>(())
    }

    /// Like [`principal`](Self::principal), for an extractor that needs the app's state.
    #[must_use]
    pub fn principal_with_state<P, T>(self, state: T) -> Self
    where
        P: FromRequestParts<T> + Principal + Clone + Send + Sync + 'static,
        T: Clone + Send + Sync + 'static,
    {
        self.with_principal(Arc::new(move |parts| {
            let state = state.clone();
            Box::pin(async move {
                match P::from_request_parts(parts, &state).await {
                    Ok(principal) => {
                        let id = principal.principal_id().into_owned();
                        parts.extensions.insert(principal);
                        Ok(Some(id))
                    }
                    Err(rejection) => {
                        let status = rejection.into_response().status();
                        if is_transient(status) {
                            tracing::warn!(%status, "the principal extractor failed; answered as retryable");
                            Err(Rejection::PrincipalUnavailable)
                        } else {
                            Ok(None)
                        }
                    }
                }
            })
        }))
    }

    /// Takes the principal from a request extension of type `P`, inserted by authentication
    /// middleware that runs before this layer.
    #[must_use]
    pub fn principal_extension<P>(self) -> Self
    where
        P: Principal + Clone + Send + Sync + 'static,
    {
        self.with_principal(Arc::new(|parts| {
            let principal = parts
                .extensions
                .get::<P>()
                .map(|p| p.principal_id().into_owned());
            Box::pin(async move { Ok(principal) })
        }))
    }
}

/// Whether an extractor's rejection with `status` is a failure a retry may cure rather than a
/// refusal of the caller: the same line the engine draws for handlers' answers.
fn is_transient(status: StatusCode) -> bool {
    status.is_server_error()
        || status == StatusCode::REQUEST_TIMEOUT
        || status == StatusCode::TOO_MANY_REQUESTS
}
