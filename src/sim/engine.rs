//! One replica's engine: an iteration-level continuous-batching loop over the KV block pool,
//! paced by precise sleeps on `tokio::time` and keeping its own simulated clock.

use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::config::EngineConfig;
use super::cost::CostModel;
use super::kv::{BlockId, BlockPool};
use super::metrics::{Metrics, FINISH_REASONS};
use super::render::Prompt;

/// Maps simulated time to real time: real = epoch + simulated × scale.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SimClock {
    epoch: Instant,
    scale: f64,
}

impl SimClock {
    /// A clock starting now.
    pub(crate) fn new(scale: f64) -> SimClock {
        SimClock {
            epoch: Instant::now(),
            scale,
        }
    }

    /// Simulated nanoseconds at real instant `t`.
    pub(crate) fn sim_ns(&self, t: Instant) -> u64 {
        (t.saturating_duration_since(self.epoch).as_nanos() as f64 / self.scale) as u64
    }

    /// Simulated nanoseconds now.
    pub(crate) fn now_ns(&self) -> u64 {
        self.sim_ns(Instant::now())
    }

    /// How far (simulated ns) the engine may run behind the real clock before it catches up:
    /// two timer ticks of real time, so millisecond timer rounding never moves the
    /// simulated clock and paused-time runs stay exact.
    pub(crate) fn lag_tolerance_ns(&self) -> u64 {
        (2e6 / self.scale) as u64
    }

    /// The real instant of simulated time `ns`.
    pub(crate) fn real_at(&self, ns: u64) -> Instant {
        self.epoch + Duration::from_nanos((ns as f64 * self.scale) as u64)
    }
}

/// Simulated nanoseconds as seconds.
pub(crate) fn secs(ns: u64) -> f64 {
    ns as f64 / 1e9
}

/// A request handed to the engine by the HTTP layer.
#[derive(Debug)]
pub(crate) struct Submission {
    /// Accept order: breaks ties between requests ready at the same simulated instant.
    pub seq: u64,
    /// When the request arrived (simulated ns).
    pub arrival_ns: u64,
    /// When it reaches the engine, after the API-server overhead (simulated ns).
    pub ready_ns: u64,
    /// The prompt's pseudo-tokens and block hashes.
    pub prompt: Prompt,
    /// Tokens to generate (the responder planned them).
    pub output_tokens: usize,
    /// Where tokens are reported; dropping the receiver cancels the request.
    pub events: mpsc::UnboundedSender<Event>,
    /// Context for the ground-truth log.
    pub trace: TraceContext,
}

/// Fields of the ground-truth log line the engine does not know itself.
#[derive(Debug, Clone, Default)]
pub(crate) struct TraceContext {
    /// The response id.
    pub request_id: String,
    /// `x-session-id` of the request, if any.
    pub session: Option<String>,
    /// The finish reason the reply ends with.
    pub finish_reason: &'static str,
}

/// What the engine reports about a request.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Event {
    /// The n-th token (1-based) was generated at simulated time `at_ns`.
    Token {
        /// Tokens generated so far.
        count: usize,
        /// Simulated time.
        at_ns: u64,
        /// Prompt tokens served from the prefix cache (Anthropic's usage opens with them).
        cached: usize,
    },
    /// The last token was generated.
    Done(Timings),
}

/// Where a request's time went, in simulated ns; the usage block and trace log use these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Timings {
    /// Arrival.
    pub arrival_ns: u64,
    /// Reached the engine.
    pub ready_ns: u64,
    /// First admitted to the running batch.
    pub scheduled_ns: u64,
    /// First token.
    pub first_token_ns: u64,
    /// Last token.
    pub finish_ns: u64,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens served from the prefix cache at first admission.
    pub cached_tokens: usize,
    /// Tokens generated.
    pub completion_tokens: usize,
    /// Times it was preempted.
    pub preemptions: u32,
}

/// Messages to an engine.
#[derive(Debug)]
pub(crate) enum Command {
    /// A new request.
    Submit(Submission),
    /// Forget the prefix cache; answered when done.
    ResetPrefixCache(oneshot::Sender<()>),
}

