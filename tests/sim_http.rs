//! Invariants of the simulator's HTTP surface: the exact OpenAI SSE sequence and usage chunk,
//! streamed tool calls that assemble into schema-valid calls, errors as HTTP statuses before
//! the first token, fault flags, vLLM metric names, the small endpoints, the oracle
//! responder, and configuration files.

mod support;

use std::sync::Arc;
use std::time::Duration;

use agentrace::dataset::{
    ClientTurn, Conversation, Dataset, ExpectedReply, HistoryMessage, RecordedReply,
};
use agentrace::sim::{self, MidStreamFault, Oracle, ResponderKind, SimConfig};
use serde_json::{json, Value};
use support::sim::*;

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

/// Exact SSE sequence: role chunk, one delta per token, finish chunk, usage chunk, `[DONE]`,
/// each event alone in its frame, on one line, with `"usage":null` on choice chunks.
#[tokio::test(start_paused = true)]
async fn stream_is_the_exact_openai_chunk_sequence_one_event_per_frame() {
    let sim = Sim::start(test_config(), 1);
    let mut body = stream_body(user("Say something."), 6);
    body["chat_template_kwargs"] = json!({"enable_thinking": false});
    let r = chat(sim.addr(0), &body).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.headers["content-type"], "text/event-stream");
    assert_eq!(r.pod(), "sim-0");
    for f in &r.frames {
        let s = std::str::from_utf8(f).unwrap();
        assert!(
            s.starts_with("data: ") && s.ends_with("\n\n") && s.matches('\n').count() == 2,
            "frame {s:?}"
        );
    }
    let events = r.events();
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    let id = first["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-"));
    let envelope = format!(
        r#"{{"id":"{id}","object":"chat.completion.chunk","created":1700000000,"model":"m","choices":"#
    );
    assert_eq!(
        events[0],
        format!(
            r#"{envelope}[{{"index":0,"delta":{{"role":"assistant","content":""}},"logprobs":null,"finish_reason":null}}],"usage":null}}"#
        )
    );
    let tokens = &events[1..events.len() - 3];
    assert_eq!(tokens.len(), 6);
    for e in tokens {
        assert!(e.starts_with(&envelope), "{e}");
        let v: Value = serde_json::from_str(e).unwrap();
        let delta = v["choices"][0]["delta"].as_object().unwrap();
        assert_eq!(delta.keys().collect::<Vec<_>>(), ["content"]);
        assert!(v["choices"][0]["finish_reason"].is_null() && v["usage"].is_null());
    }
    assert_eq!(
        events[events.len() - 3],
        format!(
            r#"{envelope}[{{"index":0,"delta":{{}},"logprobs":null,"finish_reason":"length"}}],"usage":null}}"#
        )
    );
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(usage["choices"], json!([]));
    let u = &usage["usage"];
    assert_eq!(u["completion_tokens"], 6);
    assert_eq!(u["total_tokens"], u["prompt_tokens"].as_u64().unwrap() + 6);
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(events.last().unwrap(), "[DONE]");

    // Without include_usage: no usage chunk and no usage key on chunks.
    let mut plain = body.clone();
    plain.as_object_mut().unwrap().remove("stream_options");
    let r = chat(sim.addr(0), &plain).await;
    assert!(!String::from_utf8(r.body()).unwrap().contains("usage"));
    assert_eq!(r.events().len(), 1 + 6 + 1 + 1);

    // Non-streaming: one chat.completion with usage and cached_tokens always present.
    plain["stream"] = json!(false);
    let r = chat(sim.addr(0), &plain).await;
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert!(v["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64());
    sim.stop().await;
}

/// Reasoning streams as `reasoning_content` deltas before the content.
#[tokio::test(start_paused = true)]
async fn reasoning_deltas_come_before_content() {
    let sim = Sim::start(test_config(), 1);
    let r = chat(sim.addr(0), &stream_body(user("Think first."), 40)).await;
    let kinds: Vec<String> = r
        .json_events()
        .iter()
        .filter_map(|e| {
            e["choices"][0]["delta"]
                .as_object()
                .and_then(|d| d.keys().next().cloned())
        })
        .filter(|k| k != "role")
        .collect();
    let first_content = kinds.iter().position(|k| k == "content").unwrap();
    assert!(
        first_content > 0
            && kinds[..first_content]
                .iter()
                .all(|k| k == "reasoning_content")
    );
    assert!(kinds[first_content..].iter().all(|k| k == "content"));
    sim.stop().await;
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "bash", "description": "Run", "parameters": {"type": "object",
            "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}}, "required": ["command"]}}},
        {"type": "function", "function": {"name": "edit", "parameters": {"type": "object",
            "properties": {"path": {"type": "string"}, "mode": {"enum": ["replace", "append"]},
                "lines": {"type": "array", "items": {"type": "integer"}}, "dry": {"type": "boolean"}},
            "required": ["path", "mode", "lines", "dry"]}}}
    ])
}

