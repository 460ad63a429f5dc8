//! Fixtures for the proxy tests: small hyper backends on `127.0.0.1:0` (a JSON responder, an
//! SSE streamer whose events are released one by one and can be cut, a server that fails on
//! demand), a proxy starter, and a plain HTTP client.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use agentrace::proxy::{ProxyConfig, ProxyHandle};
use agentrace::shutdown::{self, Trigger};
use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, Notify, Semaphore};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type TestBody = BoxBody<Bytes, BoxError>;

/// What a backend answers to everything except `GET /health`.
#[derive(Debug, Clone, PartialEq)]
pub enum Mode {
    /// A small chat-completion JSON naming the backend.
    Json,
    /// `events` SSE events then `data: [DONE]`; with `gated`, each event waits for
    /// [`TestBackend::release`]; with `cut_after`, the stream breaks after that many events.
    Sse {
        events: usize,
        gated: bool,
        cut_after: Option<usize>,
    },
    /// This status with a JSON error body.
    Status(u16),
    /// Reads the request, then drops the connection without any response.
    Drop,
    /// Holds the response until [`TestBackend::release`]; counts a cancellation when the
    /// request is abandoned first (the connection closed under it).
    Stall,
}

/// An endless SSE stream, written as fast as the client side takes it.
pub fn endless_sse() -> Mode {
    Mode::Sse {
        events: usize::MAX - 1,
        gated: false,
        cut_after: None,
    }
}

/// Shared state of a test backend, read and steered by the test.
pub struct Control {
    pub name: String,
    mode: Mutex<Mode>,
    healthy: AtomicBool,
    /// Requests answered (health probes excluded).
    pub hits: AtomicU64,
    /// Health probes received.
    pub probes: AtomicU64,
    last_headers: Mutex<Option<HeaderMap>>,
    gate: Semaphore,
    /// SSE events written so far (all streams).
    pub events_written: AtomicU64,
    /// Streams abandoned because the client side went away.
    pub cancelled: AtomicU64,
    /// Signalled on every cancellation and every written event.
    pub changed: Notify,
    /// Connections accepted so far; each one's number is its index.
    accepted: AtomicU64,
    /// Connections that carried at least one non-probe request.
    serving_connections: Mutex<std::collections::BTreeSet<u64>>,
    /// HTTP version of the last non-probe request.
    last_version: Mutex<Option<http::Version>>,
}

