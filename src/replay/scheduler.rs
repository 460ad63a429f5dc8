//! Slots, budget and repeats, end-to-start delays against absolute deadlines, timeouts and
//! aborts, and the performance window (STOP_PERFORMANCE_TRACKING), as the reference strategy.
//!
//! Each slot is one task that owns one connection: it takes the next trajectory instance from
//! a shared counter (round-robin over the dataset, `<id>__repeat_N`), runs its turns in order,
//! and when the counter is exhausted at the end of a trajectory it stops tracking.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rand::SeedableRng;
use tokio::time::Instant;

use super::client::{ClientError, Connector, Response, TargetConnection};
use super::config::{LogPrompts, ReplayConfig};
use super::decode::{self, DecodeError};
use super::events::{self, EventSink, Prompt, Record, Uuid};
use crate::dataset::{Conversation, Dataset, RequestBuilder, Salt};
use crate::shutdown::Shutdown;

/// How a turn ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TurnKind {
    /// A complete 200 response.
    Ok,
    /// A non-200 status.
    HttpStatus,
    /// Connect, read or write failed, or the connection closed early.
    Transport,
    /// The server sent an error event, a body that is not what was asked for, or one past
    /// `max_response_bytes`.
    BadResponse,
    /// `turn_timeout_s` expired; the request was cancelled.
    Timeout,
    /// Never sent: an earlier turn of the trajectory failed.
    Aborted,
    /// Cancelled by shutdown or the duration cap.
    Interrupted,
}

impl TurnKind {
    /// The name used in reports (as serialised).
    pub fn as_str(self) -> &'static str {
        match self {
            TurnKind::Ok => "ok",
            TurnKind::HttpStatus => "http_status",
            TurnKind::Transport => "transport",
            TurnKind::BadResponse => "bad_response",
            TurnKind::Timeout => "timeout",
            TurnKind::Aborted => "aborted",
            TurnKind::Interrupted => "interrupted",
        }
    }
}

/// Finish reasons counted as the reference does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Finish {
    /// `stop`.
    Stop,
    /// `length`.
    Length,
    /// `tool_calls`.
    ToolCalls,
    /// `content_filter`.
    ContentFilter,
    /// `function_call`.
    FunctionCall,
    /// Anything else or none.
    Other,
}

impl Finish {
    fn parse(s: Option<&str>) -> Finish {
        match s {
            Some("stop") => Finish::Stop,
            Some("length") => Finish::Length,
            Some("tool_calls") => Finish::ToolCalls,
            Some("content_filter") => Finish::ContentFilter,
            Some("function_call") => Finish::FunctionCall,
            _ => Finish::Other,
        }
    }
}

/// Everything measured about one turn (times in ns since the run's epoch).
#[derive(Debug, Clone)]
pub(crate) struct TurnRecord {
    /// Slot (user) index.
    pub slot: u32,
    /// The trajectory instance it belongs to (k-th started in the phase): groups an agent's
    /// turns for per-agent figures.
    pub instance: u64,
    /// Index of the endpoint it went to (`ReplayConfig::target`).
    pub target: u32,
    /// How it ended.
    pub kind: TurnKind,
    /// Issued while tracking was on.
    pub tracked: bool,
    /// When it was due (previous last byte + delay).
    pub intended_ns: u64,
    /// When the request bytes were handed to the socket (ISSUED).
    pub issued_ns: u64,
    /// First response byte.
    pub first_byte_ns: Option<u64>,
    /// First content, reasoning or tool-call delta (RECV_FIRST).
    pub first_token_ns: Option<u64>,
    /// Last byte (COMPLETE), or the failure time.
    pub complete_ns: u64,
    /// Output tokens (server usage, or estimated).
    pub output_tokens: u64,
    /// Prompt tokens (server usage, or estimated).
    pub prompt_tokens: u64,
    /// Prompt tokens served from the server's prefix cache, when reported.
    pub cached_tokens: Option<u64>,
    /// The token counts are estimates (no usage in the response).
    pub estimated: bool,
    /// Events that carried a delta.
    pub chunks: u32,
    /// Mean gap between delta events after the first (ns), if there were two or more.
    pub itl_ns: Option<u64>,
    /// Finish reason.
    pub finish: Finish,
    /// Streaming request.
    pub streaming: bool,
}

