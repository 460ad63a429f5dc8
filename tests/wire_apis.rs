//! The proxy and the recorder understand every agent's wire: Anthropic Messages (Claude Code)
//! and OpenAI Responses (Codex) as well as Chat Completions. Against backends that answer in
//! each API's exact shape, streamed and unstreamed:
//! - sessions without a routing header are pinned by their conversation fingerprint;
//! - a backend that lost a session's cache is noticed from each API's usage report;
//! - a request naming `previous_response_id` reaches the backend that created that response,
//!   and gets a clear error in the Responses error shape when that backend is gone;
//! - a capture of such traffic exports to a dataset that loads, with its turns, roles, tool
//!   calls and reasoning, and the source API kept;
//! - the recorded first token is the first content delta, not `message_start` or a `ping`.

mod support;

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use agentrace::capture::export::{self, ExportOptions};
use agentrace::proxy::ProxyConfig;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use parking_lot::Mutex;
use serde_json::{json, Value};
use tokio::net::TcpListener;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Body = BoxBody<Bytes, BoxError>;

/// Time a wire backend takes between its stream's opening events and its first token: a
/// prefill, long enough to tell the first byte from the first token.
const PREFILL: Duration = Duration::from_millis(40);

/// A backend serving `/v1/messages` and `/v1/responses` in those APIs' shapes, with a prefix
/// cache it can be told to lose, and the responses it created (for `previous_response_id`).
struct WireBackend {
    name: String,
    addr: SocketAddr,
    /// Conversations whose prefix this backend holds (by their first user text).
    cached: Mutex<HashSet<String>>,
    /// Responses this backend created: their conversation's first user text.
    created: Mutex<HashMap<String, String>>,
    next_id: AtomicU64,
    /// Requests naming a `previous_response_id` it never created.
    unknown_previous: AtomicU64,
    hits: AtomicU64,
    /// Loses its whole cache just before answering its request of this number (0: never).
    lose_cache_at_hit: AtomicU64,
    stop: tokio::sync::Notify,
    stopped: AtomicBool,
}

