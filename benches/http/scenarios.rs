//! The throughput and latency scenarios: the order app's, the peer's and the middleware's
//! alone, measured in interleaved rounds against their baselines, with their ratios.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::body::Bytes;
use tokio::runtime::Runtime;

use crate::BoxError;
#[cfg(feature = "sqlite")]
use crate::apps::noop_app;
use crate::backends::Backend;
use crate::cpu::{self, ServerCpu};
#[cfg(feature = "sqlite")]
use crate::load::json_body;
use crate::load::{Keys, Plan, STORM, Sample, count_per_request, drive, storm};
use crate::order::ORDER_BODY;
use crate::peer::Peer;
use crate::report::{Report, Row, Target};
use crate::rss::PeakRss;
use crate::settings::{Settings, wanted};

/// Runs a duplicate storm on `plan` and returns its sample, how many keys it stormed and how
/// many orders the backend's table gained meanwhile.
fn measure_storm(
    server: &Runtime,
    client: &Runtime,
    peak: &PeakRss,
    backend: &Backend,
    plan: &Plan,
) -> Result<(Sample, u64, i64), BoxError> {
    let before = (backend.orders)(server)?;
    peak.reset();
    let (mut sample, keys) = client.block_on(storm(plan))?;
    sample.peak_mib = peak.peak_mib();
    let executed = (backend.orders)(server)? - before;
    Ok((sample, keys, executed))
}

