//! An observer server for the replayer's timing: it answers every POST with an OpenAI-style
//! SSE stream on a fixed script of pauses and logs, on CLOCK_MONOTONIC, when each request
//! arrived (the kernel's receive time of its first and of its last bytes, `SO_TIMESTAMPNS`)
//! and when each event was written (the clock read just before and just after the `write`).
//! Shared by `tests/replay_timing.rs` and `examples/timing_observer.rs` (the benchmark's
//! server), which include this file by path.
//!
//! One plain thread per connection, blocking sockets: no runtime between a stamp and its
//! write.
#![allow(dead_code)] // each includer uses a part

use std::io::{IoSliceMut, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd};
use std::sync::mpsc::Sender;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nix::sys::socket::{self, sockopt, ControlMessageOwned, MsgFlags};

/// How every answer is paced.
#[derive(Debug, Clone, Copy)]
pub struct Script {
    /// Pause from the request's arrival to the first event.
    pub first: Duration,
    /// Pause between events.
    pub gap: Duration,
    /// Content events per answer.
    pub events: usize,
}

/// One request and its answer, as the observer saw them (ns on CLOCK_MONOTONIC).
#[derive(Debug, Clone)]
pub struct Exchange {
    /// `X-Session-ID` of the request.
    pub session: String,
    /// When the request's first bytes arrived (kernel stamp; the read's time without one).
    pub arrival_first_ns: u64,
    /// When the bytes that completed the request arrived.
    pub arrival_last_ns: u64,
    /// Whether both arrival times are the kernel's.
    pub arrival_kernel: bool,
    /// Each content event's write: the clock just before and just after it.
    pub sends: Vec<(u64, u64)>,
    /// The write of the stream's last bytes (`[DONE]` and the last chunk), before and after.
    pub end: (u64, u64),
}

impl Exchange {
    /// One JSON line for the benchmark's log.
    pub fn to_json(&self) -> String {
        serde_json::json!({
            "session": self.session,
            "arrival_first_ns": self.arrival_first_ns,
            "arrival_last_ns": self.arrival_last_ns,
            "arrival_kernel": self.arrival_kernel,
            "sends": self.sends,
            "end": self.end,
        })
        .to_string()
    }
}

/// CLOCK_MONOTONIC now, in ns.
pub fn monotonic_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// Serves `listener` on a thread per connection, sending each finished exchange to `log`.
pub fn spawn(listener: TcpListener, script: Script, log: Sender<Exchange>) -> SocketAddr {
    let addr = listener.local_addr().unwrap();
    let _ = socket::setsockopt(&listener, sockopt::ReceiveTimestampns, &true);
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { continue };
            let log = log.clone();
            std::thread::spawn(move || {
                let _ = conn.set_nodelay(true);
                let _ = serve(conn, script, &log);
            });
        }
    });
    addr
}

/// A read and when its bytes arrived (kernel stamp moved onto CLOCK_MONOTONIC), or `None`.
fn read_stamped(conn: &TcpStream, buf: &mut [u8]) -> std::io::Result<(usize, Option<u64>)> {
    let mut iov = [IoSliceMut::new(buf)];
    let mut space = nix::cmsg_space!(nix::sys::time::TimeSpec);
    let msg = socket::recvmsg::<()>(
        conn.as_fd().as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::empty(),
    )
    .map_err(std::io::Error::from)?;
    let mut stamp = None;
    for cmsg in msg.cmsgs().into_iter().flatten() {
        if let ControlMessageOwned::ScmTimestampns(t) = cmsg {
            let unix = t.tv_sec() as i128 * 1_000_000_000 + t.tv_nsec() as i128;
            let mono = monotonic_ns() as i128;
            let wall = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_nanos() as i128;
            stamp = u64::try_from(mono - (wall - unix)).ok();
        }
    }
    Ok((msg.bytes, stamp))
}

fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().find_map(|l| {
        let (n, v) = l.split_once(':')?;
        n.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// Writes `bytes` whole, with the clock read just before and just after.
fn write_stamped(conn: &mut TcpStream, bytes: &[u8]) -> std::io::Result<(u64, u64)> {
    let before = monotonic_ns();
    conn.write_all(bytes)?;
    Ok((before, monotonic_ns()))
}

fn chunk(payload: &str) -> Vec<u8> {
    format!("{:x}\r\n{payload}\r\n", payload.len()).into_bytes()
}

/// Sleeps until `deadline` (ns on CLOCK_MONOTONIC); the pauses need not be exact, since the
/// observer logs when it actually wrote.
fn pause_until(deadline: u64) {
    let now = monotonic_ns();
    if deadline > now {
        #[allow(clippy::disallowed_methods)] // a plain thread of its own, no runtime to block
        std::thread::sleep(Duration::from_nanos(deadline - now));
    }
}

fn serve(mut conn: TcpStream, script: Script, log: &Sender<Exchange>) -> std::io::Result<()> {
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk_buf = vec![0u8; 64 * 1024];
    loop {
        // One request: its head, then Content-Length bytes of body.
        let mut first: Option<(u64, bool)> = None;
        let mut last = (0u64, false);
        let (head_len, body_len, session) = loop {
            if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&buf[..end]).into_owned();
                let len = header(&head, "content-length").map_or(0, |v| v.parse().unwrap_or(0));
                if buf.len() >= end + 4 + len {
                    let session = header(&head, "x-session-id").unwrap_or("").to_string();
                    break (end + 4, len, session);
                }
            }
            let (n, stamp) = read_stamped(&conn, &mut chunk_buf)?;
            if n == 0 {
                return Ok(());
            }
            let at = (stamp.unwrap_or_else(monotonic_ns), stamp.is_some());
            first.get_or_insert(at);
            last = at;
            buf.extend_from_slice(&chunk_buf[..n]);
        };
        buf.drain(..head_len + body_len);
        let first = first.unwrap_or(last);
        let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                    transfer-encoding: chunked\r\n\r\n";
        conn.write_all(head.as_bytes())?;
        let mut sends = Vec::with_capacity(script.events);
        let mut due = last.0 + script.first.as_nanos() as u64;
        for i in 0..script.events {
            pause_until(due);
            let data = serde_json::json!({
                "id": "obs", "object": "chat.completion.chunk", "model": "observer",
                "choices": [{"index": 0, "delta": {"content": format!("t{i} ")}, "finish_reason": null}]
            });
            sends.push(write_stamped(
                &mut conn,
                &chunk(&format!("data: {data}\n\n")),
            )?);
            due = sends[i].0 + script.gap.as_nanos() as u64;
        }
        let tail = serde_json::json!({
            "id": "obs", "object": "chat.completion.chunk", "model": "observer",
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": (body_len / 4).max(1), "completion_tokens": script.events,
                      "total_tokens": (body_len / 4).max(1) + script.events}
        });
        pause_until(due);
        let mut end_bytes = chunk(&format!("data: {tail}\n\ndata: [DONE]\n\n"));
        end_bytes.extend_from_slice(b"0\r\n\r\n");
        let end = write_stamped(&mut conn, &end_bytes)?;
        let _ = log.send(Exchange {
            session,
            arrival_first_ns: first.0,
            arrival_last_ns: last.0,
            arrival_kernel: first.1 && last.1,
            sends,
            end,
        });
    }
}
