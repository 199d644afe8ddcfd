//! Throughput of the per-request work that needs no database: parsing the key and
//! fingerprinting a JSON body (canonicalisation plus SHA-256).

use std::fmt::Write;
use std::hint::black_box;

use axum_idempotency::{Fingerprinter, IdempotencyKey, canonical_json};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};

/// An order-like JSON document of about `target` bytes: members out of key order, decimal
/// amounts, escapes and nesting, so every path of the canonicaliser is exercised.
fn order_body(target: usize) -> Vec<u8> {
    let mut s = String::from(
        "{\"request_time\": \"2025-01-01T10:00:00Z\", \"trace_id\": \"4bf92f3577b34da6\", \"items\": [",
    );
    let mut i = 0;
    while s.len() + 200 < target {
        if i > 0 {
            s.push_str(", ");
        }
        write!(
            s,
            "{{\"sku\": \"widget-{i}\", \"quantity\": {q}, \"amount\": {i}.50, \"currency\": \"EUR\", \
             \"note\": \"line \\\"{i}\\\" caf\\u00e9 é\", \"tags\": [\"a\", \"b\"], \
             \"meta\": {{\"z\": true, \"y\": null, \"x\": 1.0e2}}}}",
            q = i % 7 + 1
        )
        .unwrap();
        i += 1;
    }
    s.push_str("], \"customer\": {\"name\": \"Alice\", \"id\": 42}}");
    // Measuring the early exit on invalid input would flatter the figures.
    assert!(
        canonical_json(s.as_bytes(), &[]).is_some(),
        "the benchmark body is valid JSON"
    );
    s.into_bytes()
}

fn sizes() -> [(&'static str, Vec<u8>); 3] {
    [
        ("1KiB", order_body(1024)),
        ("64KiB", order_body(64 * 1024)),
        ("1MiB", order_body(1024 * 1024)),
    ]
}

fn key_parsing(c: &mut Criterion) {
    let mut group = c.benchmark_group("key_parse");
    group.throughput(Throughput::Elements(1));
    for (name, value) in [
        ("bare_uuid", "4b3f8f3e-4f3c-4a8e-9d3f-0a6c1b2d3e4f"),
        ("sf_string_uuid", "\"4b3f8f3e-4f3c-4a8e-9d3f-0a6c1b2d3e4f\""),
    ] {
        group.bench_function(name, |b| b.iter(|| IdempotencyKey::parse(black_box(value))));
    }
    group.finish();
}

fn canonical(c: &mut Criterion) {
    let mut group = c.benchmark_group("canonical_json");
    for (name, body) in sizes() {
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_with_input(BenchmarkId::from_parameter(name), &body, |b, body| {
            b.iter(|| canonical_json(black_box(body), &["/request_time", "/trace_id"]))
        });
    }
    group.finish();
}

fn fingerprint(c: &mut Criterion) {
    let fingerprinter = Fingerprinter::new().ignore_json_fields(["/request_time", "/trace_id"]);
    let (parts, ()) = http::Request::post("/orders?b=2&a=1")
        .header("content-type", "application/json")
        .body(())
        .unwrap()
        .into_parts();
    let mut group = c.benchmark_group("fingerprint_json");
    for (name, body) in sizes() {
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_with_input(BenchmarkId::from_parameter(name), &body, |b, body| {
            b.iter(|| fingerprinter.fingerprint(&parts, black_box(body)))
        });
    }
    group.finish();
}

criterion_group!(benches, key_parsing, canonical, fingerprint);
criterion_main!(benches);