/// One trajectory instance as a user experienced it.
#[derive(Debug, Clone)]
pub(crate) struct TrajectoryRecord {
    /// Slot that ran it.
    pub slot: u32,
    /// Its instance number (k-th started in the phase).
    pub instance: u64,
    /// Index of the endpoint all its turns went to.
    pub target: u32,
    /// First ISSUED.
    pub start_ns: u64,
    /// Last COMPLETE.
    pub end_ns: u64,
    /// Every turn succeeded.
    pub completed: bool,
    /// Turns issued on the wire.
    pub turns_sent: u32,
    /// Turns not issued because issuing stopped (not failures).
    pub turns_unissued: u32,
}

/// Live counters for the progress line.
#[derive(Debug, Default)]
pub(crate) struct Progress {
    /// Trajectories finished.
    pub trajectories: AtomicU64,
    /// Turns completed successfully.
    pub turns_ok: AtomicU64,
    /// Turns failed or aborted.
    pub errors: AtomicU64,
    /// Requests in flight.
    pub in_flight: AtomicU64,
    /// Output tokens so far.
    pub output_tokens: AtomicU64,
}

pub(crate) const NOT_STARTED: u8 = 0;
const TRACKING: u8 = 1;
const STOPPED: u8 = 2;

/// State shared by the slots of one phase.
pub(crate) struct Phase {
    pub dataset: Arc<Dataset>,
    pub builder: RequestBuilder,
    /// One per endpoint, in `config.target`'s order.
    pub connectors: Vec<Connector>,
    pub events: EventSink,
    pub epoch: Instant,
    pub budget: u64,
    pub next_instance: AtomicU64,
    /// Repeat numbering: performance instances use `k / n + 1`; warmup uses 0 (its own salt).
    pub warmup: bool,
    pub tracking: AtomicU8,
    pub stop_ns: AtomicU64,
    pub stop_issuing: AtomicBool,
    pub stop_notify: tokio::sync::Notify,
    pub shutdown: Shutdown,
    pub progress: Arc<Progress>,
    pub config: ReplayConfig,
    pub routing: Vec<String>,
    pub issued_after_stop: AtomicU64,
    pub hard_deadline: Option<Instant>,
}

/// What one slot measured.
#[derive(Debug, Default)]
pub(crate) struct SlotResult {
    pub turns: Vec<TurnRecord>,
    pub trajectories: Vec<TrajectoryRecord>,
    /// Send − deadline per sent turn, and whether the turn waited out a recorded delay.
    pub lags_ns: Vec<(i64, bool)>,
    /// Why turns failed (aborted and interrupted ones left out: their cause is counted once).
    pub failure_reasons: super::metrics::FailureReasons,
}

impl Phase {
    pub(crate) fn ns(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.epoch).as_nanos() as u64
    }

    pub(crate) fn start_tracking(&self) -> u64 {
        self.tracking.store(TRACKING, Ordering::SeqCst);
        self.ns(Instant::now())
    }

    /// Idempotent; true the first time.
    pub(crate) async fn stop_tracking(&self) -> bool {
        if self
            .tracking
            .compare_exchange(TRACKING, STOPPED, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            let ts = self.ns(Instant::now());
            self.stop_ns.store(ts, Ordering::SeqCst);
            self.events
                .send(Record::Session {
                    name: "stop_performance_tracking",
                    ts,
                })
                .await;
            true
        } else {
            false
        }
    }

    fn request_stop_issuing(&self) {
        self.stop_issuing.store(true, Ordering::SeqCst);
        self.stop_notify.notify_waiters();
    }

    fn halted(&self) -> bool {
        self.stop_issuing.load(Ordering::SeqCst) || self.shutdown.is_fired()
    }
}

/// Runs one slot until the budget is exhausted or issuing stops. Every slot of the phase
/// connects first (to every endpoint: which one its first trajectory uses is known only once
/// it takes one) and waits at `start`, so the first wave goes out together and no slot's first
/// request trails the replies to the others (the reference issues its whole first wave before
/// it reads a response).
pub(crate) async fn run_slot(
    phase: Arc<Phase>,
    slot: u32,
    start: Arc<tokio::sync::Barrier>,
) -> SlotResult {
    let mut out = SlotResult::default();
    let mut conns: Vec<Option<TargetConnection>> = Vec::with_capacity(phase.connectors.len());
    for connector in &phase.connectors {
        conns.push(connector.connect().await.ok());
    }
    start.wait().await;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(
        (phase.ns(Instant::now())) ^ ((slot as u64) << 32) ^ 0x9E37_79B9_7F4A_7C15,
    );
    let mut k = phase.next_instance.fetch_add(1, Ordering::SeqCst);
    loop {
        if k >= phase.budget || phase.halted() {
            break;
        }
        let target = super::config::Targets::of_instance(k, phase.connectors.len());
        run_trajectory(
            &phase,
            slot,
            k,
            target,
            &mut conns[target],
            &mut rng,
            &mut out,
        )
        .await;
        phase.progress.trajectories.fetch_add(1, Ordering::Relaxed);
        // Refill the slot; when nothing is left, the window ends (reference §12).
        k = phase.next_instance.fetch_add(1, Ordering::SeqCst);
        if k >= phase.budget {
            if !phase.warmup
                && phase.stop_tracking().await
                && phase.config.stop_issuing_on_first_user_complete
            {
                phase.request_stop_issuing();
            }
            break;
        }
    }
    out
}

