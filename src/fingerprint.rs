//! The request fingerprint: a digest of what a request intends, compared when a key comes back.
//!
//! A retry must carry the same key *and* the same intent. A request that reuses a key with a
//! different intent is refused (`422 idempotency_key_reused`) rather than answered with the result
//! of another operation. "Same intent" is decided by comparing [`Fingerprint`]s, SHA-256 digests
//! over:
//!
//! * the method and the concrete path (`/orders/42`, not the route template);
//! * the query, split on `&`, empty pairs dropped and the pairs sorted, so `?b=2&a=1` equals
//!   `?a=1&b=2` (percent-encoding is kept as sent; a repeated parameter's values are sorted too);
//! * the headers chosen with [`Fingerprinter::include_headers`] (an absent header differs from
//!   an empty one) and the `Content-Type` without its parameters;
//! * the body in a canonical form chosen by its `Content-Type`:
//!   - `application/json` and any `+json` type: canonical JSON (below), after removing the
//!     fields named by [`Fingerprinter::ignore_json_fields`]. A body that is not valid JSON is
//!     hashed as raw bytes, tagged so it can never equal a canonical form;
//!   - `application/x-www-form-urlencoded`: the pairs sorted, as for the query;
//!   - anything else, or no `Content-Type`: the raw bytes. An empty body is a case of its own.
//!
//! # Canonical JSON
//!
//! Two JSON texts are the same intent when they differ only in insignificant whitespace, member
//! order, string escaping (`"\u0041"` is `"A"`) or number spelling. Numbers are compared by their
//! exact decimal value, never through `f64`: `12.5`, `12.50`, `1.25e1` and `125E-1` are equal,
//! `12.500000001` is not, and `0`, `-0`, `0.0` and `0e5` are all zero. Array order matters.
//!
//! Refused as not valid JSON (so hashed as raw bytes): duplicate member names (their meaning
//! depends on which parser reads them, so the intent is ambiguous), lone UTF-16 surrogates,
//! nesting deeper than 128, exponents beyond `i64`, and anything RFC 8259 does not allow.
//!
//! ```
//! use axum_idempotency::canonical_json;
//!
//! let a = canonical_json(br#"{ "amount": 12.50, "sku": "widget", "trace_id": "t-1" }"#, &["/trace_id"]);
//! let b = canonical_json(br#"{"sku":"\u0077idget","amount":1.25e1}"#, &["/trace_id"]);
//! assert_eq!(a, b);
//! assert_eq!(a.as_deref(), Some(&br#"{"amount":125e-1,"sku":"widget"}"#[..]));
//! assert_ne!(a, canonical_json(br#"{"sku":"widget","amount":12.500000001}"#, &[]));
//! ```

mod json;

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderMap, HeaderName, Method};
use sha2::{Digest, Sha256};

use json::Pointer;

