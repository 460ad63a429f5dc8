//! Simulator figures: what session affinity is worth on the public MLPerf sample, and what
//! the simulator itself costs in CPU.
//!
//! `cargo bench --bench sim` runs both; `cargo bench --bench sim -- affinity` or `-- cost`
//! runs one. The affinity replay runs on paused tokio time (simulated seconds cost nothing,
//! results are exact and repeatable). CPU figures read the simulator thread's own CPU time
//! from `/proc/thread-self/schedstat`, so other processes on the machine do not skew them.

#[path = "../tests/support/sim.rs"]
#[allow(dead_code)]
mod support;

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use agentrace::dataset::{
    ClientTurn, Conversation, Dataset, LoadOptions, ModelParams, RequestBuilder, Salt,
};
use agentrace::sim::{self, Oracle, ReplicaStats, ResponderKind, SimConfig};
use serde_json::json;
use support::request;

const SAMPLE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../shared/datasets/mlperf_agentic_coding_sample.jsonl"
);
const REPLICAS: usize = 4;

fn main() {
    let which = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .unwrap_or_default();
    let dataset = if Path::new(SAMPLE).exists() {
        Some(Arc::new(
            agentrace::dataset::load(Path::new(SAMPLE), &LoadOptions::default())
                .expect("the sample loads"),
        ))
    } else {
        println!("skipped the sample replays: {SAMPLE} is absent");
        None
    };
    if which.is_empty() || which == "affinity" {
        if let Some(d) = &dataset {
            affinity(d.clone());
        }
    }
    if which.is_empty() || which == "cost" {
        cost(dataset);
    }
}

/// The streaming chat body of one client turn, as the replayer sends it (Qwen preset,
/// usage on), salted as repeat 1.
fn turn_body(conv: &Conversation, turn: &ClientTurn) -> Vec<u8> {
    let builder = RequestBuilder::new(ModelParams::preset("qwen3.6-35b-a3b").unwrap(), true);
    builder.body(conv, turn, Some(&Salt::new(1, &conv.id)))
}

// ---------------------------------------------------------------------------------------
// Affinity: the 20 sample trajectories on 4 replicas, closed loop, all sessions at once.

#[derive(Clone, Copy, Debug)]
enum Routing {
    /// Session i on replica i mod 4 (an even 5/5/5/5 placement).
    PinnedEven,
    /// Session on replica FNV-1a(conversation id) mod 4 (what a hash placement gives).
    PinnedHash,
    /// Every request to the next replica in turn.
    RoundRobin,
}

struct ReplayResult {
    stats: Vec<ReplicaStats>,
    ttfts: Vec<f64>,
    makespan: f64,
    placement: Vec<usize>,
    cpu: Duration,
}

fn replay(dataset: Arc<Dataset>, routing: Routing, num_gpu_blocks: usize) -> ReplayResult {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    let cpu0 = thread_cpu();
    let result = rt.block_on(async move {
        let oracle = Arc::new(Oracle::new(dataset.clone()).unwrap());
        let mut cfg = SimConfig::default();
        cfg.engine.num_gpu_blocks = num_gpu_blocks;
        cfg.responder.kind = ResponderKind::Oracle;
        let (trigger, shutdown) = agentrace::shutdown::channel();
        let cluster = sim::start_with_oracle(
            cfg,
            "127.0.0.1:0".parse().unwrap(),
            REPLICAS,
            shutdown,
            Some(oracle),
        )
        .unwrap();
        let addrs = cluster.addrs();
        let next = Arc::new(AtomicUsize::new(0));
        let start = tokio::time::Instant::now();
        let mut placement = vec![0; REPLICAS];
        let mut tasks = Vec::new();
        for (s, conv) in dataset.conversations.iter().cloned().enumerate() {
            let pinned = match routing {
                Routing::PinnedEven => s % REPLICAS,
                _ => (fnv1a(conv.id.as_bytes()) % REPLICAS as u64) as usize,
            };
            placement[pinned] += 1;
            let (addrs, next) = (addrs.clone(), next.clone());
            tasks.push(tokio::spawn(async move {
                let mut ttfts = Vec::new();
                for turn in &conv.client_turns {
                    let replica = match routing {
                        Routing::RoundRobin => next.fetch_add(1, Ordering::Relaxed) % REPLICAS,
                        _ => pinned,
                    };
                    let r = request(
                        addrs[replica],
                        "POST",
                        "/v1/chat/completions",
                        turn_body(&conv, turn),
                        &[],
                    )
                    .await;
                    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body()));
                    ttfts.push(r.ttft().as_secs_f64());
                }
                ttfts
            }));
        }
        let mut ttfts = Vec::new();
        for t in tasks {
            ttfts.extend(t.await.unwrap());
        }
        let makespan = start.elapsed().as_secs_f64();
        let stats = cluster.stats();
        trigger.fire();
        cluster.join().await;
        (stats, ttfts, makespan, placement)
    });
    let (stats, ttfts, makespan, placement) = result;
    ReplayResult {
        stats,
        ttfts,
        makespan,
        placement,
        cpu: thread_cpu() - cpu0,
    }
}

