//! The proxy's configuration: one TOML document, parsed strictly and validated before any port.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::capture::CaptureConfig;
use crate::remote::{ServerUrl, UrlError};

/// Header names tried in order when no `affinity.headers` is configured: the generic MLPerf /
/// OpenCode header first, then the router- and agent-specific ones.
pub const DEFAULT_SESSION_HEADERS: [&str; 5] = [
    "x-session-id",
    "x-dynamo-session-id",
    "x-smg-routing-key",
    "x-claude-code-session-id",
    "session-id",
];

/// Everything `agentrace proxy` needs; see `config/proxy.toml` for a commented example.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProxyConfig {
    /// Address agents connect to (HTTP/1.1 and h2c, or TLS when `[tls]` is set). Port 0 picks one.
    pub listen: SocketAddr,
    /// Connections the kernel queues for the accept loop. A connect burst beyond the queue has
    /// its SYNs dropped and retried a second later, so the default is far above the 128 many
    /// servers use; Linux caps it at `net.core.somaxconn`.
    pub listen_backlog: u32,
    /// Largest request body accepted; bigger ones get `413`. The body is held for the session
    /// fingerprint and for a retry, so this bounds the proxy's memory per request.
    pub max_request_body_bytes: u64,
    /// Request body bytes all requests together may hold at once (HTTP/1.1 and HTTP/2), so
    /// that many clients each sending an allowed body cannot exhaust memory. Bodies are counted
    /// as their bytes arrive; a body past its first 64 KiB that would take the total over this
    /// gets `503` with `Retry-After`.
    pub request_body_budget_bytes: u64,
    /// How long in-flight requests and streams may run after SIGINT/SIGTERM before the proxy exits.
    pub shutdown_grace_secs: u64,
    /// Forwarding threads, each with its own single-threaded runtime and upstream pool, taking
    /// new connections from one accept loop, so a request never hops threads (0: one per core).
    pub workers: usize,
    /// Ingress TLS termination; absent means plain HTTP.
    pub tls: Option<TlsConfig>,
    /// How long the proxy waits on agents' connections.
    pub client: ClientConfig,
    /// Metrics and admin API listener.
    pub admin: AdminConfig,
    /// How the proxy talks to the backends.
    pub upstream: UpstreamConfig,
    /// Session keys and placement.
    pub affinity: AffinityConfig,
    /// Active and passive health checking.
    pub health: HealthConfig,
    /// The inference servers, in any order (placement does not depend on the order).
    pub backends: Vec<BackendConfig>,
    /// The recorder behind the proxy.
    pub capture: CaptureConfig,
    /// `agentrace epp`, the endpoint picker behind a gateway (ignored by the proxy).
    pub epp: EppConfig,
}

/// Settings only the endpoint picker reads; its endpoints are `backends`, whose URLs must then
/// be `http://IP:PORT` (what the gateway connects to), or the pods of `inference_pool`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EppConfig {
    /// A request is shed (`429`) when every endpoint it may go to already has this many
    /// requests in flight through the picker (0: never shed).
    pub shed_in_flight: u64,
    /// Most gRPC connections open at once; one more is closed as soon as accepted. A gateway
    /// needs a few per worker thread: the cap bounds descriptors and memory, not throughput.
    pub max_connections: usize,
    /// A gRPC connection that reads nothing and has no ext_proc stream open this long is
    /// closed (a gateway reconnects when it next needs one).
    pub idle_timeout_ms: u64,
    /// Longest a placed request counts in flight when the gateway never reports its end (a
    /// stream left open), so one stuck stream cannot skew bounded load and `shed_in_flight`
    /// for ever. Above the longest generation a backend serves.
    pub in_flight_max_ms: u64,
    /// File holding a bearer token every ext_proc stream must present
    /// (`authorization: Bearer TOKEN`, set in the gateway's `grpc_service.initial_metadata`);
    /// re-read on reload. Absent: no token, for a picker reachable from its gateway only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_file: Option<PathBuf>,
    /// Endpoints from a Kubernetes `InferencePool` instead of `backends` (which must then be
    /// empty): the ready pods its selector matches, at each of its target ports.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inference_pool: Option<InferencePoolConfig>,
    /// A request header naming the endpoints a request must go to (`ip:port` or `ip`,
    /// comma-separated), for the Gateway API Inference Extension's conformance suite, which
    /// sends `test-epp-endpoint-selection`. Absent: off, since any client could steer its own
    /// requests with it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub selection_header: Option<String>,
}

