//! The recorder inside a real proxy, in front of the simulator or a scripted upstream: a
//! 20-turn session round-trips capture → export → validate → replay, streams still pass event
//! by event, a proxy killed with SIGKILL leaves every flushed record readable, an
//! unwritable capture directory never stops forwarding, and a full queue under the `block`
//! policy slows only the exchanges that wait for room.

mod support;

use std::sync::Arc;

use agentrace::capture::export::{self, ExportOptions};
use agentrace::capture::reader;
use bytes::Bytes;
use serde_json::Value;
use support::capture::*;
use tokio::time::{Duration, Instant};

const SECRET: &str = "Bearer sk-e2e-SECRET-token-123456";

fn json_body(body: &[u8]) -> Value {
    serde_json::from_slice::<Value>(body).unwrap()
}

// Round trip: 20 turns of one session through proxy (capture on) → simulator; the capture
// holds each request and response byte for byte with the secret redacted; its export passes
// the dataset validator with 20 client turns; a closed-loop replay of that export through a
// second capturing proxy sends the same request bodies, turn by turn and field by field
// (messages and every generation setting the agent set).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_turn_session_round_trips_through_capture_export_and_replay() {
    let (stop_sim, sim_shutdown) = agentrace::shutdown::channel();
    let sim = start_sim(sim_shutdown);
    let dir = tempfile::tempdir().unwrap();
    let first = dir.path().join("first");
    let (stop_first, first_shutdown) = agentrace::shutdown::channel();
    let proxy = start_proxy(&sim.addrs(), Some(config(&first)), first_shutdown).await;
    let url = format!("http://{}/v1/chat/completions", proxy.addr);
    let client = client();
    let (bodies, replies) =
        agent_session(&client, &url, "e2e-1", 20, &[("authorization", SECRET)]).await;
    // Stop the proxy: its recorder finishes and closes the segment.
    stop_first.fire();
    proxy.join().await;

    let capture = read_by_arrival(&first);
    assert!(capture.cuts.is_empty(), "{:?}", capture.cuts);
    assert_eq!(capture.exchanges.len(), 20);
    for (i, e) in capture.exchanges.iter().enumerate() {
        assert_eq!(e.record.session.as_deref(), Some("e2e-1"));
        assert_eq!(e.request_body.as_deref(), Some(&bodies[i][..]), "turn {i}");
        assert_eq!(
            e.response_body.as_deref(),
            Some(&replies[i][..]),
            "turn {i}"
        );
        let auth = e
            .record
            .request
            .headers
            .iter()
            .find(|(k, _)| k == "authorization");
        assert!(auth.unwrap().1.starts_with("REDACTED-"));
        assert!(!e.event_offsets_us().is_empty());
    }
    assert!(!contains(&all_bytes(&first), b"sk-e2e-SECRET"));

    let dataset_path = dir.path().join("export.jsonl");
    let report = export::export(&first, &dataset_path, &ExportOptions::default()).unwrap();
    assert_eq!(
        (report.conversations, report.client_turns),
        (1, 20),
        "{report:?}"
    );
    let dataset = agentrace::dataset::load(&dataset_path, &Default::default()).unwrap();
    assert_eq!(dataset.conversations[0].client_turns.len(), 20);

    let second = dir.path().join("second");
    let (stop_second, second_shutdown) = agentrace::shutdown::channel();
    let replay_proxy = start_proxy(&sim.addrs(), Some(config(&second)), second_shutdown).await;
    let replay_config = agentrace::replay::ReplayConfig {
        target: format!("http://{}", replay_proxy.addr).into(),
        dataset: Some(dataset_path.clone()),
        model_name: Some("m".into()),
        concurrency: 1,
        enable_salt: false,
        inject_tool_delay: false,
        ..Default::default()
    };
    let (_stop_replay, replay_shutdown) = agentrace::shutdown::channel();
    let summary = agentrace::replay::run(
        replay_config,
        Arc::new(dataset),
        &dir.path().join("replay-out"),
        replay_shutdown,
    )
    .await
    .unwrap();
    assert_eq!(summary.turns_ok, 20, "{summary:?}");
    stop_second.fire();
    replay_proxy.join().await;
    let replayed = read_by_arrival(&second);
    assert_eq!(replayed.exchanges.len(), 20);
    for (i, (a, b)) in capture
        .exchanges
        .iter()
        .zip(&replayed.exchanges)
        .enumerate()
    {
        let captured = json_body(a.request_body.as_ref().unwrap());
        let replayed = json_body(b.request_body.as_ref().unwrap());
        for (field, value) in captured.as_object().unwrap() {
            assert_eq!(replayed.get(field), Some(value), "turn {i}: {field}");
        }
        assert_eq!(
            replayed.as_object().unwrap().len(),
            captured.as_object().unwrap().len(),
            "turn {i}: the replay sent fields the agent did not: {replayed}"
        );
    }
    stop_sim.fire();
    sim.join().await;
}