/// Assembles streamed tool-call deltas by index, as the MLPerf client does.
fn assemble_tool_calls(events: &[Value]) -> Vec<(String, String, String)> {
    let mut calls: Vec<(String, String, String)> = Vec::new();
    for e in events {
        let Some(deltas) = e["choices"][0]["delta"]["tool_calls"].as_array() else {
            continue;
        };
        for d in deltas {
            let i = d["index"].as_u64().unwrap() as usize;
            if calls.len() <= i {
                calls.resize(i + 1, Default::default());
            }
            if let Some(id) = d["id"].as_str() {
                calls[i].0 = id.to_string();
            }
            if let Some(name) = d["function"]["name"].as_str() {
                calls[i].1 = name.to_string();
            }
            calls[i]
                .2
                .push_str(d["function"]["arguments"].as_str().unwrap_or(""));
        }
    }
    calls
}

/// Streamed tool calls: the first delta carries id, type and name; argument fragments follow;
/// assembled, the arguments are JSON valid against the function's schema, and the stream
/// ends with `tool_calls`.
#[tokio::test(start_paused = true)]
async fn streamed_tool_call_deltas_assemble_into_schema_valid_calls() {
    let sim = Sim::start(test_config(), 1);
    for (choice, want) in [
        (
            json!({"type": "function", "function": {"name": "edit"}}),
            "edit",
        ),
        (json!("required"), ""),
    ] {
        let mut body = stream_body(user("Fix it."), 500);
        body["tools"] = tools();
        body["tool_choice"] = choice;
        let r = chat(sim.addr(0), &body).await;
        let events = r.json_events();
        let calls = assemble_tool_calls(&events);
        assert_eq!(calls.len(), 1);
        let (id, name, args) = &calls[0];
        assert!(id.starts_with("call_") && id.len() == 21, "{id}");
        if !want.is_empty() {
            assert_eq!(name, want);
        }
        let args: Value = serde_json::from_str(args).unwrap();
        match name.as_str() {
            "bash" => assert_eq!(args, json!({"command": "example"})),
            "edit" => assert_eq!(
                args,
                json!({"path": "example", "mode": "replace", "lines": [1], "dry": true})
            ),
            other => panic!("unexpected tool {other}"),
        }
        let finish = events
            .iter()
            .find_map(|e| e["choices"][0]["finish_reason"].as_str())
            .unwrap();
        assert_eq!(finish, "tool_calls");
        let first = events
            .iter()
            .find(|e| !e["choices"][0]["delta"]["tool_calls"].is_null())
            .unwrap();
        assert_eq!(
            first["choices"][0]["delta"]["tool_calls"][0]["type"],
            "function"
        );
        assert_eq!(
            first["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"],
            ""
        );
    }
    // tool_choice none never calls.
    let mut body = stream_body(user("Fix it."), 500);
    body["tools"] = tools();
    body["tool_choice"] = json!("none");
    let r = chat(sim.addr(0), &body).await;
    assert!(assemble_tool_calls(&r.json_events()).is_empty());
    sim.stop().await;
}

