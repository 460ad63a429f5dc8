//! HTTP/2 (h2c) attacks on the proxy: connections that settle in and then never answer a
//! PING, and streams reset right after they were opened.

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use rand::Rng;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::backends::CHAT_BODY;
use crate::http1::Tally;
use crate::probe;
use crate::proxy::Session;
use crate::report::Run;
use crate::Ctx;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_SETTINGS: u8 = 0x4;
const FRAME_PING: u8 = 0x6;
const FRAME_GOAWAY: u8 = 0x7;

/// A frame header: payload length, type, flags, stream 0.
fn frame_header(len: usize, kind: u8, flags: u8) -> [u8; 9] {
    let l = (len as u32).to_be_bytes();
    [l[1], l[2], l[3], kind, flags, 0, 0, 0, 0]
}

/// Frames read from a raw h2 connection, parsed as they complete.
#[derive(Default)]
struct Frames {
    buf: Vec<u8>,
    pings: u64,
    goaways: u64,
    server_settings: bool,
}

impl Frames {
    fn feed(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
        while self.buf.len() >= 9 {
            let len = u32::from_be_bytes([0, self.buf[0], self.buf[1], self.buf[2]]) as usize;
            if self.buf.len() < 9 + len {
                break;
            }
            let (kind, flags) = (self.buf[3], self.buf[4]);
            match kind {
                FRAME_SETTINGS if flags & 1 == 0 => self.server_settings = true,
                FRAME_PING if flags & 1 == 0 => self.pings += 1,
                FRAME_GOAWAY => self.goaways += 1,
                _ => {}
            }
            self.buf.drain(..9 + len);
        }
    }
}

/// A raw h2c connection that sends the preface and SETTINGS, acknowledges the server's
/// SETTINGS, and from then on reads nothing.
async fn settle(addr: std::net::SocketAddr) -> Result<(TcpStream, Frames), String> {
    let mut s = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect: {}", e.kind()))?;
    let mut hello = PREFACE.to_vec();
    hello.extend_from_slice(&frame_header(0, FRAME_SETTINGS, 0));
    s.write_all(&hello).await.map_err(|e| e.to_string())?;
    let mut frames = Frames::default();
    let mut buf = [0u8; 4096];
    while !frames.server_settings {
        match tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await {
            Ok(Ok(0)) => return Err("closed before SETTINGS".into()),
            Ok(Ok(n)) => frames.feed(&buf[..n]),
            Ok(Err(e)) => return Err(format!("read: {}", e.kind())),
            Err(_) => return Err("no SETTINGS in 5 s".into()),
        }
    }
    s.write_all(&frame_header(0, FRAME_SETTINGS, 1))
        .await
        .map_err(|e| e.to_string())?;
    Ok((s, frames))
}

/// Reads what the server sent meanwhile: whether the connection is still open.
async fn drain(s: &mut TcpStream, frames: &mut Frames) -> &'static str {
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(Duration::from_millis(50), s.read(&mut buf)).await {
            Err(_) => return "open at end",
            Ok(Ok(0)) => return "closed",
            Ok(Ok(n)) => frames.feed(&buf[..n]),
            Ok(Err(_)) => return "reset",
        }
    }
}

/// h2c connections that never acknowledge a PING nor read, under a short idle timeout.
pub async fn idle_no_ack(ctx: &Ctx, bin: &Path, run: Run) -> Run {
    let extra = format!(
        "[client]\nidle_timeout_ms = {}\n",
        ctx.args.h2_idle_timeout_ms
    );
    let mut s = Session::begin(ctx, bin, run, ctx.backends.fast, &extra, false).await;
    let addr = s.proxy.addr;
    let mut tasks = Vec::new();
    for _ in 0..ctx.args.h2_idle_conns {
        tasks.push(tokio::spawn(settle(addr)));
    }
    let mut conns = Vec::new();
    let mut tally = Tally::default();
    for t in tasks {
        match t.await.unwrap() {
            Ok(c) => conns.push(c),
            Err(e) => tally.add(e),
        }
    }
    let settled = conns.len();
    let watch = Duration::from_millis(ctx.args.h2_idle_timeout_ms)
        + Duration::from_secs_f64(ctx.args.h2_idle_grace_secs);
    tokio::time::sleep(watch).await;
    let fds_held = crate::procfs::fd_count(s.proxy.pid).unwrap_or(0);
    let drains: Vec<_> = conns
        .into_iter()
        .map(|(mut stream, mut frames)| {
            tokio::spawn(async move {
                let state = drain(&mut stream, &mut frames).await;
                (state, frames, stream)
            })
        })
        .collect();
    let (mut pings, mut goaways, mut conns) = (0, 0, Vec::new());
    for d in drains {
        let (state, frames, stream) = d.await.unwrap();
        tally.add(state);
        pings += frames.pings;
        goaways += frames.goaways;
        conns.push(stream);
    }
    let fresh = probe::one_request(&s.probe_target).await;
    s.run.num("connections settled", settled as f64, "");
    s.run.text("after the idle timeout + grace", tally.text());
    s.run.num(
        "still open after the idle timeout + grace",
        tally.count("open at end") as f64,
        "",
    );
    s.run.num(
        "proxy fds after the idle timeout + grace",
        fds_held as f64,
        "",
    );
    s.run
        .num("PINGs received, never acknowledged", pings as f64, "");
    s.run.num("GOAWAYs received", goaways as f64, "");
    s.run.text(
        "a fresh HTTP/1.1 request then",
        fresh.map_or_else(|e| format!("failed: {e}"), |()| "200".into()),
    );
    drop(conns);
    s.end().await
}

