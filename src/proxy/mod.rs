//! The affinity proxy: pins each agent session to one backend and streams responses through.
//!
//! Stages: `listener` (accept, TLS) → `ingress` (HTTP/1.1 client connections, on the crate's
//! `http1` codec; `arrival` stamps a request with its first byte's kernel
//! receive time; `ingress_h2` serves HTTP/2) → `routing` (session key, rendezvous pick,
//! bindings) → `upstream` (failover; `forwarded` adds the proxy's hop to the request's
//! headers) over `pool` (per-worker keep-alive connections, which `view` hands each request
//! with its worker's copy of the backend pool; `continued` sends a Responses request to the
//! backend that holds the response it continues) → `observed` (the response body,
//! streamed), which reports each exchange through the crate's [`tap`](crate::tap) (frame
//! observers for the recorder); `health` and `admin` (with `metrics`) run beside them.

pub(crate) mod admin;
pub(crate) mod arrival;
pub(crate) mod budget;
pub(crate) mod capacity;
pub(crate) mod cli;
pub mod config;
pub(crate) mod continued;
pub(crate) mod fields;
pub(crate) mod forwarded;
pub(crate) mod health;
pub(crate) mod held_body;
pub(crate) mod ingress;
pub(crate) mod ingress_h2;
pub(crate) mod listener;
pub(crate) mod metrics;
pub(crate) mod observed;
pub(crate) mod pool;
pub(crate) mod routing;
pub(crate) mod upstream;
pub(crate) mod view;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use tokio::task::JoinHandle;

pub use config::{ConfigError, Policy, ProxyConfig};

use crate::capture::{CaptureError, Recorder};
use crate::shutdown::Shutdown;
use crate::tap::ExchangeSink;
use metrics::ProxyMetrics;
use routing::{AffinitySettings, Backend, Pool, Router};

