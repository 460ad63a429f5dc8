//! The HTTP/1 codec against a table of RFC 9112 / RFC 9110 cases, one named row each: request
//! heads, response heads and chunked bodies, through `h1::parse_request`, `h1::parse_response`
//! and `h1::BodyDecoder` directly.
//!
//! Invariant: every row gives its expected outcome, which is the RFC's where the RFC says MUST,
//! and the stricter reading where a second parser downstream could read the bytes differently.
//! The rows cover the rules the codec enforces itself and those it takes from httparse, so a
//! change of either shows here. Chunked bodies must have CRLF exactly where RFC 9112 §7.1
//! puts it (after the chunk-size line, the chunk data, each trailer line and the trailer
//! section), chunk extensions must follow the grammar, and a body's extensions and trailers
//! are each bounded in all (16 KiB, as hyper bounds them), however they are split into chunks
//! and lines.

use crate::http1::{self as h1, BodyDecoder, Decoded, Framing, H1Error};
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

/// What decoding a whole chunked body must give: its data, or an error (400 for a request,
/// 502 for a response).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Body {
    Ok(&'static str),
    Bad,
}

/// Decodes `wire` as one chunked body, given whole and then the end of the stream; the bytes
/// after the body stay in the buffer and must be `rest`.
fn decode_chunked(wire: &[u8]) -> (Result<Vec<u8>, H1Error>, BytesMut) {
    let mut decoder = BodyDecoder::new(Framing::Chunked);
    let mut buf = BytesMut::from(wire);
    let mut data = Vec::new();
    loop {
        match decoder.decode(&mut buf, true) {
            Ok(Decoded::Data(d)) => data.extend_from_slice(&d),
            Ok(Decoded::Done) => return (Ok(data), buf),
            Ok(Decoded::NeedMore) => unreachable!("at the end of the stream"),
            Err(e) => return (Err(e), buf),
        }
    }
}

