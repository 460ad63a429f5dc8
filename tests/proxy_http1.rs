//! HTTP/1.1 on the wire through a real proxy: raw bytes from a `TcpStream` client, real
//! backends behind it (the support module's hyper backends, and the raw-TCP ones of
//! `support::raw_http1` that write fixed bytes for framings hyper would never produce).
//!
//! Invariants: a request body arrives at the backend whole and with a `Content-Length`, however
//! the client framed it; `Expect: 100-continue` is answered before the body is sent (and not
//! for a body over the limit); pipelined requests are answered in order; HTTP/1.0 clients get
//! delimited responses and keep their connection only when they ask; HEAD responses carry no
//! body; ambiguous or malformed heads get 400 (oversized ones 431) and a closed connection, and
//! never reach a backend; chunked, close-delimited, HTTP/1.0 and 1xx-preceded upstream
//! responses are re-framed for the client, whose connection stays reusable, and another
//! transfer coding gets 502 instead of reaching the client as coded bytes; a truncated
//! upstream body is never passed off as complete; a pooled upstream connection that the
//! backend closed is replaced on the same backend instead of failing over, and a backend that
//! closes after each streamed response is learned (by watching, or from the first request its
//! close crosses) and not reused after one; a request that reached its backend whole is sent
//! again only when safe or allowed, one that provably did not (a reset with it unread) is; a
//! backend's interim responses are capped, and a client that hangs up during them cancels the
//! request; `Connection: close` from the client closes after the response; a client that sends
//! nothing, stalls in a head or a body, or idles past the idle timeout is closed (with 408 when a request was under way),
//! while a backend may take longer than every client time limit.

mod support;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use support::backends::*;
use support::raw_http1::*;

/// A session key whose next request the proxy would send to `backend` (asked of the admin
/// API, which routes without committing).
async fn key_routed_to(proxy: &TestProxy, backend: &str) -> String {
    let client = client();
    for i in 0..512 {
        let key = format!("session-{i}");
        let url = proxy.admin_url(&format!("/admin/sessions/{key}"));
        let (status, _, body) = fetch(&client, "GET", &url, &[], "").await;
        assert_eq!(status, 200);
        let view: serde_json::Value = serde_json::from_slice(&body).unwrap();
        if view["next_request"]["backend"] == backend {
            return key;
        }
    }
    panic!("no key routes to {backend}");
}

// -------------------------------------------------------------------------------------------
// Request framing

/// A chunked request (a chunk extension, a trailer) reaches the backend de-chunked, with a
/// `Content-Length`, and without the hop-by-hop framing headers or the trailer.
#[tokio::test]
async fn chunked_request_bodies_reach_the_backend_whole() {
    let backend = RawBackend::spawn(
        &[b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"],
        After::KeepServing,
    )
    .await;
    let proxy = start_proxy(config_over(&[("raw", backend.url())])).await;
    let mut client = Client::connect(proxy.addr).await;
    client
        .send(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: proxy.test\r\n\
             transfer-encoding: chunked\r\ntrailer: x-checksum\r\n\r\n\
             7;name=value\r\n{\"a\":\"b\r\n\
             c\r\nc\",\"n\":12345\r\n\
             1\r\n}\r\n\
             0\r\nx-checksum: abc\r\n\r\n",
        )
        .await;
    let reply = client.reply().await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.body, b"ok");
    let requests = backend.requests();
    assert_eq!(requests.len(), 1);
    let (head, body) = split_request(&requests[0]);
    assert_eq!(text(&body), "{\"a\":\"bc\",\"n\":12345}");
    assert_eq!(header_in(&head, "content-length").as_deref(), Some("20"));
    for gone in ["transfer-encoding", "trailer", "x-checksum"] {
        assert_eq!(header_in(&head, gone), None, "{gone} forwarded: {head}");
    }
    // The next request on the connection starts right after the trailer section.
    client.send(get("/after")).await;
    assert_eq!(client.reply().await.body, b"ok");
    assert_eq!(backend.answered(), 2);
    proxy.shutdown().await;
}

/// `Expect: 100-continue`: the interim `100 Continue` comes before the client sends the body
/// (length-delimited or chunked), then the final response; the backend sees the whole body and
/// no `Expect`.
#[tokio::test]
async fn expect_continue_is_answered_before_the_body_is_sent() {
    let backend = TestBackend::spawn("b").await;
    let proxy = start_proxy(config_for(&[&backend])).await;
    let mut client = Client::connect(proxy.addr).await;
    client
        .send(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: proxy.test\r\n\
             expect: 100-continue\r\ncontent-length: 11\r\n\r\n",
        )
        .await;
    assert_eq!(
        client.take_through(b"\r\n\r\n").await,
        b"HTTP/1.1 100 Continue\r\n\r\n"
    );
    assert_eq!(backend.hits(), 0, "nothing is forwarded before the body");
    client.send("hello world").await;
    let reply = client.reply().await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.json()["request_bytes"], 11);
    assert!(!backend.last_headers().unwrap().contains_key("expect"));

    client
        .send(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: proxy.test\r\n\
             expect: 100-continue\r\ntransfer-encoding: chunked\r\n\r\n",
        )
        .await;
    assert_eq!(
        client.take_through(b"\r\n\r\n").await,
        b"HTTP/1.1 100 Continue\r\n\r\n"
    );
    client.send("3\r\nabc\r\n0\r\n\r\n").await;
    let reply = client.reply().await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.json()["request_bytes"], 3);
    assert_eq!(backend.hits(), 2);
    proxy.shutdown().await;
}

/// A body declared over `max_request_body_bytes` gets its 413 at once: no `100 Continue`
/// invites the client to send it, and the backend never sees the request.
#[tokio::test]
async fn expect_continue_is_withheld_from_a_body_over_the_limit() {
    let backend = TestBackend::spawn("b").await;
    let mut config = config_for(&[&backend]);
    config.max_request_body_bytes = 1024;
    let proxy = start_proxy(config).await;
    let mut client = Client::connect(proxy.addr).await;
    client
        .send(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: proxy.test\r\n\
             expect: 100-continue\r\ncontent-length: 4096\r\n\r\n",
        )
        .await;
    let reply = client.reply().await;
    assert_eq!(reply.status, 413, "{reply:?}");
    assert_eq!(reply.header("connection").as_deref(), Some("close"));
    client.assert_closed().await;
    assert_eq!(backend.hits(), 0);
    // Ends the proxy's wait for the body it refused.
    drop(client);
    proxy.shutdown().await;
}

