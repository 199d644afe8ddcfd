//! Places orders against the running `orders` example through a network that loses answers.
//!
//! ```text
//! cargo run --example orders                             # in one terminal
//! cargo run --example orders_client --features client 50 # in another: place 50 orders
//! ```
//!
//! The client talks to a proxy started here, on a loopback port, which forwards every request to
//! the server (`ORDERS_URL`, default `http://127.0.0.1:3000`) and then throws away about 30 % of
//! the answers — after the server has created the order. Each lost answer looks like a broken
//! connection to the client, which retries with the same `Idempotency-Key`; the server replays
//! the order it created instead of creating another. At the end the server holds exactly one new
//! order per logical call.

use std::env;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum_idempotency::client::{Attempts, ClientKey, IdempotentRetryLayer};
use bytes::Bytes;
use http::{Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tower::{Layer as _, ServiceExt as _};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const ORDER: &str = r#"{"sku":"widget","quantity":1,"amount":12.5,"currency":"EUR"}"#;
const TOKEN: &str = "Bearer alice-token";
const DROP_PERCENT: u32 = 30;

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let orders: usize = match env::args().nth(1).or_else(|| env::var("ORDERS").ok()) {
        Some(count) => count.parse()?,
        None => 20,
    };
    let server: Uri = env::var("ORDERS_URL")
        .unwrap_or_else(|_| "http://127.0.0.1:3000".to_owned())
        .parse()?;
    let server_addr = server
        .authority()
        .ok_or("ORDERS_URL needs a host")?
        .to_string();

    let http: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let before = count_orders(&http, &server_addr).await?;
    let (proxy, dropped) = spawn_lossy_proxy(server_addr.clone()).await?;
    println!("lossy proxy on {proxy} → {server_addr}, dropping ~{DROP_PERCENT} % of answers");

    // 0.3^10: every call gets through although the proxy keeps losing answers.
    let client = IdempotentRetryLayer::new()
        .max_attempts(10)
        .layer(http.clone());

    let (mut placed, mut attempts) = (0, 0);
    for n in 1..=orders {
        let request = Request::post(format!("http://{proxy}/orders"))
            .header("authorization", TOKEN)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(ORDER.as_bytes())))?;
        match client.clone().oneshot(request).await {
            Ok(response) => {
                let tries = response.extensions().get::<Attempts>().map_or(1, |a| a.0);
                let key = response.extensions().get::<ClientKey>().cloned();
                attempts += tries;
                if response.status() == StatusCode::CREATED {
                    placed += 1;
                }
                let replayed = response.headers().contains_key("idempotent-replayed");
                println!(
                    "order {n}: {} after {tries} attempt(s){} key {}",
                    response.status(),
                    if replayed { " (replayed)" } else { "" },
                    key.map_or_else(String::new, |key| key.to_string()),
                );
            }
            Err(error) => {
                attempts += error.attempts();
                println!(
                    "order {n}: failed after {} attempt(s): {error}",
                    error.attempts()
                );
            }
        }
    }

    println!(
        "{placed} of {orders} logical orders succeeded in {attempts} attempts; \
         the proxy dropped {} answers",
        dropped.load(Ordering::SeqCst)
    );
    if let (Some(before), Some(after)) = (before, count_orders(&http, &server_addr).await?) {
        println!("the server holds {} new orders for alice", after - before);
    }
    Ok(())
}

/// How many orders alice has, asked directly (not through the proxy); `None` if the answer is
/// not a list this example understands.
async fn count_orders(
    http: &Client<HttpConnector, Full<Bytes>>,
    server: &str,
) -> Result<Option<usize>, BoxError> {
    let request = Request::get(format!("http://{server}/orders"))
        .header("authorization", TOKEN)
        .body(Full::default())?;
    let body = http.request(request).await?.into_body().collect().await?;
    let orders: serde_json::Value = serde_json::from_slice(&body.to_bytes()).unwrap_or_default();
    let list = orders.as_array().or_else(|| orders["orders"].as_array());
    Ok(list.map(Vec::len))
}

/// A loopback HTTP proxy that forwards each request, waits for the server's complete answer,
/// and then loses some answers by closing the connection instead of replying.
async fn spawn_lossy_proxy(upstream: String) -> Result<(SocketAddr, Arc<AtomicUsize>), BoxError> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let dropped = Arc::new(AtomicUsize::new(0));
    let forward: Client<HttpConnector, Incoming> =
        Client::builder(TokioExecutor::new()).build_http();
    let counter = Arc::clone(&dropped);
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (forward, upstream, dropped) =
                (forward.clone(), upstream.clone(), Arc::clone(&counter));
            let service = hyper::service::service_fn(move |request| {
                forward_or_drop(
                    request,
                    upstream.clone(),
                    forward.clone(),
                    Arc::clone(&dropped),
                )
            });
            tokio::spawn(async move {
                // A lost answer ends the connection with an error: that is the point.
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok((addr, dropped))
}

async fn forward_or_drop(
    mut request: Request<Incoming>,
    upstream: String,
    forward: Client<HttpConnector, Incoming>,
    dropped: Arc<AtomicUsize>,
) -> Result<Response<Full<Bytes>>, BoxError> {
    *request.uri_mut() = format!("http://{upstream}{}", request.uri().path()).parse()?;
    let (parts, body) = forward.request(request).await?.into_parts();
    // The whole answer is in: the server has done its work whatever happens next.
    let body = body.collect().await?.to_bytes();
    if getrandom::u32()? % 100 < DROP_PERCENT {
        dropped.fetch_add(1, Ordering::SeqCst);
        return Err("answer lost on the way back".into());
    }
    Ok(Response::from_parts(parts, Full::new(body)))
}