/// Bad requests get a 400 with an OpenAI-style error body; unknown fields are ignored;
/// every response, errors included, names the replica.
#[tokio::test(start_paused = true)]
async fn bad_requests_get_openai_style_400s_and_unknown_fields_are_ignored() {
    let sim = Sim::start(test_config(), 1);
    let addr = sim.addr(0);
    for body in [
        &b"{not json"[..],
        br#"{"model":"m"}"#,
        br#"{"messages":"hi"}"#,
        br#"{"messages":[]}"#,
        br#"[1,2]"#,
    ] {
        let r = request(addr, "POST", "/v1/chat/completions", body.to_vec(), &[]).await;
        assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(body));
        let e = r.json();
        assert_eq!(e["error"]["type"], "invalid_request_error");
        assert_eq!(e["error"]["code"], 400);
        assert!(e["error"]["message"].as_str().unwrap().len() > 5);
        assert_eq!(r.pod(), "sim-0");
    }
    let r = post(addr, "/v1/completions", &json!({"model": "m"})).await;
    assert_eq!(r.status, 400);
    let r = chat(addr, &json!({"messages": [{"role": "user", "content": "x", "extra": 1}], "whatever": {"a": 1}, "n": 1})).await;
    assert_eq!(r.status, 200);
    let r = get(addr, "/nope").await;
    assert_eq!((r.status, r.pod()), (404, "sim-0".to_string()));
    // A prompt that can never fit the KV pool is refused up front.
    let mut cfg = test_config();
    cfg.engine.num_gpu_blocks = 8;
    let small = Sim::start(cfg, 1);
    let r = chat(small.addr(0), &stream_body(long_messages("big", 400), 4)).await;
    assert_eq!(r.status, 400);
    // The refusal names the flag that fixes it, with a size that would hold this request.
    let message = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(message.contains("KV capacity"), "{message}");
    let needed: usize = message
        .split("--num-gpu-blocks ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no --num-gpu-blocks size in {message:?}"));
    assert!(needed > 8, "{message}");
    small.stop().await;
    let mut cfg = test_config();
    cfg.engine.num_gpu_blocks = needed;
    let sized = Sim::start(cfg, 1);
    let r = chat(sized.addr(0), &stream_body(long_messages("big", 400), 4)).await;
    assert_eq!(
        r.status, 200,
        "the size the message named must hold the request"
    );
    sized.stop().await;
    sim.stop().await;
}

