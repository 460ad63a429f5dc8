//! `agentrace demo`: simulated replicas whose KV cache cannot hold every session, the proxy
//! in front of them with session affinity and then round-robin, a replay through each, and a
//! side-by-side table of what affinity is worth — all in one process, on no GPU.

mod charts;
mod figures;
mod page;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context as _;
use serde::Serialize;

use crate::dataset::{self, Conversation, Dataset};
use crate::proxy::{self, Policy, ProxyConfig};
use crate::replay::{self, ReplayConfig, ReplaySummary};
use crate::shutdown;
use crate::sim::{self, Oracle, ReplicaStats, SimConfig};

/// Flags of `agentrace demo`.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// A ~25-second version (fewer trajectories and slots; 2-point sweeps).
    #[arg(long)]
    pub quick: bool,
    /// Simulated replicas behind the proxy.
    #[arg(long, default_value_t = 4)]
    pub replicas: usize,
    /// Concurrent trajectories (slots) of each replay [default: 24, quick: 12].
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Trajectories replayed, half coding and half workflow [default: 48, quick: 24].
    #[arg(long)]
    pub trajectories: Option<usize>,
    /// KV capacity of each replica in tokens; small enough that not every session fits
    /// [default: 96000, quick: 48000].
    #[arg(long)]
    pub kv_tokens: Option<usize>,
    /// Real seconds per simulated second for the simulator and the recorded delays
    /// [default: 0.05, quick: 0.02].
    #[arg(long)]
    pub time_scale: Option<f64>,
    /// Concurrencies of the Pareto sweeps (one with each policy), comma-separated; empty to
    /// skip [default: 1,4,16,32, quick: 4,12].
    #[arg(long)]
    pub sweep: Option<String>,
    /// Bounded-load factor of the affinity run: a few dozen sessions hash unevenly over a
    /// few replicas, and the bound evens them out (the proxy's default).
    #[arg(long, default_value_t = 2.0)]
    pub load_factor: f64,
    /// MLPerf agentic dataset to draw from [default: the standard set, generated on first use].
    #[arg(long)]
    pub dataset: Option<PathBuf>,
    /// Parent directory of the `demo-<timestamp>` output directory: every run writes a new
    /// `demo-YYYYmmdd-HHMMSS/` in it (index.html, demo.json, each replay's outputs).
    #[arg(long, default_value = "runs")]
    pub out: PathBuf,
    /// No progress bars or sweep progress lines on stderr (they are off anyway when stderr
    /// is not a terminal).
    #[arg(long)]
    pub no_progress: bool,
}

/// Settings after defaults are applied.
#[derive(Debug, Clone, Serialize)]
struct Plan {
    replicas: usize,
    concurrency: usize,
    trajectories: usize,
    kv_tokens: usize,
    time_scale: f64,
    sweep: Vec<usize>,
    sweep_point_s: f64,
    load_factor: f64,
    oracle_accuracy: f64,
    dataset: String,
    progress: bool,
}

impl Plan {
    fn from_args(args: &DemoArgs) -> anyhow::Result<Plan> {
        let pick = |v: Option<usize>, full: usize, quick: usize| {
            v.unwrap_or(if args.quick { quick } else { full })
        };
        let sweep = match &args.sweep {
            Some(list) => parse_list(list)?,
            None if args.quick => vec![4, 12],
            None => vec![1, 4, 16, 32],
        };
        let plan = Plan {
            replicas: args.replicas,
            concurrency: pick(args.concurrency, 24, 12),
            trajectories: pick(args.trajectories, 48, 24),
            kv_tokens: pick(args.kv_tokens, 96_000, 48_000),
            time_scale: args
                .time_scale
                .unwrap_or(if args.quick { 0.02 } else { 0.05 }),
            sweep,
            sweep_point_s: if args.quick { 3.0 } else { 6.0 },
            load_factor: args.load_factor,
            oracle_accuracy: 0.9,
            dataset: String::new(),
            progress: !args.no_progress,
        };
        if plan.replicas < 2 {
            anyhow::bail!("--replicas: must be at least 2, got {}", plan.replicas);
        }
        if plan.concurrency == 0 || plan.trajectories < 2 {
            anyhow::bail!("--concurrency must be > 0 and --trajectories >= 2");
        }
        if !(plan.time_scale > 0.0 && plan.time_scale <= 10.0) {
            anyhow::bail!("--time-scale: must be in (0, 10], got {}", plan.time_scale);
        }
        Ok(plan)
    }
}

