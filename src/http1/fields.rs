//! Header fields as the HTTP/1.1 codec holds them: the fields of a head left in the one buffer
//! they were read into (an HTTP/1.1 head as httparse found it; hyper's HTTP/2 maps are copied
//! into the same form), so no map is built for a head that is only looked at and written out
//! again. Names compare case-insensitively and pass on as they were sent. Also the RFC 9110
//! and RFC 3986 grammar the codec and its users check values against (tokens, `Host`,
//! quoted-strings).

use bytes::{Bytes, BytesMut};
use http::header::{HeaderMap, HeaderName, HeaderValue};

/// Read access to a message's header fields, in order.
pub(crate) trait Fields {
    /// Every field in order: its name as sent, its value.
    fn pairs(&self) -> impl Iterator<Item = (&[u8], &[u8])>;

    /// The values of the fields named `name` (lower-case), in order.
    fn values_of<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a;

    /// The first value of `name` (lower-case).
    fn first<'a>(&'a self, name: &'a str) -> Option<&'a [u8]> {
        self.values_of(name).next()
    }

    /// Whether a field named `name` (lower-case) is present.
    fn has(&self, name: &str) -> bool {
        self.first(name).is_some()
    }

    /// The same fields as one map (for HTTP/2, the recorder and tests); a pair that is not a
    /// valid field is left out.
    fn to_map(&self) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in self.pairs() {
            if let (Ok(name), Ok(value)) =
                (HeaderName::from_bytes(name), HeaderValue::from_bytes(value))
            {
                map.append(name, value);
            }
        }
        map
    }
}

/// `x` with the ASCII capitals among its eight bytes made small, all eight at once: a byte
/// whose low seven bits lie in `A..=Z` (and whose high bit is clear) gains 0x20.
fn lower8(x: u64) -> u64 {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let seven = x & !HIGH;
    let from_a = seven + (0x80 - u64::from(b'A')) * ONES;
    let past_z = seven + (0x7f - u64::from(b'Z')) * ONES;
    x | ((from_a & !past_z & !x & HIGH) >> 2)
}

fn word(s: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(s[at..at + 8].try_into().expect("eight bytes"))
}

/// `a.eq_ignore_ascii_case(b)`, eight bytes at a step: every header lookup compares names
/// this way, and the byte-by-byte loop was a tenth of the proxy's own work per request.
pub(crate) fn same_name(a: &[u8], b: &[u8]) -> bool {
    let n = a.len();
    if n != b.len() {
        return false;
    }
    if n < 8 {
        return a.eq_ignore_ascii_case(b);
    }
    // Whole words, then one that ends at the end (overlapping the last whole one).
    (0..n / 8).all(|i| lower8(word(a, i * 8)) == lower8(word(b, i * 8)))
        && lower8(word(a, n - 8)) == lower8(word(b, n - 8))
}

/// Whether `name` is a hop-by-hop field, never forwarded (RFC 9110 §7.6.1).
pub(crate) fn is_hop_by_hop(name: &[u8]) -> bool {
    let is = |known: &str| same_name(name, known.as_bytes());
    match name.len() {
        2 => is("te"),
        7 => is("trailer") || is("upgrade"),
        10 => is("connection") || is("keep-alive"),
        16 => is("proxy-connection"),
        17 => is("transfer-encoding"),
        18 => is("proxy-authenticate"),
        19 => is("proxy-authorization"),
        _ => false,
    }
}

/// `value` as text when it is all visible ASCII (what `HeaderValue::to_str` accepts).
pub(crate) fn text(value: &[u8]) -> Option<&str> {
    value
        .iter()
        .all(|&b| b == b'\t' || (b' '..=b'~').contains(&b))
        .then(|| std::str::from_utf8(value).ok())
        .flatten()
}

/// Whether `b` may appear in a token (RFC 9110 §5.6.2): a field name, a method, a coding.
pub(crate) fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Whether `s` is a token: one or more [`is_tchar`] bytes.
pub(crate) fn is_token(s: &[u8]) -> bool {
    !s.is_empty() && s.iter().all(|&b| is_tchar(b))
}

