//! The picker as a gateway sees it, over real gRPC (no gateway needed): the same session key
//! always gets the same endpoint, named alike in the header and the `envoy.lb` metadata; the
//! body passes through unchanged; a subset hint is obeyed (503 when it leaves nothing); a
//! served endpoint the picker did not offer moves no session; no healthy
//! endpoint gives 503, every endpoint at the shedding bound gives 429, an oversized body 413;
//! gRPC health answers for liveness and readiness; a reload swaps the endpoints; an endpoint
//! that is not `http://IP:PORT` is refused, naming the field. Hostile clients: malformed
//! messages end the stream with a gRPC error, held bodies share the proxy's body budget, an
//! in-flight count ends after `epp.in_flight_max_ms`, a bearer token keeps others out.

mod support;

use std::net::SocketAddr;

use envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use serde_json::json;
use support::backends::TestBackend;
use support::epp::{self as fixture, Stream};

async fn endpoints(n: usize) -> (Vec<TestBackend>, Vec<(String, SocketAddr)>) {
    let mut backends = Vec::new();
    let mut list = Vec::new();
    for i in 0..n {
        let b = TestBackend::spawn(&format!("e{i}")).await;
        list.push((format!("e{i}"), b.addr));
        backends.push(b);
    }
    (backends, list)
}

fn chat(user: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({"model": "m", "messages": [
        {"role": "system", "content": "agent"}, {"role": "user", "content": user}]}))
    .unwrap()
}

#[tokio::test]
async fn a_session_key_gets_one_endpoint_named_alike_in_header_and_metadata() {
    let (_b, list) = endpoints(4).await;
    let epp = fixture::start(fixture::config(&list)).await;
    let addrs: Vec<String> = list.iter().map(|(_, a)| a.to_string()).collect();
    let mut seen = std::collections::BTreeSet::new();
    for s in 0..16 {
        let key = format!("session-{s}");
        let mut first = None;
        for turn in 0..3 {
            let mut stream = Stream::open(epp.addr()).await;
            let picked = stream
                .request(
                    &[("x-session-id", &key)],
                    &chat(&format!("turn {turn}")),
                    None,
                )
                .await
                .expect("placed");
            assert!(addrs.contains(&picked), "{picked} is one of the endpoints");
            assert_eq!(*first.get_or_insert(picked.clone()), picked, "{key} moved");
        }
        seen.insert(first.unwrap());
    }
    assert!(seen.len() > 1, "16 sessions all on one endpoint: {seen:?}");
    let metrics = epp.metrics().await;
    assert!(
        metrics.contains("agentrace_routing_decisions_total") || metrics.contains("decisions"),
        "{metrics}"
    );
    epp.stop().await;
}

#[tokio::test]
async fn headerless_chat_turns_of_one_conversation_share_an_endpoint_by_fingerprint() {
    let (_b, list) = endpoints(4).await;
    let epp = fixture::start(fixture::config(&list)).await;
    let mut picks = std::collections::BTreeSet::new();
    let mut messages = vec![
        json!({"role": "system", "content": "agent"}),
        json!({"role": "user", "content": "fix the bug"}),
    ];
    for turn in 0..4 {
        let body = serde_json::to_vec(&json!({"model": "m", "messages": messages})).unwrap();
        let mut stream = Stream::open(epp.addr()).await;
        picks.insert(stream.request(&[], &body, None).await.expect("placed"));
        messages.push(json!({"role": "assistant", "content": format!("answer {turn}")}));
        messages.push(json!({"role": "user", "content": format!("next {turn}")}));
    }
    assert_eq!(picks.len(), 1, "one conversation, one endpoint: {picks:?}");
    assert!(epp.metrics().await.contains("source=\"fingerprint\""));
    epp.stop().await;
}

