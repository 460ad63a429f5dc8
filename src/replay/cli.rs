//! `agentrace replay` and `agentrace sweep`: flags over the TOML config, and glue.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;

use super::config::{LogPrompts, ReplayConfig};
use crate::dataset::Dataset;
use crate::telemetry::EXIT_CONFIG;

/// Flags shared by `replay` and `sweep`; every one overrides the config file.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct RunFlags {
    /// TOML run config (`config/replay-qwen.toml`, `config/replay-kimi.toml`).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Endpoint base URL, e.g. http://127.0.0.1:8080. Repeat it for several endpoints without
    /// a router in front: conversation k goes to endpoint k mod N, all its turns there, and
    /// report.txt gives each endpoint's figures (replaces the config's `target`).
    #[arg(long)]
    pub target: Vec<String>,
    /// Output directory.
    #[arg(long)]
    pub out: PathBuf,
    /// Dataset (JSONL, plain or .zst); the standard set when absent.
    #[arg(long)]
    pub dataset: Option<PathBuf>,
    /// A longer dataset line stops the load at once, naming the line.
    #[arg(long)]
    pub dataset_max_line_bytes: Option<u64>,
    /// Model preset (qwen3.6-35b-a3b, kimi-k3).
    #[arg(long)]
    pub model: Option<String>,
    /// The `model` field of every request, overriding the preset's: use the name the
    /// server lists at `/v1/models` (a server serving another name answers 404 or 400).
    #[arg(long)]
    pub model_name: Option<String>,
    /// Trajectory budget (default: one pass over the dataset).
    #[arg(long)]
    pub num_trajectories: Option<u64>,
    /// Trajectories run first, to warm the server's caches, and left out of every result
    /// and of events.jsonl (0 = none).
    #[arg(long)]
    pub warmup: Option<u64>,
    /// Salting on or off.
    #[arg(long)]
    pub salt: Option<bool>,
    /// Inject recorded delays on or off.
    #[arg(long)]
    pub delays: Option<bool>,
    /// Multiply delays (2.0 = twice as slow).
    #[arg(long)]
    pub time_scale: Option<f64>,
    /// Seconds: a turn not complete this long after it was sent is cancelled on the server
    /// and fails as `timeout`; the rest of its trajectory is aborted (synthetic records).
    #[arg(long)]
    pub turn_timeout: Option<f64>,
    /// Largest response held for one turn, in bytes; a larger one fails the turn.
    #[arg(long)]
    pub max_response_bytes: Option<u64>,
    /// Stop issuing when the window ends.
    #[arg(long)]
    pub stop_issuing_on_first_user_complete: Option<bool>,
    /// Ask streaming servers for token usage (`stream_options.include_usage`); without it,
    /// token counts are estimated at 4 characters a token.
    #[arg(long)]
    pub include_usage: Option<bool>,
    /// Wake delayed sends with a kernel high-resolution timer (median schedule lag about
    /// 0.1 ms instead of 1 ms, for a few system calls per delayed send).
    #[arg(long)]
    pub precise_pacing: Option<bool>,
    /// Header carrying the conversation id on every request, for a router's session affinity
    /// (repeatable; replaces the config's list, default X-Session-ID; the agentrace proxy
    /// reads x-session-id).
    #[arg(long = "routing-header")]
    pub routing_headers: Vec<String>,
    /// Environment variable holding the API key.
    #[arg(long)]
    pub api_key_env: Option<String>,
    /// ISSUED prompts: compact or full.
    #[arg(long, value_enum)]
    pub log_prompts: Option<LogPrompts>,
    /// Log every streamed chunk (`sample.recv_non_first`).
    #[arg(long)]
    pub log_chunks: bool,
    /// The run follows an official run config: the trajectory budget must be a positive
    /// multiple of the dataset's trajectory count (the official TOMLs turn it on).
    #[arg(long)]
    pub official_rules: Option<bool>,
    /// Cap on the performance phase in seconds.
    #[arg(long)]
    pub max_duration: Option<f64>,
    /// No live progress line on stderr, nor the sweep's line per point (both are off anyway
    /// when stderr is not a terminal).
    #[arg(long)]
    pub no_progress: bool,
    /// Exit non-zero when a gate fails.
    #[arg(long)]
    pub require_pass: bool,
    /// SLO tier for goodput, e.g. `ttft_p90=2s,interactivity=30` (terms: ttft_pNN, tpot_pNN,
    /// latency_pNN with a unit; interactivity in tok/s per user).
    #[arg(long)]
    pub slo: Option<super::slo::Slo>,
    /// GPUs serving the target: reports jobs per hour per GPU.
    #[arg(long)]
    pub gpus: Option<u32>,
    /// The wire every turn is written in: chat (/v1/chat/completions), messages (Anthropic
    /// Messages, /v1/messages) or responses (OpenAI Responses, /v1/responses); official runs
    /// use chat [config: api, default chat].
    #[arg(long, value_enum, hide_possible_values = true)]
    pub api: Option<crate::wire::Api>,
    /// With --api responses: chain turns with previous_response_id and send only the new
    /// items, as Codex does (the server must keep each response) [config: responses_chain].
    #[arg(long)]
    pub responses_chain: bool,
}

