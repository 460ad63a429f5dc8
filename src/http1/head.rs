//! Request and response heads parsed (httparse) into fields left in the read buffer, with the
//! checks RFC 9112 makes of a head: one valid `Host`, a request-target of a form the method
//! allows, a framing that cannot be read two ways.

use std::mem::MaybeUninit;

use bytes::BytesMut;
use http::{Method, StatusCode, Uri, Version};

use super::fields::{self, Fields, Span, WireFields};
use super::framing::{request_framing, response_framing, Framing, Seen};
use super::limits::{MAX_HEAD, MAX_HEADERS};
use super::H1Error;

/// A parsed request head.
#[derive(Debug)]
pub(crate) struct RequestHead {
    /// Method.
    pub method: Method,
    /// Request target as sent (origin form, normally).
    pub uri: Uri,
    /// HTTP/1.0 or HTTP/1.1.
    pub version: Version,
    /// Header fields, as spans of the head.
    pub(crate) headers: WireFields,
    /// How the body is delimited.
    pub framing: Framing,
    /// Whether the client wants the connection kept open after this exchange.
    pub keep_alive: bool,
}

/// A parsed response head.
#[derive(Debug)]
pub(crate) struct ResponseHead {
    /// Status code.
    pub status: StatusCode,
    /// Header fields, as spans of the head.
    pub(crate) headers: WireFields,
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
pub(crate) fn parse_request(buf: &mut BytesMut) -> Result<Option<RequestHead>, H1Error> {
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
pub(crate) fn parse_response(
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
        headers,
        framing,
        keep_alive,
    }))
}

/// Whether the `Connection` header lists `token` (case-insensitively).
fn connection_has(headers: &impl Fields, token: &str) -> bool {
    headers
        .values_of("connection")
        .flat_map(|v| v.split(|&b| b == b','))
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token.as_bytes()))
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
}
