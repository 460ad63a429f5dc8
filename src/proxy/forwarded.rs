//! The proxy's own hop in a forwarded request's headers: who the client is
//! ([`ClientConn`], formatted once per connection), and `X-Forwarded-For`, `-Proto`, `-Host`
//! and `Forwarded` (RFC 7239), each continuing what earlier hops wrote. Kept apart from the
//! trip upstream because it is where client-controlled values cross into headers a backend
//! trusts: every such value is checked or quoted here, and tested here.

use std::net::SocketAddr;

use http::header::{self, HeaderName, HeaderValue};
use http::Uri;

use super::fields::OutboundFields;
use crate::http1::fields::{is_tchar, is_valid_host, put_quoted, quoted_len, same_name, text};
use crate::http1::{Fields, WireFields};

// Names built once: inserting by `&str` parses the name on every request.
const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// What every request of one client connection shares: who the client is, as the forwarded
/// headers say it (formatted once per connection), and which worker serves it.
pub(crate) struct ClientConn {
    /// The client's IP address, as `X-Forwarded-For` lists it.
    ip: HeaderValue,
    /// The `for=` element of `Forwarded` (IPv6 quoted and bracketed).
    forwarded_for: String,
    /// Whether the client connected with TLS.
    tls: bool,
    /// The forwarding worker (and so the upstream pool) serving the connection.
    pub(crate) worker: usize,
}

impl ClientConn {
    /// The shared view of a connection from `peer`.
    pub(crate) fn new(peer: SocketAddr, tls: bool, worker: usize) -> Self {
        let ip = peer.ip();
        Self {
            // An IP address is always a valid header value.
            ip: HeaderValue::from_str(&ip.to_string())
                .unwrap_or(HeaderValue::from_static("unknown")),
            forwarded_for: if ip.is_ipv6() {
                format!("for=\"[{ip}]\"")
            } else {
                format!("for={ip}")
            },
            tls,
            worker,
        }
    }
}

/// Fields of a request the proxy sets from elsewhere: `Host` from the backend URL,
/// `Content-Length` from the body sent, and `Expect`, which the proxy answered itself.
const REQUEST_REPLACED: &[&str] = &["host", "content-length", "expect"];

/// Client headers minus hop-by-hop ones, plus `X-Forwarded-*` and `Forwarded`.
pub(crate) fn forward_headers(h: WireFields, uri: &Uri, client: &ClientConn) -> OutboundFields {
    let added = proxy_fields(&h, uri, client);
    OutboundFields::new(h, REQUEST_REPLACED, added)
}

/// `X-Forwarded-For`, `-Proto` and `-Host` and `Forwarded`, each continuing what `h` says.
/// Every line of an earlier `X-Forwarded-For` or `Forwarded` is continued, in order; a chain
/// with a line that cannot be continued safely (not text; for `Forwarded`, not a well-formed
/// list) is replaced by this hop's element alone. The host is the target's authority (an
/// absolute-form target, HTTP/2's `:authority`), else `Host` (RFC 9112 §3.2.2), and is written
/// only when it is a valid host: quoted in `Forwarded`, and in `X-Forwarded-Host` only without a
/// comma, which there would read as a second hop.
fn proxy_fields(h: &WireFields, uri: &Uri, client: &ClientConn) -> Vec<(HeaderName, HeaderValue)> {
    // One pass over the names finds every field read below.
    let (mut xff, mut forwarded_prev, mut xfh, mut host) = (false, false, false, None);
    for (name, value) in h.pairs() {
        let is = |known: &str| same_name(name, known.as_bytes());
        match name.len() {
            4 if is("host") => host = host.or(Some(value)),
            9 if is("forwarded") => forwarded_prev = true,
            15 if is("x-forwarded-for") => xff = true,
            16 if is("x-forwarded-host") => xfh = true,
            _ => {}
        }
    }
    let host = match uri.authority() {
        Some(authority) => Some(authority.as_str().as_bytes()),
        None => host,
    }
    .filter(|host| is_valid_host(host));
    let proto = if client.tls { "https" } else { "http" };
    let mut added = Vec::with_capacity(4);
    let xff = if xff {
        let mut list = bytes::BytesMut::with_capacity(64);
        put_earlier_hops(&mut list, h.values_of("x-forwarded-for"), |line| {
            text(line).is_some()
        });
        list.extend_from_slice(client.ip.as_bytes());
        HeaderValue::from_maybe_shared(list.freeze()).ok()
    } else {
        Some(client.ip.clone())
    };
    if let Some(v) = xff {
        added.push((X_FORWARDED_FOR, v));
    }
    added.push((X_FORWARDED_PROTO, HeaderValue::from_static(proto)));
    // Built where the header value will live: one allocation.
    let mut forwarded = bytes::BytesMut::with_capacity(96);
    if forwarded_prev {
        put_earlier_hops(&mut forwarded, h.values_of("forwarded"), is_forwarded_list);
    }
    forwarded.extend_from_slice(client.forwarded_for.as_bytes());
    forwarded.extend_from_slice(b";proto=");
    forwarded.extend_from_slice(proto.as_bytes());
    if let Some(host) = host {
        forwarded.extend_from_slice(b";host=");
        put_quoted(&mut forwarded, host);
        if !xfh && !host.contains(&b',') {
            if let Ok(v) = HeaderValue::from_bytes(host) {
                added.push((X_FORWARDED_HOST, v));
            }
        }
    }
    if let Ok(v) = HeaderValue::from_maybe_shared(forwarded.freeze()) {
        added.push((header::FORWARDED, v));
    }
    added
}

