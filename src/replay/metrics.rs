//! Metrics over the performance window with the reference's formulas (§15) and percentile
//! method, plus what the reference lacks: e2e interactivity, tps per user, per-user progress,
//! schedule lag, latency from the intended start, and failures by kind.
//!
//! Turn filter for every latency and rate: tracked (issued while tracking was on), completed
//! with a 200, not synthetic. Failed and aborted turns are only counted.

use std::collections::BTreeMap;

use serde::Serialize;

use super::scheduler::{Finish, TrajectoryRecord, TurnKind, TurnRecord};

/// The reference's percentile grid and key spelling.
pub(crate) const PERCENTILES: [(f64, &str); 12] = [
    (99.9, "99.9"),
    (99.0, "99.0"),
    (97.0, "97.0"),
    (95.0, "95.0"),
    (90.0, "90.0"),
    (80.0, "80.0"),
    (75.0, "75.0"),
    (50.0, "50.0"),
    (25.0, "25.0"),
    (10.0, "10.0"),
    (5.0, "5.0"),
    (1.0, "1.0"),
];

/// `np.percentile(values, p, method="lower")` on ascending-sorted values.
pub(crate) fn percentile_lower(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((p / 100.0) * (sorted.len() - 1) as f64).floor() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

/// A series summary in the reference's shape.
#[derive(Debug, Clone, Serialize, Default)]
pub struct Series {
    /// Sum.
    pub total: f64,
    /// Minimum.
    pub min: f64,
    /// Maximum.
    pub max: f64,
    /// Median (mean of the middle two for even counts, like `np.median`).
    pub median: f64,
    /// Mean.
    pub avg: f64,
    /// Sample standard deviation.
    pub std_dev: f64,
    /// Number of values.
    pub count: usize,
    /// Lower-method percentiles keyed "99.9" … "1.0".
    pub percentiles: BTreeMap<&'static str, f64>,
    /// 30 log-spaced buckets over [min, max].
    pub histogram: Histogram,
}

/// Histogram in the reference's shape.
#[derive(Debug, Clone, Serialize, Default)]
pub struct Histogram {
    /// `[lo, hi]` per bucket.
    pub buckets: Vec<[f64; 2]>,
    /// Count per bucket.
    pub counts: Vec<u64>,
}

impl Series {
    /// Summarises `values` (any order).
    pub fn of(mut values: Vec<f64>) -> Option<Series> {
        if values.is_empty() {
            return None;
        }
        values.sort_by(|a, b| a.total_cmp(b));
        let n = values.len();
        let total: f64 = values.iter().sum();
        let avg = total / n as f64;
        let var = if n > 1 {
            values.iter().map(|v| (v - avg).powi(2)).sum::<f64>() / (n - 1) as f64
        } else {
            0.0
        };
        let median = if n % 2 == 1 {
            values[n / 2]
        } else {
            (values[n / 2 - 1] + values[n / 2]) / 2.0
        };
        let percentiles = PERCENTILES
            .iter()
            .map(|(p, k)| (*k, percentile_lower(&values, *p)))
            .collect();
        Some(Series {
            total,
            min: values[0],
            max: values[n - 1],
            median,
            avg,
            std_dev: var.sqrt(),
            count: n,
            percentiles,
            histogram: histogram(&values),
        })
    }

    /// A percentile from the grid.
    pub fn p(&self, key: &str) -> f64 {
        self.percentiles.get(key).copied().unwrap_or(f64::NAN)
    }
}

fn histogram(sorted: &[f64]) -> Histogram {
    let (min, max) = (sorted[0], sorted[sorted.len() - 1]);
    let lo = if min > 0.0 {
        min
    } else {
        1.0f64.min(max.max(1e-9))
    };
    if max <= lo {
        return Histogram {
            buckets: vec![[min, max]],
            counts: vec![sorted.len() as u64],
        };
    }
    let (l0, l1) = (lo.ln(), max.ln());
    let edges: Vec<f64> = (0..=30)
        .map(|i| (l0 + (l1 - l0) * i as f64 / 30.0).exp())
        .collect();
    let mut counts = vec![0u64; 30];
    for v in sorted {
        let i = edges[1..].partition_point(|e| e < v).min(29);
        counts[i] += 1;
    }
    Histogram {
        buckets: edges.windows(2).map(|w| [w[0], w[1]]).collect(),
        counts,
    }
}

/// Per-user (slot) progress, agentrace's addition (reference §15.4).
#[derive(Debug, Clone, Serialize)]
pub struct UserProgress {
    /// Slot index.
    pub slot: u32,
    /// Completed tracked turns.
    pub turns: u64,
    /// Their output tokens.
    pub output_tokens: u64,
    /// Output tokens / Σ turn e2e seconds for this user.
    pub tokens_per_s: f64,
    /// Trajectories this user completed (all turns OK), and when (s since window start).
    pub trajectories_completed: u64,
    /// Completion times of those trajectories, seconds since the window opened.
    pub completion_times_s: Vec<f64>,
    /// Turns completed per time bucket (see `PerUser::bucket_s`).
    pub turns_over_time: Vec<u32>,
    /// Output tokens of the turns completed in each of [`TOKEN_BUCKETS`] equal buckets of the
    /// window (see `PerUser::tokens_bucket_s`): who made progress when, and who starved.
    pub output_tokens_over_time: Vec<u64>,
}

/// Buckets of `UserProgress::output_tokens_over_time`: fixed, so a short run still draws a
/// curve and a long one stays small.
pub(crate) const TOKEN_BUCKETS: usize = 60;

/// Distribution of a per-user figure across users.
#[derive(Debug, Clone, Serialize, Default)]
pub struct Spread {
    /// Minimum.
    pub min: f64,
    /// 10th percentile (lower method).
    pub p10: f64,
    /// Median.
    pub median: f64,
    /// 90th percentile.
    pub p90: f64,
    /// Maximum.
    pub max: f64,
}

impl Spread {
    fn of(values: Vec<f64>) -> Spread {
        match Series::of(values) {
            None => Spread::default(),
            Some(s) => Spread {
                min: s.min,
                p10: s.p("10.0"),
                median: s.median,
                p90: s.p("90.0"),
                max: s.max,
            },
        }
    }
}

/// Per-user progress and its spread.
#[derive(Debug, Clone, Serialize, Default)]
pub struct PerUser {
    /// Width of a `turns_over_time` bucket in seconds.
    pub bucket_s: f64,
    /// Width of an `output_tokens_over_time` bucket in seconds (the window / [`TOKEN_BUCKETS`]).
    pub tokens_bucket_s: f64,
    /// Output tokens per user.
    pub output_tokens: Spread,
    /// Completed turns per user.
    pub turns: Spread,
    /// Per-user rate (Σ OSL / Σ turn time).
    pub tokens_per_s: Spread,
    /// Users, by slot.
    pub users: Vec<UserProgress>,
}

/// Failures by kind (every turn, tracked or not).
#[derive(Debug, Clone, Serialize, Default)]
pub struct Failures {
    /// Non-200 status.
    pub http_status: u64,
    /// Connect/read/write failures.
    pub transport: u64,
    /// Error events or unreadable bodies.
    pub bad_response: u64,
    /// Turn timeouts (cancelled).
    pub timeout: u64,
    /// Synthetic turns after a failure.
    pub aborted: u64,
    /// Interrupted by shutdown.
    pub interrupted: u64,
}

impl Failures {
    /// All failed turns.
    pub fn total(&self) -> u64 {
        self.http_status
            + self.transport
            + self.bad_response
            + self.timeout
            + self.aborted
            + self.interrupted
    }
}

/// How many failed turns gave one reason (the error message, cut to
/// [`FailureReasons::MAX_REASON_CHARS`]). Messages that differ only in their numbers (token
/// counts, ids) are one reason, shown by its first message.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct FailureReason {
    /// The failure kind.
    pub kind: TurnKind,
    /// The first error message of this reason.
    pub reason: String,
    /// Turns that failed with it.
    pub count: u64,
}

