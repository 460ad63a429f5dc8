//! Anthropic Messages responses → the replayer's [`Decoded`]: text, thinking and tool calls
//! rebuilt from the stream's blocks (or the unstreamed `content`), token counts from its
//! usage, and the first token where the recorder puts it: the first `text_delta`,
//! `thinking_delta` or `input_json_delta` (`crate::wire::messages::is_token_event`), never
//! `message_start` or a `ping`. A stream is complete only at `message_stop`.

use serde_json::value::RawValue;
use serde_json::{json, Value};

use super::client::Response;
use super::decode::{body_start, sse_data, streamed_output, DecodeError, Decoded, ModelOutput};
use super::decode::{OutputText, Usage};
use crate::wire::messages::is_token_event;

/// A `tool_use` block being streamed: its id, name and the JSON of its input so far.
#[derive(Default)]
struct ToolUse {
    id: Value,
    name: Value,
    input: String,
}

/// Token counts of `message_start` and `message_delta` (the latter's are cumulative).
#[derive(Default)]
struct Counts {
    input: u64,
    cache_read: Option<u64>,
    cache_write: u64,
    output: u64,
}

impl Counts {
    fn update(&mut self, usage: &Value) {
        let n = |k: &str| usage.get(k).and_then(Value::as_u64);
        if let Some(v) = n("input_tokens") {
            self.input = v;
        }
        if let Some(v) = n("cache_read_input_tokens") {
            self.cache_read = Some(v);
        }
        if let Some(v) = n("cache_creation_input_tokens") {
            self.cache_write = v;
        }
        if let Some(v) = n("output_tokens") {
            self.output = v;
        }
    }

    /// Messages counts cached and newly cached prompt tokens apart from `input_tokens`.
    fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.input + self.cache_read.unwrap_or(0) + self.cache_write,
            completion_tokens: self.output,
            cached_tokens: self.cache_read,
        }
    }
}

/// `stop_reason` in the chat vocabulary the metrics count.
fn finish(stop_reason: &str) -> String {
    match stop_reason {
        "end_turn" | "stop_sequence" => "stop",
        "max_tokens" => "length",
        "tool_use" => "tool_calls",
        other => other,
    }
    .to_owned()
}

fn stream_error(v: &Value) -> DecodeError {
    let err = v.get("error").unwrap_or(v);
    let text = |k: &str| err.get(k).and_then(Value::as_str).unwrap_or("");
    DecodeError::Stream(format!("{}: {}", text("type"), text("message")))
}

fn tool_call(index: usize, t: &ToolUse) -> Box<RawValue> {
    let args = if t.input.is_empty() { "{}" } else { &t.input };
    let call = json!({"index": index, "id": t.id, "type": "function",
        "function": {"name": t.name, "arguments": args}});
    RawValue::from_string(call.to_string()).expect("a JSON value is raw JSON")
}