impl Default for EppConfig {
    fn default() -> Self {
        Self {
            shed_in_flight: 0,
            max_connections: 1024,
            idle_timeout_ms: 300_000,
            in_flight_max_ms: 600_000,
            token_file: None,
            inference_pool: None,
            selection_header: None,
        }
    }
}

/// Where the picker reads its `InferencePool` and the pods it selects.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InferencePoolConfig {
    /// The `InferencePool`'s name (`inference.networking.k8s.io/v1`).
    pub name: String,
    /// Its namespace; absent: the pod's own, from the service account's `namespace` file.
    #[serde(default)]
    pub namespace: Option<String>,
    /// The API server, `https://host:port` (or `http://` on a loopback address, for tests and
    /// `kubectl proxy`); absent: `https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`.
    #[serde(default)]
    pub api_server: Option<String>,
    /// Bearer token, re-read at every (re)connection so a rotated token is picked up. The
    /// service account's by default; a missing file is an error over https only.
    #[serde(default = "default_sa_token")]
    pub token_file: PathBuf,
    /// CA bundle that verifies an https API server. The service account's by default.
    #[serde(default = "default_sa_ca")]
    pub ca_file: PathBuf,
    /// Most pods the selector may match; a list or watch beyond it is an error (retried), so
    /// memory stays bounded.
    #[serde(default = "default_max_pods")]
    pub max_pods: usize,
    /// Longest watch event (one JSON line) or pool object accepted, bytes.
    #[serde(default = "default_max_event_bytes")]
    pub max_event_bytes: usize,
}

/// The service account's files, mounted into every pod.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

fn default_sa_token() -> PathBuf {
    Path::new(SERVICE_ACCOUNT_DIR).join("token")
}

fn default_sa_ca() -> PathBuf {
    Path::new(SERVICE_ACCOUNT_DIR).join("ca.crt")
}

fn default_max_pods() -> usize {
    10_000
}

fn default_max_event_bytes() -> usize {
    1024 * 1024
}

/// Ingress TLS: PEM certificate chain and private key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM file with the certificate chain, leaf first.
    pub cert_file: PathBuf,
    /// PEM file with the private key (PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
}

/// Time limits on the agents' side, so a client that stalls or idles cannot hold a connection
/// (and its task, its buffers and, while a response is under way, a backend) for ever. None
/// applies while a backend works on a request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClientConfig {
    /// A request head must be complete this long after its first byte (or, on a new
    /// connection, after the connection opened); otherwise `408` and the connection closes.
    pub header_timeout_ms: u64,
    /// While a request body is read, each read must bring bytes within this; otherwise `408`.
    pub body_timeout_ms: u64,
    /// A keep-alive connection with no request in progress (HTTP/2: no open stream) is
    /// closed after this long. Above the 4-5 s after which agents' HTTP clients (httpx,
    /// undici) drop idle connections themselves, so the proxy never closes one a client is
    /// about to reuse.
    pub idle_timeout_ms: u64,
    /// While a response is written, the client must take some of it within this; otherwise the
    /// connection closes and the upstream request is cancelled, so a client that stops reading
    /// a stream does not hold a backend's generation.
    pub send_timeout_ms: u64,
    /// Client connections open at once. One more is answered `503` with `Retry-After` (plain
    /// HTTP; a TLS one is closed) and closed at once, with no task, buffer or handshake spent
    /// on it, so a flood of connections cannot take the proxy's file descriptors or memory.
    pub max_connections: usize,
    /// TLS handshakes past their ClientHello that may run at once on the listener (with
    /// `[tls]`). Each costs most of a millisecond of CPU; beyond this, a new one waits for a
    /// free permit within its 10 s handshake deadline, then is closed. A ClientHello is read
    /// without a permit, so clients that send theirs slowly hold none.
    pub max_tls_handshakes: usize,
    /// A graceful close waits this long for the client at most, then the connection is
    /// dropped: HTTP/2 once it has no open stream after its GOAWAY (a client that never
    /// acknowledges the PING, or never sends its preface, would otherwise hold it for ever);
    /// HTTP/1.1 for its TLS close and, after a refused request, for the client to hang up.
    pub close_grace_ms: u64,
    /// Streams an HTTP/2 client may have open at once (SETTINGS_MAX_CONCURRENT_STREAMS). A
    /// stream counts until its backend request has ended, so one the client reset still counts
    /// until its cancel reached the proxy; a stream beyond the limit is refused
    /// (REFUSED_STREAM) and never forwarded.
    pub h2_max_concurrent_streams: u32,
    /// An HTTP/2 connection whose client has cancelled more than this many streams before
    /// their response was complete (each a backend request started for nothing), and more than
    /// `h2_max_cancelled_share` of its ended streams, is closed: GOAWAY, new streams refused.
    pub h2_max_cancelled_streams: u64,
    /// The share of a connection's ended streams its client may cancel past
    /// `h2_max_cancelled_streams` (1.0: any share, the limit is off).
    pub h2_max_cancelled_share: f64,
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            header_timeout_ms: 30_000,
            body_timeout_ms: 60_000,
            idle_timeout_ms: 75_000,
            send_timeout_ms: 60_000,
            max_connections: 10_000,
            max_tls_handshakes: 64,
            close_grace_ms: 2_000,
            h2_max_concurrent_streams: 200,
            h2_max_cancelled_streams: 100,
            h2_max_cancelled_share: 0.5,
        }
    }
}

