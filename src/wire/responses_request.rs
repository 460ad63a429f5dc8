//! A Chat Completions request body rewritten as an OpenAI Responses one: the first system
//! message becomes `instructions`, later ones developer messages; the rest become `input`
//! items (`message`, `reasoning`, `function_call`, `function_call_output`).
//!
//! Stateless by default (`store: false`, the whole conversation every turn, as chat sends
//! it). Chained, as Codex talks to its server, a turn names the previous response
//! (`previous_response_id`) and sends only the items after it: the server must still hold
//! that response, which is what a replay through a router tests.

use std::collections::HashMap;

use serde_json::{json, Map, Value};

use super::text_of;

/// A turn of a chained conversation: stored, and continuing the previous turn's response
/// once there is one.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Chain<'a> {
    /// The id of the response the server created for the previous turn (none on the first).
    pub previous_response_id: Option<&'a str>,
    /// Messages of the chat body the previous turn already sent; the assistant messages that
    /// follow them are the recorded reply, which the stored response replaces.
    pub sent_messages: usize,
    /// The function-call ids of the stored response, in order: the recorded calls' ids are
    /// mapped onto them by position, so each output answers a call the server knows.
    pub call_ids: &'a [String],
}

/// The Responses body of a chat body, stateless or a turn of `chain`.
pub(crate) fn from_chat(chat: &Map<String, Value>, chain: Option<Chain<'_>>) -> Map<String, Value> {
    let mut out = Map::new();
    if let Some(model) = chat.get("model") {
        out.insert("model".into(), model.clone());
    }
    let empty = Vec::new();
    let messages = chat
        .get("messages")
        .and_then(Value::as_array)
        .unwrap_or(&empty);
    let instructions_at = messages
        .iter()
        .position(|m| m.get("role").and_then(Value::as_str) == Some("system"));
    // Instructions do not carry over from a previous response: every turn repeats them.
    if let Some(text) = instructions_at.and_then(|i| messages[i].get("content").and_then(text_of)) {
        out.insert("instructions".into(), Value::String(text));
    }
    let (from, renamed) = match chain {
        Some(c) if c.previous_response_id.is_some() => continued_from(messages, c),
        _ => (0, HashMap::new()),
    };
    let mut input = Vec::new();
    for (i, m) in messages.iter().enumerate().skip(from) {
        if Some(i) != instructions_at {
            items(m, &renamed, &mut input);
        }
    }
    out.insert("input".into(), Value::Array(input));
    if let Some(id) = chain.and_then(|c| c.previous_response_id) {
        out.insert("previous_response_id".into(), Value::String(id.to_owned()));
    }
    let max = ["max_completion_tokens", "max_tokens"]
        .iter()
        .find_map(|k| chat.get(*k).filter(|v| v.is_u64()));
    if let Some(max) = max {
        out.insert("max_output_tokens".into(), max.clone());
    }
    for key in ["stream", "temperature", "top_p"] {
        if let Some(v) = chat.get(key).filter(|v| !v.is_null()) {
            out.insert(key.into(), v.clone());
        }
    }
    // A chained conversation lives on the server, so the server must keep each response.
    out.insert("store".into(), Value::Bool(chain.is_some()));
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

/// Where the new messages start (after the recorded reply), and the recorded call ids
/// renamed to the stored response's.
fn continued_from(messages: &[Value], c: Chain<'_>) -> (usize, HashMap<String, String>) {
    let mut from = c.sent_messages.min(messages.len());
    let mut recorded = Vec::new();
    while let Some(m) = messages.get(from) {
        if m.get("role").and_then(Value::as_str) != Some("assistant") {
            break;
        }
        let calls = m.get("tool_calls").and_then(Value::as_array);
        for call in calls.into_iter().flatten() {
            if let Some(id) = call.get("id").and_then(Value::as_str) {
                recorded.push(id.to_owned());
            }
        }
        from += 1;
    }
    let renamed = recorded
        .into_iter()
        .zip(c.call_ids.iter().cloned())
        .collect();
    (from, renamed)
}

fn tool(t: &Value) -> Option<Value> {
    let f = t.get("function")?;
    let mut m = Map::new();
    m.insert("type".into(), json!("function"));
    m.insert("name".into(), f.get("name")?.clone());
    for key in ["description", "parameters", "strict"] {
        if let Some(v) = f.get(key).filter(|v| !v.is_null()) {
            m.insert(key.into(), v.clone());
        }
    }
    Some(Value::Object(m))
}

fn tool_choice(c: &Value) -> Option<Value> {
    match c {
        Value::String(_) => Some(c.clone()),
        other => {
            let name = other.pointer("/function/name")?;
            Some(json!({"type": "function", "name": name}))
        }
    }
}

/// The input items of one chat message.
fn items(m: &Value, renamed: &HashMap<String, String>, out: &mut Vec<Value>) {
    let text = || m.get("content").and_then(text_of).unwrap_or_default();
    match m.get("role").and_then(Value::as_str) {
        Some("system" | "developer") => {
            out.push(json!({"type": "message", "role": "developer", "content": text()}))
        }
        Some("assistant") => {
            let reasoning = ["reasoning_content", "reasoning"]
                .iter()
                .find_map(|k| m.get(*k).and_then(Value::as_str))
                .filter(|r| !r.is_empty());
            if let Some(r) = reasoning {
                out.push(json!({"type": "reasoning", "summary": [],
                    "content": [{"type": "reasoning_text", "text": r}]}));
            }
            let content = text();
            if !content.is_empty() {
                out.push(json!({"type": "message", "role": "assistant",
                    "content": [{"type": "output_text", "text": content}]}));
            }
            let calls = m.get("tool_calls").and_then(Value::as_array);
            for call in calls.into_iter().flatten() {
                let arguments = match call.pointer("/function/arguments") {
                    Some(Value::String(s)) => s.clone(),
                    Some(v) => v.to_string(),
                    None => "{}".to_owned(),
                };
                out.push(json!({
                    "type": "function_call",
                    "call_id": call.get("id").cloned().unwrap_or(Value::Null),
                    "name": call.pointer("/function/name").cloned().unwrap_or(Value::Null),
                    "arguments": arguments,
                }));
            }
        }
        Some("tool") => {
            let id = m.get("tool_call_id").cloned().unwrap_or(Value::Null);
            let id = match id.as_str().and_then(|s| renamed.get(s)) {
                Some(live) => Value::String(live.clone()),
                None => id,
            };
            out.push(json!({"type": "function_call_output", "call_id": id, "output": text()}));
        }
        _ => out.push(json!({"type": "message", "role": "user", "content": text()})),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat() -> Value {
        json!({
            "model": "m", "max_completion_tokens": 64, "stream": true,
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "list files"},
                {"role": "assistant", "content": "ok", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "bash", "arguments": "{\"cmd\":\"ls\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "a b"}
            ],
            "tools": [{"type": "function", "function": {"name": "bash", "parameters": {}}}]
        })
    }

    #[test]
    fn stateless_turns_carry_the_whole_conversation_unstored() {
        let r = Value::Object(from_chat(chat().as_object().unwrap(), None));
        assert_eq!(r["instructions"], "be brief");
        assert_eq!(r["store"], false);
        assert_eq!(r["max_output_tokens"], 64);
        let kinds: Vec<_> = r["input"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["type"].as_str().unwrap())
            .collect();
        assert_eq!(
            kinds,
            [
                "message",
                "message",
                "function_call",
                "function_call_output"
            ]
        );
        assert_eq!(r["input"][3]["call_id"], "call_1");
        assert_eq!(r["tools"][0]["name"], "bash");
        let first = from_chat(chat().as_object().unwrap(), Some(Chain::default()));
        assert_eq!(first["store"], true, "a chain's first turn is stored");
        assert_eq!(first["input"], r["input"]);
    }

    #[test]
    fn a_chained_turn_sends_only_new_items_answering_the_stored_calls() {
        let ids = ["call_live".to_string()];
        let chain = Chain {
            previous_response_id: Some("resp_1"),
            sent_messages: 2,
            call_ids: &ids,
        };
        let r = Value::Object(from_chat(chat().as_object().unwrap(), Some(chain)));
        assert_eq!(r["previous_response_id"], "resp_1");
        assert_eq!(r["store"], true);
        assert_eq!(r["instructions"], "be brief");
        assert_eq!(
            r["input"],
            json!([{"type": "function_call_output", "call_id": "call_live", "output": "a b"}])
        );
    }
}
