//! What a plan says: the table, the smallest replica count meeting the SLO per policy, what
//! affinity saves, where the prediction cannot be trusted; as text, JSON and a page.

use std::fmt::Write as _;

use serde::Serialize;

use super::runner::Outcome;
use crate::replay::slo::{Slo, SloMetric};
use crate::replay::sweep::escape;

/// Whether a combination meets every SLO term, judged on its aggregate figures (TTFT and
/// TPOT at the run's p50/p90/p99 nearest the term's percentile, interactivity per user).
pub(crate) fn meets(o: &Outcome, slo: &Slo) -> bool {
    o.failures == 0
        && slo.terms().iter().all(|t| match t.metric {
            SloMetric::Ttft(p) => {
                let v = if p <= 50.0 {
                    o.ttft_p50_ms
                } else if p <= 90.0 {
                    o.ttft_p90_ms
                } else {
                    o.ttft_p99_ms
                };
                v / 1e3 <= t.bound
            }
            SloMetric::Tpot(_) => o.tpot_p90_ms / 1e3 <= t.bound,
            SloMetric::Latency(_) => true,
            SloMetric::Interactivity => o.interactivity >= t.bound,
        })
}

/// The smallest replica count meeting the SLO, per policy and KV size.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Smallest {
    /// Policy.
    pub policy: String,
    /// KV blocks per replica.
    pub kv_blocks: usize,
    /// Replicas, `None` when no count tried meets it.
    pub replicas: Option<usize>,
}

/// Smallest counts for every (policy, KV) pair, in the outcomes' order.
pub(crate) fn smallest(outcomes: &[Outcome], slo: &Slo) -> Vec<Smallest> {
    let mut out: Vec<Smallest> = Vec::new();
    for o in outcomes {
        let ok = meets(o, slo);
        match out
            .iter_mut()
            .find(|s| s.policy == o.policy && s.kv_blocks == o.kv_blocks)
        {
            Some(s) => {
                if ok && s.replicas.is_none_or(|r| o.replicas < r) {
                    s.replicas = Some(o.replicas);
                }
            }
            None => out.push(Smallest {
                policy: o.policy.clone(),
                kv_blocks: o.kv_blocks,
                replicas: ok.then_some(o.replicas),
            }),
        }
    }
    out
}

/// What affinity saves against each other policy: replicas and percent.
pub(crate) fn savings(smallest: &[Smallest]) -> Vec<String> {
    let mut lines = Vec::new();
    for a in smallest.iter().filter(|s| s.policy == "affinity") {
        for o in smallest
            .iter()
            .filter(|s| s.policy != "affinity" && s.kv_blocks == a.kv_blocks)
        {
            let line = match (a.replicas, o.replicas) {
                (Some(x), Some(y)) if x <= y => format!(
                    "affinity needs {x} replicas where {} needs {y} (KV {} blocks): saves {} ({:.0}%)",
                    o.policy,
                    a.kv_blocks,
                    y - x,
                    100.0 * (y - x) as f64 / y as f64
                ),
                // A negative saving reads as nonsense: say what affinity costs instead.
                (Some(x), Some(y)) => format!(
                    "affinity needs {x} replicas where {} needs {y} (KV {} blocks): saves nothing, costs {} more",
                    o.policy,
                    a.kv_blocks,
                    x - y
                ),
                (Some(x), None) => format!(
                    "affinity meets the SLO with {x} replicas; {} meets it with none of the counts tried (KV {} blocks)",
                    o.policy, a.kv_blocks
                ),
                (None, _) => format!(
                    "affinity meets the SLO with none of the counts tried (KV {} blocks)",
                    a.kv_blocks
                ),
            };
            lines.push(line);
        }
    }
    lines
}

/// The terminal table.
pub(crate) fn table(outcomes: &[Outcome], slo: &Slo) -> String {
    let mut s = format!(
        "{:<13} {:>8} {:>9} {:>11} {:>11} {:>14} {:>12} {:>9} {:>5}\n",
        "policy",
        "replicas",
        "kv_blocks",
        "ttft_p50",
        "ttft_p90",
        "interactivity",
        "system_tps",
        "hit_rate",
        "slo"
    );
    for o in outcomes {
        let _ = writeln!(
            s,
            "{:<13} {:>8} {:>9} {:>8.1} ms {:>8.1} ms {:>8.1} tok/s {:>6.1} tok/s {:>8.1}% {:>5}",
            o.policy,
            o.replicas,
            o.kv_blocks,
            o.ttft_p50_ms,
            o.ttft_p90_ms,
            o.interactivity,
            o.system_tps,
            100.0 * o.prefix_cache_hit_rate,
            if meets(o, slo) { "met" } else { "MISS" }
        );
    }
    s
}

