//! The HTTP/1 codec against a table of RFC 9112 / RFC 9110 cases, one named row each: request
//! heads, response heads and chunked bodies, through `h1::parse_request`, `h1::parse_response`
//! and `h1::BodyDecoder` directly.
//!
//! Invariant: every row gives its expected outcome, which is the RFC's where the RFC says MUST,
//! and the stricter reading where a second parser downstream could read the bytes differently.
//! The rows cover the rules the codec enforces itself and those it takes from httparse, so a
//! change of either shows here.

use agentrace::proxy::h1::{self, Framing, H1Error};
use bytes::BytesMut;

/// What parsing a request head must give: its body framing, or the status it is refused with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Req {
    Ok(Framing),
    Refused(u16),
}

const EMPTY: Req = Req::Ok(Framing::Empty);
const BAD: Req = Req::Refused(400);

fn parse_request(wire: &[u8]) -> Result<Option<h1::RequestHead>, H1Error> {
    h1::parse_request(&mut BytesMut::from(wire))
}

/// Request heads, each with `Host` unless the row is about it.
const REQUESTS: &[(&str, &str, Req)] = &[
    // Host (RFC 9112 §3.2, RFC 9110 §7.2, RFC 3986 §3.2.2)
    ("host a reg-name", "GET / HTTP/1.1\r\nHost: example.com\r\n\r\n", EMPTY),
    ("host with a port", "GET / HTTP/1.1\r\nHost: example.com:8080\r\n\r\n", EMPTY),
    ("host an IPv4 address", "GET / HTTP/1.1\r\nHost: 192.0.2.1\r\n\r\n", EMPTY),
    ("host an IPv6 literal with a port", "GET / HTTP/1.1\r\nHost: [2001:db8::1]:80\r\n\r\n", EMPTY),
    ("host percent-encoded", "GET / HTTP/1.1\r\nHost: ex%41mple\r\n\r\n", EMPTY),
    ("host missing in HTTP/1.1", "GET / HTTP/1.1\r\n\r\n", BAD),
    ("host missing in HTTP/1.0", "GET / HTTP/1.0\r\n\r\n", EMPTY),
    ("host twice", "GET / HTTP/1.1\r\nHost: a\r\nHost: a\r\n\r\n", BAD),
    ("host twice in HTTP/1.0", "GET / HTTP/1.0\r\nHost: a\r\nhost: b\r\n\r\n", BAD),
    ("host empty", "GET / HTTP/1.1\r\nHost:\r\n\r\n", BAD),
    ("host with a space", "GET / HTTP/1.1\r\nHost: a b\r\n\r\n", BAD),
    ("host with a quote", "GET / HTTP/1.1\r\nHost: a\";for=6.6.6.6\r\n\r\n", BAD),
    ("host with userinfo", "GET / HTTP/1.1\r\nHost: user@a\r\n\r\n", BAD),
    ("host with a path", "GET / HTTP/1.1\r\nHost: a/b\r\n\r\n", BAD),
    ("host a colon without a port", "GET / HTTP/1.1\r\nHost: a:\r\n\r\n", BAD),
    ("host port over 65535", "GET / HTTP/1.1\r\nHost: a:65536\r\n\r\n", BAD),
    ("host port not digits", "GET / HTTP/1.1\r\nHost: a:http\r\n\r\n", BAD),
    ("host IPv6 unbracketed", "GET / HTTP/1.1\r\nHost: 2001:db8::1\r\n\r\n", BAD),
    ("host bracket unclosed", "GET / HTTP/1.1\r\nHost: [::1\r\n\r\n", BAD),
    ("host bad percent-encoding", "GET / HTTP/1.1\r\nHost: a%zz\r\n\r\n", BAD),
    // Request line and request-target (RFC 9112 §3)
    ("origin-form with a query", "GET /v1/x?a=b HTTP/1.1\r\nHost: a\r\n\r\n", EMPTY),
    ("absolute-form http", "GET http://a/v1 HTTP/1.1\r\nHost: a\r\n\r\n", EMPTY),
    ("absolute-form https with a port", "GET https://a:8443/ HTTP/1.1\r\nHost: a\r\n\r\n", EMPTY),
    ("absolute-form without a path", "GET http://a HTTP/1.1\r\nHost: a\r\n\r\n", EMPTY),
    ("absolute-form of another scheme", "GET ftp://a/ HTTP/1.1\r\nHost: a\r\n\r\n", BAD),
    ("absolute-form with userinfo", "GET http://u@a/ HTTP/1.1\r\nHost: a\r\n\r\n", BAD),
    ("asterisk-form for OPTIONS", "OPTIONS * HTTP/1.1\r\nHost: a\r\n\r\n", EMPTY),
    ("asterisk-form for GET", "GET * HTTP/1.1\r\nHost: a\r\n\r\n", BAD),
    ("a bare word as the target", "GET a HTTP/1.1\r\nHost: a\r\n\r\n", BAD),
    ("authority-form for GET", "GET a:80 HTTP/1.1\r\nHost: a\r\n\r\n", BAD),
    ("CONNECT", "CONNECT a:443 HTTP/1.1\r\nHost: a:443\r\n\r\n", Req::Refused(405)),
    ("CONNECT in origin-form", "CONNECT / HTTP/1.1\r\nHost: a\r\n\r\n", Req::Refused(405)),
    ("an extension method", "PURGE /x HTTP/1.1\r\nHost: a\r\n\r\n", EMPTY),
    ("a method that is not a token", "GE(T / HTTP/1.1\r\nHost: a\r\n\r\n", BAD),
    ("HTTP/1.2", "GET / HTTP/1.2\r\nHost: a\r\n\r\n", BAD),
    ("HTTP/2.0 in HTTP/1 framing", "GET / HTTP/2.0\r\nHost: a\r\n\r\n", BAD),
    ("a misspelled version", "GET / HTP/1.1\r\nHost: a\r\n\r\n", BAD),
    ("a lower-case version", "GET / http/1.1\r\nHost: a\r\n\r\n", BAD),
    ("two spaces after the method", "GET  / HTTP/1.1\r\nHost: a\r\n\r\n", BAD),
    ("a NUL in the target", "GET /a\0b HTTP/1.1\r\nHost: a\r\n\r\n", BAD),
    ("a space inside the target", "GET /a b HTTP/1.1\r\nHost: a\r\n\r\n", BAD),
    // RFC 9112 §2.2: an empty line before the request line SHOULD be ignored, and a bare LF
    // MAY end a head's lines; the proxy writes CRLF heads, so no later parser sees either.
    ("an empty line before the request line", "\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n", EMPTY),
    ("bare LF line ends in the head", "GET / HTTP/1.1\nHost: a\n\n", EMPTY),
    // Field lines (RFC 9112 §5)
    ("obs-fold", "GET / HTTP/1.1\r\nHost: a\r\nX-A: b\r\n c\r\n\r\n", BAD),
    ("a space before the colon", "GET / HTTP/1.1\r\nHost : a\r\n\r\n", BAD),
    ("a tab before the colon", "GET / HTTP/1.1\r\nHost\t: a\r\n\r\n", BAD),
    ("a name that is not a token", "GET / HTTP/1.1\r\nHost: a\r\nX@Y: 1\r\n\r\n", BAD),
    ("an empty name", "GET / HTTP/1.1\r\nHost: a\r\n: 1\r\n\r\n", BAD),
    ("a NUL in a value", "GET / HTTP/1.1\r\nHost: a\r\nX-A: b\0c\r\n\r\n", BAD),
    ("a bare CR in a value", "GET / HTTP/1.1\r\nHost: a\r\nX-A: b\rc\r\n\r\n", BAD),
    ("a line with no colon", "GET / HTTP/1.1\r\nHost: a\r\nX-A\r\n\r\n", BAD),
    ("obs-text in a value", "GET / HTTP/1.1\r\nHost: a\r\nX-A: caf\u{e9}\r\n\r\n", EMPTY),
    ("an empty value", "GET / HTTP/1.1\r\nHost: a\r\nX-A:\r\n\r\n", EMPTY),
    // Content-Length (RFC 9112 §6.2, §6.3)
    ("content-length", "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\n", Req::Ok(Framing::Length(5))),
    ("content-length zero", "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n", EMPTY),
    ("content-length twice, equal", "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\ncontent-length: 5\r\n\r\n", Req::Ok(Framing::Length(5))),
    ("content-length a list of one value", "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5, 5\r\n\r\n", Req::Ok(Framing::Length(5))),
    ("content-length twice, differing", "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n", BAD),
    ("content-length a list of two values", "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5, 6\r\n\r\n", BAD),
    ("content-length with a plus sign", "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: +5\r\n\r\n", BAD),
    ("content-length negative", "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: -5\r\n\r\n", BAD),
    ("content-length in hex", "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 0x5\r\n\r\n", BAD),
    ("content-length empty", "POST / HTTP/1.1\r\nHost: a\r\nContent-Length:\r\n\r\n", BAD),
    ("content-length over u64", "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 18446744073709551616\r\n\r\n", BAD),
    // Transfer-Encoding (RFC 9112 §6.1, §6.3, §7)
    ("chunked", "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n", Req::Ok(Framing::Chunked)),
    ("chunked in capitals", "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: CHUNKED\r\n\r\n", Req::Ok(Framing::Chunked)),
    ("chunked and content-length", "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n", BAD),
    ("chunked in HTTP/1.0", "POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n", BAD),
    ("chunked in HTTP/1.0 with a length", "POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n", BAD),
    ("a coding list ending in gzip", "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked, gzip\r\n\r\n", BAD),
    ("gzip alone", "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\n\r\n", BAD),
    ("identity alone", "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: identity\r\n\r\n", BAD),
    ("a second line that ends the list in gzip", "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: gzip\r\n\r\n", BAD),
    ("chunked twice", "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked, chunked\r\n\r\n", BAD),
    ("an empty transfer-encoding", "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding:\r\n\r\n", BAD),
    ("an empty transfer-encoding with a length", "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: \r\nContent-Length: 5\r\n\r\n", BAD),
    // Valid framing the proxy cannot pass on: the coding under the chunks would be lost.
    ("gzip under chunked", "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", Req::Refused(501)),
    ("gzip under chunked on two lines", "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n", Req::Refused(501)),
];

