//! Listener: accepts connections and serves each on its own task: HTTP/1.1 by [`ingress`],
//! HTTP/2 (h2c by its preface, or TLS with ALPN h2) by hyper; drains them within the grace
//! period on shutdown.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use metrics::Gauge;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;

use super::config::TlsConfig;
use super::ingress::{ClientLimits, Deadline};
use super::metrics::{ClientTimeout, ConnectionRefusal};
use super::{ingress, upstream, Inner, ProxyError};
use crate::shutdown::Shutdown;

/// A TLS handshake slower than this is abandoned (a stalled client must not hold a task).
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// TLS termination on one listener: the server config, and the permits of the handshakes that
/// may run at once past their ClientHello (`client.max_tls_handshakes`).
#[derive(Clone)]
struct TlsIngress {
    config: Arc<rustls::ServerConfig>,
    permits: Arc<tokio::sync::Semaphore>,
}

/// Why a TLS handshake did not complete.
#[derive(Debug, thiserror::Error)]
enum HandshakeError {
    #[error("TLS handshake failed: {0}")]
    Failed(#[from] std::io::Error),
    #[error("TLS handshake not done within {TLS_HANDSHAKE_TIMEOUT:?}")]
    TimedOut,
    #[error("no TLS handshake permit within {TLS_HANDSHAKE_TIMEOUT:?} (client.max_tls_handshakes in progress)")]
    NoPermit,
}

impl TlsIngress {
    /// Completes the handshake by `deadline`. The ClientHello is read first, without a permit:
    /// it costs nothing to parse, and a client sending it slowly must not hold a permit other
    /// handshakes wait for. The rest (key exchange, signature: the CPU of a handshake) runs
    /// with a permit, taken in arrival order once one is free.
    async fn accept(
        &self,
        stream: TcpStream,
        deadline: Instant,
        metrics: &super::metrics::ProxyMetrics,
    ) -> Result<tokio_rustls::server::TlsStream<TcpStream>, HandshakeError> {
        let hello =
            tokio_rustls::LazyConfigAcceptor::new(rustls::server::Acceptor::default(), stream);
        let start = tokio::time::timeout_at(deadline, hello)
            .await
            .map_err(|_| HandshakeError::TimedOut)??;
        let _permit = match self.permits.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                metrics.tls_handshake_waited();
                tokio::time::timeout_at(deadline, self.permits.clone().acquire_owned())
                    .await
                    .map_err(|_| HandshakeError::NoPermit)?
                    .expect("the semaphore is never closed")
            }
        };
        tokio::time::timeout_at(deadline, start.into_stream(self.config.clone()))
            .await
            .map_err(|_| HandshakeError::TimedOut)?
            .map_err(HandshakeError::Failed)
    }
}

/// Loads the certificate chain and key; errors name the file and what is wrong with it.
pub fn tls_acceptor(cfg: &TlsConfig) -> Result<TlsAcceptor, ProxyError> {
    let read = |path: &std::path::PathBuf| {
        std::fs::read(path).map_err(|e| ProxyError::Tls {
            file: path.clone(),
            reason: e.to_string(),
        })
    };
    let cert_pem = read(&cfg.cert_file)?;
    let certs = rustls_pemfile::certs(&mut cert_pem.as_slice())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ProxyError::Tls {
            file: cfg.cert_file.clone(),
            reason: format!("not a PEM certificate chain: {e}"),
        })?;
    if certs.is_empty() {
        return Err(ProxyError::Tls {
            file: cfg.cert_file.clone(),
            reason: "no certificate in the file".into(),
        });
    }
    let key_pem = read(&cfg.key_file)?;
    let key = rustls_pemfile::private_key(&mut key_pem.as_slice())
        .map_err(|e| ProxyError::Tls {
            file: cfg.key_file.clone(),
            reason: format!("not a PEM private key: {e}"),
        })?
        .ok_or_else(|| ProxyError::Tls {
            file: cfg.key_file.clone(),
            reason: "no private key in the file".into(),
        })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut server = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| ProxyError::Internal(format!("rustls: {e}")))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| ProxyError::Tls {
            file: cfg.key_file.clone(),
            reason: format!(
                "key does not fit the certificate in {}: {e}",
                cfg.cert_file.display()
            ),
        })?;
    server.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(server)))
}

