//! OpenAI Responses (`POST /v1/responses`): its conversation head, its streamed token events,
//! the id of the response a backend created, and its turns as chat messages.
//!
//! A request has `instructions` and an `input` that is a string or items: `message` (role and
//! content parts), `function_call`, `function_call_output` and `reasoning`. With
//! `previous_response_id` the backend that created that response holds the conversation, and
//! the request carries only the new items. A stream is `response.created`, then item and
//! delta events (`response.output_text.delta`, `response.function_call_arguments.delta`,
//! `response.reasoning*.delta`), and `response.completed` with the whole response.

use serde_json::{json, Map, Value};

use super::{text_of, Head};

/// The model, instructions and first user message of a request body.
pub(crate) fn head(body: &[u8]) -> Option<Head> {
    let v: Value = serde_json::from_slice(body).ok()?;
    let mut system = v.get("instructions").and_then(text_of);
    let user = match v.get("input")? {
        Value::String(s) => Some(s.clone()),
        Value::Array(items) => {
            let role = |i: &Value| i.get("role").and_then(Value::as_str).map(str::to_owned);
            if system.is_none() {
                system = items
                    .iter()
                    .find(|i| matches!(role(i).as_deref(), Some("system" | "developer")))
                    .and_then(|i| i.get("content"))
                    .and_then(text_of);
            }
            items
                .iter()
                .find(|i| role(i).as_deref() == Some("user"))
                .and_then(|i| i.get("content"))
                .and_then(text_of)
        }
        _ => None,
    };
    (system.is_some() || user.is_some()).then(|| Head {
        model: v.get("model").map(Value::to_string),
        system,
        user,
    })
}

/// Whether an event of type `t` is model output: text, function-call arguments or reasoning.
pub(crate) fn is_token_event(t: &str) -> bool {
    t == "response.output_text.delta"
        || t == "response.function_call_arguments.delta"
        || (t.starts_with("response.reasoning") && t.ends_with(".delta"))
}

/// A request as chat messages (instructions first) and the rest of its fields, among them
/// `previous_response_id`, which the export uses to put the conversation back together.
pub(crate) fn to_chat(mut request: Map<String, Value>) -> Option<(Map<String, Value>, Vec<Value>)> {
    let input = request.shift_remove("input")?;
    tools_to_chat(&mut request);
    let mut out = Vec::new();
    if let Some(i) = request
        .shift_remove("instructions")
        .as_ref()
        .and_then(text_of)
    {
        out.push(json!({"role": "system", "content": i}));
    }
    match input {
        Value::String(s) => out.push(json!({"role": "user", "content": s})),
        Value::Array(items) => items_to_chat(&items, &mut out)?,
        _ => return None,
    }
    Some((request, out))
}

/// Rewrites `tools` and `tool_choice` in the chat form (the function's fields under
/// `function`), as a replay sends them to a chat endpoint, which refuses a tool without it.
/// A built-in tool (web search, file search) has no chat form and is left out.
fn tools_to_chat(request: &mut Map<String, Value>) {
    if let Some(Value::Array(tools)) = request.get_mut("tools") {
        *tools = tools
            .iter()
            .filter(|t| t.get("type").and_then(Value::as_str) == Some("function"))
            .filter_map(|t| {
                let mut function = t.as_object()?.clone();
                function.shift_remove("type");
                Some(json!({"type": "function", "function": function}))
            })
            .collect();
    }
    if let Some(choice) = request.get_mut("tool_choice") {
        if choice.get("type").and_then(Value::as_str) == Some("function") {
            *choice = json!({"type": "function", "function": {"name": choice.get("name")}});
        }
    }
}

