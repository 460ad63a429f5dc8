//! The conformance selection header (`epp.selection_header`): the Gateway API Inference
//! Extension's conformance suite steers each request to the endpoints it names in
//! `test-epp-endpoint-selection`, so a gateway can be tested for following its picker. Off
//! unless configured: any client could steer its own requests with it.

use std::net::{IpAddr, SocketAddr};

/// Most entries read from one header value, so a long value costs bounded work.
const MAX_ENTRIES: usize = 64;

/// One endpoint the header names: an exact `ip:port`, or every port of an `ip`.
#[derive(Debug, PartialEq)]
enum Named {
    Endpoint(SocketAddr),
    Host(IpAddr),
}

/// What the header asks for: the endpoints named, in order. Entries that are neither
/// `ip:port` nor `ip` (`256.256.256.256`) name nothing.
#[derive(Debug)]
pub(crate) struct Selection(Vec<Named>);

impl Selection {
    /// The selection in `value`; None when it names nothing at all (empty, or only blanks),
    /// which leaves the request to the usual placement.
    pub(crate) fn parse(value: &[u8]) -> Option<Selection> {
        let text = std::str::from_utf8(value).ok()?;
        let items: Vec<&str> = text
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .take(MAX_ENTRIES)
            .collect();
        if items.is_empty() {
            return None;
        }
        let named = items
            .into_iter()
            .filter_map(|item| {
                if let Ok(addr) = item.parse::<SocketAddr>() {
                    return Some(Named::Endpoint(addr));
                }
                let host = item.trim_start_matches('[').trim_end_matches(']');
                host.parse::<IpAddr>().ok().map(Named::Host)
            })
            .collect();
        Some(Selection(named))
    }

    /// Whether the endpoint at `authority` (`ip:port`) is one the header names.
    pub(crate) fn names(&self, authority: &str) -> bool {
        let Ok(addr) = authority.parse::<SocketAddr>() else {
            return false;
        };
        self.0.iter().any(|n| match n {
            Named::Endpoint(e) => *e == addr,
            Named::Host(ip) => *ip == addr.ip(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::config::BackendConfig;
    use crate::proxy::ProxyConfig;

    #[test]
    fn the_config_takes_only_a_lower_case_header_name_that_means_nothing_else() {
        let with = |name: &str| {
            let mut c = ProxyConfig {
                backends: vec![BackendConfig {
                    name: "e0".into(),
                    url: "http://127.0.0.1:8000".into(),
                    weight: 1.0,
                }],
                ..ProxyConfig::default()
            };
            c.epp.selection_header = Some(name.into());
            c.validate().map_err(|e| e.to_string())
        };
        assert!(with("test-epp-endpoint-selection").is_ok());
        for (name, why) in [
            ("Test-Epp-Endpoint-Selection", "lower-case HTTP header name"),
            ("a b", "lower-case HTTP header name"),
            ("", "lower-case HTTP header name"),
            ("x-gateway-destination-endpoint", "already means something"),
            ("x-session-id", "already means something"),
        ] {
            let e = with(name).unwrap_err();
            assert!(
                e.contains("epp.selection_header") && e.contains(why),
                "{name:?}: {e}"
            );
        }
    }

    #[test]
    fn an_entry_names_an_exact_endpoint_or_every_port_of_a_host() {
        let s = Selection::parse(b" 10.0.0.1:8000 , 10.0.0.2,[::1]").unwrap();
        assert!(s.names("10.0.0.1:8000"));
        assert!(!s.names("10.0.0.1:8001"));
        assert!(s.names("10.0.0.2:9"));
        assert!(s.names("[::1]:80"));
        assert!(!s.names("10.0.0.3:8000"));
    }

    #[test]
    fn an_invalid_entry_names_nothing_and_a_blank_value_is_no_selection() {
        let s = Selection::parse(b"256.256.256.256").unwrap();
        assert!(!s.names("10.0.0.1:8000"));
        assert!(Selection::parse(b" , ").is_none());
        assert!(Selection::parse(b"").is_none());
        assert!(Selection::parse(&[0xff]).is_none());
    }
}
