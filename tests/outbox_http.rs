//! `HttpSender` against real HTTP servers on loopback, with messages from a real SQLite outbox.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum_idempotency::error::Rejection;
use axum_idempotency::outbox::{
    DownstreamKey, HttpSender, LookupOutcome, Message, OutboxRecord, SendOutcome, Sender,
};
use bytes::Bytes;
use common::sqlite::TempOutbox;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::io::AsyncReadExt;
use tokio::net::TcpListener;

mod common;

/// What the downstream saw of the last `POST`: its headers and body.
type Seen = Arc<Mutex<Option<(HeaderMap, String)>>>;

/// A downstream answering `POST /charges` with the status its `x-answer` header asks for (a
/// charge id on success, `Retry-After: 7` on 429, the `Retry-After` an `x-retry-after` header
/// asks for), and `GET /charges?key=` with the charge of that key: found for `found`, missing
/// for `missing`, a 500 otherwise.
async fn downstream(seen: Seen) -> String {
    async fn charge(
        State(seen): State<Seen>,
        headers: HeaderMap,
        body: String,
    ) -> impl IntoResponse {
        let status = headers["x-answer"]
            .to_str()
            .unwrap()
            .parse::<u16>()
            .unwrap();
        *seen.lock().unwrap() = Some((headers.clone(), body));
        let status = StatusCode::from_u16(status).unwrap();
        let mut answer_headers = HeaderMap::new();
        if status == StatusCode::TOO_MANY_REQUESTS {
            answer_headers.insert("retry-after", HeaderValue::from_static("7"));
        }
        if let Some(after) = headers.get("x-retry-after") {
            answer_headers.insert("retry-after", after.clone());
        }
        let body = if status.is_success() {
            r#"{"id":"ch_1"}"#
        } else {
            "card declined"
        };
        (status, answer_headers, body)
    }
    async fn find(Query(query): Query<Vec<(String, String)>>) -> impl IntoResponse {
        match query.first().map(|(_, key)| key.as_str()) {
            Some("found&1") => (StatusCode::OK, r#"{"id":"ch_found"}"#),
            Some("missing") => (StatusCode::NOT_FOUND, "{}"),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "{}"),
        }
    }
    let app = Router::new()
        .route("/charges", post(charge).get(find))
        .with_state(seen);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{address}")
}

