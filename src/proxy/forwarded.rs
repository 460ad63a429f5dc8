//! The proxy's own hop in a forwarded request's headers: who the client is
//! ([`ClientConn`], formatted once per connection), and `X-Forwarded-For`, `-Proto`, `-Host`
//! and `Forwarded` (RFC 7239), each continuing what earlier hops wrote. Kept apart from the
//! trip upstream because it is where client-controlled values cross into headers a backend
//! trusts: every such value is checked or quoted here, and tested here. Also `Via`
//! (RFC 9110 §7.6.3), which names this proxy instance so that a request that comes back to it
//! (a backend URL pointing at the proxy, directly or through another proxy) is refused at the
//! first repeat instead of looping until some limit breaks.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use http::header::{self, HeaderName, HeaderValue};
use http::{Uri, Version};

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

/// How long the log stays quiet after a line about a refused loop: a flood of looping requests
/// logs one line per period, with the count of those it did not log.
const LOOP_LOG_PERIOD: Duration = Duration::from_secs(10);

/// Length of a proxy instance's name in `Via`: `agentrace-` and 16 hex digits.
const VIA_NAME_LEN: usize = 26;

/// This proxy instance's entry in `Via`: `agentrace-` and 64 random bits from the operating
/// system, drawn once per instance, so replicas behind one service name pass each other's
/// traffic while a request that comes back to the same instance is recognised by its name.
pub(crate) struct Via {
    name: [u8; VIA_NAME_LEN],
    /// The whole entry per protocol the request was received with, built once.
    http10: HeaderValue,
    http11: HeaderValue,
    http2: HeaderValue,
    /// When the log last spoke of a loop (ms after `created`), and the loops since.
    created: Instant,
    logged_at_ms: AtomicU64,
    unlogged: AtomicU64,
}

/// A request whose `Via` already names this proxy instance: it has looped.
#[derive(Debug)]
pub(crate) struct Looped {
    /// The host it was sent to (the target's authority, else `Host`), for the log.
    pub host: String,
}

impl Via {
    /// A new instance name.
    pub(crate) fn new() -> Self {
        let text = format!("agentrace-{:016x}", crate::random::os_u64());
        let mut name = [0; VIA_NAME_LEN];
        name.copy_from_slice(text.as_bytes());
        let entry = |protocol: &str| {
            HeaderValue::from_str(&format!("{protocol} {text}")).expect("hex is a header value")
        };
        Self {
            name,
            http10: entry("1.0"),
            http11: entry("1.1"),
            http2: entry("2"),
            created: Instant::now(),
            logged_at_ms: AtomicU64::new(u64::MAX),
            unlogged: AtomicU64::new(0),
        }
    }

    /// The entry this proxy adds to a request received as `version`.
    pub(crate) fn entry(&self, version: Version) -> &HeaderValue {
        match version {
            Version::HTTP_10 | Version::HTTP_09 => &self.http10,
            Version::HTTP_2 | Version::HTTP_3 => &self.http2,
            _ => &self.http11,
        }
    }

    /// The instance name, as `Via` carries it.
    pub(crate) fn name(&self) -> &str {
        std::str::from_utf8(&self.name).unwrap_or("agentrace")
    }

    /// Whether a `Via` line names this instance.
    fn names_me(&self, line: &[u8]) -> bool {
        line.windows(VIA_NAME_LEN).any(|w| w == self.name)
    }

    /// Logs a refused loop: the first at once, then at most one line per [`LOOP_LOG_PERIOD`],
    /// which counts the loops refused since the last line.
    pub(crate) fn log_loop(&self, host: &str) {
        let now = self.created.elapsed().as_millis() as u64;
        let last = self.logged_at_ms.load(Ordering::Relaxed);
        let due = last == u64::MAX || now >= last + LOOP_LOG_PERIOD.as_millis() as u64;
        if !due
            || self
                .logged_at_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            self.unlogged.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let unlogged = self.unlogged.swap(0, Ordering::Relaxed);
        tracing::warn!(
            via = self.name(),
            host,
            unlogged_since_last = unlogged,
            "request refused with 508 Loop Detected: it came back to this proxy (its Via names this \
             instance); a backend URL points at this proxy, directly or through another proxy"
        );
    }
}

/// Fields of a request the proxy sets from elsewhere: `Host` from the backend URL,
/// `Content-Length` from the body sent, and `Expect`, which the proxy answered itself.
const REQUEST_REPLACED: &[&str] = &["host", "content-length", "expect"];

/// This hop as `Via` records it: the proxy instance and the protocol the request came in.
pub(crate) struct Hop<'a> {
    /// The proxy instance.
    pub via: &'a Via,
    /// The protocol version the client used.
    pub version: Version,
}

/// Client headers minus hop-by-hop ones, plus `X-Forwarded-*`, `Forwarded` and `Via`; or
/// [`Looped`] if `Via` shows the request passed this proxy instance before.
pub(crate) fn forward_headers(
    h: WireFields,
    uri: &Uri,
    client: &ClientConn,
    hop: Hop<'_>,
) -> Result<OutboundFields, Looped> {
    let added = proxy_fields(&h, uri, client, hop)?;
    Ok(OutboundFields::new(h, REQUEST_REPLACED, added))
}

