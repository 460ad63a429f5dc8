//! `agentrace epp` following an `InferencePool` through an API server that misbehaves: a
//! fake Kubernetes API in this process (real HTTP on `127.0.0.1:0`) serving `--pool-pods`
//! ready pods, and the picker started from `--bin` against it.
//!
//! - `pool-rewatch`: every watch ends as soon as it opens; re-watches a second and the
//!   picker's CPU over `--pool-secs`.
//! - `pool-bookmarks`: a pod watch that sends BOOKMARK events as fast as the picker reads them;
//!   a placement probe (one ext_proc stream per request) before and during the storm.
//! - `pool-metrics`: `/metrics` size and render time with every pod an endpoint.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;

use crate::procfs::{self, Sampler};
use crate::report::Run;
use crate::Ctx;

type Body = BoxBody<Bytes, Infallible>;

/// What the fake API server's pod watches do.
#[derive(Clone, Copy, PartialEq)]
enum Watch {
    /// End at once, with no event.
    Closes,
    /// Stay open and silent until the storm starts, then send bookmarks without end.
    Bookmarks,
    /// Stay open and silent.
    Quiet,
}

struct FakeApi {
    addr: SocketAddr,
    watch_opens: Arc<AtomicU64>,
    storm: tokio::sync::watch::Sender<bool>,
}

impl FakeApi {
    async fn start(pods: usize, watch: Watch) -> FakeApi {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let pods: Arc<Vec<String>> = Arc::new((0..pods).map(pod).collect());
        let watch_opens = Arc::new(AtomicU64::new(0));
        let (storm, storm_rx) = tokio::sync::watch::channel(false);
        let opens = watch_opens.clone();
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let (pods, opens, storm) = (pods.clone(), opens.clone(), storm_rx.clone());
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let reply = answer(&req, &pods, &opens, watch, storm.clone());
                        async move { Ok::<_, Infallible>(reply) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tcp), service)
                        .await;
                });
            }
        });
        FakeApi {
            addr,
            watch_opens,
            storm,
        }
    }
}

fn pod(i: usize) -> String {
    format!(
        r#"{{"metadata":{{"name":"m-{i}","resourceVersion":"10"}},"status":{{"phase":"Running","podIP":"10.{}.{}.{}","conditions":[{{"type":"Ready","status":"True"}}]}}}}"#,
        i / 62_500,
        i / 250 % 250,
        i % 250 + 1
    )
}

fn answer(
    req: &hyper::Request<hyper::body::Incoming>,
    pods: &[String],
    opens: &AtomicU64,
    watch: Watch,
    storm: tokio::sync::watch::Receiver<bool>,
) -> hyper::Response<Body> {
    let path = req.uri().path();
    let query = req.uri().query().unwrap_or("");
    let param = |name: &str| {
        query
            .split('&')
            .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
    };
    if param("watch") == Some("true") {
        if path.ends_with("/pods") {
            opens.fetch_add(1, Ordering::Relaxed);
        }
        if watch == Watch::Closes {
            return json(String::new());
        }
        let bookmarks = watch == Watch::Bookmarks && path.ends_with("/pods");
        let line = "{\"type\":\"BOOKMARK\",\"object\":{\"kind\":\"Pod\",\"metadata\":{\"resourceVersion\":\"10\"}}}\n";
        let chunk = Bytes::from(line.repeat(256));
        let stream = futures_util::stream::unfold((), move |()| {
            let chunk = chunk.clone();
            let mut storm = storm.clone();
            async move {
                let _ = storm.wait_for(|on| *on && bookmarks).await;
                if !bookmarks {
                    std::future::pending::<()>().await;
                }
                Some((Ok::<_, Infallible>(Frame::data(chunk)), ()))
            }
        });
        return hyper::Response::new(StreamBody::new(stream).boxed());
    }
    if path.ends_with("/pods") {
        let limit: usize = param("limit").and_then(|v| v.parse().ok()).unwrap_or(500);
        let from: usize = param("continue").and_then(|v| v.parse().ok()).unwrap_or(0);
        let end = (from + limit).min(pods.len());
        let next = if end < pods.len() {
            format!(",\"continue\":\"{end}\"")
        } else {
            String::new()
        };
        return json(format!(
            r#"{{"kind":"PodList","metadata":{{"resourceVersion":"10"{next}}},"items":[{}]}}"#,
            pods[from..end].join(",")
        ));
    }
    json(
        r#"{"metadata":{"name":"pool","resourceVersion":"5"},"spec":{"selector":{"matchLabels":{"app":"m"}},"targetPorts":[{"number":8000}]}}"#
            .into(),
    )
}