/// Decodes a streamed Messages answer.
pub(super) fn stream(resp: &Response) -> Result<Decoded, DecodeError> {
    let (mut content, mut reasoning) = (Vec::new(), Vec::new());
    let mut tools: Vec<(usize, ToolUse)> = Vec::new();
    let mut counts = Counts::default();
    let mut saw_usage = false;
    let mut finish_reason = None;
    let mut delta_events = Vec::new();
    let (mut started, mut stopped) = (false, false);
    for (i, ev) in resp.events.iter().enumerate() {
        let Some(data) = sse_data(&resp.body[ev.start..ev.end]) else {
            continue;
        };
        let v: Value = serde_json::from_slice(data.trim_ascii())
            .map_err(|e| DecodeError::Malformed(format!("SSE event {i}: {e}")))?;
        let kind = v.get("type").and_then(Value::as_str).unwrap_or("");
        match kind {
            "message_start" => {
                started = true;
                if let Some(u) = v.pointer("/message/usage") {
                    counts.update(u);
                    saw_usage = true;
                }
            }
            "content_block_start" => {
                let block = v.get("content_block").unwrap_or(&Value::Null);
                if block.get("type").and_then(Value::as_str) == Some("tool_use") {
                    let index = v.get("index").and_then(Value::as_u64).unwrap_or(0) as usize;
                    let id = block.get("id").cloned().unwrap_or(Value::Null);
                    let name = block.get("name").cloned().unwrap_or(Value::Null);
                    let input = String::new();
                    tools.push((index, ToolUse { id, name, input }));
                }
            }
            "content_block_delta" => {
                let text = |k: &str| v.pointer(k).and_then(Value::as_str).unwrap_or("");
                match text("/delta/type") {
                    "text_delta" => content.push(text("/delta/text").to_owned()),
                    "thinking_delta" => reasoning.push(text("/delta/thinking").to_owned()),
                    "input_json_delta" => {
                        let index = v.get("index").and_then(Value::as_u64).unwrap_or(0) as usize;
                        if let Some((_, t)) = tools.iter_mut().find(|(i, _)| *i == index) {
                            t.input.push_str(text("/delta/partial_json"));
                        }
                    }
                    _ => {}
                }
                if is_token_event(kind, &v) {
                    delta_events.push(i);
                }
            }
            "message_delta" => {
                if let Some(r) = v.pointer("/delta/stop_reason").and_then(Value::as_str) {
                    finish_reason = Some(finish(r));
                }
                if let Some(u) = v.get("usage") {
                    counts.update(u);
                    saw_usage = true;
                }
            }
            "message_stop" => {
                stopped = true;
                break;
            }
            "error" => return Err(stream_error(&v)),
            _ => {}
        }
    }
    if !started {
        return Err(DecodeError::Malformed(format!(
            "the stream carried no message_start event ({} events, {})",
            resp.events.len(),
            body_start(&resp.body)
        )));
    }
    if !stopped {
        return Err(DecodeError::Malformed(
            "the stream ended without message_stop".into(),
        ));
    }
    let calls = tools
        .iter()
        .enumerate()
        .map(|(n, (_, t))| tool_call(n, t))
        .collect();
    Ok(Decoded {
        output: streamed_output(content, reasoning, calls),
        finish_reason,
        usage: saw_usage.then(|| counts.usage()),
        delta_events,
        response_id: None,
        call_ids: Vec::new(),
    })
}

/// Decodes an unstreamed Messages answer (`{"type": "message", "content": [...]}`).
pub(super) fn json(body: &[u8]) -> Result<Decoded, DecodeError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| DecodeError::Malformed(format!("{e} ({})", body_start(body))))?;
    if v.get("type").and_then(Value::as_str) == Some("error") {
        return Err(stream_error(&v));
    }
    let blocks = v
        .get("content")
        .and_then(Value::as_array)
        .ok_or_else(|| DecodeError::Malformed("a message without content blocks".into()))?;
    let (mut text, mut thinking, mut calls) = (String::new(), String::new(), Vec::new());
    for b in blocks {
        let s = |k: &str| b.get(k).and_then(Value::as_str).unwrap_or("");
        match s("type") {
            "text" => text.push_str(s("text")),
            "thinking" => thinking.push_str(s("thinking")),
            "tool_use" => {
                let t = ToolUse {
                    id: b.get("id").cloned().unwrap_or(Value::Null),
                    name: b.get("name").cloned().unwrap_or(Value::Null),
                    input: b.get("input").map(Value::to_string).unwrap_or_default(),
                };
                calls.push(tool_call(calls.len(), &t));
            }
            _ => {}
        }
    }
    let mut counts = Counts::default();
    let usage = v.get("usage").map(|u| {
        counts.update(u);
        counts.usage()
    });
    Ok(Decoded {
        output: ModelOutput {
            output: OutputText::Text(text),
            reasoning: (!thinking.is_empty()).then_some(OutputText::Text(thinking)),
            tool_calls: (!calls.is_empty()).then_some(calls),
        },
        finish_reason: v.get("stop_reason").and_then(Value::as_str).map(finish),
        usage,
        delta_events: Vec::new(),
        response_id: None,
        call_ids: Vec::new(),
    })
}
