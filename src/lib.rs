//! axum-idempotency

mod fingerprint;
mod key;

pub use fingerprint::{Fingerprint, Fingerprinter, canonical_json};
pub use key::{IdempotencyKey, KeyError, MAX_KEY_LEN};
