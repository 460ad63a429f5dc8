//! Prometheus metrics of one proxy instance: a private recorder (never installed globally, so
//! several proxies share a process) with handles registered once and kept on the hot path.
//! What every request updates (decisions, 200s, the latency histograms) is counted per thread
//! in [`sharded`] and folded into the exposition at each render.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use metrics::{Counter, Gauge, Key, KeyName, Label, Metadata, Recorder, SharedString};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle, PrometheusRecorder};
use parking_lot::Mutex;

mod sharded;
use sharded::{Cells, DurationHistogram};

use super::routing::{Decision, Outcome, Pool, SessionTable, MOVE_REASONS};
use crate::capture::RecorderStats;
use crate::tap::KeySource;

static META: Metadata<'static> = Metadata::new(module_path!(), metrics::Level::INFO, None);

/// Latency buckets (seconds): from 100 µs to 10 min, since agent turns can stream for minutes.
const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];

/// Buckets for the proxy's own overhead (seconds): 5 µs to 10 ms.
const OVERHEAD_BUCKETS: &[f64] = &[
    0.000005, 0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
];

/// Upstream error kinds (the `kind` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ErrorKind {
    /// TCP/TLS connect failed or timed out.
    Connect,
    /// Sending the request or awaiting the response head failed.
    Send,
    /// The response body failed after the head was forwarded.
    Stream,
}

const ERROR_KINDS: [ErrorKind; 3] = [ErrorKind::Connect, ErrorKind::Send, ErrorKind::Stream];

impl ErrorKind {
    /// Label value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Connect => "connect",
            ErrorKind::Send => "send",
            ErrorKind::Stream => "stream",
        }
    }
}

/// Why a request was sent to the next backend (the `reason` label of the retry counter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RetryReason {
    /// No connection could be made.
    Connect,
    /// The request provably did not reach the backend whole (write failed, stream refused).
    NotSent,
    /// The backend had the request whole and closed without answering (safe methods, or
    /// `upstream.retry_after_send`): it may be generated twice.
    AfterSend,
}

const RETRY_REASONS: [RetryReason; 3] = [
    RetryReason::Connect,
    RetryReason::NotSent,
    RetryReason::AfterSend,
];

impl RetryReason {
    /// Label value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            RetryReason::Connect => "connect",
            RetryReason::NotSent => "not_sent",
            RetryReason::AfterSend => "after_send",
        }
    }
}

/// Which client-side limit (`[client]`) closed a connection (the `limit` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ClientTimeout {
    /// A head (or a new connection's first bytes) did not arrive in time.
    Header,
    /// A request body stopped arriving.
    Body,
    /// A keep-alive connection idled.
    Idle,
    /// The client stopped taking a response.
    Send,
    /// A graceful close (after the idle timeout, on shutdown, after a refusal) that the client
    /// did not let finish within `client.close_grace_ms`: the connection was dropped. A close
    /// begun for a limit (`Idle`) is counted as that limit when it begins, and here too when
    /// it had to be forced.
    Close,
}

const CLIENT_TIMEOUTS: [ClientTimeout; 5] = [
    ClientTimeout::Header,
    ClientTimeout::Body,
    ClientTimeout::Idle,
    ClientTimeout::Send,
    ClientTimeout::Close,
];

impl ClientTimeout {
    /// Label value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            ClientTimeout::Header => "header",
            ClientTimeout::Body => "body",
            ClientTimeout::Idle => "idle",
            ClientTimeout::Send => "send",
            ClientTimeout::Close => "close",
        }
    }
}

/// Why a client connection was closed as soon as it was accepted (the `reason` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ConnectionRefusal {
    /// `client.max_connections` were open.
    MaxConnections,
    /// The TLS handshake found no free permit (`tls.max_handshakes`) before its deadline.
    TlsHandshakes,
}

const CONNECTION_REFUSALS: [ConnectionRefusal; 2] = [
    ConnectionRefusal::MaxConnections,
    ConnectionRefusal::TlsHandshakes,
];

