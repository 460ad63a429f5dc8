//! The backends, in a process of their own (this benchmark started again with
//! [`SERVE_FLAG`]), so that their work is neither the attackers' nor the probe's:
//! - `fast`: hyper, answers a small chat-completion JSON, reads request bodies without keeping
//!   them;
//! - `storm`: raw TCP, answers with `HTTP/1.1 100 Continue` interim responses without end;
//! - `sse`: raw TCP, answers `200 text/event-stream` and streams `data:` events without end.
//!
//! Every backend answers `/health` and requests carrying [`PROBE_HEADER`] normally, so the
//! well-behaved probe can go through the same proxy as the attack. The fast backend reports
//! what reached the backends at `GET /__bench/counters` (asked directly, not through a proxy).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

pub const SERVE_FLAG: &str = "--serve-backends";
/// Marks the probe's requests, which every backend answers normally and counts apart.
pub const PROBE_HEADER: &str = "x-bench-probe";
pub const CHAT_BODY: &str = r#"{"model":"bench","messages":[{"role":"system","content":"You are a coding agent."},{"role":"user","content":"Fix the failing test."}],"max_tokens":16}"#;
const CHAT_RESPONSE: &str = r#"{"id":"chatcmpl-bench","object":"chat.completion","created":0,"model":"bench","choices":[{"index":0,"message":{"role":"assistant","content":"Done."},"finish_reason":"stop"}],"usage":{"prompt_tokens":24,"completion_tokens":2,"total_tokens":26}}"#;
const SSE_EVENT: &str = "data: {\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"bench\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"x\"},\"finish_reason\":null}]}\n\n";

/// What reached the backends since their process started.
#[derive(Debug, Default, Clone, Copy, Serialize, Deserialize)]
pub struct Counters {
    /// Requests other than the probe's and health checks, counted when their head arrived.
    pub attack_requests: u64,
    pub probe_requests: u64,
    /// Request body bytes the fast backend read.
    pub body_bytes: u64,
    pub storm_requests: u64,
    /// Connections on which the storm backend is still writing interim responses.
    pub storm_open: u64,
    pub sse_requests: u64,
    pub sse_bytes: u64,
}

static ATTACK: AtomicU64 = AtomicU64::new(0);
static PROBE: AtomicU64 = AtomicU64::new(0);
static BODY_BYTES: AtomicU64 = AtomicU64::new(0);
static STORM: AtomicU64 = AtomicU64::new(0);
static STORM_OPEN: AtomicU64 = AtomicU64::new(0);
static SSE: AtomicU64 = AtomicU64::new(0);
static SSE_BYTES: AtomicU64 = AtomicU64::new(0);

fn counters_now() -> Counters {
    Counters {
        attack_requests: ATTACK.load(Relaxed),
        probe_requests: PROBE.load(Relaxed),
        body_bytes: BODY_BYTES.load(Relaxed),
        storm_requests: STORM.load(Relaxed),
        storm_open: STORM_OPEN.load(Relaxed),
        sse_requests: SSE.load(Relaxed),
        sse_bytes: SSE_BYTES.load(Relaxed),
    }
}

/// The backends' process as seen from the benchmark; it exits when its stdin closes.
pub struct Backends {
    _child: tokio::process::Child,
    pub fast: SocketAddr,
    pub storm: SocketAddr,
    pub sse: SocketAddr,
}

impl Backends {
    pub async fn start() -> Backends {
        let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
            .arg(SERVE_FLAG)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("backends' process");
        let stdout = child.stdout.take().expect("stdout piped");
        let line = tokio::io::BufReader::new(stdout)
            .lines()
            .next_line()
            .await
            .unwrap()
            .expect("the backends' process announces its addresses");
        let addrs: Vec<SocketAddr> = line
            .split_whitespace()
            .map(|a| a.parse().expect("backend address"))
            .collect();
        Backends {
            _child: child,
            fast: addrs[0],
            storm: addrs[1],
            sse: addrs[2],
        }
    }

    pub async fn counters(&self) -> Counters {
        let mut s = TcpStream::connect(self.fast).await.expect("fast backend");
        s.write_all(b"GET /__bench/counters HTTP/1.1\r\nHost: b\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut text = String::new();
        s.read_to_string(&mut text).await.unwrap();
        let body = text.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
        serde_json::from_str(body).expect("counters JSON")
    }
}

/// The backends' process: addresses on one line (fast, storm, sse), then serve until stdin
/// closes.
pub fn serve() -> ! {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let fast = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let storm = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let sse = TcpListener::bind("127.0.0.1:0").await.unwrap();
        println!(
            "{} {} {}",
            fast.local_addr().unwrap(),
            storm.local_addr().unwrap(),
            sse.local_addr().unwrap()
        );
        tokio::spawn(accept_fast(fast));
        tokio::spawn(accept_raw(storm, Misbehaviour::Storm));
        tokio::spawn(accept_raw(sse, Misbehaviour::Sse));
        let _ = tokio::task::spawn_blocking(|| {
            std::io::copy(&mut std::io::stdin(), &mut std::io::sink())
        })
        .await;
    });
    std::process::exit(0);
}

