//! A small server for Anthropic Messages (`POST /v1/messages`) and OpenAI Responses
//! (`POST /v1/responses`), with real SSE framing: each answer opens with the API's preamble
//! (`message_start` and a `ping`; `response.created`) at once, then pauses `first_delay`
//! before the first delta, so a client that stamps the preamble as its first token measures a
//! time to first token near zero. It records every request, keeps each response it created
//! (a later `previous_response_id` must name one it still holds, else it answers 404 with
//! OpenAI's error body), can forget them all (a restart), and can answer an API error.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use parking_lot::Mutex;
use serde_json::{json, Value};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Body = http_body_util::combinators::BoxBody<Bytes, BoxError>;

/// One request as the server saw it.
#[derive(Debug, Clone)]
pub struct Received {
    /// The request path.
    pub path: String,
    /// Headers (name lowercased, value).
    pub headers: Vec<(String, String)>,
    /// The body as JSON.
    pub body: Value,
}

impl Received {
    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Output tokens every answer reports in its usage (not the number of deltas it sends).
pub const OUTPUT_TOKENS: u64 = 17;
/// Prompt tokens every answer reports.
pub const INPUT_TOKENS: u64 = 40;

#[derive(Default)]
struct State {
    received: Vec<Received>,
    /// The ids of the responses created and kept.
    stored: Vec<String>,
    /// Once more requests than this have arrived, every stored response is forgotten.
    forget_after: Option<usize>,
    /// Answer every request with this status and API error body.
    error: Option<(u16, Value)>,
    next_id: u64,
}

/// A running server.
pub struct WireServer {
    /// Where it listens.
    pub addr: SocketAddr,
    state: Arc<Mutex<State>>,
    _trigger: agentrace::shutdown::Trigger,
}

impl WireServer {
    /// `http://addr`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every request so far, in arrival order.
    pub fn received(&self) -> Vec<Received> {
        self.state.lock().received.clone()
    }

    /// Forgets every stored response once `n` requests have been answered, as a replica
    /// that restarted then would: request `n + 1` finds none.
    pub fn forget_responses_after(&self, n: usize) {
        self.state.lock().forget_after = Some(n);
    }

    /// Answers every later request with `status` and `body`.
    pub fn fail_with(&self, status: u16, body: Value) {
        self.state.lock().error = Some((status, body));
    }
}

/// Starts a server on 127.0.0.1:0 that pauses `first_delay` before each answer's first delta.
pub async fn start(first_delay: Duration) -> WireServer {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let state = Arc::new(Mutex::new(State::default()));
    let (trigger, shutdown) = agentrace::shutdown::channel();
    let st = state.clone();
    tokio::spawn(async move {
        let mut stop = shutdown.clone();
        loop {
            let (tcp, _) = tokio::select! {
                r = listener.accept() => match r { Ok(x) => x, Err(_) => continue },
                _ = stop.wait() => break,
            };
            let st = st.clone();
            tokio::spawn(async move {
                let svc =
                    hyper::service::service_fn(move |req| handle(req, st.clone(), first_delay));
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(tcp), svc)
                    .await;
            });
        }
    });
    WireServer {
        addr,
        state,
        _trigger: trigger,
    }
}

fn json_response(status: u16, body: &Value) -> hyper::Response<Body> {
    hyper::Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(BodyExt::boxed(
            http_body_util::Full::new(Bytes::from(body.to_string())).map_err(|n| match n {}),
        ))
        .unwrap()
}

fn event(name: &str, data: Value) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {data}\n\n"))
}

async fn handle(
    req: hyper::Request<hyper::body::Incoming>,
    state: Arc<Mutex<State>>,
    first_delay: Duration,
) -> Result<hyper::Response<Body>, Infallible> {
    let path = req.uri().path().to_string();
    let headers = req
        .headers()
        .iter()
        .map(|(k, v)| (k.as_str().to_string(), v.to_str().unwrap_or("").to_string()))
        .collect();
    let bytes = req.into_body().collect().await.unwrap().to_bytes();
    let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let (error, id) = {
        let mut s = state.lock();
        s.received.push(Received {
            path: path.clone(),
            headers,
            body: body.clone(),
        });
        if s.forget_after.is_some_and(|n| s.received.len() > n) {
            s.stored.clear();
        }
        s.next_id += 1;
        (s.error.clone(), s.next_id)
    };
    if let Some((status, body)) = error {
        return Ok(json_response(status, &body));
    }
    let stream = body.get("stream") == Some(&Value::Bool(true));
    let (preamble, deltas) = match path.as_str() {
        "/v1/messages" if stream => messages_stream(),
        "/v1/responses" if stream => {
            if let Some(prev) = body.get("previous_response_id").and_then(Value::as_str) {
                if !state.lock().stored.iter().any(|s| s == prev) {
                    let err = json!({"error": {
                        "message": format!("Previous response with id '{prev}' not found."),
                        "type": "invalid_request_error", "param": "previous_response_id",
                        "code": "previous_response_not_found"}});
                    return Ok(json_response(404, &err));
                }
            }
            let rid = format!("resp_{id}");
            if body.get("store") != Some(&Value::Bool(false)) {
                state.lock().stored.push(rid.clone());
            }
            responses_stream(&rid, &format!("call_live_{id}"))
        }
        _ => {
            let err = json!({"error": {"message": format!("no route {path} (stream {stream})"),
                "type": "not_found"}});
            return Ok(json_response(404, &err));
        }
    };
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(4);
    tokio::spawn(async move {
        for b in preamble {
            if tx.send(Ok(Frame::data(b))).await.is_err() {
                return;
            }
        }
        tokio::time::sleep(first_delay).await;
        for b in deltas {
            if tx.send(Ok(Frame::data(b))).await.is_err() {
                return;
            }
        }
    });
    let frames =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|f| (f, rx)) });
    Ok(hyper::Response::builder()
        .status(200)
        .header("content-type", "text/event-stream")
        .body(BodyExt::boxed(StreamBody::new(frames)))
        .unwrap())
}