/// Requests written back to back in one write (length-delimited, chunked, bodiless) are each
/// answered, in order, on the same connection.
#[tokio::test]
async fn pipelined_requests_get_their_responses_in_order() {
    let backend = TestBackend::spawn("b").await;
    let proxy = start_proxy(config_for(&[&backend])).await;
    let mut client = Client::connect(proxy.addr).await;
    client
        .send(
            "POST /v1/first HTTP/1.1\r\nhost: proxy.test\r\ncontent-length: 5\r\n\r\nfirst\
             POST /v1/second HTTP/1.1\r\nhost: proxy.test\r\ntransfer-encoding: chunked\r\n\r\n\
             6\r\nsecond\r\n0\r\n\r\n\
             GET /v1/third HTTP/1.1\r\nhost: proxy.test\r\n\r\n",
        )
        .await;
    for (path, bytes) in [("/v1/first", 5), ("/v1/second", 6), ("/v1/third", 0)] {
        let reply = client.reply().await;
        assert_eq!(reply.status, 200, "{reply:?}");
        let json = reply.json();
        assert_eq!(json["path"], path, "responses out of order: {json}");
        assert_eq!(json["request_bytes"], bytes, "{json}");
        assert_eq!(reply.header("connection"), None);
    }
    assert_eq!(backend.hits(), 3);
    proxy.shutdown().await;
}

// -------------------------------------------------------------------------------------------
// HTTP/1.0 clients, HEAD, Connection: close

/// An HTTP/1.0 request without keep-alive: the response is delimited by its length and says
/// `connection: close`, and the proxy closes the connection after it.
#[tokio::test]
async fn http10_clients_get_a_delimited_response_and_a_closed_connection() {
    let backend = TestBackend::spawn("b").await;
    let proxy = start_proxy(config_for(&[&backend])).await;
    let mut client = Client::connect(proxy.addr).await;
    client.send("GET /v1/models HTTP/1.0\r\n\r\n").await;
    let reply = client.reply().await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert!(reply.header("content-length").is_some(), "{reply:?}");
    assert_eq!(reply.header("transfer-encoding"), None);
    assert_eq!(reply.header("connection").as_deref(), Some("close"));
    assert_eq!(reply.json()["path"], "/v1/models");
    client.assert_closed().await;
    proxy.shutdown().await;
}

/// An HTTP/1.0 request with `Connection: keep-alive` gets `connection: keep-alive` back and
/// a connection that serves the next request.
#[tokio::test]
async fn http10_keep_alive_clients_keep_their_connection() {
    let backend = TestBackend::spawn("b").await;
    let proxy = start_proxy(config_for(&[&backend])).await;
    let mut client = Client::connect(proxy.addr).await;
    for path in ["/v1/one", "/v1/two"] {
        client
            .send(format!(
                "GET {path} HTTP/1.0\r\nconnection: keep-alive\r\n\r\n"
            ))
            .await;
        let reply = client.reply().await;
        assert_eq!(reply.status, 200, "{reply:?}");
        assert_eq!(reply.header("connection").as_deref(), Some("keep-alive"));
        assert!(reply.header("content-length").is_some(), "{reply:?}");
        assert_eq!(reply.json()["path"], path);
    }
    client.send("GET /v1/three HTTP/1.0\r\n\r\n").await;
    assert_eq!(client.reply().await.json()["path"], "/v1/three");
    client.assert_closed().await;
    assert_eq!(backend.hits(), 3);
    proxy.shutdown().await;
}

/// An HTTP/1.0 client cannot take chunks: a body of unknown length (a chunked upstream) is
/// sent bare and delimited by the close, even when the client asked for keep-alive.
#[tokio::test]
async fn http10_clients_get_bodies_of_unknown_length_delimited_by_close() {
    let backend = RawBackend::spawn(
        &[b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"],
        After::KeepServing,
    )
    .await;
    let proxy = start_proxy(config_over(&[("raw", backend.url())])).await;
    let mut client = Client::connect(proxy.addr).await;
    client
        .send("GET /stream HTTP/1.0\r\nconnection: keep-alive\r\n\r\n")
        .await;
    let reply = client.reply().await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.header("transfer-encoding"), None);
    assert_eq!(reply.header("content-length"), None);
    assert_eq!(reply.header("connection").as_deref(), Some("close"));
    assert_eq!(reply.body, b"hello world", "read until the close");
    proxy.shutdown().await;
}

/// HEAD gets the backend's headers and no body bytes; the next request on the connection is
/// answered right after the head.
#[tokio::test]
async fn head_responses_carry_headers_but_no_body() {
    let backend = TestBackend::spawn("b").await;
    let proxy = start_proxy(config_for(&[&backend])).await;
    let mut client = Client::connect(proxy.addr).await;
    client
        .send("HEAD /v1/models HTTP/1.1\r\nhost: proxy.test\r\n\r\n")
        .await;
    let reply = client.reply_to(true).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.header("x-backend").as_deref(), Some("b"));
    assert_eq!(
        reply.header("content-type").as_deref(),
        Some("application/json")
    );
    client.send(get("/v1/next")).await;
    // Any body byte after the HEAD response would come before this status line.
    let next = client.reply().await;
    assert_eq!(next.status, 200, "{next:?}");
    assert_eq!(next.json()["path"], "/v1/next");
    assert_eq!(backend.hits(), 2);
    proxy.shutdown().await;
}

/// `Connection: close` from the client: the response says `connection: close`, the proxy
/// closes after it, and a request pipelined behind it is not served.
#[tokio::test]
async fn connection_close_from_the_client_closes_after_the_response() {
    let backend = TestBackend::spawn("b").await;
    let proxy = start_proxy(config_for(&[&backend])).await;
    let mut client = Client::connect(proxy.addr).await;
    client
        .send(format!(
            "GET /v1/last HTTP/1.1\r\nhost: proxy.test\r\nconnection: close\r\n\r\n{}",
            get("/v1/never")
        ))
        .await;
    let reply = client.reply().await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.header("connection").as_deref(), Some("close"));
    assert_eq!(reply.json()["path"], "/v1/last");
    client.assert_closed().await;
    assert_eq!(backend.hits(), 1);
    let forwarded = backend.last_headers().unwrap();
    assert!(
        !forwarded.contains_key("connection"),
        "hop-by-hop forwarded: {forwarded:?}"
    );
    proxy.shutdown().await;
}

// -------------------------------------------------------------------------------------------
// Refused requests