/// A line chart of `value` against replicas, one line per policy (and KV size).
fn chart(outcomes: &[Outcome], title: &str, unit: &str, value: fn(&Outcome) -> f64) -> String {
    let (w, h, l, r, t, b) = (520.0, 300.0, 70.0, 20.0, 40.0, 45.0);
    let xmax = outcomes.iter().map(|o| o.replicas).max().unwrap_or(1) as f64;
    let ymax = outcomes.iter().map(value).fold(0.0, f64::max).max(1e-9) * 1.1;
    let px = |x: f64| l + (x - 1.0).max(0.0) / (xmax - 1.0).max(1.0) * (w - l - r);
    let py = |y: f64| h - b - y / ymax * (h - t - b);
    let mut s = format!(
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12"><text x="{l}" y="20" font-weight="bold">{}</text><line x1="{l}" y1="{}" x2="{}" y2="{}" stroke="#888"/><line x1="{l}" y1="{t}" x2="{l}" y2="{}" stroke="#888"/><text x="{}" y="{}" text-anchor="middle">replicas</text><text x="4" y="{}">{}</text><text x="4" y="{}">0</text>"##,
        escape(title),
        h - b,
        w - r,
        h - b,
        h - b,
        (l + w - r) / 2.0,
        h - 8.0,
        t + 4.0,
        escape(&format!("{:.3} {unit}", ymax)),
        h - b
    );
    for x in 1..=xmax as usize {
        let _ = write!(
            s,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{x}</text>"#,
            px(x as f64),
            h - b + 16.0
        );
    }
    let mut keys: Vec<(String, usize)> = Vec::new();
    for o in outcomes {
        if !keys.contains(&(o.policy.clone(), o.kv_blocks)) {
            keys.push((o.policy.clone(), o.kv_blocks));
        }
    }
    let colours = [
        "#1f6feb", "#d4731a", "#2da44e", "#8250df", "#cf222e", "#57606a",
    ];
    for (i, (policy, kv)) in keys.iter().enumerate() {
        let c = colours[i % colours.len()];
        let pts: Vec<String> = outcomes
            .iter()
            .filter(|o| &o.policy == policy && o.kv_blocks == *kv)
            .map(|o| format!("{:.1},{:.1}", px(o.replicas as f64), py(value(o))))
            .collect();
        let _ = write!(
            s,
            r#"<polyline fill="none" stroke="{c}" stroke-width="2" points="{}"/><text x="{}" y="{}" fill="{c}">{}</text>"#,
            pts.join(" "),
            w - r - 170.0,
            t + 14.0 * (i as f64 + 1.0),
            escape(&format!("{policy}, {kv} blocks"))
        );
    }
    s.push_str("</svg>");
    s
}

/// `index.html`: self-contained, the charts inline.
pub(crate) fn html(
    outcomes: &[Outcome],
    slo: &Slo,
    summary: &[String],
    warnings: &[String],
) -> String {
    let mut s = String::from(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>agentrace plan</title>\
         <style>body{font-family:sans-serif;max-width:1100px;margin:2em auto}pre{background:#f6f8fa;padding:1em}\
         .warn{color:#9a6700}</style></head><body><h1>agentrace plan</h1>",
    );
    let _ = write!(
        s,
        "<p>SLO: <code>{}</code> (simulated time)</p><ul>",
        escape(&slo.to_string())
    );
    for line in summary {
        let _ = write!(s, "<li>{}</li>", escape(line));
    }
    s.push_str("</ul><h2>Where this prediction cannot be trusted</h2><ul>");
    for w in warnings {
        let _ = write!(s, "<li class=\"warn\">{}</li>", escape(w));
    }
    s.push_str("</ul><div>");
    s.push_str(&chart(outcomes, "TTFT p90", "ms", |o| o.ttft_p90_ms));
    s.push_str(&chart(outcomes, "Per-user interactivity", "tok/s", |o| {
        o.interactivity
    }));
    s.push_str(&chart(outcomes, "Prefix-cache hit rate", "", |o| {
        o.prefix_cache_hit_rate
    }));
    s.push_str(&chart(outcomes, "System output rate", "tok/s", |o| {
        o.system_tps
    }));
    let _ = write!(
        s,
        "</div><h2>All combinations</h2><pre>{}</pre></body></html>",
        escape(&table(outcomes, slo))
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn smallest(policy: &str, replicas: usize) -> Smallest {
        Smallest {
            policy: policy.to_string(),
            kv_blocks: 64,
            replicas: Some(replicas),
        }
    }

    #[test]
    fn affinity_needing_more_replicas_is_a_cost_not_a_negative_saving() {
        let lines = savings(&[smallest("affinity", 2), smallest("round_robin", 1)]);
        assert_eq!(
            lines,
            vec!["affinity needs 2 replicas where round_robin needs 1 (KV 64 blocks): saves nothing, costs 1 more"]
        );
        let lines = savings(&[smallest("affinity", 1), smallest("round_robin", 2)]);
        assert_eq!(
            lines,
            vec![
                "affinity needs 1 replicas where round_robin needs 2 (KV 64 blocks): saves 1 (50%)"
            ]
        );
    }
}
