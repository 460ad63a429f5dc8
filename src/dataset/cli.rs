//! `agentrace dataset …`: validate, stats, synth, convert-snapshot.

use std::process::ExitCode;

/// Subcommands of `agentrace dataset`.
#[derive(Debug, clap::Subcommand)]
pub enum DatasetCommand {}

/// Runs one dataset subcommand.
pub async fn run(cmd: DatasetCommand) -> anyhow::Result<ExitCode> {
    match cmd {}
}
