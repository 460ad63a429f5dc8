//! `agentrace proxy`: flags and the glue that starts the proxy.

use std::process::ExitCode;

/// Flags of `agentrace proxy`.
#[derive(Debug, clap::Args)]
pub struct ProxyArgs {}

/// Runs the proxy until a shutdown signal.
pub async fn run(_args: ProxyArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("agentrace proxy is not available yet")
}
