//! Placeholder crate root on the `outbox` branch; the lead merges `lib.rs` by hand.

#[cfg(feature = "outbox")]
pub mod outbox;
