//! A proxy whose backend is itself, and a backend that answers before reading the body: the
//! third round's proxy cases.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

use crate::http1::Tally;
use crate::procfs::{self, Sampler};
use crate::proxy::Proxy;
use crate::report::Run;
use crate::Ctx;

/// Each request of these attacks gets this long, then counts as "no answer".
const REQUEST_SECS: u64 = 60;

/// POSTs `body_bytes` to `addr` on a connection of its own and returns what came back: the
/// status, or what went wrong.
async fn post(addr: SocketAddr, body_bytes: usize) -> String {
    let send = async {
        let tcp = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let (mut send, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
                .await
                .map_err(|e| format!("handshake: {e}"))?;
        tokio::spawn(conn);
        let req = Request::post("/v1/chat/completions")
            .header("host", addr.to_string())
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(vec![b' '; body_bytes])))
            .unwrap();
        let resp = send
            .send_request(req)
            .await
            .map_err(|e| format!("error: {e}"))?;
        let status = resp.status().as_u16();
        let _ = resp.into_body().collect().await;
        Ok::<_, String>(status.to_string())
    };
    match tokio::time::timeout(Duration::from_secs(REQUEST_SECS), send).await {
        Ok(Ok(status)) => status,
        Ok(Err(e)) => e.split(':').next().unwrap_or("error").to_string(),
        Err(_) => format!("no answer in {REQUEST_SECS} s"),
    }
}

/// `bin proxy` listening on a port it is also given as its one backend, health probes on
/// (every second, the default): 20 concurrent requests, then the probes alone for a while.
pub async fn self_loop(ctx: &Ctx, bin: &Path, mut run: Run) -> Run {
    let port = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap();
    let log = std::fs::File::create(ctx.dir.path().join("self-loop.log")).unwrap();
    let mut child = tokio::process::Command::new(bin)
        .args([
            "proxy",
            "--listen",
            &port.to_string(),
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .args(["--backend", &format!("http://{port}")])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = child.id().unwrap();
    let stdout = child.stdout.take().unwrap();
    let announced = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::io::BufReader::new(stdout).lines().next_line(),
    )
    .await;
    assert!(
        matches!(announced, Ok(Ok(Some(_)))),
        "{} did not start",
        bin.display()
    );
    let load_start = procfs::loadavg();
    let fds_start = procfs::fd_count(pid).unwrap_or(0);
    let sampler = Sampler::start(pid);
    let started = Instant::now();
    let requests = ctx.args.loop_requests;
    let tasks: Vec<_> = (0..requests)
        .map(|_| tokio::spawn(post(port, 1024)))
        .collect();
    let mut tally = Tally::default();
    for t in tasks {
        tally.add(t.await.unwrap_or_else(|_| "task failed".into()));
    }
    let answered = started.elapsed().as_secs_f64();
    let fds_after_requests = procfs::fd_count(pid).unwrap_or(0);
    // The health probes alone: do they loop too?
    tokio::time::sleep(Duration::from_secs_f64(ctx.args.loop_idle_secs)).await;
    let fds_idle = procfs::fd_count(pid).unwrap_or(0);
    let peaks = sampler.stop();
    let mib = |kib: u64| kib as f64 / 1024.0;
    run.text("client statuses", tally.text());
    run.num("time to answer every request", answered, "s");
    run.num("proxy fds at start", fds_start as f64, "");
    run.num("proxy fds peak", peaks.fds as f64, "");
    run.num(
        "proxy fds after the requests",
        fds_after_requests as f64,
        "",
    );
    run.num(
        &format!(
            "proxy fds after {} s of probes alone",
            ctx.args.loop_idle_secs
        ),
        fds_idle as f64,
        "",
    );
    run.num(
        "proxy RSS peak",
        mib(peaks.hwm_kib.max(peaks.rss_kib)),
        "MiB",
    );
    run.text(
        "load 1/5/15 min, start -> end",
        format!("{load_start} -> {}", procfs::loadavg()),
    );
    let _ = child.start_kill();
    let _ = child.wait().await;
    run
}

/// A backend that reads each request's head, answers `413` with a small body and closes, the
/// body unread (as a server refusing an upload does). Returns its address.
async fn early_413_backend() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut chunk = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&chunk[..n]),
                    }
                }
                let body = "{\"error\":{\"message\":\"upload too large\"}}";
                let reply = format!(
                    "HTTP/1.1 413 Payload Too Large\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = conn.write_all(reply.as_bytes()).await;
            });
        }
    });
    addr
}

/// Clients POSTing a large body each to a backend that answers 413 before reading it.
pub async fn early_413(ctx: &Ctx, bin: &Path, mut run: Run) -> Run {
    let backend = early_413_backend().await;
    let proxy = Proxy::start(ctx, bin, backend, "").await;
    let body = ctx.args.early_body_mib * 1024 * 1024;
    let started = Instant::now();
    let tasks: Vec<_> = (0..ctx.args.early_requests)
        .map(|_| tokio::spawn(post(proxy.addr, body)))
        .collect();
    let mut tally = Tally::default();
    for t in tasks {
        tally.add(t.await.unwrap_or_else(|_| "task failed".into()));
    }
    run.text("client statuses", tally.text());
    run.num(
        "time to answer every request",
        started.elapsed().as_secs_f64(),
        "s",
    );
    run.text("load 1/5/15 min at end", procfs::loadavg());
    proxy.stop().await;
    run
}
