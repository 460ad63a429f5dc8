//! HTTP/1.1 framing where RFC 9112 says MUST, through a real proxy and backend: raw bytes from a
//! `TcpStream` client, and the proxy's exact answer.
//!
//! Invariants: an HTTP/1.0 request with `Transfer-Encoding` (§6.1), and a coding list whose
//! last coding is not `chunked` (§6.3), get 400 and a closed connection; a coding under
//! `chunked` gets 501 and a closed connection; a request-target that is not origin-form,
//! absolute-form or `*` for `OPTIONS` gets 400; `CONNECT` gets 405 naming the allowed methods
//! (HTTP/2 too); none of these reaches a backend. A chunked request body without CRLF where
//! §7.1 puts it, or with more than 16 KiB of trailers, gets 400 and a closed connection as soon
//! as the fault is read; a backend's chunked response with either is cut and its connection
//! closed, never passed on whole.

mod support;

use bytes::Bytes;
use support::backends::*;
use support::raw_http1::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Sends each request on its own connection and checks it is refused with `status`, with
/// `connection: close`, and that the proxy then closes.
async fn assert_refused(proxy: &TestProxy, status: u16, cases: &[(&str, String)]) {
    for (what, request) in cases {
        let mut client = Client::connect(proxy.addr).await;
        client.send(request).await;
        let reply = client.reply().await;
        assert_eq!(reply.status, status, "{what}: {reply:?}");
        assert_eq!(
            reply.header("connection").as_deref(),
            Some("close"),
            "{what}"
        );
        assert_eq!(
            reply.json()["error"]["type"],
            "invalid_request_error",
            "{what}"
        );
        client.assert_closed().await;
    }
}

fn post_with(fields: &str, version: &str) -> String {
    format!(
        "POST /v1/chat/completions HTTP/{version}\r\nhost: proxy.test\r\n{fields}\r\n\
         3\r\nabc\r\n0\r\n\r\n"
    )
}

/// HTTP/1.0 has no transfer codings: a `Transfer-Encoding` there means faulty framing, with or
/// without a `Content-Length` beside it.
#[tokio::test]
async fn http10_with_transfer_encoding_gets_400_and_a_closed_connection() {
    let backend = TestBackend::spawn("b").await;
    let proxy = start_proxy(config_for(&[&backend])).await;
    let cases = [
        (
            "chunked",
            post_with("transfer-encoding: chunked\r\n", "1.0"),
        ),
        (
            "chunked and a length",
            post_with("transfer-encoding: chunked\r\ncontent-length: 3\r\n", "1.0"),
        ),
    ];
    assert_refused(&proxy, 400, &cases).await;
    assert_eq!(backend.hits(), 0, "a refused request reached the backend");
    proxy.shutdown().await;
}

/// A coding list whose last coding is not `chunked` leaves the body's length unknown: 400, not
/// 501, and the connection closes; so does `chunked` applied twice, or an empty list.
#[tokio::test]
async fn a_coding_list_not_ending_in_chunked_gets_400_and_a_closed_connection() {
    let backend = TestBackend::spawn("b").await;
    let proxy = start_proxy(config_for(&[&backend])).await;
    let cases: Vec<(&str, String)> = [
        ("gzip", "transfer-encoding: gzip\r\n"),
        ("identity", "transfer-encoding: identity\r\n"),
        ("chunked, gzip", "transfer-encoding: chunked, gzip\r\n"),
        (
            "gzip on a second line",
            "transfer-encoding: chunked\r\ntransfer-encoding: gzip\r\n",
        ),
        (
            "chunked, chunked",
            "transfer-encoding: chunked, chunked\r\n",
        ),
        ("an empty list", "transfer-encoding: \r\n"),
    ]
    .into_iter()
    .map(|(what, fields)| (what, post_with(fields, "1.1")))
    .collect();
    assert_refused(&proxy, 400, &cases).await;
    assert_eq!(backend.hits(), 0, "a refused request reached the backend");
    proxy.shutdown().await;
}

/// `gzip, chunked` is valid framing, but the coding under the chunks would be lost in the
/// length-framed copy the proxy sends on: 501, and the connection closes.
#[tokio::test]
async fn a_coding_under_chunked_gets_501_and_a_closed_connection() {
    let backend = TestBackend::spawn("b").await;
    let proxy = start_proxy(config_for(&[&backend])).await;
    let cases = [
        (
            "gzip, chunked",
            post_with("transfer-encoding: gzip, chunked\r\n", "1.1"),
        ),
        (
            "on two lines",
            post_with(
                "transfer-encoding: gzip\r\ntransfer-encoding: chunked\r\n",
                "1.1",
            ),
        ),
    ];
    assert_refused(&proxy, 501, &cases).await;
    assert_eq!(backend.hits(), 0, "a refused request reached the backend");
    proxy.shutdown().await;
}

