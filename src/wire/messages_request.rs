//! A Chat Completions request body rewritten as an Anthropic Messages one, so the replayer
//! drives a Messages server with the same conversation: system messages become the top-level
//! `system`; assistant turns become `thinking`, `text` and `tool_use` blocks; tool messages
//! become `tool_result` blocks of the next user message (Messages alternates user and
//! assistant, so neighbours of one role are merged). Sampling fields Messages does not define
//! (penalties, seed, template kwargs) are left out: a strict server refuses unknown fields.

use serde_json::{json, Map, Value};

use super::text_of;

/// The `anthropic-version` header value the requests are written for.
pub(crate) const ANTHROPIC_VERSION: &str = "2023-06-01";

/// The Messages body of a chat body (`model`, `messages`, `max_completion_tokens`, …).
pub(crate) fn from_chat(chat: &Map<String, Value>) -> Map<String, Value> {
    let mut out = Map::new();
    if let Some(model) = chat.get("model") {
        out.insert("model".into(), model.clone());
    }
    let empty = Vec::new();
    let messages = chat
        .get("messages")
        .and_then(Value::as_array)
        .unwrap_or(&empty);
    let (system, turns) = convert(messages);
    if !system.is_empty() {
        out.insert("system".into(), Value::String(system.join("\n\n")));
    }
    out.insert("messages".into(), Value::Array(turns));
    // Required by Messages; the chat body always carries one of these.
    let max_tokens = ["max_completion_tokens", "max_tokens"]
        .iter()
        .find_map(|k| chat.get(*k).filter(|v| v.is_u64()))
        .cloned()
        .unwrap_or(json!(1024));
    out.insert("max_tokens".into(), max_tokens);
    for key in ["stream", "temperature", "top_p", "top_k"] {
        if let Some(v) = chat.get(key).filter(|v| !v.is_null()) {
            out.insert(key.into(), v.clone());
        }
    }
    match chat.get("stop") {
        Some(Value::String(s)) => {
            out.insert("stop_sequences".into(), json!([s]));
        }
        Some(list @ Value::Array(_)) => {
            out.insert("stop_sequences".into(), list.clone());
        }
        _ => {}
    }
    if let Some(tools) = chat.get("tools").and_then(Value::as_array) {
        out.insert(
            "tools".into(),
            Value::Array(tools.iter().filter_map(tool).collect()),
        );
    }
    if let Some(choice) = chat.get("tool_choice").and_then(tool_choice) {
        out.insert("tool_choice".into(), choice);
    }
    out
}

/// A chat function tool as a Messages tool (`name`, `description`, `input_schema`).
fn tool(t: &Value) -> Option<Value> {
    let f = t.get("function")?;
    let mut m = Map::new();
    m.insert("name".into(), f.get("name")?.clone());
    if let Some(d) = f.get("description").filter(|d| d.is_string()) {
        m.insert("description".into(), d.clone());
    }
    let schema = f
        .get("parameters")
        .filter(|p| p.is_object())
        .cloned()
        .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
    m.insert("input_schema".into(), schema);
    Some(Value::Object(m))
}

fn tool_choice(c: &Value) -> Option<Value> {
    match c {
        Value::String(s) => match s.as_str() {
            "auto" => Some(json!({"type": "auto"})),
            "none" => Some(json!({"type": "none"})),
            "required" => Some(json!({"type": "any"})),
            _ => None,
        },
        other => {
            let name = other.pointer("/function/name")?;
            Some(json!({"type": "tool", "name": name}))
        }
    }
}

