//! Attacks on `agentrace epp`'s gRPC port, where the gateway (Envoy) is the only legitimate
//! client: idle connections, the descriptor limit, large held bodies, streams placed and never
//! answered, malformed ext_proc messages, and sequential exchanges (Nagle against a client
//! that does not re-arm TCP_QUICKACK). Each runs against a fresh picker over the fast backend.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request, processing_response::Response, HttpBody, HttpHeaders,
    ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::procfs::{self, Sampler};
use crate::report::Run;
use crate::Ctx;

/// `BodySendMode::FULL_DUPLEX_STREAMED`: the picker holds the body until it places.
const FULL_DUPLEX: i32 = 4;

/// A running `agentrace epp`.
struct Picker {
    child: tokio::process::Child,
    pid: u32,
    addr: SocketAddr,
    admin: SocketAddr,
    log: std::path::PathBuf,
}

impl Picker {
    /// Starts `bin epp` over the fast backend; `config` is a TOML file's text (none if
    /// empty); `nofile` lowers its descriptor limit through `prlimit`.
    async fn start(ctx: &Ctx, bin: &Path, config: &str, nofile: Option<u64>) -> Picker {
        let mut command = match nofile {
            Some(n) => {
                let mut c = tokio::process::Command::new("prlimit");
                c.arg(format!("--nofile={n}:{n}")).arg(bin);
                c
            }
            None => tokio::process::Command::new(bin),
        };
        command.args([
            "epp",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ]);
        command
            .arg("--backend")
            .arg(format!("http://{}", ctx.backends.fast));
        if !config.is_empty() {
            let path = ctx.dir.path().join("epp.toml");
            std::fs::write(&path, config).unwrap();
            command.arg("--config").arg(path);
        }
        let log = ctx.dir.path().join("epp.log");
        let mut child = command
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
        let stdout = child.stdout.take().unwrap();
        let line = tokio::time::timeout(
            Duration::from_secs(30),
            tokio::io::BufReader::new(stdout).lines().next_line(),
        )
        .await
        .ok()
        .and_then(|l| l.ok().flatten())
        .unwrap_or_else(|| panic!("epp did not start: {:?}", std::fs::read_to_string(&log)));
        // "agentrace epp listening on ADDR (admin ADMIN)"; under prlimit, the child's child.
        let words: Vec<&str> = line.split_whitespace().collect();
        let addr = words[4].parse().expect("epp address");
        let admin = words[6].trim_end_matches(')').parse().expect("admin");
        let pid = match nofile {
            Some(_) => child_of(child.id().unwrap()),
            None => child.id().unwrap(),
        };
        Picker {
            child,
            pid,
            addr,
            admin,
            log,
        }
    }

    /// The sum of metric `name`'s series on `/metrics`.
    async fn metric(&self, name: &str) -> f64 {
        let Some(text) = http_get(self.admin, "/metrics").await else {
            return f64::NAN;
        };
        text.lines()
            .filter(|l| {
                l.strip_prefix(name)
                    .is_some_and(|r| r.starts_with('{') || r.starts_with(' '))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    fn cpu(&self) -> f64 {
        procfs::cpu_seconds(self.pid).unwrap_or(f64::NAN)
    }

    /// Lines of its log that contain `needle`.
    fn log_lines(&self, needle: &str) -> usize {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains(needle))
            .count()
    }

    async fn stop(mut self) {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
    }
}

/// `prlimit` execs the command, so the picker is the same process; kept as a function in case
/// a wrapper forks.
fn child_of(pid: u32) -> u32 {
    pid
}

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

/// A request-headers message for `session`, asking for the body full-duplex streamed.
pub fn headers_msg(session: &str, end_of_stream: bool) -> ProcessingRequest {
    let pairs = [
        (":method", "POST"),
        (":path", "/v1/chat/completions"),
        ("x-session-id", session),
    ];
    ProcessingRequest {
        request: Some(Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: pairs
                    .iter()
                    .map(|(k, v)| HeaderValue {
                        key: k.to_string(),
                        raw_value: v.as_bytes().to_vec(),
                        ..HeaderValue::default()
                    })
                    .collect(),
            }),
            end_of_stream,
            ..HttpHeaders::default()
        })),
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: FULL_DUPLEX,
            ..ProtocolConfiguration::default()
        }),
        ..ProcessingRequest::default()
    }
}

