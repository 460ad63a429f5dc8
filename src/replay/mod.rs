//! The closed-loop replayer: scheduler (slots, budget, delays) → client (HTTP, SSE scan) →
//! events log → metrics, inline scorer and report; and the Pareto sweep.

pub(crate) mod cli;
pub(crate) mod client;
pub(crate) mod config;
pub(crate) mod decode;
pub(crate) mod events;
pub(crate) mod metrics;
pub mod open_loop;
pub(crate) mod per_target;
pub(crate) mod report;
pub(crate) mod scheduler;
pub mod scorer;
pub mod slo;
pub mod sweep;

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tokio::time::Instant;

pub use config::{ConfigError, LogPrompts, ReplayConfig, Targets};
pub use metrics::Metrics;
pub use report::verdict;

use crate::dataset::{Dataset, RequestBuilder};
use crate::shutdown::Shutdown;
use events::{EventSink, EventWriter, Record};
use scheduler::{Phase, Progress, SlotResult};

/// Why a replay could not run or finish.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The configuration is invalid.
    #[error("invalid configuration: {0}")]
    Config(#[from] ConfigError),
    /// The dataset cannot be replayed with this configuration.
    #[error("dataset {path}: {message}")]
    Dataset {
        /// The dataset file.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// A target did not accept a connection.
    #[error("target {target} is unreachable: {message}")]
    Unreachable {
        /// The first configured target that did not answer.
        target: String,
        /// The connect error (and any further target that did not answer either).
        message: String,
    },
    /// The runtime that runs the slots could not be started.
    #[error("cannot start the replay runtime: {0}")]
    Runtime(String),
    /// An output file could not be written.
    #[error("{path}: {message}")]
    Output {
        /// The file.
        path: String,
        /// The cause.
        message: String,
    },
}

/// One gate's verdict.
#[derive(Debug, Clone, Serialize)]
pub struct Gate {
    /// `inline_accuracy` or `osl_per_turn_mean`.
    pub name: &'static str,
    /// The measured value.
    pub value: Option<f64>,
    /// The rule, in words.
    pub rule: String,
    /// Verdict.
    pub pass: bool,
}

/// The headline of one replay; the demo and the sweep tabulate these.
#[derive(Debug, Clone, Serialize)]
pub struct ReplaySummary {
    /// Slots.
    pub concurrency: usize,
    /// The performance phase ran to its end (not interrupted).
    pub complete: bool,
    /// Output tokens / tracked duration (tokens/s).
    pub system_tps: f64,
    /// Σ OSL / Σ turn time over tracked successful turns (tokens/s per user).
    pub e2e_interactivity: f64,
    /// 1000 / TPOT p90 ms.
    pub tps_per_user: f64,
    /// TTFT p50 (ms).
    pub ttft_p50_ms: f64,
    /// TTFT p90 (ms).
    pub ttft_p90_ms: f64,
    /// TTFT p99 (ms).
    pub ttft_p99_ms: f64,
    /// TPOT p50 (ms).
    pub tpot_p50_ms: f64,
    /// TPOT p90 (ms).
    pub tpot_p90_ms: f64,
    /// Latency p50 (ms).
    pub latency_p50_ms: f64,
    /// Per-user output tokens/s: min, p10, median across users.
    pub user_tps_min: f64,
    /// See `user_tps_min`.
    pub user_tps_p10: f64,
    /// See `user_tps_min`.
    pub user_tps_median: f64,
    /// Inline accuracy (None when nothing was scorable).
    pub accuracy: Option<f64>,
    /// Scorable turns without an output.
    pub accuracy_missing: u64,
    /// Every gate passed (true when no gates are configured).
    pub gates_pass: bool,
    /// The gates.
    pub gates: Vec<Gate>,
    /// Schedule lag p50 (µs).
    pub schedule_lag_p50_us: f64,
    /// Schedule lag p99 (µs).
    pub schedule_lag_p99_us: f64,
    /// Schedule lag max (µs).
    pub schedule_lag_max_us: f64,
    /// Schedule lag p99 of turns sent after a recorded delay (µs).
    pub schedule_lag_delayed_p99_us: f64,
    /// Failed or aborted turns.
    pub failures: u64,
    /// Failures by kind.
    pub failures_by_kind: metrics::Failures,
    /// Turns issued (including synthetic).
    pub turns_issued: u64,
    /// Turns completed with a 200.
    pub turns_ok: u64,
    /// Tracked successful turns (the rate base).
    pub turns_tracked: u64,
    /// Token counts are estimates for some turns.
    pub tokens_estimated: bool,
    /// Wall time of the performance phase (s).
    pub wall_s: f64,
}

/// A connector per endpoint of `config.target`, once a connection to each has opened: a replay
/// fails fast and clearly when nothing listens at one of them, before it generates or loads a
/// dataset. Every endpoint is tried (at once), and each one that did not answer is named.
pub async fn connect_to_targets(
    config: &ReplayConfig,
) -> Result<Vec<client::Connector>, ReplayError> {
    let api_key = config.api_key();
    let tries = config
        .target
        .iter()
        .map(|url| open_target(config, url, api_key.as_deref()));
    let mut connectors = Vec::with_capacity(config.target.len());
    let mut down: Vec<(&String, String)> = Vec::new();
    for (url, outcome) in config
        .target
        .iter()
        .zip(futures_util::future::join_all(tries).await)
    {
        match outcome {
            Ok(c) => connectors.push(c),
            Err(OpenError::Invalid(e)) => return Err(e),
            Err(OpenError::Unreachable(why)) => down.push((url, why)),
        }
    }
    let mut down = down.into_iter();
    match down.next() {
        None => Ok(connectors),
        Some((target, mut message)) => {
            for (other, why) in down {
                message.push_str(&format!("; target {other} is unreachable too: {why}"));
            }
            Err(ReplayError::Unreachable {
                target: target.clone(),
                message,
            })
        }
    }
}

enum OpenError {
    Invalid(ReplayError),
    Unreachable(String),
}

/// The connector for one endpoint, once a connection to it has opened.
async fn open_target(
    config: &ReplayConfig,
    url: &str,
    api_key: Option<&str>,
) -> Result<client::Connector, OpenError> {
    let target = client::Target::parse(url).map_err(|message| {
        OpenError::Invalid(ReplayError::Config(ConfigError::Invalid {
            field: "target",
            message: format!("{message}, got {url:?}"),
        }))
    })?;
    let connector = client::Connector::new(
        target,
        api_key,
        Duration::from_secs_f64(config.connect_timeout_s),
        usize::try_from(config.max_response_bytes).unwrap_or(usize::MAX),
    )
    .map_err(|e| OpenError::Unreachable(e.to_string()))?;
    connector
        .connect()
        .await
        .map_err(|e| OpenError::Unreachable(e.to_string()))?;
    Ok(connector)
}

/// Runs one replay of `dataset` against the configured target and writes `out_dir`.
pub async fn run(
    config: ReplayConfig,
    dataset: Arc<Dataset>,
    out_dir: &Path,
    shutdown: Shutdown,
) -> Result<ReplaySummary, ReplayError> {
    config.validate()?;
    let dataset_err = |message: String| ReplayError::Dataset {
        path: dataset.path.display().to_string(),
        message,
    };
    if dataset.conversations.is_empty() {
        return Err(dataset_err("has no conversations".into()));
    }
    config.check_budget(dataset.conversations.len() as u64)?;
    if config.enable_salt {
        dataset
            .check_salt_preflight()
            .map_err(|e| dataset_err(e.to_string()))?;
    }
    let connectors = connect_to_targets(&config).await?;
    // Only once the target answered: a run that cannot start leaves no directory behind.
    let out_err = |path: &Path, e: &dyn std::fmt::Display| ReplayError::Output {
        path: path.display().to_string(),
        message: e.to_string(),
    };
    std::fs::create_dir_all(out_dir).map_err(|e| out_err(out_dir, &e))?;

    let params = config.resolved_model_params();
    let builder = RequestBuilder::new(params, config.include_usage);
    let n = dataset.conversations.len() as u64;
    let budget = config.check_budget(n)?;
    let epoch = Instant::now();
    let wall_anchor_unix_ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let progress = Arc::new(Progress::default());
    let events_path = out_dir.join("events.jsonl");
    // events.jsonl is on the system monotonic clock; its process-local 0 (every figure's
    // origin) is kept in result_summary.json.
    let clock_zero_ns = events::monotonic_ns(epoch.into_std()).unwrap_or(0);
    let (writer, sink) = EventWriter::start(&events_path, config.log_prompts, clock_zero_ns)
        .map_err(|e| out_err(&events_path, &e))?;

    let ticker = config.progress.then(|| {
        report::spawn_progress(
            progress.clone(),
            config.warmup_trajectories + budget,
            shutdown.clone(),
        )
    });

    sink.send(Record::Session {
        name: "started",
        ts: 0,
    })
    .await;
    let make_phase = |warmup: bool, budget: u64, events: EventSink| {
        Arc::new(Phase {
            dataset: dataset.clone(),
            builder: builder.clone(),
            connectors: connectors.clone(),
            events,
            epoch,
            budget,
            next_instance: AtomicU64::new(0),
            warmup,
            tracking: AtomicU8::new(scheduler::NOT_STARTED),
            stop_ns: AtomicU64::new(0),
            stop_issuing: AtomicBool::new(false),
            stop_notify: tokio::sync::Notify::new(),
            shutdown: shutdown.clone(),
            progress: progress.clone(),
            config: config.clone(),
            routing: config.routing_headers.clone(),
            issued_after_stop: AtomicU64::new(0),
            hard_deadline: None,
        })
    };

    if config.warmup_trajectories > 0 {
        let warm = make_phase(true, config.warmup_trajectories, EventSink::disabled());
        run_phase(&warm, config.concurrency).await?;
    }

    let mut perf = make_phase(false, budget, sink.clone());
    if config.max_duration_s > 0.0 {
        if let Some(p) = Arc::get_mut(&mut perf) {
            p.hard_deadline = Some(Instant::now() + Duration::from_secs_f64(config.max_duration_s));
        }
    }
    let start_ns = perf.start_tracking();
    sink.send(Record::Session {
        name: "start_performance_tracking",
        ts: start_ns,
    })
    .await;
    let phase_start = Instant::now();
    let result = run_phase(&perf, config.concurrency).await?;
    perf.stop_tracking().await;
    let wall_s = phase_start.elapsed().as_secs_f64();
    sink.send(Record::Session {
        name: "ended",
        ts: perf.ns(Instant::now()),
    })
    .await;
    let interrupted = shutdown.is_fired();
    let stop_ns = perf.stop_ns.load(Ordering::SeqCst);
    let issued_after_stop = perf.issued_after_stop.load(Ordering::SeqCst);
    drop(sink);
    drop(perf);
    let lines = writer
        .finish()
        .await
        .map_err(|e| out_err(&events_path, &e))?;
    if let Some((bar, handle)) = ticker {
        handle.abort();
        bar.finish_and_clear();
    }

    let metrics = metrics::compute(&metrics::Window {
        turns: &result.turns,
        trajectories: &result.trajectories,
        lags_ns: &result.lags_ns,
        start_ns,
        stop_ns: Some(stop_ns),
        concurrency: config.concurrency,
        issued_after_stop,
        failure_reasons: &result.failure_reasons,
    });
    let targets: Vec<String> = config.target.iter().cloned().collect();
    let per_target = per_target::compute(
        &targets,
        &result.turns,
        &result.trajectories,
        metrics.tracked_duration_ns,
    );
    let scores =
        scorer::score_events(&events_path, &dataset).map_err(|e| out_err(&events_path, &e))?;
    let scores_path = out_dir.join("scores.json");
    write_json(&scores_path, &scores.json)?;

    let gates = report::gates(&config, &metrics, &scores);
    let summary = report::summary(&config, &metrics, &scores, gates, !interrupted, wall_s);
    let summary_path = out_dir.join("result_summary.json");
    let doc = report::result_summary(report::SummaryInputs {
        config: &config,
        dataset: &dataset,
        metrics: &metrics,
        summary: &summary,
        scores: &scores,
        wall_anchor_unix_ns,
        clock_zero_monotonic_ns: clock_zero_ns,
        event_lines: lines,
        per_target: &per_target,
    });
    write_json(&summary_path, &doc)?;
    let text = report::report_text(&config, &dataset, &metrics, &summary, &per_target);
    let report_path = out_dir.join("report.txt");
    std::fs::write(&report_path, text).map_err(|e| out_err(&report_path, &e))?;
    Ok(summary)
}

/// Runs the slots on a runtime of their own, so they share their workers with nothing else in
/// the process (a demo's servers) and a due send waits behind no other component's work.
/// (Polling the injection queue and I/O more often than tokio's defaults was tried: it cost a
/// third more CPU per turn and lengthened the lag tail.)
async fn run_phase(phase: &Arc<Phase>, concurrency: usize) -> Result<SlotResult, ReplayError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("agentrace-slot")
        .build()
        .map_err(|e| ReplayError::Runtime(e.to_string()))?;
    let phase = phase.clone();
    let (mut tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("agentrace-replay".into())
        .spawn(move || {
            // A caller that stops waiting (its future dropped) ends the slots, as the tasks
            // of a JoinSet would end.
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                runtime.block_on(async {
                    tokio::select! {
                        all = run_slots(phase, concurrency) => Some(all),
                        _ = tx.closed() => None,
                    }
                })
            }));
            match result {
                Ok(Some(all)) => {
                    let _ = tx.send(Ok(all));
                }
                Ok(None) => {}
                Err(panic) => {
                    let _ = tx.send(Err(panic));
                }
            }
        })
        .map_err(|e| ReplayError::Runtime(e.to_string()))?;
    match rx.await {
        Ok(Ok(all)) => Ok(all),
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(_) => Err(ReplayError::Runtime("the slot runtime stopped".into())),
    }
}

