//! CPU time a database server spends, read from `/proc`: what a scenario costs the server per
//! request, beside what it costs the client.

use std::sync::Mutex;
use std::time::Duration;

// Shared with the chain bench, which also turns the machine's busy ticks into time.
#[allow(dead_code)]
#[path = "../common/proc_times.rs"]
mod proc_times;

/// User and system time of this process so far: the servers under test and the load generator,
/// alike for every scenario but for the work the scenario's own route does.
pub(crate) use proc_times::own as own_process;

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
        match self {
            Self::Postgres => {
                let backends = POSTGRES_BACKENDS
                    .lock()
                    .map(|pids| pids.clone())
                    .unwrap_or_default();
                proc_times::of_pids(&backends)
            }
            Self::MariaDb => proc_times::of_name("mariadbd"),
        }
    }
}
