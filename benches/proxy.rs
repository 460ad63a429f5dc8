//! Proxy benchmark: 4 loopback backends answering a small chat-completion JSON, 1,000 session
//! keys, requests/s and p50/p99 latency direct to a backend, through agentrace, and (when
//! installed) through nginx (`hash $http_x_session_id consistent`) and HAProxy
//! (`balance hdr(X-Session-ID)` + `hash-type consistent`); then an SSE run (256 paced events
//! per response) measuring events/s and the per-event delivery delay each proxy adds. With
//! HAProxy installed, `tcp-relay` (HAProxy in TCP mode, no HTTP work, one backend) shows the
//! latency that the extra hop alone adds on the machine. For the open-loop rates, agentrace's
//! own time per request is read from its `agentrace_proxy_overhead_seconds` histogram, which
//! separates the proxy's work from the hop it adds.
//!
//! Run with `scripts/bench-proxy.sh` (or `cargo bench --bench proxy -- [flags]`). Flags:
//! `--duration SECS` (per run, default 5), `--repeats N` (default 3, medians reported),
//! `--loads 8,64` (connections per run), `--sse-streams N` (default 32), `--sse-interval-us N`
//! (default 1000), `--rust-client` (do not use wrk), `--only NAME,..` (targets to run),
//! `--rates 2000,8000` (open-loop request rates for the moderate-load latency table; empty
//! to skip), `--wrap "CMD ARGS"` (start agentrace under a profiler, as
//! `scripts/proxy-instructions.sh` does), `--workers N` (agentrace's `workers` setting; default:
//! its own, one per core).
//! The backends run in a process of their own (this benchmark started again with
//! `--serve-backends`), apart from the built-in clients, so that the direct baseline crosses a
//! process boundary each way as a real client-to-server request does.
//! Load generator, backends and proxies share the machine's cores, so req/s are noisy; the proxy
//! CPU column (user + system time of the proxy processes per request, the system part in
//! brackets) is the steadier figure;
//! compare targets within one run, not across machines.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::io::AsyncBufReadExt;
use tokio::net::TcpListener;
use tokio::time::Instant;

const KEYS: usize = 1000;
const SSE_EVENTS: usize = 256;
const CHAT_BODY: &str = r#"{"model":"bench","messages":[{"role":"system","content":"You are a coding agent."},{"role":"user","content":"Fix the failing test."}],"max_tokens":16}"#;
const CHAT_RESPONSE: &str = r#"{"id":"chatcmpl-bench","object":"chat.completion","created":0,"model":"bench","choices":[{"index":0,"message":{"role":"assistant","content":"Done: the test passes now."},"finish_reason":"stop"}],"usage":{"prompt_tokens":24,"completion_tokens":8,"total_tokens":32}}"#;

struct Args {
    duration: Duration,
    repeats: usize,
    loads: Vec<usize>,
    sse_streams: usize,
    sse_interval: Duration,
    rust_client: bool,
    only: Option<Vec<String>>,
    rates: Vec<f64>,
    wrap: Vec<String>,
    /// agentrace's `workers` setting; none: its default (one per core).
    workers: Option<usize>,
}

fn parse_args() -> Args {
    let mut a = Args {
        duration: Duration::from_secs(5),
        repeats: 3,
        loads: vec![8, 64],
        sse_streams: 32,
        sse_interval: Duration::from_micros(1000),
        rust_client: false,
        only: None,
        rates: vec![2_000.0, 8_000.0],
        wrap: Vec::new(),
        workers: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--bench" => {}
            "--duration" => {
                a.duration = Duration::from_secs_f64(value().parse().expect("--duration"))
            }
            "--repeats" => a.repeats = value().parse().expect("--repeats"),
            "--loads" => {
                a.loads = value()
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(|s| s.parse().expect("--loads"))
                    .collect()
            }
            "--sse-streams" => a.sse_streams = value().parse().expect("--sse-streams"),
            "--sse-interval-us" => {
                a.sse_interval = Duration::from_micros(value().parse().expect("--sse-interval-us"))
            }
            "--rust-client" => a.rust_client = true,
            "--wrap" => a.wrap = value().split_whitespace().map(str::to_string).collect(),
            "--workers" => a.workers = Some(value().parse().expect("--workers")),
            "--rates" => {
                a.rates = value()
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(|s| match s.parse::<f64>() {
                        Ok(rate) if rate > 0.0 && rate.is_finite() => rate,
                        _ => panic!("--rates: expected request rates above 0, got {s:?}"),
                    })
                    .collect()
            }
            "--only" => a.only = Some(value().split(',').map(str::to_string).collect()),
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

// ---------------------------------------------------------------------------------------------
// Backends

/// The system-wide monotonic clock in ns: the backends' process stamps each SSE event with it
/// and the client's process reads it on arrival, so the delivery delay spans both.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the call's duration.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_MONOTONIC)");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Starts this benchmark again as the backends' process and reads their addresses. The
/// backends live apart from the load generator, as inference servers do: the direct baseline
/// then crosses a process boundary each way, like every proxied request, instead of being
/// answered by the client's own runtime. The child exits when its stdin closes.
async fn spawn_backend_process(interval: Duration) -> (tokio::process::Child, Vec<SocketAddr>) {
    let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
        .arg(BACKENDS_FLAG)
        .arg(interval.as_micros().to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("backends' process");
    let line = first_line(&mut child, "the backends' process announces its addresses").await;
    let addrs = line
        .split_whitespace()
        .map(|a| a.parse().expect("backend address"))
        .collect();
    (child, addrs)
}

/// The first line a child started with piped stdout prints (its addresses).
async fn first_line(child: &mut tokio::process::Child, what: &str) -> String {
    let stdout = child.stdout.take().expect("stdout piped");
    tokio::io::BufReader::new(stdout)
        .lines()
        .next_line()
        .await
        .unwrap()
        .expect(what)
}

/// Threads of the backends' process.
const BACKEND_THREADS: usize = 2;

/// The backends' process: 4 backends, each listening on [`BACKEND_THREADS`] sockets of one
/// port (`SO_REUSEPORT`), one per thread, each thread a single-threaded runtime; their
/// addresses on one line, then serve until the benchmark closes stdin. The kernel hands each
/// connection to one thread, which answers all of its requests. A work-stealing runtime here
/// woke its second thread on most requests, a hand-off that added scheduling noise to every
/// target at low concurrency and was no part of any proxy's cost.
fn serve_backends(interval: Duration) {
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let first: Vec<std::net::TcpListener> = (0..4).map(|_| reuseport_listener(any)).collect();
    let addrs: Vec<SocketAddr> = first.iter().map(|l| l.local_addr().unwrap()).collect();
    let mut per_thread = vec![first];
    for _ in 1..BACKEND_THREADS {
        per_thread.push(addrs.iter().map(|&a| reuseport_listener(a)).collect());
    }
    for listeners in per_thread {
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                for listener in listeners {
                    tokio::spawn(serve_backend(
                        TcpListener::from_std(listener).unwrap(),
                        interval,
                    ));
                }
                std::future::pending::<()>().await
            });
        });
    }
    let addrs: Vec<String> = addrs.iter().map(SocketAddr::to_string).collect();
    println!("{}", addrs.join(" "));
    let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
}

