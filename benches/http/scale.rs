//! The opt-in `scale` section: a records table filled server-side with rows that look like real
//! completed records, the layer measured at that size, and `purge_expired()` under load.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tokio::runtime::Runtime;

use crate::BoxError;
use crate::backends::Backend;
use crate::fill::{FILL_CHUNK, filler_insert};
use crate::load::{Keys, Plan, Sample, drive};
use crate::order::now_ms;
use crate::report::{Report, Target};
use crate::rss::PeakRss;
use crate::scenarios::{measure_rounds, order_load, order_plans};
use crate::settings::Settings;

/// The layer's wait for an in-flight duplicate, `Engine::new`'s default, which the apps keep.
const IN_FLIGHT_WAIT: Duration = Duration::from_secs(5);

/// How long the load alongside `purge_expired()` may run at most, should the purge not end.
const PURGE_LOAD_CAP: Duration = Duration::from_secs(3600);

/// The layer on an empty records table and on one of `BENCH_SCALE` rows, then
/// `purge_expired()` of the expired ones while layer-fresh load runs, against the same load
/// without it for `BENCH_SECS` × `BENCH_ROUNDS` just before (before, so that the vacuum or purge
/// work the deletes leave behind cannot slow the baseline and flatter the ratio).
pub(crate) fn run_scale(
    settings: &Settings,
    server: &Runtime,
    client: &Runtime,
    peak: &PeakRss,
    run: &str,
    backend: &Backend,
    report: &mut Report,
) -> Result<(), BoxError> {
    let Some((rows, expired)) = settings.scale_of(backend.name) else {
        return Ok(());
    };
    let name = backend.name;
    let records = &backend.records;
    let exec = |sql: String| (records.exec)(server, sql);
    let base = order_load(
        settings,
        backend.addr,
        format!("{run}-{name}-scale"),
        settings.conns,
    );
    let layer = |scenario: &str| scenario.starts_with("layer");
    // Interleaved like every other measurement, so the two sizes see the same kind of noise.
    let measure = |size: &str| -> Result<Vec<(&'static str, Sample)>, BoxError> {
        let base = Plan {
            key_prefix: format!("{}-{size}", base.key_prefix),
            ..base.clone()
        };
        let plans = order_plans(&base, layer);
        let samples = measure_rounds(settings, client, peak, &plans, |_| true, None)?;
        Ok(plans
            .iter()
            .zip(samples)
            .filter_map(|((scenario, _), sample)| Some((*scenario, sample?)))
            .collect())
    };

    // What the run's earlier scenarios left would otherwise be the "empty" table.
    exec("DELETE FROM idempotency_records".into())?;
    eprintln!("[{name}] scale: the layer on an empty records table…");
    let empty = measure("empty")?;

    eprintln!("[{name}] scale: filling {rows} records ({expired} expired)…");
    let now = now_ms();
    let started = Instant::now();
    let mut filled = 0;
    for lo in (0..rows).step_by(usize::try_from(FILL_CHUNK)?) {
        let hi = (lo + FILL_CHUNK).min(rows);
        filled += exec(filler_insert(records.dialect, lo, hi, expired, now))?;
    }
    let fill = started.elapsed();
    let started = Instant::now();
    exec(records.dialect.analyze.into())?;
    let analyze = started.elapsed();
    let none = || ("–".to_owned(), "");
    report.scale_row(
        name,
        "records filled (expired / live)",
        format!("{filled} ({expired} / {})", rows - expired),
        none(),
    );
    report.scale_row(
        name,
        &format!("fill: INSERT … SELECT, {FILL_CHUNK} rows a statement"),
        format!(
            "{:.1} s ({:.0} rows/s)",
            fill.as_secs_f64(),
            filled as f64 / fill.as_secs_f64().max(1e-9)
        ),
        none(),
    );
    report.scale_row(
        name,
        "ANALYZE",
        format!("{:.1} s", analyze.as_secs_f64()),
        none(),
    );

    eprintln!("[{name}] scale: the layer at {rows} records…");
    let full = measure("full")?;
    for ((scenario, mut small), (_, mut large)) in empty.into_iter().zip(full) {
        for (size, sample) in [("empty table", &mut small), ("full table", &mut large)] {
            report.scale_row(
                name,
                &format!("{scenario}, {size}"),
                sample.summary(),
                none(),
            );
        }
        let ratio = large.rps() / small.rps().max(1e-9);
        report.scale_row(
            name,
            &format!("{scenario} req/s, {rows} records / empty"),
            format!("{ratio:.2}"),
            Target::verdict(Some(Target::AtLeast(0.95)), ratio),
        );
    }

    let load = Plan {
        path: "/layer",
        keys: Keys::Fresh,
        duration: settings.duration().mul_f64(settings.rounds as f64),
        ..base.clone()
    };
    eprintln!("[{name}] scale: layer-fresh without a purge…");
    let mut quiet = client.block_on(drive(
        &Plan {
            key_prefix: format!("{}-quiet", load.key_prefix),
            ..load.clone()
        },
        None,
    ))?;
    eprintln!("[{name}] scale: layer-fresh while purge_expired() runs…");
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::clone(&stop);
    let purge = (records.purge)();
    let purging = server.spawn(async move {
        let started = Instant::now();
        let purged = purge.await;
        done.store(true, Ordering::Relaxed);
        (purged, started.elapsed())
    });
    let during = client.block_on(drive(
        &Plan {
            key_prefix: format!("{}-purge", load.key_prefix),
            duration: PURGE_LOAD_CAP,
            stop: Some(stop),
            ..load
        },
        None,
    ));
    let (purged, took) = server.block_on(purging)?;
    let (purged, mut during) = (purged?, during?);

    report.scale_row(
        name,
        "purge_expired(): rows purged, duration, rate",
        format!(
            "{purged} in {:.2} s ({:.0} rows/s)",
            took.as_secs_f64(),
            purged as f64 / took.as_secs_f64().max(1e-9)
        ),
        none(),
    );
    for (what, sample) in [
        ("without a purge", &mut quiet),
        ("during the purge", &mut during),
    ] {
        report.scale_row(
            name,
            &format!("layer-fresh, {} conns, {what}", settings.conns),
            sample.summary(),
            none(),
        );
    }
    let ratio = during.percentile_ms(0.99) / quiet.percentile_ms(0.99).max(1e-9);
    report.scale_row(
        name,
        "layer-fresh p99, during the purge / without",
        format!("{ratio:.2}"),
        Target::verdict(Some(Target::AtMost(1.5)), ratio),
    );
    let late = during.over(IN_FLIGHT_WAIT);
    report.scale_row(
        name,
        &format!(
            "max latency during the purge vs the in-flight wait ({} s)",
            IN_FLIGHT_WAIT.as_secs()
        ),
        format!(
            "max {:.2} ms; {late} requests past the wait",
            during.max_ms()
        ),
        (
            "none past it".into(),
            if late == 0 { "yes" } else { "**no**" },
        ),
    );
    Ok(())
}
