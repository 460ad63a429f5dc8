//! The run configuration of one replay: TOML with unknown keys rejected, overridable by flags,
//! validated before any connection is opened.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Why a configuration cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The file is not valid TOML for this struct.
    #[error("{path}: {message}")]
    Parse {
        /// The file.
        path: String,
        /// What the parser said (names the key and line).
        message: String,
    },
    /// A field has a value the replayer cannot use.
    #[error("{field}: {message}")]
    Invalid {
        /// The dotted field name.
        field: &'static str,
        /// What is wrong, with the value.
        message: String,
    },
}

/// How much of each prompt `sample.issued` records carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum, Default)]
#[serde(rename_all = "lowercase")]
pub enum LogPrompts {
    /// A one-line reference: source id, turn, message count, body size and hash.
    #[default]
    Compact,
    /// The whole salted history, tools and template kwargs, as the reference writes them.
    Full,
}

/// The endpoints of a replay: one URL, or several that share the conversations. In TOML
/// either `target = "http://a:8000"` or `target = ["http://a:8000", "http://b:8000"]`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Targets(Vec<String>);

impl Targets {
    /// The URLs, in the order given.
    pub fn iter(&self) -> std::slice::Iter<'_, String> {
        self.0.iter()
    }

    /// Number of endpoints.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// No endpoint given.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The endpoint of trajectory instance `k` (the k-th trajectory a phase starts: dataset
    /// conversation `k mod n`, repeat `k / n`): `k mod targets`. Every turn of a conversation
    /// thus goes to one endpoint (its KV cache stays there), the choice is the same in every
    /// run, and the endpoints get conversation counts within one of each other, where a hash
    /// of the id would leave a small run unbalanced.
    pub fn of_instance(k: u64, targets: usize) -> usize {
        (k % targets.max(1) as u64) as usize
    }
}

impl From<Vec<String>> for Targets {
    fn from(urls: Vec<String>) -> Self {
        Targets(urls)
    }
}

impl From<String> for Targets {
    fn from(url: String) -> Self {
        Targets(vec![url])
    }
}

impl From<&str> for Targets {
    fn from(url: &str) -> Self {
        Targets(vec![url.to_string()])
    }
}

impl std::fmt::Display for Targets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0.join(", "))
    }
}

