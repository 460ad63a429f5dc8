//! The request bodies all clients send at once are bounded together, not only one by one.
//!
//! Invariants, on HTTP/1.1 and on HTTP/2: a body is counted against
//! `request_body_budget_bytes` as the parts holding its bytes are allocated, never as its
//! `Content-Length` declares it; a large body that would take the bytes held past the budget gets 503 with
//! `Retry-After` (on HTTP/1.1 the connection then closes, as the rest of the body is unread)
//! and never reaches a backend; small requests are served while the budget is full; a body is
//! given back once its request has been forwarded, and the refused request then succeeds.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::body::Frame;
use support::backends::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const KIB: usize = 1024;
/// Budget and body limit of the proxies under test.
const BUDGET: usize = 1024 * KIB;

fn budget_config(backend: &TestBackend) -> agentrace::proxy::ProxyConfig {
    let mut config = config_for(&[backend]);
    config.max_request_body_bytes = BUDGET as u64;
    config.request_body_budget_bytes = BUDGET as u64;
    config
}

/// Waits (up to 10 s) until the proxy holds exactly `bytes` of request bodies.
async fn wait_held(proxy: &TestProxy, bytes: usize) {
    wait_held_within(proxy, bytes, bytes).await;
}

/// Waits (up to 10 s) until the proxy holds at least `sent` bytes of request bodies, and
/// checks that it holds no more than `most`: a body is charged for the parts it has
/// allocated, at most one part ahead of the bytes received.
async fn wait_held_within(proxy: &TestProxy, sent: usize, most: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let held = series_value(&proxy.metrics().await, "agentrace_request_body_bytes_held");
        assert!(
            held <= most as u64,
            "the proxy holds {held} body bytes, at most {most} expected"
        );
        if held >= sent as u64 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the proxy holds {held} body bytes, expected at least {sent}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

// -------------------------------------------------------------------------------------------
// HTTP/1.1, raw

fn head(length: usize) -> String {
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: proxy\r\ncontent-type: application/json\r\n\
         content-length: {length}\r\n\r\n"
    )
}

/// A response read off the wire: status, head text, body.
async fn read_response(stream: &mut TcpStream) -> (u16, String, Vec<u8>) {
    let read = async {
        let mut got = Vec::new();
        let end = loop {
            if let Some(i) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let mut buf = [0u8; 4096];
            let n = stream.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed before a response head");
            got.extend_from_slice(&buf[..n]);
        };
        let head = String::from_utf8_lossy(&got[..end]).to_lowercase();
        let status = head[9..12].parse().unwrap();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .map_or(0, |v| v.trim().parse().unwrap());
        let mut body = got[end..].to_vec();
        while body.len() < length {
            let mut buf = [0u8; 4096];
            let n = stream.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed within a response body");
            body.extend_from_slice(&buf[..n]);
        }
        (status, head, body)
    };
    tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .expect("a response within 10 s")
}

async fn post_whole(addr: SocketAddr, length: usize) -> (u16, String, TcpStream) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(head(length).as_bytes()).await.unwrap();
    // The proxy may answer and close before taking all of it.
    let _ = stream.write_all(&vec![b' '; length]).await;
    let (status, head, _) = read_response(&mut stream).await;
    (status, head, stream)
}

#[tokio::test]
async fn http1_bodies_held_at_once_stay_within_the_budget() {
    let a = TestBackend::spawn("a").await;
    let proxy = start_proxy(budget_config(&a)).await;

    // A large upload, three quarters sent: counted as it arrived, not as declared.
    let mut large = TcpStream::connect(proxy.addr).await.unwrap();
    large.write_all(head(BUDGET).as_bytes()).await.unwrap();
    large.write_all(&vec![b' '; BUDGET * 3 / 4]).await.unwrap();
    // Parts of 64 KiB doubling: 960 KiB allocated for 768 KiB, less than the 1 MiB declared.
    wait_held_within(&proxy, BUDGET * 3 / 4, BUDGET - 64 * KIB).await;

    // A second large body does not fit beside it: 503, Retry-After, closed, no backend.
    let (status, head, mut refused) = post_whole(proxy.addr, BUDGET / 2).await;
    assert_eq!(status, 503, "{head}");
    assert!(head.contains("retry-after: 1\r\n"), "{head}");
    assert!(head.contains("connection: close\r\n"), "{head}");
    refused.shutdown().await.unwrap();
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(10), refused.read_to_end(&mut rest));
    assert!(matches!(closed.await, Ok(Ok(0))), "closed after the 503");
    assert_eq!(a.hits(), 0);
    let metrics = proxy.metrics().await;
    assert_eq!(
        series_value(&metrics, "agentrace_body_budget_refusals_total"),
        1
    );
    assert!(series_value(&metrics, "agentrace_request_body_bytes_held") <= BUDGET as u64);

    // A small request is served meanwhile.
    let small = fetch(
        &client(),
        "POST",
        &proxy.url("/v1/chat/completions"),
        &[("x-session-id", "small")],
        vec![b' '; 4 * KIB],
    )
    .await;
    assert_eq!(small.0, 200);

    // The large upload completes and is forwarded whole; its bytes are then given back.
    large.write_all(&vec![b' '; BUDGET / 4]).await.unwrap();
    let (status, _, body) = read_response(&mut large).await;
    assert_eq!(status, 200);
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(json["request_bytes"], BUDGET);
    wait_held(&proxy, 0).await;

    // The refused body now fits.
    let (status, head, _) = post_whole(proxy.addr, BUDGET / 2).await;
    assert_eq!(status, 200, "{head}");
    proxy.shutdown().await;
}

