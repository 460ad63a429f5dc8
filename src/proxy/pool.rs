//! Pool: each forwarding worker's keep-alive connections to the backends.
//!
//! An HTTP/1.1 connection is driven by the request that holds it, in that request's task: the
//! head is written and the response head read here, and the response body ([`UpstreamBody`])
//! reads the socket itself and hands the connection back when the body ends. A request so
//! costs no task hand-off, channel or second HTTP state machine, which on a busy proxy was most
//! of its own CPU time. Backends that choose HTTP/2 by ALPN share one hyper HTTP/2 connection.

use std::io::IoSlice;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::uri::PathAndQuery;
use http::{Method, Request, StatusCode, Uri};
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::Either;
use hyper::body::Incoming;
use hyper::client::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo};
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

use super::config::{BackendUrl, UpstreamConfig};
use super::fields::OutboundFields;
use super::held_body::HeldBody;
use super::ProxyError;
use crate::http1::{self, BodyDecoder, Decoded, Fields, H1Error, WireFields};
use crate::http_body::BoxError;
use crate::remote::{self, Trust};

/// Request bodies up to this size are copied behind the head, so both go out in one write.
const COPY_BODY_MAX: usize = 16 * 1024;

/// Interim (1xx) responses taken before a request's final one. A backend has use for a few at
/// most (`103 Early Hints`; `100 Continue` to an `Expect` the proxy never forwards); unbounded,
/// one that sends them endlessly would hold the request, its connection and a share of a core
/// for as long as it liked. hyper passes every one on and nginx skips any number; 32 leaves
/// room for any real use and ends a storm within a read or two.
const MAX_INTERIM_RESPONSES: usize = 32;

/// Why a request got no response head, told by whether the backend can have acted on it,
/// which decides whether sending it again may generate it twice.
///
/// The request provably did not reach the backend whole (so it may be sent again) when:
/// - no connection was made: [`PoolError::Connect`];
/// - writing it to an HTTP/1.1 connection failed ([`PoolError::NotSent`]). Its last bytes
///   never reached the socket, and a backend acts on a request only once it has all of it
///   (the head's final blank line, the whole `Content-Length` body), though it may have
///   received a prefix. A pooled connection found closed or readable before the write is
///   not used at all ([`WorkerPool::send`]).
/// - on HTTP/2, hyper handed the request back unsent, the backend refused the stream with
///   `REFUSED_STREAM`, or its `GOAWAY` named a last stream below this one (RFC 9113 §8.7:
///   both mean it did no processing): [`PoolError::NotSent`].
///
/// - the backend's kernel reset the connection before any response byte, whether it came in
///   place of a read or behind a close: [`PoolError::NotSent`]. A host answers with a reset
///   when its application closes a connection with bytes unread, or bytes arrive after it
///   closed (RFC 9293 §3.6.1 and RFC 1122 §4.2.2.13), so the backend's application never had
///   the whole request. This is the close that crosses a request written to a pooled
///   connection. (A server that resets on purpose, with a zero linger, after reading a whole
///   request is the exception, and that request gets no answer either way.)
///
/// Anything else is after the send: the request went out whole and the connection closed or
/// failed before any response byte ([`PoolError::NoResponse`]; the backend may be generating
/// it), or bytes came that are no usable response head ([`PoolError::BadResponse`]). A close
/// whose reset has not come back by the time the read ends falls here too: nothing then tells
/// it from a backend that took the request and died.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PoolError {
    /// No connection could be made (TCP, TLS or protocol handshake).
    #[error("connect: {step}: {source}")]
    Connect {
        /// Which step failed (`tcp connect error`, `TLS handshake`, …).
        step: &'static str,
        /// Why it failed, kept for whoever walks the chain; a timeout is `TimedOut`.
        #[source]
        source: std::io::Error,
    },
    /// The request provably did not reach the backend whole.
    #[error(transparent)]
    NotSent(BoxError),
    /// The request was sent whole; the connection ended before any response byte.
    #[error(transparent)]
    NoResponse(BoxError),
    /// Response bytes arrived, but no final response head the proxy can forward.
    #[error(transparent)]
    BadResponse(BoxError),
    /// The request could not be put together for this backend.
    #[error("bad upstream request: {0}")]
    Request(String),
}

impl PoolError {
    fn bad_response(e: impl Into<BoxError>) -> Self {
        PoolError::BadResponse(e.into())
    }
}

/// What is forwarded: the client's request with its headers already edited for the backend
/// (no `Host`, `Content-Length` or hop-by-hop fields).
pub(crate) struct UpstreamRequest<'a> {
    /// Method.
    pub method: &'a Method,
    /// Origin-form path and query, before the backend's base path is put in front.
    pub path_and_query: &'a PathAndQuery,
    /// Forwarded headers.
    pub headers: &'a OutboundFields,
    /// The whole body.
    pub body: &'a HeldBody,
    /// Whether to declare the body's length (the client sent a body, or said it had one).
    pub declare_length: bool,
    /// When it goes out: idle connections are judged by it, without reading the clock again.
    pub sent_at: Instant,
}

