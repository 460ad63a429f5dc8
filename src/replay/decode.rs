//! Response → model output: SSE chunks (or one JSON body) accumulated exactly as the
//! reference does, plus the token usage and which event carried the first token. Runs once per
//! response after its last byte, never per chunk while bytes arrive.
//!
//! A 200 is a successful turn only when it is well formed for the kind asked for, so a proxy's
//! error page or a broken stream cannot pass for model output: a streamed answer must be
//! `text/event-stream` with at least one `data:` JSON chunk and end with `data: [DONE]` (as
//! OpenAI, vLLM, SGLang and llama.cpp end every stream; the reference itself does not check);
//! a non-streamed one must be a chat-completion object with `choices[0].message`.

use serde::Deserialize;
use serde_json::value::RawValue;

use super::client::Response;
use crate::wire::Api;

/// `TextModelOutput` text fields: a plain string or `[first, rest]` parts (reference §14.3).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum OutputText {
    /// One string.
    Text(String),
    /// First delta, then the rest joined (absent when there was one delta).
    Parts(Vec<String>),
}

impl OutputText {
    /// The whole text.
    pub(crate) fn joined(&self) -> String {
        match self {
            OutputText::Text(s) => s.clone(),
            OutputText::Parts(p) => p.concat(),
        }
    }

    fn to_json(&self) -> serde_json::Value {
        match self {
            OutputText::Text(s) => serde_json::Value::String(s.clone()),
            OutputText::Parts(p) => serde_json::Value::from(p.clone()),
        }
    }
}

/// What the model answered, in the reference's `TextModelOutput` shape.
#[derive(Debug, Clone)]
pub(crate) struct ModelOutput {
    /// `output`.
    pub output: OutputText,
    /// `reasoning`.
    pub reasoning: Option<OutputText>,
    /// Streaming: one raw delta list per chunk; non-streaming: the complete calls.
    pub tool_calls: Option<Vec<Box<RawValue>>>,
}

impl ModelOutput {
    /// `["TextModelOutput", output, reasoning, tool_calls]`.
    pub(crate) fn to_json(&self) -> serde_json::Value {
        let tools = match &self.tool_calls {
            None => serde_json::Value::Null,
            Some(list) => serde_json::Value::Array(
                list.iter()
                    .map(|raw| serde_json::from_str(raw.get()).unwrap_or(serde_json::Value::Null))
                    .collect(),
            ),
        };
        serde_json::json!([
            "TextModelOutput",
            self.output.to_json(),
            self.reasoning.as_ref().map(OutputText::to_json),
            tools
        ])
    }

    /// Characters of content, reasoning and tool-call bytes: the basis of estimated counts.
    pub(crate) fn char_len(&self) -> usize {
        self.output.joined().chars().count()
            + self
                .reasoning
                .as_ref()
                .map_or(0, |r| r.joined().chars().count())
            + self
                .tool_calls
                .as_ref()
                .map_or(0, |t| t.iter().map(|r| r.get().len()).sum())
    }
}

/// Token counts reported by the server.
#[derive(Debug, Clone, Copy, Default, Deserialize)]
pub(crate) struct Usage {
    /// `prompt_tokens`.
    #[serde(default)]
    pub prompt_tokens: u64,
    /// `completion_tokens`.
    #[serde(default)]
    pub completion_tokens: u64,
    /// `prompt_tokens_details.cached_tokens`.
    #[serde(
        default,
        deserialize_with = "cached_tokens",
        rename = "prompt_tokens_details"
    )]
    pub cached_tokens: Option<u64>,
}

fn cached_tokens<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    #[derive(Deserialize)]
    struct Details {
        cached_tokens: Option<u64>,
    }
    Ok(Option::<Details>::deserialize(d)?.and_then(|x| x.cached_tokens))
}

/// A decoded successful response.
#[derive(Debug, Clone)]
pub(crate) struct Decoded {
    /// The model output.
    pub output: ModelOutput,
    /// `finish_reason` of the last chunk that carried one.
    pub finish_reason: Option<String>,
    /// Server usage, if any was sent.
    pub usage: Option<Usage>,
    /// Indices into `Response::events` of the events that carried a content, reasoning or
    /// tool-call delta (the first one is RECV_FIRST).
    pub delta_events: Vec<usize>,
    /// The response's id (Responses), which a chained next turn names.
    pub response_id: Option<String>,
    /// The ids of the function calls the model made (Responses), in order.
    pub call_ids: Vec<String>,
}

/// Why a response is a failed turn.
#[derive(Debug, Clone, thiserror::Error)]
pub(crate) enum DecodeError {
    /// Non-200 status: `HTTP <code>: <body>` as the reference writes it.
    #[error("HTTP {status}: {body}")]
    Status {
        /// The status.
        status: u16,
        /// The body (truncated to 1 KiB).
        body: String,
    },
    /// The server sent an error event inside the stream.
    #[error("stream error: {0}")]
    Stream(String),
    /// The body is not what an OpenAI server sends.
    #[error("bad response: {0}")]
    Malformed(String),
}

