//! The demo's outputs for people: the side-by-side table on the terminal and `index.html`.

use std::fmt::Write as _;

use super::PolicyRun;

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
pub fn ratios(runs: &[PolicyRun]) -> serde_json::Value {
    rows()
        .iter()
        .map(|row| (row.name.to_string(), ratio(row, runs).into()))
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// The side-by-side table printed at the end of the demo.
pub fn table(runs: &[PolicyRun]) -> String {
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

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// `index.html`: the table, each run's gate verdict, the Pareto plot inline, and the plan;
/// every figure in simulated time.
pub fn html(
    runs: &[PolicyRun],
    plan_json: &str,
    time_scale: f64,
    pareto_svg: Option<&str>,
) -> String {
    let mut s = String::from(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>agentrace demo</title>\n\
         <style>body{font-family:system-ui,sans-serif;margin:2em;max-width:60em}\
         table{border-collapse:collapse}td,th{padding:.3em .8em;border-bottom:1px solid #ddd;text-align:right}\
         td:first-child,th:first-child{text-align:left}pre{background:#f6f6f6;padding:1em}</style></head><body>\n\
         <h1>agentrace demo: session affinity vs round-robin</h1>\n\
         <p>The same agentic trajectories replayed through the agentrace proxy in front of simulated \
         replicas whose KV cache cannot hold every session.</p>\n",
    );
    let _ = write!(
        s,
        "<p><b>Time base: simulated time</b>, for every figure on this page (the table and the \
         plot). The simulator runs {time_scale} real seconds per simulated second; the replayer \
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
    if let Some(svg) = pareto_svg {
        s.push_str("<h2>Pareto sweep (affinity, simulated time)</h2>\n");
        s.push_str(
            svg.trim_start_matches(|c| c != '<')
                .trim_start_matches("<?xml version=\"1.0\" encoding=\"UTF-8\"?>"),
        );
        s.push('\n');
    }
    for run in runs {
        let _ = writeln!(
            s,
            "<p><a href=\"{0}/report.txt\">{0}/report.txt</a> · <a href=\"{0}/result_summary.json\">result_summary.json</a> · <a href=\"{0}/scores.json\">scores.json</a></p>",
            escape(&run.label)
        );
    }
    let _ = write!(
        s,
        "<h2>Plan</h2>\n<pre>{}</pre>\n</body></html>\n",
        escape(plan_json)
    );
    s
}
