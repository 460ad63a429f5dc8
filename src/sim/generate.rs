//! What a reply says: deterministic synthetic text, reasoning and schema-valid tool calls,
//! cut into pseudo-token pieces that the engine releases one token at a time.

use serde_json::{Map, Value};

use super::config::ResponderConfig;
use super::render::BYTES_PER_TOKEN;
use crate::random::Rng;

/// Tokens charged for a tool call's name and envelope (llm-d-sim counts 3).
const TOOL_CALL_HEADER_TOKENS: u32 = 3;

/// The delta one piece adds to the reply.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Delta {
    /// A fragment of `reasoning_content`.
    Reasoning(String),
    /// A fragment of `content`.
    Content(String),
    /// A tool call begins: its id and function name (arguments follow).
    ToolCallStart {
        /// Position in `tool_calls`.
        index: usize,
        /// `call_…`.
        id: String,
        /// The function's name.
        name: String,
    },
    /// A fragment of a tool call's `arguments` string.
    ToolArgs {
        /// Position in `tool_calls`.
        index: usize,
        /// The fragment.
        fragment: String,
    },
}

/// One streamed delta and the tokens it costs.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Piece {
    /// What it adds.
    pub delta: Delta,
    /// Tokens the engine must generate before it is released.
    pub tokens: u32,
}

/// Why a reply ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FinishReason {
    /// Natural end.
    Stop,
    /// The token cap.
    Length,
    /// Ended after complete tool calls.
    ToolCalls,
}

impl FinishReason {
    /// The OpenAI string.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::ToolCalls => "tool_calls",
        }
    }
}

/// A whole planned reply.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Reply {
    /// The deltas in order.
    pub pieces: Vec<Piece>,
    /// Tokens the engine generates (`completion_tokens`).
    pub tokens: usize,
    /// Why it ends.
    pub finish_reason: FinishReason,
}

impl Reply {
    fn new(pieces: Vec<Piece>, natural: FinishReason) -> Reply {
        let tokens = pieces.iter().map(|p| p.tokens as usize).sum();
        Reply {
            pieces,
            tokens,
            finish_reason: natural,
        }
    }

    /// Applies the token cap: pieces that do not fit entirely are dropped and the reply
    /// ends with `length` after exactly `max` tokens. `ignore_eos` pads to `max`.
    pub(crate) fn cap(mut self, max: Option<u64>, ignore_eos: bool, rng: &mut Rng) -> Reply {
        let Some(max) = max.map(|m| m.max(1) as usize) else {
            return self;
        };
        if self.tokens > max {
            let mut used = 0;
            let keep = self
                .pieces
                .iter()
                .take_while(|p| {
                    used += p.tokens as usize;
                    used <= max
                })
                .count();
            self.pieces.truncate(keep);
            self.tokens = max;
            self.finish_reason = FinishReason::Length;
        } else if ignore_eos && self.tokens < max {
            let missing = max - self.tokens;
            self.pieces
                .extend(text_pieces(&words(rng, missing), Delta::Content));
            self.tokens = max;
            self.finish_reason = FinishReason::Length;
        }
        self
    }

    /// The text of every `Content` piece.
    pub(crate) fn content(&self) -> String {
        self.pieces
            .iter()
            .filter_map(|p| match &p.delta {
                Delta::Content(s) => Some(s.as_str()),
                _ => None,
            })
            .collect()
    }

    /// The text of every `Reasoning` piece.
    pub(crate) fn reasoning(&self) -> String {
        self.pieces
            .iter()
            .filter_map(|p| match &p.delta {
                Delta::Reasoning(s) => Some(s.as_str()),
                _ => None,
            })
            .collect()
    }

    /// The tool calls assembled as the non-streaming `message.tool_calls` array.
    pub(crate) fn tool_calls(&self) -> Vec<Value> {
        let mut calls: Vec<(String, String, String)> = Vec::new();
        for p in &self.pieces {
            match &p.delta {
                Delta::ToolCallStart { id, name, .. } => {
                    calls.push((id.clone(), name.clone(), String::new()))
                }
                Delta::ToolArgs { index, fragment } => {
                    if let Some(c) = calls.get_mut(*index) {
                        c.2.push_str(fragment);
                    }
                }
                _ => {}
            }
        }
        calls
            .into_iter()
            .map(|(id, name, arguments)| {
                serde_json::json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}})
            })
            .collect()
    }
}

