//! Replayer benchmark: how fast and how precisely one process drives an endpoint.
//!
//! `cargo bench --bench replay` (optionally `-- --dataset PATH`) spawns an instant
//! chat-completions server and a simulator in child processes (so the figures below are the
//! replayer's alone) and measures:
//! 1. a full replay of a dataset (the given file, else an in-memory stand-in of the 990-set's
//!    shape): CPU per turn and peak RSS;
//! 2. turns/s against the instant server, and client CPU time per turn;
//! 3. schedule lag p50/p99/max with 1,000 concurrent trajectories and delays on, against the
//!    simulator (precise pacing) and against the instant server (with and without);
//! 4. per-turn TTFT and latency against the simulator's ground-truth log at time-scale 1
//!    (the test `turn_timings_agree_with_the_simulator_ground_truth`, optimised).

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::sync::Arc;

use agentrace::dataset::{ClientTurn, Conversation, Dataset, HistoryMessage, Role};
use agentrace::replay::{self, ReplayConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[path = "../tests/support/truth.rs"]
mod truth;

/// The binary's allocator, so the figures are those of `agentrace replay`.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--serve-sim") {
        serve_sim();
        return;
    }
    if args.iter().any(|a| a == "--serve") {
        serve();
        return;
    }
    let dataset_path = args
        .iter()
        .position(|a| a == "--dataset")
        .and_then(|i| args.get(i + 1))
        .map(PathBuf::from);

    let (mut child, target) = spawn_server(&["--serve"]);
    println!("instant server at {target} (child pid {})", child.id());
    println!("load average before: {}", loadavg());

    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        // 1. A full set (first, so the peak RSS is this run's): the given file, else a stand-in with the 990-set's shape.
        let ds = match &dataset_path {
            Some(p) => Arc::new(
                agentrace::dataset::load(p, &agentrace::dataset::LoadOptions::default())
                    .expect("load dataset"),
            ),
            None => synthetic_990(),
        };
        let turns: usize = ds.conversations.iter().map(|c| c.client_turns.len()).sum();
        println!(
            "[full] dataset {} ({} trajectories, {turns} turns); RSS after load {} MiB",
            ds.path.display(),
            ds.conversations.len(),
            rss_kib("VmRSS") / 1024
        );
        // A real file's recorded delays would make this a ten-minute wall-clock wait.
        let (s, cpu) = measure(&target, 64, ds, |c| c.inject_tool_delay = false).await;
        println!(
            "[full] concurrency 64, no delays: {} turns in {:.2} s; client CPU {:.1} us/turn; peak RSS {} MiB",
            s.turns_ok,
            s.wall_s,
            cpu * 1e6 / s.turns_ok.max(1) as f64,
            rss_kib("VmHWM") / 1024
        );
        // 2. Throughput: 400 trajectories x 25 turns, no delays, small prompts.
        for conc in [64usize, 256] {
            let ds = synthetic(400, 25, 2_000, 0.0);
            let (s, cpu) = measure(&target, conc, ds, |_| {}).await;
            println!(
                "[turns/s] concurrency {conc}: {} turns in {:.2} s = {:.0} turns/s; client CPU {:.1} us/turn",
                s.turns_ok,
                s.wall_s,
                s.turns_ok as f64 / s.wall_s,
                cpu * 1e6 / s.turns_ok as f64
            );
        }
        // 3. Schedule lag: 1,000 concurrent trajectories, delays drawn like the sample's,
        // against the simulator (its batch steps end many streams' chunks at once, as a real
        // engine does) and against the instant server (every answer at once, so trajectories
        // that share a delay stay in lock-step and their sends fall due together).
        let (mut sim, sim_target) = spawn_server(&["--serve-sim"]);
        // Against the simulator only with precise pacing (the default): a run takes minutes.
        let runs = [
            ("simulator", &sim_target, true),
            ("instant server", &target, false),
            ("instant server", &target, true),
        ];
        for (server, target, precise) in runs {
            let ds = synthetic(1_000, 20, 2_000, 1.0);
            let (s, cpu) = measure(target, 1_000, ds, |c| c.precise_pacing = precise).await;
            println!(
                "[lag] 1000 concurrent vs the {server}, delays on, precise_pacing {precise}: lag p50 {:.0} us p99 {:.0} us max {:.0} us (turns after a delay: p99 {:.0} us); {} turns, {:.0} turns/s, CPU {:.1} us/turn",
                s.schedule_lag_p50_us,
                s.schedule_lag_p99_us,
                s.schedule_lag_max_us,
                s.schedule_lag_delayed_p99_us,
                s.turns_ok,
                s.turns_ok as f64 / s.wall_s,
                cpu * 1e6 / s.turns_ok as f64
            );
        }
        let _ = sim.kill();
        let _ = sim.wait();
        // 4. Agreement with the simulator's ground truth at time-scale 1, in a release build.
        ground_truth().await;
    });
    println!("load average after: {}", loadavg());
    let _ = child.kill();
    let _ = child.wait();
}

