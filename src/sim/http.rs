//! The HTTP surface of one replica (OpenAI Chat Completions and Completions, Anthropic
//! Messages, OpenAI Responses): parses requests, plans the reply, injects faults, hands the
//! prompt to the engine and streams one SSE event per frame. Every API takes the same engine
//! path; only how the request becomes a prompt and how the reply is written differ.

use std::convert::Infallible;
use std::fmt::Write as _;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::graceful::GracefulShutdown;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::api::{ChatRequest, CompletionRequest, Message, Turn};
use super::config::{MidStreamFault, SimConfig};
use super::engine::{Command, Event, SimClock, Submission, Timings, TraceContext};
use super::generate::{self, ChatShape, Delta, Reply};
use super::metrics::Metrics;
use super::oracle::Oracle;
use super::render::{self, fnv64, Prompt};
use super::response_store::ResponseStore;
use super::{messages, responses};
use crate::http_body::{Body, BoxError};
use crate::random::{splitmix64, Rng};
use crate::shutdown::Shutdown;

/// Largest request body accepted.
const MAX_BODY_BYTES: usize = 256 << 20;
/// How long in-flight responses may take to finish once shutdown is asked for.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// Streams a response task may run ahead of a slow client before it waits.
const STREAM_BUFFER: usize = 64;

/// Shared state of one replica's HTTP side.
pub(crate) struct Replica {
    /// Its name, sent as `x-inference-pod`.
    pub name: String,
    /// The cluster's configuration.
    pub config: Arc<SimConfig>,
    /// Simulated clock shared with the engine.
    pub clock: SimClock,
    /// Its metrics.
    pub metrics: Arc<Metrics>,
    /// The engine's inbox.
    pub engine: mpsc::UnboundedSender<Command>,
    /// Recorded replies, when the oracle responder is on.
    pub oracle: Option<Arc<Oracle>>,
    /// `created` of responses at simulated time 0.
    pub created_base: u64,
    /// Accept order of requests.
    pub next_seq: AtomicU64,
    /// Resolves hung requests at shutdown.
    pub shutdown: Shutdown,
    /// Conversations of the Responses API's `previous_response_id`.
    pub responses: Arc<ResponseStore>,
}

/// Accepts connections until `shutdown`, then drains them for a grace period.
pub(crate) async fn serve(listener: TcpListener, replica: Arc<Replica>, mut shutdown: Shutdown) {
    let graceful = GracefulShutdown::new();
    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(replica = %replica.name, error = %e, "accept failed");
                    continue;
                }
            },
            _ = shutdown.wait() => break,
        };
        let _ = stream.set_nodelay(true);
        let replica = replica.clone();
        let service = hyper::service::service_fn(move |req| {
            let replica = replica.clone();
            async move { Ok::<_, Infallible>(replica.handle(req).await) }
        });
        let conn = builder
            .serve_connection(TokioIo::new(stream), service)
            .into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
        });
    }
    drop(listener);
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(SHUTDOWN_GRACE) => {
            tracing::warn!(replica = %replica.name, "connections still open after the shutdown grace period");
        }
    }
}

/// An error answered before the first token.
struct HttpError {
    status: StatusCode,
    message: String,
    retry_after: bool,
    /// A body other than the API's error shape of `message` (vLLM's own refusals).
    body: Option<Value>,
}

impl HttpError {
    fn new(status: StatusCode, message: impl Into<String>) -> HttpError {
        HttpError {
            status,
            message: message.into(),
            retry_after: false,
            body: None,
        }
    }

    /// The body in the shape the request's API uses for errors.
    fn body(&self, api: Option<Api>) -> Value {
        if let Some(b) = &self.body {
            return b.clone();
        }
        match api {
            Some(Api::Messages) => messages::error_json(self.status.as_u16(), &self.message),
            _ => error_json(self.status, &self.message),
        }
    }
}

fn error_json(status: StatusCode, message: &str) -> Value {
    let kind = match status.as_u16() {
        400 => "invalid_request_error",
        404 => "not_found_error",
        503 => "service_unavailable",
        _ => "internal_server_error",
    };
    json!({"error": {"message": message, "type": kind, "param": null, "code": status.as_u16()}})
}

/// Which API a request came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    Chat,
    Completions,
    Messages,
    Responses,
}

