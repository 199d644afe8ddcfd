//! The client layer against a real axum server on a loopback port, through hyper-util's client.
//!
//! The server deduplicates by `Idempotency-Key` in memory and records every attempt it receives,
//! so the tests count what actually reached it. Timing tests run on a paused tokio clock: the
//! gaps they measure are the client's waits, not the machine's speed.

mod common;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum_idempotency::client::{
    Attempts, Backoff, ClientKey, ErrorKind, IdempotentRetry, IdempotentRetryLayer,
};
use bytes::Bytes;
use common::lossy::{ORDER, OUT_OF_STOCK, spawn_lossy_proxy, spawn_server};
use http::{HeaderName, Method, Request, StatusCode};
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;
use tokio::time::Instant;
use tower::{Layer as _, ServiceExt as _};

type HttpClient = Client<HttpConnector, Full<Bytes>>;

fn http_client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

/// The layer as the tests use it unless they say otherwise: quick backoff.
fn layer() -> IdempotentRetryLayer {
    IdempotentRetryLayer::new().backoff(Backoff::exponential(
        Duration::from_millis(1),
        Duration::from_millis(20),
    ))
}

fn client(layer: IdempotentRetryLayer) -> IdempotentRetry<HttpClient> {
    layer.layer(http_client())
}

fn request(method: Method, addr: SocketAddr, path: &str) -> Request<Full<Bytes>> {
    Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(ORDER.as_bytes())))
        .unwrap()
}

fn post(addr: SocketAddr, path: &str) -> Request<Full<Bytes>> {
    request(Method::POST, addr, path)
}

fn attempts<B>(response: &http::Response<B>) -> u32 {
    response.extensions().get::<Attempts>().unwrap().0
}

fn key<B>(response: &http::Response<B>) -> Option<String> {
    response
        .extensions()
        .get::<ClientKey>()
        .map(|key| key.as_str().to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_orders_through_a_lossy_proxy_execute_exactly_once() {
    let (server_addr, server) = spawn_server().await;
    let (proxy_addr, dropped) = spawn_lossy_proxy(server_addr, 30).await;
    // 0.3^12 per call: all 200 calls get an answer through a proxy that loses 30 % of them.
    let client = client(layer().max_attempts(12));

    let calls = (0..200).map(|_| {
        let client = client.clone();
        tokio::spawn(async move { client.oneshot(post(proxy_addr, "/orders")).await })
    });
    let mut total_attempts = 0;
    let mut keys = HashSet::new();
    for call in calls {
        let response = call.await.unwrap().unwrap();
        assert_eq!(response.status(), StatusCode::CREATED);
        total_attempts += attempts(&response) as usize;
        keys.insert(key(&response).unwrap());
    }

    assert_eq!(server.executions(), 200, "one execution per logical order");
    assert_eq!(keys.len(), 200, "one key per logical order");
    let seen = server.seen("/orders");
    assert!(
        dropped.load(Ordering::SeqCst) > 20,
        "the proxy did drop answers"
    );
    assert_eq!(
        seen.len(),
        total_attempts,
        "every attempt reached the server"
    );
    assert!(seen.len() > 200, "lost answers were retried");
    let keys_seen: HashSet<_> = seen.iter().map(|s| s.key().unwrap().to_owned()).collect();
    assert_eq!(keys_seen, keys, "retries carried only the calls' own keys");
}

#[tokio::test]
async fn final_client_errors_are_returned_at_once_without_retry() {
    let (addr, server) = spawn_server().await;
    let client = client(layer());
    for status in [400, 401, 403, 404, 422] {
        let path = format!("/reject/{status}");
        let response = client.clone().oneshot(post(addr, &path)).await.unwrap();
        assert_eq!(response.status().as_u16(), status);
        assert_eq!(attempts(&response), 1);
        assert_eq!(server.seen(&path).len(), 1, "{status} was not retried");
    }
}

#[tokio::test]
async fn business_conflict_is_final_and_its_body_arrives_intact() {
    let (addr, server) = spawn_server().await;
    let response = client(layer())
        .oneshot(post(addr, "/out-of-stock"))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CONFLICT);
    assert_eq!(
        response.headers()["content-type"],
        "application/problem+json"
    );
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, OUT_OF_STOCK.as_bytes());
    assert_eq!(server.seen("/out-of-stock").len(), 1);
}

async fn assert_retry_after_of_two_seconds_is_honoured(path: &str) {
    let (addr, server) = spawn_server().await;
    let client = client(layer().deadline(Duration::from_secs(3600)));
    let response = client.oneshot(post(addr, path)).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(attempts(&response), 2);

    let seen = server.seen(path);
    assert_eq!(seen.len(), 2);
    let gap = seen[1].at - seen[0].at;
    assert!(
        gap >= Duration::from_secs(2) && gap < Duration::from_millis(2100),
        "waited {gap:?}"
    );
    assert_eq!(seen[0].key(), seen[1].key());
    assert_eq!(seen[1].key(), key(&response).as_deref());
}

#[tokio::test(start_paused = true)]
async fn retry_after_on_an_in_progress_conflict_is_honoured() {
    assert_retry_after_of_two_seconds_is_honoured("/in-progress-once").await;
}

#[tokio::test(start_paused = true)]
async fn retry_after_on_service_unavailable_is_honoured() {
    assert_retry_after_of_two_seconds_is_honoured("/unavailable-once").await;
}