/// What the synthetic responder needs to know about a chat request.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ChatShape<'a> {
    /// The request's `tools`.
    pub tools: Option<&'a [Value]>,
    /// The request's `tool_choice`.
    pub tool_choice: Option<&'a Value>,
    /// False when the request turned thinking off.
    pub thinking: bool,
}

/// Pseudo-tokens of the synthetic text: each is at most 4 bytes, as the tokenizer counts.
const WORDS: &[&str] = &[
    "the ", "bug ", "fix ", "run ", "and ", "see ", "now ", "add ", "use ", "map ", "key ", "let ",
    "get ", "set ", "new ", "old ", "log ", "it. ", "ok, ", "so, ", "we ", "can ", "try ", "out ",
    "its ", "one ", "two ", "end ", "for ", "all ", "not ", "yet ",
];

/// `n` pseudo-tokens of deterministic text.
fn words(rng: &mut Rng, n: usize) -> Vec<String> {
    (0..n)
        .map(|_| WORDS[(rng.next_u64() % WORDS.len() as u64) as usize].to_string())
        .collect()
}

fn text_pieces(tokens: &[String], kind: fn(String) -> Delta) -> impl Iterator<Item = Piece> + '_ {
    tokens.iter().map(move |t| Piece {
        delta: kind(t.clone()),
        tokens: 1,
    })
}

/// Cuts text into pseudo-token fragments of at most 4 bytes on character boundaries.
pub(crate) fn fragments(text: &str) -> Vec<String> {
    let mut out = Vec::with_capacity(text.len() / BYTES_PER_TOKEN + 1);
    let mut start = 0;
    while start < text.len() {
        let mut end = (start + BYTES_PER_TOKEN).min(text.len());
        while !text.is_char_boundary(end) {
            end += 1;
        }
        out.push(text[start..end].to_string());
        start = end;
    }
    out
}

fn tool_call_pieces(index: usize, id: String, name: String, arguments: &str) -> Vec<Piece> {
    let mut pieces = vec![Piece {
        delta: Delta::ToolCallStart { index, id, name },
        tokens: TOOL_CALL_HEADER_TOKENS,
    }];
    pieces.extend(fragments(arguments).into_iter().map(|fragment| Piece {
        delta: Delta::ToolArgs { index, fragment },
        tokens: 1,
    }));
    pieces
}

/// The synthetic reply to a chat request.
pub(crate) fn synthetic_chat(shape: ChatShape<'_>, cfg: &ResponderConfig, rng: &mut Rng) -> Reply {
    let natural = rng.int(cfg.output_tokens_min, cfg.output_tokens_max);
    let reasoning_tokens = if shape.thinking {
        (natural as f64 * cfg.reasoning_ratio) as usize
    } else {
        0
    };
    let mut pieces: Vec<Piece> =
        text_pieces(&words(rng, reasoning_tokens), Delta::Reasoning).collect();
    if let Some((name, schema)) = pick_tool(shape, cfg, rng) {
        let arguments = example_value(schema.unwrap_or(&Value::Null)).to_string();
        let arguments = if arguments.starts_with('{') {
            arguments
        } else {
            "{}".to_string()
        };
        let id = format!("call_{:016x}", rng.next_u64());
        pieces.extend(tool_call_pieces(0, id, name, &arguments));
        return Reply::new(pieces, FinishReason::ToolCalls);
    }
    pieces.extend(text_pieces(
        &words(rng, natural - reasoning_tokens),
        Delta::Content,
    ));
    Reply::new(pieces, FinishReason::Stop)
}

/// The synthetic reply to a text completion.
pub(crate) fn synthetic_text(cfg: &ResponderConfig, rng: &mut Rng) -> Reply {
    let natural = rng.int(cfg.output_tokens_min, cfg.output_tokens_max);
    Reply::new(
        text_pieces(&words(rng, natural), Delta::Content).collect(),
        FinishReason::Stop,
    )
}

