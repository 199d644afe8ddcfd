//! The load generator: a hyper client that drives a server with concurrent connections, storms
//! it with duplicates, or counts the database work of sequential requests.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::{HeaderValue, Request, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::sync::Barrier;

use crate::BoxError;
use crate::counting::{COUNTING, STATEMENTS};
use crate::order::ORDER_BODY;
use crate::proxy::Wire;

/// The connections of a duplicate storm, all sending the same key at once.
pub(crate) const STORM: usize = 64;

#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Keys {
    /// No `Idempotency-Key` header.
    None,
    /// A key never sent before on every request.
    Fresh,
    /// One key for the whole scenario, so every request after the first replays.
    Fixed,
}

#[derive(Clone)]
pub(crate) struct Plan {
    pub(crate) addr: SocketAddr,
    pub(crate) path: &'static str,
    pub(crate) body: Bytes,
    pub(crate) keys: Keys,
    pub(crate) key_prefix: String,
    pub(crate) conns: usize,
    pub(crate) duration: Duration,
    /// Stop after this many requests in total (the soak run).
    pub(crate) limit: Option<u64>,
    pub(crate) record_latency: bool,
    /// Session cookies, one per client: connection `i` sends cookie `i % len`; none if empty.
    pub(crate) cookies: Arc<[HeaderValue]>,
    /// Stop once this is set, before `duration` is up (the load that runs alongside a purge).
    pub(crate) stop: Option<Arc<AtomicBool>>,
}

#[derive(Default)]
pub(crate) struct Sample {
    pub(crate) requests: u64,
    pub(crate) unexpected: u64,
    pub(crate) elapsed: Duration,
    latencies_us: Vec<u32>,
    pub(crate) peak_mib: f64,
    /// CPU time the database server spent on the sample's requests, where it was measured.
    pub(crate) server_cpu: Option<Duration>,
    /// CPU time this process (app servers and load generator) spent on them.
    pub(crate) app_cpu: Duration,
}

impl Sample {
    pub(crate) fn merge(&mut self, other: Sample) {
        self.requests += other.requests;
        self.unexpected += other.unexpected;
        self.elapsed += other.elapsed;
        self.latencies_us.extend(other.latencies_us);
        self.peak_mib = self.peak_mib.max(other.peak_mib);
        self.app_cpu += other.app_cpu;
        self.server_cpu = match (self.server_cpu, other.server_cpu) {
            (Some(a), Some(b)) => Some(a + b),
            (a, b) => a.or(b),
        };
    }

    /// This process's CPU time per request, in milliseconds.
    pub(crate) fn app_cpu_ms(&self) -> f64 {
        self.app_cpu.as_secs_f64() * 1000.0 / self.requests.max(1) as f64
    }

    /// The database server's CPU time per request, in milliseconds, where it was measured.
    pub(crate) fn server_cpu_ms(&self) -> Option<f64> {
        self.server_cpu
            .map(|cpu| cpu.as_secs_f64() * 1000.0 / self.requests.max(1) as f64)
    }

