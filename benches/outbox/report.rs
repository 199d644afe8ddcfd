//! The tables the bench prints.

use crate::Settings;
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
