//! HTTP/2 ingress: one client connection (h2c, or TLS with ALPN h2) served by hyper, each
//! stream through [`upstream::handle`]. Its life is bounded as an HTTP/1.1 connection's is
//! (`[client]`): it closes once it has had no open stream for the idle timeout; a client that
//! leaves a stream's data unread past the send timeout is cut off; a graceful close (GOAWAY)
//! the client does not let finish is cut short after the close grace; and a client that
//! cancels stream after stream, each a backend request started for nothing, has its
//! connection closed and its new streams refused. An h2c client with prior knowledge is told
//! from an HTTP/1.1 one here too, by its preface, which is then read again by hyper.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use http::Response;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use metrics::Counter;
use pin_project_lite::pin_project;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::forwarded::ClientConn;
use super::ingress::{ClientLimits, Deadline};
use super::metrics::ClientTimeout;
use super::{upstream, Inner};
use crate::shutdown::Shutdown;

/// What an HTTP/2 client sends first (RFC 9113 §3.4); an HTTP/1 request never starts so.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Reads until the first bytes show whether the client speaks HTTP/2 with prior knowledge;
/// `None` if it leaves first.
pub(crate) async fn sniff_h2(stream: &mut TcpStream, buf: &mut BytesMut) -> Option<bool> {
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

/// Serves an HTTP/2 connection until the client closes it, or the proxy does: after GOAWAY
/// (no open stream for the idle timeout, `shutdown`, or too many cancelled streams) the open
/// streams finish and the client has the close grace to let the close complete, after which
/// the connection is dropped. A client that leaves a stream's data unread for the send
/// timeout, before or after GOAWAY, has the connection closed under it, which cancels its
/// upstream requests.
pub(crate) async fn serve<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    io: S,
    inner: Arc<Inner>,
    client: Arc<ClientConn>,
    mut shutdown: Shutdown,
    opened: Instant,
) -> Result<(), hyper::Error> {
    let limits = inner.client_limits;
    let metrics = inner.metrics.clone();
    let streams = Arc::new(OpenStreams::new(
        opened,
        &limits,
        metrics.cancelled_streams.clone(),
    ));
    let service = service_fn({
        let streams = streams.clone();
        // Admitted or refused as the stream arrives, before anything of it is forwarded.
        move |req| Serving {
            open: streams.admit(),
            response: upstream::handle(inner.clone(), req, client.clone()),
        }
    });
    let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
        .max_concurrent_streams(limits.h2_max_streams)
        .serve_connection(TokioIo::new(io), service);
    tokio::pin!(conn);
    let mut deadline = Deadline::new(opened + limits.idle);
    let mut closing: Option<Closing> = None;
    // Armed until the client ends the connection itself: streams dropped with a connection
    // the proxy drops are not the client's cancels.
    let mut proxy_drops = ProxyDrops(Some(streams.clone()));
    loop {
        let check_at = streams.next_check(&limits, closing.as_ref());
        tokio::select! {
            // First, so a close the client completed is never taken for an overdue one.
            biased;
            done = conn.as_mut() => {
                proxy_drops.0 = None;
                return done;
            }
            () = shutdown.wait(), if closing.is_none() => {
                closing = Some(Closing::now());
                conn.as_mut().graceful_shutdown();
                continue;
            }
            () = streams.changed.notified() => {}
            () = deadline.reached(check_at) => {}
        }
        match streams.verdict(&limits, closing.as_ref()) {
            Verdict::Serve => {}
            Verdict::Stalled => {
                metrics.client_timeout(ClientTimeout::Send);
                tracing::debug!(
                    "HTTP/2 client took no response data within client.send_timeout_ms; closing"
                );
                return Ok(());
            }
            Verdict::Close(reason) => {
                // Counted as the close begins (before the client can see it): from here the
                // connection is gone within the close grace, by force if need be.
                match reason {
                    CloseReason::Idle => metrics.client_timeout(ClientTimeout::Idle),
                    CloseReason::Cancels => {
                        metrics.cancel_limit_close();
                        tracing::debug!("HTTP/2 client cancelled more streams than client.h2_max_cancelled_streams allows; closing");
                    }
                }
                closing = Some(Closing::now());
                conn.as_mut().graceful_shutdown();
            }
            Verdict::Overdue => {
                metrics.client_timeout(ClientTimeout::Close);
                tracing::debug!("HTTP/2 client did not let the close finish within client.close_grace_ms; dropping the connection");
                return Ok(());
            }
        }
    }
}