/// Serves connections on `workers` threads until `shutdown`, then drains them for up to `grace`.
///
/// Each worker is an OS thread with a single-threaded runtime and its own upstream pool: a
/// request, its upstream connection and its response all stay on one thread, which saves the
/// cross-thread wake-ups that otherwise cost more than the forwarding itself. One accept loop
/// (on the caller's runtime) hands each new connection to the worker serving the fewest, so
/// the load spreads evenly; workers competing on a shared socket would leave most connections
/// with whichever worker happened to be awake.
pub async fn serve(
    tcp: TcpListener,
    workers: usize,
    tls: Option<TlsAcceptor>,
    inner: Arc<Inner>,
    mut shutdown: Shutdown,
    grace: Duration,
) {
    let (max_connections, max_tls_handshakes) = {
        let config = inner.config.lock();
        (
            config.client.max_connections,
            config.client.max_tls_handshakes,
        )
    };
    let tls = tls.map(|acceptor| TlsIngress {
        config: acceptor.config().clone(),
        permits: Arc::new(tokio::sync::Semaphore::new(max_tls_handshakes)),
    });
    let mut handoffs = Vec::new();
    let mut done = Vec::new();
    for worker in 0..workers.max(1) {
        let (handoff, connections) = mpsc::unbounded_channel::<Handoff>();
        let (finished, finished_rx) = tokio::sync::oneshot::channel::<()>();
        let (tls, inner, shutdown) = (tls.clone(), inner.clone(), shutdown.clone());
        let open = Arc::new(AtomicUsize::new(0));
        let gauge = inner.metrics.worker_connections(worker);
        let spawned = std::thread::Builder::new()
            .name(format!("agentrace-proxy-{worker}"))
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        tracing::error!(error = %e, "cannot start a worker runtime");
                        return;
                    }
                };
                runtime.block_on(worker_loop(
                    connections,
                    worker,
                    tls,
                    inner,
                    shutdown,
                    grace,
                ));
                let _ = finished.send(());
            });
        match spawned {
            Ok(_) => {
                handoffs.push((handoff, open, gauge));
                done.push(finished_rx);
            }
            Err(e) => tracing::error!(error = %e, "cannot start a worker thread"),
        }
    }
    let open = Arc::new(AtomicUsize::new(0));
    let mut next = 0usize;
    loop {
        tokio::select! {
            _ = shutdown.wait() => break,
            accepted = tcp.accept() => match accepted {
                Ok((stream, _)) if open.load(Ordering::Relaxed) >= max_connections => {
                    refuse_over_capacity(&stream, tls.is_none());
                    inner.metrics.connection_refused(ConnectionRefusal::MaxConnections);
                }
                Ok((stream, peer)) => {
                    let _ = stream.set_nodelay(true);
                    // Fewest open connections; ties go round-robin.
                    let n = handoffs.len();
                    let Some(pick) = (0..n)
                        .map(|i| (next + i) % n)
                        .min_by_key(|&i| handoffs[i].1.load(Ordering::Relaxed))
                    else {
                        break;
                    };
                    next = (pick + 1) % n;
                    let (handoff, on_worker, gauge) = &handoffs[pick];
                    let stream = match stream.into_std() {
                        Ok(s) => s,
                        Err(e) => {
                            tracing::warn!(error = %e, "cannot hand a connection to a worker");
                            continue;
                        }
                    };
                    let guard = OpenConnection::new(&open, on_worker, gauge);
                    if handoff.send(Handoff { stream, peer, guard }).is_err() {
                        tracing::error!(worker = pick, "worker stopped; connection dropped");
                    }
                }
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
    drop(tcp);
    drop(handoffs);
    for rx in done {
        let _ = rx.await;
    }
}

/// A connection on its way to (and then served by) a worker.
struct Handoff {
    stream: std::net::TcpStream,
    peer: SocketAddr,
    guard: OpenConnection,
}

/// Counts a connection open (against `client.max_connections`) and on its worker (for
/// placement, and in the metrics) until dropped.
struct OpenConnection {
    open: Arc<AtomicUsize>,
    on_worker: Arc<AtomicUsize>,
    gauge: Gauge,
}

impl OpenConnection {
    fn new(open: &Arc<AtomicUsize>, on_worker: &Arc<AtomicUsize>, gauge: &Gauge) -> Self {
        open.fetch_add(1, Ordering::Relaxed);
        on_worker.fetch_add(1, Ordering::Relaxed);
        gauge.increment(1.0);
        Self {
            open: open.clone(),
            on_worker: on_worker.clone(),
            gauge: gauge.clone(),
        }
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::Relaxed);
        self.on_worker.fetch_sub(1, Ordering::Relaxed);
        self.gauge.decrement(1.0);
    }
}

/// The answer to a connection over `client.max_connections`, whole in one small write.
const OVER_CAPACITY: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\n\
content-type: application/json\r\n\
retry-after: 1\r\n\
connection: close\r\n\
content-length: 101\r\n\r\n\
{\"error\":{\"message\":\"the proxy has client.max_connections open; retry shortly\",\"type\":\"overloaded\"}}\n";

/// Answers a connection over `client.max_connections` in the accept loop, with no task and no
/// buffer: a plain one gets [`OVER_CAPACITY`] written into its fresh, empty send buffer (a TLS
/// one would need the handshake the cap saves, so it is only closed); what the client has
/// already sent is discarded, up to a few KiB, so the close is a FIN that lets it read the
/// answer rather than a reset; then the socket is closed as `stream` drops.
fn refuse_over_capacity(stream: &TcpStream, plain: bool) {
    let socket = socket2::SockRef::from(stream);
    if plain {
        let _ = socket.send(OVER_CAPACITY);
    }
    let _ = socket.shutdown(std::net::Shutdown::Write);
    let mut sink = [std::mem::MaybeUninit::<u8>::uninit(); 4096];
    for _ in 0..4 {
        if !matches!(socket.recv(&mut sink), Ok(n) if n > 0) {
            break;
        }
    }
}

/// Serves the connections handed to this worker until `shutdown` (or the accept loop ends),
/// then drains them for up to `grace`: idle HTTP/1.1 connections close at once, busy ones after
/// their response, HTTP/2 ones after a GOAWAY.
async fn worker_loop(
    mut handed: mpsc::UnboundedReceiver<Handoff>,
    worker: usize,
    tls: Option<TlsIngress>,
    inner: Arc<Inner>,
    mut shutdown: Shutdown,
    grace: Duration,
) {
    let mut connections = JoinSet::new();
    // Connections watch this worker's own copy of the signal, which every idle keep-alive
    // connection polls between requests: no lock another thread takes.
    let (stop_connections, connection_shutdown) = crate::shutdown::channel();
    loop {
        tokio::select! {
            _ = shutdown.wait() => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            handoff = handed.recv() => {
                let Some(Handoff { stream, peer, guard }) = handoff else { break };
                let stream = match TcpStream::from_std(stream) {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::warn!(error = %e, "worker cannot take a connection");
                        continue;
                    }
                };
                let (inner, tls, shutdown) =
                    (inner.clone(), tls.clone(), connection_shutdown.clone());
                connections.spawn(async move {
                    serve_connection(stream, peer, tls, inner, worker, shutdown).await;
                    drop(guard);
                });
            }
        }
    }
    stop_connections.fire();
    drop(handed);
    let open = connections.len();
    if open > 0 {
        tracing::info!(
            worker,
            connections = open,
            grace_secs = grace.as_secs(),
            "draining connections"
        );
    }
    let drained = tokio::time::timeout(grace, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            worker,
            grace_secs = grace.as_secs(),
            "grace period over; closing the remaining connections"
        );
    }
    connections.abort_all();
    while connections.join_next().await.is_some() {}
}