impl Api {
    fn of_route(path: &str) -> Option<Api> {
        match path {
            "/v1/chat/completions" => Some(Api::Chat),
            "/v1/completions" => Some(Api::Completions),
            "/v1/messages" => Some(Api::Messages),
            "/v1/responses" => Some(Api::Responses),
            _ => None,
        }
    }
}

/// A request ready for the engine, with its planned reply.
struct Planned {
    model: String,
    stream: bool,
    include_usage: bool,
    prompt: Prompt,
    reply: Reply,
    rng_seed: u64,
    /// Responses only: the id continued, and the conversation to keep with the reply.
    previous_response_id: Option<String>,
    keep: Option<Vec<Value>>,
}

impl Replica {
    async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Response<Body> {
        let accepted = Instant::now();
        let seq = self.next_seq.fetch_add(1, Relaxed);
        let api = Api::of_route(req.uri().path());
        let mut resp = match (req.method(), req.uri().path(), api) {
            (&Method::POST, _, Some(api)) => self.clone().generate(req, api, accepted, seq).await,
            (&Method::GET, "/v1/models", _) => Ok(self.models()),
            (&Method::GET, "/health", _) => Ok(self.health()),
            (&Method::GET, "/metrics", _) => Ok(text_response(
                "text/plain; version=0.0.4; charset=utf-8",
                self.metrics.render(),
            )),
            (&Method::POST, "/reset_prefix_cache", _) => self.reset().await,
            (_, path, _) => Err(HttpError::new(
                StatusCode::NOT_FOUND,
                format!("no route for {} {path}", req.method()),
            )),
        }
        .unwrap_or_else(|e| {
            let mut r = Response::new(crate::http_body::json(&e.body(api)));
            *r.status_mut() = e.status;
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            if e.retry_after {
                r.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            r
        });
        if let Ok(v) = HeaderValue::from_str(&self.name) {
            resp.headers_mut().insert("x-inference-pod", v);
        }
        resp
    }

    fn models(&self) -> Response<Body> {
        let body = json!({"object": "list", "data": [{
            "id": self.config.model, "object": "model", "created": self.created_base, "owned_by": "agentrace-sim"}]});
        json_response(&body)
    }

    fn health(&self) -> Response<Body> {
        if self.engine.is_closed() {
            let mut r = text_response("text/plain", "engine stopped\n".to_string());
            *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            r
        } else {
            text_response("text/plain", "ok\n".to_string())
        }
    }

    async fn reset(&self) -> Result<Response<Body>, HttpError> {
        let (tx, rx) = oneshot::channel();
        let stopped = || HttpError::new(StatusCode::SERVICE_UNAVAILABLE, "engine stopped");
        self.engine
            .send(Command::ResetPrefixCache(tx))
            .map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())?;
        Ok(json_response(&json!({"status": "ok"})))
    }

    /// Parses and plans a generation request.
    fn plan(&self, api: Api, body: &[u8]) -> Result<Planned, HttpError> {
        let bad = |e: serde_json::Error| {
            HttpError::new(
                StatusCode::BAD_REQUEST,
                format!("invalid request body: {e}"),
            )
        };
        let cfg = &self.config;
        let rng_seed = splitmix64(cfg.seed ^ fnv64(body));
        let mut rng = Rng::new(rng_seed);
        let bs = cfg.engine.block_size;
        let (turn, previous_response_id, keep) = match api {
            Api::Completions => {
                let req: CompletionRequest = serde_json::from_slice(body).map_err(bad)?;
                let mut text = String::new();
                super::api::content_text(&req.prompt, &mut text);
                let prompt = Prompt::from_bytes(text.as_bytes(), bs);
                let reply = generate::synthetic_text(&cfg.responder, &mut rng);
                return Ok(Planned {
                    model: req.model.unwrap_or_else(|| cfg.model.clone()),
                    stream: req.stream.unwrap_or(false),
                    include_usage: req
                        .stream_options
                        .and_then(|o| o.include_usage)
                        .unwrap_or(false),
                    prompt,
                    reply: reply.cap(req.max_tokens, req.ignore_eos.unwrap_or(false), &mut rng),
                    rng_seed,
                    previous_response_id: None,
                    keep: None,
                });
            }
            Api::Chat => {
                let req: ChatRequest = serde_json::from_slice(body).map_err(bad)?;
                (Turn::from(req), None, None)
            }
            Api::Messages => {
                let turn =
                    messages::turn(body).map_err(|m| HttpError::new(StatusCode::BAD_REQUEST, m))?;
                (turn, None, None)
            }
            Api::Responses => {
                let p = responses::turn(body, &self.responses).map_err(|r| HttpError {
                    body: Some(r.body),
                    ..HttpError::new(
                        StatusCode::from_u16(r.status).unwrap_or(StatusCode::BAD_REQUEST),
                        "refused",
                    )
                })?;
                (p.turn, p.previous_response_id, p.keep)
            }
        };
        if turn.messages.is_empty() {
            return Err(HttpError::new(
                StatusCode::BAD_REQUEST,
                "messages: must not be empty",
            ));
        }
        let tools = turn.tools.as_deref();
        let prompt = Prompt::from_bytes(&render::render_chat(&turn.messages, tools), bs);
        let shape = ChatShape {
            tools,
            tool_choice: turn.tool_choice.as_ref(),
            thinking: turn.thinking,
        };
        let reply = self
            .oracle_reply(&turn.messages, &mut rng)
            .unwrap_or_else(|| generate::synthetic_chat(shape, &cfg.responder, &mut rng));
        Ok(Planned {
            model: turn.model.unwrap_or_else(|| cfg.model.clone()),
            stream: turn.stream,
            include_usage: turn.include_usage,
            prompt,
            reply: reply.cap(turn.max_tokens, turn.ignore_eos, &mut rng),
            rng_seed,
            previous_response_id,
            keep,
        })
    }