/// Failure reasons with their counts, bounded: past [`FailureReasons::MAX_REASONS`] distinct
/// reasons, further ones are only counted in `other`.
#[derive(Debug, Clone, Default)]
pub(crate) struct FailureReasons {
    /// (kind, message with digit runs as `#`) → (first message, count).
    counts: BTreeMap<(TurnKind, String), (String, u64)>,
    /// Failures whose reason was not kept.
    pub other: u64,
}

/// The message with every run of digits replaced by `#`: a server that names the size of each
/// refused request gives one reason, not one per request.
fn reason_shape(reason: &str) -> String {
    let mut out = String::with_capacity(reason.len());
    let mut in_digits = false;
    for c in reason.chars() {
        if c.is_ascii_digit() {
            if !in_digits {
                out.push('#');
            }
            in_digits = true;
        } else {
            out.push(c);
            in_digits = false;
        }
    }
    out
}

impl FailureReasons {
    /// Distinct reasons kept.
    pub(crate) const MAX_REASONS: usize = 32;
    /// Longest reason kept, in characters.
    pub(crate) const MAX_REASON_CHARS: usize = 200;

    /// Counts one failure.
    pub(crate) fn add(&mut self, kind: TurnKind, reason: &str) {
        let reason = match reason.char_indices().nth(Self::MAX_REASON_CHARS) {
            Some((cut, _)) => format!("{}…", &reason[..cut]),
            None => reason.to_string(),
        };
        self.count((kind, reason_shape(&reason)), reason, 1);
    }

