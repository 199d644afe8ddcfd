//! Placeholder crate root (the lead owns this file).

/// Placeholder.
pub fn x() {}

#[cfg(feature = "client")]
pub mod client;
