//! Forwarding loops: a proxy whose backend is itself, or leads back to it through another
//! proxy, over real sockets.
//!
//! Invariants: every forwarded request and every health probe carries this proxy instance's
//! `Via` entry; a request whose `Via` already names the instance is answered 508 Loop Detected
//! at the first repeat (one refusal, counted), over HTTP/1.1 and HTTP/2; another instance (a
//! replica, or the other proxy of a loop) passes it on; a health probe that comes back to the
//! proxy takes the backend out.

mod support;

use std::time::{Duration, Instant};

use agentrace::proxy::ProxyConfig;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use support::backends::*;

const LOOPS: &str = "agentrace_loops_refused_total";

/// A config whose one backend is `url`, health probes every `probe_ms` (0: off).
fn config_to(url: &str, probe_ms: u64) -> ProxyConfig {
    let timeout_ms = probe_ms.max(1);
    ProxyConfig::from_toml_str(&format!(
        "listen = \"127.0.0.1:0\"\n[admin]\nlisten = \"127.0.0.1:0\"\n\
         [health]\ninterval_ms = {probe_ms}\ntimeout_ms = {timeout_ms}\nunhealthy_threshold = 1\n\
         [[backends]]\nname = \"next\"\nurl = \"{url}\"\n"
    ))
    .unwrap()
}

/// A proxy started towards a placeholder backend, then pointed at `url(proxy)` by a reload:
/// its own address is known only once it listens.
async fn proxy_pointed_at(url: impl Fn(&TestProxy) -> String, probe_ms: u64) -> TestProxy {
    let proxy = start_proxy(config_to("http://127.0.0.1:9", 0)).await;
    proxy
        .handle()
        .reload(config_to(&url(&proxy), probe_ms))
        .unwrap();
    proxy
}

async fn h2_post(proxy: &TestProxy) -> (http::StatusCode, Bytes) {
    let mut send = h2_sender::<Full<Bytes>>(proxy.addr).await;
    let req = http::Request::post(proxy.url("/v1/chat/completions"))
        .body(Full::new(Bytes::from(chat_body("loop", 0))))
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    let status = resp.status();
    (status, resp.into_body().collect().await.unwrap().to_bytes())
}

/// A proxy whose backend is itself answers 508 to the first repeat, once per request, over
/// HTTP/1.1 and HTTP/2, instead of forwarding to itself until a limit breaks.
#[tokio::test]
async fn a_proxy_whose_backend_is_itself_answers_508_at_the_first_repeat() {
    let proxy = proxy_pointed_at(|p| p.url(""), 0).await;
    let (status, headers, body) = fetch(
        &client(),
        "POST",
        &proxy.url("/v1/chat/completions"),
        &[("content-type", "application/json")],
        chat_body("loop", 0),
    )
    .await;
    assert_eq!(status, 508, "{}", String::from_utf8_lossy(&body));
    assert_eq!(headers["x-agentrace-error"], "loop_detected");
    assert_eq!(
        proxy.counter(LOOPS).await,
        1,
        "one refusal per looping request"
    );
    let (status, body) = h2_post(&proxy).await;
    assert_eq!(status, 508, "{}", String::from_utf8_lossy(&body));
    assert_eq!(proxy.counter(LOOPS).await, 2);
    proxy.shutdown().await;
}

/// A loop through a second proxy closes at the first one, the instance that sees its own
/// name come back; the second passes the request on (it is not its loop) and the 508 back.
#[tokio::test]
async fn a_loop_through_another_proxy_is_refused_by_the_instance_it_returns_to() {
    let a = start_proxy(config_to("http://127.0.0.1:9", 0)).await;
    let b = start_proxy(config_to(&a.url(""), 0)).await;
    a.handle().reload(config_to(&b.url(""), 0)).unwrap();
    let (status, _, body) = fetch(
        &client(),
        "POST",
        &a.url("/v1/chat/completions"),
        &[],
        chat_body("loop", 0),
    )
    .await;
    assert_eq!(status, 508, "{}", String::from_utf8_lossy(&body));
    assert_eq!(a.counter(LOOPS).await, 1);
    assert_eq!(b.counter(LOOPS).await, 0);
    b.shutdown().await;
    a.shutdown().await;
}

/// A backend sees this proxy's `Via` entry, after the earlier hops', naming the protocol
/// the client used.
#[tokio::test]
async fn forwarded_requests_carry_the_proxys_via_entry() {
    let backend = TestBackend::spawn("b").await;
    let proxy = start_proxy(config_for(&[&backend])).await;
    let (status, _, _) = fetch(
        &client(),
        "GET",
        &proxy.url("/v1/models"),
        &[("via", "1.0 edge")],
        "",
    )
    .await;
    assert_eq!(status, 200);
    let via = backend.last_headers().unwrap()["via"]
        .to_str()
        .unwrap()
        .to_string();
    let mine = via.strip_prefix("1.0 edge, 1.1 agentrace-");
    assert!(mine.is_some_and(|token| token.len() == 16), "{via}");
    let (status, _) = h2_post(&proxy).await;
    assert_eq!(status, 200);
    let via2 = backend.last_headers().unwrap()["via"].clone();
    assert_eq!(via2, format!("2 agentrace-{}", mine.unwrap()).as_str());
    proxy.shutdown().await;
}

/// A health probe to the proxy itself comes back with the proxy's own name and is refused:
/// the backend goes out, where before the probes looped, each holding connections.
#[tokio::test]
async fn a_health_probe_that_comes_back_takes_the_backend_out() {
    let proxy = proxy_pointed_at(|p| p.url(""), 200).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, _, body) = fetch(
            &client(),
            "GET",
            &proxy.admin_url("/admin/backends"),
            &[],
            "",
        )
        .await;
        let backends: serde_json::Value = serde_json::from_slice(&body).unwrap();
        let healthy = backends
            .as_array()
            .or_else(|| backends["backends"].as_array())
            .and_then(|list| list.first())
            .map(|b| b["healthy"].as_bool());
        if healthy == Some(Some(false)) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the self-pointing backend is still healthy: {backends}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let metrics = proxy.metrics().await;
    assert!(
        series_value(&metrics, LOOPS) >= 1,
        "the probe was not refused as a loop"
    );
    let forwarded: u64 = metrics
        .lines()
        .filter(|l| l.starts_with("agentrace_requests_total{backend=\"next\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum();
    assert_eq!(
        forwarded, 0,
        "probes were forwarded round the loop:\n{metrics}"
    );
    proxy.shutdown().await;
}
