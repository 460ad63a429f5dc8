//! Request builder: the chat-completions body of one client turn, byte for byte as the
//! reference client encodes it, with model parameters from a preset or config.

use std::borrow::Cow;
use std::io::Write;

use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::load::truthy;
use super::{ClientTurn, Conversation, HistoryMessage, Role, Salt};
use crate::wire::responses_request::Chain;
use crate::wire::Api;

/// The official presets' names, for help texts and error messages.
pub const PRESETS: &[&str] = &["qwen3.6-35b-a3b", "kimi-k3"];

/// Model name and sampling parameters applied to every turn (per-row values win).
///
/// `None` fields are left out of the request, as the reference leaves out null values.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelParams {
    /// The `model` field.
    pub name: String,
    /// `temperature`.
    pub temperature: Option<f64>,
    /// `top_p`.
    pub top_p: Option<f64>,
    /// `top_k`.
    pub top_k: Option<i64>,
    /// `repetition_penalty`.
    pub repetition_penalty: Option<f64>,
    /// `presence_penalty`.
    pub presence_penalty: Option<f64>,
    /// `frequency_penalty`.
    pub frequency_penalty: Option<f64>,
    /// `seed`.
    pub seed: Option<i64>,
    /// Sent as `max_completion_tokens` unless a row says otherwise (reference default 1024).
    pub max_new_tokens: Option<u64>,
    /// `chat_template_kwargs`, e.g. `{"preserve_thinking": true}`.
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// Whether requests stream (`stream: true`); accepts `true`/`false` or the reference's
    /// `"on"`/`"off"`/`"auto"` (auto means on, as for an online run).
    #[serde(deserialize_with = "streaming_flag")]
    pub streaming: bool,
}

impl Default for ModelParams {
    /// The reference's defaults: no sampling values, 1024 new tokens; streaming on, as the
    /// replayer measures time to first token.
    fn default() -> Self {
        Self {
            name: String::new(),
            temperature: None,
            top_p: None,
            top_k: None,
            repetition_penalty: None,
            presence_penalty: None,
            frequency_penalty: None,
            seed: None,
            max_new_tokens: Some(1024),
            chat_template_kwargs: None,
            streaming: true,
        }
    }
}

fn streaming_flag<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum Flag {
        Bool(bool),
        Text(String),
    }
    match <Flag as serde::Deserialize>::deserialize(d)? {
        Flag::Bool(b) => Ok(b),
        Flag::Text(t) => match t.as_str() {
            "on" | "auto" => Ok(true),
            "off" => Ok(false),
            other => Err(serde::de::Error::custom(format!(
                "streaming: must be true, false, \"on\", \"off\" or \"auto\", got {other:?}"
            ))),
        },
    }
}

impl ModelParams {
    /// The official presets: `qwen3.6-35b-a3b`, `kimi-k3` (the benchmark README's "Sampling
    /// Parameters and Thinking Flags"; every parameter not listed there is omitted).
    pub fn preset(name: &str) -> Option<ModelParams> {
        match name.to_ascii_lowercase().as_str() {
            "qwen3.6-35b-a3b" => Some(ModelParams {
                name: "Qwen/Qwen3.6-35B-A3B".to_string(),
                temperature: Some(1.0),
                top_p: Some(0.95),
                top_k: Some(20),
                repetition_penalty: Some(1.0),
                presence_penalty: Some(1.5),
                max_new_tokens: Some(8192),
                chat_template_kwargs: Some(Map::from_iter([(
                    "preserve_thinking".to_string(),
                    Value::Bool(true),
                )])),
                ..ModelParams::default()
            }),
            "kimi-k3" => Some(ModelParams {
                name: "moonshotai/Kimi-K3".to_string(),
                temperature: Some(1.0),
                top_p: Some(1.0),
                max_new_tokens: Some(8192),
                ..ModelParams::default()
            }),
            _ => None,
        }
    }

