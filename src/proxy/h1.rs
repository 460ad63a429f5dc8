//! HTTP/1.1 wire format of the forwarding path: request and response heads parsed (httparse)
//! into fields left in the read buffer, heads written back out in one buffer, and bodies decoded incrementally (length, chunked, or
//! until close) so a streamed body passes through piece by piece as it arrives.

use std::mem::MaybeUninit;

use bytes::{Bytes, BytesMut};
use http::header::HeaderValue;
use http::{Method, StatusCode, Uri, Version};

use super::fields::{self, Fields, Span, WireFields};

/// The largest request or response head accepted (larger: 431, or an upstream error).
pub const MAX_HEAD: usize = 64 * 1024;
/// The most header fields in one head.
const MAX_HEADERS: usize = 128;
/// The longest chunk-size line.
const MAX_LINE: usize = 4096;
/// Chunk-extension bytes one chunked body may carry in all (hyper's limit). Extensions are
/// not passed on, so past this they are only work for the proxy.
pub const MAX_CHUNK_EXTENSIONS: usize = 16 * 1024;
/// Trailer-section bytes one chunked body may carry, line ends included (hyper's limit).
/// Trailers are not passed on either.
pub const MAX_TRAILERS: usize = 16 * 1024;
/// Bytes a read buffer is grown by when it runs low.
const READ_CHUNK: usize = 16 * 1024;

/// Makes room for the next read: a quarter of `READ_CHUNK` free at least.
pub fn reserve_read(buf: &mut BytesMut) {
    if buf.capacity() - buf.len() < READ_CHUNK / 4 {
        buf.reserve(READ_CHUNK);
    }
}

/// Reads what is there (at least one byte, or 0 at the end of the stream) into `buf`.
pub async fn read_some<R: tokio::io::AsyncRead + Unpin>(
    io: &mut R,
    buf: &mut BytesMut,
) -> std::io::Result<usize> {
    reserve_read(buf);
    tokio::io::AsyncReadExt::read_buf(io, buf).await
}

