//! Capture benchmark: what recording costs and how much it stores.
//!
//! `cargo bench --bench capture [-- [sink|proxy|throughput] [SAMPLE.jsonl]]` (every part, on
//! the public MLPerf sample, by default):
//!
//! 1. **sink**: the sample's 1,007 exchanges (reference request bodies, the recorded replies
//!    as SSE) driven straight into a recorder: time spent in the sink calls per exchange (the
//!    cost on the forwarding path), the writer thread's time to drain, stored vs raw bytes.
//! 2. **proxy**: the sample replayed closed-loop (20 slots, no think time) through a proxy in
//!    front of the simulator, capture off then on, alternating twice: throughput and latency
//!    with and without capture, stored vs raw bytes through the real data path.
//! 3. **throughput**: two in-process proxies, capture off and on, in front of the same
//!    loopback backend (a small chat-completion answer as 16 SSE events), hammered by 32
//!    connections over 1,000 session keys for 3 s each, interleaved 5 times: median
//!    requests/s and p50/p99 latency of each, so the ratio shows what capture costs the proxy.
//! 4. **fleet** (only when named; needs no dataset): `FLEET_SESSIONS` (1,500) synthetic agent
//!    sessions of `FLEET_TURNS` (20) turns recorded round-robin over R replica recorders, for
//!    each R of `FLEET_REPLICAS` (`1,3`); then `agentrace capture export` of each fleet under
//!    `/usr/bin/time -v`, twice: wall time and peak RSS, and with `FLEET_BEFORE_BIN` set, the
//!    same of that other build on the same captures in the same run (the ratio is the
//!    comparison). `FLEET_WAVES=N` records N such batches one after another.
//!    `scripts/bench-capture-fleet.sh` runs it.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant as StdInstant;

use agentrace::capture::{CaptureConfig, Recorder};
use agentrace::dataset::{LoadOptions, ModelParams, RequestBuilder};
use agentrace::tap::{ExchangeEnd, ExchangeStart, KeySource};
use bytes::Bytes;
use serde_json::json;
use tokio::time::{Duration, Instant};

fn sse_frames(reply: &agentrace::dataset::RecordedReply) -> Vec<Bytes> {
    let chunk = |delta: serde_json::Value| {
        Bytes::from(format!(
            "data: {}\n\n",
            json!({"id": "c", "object": "chat.completion.chunk", "model": "m",
                   "choices": [{"index": 0, "delta": delta, "finish_reason": null}]})
        ))
    };
    let mut frames = Vec::new();
    // About 4 characters per token, one token per event, as a server streams.
    for (field, text) in [
        ("reasoning_content", &reply.reasoning_content),
        ("content", &reply.content),
    ] {
        if let Some(text) = text {
            let chars: Vec<char> = text.chars().collect();
            for piece in chars.chunks(4) {
                frames.push(chunk(json!({ field: piece.iter().collect::<String>() })));
            }
        }
    }
    if let Some(calls) = &reply.tool_calls {
        for (i, c) in calls.as_array().into_iter().flatten().enumerate() {
            let args = c["function"]["arguments"].as_str().unwrap_or("");
            frames.push(chunk(
                json!({"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                "function": {"name": c["function"]["name"], "arguments": ""}}]}),
            ));
            let chars: Vec<char> = args.chars().collect();
            for piece in chars.chunks(4) {
                frames.push(chunk(json!({"tool_calls": [{"index": i,
                    "function": {"arguments": piece.iter().collect::<String>()}}]})));
            }
        }
    }
    frames.push(Bytes::from_static(b"data: [DONE]\n\n"));
    frames
}

fn dir_bytes(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.metadata().map_or(0, |m| m.len()))
                .sum()
        })
        .unwrap_or(0)
}