/// The function to call, if the request allows and the draw says so.
fn pick_tool<'a>(
    shape: ChatShape<'a>,
    cfg: &ResponderConfig,
    rng: &mut Rng,
) -> Option<(String, Option<&'a Value>)> {
    let tools = shape.tools.filter(|t| !t.is_empty())?;
    let functions: Vec<(&str, Option<&Value>)> = tools
        .iter()
        .filter_map(|t| {
            let f = t.get("function")?;
            Some((f.get("name")?.as_str()?, f.get("parameters")))
        })
        .collect();
    if functions.is_empty() {
        return None;
    }
    let draw = rng.f64();
    let pick = rng.next_u64() as usize % functions.len();
    match shape.tool_choice {
        Some(Value::String(s)) if s == "none" => None,
        Some(Value::String(s)) if s == "required" => Some(functions[pick]),
        Some(Value::Object(o)) => {
            let name = o.get("function")?.get("name")?.as_str()?;
            functions.iter().find(|(n, _)| *n == name).copied()
        }
        _ => (draw < cfg.tool_call_probability).then_some(functions[pick]),
    }
    .map(|(n, s)| (n.to_string(), s))
}

/// A value valid against a JSON schema: required properties only, fixed values.
pub(crate) fn example_value(schema: &Value) -> Value {
    let Some(obj) = schema.as_object() else {
        return Value::Object(Map::new());
    };
    if let Some(c) = obj.get("const") {
        return c.clone();
    }
    if let Some(Value::Array(options)) = obj.get("enum") {
        if let Some(first) = options.first() {
            return first.clone();
        }
    }
    for key in ["anyOf", "oneOf", "allOf"] {
        if let Some(Value::Array(options)) = obj.get(key) {
            if let Some(first) = options
                .iter()
                .find(|s| s.get("type").and_then(Value::as_str) != Some("null"))
            {
                return example_value(first);
            }
        }
    }
    let ty = match obj.get("type") {
        Some(Value::String(t)) => t.as_str(),
        Some(Value::Array(ts)) => ts
            .iter()
            .filter_map(Value::as_str)
            .find(|t| *t != "null")
            .unwrap_or("null"),
        _ if obj.contains_key("properties") => "object",
        _ => "string",
    };
    match ty {
        "object" => {
            let mut out = Map::new();
            let props = obj.get("properties").and_then(Value::as_object);
            if let (Some(Value::Array(required)), Some(props)) = (obj.get("required"), props) {
                for name in required.iter().filter_map(Value::as_str) {
                    let sub = props.get(name).cloned().unwrap_or(Value::Null);
                    out.insert(name.to_string(), example_value(&sub));
                }
            }
            Value::Object(out)
        }
        "array" => Value::Array(vec![example_value(
            obj.get("items").unwrap_or(&Value::Null),
        )]),
        "integer" => Value::from(1),
        "number" => Value::from(1.0),
        "boolean" => Value::Bool(true),
        "null" => Value::Null,
        _ => Value::String("example".to_string()),
    }
}

/// A reply that replays recorded text and tool calls (the oracle's right answer).
pub(crate) fn recorded(
    reasoning: Option<&str>,
    content: Option<&str>,
    tool_calls: Option<&Value>,
    rng: &mut Rng,
) -> Reply {
    let mut pieces: Vec<Piece> = Vec::new();
    let text = |s: &str, kind: fn(String) -> Delta| {
        fragments(s).into_iter().map(move |f| Piece {
            delta: kind(f),
            tokens: 1,
        })
    };
    if let Some(r) = reasoning {
        pieces.extend(text(r, Delta::Reasoning));
    }
    if let Some(c) = content {
        pieces.extend(text(c, Delta::Content));
    }
    let mut called = false;
    if let Some(Value::Array(calls)) = tool_calls {
        for (index, call) in calls.iter().enumerate() {
            let f = call.get("function");
            let name = f
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string();
            let id = call
                .get("id")
                .and_then(Value::as_str)
                .map(str::to_string)
                .unwrap_or_else(|| format!("call_{:016x}", rng.next_u64()));
            let arguments = match f.and_then(|f| f.get("arguments")) {
                Some(Value::String(s)) => s.clone(),
                Some(v) => v.to_string(),
                None => "{}".to_string(),
            };
            pieces.extend(tool_call_pieces(index, id, name, &arguments));
            called = true;
        }
    }
    if pieces.is_empty() {
        pieces.extend(text_pieces(&words(rng, 1), Delta::Content));
    }
    Reply::new(
        pieces,
        if called {
            FinishReason::ToolCalls
        } else {
            FinishReason::Stop
        },
    )
}