/// The admin listener serves `/metrics` and `/admin/*`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Address of the admin listener. Port 0 picks one.
    pub listen: SocketAddr,
    /// Bearer token required on `/admin/*`; mandatory (or `token_file`) when `listen` is not
    /// a loopback address.
    pub token: Option<Secret>,
    /// File holding the token instead (e.g. a mounted Kubernetes Secret), so the config
    /// itself can live in a ConfigMap. Read once when the proxy starts; surrounding
    /// whitespace is ignored.
    pub token_file: Option<PathBuf>,
    /// Backends with series of their own on `/metrics`; the rest (an `InferencePool` of
    /// thousands of pods) are counted together under `backend="_other"`, so a scrape stays
    /// small and fast. Needs a restart.
    pub max_backend_series: usize,
}

/// `admin.max_backend_series` by default: every backend of a hand-written config has its own
/// series, and the exposition stays near 1 MB.
pub const DEFAULT_MAX_BACKEND_SERIES: usize = 256;

/// Upstream connection settings shared by every backend.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamConfig {
    /// TCP connect timeout; a connect that takes longer counts as a connect error (retried).
    pub connect_timeout_ms: u64,
    /// Idle keep-alive connections are closed after this long. Below the 5 s after which
    /// uvicorn (vLLM, SGLang, TensorRT-LLM) closes an idle connection, so a request never goes
    /// out on a connection the server is closing at that moment.
    pub pool_idle_timeout_secs: u64,
    /// Idle keep-alive connections kept per backend by each forwarding worker.
    pub pool_max_idle_per_backend: usize,
    /// Retries on another backend when a request fails before any response byte: always when
    /// it provably did not reach the backend (connect failed, the write failed, an HTTP/2
    /// stream refused), after a send with no answer only as `retry_after_send` says.
    pub retries: u32,
    /// Whether a request the backend received whole and closed on without a response byte may
    /// be sent again (to a fresh connection, or the next backend). Off, only safe methods (GET,
    /// HEAD, OPTIONS, TRACE) are; on, any is, so a POST the backend was generating when it
    /// failed may be generated twice.
    pub retry_after_send: bool,
    /// How long a backend's first connection back from a streamed (chunked) response is
    /// watched for a close before reuse. A backend that closes it (llama-server does, while
    /// advertising keep-alive) gets a new connection for every request after a stream; 0
    /// trusts keep-alive after streams without watching. Either way, one such connection
    /// found closed under the next request teaches the same.
    pub stream_close_watch_ms: u64,
    /// PEM bundle of CAs trusted for `https://` backends instead of the platform roots.
    pub ca_file: Option<PathBuf>,
}

