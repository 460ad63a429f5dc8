//! Fixtures for the capture tests: recorder configs, exchanges driven straight into a real
//! recorder's sink, and agent-like sessions whose history grows every turn.

use std::path::Path;

use agentrace::capture::reader::{self, Exchange};
use agentrace::capture::{CaptureConfig, FullPolicy};
use agentrace::tap::{ExchangeEnd, ExchangeSink, ExchangeStart, KeySource};
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
    /// Wall-clock start (ns since the Unix epoch); now when `None`.
    pub start_unix_ns: Option<u128>,
    /// Time from start to end of the exchange.
    pub duration: Duration,
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
            start_unix_ns: None,
            duration: Duration::from_millis(5),
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
    let (obs, end_at) = drive_to_end(sink, ex);
    obs.end(ExchangeEnd::Complete, end_at);
}

/// [`drive`], waiting for the observer to be ready before the end as the proxy's response
/// body does (the `block` policy's wait for room).
pub async fn drive_waiting(sink: &dyn ExchangeSink, ex: &FakeExchange) {
    let (mut obs, end_at) = drive_to_end(sink, ex);
    std::future::poll_fn(|cx| obs.poll_ready(cx)).await;
    obs.end(ExchangeEnd::Complete, end_at);
}

/// Everything of [`drive`] but the end: the observer and the end's time.
fn drive_to_end(
    sink: &dyn ExchangeSink,
    ex: &FakeExchange,
) -> (Box<dyn agentrace::tap::ExchangeObserver>, Instant) {
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
        started_unix_ns: ex.start_unix_ns.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        }),
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
    obs.response_head(status, &resp, started + ex.duration / 10);
    let n = ex.frames.len() as u32 + 1;
    for (i, f) in ex.frames.iter().enumerate() {
        let at = ex.duration / 10 + (ex.duration * 8 / 10) * (i as u32 + 1) / n;
        obs.response_frame(f, started + at);
    }
    (obs, started + ex.duration)
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

/// The capture in `dir` with its exchanges in the order their requests arrived. Records are
/// written as exchanges end, and an exchange ends once its response is written to the client,
/// which the next request may overtake; a recorder numbers exchanges as they start.
pub fn read_by_arrival(dir: &Path) -> reader::Capture {
    let mut capture = reader::read_dir(dir).unwrap();
    capture.exchanges.sort_by_key(|e| e.record.id);
    capture
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

/// One client turn of a dataset conversation, as a capture should see it.
#[derive(Debug, Clone)]
pub struct SampleTurn {
    /// The request body the reference client sends.
    pub body: Vec<u8>,
    /// The recorded assistant row that answers it, if any.
    pub reply: Option<serde_json::Value>,
    /// The turn's `delay_seconds`.
    pub delay_seconds: f64,
}

/// A dataset conversation: its rows and its client turns.
#[derive(Debug, Clone)]
pub struct SampleConversation {
    pub id: String,
    pub rows: Vec<serde_json::Value>,
    pub turns: Vec<SampleTurn>,
}

/// Reads a flat MLPerf JSONL file and pre-builds each client turn's request as the reference
/// does (system first, tool rows expanded, null fields left out, compact JSON).
pub fn dataset_conversations(path: &Path) -> Vec<SampleConversation> {
    use serde_json::{json, Map, Value};
    let text = std::fs::read_to_string(path).unwrap();
    let mut convs: Vec<SampleConversation> = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let row: Value = serde_json::from_str(line).unwrap();
        let id = row["conversation_id"].as_str().unwrap().to_owned();
        match convs.last_mut() {
            Some(c) if c.id == id => c.rows.push(row),
            _ => convs.push(SampleConversation {
                id,
                rows: vec![row],
                turns: Vec::new(),
            }),
        }
    }
    for c in &mut convs {
        c.rows.sort_by_key(|r| r["turn"].as_u64().unwrap());
        let mut history: Vec<Value> = Vec::new();
        if let Some(system) = c
            .rows
            .iter()
            .find_map(|r| r["system"].as_str().filter(|s| !s.is_empty()))
        {
            history.push(json!({"role": "system", "content": system}));
        }
        let tools = c.rows[0].get("tools").cloned();
        for (i, row) in c.rows.iter().enumerate() {
            let role = row["role"].as_str().unwrap();
            match role {
                "assistant" => {
                    let mut m = Map::new();
                    m.insert("role".into(), json!("assistant"));
                    for k in ["content", "tool_calls", "reasoning_content"] {
                        if let Some(v) = row.get(k).filter(|v| !v.is_null()) {
                            m.insert(k.into(), v.clone());
                        }
                    }
                    history.push(Value::Object(m));
                }
                "tool" => {
                    for r in row["tool_results"].as_array().unwrap() {
                        history.push(json!({"role": "tool", "content": r["content"], "tool_call_id": r["tool_call_id"]}));
                    }
                }
                _ => history.push(json!({"role": "user", "content": row["content"]})),
            }
            if role != "assistant" {
                let mut body = Map::new();
                body.insert("model".into(), json!("sample-model"));
                body.insert("messages".into(), json!(history));
                body.insert("max_completion_tokens".into(), json!(1024));
                body.insert("stream".into(), json!(true));
                if let Some(t) = &tools {
                    body.insert("tools".into(), t.clone());
                }
                let reply = c
                    .rows
                    .get(i + 1)
                    .filter(|r| r["role"] == "assistant")
                    .cloned();
                c.turns.push(SampleTurn {
                    body: serde_json::to_vec(&body).unwrap(),
                    reply,
                    delay_seconds: row
                        .get("delay_seconds")
                        .and_then(Value::as_f64)
                        .unwrap_or(0.0),
                });
            }
        }
    }
    convs
}

