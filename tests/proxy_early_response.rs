//! A backend's final answer before it has read the request body, over real sockets.
//!
//! Invariant: a backend that answers (401, 413) before reading a large body, then closes or
//! simply stops reading, has its answer forwarded to the client, over HTTP/1.1 and HTTP/2
//! ingress, rather than a 502 for the reset that follows its close or a wait for a write that
//! can never finish (RFC 9110 §15.5, RFC 9112 §9.6).

mod support;

use std::time::Duration;

use agentrace::proxy::ProxyConfig;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use support::backends::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

const BODY_BYTES: usize = 32 * 1024 * 1024;

/// What the backend does once it has answered.
#[derive(Clone, Copy)]
enum After {
    /// Closes at once, the body unread (its kernel then resets the connection).
    Close,
    /// Keeps the connection open and reads nothing more.
    StopReading,
}

/// A backend that reads each request's head only, answers `status` with a small JSON body,
/// and then does `after`. Returns its URL.
async fn early_answering_backend(status: &'static str, after: After) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let mut held = Vec::new();
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
                return;
            };
            let mut head = Vec::new();
            let mut chunk = [0u8; 4096];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                match conn.read(&mut chunk).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => head.extend_from_slice(&chunk[..n]),
                }
            }
            let body = format!("{{\"error\":{{\"message\":\"{status}\"}}}}");
            let reply = format!(
                "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = conn.write_all(reply.as_bytes()).await;
            match after {
                After::Close => drop(conn),
                After::StopReading => held.push(conn),
            }
        }
    });
    url
}

fn config_to(url: &str) -> ProxyConfig {
    ProxyConfig::from_toml_str(&format!(
        "listen = \"127.0.0.1:0\"\n[admin]\nlisten = \"127.0.0.1:0\"\n[health]\ninterval_ms = 0\n\
         [upstream]\nretries = 0\n[[backends]]\nname = \"early\"\nurl = \"{url}\"\n"
    ))
    .unwrap()
}

async fn post_h1(proxy: &TestProxy) -> (http::StatusCode, Bytes) {
    let (status, _, body) = fetch(
        &client(),
        "POST",
        &proxy.url("/v1/uploads"),
        &[("content-type", "application/octet-stream")],
        vec![b'x'; BODY_BYTES],
    )
    .await;
    (status, body)
}

async fn post_h2(proxy: &TestProxy) -> (http::StatusCode, Bytes) {
    let mut send = h2_sender::<Full<Bytes>>(proxy.addr).await;
    let req = http::Request::post(proxy.url("/v1/uploads"))
        .body(Full::new(Bytes::from(vec![b'x'; BODY_BYTES])))
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    let status = resp.status();
    (status, resp.into_body().collect().await.unwrap().to_bytes())
}

/// Bounds each exchange, so a proxy that waits on a write that cannot finish fails the test.
async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(30), f)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within 30 s"))
}

/// An early 413 from a backend that then closes reaches the client as that 413.
#[tokio::test]
async fn an_early_answer_before_a_close_is_forwarded_not_turned_into_502() {
    let url = early_answering_backend("413 Payload Too Large", After::Close).await;
    let proxy = start_proxy(config_to(&url)).await;
    for (ingress, (status, body)) in [
        ("HTTP/1.1", within("HTTP/1.1", post_h1(&proxy)).await),
        ("HTTP/2", within("HTTP/2", post_h2(&proxy)).await),
    ] {
        assert_eq!(status, 413, "{ingress}: {}", String::from_utf8_lossy(&body));
        assert!(body.starts_with(b"{\"error\""), "{ingress}: {body:?}");
    }
    proxy.shutdown().await;
}

/// An early 401 from a backend that keeps the connection but reads no more reaches the
/// client as that 401, without waiting for the rest of the body to be taken.
#[tokio::test]
async fn an_early_answer_from_a_backend_that_stops_reading_is_forwarded() {
    let url = early_answering_backend("401 Unauthorized", After::StopReading).await;
    let proxy = start_proxy(config_to(&url)).await;
    for (ingress, (status, body)) in [
        ("HTTP/1.1", within("HTTP/1.1", post_h1(&proxy)).await),
        ("HTTP/2", within("HTTP/2", post_h2(&proxy)).await),
    ] {
        assert_eq!(status, 401, "{ingress}: {}", String::from_utf8_lossy(&body));
    }
    proxy.shutdown().await;
}
