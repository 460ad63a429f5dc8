//! HTTP/1.1 client for the replayer: one keep-alive connection per slot, the request written in
//! one call, the response read and de-chunked as it arrives by the crate's codec
//! ([`crate::http1`], the proxy's own, so both refuse the same malformed responses), SSE events found by an incremental
//! line scan and stamped at socket receipt. Nothing is parsed as JSON here.
//!
//! Owning the socket is what makes the stamps honest: ISSUED is the instant the write of the
//! request returned (its bytes are in the kernel), every event carries the kernel's receive
//! time of the `read` that completed it ([`super::stamped`]), and dropping the exchange future
//! closes the connection (a timed-out turn is cancelled on the server, not left running).
//!
//! A response is held whole until it ends, so its size is capped (`max_response_bytes`): a
//! server streaming without end fails the turn instead of growing the process without bound.

use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use http::{HeaderName, HeaderValue, Method};

use super::stamped::{LastRead, StampedTcp};
use crate::http1::{self, BodyDecoder, Decoded, Fields, H1Error};
use crate::remote::{self, ServerUrl, TlsConfigError, Trust, UrlError};
use crate::wire::Api;

/// Why an exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The TCP (or TLS) connection could not be set up.
    #[error("connect to {addr}: {message}")]
    Connect {
        /// host:port.
        addr: String,
        /// The cause.
        message: String,
    },
    /// Reading or writing the socket failed.
    #[error("transport: {0}")]
    Io(#[from] std::io::Error),
    /// The peer sent something that is not HTTP/1.1, or that breaks its framing rules.
    #[error("protocol: {0}")]
    Protocol(#[from] H1Error),
    /// The server answered `101 Switching Protocols`, which the replayer does not follow.
    #[error("protocol: the server switched protocols, which the replayer does not follow")]
    SwitchedProtocols,
    /// No TLS client configuration could be built.
    #[error("TLS configuration: {0}")]
    Tls(TlsConfigError),
    /// The connection closed before the response was complete.
    #[error("connection closed before the response was complete")]
    Truncated,
    /// A kept-alive connection was closed by the server before any byte of the response,
    /// as servers do that close after a stream while advertising keep-alive: the request was
    /// not taken, so it goes again on a new connection.
    #[error("the server had closed the kept-alive connection")]
    ClosedWhileIdle,
    /// The response grew past `max_response_bytes`; the connection is dropped.
    #[error("response larger than max_response_bytes ({limit} bytes); connection closed")]
    TooLarge {
        /// The cap in bytes.
        limit: usize,
    },
}

/// Where requests go.
#[derive(Debug, Clone)]
pub struct Target {
    /// The server, as the target URL names it.
    pub server: ServerUrl,
    /// Request path of chat completions (base path + `/v1/chat/completions`).
    pub path: String,
}

impl Target {
    /// Parses `http://host:port[/prefix]` or `https://…`; the error says what is wrong.
    pub fn parse(url: &str) -> Result<Target, UrlError> {
        let server = ServerUrl::parse(url)?;
        let path = format!("{}/v1/chat/completions", server.path);
        Ok(Target { server, path })
    }

    /// The same server, with requests going to `api`'s path under the base path.
    pub(crate) fn for_api(mut self, api: Api) -> Target {
        self.path = format!("{}{}", self.server.path, api.path());
        self
    }

    /// The `Host` header: the port left out when it is the scheme's default, as the
    /// reference client sends it.
    fn host_header(&self) -> String {
        let s = &self.server;
        let host = if s.host.contains(':') {
            format!("[{}]", s.host)
        } else {
            s.host.clone()
        };
        match (s.tls, s.port) {
            (false, 80) | (true, 443) => host,
            _ => format!("{host}:{}", s.port),
        }
    }
}

/// The API-specific head fields of a request to `path`: Messages names its version and takes
/// the key as `x-api-key`; the OpenAI APIs take it as a bearer token.
fn auth_fields(path: &str, api_key: Option<&str>) -> String {
    match (Api::of_path(path), api_key) {
        (Some(Api::Messages), key) => {
            let version = crate::wire::messages_request::ANTHROPIC_VERSION;
            let key = key.map_or(String::new(), |k| format!("x-api-key: {k}\r\n"));
            format!("anthropic-version: {version}\r\n{key}")
        }
        (_, Some(key)) => format!("Authorization: Bearer {key}\r\n"),
        (_, None) => String::new(),
    }
}

/// A connection's byte stream to the target: TCP, or TLS over it.
trait TargetStream: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> TargetStream for T {}

/// Opens connections to one target; shared by every slot of a run.
#[derive(Clone)]
pub struct Connector {
    target: Arc<Target>,
    tls: Option<tokio_rustls::TlsConnector>,
    connect_timeout: Duration,
    max_response_bytes: usize,
    head_prefix: Arc<[u8]>,
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connector")
            .field("target", &self.target)
            .finish_non_exhaustive()
    }
}