/// Appends the lines of a list field an earlier hop wrote, in order, each followed by `, ` so
/// that this hop's element comes next; appends nothing if any line is not `valid`.
fn put_earlier_hops<'a>(
    out: &mut bytes::BytesMut,
    lines: impl Iterator<Item = &'a [u8]>,
    valid: impl Fn(&[u8]) -> bool,
) {
    let start = out.len();
    for line in lines {
        let line = line.trim_ascii();
        if line.is_empty() {
            continue;
        }
        if !valid(line) {
            out.truncate(start);
            return;
        }
        out.extend_from_slice(line);
        out.extend_from_slice(b", ");
    }
}

/// Whether `value` is a well-formed `Forwarded` list (RFC 7239 §4): elements split by commas,
/// each of `;`-separated `token=value` pairs, the value a token or a quoted-string that is
/// closed. Only such a list can be continued by appending an element after a comma: an open
/// quote would swallow what the proxy appends. Whitespace is allowed around `,` and `;`.
pub(crate) fn is_forwarded_list(value: &[u8]) -> bool {
    let mut i = 0;
    let skip_ws = |i: &mut usize| {
        while value.get(*i).is_some_and(|&b| b == b' ' || b == b'\t') {
            *i += 1;
        }
    };
    loop {
        skip_ws(&mut i);
        match value.get(i) {
            None => return true,
            Some(b',' | b';') => {
                i += 1;
                continue;
            }
            Some(_) => {}
        }
        let name = i;
        while value.get(i).is_some_and(|&b| is_tchar(b)) {
            i += 1;
        }
        if i == name || value.get(i) != Some(&b'=') {
            return false;
        }
        i += 1;
        match quoted_len(&value[i..]) {
            Some(len) => i += len,
            None => {
                let start = i;
                while value.get(i).is_some_and(|&b| is_tchar(b)) {
                    i += 1;
                }
                if i == start {
                    return false;
                }
            }
        }
        skip_ws(&mut i);
        if !matches!(value.get(i), None | Some(b',' | b';')) {
            return false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderMap;

    #[test]
    fn forwarded_headers_append_the_peer() {
        let mut h = HeaderMap::new();
        h.insert("host", "proxy.local".parse().unwrap());
        h.insert("x-forwarded-for", "10.0.0.1".parse().unwrap());
        let out = forward_headers(
            WireFields::from_map(&h),
            &Uri::from_static("/"),
            &ClientConn::new("192.0.2.7:5000".parse().unwrap(), false, 0),
        )
        .to_map();
        assert_eq!(out["x-forwarded-for"], "10.0.0.1, 192.0.2.7");
        assert_eq!(
            out["forwarded"],
            "for=192.0.2.7;proto=http;host=\"proxy.local\""
        );
        assert_eq!(out["x-forwarded-host"], "proxy.local");
        assert!(!out.contains_key("host"));
    }

    #[test]
    fn forwarded_headers_keep_earlier_hops_and_drop_what_the_proxy_redoes() {
        let mut h = HeaderMap::new();
        h.insert("host", "proxy.local".parse().unwrap());
        h.insert("forwarded", "for=10.0.0.1".parse().unwrap());
        h.insert("x-forwarded-host", "origin.example".parse().unwrap());
        h.insert("expect", "100-continue".parse().unwrap());
        h.insert("content-length", "2".parse().unwrap());
        h.insert("te", "trailers".parse().unwrap());
        h.insert("x-session-id", "s1".parse().unwrap());
        let out = forward_headers(
            WireFields::from_map(&h),
            &Uri::from_static("/"),
            &ClientConn::new("[2001:db8::1]:5000".parse().unwrap(), true, 0),
        )
        .to_map();
        assert_eq!(
            out["forwarded"],
            "for=10.0.0.1, for=\"[2001:db8::1]\";proto=https;host=\"proxy.local\""
        );
        assert_eq!(out["x-forwarded-host"], "origin.example");
        assert_eq!(out["x-forwarded-for"], "2001:db8::1");
        assert_eq!(out["x-forwarded-proto"], "https");
        for gone in ["expect", "content-length", "te", "host"] {
            assert!(!out.contains_key(gone), "{gone} was forwarded: {out:?}");
        }
        assert_eq!(out["x-session-id"], "s1");
    }

    #[test]
    fn forwarded_wire_fields_drop_hop_by_hop_names_in_any_case_and_keep_the_rest_as_sent() {
        let mut raw = bytes::BytesMut::from(
            &b"POST /v1/chat/completions HTTP/1.1\r\nHOST: proxy.local\r\n\
               Connection: Keep-Alive, X-Private\r\nX-PRIVATE: 1\r\nKeep-Alive: timeout=5\r\n\
               Expect: 100-continue\r\nContent-Length: 0\r\nX-Forwarded-For: 10.0.0.1\r\n\
               X-Session-Id: s1\r\n\r\n"[..],
        );
        let head = crate::http1::parse_request(&mut raw).unwrap().unwrap();
        let out = forward_headers(
            head.headers,
            &Uri::from_static("/"),
            &ClientConn::new("192.0.2.7:5000".parse().unwrap(), false, 0),
        );
        let names: Vec<&[u8]> = out.pairs().map(|(name, _)| name).collect();
        assert_eq!(
            names,
            [
                &b"X-Session-Id"[..],
                b"x-forwarded-for",
                b"x-forwarded-proto",
                b"x-forwarded-host",
                b"forwarded"
            ]
        );
        let map = out.to_map();
        assert_eq!(map["x-forwarded-for"], "10.0.0.1, 192.0.2.7");
        assert_eq!(map["x-forwarded-host"], "proxy.local");
        assert_eq!(
            map["forwarded"],
            "for=192.0.2.7;proto=http;host=\"proxy.local\""
        );
    }

    fn forwarded_for(pairs: &[(&str, &str)], uri: &'static str) -> HeaderMap {
        let fields =
            WireFields::from_pairs(pairs.iter().map(|(n, v)| (n.as_bytes(), v.as_bytes())));
        forward_headers(
            fields,
            &Uri::from_static(uri),
            &ClientConn::new("192.0.2.7:5000".parse().unwrap(), false, 0),
        )
        .to_map()
    }

    /// Nothing a client sends can add an element to `Forwarded` or a host to
    /// `X-Forwarded-Host`: a host that is not one is left out, and the host is quoted.
    #[test]
    fn client_values_cannot_inject_forwarded_elements() {
        // As HTTP/2 could hand it over, had the head not been refused.
        let out = forwarded_for(&[("host", "a\";for=6.6.6.6;x=\"")], "/");
        assert_eq!(out["forwarded"], "for=192.0.2.7;proto=http");
        assert!(!out.contains_key("x-forwarded-host"), "{out:?}");
        // Sub-delimiters are valid in a host, and stay inside the quotes.
        let out = forwarded_for(&[("host", "a;for=6.6.6.6,b")], "/");
        assert_eq!(
            out["forwarded"],
            "for=192.0.2.7;proto=http;host=\"a;for=6.6.6.6,b\""
        );
        assert!(
            !out.contains_key("x-forwarded-host"),
            "a comma would read as a second hop: {out:?}"
        );
        // An earlier Forwarded with an open quote would swallow this hop's element.
        let out = forwarded_for(&[("host", "p"), ("forwarded", "for=6.6.6.6;x=\"")], "/");
        assert_eq!(out["forwarded"], "for=192.0.2.7;proto=http;host=\"p\"");
    }

    /// Every line of an earlier hop's list is continued, in order.
    #[test]
    fn several_forwarding_lines_are_combined() {
        let out = forwarded_for(
            &[
                ("host", "p"),
                ("x-forwarded-for", "10.0.0.1"),
                ("forwarded", "for=10.0.0.1"),
                ("X-Forwarded-For", "10.0.0.2, 10.0.0.3"),
                ("Forwarded", "for=10.0.0.2;proto=https"),
            ],
            "/",
        );
        assert_eq!(
            out["x-forwarded-for"],
            "10.0.0.1, 10.0.0.2, 10.0.0.3, 192.0.2.7"
        );
        assert_eq!(
            out["forwarded"],
            "for=10.0.0.1, for=10.0.0.2;proto=https, for=192.0.2.7;proto=http;host=\"p\""
        );
        assert_eq!(out.get_all("x-forwarded-for").iter().count(), 1);
        assert_eq!(out.get_all("forwarded").iter().count(), 1);
    }

    /// An absolute-form target (or HTTP/2's `:authority`) names the host, not `Host`.
    #[test]
    fn the_target_authority_governs_over_host() {
        let out = forwarded_for(&[("host", "other.test")], "http://origin.test:8080/v1");
        assert_eq!(out["x-forwarded-host"], "origin.test:8080");
        assert_eq!(
            out["forwarded"],
            "for=192.0.2.7;proto=http;host=\"origin.test:8080\""
        );
    }

    #[test]
    fn only_well_formed_forwarded_lists_can_be_continued() {
        for ok in [
            "for=192.0.2.43",
            "for=192.0.2.43, for=198.51.100.17",
            "for=\"[2001:db8:cafe::17]:4711\";proto=https",
            "for=a;by=b;host=\"x,y\", for=c",
            "for=\"\\\"quoted\\\"\"",
            "for=a ; proto=http",
        ] {
            assert!(is_forwarded_list(ok.as_bytes()), "{ok:?} refused");
        }
        for bad in [
            "for=6.6.6.6;x=\"",
            "for=\"unclosed",
            "for",
            "=a",
            "for= a",
            "for=a b",
            "for=a\"b\"",
            "for=\"a\"b",
        ] {
            assert!(!is_forwarded_list(bad.as_bytes()), "{bad:?} accepted");
        }
    }
}