/// What an HTTP/2 client sends first (RFC 9113 §3.4); an HTTP/1 request never starts so.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Reads until the first bytes show whether the client speaks HTTP/2 with prior knowledge;
/// `None` if it leaves first.
async fn sniff_h2(stream: &mut TcpStream, buf: &mut BytesMut) -> Option<bool> {
    loop {
        let n = buf.len().min(H2_PREFACE.len());
        if buf[..n] != H2_PREFACE[..n] {
            return Some(false);
        }
        if n == H2_PREFACE.len() {
            return Some(true);
        }
        if !matches!(stream.read_buf(buf).await, Ok(r) if r > 0) {
            return None;
        }
    }
}

async fn serve_connection(
    mut stream: TcpStream,
    peer: SocketAddr,
    tls: Option<TlsIngress>,
    inner: Arc<Inner>,
    worker: usize,
    mut shutdown: Shutdown,
) {
    let opened = Instant::now();
    let client = Arc::new(upstream::ClientConn::new(peer, tls.is_some(), worker));
    let result = match tls {
        None => {
            let mut buf = BytesMut::with_capacity(16 * 1024);
            let first_bytes_due = opened + inner.client_limits.header;
            let sniffed = tokio::select! {
                sniffed = sniff_h2(&mut stream, &mut buf) => sniffed,
                () = shutdown.wait() => return,
                () = tokio::time::sleep_until(first_bytes_due) => {
                    inner.metrics.client_timeout(ClientTimeout::Header);
                    return;
                }
            };
            match sniffed {
                None => return,
                Some(false) => {
                    ingress::serve(stream, buf, inner, client, shutdown, opened).await;
                    return;
                }
                Some(true) => {
                    let io = Prefixed {
                        prefix: buf.freeze(),
                        inner: stream,
                    };
                    serve_h2(io, inner, client, shutdown, opened).await
                }
            }
        }
        Some(tls) => {
            let deadline = opened + TLS_HANDSHAKE_TIMEOUT;
            let handshake = tokio::select! {
                handshake = tls.accept(stream, deadline, &inner.metrics) => handshake,
                () = shutdown.wait() => return,
            };
            let stream = match handshake {
                Ok(s) => s,
                Err(e) => {
                    tracing::debug!(%peer, error = %e, "no TLS session");
                    match e {
                        HandshakeError::Failed(_) => {}
                        HandshakeError::TimedOut => {
                            inner.metrics.client_timeout(ClientTimeout::Header)
                        }
                        HandshakeError::NoPermit => inner
                            .metrics
                            .connection_refused(ConnectionRefusal::TlsHandshakes),
                    }
                    return;
                }
            };
            if stream.get_ref().1.alpn_protocol() != Some(b"h2") {
                ingress::serve(stream, BytesMut::new(), inner, client, shutdown, opened).await;
                return;
            }
            serve_h2(stream, inner, client, shutdown, opened).await
        }
    };
    if let Err(e) = result {
        tracing::debug!(%peer, error = %e, "connection ended with an error");
    }
}