impl WireBackend {
    async fn spawn(name: &str) -> Arc<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let me = Arc::new(Self {
            name: name.to_owned(),
            addr: listener.local_addr().unwrap(),
            cached: Mutex::new(HashSet::new()),
            created: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
            unknown_previous: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            lose_cache_at_hit: AtomicU64::new(0),
            stop: tokio::sync::Notify::new(),
            stopped: AtomicBool::new(false),
        });
        let server = me.clone();
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    a = listener.accept() => a,
                    () = server.stop.notified() => return,
                };
                let Ok((tcp, _)) = accepted else { continue };
                // As servers that stream do: no small event waits for the previous one's ACK.
                let _ = tcp.set_nodelay(true);
                let s = server.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        let s = s.clone();
                        async move {
                            // Stopped: connections kept alive by the proxy fail too.
                            if s.stopped.load(Ordering::SeqCst) {
                                return Err(std::io::Error::other("stopped"));
                            }
                            Ok::<Response<Body>, std::io::Error>(s.answer(req).await)
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tcp), svc)
                        .await;
                });
            }
        });
        me
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops listening: the port stays bound by nobody, so connects are refused.
    fn stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
        self.stop.notify_one();
    }

    async fn answer(&self, req: Request<Incoming>) -> Response<Body> {
        let path = req.uri().path().to_owned();
        if path == "/health" {
            return json_response(StatusCode::OK, json!({"ok": true}));
        }
        let hit = self.hits.fetch_add(1, Ordering::Relaxed) + 1;
        if hit == self.lose_cache_at_hit.load(Ordering::Relaxed) {
            // Evicted, as an engine under memory pressure does.
            self.cached.lock().clear();
        }
        let body = req.into_body().collect().await.unwrap().to_bytes();
        let v: Value = serde_json::from_slice(&body).unwrap();
        let stream = v["stream"].as_bool().unwrap_or(false);
        let prompt = body.len() as u64 / 4;
        match path.as_str() {
            "/v1/messages" => self.messages(&v, prompt, stream),
            "/v1/responses" => self.responses(&v, prompt, stream),
            other => json_response(StatusCode::NOT_FOUND, json!({"error": other})),
        }
    }

    /// Cached tokens for a prompt of conversation `conv`: all but the last few when this
    /// backend holds it, else none; it holds it afterwards.
    fn cache(&self, conv: &str, prompt: u64) -> u64 {
        let hit = !self.cached.lock().insert(conv.to_owned());
        if hit {
            prompt.saturating_sub(8)
        } else {
            0
        }
    }

    fn messages(&self, v: &Value, prompt: u64, stream: bool) -> Response<Body> {
        let msgs = v["messages"].as_array().unwrap();
        let conv = first_text(&msgs[0]["content"]);
        let cached = self.cache(&conv, prompt);
        // The model calls a tool after a user's text, and answers in text after a tool result.
        let last = &msgs[msgs.len() - 1]["content"];
        let after_tool = last
            .as_array()
            .is_some_and(|b| b.iter().any(|b| b["type"] == "tool_result"));
        let turn = msgs.len();
        let usage = json!({"input_tokens": prompt - cached, "cache_creation_input_tokens": 0,
                           "cache_read_input_tokens": cached, "output_tokens": 1});
        let (block, deltas) = if after_tool {
            (
                json!({"type": "text", "text": ""}),
                vec![
                    json!({"type": "text_delta", "text": format!("done {turn} ")}),
                    json!({"type": "text_delta", "text": "ok"}),
                ],
            )
        } else {
            (
                json!({"type": "tool_use", "id": format!("toolu_{turn}"), "name": "bash", "input": {}}),
                vec![
                    json!({"type": "input_json_delta", "partial_json": "{\"cmd\": "}),
                    json!({"type": "input_json_delta", "partial_json": format!("\"ls {turn}\"}}")}),
                ],
            )
        };
        let id = format!(
            "msg_{}_{}",
            self.name,
            self.next_id.fetch_add(1, Ordering::Relaxed)
        );
        if !stream {
            let content = if after_tool {
                json!([{"type": "thinking", "thinking": "think", "signature": "s"},
                       {"type": "text", "text": format!("done {turn} ok")}])
            } else {
                json!([{"type": "thinking", "thinking": "think", "signature": "s"},
                       {"type": "tool_use", "id": format!("toolu_{turn}"), "name": "bash",
                        "input": {"cmd": format!("ls {turn}")}}])
            };
            return json_response(
                StatusCode::OK,
                json!({"id": id, "type": "message",
                "role": "assistant", "model": v["model"], "content": content,
                "stop_reason": if after_tool {"end_turn"} else {"tool_use"},
                "usage": usage}),
            );
        }
        let mut before = vec![
            sse(
                "message_start",
                json!({"type": "message_start", "message": {"id": id,
                "type": "message", "role": "assistant", "model": v["model"], "content": [],
                "stop_reason": null, "usage": usage}}),
            ),
            sse("ping", json!({"type": "ping"})),
            sse(
                "content_block_start",
                json!({"type": "content_block_start", "index": 0,
                "content_block": {"type": "thinking", "thinking": ""}}),
            ),
        ];
        let mut after = vec![
            sse(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 0,
                "delta": {"type": "thinking_delta", "thinking": "think"}}),
            ),
            sse(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": 0}),
            ),
            sse(
                "content_block_start",
                json!({"type": "content_block_start", "index": 1, "content_block": block}),
            ),
        ];
        for d in deltas {
            after.push(sse(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 1, "delta": d}),
            ));
        }
        after.push(sse(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 1}),
        ));
        after.push(sse(
            "message_delta",
            json!({"type": "message_delta",
            "delta": {"stop_reason": if after_tool {"end_turn"} else {"tool_use"}},
            "usage": {"output_tokens": 9}}),
        ));
        after.push(sse("message_stop", json!({"type": "message_stop"})));
        before.shrink_to_fit();
        sse_response(before, after)
    }

    fn responses(&self, v: &Value, prompt: u64, stream: bool) -> Response<Body> {
        let conv = match v.get("previous_response_id").and_then(Value::as_str) {
            Some(prev) => match self.created.lock().get(prev) {
                Some(conv) => conv.clone(),
                None => {
                    self.unknown_previous.fetch_add(1, Ordering::Relaxed);
                    return json_response(
                        StatusCode::NOT_FOUND,
                        json!({"error": {
                        "message": format!("Response with id '{prev}' not found."),
                        "type": "invalid_request_error", "param": "previous_response_id",
                        "code": "previous_response_not_found"}}),
                    );
                }
            },
            None => match &v["input"] {
                Value::String(s) => s.clone(),
                Value::Array(items) => {
                    first_text(&items.iter().find(|i| i["role"] == "user").unwrap()["content"])
                }
                _ => panic!("input"),
            },
        };
        let cached = self.cache(&conv, prompt);
        let id = format!(
            "resp_{}_{}",
            self.name,
            self.next_id.fetch_add(1, Ordering::Relaxed)
        );
        self.created.lock().insert(id.clone(), conv);
        let input = &v["input"];
        let after_tool = input.as_array().is_some_and(|items| {
            items
                .last()
                .is_some_and(|i| i["type"] == "function_call_output")
        });
        let n = self.next_id.load(Ordering::Relaxed);
        let reasoning = json!({"type": "reasoning", "id": format!("rs_{n}"),
            "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]});
        let item = if after_tool {
            json!({"type": "message", "id": format!("msg_{n}"), "role": "assistant", "status": "completed",
                   "content": [{"type": "output_text", "text": format!("done {n}"), "annotations": []}]})
        } else {
            json!({"type": "function_call", "id": format!("fc_{n}"), "call_id": format!("call_{n}"),
                   "name": "shell", "arguments": format!("{{\"cmd\":\"ls {n}\"}}"), "status": "completed"})
        };
        let usage = json!({"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                           "output_tokens": 9, "output_tokens_details": {"reasoning_tokens": 1},
                           "total_tokens": prompt + 9});
        let response = |status: &str, output: Value, usage: Value| {
            json!({"id": id, "object": "response",
            "created_at": 1, "status": status, "model": v["model"], "output": output,
            "previous_response_id": v.get("previous_response_id"), "usage": usage})
        };
        if !stream {
            return json_response(
                StatusCode::OK,
                response("completed", json!([reasoning, item]), usage),
            );
        }
        let before = vec![
            sse(
                "response.created",
                json!({"type": "response.created", "sequence_number": 0,
                "response": response("in_progress", json!([]), Value::Null)}),
            ),
            sse(
                "response.in_progress",
                json!({"type": "response.in_progress", "sequence_number": 1,
                "response": response("in_progress", json!([]), Value::Null)}),
            ),
        ];
        let mut after = vec![
            sse(
                "response.output_item.added",
                json!({"type": "response.output_item.added",
                "output_index": 0, "item": {"type": "reasoning", "id": format!("rs_{n}"), "summary": []}}),
            ),
            sse(
                "response.reasoning_text.delta",
                json!({"type": "response.reasoning_text.delta",
                "output_index": 0, "content_index": 0, "delta": "think"}),
            ),
            sse(
                "response.output_item.done",
                json!({"type": "response.output_item.done", "output_index": 0, "item": reasoning}),
            ),
        ];
        if after_tool {
            after.push(sse(
                "response.output_text.delta",
                json!({"type": "response.output_text.delta",
                "output_index": 1, "content_index": 0, "delta": format!("done {n}")}),
            ));
        } else {
            after.push(sse(
                "response.function_call_arguments.delta",
                json!({"type": "response.function_call_arguments.delta",
                "output_index": 1, "delta": format!("{{\"cmd\":\"ls {n}\"}}")}),
            ));
        }
        after.push(sse(
            "response.output_item.done",
            json!({"type": "response.output_item.done", "output_index": 1, "item": item}),
        ));
        after.push(sse(
            "response.completed",
            json!({"type": "response.completed",
            "response": response("completed", json!([reasoning, item]), usage)}),
        ));
        sse_response(before, after)
    }
}

fn first_text(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .find_map(|p| p["text"].as_str())
            .unwrap_or("")
            .to_owned(),
        _ => String::new(),
    }
}