/// Only origin-form, absolute-form (http or https, no userinfo) and `*` for `OPTIONS` are
/// forwarded; `GET a` used to reach the backend as `GET /`.
#[tokio::test]
async fn request_targets_of_no_allowed_form_get_400() {
    let backend = TestBackend::spawn("b").await;
    let proxy = start_proxy(config_for(&[&backend])).await;
    let cases: Vec<(&str, String)> = [
        ("a bare word", "GET a HTTP/1.1"),
        ("authority-form for GET", "GET proxy.test:80 HTTP/1.1"),
        ("* for GET", "GET * HTTP/1.1"),
        ("another scheme", "GET ftp://proxy.test/ HTTP/1.1"),
        ("userinfo", "GET http://user@proxy.test/ HTTP/1.1"),
    ]
    .into_iter()
    .map(|(what, line)| (what, format!("{line}\r\nhost: proxy.test\r\n\r\n")))
    .collect();
    assert_refused(&proxy, 400, &cases).await;
    assert_eq!(backend.hits(), 0, "a refused request reached the backend");
    // The allowed forms are forwarded.
    let mut client = Client::connect(proxy.addr).await;
    for (line, path) in [
        ("OPTIONS * HTTP/1.1", "*"),
        ("GET http://proxy.test/v1/models HTTP/1.1", "/v1/models"),
        ("GET /v1/models?x=1 HTTP/1.1", "/v1/models"),
    ] {
        client
            .send(format!("{line}\r\nhost: proxy.test\r\n\r\n"))
            .await;
        let reply = client.reply().await;
        assert_eq!(reply.status, 200, "{line}: {reply:?}");
        assert_eq!(reply.json()["path"], path, "{line}");
    }
    proxy.shutdown().await;
}

/// `CONNECT` asks for a tunnel the proxy does not open: 405 with `Allow`, and the connection
/// closes before anything sent after the head (a TLS hello) could be read as a request.
#[tokio::test]
async fn connect_gets_405_and_a_closed_connection() {
    let backend = TestBackend::spawn("b").await;
    let proxy = start_proxy(config_for(&[&backend])).await;
    let mut client = Client::connect(proxy.addr).await;
    client
        .send("CONNECT proxy.test:443 HTTP/1.1\r\nhost: proxy.test:443\r\n\r\n\x16\x03\x01")
        .await;
    let (status, head) = client.head().await;
    assert_eq!(status, 405, "{head}");
    let allow = header_in(&head, "allow").expect("a 405 names the allowed methods");
    assert!(
        allow.contains("POST") && !allow.contains("CONNECT"),
        "{allow}"
    );
    assert_eq!(header_in(&head, "connection").as_deref(), Some("close"));
    let length: usize = header_in(&head, "content-length").unwrap().parse().unwrap();
    client.take_exact(length).await;
    client.assert_closed().await;
    assert_eq!(backend.hits(), 0);
    proxy.shutdown().await;
}

/// The same over HTTP/2.
#[tokio::test]
async fn connect_over_http2_gets_405() {
    let backend = TestBackend::spawn("b").await;
    let proxy = start_proxy(config_for(&[&backend])).await;
    let mut send = h2_sender(proxy.addr).await;
    let request = http::Request::connect("proxy.test:443")
        .body(http_body_util::Empty::<Bytes>::new())
        .unwrap();
    let response = send.send_request(request).await.unwrap();
    assert_eq!(response.status(), 405);
    assert!(response.headers().contains_key("allow"));
    assert_eq!(backend.hits(), 0);
    proxy.shutdown().await;
}

const CHUNKED_POST: &str =
    "POST /v1/chat/completions HTTP/1.1\r\nhost: proxy.test\r\ntransfer-encoding: chunked\r\n\r\n";

