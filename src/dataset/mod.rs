//! MLPerf agentic datasets: flat JSONL (plain or zstd) → validated conversations → per-turn
//! request bodies, salting, and the synthetic standard set.
//!
//! The types below are the contract the replayer, the simulator's oracle and the capture
//! exporter build on. Each conversation keeps its recorded history once, every message
//! already encoded as wire JSON; a client turn is a prefix length into it, so memory grows
//! with the file and not with turns squared.

pub mod cli;

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
    /// Per-row request fields that win over the model preset (already propagated from the
    /// first user row where the reference propagates), in the reference's field order.
    pub overrides: serde_json::Map<String, serde_json::Value>,
    /// The recorded assistant row that follows this turn: the scorer's ground truth.
    pub expected: Option<ExpectedReply>,
}

/// A recorded assistant reply, as the inline scorer needs it.
#[derive(Debug, Clone, Default)]
pub struct ExpectedReply {
    /// The assistant row's `turn` number.
    pub turn: u32,
    /// Its `content`, if any.
    pub content: Option<String>,
    /// Its `reasoning_content`, if any.
    pub reasoning_content: Option<String>,
    /// Its `tool_calls` exactly as in the file.
    pub tool_calls: Option<serde_json::Value>,
    /// Its `intent_codes` (workflow ground truth), if any.
    pub intent_codes: Option<Vec<String>>,
}

pub mod load;
pub mod request;
pub mod salt;
pub mod synth;

pub use load::{load, DatasetError, LoadOptions};
pub use request::{ModelParams, RequestBuilder};
pub use salt::Salt;
