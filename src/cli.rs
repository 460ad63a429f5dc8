//! Command-line surface: one binary, one subcommand per job, thin glue into the library.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::telemetry::LogFormat;

#[derive(Debug, Parser)]
#[command(name = "agentrace", version, about, long_about = None)]
pub(crate) struct Cli {
    /// Log format on stderr.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Human)]
    pub(crate) log_format: LogFormat,

    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Session-affinity reverse proxy in front of OpenAI-compatible servers.
    Proxy(crate::proxy::cli::ProxyArgs),
    /// Endpoint picker for a gateway (Envoy ext_proc, Gateway API Inference Extension).
    Epp(crate::epp::cli::EppArgs),
    /// Simulated inference server (KV cache, prefix caching, continuous batching).
    Sim(crate::sim::cli::SimArgs),
    /// Validate, inspect, synthesize and convert MLPerf agentic datasets.
    #[command(subcommand)]
    Dataset(crate::dataset::cli::DatasetCommand),
    /// Replay agentic trajectories closed-loop against an endpoint and measure it.
    Replay(crate::replay::cli::ReplayArgs),
    /// Run one replay per concurrency point and draw the Pareto curve.
    Sweep(crate::replay::cli::SweepArgs),
    /// Read, summarise and export traffic captured by the proxy.
    #[command(subcommand)]
    Capture(crate::capture::cli::CaptureCommand),
    /// Show, on the embedded simulator, what session affinity is worth.
    Demo(crate::demo::DemoArgs),
}

/// Entry point of the binary: parse, set up logging, run the command on a tokio runtime.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    // The demo prints its own narrative; its servers' routine logs would drown it.
    let default_level = match cli.command {
        Command::Demo(_) => "warn",
        _ => "info",
    };
    crate::telemetry::init(cli.log_format, default_level);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Proxy(args) => crate::proxy::cli::run(args).await,
            Command::Epp(args) => crate::epp::cli::run(args).await,
            Command::Sim(args) => crate::sim::cli::run(args).await,
            Command::Dataset(cmd) => crate::dataset::cli::run(cmd).await,
            Command::Replay(args) => crate::replay::cli::run(args).await,
            Command::Sweep(args) => crate::replay::cli::run_sweep(args).await,
            Command::Capture(cmd) => crate::capture::cli::run(cmd).await,
            Command::Demo(args) => crate::demo::run(args).await,
        }
    });
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", crate::telemetry::report(&e));
            ExitCode::FAILURE
        }
    }
}
