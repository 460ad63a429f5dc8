//! Measures a real OpenAI-compatible engine for `agentrace sim calibrate`: what it says about
//! itself (KV capacity, slots, model), then TTFT against prompt length (uncached, and extended
//! on a cached prefix) and inter-token time against batch size, with a number of requests
//! fixed and stated before the first one is sent.

use std::time::Duration;

use http::Method;
use tokio::time::Instant;

use super::profile_fit::{DecodeSample, PrefillSample};
use crate::proxy::capacity::{self, Reading, KV_PATHS};
use crate::replay::client::{ClientError, Connector, Response, Target};
use crate::replay::decode;

/// What to measure and the bounds on it.
#[derive(Debug, Clone)]
pub(crate) struct ProbeOptions {
    /// Base URL of the engine.
    pub target: String,
    /// Model name to ask for (`None`: the first of `/v1/models`).
    pub model: Option<String>,
    /// Longest prompt measured, tokens.
    pub max_prompt_tokens: u64,
    /// Tokens generated per decode stream.
    pub decode_tokens: u64,
    /// Each prefill point is measured this many times.
    pub repeats: usize,
    /// Largest batch measured when the engine states no slot count.
    pub max_batch: usize,
    /// No more chat requests than this.
    pub max_requests: usize,
    /// Per-request deadline.
    pub timeout: Duration,
}

/// Why a measurement failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ProbeError {
    /// The URL is unusable.
    #[error("--target: {0}")]
    Target(String),
    /// The plan needs more requests than allowed.
    #[error("--max-requests: the measurement needs {need} requests, {allowed} are allowed (raise --max-requests, or lower --repeats / --max-prompt-tokens / --max-batch)")]
    Budget {
        /// Requests the plan needs.
        need: usize,
        /// The bound.
        allowed: usize,
    },
    /// A request failed.
    #[error("{what}: {message}")]
    Request {
        /// Which request.
        what: String,
        /// The cause.
        message: String,
    },
}

/// What the engine says about itself.
#[derive(Debug, Clone, Default)]
pub(crate) struct Described {
    /// Model to ask for.
    pub model: String,
    /// KV capacity in tokens and where it was read.
    pub kv_tokens: Option<(u64, &'static str)>,
    /// Sequences it runs at once, when it says.
    pub slots: Option<usize>,
}

/// Everything measured.
#[derive(Debug, Clone, Default)]
pub(crate) struct Measured {
    /// TTFT samples.
    pub prefill: Vec<PrefillSample>,
    /// Inter-token-time samples.
    pub decode: Vec<DecodeSample>,
    /// Chat requests sent.
    pub requests: u64,
    /// Characters per prompt token, from the warm-up.
    pub chars_per_token: f64,
}

/// The measurement plan: prompt lengths and batch sizes, and the requests they cost.
#[derive(Debug, Clone)]
pub(crate) struct ProbePlan {
    /// Prompt lengths, tokens.
    pub lengths: Vec<u64>,
    /// Batch sizes.
    pub batches: Vec<usize>,
    /// Prompt lengths of the decode rounds (short and long context).
    pub decode_prompts: Vec<u64>,
    /// Chat requests in all.
    pub requests: usize,
}

impl ProbePlan {
    /// Doubling prompt lengths from 64 up to the bound, and doubling batches up to the slots.
    pub(crate) fn new(opts: &ProbeOptions, slots: Option<usize>) -> ProbePlan {
        let mut lengths = Vec::new();
        let mut l = 64;
        while l < opts.max_prompt_tokens {
            lengths.push(l);
            l *= 2;
        }
        lengths.push(opts.max_prompt_tokens.max(16));
        let top = slots.unwrap_or(opts.max_batch).max(1);
        let mut batches = Vec::new();
        let mut b = 1;
        while b < top {
            batches.push(b);
            b *= 2;
        }
        batches.push(top);
        let decode_prompts = vec![64.min(opts.max_prompt_tokens), opts.max_prompt_tokens / 2];
        let requests = 1
            + lengths.len() * 2 * opts.repeats
            + decode_prompts.len() * batches.iter().sum::<usize>();
        ProbePlan {
            lengths,
            batches,
            decode_prompts,
            requests,
        }
    }
}

/// A connection set-up to the engine and the requests sent so far.
pub(crate) struct Prober {
    connector: Connector,
    opts: ProbeOptions,
    model: String,
    sent: u64,
    nonce: u64,
}

/// One streamed completion: when it was sent, what came back.
struct Streamed {
    issued: Instant,
    response: Response,
    decoded: decode::Decoded,
}

impl Prober {
    /// A prober for `opts.target`.
    pub(crate) fn new(opts: ProbeOptions) -> Result<Prober, ProbeError> {
        let target = Target::parse(&opts.target).map_err(|e| ProbeError::Target(e.to_string()))?;
        let connector = Connector::new(target, None, Duration::from_secs(10), 64 << 20)
            .map_err(|e| ProbeError::Target(e.to_string()))?;
        Ok(Prober {
            connector,
            model: opts.model.clone().unwrap_or_default(),
            opts,
            sent: 0,
            nonce: crate::random::os_u64(),
        })
    }