/// A listening socket that others may bind to the same port (`SO_REUSEPORT`).
fn reuseport_listener(addr: SocketAddr) -> std::net::TcpListener {
    use std::os::fd::AsRawFd;
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    let on: libc::c_int = 1;
    // SAFETY: a valid socket, and `on` outlives the call with the size passed.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_REUSEPORT,
            (&on as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "SO_REUSEPORT: {}", std::io::Error::last_os_error());
    socket.bind(&addr.into()).unwrap();
    socket.listen(1024).unwrap();
    socket.set_nonblocking(true).unwrap();
    socket.into()
}

/// One backend's socket: JSON for plain requests, 256 paced SSE events when the body asks to
/// stream. Each SSE event carries the time it was written ([`monotonic_ns`]), so the client
/// measures per-event delivery delay.
async fn serve_backend(listener: TcpListener, interval: Duration) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        tokio::spawn(async move {
            let svc = service_fn(move |req: Request<Incoming>| async move {
                if req.uri().path() == "/health" {
                    return Ok::<_, Infallible>(Response::new(body_full("ok")));
                }
                let body = req
                    .into_body()
                    .collect()
                    .await
                    .map(|c| c.to_bytes())
                    .unwrap_or_default();
                if memchr_stream(&body) {
                    Ok(sse_response(interval))
                } else {
                    let mut r = Response::new(body_full(CHAT_RESPONSE));
                    r.headers_mut()
                        .insert("content-type", "application/json".parse().unwrap());
                    Ok(r)
                }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

type BenchBody = http_body_util::combinators::BoxBody<Bytes, Infallible>;

fn body_full(s: &'static str) -> BenchBody {
    Full::new(Bytes::from_static(s.as_bytes())).boxed()
}

fn memchr_stream(body: &[u8]) -> bool {
    body.windows(13).any(|w| w == b"\"stream\":true")
}

fn sse_response(interval: Duration) -> Response<BenchBody> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Infallible>>(4);
    tokio::spawn(async move {
        let start = Instant::now();
        for i in 0..=SSE_EVENTS {
            tokio::time::sleep_until(start + interval * i as u32).await;
            let data = if i < SSE_EVENTS {
                let t = monotonic_ns();
                format!("data: {{\"t\":{t},\"i\":{i},\"choices\":[{{\"delta\":{{\"content\":\"tok\"}}}}]}}\n\n")
            } else {
                "data: [DONE]\n\n".to_string()
            };
            if tx.send(Ok(Frame::data(Bytes::from(data)))).await.is_err() {
                return;
            }
        }
    });
    let stream =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|f| (f, rx)) });
    let mut r = Response::new(BodyExt::boxed(StreamBody::new(stream)));
    r.headers_mut()
        .insert("content-type", "text/event-stream".parse().unwrap());
    r
}

// ---------------------------------------------------------------------------------------------
// Proxies under test