#[tokio::test]
async fn a_subset_hint_is_obeyed_and_an_empty_or_foreign_one_gets_503() {
    let (_b, list) = endpoints(4).await;
    let epp = fixture::start(fixture::config(&list)).await;
    let only = vec![list[2].1.to_string()];
    for s in 0..8 {
        let mut stream = Stream::open(epp.addr()).await;
        let picked = stream
            .request(
                &[("x-session-id", &format!("s{s}"))],
                &chat("hi"),
                Some(fixture::subset(&only)),
            )
            .await;
        assert_eq!(picked, Ok(only[0].clone()));
    }
    for hint in [vec![], vec!["10.9.9.9:80".to_string()]] {
        let mut stream = Stream::open(epp.addr()).await;
        let got = stream
            .request(
                &[("x-session-id", "x")],
                &chat("hi"),
                Some(fixture::subset(&hint)),
            )
            .await;
        assert_eq!(got, Err(503), "hint {hint:?}");
    }
    epp.stop().await;
}

#[tokio::test]
async fn a_served_endpoint_the_picker_did_not_offer_does_not_move_the_session() {
    let (_b, list) = endpoints(3).await;
    let epp = fixture::start(fixture::config(&list)).await;
    let mut stream = Stream::open(epp.addr()).await;
    let picked = stream
        .request(&[("x-session-id", "moved")], &chat("hi"), None)
        .await
        .unwrap();
    let other = list
        .iter()
        .map(|(_, a)| a.to_string())
        .find(|a| *a != picked)
        .unwrap();
    stream
        .send(fixture::response_headers_msg(Some(fixture::served(&other))))
        .await;
    stream.recv().await;
    drop(stream);
    let mut next = Stream::open(epp.addr()).await;
    let again = next
        .request(&[("x-session-id", "moved")], &chat("hi again"), None)
        .await
        .unwrap();
    assert_eq!(
        again, picked,
        "only an endpoint offered for the stream may rebind its session"
    );
    assert!(epp
        .metrics()
        .await
        .contains("agentrace_epp_refusals_total{reason=\"served_not_offered\"} 1"));
    epp.stop().await;
}

#[tokio::test]
async fn no_healthy_endpoint_gives_503_and_a_full_pool_sheds_with_429() {
    let (backends, list) = endpoints(2).await;
    let mut config = fixture::config(&list);
    config.epp.shed_in_flight = 1;
    let epp = fixture::start(config).await;
    // Two streams held open: one request in flight on each endpoint.
    let mut held = Vec::new();
    for key in ["a", "b", "c", "d", "e", "f"] {
        let mut s = Stream::open(epp.addr()).await;
        if s.request(&[("x-session-id", key)], &chat("hold"), None)
            .await
            .is_ok()
        {
            held.push(s);
        }
        if held.len() == 2 {
            break;
        }
    }
    assert_eq!(held.len(), 2, "each endpoint takes one");
    let mut s = Stream::open(epp.addr()).await;
    assert_eq!(
        s.request(&[("x-session-id", "late")], &chat("x"), None)
            .await,
        Err(429)
    );
    drop(held);

    for b in &backends {
        b.set_healthy(false);
    }
    for (name, _) in &list {
        epp.wait_health(name, false).await;
    }
    let mut s = Stream::open(epp.addr()).await;
    assert_eq!(
        s.request(&[("x-session-id", "down")], &chat("x"), None)
            .await,
        Err(503)
    );
    assert!(epp.metrics().await.contains("503"));
    epp.stop().await;
}

#[tokio::test]
async fn a_body_over_max_request_body_bytes_gets_413() {
    let (_b, list) = endpoints(1).await;
    let mut config = fixture::config(&list);
    config.max_request_body_bytes = 1_000;
    config.request_body_budget_bytes = 1_000;
    let epp = fixture::start(config).await;
    let mut s = Stream::open(epp.addr()).await;
    s.send(fixture::headers_msg(&[], false, None)).await;
    s.send(fixture::body_msg(&[b'x'; 600], false)).await;
    s.send(fixture::body_msg(&[b'x'; 600], true)).await;
    match s.recv().await {
        envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response::ImmediateResponse(i) => {
            assert_eq!(i.status.unwrap().code, 413)
        }
        other => panic!("expected 413, got {other:?}"),
    }
    epp.stop().await;
}

