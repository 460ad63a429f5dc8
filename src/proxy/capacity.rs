//! How many tokens a backend's KV cache holds, read from the engine's own API after its first
//! good health probe. Bounded load uses it to tell a backend that queues but holds its sessions
//! (a spill would only cost a cache) from one whose sessions outgrew its memory.
//!
//! Each engine states it somewhere else, so a backend is asked at [`KV_PATHS`] in turn until
//! one answer states it:
//! - vLLM (and the simulator): `/metrics`, `vllm:cache_config_info{num_gpu_blocks, block_size}`;
//! - SGLang: `/metrics`, the `sglang:max_total_num_tokens` gauge (with `--enable-metrics`), else
//!   `/get_server_info`, `max_total_num_tokens` per data-parallel rank, times `dp_size`;
//! - llama.cpp `llama-server`: `/props`, `default_generation_settings.n_ctx` (context per
//!   slot) times `total_slots`, else `/slots` (each slot's `n_ctx`, summed). The server does not
//!   say whether its slots share one unified cache (`--kv-unified`, its default when
//!   `--parallel` is not given); then this overstates the cache by the number of slots, which
//!   errs towards keeping a session where its prefix is rather than moving it;
//! - TensorRT-LLM `trtllm-serve`: `/metrics`, a JSON list of iteration statistics whose
//!   `kvCacheStats` give `maxNumBlocks` and `tokensPerBlock`. It lists only iterations run
//!   since it was last read, and only with `enable_iter_perf_stats`; an empty list is asked
//!   again at the next probe. It states no size anywhere else.
//!
//! A path that answers without a size (404, 501, another engine's shape) is not asked again;
//! one that fails (5xx, no answer in time) is, for at most [`MAX_FAILED_ROUNDS`] rounds.

use std::sync::atomic::{AtomicU8, Ordering};

use serde::Deserialize;

/// Where each engine states its KV cache size, in the order they are asked.
pub(crate) const KV_PATHS: [&str; 4] = ["/metrics", "/get_server_info", "/props", "/slots"];

/// The most of one answer read: vLLM's `/metrics` is a few hundred KiB, llama-server's `/props`
/// tens of KiB (its chat template).
pub(crate) const MAX_ANSWER_BYTES: usize = 4 << 20;

/// Rounds with a failed answer after which a backend's size is taken as unknown: a path that
/// keeps failing would otherwise be asked at every health probe for ever.
pub(crate) const MAX_FAILED_ROUNDS: u8 = 5;

/// Which answer stated a backend's KV cache size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum KvSource {
    /// vLLM's `vllm:cache_config_info` on `/metrics`.
    VllmCacheConfig = 1,
    /// SGLang's `sglang:max_total_num_tokens` on `/metrics`.
    SglangMetrics = 2,
    /// SGLang's `/get_server_info`.
    SglangServerInfo = 3,
    /// llama-server's `/props`.
    LlamaProps = 4,
    /// llama-server's `/slots`.
    LlamaSlots = 5,
    /// trtllm-serve's `kvCacheStats` on `/metrics`.
    TrtllmStats = 6,
}

impl KvSource {
    const ALL: [KvSource; 6] = [
        KvSource::VllmCacheConfig,
        KvSource::SglangMetrics,
        KvSource::SglangServerInfo,
        KvSource::LlamaProps,
        KvSource::LlamaSlots,
        KvSource::TrtllmStats,
    ];

    /// What `/admin/backends` and the log call it.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            KvSource::VllmCacheConfig => "vllm /metrics cache_config_info",
            KvSource::SglangMetrics => "sglang /metrics max_total_num_tokens",
            KvSource::SglangServerInfo => "sglang /get_server_info",
            KvSource::LlamaProps => "llama.cpp /props",
            KvSource::LlamaSlots => "llama.cpp /slots",
            KvSource::TrtllmStats => "trtllm /metrics kvCacheStats",
        }
    }
}

/// What one answer says about the size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reading {
    /// The cache holds this many tokens.
    Size(u64, KvSource),
    /// Nothing, and asking again would not change that.
    Silent,
    /// Not yet: the engine states it only after it has run (trtllm-serve's empty list).
    NotYet,
}

/// The size that the 2xx answer `body` of `KV_PATHS[path]` states, if any.
pub(crate) fn read(path: usize, body: &[u8]) -> Reading {
    match KV_PATHS.get(path).copied() {
        Some("/metrics") if body.trim_ascii_start().starts_with(b"[") => trtllm_stats(body),
        Some("/metrics") => prometheus(&String::from_utf8_lossy(body)),
        Some("/get_server_info") => sglang_server_info(body),
        Some("/props") => llama_props(body),
        Some("/slots") => llama_slots(body),
        _ => Reading::Silent,
    }
}