    fn oracle_reply(&self, messages: &[Message], rng: &mut Rng) -> Option<Reply> {
        let recorded = self.oracle.as_ref()?.lookup(messages)?;
        let (r, c, t) = (
            recorded.reasoning_content.as_deref(),
            recorded.content.as_deref(),
            recorded.tool_calls.as_ref(),
        );
        Some(if rng.f64() < self.config.responder.oracle_accuracy {
            generate::recorded(r, c, t, rng)
        } else {
            generate::wrong(r, c, t, rng)
        })
    }

    async fn generate(
        self: Arc<Self>,
        req: Request<Incoming>,
        api: Api,
        accepted: Instant,
        seq: u64,
    ) -> Result<Response<Body>, HttpError> {
        let session = req
            .headers()
            .get("x-session-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let body = Limited::new(req.into_body(), MAX_BODY_BYTES)
            .collect()
            .await
            .map_err(|e| {
                HttpError::new(
                    StatusCode::BAD_REQUEST,
                    format!("cannot read request body: {e}"),
                )
            })?
            .to_bytes();
        let mut plan = self.plan(api, &body)?;
        let cfg = &self.config;
        let needed_blocks =
            (plan.prompt.tokens + plan.reply.tokens).div_ceil(cfg.engine.block_size);
        if needed_blocks > cfg.engine.num_gpu_blocks {
            return Err(HttpError::new(
                StatusCode::BAD_REQUEST,
                // What to change comes first: replay reports keep the start of this message.
                format!(
                    "request exceeds the KV capacity of {} tokens ({} blocks): start the simulator \
                     with --num-gpu-blocks {} or more; prompt {} + output {} tokens",
                    cfg.kv_capacity_tokens(),
                    cfg.engine.num_gpu_blocks,
                    needed_blocks,
                    plan.prompt.tokens,
                    plan.reply.tokens,
                ),
            ));
        }

        // Faults come from their own seeded stream so turning one on does not change replies.
        let mut fault_rng = Rng::new(splitmix64(plan.rng_seed ^ 0xFA17_FA17_FA17_FA17));
        let f = &cfg.faults;
        let draw = fault_rng.f64();
        if draw < f.fail_rate {
            let status =
                StatusCode::from_u16(f.fail_status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            return Err(HttpError::new(status, "simulated failure"));
        }
        if draw < f.fail_rate + f.hang_rate {
            self.shutdown.clone().wait().await;
            return Err(HttpError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "shutting down",
            ));
        }
        let cut_after = (draw < f.fail_rate + f.hang_rate + f.fail_mid_stream_rate)
            .then(|| fault_rng.int(1, plan.reply.tokens.saturating_sub(1).max(1)));

        let arrival_ns = self.clock.sim_ns(accepted);
        let overhead_ms = cfg.engine.request_overhead_ms + f.extra_delay_ms;
        let ready_ns = arrival_ns.saturating_add((overhead_ms * 1e6).round() as u64);
        crate::timing::sleep_until(self.clock.real_at(ready_ns).max(accepted)).await;

        if f.max_queue > 0 && self.metrics.queued.load(Relaxed) >= f.max_queue as u64 {
            return Err(HttpError {
                retry_after: true,
                ..HttpError::new(StatusCode::SERVICE_UNAVAILABLE, "waiting queue is full")
            });
        }
        let prefix = match api {
            Api::Chat => "chatcmpl-",
            Api::Completions => "cmpl-",
            Api::Messages => "msg_",
            Api::Responses => "resp_",
        };
        let id = format!("{prefix}{:016x}", splitmix64(plan.rng_seed ^ 0x1D));
        let cacheable = plan.prompt.block_hashes.len() * cfg.engine.block_size;
        let prompt_tokens = plan.prompt.tokens;
        let (tx, mut rx) = mpsc::unbounded_channel();
        self.metrics.queued.fetch_add(1, Relaxed);
        let submission = Submission {
            seq,
            arrival_ns,
            ready_ns,
            prompt: std::mem::take(&mut plan.prompt),
            output_tokens: plan.reply.tokens,
            events: tx,
            trace: TraceContext {
                request_id: id.clone(),
                session,
                finish_reason: plan.reply.finish_reason.as_str(),
            },
        };
        if self.engine.send(Command::Submit(submission)).is_err() {
            self.metrics.queued.fetch_sub(1, Relaxed);
            return Err(HttpError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "engine stopped",
            ));
        }
        // Errors before the first token are HTTP errors: wait for it before answering.
        let first = match rx.recv().await {
            Some(Event::Token { count, cached, .. }) => (count, cached),
            Some(Event::Done(_)) | None => {
                return Err(HttpError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "request aborted by the engine",
                ));
            }
        };
        let created = self.created_base + arrival_ns / 1_000_000_000;
        let mut writer = match api {
            Api::Chat | Api::Completions => Writer::OpenAi(ChunkWriter::new(
                &id,
                created,
                &plan.model,
                api,
                plan.include_usage,
            )),
            Api::Messages => Writer::Messages(messages::Writer::new(
                &id,
                &plan.model,
                prompt_tokens,
                cacheable,
            )),
            Api::Responses => Writer::Responses(responses::Writer::new(
                &id,
                created,
                &plan.model,
                plan.previous_response_id.take(),
                plan.keep.take().map(|c| (self.responses.clone(), c)),
            )),
        };
        if plan.stream {
            let (body_tx, body_rx) = mpsc::channel(STREAM_BUFFER);
            let mode = cfg.faults.mid_stream;
            let mut reply = Box::pin(stream_reply(
                writer, plan.reply, first, rx, body_tx, cut_after, mode,
            ));
            // Queue the tokens already generated before answering, so the head and the first
            // token leave together instead of one task hand-off later.
            if futures_util::FutureExt::now_or_never(reply.as_mut()).is_none() {
                tokio::spawn(reply);
            }
            let mut resp = Response::new(ChannelBody { rx: body_rx }.boxed());
            let h = resp.headers_mut();
            h.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/event-stream"),
            );
            h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
            Ok(resp)
        } else {
            let mut count = first.0;
            loop {
                if cut_after.is_some_and(|k| count >= k) {
                    return Err(HttpError::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "simulated failure mid-generation",
                    ));
                }
                match rx.recv().await {
                    Some(Event::Token { count: c, .. }) => count = c,
                    Some(Event::Done(t)) => {
                        return Ok(json_response(&writer.full(&plan.reply, &t)))
                    }
                    None => {
                        return Err(HttpError::new(
                            StatusCode::INTERNAL_SERVER_ERROR,
                            "request aborted by the engine",
                        ));
                    }
                }
            }
        }
    }
}