/// Framing a proxy and a backend could read differently (both `Content-Length` and
/// `Transfer-Encoding`, disagreeing lengths, a bad chunk) and heads that do not parse get 400
/// with `connection: close`, and the connection closes (a coding under the chunks, 501); none
/// reaches the backend.
#[tokio::test]
async fn ambiguous_or_malformed_requests_get_400_and_a_closed_connection() {
    let backend = TestBackend::spawn("b").await;
    let proxy = start_proxy(config_for(&[&backend])).await;
    let cases: [(&str, &str); 8] = [
        (
            "content-length and transfer-encoding",
            "POST /v1/chat/completions HTTP/1.1\r\nhost: proxy.test\r\ncontent-length: 5\r\n\
             transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        ),
        (
            "two content-length fields",
            "POST /v1/chat/completions HTTP/1.1\r\nhost: proxy.test\r\ncontent-length: 5\r\n\
             content-length: 6\r\n\r\nhello!",
        ),
        (
            "a content-length list",
            "POST /v1/chat/completions HTTP/1.1\r\nhost: proxy.test\r\ncontent-length: 5, 6\r\n\r\nhello!",
        ),
        (
            "a malformed chunk size",
            "POST /v1/chat/completions HTTP/1.1\r\nhost: proxy.test\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
        ),
        ("a garbage request line", "THIS IS NOT HTTP\r\n\r\n"),
        ("no host", "GET /nohost HTTP/1.1\r\n\r\n"),
        (
            "two hosts",
            "GET /twohosts HTTP/1.1\r\nhost: a\r\nhost: b\r\n\r\n",
        ),
        (
            "a space before the colon",
            "GET / HTTP/1.1\r\nhost : proxy.test\r\n\r\n",
        ),
    ];
    for (what, request) in cases {
        let mut client = Client::connect(proxy.addr).await;
        client.send(request).await;
        let reply = client.reply().await;
        assert_eq!(reply.status, 400, "{what}: {reply:?}");
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
    // A coding under the chunks, which the proxy does not decode, would be lost: 501.
    for coded in ["gzip, chunked"] {
        let mut client = Client::connect(proxy.addr).await;
        client
            .send(format!(
                "POST /v1/chat/completions HTTP/1.1\r\nhost: proxy.test\r\n\
                 transfer-encoding: {coded}\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
            ))
            .await;
        let reply = client.reply().await;
        assert_eq!(reply.status, 501, "{coded}: {reply:?}");
        client.assert_closed().await;
    }
    assert_eq!(backend.hits(), 0, "a refused request reached the backend");
    proxy.shutdown().await;
}

/// A head that grows past 64 KiB without ending, a 1 MiB head, or one with more header fields
/// than the proxy holds gets 431 and a closed connection, and never reaches the backend.
#[tokio::test]
async fn oversized_heads_get_431_and_a_closed_connection() {
    let backend = TestBackend::spawn("b").await;
    let proxy = start_proxy(config_for(&[&backend])).await;
    let unended = format!(
        "GET / HTTP/1.1\r\nhost: proxy.test\r\nx-big: {}",
        "a".repeat(70 * 1024)
    );
    let huge = format!(
        "GET / HTTP/1.1\r\nhost: proxy.test\r\nx-big: {}\r\n\r\n",
        "a".repeat(1024 * 1024)
    );
    let mut many = String::from("GET / HTTP/1.1\r\nhost: proxy.test\r\n");
    for i in 0..200 {
        many.push_str(&format!("x-field-{i}: {i}\r\n"));
    }
    many.push_str("\r\n");
    let complete = format!(
        "GET / HTTP/1.1\r\nhost: proxy.test\r\nx-big: {}\r\n\r\n",
        "a".repeat(70 * 1024)
    );
    let cases = [
        ("a 70 KiB head still going", unended),
        ("a complete 70 KiB head", complete),
        ("a 1 MiB head", huge),
        ("200 header fields", many),
    ];
    for (what, request) in cases {
        let mut client = Client::connect(proxy.addr).await;
        client.send(request).await;
        let reply = client.reply().await;
        assert_eq!(reply.status, 431, "{what}: {reply:?}");
        assert_eq!(
            reply.header("connection").as_deref(),
            Some("close"),
            "{what}"
        );
        client.assert_closed().await;
    }
    assert_eq!(backend.hits(), 0);
    proxy.shutdown().await;
}

// -------------------------------------------------------------------------------------------
// Upstream framings

/// `GET /one` then `GET /two` on one client connection, through a proxy in front of a raw
/// backend answering each with `reply`; the second answer shows the client's connection is
/// still in step after the first.
async fn two_gets_through(reply: &[&[u8]], after: After) -> (RawBackend, Vec<Reply>) {
    let backend = RawBackend::spawn(reply, after).await;
    let mut config = config_over(&[("raw", backend.url())]);
    // Reuse right after a chunked response is what these tests look at.
    config.upstream.stream_close_watch_ms = 0;
    let proxy = start_proxy(config).await;
    let mut client = Client::connect(proxy.addr).await;
    let mut replies = Vec::new();
    for path in ["/one", "/two"] {
        client.send(get(path)).await;
        let reply = client.reply().await;
        assert_eq!(reply.status, 200, "{path}: {reply:?}");
        replies.push(reply);
    }
    proxy.shutdown().await;
    (backend, replies)
}

/// A chunked upstream response (extension, trailer) reaches the client whole, re-chunked; its
/// upstream connection is reused, so the decoder stopped exactly at the body's end; the
/// client's connection serves the next request.
#[tokio::test]
async fn chunked_upstream_responses_are_re_framed_and_the_connection_reused() {
    let (backend, replies) = two_gets_through(
        &[
            b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n\r\n\
            5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nx-trailer: t\r\n\r\n",
        ],
        After::KeepServing,
    )
    .await;
    for reply in &replies {
        assert_eq!(reply.body, b"hello world");
        assert_eq!(reply.header("content-type").as_deref(), Some("text/plain"));
        assert_eq!(reply.header("connection"), None, "{reply:?}");
    }
    assert_eq!(backend.answered(), 2);
    assert_eq!(backend.accepted(), 1, "the upstream connection was reused");
}

/// A response with both `Content-Length` and `Transfer-Encoding` is read as chunked, and its
/// length is not passed on: the client gets the whole body, framed once, and its connection
/// serves the next response cleanly.
#[tokio::test]
async fn transfer_encoding_overrides_a_content_length_from_upstream() {
    let (backend, replies) = two_gets_through(
        &[
            b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n\
            5\r\nhello\r\n0\r\n\r\n",
        ],
        After::KeepServing,
    )
    .await;
    for reply in &replies {
        assert_eq!(reply.header("content-length"), None, "{reply:?}");
        assert_eq!(reply.body, b"hello");
    }
    assert_eq!(
        backend.accepted(),
        1,
        "the upstream connection stayed in step"
    );
}

/// A response whose body carries a transfer coding besides chunked (`gzip, chunked`) is not
/// passed on as if the coded bytes were the content: the client gets 502 naming the cause.
#[tokio::test]
async fn upstream_transfer_codings_other_than_chunked_get_502_not_coded_bytes() {
    let backend = RawBackend::spawn(
        &[b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntransfer-encoding: gzip, chunked\r\n\r\n\
            5\r\n\x1f\x8b\x08\x00\x00\r\n0\r\n\r\n"],
        After::KeepServing,
    )
    .await;
    let proxy = start_proxy(config_over(&[("raw", backend.url())])).await;
    let mut client = Client::connect(proxy.addr).await;
    client.send(get("/coded")).await;
    let reply = client.reply().await;
    assert_eq!(reply.status, 502, "{reply:?}");
    assert!(
        text(&reply.body).contains("transfer-encoding"),
        "{:?}",
        text(&reply.body)
    );
    proxy.shutdown().await;
}

/// A close-delimited upstream response (no length, `Connection: close`) is chunked for an
/// HTTP/1.1 client, whose connection stays open for the next request; the proxy does not
/// pass the backend's `connection: close` on.
#[tokio::test]
async fn close_delimited_upstream_responses_are_re_framed_for_the_client() {
    let (backend, replies) = two_gets_through(
        &[
            b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nconnection: close\r\n\r\nhello",
            b" world",
        ],
        After::Close,
    )
    .await;
    for reply in &replies {
        assert_eq!(
            reply.header("transfer-encoding").as_deref(),
            Some("chunked")
        );
        assert_eq!(reply.header("connection"), None, "{reply:?}");
        assert_eq!(reply.body, b"hello world");
    }
    assert_eq!(backend.accepted(), 2, "a closed connection is never reused");
}

/// `103 Early Hints` before the final `200` is not forwarded: the client's first head is the
/// 200, with its whole body; the upstream and client connections both stay reusable.
#[tokio::test]
async fn interim_upstream_responses_are_swallowed_before_the_final_one() {
    let (backend, replies) = two_gets_through(
        &[
            b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 11\r\n\r\nhello world",
        ],
        After::KeepServing,
    )
    .await;
    for reply in &replies {
        assert_eq!(reply.header("link"), None, "{reply:?}");
        assert_eq!(reply.header("content-length").as_deref(), Some("11"));
        assert_eq!(reply.body, b"hello world");
    }
    assert_eq!(backend.answered(), 2);
    assert_eq!(backend.accepted(), 1, "the upstream connection was reused");
}

/// An HTTP/1.0 upstream response (no keep-alive) is forwarded as HTTP/1.1 with its body, and
/// its connection is not reused even though this backend leaves it open.
#[tokio::test]
async fn http10_upstream_responses_are_forwarded_and_their_connection_not_reused() {
    let (backend, replies) = two_gets_through(
        &[b"HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 11\r\n\r\nhello world"],
        After::KeepServing,
    )
    .await;
    for reply in &replies {
        assert_eq!(reply.body, b"hello world");
        assert_eq!(reply.header("connection"), None, "{reply:?}");
    }
    assert_eq!(backend.answered(), 2);
    assert_eq!(backend.accepted(), 2, "an HTTP/1.0 connection was reused");
}

/// An upstream body cut short (fewer bytes than its length, or no last chunk) is never
/// completed for the client: the client connection closes before the body's end.
#[tokio::test]
async fn truncated_upstream_bodies_end_the_client_connection_short() {
    let cases: [(&str, &[u8]); 2] = [
        (
            "length",
            b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this",
        ),
        (
            "chunked",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n9\r\nonly this\r\n",
        ),
    ];
    for (what, reply) in cases {
        let backend = RawBackend::spawn(&[reply], After::Close).await;
        let proxy = start_proxy(config_over(&[("raw", backend.url())])).await;
        let mut client = Client::connect(proxy.addr).await;
        client.send(get("/cut")).await;
        let (status, head) = client.head().await;
        assert_eq!(status, 200, "{what}: {head}");
        let rest = client.rest_until_eof().await;
        match what {
            "length" => {
                assert_eq!(header_in(&head, "content-length").as_deref(), Some("100"));
                assert_eq!(text(&rest), "only this", "{what}");
            }
            _ => {
                assert_eq!(
                    header_in(&head, "transfer-encoding").as_deref(),
                    Some("chunked")
                );
                assert!(
                    !text(&rest).contains("0\r\n\r\n"),
                    "{what}: a cut body was ended with the last chunk: {:?}",
                    text(&rest)
                );
                assert!(
                    text(&rest).contains("only this"),
                    "{what}: {:?}",
                    text(&rest)
                );
            }
        }
        proxy.shutdown().await;
    }
}

/// Bodies larger than the proxy's copy thresholds (written vectored) pass whole: a 300 KiB
/// chunked request body and a 200 KiB upstream chunk.
#[tokio::test]
async fn large_bodies_pass_whole_in_both_directions() {
    let payload: Vec<u8> = (0..200 * 1024).map(|i| b'a' + (i % 26) as u8).collect();
    let mut reply = format!(
        "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n",
        payload.len()
    )
    .into_bytes();
    reply.extend_from_slice(&payload);
    reply.extend_from_slice(b"\r\n0\r\n\r\n");
    let backend = RawBackend::spawn(&[&reply], After::KeepServing).await;
    let proxy = start_proxy(config_over(&[("raw", backend.url())])).await;
    let mut client = Client::connect(proxy.addr).await;
    let sent: Vec<u8> = (0..300 * 1024).map(|i| b'A' + (i % 26) as u8).collect();
    let mut request =
        b"POST /upload HTTP/1.1\r\nhost: proxy.test\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
    for piece in sent.chunks(100 * 1024) {
        request.extend_from_slice(format!("{:x}\r\n", piece.len()).as_bytes());
        request.extend_from_slice(piece);
        request.extend_from_slice(b"\r\n");
    }
    request.extend_from_slice(b"0\r\n\r\n");
    client.send(&request).await;
    let got = client.reply().await;
    assert_eq!(got.status, 200, "{}", got.head);
    assert!(
        got.body == payload,
        "response body differs ({} bytes)",
        got.body.len()
    );
    let requests = backend.requests();
    let (head, body) = split_request(&requests[0]);
    assert_eq!(
        header_in(&head, "content-length"),
        Some(sent.len().to_string())
    );
    assert!(body == sent, "request body differs ({} bytes)", body.len());
    proxy.shutdown().await;
}

// -------------------------------------------------------------------------------------------
// Pooled upstream connections

/// A backend that closes a pooled keep-alive connection while it idles: the next request of
/// the session still reaches that backend (on a fresh connection), with no failover to the
/// other one.
#[tokio::test]
async fn a_pooled_connection_closed_while_idle_is_replaced_without_failover() {
    let mut closing = RawBackend::spawn(
        &[b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"],
        After::Close,
    )
    .await;
    let other = TestBackend::spawn("other").await;
    let proxy = start_proxy(config_over(&[
        ("closing", closing.url()),
        ("other", other.url()),
    ]))
    .await;
    let key = key_routed_to(&proxy, "closing").await;
    // A POST, which is not sent again after it reached a backend: only the check before the
    // write can save it.
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: proxy.test\r\nx-session-id: {key}\r\n\
         content-length: 2\r\n\r\n{{}}"
    );
    let mut client = Client::connect(proxy.addr).await;
    client.send(&request).await;
    let first = client.reply().await;
    assert_eq!(first.status, 200, "{first:?}");
    assert_eq!(
        first.header("x-agentrace-backend").as_deref(),
        Some("closing")
    );
    closing.wait_closed().await;
    client.send(&request).await;
    let second = client.reply().await;
    assert_eq!(second.status, 200, "{second:?}");
    assert_eq!(second.body, b"ok");
    assert_eq!(
        second.header("x-agentrace-backend").as_deref(),
        Some("closing")
    );
    assert_eq!(other.hits(), 0, "the request failed over");
    assert_eq!(
        closing.requests().len(),
        2,
        "each request reached the backend once"
    );
    assert_eq!(closing.answered(), 2);
    assert_eq!(closing.accepted(), 2);
    proxy.shutdown().await;
}

/// Two POSTs on one client connection to a backend that answers the first and closes its
/// pooled connection on the second as `closes` says, before any response byte: the replies,
/// and the requests the backend and `other` saw.
async fn post_twice_to_a_backend_that_closes_on_the_second(
    closes: After,
    retry_after_send: bool,
) -> (Vec<Reply>, RawBackend, TestBackend) {
    let racing =
        RawBackend::spawn(&[b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"], closes).await;
    let other = TestBackend::spawn("other").await;
    let mut config = config_over(&[("racing", racing.url()), ("other", other.url())]);
    config.upstream.retry_after_send = retry_after_send;
    let proxy = start_proxy(config).await;
    let key = key_routed_to(&proxy, "racing").await;
    let mut client = Client::connect(proxy.addr).await;
    let mut replies = Vec::new();
    for body in ["first", "second"] {
        client
            .send(format!(
                "POST /v1/chat/completions HTTP/1.1\r\nhost: proxy.test\r\nx-session-id: {key}\r\n\
                 content-length: {}\r\n\r\n{body}",
                body.len()
            ))
            .await;
        replies.push(client.reply().await);
    }
    proxy.shutdown().await;
    (replies, racing, other)
}

/// Every reply is the racing backend's `ok`.
fn assert_all_answered_by_racing(replies: &[Reply]) {
    for reply in replies {
        assert_eq!(reply.status, 200, "{reply:?}");
        assert_eq!(
            reply.header("x-agentrace-backend").as_deref(),
            Some("racing")
        );
        assert_eq!(reply.body, b"ok");
    }
}

fn bodies_seen(backend: &RawBackend) -> Vec<Vec<u8>> {
    backend
        .requests()
        .iter()
        .map(|r| split_request(r).1)
        .collect()
}

/// A POST written whole to a pooled connection that the backend then closes without a
/// response byte may be in generation there: it is answered 502, not sent again, neither on a
/// fresh connection nor to the next backend.
#[tokio::test]
async fn a_post_a_pooled_connection_closed_under_is_not_sent_again() {
    let (replies, racing, other) =
        post_twice_to_a_backend_that_closes_on_the_second(After::DropTheNext, false).await;
    assert_eq!(replies[0].status, 200, "{:?}", replies[0]);
    assert_eq!(replies[1].status, 502, "{:?}", replies[1]);
    assert_eq!(
        replies[1].header("x-agentrace-error").as_deref(),
        Some("upstream_error")
    );
    assert_eq!(bodies_seen(&racing), [&b"first"[..], b"second"]);
    assert_eq!(racing.accepted(), 1, "no fresh connection for a resend");
    assert_eq!(other.hits(), 0, "the request was sent to the next backend");
}

/// With `upstream.retry_after_send`, the same POST is sent once more, on a fresh connection to
/// the same backend (not failed over).
#[tokio::test]
async fn with_retry_after_send_a_post_a_pooled_connection_closed_under_is_sent_again() {
    let (replies, racing, other) =
        post_twice_to_a_backend_that_closes_on_the_second(After::DropTheNext, true).await;
    assert_all_answered_by_racing(&replies);
    assert_eq!(
        bodies_seen(&racing),
        [&b"first"[..], b"second", b"second"],
        "the dropped request and its one resend"
    );
    assert_eq!(racing.accepted(), 2, "one fresh connection for the resend");
    assert_eq!(racing.answered(), 2);
    assert_eq!(other.hits(), 0, "the request failed over");
}

/// A POST written to a pooled connection that the backend closes with the request unread (its
/// kernel then resets the connection) never reached the backend's application: it is sent
/// again on a fresh connection to the same backend, not failed over, and answered.
#[tokio::test]
async fn a_post_a_pooled_connection_was_reset_under_unread_is_sent_again() {
    let (replies, racing, other) =
        post_twice_to_a_backend_that_closes_on_the_second(After::ResetsTheNext, false).await;
    assert_all_answered_by_racing(&replies);
    assert_eq!(racing.reset_unread(), 1);
    assert_eq!(bodies_seen(&racing), [&b"first"[..], b"second"]);
    assert_eq!(racing.accepted(), 2, "one fresh connection for the resend");
    assert_eq!(other.hits(), 0, "the request failed over");
}

/// A backend whose close after a stream comes later than the watch (here: only when the next
/// request arrives) costs one resend, not one per request: the first close that crosses a
/// request teaches the pool that it closes after streams, and its connections are not
/// reused after one from then on.
#[tokio::test]
async fn one_close_crossing_a_request_after_a_stream_stops_reuse_after_streams() {
    let reply: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
        transfer-encoding: chunked\r\n\r\ne\r\ndata: [DONE]\n\n\r\n0\r\n\r\n";
    let backend = RawBackend::spawn(&[reply], After::ResetsTheNext).await;
    let mut config = config_over(&[("late", backend.url())]);
    // Connections are pooled at once after a stream, as after a watch that saw them open.
    config.upstream.stream_close_watch_ms = 0;
    let proxy = start_proxy(config).await;
    let mut client = Client::connect(proxy.addr).await;
    post_streams_back_to_back(&mut client, 8).await;
    assert_eq!(backend.answered(), 8);
    assert_eq!(
        backend.reset_unread(),
        1,
        "requests written to a closing connection"
    );
    assert_eq!(
        backend.accepted(),
        8,
        "one connection per request after the first reset"
    );
    proxy.shutdown().await;
}

/// A backend that reads a whole request and closes without answering, and `other`; the proxy
/// over both, and a session key routed to the first.
async fn a_taker_and_other() -> (RawBackend, TestBackend, TestProxy, String) {
    let taker = RawBackend::spawn(&[], After::Close).await;
    let other = TestBackend::spawn("other").await;
    let proxy = start_proxy(config_over(&[
        ("taker", taker.url()),
        ("other", other.url()),
    ]))
    .await;
    let key = key_routed_to(&proxy, "taker").await;
    (taker, other, proxy, key)
}

/// A POST that a backend read whole on a fresh connection and closed on without answering is
/// answered 502 and reaches no other backend.
#[tokio::test]
async fn a_post_the_backend_took_whole_and_closed_on_is_not_sent_again() {
    let (taker, other, proxy, key) = a_taker_and_other().await;
    let mut client = Client::connect(proxy.addr).await;
    client
        .send(format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: proxy.test\r\nx-session-id: {key}\r\n\
             content-length: 2\r\n\r\n{{}}"
        ))
        .await;
    let reply = client.reply().await;
    assert_eq!(reply.status, 502, "{reply:?}");
    assert_eq!(
        reply.header("x-agentrace-error").as_deref(),
        Some("upstream_error")
    );
    assert_eq!(taker.requests().len(), 1);
    assert_eq!(other.hits(), 0, "the request was generated twice");
    let metrics = proxy.metrics().await;
    assert!(
        metrics.contains("agentrace_retries_total{reason=\"after_send\"} 0"),
        "{metrics}"
    );
    proxy.shutdown().await;
}

/// A GET is safe to send twice (RFC 9110 §9.2.2): closed on the same way, it goes to the next
/// backend.
#[tokio::test]
async fn a_get_the_backend_took_whole_and_closed_on_is_sent_to_the_next_choice() {
    let (taker, other, proxy, key) = a_taker_and_other().await;
    let mut client = Client::connect(proxy.addr).await;
    client
        .send(format!(
            "GET /v1/models HTTP/1.1\r\nhost: proxy.test\r\nx-session-id: {key}\r\n\r\n"
        ))
        .await;
    let reply = client.reply().await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(
        reply.header("x-agentrace-backend").as_deref(),
        Some("other")
    );
    assert_eq!(taker.requests().len(), 1);
    assert_eq!(other.hits(), 1);
    let metrics = proxy.metrics().await;
    assert!(
        metrics.contains("agentrace_retries_total{reason=\"after_send\"} 1"),
        "{metrics}"
    );
    proxy.shutdown().await;
}

/// A POST whose backend refuses the connection never reached it: it goes to the next backend.
#[tokio::test]
async fn a_post_whose_backend_refuses_the_connection_is_sent_to_the_next_choice() {
    let (_refusing, dead) = support::refusing_address();
    let other = TestBackend::spawn("other").await;
    let proxy = start_proxy(config_over(&[("dead", dead), ("other", other.url())])).await;
    let key = key_routed_to(&proxy, "dead").await;
    let mut client = Client::connect(proxy.addr).await;
    client
        .send(format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: proxy.test\r\nx-session-id: {key}\r\n\
             content-length: 2\r\n\r\n{{}}"
        ))
        .await;
    let reply = client.reply().await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(
        reply.header("x-agentrace-backend").as_deref(),
        Some("other")
    );
    assert_eq!(other.hits(), 1);
    let metrics = proxy.metrics().await;
    assert!(
        metrics.contains("agentrace_retries_total{reason=\"connect\"} 1"),
        "{metrics}"
    );
    proxy.shutdown().await;
}

// -------------------------------------------------------------------------------------------
// Client time limits

/// A proxy over `backend` with the given `[client]` limits in milliseconds.
async fn proxy_with_client_limits(
    backend: &TestBackend,
    header_ms: u64,
    body_ms: u64,
    idle_ms: u64,
    send_ms: u64,
) -> TestProxy {
    let mut config = config_for(&[backend]);
    config.client.header_timeout_ms = header_ms;
    config.client.body_timeout_ms = body_ms;
    config.client.idle_timeout_ms = idle_ms;
    config.client.send_timeout_ms = send_ms;
    start_proxy(config).await
}

/// The proxy closes `client` with nothing more sent, and not before `limit` has passed since
/// `since`.
async fn assert_closed_once_past(client: &mut Client, since: std::time::Instant, limit: u64) {
    client.assert_closed().await;
    assert!(
        since.elapsed() >= Duration::from_millis(limit),
        "closed {:?} in, before the {limit} ms limit",
        since.elapsed()
    );
}

#[tokio::test]
async fn a_connection_that_sends_nothing_is_closed_after_the_header_timeout() {
    let backend = TestBackend::spawn("b").await;
    let proxy = proxy_with_client_limits(&backend, 200, 60_000, 60_000, 60_000).await;
    let opened = std::time::Instant::now();
    let mut client = Client::connect(proxy.addr).await;
    assert_closed_once_past(&mut client, opened, 200).await;
    assert_eq!(backend.hits(), 0);
    assert_eq!(proxy.client_timeouts("header").await, 1);
    proxy.shutdown().await;
}

#[tokio::test]
async fn a_head_that_stalls_gets_408_and_a_closed_connection() {
    let backend = TestBackend::spawn("b").await;
    let proxy = proxy_with_client_limits(&backend, 200, 60_000, 60_000, 60_000).await;
    let mut client = Client::connect(proxy.addr).await;
    // A first request, then half of a second head and nothing more.
    client.send(get("/v1/first")).await;
    assert_eq!(client.reply().await.status, 200);
    let stalled = std::time::Instant::now();
    client
        .send("GET /v1/never HTTP/1.1\r\nhost: proxy.test\r\n")
        .await;
    let reply = client.reply().await;
    assert_eq!(reply.status, 408, "{reply:?}");
    assert_eq!(reply.header("connection").as_deref(), Some("close"));
    assert_closed_once_past(&mut client, stalled, 200).await;
    assert_eq!(backend.hits(), 1, "the stalled request reached the backend");
    assert_eq!(proxy.client_timeouts("header").await, 1);
    assert_eq!(proxy.client_timeouts("idle").await, 0);
    proxy.shutdown().await;
}

#[tokio::test]
async fn a_body_that_stalls_gets_408_and_never_reaches_the_backend() {
    let backend = TestBackend::spawn("b").await;
    let proxy = proxy_with_client_limits(&backend, 60_000, 200, 60_000, 60_000).await;
    let mut client = Client::connect(proxy.addr).await;
    let stalled = std::time::Instant::now();
    client
        .send(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: proxy.test\r\n\
             content-type: application/json\r\ncontent-length: 100\r\n\r\n{\"model\":",
        )
        .await;
    let reply = client.reply().await;
    assert_eq!(reply.status, 408, "{reply:?}");
    assert_closed_once_past(&mut client, stalled, 200).await;
    assert_eq!(backend.hits(), 0);
    assert_eq!(proxy.client_timeouts("body").await, 1);
    proxy.shutdown().await;
}

#[tokio::test]
async fn an_idle_keep_alive_connection_is_closed_after_the_idle_timeout() {
    let backend = TestBackend::spawn("b").await;
    let proxy = proxy_with_client_limits(&backend, 60_000, 60_000, 300, 60_000).await;
    let mut client = Client::connect(proxy.addr).await;
    // The proxy's idle time starts when it has written the reply, which a loaded machine may
    // hand this client much later: the send is the one instant known to come before it.
    let idle_from = std::time::Instant::now();
    client.send(get("/v1/one")).await;
    let reply = client.reply().await;
    assert_eq!(reply.status, 200);
    assert_ne!(reply.header("connection").as_deref(), Some("close"));
    assert_closed_once_past(&mut client, idle_from, 300).await;
    assert_eq!(proxy.client_timeouts("idle").await, 1);
    assert_eq!(proxy.client_timeouts("header").await, 0);
    proxy.shutdown().await;
}

/// The client limits bound what the client sends and how long it idles, never how long a
/// backend works: a generation that outlasts all of them is answered, on a connection that
/// stays open for the next turn.
#[tokio::test]
async fn a_backend_slower_than_every_client_limit_still_answers() {
    let backend = TestBackend::spawn_with("slow", Mode::Stall).await;
    let proxy = proxy_with_client_limits(&backend, 100, 100, 100, 100).await;
    let mut client = Client::connect(proxy.addr).await;
    client.send(get("/v1/slow")).await;
    backend
        .wait_for("the request to arrive", |c| {
            c.hits.load(Ordering::SeqCst) == 1
        })
        .await;
    // Let four times the longest client limit pass with the request at the backend.
    tokio::time::sleep(Duration::from_millis(400)).await;
    backend.release(1);
    let reply = client.reply().await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.json()["stalled"], true);
    backend.set_mode(Mode::Json);
    client.send(get("/v1/next")).await;
    assert_eq!(client.reply().await.status, 200);
    proxy.shutdown().await;
}

/// A chunked body without its framing, in one pass (for bodies too long to read chunk by chunk
/// off the wire in time).
fn dechunk(mut raw: &[u8]) -> Vec<u8> {
    let mut body = Vec::with_capacity(raw.len());
    loop {
        let line = find(raw, b"\r\n").expect("a chunk size line");
        let size = usize::from_str_radix(text(&raw[..line]).trim(), 16).expect("a chunk size");
        raw = &raw[line + 2..];
        if size == 0 {
            return body;
        }
        body.extend_from_slice(&raw[..size]);
        assert_eq!(&raw[size..size + 2], b"\r\n", "chunk not followed by CRLF");
        raw = &raw[size + 2..];
    }
}

/// A client that stops reading a stream must not hold the backend's generation: once it has
/// taken nothing for the send timeout, its connection closes and the upstream request is
/// cancelled.
#[tokio::test]
async fn a_client_that_stops_reading_is_cut_off_and_its_backend_request_cancelled() {
    let backend = TestBackend::spawn_with("sse", endless_sse()).await;
    let proxy = proxy_with_client_limits(&backend, 60_000, 60_000, 60_000, 300).await;
    let mut client = Client::connect_with_receive_buffer(proxy.addr, 4096).await;
    let sent = std::time::Instant::now();
    client.send(get("/v1/stream")).await;
    backend.assert_cancelled_once_past(sent, 300).await;
    assert_eq!(proxy.client_timeouts("send").await, 1);
    // What the proxy had written before is still there to read, then the connection ends.
    let (status, head) = client.head().await;
    assert_eq!(status, 200, "{head}");
    while client.fill().await {}
    proxy.shutdown().await;
}

/// The send limit bounds each wait for the client, not the whole response: a client that
/// keeps pausing, each pause shorter than the limit but all of them together longer, is
/// served to the end.
#[tokio::test]
async fn pauses_shorter_than_the_send_timeout_do_not_cut_a_stream() {
    // About 13 MB: several times what the socket from the proxy to the client can hold.
    const EVENTS: usize = 400_000;
    // Far longer than a pause, so a loaded machine that wakes this client late is not taken
    // for a client that stopped reading.
    const LIMIT_MS: u64 = 800;
    const END: &[u8] = b"\r\n0\r\n\r\n";
    let backend = TestBackend::spawn_with(
        "sse",
        Mode::Sse {
            events: EVENTS,
            gated: false,
            cut_after: None,
        },
    )
    .await;
    let proxy = proxy_with_client_limits(&backend, 60_000, 60_000, 60_000, LIMIT_MS).await;
    let mut client = Client::connect_with_receive_buffer(proxy.addr, 4096).await;
    client.send(get("/v1/stream")).await;
    let pause = Duration::from_millis(300);
    let mut received_before_each_pause = Vec::new();
    while !client.buf.ends_with(END) {
        received_before_each_pause.push(client.buf.len());
        tokio::time::sleep(pause).await;
        let target = client.buf.len() + 1024 * 1024;
        while client.buf.len() < target && !client.buf.ends_with(END) {
            assert!(
                client.fill().await,
                "the proxy closed the stream after {} pauses",
                received_before_each_pause.len()
            );
        }
    }
    // A pause began with more left to send than the client's socket can take at most (the
    // kernel's largest send buffer, plus a margin for the client's own small buffer): the
    // proxy waited on this client through all of it. How far ahead the backend got does not
    // count, since the proxy's receive buffer from it can grow past the whole stream.
    let socket_holds = largest_send_buffer() + 64 * 1024;
    let total = client.buf.len();
    let waits = received_before_each_pause
        .iter()
        .filter(|&&received| total - received > socket_holds)
        .count();
    let held_back = pause * waits as u32;
    assert!(
        held_back >= Duration::from_millis(2 * LIMIT_MS),
        "the proxy waited on the client for only {held_back:?} in all"
    );
    let raw = std::mem::take(&mut client.buf);
    let head_end = find(&raw, b"\r\n\r\n").expect("a response head") + 4;
    assert!(
        raw.starts_with(b"HTTP/1.1 200 "),
        "{}",
        text(&raw[..head_end])
    );
    let body = text(&dechunk(&raw[head_end..]));
    assert_eq!(body.matches("\"k\":").count(), EVENTS, "events lost");
    assert!(
        body.ends_with("data: [DONE]\n\n"),
        "{}",
        &body[body.len() - 64..]
    );
    assert_eq!(proxy.client_timeouts("send").await, 0);
    assert_eq!(backend.ctl.cancelled.load(Ordering::SeqCst), 0);
    proxy.shutdown().await;
}

/// The most a TCP socket's send buffer may grow to here (`tcp_wmem`'s maximum; Linux's
/// default of 4 MiB elsewhere).
fn largest_send_buffer() -> usize {
    std::fs::read_to_string("/proc/sys/net/ipv4/tcp_wmem")
        .ok()
        .and_then(|v| v.split_whitespace().nth(2)?.parse().ok())
        .unwrap_or(4 * 1024 * 1024)
}

// -------------------------------------------------------------------------------------------
// Interim responses

/// What an [`InterimBackend`] saw.
#[derive(Debug, PartialEq, Eq)]
enum Seen {
    /// A whole request arrived; the interim responses start.
    Request,
    /// The proxy closed the connection.
    Closed,
}

/// A backend on `127.0.0.1:0` that answers every request with `100 Continue` and `103 Early
/// Hints` heads and never a final one; it reports each request and each connection the proxy
/// closes.
struct InterimBackend {
    addr: SocketAddr,
    seen: mpsc::UnboundedReceiver<Seen>,
}

impl InterimBackend {
    /// `endless`: interim heads in large batches for as long as the proxy reads them, so it
    /// always has more to read; otherwise three, then silence until the proxy closes.
    async fn spawn(endless: bool) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, seen) = mpsc::unbounded_channel();
        let mut batch = Vec::new();
        while batch.len() < if endless { 64 * 1024 } else { 1 } {
            batch.extend_from_slice(b"HTTP/1.1 100 Continue\r\n\r\n");
            batch.extend_from_slice(
                b"HTTP/1.1 103 Early Hints\r\nlink: </a.css>; rel=preload\r\n\r\n",
            );
        }
        let batch = Arc::new(batch);
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let (tx, batch) = (tx.clone(), batch.clone());
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    if read_raw_request(&mut stream, &mut buf).await.is_none() {
                        return;
                    }
                    let _ = tx.send(Seen::Request);
                    if endless {
                        while stream.write_all(&batch).await.is_ok() {}
                    } else if stream.write_all(&batch).await.is_ok() {
                        while matches!(stream.read(&mut [0u8; 1024]).await, Ok(n) if n > 0) {}
                    }
                    let _ = tx.send(Seen::Closed);
                });
            }
        });
        Self { addr, seen }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    async fn next(&mut self) -> Seen {
        guarded("the interim backend's next event", self.seen.recv())
            .await
            .expect("backend task alive")
    }
}

