//! Anthropic Messages (`POST /v1/messages`): its conversation head, its streamed token
//! events, and its turns as the chat messages the dataset format is written in.
//!
//! A request has a top-level `system` (a string or text blocks) and `messages` whose content
//! is a string or blocks: `text`, `tool_use` (assistant), `tool_result` (user), `thinking`
//! (assistant). A stream is `message_start`, then per block `content_block_start`,
//! `content_block_delta`s (`text_delta`, `input_json_delta`, `thinking_delta`) and
//! `content_block_stop`, then `message_delta` and `message_stop`, with `ping`s anywhere.

use serde_json::{json, Map, Value};

use super::{text_of, Head};

/// The model, system prompt and first user message of a request body.
pub(crate) fn head(body: &[u8]) -> Option<Head> {
    let v: Value = serde_json::from_slice(body).ok()?;
    let system = v.get("system").and_then(text_of);
    let user = v
        .get("messages")?
        .as_array()?
        .iter()
        .find(|m| m.get("role").and_then(Value::as_str) == Some("user"))
        .and_then(|m| m.get("content"))
        .map(|c| match c {
            Value::Array(blocks) => blocks.iter().map(block_text).collect::<Vec<_>>().join("\n"),
            other => text_of(other).unwrap_or_default(),
        });
    (system.is_some() || user.is_some()).then(|| Head {
        model: v.get("model").map(Value::to_string),
        system,
        user,
    })
}

/// A block's text, or for another kind of block the block as JSON without `cache_control`,
/// which a client moves to the newest message on every turn.
fn block_text(block: &Value) -> String {
    if let Some(t) = block.get("text").and_then(Value::as_str) {
        return t.to_owned();
    }
    let mut b = block.clone();
    if let Some(o) = b.as_object_mut() {
        o.shift_remove("cache_control");
    }
    b.to_string()
}

/// Whether an event of type `t` is model output (a content, tool-input or thinking delta).
pub(crate) fn is_token_event(t: &str, v: &Value) -> bool {
    t == "content_block_delta"
        && matches!(
            v.pointer("/delta/type").and_then(Value::as_str),
            Some("text_delta" | "input_json_delta" | "thinking_delta")
        )
}

/// A request as chat messages (the system prompt first) and the rest of its fields, its tools
/// and tool choice in the chat form.
pub(crate) fn to_chat(mut request: Map<String, Value>) -> Option<(Map<String, Value>, Vec<Value>)> {
    let Some(Value::Array(messages)) = request.shift_remove("messages") else {
        return None;
    };
    tools_to_chat(&mut request);
    let mut out = Vec::with_capacity(messages.len() + 1);
    if let Some(system) = request.shift_remove("system").as_ref().and_then(text_of) {
        out.push(json!({"role": "system", "content": system}));
    }
    for m in &messages {
        let content = m.get("content")?;
        match m.get("role").and_then(Value::as_str)? {
            "user" => user_messages(content, &mut out),
            "assistant" => out.push(assistant_message(content)?),
            _ => return None,
        }
    }
    Some((request, out))
}

/// Rewrites `tools` and `tool_choice` in the chat form, as a replay sends them to a chat
/// endpoint, which refuses a tool without `type: function` (llama-server answers 500). A
/// server tool (no `input_schema`: web search, the text editor) has no chat form and is left
/// out.
fn tools_to_chat(request: &mut Map<String, Value>) {
    if let Some(Value::Array(tools)) = request.get_mut("tools") {
        *tools = tools
            .iter()
            .filter_map(|t| {
                let mut function = Map::new();
                function.insert("name".into(), t.get("name")?.clone());
                if let Some(d) = t.get("description") {
                    function.insert("description".into(), d.clone());
                }
                function.insert("parameters".into(), t.get("input_schema")?.clone());
                Some(json!({"type": "function", "function": function}))
            })
            .collect();
    }
    if let Some(choice) = request.get_mut("tool_choice") {
        *choice = match choice.get("type").and_then(Value::as_str) {
            Some("any") => json!("required"),
            Some("tool") => json!({"type": "function", "function": {"name": choice.get("name")}}),
            Some("none") => json!("none"),
            _ => json!("auto"),
        };
    }
}

/// A user message: its `tool_result` blocks as tool messages, then its text as a user message.
fn user_messages(content: &Value, out: &mut Vec<Value>) {
    let Value::Array(blocks) = content else {
        if let Some(t) = text_of(content) {
            out.push(json!({"role": "user", "content": t}));
        }
        return;
    };
    let mut text = Vec::new();
    for b in blocks {
        match b.get("type").and_then(Value::as_str) {
            Some("tool_result") => {
                let id = b.get("tool_use_id").cloned().unwrap_or(Value::Null);
                let result = b.get("content").and_then(text_of).unwrap_or_default();
                out.push(json!({"role": "tool", "tool_call_id": id, "content": result}));
            }
            _ => {
                if let Some(t) = b.get("text").and_then(Value::as_str) {
                    text.push(t);
                }
            }
        }
    }
    if !text.is_empty() {
        out.push(json!({"role": "user", "content": text.join("\n\n")}));
    }
}

