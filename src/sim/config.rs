//! Simulator configuration: named hardware profiles, the TOML file format layered over a
//! profile, and validation that names the field and the value.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The profile used when none is named: an H100 serving a Qwen3-30B-A3B-like MoE in BF16.
pub const DEFAULT_PROFILE: &str = "h100-qwen3-30b-a3b-bf16";

/// Responses kept per replica by default: a few hundred agent sessions' latest turns.
pub(crate) const DEFAULT_RESPONSES_STORE_MAX: usize = 1024;
/// Bytes of kept conversations per replica by default (256 MiB).
pub(crate) const DEFAULT_RESPONSES_STORE_MAX_BYTES: usize = 256 << 20;

/// Names accepted by [`SimConfig::from_profile`].
pub const PROFILES: &[&str] = &[DEFAULT_PROFILE, "h200-qwen3-30b-a3b-fp8"];

/// Everything one `agentrace sim` cluster needs; every replica of a cluster shares it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SimConfig {
    /// The profile this config started from (informational once loaded).
    pub profile: String,
    /// Model id served by `/v1/models` and echoed in responses.
    pub model: String,
    /// Replica names are `<name>-<index>`; they appear in `x-inference-pod`.
    pub name: String,
    /// Real seconds per simulated second: 0.01 runs 100× faster than real time. Every
    /// reported duration stays in simulated time.
    pub time_scale: f64,
    /// Root of all randomness; combined with a hash of each request body.
    pub seed: u64,
    /// `created` of responses = this Unix time + simulated seconds since start. Unset: the
    /// wall clock read once at start (set it for byte-identical responses across runs).
    pub created_base_unix: Option<u64>,
    /// Also expose the pre-v0.10 name `vllm:gpu_cache_usage_perc`, for old dashboards.
    pub legacy_metrics: bool,
    /// Append one JSON line per finished request to this file (ground truth for replays).
    pub trace_log: Option<PathBuf>,
    /// Responses API conversations each replica keeps for `previous_response_id`; the oldest
    /// is forgotten first. 0 keeps none, so every continuation fails with 404.
    pub responses_store_max: usize,
    /// Bytes (of the kept conversations as JSON) each replica's store may hold, so memory stays
    /// bounded however long the conversations clients send.
    pub responses_store_max_bytes: usize,
    /// The simulated GPU and model.
    pub engine: EngineConfig,
    /// What the generated text says and how long it is.
    pub responder: ResponderConfig,
    /// Failure injection for tests.
    pub faults: FaultConfig,
    /// Where `agentrace sim calibrate` measured this profile and how well its fit holds;
    /// absent in hand-written configs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub calibration: Option<super::profile::Calibration>,
}

/// Scheduler limits, KV capacity and cost-model constants (see the simulated-backend doc §6–7).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineConfig {
    /// Tokens per KV block; prefix caching works at this granularity.
    pub block_size: usize,
    /// KV capacity in blocks; the knob that decides how many sessions stay cached.
    pub num_gpu_blocks: usize,
    /// Most requests running at once (decoding or prefilling).
    pub max_num_seqs: usize,
    /// Token budget of one engine step (decode tokens + prefill chunks).
    pub max_num_batched_tokens: usize,
    /// Bytes of KV per token; the decode step reads all of it once per step.
    pub kv_bytes_per_token: f64,
    /// Fixed cost of every engine step (launch, scheduler), ms.
    pub t_fixed_ms: f64,
    /// API-server cost paid once before a request reaches the engine (TTFT only), ms.
    pub request_overhead_ms: f64,
    /// Effective memory bandwidth, bytes per second.
    pub bandwidth_bytes_per_s: f64,
    /// Bytes of non-expert weights read every decode step.
    pub dense_weight_bytes: f64,
    /// Bytes of all expert weights; a step reads the share its batch activates.
    pub expert_weight_bytes: f64,
    /// Experts activated per token.
    pub experts_per_token: u32,
    /// Experts per layer.
    pub experts_total: u32,
    /// Prefill time per token on a short context, µs.
    pub prefill_us_per_token: f64,
    /// Context length at which attention costs as much as the linear layers, tokens.
    pub attention_equal_context: f64,
    /// Compute time of each running sequence in a decode step, µs: what a compute-bound
    /// engine (a CPU, a small model) pays per sequence where a GPU pays almost nothing.
    pub decode_us_per_seq: f64,
}

