//! The standard set and the dataset tools: `synth` is deterministic and meets its targets
//! (490 + 500 trajectories, id shapes, validity, workflow prefix sharing, coding context
//! tail, the SHA-256 recorded in docs/src/replay/datasets.md); `stats` reads the public sample as
//! measured; `convert-snapshot` rebuilds the histories it was given; the CLI's exit codes.

mod support;

use std::process::Command;

use agentrace::dataset::snapshot::convert;
use agentrace::dataset::synth::{ensure_standard_set, generate, SynthOptions};
use agentrace::dataset::DatasetStats;
use agentrace::dataset::{
    load, load_reader, Domain, LoadOptions, ModelParams, RequestBuilder, Role,
};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use support::dataset::*;

fn small(seed: u64) -> Vec<u8> {
    let mut out = Vec::new();
    let opts = SynthOptions {
        seed,
        coding: 6,
        workflow: 6,
    };
    generate(&opts, &mut out).unwrap();
    out
}

// Same seed, same bytes; another seed, other bytes.
#[test]
fn synth_is_deterministic_for_a_seed() {
    assert_eq!(small(7), small(7));
    assert_ne!(small(7), small(8));
}

// The standard set: composition, ids, validity, the KV-capacity tail of coding traces, the
// shared prefix of workflow traces, intent ground truth, and the SHA-256 the datasets page records.
#[test]
fn standard_set_meets_its_targets_and_matches_the_recorded_sha256() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mlperf-agentic-990.jsonl.zst");
    ensure_standard_set(&path).unwrap();
    let ds = load(&path, &LoadOptions::default()).unwrap();

    let page = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/docs/src/replay/datasets.md"
    ))
    .unwrap();
    assert!(
        page.contains(&ds.sha256),
        "docs/src/replay/datasets.md must record sha256 {}",
        ds.sha256
    );

    let coding: Vec<_> = ds
        .conversations
        .iter()
        .filter(|c| c.domain() == Domain::Coding)
        .collect();
    let workflow: Vec<_> = ds
        .conversations
        .iter()
        .filter(|c| c.domain() == Domain::Workflow)
        .collect();
    assert_eq!((coding.len(), workflow.len()), (490, 500));
    let swe = regex::Regex::new(r"^[a-z-]+__[a-z-]+-\d{4,5}$").unwrap();
    assert!(
        coding.iter().all(|c| swe.is_match(&c.id)),
        "coding ids are owner__repo-NNNNN"
    );
    for (i, c) in workflow.iter().enumerate() {
        assert_eq!(c.id, format!("sim_{:06}", i + 1));
    }
    assert!(ds.check_salt_preflight().is_ok());

    let stats = DatasetStats::compute(&ds);
    // Coding: a share reaches 100K–200K estimated tokens, none passes 200K.
    assert!(
        stats.coding.conversations_over_100k_tokens >= 49,
        "{}",
        stats.coding.conversations_over_100k_tokens
    );
    assert!(stats.coding.final_context_tokens_est.max <= 200_000.0);
    assert!(
        stats.coding.client_turns_per_conversation.max > 61.0 * 2.0,
        "a longer tail than the sample"
    );
    // Delays follow the sample: median ~0.06 s, p99 ~4 s, tail up to ~120 s.
    let d = &stats.coding.delay_seconds;
    assert!(
        (0.05..0.08).contains(&d.median) && (2.0..8.0).contains(&d.p99) && d.max <= 120.1,
        "{d:?}"
    );
    // Workflow: most prompt bytes are a prefix shared across conversations.
    assert!(
        stats.workflow.shared_prefix_ratio > 0.8,
        "{}",
        stats.workflow.shared_prefix_ratio
    );

    // Every coding assistant turn has reasoning and bash calls; workflow text turns state
    // their intent and carry cumulative codes ending with it.
    let intent = regex::Regex::new(r"^intent: (I\d{3})\n").unwrap();
    for c in &coding {
        for t in &c.client_turns {
            let e = t
                .expected
                .as_ref()
                .expect("coding traces end on an assistant row");
            let reply = c.recorded_reply(e);
            assert!(
                reply.reasoning_content.is_some()
                    && e.tool_calls.is_some()
                    && reply.content.is_none()
            );
        }
    }
    let mut text_turns = 0;
    for c in &workflow {
        let mut previous: Vec<String> = vec![];
        for t in &c.client_turns {
            let e = t.expected.as_ref().unwrap();
            if let Some(content) = &c.recorded_reply(e).content {
                text_turns += 1;
                let code = &intent
                    .captures(content)
                    .expect("text turns state an intent")[1];
                let codes = e.intent_codes.as_ref().unwrap();
                assert_eq!(codes.last().map(String::as_str), Some(code));
                assert!(codes.starts_with(&previous), "intent codes are cumulative");
                let n: usize = code[1..].parse().unwrap();
                assert!(n < 200, "codes are I000–I1xx");
                previous = codes.clone();
            } else {
                assert!(e.intent_codes.is_none() && e.tool_calls.is_some());
            }
        }
    }
    assert!(text_turns >= 1000);
    let system = workflow[0].system_prompt().unwrap();
    assert!(
        system.len() > 20_000 && system.contains("I057 — Pickup Delay") && system.contains("I119")
    );
    assert!(workflow
        .iter()
        .all(|c| c.system_prompt().as_deref() == Some(system.as_str())));
}

