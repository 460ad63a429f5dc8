//! The Pareto sweep: one replay per concurrency, then `pareto.json` and a hand-drawn
//! `pareto.svg` (Y = system_tps, X = e2e_interactivity, step-function frontier), and the
//! point-placement rules of policy §5 (reference §15.3).

use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;

use serde::Serialize;

use super::{ReplayConfig, ReplayError, ReplaySummary};
use crate::dataset::Dataset;
use crate::shutdown::Shutdown;

/// One point of the curve.
#[derive(Debug, Clone, Serialize)]
pub struct Point {
    /// Concurrency.
    pub concurrency: usize,
    /// Y.
    pub system_tps: f64,
    /// X.
    pub e2e_interactivity: f64,
    /// On the frontier (no other point is better on both axes).
    pub on_frontier: bool,
    /// Inline accuracy.
    pub accuracy: Option<f64>,
    /// Every gate of this point passed (true when there are none).
    pub gates_pass: bool,
    /// `PASS`, or `FAIL` with the failing gates' values and rules; `None` without gates.
    pub verdict: Option<String>,
    /// The whole headline of the point's replay.
    pub summary: ReplaySummary,
}

/// One placement rule and whether the sweep meets it.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Check {
    /// The rule.
    pub rule: String,
    /// Met?
    pub pass: bool,
}

/// Concurrency regions for `1 <= c_min <= 32 < c_max` (half-to-even rounding, as Python).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub(crate) struct Regions {
    /// Low region `[c_min + 1, low_end]`.
    pub low: [u64; 2],
    /// Medium region.
    pub med: [u64; 2],
    /// High region.
    pub high: [u64; 2],
}

/// The region boundaries of §15.3, or `None` when the rule does not apply.
pub(crate) fn regions(c_min: u64, c_max: u64) -> Option<Regions> {
    if !(1..=32).contains(&c_min) || c_max <= 32 {
        return None;
    }
    let i = ((c_max - c_min) as f64).log2() / 3.0;
    let low_end = (c_min as f64 + 2f64.powf(i)).round_ties_even() as u64;
    let med_end = (c_min as f64 + 2f64.powf(2.0 * i)).round_ties_even() as u64;
    Some(Regions {
        low: [c_min + 1, low_end],
        med: [low_end + 1, med_end],
        high: [med_end + 1, c_max],
    })
}

/// Checks the placement rules on a set of concurrencies.
pub(crate) fn placement_checks(concurrencies: &[usize]) -> Vec<Check> {
    let n = concurrencies.len();
    let mut checks = vec![
        Check {
            rule: format!("at least 7 points (have {n})"),
            pass: n >= 7,
        },
        Check {
            rule: format!("at most 32 points (have {n})"),
            pass: n <= 32,
        },
        Check {
            rule: "a point in the ultra-low region (concurrency 1-32)".into(),
            pass: concurrencies.iter().any(|c| (1..=32).contains(c)),
        },
    ];
    let c_min = concurrencies.iter().copied().min().unwrap_or(0) as u64;
    let c_max = concurrencies.iter().copied().max().unwrap_or(0) as u64;
    match regions(c_min, c_max) {
        Some(r) => {
            for (name, [lo, hi]) in [("low", r.low), ("medium", r.med), ("high", r.high)] {
                checks.push(Check {
                    rule: format!("a point in the {name} region ({lo}-{hi})"),
                    pass: concurrencies
                        .iter()
                        .any(|c| (lo..=hi).contains(&(*c as u64))),
                });
            }
        }
        None => checks.push(Check {
            rule: "regions need 1 <= C_min <= 32 and C_max > 32".into(),
            pass: false,
        }),
    }
    checks
}

fn mark_frontier(points: &mut [Point]) {
    let snapshot: Vec<(f64, f64)> = points
        .iter()
        .map(|p| (p.e2e_interactivity, p.system_tps))
        .collect();
    for (i, p) in points.iter_mut().enumerate() {
        let (x, y) = snapshot[i];
        p.on_frontier = !snapshot
            .iter()
            .enumerate()
            .any(|(j, (ox, oy))| j != i && *ox >= x && *oy >= y && (*ox > x || *oy > y));
    }
}

