//! The recorder on a disk that stops taking data, for real: a proxy child process whose files
//! may not grow past 64 KiB (`RLIMIT_FSIZE`, with `SIGXFSZ` ignored so that writes fail with
//! `EFBIG` as they would with `ENOSPC`), fed records too large to fit.
//!
//! Invariants: `agentrace_capture_records_written_total` counts exactly the records a reader
//! gets back; the records that could not be written are counted as lost, with a reason; what
//! was recorded before the failure stays readable; no segment file is left empty or without a
//! record, and while writes fail no new file is left behind; once records fit again, writing
//! resumes.

mod support;

use std::os::unix::process::CommandExt as _;
use std::path::Path;
use std::process::Stdio;

use agentrace::capture::reader;
use support::backends::TestBackend;
use support::capture::{client, post, Client};
use tokio::io::AsyncReadExt;
use tokio::time::{Duration, Instant};

const FILE_SIZE_LIMIT: u64 = 64 * 1024;
const FLUSH_INTERVAL_MS: u64 = 50;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_disk_counts_only_records_that_reached_it_and_leaves_no_empty_segments() {
    let backend = TestBackend::spawn("b").await;
    let dir = tempfile::tempdir().unwrap();
    let captures = dir.path().join("captures");
    let config = dir.path().join("proxy.toml");
    std::fs::write(
        &config,
        format!(
            "listen = \"127.0.0.1:0\"\n[admin]\nlisten = \"127.0.0.1:0\"\n\
             [[backends]]\nname = \"b\"\nurl = \"{}\"\n\
             [capture]\nenabled = true\ndir = {:?}\nflush_interval_ms = {FLUSH_INTERVAL_MS}\n",
            backend.url(),
            captures.display().to_string()
        ),
    )
    .unwrap();
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_agentrace"));
    command
        .args(["proxy", "--config"])
        .arg(&config)
        .stderr(Stdio::piped());
    // SAFETY: between fork and exec the closure calls only `setrlimit` and `signal`, both
    // async-signal-safe, and touches no memory of the parent.
    unsafe {
        command.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: FILE_SIZE_LIMIT as libc::rlim_t,
                rlim_max: FILE_SIZE_LIMIT as libc::rlim_t,
            };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // Ignored signals stay ignored across exec: a write past the limit fails with
            // EFBIG instead of killing the process.
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            Ok(())
        });
    }
    let mut proxy =
        support::proxy_process::ProxyProcess::start(tokio::process::Command::from(command)).await;
    let mut stderr = proxy.child.stderr.take().unwrap();
    let log = tokio::spawn(async move {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text).await;
        text
    });
    let (addr, admin) = (proxy.addr.clone(), proxy.admin.clone());
    let url = format!("http://{addr}/v1/chat/completions");
    let metrics_url = format!("http://{admin}/metrics");
    let client = client();
    let mut sent = 0u64;

    // Before the disk fills: small records, all written.
    let mut early = Vec::new();
    for i in 0..10 {
        let body = chat(&format!("small request {i}"));
        assert_eq!(post(&client, &url, &[], body.clone()).await.0, 200);
        early.push(body);
        sent += 1;
    }
    let m = settled(&client, &metrics_url, sent).await;
    assert_eq!((m.written, m.lost), (10, 0), "{m:?}");
    let first_segment = segment_files(&captures);
    assert_eq!(first_segment.len(), 1, "{first_segment:?}");

    // The disk is full: every record is larger than what any file can still take. Keep the
    // traffic up for many flush intervals, as a proxy on a full disk would see it.
    let full_from = Instant::now();
    let mut i = 0;
    while full_from.elapsed() < Duration::from_millis(FLUSH_INTERVAL_MS * 12) || i < 20 {
        let body = chat(&incompressible(96 * 1024, i));
        assert_eq!(post(&client, &url, &[], body).await.0, 200);
        sent += 1;
        i += 1;
    }
    let m = settled(&client, &metrics_url, sent).await;
    assert_eq!(
        m.written, 10,
        "records that never reached the disk counted: {m:?}"
    );
    assert_eq!(m.lost, sent - 10, "{m:?}");
    assert!(m.lost_write_failed >= 1, "{m:?}");
    assert!(m.write_errors >= 1, "{m:?}");
    assert_eq!(
        segment_files(&captures),
        first_segment,
        "while writes failed, segment files were left behind"
    );
    check_segments(&captures, m.written);
    let capture = support::capture::read_by_arrival(&captures);
    for (i, body) in early.iter().enumerate() {
        assert_eq!(
            capture.exchanges[i].request_body.as_deref(),
            Some(&body[..]),
            "record {i}, written before the disk filled"
        );
    }

    // Records fit again: after its wait the writer starts a new segment and counts them.
    let resumed_from = m.written;
    let deadline = Instant::now() + Duration::from_secs(60);
    let m = loop {
        assert_eq!(
            post(&client, &url, &[], chat(&format!("after {sent}")))
                .await
                .0,
            200
        );
        sent += 1;
        let m = settled(&client, &metrics_url, sent).await;
        if m.written > resumed_from {
            break m;
        }
        assert!(Instant::now() < deadline, "writing did not resume: {m:?}");
    };
    check_segments(&captures, m.written);
    assert_eq!(segment_files(&captures).len(), 2);

    // A clean shutdown ends the open segment's frame and loses nothing more.
    // SAFETY: signals a child this test started and still owns.
    unsafe {
        libc::kill(proxy.pid as libc::pid_t, libc::SIGTERM);
    }
    let status = tokio::time::timeout(Duration::from_secs(30), proxy.child.wait())
        .await
        .expect("proxy did not exit")
        .unwrap();
    let log = log.await.unwrap();
    assert!(status.success(), "{status}\n{log}");
    check_segments(&captures, m.written);
}

