//! The agentic metrics the field uses, each under the name of whose definition it is: figures
//! that look alike differ threefold between owners (a p90 of per-turn rates against the
//! inverse of a p90 of per-token times), so none is reported without its owner and formula.
//!
//! Same turn filter as `replay::metrics` unless a section says otherwise: tracked (issued
//! inside the performance window), completed with a 200, not synthetic.

use std::collections::BTreeMap;

use serde::Serialize;

use super::metrics::{Metrics, Window};
use super::scheduler::{TrajectoryRecord, TurnKind, TurnRecord};
use super::slo::{Slo, TurnSample};
use crate::dataset::Dataset;

/// MLPerf Endpoints v1.0 (`mlcommons/endpoints`, the reference client and its policy).
#[derive(Debug, Clone, Serialize, Default)]
pub struct MlperfEndpoints {
    /// Whose definition, and the formula.
    pub definition: &'static str,
    /// Σ output tokens / Σ (COMPLETE − ISSUED) over every tracked completed turn: the time
    /// between turns (tool calls, injected delays) is not in any turn, so it is excluded.
    pub e2e_avg_interactivity: f64,
    /// p90 (lower method) of ISSUED → first non-empty content, reasoning or tool-call delta.
    pub ttft_p90_ms: f64,
    /// Σ tracked output tokens / (START → last tracked COMPLETE).
    pub system_tps: f64,
    /// Trajectories the run was to issue.
    pub trajectories_budget: u64,
    /// Conversations in the dataset.
    pub dataset_conversations: u64,
    /// Budget / dataset size: the policy counts trajectories in multiples of the dataset.
    pub trajectories_in_dataset_multiples: f64,
    /// When STOP_PERFORMANCE_TRACKING fired, as the reference client does.
    pub tracking_stop: &'static str,
}

/// InferenceX's E2E normalized interactivity on AIPerf's per-request records.
#[derive(Debug, Clone, Serialize, Default)]
pub struct InferencexAiperf {
    /// Whose definition, and the formula.
    pub definition: &'static str,
    /// 1 / p90(latency / OSL), request-weighted, numpy's linear percentile (tok/s/user).
    pub e2e_normalized_interactivity_p90: Option<f64>,
    /// The same at p75.
    pub e2e_normalized_interactivity_p75: Option<f64>,
    /// Requests (turns with OSL > 0) behind both.
    pub requests: u64,
}

/// TensorRT-LLM's job-level figures: a job is one agent task (a trajectory run to its end).
#[derive(Debug, Clone, Serialize, Default)]
pub struct TrtllmJobs {
    /// Whose definition, and the formula.
    pub definition: &'static str,
    /// Trajectories whose every turn succeeded and that finished inside the window.
    pub jobs_completed: u64,
    /// jobs_completed / window hours / concurrency.
    pub jobs_per_hour_per_user: f64,
    /// jobs_completed / window hours / GPUs; absent without `gpus`.
    pub jobs_per_hour_per_gpu: Option<f64>,
    /// GPUs serving the target, as given (`--gpus`); absent when not given.
    pub gpus: Option<u32>,
    /// Why a figure is absent, if one is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<&'static str>,
}

/// Goodput: the agents and turns meeting an SLO tier.
#[derive(Debug, Clone, Serialize, Default)]
pub struct Goodput {
    /// Whose definition, and the rule.
    pub definition: &'static str,
    /// The tier, normalised (`--slo`); absent when not given.
    pub slo: Option<String>,
    /// Agents (trajectories with a tracked turn).
    pub agents: u64,
    /// Of those, completed with every turn OK and meeting the tier over their tracked turns.
    pub agents_meeting: u64,
    /// agents_meeting / agents.
    pub agents_share: Option<f64>,
    /// Tracked turns (failed ones included: they meet nothing).
    pub turns: u64,
    /// Of those, completed and meeting the tier on their own.
    pub turns_meeting: u64,
    /// turns_meeting / turns.
    pub turns_share: Option<f64>,
    /// Why nothing is reported, if so.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<&'static str>,
}