async fn accept_fast(listener: TcpListener) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        tokio::spawn(async move {
            let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service_fn(fast_answer))
                .await;
        });
    }
}

async fn fast_answer(req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    match req.uri().path() {
        "/health" => return Ok(Response::new(Full::new(Bytes::from_static(b"ok")))),
        "/__bench/counters" => {
            let json = serde_json::to_string(&counters_now()).unwrap();
            return Ok(Response::new(Full::new(Bytes::from(json))));
        }
        _ => {}
    }
    let counter = if req.headers().contains_key(PROBE_HEADER) {
        &PROBE
    } else {
        &ATTACK
    };
    counter.fetch_add(1, Relaxed);
    let mut body = req.into_body();
    while let Some(Ok(frame)) = body.frame().await {
        if let Some(data) = frame.data_ref() {
            BODY_BYTES.fetch_add(data.len() as u64, Relaxed);
        }
    }
    let mut resp = Response::new(Full::new(Bytes::from_static(CHAT_RESPONSE.as_bytes())));
    resp.headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
    Ok(resp)
}

#[derive(Clone, Copy)]
enum Misbehaviour {
    Storm,
    Sse,
}

async fn accept_raw(listener: TcpListener, how: Misbehaviour) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        tokio::spawn(serve_raw(stream, how));
    }
}

/// One connection of a misbehaving backend: health checks and probe requests get a normal
/// keep-alive answer; any other request gets the misbehaviour until the peer goes away.
async fn serve_raw(mut stream: TcpStream, how: Misbehaviour) {
    let mut buf = Vec::with_capacity(8192);
    loop {
        let (head_len, normal, body_len) = loop {
            let mut headers = [httparse::EMPTY_HEADER; 128];
            let mut req = httparse::Request::new(&mut headers);
            match req.parse(&buf) {
                Ok(httparse::Status::Complete(n)) => {
                    let header = |name: &str| {
                        req.headers
                            .iter()
                            .find(|h| h.name.eq_ignore_ascii_case(name))
                            .map(|h| String::from_utf8_lossy(h.value).into_owned())
                    };
                    let normal = req.path == Some("/health") || header(PROBE_HEADER).is_some();
                    let len = header("content-length")
                        .and_then(|v| v.trim().parse::<usize>().ok())
                        .unwrap_or(0);
                    break (n, normal, len);
                }
                Ok(httparse::Status::Partial) => {}
                Err(_) => return,
            }
            let mut chunk = [0u8; 8192];
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        if !normal {
            match how {
                Misbehaviour::Storm => storm(stream).await,
                Misbehaviour::Sse => endless_sse(stream).await,
            }
            return;
        }
        PROBE.fetch_add(1, Relaxed);
        while buf.len() < head_len + body_len {
            let mut chunk = [0u8; 8192];
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        buf.drain(..head_len + body_len);
        let answer = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{CHAT_RESPONSE}",
            CHAT_RESPONSE.len()
        );
        if stream.write_all(answer.as_bytes()).await.is_err() {
            return;
        }
    }
}

/// `100 Continue` interim responses, as fast as the peer reads them, until it goes away. Large
/// writes keep the peer's socket full, so it never waits for the next one.
async fn storm(mut stream: TcpStream) {
    STORM.fetch_add(1, Relaxed);
    STORM_OPEN.fetch_add(1, Relaxed);
    const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";
    let block = CONTINUE.repeat(64 * 1024 / CONTINUE.len());
    while stream.write_all(&block).await.is_ok() {}
    STORM_OPEN.fetch_sub(1, Relaxed);
}

/// A chunked `text/event-stream` response whose events never end, as fast as the peer reads.
async fn endless_sse(mut stream: TcpStream) {
    SSE.fetch_add(1, Relaxed);
    let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n";
    if stream.write_all(head.as_bytes()).await.is_err() {
        return;
    }
    let events = SSE_EVENT.repeat(64 * 1024 / SSE_EVENT.len());
    let chunk = format!("{:x}\r\n{events}\r\n", events.len()).into_bytes();
    while stream.write_all(&chunk).await.is_ok() {
        SSE_BYTES.fetch_add(events.len() as u64, Relaxed);
    }
}
