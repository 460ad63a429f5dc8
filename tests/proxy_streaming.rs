//! The forwarding path through a real proxy: streaming, failures, health, the tap, shutdown.
//!
//! Invariants: each SSE event reaches the client before the backend writes the next; a failure
//! before the first byte is retried on the session's next choice (and the session rebinds) when
//! the request may be sent again (an HTTP/2 stream the backend refused, a GET);
//! after the first byte it is never retried and an SSE stream ends with an error event; a
//! client that goes away cancels the upstream request; failing probes eject a backend and
//! passing ones bring it back, as do connect errors; the tap sees every exchange exactly once;
//! bodies above the limit get 413; hop-by-hop headers are dropped and X-Forwarded-For added;
//! shutdown lets an open stream finish, but not one whose HTTP/2 client stopped reading it;
//! h2c works on the plain listener, and an HTTP/2 connection is closed once it has had no open stream for the idle timeout (a stream open
//! longer than that keeps it), or once its client leaves a stream's data unread for the send
//! timeout (which cancels the upstream request), and a stalled HTTP/2 request body gets 408;
//! upstream keep-alive
//! connections are reused request after request; `https` backends are reached with the
//! configured CA file over HTTP/2 or HTTP/1.1, as ALPN settles; client connections spread
//! evenly over the forwarding workers.

mod support;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use agentrace::tap::{ExchangeEnd, ExchangeObserver, ExchangeSink, ExchangeStart, KeySource};
use bytes::Bytes;
use parking_lot::Mutex;
use support::backends::*;

fn gated_sse(events: usize) -> Mode {
    Mode::Sse {
        events,
        gated: true,
        cut_after: None,
    }
}

fn free_sse(events: usize) -> Mode {
    Mode::Sse {
        events,
        gated: false,
        cut_after: None,
    }
}

/// The client sees event k while the backend is still blocked before writing event k+1.
#[tokio::test]
async fn sse_events_arrive_one_by_one() {
    let backend = TestBackend::spawn_with("sse", gated_sse(5)).await;
    let proxy = start_proxy(config_for(&[&backend])).await;
    let client = client();
    let mut resp = send(
        &client,
        "POST",
        &proxy.url("/v1/chat/completions"),
        &[("x-session-id", "s")],
        "{}",
    )
    .await;
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    for k in 0..5u64 {
        backend.release(1);
        let data = next_data(resp.body_mut()).await.expect("event");
        let text = String::from_utf8(data.to_vec()).unwrap();
        assert!(text.contains(&format!("\"k\":{k}")), "event {k}: {text:?}");
        assert_eq!(
            backend.ctl.events_written.load(Ordering::SeqCst),
            k + 1,
            "the backend cannot have written event {} yet",
            k + 1
        );
    }
    assert_eq!(
        next_data(resp.body_mut()).await.unwrap(),
        Bytes::from("data: [DONE]\n\n")
    );
    assert!(next_data(resp.body_mut()).await.is_none());
    proxy.shutdown().await;
}

/// A backend that cuts the stream after bytes flowed: the client gets the events so far, then
/// one error event, then the end; the request is not retried anywhere.
#[tokio::test]
async fn mid_stream_failure_yields_an_error_event_and_no_retry() {
    let cut = Mode::Sse {
        events: 5,
        gated: false,
        cut_after: Some(2),
    };
    let a = TestBackend::spawn_with("a", cut.clone()).await;
    let b = TestBackend::spawn_with("b", cut).await;
    let proxy = start_proxy(config_for(&[&a, &b])).await;
    let client = client();
    let mut resp = send(
        &client,
        "POST",
        &proxy.url("/v1/chat/completions"),
        &[("x-session-id", "cut")],
        "{}",
    )
    .await;
    assert_eq!(resp.status(), 200);
    let mut events = Vec::new();
    while let Some(data) = next_data(resp.body_mut()).await {
        events.push(String::from_utf8(data.to_vec()).unwrap());
    }
    let all = events.concat();
    assert!(
        all.contains("\"k\":0") && all.contains("\"k\":1"),
        "{all:?}"
    );
    let last = events.last().unwrap();
    assert!(last.starts_with("data: {\"error\":"), "{last:?}");
    assert!(last.contains("\"type\":\"upstream_error\""), "{last:?}");
    assert!(last.ends_with("\n\n"));
    assert!(!all.contains("[DONE]"));
    assert_eq!(a.hits() + b.hits(), 1, "never retried after the first byte");
    let metrics = proxy.metrics().await;
    assert!(metrics.contains("kind=\"stream\"} 1"), "{metrics}");
    proxy.shutdown().await;
}

/// Dropping the client's response cancels the backend's stream.
#[tokio::test]
async fn client_disconnect_cancels_upstream() {
    let backend = TestBackend::spawn_with("sse", gated_sse(100)).await;
    let proxy = start_proxy(config_for(&[&backend])).await;
    let client = client();
    let mut resp = send(
        &client,
        "POST",
        &proxy.url("/v1/chat/completions"),
        &[],
        "{}",
    )
    .await;
    backend.release(1);
    next_data(resp.body_mut()).await.expect("first event");
    drop(resp);
    drop(client);
    backend
        .wait_for("the upstream stream to be cancelled", |c| {
            c.cancelled.load(Ordering::SeqCst) == 1
        })
        .await;
    assert_eq!(backend.ctl.events_written.load(Ordering::SeqCst), 1);
    proxy.shutdown().await;
}

