//! What a person reads: `result_summary.json`, `report.txt` (one screen), the accuracy and OSL
//! gates, and the live progress line on stderr.

use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;

use super::config::ReplayConfig;
use super::metrics::{Metrics, Series};
use super::owners::ByOwner;
use super::per_target::TargetFigures;
use super::scheduler::Progress;
use super::scorer::Scores;
use super::{Gate, ReplaySummary};
use crate::dataset::Dataset;
use crate::shutdown::Shutdown;

/// The accuracy and OSL gates in force.
pub(crate) fn gates(config: &ReplayConfig, m: &Metrics, scores: &Scores) -> Vec<Gate> {
    let Some(g) = config.gates() else {
        return Vec::new();
    };
    let osl = m.output_sequence_lengths.as_ref().map(|s| s.avg);
    vec![
        Gate {
            name: "inline_accuracy",
            value: scores.score,
            rule: format!(">= {:.4}", g.accuracy),
            pass: scores.score.is_some_and(|s| s >= g.accuracy),
        },
        Gate {
            name: "osl_per_turn_mean",
            value: osl,
            rule: format!(
                "{:.0}-{:.0} tokens{}",
                g.osl_band[0],
                g.osl_band[1],
                if m.tokens_from_usage {
                    ""
                } else {
                    " (estimated)"
                }
            ),
            pass: osl.is_some_and(|v| v >= g.osl_band[0] && v <= g.osl_band[1]),
        },
    ]
}

/// The gates' verdict where a person reads it: `None` without gates (nothing to pass),
/// `PASS`, or `FAIL` with each failing gate's value against its rule.
pub fn verdict(gates: &[Gate]) -> Option<String> {
    if gates.is_empty() {
        return None;
    }
    let failing: Vec<String> = gates
        .iter()
        .filter(|g| !g.pass)
        .map(|g| {
            format!(
                "{} {} not {}",
                g.name,
                g.value.map_or("-".into(), |v| format!("{v:.4}")),
                g.rule
            )
        })
        .collect();
    Some(if failing.is_empty() {
        "PASS".into()
    } else {
        format!("FAIL: {}", failing.join("; "))
    })
}

fn ms(s: &Option<Series>, key: &str) -> f64 {
    s.as_ref().map_or(f64::NAN, |s| {
        if key == "median" {
            s.median / 1e6
        } else {
            s.p(key) / 1e6
        }
    })
}

/// The headline.
pub(crate) fn summary(
    config: &ReplayConfig,
    m: &Metrics,
    scores: &Scores,
    gates: Vec<Gate>,
    complete: bool,
    wall_s: f64,
) -> ReplaySummary {
    let lag = |key: &str| {
        m.schedule_lag.as_ref().map_or(f64::NAN, |s| {
            if key == "max" {
                s.max / 1e3
            } else {
                s.p(key) / 1e3
            }
        })
    };
    ReplaySummary {
        concurrency: config.concurrency,
        complete,
        system_tps: m.system_tps,
        e2e_interactivity: m.e2e_interactivity,
        tps_per_user: m.tps_per_user,
        ttft_p50_ms: ms(&m.ttft, "50.0"),
        ttft_p90_ms: ms(&m.ttft, "90.0"),
        ttft_p99_ms: ms(&m.ttft, "99.0"),
        tpot_p50_ms: ms(&m.tpot, "50.0"),
        tpot_p90_ms: ms(&m.tpot, "90.0"),
        latency_p50_ms: ms(&m.latency, "50.0"),
        user_tps_min: m.per_user.tokens_per_s.min,
        user_tps_p10: m.per_user.tokens_per_s.p10,
        user_tps_median: m.per_user.tokens_per_s.median,
        accuracy: scores.score,
        accuracy_missing: scores.missing,
        gates_pass: gates.iter().all(|g| g.pass),
        gates,
        schedule_lag_p50_us: lag("50.0"),
        schedule_lag_p99_us: lag("99.0"),
        schedule_lag_max_us: lag("max"),
        schedule_lag_delayed_p99_us: m
            .schedule_lag_delayed
            .as_ref()
            .map_or(f64::NAN, |s| s.p("99.0") / 1e3),
        failures: m.failures.total(),
        failures_by_kind: m.failures.clone(),
        turns_issued: m.turns.issued,
        turns_ok: m.turns.ok,
        turns_tracked: m.turns.tracked_ok,
        tokens_estimated: !m.tokens_from_usage,
        wall_s,
    }
}