fn affinity(dataset: Arc<Dataset>) {
    let turns: usize = dataset
        .conversations
        .iter()
        .map(|c| c.client_turns.len())
        .sum();
    println!("\n== affinity: {} trajectories, {turns} turns, {REPLICAS} replicas, h100 profile, oracle replies ==", dataset.conversations.len());
    println!(
        "{:<12} {:>9} {:>12} {:>9} {:>10} {:>10} {:>10} {:>11} {:>9}",
        "routing",
        "KV/replica",
        "placement",
        "hit rate",
        "mean TTFT",
        "p90 TTFT",
        "makespan",
        "preemptions",
        "CPU"
    );
    for blocks in [5_000, 25_000] {
        for routing in [
            Routing::PinnedEven,
            Routing::PinnedHash,
            Routing::RoundRobin,
        ] {
            let r = replay(dataset.clone(), routing, blocks);
            let hits: u64 = r.stats.iter().map(|s| s.prefix_cache_hits).sum();
            let queries: u64 = r.stats.iter().map(|s| s.prefix_cache_queries).sum();
            let preemptions: u64 = r.stats.iter().map(|s| s.preemptions).sum();
            let mut sorted = r.ttfts.clone();
            sorted.sort_by(f64::total_cmp);
            let mean = sorted.iter().sum::<f64>() / sorted.len() as f64;
            let p90 = sorted[(sorted.len() * 9 / 10).min(sorted.len() - 1)];
            let placement = match routing {
                Routing::RoundRobin => "-".to_string(),
                _ => r
                    .placement
                    .iter()
                    .map(usize::to_string)
                    .collect::<Vec<_>>()
                    .join("/"),
            };
            println!(
                "{:<12} {:>8}K {:>12} {:>8.1}% {:>8.0}ms {:>8.0}ms {:>9.1}s {:>11} {:>7.2}s",
                format!("{routing:?}"),
                blocks * 16 / 1000,
                placement,
                100.0 * hits as f64 / queries as f64,
                mean * 1e3,
                p90 * 1e3,
                r.makespan,
                preemptions,
                r.cpu.as_secs_f64()
            );
        }
    }
    println!("(TTFT is client-side on the simulated clock: includes queueing, the 15 ms API overhead and prefill)");
}

// ---------------------------------------------------------------------------------------
// CPU cost: the simulator on its own thread and runtime, a driver on another.

/// CPU time consumed by the calling thread so far (ns resolution).
fn thread_cpu() -> Duration {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap_or_default();
    Duration::from_nanos(
        s.split_whitespace()
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
    )
}

/// A simulator on a dedicated thread whose CPU time can be read between workloads.
struct SimThread {
    addrs: Vec<std::net::SocketAddr>,
    cpu_probe: tokio::sync::mpsc::UnboundedSender<std::sync::mpsc::Sender<Duration>>,
    trigger: agentrace::shutdown::Trigger,
    thread: std::thread::JoinHandle<()>,
}

impl SimThread {
    fn start(oracle: Option<Arc<Oracle>>) -> SimThread {
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let (trigger, shutdown) = agentrace::shutdown::channel();
        let (probe_tx, mut probe_rx) =
            tokio::sync::mpsc::unbounded_channel::<std::sync::mpsc::Sender<Duration>>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                // Effectively no pacing: every simulated sleep is ~0 real time, so only the
                // simulator's own work is measured.
                let mut cfg = SimConfig {
                    time_scale: 1e-6,
                    ..SimConfig::default()
                };
                cfg.engine.num_gpu_blocks = 50_000;
                if oracle.is_some() {
                    cfg.responder.kind = ResponderKind::Oracle;
                }
                let cluster = sim::start_with_oracle(
                    cfg,
                    "127.0.0.1:0".parse().unwrap(),
                    1,
                    shutdown,
                    oracle,
                )
                .unwrap();
                addr_tx.send(cluster.addrs()).unwrap();
                tokio::spawn(async move {
                    while let Some(reply) = probe_rx.recv().await {
                        let _ = reply.send(thread_cpu());
                    }
                });
                cluster.join().await;
            });
        });
        SimThread {
            addrs: addr_rx.recv().unwrap(),
            cpu_probe: probe_tx,
            trigger,
            thread,
        }
    }

    fn cpu(&self) -> Duration {
        let (tx, rx) = std::sync::mpsc::channel();
        self.cpu_probe.send(tx).unwrap();
        rx.recv().unwrap()
    }

    fn stop(self) {
        self.trigger.fire();
        drop(self.cpu_probe);
        self.thread.join().unwrap();
    }
}

