//! A private three-node MariaDB Galera cluster on loopback, started from nothing for one test
//! binary and removed with it, also when the test panics.
//!
//! Each node gets a datadir of its own under a temporary folder, owned by the user `mysql`
//! (the rsync state transfer refuses to run as root), and its own client, group (gcomm),
//! incremental (IST) and snapshot (SST) ports, picked free so parallel tests never meet. Node 1
//! bootstraps the cluster; nodes 2 and 3 join it one after the other and receive its data by
//! rsync. The machine's own MariaDB is never touched.

use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sqlx::{Connection, MySqlConnection, Row};

/// Where Debian's `galera-4` package puts the provider.
const PROVIDER: &str = "/usr/lib/galera/libgalera_smm.so";

/// How long one node may take to join and reach `Synced`, state transfer included.
const JOIN_TIMEOUT: Duration = Duration::from_secs(90);

/// One node: its ports and, while it runs, its server process.
#[derive(Debug)]
pub(crate) struct Node {
    pub(crate) port: u16,
    dir: PathBuf,
    process: Option<Child>,
}

/// Three synced nodes, stopped and deleted on drop.
#[derive(Debug)]
pub(crate) struct Cluster {
    pub(crate) nodes: Vec<Node>,
    dir: tempfile::TempDir,
}

/// A loopback port nobody listens on now. The listener is dropped before the server binds it,
/// so another process could take it in between; each of the twelve is picked separately, and a
/// collision shows as a node that fails to start, never as a test talking to a stranger.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .expect("a free loopback port")
}