#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<ChunkChoice>,
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(default)]
    error: Option<Box<RawValue>>,
}

#[derive(Deserialize)]
struct ChunkChoice {
    #[serde(default)]
    delta: Option<Delta>,
    #[serde(default)]
    message: Option<Delta>,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct Delta {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    reasoning_content: Option<String>,
    #[serde(default)]
    reasoning: Option<String>,
    #[serde(default)]
    tool_calls: Option<Box<RawValue>>,
}

fn non_empty_list(raw: &RawValue) -> bool {
    let s = raw.get().trim();
    s.starts_with('[') && s[1..].trim_start() != "]"
}

/// Decodes a response of `api`; `streaming` says which shape was asked for. Every API's
/// answer becomes the same [`Decoded`], so metrics and scoring do not know which was spoken.
pub(crate) fn decode_as(
    api: Api,
    resp: &Response,
    streaming: bool,
) -> Result<Decoded, DecodeError> {
    if api == Api::Chat {
        return decode(resp, streaming);
    }
    if resp.status != 200 {
        return Err(DecodeError::Status {
            status: resp.status,
            body: api_error(&resp.body).unwrap_or_else(|| status_body(&resp.body)),
        });
    }
    if streaming {
        check_event_stream(resp)?;
    }
    match (api, streaming) {
        (Api::Messages, true) => super::decode_messages::stream(resp),
        (Api::Messages, false) => super::decode_messages::json(&resp.body),
        (_, true) => super::decode_responses::stream(resp),
        (_, false) => super::decode_responses::json(&resp.body),
    }
}

/// The reason an error body gives, in the shape OpenAI (`{"error": {"code"|"type",
/// "message"}}`) and Anthropic (`{"type": "error", "error": {"type", "message"}}`) share:
/// `"<code or type>: <message>"`.
pub(crate) fn api_error(body: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let err = v.get("error").filter(|e| e.is_object())?;
    let text = |k: &str| err.get(k).and_then(serde_json::Value::as_str);
    let message = text("message").unwrap_or("");
    let mut reason = match text("code").or(text("type")) {
        Some(code) if !message.is_empty() => format!("{code}: {message}"),
        Some(code) => code.to_owned(),
        None => message.to_owned(),
    };
    if reason.len() > 1024 {
        let cut = (0..=1024)
            .rev()
            .find(|&i| reason.is_char_boundary(i))
            .unwrap_or(0);
        reason.truncate(cut);
    }
    (!reason.is_empty()).then_some(reason)
}

fn status_body(body: &[u8]) -> String {
    String::from_utf8_lossy(&body[..body.len().min(1024)]).into_owned()
}

pub(super) fn check_event_stream(resp: &Response) -> Result<(), DecodeError> {
    let content_type = resp.content_type.as_deref().unwrap_or("");
    if is_event_stream(content_type) {
        return Ok(());
    }
    Err(DecodeError::Malformed(format!(
        "a stream was asked for, got content-type {content_type:?} ({})",
        body_start(&resp.body)
    )))
}

/// Decodes a chat-completions response; `streaming` says which shape was asked for.
pub(crate) fn decode(resp: &Response, streaming: bool) -> Result<Decoded, DecodeError> {
    if resp.status != 200 {
        let body = String::from_utf8_lossy(&resp.body[..resp.body.len().min(1024)]).into_owned();
        return Err(DecodeError::Status {
            status: resp.status,
            body,
        });
    }
    if streaming {
        check_event_stream(resp)?;
        decode_stream(resp)
    } else {
        decode_json(&resp.body)
    }
}

fn is_event_stream(content_type: &str) -> bool {
    content_type
        .split(';')
        .next()
        .is_some_and(|t| t.trim().eq_ignore_ascii_case("text/event-stream"))
}

/// The first bytes of a body, for an error message.
pub(super) fn body_start(body: &[u8]) -> String {
    if body.is_empty() {
        return "empty body".into();
    }
    let head = String::from_utf8_lossy(&body[..body.len().min(80)]);
    format!("body starts {:?}", head.trim())
}

pub(super) fn sse_data(event: &[u8]) -> Option<std::borrow::Cow<'_, [u8]>> {
    let mut data: Option<std::borrow::Cow<'_, [u8]>> = None;
    for line in event.split(|b| *b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(rest) = line.strip_prefix(b"data:") else {
            continue;
        };
        let rest = rest.strip_prefix(b" ").unwrap_or(rest);
        data = Some(match data {
            None => std::borrow::Cow::Borrowed(rest),
            Some(prev) => {
                let mut v = prev.into_owned();
                v.push(b'\n');
                v.extend_from_slice(rest);
                std::borrow::Cow::Owned(v)
            }
        });
    }
    data
}