enum Outcome {
    Ok {
        resp: Box<Response>,
        decoded: decode::Decoded,
    },
    Failed {
        kind: TurnKind,
        error_type: String,
        message: String,
        at: Instant,
        first_byte: Option<Instant>,
    },
}

#[allow(clippy::too_many_arguments)]
async fn run_trajectory(
    phase: &Phase,
    slot: u32,
    k: u64,
    target: usize,
    conn: &mut Option<TargetConnection>,
    rng: &mut rand_chacha::ChaCha8Rng,
    out: &mut SlotResult,
) {
    let connector = &phase.connectors[target];
    let n = phase.dataset.conversations.len() as u64;
    let conv: &Arc<Conversation> = &phase.dataset.conversations[(k % n) as usize];
    let repeat = k / n + 1;
    let logical: Arc<str> = if phase.warmup {
        format!("{}__warmup_{}", conv.id, k + 1).into()
    } else if repeat == 1 {
        conv.id.as_str().into()
    } else {
        format!("{}__repeat_{repeat}", conv.id).into()
    };
    let source: Arc<str> = conv.id.as_str().into();
    let salt = phase
        .config
        .enable_salt
        .then(|| Salt::new(if phase.warmup { 0 } else { repeat }, &conv.id));
    let routing: Vec<(&str, &str)> = phase
        .routing
        .iter()
        .map(|h| (h.as_str(), &*logical))
        .collect();
    let turn_timeout = Duration::from_secs_f64(phase.config.turn_timeout_s);
    let scale = if phase.config.inject_tool_delay {
        phase.config.time_scale
    } else {
        0.0
    };

    let mut traj = TrajectoryRecord {
        slot,
        instance: k,
        target: target as u32,
        start_ns: 0,
        end_ns: 0,
        completed: true,
        turns_sent: 0,
        turns_unissued: 0,
    };
    // The trajectory starts once its slot holds a live connection, so connecting is never
    // counted as schedule lag of the first turn.
    if conn
        .as_mut()
        .is_none_or(|c| c.is_stale(Duration::from_secs(4)))
    {
        *conn = connector.connect().await.ok();
    }
    let mut anchor = Instant::now();
    let turns = &conv.client_turns;
    let mut chain = Chained::new(phase.config.responses_chain);
    for (i, turn) in turns.iter().enumerate() {
        let deadline = anchor + Duration::from_secs_f64((turn.delay_seconds * scale).max(0.0));
        let streaming = phase.builder.is_streaming(turn);
        let body = Bytes::from(phase.builder.body_continuing(
            conv,
            turn,
            salt.as_ref(),
            chain.link(),
        ));
        let request = connector.request_bytes(streaming, &routing, &body);

        // Connect ahead of the deadline so connecting never shows up as latency.
        let stale = conn
            .as_mut()
            .is_none_or(|c| c.is_stale(Duration::from_secs(4)));
        let mut connect_error = None;
        if stale {
            *conn = None;
            match connector.connect().await {
                Ok(c) => *conn = Some(c),
                Err(e) => connect_error = Some(e.to_string()),
            }
        }
        if !wait_until(phase, deadline).await {
            traj.turns_unissued = (turns.len() - i) as u32;
            traj.completed = false;
            break;
        }
        if conn
            .as_mut()
            .is_some_and(|c| c.is_stale(Duration::from_secs(4)))
        {
            *conn = connector.connect().await.ok();
        }

        let uuid = Uuid::random(rng);
        let tracked = !phase.warmup && phase.tracking.load(Ordering::SeqCst) == TRACKING;
        if !phase.warmup && phase.tracking.load(Ordering::SeqCst) == STOPPED {
            phase.issued_after_stop.fetch_add(1, Ordering::Relaxed);
        }
        phase.progress.in_flight.fetch_add(1, Ordering::Relaxed);
        let mut issued_at: Option<Instant> = None;
        let outcome = match (conn.is_some(), connect_error) {
            (true, None) => {
                let timeout_at = Instant::now() + turn_timeout;
                let mut shutdown = phase.shutdown.clone();
                let exchange = exchange_on(connector, conn, &request, &mut issued_at);
                tokio::select! {
                    r = tokio::time::timeout_at(timeout_at, exchange) => match r {
                        Ok(Ok(resp)) => match decode::decode_as(phase.builder.api(), &resp, streaming).and_then(|d| chain.check(d)) {
                            Ok(decoded) => Outcome::Ok { resp: Box::new(resp), decoded },
                            Err(e) => {
                                let kind = match e {
                                    DecodeError::Status { .. } => TurnKind::HttpStatus,
                                    _ => TurnKind::BadResponse,
                                };
                                Outcome::Failed { kind, error_type: "error".into(), message: e.to_string(), at: resp.last_byte, first_byte: Some(resp.first_byte) }
                            }
                        },
                        Ok(Err(e)) => Outcome::Failed {
                            kind: match e {
                                ClientError::TooLarge { .. }
                                | ClientError::Protocol(_)
                                | ClientError::SwitchedProtocols => TurnKind::BadResponse,
                                _ => TurnKind::Transport,
                            },
                            error_type: "error".into(),
                            message: e.to_string(),
                            at: Instant::now(),
                            first_byte: None,
                        },
                        Err(_) => Outcome::Failed {
                            kind: TurnKind::Timeout,
                            error_type: "TurnTimeout".into(),
                            message: format!("turn timeout after {}s", py_float(phase.config.turn_timeout_s)),
                            at: Instant::now(),
                            first_byte: None,
                        },
                    },
                    _ = shutdown.wait() => Outcome::Failed { kind: TurnKind::Interrupted, error_type: "Interrupted".into(), message: "run interrupted".into(), at: Instant::now(), first_byte: None },
                }
            }
            (_, err) => Outcome::Failed {
                kind: TurnKind::Transport,
                error_type: "error".into(),
                message: err.unwrap_or_else(|| "no connection".into()),
                at: Instant::now(),
                first_byte: None,
            },
        };
        phase.progress.in_flight.fetch_sub(1, Ordering::Relaxed);
        let issued = issued_at.unwrap_or_else(Instant::now);
        let issued_ns = phase.ns(issued);
        if traj.turns_sent == 0 {
            traj.start_ns = issued_ns;
        }
        traj.turns_sent += 1;
        out.lags_ns.push((
            issued_ns as i64 - phase.ns(deadline) as i64,
            turn.delay_seconds * scale > 0.0,
        ));
        phase
            .events
            .send(Record::Issued {
                ts: issued_ns,
                uuid,
                conv: logical.clone(),
                turn: turn.turn,
                prompt: Prompt::Body {
                    source: source.clone(),
                    messages: turn.history_len,
                    body_len: body.len(),
                    fingerprint: events::fingerprint(&body),
                    full: (phase.config.log_prompts == LogPrompts::Full).then(|| {
                        (
                            body.clone(),
                            phase.builder.history_json(conv, turn, salt.as_ref()),
                        )
                    }),
                },
            })
            .await;

        let mut record = TurnRecord {
            slot,
            instance: k,
            target: target as u32,
            kind: TurnKind::Ok,
            tracked,
            intended_ns: phase.ns(deadline),
            issued_ns,
            first_byte_ns: None,
            first_token_ns: None,
            complete_ns: issued_ns,
            output_tokens: 0,
            prompt_tokens: 0,
            cached_tokens: None,
            estimated: false,
            chunks: 0,
            itl_ns: None,
            finish: Finish::Other,
            streaming,
        };
        match outcome {
            Outcome::Ok { resp, decoded } => {
                if !resp.reusable {
                    *conn = None;
                }
                let complete_ns = phase.ns(resp.last_byte);
                record.first_byte_ns = Some(phase.ns(resp.first_byte));
                record.complete_ns = complete_ns;
                let stamps: Vec<u64> = decoded
                    .delta_events
                    .iter()
                    .map(|&i| phase.ns(resp.events[i].at))
                    .collect();
                record.first_token_ns = stamps.first().copied();
                record.chunks = stamps.len() as u32;
                if stamps.len() >= 2 {
                    record.itl_ns =
                        Some((stamps[stamps.len() - 1] - stamps[0]) / (stamps.len() as u64 - 1));
                }
                match decoded.usage {
                    Some(u) => {
                        record.output_tokens = u.completion_tokens;
                        record.prompt_tokens = u.prompt_tokens;
                        record.cached_tokens = u.cached_tokens;
                    }
                    None => {
                        record.estimated = true;
                        record.output_tokens = decoded.output.char_len().div_ceil(4) as u64;
                        record.prompt_tokens = body.len().div_ceil(4) as u64;
                    }
                }
                record.finish = Finish::parse(decoded.finish_reason.as_deref());
                chain.advance(turn.history_len, &decoded);
                phase.progress.turns_ok.fetch_add(1, Ordering::Relaxed);
                phase
                    .progress
                    .output_tokens
                    .fetch_add(record.output_tokens, Ordering::Relaxed);
                if let Some(&first) = stamps.first() {
                    phase
                        .events
                        .send(Record::Recv {
                            ts: first,
                            uuid,
                            conv: logical.clone(),
                            turn: turn.turn,
                            first: true,
                        })
                        .await;
                    if phase.config.log_chunks {
                        for &ts in &stamps[1..] {
                            phase
                                .events
                                .send(Record::Recv {
                                    ts,
                                    uuid,
                                    conv: logical.clone(),
                                    turn: turn.turn,
                                    first: false,
                                })
                                .await;
                        }
                    }
                }
                phase
                    .events
                    .send(Record::Complete {
                        ts: complete_ns,
                        uuid,
                        conv: logical.clone(),
                        turn: turn.turn,
                        output: Some(Box::new(decoded.output)),
                        finish_reason: decoded.finish_reason,
                        from_worker: true,
                    })
                    .await;
                traj.end_ns = complete_ns;
                out.turns.push(record);
                anchor = resp.last_byte;
            }
            Outcome::Failed {
                kind,
                error_type,
                message,
                at,
                first_byte,
            } => {
                // The connection may hold a half-read response: never reuse it.
                *conn = None;
                let at_ns = phase.ns(at).max(issued_ns);
                record.kind = kind;
                if kind != TurnKind::Interrupted {
                    out.failure_reasons.add(kind, &message);
                }
                record.first_byte_ns = first_byte.map(|t| phase.ns(t));
                record.complete_ns = at_ns;
                phase.progress.errors.fetch_add(1, Ordering::Relaxed);
                phase
                    .events
                    .send(Record::Error {
                        ts: at_ns,
                        uuid,
                        conv: logical.clone(),
                        turn: turn.turn,
                        error_type: error_type.clone(),
                        message,
                    })
                    .await;
                phase
                    .events
                    .send(Record::Complete {
                        ts: at_ns,
                        uuid,
                        conv: logical.clone(),
                        turn: turn.turn,
                        output: None,
                        finish_reason: None,
                        from_worker: kind != TurnKind::Timeout,
                    })
                    .await;
                out.turns.push(record);
                traj.end_ns = at_ns;
                traj.completed = false;
                if kind == TurnKind::Interrupted {
                    traj.turns_unissued = (turns.len() - i - 1) as u32;
                    break;
                }
                let reason = if kind == TurnKind::Timeout {
                    format!("prior turn timed out (query={uuid})")
                } else {
                    format!("prior turn errored: {error_type}")
                };
                abort_remaining(
                    phase,
                    (slot, target as u32),
                    k,
                    &logical,
                    &turns[i + 1..],
                    &reason,
                    rng,
                    out,
                )
                .await;
                break;
            }
        }
    }
    out.trajectories.push(traj);
}

