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
pub(crate) struct ClientLimits {
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
pub(crate) struct Deadline {
    sleep: Pin<Box<Sleep>>,
}

impl Deadline {
    pub(crate) fn new(at: Instant) -> Self {
        Self {
            sleep: Box::pin(tokio::time::sleep_until(at)),
        }
    }

    /// Resolves once `at` has passed.
    pub(crate) async fn reached(&mut self, at: Instant) {
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
pub(crate) async fn serve<S: AsyncRead + AsyncWrite + Arrivals + Unpin>(
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
            version,
        };
        let response = {
            let forwarding = upstream::forward(inner, req, &body, client, started);
            tokio::pin!(forwarding);
            tokio::select! {
                biased;
                response = &mut forwarding => response,
                // Dropping the forwarding future closes the upstream connection.
                () = self.hung_up() => return Next::Close,
            }
        };
        body.release().await;
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
mod tests;