/// How a backend is chosen for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// Session affinity: rendezvous hashing with bounded load and a binding table.
    Session,
    /// Affinity off: every request goes to the next available backend in turn.
    RoundRobin,
    /// Affinity off: every request goes to the backend with the fewest requests in flight.
    LeastLoaded,
}

/// Session keys and placement.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AffinityConfig {
    /// Placement policy.
    pub policy: Policy,
    /// Headers tried in order; the first present non-empty one is the session key.
    pub headers: Vec<String>,
    /// Without a header, key `POST …/chat/completions` by model + first system + first user message.
    pub fingerprint: bool,
    /// A backend above this multiple of the pool's mean in-flight count (and at 4 or more)
    /// takes no more new sessions; sessions with a cache never move for load (0 turns the
    /// bound off).
    pub load_factor: f64,
    /// A session idle this long is forgotten (its binding, if any, is dropped).
    pub session_ttl_secs: u64,
    /// At most this many sessions are remembered; the least recently used go first.
    pub max_sessions: usize,
    /// A new session whose first choice holds more than this multiple of its share of the
    /// pool's active context starts elsewhere (0 turns the bound off).
    pub context_factor: f64,
    /// ... on whichever of its first this-many rendezvous choices holds the least active
    /// context (1: always the first choice, plain hashing).
    pub choices: usize,
    /// A session counts in its backend's active context this long after its last request.
    /// Fractions are allowed: a replay that compresses time (a simulator's time scale) needs
    /// the window compressed alike, or sessions that ended keep counting for most of the run.
    pub active_secs: f64,
    /// A continuing turn whose backend reports fewer than this share of the previous turn's
    /// prompt tokens as cached has lost its cache there; the session's next turn moves to the
    /// backend holding the least active context among those it leaves within their KV cache,
    /// if that holds less, or with no room anywhere to the one furthest over its cache (0
    /// turns this off).
    pub lost_cache_share: f64,
    /// A known session leaves for a shorter queue only when its backend's learnt queue wait
    /// is at least this long, besides longer than the session's prefill elsewhere: answers'
    /// fixed costs (a scheduling step, the network) differ between idle backends by a few
    /// milliseconds, which would otherwise read as a queue worth a cache (0: no floor).
    /// Scale it with a simulator's time scale.
    pub min_queue_wait_ms: f64,
    /// Each backend's KV cache in tokens (a backend of weight `w` holds `w` times this), or 0
    /// when unknown: where a session that lost its cache has room to move to.
    pub kv_cache_tokens: u64,
}

/// Active checks with hysteresis, and passive ejection.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HealthConfig {
    /// Path probed with `GET` on every backend; any 2xx is healthy.
    pub path: String,
    /// Time between probes of one backend; 0 turns active checks off.
    pub interval_ms: u64,
    /// A probe slower than this fails.
    pub timeout_ms: u64,
    /// Consecutive failed probes before a backend is marked unhealthy.
    pub unhealthy_threshold: u32,
    /// Consecutive good probes before an unhealthy backend takes traffic again.
    pub healthy_threshold: u32,
    /// Consecutive 5xx responses that eject a backend (0: never).
    pub eject_after_5xx: u32,
    /// With active checks off, how long an ejected backend stays out; then it takes requests
    /// again. With them on, only good probes bring it back.
    pub ejection_ms: u64,
}

/// One inference server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendConfig {
    /// Stable name: it seeds the rendezvous hash, so two proxies with the same names agree.
    pub name: String,
    /// `http://host:port` or `https://host:port`, optionally with a base path.
    pub url: String,
    /// Relative share of sessions (rendezvous weight).
    #[serde(default = "default_weight")]
    pub weight: f64,
}

fn default_weight() -> f64 {
    1.0
}

