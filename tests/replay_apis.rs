//! The replayer drives any agent's wire (`replay --api chat|messages|responses`): the same
//! trajectories, written as valid Anthropic Messages and OpenAI Responses requests, decoded
//! with the recorder's first-token rule (the first content, thinking or tool delta, never
//! `message_start`, `response.created` or a `ping`), token counts from each API's usage, the
//! Responses chain (`previous_response_id`, only new items) failing with the server's reason
//! when the server lost its state, and each API's error body as a failed turn's reason.

mod support;

use std::collections::HashSet;
use std::time::Duration;

use agentrace::replay::{Api, ReplayConfig};
use serde_json::{json, Value};
use support::replay::{config, conversation, dataset, events, no_shutdown};
use support::wire_server::{self, Received, WireServer, INPUT_TOKENS, OUTPUT_TOKENS};

/// The pause every test server makes between its preamble and its first delta.
const FIRST_DELAY: Duration = Duration::from_millis(30);

async fn replay(
    server: &WireServer,
    cfg: ReplayConfig,
) -> (agentrace::replay::ReplaySummary, tempfile::TempDir) {
    let out = tempfile::tempdir().unwrap();
    let ds = dataset(vec![
        conversation("conv-a", 3, &[], "ls"),
        conversation("conv-b", 2, &[], "pwd"),
    ]);
    let mut cfg = cfg;
    cfg.target = server.url().as_str().into();
    let summary = agentrace::replay::run(cfg, ds, out.path(), no_shutdown())
        .await
        .unwrap();
    (summary, out)
}

fn with_api(api: Api) -> ReplayConfig {
    ReplayConfig {
        api,
        ..config("http://unused", 2)
    }
}

/// Every turn's TTFT (RECV_FIRST − ISSUED) from events.jsonl, in ns.
fn ttfts_ns(dir: &std::path::Path) -> Vec<u64> {
    let ev = events(dir);
    let of = |kind: &str| -> Vec<(String, u64)> {
        ev.iter()
            .filter(|e| e["event_type"] == kind)
            .map(|e| {
                let uuid = e["sample_uuid"].as_str().unwrap().to_owned();
                (uuid, e["timestamp_ns"].as_u64().unwrap())
            })
            .collect()
    };
    let issued = of("sample.issued");
    of("sample.recv_first")
        .into_iter()
        .map(|(uuid, at)| at - issued.iter().find(|(u, _)| *u == uuid).unwrap().1)
        .collect()
}

