//! What an inbox has done with its deliveries so far.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use super::Verdict;

/// Counters since the inbox was created (shared by its clones).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Deliveries applied (handler ran and committed).
    pub processed: u64,
    /// Deliveries skipped because their business key was applied before.
    pub duplicates: u64,
    /// Deliveries rolled back and sent back for another attempt.
    pub retried: u64,
    /// Deliveries sent back because the consumer's database or a dependency was unreachable:
    /// outages, which count as no attempt.
    pub unavailable: u64,
    /// Deliveries dead-lettered.
    pub dead: u64,
}

#[derive(Default)]
pub(super) struct Counters {
    processed: AtomicU64,
    duplicates: AtomicU64,
    retried: AtomicU64,
    unavailable: AtomicU64,
    dead: AtomicU64,
    /// Outages met one after another, with no delivery getting through in between: the
    /// outage backoff's attempt number.
    outages: AtomicU32,
}

impl Counters {
    /// Counts one delivery's verdict.
    pub(super) fn count(&self, verdict: &Verdict) {
        let counter = match verdict {
            Verdict::Applied => &self.processed,
            Verdict::Duplicate => &self.duplicates,
            Verdict::Retry { .. } => &self.retried,
            Verdict::Unavailable { .. } => &self.unavailable,
            Verdict::Dead { .. } => &self.dead,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        if !matches!(verdict, Verdict::Unavailable { .. }) {
            // Something got through (or failed on its own account): the next outage backs off
            // from the start.
            self.outages.store(0, Ordering::Relaxed);
        }
    }

    /// Counts a dead letter an operator's replay applied.
    pub(super) fn replayed(&self) {
        self.processed.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts an outage met; how many were met in a row before it.
    pub(super) fn outage(&self) -> u32 {
        self.outages.fetch_add(1, Ordering::Relaxed)
    }

    pub(super) fn snapshot(&self) -> Stats {
        Stats {
            processed: self.processed.load(Ordering::Relaxed),
            duplicates: self.duplicates.load(Ordering::Relaxed),
            retried: self.retried.load(Ordering::Relaxed),
            unavailable: self.unavailable.load(Ordering::Relaxed),
            dead: self.dead.load(Ordering::Relaxed),
        }
    }
}
