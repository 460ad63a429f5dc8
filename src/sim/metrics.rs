//! Per-replica metrics with vLLM's names: plain atomics and small histograms owned by the
//! replica (no global recorder), rendered as Prometheus text.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use parking_lot::Mutex;

const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
const REQUEST_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// A fixed-bucket histogram of seconds.
#[derive(Debug)]
pub(crate) struct Histogram {
    bounds: &'static [f64],
    state: Mutex<(Vec<u64>, f64, u64)>,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            state: Mutex::new((vec![0; bounds.len()], 0.0, 0)),
        }
    }

    /// Records one observation.
    pub(crate) fn observe(&self, seconds: f64) {
        let mut s = self.state.lock();
        if let Some(i) = self.bounds.iter().position(|b| seconds <= *b) {
            s.0[i] += 1;
        }
        s.1 += seconds;
        s.2 += 1;
    }

    /// (sum, count).
    pub(crate) fn sum_count(&self) -> (f64, u64) {
        let s = self.state.lock();
        (s.1, s.2)
    }

    fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let s = self.state.lock();
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (bound, n) in self.bounds.iter().zip(&s.0) {
            cumulative += n;
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{bound}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", s.2);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", s.1);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", s.2);
    }
}

/// Everything one replica exposes on `/metrics`.
#[derive(Debug)]
pub(crate) struct Metrics {
    model: String,
    legacy: bool,
    block_size: usize,
    num_gpu_blocks: usize,
    /// Requests running (prefilling or decoding).
    pub running: AtomicU64,
    /// Requests waiting for admission.
    pub waiting: AtomicU64,
    /// KV blocks in use.
    pub kv_blocks_used: AtomicU64,
    /// Requests accepted but not yet admitted (the `max_queue` bound counts these).
    pub queued: AtomicU64,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_cache_queries: AtomicU64,
    /// Prompt tokens found in the prefix cache.
    pub prefix_cache_hits: AtomicU64,
    /// Prompt tokens of finished requests.
    pub prompt_tokens: AtomicU64,
    /// Tokens generated.
    pub generation_tokens: AtomicU64,
    /// Requests pushed back to waiting for lack of KV blocks.
    pub preemptions: AtomicU64,
    /// Responses API conversations kept for `previous_response_id`.
    pub responses_stored: AtomicU64,
    /// Bytes those conversations hold.
    pub responses_stored_bytes: AtomicU64,
    /// Conversations forgotten (or never kept) for the store's bound.
    pub responses_evicted: AtomicU64,
    /// Finished requests by reason: stop, length, tool_calls, abort.
    pub finished: [AtomicU64; 4],
    /// Time to first token.
    pub ttft: Histogram,
    /// Time between tokens.
    pub itl: Histogram,
    /// Arrival to last token.
    pub e2e: Histogram,
    /// Time in the waiting queue.
    pub queue: Histogram,
    /// First scheduled to first token.
    pub prefill: Histogram,
    /// First token to last token.
    pub decode: Histogram,
}

/// Labels of `vllm:request_success_total`, in `Metrics::finished` order.
pub(crate) const FINISH_REASONS: [&str; 4] = ["stop", "length", "tool_calls", "abort"];

impl Metrics {
    /// Zeroed metrics for one replica.
    pub(crate) fn new(
        model: &str,
        block_size: usize,
        num_gpu_blocks: usize,
        legacy: bool,
    ) -> Metrics {
        Metrics {
            model: model.to_string(),
            legacy,
            block_size,
            num_gpu_blocks,
            running: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            kv_blocks_used: AtomicU64::new(0),
            queued: AtomicU64::new(0),
            prefix_cache_queries: AtomicU64::new(0),
            prefix_cache_hits: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            preemptions: AtomicU64::new(0),
            responses_stored: AtomicU64::new(0),
            responses_stored_bytes: AtomicU64::new(0),
            responses_evicted: AtomicU64::new(0),
            finished: Default::default(),
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(REQUEST_BUCKETS),
            queue: Histogram::new(REQUEST_BUCKETS),
            prefill: Histogram::new(REQUEST_BUCKETS),
            decode: Histogram::new(REQUEST_BUCKETS),
        }
    }

