//! Where the relay's time goes: CPU time of the chain's processes, the broker, the database
//! backends serving payments and the machine as a whole, read from `/proc`.

use std::time::Duration;

#[path = "../common/proc_times.rs"]
mod proc_times;

use proc_times::duration;
pub(crate) use proc_times::{of_name, of_pids, own};

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
