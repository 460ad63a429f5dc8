//! Capture at fleet scale: proxy replicas behind a load balancer that is not session-aware
//! each see some turns of a conversation; exporting all their capture directories gives back
//! every conversation turn for turn, with the delays the client waited, ordered by history
//! where the replicas' clocks disagree; closed segments shipped with `rclone` while the proxy
//! keeps writing export the same.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use agentrace::capture::export::{self, ExportOptions};
use agentrace::capture::reader;
use serde_json::{json, Value};
use support::capture::*;
use tokio::time::{Duration, Instant};

/// The tests of this file run one at a time: the delay check's 5 ms must not absorb the CPU
/// the other test's rclone runs take.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// What the client sent and waited in one conversation.
struct Sent {
    session: String,
    /// Messages of the last request, then the last reply.
    history: Vec<Value>,
    /// Per turn after the first: time from the previous response's end to this request (s),
    /// as the client's sockets saw them.
    delays: Vec<f64>,
}

/// An agent-like conversation of `turns`, turn `t` sent to `urls[route(t)]`, thinking
/// `think_ms(t)` between a reply and the next request.
async fn conversation(
    urls: &[String],
    session: &str,
    turns: usize,
    route: impl Fn(usize) -> usize,
) -> Sent {
    let mut messages = vec![
        json!({"role": "system", "content": "You are a coding agent. Use the bash tool."}),
        json!({"role": "user", "content": format!("Session {session}: make the tests pass.")}),
    ];
    // Connected to every replica before the first turn, so that a wait the client measures
    // ends with the request on an open connection, not with a connect still to make.
    let mut replicas = Vec::new();
    for url in urls {
        replicas.push(Replica::connect(url).await);
    }
    let mut delays = Vec::new();
    let mut done: Option<Instant> = None;
    let mut reply = Value::Null;
    for turn in 0..turns {
        let body = serde_json::to_vec(&json!({"model": "m", "messages": messages,
            "max_completion_tokens": 32, "stream": true, "temperature": 0.25}))
        .unwrap();
        if done.is_some() {
            // Think time, varied per turn.
            tokio::time::sleep(Duration::from_millis(15 + 10 * (turn as u64 % 3))).await;
        }
        let (status, frames, sent, received) = replicas[route(turn)].post(session, body).await;
        // The wait as the export defines it: from the previous response's last byte to this
        // request's first, both where the client's sockets read and wrote them.
        if let Some(done) = done {
            delays.push(sent.duration_since(done).as_secs_f64());
        }
        done = Some(received);
        assert_eq!(status, 200, "{session} turn {turn}");
        reply = agentrace::capture::export::assistant_from_sse(&frames.concat()).unwrap();
        if turn + 1 == turns {
            break;
        }
        answer(&mut messages, reply.clone(), turn);
    }
    messages.push(reply);
    Sent {
        session: session.to_owned(),
        history: messages,
        delays,
    }
}

/// When a connection's socket last delivered bytes, and first took bytes since asked.
#[derive(Default)]
struct WireTimes {
    last_read: Option<Instant>,
    first_write: Option<Instant>,
}

/// A TCP stream noting when bytes cross it, so the client's times are those of its socket,
/// not of the task that later looks at the bytes.
struct TimedStream {
    tcp: tokio::net::TcpStream,
    times: Arc<std::sync::Mutex<WireTimes>>,
}

impl tokio::io::AsyncRead for TimedStream {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        loop {
            std::task::ready!(self.tcp.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            match self.tcp.try_io(tokio::io::Interest::READABLE, || {
                read_stamped(&self.tcp, unfilled)
            }) {
                Ok((n, stamp)) => {
                    if n > 0 {
                        // The kernel's receive time when it gave one: a client thread that
                        // waits for a core before reading does not make the wait look shorter.
                        let at = stamp.and_then(instant_of).unwrap_or_else(Instant::now);
                        self.times.lock().unwrap().last_read = Some(at);
                    }
                    buf.advance(n);
                    return std::task::Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return std::task::Poll::Ready(Err(e)),
            }
        }
    }
}

/// Reads what `tcp` holds into `into`, with the kernel's receive time of those bytes (ns since
/// the Unix epoch) when the socket stamps them.
fn read_stamped(
    tcp: &tokio::net::TcpStream,
    into: &mut [u8],
) -> std::io::Result<(usize, Option<u128>)> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    use std::os::fd::{AsFd, AsRawFd};
    let mut iov = [std::io::IoSliceMut::new(into)];
    let mut space = nix::cmsg_space!(nix::sys::time::TimeSpec);
    let msg = recvmsg::<()>(
        tcp.as_fd().as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_DONTWAIT,
    )
    .map_err(std::io::Error::from)?;
    let mut stamp = None;
    if let Ok(cmsgs) = msg.cmsgs() {
        for cmsg in cmsgs {
            if let ControlMessageOwned::ScmTimestampns(t) = cmsg {
                if t.tv_sec() > 0 && t.tv_nsec() >= 0 {
                    stamp = Some(t.tv_sec() as u128 * 1_000_000_000 + t.tv_nsec() as u128);
                }
            }
        }
    }
    Ok((msg.bytes, stamp))
}