async fn sink_bench(dataset: &agentrace::dataset::Dataset) {
    let builder = RequestBuilder::new(
        ModelParams {
            name: "m".into(),
            ..ModelParams::default()
        },
        true,
    );
    struct Ex {
        key: String,
        body: Bytes,
        frames: Vec<Bytes>,
    }
    let mut exchanges = Vec::new();
    let max_turns = dataset
        .conversations
        .iter()
        .map(|c| c.client_turns.len())
        .max()
        .unwrap_or(0);
    for t in 0..max_turns {
        for conv in &dataset.conversations {
            if let Some(turn) = conv.client_turns.get(t) {
                exchanges.push(Ex {
                    key: conv.id.clone(),
                    body: Bytes::from(builder.body(conv, turn, None)),
                    frames: turn
                        .expected
                        .as_ref()
                        .map(|e| sse_frames(&conv.recorded_reply(e)))
                        .unwrap_or_default(),
                });
            }
        }
    }
    // Frames from a socket are shared `Bytes`, whose clone is one atomic increment; make these
    // the same (the first clone of a `Bytes` built from a `String` allocates).
    for e in &exchanges {
        drop(e.frames.clone());
        drop(e.body.clone());
    }
    let raw: u64 = exchanges
        .iter()
        .map(|e| e.body.len() as u64 + e.frames.iter().map(|f| f.len() as u64).sum::<u64>())
        .sum();
    let frames: usize = exchanges.iter().map(|e| e.frames.len()).sum();
    let tmp = tempfile::tempdir().unwrap();
    let rec = Recorder::start(&CaptureConfig {
        enabled: true,
        dir: tmp.path().to_path_buf(),
        ..CaptureConfig::default()
    })
    .unwrap();
    let mut headers = http::HeaderMap::new();
    headers.insert("content-type", "application/json".parse().unwrap());
    headers.insert("authorization", "Bearer sk-bench".parse().unwrap());
    let mut resp_headers = http::HeaderMap::new();
    resp_headers.insert("content-type", "text/event-stream".parse().unwrap());
    let mut in_sink = Duration::ZERO;
    let mut before_first_byte = Duration::ZERO;
    let wall = StdInstant::now();
    for e in &exchanges {
        let now = Instant::now();
        let start = ExchangeStart {
            session_key: Some(e.key.clone()),
            key_source: KeySource::Header,
            backend: "b0".into(),
            started_unix_ns: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos(),
            started_at: now,
            request_received_at: now,
            method: http::Method::POST,
            path_and_query: "/v1/chat/completions".into(),
            request_headers: headers.clone(),
            request_body: e.body.clone(),
        };
        let t = StdInstant::now();
        let mut obs = rec.sink.start(start);
        obs.response_head(http::StatusCode::OK, &resp_headers, Instant::now());
        before_first_byte += t.elapsed();
        for f in &e.frames {
            obs.response_frame(f, Instant::now());
        }
        obs.end(ExchangeEnd::Complete, Instant::now());
        in_sink += t.elapsed();
    }
    let fed = wall.elapsed();
    rec.finish().await;
    let drained = wall.elapsed();
    let stored = dir_bytes(tmp.path());
    let n = exchanges.len() as f64;
    println!(
        "sink: {} exchanges, {} response frames",
        exchanges.len(),
        frames
    );
    println!(
        "sink: forwarding-path cost {:.1} µs per exchange in all: {:.2} µs before the first byte (start + head), {:.3} µs per frame",
        in_sink.as_secs_f64() * 1e6 / n,
        before_first_byte.as_secs_f64() * 1e6 / n,
        (in_sink - before_first_byte).as_secs_f64() * 1e6 / frames.max(1) as f64
    );
    println!(
        "sink: writer drained everything {:.0} ms after the last exchange ({:.0} µs of writer time per exchange at most)",
        (drained - fed).as_secs_f64() * 1e3,
        drained.as_secs_f64() * 1e6 / n
    );
    println!(
        "sink: raw {} bytes (requests + responses), stored {} bytes = {:.2}%",
        raw,
        stored,
        stored as f64 * 100.0 / raw as f64
    );
}

