//! The proxy under test as a child process, and the frame every proxy attack runs in: a fresh
//! proxy, warmed up; its memory, descriptors and CPU read before, sampled during and read after
//! the attack; the probe running throughout; the machine's load at both ends.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::AsyncBufReadExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::backends::Counters;
use crate::peer;
use crate::probe::{self, Probe, ProbeStats};
use crate::procfs::{self, Sampler};
use crate::report::Run;
use crate::Ctx;

/// A running `agentrace proxy`.
pub struct Proxy {
    child: tokio::process::Child,
    pub pid: u32,
    pub addr: SocketAddr,
    /// The admin listener; peers have none.
    pub admin: Option<SocketAddr>,
}

impl Proxy {
    /// Starts `bin proxy` with one backend; `extra` is TOML laid over `--proxy-config` (keys
    /// the attack needs, such as `[tls]`).
    pub async fn start(ctx: &Ctx, bin: &Path, backend: SocketAddr, extra: &str) -> Proxy {
        if let Some(peer) = peer::of(bin) {
            return Proxy::start_peer(ctx, peer, bin, backend).await;
        }
        let mut command = tokio::process::Command::new(bin);
        command.args([
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ]);
        command.arg("--backend").arg(format!("http://{backend}"));
        if let Some(config) = ctx.proxy_config(extra, backend) {
            command.arg("--config").arg(config);
        }
        let log = std::fs::File::create(ctx.dir.path().join("proxy.log")).unwrap();
        let mut child = command
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
        .unwrap_or_else(|| {
            let log = std::fs::read_to_string(ctx.dir.path().join("proxy.log"));
            panic!("{} did not announce its address: {log:?}", bin.display())
        });
        // "agentrace proxy listening on ADDR (admin ADMIN)"
        let words: Vec<&str> = line.split_whitespace().collect();
        let addr = words[4].parse().expect("proxy address");
        let admin = words[6]
            .trim_end_matches(')')
            .parse()
            .expect("admin address");
        Proxy {
            child,
            pid,
            addr,
            admin: Some(admin),
        }
    }