/// Appends `items` as chat messages; consecutive assistant items (text, reasoning, function
/// calls) become one assistant message, as one model turn produced them.
fn items_to_chat(items: &[Value], out: &mut Vec<Value>) -> Option<()> {
    let mut turn: Option<Map<String, Value>> = None;
    let flush = |turn: &mut Option<Map<String, Value>>, out: &mut Vec<Value>| {
        if let Some(m) = turn.take() {
            out.push(Value::Object(m));
        }
    };
    for item in items {
        let kind = item
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("message");
        let role = item.get("role").and_then(Value::as_str);
        let assistant = || {
            let mut m = Map::new();
            m.insert("role".into(), json!("assistant"));
            m
        };
        match (kind, role) {
            ("message", Some("assistant")) => {
                let m = turn.get_or_insert_with(assistant);
                let text = item.get("content").and_then(text_of).unwrap_or_default();
                append(m, "content", &text);
            }
            ("reasoning", _) => {
                let m = turn.get_or_insert_with(assistant);
                append(m, "reasoning_content", &reasoning_text(item));
            }
            ("function_call", _) => {
                let m = turn.get_or_insert_with(assistant);
                let call = json!({"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"),
                                 "arguments": item.get("arguments").cloned().unwrap_or(json!(""))}});
                match m.get_mut("tool_calls").and_then(Value::as_array_mut) {
                    Some(calls) => calls.push(call),
                    None => {
                        m.insert("tool_calls".into(), json!([call]));
                    }
                }
            }
            ("function_call_output", _) => {
                flush(&mut turn, out);
                let output = item.get("output").and_then(text_of).unwrap_or_default();
                out.push(
                    json!({"role": "tool", "tool_call_id": item.get("call_id"), "content": output}),
                );
            }
            ("message", Some(r @ ("user" | "system" | "developer"))) => {
                flush(&mut turn, out);
                let r = if r == "user" { "user" } else { "system" };
                let text = item.get("content").and_then(text_of)?;
                out.push(json!({"role": r, "content": text}));
            }
            _ => {}
        }
    }
    flush(&mut turn, out);
    Some(())
}

fn append(m: &mut Map<String, Value>, key: &str, text: &str) {
    if text.is_empty() {
        return;
    }
    let now = m.get(key).and_then(Value::as_str).unwrap_or("");
    let joined = format!("{now}{text}");
    m.insert(key.into(), Value::String(joined));
}

/// A reasoning item's text: its `content` parts, else its `summary` parts.
fn reasoning_text(item: &Value) -> String {
    let parts = |k: &str| item.get(k).and_then(text_of).filter(|t| !t.is_empty());
    parts("content")
        .or_else(|| parts("summary"))
        .unwrap_or_default()
}

/// The assistant message of a response object (`output` items), with the response's `id`
/// kept on it so a later `previous_response_id` finds it.
pub(crate) fn reply_json(response: &Value) -> Option<Value> {
    let items = response.get("output")?.as_array()?;
    let mut out = Vec::new();
    items_to_chat(items, &mut out)?;
    let mut m = out
        .into_iter()
        .find(|m| m.get("role").and_then(Value::as_str) == Some("assistant"))?;
    if let Some(id) = response.get("id").filter(|id| id.is_string()) {
        m["id"] = id.clone();
    }
    Some(m)
}

/// The assistant message of a stream: from its `response.completed` (or `.incomplete`) event,
/// which carries the whole response.
pub(crate) fn reply_sse(body: &[u8]) -> Option<Value> {
    super::sse::data_of_events(body)
        .filter_map(|d| serde_json::from_slice::<Value>(d).ok())
        .filter(|ev| {
            // A reply the output cap cut ends with `response.incomplete` instead.
            matches!(
                ev.get("type").and_then(Value::as_str),
                Some("response.completed" | "response.incomplete")
            )
        })
        .last()
        .and_then(|ev| reply_json(ev.get("response")?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn function_tools_and_a_named_tool_choice_come_out_in_the_chat_form() {
        let request = json!({
            "input": "hi",
            "tools": [
                {"type": "function", "name": "read_file", "parameters": {"type": "object"}},
                {"type": "web_search"},
            ],
            "tool_choice": {"type": "function", "name": "read_file"},
        });
        let Value::Object(request) = request else {
            unreachable!()
        };
        let (rest, _) = to_chat(request).unwrap();
        assert_eq!(
            rest["tools"],
            json!([{"type": "function", "function": {
                "name": "read_file", "parameters": {"type": "object"}}}])
        );
        assert_eq!(
            rest["tool_choice"],
            json!({"type": "function", "function": {"name": "read_file"}})
        );
    }
}