/// What is wrong with a message on the wire.
#[derive(Debug, thiserror::Error)]
pub enum H1Error {
    /// The head does not parse as HTTP/1.x.
    #[error("malformed HTTP/1 head: {0}")]
    Parse(#[from] httparse::Error),
    /// The head is longer than [`MAX_HEAD`].
    #[error("HTTP head larger than {MAX_HEAD} bytes")]
    HeadTooLarge,
    /// A part of the head is not valid for `http` (method, target, header name or value).
    #[error("invalid {0} in the HTTP head")]
    Invalid(&'static str),
    /// Content-Length and Transfer-Encoding disagree or do not parse.
    #[error("invalid message framing: {0}")]
    Framing(&'static str),
    /// A transfer coding the proxy does not decode: under `chunked`, or in a response
    /// without it.
    #[error("unsupported transfer-encoding (only chunked is understood)")]
    UnsupportedCoding,
    /// `CONNECT`, which asks for a tunnel the proxy does not open.
    #[error("CONNECT is not supported: the proxy opens no tunnels")]
    Connect,
    /// A chunked body is malformed or over a limit (RFC 9112 §7.1).
    #[error("malformed chunked body: {0}")]
    Chunked(&'static str),
    /// The peer closed the connection before the message ended.
    #[error("connection closed before the message ended")]
    Incomplete,
}

impl H1Error {
    /// The status a client is refused with for a request that has this error (a backend's
    /// response with one gets 502 instead).
    pub fn status(&self) -> StatusCode {
        match self {
            H1Error::HeadTooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            H1Error::UnsupportedCoding => StatusCode::NOT_IMPLEMENTED,
            H1Error::Connect => StatusCode::METHOD_NOT_ALLOWED,
            _ => StatusCode::BAD_REQUEST,
        }
    }
}

/// How a message body is delimited on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// No body.
    Empty,
    /// Exactly this many bytes.
    Length(u64),
    /// `Transfer-Encoding: chunked`.
    Chunked,
    /// Until the connection closes (responses only).
    UntilClose,
}

/// A parsed request head.
#[derive(Debug)]
pub struct RequestHead {
    /// Method.
    pub method: Method,
    /// Request target as sent (origin form, normally).
    pub uri: Uri,
    /// HTTP/1.0 or HTTP/1.1.
    pub version: Version,
    /// Header fields, as spans of the head.
    pub headers: WireFields,
    /// How the body is delimited.
    pub framing: Framing,
    /// Whether the client wants the connection kept open after this exchange.
    pub keep_alive: bool,
}

/// A parsed response head.
#[derive(Debug)]
pub struct ResponseHead {
    /// Status code.
    pub status: StatusCode,
    /// HTTP/1.0 or HTTP/1.1.
    pub version: Version,
    /// Header fields, as spans of the head.
    pub headers: WireFields,
    /// How the body is delimited.
    pub framing: Framing,
    /// Whether the server keeps the connection open after this response.
    pub keep_alive: bool,
}

/// Room for httparse's header fields, left uninitialised: zeroing 128 of them for every head
/// cost more than parsing it.
type Slots<'b> = [MaybeUninit<httparse::Header<'b>>; MAX_HEADERS];

fn span_of(base: &[u8], part: &[u8]) -> (u32, u32) {
    // Within a head of at most MAX_HEAD bytes.
    (
        (part.as_ptr() as usize - base.as_ptr() as usize) as u32,
        part.len() as u32,
    )
}

/// Where each field lies in `base`, so the head can be split off the buffer (which httparse
/// borrows) and its fields then read in place.
fn spans_of(base: &[u8], fields: &[httparse::Header<'_>]) -> Vec<Span> {
    fields
        .iter()
        .map(|h| {
            let (n, nl) = span_of(base, h.name.as_bytes());
            let (v, vl) = span_of(base, h.value);
            (n, nl, v, vl)
        })
        .collect()
}

/// Splits the parsed head (`len` bytes) off `buf`, its fields at `spans`.
fn take_head(buf: &mut BytesMut, len: usize, spans: Vec<Span>) -> (WireFields, Seen) {
    let fields = WireFields::new(buf.split_to(len).freeze(), spans);
    let seen = Seen::of(&fields);
    (fields, seen)
}

fn version_of(minor: Option<u8>) -> Version {
    match minor {
        Some(0) => Version::HTTP_10,
        _ => Version::HTTP_11,
    }
}

/// The length of a complete head within [`MAX_HEAD`]; `None` while it is incomplete.
fn head_len(parsed: httparse::Result<usize>, buffered: usize) -> Result<Option<usize>, H1Error> {
    match parsed {
        Ok(httparse::Status::Complete(len)) if len <= MAX_HEAD => Ok(Some(len)),
        Ok(httparse::Status::Partial) if buffered <= MAX_HEAD => Ok(None),
        Ok(_) | Err(httparse::Error::TooManyHeaders) => Err(H1Error::HeadTooLarge),
        Err(e) => Err(e.into()),
    }
}

/// Parses a request head from the front of `buf`, removing it; `None` until it is complete.
pub fn parse_request(buf: &mut BytesMut) -> Result<Option<RequestHead>, H1Error> {
    if buf.is_empty() {
        return Ok(None);
    }
    let mut fields: Slots<'_> = [const { MaybeUninit::uninit() }; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut []);
    let parsed = httparse::ParserConfig::default().parse_request_with_uninit_headers(
        &mut req,
        buf,
        &mut fields,
    );
    let Some(len) = head_len(parsed, buf.len())? else {
        return Ok(None);
    };
    let method = Method::from_bytes(req.method.unwrap_or_default().as_bytes())
        .map_err(|_| H1Error::Invalid("method"))?;
    let (target, target_len) = span_of(buf, req.path.unwrap_or_default().as_bytes());
    let version = version_of(req.version);
    let spans = spans_of(buf, req.headers);
    let (headers, seen) = take_head(buf, len, spans);
    let target = headers
        .head()
        .slice(target as usize..(target + target_len) as usize);
    let uri = Uri::from_maybe_shared(target).map_err(|_| H1Error::Invalid("request target"))?;
    check_target(&method, &uri)?;
    // RFC 9112 §3.2: exactly one valid Host in HTTP/1.1, at most one in HTTP/1.0. An empty one
    // is refused too: the RFC allows it only for a target without an authority, which no
    // request the proxy forwards is.
    match seen.hosts {
        0 if version == Version::HTTP_11 => return Err(H1Error::Invalid("Host (missing)")),
        0 => {}
        1 if headers.first("host").is_some_and(fields::is_valid_host) => {}
        1 => return Err(H1Error::Invalid("Host (not host[:port])")),
        _ => return Err(H1Error::Invalid("Host (more than one)")),
    }
    let framing = request_framing(version, &headers, seen)?;
    let keep_alive = keeps_alive(version, &headers, seen);
    Ok(Some(RequestHead {
        method,
        uri,
        version,
        headers,
        framing,
        keep_alive,
    }))
}

/// Whether the request-target has a form RFC 9112 §3.2 allows for the method: origin-form
/// (`/path?query`), absolute-form (`http` or `https`, a valid host, no userinfo, which RFC 9110
/// §4.2.4 deprecates), or `*` for `OPTIONS`. The authority-form is `CONNECT`'s, refused here.
fn check_target(method: &Method, uri: &Uri) -> Result<(), H1Error> {
    if method == Method::CONNECT {
        return Err(H1Error::Connect);
    }
    let Some(authority) = uri.authority() else {
        // `http` parses `*` and `/…` as a bare path; anything else without a scheme (`a`,
        // `a:80`) as an authority.
        return match uri.path() {
            "*" if method == Method::OPTIONS && uri.query().is_none() => Ok(()),
            "*" => Err(H1Error::Invalid("request target (* is for OPTIONS only)")),
            path if path.starts_with('/') && uri.scheme().is_none() => Ok(()),
            _ => Err(H1Error::Invalid(
                "request target (not origin-form, absolute-form or *)",
            )),
        };
    };
    let http = uri
        .scheme_str()
        .is_some_and(|s| s.eq_ignore_ascii_case("http") || s.eq_ignore_ascii_case("https"));
    if !http {
        return Err(H1Error::Invalid(
            "request target (not origin-form, absolute-form or *)",
        ));
    }
    if !fields::is_valid_host(authority.as_str().as_bytes()) {
        return Err(H1Error::Invalid(
            "request target (authority is not host[:port])",
        ));
    }
    Ok(())
}

/// Parses a response head from the front of `buf`, removing it; `None` until it is complete.
/// `head_request` says the request was `HEAD`, whose response has no body.
pub fn parse_response(
    buf: &mut BytesMut,
    head_request: bool,
) -> Result<Option<ResponseHead>, H1Error> {
    if buf.is_empty() {
        return Ok(None);
    }
    let mut fields: Slots<'_> = [const { MaybeUninit::uninit() }; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut []);
    let parsed = httparse::ParserConfig::default().parse_response_with_uninit_headers(
        &mut resp,
        buf,
        &mut fields,
    );
    let Some(len) = head_len(parsed, buf.len())? else {
        return Ok(None);
    };
    let status = StatusCode::from_u16(resp.code.unwrap_or_default())
        .map_err(|_| H1Error::Invalid("status code"))?;
    let version = version_of(resp.version);
    let spans = spans_of(buf, resp.headers);
    let (mut headers, seen) = take_head(buf, len, spans);
    let framing = response_framing(status, version, &headers, seen, head_request)?;
    // Transfer-Encoding overrides Content-Length, which must not be passed on (RFC 9112 §6.3).
    if seen.transfer_encoding && seen.content_length {
        headers.remove("content-length");
    }
    let keep_alive = keeps_alive(version, &headers, seen) && framing != Framing::UntilClose;
    Ok(Some(ResponseHead {
        status,
        version,
        headers,
        framing,
        keep_alive,
    }))
}

/// Whether the `Connection` header lists `token` (case-insensitively).
pub fn connection_has(headers: &impl Fields, token: &str) -> bool {
    headers
        .values_of("connection")
        .flat_map(|v| v.split(|&b| b == b','))
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token.as_bytes()))
}

/// Which of the fields that frame a message a head carries, told by one pass over its names,
/// so the rules below look up only the fields that are there.
#[derive(Debug, Clone, Copy, Default)]
struct Seen {
    hosts: usize,
    content_length: bool,
    transfer_encoding: bool,
    connection: bool,
}

impl Seen {
    fn of(headers: &impl Fields) -> Self {
        let mut seen = Seen::default();
        for (name, _) in headers.pairs() {
            let is = |known: &str| name.eq_ignore_ascii_case(known.as_bytes());
            match name.len() {
                4 if is("host") => seen.hosts += 1,
                10 if is("connection") => seen.connection = true,
                14 if is("content-length") => seen.content_length = true,
                17 if is("transfer-encoding") => seen.transfer_encoding = true,
                _ => {}
            }
        }
        seen
    }
}

fn keeps_alive(version: Version, headers: &impl Fields, seen: Seen) -> bool {
    if !seen.connection {
        return version != Version::HTTP_10;
    }
    if version == Version::HTTP_10 {
        connection_has(headers, "keep-alive")
    } else {
        !connection_has(headers, "close")
    }
}

/// The declared length: every `Content-Length` value must agree (RFC 9112 §6.3).
fn content_length(headers: &impl Fields) -> Result<Option<u64>, H1Error> {
    let mut length = None;
    for value in headers.values_of("content-length") {
        for part in value.split(|&b| b == b',') {
            let part = part.trim_ascii();
            if part.is_empty() || !part.iter().all(u8::is_ascii_digit) {
                return Err(H1Error::Framing("content-length is not a number"));
            }
            let n = part
                .iter()
                .try_fold(0u64, |n, &d| {
                    n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
                })
                .ok_or(H1Error::Framing("content-length is too large"))?;
            if length.is_some_and(|l| l != n) {
                return Err(H1Error::Framing("conflicting content-length values"));
            }
            length = Some(n);
        }
    }
    Ok(length)
}

/// The transfer codings, in order; empty without the header.
fn codings(headers: &impl Fields) -> impl Iterator<Item = &[u8]> {
    headers
        .values_of("transfer-encoding")
        .flat_map(|v| v.split(|&b| b == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|c| !c.is_empty())
}

/// What `Transfer-Encoding` says of a body whose framing the proxy can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Codings {
    /// `chunked` alone.
    Chunked,
    /// `chunked` over other codings (gzip, …), which the proxy does not decode.
    ChunkedOverOthers,
    /// No `chunked` (RFC 9112 §6.3: a request's length cannot be told; a response's runs to
    /// the close).
    NotChunked,
}

/// Reads `Transfer-Encoding` (present in the head). An empty list, or `chunked` anywhere but
/// last (RFC 9112 §7: it is applied once, as the final coding), is faulty framing.
fn transfer_codings(headers: &impl Fields) -> Result<Codings, H1Error> {
    let (mut count, mut chunked, mut last_chunked) = (0, 0, false);
    for coding in codings(headers) {
        count += 1;
        last_chunked = coding.eq_ignore_ascii_case(b"chunked");
        chunked += usize::from(last_chunked);
    }
    match (count, chunked, last_chunked) {
        (0, ..) => Err(H1Error::Framing("an empty transfer-encoding")),
        (1, 1, true) => Ok(Codings::Chunked),
        (_, 1, true) => Ok(Codings::ChunkedOverOthers),
        (_, 0, _) => Ok(Codings::NotChunked),
        _ => Err(H1Error::Framing(
            "chunked is not the final transfer coding, or is applied twice",
        )),
    }
}

fn request_framing(
    version: Version,
    headers: &impl Fields,
    seen: Seen,
) -> Result<Framing, H1Error> {
    if seen.transfer_encoding {
        // RFC 9112 §6.1: HTTP/1.0 has no transfer codings, so the framing is faulty.
        if version == Version::HTTP_10 {
            return Err(H1Error::Framing("transfer-encoding in an HTTP/1.0 message"));
        }
        // Both headers is how requests are smuggled past a proxy: refuse it.
        if seen.content_length {
            return Err(H1Error::Framing(
                "both transfer-encoding and content-length",
            ));
        }
        return match transfer_codings(headers)? {
            Codings::Chunked => Ok(Framing::Chunked),
            // Valid framing, but the coding under the chunks would be lost in the
            // length-framed copy sent on: RFC 9110 §6.1's 501 for a coding not understood.
            Codings::ChunkedOverOthers => Err(H1Error::UnsupportedCoding),
            // RFC 9112 §6.3: the length cannot be told; 400 and close.
            Codings::NotChunked => {
                Err(H1Error::Framing("the final transfer coding is not chunked"))
            }
        };
    }
    if !seen.content_length {
        return Ok(Framing::Empty);
    }
    Ok(match content_length(headers)? {
        Some(0) | None => Framing::Empty,
        Some(n) => Framing::Length(n),
    })
}

fn response_framing(
    status: StatusCode,
    version: Version,
    headers: &impl Fields,
    seen: Seen,
    head_request: bool,
) -> Result<Framing, H1Error> {
    // RFC 9112 §6.1, as for requests; a proxy answers such a response with 502 (§6.3).
    if seen.transfer_encoding && version == Version::HTTP_10 {
        return Err(H1Error::Framing("transfer-encoding in an HTTP/1.0 message"));
    }
    if head_request
        || status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        return Ok(Framing::Empty);
    }
    if seen.transfer_encoding {
        return match transfer_codings(headers)? {
            Codings::Chunked => Ok(Framing::Chunked),
            // Under the chunks (gzip, …) or alone: the coding is hop-by-hop and would be lost,
            // passing coded bytes off as the content.
            Codings::ChunkedOverOthers | Codings::NotChunked => Err(H1Error::UnsupportedCoding),
        };
    }
    if !seen.content_length {
        return Ok(Framing::UntilClose);
    }
    Ok(match content_length(headers)? {
        Some(0) => Framing::Empty,
        Some(n) => Framing::Length(n),
        None => Framing::UntilClose,
    })
}