/// A bare LF, a bare CR, or anything but CRLF after a chunk's data: 400 and close.
#[tokio::test]
async fn chunked_bodies_without_crlf_where_rfc_9112_puts_it_get_400() {
    let backend = TestBackend::spawn("b").await;
    let proxy = start_proxy(config_for(&[&backend])).await;
    let cases: Vec<(&str, String)> = [
        ("a bare LF after the size", "3\nabc\r\n0\r\n\r\n"),
        ("CR CR LF after the size", "3\r\r\nabc\r\n0\r\n\r\n"),
        ("a bare LF after the data", "3\r\nabc\n0\r\n\r\n"),
        ("bytes after the data", "3\r\nabcdef\r\n0\r\n\r\n"),
        ("a bare LF ending the body", "3\r\nabc\r\n0\r\n\n"),
        ("a bare LF after a trailer", "3\r\nabc\r\n0\r\nx-t: 1\n\r\n"),
    ]
    .into_iter()
    .map(|(what, body)| (what, format!("{CHUNKED_POST}{body}")))
    .collect();
    assert_refused(&proxy, 400, &cases).await;
    assert_eq!(backend.hits(), 0, "a refused request reached the backend");
    proxy.shutdown().await;
}

/// One 1 KiB trailer line, repeated.
fn trailer_line() -> String {
    format!(
        "x-trailer: {}\r\n",
        "v".repeat(1024 - "x-trailer: \r\n".len())
    )
}

/// 40 MB of trailers after a 1-byte body used to be read to their end and the request
/// forwarded. The trailers are bounded in all: the answer is 400 once 16 KiB have been read,
/// without waiting for the rest, and the connection closes.
#[tokio::test]
async fn forty_megabytes_of_trailers_get_400_within_the_limit() {
    let backend = TestBackend::spawn("b").await;
    let proxy = start_proxy(config_for(&[&backend])).await;
    let line = trailer_line();

    // 17 KiB of trailers and no end: the answer cannot have waited for more.
    let mut client = Client::connect(proxy.addr).await;
    client.send(format!("{CHUNKED_POST}1\r\na\r\n0\r\n")).await;
    client.send(line.repeat(17)).await;
    let reply = client.reply().await;
    assert_eq!(reply.status, 400, "{reply:?}");
    assert!(text(&reply.body).contains("trailers"), "{reply:?}");
    assert_eq!(reply.header("connection").as_deref(), Some("close"));
    client.assert_closed().await;

    // 40 MB with an end, written while the answer is read: refused the same.
    let stream = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let (mut read, mut write) = stream.into_split();
    let writer = tokio::spawn(async move {
        write
            .write_all(format!("{CHUNKED_POST}1\r\na\r\n0\r\n").as_bytes())
            .await?;
        let mib = line.repeat(1024);
        for _ in 0..40 {
            write.write_all(mib.as_bytes()).await?;
        }
        write.write_all(b"\r\n").await
    });
    let mut answer = Vec::new();
    guarded("the answer and the close", async {
        let mut chunk = [0u8; 4096];
        while let Ok(n @ 1..) = read.read(&mut chunk).await {
            answer.extend_from_slice(&chunk[..n]);
        }
    })
    .await;
    let answer = text(&answer);
    assert!(answer.starts_with("HTTP/1.1 400 "), "{answer}");
    // Whether the writer got everything into the socket before the close is up to the kernel.
    let _ = guarded("the writer", writer).await;
    assert_eq!(backend.hits(), 0, "a refused request reached the backend");
    proxy.shutdown().await;
}

/// A backend's chunked response with endless trailers or a bare LF is cut where the fault is
/// read: the client never sees the body's end, and the backend's connection is closed.
#[tokio::test]
async fn a_backends_malformed_chunking_cuts_the_response() {
    let head = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n\r\n";
    let forty_mb = trailer_line().repeat(40 * 1024);
    let cases: [(&str, Vec<&[u8]>); 2] = [
        (
            "40 MB of trailers",
            vec![&head[..], b"1\r\na\r\n0\r\n", forty_mb.as_bytes(), b"\r\n"],
        ),
        ("a bare LF", vec![&head[..], b"1\r\na\r\n0\n\r\n"]),
    ];
    for (what, reply) in cases {
        let mut backend = RawBackend::spawn(&reply, After::KeepServing).await;
        let proxy = start_proxy(config_over(&[("raw", backend.url())])).await;
        let mut client = Client::connect(proxy.addr).await;
        client.send(get("/v1/models")).await;
        let (status, _) = client.head().await;
        assert_eq!(status, 200, "{what}");
        let rest = client.rest_until_eof().await;
        assert!(
            !text(&rest).ends_with("0\r\n\r\n"),
            "{what}: the body was passed on whole: {:?}",
            text(&rest[rest.len().saturating_sub(64)..])
        );
        backend.wait_closed().await;
        proxy.shutdown().await;
    }
}