/// Whether `value` is a `Host` (RFC 9110 §7.2): `uri-host [ ":" port ]`, the host an RFC 3986
/// reg-name, IPv4 address or bracketed IP literal. Two forms the grammar allows are refused,
/// since parsers read them differently: an empty host, and a colon with no port or a port that
/// is not 1 to 5 digits up to 65535.
pub(crate) fn is_valid_host(value: &[u8]) -> bool {
    let (host_ok, port) = if let Some(literal) = value.strip_prefix(b"[") {
        let Some(end) = memchr::memchr(b']', literal) else {
            return false;
        };
        let port = match &literal[end + 1..] {
            [] => None,
            [b':', port @ ..] => Some(port),
            _ => return false,
        };
        (is_ip_literal(&literal[..end]), port)
    } else {
        match memchr::memchr(b':', value) {
            Some(at) => (is_reg_name(&value[..at]), Some(&value[at + 1..])),
            None => (is_reg_name(value), None),
        }
    };
    host_ok
        && port.is_none_or(|p| {
            (1..=5).contains(&p.len())
                && p.iter().all(u8::is_ascii_digit)
                && p.iter().fold(0u32, |n, &d| n * 10 + u32::from(d - b'0')) <= 65535
        })
}

/// `reg-name = *( unreserved / pct-encoded / sub-delims )` (RFC 3986 §3.2.2), not empty. An
/// IPv4 address is one too.
fn is_reg_name(s: &[u8]) -> bool {
    let mut i = 0;
    while i < s.len() {
        match s[i] {
            b'%' if s.len() > i + 2
                && s[i + 1].is_ascii_hexdigit()
                && s[i + 2].is_ascii_hexdigit() =>
            {
                i += 3;
                continue;
            }
            b if is_reg_name_char(b) => {}
            _ => return false,
        }
        i += 1;
    }
    !s.is_empty()
}

/// The bytes of a reg-name other than `%`: unreserved and sub-delims, as a table, since every
/// request's `Host` is checked against it.
const REG_NAME: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        table[b] = c.is_ascii_alphanumeric()
            || matches!(c, b'-' | b'.' | b'_' | b'~')
            || matches!(
                c,
                b'!' | b'$' | b'&' | b'\'' | b'(' | b')' | b'*' | b'+' | b',' | b';' | b'='
            );
        b += 1;
    }
    table
};

/// `unreserved / sub-delims` (RFC 3986 §2.2, §2.3).
fn is_reg_name_char(b: u8) -> bool {
    REG_NAME[usize::from(b)]
}

/// What RFC 3986 allows within brackets: an IPv6 address or `v<hex>.<text>` (IPvFuture).
fn is_ip_literal(s: &[u8]) -> bool {
    if let [b'v' | b'V', rest @ ..] = s {
        let Some(dot) = memchr::memchr(b'.', rest) else {
            return false;
        };
        let (version, text) = (&rest[..dot], &rest[dot + 1..]);
        return !version.is_empty()
            && version.iter().all(u8::is_ascii_hexdigit)
            && !text.is_empty()
            && text.iter().all(|&b| is_reg_name_char(b) || b == b':');
    }
    std::str::from_utf8(s).is_ok_and(|s| s.parse::<std::net::Ipv6Addr>().is_ok())
}

/// Appends `value` as an RFC 9110 quoted-string, `"` and `\` escaped, so that nothing in it can
/// end the string early; `value` is field text (see [`text`]).
pub(crate) fn put_quoted(out: &mut BytesMut, value: &[u8]) {
    out.extend_from_slice(b"\"");
    for part in value.split_inclusive(|&b| b == b'"' || b == b'\\') {
        match part.split_last() {
            Some((&last, head)) if last == b'"' || last == b'\\' => {
                out.extend_from_slice(head);
                out.extend_from_slice(&[b'\\', last]);
            }
            _ => out.extend_from_slice(part),
        }
    }
    out.extend_from_slice(b"\"");
}

/// The length of the quoted-string that `s` starts with (RFC 9110 §5.6.4), quotes included;
/// `None` when `s` does not start with one or it is never closed.
pub(crate) fn quoted_len(s: &[u8]) -> Option<usize> {
    if s.first() != Some(&b'"') {
        return None;
    }
    let mut i = 1;
    while let Some(&b) = s.get(i) {
        match b {
            b'"' => return Some(i + 1),
            b'\\' => match s.get(i + 1) {
                Some(&q) if q == b'\t' || q >= b' ' && q != 0x7f => i += 2,
                _ => return None,
            },
            b'\t' | b' '..=b'~' | 0x80.. => i += 1,
            _ => return None,
        }
    }
    None
}

/// Where a field's name and value lie in its head: offset and length of each.
pub(crate) type Span = (u32, u32, u32, u32);

/// A head's fields as spans of the bytes that hold them. Fields parsed by httparse were
/// checked as they were read: every name is a token and every value valid field content,
/// the same rules `HeaderName` and `HeaderValue` apply, so the bytes go out again as they came.
#[derive(Debug, Clone, Default)]
pub(crate) struct WireFields {
    head: Bytes,
    spans: Vec<Span>,
}

impl WireFields {
    /// Fields at `spans` of `head`.
    pub(crate) fn new(head: Bytes, spans: Vec<Span>) -> Self {
        Self { head, spans }
    }