/// A client that leaves while the backend is still working on the response head: the proxy
/// drops the upstream request, and the backend sees its connection close.
#[tokio::test]
async fn client_disconnect_before_the_response_cancels_upstream() {
    let backend = TestBackend::spawn_with("slow", Mode::Stall).await;
    let proxy = start_proxy(config_for(&[&backend])).await;
    let mut stream = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(
        &mut stream,
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}",
    )
    .await
    .unwrap();
    backend
        .wait_for("the request to arrive", |c| {
            c.hits.load(Ordering::SeqCst) == 1
        })
        .await;
    drop(stream);
    backend
        .wait_for("the upstream request to be abandoned", |c| {
            c.cancelled.load(Ordering::SeqCst) == 1
        })
        .await;
    let state = fetch(
        &client(),
        "GET",
        &proxy.admin_url("/admin/backends"),
        &[],
        "",
    )
    .await
    .2;
    assert!(
        String::from_utf8_lossy(&state).contains("\"in_flight\":0"),
        "{}",
        String::from_utf8_lossy(&state)
    );
    proxy.shutdown().await;
}

/// A backend that drops the connection before answering a GET (safe to send twice): the
/// request is retried on the session's next choice, the session rebinds there, and the retry
/// is counted.
#[tokio::test]
async fn failure_before_the_first_byte_fails_over_and_rebinds() {
    let a = TestBackend::spawn("a").await;
    let b = TestBackend::spawn("b").await;
    let proxy = start_proxy(config_for(&[&a, &b])).await;
    let client = client();
    let key = "failover-session";
    let (_, headers, _) = fetch(
        &client,
        "GET",
        &proxy.url("/v1/models"),
        &[("x-session-id", key)],
        "",
    )
    .await;
    let home = served_by(&headers);
    let (home_b, other) = if home == "a" { (&a, &b) } else { (&b, &a) };
    home_b.set_mode(Mode::Drop);
    let (status, headers, body) = fetch(
        &client,
        "GET",
        &proxy.url("/v1/models"),
        &[("x-session-id", key)],
        "",
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(served_by(&headers), other.name());
    // The home backend works again, but the session stays where failover put it.
    home_b.set_mode(Mode::Json);
    let (_, headers, _) = fetch(
        &client,
        "GET",
        &proxy.url("/v1/models"),
        &[("x-session-id", key)],
        "",
    )
    .await;
    assert_eq!(served_by(&headers), other.name());
    let metrics = proxy.metrics().await;
    assert!(
        metrics.contains("agentrace_retries_total{reason=\"after_send\"} 1"),
        "{metrics}"
    );
    assert!(metrics.contains("outcome=\"failover\"} 1"), "{metrics}");
    assert!(metrics.contains("outcome=\"bound\"} 1"), "{metrics}");
    proxy.shutdown().await;
}

/// With every backend failing before the first byte, the client gets a 502 after one retry.
#[tokio::test]
async fn exhausted_retries_answer_502() {
    let a = TestBackend::spawn_with("a", Mode::Drop).await;
    let b = TestBackend::spawn_with("b", Mode::Drop).await;
    let c = TestBackend::spawn_with("c", Mode::Drop).await;
    let proxy = start_proxy(config_for(&[&a, &b, &c])).await;
    let (status, headers, _) = fetch(
        &client(),
        "GET",
        &proxy.url("/x"),
        &[("x-session-id", "s")],
        "",
    )
    .await;
    assert_eq!(status, 502);
    assert_eq!(headers["x-agentrace-error"], "upstream_error");
    assert_eq!(a.hits() + b.hits() + c.hits(), 2, "one try plus one retry");
    proxy.shutdown().await;
}

async fn backend_state(client: &HttpClient, proxy: &TestProxy, name: &str) -> serde_json::Value {
    let body = fetch(client, "GET", &proxy.admin_url("/admin/backends"), &[], "")
        .await
        .2;
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    json["backends"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["name"] == name)
        .unwrap()
        .clone()
}

/// Polls the admin API until `name`'s health is `healthy` (10 s deadline).
async fn wait_health(client: &HttpClient, proxy: &TestProxy, name: &str, healthy: bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while backend_state(client, proxy, name).await["healthy"] != healthy {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{name} never became healthy={healthy}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Failing probes eject a backend (it gets no requests); passing probes bring it back.
#[tokio::test]
async fn health_checks_eject_and_recover() {
    let a = TestBackend::spawn("a").await;
    let b = TestBackend::spawn("b").await;
    let mut config = config_for(&[&a, &b]);
    config.health.interval_ms = 30;
    config.health.timeout_ms = 30;
    let proxy = start_proxy(config).await;
    let client = client();
    a.set_healthy(false);
    wait_health(&client, &proxy, "a", false).await;
    assert!(
        a.probes() >= 3,
        "ejected only after unhealthy_threshold failed probes"
    );
    let before = a.hits();
    for i in 0..30 {
        let (_, h, _) = fetch(
            &client,
            "GET",
            &proxy.url("/v1/models"),
            &[("x-session-id", &format!("s{i}"))],
            "",
        )
        .await;
        assert_eq!(served_by(&h), "b");
    }
    assert_eq!(a.hits(), before, "an unhealthy backend gets no requests");
    a.set_healthy(true);
    wait_health(&client, &proxy, "a", true).await;
    let mut served_a = false;
    for i in 100..130 {
        let (_, h, _) = fetch(
            &client,
            "GET",
            &proxy.url("/v1/models"),
            &[("x-session-id", &format!("s{i}"))],
            "",
        )
        .await;
        served_a |= served_by(&h) == "a";
    }
    assert!(served_a, "new sessions reach the recovered backend");
    proxy.shutdown().await;
}

/// A connect error ejects the backend at once; probes bring it back when it listens again.
#[tokio::test]
async fn connect_errors_eject_passively() {
    let a = TestBackend::spawn("a").await;
    let mut dead = TestBackend::spawn("dead").await;
    let dead_addr = dead.addr;
    dead.stop();
    // Wait until the port refuses connections.
    while tokio::net::TcpStream::connect(dead_addr).await.is_ok() {
        tokio::task::yield_now().await;
    }
    let mut config = config_for(&[&a, &dead]);
    config.health.interval_ms = 60_000; // probes exist but will not run again during the test
    config.health.timeout_ms = 1_000;
    let proxy = start_proxy(config).await;
    let client = client();
    let mut first_failover = None;
    for i in 0..40 {
        let (status, h, _) = fetch(
            &client,
            "GET",
            &proxy.url("/v1/models"),
            &[("x-session-id", &format!("s{i}"))],
            "",
        )
        .await;
        assert_eq!(status, 200);
        assert_eq!(served_by(&h), "a");
        if first_failover.is_none()
            && backend_state(&client, &proxy, "dead").await["healthy"] == false
        {
            first_failover = Some(i);
        }
    }
    assert!(
        first_failover.is_some(),
        "a connect error ejects the backend"
    );
    let metrics = proxy.metrics().await;
    assert!(
        metrics.contains("agentrace_upstream_errors_total{backend=\"dead\",kind=\"connect\"} 1"),
        "{metrics}"
    );
    proxy.shutdown().await;
}

/// Without probes, a run of 5xx ejects a backend; it takes requests again once `ejection_ms`
/// has passed since the ejection, and not before.
#[tokio::test]
async fn without_probes_an_ejected_backend_returns_after_the_ejection_period() {
    let a = TestBackend::spawn_with("a", Mode::Status(503)).await;
    let b = TestBackend::spawn("b").await;
    let mut config = config_for(&[&a, &b]);
    config.health.interval_ms = 0;
    config.health.eject_after_5xx = 2;
    config.health.ejection_ms = 1_500;
    let proxy = start_proxy(config).await;
    let client = client();
    let get = |key: String| {
        let client = client.clone();
        let url = proxy.url("/v1/models");
        async move { fetch(&client, "GET", &url, &[("x-session-id", &key)], "").await }
    };
    let mut before_ejection = None;
    for i in 0.. {
        assert!(i < 200, "keys never reached backend a twice");
        if a.hits() == 1 {
            before_ejection = Some(std::time::Instant::now());
        }
        let (status, h, _) = get(format!("s{i}")).await;
        if served_by(&h) == "a" {
            assert_eq!(status, 503);
            if a.hits() == 2 {
                break;
            }
        }
    }
    let before_ejection = before_ejection.unwrap();
    assert_eq!(
        backend_state(&client, &proxy, "a").await["healthy"],
        false,
        "two 5xx in a row eject the backend without probes"
    );
    for i in 1000..1020 {
        let (status, h, _) = get(format!("s{i}")).await;
        assert_eq!((status.as_u16(), served_by(&h).as_str()), (200, "b"));
    }
    assert_eq!(a.hits(), 2, "an ejected backend gets no requests");

    a.set_mode(Mode::Json);
    wait_health(&client, &proxy, "a", true).await;
    let out_for = before_ejection.elapsed();
    assert!(
        out_for >= Duration::from_millis(1_500),
        "back after {out_for:?}, before the ejection period ended"
    );
    let mut served_a = false;
    for i in 2000..2030 {
        let (status, h, _) = get(format!("s{i}")).await;
        assert_eq!(status, 200);
        served_a |= served_by(&h) == "a";
    }
    assert!(
        served_a,
        "new sessions reach the backend after its ejection period"
    );
    proxy.shutdown().await;
}

#[derive(Default)]
struct Calls {
    starts: Vec<ExchangeStart>,
    heads: Vec<u16>,
    frames: Vec<Bytes>,
    ends: Vec<ExchangeEnd>,
}

struct RecordingSink(Arc<Mutex<Calls>>);
struct RecordingObserver(Arc<Mutex<Calls>>);

impl ExchangeSink for RecordingSink {
    fn start(&self, start: ExchangeStart) -> Box<dyn ExchangeObserver> {
        self.0.lock().starts.push(start);
        Box::new(RecordingObserver(self.0.clone()))
    }
}

impl ExchangeObserver for RecordingObserver {
    fn response_head(
        &mut self,
        status: http::StatusCode,
        _: &http::HeaderMap,
        _: tokio::time::Instant,
    ) {
        self.0.lock().heads.push(status.as_u16());
    }
    fn response_frame(&mut self, data: &Bytes, _: tokio::time::Instant) {
        self.0.lock().frames.push(data.clone());
    }
    fn end(self: Box<Self>, end: ExchangeEnd, _: tokio::time::Instant) {
        self.0.lock().ends.push(end);
    }
}

/// The tap sees start (with the backend that served, after failover), the head, every frame
/// unchanged, and exactly one end, also for a client that goes away.
#[tokio::test]
async fn tap_reports_every_exchange_exactly_once() {
    let a = TestBackend::spawn_with("a", gated_sse(3)).await;
    let calls = Arc::new(Mutex::new(Calls::default()));
    let (trigger, shutdown) = agentrace::shutdown::channel();
    let handle = agentrace::proxy::start_with_sink(
        config_for(&[&a]),
        shutdown,
        Arc::new(RecordingSink(calls.clone())),
    )
    .await
    .unwrap();
    let client = client();
    let url = format!("http://{}/v1/chat/completions", handle.addr);
    let body = chat_body("tap", 1);

    // 1. A complete stream.
    a.release(3);
    let mut resp = send(
        &client,
        "POST",
        &url,
        &[("x-session-id", "tap-1")],
        body.clone(),
    )
    .await;
    let mut received = Vec::new();
    while let Some(d) = next_data(resp.body_mut()).await {
        received.push(d);
    }
    // 2. A client that leaves after the first event.
    let mut resp = send(&client, "POST", &url, &[], body.clone()).await;
    a.release(1);
    next_data(resp.body_mut()).await.unwrap();
    drop(resp);
    drop(client);
    a.wait_for("cancellation", |c| c.cancelled.load(Ordering::SeqCst) == 1)
        .await;
    // 3. A response of known length: hyper stops at its last byte, the exchange still completes.
    a.set_mode(Mode::Json);
    let (status, _, json) = fetch(
        &support::backends::client(),
        "POST",
        &url,
        &[("x-session-id", "tap-3")],
        "{}",
    )
    .await;
    assert_eq!(status, 200);
    trigger.fire();
    handle.join().await;

    let calls = calls.lock();
    assert_eq!(calls.starts.len(), 3);
    assert_eq!(
        calls.ends.len(),
        3,
        "end exactly once per exchange: {:?}",
        calls.ends
    );
    assert_eq!(calls.heads, [200, 200, 200]);
    let s = &calls.starts[0];
    assert_eq!(s.backend, "a");
    assert_eq!(s.session_key.as_deref(), Some("tap-1"));
    assert_eq!(s.key_source, KeySource::Header);
    assert_eq!(s.method, http::Method::POST);
    assert_eq!(s.path_and_query, "/v1/chat/completions");
    assert_eq!(s.request_body, Bytes::from(body.clone()));
    assert!(s.request_received_at >= s.started_at);
    assert_eq!(calls.starts[1].key_source, KeySource::Fingerprint);
    let tapped: Vec<u8> = calls.frames.concat();
    assert!(
        tapped.starts_with(&received.concat()),
        "frames reported as forwarded"
    );
    assert_eq!(calls.ends[0], ExchangeEnd::Complete);
    assert_eq!(calls.ends[1], ExchangeEnd::ClientGone);
    assert_eq!(calls.ends[2], ExchangeEnd::Complete);
    assert!(tapped.ends_with(&json), "the JSON body was reported");
}

/// A body above `max_request_body_bytes` is refused with 413 and never reaches a backend.
#[tokio::test]
async fn oversized_request_body_gets_413() {
    let a = TestBackend::spawn("a").await;
    let mut config = config_for(&[&a]);
    config.max_request_body_bytes = 1024;
    let proxy = start_proxy(config).await;
    let client = client();
    let (status, _, _) = fetch(
        &client,
        "POST",
        &proxy.url("/v1/chat/completions"),
        &[],
        vec![b'x'; 1025],
    )
    .await;
    assert_eq!(status, 413);
    // Without a declared length (chunked), the limit holds while reading.
    let chunks =
        futures_util::stream::iter((0..4).map(|_| {
            Ok::<_, std::io::Error>(hyper::body::Frame::data(Bytes::from(vec![b'y'; 400])))
        }));
    let req = http::Request::post(proxy.url("/v1/chat/completions"))
        .body(http_body_util::StreamBody::new(chunks))
        .unwrap();
    let streaming_client =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build(hyper_util::client::legacy::connect::HttpConnector::new());
    let resp = streaming_client.request(req).await.unwrap();
    assert_eq!(resp.status(), 413);
    let (status, _, _) = fetch(
        &client,
        "POST",
        &proxy.url("/v1/chat/completions"),
        &[],
        vec![b'x'; 1024],
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(a.hits(), 1);
    proxy.shutdown().await;
}

/// Hop-by-hop headers stop at the proxy; end-to-end ones pass; the client address is added.
#[tokio::test]
async fn headers_pass_through_except_hop_by_hop() {
    let a = TestBackend::spawn("a").await;
    let proxy = start_proxy(config_for(&[&a])).await;
    let (status, headers, _) = fetch(
        &client(),
        "POST",
        &proxy.url("/v1/chat/completions?trace=1"),
        &[
            ("authorization", "Bearer sk-test"),
            ("x-session-id", "h"),
            ("connection", "x-secret-hop"),
            ("x-secret-hop", "1"),
            ("x-forwarded-for", "203.0.113.9"),
        ],
        "{}",
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(headers["x-backend"], "a", "response headers pass through");
    let seen = a.last_headers().unwrap();
    assert_eq!(seen["authorization"], "Bearer sk-test");
    assert_eq!(seen["x-session-id"], "h");
    assert!(!seen.contains_key("x-secret-hop"));
    assert_eq!(seen["x-forwarded-for"], "203.0.113.9, 127.0.0.1");
    assert!(seen["forwarded"]
        .to_str()
        .unwrap()
        .starts_with("for=127.0.0.1;proto=http"));
    assert_eq!(seen["host"], a.addr.to_string());
    proxy.shutdown().await;
}

/// One client sending request after request costs the backend one connection: each response
/// hands its upstream connection back for the next request, until it has idled too long.
#[tokio::test]
async fn upstream_connections_are_reused_until_the_idle_timeout() {
    let a = TestBackend::spawn("a").await;
    let sse = TestBackend::spawn_with("sse", free_sse(3)).await;
    let proxy = start_proxy(config_for(&[&a])).await;
    let http = client();
    for i in 0..50 {
        let (status, _) = chat(&http, &proxy, "reuse", format!("{{\"n\":{i}}}")).await;
        assert_eq!(status, 200);
    }
    assert_eq!(a.hits(), 50);
    assert_eq!(
        a.serving_connections(),
        1,
        "one upstream connection served them all"
    );
    proxy.shutdown().await;

    // Streams end with the connection reusable too (unwatched: the watch for a backend that
    // closes after streams is tested in proxy_http1).
    let mut config = config_for(&[&sse]);
    config.upstream.stream_close_watch_ms = 0;
    let proxy = start_proxy(config).await;
    for _ in 0..10 {
        let (status, body) = chat(&http, &proxy, "reuse", "{\"stream\":true}").await;
        assert_eq!(status, 200);
        assert!(String::from_utf8_lossy(&body).ends_with("data: [DONE]\n\n"));
    }
    assert_eq!(sse.serving_connections(), 1);
    proxy.shutdown().await;

    // A connection idle past `pool_idle_timeout_secs` is never reused (0: none is).
    let b = TestBackend::spawn("b").await;
    let mut config = config_for(&[&b]);
    config.upstream.pool_idle_timeout_secs = 0;
    let proxy = start_proxy(config).await;
    for i in 0..5 {
        let (status, _) = chat(&http, &proxy, "reuse", format!("{{\"n\":{i}}}")).await;
        assert_eq!(status, 200);
    }
    assert_eq!(b.serving_connections(), 5, "a fresh connection per request");
    proxy.shutdown().await;
}

/// Each new client connection goes to the worker serving the fewest, so connections spread
/// evenly over the workers; the per-worker gauge follows them as they open and close.
#[tokio::test]
async fn client_connections_spread_evenly_over_the_workers() {
    let a = TestBackend::spawn("a").await;
    let mut config = config_for(&[&a]);
    config.workers = 3;
    let proxy = start_proxy(config).await;
    let per_worker = |metrics: &str| -> Vec<f64> {
        (0..3)
            .map(|w| {
                let series = format!("agentrace_worker_connections{{worker=\"{w}\"}} ");
                metrics
                    .lines()
                    .find_map(|l| l.strip_prefix(&series))
                    .map_or(0.0, |v| v.parse().unwrap())
            })
            .collect()
    };
    // A client of its own per connection; each keeps its connection open once answered.
    let mut clients = Vec::new();
    for i in 0..9 {
        let http = client();
        let (status, _) = chat(&http, &proxy, &format!("s{i}"), "{}").await;
        assert_eq!(status, 200);
        clients.push(http);
    }
    assert_eq!(per_worker(&proxy.metrics().await), vec![3.0, 3.0, 3.0]);

    drop(clients);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let open = per_worker(&proxy.metrics().await);
        if open == vec![0.0, 0.0, 0.0] {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "closed connections still counted: {open:?}"
        );
        tokio::task::yield_now().await;
    }
    proxy.shutdown().await;
}

/// An `https` backend is verified against `upstream.ca_file` and spoken to over HTTP/2 when it
/// offers h2 by ALPN, over HTTP/1.1 otherwise; both keep one connection for many requests.
#[tokio::test]
async fn https_backends_use_the_ca_file_and_the_negotiated_protocol() {
    let dir = tempfile::tempdir().unwrap();
    let certified =
        rcgen::generate_simple_self_signed(vec!["localhost".to_string(), "127.0.0.1".to_string()])
            .unwrap();
    let (cert, key) = (certified.cert.pem(), certified.key_pair.serialize_pem());
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, &cert).unwrap();
    for (alpn, version) in [
        (&[b"h2".as_slice(), b"http/1.1"][..], http::Version::HTTP_2),
        (&[b"http/1.1".as_slice()][..], http::Version::HTTP_11),
    ] {
        let backend = TestBackend::spawn_tls("tls", &cert, &key, alpn).await;
        let mut config = config_for(&[&backend]);
        config.backends[0].url = format!("https://localhost:{}", backend.addr.port());
        config.upstream.ca_file = Some(ca_file.clone());
        let proxy = start_proxy(config).await;
        let http = client();
        for _ in 0..5 {
            let (status, body) = chat(&http, &proxy, "tls", "{}").await;
            assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        }
        assert_eq!(backend.last_version(), Some(version));
        assert_eq!(backend.serving_connections(), 1);
        let seen = backend.last_headers().unwrap();
        assert_eq!(seen["x-session-id"], "tls", "{version:?}");
        assert_eq!(seen["x-forwarded-for"], "127.0.0.1", "{version:?}");
        assert_eq!(seen["x-forwarded-proto"], "http", "{version:?}");
        if version == http::Version::HTTP_11 {
            // (HTTP/2 carries it as the :authority of the request URI instead.)
            assert_eq!(
                backend.last_headers().unwrap()[http::header::HOST],
                format!("localhost:{}", backend.addr.port()).as_str(),
            );
        }
        proxy.shutdown().await;
    }

    // Without the CA file the backend's certificate is refused: a 502 naming the backend.
    let backend = TestBackend::spawn_tls("tls", &cert, &key, &[b"http/1.1"]).await;
    let mut config = config_for(&[&backend]);
    config.backends[0].url = format!("https://localhost:{}", backend.addr.port());
    let proxy = start_proxy(config).await;
    let (status, body) = chat(&client(), &proxy, "tls", "{}").await;
    assert_eq!(status, 502);
    assert!(String::from_utf8_lossy(&body).contains("backend tls failed"));
    assert_eq!(backend.hits(), 0);
    proxy.shutdown().await;
}

/// An HTTP/2 backend behind TLS (ALPN h2 only) that resets every stream with `reason` before
/// any response; the streams it saw are counted.
async fn spawn_h2_resetting(
    cert: &str,
    key: &str,
    reason: h2::Reason,
) -> (std::net::SocketAddr, Arc<std::sync::atomic::AtomicU64>) {
    let acceptor = tls_acceptor(cert, key, &[b"h2"]);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let streams = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let seen = streams.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (acceptor, seen) = (acceptor.clone(), seen.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let Ok(mut conn) = h2::server::handshake(tls).await else {
                    return;
                };
                while let Some(Ok((_, mut respond))) = conn.accept().await {
                    seen.fetch_add(1, Ordering::SeqCst);
                    respond.send_reset(reason);
                }
            });
        }
    });
    (addr, streams)
}

