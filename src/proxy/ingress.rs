//! Ingress: one HTTP/1.1 client connection (plain or TLS), served in its own task. Each
//! request is read whole, handed to [`upstream::forward`], and its response written as the
//! body arrives. While the backend works, the connection is still read, so a client that
//! hangs up takes the upstream request down with it. The client's own pace is bounded
//! (`[client]`): a head, each read of a body, the idle time between requests, and each wait
//! for the client to take more of a response.

use std::future::Future;
use std::io::IoSlice;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use bytes::{BufMut, BytesMut};
use http::header;
use http::{Method, StatusCode, Version};
use http_body::Body as _;
use http_body_util::BodyExt;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::{Instant, Sleep};

use super::arrival::Arrivals;
use super::budget::BodyCharge;
use super::forwarded::ClientConn;
use super::held_body::{BodyParts, HeldBody};
use super::metrics::ClientTimeout;
use super::observed;
use super::upstream::{self, Answer, ClientRequest, Started};
use super::Inner;
use crate::http1::{self, BodyDecoder, Decoded, Fields, Framing, H1Error, OutFraming, RequestHead};
use crate::shutdown::Shutdown;

/// Body frames up to this size are copied behind their framing, so both go out in one write;
/// frames that have already arrived are gathered up to it too, so a burst of SSE events read
/// from the backend at once costs the client one write and one wake-up, not one per event.
const COPY_MAX: usize = 16 * 1024;

/// The client-side limits (`[client]` in the config).
#[derive(Debug, Clone, Copy)]
pub struct ClientLimits {
    pub header: Duration,
    pub body: Duration,
    pub idle: Duration,
    pub send: Duration,
    /// How long a graceful close may wait on the client before the connection is dropped.
    pub close_grace: Duration,
    pub h2_max_streams: u32,
    pub h2_max_cancelled: u64,
    pub h2_cancelled_share: f64,
}

impl From<&super::config::ClientConfig> for ClientLimits {
    fn from(c: &super::config::ClientConfig) -> Self {
        Self {
            header: Duration::from_millis(c.header_timeout_ms),
            body: Duration::from_millis(c.body_timeout_ms),
            idle: Duration::from_millis(c.idle_timeout_ms),
            send: Duration::from_millis(c.send_timeout_ms),
            close_grace: Duration::from_millis(c.close_grace_ms),
            h2_max_streams: c.h2_max_concurrent_streams,
            h2_max_cancelled: c.h2_max_cancelled_streams,
            h2_cancelled_share: c.h2_max_cancelled_share,
        }
    }
}

/// One timer for a connection's life. A deadline that moves later (every request moves the
/// idle one) costs nothing until the timer fires early and is set again, so a busy connection
/// touches the timer wheel once per timeout period, not once per request.
pub struct Deadline {
    sleep: Pin<Box<Sleep>>,
}

impl Deadline {
    pub fn new(at: Instant) -> Self {
        Self {
            sleep: Box::pin(tokio::time::sleep_until(at)),
        }
    }

    /// Resolves once `at` has passed.
    pub async fn reached(&mut self, at: Instant) {
        if self.sleep.deadline() > at {
            self.sleep.as_mut().reset(at);
        }
        loop {
            self.sleep.as_mut().await;
            if Instant::now() >= at {
                return;
            }
            self.sleep.as_mut().reset(at);
        }
    }
}

/// Runs a write to the client; one the client leaves waiting for `limit` fails as `TimedOut`.
/// The clock is read only once the write has to wait, so a write that goes straight out
/// costs no timer.
async fn within<T>(
    write: impl Future<Output = std::io::Result<T>>,
    limit: Duration,
    deadline: &mut Deadline,
) -> std::io::Result<T> {
    let mut write = std::pin::pin!(write);
    if let Poll::Ready(done) = std::future::poll_fn(|cx| Poll::Ready(write.as_mut().poll(cx))).await
    {
        return done;
    }
    let due = Instant::now() + limit;
    tokio::select! {
        biased;
        done = write => done,
        () = deadline.reached(due) => Err(std::io::ErrorKind::TimedOut.into()),
    }
}

/// The most one read of a body takes: with a read per connection per round of a worker's
/// tasks, this bounds how long a round of uploading connections keeps a small request waiting.
const BODY_READ_MAX: usize = 64 * 1024;

