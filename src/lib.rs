pub fn x() {}

#[cfg(feature = "client")]
pub mod client;