// -------------------------------------------------------------------------------------------
// HTTP/2 (h2c)

type H2Sender = hyper::client::conn::http2::SendRequest<BoxBody<Bytes, BoxError>>;

fn h2_request(body: BoxBody<Bytes, BoxError>) -> http::Request<BoxBody<Bytes, BoxError>> {
    http::Request::post("http://proxy/v1/chat/completions")
        .body(body)
        .unwrap()
}

fn whole(length: usize) -> BoxBody<Bytes, BoxError> {
    Full::new(Bytes::from(vec![b' '; length]))
        .map_err(|e| match e {})
        .boxed()
}

async fn h2_status(send: &mut H2Sender, length: usize) -> http::Response<hyper::body::Incoming> {
    let resp = send.send_request(h2_request(whole(length)));
    tokio::time::timeout(Duration::from_secs(10), resp)
        .await
        .expect("a response within 10 s")
        .unwrap()
}

#[tokio::test]
async fn http2_bodies_held_at_once_stay_within_the_budget() {
    let a = TestBackend::spawn("a").await;
    let proxy = start_proxy(budget_config(&a)).await;
    let mut send = h2_sender(proxy.addr).await;

    // A large upload, three quarters sent in 16 KiB frames, on one stream of the connection.
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(1);
    let stream =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|f| (f, rx)) });
    let large =
        tokio::spawn(send.send_request(h2_request(BodyExt::boxed(StreamBody::new(stream)))));
    let frame = || Ok(Frame::data(Bytes::from(vec![b' '; 16 * KIB])));
    for _ in 0..(BUDGET * 3 / 4) / (16 * KIB) {
        tx.send(frame()).await.unwrap();
    }
    // Parts of 64 KiB doubling: 960 KiB allocated for 768 KiB, less than the 1 MiB declared.
    wait_held_within(&proxy, BUDGET * 3 / 4, BUDGET - 64 * KIB).await;

    // A second large body on another stream does not fit beside it: 503 with Retry-After.
    let refused = h2_status(&mut send, BUDGET / 2).await;
    assert_eq!(refused.status(), 503);
    assert_eq!(refused.headers()["retry-after"], "1");
    assert_eq!(a.hits(), 0);
    let metrics = proxy.metrics().await;
    assert_eq!(
        series_value(&metrics, "agentrace_body_budget_refusals_total"),
        1
    );
    assert!(series_value(&metrics, "agentrace_request_body_bytes_held") <= BUDGET as u64);

    // A small request on the same connection is served meanwhile.
    assert_eq!(h2_status(&mut send, 4 * KIB).await.status(), 200);

    // The large upload completes and is forwarded whole; its bytes are then given back.
    for _ in 0..(BUDGET / 4) / (16 * KIB) {
        tx.send(frame()).await.unwrap();
    }
    drop(tx);
    let resp = tokio::time::timeout(Duration::from_secs(10), large)
        .await
        .expect("a response within 10 s")
        .unwrap()
        .unwrap();
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(json["request_bytes"], BUDGET);
    wait_held(&proxy, 0).await;

    // The refused body now fits.
    assert_eq!(h2_status(&mut send, BUDGET / 2).await.status(), 200);
    proxy.shutdown().await;
}

// -------------------------------------------------------------------------------------------
// Large bodies are held in parts and still arrive whole

/// A chat body of `conversation` padded past `len` bytes with a later tool result, so it is
/// held in several parts; its fingerprint is the conversation's.
fn large_chat_body(conversation: &str, len: usize) -> Vec<u8> {
    let mut v: serde_json::Value = serde_json::from_str(&chat_body(conversation, 1)).unwrap();
    let pad: String = (0..len).map(|i| (b'a' + (i % 26) as u8) as char).collect();
    v["messages"][3]["content"] = serde_json::Value::String(pad);
    serde_json::to_vec(&v).unwrap()
}