/// Inputs of `result_summary.json`.
pub(crate) struct SummaryInputs<'a> {
    /// Run config.
    pub config: &'a ReplayConfig,
    /// Dataset.
    pub dataset: &'a Dataset,
    /// Metrics.
    pub metrics: &'a Metrics,
    /// Headline.
    pub summary: &'a ReplaySummary,
    /// Scores.
    pub scores: &'a Scores,
    /// `unix_ns` at the events' `timestamp_ns` 0.
    pub wall_anchor_unix_ns: u64,
    /// The system monotonic clock at the process-local 0, added to every `timestamp_ns` of
    /// `events.jsonl` (0 where the clock cannot be read: the file then stays process-local).
    pub clock_zero_monotonic_ns: u64,
    /// Lines in `events.jsonl`.
    pub event_lines: u64,
    /// Each endpoint's share, in `config.target`'s order.
    pub per_target: &'a [TargetFigures],
    /// The agentic metrics, one section per owner.
    pub by_owner: &'a ByOwner,
}

/// `result_summary.json`: the reference's keys first, then agentrace's additions.
pub(crate) fn result_summary(i: SummaryInputs<'_>) -> serde_json::Value {
    let m = i.metrics;
    let mut config = serde_json::to_value(i.config).unwrap_or_default();
    if let Some(obj) = config.as_object_mut() {
        // Only the variable's name is kept; the key itself never reaches a file.
        obj.insert(
            "api_key".into(),
            json!(i.config.api_key_env.as_ref().map(|_| "<redacted>")),
        );
    }
    json!({
        "version": env!("CARGO_PKG_VERSION"),
        "agentrace_version": env!("CARGO_PKG_VERSION"),
        "n_samples_issued": m.turns.tracked_issued,
        "n_samples_completed": m.turns.tracked_ok,
        "n_samples_failed": m.turns.tracked_issued - m.turns.tracked_ok,
        // The two failure counts of this file, each with what it counts (report.txt shows both).
        "failure_counts": {
            "n_samples_failed": {
                "count": m.turns.tracked_issued - m.turns.tracked_ok,
                "counts": "turns issued inside the performance window that did not complete with a 200, aborted ones included",
            },
            "headline.failures": {
                "count": m.failures.total(),
                "counts": "every failed or aborted turn of the run, inside the window or after it (by kind: headline.failures_by_kind)",
            },
            "top_reasons": m.failure_reasons.iter().take(5).collect::<Vec<_>>(),
        },
        "duration_ns": m.tracked_duration_ns,
        "state": if i.summary.complete { "complete" } else { "interrupted" },
        "complete": i.summary.complete,
        "ttft": m.ttft,
        "tpot": m.tpot,
        "latency": m.latency,
        "output_sequence_lengths": m.output_sequence_lengths,
        "osl_mean": {
            "tracked": m.output_sequence_lengths.as_ref().map(|s| s.avg),
            "all_completed": m.osl_mean_all_completed,
            "gate_uses": "tracked: turns issued inside the performance window (reference §18); all_completed adds the tail turns that finished after it",
        },
        "budget_rule": i.config.budget_rule(i.dataset.conversations.len() as u64),
        "input_sequence_lengths": m.input_sequence_lengths,
        "qps": m.qps,
        "tps": m.system_tps,
        "finish_reason_counts": m.finish_reason_counts,
        "run_config": config,
        "target": i.config.target,
        "per_target": {
            "assignment": "trajectory instance k (conversation k mod n, repeat k / n) goes to target k mod targets: every turn of a conversation to one target",
            "turn_filter": "turns_completed and turns_failed count every turn (they sum to metrics.turns.ok and .failed); output_tokens, tokens_per_s and TTFT use the tracked turns (they sum to the run's output tokens and tps)",
            "targets": i.per_target,
        },
        "dataset": {
            "path": i.dataset.path.display().to_string(),
            "sha256": i.dataset.sha256,
            "conversations": i.dataset.conversations.len(),
        },
        "clock": {
            "events_timestamp_ns": if i.clock_zero_monotonic_ns > 0 { "CLOCK_MONOTONIC (the system monotonic clock, as Python's time.monotonic_ns())" } else { "process-local (0 = session.started)" },
            "process_local_zero_monotonic_ns": i.clock_zero_monotonic_ns,
            "process_local_zero_unix_ns": i.wall_anchor_unix_ns,
            "timestamp_ns_zero_unix_ns": i.wall_anchor_unix_ns,
            "note": "every duration here is measured from the process-local zero: an event's timestamp_ns minus process_local_zero_monotonic_ns",
        },
        "token_counts": if m.tokens_from_usage { "server usage" } else { "estimated (4 chars per token) where the server sent no usage" },
        "headline": i.summary,
        "metrics": m,
        "accuracy": {"score": i.scores.score, "repeats": i.scores.repeats, "missing": i.scores.missing},
        "events_jsonl_lines": i.event_lines,
        "agentic_metrics": i.by_owner,
    })
}

