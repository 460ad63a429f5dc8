//! The picker's gRPC listener: accepts connections for tonic, one at a time, bounded, and
//! deals them out to the gRPC worker threads.
//!
//! tonic's own listener stream applies none of its builder's socket settings when the
//! listener is handed over, and keeps no count: so the accept loop is ours. Every accepted
//! socket gets `TCP_NODELAY` (with Nagle on, a small reply waits for the gateway's delayed
//! ACK, ~40 ms a message); connections past `epp.max_connections` are closed at once; a
//! connection that reads nothing with no ext_proc stream open for `epp.idle_timeout_ms` is
//! closed, and one that has not yet opened a stream after 10 s of silence; accept errors (out of descriptors) back off instead of spinning, with a log line.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};

use crate::proxy::metrics::ProxyMetrics;
use crate::shutdown::Shutdown;

/// First pause after a failed accept; doubled up to [`ACCEPT_BACKOFF_MAX`] while accepts keep
/// failing, so a listener out of descriptors costs no CPU while connections close.
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(10);
/// Longest pause after a failed accept.
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);
/// Refusals of one kind logged at most this often (each is counted in the metric).
const LOG_EVERY: Duration = Duration::from_secs(10);
/// The idle timeout of a connection that has not yet opened an ext_proc stream, when shorter
/// than `epp.idle_timeout_ms`: the gateway opens one as soon as it connects, so silent
/// connections that never do cannot hold `epp.max_connections` against it for long.
const IDLE_BEFORE_FIRST_STREAM: Duration = Duration::from_secs(10);

/// What bounds the listener.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// `epp.max_connections`.
    pub(crate) max_connections: usize,
    /// `epp.idle_timeout_ms`.
    pub(crate) idle: Duration,
}

/// One connection's state, shared by its socket and the streams on it (tonic hands it to
/// each request as its connect info).
#[derive(Debug)]
pub(crate) struct ConnState {
    /// The gateway's address.
    pub(crate) peer: SocketAddr,
    /// ext_proc streams open: the connection is not idle while one is.
    streams: AtomicUsize,
    /// An ext_proc stream was opened: from then on the full idle timeout applies.
    streamed: AtomicBool,
    /// A refusal on this connection was logged: one line per connection, not per message.
    logged: AtomicBool,
}

impl ConnState {
    fn new(peer: SocketAddr) -> Arc<Self> {
        Arc::new(Self {
            peer,
            streams: AtomicUsize::new(0),
            streamed: AtomicBool::new(false),
            logged: AtomicBool::new(false),
        })
    }

    /// Counts a stream open until the guard drops.
    pub(crate) fn stream_opened(self: &Arc<Self>) -> OpenStream {
        self.streams.fetch_add(1, Ordering::Relaxed);
        self.streamed.store(true, Ordering::Relaxed);
        OpenStream(self.clone())
    }

    /// True the first time only: whether a refusal on this connection is still to be logged.
    pub(crate) fn first_refusal(&self) -> bool {
        !self.logged.swap(true, Ordering::Relaxed)
    }
}

/// An ext_proc stream counted open on its connection.
pub(crate) struct OpenStream(Arc<ConnState>);

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0.streams.fetch_sub(1, Ordering::Relaxed);
    }
}

/// An accepted connection as tonic serves it: the socket, its permit under
/// `epp.max_connections`, and its idle timer.
pub(crate) struct Conn {
    stream: TcpStream,
    state: Arc<ConnState>,
    idle_after: Duration,
    idle: Pin<Box<Sleep>>,
    /// Bytes were read since the idle timer was last armed.
    read_since: bool,
    metrics: ProxyMetrics,
    _permit: OwnedSemaphorePermit,
}

impl Conn {
    /// Whether Nagle is off on the socket (read back from the kernel).
    #[cfg(test)]
    fn nodelay(&self) -> bool {
        self.stream.nodelay().unwrap_or(false)
    }

    /// The idle timeout that applies now.
    fn idle_timeout(&self) -> Duration {
        if self.state.streamed.load(Ordering::Relaxed) {
            self.idle_after
        } else {
            self.idle_after.min(IDLE_BEFORE_FIRST_STREAM)
        }
    }