/// The peer's process without its layer (`base`'s path there), and `path` under its layer with
/// fresh keys and with one key, named by `names` in that order.
fn peer_plans(
    peer: &Peer,
    base: &Plan,
    path: &'static str,
    names: [&'static str; 3],
) -> [(&'static str, Plan); 3] {
    let on_peer = Plan {
        addr: peer.addr,
        cookies: Arc::clone(&peer.cookies),
        ..base.clone()
    };
    let [bare, fresh, replay] = names;
    [
        (bare, on_peer.clone()),
        (
            fresh,
            Plan {
                path,
                keys: Keys::Fresh,
                ..on_peer.clone()
            },
        ),
        (
            replay,
            Plan {
                path,
                keys: Keys::Fixed,
                ..on_peer
            },
        ),
    ]
}

/// Measures `plans` (the `include`d ones) round after round, for `BENCH_ROUNDS` rounds of
/// `plan.duration` each; `None` for a plan left out, so that no empty sample reaches a table.
pub(crate) fn measure_rounds(
    settings: &Settings,
    client: &Runtime,
    peak: &PeakRss,
    plans: &[(&str, Plan)],
    include: fn(&str) -> bool,
    server: Option<ServerCpu>,
) -> Result<Vec<Option<Sample>>, BoxError> {
    let mut samples: Vec<Sample> = plans.iter().map(|_| Sample::default()).collect();
    for round in 0..settings.rounds {
        // Each round starts one scenario later, so no scenario always follows the same one
        // (a checkpoint or WAL growth left by a write-heavy neighbour lands on all in turn).
        for step in 0..plans.len() {
            let index = (step + round) % plans.len();
            let (name, plan) = &plans[index];
            if !include(name) {
                continue;
            }
            let total = &mut samples[index];
            let mut plan = plan.clone();
            plan.key_prefix = format!("{}-{name}-r{round}", plan.key_prefix);
            if plan.keys == Keys::Fixed {
                // One key for all rounds: only the very first request executes.
                plan.key_prefix = format!("{}-{name}", plans[0].1.key_prefix);
            }
            // Warm up off the clock (connections, prepared statements, the replayed record).
            let mut warm = plan.clone();
            warm.duration = Duration::from_millis(300);
            warm.key_prefix = format!("{}-warm", plan.key_prefix);
            if plan.keys == Keys::Fixed {
                warm.key_prefix = plan.key_prefix.clone();
            }
            client.block_on(drive(&warm, None))?;
            peak.reset();
            let cpu_before = server.map(ServerCpu::used);
            let app_before = cpu::own_process();
            let mut sample = client.block_on(drive(&plan, None))?;
            sample.app_cpu = cpu::own_process().saturating_sub(app_before);
            sample.server_cpu = server
                .zip(cpu_before)
                .map(|(server, before)| server.used().saturating_sub(before));
            sample.peak_mib = peak.peak_mib();
            total.merge(sample);
        }
    }
    Ok(plans
        .iter()
        .zip(samples)
        .map(|((name, _), sample)| include(name).then_some(sample))
        .collect())
}

/// The order app's scenarios: name, route, keys.
const ORDER_SCENARIOS: [(&str, &str, Keys); 4] = [
    ("bare", "/bare", Keys::None),
    ("manual", "/manual", Keys::Fresh),
    ("layer-fresh", "/layer", Keys::Fresh),
    ("layer-replay", "/layer", Keys::Fixed),
];

/// The order app at `addr`, `conns` connections sending orders for `BENCH_SECS` a round.
pub(crate) fn order_load(
    settings: &Settings,
    addr: SocketAddr,
    key_prefix: String,
    conns: usize,
) -> Plan {
    Plan {
        addr,
        path: "/bare",
        body: Bytes::from_static(ORDER_BODY.as_bytes()),
        keys: Keys::None,
        key_prefix,
        conns,
        duration: settings.duration(),
        limit: None,
        record_latency: true,
        cookies: Arc::from([]),
        stop: None,
    }
}

/// [`ORDER_SCENARIOS`] on `base`, those `include` keeps.
pub(crate) fn order_plans(base: &Plan, include: fn(&str) -> bool) -> Vec<(&'static str, Plan)> {
    ORDER_SCENARIOS
        .into_iter()
        .filter(|(name, _, _)| include(name))
        .map(|(name, path, keys)| {
            let plan = Plan {
                path,
                keys,
                ..base.clone()
            };
            (name, plan)
        })
        .collect()
}

pub(crate) fn run_backend(
    settings: &Settings,
    server: &Runtime,
    client: &Runtime,
    peak: &PeakRss,
    run: &str,
    backend: &Backend,
    report: &mut Report,
) -> Result<(), BoxError> {
    let name = backend.name;
    let peer = backend.peer.as_ref();
    eprintln!("[{name}] throughput…");
    let base = order_load(
        settings,
        backend.addr,
        format!("{run}-{name}"),
        settings.conns,
    );
    let mut plans = order_plans(&base, |_| true);
    plans.push((
        "layer-replay-cached",
        Plan {
            path: "/layer-cached",
            keys: Keys::Fixed,
            ..base.clone()
        },
    ));
    if let Some(peer) = peer {
        plans.extend(peer_plans(
            peer,
            &base,
            "/peer",
            ["peer-bare", "peer-fresh", "peer-replay"],
        ));
    }
    let samples = measure_rounds(settings, client, peak, &plans, wanted, ServerCpu::of(name))?;
    for ((scenario, _), sample) in plans.iter().zip(samples) {
        let Some(sample) = sample else { continue };
        let note = match *scenario {
            "peer-bare" => "axum-idempotent's process, no layer",
            "peer-fresh" => "axum-idempotent, new keys",
            "peer-replay" => "axum-idempotent, one key per session",
            _ => "",
        };
        report.rows.push(Row {
            group: name.into(),
            scenario: (*scenario).into(),
            conns: settings.conns,
            sample,
            note: note.into(),
        });
    }

    let storm_plan = Plan {
        path: "/layer",
        duration: settings.duration().mul_f64(settings.rounds as f64),
        key_prefix: format!("{run}-{name}-storm"),
        ..base.clone()
    };
    if wanted("layer-storm") {
        eprintln!("[{name}] storm…");
        let (sample, keys, executed) = measure_storm(server, client, peak, backend, &storm_plan)?;
        report.rows.push(Row {
            group: name.into(),
            scenario: "layer-storm".into(),
            conns: STORM,
            sample,
            note: format!("{keys} keys × {STORM} duplicates; orders inserted: {executed}"),
        });
    }

    if let Some(peer) = peer.filter(|_| wanted("peer-storm")) {
        eprintln!("[{name}] peer storm…");
        let peer_storm = Plan {
            addr: peer.addr,
            path: "/peer",
            cookies: Arc::clone(&peer.cookies),
            key_prefix: format!("{run}-{name}-peer-storm"),
            ..storm_plan
        };
        let (sample, keys, executed) = measure_storm(server, client, peak, backend, &peer_storm)?;
        report.rows.push(Row {
            group: name.into(),
            scenario: "peer-storm".into(),
            conns: STORM,
            sample,
            note: format!(
                "axum-idempotent: {keys} keys × {STORM} duplicates in one session; \
                 orders inserted: {executed}"
            ),
        });
    }

    report.ratio(name, "manual", "bare", None);
    // MySQL keeps the claim's row as the key's lock (two writes), so its bar is lower.
    let over_manual = match name {
        "mysql" => Target::AtLeast(1.0),
        _ => Target::AtLeast(1.1),
    };
    report.ratio(name, "layer-fresh", "manual", Some(over_manual));
    let fresh_target = match name {
        "postgres" => Some(Target::AtLeast(0.75)),
        "mysql" => Some(Target::AtLeast(0.65)),
        _ => None,
    };
    report.ratio(name, "layer-fresh", "bare", fresh_target);
    report.ratio(name, "layer-replay", "bare", Some(Target::AtLeast(1.5)));
    report.ratio(name, "layer-replay-cached", "bare", None);
    if peer.is_some() {
        report.ratio(name, "peer-bare", "bare", None);
        report.ratio(name, "peer-fresh", "bare", None);
        report.ratio(name, "peer-replay", "bare", None);
        report.ratio(name, "peer-fresh", "peer-bare", None);
        report.ratio(name, "peer-replay", "peer-bare", None);
        report.ratio(name, "layer-fresh", "peer-fresh", None);
        report.ratio(name, "layer-replay", "peer-replay", None);
    }

    if !wanted("round-trips") {
        return Ok(());
    }
    eprintln!("[{name}] counting round trips…");
    let wire = backend.wire.as_deref();
    for (scenario, path, keys) in ORDER_SCENARIOS {
        let prefix = format!("{run}-{name}-count-{scenario}");
        let (statements, trips) = client.block_on(count_per_request(
            backend.counting_addr,
            path,
            keys,
            &prefix,
            settings.trips,
            wire,
        ))?;
        let (trips, pings, total) = trips.map_or_else(
            || ("– (in-process)".into(), "–".into(), "–".into()),
            |(trips, pings)| {
                (
                    format!("{trips:.2}"),
                    format!("{pings:.2}"),
                    format!("{:.2}", trips + pings),
                )
            },
        );
        report.trips.push(format!(
            "| {name} | {scenario} | {statements:.2} | {trips} | {pings} | {total} |"
        ));
    }
    Ok(())
}

/// [`ORDER_SCENARIOS`] as sequential requests on one connection, with nothing queued behind
/// another client's request: what one caller waits. On loopback (`latency`), and through the
/// delay proxy (`latency-1ms`), where each database round trip costs the network's.
pub(crate) fn run_latency(
    settings: &Settings,
    client: &Runtime,
    peak: &PeakRss,
    run: &str,
    backend: &Backend,
    report: &mut Report,
) -> Result<(), BoxError> {
    let name = backend.name;
    let delay_ms = settings.delay.as_secs_f64() * 1000.0;
    let links = [
        ("latency", Some(backend.addr), name.to_owned(), ""),
        (
            "latency-1ms",
            backend.delayed.as_ref().map(|(addr, _)| *addr),
            format!("{name} +{delay_ms} ms each way"),
            " (what a user on a cloud database sees)",
        ),
    ];
    for (section, addr, group, label) in links {
        let Some(addr) = addr.filter(|_| wanted(section)) else {
            continue;
        };
        eprintln!("[{name}] {section}…");
        let base = order_load(settings, addr, format!("{run}-{name}-{section}"), 1);
        let plans = order_plans(&base, |_| true);
        let samples = measure_rounds(settings, client, peak, &plans, |_| true, None)?;
        for ((scenario, _), sample) in plans.iter().zip(samples) {
            let Some(sample) = sample else { continue };
            report.latency.push(Row {
                group: group.clone(),
                scenario: (*scenario).into(),
                conns: 1,
                sample,
                note: String::new(),
            });
        }
        // The target is the network databases'; SQLite's figure is there to compare with.
        // One network hop away, round trips dominate and the layer must add none.
        let bound = if section == "latency" { 1.25 } else { 1.05 };
        let target = (name != "sqlite").then_some(Target::AtMost(bound));
        report.latency_ratio(&group, "layer-fresh", "bare", target, label);
    }
    if let Some((_, wire)) = backend.delayed.as_ref().filter(|_| wanted("latency-1ms")) {
        report.notes.push(format!(
            "- {name}, latency-1ms: the proxy held each of {} chunks {:.3} ms on average \
             (`BENCH_DELAY_MS` = {delay_ms}), in each direction.",
            wire.chunks.load(Ordering::Relaxed),
            wire.mean_hold_ms()
        ));
    }
    Ok(())
}

#[cfg(feature = "sqlite")]
pub(crate) fn run_noop(
    settings: &Settings,
    server: &Runtime,
    client: &Runtime,
    peak: &PeakRss,
    run: &str,
    peer: Option<&Peer>,
    report: &mut Report,
) -> Result<(), BoxError> {
    eprintln!("[noop] throughput…");
    let shm = std::path::Path::new("/dev/shm");
    let dir = if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
    .join(format!("axum-idempotency-bench-{run}"));
    std::fs::create_dir_all(&dir)?;
    let addr = noop_app(server, &dir);
    let addr = addr?;
    let base = Plan {
        addr,
        path: "/noop",
        body: json_body(1024),
        keys: Keys::None,
        key_prefix: format!("{run}-noop"),
        conns: settings.conns,
        duration: settings.duration(),
        limit: None,
        record_latency: true,
        cookies: Arc::from([]),
        stop: None,
    };
    let mut plans = vec![
        ("noop", base.clone()),
        (
            "noop-layer-nokey",
            Plan {
                path: "/noop-optional",
                ..base.clone()
            },
        ),
        (
            "noop-layer-replay-cached",
            Plan {
                path: "/noop-layer-cached",
                keys: Keys::Fixed,
                ..base.clone()
            },
        ),
        (
            "noop-layer-replay",
            Plan {
                path: "/noop-layer",
                keys: Keys::Fixed,
                ..base.clone()
            },
        ),
        (
            "noop-layer-fresh",
            Plan {
                path: "/noop-layer",
                keys: Keys::Fresh,
                ..base.clone()
            },
        ),
    ];
    if let Some(peer) = peer {
        plans.extend(peer_plans(
            peer,
            &base,
            "/noop-peer",
            ["noop-peer-bare", "noop-peer-fresh", "noop-peer-replay"],
        ));
    }
    let samples = measure_rounds(settings, client, peak, &plans, wanted, None)?;
    let notes = [
        "no layer",
        "layer, no key (allow_missing_key): pass-through",
        "layer with .cache_replays, one key: parse, buffer, fingerprint, replay from memory",
        "layer, one key: parse, buffer, fingerprint, 1 indexed read (tmpfs SQLite), replay",
        "layer, new keys: full claim/record on tmpfs SQLite",
        "axum-idempotent's process, no layer",
        "axum-idempotent, new keys: 1 read, handler, 1 write (in-memory moka store)",
        "axum-idempotent, one key per session: 1 read (in-memory moka store), replay",
    ];
    for (((scenario, _), sample), note) in plans.iter().zip(samples).zip(notes) {
        let Some(sample) = sample else { continue };
        report.rows.push(Row {
            group: "noop 1 KiB".into(),
            scenario: (*scenario).into(),
            conns: settings.conns,
            sample,
            note: note.into(),
        });
    }
    report.ratio(
        "noop 1 KiB",
        "noop-layer-replay-cached",
        "noop",
        Some(Target::AtLeast(0.8)),
    );
    report.ratio(
        "noop 1 KiB",
        "noop-layer-replay",
        "noop",
        Some(Target::AtLeast(0.8)),
    );
    report.ratio(
        "noop 1 KiB",
        "noop-layer-fresh",
        "noop",
        Some(Target::AtLeast(0.8)),
    );
    report.ratio("noop 1 KiB", "noop-layer-nokey", "noop", None);
    if peer.is_some() {
        report.ratio("noop 1 KiB", "noop-peer-bare", "noop", None);
        report.ratio("noop 1 KiB", "noop-peer-replay", "noop-peer-bare", None);
        report.ratio("noop 1 KiB", "noop-peer-fresh", "noop-peer-bare", None);
        report.ratio(
            "noop 1 KiB",
            "noop-layer-replay-cached",
            "noop-peer-replay",
            None,
        );
        report.ratio("noop 1 KiB", "noop-layer-replay", "noop-peer-replay", None);
        report.ratio("noop 1 KiB", "noop-layer-fresh", "noop-peer-fresh", None);
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