/// Runs the sweep; each point's replay goes to `out_dir/c<N>`.
pub async fn run(
    base: ReplayConfig,
    concurrencies: &[usize],
    dataset: Arc<Dataset>,
    out_dir: &Path,
    shutdown: Shutdown,
) -> Result<Vec<Point>, ReplayError> {
    use std::io::IsTerminal as _;
    // One line per point on stderr, as the replay's progress bar: on a terminal, unless off.
    let progress = base.progress && std::io::stderr().is_terminal();
    let started = std::time::Instant::now();
    let mut points = Vec::new();
    for (i, &c) in concurrencies.iter().enumerate() {
        if shutdown.is_fired() {
            break;
        }
        if progress {
            eprintln!(
                "sweep: point {}/{} (concurrency {c}) starting, {:.0} s elapsed",
                i + 1,
                concurrencies.len(),
                started.elapsed().as_secs_f64()
            );
        }
        let mut cfg = base.clone();
        cfg.concurrency = c;
        let summary = super::run(
            cfg,
            dataset.clone(),
            &out_dir.join(format!("c{c}")),
            shutdown.clone(),
        )
        .await?;
        let verdict = super::report::verdict(&summary.gates);
        if progress {
            eprintln!(
                "sweep: point {}/{} (concurrency {c}) done: system_tps {:.1} tok/s, \
                 e2e_interactivity {:.1} tok/s/user (wall clock), gates {}",
                i + 1,
                concurrencies.len(),
                summary.system_tps,
                summary.e2e_interactivity,
                verdict.as_deref().unwrap_or("none")
            );
        }
        points.push(Point {
            concurrency: c,
            system_tps: summary.system_tps,
            e2e_interactivity: summary.e2e_interactivity,
            on_frontier: false,
            accuracy: summary.accuracy,
            gates_pass: summary.gates_pass,
            verdict,
            summary,
        });
    }
    mark_frontier(&mut points);
    let cs: Vec<usize> = points.iter().map(|p| p.concurrency).collect();
    let checks = placement_checks(&cs);
    let accs: Vec<f64> = points.iter().filter_map(|p| p.accuracy).collect();
    let mean_acc = (!accs.is_empty()).then(|| accs.iter().sum::<f64>() / accs.len() as f64);
    let doc = serde_json::json!({
        "x": "e2e_interactivity (output tokens/s per user)",
        "y": "system_tps (output tokens/s)",
        "points": points,
        "frontier": points.iter().filter(|p| p.on_frontier).map(|p| p.concurrency).collect::<Vec<_>>(),
        "accuracy_mean": mean_acc,
        "all_points_pass_gates": points.iter().all(|p| p.gates_pass),
        "placement_checks": checks,
    });
    let json_path = out_dir.join("pareto.json");
    std::fs::create_dir_all(out_dir).map_err(|e| ReplayError::Output {
        path: out_dir.display().to_string(),
        message: e.to_string(),
    })?;
    let mut bytes = serde_json::to_vec_pretty(&doc).unwrap_or_default();
    bytes.push(b'\n');
    std::fs::write(&json_path, bytes).map_err(|e| ReplayError::Output {
        path: json_path.display().to_string(),
        message: e.to_string(),
    })?;
    let svg_path = out_dir.join("pareto.svg");
    std::fs::write(&svg_path, svg(&points, TimeBase::WALL_CLOCK)).map_err(|e| {
        ReplayError::Output {
            path: svg_path.display().to_string(),
            message: e.to_string(),
        }
    })?;
    Ok(points)
}

/// The smallest 1, 2, 2.5 or 5 times a power of ten at or above `v`: an axis end with round ticks.
pub(crate) fn nice_max(v: f64) -> f64 {
    if v <= 0.0 || !v.is_finite() {
        return 1.0;
    }
    let mag = 10f64.powf(v.log10().floor());
    for m in [1.0, 2.0, 2.5, 5.0, 10.0] {
        if v <= m * mag {
            return m * mag;
        }
    }
    10.0 * mag
}

/// The time base a chart's rates are in, named on its axes.
#[derive(Debug, Clone, Copy)]
pub struct TimeBase {
    /// Multiplies every measured (wall-clock) rate.
    pub rate_factor: f64,
    /// Its name on the axes, e.g. "wall clock".
    pub label: &'static str,
}

impl TimeBase {
    /// Rates as measured.
    pub const WALL_CLOCK: TimeBase = TimeBase {
        rate_factor: 1.0,
        label: "wall clock",
    };
}

/// A gate verdict short enough for a point label: the failing gate names, or PASS.
fn short_verdict(verdict: &str) -> String {
    match verdict.strip_prefix("FAIL: ") {
        Some(failing) => {
            let names: Vec<&str> = failing
                .split("; ")
                .filter_map(|g| g.split_whitespace().next())
                .collect();
            format!("FAIL ({})", names.join(", "))
        }
        None => verdict.to_string(),
    }
}