    fn count(&mut self, key: (TurnKind, String), example: String, n: u64) {
        if let Some((_, c)) = self.counts.get_mut(&key) {
            *c += n;
        } else if self.counts.len() < Self::MAX_REASONS {
            self.counts.insert(key, (example, n));
        } else {
            self.other += n;
        }
    }

    /// Adds another set's counts.
    pub(crate) fn merge(&mut self, other: FailureReasons) {
        self.other += other.other;
        for (key, (example, n)) in other.counts {
            self.count(key, example, n);
        }
    }

    /// The reasons, most frequent first.
    pub(crate) fn ranked(&self) -> Vec<FailureReason> {
        let mut out: Vec<FailureReason> = self
            .counts
            .iter()
            .map(|((kind, _), (example, count))| FailureReason {
                kind: *kind,
                reason: example.clone(),
                count: *count,
            })
            .collect();
        out.sort_by_key(|r| std::cmp::Reverse(r.count));
        out
    }
}

/// Turn counts.
#[derive(Debug, Clone, Serialize, Default)]
pub struct TurnCounts {
    /// Every ISSUED record (sent or synthetic).
    pub issued: u64,
    /// Sent on the wire.
    pub sent: u64,
    /// Completed with a 200.
    pub ok: u64,
    /// Failed or aborted.
    pub failed: u64,
    /// Issued while tracking was on.
    pub tracked_issued: u64,
    /// Of those, completed with a 200 (the turns every rate uses).
    pub tracked_ok: u64,
    /// Issued after STOP_PERFORMANCE_TRACKING (outside the window).
    pub issued_after_stop: u64,
}

/// Every metric of one run.
#[derive(Debug, Clone, Serialize, Default)]
pub struct Metrics {
    /// The turn filter, in words.
    pub turn_filter: &'static str,
    /// Token counts came from server `usage` for every turn (false = some estimated).
    pub tokens_from_usage: bool,
    /// Turns whose counts were estimated (≈ 4 chars per token).
    pub estimated_turns: u64,
    /// START → last tracked COMPLETE (ns).
    pub tracked_duration_ns: u64,
    /// START → last COMPLETE of any turn (ns): includes the tail after STOP.
    pub total_duration_ns: u64,
    /// STOP → last COMPLETE (ns): the tail the window excluded.
    pub tail_duration_ns: u64,
    /// Successful tracked turns / tracked duration.
    pub qps: f64,
    /// Reference-compatible QPS: tracked completions including failures / tracked duration.
    pub qps_reference: f64,
    /// Σ tracked OSL / tracked duration (the policy's `system_tps`).
    pub system_tps: f64,
    /// Σ OSL / Σ turn e2e seconds over tracked successful turns (MLPerf's
    /// `e2e_avg_interactivity`).
    pub e2e_interactivity: f64,
    /// 1000 / TPOT p90 (ms).
    pub tps_per_user: f64,
    /// TTFT p90 in ms.
    pub ttft_p90_ms: f64,
    /// COMPLETE − ISSUED (ns).
    pub latency: Option<Series>,
    /// RECV_FIRST − ISSUED (ns).
    pub ttft: Option<Series>,
    /// First response byte − ISSUED (ns).
    pub ttfb: Option<Series>,
    /// (COMPLETE − RECV_FIRST) / (output tokens − 1) (ns).
    pub tpot: Option<Series>,
    /// Mean gap between delta events per turn (ns).
    pub itl: Option<Series>,
    /// COMPLETE − intended start (ns): latency including any client lateness.
    pub latency_from_intended: Option<Series>,
    /// Output tokens per turn.
    pub output_sequence_lengths: Option<Series>,
    /// Mean output tokens per turn over every turn that completed with a 200, inside the
    /// window or after it: the tail turns finish after the window and are longer on average,
    /// so this mean sits beside the tracked one (the gate uses the tracked one).
    pub osl_mean_all_completed: Option<f64>,
    /// Prompt tokens per turn.
    pub input_sequence_lengths: Option<Series>,
    /// Send − deadline (ns), every sent turn.
    pub schedule_lag: Option<Series>,
    /// Send − deadline (ns) of the turns that waited out a recorded delay: the pacer's own
    /// precision, without the burst of first turns that all fall due at the start.
    pub schedule_lag_delayed: Option<Series>,
    /// Prefix-cache hit ratio reported by the server (cached / prompt tokens).
    pub cached_token_ratio: Option<f64>,
    /// Finish reasons of tracked successful turns.
    pub finish_reason_counts: BTreeMap<&'static str, u64>,
    /// Turn counts.
    pub turns: TurnCounts,
    /// Failures by kind.
    pub failures: Failures,
    /// Why turns failed, most frequent first (aborted and interrupted turns left out).
    pub failure_reasons: Vec<FailureReason>,
    /// Failed turns whose reason was not kept (past the distinct reasons listed).
    pub failure_reasons_other: u64,
    /// Trajectories started / fully completed.
    pub trajectories_started: u64,
    /// Trajectories whose every turn succeeded.
    pub trajectories_completed: u64,
    /// Per-user progress.
    pub per_user: PerUser,
}

