//! Fixtures for the replay tests: a small hyper chat-completions server whose every answer is
//! planned by the test, which records what arrived (headers, body, time, per-session order,
//! concurrency) and notices when a client hangs up; and in-memory datasets.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use agentrace::dataset::{ClientTurn, Conversation, Dataset, ExpectedReply, HistoryMessage, Role};
use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use parking_lot::Mutex;
use tokio::time::Instant;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Body = http_body_util::combinators::BoxBody<Bytes, BoxError>;

/// One request as the server saw it.
#[derive(Debug, Clone)]
pub struct Seen {
    /// Arrival order across the server.
    pub seq: usize,
    /// When the full request had arrived.
    pub at: Instant,
    /// When the last response byte was handed to hyper (None while streaming / cancelled).
    pub done_at: Option<Instant>,
    /// Headers in arrival order (name lowercased, value).
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: Bytes,
    /// `X-Session-ID` (empty when absent).
    pub session: String,
    /// 1-based index of this request within its session.
    pub nth_in_session: usize,
    /// Requests in flight at the server when this one arrived (itself included).
    pub in_flight: usize,
    /// Requests of the same session in flight when it arrived (itself included).
    pub session_in_flight: usize,
}

/// How to answer one request.
#[derive(Debug, Clone)]
pub struct Plan {
    /// HTTP status; a non-200 answers with a small JSON error body.
    pub status: u16,
    /// Content deltas, one SSE event each.
    pub content: Vec<String>,
    /// Reasoning deltas, sent before the content.
    pub reasoning: Vec<String>,
    /// A bash tool call streamed after the content, with this command.
    pub bash: Option<String>,
    /// Pause before the first event and between events.
    pub gap: Duration,
    /// Send headers, then SSE comments forever (until the client disconnects).
    pub hang: bool,
    /// Send a usage chunk.
    pub usage: bool,
}

impl Default for Plan {
    fn default() -> Self {
        Self {
            status: 200,
            content: vec!["Hello".into(), " world".into()],
            reasoning: Vec::new(),
            bash: None,
            gap: Duration::ZERO,
            hang: false,
            usage: true,
        }
    }
}

type Planner = Arc<dyn Fn(&Seen) -> Plan + Send + Sync>;

#[derive(Default)]
struct State {
    seen: Vec<Seen>,
    in_flight: usize,
    sessions: std::collections::HashMap<String, (usize, usize)>,
}

/// A running test server.
pub struct TestServer {
    /// Where it listens.
    pub addr: SocketAddr,
    state: Arc<Mutex<State>>,
    /// Responses whose client hung up before the end.
    pub cancelled: Arc<AtomicUsize>,
    _trigger: agentrace::shutdown::Trigger,
}

impl TestServer {
    /// `http://addr`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every request so far, in arrival order.
    pub fn seen(&self) -> Vec<Seen> {
        self.state.lock().seen.clone()
    }
}

/// Starts a server on 127.0.0.1:0 answering each request with `planner(&seen)`.
pub async fn start(planner: impl Fn(&Seen) -> Plan + Send + Sync + 'static) -> TestServer {
    let planner: Planner = Arc::new(planner);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let state = Arc::new(Mutex::new(State::default()));
    let cancelled = Arc::new(AtomicUsize::new(0));
    let (trigger, shutdown) = agentrace::shutdown::channel();
    let (st, cn) = (state.clone(), cancelled.clone());
    tokio::spawn(async move {
        let mut stop = shutdown.clone();
        loop {
            let (tcp, _) = tokio::select! {
                r = listener.accept() => match r { Ok(x) => x, Err(_) => continue },
                _ = stop.wait() => break,
            };
            let (st, cn, planner) = (st.clone(), cn.clone(), planner.clone());
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req| {
                    handle(req, st.clone(), cn.clone(), planner.clone())
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(tcp), svc)
                    .await;
            });
        }
    });
    TestServer {
        addr,
        state,
        cancelled,
        _trigger: trigger,
    }
}

