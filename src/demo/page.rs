//! The demo's outputs for people: the side-by-side table on the terminal and `index.html`.

use std::fmt::Write as _;

use super::charts::{self, ParetoSeries, Progress};
use super::PolicyRun;
use crate::replay::sweep::{escape, Point};

/// One row of the comparison: name, how to read it, and the value of a run.
struct Row {
    name: &'static str,
    better: &'static str,
    value: fn(&PolicyRun) -> Option<f64>,
    format: fn(f64) -> String,
}

fn rows() -> Vec<Row> {
    let pct = |v: f64| format!("{:.1}%", 100.0 * v);
    let ms = |v: f64| format!("{v:.1} ms");
    let rate = |v: f64| format!("{v:.1} tok/s");
    vec![
        Row {
            name: "prefix-cache hit rate",
            better: "higher",
            value: |r| Some(r.prefix_cache_hit_rate),
            format: pct,
        },
        Row {
            name: "TTFT mean (server)",
            better: "lower",
            value: |r| Some(r.server_ttft_mean_ms),
            format: ms,
        },
        Row {
            name: "TTFT p50 (client)",
            better: "lower",
            value: |r| Some(r.ttft_p50_ms),
            format: ms,
        },
        Row {
            name: "TTFT p90 (client)",
            better: "lower",
            value: |r| Some(r.ttft_p90_ms),
            format: ms,
        },
        Row {
            name: "system_tps",
            better: "higher",
            value: |r| Some(r.system_tps),
            format: rate,
        },
        Row {
            name: "e2e_interactivity",
            better: "higher",
            value: |r| Some(r.e2e_interactivity),
            format: rate,
        },
        Row {
            name: "slowest user",
            better: "higher",
            value: |r| Some(r.user_tps_min),
            format: rate,
        },
        Row {
            name: "median user",
            better: "higher",
            value: |r| Some(r.user_tps_median),
            format: rate,
        },
        Row {
            name: "inline accuracy",
            better: "same",
            value: |r| r.accuracy,
            format: |v| format!("{v:.4}"),
        },
        Row {
            name: "schedule lag p99",
            better: "lower",
            value: |r| Some(r.schedule_lag_p99_ms),
            format: |v| format!("{v:.2} ms"),
        },
        Row {
            name: "preemptions",
            better: "lower",
            value: |r| Some(r.preemptions as f64),
            format: |v| format!("{v:.0}"),
        },
        Row {
            name: "failed turns",
            better: "lower",
            value: |r| Some(r.failures as f64),
            format: |v| format!("{v:.0}"),
        },
    ]
}

fn cell(row: &Row, run: &PolicyRun) -> String {
    (row.value)(run).map_or_else(|| "n/a".to_string(), row.format)
}

fn ratio(row: &Row, runs: &[PolicyRun]) -> Option<f64> {
    let (a, b) = ((row.value)(runs.first()?)?, (row.value)(runs.get(1)?)?);
    (b != 0.0).then(|| a / b)
}

