//! Rows: one flat dataset row as the public sample writes it, and its tool calls.

use serde::Serialize;
use serde_json::value::RawValue;

/// One flat dataset row, keys in the order the public sample writes them.
#[derive(Serialize, Default)]
pub(super) struct Row<'a> {
    pub(super) conversation_id: &'a str,
    pub(super) turn: u32,
    pub(super) role: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) system: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) tools: Option<&'a RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) reasoning_content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) tool_calls: Option<&'a [ToolCall]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) tool_results: Option<&'a [ToolResult]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) delay_seconds: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) intent_codes: Option<&'a [String]>,
}

#[derive(Serialize)]
pub(super) struct ToolCall {
    pub(super) id: String,
    #[serde(rename = "type")]
    pub(super) kind: &'static str,
    pub(super) function: FunctionCall,
}

#[derive(Serialize)]
pub(super) struct FunctionCall {
    pub(super) name: String,
    pub(super) arguments: String,
}

#[derive(Serialize)]
pub(super) struct ToolResult {
    pub(super) tool_call_id: String,
    pub(super) content: String,
}

pub(super) fn call(id: String, name: &str, arguments: String) -> ToolCall {
    ToolCall {
        id,
        kind: "function",
        function: FunctionCall {
            name: name.to_string(),
            arguments,
        },
    }
}

/// Delays rounded to 5 decimals, as the sample stores them.
pub(super) fn round5(x: f64) -> f64 {
    (x * 1e5).round() / 1e5
}
