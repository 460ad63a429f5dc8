//! Loader and validator invariants: the reference's dataset acceptance items 1–9
//! (`mlperf-agentic-reference.md` §20), every validation error reported with its location,
//! zstd input, and the public sample loading as measured in §19.

mod support;

use std::path::Path;

use agentrace::dataset::{
    load, load_reader, Dataset, DatasetError, LoadOptions, ModelParams, RequestBuilder, Role, Rule,
};
use serde_json::{json, Value};
use support::dataset::*;

fn load_rows(rows: &[Value]) -> Result<Dataset, DatasetError> {
    let dir = tempfile::tempdir().unwrap();
    let path = write_rows(dir.path(), "d.jsonl", rows);
    load(&path, &LoadOptions::default())
}

fn load_text(text: &str) -> Result<Dataset, DatasetError> {
    let dir = tempfile::tempdir().unwrap();
    let path = write_file(dir.path(), "d.jsonl", text);
    load(&path, &LoadOptions::default())
}

/// The rules broken, in report order.
fn rules(result: Result<Dataset, DatasetError>) -> Vec<(usize, Rule)> {
    match result {
        Ok(_) => panic!("expected the dataset to be rejected"),
        Err(e) => {
            assert!(matches!(e, DatasetError::Invalid { .. }), "{e}");
            e.validation_errors()
                .iter()
                .map(|v| (v.line, v.rule))
                .collect()
        }
    }
}

fn history(ds: &Dataset, conv: usize, turn_index: usize) -> Value {
    let b = RequestBuilder::new(ModelParams::default(), false);
    let c = &ds.conversations[conv];
    serde_json::from_slice(&b.history_json(c, &c.client_turns[turn_index], None)).unwrap()
}

// Item 1: only user and tool rows become client turns, in file order, each with its
// pre-built history.
#[test]
fn client_turns_are_user_and_tool_rows_in_file_order() {
    let mut rows = coding_conversation("a", 2);
    rows.extend(coding_conversation("b", 1));
    let ds = load_rows(&rows).unwrap();
    let ids: Vec<&str> = ds.conversations.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(ids, ["a", "b"]);
    let turns: Vec<u32> = ds.conversations[0]
        .client_turns
        .iter()
        .map(|t| t.turn)
        .collect();
    assert_eq!(turns, [1, 3, 5]);
    assert_eq!(ds.client_turn_count(), 5);
    // system + user, then + assistant + tool per round.
    let lens: Vec<usize> = ds.conversations[0]
        .client_turns
        .iter()
        .map(|t| t.history_len)
        .collect();
    assert_eq!(lens, [2, 4, 6]);
}

// Item 2: per-conversation metadata (turns, client turns, expected replies).
#[test]
fn metadata_counts_conversations_turns_and_client_turns() {
    let mut rows = coding_conversation("a", 3);
    rows.extend(coding_conversation("b", 1));
    let ds = load_rows(&rows).unwrap();
    assert_eq!(ds.conversations.len(), 2);
    let client: Vec<usize> = ds
        .conversations
        .iter()
        .map(|c| c.client_turns.len())
        .collect();
    assert_eq!(client, [4, 2]);
    let last = ds.conversations[0].client_turns.last().unwrap();
    let expected = last.expected.as_ref().unwrap();
    assert_eq!(expected.turn, 8);
    let reply = ds.conversations[0].recorded_reply(expected);
    assert_eq!(reply.content.as_deref(), Some("Done."));
    // The reply is the history's own assistant message, not a copy.
    assert_eq!(
        ds.conversations[0].messages[expected.message].role,
        agentrace::dataset::Role::Assistant
    );
    let first = &ds.conversations[0].client_turns[0];
    assert_eq!(first.expected.as_ref().unwrap().turn, 2);
    assert!(first.expected.as_ref().unwrap().tool_calls.is_some());
}