fn parse_list(list: &str) -> anyhow::Result<Vec<usize>> {
    list.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<usize>()
                .ok()
                .filter(|c| *c > 0)
                .with_context(|| format!("--sweep: {s:?} is not a positive integer"))
        })
        .collect()
}

/// One replay through the proxy under one placement policy.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyRun {
    /// `affinity` or `round-robin`.
    pub label: String,
    /// Prefix-cache hit rate in tokens over all replicas.
    pub prefix_cache_hit_rate: f64,
    /// Mean time to first token as the simulator saw it (simulated ms).
    pub server_ttft_mean_ms: f64,
    /// TTFT p50 measured by the replayer, converted to simulated ms.
    pub ttft_p50_ms: f64,
    /// TTFT p90 measured by the replayer, converted to simulated ms.
    pub ttft_p90_ms: f64,
    /// Output tokens per simulated second.
    pub system_tps: f64,
    /// Output tokens per simulated second of turn time, per user.
    pub e2e_interactivity: f64,
    /// Slowest user's output rate (tokens per simulated second).
    pub user_tps_min: f64,
    /// Median user's output rate (tokens per simulated second).
    pub user_tps_median: f64,
    /// Inline accuracy.
    pub accuracy: Option<f64>,
    /// Schedule lag p99 in simulated milliseconds (the replayer's real lateness divided by
    /// the time scale, like every other duration of the run).
    pub schedule_lag_p99_ms: f64,
    /// The gates' verdict (`PASS`, or `FAIL` with the failing gates' values and rules);
    /// `None` when the run had no gates.
    pub gates_verdict: Option<String>,
    /// Failed or aborted turns.
    pub failures: u64,
    /// Turns completed.
    pub turns_ok: u64,
    /// Preemptions on the replicas.
    pub preemptions: u64,
    /// Per-replica counters at the end.
    pub replicas: Vec<ReplicaStats>,
    /// Where the replay's outputs are.
    pub dir: PathBuf,
    /// Client TTFT of every answered turn, simulated ms (from its `events.jsonl`).
    #[serde(skip)]
    pub ttfts_ms: Vec<f64>,
    /// Each user's output tokens over time (from its `result_summary.json`).
    #[serde(skip)]
    pub user_tokens: figures::UserTokens,
}

/// Runs the demo and prints the table.
pub async fn run(args: DemoArgs) -> anyhow::Result<ExitCode> {
    let out = args.out.join(format!("demo-{}", timestamp()));
    let result = run_into(&args, &out).await?;
    print!("{}", page::table(&result.runs));
    println!();
    println!("Outputs in {}/", out.display());
    println!("  index.html      the table, the plan and the figures (Pareto, TTFT, per user, per replica)");
    println!("  demo.json       every figure above, machine-readable");
    println!("  affinity/ round-robin/   each replay's events.jsonl, result_summary.json, scores.json, report.txt, captures/");
    if result.pareto_svg.is_some() {
        println!("  pareto.svg      system_tps vs e2e_interactivity per policy, one point per concurrency");
    }
    println!();
    println!("Next:");
    println!("  agentrace proxy --listen 127.0.0.1:8080 --backend http://<vllm-1>:8000 --backend http://<vllm-2>:8000");
    println!("  agentrace proxy --config config/proxy.toml --capture captures/   # record real agent traffic");
    println!(
        "  agentrace capture stats {}/affinity/captures",
        out.display()
    );
    println!("  agentrace replay --target http://127.0.0.1:8080 --concurrency 64 --out runs/c64");
    println!(
        "  agentrace sweep --target http://127.0.0.1:8080 --concurrency 1,4,16,64 --out runs/sweep"
    );
    Ok(ExitCode::SUCCESS)
}