/// Faults: `fail_rate` is an HTTP 500 before any token; `fail_mid_stream_rate` cuts a stream
/// after some tokens with an error event and `[DONE]` (or a cut connection); `hang_rate`
/// never answers; `max_queue` answers 503 with Retry-After once the queue is full;
/// `fail_status` picks the status and `extra_delay_ms` delays the first token.
#[tokio::test(start_paused = true)]
async fn fault_flags_fail_cut_hang_and_shed_as_configured() {
    let with = |f: &dyn Fn(&mut SimConfig)| {
        let mut c = test_config();
        f(&mut c);
        Sim::start(c, 1)
    };
    let body = stream_body(user("hello"), 20);

    let sim = with(&|c| c.faults.fail_rate = 1.0);
    let r = chat(sim.addr(0), &body).await;
    assert_eq!(r.status, 500);
    assert_eq!(r.json()["error"]["code"], 500);
    sim.stop().await;

    let sim = with(&|c| {
        c.faults.fail_rate = 1.0;
        c.faults.fail_status = 429;
    });
    assert_eq!(chat(sim.addr(0), &body).await.status, 429);
    sim.stop().await;

    // An extra delay postpones the first token by that much simulated time.
    let base = with(&|_| {});
    let slow = with(&|c| c.faults.extra_delay_ms = 500.0);
    let fast_r = chat(base.addr(0), &body).await;
    let slow_r = chat(slow.addr(0), &body).await;
    let extra = slow_r.ttft().as_secs_f64() - fast_r.ttft().as_secs_f64();
    assert!((0.499..0.502).contains(&extra), "extra delay {extra}");
    base.stop().await;
    slow.stop().await;

    let sim = with(&|c| c.faults.fail_mid_stream_rate = 1.0);
    let r = chat(sim.addr(0), &body).await;
    assert_eq!(r.status, 200);
    let events = r.events();
    assert_eq!(events.last().unwrap(), "[DONE]");
    let err: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(err["error"]["code"], 500);
    assert!(events.len() >= 4, "some tokens came first");
    assert!(!events.iter().any(|e| e.contains("\"finish_reason\":\"")));
    sim.stop().await;

    let sim = with(&|c| {
        c.faults.fail_mid_stream_rate = 1.0;
        c.faults.mid_stream = MidStreamFault::Abort;
    });
    let r = chat(sim.addr(0), &body).await;
    assert!(r.body_error.is_some());
    assert!(!r.events().contains(&"[DONE]".to_string()));
    sim.stop().await;

    let sim = with(&|c| c.faults.hang_rate = 1.0);
    let hung = tokio::time::timeout(Duration::from_secs(600), chat(sim.addr(0), &body)).await;
    assert!(hung.is_err());
    sim.stop().await;

    let sim = with(&|c| {
        c.faults.max_queue = 1;
        c.engine.max_num_seqs = 1;
    });
    let addr = sim.addr(0);
    let tasks: Vec<_> = (0..5)
        .map(|i| {
            tokio::spawn(async move { chat(addr, &stream_body(user(&format!("q{i}")), 20)).await })
        })
        .collect();
    let mut statuses = Vec::new();
    for t in tasks {
        let r = t.await.unwrap();
        if r.status == 503 {
            assert_eq!(r.headers["retry-after"], "1");
        }
        statuses.push(r.status);
    }
    assert!(
        statuses.contains(&200) && statuses.contains(&503),
        "{statuses:?}"
    );
    sim.stop().await;
}

/// Metrics carry vLLM's names, agree with the cluster's stats, and are per replica.
#[tokio::test(start_paused = true)]
async fn metrics_use_vllm_names_and_belong_to_their_replica() {
    let sim = Sim::start(test_config(), 2);
    for _ in 0..2 {
        chat(sim.addr(0), &stream_body(long_messages("m", 200), 8)).await;
    }
    let text = String::from_utf8(get(sim.addr(0), "/metrics").await.body()).unwrap();
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_preemptions_total",
        "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_sum",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_queue_time_seconds_bucket",
        "vllm:request_prefill_time_seconds_count",
        "vllm:request_decode_time_seconds_count",
        "vllm:cache_config_info",
    ] {
        assert!(text.contains(&format!("{name}{{")), "{name} missing");
    }
    let stats = sim.cluster.stats();
    assert_eq!(
        metric(&text, "vllm:prefix_cache_hits_total"),
        stats[0].prefix_cache_hits as f64
    );
    assert_eq!(
        metric(&text, "vllm:prefix_cache_queries_total"),
        stats[0].prefix_cache_queries as f64
    );
    assert_eq!(metric(&text, "vllm:generation_tokens_total"), 16.0);
    assert_eq!(metric(&text, "vllm:e2e_request_latency_seconds_count"), 2.0);
    assert!(stats[0].prefix_cache_hits > 0);
    assert!(!text.contains("vllm:gpu_cache_usage_perc"));
    let other = String::from_utf8(get(sim.addr(1), "/metrics").await.body()).unwrap();
    assert_eq!(metric(&other, "vllm:prompt_tokens_total"), 0.0);
    assert_eq!(stats[1].requests, 0);
    sim.stop().await;
    let legacy = Sim::start(
        SimConfig {
            legacy_metrics: true,
            ..test_config()
        },
        1,
    );
    let text = String::from_utf8(get(legacy.addr(0), "/metrics").await.body()).unwrap();
    assert_eq!(metric(&text, "vllm:gpu_cache_usage_perc"), 0.0);
    legacy.stop().await;
}

