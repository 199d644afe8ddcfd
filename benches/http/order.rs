//! The order every app takes and every load sends, and the clock the records are written by.

use std::time::{SystemTime, UNIX_EPOCH};

/// How long the apps keep a record.
pub(crate) const TTL_MS: i64 = 24 * 3600 * 1000;
pub(crate) const ORDER_BODY: &str = r#"{"sku":"widget","qty":3}"#;

pub(crate) fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}