pin_project! {
    /// A stream's request on its way to an answer. Fields drop in order: dropped before the
    /// answer (the client reset the stream), the stream is counted as cancelled before the
    /// backend request is dropped, so a backend never sees a cancel the proxy has not counted.
    struct Serving<F> {
        // `None`: the stream is refused.
        open: Option<StreamOpen>,
        #[pin]
        response: F,
    }
}

impl<F: Future<Output = Response<upstream::ProxyBody>>> Future for Serving<F> {
    type Output = Result<Response<Tracked<upstream::ProxyBody>>, h2::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if this.open.is_none() {
            // REFUSED_STREAM: not processed, so the client may send it again elsewhere.
            return Poll::Ready(Err(h2::Error::from(h2::Reason::REFUSED_STREAM)));
        }
        let response = std::task::ready!(this.response.poll(cx));
        let open = this.open.take().expect("checked above");
        Poll::Ready(Ok(response.map(|body| Tracked { body, open })))
    }
}

/// Why the proxy is closing a connection gracefully.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CloseReason {
    Idle,
    /// The client cancelled more streams than the limits allow.
    Cancels,
}

/// A graceful close under way: since when (the close grace runs from then).
struct Closing {
    since: Instant,
}

impl Closing {
    fn now() -> Self {
        Self {
            since: Instant::now(),
        }
    }
}

/// What the connection's limits call for now.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    Serve,
    /// A stream's data has waited on the client past the send timeout: drop the connection.
    Stalled,
    /// Start a graceful close.
    Close(CloseReason),
    /// A graceful close outlived its grace: drop the connection.
    Overdue,
}

/// Marks, when dropped armed, that the proxy is dropping the connection.
struct ProxyDrops(Option<Arc<OpenStreams>>);

impl Drop for ProxyDrops {
    fn drop(&mut self) {
        if let Some(streams) = self.0.take() {
            streams.state.lock().proxy_closed = true;
        }
    }
}

/// The streams open on an HTTP/2 connection, since when it has had none, which of them wait
/// for the client to make room for their data, and how the client has ended them.
struct OpenStreams {
    state: parking_lot::Mutex<StreamsState>,
    /// Signalled when the serving loop has something to act on: the cancel limit passed, or
    /// the last stream of a connection past its close grace ended.
    changed: Notify,
    max_open: usize,
    max_cancelled: u64,
    cancelled_share: f64,
    cancelled_total: Counter,
}

struct StreamsState {
    open: usize,
    idle_since: Instant,
    next_id: u64,
    /// Streams whose last data frame hyper holds until the client opens its flow-control
    /// window, each with the time it started waiting.
    waiting: Vec<(u64, Instant)>,
    /// Streams whose response was complete, and those the client ended before that.
    completed: u64,
    cancelled: u64,
    /// The client cancelled past the limits: new streams are refused, the connection closes.
    condemned: bool,
    /// A close past its grace waits only for the open streams: new streams are refused.
    refuse_new: bool,
    /// The proxy dropped the connection: what its streams lose is not the client's doing.
    proxy_closed: bool,
}

impl OpenStreams {
    fn new(opened: Instant, limits: &ClientLimits, cancelled_total: Counter) -> Self {
        Self {
            state: parking_lot::Mutex::new(StreamsState {
                open: 0,
                idle_since: opened,
                next_id: 0,
                waiting: Vec::new(),
                completed: 0,
                cancelled: 0,
                condemned: false,
                refuse_new: false,
                proxy_closed: false,
            }),
            changed: Notify::new(),
            max_open: limits.h2_max_streams as usize,
            max_cancelled: limits.h2_max_cancelled,
            cancelled_share: limits.h2_cancelled_share,
            cancelled_total,
        }
    }

