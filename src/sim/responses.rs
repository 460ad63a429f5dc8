//! OpenAI Responses on the simulator (`POST /v1/responses`): the request read through
//! `crate::wire::responses` into the chat form the engine plans from, with the stored
//! conversation of `previous_response_id` in front, and the reply rendered as output items and
//! named stream events.

use std::sync::Arc;

use serde_json::{json, Map, Value};

use super::api::{messages_of, Turn};
use super::engine::Timings;
use super::generate::{Delta, FinishReason, Reply};
use super::response_store::ResponseStore;

/// Why a Responses request was refused: the status and OpenAI-shaped body.
#[derive(Debug)]
pub(crate) struct Refusal {
    pub status: u16,
    pub body: Value,
}

fn invalid(message: String) -> Refusal {
    Refusal {
        status: 400,
        body: json!({"error": {"message": message, "type": "invalid_request_error",
            "param": null, "code": 400}}),
    }
}

/// A request read, with what to keep once it is answered.
#[derive(Debug)]
pub(crate) struct Planned {
    pub turn: Turn,
    /// The conversation so far (without instructions), kept with the reply unless
    /// `store: false`.
    pub keep: Option<Vec<Value>>,
    /// Echoed in the response object.
    pub previous_response_id: Option<String>,
}

/// Reads a Responses body; `previous_response_id` is looked up in `store`, and an unknown one
/// is refused as vLLM refuses it (404, `invalid_request_error`, param `response_id`).
pub(crate) fn turn(body: &[u8], store: &ResponseStore) -> Result<Planned, Refusal> {
    let mut request: Map<String, Value> =
        serde_json::from_slice(body).map_err(|e| invalid(format!("invalid request body: {e}")))?;
    let field = |k: &str| request.get(k).cloned();
    let model = field("model").and_then(|m| m.as_str().map(str::to_owned));
    let stream = field("stream").and_then(|v| v.as_bool()).unwrap_or(false);
    let keep = field("store").and_then(|v| v.as_bool()).unwrap_or(true);
    let max_tokens = field("max_output_tokens").and_then(|v| v.as_u64());
    let thinking = field("reasoning").is_some_and(|r| !r.is_null());
    let tools = match field("tools") {
        Some(Value::Array(tools)) => Some(tools.iter().filter_map(chat_tool).collect()),
        Some(Value::Null) | None => None,
        Some(_) => return Err(invalid("tools: must be an array".into())),
    };
    let tool_choice = field("tool_choice").as_ref().and_then(chat_tool_choice);
    let previous = match field("previous_response_id") {
        Some(Value::String(id)) => Some(id),
        Some(Value::Null) | None => None,
        Some(_) => return Err(invalid("previous_response_id: must be a string".into())),
    };
    let instructions = request.shift_remove("instructions");
    if !matches!(
        request.get("input"),
        Some(Value::String(_) | Value::Array(_))
    ) {
        return Err(invalid(
            "input: must be a string or an array of items".into(),
        ));
    }
    let (_, new) = crate::wire::responses::to_chat(request)
        .ok_or_else(|| invalid("input: every message item needs text content".into()))?;
    let mut conversation = match &previous {
        None => Vec::new(),
        Some(id) => store.get(id).ok_or_else(|| not_found(id))?.as_ref().clone(),
    };
    conversation.extend(new);
    let mut all = Vec::with_capacity(conversation.len() + 1);
    if let Some(text) = instructions.as_ref().and_then(crate::wire::text_of) {
        all.push(json!({"role": "system", "content": text}));
    }
    all.extend(conversation.iter().cloned());
    let messages = messages_of(all).map_err(|e| invalid(format!("input: {e}")))?;
    if messages.is_empty() {
        return Err(invalid("input: must not be empty".into()));
    }
    Ok(Planned {
        turn: Turn {
            model,
            messages,
            tools,
            tool_choice,
            thinking,
            stream,
            include_usage: false,
            max_tokens,
            ignore_eos: false,
        },
        keep: keep.then_some(conversation),
        previous_response_id: previous,
    })
}