/// A running backend.
pub struct TestBackend {
    pub addr: SocketAddr,
    pub ctl: Arc<Control>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl TestBackend {
    /// Starts a JSON responder named `name`.
    pub async fn spawn(name: &str) -> Self {
        Self::spawn_with(name, Mode::Json).await
    }

    /// Starts a backend in `mode`.
    pub async fn spawn_with(name: &str, mode: Mode) -> Self {
        Self::start(name, mode, None).await
    }

    /// Starts a JSON responder behind TLS that offers these ALPN protocols and serves HTTP/1.1
    /// or HTTP/2 as negotiated.
    pub async fn spawn_tls(name: &str, cert_pem: &str, key_pem: &str, alpn: &[&[u8]]) -> Self {
        Self::start(
            name,
            Mode::Json,
            Some(tls_acceptor(cert_pem, key_pem, alpn)),
        )
        .await
    }

    async fn start(name: &str, mode: Mode, tls: Option<tokio_rustls::TlsAcceptor>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let ctl = Arc::new(Control {
            name: name.to_string(),
            mode: Mutex::new(mode),
            healthy: AtomicBool::new(true),
            hits: AtomicU64::new(0),
            probes: AtomicU64::new(0),
            last_headers: Mutex::new(None),
            gate: Semaphore::new(0),
            events_written: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            changed: Notify::new(),
            accepted: AtomicU64::new(0),
            serving_connections: Mutex::new(Default::default()),
            last_version: Mutex::new(None),
        });
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        let c = ctl.clone();
        tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            loop {
                tokio::select! {
                    _ = &mut stopped => break,
                    Ok((stream, _)) = listener.accept() => {
                        let c = c.clone();
                        let tls = tls.clone();
                        conns.spawn(async move {
                            let id = c.accepted.fetch_add(1, Ordering::SeqCst);
                            let svc = service_fn(move |req: Request<Incoming>| {
                                if req.uri().path() != "/health" {
                                    c.serving_connections.lock().insert(id);
                                    *c.last_version.lock() = Some(req.version());
                                }
                                answer(c.clone(), req)
                            });
                            match tls {
                                None => {
                                    let _ = hyper::server::conn::http1::Builder::new()
                                        .serve_connection(TokioIo::new(stream), svc)
                                        .await;
                                }
                                Some(acceptor) => {
                                    let Ok(stream) = acceptor.accept(stream).await else {
                                        return;
                                    };
                                    let _ = hyper_util::server::conn::auto::Builder::new(
                                        TokioExecutor::new(),
                                    )
                                    .serve_connection(TokioIo::new(stream), svc)
                                    .await;
                                }
                            }
                        });
                    }
                }
            }
            conns.abort_all();
        });
        Self {
            addr,
            ctl,
            stop: Some(stop),
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn name(&self) -> &str {
        &self.ctl.name
    }

    pub fn set_mode(&self, mode: Mode) {
        *self.ctl.mode.lock() = mode;
    }

    /// Makes `GET /health` answer 200 (true) or 503 (false).
    pub fn set_healthy(&self, healthy: bool) {
        self.ctl.healthy.store(healthy, Ordering::SeqCst);
    }

    pub fn hits(&self) -> u64 {
        self.ctl.hits.load(Ordering::SeqCst)
    }

    pub fn probes(&self) -> u64 {
        self.ctl.probes.load(Ordering::SeqCst)
    }

    /// How many connections carried requests other than health probes.
    pub fn serving_connections(&self) -> usize {
        self.ctl.serving_connections.lock().len()
    }

    /// HTTP version of the last non-probe request.
    pub fn last_version(&self) -> Option<http::Version> {
        *self.ctl.last_version.lock()
    }

    /// Headers of the last non-probe request.
    pub fn last_headers(&self) -> Option<HeaderMap> {
        self.ctl.last_headers.lock().clone()
    }

    /// Lets `n` more gated SSE events out.
    pub fn release(&self, n: usize) {
        self.ctl.gate.add_permits(n);
    }

    /// Waits (up to 10 s) until `pred` holds on the control state.
    pub async fn wait_for(&self, what: &str, pred: impl Fn(&Control) -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let notified = self.ctl.changed.notified();
            if pred(&self.ctl) {
                return;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                panic!("backend {}: timed out waiting for {what}", self.ctl.name);
            }
        }
    }

    /// Waits until exactly one stream has been abandoned by the client side, and checks that
    /// this came no earlier than `limit_ms` after `since`.
    pub async fn assert_cancelled_once_past(&self, since: std::time::Instant, limit_ms: u64) {
        self.wait_for("the stream to be cancelled", |c| {
            c.cancelled.load(Ordering::SeqCst) == 1
        })
        .await;
        assert!(
            since.elapsed() >= Duration::from_millis(limit_ms),
            "cancelled {:?} in, before the {limit_ms} ms limit",
            since.elapsed()
        );
    }

