//! Captures turned into MLPerf agentic datasets, and the `agentrace capture …` commands: the
//! public sample survives capture → export row for row, exports honour their filters and
//! redaction, the commands print what the files hold, and conversations a salted replay would
//! refuse (no system prompt) are flagged at export and validation.

mod support;

use std::process::Command;

use agentrace::capture::export::{self, ExportOptions};
use agentrace::capture::Recorder;
use serde_json::Value;
use support::capture::*;
use support::dataset::sample_path;

fn read_rows(path: &std::path::Path) -> Vec<Value> {
    let bytes = std::fs::read(path).unwrap();
    let text = if path.extension().is_some_and(|e| e == "zst") {
        String::from_utf8(zstd::decode_all(&bytes[..]).unwrap()).unwrap()
    } else {
        String::from_utf8(bytes).unwrap()
    };
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

// Capture → export of the public sample: every conversation comes back with the same rows
// (roles, contents, tool calls and results, reasoning, system prompt, tools) in turn order,
// the recorded think times as `delay_seconds`, assistant rows from the recorded responses;
// and the capture stores under 5% of the raw request + response bytes.
#[tokio::test]
async fn exported_sample_capture_reproduces_the_dataset_rows() {
    let Some(sample) = sample_path("exported_sample_capture_reproduces_the_dataset_rows") else {
        return;
    };
    let convs = dataset_conversations(&sample);
    let dir = tempfile::tempdir().unwrap();
    let rec = Recorder::start(&config(dir.path())).unwrap();
    let raw = drive_conversations(rec.sink.as_ref(), &convs);
    rec.finish().await;
    let stored: u64 = agentrace::capture::reader::segments(dir.path())
        .unwrap()
        .iter()
        .map(|p| std::fs::metadata(p).unwrap().len())
        .sum();
    assert!(stored * 20 < raw, "stored {stored} of {raw} raw bytes");

    let out = dir.path().join("export").join("sample.jsonl.zst");
    let report = export::export(dir.path(), &out, &ExportOptions::default()).unwrap();
    assert_eq!(report.conversations, convs.len());
    assert_eq!(
        report.client_turns,
        convs.iter().map(|c| c.turns.len()).sum::<usize>()
    );
    let rows = read_rows(&out);
    let mut at = 0;
    for c in &convs {
        for want in &c.rows {
            let got = &rows[at];
            at += 1;
            assert_eq!(got["conversation_id"], want["conversation_id"]);
            assert_eq!(got["turn"], want["turn"]);
            for key in [
                "role",
                "content",
                "tool_calls",
                "tool_results",
                "reasoning_content",
                "system",
                "tools",
            ] {
                assert_eq!(
                    got.get(key),
                    want.get(key),
                    "{} turn {} {key}",
                    c.id,
                    want["turn"]
                );
            }
            let d_got = got
                .get("delay_seconds")
                .and_then(Value::as_f64)
                .unwrap_or(0.0);
            let d_want = want
                .get("delay_seconds")
                .and_then(Value::as_f64)
                .unwrap_or(0.0);
            assert!(
                (d_got - d_want).abs() < 2e-6,
                "{} turn {}: delay {d_got} vs {d_want}",
                c.id,
                want["turn"]
            );
        }
    }
    assert_eq!(at, rows.len());
}

// Export options: a session filter and a time range keep only what they name, content
// redaction keeps every length and no original text, and session keys outside ASCII 32..126
// become distinct valid conversation ids.
#[tokio::test]
async fn export_filters_redacts_and_sanitises_ids() {
    let dir = tempfile::tempdir().unwrap();
    let rec = Recorder::start(&config(dir.path())).unwrap();
    let keys = ["caf\u{e9}", "caf\u{e8}", "plain"];
    let t0 = 1_780_000_000_000_000_000u128;
    for (i, key) in keys.iter().enumerate() {
        for (turn, body) in agent_bodies(key, 3).into_iter().enumerate() {
            let mut ex = FakeExchange::chat(Some(key), body, &format!("secret plan {turn}"));
            ex.start_unix_ns = Some(t0 + (i as u128 * 10 + turn as u128) * 1_000_000_000);
            drive(rec.sink.as_ref(), &ex);
        }
    }
    rec.finish().await;

    let all = dir.path().join("all.jsonl");
    export::export(dir.path(), &all, &ExportOptions::default()).unwrap();
    let rows = read_rows(&all);
    let ids: std::collections::BTreeSet<&str> = rows
        .iter()
        .map(|r| r["conversation_id"].as_str().unwrap())
        .collect();
    assert_eq!(
        ids.into_iter().collect::<Vec<_>>(),
        ["caf_", "caf_-2", "plain"]
    );
    // 3 turns: user, assistant, tool, assistant, tool, assistant.
    assert_eq!(rows.len(), 3 * 6);

    let one = dir.path().join("one.jsonl");
    let opts = ExportOptions {
        sessions: vec!["plain".into()],
        ..ExportOptions::default()
    };
    export::export(dir.path(), &one, &opts).unwrap();
    assert!(read_rows(&one)
        .iter()
        .all(|r| r["conversation_id"] == "plain"));

    let window = dir.path().join("window.jsonl");
    let opts = ExportOptions {
        since_unix_ns: Some((t0 + 10_000_000_000) as u64),
        until_unix_ns: Some((t0 + 20_000_000_000) as u64),
        ..ExportOptions::default()
    };
    export::export(dir.path(), &window, &opts).unwrap();
    assert!(read_rows(&window)
        .iter()
        .all(|r| r["conversation_id"] == "caf_"));

    let redacted = dir.path().join("redacted.jsonl");
    let opts = ExportOptions {
        redact_content: true,
        ..ExportOptions::default()
    };
    export::export(dir.path(), &redacted, &opts).unwrap();
    let text = std::fs::read_to_string(&redacted).unwrap();
    assert!(!text.contains("secret plan") && !text.contains("parser fails"));
    for (a, b) in rows.iter().zip(read_rows(&redacted)) {
        for key in ["content", "reasoning_content", "system"] {
            let len = |v: &Value| {
                v.get(key)
                    .and_then(Value::as_str)
                    .map(|s| s.chars().count())
            };
            assert_eq!(len(a), len(&b));
        }
    }
}

// The commands: `ls` lists each segment, `stats --json` counts sessions, exchanges and bytes,
// `cat --session` prints that session's records with whole bodies (an unknown session is a
// non-zero exit naming it), `export` writes a file; a missing directory is a non-zero exit
// naming it.
#[tokio::test]
async fn capture_commands_show_what_the_files_hold() {
    let dir = tempfile::tempdir().unwrap();
    let rec = Recorder::start(&config(dir.path())).unwrap();
    let bodies = agent_bodies("cli", 4);
    for body in &bodies {
        drive(
            rec.sink.as_ref(),
            &FakeExchange::chat(Some("cli-session"), body.clone(), "done"),
        );
    }
    drive(
        rec.sink.as_ref(),
        &FakeExchange::chat(Some("other"), b"{}".to_vec(), "x"),
    );
    rec.finish().await;
    let bin = env!("CARGO_BIN_EXE_agentrace");
    let run = |args: &[&str]| {
        let out = Command::new(bin).args(args).output().unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let d = dir.path().to_str().unwrap();
    let ls = run(&["capture", "ls", d]);
    assert!(ls.contains("5 exchanges") && ls.contains(" ok"), "{ls}");
    let stats: Value = serde_json::from_str(&run(&["capture", "stats", d, "--json"])).unwrap();
    assert_eq!(stats["sessions"], 2);
    assert_eq!(stats["exchanges"], 5);
    assert!(stats["bytes_stored"].as_u64().unwrap() > 0);
    assert!(stats["bytes_raw"].as_u64().unwrap() > stats["bytes_stored"].as_u64().unwrap());
    let cat = run(&["capture", "cat", d, "--session", "cli-session"]);
    let lines: Vec<Value> = cat
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 4);
    for (line, body) in lines.iter().zip(&bodies) {
        assert!(line["request"]["body"].get("base").is_none());
        assert_eq!(
            line["request"]["body"]["text"].as_str().unwrap().as_bytes(),
            &body[..]
        );
    }
    let unknown = Command::new(bin)
        .args(["capture", "cat", d, "--session", "nosuch"])
        .output()
        .unwrap();
    assert!(!unknown.status.success());
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("no exchange of session \"nosuch\""));
    let out = dir.path().join("x.jsonl");
    let msg = run(&["capture", "export", d, "--out", out.to_str().unwrap()]);
    assert!(
        msg.contains("1 conversations") && msg.contains("left out 1: request has no messages"),
        "{msg}"
    );
    let missing = Command::new(bin)
        .args(["capture", "stats", "/nonexistent/capture-dir"])
        .output()
        .unwrap();
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("/nonexistent/capture-dir"));
}