/// The monotonic instant of a wall-clock time at most a minute back.
fn instant_of(unix_ns: u128) -> Option<Instant> {
    let (now, wall) = (Instant::now(), std::time::SystemTime::now());
    let wall_ns = wall.duration_since(std::time::UNIX_EPOCH).ok()?.as_nanos();
    let age = u64::try_from(wall_ns.checked_sub(unix_ns)?).ok()?;
    (age <= 60_000_000_000)
        .then(|| now.checked_sub(Duration::from_nanos(age)))
        .flatten()
}

impl tokio::io::AsyncWrite for TimedStream {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        data: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let at = Instant::now();
        let poll = std::pin::Pin::new(&mut self.tcp).poll_write(cx, data);
        if matches!(poll, std::task::Poll::Ready(Ok(n)) if n > 0) {
            self.times.lock().unwrap().first_write.get_or_insert(at);
        }
        poll
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let at = Instant::now();
        let poll = std::pin::Pin::new(&mut self.tcp).poll_write_vectored(cx, bufs);
        if matches!(poll, std::task::Poll::Ready(Ok(n)) if n > 0) {
            self.times.lock().unwrap().first_write.get_or_insert(at);
        }
        poll
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}

/// One kept-alive HTTP/1.1 connection to a proxy replica.
struct Replica {
    send: hyper::client::conn::http1::SendRequest<http_body_util::Full<bytes::Bytes>>,
    url: http::Uri,
    times: Arc<std::sync::Mutex<WireTimes>>,
}

