//! Time as the crate reads and keeps it: one clock and one millisecond type for records and
//! the outbox alike.
//!
//! Every expiry, lease, retry and time budget is compared with a [`Clock`]'s "now", which an
//! engine and an outbox each carry: the wall clock, or a test's [`ManualClock`]. Given one
//! `ManualClock`, records and outbox messages age together, as they would in production.

// The types are `pub` for the sealed backend's signatures; the module is private, so nothing
// here but `ManualClock` is reachable from outside the crate.
#![allow(unreachable_pub)]

#[cfg(feature = "test-util")]
use std::sync::Arc;
#[cfg(feature = "test-util")]
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A point in time as the tables keep it: whole milliseconds since the Unix epoch, the one
/// unit every record and outbox column, lease, retry and expiry uses. Each process writes its
/// own clock's time, so instances on several hosts assume clocks kept in sync (NTP), within a
/// small fraction of the shortest lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Millis(i64);

impl Millis {
    /// The wall clock's time: what [`Clock::System`] reads, and what stamps the rare column
    /// that records when something really happened whatever the clock (a migration's
    /// `applied_at`).
    pub(crate) fn now() -> Self {
        Self::from(SystemTime::now())
    }

    /// A time as a table column holds it.
    pub(crate) const fn from_column(millis: i64) -> Self {
        Self(millis)
    }

    /// The value a table column holds.
    pub(crate) const fn column(self) -> i64 {
        self.0
    }

    /// `span` later, saturating rather than wrapping for absurd spans.
    pub(crate) fn after(self, span: Duration) -> Self {
        Self(self.0.saturating_add(span_millis(span)))
    }

    /// How long from this time until `later`; nothing when `later` is not after it.
    #[cfg_attr(not(feature = "outbox"), allow(dead_code))]
    pub(crate) fn until(self, later: Self) -> Duration {
        Duration::from_millis(u64::try_from(later.0.saturating_sub(self.0)).unwrap_or(0))
    }

    /// `span` earlier, saturating rather than wrapping for absurd spans.
    #[cfg_attr(not(feature = "outbox"), allow(dead_code))]
    pub(crate) fn before(self, span: Duration) -> Self {
        Self(self.0.saturating_sub(span_millis(span)))
    }
}

/// `span` in whole milliseconds, the longest spans held at the largest.
fn span_millis(span: Duration) -> i64 {
    i64::try_from(span.as_millis()).unwrap_or(i64::MAX)
}

impl From<SystemTime> for Millis {
    fn from(time: SystemTime) -> Self {
        // A clock set before 1970 reads as the epoch: expiries stay ordered, nothing panics.
        Self(time.duration_since(UNIX_EPOCH).map_or(0, span_millis))
    }
}

impl From<Millis> for SystemTime {
    fn from(millis: Millis) -> Self {
        UNIX_EPOCH + Duration::from_millis(u64::try_from(millis.0).unwrap_or(0))
    }
}

/// Where the time is read: the wall clock, or a [`ManualClock`] a test moves. A store (and
/// the engines on it) and an outbox each carry one.
#[derive(Debug, Clone, Default)]
pub enum Clock {
    #[default]
    System,
    #[cfg(feature = "test-util")]
    Manual(ManualClock),
}

impl Clock {
    pub(crate) fn now(&self) -> Millis {
        match self {
            Self::System => Millis::now(),
            #[cfg(feature = "test-util")]
            Self::Manual(clock) => Millis(clock.0.load(Ordering::Relaxed)),
        }
    }
}

/// A clock that stands still until moved, for tests of retention, leases, retries and time
/// budgets that should not sleep through them. Give it to
/// [`Engine::timed_by`](crate::Engine::timed_by) or
/// [`IdempotencyLayer::timed_by`](crate::IdempotencyLayer::timed_by), and to
/// `Outbox::timed_by` (with the `outbox` feature): clones share one time, so one clock ages
/// records and outbox messages together.
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use axum_idempotency::ManualClock;
///
/// let clock = ManualClock::new(SystemTime::now());
/// let start = clock.now();
/// clock.advance(Duration::from_secs(25 * 3600));
/// assert_eq!(clock.now().duration_since(start)?, Duration::from_secs(25 * 3600));
/// # Ok::<(), std::time::SystemTimeError>(())
/// ```
#[cfg(feature = "test-util")]
#[derive(Debug, Clone)]
pub struct ManualClock(Arc<AtomicI64>);

#[cfg(feature = "test-util")]
impl ManualClock {
    /// A clock standing at `time` (to the millisecond).
    pub fn new(time: SystemTime) -> Self {
        Self(Arc::new(AtomicI64::new(Millis::from(time).0)))
    }

    /// The time it stands at.
    pub fn now(&self) -> SystemTime {
        Millis(self.0.load(Ordering::Relaxed)).into()
    }

    /// Moves it `by` forward.
    pub fn advance(&self, by: Duration) {
        self.0.fetch_add(span_millis(by), Ordering::Relaxed);
    }
}

#[cfg(feature = "test-util")]
impl From<ManualClock> for Clock {
    fn from(clock: ManualClock) -> Self {
        Self::Manual(clock)
    }
}