// A capture of an agent that sends no system message exports, and both the export and
// `dataset validate` say that its replay needs `--salt false`; a replay left at the default
// (salted) refuses it with an error that names the flag.
#[tokio::test]
async fn conversations_without_a_system_prompt_are_flagged_for_an_unsalted_replay() {
    let dir = tempfile::tempdir().unwrap();
    let rec = Recorder::start(&config(dir.path())).unwrap();
    let body = serde_json::to_vec(&serde_json::json!({"model": "m", "stream": true,
        "messages": [{"role": "user", "content": "list the files"}]}))
    .unwrap();
    drive(
        rec.sink.as_ref(),
        &FakeExchange::chat(Some("no-system"), body, "done"),
    );
    rec.finish().await;
    let bin = env!("CARGO_BIN_EXE_agentrace");
    let out = dir.path().join("nosys.jsonl");
    let export = Command::new(bin)
        .args(["capture", "export", dir.path().to_str().unwrap(), "--out"])
        .arg(&out)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&export.stdout);
    assert!(export.status.success(), "{said}");
    assert!(
        said.contains("1 conversations have no system prompt") && said.contains("--salt false"),
        "{said}"
    );
    let validate = Command::new(bin)
        .args(["dataset", "validate"])
        .arg(&out)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&validate.stdout);
    assert!(validate.status.success(), "{said}");
    assert!(
        said.contains("valid") && said.contains("--salt false"),
        "{said}"
    );
    let dataset = agentrace::dataset::load(&out, &Default::default()).unwrap();
    let err = dataset.check_salt_preflight().unwrap_err().to_string();
    assert!(err.contains("--salt false"), "{err}");
}