// The public sample's stats: 20 conversations, 1,007 client turns, delays as measured.
#[test]
fn sample_stats_read_twenty_conversations_and_1007_client_turns() {
    let Some(path) = sample_path("sample_stats_read_twenty_conversations_and_1007_client_turns")
    else {
        return;
    };
    let ds = load(&path, &LoadOptions::default()).unwrap();
    let s = DatasetStats::compute(&ds);
    assert_eq!((s.all.conversations, s.all.client_turns), (20, 1007));
    assert_eq!((s.coding.conversations, s.workflow.conversations), (20, 0));
    assert_eq!(s.coding.client_turns_per_conversation.min, 27.0);
    assert_eq!(s.coding.client_turns_per_conversation.max, 61.0);
    assert_eq!(s.coding.delayed_turns, 987);
    assert!((s.coding.delay_seconds.median - 0.063).abs() < 0.001);
    assert!((s.coding.delay_seconds.max - 120.1).abs() < 0.01);
    assert!((s.coding.delay_seconds_total - 636.4).abs() < 0.1);
    // §19: about 54 MB of compact JSON bodies for one pass.
    assert!(
        (50e6..58e6).contains(&(s.all.replay_request_bytes as f64)),
        "{}",
        s.all.replay_request_bytes
    );
    // The exact total equals the bodies actually built.
    let b = &RequestBuilder::new(ModelParams::default(), false);
    let built: usize = ds
        .conversations
        .iter()
        .flat_map(|c| c.client_turns.iter().map(move |t| b.body(c, t, None).len()))
        .sum();
    assert_eq!(built as u64, s.all.replay_request_bytes);
    let table = s.table();
    assert!(
        table.contains("client turns") && table.contains("1007"),
        "{table}"
    );
}