/// An HTTP/2 backend that refuses a stream (`REFUSED_STREAM`: RFC 9113 §8.7, it did no
/// processing) has a POST sent to the next backend; one that resets it for any other reason
/// may have acted on it, and the POST gets 502 instead of reaching a second backend.
#[tokio::test]
async fn an_http2_stream_the_backend_refused_is_sent_to_the_next_choice_and_no_other() {
    let dir = tempfile::tempdir().unwrap();
    let certified = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let (cert, key) = (certified.cert.pem(), certified.key_pair.serialize_pem());
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, &cert).unwrap();
    for (reason, status) in [
        (h2::Reason::REFUSED_STREAM, 200),
        (h2::Reason::INTERNAL_ERROR, 502),
    ] {
        let (addr, streams) = spawn_h2_resetting(&cert, &key, reason).await;
        let other = TestBackend::spawn("other").await;
        let mut config = config_for(&[&other]);
        config
            .backends
            .push(agentrace::proxy::config::BackendConfig {
                name: "resetting".into(),
                url: format!("https://localhost:{}", addr.port()),
                ..config.backends[0].clone()
            });
        config.upstream.ca_file = Some(ca_file.clone());
        let proxy = start_proxy(config).await;
        let http = client();
        // Sessions until one is placed on the resetting backend.
        for i in 0..64 {
            let hits = other.hits();
            let (got, headers, body) = fetch(
                &http,
                "POST",
                &proxy.url("/v1/chat/completions"),
                &[("x-session-id", &format!("s{i}"))],
                "{}",
            )
            .await;
            if streams.load(Ordering::SeqCst) == 0 {
                assert_eq!(got, 200, "{}", String::from_utf8_lossy(&body));
                continue;
            }
            assert_eq!(
                got,
                status,
                "{reason:?}: {}",
                String::from_utf8_lossy(&body)
            );
            assert_eq!(streams.load(Ordering::SeqCst), 1, "{reason:?}");
            if status == 200 {
                assert_eq!(served_by(&headers), "other");
                assert_eq!(other.hits(), hits + 1);
            } else {
                assert_eq!(other.hits(), hits, "{reason:?}: sent to a second backend");
            }
            break;
        }
        assert_eq!(
            streams.load(Ordering::SeqCst),
            1,
            "no session reached the backend"
        );
        proxy.shutdown().await;
    }
}

