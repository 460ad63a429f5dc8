//! Fixtures for the capture tests: recorder configs, exchanges driven straight into a real
//! recorder's sink, and agent-like sessions whose history grows every turn.

use std::path::Path;

use agentrace::capture::reader::{self, Exchange};
use agentrace::capture::{CaptureConfig, FullPolicy};
use agentrace::proxy::tap::{ExchangeEnd, ExchangeSink, ExchangeStart, KeySource};
use bytes::Bytes;
use tokio::time::{Duration, Instant};

/// A recorder config writing to `dir` with a short flush interval.
pub fn config(dir: &Path) -> CaptureConfig {
    CaptureConfig {
        enabled: true,
        dir: dir.to_path_buf(),
        flush_interval_ms: 50,
        full_policy: FullPolicy::Drop,
        ..CaptureConfig::default()
    }
}

/// One exchange to push through a sink.
#[derive(Debug, Clone)]
pub struct FakeExchange {
    pub session: Option<String>,
    pub headers: Vec<(&'static str, String)>,
    pub path: String,
    pub body: Bytes,
    pub status: u16,
    pub response_headers: Vec<(&'static str, String)>,
    pub frames: Vec<Bytes>,
}

impl FakeExchange {
    /// A streaming chat-completions exchange of `session` with `body`, answered by `reply`
    /// as SSE events, one frame each.
    pub fn chat(session: Option<&str>, body: Vec<u8>, reply: &str) -> FakeExchange {
        FakeExchange {
            session: session.map(str::to_owned),
            headers: vec![("content-type", "application/json".into())],
            path: "/v1/chat/completions".into(),
            body: Bytes::from(body),
            status: 200,
            response_headers: vec![("content-type", "text/event-stream".into())],
            frames: sse_reply(reply),
        }
    }
}

/// An OpenAI-style SSE stream carrying `text` in a few content deltas, then `[DONE]`.
pub fn sse_reply(text: &str) -> Vec<Bytes> {
    let mut frames = Vec::new();
    let words: Vec<&str> = text.split_inclusive(' ').collect();
    for chunk in words.chunks(3) {
        let piece: String = chunk.concat();
        let event = serde_json::json!({
            "id": "chatcmpl-1", "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": piece}}]
        });
        frames.push(Bytes::from(format!("data: {event}\n\n")));
    }
    let last = serde_json::json!({
        "id": "chatcmpl-1", "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]
    });
    frames.push(Bytes::from(format!("data: {last}\n\ndata: [DONE]\n\n")));
    frames
}

/// Pushes `ex` through `sink` as the proxy would: start, head, every frame, end.
pub fn drive(sink: &dyn ExchangeSink, ex: &FakeExchange) {
    let started = Instant::now();
    let mut headers = http::HeaderMap::new();
    for (k, v) in &ex.headers {
        headers.append(
            http::HeaderName::from_static(k),
            http::HeaderValue::from_str(v).unwrap(),
        );
    }
    let mut obs = sink.start(ExchangeStart {
        session_key: ex.session.clone(),
        key_source: if ex.session.is_some() {
            KeySource::Header
        } else {
            KeySource::None
        },
        backend: "b0".into(),
        started_unix_ns: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos(),
        started_at: started,
        request_received_at: started + Duration::from_micros(50),
        method: http::Method::POST,
        path_and_query: ex.path.clone(),
        request_headers: headers,
        request_body: ex.body.clone(),
    });
    let mut resp = http::HeaderMap::new();
    for (k, v) in &ex.response_headers {
        resp.append(
            http::HeaderName::from_static(k),
            http::HeaderValue::from_str(v).unwrap(),
        );
    }
    let status = http::StatusCode::from_u16(ex.status).unwrap();
    obs.response_head(status, &resp, started + Duration::from_micros(900));
    for (i, f) in ex.frames.iter().enumerate() {
        obs.response_frame(f, started + Duration::from_millis(1 + i as u64));
    }
    obs.end(
        ExchangeEnd::Complete,
        started + Duration::from_millis(2 + ex.frames.len() as u64),
    );
}

/// Request bodies of an agent session: each turn resends the whole history plus a new
/// assistant reply and tool result, like a coding agent.
pub fn agent_bodies(session: &str, turns: usize) -> Vec<Vec<u8>> {
    let tools = serde_json::json!([{"type": "function", "function": {"name": "bash",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]);
    let mut messages = vec![
        serde_json::json!({"role": "system", "content": "You are a helpful coding agent."}),
        serde_json::json!({"role": "user", "content": format!("Fix issue {session}: the parser fails on empty input. {}", "Details follow. ".repeat(40))}),
    ];
    let mut out = Vec::new();
    for turn in 0..turns {
        if turn > 0 {
            messages.push(serde_json::json!({"role": "assistant", "content": null,
                "tool_calls": [{"id": format!("call_{turn}"), "type": "function",
                "function": {"name": "bash", "arguments": format!("{{\"command\":\"grep -n parse src/lib{turn}.rs\"}}")}}]}));
            messages.push(serde_json::json!({"role": "tool", "tool_call_id": format!("call_{turn}"),
                "content": format!("src/lib{turn}.rs:{}: fn parse(input: &str) -> Result<Ast> {{ … }} — ünïcödé ✓ {}", turn * 7, "x".repeat(turn * 13 % 200))}));
        }
        let body = serde_json::json!({"model": "m", "messages": messages, "stream": true,
            "temperature": 0.0, "tools": tools});
        out.push(serde_json::to_vec(&body).unwrap());
    }
    out
}

/// Every exchange readable in `dir`, in file order.
pub fn read_all(dir: &Path) -> Vec<Exchange> {
    reader::read_dir(dir).unwrap().exchanges
}

/// Every segment file of `dir`, decompressed as far as it goes, concatenated.
pub fn decompressed(dir: &Path) -> Vec<u8> {
    let mut out = Vec::new();
    for path in reader::segments(dir).unwrap() {
        let file = std::fs::File::open(&path).unwrap();
        let mut dec = zstd::stream::read::Decoder::new(file).unwrap();
        let _ = std::io::copy(&mut dec, &mut out);
    }
    out
}

/// Every byte of every file in `dir`, raw (compressed) then decompressed.
pub fn all_bytes(dir: &Path) -> Vec<u8> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        out.extend(std::fs::read(entry.unwrap().path()).unwrap());
    }
    out.extend(decompressed(dir));
    out
}

/// True when `needle` occurs in `haystack`.
pub fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}