    /// `pairs` copied into one buffer.
    pub(crate) fn from_pairs<'a>(pairs: impl IntoIterator<Item = (&'a [u8], &'a [u8])>) -> Self {
        let mut head = BytesMut::new();
        let mut spans = Vec::new();
        for (name, value) in pairs {
            let at = head.len() as u32;
            head.extend_from_slice(name);
            head.extend_from_slice(value);
            spans.push((
                at,
                name.len() as u32,
                at + name.len() as u32,
                value.len() as u32,
            ));
        }
        Self::new(head.freeze(), spans)
    }

    /// The fields of a map (hyper's, for HTTP/2).
    pub(crate) fn from_map(map: &HeaderMap) -> Self {
        Self::from_pairs(
            map.iter()
                .map(|(n, v)| (n.as_str().as_bytes(), v.as_bytes())),
        )
    }

    /// The fields of an HTTP/2 request, its `cookie` fields joined into one by `"; "` where
    /// the first was (RFC 9113 §8.2.3): HTTP/2 lets a client split the cookies over several
    /// fields for compression, but an HTTP/1.1 server expects one `Cookie` line.
    pub(crate) fn from_h2_request(map: &HeaderMap) -> Self {
        let mut cookies = map.get_all(http::header::COOKIE).iter();
        if cookies.next().is_none() || cookies.next().is_none() {
            return Self::from_map(map);
        }
        let mut joined = BytesMut::new();
        for value in map.get_all(http::header::COOKIE) {
            if !joined.is_empty() {
                joined.extend_from_slice(b"; ");
            }
            joined.extend_from_slice(value.as_bytes());
        }
        let mut cookie_written = false;
        Self::from_pairs(map.iter().filter_map(|(name, value)| {
            if name != http::header::COOKIE {
                return Some((name.as_str().as_bytes(), value.as_bytes()));
            }
            (!std::mem::replace(&mut cookie_written, true))
                .then_some((name.as_str().as_bytes(), &joined[..]))
        }))
    }

    /// The whole head the fields were read from.
    pub(crate) fn head(&self) -> &Bytes {
        &self.head
    }

    /// Drops the fields named `name` (lower-case).
    pub(crate) fn remove(&mut self, name: &str) {
        let head = &self.head;
        self.spans.retain(|&(n, nl, _, _)| {
            !same_name(&head[n as usize..(n + nl) as usize], name.as_bytes())
        });
    }

    fn part(&self, at: u32, len: u32) -> &[u8] {
        &self.head[at as usize..(at + len) as usize]
    }
}

impl Fields for WireFields {
    fn pairs(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.spans
            .iter()
            .map(|&(n, nl, v, vl)| (self.part(n, nl), self.part(v, vl)))
    }

    /// Fields of another length are passed over without their bytes being read.
    fn values_of<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.spans
            .iter()
            .filter(move |&&(n, nl, _, _)| {
                nl as usize == name.len() && same_name(self.part(n, nl), name.as_bytes())
            })
            .map(|&(_, _, v, vl)| self.part(v, vl))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wire(head: &'static str) -> WireFields {
        let mut spans = Vec::new();
        let mut at = 0;
        for line in head.split_inclusive("\r\n") {
            if let Some((name, value)) = line.trim_end().split_once(": ") {
                let v = at + name.len() + 2;
                spans.push((at as u32, name.len() as u32, v as u32, value.len() as u32));
            }
            at += line.len();
        }
        WireFields::new(Bytes::from_static(head.as_bytes()), spans)
    }

    #[test]
    fn names_compare_as_eq_ignore_ascii_case_does_for_every_byte_anywhere() {
        let base = b"x-session-id-and-more".to_vec();
        for len in [8, 9, 12, 14, 16, 21] {
            for at in 0..len {
                for x in 0..=255u8 {
                    for y in [
                        x,
                        x ^ 0x20,
                        x.wrapping_add(1),
                        b'a',
                        b'A',
                        b'@',
                        b'`',
                        0x80 | x,
                    ] {
                        let (mut a, mut b) = (base[..len].to_vec(), base[..len].to_vec());
                        a[at] = x;
                        b[at] = y;
                        assert_eq!(same_name(&a, &b), a.eq_ignore_ascii_case(&b), "{a:?} {b:?}");
                    }
                }
            }
        }
        assert!(same_name(b"Content-Length", b"content-length"));
        assert!(!same_name(b"Content-Length", b"content-lengti"));
        assert!(!same_name(b"content-length", b"content-lengt"));
        assert!(same_name(b"TE", b"te") && !same_name(b"TE", b"tf"));
    }

