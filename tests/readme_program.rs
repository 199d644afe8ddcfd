//! The README's "Use it" program, built and run as a reader would: its `toml` block becomes
//! the `[dependencies]` of a fresh cargo project (with this repository standing in for the
//! published crate, same features), its `rust` block becomes `src/main.rs`, and nothing else is
//! added. That block must be `examples/basic.rs` as it is, so the program a reader copies from
//! the README and the one `cargo run --example basic` serves are one. The program is built
//! offline and run on a fresh SQLite file; a keyed `POST` must be created, replayed and refused
//! as the README says, and SIGTERM must stop it cleanly. The same dependencies must not bring
//! another database's driver, as the README says.
//!
//! The build shares a target directory across runs (`<target>/readme-program`), so only the
//! first run compiles the dependencies.

mod common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use common::markdown::fenced_blocks;
use common::process::{Answer, Http};
use http::{Request, StatusCode};
use http_body_util::Full;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

const README: &str = include_str!("../README.md");
const BASIC: &str = include_str!("../examples/basic.rs");

/// The fenced blocks of the README's "Use it" section, as (info string, content).
fn use_it_blocks() -> Vec<(String, String)> {
    let start = README
        .find("\n## Use it\n")
        .expect("the README has a \"Use it\" section");
    let section = &README[start + 1..];
    let section = section[3..]
        .find("\n## ")
        .map_or(section, |end| &section[..end + 3]);
    fenced_blocks(section)
}

/// The one block whose info string starts with `language`.
fn block(blocks: &[(String, String)], language: &str) -> String {
    let mut found = blocks
        .iter()
        .filter(|(info, _)| info.split(',').next() == Some(language));
    let (_, content) = found
        .next()
        .unwrap_or_else(|| panic!("no {language} block in the README's \"Use it\" section"));
    assert!(
        found.next().is_none(),
        "several {language} blocks in \"Use it\": the test would not know which one is the program's"
    );
    content.clone()
}

/// The README's dependency list with the published crate replaced by this repository.
fn manifest(dependencies: &str, repo: &Path) -> String {
    let mut lines = dependencies.lines();
    assert_eq!(lines.next(), Some("[dependencies]"), "{dependencies}");
    let mut manifest = String::from(
        "[package]\nname = \"readme-program\"\nversion = \"0.0.0\"\nedition = \"2024\"\n\
         publish = false\n\n[dependencies]\n",
    );
    let mut crate_listed = false;
    for line in lines {
        assert!(
            !line.trim_start().starts_with('['),
            "the README's dependency list has a second section: {line}"
        );
        if let Some(spec) = line.strip_prefix("axum-idempotency = ") {
            let version = "version = \"0.1\"";
            assert!(spec.contains(version), "{line}");
            let path = format!("path = {:?}", repo.display().to_string());
            manifest.push_str(&format!(
                "axum-idempotency = {}\n",
                spec.replace(version, &path)
            ));
            crate_listed = true;
        } else {
            manifest.push_str(line);
            manifest.push('\n');
        }
    }
    assert!(
        crate_listed,
        "the README's dependencies lack axum-idempotency"
    );
    manifest
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"))
        .join("readme-program")
}

/// Writes the project: the README's dependencies and program, and the repository's lock file.
fn write_project(project: &Path) {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let blocks = use_it_blocks();
    std::fs::create_dir_all(project.join("src")).expect("project dir");
    std::fs::write(
        project.join("Cargo.toml"),
        manifest(&block(&blocks, "toml"), repo),
    )
    .expect("Cargo.toml");
    std::fs::write(project.join("src/main.rs"), block(&blocks, "rust")).expect("main.rs");
    // The repository's lock file: the same versions as the crate's own build, all of them in
    // the local registry cache, so the build needs no network.
    std::fs::copy(repo.join("Cargo.lock"), project.join("Cargo.lock")).expect("Cargo.lock");
}