#[test]
fn request_heads_follow_the_table() {
    let mut wrong = Vec::new();
    for &(name, wire, expected) in REQUESTS {
        let got = match parse_request(wire.as_bytes()) {
            Ok(Some(head)) => Req::Ok(head.framing),
            Ok(None) => panic!("{name}: the head was not complete"),
            Err(e) => Req::Refused(e.status().as_u16()),
        };
        if got != expected {
            wrong.push(format!("{name}: expected {expected:?}, got {got:?}"));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} rows wrong:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
}

/// Heads that exceed the limits: 431.
#[test]
fn oversized_request_heads_are_refused_with_431() {
    let mut many = String::from("GET / HTTP/1.1\r\nHost: a\r\n");
    for i in 0..200 {
        many.push_str(&format!("x-{i}: {i}\r\n"));
    }
    many.push_str("\r\n");
    let long = format!(
        "GET / HTTP/1.1\r\nHost: a\r\nx: {}\r\n\r\n",
        "a".repeat(h1::MAX_HEAD)
    );
    for (name, wire) in [("200 fields", many), ("a head over the limit", long)] {
        let status = parse_request(wire.as_bytes())
            .map(|_| ())
            .unwrap_err()
            .status();
        assert_eq!(status, 431, "{name}");
    }
}

/// What parsing a backend's response head must give: its framing, or an error (502).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Resp {
    Ok(Framing),
    Error,
}

