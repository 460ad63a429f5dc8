//! `agentrace sim`: flags and the glue that starts the simulated replicas.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use super::config::{MidStreamFault, ResponderKind, SimConfig};

/// Flags of `agentrace sim`; each one wins over the same field of `--config`.
#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub(crate) struct SimArgs {
    /// `calibrate`: measure a real engine instead of serving.
    #[command(subcommand)]
    pub command: Option<SimCommand>,
    /// Number of independent replicas, on consecutive ports.
    #[arg(long, default_value_t = 1)]
    pub replicas: usize,
    /// Address of the first replica (port 0: an ephemeral port per replica).
    #[arg(long, default_value = "127.0.0.1:8001")]
    pub listen: SocketAddr,
    /// Where the configuration comes from and what the flags override (boxed: the
    /// subcommand enum stays small).
    #[command(flatten)]
    pub settings: Box<SimSettings>,
}

/// What `agentrace sim` does besides serving.
#[derive(Debug, clap::Subcommand)]
pub(crate) enum SimCommand {
    /// Measure a real OpenAI-compatible engine (prefill and decode rates, KV capacity, slots)
    /// and write a simulator profile that `--profile FILE` reads.
    Calibrate(CalibrateArgs),
}

/// Flags of `agentrace sim calibrate`.
#[derive(Debug, clap::Args)]
pub(crate) struct CalibrateArgs {
    /// Base URL of the engine (`http://host:port`).
    #[arg(long)]
    pub target: String,
    /// Where the profile (TOML) is written.
    #[arg(long, default_value = "profile.toml")]
    pub out: PathBuf,
    /// Refuse to start when the measurement needs more chat requests than this.
    #[arg(long, default_value_t = 64)]
    pub max_requests: usize,
    /// Longest prompt measured, tokens; the plan warns beyond it.
    #[arg(long, default_value_t = 2048)]
    pub max_prompt_tokens: u64,
    /// Tokens each decode stream generates.
    #[arg(long, default_value_t = 32)]
    pub decode_tokens: u64,
    /// Measurements of each prefill point.
    #[arg(long, default_value_t = 2)]
    pub repeats: usize,
    /// Largest batch measured when the engine states no slot count.
    #[arg(long, default_value_t = 8)]
    pub max_batch: usize,
    /// Model to ask for [default: the first of the engine's `/v1/models`].
    #[arg(long)]
    pub model: Option<String>,
    /// Deadline of each request, seconds.
    #[arg(long, default_value_t = 120.0)]
    pub timeout_s: f64,
}

/// Profile, config file and per-field overrides of `agentrace sim`.
#[derive(Debug, clap::Args)]
pub(crate) struct SimSettings {
    /// Hardware profile: h100-qwen3-30b-a3b-bf16 (default), h200-qwen3-30b-a3b-fp8, or a
    /// profile file written by `agentrace sim calibrate`.
    #[arg(long)]
    pub profile: Option<String>,
    /// TOML file with any SimConfig field (its `profile` is the base).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Real seconds per simulated second (0.01 = 100× faster than real time).
    #[arg(long)]
    pub time_scale: Option<f64>,
    /// Seed of every random choice.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Model id served.
    #[arg(long)]
    pub model: Option<String>,
    /// KV capacity per replica in blocks of 16 tokens.
    #[arg(long)]
    pub num_gpu_blocks: Option<usize>,
    /// Who writes replies: `synthetic` (deterministic text, reasoning and tool calls valid
    /// against the request's tools) or `oracle` (the recorded reply of the matching turn of
    /// `--oracle-dataset`, right with probability `--oracle-accuracy`).
    #[arg(long, value_enum)]
    pub responder: Option<ResponderKind>,
    /// MLPerf agentic dataset for the oracle responder (implies `--responder oracle`).
    #[arg(long)]
    pub oracle_dataset: Option<PathBuf>,
    /// Probability that the oracle gives the recorded answer.
    #[arg(long)]
    pub oracle_accuracy: Option<f64>,
    /// Probability of HTTP 500 before the first token.
    #[arg(long)]
    pub fail_rate: Option<f64>,
    /// HTTP status of those failures.
    #[arg(long)]
    pub fail_status: Option<u16>,
    /// Extra simulated delay before each request reaches the engine, ms.
    #[arg(long)]
    pub extra_delay_ms: Option<f64>,
    /// Probability of a stream cut after some tokens.
    #[arg(long)]
    pub fail_mid_stream_rate: Option<f64>,
    /// How a mid-stream cut shows.
    #[arg(long, value_enum)]
    pub mid_stream: Option<MidStreamFault>,
    /// Probability that a request never gets an answer.
    #[arg(long)]
    pub hang_rate: Option<f64>,
    /// Waiting-queue bound (503 with Retry-After beyond it); 0 = unbounded.
    #[arg(long)]
    pub max_queue: Option<usize>,
    /// Also expose the legacy `vllm:gpu_cache_usage_perc` gauge.
    #[arg(long)]
    pub legacy_metrics: bool,
    /// One JSON line per request: arrival, queue wait, tokens, first token, finish.
    #[arg(long)]
    pub trace_log: Option<PathBuf>,
}