impl Connector {
    /// A connector; `api_key` goes into every request's `Authorization` header; a response
    /// past `max_response_bytes` fails (see [`TargetConnection::exchange`]).
    pub fn new(
        target: Target,
        api_key: Option<&str>,
        connect_timeout: Duration,
        max_response_bytes: usize,
    ) -> Result<Self, ClientError> {
        let tls = if target.server.tls {
            let config = remote::client_config(Trust::Platform, &[]).map_err(ClientError::Tls)?;
            Some(tokio_rustls::TlsConnector::from(Arc::new(config)))
        } else {
            None
        };
        // Header order as the reference: Host, Authorization, Content-Type, then per request
        // Accept, routing headers, Content-Length.
        let mut head = format!(
            "POST {} HTTP/1.1\r\nHost: {}\r\n",
            target.path,
            target.host_header()
        );
        head.push_str(&auth_fields(&target.path, api_key));
        head.push_str("Content-Type: application/json\r\n");
        Ok(Self {
            target: Arc::new(target),
            tls,
            connect_timeout,
            max_response_bytes,
            head_prefix: head.into_bytes().into(),
        })
    }

    /// The full request bytes: head and body in one buffer, so one write sends it.
    pub fn request_bytes(&self, streaming: bool, routing: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.head_prefix.len() + 160 + body.len());
        out.extend_from_slice(&self.head_prefix);
        out.extend_from_slice(if streaming {
            b"Accept: text/event-stream\r\n"
        } else {
            b"Accept: application/json\r\n"
        });
        for (name, value) in routing {
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(format!("Content-Length: {}\r\n\r\n", body.len()).as_bytes());
        out.extend_from_slice(body);
        out
    }

    /// Request bytes for any method, path and fields (the open-loop replay of captured
    /// requests): `path` is appended to the target's base path; `Host` and `Content-Length`
    /// are the connector's own, so `fields` must carry neither.
    pub(crate) fn request_bytes_as(
        &self,
        method: &Method,
        path: &str,
        fields: &[(String, String)],
        body: &[u8],
    ) -> Result<Vec<u8>, String> {
        let host = HeaderValue::from_str(&self.target.host_header()).map_err(|_| {
            format!(
                "host {:?}: not a valid Host value",
                self.target.host_header()
            )
        })?;
        for (name, value) in fields {
            HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| format!("header {name:?}: not a valid field name"))?;
            HeaderValue::from_str(value)
                .map_err(|_| format!("header {name:?}: not a valid field value"))?;
        }
        let bodyless = body.is_empty() && matches!(*method, Method::GET | Method::HEAD);
        let mut out = Vec::with_capacity(256 + body.len());
        http1::put_request_head(
            &mut out,
            method,
            &[&self.target.server.path, path],
            &host,
            fields.iter().map(|(n, v)| (n.as_bytes(), v.as_bytes())),
            (!bodyless).then_some(body.len() as u64),
        );
        out.extend_from_slice(body);
        Ok(out)
    }

    /// Opens a new connection.
    pub async fn connect(&self) -> Result<TargetConnection, ClientError> {
        let server = &self.target.server;
        let addr = format!("{}:{}", server.host, server.port);
        let fail = |message: String| ClientError::Connect {
            addr: addr.clone(),
            message,
        };
        let tcp = tokio::time::timeout(
            self.connect_timeout,
            TcpStream::connect((server.host.as_str(), server.port)),
        )
        .await
        .map_err(|_| fail(format!("timed out after {:?}", self.connect_timeout)))?
        .map_err(|e| fail(e.to_string()))?;
        let _ = tcp.set_nodelay(true);
        let (tcp, received) = StampedTcp::new(tcp);
        let io: Box<dyn TargetStream> = match &self.tls {
            None => Box::new(tcp),
            Some(tls) => {
                let name = server.server_name().map_err(|e| fail(e.to_string()))?;
                Box::new(
                    tls.connect(name, tcp)
                        .await
                        .map_err(|e| fail(e.to_string()))?,
                )
            }
        };
        Ok(TargetConnection {
            io,
            received,
            buf: BytesMut::with_capacity(16 * 1024),
            last_used: Instant::now(),
            answered: 0,
            max_response_bytes: self.max_response_bytes,
        })
    }
}

