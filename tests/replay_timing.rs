//! The replayer's stamps are the kernel's, not its task's: a local server with known pauses
//! (`support/observer.rs`: 50 ms to the first event, 50 ms between events) logs on
//! CLOCK_MONOTONIC, the clock of `events.jsonl`, just before and just after writing each
//! event, and every RECV and COMPLETE stamp must fall inside that write, within 0.2 ms.
//!
//! On loopback the bytes are received, and stamped in softirq, inside the server's `write`
//! call, so the bound holds however late the replayer's task runs on a loaded machine; a
//! stamp taken when the task reads is late by the wait for a core. The server's own stamps
//! are the reference, not the nominal pauses, so a server thread that runs late moves both.

#[path = "support/observer.rs"]
mod observer;
mod support;

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use support::dataset::{coding_conversation, write_rows};
use support::replay::events;

/// How far outside the server's write a stamp may fall: a read that coalesces the next event
/// with this one, or a packet the kernel delivers just after the write returns.
const TOLERANCE_NS: u64 = 200_000;

/// The replayer under test: this build's, or `AGENTRACE_BIN` (to run the test against another
/// build, as it was against the code before kernel stamps, where it fails).
fn replayer() -> PathBuf {
    std::env::var_os("AGENTRACE_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_agentrace").into())
}

#[test]
fn every_event_is_stamped_inside_the_server_write_that_sent_it() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let script = observer::Script {
        first: Duration::from_millis(50),
        gap: Duration::from_millis(50),
        events: 4,
    };
    let addr = observer::spawn(listener, script, tx);
    let dir = tempfile::tempdir().unwrap();
    let rows: Vec<_> = (0..3)
        .flat_map(|i| coding_conversation(&format!("timing{i}"), 2))
        .collect();
    let dataset = write_rows(dir.path(), "timing.jsonl", &rows);
    let out = dir.path().join("run");
    let run = Command::new(replayer())
        .args([
            "replay",
            "--concurrency",
            "3",
            "--log-chunks",
            "--no-progress",
        ])
        .args(["--salt", "false", "--delays", "true", "--target"])
        .arg(format!("http://{addr}"))
        .arg("--dataset")
        .arg(&dataset)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "replay failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );

    let mut served: HashMap<String, Vec<observer::Exchange>> = HashMap::new();
    // The server logs an exchange just after its last write, which the run may outpace.
    for _ in 0..9 {
        let x = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        served.entry(x.session.clone()).or_default().push(x);
    }
    let evs = events(&out);
    let ts = |e: &serde_json::Value| e["timestamp_ns"].as_u64().unwrap();
    let mut nth: HashMap<String, usize> = HashMap::new();
    let mut checked = 0;
    let mut send_gaps = Vec::new();
    for issued in evs.iter().filter(|e| e["event_type"] == "sample.issued") {
        let conv = issued["conversation_id"].as_str().unwrap().to_string();
        let n = nth.entry(conv.clone()).or_default();
        let x = &served[&conv][*n];
        *n += 1;
        let uuid = &issued["sample_uuid"];
        let of = |kind: &str| -> Vec<u64> {
            evs.iter()
                .filter(|e| e["sample_uuid"] == *uuid && e["event_type"] == kind)
                .map(ts)
                .collect()
        };
        // The request's send time is when the write that completed it began: on loopback its
        // bytes reach the server within that write, so the two stamps (the server's is the
        // kernel's, moved onto the same clock) agree within the tolerance.
        assert!(
            ts(issued).abs_diff(x.arrival_first_ns) <= TOLERANCE_NS,
            "{conv}: ISSUED {} ns from the request's arrival at the server",
            ts(issued) as i64 - x.arrival_first_ns as i64
        );
        send_gaps.push(ts(issued).abs_diff(x.arrival_first_ns));
        let mut recv = of("sample.recv_first");
        recv.extend(of("sample.recv_non_first"));
        assert_eq!(recv.len(), x.sends.len(), "{conv}: one RECV per event");
        let complete = of("sample.complete");
        let pairs = recv
            .iter()
            .zip(&x.sends)
            .chain(complete.iter().zip([&x.end]));
        for (i, (&got, &(before, after))) in pairs.enumerate() {
            assert!(
                got + TOLERANCE_NS >= before && got <= after + TOLERANCE_NS,
                "{conv} turn {n} event {i}: stamped at {got}, the server wrote it in \
                 [{before}, {after}]: {} µs after the write ended",
                (got as i64 - after as i64) / 1000
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 9 * 5, "every event and every end was compared");
    send_gaps.sort_unstable();
    let median = send_gaps[send_gaps.len() / 2];
    assert!(
        median <= TOLERANCE_NS,
        "ISSUED is {median} ns from the server's arrival at the median: {send_gaps:?}"
    );
}
