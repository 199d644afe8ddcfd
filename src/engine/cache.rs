//! Final records held in memory, so a replay this instance has already answered costs no
//! database read.
//!
//! Only records in a final state are held (completed or failed permanently). Such a record is
//! never rewritten while it lives: the store replaces a record only once it has expired, and
//! purges only expired records. A copy held until its `expires_at` therefore answers exactly as
//! the table would, on every instance, with no invalidation protocol. What the cache cannot see
//! is a record deleted from the table by hand before it expires: an instance that holds a copy
//! replays it until it expires or is evicted.
//!
//! Next to a record the cache keeps the request it was answered for, exactly as sent (a
//! [`Verbatim`] copy, for bodies up to 64 KiB), so a byte-identical retry is recognised without
//! fingerprinting it again.
//!
//! The cache is bounded by the bytes of the responses and requests it holds; the least useful
//! entries are evicted first (quick_cache's S3-FIFO policy, which keeps entries that are hit
//! again over entries seen once).

use std::fmt;
use std::sync::Arc;

use quick_cache::Weighter;
use quick_cache::sync::Cache;

use crate::clock::Millis;
use crate::fingerprint::Verbatim;
use crate::record::{Record, RecordState};
use crate::scope::ScopedKey;

/// What one entry costs besides its headers and body: the key, the record's fixed fields and
/// the cache's own bookkeeping, rounded up.
const ENTRY_OVERHEAD: u64 = 256;

/// A final record and, when known, the request it answers as sent.
#[derive(Debug)]
pub(crate) struct Cached {
    pub(crate) record: Record,
    /// Present only when this request's fingerprint was seen to equal the record's.
    pub(crate) request: Option<Verbatim>,
}

/// A size-bounded map from scoped key to final record. Cheap to clone.
#[derive(Clone)]
pub(crate) struct ReplayCache {
    entries: Arc<Cache<ScopedKey, Arc<Cached>, ByWeight>>,
    max_bytes: u64,
}

impl fmt::Debug for ReplayCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReplayCache")
            .field("max_bytes", &self.max_bytes)
            .field("entries", &self.entries.len())
            .finish()
    }
}

impl ReplayCache {
    /// A cache holding records whose responses weigh `max_bytes` in all.
    pub(crate) fn new(max_bytes: u64) -> Self {
        // The estimate only sizes the initial tables; 1 KiB is a typical stored response.
        let estimated_items = usize::try_from(max_bytes / 1024).unwrap_or(usize::MAX);
        Self {
            entries: Arc::new(Cache::with_weighter(
                estimated_items.clamp(16, 1 << 20),
                max_bytes,
                ByWeight,
            )),
            max_bytes,
        }
    }

    /// The final record under `key`, if held and still live at `now`.
    pub(crate) fn get(&self, key: &ScopedKey, now: Millis) -> Option<Arc<Cached>> {
        let cached = self.entries.get(key)?;
        if cached.record.is_expired(now) {
            self.entries.remove(key);
            return None;
        }
        Some(cached)
    }

    /// Drops what is held under `key`.
    pub(crate) fn remove(&self, key: &ScopedKey) {
        self.entries.remove(key);
    }

    /// Holds `record` (with the `request` it answers, if known) if it is final, carries its
    /// response and is live at `now`.
    pub(crate) fn insert(
        &self,
        key: ScopedKey,
        record: Record,
        request: Option<Verbatim>,
        now: Millis,
    ) {
        let cacheable = matches!(
            record.state,
            RecordState::Completed | RecordState::FailedPermanent
        ) && record.response.is_some()
            && !record.is_expired(now);
        if cacheable {
            self.entries
                .insert(key, Arc::new(Cached { record, request }));
        }
    }
}

#[derive(Clone)]
struct ByWeight;

