//! Figures per endpoint when a replay spreads its conversations over several: how much work
//! each endpoint got and how it served it, with the run's own turn filters so that the
//! counts, tokens and rates add up to the run's totals.

use serde::Serialize;

use super::metrics::percentile_lower;
use super::scheduler::{TrajectoryRecord, TurnKind, TurnRecord};

/// One endpoint's share of a run.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct TargetFigures {
    /// The endpoint's URL.
    pub target: String,
    /// Trajectories started on it.
    pub trajectories: u64,
    /// Turns that completed with a 200, inside the window or after it (`turns.ok`).
    pub turns_completed: u64,
    /// Turns that failed or were aborted (`turns.failed`).
    pub turns_failed: u64,
    /// Tracked turns completed with a 200 (the turns every rate uses).
    pub turns_tracked: u64,
    /// Output tokens of the tracked turns.
    pub output_tokens: u64,
    /// `output_tokens` over the run's tracked duration: the endpoints' figures sum to
    /// `system_tps`.
    pub tokens_per_s: f64,
    /// TTFT p50 of the tracked turns (ms, lower method as the run's).
    pub ttft_p50_ms: Option<f64>,
    /// TTFT p90 (ms).
    pub ttft_p90_ms: Option<f64>,
}

/// The figures of every endpoint in `targets`, in their order.
pub(crate) fn compute(
    targets: &[String],
    turns: &[TurnRecord],
    trajectories: &[TrajectoryRecord],
    tracked_duration_ns: u64,
) -> Vec<TargetFigures> {
    let dur_s = tracked_duration_ns as f64 / 1e9;
    targets
        .iter()
        .enumerate()
        .map(|(i, url)| {
            let mine = |t: &&TurnRecord| t.target as usize == i;
            let mut ttft: Vec<f64> = Vec::new();
            let mut fig = TargetFigures {
                target: url.clone(),
                trajectories: trajectories
                    .iter()
                    .filter(|t| t.target as usize == i)
                    .count() as u64,
                turns_completed: 0,
                turns_failed: 0,
                turns_tracked: 0,
                output_tokens: 0,
                tokens_per_s: 0.0,
                ttft_p50_ms: None,
                ttft_p90_ms: None,
            };
            for t in turns.iter().filter(mine) {
                if t.kind != TurnKind::Ok {
                    fig.turns_failed += 1;
                    continue;
                }
                fig.turns_completed += 1;
                if t.tracked {
                    fig.turns_tracked += 1;
                    fig.output_tokens += t.output_tokens;
                    if let Some(f) = t.first_token_ns {
                        ttft.push(f.saturating_sub(t.issued_ns) as f64 / 1e6);
                    }
                }
            }
            if dur_s > 0.0 {
                fig.tokens_per_s = fig.output_tokens as f64 / dur_s;
            }
            if !ttft.is_empty() {
                ttft.sort_by(|a, b| a.total_cmp(b));
                fig.ttft_p50_ms = Some(percentile_lower(&ttft, 50.0));
                fig.ttft_p90_ms = Some(percentile_lower(&ttft, 90.0));
            }
            fig
        })
        .collect()
}