    /// Checks value ranges; the message names the field and the value.
    pub fn validate(&self) -> Result<(), String> {
        let check = |field: &str, v: Option<f64>, ok: fn(f64) -> bool, rule: &str| match v {
            Some(x) if !ok(x) => Err(format!("model_params.{field}: must be {rule}, got {x}")),
            _ => Ok(()),
        };
        check(
            "temperature",
            self.temperature,
            |x| x >= 0.0 && x.is_finite(),
            ">= 0",
        )?;
        check("top_p", self.top_p, |x| x > 0.0 && x <= 1.0, "in (0, 1]")?;
        check(
            "repetition_penalty",
            self.repetition_penalty,
            |x| x > 0.0 && x.is_finite(),
            "> 0",
        )?;
        check(
            "presence_penalty",
            self.presence_penalty,
            |x| (-2.0..=2.0).contains(&x),
            "in [-2, 2]",
        )?;
        check(
            "frequency_penalty",
            self.frequency_penalty,
            |x| (-2.0..=2.0).contains(&x),
            "in [-2, 2]",
        )?;
        if let Some(k) = self.top_k {
            if k < -1 || k == 0 {
                return Err(format!(
                    "model_params.top_k: must be >= 1 or -1 (disabled), got {k}"
                ));
            }
        }
        if self.max_new_tokens == Some(0) {
            return Err("model_params.max_new_tokens: must be > 0, got 0".to_string());
        }
        Ok(())
    }
}

/// Builds request bodies for one run.
#[derive(Debug, Clone)]
pub struct RequestBuilder {
    params: ModelParams,
    include_usage: bool,
    /// The wire the bodies are written for; every API's body is derived from the chat one.
    api: Api,
    /// The preset's parameters pre-encoded as JSON values, so a body only copies bytes.
    defaults: Defaults,
}

#[derive(Debug, Clone, Default)]
struct Defaults {
    model: Value,
    temperature: Option<Value>,
    seed: Option<Value>,
    top_p: Option<Value>,
    top_k: Option<Value>,
    repetition_penalty: Option<Value>,
    presence_penalty: Option<Value>,
    frequency_penalty: Option<Value>,
    chat_template_kwargs: Option<Value>,
    max_completion_tokens: Option<Value>,
}

impl Defaults {
    fn new(p: &ModelParams) -> Self {
        let num = |v: Option<f64>| v.and_then(serde_json::Number::from_f64).map(Value::Number);
        Defaults {
            model: Value::String(if p.name.is_empty() {
                // The reference's struct default when a sample has no model.
                "no-model-name".to_string()
            } else {
                p.name.clone()
            }),
            temperature: num(p.temperature),
            seed: p.seed.map(Value::from),
            top_p: num(p.top_p),
            top_k: p.top_k.map(Value::from),
            repetition_penalty: num(p.repetition_penalty),
            presence_penalty: num(p.presence_penalty),
            frequency_penalty: num(p.frequency_penalty),
            chat_template_kwargs: p.chat_template_kwargs.clone().map(Value::Object),
            max_completion_tokens: p.max_new_tokens.map(Value::from),
        }
    }
}

/// The body's fields after `messages`, in the reference's order: the one list the request
/// builder writes and the loader reads rows by (see [`request_keys`]).
const BODY_FIELDS: &[&str] = &[
    "temperature",
    "max_completion_tokens",
    "stream",
    "seed",
    "top_p",
    "top_k",
    "repetition_penalty",
    "n",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "user",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "tool_choice",
];

/// The row keys a dataset may give `max_completion_tokens` under, in the reference's order of
/// preference.
const MAX_TOKENS_KEYS: &[&str] = &["max_new_tokens", "max_completion_tokens", "max_tokens"];

/// Row keys that become request fields, in the body's order: `model`, then [`BODY_FIELDS`]
/// with the max-token aliases where `max_completion_tokens` goes.
pub(crate) fn request_keys() -> impl Iterator<Item = &'static str> {
    std::iter::once("model").chain(BODY_FIELDS.iter().flat_map(|field| match *field {
        "max_completion_tokens" => MAX_TOKENS_KEYS.iter().copied(),
        _ => std::slice::from_ref(field).iter().copied(),
    }))
}

impl RequestBuilder {
    /// `include_usage` adds `stream_options: {"include_usage": true}` to streaming requests.
    pub fn new(params: ModelParams, include_usage: bool) -> Self {
        let defaults = Defaults::new(&params);
        Self {
            params,
            include_usage,
            api: Api::Chat,
            defaults,
        }
    }

    /// The same builder writing bodies for `api` (`POST /v1/messages`, `/v1/responses`).
    pub fn with_api(mut self, api: Api) -> Self {
        self.api = api;
        self
    }

    /// The API the bodies are written for.
    pub fn api(&self) -> Api {
        self.api
    }

