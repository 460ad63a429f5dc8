//! Each replayed turn next to the simulator's ground truth (`--trace-log`: when the request
//! arrived, when its first token and its last were due). Shared by the ground-truth test and
//! the replay benchmark's `[truth]` line, which includes this file by path.

use std::collections::HashMap;
use std::path::Path;

/// One turn's TTFT and latency in milliseconds, as the replayer measured them and as the
/// simulator scheduled them.
#[derive(Debug, Clone, Copy)]
pub struct TurnTiming {
    pub client_ttft_ms: f64,
    pub client_latency_ms: f64,
    pub server_ttft_ms: f64,
    pub server_latency_ms: f64,
}

fn json_lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Pairs the turns of `events.jsonl` in `run_dir` with the lines of `trace_log`, per session
/// in order.
pub fn turn_timings(trace_log: &Path, run_dir: &Path) -> Vec<TurnTiming> {
    let mut truth: HashMap<String, Vec<(f64, f64)>> = HashMap::new();
    for v in json_lines(trace_log) {
        let arrival = v["arrival_s"].as_f64().unwrap();
        truth
            .entry(v["session"].as_str().unwrap().to_string())
            .or_default()
            .push((
                (v["first_token_s"].as_f64().unwrap() - arrival) * 1e3,
                (v["finish_s"].as_f64().unwrap() - arrival) * 1e3,
            ));
    }
    let events = json_lines(&run_dir.join("events.jsonl"));
    let at_ms = |kind: &str, uuid: &serde_json::Value| {
        events
            .iter()
            .find(|e| e["event_type"] == kind && &e["sample_uuid"] == uuid)
            .map(|e| e["timestamp_ns"].as_f64().unwrap() / 1e6)
            .unwrap_or_else(|| panic!("no {kind} for {uuid}"))
    };
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut timings = Vec::new();
    for issued in events.iter().filter(|e| e["event_type"] == "sample.issued") {
        let session = issued["conversation_id"].as_str().unwrap();
        let n = seen.entry(session.to_string()).or_default();
        let (server_ttft_ms, server_latency_ms) = truth[session][*n];
        *n += 1;
        let uuid = &issued["sample_uuid"];
        let t0 = at_ms("sample.issued", uuid);
        timings.push(TurnTiming {
            client_ttft_ms: at_ms("sample.recv_first", uuid) - t0,
            client_latency_ms: at_ms("sample.complete", uuid) - t0,
            server_ttft_ms,
            server_latency_ms,
        });
    }
    timings
}