/// Which responder writes the replies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ResponderKind {
    /// Deterministic text, reasoning and schema-valid tool calls.
    Synthetic,
    /// The recorded reply of a loaded MLPerf dataset turn (synthetic when unrecognised).
    Oracle,
}

/// Reply content and length.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ResponderConfig {
    /// Which responder writes the replies.
    pub kind: ResponderKind,
    /// MLPerf agentic dataset the oracle answers from.
    pub oracle_dataset: Option<PathBuf>,
    /// Probability that the oracle answers with the recorded reply rather than a wrong one.
    pub oracle_accuracy: f64,
    /// Probability of a tool call under `tool_choice: auto`.
    pub tool_call_probability: f64,
    /// Share of a synthetic reply spent in `reasoning_content` (0 disables reasoning).
    pub reasoning_ratio: f64,
    /// Shortest natural reply length in tokens (before `max_tokens`).
    pub output_tokens_min: usize,
    /// Longest natural reply length in tokens (before `max_tokens`).
    pub output_tokens_max: usize,
}

/// How a mid-stream failure shows on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum MidStreamFault {
    /// An OpenAI-style error event, then `data: [DONE]` (what vLLM and llm-d-sim send).
    ErrorEvent,
    /// The connection is cut without a terminating chunk.
    Abort,
}

/// Failure injection; every draw is seeded by the request, so a test sees the same faults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FaultConfig {
    /// Probability of an HTTP 500 before the first token.
    pub fail_rate: f64,
    /// HTTP status of those failures (500 by default; 429 or 503 exercise retry paths).
    pub fail_status: u16,
    /// Probability that a stream is cut after some tokens.
    pub fail_mid_stream_rate: f64,
    /// How a mid-stream failure looks.
    pub mid_stream: MidStreamFault,
    /// Probability that a request never gets a response (until the client gives up).
    pub hang_rate: f64,
    /// Waiting-queue bound: a request that finds this many waiting gets 503 + Retry-After.
    /// 0 means unbounded.
    pub max_queue: usize,
    /// Extra simulated delay before a request reaches the engine, ms.
    pub extra_delay_ms: f64,
}

/// A configuration that cannot run.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// No profile of that name.
    #[error("profile: unknown profile {0:?} (known: {known})", known = PROFILES.join(", "))]
    UnknownProfile(String),
    /// A field has a value the simulator cannot use.
    #[error("{field}: {reason}, got {value}")]
    Invalid {
        /// Dotted path of the field.
        field: &'static str,
        /// What is required.
        reason: &'static str,
        /// The value found.
        value: String,
    },
    /// The TOML could not be parsed or has unknown fields.
    #[error("{path}: {message}")]
    Parse {
        /// The file.
        path: String,
        /// The parser's message.
        message: String,
    },
}

impl Default for SimConfig {
    fn default() -> Self {
        Self::from_profile(DEFAULT_PROFILE).expect("the default profile exists")
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        SimConfig::default().engine
    }
}

impl Default for ResponderConfig {
    fn default() -> Self {
        Self {
            kind: ResponderKind::Synthetic,
            oracle_dataset: None,
            oracle_accuracy: 1.0,
            tool_call_probability: 0.5,
            reasoning_ratio: 0.25,
            output_tokens_min: 16,
            output_tokens_max: 256,
        }
    }
}

impl Default for FaultConfig {
    fn default() -> Self {
        Self {
            fail_rate: 0.0,
            fail_status: 500,
            fail_mid_stream_rate: 0.0,
            mid_stream: MidStreamFault::ErrorEvent,
            hang_rate: 0.0,
            max_queue: 0,
            extra_delay_ms: 0.0,
        }
    }
}