#[tokio::test]
async fn large_bodies_reach_the_backend_byte_for_byte_and_keep_their_conversation() {
    let backends = [
        TestBackend::spawn("a").await,
        TestBackend::spawn("b").await,
        TestBackend::spawn("c").await,
        TestBackend::spawn("d").await,
    ];
    let mut config = config_for(&backends.iter().collect::<Vec<_>>());
    config.max_request_body_bytes = 8 << 20;
    let proxy = start_proxy(config).await;
    let http = client();
    let mut h2 = h2_sender::<BoxBody<Bytes, BoxError>>(proxy.addr).await;
    let url = proxy.url("/v1/chat/completions");
    let check = |status: u16, body: &[u8], sent: &[u8], how: &str| {
        assert_eq!(status, 200, "{how}");
        let json: serde_json::Value = serde_json::from_slice(body).unwrap();
        assert_eq!(json["request_bytes"], sent.len(), "{how}");
        assert_eq!(json["request_digest"], body_digest(sent), "{how}");
        json["backend"].as_str().unwrap().to_string()
    };
    for conversation in ["c1", "c2", "c3", "c4", "c5", "c6"] {
        // The first turn, small and in one part, places the conversation.
        let (status, headers, _) =
            fetch(&http, "POST", &url, &[], chat_body(conversation, 0)).await;
        assert_eq!(status, 200);
        let home = served_by(&headers);
        let large = large_chat_body(conversation, 3 << 20);

        // HTTP/1.1 with a Content-Length, sent in many writes.
        let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
        stream
            .write_all(head(large.len()).as_bytes())
            .await
            .unwrap();
        for piece in large.chunks(100_000) {
            stream.write_all(piece).await.unwrap();
        }
        let (status, _, body) = read_response(&mut stream).await;
        assert_eq!(check(status, &body, &large, "content-length"), home);

        // HTTP/1.1 chunked, through hyper's client.
        let chunks: Vec<Result<Frame<Bytes>, BoxError>> = large
            .chunks(70_000)
            .map(|c| Ok(Frame::data(Bytes::copy_from_slice(c))))
            .collect();
        let req = http::Request::post(&url)
            .header("content-type", "application/json")
            .body(BodyExt::boxed(StreamBody::new(futures_util::stream::iter(
                chunks,
            ))))
            .unwrap();
        let chunked =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<BoxBody<Bytes, BoxError>>();
        let resp = chunked.request(req).await.unwrap();
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(check(status, &body, &large, "chunked"), home);

        // HTTP/2, in 16 KiB frames.
        let frames: Vec<Result<Frame<Bytes>, BoxError>> = large
            .chunks(16 * KIB)
            .map(|c| Ok(Frame::data(Bytes::copy_from_slice(c))))
            .collect();
        let resp = h2
            .send_request(h2_request(BodyExt::boxed(StreamBody::new(
                futures_util::stream::iter(frames),
            ))))
            .await
            .unwrap();
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(check(status, &body, &large, "h2"), home);
    }
    // The copies made to fingerprint large bodies were given back.
    wait_held(&proxy, 0).await;
    proxy.shutdown().await;
}

// -------------------------------------------------------------------------------------------
// The binary's allocator

/// Once a large body has been forwarded its memory leaves the process at once, not a second
/// later: the binary's allocator purges freed memory without delay (mimalloc's default
/// keeps it for 1 s, so a burst of uploads would hold the budget's worth of memory after
/// the budget was given back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarded_body_leaves_the_process_memory_at_once() {
    use support::proxy_process::ProxyProcess;
    use support::raw_http1::Client;
    const BODY: usize = 48 * 1024 * KIB;
    let backend = TestBackend::spawn("a").await;
    let proxy = ProxyProcess::spawn(&["--backend", &backend.url()]).await;
    let addr: SocketAddr = proxy.addr.parse().unwrap();
    let mut client = Client::connect(addr).await;
    let small = support::backends::chat_body("warm", 0);
    let small_request = format!("{}{small}", head(small.len()));
    client.send(&small_request).await;
    assert_eq!(client.reply().await.status, 200);
    let before = proxy.rss_kib();

    client.send(head(BODY)).await;
    let filler = vec![b' '; 1024 * KIB];
    for _ in 0..BODY / filler.len() - 1 {
        client.send(&filler).await;
    }
    client.send(&filler[..filler.len() - small.len()]).await;
    client.send(&small).await;
    let big = client.reply().await;
    assert_eq!(big.status, 200, "{}", big.head);
    assert_eq!(big.json()["request_bytes"], BODY);
    // The next request on the connection starts only once the big one is done with.
    client.send(&small_request).await;
    assert_eq!(client.reply().await.status, 200);
    let after = proxy.rss_kib();
    assert!(
        after < before + (BODY / KIB / 4) as u64,
        "RSS {before} KiB before a {} MiB body, {after} KiB after it was forwarded",
        BODY / (1024 * KIB)
    );
}

/// The binary holds bodies in small pages: with transparent huge pages the first byte read
/// into a part made the kernel zero 2 MiB at once on the worker serving every other
/// connection, and freed memory went back only in 2 MiB pieces.
#[tokio::test]
async fn the_proxy_process_opts_out_of_transparent_huge_pages() {
    use support::proxy_process::ProxyProcess;
    let backend = TestBackend::spawn("a").await;
    let proxy = ProxyProcess::spawn(&["--backend", &backend.url()]).await;
    let status = std::fs::read_to_string(format!("/proc/{}/status", proxy.pid)).unwrap();
    let Some(thp) = status.lines().find_map(|l| l.strip_prefix("THP_enabled:")) else {
        support::skip(
            "the_proxy_process_opts_out_of_transparent_huge_pages",
            "this kernel's /proc/PID/status has no THP_enabled line",
        );
        return;
    };
    assert_eq!(thp.trim(), "0", "THP_enabled of the proxy process");
}