fn sse(event: &str, data: Value) -> Bytes {
    Bytes::from(format!("event: {event}\ndata: {data}\n\n"))
}

fn json_response(status: StatusCode, v: Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(
            Full::new(Bytes::from(v.to_string()))
                .map_err(|e| match e {})
                .boxed(),
        )
        .unwrap()
}

/// A stream of `before`, then after a prefill the model's output `after`, one frame an event.
fn sse_response(before: Vec<Bytes>, after: Vec<Bytes>) -> Response<Body> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(64);
    tokio::spawn(async move {
        for b in before {
            let _ = tx.send(Ok(Frame::data(b))).await;
        }
        tokio::time::sleep(PREFILL).await;
        for b in after {
            let _ = tx.send(Ok(Frame::data(b))).await;
        }
    });
    let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(BodyExt::boxed(StreamBody::new(stream)))
        .unwrap()
}

// ---------------------------------------------------------------------------------------------
// Clients: a Claude Code-like and a Codex-like agent loop.

type Client = hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    Full<Bytes>,
>;

fn client() -> Client {
    hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build_http()
}

/// What one request of an agent saw.
struct Seen {
    status: StatusCode,
    backend: Option<String>,
    body: Bytes,
    /// Client-side time from sending to the first token event (streams only).
    ttft: Option<Duration>,
}

/// The admin address of each proxy under test, by its URL: a request waits until the proxy
/// counts nothing in flight, as an agent's next turn follows the end of its last one (the
/// proxy ends an exchange just after the client has read it).
static ADMINS: Mutex<Vec<(String, SocketAddr)>> = Mutex::new(Vec::new());

fn register(proxy: &agentrace::proxy::ProxyHandle) -> String {
    let url = format!("http://{}", proxy.addr);
    ADMINS.lock().push((url.clone(), proxy.admin_addr));
    url
}

async fn idle(client: &Client, url: &str) {
    let admin = ADMINS
        .lock()
        .iter()
        .find(|(u, _)| url.starts_with(u.as_str()))
        .map(|a| a.1);
    let Some(admin) = admin else { return };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let resp = client
            .request(
                Request::get(format!("http://{admin}/admin/backends"))
                    .body(Full::new(Bytes::new()))
                    .unwrap(),
            )
            .await
            .unwrap();
        let v: Value =
            serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
        let busy: u64 = v["backends"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["in_flight"].as_u64().unwrap())
            .sum();
        if busy == 0 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "requests still in flight after 10 s"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

async fn post(client: &Client, url: &str, headers: &[(&str, &str)], body: &Value) -> Seen {
    idle(client, url).await;
    let mut req = Request::post(url).header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let sent = tokio::time::Instant::now();
    let resp = client
        .request(req.body(Full::new(Bytes::from(body.to_string()))).unwrap())
        .await
        .unwrap();
    let status = resp.status();
    let backend = resp
        .headers()
        .get("x-agentrace-backend")
        .map(|v| v.to_str().unwrap().to_owned());
    let mut incoming = resp.into_body();
    let mut all = Vec::new();
    let mut ttft = None;
    while let Some(frame) = incoming.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            let text = String::from_utf8_lossy(&data);
            if ttft.is_none() && (text.contains("_delta\"") || text.contains(".delta\"")) {
                ttft = Some(sent.elapsed());
            }
            all.extend_from_slice(&data);
        }
    }
    Seen {
        status,
        backend,
        body: Bytes::from(all),
        ttft,
    }
}

/// The data of each SSE event of a whole stream, parsed.
fn events(body: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(body)
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str(d).ok())
        .collect()
}

/// A Claude Code-like session: `turns` requests to `/v1/messages?beta=true`, each resending
/// the whole conversation (system blocks with `cache_control`, which moves to the newest
/// message every turn), with a tool result after each tool call.
async fn claude_session(
    client: &Client,
    url: &str,
    conv: &str,
    turns: usize,
    stream: bool,
) -> Vec<Seen> {
    claude_session_with(client, url, conv, turns, stream, |_, _| async {}).await
}

