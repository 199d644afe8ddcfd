//! The keys this instance has handled lately, remembered just well enough to guess whether a
//! request is a retry.
//!
//! Most keyed requests are first attempts; retries are the exception. A first attempt gains
//! nothing from reading the store before its claim (there is nothing to read), so the engine
//! claims a key it has not seen lately straight away, and reads first only for a key it has:
//! a double click, a client's quick retry or a replayed delivery, which one indexed read
//! answers without a transaction. The guess only picks the cheaper order. A wrong guess costs
//! a round trip, never a guarantee: a claim still relies on the table's unique key alone, and
//! a claim that finds the key taken reads the record inside its own transaction.
//!
//! The table is direct-mapped and lossy: a slot holds 64 bits of one key's digest, and a newer
//! key landing in the same slot replaces it. It is fixed in size, costs one atomic swap per
//! request and takes no lock.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::scope::ScopedKey;

/// Slots in the table (a power of two). 64 KiB: at a few thousand new keys per second a key
/// stays for seconds, the span in which double clicks and quick retries arrive.
const SLOTS: usize = 8192;

/// A lossy set of recently handled scoped keys. Cheap to clone; clones share the table.
#[derive(Clone)]
pub(crate) struct RecentKeys {
    slots: Arc<[AtomicU64]>,
}

impl fmt::Debug for RecentKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecentKeys")
            .field("slots", &self.slots.len())
            .finish_non_exhaustive()
    }
}

impl RecentKeys {
    /// An empty table.
    pub(crate) fn new() -> Self {
        Self {
            slots: (0..SLOTS).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Notes `key` as handled now, and says whether it had been handled lately.
    pub(crate) fn saw(&self, key: &ScopedKey) -> bool {
        let digest = key.digest();
        let word = |at: usize| {
            let mut bytes = [0; 8];
            bytes.copy_from_slice(&digest[at..at + 8]);
            u64::from_le_bytes(bytes)
        };
        // The digest is SHA-256, so any two of its words are independent: one picks the slot,
        // the other identifies the key. The low bit is forced on because 0 marks an empty slot.
        let slot = word(8) as usize & (SLOTS - 1);
        let tag = word(0) | 1;
        self.slots[slot].swap(tag, Ordering::Relaxed) == tag
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::IdempotencyKey;
    use crate::scope::Scope;

    fn key(name: &str) -> ScopedKey {
        let key: IdempotencyKey = name.parse().expect("valid key");
        Scope::new("alice", "POST", "/orders", key).scoped_key()
    }

    #[test]
    fn a_key_is_new_once_then_seen() {
        let recent = RecentKeys::new();
        let first = key("order-1");
        assert!(!recent.saw(&first));
        assert!(recent.saw(&first));
        assert!(recent.saw(&first.clone()));
        assert!(!recent.saw(&key("order-2")));
        assert!(recent.saw(&first));
    }

    #[test]
    fn clones_share_what_they_saw() {
        let recent = RecentKeys::new();
        let clone = recent.clone();
        assert!(!recent.saw(&key("shared")));
        assert!(clone.saw(&key("shared")));
    }

    #[test]
    fn a_key_is_forgotten_once_enough_newer_keys_pass() {
        let recent = RecentKeys::new();
        let old = key("old");
        recent.saw(&old);
        for n in 0..SLOTS * 16 {
            recent.saw(&key(&format!("newer-{n}")));
        }
        assert!(!recent.saw(&old));
    }
}
