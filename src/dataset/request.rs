//! Request builder: the chat-completions body of one client turn, byte for byte as the
//! reference client encodes it, with model parameters from a preset or config.

use super::{ClientTurn, Conversation, Salt};

/// Model name and sampling parameters applied to every turn (per-row values win).
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct ModelParams {
    /// The `model` field.
    pub name: String,
}

impl ModelParams {
    /// The official presets: `qwen3.6-35b-a3b`, `kimi-k3`.
    pub fn preset(_name: &str) -> Option<ModelParams> {
        None
    }
}

/// Builds request bodies for one run.
#[derive(Debug, Clone)]
pub struct RequestBuilder {
    params: ModelParams,
    include_usage: bool,
}

impl RequestBuilder {
    /// `include_usage` adds `stream_options: {"include_usage": true}` to streaming requests.
    pub fn new(params: ModelParams, include_usage: bool) -> Self {
        Self {
            params,
            include_usage,
        }
    }

    /// Whether this turn's request streams.
    pub fn is_streaming(&self, _turn: &ClientTurn) -> bool {
        let _ = (&self.params, self.include_usage);
        true
    }

    /// The compact JSON body for `turn` of `conv`, salted when `salt` is given.
    pub fn body(&self, _conv: &Conversation, _turn: &ClientTurn, _salt: Option<&Salt>) -> Vec<u8> {
        Vec::new()
    }

    /// The turn's messages in the reference's history form (tool-call assistant messages
    /// carry `"content": null`), as `events.jsonl` ISSUED records show them.
    pub fn history_json(
        &self,
        _conv: &Conversation,
        _turn: &ClientTurn,
        _salt: Option<&Salt>,
    ) -> Vec<u8> {
        Vec::new()
    }
}
