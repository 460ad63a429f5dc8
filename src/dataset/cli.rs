//! `agentrace dataset …`: validate, stats, synth, convert-snapshot.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;

use super::lines::DEFAULT_MAX_LINE_BYTES;
use super::synth::{SynthOptions, DEFAULT_SEED, STANDARD_SET_PATH};
use super::{load, DatasetError, LoadOptions};

/// Subcommands of `agentrace dataset`.
#[derive(Debug, clap::Subcommand)]
pub(crate) enum DatasetCommand {
    /// Check a dataset against every rule of the reference; lists all errors (exit 1).
    Validate {
        /// The JSONL file (`.jsonl` or `.jsonl.zst`).
        path: PathBuf,
        /// List at most this many broken rules; the check still reads the whole file, exits 1
        /// when any rule is broken, and says how many more it did not list.
        #[arg(long, default_value_t = 100)]
        max_errors: usize,
        /// A longer line stops the check at once, naming the line.
        #[arg(long, default_value_t = DEFAULT_MAX_LINE_BYTES)]
        max_line_bytes: usize,
    },
    /// Describe a dataset: conversations, turns, delays, prompt sizes, prefix sharing.
    Stats {
        /// The JSONL file (`.jsonl` or `.jsonl.zst`).
        path: PathBuf,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// A longer line stops the load at once, naming the line.
        #[arg(long, default_value_t = DEFAULT_MAX_LINE_BYTES)]
        max_line_bytes: usize,
    },
    /// Generate the synthetic standard set (490 coding + 500 workflow trajectories).
    Synth {
        /// Output file; zstd-compressed when it ends in `.zst`.
        #[arg(long, default_value = STANDARD_SET_PATH)]
        out: PathBuf,
        /// Seed of every random draw; the same seed and counts give the same bytes, so a
        /// set is named by its seed (the default gives the standard set's SHA-256).
        #[arg(long, default_value_t = DEFAULT_SEED)]
        seed: u64,
        /// Number of agentic-coding trajectories (bash tool calls, scored by command
        /// Jaccard); the standard set has 490.
        #[arg(long, default_value_t = 490)]
        coding: usize,
        /// Number of agentic-workflow trajectories (ids `sim_<n>`, scored by intent code);
        /// the standard set has 500.
        #[arg(long, default_value_t = 500)]
        workflow: usize,
    },
    /// Turn the reference's snapshot JSONL into flat dataset rows. Each input line is
    /// `{"conversation_id": "...", "messages": [OpenAI chat messages], "tools": [...]}`
    /// (`tools` optional), the whole history so far; the last snapshot of a conversation
    /// wins, and lines with a `_type` key (sentinels) are skipped.
    ConvertSnapshot {
        /// The snapshot file (`.jsonl` or `.jsonl.zst`).
        input: PathBuf,
        /// The flat dataset to write (`.zst` compresses).
        #[arg(long)]
        out: PathBuf,
        /// A longer snapshot line stops the conversion at once, naming the line.
        #[arg(long, default_value_t = DEFAULT_MAX_LINE_BYTES)]
        max_line_bytes: usize,
    },
}

/// Runs one dataset subcommand.
pub(crate) async fn run(cmd: DatasetCommand) -> anyhow::Result<ExitCode> {
    tokio::task::spawn_blocking(move || run_blocking(cmd))
        .await
        .context("the dataset task panicked")?
}

fn run_blocking(cmd: DatasetCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        DatasetCommand::Validate {
            path,
            max_errors,
            max_line_bytes,
        } => {
            let opts = LoadOptions {
                max_errors,
                max_line_bytes,
            };
            match load(&path, &opts) {
                Ok(ds) => {
                    println!(
                        "{}: valid: {} conversations, {} client turns, sha256 {}",
                        path.display(),
                        ds.conversations.len(),
                        ds.client_turn_count(),
                        ds.sha256
                    );
                    let unsalted = ds.without_system_prompt().count();
                    if unsalted > 0 {
                        println!(
                            "note: {unsalted} conversations have no system prompt; replay them \
                             with --salt false (salting, on by default, needs one)"
                        );
                    }
                    Ok(ExitCode::SUCCESS)
                }
                Err(e @ (DatasetError::Invalid { .. } | DatasetError::LineTooLong { .. })) => {
                    eprintln!("{e}");
                    Ok(ExitCode::FAILURE)
                }
                Err(e) => Err(e.into()),
            }
        }
        DatasetCommand::Stats {
            path,
            json,
            max_line_bytes,
        } => {
            let opts = LoadOptions {
                max_line_bytes,
                ..LoadOptions::default()
            };
            let ds = load(&path, &opts)?;
            let stats = super::stats::DatasetStats::compute(&ds);
            if json {
                println!("{}", serde_json::to_string_pretty(&stats)?);
            } else {
                print!("{}", stats.table());
            }
            Ok(ExitCode::SUCCESS)
        }
        DatasetCommand::Synth {
            out,
            seed,
            coding,
            workflow,
        } => {
            let opts = SynthOptions {
                seed,
                coding,
                workflow,
            };
            super::synth::write_file(&out, &opts)?;
            let size = std::fs::metadata(&out)?.len();
            println!(
                "{}: {} coding + {} workflow trajectories, seed {seed}, {size} bytes",
                out.display(),
                coding,
                workflow
            );
            Ok(ExitCode::SUCCESS)
        }
        DatasetCommand::ConvertSnapshot {
            input,
            out,
            max_line_bytes,
        } => {
            let summary = super::snapshot::convert_file(&input, &out, max_line_bytes)?;
            println!(
                "{}: {} conversations, {} rows from {} snapshot lines",
                out.display(),
                summary.conversations,
                summary.rows,
                summary.snapshots
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}
