//! `agentrace plan`: from recorded traffic (captures or a dataset) and a simulator profile to
//! the replica count that meets an SLO, per placement policy, by running every combination
//! on the real path (simulated replicas behind the real proxy, driven by the replayer) in
//! this process.
//!
//! # Layout
//!
//! - `config`: flags → the combinations, validated.
//! - `runner`: one combination, its outcome kept with a hash of its inputs (resumable).
//! - `report`: SLO verdicts, smallest counts, what affinity saves, table and page.

pub mod config;
pub(crate) mod report;
pub(crate) mod runner;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context as _;

pub use config::{PlanArgs, PlanConfig, PlanConfigError};

use crate::dataset::{self, Dataset};
use crate::replay::slo::Slo;
use crate::replay::ReplayConfig;
use crate::sim::{Oracle, SimConfig};
use runner::{Combination, Outcome, Shared};

/// Features of real engines the simulator does not model.
const NOT_MODELLED: &str = "the simulator does not model speculative decoding, KV offload tiers (CPU/disk cache), or disaggregated prefill: a deployment using them will differ";

/// Runs `agentrace plan` and prints the table.
pub async fn run(args: PlanArgs) -> anyhow::Result<ExitCode> {
    let cfg = match PlanConfig::from_args(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return Ok(ExitCode::from(crate::telemetry::EXIT_CONFIG));
        }
    };
    let text = run_into(&args, &cfg).await?;
    print!("{text}");
    println!(
        "Outputs in {}/: plan.json, report.txt, index.html, runs/",
        args.out.display()
    );
    Ok(ExitCode::SUCCESS)
}

