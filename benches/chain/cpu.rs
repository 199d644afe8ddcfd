//! Where the relay's time goes: CPU time of the chain's processes, the broker, the database
//! backends serving payments and the machine as a whole, read from `/proc`.

use std::time::Duration;

/// Linux reports process times in units of `USER_HZ`, 100 a second on every architecture.
const TICKS_PER_SECOND: u64 = 100;

fn duration(ticks: u64) -> Duration {
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

/// CPU time of this process (the bench: its load and its polls).
pub(crate) fn own() -> Duration {
    duration(
        std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|stat| process_ticks(&stat))
            .unwrap_or(0),
    )
}

/// Busy time of the whole machine so far, summed over its cores (everything in `/proc/stat`'s
/// `cpu` line but idle and iowait), and how many cores it has.
pub(crate) fn machine() -> (Duration, usize) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let cores = stat
        .lines()
        .filter(|l| l.starts_with("cpu") && !l.starts_with("cpu "))
        .count();
    let busy = stat
        .lines()
        .find(|l| l.starts_with("cpu "))
        .map(|line| {
            line.split_whitespace()
                .skip(1)
                .filter_map(|v| v.parse::<u64>().ok())
                .enumerate()
                .filter(|(i, _)| *i != 3 && *i != 4)
                .map(|(_, v)| v)
                .sum()
        })
        .unwrap_or(0);
    (duration(busy), cores.max(1))
}