    pub(crate) fn rps(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    pub(crate) fn percentile_ms(&mut self, q: f64) -> f64 {
        if self.latencies_us.is_empty() {
            return 0.0;
        }
        self.latencies_us.sort_unstable();
        let i = ((self.latencies_us.len() as f64 * q) as usize).min(self.latencies_us.len() - 1);
        f64::from(self.latencies_us[i]) / 1000.0
    }

    pub(crate) fn max_ms(&self) -> f64 {
        f64::from(self.latencies_us.iter().copied().max().unwrap_or(0)) / 1000.0
    }

    /// Requests, throughput and tail latency in a line.
    pub(crate) fn summary(&mut self) -> String {
        let p99 = self.percentile_ms(0.99);
        format!(
            "{} requests in {:.1} s, {:.0} req/s, p99 {p99:.2} ms, max {:.2} ms, {} non-2xx",
            self.requests,
            self.elapsed.as_secs_f64(),
            self.rps(),
            self.max_ms(),
            self.unexpected
        )
    }

    /// Requests that took longer than `limit`.
    pub(crate) fn over(&self, limit: Duration) -> usize {
        let limit = u32::try_from(limit.as_micros()).unwrap_or(u32::MAX);
        self.latencies_us.iter().filter(|&&us| us > limit).count()
    }
}

type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

pub(crate) async fn connect(addr: SocketAddr) -> Result<Sender, BoxError> {
    let stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    Ok(sender)
}

async fn send(
    sender: &mut Sender,
    path: &str,
    body: &Bytes,
    key: Option<&str>,
    cookie: Option<&HeaderValue>,
) -> Result<StatusCode, BoxError> {
    let mut request = Request::post(path)
        .header(header::HOST, "127.0.0.1")
        .header(header::CONTENT_TYPE, "application/json");
    if let Some(key) = key {
        request = request.header("idempotency-key", HeaderValue::from_str(key)?);
    }
    if let Some(cookie) = cookie {
        request = request.header(header::COOKIE, cookie);
    }
    let request = request.body(Full::new(body.clone()))?;
    sender.ready().await?;
    let response = sender.send_request(request).await?;
    let status = response.status();
    response.into_body().collect().await?;
    Ok(status)
}

/// Runs `plan.conns` connections, each sending requests back to back until the time is up.
pub(crate) async fn drive(
    plan: &Plan,
    progress: Option<Arc<AtomicU64>>,
) -> Result<Sample, BoxError> {
    let started = Instant::now();
    let deadline = started + plan.duration;
    let total = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::with_capacity(plan.conns);
    for worker in 0..plan.conns {
        let plan = plan.clone();
        let total = Arc::clone(&total);
        let progress = progress.clone();
        workers.push(tokio::spawn(async move {
            let mut sender = connect(plan.addr).await?;
            let mut sample = Sample::default();
            let cookie = plan
                .cookies
                .get(worker % plan.cookies.len().max(1))
                .cloned();
            let fixed = format!("{}-fixed", plan.key_prefix);
            let mut seq = 0_u64;
            let stopped = || {
                plan.stop
                    .as_ref()
                    .is_some_and(|s| s.load(Ordering::Relaxed))
            };
            while Instant::now() < deadline && !stopped() {
                if let Some(limit) = plan.limit
                    && total.fetch_add(1, Ordering::Relaxed) >= limit
                {
                    break;
                }
                let key = match plan.keys {
                    Keys::None => None,
                    Keys::Fresh => Some(format!("{}-{worker}-{seq}", plan.key_prefix)),
                    Keys::Fixed => Some(fixed.clone()),
                };
                seq += 1;
                let sent = Instant::now();
                let status = send(
                    &mut sender,
                    plan.path,
                    &plan.body,
                    key.as_deref(),
                    cookie.as_ref(),
                )
                .await?;
                if plan.record_latency {
                    sample
                        .latencies_us
                        .push(u32::try_from(sent.elapsed().as_micros()).unwrap_or(u32::MAX));
                }
                sample.requests += 1;
                if !status.is_success() {
                    sample.unexpected += 1;
                }
                if let Some(progress) = &progress {
                    progress.fetch_add(1, Ordering::Relaxed);
                }
            }
            Ok::<_, BoxError>(sample)
        }));
    }
    let mut merged = Sample::default();
    for worker in workers {
        merged.merge(worker.await??);
    }
    merged.elapsed = started.elapsed();
    Ok(merged)
}

/// `STORM` connections send the same fresh key at the same moment, round after round. They are
/// one client retrying, so they share the plan's first session cookie.
pub(crate) async fn storm(plan: &Plan) -> Result<(Sample, u64), BoxError> {
    const STOP: u64 = u64::MAX;
    let start = Arc::new(Barrier::new(STORM + 1));
    let done = Arc::new(Barrier::new(STORM + 1));
    let round = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::with_capacity(STORM);
    for _ in 0..STORM {
        let (plan, start, done, round) = (
            plan.clone(),
            Arc::clone(&start),
            Arc::clone(&done),
            Arc::clone(&round),
        );
        workers.push(tokio::spawn(async move {
            let mut sender = connect(plan.addr).await;
            let mut sample = Sample::default();
            loop {
                start.wait().await;
                let r = round.load(Ordering::SeqCst);
                if r == STOP {
                    break;
                }
                // A failed connection still takes part in the barriers, or the storm hangs.
                if let Ok(sender) = sender.as_mut() {
                    let key = format!("{}-storm-{r}", plan.key_prefix);
                    let sent = Instant::now();
                    let cookie = plan.cookies.first();
                    match send(sender, plan.path, &plan.body, Some(&key), cookie).await {
                        Ok(status) if status.is_success() => {}
                        _ => sample.unexpected += 1,
                    }
                    sample
                        .latencies_us
                        .push(u32::try_from(sent.elapsed().as_micros()).unwrap_or(u32::MAX));
                    sample.requests += 1;
                }
                done.wait().await;
            }
            let _ = sender?;
            Ok::<_, BoxError>(sample)
        }));
    }
    let started = Instant::now();
    let mut rounds = 0_u64;
    loop {
        let stop = started.elapsed() >= plan.duration;
        round.store(if stop { STOP } else { rounds }, Ordering::SeqCst);
        start.wait().await;
        if stop {
            break;
        }
        done.wait().await;
        rounds += 1;
    }
    let mut merged = Sample::default();
    for worker in workers {
        merged.merge(worker.await??);
    }
    merged.elapsed = started.elapsed();
    Ok((merged, rounds))
}

/// Statements, and wire round trips and pings per request, over `n` sequential requests on one
/// connection.
pub(crate) async fn count_per_request(
    addr: SocketAddr,
    path: &'static str,
    keys: Keys,
    prefix: &str,
    n: usize,
    wire: Option<&Wire>,
) -> Result<(f64, Option<(f64, f64)>), BoxError> {
    let body = Bytes::from_static(ORDER_BODY.as_bytes());
    let mut sender = connect(addr).await?;
    let key = |i: usize| match keys {
        Keys::None => None,
        Keys::Fresh => Some(format!("{prefix}-{i}")),
        Keys::Fixed => Some(format!("{prefix}-fixed")),
    };
    // Warm up: connections opened, statements prepared, the replayed record written.
    for i in 0..20 {
        send(&mut sender, path, &body, key(i).as_deref(), None).await?;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    STATEMENTS.store(0, Ordering::SeqCst);
    if let Some(wire) = wire {
        wire.trips.store(0, Ordering::SeqCst);
        wire.pings.store(0, Ordering::SeqCst);
    }
    COUNTING.store(true, Ordering::SeqCst);
    for i in 20..20 + n {
        let status = send(&mut sender, path, &body, key(i).as_deref(), None).await?;
        if !status.is_success() {
            return Err(format!("{path}: {status} while counting").into());
        }
    }
    // The pool tests a connection as it takes it back, after the response: wait for that too.
    tokio::time::sleep(Duration::from_millis(300)).await;
    COUNTING.store(false, Ordering::SeqCst);
    let statements = STATEMENTS.load(Ordering::SeqCst) as f64 / n as f64;
    let per_request = |counter: &AtomicU64| counter.load(Ordering::SeqCst) as f64 / n as f64;
    let trips = wire.map(|w| (per_request(&w.trips), per_request(&w.pings)));
    Ok((statements, trips))
}

pub(crate) fn json_body(len: usize) -> Bytes {
    let head = r#"{"customer":"c-42","items":[{"sku":"widget","qty":3},{"sku":"gadget","qty":1}],"sku":"widget","qty":3,"note":""#;
    let tail = "\"}";
    let pad = len.saturating_sub(head.len() + tail.len());
    let mut body = String::with_capacity(len);
    body.push_str(head);
    body.extend(std::iter::repeat_n('x', pad));
    body.push_str(tail);
    Bytes::from(body)
}