/// Flags of `agentrace replay`.
#[derive(Debug, clap::Args)]
pub(crate) struct ReplayArgs {
    /// Slots (active trajectories).
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Replay the requests captured by the proxy in DIR open-loop, instead of a dataset
    /// closed-loop (closed-loop replay of a capture: `capture export`, then `--dataset`).
    /// Several directories (or a directory of replica directories) are merged by start time.
    #[arg(long, value_name = "DIR", num_args = 1.., requires = "timing")]
    pub captures: Vec<PathBuf>,
    /// How captured requests are paced: at their recorded start times.
    #[arg(long, value_enum, requires = "captures")]
    pub timing: Option<Timing>,
    /// With `--timing recorded`: 2.0 replays twice as fast as recorded.
    #[arg(long, default_value_t = 1.0, requires = "captures")]
    pub speed: f64,
    /// With `--captures`: replay only the exchanges of this session key, as `capture ls`
    /// lists them (repeatable; default every session).
    #[arg(long = "session", requires = "captures")]
    pub sessions: Vec<String>,
    #[command(flatten)]
    pub run: RunFlags,
}

/// Pacing of an open-loop replay of captures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Timing {
    /// Each request at its recorded start time, scaled by `--speed`.
    Recorded,
}

/// Flags of `agentrace sweep`.
#[derive(Debug, clap::Args)]
pub(crate) struct SweepArgs {
    /// Concurrency points, comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    pub concurrency: Vec<usize>,
    #[command(flatten)]
    pub run: RunFlags,
}

/// Builds the config from the file and the flags.
pub(crate) fn resolve(
    flags: &RunFlags,
    concurrency: Option<usize>,
) -> anyhow::Result<ReplayConfig> {
    let mut c = match &flags.config {
        Some(p) => ReplayConfig::from_file(p)?,
        None => ReplayConfig::default(),
    };
    macro_rules! set {
        ($field:ident, $v:expr) => {
            if let Some(v) = $v {
                c.$field = v;
            }
        };
    }
    if !flags.target.is_empty() {
        c.target = flags.target.clone().into();
    }
    if flags.dataset.is_some() {
        c.dataset = flags.dataset.clone();
    }
    set!(dataset_max_line_bytes, flags.dataset_max_line_bytes);
    if flags.model.is_some() {
        c.model = flags.model.clone();
    }
    if flags.model_name.is_some() {
        c.model_name = flags.model_name.clone();
    }
    set!(concurrency, concurrency);
    if flags.num_trajectories.is_some() {
        c.num_trajectories = flags.num_trajectories;
    }
    set!(warmup_trajectories, flags.warmup);
    set!(enable_salt, flags.salt);
    set!(inject_tool_delay, flags.delays);
    set!(time_scale, flags.time_scale);
    set!(turn_timeout_s, flags.turn_timeout);
    set!(max_response_bytes, flags.max_response_bytes);
    set!(
        stop_issuing_on_first_user_complete,
        flags.stop_issuing_on_first_user_complete
    );
    set!(include_usage, flags.include_usage);
    set!(precise_pacing, flags.precise_pacing);
    if !flags.routing_headers.is_empty() {
        c.routing_headers = flags.routing_headers.clone();
    }
    if flags.api_key_env.is_some() {
        c.api_key_env = flags.api_key_env.clone();
    }
    set!(log_prompts, flags.log_prompts);
    if flags.log_chunks {
        c.log_chunks = true;
    }
    set!(max_duration_s, flags.max_duration);
    set!(official_rules, flags.official_rules);
    set_api(&mut c, flags);
    c.progress = !flags.no_progress;
    if flags.slo.is_some() {
        c.slo = flags.slo.clone();
    }
    if flags.gpus.is_some() {
        c.gpus = flags.gpus;
    }
    Ok(c)
}

