//! Who is asking, and for which operation: the namespace a key lives in.
//!
//! A client's key means something only within the scope of the verified caller (the
//! *principal*), the HTTP method and the matched route template. The layer never takes
//! the principal from a header the client asserts: it comes from an extractor or an extension
//! set by authentication. User B reusing user A's key therefore lands in another scope and
//! never sees A's result, and the same key on `POST /orders` and `POST /payments` names two
//! unrelated intents.
//!
//! The database stores only the SHA-256 digest of the scoped key ([`ScopedKey::digest`]),
//! never the raw key; principal, method and route are kept in clear for operators, with a NUL
//! (which PostgreSQL's `text` cannot hold) shown as U+FFFD. The digest covers the exact text,
//! so scopes that differ only in a NUL never share a record.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::key::IdempotencyKey;

/// The verified identity a key is scoped to.
///
/// Implement it for the type your authentication extractor yields:
///
/// ```
/// use std::borrow::Cow;
/// use axum_idempotency::Principal;
///
/// #[derive(Clone)]
/// struct AuthUser {
///     id: i64,
/// }
///
/// impl Principal for AuthUser {
///     fn principal_id(&self) -> Cow<'_, str> {
///         Cow::Owned(self.id.to_string())
///     }
/// }
/// ```
pub trait Principal {
    /// A stable identifier of the caller: the same person or service always yields the same id.
    fn principal_id(&self) -> Cow<'_, str>;
}

impl<T: Principal> Principal for axum::Extension<T> {
    fn principal_id(&self) -> Cow<'_, str> {
        self.0.principal_id()
    }
}

/// The full identity of one intent: principal, method, route template and the client's key.
///
/// Background jobs build one directly to go through the same claim logic as HTTP requests.
#[derive(Clone, PartialEq, Eq)]
pub struct Scope(Arc<Fields>);

/// A scope's parts, shared by its clones: the engine hands one to the work's task and one to
/// each attempt's [`IdempotencyContext`], and a copy of four strings per clone would cost more
/// than everything else the scope does.
#[derive(PartialEq, Eq)]
struct Fields {
    principal: Option<String>,
    method: String,
    route: String,
    key: IdempotencyKey,
}

impl Scope {
    /// A scope owned by a verified principal.
    pub fn new(
        principal: impl Into<String>,
        method: impl Into<String>,
        route: impl Into<String>,
        key: IdempotencyKey,
    ) -> Self {
        Self(Arc::new(Fields {
            principal: Some(principal.into()),
            method: method.into(),
            route: route.into(),
            key,
        }))
    }

    /// A scope with no principal, for routes the layer was told to allow anonymously.
    ///
    /// Anonymous scopes never collide with any principal's scope, whatever its id.
    pub fn anonymous(
        method: impl Into<String>,
        route: impl Into<String>,
        key: IdempotencyKey,
    ) -> Self {
        Self(Arc::new(Fields {
            principal: None,
            method: method.into(),
            route: route.into(),
            key,
        }))
    }

    /// The principal, or `None` for an anonymous scope.
    pub fn principal(&self) -> Option<&str> {
        self.0.principal.as_deref()
    }

    /// The HTTP method (or, for jobs, the operation's verb).
    pub fn method(&self) -> &str {
        &self.0.method
    }

    /// The route template, e.g. `/orders/{id}/ship`.
    pub fn route(&self) -> &str {
        &self.0.route
    }

    /// The digest that identifies this scope's record.
    pub fn scoped_key(&self) -> ScopedKey {
        let mut hasher = Sha256::new();
        hasher.update(b"axum-idempotency/scope/v1");
        // The kind byte keeps anonymous scopes apart from a principal whose id is empty, and
        // the length prefixes keep ("ab", "c") apart from ("a", "bc").
        match &self.0.principal {
            Some(principal) => {
                hasher.update([1]);
                update_field(&mut hasher, principal.as_bytes());
            }
            None => hasher.update([0]),
        }
        update_field(&mut hasher, self.0.method.as_bytes());
        update_field(&mut hasher, self.0.route.as_bytes());
        update_field(&mut hasher, self.0.key.as_str().as_bytes());
        ScopedKey(hasher.finalize().into())
    }
}