/// A whole, positive token count, or nothing.
fn size(tokens: Option<u64>, source: KvSource) -> Reading {
    match tokens {
        Some(t) if t > 0 => Reading::Size(t, source),
        _ => Reading::Silent,
    }
}

/// vLLM's and SGLang's Prometheus text.
fn prometheus(text: &str) -> Reading {
    let mut sglang = SglangRanks::default();
    for line in text.lines() {
        if let Some(labels) = line.strip_prefix("vllm:cache_config_info{") {
            let tokens = label(labels, "num_gpu_blocks")
                .and_then(|blocks| blocks.checked_mul(label(labels, "block_size")?));
            return size(tokens, KvSource::VllmCacheConfig);
        }
        if let Some(rest) = line.strip_prefix("sglang:max_total_num_tokens") {
            if !sglang.add(rest) {
                return Reading::Silent;
            }
        }
    }
    size(sglang.total(), KvSource::SglangMetrics)
}

/// More data-parallel ranks than any server runs.
const MAX_RANKS: usize = 1024;

/// SGLang's gauge, one sample per scheduler: tensor-parallel ranks share a pool and repeat its
/// size, each data-parallel rank (`dp_rank`) has a pool of its own.
#[derive(Default)]
struct SglangRanks {
    /// (dp_rank label, largest size seen for it); a handful at most.
    ranks: Vec<(String, u64)>,
}

impl SglangRanks {
    /// Takes one sample (`{labels} value` or ` value`); false when it is malformed.
    fn add(&mut self, rest: &str) -> bool {
        let (labels, value) = match rest.strip_prefix('{') {
            Some(r) => match r.rsplit_once('}') {
                Some((labels, value)) => (labels, value),
                None => return false,
            },
            None if rest.starts_with(' ') => ("", rest),
            // Another metric whose name starts alike.
            None => return true,
        };
        let Some(tokens) = whole_tokens(value) else {
            return false;
        };
        let rank = label_text(labels, "dp_rank").unwrap_or("");
        if let Some((_, t)) = self.ranks.iter_mut().find(|(r, _)| r == rank) {
            *t = (*t).max(tokens);
            return true;
        }
        // Bounded by what a server could have: a flood of ranks states nothing.
        if self.ranks.len() >= MAX_RANKS {
            return false;
        }
        self.ranks.push((rank.to_string(), tokens));
        true
    }

    fn total(&self) -> Option<u64> {
        if self.ranks.is_empty() {
            return None;
        }
        self.ranks
            .iter()
            .try_fold(0u64, |sum, (_, t)| sum.checked_add(*t))
    }
}

/// A sample value (` 123456.0`, maybe followed by a timestamp) as a whole token count ≥ 1.
fn whole_tokens(value: &str) -> Option<u64> {
    let v = value.split_whitespace().next()?.parse::<f64>().ok()?;
    (v >= 1.0 && v < u64::MAX as f64).then_some(v as u64)
}

/// The value of label `name` in a sample's label set (`a="1",b="2"`).
fn label_text<'a>(labels: &'a str, name: &str) -> Option<&'a str> {
    let at = labels
        .match_indices(&format!("{name}=\""))
        .find(|(i, _)| *i == 0 || labels.as_bytes()[i - 1] == b',')?
        .0
        + name.len()
        + 2;
    let value = &labels[at..];
    Some(&value[..value.find('"')?])
}

/// The whole-number value of label `name`.
fn label(labels: &str, name: &str) -> Option<u64> {
    label_text(labels, name)?.parse().ok()
}

/// SGLang's `/get_server_info`: its server arguments, its scheduler's figures and more, in one
/// object.
fn sglang_server_info(body: &[u8]) -> Reading {
    #[derive(Deserialize)]
    struct Info {
        max_total_num_tokens: Option<u64>,
        dp_size: Option<u64>,
    }
    let Ok(info) = serde_json::from_slice::<Info>(body) else {
        return Reading::Silent;
    };
    let ranks = info.dp_size.unwrap_or(1).max(1);
    let tokens = info.max_total_num_tokens.and_then(|t| t.checked_mul(ranks));
    size(tokens, KvSource::SglangServerInfo)
}