/// A string that never shows up in logs or `Debug` output.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret(pub String);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file `admin.token_file` names could not be read.
    #[error("admin.token_file: cannot read {path}: {source}")]
    TokenFile {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The TOML is malformed or has unknown or mistyped fields.
    #[error("{origin}: {message}")]
    Parse {
        /// The file, or `<inline>`.
        origin: String,
        /// The parser's message (it names the line and field).
        message: String,
    },
    /// A value is out of range or inconsistent.
    #[error("{0}")]
    Invalid(String),
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            listen_backlog: 4096,
            max_request_body_bytes: 64 * 1024 * 1024,
            request_body_budget_bytes: 256 * 1024 * 1024,
            shutdown_grace_secs: 30,
            workers: 0,
            tls: None,
            client: ClientConfig::default(),
            admin: AdminConfig::default(),
            upstream: UpstreamConfig::default(),
            affinity: AffinityConfig::default(),
            health: HealthConfig::default(),
            backends: Vec::new(),
            capture: CaptureConfig::default(),
            epp: EppConfig::default(),
        }
    }
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 9464)),
            token: None,
            token_file: None,
            max_backend_series: DEFAULT_MAX_BACKEND_SERIES,
        }
    }
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        Self {
            connect_timeout_ms: 2_000,
            pool_idle_timeout_secs: 4,
            pool_max_idle_per_backend: 256,
            retries: 1,
            retry_after_send: false,
            stream_close_watch_ms: 5,
            ca_file: None,
        }
    }
}

impl Default for AffinityConfig {
    fn default() -> Self {
        Self {
            policy: Policy::Session,
            headers: DEFAULT_SESSION_HEADERS
                .iter()
                .map(|h| h.to_string())
                .collect(),
            fingerprint: true,
            load_factor: 2.0,
            session_ttl_secs: 30 * 60,
            max_sessions: 1_000_000,
            context_factor: 1.1,
            choices: 3,
            active_secs: 20.0,
            lost_cache_share: 0.5,
            min_queue_wait_ms: 250.0,
            kv_cache_tokens: 0,
        }
    }
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            path: "/health".to_string(),
            interval_ms: 5_000,
            timeout_ms: 2_000,
            unhealthy_threshold: 3,
            healthy_threshold: 2,
            eject_after_5xx: 5,
            ejection_ms: 10_000,
        }
    }
}