fn cargo() -> std::process::Command {
    std::process::Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// Writes the project and builds it offline; returns the binary.
fn build(project: &Path) -> PathBuf {
    write_project(project);
    let target = target_dir();
    let output = cargo()
        .args(["build", "--offline", "--quiet"])
        .current_dir(project)
        .env("CARGO_TARGET_DIR", &target)
        .env_remove("RUSTFLAGS")
        .output()
        .expect("cargo runs");
    assert!(
        output.status.success(),
        "the README's program does not build with the README's dependencies:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    target.join("debug").join("readme-program")
}

fn order(key: &str, body: &'static str, url: &str) -> Request<Full<Bytes>> {
    Request::post(format!("{url}/orders"))
        .header("authorization", "Bearer alice-token")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .expect("a request")
}

fn replayed(answer: &Answer) -> Option<&str> {
    answer
        .headers
        .get("idempotent-replayed")
        .and_then(|v| v.to_str().ok())
}

/// The README shows the whole of `examples/basic.rs`: an edit to either that leaves the other
/// behind fails here, and the example's own build and this test's run then cover the README.
#[test]
fn the_readme_program_is_the_basic_example() {
    let program = block(&use_it_blocks(), "rust");
    if program != BASIC {
        let differs = program
            .lines()
            .zip(BASIC.lines())
            .position(|(readme, example)| readme != example)
            .unwrap_or_else(|| program.lines().count().min(BASIC.lines().count()));
        panic!(
            "the README's \"Use it\" program and examples/basic.rs differ from line {}",
            differs + 1
        );
    }
}

/// The README says its SQLite build compiles no other database: a driver the program never
/// opens would only lengthen a fresh build.
#[test]
fn the_readme_dependencies_compile_no_other_database() {
    let project = tempfile::tempdir().expect("temp dir");
    write_project(project.path());
    let output = cargo()
        .args([
            "tree",
            "--offline",
            "--edges",
            "normal,build",
            "--prefix",
            "none",
        ])
        .args(["--format", "{p}"])
        .current_dir(project.path())
        .output()
        .expect("cargo runs");
    assert!(
        output.status.success(),
        "cargo tree fails on the README's dependencies:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let tree = String::from_utf8_lossy(&output.stdout);
    assert!(
        tree.lines().any(|line| line.starts_with("sqlx-sqlite ")),
        "{tree}"
    );
    let mut others: Vec<&str> = tree
        .lines()
        .filter(|line| line.starts_with("sqlx-postgres ") || line.starts_with("sqlx-mysql "))
        .collect();
    others.sort_unstable();
    others.dedup();
    assert!(
        others.is_empty(),
        "the README's SQLite build compiles another database: {others:?}"
    );
}

#[tokio::test]
async fn the_readme_program_builds_with_its_listed_dependencies_and_replays() {
    let project = tempfile::tempdir().expect("temp dir");
    let binary = build(project.path());
    // A fresh database file of the test's own, which the program creates.
    let database = format!("sqlite://{}", project.path().join("basic.db").display());

    let mut program = Command::new(&binary)
        .env("DATABASE_URL", &database)
        .env("BIND", "127.0.0.1:0")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("the program starts");
    let mut lines = BufReader::new(program.stdout.take().expect("stdout")).lines();
    let url = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(line) = lines.next_line().await.expect("stdout") {
            if let Some(url) = line.strip_prefix("listening on ") {
                return url.trim().to_owned();
            }
        }
        panic!("the program exited before listening");
    })
    .await
    .expect("the program listens within 30 s");

    let http = Http::new();
    let key = "7c1e4b0a-5d2f-4e8a-9b6c-3f0d2a1e8b57";
    let first = http
        .call(order(key, r#"{"sku":"widget","quantity":2}"#, &url))
        .await;
    assert_eq!(first.status, StatusCode::CREATED, "{:?}", first.body);
    assert_eq!(replayed(&first), None);
    assert_eq!(first.json()["status"], "created");

    // The same intent spelled differently, with a field the program declares intent-neutral.
    let retry = http
        .call(order(
            key,
            r#"{ "quantity": 2, "sku": "widget", "trace_id": "retry-1" }"#,
            &url,
        ))
        .await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(replayed(&retry), Some("true"));
    assert_eq!(retry.body, first.body);
    assert_eq!(retry.headers.get("location"), first.headers.get("location"));

    let other = http
        .call(order(key, r#"{"sku":"widget","quantity":3}"#, &url))
        .await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(other.json()["code"], "idempotency_key_reused");

    let stranger = http
        .call(
            Request::post(format!("{url}/orders"))
                .header("authorization", "Bearer mallory-token")
                .header("idempotency-key", key)
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from_static(
                    b"{\"sku\":\"widget\",\"quantity\":2}",
                )))
                .expect("a request"),
        )
        .await;
    assert_eq!(stranger.status, StatusCode::UNAUTHORIZED);

    let db = sqlx::SqlitePool::connect(&database)
        .await
        .expect("the program's database");
    let orders: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(&db)
        .await
        .expect("the program's table");
    assert_eq!(orders, 1, "one intent, one order");
    db.close().await;

    // SIGTERM, as Kubernetes and systemd stop a service: a clean exit, not the default action.
    let pid = program.id().expect("still running");
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .expect("kill(1) runs");
    assert!(killed.success());
    let exit = tokio::time::timeout(Duration::from_secs(15), program.wait())
        .await
        .expect("the program stops within 15 s of SIGTERM")
        .expect("wait");
    assert!(exit.success(), "SIGTERM ended the program with {exit}");
}