/// Loads the inputs, runs every combination not already done, writes the outputs into
/// `args.out`; returns the report text.
pub async fn run_into(args: &PlanArgs, cfg: &PlanConfig) -> anyhow::Result<String> {
    let out = &args.out;
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let slo = Slo::parse(&cfg.slo)?;
    let mut profile = crate::sim::profile::resolve(&args.profile)
        .with_context(|| format!("--profile {}", args.profile))?;
    profile.time_scale = cfg.time_scale;
    profile.validate().context("--profile")?;
    let dataset = Arc::new(load_input(args, out)?);
    anyhow::ensure!(
        !dataset.conversations.is_empty(),
        "the input holds no conversation"
    );
    let oracle =
        Arc::new(Oracle::new(dataset.clone()).context("cannot index the recorded replies")?);
    let users = if cfg.closed_loop {
        cfg.concurrency
    } else {
        dataset.conversations.len()
    };
    let replay = ReplayConfig {
        concurrency: users,
        inject_tool_delay: !cfg.closed_loop,
        time_scale: cfg.time_scale,
        progress: false,
        ..ReplayConfig::default()
    };
    let replay_key = format!(
        "{}|{}|{}",
        users, replay.inject_tool_delay, replay.enable_salt
    );
    let shared = Shared {
        profile: profile.clone(),
        dataset: dataset.clone(),
        oracle,
        replay,
    };
    let mut combos = Vec::new();
    for &kv in &cfg.kv_blocks {
        for &policy in &cfg.policies {
            for &replicas in &cfg.replicas {
                combos.push(Combination {
                    replicas,
                    policy,
                    kv_blocks: kv.unwrap_or(profile.engine.num_gpu_blocks),
                });
            }
        }
    }
    let bar = if args.no_progress {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::with_draw_target(
            Some(combos.len() as u64),
            indicatif::ProgressDrawTarget::stderr_with_hz(4),
        )
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template("plan {bar:30} {pos}/{len} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut outcomes: Vec<Outcome> = Vec::new();
    let mut reused = 0;
    for c in &combos {
        let name = format!(
            "{}-r{}-kv{}",
            config::policy_name(c.policy),
            c.replicas,
            c.kv_blocks
        );
        bar.set_message(name.clone());
        let dir = out.join("runs").join(&name);
        let hash = runner::inputs_hash(c, &profile, &dataset.sha256, &replay_key);
        let outcome = match runner::stored(&dir, &hash) {
            Some(o) => {
                reused += 1;
                o
            }
            None => runner::run(c, &shared, hash, &dir)
                .await
                .with_context(|| format!("combination {name}"))?,
        };
        outcomes.push(outcome);
        bar.inc(1);
    }
    bar.finish_and_clear();

    let smallest = report::smallest(&outcomes, &slo);
    let mut summary: Vec<String> = smallest
        .iter()
        .map(|s| match s.replicas {
            Some(r) => format!(
                "{}: {r} replicas meet the SLO (KV {} blocks each)",
                s.policy, s.kv_blocks
            ),
            None => format!(
                "{}: none of the replica counts tried meets the SLO (KV {} blocks each)",
                s.policy, s.kv_blocks
            ),
        })
        .collect();
    summary.extend(report::savings(&smallest));
    summary.push(if cfg.closed_loop {
        format!("load: closed loop, {users} users, turns back to back")
    } else {
        format!(
            "load: one user per recorded conversation ({users}), each at its recorded think and tool times; all start together (no session start times are replayed)"
        )
    });
    if reused > 0 {
        summary.push(format!(
            "{reused} of {} combinations reused from an earlier run (same inputs)",
            combos.len()
        ));
    }
    let warnings = trust_warnings(&profile, &dataset, users, &cfg.replicas);
    let mut text = report::table(&outcomes, &slo);
    text.push('\n');
    let _ = std::fmt::Write::write_fmt(&mut text, format_args!("SLO: {slo}\n"));
    for line in &summary {
        text.push_str(line);
        text.push('\n');
    }
    text.push_str("\nWhere this prediction cannot be trusted:\n");
    for w in &warnings {
        text.push_str("  - ");
        text.push_str(w);
        text.push('\n');
    }
    write(&out.join("report.txt"), text.as_bytes())?;
    let doc = serde_json::json!({
        "config": cfg,
        "profile": args.profile,
        "slo": slo.to_string(),
        "outcomes": outcomes,
        "smallest": smallest,
        "summary": summary,
        "warnings": warnings,
    });
    write(&out.join("plan.json"), &serde_json::to_vec_pretty(&doc)?)?;
    write(
        &out.join("index.html"),
        report::html(&outcomes, &slo, &summary, &warnings).as_bytes(),
    )?;
    Ok(text)
}

fn write(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    std::fs::write(path, bytes).with_context(|| format!("cannot write {}", path.display()))
}

/// The dataset, or the captures exported to `out/dataset.jsonl` first.
fn load_input(args: &PlanArgs, out: &Path) -> anyhow::Result<Dataset> {
    let path: PathBuf = match (&args.dataset, args.captures.is_empty()) {
        (Some(p), true) => p.clone(),
        (None, false) => {
            let dst = out.join("dataset.jsonl");
            crate::capture::export::export_dirs(
                &args.captures,
                &dst,
                &crate::capture::export::ExportOptions::default(),
            )
            .context("cannot export --captures")?;
            dst
        }
        _ => anyhow::bail!("give --captures DIR… or --dataset FILE (one of them)"),
    };
    dataset::load(&path, &dataset::LoadOptions::default())
        .with_context(|| format!("cannot load {}", path.display()))
}

/// Where the prediction leaves what the profile measured, and what it never models.
fn trust_warnings(
    profile: &SimConfig,
    dataset: &Dataset,
    users: usize,
    replicas: &[usize],
) -> Vec<String> {
    let mut w = Vec::new();
    // Bytes per token of JSON chat text: a rough estimate, enough to flag a range.
    let longest_prompt_tokens = dataset
        .conversations
        .iter()
        .map(|c| {
            let last = c.client_turns.last().map_or(0, |t| t.history_len);
            c.messages[..last]
                .iter()
                .map(|m| m.wire.get().len())
                .sum::<usize>()
                / 4
        })
        .max()
        .unwrap_or(0) as u64;
    match &profile.calibration {
        None => w.push(format!(
            "profile {:?} is not measured on your engine (run `agentrace sim calibrate`)",
            profile.profile
        )),
        Some(c) => {
            if longest_prompt_tokens > c.prompt_tokens_max {
                w.push(format!(
                    "prompts reach ~{longest_prompt_tokens} tokens, the profile measured prefill up to {} tokens: longer prompts are extrapolated",
                    c.prompt_tokens_max
                ));
            }
            let fewest = replicas.iter().copied().min().unwrap_or(1).max(1);
            let per_replica = users.div_ceil(fewest) as u64;
            if per_replica > c.batch_max {
                w.push(format!(
                    "up to {per_replica} users per replica, the profile measured batches up to {}: larger batches are extrapolated",
                    c.batch_max
                ));
            }
            w.push(format!(
                "the profile's fit is off by up to {:.0}% (TTFT) and {:.0}% (inter-token time) on its own samples",
                c.prefill_max_error_pct, c.decode_max_error_pct
            ));
        }
    }
    w.push(NOT_MODELLED.to_string());
    w
}