    /// Stops accepting and closes every connection.
    pub fn stop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

impl Drop for TestBackend {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A TLS acceptor (rustls, ring) for this PEM certificate and key, offering these ALPN
/// protocols.
pub fn tls_acceptor(cert_pem: &str, key_pem: &str, alpn: &[&[u8]]) -> tokio_rustls::TlsAcceptor {
    let certs = rustls_pemfile::certs(&mut cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = rustls_pemfile::private_key(&mut key_pem.as_bytes())
        .unwrap()
        .unwrap();
    let mut server = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .unwrap();
    server.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    tokio_rustls::TlsAcceptor::from(Arc::new(server))
}

fn full(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Response<TestBody> {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .body(Full::new(body.into()).map_err(|e| match e {}).boxed())
        .unwrap()
}

/// A digest of a request body, for a test to check that the backend got every byte.
pub fn body_digest(body: &[u8]) -> String {
    use std::hash::Hasher;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    h.write(body);
    format!("{:016x}", h.finish())
}

async fn answer(ctl: Arc<Control>, req: Request<Incoming>) -> Result<Response<TestBody>, BoxError> {
    if req.uri().path() == "/health" {
        ctl.probes.fetch_add(1, Ordering::SeqCst);
        let ok = ctl.healthy.load(Ordering::SeqCst);
        let status = if ok {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        };
        return Ok(full(status, "text/plain", if ok { "ok" } else { "down" }));
    }
    *ctl.last_headers.lock() = Some(req.headers().clone());
    let path = req.uri().path().to_string();
    let body = req.into_body().collect().await?.to_bytes();
    let mode = ctl.mode.lock().clone();
    ctl.hits.fetch_add(1, Ordering::SeqCst);
    let resp = match mode {
        Mode::Json => {
            let json = serde_json::json!({
                "id": "chatcmpl-test",
                "object": "chat.completion",
                "backend": ctl.name,
                "path": path,
                "request_bytes": body.len(),
                "request_digest": body_digest(&body),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            });
            let mut r = full(StatusCode::OK, "application/json", json.to_string());
            r.headers_mut()
                .insert("x-backend", ctl.name.parse().unwrap());
            r
        }
        Mode::Status(code) => full(
            StatusCode::from_u16(code).unwrap(),
            "application/json",
            format!(
                "{{\"error\":{{\"message\":\"failing on demand\",\"backend\":\"{}\"}}}}",
                ctl.name
            ),
        ),
        Mode::Drop => return Err("dropping the connection on demand".into()),
        Mode::Stall => {
            let guard = CancelGuard(Some(ctl.clone()));
            ctl.changed.notify_waiters();
            ctl.gate.acquire().await.unwrap().forget();
            drop(guard.disarm());
            full(StatusCode::OK, "application/json", "{\"stalled\":true}")
        }
        Mode::Sse {
            events,
            gated,
            cut_after,
        } => sse(ctl, events, gated, cut_after),
    };
    Ok(resp)
}

fn sse(
    ctl: Arc<Control>,
    events: usize,
    gated: bool,
    cut_after: Option<usize>,
) -> Response<TestBody> {
    let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, BoxError>>(1);
    let name = ctl.name.clone();
    tokio::spawn(async move {
        for k in 0..=events {
            if cut_after == Some(k) {
                let _ = tx.send(Err("stream cut on demand".into())).await;
                return;
            }
            if gated && k < events {
                tokio::select! {
                    permit = ctl.gate.acquire() => permit.unwrap().forget(),
                    _ = tx.closed() => { cancelled(&ctl); return; }
                }
            }
            let data = if k < events {
                format!("data: {{\"backend\":\"{}\",\"k\":{k}}}\n\n", ctl.name)
            } else {
                "data: [DONE]\n\n".to_string()
            };
            if tx.send(Ok(Frame::data(Bytes::from(data)))).await.is_err() {
                cancelled(&ctl);
                return;
            }
            if k < events {
                ctl.events_written.fetch_add(1, Ordering::SeqCst);
                ctl.changed.notify_waiters();
            }
        }
    });
    let stream =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|f| (f, rx)) });
    Response::builder()
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-cache")
        .header("x-backend", name)
        .body(BodyExt::boxed(StreamBody::new(stream)))
        .unwrap()
}

/// Counts a cancellation if dropped while armed.
struct CancelGuard(Option<Arc<Control>>);

impl CancelGuard {
    fn disarm(mut self) -> Self {
        self.0 = None;
        self
    }
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if let Some(ctl) = self.0.take() {
            cancelled(&ctl);
        }
    }
}

fn cancelled(ctl: &Control) {
    ctl.cancelled.fetch_add(1, Ordering::SeqCst);
    ctl.changed.notify_waiters();
}

// -------------------------------------------------------------------------------------------
// Proxy and client helpers

/// A running proxy with its shutdown trigger.
pub struct TestProxy {
    pub handle: Option<ProxyHandle>,
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    trigger: Trigger,
}