// Item 3: each invalid role sequence is rejected under the role-sequence rule.
#[test]
fn invalid_role_sequences_are_rejected() {
    let cases: Vec<(&str, Vec<Value>)> = vec![
        ("assistant first", vec![assistant_text("c", 1, "hi")]),
        (
            "assistant after assistant",
            vec![
                user("c", 1, "q"),
                assistant_text("c", 2, "a"),
                assistant_text("c", 3, "b"),
            ],
        ),
        (
            "tool after assistant without tool_calls",
            vec![
                user("c", 1, "q"),
                assistant_text("c", 2, "a"),
                tool("c", 3, &[("x", "out")], 0.0),
            ],
        ),
        (
            "user after assistant with tool_calls",
            vec![
                user("c", 1, "q"),
                assistant_calls("c", 2, "r", vec![bash_call("x", "ls")]),
                user("c", 3, "again"),
            ],
        ),
        (
            "tool after tool",
            vec![
                user("c", 1, "q"),
                assistant_calls("c", 2, "r", vec![bash_call("x", "ls")]),
                tool("c", 3, &[("x", "out")], 0.0),
                tool("c", 4, &[("x", "out")], 0.0),
            ],
        ),
        (
            "role assistant_tc",
            vec![
                user("c", 1, "q"),
                json!({"conversation_id": "c", "turn": 2, "role": "assistant_tc", "content": "x"}),
            ],
        ),
    ];
    for (name, rows) in cases {
        let found = rules(load_rows(&rows));
        assert!(
            found.iter().any(|(_, r)| *r == Rule::RoleSequence),
            "{name}: {found:?}"
        );
    }
}

// Item 3: a user row with missing or empty content; an empty file.
#[test]
fn user_rows_need_content_and_files_need_rows() {
    let missing = json!({"conversation_id": "c", "turn": 1, "role": "user"});
    assert_eq!(rules(load_rows(&[missing])), [(1, Rule::UserContent)]);
    assert_eq!(
        rules(load_rows(&[user("c", 1, "")])),
        [(1, Rule::UserContent)]
    );
    let null = json!({"conversation_id": "c", "turn": 1, "role": "user", "content": null});
    assert_eq!(rules(load_rows(&[null])), [(1, Rule::UserContent)]);
    assert_eq!(rules(load_text("")), [(0, Rule::Empty)]);
    // A file of only a metadata sentinel has no rows either.
    let sentinel = "{\"_type\":\"dataset_metadata\",\"license\":\"x\"}\n";
    assert_eq!(rules(load_text(sentinel)), [(0, Rule::Empty)]);
}

// Item 3: interleaved conversations are rejected at the line where an id reappears.
#[test]
fn interleaved_conversations_are_rejected() {
    let rows = vec![
        user("a", 1, "q"),
        user("b", 1, "q"),
        assistant_text("a", 2, "late"),
    ];
    assert_eq!(rules(load_rows(&rows)), [(3, Rule::Grouping)]);
}

// Item 3: turn numbering must be exactly 1..N after sorting.
#[test]
fn turn_numbering_must_be_one_to_n() {
    let gap = vec![user("c", 1, "q"), assistant_text("c", 3, "a")];
    assert_eq!(rules(load_rows(&gap)), [(2, Rule::TurnNumbering)]);
    let from_two = vec![user("c", 2, "q"), assistant_text("c", 3, "a")];
    assert_eq!(rules(load_rows(&from_two)), [(1, Rule::TurnNumbering)]);
    let from_zero = vec![user("c", 0, "q"), assistant_text("c", 1, "a")];
    assert_eq!(rules(load_rows(&from_zero)), [(1, Rule::TurnNumbering)]);
    let duplicate = vec![
        user("c", 1, "q"),
        assistant_text("c", 2, "a"),
        user("c", 2, "b"),
    ];
    let found = rules(load_rows(&duplicate));
    assert!(found.contains(&(3, Rule::TurnNumbering)), "{found:?}");
    // Rows of one conversation may come in any order: they are sorted by turn.
    let shuffled = vec![assistant_text("c", 2, "a"), user("c", 1, "q")];
    assert!(load_rows(&shuffled).is_ok());
}

// Item 3: null, non-string and non-printable ids are rejected; ids stay raw strings.
#[test]
fn conversation_ids_must_be_printable_ascii_strings() {
    let null = json!({"conversation_id": null, "turn": 1, "role": "user", "content": "q"});
    assert_eq!(rules(load_rows(&[null])), [(1, Rule::ConversationId)]);
    let number = json!({"conversation_id": 17, "turn": 1, "role": "user", "content": "q"});
    let err = load_rows(&[number]).unwrap_err();
    assert!(
        err.to_string().contains("must be a string, got a number"),
        "{err}"
    );
    for bad in ["", "nan", "tab\there", "caf\u{e9}"] {
        assert_eq!(
            rules(load_rows(&[user(bad, 1, "q")])),
            [(1, Rule::ConversationId)],
            "{bad:?}"
        );
    }
    // Numeric-looking ids and spaces are kept exactly as written.
    let ds = load_rows(&[user("007", 1, "q"), user("a b", 1, "q")]).unwrap();
    assert_eq!(ds.conversations[0].id, "007");
    assert_eq!(ds.conversations[1].id, "a b");
}