impl SimSettings {
    /// The configuration these flags describe.
    pub(crate) fn to_config(&self) -> anyhow::Result<SimConfig> {
        let mut cfg = match (&self.config, &self.profile) {
            (Some(path), profile) => {
                let mut cfg = SimConfig::from_file(path)?;
                if let Some(p) = profile {
                    let base = super::profile::resolve(p)?;
                    cfg.engine = base.engine;
                    cfg.profile = base.profile;
                    cfg.calibration = base.calibration;
                }
                cfg
            }
            (None, Some(p)) => super::profile::resolve(p)?,
            (None, None) => SimConfig::default(),
        };
        macro_rules! set {
            ($flag:expr => $($field:tt)+) => {
                if let Some(v) = $flag.clone() {
                    cfg.$($field)+ = v;
                }
            };
        }
        set!(self.time_scale => time_scale);
        set!(self.seed => seed);
        set!(self.model => model);
        set!(self.num_gpu_blocks => engine.num_gpu_blocks);
        set!(self.responder => responder.kind);
        set!(self.oracle_accuracy => responder.oracle_accuracy);
        set!(self.fail_rate => faults.fail_rate);
        set!(self.fail_status => faults.fail_status);
        set!(self.extra_delay_ms => faults.extra_delay_ms);
        set!(self.fail_mid_stream_rate => faults.fail_mid_stream_rate);
        set!(self.mid_stream => faults.mid_stream);
        set!(self.hang_rate => faults.hang_rate);
        set!(self.max_queue => faults.max_queue);
        if let Some(p) = &self.oracle_dataset {
            cfg.responder.oracle_dataset = Some(p.clone());
            if self.responder.is_none() {
                cfg.responder.kind = ResponderKind::Oracle;
            }
        }
        if self.legacy_metrics {
            cfg.legacy_metrics = true;
        }
        if let Some(p) = &self.trace_log {
            cfg.trace_log = Some(p.clone());
        }
        Ok(cfg)
    }
}

/// Runs the simulated replicas until a shutdown signal, or `sim calibrate`.
pub(crate) async fn run(args: SimArgs) -> anyhow::Result<ExitCode> {
    if let Some(SimCommand::Calibrate(c)) = args.command {
        return calibrate(c).await;
    }
    if args.replicas == 0 {
        eprintln!("error: --replicas: must be >= 1, got 0");
        return Ok(ExitCode::from(crate::telemetry::EXIT_CONFIG));
    }
    let config = match args
        .settings
        .to_config()
        .and_then(|c| c.validate().map(|()| c).map_err(Into::into))
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {}", crate::telemetry::report(&e));
            return Ok(ExitCode::from(crate::telemetry::EXIT_CONFIG));
        }
    };
    let stop = stop_signal()?;
    let (trigger, shutdown) = crate::shutdown::channel();
    let cluster = match super::start(config.clone(), args.listen, args.replicas, shutdown) {
        Ok(c) => c,
        Err(e @ (super::SimError::Config(_) | super::SimError::OracleMissing)) => {
            eprintln!("error: {e}");
            return Ok(ExitCode::from(crate::telemetry::EXIT_CONFIG));
        }
        Err(e) => return Err(e.into()),
    };
    for (name, addr) in cluster.replica_names().iter().zip(cluster.addrs()) {
        tracing::info!(replica = %name, %addr, profile = %config.profile, time_scale = config.time_scale, "simulated replica listening");
    }
    stop.await;
    tracing::info!("shutting down");
    trigger.fire();
    cluster.join().await;
    Ok(ExitCode::SUCCESS)
}

/// `agentrace sim calibrate`: measures, fits, writes the profile, prints the fit.
async fn calibrate(args: CalibrateArgs) -> anyhow::Result<ExitCode> {
    use anyhow::Context as _;
    if args.repeats == 0 || args.max_batch == 0 || args.decode_tokens < 2 {
        eprintln!("error: --repeats and --max-batch must be >= 1 and --decode-tokens >= 2");
        return Ok(ExitCode::from(crate::telemetry::EXIT_CONFIG));
    }
    if !(args.timeout_s.is_finite() && args.timeout_s > 0.0) {
        eprintln!("error: --timeout-s: must be > 0, got {}", args.timeout_s);
        return Ok(ExitCode::from(crate::telemetry::EXIT_CONFIG));
    }
    let opts = super::profile_probe::ProbeOptions {
        target: args.target.clone(),
        model: args.model.clone(),
        max_prompt_tokens: args.max_prompt_tokens.max(16),
        decode_tokens: args.decode_tokens,
        repeats: args.repeats,
        max_batch: args.max_batch,
        max_requests: args.max_requests,
        timeout: std::time::Duration::from_secs_f64(args.timeout_s),
    };
    let calibrated = super::profile::calibrate(opts, &|line| eprintln!("{line}")).await?;
    let text = super::profile::render(&calibrated.config, &calibrated.header)?;
    std::fs::write(&args.out, text)
        .with_context(|| format!("cannot write {}", args.out.display()))?;
    for line in &calibrated.header {
        println!("{line}");
    }
    println!("profile written to {}", args.out.display());
    Ok(ExitCode::SUCCESS)
}

/// Resolves on SIGINT or SIGTERM received from now on: the handlers are installed before the
/// replicas announce their addresses, so a signal sent right after cannot kill the process
/// without a clean shutdown.
#[cfg(unix)]
fn stop_signal() -> std::io::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    })
}

/// Resolves on Ctrl-C.
#[cfg(not(unix))]
fn stop_signal() -> std::io::Result<impl std::future::Future<Output = ()>> {
    Ok(crate::shutdown::signal())
}
