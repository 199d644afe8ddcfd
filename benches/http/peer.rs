//! The peer crate, axum-idempotent, served by `benches/peer` in a child process: built,
//! started on this run's PostgreSQL schema, given one session per connection, and stopped.

use std::net::SocketAddr;
use std::sync::Arc;

#[cfg(feature = "postgres")]
use axum::body::Bytes;
use axum::http::HeaderValue;
#[cfg(feature = "postgres")]
use axum::http::{Request, header};
#[cfg(feature = "postgres")]
use http_body_util::{BodyExt, Full};
use tokio::runtime::Runtime;

#[cfg(feature = "postgres")]
use crate::BoxError;
#[cfg(feature = "postgres")]
use crate::load::connect;
use crate::settings::Settings;

/// The running peer server; dropping it stops the process.
pub(crate) struct Peer {
    child: std::process::Child,
    pub(crate) addr: SocketAddr,
    /// What the peer says about its store and keying.
    pub(crate) store: String,
    /// One session per load-generator connection: axum-idempotent caches only within a session.
    pub(crate) cookies: Arc<[HeaderValue]>,
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The peer server, or why this run goes without it.
pub(crate) fn peer_or_reason(
    settings: &Settings,
    client: &Runtime,
    run: &str,
    postgres_used: bool,
) -> Result<Peer, String> {
    if !settings.peer {
        return Err("BENCH_PEER=false".into());
    }
    if !postgres_used {
        return Err("it runs on PostgreSQL and the postgres backend is not in this run".into());
    }
    #[cfg(feature = "postgres")]
    return start_peer(settings, client, run);
    #[cfg(not(feature = "postgres"))]
    {
        let _ = (client, run);
        Err("this build lacks the `postgres` feature".into())
    }
}

/// Builds and starts the peer on the PostgreSQL schema of this run. The error is the reason to
/// print when it cannot run.
#[cfg(feature = "postgres")]
fn start_peer(settings: &Settings, client: &Runtime, run: &str) -> Result<Peer, String> {
    use std::io::BufRead;
    use std::process::{Command, Stdio};

    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let target = root.join("target").join("peer");
    // Its own target dir: the one of this bench may still be locked by the cargo running it.
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    eprintln!("[peer] building benches/peer (axum-idempotent)…");
    let built = Command::new(&cargo)
        .args(["build", "--release", "--quiet", "--manifest-path"])
        .arg(root.join("benches/peer/Cargo.toml"))
        .arg("--target-dir")
        .arg(&target)
        .stdout(Stdio::null())
        .status()
        .map_err(|e| format!("cannot run {cargo}: {e}"))?;
    if !built.success() {
        return Err(format!("`cargo build` of benches/peer failed ({built})"));
    }
    let mut child = Command::new(target.join("release/axum-idempotency-bench-peer"))
        .env("PEER_DATABASE_URL", &settings.database_url)
        .env("PEER_SCHEMA", format!("bench_http_{run}"))
        .env("PEER_STORE", &settings.peer_store)
        .env("PEER_REDIS_URL", &settings.peer_redis)
        .env("PEER_KEYING", &settings.peer_keying)
        .env(
            "PEER_TEST_BEFORE_ACQUIRE",
            settings.test_before_acquire.to_string(),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start the peer binary: {e}"))?;
    let mut line = String::new();
    if let Some(stdout) = child.stdout.take() {
        let _ = std::io::BufReader::new(stdout).read_line(&mut line);
    }
    let started = line
        .trim()
        .strip_prefix("listening ")
        .and_then(|rest| rest.split_once(' '))
        .and_then(|(addr, store)| Some((addr.parse::<SocketAddr>().ok()?, store.to_owned())));
    let Some((addr, store)) = started else {
        let _ = child.kill();
        let _ = child.wait();
        let why = line
            .trim()
            .strip_prefix("unavailable ")
            .unwrap_or(line.trim());
        return Err(format!("the peer did not start: {why}"));
    };
    let mut peer = Peer {
        child,
        addr,
        store,
        cookies: Arc::from([]),
    };
    let cookies = client
        .block_on(peer_sessions(addr, settings.conns.max(1)))
        .map_err(|e| format!("the peer could not start sessions: {e}"))?;
    peer.cookies = cookies.into();
    Ok(peer)
}

/// Starts `n` sessions on the peer and returns their `Cookie` header values.
#[cfg(feature = "postgres")]
async fn peer_sessions(addr: SocketAddr, n: usize) -> Result<Vec<HeaderValue>, BoxError> {
    let mut sender = connect(addr).await?;
    let mut cookies = Vec::with_capacity(n);
    for _ in 0..n {
        let request = Request::post("/session")
            .header(header::HOST, "127.0.0.1")
            .body(Full::new(Bytes::new()))?;
        sender.ready().await?;
        let response = sender.send_request(request).await?;
        let status = response.status();
        let cookie = response
            .headers()
            .get(header::SET_COOKIE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .map(HeaderValue::from_str)
            .transpose()?;
        let body = response.into_body().collect().await?.to_bytes();
        match cookie {
            Some(cookie) if status.is_success() => cookies.push(cookie),
            _ => {
                return Err(
                    format!("POST /session: {status} {}", String::from_utf8_lossy(&body)).into(),
                );
            }
        }
    }
    Ok(cookies)
}