fn f(v: f64, prec: usize) -> String {
    if v.is_finite() {
        format!("{v:.prec$}")
    } else {
        "-".into()
    }
}

/// `report.txt`: fits a screen.
pub(crate) fn report_text(
    config: &ReplayConfig,
    dataset: &Dataset,
    m: &Metrics,
    s: &ReplaySummary,
    per_target: &[TargetFigures],
) -> String {
    let est = if m.tokens_from_usage {
        ""
    } else {
        " (estimated)"
    };
    let mut o = String::new();
    let _ = writeln!(o, "agentrace replay {}", env!("CARGO_PKG_VERSION"));
    let _ = writeln!(
        o,
        "target {}  concurrency {}  dataset {} ({} conversations, sha256 {}…)",
        config.target,
        config.concurrency,
        dataset.path.display(),
        dataset.conversations.len(),
        dataset.sha256.get(..12).unwrap_or("")
    );
    let _ = writeln!(
        o,
        "salt {}  delays {} (x{})  stop_issuing_on_first_user_complete {}  state {}",
        config.enable_salt,
        config.inject_tool_delay,
        config.time_scale,
        config.stop_issuing_on_first_user_complete,
        if s.complete {
            "complete"
        } else {
            "INTERRUPTED"
        }
    );
    let _ = writeln!(o);
    let _ = writeln!(
        o,
        "window        {} s tracked, tail after STOP {} s ({} turns issued after STOP)",
        f(m.tracked_duration_ns as f64 / 1e9, 2),
        f(m.tail_duration_ns as f64 / 1e9, 2),
        m.turns.issued_after_stop
    );
    let _ = writeln!(
        o,
        "throughput    system_tps {} tok/s{est}   qps {}",
        f(m.system_tps, 1),
        f(m.qps, 2)
    );
    let _ = writeln!(
        o,
        "interactivity e2e {} tok/s/user{est}   tps_per_user {}",
        f(m.e2e_interactivity, 1),
        f(m.tps_per_user, 1)
    );
    let _ = writeln!(o, "                      p50        p90        p99");
    for (name, series) in [
        ("TTFT ms", &m.ttft),
        ("TPOT ms", &m.tpot),
        ("ITL ms", &m.itl),
        ("latency ms", &m.latency),
    ] {
        let _ = writeln!(
            o,
            "{name:<14}{:>11}{:>11}{:>11}",
            f(ms(series, "50.0"), 2),
            f(ms(series, "90.0"), 2),
            f(ms(series, "99.0"), 2)
        );
    }
    if let (Some(osl), Some(isl)) = (&m.output_sequence_lengths, &m.input_sequence_lengths) {
        let _ = writeln!(
            o,
            "OSL mean {} tracked (the gate's), {} all completed turns  ISL mean {}{est}  prefix-cache hits {}",
            f(osl.avg, 1),
            m.osl_mean_all_completed.map_or("-".into(), |v| f(v, 1)),
            f(isl.avg, 1),
            m.cached_token_ratio
                .map_or("-".into(), |r| format!("{:.1}%", r * 100.0))
        );
    }
    let pu = &m.per_user;
    let _ = writeln!(
        o,
        "per user      tok/s min {} p10 {} median {}   turns min {} median {}",
        f(pu.tokens_per_s.min, 1),
        f(pu.tokens_per_s.p10, 1),
        f(pu.tokens_per_s.median, 1),
        f(pu.turns.min, 0),
        f(pu.turns.median, 0)
    );
    let _ = writeln!(
        o,
        "schedule lag  p50 {} us  p99 {} us  max {} us  (after a delay: p99 {} us)",
        f(s.schedule_lag_p50_us, 0),
        f(s.schedule_lag_p99_us, 0),
        f(s.schedule_lag_max_us, 0),
        f(s.schedule_lag_delayed_p99_us, 0)
    );
    let fl = &m.failures;
    let _ = writeln!(
        o,
        "turns         issued {} ok {} tracked {}  trajectories {} ({} complete)",
        m.turns.issued,
        m.turns.ok,
        m.turns.tracked_ok,
        m.trajectories_started,
        m.trajectories_completed
    );
    // Two scopes, both named: every turn of the run here, the window's turns in
    // result_summary.json's n_samples_failed.
    let _ = writeln!(
        o,
        "failures      {} of {} turns (http {} transport {} bad {} timeout {} aborted {} interrupted {}); \
         inside the window {} of {} (n_samples_failed)",
        fl.total(),
        m.turns.issued,
        fl.http_status,
        fl.transport,
        fl.bad_response,
        fl.timeout,
        fl.aborted,
        fl.interrupted,
        m.turns.tracked_issued - m.turns.tracked_ok,
        m.turns.tracked_issued
    );
    if per_target.len() > 1 {
        per_target_lines(&mut o, per_target);
    }
    const SHOWN: usize = 5;
    for r in m.failure_reasons.iter().take(SHOWN) {
        let _ = writeln!(o, "  {:>6} {}: {}", r.count, r.kind.as_str(), r.reason);
    }
    let more: u64 = m
        .failure_reasons
        .iter()
        .skip(SHOWN)
        .map(|r| r.count)
        .sum::<u64>()
        + m.failure_reasons_other;
    if more > 0 {
        let _ = writeln!(
            o,
            "  {more:>6} more with other reasons (result_summary.json lists up to {})",
            super::metrics::FailureReasons::MAX_REASONS
        );
    }
    let _ = writeln!(
        o,
        "accuracy      {}{}",
        s.accuracy
            .map_or("- (nothing scorable)".into(), |a| format!("{a:.4}")),
        if s.accuracy_missing > 0 {
            format!(" ({} scorable turns missing)", s.accuracy_missing)
        } else {
            String::new()
        }
    );
    for g in &s.gates {
        let _ = writeln!(
            o,
            "{}  {} = {} (rule {})",
            if g.pass { "PASS" } else { "FAIL" },
            g.name,
            g.value.map_or("-".into(), |v| format!("{v:.4}")),
            g.rule
        );
    }
    let _ = writeln!(o, "rates use: {}", m.turn_filter);
    o
}

