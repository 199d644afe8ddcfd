//! The `Idempotency-Key` request header: what a client sends and what this crate accepts.
//!
//! # Protocol
//!
//! * **The client makes the key** before its first attempt at an operation and sends the same key,
//!   unchanged, on every retry of that operation. A new operation gets a new key. Keys must be hard to
//!   guess and must never repeat: use a long random value such as a UUIDv4
//!   (`4b3f8f3e-4f3c-4a8e-9d3f-0a6c1b2d3e4f`) or at least 128 random bits in base64url.
//! * **Syntax**: 1 to [`MAX_KEY_LEN`] (255) visible ASCII characters, `0x21`–`0x7E`; no spaces,
//!   no control characters, no non-ASCII. The key may be sent bare (`Idempotency-Key: k1`) or as an
//!   RFC 9651 Structured-Field string (`Idempotency-Key: "k1"`); both spell the same key. Spaces and
//!   tabs around the value are ignored. The length counts the key's characters after unquoting.
//! * **Exactly one value**: a request with several `Idempotency-Key` fields, or one field holding a
//!   comma-separated list (which is how intermediaries join repeated fields), is rejected.
//!
//! A rejected key is answered with `400` and the problem `code` `idempotency_key_invalid`; the
//! [`KeyError`] message is written for the client.
//!
//! ```
//! use axum_idempotency::{IdempotencyKey, KeyError};
//!
//! let bare = IdempotencyKey::parse("4b3f8f3e-4f3c-4a8e-9d3f-0a6c1b2d3e4f")?;
//! let quoted = IdempotencyKey::parse("\"4b3f8f3e-4f3c-4a8e-9d3f-0a6c1b2d3e4f\"")?;
//! assert_eq!(bare, quoted);
//! assert_eq!(bare.as_str(), "4b3f8f3e-4f3c-4a8e-9d3f-0a6c1b2d3e4f");
//!
//! assert_eq!(IdempotencyKey::parse("a, b"), Err(KeyError::SeveralValues));
//! assert_eq!(IdempotencyKey::parse("has space"), Err(KeyError::InvalidCharacter));
//! # Ok::<(), KeyError>(())
//! ```

use std::fmt;
use std::str::FromStr;

use http::{HeaderMap, HeaderName, HeaderValue};

use crate::key_syntax::KeySyntaxError;

/// The longest key accepted, in characters.
pub const MAX_KEY_LEN: usize = crate::key_syntax::MAX_KEY_LEN;

/// A validated idempotency key: 1 to [`MAX_KEY_LEN`] visible ASCII characters (`0x21`–`0x7E`).
///
/// Its `Debug` output never shows the key itself, only its length, so a key cannot leak into logs
/// through a stray `{:?}`.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// Parses one header value, bare (`k1`) or as a Structured-Field string (`"k1"`).
    ///
    /// # Errors
    ///
    /// A [`KeyError`] saying why the value is not a key.
    pub fn parse(value: &str) -> Result<Self, KeyError> {
        let value = value.trim_matches([' ', '\t']);
        if value.is_empty() {
            return Err(KeyError::Empty);
        }
        if value.starts_with('"') {
            return Self::validated(&parse_sf_string(value)?);
        }
        if value.contains(',') {
            return Err(KeyError::SeveralValues);
        }
        Self::validated(value)
    }

    /// Reads the key from the header `name` in `headers`.
    ///
    /// Returns `Ok(None)` when the header is absent.
    ///
    /// # Errors
    ///
    /// [`KeyError::SeveralValues`] when the header appears more than once, otherwise whatever
    /// [`IdempotencyKey::parse`] finds wrong with its value.
    pub fn from_headers(headers: &HeaderMap, name: &HeaderName) -> Result<Option<Self>, KeyError> {
        let mut values = headers.get_all(name).iter();
        let Some(first) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err(KeyError::SeveralValues);
        }
        Self::try_from(first).map(Some)
    }

    /// The key, unquoted.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    fn validated(key: &str) -> Result<Self, KeyError> {
        crate::key_syntax::check_key(key.as_bytes())?;
        Ok(Self(key.to_owned()))
    }
}

