//! The report: rows, ratios and section lines gathered during the run, printed at the end as
//! Markdown tables.

use crate::load::Sample;

pub(crate) struct Row {
    pub(crate) group: String,
    pub(crate) scenario: String,
    pub(crate) conns: usize,
    pub(crate) sample: Sample,
    pub(crate) note: String,
}

struct Ratio {
    what: String,
    /// `None` when the baseline was left out by `BENCH_ONLY`.
    value: Option<f64>,
    target: Option<Target>,
}

#[derive(Clone, Copy)]
pub(crate) enum Target {
    AtLeast(f64),
    AtMost(f64),
}

impl Target {
    /// The target column and the met column of a table row for `value`.
    pub(crate) fn verdict(target: Option<Self>, value: f64) -> (String, &'static str) {
        let (text, met) = match target {
            Some(Self::AtLeast(t)) => (format!("≥ {t:.2}"), value >= t),
            Some(Self::AtMost(t)) => (format!("≤ {t:.2}"), value <= t),
            None => return ("–".into(), ""),
        };
        (text, if met { "yes" } else { "**no**" })
    }
}

#[derive(Default)]
pub(crate) struct Report {
    pub(crate) rows: Vec<Row>,
    /// Sequential requests on one connection (`latency`, `latency-1ms`).
    pub(crate) latency: Vec<Row>,
    ratios: Vec<Ratio>,
    pub(crate) trips: Vec<String>,
    /// Table rows of the scale section.
    scale: Vec<String>,
    pub(crate) notes: Vec<String>,
    pub(crate) memory: Vec<String>,
    pub(crate) soak: Vec<String>,
}

impl Report {
    fn rps(&self, group: &str, scenario: &str) -> Option<f64> {
        self.rows
            .iter()
            .find(|r| r.group == group && r.scenario == scenario)
            .map(|r| r.sample.rps())
    }

    fn latency_p50(&mut self, group: &str, scenario: &str) -> Option<f64> {
        self.latency
            .iter_mut()
            .find(|r| r.group == group && r.scenario == scenario)
            .map(|r| r.sample.percentile_ms(0.50))
    }

    /// A ratio of two scenarios, `None` where `BENCH_ONLY` skipped them. One whose numerator
    /// was skipped is left out of the table; one whose baseline was skipped is listed without
    /// a value, so the table says which figure is missing rather than showing a 0 or NaN.
    fn push_ratio(
        &mut self,
        what: String,
        of: Option<f64>,
        over: Option<f64>,
        target: Option<Target>,
    ) {
        if let Some(of) = of {
            self.ratios.push(Ratio {
                what,
                value: over.map(|over| of / over),
                target,
            });
        }
    }

    pub(crate) fn ratio(&mut self, group: &str, what: &str, over: &str, target: Option<Target>) {
        let (of, by) = (self.rps(group, what), self.rps(group, over));
        self.push_ratio(format!("{group}: {what} / {over}"), of, by, target);
    }

    /// `what`'s p50 over `over`'s at one connection; `label` names the comparison.
    pub(crate) fn latency_ratio(
        &mut self,
        group: &str,
        what: &str,
        over: &str,
        target: Option<Target>,
        label: &str,
    ) {
        let (of, by) = (self.latency_p50(group, what), self.latency_p50(group, over));
        self.push_ratio(
            format!("{group}, 1 connection: {what} p50 / {over} p50{label}"),
            of,
            by,
            target,
        );
    }

    /// One row of the scale table; `check` is the target and whether it is met.
    pub(crate) fn scale_row(
        &mut self,
        backend: &str,
        figure: &str,
        value: String,
        check: (String, &str),
    ) {
        let (target, met) = check;
        self.scale.push(format!(
            "| {backend} | {figure} | {value} | {target} | {met} |"
        ));
    }

    fn print_rows(title: &str, rows: &mut [Row]) {
        if rows.is_empty() {
            return;
        }
        println!("\n## {title}\n");
        println!(
            "| backend | scenario | conns | requests | req/s | p50 ms | p99 ms | peak RSS MiB | app CPU ms/req | server CPU ms/req | non-2xx | note |"
        );
        println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|");
        for row in rows {
            let (p50, p99) = (
                row.sample.percentile_ms(0.50),
                row.sample.percentile_ms(0.99),
            );
            let server_cpu = row
                .sample
                .server_cpu_ms()
                .map_or_else(|| "–".to_owned(), |ms| format!("{ms:.3}"));
            println!(
                "| {} | {} | {} | {} | {:.0} | {:.2} | {:.2} | {:.1} | {:.3} | {server_cpu} | {} | {} |",
                row.group,
                row.scenario,
                row.conns,
                row.sample.requests,
                row.sample.rps(),
                p50,
                p99,
                row.sample.peak_mib,
                row.sample.app_cpu_ms(),
                row.sample.unexpected,
                row.note
            );
        }
    }

    pub(crate) fn print(&mut self) {
        Self::print_rows("Throughput and latency", &mut self.rows);
        Self::print_rows(
            "Latency at one connection (sequential requests)",
            &mut self.latency,
        );
        if !self.ratios.is_empty() {
            println!("\n## Ratios (same run)\n");
            println!("| ratio | measured | target | met |");
            println!("|---|---:|---:|---|");
        }
        for ratio in &self.ratios {
            let (measured, target, met) = match ratio.value {
                Some(value) => {
                    let (target, met) = Target::verdict(ratio.target, value);
                    (format!("{value:.2}"), target, met)
                }
                None => {
                    let (target, _) = Target::verdict(ratio.target, f64::NAN);
                    ("– (baseline skipped)".to_owned(), target, "")
                }
            };
            println!("| {} | {measured} | {target} | {met} |", ratio.what);
        }
        if !self.trips.is_empty() {
            println!("\n## Database work per request\n");
            println!(
                "| backend | scenario | statements logged by sqlx / req | round trips / req (excluding pings) | pings / req | all exchanges / req |"
            );
            println!("|---|---|---:|---:|---:|---:|");
            for line in &self.trips {
                println!("{line}");
            }
        }
        if !self.scale.is_empty() {
            println!("\n## Scale: a large records table\n");
            println!("| backend | figure | value | target | met |");
            println!("|---|---|---|---:|---|");
            for line in &self.scale {
                println!("{line}");
            }
        }
        for (title, lines) in [
            ("Soak: RSS over a long run", &self.soak),
            ("Memory: concurrent 1 MiB requests", &self.memory),
            ("Notes", &self.notes),
        ] {
            if !lines.is_empty() {
                println!("\n## {title}\n");
                for line in lines {
                    println!("{line}");
                }
            }
        }
    }
}
