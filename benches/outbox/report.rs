//! The tables the bench prints.

use std::time::Duration;

use crate::Settings;
use crate::latency::{Latency, P50_TARGET, P99_TARGET, quantile};
use crate::run::{Row, median};

fn rate(value: Option<f64>) -> String {
    value.map_or_else(|| "–".to_owned(), |v| format!("{v:.0}"))
}

pub(crate) fn print(rows: &[Row], settings: &Settings) {
    println!(
        "\n## Outbox relay against a bare publisher\n\n{} messages of {} bytes per run, \
         medians of {} rounds\n",
        settings.messages, settings.payload, settings.rounds
    );
    println!(
        "| store | broker | dispatcher | bare msg/s | relay msg/s | relay / bare | target | met |"
    );
    println!("|---|---|---|---:|---:|---:|---:|---|");
    for row in rows {
        let (bare, relay) = (median(&row.bare), median(&row.relay));
        let ratio = bare.zip(relay).map(|(bare, relay)| relay / bare);
        let met = match ratio {
            _ if !row.errors.is_empty() => "invalid",
            Some(ratio) if ratio >= 0.5 => "yes",
            Some(_) => "**no**",
            None => "–",
        };
        println!(
            "| {} | {} | {} | {} | {} | {} | ≥ 0.50 | {met} |",
            row.store,
            row.broker,
            row.profile.label(),
            rate(bare),
            rate(relay),
            ratio.map_or_else(|| "–".to_owned(), |r| format!("{r:.2}"))
        );
    }
    println!(
        "\n## Committing, and end to end\n\n`commit`: the producers alone ({} concurrent, one \
         message per transaction, no dispatcher running); `live`: producers and dispatcher \
         together, first commit to last delivery recorded; `relay, no broker`: the relay to a \
         sender that confirms at once (the dispatcher's database work alone; measured with the \
         first broker, `–` on the others)\n",
        settings.producers
    );
    println!(
        "| store | broker | dispatcher | commit msg/s | relay, no broker msg/s | live msg/s | \
         live / bare |"
    );
    println!("|---|---|---|---:|---:|---:|---:|");
    for row in rows {
        let (bare, live) = (median(&row.bare), median(&row.live));
        println!(
            "| {} | {} | {} | {} | {} | {} | {} |",
            row.store,
            row.broker,
            row.profile.label(),
            rate(median(&row.commit)),
            rate(median(&row.nowhere)),
            rate(live),
            bare.zip(live)
                .map_or_else(|| "–".to_owned(), |(b, l)| format!("{:.2}", l / b))
        );
    }
    let errors: Vec<_> = rows.iter().flat_map(|row| &row.errors).collect();
    if !errors.is_empty() {
        println!("\n## Runs that failed verification (not counted)\n");
        for error in errors {
            println!("- {error}");
        }
    }
}

fn millis(value: Option<Duration>) -> String {
    value.map_or_else(
        || "–".to_owned(),
        |v| format!("{:.2}", v.as_secs_f64() * 1e3),
    )
}

pub(crate) fn print_latency(rows: &[Latency], settings: &Settings) {
    if rows.is_empty() {
        return;
    }
    println!(
        "\n## Commit → delivered\n\n{} messages of {} bytes, one request each through the \
         layer, its handler enqueuing on its `Tx`; requests started at half the top rate of {} \
         producers; one dispatcher with the defaults, woken by the commits alone\n",
        settings.messages, settings.payload, settings.producers
    );
    println!(
        "| store | broker | top commit msg/s | paced msg/s | p50 ms | p99 ms | max ms | target \
         p50 / p99 | met | to send p50 / p99 ms | send → ack p50 / p99 ms | timer lag p50 / p99 ms | load before / after |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---|---|---|---|---|---|");
    for row in rows {
        let (p50, p99) = (row.quantile(0.5), row.quantile(0.99));
        let met = match p50.zip(p99) {
            _ if !row.errors.is_empty() => "invalid",
            Some((p50, p99)) if p50 <= P50_TARGET && p99 <= P99_TARGET => "yes",
            Some(_) => "**no**",
            None => "–",
        };
        println!(
            "| {} | {} | {:.0} | {:.0} | {} | {} | {} | ≤ {} / ≤ {} | {met} | {} / {} | {} / {} | {} / {} | {} / {} |",
            row.store,
            row.broker,
            row.top,
            row.paced,
            millis(p50),
            millis(p99),
            millis(row.latencies.last().copied()),
            P50_TARGET.as_millis(),
            P99_TARGET.as_millis(),
            millis(quantile(&row.to_send, 0.5)),
            millis(quantile(&row.to_send, 0.99)),
            millis(quantile(&row.in_send, 0.5)),
            millis(quantile(&row.in_send, 0.99)),
            millis(quantile(&row.lag, 0.5)),
            millis(quantile(&row.lag, 0.99)),
            row.load.0,
            row.load.1
        );
    }
    if rows.iter().any(|row| !row.errors.is_empty()) {
        println!("\n## Latency runs that failed verification\n");
        for row in rows {
            for error in &row.errors {
                println!("- {} × {}: {error}", row.store, row.broker);
            }
        }
    }
}
