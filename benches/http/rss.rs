//! The process's resident memory: the current RSS and the peak over a scenario.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

fn status_kib(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
}

/// Peak RSS since the last reset: VmHWM after resetting it through `clear_refs` where the
/// kernel allows that, else the maximum of VmRSS sampled every 5 ms.
pub(crate) struct PeakRss {
    resettable: bool,
    sampled: Arc<AtomicU64>,
}

impl PeakRss {
    pub(crate) fn start() -> Self {
        let resettable = std::fs::write("/proc/self/clear_refs", "5").is_ok();
        let sampled = Arc::new(AtomicU64::new(0));
        let max = Arc::clone(&sampled);
        std::thread::spawn(move || {
            loop {
                if let Some(rss) = status_kib("VmRSS:") {
                    max.fetch_max(rss, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        Self {
            resettable,
            sampled,
        }
    }

    pub(crate) fn reset(&self) {
        if self.resettable {
            let _ = std::fs::write("/proc/self/clear_refs", "5");
        }
        self.sampled
            .store(status_kib("VmRSS:").unwrap_or(0), Ordering::Relaxed);
    }

    pub(crate) fn peak_mib(&self) -> f64 {
        let sampled = self.sampled.load(Ordering::Relaxed);
        let peak = if self.resettable {
            status_kib("VmHWM:").unwrap_or(0).max(sampled)
        } else {
            sampled
        };
        peak as f64 / 1024.0
    }

    pub(crate) fn source(&self) -> &'static str {
        if self.resettable {
            "VmHWM (reset per scenario via /proc/self/clear_refs)"
        } else {
            "max VmRSS sampled every 5 ms"
        }
    }
}

pub(crate) fn rss_mib() -> f64 {
    status_kib("VmRSS:").unwrap_or(0) as f64 / 1024.0
}
