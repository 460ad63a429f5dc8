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

/// A generation request of any chat-like API, in the chat form the template renders: the one
/// shape the engine path plans from, so every API shares tokenisation, cache and cost.
#[derive(Debug, Default)]
pub(crate) struct Turn {
    /// Echoed back when given.
    pub model: Option<String>,
    /// The whole conversation the prompt renders, system prompt first.
    pub messages: Vec<Message>,
    /// Function schemas in chat form (`{"type":"function","function":{…}}`).
    pub tools: Option<Vec<Value>>,
    /// `none`, `auto`, `required` or a named function, in chat form.
    pub tool_choice: Option<Value>,
    /// Whether the reply may open with reasoning.
    pub thinking: bool,
    /// Server-sent events instead of one JSON body.
    pub stream: bool,
    /// Chat only: a usage chunk before `[DONE]`.
    pub include_usage: bool,
    /// Output cap.
    pub max_tokens: Option<u64>,
    /// Generate exactly the cap.
    pub ignore_eos: bool,
}

impl From<ChatRequest> for Turn {
    fn from(req: ChatRequest) -> Turn {
        let thinking = req
            .chat_template_kwargs
            .as_ref()
            .and_then(|k| k.get("enable_thinking"))
            .and_then(Value::as_bool)
            .unwrap_or(true);
        Turn {
            model: req.model,
            messages: req.messages,
            tools: req.tools,
            tool_choice: req.tool_choice,
            thinking,
            stream: req.stream.unwrap_or(false),
            include_usage: req
                .stream_options
                .and_then(|o| o.include_usage)
                .unwrap_or(false),
            max_tokens: req.max_completion_tokens.or(req.max_tokens),
            ignore_eos: req.ignore_eos.unwrap_or(false),
        }
    }
}

/// Chat-form messages (JSON values another API's request was converted to) as [`Message`]s.
pub(crate) fn messages_of(values: Vec<Value>) -> Result<Vec<Message>, serde_json::Error> {
    serde_json::from_value(Value::Array(values))
}
