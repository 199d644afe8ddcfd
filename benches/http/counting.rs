//! Counting statements: sqlx's own statement log, and the switch that turns counting on for
//! it and for the wire proxy's round trips.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tracing::subscriber::Interest;
use tracing::{Event, Metadata, Subscriber};
use tracing_subscriber::layer::Context;

pub(crate) static COUNTING: AtomicBool = AtomicBool::new(false);
pub(crate) static STATEMENTS: AtomicU64 = AtomicU64::new(0);

/// Counts sqlx's per-statement events (target `sqlx::query`) while [`COUNTING`] is on. Every
/// other callsite is disabled for good, so the engine's spans cost what they cost with no
/// subscriber at all.
pub(crate) struct StatementCounter;

impl<S: Subscriber> tracing_subscriber::Layer<S> for StatementCounter {
    fn register_callsite(&self, metadata: &'static Metadata<'static>) -> Interest {
        if metadata.target() == "sqlx::query" {
            Interest::sometimes()
        } else {
            Interest::never()
        }
    }

    fn enabled(&self, metadata: &Metadata<'_>, _ctx: Context<'_, S>) -> bool {
        metadata.target() == "sqlx::query" && COUNTING.load(Ordering::Relaxed)
    }

    fn on_event(&self, _event: &Event<'_>, _ctx: Context<'_, S>) {
        STATEMENTS.fetch_add(1, Ordering::Relaxed);
    }
}