fn json(body: String) -> hyper::Response<Body> {
    hyper::Response::builder()
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)).boxed())
        .unwrap()
}

/// A running `agentrace epp`.
struct Epp {
    child: tokio::process::Child,
    pid: u32,
    addr: SocketAddr,
    admin: SocketAddr,
}

impl Epp {
    async fn start(ctx: &Ctx, bin: &Path, api: SocketAddr, pods: usize) -> Epp {
        let config = ctx.dir.path().join("epp.toml");
        std::fs::write(
            &config,
            format!(
                "[health]\ninterval_ms = 0\n[epp.inference_pool]\nname = \"pool\"\nnamespace = \"ns\"\napi_server = \"http://{api}\"\ntoken_file = \"/nonexistent\"\nca_file = \"/nonexistent\"\nmax_pods = {}\n",
                pods.max(1) * 2
            ),
        )
        .unwrap();
        let log = std::fs::File::create(ctx.dir.path().join("epp.log")).unwrap();
        let mut child = tokio::process::Command::new(bin)
            .args([
                "epp",
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
            ])
            .arg("--config")
            .arg(&config)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
        let pid = child.id().unwrap();
        let stdout = child.stdout.take().unwrap();
        let line = tokio::time::timeout(
            Duration::from_secs(30),
            tokio::io::BufReader::new(stdout).lines().next_line(),
        )
        .await
        .ok()
        .and_then(|l| l.ok().flatten())
        .expect("agentrace epp announces its addresses");
        // "agentrace epp listening on ADDR (admin ADMIN)"
        let words: Vec<&str> = line.split_whitespace().collect();
        Epp {
            child,
            pid,
            addr: words[4].parse().expect("epp address"),
            admin: words[6]
                .trim_end_matches(')')
                .parse()
                .expect("admin address"),
        }
    }

    async fn stop(mut self) {
        procfs::kill(self.pid, libc::SIGKILL);
        let _ = self.child.wait().await;
    }
}

/// One placement through a fresh ext_proc stream: the time to the answer, or why none.
async fn place(
    client: &mut ExternalProcessorClient<tonic::transport::Channel>,
    session: usize,
) -> Result<Duration, String> {
    let started = Instant::now();
    let msg = crate::epp::headers_msg(&format!("s{session}"), true);
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(msg).await.unwrap();
    let outbound =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
    let mut replies = client
        .process(outbound)
        .await
        .map_err(|e| e.to_string())?
        .into_inner();
    let reply = replies
        .message()
        .await
        .map_err(|e| e.to_string())?
        .ok_or("no reply")?;
    drop(tx);
    match reply.response {
        Some(Response::RequestHeaders(_)) => Ok(started.elapsed()),
        other => Err(format!("not placed: {other:?}")),
    }
}

async fn client(addr: SocketAddr) -> ExternalProcessorClient<tonic::transport::Channel> {
    ExternalProcessorClient::connect(format!("http://{addr}"))
        .await
        .expect("connect to the picker")
}

/// Waits until the picker places requests (its pool's endpoints are known).
async fn wait_placing(addr: SocketAddr) -> Duration {
    let started = Instant::now();
    let mut c = client(addr).await;
    while place(&mut c, 0).await.is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the picker never placed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    started.elapsed()
}

/// Probes placement at `rate` per second for `secs`: (placements, failures, p50 ms, p99 ms).
async fn probe(addr: SocketAddr, rate: f64, secs: f64) -> (usize, usize, f64, f64) {
    let mut c = client(addr).await;
    let end = Instant::now() + Duration::from_secs_f64(secs);
    let every = Duration::from_secs_f64(1.0 / rate);
    let mut next = Instant::now();
    let (mut ms, mut failed) = (Vec::new(), 0);
    let mut i = 0;
    while Instant::now() < end {
        tokio::time::sleep_until(next).await;
        next += every;
        i += 1;
        match place(&mut c, i).await {
            Ok(d) => ms.push(d.as_secs_f64() * 1000.0),
            Err(_) => failed += 1,
        }
    }
    ms.sort_by(f64::total_cmp);
    let q = |q: f64| {
        ms.get(((ms.len() as f64 - 1.0) * q).round() as usize)
            .copied()
            .unwrap_or(f64::NAN)
    };
    (ms.len(), failed, q(0.5), q(0.99))
}

