//! Anthropic Messages on the simulator (`POST /v1/messages`): the request read through
//! `crate::wire::messages` into the chat form the engine plans from, and the reply rendered as
//! Anthropic's content blocks and named stream events.

use serde_json::{json, Map, Value};

use super::api::{messages_of, Turn};
use super::engine::Timings;
use super::generate::{Delta, FinishReason, Reply};

/// Reads a Messages body. The error names the field that is wrong.
pub(crate) fn turn(body: &[u8]) -> Result<Turn, String> {
    let request: Map<String, Value> =
        serde_json::from_slice(body).map_err(|e| format!("invalid request body: {e}"))?;
    let field = |k: &str| request.get(k).cloned();
    let model = field("model").and_then(|m| m.as_str().map(str::to_owned));
    let stream = field("stream").and_then(|v| v.as_bool()).unwrap_or(false);
    let max_tokens = field("max_tokens").and_then(|v| v.as_u64());
    let thinking = field("thinking")
        .and_then(|t| {
            t.get("type")
                .and_then(Value::as_str)
                .map(|t| t == "enabled")
        })
        .unwrap_or(false);
    let tools = match field("tools") {
        Some(Value::Array(tools)) => Some(tools.iter().filter_map(chat_tool).collect()),
        Some(Value::Null) | None => None,
        Some(_) => return Err("tools: must be an array".into()),
    };
    let tool_choice = field("tool_choice").as_ref().and_then(chat_tool_choice);
    match request.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => {}
        _ => return Err("messages: must be a non-empty array".into()),
    }
    let (_, values) = crate::wire::messages::to_chat(request).ok_or(
        "messages: each needs a role of user or assistant and a content of text or blocks",
    )?;
    let messages = messages_of(values).map_err(|e| format!("messages: {e}"))?;
    Ok(Turn {
        model,
        messages,
        tools,
        tool_choice,
        thinking,
        stream,
        include_usage: false,
        max_tokens,
        ignore_eos: false,
    })
}

/// `{name, description, input_schema}` as a chat function tool.
fn chat_tool(tool: &Value) -> Option<Value> {
    let name = tool.get("name")?;
    Some(json!({"type": "function", "function": {
        "name": name,
        "description": tool.get("description").cloned().unwrap_or(Value::Null),
        "parameters": tool.get("input_schema").cloned().unwrap_or(json!({})),
    }}))
}

/// `{"type": "auto" | "any" | "tool" | "none", "name"}` as a chat `tool_choice`.
fn chat_tool_choice(choice: &Value) -> Option<Value> {
    match choice.get("type")?.as_str()? {
        "auto" => Some(json!("auto")),
        "any" => Some(json!("required")),
        "none" => Some(json!("none")),
        "tool" => Some(json!({"type": "function", "function": {"name": choice.get("name")?}})),
        _ => None,
    }
}

/// Anthropic's `stop_reason` for a finish reason.
fn stop_reason(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop => "end_turn",
        FinishReason::Length => "max_tokens",
        FinishReason::ToolCalls => "tool_use",
    }
}

/// Anthropic's error type for an HTTP status.
pub(crate) fn error_type(status: u16) -> &'static str {
    match status {
        400 | 413 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    }
}

/// An error body in Anthropic's shape.
pub(crate) fn error_json(status: u16, message: &str) -> Value {
    json!({"type": "error", "error": {"type": error_type(status), "message": message}})
}

/// How the prompt's tokens split between cache reads, cache writes and the rest, as
/// Anthropic's usage reports them (the three add up to the prompt).
#[derive(Debug, Clone, Copy)]
pub(crate) struct InputUsage {
    /// Prompt tokens found in the prefix cache.
    pub cache_read: usize,
    /// Prompt tokens of full blocks this request adds to the prefix cache.
    pub cache_creation: usize,
    /// The remaining prompt tokens.
    pub uncached: usize,
}

impl InputUsage {
    /// Splits a prompt of `tokens` with `cacheable` tokens in full blocks, `cached` of them hit.
    pub(crate) fn new(tokens: usize, cacheable: usize, cached: usize) -> InputUsage {
        let cache_read = cached.min(tokens);
        let cache_creation = cacheable.min(tokens).saturating_sub(cache_read);
        InputUsage {
            cache_read,
            cache_creation,
            uncached: tokens - cache_read - cache_creation,
        }
    }

    fn json(self, output_tokens: usize) -> Value {
        json!({"input_tokens": self.uncached, "cache_creation_input_tokens": self.cache_creation,
            "cache_read_input_tokens": self.cache_read, "output_tokens": output_tokens})
    }
}

/// Which kind of content block is open in a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Block {
    Text,
    Thinking,
    ToolUse,
}

/// Renders one Messages reply: its stream events one by one, or its whole body.
pub(crate) struct Writer {
    id: String,
    model: String,
    /// Prompt tokens and how many of them sit in full blocks.
    prompt: (usize, usize),
    open: Option<(usize, Block)>,
    next_index: usize,
}

/// An Anthropic SSE event: the `event:` line names the `type` of its data.
fn event(kind: &str, data: &Value) -> String {
    format!("event: {kind}\ndata: {data}\n\n")
}

/// A tool-call id in Anthropic's form (`toolu_…`).
fn tool_use_id(id: &str) -> String {
    format!("toolu_{}", id.strip_prefix("call_").unwrap_or(id))
}

impl Writer {
    /// `prompt_tokens` with `cacheable` of them in full KV blocks.
    pub(crate) fn new(id: &str, model: &str, prompt_tokens: usize, cacheable: usize) -> Writer {
        Writer {
            id: id.to_string(),
            model: model.to_string(),
            prompt: (prompt_tokens, cacheable),
            open: None,
            next_index: 0,
        }
    }

