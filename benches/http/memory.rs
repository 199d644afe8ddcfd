//! The memory sections: RSS over a long soak of fresh keys, and the peak under concurrent
//! 1 MiB requests.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use axum::body::Bytes;
use tokio::runtime::Runtime;

use crate::BoxError;
use crate::backends::Backend;
use crate::load::{Keys, Plan, drive, json_body};
use crate::order::ORDER_BODY;
use crate::report::Report;
use crate::rss::{PeakRss, rss_mib};
use crate::settings::Settings;

/// How long the memory test sends 1 MiB bodies on each route: long enough for every
/// connection to have several requests in flight one after another.
const MEMORY_RUN: Duration = Duration::from_secs(3);

pub(crate) fn run_big_bodies(
    settings: &Settings,
    client: &Runtime,
    peak: &PeakRss,
    run: &str,
    backend: &Backend,
    report: &mut Report,
) -> Result<(), BoxError> {
    const MIB: usize = 1024 * 1024;
    eprintln!("[memory] {} concurrent 1 MiB requests…", settings.big);
    let body = json_body(MIB);
    let name = backend.name;
    report.memory.push(format!(
        "{} connections, each sending 1 MiB JSON bodies (the layer's default limit is 1 MiB) \
         back to back for {} s, on {name}:\n",
        settings.big,
        MEMORY_RUN.as_secs()
    ));
    report
        .memory
        .push("| route | requests | non-2xx | RSS before MiB | peak RSS MiB | peak − before, MiB per in-flight request |".into());
    report.memory.push("|---|---:|---:|---:|---:|---:|".into());
    for (label, path, keys) in [
        ("bare", "/bare", Keys::None),
        ("layer-fresh", "/layer", Keys::Fresh),
    ] {
        let plan = Plan {
            addr: backend.addr,
            path,
            body: body.clone(),
            keys,
            key_prefix: format!("{run}-{name}-big-{label}"),
            conns: settings.big,
            duration: MEMORY_RUN,
            limit: None,
            record_latency: false,
            cookies: Arc::from([]),
            stop: None,
        };
        let before = rss_mib();
        peak.reset();
        let sample = client.block_on(drive(&plan, None))?;
        let top = peak.peak_mib();
        report.memory.push(format!(
            "| {label} | {} | {} | {before:.1} | {top:.1} | {:.2} |",
            sample.requests,
            sample.unexpected,
            (top - before) / settings.big as f64
        ));
    }
    Ok(())
}

pub(crate) fn run_soak(
    settings: &Settings,
    client: &Runtime,
    run: &str,
    backend: &Backend,
    report: &mut Report,
) -> Result<(), BoxError> {
    let name = backend.name;
    eprintln!(
        "[soak] layer-fresh on {name}, up to {} requests or {} s…",
        settings.soak_requests, settings.soak_secs
    );
    let plan = Plan {
        addr: backend.addr,
        path: "/layer",
        body: Bytes::from_static(ORDER_BODY.as_bytes()),
        keys: Keys::Fresh,
        key_prefix: format!("{run}-{name}-soak"),
        conns: settings.conns,
        duration: Duration::from_secs_f64(settings.soak_secs),
        limit: Some(settings.soak_requests),
        // Recording latencies would itself grow memory by 4 bytes a request.
        record_latency: false,
        cookies: Arc::from([]),
        stop: None,
    };
    let progress = Arc::new(AtomicU64::new(0));
    let watched = Arc::clone(&progress);
    let finished = Arc::new(AtomicBool::new(false));
    let stop = Arc::clone(&finished);
    let every = Duration::from_secs_f64((settings.soak_secs / 10.0).max(0.5));
    let sampler = std::thread::spawn(move || {
        let mut points = vec![(0, rss_mib())];
        while !stop.load(Ordering::Relaxed) {
            std::thread::sleep(every);
            points.push((watched.load(Ordering::Relaxed), rss_mib()));
        }
        points
    });
    let sample = client.block_on(drive(&plan, Some(progress)));
    finished.store(true, Ordering::Relaxed);
    let points = sampler.join().map_err(|_| "the RSS sampler panicked")?;
    let sample = sample?;
    report.soak.push(format!(
        "layer-fresh on {name}, {} connections: {} requests in {:.0} s ({:.0} req/s), {} non-2xx \
         (target 1000000 requests; `BENCH_SOAK_SECS` / `BENCH_SOAK_REQUESTS` set the length).\n",
        settings.conns,
        sample.requests,
        sample.elapsed.as_secs_f64(),
        sample.rps(),
        sample.unexpected
    ));
    report.soak.push("| requests so far | VmRSS MiB |".into());
    report.soak.push("|---:|---:|".into());
    for (requests, rss) in &points {
        report.soak.push(format!("| {requests} | {rss:.1} |"));
    }
    // Growth between the first sample after warm-up (10 %) and the last.
    if let (Some(first), Some(last)) = (points.get(1), points.last())
        && last.0 > first.0
    {
        let per_100k = (last.1 - first.1) / (last.0 - first.0) as f64 * 100_000.0;
        report.soak.push(format!(
            "\nGrowth from {} to {} requests: {:+.1} MiB ({per_100k:+.2} MiB per 100k requests).",
            first.0,
            last.0,
            last.1 - first.1
        ));
    }
    Ok(())
}
