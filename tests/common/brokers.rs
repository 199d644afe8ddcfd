//! Private brokers that a test may stop and start again: a `nats-server` with JetStream and a
//! RabbitMQ node of its own, each on free loopback ports with its data in a temporary
//! directory that outlives a restart. The machine's shared brokers (4222, 5672) are never
//! touched. Dropping one stops it and deletes its data.

use std::net::TcpListener;
use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio::process::{Child, Command};

/// A free loopback port (the kernel's pick; free again once the probe is dropped).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free loopback port")
        .port()
}

/// Sends `signal` to `pid` through kill(1), so the suite needs no FFI crate.
fn signal(pid: u32, signal: &str) {
    let _ = std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status();
}

/// Sends `signal` to every process of the group `group` (the script and the VM it starts).
fn signal_group(group: u32, signal: &str) {
    let _ = std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg("--")
        .arg(format!("-{group}"))
        .stderr(Stdio::null())
        .status();
}

/// Whether any process of the group `group` is still running.
fn group_alive(group: u32) -> bool {
    std::process::Command::new("kill")
        .args(["-0", "--"])
        .arg(format!("-{group}"))
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// Waits until `port` accepts TCP connections, at most `within`.
async fn wait_listening(port: u16, within: Duration, what: &str) {
    let deadline = Instant::now() + within;
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        assert!(
            Instant::now() < deadline,
            "{what} did not listen on {port} within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A private `nats-server -js` on a free port; its JetStream store survives [`stop`](Self::stop).
pub struct PrivateNats {
    port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl PrivateNats {
    pub async fn start() -> Self {
        let mut nats = Self {
            port: free_port(),
            dir: tempfile::tempdir().expect("a temporary directory"),
            child: None,
        };
        nats.start_again().await;
        nats
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Starts the server (again) on the same port and store; returns once it accepts clients.
    pub async fn start_again(&mut self) {
        assert!(self.child.is_none(), "the NATS server is already running");
        let child = Command::new("/usr/sbin/nats-server")
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("nats-server at /usr/sbin/nats-server");
        self.child = Some(child);
        wait_listening(self.port, Duration::from_secs(20), "nats-server").await;
        // JetStream answers only once it has recovered its streams from the store.
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(client) = async_nats::connect(self.url()).await {
                // Any answer of the JetStream API (raw: this server may predate the
                // client's account type) means it is up.
                let info = client.request("$JS.API.INFO", bytes::Bytes::new()).await;
                if info.is_ok_and(|reply| reply.payload.starts_with(b"{")) {
                    return;
                }
            }
            assert!(Instant::now() < deadline, "JetStream did not come up");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Stops the server as an operator would (SIGTERM, then waits for it to exit).
    pub async fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            if let Some(pid) = child.id() {
                signal(pid, "TERM");
            }
            if tokio::time::timeout(Duration::from_secs(15), child.wait())
                .await
                .is_err()
            {
                let _ = child.kill().await;
            }
        }
    }
}

/// A private RabbitMQ node (its own node name, ports, Mnesia directory, no plugins); its
/// durable queues and exchanges survive [`stop`](Self::stop).
pub struct PrivateRabbitMq {
    node: String,
    port: u16,
    dist_port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
    /// The process group of the running node: the script, the Erlang VM and its helpers.
    group: Option<u32>,
}

/// The server script itself, not the wrapper in /usr/sbin that switches to the `rabbitmq`
/// user: the node runs as the test's user, with its files in the test's directory.
const RABBITMQ_SERVER: &str = "/usr/lib/rabbitmq/bin/rabbitmq-server";

impl PrivateRabbitMq {
    pub async fn start() -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let node = format!(
            "axum_idem_test_{}_{}@localhost",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        let dir = tempfile::tempdir().expect("a temporary directory");
        let port = free_port();
        let mut dist_port = free_port();
        while dist_port == port || dist_port == 25672 {
            dist_port = free_port();
        }
        let config = format!("listeners.tcp.1 = 127.0.0.1:{port}\n");
        std::fs::write(dir.path().join("rabbitmq.conf"), config).expect("write rabbitmq.conf");
        std::fs::write(dir.path().join("enabled_plugins"), "[].\n").expect("write plugins");
        std::fs::write(dir.path().join("rabbitmq-env.conf"), "").expect("write env");
        let mut rabbit = Self {
            node,
            port,
            dist_port,
            dir,
            child: None,
            group: None,
        };
        rabbit.start_again().await;
        rabbit
    }

    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }

    /// Starts the node (again) with the same name, ports and Mnesia directory; returns once
    /// it accepts AMQP connections.
    pub async fn start_again(&mut self) {
        assert!(self.child.is_none(), "the RabbitMQ node is already running");
        let dir: &Path = self.dir.path();
        let child = Command::new(RABBITMQ_SERVER)
            // The cookie Erlang makes for the node lands here, not in the user's home.
            .env("HOME", dir)
            // Not the machine's /etc/rabbitmq/rabbitmq-env.conf, which names the shared node.
            .env("RABBITMQ_CONF_ENV_FILE", self.path("rabbitmq-env.conf"))
            .env("RABBITMQ_CONFIG_FILE", self.path("rabbitmq.conf"))
            .env(
                "RABBITMQ_ENABLED_PLUGINS_FILE",
                self.path("enabled_plugins"),
            )
            .env("RABBITMQ_NODENAME", &self.node)
            .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("RABBITMQ_MNESIA_BASE", self.path("mnesia"))
            .env("RABBITMQ_LOG_BASE", self.path("log"))
            .env("RABBITMQ_PID_FILE", self.path("pid"))
            .env("ERL_EPMD_ADDRESS", "127.0.0.1")
            .env(
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS",
                "-kernel inet_dist_use_interface {127,0,0,1}",
            )
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            // A group of its own, so that stopping it reaches the VM the script starts.
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .expect("rabbitmq-server");
        self.group = child.id();
        self.child = Some(child);
        wait_listening(self.port, Duration::from_secs(60), "RabbitMQ").await;
        // The listener opens last in the boot; an AMQP handshake proves the node serves.
        let deadline = Instant::now() + Duration::from_secs(30);
        while lapin::Connection::connect(&self.url(), Default::default())
            .await
            .is_err()
        {
            assert!(Instant::now() < deadline, "RabbitMQ did not accept AMQP");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Stops the node as an operator would (SIGTERM: the VM shuts down cleanly and closes
    /// its connections), and waits for all of it to exit.
    pub async fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if let Some(group) = self.group.take() {
            signal_group(group, "TERM");
            let deadline = Instant::now() + Duration::from_secs(30);
            // Reaping the script as it exits: a zombie still counts as a member of its group.
            while (child.try_wait().is_ok_and(|exited| exited.is_none()) || group_alive(group))
                && Instant::now() < deadline
            {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            signal_group(group, "KILL");
        }
        let _ = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
    }
}

impl Drop for PrivateRabbitMq {
    fn drop(&mut self) {
        // The VM is the script's child: killing the script alone would leave the node running.
        if let Some(group) = self.group {
            signal_group(group, "KILL");
        }
    }
}

/// The dead letters waiting under the namespace `ns` (`BROKER_NAMESPACE`) on the broker at
/// `url`: the orders example's dead-letter queue (RabbitMQ) or stream (NATS); none when it was
/// never declared.
pub async fn dead_letters(url: &str, ns: &str) -> u64 {
    if url.starts_with("amqp") {
        use lapin::options::QueueDeclareOptions;
        let connection = lapin::Connection::connect(url, Default::default())
            .await
            .expect("RabbitMQ is reachable");
        let channel = connection.create_channel().await.expect("a channel");
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let queue = format!("{ns}.orders.payment-succeeded.dead");
        let declared = channel
            .queue_declare(queue.into(), passive, Default::default())
            .await;
        let _ = connection.close(200, "counted".into()).await;
        declared.map_or(0, |queue| u64::from(queue.message_count()))
    } else {
        let client = async_nats::connect(url).await.expect("NATS is reachable");
        let js = async_nats::jetstream::new(client);
        let stream = format!("{}_ORDERS_DEAD", ns.to_uppercase());
        match js.get_stream(stream).await {
            Ok(mut stream) => stream.info().await.map_or(0, |info| info.state.messages),
            Err(_) => 0,
        }
    }
}

/// Deletes what the chain's examples declared under the namespace `ns` on the shared broker
/// at `url`: RabbitMQ's exchange and queues, or NATS's streams.
pub async fn delete_namespace(url: &str, ns: &str) {
    if url.starts_with("amqp") {
        use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
        let connection = lapin::Connection::connect(url, Default::default())
            .await
            .expect("RabbitMQ is reachable");
        let channel = connection.create_channel().await.expect("a channel");
        let queue = format!("{ns}.orders.payment-succeeded");
        for queue in [
            queue.clone(),
            format!("{queue}.retry"),
            format!("{queue}.dead"),
        ] {
            let _ = channel
                .queue_delete(queue.into(), QueueDeleteOptions::default())
                .await;
        }
        let exchange = format!("{ns}.payments");
        let _ = channel
            .exchange_delete(exchange.into(), ExchangeDeleteOptions::default())
            .await;
        let _ = connection.close(200, "cleaned up".into()).await;
    } else {
        let client = async_nats::connect(url).await.expect("NATS is reachable");
        let js = async_nats::jetstream::new(client);
        for stream in ["PAYMENTS", "ORDERS_DEAD"] {
            let _ = js
                .delete_stream(format!("{}_{stream}", ns.to_uppercase()))
                .await;
        }
    }
}