/// Serves an HTTP/2 connection with hyper, each request through [`upstream::handle`], until
/// the client closes it, or it has had no open stream for the idle timeout or `shutdown`
/// fires (then GOAWAY, and the open streams finish). A client that leaves a stream's data
/// unread for the send timeout, before or after GOAWAY, has the connection closed under it,
/// which cancels its upstream requests.
async fn serve_h2<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    io: S,
    inner: Arc<Inner>,
    client: Arc<upstream::ClientConn>,
    mut shutdown: Shutdown,
    opened: Instant,
) -> Result<(), hyper::Error> {
    let limits = inner.client_limits;
    let metrics = inner.metrics.clone();
    let streams = Arc::new(OpenStreams::new(opened));
    let service = service_fn({
        let streams = streams.clone();
        move |req| {
            let (inner, client, open) = (inner.clone(), client.clone(), streams.open());
            async move {
                let response = upstream::handle(inner, req, client).await;
                Ok::<_, Infallible>(response.map(|body| Tracked { body, open }))
            }
        }
    });
    let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
        .serve_connection(TokioIo::new(io), service);
    tokio::pin!(conn);
    let mut deadline = Deadline::new(opened + limits.idle);
    // After GOAWAY the open streams finish, still within the send limit.
    let mut closing = false;
    loop {
        tokio::select! {
            done = conn.as_mut() => return done,
            () = shutdown.wait(), if !closing => {
                closing = true;
                conn.as_mut().graceful_shutdown();
            }
            () = deadline.reached(streams.next_check(&limits)) => {
                match streams.expired(&limits) {
                    Some(ClientTimeout::Send) => {
                        metrics.client_timeout(ClientTimeout::Send);
                        tracing::debug!("HTTP/2 client took no response data within client.send_timeout_ms; closing");
                        return Ok(());
                    }
                    Some(limit) if !closing => {
                        metrics.client_timeout(limit);
                        closing = true;
                        conn.as_mut().graceful_shutdown();
                    }
                    _ => {}
                }
            }
        }
    }
}