impl ProxyConfig {
    /// Reads, parses and validates a config file.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let config = Self::read(path.as_ref())?;
        config.validate()?;
        Ok(config)
    }

    /// Reads and parses a config file without validating it: for a caller that lays
    /// command-line flags over it first, since a flag may supply what the file leaves out
    /// (`--backend` for a file without `[[backends]]`).
    pub(crate) fn read(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Parses and validates TOML text.
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        let config = Self::parse(text, "<inline>")?;
        config.validate()?;
        Ok(config)
    }

    fn parse(text: &str, origin: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse {
            origin: origin.to_string(),
            message: e.to_string().trim_end().to_string(),
        })
    }

    /// Reads `admin.token_file` into `admin.token` (a no-op without one), so every later
    /// check and the admin API see one token.
    pub fn resolve_token_file(&mut self) -> Result<(), ConfigError> {
        let Some(path) = self.admin.token_file.take() else {
            return Ok(());
        };
        let text = std::fs::read_to_string(&path).map_err(|source| ConfigError::TokenFile {
            path: path.clone(),
            source,
        })?;
        self.admin.token = Some(Secret(text.trim().to_string()));
        Ok(())
    }

    /// Checks ranges and cross-field rules; the message names the field and the value.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |msg: String| Err(ConfigError::Invalid(msg));
        if self.max_request_body_bytes == 0 {
            return bad("max_request_body_bytes: must be > 0, got 0".into());
        }
        if self.request_body_budget_bytes < self.max_request_body_bytes {
            return bad(format!(
                "request_body_budget_bytes: must be >= max_request_body_bytes ({}), got {}",
                self.max_request_body_bytes, self.request_body_budget_bytes
            ));
        }
        for (field, value) in [
            ("client.header_timeout_ms", self.client.header_timeout_ms),
            ("client.body_timeout_ms", self.client.body_timeout_ms),
            ("client.idle_timeout_ms", self.client.idle_timeout_ms),
            ("client.send_timeout_ms", self.client.send_timeout_ms),
            ("client.close_grace_ms", self.client.close_grace_ms),
            (
                "client.h2_max_concurrent_streams",
                u64::from(self.client.h2_max_concurrent_streams),
            ),
        ] {
            if value == 0 {
                return bad(format!("{field}: must be > 0, got 0"));
            }
        }
        if self.listen_backlog == 0 || self.listen_backlog > 65_535 {
            return bad(format!(
                "listen_backlog: must be 1 to 65535, got {}",
                self.listen_backlog
            ));
        }
        if self.client.max_connections == 0 {
            return bad("client.max_connections: must be >= 1, got 0".into());
        }
        if self.client.max_tls_handshakes == 0 {
            return bad("client.max_tls_handshakes: must be >= 1, got 0".into());
        }
        let share = self.client.h2_max_cancelled_share;
        if !(0.0..=1.0).contains(&share) {
            return bad(format!(
                "client.h2_max_cancelled_share: must be within 0.0..=1.0, got {share}"
            ));
        }
        if self.workers > 256 {
            return bad(format!("workers: must be <= 256, got {}", self.workers));
        }
        if self.admin.token.is_some() && self.admin.token_file.is_some() {
            return bad("admin.token_file: set admin.token or admin.token_file, not both".into());
        }
        if !self.admin.listen.ip().is_loopback() && self.admin.token_file.is_none() {
            match &self.admin.token {
                None => {
                    return bad(format!(
                        "admin.token: required when admin.listen is not loopback, got listen {} and no token",
                        self.admin.listen
                    ))
                }
                Some(t) if t.0.trim().is_empty() => {
                    return bad("admin.token: must not be empty".into())
                }
                _ => {}
            }
        }
        if let Some(t) = &self.admin.token {
            if t.0.is_empty() || !t.0.bytes().all(|b| b.is_ascii_graphic()) {
                return bad("admin.token: must be non-empty printable ASCII without spaces".into());
            }
        }
        if self.admin.listen == self.listen && self.listen.port() != 0 {
            return bad(format!(
                "admin.listen: must differ from listen, both are {}",
                self.listen
            ));
        }
        if self.upstream.connect_timeout_ms == 0 {
            return bad("upstream.connect_timeout_ms: must be > 0, got 0".into());
        }
        if self.upstream.stream_close_watch_ms > 1_000 {
            return bad(format!(
                "upstream.stream_close_watch_ms: must be <= 1000, got {}",
                self.upstream.stream_close_watch_ms
            ));
        }
        if self.upstream.retries > 8 {
            return bad(format!(
                "upstream.retries: must be <= 8, got {}",
                self.upstream.retries
            ));
        }
        self.validate_affinity()?;
        self.validate_health()?;
        self.validate_backends()?;
        self.validate_inference_pool()?;
        self.validate_epp_listener()?;
        self.capture.validate().map_err(ConfigError::Invalid)?;
        Ok(())
    }

    fn validate_affinity(&self) -> Result<(), ConfigError> {
        let a = &self.affinity;
        let bad = |msg: String| Err(ConfigError::Invalid(msg));
        if a.headers.is_empty() && a.policy == Policy::Session && !a.fingerprint {
            return bad(
                "affinity.headers: must name at least one header when affinity.fingerprint is off, got []"
                    .into(),
            );
        }
        for (i, h) in a.headers.iter().enumerate() {
            if http::HeaderName::from_bytes(h.as_bytes()).is_err() {
                return bad(format!(
                    "affinity.headers[{i}]: not a valid header name, got {h:?}"
                ));
            }
        }
        if !a.load_factor.is_finite() || (a.load_factor != 0.0 && a.load_factor < 1.0) {
            return bad(format!(
                "affinity.load_factor: must be >= 1.0 or 0, got {}",
                a.load_factor
            ));
        }
        if a.session_ttl_secs == 0 {
            return bad("affinity.session_ttl_secs: must be > 0, got 0".into());
        }
        if a.max_sessions == 0 {
            return bad("affinity.max_sessions: must be > 0, got 0".into());
        }
        if !a.context_factor.is_finite() || (a.context_factor != 0.0 && a.context_factor < 1.0) {
            return bad(format!(
                "affinity.context_factor: must be >= 1.0 or 0, got {}",
                a.context_factor
            ));
        }
        if !(1..=64).contains(&a.choices) {
            return bad(format!(
                "affinity.choices: must be 1 to 64, got {}",
                a.choices
            ));
        }
        // NaN fails the first comparison; the TTL bound also keeps the duration representable.
        if !(a.active_secs > 0.0 && a.active_secs <= a.session_ttl_secs as f64) {
            return bad(format!(
                "affinity.active_secs: must be > 0 and at most session_ttl_secs, got {}",
                a.active_secs
            ));
        }
        if !(0.0..=1.0).contains(&a.lost_cache_share) {
            return bad(format!(
                "affinity.lost_cache_share: must be 0 to 1, got {}",
                a.lost_cache_share
            ));
        }
        if !(a.min_queue_wait_ms.is_finite() && a.min_queue_wait_ms >= 0.0) {
            return bad(format!(
                "affinity.min_queue_wait_ms: must be a number >= 0, got {}",
                a.min_queue_wait_ms
            ));
        }
        Ok(())
    }

    fn validate_health(&self) -> Result<(), ConfigError> {
        let h = &self.health;
        let bad = |msg: String| Err(ConfigError::Invalid(msg));
        if !h.path.starts_with('/') || h.path.parse::<http::uri::PathAndQuery>().is_err() {
            return bad(format!(
                "health.path: must be an absolute path like /health, got {:?}",
                h.path
            ));
        }
        if h.interval_ms > 0 {
            if h.timeout_ms == 0 {
                return bad("health.timeout_ms: must be > 0, got 0".into());
            }
            if h.timeout_ms > h.interval_ms {
                return bad(format!(
                    "health.timeout_ms: must be <= health.interval_ms ({}), got {}",
                    h.interval_ms, h.timeout_ms
                ));
            }
        }
        if h.unhealthy_threshold == 0 {
            return bad("health.unhealthy_threshold: must be >= 1, got 0".into());
        }
        if h.healthy_threshold == 0 {
            return bad("health.healthy_threshold: must be >= 1, got 0".into());
        }
        if h.ejection_ms == 0 {
            return bad("health.ejection_ms: must be > 0, got 0".into());
        }
        Ok(())
    }

    fn validate_backends(&self) -> Result<(), ConfigError> {
        let bad = |msg: String| Err(ConfigError::Invalid(msg));
        // The picker's pod endpoints may be none for a while (no pod ready yet).
        if self.backends.is_empty() && self.epp.inference_pool.is_none() {
            return bad("backends: at least one backend is required, got none".into());
        }
        let mut names = std::collections::HashSet::new();
        for (i, b) in self.backends.iter().enumerate() {
            if b.name.is_empty() || !b.name.bytes().all(|c| c.is_ascii_graphic() && c != b'/') {
                return bad(format!(
                    "backends[{i}].name: must be non-empty printable ASCII without '/' or spaces, got {:?}",
                    b.name
                ));
            }
            if !names.insert(b.name.as_str()) {
                return bad(format!("backends[{i}].name: duplicate name {:?}", b.name));
            }
            if let Err(why) = BackendUrl::parse(&b.url) {
                return bad(format!("backends[{i}].url: {why}, got {:?}", b.url));
            }
            if !b.weight.is_finite() || b.weight <= 0.0 {
                return bad(format!(
                    "backends[{i}].weight: must be > 0, got {}",
                    b.weight
                ));
            }
        }
        Ok(())
    }
}

