//! `agentrace demo`: simulated replicas, the proxy with and without affinity, and a replay
//! through each, in one process.

use std::process::ExitCode;

/// Flags of `agentrace demo`.
#[derive(Debug, clap::Args)]
pub struct DemoArgs {}

/// Runs the demo.
pub async fn run(_args: DemoArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("agentrace demo is not available yet")
}