#[tokio::test]
async fn grpc_health_serves_liveness_and_readiness() {
    let (_b, list) = endpoints(1).await;
    let epp = fixture::start(fixture::config(&list)).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", epp.addr()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = tonic_health::pb::health_client::HealthClient::new(channel);
    for service in [
        "liveness",
        "readiness",
        "envoy.service.ext_proc.v3.ExternalProcessor",
    ] {
        let reply = client
            .check(tonic_health::pb::HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            reply.status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32,
            "{service}"
        );
    }
    let unknown = client
        .check(tonic_health::pb::HealthCheckRequest {
            service: "nope".into(),
        })
        .await;
    assert!(
        unknown.is_err(),
        "an unknown service is not reported serving"
    );
    epp.stop().await;
}

#[tokio::test]
async fn a_reload_swaps_the_endpoints_and_a_non_ip_endpoint_is_refused_naming_the_field() {
    let (_b, list) = endpoints(3).await;
    let epp = fixture::start(fixture::config(&list[..1])).await;
    let mut s = Stream::open(epp.addr()).await;
    assert_eq!(
        s.request(&[("x-session-id", "r")], &chat("x"), None).await,
        Ok(list[0].1.to_string())
    );
    epp.handle.reload(fixture::config(&list[1..2])).unwrap();
    let mut s = Stream::open(epp.addr()).await;
    assert_eq!(
        s.request(&[("x-session-id", "r")], &chat("x"), None).await,
        Ok(list[1].1.to_string())
    );

    let mut bad = fixture::config(&list[..1]);
    bad.backends[0].url = "http://model-server.local:8000".into();
    let err = epp.handle.reload(bad.clone()).unwrap_err().to_string();
    assert!(err.contains("backends[0].url"), "{err}");
    assert_eq!(
        epp.handle.endpoints(),
        vec![list[1].1.to_string()],
        "the running endpoints stay"
    );
    let (_t, shutdown) = agentrace::shutdown::channel();
    let err = agentrace::epp::start("127.0.0.1:0".parse().unwrap(), bad, shutdown)
        .await
        .err()
        .unwrap();
    assert!(
        err.is_config() && err.to_string().contains("backends[0].url"),
        "{err}"
    );
    epp.stop().await;
}