    async fn get(&self, path: &str) -> Result<Response, ClientError> {
        let bytes = self
            .connector
            .request_bytes_as(&Method::GET, path, &[], &[])
            .map_err(|m| ClientError::Io(std::io::Error::other(m)))?;
        let mut conn = self.connector.connect().await?;
        let mut issued = None;
        tokio::time::timeout(
            self.opts.timeout,
            conn.exchange_as(&bytes, false, &mut issued),
        )
        .await
        .map_err(|_| ClientError::Io(std::io::ErrorKind::TimedOut.into()))?
    }

    /// Model, KV capacity and slots, from the engine's own endpoints (the proxy's reader
    /// of KV capacity, one implementation).
    pub(crate) async fn describe(&mut self) -> Described {
        let mut d = Described::default();
        if self.model.is_empty() {
            if let Ok(r) = self.get("/v1/models").await {
                let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap_or_default();
                if let Some(id) = v["data"][0]["id"].as_str() {
                    self.model = id.to_string();
                }
            }
        }
        if self.model.is_empty() {
            self.model = "default".to_string();
        }
        d.model = self.model.clone();
        for (i, path) in KV_PATHS.iter().enumerate() {
            let Ok(r) = self.get(path).await else {
                continue;
            };
            if r.status != 200 {
                continue;
            }
            if d.kv_tokens.is_none() {
                if let Reading::Size(tokens, source) = capacity::read(i, &r.body) {
                    d.kv_tokens = Some((tokens, source.as_str()));
                }
            }
            if d.slots.is_none() {
                d.slots = slots(path, &r.body);
            }
        }
        d
    }

    /// A prompt of about `tokens` tokens: a nonce first (so no cache holds it), then words.
    fn prompt(&self, tokens: u64, chars_per_token: f64, nonce: u64) -> String {
        let chars = (tokens as f64 * chars_per_token).round() as usize;
        let mut s = format!("[{nonce:016x}]");
        let mut i = 0u64;
        while s.len() < chars {
            s.push_str(&format!(
                " w{}",
                crate::random::splitmix64(i ^ 0x5eed) % 997
            ));
            i += 1;
        }
        s
    }

    fn body(&self, prompt: &str, max_tokens: u64) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "ignore_eos": true,
            "temperature": 0.0,
            "stream": true,
            "stream_options": {"include_usage": true},
        }))
        .expect("a JSON value serialises")
    }

    async fn stream(
        &self,
        prompt: &str,
        max_tokens: u64,
        what: &str,
    ) -> Result<Streamed, ProbeError> {
        let fail = |message: String| ProbeError::Request {
            what: what.to_string(),
            message,
        };
        let bytes = self
            .connector
            .request_bytes(true, &[], &self.body(prompt, max_tokens));
        let mut conn = self
            .connector
            .connect()
            .await
            .map_err(|e| fail(e.to_string()))?;
        let mut issued = None;
        let response = tokio::time::timeout(self.opts.timeout, conn.exchange(&bytes, &mut issued))
            .await
            .map_err(|_| fail(format!("no answer within {:?}", self.opts.timeout)))?
            .map_err(|e| fail(e.to_string()))?;
        let decoded = decode::decode(&response, true).map_err(|e| fail(e.to_string()))?;
        Ok(Streamed {
            issued: issued.unwrap_or_else(Instant::now),
            response,
            decoded,
        })
    }

    /// Runs the plan. `progress` hears about each finished step.
    pub(crate) async fn measure(
        &mut self,
        plan: &ProbePlan,
        progress: &dyn Fn(&str),
    ) -> Result<Measured, ProbeError> {
        if plan.requests > self.opts.max_requests {
            return Err(ProbeError::Budget {
                need: plan.requests,
                allowed: self.opts.max_requests,
            });
        }
        let mut m = Measured::default();
        // Warm-up: loads whatever loads lazily and tells characters per token.
        let warm_chars = 2_000.0;
        let nonce = self.next_nonce();
        let warm = self.prompt(500, 4.0, nonce);
        let s = self.stream(&warm, 2, "warm-up").await?;
        self.sent += 1;
        let tokens = usage(&s).prompt_tokens.max(1) as f64;
        m.chars_per_token = (warm_chars / tokens).clamp(0.5, 16.0);
        for &len in &plan.lengths {
            for _ in 0..self.opts.repeats {
                let nonce = self.next_nonce();
                let base = self.prompt(len, m.chars_per_token, nonce);
                let s = self
                    .stream(&base, 2, &format!("prefill {len} tokens"))
                    .await?;
                self.sent += 1;
                let u = usage(&s);
                m.prefill.push(PrefillSample {
                    uncached: u.prompt_tokens.saturating_sub(u.cached_tokens.unwrap_or(0)) as f64,
                    cached: u.cached_tokens.unwrap_or(0) as f64,
                    ttft_ms: ttft_ms(&s),
                });
                // The same prompt extended by a quarter: its prefix is cached now.
                let ext = self.prompt(len + (len / 4).max(32), m.chars_per_token, nonce);
                let s = self
                    .stream(&ext, 2, &format!("prefill {len} tokens, extended"))
                    .await?;
                self.sent += 1;
                let e = usage(&s);
                // An engine that does not report cached tokens is taken to have kept the
                // whole first prompt.
                let cached = e
                    .cached_tokens
                    .unwrap_or(u.prompt_tokens.saturating_sub(1))
                    .min(e.prompt_tokens);
                m.prefill.push(PrefillSample {
                    uncached: e.prompt_tokens.saturating_sub(cached) as f64,
                    cached: cached as f64,
                    ttft_ms: ttft_ms(&s),
                });
            }
            progress(&format!("prefill at {len} tokens"));
        }
        for &prompt_len in &plan.decode_prompts {
            for &b in &plan.batches {
                let prompts: Vec<String> = (0..b)
                    .map(|_| {
                        let n = self.next_nonce();
                        self.prompt(prompt_len, m.chars_per_token, n)
                    })
                    .collect();
                let what = format!("decode batch {b}");
                let results = futures_util::future::join_all(
                    prompts
                        .iter()
                        .map(|p| self.stream(p, self.opts.decode_tokens, &what)),
                )
                .await;
                self.sent += b as u64;
                let mut itls = Vec::new();
                let mut context = 0.0;
                for r in results {
                    let s = r?;
                    let u = usage(&s);
                    context += u.prompt_tokens as f64 + u.completion_tokens as f64 / 2.0;
                    if let Some(itl) = itl_ms(&s) {
                        itls.push(itl);
                    }
                }
                if let Some(itl) = median(&mut itls) {
                    m.decode.push(DecodeSample {
                        batch: b as f64,
                        context,
                        itl_ms: itl,
                    });
                }
                progress(&format!("decode at batch {b}, {prompt_len}-token prompts"));
            }
        }
        m.requests = self.sent;
        Ok(m)
    }

    fn next_nonce(&mut self) -> u64 {
        self.nonce = crate::random::splitmix64(self.nonce);
        self.nonce
    }
}