    #[test]
    fn wire_fields_and_maps_answer_lookups_alike() {
        let w = wire("Host: a\r\nX-Session-ID: s1\r\nAccept: x\r\naccept: y\r\n");
        let m = w.to_map();
        assert_eq!(m.len(), 4);
        assert_eq!(m["x-session-id"], "s1");
        for name in ["host", "x-session-id", "accept", "missing"] {
            assert_eq!(
                w.values_of(name).collect::<Vec<_>>(),
                m.get_all(name)
                    .iter()
                    .map(HeaderValue::as_bytes)
                    .collect::<Vec<_>>(),
                "{name}"
            );
        }
        assert!(w.has("accept") && !w.has("accep"));
        assert_eq!(w.first("ACCEPT".to_lowercase().as_str()), Some(&b"x"[..]));
        // Names go out as the client wrote them.
        assert_eq!(w.pairs().nth(1), Some((&b"X-Session-ID"[..], &b"s1"[..])));
    }

    #[test]
    fn wire_fields_remove_every_field_of_a_name() {
        let mut w = wire("Content-Length: 1\r\nA: x\r\ncontent-length: 1\r\n");
        w.remove("content-length");
        assert_eq!(w.pairs().collect::<Vec<_>>(), [(&b"A"[..], &b"x"[..])]);
    }

    #[test]
    fn maps_leave_out_what_is_not_a_field() {
        let m = WireFields::from_pairs([
            (&b"ok"[..], &b"1"[..]),
            (b"bad name", b"2"),
            (b"bad-value", b"a\nb"),
        ])
        .to_map();
        assert_eq!(m.len(), 1);
        assert_eq!(m["ok"], "1");
    }

    #[test]
    fn hosts_follow_rfc_3986_and_nothing_looser() {
        for ok in [
            "a",
            "proxy.test:8080",
            "127.0.0.1",
            "[::1]",
            "[2001:db8::1]:443",
            "[v1.fe80::a+en1]",
            "xn--bcher-kva.example",
            "a%2Fb",
            "a,b",
            "a:65535",
        ] {
            assert!(is_valid_host(ok.as_bytes()), "{ok:?} refused");
        }
        for bad in [
            "",
            ":80",
            "a b",
            "a\"",
            "a\";for=6.6.6.6;x=\"",
            "a:",
            "a:65536",
            "a:123456",
            "a:8o",
            "a:1:2",
            "user@a",
            "a/b",
            "a?b",
            "a#b",
            "%zz",
            "a%2",
            "[::1",
            "[::1]x",
            "[not-ip]",
            "[v.x]",
            "::1",
            "\u{e9}.example",
        ] {
            assert!(!is_valid_host(bad.as_bytes()), "{bad:?} accepted");
        }
        // Every byte a reg-name may hold (RFC 3986 §2.2, §2.3), and no other.
        let allowed =
            "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~!$&'()*+,;=";
        for b in 0..=255u8 {
            assert_eq!(
                is_valid_host(&[b'h', b, b'x']),
                allowed.as_bytes().contains(&b),
                "byte {b:#04x}"
            );
        }
    }

    #[test]
    fn quoted_strings_escape_what_would_end_them() {
        let quoted = |s: &str| {
            let mut out = BytesMut::new();
            put_quoted(&mut out, s.as_bytes());
            String::from_utf8(out.to_vec()).unwrap()
        };
        assert_eq!(quoted("proxy.test"), "\"proxy.test\"");
        assert_eq!(quoted("a\";x=\"\\"), "\"a\\\";x=\\\"\\\\\"");
        assert_eq!(quoted_len(quoted("a\";b\\").as_bytes()), Some(9));
    }

    #[test]
    fn split_http2_cookies_become_one_field_where_the_first_was() {
        let mut map = HeaderMap::new();
        map.append("x-session-id", HeaderValue::from_static("s"));
        map.append("cookie", HeaderValue::from_static("a=1"));
        map.append("accept", HeaderValue::from_static("*/*"));
        map.append("cookie", HeaderValue::from_static("b=2"));
        map.append("cookie", HeaderValue::from_static("c=3"));
        let fields = WireFields::from_h2_request(&map);
        let pairs: Vec<(&[u8], &[u8])> = fields.pairs().collect();
        assert_eq!(
            pairs,
            [
                (&b"x-session-id"[..], &b"s"[..]),
                (b"cookie", b"a=1; b=2; c=3"),
                (b"accept", b"*/*"),
            ]
        );
        // One cookie field is left as it is.
        map.remove("cookie");
        map.append("cookie", HeaderValue::from_static("only=1"));
        let fields = WireFields::from_h2_request(&map);
        assert_eq!(fields.values_of("cookie").collect::<Vec<_>>(), [b"only=1"]);
    }
}
