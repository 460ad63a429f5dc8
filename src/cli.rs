//! Command-line surface: one binary, one subcommand per job, thin glue into the library.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::telemetry::LogFormat;

mod docs;

/// The package version and the commit it was built from (`build.rs`), so a report of a bug
/// names the exact source.
const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (",
    env!("AGENTRACE_GIT_COMMIT"),
    ")"
);

#[derive(Debug, Parser)]
#[command(name = "agentrace", version = VERSION, about, long_about = None)]
pub(crate) struct Cli {
    /// Log format on stderr.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Human)]
    pub(crate) log_format: LogFormat,

    #[command(subcommand)]
    pub(crate) command: Command,
}

// Each subcommand's help ends with examples a reader can paste; `tests/docs_commands.rs`
// checks that they name real subcommands and flags, through the CLI reference page.
#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Session-affinity reverse proxy in front of OpenAI-compatible servers.
    #[command(after_help = "Examples:
  agentrace proxy --listen 127.0.0.1:8080 --backend http://127.0.0.1:8001 --backend http://127.0.0.1:8002
  agentrace proxy --config config/proxy.toml --capture captures/run1")]
    Proxy(crate::proxy::cli::ProxyArgs),
    /// Endpoint picker for a gateway (Envoy ext_proc, Gateway API Inference Extension).
    #[command(after_help = "Examples:
  agentrace epp --listen 127.0.0.1:9002 --backend r0=http://10.0.0.1:8000 --backend r1=http://10.0.0.2:8000
  agentrace epp --listen 0.0.0.0:9002 --config config/proxy.toml")]
    Epp(crate::epp::cli::EppArgs),
    /// Simulated inference server (KV cache, prefix caching, continuous batching).
    #[command(after_help = "Examples:
  agentrace sim --replicas 4 --listen 127.0.0.1:8001
  agentrace sim --replicas 4 --config config/sim-h200-demo.toml")]
    Sim(crate::sim::cli::SimArgs),
    /// Validate, inspect, synthesize and convert MLPerf agentic datasets.
    #[command(
        subcommand,
        after_help = "Examples:
  agentrace dataset synth --out datasets/mlperf-agentic-990.jsonl.zst
  agentrace dataset validate datasets/mlperf-agentic-990.jsonl.zst
  agentrace dataset stats datasets/mlperf-agentic-990.jsonl.zst --json"
    )]
    Dataset(crate::dataset::cli::DatasetCommand),
    /// Replay agentic trajectories closed-loop against an endpoint and measure it.
    #[command(after_help = "Examples:
  agentrace replay --target http://127.0.0.1:8080 --concurrency 64 --out runs/c64
  agentrace replay --config config/replay-qwen.toml --target http://127.0.0.1:8080 --out runs/qwen")]
    Replay(crate::replay::cli::ReplayArgs),
    /// Run one replay per concurrency point and draw the Pareto curve.
    #[command(after_help = "Examples:
  agentrace sweep --concurrency 1,4,16,64 --target http://127.0.0.1:8080 --out runs/sweep")]
    Sweep(crate::replay::cli::SweepArgs),
    /// Read, summarise and export traffic captured by the proxy.
    #[command(
        subcommand,
        after_help = "Examples:
  agentrace capture stats captures/run1
  agentrace capture export captures/run1 --out my-agents.jsonl.zst"
    )]
    Capture(crate::capture::cli::CaptureCommand),
    /// Show, on the embedded simulator, what session affinity is worth.
    #[command(after_help = "Examples:
  agentrace demo
  agentrace demo --quick --out runs")]
    Demo(crate::demo::DemoArgs),
    /// Find the replica count that meets an SLO, per placement policy, from recorded traffic
    /// and a simulator profile.
    #[command(after_help = "Examples:
  agentrace sim calibrate --target http://127.0.0.1:8000 --out profile.toml
  agentrace plan --captures captures/ --profile profile.toml --replicas 1..8 --slo ttft_p90=2s,interactivity=30")]
    Plan(crate::plan::PlanArgs),
    /// Print a completion script for a shell to stdout.
    #[command(after_help = "Examples:
  agentrace completions bash > ~/.local/share/bash-completion/completions/agentrace
  agentrace completions zsh > ~/.zfunc/_agentrace
  agentrace completions fish > ~/.config/fish/completions/agentrace.fish")]
    Completions {
        /// The shell the script is for.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Documentation generated from this command line: the CLI reference page, man pages.
    #[command(subcommand, hide = true)]
    Docs(docs::DocsCommand),
}

/// Entry point of the binary: parse, set up logging, run the command on a tokio runtime.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    // Neither needs logging nor a runtime: they print what the command line itself says.
    match cli.command {
        Command::Completions { shell } => return docs::completions(shell),
        Command::Docs(cmd) => return docs::run(cmd),
        _ => {}
    }
    // The demo prints its own narrative; its servers' routine logs would drown it.
    let default_level = match cli.command {
        Command::Demo(_) | Command::Plan(_) => "warn",
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
            Command::Plan(args) => crate::plan::run(args).await,
            Command::Completions { .. } | Command::Docs(_) => unreachable!("handled above"),
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