/// `{metric: affinity / round-robin}` for `demo.json`.
pub(super) fn ratios(runs: &[PolicyRun]) -> serde_json::Value {
    rows()
        .iter()
        .map(|row| (row.name.to_string(), ratio(row, runs).into()))
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// The side-by-side table printed at the end of the demo.
pub(super) fn table(runs: &[PolicyRun]) -> String {
    let mut s = String::new();
    let heads: Vec<&str> = runs.iter().map(|r| r.label.as_str()).collect();
    let _ = write!(s, "\n{:<24}", "metric (simulated time)");
    for h in &heads {
        let _ = write!(s, "{h:>16}");
    }
    let _ = writeln!(s, "{:>12}  better", "ratio");
    for row in rows() {
        let _ = write!(s, "{:<24}", row.name);
        for run in runs {
            let _ = write!(s, "{:>16}", cell(&row, run));
        }
        let r = ratio(&row, runs).map_or_else(|| "n/a".to_string(), |v| format!("{v:.2}×"));
        let _ = writeln!(s, "{r:>12}  {}", row.better);
    }
    s
}

/// The combined Pareto chart of both policies' sweeps, rates in simulated time.
pub(super) fn pareto(sweeps: &[(String, Vec<Point>)], time_scale: f64) -> String {
    let series: Vec<ParetoSeries<'_>> = sweeps
        .iter()
        .map(|(label, points)| ParetoSeries {
            label,
            points: points
                .iter()
                .map(|p| {
                    (
                        p.e2e_interactivity * time_scale,
                        p.system_tps * time_scale,
                        p.concurrency,
                    )
                })
                .collect(),
            fails: points
                .iter()
                .map(|p| {
                    p.verdict
                        .as_deref()
                        .and_then(|v| v.strip_prefix("FAIL: "))
                        .map(str::to_string)
                })
                .collect(),
        })
        .collect();
    charts::pareto(&series, TIME_BASE)
}

/// The page's one time base, named on every axis.
const TIME_BASE: &str = "simulated time";

/// What each plan key means, for the plan's table.
fn plan_meaning(key: &str) -> &'static str {
    match key {
        "replicas" => "simulated replicas behind the proxy",
        "concurrency" => "concurrent users (slots) of each replay",
        "trajectories" => "trajectories replayed, half coding and half workflow",
        "kv_tokens" => "KV-cache capacity of each replica (tokens)",
        "time_scale" => "real seconds per simulated second",
        "sweep" => "concurrencies of each Pareto sweep",
        "sweep_point_s" => "wall-clock seconds measured per sweep point",
        "load_factor" => "bounded-load factor of the affinity placement",
        "oracle_accuracy" => "share of turns answered with the recorded reply",
        "dataset" => "trajectories drawn from",
        "progress" => "progress bars on stderr",
        _ => "",
    }
}

fn plan_table(plan: &serde_json::Value) -> String {
    let mut s = String::from(
        "<table class=\"plan\">\n<tr><th>setting</th><th>value</th><th>meaning</th></tr>\n",
    );
    if let Some(map) = plan.as_object() {
        for (key, value) in map {
            let shown = match value {
                serde_json::Value::String(text) => text.clone(),
                serde_json::Value::Array(items) => items
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", "),
                other => other.to_string(),
            };
            let _ = writeln!(
                s,
                "<tr><td>{}</td><td>{}</td><td>{}</td></tr>",
                escape(key),
                escape(&shown),
                plan_meaning(key)
            );
        }
    }
    s.push_str("</table>\n");
    s
}

/// A figure with its heading and a sentence on how to read it.
fn figure(s: &mut String, heading: &str, how_to_read: &str, svg: &str) {
    let _ = write!(
        s,
        "<h2>{heading}</h2>\n<p>{how_to_read}</p>\n<figure>\n{svg}</figure>\n"
    );
}