async fn proxy_run(
    dataset: Arc<agentrace::dataset::Dataset>,
    capture: Option<&std::path::Path>,
) -> (
    agentrace::replay::ReplaySummary,
    f64,
    Option<agentrace::capture::RecorderStats>,
) {
    let (stop, shutdown) = agentrace::shutdown::channel();
    let mut sim_config = agentrace::sim::SimConfig {
        time_scale: 0.0005,
        ..Default::default()
    };
    sim_config.responder.output_tokens_max = 128;
    let sim = agentrace::sim::start(
        sim_config,
        "127.0.0.1:0".parse().unwrap(),
        2,
        shutdown.clone(),
    )
    .unwrap();
    let mut config = agentrace::proxy::ProxyConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        ..Default::default()
    };
    config.admin.listen = "127.0.0.1:0".parse().unwrap();
    config.backends = sim
        .addrs()
        .iter()
        .enumerate()
        .map(|(i, a)| agentrace::proxy::config::BackendConfig {
            name: format!("sim{i}"),
            url: format!("http://{a}"),
            weight: 1.0,
        })
        .collect();
    if let Some(dir) = capture {
        config.capture = CaptureConfig {
            enabled: true,
            dir: dir.to_path_buf(),
            ..CaptureConfig::default()
        };
    }
    let proxy = agentrace::proxy::start(config, shutdown.clone())
        .await
        .unwrap();
    let out = tempfile::tempdir().unwrap();
    let replay = agentrace::replay::ReplayConfig {
        target: format!("http://{}", proxy.addr).into(),
        model_name: Some("m".into()),
        concurrency: 20,
        enable_salt: false,
        inject_tool_delay: false,
        ..Default::default()
    };
    let (_keep, replay_shutdown) = agentrace::shutdown::channel();
    let t = StdInstant::now();
    let summary = agentrace::replay::run(replay, dataset, out.path(), replay_shutdown)
        .await
        .unwrap();
    let wall = t.elapsed().as_secs_f64();
    stop.fire();
    proxy.join().await;
    sim.join().await;
    let stats = capture.map(|dir| {
        let c = agentrace::capture::reader::read_dir(dir).unwrap();
        let raw: u64 = c
            .exchanges
            .iter()
            .map(|e| {
                e.record.request.body.len + e.record.response.as_ref().map_or(0, |r| r.body.len)
            })
            .sum();
        agentrace::capture::RecorderStats {
            records_written: c.exchanges.len() as u64,
            records_dropped: c.dropped,
            records_lost_write_failed: 0,
            records_lost_retry_wait: 0,
            write_errors: 0,
            bytes_raw: raw,
            bytes_stored: dir_bytes(dir),
        }
    });
    (summary, wall, stats)
}

async fn proxy_bench(dataset: Arc<agentrace::dataset::Dataset>) {
    for round in 1..=2 {
        for capture in [false, true] {
            let tmp = tempfile::tempdir().unwrap();
            let dir = capture.then(|| tmp.path().join("cap"));
            let (s, wall, stats) = proxy_run(dataset.clone(), dir.as_deref()).await;
            println!(
                "proxy round {round} capture {:3}: {} turns ok in {:.2} s = {:.1} req/s, latency p50 {:.2} ms, ttft p50 {:.2} ms",
                if capture { "on" } else { "off" },
                s.turns_ok,
                wall,
                s.turns_ok as f64 / wall,
                s.latency_p50_ms,
                s.ttft_p50_ms
            );
            if let Some(st) = stats {
                println!(
                    "proxy round {round}: {} records, {} dropped, raw {} bytes, stored {} bytes = {:.2}%",
                    st.records_written,
                    st.records_dropped,
                    st.bytes_raw,
                    st.bytes_stored,
                    st.bytes_stored as f64 * 100.0 / st.bytes_raw.max(1) as f64
                );
            }
        }
    }
}

const MODES: [&str; 3] = ["sink", "proxy", "throughput"];

/// A loopback backend answering every POST with 16 SSE events of a chat completion.
async fn sse_backend() -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let events: Vec<Bytes> = (0..16)
        .map(|i| {
            Bytes::from(format!(
                "data: {}\n\n",
                json!({"id": "c", "object": "chat.completion.chunk", "model": "bench",
                       "choices": [{"index": 0, "delta": {"content": format!("token{i} ")}}]})
            ))
        })
        .chain([Bytes::from_static(b"data: [DONE]\n\n")])
        .collect();
    let events = Arc::new(events);
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let events = events.clone();
            tokio::spawn(async move {
                let svc =
                    hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let events = events.clone();
                        async move {
                            use http_body_util::BodyExt;
                            let _ = req.into_body().collect().await;
                            let frames = futures_util::stream::iter(
                                events
                                    .iter()
                                    .cloned()
                                    .map(|b| {
                                        Ok::<_, std::convert::Infallible>(http_body::Frame::data(b))
                                    })
                                    .collect::<Vec<_>>(),
                            );
                            let resp = http::Response::builder()
                                .header("content-type", "text/event-stream")
                                .body(http_body_util::StreamBody::new(frames))
                                .unwrap();
                            Ok::<_, std::convert::Infallible>(resp)
                        }
                    });
                let io = hyper_util::rt::TokioIo::new(stream);
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(io, svc)
                    .await;
            });
        }
    });
    addr
}

