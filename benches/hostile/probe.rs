//! The well-behaved client: one keep-alive HTTP/1.1 connection (over TLS when asked) sending
//! small GETs and POSTs at a steady rate through the proxy, on a thread and runtime of its own
//! so the attackers' load in this process does not delay it. A request is timed from when it
//! was due, so a stall also counts against the requests queued behind it.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper::Request;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::backends::{CHAT_BODY, PROBE_HEADER};

const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Where the probe sends: the proxy's address, and the TLS client config when it terminates TLS.
#[derive(Clone)]
pub struct Target {
    pub addr: SocketAddr,
    pub tls: Option<Arc<rustls::ClientConfig>>,
}

/// What the probe saw.
#[derive(Debug, Default)]
pub struct ProbeStats {
    pub sent: u64,
    pub failed: u64,
    /// Latencies of the answered requests, µs, sorted.
    pub latencies_us: Vec<u64>,
    pub first_error: Option<String>,
}

impl ProbeStats {
    /// The `q` quantile in ms (nearest rank), NaN without answers.
    pub fn quantile_ms(&self, q: f64) -> f64 {
        if self.latencies_us.is_empty() {
            return f64::NAN;
        }
        let rank = ((q * self.latencies_us.len() as f64).ceil() as usize).max(1);
        self.latencies_us[rank.min(self.latencies_us.len()) - 1] as f64 / 1000.0
    }
}

pub struct Probe {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<ProbeStats>,
}

impl Probe {
    /// Starts sending `rate` requests/s to `target`.
    pub fn start(target: Target, rate: f64) -> Probe {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(run(target, rate, flag))
        });
        Probe { stop, thread }
    }

    pub fn stop(self) -> ProbeStats {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().expect("probe thread")
    }
}

/// One request through `target` on a fresh connection: `Ok` when it was answered 2xx.
pub async fn one_request(target: &Target) -> Result<(), String> {
    let mut send = connect(target).await?;
    request(&mut send, target.addr, 0).await
}

async fn run(target: Target, rate: f64, stop: Arc<AtomicBool>) -> ProbeStats {
    let mut stats = ProbeStats::default();
    let interval = Duration::from_secs_f64(1.0 / rate);
    let start = Instant::now();
    let mut sender: Option<SendRequest<Full<Bytes>>> = None;
    let mut previous_end = start;
    for n in 0u32.. {
        let due = start + interval * n;
        tokio::time::sleep_until(due).await;
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let t0 = if previous_end > due {
            due
        } else {
            Instant::now()
        };
        stats.sent += 1;
        let outcome = async {
            if sender.is_none() {
                sender = Some(connect(&target).await?);
            }
            request(sender.as_mut().unwrap(), target.addr, n).await
        }
        .await;
        previous_end = Instant::now();
        match outcome {
            Ok(()) => stats
                .latencies_us
                .push(previous_end.duration_since(t0).as_micros() as u64),
            Err(e) => {
                stats.failed += 1;
                stats.first_error.get_or_insert(e);
                sender = None;
            }
        }
    }
    stats.latencies_us.sort_unstable();
    stats
}

async fn connect(target: &Target) -> Result<SendRequest<Full<Bytes>>, String> {
    let tcp = tokio::time::timeout(REQUEST_TIMEOUT, TcpStream::connect(target.addr))
        .await
        .map_err(|_| "connect timed out".to_string())?
        .map_err(|e| format!("connect: {e}"))?;
    tcp.set_nodelay(true).ok();
    let Some(tls) = &target.tls else {
        return handshake(tcp).await;
    };
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let stream = tokio::time::timeout(
        REQUEST_TIMEOUT,
        tokio_rustls::TlsConnector::from(tls.clone()).connect(name, tcp),
    )
    .await
    .map_err(|_| "TLS handshake timed out".to_string())?
    .map_err(|e| format!("TLS: {e}"))?;
    handshake(stream).await
}

async fn handshake<S>(io: S) -> Result<SendRequest<Full<Bytes>>, String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    tokio::spawn(conn);
    Ok(send)
}

/// The `n`th probe request: GETs and chat-completion POSTs in turn.
async fn request(
    send: &mut SendRequest<Full<Bytes>>,
    addr: SocketAddr,
    n: u32,
) -> Result<(), String> {
    let builder = if n % 2 == 0 {
        Request::get("/v1/models")
    } else {
        Request::post("/v1/chat/completions").header("content-type", "application/json")
    };
    let body = if n % 2 == 0 { "" } else { CHAT_BODY };
    let req = builder
        .header("host", addr.to_string())
        .header(PROBE_HEADER, "1")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap();
    let answer = async {
        send.ready().await.map_err(|e| format!("connection: {e}"))?;
        let resp = send
            .send_request(req)
            .await
            .map_err(|e| format!("request: {e}"))?;
        let status = resp.status();
        resp.into_body()
            .collect()
            .await
            .map_err(|e| format!("body: {e}"))?;
        if status.is_success() {
            Ok(())
        } else {
            Err(format!("status {status}"))
        }
    };
    tokio::time::timeout(REQUEST_TIMEOUT, answer)
        .await
        .map_err(|_| "no answer within 10 s".to_string())?
}