/// The small endpoints: models, health, reset of the prefix cache, text completions; and
/// each replica of a port-0 cluster has its own port and name.
#[tokio::test(start_paused = true)]
async fn models_health_reset_and_completions_endpoints_work() {
    let sim = Sim::start(test_config(), 3);
    let addrs = sim.cluster.addrs();
    assert_eq!(sim.cluster.replica_names(), ["sim-0", "sim-1", "sim-2"]);
    assert!(addrs[0] != addrs[1] && addrs[1] != addrs[2] && addrs[0] != addrs[2]);
    for (i, addr) in addrs.iter().enumerate() {
        assert_eq!(get(*addr, "/v1/models").await.pod(), format!("sim-{i}"));
    }
    let models = get(addrs[0], "/v1/models").await.json();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "qwen3-30b-a3b");
    assert_eq!(models["data"][0]["object"], "model");
    let health = get(addrs[0], "/health").await;
    assert_eq!(health.status, 200);

    let body = stream_body(long_messages("reset", 300), 4);
    chat(addrs[0], &body).await;
    assert!(chat(addrs[0], &body).await.cached_tokens() > 0);
    assert_eq!(
        request(addrs[0], "POST", "/reset_prefix_cache", Vec::new(), &[])
            .await
            .status,
        200
    );
    assert_eq!(chat(addrs[0], &body).await.cached_tokens(), 0);

    let r = post(
        addrs[1],
        "/v1/completions",
        &json!({"prompt": "Once upon", "max_tokens": 5, "stream": true,
        "stream_options": {"include_usage": true}}),
    )
    .await;
    let events = r.json_events();
    assert!(events.iter().all(|e| e["object"] == "text_completion"));
    assert_eq!(
        events
            .iter()
            .filter(|e| e["choices"][0]["text"]
                .as_str()
                .is_some_and(|t| !t.is_empty()))
            .count(),
        5
    );
    assert_eq!(r.usage()["completion_tokens"], 5);
    let r = post(
        addrs[1],
        "/v1/completions",
        &json!({"prompt": ["Once ", "upon"], "max_tokens": 3}),
    )
    .await;
    assert_eq!(r.json()["choices"][0]["finish_reason"], "length");
    sim.stop().await;
}

/// Every example config parses and validates; unknown fields and bad values are errors that
/// name the field and the value.
#[test]
fn config_files_parse_and_errors_name_field_and_value() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/config");
    let mut seen = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if name.starts_with("sim-") && name.ends_with(".toml") {
            let cfg = SimConfig::from_file(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
            cfg.validate().unwrap_or_else(|e| panic!("{name}: {e}"));
            seen += 1;
        }
    }
    assert!(seen >= 2, "example configs found: {seen}");
    let h200 = SimConfig::from_toml_str(
        "profile = \"h200-qwen3-30b-a3b-fp8\"\n[engine]\nnum_gpu_blocks = 6000\n",
        "x.toml",
    )
    .unwrap();
    assert_eq!(h200.engine.num_gpu_blocks, 6000);
    assert_eq!(h200.engine.max_num_seqs, 128);
    let err = SimConfig::from_toml_str("[engine]\nblok_size = 16\n", "bad.toml")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("bad.toml") && err.contains("blok_size"),
        "{err}"
    );
    let c = SimConfig {
        time_scale: 0.0,
        ..SimConfig::default()
    };
    assert_eq!(
        c.validate().unwrap_err().to_string(),
        "time_scale: must be > 0, got 0"
    );
    let mut c = SimConfig::default();
    c.faults.fail_rate = 1.5;
    assert_eq!(
        c.validate().unwrap_err().to_string(),
        "faults.fail_rate: must be in [0, 1], got 1.5"
    );
    assert!(SimConfig::from_profile("a100")
        .unwrap_err()
        .to_string()
        .contains("a100"));
}