// Item 3: each malformed tool_calls shape is rejected under the tool_calls rule.
#[test]
fn malformed_tool_calls_are_rejected() {
    let good = bash_call("x", "ls");
    let mut empty_id = good.clone();
    empty_id["id"] = json!("");
    let mut wrong_type = good.clone();
    wrong_type["type"] = json!("tool");
    let mut no_name = good.clone();
    no_name["function"].as_object_mut().unwrap().remove("name");
    let mut bad_args = good.clone();
    bad_args["function"]["arguments"] = json!(42);
    for (name, call) in [
        ("not an object", json!("call")),
        ("empty id", empty_id),
        ("type not function", wrong_type),
        ("missing name", no_name),
        ("arguments not str/object", bad_args),
    ] {
        let rows = vec![
            user("c", 1, "q"),
            assistant_calls("c", 2, "r", vec![call]),
            tool("c", 3, &[("x", "out")], 0.0),
        ];
        let found = rules(load_rows(&rows));
        assert!(found.contains(&(2, Rule::ToolCalls)), "{name}: {found:?}");
    }
    let empty_list = vec![user("c", 1, "q"), assistant_calls("c", 2, "r", vec![])];
    assert!(rules(load_rows(&empty_list)).contains(&(2, Rule::ToolCalls)));
    // Arguments stored as an object are accepted and forwarded as stored.
    let mut object_args = good;
    object_args["function"]["arguments"] = json!({"command": "ls"});
    let rows = vec![
        user("c", 1, "q"),
        assistant_calls("c", 2, "r", vec![object_args]),
        tool("c", 3, &[("x", "out")], 0.0),
    ];
    assert!(load_rows(&rows).is_ok());
}

// Item 3: each malformed tool_results shape is rejected under the tool_results rule.
#[test]
fn malformed_tool_results_are_rejected() {
    let head = vec![
        user("c", 1, "q"),
        assistant_calls("c", 2, "r", vec![bash_call("x", "ls")]),
    ];
    for (name, results) in [
        ("empty", json!([])),
        ("not an object", json!(["out"])),
        ("missing tool_call_id", json!([{"content": "out"}])),
        ("missing content", json!([{"tool_call_id": "x"}])),
        ("not a list", json!({"tool_call_id": "x", "content": "out"})),
    ] {
        let mut rows = head.clone();
        rows.push(
            json!({"conversation_id": "c", "turn": 3, "role": "tool", "tool_results": results}),
        );
        assert_eq!(rules(load_rows(&rows)), [(3, Rule::ToolResults)], "{name}");
    }
    let mut rows = head;
    rows.push(json!({"conversation_id": "c", "turn": 3, "role": "tool"}));
    assert_eq!(rules(load_rows(&rows)), [(3, Rule::ToolResults)]);
}

// Every error of a file is reported, each with line, conversation, turn and rule; the list
// is capped by `max_errors` and its Display prints one error per line.
#[test]
fn all_validation_errors_are_reported_with_their_location() {
    let rows = vec![
        assistant_text("a", 1, "no user first"),
        user("b", 1, ""),
        json!({"conversation_id": 5, "turn": 1, "role": "user", "content": "q"}),
        user("c", 1, "q"),
        assistant_calls("c", 2, "r", vec![json!({"id": "", "type": "function"})]),
        user("a", 2, "back again"),
    ];
    let err = load_rows(&rows).unwrap_err();
    let found: Vec<(usize, Option<&str>, Option<i64>, Rule)> = err
        .validation_errors()
        .iter()
        .map(|e| (e.line, e.conversation_id.as_deref(), e.turn, e.rule))
        .collect();
    assert_eq!(
        found,
        [
            (1, Some("a"), Some(1), Rule::RoleSequence),
            (2, Some("b"), Some(1), Rule::UserContent),
            (3, None, Some(1), Rule::ConversationId),
            (5, Some("c"), Some(2), Rule::ToolCalls),
            (6, Some("a"), Some(2), Rule::Grouping),
        ]
    );
    let text = err.to_string();
    assert_eq!(text.lines().count(), 6, "{text}");
    assert!(text
        .lines()
        .nth(1)
        .unwrap()
        .contains("line 1, conversation \"a\", turn 1: [role-sequence]"));

    let dir = tempfile::tempdir().unwrap();
    let path = write_rows(dir.path(), "d.jsonl", &rows);
    let capped = load(
        &path,
        &LoadOptions {
            max_errors: 2,
            ..LoadOptions::default()
        },
    )
    .unwrap_err();
    match &capped {
        DatasetError::Invalid { errors, total, .. } => {
            assert_eq!((errors.len(), *total), (2, 5));
        }
        other => panic!("unexpected {other}"),
    }
    assert!(capped.to_string().contains("3 more not listed"));
}

