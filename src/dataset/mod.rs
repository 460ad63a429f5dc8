//! MLPerf agentic datasets: flat JSONL (plain or zstd) → validated conversations → per-turn
//! request bodies, salting, and the synthetic standard set.
//!
//! The types below are the contract the replayer, the simulator's oracle and the capture
//! exporter build on. Each conversation keeps its recorded history once, every message
//! already encoded as wire JSON; a client turn is a prefix length into it, so memory grows
//! with the file and not with turns squared.

pub(crate) mod cli;

use std::path::PathBuf;
use std::sync::Arc;

use serde_json::value::RawValue;

/// A loaded, validated dataset in file order.
#[derive(Debug, Clone)]
pub struct Dataset {
    /// Where it was read from.
    pub path: PathBuf,
    /// SHA-256 (lowercase hex) of the file's bytes as stored (compressed if `.zst`).
    pub sha256: String,
    /// Conversations in the order they first appear in the file.
    pub conversations: Vec<Arc<Conversation>>,
}

/// The role of a dataset row or history message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// The leading system prompt (history only; never a dataset row role).
    System,
    /// A user row.
    User,
    /// A recorded assistant row.
    Assistant,
    /// A tool result message (one per `tool_results` entry).
    Tool,
}

/// One message of a conversation's recorded history.
#[derive(Debug, Clone)]
pub struct HistoryMessage {
    /// Its role.
    pub role: Role,
    /// The message as sent on the wire: keys in the reference's order
    /// (`role, content, name, tool_calls, tool_call_id, reasoning_content`), nulls omitted,
    /// compact JSON.
    pub wire: Box<RawValue>,
}

/// One recorded conversation (a trajectory's source).
#[derive(Debug, Clone)]
pub struct Conversation {
    /// The `conversation_id` exactly as in the file.
    pub id: String,
    /// The whole recorded history: the system prompt first (if any), then every row's
    /// messages in turn order (tool rows expanded one message per result).
    pub messages: Vec<HistoryMessage>,
    /// The client (user or tool) rows in turn order: one request each.
    pub client_turns: Vec<ClientTurn>,
}

/// One client turn: the request a replay sends for it.
#[derive(Debug, Clone)]
pub struct ClientTurn {
    /// The row's `turn` number.
    pub turn: u32,
    /// The request carries `messages[..history_len]` of its conversation.
    pub history_len: usize,
    /// Pause before issuing this turn when delays are injected (seconds; 0 when none).
    pub delay_seconds: f64,
    /// Per-row request fields that win over the model preset, in the reference's field order
    /// (already propagated from the first user row where the reference propagates:
    /// `max_new_tokens` and a `stream: true`). `tools` is stored once, on the conversation's
    /// first turn; [`Conversation::request_field`] resolves it for later turns. Never holds
    /// `tool_results`, `tool_calls`, `delay_seconds` or bookkeeping keys.
    pub overrides: serde_json::Map<String, serde_json::Value>,
    /// The recorded assistant row that follows this turn: the scorer's ground truth.
    pub expected: Option<ExpectedReply>,
}

/// A recorded assistant reply, as the inline scorer needs it.
#[derive(Debug, Clone, Default)]
pub struct ExpectedReply {
    /// The assistant row's `turn` number.
    pub turn: u32,
    /// Index of the recorded assistant message in the conversation's `messages`: its text
    /// is read from there ([`Conversation::recorded_reply`]) rather than held twice.
    pub message: usize,
    /// Its `tool_calls` exactly as in the file, kept as raw JSON: parsed trees cost several
    /// times their text, and only the scorer and the oracle read them, once per turn.
    pub tool_calls: Option<Box<RawValue>>,
    /// Its `intent_codes` (workflow ground truth), if any.
    pub intent_codes: Option<Vec<String>>,
}

/// A recorded assistant reply with its text, read from the history when needed.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RecordedReply {
    /// Its `content`, if a string.
    pub content: Option<String>,
    /// Its `reasoning_content`, if any.
    pub reasoning_content: Option<String>,
    /// Its `tool_calls`, parsed.
    pub tool_calls: Option<serde_json::Value>,
}