/// `X-Forwarded-For`, `-Proto` and `-Host` and `Forwarded`, each continuing what `h` says.
/// Every line of an earlier `X-Forwarded-For` or `Forwarded` is continued, in order; a chain
/// with a line that cannot be continued safely (not text; for `Forwarded`, not a well-formed
/// list) is replaced by this hop's element alone. The host is the target's authority (an
/// absolute-form target, HTTP/2's `:authority`), else `Host` (RFC 9112 §3.2.2), and is written
/// only when it is a valid host: quoted in `Forwarded`, and in `X-Forwarded-Host` only without a
/// comma, which there would read as a second hop.
///
/// `Via` is continued the same way, with this hop's entry last; a request whose `Via` already
/// names this instance is [`Looped`]. The check reads `Via` only when the request has one.
fn proxy_fields(
    h: &WireFields,
    uri: &Uri,
    client: &ClientConn,
    hop: Hop<'_>,
) -> Result<Vec<(HeaderName, HeaderValue)>, Looped> {
    // One pass over the names finds every field read below.
    let (mut xff, mut forwarded_prev, mut xfh, mut host) = (false, false, false, None);
    let (mut via_prev, mut looped) = (false, false);
    for (name, value) in h.pairs() {
        let is = |known: &str| same_name(name, known.as_bytes());
        match name.len() {
            3 if is("via") => {
                looped |= hop.via.names_me(value);
                via_prev = true;
            }
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
    if looped {
        let host = String::from_utf8_lossy(host.unwrap_or_default()).into_owned();
        return Err(Looped { host });
    }
    let proto = if client.tls { "https" } else { "http" };
    let mut added = Vec::with_capacity(5);
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
    let entry = hop.via.entry(hop.version);
    let via = if via_prev {
        let mut list = bytes::BytesMut::with_capacity(64);
        put_earlier_hops(&mut list, h.values_of("via"), |line| text(line).is_some());
        list.extend_from_slice(entry.as_bytes());
        HeaderValue::from_maybe_shared(list.freeze()).unwrap_or_else(|_| entry.clone())
    } else {
        entry.clone()
    };
    added.push((header::VIA, via));
    Ok(added)
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

    /// The fields forwarded for a request received over HTTP/1.1 by a new instance.
    fn fwd(h: WireFields, uri: &Uri, client: &ClientConn) -> OutboundFields {
        let via = Via::new();
        let hop = Hop {
            via: &via,
            version: Version::HTTP_11,
        };
        forward_headers(h, uri, client, hop).expect("no loop")
    }

    #[test]
    fn forwarded_headers_append_the_peer() {
        let mut h = HeaderMap::new();
        h.insert("host", "proxy.local".parse().unwrap());
        h.insert("x-forwarded-for", "10.0.0.1".parse().unwrap());
        let out = fwd(
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
        let out = fwd(
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
        let out = fwd(
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
                b"forwarded",
                b"via"
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
        fwd(
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

    /// `Via` is continued with this instance's entry, naming the protocol the request came
    /// in; a request whose `Via` names the instance anywhere is a loop.
    #[test]
    fn via_continues_earlier_hops_and_a_request_naming_this_instance_has_looped() {
        let via = Via::new();
        let client = ClientConn::new("192.0.2.7:5000".parse().unwrap(), false, 0);
        let hop = |version| Hop { via: &via, version };
        let fields = |pairs: &[(&str, &str)]| {
            WireFields::from_pairs(pairs.iter().map(|(n, v)| (n.as_bytes(), v.as_bytes())))
        };
        let uri = Uri::from_static("/");
        let out = forward_headers(
            fields(&[("host", "p")]),
            &uri,
            &client,
            hop(Version::HTTP_2),
        )
        .unwrap()
        .to_map();
        assert_eq!(out["via"], format!("2 {}", via.name()));
        let out = forward_headers(
            fields(&[("via", "1.0 fred, 1.1 p.example"), ("Via", "2 other")]),
            &uri,
            &client,
            hop(Version::HTTP_11),
        )
        .unwrap()
        .to_map();
        assert_eq!(
            out["via"],
            format!("1.0 fred, 1.1 p.example, 2 other, 1.1 {}", via.name())
        );
        assert_eq!(out.get_all("via").iter().count(), 1);
        let mine = format!("1.1 edge, 1.1 {}", via.name());
        let looped = forward_headers(
            fields(&[("host", "p"), ("via", "1.1 a"), ("via", &mine)]),
            &uri,
            &client,
            hop(Version::HTTP_11),
        );
        assert!(looped.is_err(), "a request naming this instance passed");
        // Another instance (a replica behind the same name) passes it on.
        let other = Via::new();
        assert_ne!(other.name(), via.name());
        let passed = forward_headers(
            fields(&[("via", &mine)]),
            &uri,
            &client,
            Hop {
                via: &other,
                version: Version::HTTP_11,
            },
        );
        assert!(passed.is_ok());
    }
}
