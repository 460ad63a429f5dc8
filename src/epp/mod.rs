//! The endpoint picker (EPP) of the Gateway API Inference Extension: a gateway (Envoy) asks it
//! over the external-processing gRPC protocol which model server gets each request, and it
//! answers with the proxy's own placement (session keys, conversation fingerprint, bounded
//! load, session table, health checks), run by the proxy's code on the proxy's configuration.
//!
//! Stages: `listener` (accepted connections: cap, idle timeout, `TCP_NODELAY`) → `exchange`
//! (one ext_proc stream: headers, held body, placement, served endpoint) → `reply` (the
//! messages sent back); `cli` loads the configuration and reloads it on SIGHUP.
//! The endpoints are the config's `backends`, or the pods of an `InferencePool` followed by
//! `pool_watch` over `kube` (a small Kubernetes API client). The admin port (metrics,
//! sessions, drain) is the proxy's.

mod backoff;
pub(crate) mod cli;
mod exchange;
mod kube;
mod listener;
mod pool_metrics;
mod pool_watch;
mod reply;
mod selection;
mod workers;

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use futures_util::Stream;
use tokio::task::JoinHandle;
use tonic::{Request, Response, Status, Streaming};

use parking_lot::Mutex;

use crate::proxy::config::{BackendConfig, Secret};
use crate::proxy::{start_placement, Inner, Placement, ProxyConfig, ProxyError};
use crate::shutdown::Shutdown;

/// The gRPC health services the picker reports: the process is up; it can place requests; the
/// ext_proc service itself.
pub const HEALTH_SERVICES: [&str; 3] = [
    "liveness",
    "readiness",
    "envoy.service.ext_proc.v3.ExternalProcessor",
];

/// How long open ext_proc streams may finish after shutdown fired.
const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// Why the picker could not start.
#[derive(Debug, thiserror::Error)]
pub enum EppError {
    /// The configuration (shared with the proxy) is invalid, or a backend is not an endpoint.
    #[error("{0}")]
    Proxy(#[from] ProxyError),
    /// `backends[i].url` is not `http://IP:PORT`.
    #[error("config: backends[{index}].url: {reason}, got {url:?}")]
    Endpoint {
        /// Position in `backends`.
        index: usize,
        /// The URL.
        url: String,
        /// What is wrong.
        reason: &'static str,
    },
    /// `epp.inference_pool` cannot be used, or cannot change without a restart.
    #[error("config: {0}")]
    InferencePool(String),
    /// `epp.token_file` could not be read, or holds no token.
    #[error("config: epp.token_file: cannot use {path}: {reason}")]
    TokenFile {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The gRPC listener could not be bound.
    #[error("cannot listen on {addr} (epp listener): {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
}

impl EppError {
    /// True for errors in what the user supplied (exit code 2).
    pub fn is_config(&self) -> bool {
        match self {
            EppError::Proxy(e) => e.is_config(),
            EppError::Endpoint { .. } | EppError::InferencePool(_) | EppError::TokenFile { .. } => {
                true
            }
            EppError::Bind { .. } => false,
        }
    }
}

/// The endpoints come from one place: `backends`, or the pods of `epp.inference_pool`.
pub fn check_source(config: &ProxyConfig) -> Result<(), EppError> {
    if config.epp.inference_pool.is_some() && !config.backends.is_empty() {
        return Err(EppError::InferencePool(
            "backends: must be empty when epp.inference_pool is set (the endpoints are the pool's pods)".into(),
        ));
    }
    Ok(())
}

/// Every backend must be an endpoint the gateway can connect to: `http://IP:PORT`, no path.
pub fn check_endpoints(config: &ProxyConfig) -> Result<(), EppError> {
    for (index, b) in config.backends.iter().enumerate() {
        let bad = |reason| EppError::Endpoint {
            index,
            url: b.url.clone(),
            reason,
        };
        let url = crate::remote::ServerUrl::parse(&b.url).map_err(|_| bad("not a valid URL"))?;
        if url.tls {
            return Err(bad("an endpoint is plain http://IP:PORT"));
        }
        if url.authority.as_str().parse::<SocketAddr>().is_err() {
            return Err(bad("an endpoint is an IP address and a port"));
        }
        if !url.path.is_empty() {
            return Err(bad("an endpoint has no path"));
        }
    }
    Ok(())
}

/// Reads `epp.token_file`: the token every ext_proc stream must present, if any.
fn read_token(config: &ProxyConfig) -> Result<Option<Secret>, EppError> {
    let Some(path) = &config.epp.token_file else {
        return Ok(None);
    };
    let bad = |reason: String| EppError::TokenFile {
        path: path.clone(),
        reason,
    };
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    let token = text.trim();
    if token.is_empty() {
        return Err(bad("the file is empty".into()));
    }
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(bad("a token is printable ASCII with no spaces".into()));
    }
    Ok(Some(Secret(token.to_string())))
}

/// What every stream of the picker shares.
pub(crate) struct Picker {
    inner: Arc<Inner>,
    /// `epp.shed_in_flight`, reloadable.
    shed_in_flight: AtomicU64,
    /// `epp.in_flight_max_ms`, reloadable.
    in_flight_max_ms: AtomicU64,
    /// The token of `epp.token_file`, re-read on reload.
    token: Mutex<Option<Secret>>,
    /// `epp.selection_header` (restart to change).
    selection_header: Option<String>,
}

impl Picker {
    /// Whether `metadata` carries the bearer token, when one is required. Compared in
    /// constant time, so a client cannot find it byte by byte from response times.
    fn authorized(&self, metadata: &tonic::metadata::MetadataMap) -> bool {
        let token = self.token.lock();
        let Some(Secret(token)) = token.as_ref() else {
            return true;
        };
        let presented = metadata
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        presented.len() == token.len()
            && presented
                .bytes()
                .zip(token.bytes())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }

    /// Counts a refused stream and logs it, once per connection (each one is counted).
    fn refused(&self, reason: &'static str, why: &str, conn: Option<&listener::ConnState>) {
        self.inner.metrics().epp_refused(reason);
        match conn {
            Some(c) if c.first_refusal() => {
                tracing::warn!(peer = %c.peer, reason, "epp stream refused: {why}")
            }
            _ => tracing::debug!(reason, "epp stream refused: {why}"),
        }
    }
}

/// The status a stream ends with when the gateway's gRPC could not be read as ext_proc
/// messages; None when the stream broke (reset, connection lost) rather than being malformed.
fn unreadable(status: &Status) -> Option<Status> {
    use tonic::Code;
    // Formatted only for a malformed stream: a gateway's reset ends every stream it cancels.
    let message = || format!("malformed ext_proc message: {}", status.message());
    match status.code() {
        // tonic's decoder: protobuf that does not decode, a bad compressed flag, a message cut
        // short by the end of the stream.
        Code::Internal | Code::InvalidArgument => Some(Status::invalid_argument(message())),
        // A length prefix past the most a message may be.
        Code::OutOfRange | Code::ResourceExhausted => Some(Status::resource_exhausted(message())),
        Code::Unimplemented => Some(Status::unimplemented(message())),
        _ => None,
    }
}

/// Sleeps until `deadline`; for ever without one.
async fn until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

struct Service(Arc<Picker>);

/// A reply on its way to the gateway, with the body charge it carries (see
/// [`exchange::HeldCharge`]), dropped when the gRPC server takes the reply.
type Outgoing = (
    Result<ProcessingResponse, Status>,
    Option<exchange::HeldCharge>,
);

type ReplyStream = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Service {
    type ProcessStream = ReplyStream;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let conn = request
            .extensions()
            .get::<Arc<listener::ConnState>>()
            .cloned();
        if !self.0.authorized(request.metadata()) {
            let why = "no valid bearer token (epp.token_file)";
            self.0.refused("unauthenticated", why, conn.as_deref());
            return Err(Status::unauthenticated(why));
        }
        let state = StreamState::new(self.0.clone(), request.into_inner(), conn);
        // The gateway's messages are read and answered as the gRPC server asks for the next
        // reply, in its own task: no task of ours and no channel between them, which cost a
        // wake-up across threads on every message.
        let stream = futures_util::stream::unfold(state, |mut state| async move {
            let (item, charge) = state.next().await?;
            drop(charge);
            Some((item, state))
        });
        Ok(Response::new(Box::pin(stream)))
    }
}