/// POSTs `body` to the proxy's chat-completions path in session `session`.
async fn chat(
    http: &HttpClient,
    proxy: &TestProxy,
    session: &str,
    body: impl Into<Bytes>,
) -> (http::StatusCode, Bytes) {
    let (status, _, body) = fetch(
        http,
        "POST",
        &proxy.url("/v1/chat/completions"),
        &[("x-session-id", session)],
        body,
    )
    .await;
    (status, body)
}

/// On shutdown the listener stops accepting while an open stream runs to its end.
#[tokio::test]
async fn shutdown_drains_open_streams() {
    let a = TestBackend::spawn_with("a", gated_sse(2)).await;
    let proxy = start_proxy(config_for(&[&a])).await;
    let addr = proxy.addr;
    let client = client();
    let mut resp = send(
        &client,
        "POST",
        &proxy.url("/v1/chat/completions"),
        &[],
        "{}",
    )
    .await;
    let joined = tokio::spawn(proxy.shutdown());
    // The listener closes (new connections are refused) while the stream stays open.
    while tokio::net::TcpStream::connect(addr).await.is_ok() {
        tokio::task::yield_now().await;
    }
    assert!(!joined.is_finished());
    a.release(2);
    let mut n = 0;
    while next_data(resp.body_mut()).await.is_some() {
        n += 1;
    }
    assert_eq!(n, 3, "both events and [DONE] arrived during the drain");
    tokio::time::timeout(Duration::from_secs(10), joined)
        .await
        .unwrap()
        .unwrap();
}

