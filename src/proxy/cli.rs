//! `agentrace proxy`: flags, config loading, signals (SIGINT/SIGTERM stop, SIGHUP reloads).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::builder::TypedValueParser;

use super::config::{BackendConfig, Policy, ProxyConfig};
use crate::telemetry::EXIT_CONFIG;

/// Flags of `agentrace proxy`.
#[derive(Debug, clap::Args)]
pub(crate) struct ProxyArgs {
    /// TOML config file (see config/proxy.toml); SIGHUP re-reads it.
    #[arg(long, short = 'c')]
    pub config: Option<PathBuf>,
    /// Listen address (overrides the file).
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// Admin/metrics listen address (overrides the file).
    #[arg(long)]
    pub admin_listen: Option<SocketAddr>,
    /// A backend URL, repeatable; `name=URL` names it, otherwise its host:port is the name.
    /// Replaces the file's backends.
    #[arg(long = "backend", value_name = "[NAME=]URL")]
    pub backends: Vec<String>,
    /// Placement policy (overrides the file): `session` keeps a conversation on the backend
    /// holding its cache; `round_robin` and `least_loaded` turn affinity off.
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(POLICIES).map(|s| parse_policy(&s)))]
    pub policy: Option<Policy>,
    /// Record traffic into this directory (turns `[capture]` on).
    #[arg(long, value_name = "DIR")]
    pub capture: Option<PathBuf>,
}

/// The `--policy` values, as `[affinity] policy` spells them.
const POLICIES: [&str; 3] = ["session", "round_robin", "least_loaded"];

/// One of [`POLICIES`] (clap has already refused anything else).
fn parse_policy(s: &str) -> Policy {
    match s {
        "round_robin" => Policy::RoundRobin,
        "least_loaded" => Policy::LeastLoaded,
        _ => Policy::Session,
    }
}

/// The effective configuration: the file (or defaults) with the flags on top, validated
/// once the flags are applied, so a flag can supply what the file leaves out.
pub(crate) fn effective_config(args: &ProxyArgs) -> anyhow::Result<ProxyConfig> {
    let mut config = match &args.config {
        Some(path) => ProxyConfig::read(path)?,
        None => ProxyConfig::default(),
    };
    if let Some(listen) = args.listen {
        config.listen = listen;
    }
    if let Some(admin) = args.admin_listen {
        config.admin.listen = admin;
    }
    if !args.backends.is_empty() {
        config.backends = args
            .backends
            .iter()
            .map(|spec| backend_from_flag(spec))
            .collect::<anyhow::Result<_>>()?;
    }
    if let Some(policy) = args.policy {
        config.affinity.policy = policy;
    }
    if let Some(dir) = &args.capture {
        config.capture.enabled = true;
        config.capture.dir = dir.clone();
    }
    config.validate()?;
    Ok(config)
}

fn backend_from_flag(spec: &str) -> anyhow::Result<BackendConfig> {
    let (name, url) = match spec.split_once('=') {
        Some((name, url)) if !name.contains("://") => (name.to_string(), url.to_string()),
        _ => {
            let parsed = super::config::BackendUrl::parse(spec)
                .map_err(|why| anyhow::anyhow!("--backend {spec:?}: {why}"))?;
            (parsed.server.authority.to_string(), spec.to_string())
        }
    };
    Ok(BackendConfig {
        name,
        url,
        weight: 1.0,
    })
}

/// Runs the proxy until SIGINT/SIGTERM; exit code 2 for a bad configuration.
pub(crate) async fn run(args: ProxyArgs) -> anyhow::Result<ExitCode> {
    let config = match effective_config(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {}", crate::telemetry::report(&e));
            return Ok(ExitCode::from(EXIT_CONFIG));
        }
    };
    // Install the signal handlers before announcing the addresses: an early SIGHUP must
    // reload, and an early SIGINT stop cleanly, not kill the process.
    let reloads =
        crate::shutdown::Reloads::install().context("cannot install the signal handlers")?;
    let (trigger, shutdown) = crate::shutdown::channel();
    let handle = match super::start(config, shutdown).await {
        Ok(h) => h,
        Err(e) if e.is_config() => {
            eprintln!("error: {e}");
            return Ok(ExitCode::from(EXIT_CONFIG));
        }
        Err(e) => return Err(e.into()),
    };
    println!(
        "agentrace proxy listening on {} (admin {})",
        handle.addr, handle.admin_addr
    );

    reloads.until_stopped(|| reload(&args, &handle)).await;
    tracing::info!("shutting down: draining in-flight requests");
    trigger.fire();
    handle.join().await;
    Ok(ExitCode::SUCCESS)
}

fn reload(args: &ProxyArgs, handle: &super::ProxyHandle) {
    if args.config.is_none() {
        tracing::warn!("SIGHUP ignored: no --config file to reload");
        return;
    }
    let config = match effective_config(args) {
        Ok(c) => c,
        Err(e) => {
            handle.note_refused_reload();
            tracing::error!(error = %crate::telemetry::report(&e), "configuration reload refused; keeping the running configuration");
            return;
        }
    };
    match handle.reload(config) {
        Ok(()) => tracing::info!(backends = ?handle.backend_names(), "configuration reloaded"),
        Err(e) => {
            tracing::error!(error = %e, "configuration reload refused; keeping the running configuration")
        }
    }
}