impl ProxyConfig {
    fn validate_epp_listener(&self) -> Result<(), ConfigError> {
        let e = &self.epp;
        let bad = |msg: String| Err(ConfigError::Invalid(msg));
        if e.max_connections == 0 || e.max_connections > 1_000_000 {
            return bad(format!(
                "epp.max_connections: must be 1 to 1000000, got {}",
                e.max_connections
            ));
        }
        for (field, value) in [
            ("epp.idle_timeout_ms", e.idle_timeout_ms),
            ("epp.in_flight_max_ms", e.in_flight_max_ms),
        ] {
            if value == 0 {
                return bad(format!("{field}: must be > 0, got 0"));
            }
        }
        self.validate_selection_header()
    }

    /// The selection header is a lower-case header name, and not one the picker or the
    /// gateway already give a meaning.
    fn validate_selection_header(&self) -> Result<(), ConfigError> {
        let Some(name) = &self.epp.selection_header else {
            return Ok(());
        };
        let token = !name.is_empty()
            && name.bytes().all(|b| {
                b.is_ascii_lowercase() || b.is_ascii_digit() || b"!#$%&'*+-.^_`|~".contains(&b)
            });
        if !token {
            return Err(ConfigError::Invalid(format!(
                "epp.selection_header: must be a lower-case HTTP header name, got {name:?}"
            )));
        }
        let session_header = if self.affinity.headers.is_empty() {
            DEFAULT_SESSION_HEADERS.contains(&name.as_str())
        } else {
            self.affinity
                .headers
                .iter()
                .any(|h| h.eq_ignore_ascii_case(name))
        };
        if name.starts_with("x-gateway-") || session_header {
            return Err(ConfigError::Invalid(format!(
                "epp.selection_header: {name:?} already means something (a gateway header or a session header)"
            )));
        }
        Ok(())
    }