/// HTTP/2 with prior knowledge (h2c) on the plain listener.
#[tokio::test]
async fn h2c_ingress_is_served() {
    let a = TestBackend::spawn("a").await;
    let proxy = start_proxy(config_for(&[&a])).await;
    let h2: hyper_util::client::legacy::Client<_, http_body_util::Full<Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .http2_only(true)
            .build(hyper_util::client::legacy::connect::HttpConnector::new());
    let req = http::Request::get(proxy.url("/v1/models"))
        .header("x-session-id", "h2")
        .body(http_body_util::Full::new(Bytes::new()))
        .unwrap();
    let resp = h2.request(req).await.unwrap();
    assert_eq!(resp.version(), http::Version::HTTP_2);
    assert_eq!(resp.status(), 200);
    assert_eq!(served_by(resp.headers()), "a");
    proxy.shutdown().await;
}

#[tokio::test]
async fn an_http2_connection_closes_after_idling_but_not_while_a_stream_is_open() {
    let backend = TestBackend::spawn_with("slow", Mode::Stall).await;
    let mut config = config_for(&[&backend]);
    config.client.idle_timeout_ms = 200;
    let proxy = start_proxy(config).await;
    let tcp = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    let mut conn = tokio::spawn(conn);
    let req = http::Request::get(proxy.url("/v1/slow"))
        .body(http_body_util::Full::new(Bytes::new()))
        .unwrap();
    let first = send.send_request(req);
    let answer = tokio::spawn(first);
    backend
        .wait_for("the request to arrive", |c| {
            c.hits.load(Ordering::SeqCst) == 1
        })
        .await;
    // Three idle timeouts pass with the stream open; the connection still takes new streams.
    tokio::time::sleep(Duration::from_millis(600)).await;
    backend.set_mode(Mode::Json);
    let second = http::Request::get(proxy.url("/v1/second"))
        .body(http_body_util::Full::new(Bytes::new()))
        .unwrap();
    let second = send
        .send_request(second)
        .await
        .expect("a new stream after a long open one");
    assert_eq!(second.status(), 200);
    drop(second);
    backend.release(1);
    let resp = answer.await.unwrap().unwrap();
    assert_eq!(resp.status(), 200);
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .unwrap()
        .to_bytes();
    assert!(body.starts_with(b"{\"stalled\""), "{body:?}");
    let idle_from = std::time::Instant::now();
    tokio::time::timeout(Duration::from_secs(10), &mut conn)
        .await
        .expect("the idle connection was not closed")
        .unwrap()
        .unwrap();
    assert!(
        idle_from.elapsed() >= Duration::from_millis(150),
        "closed {:?} after the stream ended",
        idle_from.elapsed()
    );
    assert_eq!(proxy.client_timeouts("idle").await, 1);
    proxy.shutdown().await;
}

