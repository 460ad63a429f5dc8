//! Request bodies and salting, byte for byte against the reference (`mlperf-agentic-reference.md`
//! §5 and §10): golden bodies for a coding turn, a parallel-tool turn and a workflow turn,
//! written by hand from the spec; the salt test vectors; the presets.

mod support;

use agentrace::dataset::{load, Dataset, LoadOptions, ModelParams, RequestBuilder, Salt};
use serde_json::{json, Value};
use support::dataset::*;

fn load_rows(rows: &[Value]) -> Dataset {
    let dir = tempfile::tempdir().unwrap();
    let path = write_rows(dir.path(), "d.jsonl", rows);
    load(&path, &LoadOptions::default()).unwrap()
}

fn text(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes).unwrap()
}

const BASH_TOOL: &str = r#"[{"type":"function","function":{"name":"bash","description":"Execute a bash command","parameters":{"type":"object","properties":{"command":{"type":"string","description":"The bash command to execute"}},"required":["command"]}}}]"#;

// A coding tool turn with the Qwen preset: body fields in the struct's order, nulls
// omitted, no `content` on the tool-call message, tool message as role/content/tool_call_id.
#[test]
fn coding_turn_body_matches_the_reference_bytes() {
    let ds = load_rows(&coding_conversation("django__django-16899", 1));
    let c = &ds.conversations[0];
    let b = RequestBuilder::new(ModelParams::preset("qwen3.6-35b-a3b").unwrap(), false);
    let expected = format!(
        concat!(
            r#"{{"model":"Qwen/Qwen3.6-35B-A3B","messages":["#,
            r#"{{"role":"system","content":"You are a helpful assistant."}},"#,
            r#"{{"role":"user","content":"Fix the bug"}},"#,
            r#"{{"role":"assistant","tool_calls":[{{"id":"functions.bash:0","type":"function","function":{{"name":"bash","arguments":"{{\"command\":\"ls\"}}"}}}}],"reasoning_content":"Look."}},"#,
            r#"{{"role":"tool","content":"a.py\n","tool_call_id":"functions.bash:0"}}],"#,
            r#""temperature":1.0,"max_completion_tokens":8192,"stream":true,"top_p":0.95,"top_k":20,"#,
            r#""repetition_penalty":1.0,"presence_penalty":1.5,"chat_template_kwargs":{{"preserve_thinking":true}},"#,
            r#""tools":{}}}"#
        ),
        BASH_TOOL
    );
    assert_eq!(text(b.body(c, &c.client_turns[1], None)), expected);

    // Salted (repeat 1): only the system message changes, with the §10 salts.
    let salted = text(b.body(c, &c.client_turns[1], Some(&Salt::new(1, &c.id))));
    let want = expected.replace(
        r#""content":"You are a helpful assistant.""#,
        r#""content":"[salt: 4461]\n\nYou are a helpful assistant.\n\n[salt: edc0]""#,
    );
    assert_eq!(salted, want);
}