// Lines that are not JSON objects are errors at their line; sentinel rows are dropped.
#[test]
fn bad_json_lines_are_errors_and_metadata_rows_are_dropped() {
    let text = format!(
        "{}\nnot json\n[1,2]\n{}",
        json!({"_type": "dataset_metadata", "source": "x"}),
        jsonl(&coding_conversation("a", 1))
    );
    assert_eq!(rules(load_text(&text)), [(2, Rule::Json), (3, Rule::Json)]);
    let text = format!(
        "{}\n\n{}",
        json!({"_type": "dataset_metadata", "source": "x"}),
        jsonl(&coding_conversation("a", 1))
    );
    assert_eq!(load_text(&text).unwrap().conversations.len(), 1);
}

// Item 4: tool sequences, parallel tool calls with merged results, and a conversation that
// ends on a tool row are accepted.
#[test]
fn tool_sequences_parallel_calls_and_trailing_tool_rows_are_accepted() {
    let rows = vec![
        first_user("p", "sys", "q"),
        assistant_calls(
            "p",
            2,
            "two at once",
            vec![bash_call("c1", "ls"), bash_call("c2", "pwd")],
        ),
        tool("p", 3, &[("c1", "a"), ("c2", "/")], 0.2),
        assistant_calls("p", 4, "again", vec![bash_call("c3", "cat a")]),
        tool("p", 5, &[("c3", "x")], 0.0),
    ];
    let ds = load_rows(&rows).unwrap();
    let c = &ds.conversations[0];
    assert_eq!(c.client_turns.len(), 3);
    assert!(
        c.client_turns[2].expected.is_none(),
        "a trailing tool row has no reply"
    );
    // tool → user without a closing assistant is allowed too.
    let rows = vec![
        user("t", 1, "q"),
        assistant_calls("t", 2, "r", vec![bash_call("x", "ls")]),
        tool("t", 3, &[("x", "out")], 0.0),
        user("t", 4, "next"),
    ];
    let ds = load_rows(&rows).unwrap();
    assert!(ds.conversations[0].client_turns[1].expected.is_none());
}

// Item 5: the system prompt is the first message; earlier replies appear in later turns;
// nothing leaks across conversations.
#[test]
fn histories_start_with_the_system_prompt_and_never_leak() {
    let mut rows = vec![
        user("a", 1, "first question"),
        assistant_text("a", 2, "first answer"),
        json!({"conversation_id": "a", "turn": 3, "role": "user", "content": "second", "system": "late system"}),
    ];
    rows.extend(coding_conversation("b", 1));
    let ds = load_rows(&rows).unwrap();
    let h = history(&ds, 0, 1);
    assert_eq!(
        h,
        json!([
            {"role": "system", "content": "late system"},
            {"role": "user", "content": "first question"},
            {"role": "assistant", "content": "first answer"},
            {"role": "user", "content": "second"}
        ])
    );
    let b = history(&ds, 1, 0);
    assert_eq!(
        b[0],
        json!({"role": "system", "content": "You are a helpful assistant."})
    );
    assert!(!b.to_string().contains("first answer"));
    assert_eq!(
        ds.conversations[0].system_prompt().as_deref(),
        Some("late system")
    );
}