/// Releases reply pieces as the engine generates tokens, one SSE event per frame.
async fn stream_reply(
    mut writer: Writer,
    reply: Reply,
    (first, cached): (usize, usize),
    mut events: mpsc::UnboundedReceiver<Event>,
    body: mpsc::Sender<Result<Bytes, BoxError>>,
    cut_after: Option<usize>,
    mode: MidStreamFault,
) {
    let send = |frame: String| body.send(Ok(Bytes::from(frame)));
    for frame in writer.start(cached) {
        if send(frame).await.is_err() {
            return;
        }
    }
    let mut released = 0usize;
    let mut next_piece = 0usize;
    let mut count = first;
    loop {
        while next_piece < reply.pieces.len()
            && released + reply.pieces[next_piece].tokens as usize <= count
        {
            released += reply.pieces[next_piece].tokens as usize;
            for frame in writer.piece(&reply.pieces[next_piece].delta) {
                if send(frame).await.is_err() {
                    return;
                }
            }
            next_piece += 1;
        }
        let frames = if cut_after.is_some_and(|k| count >= k) {
            if mode == MidStreamFault::Abort {
                let _ = body
                    .send(Err("simulated connection cut mid-stream".into()))
                    .await;
                return;
            }
            writer.error("simulated failure mid-stream")
        } else {
            match events.recv().await {
                Some(Event::Token { count: c, .. }) => {
                    count = c;
                    continue;
                }
                Some(Event::Done(t)) => writer.finish(&reply, &t),
                None => writer.error("request aborted by the engine"),
            }
        };
        for frame in frames {
            if send(frame).await.is_err() {
                return;
            }
        }
        return;
    }
}