/// A backend's requests in flight as `/metrics` reports them.
async fn in_flight(proxy: &TestProxy, backend: &str) -> u64 {
    let metrics = proxy.metrics().await;
    let series = format!("agentrace_in_flight{{backend=\"{backend}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series.as_str()))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {series:?} in /metrics:\n{metrics}"))
}

const POST_EMPTY_OBJECT: &str =
    "POST /v1/chat/completions HTTP/1.1\r\nhost: proxy.test\r\ncontent-length: 2\r\n\r\n{}";

/// A backend that answers with interim responses and never a final one gets no more than the
/// cap of them: the client gets a 502, the backend's connection is closed (not pooled), and
/// nothing stays in flight.
#[tokio::test]
async fn an_endless_run_of_interim_responses_gets_502_and_the_connection_closed() {
    let mut storm = InterimBackend::spawn(true).await;
    let proxy = start_proxy(config_over(&[("storm", storm.url())])).await;
    let mut client = Client::connect(proxy.addr).await;
    client.send(POST_EMPTY_OBJECT).await;
    let reply = client.reply().await;
    assert_eq!(reply.status, 502, "{reply:?}");
    assert_eq!(
        reply.header("x-agentrace-error").as_deref(),
        Some("upstream_error")
    );
    assert!(
        text(&reply.body).contains("interim"),
        "{}",
        text(&reply.body)
    );
    assert_eq!(storm.next().await, Seen::Request);
    assert_eq!(storm.next().await, Seen::Closed);
    assert_eq!(in_flight(&proxy, "storm").await, 0);
    proxy.shutdown().await;
}

