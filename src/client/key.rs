//! The key a client sends for one logical call.

use std::fmt;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use http::HeaderValue;

use crate::key_syntax::check_key;

/// Random bytes in a generated key: 192 bits, well above the 128 a key needs to be unguessable
/// and collision-free, and a multiple of three so the base64 text needs no padding.
const GENERATED_KEY_BYTES: usize = 24;

/// The idempotency key of one logical call: the same value goes out on every retry.
///
/// The layer generates one per call unless the caller brings its own, either as a request
/// extension (for example derived from the caller's own order id) or as the header already set on
/// the request. The key actually used is put into the response's extensions, so a caller can log
/// it:
///
/// ```
/// use axum_idempotency::client::ClientKey;
///
/// let mut request = http::Request::post("http://127.0.0.1:3000/orders").body(()).unwrap();
/// request
///     .extensions_mut()
///     .insert(ClientKey::new("order-2024-0001").unwrap());
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct ClientKey(HeaderValue);

impl ClientKey {
    /// Generates a fresh key: 192 bits from the operating system's CSPRNG as URL-safe base64
    /// (32 characters from `A–Z a–z 0–9 - _`).
    ///
    /// # Errors
    ///
    /// When the operating system cannot provide random bytes.
    pub fn generate() -> Result<Self, std::io::Error> {
        let mut bytes = [0_u8; GENERATED_KEY_BYTES];
        getrandom::fill(&mut bytes).map_err(std::io::Error::from)?;
        let text = URL_SAFE_NO_PAD.encode(bytes);
        let value = HeaderValue::try_from(text).expect("URL-safe base64 is visible ASCII");
        Ok(Self(value))
    }

    /// A key chosen by the caller, e.g. derived from its own order id.
    ///
    /// # Errors
    ///
    /// When `key` is empty, longer than 255 characters, or contains anything but visible ASCII
    /// (`0x21`–`0x7E`): the server would reject it.
    pub fn new(key: impl AsRef<str>) -> Result<Self, InvalidClientKey> {
        Self::from_bytes(key.as_ref().as_bytes())
    }

    /// Reads a key from a header value already set on a request.
    pub(crate) fn from_header(value: &HeaderValue) -> Result<Self, InvalidClientKey> {
        Self::from_bytes(value.as_bytes())
    }

    fn from_bytes(bytes: &[u8]) -> Result<Self, InvalidClientKey> {
        // The server's own check: a key the client accepts is one the server accepts.
        check_key(bytes).map_err(|_| InvalidClientKey)?;
        HeaderValue::from_bytes(bytes)
            .map(Self)
            .map_err(|_| InvalidClientKey)
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        // Only visible ASCII gets in, so the value is always valid text.
        self.0.to_str().unwrap_or_default()
    }

    pub(crate) fn header_value(&self) -> HeaderValue {
        self.0.clone()
    }
}

impl fmt::Display for ClientKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for ClientKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("ClientKey").field(&self.as_str()).finish()
    }
}

/// A caller-chosen key the server would reject: empty, longer than 255 characters, or not
/// visible ASCII.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("an idempotency key must be 1 to 255 visible ASCII characters")]
pub struct InvalidClientKey;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_keys_are_long_url_safe_and_distinct() {
        let first = ClientKey::generate().unwrap();
        let second = ClientKey::generate().unwrap();
        assert_eq!(first.as_str().len(), 32);
        assert!(
            first
                .as_str()
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        );
        assert_ne!(first, second);
    }

    #[test]
    fn caller_keys_follow_the_server_contract() {
        assert!(ClientKey::new("order-42").is_ok());
        assert!(ClientKey::new("x".repeat(255)).is_ok());
        assert_eq!(ClientKey::new(""), Err(InvalidClientKey));
        assert_eq!(ClientKey::new("x".repeat(256)), Err(InvalidClientKey));
        assert_eq!(ClientKey::new("has space"), Err(InvalidClientKey));
        assert_eq!(ClientKey::new("é"), Err(InvalidClientKey));
    }
}
