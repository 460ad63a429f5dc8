//! HTTP/2 ingress under attack, through a real proxy and real backends, with clients that
//! behave as attackers do: a raw-frame client that never acknowledges a PING, a TLS client
//! that never sends its preface, and `h2` crate clients that reset streams.
//!
//! Invariants:
//! - every graceful close has a hard deadline: an HTTP/2 connection whose client never
//!   acknowledges the GOAWAY's PING (h2c), or never sends its preface (TLS with ALPN h2), is
//!   dropped `client.close_grace_ms` after the idle timeout closed it, and an HTTP/1.1 client
//!   that does not hang up after a refusal is cut off after the same grace; each such drop is
//!   counted once as `limit="close"`, besides the `idle` count of the close it cut short;
//! - a reset storm (streams cancelled once their request reached the backend) closes the
//!   connection, and the backend sees no more than `h2_max_cancelled_streams` +
//!   `h2_max_concurrent_streams` of its requests; the cancelled streams are counted in
//!   `agentrace_client_cancelled_streams_total` and `agentrace_requests_total{status="cancelled"}`,
//!   the close in `agentrace_client_cancel_limit_closes_total`;
//! - a client that cancels fewer than `h2_max_cancelled_share` of its streams keeps its
//!   connection;
//! - split HTTP/2 `cookie` fields reach an HTTP/1.1 backend as one `cookie` line, joined by
//!   `"; "` (RFC 9113 §8.2.3);
//! - an HTTP/2 `CONNECT` gets 405 and never reaches a backend, and the connection serves on.

mod support;

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentrace::proxy::config::TlsConfig;
use bytes::Bytes;
use support::backends::*;
use support::raw_h2::{self, RawH2};
use support::raw_http1::{self, guarded, After, RawBackend};
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

const MAX_CANCELLED: u64 = 10;
const MAX_STREAMS: u32 = 4;

/// A proxy over `backend` with small HTTP/2 stream limits.
async fn proxy_with_stream_limits(backend: &TestBackend) -> TestProxy {
    let mut config = config_for(&[backend]);
    config.client.h2_max_cancelled_streams = MAX_CANCELLED;
    config.client.h2_max_cancelled_share = 0.5;
    config.client.h2_max_concurrent_streams = MAX_STREAMS;
    config.client.close_grace_ms = 1_000;
    start_proxy(config).await
}

async fn h2_client(
    proxy: &TestProxy,
) -> (
    h2::client::SendRequest<Bytes>,
    tokio::task::JoinHandle<Result<(), h2::Error>>,
) {
    let tcp = TcpStream::connect(proxy.addr).await.unwrap();
    let (send, conn) = h2::client::handshake(tcp).await.unwrap();
    (send, tokio::spawn(conn))
}

/// Opens a stream for `GET path`, whose answer (or refusal) is reported on `answered` with
/// `index`; `None` once the connection takes no more streams.
async fn open_stream(
    client: &mut h2::client::SendRequest<Bytes>,
    proxy: &TestProxy,
    path: &str,
    index: u64,
    answered: &tokio::sync::mpsc::UnboundedSender<(u64, Option<u16>)>,
) -> Option<h2::SendStream<Bytes>> {
    let ready = guarded("stream capacity", client.clone().ready())
        .await
        .ok()?;
    *client = ready;
    let req = http::Request::get(proxy.url(path)).body(()).unwrap();
    let (response, stream) = client.send_request(req, true).ok()?;
    let answered = answered.clone();
    tokio::spawn(async move {
        let status = response.await.ok().map(|r| r.status().as_u16());
        let _ = answered.send((index, status));
    });
    Some(stream)
}

/// Waits until each of the streams `first..first + n` has either reached the backend (its hit
/// counted past `hits_before`) or been answered without it.
async fn each_forwarded_or_answered(
    backend: &TestBackend,
    hits_before: u64,
    first: u64,
    n: u64,
    answered: &mut tokio::sync::mpsc::UnboundedReceiver<(u64, Option<u16>)>,
) {
    let mut done = HashSet::new();
    guarded("each stream to reach the backend or be refused", async {
        loop {
            let notified = backend.ctl.changed.notified();
            if backend.hits() - hits_before + done.len() as u64 >= n {
                return;
            }
            tokio::select! {
                () = notified => {}
                Some((index, _)) = answered.recv() => {
                    if index >= first {
                        done.insert(index);
                    }
                }
            }
        }
    })
    .await;
}