fn body_msg(body: Vec<u8>, end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Request::RequestBody(HttpBody {
            body,
            end_of_stream,
            ..HttpBody::default()
        })),
        ..ProcessingRequest::default()
    }
}

/// An open ext_proc stream.
struct Stream {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: tonic::Streaming<ProcessingResponse>,
}

impl Stream {
    async fn open(
        client: &mut ExternalProcessorClient<tonic::transport::Channel>,
    ) -> Option<Stream> {
        let (tx, rx) = mpsc::channel(4);
        let outbound = futures_util::stream::unfold(rx, |mut rx: mpsc::Receiver<_>| async move {
            rx.recv().await.map(|m| (m, rx))
        });
        let rx = client.process(outbound).await.ok()?.into_inner();
        Some(Stream { tx, rx })
    }

    async fn recv(&mut self) -> Option<Response> {
        tokio::time::timeout(Duration::from_secs(30), self.rx.message())
            .await
            .ok()?
            .ok()?
            .and_then(|m| m.response)
    }
}

async fn client(addr: SocketAddr) -> ExternalProcessorClient<tonic::transport::Channel> {
    ExternalProcessorClient::connect(format!("http://{addr}"))
        .await
        .expect("connect to epp")
}

fn load_row(run: &mut Run, start: &str) {
    run.text(
        "load 1/5/15 min, start -> end",
        format!("{start} -> {}", procfs::loadavg()),
    );
}

/// `idle_conns` connections opened to the gRPC port and held idle `idle_secs`: how many the
/// picker keeps, and its descriptors.
pub async fn idle_conns(ctx: &Ctx, bin: &Path, mut run: Run) -> Run {
    let load = procfs::loadavg();
    let picker = Picker::start(ctx, bin, "", None).await;
    let sampler = Sampler::start(picker.pid);
    let mut conns = Vec::new();
    for _ in 0..ctx.args.idle_conns {
        match TcpStream::connect(picker.addr).await {
            Ok(c) => conns.push(c),
            Err(_) => break,
        }
    }
    run.num("connections opened", conns.len() as f64, "");
    tokio::time::sleep(Duration::from_secs_f64(ctx.args.idle_secs)).await;
    // Open: nothing to read, or the server's HTTP/2 SETTINGS; closed: its end or a reset.
    let mut open = 0;
    for c in &conns {
        let mut b = [0u8; 1];
        match tokio::time::timeout(Duration::from_millis(1), c.peek(&mut b)).await {
            Err(_) => open += 1,
            Ok(Ok(n)) if n > 0 => open += 1,
            Ok(_) => {}
        }
    }
    run.num("still open after the hold", open as f64, "");
    let peaks = sampler.stop();
    run.num("picker fds peak", peaks.fds as f64, "");
    run.num(
        "picker RSS peak",
        peaks.hwm_kib.max(peaks.rss_kib) as f64 / 1024.0,
        "MiB",
    );
    // Does a gateway still get through?
    let mut c = client(picker.addr).await;
    let mut s = Stream::open(&mut c).await;
    let placed = match s.as_mut() {
        Some(s) => {
            let _ = s.tx.send(headers_msg("probe", true)).await;
            matches!(s.recv().await, Some(Response::RequestHeaders(_)))
        }
        None => false,
    };
    run.text(
        "a new gateway stream placed",
        if placed { "yes" } else { "no" },
    );
    drop(conns);
    load_row(&mut run, &load);
    picker.stop().await;
    run
}

/// The picker with 256 descriptors, 400 connections opened: CPU over `idle_secs` while it
/// cannot accept, and its log lines about it.
pub async fn fd_limit(ctx: &Ctx, bin: &Path, mut run: Run) -> Run {
    let load = procfs::loadavg();
    let picker = Picker::start(ctx, bin, "", Some(256)).await;
    let mut conns = Vec::new();
    for _ in 0..400 {
        match tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(picker.addr)).await {
            Ok(Ok(c)) => conns.push(c),
            _ => break,
        }
    }
    run.num("connections opened", conns.len() as f64, "");
    let cpu = picker.cpu();
    let secs = 5.0;
    tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    let used = picker.cpu() - cpu;
    run.num("picker CPU over 5 s at the fd limit", used, "s");
    run.num(
        "log lines about failed accepts",
        picker.log_lines("accept") as f64,
        "",
    );
    drop(conns);
    load_row(&mut run, &load);
    picker.stop().await;
    run
}

