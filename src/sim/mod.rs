//! The simulated inference server: an OpenAI-compatible HTTP surface over an engine loop with
//! continuous batching, a block-based KV cache with prefix caching and a cost model.
//!
//! # Layout
//!
//! - `config`: profiles, the TOML format, validation.
//! - `api`: lenient request types.
//! - `messages`, `responses`: Anthropic Messages and OpenAI Responses requests read into the
//!   chat form every API is planned from, and replies written in their wire format.
//! - `response_store`: the bounded conversations behind `previous_response_id`.
//! - `render`: chat template → pseudo-tokens → chained block hashes.
//! - `kv`: the block pool with prefix caching.
//! - `cost`: the step latency model.
//! - `engine`: one continuous-batching loop per replica, on its own simulated clock.
//! - `generate`: what replies say (synthetic text, reasoning, tool calls).
//! - `oracle`: recognises replayed dataset turns and answers with the recorded reply.
//! - `http`: routes, faults, SSE.
//! - `metrics`: per-replica vLLM-named metrics.
//! - `profile`, `profile_probe`, `profile_fit`: `agentrace sim calibrate`: a profile
//!   measured on a real engine, and `--profile NAME|FILE`.
//! - `cli`: `agentrace sim`.

pub(crate) mod api;
pub(crate) mod cli;
pub(crate) mod config;
pub(crate) mod cost;
pub(crate) mod engine;
pub(crate) mod generate;
pub(crate) mod http;
pub(crate) mod kv;
pub(crate) mod messages;
pub(crate) mod metrics;
pub(crate) mod oracle;
pub mod profile;
pub(crate) mod profile_fit;
pub(crate) mod profile_probe;
pub(crate) mod render;
pub(crate) mod response_store;
pub(crate) mod responses;

use std::io::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;

pub use config::{
    ConfigError, MidStreamFault, ResponderKind, SimConfig, DEFAULT_PROFILE, PROFILES,
};
pub use oracle::{Oracle, OracleError};

use crate::shutdown::Shutdown;
use engine::{Engine, SimClock};
use metrics::Metrics;

/// Why a cluster could not start.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A listener could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
    /// The oracle's dataset could not be loaded.
    #[error("responder.oracle_dataset: {0}")]
    Dataset(#[from] crate::dataset::DatasetError),
    /// The oracle's dataset could not be indexed.
    #[error("responder.oracle_dataset: {0}")]
    Oracle(#[from] OracleError),
    /// The oracle responder has nothing to answer from.
    #[error("responder.oracle_dataset: required when responder.kind is oracle")]
    OracleMissing,
    /// The trace log could not be created.
    #[error("trace_log: cannot create {path}: {source}")]
    TraceLog {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
}

/// A snapshot of one replica's counters: enough to compute prefix-cache hit rates and mean
/// TTFT without scraping `/metrics`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ReplicaStats {
    /// Replica name (`x-inference-pod`).
    pub name: String,
    /// Requests that finished (any reason but abort).
    pub requests: u64,
    /// Requests aborted (client gone, mid-stream fault).
    pub aborted: u64,
    /// Prompt tokens admitted (`vllm:prompt_tokens_total`).
    pub prompt_tokens: u64,
    /// Prompt tokens looked up in the prefix cache (`vllm:prefix_cache_queries_total`).
    pub prefix_cache_queries: u64,
    /// Prompt tokens found there, i.e. cached tokens (`vllm:prefix_cache_hits_total`).
    pub prefix_cache_hits: u64,
    /// Tokens generated.
    pub generation_tokens: u64,
    /// Preemptions.
    pub preemptions: u64,
    /// Share of KV blocks in use now (0..=1).
    pub kv_usage: f64,
    /// Requests running now.
    pub running: u64,
    /// Requests waiting now.
    pub waiting: u64,
    /// Sum of time to first token over requests that got one, simulated seconds.
    pub ttft_seconds_sum: f64,
    /// Requests that got a first token.
    pub ttft_count: u64,
}

impl ReplicaStats {
    /// Prefix-cache hit rate in tokens (0 when nothing was queried).
    pub fn hit_rate(&self) -> f64 {
        if self.prefix_cache_queries == 0 {
            0.0
        } else {
            self.prefix_cache_hits as f64 / self.prefix_cache_queries as f64
        }
    }
}

/// Running replicas: their addresses, names and counters; `join` waits for them to stop.
pub struct SimCluster {
    addrs: Vec<SocketAddr>,
    names: Vec<String>,
    metrics: Vec<Arc<Metrics>>,
    tasks: Vec<JoinHandle<()>>,
    trace_writer: Option<JoinHandle<()>>,
}

impl SimCluster {
    /// Listening address of each replica, in replica order.
    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.addrs.clone()
    }

    /// Name of each replica (`x-inference-pod`), in replica order.
    pub fn replica_names(&self) -> Vec<String> {
        self.names.clone()
    }

    /// Current counters of each replica, in replica order.
    pub fn stats(&self) -> Vec<ReplicaStats> {
        self.names
            .iter()
            .zip(&self.metrics)
            .map(|(name, m)| {
                let (ttft_seconds_sum, ttft_count) = m.ttft.sum_count();
                ReplicaStats {
                    name: name.clone(),
                    requests: m.finished[..3].iter().map(|c| c.load(Relaxed)).sum(),
                    aborted: m.finished[3].load(Relaxed),
                    prompt_tokens: m.prompt_tokens.load(Relaxed),
                    prefix_cache_queries: m.prefix_cache_queries.load(Relaxed),
                    prefix_cache_hits: m.prefix_cache_hits.load(Relaxed),
                    generation_tokens: m.generation_tokens.load(Relaxed),
                    preemptions: m.preemptions.load(Relaxed),
                    kv_usage: m.kv_usage(),
                    running: m.running.load(Relaxed),
                    waiting: m.waiting.load(Relaxed),
                    ttft_seconds_sum,
                    ttft_count,
                }
            })
            .collect()
    }

    /// Waits until every replica stopped (after the shutdown fired) and the trace log is
    /// flushed.
    pub async fn join(self) {
        for task in self.tasks {
            let _ = task.await;
        }
        if let Some(writer) = self.trace_writer {
            let _ = writer.await;
        }
    }
}

