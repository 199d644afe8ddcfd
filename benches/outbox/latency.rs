//! Commit → delivered: how long a message waits between the commit of the request that
//! enqueued it and the broker's confirmation, with the dispatcher woken by that commit alone.
//!
//! Requests go through the idempotency layer (`tower::ServiceExt::oneshot` on the router, no
//! socket), each keyed, its handler enqueuing one message on its `Tx`; nothing in the bench
//! wakes the dispatcher. First the producers' top rate: `OUTBOX_BENCH_PRODUCERS` tasks send as
//! many requests as they can, no dispatcher running. Then one dispatcher with the user's
//! defaults runs while requests are started at half that rate, at even intervals, whatever the
//! previous ones are doing. A message's latency runs from the moment its request's answer is
//! back (the commit, the wake and the answer's way out behind it: microseconds after the
//! commit) to the moment the sender returns the broker's confirmation for it.

// The measurement runs on PostgreSQL only: built without it, only the report's part is used.
#![cfg_attr(not(feature = "postgres"), allow(dead_code))]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum_idempotency::outbox::{Dispatcher, Message, Outbox};
use axum_idempotency::{IdempotencyLayer, Store as Records, Tx};
use sqlx::Pool;
use tokio::sync::oneshot;
use tower::ServiceExt;

use crate::broker::{Acks, Broker};
use crate::store::Store;
use crate::{Settings, TOPIC, key, payload};

/// The targets the figures are held to.
pub(crate) const P50_TARGET: Duration = Duration::from_millis(5);
pub(crate) const P99_TARGET: Duration = Duration::from_millis(50);

/// One store and broker's latencies.
pub(crate) struct Latency {
    pub(crate) store: &'static str,
    pub(crate) broker: &'static str,
    /// The producers' top rate through the layer, no dispatcher running (msg/s).
    pub(crate) top: f64,
    /// The rate requests were started at during the measurement (msg/s).
    pub(crate) paced: f64,
    /// Every message's commit → delivered, sorted.
    pub(crate) latencies: Vec<Duration>,
    /// Its first part, commit → the sender called (the wake, the claim, a free send slot),
    /// sorted; the rest is the broker's round trip.
    pub(crate) to_send: Vec<Duration>,
    /// Its last part, the sender called → the broker's confirmation, sorted.
    pub(crate) in_send: Vec<Duration>,
    /// The machine's 1-minute load average before and after the measurement.
    pub(crate) load: (String, String),
    /// How late a 1 ms timer of this process fired during the measurement, sorted: how long
    /// a ready task waited for a CPU.
    pub(crate) lag: Vec<Duration>,
    pub(crate) errors: Vec<String>,
}

impl Latency {
    /// The `q` quantile (nearest rank) of the latencies.
    pub(crate) fn quantile(&self, q: f64) -> Option<Duration> {
        quantile(&self.latencies, q)
    }
}

/// The `q` quantile (nearest rank) of `sorted`.
pub(crate) fn quantile(sorted: &[Duration], q: f64) -> Option<Duration> {
    let last = sorted.len().checked_sub(1)?;
    let rank = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, last + 1);
    Some(sorted[rank - 1])
}

/// The 1-minute load average, as the kernel reports it.
fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".to_owned())
}

struct App<DB: Store> {
    outbox: Outbox<DB>,
    run: Arc<str>,
    payload: usize,
}

// By hand: a derive would ask the database type to be `Clone` too.
impl<DB: Store> Clone for App<DB> {
    fn clone(&self) -> Self {
        Self {
            outbox: self.outbox.clone(),
            run: self.run.clone(),
            payload: self.payload,
        }
    }
}

/// The handler: one message, on the request's `Tx`, and nothing else.
async fn enqueue<DB: Store>(
    State(app): State<App<DB>>,
    Path(n): Path<usize>,
    mut tx: Tx<DB>,
) -> StatusCode {
    let message = Message::new(TOPIC, key(&app.run, n), payload(n, app.payload));
    match app.outbox.enqueue(&mut tx, message).await {
        Ok(_) => StatusCode::ACCEPTED,
        Err(_) => StatusCode::SERVICE_UNAVAILABLE,
    }
}

/// Sends request `n` of the run through the layer; `true` when it was accepted (committed).
async fn request(app: &Router, run: &str, n: usize) -> bool {
    let request = Request::post(format!("/events/{n}"))
        .header("idempotency-key", format!("{run}/{n}").replace(' ', "_"))
        .body(axum::body::Body::empty())
        .expect("request");
    let answer = app.clone().oneshot(request).await;
    matches!(answer, Ok(response) if response.status() == StatusCode::ACCEPTED)
}

fn router<DB: Store>(pool: &Pool<DB>, outbox: &Outbox<DB>, run: &str, size: usize) -> Router {
    Router::new()
        .route("/events/{n}", post(enqueue::<DB>))
        .route_layer(IdempotencyLayer::new(Records::new(pool.clone())).allow_anonymous())
        .with_state(App {
            outbox: outbox.clone(),
            run: run.into(),
            payload: size,
        })
}