impl ConnectionRefusal {
    /// Label value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            ConnectionRefusal::MaxConnections => "max_connections",
            ConnectionRefusal::TlsHandshakes => "tls_handshakes",
        }
    }
}

const SOURCES: [KeySource; 3] = [KeySource::Header, KeySource::Fingerprint, KeySource::None];
const OUTCOMES: [Outcome; 8] = [
    Outcome::Hash,
    Outcome::Bound,
    Outcome::Spill,
    Outcome::Placed,
    Outcome::Moved,
    Outcome::Failover,
    Outcome::LeastLoaded,
    Outcome::RoundRobin,
];

fn source_label(s: KeySource) -> &'static str {
    match s {
        KeySource::Header => "header",
        KeySource::Fingerprint => "fingerprint",
        KeySource::None => "none",
    }
}

/// Proxy-wide metric handles.
#[derive(Clone)]
pub(crate) struct ProxyMetrics {
    recorder: Arc<PrometheusRecorder>,
    handle: PrometheusHandle,
    decisions: Arc<Vec<Counter>>,
    /// What `decisions` show, counted per thread until a render.
    decision_counts: Arc<Cells>,
    /// Known sessions moved off the backend holding their cache, by [`MOVE_REASONS`].
    moves: Arc<Vec<Counter>>,
    /// Retries on another backend before any response byte, by [`RETRY_REASONS`].
    retries: Arc<Vec<Counter>>,
    /// Time the proxy adds: body received → request handed to the pool, plus response head
    /// received → head handed to the client connection.
    overhead: Arc<DurationHistogram>,
    /// The configured backends' per-request series, by name.
    backend_series: Arc<Mutex<BackendRegistry>>,
    /// Requests refused with 503 because request bodies held `request_body_budget_bytes`.
    body_budget_refusals: Counter,
    /// Requests refused with 508 because their `Via` named this proxy instance.
    loops_refused: Counter,
    /// Request body bytes held now (set when rendered).
    body_bytes_held: Gauge,
    /// Requests refused before reaching any backend, by status.
    no_backend: Arc<Mutex<HashMap<u16, Counter>>>,
    bound_sessions: Gauge,
    sessions: Gauge,
    reloads_ok: Counter,
    reloads_failed: Counter,
    client_timeouts: Arc<Vec<Counter>>,
    /// Connections closed as soon as accepted, by [`CONNECTION_REFUSALS`].
    connections_refused: Arc<Vec<Counter>>,
    /// TLS handshakes that had to wait for a permit.
    tls_handshake_waits: Counter,
    /// HTTP/2 streams the client cancelled before their response was complete.
    pub cancelled_streams: Counter,
    /// HTTP/2 connections closed for cancelling too many streams.
    cancel_closes: Counter,
    /// Backends past this many share the `backend="_other"` series (`admin.max_backend_series`).
    max_backend_series: Arc<AtomicUsize>,
    /// Run before each render, so series owned elsewhere (the pool watch's ages) are current.
    render_hooks: Arc<Mutex<Vec<RenderHook>>>,
}

/// Refreshes gauges owned outside this module just before a render.
type RenderHook = Box<dyn Fn() + Send + Sync>;

/// The `backend` label every backend past `admin.max_backend_series` shares.
pub(crate) const OTHER_BACKENDS: &str = "_other";

/// The series of one backend that every request updates, counted per thread.
struct BackendSeries {
    name: SharedString,
    /// Responses with status 200: the common case of `agentrace_requests_total`.
    ok: Cells,
    /// The exporter's 200 series, registered once a render finds a 200 counted.
    ok_exported: OnceLock<Counter>,
    /// Request sent → response body finished.
    latency: DurationHistogram,
    /// Request sent → first response body byte (response head for an empty body).
    ttfb: DurationHistogram,
}