async fn measure(
    target: &str,
    concurrency: usize,
    ds: Arc<Dataset>,
    tweak: impl FnOnce(&mut ReplayConfig),
) -> (replay::ReplaySummary, f64) {
    let mut cfg = ReplayConfig {
        target: target.into(),
        concurrency,
        progress: false,
        enable_salt: true,
        inject_tool_delay: true,
        ..Default::default()
    };
    tweak(&mut cfg);
    let out = tempfile::tempdir().unwrap();
    let (trigger, shutdown) = agentrace::shutdown::channel();
    let cpu0 = cpu_seconds();
    let s = replay::run(cfg, ds, out.path(), shutdown)
        .await
        .expect("replay");
    let cpu = cpu_seconds() - cpu0;
    drop(trigger);
    (s, cpu)
}

/// Replays 64 turns against an in-process simulator at time-scale 1 and compares each turn's
/// TTFT and latency with the simulator's `--trace-log` (when each token was due).
async fn ground_truth() {
    use agentrace::sim::{self, SimConfig};
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace.jsonl");
    let mut cfg = SimConfig::from_profile(sim::DEFAULT_PROFILE).unwrap();
    cfg.time_scale = 1.0;
    cfg.trace_log = Some(trace.clone());
    cfg.responder.output_tokens_min = 8;
    cfg.responder.output_tokens_max = 40;
    let (trigger, shutdown) = agentrace::shutdown::channel();
    let cluster = sim::start(cfg, "127.0.0.1:0".parse().unwrap(), 1, shutdown).unwrap();
    let target = format!("http://{}", cluster.addrs()[0]);
    let out = dir.path().join("run");
    let cfg = ReplayConfig {
        target: target.into(),
        concurrency: 2,
        progress: false,
        ..Default::default()
    };
    let (_t, no_shutdown) = agentrace::shutdown::channel();
    replay::run(cfg, synthetic(16, 4, 2_000, 0.0), &out, no_shutdown)
        .await
        .expect("replay");
    trigger.fire();
    cluster.join().await;

    let (mut ttft, mut lat): (Vec<f64>, Vec<f64>) = truth::turn_timings(&trace, &out)
        .iter()
        .map(|t| {
            (
                t.client_ttft_ms - t.server_ttft_ms,
                t.client_latency_ms - t.server_latency_ms,
            )
        })
        .unzip();
    let pct = |v: &mut Vec<f64>, q: f64| {
        v.sort_by(|a, b| a.total_cmp(b));
        v.get(((v.len().max(1) - 1) as f64 * q) as usize)
            .copied()
            .unwrap_or(f64::NAN)
    };
    println!(
        "[truth] {} turns vs the simulator's ground truth at time-scale 1: TTFT +{:.3} ms p50 (p90 {:.3}, min {:.3}); latency +{:.3} ms p50 (p90 {:.3}, min {:.3})",
        ttft.len(),
        pct(&mut ttft, 0.5),
        pct(&mut ttft, 0.9),
        pct(&mut ttft, 0.0),
        pct(&mut lat, 0.5),
        pct(&mut lat, 0.9),
        pct(&mut lat, 0.0),
    );
}

