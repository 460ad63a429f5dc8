//! HTTP/1.1 attacks on the proxy: many large session keys, large bodies at once, a backend
//! that never gets past interim responses, slow heads, idle connections.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper::Request;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::backends::CHAT_BODY;
use crate::proxy::Session;
use crate::report::{fmt_num, Run};
use crate::Ctx;

/// Counts of what the attackers got (statuses, errors), printed largest first.
#[derive(Default)]
pub struct Tally(BTreeMap<String, u64>);

impl Tally {
    pub fn add(&mut self, what: impl Into<String>) {
        *self.0.entry(what.into()).or_default() += 1;
    }

    pub fn merge(&mut self, other: Tally) {
        for (k, v) in other.0 {
            *self.0.entry(k).or_default() += v;
        }
    }

    pub fn count(&self, what: &str) -> u64 {
        self.0.get(what).copied().unwrap_or(0)
    }

    pub fn text(&self) -> String {
        let mut items: Vec<(&String, &u64)> = self.0.iter().collect();
        items.sort_by(|a, b| b.1.cmp(a.1));
        let parts: Vec<String> = items
            .iter()
            .map(|(k, v)| format!("{k}: {}", fmt_num(**v as f64)))
            .collect();
        if parts.is_empty() {
            "nothing".into()
        } else {
            parts.join(", ")
        }
    }
}

/// The `q` quantile of unsorted `values` (nearest rank), NaN when empty.
pub fn quantile(values: &mut [f64], q: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len());
    values[rank - 1]
}

/// An HTTP/1.1 client connection to `addr`.
async fn h1_connect<B>(addr: SocketAddr) -> Result<SendRequest<B>, String>
where
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let tcp = tokio::time::timeout(Duration::from_secs(10), TcpStream::connect(addr))
        .await
        .map_err(|_| "connect timed out".to_string())?
        .map_err(|e| format!("connect: {e}"))?;
    tcp.set_nodelay(true).ok();
    let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    tokio::spawn(conn);
    Ok(send)
}

/// The probe alone: what the proxy costs and answers at rest.
pub async fn baseline(ctx: &Ctx, bin: &Path, run: Run) -> Run {
    let s = Session::begin(ctx, bin, run, ctx.backends.fast, "", false).await;
    tokio::time::sleep(Duration::from_secs_f64(ctx.args.baseline_secs)).await;
    s.end().await
}

/// Many requests, each with a session key of its own, as large as a head allows.
pub async fn session_keys(ctx: &Ctx, bin: &Path, run: Run) -> Run {
    let mut s = Session::begin(ctx, bin, run, ctx.backends.fast, "", false).await;
    let (addr, n, conns) = (
        s.proxy.addr,
        ctx.args.session_requests,
        ctx.args.session_conns,
    );
    let key_len = ctx.args.session_key_kib * 1024;
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut tasks = Vec::new();
    for c in 0..conns {
        tasks.push(tokio::spawn(async move {
            let mut tally = Tally::default();
            let mut send: Option<SendRequest<Full<Bytes>>> = None;
            for i in (c..n).step_by(conns) {
                if Instant::now() > deadline {
                    tally.add("not sent: out of time");
                    continue;
                }
                let mut key = format!("{i:010}-");
                key.extend(std::iter::repeat_n('k', key_len.saturating_sub(key.len())));
                let req = Request::post("/v1/chat/completions")
                    .header("host", addr.to_string())
                    .header("content-type", "application/json")
                    .header("x-session-id", key)
                    .body(Full::new(Bytes::from_static(CHAT_BODY.as_bytes())))
                    .unwrap();
                let outcome = async {
                    if send.is_none() {
                        send = Some(h1_connect(addr).await?);
                    }
                    let sender = send.as_mut().unwrap();
                    sender
                        .ready()
                        .await
                        .map_err(|e| format!("connection: {e}"))?;
                    let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
                    let status = resp.status().as_u16().to_string();
                    let _ = resp.into_body().collect().await;
                    Ok::<_, String>(status)
                };
                match tokio::time::timeout(Duration::from_secs(10), outcome).await {
                    Ok(Ok(status)) => tally.add(status),
                    Ok(Err(e)) => {
                        tally.add(e);
                        send = None;
                    }
                    Err(_) => {
                        tally.add("no answer in 10 s");
                        send = None;
                    }
                }
            }
            tally
        }));
    }
    let mut tally = Tally::default();
    for t in tasks {
        tally.merge(t.await.unwrap());
    }
    let delta = s.backend_delta(ctx).await;
    let sessions = s.proxy.metric("agentrace_sessions").await;
    s.run.num("requests sent", n as f64, "");
    s.run.text("attackers got", tally.text());
    s.run.num(
        "requests that reached the backend",
        delta.attack_requests as f64,
        "",
    );
    s.run.num(
        "sessions the proxy remembers",
        sessions.unwrap_or(f64::NAN),
        "",
    );
    s.end().await
}

