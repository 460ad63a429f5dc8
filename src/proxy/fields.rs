//! Header fields as the forwarding path reads them: a map hyper built (HTTP/2), or the fields
//! of an HTTP/1.1 head left in the bytes they were read into, which spares building a map for
//! a head that is only looked at and written out again. Names compare case-insensitively.

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};

/// Read access to a message's header fields, in order.
pub trait Fields {
    /// Every field in order: its name as sent, its value.
    fn pairs(&self) -> impl Iterator<Item = (&[u8], &[u8])>;

    /// The values of the fields named `name` (lower-case), in order.
    fn values_of<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.pairs()
            .filter(move |(n, _)| n.eq_ignore_ascii_case(name.as_bytes()))
            .map(|(_, v)| v)
    }

    /// The first value of `name` (lower-case).
    fn first<'a>(&'a self, name: &'a str) -> Option<&'a [u8]> {
        self.values_of(name).next()
    }

    /// Whether a field named `name` (lower-case) is present.
    fn has(&self, name: &str) -> bool {
        self.first(name).is_some()
    }

    /// The same fields as one map (for HTTP/2, the recorder and tests).
    fn to_map(&self) -> HeaderMap {
        map_of(self.pairs())
    }
}

/// Whether `name` is a hop-by-hop field, never forwarded (RFC 9110 §7.6.1).
pub fn is_hop_by_hop(name: &[u8]) -> bool {
    let is = |known: &str| name.eq_ignore_ascii_case(known.as_bytes());
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
pub fn text(value: &[u8]) -> Option<&str> {
    value
        .iter()
        .all(|&b| b == b'\t' || (b' '..=b'~').contains(&b))
        .then(|| std::str::from_utf8(value).ok())
        .flatten()
}

/// A map of `pairs`; a pair that is not a valid field is left out.
pub fn map_of<'a>(pairs: impl Iterator<Item = (&'a [u8], &'a [u8])>) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (name, value) in pairs {
        if let (Ok(name), Ok(value)) =
            (HeaderName::from_bytes(name), HeaderValue::from_bytes(value))
        {
            map.append(name, value);
        }
    }
    map
}

impl Fields for HeaderMap {
    fn pairs(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.iter()
            .map(|(n, v)| (n.as_str().as_bytes(), v.as_bytes()))
    }

    fn values_of<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.get_all(name).into_iter().map(HeaderValue::as_bytes)
    }

    fn to_map(&self) -> HeaderMap {
        self.clone()
    }
}

/// Where a field's name and value lie in its head: offset and length of each.
pub type Span = (u32, u32, u32, u32);

/// The fields of an HTTP/1.1 head as httparse found them, as spans of the head's bytes. The
/// parser has checked every name is a token and every value valid field content, the same
/// rules `HeaderName` and `HeaderValue` apply, so the bytes go out again as they came.
#[derive(Debug, Clone, Default)]
pub struct WireFields {
    head: Bytes,
    spans: Vec<Span>,
}

impl WireFields {
    /// Fields at `spans` of `head`.
    pub fn new(head: Bytes, spans: Vec<Span>) -> Self {
        Self { head, spans }
    }

    /// The whole head the fields were read from.
    pub fn head(&self) -> &Bytes {
        &self.head
    }

    /// The number of fields.
    pub fn len(&self) -> usize {
        self.spans.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    /// Every field in order, each value sharing the head's buffer instead of being copied.
    pub fn shared_pairs(&self) -> impl Iterator<Item = (&[u8], Bytes)> {
        self.spans.iter().map(|&(n, nl, v, vl)| {
            let value = self.head.slice(v as usize..(v + vl) as usize);
            (self.part(n, nl), value)
        })
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
                nl as usize == name.len() && self.part(n, nl).eq_ignore_ascii_case(name.as_bytes())
            })
            .map(|&(_, _, v, vl)| self.part(v, vl))
    }

    fn to_map(&self) -> HeaderMap {
        let mut map = HeaderMap::with_capacity(self.spans.len());
        for (name, value) in self.shared_pairs() {
            if let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(name),
                HeaderValue::from_maybe_shared(value),
            ) {
                map.append(name, value);
            }
        }
        map
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
    fn wire_fields_and_maps_answer_lookups_alike() {
        let w = wire("Host: a\r\nX-Session-ID: s1\r\nAccept: x\r\naccept: y\r\n");
        let m = w.to_map();
        assert_eq!(m.len(), 4);
        assert_eq!(m["x-session-id"], "s1");
        for name in ["host", "x-session-id", "accept", "missing"] {
            assert_eq!(
                w.values_of(name).collect::<Vec<_>>(),
                m.values_of(name).collect::<Vec<_>>(),
                "{name}"
            );
        }
        assert!(w.has("accept") && !w.has("accep"));
        assert_eq!(w.first("ACCEPT".to_lowercase().as_str()), Some(&b"x"[..]));
        // Names go out as the client wrote them.
        assert_eq!(w.pairs().nth(1), Some((&b"X-Session-ID"[..], &b"s1"[..])));
    }

    #[test]
    fn map_of_leaves_out_what_is_not_a_field() {
        let m = map_of(
            [
                (&b"ok"[..], &b"1"[..]),
                (b"bad name", b"2"),
                (b"bad-value", b"a\nb"),
            ]
            .into_iter(),
        );
        assert_eq!(m.len(), 1);
        assert_eq!(m["ok"], "1");
    }
}
