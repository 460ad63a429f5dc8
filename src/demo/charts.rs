//! The page's figures as inline SVG drawn here: no script, no font file, no plotting library.
//! Every chart names its unit and its time base on its axes.

use std::fmt::Write as _;

use crate::replay::sweep::{escape, nice_max, trim};

/// One policy's colour on every chart, so a reader learns it once.
pub(crate) fn colour(label: &str) -> &'static str {
    match label {
        "affinity" => "#1f6feb",
        _ => "#d4731a",
    }
}

/// Plot area and scales of one chart.
struct Frame {
    w: f64,
    h: f64,
    l: f64,
    r: f64,
    t: f64,
    b: f64,
    xmax: f64,
    ymax: f64,
}

impl Frame {
    fn new(w: f64, h: f64, xmax: f64, ymax: f64) -> Frame {
        Frame {
            w,
            h,
            l: 70.0,
            r: 20.0,
            t: 56.0,
            b: 50.0,
            xmax: nice_max(xmax),
            ymax: nice_max(ymax),
        }
    }

    fn px(&self, x: f64) -> f64 {
        self.l + (x / self.xmax).clamp(0.0, 1.0) * (self.w - self.l - self.r)
    }

    fn py(&self, y: f64) -> f64 {
        self.h - self.b - (y / self.ymax).clamp(0.0, 1.0) * (self.h - self.t - self.b)
    }

    /// The `<svg>` opening, title, grid, ticks and axis labels; `ytick` formats a y value,
    /// and x ticks are drawn only on a continuous x axis (`xticks`).
    fn open(
        &self,
        title: &str,
        (xlabel, xticks): (&str, bool),
        ylabel: &str,
        ytick: &dyn Fn(f64) -> String,
    ) -> String {
        let (w, h, l, r, t, b) = (self.w, self.h, self.l, self.r, self.t, self.b);
        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" role="img" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12"><title>{0}</title>"#,
            escape(title)
        );
        let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
        let _ = writeln!(
            s,
            r#"<text x="{}" y="20" text-anchor="middle" font-size="14">{}</text>"#,
            w / 2.0,
            escape(title)
        );
        for i in 0..=5 {
            let (xv, yv) = (self.xmax * i as f64 / 5.0, self.ymax * i as f64 / 5.0);
            if xticks {
                let _ = writeln!(
                    s,
                    r##"<line x1="{0:.1}" y1="{t}" x2="{0:.1}" y2="{1}" stroke="#eee"/><text x="{0:.1}" y="{2}" text-anchor="middle">{3}</text>"##,
                    self.px(xv),
                    h - b,
                    h - b + 16.0,
                    trim(xv)
                );
            }
            let _ = writeln!(
                s,
                r##"<line x1="{l}" y1="{0:.1}" x2="{1}" y2="{0:.1}" stroke="#eee"/><text x="{2}" y="{3:.1}" text-anchor="end">{4}</text>"##,
                self.py(yv),
                w - r,
                l - 6.0,
                self.py(yv) + 4.0,
                ytick(yv)
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
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{}</text>"#,
            (l + w - r) / 2.0,
            h - 12.0,
            escape(xlabel)
        );
        let _ = writeln!(
            s,
            r#"<text x="16" y="{0:.1}" text-anchor="middle" transform="rotate(-90 16 {0:.1})">{1}</text>"#,
            (t + h - b) / 2.0,
            escape(ylabel)
        );
        s
    }

    /// Colour swatches with their labels in a row under the title, clear of the data.
    fn legend(&self, s: &mut String, entries: &[(&str, &str)]) {
        let y = 40.0;
        let mut x = self.l;
        for (label, colour) in entries {
            let _ = writeln!(
                s,
                r#"<rect x="{x}" y="{}" width="12" height="12" fill="{colour}"/><text x="{}" y="{}">{}</text>"#,
                y - 10.0,
                x + 18.0,
                y,
                escape(label)
            );
            x += 30.0 + 7.0 * label.chars().count() as f64;
        }
    }
}

/// A polyline through `points` (data coordinates).
fn polyline(f: &Frame, points: &[(f64, f64)], colour: &str, width: f64) -> String {
    let mut d = String::new();
    for (i, (x, y)) in points.iter().enumerate() {
        let _ = write!(
            d,
            "{}{:.1} {:.1}",
            if i == 0 { "M " } else { " L " },
            f.px(*x),
            f.py(*y)
        );
    }
    format!(r#"<path d="{d}" fill="none" stroke="{colour}" stroke-width="{width}"/>"#)
}

/// One policy's sweep, rates already in the page's time base.
pub(crate) struct ParetoSeries<'a> {
    /// `affinity` or `round-robin`.
    pub label: &'a str,
    /// `(e2e_interactivity, system_tps, concurrency)` per point.
    pub points: Vec<(f64, f64, usize)>,
    /// Per point, the failing gates with their values and rules; `None` when all pass.
    pub fails: Vec<Option<String>>,
}

