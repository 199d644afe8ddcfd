//! A PostgreSQL primary and a hot standby of the test's own, streaming replication between them
//! over a link with a few milliseconds of lag (two zones, say), on free loopback ports in a
//! temporary directory: the setup a failover test kills and promotes. The machine's shared
//! PostgreSQL is never touched.
//!
//! Needs the server binaries under `/usr/lib/postgresql/<version>/bin`. Run as root, the tools
//! run as the `postgres` user (the server refuses to run as root).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use sqlx::Connection;

use super::link::Link;

/// The one-way lag between primary and standby: what an asynchronous standby can miss when the
/// primary dies. On one machine with no lag it would almost never miss anything.
const LAG: Duration = Duration::from_millis(5);

/// The name the standby streams under, which the primary's `synchronous_standby_names` waits for.
const STANDBY_NAME: &str = "standby";

/// How the primary commits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Replication {
    /// A commit returns once the standby has it too (`synchronous_standby_names`,
    /// `synchronous_commit = on`).
    Synchronous,
    /// A commit returns once the primary has it; the standby follows as fast as it can.
    Asynchronous,
}

/// One server of the pair.
pub(crate) struct Node {
    data: PathBuf,
    port: u16,
    /// Set once the node was killed: its pid file then names a process id the system may have
    /// given to someone else's process since.
    killed: AtomicBool,
}

impl Node {
    fn new(data: PathBuf, port: u16) -> Self {
        Self {
            data,
            port,
            killed: AtomicBool::new(false),
        }
    }

    pub(crate) fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    pub(crate) fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// The postmaster's process id, from its pid file, while one is there.
    fn postmaster(&self) -> Option<u32> {
        let pid_file = std::fs::read_to_string(self.data.join("postmaster.pid")).ok()?;
        pid_file.lines().next()?.trim().parse().ok()
    }

    /// SIGKILL to the postmaster and every process it started (backends, walsender, helpers),
    /// as on a machine that lost power, once; returns when they are gone. The postmaster's
    /// children each lead a process group of their own, so they are named one by one; and all
    /// are stopped first, so that none of them acts on another's death (a backend that sees
    /// the postmaster gone tells its client so).
    fn kill(&self) {
        if self.killed.swap(true, Ordering::SeqCst) {
            return;
        }
        let Some(postmaster) = self.postmaster() else {
            return;
        };
        // The postmaster is stopped before its children are listed, so it forks no more.
        signal("STOP", &[postmaster]);
        let mut pids = vec![postmaster];
        pids.extend(children(postmaster));
        signal("STOP", &pids);
        signal("KILL", &pids);
        // Until they are gone they may still hold files the cluster's directory removal needs.
        let started = Instant::now();
        while pids.iter().any(|&pid| running(pid)) && started.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

fn signal(signal: &str, pids: &[u32]) {
    let _ = std::process::Command::new("kill")
        .args(["-s", signal, "--"])
        .args(pids.iter().map(u32::to_string))
        .stderr(std::process::Stdio::null())
        .status();
}

/// Whether `pid` is a process that has not exited (a zombie has).
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X")
    })
}

/// The processes whose parent is `parent`, from `/proc`.
fn children(parent: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            // The fields after the command name, which may itself hold spaces and parentheses:
            // state, then the parent's pid.
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
                stat.rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok())
                    == Some(parent)
            })
        })
        .collect()
}

/// A primary and its standby. Dropping the cluster kills both and removes their files, also
/// when the test panics.
pub(crate) struct PgCluster {
    pub(crate) primary: Node,
    pub(crate) standby: Node,
    link: Link,
    // Declared last: dropped after the servers are dead.
    dir: tempfile::TempDir,
}

impl PgCluster {
    /// Initialises a primary, starts it, clones a standby from it with `pg_basebackup`, starts
    /// that, and returns once the primary sees the standby streaming (as its synchronous standby
    /// under [`Replication::Synchronous`]).
    pub(crate) async fn start(replication: Replication) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        if is_root() {
            let status = std::process::Command::new("chown")
                .args(["postgres:", &dir.path().display().to_string()])
                .status()
                .expect("chown");
            assert!(
                status.success(),
                "chown the cluster's directory to postgres"
            );
        }
        let primary_port = free_port();
        let cluster = Self {
            link: Link::start(SocketAddr::from(([127, 0, 0, 1], primary_port)), LAG).await,
            primary: Node::new(dir.path().join("primary"), primary_port),
            standby: Node::new(dir.path().join("standby"), free_port()),
            dir,
        };
        pg_tool(
            "initdb",
            &[
                "-D",
                &path(&cluster.primary.data),
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
                "-E",
                "UTF8",
            ],
        )
        .await;
        let mut primary_settings = vec![
            "-c wal_level=replica".to_owned(),
            "-c max_wal_senders=4".to_owned(),
        ];
        if replication == Replication::Synchronous {
            primary_settings.push(format!("-c synchronous_standby_names={STANDBY_NAME}"));
            primary_settings.push("-c synchronous_commit=on".to_owned());
        }
        cluster.run(&cluster.primary, &primary_settings).await;

