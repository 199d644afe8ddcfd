//! What idempotency costs over HTTP, measured side by side in one run.
//!
//! Real axum servers on loopback, driven by a hyper client load generator in the same process
//! (separate runtimes). Every scenario is measured in the same run as its baseline, interleaved
//! round by round (each round starting one scenario later), because the machine is shared and
//! noisy: the ratios are the result, the absolute numbers drift. The throughput table also
//! gives the CPU time per request of this process (servers and load generator) and of the
//! database server, from `/proc`: on PostgreSQL the backends of the app's pool, on MariaDB the
//! whole server (run nothing else against it meanwhile).
//!
//! Sections besides throughput: `round-trips` counts statements, wire round trips and pool pings
//! per request through a TCP proxy; `latency` sends sequential requests on one connection (what
//! one client waits, with no queueing behind others); `latency-1ms` does the same through a
//! proxy that holds every chunk to and from the database for `BENCH_DELAY_MS` (PostgreSQL and
//! MariaDB), which is what a user of a database one network hop away sees; `scale` (opt-in)
//! fills the records table with `BENCH_SCALE` rows and measures the layer at that size and
//! while `purge_expired()` deletes the expired ones under load.
//!
//! Settings (environment):
//! - `BENCH_BACKENDS` (default `sqlite,postgres,mysql`): backends to run; one whose cargo feature
//!   is not compiled in is skipped, and the run says so.
//! - `BENCH_SECS` (default 1) seconds per scenario per round, `BENCH_ROUNDS` (default 15),
//!   `BENCH_CONNECTIONS` (default 32). Many short rounds rather than a few long ones: a burst
//!   of contention from the machine's neighbours then lands on every scenario in turn instead
//!   of on one of them.
//! - `BENCH_TRIPS` (default 200): sequential requests over which round trips are counted.
//! - `BENCH_BIG` (default 256): concurrent 1 MiB requests for the memory test.
//! - `BENCH_SOAK_SECS` (default 45) and `BENCH_SOAK_REQUESTS` (default 1000000): the soak run
//!   stops at whichever comes first.
//! - `BENCH_TEST_BEFORE_ACQUIRE` (default `true`, sqlx's default): whether the pools ping a
//!   connection each time they hand it out.
//! - `BENCH_ONLY` (default: all): a comma-separated list of scenarios to measure, the others
//!   are skipped (to profile one scenario; ratios need their baselines measured too). The
//!   sections `layer-storm`, `round-trips`, `latency`, `latency-1ms`, `scale`, `soak` and
//!   `memory` are named the same way; a section, once in, measures all of its scenarios.
//! - `BENCH_DELAY_MS` (default 1, fractions allowed): what the `latency-1ms` section's proxy adds
//!   in each direction between the app's pool and the database.
//! - `BENCH_SCALE` (default unset: the `scale` section is skipped): records in the table for the
//!   `scale` section on PostgreSQL, e.g. `10000000`. SQLite and MariaDB get the smaller of it
//!   and 10^6, unless `BENCH_SCALE_SMALL` sets their count.
//! - `BENCH_SCALE_EXPIRED` (default: the smaller of 10^6 and a tenth of the records): how many of
//!   the `scale` section's records are already expired, for `purge_expired()` to delete.
//! - `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`): the PostgreSQL server;
//!   the run creates a schema of its own there and drops it at the end.
//! - `MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`): the MySQL/MariaDB server; the run
//!   creates a database of its own there and drops it at the end.
//! - `BENCH_PEER` (default `true`): also measure the peer crate `axum-idempotent` on the same
//!   order handler (`peer-*` rows on PostgreSQL, `noop-peer-*` rows). The run builds
//!   `benches/peer` (`cargo build --release`, target dir `target/peer`), starts it as a child
//!   process on the PostgreSQL schema and stops it at the end; it needs the `postgres` backend.
//!   Where the build or the start fails, the run says why and goes on without it.
//! - `BENCH_PEER_STORE` (default `auto`): the peer's session store, `redis`, `postgres`, or
//!   `auto` (Redis where the server runs ruts' scripts, which need Redis 7.4, else PostgreSQL).
//! - `BENCH_PEER_REDIS` (default `redis://127.0.0.1:6379`): the Redis server for the peer.
//! - `BENCH_PEER_KEYING` (default `header`): the peer keys on the `Idempotency-Key` header
//!   (`header`) or on a hash of method, target, headers and body (`hash`).