// A parallel-tool turn with the Kimi preset and usage reporting: two tool messages from one
// tool row, `stream_options` last.
#[test]
fn parallel_tool_turn_body_matches_the_reference_bytes() {
    let rows = vec![
        first_user("psf__requests-1921", "sys", "Fix it"),
        assistant_calls(
            "psf__requests-1921",
            2,
            "Two reads.",
            vec![
                bash_call("functions.bash:0", "cat a.py"),
                bash_call("functions.bash:1", "cat b.py"),
            ],
        ),
        tool(
            "psf__requests-1921",
            3,
            &[("functions.bash:0", "A"), ("functions.bash:1", "B")],
            0.06,
        ),
        assistant_text("psf__requests-1921", 4, "Done."),
    ];
    let ds = load_rows(&rows);
    let c = &ds.conversations[0];
    let b = RequestBuilder::new(ModelParams::preset("kimi-k3").unwrap(), true);
    let expected = format!(
        concat!(
            r#"{{"model":"moonshotai/Kimi-K3","messages":["#,
            r#"{{"role":"system","content":"sys"}},"#,
            r#"{{"role":"user","content":"Fix it"}},"#,
            r#"{{"role":"assistant","tool_calls":["#,
            r#"{{"id":"functions.bash:0","type":"function","function":{{"name":"bash","arguments":"{{\"command\":\"cat a.py\"}}"}}}},"#,
            r#"{{"id":"functions.bash:1","type":"function","function":{{"name":"bash","arguments":"{{\"command\":\"cat b.py\"}}"}}}}],"#,
            r#""reasoning_content":"Two reads."}},"#,
            r#"{{"role":"tool","content":"A","tool_call_id":"functions.bash:0"}},"#,
            r#"{{"role":"tool","content":"B","tool_call_id":"functions.bash:1"}}],"#,
            r#""temperature":1.0,"max_completion_tokens":8192,"stream":true,"top_p":1.0,"tools":{},"#,
            r#""stream_options":{{"include_usage":true}}}}"#
        ),
        BASH_TOOL
    );
    assert_eq!(text(b.body(c, &c.client_turns[1], None)), expected);
    assert!(b.is_streaming(&c.client_turns[1]));
    // Strict parity: no stream_options when usage reporting is off.
    let strict = RequestBuilder::new(ModelParams::preset("kimi-k3").unwrap(), false);
    let body = text(strict.body(c, &c.client_turns[1], None));
    assert_eq!(
        body,
        expected.replace(r#","stream_options":{"include_usage":true}"#, "")
    );
}

// A workflow user turn: a text reply carrying intent_codes precedes it (never sent), a
// function tool call with object arguments is forwarded as stored, per-row values win,
// the first user row's max_new_tokens propagates; streaming off sends `stream: false`.
#[test]
fn workflow_turn_body_matches_the_reference_bytes() {
    let tools = json!([{"type": "function", "function": {"name": "lookup_order",
        "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}}}}]);
    let rows = vec![
        json!({"conversation_id": "sim_000001", "turn": 1, "role": "user",
               "content": "Where is order 42?", "system": "You are a logistics agent.",
               "tools": tools, "max_new_tokens": 512}),
        json!({"conversation_id": "sim_000001", "turn": 2, "role": "assistant",
               "tool_calls": [{"id": "call_1", "type": "function",
                   "function": {"name": "lookup_order", "arguments": {"order_id": "42"}}}]}),
        json!({"conversation_id": "sim_000001", "turn": 3, "role": "tool",
               "tool_results": [{"tool_call_id": "call_1", "content": "{\"status\":\"delayed\"}"}]}),
        json!({"conversation_id": "sim_000001", "turn": 4, "role": "assistant",
               "content": "intent: I057\nYour order is delayed.", "intent_codes": ["I000", "I057"]}),
        json!({"conversation_id": "sim_000001", "turn": 5, "role": "user",
               "content": "Why?", "temperature": 0.5, "delay_seconds": 3.5}),
        json!({"conversation_id": "sim_000001", "turn": 6, "role": "assistant",
               "content": "intent: I058\nThe courier missed it.", "intent_codes": ["I000", "I057", "I058"]}),
    ];
    let ds = load_rows(&rows);
    let c = &ds.conversations[0];
    let turn = &c.client_turns[2];
    assert_eq!(turn.turn, 5);
    assert_eq!(turn.delay_seconds, 3.5);
    let params = ModelParams {
        name: "m".to_string(),
        temperature: Some(1.0),
        streaming: false,
        ..ModelParams::default()
    };
    let b = RequestBuilder::new(params, true);
    let expected = concat!(
        r#"{"model":"m","messages":["#,
        r#"{"role":"system","content":"You are a logistics agent."},"#,
        r#"{"role":"user","content":"Where is order 42?"},"#,
        r#"{"role":"assistant","tool_calls":[{"id":"call_1","type":"function","function":{"name":"lookup_order","arguments":{"order_id":"42"}}}]},"#,
        r#"{"role":"tool","content":"{\"status\":\"delayed\"}","tool_call_id":"call_1"},"#,
        r#"{"role":"assistant","content":"intent: I057\nYour order is delayed."},"#,
        r#"{"role":"user","content":"Why?"}],"#,
        r#""temperature":0.5,"max_completion_tokens":512,"stream":false,"#,
        r#""tools":[{"type":"function","function":{"name":"lookup_order","parameters":{"type":"object","properties":{"order_id":{"type":"string"}}}}}]}"#
    );
    assert_eq!(text(b.body(c, turn, None)), expected);
    assert!(!b.is_streaming(turn));
    let gt = turn.expected.as_ref().unwrap();
    assert_eq!(
        gt.intent_codes.as_deref(),
        Some(&["I000".to_string(), "I057".to_string(), "I058".to_string()][..])
    );
    // The history form lists `content: null` for the tool-call message and no intent codes.
    let history = text(b.history_json(c, turn, Some(&Salt::new(2, &c.id))));
    assert!(history.starts_with(r#"[{"role":"system","content":"[salt: ba75]\n\nYou are a logistics agent.\n\n[salt: 1bd4]"}"#), "{history}");
    assert!(history.contains(r#"{"role":"assistant","tool_calls":[{"id":"call_1","type":"function","function":{"name":"lookup_order","arguments":{"order_id":"42"}}}],"content":null}"#));
    assert!(history.contains(
        r#"{"role":"tool","tool_call_id":"call_1","content":"{\"status\":\"delayed\"}"}"#
    ));
    assert!(!history.contains("intent_codes"));
}

// §10's test vectors: 2-byte BLAKE2b of the repeat number and of the source id.
#[test]
fn salts_match_the_reference_vectors() {
    let repeats = [
        "4461", "ba75", "0967", "88ed", "56d5", "68bf", "b0ae", "56df", "4a4d", "6cd2",
    ];
    for (i, want) in repeats.iter().enumerate() {
        assert_eq!(
            Salt::new(i as u64 + 1, "x").repeat,
            *want,
            "repeat {}",
            i + 1
        );
    }
    for (id, want) in [
        ("django__django-16899", "edc0"),
        ("psf__requests-1921", "2e73"),
        ("sim_000001", "1bd4"),
        ("astropy__astropy-12907", "efbe"),
        ("sympy__sympy-18763", "06f3"),
        ("scikit-learn__scikit-learn-26323", "e26d"),
    ] {
        assert_eq!(Salt::new(1, id).conversation, want, "{id}");
    }
    assert_eq!(
        Salt::new(1, "django__django-16899").apply("sys"),
        "[salt: 4461]\n\nsys\n\n[salt: edc0]"
    );
}

// The exact salted system content of repeat 1 of django__django-16899 in the public sample;
// salting never mutates the stored history; a dataset without system prompts fails the
// salting pre-flight with the reference's message.
#[test]
fn sample_turn_is_salted_exactly_and_history_is_not_mutated() {
    if let Some(path) = sample_path("sample_turn_is_salted_exactly_and_history_is_not_mutated") {
        let ds = load(&path, &LoadOptions::default()).unwrap();
        let c = ds.conversation("django__django-16899").unwrap();
        let b = RequestBuilder::new(ModelParams::preset("qwen3.6-35b-a3b").unwrap(), false);
        let salt = Salt::new(1, &c.id);
        let body: Value =
            serde_json::from_slice(&b.body(c, &c.client_turns[0], Some(&salt))).unwrap();
        assert_eq!(
            body["messages"][0]["content"],
            "[salt: 4461]\n\nYou are a helpful assistant that can interact with a computer shell to solve programming tasks.\n\n[salt: edc0]"
        );
        let plain: Value = serde_json::from_slice(&b.body(c, &c.client_turns[0], None)).unwrap();
        assert_eq!(
            plain["messages"][0]["content"],
            "You are a helpful assistant that can interact with a computer shell to solve programming tasks."
        );
        // Every body of the sample is valid JSON whose messages match the history length.
        for turn in &c.client_turns {
            let v: Value = serde_json::from_slice(&b.body(c, turn, Some(&salt))).unwrap();
            assert_eq!(v["messages"].as_array().unwrap().len(), turn.history_len);
        }
    }
    let ds = load_rows(&[user("nosys", 1, "q")]);
    let err = ds.check_salt_preflight().unwrap_err();
    assert_eq!(
        err.to_string(),
        "agentic_inference.enable_salt requires a system prompt for every conversation; conversation \"nosys\" turn 1 has no system prompt; to replay such a dataset, turn salting off (--salt false, or enable_salt = false)"
    );
}

// The presets carry the official sampling values and nothing else; the default streams and
// sends 1024 max tokens; an empty model name falls back to the reference's placeholder.
#[test]
fn presets_carry_the_official_sampling_values() {
    let qwen = ModelParams::preset("qwen3.6-35b-a3b").unwrap();
    assert_eq!(
        (
            qwen.temperature,
            qwen.top_p,
            qwen.top_k,
            qwen.repetition_penalty,
            qwen.presence_penalty,
            qwen.max_new_tokens
        ),
        (
            Some(1.0),
            Some(0.95),
            Some(20),
            Some(1.0),
            Some(1.5),
            Some(8192)
        )
    );
    assert_eq!(
        qwen.chat_template_kwargs.as_ref().unwrap()["preserve_thinking"],
        true
    );
    assert!(qwen.streaming && qwen.frequency_penalty.is_none() && qwen.seed.is_none());
    let kimi = ModelParams::preset("kimi-k3").unwrap();
    assert_eq!(
        (kimi.temperature, kimi.top_p, kimi.max_new_tokens),
        (Some(1.0), Some(1.0), Some(8192))
    );
    assert!(kimi.top_k.is_none() && kimi.chat_template_kwargs.is_none() && kimi.streaming);
    assert!(qwen.validate().is_ok() && kimi.validate().is_ok());

    let ds = load_rows(&[user("c", 1, "q")]);
    let c = &ds.conversations[0];
    let body =
        text(RequestBuilder::new(ModelParams::default(), false).body(c, &c.client_turns[0], None));
    assert_eq!(
        body,
        r#"{"model":"no-model-name","messages":[{"role":"user","content":"q"}],"max_completion_tokens":1024,"stream":true}"#
    );
}