/// vLLM's answer to a `previous_response_id` it does not hold.
fn not_found(id: &str) -> Refusal {
    Refusal {
        status: 404,
        body: json!({"error": {"message": format!("Response with id '{id}' not found."),
            "type": "invalid_request_error", "param": "response_id", "code": 404}}),
    }
}

/// `{"type": "function", name, description, parameters}` as a chat function tool.
fn chat_tool(tool: &Value) -> Option<Value> {
    if tool.get("type").and_then(Value::as_str) != Some("function") {
        return None;
    }
    Some(json!({"type": "function", "function": {
        "name": tool.get("name")?,
        "description": tool.get("description").cloned().unwrap_or(Value::Null),
        "parameters": tool.get("parameters").cloned().unwrap_or(json!({})),
    }}))
}

/// `"auto" | "none" | "required" | {"type": "function", "name"}` as a chat `tool_choice`.
fn chat_tool_choice(choice: &Value) -> Option<Value> {
    match choice {
        Value::String(_) => Some(choice.clone()),
        Value::Object(o) => {
            let name = o.get("name")?;
            Some(json!({"type": "function", "function": {"name": name}}))
        }
        _ => None,
    }
}

/// Which kind of output item is open in a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Message,
    Reasoning,
    FunctionCall,
}

/// The item being streamed: its position, id, kind and what it has said so far.
struct OpenItem {
    index: usize,
    id: String,
    kind: Kind,
    text: String,
    call: Option<(String, String)>,
}

/// Renders one Responses reply: its stream events one by one, or its whole response object,
/// and keeps the conversation for `previous_response_id` once the reply is complete.
pub(crate) struct Writer {
    id: String,
    created_at: u64,
    model: String,
    previous_response_id: Option<String>,
    sequence: u64,
    open: Option<OpenItem>,
    items: Vec<Value>,
    keep: Option<(Arc<ResponseStore>, Vec<Value>)>,
}

/// A Responses SSE event: `event:` names its `type`; every event carries a sequence number.
fn event(kind: &str, sequence: &mut u64, mut data: Value) -> String {
    data["type"] = json!(kind);
    data["sequence_number"] = json!(*sequence);
    *sequence += 1;
    format!("event: {kind}\ndata: {data}\n\n")
}

impl Writer {
    pub(crate) fn new(
        id: &str,
        created_at: u64,
        model: &str,
        previous_response_id: Option<String>,
        keep: Option<(Arc<ResponseStore>, Vec<Value>)>,
    ) -> Writer {
        Writer {
            id: id.to_string(),
            created_at,
            model: model.to_string(),
            previous_response_id,
            sequence: 0,
            open: None,
            items: Vec::new(),
            keep,
        }
    }

    /// The response object with the output so far.
    fn object(&self, status: &str, usage: Value, incomplete: bool) -> Value {
        json!({"id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "model": self.model, "output": self.items,
            "previous_response_id": self.previous_response_id, "usage": usage,
            "error": null,
            "incomplete_details": if incomplete { json!({"reason": "max_output_tokens"}) } else { Value::Null },
            "instructions": null, "metadata": {}, "parallel_tool_calls": true,
            "temperature": 1.0, "top_p": 1.0, "tool_choice": "auto", "tools": [],
            "text": {"format": {"type": "text"}}, "truncation": "disabled",
            "store": self.keep.is_some()})
    }

    /// `response.created` and `response.in_progress`, sent with the first token.
    pub(crate) fn start(&mut self) -> Vec<String> {
        let response = self.object("in_progress", Value::Null, false);
        vec![
            event(
                "response.created",
                &mut self.sequence,
                json!({"response": response}),
            ),
            event(
                "response.in_progress",
                &mut self.sequence,
                json!({"response": response}),
            ),
        ]
    }