/// Inputs of the computation.
pub(crate) struct Window<'a> {
    /// Every turn record.
    pub turns: &'a [TurnRecord],
    /// Every trajectory.
    pub trajectories: &'a [TrajectoryRecord],
    /// Send − deadline per sent turn, and whether it waited out a delay.
    pub lags_ns: &'a [(i64, bool)],
    /// START_PERFORMANCE_TRACKING (ns).
    pub start_ns: u64,
    /// STOP (ns), if it happened.
    pub stop_ns: Option<u64>,
    /// Number of slots.
    pub concurrency: usize,
    /// Turns issued after STOP.
    pub issued_after_stop: u64,
    /// Why turns failed.
    pub failure_reasons: &'a FailureReasons,
}

/// Computes every metric.
pub(crate) fn compute(w: &Window<'_>) -> Metrics {
    let mut m = Metrics {
        turn_filter: "tracked (issued inside the performance window), HTTP 200, not synthetic",
        ..Default::default()
    };
    let good: Vec<&TurnRecord> = w
        .turns
        .iter()
        .filter(|t| t.tracked && t.kind == TurnKind::Ok)
        .collect();
    for t in w.turns {
        m.turns.issued += 1;
        if t.kind != TurnKind::Aborted {
            m.turns.sent += 1;
        }
        if t.kind == TurnKind::Ok {
            m.turns.ok += 1;
        } else {
            m.turns.failed += 1;
        }
        if t.tracked {
            m.turns.tracked_issued += 1;
        }
        match t.kind {
            TurnKind::Ok => {}
            TurnKind::HttpStatus => m.failures.http_status += 1,
            TurnKind::Transport => m.failures.transport += 1,
            TurnKind::BadResponse => m.failures.bad_response += 1,
            TurnKind::Timeout => m.failures.timeout += 1,
            TurnKind::Aborted => m.failures.aborted += 1,
            TurnKind::Interrupted => m.failures.interrupted += 1,
        }
    }
    m.turns.tracked_ok = good.len() as u64;
    m.turns.issued_after_stop = w.issued_after_stop;
    m.failure_reasons = w.failure_reasons.ranked();
    m.failure_reasons_other = w.failure_reasons.other;
    m.estimated_turns = w
        .turns
        .iter()
        .filter(|t| t.kind == TurnKind::Ok && t.estimated)
        .count() as u64;
    m.tokens_from_usage = m.estimated_turns == 0;

    let last_tracked = w
        .turns
        .iter()
        .filter(|t| t.tracked)
        .map(|t| t.complete_ns)
        .max()
        .unwrap_or(w.start_ns);
    let last_any = w
        .turns
        .iter()
        .map(|t| t.complete_ns)
        .max()
        .unwrap_or(w.start_ns);
    m.tracked_duration_ns = last_tracked.saturating_sub(w.start_ns);
    m.total_duration_ns = last_any.saturating_sub(w.start_ns);
    m.tail_duration_ns = w.stop_ns.map_or(0, |s| last_any.saturating_sub(s));
    let dur_s = m.tracked_duration_ns as f64 / 1e9;
    let osl_sum: u64 = good.iter().map(|t| t.output_tokens).sum();
    if dur_s > 0.0 {
        m.qps = good.len() as f64 / dur_s;
        let completed_incl_failures = w.turns.iter().filter(|t| t.tracked).count();
        m.qps_reference = completed_incl_failures as f64 / dur_s;
        m.system_tps = osl_sum as f64 / dur_s;
    }
    let (mut osl, mut e2e) = (0u64, 0u64);
    // Every completed turn's time counts, as the policy's "across completed turns": a turn
    // that answered nothing still kept its user waiting.
    for t in &good {
        osl += t.output_tokens;
        e2e += t.complete_ns - t.issued_ns;
    }
    if e2e > 0 {
        m.e2e_interactivity = osl as f64 / (e2e as f64 / 1e9);
    }

    let ns = |f: &dyn Fn(&TurnRecord) -> Option<f64>| -> Option<Series> {
        Series::of(good.iter().filter_map(|t| f(t)).collect())
    };
    m.latency = ns(&|t| Some((t.complete_ns - t.issued_ns) as f64));
    m.ttft = ns(&|t| {
        t.first_token_ns
            .map(|f| f.saturating_sub(t.issued_ns) as f64)
    });
    m.ttfb = ns(&|t| {
        t.first_byte_ns
            .map(|f| f.saturating_sub(t.issued_ns) as f64)
    });
    m.tpot = ns(&|t| match (t.first_token_ns, t.output_tokens) {
        (Some(f), n) if n > 1 && t.streaming => {
            Some(t.complete_ns.saturating_sub(f) as f64 / (n - 1) as f64)
        }
        _ => None,
    });
    m.itl = ns(&|t| t.itl_ns.map(|v| v as f64));
    m.latency_from_intended =
        ns(&|t| Some(t.complete_ns.saturating_sub(t.intended_ns.min(t.issued_ns)) as f64));
    m.output_sequence_lengths = ns(&|t| Some(t.output_tokens as f64));
    m.input_sequence_lengths = ns(&|t| Some(t.prompt_tokens as f64));
    let completed: Vec<u64> = w
        .turns
        .iter()
        .filter(|t| t.kind == TurnKind::Ok)
        .map(|t| t.output_tokens)
        .collect();
    m.osl_mean_all_completed = (!completed.is_empty())
        .then(|| completed.iter().sum::<u64>() as f64 / completed.len() as f64);
    m.schedule_lag = Series::of(w.lags_ns.iter().map(|v| v.0 as f64).collect());
    m.schedule_lag_delayed = Series::of(
        w.lags_ns
            .iter()
            .filter(|v| v.1)
            .map(|v| v.0 as f64)
            .collect(),
    );
    let (cached, prompt) = good.iter().fold((0u64, 0u64), |(c, p), t| {
        (c + t.cached_tokens.unwrap_or(0), p + t.prompt_tokens)
    });
    if good.iter().any(|t| t.cached_tokens.is_some()) && prompt > 0 {
        m.cached_token_ratio = Some(cached as f64 / prompt as f64);
    }
    if let Some(tpot) = &m.tpot {
        let p90_ms = tpot.p("90.0") / 1e6;
        if p90_ms > 0.0 {
            m.tps_per_user = 1000.0 / p90_ms;
        }
    }
    if let Some(ttft) = &m.ttft {
        m.ttft_p90_ms = ttft.p("90.0") / 1e6;
    }
    for key in [
        "stop",
        "length",
        "tool_calls",
        "content_filter",
        "function_call",
        "other",
    ] {
        m.finish_reason_counts.insert(key, 0);
    }
    for t in &good {
        let key = match t.finish {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::ToolCalls => "tool_calls",
            Finish::ContentFilter => "content_filter",
            Finish::FunctionCall => "function_call",
            Finish::Other => "other",
        };
        *m.finish_reason_counts.entry(key).or_default() += 1;
    }
    m.trajectories_started = w.trajectories.len() as u64;
    m.trajectories_completed = w.trajectories.iter().filter(|t| t.completed).count() as u64;
    m.per_user = per_user(w, &good, m.tracked_duration_ns);
    m
}