/// One ext_proc stream: the exchange (and its in-flight count) lives as long as the
/// gateway's stream, its in-flight count at most `epp.in_flight_max_ms`.
struct StreamState {
    picker: Arc<Picker>,
    inbound: Streaming<ProcessingRequest>,
    exchange: exchange::Exchange,
    conn: Option<Arc<listener::ConnState>>,
    _open: Option<listener::OpenStream>,
    /// Replies to the last message not yet taken by the gRPC server.
    pending: std::collections::VecDeque<Outgoing>,
    /// The stream is over once `pending` is sent.
    ended: bool,
}

impl StreamState {
    fn new(
        picker: Arc<Picker>,
        inbound: Streaming<ProcessingRequest>,
        conn: Option<Arc<listener::ConnState>>,
    ) -> Self {
        Self {
            exchange: exchange::Exchange::new(picker.clone()),
            _open: conn.as_ref().map(|c| c.stream_opened()),
            picker,
            inbound,
            conn,
            pending: std::collections::VecDeque::new(),
            ended: false,
        }
    }

    /// The next reply to send, reading the gateway's messages until there is one; None when
    /// the stream is over.
    async fn next(&mut self) -> Option<Outgoing> {
        loop {
            if let Some(out) = self.pending.pop_front() {
                return Some(out);
            }
            if self.ended {
                return None;
            }
            self.read_one().await;
        }
    }

    /// Reads one message from the gateway (or lets the in-flight count expire) and queues
    /// its replies.
    async fn read_one(&mut self) {
        let picker = &self.picker;
        let longest = Duration::from_millis(picker.in_flight_max_ms.load(Ordering::Relaxed));
        let deadline = self.exchange.in_flight_until(longest);
        let next = tokio::select! {
            next = self.inbound.message() => next,
            _ = until(deadline) => {
                self.exchange.expire_in_flight();
                return;
            }
        };
        let msg = match next {
            Ok(Some(msg)) => msg,
            Ok(None) => {
                self.ended = true;
                return;
            }
            Err(status) => {
                if let Some(answer) = unreadable(&status) {
                    picker.refused("malformed_message", answer.message(), self.conn.as_deref());
                    self.pending.push_back((Err(answer), None));
                }
                self.ended = true;
                return;
            }
        };
        let replies = match self.exchange.on(msg) {
            Ok(replies) => replies,
            Err(e) => {
                let answer = Status::invalid_argument(format!("malformed ext_proc stream: {e}"));
                picker.refused("malformed_message", answer.message(), self.conn.as_deref());
                self.pending.push_back((Err(answer), None));
                self.ended = true;
                return;
            }
        };
        let mut charge = self.exchange.handed_on.take();
        let last = replies.len().saturating_sub(1);
        for (i, reply) in replies.into_iter().enumerate() {
            let charge = if i == last { charge.take() } else { None };
            self.pending.push_back((Ok(reply), charge));
        }
        self.ended = self.exchange.done;
    }
}

/// A running picker.
pub struct EppHandle {
    /// The gRPC listener (ext_proc and health).
    pub addr: SocketAddr,
    /// The admin listener (`/metrics`, `/admin/*`), as the proxy's.
    pub admin_addr: SocketAddr,
    shared: Arc<Shared>,
    server: workers::Workers,
    watcher: Option<JoinHandle<()>>,
}

/// What the handle, SIGHUP reloads and the pool watch share.
struct Shared {
    picker: Arc<Picker>,
    placement: Placement,
    /// The configuration as loaded (no `backends` when they come from a pool) and the pool's
    /// current endpoints; one lock so a reload and a pod change never interleave.
    running: Mutex<Running>,
}

struct Running {
    file: ProxyConfig,
    pods: Vec<BackendConfig>,
}

impl Running {
    /// The configuration placement runs on: the file's, with the pool's pods as backends.
    fn effective(&self) -> ProxyConfig {
        let mut config = self.file.clone();
        if config.epp.inference_pool.is_some() {
            config.backends = self.pods.clone();
        }
        config
    }
}