/// The reasons of events.jsonl's error records.
fn error_messages(dir: &std::path::Path) -> Vec<String> {
    events(dir)
        .iter()
        .filter(|e| e["event_type"].as_str().unwrap().starts_with("error."))
        .map(|e| e["data"].to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_requests_pair_tool_use_with_tool_results_and_carry_max_tokens() {
    let server = wire_server::start(FIRST_DELAY).await;
    let mut cfg = with_api(Api::Messages);
    cfg.api_key_env = Some("CARGO_PKG_NAME".into());
    let (summary, _out) = replay(&server, cfg).await;
    assert_eq!(summary.turns_ok, 5, "{summary:?}");
    let received = server.received();
    assert_eq!(received.len(), 5);
    let key = std::env::var("CARGO_PKG_NAME").unwrap();
    for r in &received {
        assert_eq!(r.path, "/v1/messages");
        assert_eq!(r.header("anthropic-version"), Some("2023-06-01"));
        assert_eq!(r.header("x-api-key"), Some(key.as_str()));
        assert!(
            r.header("authorization").is_none(),
            "Messages takes x-api-key"
        );
        check_messages_body(r);
    }
}

fn check_messages_body(r: &Received) {
    let b = &r.body;
    assert!(b["max_tokens"].as_u64().is_some_and(|n| n > 0), "{b}");
    assert_eq!(b["stream"], true);
    assert_eq!(b["system"], "You are a test.");
    assert_eq!(b["tools"][0]["name"], "bash");
    assert!(b["tools"][0]["input_schema"].is_object());
    let turns = b["messages"].as_array().unwrap();
    assert_eq!(turns[0]["role"], "user", "{b}");
    let mut open: HashSet<String> = HashSet::new();
    for (i, t) in turns.iter().enumerate() {
        let role = t["role"].as_str().unwrap();
        assert_eq!(role, if i % 2 == 0 { "user" } else { "assistant" }, "{b}");
        for block in t["content"].as_array().unwrap() {
            match block["type"].as_str().unwrap() {
                "tool_use" => {
                    assert_eq!(role, "assistant");
                    assert!(block["input"].is_object(), "{block}");
                    open.insert(block["id"].as_str().unwrap().to_owned());
                }
                "tool_result" => {
                    assert_eq!(role, "user");
                    let id = block["tool_use_id"].as_str().unwrap();
                    assert!(
                        open.remove(id),
                        "tool_result {id} answers no earlier tool_use: {b}"
                    );
                }
                "thinking" => assert_eq!(role, "assistant"),
                "text" => {}
                other => panic!("unexpected block {other}"),
            }
        }
    }
    assert_eq!(turns.last().unwrap()["role"], "user");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_requests_pair_function_calls_with_outputs_and_are_stateless() {
    let server = wire_server::start(FIRST_DELAY).await;
    let (summary, _out) = replay(&server, with_api(Api::Responses)).await;
    assert_eq!(summary.turns_ok, 5, "{summary:?}");
    for r in server.received() {
        assert_eq!(r.path, "/v1/responses");
        let b = &r.body;
        assert_eq!(b["store"], false);
        assert!(b.get("previous_response_id").is_none());
        assert_eq!(b["instructions"], "You are a test.");
        assert!(b["max_output_tokens"].as_u64().is_some_and(|n| n > 0));
        assert_eq!(b["tools"][0]["type"], "function");
        assert_eq!(b["tools"][0]["name"], "bash");
        let items = b["input"].as_array().unwrap();
        assert_eq!(items[0]["type"], "message");
        assert_eq!(items[0]["role"], "user");
        let mut calls: HashSet<String> = HashSet::new();
        for item in items {
            match item["type"].as_str().unwrap() {
                "function_call" => {
                    assert!(item["arguments"].is_string());
                    calls.insert(item["call_id"].as_str().unwrap().to_owned());
                }
                "function_call_output" => {
                    let id = item["call_id"].as_str().unwrap();
                    assert!(calls.remove(id), "output {id} answers no earlier call: {b}");
                }
                "message" | "reasoning" => {}
                other => panic!("unexpected item {other}"),
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttft_is_the_first_delta_not_the_preamble_and_tokens_come_from_usage() {
    let server = wire_server::start(FIRST_DELAY).await;
    for api in [Api::Messages, Api::Responses] {
        let (summary, out) = replay(&server, with_api(api)).await;
        assert_eq!(summary.turns_ok, 5, "{api:?}: {summary:?}");
        assert!(!summary.tokens_estimated, "{api:?}: counts come from usage");
        let ttfts = ttfts_ns(out.path());
        assert_eq!(ttfts.len(), 5, "{api:?}: one RECV_FIRST per turn");
        for t in ttfts {
            assert!(
                t >= FIRST_DELAY.as_nanos() as u64,
                "{api:?}: TTFT {t} ns is before the first delta"
            );
        }
        let summary_json: Value = serde_json::from_str(
            &std::fs::read_to_string(out.path().join("result_summary.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(
            summary_json["osl_mean"]["all_completed"].as_f64(),
            Some(OUTPUT_TOKENS as f64),
            "{api:?}: output tokens are usage's, not a count of deltas"
        );
        let isl = summary_json["input_sequence_lengths"]["avg"].as_f64();
        assert_eq!(
            isl,
            Some(INPUT_TOKENS as f64),
            "{api:?}: prompt tokens from usage"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chained_turn_names_the_previous_response_and_sends_only_new_items() {
    let server = wire_server::start(FIRST_DELAY).await;
    let mut cfg = with_api(Api::Responses);
    cfg.responses_chain = true;
    cfg.concurrency = 1;
    let (summary, _out) = replay(&server, cfg).await;
    assert_eq!(summary.turns_ok, 5, "{summary:?}");
    let received = server.received();
    // conv-a: turns 1..3, then conv-b: turns 1..2 (one slot).
    let firsts = [0, 3];
    for (i, r) in received.iter().enumerate() {
        let b = &r.body;
        assert_eq!(b["store"], true);
        assert_eq!(b["instructions"], "You are a test.");
        if firsts.contains(&i) {
            assert!(b.get("previous_response_id").is_none(), "{b}");
            assert_eq!(b["input"][0]["role"], "user");
            continue;
        }
        assert_eq!(b["previous_response_id"], format!("resp_{i}"), "{b}");
        assert_eq!(
            b["input"],
            json!([{"type": "function_call_output", "call_id": format!("call_live_{i}"),
                "output": format!("out {}", if i < 3 { i } else { i - 3 })}]),
            "only the new tool output, answering the stored response's call"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chained_turn_the_server_lost_fails_with_its_reason() {
    let server = wire_server::start(Duration::ZERO).await;
    let mut cfg = with_api(Api::Responses);
    cfg.responses_chain = true;
    cfg.concurrency = 1;
    cfg.num_trajectories = Some(1);
    // The first turn's response is stored; the server has lost it when the second arrives.
    server.forget_responses_after(1);
    let out = tempfile::tempdir().unwrap();
    let ds = dataset(vec![conversation("conv-a", 2, &[], "ls")]);
    cfg.target = server.url().as_str().into();
    let summary = agentrace::replay::run(cfg, ds, out.path(), no_shutdown())
        .await
        .unwrap();
    assert_eq!((summary.turns_ok, summary.failures), (1, 1), "{summary:?}");
    assert_eq!(
        server.received()[1].body["previous_response_id"],
        "resp_1",
        "the failed turn was a chained one"
    );
    let errors = error_messages(out.path());
    assert!(
        errors
            .iter()
            .any(|e| e.contains("previous_response_not_found")),
        "{errors:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_error_body_becomes_a_failed_turn_with_its_reason() {
    let server = wire_server::start(Duration::ZERO).await;
    server.fail_with(
        529,
        json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
    );
    let (summary, out) = replay(&server, with_api(Api::Messages)).await;
    assert_eq!(summary.turns_ok, 0);
    let errors = error_messages(out.path());
    assert!(
        errors
            .iter()
            .any(|e| e.contains("HTTP 529: overloaded_error: Overloaded")),
        "{errors:?}"
    );
}

#[test]
fn official_runs_refuse_an_api_other_than_chat() {
    let mut cfg = config("http://127.0.0.1:9", 1);
    cfg.official_rules = true;
    cfg.api = Api::Messages;
    let e = cfg.validate().unwrap_err().to_string();
    assert!(e.starts_with("api:") && e.contains("official"), "{e}");
    cfg.api = Api::Chat;
    cfg.validate().unwrap();
    cfg.official_rules = false;
    cfg.responses_chain = true;
    let e = cfg.validate().unwrap_err().to_string();
    assert!(e.starts_with("responses_chain:"), "{e}");
}

/// The first `n` conversations of the public sample, each cut to its first `turns` turns.
fn sample_prefix(
    test: &str,
    n: usize,
    turns: usize,
) -> Option<std::sync::Arc<agentrace::dataset::Dataset>> {
    let path = support::dataset::sample_path(test)?;
    let mut ds = agentrace::dataset::load(&path, &Default::default()).unwrap();
    ds.conversations.truncate(n);
    for conv in &mut ds.conversations {
        let mut c = (**conv).clone();
        c.client_turns.truncate(turns);
        *conv = std::sync::Arc::new(c);
    }
    Some(std::sync::Arc::new(ds))
}

// The same few trajectories of the public sample, replayed against llama.cpp's llama-server
// in each API it routes: every turn succeeds in each, with the server's own usage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sample_replays_against_llama_server_in_every_api() {
    const TEST: &str = "the_sample_replays_against_llama_server_in_every_api";
    let Some((server, model)) = support::engine::artefacts(TEST) else {
        return;
    };
    let Some(ds) = sample_prefix(TEST, 3, 3) else {
        return;
    };
    let engine = support::engine::Engine::start(&server, &model, 2).await;
    let turns: u64 = ds
        .conversations
        .iter()
        .map(|c| c.client_turns.len() as u64)
        .sum();
    for api in [Api::Chat, Api::Messages, Api::Responses] {
        let cfg = ReplayConfig {
            target: engine.url().as_str().into(),
            api,
            model_params: Some(agentrace::dataset::ModelParams {
                name: "tiny".into(),
                max_new_tokens: Some(8),
                temperature: Some(0.0),
                ..Default::default()
            }),
            ..config("http://unused", 2)
        };
        let out = tempfile::tempdir().unwrap();
        let s = agentrace::replay::run(cfg, ds.clone(), out.path(), no_shutdown())
            .await
            .unwrap();
        assert_eq!(
            (s.turns_ok, s.failures),
            (turns, 0),
            "{api:?}: {:?}",
            error_messages(out.path())
        );
        assert!(!s.tokens_estimated, "{api:?}: usage missing");
        assert_eq!(
            ttfts_ns(out.path()).len() as u64,
            turns,
            "{api:?}: a first token per turn"
        );
    }
}
