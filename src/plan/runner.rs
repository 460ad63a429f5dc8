//! One combination (replicas × policy × KV size): simulated replicas with the profile behind
//! the real proxy, driven by the replayer, in this process; its result is kept in the output
//! directory with a hash of its inputs, so a rerun skips it unless something changed.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use anyhow::Context as _;
use serde::{Deserialize, Serialize};
use sha2::Digest as _;

use crate::dataset::Dataset;
use crate::proxy::{self, Policy, ProxyConfig};
use crate::replay::{self, ReplayConfig};
use crate::shutdown;
use crate::sim::{self, Oracle, SimConfig};

/// What one combination is.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Combination {
    /// Replicas behind the proxy.
    pub replicas: usize,
    /// Placement.
    pub policy: Policy,
    /// KV blocks per replica.
    pub kv_blocks: usize,
}

/// What one combination measured, in simulated time.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Outcome {
    /// Hash of every input; a stored outcome with another hash is rerun.
    pub inputs_sha256: String,
    /// Replicas.
    pub replicas: usize,
    /// Policy name.
    pub policy: String,
    /// KV blocks per replica.
    pub kv_blocks: usize,
    /// TTFT p50, ms.
    pub ttft_p50_ms: f64,
    /// TTFT p90, ms.
    pub ttft_p90_ms: f64,
    /// TTFT p99, ms.
    pub ttft_p99_ms: f64,
    /// TPOT p90, ms.
    pub tpot_p90_ms: f64,
    /// Σ output tokens / Σ turn time per user, tokens/s.
    pub interactivity: f64,
    /// Median user's output rate, tokens/s.
    pub user_tps_median: f64,
    /// Output tokens per second over all replicas.
    pub system_tps: f64,
    /// Cached prompt tokens over prompt tokens, from the replies' usage as the replay counts
    /// them: the figure a replay against real engines reports, so the two compare directly.
    pub prefix_cache_hit_rate: f64,
    /// Turns answered.
    pub turns_ok: u64,
    /// Turns failed.
    pub failures: u64,
    /// Preemptions on the replicas.
    pub preemptions: u64,
}

/// The hash of a combination's inputs.
pub(crate) fn inputs_hash(
    c: &Combination,
    profile: &SimConfig,
    dataset_sha256: &str,
    replay: &str,
) -> String {
    let mut h = sha2::Sha256::new();
    h.update(toml::to_string(profile).unwrap_or_default());
    h.update(dataset_sha256);
    h.update(replay);
    h.update(format!("{}|{:?}|{}", c.replicas, c.policy, c.kv_blocks));
    hex::encode(h.finalize())
}

/// The stored outcome of `dir` if its hash is `hash`.
pub(crate) fn stored(dir: &Path, hash: &str) -> Option<Outcome> {
    let text = std::fs::read_to_string(dir.join("outcome.json")).ok()?;
    let o: Outcome = serde_json::from_str(&text).ok()?;
    (o.inputs_sha256 == hash).then_some(o)
}

/// Settings every combination shares.
pub(crate) struct Shared {
    /// The profile.
    pub profile: SimConfig,
    /// The dataset.
    pub dataset: Arc<Dataset>,
    /// Recorded replies, so replies are as long as recorded.
    pub oracle: Arc<Oracle>,
    /// The replay's settings (target filled per run).
    pub replay: ReplayConfig,
}

/// Runs one combination into `dir` and stores its outcome there.
pub(crate) async fn run(
    c: &Combination,
    shared: &Shared,
    hash: String,
    dir: &Path,
) -> anyhow::Result<Outcome> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut cfg = shared.profile.clone();
    cfg.engine.num_gpu_blocks = c.kv_blocks;
    cfg.created_base_unix = Some(1_767_225_600);
    let (trigger, listener) = shutdown::channel();
    let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
    let sims = sim::start_with_oracle(
        cfg,
        loopback,
        c.replicas,
        listener.clone(),
        Some(shared.oracle.clone()),
    )?;
    let mut pcfg = ProxyConfig {
        listen: loopback,
        backends: sims
            .addrs()
            .iter()
            .enumerate()
            .map(|(i, addr)| proxy::config::BackendConfig {
                name: format!("sim-{i}"),
                url: format!("http://{addr}"),
                weight: 1.0,
            })
            .collect(),
        ..ProxyConfig::default()
    };
    pcfg.admin.listen = loopback;
    pcfg.affinity.policy = c.policy;
    let proxy = proxy::start(pcfg, listener).await?;
    let mut rcfg = shared.replay.clone();
    rcfg.target = format!("http://{}", proxy.addr).into();
    let (_never, replay_shutdown) = shutdown::channel();
    let summary = replay::run(rcfg, shared.dataset.clone(), dir, replay_shutdown).await;
    let stats = sims.stats();
    trigger.fire();
    proxy.join().await;
    sims.join().await;
    let s = summary.context("the replay failed")?;
    let k = shared.replay.time_scale;
    let hit_rate = cached_token_ratio(dir)?;
    let outcome = Outcome {
        inputs_sha256: hash,
        replicas: c.replicas,
        policy: super::config::policy_name(c.policy).to_string(),
        kv_blocks: c.kv_blocks,
        ttft_p50_ms: s.ttft_p50_ms / k,
        ttft_p90_ms: s.ttft_p90_ms / k,
        ttft_p99_ms: s.ttft_p99_ms / k,
        tpot_p90_ms: s.tpot_p90_ms / k,
        interactivity: s.e2e_interactivity * k,
        user_tps_median: s.user_tps_median * k,
        system_tps: s.system_tps * k,
        prefix_cache_hit_rate: hit_rate,
        turns_ok: s.turns_ok,
        failures: s.failures,
        preemptions: stats.iter().map(|r| r.preemptions).sum(),
    };
    std::fs::write(
        dir.join("outcome.json"),
        serde_json::to_vec_pretty(&outcome)?,
    )
    .with_context(|| format!("cannot write {}", dir.join("outcome.json").display()))?;
    Ok(outcome)
}

/// The replay's `cached_token_ratio` from the `result_summary.json` it wrote into `dir`
/// (0 when no reply reported prompt tokens).
fn cached_token_ratio(dir: &Path) -> anyhow::Result<f64> {
    let path = dir.join("result_summary.json");
    let text = std::fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let doc: serde_json::Value =
        serde_json::from_slice(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    Ok(doc["metrics"]["cached_token_ratio"].as_f64().unwrap_or(0.0))
}
