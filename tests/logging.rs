//! What the logs say about a request: a short digest of the scoped key and the outcome, never
//! the key itself or a body.

mod common;

use axum_idempotency::{IdempotencyKey, Scope};
use common::logs::Captured;
use common::serve_fresh;

// A current-thread runtime keeps every task (server, engine) on the thread that owns the
// subscriber set below.
#[tokio::test]
async fn logs_carry_a_digest_of_the_key_never_the_key_or_a_body() {
    let captured = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(captured.clone())
        .with_max_level(tracing::Level::TRACE)
        .with_ansi(false)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let app = serve_fresh::<sqlx::Sqlite>(4, |layer| layer).await;
    let key = "the-raw-key-3f9a7c21e5b84d06";
    let secret = r#"{"label":"body-marker-7d1e"}"#;
    app.post("/effects", Some("alice"), Some(key), secret).await;
    app.post("/effects", Some("alice"), Some(key), secret).await;
    app.post(
        "/effects",
        Some("alice"),
        Some(key),
        r#"{"label":"other-marker-2b"}"#,
    )
    .await;

    let logs = captured.text();
    let digest = Scope::new(
        "alice",
        "POST",
        "/effects",
        key.parse::<IdempotencyKey>().expect("key"),
    )
    .scoped_key()
    .short();
    for outcome in [
        "outcome=\"executed\"",
        "outcome=\"replayed\"",
        "outcome=\"mismatch\"",
    ] {
        assert!(logs.contains(outcome), "missing {outcome} in:\n{logs}");
    }
    assert!(
        logs.contains(&digest),
        "the short digest correlates the lines:\n{logs}"
    );
    assert!(
        !logs.contains(key),
        "the raw key leaked into the logs:\n{logs}"
    );
    assert!(
        !logs.contains("body-marker-7d1e") && !logs.contains("other-marker-2b"),
        "a body leaked:\n{logs}"
    );
    app.dispose().await;
}