/// What one rapid-reset connection did.
#[derive(Default)]
struct Resets {
    sent: u64,
    /// Times the proxy ended the connection (GOAWAY or close) before the attack's end.
    closed_by_proxy: u64,
    first_error: Option<String>,
}

/// h2c connections opening chat-completion streams in small batches and resetting each
/// 2-5 ms later.
pub async fn rapid_reset(ctx: &Ctx, bin: &Path, run: Run) -> Run {
    // The streaming backend, which keeps generating until the proxy hangs up: as an engine
    // does, so a reset cancels a request under way rather than one already answered.
    let mut s = Session::begin(ctx, bin, run, ctx.backends.sse, "", false).await;
    let addr = s.proxy.addr;
    let batch = ctx.args.reset_batch;
    let deadline = Instant::now() + Duration::from_secs_f64(ctx.args.reset_secs);
    let cpu0 = s.proxy.cpu();
    let tasks: Vec<_> = (0..ctx.args.reset_conns)
        .map(|_| tokio::spawn(reset_conn(addr, batch, deadline)))
        .collect();
    let mut total = Resets::default();
    for t in tasks {
        let r = t.await.unwrap();
        total.sent += r.sent;
        total.closed_by_proxy += r.closed_by_proxy;
        total.first_error = total.first_error.or(r.first_error);
    }
    let cpu = s.proxy.cpu() - cpu0;
    // Let requests already on their way reach the backend before counting.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let delta = s.backend_delta(ctx).await;
    s.run.num("streams opened and reset", total.sent as f64, "");
    s.run.num(
        "requests that reached the backend",
        delta.sse_requests as f64,
        "",
    );
    s.run.num(
        "share that reached the backend",
        100.0 * delta.sse_requests as f64 / total.sent.max(1) as f64,
        "%",
    );
    s.run.num(
        "connections the proxy ended",
        total.closed_by_proxy as f64,
        "",
    );
    if let Some(e) = total.first_error {
        s.run.text("first connection error", e);
    }
    s.run.num("proxy CPU while resetting", cpu, "s");
    s.end().await
}

async fn reset_conn(addr: std::net::SocketAddr, batch: usize, deadline: Instant) -> Resets {
    let mut r = Resets::default();
    let uri = format!("http://{addr}/v1/chat/completions");
    'connection: while Instant::now() < deadline {
        let tcp = match TcpStream::connect(addr).await {
            Ok(t) => t,
            Err(e) => {
                r.first_error.get_or_insert(format!("connect: {e}"));
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        tcp.set_nodelay(true).ok();
        let (mut client, conn) = match h2::client::handshake(tcp).await {
            Ok(h) => h,
            Err(e) => {
                r.first_error.get_or_insert(format!("handshake: {e}"));
                r.closed_by_proxy += 1;
                continue;
            }
        };
        let driver = tokio::spawn(conn);
        while Instant::now() < deadline {
            let mut streams = Vec::with_capacity(batch);
            for _ in 0..batch {
                let req = http::Request::post(&uri)
                    .header("content-type", "application/json")
                    .body(())
                    .unwrap();
                client = match client.ready().await {
                    Ok(ready) => ready,
                    Err(e) => {
                        r.first_error.get_or_insert(e.to_string());
                        r.closed_by_proxy += 1;
                        driver.abort();
                        continue 'connection;
                    }
                };
                match client.send_request(req, false) {
                    Ok((response, mut stream)) => {
                        let _ = stream.send_data(Bytes::from_static(CHAT_BODY.as_bytes()), true);
                        streams.push((response, stream));
                        r.sent += 1;
                    }
                    Err(e) => {
                        r.first_error.get_or_insert(e.to_string());
                        r.closed_by_proxy += 1;
                        driver.abort();
                        continue 'connection;
                    }
                }
            }
            let wait = rand::thread_rng().gen_range(2_000..=5_000);
            tokio::time::sleep(Duration::from_micros(wait)).await;
            for (response, mut stream) in streams {
                stream.send_reset(h2::Reason::CANCEL);
                drop(response);
            }
        }
        driver.abort();
    }
    r
}