fn set_api(c: &mut ReplayConfig, flags: &RunFlags) {
    if let Some(api) = flags.api {
        c.api = api;
    }
    if flags.responses_chain {
        c.responses_chain = true;
    }
}

fn load_dataset(config: &ReplayConfig) -> anyhow::Result<Arc<Dataset>> {
    let path = match &config.dataset {
        Some(p) => p.clone(),
        None => crate::dataset::synth::ensure_standard_set(Path::new(
            crate::dataset::synth::STANDARD_SET_PATH,
        ))?,
    };
    let opts = crate::dataset::LoadOptions {
        max_line_bytes: usize::try_from(config.dataset_max_line_bytes).unwrap_or(usize::MAX),
        ..crate::dataset::LoadOptions::default()
    };
    let ds = crate::dataset::load(&path, &opts)
        .with_context(|| format!("cannot load dataset {}", path.display()))?;
    Ok(Arc::new(ds))
}

fn prepare(flags: &RunFlags, concurrency: Option<usize>) -> Result<ReplayConfig, ExitCode> {
    let config = match resolve(flags, concurrency) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {}", crate::telemetry::report(&e));
            return Err(ExitCode::from(EXIT_CONFIG));
        }
    };
    if let Err(e) = config.validate() {
        eprintln!("error: invalid configuration: {e}");
        return Err(ExitCode::from(EXIT_CONFIG));
    }
    Ok(config)
}

/// A budget the official rule refuses is a configuration error (exit 2), found before any
/// connection is opened.
fn check_budget(config: &ReplayConfig, dataset: &Dataset) -> Result<(), ExitCode> {
    config
        .check_budget(dataset.conversations.len() as u64)
        .map(drop)
        .map_err(|e| {
            eprintln!("error: invalid configuration: {e}");
            ExitCode::from(EXIT_CONFIG)
        })
}

/// Runs one replay.
pub(crate) async fn run(args: ReplayArgs) -> anyhow::Result<ExitCode> {
    if !args.captures.is_empty() {
        return run_captures(&args, &args.captures).await;
    }
    let config = match prepare(&args.run, args.concurrency) {
        Ok(c) => c,
        Err(code) => return Ok(code),
    };
    // Before the standard set is generated (seconds, 19 MB) for a target that is not there.
    super::connect_to_targets(&config).await?;
    let dataset = load_dataset(&config)?;
    if let Err(code) = check_budget(&config, &dataset) {
        return Ok(code);
    }
    let (trigger, shutdown) = crate::shutdown::channel();
    tokio::spawn(async move {
        crate::shutdown::signal().await;
        trigger.fire();
    });
    let summary = super::run(config, dataset, &args.run.out, shutdown).await?;
    let report = std::fs::read_to_string(args.run.out.join("report.txt")).unwrap_or_default();
    print!("{report}");
    Ok(exit_code(&summary, args.run.require_pass))
}