    /// Polls the idle timer: an error once the connection has been idle for the timeout.
    fn poll_idle(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        while self.idle.as_mut().poll(cx).is_ready() {
            let busy = self.state.streams.load(Ordering::Relaxed) > 0;
            if !busy && !self.read_since {
                self.metrics.epp_refused("idle_timeout");
                tracing::debug!(peer = %self.state.peer, "epp connection idle: closing it");
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "epp connection idle past epp.idle_timeout_ms",
                ));
            }
            self.read_since = false;
            let next = Instant::now() + self.idle_timeout();
            self.idle.as_mut().reset(next);
        }
        Ok(())
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.stream).poll_read(cx, buf) {
            Poll::Ready(r) => {
                if buf.filled().len() > before {
                    self.read_since = true;
                }
                Poll::Ready(r)
            }
            Poll::Pending => match self.poll_idle(cx) {
                Ok(()) => Poll::Pending,
                Err(e) => Poll::Ready(Err(e)),
            },
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for Conn {
    type ConnectInfo = Arc<ConnState>;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.state.clone()
    }
}

/// A log line at most every [`LOG_EVERY`], saying how many were not logged in between.
struct Throttled {
    last: Option<Instant>,
    unlogged: u64,
}

impl Throttled {
    fn new() -> Self {
        Self {
            last: None,
            unlogged: 0,
        }
    }

    /// Whether to log now, and how many went unlogged before.
    fn due(&mut self) -> Option<u64> {
        let now = Instant::now();
        if self.last.is_some_and(|t| now < t + LOG_EVERY) {
            self.unlogged += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.unlogged))
    }
}

/// Accepts on `tcp` until `shutdown`, handing the connections in turn to `workers` returned
/// streams (one per gRPC worker thread, for tonic's `serve_with_incoming_shutdown`).
pub(crate) fn incoming(
    tcp: TcpListener,
    limits: Limits,
    metrics: ProxyMetrics,
    shutdown: Shutdown,
    workers: usize,
) -> Vec<impl futures_util::Stream<Item = io::Result<Conn>>> {
    // Small: tonic takes each connection as it comes, and a full queue holds the accept loop
    // back rather than piling up sockets.
    let (senders, receivers): (Vec<_>, Vec<_>) =
        (0..workers.max(1)).map(|_| mpsc::channel(16)).unzip();
    tokio::spawn(accept_loop(tcp, limits, metrics, senders, shutdown));
    receivers
        .into_iter()
        .map(|rx| {
            futures_util::stream::unfold(rx, |mut rx| async move {
                rx.recv().await.map(|conn| (Ok(conn), rx))
            })
        })
        .collect()
}