    /// Starts a peer proxy and waits until it accepts connections.
    async fn start_peer(ctx: &Ctx, peer: &str, bin: &Path, backend: SocketAddr) -> Proxy {
        let (mut command, addr) = peer::command(peer, bin, ctx.dir.path(), backend);
        let log = std::fs::File::create(ctx.dir.path().join(format!("{peer}.log"))).unwrap();
        let child = command
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
        let pid = child.id().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(addr).await.is_err() {
            assert!(
                Instant::now() < deadline,
                "{peer} did not listen on {addr}: {:?}",
                std::fs::read_to_string(ctx.dir.path().join(format!("{peer}.log")))
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Proxy {
            child,
            pid,
            addr,
            admin: None,
        }
    }

    /// The sum of every series of metric `name` on `/metrics`, `None` when there is none.
    pub async fn metric(&self, name: &str) -> Option<f64> {
        let text = http_get(self.admin?, "/metrics").await?;
        let values: Vec<f64> = text
            .lines()
            .filter(|l| {
                l.strip_prefix(name)
                    .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
            .collect();
        (!values.is_empty()).then(|| values.iter().sum())
    }

    pub fn cpu(&self) -> f64 {
        procfs::cpu_seconds(self.pid).unwrap_or(f64::NAN)
    }

    pub async fn stop(mut self) {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
    }
}

/// A plain `GET` with `Connection: close`: the body, or `None` on any failure.
async fn http_get(addr: SocketAddr, path: &str) -> Option<String> {
    let fetch = async {
        let mut s = TcpStream::connect(addr).await.ok()?;
        let head = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        s.write_all(head.as_bytes()).await.ok()?;
        let mut text = String::new();
        s.read_to_string(&mut text).await.ok()?;
        Some(text.split_once("\r\n\r\n")?.1.to_string())
    };
    tokio::time::timeout(Duration::from_secs(5), fetch)
        .await
        .ok()
        .flatten()
}

/// One attack on a fresh proxy, from the readings before to the report after.
pub struct Session {
    pub proxy: Proxy,
    pub run: Run,
    pub probe_target: probe::Target,
    probe: Option<Probe>,
    sampler: Sampler,
    started: Instant,
    cpu_start: f64,
    rss_start_kib: u64,
    fds_start: usize,
    counters_start: Counters,
    load_start: String,
}

impl Session {
    /// Starts a proxy in front of `backend`, warms it up with a few probe requests, reads its
    /// resting state and starts the sampler and the probe.
    pub async fn begin(
        ctx: &Ctx,
        bin: &Path,
        mut run: Run,
        backend: SocketAddr,
        extra: &str,
        tls: bool,
    ) -> Session {
        let proxy = Proxy::start(ctx, bin, backend, extra).await;
        let probe_target = probe::Target {
            addr: proxy.addr,
            tls: tls.then(|| ctx.tls.probe.clone()),
        };
        for _ in 0..3 {
            if let Err(e) = probe::one_request(&probe_target).await {
                run.text("warm-up request", e);
            }
        }
        let load_start = procfs::loadavg();
        let counters_start = ctx.backends.counters().await;
        let rss_start_kib = procfs::status_kib(proxy.pid, "VmRSS").unwrap_or(0);
        let fds_start = procfs::fd_count(proxy.pid).unwrap_or(0);
        let cpu_start = proxy.cpu();
        let sampler = Sampler::start(proxy.pid);
        let probe = Some(Probe::start(probe_target.clone(), ctx.args.probe_rate));
        Session {
            proxy,
            run,
            probe_target,
            probe,
            sampler,
            started: Instant::now(),
            cpu_start,
            rss_start_kib,
            fds_start,
            counters_start,
            load_start,
        }
    }

    /// What reached the backends since the session began.
    pub async fn backend_delta(&self, ctx: &Ctx) -> Counters {
        let now = ctx.backends.counters().await;
        let s = &self.counters_start;
        Counters {
            attack_requests: now.attack_requests - s.attack_requests,
            probe_requests: now.probe_requests - s.probe_requests,
            body_bytes: now.body_bytes - s.body_bytes,
            storm_requests: now.storm_requests - s.storm_requests,
            storm_open: now.storm_open,
            sse_requests: now.sse_requests - s.sse_requests,
            sse_bytes: now.sse_bytes - s.sse_bytes,
        }
    }

    /// Stops the probe and the sampler, adds the proxy's and the probe's rows, stops the proxy.
    pub async fn end(mut self) -> Run {
        let probe = self.probe.take().map(Probe::stop).unwrap_or_default();
        let peaks = self.sampler.stop();
        let wall = self.started.elapsed().as_secs_f64();
        let cpu = self.proxy.cpu() - self.cpu_start;
        let pid = self.proxy.pid;
        let rss_end = procfs::status_kib(pid, "VmRSS").unwrap_or(0);
        let fds_end = procfs::fd_count(pid).unwrap_or(0);
        let alive = procfs::status_kib(pid, "VmRSS").is_some();
        let run = &mut self.run;
        let mib = |kib: u64| kib as f64 / 1024.0;
        let peak = peaks.hwm_kib.max(peaks.rss_kib).max(rss_end);
        run.num("proxy RSS at start", mib(self.rss_start_kib), "MiB");
        run.num("proxy RSS peak", mib(peak), "MiB");
        run.num(
            "proxy RSS growth (peak - start)",
            mib(peak.saturating_sub(self.rss_start_kib)),
            "MiB",
        );
        run.num("proxy RSS at end", mib(rss_end), "MiB");
        run.num("proxy fds at start", self.fds_start as f64, "");
        run.num("proxy fds peak", peaks.fds as f64, "");
        run.num("proxy fds at end", fds_end as f64, "");
        run.num("proxy CPU over the attack", cpu, "s");
        run.num("proxy CPU, share of a core", 100.0 * cpu / wall, "%");
        if !alive {
            run.text("proxy process", "gone before the end");
        }
        probe_rows(run, &probe);
        run.text(
            "load 1/5/15 min, start -> end",
            format!("{} -> {}", self.load_start, procfs::loadavg()),
        );
        run.num("attack wall time", wall, "s");
        let run = self.run.clone();
        self.proxy.stop().await;
        run
    }
}

/// The probe's rows: requests, failures (with the first reason), p50/p99/max.
pub fn probe_rows(run: &mut Run, probe: &ProbeStats) {
    run.num("probe requests", probe.sent as f64, "");
    run.num("probe failures", probe.failed as f64, "");
    if let Some(e) = &probe.first_error {
        run.text("probe first failure", e.clone());
    }
    run.num("probe p50", probe.quantile_ms(0.50), "ms");
    run.num("probe p99", probe.quantile_ms(0.99), "ms");
    run.num("probe max", probe.quantile_ms(1.0), "ms");
}