/// Requests/s and latency percentiles (ms) of `conns` closed-loop connections for `secs`.
async fn hammer(addr: std::net::SocketAddr, conns: usize, secs: f64) -> (f64, f64, f64) {
    use http_body_util::BodyExt;
    let client: hyper_util::client::legacy::Client<_, http_body_util::Full<Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http();
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let body = Bytes::from_static(br#"{"model":"bench","messages":[{"role":"system","content":"You are a coding agent."},{"role":"user","content":"Fix the failing test."}],"stream":true,"max_tokens":16}"#);
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..conns {
        let client = client.clone();
        let body = body.clone();
        tasks.spawn(async move {
            let mut lat = Vec::new();
            let mut i = c;
            while Instant::now() < deadline {
                let t = Instant::now();
                let req = http::Request::post(format!("http://{addr}/v1/chat/completions"))
                    .header("x-session-id", format!("key-{}", i % 1000))
                    .header("content-type", "application/json")
                    .body(http_body_util::Full::new(body.clone()))
                    .unwrap();
                let resp = client.request(req).await.unwrap();
                let _ = resp.into_body().collect().await.unwrap();
                lat.push(t.elapsed().as_secs_f64() * 1e3);
                i += conns;
            }
            lat
        });
    }
    let mut all = Vec::new();
    while let Some(Ok(l)) = tasks.join_next().await {
        all.extend(l);
    }
    all.sort_by(f64::total_cmp);
    let pct = |q: f64| all[((q * all.len() as f64) as usize).min(all.len() - 1)];
    (all.len() as f64 / secs, pct(0.5), pct(0.99))
}

async fn throughput_bench() {
    let backend = sse_backend().await;
    let tmp = tempfile::tempdir().unwrap();
    let (_stop, shutdown) = agentrace::shutdown::channel();
    let mut proxies = Vec::new();
    for capture in [false, true] {
        let mut config = agentrace::proxy::ProxyConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            ..Default::default()
        };
        config.admin.listen = "127.0.0.1:0".parse().unwrap();
        config.backends = vec![agentrace::proxy::config::BackendConfig {
            name: "gpu-0".into(),
            url: format!("http://{backend}"),
            weight: 1.0,
        }];
        if capture {
            config.capture = CaptureConfig {
                enabled: true,
                dir: tmp.path().join("cap"),
                ..CaptureConfig::default()
            };
        }
        proxies.push(
            agentrace::proxy::start(config, shutdown.clone())
                .await
                .unwrap(),
        );
    }
    let mut results: [Vec<(f64, f64, f64)>; 2] = [Vec::new(), Vec::new()];
    for _ in 0..5 {
        for (i, p) in proxies.iter().enumerate() {
            results[i].push(hammer(p.addr, 32, 3.0).await);
        }
    }
    let median = |v: &mut Vec<(f64, f64, f64)>| {
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
        v[v.len() / 2]
    };
    let off = median(&mut results[0]);
    let on = median(&mut results[1]);
    for (name, r) in [("off", off), ("on ", on)] {
        println!(
            "throughput capture {name}: {:.0} req/s (median of 5), p50 {:.2} ms, p99 {:.2} ms",
            r.0, r.1, r.2
        );
    }
    println!(
        "throughput: capture on / off = {:.1}%",
        on.0 * 100.0 / off.0
    );
}