/// [`claude_session`], calling `before(turn, backend of turn 0)` before each turn.
async fn claude_session_with<F, Fut>(
    client: &Client,
    url: &str,
    conv: &str,
    turns: usize,
    stream: bool,
    mut before: F,
) -> Vec<Seen>
where
    F: FnMut(usize, Option<String>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut messages: Vec<Value> = vec![json!({"role": "user", "content": [
        {"type": "text", "text": format!("fix the bug in {conv}"), "cache_control": {"type": "ephemeral"}}]})];
    let mut seen: Vec<Seen> = Vec::new();
    for turn in 0..turns {
        before(turn, seen.first().and_then(|s| s.backend.clone())).await;
        let body = json!({"model": "claude-test", "max_tokens": 256, "stream": stream,
            "system": [{"type": "text", "text": "You are Claude Code."},
                       {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
            "messages": messages});
        let s = post(
            client,
            &format!("{url}/v1/messages?beta=true"),
            &[
                ("anthropic-version", "2023-06-01"),
                ("x-api-key", "sk-ant-SECRET"),
            ],
            &body,
        )
        .await;
        assert_eq!(s.status, 200, "{}", String::from_utf8_lossy(&s.body));
        let content = assistant_content(&s.body, stream);
        // The client moves `cache_control` to the newest message: strip it from the old ones.
        for m in &mut messages {
            if let Some(blocks) = m["content"].as_array_mut() {
                for b in blocks {
                    b.as_object_mut().unwrap().remove("cache_control");
                }
            }
        }
        let tool = content.iter().find(|b| b["type"] == "tool_use").cloned();
        messages.push(json!({"role": "assistant", "content": content}));
        match tool {
            Some(t) => messages.push(json!({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": t["id"], "content": "file.rs",
                 "cache_control": {"type": "ephemeral"}}]})),
            None => messages.push(json!({"role": "user", "content": [
                {"type": "text", "text": "next", "cache_control": {"type": "ephemeral"}}]})),
        }
        seen.push(s);
    }
    seen
}

/// The assistant content blocks of a Messages response, streamed or not.
fn assistant_content(body: &[u8], stream: bool) -> Vec<Value> {
    if !stream {
        let v: Value = serde_json::from_slice(body).unwrap();
        return v["content"].as_array().unwrap().clone();
    }
    let mut blocks: Vec<Value> = Vec::new();
    let mut json_parts: HashMap<usize, String> = HashMap::new();
    for e in events(body) {
        let i = e["index"].as_u64().unwrap_or(0) as usize;
        match e["type"].as_str().unwrap() {
            "content_block_start" => blocks.push(e["content_block"].clone()),
            "content_block_delta" => match e["delta"]["type"].as_str().unwrap() {
                "text_delta" => {
                    let t = format!(
                        "{}{}",
                        blocks[i]["text"].as_str().unwrap_or(""),
                        e["delta"]["text"].as_str().unwrap()
                    );
                    blocks[i]["text"] = json!(t);
                }
                "thinking_delta" => {
                    let t = format!(
                        "{}{}",
                        blocks[i]["thinking"].as_str().unwrap_or(""),
                        e["delta"]["thinking"].as_str().unwrap()
                    );
                    blocks[i]["thinking"] = json!(t);
                }
                "input_json_delta" => json_parts
                    .entry(i)
                    .or_default()
                    .push_str(e["delta"]["partial_json"].as_str().unwrap()),
                _ => {}
            },
            _ => {}
        }
    }
    for (i, j) in json_parts {
        blocks[i]["input"] = serde_json::from_str(&j).unwrap();
    }
    blocks
}

/// The response object of a Responses answer, streamed (its `response.completed`) or not.
fn response_object(body: &[u8], stream: bool) -> Value {
    if !stream {
        return serde_json::from_slice(body).unwrap();
    }
    events(body)
        .into_iter()
        .find(|e| e["type"] == "response.completed")
        .expect("response.completed")["response"]
        .clone()
}

/// A Codex-like session over `/v1/responses`: with `chained`, each request names the previous
/// response and carries only the new items; otherwise it resends the whole input.
async fn codex_session(
    client: &Client,
    url: &str,
    conv: &str,
    turns: usize,
    stream: bool,
    chained: bool,
) -> Vec<Seen> {
    codex_session_with(client, url, conv, turns, stream, chained, |_, _| async {}).await
}