/// The agentic metrics in `report.txt`, each line under its owner's name (formulas in
/// `result_summary.json`'s `agentic_metrics` and on the outputs page).
pub(crate) fn by_owner_lines(o: &mut String, b: &ByOwner) {
    let opt = |v: Option<f64>, prec: usize| v.map_or("-".into(), |v| f(v, prec));
    let pct = |v: Option<f64>| v.map_or("-".into(), |v| format!("{:.1}%", v * 100.0));
    let _ = writeln!(
        o,
        "agentic metrics by owner (result_summary.json agentic_metrics)"
    );
    let ml = &b.mlperf_endpoints_v1_0;
    let _ = writeln!(
        o,
        "  MLPerf Endpoints v1.0   e2e_avg_interactivity {} tok/s/user  ttft_p90 {} ms  system_tps {} tok/s  budget {}x dataset",
        f(ml.e2e_avg_interactivity, 1),
        f(ml.ttft_p90_ms, 1),
        f(ml.system_tps, 1),
        f(ml.trajectories_in_dataset_multiples, 2)
    );
    let ix = &b.inferencex_aiperf;
    let _ = writeln!(
        o,
        "  InferenceX / AIPerf     E2E normalized interactivity p90 {}  p75 {} tok/s/user ({} requests)",
        opt(ix.e2e_normalized_interactivity_p90, 1),
        opt(ix.e2e_normalized_interactivity_p75, 1),
        ix.requests
    );
    let jobs = &b.trtllm_jobs;
    let _ = writeln!(
        o,
        "  TensorRT-LLM jobs       {} jobs  {} jobs/h/user  {}",
        jobs.jobs_completed,
        f(jobs.jobs_per_hour_per_user, 1),
        jobs.jobs_per_hour_per_gpu
            .map_or("jobs/h/GPU - (give --gpus N)".into(), |v| format!(
                "{} jobs/h/GPU ({} GPUs)",
                f(v, 1),
                jobs.gpus.unwrap_or(0)
            ))
    );
    let g = &b.goodput;
    match &g.slo {
        Some(slo) => {
            let _ = writeln!(
                o,
                "  goodput ({slo})  agents {} of {} ({})  turns {} of {} ({})",
                g.agents_meeting,
                g.agents,
                pct(g.agents_share),
                g.turns_meeting,
                g.turns,
                pct(g.turns_share)
            );
        }
        None => {
            let _ = writeln!(
                o,
                "  goodput                 - (give --slo, e.g. ttft_p90=2s,interactivity=30)"
            );
        }
    }
    let co = &b.coordinated_omission;
    let grid = |m: &std::collections::BTreeMap<&'static str, f64>| {
        ["p50", "p90", "p99"]
            .iter()
            .map(|k| m.get(k).map_or("-".into(), |v| f(*v, 1)))
            .collect::<Vec<_>>()
            .join("/")
    };
    let _ = writeln!(
        o,
        "  latency p50/p90/p99 ms  from send {}  from scheduled start {} (coordinated omission corrected)",
        grid(&co.latency_ms),
        grid(&co.latency_from_scheduled_start_ms)
    );
    let so = &b.session_outcomes;
    let _ = writeln!(
        o,
        "  sessions                completed {} failed {} truncated {}",
        so.completed, so.failed, so.truncated
    );
    let pc = &b.prefix_cache;
    let _ = writeln!(
        o,
        "  prefix cache            optimum {} (dataset alone)  measured {}",
        pct(pc.optimum_hit),
        pct(pc.measured_hit)
    );
}