// The modules depend one way: the order and the clock (order), the filler rows (fill), the apps
// on each backend (apps, backends); the load and what reads it (load, peer, report); the
// sections built from those (scenarios, scale, memory), which only this file runs.
mod apps;
mod backends;
mod counting;
mod cpu;
mod fill;
mod load;
mod memory;
mod order;
mod peer;
mod proxy;
mod report;
mod rss;
mod scale;
mod scenarios;
mod settings;

use std::error::Error;

use tracing_subscriber::layer::SubscriberExt;

#[cfg(feature = "sqlite")]
use crate::backends::sqlite_backend;
#[cfg(feature = "mysql")]
use crate::backends::{drop_mysql_database, mysql_backend};
#[cfg(feature = "postgres")]
use crate::backends::{drop_postgres_schema, postgres_backend};
use crate::counting::StatementCounter;
use crate::memory::{run_big_bodies, run_soak};
use crate::order::now_ms;
use crate::peer::peer_or_reason;
use crate::report::Report;
use crate::rss::PeakRss;
use crate::scale::run_scale;
#[cfg(feature = "sqlite")]
use crate::scenarios::run_noop;
use crate::scenarios::{run_backend, run_latency};
use crate::settings::{Settings, wanted};

type BoxError = Box<dyn Error + Send + Sync>;