    /// Ends the open item: its `…done` events and `response.output_item.done`.
    fn close(&mut self, out: &mut Vec<String>) {
        let Some(item) = self.open.take() else {
            return;
        };
        let (index, id) = (item.index, item.id.clone());
        let done = match item.kind {
            Kind::Message => {
                let part = json!({"type": "output_text", "text": item.text, "annotations": []});
                out.push(event("response.output_text.done", &mut self.sequence,
                    json!({"item_id": id, "output_index": index, "content_index": 0, "text": item.text, "logprobs": []})));
                out.push(event(
                    "response.content_part.done",
                    &mut self.sequence,
                    json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
                ));
                json!({"id": id, "type": "message", "status": "completed", "role": "assistant",
                    "content": [part]})
            }
            Kind::Reasoning => {
                out.push(event("response.reasoning_text.done", &mut self.sequence,
                    json!({"item_id": id, "output_index": index, "content_index": 0, "text": item.text})));
                json!({"id": id, "type": "reasoning", "summary": [],
                    "content": [{"type": "reasoning_text", "text": item.text}]})
            }
            Kind::FunctionCall => {
                let (call_id, name) = item.call.unwrap_or_default();
                out.push(event("response.function_call_arguments.done", &mut self.sequence,
                    json!({"item_id": id, "output_index": index, "name": name, "arguments": item.text})));
                json!({"id": id, "type": "function_call", "status": "completed",
                    "call_id": call_id, "name": name, "arguments": item.text})
            }
        };
        out.push(event(
            "response.output_item.done",
            &mut self.sequence,
            json!({"output_index": index, "item": done}),
        ));
        self.items.push(done);
    }

    /// Opens an item of `kind` unless one is open (a function call always opens its own).
    fn open(&mut self, kind: Kind, call: Option<(String, String)>, out: &mut Vec<String>) {
        if self
            .open
            .as_ref()
            .is_some_and(|o| o.kind == kind && kind != Kind::FunctionCall)
        {
            return;
        }
        self.close(out);
        let index = self.items.len();
        let suffix = self.id.trim_start_matches("resp_");
        let (id, item) = match kind {
            Kind::Message => {
                let id = format!("msg_{suffix}{index}");
                let item = json!({"id": id, "type": "message", "status": "in_progress",
                    "role": "assistant", "content": []});
                (id, item)
            }
            Kind::Reasoning => {
                let id = format!("rs_{suffix}{index}");
                (
                    id.clone(),
                    json!({"id": id, "type": "reasoning", "summary": [], "content": []}),
                )
            }
            Kind::FunctionCall => {
                let id = format!("fc_{suffix}{index}");
                let (call_id, name) = call.clone().unwrap_or_default();
                let item = json!({"id": id, "type": "function_call", "status": "in_progress",
                    "call_id": call_id, "name": name, "arguments": ""});
                (id, item)
            }
        };
        out.push(event(
            "response.output_item.added",
            &mut self.sequence,
            json!({"output_index": index, "item": item}),
        ));
        let part = match kind {
            Kind::Message => Some(json!({"type": "output_text", "text": "", "annotations": []})),
            Kind::Reasoning => Some(json!({"type": "reasoning_text", "text": ""})),
            Kind::FunctionCall => None,
        };
        if let Some(part) = part {
            out.push(event(
                "response.content_part.added",
                &mut self.sequence,
                json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
            ));
        }
        self.open = Some(OpenItem {
            index,
            id,
            kind,
            text: String::new(),
            call,
        });
    }

    /// The events one reply piece adds.
    pub(crate) fn piece(&mut self, delta: &Delta) -> Vec<String> {
        let mut out = Vec::with_capacity(1);
        let (kind, text) = match delta {
            Delta::Content(t) => {
                self.open(Kind::Message, None, &mut out);
                ("response.output_text.delta", t)
            }
            Delta::Reasoning(t) => {
                self.open(Kind::Reasoning, None, &mut out);
                ("response.reasoning_text.delta", t)
            }
            Delta::ToolCallStart { id, name, .. } => {
                let call = Some((id.clone(), name.clone()));
                self.open(Kind::FunctionCall, call, &mut out);
                return out;
            }
            Delta::ToolArgs { fragment, .. } => {
                ("response.function_call_arguments.delta", fragment)
            }
        };
        let Some(item) = self.open.as_mut() else {
            return out;
        };
        item.text.push_str(text);
        let mut data = json!({"item_id": item.id, "output_index": item.index, "delta": text});
        if item.kind != Kind::FunctionCall {
            data["content_index"] = json!(0);
        }
        if item.kind == Kind::Message {
            data["logprobs"] = json!([]);
        }
        out.push(event(kind, &mut self.sequence, data));
        out
    }

