//! A remote http(s) server this process connects to, as the proxy's backends, the replayer's
//! targets and the endpoint picker's Kubernetes API server all are: its URL parsed and checked
//! once, and the rustls client configuration that verifies it.
//!
//! One parser, so that a backend URL the proxy accepts is a target the replayer accepts, and
//! one TLS set-up (rustls with the `ring` provider), so that a change to trust or protocol
//! versions reaches every client at once. This module depends on no other stage of the crate:
//! the proxy, the replayer and the endpoint picker each depend on it.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use http::uri::{Authority, Scheme};
use rustls::pki_types::{InvalidDnsNameError, ServerName};

/// What is wrong with a server URL. Each message names the part at fault, so that a caller
/// can put it after the field it came from (`backends[0].url: must not have a query`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UrlError {
    /// Not a URI at all.
    #[error("not a valid URL ({0})")]
    NotAUrl(String),
    /// No `scheme://` in front: a bare `host:port`.
    #[error("must start with http:// or https://")]
    NoScheme,
    /// A scheme other than `http` or `https`.
    #[error("scheme must be http or https")]
    Scheme,
    /// `http://` with nothing after it, or only a port.
    #[error("must name a host")]
    NoHost,
    /// A port that is not a number from 1 to 65535 (`http::Uri` takes `:99999` and `:` and
    /// leaves the port unset, which would mean the scheme's default).
    #[error("port must be 1 to 65535")]
    Port,
    /// `user:password@host`: credentials travel in headers, never in the Host of every request.
    #[error("must not carry user:password@ before the host")]
    UserInfo,
    /// A `?query`, which no request path could carry along.
    #[error("must not have a query")]
    Query,
    /// A `#fragment`, which a client never sends.
    #[error("must not have a fragment")]
    Fragment,
}

/// An `http://` or `https://` server: `host[:port][/path]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerUrl {
    /// True for `https`.
    pub tls: bool,
    /// The host name or IP address to connect to and to verify the certificate against;
    /// an IPv6 literal without its brackets.
    pub host: String,
    /// The port, written or the scheme's default (80, 443).
    pub port: u16,
    /// `host[:port]` as written (IPv6 in brackets): what an HTTP/1.1 `Host` header carries.
    pub authority: Authority,
    /// The path, without a trailing slash; empty when the URL has none.
    pub path: String,
}

impl ServerUrl {
    /// Parses `http(s)://host[:port][/path]`; the error says what is wrong.
    pub fn parse(url: &str) -> Result<Self, UrlError> {
        let uri: http::Uri = url
            .parse()
            .map_err(|e: http::uri::InvalidUri| UrlError::NotAUrl(e.to_string()))?;
        let tls = match uri.scheme() {
            None => return Err(UrlError::NoScheme),
            Some(s) if *s == Scheme::HTTPS => true,
            Some(s) if *s == Scheme::HTTP => false,
            Some(_) => return Err(UrlError::Scheme),
        };
        let authority = uri.authority().cloned().ok_or(UrlError::NoHost)?;
        if authority.as_str().contains('@') {
            return Err(UrlError::UserInfo);
        }
        // Without user info, the authority is the host and then `:port` if anything.
        let (host, port) = authority.as_str().split_at(authority.host().len());
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return Err(UrlError::NoHost);
        }
        let port = match port.strip_prefix(':') {
            None if tls => 443,
            None => 80,
            Some(port) => match port.parse::<u16>() {
                Ok(port) if port != 0 => port,
                _ => return Err(UrlError::Port),
            },
        };
        if uri.query().is_some() {
            return Err(UrlError::Query);
        }
        // `http::Uri` drops a fragment silently; a URL that has one was meant otherwise.
        if url.contains('#') {
            return Err(UrlError::Fragment);
        }
        Ok(Self {
            tls,
            host: host.to_string(),
            port,
            path: uri.path().trim_end_matches('/').to_string(),
            authority,
        })
    }

    /// `http` or `https`.
    pub fn scheme(&self) -> Scheme {
        if self.tls {
            Scheme::HTTPS
        } else {
            Scheme::HTTP
        }
    }

    /// The name the server's certificate must carry (a DNS name or an IP address).
    pub fn server_name(&self) -> Result<ServerName<'static>, InvalidDnsNameError> {
        ServerName::try_from(self.host.clone())
    }
}

impl fmt::Display for ServerUrl {
    /// `scheme://authority/path`, as parsed (no trailing slash).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}://{}{}", self.scheme(), self.authority, self.path)
    }
}