/// Latency with and without coordinated omission.
#[derive(Debug, Clone, Serialize, Default)]
pub struct CoordinatedOmission {
    /// Whose definition, and the formula.
    pub definition: &'static str,
    /// COMPLETE − ISSUED, ms: p50, p90, p99.
    pub latency_ms: BTreeMap<&'static str, f64>,
    /// COMPLETE − scheduled start (previous last byte + delay), ms: p50, p90, p99.
    pub latency_from_scheduled_start_ms: BTreeMap<&'static str, f64>,
}

/// How each trajectory ended.
#[derive(Debug, Clone, Serialize, Default)]
pub struct SessionOutcomes {
    /// What each count means.
    pub definition: &'static str,
    /// Every turn completed with a 200.
    pub completed: u64,
    /// A turn failed (its remaining turns were aborted).
    pub failed: u64,
    /// Cut short without a failure: issuing stopped, the run's duration ran out, or shutdown.
    pub truncated: u64,
}

/// Prefix-cache hit against what a perfect cache could reach.
#[derive(Debug, Clone, Serialize, Default)]
pub struct PrefixCache {
    /// Whose definition, and the formula.
    pub definition: &'static str,
    /// Share of prompt bytes of every dataset turn that the previous turn's prompt covers.
    pub optimum_hit: Option<f64>,
    /// Σ cached prompt tokens / Σ prompt tokens as the server's usage reported them.
    pub measured_hit: Option<f64>,
    /// Where `measured_hit` came from, or why it is absent.
    pub measured_source: &'static str,
}

/// Every section, one per owner.
#[derive(Debug, Clone, Serialize, Default)]
pub struct ByOwner {
    /// MLPerf Endpoints v1.0.
    pub mlperf_endpoints_v1_0: MlperfEndpoints,
    /// InferenceX / AIPerf.
    pub inferencex_aiperf: InferencexAiperf,
    /// TensorRT-LLM job-level.
    pub trtllm_jobs: TrtllmJobs,
    /// Goodput under `--slo`.
    pub goodput: Goodput,
    /// Coordinated-omission-corrected latency.
    pub coordinated_omission: CoordinatedOmission,
    /// Session outcomes.
    pub session_outcomes: SessionOutcomes,
    /// Prefix-cache hit against the optimum.
    pub prefix_cache: PrefixCache,
}

/// What the sections need beyond the window.
pub(crate) struct Context<'a> {
    /// The dataset replayed.
    pub dataset: &'a Dataset,
    /// Trajectories the run was to issue.
    pub budget: u64,
    /// `--slo`.
    pub slo: Option<&'a Slo>,
    /// `--gpus`.
    pub gpus: Option<u32>,
}

/// `np.percentile(values, p)` with numpy's default linear interpolation, on sorted values.
pub(crate) fn percentile_linear(sorted: &[f64], p: f64) -> Option<f64> {
    let last = sorted.len().checked_sub(1)?;
    let rank = p / 100.0 * last as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    Some(sorted[lo] + (sorted[hi.min(last)] - sorted[lo]) * (rank - lo as f64))
}

/// Computes every section.
pub(crate) fn compute(w: &Window<'_>, m: &Metrics, cx: &Context<'_>) -> ByOwner {
    let good: Vec<&TurnRecord> = w
        .turns
        .iter()
        .filter(|t| t.tracked && t.kind == TurnKind::Ok)
        .collect();
    let n = cx.dataset.conversations.len() as u64;
    ByOwner {
        mlperf_endpoints_v1_0: MlperfEndpoints {
            definition: "MLPerf Endpoints v1.0 (mlcommons/endpoints): e2e_avg_interactivity = Σ OSL / Σ (COMPLETE − ISSUED) over tracked completed turns (tool time lies between turns, so it is excluded); ttft from the first non-empty content, reasoning or tool-call delta, p90 by the lower method; system_tps = Σ OSL / tracked duration",
            e2e_avg_interactivity: m.e2e_interactivity,
            ttft_p90_ms: m.ttft_p90_ms,
            system_tps: m.system_tps,
            trajectories_budget: cx.budget,
            dataset_conversations: n,
            trajectories_in_dataset_multiples: if n > 0 {
                cx.budget as f64 / n as f64
            } else {
                0.0
            },
            tracking_stop: "when the budget is exhausted and a user finishes its trajectory (the first user to find nothing left to start), as the reference client",
        },
        inferencex_aiperf: inferencex(&good),
        trtllm_jobs: trtllm(w, m, cx.gpus),
        goodput: goodput(w, cx.slo),
        coordinated_omission: coordinated_omission(m),
        session_outcomes: outcomes(w.trajectories),
        prefix_cache: PrefixCache {
            definition: "optimum: Σ over every dataset turn of the bytes of the previous turn's prompt (which a cache that kept every earlier prefix holds) / Σ prompt bytes, from the dataset alone; measured: Σ usage cached tokens / Σ prompt tokens",
            optimum_hit: prefix_optimum(cx.dataset),
            measured_hit: m.cached_token_ratio,
            measured_source: if m.cached_token_ratio.is_some() {
                "server usage: prompt_tokens_details.cached_tokens"
            } else {
                "absent: the server reported no cached tokens in usage"
            },
        },
    }
}