/// A backend's response head, its body still to stream from the connection.
pub(crate) struct UpstreamResponse {
    /// Status.
    pub status: StatusCode,
    /// Header fields as the backend sent them.
    pub headers: WireFields,
    /// The body.
    pub body: UpstreamBody,
}

/// A backend's origin ([`BackendUrl::origin`]), as the pool files its connections. Requests
/// share the backend's one `Arc`, so a lookup is normally a pointer comparison.
#[derive(Clone)]
struct Key(Arc<str>);

impl Key {
    fn is(&self, other: &Key) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.0 == other.0
    }
}

/// A backend connection's byte stream: TCP, or TLS over it.
enum BackendStream {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl AsyncRead for BackendStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            BackendStream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            BackendStream::Tls(s) => Pin::new(&mut **s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for BackendStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            BackendStream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            BackendStream::Tls(s) => Pin::new(&mut **s).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            BackendStream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            BackendStream::Tls(s) => Pin::new(&mut **s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            BackendStream::Plain(s) => Pin::new(s).poll_flush(cx),
            BackendStream::Tls(s) => Pin::new(&mut **s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            BackendStream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            BackendStream::Tls(s) => Pin::new(&mut **s).poll_shutdown(cx),
        }
    }
}

/// An HTTP/1.1 connection to a backend with its read buffer and head-writing buffer.
struct H1Conn {
    io: BackendStream,
    buf: BytesMut,
    out: Vec<u8>,
    /// Its last response was streamed: a close under the next request is the backend closing
    /// after streams (see [`AfterStream`]).
    after_stream: bool,
}

impl H1Conn {
    fn new(io: BackendStream) -> Self {
        Self {
            io,
            buf: BytesMut::new(),
            out: Vec::with_capacity(1024),
            after_stream: false,
        }
    }

    /// Whether an idle connection is still usable: no bytes and no close arrived while it
    /// idled. Asks the kernel (a non-blocking peek): the runtime learns of a close only when
    /// its reactor next polls, and a backend that closes right after each response (as
    /// llama-server does) would otherwise have its connection reused after the close arrived.
    fn still_open(&mut self) -> bool {
        self.buf.is_empty() && nothing_arrived(peek_one(self.tcp()))
    }

    /// [`H1Conn::still_open`] without a system call when the runtime has seen nothing arrive
    /// on the connection since it was last read to the end: what arrives while a worker runs
    /// is reported at its next turn of the reactor, within microseconds under load and at once
    /// when idle. Only a connection the runtime marks readable is peeked at, so the common
    /// case, a quiet connection, costs no `recv` that fails with `EAGAIN`. A close that lands
    /// after the reactor's last turn is a close that crosses the request (see [`PoolError`]).
    fn seems_open(&mut self) -> bool {
        if !self.buf.is_empty() {
            return false;
        }
        let tcp = self.tcp();
        nothing_arrived(tcp.try_io(tokio::io::Interest::READABLE, || peek_one(tcp)))
    }

    /// The TCP socket under the connection, TLS or not.
    fn tcp(&self) -> &TcpStream {
        match &self.io {
            BackendStream::Plain(tcp) => tcp,
            BackendStream::Tls(tls) => tls.get_ref().0,
        }
    }

    async fn read_more(&mut self) -> std::io::Result<usize> {
        http1::read_some(&mut self.io, &mut self.buf).await
    }
}

struct Idle {
    conn: H1Conn,
    since: Instant,
}

#[derive(Default)]
struct Slot {
    idle: Vec<Idle>,
    h2: Option<http2::SendRequest<HeldBody>>,
    after_stream: AfterStream,
}

/// What a backend does with its connection after a chunked (streamed) response, learned from
/// the first one. llama-server closes it about 70 µs after the last chunk while advertising
/// keep-alive: a request sent on it at once would be written to a closing connection, and
/// then could not be sent again safely (see [`PoolError`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum AfterStream {
    /// Not seen yet: the first such connection is watched (`upstream.stream_close_watch_ms`:
    /// far longer than a server takes to close after its last chunk, far shorter than any
    /// keep-alive timeout) before reuse.
    #[default]
    Unknown,
    /// Kept it open: pooled as any other.
    KeepsOpen,
    /// Closed it, at the watch or under the next request: never pooled after a streamed
    /// response.
    Closes,
}