impl Shared {
    /// Applies the pool's new endpoint set as a reload would, without counting a reload;
    /// true when the pool has an endpoint to place on.
    fn apply_pods(&self, pods: Vec<BackendConfig>) -> bool {
        let mut running = self.running.lock();
        let previous = std::mem::replace(&mut running.pods, pods);
        if let Err(e) = self.placement.apply_endpoints(running.effective()) {
            tracing::error!(error = %e, "InferencePool endpoints refused; keeping the previous ones");
            running.pods = previous;
        }
        !running.pods.is_empty()
    }
}

/// The metrics the listener counts its refusals in: the placement's.
fn placement_metrics(shared: &Shared) -> crate::proxy::metrics::ProxyMetrics {
    shared.picker.inner.metrics().clone()
}

/// Binds `listen` and starts serving ext_proc and gRPC health, placing over `config`'s
/// backends, or over the pods of `epp.inference_pool`; stops when `shutdown` fires.
pub async fn start(
    listen: SocketAddr,
    config: ProxyConfig,
    shutdown: Shutdown,
) -> Result<EppHandle, EppError> {
    check_source(&config)?;
    check_endpoints(&config)?;
    config.validate().map_err(ProxyError::from)?;
    let target = config
        .epp
        .inference_pool
        .as_ref()
        .map(pool_watch::Target::resolve)
        .transpose()
        .map_err(EppError::InferencePool)?;
    let shed = config.epp.shed_in_flight;
    let token = read_token(&config)?;
    let limits = listener::Limits {
        max_connections: config.epp.max_connections,
        idle: Duration::from_millis(config.epp.idle_timeout_ms),
    };
    let tcp = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|source| EppError::Bind {
            addr: listen,
            source,
        })?;
    let addr = tcp.local_addr().map_err(|source| EppError::Bind {
        addr: listen,
        source,
    })?;
    let placement = start_placement(config.clone(), shutdown.clone()).await?;
    let picker = Arc::new(Picker {
        inner: placement.inner.clone(),
        shed_in_flight: AtomicU64::new(shed),
        in_flight_max_ms: AtomicU64::new(config.epp.in_flight_max_ms),
        token: Mutex::new(token),
        selection_header: config.epp.selection_header.clone(),
    });
    let admin_addr = placement.admin_addr;
    let shared = Arc::new(Shared {
        picker: picker.clone(),
        placement,
        running: Mutex::new(Running {
            file: config,
            pods: Vec::new(),
        }),
    });
    let from_pool = target.is_some();
    // Whether the pool has a ready endpoint, for the readiness service.
    let (ready_tx, ready_rx) = tokio::sync::watch::channel(false);
    let watcher = target.map(|target| {
        tracing::info!(pool = %target.config.name, namespace = %target.namespace, "endpoints from an InferencePool");
        let weak = Arc::downgrade(&shared);
        let metrics = pool_metrics::WatchMetrics::new(shared.placement.inner.metrics());
        tokio::spawn(pool_watch::run(
            target,
            move |pods| {
                if let Some(shared) = weak.upgrade() {
                    ready_tx.send_replace(shared.apply_pods(pods));
                }
            },
            metrics,
            shutdown.clone(),
        ))
    });
    let (reporter, health) = tonic_health::server::health_reporter();
    for service in HEALTH_SERVICES {
        // From a pool, not ready until its first ready endpoint is known.
        let status = if from_pool && service == "readiness" {
            tonic_health::ServingStatus::NotServing
        } else {
            tonic_health::ServingStatus::Serving
        };
        reporter.set_service_status(service, status).await;
    }
    if from_pool {
        tokio::spawn(report_readiness(reporter, ready_rx, shutdown.clone()));
    }
    let service = ExternalProcessorServer::new(Service(picker));
    let routes = tonic::service::Routes::new(health).add_service(service);
    let conns = listener::incoming(
        tcp,
        limits,
        placement_metrics(&shared),
        shutdown.clone(),
        crate::proxy::worker_count(&shared.running.lock().file),
    );
    let server = workers::Workers::start(conns, routes, shutdown);
    tracing::info!(%addr, %admin_addr, "epp listening");
    Ok(EppHandle {
        addr,
        admin_addr,
        shared,
        server,
        watcher,
    })
}