/// utime + stime of this process in seconds (`/proc/self/stat`, clock ticks of 10 ms).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0)
        + f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0.0);
    ticks / 100.0
}

fn rss_kib(key: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .trim()
        .to_string()
}

fn raw(v: serde_json::Value) -> Box<serde_json::value::RawValue> {
    serde_json::value::RawValue::from_string(v.to_string()).unwrap()
}

/// Which decile of delays turn `t` of conversation `c` waits: a fixed hash, so every run
/// replays the same delays, but independent per turn. (A cycle through the ten deciles gave
/// every conversation the same total delay per ten turns, and all users fell back into step
/// every ~3 s: bursts of sends due together that no client can meet.)
fn decile(c: usize, t: usize) -> usize {
    let mut z = ((c as u64) << 32 | t as u64).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    ((z ^ (z >> 31)) % 10) as usize
}

/// `n` conversations of `turns` client turns, each message `msg_bytes` long; delays (when
/// `delay_scale` > 0) are drawn from approximate deciles of the public sample's delays
/// (min 38 ms, median 63 ms, p90 479 ms; the top decile capped at 2 s).
fn synthetic(n: usize, turns: usize, msg_bytes: usize, delay_scale: f64) -> Arc<Dataset> {
    const DELAYS: [f64; 10] = [
        0.040, 0.045, 0.05, 0.056, 0.063, 0.075, 0.1, 0.2, 0.479, 2.0,
    ];
    let filler = "x".repeat(msg_bytes);
    let convs = (0..n)
        .map(|c| {
            let mut messages = vec![HistoryMessage {
                role: Role::System,
                wire: raw(
                    serde_json::json!({"role":"system","content":"You are a helpful assistant."}),
                ),
            }];
            let mut client_turns = Vec::with_capacity(turns);
            for t in 0..turns {
                let role = if t == 0 { "user" } else { "tool" };
                messages.push(HistoryMessage {
                    role: if t == 0 { Role::User } else { Role::Tool },
                    wire: raw(serde_json::json!({"role":role,"content":filler,"tool_call_id":"c"})),
                });
                client_turns.push(ClientTurn {
                    turn: (2 * t + 1) as u32,
                    history_len: messages.len(),
                    delay_seconds: if t == 0 {
                        0.0
                    } else {
                        DELAYS[decile(c, t)] * delay_scale
                    },
                    overrides: serde_json::Map::new(),
                    expected: None,
                });
                messages.push(HistoryMessage {
                    role: Role::Assistant,
                    wire: raw(serde_json::json!({"role":"assistant","content":"ok"})),
                });
            }
            Arc::new(Conversation {
                id: format!("bench_{c:06}"),
                messages,
                client_turns,
            })
        })
        .collect();
    Arc::new(Dataset {
        path: "in-memory".into(),
        sha256: String::new(),
        conversations: convs,
    })
}

/// The 990-set's shape: 490 coding trajectories (~50 turns, ~2 KB per tool output) and 500
/// workflow trajectories (~10 turns, ~600 B messages).
fn synthetic_990() -> Arc<Dataset> {
    let coding = synthetic(490, 50, 2_000, 0.0);
    let workflow = synthetic(500, 10, 600, 0.0);
    let mut convs = coding.conversations.clone();
    for (i, c) in workflow.conversations.iter().enumerate() {
        let mut c = (**c).clone();
        c.id = format!("sim_{i:06}");
        convs.push(Arc::new(c));
    }
    Arc::new(Dataset {
        path: "in-memory 990-set stand-in".into(),
        sha256: String::new(),
        conversations: convs,
    })
}