// The export's memory budget is one for the whole export, not one per replica: each
// replica's reader keeps the last request of every session it saw (the base of the next
// delta), so a fleet where every replica sees every session held replicas x sessions x body
// outside the budget. With 1 and then 5 replicas and a budget far below that, the export's own
// accounting of what it held (turns, rows, bases) stays within the budget, bases went to the
// spill file, and the dataset is the one an export with room for everything writes, every
// recorded turn in it.
#[tokio::test]
async fn export_memory_stays_within_one_budget_whatever_the_replica_count() {
    let (sessions, turns) = (40, 5);
    let bodies: Vec<Vec<Vec<u8>>> = (0..sessions)
        .map(|s| agent_bodies(&format!("s{s}"), turns))
        .collect();
    let budget = 64 << 10;
    let base_bytes: usize = bodies.iter().map(|b| b[turns - 2].len()).sum();
    assert!(
        base_bytes > budget,
        "{base_bytes}: the bases of one replica overflow it"
    );
    for replicas in [1, 5] {
        let root = tempfile::tempdir().unwrap();
        let dirs: Vec<std::path::PathBuf> = (0..replicas)
            .map(|i| root.path().join(format!("pod-{i}")))
            .collect();
        let recorders: Vec<Recorder> = dirs
            .iter()
            .map(|d| Recorder::start(&config(d)).unwrap())
            .collect();
        let t0: u128 = 1_790_000_000_000_000_000;
        for t in 0..turns {
            for (s, session) in bodies.iter().enumerate() {
                let mut ex =
                    FakeExchange::chat(Some(&format!("session-{s:02}")), session[t].clone(), "ok");
                ex.start_unix_ns = Some(t0 + (t as u128 * 100 + s as u128) * 1_000_000);
                drive(recorders[(s + t) % replicas].sink.as_ref(), &ex);
            }
        }
        for r in recorders {
            r.finish().await;
        }
        let roomy = root.path().join("roomy.jsonl");
        let whole = export::export_dirs(&dirs, &roomy, &ExportOptions::default()).unwrap();
        assert_eq!(whole.bases_spilled, 0, "{whole:?}");
        let out = root.path().join("bounded.jsonl");
        let opts = ExportOptions {
            sort_buffer_bytes: budget,
            ..ExportOptions::default()
        };
        let report = export::export_dirs(&dirs, &out, &opts).unwrap();
        assert_eq!(report.buffer_bytes, budget);
        assert!(
            report.peak_buffered_bytes <= budget,
            "{replicas} replicas: held {} bytes, budget {budget}: {report:?}",
            report.peak_buffered_bytes
        );
        assert!(report.bases_spilled > 0, "{report:?}");
        assert_eq!(
            (report.conversations, report.client_turns, report.exchanges),
            (sessions, sessions * turns, sessions * turns),
            "{replicas} replicas: every recorded turn is exported"
        );
        assert_eq!(read_rows(&out), read_rows(&roomy), "{replicas} replicas");
        let left: Vec<_> = std::fs::read_dir(root.path())
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with('.'))
            .collect();
        assert!(left.is_empty(), "spill files removed: {left:?}");
    }
}