/// A connection pool (one per forwarding worker, one for health probes), offering HTTP/2 and
/// HTTP/1.1 to `https` backends, verified against `upstream.ca_file`, else the platform's CA
/// store; with no `https` backend the store is not read.
pub(crate) fn connection_pool(
    cfg: &UpstreamConfig,
    any_https: bool,
) -> Result<WorkerPool, ProxyError> {
    let trust = match &cfg.ca_file {
        Some(path) => Trust::CaFile(path),
        None if any_https => Trust::Platform,
        None => Trust::Nothing,
    };
    let tls = remote::client_config(trust, &[b"h2", b"http/1.1"])?;
    Ok(WorkerPool::new(
        tokio_rustls::TlsConnector::from(Arc::new(tls)),
        Duration::from_millis(cfg.connect_timeout_ms),
        cfg.pool_max_idle_per_backend,
        Duration::from_secs(cfg.pool_idle_timeout_secs),
        cfg.retry_after_send,
        Duration::from_millis(cfg.stream_close_watch_ms),
    ))
}

/// One forwarding worker's connections, by backend. Only that worker's thread takes from it
/// (the lock is uncontended); the housekeeping task reaps it from elsewhere.
pub(crate) struct WorkerPool {
    tls: TlsConnector,
    connect_timeout: Duration,
    /// By backend; a handful, so a scan beats hashing.
    slots: Mutex<Vec<(Key, Slot)>>,
    max_idle: usize,
    idle_timeout: Duration,
    /// `upstream.retry_after_send`: any request may be sent again after [`PoolError::NoResponse`].
    retry_after_send: bool,
    /// `upstream.stream_close_watch_ms`; zero trusts keep-alive after streams.
    stream_close_watch: Duration,
}

enum Sender {
    H1 { conn: H1Conn, reused: bool },
    H2(http2::SendRequest<HeldBody>),
}

impl WorkerPool {
    /// A pool that connects within `connect_timeout` (TLS by `tls`, which offers h2 and
    /// http/1.1) and keeps up to `max_idle` idle connections per backend for `idle_timeout`;
    /// `retry_after_send` lets [`WorkerPool::may_resend`] allow any method; a backend's first
    /// connection back from a stream is watched for `stream_close_watch` (`AfterStream`).
    pub(crate) fn new(
        tls: TlsConnector,
        connect_timeout: Duration,
        max_idle: usize,
        idle_timeout: Duration,
        retry_after_send: bool,
        stream_close_watch: Duration,
    ) -> Self {
        Self {
            tls,
            connect_timeout,
            slots: Mutex::new(Vec::new()),
            max_idle,
            idle_timeout,
            retry_after_send,
            stream_close_watch,
        }
    }

    /// Whether a request that failed as `e` may be sent again. One that provably did not reach
    /// the backend may; one sent whole with no answer may only if its method is safe (GET,
    /// HEAD, OPTIONS, TRACE: RFC 9110 §9.2.2 lets a client retry those, and a second one
    /// changes nothing) or `upstream.retry_after_send` is on, since the backend may be
    /// generating it already; one the backend answered, however badly, never.
    pub(crate) fn may_resend(&self, e: &PoolError, method: &Method) -> bool {
        match e {
            PoolError::Connect { .. } | PoolError::NotSent(_) => true,
            PoolError::NoResponse(_) => self.retry_after_send || method.is_safe(),
            PoolError::BadResponse(_) | PoolError::Request(_) => false,
        }
    }

    /// Sends `req` to `backend` and resolves with the response head; its body streams from
    /// the connection. An idle connection found closed is never written to. A pooled one that
    /// fails under the request (the backend's keep-alive timeout racing it) is replaced once by
    /// a fresh one when [`WorkerPool::may_resend`] allows; every other failure is returned for
    /// the caller's failover.
    pub(crate) async fn send(
        self: &Arc<Self>,
        backend: &BackendUrl,
        req: UpstreamRequest<'_>,
    ) -> Result<UpstreamResponse, PoolError> {
        let key = Key(backend.origin.clone());
        let mut fresh_only = false;
        loop {
            let sender = match (!fresh_only)
                .then(|| self.check_out(&key, req.sent_at))
                .flatten()
            {
                Some(sender) => sender,
                // Boxed: the handshakes' state is most of this future's size, and every
                // request would otherwise move it, though most reuse a connection.
                None => Box::pin(self.connect(&key, backend)).await?,
            };
            match sender {
                Sender::H2(send) => return self.send_h2(send, &key, backend, &req).await,
                Sender::H1 { conn, reused } => {
                    let after_stream = conn.after_stream;
                    match self.send_h1(conn, &key, backend, &req).await {
                        Ok(resp) => return Ok(resp),
                        Err(e) => {
                            if after_stream
                                && matches!(e, PoolError::NotSent(_) | PoolError::NoResponse(_))
                            {
                                self.learn_closes_after_stream(&key);
                            }
                            if !(reused && self.may_resend(&e, req.method)) {
                                return Err(e);
                            }
                            fresh_only = true;
                        }
                    }
                }
            }
        }
    }