/// Where a trajectory's Responses chain stands (`responses_chain`): the response the next
/// turn continues, once a turn has succeeded.
struct Chained {
    on: bool,
    /// The last response's id, the messages its request carried, and its call ids.
    last: Option<(String, usize, Vec<String>)>,
}

impl Chained {
    fn new(on: bool) -> Self {
        Self { on, last: None }
    }

    /// The chain the next body belongs to (none when chaining is off).
    fn link(&self) -> Option<crate::wire::responses_request::Chain<'_>> {
        use crate::wire::responses_request::Chain;
        if !self.on {
            return None;
        }
        Some(match &self.last {
            None => Chain::default(),
            Some((id, sent, calls)) => Chain {
                previous_response_id: Some(id),
                sent_messages: *sent,
                call_ids: calls,
            },
        })
    }

    /// A chained turn's answer must carry the id the next turn names.
    fn check(&self, d: decode::Decoded) -> Result<decode::Decoded, DecodeError> {
        if self.on && d.response_id.is_none() {
            return Err(DecodeError::Malformed(
                "the response has no id, which responses_chain needs for the next turn".into(),
            ));
        }
        Ok(d)
    }

    fn advance(&mut self, sent_messages: usize, d: &decode::Decoded) {
        if let Some(id) = d.response_id.as_ref().filter(|_| self.on) {
            self.last = Some((id.clone(), sent_messages, d.call_ids.clone()));
        }
    }
}