/// `big_conns_epp` (8) streams each sending a `big_body_mib` MiB body in 1 MiB chunks at full
/// speed, held open: the picker's peak RSS and what each stream got.
pub async fn big_bodies(ctx: &Ctx, bin: &Path, mut run: Run) -> Run {
    let load = procfs::loadavg();
    let picker = Picker::start(ctx, bin, "", None).await;
    let rss_start = procfs::status_kib(picker.pid, "VmRSS").unwrap_or(0);
    let sampler = Sampler::start(picker.pid);
    let mut tasks = Vec::new();
    for i in 0..8 {
        let addr = picker.addr;
        let mib = ctx.args.big_body_mib;
        tasks.push(tokio::spawn(async move {
            let mut c = client(addr).await;
            let Some(mut s) = Stream::open(&mut c).await else {
                return ("no stream".to_string(), None);
            };
            let _ = s.tx.send(headers_msg(&format!("big{i}"), false)).await;
            let tx = s.tx.clone();
            let sender = tokio::spawn(async move {
                for k in 0..mib {
                    if tx
                        .send(body_msg(vec![b'x'; 1 << 20], k + 1 == mib))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
            });
            let got = match s.recv().await {
                Some(Response::ImmediateResponse(r)) => {
                    format!("{}", r.status.map_or(0, |s| s.code))
                }
                Some(Response::RequestHeaders(_)) => "placed".to_string(),
                Some(_) => "other".to_string(),
                None => "nothing".to_string(),
            };
            let _ = sender.await;
            (got, Some(s))
        }));
    }
    let mut outcomes = std::collections::BTreeMap::<String, usize>::new();
    let mut held = Vec::new();
    for t in tasks {
        let (got, s) = t.await.unwrap();
        *outcomes.entry(got).or_default() += 1;
        held.push(s);
    }
    let peaks = sampler.stop();
    let peak = peaks.hwm_kib.max(peaks.rss_kib);
    run.num("picker RSS at start", rss_start as f64 / 1024.0, "MiB");
    run.num("picker RSS peak", peak as f64 / 1024.0, "MiB");
    run.text("streams got", format!("{outcomes:?}"));
    drop(held);
    load_row(&mut run, &load);
    picker.stop().await;
    run
}

/// 400 streams placed and never answered: the in-flight count the picker keeps, at once and
/// after a wait past `epp.in_flight_max_ms` (set to 5 s where the binary knows the key).
pub async fn unanswered(ctx: &Ctx, bin: &Path, mut run: Run, knows_lifetime: bool) -> Run {
    let load = procfs::loadavg();
    let config = if knows_lifetime {
        format!(
            "[[backends]]\nname = \"fast\"\nurl = \"http://{}\"\n[epp]\nin_flight_max_ms = 5000\n",
            ctx.backends.fast
        )
    } else {
        String::new()
    };
    let picker = Picker::start(ctx, bin, &config, None).await;
    let mut c = client(picker.addr).await;
    let mut held = Vec::new();
    for i in 0..400 {
        if let Some(mut s) = Stream::open(&mut c).await {
            let _ = s.tx.send(headers_msg(&format!("u{i}"), true)).await;
            let _ = s.recv().await;
            held.push(s);
        }
    }
    run.num("streams placed and held", held.len() as f64, "");
    run.num(
        "in flight right after",
        picker.metric("agentrace_in_flight").await,
        "",
    );
    tokio::time::sleep(Duration::from_secs(7)).await;
    run.num(
        "in flight 7 s later, streams still open",
        picker.metric("agentrace_in_flight").await,
        "",
    );
    drop(held);
    load_row(&mut run, &load);
    picker.stop().await;
    run
}

fn grpc_frame(flag: u8, declared: u32, payload: &[u8]) -> Vec<u8> {
    let mut frame = vec![flag];
    frame.extend_from_slice(&declared.to_be_bytes());
    frame.extend_from_slice(payload);
    frame
}

/// One call over raw HTTP/2 with `body` as the request stream: its `grpc-status`.
async fn raw_call(addr: SocketAddr, body: &[u8]) -> String {
    let call = async {
        let tcp = TcpStream::connect(addr).await.ok()?;
        let (mut client, conn) = h2::client::handshake(tcp).await.ok()?;
        tokio::spawn(conn);
        let request = http::Request::post(format!(
            "http://{addr}/envoy.service.ext_proc.v3.ExternalProcessor/Process"
        ))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .ok()?;
        let (response, mut send) = client.send_request(request, false).ok()?;
        send.send_data(bytes::Bytes::copy_from_slice(body), true)
            .ok()?;
        let response = response.await.ok()?;
        if let Some(s) = response.headers().get("grpc-status") {
            return Some(s.to_str().ok()?.to_string());
        }
        let mut body = response.into_body();
        while body.data().await.is_some() {}
        let trailers = body.trailers().await.ok()??;
        Some(trailers.get("grpc-status")?.to_str().ok()?.to_string())
    };
    tokio::time::timeout(Duration::from_secs(10), call)
        .await
        .ok()
        .flatten()
        .unwrap_or_else(|| "none".into())
}

/// Seven kinds of malformed ext_proc message: the `grpc-status` each gets, and what the log
/// and metrics say.
pub async fn malformed(ctx: &Ctx, bin: &Path, mut run: Run) -> Run {
    let load = procfs::loadavg();
    let picker = Picker::start(ctx, bin, "", None).await;
    let body_first = [0x22, 0x05, 0x0a, 0x01, b'x', 0x10, 0x01];
    let cases: [(&str, Vec<u8>); 7] = [
        ("garbage protobuf", grpc_frame(0, 5, &[0xff; 5])),
        ("4 GiB length prefix", grpc_frame(0, u32::MAX, b"ab")),
        ("compressed, no grpc-encoding", grpc_frame(1, 2, b"ab")),
        ("compression flag 2", grpc_frame(2, 2, b"ab")),
        ("message cut short", grpc_frame(0, 100, b"abc")),
        ("no request phase", grpc_frame(0, 0, b"")),
        ("body before headers", grpc_frame(0, 7, &body_first)),
    ];
    for (what, bytes) in &cases {
        run.text(
            &format!("grpc-status: {what}"),
            raw_call(picker.addr, bytes).await,
        );
    }
    run.num(
        "counted (agentrace_epp_refusals_total)",
        picker.metric("agentrace_epp_refusals_total").await,
        "",
    );
    run.num("log lines", picker.log_lines("malformed") as f64, "");
    load_row(&mut run, &load);
    picker.stop().await;
    run
}

/// 200 sequential exchanges (headers in, destination out) on one stream from a plain client:
/// with Nagle on at the picker, each reply waits for the client's delayed ACK.
pub async fn sequential(ctx: &Ctx, bin: &Path, mut run: Run) -> Run {
    let load = procfs::loadavg();
    let picker = Picker::start(ctx, bin, "", None).await;
    let mut c = client(picker.addr).await;
    let mut times = Vec::new();
    for i in 0..200 {
        let Some(mut s) = Stream::open(&mut c).await else {
            break;
        };
        let start = Instant::now();
        let _ = s.tx.send(headers_msg(&format!("n{i}"), true)).await;
        if s.recv().await.is_none() {
            break;
        }
        times.push(start.elapsed().as_secs_f64() * 1000.0);
    }
    times.sort_by(f64::total_cmp);
    let at = |q: f64| {
        times
            .get(((times.len() as f64 - 1.0) * q) as usize)
            .copied()
            .unwrap_or(f64::NAN)
    };
    run.num("exchanges", times.len() as f64, "");
    run.num("exchange p50", at(0.5), "ms");
    run.num("exchange p99", at(0.99), "ms");
    load_row(&mut run, &load);
    picker.stop().await;
    run
}
