//! The oracle responder's index: recognises which recorded client turn of an MLPerf agentic
//! dataset a request replays, by a hash of its message history with the salts stripped.

use std::collections::HashMap;
use std::sync::Arc;

use serde_json::Value;

use super::api::{content_text, Message};
use super::render::fnv64;
use crate::dataset::{Dataset, RecordedReply};
use crate::random::splitmix64;

/// Why a dataset cannot back the oracle.
#[derive(Debug, thiserror::Error)]
pub enum OracleError {
    /// A history message is not a chat message.
    #[error("conversation {conversation:?} message {index}: {message}")]
    BadMessage {
        /// The conversation id.
        conversation: String,
        /// Position in its history.
        index: usize,
        /// The parser's message.
        message: String,
    },
}

/// Recorded replies by the history hash of the client turn they answer.
#[derive(Debug)]
pub struct Oracle {
    dataset: Arc<Dataset>,
    /// History hash → (conversation index, client-turn index).
    index: HashMap<u64, (usize, usize)>,
}

impl Oracle {
    /// Indexes every client turn that has a recorded reply.
    pub fn new(dataset: Arc<Dataset>) -> Result<Oracle, OracleError> {
        let mut index = HashMap::new();
        for (ci, conv) in dataset.conversations.iter().enumerate() {
            let messages = conv
                .messages
                .iter()
                .enumerate()
                .map(|(i, m)| {
                    serde_json::from_str::<Message>(m.wire.get()).map_err(|e| {
                        OracleError::BadMessage {
                            conversation: conv.id.clone(),
                            index: i,
                            message: e.to_string(),
                        }
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            let prefix = history_hashes(&messages);
            for (ti, turn) in conv.client_turns.iter().enumerate() {
                if turn.expected.is_none()
                    || turn.history_len == 0
                    || turn.history_len > prefix.len()
                {
                    continue;
                }
                index
                    .entry(prefix[turn.history_len - 1])
                    .or_insert((ci, ti));
            }
        }
        Ok(Oracle { dataset, index })
    }

    /// Client turns indexed.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// True when no turn could be indexed.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// The recorded reply to a request with these messages, if it replays a dataset turn.
    pub fn lookup(&self, messages: &[Message]) -> Option<RecordedReply> {
        let h = *history_hashes(messages).last()?;
        let &(ci, ti) = self.index.get(&h)?;
        let conv = &self.dataset.conversations[ci];
        Some(conv.recorded_reply(conv.client_turns[ti].expected.as_ref()?))
    }
}

/// Chained hash after each message: element `k` identifies `messages[..=k]`. Fields that
/// re-encoding may reorder or omit (key order, `content: null`) do not change it, and the
/// salt markers of the first system message are ignored.
pub(crate) fn history_hashes(messages: &[Message]) -> Vec<u64> {
    let mut out = Vec::with_capacity(messages.len());
    let mut h = 0x5EED_0F0A_C1E0_0001u64;
    let mut seen_system = false;
    let mut buf = String::new();
    for m in messages {
        buf.clear();
        buf.push_str(&m.role);
        buf.push('\u{1e}');
        let mut text = String::new();
        if let Some(c) = &m.content {
            content_text(c, &mut text);
        }
        if m.role == "system" && !seen_system {
            seen_system = true;
            buf.push_str(strip_salt(&text));
        } else {
            buf.push_str(&text);
        }
        buf.push('\u{1e}');
        buf.push_str(m.name.as_deref().unwrap_or(""));
        buf.push('\u{1e}');
        if let Some(Value::Array(calls)) = &m.tool_calls {
            for call in calls {
                let f = call.get("function");
                buf.push_str(call.get("id").and_then(Value::as_str).unwrap_or(""));
                buf.push('\u{1f}');
                buf.push_str(
                    f.and_then(|f| f.get("name"))
                        .and_then(Value::as_str)
                        .unwrap_or(""),
                );
                buf.push('\u{1f}');
                match f.and_then(|f| f.get("arguments")) {
                    Some(Value::String(s)) => buf.push_str(s),
                    Some(v) => buf.push_str(&v.to_string()),
                    None => {}
                }
                buf.push('\u{1f}');
            }
        }
        buf.push('\u{1e}');
        buf.push_str(m.tool_call_id.as_deref().unwrap_or(""));
        buf.push('\u{1e}');
        buf.push_str(m.reasoning_text().unwrap_or(""));
        h = splitmix64(h ^ fnv64(buf.as_bytes()));
        out.push(h);
    }
    out
}

/// The system prompt without the reference's `[salt: xxxx]\n\n` prefix and
/// `\n\n[salt: xxxx]` suffix.
pub(crate) fn strip_salt(content: &str) -> &str {
    fn is_salt(s: &str) -> bool {
        s.len() == 4 && s.bytes().all(|b| b.is_ascii_hexdigit())
    }
    let mut s = content;
    if let Some(rest) = s.strip_prefix("[salt: ") {
        if rest.len() >= 7 && is_salt(&rest[..4]) && rest[4..].starts_with("]\n\n") {
            s = &rest[7..];
        }
    }
    if let Some(head) = s.strip_suffix(']') {
        if head.len() >= 13 && head.is_char_boundary(head.len() - 13) {
            let (body, tail) = head.split_at(head.len() - 13);
            if tail.starts_with("\n\n[salt: ") && is_salt(&tail[9..]) {
                s = body;
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn salts_are_stripped_exactly() {
        assert_eq!(
            strip_salt("[salt: 4461]\n\nYou are helpful.\n\n[salt: edc0]"),
            "You are helpful."
        );
        assert_eq!(strip_salt("You are helpful."), "You are helpful.");
        assert_eq!(strip_salt("[salt: zz]\n\nx"), "[salt: zz]\n\nx");
    }

    #[test]
    fn history_hash_ignores_salt_key_order_and_null_content() {
        let a: Vec<Message> = serde_json::from_str(
            r#"[{"role":"system","content":"[salt: 0001]\n\nsys\n\n[salt: abcd]"},{"role":"user","content":"hi"},
                {"role":"assistant","tool_calls":[{"id":"c1","type":"function","function":{"name":"bash","arguments":"{}"}}]}]"#,
        )
        .unwrap();
        let b: Vec<Message> = serde_json::from_str(
            r#"[{"content":"sys","role":"system"},{"role":"user","content":"hi"},
                {"role":"assistant","content":null,"tool_calls":[{"function":{"arguments":"{}","name":"bash"},"id":"c1","type":"function"}]}]"#,
        )
        .unwrap();
        assert_eq!(history_hashes(&a), history_hashes(&b));
        let mut c = b.clone();
        c[1].content = Some(Value::String("hello".into()));
        assert_ne!(history_hashes(&a)[2], history_hashes(&c)[2]);
    }
}