/// Chunked bodies (RFC 9112 §7.1), with the facts hyper's and pingora's decoders are tested
/// for where they agree with the RFC; where hyper is more lenient than the grammar (it takes
/// any bytes up to CR as extensions) the row says so and follows the grammar.
const CHUNKED: &[(&str, &str, Body)] = &[
    ("one chunk", "5\r\nhello\r\n0\r\n\r\n", Body::Ok("hello")),
    (
        "several chunks",
        "1\r\na\r\n2\r\nbc\r\n0\r\n\r\n",
        Body::Ok("abc"),
    ),
    ("no chunk before the last", "0\r\n\r\n", Body::Ok("")),
    (
        "a size in upper and lower case hex",
        "A\r\n0123456789\r\nf\r\n0123456789abcde\r\n0\r\n\r\n",
        Body::Ok("01234567890123456789abcde"),
    ),
    (
        "a size with leading zeros",
        "0005\r\nhello\r\n00\r\n\r\n",
        Body::Ok("hello"),
    ),
    (
        "a size of 15 hex digits",
        "00000000000000a\r\n0123456789\r\n0\r\n\r\n",
        Body::Ok("0123456789"),
    ),
    (
        "an extension",
        "5;a=b\r\nhello\r\n0\r\n\r\n",
        Body::Ok("hello"),
    ),
    (
        "an extension without a value",
        "5;a\r\nhello\r\n0;aaaa\r\n\r\n",
        Body::Ok("hello"),
    ),
    (
        "several extensions",
        "5;a;b=c;d=\"e f\"\r\nhello\r\n0\r\n\r\n",
        Body::Ok("hello"),
    ),
    (
        "a quoted extension value with an escape",
        "5;a=\"b\\\"c\"\r\nhello\r\n0\r\n\r\n",
        Body::Ok("hello"),
    ),
    (
        "whitespace around the extension's parts",
        "5 ; a = b \r\nhello\r\n0\r\n\r\n",
        Body::Ok("hello"),
    ),
    (
        "whitespace after the size",
        "5  \r\nhello\r\n0\t\r\n\r\n",
        Body::Ok("hello"),
    ),
    (
        "trailers",
        "1\r\na\r\n0\r\nX-A: b\r\nx-b:\r\n\r\n",
        Body::Ok("a"),
    ),
    (
        "a trailer value with obs-text and a tab",
        "0\r\nX-A: caf\u{e9}\tb\r\n\r\n",
        Body::Ok(""),
    ),
    // CRLF where §7.1 puts it
    (
        "a bare LF after the size",
        "5\nhello\r\n0\r\n\r\n",
        Body::Bad,
    ),
    (
        "a bare CR after the size",
        "5\rhello\r\n0\r\n\r\n",
        Body::Bad,
    ),
    (
        "CR CR LF after the size",
        "5\r\r\nhello\r\n0\r\n\r\n",
        Body::Bad,
    ),
    ("LF CR after the size", "5\n\rhello\r\n0\r\n\r\n", Body::Bad),
    (
        "a bare LF after the data",
        "5\r\nhello\n0\r\n\r\n",
        Body::Bad,
    ),
    (
        "a bare CR after the data",
        "5\r\nhello\r0\r\n\r\n",
        Body::Bad,
    ),
    ("no CRLF after the data", "5\r\nhello0\r\n\r\n", Body::Bad),
    (
        "data longer than its size",
        "3\r\nhello\r\n0\r\n\r\n",
        Body::Bad,
    ),
    (
        "data shorter than its size",
        "7\r\nhello\r\n0\r\n\r\n",
        Body::Bad,
    ),
    ("a bare LF after the last chunk", "0\n\r\n", Body::Bad),
    ("a bare LF ending the body", "0\r\n\n", Body::Bad),
    ("a bare LF after a trailer", "0\r\nX-A: b\n\r\n", Body::Bad),
    (
        "a CR inside a trailer line",
        "0\r\nbad\r\r\n\r\n",
        Body::Bad,
    ),
    (
        "a bare LF inside an extension",
        "1;reject\nnewlines\r\na\r\n0\r\n\r\n",
        Body::Bad,
    ),
    // The chunk size
    ("a size that is not hex", "X\r\n", Body::Bad),
    (
        "a digit then a letter past f",
        "1X\r\na\r\n0\r\n\r\n",
        Body::Bad,
    ),
    ("an empty size", "\r\nhello\r\n0\r\n\r\n", Body::Bad),
    ("a negative size", "-1\r\na\r\n0\r\n\r\n", Body::Bad),
    (
        "a size with a plus sign",
        "+5\r\nhello\r\n0\r\n\r\n",
        Body::Bad,
    ),
    ("a size with 0x", "0x5\r\nhello\r\n0\r\n\r\n", Body::Bad),
    (
        "whitespace before the size",
        " 5\r\nhello\r\n0\r\n\r\n",
        Body::Bad,
    ),
    (
        "a second number after whitespace",
        "1 A\r\na\r\n0\r\n\r\n",
        Body::Bad,
    ),
    (
        "a size of 16 hex digits",
        "000000000000000a\r\n0123456789\r\n0\r\n\r\n",
        Body::Bad,
    ),
    (
        "a size over 64 bits",
        "f0000000000000003\r\nabc\r\n0\r\n\r\n",
        Body::Bad,
    ),
    // Extensions (§7.1.1): hyper accepts the first two, the grammar does not.
    (
        "an extension with an empty name",
        "1;;;  ;\r\na\r\n0\r\n\r\n",
        Body::Bad,
    ),
    (
        "an extension name with a space in it",
        "a;ext name=value\r\n0123456789\r\n0\r\n\r\n",
        Body::Bad,
    ),
    (
        "an extension name ending in dots",
        "2; extension...\r\nab\r\n0\r\n\r\n",
        Body::Ok("ab"),
    ),
    (
        "an extension without its semicolon",
        "1 invalid extension\r\na\r\n0\r\n\r\n",
        Body::Bad,
    ),
    (
        "an extension with an empty value",
        "5;a=\r\nhello\r\n0\r\n\r\n",
        Body::Bad,
    ),
    (
        "an unclosed quoted value",
        "5;a=\"b\r\nhello\r\n0\r\n\r\n",
        Body::Bad,
    ),
    (
        "a NUL in an extension",
        "5;a\0\r\nhello\r\n0\r\n\r\n",
        Body::Bad,
    ),
    // Trailers (§7.1.2)
    ("a trailer without a colon", "0\r\nX-A\r\n\r\n", Body::Bad),
    (
        "an obs-folded trailer",
        "0\r\nX-A: b\r\n c\r\n\r\n",
        Body::Bad,
    ),
    (
        "a trailer name with a space",
        "0\r\nX A: b\r\n\r\n",
        Body::Bad,
    ),
    (
        "a trailer with an empty name",
        "0\r\n: b\r\n\r\n",
        Body::Bad,
    ),
    (
        "a NUL in a trailer value",
        "0\r\nX-A: b\0c\r\n\r\n",
        Body::Bad,
    ),
    // The end of the stream
    ("the stream ends inside the data", "9\r\nfoo bar", Body::Bad),
    ("the stream ends after a chunk", "1\r\na\r\n", Body::Bad),
    ("the stream ends within a CRLF", "1\r", Body::Bad),
    (
        "the stream ends before the final CRLF",
        "10\r\n1234567890abcdef\r\n0\r\n",
        Body::Bad,
    ),
    (
        "the stream ends inside the trailers",
        "0\r\nX-A: b\r\n",
        Body::Bad,
    ),
];