/// An HTTP/2 client connection to `proxy` whose streams' receive windows hold `window` bytes,
/// its connection task spawned.
async fn h2_connect(
    proxy: &TestProxy,
    window: u32,
) -> (
    hyper::client::conn::http2::SendRequest<
        http_body_util::combinators::BoxBody<Bytes, std::io::Error>,
    >,
    tokio::task::JoinHandle<hyper::Result<()>>,
) {
    let tcp = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let (send, conn) =
        hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .initial_stream_window_size(window)
            .handshake(hyper_util::rt::TokioIo::new(tcp))
            .await
            .unwrap();
    (send, tokio::spawn(conn))
}

fn h2_get(
    proxy: &TestProxy,
    path: &str,
) -> http::Request<http_body_util::combinators::BoxBody<Bytes, std::io::Error>> {
    use http_body_util::BodyExt;
    http::Request::get(proxy.url(path))
        .body(http_body_util::Empty::new().map_err(|e| match e {}).boxed())
        .unwrap()
}

/// HTTP/2 has flow control instead of a socket that fills: a client that stops reading a
/// stream's data must not hold the backend's generation either.
#[tokio::test]
async fn an_http2_client_that_stops_reading_is_cut_off_and_its_backend_request_cancelled() {
    let backend = TestBackend::spawn_with("sse", endless_sse()).await;
    let mut config = config_for(&[&backend]);
    config.client.send_timeout_ms = 300;
    let proxy = start_proxy(config).await;
    let (mut send, conn) = h2_connect(&proxy, 16 * 1024).await;
    let sent = std::time::Instant::now();
    let resp = send
        .send_request(h2_get(&proxy, "/v1/stream"))
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    // The body is held and never read.
    backend.assert_cancelled_once_past(sent, 300).await;
    let closed = tokio::time::timeout(Duration::from_secs(10), conn).await;
    assert!(closed.is_ok(), "the client's connection stayed open");
    assert_eq!(proxy.client_timeouts("send").await, 1);
    drop(resp);
    proxy.shutdown().await;
}