/// What one demo run produced.
#[derive(Debug, Clone, Serialize)]
pub struct DemoResult {
    /// The affinity run, then the round-robin run.
    pub runs: Vec<PolicyRun>,
    /// Both sweeps' plot, when a sweep ran.
    pub pareto_svg: Option<PathBuf>,
    /// Each policy's sweep points (affinity, then round-robin), in wall-clock rates.
    #[serde(skip)]
    pub sweeps: Vec<(String, Vec<replay::sweep::Point>)>,
}

/// Runs everything and writes the outputs into `out` (created).
pub async fn run_into(args: &DemoArgs, out: &Path) -> anyhow::Result<DemoResult> {
    let mut plan = Plan::from_args(args)?;
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let dataset_path = match &args.dataset {
        Some(p) => p.clone(),
        None => dataset::synth::ensure_standard_set(Path::new(dataset::synth::STANDARD_SET_PATH))?,
    };
    plan.dataset = dataset_path.display().to_string();
    let full = dataset::load(&dataset_path, &dataset::LoadOptions::default())
        .with_context(|| format!("cannot load {}", dataset_path.display()))?;
    let subset = Arc::new(subset(&full, plan.trajectories));
    let oracle = Arc::new(Oracle::new(subset.clone()).context("cannot index the oracle")?);
    eprintln!(
        "demo: {} trajectories ({} coding, {} workflow), {} replicas × {} KV tokens, concurrency {}, time scale {}",
        subset.conversations.len(),
        subset.conversations.iter().filter(|c| !is_workflow(c)).count(),
        subset.conversations.iter().filter(|c| is_workflow(c)).count(),
        plan.replicas,
        plan.kv_tokens,
        plan.concurrency,
        plan.time_scale
    );

    let mut runs = Vec::new();
    for (label, policy) in [
        ("affinity", Policy::Session),
        ("round-robin", Policy::RoundRobin),
    ] {
        eprintln!("demo: replaying through the proxy with {label} placement");
        let run = run_policy(&plan, label, policy, &subset, &oracle, &out.join(label)).await?;
        runs.push(run);
    }

    let mut sweeps = Vec::new();
    if !plan.sweep.is_empty() {
        for (label, policy) in [
            ("affinity", Policy::Session),
            ("round-robin", Policy::RoundRobin),
        ] {
            eprintln!(
                "demo: Pareto sweep with {label} placement at concurrency {:?}",
                plan.sweep
            );
            let dir = out.join("sweep").join(label);
            let points = sweep(&plan, policy, &subset, &oracle, &dir).await?;
            sweeps.push((label.to_string(), points));
        }
    }
    // The page's plot in the page's time base; each sweep/<policy>/pareto.svg keeps the wall
    // clock of the sweep's own reports.
    let pareto_svg = if sweeps.is_empty() {
        None
    } else {
        let dst = out.join("pareto.svg");
        write(&dst, page::pareto(&sweeps, plan.time_scale).as_bytes())?;
        Some(dst)
    };

    let result = DemoResult {
        runs,
        pareto_svg,
        sweeps,
    };
    let doc = serde_json::json!({ "plan": plan, "runs": result.runs, "ratios": page::ratios(&result.runs) });
    write(&out.join("demo.json"), &serde_json::to_vec_pretty(&doc)?)?;
    write(
        &out.join("index.html"),
        page::html(
            &result.runs,
            &result.sweeps,
            &serde_json::to_value(&plan)?,
            plan.time_scale,
        )
        .as_bytes(),
    )?;
    Ok(result)
}

fn write(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    std::fs::write(path, bytes).with_context(|| format!("cannot write {}", path.display()))
}

/// The MLPerf scorer's domain rule: workflow ids are `sim_<digits>`.
fn is_workflow(conv: &Conversation) -> bool {
    conv.id
        .strip_prefix("sim_")
        .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
}

/// Request bytes of a conversation's longest turn: a proxy for its KV footprint.
fn peak_prompt_bytes(conv: &Conversation) -> usize {
    let last = conv.client_turns.last().map_or(0, |t| t.history_len);
    conv.messages[..last]
        .iter()
        .map(|m| m.wire.get().len())
        .sum()
}