/// Sends `request` on the slot's connection (which must be there) and reads the response;
/// when the server had already closed that kept-alive connection, sends it once more on a new
/// one, re-stamping `issued`: the first try never reached the server.
async fn exchange_on(
    connector: &Connector,
    conn: &mut Option<TargetConnection>,
    request: &[u8],
    issued: &mut Option<Instant>,
) -> Result<Response, ClientError> {
    let Some(c) = conn.as_mut() else {
        return Err(ClientError::Truncated);
    };
    match c.exchange(request, issued).await {
        Err(ClientError::ClosedWhileIdle) => {
            *conn = None;
            let c = conn.insert(connector.connect().await?);
            c.exchange(request, issued).await
        }
        r => r,
    }
}

/// Synthetic ISSUED + ERROR + COMPLETE for every turn not yet issued (reference §11.3).
#[allow(clippy::too_many_arguments)]
async fn abort_remaining(
    phase: &Phase,
    (slot, target): (u32, u32),
    k: u64,
    logical: &Arc<str>,
    rest: &[crate::dataset::ClientTurn],
    reason: &str,
    rng: &mut rand_chacha::ChaCha8Rng,
    out: &mut SlotResult,
) {
    for turn in rest {
        let uuid = Uuid::random(rng);
        let ts = phase.ns(Instant::now());
        for record in [
            Record::Issued {
                ts,
                uuid,
                conv: logical.clone(),
                turn: turn.turn,
                prompt: Prompt::Skipped,
            },
            Record::Error {
                ts,
                uuid,
                conv: logical.clone(),
                turn: turn.turn,
                error_type: "TurnAbortedByPriorFailure".into(),
                message: reason.to_string(),
            },
            Record::Complete {
                ts,
                uuid,
                conv: logical.clone(),
                turn: turn.turn,
                output: None,
                finish_reason: None,
                from_worker: false,
            },
        ] {
            phase.events.send(record).await;
        }
        phase.progress.errors.fetch_add(1, Ordering::Relaxed);
        out.turns.push(TurnRecord {
            slot,
            instance: k,
            target,
            kind: TurnKind::Aborted,
            tracked: !phase.warmup && phase.tracking.load(Ordering::SeqCst) == TRACKING,
            intended_ns: ts,
            issued_ns: ts,
            first_byte_ns: None,
            first_token_ns: None,
            complete_ns: ts,
            output_tokens: 0,
            prompt_tokens: 0,
            cached_tokens: None,
            estimated: false,
            chunks: 0,
            itl_ns: None,
            finish: Finish::Other,
            streaming: false,
        });
    }
}