/// `replay --captures DIR --timing recorded`: the proxy's captures, open-loop.
async fn run_captures(args: &ReplayArgs, captures: &[PathBuf]) -> anyhow::Result<ExitCode> {
    let target = match args.run.target.as_slice() {
        [one] => one.clone(),
        [] => {
            eprintln!("error: invalid configuration: --target is required with --captures");
            return Ok(ExitCode::from(EXIT_CONFIG));
        }
        _ => {
            eprintln!(
                "error: invalid configuration: --captures replays to one --target (got {})",
                args.run.target.len()
            );
            return Ok(ExitCode::from(EXIT_CONFIG));
        }
    };
    if args.run.api.is_some() || args.run.responses_chain {
        eprintln!(
            "error: invalid configuration: --api/--responses-chain: the open-loop replay sends \
             each captured request in the API it was recorded in; replay a capture in another \
             API closed-loop (capture export, then --dataset with --api)"
        );
        return Ok(ExitCode::from(EXIT_CONFIG));
    }
    if !(args.speed.is_finite() && args.speed > 0.0) {
        eprintln!(
            "error: invalid configuration: --speed: must be > 0, got {}",
            args.speed
        );
        return Ok(ExitCode::from(EXIT_CONFIG));
    }
    let (trigger, shutdown) = crate::shutdown::channel();
    tokio::spawn(async move {
        crate::shutdown::signal().await;
        trigger.fire();
    });
    let options = crate::replay::open_loop::OpenLoopOptions {
        target,
        captures: captures.to_vec(),
        speed: args.speed,
        out_dir: args.run.out.clone(),
        sessions: args.sessions.clone(),
    };
    let report = crate::replay::open_loop::run(options, shutdown)
        .await
        .with_context(|| {
            format!(
                "open-loop replay of {}",
                crate::capture::merge::names(captures)
            )
        })?;
    println!(
        "open-loop replay of {}: {} scheduled, {} sent, {} ok, {} failed{}",
        crate::capture::merge::names(captures),
        report.scheduled,
        report.sent,
        report.ok,
        report.failed,
        if report.interrupted {
            " (interrupted)"
        } else {
            ""
        }
    );
    println!(
        "recorded span {:.3} s, replayed in {:.3} s at speed {}; schedule lag p50 {:.3} ms p99 {:.3} ms max {:.3} ms",
        report.recorded_span_s,
        report.wall_s,
        report.speed,
        report.schedule_lag.p50_ms,
        report.schedule_lag.p99_ms,
        report.schedule_lag.max_ms
    );
    println!(
        "report: {}",
        args.run.out.join("open-loop-report.json").display()
    );
    Ok(if report.sent > 0 && report.ok == 0 {
        eprintln!("error: every request failed");
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

fn exit_code(s: &super::ReplaySummary, require_pass: bool) -> ExitCode {
    if s.turns_issued > 0 && s.turns_ok == 0 {
        eprintln!("error: every turn failed");
        return ExitCode::FAILURE;
    }
    if require_pass && !s.gates_pass {
        eprintln!("error: a gate failed (see report.txt)");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

/// Runs one replay per concurrency point.
pub(crate) async fn run_sweep(args: SweepArgs) -> anyhow::Result<ExitCode> {
    let config = match prepare(&args.run, args.concurrency.first().copied()) {
        Ok(c) => c,
        Err(code) => return Ok(code),
    };
    if args.concurrency.contains(&0) {
        eprintln!("error: invalid configuration: concurrency: every point must be >= 1, got 0");
        return Ok(ExitCode::from(EXIT_CONFIG));
    }
    let dataset = load_dataset(&config)?;
    if let Err(code) = check_budget(&config, &dataset) {
        return Ok(code);
    }
    let (trigger, shutdown) = crate::shutdown::channel();
    tokio::spawn(async move {
        crate::shutdown::signal().await;
        trigger.fire();
    });
    let points =
        super::sweep::run(config, &args.concurrency, dataset, &args.run.out, shutdown).await?;
    println!("concurrency  system_tps  e2e_interactivity  accuracy  frontier  gates");
    for p in &points {
        println!(
            "{:>11}  {:>10.1}  {:>17.1}  {:>8}  {:>8}  {}",
            p.concurrency,
            p.system_tps,
            p.e2e_interactivity,
            p.accuracy.map_or("-".into(), |a| format!("{a:.4}")),
            if p.on_frontier { "yes" } else { "" },
            p.verdict.as_deref().unwrap_or("- (no gates)")
        );
    }
    println!("wrote {}", args.run.out.join("pareto.svg").display());
    if points.iter().all(|p| p.summary.turns_ok == 0) {
        return Ok(ExitCode::FAILURE);
    }
    if args.run.require_pass && !points.iter().all(|p| p.gates_pass) {
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        run: RunFlags,
    }

    #[test]
    fn include_usage_and_precise_pacing_flags_override_the_config() {
        let cli = Cli::parse_from([
            "replay",
            "--out",
            "o",
            "--include-usage",
            "false",
            "--precise-pacing",
            "false",
        ]);
        let defaults = ReplayConfig::default();
        assert!(defaults.include_usage && defaults.precise_pacing);
        let c = resolve(&cli.run, None).unwrap();
        assert!(!c.include_usage && !c.precise_pacing);
    }
}