/// Sends `bodies` with `concurrency` closed-loop clients; returns (requests, body bytes,
/// output tokens, simulator CPU, driver CPU).
fn drive(
    sim: &SimThread,
    bodies: Vec<Vec<u8>>,
    concurrency: usize,
) -> (usize, usize, u64, Duration, Duration) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let addr = sim.addrs[0];
    let n = bodies.len();
    let bytes: usize = bodies.iter().map(Vec::len).sum();
    let sim_cpu0 = sim.cpu();
    let cpu0 = thread_cpu();
    let bodies = Arc::new(bodies);
    let out_tokens = rt.block_on(async move {
        let next = Arc::new(AtomicUsize::new(0));
        let tasks: Vec<_> = (0..concurrency)
            .map(|_| {
                let (next, bodies) = (next.clone(), bodies.clone());
                tokio::spawn(async move {
                    let mut tokens = 0;
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(body) = bodies.get(i) else { break };
                        let r =
                            request(addr, "POST", "/v1/chat/completions", body.clone(), &[]).await;
                        assert_eq!(r.status, 200);
                        tokens += r.usage()["completion_tokens"].as_u64().unwrap();
                    }
                    tokens
                })
            })
            .collect();
        let mut total = 0;
        for t in tasks {
            total += t.await.unwrap();
        }
        total
    });
    let driver = thread_cpu() - cpu0;
    (n, bytes, out_tokens, sim.cpu() - sim_cpu0, driver)
}

fn synthetic_bodies(n: usize, prompt_bytes: usize, out: u64) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| {
            let filler: String = (0..prompt_bytes / 5).map(|j| format!("{:04} ", (i * 131 + j) % 10_000)).collect();
            serde_json::to_vec(&json!({"messages": [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": filler}], "max_completion_tokens": out, "ignore_eos": true,
                "stream": true, "stream_options": {"include_usage": true}}))
            .unwrap()
        })
        .collect()
}

fn cost(dataset: Option<Arc<Dataset>>) {
    println!("\n== simulator CPU cost (simulator thread only; driver shown for context) ==");
    println!(
        "{:<34} {:>6} {:>9} {:>9} {:>12} {:>12} {:>13} {:>11}",
        "workload",
        "reqs",
        "MB sent",
        "out tok",
        "sim CPU",
        "per request",
        "per MB prompt",
        "driver CPU"
    );
    let row =
        |name: &str, (n, bytes, out, sim_cpu, driver): (usize, usize, u64, Duration, Duration)| {
            let mb = bytes as f64 / 1e6;
            println!(
                "{:<34} {:>6} {:>9.1} {:>9} {:>10.0}ms {:>10.0}µs {:>11.1}ms {:>9.0}ms",
                name,
                n,
                mb,
                out,
                sim_cpu.as_secs_f64() * 1e3,
                sim_cpu.as_secs_f64() * 1e6 / n as f64,
                sim_cpu.as_secs_f64() * 1e3 / mb,
                driver.as_secs_f64() * 1e3
            );
        };
    let sim = SimThread::start(None);
    row(
        "1 KB prompt, 16 tokens out",
        drive(&sim, synthetic_bodies(2_000, 1_000, 16), 4),
    );
    row(
        "256 KB prompt, 16 tokens out",
        drive(&sim, synthetic_bodies(200, 256_000, 16), 4),
    );
    row(
        "1 KB prompt, 256 tokens out",
        drive(&sim, synthetic_bodies(300, 1_000, 256), 4),
    );
    sim.stop();
    if let Some(dataset) = dataset {
        let oracle = Arc::new(Oracle::new(dataset.clone()).unwrap());
        let sim = SimThread::start(Some(oracle));
        let bodies: Vec<Vec<u8>> = dataset
            .conversations
            .iter()
            .flat_map(|c| c.client_turns.iter().map(move |t| turn_body(c, t)))
            .collect();
        row(
            "MLPerf sample, every turn (oracle)",
            drive(&sim, bodies, 20),
        );
        sim.stop();
    }
    println!("(CPU from /proc/thread-self/schedstat of each runtime's single thread)");
}

/// 64-bit FNV-1a of the bytes: the hash a simple client-side router would place by.
fn fnv1a(bytes: &[u8]) -> u64 {
    use std::hash::Hasher;
    let mut h = fnv::FnvHasher::default();
    h.write(bytes);
    h.finish()
}