/// System texts, and the other messages as alternating Messages turns.
fn convert(messages: &[Value]) -> (Vec<String>, Vec<Value>) {
    let mut system = Vec::new();
    let mut turns: Vec<(&'static str, Vec<Value>)> = Vec::new();
    for m in messages {
        let (role, blocks) = match m.get("role").and_then(Value::as_str) {
            Some("system" | "developer") => {
                if let Some(t) = m.get("content").and_then(text_of) {
                    system.push(t);
                }
                continue;
            }
            Some("assistant") => ("assistant", assistant_blocks(m)),
            Some("tool") => ("user", vec![tool_result(m)]),
            _ => ("user", user_blocks(m.get("content"))),
        };
        match turns.last_mut() {
            Some((last, blocks_so_far)) if *last == role => blocks_so_far.extend(blocks),
            _ => turns.push((role, blocks)),
        }
    }
    let turns = turns
        .into_iter()
        .map(|(role, blocks)| json!({"role": role, "content": blocks}))
        .collect();
    (system, turns)
}

fn text_block(text: String) -> Value {
    json!({"type": "text", "text": text})
}

fn user_blocks(content: Option<&Value>) -> Vec<Value> {
    match content {
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .map(|t| text_block(t.to_owned()))
            .collect(),
        Some(c) => vec![text_block(text_of(c).unwrap_or_default())],
        None => vec![text_block(String::new())],
    }
}

/// Thinking first, then text, then tool calls: the order a Messages model emits them.
fn assistant_blocks(m: &Value) -> Vec<Value> {
    let mut blocks = Vec::new();
    let reasoning = ["reasoning_content", "reasoning"]
        .iter()
        .find_map(|k| m.get(*k).and_then(Value::as_str))
        .filter(|r| !r.is_empty());
    if let Some(r) = reasoning {
        blocks.push(json!({"type": "thinking", "thinking": r}));
    }
    if let Some(t) = m.get("content").and_then(text_of).filter(|t| !t.is_empty()) {
        blocks.push(text_block(t));
    }
    for call in m
        .get("tool_calls")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let args = call.pointer("/function/arguments");
        let input = match args {
            Some(Value::String(s)) => serde_json::from_str::<Value>(s).ok(),
            Some(v) => Some(v.clone()),
            None => None,
        }
        .filter(Value::is_object)
        .unwrap_or_else(|| json!({}));
        blocks.push(json!({
            "type": "tool_use",
            "id": call.get("id").cloned().unwrap_or(Value::Null),
            "name": call.pointer("/function/name").cloned().unwrap_or(Value::Null),
            "input": input,
        }));
    }
    if blocks.is_empty() {
        blocks.push(text_block(String::new()));
    }
    blocks
}

fn tool_result(m: &Value) -> Value {
    json!({
        "type": "tool_result",
        "tool_use_id": m.get("tool_call_id").cloned().unwrap_or(Value::Null),
        "content": m.get("content").and_then(text_of).unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_results_answer_the_tool_use_ids_in_the_next_user_turn() {
        let chat = json!({
            "model": "m", "max_completion_tokens": 64, "stream": true, "seed": 3,
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "list files"},
                {"role": "assistant", "reasoning_content": "use ls", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "bash", "arguments": "{\"cmd\":\"ls\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "a b"},
                {"role": "user", "content": "and now?"}
            ],
            "tools": [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}],
            "tool_choice": "required"
        });
        let m = Value::Object(from_chat(chat.as_object().unwrap()));
        assert_eq!(m["system"], "be brief");
        assert_eq!(m["max_tokens"], 64);
        assert!(m.get("seed").is_none());
        let turns = m["messages"].as_array().unwrap();
        let roles: Vec<_> = turns.iter().map(|t| t["role"].as_str().unwrap()).collect();
        assert_eq!(roles, ["user", "assistant", "user"]);
        assert_eq!(turns[1]["content"][0]["type"], "thinking");
        assert_eq!(turns[1]["content"][1]["id"], "call_1");
        assert_eq!(turns[1]["content"][1]["input"]["cmd"], "ls");
        assert_eq!(turns[2]["content"][0]["tool_use_id"], "call_1");
        assert_eq!(turns[2]["content"][1]["text"], "and now?");
        assert_eq!(m["tools"][0]["input_schema"]["type"], "object");
        assert_eq!(m["tool_choice"]["type"], "any");
    }
}