    /// The model parameters in use.
    pub fn params(&self) -> &ModelParams {
        &self.params
    }

    /// Whether this turn's request streams: the row's `stream` (or the first user row's
    /// `stream: true`), else the model parameters' `streaming`.
    pub fn is_streaming(&self, turn: &ClientTurn) -> bool {
        match turn.overrides.get("stream") {
            Some(v) if !v.is_null() => truthy(v),
            _ => self.params.streaming,
        }
    }

    /// The `max_completion_tokens` value: `max_new_tokens or max_completion_tokens or
    /// max_tokens or 128` after the model parameters filled `max_completion_tokens` (§4.4).
    fn max_tokens<'a>(&'a self, ov: &'a Map<String, Value>) -> Cow<'a, Value> {
        let filled_mct = ov
            .get("max_completion_tokens")
            .or(self.defaults.max_completion_tokens.as_ref());
        [ov.get("max_new_tokens"), filled_mct, ov.get("max_tokens")]
            .into_iter()
            .flatten()
            .find(|v| truthy(v))
            .map(Cow::Borrowed)
            .unwrap_or(Cow::Owned(Value::from(128)))
    }

    fn default_for(&self, field: &str) -> Option<&Value> {
        let d = &self.defaults;
        match field {
            "temperature" => d.temperature.as_ref(),
            "seed" => d.seed.as_ref(),
            "top_p" => d.top_p.as_ref(),
            "top_k" => d.top_k.as_ref(),
            "repetition_penalty" => d.repetition_penalty.as_ref(),
            "presence_penalty" => d.presence_penalty.as_ref(),
            "frequency_penalty" => d.frequency_penalty.as_ref(),
            "chat_template_kwargs" => d.chat_template_kwargs.as_ref(),
            _ => None,
        }
    }

    /// The compact JSON body for `turn` of `conv`, salted when `salt` is given, in the
    /// builder's API.
    pub fn body(&self, conv: &Conversation, turn: &ClientTurn, salt: Option<&Salt>) -> Vec<u8> {
        self.body_continuing(conv, turn, salt, None)
    }

    /// [`body`](Self::body), for a Responses turn that continues a stored response when
    /// `chain` is given. The Messages and Responses bodies are the chat body rewritten
    /// (`crate::wire`), so all three carry the same conversation and parameters.
    pub(crate) fn body_continuing(
        &self,
        conv: &Conversation,
        turn: &ClientTurn,
        salt: Option<&Salt>,
        chain: Option<Chain<'_>>,
    ) -> Vec<u8> {
        let mut out = Vec::new();
        self.write_chat_body(&mut out, conv, turn, salt);
        if self.api == Api::Chat {
            return out;
        }
        let chat: Map<String, Value> =
            serde_json::from_slice(&out).expect("the chat body is a JSON object");
        let body = match self.api {
            Api::Messages => crate::wire::messages_request::from_chat(&chat),
            _ => crate::wire::responses_request::from_chat(&chat, chain),
        };
        out.clear();
        serde_json::to_writer(&mut out, &body).expect("a JSON object encodes");
        out
    }

    /// Appends the chat-completions body to `out`, so a caller can reuse one buffer across
    /// turns (whatever the builder's API).
    pub fn write_body(
        &self,
        out: &mut Vec<u8>,
        conv: &Conversation,
        turn: &ClientTurn,
        salt: Option<&Salt>,
    ) {
        self.write_chat_body(out, conv, turn, salt)
    }