/// An upstream whose SSE events are released one at a time by the test.
async fn scripted_upstream() -> (
    std::net::SocketAddr,
    tokio::sync::mpsc::UnboundedSender<Bytes>,
) {
    use http_body_util::BodyExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Bytes>();
    let rx = Arc::new(parking_lot::Mutex::new(Some(rx)));
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let rx = rx.clone();
            let svc =
                hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                    let rx = if req.method() == http::Method::POST {
                        rx.lock().take()
                    } else {
                        None
                    };
                    async move {
                        let body = match rx {
                            Some(rx) => {
                                let stream =
                                    futures_util::stream::unfold(rx, |mut rx| async move {
                                        rx.recv().await.map(|b| {
                                            (
                                                Ok::<_, std::convert::Infallible>(
                                                    http_body::Frame::data(b),
                                                ),
                                                rx,
                                            )
                                        })
                                    });
                                http_body_util::StreamBody::new(stream).boxed()
                            }
                            None => http_body_util::Full::new(Bytes::from_static(b"ok"))
                                .map_err(|never| match never {})
                                .boxed(),
                        };
                        let resp = http::Response::builder()
                            .header("content-type", "text/event-stream")
                            .body(body)
                            .unwrap();
                        Ok::<_, std::convert::Infallible>(resp)
                    }
                });
            tokio::spawn(async move {
                let io = hyper_util::rt::TokioIo::new(stream);
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(io, svc)
                    .await;
            });
        }
    });
    (addr, tx)
}

// Streaming: with capture on, each SSE event reaches the client before the upstream sends
// the next (the upstream waits for the client to see it, so a buffering proxy would hang);
// the capture stamps each event with its own, non-decreasing offset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_are_forwarded_event_by_event_with_capture_on() {
    use http_body_util::BodyExt;
    let (stop, shutdown) = agentrace::shutdown::channel();
    let (upstream, events) = scripted_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = start_proxy(&[upstream], Some(config(dir.path())), shutdown).await;
    let req = http::Request::post(format!("http://{}/v1/chat/completions", proxy.addr))
        .header("x-session-id", "stream-1")
        .body(http_body_util::Full::new(Bytes::from_static(
            b"{\"messages\":[]}",
        )))
        .unwrap();
    let resp = client().request(req).await.unwrap();
    let mut body = resp.into_body();
    let sent: Vec<String> = (0..4).map(|i| format!("data: {{\"i\":{i}}}\n\n")).collect();
    let mut received = Vec::new();
    for event in &sent {
        events.send(Bytes::from(event.clone())).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let frame = tokio::time::timeout_at(deadline, body.frame())
            .await
            .expect("event held back by the proxy")
            .unwrap()
            .unwrap();
        let data = frame.into_data().unwrap();
        assert_eq!(data, event.as_bytes(), "each event arrives alone and whole");
        received.push(data);
    }
    drop(events);
    assert!(body.frame().await.is_none());
    stop.fire();
    proxy.join().await;
    let back = read_all(dir.path());
    assert_eq!(back.len(), 1);
    let offsets = back[0].event_offsets_us();
    assert_eq!(offsets.len(), 4);
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{offsets:?}");
    assert_eq!(
        back[0].response_body.as_deref(),
        Some(&received.concat()[..])
    );
}