/// A refused reload counts in `agentrace_config_reloads_total{result="refused"}` as the
/// proxy's does, whether the file does not load (SIGHUP to the binary) or an endpoint is
/// refused by the picker.
#[tokio::test]
async fn a_refused_reload_counts_as_refused_in_the_reload_metric() {
    let (_b, list) = endpoints(1).await;
    let epp = fixture::start(fixture::config(&list)).await;
    let mut bad = fixture::config(&list);
    bad.backends[0].url = "http://model-server.local:8000".into();
    assert!(epp.handle.reload(bad).is_err());
    let metrics = epp.metrics().await;
    assert!(
        metrics.contains("agentrace_config_reloads_total{result=\"refused\"} 1"),
        "{metrics}"
    );
    epp.stop().await;

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("epp.toml");
    let good = format!(
        "[[backends]]\nname = \"e0\"\nurl = \"http://{}\"\n",
        list[0].1
    );
    std::fs::write(&path, &good).unwrap();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_agentrace"))
        .args([
            "epp",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .arg("--config")
        .arg(&path)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stdout =
        tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(child.stdout.take().unwrap()));
    let line = tokio::time::timeout(std::time::Duration::from_secs(30), stdout.next_line())
        .await
        .expect("announced within 30 s")
        .unwrap()
        .expect("an announcement");
    // "agentrace epp listening on ADDR (admin ADMIN)"
    let admin: SocketAddr = line
        .rsplit(' ')
        .next()
        .unwrap()
        .trim_end_matches(')')
        .parse()
        .unwrap_or_else(|e| panic!("{line}: {e}"));
    std::fs::write(&path, "backends = 3\n").unwrap();
    let pid = child.id().unwrap() as libc::pid_t;
    // SAFETY: signalling the child this test started, by its PID.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGHUP) }, 0);
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let reply = support::sim::get(admin, "/metrics").await;
        let metrics = String::from_utf8(reply.body().to_vec()).unwrap();
        if metrics.contains("agentrace_config_reloads_total{result=\"refused\"} 1") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the refused SIGHUP reload was not counted: {metrics}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let status = tokio::time::timeout(std::time::Duration::from_secs(20), child.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(0));
}

/// Polls `/metrics` until `line` appears, for up to 10 s.
async fn wait_metric(epp: &fixture::TestEpp, line: &str) {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let metrics = epp.metrics().await;
        if metrics.lines().any(|l| l == line) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no {line:?} within 10 s in:\n{metrics}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// One ext_proc call over raw HTTP/2 carrying `body` as its request stream; the call's
/// `grpc-status` (from the trailers, or a trailers-only answer's head).
async fn raw_call(addr: SocketAddr, body: &[u8]) -> String {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut client, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    let request = http::Request::post(format!(
        "http://{addr}/envoy.service.ext_proc.v3.ExternalProcessor/Process"
    ))
    .header("content-type", "application/grpc")
    .header("te", "trailers")
    .body(())
    .unwrap();
    let (response, mut send) = client.send_request(request, false).unwrap();
    send.send_data(bytes::Bytes::copy_from_slice(body), true)
        .unwrap();
    let response = tokio::time::timeout(std::time::Duration::from_secs(10), response)
        .await
        .expect("an answer within 10 s")
        .unwrap();
    if let Some(status) = response.headers().get("grpc-status") {
        return status.to_str().unwrap().to_string();
    }
    let mut body = response.into_body();
    while let Some(chunk) = body.data().await {
        let _ = chunk;
    }
    let trailers = body.trailers().await.unwrap().expect("trailers");
    trailers["grpc-status"].to_str().unwrap().to_string()
}

fn grpc_frame(flag: u8, declared: u32, payload: &[u8]) -> Vec<u8> {
    let mut frame = vec![flag];
    frame.extend_from_slice(&declared.to_be_bytes());
    frame.extend_from_slice(payload);
    frame
}

#[tokio::test]
async fn malformed_ext_proc_messages_end_the_stream_with_an_error_status_and_are_counted() {
    let (_b, list) = endpoints(1).await;
    let epp = fixture::start(fixture::config(&list)).await;
    // ProcessingRequest { request_body (4): HttpBody { body (1): "x", end_of_stream (2): true } }
    let body_first = [0x22, 0x05, 0x0a, 0x01, b'x', 0x10, 0x01];
    let cases: [(&str, Vec<u8>, &str); 7] = [
        ("garbage protobuf", grpc_frame(0, 5, &[0xff; 5]), "3"),
        ("4 GiB length prefix", grpc_frame(0, u32::MAX, b"ab"), "8"),
        (
            "compressed with no grpc-encoding",
            grpc_frame(1, 2, b"ab"),
            "3",
        ),
        ("compression flag 2", grpc_frame(2, 2, b"ab"), "3"),
        ("message cut short", grpc_frame(0, 100, b"abc"), "3"),
        ("no request phase", grpc_frame(0, 0, b""), "3"),
        (
            "body before headers",
            grpc_frame(0, body_first.len() as u32, &body_first),
            "3",
        ),
    ];
    for (what, bytes, want) in &cases {
        let status = raw_call(epp.addr(), bytes).await;
        assert_eq!(&status, want, "{what}: grpc-status");
    }
    wait_metric(
        &epp,
        "agentrace_epp_refusals_total{reason=\"malformed_message\"} 7",
    )
    .await;
    epp.stop().await;
}

#[tokio::test]
async fn a_request_never_answered_stops_counting_in_flight_after_in_flight_max_ms() {
    let (_b, list) = endpoints(1).await;
    let mut config = fixture::config(&list);
    config.epp.in_flight_max_ms = 300;
    let epp = fixture::start(config).await;
    let mut held = Stream::open(epp.addr()).await;
    held.request(&[("x-session-id", "stuck")], &chat("hi"), None)
        .await
        .unwrap();
    // Counted while the response is under way, then no longer, though the stream stays open.
    wait_metric(&epp, "agentrace_in_flight{backend=\"e0\"} 1").await;
    wait_metric(&epp, "agentrace_in_flight{backend=\"e0\"} 0").await;
    wait_metric(
        &epp,
        "agentrace_epp_refusals_total{reason=\"in_flight_expired\"} 1",
    )
    .await;
    drop(held);
    epp.stop().await;
}

#[tokio::test]
async fn bodies_held_by_the_picker_share_the_body_budget_and_past_it_get_the_proxys_503() {
    let (_b, list) = endpoints(1).await;
    let mut config = fixture::config(&list);
    config.max_request_body_bytes = 1 << 20;
    config.request_body_budget_bytes = 1 << 20;
    let epp = fixture::start(config).await;
    // One stream holds most of the budget with a body not yet complete.
    let holder = Stream::open(epp.addr()).await;
    holder.send(fixture::headers_msg(&[], false, None)).await;
    holder
        .send(fixture::body_msg(&vec![b'x'; 900 << 10], false))
        .await;
    wait_metric(&epp, "agentrace_request_body_bytes_held 921600").await;
    let mut late = Stream::open(epp.addr()).await;
    late.send(fixture::headers_msg(&[], false, None)).await;
    late.send(fixture::body_msg(&vec![b'y'; 200 << 10], true))
        .await;
    match late.recv().await {
        envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response::ImmediateResponse(i) => {
            assert_eq!(i.status.unwrap().code, 503);
            let body: serde_json::Value = serde_json::from_slice(&i.body).unwrap();
            assert_eq!(body["error"]["type"], "overloaded");
            let headers = i.headers.unwrap().set_headers;
            let retry = headers
                .iter()
                .map(|h| h.header.as_ref().unwrap())
                .find(|h| h.key == "retry-after")
                .expect("retry-after, as the proxy answers");
            assert_eq!(retry.raw_value, b"1");
        }
        other => panic!("expected 503, got {other:?}"),
    }
    assert!(epp
        .metrics()
        .await
        .contains("agentrace_body_budget_refusals_total 1"));
    // The held bytes are given back when the holder goes.
    drop(holder);
    wait_metric(&epp, "agentrace_request_body_bytes_held 0").await;
    epp.stop().await;
}

#[tokio::test]
async fn with_a_token_file_a_stream_without_the_token_is_refused_before_placement() {
    let (_b, list) = endpoints(1).await;
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "s3cret-token\n").unwrap();
    let mut config = fixture::config(&list);
    config.epp.token_file = Some(token_file);
    let epp = fixture::start(config).await;
    for token in [None, Some("wrong-token!")] {
        let refused = Stream::open_with_token(epp.addr(), token).await;
        assert_eq!(
            refused.err().map(|s| s.code()),
            Some(tonic::Code::Unauthenticated),
            "token {token:?}"
        );
    }
    let mut s = Stream::open_with_token(epp.addr(), Some("s3cret-token"))
        .await
        .unwrap();
    s.request(&[("x-session-id", "ok")], &chat("hi"), None)
        .await
        .unwrap();
    let metrics = epp.metrics().await;
    assert!(metrics.contains("agentrace_epp_refusals_total{reason=\"unauthenticated\"} 2"));
    let placed: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("agentrace_affinity_decisions_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(placed, 1.0, "only the stream with the token was placed");
    epp.stop().await;
}

/// A chat turn of `size` bytes of user text, and the `content-length` a gateway sends with it.
fn sized_chat(turn: usize, size: usize) -> (Vec<u8>, String) {
    let mut messages = vec![json!({"role": "user", "content": "x".repeat(size)})];
    for t in 0..turn {
        messages.push(json!({"role": "assistant", "content": format!("answer {t}")}));
        messages.push(json!({"role": "user", "content": format!("more {t}")}));
    }
    let body = serde_json::to_vec(&json!({"model": "m", "messages": messages})).unwrap();
    let length = body.len().to_string();
    (body, length)
}

/// Ends the request as the gateway would once the response head came back, so the next
/// request sees this one finished.
async fn finish(stream: &mut Stream) {
    stream.send(fixture::response_headers_msg(None)).await;
    stream.recv().await;
}

#[tokio::test]
async fn a_known_session_is_placed_at_its_request_headers_before_its_body_arrives() {
    let (_b, list) = endpoints(3).await;
    let epp = fixture::start(fixture::config(&list)).await;
    let (first, length) = sized_chat(0, 200);
    let mut stream = Stream::open(epp.addr()).await;
    let home = stream
        .request(
            &[("x-session-id", "early"), ("content-length", &length)],
            &first,
            None,
        )
        .await
        .expect("placed");
    finish(&mut stream).await;

    let (next, length) = sized_chat(1, 200);
    let mut stream = Stream::open(epp.addr()).await;
    stream
        .send(fixture::headers_msg(
            &[("x-session-id", "early"), ("content-length", &length)],
            false,
            None,
        ))
        .await;
    // Nothing of the body is sent yet: the answer must come from the headers alone.
    let picked = match stream.recv().await {
        r @ Response::RequestHeaders(_) => r,
        other => panic!("expected the destination, got {other:?}"),
    };
    let Response::RequestHeaders(h) = picked else {
        unreachable!()
    };
    let set = h.response.unwrap().header_mutation.unwrap().set_headers;
    let endpoint = String::from_utf8(set[0].header.as_ref().unwrap().raw_value.clone()).unwrap();
    assert_eq!(
        endpoint, home,
        "the session stays where its first turn went"
    );
    // The body then streams through, chunk by chunk, unchanged.
    let (a, b) = next.split_at(next.len() / 2);
    for (chunk, end) in [(a, false), (b, true)] {
        stream.send(fixture::body_msg(chunk, end)).await;
        match stream.recv().await {
            Response::RequestBody(r) => match r.response.unwrap().body_mutation.unwrap().mutation {
                Some(Mutation::StreamedResponse(s)) => {
                    assert_eq!(s.body, chunk);
                    assert_eq!(s.end_of_stream, end);
                }
                other => panic!("unexpected body mutation {other:?}"),
            },
            other => panic!("expected the body chunk back, got {other:?}"),
        }
    }
    epp.stop().await;
}

#[tokio::test]
async fn header_only_placement_sends_each_session_where_the_streamed_body_does() {
    let (_b, list) = endpoints(4).await;
    let with_body = fixture::start(fixture::config(&list)).await;
    let header_only = fixture::start(fixture::config(&list)).await;
    let mut by_body = Vec::new();
    let mut by_headers = Vec::new();
    // Turns of very different sizes, so that where a new session starts depends on its bytes.
    for turn in 0..3 {
        for s in 0..24 {
            let key = format!("session-{s}");
            let (body, length) = sized_chat(turn, 100 + (s % 6) * (s % 6) * 4000);
            let headers = [("x-session-id", key.as_str()), ("content-length", &length)];

            let mut stream = Stream::open(with_body.addr()).await;
            by_body.push(stream.request(&headers, &body, None).await.expect("placed"));
            finish(&mut stream).await;

            let mut stream = Stream::open(header_only.addr()).await;
            let mut msg = fixture::headers_msg(&headers, false, None);
            // request_body_mode: NONE, the gateway's header-only configuration.
            msg.protocol_config.as_mut().unwrap().request_body_mode = 0;
            stream.send(msg).await;
            let Response::RequestHeaders(h) = stream.recv().await else {
                panic!("expected the destination at the headers");
            };
            let set = h.response.unwrap().header_mutation.unwrap().set_headers;
            by_headers.push(
                String::from_utf8(set[0].header.as_ref().unwrap().raw_value.clone()).unwrap(),
            );
            finish(&mut stream).await;
        }
    }
    assert_eq!(
        by_headers, by_body,
        "each request goes where the body mode places it"
    );
    let spread: std::collections::BTreeSet<_> = by_body.iter().collect();
    assert!(spread.len() > 1, "all on one endpoint: {spread:?}");
    with_body.stop().await;
    header_only.stop().await;
}