async fn run_slots(phase: Arc<Phase>, concurrency: usize) -> SlotResult {
    let slots = concurrency.min(phase.budget.max(1) as usize);
    let start = Arc::new(tokio::sync::Barrier::new(slots));
    let mut set = tokio::task::JoinSet::new();
    for slot in 0..slots {
        set.spawn(scheduler::run_slot(
            phase.clone(),
            slot as u32,
            start.clone(),
        ));
    }
    let mut all = SlotResult::default();
    while let Some(r) = set.join_next().await {
        match r {
            Ok(mut r) => {
                all.turns.append(&mut r.turns);
                all.trajectories.append(&mut r.trajectories);
                all.lags_ns.append(&mut r.lags_ns);
                all.failure_reasons.merge(r.failure_reasons);
            }
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(_) => {}
        }
    }
    all.turns.sort_by_key(|t| t.issued_ns);
    all
}

fn write_json(path: &Path, value: &impl Serialize) -> Result<(), ReplayError> {
    let mut bytes = serde_json::to_vec_pretty(value).map_err(|e| ReplayError::Output {
        path: path.display().to_string(),
        message: e.to_string(),
    })?;
    bytes.push(b'\n');
    std::fs::write(path, bytes).map_err(|e| ReplayError::Output {
        path: path.display().to_string(),
        message: e.to_string(),
    })
}