/// A stored outbox message with `key`, as the dispatcher hands it to a sender, and the outbox
/// it is stored in.
async fn record(key: &str) -> (OutboxRecord, TempOutbox) {
    let outbox = TempOutbox::new().await;
    let key = DownstreamKey::new(key).unwrap();
    let message = Message::json("charges", key, &serde_json::json!({ "amount": 12.5 })).unwrap();
    (outbox.record(message).await, outbox)
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// A sender posting to `base`'s charges, asking the downstream to answer `answer`.
fn sender(base: &str, answer: &str) -> HttpSender<HttpClient> {
    let client = Client::builder(TokioExecutor::new()).build_http();
    HttpSender::new(client, format!("{base}/charges").parse().unwrap())
        .header(
            HeaderName::from_static("x-answer"),
            HeaderValue::from_str(answer).unwrap(),
        )
        .lookup_url(format!("{base}/charges?key={{key}}"))
}

#[tokio::test]
async fn posts_the_payload_with_its_key_and_reads_the_receipt() {
    let seen = Seen::default();
    let base = downstream(seen.clone()).await;
    let (record, _dir) = record("charge-1").await;
    let sender = sender(&base, "201").header(
        HeaderName::from_static("authorization"),
        HeaderValue::from_static("Bearer sk_test"),
    );
    let delivered = sender.send(&record).await;
    assert_eq!(
        delivered,
        SendOutcome::Delivered {
            receipt: "ch_1".into()
        }
    );
    let (headers, body) = seen.lock().unwrap().take().unwrap();
    assert_eq!(headers["idempotency-key"], "charge-1");
    assert_eq!(headers["content-type"], "application/json");
    assert_eq!(headers["authorization"], "Bearer sk_test");
    assert_eq!(body, r#"{"amount":12.5}"#);
}

#[tokio::test]
async fn answers_become_the_outcomes_the_dispatcher_acts_on() {
    let base = downstream(Seen::default()).await;
    let (record, _dir) = record("charge-2").await;
    let outcome = |answer: &'static str| {
        let sender = sender(&base, answer);
        let record = record.clone();
        async move { sender.send(&record).await }
    };
    let retry = |after, status: &str| SendOutcome::Retry {
        after,
        reason: format!("answered {status}"),
    };
    let unavailable = |after, status: &str| SendOutcome::Unavailable {
        after,
        reason: format!("answered {status}"),
    };
    assert_eq!(
        outcome("429").await,
        unavailable(Some(Duration::from_secs(7)), "429 Too Many Requests")
    );
    assert_eq!(
        outcome("503").await,
        unavailable(None, "503 Service Unavailable")
    );
    let busy = sender(&base, "503").header(
        HeaderName::from_static("x-retry-after"),
        HeaderValue::from_static("3"),
    );
    assert_eq!(
        busy.send(&record).await,
        unavailable(Some(Duration::from_secs(3)), "503 Service Unavailable")
    );
    assert_eq!(outcome("408").await, retry(None, "408 Request Timeout"));
    for maybe_applied in ["500", "502", "504"] {
        assert!(
            matches!(outcome(maybe_applied).await, SendOutcome::Unknown { .. }),
            "{maybe_applied}"
        );
    }
    let SendOutcome::Rejected { reason } = outcome("402").await else {
        panic!("a 402 is final");
    };
    assert_eq!(reason, "answered 402 Payment Required: card declined");
    assert_eq!(
        outcome("200").await,
        SendOutcome::Delivered {
            receipt: "ch_1".into()
        }
    );
}

#[tokio::test]
async fn an_unreachable_downstream_is_unavailable_and_a_lost_answer_is_unknown() {
    let (record, _dir) = record("charge-3").await;
    let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let refusing = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let refused = sender(&refusing, "201").send(&record).await;
    let SendOutcome::Unavailable {
        after: None,
        reason,
    } = refused
    else {
        panic!("a refused connection is an outage: {refused:?}");
    };
    assert!(reason.contains("refused"), "{reason}");

    // `.invalid` never resolves (RFC 6761): the request cannot have left either.
    let unresolved = sender("http://charges.invalid", "201").send(&record).await;
    assert!(
        matches!(unresolved, SendOutcome::Unavailable { after: None, .. }),
        "{unresolved:?}"
    );

    // Reads the request, then hangs up without a word: the charge may have been made.
    let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hanging_up = format!("http://{}", silent.local_addr().unwrap());
    tokio::spawn(async move {
        let (mut stream, _) = silent.accept().await.unwrap();
        let mut buffer = [0; 4096];
        let _ = stream.read(&mut buffer).await;
    });
    let lost = sender(&hanging_up, "201").send(&record).await;
    assert!(matches!(lost, SendOutcome::Unknown { .. }), "{lost:?}");
}

#[tokio::test]
async fn looks_a_message_up_by_its_percent_encoded_key() {
    let base = downstream(Seen::default()).await;
    let found = sender(&base, "201")
        .lookup(&record("found&1").await.0)
        .await;
    assert_eq!(
        found,
        LookupOutcome::Found {
            receipt: "ch_found".into()
        }
    );
    let missing = sender(&base, "201")
        .lookup(&record("missing").await.0)
        .await;
    assert_eq!(missing, LookupOutcome::NotFound);
    let failing = sender(&base, "201").lookup(&record("broken").await.0).await;
    assert!(
        matches!(failing, LookupOutcome::Failed { .. }),
        "{failing:?}"
    );

    let client = Client::builder(TokioExecutor::new()).build_http();
    let without = HttpSender::new(client, format!("{base}/charges").parse().unwrap());
    let unsupported = without.lookup(&record("found&1").await.0).await;
    assert_eq!(unsupported, LookupOutcome::Unsupported);
}

/// A downstream answering the first `POST /charges` with `answer`; the sender posting to it.
async fn answering(answer: Response) -> HttpSender<HttpClient> {
    let answer = Arc::new(Mutex::new(Some(answer)));
    let app = Router::new().route(
        "/charges",
        post(move || async move { answer.lock().unwrap().take().unwrap() }),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let client = Client::builder(TokioExecutor::new()).build_http();
    HttpSender::new(client, format!("http://{address}/charges").parse().unwrap())
}

/// A `409` problem document with `code`.
fn problem(code: &str) -> Response {
    let body = serde_json::json!({
        "type": format!("https://example.test/{code}"),
        "title": "conflict",
        "status": 409,
        "code": code,
    });
    let content_type = [("content-type", "application/problem+json")];
    (StatusCode::CONFLICT, content_type, body.to_string()).into_response()
}

#[tokio::test]
async fn a_conflict_is_retried_only_while_the_key_is_in_flight() {
    let (record, _dir) = record("charge-409").await;
    let retry = |after| SendOutcome::Retry {
        after,
        reason: "answered 409 Conflict".into(),
    };

    // This crate's own layer, asked while the key's first request runs.
    let in_flight = Rejection::InProgress {
        retry_after: Duration::from_secs(2),
    };
    let sent = answering(in_flight.into_response())
        .await
        .send(&record)
        .await;
    assert_eq!(sent, retry(Some(Duration::from_secs(2))));

    // The same document after a proxy dropped its `Retry-After`: the body alone says so.
    let mut stripped = Rejection::InProgress {
        retry_after: Duration::from_secs(2),
    }
    .into_response();
    assert!(stripped.headers_mut().remove("retry-after").is_some());
    let sent = answering(stripped).await.send(&record).await;
    assert_eq!(sent, retry(None));

    // Another server's way of saying it: a bare `Retry-After`.
    let bare = (StatusCode::CONFLICT, [("retry-after", "5")], "busy").into_response();
    let sent = answering(bare).await.send(&record).await;
    assert_eq!(sent, retry(Some(Duration::from_secs(5))));

    // A business conflict is the downstream's answer to this request, not a reason to resend.
    let sent = answering(problem("out_of_stock")).await.send(&record).await;
    let SendOutcome::Rejected { reason } = sent else {
        panic!("a business 409 is final: {sent:?}");
    };
    assert!(
        reason.starts_with("answered 409 Conflict: {") && reason.contains("out_of_stock"),
        "{reason}"
    );
    let sent = answering((StatusCode::CONFLICT, "duplicate order").into_response())
        .await
        .send(&record)
        .await;
    assert_eq!(
        sent,
        SendOutcome::Rejected {
            reason: "answered 409 Conflict: duplicate order".into()
        }
    );
}

#[tokio::test]
async fn the_users_rules_come_before_the_default_table() {
    let (record, _dir) = record("charge-rules").await;
    let rules = |status: StatusCode, headers: &HeaderMap, body: &[u8]| match status {
        StatusCode::LOCKED => Some(SendOutcome::Retry {
            after: Some(Duration::from_secs(60)),
            reason: format!("locked: {}", String::from_utf8_lossy(body)),
        }),
        // This downstream's 503 with `x-maintenance` means the request was taken in part.
        StatusCode::SERVICE_UNAVAILABLE if headers.contains_key("x-maintenance") => {
            Some(SendOutcome::Unknown {
                reason: "maintenance".into(),
            })
        }
        _ => None,
    };

    let locked = (StatusCode::LOCKED, "migrating").into_response();
    let sent = answering(locked).await.classify(rules).send(&record).await;
    assert_eq!(
        sent,
        SendOutcome::Retry {
            after: Some(Duration::from_secs(60)),
            reason: "locked: migrating".into()
        }
    );
    let maintenance = (
        StatusCode::SERVICE_UNAVAILABLE,
        [("x-maintenance", "1")],
        "",
    )
        .into_response();
    let sent = answering(maintenance)
        .await
        .classify(rules)
        .send(&record)
        .await;
    assert_eq!(
        sent,
        SendOutcome::Unknown {
            reason: "maintenance".into()
        }
    );
    // What the rules leave alone follows the table.
    let declined = (StatusCode::PAYMENT_REQUIRED, "card declined").into_response();
    let sent = answering(declined)
        .await
        .classify(rules)
        .send(&record)
        .await;
    assert_eq!(
        sent,
        SendOutcome::Rejected {
            reason: "answered 402 Payment Required: card declined".into()
        }
    );
}