// Snapshots become flat rows whose histories reproduce the snapshot messages: the last
// snapshot wins, the system prompt leads, runs of tool messages merge into one row.
#[test]
fn snapshot_conversion_rebuilds_the_last_snapshot() {
    let tools =
        json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    let call =
        json!({"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}});
    let call2 =
        json!({"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{}"}});
    let full = json!([
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hello"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": null, "tool_calls": [call, call2]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "content": "intent: I057\nok", "intent_codes": ["I000", "I057"]}
    ]);
    let partial =
        json!([{"role": "system", "content": "sys"}, {"role": "user", "content": "hello"}]);
    let lines = [
        json!({"_type": "dataset_metadata", "license": "x"}),
        json!({"conversation_id": "sim_000001", "conversation_idx": 0, "messages": partial, "tools": tools, "metadata": {}}),
        json!({"conversation_id": "sim_000002", "conversation_idx": 1, "messages": partial, "tools": tools, "metadata": {}}),
        json!({"conversation_id": "sim_000001", "conversation_idx": 0, "messages": full, "tools": tools, "metadata": {}}),
    ];
    let mut out = Vec::new();
    let summary = convert(
        std::io::Cursor::new(jsonl(&lines)),
        &mut out,
        "mem",
        1 << 20,
    )
    .unwrap();
    assert_eq!(
        (summary.snapshots, summary.conversations, summary.rows),
        (3, 2, 5)
    );
    let convs = load_reader(
        &mut std::io::Cursor::new(out),
        "converted",
        &LoadOptions::default(),
    )
    .unwrap();
    assert_eq!(convs[0].id, "sim_000001");
    let c = &convs[0];
    assert_eq!(c.client_turns.len(), 2);
    let b = RequestBuilder::new(ModelParams::default(), false);
    let history: Value =
        serde_json::from_slice(&b.history_json(c, &c.client_turns[1], None)).unwrap();
    assert_eq!(
        history,
        json!([
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "hello\n\nagain"},
            {"role": "assistant", "tool_calls": [call, call2], "content": null},
            {"role": "tool", "tool_call_id": "c1", "content": "one"},
            {"role": "tool", "tool_call_id": "c2", "content": "two"}
        ])
    );
    let roles: Vec<Role> = c.messages.iter().map(|m| m.role).collect();
    assert_eq!(roles.len(), 6);
    let gt = c.client_turns[1].expected.as_ref().unwrap();
    assert_eq!(
        gt.intent_codes.as_deref(),
        Some(&["I000".to_string(), "I057".to_string()][..])
    );
    assert_eq!(
        b.body(c, &c.client_turns[1], None)
            .windows(8)
            .filter(|w| w == b"\"tools\":")
            .count(),
        1
    );
}

// `dataset validate` exits 0 with a one-line summary when valid, 1 with every error listed
// when not; `dataset synth` writes the same bytes for the same seed.
#[test]
fn cli_validate_and_synth_report_through_exit_codes() {
    let bin = env!("CARGO_BIN_EXE_agentrace");
    let dir = tempfile::tempdir().unwrap();
    let good = write_rows(dir.path(), "good.jsonl", &coding_conversation("a", 2));
    let out = Command::new(bin)
        .args(["dataset", "validate"])
        .arg(&good)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(stdout.lines().count(), 1);
    assert!(
        stdout.contains("valid: 1 conversations, 3 client turns"),
        "{stdout}"
    );

    let bad = write_rows(
        dir.path(),
        "bad.jsonl",
        &[assistant_text("a", 1, "x"), user("b", 1, "")],
    );
    let out = Command::new(bin)
        .args(["dataset", "validate"])
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(stderr.contains("2 validation errors"), "{stderr}");
    assert!(
        stderr.contains("line 1, conversation \"a\", turn 1: [role-sequence]"),
        "{stderr}"
    );
    assert!(
        stderr.contains("line 2, conversation \"b\", turn 1: [user-content]"),
        "{stderr}"
    );

    let mut digests = vec![];
    for name in ["s1.jsonl.zst", "s2.jsonl.zst"] {
        let p = dir.path().join(name);
        let status = Command::new(bin)
            .args([
                "dataset",
                "synth",
                "--coding",
                "3",
                "--workflow",
                "3",
                "--seed",
                "5",
                "--out",
            ])
            .arg(&p)
            .status()
            .unwrap();
        assert!(status.success());
        digests.push(hex::encode(Sha256::digest(std::fs::read(&p).unwrap())));
    }
    assert_eq!(digests[0], digests[1]);
}