/// The SSE stream a server would send for a recorded assistant row: reasoning, content and
/// tool calls as separate deltas, split in a few events each.
pub fn sse_for_row(row: &serde_json::Value) -> Vec<Bytes> {
    use serde_json::json;
    let mut events = Vec::new();
    let chunk = |delta: serde_json::Value| json!({"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]});
    for (key, field) in [
        ("reasoning_content", "reasoning_content"),
        ("content", "content"),
    ] {
        if let Some(text) = row.get(key).and_then(|v| v.as_str()) {
            let chars: Vec<char> = text.chars().collect();
            for part in chars.chunks(40) {
                events.push(chunk(json!({ field: part.iter().collect::<String>() })));
            }
        }
    }
    for (i, call) in row
        .get("tool_calls")
        .and_then(|v| v.as_array())
        .into_iter()
        .flatten()
        .enumerate()
    {
        let args = call["function"]["arguments"]
            .as_str()
            .unwrap_or("")
            .to_owned();
        let (a, b) = args.split_at(
            args.char_indices()
                .nth(args.chars().count() / 2)
                .map_or(0, |x| x.0),
        );
        events.push(chunk(json!({"tool_calls": [{"index": i, "id": call["id"], "type": "function", "function": {"name": call["function"]["name"], "arguments": a}}]})));
        events.push(chunk(
            json!({"tool_calls": [{"index": i, "function": {"arguments": b}}]}),
        ));
    }
    events.push(json!({"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}));
    let mut frames: Vec<Bytes> = events
        .iter()
        .map(|e| Bytes::from(format!("data: {e}\n\n")))
        .collect();
    frames.push(Bytes::from_static(b"data: [DONE]\n\n"));
    frames
}

/// Drives every conversation through `sink` as interleaved sessions, each turn starting its
/// recorded delay after the previous turn's end (wall-clock times made up, monotonic ones
/// real); returns the raw request + response bytes.
pub fn drive_conversations(sink: &dyn ExchangeSink, convs: &[SampleConversation]) -> u64 {
    let t0: u128 = 1_780_000_000_000_000_000;
    let mut clock: Vec<u128> = (0..convs.len())
        .map(|i| t0 + i as u128 * 1_000_000)
        .collect();
    let mut raw = 0u64;
    let max_turns = convs.iter().map(|c| c.turns.len()).max().unwrap_or(0);
    for t in 0..max_turns {
        for (i, c) in convs.iter().enumerate() {
            let Some(turn) = c.turns.get(t) else { continue };
            let frames = turn.reply.as_ref().map(sse_for_row).unwrap_or_default();
            let start = clock[i] + (turn.delay_seconds * 1e9).round() as u128;
            let ex = FakeExchange {
                session: Some(c.id.clone()),
                headers: vec![
                    ("content-type", "application/json".into()),
                    ("x-session-id", c.id.clone()),
                ],
                path: "/v1/chat/completions".into(),
                body: Bytes::from(turn.body.clone()),
                status: 200,
                response_headers: vec![("content-type", "text/event-stream".into())],
                frames,
                start_unix_ns: Some(start),
                duration: Duration::from_millis(20),
            };
            raw += ex.body.len() as u64 + ex.frames.iter().map(|f| f.len() as u64).sum::<u64>();
            drive(sink, &ex);
            clock[i] = start + 20_000_000;
        }
    }
    raw
}

/// A simulated backend on `127.0.0.1:0`, fast enough for tests.
pub fn start_sim(shutdown: agentrace::shutdown::Shutdown) -> agentrace::sim::SimCluster {
    let mut config = agentrace::sim::SimConfig {
        time_scale: 0.001,
        ..Default::default()
    };
    config.responder.output_tokens_max = 48;
    agentrace::sim::start(config, "127.0.0.1:0".parse().unwrap(), 1, shutdown).unwrap()
}

/// A proxy on `127.0.0.1:0` in front of `backends`, recording with `capture`.
pub async fn start_proxy(
    backends: &[std::net::SocketAddr],
    capture: Option<CaptureConfig>,
    shutdown: agentrace::shutdown::Shutdown,
) -> agentrace::proxy::ProxyHandle {
    let mut config = proxy_config(backends);
    if let Some(c) = capture {
        config.capture = c;
    }
    agentrace::proxy::start(config, shutdown).await.unwrap()
}

/// The config of a proxy on `127.0.0.1:0` in front of `backends`, recording nothing.
pub fn proxy_config(backends: &[std::net::SocketAddr]) -> agentrace::proxy::ProxyConfig {
    let mut config = agentrace::proxy::ProxyConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        ..Default::default()
    };
    config.admin.listen = "127.0.0.1:0".parse().unwrap();
    config.shutdown_grace_secs = 5;
    config.backends = backends
        .iter()
        .enumerate()
        .map(|(i, a)| agentrace::proxy::config::BackendConfig {
            name: format!("b{i}"),
            url: format!("http://{a}"),
            weight: 1.0,
        })
        .collect();
    config
}

/// A plain HTTP/1.1 client.
pub type Client = hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    http_body_util::Full<Bytes>,
>;

/// A new client.
pub fn client() -> Client {
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build_http()
}

/// Sends a POST and returns the status and every body frame as it arrived.
pub async fn post(
    client: &Client,
    url: &str,
    headers: &[(&str, &str)],
    body: Vec<u8>,
) -> (u16, Vec<Bytes>) {
    let mut req = http::Request::post(url).header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = client
        .request(
            req.body(http_body_util::Full::new(Bytes::from(body)))
                .unwrap(),
        )
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, data_frames(resp.into_body()).await)
}

/// The data frames of a response body, to its end.
pub async fn data_frames(mut body: hyper::body::Incoming) -> Vec<Bytes> {
    use http_body_util::BodyExt;
    let mut frames = Vec::new();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            frames.push(data);
        }
    }
    frames
}

/// Runs an agent-like session of `turns` through `url`: every turn resends the history plus
/// the reply it got (as the reference sends assistant messages) and a tool result or a user
/// message, with the generation settings an agent sets. Returns the request bodies sent and
/// the response bytes received.
pub async fn agent_session(
    client: &Client,
    url: &str,
    session: &str,
    turns: usize,
    extra_headers: &[(&str, &str)],
) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
    use serde_json::json;
    let mut messages = vec![
        json!({"role": "system", "content": "You are a coding agent. Use the bash tool."}),
        json!({"role": "user", "content": format!("Session {session}: make the tests pass.")}),
    ];
    let mut bodies = Vec::new();
    let mut replies = Vec::new();
    for turn in 0..turns {
        let body = serde_json::to_vec(&json!({"model": "m", "messages": messages,
            "max_completion_tokens": 48, "stream": true, "temperature": 0.25, "top_p": 0.9,
            "top_k": 20, "seed": 7, "stop": ["</done>"],
            "chat_template_kwargs": {"enable_thinking": false},
            "stream_options": {"include_usage": true}}))
        .unwrap();
        let mut headers = vec![("x-session-id", session)];
        headers.extend_from_slice(extra_headers);
        let (status, frames) = post(client, url, &headers, body.clone()).await;
        assert_eq!(status, 200, "turn {turn}");
        let bytes = frames.concat();
        let reply = agentrace::capture::export::assistant_from_sse(&bytes).unwrap();
        bodies.push(body);
        replies.push(bytes);
        answer(&mut messages, reply, turn);
    }
    (bodies, replies)
}

/// Appends the reply of `turn` and what an agent sends after it: a tool result per tool
/// call, or a user message when there is none.
pub fn answer(messages: &mut Vec<serde_json::Value>, reply: serde_json::Value, turn: usize) {
    use serde_json::{json, Value};
    let calls = reply.get("tool_calls").and_then(Value::as_array).cloned();
    messages.push(reply);
    match calls {
        Some(calls) => {
            for c in calls {
                messages.push(json!({"role": "tool", "content": format!("exit 0 after turn {turn}"), "tool_call_id": c["id"]}));
            }
        }
        None => messages
            .push(json!({"role": "user", "content": format!("Continue with step {}.", turn + 1)})),
    }
}