/// One keep-alive connection, owned by one slot.
pub struct TargetConnection {
    io: Box<dyn TargetStream>,
    /// When the bytes of the latest TCP read arrived (the kernel's stamp).
    received: Arc<LastRead>,
    buf: BytesMut,
    last_used: Instant,
    /// Responses read whole on this connection.
    answered: u32,
    max_response_bytes: usize,
}

impl std::fmt::Debug for TargetConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TargetConnection").finish_non_exhaustive()
    }
}

/// One SSE event: where its bytes are in the decoded body and when they arrived.
#[derive(Debug, Clone, Copy)]
pub struct SseEvent {
    /// Start offset in [`Response::body`].
    pub start: usize,
    /// End offset (exclusive, before the blank line).
    pub end: usize,
    /// When the bytes of the `read` that completed the event arrived (the kernel's receive
    /// time of that read's first packet; the read's own time where the kernel gave none).
    pub at: Instant,
}

/// A complete response with its socket-level stamps.
#[derive(Debug)]
pub struct Response {
    /// HTTP status.
    pub status: u16,
    /// The `Content-Type` value, if the response had one.
    pub content_type: Option<String>,
    /// De-chunked body bytes.
    pub body: BytesMut,
    /// SSE events found in the body (empty for a JSON response).
    pub events: Vec<SseEvent>,
    /// When the first response byte arrived.
    pub first_byte: Instant,
    /// When the last body byte arrived.
    pub last_byte: Instant,
    /// Whether the connection can carry another request.
    pub reusable: bool,
}

impl TargetConnection {
    /// True when the peer closed (or wrote unasked) while the connection sat idle.
    pub fn is_stale(&mut self, max_idle: Duration) -> bool {
        if self.last_used.elapsed() > max_idle || !self.buf.is_empty() {
            return true;
        }
        let mut probe = [0u8; 1];
        futures_util::FutureExt::now_or_never(self.io.read(&mut probe)).is_some()
    }

    /// Sends `request` and reads the whole response. `issued` receives the instant the write
    /// that completed the request began (the first write's, until then). Dropping the future closes nothing by itself: the
    /// caller drops the `TargetConnection` after a timeout so the server sees the disconnect.
    ///
    /// Fails with [`ClientError::TooLarge`] once the bytes read for this response, plus the
    /// bookkeeping of the SSE events found in them, pass `max_response_bytes`; the caller then
    /// drops the connection, which is mid-response.
    pub async fn exchange(
        &mut self,
        request: &[u8],
        issued: &mut Option<Instant>,
    ) -> Result<Response, ClientError> {
        self.exchange_as(request, false, issued).await
    }

