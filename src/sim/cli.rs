//! `agentrace sim`: flags and the glue that starts the simulated replicas.

use std::process::ExitCode;

/// Flags of `agentrace sim`.
#[derive(Debug, clap::Args)]
pub struct SimArgs {}

/// Runs the simulated replicas until a shutdown signal.
pub async fn run(_args: SimArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("agentrace sim is not available yet")
}
