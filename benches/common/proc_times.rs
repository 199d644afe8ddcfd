//! CPU time of processes, read from `/proc`; shared by the benches that say where the time goes.

use std::time::Duration;

/// Linux reports process times in units of `USER_HZ`, 100 a second on every architecture.
const TICKS_PER_SECOND: u64 = 100;

/// `ticks` of `USER_HZ` as a duration.
pub(crate) fn duration(ticks: u64) -> Duration {
    Duration::from_millis(ticks * 1000 / TICKS_PER_SECOND)
}

/// utime + stime from a `/proc/<pid>/stat` line. The process's name sits in parentheses and
/// may hold spaces; the fields after it are plain: state is field 3, utime 14, stime 15.
fn process_ticks(stat: &str) -> Option<u64> {
    let close = stat.rfind(')')?;
    let mut fields = stat.get(close + 2..)?.split(' ').skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// CPU time of the processes `pids` so far (one that has exited counts nothing).
pub(crate) fn of_pids(pids: &[u32]) -> Duration {
    duration(
        pids.iter()
            .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok())
            .filter_map(|stat| process_ticks(&stat))
            .sum(),
    )
}

/// CPU time so far of every process named `name` (its `comm`, as in `(beam.smp)`).
pub(crate) fn of_name(name: &str) -> Duration {
    let comm = format!("({name})");
    duration(
        std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|entry| std::fs::read_to_string(entry.path().join("stat")).ok())
            .filter(|stat| stat.contains(&comm))
            .filter_map(|stat| process_ticks(&stat))
            .sum(),
    )
}

/// CPU time of this process so far.
pub(crate) fn own() -> Duration {
    duration(
        std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|stat| process_ticks(&stat))
            .unwrap_or(0),
    )
}
