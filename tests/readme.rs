//! The README's transcript, run as written: every `curl` in its "Try it" section, then every
//! one in the guide's `orders` chapter, which continues the session, is sent to the `orders`
//! example, started on a fresh SQLite file, and the answer must be the one the document prints
//! under it (status, the headers it shows, the body). A first execution must not carry
//! `Idempotent-Replayed` unless the document shows it.
//!
//! The transcript is a sequence of a ```` ```sh ```` block holding one `curl` command and the
//! ```` ```text ```` block after it holding the answer as `curl -si` prints it (headers
//! abridged to those shown). In an expected JSON body, the string `"<any>"` matches any value.

mod common;

use bytes::Bytes;
use common::markdown::fenced_blocks;
use common::process::{Http, Process};
use http::{HeaderName, Request};
use http_body_util::Full;
use serde_json::Value;

const README: &str = include_str!("../README.md");
const GUIDE: &str = include_str!("../src/guide.rs");

/// One step of the transcript.
#[derive(Debug)]
struct Step {
    command: String,
    method: String,
    path: String,
    headers: Vec<(String, String)>,
    body: Option<String>,
    expected: Expected,
}

#[derive(Debug)]
struct Expected {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

/// Splits a shell command into words: single and double quotes, backslash-newline
/// continuations, `#` comment lines. Enough for the README's curl lines, not a shell.
fn shell_words(command: &str) -> Vec<String> {
    let joined: String = command
        .lines()
        .filter(|line| !line.trim_start().starts_with('#'))
        .map(|line| line.trim_end().trim_end_matches('\\'))
        .collect::<Vec<_>>()
        .join(" ");
    let mut words = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut chars = joined.chars();
    while let Some(c) = chars.next() {
        match c {
            '\'' => {
                in_word = true;
                for c in chars.by_ref() {
                    if c == '\'' {
                        break;
                    }
                    word.push(c);
                }
            }
            '"' => {
                in_word = true;
                while let Some(c) = chars.next() {
                    match c {
                        '"' => break,
                        '\\' => word.extend(chars.next()),
                        c => word.push(c),
                    }
                }
            }
            c if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            c => {
                in_word = true;
                word.push(c);
            }
        }
    }
    if in_word {
        words.push(word);
    }
    words
}

fn header_line(line: &str) -> (String, String) {
    let (name, value) = line
        .split_once(':')
        .unwrap_or_else(|| panic!("not a header line: {line:?}"));
    (name.trim().to_ascii_lowercase(), value.trim().to_owned())
}

fn parse_step(command: &str, answer: &str) -> Step {
    let words = shell_words(command);
    assert_eq!(words.first().map(String::as_str), Some("curl"), "{command}");
    let mut method = None;
    let mut url = None;
    let mut headers = Vec::new();
    let mut body = None;
    let mut rest = words[1..].iter();
    while let Some(word) = rest.next() {
        let mut value = || {
            rest.next()
                .unwrap_or_else(|| panic!("{word} needs a value in {command}"))
                .clone()
        };
        match word.as_str() {
            "-X" => method = Some(value()),
            "-H" => headers.push(header_line(&value())),
            "-d" => body = Some(value()),
            "-s" | "-i" | "-si" | "-is" => {}
            flag if flag.starts_with('-') => panic!("the test does not know {flag}: {command}"),
            _ => url = Some(word.clone()),
        }
    }
    let url = url.unwrap_or_else(|| panic!("no URL in {command}"));
    let without_scheme = url.strip_prefix("http://").unwrap_or(&url);
    let path = without_scheme
        .find('/')
        .map_or("/", |slash| &without_scheme[slash..])
        .to_owned();
    let method = method.unwrap_or_else(|| if body.is_some() { "POST" } else { "GET" }.into());

    let (head, expected_body) = answer.split_once("\n\n").unwrap_or((answer, ""));
    let mut head = head.lines();
    let status_line = head.next().unwrap_or_default();
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status in {status_line:?}"));
    Step {
        command: command.trim().to_owned(),
        method,
        path,
        headers,
        body,
        expected: Expected {
            status,
            headers: head.map(header_line).collect(),
            body: expected_body.trim().to_owned(),
        },
    }
}

/// The README's "Try it" section.
fn readme_section() -> &'static str {
    let start = README
        .find("\n## Try it")
        .expect("the README has a \"Try it\" section");
    let section = &README[start + 1..];
    section[3..]
        .find("\n## ")
        .map_or(section, |end| &section[..end + 3])
}

