//! The header fields the proxy passes on: a received head's fields less the hop-by-hop ones
//! and those the proxy sets itself, merged with the proxy's own as the head is written. Which
//! fields the proxy adds to a request is [`super::forwarded`]'s business.

use http::header::{HeaderName, HeaderValue};

use crate::http1::fields::{is_hop_by_hop, same_name, Fields, WireFields};

/// The lengths of the hop-by-hop names, as [`OutboundFields`]' length filter holds them.
const HOP_BY_HOP_LENGTHS: u64 = 1 << 2 | 1 << 7 | 1 << 10 | 1 << 16 | 1 << 17 | 1 << 18 | 1 << 19;

fn length_bit(name: &[u8]) -> u64 {
    1 << name.len().min(63)
}

/// Fields passed on by the proxy: those received, less hop-by-hop ones (with the names their
/// `Connection` lists) and the ones the proxy sets itself, then the proxy's own. The two are
/// kept apart and merged as the head is written, so no field is removed from or added to a
/// map on the way.
#[derive(Debug)]
pub(crate) struct OutboundFields {
    received: WireFields,
    /// Received names (lower-case) the proxy sets from elsewhere.
    replaced: &'static [&'static str],
    /// Names the received `Connection` lists (lower-case).
    connection_listed: Vec<Vec<u8>>,
    /// Fields the proxy sets; a received field of the same name is not passed on.
    added: Vec<(HeaderName, HeaderValue)>,
    /// A bit for the length of every name left out: most names are kept on this alone.
    dropped_lengths: u64,
}

impl OutboundFields {
    /// `received`, to be passed on without hop-by-hop fields or those named in `replaced`,
    /// then `added`.
    pub(crate) fn new(
        received: WireFields,
        replaced: &'static [&'static str],
        added: Vec<(HeaderName, HeaderValue)>,
    ) -> Self {
        let connection_listed: Vec<Vec<u8>> = received
            .values_of("connection")
            .flat_map(|v| v.split(|&b| b == b','))
            .map(<[u8]>::trim_ascii)
            .filter(|name| !name.is_empty())
            .map(<[u8]>::to_ascii_lowercase)
            .collect();
        let dropped_lengths = replaced
            .iter()
            .map(|r| r.as_bytes())
            .chain(connection_listed.iter().map(Vec::as_slice))
            .chain(added.iter().map(|(name, _)| name.as_str().as_bytes()))
            .fold(HOP_BY_HOP_LENGTHS, |bits, name| bits | length_bit(name));
        Self {
            received,
            replaced,
            connection_listed,
            added,
            dropped_lengths,
        }
    }

    /// Sets `name` to `value`, in place of any received field of that name.
    pub(crate) fn set(&mut self, name: HeaderName, value: HeaderValue) {
        self.dropped_lengths |= length_bit(name.as_str().as_bytes());
        self.added.push((name, value));
    }

    fn keeps(&self, name: &[u8]) -> bool {
        if self.dropped_lengths & length_bit(name) == 0 {
            return true;
        }
        let is = |other: &[u8]| same_name(name, other);
        !(is_hop_by_hop(name)
            || self.replaced.iter().any(|r| is(r.as_bytes()))
            || self.added.iter().any(|(a, _)| is(a.as_str().as_bytes()))
            || self.connection_listed.iter().any(|listed| is(listed)))
    }
}

impl Fields for OutboundFields {
    /// The received fields that are kept, then the proxy's.
    fn pairs(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        let kept = self.received.pairs().filter(|(name, _)| self.keeps(name));
        kept.chain(
            self.added
                .iter()
                .map(|(name, value)| (name.as_str().as_bytes(), value.as_bytes())),
        )
    }

    fn values_of<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        let kept = self.keeps(name.as_bytes());
        let received = self.received.values_of(name).filter(move |_| kept);
        received.chain(
            self.added
                .iter()
                .filter(move |(added, _)| added.as_str() == name)
                .map(|(_, value)| value.as_bytes()),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderMap;

    #[test]
    fn forwarded_fields_leave_out_hop_by_hop_and_replaced_ones() {
        let mut h = HeaderMap::new();
        h.insert("connection", "close, x-private".parse().unwrap());
        h.insert("x-private", "1".parse().unwrap());
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        h.insert("transfer-encoding", "chunked".parse().unwrap());
        h.insert("content-length", "2".parse().unwrap());
        h.insert("x-agentrace-backend", "spoofed".parse().unwrap());
        h.insert("x-session-id", "s1".parse().unwrap());
        // As long as "connection": the length alone must not decide.
        h.insert("user-agent", "agent/1".parse().unwrap());
        let out = OutboundFields::new(
            WireFields::from_map(&h),
            &["content-length"],
            vec![(
                HeaderName::from_static("x-agentrace-backend"),
                HeaderValue::from_static("b1"),
            )],
        );
        let sent: Vec<_> = out.pairs().collect();
        assert_eq!(
            sent,
            [
                (&b"x-session-id"[..], &b"s1"[..]),
                (b"user-agent", b"agent/1"),
                (b"x-agentrace-backend", b"b1")
            ]
        );
        // Lookups see the edited fields.
        for gone in ["x-private", "content-length", "connection", "keep-alive"] {
            assert!(!out.has(gone), "{gone}");
        }
        assert_eq!(out.first("x-agentrace-backend"), Some(&b"b1"[..]));
        assert_eq!(out.first("user-agent"), Some(&b"agent/1"[..]));
        assert_eq!(out.to_map().len(), 3);
    }
}