    fn validate_inference_pool(&self) -> Result<(), ConfigError> {
        let Some(p) = &self.epp.inference_pool else {
            return Ok(());
        };
        let bad = |msg: String| Err(ConfigError::Invalid(msg));
        // Kubernetes object names: DNS subdomains (RFC 1123), at most 253 characters.
        let dns_name = |s: &str| {
            !s.is_empty()
                && s.len() <= 253
                && s.bytes()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-' || c == b'.')
                && s.starts_with(|c: char| c.is_ascii_alphanumeric())
                && s.ends_with(|c: char| c.is_ascii_alphanumeric())
        };
        if !dns_name(&p.name) {
            return bad(format!(
                "epp.inference_pool.name: must be a Kubernetes object name (lower-case letters, digits, '-', '.'), got {:?}",
                p.name
            ));
        }
        if let Some(ns) = &p.namespace {
            if !dns_name(ns) || ns.contains('.') || ns.len() > 63 {
                return bad(format!(
                    "epp.inference_pool.namespace: must be a namespace name (lower-case letters, digits, '-'), got {ns:?}"
                ));
            }
        }
        if let Some(url) = &p.api_server {
            if let Err(why) = api_server_url(url) {
                return bad(format!("epp.inference_pool.api_server: {why}, got {url:?}"));
            }
        }
        if p.max_pods == 0 || p.max_pods > 100_000 {
            return bad(format!(
                "epp.inference_pool.max_pods: must be 1 to 100000, got {}",
                p.max_pods
            ));
        }
        if !(4096..=64 * 1024 * 1024).contains(&p.max_event_bytes) {
            return bad(format!(
                "epp.inference_pool.max_event_bytes: must be 4096 to 67108864, got {}",
                p.max_event_bytes
            ));
        }
        Ok(())
    }
}

/// A Kubernetes API server address: `https://host[:port]`, or `http://` on a loopback IP;
/// the error says what is wrong.
pub fn api_server_url(url: &str) -> Result<ServerUrl, String> {
    let server = ServerUrl::parse(url).map_err(|e| match e {
        UrlError::NoScheme | UrlError::Scheme => {
            "must start with https:// (or http:// on a loopback address)".to_string()
        }
        e => e.to_string(),
    })?;
    if !server.path.is_empty() {
        return Err("must have no path or query".into());
    }
    if !server.tls
        && !server
            .host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
    {
        return Err("plain http is allowed on a loopback IP address only".into());
    }
    Ok(server)
}

/// A backend URL with the parts the forwarding path reuses for every request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendUrl {
    /// Where the backend is; its path is the prefix put before every forwarded path.
    pub server: ServerUrl,
    /// The `Host` header of HTTP/1.1 requests to this backend.
    pub host: http::HeaderValue,
    /// `scheme://authority` in lower case: which upstream connections can serve this backend.
    pub origin: std::sync::Arc<str>,
}

impl BackendUrl {
    /// Parses `http(s)://host[:port][/base]`; the error says what is wrong.
    pub fn parse(url: &str) -> Result<Self, UrlError> {
        let server = ServerUrl::parse(url)?;
        // An authority that parsed is visible ASCII, so this does not fail.
        let host = http::HeaderValue::from_str(server.authority.as_str())
            .map_err(|_| UrlError::NotAUrl("host is not a valid Host header".into()))?;
        let origin = format!("{}://{}", server.scheme(), server.authority)
            .to_ascii_lowercase()
            .into();
        Ok(Self {
            server,
            host,
            origin,
        })
    }
}

impl fmt::Display for BackendUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.server.fmt(f)
    }
}

#[cfg(test)]
mod tests;