    fn input_usage(&self, cached: usize) -> InputUsage {
        InputUsage::new(self.prompt.0, self.prompt.1, cached)
    }

    /// `message_start` (with the prompt's usage) and a `ping`, sent with the first token.
    pub(crate) fn start(&mut self, cached: usize) -> Vec<String> {
        let message = json!({"id": self.id, "type": "message", "role": "assistant",
            "model": self.model, "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": self.input_usage(cached).json(1)});
        vec![
            event(
                "message_start",
                &json!({"type": "message_start", "message": message}),
            ),
            event("ping", &json!({"type": "ping"})),
        ]
    }

    fn close(&mut self, out: &mut Vec<String>) {
        if let Some((index, kind)) = self.open.take() {
            if kind == Block::Thinking {
                let delta = json!({"type": "signature_delta", "signature": ""});
                out.push(event(
                    "content_block_delta",
                    &json!({"type": "content_block_delta", "index": index, "delta": delta}),
                ));
            }
            out.push(event(
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": index}),
            ));
        }
    }

    /// Opens a block of `kind` unless one is open already (tool calls always open a new one).
    fn open(&mut self, kind: Block, block: Value, out: &mut Vec<String>) -> usize {
        if let Some((index, open)) = self.open {
            if open == kind && kind != Block::ToolUse {
                return index;
            }
        }
        self.close(out);
        let index = self.next_index;
        self.next_index += 1;
        self.open = Some((index, kind));
        out.push(event(
            "content_block_start",
            &json!({"type": "content_block_start", "index": index, "content_block": block}),
        ));
        index
    }

    /// The events one reply piece adds.
    pub(crate) fn piece(&mut self, delta: &Delta) -> Vec<String> {
        let mut out = Vec::with_capacity(1);
        let (index, delta) = match delta {
            Delta::Content(t) => {
                let block = json!({"type": "text", "text": ""});
                let i = self.open(Block::Text, block, &mut out);
                (i, json!({"type": "text_delta", "text": t}))
            }
            Delta::Reasoning(t) => {
                let block = json!({"type": "thinking", "thinking": "", "signature": ""});
                let i = self.open(Block::Thinking, block, &mut out);
                (i, json!({"type": "thinking_delta", "thinking": t}))
            }
            Delta::ToolCallStart { id, name, .. } => {
                let block =
                    json!({"type": "tool_use", "id": tool_use_id(id), "name": name, "input": {}});
                self.open(Block::ToolUse, block, &mut out);
                return out;
            }
            Delta::ToolArgs { fragment, .. } => match self.open {
                Some((i, Block::ToolUse)) => (
                    i,
                    json!({"type": "input_json_delta", "partial_json": fragment}),
                ),
                _ => return out,
            },
        };
        out.push(event(
            "content_block_delta",
            &json!({"type": "content_block_delta", "index": index, "delta": delta}),
        ));
        out
    }

    /// Closes the open block, then `message_delta` with the stop reason and usage, and
    /// `message_stop`.
    pub(crate) fn finish(&mut self, reply: &Reply, t: &Timings) -> Vec<String> {
        let mut out = Vec::with_capacity(3);
        self.close(&mut out);
        let delta = json!({"type": "message_delta",
            "delta": {"stop_reason": stop_reason(reply.finish_reason), "stop_sequence": null},
            "usage": self.input_usage(t.cached_tokens).json(t.completion_tokens)});
        out.push(event("message_delta", &delta));
        out.push(event("message_stop", &json!({"type": "message_stop"})));
        out
    }

    /// An `error` event, which ends a stream that failed after its first token.
    pub(crate) fn error(&self, status: u16, message: &str) -> String {
        event("error", &error_json(status, message))
    }

    /// The unstreamed body: every block of the reply at once.
    pub(crate) fn full(&self, reply: &Reply, t: &Timings) -> Value {
        let mut content = Vec::new();
        let reasoning = reply.reasoning();
        if !reasoning.is_empty() {
            content.push(json!({"type": "thinking", "thinking": reasoning, "signature": ""}));
        }
        let text = reply.content();
        if !text.is_empty() {
            content.push(json!({"type": "text", "text": text}));
        }
        for call in reply.tool_calls() {
            let f = &call["function"];
            let args = f["arguments"].as_str().unwrap_or("{}");
            let input: Value = serde_json::from_str(args).unwrap_or_else(|_| json!({}));
            content.push(json!({"type": "tool_use",
                "id": tool_use_id(call["id"].as_str().unwrap_or("")),
                "name": f["name"], "input": input}));
        }
        json!({"id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": content, "stop_reason": stop_reason(reply.finish_reason),
            "stop_sequence": null,
            "usage": self.input_usage(t.cached_tokens).json(t.completion_tokens)})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_usage_parts_add_up_to_the_prompt() {
        let u = InputUsage::new(100, 96, 64);
        assert_eq!((u.cache_read, u.cache_creation, u.uncached), (64, 32, 4));
        let u = InputUsage::new(10, 0, 0);
        assert_eq!((u.cache_read, u.cache_creation, u.uncached), (0, 0, 10));
    }

    #[test]
    fn tools_and_tool_choice_become_chat_functions() {
        let body = json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "ls", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool", "name": "ls"}});
        let t = turn(body.to_string().as_bytes()).unwrap();
        assert_eq!(t.tools.unwrap()[0]["function"]["name"], "ls");
        assert_eq!(t.tool_choice.unwrap()["function"]["name"], "ls");
        assert_eq!(t.max_tokens, Some(8));
    }

    #[test]
    fn a_body_without_messages_names_the_field() {
        let err = turn(br#"{"model":"m","max_tokens":8}"#).unwrap_err();
        assert!(err.starts_with("messages:"), "{err}");
    }
}