impl TestProxy {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.admin)
    }

    /// The Prometheus text of `/metrics`.
    pub async fn metrics(&self) -> String {
        let (status, _, body) = fetch(&client(), "GET", &self.admin_url("/metrics"), &[], "").await;
        assert_eq!(status, 200, "/metrics answers");
        String::from_utf8(body.to_vec()).unwrap()
    }

    /// Client connections closed so far by the `[client]` limit `limit` (header, body, idle,
    /// send), from /metrics.
    pub async fn client_timeouts(&self, limit: &str) -> u64 {
        let metrics = self.metrics().await;
        let series = format!("agentrace_client_timeouts_total{{limit=\"{limit}\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(series.as_str()))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {series:?} in /metrics:\n{metrics}"))
    }

    /// The value of the counter `series` (its name with labels, as /metrics prints it).
    pub async fn counter(&self, series: &str) -> u64 {
        series_value(&self.metrics().await, series)
    }

    pub fn handle(&self) -> &ProxyHandle {
        self.handle.as_ref().unwrap()
    }

    /// Fires shutdown and waits for the drain.
    pub async fn shutdown(mut self) {
        self.trigger.fire();
        if let Some(h) = self.handle.take() {
            h.join().await;
        }
    }
}

/// A config over `backends` with ports 0, fast health checks off unless `tweak` turns them on.
pub fn config_for(backends: &[&TestBackend]) -> ProxyConfig {
    let mut toml = String::from(
        "listen = \"127.0.0.1:0\"\n[admin]\nlisten = \"127.0.0.1:0\"\n[health]\ninterval_ms = 0\n",
    );
    for b in backends {
        toml.push_str(&format!(
            "[[backends]]\nname = \"{}\"\nurl = \"{}\"\n",
            b.name(),
            b.url()
        ));
    }
    ProxyConfig::from_toml_str(&toml).unwrap()
}

/// Starts a proxy on `config`.
pub async fn start_proxy(config: ProxyConfig) -> TestProxy {
    let (trigger, shutdown) = shutdown::channel();
    let handle = agentrace::proxy::start(config, shutdown).await.unwrap();
    TestProxy {
        addr: handle.addr,
        admin: handle.admin_addr,
        handle: Some(handle),
        trigger,
    }
}

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

/// Sends a request and returns the response with its body still streaming.
pub async fn send(
    client: &HttpClient,
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Response<Incoming> {
    let mut req = Request::builder().method(method).uri(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    client
        .request(req.body(Full::new(body.into())).unwrap())
        .await
        .unwrap_or_else(|e| panic!("{method} {url}: {e}"))
}

/// Sends a request and reads the whole response.
pub async fn fetch(
    client: &HttpClient,
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> (StatusCode, HeaderMap, Bytes) {
    let resp = send(client, method, url, headers, body).await;
    let status = resp.status();
    let headers = resp.headers().clone();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, headers, body)
}

/// The backend that served a proxied response (the proxy's `x-agentrace-backend` header).
pub fn served_by(headers: &HeaderMap) -> String {
    headers
        .get("x-agentrace-backend")
        .expect("x-agentrace-backend header")
        .to_str()
        .unwrap()
        .to_string()
}

/// A chat-completions body whose fingerprint depends on `conversation` and not on `turn`.
pub fn chat_body(conversation: &str, turn: usize) -> String {
    let mut messages = vec![
        serde_json::json!({"role": "system", "content": "You are a coding agent."}),
        serde_json::json!({"role": "user", "content": format!("task {conversation}")}),
    ];
    for t in 0..turn {
        messages.push(serde_json::json!({"role": "assistant", "content": format!("step {t}")}));
        messages.push(serde_json::json!({"role": "user", "content": format!("tool result {t}")}));
    }
    serde_json::json!({"model": "test-model", "messages": messages, "stream": false}).to_string()
}

/// Reads the next data frame of a streaming body, failing after 10 s.
pub async fn next_data(body: &mut Incoming) -> Option<Bytes> {
    loop {
        let frame = tokio::time::timeout(Duration::from_secs(10), body.frame())
            .await
            .expect("no frame within 10 s: the proxy is holding data back")?;
        if let Ok(data) = frame.expect("body error").into_data() {
            return Some(data);
        }
    }
}

/// An HTTP/2 (prior knowledge) client connection to `addr`, its connection task spawned.
pub async fn h2_sender<B>(addr: SocketAddr) -> hyper::client::conn::http2::SendRequest<B>
where
    B: hyper::body::Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    send
}

/// The value of `series` (a name with its labels, as /metrics prints it) in Prometheus text.
pub fn series_value(metrics: &str, series: &str) -> u64 {
    let prefix = format!("{series} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {series:?} in /metrics:\n{metrics}"))
}