    fn usage(reply: &Reply, t: &Timings) -> Value {
        let reasoning: u32 = reply
            .pieces
            .iter()
            .filter(|p| matches!(p.delta, Delta::Reasoning(_)))
            .map(|p| p.tokens)
            .sum();
        json!({"input_tokens": t.prompt_tokens,
            "input_tokens_details": {"cached_tokens": t.cached_tokens},
            "output_tokens": t.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": t.prompt_tokens + t.completion_tokens})
    }

    /// The finished response object; keeps the conversation with the reply unless told not to.
    fn complete(&mut self, reply: &Reply, t: &Timings) -> (Value, bool) {
        let incomplete = reply.finish_reason == FinishReason::Length;
        let status = if incomplete {
            "incomplete"
        } else {
            "completed"
        };
        let response = self.object(status, Self::usage(reply, t), incomplete);
        if let Some((store, mut conversation)) = self.keep.take() {
            let mut assistant = json!({"role": "assistant"});
            let (content, reasoning, calls) =
                (reply.content(), reply.reasoning(), reply.tool_calls());
            if !content.is_empty() {
                assistant["content"] = json!(content);
            }
            if !reasoning.is_empty() {
                assistant["reasoning_content"] = json!(reasoning);
            }
            if !calls.is_empty() {
                assistant["tool_calls"] = json!(calls);
            }
            conversation.push(assistant);
            store.insert(self.id.clone(), conversation);
        }
        (response, incomplete)
    }

    /// Closes the open item, then `response.completed` (or `response.incomplete` when the
    /// output cap cut the reply) with the whole response.
    pub(crate) fn finish(&mut self, reply: &Reply, t: &Timings) -> Vec<String> {
        let mut out = Vec::with_capacity(4);
        self.close(&mut out);
        let (response, incomplete) = self.complete(reply, t);
        let kind = if incomplete {
            "response.incomplete"
        } else {
            "response.completed"
        };
        out.push(event(
            kind,
            &mut self.sequence,
            json!({"response": response}),
        ));
        out
    }

    /// An `error` event, which ends a stream that failed after its first token.
    pub(crate) fn error(&mut self, message: &str) -> String {
        event(
            "error",
            &mut self.sequence,
            json!({"code": "server_error", "message": message, "param": null}),
        )
    }

    /// The unstreamed response: the same items a stream would build, all at once.
    pub(crate) fn full(&mut self, reply: &Reply, t: &Timings) -> Value {
        for p in &reply.pieces {
            self.piece(&p.delta);
        }
        self.close(&mut Vec::new());
        self.complete(reply, t).0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::metrics::Metrics;

    fn store() -> ResponseStore {
        ResponseStore::new(4, 1 << 20, Arc::new(Metrics::new("m", 16, 16, false)))
    }

    #[test]
    fn instructions_lead_and_are_not_kept() {
        let body = json!({"model": "m", "instructions": "be brief", "input": "hi"});
        let p = turn(body.to_string().as_bytes(), &store()).unwrap();
        assert_eq!(p.turn.messages[0].role, "system");
        assert_eq!(p.turn.messages.len(), 2);
        assert_eq!(
            p.keep.unwrap(),
            vec![json!({"role": "user", "content": "hi"})]
        );
    }

    #[test]
    fn store_false_keeps_nothing_and_a_bad_input_names_the_field() {
        let body = json!({"input": "hi", "store": false});
        assert!(turn(body.to_string().as_bytes(), &store())
            .unwrap()
            .keep
            .is_none());
        let err = turn(br#"{"input": 3}"#, &store()).err().unwrap();
        assert_eq!(err.status, 400);
        assert!(err.body["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("input:"));
    }
}