/// Why the proxy could not start (or a reload was refused).
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The configuration is invalid.
    #[error("config: {0}")]
    Config(#[from] ConfigError),
    /// A TLS file is missing or unusable.
    #[error("TLS file {}: {reason}", file.display())]
    Tls {
        /// The file.
        file: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A listener could not be bound.
    #[error("cannot listen on {addr} ({what}): {source}")]
    Bind {
        /// Which listener.
        what: &'static str,
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// The recorder could not start.
    #[error("capture: {0}")]
    Capture(#[from] CaptureError),
    /// Anything else (a library refused a setting).
    #[error("{0}")]
    Internal(String),
}

impl From<crate::remote::TlsConfigError> for ProxyError {
    fn from(e: crate::remote::TlsConfigError) -> Self {
        match e {
            crate::remote::TlsConfigError::CaFile { path, reason } => {
                ProxyError::Tls { file: path, reason }
            }
            e @ crate::remote::TlsConfigError::Rustls(_) => ProxyError::Internal(e.to_string()),
        }
    }
}

impl ProxyError {
    /// True for errors in what the user supplied (exit code 2), as opposed to the environment.
    pub fn is_config(&self) -> bool {
        matches!(self, ProxyError::Config(_) | ProxyError::Tls { .. })
    }
}

/// State shared by the listener, the health checker and the admin API.
pub struct Inner {
    router: Router,
    /// Connections for health probes: a pool of their own on the caller's runtime, speaking
    /// the forwarding path's HTTP/1.1 and TLS, so a backend passes its probes only if
    /// forwarding can talk to it too.
    probe_pool: RwLock<Arc<pool::WorkerPool>>,
    /// Per forwarding worker, what its requests read: the pool, and its own upstream
    /// connections, which live on its thread.
    workers: view::WorkerViews,
    metrics: ProxyMetrics,
    sink: Option<Arc<dyn ExchangeSink>>,
    recorder: Mutex<Option<Recorder>>,
    max_request_body: u64,
    /// Request body bytes held by all requests together (`request_body_budget_bytes`).
    body_budget: budget::BodyBudget,
    client_limits: ingress::ClientLimits,
    retries: AtomicU32,
    /// This instance's name in `Via`, on forwarded requests and health probes.
    via: forwarded::Via,
    config: Mutex<ProxyConfig>,
}

/// A running proxy.
pub struct ProxyHandle {
    /// Address of the proxy listener.
    pub addr: SocketAddr,
    /// Address of the admin listener (`/metrics`, `/admin/*`).
    pub admin_addr: SocketAddr,
    inner: Arc<Inner>,
    listener: JoinHandle<()>,
    side_tasks: Vec<JoinHandle<()>>,
}

fn build_pool(config: &ProxyConfig, metrics: &ProxyMetrics, previous: Option<&Pool>) -> Pool {
    let old: HashMap<&str, &Arc<Backend>> = previous
        .map(|p| p.backends.iter().map(|b| (&*b.name, b)).collect())
        .unwrap_or_default();
    let backends = config
        .backends
        .iter()
        .map(|b| {
            let url = config::BackendUrl::parse(&b.url).expect("validated");
            match old.get(b.name.as_str()) {
                // Same name, URL and weight: keep the live state (in flight, health, drain).
                Some(existing) if existing.url == url && existing.weight == b.weight => {
                    Arc::clone(existing)
                }
                _ => Arc::new(Backend::new(
                    &b.name,
                    url,
                    b.weight,
                    metrics.backend(&b.name),
                )),
            }
        })
        .collect();
    metrics.keep_backends(config.backends.iter().map(|b| b.name.as_str()));
    Pool {
        backends,
        affinity: AffinitySettings::from_config(&config.affinity),
        health: config.health.clone(),
    }
}

pub(crate) fn worker_count(config: &ProxyConfig) -> usize {
    match config.workers {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    }
}

fn any_https(config: &ProxyConfig) -> bool {
    config.backends.iter().any(|b| b.url.starts_with("https:"))
}

fn probe_pool(config: &ProxyConfig) -> Result<Arc<pool::WorkerPool>, ProxyError> {
    pool::connection_pool(&config.upstream, any_https(config)).map(Arc::new)
}

fn worker_pools(
    config: &ProxyConfig,
    workers: usize,
) -> Result<Vec<Arc<pool::WorkerPool>>, ProxyError> {
    (0..workers)
        .map(|_| pool::connection_pool(&config.upstream, any_https(config)).map(Arc::new))
        .collect()
}

/// Validates `config`, binds both listeners and starts serving; resolves once bound. With
/// `capture.enabled`, the recorder is started and every exchange is reported to it.
pub async fn start(config: ProxyConfig, shutdown: Shutdown) -> Result<ProxyHandle, ProxyError> {
    start_inner(config, shutdown, None).await
}

/// Like [`start`], reporting every exchange to `sink` instead of a recorder (tests, embedding).
pub async fn start_with_sink(
    config: ProxyConfig,
    shutdown: Shutdown,
    sink: Arc<dyn ExchangeSink>,
) -> Result<ProxyHandle, ProxyError> {
    start_inner(config, shutdown, Some(sink)).await
}

/// The placement half of the proxy without its HTTP listener: the router over the configured
/// backends, their health checks, housekeeping and the admin API (metrics, sessions, drain).
/// `agentrace epp` places requests for a gateway with it, so both modes share one placement.
pub(crate) struct Placement {
    /// Address of the admin listener.
    pub admin_addr: SocketAddr,
    /// The shared state the router, health checks and admin API run on.
    pub inner: Arc<Inner>,
    tasks: Vec<JoinHandle<()>>,
}

impl Placement {
    /// Applies a new configuration's backends and settings, as [`ProxyHandle::reload`] does.
    pub(crate) fn reload(&self, config: ProxyConfig) -> Result<(), ProxyError> {
        let result = self.inner.reload(config);
        self.inner.metrics.reload(result.is_ok());
        result
    }

    /// Counts a reload refused before it reached [`Placement::reload`] (unreadable file, an
    /// endpoint the picker cannot use).
    pub(crate) fn note_refused_reload(&self) {
        self.inner.metrics.reload(false);
    }

    /// Applies `config` as [`Placement::reload`] does, without counting a configuration
    /// reload: the picker's endpoint set changed (pods of its `InferencePool`).
    pub(crate) fn apply_endpoints(&self, config: ProxyConfig) -> Result<(), ProxyError> {
        self.inner.reload(config)
    }

    /// Resolves once the side tasks have stopped (after `shutdown` fired).
    pub(crate) async fn join(self) {
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

/// Starts [`Placement`] for `config` (validated here); its tasks stop when `shutdown` fires.
pub(crate) async fn start_placement(
    mut config: ProxyConfig,
    mut shutdown: Shutdown,
) -> Result<Placement, ProxyError> {
    config.validate()?;
    config.resolve_token_file()?;
    config.validate()?;
    let probe_pool = probe_pool(&config)?;
    let addr = config.admin.listen;
    let admin_tcp = listen(addr, 128, false).map_err(|source| ProxyError::Bind {
        what: "admin listener",
        addr,
        source,
    })?;
    let admin_addr = admin_tcp.local_addr().map_err(|source| ProxyError::Bind {
        what: "admin listener",
        addr,
        source,
    })?;
    let inner = new_inner(config, probe_pool, Vec::new(), None, None);
    let (stop_side, side_stop) = crate::shutdown::channel();
    let mut tasks = vec![
        tokio::spawn(health::run(inner.clone(), side_stop.clone())),
        tokio::spawn(admin::serve(admin_tcp, inner.clone(), side_stop.clone())),
        tokio::spawn(housekeeping(inner.clone(), side_stop)),
    ];
    tasks.push(tokio::spawn(async move {
        shutdown.wait().await;
        stop_side.fire();
    }));
    Ok(Placement {
        admin_addr,
        inner,
        tasks,
    })
}

/// The shared state over `config`'s backends: one construction for the proxy and the picker.
fn new_inner(
    config: ProxyConfig,
    probe_pool: Arc<pool::WorkerPool>,
    worker_pools: Vec<Arc<pool::WorkerPool>>,
    sink: Option<Arc<dyn ExchangeSink>>,
    recorder: Option<Recorder>,
) -> Arc<Inner> {
    let metrics = ProxyMetrics::new();
    metrics.set_max_backend_series(config.admin.max_backend_series);
    let pool = build_pool(&config, &metrics, None);
    let router = Router::new(
        pool,
        config.affinity.max_sessions,
        Duration::from_secs(config.affinity.session_ttl_secs),
    );
    router
        .sessions
        .set_active_window(Duration::from_secs_f64(config.affinity.active_secs));
    let workers = view::WorkerViews::new(&router.pool(), worker_pools, &router.sessions);
    Arc::new(Inner {
        router,
        probe_pool: RwLock::new(probe_pool),
        workers,
        metrics,
        sink,
        recorder: Mutex::new(recorder),
        max_request_body: config.max_request_body_bytes,
        body_budget: budget::BodyBudget::new(config.request_body_budget_bytes),
        client_limits: ingress::ClientLimits::from(&config.client),
        retries: AtomicU32::new(config.upstream.retries),
        via: forwarded::Via::new(),
        config: Mutex::new(config),
    })
}

async fn start_inner(
    mut config: ProxyConfig,
    shutdown: Shutdown,
    sink: Option<Arc<dyn ExchangeSink>>,
) -> Result<ProxyHandle, ProxyError> {
    // Validate before touching the file system, then again to check the token it held.
    config.validate()?;
    require_backends(&config)?;
    config.resolve_token_file()?;
    config.validate()?;
    let tls = config
        .tls
        .as_ref()
        .map(listener::tls_acceptor)
        .transpose()?;
    let probe_pool = probe_pool(&config)?;
    let workers = worker_count(&config);
    let worker_pools = worker_pools(&config, workers)?;

    let bind = |what: &'static str, addr: SocketAddr, backlog: u32, stamp: bool| {
        listen(addr, backlog, stamp).map_err(|source| ProxyError::Bind { what, addr, source })
    };
    // With a recorder on, the kernel stamps every client connection's arrivals, set before
    // the socket listens: a connection accepted earlier would inherit no stamping.
    let stamp = config.capture.enabled || sink.is_some();
    let tcp = bind(
        "proxy listener",
        config.listen,
        config.listen_backlog,
        stamp,
    )?;
    // Scrapes and admin calls come a few at a time.
    let admin_tcp = bind("admin listener", config.admin.listen, 128, false)?;
    let local = |l: &tokio::net::TcpListener, what: &'static str, addr: SocketAddr| {
        l.local_addr()
            .map_err(|source| ProxyError::Bind { what, addr, source })
    };
    let addr = local(&tcp, "proxy listener", config.listen)?;
    let admin_addr = local(&admin_tcp, "admin listener", config.admin.listen)?;

    let recorder = if config.capture.enabled && sink.is_none() {
        Some(Recorder::start(&config.capture)?)
    } else {
        None
    };
    let sink = sink.or_else(|| recorder.as_ref().map(|r| r.sink.clone()));

    let grace = Duration::from_secs(config.shutdown_grace_secs);
    let inner = new_inner(config, probe_pool, worker_pools, sink, recorder);

    let (stop_side, side_stop) = crate::shutdown::channel();
    let side_tasks = vec![
        tokio::spawn(health::run(inner.clone(), side_stop.clone())),
        tokio::spawn(admin::serve(admin_tcp, inner.clone(), side_stop.clone())),
        tokio::spawn(housekeeping(inner.clone(), side_stop)),
    ];
    // The admin API and health checks keep running through the drain and stop after it, so
    // dropping the handle without joining leaves a fully working proxy.
    let listener = tokio::spawn({
        let inner = inner.clone();
        async move {
            listener::serve(tcp, workers, tls, inner, shutdown, grace).await;
            stop_side.fire();
        }
    });
    tracing::info!(%addr, %admin_addr, backends = inner.router.pool().backends.len(), "proxy listening");
    Ok(ProxyHandle {
        addr,
        admin_addr,
        inner,
        listener,
        side_tasks,
    })
}

/// The proxy forwards to `backends` only: `epp.inference_pool`, which lets the list be empty,
/// is read by `agentrace epp`.
fn require_backends(config: &ProxyConfig) -> Result<(), ProxyError> {
    if config.backends.is_empty() {
        return Err(ConfigError::Invalid(
            "backends: at least one backend is required (epp.inference_pool is read by agentrace epp only), got none".into(),
        )
        .into());
    }
    Ok(())
}

/// A listening socket on `addr` whose accept queue holds `backlog` connections (tokio's and
/// std's `bind` ask for 128), whose connections' arrivals the kernel stamps if `stamp`.
fn listen(addr: SocketAddr, backlog: u32, stamp: bool) -> std::io::Result<tokio::net::TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    // As `TcpListener::bind` does: a restarted proxy binds while old connections linger.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    if stamp && !arrival::enable(&socket) {
        tracing::debug!("no kernel receive timestamps: requests are stamped when read");
    }
    socket.listen(backlog)
}

/// Sweeps idle sessions and upstream connections, so neither grows between scrapes.
async fn housekeeping(inner: Arc<Inner>, mut stop: Shutdown) {
    let period = Duration::from_secs(5);
    let mut next = tokio::time::Instant::now() + period;
    loop {
        tokio::select! {
            _ = stop.wait() => return,
            _ = tokio::time::sleep_until(next) => {}
        }
        inner.router.sessions.sweep();
        for pool in inner.workers.upstream_pools() {
            pool.reap();
        }
        inner.probe_pool.read().reap();
        next += period;
    }
}

impl Inner {
    /// The router: the pool, the session table and placement.
    pub(crate) fn router(&self) -> &Router {
        &self.router
    }

    /// The metric handles the admin port renders.
    pub(crate) fn metrics(&self) -> &ProxyMetrics {
        &self.metrics
    }

    /// `max_request_body_bytes`: the most body bytes held for one request.
    pub(crate) fn max_request_body(&self) -> u64 {
        self.max_request_body
    }

    /// The budget every held request body counts against (`request_body_budget_bytes`).
    pub(crate) fn body_budget(&self) -> &budget::BodyBudget {
        &self.body_budget
    }

    /// Swaps in the backend list and affinity/health/upstream settings of `config`; listener
    /// addresses, TLS and the admin token need a restart and are left as they are.
    fn reload(&self, config: ProxyConfig) -> Result<(), ProxyError> {
        config.validate()?;
        let mut current = self.config.lock();
        if config.listen != current.listen
            || config.listen_backlog != current.listen_backlog
            || config.tls != current.tls
            || config.admin != current.admin
            || config.capture != current.capture
            || config.max_request_body_bytes != current.max_request_body_bytes
            || config.request_body_budget_bytes != current.request_body_budget_bytes
            || config.client != current.client
            || config.workers != current.workers
        {
            tracing::warn!("listen, listen_backlog, tls, client, admin, capture, workers, max_request_body_bytes and request_body_budget_bytes changes need a restart; keeping the running values");
        }
        let probe_pool = probe_pool(&config)?;
        let worker_pools = worker_pools(&config, self.workers.len())?;
        let pool = build_pool(&config, &self.metrics, Some(&self.router.pool()));
        self.router.sessions.set_limits(
            config.affinity.max_sessions,
            Duration::from_secs(config.affinity.session_ttl_secs),
        );
        self.router
            .sessions
            .set_active_window(Duration::from_secs_f64(config.affinity.active_secs));
        *self.probe_pool.write() = probe_pool;
        self.retries
            .store(config.upstream.retries, Ordering::Relaxed);
        self.workers.replace(&pool, worker_pools);
        self.router.replace_pool(pool);
        current.backends = config.backends;
        current.affinity = config.affinity;
        current.health = config.health;
        current.upstream = config.upstream;
        current.epp = config.epp;
        Ok(())
    }
}

impl ProxyHandle {
    /// Applies a new configuration's backends and affinity settings without dropping traffic;
    /// an invalid one is refused and the running one stays.
    pub fn reload(&self, config: ProxyConfig) -> Result<(), ProxyError> {
        let result = require_backends(&config).and_then(|()| self.inner.reload(config));
        self.inner.metrics.reload(result.is_ok());
        result
    }

    /// Counts a reload refused before it reached [`ProxyHandle::reload`] (unreadable file).
    pub fn note_refused_reload(&self) {
        self.inner.metrics.reload(false);
    }

    /// Names of the backends currently in the pool.
    pub fn backend_names(&self) -> Vec<String> {
        self.inner
            .router
            .pool()
            .backends
            .iter()
            .map(|b| b.name.to_string())
            .collect()
    }

    /// Resolves after shutdown: the listener stopped, in-flight streams drained (up to the
    /// grace period), side tasks stopped and the recorder finished.
    pub async fn join(self) {
        if let Err(e) = self.listener.await {
            tracing::error!(error = %e, "proxy listener task failed");
        }
        for t in self.side_tasks {
            let _ = t.await;
        }
        let recorder = self.inner.recorder.lock().take();
        if let Some(recorder) = recorder {
            recorder.finish().await;
        }
        tracing::info!(addr = %self.addr, "proxy stopped");
    }
}