/// Measures one store and broker: the top rate, then the latencies at half of it.
pub(crate) async fn measure<DB: Store>(
    pool: &Pool<DB>,
    broker: &Broker,
    settings: &Settings,
    tag: u32,
) -> Latency {
    Records::new(pool.clone())
        .migrate()
        .await
        .expect("migrate the store");
    let outbox = Outbox::new(pool.clone());
    outbox.migrate().await.expect("migrate the outbox");
    let n = settings.messages;
    let mut row = Latency {
        store: DB::LABEL,
        broker: broker.name(),
        top: 0.0,
        paced: 0.0,
        latencies: Vec::new(),
        to_send: Vec::new(),
        in_send: Vec::new(),
        load: (load(), String::new()),
        lag: Vec::new(),
        errors: Vec::new(),
    };

    // The top rate, no dispatcher running; what it enqueued is dropped afterwards.
    DB::clear(pool).await;
    let top_run = format!("{tag}-latency-top-{}-{}", DB::LABEL, broker.name());
    let app = router(pool, &outbox, &top_run, settings.payload);
    let producers = settings.producers.max(1);
    let started = Instant::now();
    let tasks: Vec<_> = (0..producers)
        .map(|p| {
            let (app, run) = (app.clone(), top_run.clone());
            tokio::spawn(async move {
                for i in (p..n).step_by(producers) {
                    assert!(request(&app, &run, i).await, "request {i} refused");
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("a producer panicked");
    }
    row.top = n as f64 / started.elapsed().as_secs_f64();
    row.paced = row.top / 2.0;
    DB::clear(pool).await;

    // Half the top rate, one dispatcher with the defaults, woken by the commits alone.
    let run = format!("{tag}-latency-{}-{}", DB::LABEL, broker.name());
    let app = router(pool, &outbox, &run, settings.payload);
    let (sends, acks): (Acks, Acks) = (Arc::default(), Arc::default());
    let confirmed = Arc::default();
    let sender = broker
        .sender(confirmed, false)
        .await
        .recording(sends.clone(), acks.clone());
    let (stop, stopped) = oneshot::channel::<()>();
    let dispatching = tokio::spawn(Dispatcher::new(outbox.clone(), sender).run(async {
        let _ = stopped.await;
    }));
    // Its first claim has found nothing: it sleeps its poll interval unless a commit wakes it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (probe_stop, mut probe_stopped) = oneshot::channel::<()>();
    let probe = tokio::spawn(async move {
        let mut lag = Vec::new();
        loop {
            let before = Instant::now();
            tokio::select! {
                _ = &mut probe_stopped => return lag,
                () = tokio::time::sleep(Duration::from_millis(1)) => {}
            }
            lag.push(before.elapsed().saturating_sub(Duration::from_millis(1)));
        }
    });
    let committed: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let interval = Duration::from_secs_f64(1.0 / row.paced);
    let start = tokio::time::Instant::now();
    let mut requests = Vec::with_capacity(n);
    for i in 0..n {
        tokio::time::sleep_until(start + interval.mul_f64(i as f64)).await;
        let (app, run, committed) = (app.clone(), run.clone(), committed.clone());
        requests.push(tokio::spawn(async move {
            if request(&app, &run, i).await {
                let at = Instant::now();
                let key = key(&run, i).as_str().to_owned();
                committed.lock().expect("commit times").insert(key, at);
            }
        }));
    }
    for request in requests {
        request.await.expect("a request panicked");
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while acks.lock().expect("acks").len() < n && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let _ = stop.send(());
    dispatching.await.expect("the dispatcher panicked");

    row.load.1 = load();
    let _ = probe_stop.send(());
    row.lag = probe.await.expect("the probe panicked");
    row.lag.sort();
    let committed = std::mem::take(&mut *committed.lock().expect("commit times"));
    let sends = std::mem::take(&mut *sends.lock().expect("sends"));
    let acks = std::mem::take(&mut *acks.lock().expect("acks"));
    if committed.len() != n {
        row.errors
            .push(format!("{} of {n} requests committed", committed.len()));
    }
    if acks.len() != n {
        row.errors
            .push(format!("{} of {n} messages confirmed", acks.len()));
    }
    row.latencies = committed
        .iter()
        .filter_map(|(key, at)| Some(acks.get(key)?.saturating_duration_since(*at)))
        .collect();
    row.latencies.sort();
    row.to_send = committed
        .iter()
        .filter_map(|(key, at)| Some(sends.get(key)?.saturating_duration_since(*at)))
        .collect();
    row.to_send.sort();
    row.in_send = sends
        .iter()
        .filter_map(|(key, at)| Some(acks.get(key)?.saturating_duration_since(*at)))
        .collect();
    row.in_send.sort();
    let expected = (0..n).map(|i| key(&run, i).as_str().to_owned()).collect();
    if let Err(error) = broker.verify_and_empty(&expected).await {
        row.errors.push(error);
    }
    DB::clear(pool).await;
    row
}