/// Points no other point beats on both axes, by rising x: the step frontier.
fn frontier(points: &[(f64, f64, usize)]) -> Vec<(f64, f64)> {
    let mut front: Vec<(f64, f64)> = points
        .iter()
        .filter(|(x, y, _)| {
            !points
                .iter()
                .any(|(ox, oy, _)| ox >= x && oy >= y && (ox > x || oy > y))
        })
        .map(|(x, y, _)| (*x, *y))
        .collect();
    front.sort_by(|a, b| a.0.total_cmp(&b.0));
    front
}

/// Both policies' sweeps and their frontiers on one chart.
pub(crate) fn pareto(series: &[ParetoSeries<'_>], time_base: &str) -> String {
    let all = series.iter().flat_map(|s| s.points.iter());
    let xmax = all.clone().map(|p| p.0).fold(0.0, f64::max) * 1.1;
    let ymax = all.map(|p| p.1).fold(0.0, f64::max) * 1.1;
    let f = Frame::new(720.0, 420.0, xmax, ymax);
    let mut s = f.open(
        "Pareto frontier: system throughput vs interactivity, per policy",
        (
            &format!("e2e_interactivity (output tokens/s per user, {time_base})"),
            true,
        ),
        &format!("system_tps (output tokens/s, {time_base})"),
        &trim,
    );
    for sr in series {
        let c = colour(sr.label);
        let front = frontier(&sr.points);
        // Step frontier: up to each point's throughput, then across to its interactivity.
        let mut steps = Vec::new();
        for (i, p) in front.iter().enumerate() {
            if i > 0 {
                steps.push((front[i - 1].0, p.1));
            }
            steps.push(*p);
        }
        s.push_str(&polyline(&f, &steps, c, 2.0));
        for (i, (x, y, conc)) in sr.points.iter().enumerate() {
            // A point whose gates fail is drawn hollow.
            let fill = match sr.fails.get(i) {
                Some(Some(_)) => "white",
                _ => c,
            };
            let _ = writeln!(
                s,
                r#"<circle cx="{0:.1}" cy="{1:.1}" r="5" fill="{fill}" stroke="{c}" stroke-width="2"/><text x="{2:.1}" y="{3:.1}" fill="{c}">c={conc}</text>"#,
                f.px(*x),
                f.py(*y),
                f.px(*x) + 7.0,
                f.py(*y) - 7.0
            );
        }
    }
    let entries: Vec<(&str, &str)> = series.iter().map(|s| (s.label, colour(s.label))).collect();
    f.legend(&mut s, &entries);
    // One line per failing gate, with the first failing point's value as an example.
    let mut why: Vec<&str> = Vec::new();
    for reason in series
        .iter()
        .flat_map(|sr| sr.fails.iter().flatten())
        .flat_map(|r| r.split("; "))
    {
        let gate = reason.split_whitespace().next();
        if !why.iter().any(|w| w.split_whitespace().next() == gate) {
            why.push(reason);
        }
    }
    for (i, reason) in why.iter().take(3).enumerate() {
        let _ = writeln!(
            s,
            r##"<text x="{}" y="{}" fill="#cf222e">hollow point: a gate fails: {}{}</text>"##,
            f.l + 8.0,
            f.t + 12.0 + 14.0 * i as f64,
            escape(reason),
            if i == 0 { " (first failing point)" } else { "" }
        );
    }
    s.push_str("</svg>\n");
    s
}

/// Empirical CDFs of client TTFT, one line per policy; `series` values in ms, any order.
pub(crate) fn ttft_cdf(series: &[(&str, Vec<f64>)], time_base: &str) -> String {
    // The axis ends at the 99th percentile of all turns, so the body of the curves stays
    // readable; the slowest 1 % run off the right edge.
    let mut all: Vec<f64> = series.iter().flat_map(|(_, v)| v.iter().copied()).collect();
    all.sort_by(f64::total_cmp);
    let p99 = all
        .get((all.len() * 99 / 100).min(all.len().saturating_sub(1)))
        .copied()
        .unwrap_or(1.0);
    let f = Frame::new(720.0, 380.0, p99, 1.0);
    let mut s = f.open(
        "TTFT distribution (client side), per policy; axis cut at the 99th percentile",
        (&format!("time to first token (ms, {time_base})"), true),
        "share of turns at or below (%)",
        &|v| format!("{:.0}", v * 100.0),
    );
    for (label, values) in series {
        let mut sorted = values.clone();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len() as f64;
        let mut steps = vec![(0.0, 0.0)];
        for (i, v) in sorted.iter().enumerate() {
            steps.push((*v, i as f64 / n));
            steps.push((*v, (i + 1) as f64 / n));
        }
        s.push_str(&polyline(&f, &steps, colour(label), 2.0));
    }
    let entries: Vec<String> = series
        .iter()
        .map(|(l, v)| format!("{l} ({} turns)", v.len()))
        .collect();
    let pairs: Vec<(&str, &str)> = entries
        .iter()
        .zip(series)
        .map(|(e, (l, _))| (e.as_str(), colour(l)))
        .collect();
    f.legend(&mut s, &pairs);
    s.push_str("</svg>\n");
    s
}

/// One policy's users: cumulative output tokens per user at the end of each bucket.
pub(crate) struct Progress<'a> {
    /// `affinity` or `round-robin`.
    pub label: &'a str,
    /// Bucket width in the page's time base (seconds).
    pub bucket_s: f64,
    /// Per user, tokens completed in each bucket.
    pub users: Vec<Vec<u64>>,
}

