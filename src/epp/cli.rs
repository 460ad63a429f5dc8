//! `agentrace epp`: flags, config loading (the proxy's file), signals (SIGHUP reloads).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;

use crate::proxy::cli::{effective_config, ProxyArgs};
use crate::proxy::ProxyConfig;
use crate::telemetry::EXIT_CONFIG;

/// Flags of `agentrace epp`.
#[derive(Debug, clap::Args)]
pub(crate) struct EppArgs {
    /// Address of the gRPC listener (ext_proc and gRPC health) the gateway connects to.
    #[arg(long, default_value = "127.0.0.1:9002")]
    pub listen: SocketAddr,
    /// TOML config file, the proxy's (see config/proxy.toml): `backends` are the endpoints,
    /// `http://IP:PORT` each, or `[epp.inference_pool]` names a pool whose pods are. SIGHUP
    /// re-reads it.
    #[arg(long, short = 'c')]
    pub config: Option<PathBuf>,
    /// Admin/metrics listen address (overrides the file).
    #[arg(long)]
    pub admin_listen: Option<SocketAddr>,
    /// An endpoint `http://IP:PORT`, repeatable; `name=URL` names it. Replaces the file's.
    #[arg(long = "backend", value_name = "[NAME=]URL")]
    pub backends: Vec<String>,
}

fn config_of(args: &EppArgs) -> anyhow::Result<ProxyConfig> {
    let config = effective_config(&ProxyArgs {
        config: args.config.clone(),
        listen: None,
        admin_listen: args.admin_listen,
        backends: args.backends.clone(),
        policy: None,
        capture: None,
    })?;
    super::check_source(&config)?;
    super::check_endpoints(&config)?;
    Ok(config)
}

/// Runs the picker until SIGINT/SIGTERM; exit code 2 for a bad configuration.
pub(crate) async fn run(args: EppArgs) -> anyhow::Result<ExitCode> {
    let config = match config_of(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {}", crate::telemetry::report(&e));
            return Ok(ExitCode::from(EXIT_CONFIG));
        }
    };
    let reloads =
        crate::shutdown::Reloads::install().context("cannot install the signal handlers")?;
    let (trigger, shutdown) = crate::shutdown::channel();
    let handle = match super::start(args.listen, config, shutdown).await {
        Ok(h) => h,
        Err(e) if e.is_config() => {
            eprintln!("error: {e}");
            return Ok(ExitCode::from(EXIT_CONFIG));
        }
        Err(e) => return Err(e.into()),
    };
    println!(
        "agentrace epp listening on {} (admin {})",
        handle.addr, handle.admin_addr
    );
    reloads.until_stopped(|| reload(&args, &handle)).await;
    tracing::info!("shutting down");
    trigger.fire();
    handle.join().await;
    Ok(ExitCode::SUCCESS)
}

fn reload(args: &EppArgs, handle: &super::EppHandle) {
    if args.config.is_none() {
        tracing::warn!("SIGHUP ignored: no --config file to reload");
        return;
    }
    let result = match config_of(args) {
        Ok(config) => handle.reload(config).map_err(anyhow::Error::from),
        Err(e) => {
            // Counted as the proxy counts a file it could not use.
            handle.note_refused_reload();
            Err(e)
        }
    };
    match result {
        Ok(()) => tracing::info!(endpoints = ?handle.endpoints(), "configuration reloaded"),
        Err(e) => {
            tracing::error!(error = %crate::telemetry::report(&e), "configuration reload refused; keeping the running configuration")
        }
    }
}