        pg_tool(
            "pg_basebackup",
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &cluster.primary.port.to_string(),
                "-U",
                "postgres",
                "-D",
                &path(&cluster.standby.data),
                "-R",
                "-X",
                "stream",
                "-c",
                "fast",
                "--no-sync",
            ],
        )
        .await;
        // `-R` wrote a primary_conninfo and standby.signal; this later line wins: it streams
        // over the link, and names the standby as synchronous_standby_names expects it.
        let conninfo = format!(
            "\nprimary_conninfo = 'host=127.0.0.1 port={} user=postgres application_name={STANDBY_NAME}'\n",
            cluster.link.addr.port()
        );
        let auto_conf = cluster.standby.data.join("postgresql.auto.conf");
        let mut settings = std::fs::read_to_string(&auto_conf).expect("standby settings");
        settings.push_str(&conninfo);
        std::fs::write(&auto_conf, settings).expect("standby settings");
        cluster
            .run(&cluster.standby, &["-c hot_standby=on".to_owned()])
            .await;
        cluster.await_streaming(replication).await;
        cluster
    }

    /// Starts `node` on its port with the shared settings and `settings`.
    async fn run(&self, node: &Node, settings: &[String]) {
        // fsync stays off: the test kills processes, not the machine, so the page cache keeps
        // every write and the disk is spared.
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=60 {}",
            node.port,
            self.dir.path().display(),
            settings.join(" ")
        );
        let log = format!("{}.log", path(&node.data));
        pg_tool(
            "pg_ctl",
            &[
                "-D",
                &path(&node.data),
                "-l",
                &log,
                "-o",
                &options,
                "-w",
                "-t",
                "30",
                "start",
            ],
        )
        .await;
    }

    async fn await_streaming(&self, replication: Replication) {
        let wanted = match replication {
            Replication::Synchronous => "sync",
            Replication::Asynchronous => "async",
        };
        let mut primary = sqlx::PgConnection::connect(&self.primary.url())
            .await
            .expect("connect to the primary");
        let started = Instant::now();
        loop {
            let state: Option<String> = sqlx::query_scalar(
                "SELECT sync_state FROM pg_stat_replication \
                 WHERE application_name = $1 AND state = 'streaming'",
            )
            .bind(STANDBY_NAME)
            .fetch_optional(&mut primary)
            .await
            .expect("pg_stat_replication");
            if state.as_deref() == Some(wanted) {
                let _ = primary.close().await;
                return;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the standby is not streaming ({wanted}) after 30 s: {state:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Cuts the link to the standby, losing the WAL it still carried, kills every process of
    /// the primary with SIGKILL, and returns once the primary's port refuses. The standby
    /// misses the primary's last few milliseconds, as when a machine dies with its network.
    pub(crate) async fn kill_primary(&self) {
        self.link.cut();
        self.primary.kill();
        let started = Instant::now();
        while tokio::net::TcpStream::connect(self.primary.addr())
            .await
            .is_ok()
        {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "the killed primary still accepts connections"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Promotes the standby and returns once it accepts writes.
    pub(crate) async fn promote_standby(&self) {
        pg_tool(
            "pg_ctl",
            &["-D", &path(&self.standby.data), "-w", "-t", "30", "promote"],
        )
        .await;
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        self.primary.kill();
        self.standby.kill();
    }
}

fn path(path: &Path) -> String {
    path.display().to_string()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port()
}

fn is_root() -> bool {
    std::process::Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).trim() == "0")
}

/// Runs a PostgreSQL server tool of the newest installed version, as `postgres` when root.
async fn pg_tool(tool: &str, args: &[&str]) {
    let bin = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL server binaries under /usr/lib/postgresql")
        .filter_map(|entry| entry.ok().map(|e| e.path().join("bin")))
        .filter(|bin| bin.join(tool).exists())
        .max()
        .expect("a PostgreSQL version with its tools")
        .join(tool);
    let mut command = if is_root() {
        let mut command = tokio::process::Command::new("runuser");
        command.args(["-u", "postgres", "--"]).arg(bin);
        command
    } else {
        tokio::process::Command::new(bin)
    };
    let output = command
        .args(args)
        .output()
        .await
        .expect("run a PostgreSQL tool");
    assert!(
        output.status.success(),
        "{tool} {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}