/// Spawns this binary as a server child (`--serve` or `--serve-sim`), so the figures are
/// the replayer's alone; returns the child and its base URL.
fn spawn_server(args: &[&str]) -> (std::process::Child, String) {
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(args)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("spawn a server child");
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let target = format!("http://{}", line.trim());
    (child, target)
}

/// The simulator for the lag run: default profile at time-scale 0.05 (20 times a real
/// engine's pace, so a 20,000-turn run takes seconds and the client sees more chunks per
/// second, not fewer), 256 sequences per batch, 8–64 output tokens per turn.
fn serve_sim() {
    use agentrace::sim::{self, SimConfig};
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut cfg = SimConfig::from_profile(sim::DEFAULT_PROFILE).unwrap();
        cfg.time_scale = 0.05;
        cfg.engine.max_num_seqs = 256;
        cfg.responder.output_tokens_min = 8;
        cfg.responder.output_tokens_max = 64;
        let (_trigger, shutdown) = agentrace::shutdown::channel();
        let cluster = sim::start(cfg, "127.0.0.1:0".parse().unwrap(), 1, shutdown).unwrap();
        println!("{}", cluster.addrs()[0]);
        std::io::stdout().flush().unwrap();
        cluster.join().await;
    });
}

/// The instant server: answers every chat request at once with a 16-token SSE stream.
fn serve() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        // A deep accept queue: a thousand slots connect at once, and a connection dropped
        // from a full queue is retried only after the 1 s SYN timeout (that second showed up
        // as turns/s at 256 slots, with ListenOverflows and TCPSynRetrans counted by nstat).
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener = socket.listen(4096).unwrap();
        println!("{}", listener.local_addr().unwrap());
        std::io::stdout().flush().unwrap();
        let response = instant_response();
        loop {
            let Ok((mut tcp, _)) = listener.accept().await else {
                continue;
            };
            let response = response.clone();
            tokio::spawn(async move {
                let _ = tcp.set_nodelay(true);
                let mut buf = Vec::with_capacity(64 * 1024);
                loop {
                    // Read one request: head, then Content-Length bytes.
                    let (head_len, body_len) = loop {
                        let mut headers = [httparse::EMPTY_HEADER; 32];
                        let mut req = httparse::Request::new(&mut headers);
                        if let Ok(httparse::Status::Complete(n)) = req.parse(&buf) {
                            let len = req
                                .headers
                                .iter()
                                .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                                .and_then(|h| std::str::from_utf8(h.value).ok()?.parse().ok())
                                .unwrap_or(0usize);
                            break (n, len);
                        }
                        if tcp.read_buf(&mut buf).await.unwrap_or(0) == 0 {
                            return;
                        }
                    };
                    while buf.len() < head_len + body_len {
                        if tcp.read_buf(&mut buf).await.unwrap_or(0) == 0 {
                            return;
                        }
                    }
                    buf.drain(..head_len + body_len);
                    if tcp.write_all(&response).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
}

fn instant_response() -> Arc<Vec<u8>> {
    let mut events = String::new();
    let chunk = |delta: &str, finish: &str| {
        format!("data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{delta},\"finish_reason\":{finish}}}]}}\n\n")
    };
    events.push_str(&chunk("{\"role\":\"assistant\",\"content\":\"\"}", "null"));
    for i in 0..16 {
        events.push_str(&chunk(&format!("{{\"content\":\"tok{i} \"}}"), "null"));
    }
    events.push_str(&chunk("{}", "\"stop\""));
    events.push_str("data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"m\",\"choices\":[],\"usage\":{\"prompt_tokens\":100,\"completion_tokens\":16,\"total_tokens\":116}}\n\n");
    events.push_str("data: [DONE]\n\n");
    let mut out = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n",
        events.len()
    )
    .into_bytes();
    out.extend_from_slice(events.as_bytes());
    out.extend_from_slice(b"\r\n0\r\n\r\n");
    Arc::new(out)
}