fn wire(v: Value) -> HistoryMessage {
    let role = serde_json::from_value(v["role"].clone()).unwrap();
    HistoryMessage {
        role,
        wire: serde_json::value::RawValue::from_string(v.to_string()).unwrap(),
    }
}

/// A two-turn conversation built in the test: a tool-call reply, then a content reply.
fn tiny_dataset() -> Dataset {
    let calls = json!([{"id": "functions.bash:0", "type": "function", "function": {"name": "bash", "arguments": "{\"command\":\"ls -la\"}"}}]);
    let messages = vec![
        wire(json!({"role": "system", "content": "You are a coding agent."})),
        wire(json!({"role": "user", "content": "List the files."})),
        wire(
            json!({"role": "assistant", "tool_calls": calls, "reasoning_content": "Look first.", "content": null}),
        ),
        wire(json!({"role": "tool", "content": "a.rs b.rs", "tool_call_id": "functions.bash:0"})),
        wire(json!({"role": "assistant", "content": "There are two files."})),
    ];
    let turn = |turn, history_len, expected| ClientTurn {
        turn,
        history_len,
        delay_seconds: 0.0,
        overrides: Default::default(),
        expected: Some(expected),
    };
    Dataset {
        path: "tiny.jsonl".into(),
        sha256: String::new(),
        conversations: vec![Arc::new(Conversation {
            id: "conv-1".into(),
            messages,
            client_turns: vec![
                turn(
                    1,
                    2,
                    ExpectedReply {
                        turn: 2,
                        message: 2,
                        tool_calls: Some(serde_json::value::to_raw_value(&calls).unwrap()),
                        ..Default::default()
                    },
                ),
                turn(
                    3,
                    4,
                    ExpectedReply {
                        turn: 4,
                        message: 4,
                        ..Default::default()
                    },
                ),
            ],
        })],
    }
}

fn oracle_sim(dataset: Dataset, accuracy: f64) -> (Sim, Arc<Oracle>) {
    let oracle = Arc::new(Oracle::new(Arc::new(dataset)).unwrap());
    let mut cfg = test_config();
    cfg.responder.kind = ResponderKind::Oracle;
    cfg.responder.oracle_accuracy = accuracy;
    let (trigger, shutdown) = agentrace::shutdown::channel();
    let cluster = sim::start_with_oracle(
        cfg,
        "127.0.0.1:0".parse().unwrap(),
        1,
        shutdown,
        Some(oracle.clone()),
    )
    .unwrap();
    (Sim::from_parts(cluster, trigger), oracle)
}