    /// [`exchange`](Self::exchange) for a request that may be `HEAD`, whose response has a
    /// head only, whatever its `Content-Length` says.
    pub(crate) async fn exchange_as(
        &mut self,
        request: &[u8],
        head_request: bool,
        issued: &mut Option<Instant>,
    ) -> Result<Response, ClientError> {
        self.buf.clear();
        *issued = Some(Instant::now());
        // On a kept-alive connection, a reset or an end of stream before any response byte
        // means the server had closed it: its FIN can arrive just after the idle check.
        let kept_alive = self.answered > 0;
        let closed_while_idle = |e: std::io::Error| {
            use std::io::ErrorKind::*;
            match e.kind() {
                BrokenPipe | ConnectionReset | ConnectionAborted if kept_alive => {
                    ClientError::ClosedWhileIdle
                }
                _ => ClientError::Io(e),
            }
        };
        // ISSUED is the instant the write that completes the request began: its bytes cannot
        // have left before it, and a task that waits for a core after the write returns
        // does not move it later than they did.
        let mut sent = 0;
        while sent < request.len() {
            let began = Instant::now();
            let n = self
                .io
                .write(&request[sent..])
                .await
                .map_err(closed_while_idle)?;
            if n == 0 {
                return Err(ClientError::Io(std::io::ErrorKind::WriteZero.into()));
            }
            sent += n;
            *issued = Some(began);
        }
        self.io.flush().await.map_err(closed_while_idle)?;

        let mut reader = ResponseReader {
            head_request,
            ..ResponseReader::default()
        };
        let mut first_byte = None;
        let mut received = 0usize;
        loop {
            let read = http1::read_some(&mut self.io, &mut self.buf).await;
            let n = match read {
                Err(e) if first_byte.is_none() => return Err(closed_while_idle(e)),
                r => r?,
            };
            let now = if n == 0 {
                Instant::now()
            } else {
                self.received.at()
            };
            if n == 0 && first_byte.is_none() && kept_alive {
                return Err(ClientError::ClosedWhileIdle);
            }
            first_byte.get_or_insert(now);
            received += n;
            let done = reader.feed(&mut self.buf, now, n == 0)?;
            let held = received + reader.events.len() * std::mem::size_of::<SseEvent>();
            if held > self.max_response_bytes {
                return Err(ClientError::TooLarge {
                    limit: self.max_response_bytes,
                });
            }
            if done {
                break;
            }
            if n == 0 {
                return Err(ClientError::Truncated);
            }
        }
        self.last_used = Instant::now();
        self.answered += 1;
        let first_byte = first_byte.unwrap_or(self.last_used);
        // The write's return can be seen after the answer's first bytes came (a fast server, or
        // a task that waited for a core): the request was sent by then.
        if issued.is_some_and(|at| at > first_byte) {
            *issued = Some(first_byte);
        }
        let last_byte = reader.last_byte.unwrap_or(first_byte);
        Ok(Response {
            status: reader.status,
            content_type: reader.content_type,
            reusable: reader.keep_alive && self.buf.is_empty(),
            body: reader.body,
            events: reader.events,
            first_byte,
            last_byte,
        })
    }
}

/// Where a response stands.
#[derive(Debug, Default)]
enum Stage {
    /// Reading the head (or an interim 1xx head before the final one).
    #[default]
    Head,
    /// Decoding the body as the head framed it.
    Body(BodyDecoder),
    /// The response is complete.
    Done,
}

/// Incremental response reader: the head and the body framing by the crate's HTTP/1.1 codec,
/// then the SSE line scan over the decoded body.
#[derive(Debug, Default)]
struct ResponseReader {
    /// The request was `HEAD`: the response has no body.
    head_request: bool,
    stage: Stage,
    status: u16,
    content_type: Option<String>,
    keep_alive: bool,
    body: BytesMut,
    events: Vec<SseEvent>,
    /// Where the line scan resumes.
    scan_pos: usize,
    /// Start of the event being accumulated.
    event_start: usize,
    last_byte: Option<Instant>,
}

impl ResponseReader {
    #[cfg(test)]
    fn is_done(&self) -> bool {
        matches!(self.stage, Stage::Done)
    }

