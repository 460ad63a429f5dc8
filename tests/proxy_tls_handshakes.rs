//! TLS handshakes on the proxy's listener, with real rustls clients and raw sockets.
//!
//! Invariants: at most `client.max_tls_handshakes` handshakes run past their ClientHello at
//! once; one more waits for a free permit (counted in `agentrace_tls_handshake_waits_total`)
//! and proceeds, in order, as soon as one is let go; a client that sends its ClientHello
//! partially and stalls holds no permit, nor holds up shutdown.

mod support;

use std::sync::Arc;
use std::time::Duration;

use agentrace::proxy::config::TlsConfig;
use support::backends::*;
use support::raw_http1::guarded;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn client_config(cert: &rcgen::CertifiedKey) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.cert.der().clone()).unwrap();
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    Arc::new(config)
}

/// The bytes of a real ClientHello, as a client sends them first.
fn client_hello(config: &Arc<rustls::ClientConfig>) -> Vec<u8> {
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let mut conn = rustls::ClientConnection::new(config.clone(), name).unwrap();
    let mut hello = Vec::new();
    while conn.wants_write() {
        conn.write_tls(&mut hello).unwrap();
    }
    hello
}

fn waits(metrics: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("agentrace_tls_handshake_waits_total "))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

#[tokio::test]
async fn a_handshake_over_max_tls_handshakes_waits_until_one_is_let_go() {
    let backend = TestBackend::spawn("b").await;
    let dir = tempfile::tempdir().unwrap();
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let (cert_file, key_file) = (dir.path().join("proxy.crt"), dir.path().join("proxy.key"));
    std::fs::write(&cert_file, cert.cert.pem()).unwrap();
    std::fs::write(&key_file, cert.key_pair.serialize_pem()).unwrap();
    let mut config = config_for(&[&backend]);
    config.tls = Some(TlsConfig {
        cert_file,
        key_file,
    });
    config.client.max_tls_handshakes = 1;
    let proxy = start_proxy(config).await;
    let tls = client_config(&cert);

    // A partial ClientHello, then nothing: it must not take the only permit.
    let hello = client_hello(&tls);
    let mut partial = TcpStream::connect(proxy.addr).await.unwrap();
    partial.write_all(&hello[..hello.len() / 2]).await.unwrap();

    // A whole ClientHello, then nothing: the proxy answers it (so it holds the permit) and
    // waits for the client's Finished, which never comes.
    let mut holder = TcpStream::connect(proxy.addr).await.unwrap();
    holder.write_all(&client_hello(&tls)).await.unwrap();
    let mut server_hello = [0u8; 1];
    guarded(
        "the holder's ServerHello",
        holder.read_exact(&mut server_hello),
    )
    .await
    .unwrap();
    assert_eq!(server_hello[0], 0x16, "a handshake record");

    // A real client now waits for the permit: the proxy has not answered its ClientHello.
    let connector = tokio_rustls::TlsConnector::from(tls.clone());
    let addr = proxy.addr;
    let waiting = tokio::spawn(async move {
        let tcp = TcpStream::connect(addr).await.unwrap();
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        connector.connect(name, tcp).await
    });
    guarded("the second handshake to wait for the permit", async {
        while waits(&proxy.metrics().await) < 1.0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(
        !waiting.is_finished(),
        "the handshake went ahead without a permit"
    );

    // The holder leaves: its handshake fails, the permit passes on, and the waiting client's
    // handshake completes and is served.
    drop(holder);
    let mut session = guarded("the waiting handshake", waiting)
        .await
        .unwrap()
        .expect("the handshake completes once the permit is free");
    session
        .write_all(b"GET /v1/models HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    guarded("the answer", session.read_to_end(&mut answer))
        .await
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200 "), "{answer}");
    assert_eq!(waits(&proxy.metrics().await), 1.0);

    // The partial ClientHello held no permit throughout; shutdown does not wait for it.
    tokio::time::timeout(Duration::from_secs(5), proxy.shutdown())
        .await
        .expect("shutdown waited for the stalled ClientHello");
    drop(partial);
}