// An export holds one session at a time, not the capture: with a sort buffer far smaller than
// the capture, three replicas' turns of 30 interleaved sessions go through spill files and
// come back one session at a time (one conversation held at once), and the dataset is the
// one an export that fits in memory writes, row for row, in order of first appearance.
#[tokio::test]
async fn export_spills_past_its_buffer_and_holds_one_session_at_a_time() {
    let root = tempfile::tempdir().unwrap();
    let dirs: Vec<std::path::PathBuf> = (0..3)
        .map(|i| root.path().join(format!("pod-{i}")))
        .collect();
    let recorders: Vec<Recorder> = dirs
        .iter()
        .map(|d| Recorder::start(&config(d)).unwrap())
        .collect();
    let (sessions, turns) = (30, 4);
    let bodies: Vec<Vec<Vec<u8>>> = (0..sessions)
        .map(|s| agent_bodies(&format!("s{s}"), turns))
        .collect();
    let t0: u128 = 1_790_000_000_000_000_000;
    for t in 0..turns {
        for (s, session) in bodies.iter().enumerate() {
            let mut ex =
                FakeExchange::chat(Some(&format!("session-{s:02}")), session[t].clone(), "ok");
            // Session 29 starts first, session 0 last: appearance is not key order.
            ex.start_unix_ns = Some(t0 + (t as u128 * 100 + (sessions - s) as u128) * 1_000_000);
            drive(recorders[(s + t) % 3].sink.as_ref(), &ex);
        }
    }
    for r in recorders {
        r.finish().await;
    }
    let in_memory = root.path().join("mem.jsonl");
    let whole = export::export_dirs(&dirs, &in_memory, &ExportOptions::default()).unwrap();
    assert_eq!(whole.spill_runs, 0, "{whole:?}");
    let spilled = root.path().join("out").join("spilled.jsonl.zst");
    let opts = ExportOptions {
        sort_buffer_bytes: 16 << 10,
        ..ExportOptions::default()
    };
    let report = export::export_dirs(&dirs, &spilled, &opts).unwrap();
    assert!(report.spill_runs >= 4, "{report:?}");
    assert_eq!(report.peak_conversations_held, 1, "{report:?}");
    assert_eq!(
        (report.conversations, report.client_turns),
        (sessions, sessions * turns)
    );
    let rows = read_rows(&spilled);
    assert_eq!(rows, read_rows(&in_memory));
    let mut order: Vec<&str> = rows
        .iter()
        .map(|r| r["conversation_id"].as_str().unwrap())
        .collect();
    order.dedup();
    let want: Vec<String> = (0..sessions)
        .rev()
        .map(|s| format!("session-{s:02}"))
        .collect();
    assert_eq!(order, want);
    // Nothing but the dataset is left beside it.
    let left: Vec<_> = std::fs::read_dir(root.path().join("out"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, ["spilled.jsonl.zst"]);
}
