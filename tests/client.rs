//! The client layer against a real axum server on a loopback port, through hyper-util's client.
//!
//! The server deduplicates by `Idempotency-Key` in memory and records every attempt it receives,
//! so the tests count what actually reached it. Timing tests run on a paused tokio clock: the
//! gaps they measure are the client's waits, not the machine's speed.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum_idempotency::client::{
    Attempts, Backoff, ClientKey, ErrorKind, IdempotentRetry, IdempotentRetryLayer,
};
use bytes::Bytes;
use http::{HeaderMap, HeaderName, Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::time::Instant;
use tower::{Layer as _, ServiceExt as _};

const ORDER: &str = r#"{"sku":"widget","quantity":1,"amount":12.5,"currency":"EUR"}"#;
const IN_PROGRESS: &str = r#"{"type":"https://example.test/in-progress","title":"in progress","status":409,"code":"idempotency_request_in_progress"}"#;
const OUT_OF_STOCK: &str = r#"{"type":"https://example.test/out-of-stock","title":"out of stock","status":409,"code":"out_of_stock"}"#;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// One request as the server received it.
#[derive(Debug, Clone)]
struct Seen {
    method: Method,
    path: String,
    headers: HeaderMap,
    body: Bytes,
    at: Instant,
}

impl Seen {
    fn key(&self) -> Option<&str> {
        self.header("idempotency-key")
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// The test server: every attempt logged; `/orders` executes once per key and replays after.
#[derive(Default)]
struct Server {
    seen: Mutex<Vec<Seen>>,
    orders: Mutex<HashMap<String, Bytes>>,
    executions: AtomicUsize,
}

impl Server {
    fn seen(&self, path: &str) -> Vec<Seen> {
        let seen = self.seen.lock().unwrap();
        seen.iter().filter(|s| s.path == path).cloned().collect()
    }

    fn executions(&self) -> usize {
        self.executions.load(Ordering::SeqCst)
    }
}

async fn handle(
    State(server): State<Arc<Server>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let seen = Seen {
        method,
        path: uri.path().to_owned(),
        headers,
        body,
        at: Instant::now(),
    };
    // Earlier attempts of the same call: same path and same key (or no key at all).
    let earlier = {
        let mut log = server.seen.lock().unwrap();
        let earlier = log
            .iter()
            .filter(|s| s.path == seen.path && s.key() == seen.key())
            .count();
        log.push(seen.clone());
        earlier
    };
    let created = (StatusCode::CREATED, ORDER).into_response();
    match seen.path.as_str() {
        "/orders" => place_order(&server, &seen),
        "/out-of-stock" => problem(StatusCode::CONFLICT, OUT_OF_STOCK),
        "/in-progress-once" if earlier == 0 => {
            with_retry_after(problem(StatusCode::CONFLICT, IN_PROGRESS), "2")
        }
        "/unavailable-once" if earlier == 0 => {
            with_retry_after(StatusCode::SERVICE_UNAVAILABLE.into_response(), "2")
        }
        "/flaky-once" if earlier == 0 => StatusCode::SERVICE_UNAVAILABLE.into_response(),
        "/flaky-once" if seen.method == Method::GET => StatusCode::OK.into_response(),
        "/always-unavailable" => StatusCode::SERVICE_UNAVAILABLE.into_response(),
        "/far-retry-after" => {
            with_retry_after(StatusCode::SERVICE_UNAVAILABLE.into_response(), "120")
        }
        "/slow-once" if earlier == 0 => {
            tokio::time::sleep(Duration::from_secs(60)).await;
            created
        }
        path => match path.strip_prefix("/reject/") {
            Some(code) => {
                let status = code.parse().ok().and_then(|c| StatusCode::from_u16(c).ok());
                problem(
                    status.unwrap_or(StatusCode::IM_A_TEAPOT),
                    r#"{"code":"rejected"}"#,
                )
            }
            None => created,
        },
    }
}

fn place_order(server: &Server, seen: &Seen) -> Response {
    let Some(key) = seen.key() else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let mut orders = server.orders.lock().unwrap();
    if let Some(body) = orders.get(key) {
        return (
            StatusCode::CREATED,
            [("idempotent-replayed", "true")],
            body.clone(),
        )
            .into_response();
    }
    let id = server.executions.fetch_add(1, Ordering::SeqCst) + 1;
    let body = Bytes::from(format!(r#"{{"id":{id},"status":"created"}}"#));
    orders.insert(key.to_owned(), body.clone());
    (StatusCode::CREATED, body).into_response()
}

fn problem(status: StatusCode, body: &'static str) -> Response {
    (status, [("content-type", "application/problem+json")], body).into_response()
}

fn with_retry_after(mut response: Response, seconds: &'static str) -> Response {
    response
        .headers_mut()
        .insert("retry-after", http::HeaderValue::from_static(seconds));
    response
}

async fn spawn_server() -> (SocketAddr, Arc<Server>) {
    let server = Arc::new(Server::default());
    let app = Router::new()
        .fallback(handle)
        .with_state(Arc::clone(&server));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (addr, server)
}

/// A loopback HTTP proxy that forwards every request, waits for the server's whole answer, and
/// then throws away `drop_percent` of the answers by closing the client's connection instead.
/// Returns its address and the number of answers it dropped.
async fn spawn_lossy_proxy(
    upstream: SocketAddr,
    drop_percent: u64,
) -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let dropped = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&dropped);
    // A fixed-seed xorshift keeps the drop pattern the same from run to run.
    let rng = Arc::new(AtomicU64::new(0x9E37_79B9_7F4A_7C15));
    let forward: Client<HttpConnector, Incoming> =
        Client::builder(TokioExecutor::new()).build_http();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let (forward, rng, dropped) = (forward.clone(), Arc::clone(&rng), Arc::clone(&counter));
            let service = hyper::service::service_fn(move |request| {
                forward_or_drop(
                    request,
                    upstream,
                    forward.clone(),
                    Arc::clone(&rng),
                    drop_percent,
                    Arc::clone(&dropped),
                )
            });
            tokio::spawn(async move {
                // A dropped answer ends the connection with an error, which is the point.
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (addr, dropped)
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

async fn forward_or_drop(
    mut request: Request<Incoming>,
    upstream: SocketAddr,
    forward: Client<HttpConnector, Incoming>,
    rng: Arc<AtomicU64>,
    drop_percent: u64,
    dropped: Arc<AtomicUsize>,
) -> Result<http::Response<Full<Bytes>>, BoxError> {
    *request.uri_mut() = format!("http://{upstream}{}", request.uri().path()).parse()?;
    let (parts, body) = forward.request(request).await?.into_parts();
    let body = body.collect().await?.to_bytes();
    if next_random(&rng) % 100 < drop_percent {
        dropped.fetch_add(1, Ordering::SeqCst);
        return Err(BoxError::from("answer dropped by the lossy proxy"));
    }
    Ok(http::Response::from_parts(parts, Full::new(body)))
}

fn next_random(state: &AtomicU64) -> u64 {
    let mut x = state.load(Ordering::SeqCst);
    loop {
        let mut next = x;
        next ^= next << 13;
        next ^= next >> 7;
        next ^= next << 17;
        match state.compare_exchange(x, next, Ordering::SeqCst, Ordering::SeqCst) {
            Ok(_) => return next,
            Err(current) => x = current,
        }
    }
}

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
    let client = client(layer().body_limit(8));
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