    fn write_chat_body(
        &self,
        out: &mut Vec<u8>,
        conv: &Conversation,
        turn: &ClientTurn,
        salt: Option<&Salt>,
    ) {
        let history = &conv.messages[..turn.history_len.min(conv.messages.len())];
        let size: usize = history.iter().map(|m| m.wire.get().len() + 1).sum();
        out.reserve(size + 1024);
        let ov = &turn.overrides;

        out.extend_from_slice(b"{\"model\":");
        write_json(out, ov.get("model").unwrap_or(&self.defaults.model));
        out.extend_from_slice(b",\"messages\":[");
        write_messages(out, history, salt, Form::Wire);
        out.push(b']');

        let streaming = self.is_streaming(turn);
        for field in BODY_FIELDS {
            let value: Cow<'_, Value> = match *field {
                "max_completion_tokens" => self.max_tokens(ov),
                "stream" => Cow::Owned(Value::Bool(streaming)),
                f => match conv.request_field(turn, f).or_else(|| self.default_for(f)) {
                    Some(v) => Cow::Borrowed(v),
                    None => continue,
                },
            };
            if value.is_null() {
                continue;
            }
            out.extend_from_slice(b",\"");
            out.extend_from_slice(field.as_bytes());
            out.extend_from_slice(b"\":");
            write_json(out, &value);
        }
        if streaming && self.include_usage {
            out.extend_from_slice(b",\"stream_options\":{\"include_usage\":true}");
        }
        out.push(b'}');
    }

    /// The turn's messages in the reference's history form (tool-call assistant messages
    /// carry `"content": null`), as `events.jsonl` ISSUED records show them.
    pub fn history_json(
        &self,
        conv: &Conversation,
        turn: &ClientTurn,
        salt: Option<&Salt>,
    ) -> Vec<u8> {
        let history = &conv.messages[..turn.history_len.min(conv.messages.len())];
        let size: usize = history.iter().map(|m| m.wire.get().len() + 16).sum();
        let mut out = Vec::with_capacity(size + 2);
        out.push(b'[');
        write_messages(&mut out, history, salt, Form::History);
        out.push(b']');
        out
    }
}

/// Which encoding of a message: the wire's, or the reference's in-memory history dict.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Form {
    Wire,
    History,
}

fn write_json(out: &mut Vec<u8>, v: &Value) {
    // Writing a `Value` into a Vec cannot fail.
    serde_json::to_writer(&mut *out, v).expect("a JSON value encodes");
}

/// Comma-separated messages; the first system message is salted when a salt is given.
fn write_messages(out: &mut Vec<u8>, history: &[HistoryMessage], salt: Option<&Salt>, form: Form) {
    let mut salted = salt.is_none();
    for (i, msg) in history.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        if !salted && msg.role == Role::System {
            if let Some(content) = system_content(&msg.wire) {
                salted = true;
                let salt = salt.expect("checked above");
                out.extend_from_slice(b"{\"role\":\"system\",\"content\":");
                serde_json::to_writer(&mut *out, &salt.apply(&content)).expect("a string encodes");
                out.push(b'}');
                continue;
            }
        }
        match form {
            Form::Wire => out.extend_from_slice(msg.wire.get().as_bytes()),
            Form::History => write_history_form(out, msg),
        }
    }
}

/// The content of a system message, when it is a string.
fn system_content(wire: &RawValue) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct System<'a> {
        #[serde(borrow)]
        content: Option<Cow<'a, str>>,
    }
    serde_json::from_str::<System<'_>>(wire.get())
        .ok()
        .and_then(|s| s.content)
        .map(Cow::into_owned)
}

/// The reference's history dict of a message: tool messages as
/// `{"role","tool_call_id","content"}`, and `"content": null` appended to an assistant
/// message that has `tool_calls` but no content.
fn write_history_form(out: &mut Vec<u8>, msg: &HistoryMessage) {
    #[derive(serde::Deserialize)]
    struct Keys<'a> {
        #[serde(borrow)]
        content: Option<&'a RawValue>,
        #[serde(borrow)]
        tool_calls: Option<&'a RawValue>,
        #[serde(borrow)]
        tool_call_id: Option<&'a RawValue>,
    }
    let wire = msg.wire.get();
    match msg.role {
        Role::Tool | Role::Assistant => {
            let Ok(keys) = serde_json::from_str::<Keys<'_>>(wire) else {
                out.extend_from_slice(wire.as_bytes());
                return;
            };
            if msg.role == Role::Tool {
                let _ = write!(out, "{{\"role\":\"tool\"");
                if let Some(id) = keys.tool_call_id {
                    let _ = write!(out, ",\"tool_call_id\":{}", id.get());
                }
                let content = keys.content.map_or("null", RawValue::get);
                let _ = write!(out, ",\"content\":{content}}}");
            } else if keys.tool_calls.is_some() && keys.content.is_none() {
                out.extend_from_slice(&wire.as_bytes()[..wire.len() - 1]);
                out.extend_from_slice(b",\"content\":null}");
            } else {
                out.extend_from_slice(wire.as_bytes());
            }
        }
        Role::System | Role::User => out.extend_from_slice(wire.as_bytes()),
    }
}