impl BackendSeries {
    /// Hands the 200s counted so far to the exporter's series of them; returns the count.
    fn export_ok(&self, recorder: &PrometheusRecorder) -> u64 {
        let ok = self.ok.total(0);
        if ok > 0 {
            let exported = self.ok_exported.get_or_init(|| {
                let labels = vec![
                    Label::new("backend", self.name.clone()),
                    Label::new("status", "200"),
                ];
                recorder.register_counter(&key("agentrace_requests_total", labels), &META)
            });
            exported.absolute(ok);
        }
        ok
    }
}

/// Each configured backend name's series, kept across reloads that rebuild the backend.
/// A name the configuration drops lets its series go (each is a few shards of cache lines, and
/// names come and go with pods); only its count of 200s stays, for the exporter's counter of
/// it to go on from there should the name return.
#[derive(Default)]
struct BackendRegistry {
    live: Vec<Arc<BackendSeries>>,
    retired_ok: HashMap<SharedString, u64>,
}

/// Metric handles of one backend.
#[derive(Clone)]
pub(crate) struct BackendMetrics {
    recorder: Arc<PrometheusRecorder>,
    name: SharedString,
    by_status: Arc<Mutex<HashMap<u16, Counter>>>,
    series: Arc<BackendSeries>,
    /// Requests abandoned before the response head: the `status="cancelled"` series.
    cancelled: Counter,
    errors: Arc<Vec<Counter>>,
    in_flight: Gauge,
    healthy: Gauge,
    draining: Gauge,
    sessions: Gauge,
    active_context: Gauge,
}

impl std::fmt::Debug for BackendMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BackendMetrics")
            .field("backend", &self.name)
            .finish()
    }
}

fn key(name: &'static str, labels: Vec<Label>) -> Key {
    Key::from_parts(name, labels)
}