/// Each user's cumulative output tokens over time, one panel per policy on shared scales;
/// the user with the fewest tokens at the end is drawn in red: the starved one.
pub(crate) fn user_progress(runs: &[Progress<'_>], time_base: &str) -> String {
    let cumulative = |u: &[u64]| -> Vec<u64> {
        u.iter()
            .scan(0, |acc, v| {
                *acc += v;
                Some(*acc)
            })
            .collect()
    };
    let xmax = runs
        .iter()
        .map(|r| r.bucket_s * r.users.first().map_or(0, Vec::len) as f64)
        .fold(0.0, f64::max);
    let ymax = runs
        .iter()
        .flat_map(|r| r.users.iter().map(|u| u.iter().sum::<u64>() as f64))
        .fold(0.0, f64::max);
    let mut out = String::new();
    for run in runs {
        let f = Frame::new(360.0, 340.0, xmax, ymax * 1.05);
        let mut s = f.open(
            &format!("{}: output tokens per user", run.label),
            (
                &format!("time since the window opened (s, {time_base})"),
                true,
            ),
            "output tokens, cumulative",
            &trim,
        );
        let totals: Vec<u64> = run.users.iter().map(|u| u.iter().sum()).collect();
        let starved = totals
            .iter()
            .enumerate()
            .min_by_key(|(_, t)| **t)
            .map(|(i, _)| i);
        for (i, u) in run.users.iter().enumerate() {
            let mut pts = vec![(0.0, 0.0)];
            pts.extend(
                cumulative(u)
                    .iter()
                    .enumerate()
                    .map(|(b, c)| ((b + 1) as f64 * run.bucket_s, *c as f64)),
            );
            if Some(i) != starved {
                s.push_str(&polyline(&f, &pts, colour(run.label), 1.0));
            }
        }
        if let Some(i) = starved {
            let mut pts = vec![(0.0, 0.0)];
            pts.extend(
                cumulative(&run.users[i])
                    .iter()
                    .enumerate()
                    .map(|(b, c)| ((b + 1) as f64 * run.bucket_s, *c as f64)),
            );
            s.push_str(&polyline(&f, &pts, "#cf222e", 2.0));
            let _ = writeln!(
                s,
                r##"<text x="{}" y="{}" fill="#cf222e">red: slowest user (slot {i}, {} tokens)</text>"##,
                f.l + 8.0,
                f.t + 12.0,
                totals[i]
            );
        }
        s.push_str("</svg>\n");
        out.push_str(&s);
    }
    out
}

/// Prefix-cache hit rate of each replica, one bar per policy.
pub(crate) fn hit_rates(runs: &[(&str, Vec<(String, f64)>)]) -> String {
    let replicas = runs.iter().map(|(_, r)| r.len()).max().unwrap_or(0);
    let f = Frame::new(720.0, 340.0, 1.0, 1.0);
    let mut s = f.open(
        "Prefix-cache hit rate per replica (tokens found in the cache / tokens looked up)",
        ("replica", false),
        "prefix-cache hit rate (%)",
        &|v| format!("{:.0}", v * 100.0),
    );
    let group = (f.w - f.l - f.r) / replicas.max(1) as f64;
    let bar = group * 0.8 / runs.len().max(1) as f64;
    for g in 0..replicas {
        let x0 = f.l + group * g as f64 + group * 0.1;
        for (k, (label, rates)) in runs.iter().enumerate() {
            let Some((_, rate)) = rates.get(g) else {
                continue;
            };
            let (x, y) = (x0 + bar * k as f64, f.py(*rate));
            let _ = writeln!(
                s,
                r#"<rect x="{x:.1}" y="{y:.1}" width="{:.1}" height="{:.1}" fill="{}"/><text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="11">{:.0}%</text>"#,
                bar - 2.0,
                f.py(0.0) - y,
                colour(label),
                x + bar / 2.0,
                y - 4.0,
                rate * 100.0
            );
        }
        let name = runs
            .iter()
            .find_map(|(_, r)| r.get(g).map(|(n, _)| n.clone()))
            .unwrap_or_default();
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{}</text>"#,
            f.l + group * (g as f64 + 0.5),
            f.h - f.b + 16.0,
            escape(&name)
        );
    }
    let entries: Vec<(&str, &str)> = runs.iter().map(|(l, _)| (*l, colour(l))).collect();
    f.legend(&mut s, &entries);
    s.push_str("</svg>\n");
    s
}