    async fn send_h1(
        self: &Arc<Self>,
        mut conn: H1Conn,
        key: &Key,
        backend: &BackendUrl,
        req: &UpstreamRequest<'_>,
    ) -> Result<UpstreamResponse, PoolError> {
        // Lets the worker's other ready connections reach this point first, so a round of
        // requests goes to the backends in one burst: each backend then wakes once per round,
        // not once per request, which under load costs the backends and the proxy less CPU
        // than the wait (one pass of the worker's other tasks) costs this request.
        tokio::task::yield_now().await;
        conn.out.clear();
        let length = req.declare_length.then_some(req.body.len() as u64);
        http1::put_request_head(
            &mut conn.out,
            req.method,
            &[&backend.server.path, req.path_and_query.as_str()],
            &backend.host,
            req.headers.pairs(),
            length,
        );
        let head_request = req.method == Method::HEAD;
        let mut interim = 0;
        let mut received = false;
        let parts: Vec<&[u8]>;
        let whole: [&[u8]; 1];
        let early = {
            let H1Conn { io, buf, out, .. } = &mut conn;
            let bufs: &[&[u8]] = match req.body.single() {
                Some(body) if body.len() <= COPY_BODY_MAX => {
                    out.extend_from_slice(body);
                    whole = [&out[..]];
                    &whole
                }
                _ => {
                    parts = std::iter::once(&out[..])
                        .chain(req.body.parts().map(|p| &p[..]))
                        .collect();
                    &parts
                }
            };
            let mut watch = Watch {
                buf,
                head_request,
                interim: &mut interim,
                received: &mut received,
            };
            write_watching(io, bufs, &mut watch).await?
        };
        // A request cut short by an early answer leaves the connection mid-request: never reused.
        let sent_whole = early.is_none();
        let head = match early {
            Some(head) => head,
            None => loop {
                let mut watch = Watch {
                    buf: &mut conn.buf,
                    head_request,
                    interim: &mut interim,
                    received: &mut received,
                };
                if let Some(head) = watch.take_head()? {
                    break head;
                }
                match conn.read_more().await {
                    Ok(0) if !received => {
                        return Err(match conn.tcp().take_error() {
                            Ok(Some(e)) if is_reset(&e) => PoolError::NotSent(Box::new(e)),
                            _ => PoolError::NoResponse(
                                "the backend closed the connection without answering".into(),
                            ),
                        })
                    }
                    Ok(0) => return Err(PoolError::bad_response(H1Error::Incomplete)),
                    Ok(_) => received = true,
                    Err(e) if !received && is_reset(&e) => {
                        return Err(PoolError::NotSent(Box::new(e)))
                    }
                    Err(e) if !received => return Err(PoolError::NoResponse(Box::new(e))),
                    Err(e) => return Err(PoolError::bad_response(e)),
                }
            },
        };
        let mut body = H1Body {
            conn: Some(conn),
            decoder: BodyDecoder::new(head.framing),
            reusable: head.keep_alive && sent_whole,
            streamed: head.framing == http1::Framing::Chunked,
            eof: false,
            home: Some((key.clone(), self.clone())),
        };
        if body.decoder.is_done() {
            body.finish();
        }
        Ok(UpstreamResponse {
            status: head.status,
            headers: head.headers,
            body: Either::Left(body),
        })
    }

    async fn send_h2(
        &self,
        mut send: http2::SendRequest<HeldBody>,
        key: &Key,
        backend: &BackendUrl,
        req: &UpstreamRequest<'_>,
    ) -> Result<UpstreamResponse, PoolError> {
        let path = if backend.server.path.is_empty() {
            req.path_and_query.clone()
        } else {
            format!("{}{}", backend.server.path, req.path_and_query)
                .parse()
                .map_err(|e| PoolError::Request(format!("bad path: {e}")))?
        };
        let mut request = Request::new(req.body.clone());
        *request.method_mut() = req.method.clone();
        *request.uri_mut() = Uri::builder()
            .scheme(backend.server.scheme())
            .authority(backend.server.authority.clone())
            .path_and_query(path)
            .build()
            .map_err(|e| PoolError::Request(e.to_string()))?;
        *request.headers_mut() = req.headers.to_map();
        match send.try_send_request(request).await {
            Ok(resp) => {
                let (parts, body) = resp.into_parts();
                Ok(UpstreamResponse {
                    status: parts.status,
                    headers: WireFields::from_map(&parts.headers),
                    body: Either::Right(body),
                })
            }
            Err(mut e) => {
                // hyper hands the request back when it never reached the connection.
                let handed_back = e.take_message().is_some();
                let e = e.into_error();
                let refused = h2_refusal(&e);
                if send.is_closed() || refused == Some(H2Refusal::GoAway) {
                    self.forget_h2(key);
                }
                Err(if handed_back || refused.is_some() {
                    PoolError::NotSent(Box::new(e))
                } else {
                    PoolError::NoResponse(Box::new(e))
                })
            }
        }
    }