/// GET `/metrics` on the admin port: (bytes, seconds).
async fn scrape(admin: SocketAddr) -> (usize, f64) {
    let started = Instant::now();
    let mut tcp = tokio::net::TcpStream::connect(admin).await.unwrap();
    tcp.write_all(b"GET /metrics HTTP/1.1\r\nhost: bench\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut response = Vec::new();
    tcp.read_to_end(&mut response).await.unwrap();
    let elapsed = started.elapsed().as_secs_f64();
    let head = memchr::memmem::find(&response, b"\r\n\r\n").map_or(0, |i| i + 4);
    (response.len() - head, elapsed)
}

pub async fn rewatch(ctx: &Ctx, bin: &Path, mut run: Run) -> Run {
    let api = FakeApi::start(10, Watch::Closes).await;
    let epp = Epp::start(ctx, bin, api.addr, 10).await;
    wait_placing(epp.addr).await;
    let secs = ctx.args.pool_secs;
    let (opens, cpu) = (
        api.watch_opens.load(Ordering::Relaxed),
        procfs::cpu_seconds(epp.pid).unwrap_or(0.0),
    );
    let sampler = Sampler::start(epp.pid);
    tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    let peaks = sampler.stop();
    let opens = api.watch_opens.load(Ordering::Relaxed) - opens;
    let cpu = procfs::cpu_seconds(epp.pid).unwrap_or(0.0) - cpu;
    run.num("pod watches opened", opens as f64, "");
    run.num("re-watches per second", opens as f64 / secs, "/s");
    run.num("picker CPU", 100.0 * cpu / secs, "%");
    run.num("picker peak RSS", peaks.rss_kib as f64 / 1024.0, "MiB");
    epp.stop().await;
    run
}

pub async fn bookmarks(ctx: &Ctx, bin: &Path, mut run: Run) -> Run {
    let pods = ctx.args.pool_pods;
    let api = FakeApi::start(pods, Watch::Bookmarks).await;
    let epp = Epp::start(ctx, bin, api.addr, pods).await;
    let ready = wait_placing(epp.addr).await;
    run.num("endpoints known after", ready.as_secs_f64(), "s");
    let secs = ctx.args.pool_secs;
    let rate = ctx.args.probe_rate;
    let (n, failed, p50, p99) = probe(epp.addr, rate, secs / 2.0).await;
    run.num("quiet: placements", n as f64, "");
    run.num("quiet: failed", failed as f64, "");
    run.num("quiet: probe p50", p50, "ms");
    run.num("quiet: probe p99", p99, "ms");
    let cpu = procfs::cpu_seconds(epp.pid).unwrap_or(0.0);
    api.storm.send_replace(true);
    let (n, failed, p50, p99) = probe(epp.addr, rate, secs).await;
    let cpu = procfs::cpu_seconds(epp.pid).unwrap_or(0.0) - cpu;
    run.num("storm: placements", n as f64, "");
    run.num("storm: failed", failed as f64, "");
    run.num("storm: probe p50", p50, "ms");
    run.num("storm: probe p99", p99, "ms");
    run.num("storm: picker CPU", 100.0 * cpu / secs, "%");
    epp.stop().await;
    run
}

pub async fn metrics(ctx: &Ctx, bin: &Path, mut run: Run) -> Run {
    let pods = ctx.args.pool_pods;
    let api = FakeApi::start(pods, Watch::Quiet).await;
    let epp = Epp::start(ctx, bin, api.addr, pods).await;
    let ready = wait_placing(epp.addr).await;
    run.num("endpoints known after", ready.as_secs_f64(), "s");
    let mut times = Vec::new();
    let mut bytes = 0;
    for _ in 0..3 {
        let (b, t) = scrape(epp.admin).await;
        bytes = b;
        times.push(t);
    }
    times.sort_by(f64::total_cmp);
    run.num("/metrics size", bytes as f64 / 1e6, "MB");
    run.num("/metrics render, median of 3", times[1] * 1000.0, "ms");
    run.num("/metrics render, slowest of 3", times[2] * 1000.0, "ms");
    epp.stop().await;
    run
}
