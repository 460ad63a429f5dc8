//! Heads written out in wire form, each into one buffer so that one write sends it, and the
//! chunked coding of a body whose length is not known.

use http::header::HeaderValue;
use http::{Method, StatusCode};

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
pub(crate) fn put_request_head<'h>(
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
pub(crate) enum OutFraming {
    /// No body on the wire (HEAD, 204, 304), or one whose `Content-Length` is in the headers.
    AsIs,
    /// Chunked transfer coding (an HTTP/1.1 client, length unknown).
    Chunked,
    /// Until the connection closes (an HTTP/1.0 client, length unknown).
    Close,
}

/// Writes a response head; `close` adds `Connection: close`, `keep_alive_10` the
/// `Connection: keep-alive` an HTTP/1.0 client needs to keep the connection.
pub(crate) fn put_response_head<'h>(
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
pub(crate) fn length_value(n: u64) -> HeaderValue {
    let mut out = Vec::with_capacity(20);
    put_decimal(&mut out, n);
    HeaderValue::from_bytes(&out).expect("digits are a valid header value")
}

/// Appends the chunk-size line of a chunk of `len` bytes.
pub(crate) fn put_chunk_size(out: &mut Vec<u8>, len: usize) {
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
pub(crate) const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http1::fields::{Fields, WireFields};

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