impl fmt::Debug for Scope {
    // The raw key stays out of every log line.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Scope")
            .field("principal", &self.0.principal)
            .field("method", &self.0.method)
            .field("route", &self.0.route)
            .field("key", &self.scoped_key())
            .finish()
    }
}

fn update_field(hasher: &mut Sha256, bytes: &[u8]) {
    hasher.update((bytes.len() as u64).to_be_bytes());
    hasher.update(bytes);
}

/// SHA-256 of a [`Scope`]: the primary key of its record.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ScopedKey([u8; 32]);

impl ScopedKey {
    /// The 32 digest bytes, as stored.
    pub fn digest(&self) -> &[u8; 32] {
        &self.0
    }

    /// The digest in lowercase hex, e.g. to derive downstream keys from it.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// A short prefix of the digest for logs: enough to correlate lines, useless to replay.
    pub fn short(&self) -> String {
        hex::encode(&self.0[..6])
    }
}

impl fmt::Debug for ScopedKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ScopedKey({})", self.short())
    }
}

impl fmt::Display for ScopedKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.short())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(k: &str) -> IdempotencyKey {
        k.parse().expect("valid test key")
    }

    #[test]
    fn same_key_for_other_principal_is_another_scope() {
        let a = Scope::new("alice", "POST", "/orders", key("k1")).scoped_key();
        let b = Scope::new("bob", "POST", "/orders", key("k1")).scoped_key();
        assert_ne!(a, b);
    }

    #[test]
    fn same_key_on_other_route_or_method_is_another_scope() {
        let base = Scope::new("alice", "POST", "/orders", key("k1")).scoped_key();
        assert_ne!(
            base,
            Scope::new("alice", "POST", "/payments", key("k1")).scoped_key()
        );
        assert_ne!(
            base,
            Scope::new("alice", "PATCH", "/orders", key("k1")).scoped_key()
        );
    }

    #[test]
    fn anonymous_scope_never_equals_a_principal_scope() {
        let anon = Scope::anonymous("POST", "/orders", key("k1")).scoped_key();
        assert_ne!(
            anon,
            Scope::new("", "POST", "/orders", key("k1")).scoped_key()
        );
    }

    #[test]
    fn field_boundaries_are_unambiguous() {
        let a = Scope::new("ab", "POST", "/x", key("k")).scoped_key();
        let b = Scope::new("a", "bPOST", "/x", key("k")).scoped_key();
        assert_ne!(a, b);
    }

    #[test]
    fn debug_output_never_contains_the_raw_key() {
        let scope = Scope::new("alice", "POST", "/orders", key("super-secret-key-123"));
        assert!(!format!("{scope:?}").contains("super-secret-key-123"));
    }
}

/// The scope a keyed request runs under, for handlers that derive further identities from it
/// (for example the downstream key of an outbox message, so every resend of one intent carries
/// the same key downstream).
///
/// ```
/// use axum_idempotency::IdempotencyContext;
///
/// async fn charge(context: IdempotencyContext) -> String {
///     format!("downstream key: charge-{}", context.scoped_key().to_hex())
/// }
/// ```
///
/// Extracting it on a request that carries no key (or outside the layer) is a 500: the route
/// is wired wrongly.
#[derive(Debug, Clone)]
pub struct IdempotencyContext {
    scope: Scope,
    scoped_key: ScopedKey,
}

impl IdempotencyContext {
    /// The context of `scope`, whose scoped key was already computed as `scoped_key`.
    pub(crate) fn with_key(scope: Scope, scoped_key: ScopedKey) -> Self {
        Self { scope, scoped_key }
    }

    /// The scope: principal, method, route template, key.
    pub fn scope(&self) -> &Scope {
        &self.scope
    }

    /// The digest of the scoped key.
    pub fn scoped_key(&self) -> ScopedKey {
        self.scoped_key
    }
}

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for IdempotencyContext {
    type Rejection = crate::error::Rejection;

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        _state: &S,
    ) -> Result<Self, Self::Rejection> {
        parts.extensions.get::<Self>().cloned().ok_or_else(|| {
            tracing::error!("IdempotencyContext extracted on a request without an idempotency key");
            crate::error::Rejection::Internal
        })
    }
}