fn inferencex(good: &[&TurnRecord]) -> InferencexAiperf {
    let mut per_token: Vec<f64> = good
        .iter()
        .filter(|t| t.output_tokens > 0)
        .map(|t| (t.complete_ns - t.issued_ns) as f64 / 1e9 / t.output_tokens as f64)
        .collect();
    per_token.sort_by(|a, b| a.total_cmp(b));
    let inv = |p| {
        percentile_linear(&per_token, p)
            .filter(|v| *v > 0.0)
            .map(|v| 1.0 / v)
    };
    InferencexAiperf {
        definition: "InferenceX on AIPerf records: 1 / percentile(E2E request latency / OSL) over turns with OSL > 0, request-weighted, numpy linear interpolation",
        e2e_normalized_interactivity_p90: inv(90.0),
        e2e_normalized_interactivity_p75: inv(75.0),
        requests: per_token.len() as u64,
    }
}

fn trtllm(w: &Window<'_>, m: &Metrics, gpus: Option<u32>) -> TrtllmJobs {
    let end = w.start_ns + m.tracked_duration_ns;
    let jobs = w
        .trajectories
        .iter()
        .filter(|t| t.completed && t.end_ns > w.start_ns && t.end_ns <= end)
        .count() as u64;
    let hours = m.tracked_duration_ns as f64 / 3.6e12;
    let per_hour = if hours > 0.0 {
        jobs as f64 / hours
    } else {
        0.0
    };
    TrtllmJobs {
        definition: "TensorRT-LLM job-level: a job is a trajectory completed inside the window; jobs per hour / concurrency, and / GPUs",
        jobs_completed: jobs,
        jobs_per_hour_per_user: per_hour / w.concurrency.max(1) as f64,
        jobs_per_hour_per_gpu: gpus.map(|g| per_hour / f64::from(g.max(1))),
        gpus,
        note: gpus
            .is_none()
            .then_some("jobs_per_hour_per_gpu needs --gpus N (gpus in the config)"),
    }
}

fn sample(t: &TurnRecord) -> TurnSample {
    TurnSample {
        ttft_s: t
            .first_token_ns
            .map(|f| f.saturating_sub(t.issued_ns) as f64 / 1e9),
        tpot_s: match (t.first_token_ns, t.output_tokens) {
            (Some(f), n) if n > 1 => {
                Some(t.complete_ns.saturating_sub(f) as f64 / 1e9 / (n - 1) as f64)
            }
            _ => None,
        },
        latency_s: (t.complete_ns - t.issued_ns) as f64 / 1e9,
        output_tokens: t.output_tokens,
    }
}

