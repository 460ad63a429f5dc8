//! OpenAI Responses answers → the replayer's [`Decoded`]: text and reasoning from the stream's
//! deltas, function calls, the response id (which a chained next turn names) and token counts
//! from the final response object, and the first token where the recorder puts it: the first
//! text, function-argument or reasoning delta (`crate::wire::responses::is_token_event`),
//! never `response.created`. A stream is complete only at `response.completed` (or
//! `response.incomplete`, a cut-short answer); `response.failed` and `error` fail the turn.

use serde_json::value::RawValue;
use serde_json::{json, Value};

use super::client::Response;
use super::decode::{body_start, sse_data, streamed_output, DecodeError, Decoded, ModelOutput};
use super::decode::{OutputText, Usage};
use crate::wire::responses::is_token_event;

/// What the final response object says: its id, calls, counts and why it ended.
struct Final {
    id: Option<String>,
    calls: Vec<Box<RawValue>>,
    call_ids: Vec<String>,
    usage: Option<Usage>,
    finish_reason: Option<String>,
}

fn final_of(response: &Value) -> Final {
    let mut calls = Vec::new();
    let mut call_ids = Vec::new();
    let items = response.get("output").and_then(Value::as_array);
    for item in items.into_iter().flatten() {
        if item.get("type").and_then(Value::as_str) != Some("function_call") {
            continue;
        }
        let id = item.get("call_id").cloned().unwrap_or(Value::Null);
        if let Some(s) = id.as_str() {
            call_ids.push(s.to_owned());
        }
        let args = match item.get("arguments") {
            Some(Value::String(s)) => s.clone(),
            Some(v) => v.to_string(),
            None => String::new(),
        };
        let call = json!({"index": calls.len(), "id": id, "type": "function",
            "function": {"name": item.get("name"), "arguments": args}});
        calls.push(RawValue::from_string(call.to_string()).expect("a JSON value is raw JSON"));
    }
    let usage = response.get("usage").filter(|u| u.is_object()).map(|u| {
        let n = |p: &str| u.pointer(p).and_then(Value::as_u64);
        Usage {
            prompt_tokens: n("/input_tokens").unwrap_or(0),
            completion_tokens: n("/output_tokens").unwrap_or(0),
            cached_tokens: n("/input_tokens_details/cached_tokens"),
        }
    });
    let status = response.get("status").and_then(Value::as_str);
    let finish_reason = match status {
        Some("incomplete") => Some("length".to_owned()),
        Some("completed") if !calls.is_empty() => Some("tool_calls".to_owned()),
        Some("completed") => Some("stop".to_owned()),
        Some(other) => Some(other.to_owned()),
        None => None,
    };
    Final {
        id: response
            .get("id")
            .and_then(Value::as_str)
            .map(str::to_owned),
        calls,
        call_ids,
        usage,
        finish_reason,
    }
}

/// The reason a failed response or an `error` event gives.
fn failure(v: &Value) -> DecodeError {
    let err = v
        .pointer("/response/error")
        .filter(|e| e.is_object())
        .unwrap_or(v);
    let text = |k: &str| err.get(k).and_then(Value::as_str);
    let code = text("code").or(text("type")).unwrap_or("error");
    DecodeError::Stream(format!("{code}: {}", text("message").unwrap_or("")))
}

/// Decodes a streamed Responses answer.
pub(super) fn stream(resp: &Response) -> Result<Decoded, DecodeError> {
    let (mut content, mut reasoning) = (Vec::new(), Vec::new());
    let mut delta_events = Vec::new();
    let mut last = None;
    for (i, ev) in resp.events.iter().enumerate() {
        let Some(data) = sse_data(&resp.body[ev.start..ev.end]) else {
            continue;
        };
        let trimmed = data.trim_ascii();
        if trimmed == b"[DONE]" {
            break;
        }
        let v: Value = serde_json::from_slice(trimmed)
            .map_err(|e| DecodeError::Malformed(format!("SSE event {i}: {e}")))?;
        let kind = v.get("type").and_then(Value::as_str).unwrap_or("");
        let delta = || {
            v.get("delta")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_owned()
        };
        if kind == "response.output_text.delta" {
            content.push(delta());
        } else if kind.starts_with("response.reasoning") && kind.ends_with(".delta") {
            reasoning.push(delta());
        }
        if is_token_event(kind) {
            delta_events.push(i);
        }
        match kind {
            "response.completed" | "response.incomplete" => {
                last = Some(final_of(v.get("response").unwrap_or(&Value::Null)));
                break;
            }
            "response.failed" | "error" => return Err(failure(&v)),
            _ => {}
        }
    }
    let Some(done) = last else {
        return Err(DecodeError::Malformed(format!(
            "the stream ended without response.completed ({} events, {})",
            resp.events.len(),
            body_start(&resp.body)
        )));
    };
    Ok(Decoded {
        output: streamed_output(content, reasoning, done.calls),
        finish_reason: done.finish_reason,
        usage: done.usage,
        delta_events,
        response_id: done.id,
        call_ids: done.call_ids,
    })
}

/// Decodes an unstreamed Responses answer (the response object).
pub(super) fn json(body: &[u8]) -> Result<Decoded, DecodeError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| DecodeError::Malformed(format!("{e} ({})", body_start(body))))?;
    if v.get("error").is_some_and(Value::is_object) || v.get("status") == Some(&json!("failed")) {
        return Err(failure(&json!({"response": v})));
    }
    let items = v
        .get("output")
        .and_then(Value::as_array)
        .ok_or_else(|| DecodeError::Malformed("a response without output items".into()))?;
    let (mut text, mut thinking) = (String::new(), String::new());
    for item in items {
        let parts = |k: &str| {
            item.get(k)
                .and_then(crate::wire::text_of)
                .unwrap_or_default()
        };
        match item.get("type").and_then(Value::as_str) {
            Some("message") => text.push_str(&parts("content")),
            Some("reasoning") => thinking.push_str(&parts("content")),
            _ => {}
        }
    }
    let done = final_of(&v);
    Ok(Decoded {
        output: ModelOutput {
            output: OutputText::Text(text),
            reasoning: (!thinking.is_empty()).then_some(OutputText::Text(thinking)),
            tool_calls: (!done.calls.is_empty()).then_some(done.calls),
        },
        finish_reason: done.finish_reason,
        usage: done.usage,
        delta_events: Vec::new(),
        response_id: done.id,
        call_ids: done.call_ids,
    })
}