struct Target {
    name: String,
    addr: SocketAddr,
    /// agentrace's admin listener, whose `/metrics` shows the proxy's own time per request.
    admin: Option<SocketAddr>,
    _child: Option<tokio::process::Child>,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

async fn wait_listening(addr: SocketAddr, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while tokio::net::TcpStream::connect(addr).await.is_err() {
        assert!(
            Instant::now() < deadline,
            "{what} did not start listening on {addr}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn installed(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .chain(["/usr/sbin", "/sbin"])
        .map(|d| Path::new(d).join(program))
        .find(|p| p.is_file())
}

async fn start_agentrace(
    dir: &Path,
    backends: &[SocketAddr],
    wrap: &[String],
    workers: Option<usize>,
) -> Target {
    let mut toml = String::from("listen = \"127.0.0.1:0\"\n");
    if let Some(n) = workers {
        toml.push_str(&format!("workers = {n}\n"));
    }
    toml.push_str("[admin]\nlisten = \"127.0.0.1:0\"\n");
    for (i, b) in backends.iter().enumerate() {
        toml.push_str(&format!(
            "[[backends]]\nname = \"gpu-{i}\"\nurl = \"http://{b}\"\n"
        ));
    }
    let path = dir.join("agentrace.toml");
    std::fs::write(&path, toml).unwrap();
    let binary = env!("CARGO_BIN_EXE_agentrace");
    let mut command = match wrap.split_first() {
        Some((program, args)) => {
            let mut c = tokio::process::Command::new(program);
            c.args(args).arg(binary);
            c
        }
        None => tokio::process::Command::new(binary),
    };
    let mut child = command
        .args(["proxy", "--config"])
        .arg(&path)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("agentrace binary");
    let line = first_line(&mut child, "agentrace announces its address").await;
    // "agentrace proxy listening on ADDR (admin ADMIN)"
    let words: Vec<&str> = line.split_whitespace().collect();
    let addr: SocketAddr = words[4].parse().unwrap();
    let admin: SocketAddr = words[6].trim_end_matches(')').parse().unwrap();
    Target {
        name: "agentrace".into(),
        addr,
        admin: Some(admin),
        _child: Some(child),
    }
}

async fn start_nginx(nginx: &Path, dir: &Path, backends: &[SocketAddr]) -> Target {
    let port = free_port();
    let d = dir.join("nginx");
    std::fs::create_dir_all(&d).unwrap();
    let servers: String = backends
        .iter()
        .map(|b| format!("    server {b};\n"))
        .collect();
    let conf = format!(
        "worker_processes 2;\ndaemon off;\npid {d}/nginx.pid;\nerror_log {d}/error.log warn;\n\
         events {{ worker_connections 4096; }}\n\
         http {{\n  access_log off;\n  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n\
           fastcgi_temp_path {d}/fcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n\
           upstream backends {{\n    hash $http_x_session_id consistent;\n{servers}    keepalive 256;\n  }}\n\
           server {{\n    listen 127.0.0.1:{port};\n    location / {{\n      proxy_pass http://backends;\n\
               proxy_http_version 1.1;\n      proxy_set_header Connection \"\";\n      proxy_buffering off;\n    }}\n  }}\n}}\n",
        d = d.display()
    );
    let conf_path = d.join("nginx.conf");
    std::fs::write(&conf_path, conf).unwrap();
    let mut command = tokio::process::Command::new(nginx);
    command
        .arg("-p")
        .arg(&d)
        .arg("-c")
        .arg(&conf_path)
        .arg("-e")
        .arg(d.join("error.log"));
    start_peer("nginx", command, port).await
}

async fn start_haproxy(haproxy: &Path, dir: &Path, backends: &[SocketAddr]) -> Target {
    let port = free_port();
    let servers: String = backends
        .iter()
        .enumerate()
        .map(|(i, b)| format!("  server gpu-{i} {b}\n"))
        .collect();
    let conf = format!(
        "global\n  nbthread 2\n  maxconn 4000\ndefaults\n  mode http\n  timeout connect 5s\n  timeout client 120s\n\
         timeout server 120s\n  option http-keep-alive\n  http-reuse always\n\
         frontend fe\n  bind 127.0.0.1:{port}\n  default_backend be\n\
         backend be\n  balance hdr(X-Session-ID)\n  hash-type consistent\n{servers}"
    );
    let path = dir.join("haproxy.cfg");
    std::fs::write(&path, conf).unwrap();
    let mut command = tokio::process::Command::new(haproxy);
    command.arg("-f").arg(&path).arg("-db");
    start_peer("haproxy", command, port).await
}

/// HAProxy in TCP mode relaying every connection to the first backend: no HTTP work at all,
/// only the extra hop through another process. Its added latency is the floor any proxy pays
/// on this machine (the wake-ups of a process in the path), against which the others read.
async fn start_tcp_relay(haproxy: &Path, dir: &Path, backend: SocketAddr) -> Target {
    let port = free_port();
    let conf = format!(
        "global\n  nbthread 2\n  maxconn 4000\ndefaults\n  mode tcp\n  timeout connect 5s\n\
         timeout client 120s\n  timeout server 120s\n\
         listen relay\n  bind 127.0.0.1:{port}\n  server b0 {backend}\n"
    );
    let path = dir.join("tcp-relay.cfg");
    std::fs::write(&path, conf).unwrap();
    let mut command = tokio::process::Command::new(haproxy);
    command.arg("-f").arg(&path).arg("-db");
    start_peer("tcp-relay", command, port).await
}

/// Starts a peer proxy configured to listen on `port` and waits until it does.
async fn start_peer(name: &str, mut command: tokio::process::Command, port: u16) -> Target {
    let child = command
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect(name);
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    wait_listening(addr, name).await;
    Target {
        name: name.into(),
        admin: None,
        addr,
        _child: Some(child),
    }
}

// ---------------------------------------------------------------------------------------------
// Load generators

#[derive(Clone, Copy, Debug)]
struct RunResult {
    rps: f64,
    p50_us: f64,
    p99_us: f64,
    errors: u64,
    /// CPU time the proxy processes spent per request (user + system), when measurable.
    cpu_us_per_req: f64,
    /// The part of `cpu_us_per_req` spent in the kernel (system time): the sockets' work,
    /// the same for every proxy that makes the same system calls.
    kernel_us_per_req: f64,
    /// agentrace only: the p50 and p99 of its own time per request in this run, as the upper
    /// bounds of their buckets in `agentrace_proxy_overhead_seconds` (NaN for the others).
    own_p50_us: f64,
    own_p99_us: f64,
}

/// The cumulative bucket counts of agentrace's overhead histogram, `(le seconds, count)`.
async fn overhead_buckets(admin: SocketAddr) -> Vec<(f64, u64)> {
    let stream = tokio::net::TcpStream::connect(admin).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = Request::get("/metrics")
        .header("host", admin.to_string())
        .body(Full::new(Bytes::new()))
        .unwrap();
    let body = send.send_request(req).await.unwrap().into_body();
    let text = body.collect().await.unwrap().to_bytes();
    String::from_utf8_lossy(&text)
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix("agentrace_proxy_overhead_seconds_bucket{le=\"")?;
            let (le, count) = rest.split_once("\"} ")?;
            Some((
                le.parse().unwrap_or(f64::INFINITY),
                count.trim().parse().ok()?,
            ))
        })
        .collect()
}

/// The upper bound (µs) of the bucket holding quantile `q` of what was counted between
/// `before` and `after`.
fn bucket_quantile_us(before: &[(f64, u64)], after: &[(f64, u64)], q: f64) -> f64 {
    let counts: Vec<(f64, u64)> = after
        .iter()
        .map(|&(le, n)| {
            let was = before.iter().find(|b| b.0 == le).map_or(0, |b| b.1);
            (le, n - was)
        })
        .collect();
    let total = counts.last().map_or(0, |c| c.1);
    if total == 0 {
        return f64::NAN;
    }
    let rank = (total as f64 * q).ceil() as u64;
    counts
        .iter()
        .find(|c| c.1 >= rank)
        .map_or(f64::NAN, |c| c.0 * 1e6)
}

/// Runs `run` against `t`, adding agentrace's own time per request (from its metrics).
async fn with_own_time(t: &Target, run: impl std::future::Future<Output = RunResult>) -> RunResult {
    let Some(admin) = t.admin else {
        return run.await;
    };
    let before = overhead_buckets(admin).await;
    let mut r = run.await;
    let after = overhead_buckets(admin).await;
    r.own_p50_us = bucket_quantile_us(&before, &after, 0.50);
    r.own_p99_us = bucket_quantile_us(&before, &after, 0.99);
    r
}

fn wrk_script(dir: &Path) -> PathBuf {
    let path = dir.join("sessions.lua");
    let script = format!(
        "local keys = {{}}\nfor i = 1, {KEYS} do keys[i] = \"session-\" .. i end\n\
         local body = '{CHAT_BODY}'\n\
         request = function()\n  return wrk.format(\"POST\", \"/v1/chat/completions\", \
         {{[\"Content-Type\"] = \"application/json\", [\"X-Session-ID\"] = keys[math.random(1, {KEYS})]}}, body)\nend\n"
    );
    std::fs::write(&path, script).unwrap();
    path
}

fn parse_wrk_duration(s: &str) -> f64 {
    let (num, unit) = s.split_at(s.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(s.len()));
    let v: f64 = num.parse().unwrap_or(f64::NAN);
    match unit {
        "us" => v,
        "ms" => v * 1e3,
        "s" => v * 1e6,
        "m" => v * 60e6,
        _ => f64::NAN,
    }
}

async fn run_wrk(
    wrk: &Path,
    script: &Path,
    addr: SocketAddr,
    conns: usize,
    duration: Duration,
) -> RunResult {
    let threads = conns.clamp(1, 2);
    let out = tokio::process::Command::new(wrk)
        .arg(format!("-t{threads}"))
        .arg(format!("-c{conns}"))
        .arg(format!("-d{}s", duration.as_secs().max(1)))
        .arg("--latency")
        .arg("-s")
        .arg(script)
        .arg(format!("http://{addr}/v1/chat/completions"))
        .output()
        .await
        .expect("wrk");
    let text = String::from_utf8_lossy(&out.stdout);
    let mut r = RunResult {
        rps: f64::NAN,
        p50_us: f64::NAN,
        p99_us: f64::NAN,
        errors: 0,
        cpu_us_per_req: f64::NAN,
        kernel_us_per_req: f64::NAN,
        own_p50_us: f64::NAN,
        own_p99_us: f64::NAN,
    };
    for line in text.lines() {
        let w: Vec<&str> = line.split_whitespace().collect();
        match w.as_slice() {
            ["50%", v] => r.p50_us = parse_wrk_duration(v),
            ["99%", v] => r.p99_us = parse_wrk_duration(v),
            ["Requests/sec:", v] => r.rps = v.parse().unwrap_or(f64::NAN),
            ["Non-2xx", "or", "3xx", "responses:", n] => r.errors += n.parse::<u64>().unwrap_or(0),
            ["Socket", "errors:", ..] => r.errors += line.matches(char::is_numeric).count() as u64,
            _ => {}
        }
    }
    if r.rps.is_nan() {
        eprintln!(
            "wrk output not understood:\n{text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    r
}

/// An open-loop HTTP/1.1 client: `conns` keep-alive connections sharing a fixed request rate,
/// each request due at its own instant; a slow response delays (and is charged to) the
/// requests queued behind it.
async fn run_fixed_rate(addr: SocketAddr, rate: f64, duration: Duration) -> RunResult {
    const CONNS: usize = 16;
    let start = Instant::now() + Duration::from_millis(20);
    let interval = Duration::from_secs_f64(CONNS as f64 / rate);
    let per_conn = (duration.as_secs_f64() * rate / CONNS as f64) as u32;
    let mut tasks = Vec::new();
    for c in 0..CONNS {
        tasks.push(tokio::spawn(async move {
            let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
            stream.set_nodelay(true).unwrap();
            let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                .await
                .unwrap();
            tokio::spawn(conn);
            let offset = interval * c as u32 / CONNS as u32;
            let (mut lat, mut errors) = (Vec::with_capacity(per_conn as usize), 0u64);
            let mut previous_end = Instant::now();
            for n in 0..per_conn {
                let due = start + offset + interval * n;
                tokio::time::sleep_until(due).await;
                // A request queued behind a slow response is charged from its due time; one
                // that waited on this client's timer (millisecond ticks) from when it left.
                let t0 = if previous_end > due {
                    due
                } else {
                    Instant::now()
                };
                let req = Request::post("/v1/chat/completions")
                    .header("host", addr.to_string())
                    .header("content-type", "application/json")
                    .header(
                        "x-session-id",
                        format!("session-{}", (c * 7919 + n as usize) % KEYS + 1),
                    )
                    .body(Full::new(Bytes::from_static(CHAT_BODY.as_bytes())))
                    .unwrap();
                match send.send_request(req).await {
                    Ok(resp) => {
                        errors += u64::from(!resp.status().is_success());
                        let _ = resp.into_body().collect().await;
                        previous_end = Instant::now();
                        lat.push(previous_end.duration_since(t0).as_nanos() as u64);
                    }
                    Err(_) => {
                        errors += 1;
                        break;
                    }
                }
            }
            (lat, errors)
        }));
    }
    gather(tasks, duration).await
}

/// A closed-loop HTTP/1.1 client: `conns` keep-alive connections, each sending the next
/// request as soon as the previous response ended.
async fn run_rust_client(addr: SocketAddr, conns: usize, duration: Duration) -> RunResult {
    let end = Instant::now() + duration;
    let mut tasks = Vec::new();
    for c in 0..conns {
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut errors = 0u64;
            let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
            stream.set_nodelay(true).unwrap();
            let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                .await
                .unwrap();
            tokio::spawn(conn);
            let mut i = c * 7919;
            while Instant::now() < end {
                i = (i + 104_729) % KEYS;
                let req = Request::post("/v1/chat/completions")
                    .header("host", addr.to_string())
                    .header("content-type", "application/json")
                    .header("x-session-id", format!("session-{}", i + 1))
                    .body(Full::new(Bytes::from_static(CHAT_BODY.as_bytes())))
                    .unwrap();
                let t0 = Instant::now();
                match send.send_request(req).await {
                    Ok(resp) => {
                        let ok = resp.status().is_success();
                        let _ = resp.into_body().collect().await;
                        lat.push(t0.elapsed().as_nanos() as u64);
                        errors += u64::from(!ok);
                    }
                    Err(_) => {
                        errors += 1;
                        break;
                    }
                }
            }
            (lat, errors)
        }));
    }
    gather(tasks, duration).await
}