/// One line per endpoint: its share of the work and how it served it.
fn per_target_lines(o: &mut String, per_target: &[TargetFigures]) {
    let _ = writeln!(
        o,
        "per target    (conversation k to target k mod {}; tokens and TTFT of tracked turns)",
        per_target.len()
    );
    let _ = writeln!(
        o,
        "  {:<32}{:>7}{:>8}{:>8}{:>11}{:>10}{:>10}{:>10}",
        "target", "traj", "ok", "failed", "out tok", "tok/s", "TTFT p50", "p90 ms"
    );
    for t in per_target {
        let _ = writeln!(
            o,
            "  {:<32}{:>7}{:>8}{:>8}{:>11}{:>10}{:>10}{:>10}",
            t.target,
            t.trajectories,
            t.turns_completed,
            t.turns_failed,
            t.output_tokens,
            f(t.tokens_per_s, 1),
            t.ttft_p50_ms.map_or("-".into(), |v| f(v, 2)),
            t.ttft_p90_ms.map_or("-".into(), |v| f(v, 2)),
        );
    }
}

/// Starts the live progress line; returns the bar and the ticking task.
pub(crate) fn spawn_progress(
    progress: Arc<Progress>,
    total: u64,
    shutdown: Shutdown,
) -> (indicatif::ProgressBar, tokio::task::JoinHandle<()>) {
    let bar = indicatif::ProgressBar::with_draw_target(
        Some(total),
        indicatif::ProgressDrawTarget::stderr_with_hz(4),
    );
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{elapsed_precise} [{bar:30}] {pos}/{len} trajectories  {msg}  eta {eta}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    let b = bar.clone();
    let handle = tokio::spawn(async move {
        let start = tokio::time::Instant::now();
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        loop {
            tick.tick().await;
            if shutdown.is_fired() {
                break;
            }
            let tokens = progress.output_tokens.load(Ordering::Relaxed);
            let secs = start.elapsed().as_secs_f64().max(1e-3);
            b.set_position(progress.trajectories.load(Ordering::Relaxed));
            b.set_message(format!(
                "turns {}  in flight {}  {:.0} tok/s  errors {}",
                progress.turns_ok.load(Ordering::Relaxed),
                progress.in_flight.load(Ordering::Relaxed),
                tokens as f64 / secs,
                progress.errors.load(Ordering::Relaxed)
            ));
        }
    });
    (bar, handle)
}