async fn accept_loop(
    tcp: TcpListener,
    limits: Limits,
    metrics: ProxyMetrics,
    workers: Vec<mpsc::Sender<Conn>>,
    mut shutdown: Shutdown,
) {
    let mut turn = 0usize;
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let mut backoff = ACCEPT_BACKOFF_MIN;
    let (mut over_cap_log, mut error_log) = (Throttled::new(), Throttled::new());
    loop {
        let accepted = tokio::select! {
            _ = shutdown.wait() => return,
            accepted = tcp.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(a) => {
                backoff = ACCEPT_BACKOFF_MIN;
                a
            }
            Err(e) => {
                metrics.epp_refused("accept_error");
                if let Some(unlogged) = error_log.due() {
                    tracing::warn!(error = %e, pause = ?backoff, unlogged, "epp accept failed; pausing accepts");
                }
                tokio::select! {
                    _ = shutdown.wait() => return,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(ACCEPT_BACKOFF_MAX);
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            metrics.epp_refused("max_connections");
            if let Some(unlogged) = over_cap_log.due() {
                tracing::warn!(%peer, max_connections = limits.max_connections, unlogged, "epp connection refused: epp.max_connections open");
            }
            // Closed as it drops, before any gRPC: the client reconnects later or elsewhere.
            drop(stream);
            continue;
        };
        if let Err(e) = stream.set_nodelay(true) {
            tracing::warn!(%peer, error = %e, "cannot set TCP_NODELAY on an epp connection");
        }
        let conn = Conn {
            stream,
            state: ConnState::new(peer),
            idle_after: limits.idle,
            idle: Box::pin(tokio::time::sleep(
                limits.idle.min(IDLE_BEFORE_FIRST_STREAM),
            )),
            read_since: false,
            metrics: metrics.clone(),
            _permit: permit,
        };
        // In turn: a gateway keeps few long connections, each carrying all its streams.
        turn = turn.wrapping_add(1);
        if workers[turn % workers.len()].send(conn).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use futures_util::StreamExt;
    use tokio::io::AsyncReadExt;

    use super::*;

    async fn listening(
        limits: Limits,
    ) -> (
        SocketAddr,
        impl futures_util::Stream<Item = io::Result<Conn>>,
        crate::shutdown::Trigger,
    ) {
        let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = tcp.local_addr().unwrap();
        let (trigger, shutdown) = crate::shutdown::channel();
        let metrics = ProxyMetrics::new();
        let conns = incoming(tcp, limits, metrics, shutdown, 1).pop().unwrap();
        (addr, Box::pin(conns), trigger)
    }

    #[tokio::test]
    async fn every_accepted_socket_has_nagle_off() {
        let limits = Limits {
            max_connections: 4,
            idle: Duration::from_secs(60),
        };
        let (addr, mut conns, _stop) = listening(limits).await;
        for _ in 0..2 {
            let _client = TcpStream::connect(addr).await.unwrap();
            let conn = conns.next().await.unwrap().unwrap();
            assert!(
                conn.nodelay(),
                "TCP_NODELAY read back from the accepted socket"
            );
        }
    }

    #[tokio::test]
    async fn connections_past_the_cap_are_closed_and_a_freed_slot_is_reused() {
        let limits = Limits {
            max_connections: 2,
            idle: Duration::from_secs(60),
        };
        let (addr, mut conns, _stop) = listening(limits).await;
        let _a = TcpStream::connect(addr).await.unwrap();
        let first = conns.next().await.unwrap().unwrap();
        let _b = TcpStream::connect(addr).await.unwrap();
        let _second = conns.next().await.unwrap().unwrap();
        let mut over = TcpStream::connect(addr).await.unwrap();
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(10), over.read(&mut byte))
            .await
            .expect("the connection past the cap is closed");
        assert!(!matches!(read, Ok(n) if n > 0), "closed, got {read:?}");
        drop(first);
        let _c = TcpStream::connect(addr).await.unwrap();
        tokio::time::timeout(Duration::from_secs(10), conns.next())
            .await
            .expect("a freed slot takes a new connection")
            .unwrap()
            .unwrap();
    }

    #[tokio::test]
    async fn a_connection_with_nothing_read_and_no_stream_closes_after_the_idle_timeout() {
        let limits = Limits {
            max_connections: 4,
            idle: Duration::from_millis(200),
        };
        let (addr, mut conns, _stop) = listening(limits).await;
        let _client = TcpStream::connect(addr).await.unwrap();
        let mut conn = conns.next().await.unwrap().unwrap();
        let mut buf = [0u8; 8];
        let read = tokio::time::timeout(Duration::from_secs(10), conn.read(&mut buf))
            .await
            .expect("the idle timer ends the read");
        assert_eq!(read.unwrap_err().kind(), io::ErrorKind::TimedOut);

        // With a stream open, the same silence is not idleness.
        let _client = TcpStream::connect(addr).await.unwrap();
        let mut conn = conns.next().await.unwrap().unwrap();
        let _open = conn.state.stream_opened();
        let read = tokio::time::timeout(Duration::from_millis(800), conn.read(&mut buf)).await;
        assert!(read.is_err(), "still waiting for bytes: {read:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_connection_that_never_opened_a_stream_closes_before_the_idle_timeout() {
        let limits = Limits {
            max_connections: 4,
            idle: Duration::from_secs(300),
        };
        let (addr, mut conns, _stop) = listening(limits).await;
        let _client = TcpStream::connect(addr).await.unwrap();
        let mut conn = conns.next().await.unwrap().unwrap();
        let mut buf = [0u8; 8];
        let read = tokio::time::timeout(IDLE_BEFORE_FIRST_STREAM * 3, conn.read(&mut buf))
            .await
            .expect("closed well before epp.idle_timeout_ms");
        assert_eq!(read.unwrap_err().kind(), io::ErrorKind::TimedOut);
    }
}