/// A SHA-256 digest of a request's intent.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// The 32 digest bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The digest as 64 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl From<[u8; 32]> for Fingerprint {
    fn from(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", self.to_hex())
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// Computes [`Fingerprint`]s; built once per layer and cheap to clone.
///
/// ```
/// use axum_idempotency::Fingerprinter;
/// use http::Request;
///
/// let fingerprinter = Fingerprinter::new()
///     .ignore_json_fields(["/request_time", "/meta/trace_id"])
///     .include_headers([http::header::ACCEPT_LANGUAGE]);
///
/// let request = |body: &'static str| {
///     let (parts, ()) = Request::post("/orders?b=2&a=1")
///         .header("content-type", "application/json; charset=utf-8")
///         .body(())
///         .unwrap()
///         .into_parts();
///     fingerprinter.fingerprint(&parts, body.as_bytes())
/// };
/// assert_eq!(
///     request(r#"{"amount":12.5,"request_time":"10:00"}"#),
///     request(r#"{ "request_time": "10:01", "amount": 12.50 }"#),
/// );
/// assert_ne!(request(r#"{"amount":12.5}"#), request(r#"{"amount":12.6}"#));
/// ```
#[derive(Clone, Debug, Default)]
pub struct Fingerprinter {
    config: Arc<Config>,
}

#[derive(Clone, Debug, Default, PartialEq)]
struct Config {
    ignored: Vec<Pointer>,
    /// Sorted and without duplicates, so the order they were configured in does not matter.
    headers: Vec<HeaderName>,
}

/// Changing anything in the hashed layout must change this tag, so old and new digests never
/// compare equal by accident.
const VERSION: &[u8] = b"axum-idempotency/fp/v1";

mod body_tag {
    pub(super) const EMPTY: u8 = 0;
    pub(super) const CANONICAL_JSON: u8 = 1;
    pub(super) const RAW: u8 = 2;
    pub(super) const INVALID_JSON: u8 = 3;
    pub(super) const FORM: u8 = 4;
}

enum BodyKind {
    Json,
    Form,
    Raw,
}

impl Fingerprinter {
    /// A fingerprinter with no ignored fields and no extra headers.
    pub fn new() -> Self {
        Self::default()
    }

    /// Removes these fields from JSON bodies before hashing, so they never count as intent
    /// (request time, trace id…).
    ///
    /// Each is an RFC 6901 JSON Pointer such as `/request_time` or `/meta/trace_id`; `~1` stands
    /// for `/` and `~0` for `~` in a name, and a decimal token also selects that array element.
    /// A pointer that does not start with `/` is read as if it did (`request_time` is
    /// `/request_time`; the empty pointer is `/`, the member named `""`). A pointer naming
    /// nothing in a body is fine.
    #[must_use]
    pub fn ignore_json_fields<I, S>(mut self, pointers: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let config = Arc::make_mut(&mut self.config);
        for pointer in pointers {
            let pointer = Pointer::parse(&pointer.into());
            if !config.ignored.contains(&pointer) {
                config.ignored.push(pointer);
            }
        }
        self
    }

    /// Makes these headers part of the intent: their values, in order, join the fingerprint,
    /// and a request without the header differs from one with it. By default no header does
    /// except `Content-Type`.
    #[must_use]
    pub fn include_headers<I>(mut self, names: I) -> Self
    where
        I: IntoIterator<Item = HeaderName>,
    {
        let config = Arc::make_mut(&mut self.config);
        config.headers.extend(names);
        config.headers.sort_by(|a, b| a.as_str().cmp(b.as_str()));
        config.headers.dedup();
        self
    }

    /// The fingerprint of an HTTP request: its method, path, query, included headers,
    /// content type and body.
    pub fn fingerprint(&self, parts: &Parts, body: &[u8]) -> Fingerprint {
        let mut h = Hasher::new(b"http");
        h.field(parts.method.as_str().as_bytes());
        h.field(parts.uri.path().as_bytes());
        h.pairs(parts.uri.query().unwrap_or("").as_bytes());
        self.headers(&mut h, &parts.headers);

        let content_type = parts
            .headers
            .get(http::header::CONTENT_TYPE)
            .map(|v| media_type(v.as_bytes()));
        match &content_type {
            Some(essence) => {
                h.tag(1);
                h.field(essence);
            }
            None => h.tag(0),
        }
        let kind = match content_type.as_deref() {
            Some(b"application/json") => BodyKind::Json,
            Some(t) if t.ends_with(b"+json") => BodyKind::Json,
            Some(b"application/x-www-form-urlencoded") => BodyKind::Form,
            _ => BodyKind::Raw,
        };
        self.body(&mut h, kind, body);
        h.finish()
    }

    /// The fingerprint of an operation outside HTTP, such as a background job: its name
    /// and a JSON body, canonicalised as for a request (with the ignored fields removed). A body
    /// that is not JSON is hashed as raw bytes.
    ///
    /// It never equals the fingerprint of an HTTP request.
    pub fn fingerprint_value(&self, operation: &str, body: &[u8]) -> Fingerprint {
        let mut h = Hasher::new(b"value");
        h.field(operation.as_bytes());
        self.body(&mut h, BodyKind::Json, body);
        h.finish()
    }

    /// A copy of what this fingerprinter reads from the request, or `None` for a body too
    /// large to be worth keeping.
    pub(crate) fn verbatim(&self, parts: &Parts, body: &[u8]) -> Option<Verbatim> {
        if body.len() > VERBATIM_MAX_BODY {
            return None;
        }
        // Copied, not shared: a slice of the connection's read buffer would keep all of it.
        let headers = fingerprinted_headers(&self.config)
            .map(|name| {
                parts
                    .headers
                    .get_all(name)
                    .iter()
                    .map(|value| Box::from(value.as_bytes()))
                    .collect()
            })
            .collect();
        Some(Verbatim {
            config: Arc::clone(&self.config),
            method: parts.method.clone(),
            path: parts.uri.path().into(),
            query: parts.uri.query().map(Box::from),
            headers,
            body: Bytes::copy_from_slice(body),
        })
    }

    fn headers(&self, h: &mut Hasher, headers: &HeaderMap) {
        h.count(self.config.headers.len());
        for name in &self.config.headers {
            h.field(name.as_str().as_bytes());
            let values = headers.get_all(name);
            let count = values.iter().count();
            if count == 0 {
                h.tag(0);
            } else {
                h.tag(1);
                h.count(count);
                for value in values {
                    h.field(value.as_bytes());
                }
            }
        }
    }

    fn body(&self, h: &mut Hasher, kind: BodyKind, body: &[u8]) {
        if body.is_empty() {
            h.tag(body_tag::EMPTY);
            return;
        }
        match kind {
            BodyKind::Json => {
                json::with_canonical(body, &self.config.ignored, |canonical| match canonical {
                    Some(text) => {
                        h.tag(body_tag::CANONICAL_JSON);
                        h.field(text);
                    }
                    None => {
                        h.tag(body_tag::INVALID_JSON);
                        h.field(body);
                    }
                })
            }
            BodyKind::Form => {
                h.tag(body_tag::FORM);
                h.pairs(body);
            }
            BodyKind::Raw => {
                h.tag(body_tag::RAW);
                h.field(body);
            }
        }
    }
}

/// Bodies larger than this are not kept [`Verbatim`]: the copy would weigh on the replay cache
/// more than a retry of that size gains.
const VERBATIM_MAX_BODY: usize = 64 * 1024;

/// What a [`Fingerprinter`] reads from a request, copied exactly as sent.
///
/// Two requests whose fingerprinted parts are byte for byte the same have the same fingerprint
/// under the same fingerprinter, so a retry that matches a kept copy needs neither the
/// canonicaliser nor SHA-256: the replay cache keeps one next to each record it holds. A retry
/// that differs in any byte (whitespace, member order, an ignored field) is not refused for it;
/// it is compared by fingerprint as before.
#[derive(Clone, Debug)]
pub(crate) struct Verbatim {
    config: Arc<Config>,
    method: Method,
    path: Box<str>,
    query: Option<Box<str>>,
    /// The values of `Content-Type`, then of each included header in the configured order.
    headers: Box<[HeaderValues]>,
    body: Bytes,
}

/// One header's values, in the order sent.
type HeaderValues = Box<[Box<[u8]>]>;

impl Verbatim {
    /// The bytes this copy holds, for the replay cache's budget.
    pub(crate) fn weight(&self) -> usize {
        let headers: usize = self
            .headers
            .iter()
            // Each value is a separate allocation with a length word of its own.
            .flat_map(|values| values.iter().map(|value| value.len() + 8))
            .sum();
        self.path.len() + self.query.as_ref().map_or(0, |q| q.len()) + headers + self.body.len()
    }

    /// Whether the request in `parts` and `body`, read by `fingerprinter`, is this copy's.
    pub(crate) fn matches(
        &self,
        fingerprinter: &Fingerprinter,
        parts: &Parts,
        body: &[u8],
    ) -> bool {
        let config = &fingerprinter.config;
        (Arc::ptr_eq(&self.config, config) || *self.config == **config)
            && self.method == parts.method
            && *self.path == *parts.uri.path()
            && self.query.as_deref() == parts.uri.query()
            && *self.body == *body
            && fingerprinted_headers(config)
                .zip(self.headers.iter())
                .all(|(name, kept)| {
                    let mut sent = parts.headers.get_all(name).iter();
                    kept.iter()
                        .all(|kept| sent.next().is_some_and(|value| **kept == *value.as_bytes()))
                        && sent.next().is_none()
                })
    }
}

/// `Content-Type`, then the headers the configuration includes: what [`Verbatim`] keeps.
fn fingerprinted_headers(config: &Config) -> impl Iterator<Item = &HeaderName> {
    std::iter::once(&http::header::CONTENT_TYPE).chain(&config.headers)
}

/// The canonical form of a JSON text, with the members at the `ignored` JSON Pointers removed,
/// or `None` when the text is not valid JSON.
///
/// This is the form [`Fingerprinter`] hashes for JSON bodies; the module documentation lists
/// its rules. Pointers are read as in [`Fingerprinter::ignore_json_fields`].
pub fn canonical_json(json: &[u8], ignored: &[&str]) -> Option<Vec<u8>> {
    let pointers: Vec<Pointer> = ignored.iter().map(|p| Pointer::parse(p)).collect();
    json::with_canonical(json, &pointers, |canonical| canonical.map(std::mem::take))
}

/// The `type/subtype` of a `Content-Type` value, lowercased, without parameters.
fn media_type(value: &[u8]) -> Vec<u8> {
    let essence = value.split(|&b| b == b';').next().unwrap_or(value);
    essence.trim_ascii().to_ascii_lowercase()
}

/// Feeds SHA-256 with length-prefixed fields, so no two different inputs share a byte stream.
struct Hasher(Sha256);

impl Hasher {
    fn new(domain: &[u8]) -> Self {
        let mut h = Self(Sha256::new());
        h.field(VERSION);
        h.field(domain);
        h
    }

    fn tag(&mut self, tag: u8) {
        self.0.update([tag]);
    }

    fn count(&mut self, n: usize) {
        self.0.update((n as u64).to_be_bytes());
    }

    fn field(&mut self, bytes: &[u8]) {
        self.count(bytes.len());
        self.0.update(bytes);
    }

    /// `a=1&b=2` pairs: split on `&`, empties dropped, sorted bytewise.
    fn pairs(&mut self, text: &[u8]) {
        let mut pairs: Vec<&[u8]> = text
            .split(|&b| b == b'&')
            .filter(|p| !p.is_empty())
            .collect();
        pairs.sort_unstable();
        self.count(pairs.len());
        for pair in pairs {
            self.field(pair);
        }
    }

    fn finish(self) -> Fingerprint {
        Fingerprint(self.0.finalize().into())
    }
}

#[cfg(test)]
mod tests;
