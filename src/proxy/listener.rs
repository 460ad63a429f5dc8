//! Listener: accepts connections and serves each on its own task: HTTP/1.1 by [`ingress`],
//! HTTP/2 (h2c by its preface, or TLS with ALPN h2) by hyper; drains them within the grace
//! period on shutdown.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use metrics::Gauge;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;

use super::config::TlsConfig;
use super::ingress_h2::{serve as serve_h2, sniff_h2, Prefixed};
use super::metrics::{ClientTimeout, ConnectionRefusal};
use super::{arrival, forwarded, ingress, Inner, ProxyError};
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
pub(crate) fn tls_acceptor(cfg: &TlsConfig) -> Result<TlsAcceptor, ProxyError> {
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
pub(crate) async fn serve(
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
        let (tls, inner, shutdown) = (tls.clone(), inner.clone(), shutdown.clone());
        let open = Arc::new(AtomicUsize::new(0));
        let gauge = inner.metrics.worker_connections(worker);
        let spawned = spawn_worker_thread(format!("agentrace-proxy-{worker}"), move || {
            worker_loop(connections, worker, tls, inner, shutdown, grace)
        });
        match spawned {
            Ok(finished_rx) => {
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

/// Starts thread `name` running `work` on a single-threaded runtime of its own, so a
/// connection's tasks never wake one another across cores. The receiver resolves once the
/// work has ended and its runtime, with whatever tasks it still held, is dropped.
pub(crate) fn spawn_worker_thread<F, Fut>(
    name: String,
    work: F,
) -> std::io::Result<tokio::sync::oneshot::Receiver<()>>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()>,
{
    let (finished, finished_rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new().name(name).spawn(move || {
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
        runtime.block_on(work());
        drop(runtime);
        let _ = finished.send(());
    })?;
    Ok(finished_rx)
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

/// Serves one connection. Every path but plain HTTP/1.1 (the common one) runs boxed: a
/// connection's task is as large as its largest path, and the TLS and HTTP/2 paths would
/// otherwise make every plain connection's task a fifth larger (10.8 KB, not 8.4 KB).
async fn serve_connection(
    mut stream: TcpStream,
    peer: SocketAddr,
    tls: Option<TlsIngress>,
    inner: Arc<Inner>,
    worker: usize,
    mut shutdown: Shutdown,
) {
    let opened = Instant::now();
    let client = Arc::new(forwarded::ClientConn::new(peer, tls.is_some(), worker));
    let result = match tls {
        None => {
            let mut buf = BytesMut::with_capacity(16 * 1024);
            let first_bytes_due = opened + inner.client_limits.header;
            // With a recorder on, the first request's start is when its first byte arrived.
            let stamp = inner.sink.is_some();
            let mut arrived = None;
            let sniffed = tokio::select! {
                sniffed = async {
                    if stamp {
                        arrived = arrival::first_byte(&stream).await;
                    }
                    sniff_h2(&mut stream, &mut buf).await
                } => sniffed,
                () = shutdown.wait() => return,
                () = tokio::time::sleep_until(first_bytes_due) => {
                    inner.metrics.client_timeout(ClientTimeout::Header);
                    return;
                }
            };
            match sniffed {
                None => return,
                Some(false) => {
                    ingress::serve(stream, buf, inner, client, shutdown, opened, arrived).await;
                    return;
                }
                Some(true) => {
                    let io = Prefixed {
                        prefix: buf.freeze(),
                        inner: stream,
                    };
                    Box::pin(serve_h2(io, inner, client, shutdown, opened)).await
                }
            }
        }
        Some(tls) => {
            let deadline = opened + TLS_HANDSHAKE_TIMEOUT;
            let handshake = tokio::select! {
                handshake = Box::pin(tls.accept(stream, deadline, &inner.metrics)) => handshake,
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
                let (buf, arrived) = (BytesMut::new(), None);
                Box::pin(ingress::serve(
                    stream, buf, inner, client, shutdown, opened, arrived,
                ))
                .await;
                return;
            }
            Box::pin(serve_h2(stream, inner, client, shutdown, opened)).await
        }
    };
    if let Err(e) = result {
        tracing::debug!(%peer, error = %e, "connection ended with an error");
    }
}