/// One read of a request body into `into`'s spare capacity (at most [`BODY_READ_MAX`]),
/// which must bring bytes within `limit` (the body timeout).
async fn read_body_into<R: AsyncRead + Unpin>(
    io: &mut R,
    into: &mut BytesMut,
    limit: Duration,
    deadline: &mut Deadline,
) -> Result<(), BodyError> {
    let due = Instant::now() + limit;
    let mut room = into.limit(BODY_READ_MAX);
    tokio::select! {
        read = io.read_buf(&mut room) => match read {
            Ok(n) if n > 0 => Ok(()),
            _ => Err(BodyError::Closed),
        },
        () = deadline.reached(due) => Err(BodyError::TimedOut),
    }
}

/// Lets the other connections on this worker, and its I/O driver, run between the reads of
/// a body: a client uploading at full speed always has bytes ready, and a worker's runtime
/// looks for new I/O events only between rounds of its tasks, so without this one upload
/// delayed every small request on the worker by tens of milliseconds per round trip.
async fn yield_to_other_connections() {
    tokio::task::yield_now().await;
}

/// Writes and flushes every byte of `bufs`, in as few system calls as the socket allows; the
/// client must take some of them within `limit` each time the socket is full.
async fn send_all<W: AsyncWrite + Unpin>(
    io: &mut W,
    mut bufs: &mut [IoSlice<'_>],
    limit: Duration,
    deadline: &mut Deadline,
) -> std::io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0);
    // A write that makes progress ends the wait, so the client's `limit` starts afresh.
    loop {
        let sent = std::future::poll_fn(|cx| poll_send(io, cx, &mut bufs));
        if within(sent, limit, deadline).await? {
            return Ok(());
        }
    }
}

/// Writes what the socket takes now: `Ready(Ok(true))` once all of `bufs` is written and
/// flushed, `Ready(Ok(false))` if some went out before the socket filled, `Pending` if none.
fn poll_send<W: AsyncWrite + Unpin>(
    io: &mut W,
    cx: &mut std::task::Context<'_>,
    bufs: &mut &mut [IoSlice<'_>],
) -> Poll<std::io::Result<bool>> {
    let mut wrote = false;
    while !bufs.is_empty() {
        match Pin::new(&mut *io).poll_write_vectored(cx, bufs) {
            Poll::Ready(Ok(0)) => return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into())),
            Poll::Ready(Ok(n)) => {
                IoSlice::advance_slices(bufs, n);
                wrote = true;
            }
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            Poll::Pending if wrote => return Poll::Ready(Ok(false)),
            Poll::Pending => return Poll::Pending,
        }
    }
    match Pin::new(&mut *io).poll_flush(cx) {
        Poll::Ready(result) => Poll::Ready(result.map(|()| true)),
        Poll::Pending if wrote => Poll::Ready(Ok(false)),
        Poll::Pending => Poll::Pending,
    }
}

/// Serves HTTP/1.1 requests on `io` until the client closes, asks to close, idles past the
/// idle timeout, or `shutdown` fires while the connection is idle; `buf` holds bytes already
/// read from it, and `opened` is when the connection was accepted. With a recorder on, a
/// request's start is when its first byte reached the host ([`Arrivals`]): `arrived` for the
/// bytes in `buf`, the kernel's stamp for a request that begins on an empty buffer.
pub async fn serve<S: AsyncRead + AsyncWrite + Arrivals + Unpin>(
    io: S,
    buf: BytesMut,
    inner: Arc<Inner>,
    client: Arc<ClientConn>,
    shutdown: Shutdown,
    opened: Instant,
    arrived: Option<u128>,
) {
    let limits = inner.client_limits;
    let mut conn = Downstream {
        io,
        buf,
        out: Vec::with_capacity(4096),
        limits,
        idle_since: opened,
        served: false,
        shut: false,
        stamp_arrivals: inner.sink.is_some(),
        arrived,
    };
    // One wait and one timer for the connection's life: they register once, not per request.
    let mut stop = std::pin::pin!(shutdown.clone().signalled());
    let mut deadline = Deadline::new(opened + limits.header);
    while let Next::KeepAlive = conn
        .exchange(&inner, &client, &shutdown, &mut stop, &mut deadline)
        .await
    {}
    // A TLS close is a write too: a client that reads nothing must not hold it open.
    if !conn.shut {
        let closed = within(conn.io.shutdown(), limits.close_grace, &mut deadline).await;
        if closed.is_err_and(|e| e.kind() == std::io::ErrorKind::TimedOut) {
            inner.metrics.client_timeout(ClientTimeout::Close);
        }
    }
}