#[tokio::test(start_paused = true)]
async fn a_retry_after_past_the_deadline_returns_the_answer_without_waiting() {
    let (addr, server) = spawn_server().await;
    let client = client(layer().deadline(Duration::from_secs(30)));
    let started = Instant::now();
    let response = client
        .oneshot(post(addr, "/far-retry-after"))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(attempts(&response), 1);
    assert_eq!(server.seen("/far-retry-after").len(), 1);
    assert!(started.elapsed() < Duration::from_secs(1), "did not sleep");
}

#[tokio::test]
async fn two_calls_get_different_keys_and_each_keeps_its_key_and_body_across_retries() {
    let (addr, server) = spawn_server().await;
    let client = client(layer());
    let first = client
        .clone()
        .oneshot(post(addr, "/flaky-once"))
        .await
        .unwrap();
    let second = client.oneshot(post(addr, "/flaky-once")).await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    assert_eq!(second.status(), StatusCode::CREATED);

    let seen = server.seen("/flaky-once");
    let keys: Vec<_> = seen.iter().map(|s| s.key().unwrap()).collect();
    assert_eq!(keys.len(), 4);
    assert_eq!(keys[0], keys[1], "retry of the first call reuses its key");
    assert_eq!(keys[2], keys[3], "retry of the second call reuses its key");
    assert_ne!(keys[0], keys[2], "two logical calls have two keys");
    assert_eq!(key(&first).as_deref(), Some(keys[0]));
    assert_eq!(key(&second).as_deref(), Some(keys[2]));
    assert!(keys[0].len() >= 22, "at least 128 bits of base64");
    assert!(
        seen.iter().all(|s| s.body == ORDER.as_bytes()),
        "same body every time"
    );
}

#[tokio::test]
async fn a_key_the_caller_brings_is_sent_on_every_attempt() {
    let (addr, server) = spawn_server().await;
    let client = client(layer());

    let mut by_extension = post(addr, "/flaky-once");
    let mine = ClientKey::new("order-0001").unwrap();
    by_extension.extensions_mut().insert(mine.clone());
    let response = client.clone().oneshot(by_extension).await.unwrap();
    assert_eq!(response.extensions().get::<ClientKey>(), Some(&mine));

    let mut by_header = post(addr, "/flaky-once");
    by_header
        .headers_mut()
        .insert("idempotency-key", "order-0002".parse().unwrap());
    let response = client.oneshot(by_header).await.unwrap();
    assert_eq!(key(&response).as_deref(), Some("order-0002"));

    let keys: Vec<_> = server
        .seen("/flaky-once")
        .iter()
        .map(|s| s.key().unwrap().to_owned())
        .collect();
    assert_eq!(
        keys,
        ["order-0001", "order-0001", "order-0002", "order-0002"]
    );
}

#[tokio::test]
async fn the_key_header_name_is_configurable() {
    let (addr, server) = spawn_server().await;
    let client = client(layer().header_name(HeaderName::from_static("x-request-key")));
    let response = client.oneshot(post(addr, "/flaky-once")).await.unwrap();
    let seen = server.seen("/flaky-once");
    assert_eq!(seen.len(), 2);
    assert!(seen.iter().all(|s| s.key().is_none()));
    assert!(
        seen.iter()
            .all(|s| s.header("x-request-key") == key(&response).as_deref())
    );
}

#[tokio::test]
async fn unkeyed_methods_get_no_key_and_only_idempotent_ones_are_retried() {
    let (addr, server) = spawn_server().await;
    let client = client(layer().keyed_methods([Method::PATCH]));

    let get = client
        .clone()
        .oneshot(request(Method::GET, addr, "/flaky-once"))
        .await
        .unwrap();
    assert_eq!(get.status(), StatusCode::OK);
    assert_eq!(attempts(&get), 2);
    assert_eq!(key(&get), None);

    let unkeyed_post = client
        .oneshot(post(addr, "/always-unavailable"))
        .await
        .unwrap();
    assert_eq!(unkeyed_post.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        attempts(&unkeyed_post),
        1,
        "a POST without a key is never resent"
    );

    let seen = server.seen.lock().unwrap();
    assert_eq!(seen.len(), 3);
    assert!(seen.iter().all(|s| s.key().is_none()));
}

#[tokio::test]
async fn the_last_answer_is_returned_after_max_attempts() {
    let (addr, server) = spawn_server().await;
    let client = client(layer().max_attempts(3));
    let response = client
        .oneshot(post(addr, "/always-unavailable"))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(attempts(&response), 3);
    assert_eq!(server.seen("/always-unavailable").len(), 3);
}

#[tokio::test(start_paused = true)]
async fn a_slow_attempt_times_out_and_is_retried_with_the_same_key() {
    let (addr, server) = spawn_server().await;
    let client = client(layer().attempt_timeout(Duration::from_secs(5)));
    let response = client.oneshot(post(addr, "/slow-once")).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(attempts(&response), 2);
    let seen = server.seen("/slow-once");
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0].key(), seen[1].key());
    assert!(seen[1].at - seen[0].at >= Duration::from_secs(5));
}

#[tokio::test]
async fn a_body_over_the_limit_fails_before_anything_is_sent() {
    let (addr, server) = spawn_server().await;
    let client = client(layer().max_request_body(8));
    let error = client.oneshot(post(addr, "/orders")).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::RequestBodyTooLarge);
    assert_eq!(error.attempts(), 0);
    assert!(server.seen("/orders").is_empty());
}

#[tokio::test]
async fn connection_errors_are_retried_and_the_error_keeps_the_key() {
    let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = closed.local_addr().unwrap();
    drop(closed);
    let client = client(layer().max_attempts(3));
    let error = client.oneshot(post(addr, "/orders")).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Transport);
    assert_eq!(error.attempts(), 3);
    assert!(
        error.key().is_some(),
        "the caller can retry later with this key"
    );
}