// Crash safety: a proxy child process killed with SIGKILL mid-run leaves every record that
// was readable before the kill readable after it, bodies intact; later records are either
// whole or absent, and the reader says where the segment stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_the_proxy_keeps_every_record_flushed_before_it() {
    let (_stop, shutdown) = agentrace::shutdown::channel();
    let sim = start_sim(shutdown);
    let dir = tempfile::tempdir().unwrap();
    let backend = format!("http://{}", sim.addrs()[0]);
    let mut proxy = support::proxy_process::ProxyProcess::spawn(&[
        "--backend",
        &backend,
        "--capture",
        dir.path().to_str().unwrap(),
    ])
    .await;
    let addr = proxy.addr.clone();
    let url = format!("http://{addr}/v1/chat/completions");
    let client = client();
    let (before, _) = agent_session(&client, &url, "crash-1", 5, &[]).await;
    let path = dir.path().to_path_buf();
    let deadline = Instant::now() + Duration::from_secs(30);
    while reader::read_dir(&path)
        .map(|c| c.exchanges.len())
        .unwrap_or(0)
        < before.len()
    {
        assert!(Instant::now() < deadline, "records not flushed within 30 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (after, _) = agent_session(&client, &url, "crash-2", 3, &[]).await;
    proxy.child.start_kill().unwrap();
    proxy.child.wait().await.unwrap();

    let capture = read_by_arrival(&path);
    let got: Vec<&[u8]> = capture
        .exchanges
        .iter()
        .map(|e| e.request_body.as_deref().unwrap())
        .collect();
    assert!(got.len() >= before.len());
    for (i, body) in before.iter().enumerate() {
        assert_eq!(got[i], &body[..], "flushed record {i}");
    }
    for (i, body) in got[before.len()..].iter().enumerate() {
        assert_eq!(*body, &after[i][..], "record after the last check {i}");
    }
    assert!(capture.cuts.len() <= 1, "{:?}", capture.cuts);
}

// Unwritable directory: every request is still answered in full, and the proxy's metrics
// count every exchange as a lost record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unwritable_capture_directory_keeps_the_proxy_forwarding() {
    let (stop, shutdown) = agentrace::shutdown::channel();
    let sim = start_sim(shutdown.clone());
    let dir = tempfile::tempdir().unwrap();
    let blocker = dir.path().join("file");
    std::fs::write(&blocker, b"x").unwrap();
    let proxy = start_proxy(
        &sim.addrs(),
        Some(config(&blocker.join("captures"))),
        shutdown,
    )
    .await;
    let url = format!("http://{}/v1/chat/completions", proxy.addr);
    let client = client();
    let (bodies, replies) = agent_session(&client, &url, "nowhere", 6, &[]).await;
    assert_eq!(bodies.len(), 6);
    assert!(replies.iter().all(|r| contains(r, b"[DONE]")));
    let metrics_url = format!("http://{}/metrics", proxy.admin_addr);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let resp = client.get(metrics_url.parse().unwrap()).await.unwrap();
        use http_body_util::BodyExt;
        let text = String::from_utf8(
            resp.into_body()
                .collect()
                .await
                .unwrap()
                .to_bytes()
                .to_vec(),
        )
        .unwrap();
        let lost: f64 = text
            .lines()
            .filter(|l| l.starts_with("agentrace_capture_records_lost_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        if lost == 6.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "lost records not counted:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.fire();
    proxy.join().await;
    sim.join().await;
}

/// Sends one streaming chat request of `session` on a client (and so a connection) of its
/// own: the receiver fires once the `[DONE]` event has arrived, the task ends with the whole
/// body once the response has ended.
fn stream_on_own_connection(
    url: &str,
    session: &str,
) -> (
    tokio::sync::oneshot::Receiver<()>,
    tokio::task::JoinHandle<Vec<u8>>,
) {
    use http_body_util::BodyExt;
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    let body = serde_json::json!({"model": "m", "stream": true, "max_completion_tokens": 8,
        "messages": [{"role": "user", "content": format!("hello from {session}")}]});
    let req = http::Request::post(url)
        .header("content-type", "application/json")
        .header("x-session-id", session)
        .body(http_body_util::Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let task = tokio::spawn(async move {
        let resp = client().request(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        let mut body = resp.into_body();
        let mut got = Vec::new();
        let mut done_tx = Some(done_tx);
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame.unwrap().into_data() {
                got.extend_from_slice(&data);
            }
            if contains(&got, b"[DONE]") {
                if let Some(tx) = done_tx.take() {
                    let _ = tx.send(());
                }
            }
        }
        got
    });
    (done_rx, task)
}

/// `full_policy = "block"` waits for room on the exchange whose record does not fit, never on
/// the forwarding thread: with one worker, a one-record queue and the writer held (as a stuck
/// disk would hold it), responses whose records wait still deliver every event, a new client
/// on the same worker is still served, and once the writer moves every record is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_policy_waits_on_the_exchange_never_on_the_worker_thread() {
    let (stop, shutdown) = agentrace::shutdown::channel();
    let sim = start_sim(shutdown.clone());
    let dir = tempfile::tempdir().unwrap();
    let rec = agentrace::capture::Recorder::start(&agentrace::capture::CaptureConfig {
        queue_capacity: 1,
        full_policy: agentrace::capture::FullPolicy::Block,
        ..config(dir.path())
    })
    .unwrap();
    let mut proxy_cfg = proxy_config(&sim.addrs());
    proxy_cfg.workers = 1;
    let proxy = agentrace::proxy::start_with_sink(proxy_cfg, shutdown, rec.sink.clone())
        .await
        .unwrap();
    let url = format!("http://{}/v1/chat/completions", proxy.addr);
    let hold = rec.hold_writer();
    // The writer takes the first record and is held with it: the queue's one slot stays taken.
    let (_, first) = stream_on_own_connection(&url, "first");
    let body = tokio::time::timeout(Duration::from_secs(30), first)
        .await
        .expect("the first exchange found room and ends")
        .unwrap();
    assert!(contains(&body, b"[DONE]"));
    let mut waiting = Vec::new();
    for session in ["second", "third", "probe"] {
        let (done, task) = stream_on_own_connection(&url, session);
        tokio::time::timeout(Duration::from_secs(20), done)
            .await
            .unwrap_or_else(|_| panic!("{session}: no [DONE] in 20 s: the worker thread is stuck"))
            .unwrap();
        waiting.push(task);
    }
    drop(hold);
    for task in waiting {
        let body = tokio::time::timeout(Duration::from_secs(30), task)
            .await
            .expect("a waiting exchange ends once the writer makes room")
            .unwrap();
        assert!(contains(&body, b"[DONE]"));
    }
    stop.fire();
    proxy.join().await;
    sim.join().await;
    rec.finish().await;
    let capture = reader::read_dir(dir.path()).unwrap();
    assert_eq!(capture.exchanges.len(), 4);
    assert_eq!(capture.dropped, 0);
}

// Open-loop replay: captured requests are sent in recorded start order, none before its due
// time (recorded offset / speed), with the captured bodies and the session header; the report
// gives every request's status and the schedule lag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_loop_replay_sends_captured_requests_at_scaled_recorded_times() {
    use agentrace::replay::open_loop::{self, OpenLoopOptions};
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("source");
    let rec = agentrace::capture::Recorder::start(&config(&source)).unwrap();
    let t0 = 1_780_000_000_000_000_000u128;
    let offsets_ms = [0u64, 120, 121, 300, 480, 600];
    let mut sent = Vec::new();
    for (i, off) in offsets_ms.iter().enumerate() {
        let session = format!("ol-{}", i % 2);
        let body = agent_bodies(&session, i / 2 + 1).pop().unwrap();
        let mut ex = FakeExchange::chat(Some(&session), body, "recorded reply");
        ex.headers.push(("x-session-id", session.clone()));
        ex.headers.push(("authorization", SECRET.into()));
        ex.start_unix_ns = Some(t0 + *off as u128 * 1_000_000);
        drive(rec.sink.as_ref(), &ex);
        sent.push(ex);
    }
    rec.finish().await;

    let (stop, shutdown) = agentrace::shutdown::channel();
    let sim = start_sim(shutdown.clone());
    let seen = dir.path().join("seen");
    let proxy = start_proxy(&sim.addrs(), Some(config(&seen)), shutdown.clone()).await;
    let speed = 2.0;
    let report = open_loop::run(
        OpenLoopOptions {
            target: format!("http://{}", proxy.addr),
            captures: vec![source.clone()],
            speed,
            out_dir: dir.path().join("out"),
            sessions: Vec::new(),
        },
        shutdown,
    )
    .await
    .unwrap();
    assert_eq!(
        (report.scheduled, report.sent, report.ok),
        (6, 6, 6),
        "{report:?}"
    );
    for (o, off) in report.requests.iter().zip(offsets_ms) {
        assert_eq!(o.status, Some(200));
        assert!((o.due_ms - off as f64 / speed).abs() < 1e-6, "{o:?}");
        assert!(o.lag_ms >= 0.0 && o.latency_ms.unwrap() >= o.ttfb_ms.unwrap());
    }
    assert!(report.schedule_lag.max_ms >= report.schedule_lag.p99_ms);
    assert!(dir.path().join("out/open-loop-report.json").exists());

    stop.fire();
    proxy.join().await;
    sim.join().await;
    // Requests due close together may reach the proxy in either order: match by body.
    let replayed = read_all(&seen);
    assert_eq!(replayed.len(), 6);
    let find = |want: &FakeExchange| {
        replayed
            .iter()
            .find(|e| e.request_body.as_deref() == Some(&want.body[..]))
            .expect("a captured request was not replayed byte for byte")
    };
    // Never early: request i reaches the proxy no earlier than its due time, and request 0
    // no later than its dispatch plus its time to first byte, so the gap between them is at
    // least due_i - (lag_0 + ttfb_0) (1 ms slack for the two clocks involved).
    let first = find(&sent[0]).record.start_unix_ns;
    let r0 = &report.requests[0];
    let head_start_ms = r0.lag_ms + r0.ttfb_ms.unwrap();
    for (want, o) in sent.iter().zip(&report.requests) {
        let got = find(want);
        assert_eq!(got.record.session, want.session, "session header replayed");
        let gap_ms = (got.record.start_unix_ns as f64 - first as f64) / 1e6;
        assert!(
            gap_ms + 1.0 >= o.due_ms - head_start_ms,
            "{o:?} sent early (gap {gap_ms} ms)"
        );
    }
}

// The command-line form of the same: `replay --captures DIR --timing recorded --speed F`
// replays every captured request and says so; without `--target` it is a usage error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_command_replays_captures_at_recorded_times() {
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("source");
    let rec = agentrace::capture::Recorder::start(&config(&source)).unwrap();
    let t0 = 1_780_000_000_000_000_000u128;
    for (i, off) in [0u64, 40, 80].iter().enumerate() {
        let session = format!("cli-{i}");
        let body = agent_bodies(&session, 1).pop().unwrap();
        let mut ex = FakeExchange::chat(Some(&session), body, "recorded reply");
        ex.start_unix_ns = Some(t0 + *off as u128 * 1_000_000);
        drive(rec.sink.as_ref(), &ex);
    }
    rec.finish().await;

    let (stop, shutdown) = agentrace::shutdown::channel();
    let sim = start_sim(shutdown);
    let out = dir.path().join("out");
    let ok = tokio::process::Command::new(env!("CARGO_BIN_EXE_agentrace"))
        .args(["replay", "--captures"])
        .arg(&source)
        .args(["--timing", "recorded", "--speed", "4", "--out"])
        .arg(&out)
        .args(["--target", &format!("http://{}", sim.addrs()[0])])
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&ok.stdout);
    assert!(
        ok.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(
        stdout.contains("3 scheduled, 3 sent, 3 ok, 0 failed"),
        "{stdout}"
    );
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("open-loop-report.json")).unwrap()).unwrap();
    assert_eq!(report["speed"], 4.0);

    let out2 = dir.path().join("out2");
    let no_target = tokio::process::Command::new(env!("CARGO_BIN_EXE_agentrace"))
        .args(["replay", "--captures"])
        .arg(&source)
        .args(["--timing", "recorded", "--out"])
        .arg(&out2)
        .output()
        .await
        .unwrap();
    assert_eq!(no_target.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&no_target.stderr).contains("--target"));
    stop.fire();
    sim.join().await;
}