/// [`codex_session`], calling `before(turn, backend of turn 0)` before each turn.
async fn codex_session_with<F, Fut>(
    client: &Client,
    url: &str,
    conv: &str,
    turns: usize,
    stream: bool,
    chained: bool,
    mut before: F,
) -> Vec<Seen>
where
    F: FnMut(usize, Option<String>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut input: Vec<Value> = vec![json!({"type": "message", "role": "user",
        "content": [{"type": "input_text", "text": format!("refactor {conv}")}]})];
    let mut new_items = input.clone();
    let mut previous: Option<String> = None;
    let mut seen: Vec<Seen> = Vec::new();
    for turn in 0..turns {
        before(turn, seen.first().and_then(|s| s.backend.clone())).await;
        let mut body = json!({"model": "codex-test", "instructions": "You are Codex.", "stream": stream,
            "store": true, "input": if chained { new_items.clone() } else { input.clone() }});
        if let Some(p) = previous.as_ref().filter(|_| chained) {
            body["previous_response_id"] = json!(p);
        }
        let s = post(
            client,
            &format!("{url}/v1/responses"),
            &[("authorization", "Bearer sk-SECRET")],
            &body,
        )
        .await;
        if s.status != 200 {
            seen.push(s);
            return seen;
        }
        let response = response_object(&s.body, stream);
        let output = response["output"].as_array().unwrap().clone();
        previous = response["id"].as_str().map(str::to_owned);
        new_items.clear();
        let call = output
            .iter()
            .find(|i| i["type"] == "function_call")
            .cloned();
        input.extend(output);
        let next = match call {
            Some(c) => {
                json!({"type": "function_call_output", "call_id": c["call_id"], "output": "src/"})
            }
            None => {
                json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go on"}]})
            }
        };
        input.push(next.clone());
        new_items.push(next);
        seen.push(s);
    }
    seen
}

fn proxy_config(backends: &[&Arc<WireBackend>]) -> ProxyConfig {
    let mut config = support::capture::proxy_config(&[]);
    config.backends = backends
        .iter()
        .map(|b| agentrace::proxy::config::BackendConfig {
            name: b.name.clone(),
            url: b.url(),
            weight: 1.0,
        })
        .collect();
    config.health.interval_ms = 0;
    config
}

async fn four_backends() -> Vec<Arc<WireBackend>> {
    let mut v = Vec::new();
    for name in ["w0", "w1", "w2", "w3"] {
        v.push(WireBackend::spawn(name).await);
    }
    v
}

async fn metrics(admin: SocketAddr) -> String {
    let resp = client()
        .request(
            Request::get(format!("http://{admin}/metrics"))
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await
        .unwrap();
    String::from_utf8(
        resp.into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec(),
    )
    .unwrap()
}

fn series(metrics: &str, name: &str) -> u64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .map_or(0, |v| v.trim().parse::<f64>().unwrap() as u64)
}

/// Sends a large request of another session to backend `name` (its key found through the
/// admin API), so that backend holds more active context than any other.
async fn load_backend(c: &Client, url: &str, admin: SocketAddr, name: &str) {
    for i in 0..1000 {
        let key = format!("other-{i}");
        let resp = c
            .request(
                Request::get(format!("http://{admin}/admin/sessions/{key}"))
                    .body(Full::new(Bytes::new()))
                    .unwrap(),
            )
            .await
            .unwrap();
        let v: Value =
            serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
        if v["rendezvous_order"][0] != name {
            continue;
        }
        let body = json!({"model": "claude-test", "max_tokens": 8, "stream": false,
            "messages": [{"role": "user", "content": "x".repeat(200_000)}]});
        let s = post(
            c,
            &format!("{url}/v1/messages"),
            &[("x-session-id", &key)],
            &body,
        )
        .await;
        assert_eq!(s.backend.as_deref(), Some(name));
        return;
    }
    panic!("no key goes to {name}");
}

fn one_backend(seen: &[Seen]) -> Option<String> {
    let set: HashSet<_> = seen.iter().map(|s| s.backend.clone()).collect();
    (set.len() == 1).then(|| seen[0].backend.clone()).flatten()
}

// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_and_responses_sessions_stay_on_one_backend_by_fingerprint_without_a_header() {
    let backends = four_backends().await;
    let (stop, shutdown) = agentrace::shutdown::channel();
    let proxy =
        agentrace::proxy::start(proxy_config(&backends.iter().collect::<Vec<_>>()), shutdown)
            .await
            .unwrap();
    let url = register(&proxy);
    let c = client();
    let mut homes = HashSet::new();
    for i in 0..6 {
        let claude = claude_session(&c, &url, &format!("c{i}"), 4, i % 2 == 0).await;
        let home = one_backend(&claude);
        assert!(
            home.is_some(),
            "Messages session c{i} moved: {:?}",
            claude.iter().map(|s| &s.backend).collect::<Vec<_>>()
        );
        homes.insert(home);
        let codex = codex_session(&c, &url, &format!("x{i}"), 4, i % 2 == 1, false).await;
        let home = one_backend(&codex);
        assert!(
            home.is_some(),
            "Responses session x{i} moved: {:?}",
            codex.iter().map(|s| &s.backend).collect::<Vec<_>>()
        );
        homes.insert(home);
    }
    assert!(homes.len() > 1, "12 sessions all on one backend: {homes:?}");
    let m = metrics(proxy.admin_addr).await;
    let by_fp: u64 = ["hash", "placed", "bound"]
        .iter()
        .map(|o| {
            series(
                &m,
                &format!(
                    "agentrace_affinity_decisions_total{{source=\"fingerprint\",outcome=\"{o}\"}}"
                ),
            )
        })
        .sum();
    assert_eq!(by_fp, 48, "every request keyed by its fingerprint:\n{m}");
    stop.fire();
    proxy.join().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_cache_is_noticed_from_messages_and_responses_usage() {
    for api in ["messages", "responses"] {
        for stream in [true, false] {
            let backends = four_backends().await;
            let (stop, shutdown) = agentrace::shutdown::channel();
            let mut config = proxy_config(&backends.iter().collect::<Vec<_>>());
            config.affinity.lost_cache_share = 0.5;
            // Plain hashing for new sessions, so the other agent's session can be put on
            // this one's backend.
            config.affinity.choices = 1;
            let proxy = agentrace::proxy::start(config, shutdown).await.unwrap();
            let url = register(&proxy);
            let c = client();
            // Two turns build the cache on the session's backend, which loses it before the
            // third: the third's usage says so, and the fourth moves.
            for b in &backends {
                b.lose_cache_at_hit.store(3, Ordering::Relaxed);
            }
            // A session moves only to a backend that would then hold less than its own: a
            // large session of another agent, active on the same backend, makes it so.
            let admin = proxy.admin_addr;
            let filler = |turn: usize, home: Option<String>| {
                let (c, url) = (c.clone(), url.clone());
                async move {
                    if turn == 3 {
                        load_backend(&c, &url, admin, &home.unwrap()).await;
                    }
                }
            };
            let seen = match api {
                "messages" => claude_session_with(&c, &url, "lost", 4, stream, filler).await,
                _ => codex_session_with(&c, &url, "lost", 4, stream, false, filler).await,
            };
            let home = seen[0].backend.clone().unwrap();
            let at: Vec<_> = seen.iter().map(|s| s.backend.clone().unwrap()).collect();
            assert_eq!(
                &at[..3],
                [home.clone(), home.clone(), home.clone()],
                "{api} stream={stream}"
            );
            assert_ne!(
                at[3], home,
                "{api} stream={stream}: the loss was not noticed"
            );
            let m = metrics(proxy.admin_addr).await;
            let moved =
                "agentrace_affinity_decisions_total{source=\"fingerprint\",outcome=\"moved\"}";
            assert_eq!(series(&m, moved), 1, "{api} stream={stream}:\n{m}");
            stop.fire();
            proxy.join().await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn previous_response_id_reaches_the_backend_that_created_it_over_four_backends() {
    let backends = four_backends().await;
    let (stop, shutdown) = agentrace::shutdown::channel();
    let mut config = proxy_config(&backends.iter().collect::<Vec<_>>());
    // Round robin places every request afresh: only the response ids keep a chain together.
    config.affinity.policy = agentrace::proxy::config::Policy::RoundRobin;
    let proxy = agentrace::proxy::start(config, shutdown).await.unwrap();
    let url = register(&proxy);
    let c = client();
    for i in 0..8 {
        let seen = codex_session(&c, &url, &format!("chain{i}"), 4, i % 2 == 0, true).await;
        assert_eq!(
            seen.len(),
            4,
            "chain{i} failed: {}",
            String::from_utf8_lossy(&seen.last().unwrap().body)
        );
        assert!(
            one_backend(&seen).is_some(),
            "chain{i} spread over backends"
        );
    }
    let unknown: u64 = backends
        .iter()
        .map(|b| b.unknown_previous.load(Ordering::Relaxed))
        .sum();
    assert_eq!(unknown, 0);
    let m = metrics(proxy.admin_addr).await;
    assert_eq!(series(&m, "agentrace_response_ids"), 32, "{m}");

    // The backend holding a chain stops: the next turn is refused with the Responses error
    // shape naming the parameter, not sent to a replica without the state.
    let first = codex_session(&c, &url, "orphan", 1, false, true).await;
    let home = first[0].backend.clone().unwrap();
    let prev = response_object(&first[0].body, false)["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let holder = backends.iter().find(|b| b.name == home).unwrap();
    holder.stop();
    let hits_before: u64 = backends
        .iter()
        .map(|b| b.hits.load(Ordering::Relaxed))
        .sum();
    let body = json!({"model": "codex-test", "previous_response_id": prev, "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "and?"}]}]});
    let s = post(&c, &format!("{url}/v1/responses"), &[], &body).await;
    assert_eq!(
        s.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        String::from_utf8_lossy(&s.body)
    );
    let err: Value = serde_json::from_slice(&s.body).unwrap();
    assert_eq!(err["error"]["param"], "previous_response_id", "{err}");
    assert_eq!(
        err["error"]["code"], "previous_response_unavailable",
        "{err}"
    );
    assert!(
        err["error"]["message"].as_str().unwrap().contains(&prev),
        "{err}"
    );
    let hits_after: u64 = backends
        .iter()
        .map(|b| b.hits.load(Ordering::Relaxed))
        .sum();
    assert_eq!(
        hits_before, hits_after,
        "no other replica was sent the orphaned request"
    );

    // Taken out of the pool: refused as the OpenAI API refuses an id it does not know.
    let rest: Vec<&Arc<WireBackend>> = backends.iter().filter(|b| b.name != home).collect();
    proxy.reload(proxy_config(&rest)).unwrap();
    let s = post(&c, &format!("{url}/v1/responses"), &[], &body).await;
    assert_eq!(
        s.status,
        StatusCode::BAD_REQUEST,
        "{}",
        String::from_utf8_lossy(&s.body)
    );
    let err: Value = serde_json::from_slice(&s.body).unwrap();
    assert_eq!(err["error"]["code"], "previous_response_not_found", "{err}");
    assert_eq!(err["error"]["type"], "invalid_request_error", "{err}");
    stop.fire();
    proxy.join().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_and_codex_captures_export_to_a_dataset_with_their_turns_and_first_tokens() {
    let backends = four_backends().await;
    let dir = tempfile::tempdir().unwrap();
    let cap = dir.path().join("cap");
    let (stop, shutdown) = agentrace::shutdown::channel();
    let mut config = proxy_config(&backends.iter().collect::<Vec<_>>());
    config.capture = support::capture::config(&cap);
    let proxy = agentrace::proxy::start(config, shutdown).await.unwrap();
    let url = register(&proxy);
    let c = client();
    let claude = claude_session(&c, &url, "cc", 4, true).await;
    let codex_full = codex_session(&c, &url, "cx", 4, false, false).await;
    let codex_chain = codex_session(&c, &url, "ch", 4, true, true).await;
    stop.fire();
    proxy.join().await;

    // The first token recorded is the first content delta, as the client saw it: after the
    // opening events and the prefill, not with the first byte.
    let capture = support::capture::read_all(&cap);
    assert_eq!(capture.len(), 12);
    for e in &capture {
        let t = &e.record.t;
        let Some(first_token) = t.first_token_us else {
            assert!(e
                .record
                .response
                .as_ref()
                .unwrap()
                .headers
                .iter()
                .any(|(k, v)| k == "content-type" && v == "application/json"));
            continue;
        };
        let first_byte = t.first_byte_us.unwrap();
        assert!(first_token >= first_byte + PREFILL.as_micros() as u64 * 3 / 4,
            "first token {first_token} µs is not after the prefill from the first byte {first_byte} µs");
        let headers = &e.record.request.headers;
        if let Some((_, v)) = headers.iter().find(|(k, _)| k == "x-api-key") {
            assert!(v.starts_with("REDACTED-"), "{v}");
        }
    }
    for s in claude.iter().chain(&codex_chain) {
        let ttft = s.ttft.expect("a token event");
        assert!(ttft >= PREFILL, "client TTFT {ttft:?}");
    }

    let out = dir.path().join("export.jsonl");
    let report = export::export(&cap, &out, &ExportOptions::default()).unwrap();
    assert_eq!(report.conversations, 3, "{report:?}");
    assert_eq!(report.client_turns, 12, "{report:?}");
    let rows: Vec<Value> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let conv = |api: &str| -> Vec<&Value> {
        let id = rows.iter().find(|r| r["source_api"] == api).unwrap()["conversation_id"].clone();
        rows.iter().filter(|r| r["conversation_id"] == id).collect()
    };
    let messages = conv("messages");
    assert_eq!(messages[0]["system"], "You are Claude Code.\n\nBe brief.");
    assert_eq!(messages[0]["content"], "fix the bug in cc");
    let roles: Vec<&str> = messages
        .iter()
        .map(|r| r["role"].as_str().unwrap())
        .collect();
    assert_eq!(
        roles,
        [
            "user",
            "assistant",
            "tool",
            "assistant",
            "user",
            "assistant",
            "tool",
            "assistant"
        ]
    );
    assert_eq!(messages[1]["tool_calls"][0]["function"]["name"], "bash");
    assert_eq!(messages[1]["reasoning_content"], "think");
    assert_eq!(
        messages[2]["tool_results"][0]["tool_call_id"],
        messages[1]["tool_calls"][0]["id"]
    );
    let responses: Vec<Vec<&Value>> = {
        let ids: Vec<Value> = rows
            .iter()
            .filter(|r| r["source_api"] == "responses")
            .map(|r| r["conversation_id"].clone())
            .collect::<Vec<_>>();
        let mut uniq: Vec<Value> = Vec::new();
        for id in ids {
            if !uniq.contains(&id) {
                uniq.push(id);
            }
        }
        uniq.iter()
            .map(|id| {
                rows.iter()
                    .filter(|r| &r["conversation_id"] == id)
                    .collect()
            })
            .collect()
    };
    assert_eq!(
        responses.len(),
        2,
        "the resent and the chained Codex sessions"
    );
    for conv in &responses {
        let roles: Vec<&str> = conv.iter().map(|r| r["role"].as_str().unwrap()).collect();
        assert_eq!(
            roles,
            [
                "user",
                "assistant",
                "tool",
                "assistant",
                "user",
                "assistant",
                "tool",
                "assistant"
            ],
            "{conv:?}"
        );
        assert_eq!(conv[0]["system"], "You are Codex.");
        assert_eq!(conv[1]["tool_calls"][0]["function"]["name"], "shell");
        assert_eq!(
            conv[2]["tool_results"][0]["tool_call_id"],
            conv[1]["tool_calls"][0]["id"]
        );
        assert_eq!(conv[1]["reasoning_content"], "think");
    }
    let _ = (codex_full, codex_chain);
    let dataset = agentrace::dataset::load(&out, &Default::default()).unwrap();
    assert_eq!(dataset.conversations.len(), 3);
    let turns: usize = dataset
        .conversations
        .iter()
        .map(|c| c.client_turns.len())
        .sum();
    assert_eq!(turns, 12);
}

/// The figures of `scripts/bench-wire.sh`: for each API, sessions pinned without a header,
/// lost caches noticed, turns exported against turns sent and the recorded TTFT against the
/// client's; and chains continued by `previous_response_id` over four backends, failed when
/// sent round robin straight to the backends against through the proxy. Prints one JSON line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "figures for scripts/bench-wire.sh"]
async fn wire_figures() {
    let sessions: usize = std::env::var("WIRE_SESSIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16);
    let turns = 4;
    let backends = four_backends().await;
    let dir = tempfile::tempdir().unwrap();
    let cap = dir.path().join("cap");
    let (stop, shutdown) = agentrace::shutdown::channel();
    let mut config = proxy_config(&backends.iter().collect::<Vec<_>>());
    config.capture = support::capture::config(&cap);
    let proxy = agentrace::proxy::start(config, shutdown).await.unwrap();
    let url = register(&proxy);
    let c = client();
    let mut pinned = HashMap::new();
    let mut client_ttft: Vec<Duration> = Vec::new();
    for api in ["messages", "responses"] {
        let mut n = 0;
        for i in 0..sessions {
            let stream = i % 2 == 0;
            let seen = match api {
                "messages" => claude_session(&c, &url, &format!("f{i}"), turns, stream).await,
                _ => codex_session(&c, &url, &format!("g{i}"), turns, stream, i % 4 == 0).await,
            };
            n += usize::from(one_backend(&seen).is_some());
            client_ttft.extend(seen.iter().filter_map(|s| s.ttft));
        }
        pinned.insert(api, n);
    }
    stop.fire();
    proxy.join().await;
    let capture = support::capture::read_all(&cap);
    let recorded: Vec<u64> = capture
        .iter()
        .filter_map(|e| e.record.t.first_token_us)
        .collect();
    let mut gaps: Vec<f64> = recorded
        .iter()
        .zip(&client_ttft)
        .map(|(r, c)| (*r as f64 / 1e3 - c.as_secs_f64() * 1e3).abs())
        .collect();
    gaps.sort_by(f64::total_cmp);
    let out = dir.path().join("export.jsonl");
    let report = export::export(&cap, &out, &ExportOptions::default()).unwrap();
    agentrace::dataset::load(&out, &Default::default()).unwrap();

    // Lost caches: each session's backend loses it before its third turn.
    let mut noticed = HashMap::new();
    for api in ["messages", "responses"] {
        let mut moved = 0;
        for i in 0..sessions.min(8) {
            let backends = four_backends().await;
            for b in &backends {
                b.lose_cache_at_hit.store(3, Ordering::Relaxed);
            }
            let (stop, shutdown) = agentrace::shutdown::channel();
            let mut config = proxy_config(&backends.iter().collect::<Vec<_>>());
            config.affinity.choices = 1;
            let proxy = agentrace::proxy::start(config, shutdown).await.unwrap();
            let url = register(&proxy);
            let admin = proxy.admin_addr;
            let filler = |turn: usize, home: Option<String>| {
                let (c, url) = (c.clone(), url.clone());
                async move {
                    if turn == 3 {
                        load_backend(&c, &url, admin, &home.unwrap()).await;
                    }
                }
            };
            let seen = match api {
                "messages" => {
                    claude_session_with(&c, &url, &format!("l{i}"), 4, i % 2 == 0, filler).await
                }
                _ => {
                    codex_session_with(&c, &url, &format!("l{i}"), 4, i % 2 == 0, false, filler)
                        .await
                }
            };
            moved += usize::from(seen[3].backend != seen[0].backend);
            stop.fire();
            proxy.join().await;
        }
        noticed.insert(api, (moved, sessions.min(8)));
    }

    // previous_response_id over four backends: straight round robin against the proxy.
    let backends = four_backends().await;
    let urls: Vec<String> = backends.iter().map(|b| b.url()).collect();
    let mut rr_failed = 0;
    let mut k = 0;
    for i in 0..sessions {
        let mut previous: Option<String> = None;
        for t in 0..turns {
            let mut body = json!({"model": "codex-test", "stream": false, "input": format!("chain {i} turn {t}")});
            if let Some(p) = &previous {
                body["previous_response_id"] = json!(p);
            }
            let s = post(
                &c,
                &format!("{}/v1/responses", urls[k % urls.len()]),
                &[],
                &body,
            )
            .await;
            k += 1;
            if s.status != 200 {
                rr_failed += 1;
                break;
            }
            previous = serde_json::from_slice::<Value>(&s.body).unwrap()["id"]
                .as_str()
                .map(str::to_owned);
        }
    }
    let (stop, shutdown) = agentrace::shutdown::channel();
    let mut config = proxy_config(&backends.iter().collect::<Vec<_>>());
    config.affinity.policy = agentrace::proxy::config::Policy::RoundRobin;
    let proxy = agentrace::proxy::start(config, shutdown).await.unwrap();
    let url = register(&proxy);
    let mut proxy_failed = 0;
    for i in 0..sessions {
        let seen = codex_session(&c, &url, &format!("p{i}"), turns, i % 2 == 0, true).await;
        proxy_failed += usize::from(seen.len() < turns);
    }
    stop.fire();
    proxy.join().await;

    let sent = 2 * sessions * turns;
    println!(
        "{}",
        json!({
            "sessions_per_api": sessions, "turns_per_session": turns,
            "pinned_sessions": {"messages": pinned["messages"], "responses": pinned["responses"]},
            "lost_caches_noticed": {"messages": noticed["messages"], "responses": noticed["responses"]},
            "client_turns_sent": sent, "client_turns_exported": report.client_turns,
            "exchanges_recorded": capture.len(),
            "ttft_capture_vs_client_ms": {"streams": gaps.len(), "median_abs_diff": gaps.get(gaps.len() / 2),
                                          "max_abs_diff": gaps.last()},
            "previous_response_id_chains": sessions,
            "chains_failed": {"round_robin_direct": rr_failed, "agentrace_round_robin": proxy_failed},
        })
    );
}