/// llama-server's `/props`: the context of one slot and the number of slots.
fn llama_props(body: &[u8]) -> Reading {
    #[derive(Deserialize)]
    struct Props {
        default_generation_settings: Option<Settings>,
        total_slots: Option<u64>,
    }
    #[derive(Deserialize)]
    struct Settings {
        n_ctx: Option<u64>,
    }
    let Ok(props) = serde_json::from_slice::<Props>(body) else {
        return Reading::Silent;
    };
    let per_slot = props.default_generation_settings.and_then(|s| s.n_ctx);
    let tokens = per_slot.and_then(|n| n.checked_mul(props.total_slots?));
    size(tokens, KvSource::LlamaProps)
}

/// llama-server's `/slots`: one object per slot, each with its context.
fn llama_slots(body: &[u8]) -> Reading {
    #[derive(Deserialize)]
    struct Slot {
        n_ctx: u64,
    }
    let Ok(slots) = serde_json::from_slice::<Vec<Slot>>(body) else {
        return Reading::Silent;
    };
    let tokens = slots
        .iter()
        .try_fold(0u64, |sum, s| sum.checked_add(s.n_ctx));
    size(tokens, KvSource::LlamaSlots)
}

/// trtllm-serve's `/metrics`: the iteration statistics gathered since the last read.
fn trtllm_stats(body: &[u8]) -> Reading {
    #[derive(Deserialize)]
    struct Iteration {
        #[serde(rename = "kvCacheStats")]
        kv_cache_stats: Option<KvStats>,
    }
    #[derive(Deserialize)]
    struct KvStats {
        #[serde(rename = "maxNumBlocks")]
        max_num_blocks: Option<u64>,
        #[serde(rename = "tokensPerBlock")]
        tokens_per_block: Option<u64>,
    }
    let Ok(iterations) = serde_json::from_slice::<Vec<Iteration>>(body) else {
        return Reading::Silent;
    };
    if iterations.is_empty() {
        return Reading::NotYet;
    }
    let tokens = iterations
        .iter()
        .rev()
        .filter_map(|i| i.kv_cache_stats.as_ref())
        .find_map(|s| s.max_num_blocks?.checked_mul(s.tokens_per_block?));
    size(tokens, KvSource::TrtllmStats)
}

/// How far the proxy got learning one backend's size; only its health checker writes it.
#[derive(Debug, Default)]
pub(crate) struct KvSizeState {
    /// 0 while asking, [`UNKNOWN`] when every path answered without a size or asking gave up,
    /// else the [`KvSource`] that stated it.
    settled: AtomicU8,
    /// Bit `i` set: `KV_PATHS[i]` answered without a size, and is not asked again.
    silent: AtomicU8,
    /// Rounds in which a path failed.
    failed_rounds: AtomicU8,
}

const UNKNOWN: u8 = u8::MAX;

/// What `/admin/backends` shows while a backend is still being asked.
const PENDING: &str = "pending";

impl KvSizeState {
    /// Whether the size is still to be learnt.
    pub(crate) fn asking(&self) -> bool {
        self.settled.load(Ordering::Relaxed) == 0
    }

    /// Whether `KV_PATHS[path]` is worth asking this round.
    pub(crate) fn ask(&self, path: usize) -> bool {
        self.silent.load(Ordering::Relaxed) & (1 << path) == 0
    }

    /// `KV_PATHS[path]` answered without a size.
    pub(crate) fn silent(&self, path: usize) {
        self.silent.fetch_or(1 << path, Ordering::Relaxed);
    }

    /// `source` stated the size.
    pub(crate) fn stated(&self, source: KvSource) {
        self.settled.store(source as u8, Ordering::Relaxed);
    }

    /// A round ended without a size; `failed` when some path failed. True when the size is
    /// now taken as unknown (once per backend).
    pub(crate) fn round_ended(&self, failed: bool, not_yet: bool) -> bool {
        let give_up = if failed {
            self.failed_rounds.fetch_add(1, Ordering::Relaxed) + 1 >= MAX_FAILED_ROUNDS
        } else {
            !not_yet
        };
        give_up && self.settled.swap(UNKNOWN, Ordering::Relaxed) == 0
    }

    /// Where the size came from: a [`KvSource`], `unknown`, or `pending`.
    pub(crate) fn source(&self) -> &'static str {
        match self.settled.load(Ordering::Relaxed) {
            0 => PENDING,
            UNKNOWN => "unknown",
            n => KvSource::ALL
                .iter()
                .find(|s| **s as u8 == n)
                .map_or("unknown", |s| s.as_str()),
        }
    }
}

#[cfg(test)]
mod tests;
