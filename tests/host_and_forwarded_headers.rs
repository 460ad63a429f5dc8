//! `Host` and the forwarding headers the proxy adds, through a real proxy and backend.
//!
//! Invariants: a request whose `Host` is not `host[:port]` (RFC 9112 §3.2, RFC 3986), over
//! HTTP/1.1 or HTTP/2, gets 400 and never reaches a backend; nothing a client sends can add an
//! element to `Forwarded` or a host to `X-Forwarded-Host`; an absolute-form target's authority
//! names the host, not `Host`; every line of an earlier `X-Forwarded-For` or `Forwarded` is
//! continued, not only the first.

mod support;

use bytes::Bytes;
use http_body_util::BodyExt;
use support::backends::*;
use support::raw_http1::*;

/// A `Host` that is not a host (the injection from the report, a space, nothing, a bad port,
/// userinfo, a path) gets 400 with `connection: close`, on HTTP/1.1 and HTTP/1.0 alike.
#[tokio::test]
async fn an_invalid_host_gets_400_and_never_reaches_the_backend() {
    let backend = TestBackend::spawn("b").await;
    let proxy = start_proxy(config_for(&[&backend])).await;
    for (version, host) in [
        ("1.1", "a\";for=6.6.6.6;x=\""),
        ("1.1", "a b"),
        ("1.1", ""),
        ("1.1", "proxy.test:"),
        ("1.1", "proxy.test:99999"),
        ("1.1", "user@proxy.test"),
        ("1.1", "proxy.test/v1"),
        ("1.0", "a\";for=6.6.6.6;x=\""),
        ("1.0", ""),
    ] {
        let what = format!("HTTP/{version} with host {host:?}");
        let mut client = Client::connect(proxy.addr).await;
        client
            .send(format!(
                "GET /v1/models HTTP/{version}\r\nhost: {host}\r\n\r\n"
            ))
            .await;
        let reply = client.reply().await;
        assert_eq!(reply.status, 400, "{what}: {reply:?}");
        assert_eq!(
            reply.header("connection").as_deref(),
            Some("close"),
            "{what}"
        );
        assert!(
            text(&reply.body).contains("Host"),
            "{what}: the error names the field: {}",
            text(&reply.body)
        );
        client.assert_closed().await;
    }
    assert_eq!(backend.hits(), 0, "a request with a bad Host was forwarded");
    proxy.shutdown().await;
}

/// HTTP/2 goes through the same checks: a `Host` that would break out of `Forwarded`'s quotes
/// gets 400 instead of reaching the backend.
#[tokio::test]
async fn an_http2_request_with_an_invalid_host_gets_400() {
    let backend = TestBackend::spawn("b").await;
    let proxy = start_proxy(config_for(&[&backend])).await;
    let mut send = h2_sender(proxy.addr).await;
    let request = |host: &str| {
        http::Request::get(proxy.url("/v1/models"))
            .header("host", host)
            .body(http_body_util::Full::new(Bytes::new()))
            .unwrap()
    };
    let refused = send
        .send_request(request("a\";for=6.6.6.6;x=\""))
        .await
        .unwrap();
    assert_eq!(refused.status(), 400);
    let body = refused.into_body().collect().await.unwrap().to_bytes();
    assert!(text(&body).contains("Host"), "{}", text(&body));
    assert_eq!(backend.hits(), 0, "the request was forwarded");
    // The connection serves the next request; its host is the `:authority`.
    let served = send.send_request(request("proxy.test")).await.unwrap();
    assert_eq!(served.status(), 200);
    let seen = backend.last_headers().unwrap();
    let authority = proxy.addr.to_string();
    assert_eq!(seen["x-forwarded-host"], authority.as_str());
    assert_eq!(
        seen["forwarded"],
        format!("for=127.0.0.1;proto=http;host=\"{authority}\"").as_str()
    );
    proxy.shutdown().await;
}

/// What the backend is told of a request sent as `request`.
async fn forwarded_fields(request: &str) -> http::HeaderMap {
    let backend = TestBackend::spawn("b").await;
    let proxy = start_proxy(config_for(&[&backend])).await;
    let mut client = Client::connect(proxy.addr).await;
    client.send(request).await;
    let reply = client.reply().await;
    assert_eq!(reply.status, 200, "{reply:?}");
    proxy.shutdown().await;
    backend
        .last_headers()
        .expect("the request reached the backend")
}

/// A host with the sub-delimiters RFC 3986 allows stays inside `Forwarded`'s quotes, and is
/// not written into `X-Forwarded-Host`, where its comma would read as a second hop.
#[tokio::test]
async fn a_host_with_delimiters_stays_one_quoted_value() {
    let seen = forwarded_fields("GET /v1 HTTP/1.1\r\nhost: a;for=6.6.6.6,b\r\n\r\n").await;
    assert_eq!(
        seen["forwarded"],
        "for=127.0.0.1;proto=http;host=\"a;for=6.6.6.6,b\""
    );
    assert!(!seen.contains_key("x-forwarded-host"), "{seen:?}");
}

/// Two `X-Forwarded-For` lines and two `Forwarded` lines are each continued as one list, in
/// order, with the client's address last.
#[tokio::test]
async fn several_forwarding_lines_are_combined_not_cut_to_the_first() {
    let seen = forwarded_fields(
        "GET /v1 HTTP/1.1\r\nhost: proxy.test\r\n\
         x-forwarded-for: 203.0.113.1\r\nforwarded: for=203.0.113.1\r\n\
         x-forwarded-for: 203.0.113.2\r\nforwarded: for=203.0.113.2;proto=https\r\n\r\n",
    )
    .await;
    assert_eq!(
        seen["x-forwarded-for"],
        "203.0.113.1, 203.0.113.2, 127.0.0.1"
    );
    assert_eq!(
        seen["forwarded"],
        "for=203.0.113.1, for=203.0.113.2;proto=https, \
         for=127.0.0.1;proto=http;host=\"proxy.test\""
    );
}

/// An absolute-form target names the host the request is for (RFC 9112 §3.2.2): `Host` is
/// still checked, but the forwarded host is the target's.
#[tokio::test]
async fn an_absolute_form_target_governs_over_host() {
    let seen =
        forwarded_fields("GET http://origin.test:8080/v1 HTTP/1.1\r\nhost: other.test\r\n\r\n")
            .await;
    assert_eq!(seen["x-forwarded-host"], "origin.test:8080");
    assert_eq!(
        seen["forwarded"],
        "for=127.0.0.1;proto=http;host=\"origin.test:8080\""
    );
}

/// HTTP/1.0 may leave `Host` out: the request is served, with no host claimed for it.
#[tokio::test]
async fn http10_without_host_is_served_with_no_forwarded_host() {
    let seen = forwarded_fields("GET /v1 HTTP/1.0\r\n\r\n").await;
    assert!(!seen.contains_key("x-forwarded-host"), "{seen:?}");
    assert_eq!(seen["forwarded"], "for=127.0.0.1;proto=http");
}