enum Next {
    KeepAlive,
    Close,
}

/// Why a request body could not be read.
enum BodyError {
    TooLarge,
    /// Request bodies held by all requests together are at `request_body_budget_bytes`.
    OverBudget,
    Malformed(H1Error),
    Closed,
    TimedOut,
}

struct Downstream<S> {
    io: S,
    /// Bytes read and not yet parsed (the rest of a request, or the next pipelined one).
    buf: BytesMut,
    /// The response bytes being put together for the next write.
    out: Vec<u8>,
    limits: ClientLimits,
    /// When the connection last became idle: opened, or the last response written.
    idle_since: Instant,
    /// Whether a request has been answered on this connection.
    served: bool,
    /// Whether the sending side has been closed already (after a refusal).
    shut: bool,
    /// Whether requests are stamped with the kernel's receive time (a recorder is on).
    stamp_arrivals: bool,
    /// When the first byte of the request beginning in `buf` arrived, if known.
    arrived: Option<u128>,
}

impl<S: AsyncRead + AsyncWrite + Arrivals + Unpin> Downstream<S> {
    async fn read_more(&mut self) -> std::io::Result<usize> {
        http1::read_some(&mut self.io, &mut self.buf).await
    }

    /// Resolves once the client has hung up; bytes it sends meanwhile (a pipelined request)
    /// are kept for later. Stops watching once the buffer holds a whole head's worth.
    async fn hung_up(&mut self) {
        loop {
            if self.buf.len() >= http1::MAX_HEAD {
                std::future::pending::<()>().await;
            }
            if !matches!(self.read_more().await, Ok(n) if n > 0) {
                return;
            }
        }
    }

    async fn write_out(&mut self, deadline: &mut Deadline) -> std::io::Result<()> {
        let mut out = [IoSlice::new(&self.out)];
        send_all(&mut self.io, &mut out, self.limits.send, deadline).await?;
        self.out.clear();
        Ok(())
    }