#[derive(Debug)]
struct Seq {
    sub: Submission,
    computed: usize,
    generated: usize,
    blocks: Vec<BlockId>,
    cached_tokens: Option<usize>,
    scheduled_ns: u64,
    first_token_ns: u64,
    last_token_ns: u64,
    preemptions: u32,
    /// Tokens computed in the current step.
    step_tokens: usize,
}

impl Seq {
    /// Tokens that must be in KV before the next token can be emitted.
    fn target(&self) -> usize {
        self.sub.prompt.tokens + self.generated
    }

    fn is_decoding(&self) -> bool {
        self.generated > 0 && self.computed + 1 == self.target()
    }
}

/// One replica's engine state; [`Engine::run`] is its task.
pub(crate) struct Engine {
    cfg: EngineConfig,
    cost: CostModel,
    pool: BlockPool,
    clock: SimClock,
    now_ns: u64,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    rx: mpsc::UnboundedReceiver<Command>,
    metrics: Arc<Metrics>,
    replica: String,
    trace_log: Option<mpsc::UnboundedSender<String>>,
}

impl Engine {
    /// An idle engine reading commands from `rx`.
    pub(crate) fn new(
        cfg: EngineConfig,
        clock: SimClock,
        rx: mpsc::UnboundedReceiver<Command>,
        metrics: Arc<Metrics>,
        replica: String,
        trace_log: Option<mpsc::UnboundedSender<String>>,
    ) -> Engine {
        Engine {
            cost: CostModel::new(&cfg),
            pool: BlockPool::new(cfg.num_gpu_blocks),
            cfg,
            clock,
            now_ns: 0,
            waiting: VecDeque::new(),
            running: Vec::new(),
            rx,
            metrics,
            replica,
            trace_log,
        }
    }

    /// Runs until every command sender is gone and no request is left.
    pub(crate) async fn run(mut self) {
        loop {
            if self.running.is_empty() && self.waiting.is_empty() {
                match self.rx.recv().await {
                    Some(cmd) => self.handle(cmd),
                    None => break,
                }
            }
            while let Ok(cmd) = self.rx.try_recv() {
                self.handle(cmd);
            }
            self.drop_cancelled();
            if self.running.is_empty() {
                match self.waiting.iter().map(|s| s.sub.ready_ns).min() {
                    Some(ready) => self.now_ns = self.now_ns.max(ready),
                    None => continue,
                }
            }
            // A machine too slow for the time scale makes simulated time pass: reported
            // durations then include the lag, as clients see it, instead of hiding it.
            let real_now = self.clock.now_ns();
            if real_now > self.now_ns.saturating_add(self.clock.lag_tolerance_ns()) {
                self.now_ns = real_now;
            }
            let (batch, context, chunks) = self.schedule();
            self.publish_gauges();
            if self.running.is_empty() {
                // Nothing could be admitted with every block free: the request can never
                // fit (the HTTP layer rejects those, so this is a safety net).
                if let Some(seq) = self.waiting.pop_front() {
                    self.finish(seq, true);
                }
                continue;
            }
            let step_ms = self.cost.step_ms(batch, context, chunks.into_iter());
            let end_ns = self.now_ns + (step_ms * 1e6).round() as u64;
            let deadline = self.clock.real_at(end_ns);
            if deadline > Instant::now() {
                // Tokens leave when they are due, as the ground-truth log says.
                crate::timing::sleep_until(deadline).await;
            } else {
                tokio::task::yield_now().await;
            }
            self.now_ns = end_ns;
            self.complete_step();
            self.publish_gauges();
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit(sub) => {
                let seq = Seq {
                    sub,
                    computed: 0,
                    generated: 0,
                    blocks: Vec::new(),
                    cached_tokens: None,
                    scheduled_ns: 0,
                    first_token_ns: 0,
                    last_token_ns: 0,
                    preemptions: 0,
                    step_tokens: 0,
                };
                let key = (seq.sub.ready_ns, seq.sub.seq);
                // FCFS by (ready time, accept order); preempted requests sit at the front.
                let pos = self
                    .waiting
                    .iter()
                    .rposition(|s| s.cached_tokens.is_some() || (s.sub.ready_ns, s.sub.seq) <= key)
                    .map_or(0, |p| p + 1);
                self.waiting.insert(pos, seq);
            }
            Command::ResetPrefixCache(done) => {
                self.pool.reset();
                let _ = done.send(());
            }
        }
    }