/// The streams open on an HTTP/2 connection, since when it has had none, and which of them
/// wait for the client to make room for their data.
struct OpenStreams {
    state: parking_lot::Mutex<StreamsState>,
}

struct StreamsState {
    open: usize,
    idle_since: Instant,
    next_id: u64,
    /// Streams whose last data frame hyper holds until the client opens its flow-control
    /// window, each with the time it started waiting.
    waiting: Vec<(u64, Instant)>,
}

impl OpenStreams {
    fn new(opened: Instant) -> Self {
        Self {
            state: parking_lot::Mutex::new(StreamsState {
                open: 0,
                idle_since: opened,
                next_id: 0,
                waiting: Vec::new(),
            }),
        }
    }

    fn open(self: &Arc<Self>) -> StreamOpen {
        let mut state = self.state.lock();
        state.open += 1;
        state.next_id += 1;
        StreamOpen {
            streams: self.clone(),
            id: state.next_id,
            waiting: false,
        }
    }

    /// When to look again: when the connection will have idled for the idle limit (with a
    /// stream open, an idle limit from now), and at least every half send limit, so a stall
    /// is found between one and one and a half send limits after it began.
    fn next_check(&self, limits: &ClientLimits) -> Instant {
        let state = self.state.lock();
        let now = Instant::now();
        let idle_end = if state.open > 0 {
            now + limits.idle
        } else {
            state.idle_since + limits.idle
        };
        idle_end.min(now + limits.send / 2)
    }

    /// The limit the connection has run past, if any.
    fn expired(&self, limits: &ClientLimits) -> Option<ClientTimeout> {
        let state = self.state.lock();
        let now = Instant::now();
        if state
            .waiting
            .iter()
            .any(|&(_, since)| since + limits.send <= now)
        {
            Some(ClientTimeout::Send)
        } else if state.open == 0 && state.idle_since + limits.idle <= now {
            Some(ClientTimeout::Idle)
        } else {
            None
        }
    }
}

/// One open stream: counted from its request until its response body ends or is dropped.
struct StreamOpen {
    streams: Arc<OpenStreams>,
    id: u64,
    waiting: bool,
}

impl StreamOpen {
    /// Marks the stream as waiting for the client to take its data, or not.
    fn set_waiting(&mut self, waiting: bool) {
        if self.waiting == waiting {
            return;
        }
        self.waiting = waiting;
        let mut state = self.streams.state.lock();
        if waiting {
            state.waiting.push((self.id, Instant::now()));
        } else {
            state.waiting.retain(|&(id, _)| id != self.id);
        }
    }
}

impl Drop for StreamOpen {
    fn drop(&mut self) {
        self.set_waiting(false);
        let mut state = self.streams.state.lock();
        state.open -= 1;
        if state.open == 0 {
            state.idle_since = Instant::now();
        }
    }
}

/// A response body that keeps its stream counted open while it is sent. hyper polls it for
/// the next frame only once the client has room for more, so a frame handed over and not
/// followed by a poll is data the client has not taken.
struct Tracked<B> {
    body: B,
    open: StreamOpen,
}

impl<B: hyper::body::Body + Unpin> hyper::body::Body for Tracked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<B::Data>, B::Error>>> {
        let this = &mut *self;
        this.open.set_waiting(false);
        let polled = std::pin::Pin::new(&mut this.body).poll_frame(cx);
        if let std::task::Poll::Ready(Some(Ok(frame))) = &polled {
            if frame.is_data() && !this.body.is_end_stream() {
                this.open.set_waiting(true);
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// A stream whose first bytes were already read: they are read again before the rest.
struct Prefixed<S> {
    prefix: Bytes,
    inner: S,
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            buf.put_slice(&self.prefix[..n]);
            self.prefix.advance(n);
            return std::task::Poll::Ready(Ok(()));
        }
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