// Item 6: tool rows expand to one message per result with tool_call_id and content; an
// assistant with tool_calls keeps `content: null` in the history form.
#[test]
fn tool_rows_expand_and_tool_call_messages_keep_null_content_in_history() {
    let rows = vec![
        first_user("p", "sys", "q"),
        assistant_calls(
            "p",
            2,
            "both",
            vec![bash_call("c1", "ls"), bash_call("c2", "pwd")],
        ),
        tool("p", 3, &[("c1", "a"), ("c2", "/")], 0.2),
        assistant_text("p", 4, "ok"),
    ];
    let ds = load_rows(&rows).unwrap();
    let h = history(&ds, 0, 1);
    assert_eq!(h.as_array().unwrap().len(), 5);
    assert_eq!(
        h[3],
        json!({"role": "tool", "tool_call_id": "c1", "content": "a"})
    );
    assert_eq!(
        h[4],
        json!({"role": "tool", "tool_call_id": "c2", "content": "/"})
    );
    let b = RequestBuilder::new(ModelParams::default(), false);
    let c = &ds.conversations[0];
    let text = String::from_utf8(b.history_json(c, &c.client_turns[1], None)).unwrap();
    assert!(
        text.contains("\"reasoning_content\":\"both\",\"content\":null}"),
        "content: null is appended last: {text}"
    );
    assert!(text.contains("{\"role\":\"tool\",\"tool_call_id\":\"c1\",\"content\":\"a\"}"));
    let roles: Vec<Role> = c.messages.iter().map(|m| m.role).collect();
    assert_eq!(
        roles,
        [
            Role::System,
            Role::User,
            Role::Assistant,
            Role::Tool,
            Role::Tool,
            Role::Assistant
        ]
    );
}

// Item 7: tool_results, tool_calls, delay_seconds and internal fields never reach a turn's
// request fields; a merged tool row has no stray content.
#[test]
fn row_bookkeeping_fields_never_reach_requests() {
    let mut rows = coding_conversation("a", 1);
    rows[2]["intent_codes"] = json!(["I001"]);
    rows[2]["_internal"] = json!("x");
    let ds = load_rows(&rows).unwrap();
    let c = &ds.conversations[0];
    let turn = &c.client_turns[1];
    for key in [
        "tool_results",
        "tool_calls",
        "delay_seconds",
        "intent_codes",
        "_internal",
        "content",
    ] {
        assert!(!turn.overrides.contains_key(key), "{key}");
    }
    assert_eq!(turn.delay_seconds, 0.1);
    let body = RequestBuilder::new(ModelParams::default(), false).body(c, turn, None);
    let body: Value = serde_json::from_slice(&body).unwrap();
    let text = body.to_string();
    for key in [
        "tool_results",
        "delay_seconds",
        "intent_codes",
        "_internal",
        "NaN",
    ] {
        assert!(!text.contains(key), "{key} leaked: {text}");
    }
    assert_eq!(
        body["messages"][3],
        json!({"role": "tool", "content": "a.py\n", "tool_call_id": "functions.bash:0"})
    );
}

// Item 8: generation parameters on rows are forwarded (per-row values win, the
// max_new_tokens alias becomes max_completion_tokens) and tools survive the round trip.
#[test]
fn row_generation_parameters_are_forwarded_over_defaults() {
    let mut rows = coding_conversation("a", 1);
    rows[0]["model"] = json!("row-model");
    rows[0]["temperature"] = json!(0.25);
    rows[0]["max_new_tokens"] = json!(77);
    rows[0]["stop"] = json!(["</s>"]);
    rows[2]["seed"] = json!(9);
    let ds = load_rows(&rows).unwrap();
    let c = &ds.conversations[0];
    let b = RequestBuilder::new(ModelParams::preset("kimi-k3").unwrap(), false);
    let first: Value = serde_json::from_slice(&b.body(c, &c.client_turns[0], None)).unwrap();
    assert_eq!(first["model"], "row-model");
    assert_eq!(first["temperature"], 0.25);
    assert_eq!(first["max_completion_tokens"], 77);
    assert_eq!(first["stop"], json!(["</s>"]));
    assert_eq!(first["tools"], bash_tool());
    assert!(first.get("max_new_tokens").is_none());
    let second: Value = serde_json::from_slice(&b.body(c, &c.client_turns[1], None)).unwrap();
    // model is filled from the preset before propagation; max_new_tokens and tools propagate.
    assert_eq!(second["model"], "moonshotai/Kimi-K3");
    assert_eq!(second["temperature"], 1.0);
    assert_eq!(second["max_completion_tokens"], 77);
    assert_eq!(second["seed"], 9);
    assert_eq!(second["tools"], bash_tool());
    assert!(second.get("stop").is_none());
}

