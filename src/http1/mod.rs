//! The crate's one HTTP/1.1 codec: heads parsed and written, bodies framed and decoded, under
//! the limits in `limits`. The proxy's ingress (client connections), its upstream pool
//! (backend connections, health probes included) and the replay client all speak HTTP/1.1
//! through it.
//!
//! One codec because each copy of a wire parser is a place where two readers of the same bytes
//! can disagree (a smuggled request, a response read two ways, a limit one copy forgot): a fix
//! or a limit made here holds for every component at once. The codec owns no socket; callers
//! read into a buffer and hand it over, so it serves a proxy's task-per-connection loop and a
//! client's timed reads alike.
//!
//! - `head`: request and response heads (httparse), with RFC 9112's checks of them;
//! - `framing`: how a body is delimited, from `Content-Length` and `Transfer-Encoding`;
//! - `body`: the incremental body decoder (length, chunked, until close);
//! - `write`: heads and chunk framing in wire form;
//! - `fields`: header fields left in the buffer they were read into, and the value grammar;
//! - `limits`: every size a peer controls.

mod body;
pub(crate) mod fields;
mod framing;
mod head;
pub(crate) mod limits;
mod write;

#[cfg(test)]
mod tests;

use bytes::BytesMut;
use http::StatusCode;

pub(crate) use body::{BodyDecoder, Decoded};
pub(crate) use fields::{Fields, WireFields};
pub(crate) use framing::Framing;
pub(crate) use head::{parse_request, parse_response, RequestHead, ResponseHead};
pub(crate) use limits::MAX_HEAD;
pub(crate) use write::{
    length_value, put_chunk_size, put_request_head, put_response_head, OutFraming, LAST_CHUNK,
};

use limits::READ_CHUNK;

/// Makes room for the next read: a quarter of `READ_CHUNK` free at least.
///
/// An empty buffer whose earlier messages are all dropped starts again at its beginning, so
/// a keep-alive connection reads every message into the same few cache lines rather than
/// walking its whole buffer (and, on a busy worker, the cache with it).
pub(crate) fn reserve_read(buf: &mut BytesMut) {
    if buf.is_empty() && buf.try_reclaim(READ_CHUNK) {
        return;
    }
    if buf.capacity() - buf.len() < READ_CHUNK / 4 {
        buf.reserve(READ_CHUNK);
    }
}

/// Reads what is there (at least one byte, or 0 at the end of the stream) into `buf`.
pub(crate) async fn read_some<R: tokio::io::AsyncRead + Unpin>(
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