impl Replica {
    async fn connect(url: &str) -> Self {
        let url: http::Uri = url.parse().unwrap();
        let tcp = tokio::net::TcpStream::connect(url.authority().unwrap().as_str())
            .await
            .unwrap();
        // Every read says when the kernel received its bytes.
        nix::sys::socket::setsockopt(&tcp, nix::sys::socket::sockopt::ReceiveTimestampns, &true)
            .unwrap();
        let times = Arc::new(std::sync::Mutex::new(WireTimes::default()));
        let stream = TimedStream {
            tcp,
            times: times.clone(),
        };
        let (send, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .unwrap();
        tokio::spawn(conn);
        Self { send, url, times }
    }

    /// Posts a chat body of `session`: the status, the response's data frames, when the
    /// request's first byte went out and when the response's last byte came in.
    async fn post(
        &mut self,
        session: &str,
        body: Vec<u8>,
    ) -> (u16, Vec<bytes::Bytes>, Instant, Instant) {
        let req = http::Request::post(self.url.path())
            .header("host", self.url.authority().unwrap().as_str())
            .header("content-type", "application/json")
            .header("x-session-id", session)
            .body(http_body_util::Full::new(bytes::Bytes::from(body)))
            .unwrap();
        self.send.ready().await.unwrap();
        self.times.lock().unwrap().first_write = None;
        let resp = self.send.send_request(req).await.unwrap();
        let status = resp.status().as_u16();
        let frames = data_frames(resp.into_body()).await;
        let times = self.times.lock().unwrap();
        let sent = times.first_write.expect("the request was written");
        let received = times.last_read.expect("the response was read");
        (status, frames, sent, received)
    }
}

/// One line per dataset row as its role and identifying content, consecutive user and tool
/// messages grouped as the exporter groups them.
fn expected_rows(history: &[Value]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut last_role = "";
    for m in &history[1..] {
        let role = m["role"].as_str().unwrap();
        let part = match role {
            "tool" => m["tool_call_id"].as_str().unwrap().to_owned(),
            "user" => m["content"].as_str().unwrap().to_owned(),
            _ => assistant_signature(m),
        };
        if role == last_role && role != "assistant" {
            let sep = if role == "user" { "\n\n" } else { "," };
            out.last_mut().unwrap().push_str(&format!("{sep}{part}"));
        } else {
            out.push(format!("{role}:{part}"));
        }
        last_role = role;
    }
    out
}

fn assistant_signature(m: &Value) -> String {
    match m.get("tool_calls").and_then(Value::as_array) {
        Some(calls) if !calls.is_empty() => calls
            .iter()
            .map(|c| c["id"].as_str().unwrap().to_owned())
            .collect::<Vec<_>>()
            .join(","),
        _ => m["content"].as_str().unwrap_or("").to_owned(),
    }
}

fn row_signature(row: &Value) -> String {
    let role = row["role"].as_str().unwrap();
    let part = match role {
        "tool" => row["tool_results"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["tool_call_id"].as_str().unwrap().to_owned())
            .collect::<Vec<_>>()
            .join(","),
        "user" => row["content"].as_str().unwrap().to_owned(),
        _ => assistant_signature(row),
    };
    format!("{role}:{part}")
}

fn read_rows(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Moves the start of every record of `session` in `dir` by `-shift_ns`: that replica's clock
/// ran behind for this conversation.
fn skew_session(dir: &Path, session: &str, shift_ns: u64) {
    for path in reader::segments(dir).unwrap() {
        let raw = zstd::decode_all(&std::fs::read(&path).unwrap()[..]).unwrap();
        let mut out = Vec::new();
        for line in raw.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
            let mut v: Value = serde_json::from_slice(line).unwrap();
            if v["type"] == "exchange" && v["session"] == session {
                let start = v["start_unix_ns"].as_u64().unwrap();
                v["start_unix_ns"] = json!(start - shift_ns);
            }
            out.extend(serde_json::to_vec(&v).unwrap());
            out.push(b'\n');
        }
        std::fs::write(&path, zstd::encode_all(&out[..], 3).unwrap()).unwrap();
    }
}

fn run_cli(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_agentrace"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

// Three replicas, six conversations of four turns sent round the replicas, and one whose turns
// alternate between two replicas with one replica's clock 300 ms behind: the export of all
// three directories has exactly the client's conversations turn for turn, the delays the
// client waited within 5 ms (from the last byte of a response to the first byte of the next
// request, as its sockets saw them; all 18, the proxy stamping a request's start with the
// kernel's receive time of its first byte), the skewed conversation put in
// order by its history (2 turns decided so); it validates and replays. One directory alone
// misses turns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleet_export_rebuilds_every_conversation_across_replicas() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (stop_sim, sim_shutdown) = agentrace::shutdown::channel();
    let sim = start_sim(sim_shutdown);
    let root = tempfile::tempdir().unwrap();
    let fleet = root.path().join("fleet");
    let mut proxies = Vec::new();
    let mut urls = Vec::new();
    let mut dirs: Vec<PathBuf> = Vec::new();
    for i in 0..3 {
        let dir = fleet.join(format!("pod-{i}"));
        let mut capture = config(&dir);
        capture.replica = format!("pod-{i}");
        let (stop, shutdown) = agentrace::shutdown::channel();
        let proxy = start_proxy(&sim.addrs(), Some(capture), shutdown).await;
        urls.push(format!("http://{}/v1/chat/completions", proxy.addr));
        proxies.push((stop, proxy));
        dirs.push(dir);
    }
    // One conversation at a time: the 5 ms the delay check allows is for the export, not for
    // seven conversations' tasks waiting for the test's two threads.
    let mut sent = Vec::new();
    for c in 0..6 {
        sent.push(conversation(&urls, &format!("fleet-{c}"), 4, |t| (c + t) % 3).await);
    }
    sent.push(conversation(&urls, "skewed", 4, |t| t % 2).await);
    sent.sort_by(|a, b| a.session.cmp(&b.session));
    for (stop, proxy) in proxies {
        stop.fire();
        proxy.join().await;
    }
    skew_session(&dirs[1], "skewed", 300_000_000);

    let out = root.path().join("fleet.jsonl");
    let report = export::export_dirs(&dirs, &out, &ExportOptions::default()).unwrap();
    assert!(report.cuts.is_empty(), "{:?}", report.cuts);
    assert_eq!(
        (
            report.directories,
            report.conversations,
            report.client_turns
        ),
        (3, 7, 28),
        "{report:?}"
    );
    assert_eq!(report.turns_ordered_by_history, 2, "{report:?}");
    let rows = read_rows(&out);
    // (session, exported delay, client's wait) of every turn after a first.
    let mut delays: Vec<(String, f64, f64)> = Vec::new();
    for s in &sent {
        let conv: Vec<&Value> = rows
            .iter()
            .filter(|r| r["conversation_id"] == s.session.as_str())
            .collect();
        let got: Vec<String> = conv.iter().map(|r| row_signature(r)).collect();
        assert_eq!(got, expected_rows(&s.history), "{}", s.session);
        if s.session == "skewed" {
            continue;
        }
        let client_rows: Vec<&&Value> = conv
            .iter()
            .filter(|r| r["role"] == "user" || r["role"] == "tool")
            .collect();
        assert_eq!(client_rows.len(), 4, "{}", s.session);
        assert!(client_rows[0].get("delay_seconds").is_none());
        for (row, want) in client_rows[1..].iter().zip(&s.delays) {
            let got = row["delay_seconds"].as_f64().unwrap();
            delays.push((s.session.clone(), got, *want));
        }
    }
    // Both ends are wire times: the proxy stamps a response's end once its connection wrote
    // the last bytes and a request's start with the kernel's receive time of its first byte
    // (so a proxy thread waiting for a core does not stamp it late), the client the kernel's
    // receive time of its last read and its first write; only loopback lies between them.
    assert_eq!(delays.len(), 18);
    assert!(
        delays.iter().all(|d| (d.1 - d.2).abs() <= 0.005),
        "{delays:?}"
    );

    // The command line takes the directory of replica directories and says what it merged.
    let root_arg = fleet.to_str().unwrap();
    let cli_out = root.path().join("cli.jsonl");
    let said = run_cli(&[
        "capture",
        "export",
        root_arg,
        "--out",
        cli_out.to_str().unwrap(),
    ]);
    assert!(
        said.contains("7 conversations") && said.contains("merged 3 capture directories; 2 turns"),
        "{said}"
    );
    assert_eq!(read_rows(&cli_out), rows);
    let stats: Value =
        serde_json::from_str(&run_cli(&["capture", "stats", root_arg, "--json"])).unwrap();
    assert_eq!(stats["directories"], 3);
    assert_eq!(stats["exchanges"], 28);
    let replicas = stats["replicas"].as_object().unwrap();
    assert_eq!(
        replicas.keys().collect::<Vec<_>>(),
        ["pod-0", "pod-1", "pod-2"]
    );
    let ls = run_cli(&["capture", "ls", root_arg]);
    assert!(ls.contains("replica pod-2"), "{ls}");
    // `cat` reads a fleet too: one session's records from all three replicas, in time order;
    // a session none of them holds is an error naming it.
    let cat = run_cli(&["capture", "cat", root_arg, "--session", "fleet-0"]);
    let starts: Vec<u64> = cat
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["start_unix_ns"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(starts.len(), 4, "{cat}");
    assert!(starts.windows(2).all(|w| w[0] < w[1]), "{starts:?}");
    let unknown = Command::new(env!("CARGO_BIN_EXE_agentrace"))
        .args(["capture", "cat"])
        .args(&dirs)
        .args(["--session", "nosuch"])
        .output()
        .unwrap();
    assert!(!unknown.status.success());
    assert!(
        String::from_utf8_lossy(&unknown.stderr).contains("no exchange of session \"nosuch\""),
        "{}",
        String::from_utf8_lossy(&unknown.stderr)
    );

    // One replica's directory alone loses turns other replicas saw after its last request.
    let alone = export::export(
        &dirs[0],
        &root.path().join("one.jsonl"),
        &Default::default(),
    )
    .unwrap();
    assert!(alone.client_turns < 28, "{alone:?}");

    let dataset = agentrace::dataset::load(&out, &Default::default()).unwrap();
    assert_eq!(dataset.conversations.len(), 7);
    let replay_config = agentrace::replay::ReplayConfig {
        target: format!("http://{}", sim.addrs()[0]).into(),
        dataset: Some(out.clone()),
        model_name: Some("m".into()),
        concurrency: 4,
        inject_tool_delay: false,
        ..Default::default()
    };
    let (_stop_replay, replay_shutdown) = agentrace::shutdown::channel();
    let summary = agentrace::replay::run(
        replay_config,
        Arc::new(dataset),
        &root.path().join("replay-out"),
        replay_shutdown,
    )
    .await
    .unwrap();
    assert_eq!(summary.turns_ok, 28, "{summary:?}");
    stop_sim.fire();
    sim.join().await;
}

// `rclone copy --min-age` run while the proxy keeps writing copies only closed segments (a
// segment untouched for longer than the rotation age plus the flush interval is closed), and
// the copy exports the same dataset as the source once the last segment is shipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_segments_shipped_by_rclone_export_like_the_source() {
    if Command::new("rclone").arg("version").output().is_err() {
        support::skip(
            "closed_segments_shipped_by_rclone_export_like_the_source",
            "rclone not installed",
        );
        return;
    }
    let _one = ONE_AT_A_TIME.lock().await;
    let (stop_sim, sim_shutdown) = agentrace::shutdown::channel();
    let sim = start_sim(sim_shutdown);
    let root = tempfile::tempdir().unwrap();
    let (src, dst) = (root.path().join("pod-0"), root.path().join("bucket/pod-0"));
    let mut capture = config(&src);
    capture.rotate_age_secs = 1;
    capture.flush_interval_ms = 100;
    let (stop, shutdown) = agentrace::shutdown::channel();
    let proxy = start_proxy(&sim.addrs(), Some(capture), shutdown).await;
    let urls = Arc::new(vec![format!("http://{}/v1/chat/completions", proxy.addr)]);
    conversation(&urls, "ship-0", 3, |_| 0).await;
    // Wait for the first segment to close (its frame ends).
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let closed = reader::segments(&src).unwrap().iter().any(|p| {
            let mut r = reader::SegmentReader::open(p).unwrap();
            r.by_ref().count();
            r.cut().is_none()
        });
        if closed {
            break;
        }
        assert!(Instant::now() < deadline, "no segment closed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The proxy keeps writing while rclone copies, pass after pass, until closed segments
    // have been shipped.
    let keep_writing = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let writing = {
        let (urls, keep) = (urls.clone(), keep_writing.clone());
        tokio::spawn(async move {
            let mut s = 1;
            while keep.load(std::sync::atomic::Ordering::Relaxed) {
                conversation(&urls, &format!("ship-{s}"), 3, |_| 0).await;
                s += 1;
            }
            s - 1
        })
    };
    let rclone = |min_age: Option<&str>| {
        let mut cmd = Command::new("rclone");
        cmd.args(["copy", "--include", "capture-*.jsonl.zst"]);
        if let Some(age) = min_age {
            cmd.args(["--min-age", age]);
        }
        let out = cmd.arg(&src).arg(&dst).output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    loop {
        // Rotation age 1 s + flush interval 0.1 s + margin.
        tokio::task::block_in_place(|| rclone(Some("1500ms")));
        let shipped = if dst.exists() {
            reader::segments(&dst).unwrap()
        } else {
            Vec::new()
        };
        for path in &shipped {
            let mut r = reader::SegmentReader::open(path).unwrap();
            r.by_ref().count();
            assert!(
                r.cut().is_none(),
                "an open segment was shipped: {:?}",
                r.cut()
            );
        }
        if shipped.len() >= 2 {
            break;
        }
        assert!(Instant::now() < deadline, "nothing shipped");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    keep_writing.store(false, std::sync::atomic::Ordering::Relaxed);
    let conversations = writing.await.unwrap() + 1;
    stop.fire();
    proxy.join().await;
    rclone(None);

    let (a, b) = (root.path().join("src.jsonl"), root.path().join("dst.jsonl"));
    let from_src = export::export(&src, &a, &ExportOptions::default()).unwrap();
    let from_dst =
        export::export_dirs(&[root.path().join("bucket")], &b, &ExportOptions::default()).unwrap();
    assert_eq!(
        (from_dst.conversations, from_dst.client_turns),
        (conversations, 3 * conversations)
    );
    assert_eq!(from_src.client_turns, from_dst.client_turns);
    assert_eq!(read_rows(&a), read_rows(&b));
    stop_sim.fire();
    sim.join().await;
}