/// Assistant content (a string or blocks) as one chat assistant message.
pub(crate) fn assistant_message(content: &Value) -> Option<Value> {
    let blocks = match content {
        Value::String(s) => return Some(json!({"role": "assistant", "content": s})),
        Value::Array(blocks) => blocks,
        _ => return None,
    };
    let (mut text, mut thinking, mut calls) = (String::new(), String::new(), Vec::new());
    for b in blocks {
        match b.get("type").and_then(Value::as_str) {
            Some("text") => text.push_str(b.get("text").and_then(Value::as_str).unwrap_or("")),
            Some("thinking") => {
                thinking.push_str(b.get("thinking").and_then(Value::as_str).unwrap_or(""))
            }
            Some("tool_use") => {
                let args = match b.get("input") {
                    Some(Value::String(s)) => s.clone(),
                    Some(v) => v.to_string(),
                    None => "{}".to_owned(),
                };
                calls.push(json!({"id": b.get("id"), "type": "function",
                    "function": {"name": b.get("name"), "arguments": args}}));
            }
            _ => {}
        }
    }
    let mut m = Map::new();
    m.insert("role".into(), json!("assistant"));
    if !text.is_empty() {
        m.insert("content".into(), json!(text));
    }
    if !calls.is_empty() {
        m.insert("tool_calls".into(), Value::Array(calls));
    }
    if !thinking.is_empty() {
        m.insert("reasoning_content".into(), json!(thinking));
    }
    Some(Value::Object(m))
}

/// The assistant message of an unstreamed response body.
pub(crate) fn reply_json(body: &Value) -> Option<Value> {
    assistant_message(body.get("content")?)
}

/// The assistant message of a stream: its blocks rebuilt from their start events and deltas.
pub(crate) fn reply_sse(body: &[u8]) -> Option<Value> {
    let mut blocks: Vec<Value> = Vec::new();
    let mut partial_json: Vec<String> = Vec::new();
    for data in super::sse::data_of_events(body) {
        let Ok(ev) = serde_json::from_slice::<Value>(data) else {
            continue;
        };
        let index = ev.get("index").and_then(Value::as_u64).unwrap_or(0) as usize;
        match ev.get("type").and_then(Value::as_str) {
            Some("content_block_start") => {
                if index > 1024 || index < blocks.len() {
                    continue;
                }
                blocks.resize(index, Value::Null);
                partial_json.resize(index + 1, String::new());
                blocks.push(ev.get("content_block").cloned().unwrap_or(Value::Null));
            }
            Some("content_block_delta") => {
                let (Some(block), Some(delta)) = (blocks.get_mut(index), ev.get("delta")) else {
                    continue;
                };
                let append = |block: &mut Value, key: &str, s: Option<&str>| {
                    let now = block.get(key).and_then(Value::as_str).unwrap_or("");
                    let joined = format!("{now}{}", s.unwrap_or(""));
                    block[key] = Value::String(joined);
                };
                let field = |k: &str| delta.get(k).and_then(Value::as_str);
                match delta.get("type").and_then(Value::as_str) {
                    Some("text_delta") => append(block, "text", field("text")),
                    Some("thinking_delta") => append(block, "thinking", field("thinking")),
                    Some("input_json_delta") => {
                        partial_json[index].push_str(field("partial_json").unwrap_or(""))
                    }
                    _ => {}
                }
            }
            _ => {}
        }
    }
    for (block, json) in blocks.iter_mut().zip(&partial_json) {
        if !json.is_empty() && block.is_object() {
            block["input"] = Value::String(json.clone());
        }
    }
    assistant_message(&Value::Array(blocks))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tools_and_tool_choice_come_out_in_the_chat_form_a_chat_endpoint_accepts() {
        let request = json!({
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [
                {"name": "read_file", "description": "Read", "input_schema": {"type": "object"}},
                {"type": "web_search_20250305", "name": "web_search"},
            ],
            "tool_choice": {"type": "any"},
        });
        let Value::Object(request) = request else {
            unreachable!()
        };
        let (rest, _) = to_chat(request).unwrap();
        assert_eq!(
            rest["tools"],
            json!([{"type": "function", "function": {
                "name": "read_file", "description": "Read", "parameters": {"type": "object"}}}])
        );
        assert_eq!(rest["tool_choice"], "required");
    }
}