fn chunk(delta: serde_json::Value, finish: Option<&str>) -> Bytes {
    let v = serde_json::json!({"id":"chatcmpl-t","object":"chat.completion.chunk","created":0,"model":"m",
        "choices":[{"index":0,"delta":delta,"logprobs":null,"finish_reason":finish}]});
    Bytes::from(format!("data: {v}\n\n"))
}

async fn handle(
    req: hyper::Request<hyper::body::Incoming>,
    state: Arc<Mutex<State>>,
    cancelled: Arc<AtomicUsize>,
    planner: Planner,
) -> Result<hyper::Response<Body>, Infallible> {
    let headers: Vec<(String, String)> = req
        .headers()
        .iter()
        .map(|(k, v)| (k.as_str().to_string(), v.to_str().unwrap_or("").to_string()))
        .collect();
    let session = req
        .headers()
        .get("x-session-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let seen = {
        let mut s = state.lock();
        s.in_flight += 1;
        let in_flight = s.in_flight;
        let e = s.sessions.entry(session.clone()).or_default();
        e.0 += 1;
        e.1 += 1;
        let (nth, sess_in_flight) = (e.0, e.1);
        let seen = Seen {
            seq: s.seen.len(),
            at: Instant::now(),
            done_at: None,
            headers,
            body,
            session: session.clone(),
            nth_in_session: nth,
            in_flight,
            session_in_flight: sess_in_flight,
        };
        s.seen.push(seen.clone());
        seen
    };
    let plan = planner(&seen);
    let finish = {
        let state = state.clone();
        let session = session.clone();
        move |completed: bool| {
            let mut s = state.lock();
            s.in_flight -= 1;
            if let Some(e) = s.sessions.get_mut(&session) {
                e.1 -= 1;
            }
            if completed {
                s.seen[seen.seq].done_at = Some(Instant::now());
            }
        }
    };
    if plan.status != 200 {
        finish(true);
        let resp = hyper::Response::builder()
            .status(plan.status)
            .header("content-type", "application/json")
            .body(BodyExt::boxed(
                http_body_util::Full::new(Bytes::from_static(br#"{"error": "injected failure"}"#))
                    .map_err(|never| match never {}),
            ))
            .unwrap();
        return Ok(resp);
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(4);
    tokio::spawn(async move {
        let send = |b: Bytes| {
            let tx = tx.clone();
            async move { tx.send(Ok(Frame::data(b))).await.is_ok() }
        };
        if plan.hang {
            loop {
                tokio::time::sleep(Duration::from_millis(5)).await;
                if !send(Bytes::from_static(b": ping\n\n")).await {
                    cancelled.fetch_add(1, Ordering::SeqCst);
                    finish(false);
                    return;
                }
            }
        }
        let mut events = vec![chunk(
            serde_json::json!({"role":"assistant","content":""}),
            None,
        )];
        events.extend(
            plan.reasoning
                .iter()
                .map(|r| chunk(serde_json::json!({"reasoning_content": r}), None)),
        );
        events.extend(
            plan.content
                .iter()
                .map(|c| chunk(serde_json::json!({"content": c}), None)),
        );
        let mut finish_reason = "stop";
        if let Some(cmd) = &plan.bash {
            finish_reason = "tool_calls";
            events.push(chunk(serde_json::json!({"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"bash","arguments":""}}]}), None));
            let args = serde_json::json!({"command": cmd}).to_string();
            events.push(chunk(
                serde_json::json!({"tool_calls":[{"index":0,"function":{"arguments":args}}]}),
                None,
            ));
        }
        events.push(chunk(serde_json::json!({}), Some(finish_reason)));
        if plan.usage {
            let n = plan.content.len() + plan.reasoning.len() + plan.bash.is_some() as usize * 4;
            let v = serde_json::json!({"id":"chatcmpl-t","object":"chat.completion.chunk","created":0,"model":"m","choices":[],
                "usage":{"prompt_tokens":10,"completion_tokens":n,"total_tokens":10+n,"prompt_tokens_details":{"cached_tokens":0}}});
            events.push(Bytes::from(format!("data: {v}\n\n")));
        }
        events.push(Bytes::from_static(b"data: [DONE]\n\n"));
        for (i, e) in events.into_iter().enumerate() {
            if !plan.gap.is_zero() && i > 0 {
                tokio::time::sleep(plan.gap).await;
            }
            if !send(e).await {
                cancelled.fetch_add(1, Ordering::SeqCst);
                finish(false);
                return;
            }
        }
        finish(true);
    });
    let stream = tokio_stream_from(rx);
    let resp = hyper::Response::builder()
        .status(200)
        .header("content-type", "text/event-stream")
        .body(BodyExt::boxed(StreamBody::new(stream)))
        .unwrap();
    Ok(resp)
}

fn tokio_stream_from(
    mut rx: tokio::sync::mpsc::Receiver<Result<Frame<Bytes>, BoxError>>,
) -> impl futures_util::Stream<Item = Result<Frame<Bytes>, BoxError>> {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

fn raw(v: serde_json::Value) -> Box<serde_json::value::RawValue> {
    serde_json::value::RawValue::from_string(v.to_string()).unwrap()
}

/// A conversation `id` with a system prompt and `turns` client turns (user, then tool rows),
/// each followed by a recorded assistant bash call `cmd`, with `delays[i]` before turn i.
pub fn conversation(id: &str, turns: usize, delays: &[f64], cmd: &str) -> Conversation {
    let mut messages = vec![HistoryMessage {
        role: Role::System,
        wire: raw(serde_json::json!({"role":"system","content":"You are a test."})),
    }];
    let mut client_turns = Vec::new();
    let mut row = 1u32;
    for i in 0..turns {
        let msg = if i == 0 {
            HistoryMessage {
                role: Role::User,
                wire: raw(serde_json::json!({"role":"user","content":format!("task {id}")})),
            }
        } else {
            HistoryMessage {
                role: Role::Tool,
                wire: raw(
                    serde_json::json!({"role":"tool","content":format!("out {i}"),"tool_call_id":format!("c{i}")}),
                ),
            }
        };
        messages.push(msg);
        let tool_calls = serde_json::json!([{"id":format!("c{}", i + 1),"type":"function","function":{"name":"bash","arguments":serde_json::json!({"command":cmd}).to_string()}}]);
        client_turns.push(ClientTurn {
            turn: row,
            history_len: messages.len(),
            delay_seconds: delays.get(i).copied().unwrap_or(0.0),
            overrides: serde_json::Map::from_iter([("tools".to_string(), serde_json::json!([{"type":"function","function":{"name":"bash","parameters":{"type":"object","properties":{"command":{"type":"string"}},"required":["command"]}}}]))]),
            expected: Some(ExpectedReply {
                turn: row + 1,
                // The assistant message pushed just below.
                message: messages.len(),
                tool_calls: Some(serde_json::value::to_raw_value(&tool_calls).unwrap()),
                intent_codes: None,
            }),
        });
        messages.push(HistoryMessage {
            role: Role::Assistant,
            wire: raw(serde_json::json!({"role":"assistant","tool_calls":tool_calls,"reasoning_content":"thinking"})),
        });
        row += 2;
    }
    Conversation {
        id: id.to_string(),
        messages,
        client_turns,
    }
}

/// A dataset of conversations built in memory.
pub fn dataset(convs: Vec<Conversation>) -> Arc<Dataset> {
    Arc::new(Dataset {
        path: "in-memory.jsonl".into(),
        sha256: "0".repeat(64),
        conversations: convs.into_iter().map(Arc::new).collect(),
    })
}

/// A replay config for tests: no progress line, no salt, no delays.
pub fn config(target: &str, concurrency: usize) -> agentrace::replay::ReplayConfig {
    agentrace::replay::ReplayConfig {
        target: target.into(),
        concurrency,
        enable_salt: false,
        inject_tool_delay: false,
        progress: false,
        ..Default::default()
    }
}

/// A shutdown listener that never fires (its trigger is leaked for the test's lifetime).
pub fn no_shutdown() -> agentrace::shutdown::Shutdown {
    let (trigger, shutdown) = agentrace::shutdown::channel();
    std::mem::forget(trigger);
    shutdown
}

/// Parses `events.jsonl`.
pub fn events(dir: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("events.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}
