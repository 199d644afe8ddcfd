//! Why a call ended without a response.

use std::fmt;

use super::ClientKey;

/// A boxed error from the inner client or the request body.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A call that ended without any response to return.
///
/// It carries the key the call used (when it was keyed) so the caller can log it and, if the
/// operation still matters, try again later with the **same** key: the server may have executed
/// an attempt whose answer was lost.
#[derive(Debug)]
pub struct Error {
    kind: ErrorKind,
    key: Option<ClientKey>,
    attempts: u32,
    source: Option<BoxError>,
}

/// The reason behind an [`Error`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The request body exceeded the layer's body limit; nothing was sent.
    RequestBodyTooLarge,
    /// Reading the request body failed; nothing was sent.
    RequestBody,
    /// The request already carried a key header the server would reject; nothing was sent.
    InvalidKey,
    /// The operating system could not provide random bytes for a key; nothing was sent.
    KeyGeneration,
    /// The last attempt failed in the inner client (connection refused or reset, a body error).
    Transport,
    /// The last attempt ran out of time (its own timeout or the call's deadline).
    Timeout,
}

impl Error {
    pub(crate) fn new(kind: ErrorKind, source: Option<BoxError>) -> Self {
        Self {
            kind,
            key: None,
            attempts: 0,
            source,
        }
    }

    pub(crate) fn with_call(mut self, key: Option<ClientKey>, attempts: u32) -> Self {
        self.key = key;
        self.attempts = attempts;
        self
    }

    /// Why the call ended.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The key the call sent, if it was keyed.
    pub fn key(&self) -> Option<&ClientKey> {
        self.key.as_ref()
    }

    /// How many attempts were sent (0 when the request was refused before sending).
    pub fn attempts(&self) -> u32 {
        self.attempts
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let reason = match self.kind {
            ErrorKind::RequestBodyTooLarge => "request body exceeds the retry layer's limit",
            ErrorKind::RequestBody => "reading the request body failed",
            ErrorKind::InvalidKey => "the request's idempotency key header is invalid",
            ErrorKind::KeyGeneration => "no random bytes for an idempotency key",
            ErrorKind::Transport => "the request failed",
            ErrorKind::Timeout => "the request timed out",
        };
        write!(f, "{reason} (after {} attempt(s))", self.attempts)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|source| source as &(dyn std::error::Error + 'static))
    }
}
