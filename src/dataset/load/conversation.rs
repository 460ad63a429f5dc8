//! Conversation building: a validated conversation's history, its client turns and the
//! request fields each turn carries.

use serde_json::{Map, Value};

use crate::dataset::load::validate::{Group, Row};
use crate::dataset::request::request_keys;
use crate::dataset::{ClientTurn, Conversation, ExpectedReply, HistoryMessage, Role};

/// Turns a validated, turn-sorted group into its history and client turns (§3, §4).
pub(super) fn build_conversation(group: Group) -> Conversation {
    let rows = group.rows;
    if rows.is_empty() {
        return Conversation {
            id: group.id,
            messages: Vec::new(),
            client_turns: Vec::new(),
        };
    }
    let mut messages: Vec<HistoryMessage> = Vec::with_capacity(rows.len() + 4);
    if let Some(system) = rows.iter().find_map(|r| {
        r.get("system")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
    }) {
        messages.push(HistoryMessage::new(
            Role::System,
            &WireMessage {
                role: "system",
                content: Some(&Value::String(system.to_string())),
                ..WireMessage::default()
            },
        ));
    }

    // What the first user row propagates to the conversation's other client rows (§4.2):
    // `model` and `max_completion_tokens` are always filled from the model parameters first,
    // so only `max_new_tokens`, `tools` and a `stream: true` ever reach other rows. `tools`
    // (often tens of KB, on every row of converted files) is kept once, on the first turn,
    // and applied by `Conversation::request_field`.
    let first_tools = rows[0].get("tools").cloned();
    let propagated: Vec<(&str, Value)> = ["max_new_tokens", "stream"]
        .into_iter()
        .filter_map(|k| rows[0].get(k).map(|v| (k, v.clone())))
        .filter(|(k, v)| *k != "stream" || truthy(v))
        .collect();

    // Pass 1: every message's wire form, and each client row's history length.
    let mut history_lens = Vec::with_capacity(rows.len());
    for row in &rows {
        let role = row.role().unwrap_or(Role::User);
        match row.get("tool_results") {
            Some(Value::Array(results)) => {
                for result in results {
                    messages.push(HistoryMessage::new(
                        Role::Tool,
                        &WireMessage {
                            role: "tool",
                            content: result.get("content").filter(|v| !v.is_null()),
                            tool_call_id: result.get("tool_call_id"),
                            ..WireMessage::default()
                        },
                    ));
                }
            }
            _ => {
                let role_name = match role {
                    Role::System => "system",
                    Role::User => "user",
                    Role::Assistant => "assistant",
                    Role::Tool => "tool",
                };
                messages.push(HistoryMessage::new(
                    role,
                    &WireMessage {
                        role: role_name,
                        content: row.get("content"),
                        name: row.get("name"),
                        tool_calls: row.get("tool_calls"),
                        tool_call_id: None,
                        reasoning_content: row.get("reasoning_content"),
                    },
                ));
            }
        }
        history_lens.push(messages.len());
    }

    // Pass 2: client turns, moving request fields and replies out of the rows.
    let mut rows = rows;
    let mut client_turns = Vec::new();
    for i in 0..rows.len() {
        if rows[i].role() == Some(Role::Assistant) {
            continue;
        }
        let expected = match rows.get_mut(i + 1) {
            // An assistant row is one message: the last one its pass-1 length counts.
            Some(next) if next.role() == Some(Role::Assistant) => {
                Some(expected_reply(next, history_lens[i + 1] - 1))
            }
            _ => None,
        };
        let row = &mut rows[i];
        let mut overrides = Map::new();
        for key in request_keys() {
            match row.fields.remove(key).filter(|v| !v.is_null()) {
                Some(v) if key == "tools" && i > 0 && Some(&v) == first_tools.as_ref() => {}
                Some(v) => {
                    overrides.insert(key.to_string(), v);
                }
                None if i > 0 => {
                    if let Some((_, v)) = propagated.iter().find(|(k, _)| *k == key) {
                        overrides.insert(key.to_string(), v.clone());
                    }
                }
                None => {}
            }
        }
        client_turns.push(ClientTurn {
            turn: row.turn as u32,
            history_len: history_lens[i],
            delay_seconds: row
                .get("delay_seconds")
                .and_then(Value::as_f64)
                .filter(|d| *d > 0.0 && d.is_finite())
                .unwrap_or(0.0),
            overrides,
            expected,
        });
    }
    messages.shrink_to_fit();
    client_turns.shrink_to_fit();
    Conversation {
        id: group.id,
        messages,
        client_turns,
    }
}

pub(super) fn expected_reply(row: &mut Row, message: usize) -> ExpectedReply {
    ExpectedReply {
        turn: row.turn as u32,
        message,
        tool_calls: row
            .fields
            .remove("tool_calls")
            .filter(|v| !v.is_null())
            .and_then(|v| serde_json::value::to_raw_value(&v).ok()),
        intent_codes: row
            .get("intent_codes")
            .and_then(Value::as_array)
            .map(|codes| {
                codes
                    .iter()
                    .filter_map(Value::as_str)
                    .map(str::to_string)
                    .collect()
            }),
    }
}

/// Python truthiness of a JSON value, as the reference's `a or b` chains see it.
pub(crate) fn truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

/// A message in the wire's key order (`role, content, name, tool_calls, tool_call_id,
/// reasoning_content`) with nulls omitted, as the reference's `ChatMessage` encodes it.
#[derive(Default, serde::Serialize)]
pub(crate) struct WireMessage<'a> {
    pub role: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<&'a Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<&'a Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<&'a Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<&'a Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<&'a Value>,
}

impl HistoryMessage {
    pub(crate) fn new(role: Role, msg: &WireMessage<'_>) -> Self {
        // Serialising our own struct cannot fail: every field is plain JSON.
        let wire = serde_json::value::to_raw_value(msg).expect("a message encodes as JSON");
        HistoryMessage { role, wire }
    }
}