/// Which certificate authorities a TLS client trusts.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Trust<'a> {
    /// The platform's store (as `rustls-native-certs` finds it), for servers on the internet.
    Platform,
    /// Only the certificates in this PEM file: a private CA, a cluster's service-account CA.
    CaFile(&'a Path),
    /// None: for a client that must hold a configuration but has no `https` server to reach
    /// yet, without reading the platform store for nothing.
    Nothing,
}

/// Why no TLS client configuration could be built.
#[derive(Debug, thiserror::Error)]
pub enum TlsConfigError {
    /// The CA file is missing, unreadable, or holds no usable certificate.
    #[error("CA file {}: {reason}", path.display())]
    CaFile {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// rustls refused the settings (a provider without the default protocol versions).
    #[error("rustls: {0}")]
    Rustls(rustls::Error),
}

/// A rustls client configuration (`ring` provider, the safe default protocol versions, no
/// client certificate) trusting `trust`, offering the `alpn` protocols in order of preference.
pub(crate) fn client_config(
    trust: Trust<'_>,
    alpn: &[&[u8]],
) -> Result<rustls::ClientConfig, TlsConfigError> {
    let roots = match trust {
        Trust::Platform => platform_roots(),
        Trust::CaFile(path) => ca_file_roots(path)?,
        Trust::Nothing => rustls::RootCertStore::empty(),
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(TlsConfigError::Rustls)?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(config)
}

/// The platform's CA certificates; what cannot be loaded is logged, not fatal, since the
/// servers this process talks to may not need it.
fn platform_roots() -> rustls::RootCertStore {
    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    for e in &native.errors {
        tracing::warn!(error = %e, "could not load some platform CA certificates");
    }
    let (added, _) = roots.add_parsable_certificates(native.certs);
    if added == 0 {
        tracing::warn!(
            "no platform CA certificates found: https servers cannot be verified unless a CA file is set"
        );
    }
    roots
}

/// Every certificate in the PEM file at `path`; a file with none is refused, since it would
/// make every handshake fail later with a less helpful message.
fn ca_file_roots(path: &Path) -> Result<rustls::RootCertStore, TlsConfigError> {
    let err = |reason: String| TlsConfigError::CaFile {
        path: path.to_path_buf(),
        reason,
    };
    let pem = std::fs::read(path).map_err(|e| err(e.to_string()))?;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_pemfile::certs(&mut pem.as_slice()) {
        let cert = cert.map_err(|e| err(format!("not a PEM certificate bundle: {e}")))?;
        roots
            .add(cert)
            .map_err(|e| err(format!("bad certificate: {e}")))?;
    }
    if roots.is_empty() {
        return Err(err("no certificate in the file".into()));
    }
    Ok(roots)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_split_into_host_port_and_path_with_the_scheme_default_port() {
        let cases = [
            ("http://h", false, "h", 80, "h", ""),
            ("https://h", true, "h", 443, "h", ""),
            (
                "http://127.0.0.1:8000",
                false,
                "127.0.0.1",
                8000,
                "127.0.0.1:8000",
                "",
            ),
            (
                "HTTPS://Api.Example.com:8443/v2/",
                true,
                "Api.Example.com",
                8443,
                "Api.Example.com:8443",
                "/v2",
            ),
            ("http://h:1/a/b", false, "h", 1, "h:1", "/a/b"),
            (
                "http://[::1]:9000/base/",
                false,
                "::1",
                9000,
                "[::1]:9000",
                "/base",
            ),
            (
                "https://[2001:db8::1]",
                true,
                "2001:db8::1",
                443,
                "[2001:db8::1]",
                "",
            ),
        ];
        for (url, tls, host, port, authority, path) in cases {
            let u = ServerUrl::parse(url).unwrap_or_else(|e| panic!("{url}: {e}"));
            assert_eq!(
                (
                    u.tls,
                    u.host.as_str(),
                    u.port,
                    u.authority.as_str(),
                    u.path.as_str()
                ),
                (tls, host, port, authority, path),
                "{url}"
            );
        }
    }

    #[test]
    fn a_bad_url_is_refused_naming_what_is_wrong() {
        let cases = [
            ("localhost:8000", "must start with http:// or https://"),
            ("/v1/chat", "must start with http:// or https://"),
            ("ftp://h:1", "scheme must be http or https"),
            ("http://h:0", "port must be 1 to 65535"),
            ("http://h:99999", "port must be 1 to 65535"),
            ("http://h:/v1", "port must be 1 to 65535"),
            (
                "http://user:pw@h:1",
                "must not carry user:password@ before the host",
            ),
            ("http://h:1/v1?x=1", "must not have a query"),
            ("http://h:1/v1#top", "must not have a fragment"),
        ];
        for (url, message) in cases {
            let e = ServerUrl::parse(url).unwrap_err();
            assert_eq!(e.to_string(), message, "{url}");
        }
        for url in ["", "http://", "http://a b", "http://[::1"] {
            let e = ServerUrl::parse(url).unwrap_err();
            assert!(
                matches!(e, UrlError::NotAUrl(_) | UrlError::NoHost),
                "{url:?}: {e:?}"
            );
        }
    }

    #[test]
    fn display_and_server_name_round_trip_the_parsed_parts() {
        let u = ServerUrl::parse("https://[2001:db8::1]:8443/v2/").unwrap();
        assert_eq!(u.to_string(), "https://[2001:db8::1]:8443/v2");
        assert_eq!(u.scheme(), Scheme::HTTPS);
        assert!(matches!(u.server_name().unwrap(), ServerName::IpAddress(_)));
        let u = ServerUrl::parse("https://api.example.com").unwrap();
        assert!(matches!(u.server_name().unwrap(), ServerName::DnsName(_)));
    }

    #[test]
    fn a_missing_or_unusable_ca_file_is_refused_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.pem");
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let broken = dir.path().join("broken.pem");
        std::fs::write(
            &broken,
            "-----BEGIN CERTIFICATE-----\n!!!\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        for (path, reason) in [
            (&missing, "No such file"),
            (&empty, "no certificate in the file"),
            (&broken, "not a PEM certificate bundle"),
        ] {
            let e = client_config(Trust::CaFile(path), &[]).unwrap_err();
            let text = e.to_string();
            assert!(
                text.starts_with(&format!("CA file {}: ", path.display())),
                "{text}"
            );
            assert!(text.contains(reason), "{text}");
        }
    }

    /// Runs a TLS handshake in memory between `client` and a server presenting `cert` for
    /// `localhost`; the error is the client's verdict.
    fn handshake(
        client: rustls::ClientConfig,
        cert: &rcgen::CertifiedKey,
    ) -> Result<Option<Vec<u8>>, rustls::Error> {
        let key =
            rustls::pki_types::PrivateKeyDer::try_from(cert.key_pair.serialize_der()).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut server = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![cert.cert.der().clone()], key)
            .unwrap();
        server.alpn_protocols = vec![b"http/1.1".to_vec()];
        let name = ServerName::try_from("localhost").unwrap();
        let mut c = rustls::ClientConnection::new(Arc::new(client), name).unwrap();
        let mut s = rustls::ServerConnection::new(Arc::new(server)).unwrap();
        while c.is_handshaking() || s.is_handshaking() {
            let mut wire = Vec::new();
            c.write_tls(&mut wire).unwrap();
            s.read_tls(&mut wire.as_slice()).unwrap();
            // The server's verdict does not matter here; its alert reaches the client below.
            let _ = s.process_new_packets();
            wire.clear();
            s.write_tls(&mut wire).unwrap();
            if wire.is_empty() && !c.wants_write() {
                break;
            }
            c.read_tls(&mut wire.as_slice()).unwrap();
            c.process_new_packets()?;
        }
        Ok(c.alpn_protocol().map(<[u8]>::to_vec))
    }

    #[test]
    fn a_ca_file_is_trusted_alone_and_alpn_is_offered() {
        let ca = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let other = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ca.pem");
        std::fs::write(&path, ca.cert.pem()).unwrap();
        let config = || client_config(Trust::CaFile(&path), &[b"h2", b"http/1.1"]).unwrap();
        assert_eq!(
            config().alpn_protocols,
            [b"h2".to_vec(), b"http/1.1".to_vec()]
        );
        assert_eq!(
            handshake(config(), &ca).unwrap(),
            Some(b"http/1.1".to_vec())
        );
        let refused = handshake(config(), &other).unwrap_err();
        assert!(
            matches!(refused, rustls::Error::InvalidCertificate(_)),
            "{refused:?}"
        );
        let nothing = client_config(Trust::Nothing, &[]).unwrap();
        assert!(handshake(nothing, &ca).is_err());
    }
}