/// The oracle recognises a replayed turn by its history, salts ignored, and answers with the
/// recorded reply (reasoning, content, tool calls, its length); at accuracy 0 it answers
/// wrongly in the same shape; an unknown history gets a synthetic reply.
#[tokio::test(start_paused = true)]
async fn oracle_answers_recorded_turns_and_falls_back_to_synthetic() {
    let (sim, oracle) = oracle_sim(tiny_dataset(), 1.0);
    assert_eq!(oracle.len(), 2);
    let salted = json!({"role": "system", "content": "[salt: 4461]\n\nYou are a coding agent.\n\n[salt: edc0]"});
    let turn1 = json!([salted, {"role": "user", "content": "List the files."}]);
    let mut body = stream_body(turn1.clone(), 8192);
    body["tools"] = tools();
    let r = chat(sim.addr(0), &body).await;
    let calls = assemble_tool_calls(&r.json_events());
    assert_eq!(
        calls,
        [(
            "functions.bash:0".to_string(),
            "bash".to_string(),
            "{\"command\":\"ls -la\"}".to_string()
        )]
    );
    let reasoning: String = r
        .json_events()
        .iter()
        .filter_map(|e| {
            e["choices"][0]["delta"]["reasoning_content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert_eq!(reasoning, "Look first.");
    // 3 tokens of reasoning, 3 for the call header, 5 argument fragments.
    assert_eq!(r.usage()["completion_tokens"], 3 + 3 + 5);

    let turn2 = json!([salted, {"role": "user", "content": "List the files."},
        {"role": "assistant", "tool_calls": [{"id": "functions.bash:0", "type": "function", "function": {"name": "bash", "arguments": "{\"command\":\"ls -la\"}"}}], "reasoning_content": "Look first."},
        {"role": "tool", "content": "a.rs b.rs", "tool_call_id": "functions.bash:0"}]);
    let r = chat(sim.addr(0), &json!({"messages": turn2, "stream": false})).await;
    assert_eq!(
        r.json()["choices"][0]["message"]["content"],
        "There are two files."
    );
    assert_eq!(r.json()["choices"][0]["finish_reason"], "stop");

    let r = chat(
        sim.addr(0),
        &json!({"messages": user("Something else."), "stream": false, "max_tokens": 7}),
    )
    .await;
    assert_ne!(
        r.json()["choices"][0]["message"]["content"],
        "There are two files."
    );
    assert_eq!(r.json()["usage"]["completion_tokens"], 7);
    sim.stop().await;

    let (sim, _) = oracle_sim(tiny_dataset(), 0.0);
    let r = chat(sim.addr(0), &body).await;
    let calls = assemble_tool_calls(&r.json_events());
    assert_eq!(calls[0].1, "bash");
    assert_ne!(calls[0].2, "{\"command\":\"ls -la\"}");
    assert!(serde_json::from_str::<Value>(&calls[0].2)
        .unwrap()
        .is_object());
    sim.stop().await;
}

/// The CLI: bad flags exit with the configuration error code and a message naming the field;
/// a valid command serves every replica on its own port until SIGTERM, then exits cleanly.
#[test]
fn cli_rejects_bad_flags_and_serves_until_sigterm() {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::process::{Command, Stdio};
    let bin = env!("CARGO_BIN_EXE_agentrace");
    let out = Command::new(bin)
        .args(["sim", "--time-scale", "0", "--listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("time_scale: must be > 0, got 0"));

    let mut child = Command::new(bin)
        .args([
            "--log-format",
            "json",
            "sim",
            "--replicas",
            "2",
            "--listen",
            "127.0.0.1:0",
            "--time-scale",
            "0.01",
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut addrs = Vec::new();
    while addrs.len() < 2 {
        let line = lines.next().expect("a log line").unwrap();
        let v: Value = serde_json::from_str(&line).unwrap();
        if let Some(addr) = v["fields"]["addr"].as_str() {
            addrs.push(addr.to_string());
        }
    }
    assert_ne!(addrs[0], addrs[1]);
    for (i, addr) in addrs.iter().enumerate() {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .unwrap();
        let mut resp = String::new();
        s.read_to_string(&mut resp).unwrap();
        assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
        assert!(
            resp.contains(&format!("x-inference-pod: sim-{i}")),
            "{resp}"
        );
    }
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = child.wait().unwrap();
    assert!(status.success(), "exit after SIGTERM: {status:?}");
}

/// Reasoning, content and tool calls `(id, name, arguments)` of a reply, streamed or not.
fn reply_parts(r: &Reply) -> (String, String, Vec<(String, String, String)>, String) {
    if r.headers["content-type"] == "text/event-stream" {
        let events = r.json_events();
        let text = |key: &str| -> String {
            events
                .iter()
                .filter_map(|e| e["choices"][0]["delta"][key].as_str().map(str::to_string))
                .collect()
        };
        let finish = events
            .iter()
            .find_map(|e| e["choices"][0]["finish_reason"].as_str())
            .unwrap_or("")
            .to_string();
        (
            text("reasoning_content"),
            text("content"),
            assemble_tool_calls(&events),
            finish,
        )
    } else {
        let v = r.json();
        let m = &v["choices"][0]["message"];
        let calls = m["tool_calls"]
            .as_array()
            .map(|calls| {
                calls
                    .iter()
                    .map(|c| {
                        let s = |v: &Value| v.as_str().unwrap_or("").to_string();
                        (
                            s(&c["id"]),
                            s(&c["function"]["name"]),
                            s(&c["function"]["arguments"]),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        let s = |v: &Value| v.as_str().unwrap_or("").to_string();
        (
            s(&m["reasoning_content"]),
            s(&m["content"]),
            calls,
            s(&v["choices"][0]["finish_reason"]),
        )
    }
}

/// True when a reply is exactly the recorded one.
fn matches_expected(r: &Reply, expected: &RecordedReply) -> bool {
    let (reasoning, content, calls, finish) = reply_parts(r);
    let want_calls: Vec<(String, String, String)> = expected
        .tool_calls
        .as_ref()
        .and_then(Value::as_array)
        .map(|calls| {
            calls
                .iter()
                .map(|c| {
                    let args = match &c["function"]["arguments"] {
                        Value::String(s) => s.clone(),
                        other => other.to_string(),
                    };
                    (
                        c["id"].as_str().unwrap().to_string(),
                        c["function"]["name"].as_str().unwrap().to_string(),
                        args,
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    let want_finish = if want_calls.is_empty() {
        "stop"
    } else {
        "tool_calls"
    };
    reasoning == expected.reasoning_content.clone().unwrap_or_default()
        && content == expected.content.clone().unwrap_or_default()
        && calls == want_calls
        && finish == want_finish
}

/// The oracle on the public sample: turns built by the dataset's request builder and salted
/// as the reference does (any repeat) are recognised and answered with their recorded
/// reply; at accuracy 0.5 about half of the answers are right, and the wrong ones differ.
#[tokio::test(start_paused = true)]
async fn oracle_replays_recorded_replies_of_salted_sample_turns() {
    use agentrace::dataset::{LoadOptions, ModelParams, RequestBuilder, Salt};
    let Some(path) =
        support::dataset::sample_path("oracle_replays_recorded_replies_of_salted_sample_turns")
    else {
        return;
    };
    let dataset = Arc::new(agentrace::dataset::load(&path, &LoadOptions::default()).unwrap());
    let with_reply: usize = dataset
        .conversations
        .iter()
        .map(|c| {
            c.client_turns
                .iter()
                .filter(|t| t.expected.is_some())
                .count()
        })
        .sum();
    let builder = RequestBuilder::new(ModelParams::preset("qwen3.6-35b-a3b").unwrap(), true);
    for (accuracy, repeat) in [(1.0, 1), (0.5, 3)] {
        let oracle = Arc::new(Oracle::new(dataset.clone()).unwrap());
        assert_eq!(oracle.len(), with_reply);
        let mut cfg = test_config();
        cfg.engine.num_gpu_blocks = 50_000;
        cfg.responder.oracle_accuracy = accuracy;
        let (trigger, shutdown) = agentrace::shutdown::channel();
        let cluster = sim::start_with_oracle(
            cfg,
            "127.0.0.1:0".parse().unwrap(),
            1,
            shutdown,
            Some(oracle),
        )
        .unwrap();
        let sim = Sim::from_parts(cluster, trigger);
        let (mut asked, mut right) = (0, 0);
        for conv in &dataset.conversations {
            let salt = Salt::new(repeat, &conv.id);
            for turn in conv
                .client_turns
                .iter()
                .step_by(7)
                .filter(|t| t.expected.is_some())
            {
                let r = request(
                    sim.addr(0),
                    "POST",
                    "/v1/chat/completions",
                    builder.body(conv, turn, Some(&salt)),
                    &[],
                )
                .await;
                assert_eq!(r.status, 200);
                asked += 1;
                let recorded = conv.recorded_reply(turn.expected.as_ref().unwrap());
                right += usize::from(matches_expected(&r, &recorded));
            }
        }
        sim.stop().await;
        assert!(asked > 100, "only {asked} turns asked");
        if accuracy == 1.0 {
            assert_eq!(right, asked);
        } else {
            let share = right as f64 / asked as f64;
            assert!(
                (0.3..=0.7).contains(&share),
                "{right} of {asked} right at accuracy 0.5"
            );
        }
    }
}