/// Rapid Reset without the timing: each batch of streams is reset only once every one of them
/// reached the backend (or was refused), so every cancel costs the backend a request, as the
/// attack's 2-5 ms resets did.
#[tokio::test]
async fn a_reset_storm_closes_the_connection_before_the_backend_sees_more_than_the_limits_allow() {
    let backend = TestBackend::spawn_with("b", Mode::Stall).await;
    let proxy = proxy_with_stream_limits(&backend).await;
    let (mut client, conn) = h2_client(&proxy).await;
    let (answered_tx, mut answered) = tokio::sync::mpsc::unbounded_channel();
    let mut sent = 0u64;
    'storm: while sent < 200 {
        let (hits_before, first) = (backend.hits(), sent);
        let mut batch = Vec::new();
        for _ in 0..MAX_STREAMS {
            match open_stream(&mut client, &proxy, "/v1/storm", sent, &answered_tx).await {
                Some(stream) => batch.push(stream),
                None if batch.is_empty() => break 'storm,
                None => break,
            }
            sent += 1;
        }
        let n = batch.len() as u64;
        each_forwarded_or_answered(&backend, hits_before, first, n, &mut answered).await;
        for mut stream in batch {
            stream.send_reset(h2::Reason::CANCEL);
        }
    }
    drop(client);
    guarded("the proxy to close the storming connection", conn)
        .await
        .unwrap()
        .ok();
    let hits = backend.hits();
    assert!(
        hits > MAX_CANCELLED,
        "closed after {hits} requests, before the cancel limit"
    );
    assert!(
        hits <= MAX_CANCELLED + u64::from(MAX_STREAMS),
        "{hits} of {sent} streams reached the backend"
    );
    backend
        .wait_for("every forwarded request to be cancelled", |c| {
            c.cancelled.load(Ordering::SeqCst) == hits
        })
        .await;
    assert_eq!(
        proxy
            .counter("agentrace_requests_total{backend=\"b\",status=\"cancelled\"}")
            .await,
        hits
    );
    let cancelled = proxy
        .counter("agentrace_client_cancelled_streams_total")
        .await;
    assert!(
        cancelled > MAX_CANCELLED && cancelled <= hits,
        "{cancelled} cancelled streams counted, {hits} forwarded"
    );
    assert_eq!(
        proxy
            .counter("agentrace_client_cancel_limit_closes_total")
            .await,
        1
    );
    proxy.shutdown().await;
}

/// Cancelling is ordinary (an agent stops a generation): past the count limit, a client that
/// cancels less than the share of its streams keeps its connection.
#[tokio::test]
async fn a_client_that_cancels_a_minority_of_its_streams_keeps_its_connection() {
    let backend = TestBackend::spawn("b").await;
    let proxy = proxy_with_stream_limits(&backend).await;
    let (mut client, _conn) = h2_client(&proxy).await;
    let (answered_tx, mut answered) = tokio::sync::mpsc::unbounded_channel();
    let mut index = 0u64;
    // 2 * (MAX_CANCELLED + 2) answered, then MAX_CANCELLED + 2 cancelled: a third cancelled.
    for _ in 0..2 * (MAX_CANCELLED + 2) {
        open_stream(&mut client, &proxy, "/v1/ok", index, &answered_tx)
            .await
            .expect("the connection takes streams");
        let (at, status) = guarded("an answer", answered.recv()).await.unwrap();
        assert_eq!((at, status), (index, Some(200)));
        index += 1;
    }
    backend.set_mode(Mode::Stall);
    for _ in 0..MAX_CANCELLED + 2 {
        let hits_before = backend.hits();
        let mut stream = open_stream(&mut client, &proxy, "/v1/stop", index, &answered_tx)
            .await
            .expect("the connection takes streams");
        each_forwarded_or_answered(&backend, hits_before, index, 1, &mut answered).await;
        assert_eq!(backend.hits(), hits_before + 1, "stream {index} refused");
        stream.send_reset(h2::Reason::CANCEL);
        index += 1;
    }
    backend
        .wait_for("the cancels to reach the backend", |c| {
            c.cancelled.load(Ordering::SeqCst) == MAX_CANCELLED + 2
        })
        .await;
    backend.set_mode(Mode::Json);
    open_stream(&mut client, &proxy, "/v1/after", index, &answered_tx)
        .await
        .expect("the connection still takes streams");
    loop {
        let (at, status) = guarded("an answer", answered.recv()).await.unwrap();
        if at == index {
            assert_eq!(status, Some(200));
            break;
        }
    }
    assert_eq!(
        proxy
            .counter("agentrace_client_cancelled_streams_total")
            .await,
        MAX_CANCELLED + 2
    );
    assert_eq!(
        proxy
            .counter("agentrace_client_cancel_limit_closes_total")
            .await,
        0
    );
    proxy.shutdown().await;
}