    /// The most recently used idle connection that is still open, or the backend's HTTP/2
    /// connection.
    fn check_out(&self, key: &Key, now: Instant) -> Option<Sender> {
        let mut slots = self.slots.lock();
        let slot = slots.iter_mut().find(|(k, _)| k.is(key)).map(|(_, s)| s)?;
        if let Some(h2) = &slot.h2 {
            if !h2.is_closed() {
                return Some(Sender::H2(h2.clone()));
            }
            slot.h2 = None;
        }
        while let Some(mut idle) = slot.idle.pop() {
            if now.saturating_duration_since(idle.since) <= self.idle_timeout
                && idle.conn.seems_open()
            {
                return Some(Sender::H1 {
                    conn: idle.conn,
                    reused: true,
                });
            }
        }
        None
    }

    /// Returns a connection whose response ended cleanly; after a streamed one, as the
    /// backend's [`AfterStream`] says.
    fn check_in(self: &Arc<Self>, key: &Key, mut conn: H1Conn, streamed: bool) {
        let mut slots = self.slots.lock();
        let slot = slot_of(&mut slots, key);
        conn.after_stream = streamed;
        match (streamed, slot.after_stream) {
            (true, AfterStream::Closes) => return,
            (true, AfterStream::Unknown) if !self.stream_close_watch.is_zero() => {
                drop(slots);
                let (pool, key) = (self.clone(), key.clone());
                tokio::spawn(async move {
                    tokio::time::sleep(pool.stream_close_watch).await;
                    let open = conn.still_open();
                    let mut slots = pool.slots.lock();
                    let slot = slot_of(&mut slots, &key);
                    if slot.after_stream == AfterStream::Unknown {
                        slot.after_stream = if open {
                            AfterStream::KeepsOpen
                        } else {
                            tracing::info!(
                                backend = &*key.0,
                                "the backend closes its connection after each streamed \
                                 response; a new one is opened for each"
                            );
                            AfterStream::Closes
                        };
                    }
                    if open
                        && slot.after_stream == AfterStream::KeepsOpen
                        && slot.idle.len() < pool.max_idle
                    {
                        slot.idle.push(Idle {
                            conn,
                            since: Instant::now(),
                        });
                    }
                });
                return;
            }
            _ => {}
        }
        if slot.idle.len() < self.max_idle {
            slot.idle.push(Idle {
                conn,
                since: Instant::now(),
            });
        }
    }

    /// A connection back from a streamed response was closed under the next request: the
    /// backend closes after streams whatever the watch saw (a loaded backend can take longer
    /// than the watch to close). Its other such idle connections are dropped before they
    /// cost a request too.
    fn learn_closes_after_stream(&self, key: &Key) {
        let mut slots = self.slots.lock();
        let slot = slot_of(&mut slots, key);
        if slot.after_stream != AfterStream::Closes {
            tracing::info!(
                backend = &*key.0,
                "a connection back from a streamed response was closed under the next \
                 request; a new one is opened after each stream from now on"
            );
            slot.after_stream = AfterStream::Closes;
        }
        slot.idle.retain(|idle| !idle.conn.after_stream);
    }

    fn forget_h2(&self, key: &Key) {
        if let Some((_, slot)) = self.slots.lock().iter_mut().find(|(k, _)| k.is(key)) {
            slot.h2 = None;
        }
    }