const BIG_PREFIX: &[u8] = br#"{"model":"bench","messages":[{"role":"user","content":""#;
const BIG_SUFFIX: &[u8] = br#""}]}"#;
static PAD: [u8; 1 << 20] = [b'a'; 1 << 20];

/// A chat-completion JSON body of an exact length, made of static padding: sending it costs
/// the attacker no memory.
struct PaddedJson {
    stage: u8,
    pad_left: usize,
    total_left: u64,
}

impl PaddedJson {
    fn new(len: usize) -> PaddedJson {
        PaddedJson {
            stage: 0,
            pad_left: len - BIG_PREFIX.len() - BIG_SUFFIX.len(),
            total_left: len as u64,
        }
    }
}

impl Body for PaddedJson {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        let chunk: &'static [u8] = match this.stage {
            0 => {
                this.stage = 1;
                BIG_PREFIX
            }
            1 if this.pad_left > 0 => {
                let n = this.pad_left.min(PAD.len());
                this.pad_left -= n;
                &PAD[..n]
            }
            1 => {
                this.stage = 2;
                BIG_SUFFIX
            }
            _ => return Poll::Ready(None),
        };
        this.total_left -= chunk.len() as u64;
        Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(chunk)))))
    }

    fn is_end_stream(&self) -> bool {
        self.total_left == 0
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.total_left)
    }
}

/// Many connections each sending a body just under the limit, at once and at full speed.
pub async fn big_bodies(ctx: &Ctx, bin: &Path, run: Run) -> Run {
    let mut s = Session::begin(ctx, bin, run, ctx.backends.fast, "", false).await;
    let addr = s.proxy.addr;
    let len = ctx.args.big_body_mib << 20;
    let mut tasks = Vec::new();
    for _ in 0..ctx.args.big_conns {
        tasks.push(tokio::spawn(async move {
            let t0 = Instant::now();
            let outcome = async {
                let mut send = h1_connect::<PaddedJson>(addr).await?;
                let req = Request::post("/v1/chat/completions")
                    .header("host", addr.to_string())
                    .header("content-type", "application/json")
                    .header("content-length", len.to_string())
                    .body(PaddedJson::new(len))
                    .unwrap();
                let resp = send.send_request(req).await.map_err(|e| e.to_string())?;
                let status = resp.status().as_u16().to_string();
                let _ = resp.into_body().collect().await;
                Ok::<_, String>(status)
            };
            let what = match tokio::time::timeout(Duration::from_secs(120), outcome).await {
                Ok(Ok(status)) => status,
                Ok(Err(e)) => e,
                Err(_) => "no answer in 120 s".into(),
            };
            (what, t0.elapsed().as_secs_f64())
        }));
    }
    let (mut tally, mut times) = (Tally::default(), Vec::new());
    for t in tasks {
        let (what, secs) = t.await.unwrap();
        tally.add(what);
        times.push(secs);
    }
    let delta = s.backend_delta(ctx).await;
    s.run.text("attackers got", tally.text());
    s.run
        .num("attacker answered, p50", quantile(&mut times, 0.5), "s");
    s.run
        .num("attacker answered, max", quantile(&mut times, 1.0), "s");
    s.run.num(
        "requests that reached the backend",
        delta.attack_requests as f64,
        "",
    );
    s.run.num(
        "body bytes that reached the backend",
        delta.body_bytes as f64 / (1u64 << 20) as f64,
        "MiB",
    );
    s.end().await
}

