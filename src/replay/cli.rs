//! `agentrace replay` and `agentrace sweep`: flags and glue.

use std::process::ExitCode;

/// Flags of `agentrace replay`.
#[derive(Debug, clap::Args)]
pub struct ReplayArgs {}

/// Flags of `agentrace sweep`.
#[derive(Debug, clap::Args)]
pub struct SweepArgs {}

/// Runs one replay.
pub async fn run(_args: ReplayArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("agentrace replay is not available yet")
}

/// Runs one replay per concurrency point.
pub async fn run_sweep(_args: SweepArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("agentrace sweep is not available yet")
}