/// Half coding, half workflow, in file order; coding trajectories are taken among those
/// whose longest prompt stays under ~60K tokens, so a demo replay finishes in seconds.
fn subset(full: &Dataset, n: usize) -> Dataset {
    const MAX_PROMPT_BYTES: usize = 240_000;
    let coding: Vec<_> = full
        .conversations
        .iter()
        .filter(|c| !is_workflow(c) && peak_prompt_bytes(c) <= MAX_PROMPT_BYTES)
        .cloned()
        .collect();
    let workflow: Vec<_> = full
        .conversations
        .iter()
        .filter(|c| is_workflow(c))
        .cloned()
        .collect();
    let want_coding = (n / 2).min(coding.len());
    let want_workflow = (n - want_coding).min(workflow.len());
    let mut conversations = Vec::with_capacity(n);
    // Interleave so both domains run from the start.
    let (mut c, mut w) = (
        coding.into_iter().take(want_coding),
        workflow.into_iter().take(want_workflow),
    );
    loop {
        let (a, b) = (c.next(), w.next());
        if a.is_none() && b.is_none() {
            break;
        }
        conversations.extend(a);
        conversations.extend(b);
    }
    Dataset {
        path: full.path.clone(),
        sha256: full.sha256.clone(),
        conversations,
    }
}

fn sim_config(plan: &Plan) -> anyhow::Result<SimConfig> {
    let mut cfg = SimConfig::from_profile(sim::DEFAULT_PROFILE)?;
    cfg.time_scale = plan.time_scale;
    cfg.engine.num_gpu_blocks = plan.kv_tokens.div_ceil(cfg.engine.block_size);
    cfg.responder.oracle_accuracy = plan.oracle_accuracy;
    cfg.created_base_unix = Some(1_767_225_600);
    Ok(cfg)
}

fn proxy_config(
    plan: &Plan,
    backends: &[SocketAddr],
    policy: Policy,
    capture_dir: &Path,
) -> ProxyConfig {
    let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
    let mut cfg = ProxyConfig {
        listen: loopback,
        backends: backends
            .iter()
            .enumerate()
            .map(|(i, addr)| proxy::config::BackendConfig {
                name: format!("sim-{i}"),
                url: format!("http://{addr}"),
                weight: 1.0,
            })
            .collect(),
        ..ProxyConfig::default()
    };
    cfg.admin.listen = loopback;
    cfg.affinity.policy = policy;
    cfg.affinity.load_factor = plan.load_factor;
    cfg.capture.enabled = true;
    cfg.capture.dir = capture_dir.to_path_buf();
    cfg
}

fn replay_config(plan: &Plan, target: SocketAddr, concurrency: usize) -> ReplayConfig {
    ReplayConfig {
        target: format!("http://{target}").into(),
        model: Some("qwen3.6-35b-a3b".into()),
        concurrency,
        time_scale: plan.time_scale,
        progress: plan.progress,
        ..ReplayConfig::default()
    }
}

/// Simulators and a proxy in front of them, stopped together.
struct Stack {
    trigger: shutdown::Trigger,
    sims: sim::SimCluster,
    proxy: proxy::ProxyHandle,
}

impl Stack {
    async fn start(
        plan: &Plan,
        policy: Policy,
        oracle: &Arc<Oracle>,
        dir: &Path,
    ) -> anyhow::Result<Stack> {
        let (trigger, listener) = shutdown::channel();
        let sims = sim::start_with_oracle(
            sim_config(plan)?,
            SocketAddr::from(([127, 0, 0, 1], 0)),
            plan.replicas,
            listener.clone(),
            Some(oracle.clone()),
        )?;
        let proxy = proxy::start(
            proxy_config(plan, &sims.addrs(), policy, &dir.join("captures")),
            listener,
        )
        .await?;
        Ok(Stack {
            trigger,
            sims,
            proxy,
        })
    }

    async fn stop(self) -> Vec<ReplicaStats> {
        let stats = self.sims.stats();
        self.trigger.fire();
        self.proxy.join().await;
        self.sims.join().await;
        stats
    }
}