/// One endpoint is written as a string (as before lists were accepted), several as a list.
impl Serialize for Targets {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0.as_slice() {
            [one] => s.serialize_str(one),
            many => many.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for Targets {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Urls;
        impl<'de> serde::de::Visitor<'de> for Urls {
            type Value = Targets;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a URL or a list of URLs")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Targets, E> {
                Ok(Targets(vec![v.to_string()]))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Targets, A::Error> {
                let mut urls = Vec::new();
                while let Some(url) = seq.next_element::<String>()? {
                    urls.push(url);
                }
                Ok(Targets(urls))
            }
        }
        d.deserialize_any(Urls)
    }
}

/// Default of `max_response_bytes`: hundreds of times the largest reply of a real agent turn
/// (a 32 K-token reply streamed token by token is about 8 MiB of SSE).
pub(crate) const DEFAULT_MAX_RESPONSE_BYTES: u64 = 64 * 1024 * 1024;

/// Smallest `max_response_bytes` accepted: room for a response head and a short reply.
pub(crate) const MIN_MAX_RESPONSE_BYTES: u64 = 4096;

/// Everything one replay needs; `agentrace replay` flags override the TOML values.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReplayConfig {
    /// Base URL of the OpenAI-compatible endpoint (`http://host:port`, optional path prefix),
    /// or a list of them: conversations are then spread over the endpoints, each conversation
    /// kept on one (see [`Targets::of_instance`]).
    pub target: Targets,
    /// Dataset file; the standard set is generated and used when absent.
    pub dataset: Option<PathBuf>,
    /// A dataset line longer than this stops the load at once, naming the line.
    pub dataset_max_line_bytes: u64,
    /// Model preset (`qwen3.6-35b-a3b`, `kimi-k3`) giving sampling parameters and gates.
    pub model: Option<String>,
    /// Overrides the preset's `model` name on the wire.
    pub model_name: Option<String>,
    /// Explicit model parameters (`[model_params]`); they replace the preset's.
    pub model_params: Option<crate::dataset::ModelParams>,
    /// Number of slots: active trajectories, each with at most one request in flight.
    pub concurrency: usize,
    /// Trajectory budget; `None` = one pass over the dataset.
    pub num_trajectories: Option<u64>,
    /// Trajectories run before the performance window and excluded from every result.
    pub warmup_trajectories: u64,
    /// Salt the system prompt per repeat and conversation, exactly as the reference.
    pub enable_salt: bool,
    /// Honour `delay_seconds` end-to-start.
    pub inject_tool_delay: bool,
    /// Multiplies every delay (2.0 = twice as slow, 0.5 = twice as fast).
    pub time_scale: f64,
    /// A turn that has not completed this long after it was issued is cancelled and fails.
    pub turn_timeout_s: f64,
    /// Connecting to the target gives up after this long.
    pub connect_timeout_s: f64,
    /// A response is held whole until it ends: one larger than this fails its turn
    /// (`bad_response`) and its connection is dropped, so a server that streams without end
    /// cannot grow the replayer without bound.
    pub max_response_bytes: u64,
    /// Stop issuing turns of active trajectories when the performance window ends.
    pub stop_issuing_on_first_user_complete: bool,
    /// Header names that carry the logical conversation id (every one the same value).
    pub routing_headers: Vec<String>,
    /// Name of the environment variable holding the API key (the key itself never appears).
    pub api_key_env: Option<String>,
    /// Ask streaming servers for token usage (`stream_options.include_usage`).
    pub include_usage: bool,
    /// Wall-clock cap on the performance phase in seconds (0 = none).
    pub max_duration_s: f64,
    /// ISSUED records: compact (default) or full prompts.
    pub log_prompts: LogPrompts,
    /// Write `sample.recv_non_first` for every streamed event after the first.
    pub log_chunks: bool,
    /// Wake each send with a kernel high-resolution timer (`crate::timing`) rather than on
    /// tokio's millisecond ticks: the median schedule lag drops from about 1 ms to about
    /// 0.1 ms for a few system calls per delayed send. On by default; off saves them.
    pub precise_pacing: bool,
    /// Inline accuracy gate; the preset's threshold when absent.
    pub accuracy_threshold: Option<f64>,
    /// OSL per-turn mean band `[low, high]`; the preset's band when absent.
    pub osl_band: Option<[f64; 2]>,
    /// The run claims to follow an official run config: the budget must then be a positive
    /// multiple of the dataset's trajectory count (the official configs set it).
    pub official_rules: bool,
    /// Live progress line on stderr.
    pub progress: bool,
    /// An SLO tier (`ttft_p90=2s,interactivity=30`): goodput counts the agents and turns
    /// meeting it; absent, no goodput is reported.
    pub slo: Option<super::slo::Slo>,
    /// GPUs serving the target, for jobs per hour per GPU; absent, that figure is not
    /// reported.
    pub gpus: Option<u32>,
    /// The wire every turn is written in: `chat` (`/v1/chat/completions`), `messages`
    /// (Anthropic, `/v1/messages`) or `responses` (OpenAI, `/v1/responses`). The same
    /// conversations, metrics and first-token rule in each; official runs use `chat`.
    pub api: crate::wire::Api,
    /// With `api = "responses"`: chain turns with `previous_response_id`, sending only the new
    /// items, as Codex does; a turn whose server no longer holds the previous response fails
    /// with the server's reason. Off: every turn carries the whole conversation unstored.
    pub responses_chain: bool,
}

impl Default for ReplayConfig {
    fn default() -> Self {
        Self {
            target: Targets::default(),
            dataset: None,
            dataset_max_line_bytes: crate::dataset::lines::DEFAULT_MAX_LINE_BYTES as u64,
            model: None,
            model_name: None,
            model_params: None,
            concurrency: 8,
            num_trajectories: None,
            warmup_trajectories: 0,
            enable_salt: true,
            inject_tool_delay: true,
            time_scale: 1.0,
            turn_timeout_s: 86_400.0,
            connect_timeout_s: 10.0,
            max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
            stop_issuing_on_first_user_complete: false,
            routing_headers: vec!["X-Session-ID".to_string()],
            api_key_env: None,
            include_usage: true,
            max_duration_s: 0.0,
            log_prompts: LogPrompts::Compact,
            log_chunks: false,
            precise_pacing: true,
            accuracy_threshold: None,
            osl_band: None,
            official_rules: false,
            progress: false,
            slo: None,
            gpus: None,
            api: crate::wire::Api::Chat,
            responses_chain: false,
        }
    }
}

