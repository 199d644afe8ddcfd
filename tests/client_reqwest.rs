//! The reqwest-middleware front door against the same loopback server and lossy proxy as the
//! tower layer: one policy, so the same behaviour.

mod common;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::time::Duration;

use axum_idempotency::client::{
    Attempts, Backoff, ClientKey, IdempotentRetryLayer, IdempotentRetryMiddleware,
};
use common::lossy::{ORDER, OUT_OF_STOCK, spawn_lossy_proxy, spawn_server};
use http::StatusCode;
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};

fn client(layer: IdempotentRetryLayer) -> ClientWithMiddleware {
    let layer = layer.backoff(Backoff::exponential(
        Duration::from_millis(1),
        Duration::from_millis(20),
    ));
    ClientBuilder::new(reqwest::Client::new())
        .with(IdempotentRetryMiddleware::from(layer))
        .build()
}

async fn post(client: &ClientWithMiddleware, addr: SocketAddr, path: &str) -> reqwest::Response {
    client
        .post(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(ORDER)
        .send()
        .await
        .unwrap()
}

fn attempts(response: &reqwest::Response) -> u32 {
    response.extensions().get::<Attempts>().unwrap().0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_through_a_lossy_proxy_execute_exactly_once() {
    let (server_addr, server) = spawn_server().await;
    let (proxy_addr, _dropped) = spawn_lossy_proxy(server_addr, 30).await;
    let client = client(IdempotentRetryLayer::new().max_attempts(12));

    let calls = (0..100).map(|_| {
        let client = client.clone();
        tokio::spawn(async move { post(&client, proxy_addr, "/orders").await })
    });
    let mut keys = HashSet::new();
    let mut total_attempts = 0;
    for call in calls {
        let response = call.await.unwrap();
        assert_eq!(response.status(), StatusCode::CREATED);
        total_attempts += attempts(&response) as usize;
        keys.insert(response.extensions().get::<ClientKey>().unwrap().clone());
    }
    assert_eq!(server.executions(), 100);
    assert_eq!(keys.len(), 100);
    assert_eq!(server.seen("/orders").len(), total_attempts);
    assert!(total_attempts > 100, "lost answers were retried");
}

#[tokio::test]
async fn final_client_errors_are_returned_at_once_without_retry() {
    let (addr, server) = spawn_server().await;
    let client = client(IdempotentRetryLayer::new());
    for status in [400, 422] {
        let path = format!("/reject/{status}");
        let response = post(&client, addr, &path).await;
        assert_eq!(response.status().as_u16(), status);
        assert_eq!(server.seen(&path).len(), 1, "{status} was not retried");
    }
}

#[tokio::test]
async fn business_conflict_is_final_and_arrives_intact() {
    let (addr, server) = spawn_server().await;
    let response = post(&client(IdempotentRetryLayer::new()), addr, "/out-of-stock").await;
    assert_eq!(response.status(), StatusCode::CONFLICT);
    assert_eq!(response.url().path(), "/out-of-stock");
    assert_eq!(response.bytes().await.unwrap(), OUT_OF_STOCK.as_bytes());
    assert_eq!(server.seen("/out-of-stock").len(), 1);
}

#[tokio::test(start_paused = true)]
async fn retry_after_on_an_in_progress_conflict_is_honoured_with_the_same_key() {
    let (addr, server) = spawn_server().await;
    let client = client(IdempotentRetryLayer::new().deadline(Duration::from_secs(3600)));
    let response = post(&client, addr, "/in-progress-once").await;
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(attempts(&response), 2);
    let seen = server.seen("/in-progress-once");
    let gap = seen[1].at - seen[0].at;
    assert!(
        gap >= Duration::from_secs(2) && gap < Duration::from_millis(2100),
        "waited {gap:?}"
    );
    assert_eq!(seen[0].key(), seen[1].key());
    assert_eq!(seen[0].body, ORDER.as_bytes());
    assert_eq!(seen[1].body, ORDER.as_bytes());
}

#[tokio::test]
async fn a_caller_key_in_the_extensions_is_sent_on_every_attempt() {
    let (addr, server) = spawn_server().await;
    let client = client(IdempotentRetryLayer::new());
    let response = client
        .post(format!("http://{addr}/flaky-once"))
        .with_extension(ClientKey::new("order-0001").unwrap())
        .body(ORDER)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let keys: Vec<_> = server
        .seen("/flaky-once")
        .iter()
        .map(|s| s.key().unwrap().to_owned())
        .collect();
    assert_eq!(keys, ["order-0001", "order-0001"]);
}