fn per_user(w: &Window<'_>, good: &[&TurnRecord], window_ns: u64) -> PerUser {
    let window_s = (window_ns as f64 / 1e9).max(1e-9);
    let bucket_s = (window_s / 60.0).max(1.0).ceil();
    let n_buckets = ((window_s / bucket_s).ceil() as usize).max(1);
    let tokens_bucket_s = window_s / TOKEN_BUCKETS as f64;
    let mut users: Vec<UserProgress> = (0..w.concurrency as u32)
        .map(|slot| UserProgress {
            slot,
            turns: 0,
            output_tokens: 0,
            tokens_per_s: 0.0,
            trajectories_completed: 0,
            completion_times_s: Vec::new(),
            turns_over_time: vec![0; n_buckets],
            output_tokens_over_time: vec![0; TOKEN_BUCKETS],
        })
        .collect();
    let mut e2e = vec![0u64; users.len()];
    for t in good {
        let Some(u) = users.get_mut(t.slot as usize) else {
            continue;
        };
        u.turns += 1;
        u.output_tokens += t.output_tokens;
        e2e[t.slot as usize] += t.complete_ns - t.issued_ns;
        let at = t.complete_ns.saturating_sub(w.start_ns) as f64 / 1e9;
        let b = ((at / bucket_s) as usize).min(n_buckets - 1);
        u.turns_over_time[b] += 1;
        let tb = ((at / tokens_bucket_s) as usize).min(TOKEN_BUCKETS - 1);
        u.output_tokens_over_time[tb] += t.output_tokens;
    }
    for t in w.trajectories.iter().filter(|t| t.completed) {
        if let Some(u) = users.get_mut(t.slot as usize) {
            u.trajectories_completed += 1;
            u.completion_times_s
                .push(t.end_ns.saturating_sub(w.start_ns) as f64 / 1e9);
        }
    }
    for (u, e) in users.iter_mut().zip(&e2e) {
        if *e > 0 {
            u.tokens_per_s = u.output_tokens as f64 / (*e as f64 / 1e9);
        }
    }
    PerUser {
        bucket_s,
        tokens_bucket_s,
        output_tokens: Spread::of(users.iter().map(|u| u.output_tokens as f64).collect()),
        turns: Spread::of(users.iter().map(|u| u.turns as f64).collect()),
        tokens_per_s: Spread::of(users.iter().map(|u| u.tokens_per_s).collect()),
        users,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lower_percentile_picks_floor_index_like_numpy_lower() {
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        // floor(0.9 * 9) = 8 → 9.0; floor(0.5 * 9) = 4 → 5.0; floor(0.999 * 9) = 8 → 9.0
        assert_eq!(percentile_lower(&v, 90.0), 9.0);
        assert_eq!(percentile_lower(&v, 50.0), 5.0);
        assert_eq!(percentile_lower(&v, 99.9), 9.0);
        assert_eq!(percentile_lower(&v, 1.0), 1.0);
        let s = Series::of(v).unwrap();
        assert_eq!(s.median, 5.5);
        assert_eq!(s.histogram.counts.iter().sum::<u64>(), 10);
        assert!((s.std_dev - 3.0276503540974917).abs() < 1e-12);
    }

    #[test]
    fn messages_differing_only_in_numbers_are_one_reason_shown_by_the_first() {
        let mut r = FailureReasons::default();
        for tokens in [91_000, 120_500, 194_002] {
            r.add(
                TurnKind::HttpStatus,
                &format!("HTTP 400: exceeds the KV capacity of 80000 tokens; prompt {tokens}"),
            );
        }
        r.add(TurnKind::HttpStatus, "HTTP 503: overloaded");
        let ranked = r.ranked();
        assert_eq!(ranked.len(), 2, "{ranked:?}");
        assert_eq!(ranked[0].count, 3);
        assert!(ranked[0].reason.ends_with("prompt 91000"), "{ranked:?}");
        assert_eq!(
            (ranked[1].count, ranked[1].reason.as_str()),
            (1, "HTTP 503: overloaded")
        );
    }
}