fn decode_stream(resp: &Response) -> Result<Decoded, DecodeError> {
    let mut content: Vec<String> = Vec::new();
    let mut reasoning: Vec<String> = Vec::new();
    let mut tools: Vec<Box<RawValue>> = Vec::new();
    let mut finish_reason = None;
    let mut usage = None;
    let mut delta_events = Vec::new();
    let mut chunks = 0usize;
    let mut done = false;
    for (i, ev) in resp.events.iter().enumerate() {
        let Some(data) = sse_data(&resp.body[ev.start..ev.end]) else {
            continue;
        };
        let trimmed = data.trim_ascii();
        if trimmed == b"[DONE]" {
            done = true;
            break;
        }
        if trimmed.is_empty() {
            continue;
        }
        if !trimmed.starts_with(b"{") {
            return Err(DecodeError::Malformed(format!(
                "SSE event {i}: data is not a JSON object"
            )));
        }
        let chunk: Chunk = serde_json::from_slice(trimmed)
            .map_err(|e| DecodeError::Malformed(format!("SSE event {i}: {e}")))?;
        chunks += 1;
        if let Some(err) = chunk.error {
            return Err(DecodeError::Stream(err.get().to_string()));
        }
        if chunk.usage.is_some() {
            usage = chunk.usage;
        }
        let Some(choice) = chunk.choices.into_iter().next() else {
            continue;
        };
        if choice.finish_reason.is_some() {
            finish_reason = choice.finish_reason;
        }
        let Some(delta) = choice.delta else { continue };
        let mut carried = false;
        if let Some(c) = delta.content.filter(|c| !c.is_empty()) {
            content.push(c);
            carried = true;
        }
        if let Some(r) = delta
            .reasoning_content
            .or(delta.reasoning)
            .filter(|r| !r.is_empty())
        {
            reasoning.push(r);
            carried = true;
        }
        if let Some(t) = delta.tool_calls.filter(|t| non_empty_list(t)) {
            tools.push(t);
            carried = true;
        }
        if carried {
            delta_events.push(i);
        }
    }
    if chunks == 0 {
        return Err(DecodeError::Malformed(format!(
            "the stream carried no data: event with a JSON chunk ({} events, {})",
            resp.events.len(),
            body_start(&resp.body)
        )));
    }
    if !done {
        return Err(DecodeError::Malformed(format!(
            "the stream ended without data: [DONE] after {chunks} chunks"
        )));
    }
    Ok(Decoded {
        output: streamed_output(content, reasoning, tools),
        finish_reason,
        usage,
        delta_events,
        response_id: None,
        call_ids: Vec::new(),
    })
}

/// A streamed answer in the reference's shape: the first delta of the text the user saw
/// first (reasoning when there is any), then the rest joined.
pub(super) fn streamed_output(
    content: Vec<String>,
    reasoning: Vec<String>,
    tools: Vec<Box<RawValue>>,
) -> ModelOutput {
    let parts = |mut v: Vec<String>| {
        let first = v.remove(0);
        let rest = v.concat();
        if rest.is_empty() && v.is_empty() {
            OutputText::Parts(vec![first])
        } else {
            OutputText::Parts(vec![first, rest])
        }
    };
    let (output, reasoning) = if !reasoning.is_empty() {
        (OutputText::Text(content.concat()), Some(parts(reasoning)))
    } else if !content.is_empty() {
        (parts(content), None)
    } else {
        (OutputText::Parts(Vec::new()), None)
    };
    ModelOutput {
        output,
        reasoning,
        tool_calls: (!tools.is_empty()).then_some(tools),
    }
}

fn decode_json(body: &[u8]) -> Result<Decoded, DecodeError> {
    if !body.trim_ascii_start().starts_with(b"{") {
        return Err(DecodeError::Malformed(format!(
            "not a JSON object ({})",
            body_start(body)
        )));
    }
    let chunk: Chunk =
        serde_json::from_slice(body).map_err(|e| DecodeError::Malformed(e.to_string()))?;
    if let Some(err) = chunk.error {
        return Err(DecodeError::Stream(err.get().to_string()));
    }
    let choice = chunk
        .choices
        .into_iter()
        .next()
        .ok_or_else(|| DecodeError::Malformed("empty choices".into()))?;
    let msg = choice
        .message
        .or(choice.delta)
        .ok_or_else(|| DecodeError::Malformed("choice without message".into()))?;
    let tool_calls = msg
        .tool_calls
        .filter(|t| non_empty_list(t))
        .map(|raw| serde_json::from_str::<Vec<Box<RawValue>>>(raw.get()).unwrap_or_default());
    Ok(Decoded {
        output: ModelOutput {
            output: OutputText::Text(msg.content.unwrap_or_default()),
            reasoning: msg
                .reasoning_content
                .or(msg.reasoning)
                .map(OutputText::Text),
            tool_calls,
        },
        finish_reason: choice.finish_reason,
        usage: chunk.usage,
        delta_events: Vec::new(),
        response_id: None,
        call_ids: Vec::new(),
    })
}
