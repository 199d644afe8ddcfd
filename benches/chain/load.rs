//! Payments posted to the payments example: as fast as it answers, or at a steady rate.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{Client, connect::HttpConnector};
use hyper_util::rt::TokioExecutor;

/// The orders the payments are spread over, ids 1 to this: the orders app of the outage step
/// places them first, so each event applies; spread, so its consumer does not queue on one
/// order's row.
pub(crate) const ORDERS: u64 = 16;

/// What the load got back.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    /// `202`: a payment accepted into the outbox.
    pub(crate) accepted: AtomicU64,
    /// Anything else, or no answer.
    pub(crate) refused: AtomicU64,
    /// Paced load only: ticks skipped because every connection was still busy.
    pub(crate) late: AtomicU64,
}

#[derive(Clone)]
pub(crate) struct Load {
    client: Client<HttpConnector, Full<Bytes>>,
    url: String,
    ns: String,
    pub(crate) tally: Arc<Tally>,
    next: Arc<AtomicU64>,
}

impl Load {
    pub(crate) fn new(payments_url: &str, ns: &str) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        Self {
            client: Client::builder(TokioExecutor::new()).build(connector),
            url: format!("{payments_url}/payments"),
            ns: ns.to_owned(),
            tally: Arc::default(),
            next: Arc::default(),
        }
    }

    /// One payment under a key never used before.
    async fn post(&self) {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let request = Request::post(&self.url)
            .header("authorization", "Bearer alice-token")
            .header("idempotency-key", format!("{}-{n}", self.ns))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(format!(
                r#"{{"order_id":"{}","amount":12.5,"currency":"EUR","payee":"acme"}}"#,
                n % ORDERS + 1
            ))))
            .expect("request");
        let accepted = match self.client.request(request).await {
            Ok(response) => {
                let status = response.status();
                let _ = response.into_body().collect().await;
                status == StatusCode::ACCEPTED
            }
            Err(_) => false,
        };
        let counter = if accepted {
            &self.tally.accepted
        } else {
            &self.tally.refused
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// `connections` clients posting back to back for `warmup`, then for `measured`: the
    /// payments accepted per second in the measured part.
    pub(crate) async fn saturate(
        &self,
        connections: usize,
        warmup: Duration,
        measured: Duration,
    ) -> f64 {
        let end = Instant::now() + warmup + measured;
        let workers: Vec<_> = (0..connections)
            .map(|_| {
                let load = self.clone();
                tokio::spawn(async move {
                    while Instant::now() < end {
                        load.post().await;
                    }
                })
            })
            .collect();
        tokio::time::sleep(warmup).await;
        let (before, started) = (self.tally.accepted.load(Ordering::Relaxed), Instant::now());
        tokio::time::sleep(measured).await;
        let (after, elapsed) = (
            self.tally.accepted.load(Ordering::Relaxed),
            started.elapsed(),
        );
        for worker in workers {
            let _ = worker.await;
        }
        (after - before) as f64 / elapsed.as_secs_f64()
    }

    /// Posts `rate` payments a second, at most `connections` in flight, until `stop` is set;
    /// the task ends once the payments in flight are answered.
    pub(crate) fn paced(
        &self,
        rate: f64,
        connections: usize,
    ) -> (
        tokio::sync::watch::Sender<bool>,
        tokio::task::JoinHandle<()>,
    ) {
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let load = self.clone();
        let slots = Arc::new(tokio::sync::Semaphore::new(connections));
        let running = tokio::spawn(async move {
            let mut ticks = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            loop {
                tokio::select! {
                    _ = ticks.tick() => {}
                    _ = stopped.wait_for(|stop| *stop) => break,
                }
                let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
                    load.tally.late.fetch_add(1, Ordering::Relaxed);
                    continue;
                };
                let load = load.clone();
                tokio::spawn(async move {
                    load.post().await;
                    drop(slot);
                });
            }
            // The payments in flight are answered before the caller reads the tally.
            let _ = slots.acquire_many(connections as u32).await;
        });
        (stop, running)
    }
}

/// Places the [`ORDERS`] orders the payments are for, ids 1 to [`ORDERS`] in a fresh database,
/// each large enough for every payment of a run.
pub(crate) async fn place_orders(orders_url: &str, ns: &str) {
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    for n in 1..=ORDERS {
        let body = r#"{"sku":"widget","quantity":1,"amount":1e9,"currency":"EUR"}"#;
        let request = Request::post(format!("{orders_url}/orders"))
            .header("authorization", "Bearer alice-token")
            .header("idempotency-key", format!("{ns}-order-{n}"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .expect("request");
        let response = client.request(request).await.expect("orders answers");
        assert_eq!(response.status(), StatusCode::CREATED, "order {n} placed");
        let body = response
            .into_body()
            .collect()
            .await
            .expect("body")
            .to_bytes();
        let order: serde_json::Value = serde_json::from_slice(&body).expect("an order");
        assert_eq!(
            order["id"].as_u64(),
            Some(n),
            "the orders' ids are 1 to {ORDERS}"
        );
    }
}
