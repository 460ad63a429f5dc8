//! `agentrace capture …`: list, summarise, print and export captures.

use std::process::ExitCode;

/// Subcommands of `agentrace capture`.
#[derive(Debug, clap::Subcommand)]
pub enum CaptureCommand {}

/// Runs one capture subcommand.
pub async fn run(cmd: CaptureCommand) -> anyhow::Result<ExitCode> {
    match cmd {}
}
