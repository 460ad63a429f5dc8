//! Server-sent events as the three APIs stream them: where the first token is.

use bytes::Bytes;
use serde_json::Value;

use super::{chat, messages, responses};

/// Data of one event larger than this is not read for its type: token events are small, and
/// the recorder must not hold a whole hostile stream in one event.
const MAX_EVENT_DATA: usize = 64 * 1024;

/// Whether one event's data is the model's output: a content, thinking or tool-call delta of
/// any of the three APIs. `message_start`, `response.created`, `ping` and role-only chunks
/// are not: they come before the model has produced anything.
pub(crate) fn is_token_event(data: &[u8]) -> bool {
    let Ok(v) = serde_json::from_slice::<Value>(data) else {
        return false;
    };
    match v.get("type").and_then(Value::as_str) {
        Some(t) if t.starts_with("response.") => responses::is_token_event(t),
        Some(t) => messages::is_token_event(t, &v),
        None => chat::is_token_chunk(&v),
    }
}

/// The index of the frame that completed the stream's first token event, if any.
pub(crate) fn first_token_frame(frames: &[Bytes]) -> Option<usize> {
    let mut data: Vec<u8> = Vec::new();
    let mut line: Vec<u8> = Vec::new();
    let mut overflow = false;
    for (i, frame) in frames.iter().enumerate() {
        for &b in frame.iter() {
            if b != b'\n' {
                if b != b'\r' && line.len() <= MAX_EVENT_DATA {
                    line.push(b);
                }
                continue;
            }
            if line.is_empty() {
                if !data.is_empty() && !overflow && is_token_event(&data) {
                    return Some(i);
                }
                data.clear();
                overflow = false;
            } else if let Some(rest) = line.strip_prefix(b"data:") {
                let rest = rest.strip_prefix(b" ").unwrap_or(rest);
                if data.len() + rest.len() > MAX_EVENT_DATA {
                    overflow = true;
                } else {
                    if !data.is_empty() {
                        data.push(b'\n');
                    }
                    data.extend_from_slice(rest);
                }
            }
            line.clear();
        }
    }
    None
}

/// The payload of each `data:` line of a whole recorded stream (each API sends one line per
/// event), `[DONE]` left out.
pub(crate) fn data_of_events(body: &[u8]) -> impl Iterator<Item = &[u8]> {
    body.split(|&b| b == b'\n').filter_map(|line| {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let rest = line.strip_prefix(b"data:")?;
        let rest = rest.strip_prefix(b" ").unwrap_or(rest);
        (rest != b"[DONE]").then_some(rest)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(parts: &[&'static str]) -> Vec<Bytes> {
        parts
            .iter()
            .map(|p| Bytes::from_static(p.as_bytes()))
            .collect()
    }

    #[test]
    fn the_first_token_is_the_first_content_delta_never_a_start_or_ping() {
        let messages = frames(&[
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"content\":[],\"usage\":{\"input_tokens\":9}}}\n\n",
            "event: ping\ndata: {\"type\": \"ping\"}\n\n",
            "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"thinking\",\"thinking\":\"\"}}\n\n",
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,",
            "\"delta\":{\"type\":\"thinking_delta\",\"thinking\":\"hm\"}}\n\n",
        ]);
        assert_eq!(first_token_frame(&messages), Some(4));
        let responses = frames(&[
            "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_1\"}}\n\n",
            "event: response.output_item.added\ndata: {\"type\":\"response.output_item.added\",\"item\":{\"type\":\"function_call\"}}\n\n",
            "event: response.function_call_arguments.delta\ndata: {\"type\":\"response.function_call_arguments.delta\",\"delta\":\"{\"}\n\n",
        ]);
        assert_eq!(first_token_frame(&responses), Some(2));
        let chat = frames(&[
            "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\ndata: [DONE]\n\n",
        ]);
        assert_eq!(first_token_frame(&chat), Some(1));
        assert_eq!(
            first_token_frame(&frames(&["event: ping\ndata: {\"type\":\"ping\"}\n\n"])),
            None
        );
    }
}