#[tokio::test]
async fn split_http2_cookies_reach_an_http1_backend_as_one_line() {
    let backend = RawBackend::spawn(
        &[b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"],
        After::KeepServing,
    )
    .await;
    let proxy = start_proxy(raw_http1::config_over(&[("raw", backend.url())])).await;
    let (mut client, _conn) = h2_client(&proxy).await;
    let req = http::Request::get(proxy.url("/v1/models"))
        .header("cookie", "a=1")
        .header("x-session-id", "s")
        .header("cookie", "b=2")
        .body(())
        .unwrap();
    let (response, _) = client.send_request(req, true).unwrap();
    let response = guarded("the answer", response).await.unwrap();
    assert_eq!(response.status(), 200);
    let requests = backend.requests();
    assert_eq!(requests.len(), 1);
    let (head, _) = raw_http1::split_request(&requests[0]);
    let cookies: Vec<&str> = head
        .lines()
        .filter(|l| l.to_ascii_lowercase().starts_with("cookie:"))
        .collect();
    assert_eq!(cookies, ["cookie: a=1; b=2"], "{head}");
    proxy.shutdown().await;
}

/// The tunnel's first bytes follow the CONNECT as DATA, as a client's TLS hello would.
#[tokio::test]
async fn an_http2_connect_gets_405_and_never_reaches_a_backend() {
    let backend = RawBackend::spawn(
        &[b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"],
        After::KeepServing,
    )
    .await;
    let proxy = start_proxy(raw_http1::config_over(&[("raw", backend.url())])).await;
    let (mut client, _conn) = h2_client(&proxy).await;
    let connect = http::Request::connect("proxy.test:443").body(()).unwrap();
    let (response, mut tunnel) = client.send_request(connect, false).unwrap();
    tunnel
        .send_data(Bytes::from_static(b"\x16\x03\x01\x02\x00"), false)
        .unwrap();
    let response = guarded("the answer to CONNECT", response).await.unwrap();
    assert_eq!(response.status(), 405);
    let allow = response.headers()["allow"].to_str().unwrap();
    assert!(
        allow.contains("POST") && !allow.contains("CONNECT"),
        "{allow}"
    );
    // The connection serves on; the backend sees the next request and only that.
    let mut client = guarded("stream capacity", client.ready()).await.unwrap();
    let get = http::Request::get(proxy.url("/v1/models"))
        .body(())
        .unwrap();
    let (response, _) = client.send_request(get, true).unwrap();
    assert_eq!(guarded("the answer", response).await.unwrap().status(), 200);
    let requests: Vec<String> = backend
        .requests()
        .iter()
        .map(|r| raw_http1::split_request(r).0)
        .collect();
    assert_eq!(requests.len(), 1, "{requests:?}");
    assert!(requests[0].starts_with("GET /v1/models "), "{requests:?}");
    assert_eq!(
        proxy
            .counter("agentrace_requests_total{backend=\"none\",status=\"405\"}")
            .await,
        1
    );
    proxy.shutdown().await;
}