impl Default for ProxyMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl ProxyMetrics {
    /// A fresh recorder with every proxy-wide series registered and described.
    pub(crate) fn new() -> Self {
        let recorder = PrometheusBuilder::new().build_recorder();
        describe(&recorder);
        let handle = recorder.handle();
        let r = &recorder;
        let mut decisions = Vec::new();
        for s in SOURCES {
            for o in OUTCOMES {
                decisions.push(r.register_counter(
                    &key(
                        "agentrace_affinity_decisions_total",
                        vec![
                            Label::new("source", source_label(s)),
                            Label::new("outcome", o.as_str()),
                        ],
                    ),
                    &META,
                ));
            }
        }
        let moves = MOVE_REASONS
            .iter()
            .map(|reason| {
                r.register_counter(
                    &key(
                        "agentrace_affinity_moves_total",
                        vec![Label::new("reason", reason.as_str())],
                    ),
                    &META,
                )
            })
            .collect();
        let retries = RETRY_REASONS
            .iter()
            .map(|reason| {
                r.register_counter(
                    &key(
                        "agentrace_retries_total",
                        vec![Label::new("reason", reason.as_str())],
                    ),
                    &META,
                )
            })
            .collect();
        let body_budget_refusals =
            r.register_counter(&key("agentrace_body_budget_refusals_total", vec![]), &META);
        let loops_refused =
            r.register_counter(&key("agentrace_loops_refused_total", vec![]), &META);
        let body_bytes_held =
            r.register_gauge(&key("agentrace_request_body_bytes_held", vec![]), &META);
        let bound_sessions = r.register_gauge(&key("agentrace_bound_sessions", vec![]), &META);
        let sessions = r.register_gauge(&key("agentrace_sessions", vec![]), &META);
        let reload = |result: &'static str| {
            r.register_counter(
                &key(
                    "agentrace_config_reloads_total",
                    vec![Label::new("result", result)],
                ),
                &META,
            )
        };
        let (reloads_ok, reloads_failed) = (reload("ok"), reload("refused"));
        let client_timeouts = CLIENT_TIMEOUTS
            .iter()
            .map(|t| {
                r.register_counter(
                    &key(
                        "agentrace_client_timeouts_total",
                        vec![Label::new("limit", t.as_str())],
                    ),
                    &META,
                )
            })
            .collect();
        let connections_refused = CONNECTION_REFUSALS
            .iter()
            .map(|reason| {
                r.register_counter(
                    &key(
                        "agentrace_client_connections_refused_total",
                        vec![Label::new("reason", reason.as_str())],
                    ),
                    &META,
                )
            })
            .collect();
        let tls_handshake_waits =
            r.register_counter(&key("agentrace_tls_handshake_waits_total", vec![]), &META);
        let cancelled_streams = r.register_counter(
            &key("agentrace_client_cancelled_streams_total", vec![]),
            &META,
        );
        let cancel_closes = r.register_counter(
            &key("agentrace_client_cancel_limit_closes_total", vec![]),
            &META,
        );
        Self {
            handle,
            cancelled_streams,
            cancel_closes,
            decision_counts: Arc::new(Cells::new(decisions.len())),
            decisions: Arc::new(decisions),
            moves: Arc::new(moves),
            retries: Arc::new(retries),
            overhead: Arc::new(DurationHistogram::new(OVERHEAD_BUCKETS)),
            backend_series: Arc::default(),
            body_budget_refusals,
            loops_refused,
            body_bytes_held,
            no_backend: Arc::default(),
            bound_sessions,
            sessions,
            reloads_ok,
            reloads_failed,
            client_timeouts: Arc::new(client_timeouts),
            connections_refused: Arc::new(connections_refused),
            tls_handshake_waits,
            recorder: Arc::new(recorder),
            max_backend_series: Arc::new(AtomicUsize::new(
                super::config::DEFAULT_MAX_BACKEND_SERIES,
            )),
            render_hooks: Arc::default(),
        }
    }

    /// Backends beyond `max` (by order of arrival) are counted together under
    /// `backend="_other"`, so the exposition stays a bounded size however many pods a pool has.
    pub(crate) fn set_max_backend_series(&self, max: usize) {
        self.max_backend_series.store(max, Ordering::Relaxed);
    }

    /// A counter of this recorder, described with `help`.
    pub(crate) fn counter(
        &self,
        name: &'static str,
        labels: &[(&'static str, &'static str)],
        help: &'static str,
    ) -> Counter {
        self.recorder
            .describe_counter(KeyName::from(name), None, SharedString::from(help));
        let labels = labels.iter().map(|(k, v)| Label::new(*k, *v)).collect();
        self.recorder.register_counter(&key(name, labels), &META)
    }

    /// A gauge of this recorder, described with `help`.
    pub(crate) fn gauge(&self, name: &'static str, help: &'static str) -> Gauge {
        self.recorder
            .describe_gauge(KeyName::from(name), None, SharedString::from(help));
        self.recorder.register_gauge(&key(name, vec![]), &META)
    }

    /// Runs `hook` before every render.
    pub(crate) fn on_render(&self, hook: RenderHook) {
        self.render_hooks.lock().push(hook);
    }

    /// Client connections open on forwarding worker `worker` (shows whether load spreads).
    pub(crate) fn worker_connections(&self, worker: usize) -> Gauge {
        self.recorder.register_gauge(
            &key(
                "agentrace_worker_connections",
                vec![Label::new("worker", worker.to_string())],
            ),
            &META,
        )
    }

    /// Handles for a backend's series.
    pub(crate) fn backend(&self, name: &str) -> BackendMetrics {
        let r = &*self.recorder;
        let name = self.series_name(name);
        let l = || vec![Label::new("backend", name.clone())];
        let errors = ERROR_KINDS
            .iter()
            .map(|k| {
                let mut labels = l();
                labels.push(Label::new("kind", k.as_str()));
                r.register_counter(&key("agentrace_upstream_errors_total", labels), &META)
            })
            .collect();
        let mut cancelled = l();
        cancelled.push(Label::new("status", "cancelled"));
        let series = {
            let mut registry = self.backend_series.lock();
            match registry.live.iter().find(|s| s.name == name) {
                Some(s) => s.clone(),
                None => {
                    let s = Arc::new(BackendSeries {
                        name: name.clone(),
                        ok: Cells::new(1),
                        ok_exported: OnceLock::new(),
                        latency: DurationHistogram::new(LATENCY_BUCKETS),
                        ttfb: DurationHistogram::new(LATENCY_BUCKETS),
                    });
                    if let Some(before) = registry.retired_ok.remove(&name) {
                        s.ok.add(0, before);
                    }
                    registry.live.push(s.clone());
                    s
                }
            }
        };
        BackendMetrics {
            recorder: self.recorder.clone(),
            by_status: Arc::default(),
            series,
            cancelled: r.register_counter(&key("agentrace_requests_total", cancelled), &META),
            errors: Arc::new(errors),
            in_flight: r.register_gauge(&key("agentrace_in_flight", l()), &META),
            healthy: r.register_gauge(&key("agentrace_backend_healthy", l()), &META),
            draining: r.register_gauge(&key("agentrace_backend_draining", l()), &META),
            sessions: r.register_gauge(&key("agentrace_backend_sessions", l()), &META),
            active_context: r
                .register_gauge(&key("agentrace_backend_active_context_bytes", l()), &META),
            name,
        }
    }

    /// The `backend` label of `name`: its own while fewer than `max_backend_series` backends
    /// have one (or it has one already), else the shared [`OTHER_BACKENDS`].
    fn series_name(&self, name: &str) -> SharedString {
        let registry = self.backend_series.lock();
        let own = registry
            .live
            .iter()
            .filter(|s| &*s.name != OTHER_BACKENDS)
            .count();
        let has_own = registry.live.iter().any(|s| &*s.name == name);
        if has_own || own < self.max_backend_series.load(Ordering::Relaxed) {
            SharedString::from(name.to_string())
        } else {
            SharedString::const_str(OTHER_BACKENDS)
        }
    }

    /// Lets go of the series of backends no longer named in the configuration, their 200s
    /// handed to the exporter first. Requests still in flight to them count on in series no
    /// render shows.
    pub(crate) fn keep_backends<'a>(&self, names: impl IntoIterator<Item = &'a str>) {
        let names: std::collections::HashSet<&str> = names.into_iter().collect();
        let mut registry = self.backend_series.lock();
        let BackendRegistry { live, retired_ok } = &mut *registry;
        live.retain(|s| {
            if names.contains(&*s.name) || &*s.name == OTHER_BACKENDS {
                return true;
            }
            let ok = s.export_ok(&self.recorder);
            if ok > 0 {
                retired_ok.insert(s.name.clone(), ok);
            }
            false
        });
    }

    /// Counts one routing decision.
    pub(crate) fn decision(&self, source: KeySource, outcome: Outcome) {
        let s = SOURCES.iter().position(|x| *x == source).unwrap_or(0);
        let o = OUTCOMES.iter().position(|x| *x == outcome).unwrap_or(0);
        self.decision_counts.add(s * OUTCOMES.len() + o, 1);
    }

    /// Counts one routing decision, and the move it made, if any.
    pub(crate) fn routed(&self, source: KeySource, decision: &Decision) {
        self.decision(source, decision.outcome);
        if let Some(reason) = decision.moved {
            let i = MOVE_REASONS.iter().position(|x| *x == reason).unwrap_or(0);
            self.moves[i].increment(1);
        }
    }

    /// Counts a response the proxy produced without a backend (413, 502, 503).
    pub(crate) fn refused(&self, status: http::StatusCode) {
        let code = status.as_u16();
        let mut map = self.no_backend.lock();
        map.entry(code)
            .or_insert_with(|| {
                self.recorder.register_counter(
                    &key(
                        "agentrace_requests_total",
                        vec![
                            Label::new("backend", "none"),
                            Label::new("status", code.to_string()),
                        ],
                    ),
                    &META,
                )
            })
            .increment(1);
    }

    /// Counts one thing the endpoint picker refused or cut short, by `reason`; registered
    /// at its first occurrence, as these are rare.
    pub(crate) fn epp_refused(&self, reason: &'static str) {
        self.recorder
            .register_counter(
                &key(
                    "agentrace_epp_refusals_total",
                    vec![Label::new("reason", reason)],
                ),
                &META,
            )
            .increment(1);
    }

    /// Counts a request refused because request bodies held the whole budget.
    pub(crate) fn body_budget_refused(&self) {
        self.body_budget_refusals.increment(1);
    }

    /// Counts a request refused because it came back to this proxy instance (a loop).
    pub(crate) fn loop_refused(&self) {
        self.loops_refused.increment(1);
    }

    /// Publishes the request body bytes held now (read by the admin listener before a render,
    /// so the hot path only counts in the budget).
    pub(crate) fn body_bytes_held(&self, bytes: u64) {
        self.body_bytes_held.set(bytes as f64);
    }

    /// Counts a retry on the next backend.
    pub(crate) fn retry(&self, reason: RetryReason) {
        let i = RETRY_REASONS.iter().position(|r| *r == reason).unwrap_or(0);
        self.retries[i].increment(1);
    }

    /// Counts a client connection closed by one of the `[client]` limits.
    pub(crate) fn client_timeout(&self, limit: ClientTimeout) {
        let i = CLIENT_TIMEOUTS
            .iter()
            .position(|t| *t == limit)
            .unwrap_or(0);
        self.client_timeouts[i].increment(1);
    }

    /// Counts a client connection closed as soon as it was accepted.
    pub(crate) fn connection_refused(&self, reason: ConnectionRefusal) {
        let i = CONNECTION_REFUSALS
            .iter()
            .position(|r| *r == reason)
            .unwrap_or(0);
        self.connections_refused[i].increment(1);
    }

    /// Counts a TLS handshake that waits for a permit.
    pub(crate) fn tls_handshake_waited(&self) {
        self.tls_handshake_waits.increment(1);
    }

    /// Counts an HTTP/2 connection closed because its client cancelled too many streams.
    pub(crate) fn cancel_limit_close(&self) {
        self.cancel_closes.increment(1);
    }

    /// Counts a configuration reload attempt.
    pub(crate) fn reload(&self, ok: bool) {
        if ok {
            self.reloads_ok.increment(1)
        } else {
            self.reloads_failed.increment(1)
        }
    }

    /// Records the time the proxy itself added to a request.
    pub(crate) fn overhead(&self, d: Duration) {
        self.overhead.record(d);
    }

    /// The Prometheus text exposition, with gauges refreshed from live state first.
    pub(crate) fn render(
        &self,
        pool: &Pool,
        sessions: &SessionTable,
        capture: Option<RecorderStats>,
    ) -> String {
        // Takes sessions past their active window out first, so the active context is current.
        sessions.sweep();
        for hook in self.render_hooks.lock().iter() {
            hook();
        }
        // Backends sharing `_other` share its gauges: each shows the sum over them.
        let mut sums: HashMap<*const BackendSeries, (&BackendMetrics, [f64; 5])> = HashMap::new();
        for b in &pool.backends {
            let m = &b.metrics;
            let values = [
                b.in_flight.load(Ordering::Relaxed) as f64,
                f64::from(u8::from(b.healthy.load(Ordering::Relaxed))),
                f64::from(u8::from(b.draining.load(Ordering::Relaxed))),
                b.sessions.load(Ordering::Relaxed).max(0) as f64,
                b.active_bytes.load(Ordering::Relaxed).max(0) as f64,
            ];
            let sum = &mut sums
                .entry(Arc::as_ptr(&m.series))
                .or_insert((m, [0.0; 5]))
                .1;
            for (s, v) in sum.iter_mut().zip(values) {
                *s += v;
            }
        }
        for (m, [in_flight, healthy, draining, sessions, active]) in sums.into_values() {
            m.in_flight.set(in_flight);
            m.healthy.set(healthy);
            m.draining.set(draining);
            m.sessions.set(sessions);
            m.active_context.set(active);
        }
        self.bound_sessions.set(sessions.bound() as f64);
        self.sessions.set(sessions.len() as f64);
        if let Some(s) = capture {
            let r = &*self.recorder;
            let c = |name: &'static str, v: u64| {
                r.register_counter(&key(name, vec![]), &META).absolute(v);
            };
            c("agentrace_capture_records_written_total", s.records_written);
            c("agentrace_capture_records_dropped_total", s.records_dropped);
            for (reason, v) in [
                ("write_failed", s.records_lost_write_failed),
                ("retry_wait", s.records_lost_retry_wait),
            ] {
                r.register_counter(
                    &key(
                        "agentrace_capture_records_lost_total",
                        vec![Label::new("reason", reason)],
                    ),
                    &META,
                )
                .absolute(v);
            }
            c("agentrace_capture_write_errors_total", s.write_errors);
            c("agentrace_capture_bytes_raw_total", s.bytes_raw);
            c("agentrace_capture_bytes_stored_total", s.bytes_stored);
        }
        for (i, counter) in self.decisions.iter().enumerate() {
            counter.absolute(self.decision_counts.total(i));
        }
        let series: Vec<Arc<BackendSeries>> = self.backend_series.lock().live.clone();
        for s in &series {
            s.export_ok(&self.recorder);
        }
        let mut out = self.handle.render();
        sharded::render_family(
            &mut out,
            "agentrace_proxy_overhead_seconds",
            "Time the proxy itself adds to a request.",
            [(&[][..], &*self.overhead)],
        );
        let labels: Vec<[(&str, &str); 1]> =
            series.iter().map(|s| [("backend", &*s.name)]).collect();
        sharded::render_family(
            &mut out,
            "agentrace_upstream_latency_seconds",
            "Request sent upstream to response body end, per backend.",
            labels
                .iter()
                .zip(&series)
                .map(|(l, s)| (&l[..], &s.latency)),
        );
        sharded::render_family(
            &mut out,
            "agentrace_upstream_ttfb_seconds",
            "Request sent upstream to first response body byte, per backend.",
            labels.iter().zip(&series).map(|(l, s)| (&l[..], &s.ttfb)),
        );
        out
    }
}