/// Appends `name: value\r\n` for every header.
fn put_headers<'h>(out: &mut Vec<u8>, headers: impl IntoIterator<Item = (&'h [u8], &'h [u8])>) {
    for (name, value) in headers {
        out.extend_from_slice(name);
        out.extend_from_slice(b": ");
        out.extend_from_slice(value);
        out.extend_from_slice(b"\r\n");
    }
}

fn put_decimal(out: &mut Vec<u8>, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[i..]);
}

/// Writes an HTTP/1.1 request head: `target` is the origin-form path, `host` the backend's,
/// `headers` the forwarded ones (without `Host`, `Content-Length` or hop-by-hop fields).
pub fn put_request_head<'h>(
    out: &mut Vec<u8>,
    method: &Method,
    target: &[&str],
    host: &HeaderValue,
    headers: impl IntoIterator<Item = (&'h [u8], &'h [u8])>,
    content_length: Option<u64>,
) {
    out.extend_from_slice(method.as_str().as_bytes());
    out.push(b' ');
    for part in target {
        out.extend_from_slice(part.as_bytes());
    }
    out.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    out.extend_from_slice(host.as_bytes());
    out.extend_from_slice(b"\r\n");
    put_headers(out, headers);
    if let Some(n) = content_length {
        out.extend_from_slice(b"content-length: ");
        put_decimal(out, n);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

/// How a response body is sent to the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutFraming {
    /// No body on the wire (HEAD, 204, 304), or one whose `Content-Length` is in the headers.
    AsIs,
    /// Chunked transfer coding (an HTTP/1.1 client, length unknown).
    Chunked,
    /// Until the connection closes (an HTTP/1.0 client, length unknown).
    Close,
}

/// Writes a response head; `close` adds `Connection: close`, `keep_alive_10` the
/// `Connection: keep-alive` an HTTP/1.0 client needs to keep the connection.
pub fn put_response_head<'h>(
    out: &mut Vec<u8>,
    status: StatusCode,
    headers: impl IntoIterator<Item = (&'h [u8], &'h [u8])>,
    framing: OutFraming,
    close: bool,
    keep_alive_10: bool,
) {
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    put_headers(out, headers);
    if framing == OutFraming::Chunked {
        out.extend_from_slice(b"transfer-encoding: chunked\r\n");
    }
    if close {
        out.extend_from_slice(b"connection: close\r\n");
    } else if keep_alive_10 {
        out.extend_from_slice(b"connection: keep-alive\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

/// Writes `Content-Length` into `headers` form (for bodies of known size without the header).
pub fn length_value(n: u64) -> HeaderValue {
    let mut out = Vec::with_capacity(20);
    put_decimal(&mut out, n);
    HeaderValue::from_bytes(&out).expect("digits are a valid header value")
}

/// Appends the chunk-size line of a chunk of `len` bytes.
pub fn put_chunk_size(out: &mut Vec<u8>, len: usize) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut digits = [0u8; 16];
    let mut i = digits.len();
    let mut n = len;
    loop {
        i -= 1;
        digits[i] = HEX[n & 15];
        n >>= 4;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[i..]);
    out.extend_from_slice(b"\r\n");
}

/// The end of a chunked body (no trailers).
pub const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

/// What one decoding step produced.
#[derive(Debug, PartialEq, Eq)]
pub enum Decoded {
    /// A piece of body data, split off the buffer.
    Data(Bytes),
    /// The buffer holds no more of the body yet: read more.
    NeedMore,
    /// The body is complete.
    Done,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    Size,
    Data(u64),
    DataEnd,
    Trailers,
}

/// Decodes a body of a given framing from the front of a read buffer, leaving whatever
/// follows it (the next pipelined message) in place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BodyDecoder {
    state: State,
    /// Chunk-extension bytes seen so far, against [`MAX_CHUNK_EXTENSIONS`].
    extensions: usize,
    /// Trailer-section bytes seen so far, against [`MAX_TRAILERS`].
    trailers: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Length(u64),
    Chunked(Chunk),
    UntilClose,
    Done,
}

impl BodyDecoder {
    /// A decoder for a body framed as `framing`.
    pub fn new(framing: Framing) -> Self {
        let state = match framing {
            Framing::Empty | Framing::Length(0) => State::Done,
            Framing::Length(n) => State::Length(n),
            Framing::Chunked => State::Chunked(Chunk::Size),
            Framing::UntilClose => State::UntilClose,
        };
        Self {
            state,
            extensions: 0,
            trailers: 0,
        }
    }

    /// True once the whole body has been decoded.
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// The body bytes still expected, when the framing says.
    pub fn remaining(&self) -> Option<u64> {
        match self.state {
            State::Length(n) => Some(n),
            State::Done => Some(0),
            _ => None,
        }
    }

    /// Decodes the next piece from `buf`; `eof` says the peer has closed (so `buf` is all
    /// there will be).
    pub fn decode(&mut self, buf: &mut BytesMut, eof: bool) -> Result<Decoded, H1Error> {
        match self.state {
            State::Done => Ok(Decoded::Done),
            State::Length(_) | State::Chunked(_) if buf.is_empty() && eof => {
                Err(H1Error::Incomplete)
            }
            State::Length(n) => {
                if buf.is_empty() {
                    return Ok(Decoded::NeedMore);
                }
                let take = n.min(buf.len() as u64);
                self.state = match n - take {
                    0 => State::Done,
                    rest => State::Length(rest),
                };
                Ok(Decoded::Data(buf.split_to(take as usize).freeze()))
            }
            State::UntilClose if !buf.is_empty() => Ok(Decoded::Data(buf.split().freeze())),
            State::UntilClose if eof => {
                self.state = State::Done;
                Ok(Decoded::Done)
            }
            State::UntilClose => Ok(Decoded::NeedMore),
            State::Chunked(chunk) => match self.chunked_step(chunk, buf)? {
                Some(decoded) => Ok(decoded),
                None if self.is_done() => Ok(Decoded::Done),
                None if eof => Err(H1Error::Incomplete),
                None => Ok(Decoded::NeedMore),
            },
        }
    }

    /// Advances the chunked state as far as `buf` allows; `Some` when data is produced.
    /// Every line must end in CRLF, and so must every chunk's data (RFC 9112 §7.1): a bare
    /// LF or CR is where two parsers would disagree on where a chunk ends.
    fn chunked_step(
        &mut self,
        mut chunk: Chunk,
        buf: &mut BytesMut,
    ) -> Result<Option<Decoded>, H1Error> {
        loop {
            match chunk {
                Chunk::Size => {
                    let Some(line) = take_line(buf, MAX_LINE, "a chunk-size line over 4 KiB")?
                    else {
                        break;
                    };
                    let (size, extensions) = chunk_size(&line)?;
                    self.extensions += extensions;
                    if self.extensions > MAX_CHUNK_EXTENSIONS {
                        return Err(H1Error::Chunked("chunk extensions over 16 KiB in all"));
                    }
                    chunk = match size {
                        0 => Chunk::Trailers,
                        n => Chunk::Data(n),
                    };
                }
                Chunk::Data(n) => {
                    if buf.is_empty() {
                        break;
                    }
                    let take = n.min(buf.len() as u64);
                    let data = buf.split_to(take as usize).freeze();
                    self.state = State::Chunked(if take == n {
                        Chunk::DataEnd
                    } else {
                        Chunk::Data(n - take)
                    });
                    return Ok(Some(Decoded::Data(data)));
                }
                Chunk::DataEnd => {
                    // Refused at the first wrong byte, without waiting for a line end.
                    if buf.first().is_some_and(|&b| b != b'\r')
                        || buf.get(1).is_some_and(|&b| b != b'\n')
                    {
                        return Err(H1Error::Chunked("chunk data not followed by CRLF"));
                    }
                    if buf.len() < 2 {
                        break;
                    }
                    bytes::Buf::advance(buf, 2);
                    chunk = Chunk::Size;
                }
                Chunk::Trailers => {
                    // Each line with its CRLF, and the final CRLF, within the limit.
                    let Some(room) = (MAX_TRAILERS - self.trailers).checked_sub(2) else {
                        return Err(H1Error::Chunked("trailers over 16 KiB"));
                    };
                    let Some(line) = take_line(buf, room, "trailers over 16 KiB")? else {
                        break;
                    };
                    self.trailers += line.len() + 2;
                    if line.is_empty() {
                        self.state = State::Done;
                        return Ok(None);
                    }
                    if !is_field_line(&line) {
                        return Err(H1Error::Chunked("a trailer that is not a field line"));
                    }
                }
            }
        }
        self.state = State::Chunked(chunk);
        Ok(None)
    }
}

/// Takes one line, without its CRLF, off the front of `buf`; `None` until a whole line is
/// there. A line longer than `max` bytes (`too_long` says which), one ended by a bare LF, or
/// one holding a CR is an error, found without reading past `max`.
fn take_line(
    buf: &mut BytesMut,
    max: usize,
    too_long: &'static str,
) -> Result<Option<Bytes>, H1Error> {
    // Judged by the first CR or LF, whichever comes first, so that the verdict does not depend
    // on how much of the line has arrived.
    let window = &buf[..buf.len().min(max + 2)];
    let cr = memchr::memchr(b'\r', window);
    if let Some(lf) = memchr::memchr(b'\n', window) {
        if cr.is_none_or(|cr| lf < cr) {
            return Err(H1Error::Chunked("a line ended by a bare LF"));
        }
    }
    match cr {
        Some(cr) if cr + 1 < window.len() => {
            if window[cr + 1] != b'\n' {
                return Err(H1Error::Chunked("a CR not followed by LF"));
            }
            let mut line = buf.split_to(cr + 2);
            line.truncate(cr);
            Ok(Some(line.freeze()))
        }
        _ if window.len() == max + 2 => Err(H1Error::Chunked(too_long)),
        _ => Ok(None),
    }
}

/// Reads a chunk-size line (RFC 9112 §7.1.1): the size, and how many bytes of chunk
/// extensions follow it. At most 15 hex digits (as httparse allows), so no size overflows;
/// whitespace after the size is taken as the BWS before an extension, as hyper, httparse and
/// h11 do.
fn chunk_size(line: &[u8]) -> Result<(u64, usize), H1Error> {
    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    if digits == 0 {
        return Err(H1Error::Chunked("a chunk size that is not hex digits"));
    }
    if digits > 15 {
        return Err(H1Error::Chunked("a chunk size over 15 hex digits"));
    }
    let size = line[..digits].iter().fold(0u64, |n, &b| {
        n << 4 | u64::from((b as char).to_digit(16).unwrap_or_default())
    });
    let extensions = &line[digits..];
    if !is_chunk_ext(extensions) {
        return Err(H1Error::Chunked("a malformed chunk extension"));
    }
    Ok((size, extensions.len()))
}

/// Whether `s` is `*( BWS ";" BWS name [ BWS "=" BWS ( token / quoted-string ) ] ) BWS`.
fn is_chunk_ext(mut s: &[u8]) -> bool {
    let skip_ws =
        |s: &[u8]| -> usize { s.iter().take_while(|&&b| b == b' ' || b == b'\t').count() };
    let token_len = |s: &[u8]| -> usize { s.iter().take_while(|&&b| fields::is_tchar(b)).count() };
    loop {
        s = &s[skip_ws(s)..];
        let Some(rest) = s.strip_prefix(b";") else {
            return s.is_empty();
        };
        let rest = &rest[skip_ws(rest)..];
        let name = token_len(rest);
        if name == 0 {
            return false;
        }
        s = &rest[name..];
        let after = &s[skip_ws(s)..];
        if let Some(value) = after.strip_prefix(b"=") {
            let value = &value[skip_ws(value)..];
            let len = match fields::quoted_len(value) {
                Some(len) => len,
                None => token_len(value),
            };
            if len == 0 {
                return false;
            }
            s = &value[len..];
        }
    }
}

/// Whether a trailer line is `name ":" value` with a token name and a value of field content
/// (no obs-fold, no control other than HTAB).
fn is_field_line(line: &[u8]) -> bool {
    let Some(colon) = memchr::memchr(b':', line) else {
        return false;
    };
    fields::is_token(&line[..colon])
        && line[colon + 1..]
            .iter()
            .all(|&b| b == b'\t' || (b >= b' ' && b != 0x7f))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buf(s: &str) -> BytesMut {
        BytesMut::from(s.as_bytes())
    }

    #[test]
    fn request_head_is_parsed_and_the_rest_left_for_the_body() {
        let mut b = buf("POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: a\r\nX-Session-ID: s1\r\ncontent-length: 2\r\n\r\n{}GET");
        let head = parse_request(&mut b).unwrap().unwrap();
        assert_eq!(head.method, Method::POST);
        assert_eq!(head.uri.path(), "/v1/chat/completions");
        assert_eq!(head.uri.query(), Some("x=1"));
        assert_eq!(head.headers.first("x-session-id"), Some(&b"s1"[..]));
        assert_eq!(head.headers.pairs().count(), 3);
        assert_eq!(head.headers.to_map()["host"], "a");
        assert_eq!(head.framing, Framing::Length(2));
        assert!(head.keep_alive);
        assert_eq!(&b[..], b"{}GET");
    }

    #[test]
    fn partial_heads_wait_and_oversized_ones_fail() {
        let mut b = buf("GET / HTTP/1.1\r\nHost: a\r\n");
        assert!(parse_request(&mut b).unwrap().is_none());
        assert_eq!(b.len(), 25, "nothing consumed");
        let mut big = buf("GET / HTTP/1.1\r\nx-big: ");
        big.extend_from_slice(&vec![b'a'; MAX_HEAD + 1]);
        assert!(matches!(
            parse_request(&mut big),
            Err(H1Error::HeadTooLarge)
        ));
    }

    #[test]
    fn smuggling_shaped_framing_is_refused() {
        let refused = |fields: &str| {
            let head = format!("POST / HTTP/1.1\r\nhost: a\r\n{fields}\r\n");
            parse_request(&mut buf(&head)).unwrap_err()
        };
        for fields in [
            "content-length: 3\r\ntransfer-encoding: chunked\r\n",
            "content-length: 3\r\ncontent-length: 4\r\n",
            "content-length: +3\r\n",
            "Content-Length: 3\r\nCONTENT-LENGTH: 4\r\n",
            "content-length: 18446744073709551616\r\n",
        ] {
            assert!(matches!(refused(fields), H1Error::Framing(_)), "{fields}");
        }
        let largest = "POST / HTTP/1.1\r\nhost: a\r\nContent-Length: 18446744073709551615\r\n\r\n";
        assert_eq!(
            parse_request(&mut buf(largest)).unwrap().unwrap().framing,
            Framing::Length(u64::MAX)
        );
        let fields = "transfer-encoding: gzip, chunked\r\n";
        assert!(matches!(refused(fields), H1Error::UnsupportedCoding));
        for coded in ["gzip", "chunked, gzip", "chunked, chunked", ""] {
            let fields = format!("transfer-encoding: {coded}\r\n");
            assert!(matches!(refused(&fields), H1Error::Framing(_)), "{coded}");
        }
        assert!(matches!(refused("host: b\r\n"), H1Error::Invalid(_)));
        let no_host = "GET / HTTP/1.1\r\n\r\n";
        assert!(matches!(
            parse_request(&mut buf(no_host)),
            Err(H1Error::Invalid(_))
        ));
    }

    #[test]
    fn complete_heads_over_the_limit_are_refused_too() {
        let mut big = buf("GET / HTTP/1.1\r\nhost: a\r\nx-big: ");
        big.extend_from_slice(&vec![b'a'; MAX_HEAD]);
        big.extend_from_slice(b"\r\n\r\n");
        assert!(matches!(
            parse_request(&mut big),
            Err(H1Error::HeadTooLarge)
        ));
        let mut resp = buf("HTTP/1.1 200 OK\r\nx-big: ");
        resp.extend_from_slice(&vec![b'a'; MAX_HEAD]);
        resp.extend_from_slice(b"\r\n\r\n");
        assert!(matches!(
            parse_response(&mut resp, false),
            Err(H1Error::HeadTooLarge)
        ));
    }

    #[test]
    fn keep_alive_follows_the_version_and_connection_header() {
        let parse = |s: &str| parse_request(&mut buf(s)).unwrap().unwrap();
        assert!(!parse("GET / HTTP/1.0\r\n\r\n").keep_alive);
        assert!(parse("GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n").keep_alive);
        assert!(!parse("GET / HTTP/1.1\r\nhost: a\r\nconnection: foo, close\r\n\r\n").keep_alive);
        assert!(parse("GET / HTTP/1.1\r\nhost: a\r\n\r\n").keep_alive);
    }

    #[test]
    fn response_framing_follows_rfc_9112() {
        let parse = |s: &str, head: bool| parse_response(&mut buf(s), head).unwrap().unwrap();
        assert_eq!(
            parse("HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n", false).framing,
            Framing::Length(5)
        );
        assert_eq!(
            parse("HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n", true).framing,
            Framing::Empty
        );
        assert_eq!(
            parse("HTTP/1.1 204 No Content\r\n\r\n", false).framing,
            Framing::Empty
        );
        assert_eq!(
            parse(
                "HTTP/1.1 304 Not Modified\r\ncontent-length: 9\r\n\r\n",
                false
            )
            .framing,
            Framing::Empty
        );
        let both = parse(
            "HTTP/1.1 200 OK\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n",
            false,
        );
        assert_eq!(both.framing, Framing::Chunked, "transfer-encoding wins");
        assert!(
            !both.headers.has("content-length"),
            "and the length is not passed on"
        );
        let chunked = parse(
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
            false,
        );
        assert_eq!(chunked.framing, Framing::Chunked);
        assert!(chunked.keep_alive);
        let until_close = parse("HTTP/1.1 200 OK\r\n\r\n", false);
        assert_eq!(until_close.framing, Framing::UntilClose);
        assert!(
            !until_close.keep_alive,
            "a close-delimited body ends the connection"
        );
        assert!(!parse("HTTP/1.0 200 OK\r\ncontent-length: 1\r\n\r\n", false).keep_alive);
        for coded in ["gzip", "gzip, chunked"] {
            let head = format!("HTTP/1.1 200 OK\r\ntransfer-encoding: {coded}\r\n\r\n");
            assert!(
                matches!(
                    parse_response(&mut buf(&head), false),
                    Err(H1Error::UnsupportedCoding)
                ),
                "{coded}"
            );
        }
        for faulty in [
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked, chunked\r\n\r\n",
            "HTTP/1.0 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
        ] {
            assert!(
                matches!(
                    parse_response(&mut buf(faulty), false),
                    Err(H1Error::Framing(_))
                ),
                "{faulty}"
            );
        }
    }

    #[test]
    fn chunked_bodies_decode_piece_by_piece_across_reads() {
        let wire = "5;ext=1\r\nhello\r\n7\r\n, world\r\n0\r\ntrailer: x\r\n\r\nNEXT";
        // Feed the body one byte at a time: the data must come out whole and in order.
        let mut decoder = BodyDecoder::new(Framing::Chunked);
        let mut b = BytesMut::new();
        let mut out = Vec::new();
        let mut done = false;
        for (i, byte) in wire.bytes().enumerate() {
            if done {
                b.extend_from_slice(&wire.as_bytes()[i..]);
                break;
            }
            b.extend_from_slice(&[byte]);
            loop {
                match decoder.decode(&mut b, false).unwrap() {
                    Decoded::Data(d) => out.extend_from_slice(&d),
                    Decoded::NeedMore => break,
                    Decoded::Done => {
                        done = true;
                        break;
                    }
                }
            }
        }
        assert!(done && decoder.is_done());
        assert_eq!(out, b"hello, world");
        assert_eq!(&b[..], b"NEXT", "the next message stays in the buffer");
    }

    #[test]
    fn truncated_and_malformed_bodies_are_errors() {
        let mut d = BodyDecoder::new(Framing::Length(10));
        let mut b = buf("12345");
        assert_eq!(
            d.decode(&mut b, false).unwrap(),
            Decoded::Data(Bytes::from_static(b"12345"))
        );
        assert!(matches!(d.decode(&mut b, true), Err(H1Error::Incomplete)));
        let mut c = BodyDecoder::new(Framing::Chunked);
        assert!(matches!(
            c.decode(&mut buf("zz\r\n"), false),
            Err(H1Error::Chunked(_))
        ));
        let mut c = BodyDecoder::new(Framing::Chunked);
        assert!(matches!(
            c.decode(&mut buf("3\r\nabcX\r\n"), false),
            Ok(Decoded::Data(_))
        ));
        assert!(matches!(
            c.decode(&mut buf("X\r\n"), false),
            Err(H1Error::Chunked(_))
        ));
        let mut c = BodyDecoder::new(Framing::Chunked);
        assert!(matches!(
            c.decode(&mut buf("3\r\nab"), true),
            Ok(Decoded::Data(_))
        ));
        assert!(matches!(
            c.decode(&mut BytesMut::new(), true),
            Err(H1Error::Incomplete)
        ));
        let mut u = BodyDecoder::new(Framing::UntilClose);
        assert!(matches!(
            u.decode(&mut buf("abc"), false),
            Ok(Decoded::Data(_))
        ));
        assert_eq!(u.decode(&mut BytesMut::new(), true).unwrap(), Decoded::Done);
    }

    #[test]
    fn heads_are_written_in_wire_form() {
        let headers = WireFields::from_pairs([(&b"x-session-id"[..], &b"s1"[..])]);
        let mut out = Vec::new();
        put_request_head(
            &mut out,
            &Method::POST,
            &["/base", "/v1/chat/completions"],
            &HeaderValue::from_static("10.0.0.1:8000"),
            headers.pairs(),
            Some(1234),
        );
        assert_eq!(
            out,
            b"POST /base/v1/chat/completions HTTP/1.1\r\nhost: 10.0.0.1:8000\r\nx-session-id: s1\r\ncontent-length: 1234\r\n\r\n"
        );
        let mut out = Vec::new();
        put_response_head(
            &mut out,
            StatusCode::OK,
            headers.pairs(),
            OutFraming::Chunked,
            true,
            false,
        );
        assert_eq!(
            out,
            b"HTTP/1.1 200 OK\r\nx-session-id: s1\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
        );
        let mut size = Vec::new();
        put_chunk_size(&mut size, 0x1a2f);
        assert_eq!(size, b"1a2f\r\n");
        assert_eq!(length_value(0), "0");
        assert_eq!(
            length_value(18_446_744_073_709_551_615),
            "18446744073709551615"
        );
    }
}