/// Unquotes an RFC 9651 sf-string item; parameters are refused because a key has none.
fn parse_sf_string(value: &str) -> Result<String, KeyError> {
    match sfv::Parser::new(value).parse::<sfv::Item>() {
        Ok(item) => {
            if !item.params.is_empty() {
                return Err(KeyError::MalformedString);
            }
            item.bare_item
                .as_string()
                .map(|s| s.as_str().to_owned())
                .ok_or(KeyError::MalformedString)
        }
        // `"a", "b"` is not one item but is a well-formed list: the client sent several keys.
        Err(_) => match sfv::Parser::new(value).parse::<sfv::List>() {
            Ok(list) if list.len() > 1 => Err(KeyError::SeveralValues),
            _ => Err(KeyError::MalformedString),
        },
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdempotencyKey(<redacted, {} chars>)", self.0.len())
    }
}

impl FromStr for IdempotencyKey {
    type Err = KeyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl TryFrom<&HeaderValue> for IdempotencyKey {
    type Error = KeyError;

    /// Parses a header value; bytes outside visible ASCII, space and tab (obs-text) are
    /// [`KeyError::InvalidCharacter`].
    fn try_from(value: &HeaderValue) -> Result<Self, Self::Error> {
        let value = value.to_str().map_err(|_| KeyError::InvalidCharacter)?;
        Self::parse(value)
    }
}

/// Why a header value is not an idempotency key. The message is meant for the client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The value is empty or only whitespace.
    #[error("the Idempotency-Key header is empty; it must be 1 to 255 visible ASCII characters")]
    Empty,
    /// The key has more than [`MAX_KEY_LEN`] characters.
    #[error(
        "the Idempotency-Key header is {len} characters long; it must be 1 to 255 visible ASCII characters"
    )]
    TooLong {
        /// The key's length in characters.
        len: usize,
    },
    /// The key contains a space, a control character or a non-ASCII character.
    #[error(
        "the Idempotency-Key header must be 1 to 255 visible ASCII characters (0x21 to 0x7E), without spaces"
    )]
    InvalidCharacter,
    /// Several keys were sent: repeated header fields or a comma-separated list.
    #[error("the Idempotency-Key header must be sent once, with exactly one key")]
    SeveralValues,
    /// The value starts with `"` but is not a valid RFC 9651 string without parameters.
    #[error(
        "the Idempotency-Key header starts with a quote but is not a valid structured-field string"
    )]
    MalformedString,
}