impl BackendMetrics {
    /// Counts a finished response by status.
    pub(crate) fn request(&self, status: http::StatusCode) {
        if status == http::StatusCode::OK {
            self.series.ok.add(0, 1);
            return;
        }
        let code = status.as_u16();
        let register = || {
            self.recorder.register_counter(
                &key(
                    "agentrace_requests_total",
                    vec![
                        Label::new("backend", self.name.clone()),
                        Label::new("status", code.to_string()),
                    ],
                ),
                &META,
            )
        };
        let mut map = self.by_status.lock();
        map.entry(code).or_insert_with(register).increment(1);
    }

    /// Counts a request abandoned (its client gone, or its stream reset) while it was on its
    /// way to the backend or awaiting the response head.
    pub(crate) fn request_cancelled(&self) {
        self.cancelled.increment(1);
    }

    /// Counts an upstream error.
    pub(crate) fn error(&self, kind: ErrorKind) {
        let i = ERROR_KINDS.iter().position(|k| *k == kind).unwrap_or(0);
        self.errors[i].increment(1);
    }

    /// Records the time from a request sent to its response body's end.
    pub(crate) fn latency(&self, d: Duration) {
        self.series.latency.record(d);
    }

    /// Records the time from a request sent to its first response body byte.
    pub(crate) fn ttfb(&self, d: Duration) {
        self.series.ttfb.record(d);
    }
}