    /// Reads, forwards and answers one request.
    async fn exchange(
        &mut self,
        inner: &Arc<Inner>,
        client: &ClientConn,
        shutdown: &Shutdown,
        stop: &mut Pin<&mut impl Future<Output = ()>>,
        deadline: &mut Deadline,
    ) -> Next {
        // Set when a head is found incomplete: only a head split over reads waits on it.
        let mut head_due = None;
        let mut arrived = self.arrived.take();
        let head = loop {
            match http1::parse_request(&mut self.buf) {
                Ok(Some(head)) => break head,
                Ok(None) => {}
                Err(H1Error::Connect) => {
                    let answer = upstream::refuse_connect(inner);
                    return self.close_with(inner, answer, deadline).await;
                }
                Err(e) => {
                    return self
                        .refuse(inner, e.status(), &e.to_string(), deadline)
                        .await
                }
            }
            let idle = self.buf.is_empty();
            let due = match (self.served, idle) {
                // A new connection has the header timeout to bring its first head.
                (false, _) => self.idle_since + self.limits.header,
                (true, true) => self.idle_since + self.limits.idle,
                (true, false) => {
                    *head_due.get_or_insert_with(|| Instant::now() + self.limits.header)
                }
            };
            // Biased: once bytes are there, neither the signal nor the timer is polled again.
            let stamp = idle && self.stamp_arrivals && arrived.is_none();
            let read = tokio::select! {
                biased;
                read = async {
                    if stamp {
                        arrived = self.io.first_byte().await;
                    }
                    self.read_more().await
                } => read,
                () = stop.as_mut(), if idle => return Next::Close,
                () = deadline.reached(due) => {
                    let limit = if idle && self.served {
                        ClientTimeout::Idle
                    } else {
                        ClientTimeout::Header
                    };
                    inner.metrics.client_timeout(limit);
                    if idle {
                        return Next::Close;
                    }
                    return self
                        .refuse(
                            inner,
                            StatusCode::REQUEST_TIMEOUT,
                            "request head not received in time",
                            deadline,
                        )
                        .await;
                }
            };
            if !matches!(read, Ok(n) if n > 0) {
                return Next::Close;
            }
        };
        let started = Started::arrived(inner, arrived);
        let limit = inner.max_request_body;
        // Held until the request has been forwarded (or abandoned): the end of this function.
        let mut charge = inner.body_budget.charge();
        let body = match self.read_body(&head, limit, &mut charge, deadline).await {
            Ok(body) => body,
            Err(BodyError::TooLarge) => {
                let answer = upstream::too_large(inner, limit);
                self.respond(inner, answer, false, head.version, false, deadline)
                    .await;
                self.linger(inner, deadline).await;
                return Next::Close;
            }
            Err(BodyError::OverBudget) => {
                // What was read is let go now, not when the connection ends; the rest of the
                // body is not read: answer and close.
                drop(charge);
                self.buf = BytesMut::new();
                let answer = upstream::over_budget(inner);
                self.respond(inner, answer, false, head.version, false, deadline)
                    .await;
                self.linger(inner, deadline).await;
                return Next::Close;
            }
            Err(BodyError::Malformed(e)) => {
                return self
                    .refuse(inner, StatusCode::BAD_REQUEST, &e.to_string(), deadline)
                    .await
            }
            Err(BodyError::Closed) => return Next::Close,
            Err(BodyError::TimedOut) => {
                inner.metrics.client_timeout(ClientTimeout::Body);
                return self
                    .refuse(
                        inner,
                        StatusCode::REQUEST_TIMEOUT,
                        "request body not received in time",
                        deadline,
                    )
                    .await;
            }
        };
        let RequestHead {
            method,
            uri,
            version,
            headers,
            keep_alive,
            ..
        } = head;
        let head_request = method == Method::HEAD;
        let req = ClientRequest {
            method,
            uri,
            headers,
            body,
        };
        let response = {
            let forwarding = upstream::forward(inner, req, client, started);
            tokio::pin!(forwarding);
            tokio::select! {
                biased;
                response = &mut forwarding => response,
                // Dropping the forwarding future closes the upstream connection.
                () = self.hung_up() => return Next::Close,
            }
        };
        drop(charge);
        let keep = keep_alive && !shutdown.is_fired();
        let next = self
            .respond(inner, response, head_request, version, keep, deadline)
            .await;
        self.served = true;
        self.idle_since = Instant::now();
        next
    }

    /// Reads the request body whole, within `limit` bytes, counting its bytes in `charge` as
    /// they arrive. A body that came with its head stays in the read buffer's memory; a
    /// longer one is gathered in parts ([`BodyParts`]), and the read buffer stays small.
    async fn read_body(
        &mut self,
        head: &RequestHead,
        limit: u64,
        charge: &mut BodyCharge<'_>,
        deadline: &mut Deadline,
    ) -> Result<HeldBody, BodyError> {
        let expects_continue = head.version == Version::HTTP_11
            && head
                .headers
                .first("expect")
                .is_some_and(|v| v.eq_ignore_ascii_case(b"100-continue"));
        match head.framing {
            Framing::Empty | Framing::UntilClose => Ok(HeldBody::default()),
            Framing::Length(n) => {
                if n > limit {
                    return Err(BodyError::TooLarge);
                }
                let n = n as usize;
                if self.buf.len() >= n {
                    if !charge.try_add(n as u64) {
                        return Err(BodyError::OverBudget);
                    }
                    let body = self.buf.split_to(n).freeze();
                    if n > COPY_MAX {
                        // Whatever follows the body shares its allocation: copied out, the
                        // next request does not keep the body's memory alive.
                        self.buf = BytesMut::from(&self.buf[..]);
                    }
                    return Ok(HeldBody::from(body));
                }
                // A declared length reserves nothing: parts grow as bytes arrive.
                let mut parts = BodyParts::new(n);
                if !parts.push_bytes(self.buf.split().freeze(), charge) {
                    return Err(BodyError::OverBudget);
                }
                if expects_continue {
                    self.send_continue(deadline).await?;
                }
                // Read straight into the parts, which never hold more than was declared.
                let gathered = async {
                    while parts.gathered() < n {
                        let room = parts.room(charge).ok_or(BodyError::OverBudget)?;
                        read_body_into(&mut self.io, room, self.limits.body, deadline).await?;
                        yield_to_other_connections().await;
                    }
                    Ok(())
                };
                let gathered = gathered.await;
                parts.finish_after(gathered)
            }
            Framing::Chunked => {
                if expects_continue && self.buf.is_empty() {
                    self.send_continue(deadline).await?;
                }
                let mut decoder = BodyDecoder::new(Framing::Chunked);
                let mut parts = BodyParts::new(usize::try_from(limit).unwrap_or(usize::MAX));
                let gathered = async {
                    loop {
                        loop {
                            match decoder
                                .decode(&mut self.buf, false)
                                .map_err(BodyError::Malformed)?
                            {
                                Decoded::Data(d) => {
                                    if (parts.gathered() + d.len()) as u64 > limit {
                                        return Err(BodyError::TooLarge);
                                    }
                                    if !parts.push(&d, charge) {
                                        return Err(BodyError::OverBudget);
                                    }
                                }
                                Decoded::NeedMore => break,
                                Decoded::Done => return Ok(()),
                            }
                        }
                        http1::reserve_read(&mut self.buf);
                        read_body_into(&mut self.io, &mut self.buf, self.limits.body, deadline)
                            .await?;
                        yield_to_other_connections().await;
                    }
                };
                let gathered = gathered.await;
                parts.finish_after(gathered)
            }
        }
    }