fn main() -> Result<(), BoxError> {
    let settings = Settings::from_env();
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(StatementCounter))?;
    let server = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("bench-server")
        .enable_all()
        .build()?;
    let client = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("bench-load")
        .enable_all()
        .build()?;
    let run = format!("{}_{}", std::process::id(), now_ms());
    let peak = PeakRss::start();
    let mut report = Report::default();
    let dir = std::env::temp_dir().join(format!("axum-idempotency-bench-{run}"));
    std::fs::create_dir_all(&dir)?;

    println!(
        "# cargo bench --bench http — {} s × {} rounds per scenario, {} connections",
        settings.secs, settings.rounds, settings.conns
    );
    let mut backends = Vec::new();
    // A listed backend is either set up below or the run stops with its error, so "used" is
    // "listed and built in".
    let listed = |name: &str| settings.backends.iter().any(|b| b == name);
    let postgres_used = cfg!(feature = "postgres") && listed("postgres");
    let mysql_used = cfg!(feature = "mysql") && listed("mysql");
    for name in &settings.backends {
        match name.as_str() {
            #[cfg(feature = "sqlite")]
            "sqlite" => backends.push(sqlite_backend(&server, &dir, settings.test_before_acquire)?),
            #[cfg(feature = "postgres")]
            "postgres" => {
                backends.push(postgres_backend(
                    &server,
                    &settings.database_url,
                    &run,
                    settings.test_before_acquire,
                    settings.delay,
                )?);
            }
            #[cfg(feature = "mysql")]
            "mysql" => {
                backends.push(mysql_backend(
                    &server,
                    &settings.mysql_url,
                    &run,
                    settings.test_before_acquire,
                    settings.delay,
                )?);
            }
            #[cfg(not(feature = "sqlite"))]
            "sqlite" => report.notes.push(skipped_feature(name)),
            #[cfg(not(feature = "postgres"))]
            "postgres" => report.notes.push(skipped_feature(name)),
            #[cfg(not(feature = "mysql"))]
            "mysql" => report.notes.push(skipped_feature(name)),
            other => report
                .notes
                .push(format!("- {other}: skipped, unknown backend.")),
        }
    }

    match peer_or_reason(&settings, &client, &run, postgres_used) {
        Ok(peer) => {
            report.notes.push(format!(
                "- peer: axum-idempotent 0.6 on the same order handler and SQL, served by \
                 benches/peer in a child process (tokio, 2 workers, pool of 16 on the same \
                 schema): {}. Each of the {} connections carries a session of its own \
                 (the layer caches only within a session); the storm's 64 share one. \
                 `peer-bare` is the same handler in that process without layers. Peak RSS \
                 of the peer rows is this process's (the load generator's), not the peer's.",
                peer.store, settings.conns
            ));
            if let Some(backend) = backends.iter_mut().find(|b| b.name == "postgres") {
                backend.peer = Some(peer);
            }
        }
        Err(why) => {
            eprintln!("[peer] skipped: {why}");
            report
                .notes
                .push(format!("- peer (axum-idempotent): skipped, {why}."));
        }
    }
    for backend in &backends {
        run_backend(
            &settings,
            &server,
            &client,
            &peak,
            &run,
            backend,
            &mut report,
        )?;
        run_latency(&settings, &client, &peak, &run, backend, &mut report)?;
    }
    #[cfg(feature = "sqlite")]
    run_noop(
        &settings,
        &server,
        &client,
        &peak,
        &run,
        backends.iter().find_map(|b| b.peer.as_ref()),
        &mut report,
    )?;
    // The soak before the memory test: RSS in the soak is then not inflated by the memory test's
    // 1 MiB allocations, which the allocator keeps.
    if let Some(backend) = backends
        .iter()
        .find(|b| b.name == "postgres")
        .or(backends.first())
        .filter(|_| wanted("soak"))
    {
        run_soak(&settings, &client, &run, backend, &mut report)?;
    }
    if let Some(backend) = backends.first().filter(|_| wanted("memory")) {
        run_big_bodies(&settings, &client, &peak, &run, backend, &mut report)?;
    }
    // Last: the filled table would weigh on every scenario after it.
    if settings.scale.is_some() && wanted("scale") {
        for backend in &backends {
            run_scale(
                &settings,
                &server,
                &client,
                &peak,
                &run,
                backend,
                &mut report,
            )?;
        }
    }

    for backend in &backends {
        report
            .notes
            .push(format!("- {}: {}.", backend.name, backend.note));
    }
    report.notes.push(
        "- Statements are sqlx's own `sqlx::query` events, counted by a tracing layer; sqlx does \
         not log transaction control on SQLite (BEGIN, COMMIT) nor a custom BEGIN on PostgreSQL; \
         on MySQL it logs both. \
         Wire round trips are counted by a TCP proxy between the pool and the server (PostgreSQL \
         or MariaDB): one per answer that follows a client send. Pool pings (sqlx tests a \
         connection when it hands it out, if `test_before_acquire`, and again when it takes it \
         back) are counted apart: the proxy takes a client chunk that is a lone PostgreSQL Sync \
         or a lone MySQL COM_PING for a ping, a heuristic on the bytes of one read. A ping that \
         carries the ROLLBACK sqlx queues for a dropped transaction (PostgreSQL, under the \
         layer) shares one read with it and is counted as a round trip: compare \
         `all exchanges`. Both over sequential requests on one connection, after a warm-up."
            .into(),
    );
    report.notes.push(format!(
        "- Peak RSS is the whole process (servers and load generator): {}.",
        peak.source()
    ));
    report.print();

    let _ = std::fs::remove_dir_all(&dir);
    // The peer holds connections to the schema: stopped first.
    for backend in &mut backends {
        drop(backend.peer.take());
    }
    #[cfg(feature = "postgres")]
    if postgres_used {
        drop_postgres_schema(&server, &settings.database_url, &run)?;
    }
    #[cfg(feature = "mysql")]
    if mysql_used {
        drop_mysql_database(&server, &settings.mysql_url, &run)?;
    }
    let _ = (postgres_used, mysql_used);
    Ok(())
}

#[cfg(not(all(feature = "sqlite", feature = "postgres", feature = "mysql")))]
fn skipped_feature(name: &str) -> String {
    format!("- {name}: skipped, this build lacks the `{name}` feature (add `--features {name}`).")
}