fn describe(r: &PrometheusRecorder) {
    let d = |name: &'static str, help: &'static str, kind: u8| {
        let (k, h) = (KeyName::from(name), SharedString::from(help));
        match kind {
            0 => r.describe_counter(k, None, h),
            1 => r.describe_gauge(k, None, h),
            _ => r.describe_histogram(k, None, h),
        }
    };
    d(
        "agentrace_requests_total",
        "Responses by backend (none: refused by the proxy) and status (cancelled: abandoned by the client before the response head).",
        0,
    );
    d(
        "agentrace_client_timeouts_total",
        "Client connections closed by a [client] limit (header, body, idle, send; close: dropped when a graceful close did not finish within close_grace_ms).",
        0,
    );
    d(
        "agentrace_client_cancelled_streams_total",
        "HTTP/2 streams the client reset (or whose connection it closed) before their response was complete.",
        0,
    );
    d(
        "agentrace_client_cancel_limit_closes_total",
        "HTTP/2 connections closed because their client cancelled more streams than client.h2_max_cancelled_streams and client.h2_max_cancelled_share allow.",
        0,
    );
    d(
        "agentrace_client_connections_refused_total",
        "Client connections closed as soon as accepted (max_connections open, or no TLS handshake permit in time).",
        0,
    );
    d(
        "agentrace_tls_handshake_waits_total",
        "TLS handshakes that waited for a permit because tls.max_handshakes were in progress.",
        0,
    );
    d("agentrace_in_flight", "Requests in flight per backend.", 1);
    d(
        "agentrace_backend_healthy",
        "1 when the backend takes traffic per health checks.",
        1,
    );
    d(
        "agentrace_backend_draining",
        "1 when the backend is draining (no new sessions).",
        1,
    );
    d(
        "agentrace_backend_sessions",
        "Sessions the session table places on the backend.",
        1,
    );
    d(
        "agentrace_backend_active_context_bytes",
        "Request bytes of the sessions on the backend with a turn in flight or ended within affinity.active_secs: what new sessions are placed by.",
        1,
    );
    d(
        "agentrace_affinity_decisions_total",
        "Routing decisions by key source and outcome.",
        0,
    );
    d(
        "agentrace_affinity_moves_total",
        "Known sessions moved off the backend holding their cache, by reason (failed, removed, cache_lost, queue_wait).",
        0,
    );
    d(
        "agentrace_bound_sessions",
        "Sessions bound away from their plain hash (spill, failover).",
        1,
    );
    d(
        "agentrace_sessions",
        "Sessions remembered by the session table.",
        1,
    );
    d(
        "agentrace_retries_total",
        "Retries on another backend before any response byte, by reason (connect, not_sent, after_send).",
        0,
    );
    d(
        "agentrace_upstream_errors_total",
        "Upstream errors by backend and kind (connect, send, stream).",
        0,
    );
    d(
        "agentrace_body_budget_refusals_total",
        "Requests refused with 503 because request bodies held request_body_budget_bytes.",
        0,
    );
    d(
        "agentrace_epp_refusals_total",
        "What the endpoint picker refused or cut short, by reason (max_connections, idle_timeout, accept_error, malformed_message, unauthenticated, in_flight_expired, served_not_offered).",
        0,
    );
    d(
        "agentrace_loops_refused_total",
        "Requests refused with 508 Loop Detected because their Via named this proxy instance.",
        0,
    );
    d(
        "agentrace_request_body_bytes_held",
        "Request body bytes held in memory now, against request_body_budget_bytes.",
        1,
    );
    d(
        "agentrace_worker_connections",
        "Client connections open per forwarding worker.",
        1,
    );
    d(
        "agentrace_config_reloads_total",
        "Configuration reloads by result.",
        0,
    );
    d(
        "agentrace_capture_records_written_total",
        "Exchanges in capture segments (counted once the flush holding them succeeded).",
        0,
    );
    d(
        "agentrace_capture_records_dropped_total",
        "Exchanges the recorder dropped before writing (queue full, memory bound, shutdown).",
        0,
    );
    d(
        "agentrace_capture_records_lost_total",
        "Exchanges that never reached the disk, by reason (write_failed, retry_wait).",
        0,
    );
    d(
        "agentrace_capture_write_errors_total",
        "Failed segment opens, writes, flushes and closes.",
        0,
    );
    d(
        "agentrace_capture_bytes_raw_total",
        "Body bytes of the exchanges written.",
        0,
    );
    d(
        "agentrace_capture_bytes_stored_total",
        "Compressed bytes in capture segments, up to their last successful flush.",
        0,
    );
}

#[cfg(test)]
mod tests;
