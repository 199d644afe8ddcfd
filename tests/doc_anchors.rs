//! Every rejection's problem `type` is a link into the crate's docs: it must name the page
//! rustdoc writes for `Rejection` and an anchor that page has, one per variant. The test reads
//! the HTML `cargo doc` generates (run by the test, a no-op when the docs are current), so a renamed
//! variant or a moved module fails here rather than as a dead link on docs.rs.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use axum::response::IntoResponse;
use axum_idempotency::{IdempotencyKey, Rejection};
use http_body_util::BodyExt;

/// The docs of this very version: a problem `type` keeps naming what it meant when a later
/// release changes the docs.
const DOCS_RS: &str = concat!(
    "https://docs.rs/axum-idempotency/",
    env!("CARGO_PKG_VERSION"),
    "/"
);

/// One of each variant. `Rejection` is non-exhaustive, so a variant added later is caught by
/// the comparison with the anchors in the page, not by the compiler.
fn every_rejection() -> Vec<Rejection> {
    let invalid = match "".parse::<IdempotencyKey>() {
        Ok(_) => panic!("an empty key must not parse"),
        Err(error) => error,
    };
    vec![
        Rejection::KeyMissing,
        Rejection::KeyInvalid(invalid),
        Rejection::PrincipalMissing,
        Rejection::PrincipalUnavailable,
        Rejection::KeyReused,
        Rejection::InProgress {
            retry_after: Duration::from_secs(1),
        },
        Rejection::BodyTooLarge { limit: 1 },
        Rejection::LeaseLost,
        Rejection::BodyUnreadable,
        Rejection::ResponseTooLarge,
        Rejection::TransactionHeld,
        Rejection::Internal,
        Rejection::Timeout,
        Rejection::BodyTimeout,
        Rejection::Conflict,
        Rejection::LayerMissing {
            database: "SQLite",
            marker: None,
        },
    ]
}

async fn problem_type(rejection: Rejection) -> String {
    let body = rejection
        .into_response()
        .into_body()
        .collect()
        .await
        .expect("an in-memory body")
        .to_bytes();
    let problem: serde_json::Value = serde_json::from_slice(&body).expect("problem+json");
    problem["type"].as_str().expect("a type member").to_owned()
}

fn doc_root() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"))
        .join("doc")
}

/// The generated page at `path` (relative to the doc root). The docs are brought up to date
/// first, so a page left by an older build cannot answer for the current code; when they are
/// current, cargo does nothing.
fn generated_page(path: &str) -> String {
    let doc = Command::new(env!("CARGO"))
        .args(["doc", "--no-deps", "--all-features"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo doc runs");
    assert!(
        doc.status.success(),
        "cargo doc failed:\n{}",
        String::from_utf8_lossy(&doc.stderr)
    );
    let page = doc_root().join(path);
    std::fs::read_to_string(&page)
        .unwrap_or_else(|error| panic!("{} is not readable: {error}", page.display()))
}

#[tokio::test]
async fn every_rejection_type_names_an_anchor_of_the_generated_docs() {
    let mut linked = BTreeSet::new();
    let mut pages = BTreeSet::new();
    for rejection in every_rejection() {
        let url = problem_type(rejection).await;
        let relative = url
            .strip_prefix(DOCS_RS)
            .unwrap_or_else(|| panic!("{url} does not point at the crate's docs.rs pages"));
        let (page, anchor) = relative
            .split_once('#')
            .unwrap_or_else(|| panic!("{url} names no anchor"));
        pages.insert(page.to_owned());
        assert!(linked.insert(anchor.to_owned()), "{anchor} is linked twice");
    }
    assert_eq!(
        pages.len(),
        1,
        "all rejections are described on one page: {pages:?}"
    );
    let page = pages.pop_first().expect("one page");
    // The page rustdoc writes for a type is named after the module that defines it.
    let defined_in = std::any::type_name::<Rejection>().replace("::", "/");
    let expected = match defined_in.rsplit_once('/') {
        Some((module, name)) => format!("{module}/enum.{name}.html"),
        None => panic!("{defined_in} has no module"),
    };
    assert_eq!(page, expected);

    let html = generated_page(&page);
    let documented: BTreeSet<String> = html
        .split("id=\"")
        .skip(1)
        .filter_map(|rest| rest.split('"').next())
        // Fields of a variant get ids such as `variant.InProgress.field.retry_after`.
        .filter(|id| id.starts_with("variant.") && id.matches('.').count() == 1)
        .map(str::to_owned)
        .collect();
    assert_eq!(
        linked, documented,
        "the problem types and the variants documented on {page} differ"
    );
}