/// Keeps the `readiness` health service SERVING exactly while the pool has a ready endpoint.
async fn report_readiness(
    reporter: tonic_health::server::HealthReporter,
    mut ready: tokio::sync::watch::Receiver<bool>,
    mut shutdown: Shutdown,
) {
    loop {
        tokio::select! {
            _ = shutdown.wait() => return,
            changed = ready.changed() => if changed.is_err() { return },
        }
        let status = if *ready.borrow_and_update() {
            tonic_health::ServingStatus::Serving
        } else {
            tonic_health::ServingStatus::NotServing
        };
        reporter.set_service_status("readiness", status).await;
    }
}

impl EppHandle {
    /// Applies a new configuration's endpoints and settings; an invalid one is refused (and
    /// counted in `agentrace_config_reloads_total{result="refused"}`) and the running one
    /// stays. With `epp.inference_pool`, the pool's current pods stay the endpoints; the pool
    /// itself changes only with a restart.
    pub fn reload(&self, config: ProxyConfig) -> Result<(), EppError> {
        let mut running = self.shared.running.lock();
        let checked = check_source(&config)
            .and_then(|()| check_endpoints(&config))
            .and_then(|()| {
                if config.epp.inference_pool != running.file.epp.inference_pool {
                    return Err(EppError::InferencePool(
                        "epp.inference_pool: changes need a restart".into(),
                    ));
                }
                Ok(())
            });
        if let Err(e) = checked {
            self.shared.placement.note_refused_reload();
            return Err(e);
        }
        let token = match read_token(&config) {
            Ok(token) => token,
            Err(e) => {
                self.shared.placement.note_refused_reload();
                return Err(e);
            }
        };
        if (config.epp.max_connections, config.epp.idle_timeout_ms)
            != (
                running.file.epp.max_connections,
                running.file.epp.idle_timeout_ms,
            )
        {
            tracing::warn!("epp.max_connections and epp.idle_timeout_ms changes need a restart; keeping the running values");
        }
        if config.epp.selection_header != running.file.epp.selection_header {
            tracing::warn!(
                "epp.selection_header changes need a restart; keeping the running value"
            );
        }
        let shed = config.epp.shed_in_flight;
        let in_flight_max_ms = config.epp.in_flight_max_ms;
        let previous = std::mem::replace(&mut running.file, config);
        if let Err(e) = self.shared.placement.reload(running.effective()) {
            running.file = previous;
            return Err(e.into());
        }
        let picker = &self.shared.picker;
        picker.shed_in_flight.store(shed, Ordering::Relaxed);
        picker
            .in_flight_max_ms
            .store(in_flight_max_ms, Ordering::Relaxed);
        *picker.token.lock() = token;
        Ok(())
    }

    /// Counts a reload refused before it reached [`EppHandle::reload`] (unreadable or
    /// invalid file).
    pub fn note_refused_reload(&self) {
        self.shared.placement.note_refused_reload();
    }

    /// The endpoints currently in the pool, as `ip:port`.
    pub fn endpoints(&self) -> Vec<String> {
        self.shared
            .picker
            .inner
            .router()
            .pool()
            .backends
            .iter()
            .map(|b| b.url.server.authority.to_string())
            .collect()
    }

    /// Resolves once the server and the side tasks have stopped (after shutdown fired). A
    /// gateway keeps its gRPC connection open, so streams still open after
    /// `SHUTDOWN_GRACE` are cut.
    pub async fn join(self) {
        self.server.join(SHUTDOWN_GRACE).await;
        if let Some(watcher) = self.watcher {
            let _ = watcher.await;
        }
        // The watcher held a weak reference only; the streams' pickers are the router's.
        match Arc::try_unwrap(self.shared) {
            Ok(shared) => shared.placement.join().await,
            Err(_) => {
                tracing::warn!("epp state still shared at shutdown; not waiting for its side tasks")
            }
        }
    }
}
