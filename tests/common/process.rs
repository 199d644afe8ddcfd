//! Examples run as real processes on loopback, and an HTTP client to talk to them.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

pub fn example(name: &str) -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"));
    let path = target.join("debug").join("examples").join(name);
    assert!(
        path.exists(),
        "{} is missing: build the examples first (`cargo test --all-features` does)",
        path.display()
    );
    path
}

/// A running example; killed with SIGKILL when dropped.
pub struct Process {
    child: Child,
    pub url: String,
    /// Every line it printed on stdout so far.
    pub output: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Process {
    pub async fn start(name: &str, env: &[(&str, &str)]) -> Self {
        let mut command = Command::new(example(name));
        command
            .env("BIND", "127.0.0.1:0")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        for (key, value) in env {
            command.env(key, value);
        }
        let mut child = command.spawn().unwrap();
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let url = tokio::time::timeout(Duration::from_secs(30), async {
            while let Some(line) = lines.next_line().await.unwrap() {
                if let Some(rest) = line.split("listening on ").nth(1) {
                    return rest.split_whitespace().next().unwrap().to_owned();
                }
            }
            panic!("{name} exited before listening");
        })
        .await
        .unwrap();
        // Keep draining stdout so the child never blocks on a full pipe.
        let output = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let kept = output.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                kept.lock().unwrap().push(line);
            }
        });
        Self { child, url, output }
    }

    /// The last line printed that contains `needle`, if any.
    pub fn last_line(&self, needle: &str) -> Option<String> {
        let output = self.output.lock().unwrap();
        output.iter().rev().find(|l| l.contains(needle)).cloned()
    }

    /// Waits (bounded) until a line containing `needle` is printed.
    pub async fn wait_for_line(&self, needle: &str, within: Duration) -> String {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Some(line) = self.last_line(needle) {
                return line;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no line with {needle:?} within {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn kill(mut self) {
        self.child.start_kill().unwrap();
        self.child.wait().await.unwrap();
    }

    /// Sends `signal` (e.g. `TERM`) through kill(1), so the suite needs no FFI crate.
    pub fn signal(&self, signal: &str) {
        let pid = self.child.id().expect("the process is still running");
        let status = std::process::Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .status()
            .expect("kill(1) runs");
        assert!(status.success(), "kill -{signal} {pid} failed");
    }

    /// Whether the process has exited (without waiting for it).
    pub fn has_exited(&mut self) -> bool {
        self.child.try_wait().expect("try_wait").is_some()
    }

    /// Waits at most `limit` for the process to exit, and returns how it did.
    pub async fn exit_status(mut self, limit: Duration) -> std::process::ExitStatus {
        tokio::time::timeout(limit, self.child.wait())
            .await
            .expect("the process exits in time")
            .expect("wait for the process")
    }
}

pub struct Http(Client<HttpConnector, Full<Bytes>>);

pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap()
    }
}

impl Http {
    pub fn new() -> Self {
        Self(Client::builder(TokioExecutor::new()).build_http())
    }

    /// Like [`call`](Self::call), but a transport failure is returned, not a panic.
    pub async fn try_call(&self, request: Request<Full<Bytes>>) -> Result<Answer, String> {
        let response = self
            .0
            .request(request)
            .await
            .map_err(|e| format!("{e:?}"))?;
        let status = response.status();
        let headers = response.headers().clone();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("{e:?}"))?
            .to_bytes();
        Ok(Answer {
            status,
            headers,
            body,
        })
    }

    pub async fn call(&self, request: Request<Full<Bytes>>) -> Answer {
        let response = self.0.request(request).await.unwrap();
        let status = response.status();
        let headers = response.headers().clone();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        Answer {
            status,
            headers,
            body,
        }
    }
}