// Item 9: a request cannot be built without model parameters; unknown presets are refused
// rather than silently defaulted.
#[test]
fn requests_need_model_params_and_unknown_presets_are_refused() {
    assert!(ModelParams::preset("gpt-5").is_none());
    assert!(ModelParams::preset("kimi-k3").is_some());
    assert!(ModelParams::preset("Qwen3.6-35B-A3B").is_some());
    let bad = ModelParams {
        top_p: Some(1.5),
        ..ModelParams::default()
    };
    assert_eq!(
        bad.validate().unwrap_err(),
        "model_params.top_p: must be in (0, 1], got 1.5"
    );
    let parsed: Result<ModelParams, _> = serde_json::from_str(r#"{"name":"m","temp":1}"#);
    assert!(parsed.is_err(), "unknown keys are refused");
    let parsed: ModelParams = serde_json::from_str(r#"{"name":"m","streaming":"off"}"#).unwrap();
    assert!(!parsed.streaming);
}

// zstd input loads to the same conversations as the plain file; the SHA-256 is of the
// stored bytes.
#[test]
fn zstd_files_load_like_plain_files() {
    let mut rows = coding_conversation("a", 3);
    rows.extend(coding_conversation("b", 2));
    let dir = tempfile::tempdir().unwrap();
    let text = jsonl(&rows);
    let plain = load(
        &write_file(dir.path(), "d.jsonl", &text),
        &LoadOptions::default(),
    )
    .unwrap();
    let zst_path = write_file(dir.path(), "d.jsonl.zst", &text);
    let packed = load(&zst_path, &LoadOptions::default()).unwrap();
    assert_eq!(plain.conversations.len(), packed.conversations.len());
    for (a, b) in plain.conversations.iter().zip(&packed.conversations) {
        let wa: Vec<&str> = a.messages.iter().map(|m| m.wire.get()).collect();
        let wb: Vec<&str> = b.messages.iter().map(|m| m.wire.get()).collect();
        assert_eq!(wa, wb);
    }
    use sha2::Digest;
    let stored = std::fs::read(&zst_path).unwrap();
    assert_eq!(packed.sha256, hex::encode(sha2::Sha256::digest(&stored)));
    assert_ne!(plain.sha256, packed.sha256);
    // A reader works too.
    let mut reader = std::io::Cursor::new(text.into_bytes());
    let convs = load_reader(&mut reader, "mem", &LoadOptions::default()).unwrap();
    assert_eq!(convs.len(), 2);
}

// The history is stored once per conversation: messages grow with rows, not turns².
#[test]
fn history_is_stored_once_not_per_turn() {
    let rows = coding_conversation("long", 200);
    let ds = load_rows(&rows).unwrap();
    let c = &ds.conversations[0];
    assert_eq!(c.client_turns.len(), 201);
    assert_eq!(c.messages.len(), 1 + rows.len());
    assert!(c
        .client_turns
        .windows(2)
        .all(|w| w[0].history_len < w[1].history_len));
}

// The public sample validates: 20 conversations, 1,007 client turns (§19).
#[test]
fn public_sample_loads_with_twenty_conversations_and_1007_client_turns() {
    let Some(path) =
        sample_path("public_sample_loads_with_twenty_conversations_and_1007_client_turns")
    else {
        return;
    };
    let ds = load(&path, &LoadOptions::default()).unwrap();
    assert_eq!(ds.conversations.len(), 20);
    assert_eq!(ds.client_turn_count(), 1007);
    let client: Vec<usize> = ds
        .conversations
        .iter()
        .map(|c| c.client_turns.len())
        .collect();
    assert_eq!(*client.iter().min().unwrap(), 27);
    assert_eq!(*client.iter().max().unwrap(), 61);
    let expected = ds
        .conversations
        .iter()
        .flat_map(|c| &c.client_turns)
        .filter(|t| t.expected.is_some())
        .count();
    assert_eq!(expected, 1007);
    let delays: f64 = ds
        .conversations
        .iter()
        .flat_map(|c| &c.client_turns)
        .map(|t| t.delay_seconds)
        .sum();
    assert!((delays - 636.4).abs() < 0.1, "{delays}");
    assert!(ds.check_salt_preflight().is_ok());
    assert_eq!(ds.sha256.len(), 64);
    let _ = Path::new(&ds.path);
}