/// The writer of one reply in its API's wire format.
enum Writer {
    OpenAi(ChunkWriter),
    Messages(messages::Writer),
    Responses(responses::Writer),
}

impl Writer {
    /// What a stream opens with, sent with the first token.
    fn start(&mut self, cached: usize) -> Vec<String> {
        match self {
            Writer::OpenAi(w) if w.api == Api::Chat => vec![w.role_chunk()],
            Writer::OpenAi(_) => Vec::new(),
            Writer::Messages(w) => w.start(cached),
            Writer::Responses(w) => w.start(),
        }
    }

    /// The events of one reply piece.
    fn piece(&mut self, delta: &Delta) -> Vec<String> {
        match self {
            Writer::OpenAi(w) => vec![w.piece_chunk(delta)],
            Writer::Messages(w) => w.piece(delta),
            Writer::Responses(w) => w.piece(delta),
        }
    }

    /// What a complete stream ends with.
    fn finish(&mut self, reply: &Reply, t: &Timings) -> Vec<String> {
        match self {
            Writer::OpenAi(w) => {
                let mut out = vec![w.finish_chunk(reply.finish_reason.as_str())];
                if w.include_usage {
                    out.push(w.usage_chunk(t));
                }
                out.push("data: [DONE]\n\n".to_string());
                out
            }
            Writer::Messages(w) => w.finish(reply, t),
            Writer::Responses(w) => w.finish(reply, t),
        }
    }

    /// What a stream that fails after its first token ends with.
    fn error(&mut self, message: &str) -> Vec<String> {
        match self {
            Writer::OpenAi(_) => {
                let err = error_json(StatusCode::INTERNAL_SERVER_ERROR, message);
                vec![format!("data: {err}\n\n"), "data: [DONE]\n\n".to_string()]
            }
            Writer::Messages(w) => vec![w.error(500, message)],
            Writer::Responses(w) => vec![w.error(message)],
        }
    }

    /// The unstreamed body.
    fn full(&mut self, reply: &Reply, t: &Timings) -> Value {
        match self {
            Writer::OpenAi(w) => w.full_response(reply, t),
            Writer::Messages(w) => w.full(reply, t),
            Writer::Responses(w) => w.full(reply, t),
        }
    }
}

/// Builds the SSE events and the non-streaming body of one response.
struct ChunkWriter {
    api: Api,
    include_usage: bool,
    /// `data: {"id":…,"object":…,"created":…,"model":…,"choices":[{"index":0,`
    head: String,
    /// `,"logprobs":null,"finish_reason":null}]` plus `"usage":null` when usage is on.
    tail: String,
    id: String,
    created: u64,
    model: String,
}

impl ChunkWriter {
    fn new(id: &str, created: u64, model: &str, api: Api, include_usage: bool) -> ChunkWriter {
        let object = match api {
            Api::Chat => "chat.completion.chunk",
            _ => "text_completion",
        };
        let model_json = Value::String(model.to_string());
        let head = format!(
            "data: {{\"id\":\"{id}\",\"object\":\"{object}\",\"created\":{created},\"model\":{model_json},\"choices\":[{{\"index\":0,"
        );
        let usage = if include_usage { ",\"usage\":null" } else { "" };
        let tail = format!(",\"logprobs\":null,\"finish_reason\":null}}]{usage}}}\n\n");
        ChunkWriter {
            api,
            include_usage,
            head,
            tail,
            id: id.to_string(),
            created,
            model: model.to_string(),
        }
    }

    fn role_chunk(&self) -> String {
        format!(
            "{}\"delta\":{{\"role\":\"assistant\",\"content\":\"\"}}{}",
            self.head, self.tail
        )
    }