/// Runs a command to its end and panics with its output unless it succeeds.
fn run(command: &mut Command) {
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    assert!(
        output.status.success(),
        "{command:?} failed: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

impl Cluster {
    /// Starts three nodes and waits until each reports `Synced` in a cluster of three. Panics
    /// (failing the test, never skipping it) when a node cannot start, naming its error log.
    pub(crate) async fn start() -> Self {
        for tool in ["mariadbd", "mariadb-install-db", "rsync"] {
            let found = Command::new("sh")
                .args(["-c", &format!("command -v {tool}")])
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|status| status.success());
            assert!(found, "the Galera tests need `{tool}` on PATH");
        }
        assert!(
            Path::new(PROVIDER).exists(),
            "the Galera tests need the galera-4 provider at {PROVIDER}"
        );
        let dir = tempfile::Builder::new()
            .prefix("axum-idempotency-galera-")
            .tempdir()
            .expect("temporary folder");
        run(Command::new("chmod").arg("a+rx").arg(dir.path()));
        let ports: Vec<[u16; 4]> = (0..3)
            .map(|_| [free_port(), free_port(), free_port(), free_port()])
            .collect();
        let members = ports
            .iter()
            .map(|[_, gcomm, _, _]| format!("127.0.0.1:{gcomm}"))
            .collect::<Vec<_>>()
            .join(",");
        let mut cluster = Self {
            nodes: Vec::new(),
            dir,
        };
        for (i, [port, gcomm, ist, sst]) in ports.into_iter().enumerate() {
            let node_dir = cluster.dir.path().join(format!("n{}", i + 1));
            std::fs::create_dir_all(node_dir.join("data")).expect("datadir");
            let config = format!(
                "[mysqld]
datadir={dir}/data
socket={dir}/sock
port={port}
bind-address=127.0.0.1
pid-file={dir}/pid
log-error={dir}/err.log
user=mysql
binlog_format=ROW
default_storage_engine=InnoDB
innodb_autoinc_lock_mode=2
innodb_buffer_pool_size=64M
innodb_log_file_size=16M
wsrep_on=ON
wsrep_provider={PROVIDER}
wsrep_cluster_name=axum_idempotency_test
wsrep_node_address=127.0.0.1:{gcomm}
wsrep_provider_options=\"gmcast.listen_addr=tcp://127.0.0.1:{gcomm};ist.recv_addr=127.0.0.1:{ist}\"
wsrep_sst_receive_address=127.0.0.1:{sst}
wsrep_sst_method=rsync
wsrep_cluster_address=gcomm://{members}
",
                dir = node_dir.display(),
            );
            std::fs::write(node_dir.join("my.cnf"), config).expect("my.cnf");
            run(Command::new("chown")
                .args(["-R", "mysql:mysql"])
                .arg(&node_dir));
            cluster.nodes.push(Node {
                port,
                dir: node_dir,
                process: None,
            });
        }
        // Only the first node needs a system database of its own: the others receive the
        // first one's by state transfer.
        let first = &cluster.nodes[0].dir;
        run(Command::new("mariadb-install-db")
            .arg(format!(
                "--defaults-file={}",
                first.join("my.cnf").display()
            ))
            .args(["--user=mysql", "--auth-root-authentication-method=normal"]));
        for i in 0..3 {
            cluster.launch(i, i == 0);
            cluster.wait_synced(i, i as i64 + 1).await;
        }
        cluster
    }

    /// Starts node `i`'s server, in a process group of its own so that the state transfer's
    /// helpers go with it.
    fn launch(&mut self, i: usize, bootstrap: bool) {
        let node = &mut self.nodes[i];
        let mut command = Command::new("mariadbd");
        command
            .arg(format!(
                "--defaults-file={}",
                node.dir.join("my.cnf").display()
            ))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0);
        if bootstrap {
            command.arg("--wsrep-new-cluster");
        }
        node.process = Some(command.spawn().expect("start mariadbd"));
    }

    /// Waits until node `i` is `Synced` and sees at least `size` members.
    async fn wait_synced(&mut self, i: usize, size: i64) {
        let started = Instant::now();
        loop {
            if let Some(status) = self.nodes[i]
                .process
                .as_mut()
                .and_then(|p| p.try_wait().ok())
                && let Some(status) = status
            {
                panic!(
                    "Galera node {} exited ({status}) while starting; its log:\n{}",
                    i + 1,
                    self.log_tail(i)
                );
            }
            if let Some((state, members)) = self.wsrep_state(i).await
                && state == "Synced"
                && members >= size
            {
                return;
            }
            assert!(
                started.elapsed() < JOIN_TIMEOUT,
                "Galera node {} did not sync within {JOIN_TIMEOUT:?}; its log:\n{}",
                i + 1,
                self.log_tail(i)
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Node `i`'s `wsrep_local_state_comment` and `wsrep_cluster_size`, if it answers.
    pub(crate) async fn wsrep_state(&self, i: usize) -> Option<(String, i64)> {
        let mut conn = MySqlConnection::connect(&self.url(i, "mysql")).await.ok()?;
        let rows = sqlx::query(
            "SHOW STATUS WHERE Variable_name IN ('wsrep_local_state_comment', 'wsrep_cluster_size')",
        )
        .fetch_all(&mut conn)
        .await
        .ok()?;
        let _ = conn.close().await;
        let value = |name: &str| {
            rows.iter()
                .find(|row| row.try_get::<String, _>(0).is_ok_and(|n| n == name))
                .and_then(|row| row.try_get::<String, _>(1).ok())
        };
        Some((
            value("wsrep_local_state_comment")?,
            value("wsrep_cluster_size")?.parse().ok()?,
        ))
    }

    /// A URL for `database` on node `i`.
    pub(crate) fn url(&self, i: usize, database: &str) -> String {
        format!("mysql://root@127.0.0.1:{}/{database}", self.nodes[i].port)
    }

    /// The last lines of node `i`'s error log.
    pub(crate) fn log_tail(&self, i: usize) -> String {
        let log = std::fs::read_to_string(self.nodes[i].dir.join("err.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// Kills node `i`'s server with SIGKILL, as a crash or the kernel's OOM killer would.
    pub(crate) fn kill(&mut self, i: usize) {
        if let Some(mut process) = self.nodes[i].process.take() {
            let _ = process.kill();
            let _ = process.wait();
        }
    }
}

impl Drop for Cluster {
    // The servers go first, with their state transfer helpers (their process groups), so the
    // temporary folder is not in use when it is deleted.
    fn drop(&mut self) {
        for node in &mut self.nodes {
            if let Some(mut process) = node.process.take() {
                let _ = Command::new("kill")
                    .args(["-KILL", "--", &format!("-{}", process.id())])
                    .stderr(Stdio::null())
                    .status();
                let _ = process.kill();
                let _ = process.wait();
            }
        }
    }
}