    async fn send_continue(&mut self, deadline: &mut Deadline) -> Result<(), BodyError> {
        const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";
        let limit = self.limits.send;
        send_all(&mut self.io, &mut [IoSlice::new(CONTINUE)], limit, deadline)
            .await
            .map_err(|_| BodyError::Closed)
    }

    /// Answers a request the proxy cannot read, and closes.
    async fn refuse(
        &mut self,
        inner: &Inner,
        status: StatusCode,
        message: &str,
        deadline: &mut Deadline,
    ) -> Next {
        let answer = upstream::refuse(inner, status, "invalid_request_error", message);
        self.close_with(inner, answer, deadline).await
    }

    /// Sends `answer` and closes.
    async fn close_with(&mut self, inner: &Inner, answer: Answer, deadline: &mut Deadline) -> Next {
        self.respond(inner, answer, false, Version::HTTP_11, false, deadline)
            .await;
        self.linger(inner, deadline).await;
        Next::Close
    }

    /// Ends the sending side and reads and drops what the client still sends until it hangs
    /// up, so that closing does not reset the connection before the client has read the
    /// answer; a client still there after `client.close_grace_ms` is cut off.
    async fn linger(&mut self, inner: &Inner, deadline: &mut Deadline) {
        self.shut = true;
        let due = Instant::now() + self.limits.close_grace;
        let hung_up = async {
            if self.io.shutdown().await.is_err() {
                return;
            }
            loop {
                self.buf.clear();
                if !matches!(self.read_more().await, Ok(n) if n > 0) {
                    return;
                }
            }
        };
        tokio::select! {
            () = hung_up => {}
            () = deadline.reached(due) => inner.metrics.client_timeout(ClientTimeout::Close),
        }
    }