/// A deliberately wrong variant of a recorded reply: same shape and similar length, but
/// every string argument and the content replaced.
pub(crate) fn wrong(
    reasoning: Option<&str>,
    content: Option<&str>,
    tool_calls: Option<&Value>,
    rng: &mut Rng,
) -> Reply {
    const WRONG: &str = "oracle-wrong-answer";
    fn spoil(v: &Value) -> Value {
        match v {
            Value::String(_) => Value::String(WRONG.to_string()),
            Value::Array(a) => Value::Array(a.iter().map(spoil).collect()),
            Value::Object(o) => {
                Value::Object(o.iter().map(|(k, v)| (k.clone(), spoil(v))).collect())
            }
            other => other.clone(),
        }
    }
    let calls = tool_calls.and_then(Value::as_array).map(|calls| {
        Value::Array(
            calls
                .iter()
                .map(|call| {
                    let mut call = call.clone();
                    if let Some(f) = call.get_mut("function").and_then(Value::as_object_mut) {
                        let args = match f.get("arguments") {
                            Some(Value::String(s)) => {
                                serde_json::from_str::<Value>(s).unwrap_or(Value::Null)
                            }
                            Some(v) => v.clone(),
                            None => Value::Null,
                        };
                        let spoiled = match spoil(&args) {
                            Value::Object(o) if !o.is_empty() => Value::Object(o),
                            _ => serde_json::json!({ "command": WRONG }),
                        };
                        f.insert("arguments".to_string(), Value::String(spoiled.to_string()));
                    }
                    call
                })
                .collect(),
        )
    });
    let content = content.map(|c| words(rng, c.len().div_ceil(BYTES_PER_TOKEN).max(1)).concat());
    let reasoning =
        reasoning.map(|r| words(rng, r.len().div_ceil(BYTES_PER_TOKEN).max(1)).concat());
    let content = match (&content, &calls) {
        (None, None) => Some(WRONG.to_string()),
        _ => content,
    };
    recorded(
        reasoning.as_deref(),
        content.as_deref(),
        calls.as_ref(),
        rng,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn schema_example_fills_required_properties_only() {
        let schema = json!({"type": "object", "properties": {
            "command": {"type": "string"}, "n": {"type": "integer"}, "mode": {"enum": ["fast", "slow"]},
            "paths": {"type": "array", "items": {"type": "string"}}, "opt": {"type": "boolean"}},
            "required": ["command", "n", "mode", "paths"]});
        assert_eq!(
            example_value(&schema),
            json!({"command": "example", "n": 1, "mode": "fast", "paths": ["example"]})
        );
    }

    #[test]
    fn cap_cuts_at_the_token_limit_with_length() {
        let cfg = ResponderConfig::default();
        let mut rng = Rng::new(1);
        let shape = ChatShape {
            tools: None,
            tool_choice: None,
            thinking: true,
        };
        let reply = synthetic_chat(shape, &cfg, &mut rng).cap(Some(5), false, &mut rng);
        assert_eq!(
            (reply.tokens, reply.finish_reason),
            (5, FinishReason::Length)
        );
        let padded = synthetic_chat(shape, &cfg, &mut rng).cap(Some(1000), true, &mut rng);
        assert_eq!(padded.tokens, 1000);
        assert_eq!(
            padded
                .pieces
                .iter()
                .map(|p| p.tokens as usize)
                .sum::<usize>(),
            1000
        );
    }

    #[test]
    fn fragments_respect_character_boundaries() {
        let parts = fragments("héllo wörld ✓");
        assert_eq!(parts.concat(), "héllo wörld ✓");
        assert!(parts.iter().all(|p| !p.is_empty() && p.len() <= 6));
    }
}