    /// A new stream, counted open; `None` if it is to be refused. A stream counts open until
    /// its backend request has ended, so streams the client reset still count until hyper has
    /// dropped them: a reset storm cannot have more backend requests under way than
    /// `h2_max_concurrent_streams`, nor start more than that past the cancel limit.
    fn admit(self: &Arc<Self>) -> Option<StreamOpen> {
        let mut state = self.state.lock();
        if state.condemned || state.refuse_new || state.open >= self.max_open {
            return None;
        }
        state.open += 1;
        state.next_id += 1;
        Some(StreamOpen {
            streams: self.clone(),
            id: state.next_id,
            waiting: false,
            completed: false,
        })
    }

    /// When to look again: when the connection will have idled for the idle limit (with a
    /// stream open, an idle limit from now), or a close under way will have had its grace,
    /// and at least every half send limit, so a stall is found between one and one and a half
    /// send limits after it began.
    fn next_check(&self, limits: &ClientLimits, closing: Option<&Closing>) -> Instant {
        let state = self.state.lock();
        let now = Instant::now();
        let stall_check = now + limits.send / 2;
        match closing {
            // Past its grace, the close waits for the last stream, which signals `changed`.
            Some(_) if state.refuse_new => stall_check,
            Some(c) => stall_check.min(c.since + limits.close_grace),
            None if state.open > 0 => stall_check.min(now + limits.idle),
            None => stall_check.min(state.idle_since + limits.idle),
        }
    }

    /// What the limits call for now, given the close under way, if any.
    fn verdict(&self, limits: &ClientLimits, closing: Option<&Closing>) -> Verdict {
        let mut state = self.state.lock();
        let now = Instant::now();
        if state
            .waiting
            .iter()
            .any(|&(_, since)| since + limits.send <= now)
        {
            return Verdict::Stalled;
        }
        match closing {
            Some(c) if c.since + limits.close_grace <= now => {
                if state.open == 0 || state.condemned {
                    return Verdict::Overdue;
                }
                // The open streams finish under their own limits; nothing new starts.
                state.refuse_new = true;
                Verdict::Serve
            }
            Some(_) => Verdict::Serve,
            None if state.condemned => Verdict::Close(CloseReason::Cancels),
            None if state.open == 0 && state.idle_since + limits.idle <= now => {
                Verdict::Close(CloseReason::Idle)
            }
            None => Verdict::Serve,
        }
    }
}

/// One open stream: counted from its request until its response body ends or is dropped.
struct StreamOpen {
    streams: Arc<OpenStreams>,
    id: u64,
    waiting: bool,
    /// Whether the response went out whole (or ended as the proxy ended it).
    completed: bool,
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
    /// A stream dropped before its response was complete was ended by the client: it reset
    /// the stream (hyper then drops the request's future, which cancels the backend request)
    /// or closed the connection.
    fn drop(&mut self) {
        self.set_waiting(false);
        let streams = &*self.streams;
        let mut state = streams.state.lock();
        state.open -= 1;
        if state.open == 0 {
            state.idle_since = Instant::now();
            if state.refuse_new {
                streams.changed.notify_one();
            }
        }
        if self.completed {
            state.completed += 1;
            return;
        }
        if state.proxy_closed {
            return;
        }
        state.cancelled += 1;
        streams.cancelled_total.increment(1);
        let ended = state.cancelled + state.completed;
        if !state.condemned
            && state.cancelled > streams.max_cancelled
            && state.cancelled as f64 > streams.cancelled_share * ended as f64
        {
            state.condemned = true;
            streams.changed.notify_one();
        }
    }
}

/// A response body that keeps its stream counted open while it is sent. hyper polls it for
/// the next frame only once the client has room for more, so a frame handed over and not
/// followed by a poll is data the client has not taken.
struct Tracked<B: hyper::body::Body> {
    body: B,
    open: StreamOpen,
}

impl<B: hyper::body::Body> Drop for Tracked<B> {
    fn drop(&mut self) {
        // The body says it ended once its last frame went out, or after an upstream error
        // (which hyper sends on as a reset): either way not a cancel by the client.
        self.open.completed = self.body.is_end_stream();
    }
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
pub(crate) struct Prefixed<S> {
    pub(crate) prefix: Bytes,
    pub(crate) inner: S,
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
