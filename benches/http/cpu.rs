//! CPU time a database server spends, read from `/proc`: what a scenario costs the server per
//! request, beside what it costs the client.

use std::sync::Mutex;
use std::time::Duration;

/// The PostgreSQL backends serving the app's pool: a process per connection, which does a
/// request's work (parsing, planning, writing the heap, the indexes and the WAL). Counting them
/// alone keeps other clients of a shared server out of the figure.
static POSTGRES_BACKENDS: Mutex<Vec<u32>> = Mutex::new(Vec::new());

/// Notes the backend process of a connection the app's pool opened.
#[cfg(feature = "postgres")]
pub(crate) async fn note_postgres_backend(
    conn: &mut sqlx::PgConnection,
) -> Result<(), sqlx::Error> {
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(conn)
        .await?;
    if let (Ok(pid), Ok(mut backends)) = (u32::try_from(pid), POSTGRES_BACKENDS.lock()) {
        backends.push(pid);
    }
    Ok(())
}

/// A database server on this machine.
#[derive(Clone, Copy)]
pub(crate) enum ServerCpu {
    /// PostgreSQL: the backends of the app's connections.
    Postgres,
    /// MariaDB: its one process, `mariadbd`, whatever its clients.
    MariaDb,
}

/// Linux reports process times in units of `USER_HZ`, 100 a second on every architecture.
const TICKS_PER_SECOND: u64 = 100;

impl ServerCpu {
    pub(crate) fn of(backend: &str) -> Option<Self> {
        match backend {
            "postgres" => Some(Self::Postgres),
            "mysql" => Some(Self::MariaDb),
            _ => None,
        }
    }

    /// User and system time of the server's processes so far.
    pub(crate) fn used(self) -> Duration {
        let ticks: u64 = match self {
            Self::Postgres => {
                let backends = POSTGRES_BACKENDS
                    .lock()
                    .map(|pids| pids.clone())
                    .unwrap_or_default();
                backends
                    .iter()
                    .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok())
                    .filter_map(|stat| process_ticks(&stat))
                    .sum()
            }
            Self::MariaDb => std::fs::read_dir("/proc")
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|entry| std::fs::read_to_string(entry.path().join("stat")).ok())
                .filter(|stat| stat.contains("(mariadbd)"))
                .filter_map(|stat| process_ticks(&stat))
                .sum(),
        };
        Duration::from_millis(ticks * 1000 / TICKS_PER_SECOND)
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