async fn sleep_opt(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// Waits for `deadline`; false when issuing stopped meanwhile (the pending turn is dropped).
async fn wait_until(phase: &Phase, deadline: Instant) -> bool {
    let stop = phase.stop_notify.notified();
    tokio::pin!(stop);
    stop.as_mut().enable();
    if phase.halted() {
        return false;
    }
    let mut shutdown = phase.shutdown.clone();
    let hard = phase.hard_deadline;
    tokio::select! {
        _ = pace(deadline, phase.config.precise_pacing) => {}
        _ = &mut stop => return false,
        _ = shutdown.wait() => return false,
        _ = sleep_opt(hard) => return false,
    }
    !phase.halted()
}

/// Waits for a send's deadline: precisely (a kernel timer wakes the slot within tens of
/// microseconds) or on tokio's millisecond ticks. A deadline already passed (a first turn, a
/// slow response's follow-up) sends at once: tokio would wait for its next timer turn.
pub(crate) async fn pace(deadline: Instant, precise: bool) {
    if Instant::now() >= deadline {
        return;
    }
    if precise {
        crate::timing::sleep_until(deadline).await;
    } else {
        tokio::time::sleep_until(deadline).await;
    }
}

/// Python's `str(float)` for the values a timeout takes (`2.0`, `0.25`, `14400.0`).
pub(crate) fn py_float(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e16 {
        format!("{v:.1}")
    } else {
        format!("{v}")
    }
}