/// `index.html`: the table, each run's gate verdict, the figures inline (both policies'
/// Pareto frontiers, TTFT distributions, per-user progress, per-replica hit rates), the
/// outputs' links and the plan; every figure in simulated time.
pub(super) fn html(
    runs: &[PolicyRun],
    sweeps: &[(String, Vec<Point>)],
    plan: &serde_json::Value,
    time_scale: f64,
) -> String {
    let mut s = String::from(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>agentrace demo</title>\n\
         <style>body{font-family:sans-serif;margin:2em;max-width:62em}\
         table{border-collapse:collapse;margin-bottom:1em}td,th{padding:.3em .8em;border-bottom:1px solid #ddd;text-align:right}\
         td:first-child,th:first-child{text-align:left}.plan td{text-align:left}figure{margin:0}svg{max-width:100%;height:auto}\
         .key{font-weight:bold}</style></head><body>\n\
         <h1>agentrace demo: session affinity vs round-robin</h1>\n\
         <p>The same agentic trajectories replayed through the agentrace proxy in front of simulated \
         replicas whose KV cache cannot hold every session, once with each placement policy: \
         <span class=\"key\" style=\"color:#1f6feb\">affinity</span> (each session stays on the replica \
         that holds its cache) and <span class=\"key\" style=\"color:#d4731a\">round-robin</span>.</p>\n",
    );
    let _ = write!(
        s,
        "<p><b>Time base: simulated time</b>, for every figure on this page (the table and the \
         plots). The simulator runs {time_scale} real seconds per simulated second; the replayer \
         measures real time, so its durations are divided by {time_scale} and its rates \
         multiplied by it here. Each replay's own <code>report.txt</code> and \
         <code>result_summary.json</code> (linked below) stay in wall-clock time.</p>\n\
         <table>\n<tr><th>metric (simulated time)</th>"
    );
    for run in runs {
        let _ = write!(s, "<th>{}</th>", escape(&run.label));
    }
    s.push_str("<th>ratio</th><th>better</th></tr>\n");
    for row in rows() {
        let _ = write!(s, "<tr><td>{}</td>", row.name);
        for run in runs {
            let _ = write!(s, "<td>{}</td>", escape(&cell(&row, run)));
        }
        let r = ratio(&row, runs).map_or_else(|| "n/a".to_string(), |v| format!("{v:.2}×"));
        let _ = writeln!(s, "<td>{r}</td><td>{}</td></tr>", row.better);
    }
    s.push_str("</table>\n");
    for run in runs {
        let _ = writeln!(
            s,
            "<p>{} gates: {}</p>",
            escape(&run.label),
            escape(
                run.gates_verdict
                    .as_deref()
                    .unwrap_or("none (no gates for this run)")
            )
        );
    }
    if !sweeps.is_empty() {
        figure(
            &mut s,
            "Pareto frontiers",
            "One point per concurrency of each policy's sweep; up is more total throughput, \
             right is faster for each user. A frontier above and to the right of the other \
             dominates it.",
            &pareto(sweeps, time_scale),
        );
    }
    let ttfts: Vec<(&str, Vec<f64>)> = runs
        .iter()
        .map(|r| (r.label.as_str(), r.ttfts_ms.clone()))
        .collect();
    figure(
        &mut s,
        "Time to first token",
        "Share of turns whose first token came within a given time, measured by the replayer \
         (from <code>sample.issued</code> to <code>sample.recv_first</code> in each \
         <code>events.jsonl</code>). Further left is faster; a long tail to the right is \
         turns that waited for their prefix to be recomputed.",
        &charts::ttft_cdf(&ttfts, TIME_BASE),
    );
    let progress: Vec<Progress<'_>> = runs
        .iter()
        .map(|r| Progress {
            label: &r.label,
            bucket_s: r.user_tokens.bucket_s,
            users: r.user_tokens.users.clone(),
        })
        .collect();
    figure(
        &mut s,
        "Progress of each user",
        "One line per user (replay slot): output tokens of its completed turns over the \
         measured window. Lines bunched together mean every user was served alike; a line \
         far below the others is a starved user.",
        &charts::user_progress(&progress, TIME_BASE),
    );
    let rates: Vec<(&str, Vec<(String, f64)>)> = runs
        .iter()
        .map(|r| {
            (
                r.label.as_str(),
                r.replicas
                    .iter()
                    .map(|x| (x.name.clone(), x.hit_rate()))
                    .collect(),
            )
        })
        .collect();
    figure(
        &mut s,
        "Prefix-cache hit rate per replica",
        "Each replica's counters at the end of each run (no time axis). With affinity a \
         session's next turn finds its prefix where the previous turn left it.",
        &charts::hit_rates(&rates),
    );
    s.push_str("<h2>Outputs</h2>\n<ul>\n<li><a href=\"demo.json\">demo.json</a>: every figure of the table, machine-readable</li>\n");
    for run in runs {
        let _ = writeln!(
            s,
            "<li>{0}: <a href=\"{0}/report.txt\">report.txt</a> · <a href=\"{0}/result_summary.json\">result_summary.json</a> · <a href=\"{0}/scores.json\">scores.json</a> · <a href=\"{0}/events.jsonl\">events.jsonl</a></li>",
            escape(&run.label)
        );
    }
    for (label, _) in sweeps {
        let _ = writeln!(
            s,
            "<li>{0} sweep (wall clock): <a href=\"sweep/{0}/pareto.json\">pareto.json</a> · <a href=\"sweep/{0}/pareto.svg\">pareto.svg</a></li>",
            escape(label)
        );
    }
    let _ = write!(
        s,
        "</ul>\n<h2>Plan</h2>\n{}</body></html>\n",
        plan_table(plan)
    );
    s
}