    /// Writes `response`, its body frame by frame as it arrives; a frame that is ready goes out
    /// in the same write as what precedes it (the head, a chunk header).
    async fn respond(
        &mut self,
        inner: &Inner,
        answer: Answer,
        head_request: bool,
        version: Version,
        keep: bool,
        deadline: &mut Deadline,
    ) -> Next {
        let Answer {
            status,
            mut headers,
            mut body,
        } = answer;
        let bodiless = head_request
            || status.is_informational()
            || status == StatusCode::NO_CONTENT
            || status == StatusCode::NOT_MODIFIED;
        let framing = if bodiless || headers.has("content-length") {
            OutFraming::AsIs
        } else if let Some(n) = body.size_hint().exact() {
            headers.set(header::CONTENT_LENGTH, http1::length_value(n));
            OutFraming::AsIs
        } else if version == Version::HTTP_11 {
            OutFraming::Chunked
        } else {
            OutFraming::Close
        };
        let keep = keep && framing != OutFraming::Close;
        let next = if keep { Next::KeepAlive } else { Next::Close };
        self.out.clear();
        http1::put_response_head(
            &mut self.out,
            status,
            headers.pairs(),
            framing,
            !keep,
            keep && version == Version::HTTP_10,
        );
        if bodiless {
            return match self.write_out(deadline).await {
                Ok(()) => next,
                Err(e) => write_failed(inner, &e),
            };
        }
        loop {
            let ready = std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut body).poll_frame(cx)));
            let frame = match ready.await {
                Poll::Ready(frame) => frame,
                Poll::Pending => {
                    if !self.out.is_empty() {
                        if let Err(e) = self.write_out(deadline).await {
                            return write_failed(inner, &e);
                        }
                    }
                    tokio::select! {
                        biased;
                        frame = body.frame() => frame,
                        () = self.hung_up() => return Next::Close,
                    }
                }
            };
            let data = match frame {
                None => {
                    if framing == OutFraming::Chunked {
                        self.out.extend_from_slice(http1::LAST_CHUNK);
                    }
                    return match self.write_out(deadline).await {
                        Ok(()) => {
                            observed::delivered(&mut body, Instant::now());
                            next
                        }
                        Err(e) => write_failed(inner, &e),
                    };
                }
                // Cut after the head: the client sees the response end short.
                Some(Err(_)) => {
                    if let Err(e) = self.write_out(deadline).await {
                        return write_failed(inner, &e);
                    }
                    return Next::Close;
                }
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) if !data.is_empty() => data,
                    _ => continue,
                },
            };
            let end = body.is_end_stream();
            let tail: &[u8] = match (framing, end) {
                (OutFraming::Chunked, false) => b"\r\n",
                (OutFraming::Chunked, true) => b"\r\n0\r\n\r\n",
                _ => b"",
            };
            if framing == OutFraming::Chunked {
                http1::put_chunk_size(&mut self.out, data.len());
            }
            let written = if data.len() <= COPY_MAX {
                self.out.extend_from_slice(&data);
                self.out.extend_from_slice(tail);
                // The next frame may be here already; the next poll writes all of it out
                // before it waits for more.
                if !end && self.out.len() < COPY_MAX {
                    continue;
                }
                self.write_out(deadline).await
            } else {
                let mut slices = [
                    IoSlice::new(&self.out),
                    IoSlice::new(&data),
                    IoSlice::new(tail),
                ];
                let limit = self.limits.send;
                let written = send_all(&mut self.io, &mut slices, limit, deadline).await;
                self.out.clear();
                written
            };
            if let Err(e) = written {
                return write_failed(inner, &e);
            }
            if end {
                observed::delivered(&mut body, Instant::now());
                return next;
            }
        }
    }
}