/// Shutdown lets open streams finish, but a stream its client does not read is not one that
/// finishes: it is cut off at the send limit, not at the end of the grace period.
#[tokio::test]
async fn shutdown_does_not_wait_for_an_http2_stream_its_client_does_not_read() {
    let backend = TestBackend::spawn_with("sse", endless_sse()).await;
    let mut config = config_for(&[&backend]);
    config.client.send_timeout_ms = 300;
    config.shutdown_grace_secs = 60;
    let proxy = start_proxy(config).await;
    let (mut send, _conn) = h2_connect(&proxy, 16 * 1024).await;
    let resp = send
        .send_request(h2_get(&proxy, "/v1/stream"))
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let asked = std::time::Instant::now();
    tokio::time::timeout(Duration::from_secs(10), proxy.shutdown())
        .await
        .expect("shutdown waited on a stream nobody reads");
    assert!(
        asked.elapsed() >= Duration::from_millis(300),
        "shut down {:?} in, before the 300 ms send limit",
        asked.elapsed()
    );
    backend
        .wait_for("the stream to be cancelled", |c| {
            c.cancelled.load(Ordering::SeqCst) == 1
        })
        .await;
    drop(resp);
}

/// The body limit holds on HTTP/2 too: a request body that stops arriving is answered 408 and
/// never reaches a backend.
#[tokio::test]
async fn an_http2_request_body_that_stalls_gets_408() {
    use http_body_util::BodyExt;
    let backend = TestBackend::spawn("b").await;
    let mut config = config_for(&[&backend]);
    config.client.body_timeout_ms = 200;
    let proxy = start_proxy(config).await;
    let (mut send, _conn) = h2_connect(&proxy, 65_535).await;
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<http_body::Frame<Bytes>, std::io::Error>>(1);
    tx.send(Ok(http_body::Frame::data(Bytes::from_static(
        b"{\"model\":",
    ))))
    .await
    .unwrap();
    let body = http_body_util::StreamBody::new(futures_util::stream::unfold(rx, |mut rx| async {
        rx.recv().await.map(|f| (f, rx))
    }));
    let req = http::Request::post(proxy.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(body.boxed())
        .unwrap();
    let stalled = std::time::Instant::now();
    let resp = tokio::time::timeout(Duration::from_secs(10), send.send_request(req))
        .await
        .expect("no answer to a stalled body")
        .unwrap();
    assert_eq!(resp.status(), 408);
    assert!(
        stalled.elapsed() >= Duration::from_millis(200),
        "answered {:?} in, before the 200 ms body limit",
        stalled.elapsed()
    );
    assert_eq!(backend.hits(), 0);
    assert_eq!(proxy.client_timeouts("body").await, 1);
    drop(tx);
    proxy.shutdown().await;
}

/// With `[capture]` on, the recorder behind the proxy receives every exchange, its counters
/// show on /metrics, and `join` leaves finished segment files.
#[tokio::test]
async fn capture_records_exchanges_passing_through() {
    let sse = TestBackend::spawn_with("sse", free_sse(3)).await;
    let dir = tempfile::tempdir().unwrap();
    let mut config = config_for(&[&sse]);
    config.capture.enabled = true;
    config.capture.dir = dir.path().to_path_buf();
    config.capture.flush_interval_ms = 50;
    let proxy = start_proxy(config).await;
    let client = client();
    let (status, _, body) = fetch(
        &client,
        "POST",
        &proxy.url("/v1/chat/completions"),
        &[("x-session-id", "rec")],
        chat_body("rec", 0),
    )
    .await;
    assert_eq!(status, 200);
    let metrics = proxy.metrics().await;
    assert!(
        metrics.contains("agentrace_capture_records_dropped_total 0"),
        "{metrics}"
    );
    proxy.shutdown().await;

    let capture = agentrace::capture::reader::read_dir(dir.path()).unwrap();
    assert_eq!(capture.exchanges.len(), 1);
    let ex = &capture.exchanges[0];
    assert_eq!(ex.record.session.as_deref(), Some("rec"));
    assert_eq!(ex.record.backend, "sse");
    assert_eq!(
        ex.request_body.as_deref(),
        Some(chat_body("rec", 0).as_bytes())
    );
    assert_eq!(
        ex.response_body.as_deref(),
        Some(&body[..]),
        "the stream as the client saw it"
    );
}