impl SimConfig {
    /// The configuration of a named profile (see the simulated-backend doc §7).
    pub fn from_profile(name: &str) -> Result<SimConfig, ConfigError> {
        let h100 = EngineConfig {
            block_size: 16,
            num_gpu_blocks: 5_000,
            max_num_seqs: 64,
            max_num_batched_tokens: 8_192,
            kv_bytes_per_token: 98_304.0,
            t_fixed_ms: 3.0,
            request_overhead_ms: 15.0,
            bandwidth_bytes_per_s: 2.7e12,
            dense_weight_bytes: 3.1e9,
            expert_weight_bytes: 58e9,
            experts_per_token: 8,
            experts_total: 128,
            prefill_us_per_token: 20.0,
            attention_equal_context: 16_000.0,
            decode_us_per_seq: 0.0,
        };
        let engine = match name {
            "h100-qwen3-30b-a3b-bf16" => h100,
            "h200-qwen3-30b-a3b-fp8" => EngineConfig {
                num_gpu_blocks: 20_000,
                max_num_seqs: 128,
                bandwidth_bytes_per_s: 3.9e12,
                dense_weight_bytes: 1.6e9,
                expert_weight_bytes: 29e9,
                prefill_us_per_token: 12.0,
                ..h100
            },
            other => return Err(ConfigError::UnknownProfile(other.to_string())),
        };
        Ok(SimConfig {
            profile: name.to_string(),
            model: "qwen3-30b-a3b".to_string(),
            name: "sim".to_string(),
            time_scale: 1.0,
            seed: 0,
            created_base_unix: None,
            legacy_metrics: false,
            trace_log: None,
            responses_store_max: DEFAULT_RESPONSES_STORE_MAX,
            responses_store_max_bytes: DEFAULT_RESPONSES_STORE_MAX_BYTES,
            engine,
            responder: ResponderConfig::default(),
            faults: FaultConfig::default(),
            calibration: None,
        })
    }

    /// Parses a TOML file body: the profile it names (or the default) with the file's
    /// fields laid over it. Unknown fields are errors.
    pub fn from_toml_str(text: &str, path: &str) -> Result<SimConfig, ConfigError> {
        let parse_err = |message: String| ConfigError::Parse {
            path: path.to_string(),
            message,
        };
        let file: toml::Table = text
            .parse()
            .map_err(|e: toml::de::Error| parse_err(e.to_string()))?;
        let profile = match file.get("profile") {
            None => DEFAULT_PROFILE.to_string(),
            Some(toml::Value::String(s)) => s.clone(),
            Some(other) => {
                return Err(parse_err(format!(
                    "profile: expected a string, got {other}"
                )))
            }
        };
        let base = SimConfig::from_profile(&profile)?;
        let mut merged = toml::Table::try_from(&base).map_err(|e| parse_err(e.to_string()))?;
        merge(&mut merged, file);
        let config: SimConfig = toml::Value::Table(merged)
            .try_into()
            .map_err(|e: toml::de::Error| parse_err(e.to_string()))?;
        Ok(config)
    }

    /// Reads and parses a TOML file (see [`SimConfig::from_toml_str`]).
    pub fn from_file(path: &std::path::Path) -> Result<SimConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Parse {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        Self::from_toml_str(&text, &path.display().to_string())
    }

    /// KV capacity in tokens.
    pub fn kv_capacity_tokens(&self) -> usize {
        self.engine.num_gpu_blocks * self.engine.block_size
    }

