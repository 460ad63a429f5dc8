//! Chat Completions: which streamed chunk carries the model's first output.

use serde_json::Value;

/// Whether a chunk's `choices[0].delta` carries content, reasoning or a tool call.
pub(crate) fn is_token_chunk(chunk: &Value) -> bool {
    let Some(delta) = chunk.pointer("/choices/0/delta") else {
        return false;
    };
    let text = |k: &str| {
        delta
            .get(k)
            .and_then(Value::as_str)
            .is_some_and(|s| !s.is_empty())
    };
    text("content")
        || text("reasoning_content")
        || text("reasoning")
        || delta
            .get("tool_calls")
            .and_then(Value::as_array)
            .is_some_and(|c| !c.is_empty())
}
