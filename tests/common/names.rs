//! Names of what a test makes on a shared server: a prefix saying which suite made it, the
//! test process's id, a timestamp and a counter, so no two tests (nor two runs) collide and an
//! operator can tell the suite's objects from anyone else's.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// A name no other test (or earlier run) uses.
pub(crate) fn unique(prefix: &str) -> String {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "{prefix}_{}_{}_{}",
        std::process::id(),
        nanos % 1_000_000_000_000,
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}