/// The recorder's counters once every record sent is accounted for.
#[derive(Debug, Clone, Copy)]
struct Counts {
    written: u64,
    lost: u64,
    lost_write_failed: u64,
    write_errors: u64,
}

/// Waits until written + lost + dropped equals `sent` (the writer has taken every record and
/// decided its fate), then returns the counters.
async fn settled(client: &Client, metrics_url: &str, sent: u64) -> Counts {
    use http_body_util::BodyExt;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let resp = client.get(metrics_url.parse().unwrap()).await.unwrap();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        let text = String::from_utf8(bytes.to_vec()).unwrap();
        let counts = Counts {
            written: metric(&text, "agentrace_capture_records_written_total"),
            lost: metric(&text, "agentrace_capture_records_lost_total"),
            lost_write_failed: metric(
                &text,
                "agentrace_capture_records_lost_total{reason=\"write_failed\"}",
            ),
            write_errors: metric(&text, "agentrace_capture_write_errors_total"),
        };
        let dropped = metric(&text, "agentrace_capture_records_dropped_total");
        if counts.written + counts.lost + dropped == sent {
            assert_eq!(dropped, 0, "{counts:?}");
            return counts;
        }
        assert!(
            Instant::now() < deadline,
            "{sent} records not accounted for: {counts:?}, {dropped} dropped\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Sum of the series whose name (with labels, if given) starts the line.
fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

fn segment_files(dir: &Path) -> Vec<std::path::PathBuf> {
    reader::segments(dir).unwrap()
}

/// Every segment holds at least one readable exchange, and together they hold `written`.
fn check_segments(dir: &Path, written: u64) {
    let mut total = 0;
    for path in segment_files(dir) {
        let len = std::fs::metadata(&path).unwrap().len();
        assert!(len > 0, "{} is empty", path.display());
        let exchanges = reader::SegmentReader::open(&path)
            .unwrap()
            .filter(|e| matches!(e, reader::Entry::Exchange(_)))
            .count() as u64;
        assert!(exchanges > 0, "{} holds no exchange", path.display());
        total += exchanges;
    }
    assert_eq!(total, written, "records counted written vs readable");
    assert_eq!(
        reader::read_dir(dir).unwrap().exchanges.len() as u64,
        written
    );
}

fn chat(content: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "model": "m",
        "messages": [{"role": "user", "content": content}],
    }))
    .unwrap()
}

/// `len` characters that zstd cannot shrink much (6 random bits each).
fn incompressible(len: usize, seed: u64) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ALPHABET[(x >> 58) as usize] as char
        })
        .collect()
}
