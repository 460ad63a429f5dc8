//! Request types of the OpenAI-compatible surface, parsed leniently: unknown fields are
//! ignored, only the fields the simulator acts on are typed.

use serde::Deserialize;
use serde_json::Value;

/// A `POST /v1/chat/completions` body.
#[derive(Debug, Deserialize)]
pub(crate) struct ChatRequest {
    /// Echoed back when given.
    #[serde(default)]
    pub model: Option<String>,
    /// The conversation so far.
    pub messages: Vec<Message>,
    /// Server-sent events instead of one JSON body.
    #[serde(default)]
    pub stream: Option<bool>,
    /// `include_usage` adds the usage chunk to a stream.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Output cap (current name).
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
    /// Output cap (legacy name).
    #[serde(default)]
    pub max_tokens: Option<u64>,
    /// vLLM extension: generate exactly the cap.
    #[serde(default)]
    pub ignore_eos: Option<bool>,
    /// Function schemas the reply may call.
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    /// `none`, `auto`, `required` or a named function.
    #[serde(default)]
    pub tool_choice: Option<Value>,
    /// `enable_thinking: false` turns reasoning off.
    #[serde(default)]
    pub chat_template_kwargs: Option<Value>,
}

/// A `POST /v1/completions` body.
#[derive(Debug, Deserialize)]
pub(crate) struct CompletionRequest {
    /// Echoed back when given.
    #[serde(default)]
    pub model: Option<String>,
    /// A string or an array of strings (concatenated).
    pub prompt: Value,
    /// Server-sent events instead of one JSON body.
    #[serde(default)]
    pub stream: Option<bool>,
    /// `include_usage` adds the usage chunk to a stream.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Output cap.
    #[serde(default)]
    pub max_tokens: Option<u64>,
    /// vLLM extension: generate exactly the cap.
    #[serde(default)]
    pub ignore_eos: Option<bool>,
}

/// `stream_options`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct StreamOptions {
    /// Send a usage chunk before `[DONE]`.
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// One chat message; content may be a string or an array of parts.
#[derive(Debug, Clone, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant`, `tool`, …
    pub role: String,
    /// Text, parts or null.
    #[serde(default)]
    pub content: Option<Value>,
    /// Optional participant name.
    #[serde(default)]
    pub name: Option<String>,
    /// Calls the assistant made.
    #[serde(default)]
    pub tool_calls: Option<Value>,
    /// Which call a tool message answers.
    #[serde(default)]
    pub tool_call_id: Option<String>,
    /// The assistant's reasoning (vLLM's name).
    #[serde(default)]
    pub reasoning_content: Option<String>,
    /// The assistant's reasoning (alternative name).
    #[serde(default)]
    pub reasoning: Option<String>,
}

impl Message {
    /// The reasoning under either name.
    pub fn reasoning_text(&self) -> Option<&str> {
        self.reasoning_content
            .as_deref()
            .or(self.reasoning.as_deref())
    }
}

/// Text of a `content` value: a string, or the `text` of each part, concatenated.
pub(crate) fn content_text(content: &Value, out: &mut String) {
    match content {
        Value::String(s) => out.push_str(s),
        Value::Array(parts) => {
            for part in parts {
                match part {
                    Value::String(s) => out.push_str(s),
                    Value::Object(o) => {
                        if let Some(Value::String(t)) = o.get("text") {
                            out.push_str(t);
                        }
                    }
                    _ => {}
                }
            }
        }
        Value::Null => {}
        other => out.push_str(&other.to_string()),
    }
}