/// Accuracy and output-length gates of an official model (reference §18).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Gates {
    /// Minimum inline accuracy (a fraction).
    pub accuracy: f64,
    /// OSL per-turn mean band in tokens.
    pub osl_band: [f64; 2],
}

/// The gates of a known preset.
pub(crate) fn preset_gates(preset: &str) -> Option<Gates> {
    match preset {
        "qwen3.6-35b-a3b" => Some(Gates {
            accuracy: 0.5586,
            osl_band: [355.0, 434.0],
        }),
        "kimi-k3" => Some(Gates {
            accuracy: 0.5832,
            osl_band: [390.0, 475.0],
        }),
        _ => None,
    }
}

impl ReplayConfig {
    /// Reads a TOML file.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_toml(&text).map_err(|e| match e {
            ConfigError::Parse { message, .. } => ConfigError::Parse {
                path: path.display().to_string(),
                message,
            },
            other => other,
        })
    }

    /// Parses TOML text.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: "<config>".to_string(),
            message: e.to_string().trim_end().to_string(),
        })
    }

    /// The gates in force: explicit values win over the preset's.
    pub fn gates(&self) -> Option<Gates> {
        let preset = self.model.as_deref().and_then(preset_gates);
        let accuracy = self.accuracy_threshold.or(preset.map(|g| g.accuracy))?;
        let osl_band = self.osl_band.or(preset.map(|g| g.osl_band))?;
        Some(Gates { accuracy, osl_band })
    }

    /// The trajectory budget of a run over `trajectories` conversations, checked against the
    /// official rule when `official_rules` is on.
    pub fn check_budget(&self, trajectories: u64) -> Result<u64, ConfigError> {
        let budget = self.num_trajectories.unwrap_or(trajectories);
        if self.official_rules && (trajectories == 0 || budget % trajectories != 0) {
            return Err(ConfigError::Invalid {
                field: "num_trajectories",
                message: format!(
                    "official_rules requires a positive multiple of the dataset's {trajectories} \
                     trajectories, got {budget} (set official_rules = false for a shorter run)"
                ),
            });
        }
        Ok(budget)
    }

    /// Which budget rule applied, in words, for `result_summary.json`.
    pub fn budget_rule(&self, trajectories: u64) -> String {
        let budget = self.num_trajectories.unwrap_or(trajectories);
        if self.official_rules {
            format!(
                "official (official_rules = true): the budget must be a positive multiple of the \
                 dataset's {trajectories} trajectories; {budget} is"
            )
        } else {
            format!(
                "none (official_rules = false): any budget is accepted; {budget} trajectories \
                 over a dataset of {trajectories}"
            )
        }
    }

    /// Checks every field; messages name the field and the value.
    pub fn validate(&self) -> Result<(), ConfigError> {
        fn bad(field: &'static str, message: String) -> Result<(), ConfigError> {
            Err(ConfigError::Invalid { field, message })
        }
        if self.target.is_empty() {
            return bad(
                "target",
                "must be set: a URL or a list of URLs (e.g. http://127.0.0.1:8080)".into(),
            );
        }
        for (i, url) in self.target.iter().enumerate() {
            if let Err(e) = super::client::Target::parse(url) {
                return bad("target", format!("{e}, got {url:?}"));
            }
            let same = |other: &String| other.trim_end_matches('/') == url.trim_end_matches('/');
            if self.target.iter().take(i).any(same) {
                return bad(
                    "target",
                    format!("{url:?} is listed twice (each endpoint once)"),
                );
            }
        }
        if self.concurrency == 0 {
            return bad("concurrency", "must be >= 1, got 0".into());
        }
        if self.gpus == Some(0) {
            return bad("gpus", "must be >= 1 when given, got 0".into());
        }
        if self.dataset_max_line_bytes < 1024 {
            return bad(
                "dataset_max_line_bytes",
                format!("must be >= 1024, got {}", self.dataset_max_line_bytes),
            );
        }
        if self.num_trajectories == Some(0) {
            return bad(
                "num_trajectories",
                "must be >= 1 (omit it for one pass), got 0".into(),
            );
        }
        if !(self.time_scale.is_finite() && self.time_scale >= 0.0) {
            return bad(
                "time_scale",
                format!("must be a finite number >= 0, got {}", self.time_scale),
            );
        }
        if !(self.turn_timeout_s.is_finite() && self.turn_timeout_s > 0.0) {
            return bad(
                "turn_timeout_s",
                format!("must be > 0, got {}", self.turn_timeout_s),
            );
        }
        if !(self.connect_timeout_s.is_finite() && self.connect_timeout_s > 0.0) {
            return bad(
                "connect_timeout_s",
                format!("must be > 0, got {}", self.connect_timeout_s),
            );
        }
        if self.max_response_bytes < MIN_MAX_RESPONSE_BYTES {
            return bad(
                "max_response_bytes",
                format!(
                    "must be >= {MIN_MAX_RESPONSE_BYTES}, got {}",
                    self.max_response_bytes
                ),
            );
        }
        if !(self.max_duration_s.is_finite() && self.max_duration_s >= 0.0) {
            return bad(
                "max_duration_s",
                format!("must be >= 0 (0 = no cap), got {}", self.max_duration_s),
            );
        }
        for name in &self.routing_headers {
            if http::HeaderName::from_bytes(name.as_bytes()).is_err() {
                return bad(
                    "routing_headers",
                    format!("{name:?} is not a valid HTTP header name"),
                );
            }
        }
        if let Some(model) = &self.model {
            if crate::dataset::ModelParams::preset(model).is_none() && preset_gates(model).is_none()
            {
                return bad(
                    "model",
                    format!("unknown preset {model:?} (known: qwen3.6-35b-a3b, kimi-k3)"),
                );
            }
        }
        if let Some(p) = &self.model_params {
            p.validate().map_err(|message| ConfigError::Invalid {
                field: "model_params",
                message,
            })?;
        }
        if let Some(t) = self.accuracy_threshold {
            if !(0.0..=1.0).contains(&t) {
                return bad(
                    "accuracy_threshold",
                    format!("must be a fraction in [0, 1], got {t}"),
                );
            }
        }
        if let Some([lo, hi]) = self.osl_band {
            if !(lo.is_finite() && hi.is_finite() && lo >= 0.0 && lo <= hi) {
                return bad(
                    "osl_band",
                    format!("must be [low, high] with 0 <= low <= high, got [{lo}, {hi}]"),
                );
            }
        }
        self.validate_api()?;
        if let Some(var) = &self.api_key_env {
            if var.is_empty() {
                return bad("api_key_env", "must name an environment variable".into());
            }
            if std::env::var_os(var).is_none() {
                return bad(
                    "api_key_env",
                    format!("environment variable {var:?} is not set"),
                );
            }
        }
        Ok(())
    }

    /// `api` and `responses_chain`: MLPerf runs are defined on Chat Completions, and chaining
    /// is a Responses feature.
    fn validate_api(&self) -> Result<(), ConfigError> {
        use crate::wire::Api;
        if self.official_rules && self.api != Api::Chat {
            return Err(ConfigError::Invalid {
                field: "api",
                message: format!(
                    "official runs (official_rules = true) replay Chat Completions, got {:?} \
                     (use --api chat / api = \"chat\", or official_rules = false)",
                    self.api.as_str()
                ),
            });
        }
        if self.responses_chain && self.api != Api::Responses {
            return Err(ConfigError::Invalid {
                field: "responses_chain",
                message: format!(
                    "chains Responses turns, so it needs api = \"responses\", got {:?}",
                    self.api.as_str()
                ),
            });
        }
        Ok(())
    }

    /// The model parameters in force: `[model_params]`, else the preset, else defaults; the
    /// `model_name` override applies last.
    pub fn resolved_model_params(&self) -> crate::dataset::ModelParams {
        let mut params = self
            .model_params
            .clone()
            .or_else(|| {
                self.model
                    .as_deref()
                    .and_then(crate::dataset::ModelParams::preset)
            })
            .unwrap_or_default();
        if let Some(name) = &self.model_name {
            params.name = name.clone();
        }
        params
    }

    /// The API key, read from the named environment variable (never stored in the config).
    pub(crate) fn api_key(&self) -> Option<String> {
        self.api_key_env
            .as_deref()
            .and_then(|var| std::env::var(var).ok())
    }
}