    fn piece_chunk(&self, delta: &Delta) -> String {
        let mut s = String::with_capacity(self.head.len() + self.tail.len() + 64);
        s.push_str(&self.head);
        let q = |t: &str| Value::String(t.to_string()).to_string();
        match (self.api, delta) {
            (Api::Chat, Delta::Content(t)) => {
                let _ = write!(s, "\"delta\":{{\"content\":{}}}", q(t));
            }
            (Api::Chat, Delta::Reasoning(t)) => {
                let _ = write!(s, "\"delta\":{{\"reasoning_content\":{}}}", q(t));
            }
            (Api::Chat, Delta::ToolCallStart { index, id, name }) => {
                let _ = write!(
                    s,
                    "\"delta\":{{\"tool_calls\":[{{\"index\":{index},\"id\":{},\"type\":\"function\",\"function\":{{\"name\":{},\"arguments\":\"\"}}}}]}}",
                    q(id),
                    q(name)
                );
            }
            (Api::Chat, Delta::ToolArgs { index, fragment }) => {
                let _ = write!(
                    s,
                    "\"delta\":{{\"tool_calls\":[{{\"index\":{index},\"function\":{{\"arguments\":{}}}}}]}}",
                    q(fragment)
                );
            }
            (_, Delta::Content(t) | Delta::Reasoning(t)) => {
                let _ = write!(s, "\"text\":{}", q(t));
            }
            (_, _) => s.push_str("\"text\":\"\""),
        }
        s.push_str(&self.tail);
        s
    }

    fn finish_chunk(&self, reason: &str) -> String {
        let tail = self.tail.replace(
            "\"finish_reason\":null",
            &format!("\"finish_reason\":\"{reason}\""),
        );
        match self.api {
            Api::Chat => format!("{}\"delta\":{{}}{tail}", self.head),
            _ => format!("{}\"text\":\"\"{tail}", self.head),
        }
    }

    fn usage(t: &Timings) -> Value {
        json!({
            "prompt_tokens": t.prompt_tokens,
            "completion_tokens": t.completion_tokens,
            "total_tokens": t.prompt_tokens + t.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": t.cached_tokens},
        })
    }

    fn object(&self, suffix: &str) -> &'static str {
        match (self.api, suffix) {
            (Api::Chat, "chunk") => "chat.completion.chunk",
            (Api::Chat, _) => "chat.completion",
            (_, _) => "text_completion",
        }
    }

    fn usage_chunk(&self, t: &Timings) -> String {
        let v = json!({"id": self.id, "object": self.object("chunk"), "created": self.created, "model": self.model,
            "choices": [], "usage": Self::usage(t)});
        format!("data: {v}\n\n")
    }

    fn full_response(&self, reply: &Reply, t: &Timings) -> Value {
        let choice = match self.api {
            Api::Chat => {
                let calls = reply.tool_calls();
                let content = reply.content();
                let mut message = serde_json::Map::new();
                message.insert("role".into(), "assistant".into());
                message.insert(
                    "content".into(),
                    if content.is_empty() && !calls.is_empty() {
                        Value::Null
                    } else {
                        content.into()
                    },
                );
                let reasoning = reply.reasoning();
                if !reasoning.is_empty() {
                    message.insert("reasoning_content".into(), reasoning.into());
                }
                if !calls.is_empty() {
                    message.insert("tool_calls".into(), calls.into());
                }
                json!({"index": 0, "message": message, "logprobs": null, "finish_reason": reply.finish_reason.as_str()})
            }
            _ => {
                json!({"index": 0, "text": reply.content(), "logprobs": null, "finish_reason": reply.finish_reason.as_str()})
            }
        };
        json!({"id": self.id, "object": self.object("full"), "created": self.created, "model": self.model,
            "choices": [choice], "usage": Self::usage(t)})
    }
}

/// A response body fed by a task: each message is exactly one frame.
struct ChannelBody {
    rx: mpsc::Receiver<Result<Bytes, BoxError>>,
}

impl http_body::Body for ChannelBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.rx
            .poll_recv(cx)
            .map(|item| item.map(|r| r.map(Frame::data)))
    }
}

fn json_response(value: &Value) -> Response<Body> {
    let mut r = Response::new(crate::http_body::json(value));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

fn text_response(content_type: &'static str, text: String) -> Response<Body> {
    let mut r = Response::new(crate::http_body::full(text));
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}