impl Conversation {
    /// The text of the assistant message `expected` points at.
    pub fn recorded_reply(&self, expected: &ExpectedReply) -> RecordedReply {
        let parsed: Option<serde_json::Value> = self
            .messages
            .get(expected.message)
            .and_then(|m| serde_json::from_str(m.wire.get()).ok());
        let Some(serde_json::Value::Object(mut fields)) = parsed else {
            return RecordedReply::default();
        };
        let mut text = |key: &str| match fields.remove(key) {
            Some(serde_json::Value::String(s)) => Some(s),
            _ => None,
        };
        RecordedReply {
            content: text("content"),
            reasoning_content: text("reasoning_content"),
            tool_calls: fields.remove("tool_calls").filter(|v| !v.is_null()),
        }
    }
}

impl ExpectedReply {
    /// The recorded `tool_calls`, parsed.
    pub fn tool_calls_value(&self) -> Option<serde_json::Value> {
        self.tool_calls
            .as_ref()
            .and_then(|raw| serde_json::from_str(raw.get()).ok())
    }
}

pub(crate) mod lines;
pub(crate) mod load;
pub(crate) mod request;
pub(crate) mod salt;
pub mod snapshot;
pub(crate) mod stats;
pub mod synth;

pub use lines::DEFAULT_MAX_LINE_BYTES;
pub use load::open_lines;
pub use load::{load, load_reader, DatasetError, LoadOptions, Rule, ValidationError};
pub use request::{ModelParams, RequestBuilder, PRESETS};
pub use salt::Salt;
pub use stats::DatasetStats;

impl Dataset {
    /// Client turns (requests) in one pass over the dataset.
    pub fn client_turn_count(&self) -> usize {
        self.conversations
            .iter()
            .map(|c| c.client_turns.len())
            .sum()
    }

    /// The conversation with this id, if any.
    pub fn conversation(&self, id: &str) -> Option<&Arc<Conversation>> {
        self.conversations.iter().find(|c| c.id == id)
    }

    /// The reference's salting pre-flight: with salting on, every client turn's history
    /// must hold a system message, otherwise nothing may be issued.
    pub fn check_salt_preflight(&self) -> Result<(), DatasetError> {
        if let Some(conv) = self.without_system_prompt().next() {
            return Err(DatasetError::SaltWithoutSystemPrompt {
                conversation_id: conv.id.clone(),
                turn: conv.client_turns.first().map_or(0, |t| t.turn),
            });
        }
        Ok(())
    }

    /// Conversations with client turns and no system prompt: a salted replay (the default)
    /// refuses them, so validation and export say so before a replay does.
    pub fn without_system_prompt(&self) -> impl Iterator<Item = &Arc<Conversation>> {
        self.conversations.iter().filter(|c| {
            !c.client_turns.is_empty() && c.messages.first().map(|m| m.role) != Some(Role::System)
        })
    }
}

impl Conversation {
    /// The inline scorer's domain: `workflow` iff the id matches `^sim_\d+$`.
    pub fn domain(&self) -> Domain {
        Domain::of(&self.id)
    }

    /// The request field `key` of `turn` as the reference resolves it from the rows: the
    /// turn's own value, else for `tools` the first user row's (stored once per conversation).
    pub fn request_field<'a>(
        &'a self,
        turn: &'a ClientTurn,
        key: &str,
    ) -> Option<&'a serde_json::Value> {
        turn.overrides.get(key).or_else(|| {
            (key == "tools")
                .then(|| self.client_turns.first()?.overrides.get("tools"))
                .flatten()
        })
    }

    /// The system prompt, when the conversation has one.
    pub fn system_prompt(&self) -> Option<String> {
        let first = self.messages.first().filter(|m| m.role == Role::System)?;
        let v: serde_json::Value = serde_json::from_str(first.wire.get()).ok()?;
        v.get("content")?.as_str().map(str::to_string)
    }
}

/// The two kinds of MLPerf agentic trajectories, told apart by id as the scorer does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Domain {
    /// SWE-bench style coding traces.
    Coding,
    /// `sim_NNNNNN` workflow traces.
    Workflow,
}

impl Domain {
    /// The domain of a source conversation id.
    pub fn of(id: &str) -> Domain {
        match id.strip_prefix("sim_") {
            Some(digits) if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) => {
                Domain::Workflow
            }
            _ => Domain::Coding,
        }
    }

    /// `coding` or `workflow`.
    pub fn as_str(self) -> &'static str {
        match self {
            Domain::Coding => "coding",
            Domain::Workflow => "workflow",
        }
    }
}