    /// Opens a connection (TLS with ALPN for `https`); an HTTP/2 one gets its task on this
    /// thread and is shared from then on.
    async fn connect(&self, key: &Key, backend: &BackendUrl) -> Result<Sender, PoolError> {
        let server = &backend.server;
        let timeout_ms = self.connect_timeout.as_millis();
        let tcp = match tokio::time::timeout(
            self.connect_timeout,
            TcpStream::connect((server.host.as_str(), server.port)),
        )
        .await
        {
            Ok(Ok(tcp)) => tcp,
            Ok(Err(e)) => return Err(connect_error("tcp connect error", e)),
            Err(_) => return Err(connect_timeout("tcp connect", timeout_ms)),
        };
        let _ = tcp.set_nodelay(true);
        if !server.tls {
            return Ok(Sender::H1 {
                conn: H1Conn::new(BackendStream::Plain(tcp)),
                reused: false,
            });
        }
        let name = server.server_name().map_err(|e| {
            connect_error(
                "invalid TLS server name",
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("{:?} ({e})", server.host),
                ),
            )
        })?;
        let tls =
            match tokio::time::timeout(self.connect_timeout, self.tls.connect(name, tcp)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(e)) => return Err(connect_error("TLS handshake", e)),
                Err(_) => return Err(connect_timeout("TLS handshake", timeout_ms)),
            };
        if tls.get_ref().1.alpn_protocol() != Some(b"h2") {
            return Ok(Sender::H1 {
                conn: H1Conn::new(BackendStream::Tls(Box::new(tls))),
                reused: false,
            });
        }
        let (send, conn) = http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
            .await
            .map_err(|e| connect_error("HTTP/2 handshake", std::io::Error::other(e)))?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "upstream HTTP/2 connection ended");
            }
        });
        slot_of(&mut self.slots.lock(), key).h2 = Some(send.clone());
        Ok(Sender::H2(send))
    }

    /// Drops connections idle for longer than the timeout and closed HTTP/2 connections.
    pub(crate) fn reap(&self) {
        let now = Instant::now();
        let mut slots = self.slots.lock();
        for (_, slot) in slots.iter_mut() {
            slot.idle
                .retain(|i| now.duration_since(i.since) <= self.idle_timeout);
            if slot.h2.as_ref().is_some_and(|h| h.is_closed()) {
                slot.h2 = None;
            }
        }
        slots.retain(|(_, s)| !s.idle.is_empty() || s.h2.is_some());
    }
}

fn connect_error(step: &'static str, source: std::io::Error) -> PoolError {
    PoolError::Connect { step, source }
}

fn connect_timeout(step: &'static str, timeout_ms: u128) -> PoolError {
    let source = std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("timed out after {timeout_ms} ms"),
    );
    PoolError::Connect { step, source }
}

/// The slot filed under `key`, added if there is none.
fn slot_of<'a>(slots: &'a mut Vec<(Key, Slot)>, key: &Key) -> &'a mut Slot {
    let at = match slots.iter().position(|(k, _)| k.is(key)) {
        Some(at) => at,
        None => {
            slots.push((key.clone(), Slot::default()));
            slots.len() - 1
        }
    };
    &mut slots[at].1
}

/// How an HTTP/2 backend said it did not process a stream (RFC 9113 §8.7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum H2Refusal {
    /// `RST_STREAM` with `REFUSED_STREAM`.
    Refused,
    /// A `GOAWAY` whose last stream id is below this stream's (or that came before it was
    /// opened); the connection takes no new streams.
    GoAway,
}

/// The refusal `e` reports, if any. h2 gives a stream a remote `GOAWAY` error only when the
/// frame's last stream id excludes it; a stream the backend kept ends some other way.
fn h2_refusal(e: &hyper::Error) -> Option<H2Refusal> {
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        if let Some(h2) = cause.downcast_ref::<h2::Error>() {
            if !h2.is_remote() {
                return None;
            }
            if h2.is_go_away() {
                return Some(H2Refusal::GoAway);
            }
            return (h2.is_reset() && h2.reason() == Some(h2::Reason::REFUSED_STREAM))
                .then_some(H2Refusal::Refused);
        }
        source = cause.source();
    }
    None
}

/// What the backend has sent while a request is written: its read buffer, and how far into a
/// response it is.
struct Watch<'a> {
    buf: &'a mut BytesMut,
    head_request: bool,
    interim: &'a mut usize,
    received: &'a mut bool,
}

impl Watch<'_> {
    /// The final response head in the buffer, past any interim ones; `None` until it is whole.
    fn take_head(&mut self) -> Result<Option<http1::ResponseHead>, PoolError> {
        loop {
            match http1::parse_response(self.buf, self.head_request) {
                Ok(Some(head)) if head.status == StatusCode::SWITCHING_PROTOCOLS => {
                    return Err(PoolError::bad_response(
                        "the backend switched protocols, which the proxy does not forward",
                    ))
                }
                // Interim responses (100, 103) are not forwarded; the final one follows.
                Ok(Some(head)) if head.status.is_informational() => {
                    *self.interim += 1;
                    if *self.interim > MAX_INTERIM_RESPONSES {
                        return Err(PoolError::bad_response(format!(
                            "the backend sent more than {MAX_INTERIM_RESPONSES} interim (1xx) \
                             responses without a final one"
                        )));
                    }
                }
                Ok(Some(head)) => return Ok(Some(head)),
                Ok(None) => return Ok(None),
                Err(e) => return Err(PoolError::bad_response(e)),
            }
        }
    }

    /// Reads what the backend sent: `Ok(false)` at the end of the stream.
    fn poll_read(
        &mut self,
        io: &mut BackendStream,
        cx: &mut Context<'_>,
    ) -> Poll<std::io::Result<bool>> {
        http1::reserve_read(self.buf);
        let read = std::task::ready!(tokio_util::io::poll_read_buf(Pin::new(io), cx, self.buf));
        let more = read? > 0;
        *self.received |= more;
        Poll::Ready(Ok(more))
    }
}