/// The chart, without fonts or libraries: axes, ticks, the step frontier, labelled points;
/// rates in `base`. Each point's label carries its gates' verdict (why it fails, in the
/// chart's notes), none when the run had no gates.
pub fn svg(points: &[Point], base: TimeBase) -> String {
    let gated = points.iter().any(|p| p.verdict.is_some());
    let k = base.rate_factor;
    let scaled: Vec<Point> = points
        .iter()
        .map(|p| Point {
            system_tps: p.system_tps * k,
            e2e_interactivity: p.e2e_interactivity * k,
            ..p.clone()
        })
        .collect();
    let points = &scaled[..];
    let (w, h, l, r, t, b) = (720.0, 460.0, 80.0, 30.0, 40.0, 60.0);
    let xmax = nice_max(
        points
            .iter()
            .map(|p| p.e2e_interactivity)
            .fold(0.0, f64::max)
            * 1.05,
    );
    let ymax = nice_max(points.iter().map(|p| p.system_tps).fold(0.0, f64::max) * 1.05);
    let px = |x: f64| l + (x / xmax) * (w - l - r);
    let py = |y: f64| h - b - (y / ymax) * (h - t - b);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="15">system throughput vs interactivity (agentrace sweep)</text>"#,
        w / 2.0
    );
    for i in 0..=5 {
        let xv = xmax * i as f64 / 5.0;
        let yv = ymax * i as f64 / 5.0;
        let _ = writeln!(
            s,
            r##"<line x1="{0}" y1="{1}" x2="{0}" y2="{2}" stroke="#eee"/><text x="{0}" y="{3}" text-anchor="middle">{4}</text>"##,
            px(xv),
            t,
            h - b,
            h - b + 18.0,
            trim(xv)
        );
        let _ = writeln!(
            s,
            r##"<line x1="{0}" y1="{1}" x2="{2}" y2="{1}" stroke="#eee"/><text x="{3}" y="{4}" text-anchor="end">{5}</text>"##,
            l,
            py(yv),
            w - r,
            l - 6.0,
            py(yv) + 4.0,
            trim(yv)
        );
    }
    let _ = writeln!(
        s,
        r##"<line x1="{l}" y1="{0}" x2="{1}" y2="{0}" stroke="#333"/><line x1="{l}" y1="{t}" x2="{l}" y2="{0}" stroke="#333"/>"##,
        h - b,
        w - r
    );
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">e2e_interactivity (output tokens/s per user, {})</text>"#,
        (l + w - r) / 2.0,
        h - 18.0,
        base.label
    );
    let _ = writeln!(
        s,
        r#"<text x="18" y="{0}" text-anchor="middle" transform="rotate(-90 18 {0})">system_tps (output tokens/s, {1})</text>"#,
        (t + h - b) / 2.0,
        base.label
    );
    let mut frontier: Vec<&Point> = points.iter().filter(|p| p.on_frontier).collect();
    frontier.sort_by(|a, b| a.e2e_interactivity.total_cmp(&b.e2e_interactivity));
    if let Some(first) = frontier.first() {
        let mut d = format!(
            "M {:.1} {:.1}",
            px(first.e2e_interactivity),
            py(first.system_tps)
        );
        for p in &frontier[1..] {
            let _ = write!(
                d,
                " V {:.1} H {:.1}",
                py(p.system_tps),
                px(p.e2e_interactivity)
            );
        }
        let _ = writeln!(
            s,
            r##"<path d="{d}" fill="none" stroke="#1f6feb" stroke-width="2"/>"##
        );
    }
    for p in points {
        let color = if !gated {
            "#555"
        } else if p.gates_pass {
            "#1a7f37"
        } else {
            "#cf222e"
        };
        let (x, y) = (px(p.e2e_interactivity), py(p.system_tps));
        let _ = writeln!(
            s,
            r#"<circle cx="{x:.1}" cy="{y:.1}" r="5" fill="{color}"/><text x="{:.1}" y="{:.1}">c={}{}</text>"#,
            x + 7.0,
            y - 7.0,
            p.concurrency,
            p.verdict
                .as_deref()
                .map_or(String::new(), |v| format!(" {}", escape(&short_verdict(v))))
        );
    }
    if gated {
        let _ = writeln!(
            s,
            r##"<text x="{}" y="{}" text-anchor="end" fill="#555">green: gates (accuracy, OSL band) pass; red: a gate fails</text>"##,
            w - r,
            t + 12.0
        );
        // Why each failing point fails, in full, under the title.
        let mut why: Vec<String> = points
            .iter()
            .filter_map(|p| {
                p.verdict
                    .as_deref()?
                    .strip_prefix("FAIL: ")
                    .map(str::to_string)
            })
            .collect();
        why.dedup();
        for (i, reason) in why.iter().take(3).enumerate() {
            let _ = writeln!(
                s,
                r##"<text x="{}" y="{}" text-anchor="end" fill="#cf222e">fails: {}</text>"##,
                w - r,
                t + 26.0 + 14.0 * i as f64,
                escape(reason)
            );
        }
    }
    s.push_str("</svg>\n");
    s
}

pub(crate) fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A tick label with as many decimals as its size needs.
pub(crate) fn trim(v: f64) -> String {
    if v >= 100.0 || v == 0.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_match_the_policy_worked_example() {
        let r = regions(1, 256).unwrap();
        assert_eq!(r.low, [2, 7]);
        assert_eq!(r.med, [8, 41]);
        assert_eq!(r.high, [42, 256]);
        assert!(regions(1, 32).is_none());
    }
}