/// The Markdown of the guide's `orders` chapter: its doc comment, without the `///`.
fn guide_section() -> String {
    let start = GUIDE
        .find("/// # The `orders` example, continued")
        .expect("the guide has the orders chapter");
    let end = GUIDE[start..]
        .find("pub mod orders {}")
        .expect("the orders chapter ends");
    GUIDE[start..start + end]
        .lines()
        .map(|line| {
            let line = line.trim_start().trim_start_matches("///");
            line.strip_prefix(' ').unwrap_or(line)
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The transcript: the `curl` blocks of the README's "Try it" section and then of the guide's
/// `orders` chapter, each with the answer after it.
fn transcript() -> Vec<Step> {
    let mut all = steps(readme_section());
    all.extend(steps(&guide_section()));
    all
}

/// The steps of one document's part of the transcript.
fn steps(section: &str) -> Vec<Step> {
    let blocks = fenced_blocks(section);
    let mut steps = Vec::new();
    let mut blocks = blocks.iter().peekable();
    while let Some((info, content)) = blocks.next() {
        if info != "sh" || !content.trim_start().starts_with("curl") {
            continue;
        }
        match blocks.peek() {
            Some((info, answer)) if info == "text" && answer.starts_with("HTTP/") => {
                steps.push(parse_step(content, answer));
            }
            _ => panic!("no answer follows {content}"),
        }
    }
    steps
}

/// Whether `actual` is `expected`, where the string `"<any>"` in `expected` matches anything.
fn json_matches(expected: &Value, actual: &Value) -> bool {
    match (expected, actual) {
        (Value::String(marker), _) if marker == "<any>" => true,
        (Value::Object(e), Value::Object(a)) => {
            e.len() == a.len()
                && e.iter()
                    .all(|(k, v)| a.get(k).is_some_and(|a| json_matches(v, a)))
        }
        (Value::Array(e), Value::Array(a)) => {
            e.len() == a.len() && e.iter().zip(a).all(|(e, a)| json_matches(e, a))
        }
        (e, a) => e == a,
    }
}

#[test]
fn the_transcript_parses_into_steps() {
    assert!(
        steps(readme_section()).len() >= 5,
        "the README's transcript lost its steps"
    );
    assert!(
        steps(&guide_section()).len() >= 3,
        "the guide's transcript lost its steps"
    );
    let steps = transcript();
    for step in &steps {
        assert!(step.path.starts_with('/'), "{step:#?}");
    }
}

#[tokio::test]
async fn the_readme_transcript_is_what_the_orders_example_answers() {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("orders.db").display());
    let orders = Process::start("orders", &[("DATABASE_URL", url.as_str())]).await;
    let http = Http::new();

    for (n, step) in transcript().into_iter().enumerate() {
        let mut request = Request::builder()
            .method(step.method.as_str())
            .uri(format!("{}{}", orders.url, step.path));
        for (name, value) in &step.headers {
            request = request.header(name.as_str(), value.as_str());
        }
        let body = Bytes::from(step.body.clone().unwrap_or_default());
        let answer = http
            .call(request.body(Full::new(body)).expect("a request"))
            .await;
        let shown = String::from_utf8_lossy(&answer.body);
        let context = format!(
            "step {} of the transcript:\n{}\nanswered {} {shown}",
            n + 1,
            step.command,
            answer.status
        );

        assert_eq!(answer.status.as_u16(), step.expected.status, "{context}");
        for (name, value) in &step.expected.headers {
            let actual = answer
                .headers
                .get(name.as_str())
                .and_then(|v| v.to_str().ok());
            assert_eq!(actual, Some(value.as_str()), "header {name}: {context}");
        }
        let replayed = HeaderName::from_static("idempotent-replayed");
        if !step
            .expected
            .headers
            .iter()
            .any(|(name, _)| name == replayed.as_str())
        {
            assert!(
                !answer.headers.contains_key(&replayed),
                "not a replay: {context}"
            );
        }
        match serde_json::from_str::<Value>(&step.expected.body) {
            Ok(expected) => {
                let actual: Value = serde_json::from_slice(&answer.body)
                    .unwrap_or_else(|_| panic!("a JSON body: {context}"));
                assert!(json_matches(&expected, &actual), "body: {context}");
            }
            Err(_) => assert_eq!(shown.trim(), step.expected.body, "body: {context}"),
        }
    }
    orders.kill().await;
}