/// How writing a request ended.
enum Written {
    /// Whole and flushed.
    Whole,
    /// Cut short by the backend's final answer.
    Answered(http1::ResponseHead),
    /// The connection failed under it.
    Failed(std::io::Error),
    /// The backend sent something that is no response.
    Bad(PoolError),
}

/// Writes a request (its head, then its body's parts, in vectored writes of at most
/// [`PARTS_PER_WRITE`] slices) and flushes it, reading whatever the backend sends meanwhile.
/// A backend may answer before it has read the whole body (a 401 or 413 to a large upload,
/// RFC 9110 §15.5 and RFC 9112 §9.6) and then stop reading or close: the answer is what the
/// client should get, so a final response head that arrives while the socket takes no more
/// of the request ends the write and is returned (`Some`). A write that fails is checked for
/// such an answer received before the failure, since a backend that closes with the body
/// unread resets the connection behind its answer; without one it is [`PoolError::NotSent`].
/// The common case, a request the socket takes at once, reads nothing.
async fn write_watching(
    io: &mut BackendStream,
    bufs: &[&[u8]],
    watch: &mut Watch<'_>,
) -> Result<Option<http1::ResponseHead>, PoolError> {
    let (mut index, mut offset) = (0, 0);
    let mut read_ended = false;
    let written = std::future::poll_fn(|cx| loop {
        while bufs.get(index).is_some_and(|b| b.len() == offset) {
            (index, offset) = (index + 1, 0);
        }
        if index < bufs.len() {
            let mut slices = [IoSlice::new(&[]); PARTS_PER_WRITE];
            let mut n = 0;
            for (slot, b) in slices.iter_mut().zip(&bufs[index..]) {
                *slot = IoSlice::new(if n == 0 { &b[offset..] } else { b });
                n += 1;
            }
            match Pin::new(&mut *io).poll_write_vectored(cx, &slices[..n]) {
                Poll::Ready(Ok(0)) => {
                    return Poll::Ready(Written::Failed(std::io::ErrorKind::WriteZero.into()))
                }
                Poll::Ready(Ok(mut w)) => {
                    while w > 0 {
                        let left = bufs[index].len() - offset;
                        if w < left {
                            offset += w;
                            break;
                        }
                        w -= left;
                        (index, offset) = (index + 1, 0);
                    }
                    continue;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Written::Failed(e)),
                Poll::Pending => {}
            }
        } else {
            match Pin::new(&mut *io).poll_flush(cx) {
                Poll::Ready(Ok(())) => return Poll::Ready(Written::Whole),
                Poll::Ready(Err(e)) => return Poll::Ready(Written::Failed(e)),
                Poll::Pending => {}
            }
        }
        // The socket takes no more of the request now: has the backend answered?
        if read_ended {
            return Poll::Pending;
        }
        match std::task::ready!(watch.poll_read(io, cx)) {
            Ok(true) => match watch.take_head() {
                Ok(Some(head)) => return Poll::Ready(Written::Answered(head)),
                Ok(None) => {}
                Err(e) => return Poll::Ready(Written::Bad(e)),
            },
            // Closed for reading: the write alone decides.
            Ok(false) => read_ended = true,
            Err(e) => return Poll::Ready(Written::Failed(e)),
        }
    })
    .await;
    match written {
        Written::Whole => Ok(None),
        Written::Answered(head) => Ok(Some(head)),
        Written::Bad(e) => Err(e),
        Written::Failed(e) => match answered_before(io, watch).await? {
            Some(head) => Ok(Some(head)),
            None => Err(PoolError::NotSent(Box::new(e))),
        },
    }
}

/// A final response head the backend sent before its connection failed: what its kernel has
/// already received. The connection is dead, so the reads end at once (data, then the end or
/// the error); the bound is for a failure that leaves it open.
async fn answered_before(
    io: &mut BackendStream,
    watch: &mut Watch<'_>,
) -> Result<Option<http1::ResponseHead>, PoolError> {
    let read = async {
        loop {
            if let Some(head) = watch.take_head()? {
                return Ok(Some(head));
            }
            match std::future::poll_fn(|cx| watch.poll_read(io, cx)).await {
                Ok(true) => {}
                _ => return Ok(None),
            }
        }
    };
    tokio::time::timeout(ANSWER_AFTER_FAILURE, read)
        .await
        .unwrap_or(Ok(None))
}