#[test]
fn chunked_bodies_follow_the_table() {
    let mut wrong = Vec::new();
    for &(name, wire, expected) in CHUNKED {
        let (got, rest) = decode_chunked(wire.as_bytes());
        let got = match got {
            Ok(data) => {
                assert!(rest.is_empty(), "{name}: left {rest:?}");
                Body::Ok(String::from_utf8(data).unwrap().leak())
            }
            Err(e) => {
                assert_eq!(e.status(), 400, "{name}: {e}");
                Body::Bad
            }
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

/// The bytes after a body are the next message's: they stay in the buffer, whole.
#[test]
fn what_follows_a_chunked_body_stays_in_the_buffer() {
    let (got, rest) = decode_chunked(b"1\r\na\r\n0\r\nX-A: b\r\n\r\nGET / HTTP/1.1\r\n");
    assert_eq!(got.unwrap(), b"a");
    assert_eq!(&rest[..], b"GET / HTTP/1.1\r\n");
}

/// A body's chunk extensions are bounded in all, not per line: 16 KiB split over many chunks
/// is as much work as one long line (hyper's limit); the same for trailers split over many
/// lines. At the limit a body is still accepted.
#[test]
fn chunk_extensions_and_trailers_are_bounded_per_body() {
    let chunks_with = |ext_len: usize, chunks: usize| {
        let ext = format!(";{}", "e".repeat(ext_len - 1));
        let mut wire = String::new();
        for _ in 0..chunks {
            wire.push_str(&format!("1{ext}\r\na\r\n"));
        }
        wire.push_str("0\r\n\r\n");
        wire
    };
    // 16 chunks of 1 KiB extensions: the limit exactly.
    let at_limit = chunks_with(1024, 16);
    assert_eq!(decode_chunked(at_limit.as_bytes()).0.unwrap().len(), 16);
    let over = chunks_with(1024, 17);
    let e = decode_chunked(over.as_bytes()).0.unwrap_err();
    assert!(e.to_string().contains("extensions"), "{e}");
    assert_eq!(e.status(), 400);
    // One line can never be longer than 4 KiB, extensions or not (pingora refuses 8 KiB).
    let long = format!("0;{}\r\n\r\n", "a".repeat(8 * 1024));
    assert!(decode_chunked(long.as_bytes()).0.is_err());

    let trailers_of = |lines: usize, line_len: usize| {
        let value = "v".repeat(line_len - "x-nnnn: ".len() - 2);
        let mut wire = String::from("1\r\na\r\n0\r\n");
        for i in 0..lines {
            wire.push_str(&format!("x-{i:04}: {value}\r\n"));
        }
        wire.push_str("\r\n");
        wire
    };
    // 16 KiB with every CRLF and the final one: the limit exactly.
    let at_limit = trailers_of(16, 1024).replacen("v", "", 2);
    assert_eq!(
        at_limit.len() - "1\r\na\r\n0\r\n".len(),
        crate::http1::limits::MAX_TRAILERS
    );
    assert_eq!(decode_chunked(at_limit.as_bytes()).0.unwrap(), b"a");
    let many_small = trailers_of(2048, 16);
    let e = decode_chunked(many_small.as_bytes()).0.unwrap_err();
    assert!(e.to_string().contains("trailers"), "{e}");
    let one_huge = format!("0\r\nx: {}\r\n\r\n", "v".repeat(40 * 1024));
    let e = decode_chunked(one_huge.as_bytes()).0.unwrap_err();
    assert!(e.to_string().contains("trailers"), "{e}");
}

/// The refusal comes as soon as the limit is passed, not at the end of the trailers: a decoder
/// fed trailers without end stops within the limit and a line.
#[test]
fn endless_trailers_are_refused_within_the_limit() {
    let mut decoder = BodyDecoder::new(Framing::Chunked);
    let mut buf = BytesMut::from(&b"1\r\na\r\n0\r\n"[..]);
    assert!(matches!(
        decoder.decode(&mut buf, false),
        Ok(Decoded::Data(_))
    ));
    let mut fed = 0;
    let line = b"x-trailer: 0123456789abcdef0123456789abcdef\r\n";
    let refused = loop {
        buf.extend_from_slice(line);
        fed += line.len();
        match decoder.decode(&mut buf, false) {
            Ok(Decoded::NeedMore) => assert!(fed < 1 << 20, "still reading after {fed} bytes"),
            Ok(other) => panic!("{other:?}"),
            Err(e) => break e,
        }
    };
    assert!(
        fed <= crate::http1::limits::MAX_TRAILERS + line.len(),
        "refused after {fed} bytes"
    );
    assert!(refused.to_string().contains("trailers"), "{refused}");
}