/// `message_start` and a `ping`; then a thinking block, a text block and a `tool_use` block
/// streamed as deltas, `message_delta` with the usage, `message_stop`.
fn messages_stream() -> (Vec<Bytes>, Vec<Bytes>) {
    let delta = |index: u64, delta: Value| {
        event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": index, "delta": delta}),
        )
    };
    let start = |index: u64, block: Value| {
        event(
            "content_block_start",
            json!({"type": "content_block_start", "index": index, "content_block": block}),
        )
    };
    let stop = |index: u64| {
        event(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": index}),
        )
    };
    let preamble = vec![
        event(
            "message_start",
            json!({"type": "message_start", "message": {"id": "msg_1", "type": "message",
            "role": "assistant", "content": [], "model": "m", "stop_reason": null,
            "usage": {"input_tokens": INPUT_TOKENS, "output_tokens": 1}}}),
        ),
        event("ping", json!({"type": "ping"})),
        start(0, json!({"type": "thinking", "thinking": ""})),
    ];
    let deltas = vec![
        delta(
            0,
            json!({"type": "thinking_delta", "thinking": "let me see"}),
        ),
        stop(0),
        start(1, json!({"type": "text", "text": ""})),
        delta(1, json!({"type": "text_delta", "text": "Hello"})),
        delta(1, json!({"type": "text_delta", "text": " world"})),
        stop(1),
        start(
            2,
            json!({"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {}}),
        ),
        delta(
            2,
            json!({"type": "input_json_delta", "partial_json": "{\"command\":"}),
        ),
        delta(
            2,
            json!({"type": "input_json_delta", "partial_json": "\"ls\"}"}),
        ),
        stop(2),
        event(
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": "tool_use"},
            "usage": {"output_tokens": OUTPUT_TOKENS}}),
        ),
        event("message_stop", json!({"type": "message_stop"})),
    ];
    (preamble, deltas)
}

/// `response.created` and `response.in_progress`; then reasoning, text and function-call
/// argument deltas, and `response.completed` with the whole response and its usage.
fn responses_stream(id: &str, call_id: &str) -> (Vec<Bytes>, Vec<Bytes>) {
    let shell = |status: &str| {
        json!({"id": id, "object": "response", "status": status,
        "model": "m", "output": []})
    };
    let preamble = vec![
        event(
            "response.created",
            json!({"type": "response.created", "response": shell("in_progress")}),
        ),
        event(
            "response.in_progress",
            json!({"type": "response.in_progress", "response": shell("in_progress")}),
        ),
    ];
    let call = json!({"type": "function_call", "id": "fc_1", "call_id": call_id,
        "name": "bash", "arguments": "{\"command\":\"ls\"}", "status": "completed"});
    let mut done = shell("completed");
    done["output"] = json!([
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "let me see"}]},
        {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Hello world", "annotations": []}]},
        call
    ]);
    done["usage"] = json!({"input_tokens": INPUT_TOKENS, "output_tokens": OUTPUT_TOKENS,
        "input_tokens_details": {"cached_tokens": 8}, "total_tokens": INPUT_TOKENS + OUTPUT_TOKENS});
    let ev = |name: &str, extra: Value| {
        let mut v = extra;
        v["type"] = json!(name);
        event(name, v)
    };
    let deltas = vec![
        ev(
            "response.reasoning_text.delta",
            json!({"item_id": "rs_1", "output_index": 0, "delta": "let me see"}),
        ),
        ev(
            "response.output_item.added",
            json!({"output_index": 1, "item": {"type": "message", "id": "msg_1"}}),
        ),
        ev(
            "response.output_text.delta",
            json!({"item_id": "msg_1", "output_index": 1, "delta": "Hello"}),
        ),
        ev(
            "response.output_text.delta",
            json!({"item_id": "msg_1", "output_index": 1, "delta": " world"}),
        ),
        ev(
            "response.output_item.added",
            json!({"output_index": 2, "item": {"type": "function_call", "id": "fc_1",
            "call_id": call_id, "name": "bash", "arguments": ""}}),
        ),
        ev(
            "response.function_call_arguments.delta",
            json!({"item_id": "fc_1", "output_index": 2, "delta": "{\"command\":\"ls\"}"}),
        ),
        ev("response.completed", json!({"response": done})),
    ];
    (preamble, deltas)
}