/// How long a failed write waits for an answer already on its way.
const ANSWER_AFTER_FAILURE: Duration = Duration::from_secs(1);

/// Slices in one vectored write.
const PARTS_PER_WRITE: usize = 64;

/// A backend's response body, read from its connection as the client takes it: an HTTP/1.1
/// body decoded from the connection this request holds, or a stream of a shared HTTP/2
/// connection. `Either` dispatches each frame with a match, as a hand-written enum would, and
/// boxes only an error.
pub(crate) type UpstreamBody = Either<H1Body, Incoming>;

/// An HTTP/1.1 response body that owns its connection: when the body ends cleanly on a
/// keep-alive connection, the connection goes back to the pool; dropped before that, the
/// connection closes, which cancels the request on the backend.
pub(crate) struct H1Body {
    conn: Option<H1Conn>,
    decoder: BodyDecoder,
    reusable: bool,
    /// Chunked: the backend may close after it ([`AfterStream`]).
    streamed: bool,
    eof: bool,
    home: Option<(Key, Arc<WorkerPool>)>,
}

impl H1Body {
    fn finish(&mut self) {
        let (Some(conn), Some((key, pool))) = (self.conn.take(), self.home.take()) else {
            return;
        };
        // Bytes past the body mean the backend broke framing: never reuse such a connection.
        if self.reusable && conn.buf.is_empty() {
            pool.check_in(&key, conn, self.streamed);
        }
    }

    fn poll_data(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        loop {
            let Some(conn) = self.conn.as_mut() else {
                return Poll::Ready(None);
            };
            match self.decoder.decode(&mut conn.buf, self.eof) {
                Ok(Decoded::Data(data)) => {
                    if self.decoder.is_done() {
                        self.finish();
                    }
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Ok(Decoded::Done) => {
                    self.finish();
                    return Poll::Ready(None);
                }
                Ok(Decoded::NeedMore) => {}
                Err(e) => {
                    self.conn = None;
                    return Poll::Ready(Some(Err(Box::new(e))));
                }
            }
            http1::reserve_read(&mut conn.buf);
            match tokio_util::io::poll_read_buf(Pin::new(&mut conn.io), cx, &mut conn.buf) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(0)) => self.eof = true,
                Poll::Ready(Ok(_)) => {}
                Poll::Ready(Err(e)) => {
                    self.conn = None;
                    return Poll::Ready(Some(Err(Box::new(e))));
                }
            }
        }
    }
}

impl HttpBody for H1Body {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.get_mut().poll_data(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.conn.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        match self.decoder.remaining() {
            _ if self.conn.is_none() => SizeHint::with_exact(0),
            Some(n) => SizeHint::with_exact(n),
            None => SizeHint::new(),
        }
    }
}

/// Peeks at one byte without taking it: an idle connection shows nothing.
fn peek_one(tcp: &TcpStream) -> std::io::Result<usize> {
    let mut probe = [std::mem::MaybeUninit::<u8>::uninit(); 1];
    socket2::SockRef::from(tcp).peek(&mut probe)
}

/// Whether a connection error is a reset by the backend's kernel: `ECONNRESET` in place of a
/// read, or `EPIPE` when it came behind the backend's close (Linux reports a reset in
/// `CLOSE_WAIT` so).
fn is_reset(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
    )
}

/// Whether a peek found the connection quiet: neither bytes nor a close arrived.
fn nothing_arrived(peeked: std::io::Result<usize>) -> bool {
    matches!(peeked, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_refused_connect_keeps_its_io_error_and_prints_it_once() {
        // Bound but never listening: refused, and no other test's server can take the port.
        let held =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        let any: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
        held.bind(&any.into()).unwrap();
        let port = held.local_addr().unwrap().as_socket().unwrap().port();
        let backend = BackendUrl::parse(&format!("http://127.0.0.1:{port}")).unwrap();
        let tls = TlsConnector::from(Arc::new(
            crate::remote::client_config(crate::remote::Trust::Nothing, &[]).unwrap(),
        ));
        let pool = WorkerPool::new(
            tls,
            Duration::from_secs(5),
            1,
            Duration::from_secs(1),
            false,
            Duration::ZERO,
        );
        let Err(e) = pool.connect(&Key(backend.origin.clone()), &backend).await else {
            panic!("connected to a port nothing listens on");
        };
        let io = std::error::Error::source(&e)
            .and_then(|s| s.downcast_ref::<std::io::Error>())
            .expect("the io::Error is the source");
        assert_eq!(io.kind(), std::io::ErrorKind::ConnectionRefused);
        let chain = crate::telemetry::error_chain(&e);
        assert!(chain.starts_with("connect: tcp connect error: "), "{chain}");
        assert_eq!(chain.matches(&io.to_string()).count(), 1, "{chain}");
    }
}
