//! What the server and the client agree on about the key: the header that carries it and the
//! syntax of the key itself.
//!
//! Both halves (and the outbox's downstream keys, which travel in the same header) check keys
//! here, so a key the client accepts is one the server accepts. This module depends on `http`
//! alone: a client-only build must not compile the server's parser (`sfv`) to get it.

/// The header that carries the key, unless a layer is configured with another.
pub(crate) const KEY_HEADER: http::HeaderName = http::HeaderName::from_static("idempotency-key");

/// The longest key accepted, in characters.
pub(crate) const MAX_KEY_LEN: usize = 255;

/// Why a key (after any unquoting) is not a valid key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeySyntaxError {
    /// No characters.
    Empty,
    /// A byte outside visible ASCII (`0x21`–`0x7E`).
    InvalidCharacter,
    /// More than [`MAX_KEY_LEN`] characters.
    TooLong { len: usize },
}

/// Checks the key's syntax: 1 to [`MAX_KEY_LEN`] visible ASCII characters (`0x21`–`0x7E`).
///
/// The characters are checked before the length so that the length is a count of characters:
/// once every byte is ASCII, bytes and characters are the same count.
pub(crate) fn check_key(key: &[u8]) -> Result<(), KeySyntaxError> {
    if key.is_empty() {
        return Err(KeySyntaxError::Empty);
    }
    if !key.iter().all(|b| (0x21..=0x7e).contains(b)) {
        return Err(KeySyntaxError::InvalidCharacter);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeySyntaxError::TooLong { len: key.len() });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_one_to_255_visible_ascii_characters() {
        assert_eq!(check_key(b"order-42"), Ok(()));
        assert_eq!(check_key(b"!~"), Ok(()));
        assert_eq!(check_key("x".repeat(255).as_bytes()), Ok(()));
        assert_eq!(check_key(b""), Err(KeySyntaxError::Empty));
        assert_eq!(
            check_key("x".repeat(256).as_bytes()),
            Err(KeySyntaxError::TooLong { len: 256 })
        );
        assert_eq!(
            check_key(b"has space"),
            Err(KeySyntaxError::InvalidCharacter)
        );
        assert_eq!(
            check_key("é".as_bytes()),
            Err(KeySyntaxError::InvalidCharacter)
        );
        // A long key with a bad character reports the character, not the length.
        let long_and_bad = format!("{} ", "x".repeat(300));
        assert_eq!(
            check_key(long_and_bad.as_bytes()),
            Err(KeySyntaxError::InvalidCharacter)
        );
    }
}
