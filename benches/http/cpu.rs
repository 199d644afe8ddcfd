//! CPU time a database server spends, read from `/proc`: what a scenario costs the server per
//! request, beside what it costs the client.

use std::time::Duration;

/// A database server on this machine, known by its processes' name.
#[derive(Clone, Copy)]
pub(crate) struct ServerCpu {
    /// The `comm` of the server's processes: `postgres` (a process per connection, plus the
    /// writers the requests keep busy) or `mariadbd` (one process).
    comm: &'static str,
}

/// Linux reports process times in units of `USER_HZ`, 100 a second on every architecture.
const TICKS_PER_SECOND: u64 = 100;

impl ServerCpu {
    pub(crate) fn of(backend: &str) -> Option<Self> {
        match backend {
            "postgres" => Some(Self { comm: "postgres" }),
            "mysql" => Some(Self { comm: "mariadbd" }),
            _ => None,
        }
    }

    /// User and system time of every live process of the server so far.
    pub(crate) fn used(self) -> Duration {
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return Duration::ZERO;
        };
        let ticks: u64 = entries
            .flatten()
            .filter_map(|entry| std::fs::read_to_string(entry.path().join("stat")).ok())
            .filter_map(|stat| self.ticks(&stat))
            .sum();
        Duration::from_millis(ticks * 1000 / TICKS_PER_SECOND)
    }

    /// utime + stime from one `/proc/<pid>/stat` line, if the process is the server's.
    fn ticks(self, stat: &str) -> Option<u64> {
        let open = stat.find('(')?;
        let close = stat.rfind(')')?;
        (stat.get(open + 1..close)? == self.comm)
            .then(|| process_ticks(stat))
            .flatten()
    }
}

/// User and system time of this process so far: the servers under test and the load generator,
/// alike for every scenario but for the work the scenario's own route does.
pub(crate) fn own_process() -> Duration {
    let ticks = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|stat| process_ticks(&stat))
        .unwrap_or(0);
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