/// A response the client could not be given: the connection closes (dropping the upstream body
/// cancels the backend's request); a client that stopped taking it is counted.
fn write_failed(inner: &Inner, e: &std::io::Error) -> Next {
    if e.kind() == std::io::ErrorKind::TimedOut {
        inner.metrics.client_timeout(ClientTimeout::Send);
        tracing::debug!("client took no response bytes within client.send_timeout_ms; closing");
    }
    Next::Close
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::task::Context;
    use tokio::io::{AsyncReadExt, DuplexStream, ReadBuf};
    use tokio::net::TcpListener;

    /// A client connection that keeps a copy of each write the proxy makes to it.
    struct RecordingIo {
        io: DuplexStream,
        writes: Arc<parking_lot::Mutex<Vec<Vec<u8>>>>,
    }

    impl Arrivals for RecordingIo {}

    impl AsyncRead for RecordingIo {
        fn poll_read(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<std::io::Result<()>> {
            Pin::new(&mut self.io).poll_read(cx, buf)
        }
    }

    impl AsyncWrite for RecordingIo {
        fn poll_write(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<std::io::Result<usize>> {
            let this = &mut *self;
            let written = Pin::new(&mut this.io).poll_write(cx, buf);
            if let Poll::Ready(Ok(n)) = written {
                this.writes.lock().push(buf[..n].to_vec());
            }
            written
        }

        fn poll_write_vectored(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            bufs: &[IoSlice<'_>],
        ) -> Poll<std::io::Result<usize>> {
            // One write, as a socket's writev would be.
            let joined: Vec<u8> = bufs.iter().flat_map(|b| b.iter().copied()).collect();
            self.poll_write(cx, &joined)
        }

        fn is_write_vectored(&self) -> bool {
            true
        }

        fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Pin::new(&mut self.io).poll_flush(cx)
        }

        fn poll_shutdown(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<std::io::Result<()>> {
            Pin::new(&mut self.io).poll_shutdown(cx)
        }
    }

    fn chunk(data: &str) -> String {
        format!("{:x}\r\n{data}\r\n", data.len())
    }

    fn contains(haystack: &[u8], needle: &str) -> bool {
        haystack
            .windows(needle.len())
            .any(|w| w == needle.as_bytes())
    }

    /// Reads from the client's side until `needle` has arrived, failing after 10 s.
    /// A one-worker proxy in front of the backend at `backend_addr`, without health probes.
    fn one_backend(backend_addr: std::net::SocketAddr) -> super::super::config::ProxyConfig {
        super::super::config::ProxyConfig::from_toml_str(&format!(
            "listen = \"127.0.0.1:0\"\nworkers = 1\n[admin]\nlisten = \"127.0.0.1:0\"\n\
             [health]\ninterval_ms = 0\n[[backends]]\nname = \"a\"\nurl = \"http://{backend_addr}\"\n"
        ))
        .unwrap()
    }

    /// A client connection served by `proxy`'s ingress, `capacity` bytes each way, and the
    /// writes the proxy makes to it.
    fn client_of(
        proxy: &super::super::ProxyHandle,
        shutdown: crate::shutdown::Shutdown,
        capacity: usize,
    ) -> (DuplexStream, Arc<parking_lot::Mutex<Vec<Vec<u8>>>>) {
        let writes = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let (client, proxy_side) = tokio::io::duplex(capacity);
        let io = RecordingIo {
            io: proxy_side,
            writes: writes.clone(),
        };
        let peer = "127.0.0.1:40000".parse().unwrap();
        tokio::spawn(serve(
            io,
            BytesMut::new(),
            proxy.inner.clone(),
            Arc::new(ClientConn::new(peer, false, 0)),
            shutdown,
            Instant::now(),
            None,
        ));
        (client, writes)
    }

    async fn read_until(client: &mut DuplexStream, got: &mut Vec<u8>, needle: &str) {
        let wait = async {
            while !contains(got, needle) {
                let mut buf = [0u8; 4096];
                let n = client.read(&mut buf).await.unwrap();
                assert!(n > 0, "the proxy closed before {needle:?} arrived");
                got.extend_from_slice(&buf[..n]);
            }
        };
        tokio::time::timeout(Duration::from_secs(10), wait)
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "{needle:?} did not arrive; got {:?}",
                    String::from_utf8_lossy(got)
                )
            });
    }

    #[tokio::test]
    async fn events_that_arrived_together_reach_the_client_in_one_write_and_none_waits_for_the_next(
    ) {
        let events = [
            "data: one\n\n",
            "data: two\n\n",
            "data: three\n\n",
            "data: four\n\n",
        ];
        let backend = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let backend_addr = backend.local_addr().unwrap();
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            let (mut s, _) = backend.accept().await.unwrap();
            let mut head = Vec::new();
            while !contains(&head, "\r\n\r\n") {
                let mut buf = [0u8; 1024];
                let n = s.read(&mut buf).await.unwrap();
                assert!(n > 0, "the proxy closed before sending a head");
                head.extend_from_slice(&buf[..n]);
            }
            // Three events in one write, as a backend's burst reaches the proxy in one read.
            let burst = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n{}{}{}",
                chunk(events[0]),
                chunk(events[1]),
                chunk(events[2])
            );
            s.write_all(burst.as_bytes()).await.unwrap();
            let _ = released.await;
            s.write_all(format!("{}0\r\n\r\n", chunk(events[3])).as_bytes())
                .await
                .unwrap();
            let _ = s.read(&mut [0u8; 64]).await;
        });

        let config = one_backend(backend_addr);
        let (_trigger, shutdown) = crate::shutdown::channel();
        let proxy = super::super::start(config, shutdown.clone()).await.unwrap();
        let (mut client, writes) = client_of(&proxy, shutdown, 1 << 20);

        client
            .write_all(b"GET /v1/stream HTTP/1.1\r\nhost: agentrace\r\nx-session-id: s\r\n\r\n")
            .await
            .unwrap();
        let mut got = Vec::new();
        read_until(&mut client, &mut got, events[2]).await;
        {
            let writes = writes.lock();
            assert_eq!(
                writes.len(),
                1,
                "the three events read together went out in {} writes",
                writes.len()
            );
            assert!(
                contains(&writes[0], "HTTP/1.1 200"),
                "the head leads the first write"
            );
            for event in &events[..3] {
                assert!(
                    contains(&writes[0], event),
                    "{event:?} missing from the first write"
                );
            }
        }
        // The fourth is only written once the client has the first three.
        release.send(()).unwrap();
        read_until(&mut client, &mut got, "0\r\n\r\n").await;
        let text = String::from_utf8_lossy(&got);
        let at: Vec<usize> = events.iter().map(|e| text.find(e).unwrap()).collect();
        assert!(
            at.windows(2).all(|w| w[0] < w[1]),
            "events out of order: {text}"
        );
    }

    /// Notes when each exchange it sees ended.
    struct EndTimes(Arc<parking_lot::Mutex<Vec<Instant>>>);

    struct EndTime(Arc<parking_lot::Mutex<Vec<Instant>>>);

    impl crate::tap::ExchangeSink for EndTimes {
        fn start(&self, _: crate::tap::ExchangeStart) -> Box<dyn crate::tap::ExchangeObserver> {
            Box::new(EndTime(self.0.clone()))
        }
    }

    impl crate::tap::ExchangeObserver for EndTime {
        fn response_head(&mut self, _: StatusCode, _: &http::HeaderMap, _: Instant) {}
        fn response_frame(&mut self, _: &bytes::Bytes, _: Instant) {}
        fn end(self: Box<Self>, _: crate::tap::ExchangeEnd, at: Instant) {
            self.0.lock().push(at);
        }
    }

    // A response ends when the client connection has written its last bytes, not when they
    // were handed to it: a body that arrives whole while the client is not reading ends only
    // once the client has taken it (the wait the recorder computes before the next turn starts
    // there).
    #[tokio::test]
    async fn a_response_ends_when_its_last_bytes_are_written_not_when_handed_on() {
        let body = "x".repeat(4096);
        let backend = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let backend_addr = backend.local_addr().unwrap();
        let answer = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        tokio::spawn(async move {
            let (mut s, _) = backend.accept().await.unwrap();
            let mut head = Vec::new();
            while !contains(&head, "\r\n\r\n") {
                let mut buf = [0u8; 1024];
                let n = s.read(&mut buf).await.unwrap();
                assert!(n > 0, "the proxy closed before sending a head");
                head.extend_from_slice(&buf[..n]);
            }
            s.write_all(answer.as_bytes()).await.unwrap();
            let _ = s.read(&mut [0u8; 64]).await;
        });
        let config = one_backend(backend_addr);
        let ends = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let (_trigger, shutdown) = crate::shutdown::channel();
        let proxy = super::super::start_with_sink(
            config,
            shutdown.clone(),
            Arc::new(EndTimes(ends.clone())),
        )
        .await
        .unwrap();
        // Room for the head and a little of the body: the rest waits for the client.
        let (mut client, _) = client_of(&proxy, shutdown, 256);
        client
            .write_all(b"GET /v1/models HTTP/1.1\r\nhost: agentrace\r\n\r\n")
            .await
            .unwrap();
        let mut got = Vec::new();
        read_until(&mut client, &mut got, "\r\n\r\n").await;
        // The client takes a while before reading the body.
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(ends.lock().is_empty(), "ended before the body was written");
        let resumed = Instant::now();
        read_until(&mut client, &mut got, &body).await;
        // The end is reported once the last write completed, after the client read again.
        let end = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                if let Some(&end) = ends.lock().first() {
                    return end;
                }
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the exchange ended");
        assert!(
            end >= resumed,
            "ended {:?} before the client read the body",
            resumed - end
        );
    }
}
