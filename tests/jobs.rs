//! A job's run, plain or leased, that commits nothing says why: the engine refused it, the
//! store failed, or the work itself failed; and whether running it again under the same key
//! may succeed.

#![cfg(feature = "sqlite")]

use std::time::Duration;

use axum::response::IntoResponse;
use axum_idempotency::{
    Engine, Execution, Fingerprint, Fingerprinter, Lookup, Outcome, Rejection, RunError, Scope,
    SqliteStore, Tx, TxError,
};
use http::StatusCode;
use sqlx::{Sqlite, SqlitePool};

async fn engine() -> (Engine<Sqlite>, SqlitePool) {
    let pool = SqlitePool::connect("sqlite::memory:")
        .await
        .expect("sqlite");
    sqlx::query("CREATE TABLE invoices (month TEXT)")
        .execute(&pool)
        .await
        .expect("table");
    let store = SqliteStore::new(pool.clone());
    store.migrate().await.expect("migrate");
    (Engine::new(store), pool)
}

fn invoice(key: &str) -> (Scope, Fingerprint) {
    let scope = Scope::new(
        "billing-job",
        "RUN",
        "monthly-invoice",
        key.parse().expect("key"),
    );
    let fingerprint = Fingerprinter::new().fingerprint_value("invoice", b"2026-11");
    (scope, fingerprint)
}

#[tokio::test]
async fn a_failing_job_gets_its_response_back_as_an_error_and_the_key_runs_afresh() {
    let (engine, _pool) = engine().await;
    let (scope, fingerprint) = invoice("invoice-failing");
    let failed = engine
        .run(&scope, fingerprint, |mut tx: Tx<Sqlite>| async move {
            sqlx::query("INSERT INTO no_such_table VALUES (1)")
                .execute(&mut *tx)
                .await?;
            Ok::<_, TxError>("invoiced")
        })
        .await;
    match failed {
        Err(error @ RunError::Failed(_)) => {
            assert!(error.is_retryable(), "{error}");
            let RunError::Failed(response) = error else {
                unreachable!()
            };
            assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
        }
        other => panic!("expected the work's failure, got {other:?}"),
    }
    assert!(matches!(
        engine.lookup(&scope).await.expect("look up"),
        Lookup::Absent
    ));

    let again = engine
        .run(&scope, fingerprint, |mut tx: Tx<Sqlite>| async move {
            sqlx::query("INSERT INTO invoices (month) VALUES ('2026-11')")
                .execute(&mut *tx)
                .await?;
            Ok::<_, TxError>("invoiced")
        })
        .await
        .expect("runs afresh");
    assert_eq!(again.outcome, Outcome::Executed);
}

#[tokio::test]
async fn a_panicking_job_is_told_so() {
    let (engine, _pool) = engine().await;
    let (scope, fingerprint) = invoice("invoice-panicking");
    let panicked = engine
        .run(&scope, fingerprint, |_tx: Tx<Sqlite>| async {
            if true {
                panic!("the job has a bug");
            }
            "invoiced"
        })
        .await;
    assert!(matches!(panicked, Err(RunError::Panicked)), "{panicked:?}");
    assert!(panicked.is_err_and(|error| error.is_retryable()));
}

#[tokio::test]
async fn a_key_reused_for_another_intent_is_a_final_rejection() {
    let (engine, _pool) = engine().await;
    let (scope, fingerprint) = invoice("invoice-reused");
    engine
        .run(&scope, fingerprint, |_tx: Tx<Sqlite>| async { "invoiced" })
        .await
        .expect("runs");
    let other = Fingerprinter::new().fingerprint_value("invoice", b"2026-12");
    let reused = engine
        .run(&scope, other, |_tx: Tx<Sqlite>| async { "never runs" })
        .await;
    match reused {
        Err(error @ RunError::Rejected(Rejection::KeyReused)) => {
            assert!(!error.is_retryable(), "{error}");
        }
        other => panic!("expected the key reused, got {other:?}"),
    }
}

#[tokio::test]
async fn a_store_that_fails_is_named_as_the_cause() {
    let (engine, pool) = engine().await;
    let (scope, fingerprint) = invoice("invoice-store-down");
    pool.close().await;
    let down = engine
        .run(&scope, fingerprint, |_tx: Tx<Sqlite>| async {
            "never runs"
        })
        .await;
    match down {
        Err(error @ RunError::Store(_)) => {
            assert!(error.is_retryable(), "{error}");
            assert!(std::error::Error::source(&error).is_some(), "{error}");
        }
        other => panic!("expected the store's failure, got {other:?}"),
    }
}

/// Leased work under a 30 s lease, with nothing to recover, that answers `answer`.
async fn run_leased<R>(
    engine: &Engine<Sqlite>,
    (scope, fingerprint): &(Scope, Fingerprint),
    answer: R,
) -> Result<Execution, RunError>
where
    R: IntoResponse + Send + 'static,
{
    engine
        .run_leased(
            scope,
            *fingerprint,
            Duration::from_secs(30),
            || async { None::<&str> },
            |_lease| async move { answer },
        )
        .await
}

#[tokio::test]
async fn a_failing_leased_job_gets_its_response_back_as_an_error_and_the_key_runs_afresh() {
    let (engine, _pool) = engine().await;
    let job = invoice("invoice-leased-failing");
    let failed = run_leased(
        &engine,
        &job,
        (StatusCode::BAD_GATEWAY, "the bank did not answer"),
    )
    .await;
    match failed {
        Err(RunError::Failed(response)) => {
            assert_eq!(response.status(), StatusCode::BAD_GATEWAY);
            assert_eq!(response.body().as_ref(), b"the bank did not answer");
        }
        other => panic!("expected the work's failure, got {other:?}"),
    }

    let again = run_leased(&engine, &job, "invoiced")
        .await
        .expect("the lease was let go: runs afresh");
    assert_eq!(again.outcome, Outcome::Executed);
}

#[tokio::test]
async fn a_leased_job_on_a_failing_store_is_told_the_cause() {
    let (engine, pool) = engine().await;
    let job = invoice("invoice-leased-store-down");
    pool.close().await;
    let down = run_leased(&engine, &job, "never runs").await;
    assert!(matches!(down, Err(RunError::Store(_))), "{down:?}");
}
