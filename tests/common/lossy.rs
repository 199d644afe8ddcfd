//! A test server that deduplicates by `Idempotency-Key` in memory and records every attempt it
//! receives, and a lossy loopback proxy in front of it; shared by the tests of both front doors.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::time::Instant;

pub(crate) const ORDER: &str = r#"{"sku":"widget","quantity":1,"amount":12.5,"currency":"EUR"}"#;
pub(crate) const IN_PROGRESS: &str = r#"{"type":"https://example.test/in-progress","title":"in progress","status":409,"code":"idempotency_request_in_progress"}"#;
pub(crate) const OUT_OF_STOCK: &str = r#"{"type":"https://example.test/out-of-stock","title":"out of stock","status":409,"code":"out_of_stock"}"#;

/// One request as the server received it.
#[derive(Debug, Clone)]
pub(crate) struct Seen {
    pub(crate) method: Method,
    pub(crate) path: String,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
    pub(crate) at: Instant,
}

impl Seen {
    pub(crate) fn key(&self) -> Option<&str> {
        self.header("idempotency-key")
    }

    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// The test server: every attempt logged; `/orders` executes once per key and replays after.
#[derive(Default)]
pub(crate) struct Server {
    pub(crate) seen: Mutex<Vec<Seen>>,
    pub(crate) orders: Mutex<HashMap<String, Bytes>>,
    pub(crate) executions: AtomicUsize,
}

impl Server {
    pub(crate) fn seen(&self, path: &str) -> Vec<Seen> {
        let seen = self.seen.lock().unwrap();
        seen.iter().filter(|s| s.path == path).cloned().collect()
    }

    pub(crate) fn executions(&self) -> usize {
        self.executions.load(Ordering::SeqCst)
    }
}

pub(crate) async fn handle(
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

pub(crate) fn place_order(server: &Server, seen: &Seen) -> Response {
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

pub(crate) fn problem(status: StatusCode, body: &'static str) -> Response {
    (status, [("content-type", "application/problem+json")], body).into_response()
}

pub(crate) fn with_retry_after(mut response: Response, seconds: &'static str) -> Response {
    response
        .headers_mut()
        .insert("retry-after", http::HeaderValue::from_static(seconds));
    response
}

pub(crate) async fn spawn_server() -> (SocketAddr, Arc<Server>) {
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
pub(crate) async fn spawn_lossy_proxy(
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

pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

pub(crate) async fn forward_or_drop(
    mut request: Request<Incoming>,
    upstream: SocketAddr,
    forward: Client<HttpConnector, Incoming>,
    rng: Arc<AtomicU64>,
    drop_percent: u64,
    dropped: Arc<AtomicUsize>,
) -> Result<http::Response<Full<Bytes>>, BoxError> {
    // The query too: a lookup such as `GET /charges?key=…` means nothing without it.
    let target = request.uri().path_and_query().map_or("/", |p| p.as_str());
    *request.uri_mut() = format!("http://{upstream}{target}").parse()?;
    let (parts, body) = forward.request(request).await?.into_parts();
    let body = body.collect().await?.to_bytes();
    if next_random(&rng) % 100 < drop_percent {
        dropped.fetch_add(1, Ordering::SeqCst);
        return Err(BoxError::from("answer dropped by the lossy proxy"));
    }
    Ok(http::Response::from_parts(parts, Full::new(body)))
}

pub(crate) fn next_random(state: &AtomicU64) -> u64 {
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