/// A backend that answers with `100 Continue` without end; each client leaves after 100 ms.
pub async fn interim_storm(ctx: &Ctx, bin: &Path, run: Run) -> Run {
    let mut s = Session::begin(ctx, bin, run, ctx.backends.storm, "", false).await;
    let addr = s.proxy.addr;
    let clients: Vec<_> = (0..ctx.args.storm_clients)
        .map(|_| {
            tokio::spawn(async move {
                let mut client = TcpStream::connect(addr).await.unwrap();
                let head = format!(
                    "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{CHAT_BODY}",
                    CHAT_BODY.len()
                );
                client.write_all(head.as_bytes()).await.unwrap();
                let mut got = 0u64;
                let leave = Instant::now() + Duration::from_millis(100);
                let mut buf = vec![0u8; 65536];
                while let Ok(Ok(n)) = tokio::time::timeout_at(leave, client.read(&mut buf)).await {
                    if n == 0 {
                        break;
                    }
                    got += n as u64;
                }
                got
            })
        })
        .collect();
    let mut got = 0;
    for c in clients {
        got += c.await.unwrap();
    }
    let (left, cpu_left) = (Instant::now(), s.proxy.cpu());
    let watch = Duration::from_secs_f64(ctx.args.storm_watch_secs);
    // When the backend's connections ended, i.e. the proxy stopped reading interim responses.
    let mut storm_ended = None;
    while left.elapsed() < watch {
        tokio::time::sleep(Duration::from_millis(250).min(watch - left.elapsed())).await;
        if storm_ended.is_none() && ctx.backends.counters().await.storm_open == 0 {
            storm_ended = Some(left.elapsed().as_secs_f64());
        }
    }
    let cpu_after = s.proxy.cpu() - cpu_left;
    // The lowest of a few reads: a probe request in flight at one of them does not count.
    let mut in_flight = f64::NAN;
    for _ in 0..5 {
        let v = s
            .proxy
            .metric("agentrace_in_flight")
            .await
            .unwrap_or(f64::NAN);
        in_flight = in_flight.min(v);
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    let delta = s.backend_delta(ctx).await;
    s.run.num("clients", ctx.args.storm_clients as f64, "");
    s.run
        .num("bytes the clients got in 100 ms", got as f64, "B");
    s.run.num(
        "storm requests that reached the backend",
        delta.storm_requests as f64,
        "",
    );
    s.run
        .num("agentrace_in_flight after the watch", in_flight, "");
    s.run.num(
        "backend connections still fed 100s after the watch",
        delta.storm_open as f64,
        "",
    );
    s.run.text(
        "the proxy stopped reading 100s after the clients left",
        match storm_ended {
            Some(secs) => format!("within {secs:.2} s"),
            None => format!("not within {:.0} s", watch.as_secs_f64()),
        },
    );
    s.run.num(
        "proxy CPU after the clients left, share of a core",
        100.0 * cpu_after / watch.as_secs_f64(),
        "%",
    );
    s.end().await
}

/// How an attacking connection ended.
fn status_of(bytes: &[u8]) -> String {
    match bytes.get(9..12).and_then(|s| std::str::from_utf8(s).ok()) {
        Some(code) if bytes.starts_with(b"HTTP/1.") => code.to_string(),
        _ => "answered, not HTTP".into(),
    }
}

fn io_end(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::ConnectionReset => "reset".into(),
        std::io::ErrorKind::BrokenPipe => "closed".into(),
        _ => format!("error: {e}"),
    }
}

/// Connects to `addr` within `limit`: the stream or why not, and how long the connect took.
async fn connect_timed(addr: SocketAddr, limit: Duration) -> (Result<TcpStream, String>, Duration) {
    let t0 = Instant::now();
    let stream = match tokio::time::timeout(limit, TcpStream::connect(addr)).await {
        Ok(Ok(s)) => Ok(s),
        Ok(Err(e)) => Err(format!("connect failed: {}", e.kind())),
        Err(_) => Err("connect timed out".into()),
    };
    (stream, t0.elapsed())
}

/// Whether the proxy still holds `stream` open: what a read finds within 50 ms.
async fn still_open(stream: &mut TcpStream) -> String {
    let mut buf = [0u8; 512];
    match tokio::time::timeout(Duration::from_millis(50), stream.read(&mut buf)).await {
        Err(_) => "open at end".into(),
        Ok(Ok(0)) => "closed".into(),
        Ok(Ok(n)) => status_of(&buf[..n]),
        Ok(Err(e)) => io_end(&e),
    }
}