    /// Checks every field; the message names the field and the value.
    pub fn validate(&self) -> Result<(), ConfigError> {
        fn check(
            ok: bool,
            field: &'static str,
            reason: &'static str,
            value: impl ToString,
        ) -> Result<(), ConfigError> {
            if ok {
                Ok(())
            } else {
                Err(ConfigError::Invalid {
                    field,
                    reason,
                    value: value.to_string(),
                })
            }
        }
        let prob = |p: f64| (0.0..=1.0).contains(&p);
        let pos = |x: f64| x.is_finite() && x > 0.0;
        let nonneg = |x: f64| x.is_finite() && x >= 0.0;
        let e = &self.engine;
        check(
            pos(self.time_scale),
            "time_scale",
            "must be > 0",
            self.time_scale,
        )?;
        // Below this, simulated nanoseconds since start would overflow 64 bits within hours.
        check(
            self.time_scale >= 1e-6,
            "time_scale",
            "must be >= 0.000001",
            self.time_scale,
        )?;
        check(!self.model.is_empty(), "model", "must not be empty", "\"\"")?;
        check(
            !self.name.is_empty() && self.name.bytes().all(|b| b.is_ascii_graphic()),
            "name",
            "must be non-empty printable ASCII without spaces",
            format!("{:?}", self.name),
        )?;
        check(
            e.block_size >= 1,
            "engine.block_size",
            "must be >= 1",
            e.block_size,
        )?;
        check(
            e.num_gpu_blocks >= 1,
            "engine.num_gpu_blocks",
            "must be >= 1",
            e.num_gpu_blocks,
        )?;
        check(
            e.max_num_seqs >= 1,
            "engine.max_num_seqs",
            "must be >= 1",
            e.max_num_seqs,
        )?;
        check(
            e.max_num_batched_tokens > e.max_num_seqs,
            "engine.max_num_batched_tokens",
            "must be > engine.max_num_seqs",
            e.max_num_batched_tokens,
        )?;
        check(
            nonneg(e.kv_bytes_per_token),
            "engine.kv_bytes_per_token",
            "must be >= 0",
            e.kv_bytes_per_token,
        )?;
        check(
            nonneg(e.t_fixed_ms),
            "engine.t_fixed_ms",
            "must be >= 0",
            e.t_fixed_ms,
        )?;
        check(
            nonneg(e.request_overhead_ms),
            "engine.request_overhead_ms",
            "must be >= 0",
            e.request_overhead_ms,
        )?;
        check(
            pos(e.bandwidth_bytes_per_s),
            "engine.bandwidth_bytes_per_s",
            "must be > 0",
            e.bandwidth_bytes_per_s,
        )?;
        check(
            nonneg(e.dense_weight_bytes),
            "engine.dense_weight_bytes",
            "must be >= 0",
            e.dense_weight_bytes,
        )?;
        check(
            nonneg(e.expert_weight_bytes),
            "engine.expert_weight_bytes",
            "must be >= 0",
            e.expert_weight_bytes,
        )?;
        check(
            e.experts_total >= 1,
            "engine.experts_total",
            "must be >= 1",
            e.experts_total,
        )?;
        check(
            e.experts_per_token <= e.experts_total,
            "engine.experts_per_token",
            "must be <= engine.experts_total",
            e.experts_per_token,
        )?;
        check(
            nonneg(e.prefill_us_per_token),
            "engine.prefill_us_per_token",
            "must be >= 0",
            e.prefill_us_per_token,
        )?;
        check(
            pos(e.attention_equal_context),
            "engine.attention_equal_context",
            "must be > 0",
            e.attention_equal_context,
        )?;
        check(
            self.responses_store_max == 0 || self.responses_store_max_bytes > 0,
            "responses_store_max_bytes",
            "must be > 0 when responses_store_max is",
            self.responses_store_max_bytes,
        )?;
        check(
            nonneg(e.decode_us_per_seq),
            "engine.decode_us_per_seq",
            "must be >= 0",
            e.decode_us_per_seq,
        )?;
        let r = &self.responder;
        check(
            prob(r.oracle_accuracy),
            "responder.oracle_accuracy",
            "must be in [0, 1]",
            r.oracle_accuracy,
        )?;
        check(
            prob(r.tool_call_probability),
            "responder.tool_call_probability",
            "must be in [0, 1]",
            r.tool_call_probability,
        )?;
        check(
            prob(r.reasoning_ratio) && r.reasoning_ratio < 1.0,
            "responder.reasoning_ratio",
            "must be in [0, 1)",
            r.reasoning_ratio,
        )?;
        check(
            r.output_tokens_min >= 1,
            "responder.output_tokens_min",
            "must be >= 1",
            r.output_tokens_min,
        )?;
        check(
            r.output_tokens_max >= r.output_tokens_min,
            "responder.output_tokens_max",
            "must be >= responder.output_tokens_min",
            r.output_tokens_max,
        )?;
        let f = &self.faults;
        check(
            prob(f.fail_rate),
            "faults.fail_rate",
            "must be in [0, 1]",
            f.fail_rate,
        )?;
        check(
            prob(f.fail_mid_stream_rate),
            "faults.fail_mid_stream_rate",
            "must be in [0, 1]",
            f.fail_mid_stream_rate,
        )?;
        check(
            prob(f.hang_rate),
            "faults.hang_rate",
            "must be in [0, 1]",
            f.hang_rate,
        )?;
        check(
            (400..=599).contains(&f.fail_status),
            "faults.fail_status",
            "must be an HTTP error status (400..=599)",
            f.fail_status,
        )?;
        check(
            f.fail_rate + f.fail_mid_stream_rate + f.hang_rate <= 1.0,
            "faults",
            "fail_rate + fail_mid_stream_rate + hang_rate must be <= 1",
            f.fail_rate + f.fail_mid_stream_rate + f.hang_rate,
        )?;
        check(
            nonneg(f.extra_delay_ms),
            "faults.extra_delay_ms",
            "must be >= 0",
            f.extra_delay_ms,
        )?;
        Ok(())
    }
}

/// Lays `over` onto `base`, table by table, so a file only names what it changes.
fn merge(base: &mut toml::Table, over: toml::Table) {
    for (key, value) in over {
        match (base.get_mut(&key), value) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            (_, v) => {
                base.insert(key, v);
            }
        }
    }
}