/// Response heads; `true` when the request was `HEAD`.
const RESPONSES: &[(&str, &str, bool, Resp)] = &[
    (
        "content-length",
        "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n",
        false,
        Resp::Ok(Framing::Length(5)),
    ),
    (
        "no length: until the close",
        "HTTP/1.1 200 OK\r\n\r\n",
        false,
        Resp::Ok(Framing::UntilClose),
    ),
    (
        "HTTP/1.0 without a length",
        "HTTP/1.0 200 OK\r\n\r\n",
        false,
        Resp::Ok(Framing::UntilClose),
    ),
    (
        "chunked",
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
        false,
        Resp::Ok(Framing::Chunked),
    ),
    (
        "chunked overrides a length",
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n",
        false,
        Resp::Ok(Framing::Chunked),
    ),
    (
        "204 has no body",
        "HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n",
        false,
        Resp::Ok(Framing::Empty),
    ),
    (
        "304 has no body",
        "HTTP/1.1 304 Not Modified\r\nContent-Length: 5\r\n\r\n",
        false,
        Resp::Ok(Framing::Empty),
    ),
    (
        "1xx has no body",
        "HTTP/1.1 103 Early Hints\r\n\r\n",
        false,
        Resp::Ok(Framing::Empty),
    ),
    (
        "a HEAD response has no body",
        "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n",
        true,
        Resp::Ok(Framing::Empty),
    ),
    (
        "chunked in HTTP/1.0",
        "HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
        false,
        Resp::Error,
    ),
    (
        "gzip under chunked",
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
        false,
        Resp::Error,
    ),
    (
        "gzip alone",
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
        false,
        Resp::Error,
    ),
    (
        "chunked twice",
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, chunked\r\n\r\n",
        false,
        Resp::Error,
    ),
    (
        "differing lengths",
        "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
        false,
        Resp::Error,
    ),
    (
        "a length that is not a number",
        "HTTP/1.1 200 OK\r\nContent-Length: five\r\n\r\n",
        false,
        Resp::Error,
    ),
    (
        "a two-digit status",
        "HTTP/1.1 20 OK\r\n\r\n",
        false,
        Resp::Error,
    ),
    (
        "obs-fold",
        "HTTP/1.1 200 OK\r\nX-A: b\r\n c\r\n\r\n",
        false,
        Resp::Error,
    ),
    (
        "a space before the colon",
        "HTTP/1.1 200 OK\r\nX-A : b\r\n\r\n",
        false,
        Resp::Error,
    ),
    (
        "no reason phrase",
        "HTTP/1.1 200 \r\nContent-Length: 0\r\n\r\n",
        false,
        Resp::Ok(Framing::Empty),
    ),
];

#[test]
fn response_heads_follow_the_table() {
    let mut wrong = Vec::new();
    for &(name, wire, head_request, expected) in RESPONSES {
        let got = match h1::parse_response(&mut BytesMut::from(wire.as_bytes()), head_request) {
            Ok(Some(head)) => Resp::Ok(head.framing),
            Ok(None) => panic!("{name}: the head was not complete"),
            Err(_) => Resp::Error,
        };
        if got != expected {
            wrong.push(format!("{name}: expected {expected:?}, got {got:?}"));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} rows wrong:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
}