fn usage(s: &Streamed) -> decode::Usage {
    s.decoded.usage.unwrap_or_default()
}

/// Sending to the first token (the first event carrying output, else the first event).
fn ttft_ms(s: &Streamed) -> f64 {
    let first = s
        .decoded
        .delta_events
        .first()
        .and_then(|&i| s.response.events.get(i))
        .or(s.response.events.first())
        .map_or(s.response.first_byte, |e| e.at);
    first.saturating_duration_since(s.issued).as_secs_f64() * 1e3
}

/// Mean time between the first and the last output event of one stream.
fn itl_ms(s: &Streamed) -> Option<f64> {
    let (&first, &last) = (
        s.decoded.delta_events.first()?,
        s.decoded.delta_events.last()?,
    );
    let span = last.checked_sub(first).filter(|n| *n > 0)?;
    let (a, b) = (s.response.events[first].at, s.response.events[last].at);
    Some(b.saturating_duration_since(a).as_secs_f64() * 1e3 / span as f64)
}

fn median(v: &mut [f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

/// Sequences run at once, as llama-server states them (`/props` `total_slots`, `/slots`).
fn slots(path: &str, body: &[u8]) -> Option<usize> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let n = match path {
        "/props" => v["total_slots"].as_u64()?,
        "/slots" => v.as_array()?.len() as u64,
        "/get_server_info" => v["max_running_requests"].as_u64()?,
        _ => return None,
    };
    usize::try_from(n).ok().filter(|n| *n > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts() -> ProbeOptions {
        ProbeOptions {
            target: "http://127.0.0.1:1".into(),
            model: None,
            max_prompt_tokens: 1024,
            decode_tokens: 32,
            repeats: 2,
            max_batch: 8,
            max_requests: 64,
            timeout: Duration::from_secs(1),
        }
    }

    #[test]
    fn the_plan_counts_every_request_it_will_send() {
        let plan = ProbePlan::new(&opts(), Some(4));
        assert_eq!(plan.lengths, vec![64, 128, 256, 512, 1024]);
        assert_eq!(plan.batches, vec![1, 2, 4]);
        // warm-up + 5 lengths × 2 kinds × 2 repeats + 2 contexts × (1+2+4)
        assert_eq!(plan.requests, 1 + 20 + 14);
    }

    #[tokio::test]
    async fn a_plan_over_the_bound_is_refused_before_anything_is_sent() {
        let mut o = opts();
        o.max_requests = 10;
        let plan = ProbePlan::new(&o, None);
        let mut p = Prober::new(o).unwrap();
        let err = p.measure(&plan, &|_| {}).await.unwrap_err();
        assert!(err.to_string().starts_with("--max-requests:"), "{err}");
        assert_eq!(p.sent, 0);
    }
}