/// Connections that send a request head one byte at a time, never finishing it.
pub async fn slowloris(ctx: &Ctx, bin: &Path, run: Run) -> Run {
    let mut s = Session::begin(ctx, bin, run, ctx.backends.fast, "", false).await;
    let (addr, n) = (s.proxy.addr, ctx.args.slowloris_conns);
    let interval = Duration::from_secs(1);
    let deadline = Instant::now() + Duration::from_secs_f64(ctx.args.slowloris_secs);
    let gate = Arc::new(tokio::sync::Semaphore::new(100));
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let gate = gate.clone();
            tokio::spawn(async move {
                let permit = gate.acquire_owned().await.unwrap();
                let (stream, _) = connect_timed(addr, Duration::from_secs(10)).await;
                drop(permit);
                let stream = match stream {
                    Ok(s) => s,
                    Err(e) => return (e, None),
                };
                let t0 = Instant::now();
                let head = format!(
                    "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nX-Session-ID: slowloris-{i}\r\nX-Pad: "
                );
                let (mut rd, mut wr) = stream.into_split();
                // Spread the connections' writes over each second.
                let mut next = t0;
                let phase = interval * (i as u32 % 1000) / 1000;
                let mut buf = [0u8; 512];
                for pos in 0usize.. {
                    tokio::select! {
                        _ = tokio::time::sleep_until(next.min(deadline)) => {
                            if Instant::now() >= deadline {
                                return ("open at end".to_string(), None);
                            }
                            let byte = head.as_bytes().get(pos).copied().unwrap_or(b'a');
                            if let Err(e) = wr.write_all(&[byte]).await {
                                return (io_end(&e), Some(t0.elapsed().as_secs_f64()));
                            }
                            next = t0 + phase + interval * (pos as u32 + 1);
                        }
                        r = rd.read(&mut buf) => {
                            let what = match r {
                                Ok(0) => "closed".to_string(),
                                Ok(k) => status_of(&buf[..k]),
                                Err(e) => io_end(&e),
                            };
                            return (what, Some(t0.elapsed().as_secs_f64()));
                        }
                    }
                }
                unreachable!()
            })
        })
        .collect();
    let (mut tally, mut ended) = (Tally::default(), Vec::new());
    for t in tasks {
        let (what, after) = t.await.unwrap();
        tally.add(what);
        ended.extend(after);
    }
    s.run.num("connections", n as f64, "");
    s.run.text("attackers got", tally.text());
    s.run.num(
        "attackers still open at the end",
        tally.count("open at end") as f64,
        "",
    );
    s.run.num(
        "ended by the proxy after, p50",
        quantile(&mut ended, 0.5),
        "s",
    );
    s.run.num(
        "ended by the proxy after, max",
        quantile(&mut ended, 1.0),
        "s",
    );
    s.end().await
}

/// Many connections opened at once and left idle: the connect burst, then what they cost.
pub async fn idle_conns(ctx: &Ctx, bin: &Path, run: Run) -> Run {
    let mut s = Session::begin(ctx, bin, run, ctx.backends.fast, "", false).await;
    let (addr, n) = (s.proxy.addr, ctx.args.idle_conns);
    let hold = Duration::from_secs_f64(ctx.args.idle_secs);
    let deadline = Instant::now() + hold;
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            tokio::spawn(async move {
                let (stream, took) = connect_timed(addr, hold).await;
                let what = match stream {
                    Ok(mut stream) => {
                        tokio::time::sleep_until(deadline).await;
                        still_open(&mut stream).await
                    }
                    Err(e) => e,
                };
                (what, took.as_secs_f64() * 1000.0)
            })
        })
        .collect();
    // Descriptors while every connection is held: fewer than the connections made means some
    // still wait in the listen queue, not yet accepted.
    tokio::time::sleep_until(deadline - Duration::from_millis(200).min(hold)).await;
    let fds_held = crate::procfs::fd_count(s.proxy.pid).unwrap_or(0);
    let (mut tally, mut connect_ms) = (Tally::default(), Vec::new());
    for t in tasks {
        let (what, ms) = t.await.unwrap();
        if !what.starts_with("connect") {
            connect_ms.push(ms);
        }
        tally.add(what);
    }
    let slow = connect_ms.iter().filter(|&&ms| ms > 1000.0).count();
    s.run.num("connections", n as f64, "");
    s.run.num("connected", connect_ms.len() as f64, "");
    s.run
        .num("connect p50", quantile(&mut connect_ms, 0.5), "ms");
    s.run
        .num("connect p99", quantile(&mut connect_ms, 0.99), "ms");
    s.run
        .num("connect max", quantile(&mut connect_ms, 1.0), "ms");
    s.run
        .num("connects over 1 s (SYN retransmitted)", slow as f64, "");
    s.run.text("attackers got", tally.text());
    s.run
        .num("proxy fds while all were held", fds_held as f64, "");
    s.end().await
}