/// Records `sessions` agent sessions of `turns` turns into one recorder per entry of
/// `recorders`, turn `t` of session `s` into recorder `(s + t) % n`, stamped as if each turn
/// came 2 s after the previous one; `wave` numbers a batch of sessions that starts after the
/// previous batch ended (its own session keys).
async fn record_sessions(recorders: &[Recorder], sessions: usize, turns: usize, wave: usize) {
    let t0: u128 = 1_795_000_000_000_000_000 + (wave * turns) as u128 * 2_000_000_000;
    let written: Vec<u64> = recorders
        .iter()
        .map(|r| r.stats().records_written)
        .collect();
    let mut headers = http::HeaderMap::new();
    headers.insert("content-type", "application/json".parse().unwrap());
    let mut resp_headers = http::HeaderMap::new();
    resp_headers.insert("content-type", "text/event-stream".parse().unwrap());
    let system = "You are a coding agent working in a large repository. ".repeat(40);
    let mut histories: Vec<Vec<serde_json::Value>> = (0..sessions)
        .map(|s| {
            vec![
                json!({"role": "system", "content": system}),
                json!({"role": "user", "content": format!("Session {s}: fix the failing test in module {}.", s % 97)}),
            ]
        })
        .collect();
    for t in 0..turns {
        for (s, history) in histories.iter_mut().enumerate() {
            let r = (s + t) % recorders.len();
            let rec = &recorders[r];
            let body = serde_json::to_vec(&json!({"model": "m", "messages": history,
                "max_completion_tokens": 256, "stream": true}))
            .unwrap();
            let call = format!("call_{s}_{t}");
            let reply = format!("Turn {t}: I will run the tests of module {} again.", s % 97);
            let frames: Vec<Bytes> = [
                json!({"content": reply}),
                json!({"tool_calls": [{"index": 0, "id": call, "type": "function",
                    "function": {"name": "bash", "arguments": "{\"command\":\"cargo test\"}"}}]}),
            ]
            .iter()
            .map(|d| {
                Bytes::from(format!(
                    "data: {}\n\n",
                    json!({"choices": [{"index": 0, "delta": d}]})
                ))
            })
            .collect();
            let now = Instant::now();
            let mut obs = rec.sink.start(ExchangeStart {
                session_key: Some(format!("fleet-{wave}-{s}")),
                key_source: KeySource::Header,
                backend: "b0".into(),
                started_unix_ns: t0 + t as u128 * 2_000_000_000 + s as u128 * 1_000_000,
                started_at: now,
                request_received_at: now,
                method: http::Method::POST,
                path_and_query: "/v1/chat/completions".into(),
                request_headers: headers.clone(),
                request_body: Bytes::from(body),
            });
            obs.response_head(http::StatusCode::OK, &resp_headers, now);
            for f in &frames {
                obs.response_frame(f, Instant::now());
            }
            obs.end(ExchangeEnd::Complete, Instant::now());
            history.push(json!({"role": "assistant", "content": reply,
                "tool_calls": [{"id": call, "type": "function",
                    "function": {"name": "bash", "arguments": "{\"command\":\"cargo test\"}"}}]}));
            history.push(json!({"role": "tool", "tool_call_id": call,
                "content": format!("running {s}/{t}: ").repeat(30)}));
            // Keep the writer's queue from overflowing (the recorder drops, never blocks, here).
            while rec.stats().records_written + 4000
                < written[r] + (t * sessions + s + 1) as u64 / recorders.len() as u64
            {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    }
}

/// `/usr/bin/time -v BIN capture export DIRS… --out OUT`: (wall s, peak RSS KiB, stdout).
fn timed_export(
    bin: &std::path::Path,
    dirs: &[PathBuf],
    out: &std::path::Path,
) -> (f64, u64, String) {
    let mut cmd = std::process::Command::new("/usr/bin/time");
    cmd.arg("-v")
        .arg(bin)
        .args(["capture", "export"])
        .args(dirs)
        .arg("--out")
        .arg(out);
    let t = StdInstant::now();
    let o = cmd
        .output()
        .expect("/usr/bin/time (Debian: apt-get install time)");
    let wall = t.elapsed().as_secs_f64();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    let rss = stderr
        .lines()
        .find_map(|l| {
            l.trim()
                .strip_prefix("Maximum resident set size (kbytes): ")
        })
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    (wall, rss, String::from_utf8_lossy(&o.stdout).into_owned())
}

/// A positive number from the environment, or `default`.
fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or(default)
}

async fn fleet_bench() {
    let sessions = env_or("FLEET_SESSIONS", 1500);
    let turns = env_or("FLEET_TURNS", 20);
    // Batches of sessions one after the other: the capture grows, the sessions open at once
    // do not.
    let waves = env_or("FLEET_WAVES", 1);
    let replica_counts: Vec<usize> = std::env::var("FLEET_REPLICAS")
        .unwrap_or_else(|_| "1,3".into())
        .split(',')
        .map(|r| {
            r.trim()
                .parse()
                .expect("FLEET_REPLICAS: replica counts, e.g. 1,3,10")
        })
        .collect();
    // Another build of agentrace (say, of an earlier commit) exporting the same captures in
    // the same run, for a before/after ratio on the same machine at the same load.
    let before = std::env::var_os("FLEET_BEFORE_BIN").map(PathBuf::from);
    let current = PathBuf::from(env!("CARGO_BIN_EXE_agentrace"));
    let tmp = tempfile::tempdir().unwrap();
    let config = |dir: PathBuf, replica: &str| CaptureConfig {
        enabled: true,
        dir,
        replica: replica.into(),
        queue_capacity: 8192,
        flush_interval_ms: 100,
        ..CaptureConfig::default()
    };
    for &replicas in &replica_counts {
        let root = tmp.path().join(format!("fleet-{replicas}"));
        let fleet: Vec<PathBuf> = (0..replicas)
            .map(|i| root.join(format!("replica-{i}")))
            .collect();
        let recorders: Vec<Recorder> = fleet
            .iter()
            .enumerate()
            .map(|(i, d)| Recorder::start(&config(d.clone(), &format!("replica-{i}"))).unwrap())
            .collect();
        for wave in 0..waves {
            record_sessions(&recorders, sessions, turns, wave).await;
        }
        for r in recorders {
            let stats = r.stats();
            assert_eq!(stats.records_dropped, 0, "{stats:?}");
            r.finish().await;
        }
        println!(
            "fleet: {waves} x {sessions} sessions x {turns} turns = {} exchanges over {replicas} replica directories of {} bytes",
            waves * sessions * turns,
            fleet.iter().map(|d| dir_bytes(d)).sum::<u64>()
        );
        let out = root.join("export.jsonl");
        for round in 0..2 {
            let (w, rss, said) = timed_export(&current, &fleet, &out);
            if round == 0 {
                print!("fleet: {replicas} replicas: export: {said}");
            }
            let mut line = format!(
                "fleet: {replicas} replicas: round {round}: export {w:.2} s, peak RSS {} MiB",
                rss / 1024
            );
            if let Some(bin) = &before {
                let (bw, brss, _) = timed_export(bin, &fleet, &out);
                line += &format!(
                    "; before {bw:.2} s, peak RSS {} MiB; ratio after/before time {:.2}, RSS {:.2}",
                    brss / 1024,
                    w / bw,
                    rss as f64 / brss.max(1) as f64
                );
            }
            println!("{line}");
        }
        std::fs::remove_dir_all(&root).unwrap();
    }
}

fn main() {
    if std::env::args().any(|a| a == "fleet") {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(fleet_bench());
        return;
    }
    let path = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with("--") && !MODES.contains(&a.as_str()))
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../shared/datasets/mlperf_agentic_coding_sample.jsonl"
            ))
        });
    if !path.exists() {
        println!("skipped: no dataset at {}", path.display());
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let dataset = Arc::new(agentrace::dataset::load(&path, &LoadOptions::default()).unwrap());
        println!(
            "dataset {}: {} conversations, {} client turns",
            path.display(),
            dataset.conversations.len(),
            dataset.client_turn_count()
        );
        let only = std::env::args().find(|a| MODES.contains(&a.as_str()));
        let run = |m: &str| only.as_deref().is_none_or(|o| o == m);
        if run("sink") {
            sink_bench(&dataset).await;
        }
        if run("proxy") {
            proxy_bench(dataset).await;
        }
        if run("throughput") {
            throughput_bench().await;
        }
    });
}