/// Merges the connections' latencies (ns) and error counts over a run of `duration`.
async fn gather(
    tasks: Vec<tokio::task::JoinHandle<(Vec<u64>, u64)>>,
    duration: Duration,
) -> RunResult {
    let (mut all, mut errors) = (Vec::new(), 0);
    for t in tasks {
        let (l, e) = t.await.unwrap();
        all.extend(l);
        errors += e;
    }
    all.sort_unstable();
    RunResult {
        rps: all.len() as f64 / duration.as_secs_f64(),
        p50_us: percentile(&all, 0.50) / 1e3,
        p99_us: percentile(&all, 0.99) / 1e3,
        errors,
        cpu_us_per_req: f64::NAN,
        kernel_us_per_req: f64::NAN,
        own_p50_us: f64::NAN,
        own_p99_us: f64::NAN,
    }
}

fn percentile(sorted: &[u64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize] as f64
}

#[derive(Clone, Copy, Debug)]
struct SseResult {
    events_per_sec: f64,
    p50_delay_us: f64,
    p99_delay_us: f64,
}

/// `streams` concurrent SSE streams, each opening the next as soon as one ends; every event's
/// delay is (received − written by the backend), on the shared monotonic clock.
async fn run_sse(addr: SocketAddr, streams: usize, duration: Duration) -> SseResult {
    let end = Instant::now() + duration;
    let body = CHAT_BODY.replace("\"max_tokens\":16", "\"stream\":true");
    let mut tasks = Vec::new();
    for s in 0..streams {
        let body = body.clone();
        tasks.push(tokio::spawn(async move {
            let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
            stream.set_nodelay(true).unwrap();
            let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                .await
                .unwrap();
            tokio::spawn(conn);
            let mut delays = Vec::new();
            let mut n = s;
            while Instant::now() < end {
                n += streams;
                let req = Request::post("/v1/chat/completions")
                    .header("host", addr.to_string())
                    .header("content-type", "application/json")
                    .header("x-session-id", format!("session-{}", n % KEYS + 1))
                    .body(Full::new(Bytes::from(body.clone())))
                    .unwrap();
                let Ok(resp) = send.send_request(req).await else {
                    break;
                };
                let mut b = resp.into_body();
                let mut pending = Vec::new();
                while let Some(Ok(frame)) = b.frame().await {
                    let now = monotonic_ns();
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    pending.extend_from_slice(&data);
                    while let Some(pos) = pending.windows(2).position(|w| w == b"\n\n") {
                        let event: Vec<u8> = pending.drain(..pos + 2).collect();
                        if let Some(t) = event_time(&event) {
                            if Instant::now() < end {
                                delays.push(now.saturating_sub(t));
                            }
                        }
                    }
                }
            }
            delays
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all.sort_unstable();
    SseResult {
        events_per_sec: all.len() as f64 / duration.as_secs_f64(),
        p50_delay_us: percentile(&all, 0.50) / 1e3,
        p99_delay_us: percentile(&all, 0.99) / 1e3,
    }
}

fn event_time(event: &[u8]) -> Option<u64> {
    let s = std::str::from_utf8(event).ok()?;
    let rest = s.split_once("\"t\":")?.1;
    rest[..rest.find(',')?].parse().ok()
}

/// Runs `run` `repeats` times on every target: one round per repeat, every target once in each,
/// so background noise hits all of them, and the order turned by one each round so no target
/// always follows the same one. One result list per target, in round order, which lets
/// [`paired_line`] compare two targets round by round.
async fn each_target<R>(
    targets: &[Target],
    repeats: usize,
    mut run: impl for<'a> FnMut(
        &'a Target,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = R> + 'a>>,
) -> Vec<Vec<R>> {
    let mut results: Vec<Vec<R>> = targets.iter().map(|_| Vec::new()).collect();
    for round in 0..repeats {
        for k in 0..targets.len() {
            let i = (round + k) % targets.len();
            results[i].push(run(&targets[i]).await);
        }
    }
    results
}

/// agentrace against each peer proxy, round by round: in how many rounds its `field` was
/// better (`higher_is_better` or lower) and the median of the per-round ratios. Targets that
/// ran in the same round met the same machine, so the pairs cancel the drift between rounds
/// that medians over a whole run keep.
fn paired_line<R>(
    targets: &[Target],
    results: &[Vec<R>],
    what: &str,
    higher_is_better: bool,
    field: impl Fn(&R) -> f64,
) -> Option<String> {
    let ours = targets.iter().position(|t| t.name == "agentrace")?;
    let mut parts = Vec::new();
    for (t, theirs) in targets.iter().zip(results) {
        if !matches!(t.name.as_str(), "nginx" | "haproxy") {
            continue;
        }
        let ratios: Vec<f64> = results[ours]
            .iter()
            .zip(theirs)
            .map(|(a, b)| field(a) / field(b))
            .filter(|r| r.is_finite())
            .collect();
        let better = ratios
            .iter()
            .filter(|&&r| if higher_is_better { r > 1.0 } else { r < 1.0 })
            .count();
        parts.push(format!(
            "{} in {better} of {} rounds (median ratio {:.3})",
            t.name,
            ratios.len(),
            median(&ratios, |r| *r)
        ));
    }
    (!parts.is_empty()).then(|| format!("agentrace {what} than {}", parts.join(", ")))
}

/// In how many rounds agentrace added less than `limit_us` to the direct target's `field`
/// measured in the same round, and the median of what it added.
fn added_under_line<R>(
    targets: &[Target],
    results: &[Vec<R>],
    what: &str,
    limit_us: f64,
    field: impl Fn(&R) -> f64,
) -> Option<String> {
    let ours = targets.iter().position(|t| t.name == "agentrace")?;
    let added: Vec<f64> = results[ours]
        .iter()
        .zip(&results[0])
        .map(|(a, direct)| field(a) - field(direct))
        .collect();
    let under = added.iter().filter(|&&a| a < limit_us).count();
    Some(format!(
        "agentrace added {what} under {limit_us:.0} µs in {under} of {} rounds (median of the rounds: {:.0} µs)",
        added.len(),
        median(&added, |a| *a)
    ))
}

/// `value − direct` for a proxy; "-" for the direct target itself.
fn added_cell(t: &Target, value: f64, direct: f64) -> String {
    if t.name == "direct" {
        "-".to_string()
    } else {
        format!("{:.0}", value - direct)
    }
}

/// The median proxy CPU per request with its kernel part, "-" where it was not measurable.
fn cpu_cell(runs: &[RunResult]) -> String {
    let cpu = median(runs, |r| r.cpu_us_per_req);
    let kernel = median(runs, |r| r.kernel_us_per_req);
    if cpu.is_nan() {
        "-".to_string()
    } else {
        format!("{cpu:.1} ({kernel:.1})")
    }
}

/// Runs `run` against `t`, adding the proxy processes' CPU time per request to its result.
async fn with_cpu(
    t: &Target,
    duration: Duration,
    run: impl std::future::Future<Output = RunResult>,
) -> RunResult {
    let before = t.cpu_seconds();
    let mut r = run.await;
    if let (Some((user0, kernel0)), Some((user1, kernel1))) = (before, t.cpu_seconds()) {
        let per_req = |seconds: f64| seconds * 1e6 / (r.rps * duration.as_secs_f64());
        r.cpu_us_per_req = per_req(user1 + kernel1 - user0 - kernel0);
        r.kernel_us_per_req = per_req(kernel1 - kernel0);
    }
    r
}

/// The median of `field` over the repeats of a run (NaN values left out).
fn median<R>(runs: &[R], field: impl Fn(&R) -> f64) -> f64 {
    let mut v: Vec<f64> = runs.iter().map(field).filter(|x| !x.is_nan()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

// ---------------------------------------------------------------------------------------------

/// Runs this benchmark as the backends' process (see [`spawn_backend_process`]).
const BACKENDS_FLAG: &str = "--serve-backends";

fn main() {
    let mut argv = std::env::args().skip(1);
    if argv.next().as_deref() == Some(BACKENDS_FLAG) {
        let us = argv
            .next()
            .and_then(|v| v.parse().ok())
            .expect("interval µs");
        return serve_backends(Duration::from_micros(us));
    }
    let args = parse_args();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(run(args));
}

async fn run(args: Args) {
    let dir = tempfile::tempdir().unwrap();
    let (_backends_process, backends) = spawn_backend_process(args.sse_interval).await;
    let wanted = |name: &str| {
        args.only
            .as_ref()
            .is_none_or(|o| o.iter().any(|x| x == name))
    };

    let mut targets = vec![Target {
        name: "direct".into(),
        addr: backends[0],
        admin: None,
        _child: None,
    }];
    if wanted("agentrace") {
        targets.push(start_agentrace(dir.path(), &backends, &args.wrap, args.workers).await);
    }
    match installed("nginx") {
        Some(p) if wanted("nginx") => targets.push(start_nginx(&p, dir.path(), &backends).await),
        None => println!("nginx not installed: skipped (apt-get install nginx)"),
        _ => {}
    }
    match installed("haproxy") {
        Some(p) => {
            if wanted("haproxy") {
                targets.push(start_haproxy(&p, dir.path(), &backends).await);
            }
            if wanted("tcp-relay") {
                targets.push(start_tcp_relay(&p, dir.path(), backends[0]).await);
            }
        }
        None => println!("haproxy not installed: skipped (apt-get install haproxy)"),
    }
    let wrk = if args.rust_client {
        None
    } else {
        installed("wrk")
    };
    let client_name = match &wrk {
        Some(_) => "wrk",
        None => {
            if !args.rust_client {
                println!("wrk not installed: using the built-in Rust client (apt-get install wrk)");
            }
            "built-in Rust client"
        }
    };
    let script = wrk_script(dir.path());
    println!(
        "JSON: {} s per run, {} repeats (medians), {KEYS} session keys, load generator: {client_name}, cores: {}",
        args.duration.as_secs_f64(),
        args.repeats,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );

    // Warm up pools and caches.
    for t in &targets {
        run_rust_client(t.addr, 4, Duration::from_millis(500)).await;
    }

    for &conns in &args.loads {
        let results = each_target(&targets, args.repeats, |t| {
            let (wrk, script, duration) = (wrk.clone(), script.clone(), args.duration);
            Box::pin(with_cpu(t, duration, async move {
                match &wrk {
                    Some(w) => run_wrk(w, &script, t.addr, conns, duration).await,
                    None => run_rust_client(t.addr, conns, duration).await,
                }
            }))
        })
        .await;
        println!("\n{conns} connections (closed loop)");
        println!(
            "| target    | req/s (median) | p50 µs | p99 µs | p50 added vs direct µs | proxy CPU µs/req (kernel) | errors |"
        );
        println!(
            "|-----------|---------------:|-------:|-------:|-----------------------:|--------------------------:|-------:|"
        );
        let direct_p50 = median(&results[0], |r| r.p50_us);
        for (t, rs) in targets.iter().zip(&results) {
            let p50 = median(rs, |r| r.p50_us);
            println!(
                "| {:<9} | {:>14.0} | {:>6.0} | {:>6.0} | {:>22} | {:>25} | {:>6} |",
                t.name,
                median(rs, |r| r.rps),
                p50,
                median(rs, |r| r.p99_us),
                added_cell(t, p50, direct_p50),
                cpu_cell(rs),
                rs.iter().map(|r| r.errors).sum::<u64>()
            );
        }
        let lines = [
            paired_line(&targets, &results, "had more req/s", true, |r| r.rps),
            paired_line(&targets, &results, "had a lower p99", false, |r| r.p99_us),
        ];
        lines.iter().flatten().for_each(|l| println!("{l}"));
    }

    for &rate in &args.rates {
        let duration = args.duration;
        let results = each_target(&targets, args.repeats, |t| {
            Box::pin(with_own_time(
                t,
                with_cpu(t, duration, run_fixed_rate(t.addr, rate, duration)),
            ))
        })
        .await;
        println!("\n{rate:.0} req/s offered (open loop, 16 connections, latency from each request's due time)");
        println!("| target    | p50 µs | p99 µs | p50 added µs | p99 added µs | proxy CPU µs/req (kernel) | errors |");
        println!("|-----------|-------:|-------:|-------------:|-------------:|--------------------------:|-------:|");
        let d50 = median(&results[0], |r| r.p50_us);
        let d99 = median(&results[0], |r| r.p99_us);
        for (t, rs) in targets.iter().zip(&results) {
            let p50 = median(rs, |r| r.p50_us);
            let p99 = median(rs, |r| r.p99_us);
            println!(
                "| {:<9} | {:>6.0} | {:>6.0} | {:>12} | {:>12} | {:>25} | {:>6} |",
                t.name,
                p50,
                p99,
                added_cell(t, p50, d50),
                added_cell(t, p99, d99),
                cpu_cell(rs),
                rs.iter().map(|r| r.errors).sum::<u64>()
            );
        }
        for (t, rs) in targets.iter().zip(&results) {
            let (own50, own99) = (median(rs, |r| r.own_p50_us), median(rs, |r| r.own_p99_us));
            if !own50.is_nan() {
                println!(
                    "{}'s own time per request (its agentrace_proxy_overhead_seconds buckets): \
                     p50 <= {own50:.0} µs, p99 <= {own99:.0} µs; the rest of what it adds is the hop",
                    t.name
                );
            }
        }
        let lines = [
            added_under_line(&targets, &results, "p50", 100.0, |r| r.p50_us),
            paired_line(&targets, &results, "had a lower p50", false, |r| r.p50_us),
            paired_line(&targets, &results, "had a lower p99", false, |r| r.p99_us),
        ];
        lines.iter().flatten().for_each(|l| println!("{l}"));
    }

    if args.sse_streams > 0 {
        sse_table(&targets, &args).await;
    }
    for t in targets {
        t.stop().await;
    }
}

/// The SSE run: events/s and the per-event delivery delay each proxy adds.
async fn sse_table(targets: &[Target], args: &Args) {
    println!(
        "\nSSE: {} concurrent streams, {SSE_EVENTS} events per response, one event every {} µs per stream, {} s per run",
        args.sse_streams,
        args.sse_interval.as_micros(),
        args.duration.as_secs_f64()
    );
    let (streams, duration) = (args.sse_streams, args.duration);
    let sse = each_target(targets, args.repeats, |t| {
        Box::pin(run_sse(t.addr, streams, duration))
    })
    .await;
    println!("| target    | events/s (median) | delivery p50 µs | delivery p99 µs | p50 added µs | p99 added µs |");
    println!("|-----------|------------------:|----------------:|----------------:|-------------:|-------------:|");
    let d50 = median(&sse[0], |r| r.p50_delay_us);
    let d99 = median(&sse[0], |r| r.p99_delay_us);
    for (t, rs) in targets.iter().zip(&sse) {
        let p50 = median(rs, |r| r.p50_delay_us);
        let p99 = median(rs, |r| r.p99_delay_us);
        println!(
            "| {:<9} | {:>17.0} | {:>15.0} | {:>15.0} | {:>12} | {:>12} |",
            t.name,
            median(rs, |r| r.events_per_sec),
            p50,
            p99,
            added_cell(t, p50, d50),
            added_cell(t, p99, d99)
        );
    }
}

impl Target {
    /// User and system CPU seconds of the proxy process and its descendants (nginx's workers),
    /// from `/proc`; `None` for the in-process direct target or where `/proc` is missing.
    fn cpu_seconds(&self) -> Option<(f64, f64)> {
        let root = self._child.as_ref()?.id()?;
        let mut parent_of = std::collections::HashMap::new();
        let mut ticks = std::collections::HashMap::new();
        for entry in std::fs::read_dir("/proc").ok()?.flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                continue;
            };
            // Fields after the parenthesised command name: state, ppid, ..., utime (12th), stime.
            let f: Vec<&str> = stat.rsplit(')').next()?.split_whitespace().collect();
            let num = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            parent_of.insert(pid, num(1) as u32);
            ticks.insert(pid, (num(11), num(12)));
        }
        let in_tree = |mut pid: u32| loop {
            if pid == root {
                return true;
            }
            match parent_of.get(&pid) {
                Some(&p) if p != 0 && p != pid => pid = p,
                _ => return false,
            }
        };
        let (user, system) = ticks
            .iter()
            .filter(|(pid, _)| in_tree(**pid))
            .fold((0, 0), |(u, s), (_, (user, system))| (u + user, s + system));
        // Clock ticks are 1/100 s on Linux.
        Some((user as f64 / 100.0, system as f64 / 100.0))
    }

    /// SIGTERM and wait: nginx's workers outlive a SIGKILLed master.
    async fn stop(self) {
        if let Some(mut child) = self._child {
            if let Some(pid) = child.id() {
                let _ = std::process::Command::new("kill")
                    .arg(pid.to_string())
                    .status();
            }
            let _ = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
        }
    }
}