impl From<KeySyntaxError> for KeyError {
    fn from(error: KeySyntaxError) -> Self {
        match error {
            KeySyntaxError::Empty => Self::Empty,
            KeySyntaxError::InvalidCharacter => Self::InvalidCharacter,
            KeySyntaxError::TooLong { len } => Self::TooLong { len },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(value: &str) -> Result<String, KeyError> {
        IdempotencyKey::parse(value).map(|k| k.as_str().to_owned())
    }

    #[test]
    fn parses_the_key_table() {
        let max = "k".repeat(255);
        let over = "k".repeat(256);
        let max_quoted = format!("\"{max}\"");
        let over_quoted = format!("\"{over}\"");
        let cases: Vec<(&str, Result<&str, KeyError>)> = vec![
            ("k1", Ok("k1")),
            ("\"k1\"", Ok("k1")),
            ("  k1\t", Ok("k1")),
            (" \"k1\" ", Ok("k1")),
            (r#""a\"b""#, Ok("a\"b")),
            (r#""a\\b""#, Ok("a\\b")),
            ("a\"b", Ok("a\"b")),
            (
                "4b3f8f3e-4f3c-4a8e-9d3f-0a6c1b2d3e4f",
                Ok("4b3f8f3e-4f3c-4a8e-9d3f-0a6c1b2d3e4f"),
            ),
            ("!~", Ok("!~")),
            (&max, Ok(&max)),
            (&max_quoted, Ok(&max)),
            ("", Err(KeyError::Empty)),
            ("   ", Err(KeyError::Empty)),
            (" \t ", Err(KeyError::Empty)),
            ("\"\"", Err(KeyError::Empty)),
            (&over, Err(KeyError::TooLong { len: 256 })),
            (&over_quoted, Err(KeyError::TooLong { len: 256 })),
            ("a b", Err(KeyError::InvalidCharacter)),
            ("\"a b\"", Err(KeyError::InvalidCharacter)),
            ("a\u{7f}b", Err(KeyError::InvalidCharacter)),
            ("a\u{1}b", Err(KeyError::InvalidCharacter)),
            ("clé", Err(KeyError::InvalidCharacter)),
            ("a,b", Err(KeyError::SeveralValues)),
            ("a, b", Err(KeyError::SeveralValues)),
            ("\"a\", \"b\"", Err(KeyError::SeveralValues)),
            ("\"k1\";p=1", Err(KeyError::MalformedString)),
            ("\"k1", Err(KeyError::MalformedString)),
            ("\"k1\"x", Err(KeyError::MalformedString)),
            (r#""a\qb""#, Err(KeyError::MalformedString)),
        ];
        for (input, expected) in cases {
            let expected = expected.map(str::to_owned);
            assert_eq!(parse(input), expected, "input {input:?}");
        }
    }

    #[test]
    fn bare_and_quoted_forms_are_the_same_key() {
        assert_eq!(
            IdempotencyKey::parse("k1").ok(),
            IdempotencyKey::parse("\"k1\"").ok()
        );
    }

    #[test]
    fn debug_never_shows_the_key() {
        let key = IdempotencyKey::parse("secret-key-1").unwrap();
        let shown = format!("{key:?}");
        assert!(!shown.contains("secret"), "{shown}");
        assert_eq!(shown, "IdempotencyKey(<redacted, 12 chars>)");
    }

    #[test]
    fn absent_header_is_none() {
        let name = HeaderName::from_static("idempotency-key");
        assert_eq!(
            IdempotencyKey::from_headers(&HeaderMap::new(), &name),
            Ok(None)
        );
    }

    #[test]
    fn one_header_field_is_parsed() {
        let name = HeaderName::from_static("idempotency-key");
        let mut headers = HeaderMap::new();
        headers.insert(&name, HeaderValue::from_static("\"k1\""));
        let key = IdempotencyKey::from_headers(&headers, &name)
            .unwrap()
            .unwrap();
        assert_eq!(key.as_str(), "k1");
    }

    #[test]
    fn two_header_fields_are_several_values() {
        let name = HeaderName::from_static("idempotency-key");
        let mut headers = HeaderMap::new();
        headers.append(&name, HeaderValue::from_static("k1"));
        headers.append(&name, HeaderValue::from_static("k1"));
        assert_eq!(
            IdempotencyKey::from_headers(&headers, &name),
            Err(KeyError::SeveralValues)
        );
    }

    #[test]
    fn a_configured_header_name_is_read() {
        let name = HeaderName::from_static("x-request-key");
        let mut headers = HeaderMap::new();
        headers.insert("idempotency-key", HeaderValue::from_static("other"));
        headers.insert(&name, HeaderValue::from_static("mine"));
        let key = IdempotencyKey::from_headers(&headers, &name)
            .unwrap()
            .unwrap();
        assert_eq!(key.as_str(), "mine");
    }

    #[test]
    fn obs_text_header_value_is_invalid_character() {
        let value = HeaderValue::from_bytes(b"k\xe91").unwrap();
        assert_eq!(
            IdempotencyKey::try_from(&value),
            Err(KeyError::InvalidCharacter)
        );
    }

    #[test]
    fn from_str_is_parse() {
        let key: IdempotencyKey = "\"k1\"".parse().unwrap();
        assert_eq!(key.as_str(), "k1");
    }

    #[test]
    fn errors_read_as_sentences_for_clients() {
        assert_eq!(
            KeyError::TooLong { len: 300 }.to_string(),
            "the Idempotency-Key header is 300 characters long; it must be 1 to 255 visible ASCII characters"
        );
        assert!(
            KeyError::SeveralValues
                .to_string()
                .contains("exactly one key")
        );
    }

    proptest::proptest! {
        #[test]
        fn every_visible_ascii_key_round_trips_bare_and_quoted(key in "[!-~]{1,255}") {
            let bare = IdempotencyKey::parse(&key);
            let quoted_text = format!(
                "\"{}\"",
                key.replace('\\', "\\\\").replace('"', "\\\"")
            );
            let quoted = IdempotencyKey::parse(&quoted_text).unwrap();
            proptest::prop_assert_eq!(quoted.as_str(), key.as_str());
            if key.starts_with('"') {
                // A bare value starting with a quote is read as an sf-string, as the contract says.
                proptest::prop_assert!(bare.is_err() || bare.unwrap().as_str() != key);
            } else if key.contains(',') {
                proptest::prop_assert_eq!(bare, Err(KeyError::SeveralValues));
            } else {
                proptest::prop_assert_eq!(bare.map(|k| k.as_str().to_owned()), Ok(key.clone()));
            }
        }
    }
}
