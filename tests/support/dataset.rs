//! Fixtures for the dataset tests: the public sample's location, row builders in the
//! MLPerf flat format, and writers for plain and zstd JSONL files.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

/// The public MLPerf sample, or `None` (with a visible skip line naming `test`) when it is
/// absent. Looked for in `AGENTRACE_SAMPLE_DIR` when set (so a run can check the skips:
/// `AGENTRACE_SAMPLE_DIR=/nonexistent cargo test`), else where `scripts/fetch-sample.sh` puts
/// it (`datasets/` in the checkout), then in a `shared/datasets/` directory beside the checkout.
pub fn sample_path(test: &str) -> Option<PathBuf> {
    const NAME: &str = "mlperf_agentic_coding_sample.jsonl";
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let places = match std::env::var_os("AGENTRACE_SAMPLE_DIR") {
        Some(dir) => vec![PathBuf::from(dir).join(NAME)],
        None => vec![
            root.join("datasets").join(NAME),
            root.join("../shared/datasets").join(NAME),
        ],
    };
    let found = places.iter().find(|p| p.exists()).cloned();
    if found.is_none() {
        super::skip(
            test,
            &format!(
                "the public sample is absent ({}; scripts/fetch-sample.sh downloads it)",
                places[0].display()
            ),
        );
    }
    found
}

/// The sample's bash tool definition.
pub fn bash_tool() -> Value {
    json!([{"type": "function", "function": {"name": "bash",
        "description": "Execute a bash command",
        "parameters": {"type": "object",
            "properties": {"command": {"type": "string", "description": "The bash command to execute"}},
            "required": ["command"]}}}])
}

/// A user row.
pub fn user(id: &str, turn: u32, content: &str) -> Value {
    json!({"conversation_id": id, "turn": turn, "role": "user", "content": content})
}

/// A user row opening a conversation: with a system prompt and the bash tool.
pub fn first_user(id: &str, system: &str, content: &str) -> Value {
    json!({"conversation_id": id, "turn": 1, "role": "user", "content": content,
           "system": system, "tools": bash_tool()})
}

/// One bash tool call as the sample stores it.
pub fn bash_call(call_id: &str, command: &str) -> Value {
    json!({"id": call_id, "type": "function",
           "function": {"name": "bash", "arguments": json!({"command": command}).to_string()}})
}

/// An assistant row with reasoning and tool calls.
pub fn assistant_calls(id: &str, turn: u32, reasoning: &str, calls: Vec<Value>) -> Value {
    json!({"conversation_id": id, "turn": turn, "role": "assistant",
           "reasoning_content": reasoning, "tool_calls": calls})
}

/// An assistant row with text content only.
pub fn assistant_text(id: &str, turn: u32, content: &str) -> Value {
    json!({"conversation_id": id, "turn": turn, "role": "assistant", "content": content})
}

/// A tool row with one result per `(tool_call_id, content)`.
pub fn tool(id: &str, turn: u32, results: &[(&str, &str)], delay: f64) -> Value {
    let results: Vec<Value> = results
        .iter()
        .map(|(call, content)| json!({"tool_call_id": call, "content": content}))
        .collect();
    json!({"conversation_id": id, "turn": turn, "role": "tool",
           "tool_results": results, "delay_seconds": delay})
}

/// A valid coding conversation `u a t a t a` with `n_tools` tool rounds.
pub fn coding_conversation(id: &str, n_tools: u32) -> Vec<Value> {
    let mut rows = vec![first_user(
        id,
        "You are a helpful assistant.",
        "Fix the bug",
    )];
    let mut turn = 2;
    for k in 0..n_tools {
        let call = format!("functions.bash:{k}");
        rows.push(assistant_calls(
            id,
            turn,
            "Look.",
            vec![bash_call(&call, "ls")],
        ));
        rows.push(tool(id, turn + 1, &[(&call, "a.py\n")], 0.1));
        turn += 2;
    }
    rows.push(assistant_text(id, turn, "Done."));
    rows
}

/// One JSONL line per row.
pub fn jsonl(rows: &[Value]) -> String {
    rows.iter().map(|r| format!("{r}\n")).collect()
}

/// Writes `text` to `dir/name`; zstd-compresses it when the name ends in `.zst`.
pub fn write_file(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    let mut file = std::fs::File::create(&path).expect("create dataset file");
    if name.ends_with(".zst") {
        let mut enc = zstd::Encoder::new(file, 3).expect("zstd encoder");
        enc.write_all(text.as_bytes()).expect("write");
        enc.finish().expect("finish zstd");
    } else {
        file.write_all(text.as_bytes()).expect("write");
    }
    path
}

/// Writes rows as a JSONL file named `name` in `dir`.
pub fn write_rows(dir: &Path, name: &str, rows: &[Value]) -> PathBuf {
    write_file(dir, name, &jsonl(rows))
}
