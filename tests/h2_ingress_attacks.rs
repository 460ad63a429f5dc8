//! HTTP/2 ingress under attack, through a real proxy and real backends, with clients that
//! behave as attackers do: a raw-frame client that never acknowledges a PING, and a TLS client
//! that never sends its preface.
//!
//! Invariants:
//! - every graceful close has a hard deadline: an HTTP/2 connection whose client never
//!   acknowledges the GOAWAY's PING (h2c), or never sends its preface (TLS with ALPN h2), is
//!   dropped `client.close_grace_ms` after the idle timeout closed it, and an HTTP/1.1 client
//!   that does not hang up after a refusal is cut off after the same grace; each such drop is
//!   counted once as `limit="close"`, besides the `idle` count of the close it cut short.

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use agentrace::proxy::config::TlsConfig;
use support::backends::*;
use support::raw_h2::{self, RawH2};
use support::raw_http1::{self, guarded};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// A proxy over `backend` that closes HTTP/2 connections idle for 200 ms and gives a graceful
/// close 300 ms.
async fn proxy_closing_quickly(backend: &TestBackend) -> (TestProxy, Duration) {
    let mut config = config_for(&[backend]);
    config.client.idle_timeout_ms = 200;
    config.client.close_grace_ms = 300;
    (start_proxy(config).await, Duration::from_millis(500))
}

#[tokio::test]
async fn an_http2_client_that_never_acknowledges_the_ping_is_dropped_after_the_close_grace() {
    let backend = TestBackend::spawn("b").await;
    let (proxy, idle_and_grace) = proxy_closing_quickly(&backend).await;
    // Before the connection opens, so the proxy's clock starts later.
    let connecting = Instant::now();
    let tcp = TcpStream::connect(proxy.addr).await.unwrap();
    let mut h2 = RawH2::settle(tcp).await;
    let frames = h2
        .frames_until_closed("the proxy to drop a connection whose client never acks the PING")
        .await;
    assert!(
        connecting.elapsed() >= idle_and_grace,
        "dropped {:?} in, before the idle timeout and the close grace",
        connecting.elapsed()
    );
    assert!(
        frames.iter().any(|f| f.is(raw_h2::GOAWAY)),
        "no GOAWAY before the drop: {frames:?}"
    );
    assert!(
        frames.iter().any(|f| f.is(raw_h2::PING) && !f.is_ack()),
        "the graceful close sent no PING: {frames:?}"
    );
    assert_eq!(proxy.client_timeouts("close").await, 1);
    assert_eq!(proxy.client_timeouts("idle").await, 1);
    proxy.shutdown().await;
}

#[tokio::test]
async fn a_tls_http2_client_that_never_sends_its_preface_is_dropped_after_the_close_grace() {
    let backend = TestBackend::spawn("b").await;
    let dir = tempfile::tempdir().unwrap();
    let certified = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let (cert_file, key_file) = (dir.path().join("proxy.crt"), dir.path().join("proxy.key"));
    std::fs::write(&cert_file, certified.cert.pem()).unwrap();
    std::fs::write(&key_file, certified.key_pair.serialize_pem()).unwrap();
    let mut config = config_for(&[&backend]);
    config.client.idle_timeout_ms = 200;
    config.client.close_grace_ms = 300;
    config.tls = Some(TlsConfig {
        cert_file,
        key_file,
    });
    let proxy = start_proxy(config).await;

    let mut roots = rustls::RootCertStore::empty();
    roots.add(certified.cert.der().clone()).unwrap();
    let mut tls = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    tls.alpn_protocols = vec![b"h2".to_vec()];
    let connecting = Instant::now();
    let tcp = TcpStream::connect(proxy.addr).await.unwrap();
    let stream = tokio_rustls::TlsConnector::from(Arc::new(tls))
        .connect("localhost".try_into().unwrap(), tcp)
        .await
        .unwrap();
    assert_eq!(stream.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    // No preface, no SETTINGS: only reads.
    RawH2::new(stream)
        .frames_until_closed("the proxy to drop a TLS connection that never sent its preface")
        .await;
    assert!(
        connecting.elapsed() >= Duration::from_millis(500),
        "dropped {:?} in, before the idle timeout and the close grace",
        connecting.elapsed()
    );
    assert_eq!(proxy.client_timeouts("close").await, 1);
    assert_eq!(proxy.client_timeouts("idle").await, 1);
    proxy.shutdown().await;
}

/// HTTP/1.1's graceful close after a refusal waits for the client to hang up, for the close
/// grace at most.
#[tokio::test]
async fn an_http1_client_that_does_not_hang_up_after_a_refusal_is_cut_off_after_the_close_grace() {
    let backend = TestBackend::spawn("b").await;
    let (proxy, _) = proxy_closing_quickly(&backend).await;
    let mut client = raw_http1::Client::connect(proxy.addr).await;
    let asked = Instant::now();
    client
        .send("CONNECT proxy.test:443 HTTP/1.1\r\nhost: proxy.test:443\r\n\r\n")
        .await;
    assert_eq!(client.reply().await.status, 405);
    // Still sending, never hanging up: the proxy reads and drops it until it gives up.
    let mut pace = tokio::time::interval(Duration::from_millis(10));
    guarded("the proxy to cut the client off", async {
        loop {
            pace.tick().await;
            if client.stream.write_all(b"x").await.is_err() {
                return;
            }
        }
    })
    .await;
    assert!(
        asked.elapsed() >= Duration::from_millis(300),
        "cut off {:?} in, before the close grace",
        asked.elapsed()
    );
    assert_eq!(proxy.client_timeouts("close").await, 1);
    assert_eq!(backend.hits(), 0);
    proxy.shutdown().await;
}