    /// Consumes what it can from `buf`; true once the response is complete. `eof` says the
    /// server has closed, so `buf` is all there will be: a response not complete by then is
    /// [`ClientError::Truncated`], unless its body runs to the close.
    fn feed(&mut self, buf: &mut BytesMut, now: Instant, eof: bool) -> Result<bool, ClientError> {
        loop {
            match &mut self.stage {
                Stage::Head => {
                    let Some(head) = http1::parse_response(buf, self.head_request)? else {
                        return if eof {
                            Err(ClientError::Truncated)
                        } else {
                            Ok(false)
                        };
                    };
                    if head.status == http::StatusCode::SWITCHING_PROTOCOLS {
                        return Err(ClientError::SwitchedProtocols);
                    }
                    self.last_byte = Some(now);
                    // Interim responses (100, 103) are passed over; the final one follows.
                    if head.status.is_informational() {
                        continue;
                    }
                    self.status = head.status.as_u16();
                    self.keep_alive = head.keep_alive;
                    self.content_type = head
                        .headers
                        .first("content-type")
                        .map(|v| String::from_utf8_lossy(v).into_owned());
                    self.stage = Stage::Body(BodyDecoder::new(head.framing));
                }
                Stage::Body(decoder) => match decoder.decode(buf, eof) {
                    Ok(Decoded::Data(data)) => {
                        self.body.extend_from_slice(&data);
                        self.scan(now, false);
                    }
                    Ok(Decoded::NeedMore) => return Ok(false),
                    Ok(Decoded::Done) => {
                        self.stage = Stage::Done;
                        self.scan(now, true);
                    }
                    Err(H1Error::Incomplete) => return Err(ClientError::Truncated),
                    Err(e) => return Err(e.into()),
                },
                Stage::Done => {
                    self.last_byte = Some(now);
                    return Ok(true);
                }
            }
        }
    }