fn goodput(w: &Window<'_>, slo: Option<&Slo>) -> Goodput {
    let definition = "an agent meets the tier when its trajectory completed and its tracked turns meet every term (percentiles over its turns, interactivity pooled); a turn meets it on its own figures";
    let Some(slo) = slo else {
        return Goodput {
            definition,
            note: Some("no SLO given (--slo, e.g. ttft_p90=2s,interactivity=30)"),
            ..Default::default()
        };
    };
    let mut agents: BTreeMap<u64, Vec<TurnSample>> = BTreeMap::new();
    let (mut turns, mut turns_meeting) = (0u64, 0u64);
    for t in w.turns.iter().filter(|t| t.tracked) {
        turns += 1;
        let samples = agents.entry(t.instance).or_default();
        if t.kind == TurnKind::Ok {
            let s = sample(t);
            turns_meeting += u64::from(slo.turn_meets(&s));
            samples.push(s);
        }
    }
    let completed: std::collections::HashSet<u64> = w
        .trajectories
        .iter()
        .filter(|t| t.completed)
        .map(|t| t.instance)
        .collect();
    let agents_meeting = agents
        .iter()
        .filter(|(k, s)| completed.contains(k) && slo.agent_meets(s))
        .count() as u64;
    let share = |a: u64, b: u64| (b > 0).then(|| a as f64 / b as f64);
    Goodput {
        definition,
        slo: Some(slo.to_string()),
        agents: agents.len() as u64,
        agents_meeting,
        agents_share: share(agents_meeting, agents.len() as u64),
        turns,
        turns_meeting,
        turns_share: share(turns_meeting, turns),
        note: None,
    }
}

fn coordinated_omission(m: &Metrics) -> CoordinatedOmission {
    let grid = |s: &Option<super::metrics::Series>| {
        [("p50", "50.0"), ("p90", "90.0"), ("p99", "99.0")]
            .into_iter()
            .filter_map(|(k, p)| s.as_ref().map(|s| (k, s.p(p) / 1e6)))
            .collect()
    };
    CoordinatedOmission {
        definition: "uncorrected: COMPLETE − ISSUED; corrected: COMPLETE − scheduled start (previous turn's last byte + its delay), so a late send counts against the server's queue rather than vanishing",
        latency_ms: grid(&m.latency),
        latency_from_scheduled_start_ms: grid(&m.latency_from_intended),
    }
}

fn outcomes(trajectories: &[TrajectoryRecord]) -> SessionOutcomes {
    let mut o = SessionOutcomes {
        definition: "completed: every turn OK; truncated: turns left unissued without a failure (issuing stopped, max duration, shutdown); failed: a turn failed",
        ..Default::default()
    };
    for t in trajectories {
        if t.completed {
            o.completed += 1;
        } else if t.turns_unissued > 0 {
            o.truncated += 1;
        } else {
            o.failed += 1;
        }
    }
    o
}

/// Each turn's prompt is its conversation's history up to `history_len`, so the previous
/// turn's prompt is the longest prefix an earlier turn left; a first turn reuses nothing.
/// Bytes of the messages stand in for tokens (a ratio, so the unit cancels).
fn prefix_optimum(dataset: &Dataset) -> Option<f64> {
    let (mut reusable, mut total) = (0u64, 0u64);
    for conv in &dataset.conversations {
        let mut prefix = vec![0u64; conv.messages.len() + 1];
        for (i, m) in conv.messages.iter().enumerate() {
            prefix[i + 1] = prefix[i] + m.wire.get().len() as u64;
        }
        let mut previous = 0usize;
        for turn in &conv.client_turns {
            let len = turn.history_len.min(conv.messages.len());
            total += prefix[len];
            reusable += prefix[previous.min(len)];
            previous = len;
        }
    }
    (total > 0).then(|| reusable as f64 / total as f64)
}

/// `turns.jsonl`: one line per turn with the figures every section above is computed from,
/// so another tool can recompute any of them from the same records.
pub(crate) fn write_turn_records(
    path: &std::path::Path,
    turns: &[TurnRecord],
) -> std::io::Result<()> {
    use std::io::Write as _;
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    for t in turns {
        let line = serde_json::json!({
            "instance": t.instance,
            "slot": t.slot,
            "kind": t.kind.as_str(),
            "tracked": t.tracked,
            "scheduled_ns": t.intended_ns,
            "issued_ns": t.issued_ns,
            "first_token_ns": t.first_token_ns,
            "complete_ns": t.complete_ns,
            "output_tokens": t.output_tokens,
            "prompt_tokens": t.prompt_tokens,
            "cached_tokens": t.cached_tokens,
        });
        serde_json::to_writer(&mut out, &line)?;
        out.write_all(b"\n")?;
    }
    out.flush()
}

#[cfg(test)]
mod tests;