    /// Share of KV blocks in use (0..=1).
    pub(crate) fn kv_usage(&self) -> f64 {
        self.kv_blocks_used.load(Relaxed) as f64 / self.num_gpu_blocks.max(1) as f64
    }

    /// Prometheus text exposition.
    pub(crate) fn render(&self) -> String {
        let mut out = String::with_capacity(8192);
        let labels = format!("model_name=\"{}\"", self.model);
        let gauge = |out: &mut String, name: &str, help: &str, v: String| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{labels}}} {v}"
            );
        };
        let counter = |out: &mut String, name: &str, help: &str, v: &AtomicU64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{{labels}}} {}",
                v.load(Relaxed)
            );
        };
        gauge(
            &mut out,
            "vllm:num_requests_running",
            "Requests in the running batch.",
            self.running.load(Relaxed).to_string(),
        );
        gauge(
            &mut out,
            "vllm:num_requests_waiting",
            "Requests waiting to be scheduled.",
            self.waiting.load(Relaxed).to_string(),
        );
        gauge(
            &mut out,
            "vllm:kv_cache_usage_perc",
            "KV-cache usage; 1 means 100 percent.",
            self.kv_usage().to_string(),
        );
        if self.legacy {
            gauge(
                &mut out,
                "vllm:gpu_cache_usage_perc",
                "KV-cache usage (legacy name).",
                self.kv_usage().to_string(),
            );
        }
        counter(
            &mut out,
            "vllm:prefix_cache_queries_total",
            "Prompt tokens queried in the prefix cache.",
            &self.prefix_cache_queries,
        );
        counter(
            &mut out,
            "vllm:prefix_cache_hits_total",
            "Prompt tokens found in the prefix cache.",
            &self.prefix_cache_hits,
        );
        counter(
            &mut out,
            "vllm:prompt_tokens_total",
            "Prefill tokens processed.",
            &self.prompt_tokens,
        );
        counter(
            &mut out,
            "vllm:generation_tokens_total",
            "Generation tokens processed.",
            &self.generation_tokens,
        );
        counter(
            &mut out,
            "vllm:num_preemptions_total",
            "Cumulative number of preemptions.",
            &self.preemptions,
        );
        gauge(
            &mut out,
            "agentrace_sim_responses_stored",
            "Responses API conversations kept for previous_response_id.",
            self.responses_stored.load(Relaxed).to_string(),
        );
        gauge(
            &mut out,
            "agentrace_sim_responses_stored_bytes",
            "Bytes of the kept Responses API conversations.",
            self.responses_stored_bytes.load(Relaxed).to_string(),
        );
        counter(
            &mut out,
            "agentrace_sim_responses_evicted_total",
            "Responses API conversations forgotten for the store's bound.",
            &self.responses_evicted,
        );
        let _ = writeln!(
            out,
            "# HELP vllm:request_success_total Finished requests by finish reason.\n# TYPE vllm:request_success_total counter"
        );
        for (reason, n) in FINISH_REASONS.iter().zip(&self.finished) {
            let _ = writeln!(
                out,
                "vllm:request_success_total{{{labels},finished_reason=\"{reason}\"}} {}",
                n.load(Relaxed)
            );
        }
        self.ttft.render(
            &mut out,
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            &labels,
        );
        self.itl.render(
            &mut out,
            "vllm:inter_token_latency_seconds",
            "Inter-token latency.",
            &labels,
        );
        self.e2e.render(
            &mut out,
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency.",
            &labels,
        );
        self.queue.render(
            &mut out,
            "vllm:request_queue_time_seconds",
            "Time spent waiting.",
            &labels,
        );
        self.prefill.render(
            &mut out,
            "vllm:request_prefill_time_seconds",
            "Time spent in prefill.",
            &labels,
        );
        self.decode.render(
            &mut out,
            "vllm:request_decode_time_seconds",
            "Time spent in decode.",
            &labels,
        );
        let _ = writeln!(
            out,
            "# HELP vllm:cache_config_info KV cache configuration.\n# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size=\"{}\",num_gpu_blocks=\"{}\"}} 1",
            self.block_size, self.num_gpu_blocks
        );
        out
    }
}