    /// Advances the line scan over newly decoded bytes: a blank line ends an event. Every
    /// byte is looked at once, so the work is linear in the response size.
    fn scan(&mut self, now: Instant, at_end: bool) {
        self.last_byte = Some(now);
        while let Some(off) = memchr::memchr(b'\n', &self.body[self.scan_pos..]) {
            let nl = self.scan_pos + off;
            let line_start = self.scan_pos;
            self.scan_pos = nl + 1;
            let blank = self.body[line_start..nl].iter().all(|b| *b == b'\r');
            if blank {
                let mut end = line_start;
                while end > self.event_start && matches!(self.body[end - 1], b'\n' | b'\r') {
                    end -= 1;
                }
                if end > self.event_start {
                    self.events.push(SseEvent {
                        start: self.event_start,
                        end,
                        at: now,
                    });
                }
                self.event_start = self.scan_pos;
            }
        }
        if at_end && self.body.len() > self.event_start {
            let tail = &self.body[self.event_start..];
            if !tail.iter().all(|b| b.is_ascii_whitespace()) {
                self.events.push(SseEvent {
                    start: self.event_start,
                    end: self.body.len(),
                    at: now,
                });
            }
            self.event_start = self.body.len();
            self.scan_pos = self.body.len();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed_all(parts: &[&[u8]]) -> Result<ResponseReader, ClientError> {
        let mut r = ResponseReader::default();
        let mut buf = BytesMut::new();
        let now = Instant::now();
        for p in parts {
            buf.extend_from_slice(p);
            if r.feed(&mut buf, now, false)? {
                break;
            }
        }
        Ok(r)
    }

    #[test]
    fn chunked_sse_split_anywhere_yields_the_same_events() {
        let wire: &[u8] = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n\
            a\r\ndata: {}\n\n\r\n\
            13\r\ndata: {\"a\":1}\n\ndata\r\n\
            c\r\n: [DONE]\r\n\r\n\r\n\
            0\r\n\r\n";
        for split in 1..wire.len() {
            let r = feed_all(&[&wire[..split], &wire[split..]]).unwrap();
            assert!(r.is_done(), "split at {split}");
            let texts: Vec<&[u8]> = r.events.iter().map(|e| &r.body[e.start..e.end]).collect();
            assert_eq!(
                texts,
                vec![
                    &b"data: {}"[..],
                    &b"data: {\"a\":1}"[..],
                    &b"data: [DONE]"[..]
                ],
                "split at {split}"
            );
        }
    }

    #[test]
    fn a_captured_request_reads_back_through_the_codec_under_the_target_base_path() {
        let target = Target::parse("http://127.0.0.1:8080/base/").unwrap();
        let c = Connector::new(target, None, Duration::from_secs(1), 1 << 20).unwrap();
        let fields = [("x-session-id".to_string(), "s1".to_string())];
        let bytes = c
            .request_bytes_as(&Method::PUT, "/v1/x?q=1", &fields, b"{}")
            .unwrap();
        let mut buf = BytesMut::from(&bytes[..]);
        let head = http1::parse_request(&mut buf).unwrap().unwrap();
        assert_eq!(head.method, Method::PUT);
        assert_eq!(head.uri, "/base/v1/x?q=1");
        assert_eq!(head.headers.first("host"), Some(&b"127.0.0.1:8080"[..]));
        assert_eq!(head.headers.first("x-session-id"), Some(&b"s1"[..]));
        assert_eq!(head.framing, http1::Framing::Length(2));
        assert_eq!(&buf[..], b"{}", "the body follows the head");

        let get = c.request_bytes_as(&Method::GET, "/", &[], b"").unwrap();
        let head = http1::parse_request(&mut BytesMut::from(&get[..]))
            .unwrap()
            .unwrap();
        assert!(
            head.headers.first("content-length").is_none(),
            "a bodyless GET says no length"
        );

        let bad = [("bad name".to_string(), "v".to_string())];
        let err = c
            .request_bytes_as(&Method::GET, "/", &bad, b"")
            .unwrap_err();
        assert!(err.contains("\"bad name\""), "{err}");
    }

    #[test]
    fn a_head_response_ends_at_its_head_whatever_its_length_says() {
        let mut r = ResponseReader {
            head_request: true,
            ..ResponseReader::default()
        };
        let mut buf = BytesMut::from(&b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n"[..]);
        assert!(r.feed(&mut buf, Instant::now(), false).unwrap());
        assert!(r.body.is_empty() && r.keep_alive);
    }

    #[test]
    fn content_length_body_completes_without_eof() {
        let r = feed_all(&[
            b"HTTP/1.1 500 Internal\r\nContent-Length: 5\r\n\r\nhel",
            b"lo",
        ])
        .unwrap();
        assert!(r.is_done());
        assert_eq!(r.status, 500);
        assert_eq!(&r.body[..], b"hello");
        assert!(r.keep_alive);
    }

    #[test]
    fn malformed_framing_is_a_protocol_error_not_a_body() {
        for wire in [
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n+5\r\nhello\r\n0\r\n\r\n",
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\nhello\r\n0\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello",
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
        ] {
            assert!(
                matches!(feed_all(&[wire.as_bytes()]), Err(ClientError::Protocol(_))),
                "{wire:?}"
            );
        }
    }

    #[test]
    fn interim_responses_are_passed_over_and_a_close_ends_an_unframed_body() {
        let mut r = ResponseReader::default();
        let mut buf =
            BytesMut::from(&b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n\r\nab"[..]);
        let now = Instant::now();
        assert!(!r.feed(&mut buf, now, false).unwrap());
        assert!(r.feed(&mut buf, now, true).unwrap());
        assert_eq!(
            (r.status, &r.body[..], r.keep_alive),
            (200, &b"ab"[..], false)
        );
        let cut = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhel";
        let mut r = ResponseReader::default();
        assert!(matches!(
            r.feed(&mut BytesMut::from(&cut[..]), now, true),
            Err(ClientError::Truncated)
        ));
    }

    #[test]
    fn target_parse_builds_the_chat_path() {
        let t = Target::parse("http://127.0.0.1:9000/base/").unwrap();
        assert_eq!(t.path, "/base/v1/chat/completions");
        assert_eq!(t.host_header(), "127.0.0.1:9000");
        assert!(Target::parse("ftp://x").is_err());
        let t = Target::parse("https://[::1]:443").unwrap();
        assert_eq!(t.path, "/v1/chat/completions");
        assert_eq!(t.host_header(), "[::1]");
    }
}