/// Starts `replicas` simulated servers. With port 0 every replica gets its own ephemeral
/// port, otherwise ports `listen.port()..+replicas`. Must be called inside a tokio runtime;
/// every listener is bound before this returns.
pub fn start(
    config: SimConfig,
    listen: SocketAddr,
    replicas: usize,
    shutdown: Shutdown,
) -> Result<SimCluster, SimError> {
    start_with_oracle(config, listen, replicas, shutdown, None)
}

/// [`start`] with an already indexed oracle: when one is given it answers every request it
/// recognises, whatever `responder.kind` says (and `responder.oracle_dataset` is not read).
pub fn start_with_oracle(
    config: SimConfig,
    listen: SocketAddr,
    replicas: usize,
    shutdown: Shutdown,
    oracle: Option<Arc<Oracle>>,
) -> Result<SimCluster, SimError> {
    config.validate()?;
    let oracle = match (
        oracle,
        config.responder.kind,
        &config.responder.oracle_dataset,
    ) {
        (Some(o), _, _) => Some(o),
        (None, ResponderKind::Oracle, Some(path)) => {
            let dataset = crate::dataset::load(path, &crate::dataset::LoadOptions::default())?;
            Some(Arc::new(Oracle::new(Arc::new(dataset))?))
        }
        (None, ResponderKind::Oracle, None) => return Err(SimError::OracleMissing),
        (None, ResponderKind::Synthetic, _) => None,
    };
    let mut listeners = Vec::with_capacity(replicas);
    for i in 0..replicas {
        let port = if listen.port() == 0 {
            0
        } else {
            listen.port() + i as u16
        };
        let addr = SocketAddr::new(listen.ip(), port);
        let bind = || -> std::io::Result<tokio::net::TcpListener> {
            let l = std::net::TcpListener::bind(addr)?;
            l.set_nonblocking(true)?;
            tokio::net::TcpListener::from_std(l)
        };
        listeners.push(bind().map_err(|source| SimError::Bind { addr, source })?);
    }
    let (trace_tx, trace_writer) = match &config.trace_log {
        Some(path) => {
            let file = std::fs::File::create(path).map_err(|source| SimError::TraceLog {
                path: path.display().to_string(),
                source,
            })?;
            let (tx, rx) = mpsc::unbounded_channel();
            (Some(tx), Some(tokio::spawn(write_trace_log(file, rx))))
        }
        None => (None, None),
    };
    let created_base = config.created_base_unix.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0)
    });
    let config = Arc::new(config);
    let clock = SimClock::new(config.time_scale);
    let mut cluster = SimCluster {
        addrs: Vec::new(),
        names: Vec::new(),
        metrics: Vec::new(),
        tasks: Vec::new(),
        trace_writer,
    };
    for (i, listener) in listeners.into_iter().enumerate() {
        let name = format!("{}-{i}", config.name);
        let addr = listener.local_addr().map_err(|source| SimError::Bind {
            addr: listen,
            source,
        })?;
        let metrics = Arc::new(Metrics::new(
            &config.model,
            config.engine.block_size,
            config.engine.num_gpu_blocks,
            config.legacy_metrics,
        ));
        let (engine_tx, engine_rx) = mpsc::unbounded_channel();
        let engine = Engine::new(
            config.engine.clone(),
            clock,
            engine_rx,
            metrics.clone(),
            name.clone(),
            trace_tx.clone(),
        );
        let replica = Arc::new(http::Replica {
            name: name.clone(),
            config: config.clone(),
            clock,
            metrics: metrics.clone(),
            engine: engine_tx,
            oracle: oracle.clone(),
            created_base,
            next_seq: AtomicU64::new(0),
            shutdown: shutdown.clone(),
            responses: Arc::new(response_store::ResponseStore::new(
                config.responses_store_max,
                config.responses_store_max_bytes,
                metrics.clone(),
            )),
        });
        cluster.tasks.push(tokio::spawn(engine.run()));
        cluster.tasks.push(tokio::spawn(http::serve(
            listener,
            replica,
            shutdown.clone(),
        )));
        cluster.addrs.push(addr);
        cluster.names.push(name);
        cluster.metrics.push(metrics);
    }
    Ok(cluster)
}

/// Appends trace lines to the file, flushing whenever the queue runs dry.
async fn write_trace_log(file: std::fs::File, mut rx: mpsc::UnboundedReceiver<String>) {
    let mut out = std::io::BufWriter::new(file);
    while let Some(line) = rx.recv().await {
        let _ = writeln!(out, "{line}");
        while let Ok(line) = rx.try_recv() {
            let _ = writeln!(out, "{line}");
        }
        if let Err(e) = out.flush() {
            tracing::warn!(error = %e, "cannot write the trace log");
        }
    }
}