    fn drop_cancelled(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].sub.events.is_closed() {
                let seq = self.running.remove(i);
                self.pool.free(&seq.blocks);
                self.finish(seq, true);
            } else {
                i += 1;
            }
        }
        let cancelled: Vec<usize> = (0..self.waiting.len())
            .filter(|&i| self.waiting[i].sub.events.is_closed())
            .collect();
        for i in cancelled.into_iter().rev() {
            if let Some(seq) = self.waiting.remove(i) {
                self.finish(seq, true);
            }
        }
    }

    /// Picks this step's work: one token per decoding request, then prefill chunks of
    /// running requests, then admissions, within the token budget. Returns the decode batch
    /// size, its total context and the prefill chunks `(new, already computed)`.
    fn schedule(&mut self) -> (usize, usize, Vec<(usize, usize)>) {
        let bs = self.cfg.block_size;
        let mut budget = self.cfg.max_num_batched_tokens;
        for seq in &mut self.running {
            seq.step_tokens = 0;
        }
        for decode_pass in [true, false] {
            let mut i = 0;
            while i < self.running.len() && budget > 0 {
                if self.running[i].is_decoding() != decode_pass || self.running[i].step_tokens > 0 {
                    i += 1;
                    continue;
                }
                let seq = &self.running[i];
                let tokens = (seq.target() - seq.computed).min(budget);
                let needed = (seq.computed + tokens)
                    .div_ceil(bs)
                    .saturating_sub(seq.blocks.len());
                match self.pool.allocate(needed) {
                    Some(new) => {
                        let seq = &mut self.running[i];
                        seq.blocks.extend(new);
                        seq.step_tokens = tokens;
                        budget -= tokens;
                        i += 1;
                    }
                    None => {
                        // Out of blocks: the newest request makes room (possibly this one).
                        let victim = self.running.len() - 1;
                        budget += self.running[victim].step_tokens;
                        self.preempt(victim);
                        if victim == i {
                            break;
                        }
                    }
                }
            }
        }
        while budget > 0 && self.running.len() < self.cfg.max_num_seqs {
            let Some(seq) = self.waiting.front() else {
                break;
            };
            if seq.sub.ready_ns > self.now_ns {
                break;
            }
            let n = seq.sub.prompt.tokens;
            let hit = self.pool.lookup(&seq.sub.prompt.block_hashes, n, bs);
            let hit_tokens = hit.len() * bs;
            let tokens = (seq.target() - hit_tokens).min(budget);
            let needed = (hit_tokens + tokens).div_ceil(bs) - hit.len();
            if self.pool.free_blocks() - self.pool.free_among(&hit) < needed {
                break;
            }
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            self.pool.touch(&hit);
            let new = self.pool.allocate(needed).expect("checked above");
            seq.blocks = hit;
            seq.blocks.extend(new);
            seq.computed = hit_tokens;
            seq.step_tokens = tokens;
            budget -= tokens;
            if seq.cached_tokens.is_none() {
                seq.cached_tokens = Some(hit_tokens);
                seq.scheduled_ns = self.now_ns;
                self.metrics.queued.fetch_sub(1, Relaxed);
                self.metrics
                    .prefix_cache_queries
                    .fetch_add(n as u64, Relaxed);
                self.metrics
                    .prefix_cache_hits
                    .fetch_add(hit_tokens as u64, Relaxed);
                self.metrics.prompt_tokens.fetch_add(n as u64, Relaxed);
                self.metrics
                    .queue
                    .observe(secs(self.now_ns.saturating_sub(seq.sub.ready_ns)));
            }
            self.running.push(seq);
        }
        let mut batch = 0;
        let mut context = 0;
        let mut chunks = Vec::new();
        for seq in self.running.iter().filter(|s| s.step_tokens > 0) {
            if seq.is_decoding() {
                batch += 1;
                context += seq.computed + 1;
            } else {
                chunks.push((seq.step_tokens, seq.computed));
            }
        }
        (batch, context, chunks)
    }

    fn preempt(&mut self, index: usize) {
        let mut seq = self.running.remove(index);
        self.pool.free(&seq.blocks);
        seq.blocks.clear();
        seq.computed = 0;
        seq.step_tokens = 0;
        seq.preemptions += 1;
        self.metrics.preemptions.fetch_add(1, Relaxed);
        self.waiting.push_front(seq);
    }

    /// Applies the step that just ended at `now_ns`: caches completed prompt blocks, emits
    /// tokens and retires finished requests.
    fn complete_step(&mut self) {
        let bs = self.cfg.block_size;
        let now = self.now_ns;
        let mut i = 0;
        while i < self.running.len() {
            let seq = &mut self.running[i];
            if seq.step_tokens == 0 {
                i += 1;
                continue;
            }
            let before = seq.computed;
            seq.computed += seq.step_tokens;
            seq.step_tokens = 0;
            let prompt_blocks = seq.sub.prompt.block_hashes.len();
            for b in before / bs..(seq.computed / bs).min(prompt_blocks) {
                self.pool
                    .cache(seq.blocks[b], seq.sub.prompt.block_hashes[b]);
            }
            if seq.computed < seq.target() {
                i += 1;
                continue;
            }
            seq.generated += 1;
            if seq.generated == 1 {
                seq.first_token_ns = now;
                self.metrics.ttft.observe(secs(now - seq.sub.arrival_ns));
                self.metrics.prefill.observe(secs(now - seq.scheduled_ns));
            } else {
                self.metrics.itl.observe(secs(now - seq.last_token_ns));
            }
            seq.last_token_ns = now;
            self.metrics.generation_tokens.fetch_add(1, Relaxed);
            let _ = seq.sub.events.send(Event::Token {
                count: seq.generated,
                at_ns: now,
                cached: seq.cached_tokens.unwrap_or(0),
            });
            if seq.generated >= seq.sub.output_tokens {
                let seq = self.running.remove(i);
                self.pool.free(&seq.blocks);
                self.finish(seq, false);
            } else {
                i += 1;
            }
        }
    }

    /// Reports a request that left the engine (finished, or cancelled when `aborted`).
    fn finish(&mut self, seq: Seq, aborted: bool) {
        let t = Timings {
            arrival_ns: seq.sub.arrival_ns,
            ready_ns: seq.sub.ready_ns,
            scheduled_ns: seq.scheduled_ns,
            first_token_ns: seq.first_token_ns,
            finish_ns: self.now_ns,
            prompt_tokens: seq.sub.prompt.tokens,
            cached_tokens: seq.cached_tokens.unwrap_or(0),
            completion_tokens: seq.generated,
            preemptions: seq.preemptions,
        };
        if seq.cached_tokens.is_none() {
            self.metrics.queued.fetch_sub(1, Relaxed);
        }
        let reason = if aborted {
            "abort"
        } else {
            seq.sub.trace.finish_reason
        };
        if let Some(i) = FINISH_REASONS.iter().position(|r| *r == reason) {
            self.metrics.finished[i].fetch_add(1, Relaxed);
        }
        if !aborted {
            self.metrics.e2e.observe(secs(t.finish_ns - t.arrival_ns));
            self.metrics
                .decode
                .observe(secs(t.finish_ns - t.first_token_ns));
            let _ = seq.sub.events.send(Event::Done(t));
        }
        if let Some(log) = &self.trace_log {
            let started = seq.cached_tokens.is_some();
            let line = serde_json::json!({
                "replica": self.replica,
                "request_id": seq.sub.trace.request_id,
                "session": seq.sub.trace.session,
                "arrival_s": secs(t.arrival_ns),
                "queue_wait_s": started.then(|| secs(t.scheduled_ns.saturating_sub(t.ready_ns))),
                "scheduled_s": started.then(|| secs(t.scheduled_ns)),
                "first_token_s": (t.completion_tokens > 0).then(|| secs(t.first_token_ns)),
                "finish_s": secs(t.finish_ns),
                "prompt_tokens": t.prompt_tokens,
                "cached_tokens": t.cached_tokens,
                "output_tokens": t.completion_tokens,
                "finish_reason": reason,
                "preemptions": t.preemptions,
            });
            let _ = log.send(line.to_string());
        }
    }

    fn publish_gauges(&self) {
        self.metrics
            .running
            .store(self.running.len() as u64, Relaxed);
        self.metrics
            .waiting
            .store(self.waiting.len() as u64, Relaxed);
        self.metrics
            .kv_blocks_used
            .store(self.pool.used_blocks() as u64, Relaxed);
    }
}