impl Weighter<ScopedKey, Arc<Cached>> for ByWeight {
    fn weight(&self, _key: &ScopedKey, cached: &Arc<Cached>) -> u64 {
        let request = cached.request.as_ref().map_or(0, Verbatim::weight);
        let response = cached.record.response.as_ref().map_or(0, |response| {
            let headers: usize = response
                .headers
                .iter()
                .map(|(name, value)| name.as_str().len() + value.len() + 16)
                .sum();
            headers + response.body.len()
        });
        ENTRY_OVERHEAD + (request + response) as u64
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use http::{HeaderMap, StatusCode};

    use super::*;
    use crate::fingerprint::{Fingerprint, Fingerprinter};
    use crate::record::StoredResponse;
    use crate::scope::Scope;

    fn key(name: &str) -> ScopedKey {
        Scope::anonymous("POST", "/orders", name.parse().expect("valid key")).scoped_key()
    }

    fn record(state: RecordState, body: usize, expires_at_ms: i64) -> Record {
        Record {
            state,
            fingerprint: Fingerprint::from([7; 32]),
            response: (state != RecordState::Processing).then(|| StoredResponse {
                status: StatusCode::CREATED,
                headers: HeaderMap::new(),
                body: Bytes::from(vec![b'x'; body]),
            }),
            expires_at: Millis::from_column(expires_at_ms),
            lease_expires_at: None,
        }
    }

    #[test]
    fn holds_final_records_until_they_expire() {
        let cache = ReplayCache::new(1 << 20);
        cache.insert(
            key("a"),
            record(RecordState::Completed, 10, 1_000),
            None,
            Millis::from_column(0),
        );
        cache.insert(
            key("b"),
            record(RecordState::FailedPermanent, 10, 1_000),
            None,
            Millis::from_column(0),
        );
        assert!(cache.get(&key("a"), Millis::from_column(999)).is_some());
        assert!(cache.get(&key("b"), Millis::from_column(999)).is_some());
        assert!(
            cache.get(&key("a"), Millis::from_column(1_000)).is_none(),
            "expired at expires_at"
        );
        assert!(
            cache.get(&key("a"), Millis::from_column(0)).is_none(),
            "an expired entry is dropped"
        );
    }

    #[test]
    fn never_holds_processing_or_expired_records() {
        let cache = ReplayCache::new(1 << 20);
        cache.insert(
            key("p"),
            record(RecordState::Processing, 0, 1_000),
            None,
            Millis::from_column(0),
        );
        cache.insert(
            key("e"),
            record(RecordState::Completed, 10, 1_000),
            None,
            Millis::from_column(1_000),
        );
        assert!(cache.get(&key("p"), Millis::from_column(0)).is_none());
        assert!(cache.get(&key("e"), Millis::from_column(0)).is_none());
    }

    #[test]
    fn stays_within_its_byte_budget() {
        let cache = ReplayCache::new(64 * 1024);
        for i in 0..1_000 {
            cache.insert(
                key(&format!("k{i}")),
                record(RecordState::Completed, 1024, i64::MAX),
                None,
                Millis::from_column(0),
            );
        }
        let held = (0..1_000)
            .filter(|i| {
                cache
                    .get(&key(&format!("k{i}")), Millis::from_column(0))
                    .is_some()
            })
            .count();
        assert!(held > 0, "the newest entries are held");
        assert!(
            held as u64 * (1024 + ENTRY_OVERHEAD) <= 64 * 1024,
            "{held} entries of 1 KiB in a 64 KiB cache"
        );
    }

    #[test]
    fn kept_requests_count_against_the_budget() {
        let (parts, ()) = http::Request::post("/orders")
            .body(())
            .unwrap()
            .into_parts();
        let request = Fingerprinter::new().verbatim(&parts, &[b'r'; 1024]);
        assert!(request.is_some(), "a 1 KiB body is kept");
        let cache = ReplayCache::new(64 * 1024);
        for i in 0..1_000 {
            cache.insert(
                key(&format!("k{i}")),
                record(RecordState::Completed, 1024, i64::MAX),
                request.clone(),
                Millis::from_column(0),
            );
        }
        let held: Vec<_> = (0..1_000)
            .filter_map(|i| cache.get(&key(&format!("k{i}")), Millis::from_column(0)))
            .collect();
        assert!(!held.is_empty(), "the newest entries are held");
        assert!(held.iter().all(|cached| cached.request.is_some()));
        assert!(
            held.len() as u64 * (2 * 1024 + ENTRY_OVERHEAD) <= 64 * 1024,
            "{} entries of 1 KiB response and 1 KiB request in a 64 KiB cache",
            held.len()
        );
    }
}