/// A client that hangs up while its backend is in interim responses cancels the upstream
/// request, as any other disconnect does: the backend sees its connection closed and nothing
/// stays in flight. (Fewer interim responses than the cap, so only the hang-up ends them.)
#[tokio::test]
async fn a_client_that_hangs_up_during_interim_responses_cancels_the_upstream_request() {
    let mut interim = InterimBackend::spawn(false).await;
    let proxy = start_proxy(config_over(&[("interim", interim.url())])).await;
    let mut client = Client::connect(proxy.addr).await;
    client.send(POST_EMPTY_OBJECT).await;
    assert_eq!(interim.next().await, Seen::Request);
    drop(client);
    assert_eq!(interim.next().await, Seen::Closed);
    guarded("the request to leave the in-flight count", async {
        while in_flight(&proxy, "interim").await != 0 {
            tokio::task::yield_now().await;
        }
    })
    .await;
    proxy.shutdown().await;
}

/// A backend that closes its connection a millisecond after each streamed response, though it
/// advertises keep-alive (as llama-server does): requests sent back to back through the proxy
/// all succeed, none is written to the closing connection and then answered with 502.
#[tokio::test]
async fn a_backend_closing_after_each_stream_never_costs_a_request() {
    let reply: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
        keep-alive: timeout=5, max=100\r\ntransfer-encoding: chunked\r\n\r\n\
        e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n";
    let backend = RawBackend::spawn(&[reply], After::ClosesSoon(Duration::from_millis(1))).await;
    let proxy = start_proxy(config_over(&[("closing", backend.url())])).await;
    let mut client = Client::connect(proxy.addr).await;
    post_streams_back_to_back(&mut client, 30).await;
    assert_eq!(backend.answered(), 30);
    proxy.shutdown().await;
}

/// Sends `rounds` streamed chat POSTs on `client`, each as soon as the last is answered, and
/// asserts every one got 200.
async fn post_streams_back_to_back(client: &mut Client, rounds: usize) {
    let body = r#"{"messages":[],"stream":true}"#;
    for round in 0..rounds {
        client
            .send(format!(
                "POST /v1/chat/completions HTTP/1.1\r\nhost: proxy.test\r\n\
                 content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            ))
            .await;
        let reply = client.reply().await;
        assert_eq!(reply.status, 200, "round {round}: {}", reply.head);
    }
}