async fn run_policy(
    plan: &Plan,
    label: &str,
    policy: Policy,
    dataset: &Arc<Dataset>,
    oracle: &Arc<Oracle>,
    dir: &Path,
) -> anyhow::Result<PolicyRun> {
    let stack = Stack::start(plan, policy, oracle, dir).await?;
    let (_never, replay_shutdown) = shutdown::channel();
    let summary = replay::run(
        replay_config(plan, stack.proxy.addr, plan.concurrency),
        dataset.clone(),
        dir,
        replay_shutdown,
    )
    .await;
    let replicas = stack.stop().await;
    let summary = summary.with_context(|| format!("the {label} replay failed"))?;
    let mut run = policy_run(plan, label, &summary, replicas, dir);
    run.ttfts_ms = figures::client_ttfts_ms(&dir.join("events.jsonl"), plan.time_scale)?;
    run.user_tokens = figures::user_tokens(&dir.join("result_summary.json"), plan.time_scale)?;
    Ok(run)
}

fn policy_run(
    plan: &Plan,
    label: &str,
    s: &ReplaySummary,
    replicas: Vec<ReplicaStats>,
    dir: &Path,
) -> PolicyRun {
    let sum = |f: fn(&ReplicaStats) -> f64| replicas.iter().map(f).sum::<f64>();
    let queries = sum(|r| r.prefix_cache_queries as f64);
    let ttft_count = sum(|r| r.ttft_count as f64);
    // The replayer measures real time; the simulator runs `time_scale` real seconds per
    // simulated second, so durations divide by it and rates multiply.
    let k = plan.time_scale;
    PolicyRun {
        label: label.to_string(),
        prefix_cache_hit_rate: if queries > 0.0 {
            sum(|r| r.prefix_cache_hits as f64) / queries
        } else {
            0.0
        },
        server_ttft_mean_ms: if ttft_count > 0.0 {
            1000.0 * sum(|r| r.ttft_seconds_sum) / ttft_count
        } else {
            0.0
        },
        ttft_p50_ms: s.ttft_p50_ms / k,
        ttft_p90_ms: s.ttft_p90_ms / k,
        system_tps: s.system_tps * k,
        e2e_interactivity: s.e2e_interactivity * k,
        user_tps_min: s.user_tps_min * k,
        user_tps_median: s.user_tps_median * k,
        accuracy: s.accuracy,
        schedule_lag_p99_ms: s.schedule_lag_p99_us / 1000.0 / k,
        gates_verdict: replay::report::verdict(&s.gates),
        failures: s.failures,
        turns_ok: s.turns_ok,
        preemptions: replicas.iter().map(|r| r.preemptions).sum(),
        replicas,
        dir: dir.to_path_buf(),
        ttfts_ms: Vec::new(),
        user_tokens: figures::UserTokens::default(),
    }
}

async fn sweep(
    plan: &Plan,
    policy: Policy,
    dataset: &Arc<Dataset>,
    oracle: &Arc<Oracle>,
    dir: &Path,
) -> anyhow::Result<Vec<replay::sweep::Point>> {
    let stack = Stack::start(plan, policy, oracle, dir).await?;
    let (_never, replay_shutdown) = shutdown::channel();
    let mut base = replay_config(plan, stack.proxy.addr, 1);
    // Each point measures a fixed stretch rather than a whole pass: at concurrency 1 a pass
    // would replay every trajectory one after another.
    base.max_duration_s = plan.sweep_point_s;
    let points = replay::sweep::run(base, &plan.sweep, dataset.clone(), dir, replay_shutdown).await;
    stack.stop().await;
    points.context("the sweep failed")
}

/// `YYYYmmdd-HHMMSS` in UTC, for output directory names that sort by time.
fn timestamp() -> String {
    let now_ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let (y, mo, d, h, mi, s, _) = crate::capture::format::civil(now_ns);
    format!("{y:04}{mo:02}{d:02}-{h:02}{mi:02}{s:02}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sweep_list_rejects_zero_and_words() {
        assert_eq!(parse_list("1, 4,16").unwrap(), vec![1, 4, 16]);
        assert!(parse_list("0").is_err());
        assert!(parse_list("4,x").is_err());
    }
}
