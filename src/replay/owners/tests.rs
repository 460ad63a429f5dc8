//! One small run worked by hand; every figure below is checked against its owner's formula.
//!
//! Window opens at 1 s; two users (slots), times in seconds:
//!
//! | agent | turn | scheduled | sent | first token | last byte | OSL | prompt | cached |
//! |---|---|---|---|---|---|---|---|---|
//! | A (0) | 1 | 1.0 | 1.0 | 1.5 | 3.0 | 100 | 50 | 0 |
//! | A (0) | 2 | 4.0 | 4.5 | 5.0 | 6.5 | 50 | 100 | 80 |
//! | B (1) | 1 | 1.0 | 1.0 | 3.0 | 5.0 | 200 | 60 | 0 |
//! | B (1) | 2 | 6.0 | 6.0 | none | 7.0 | 0 | 90 | 0 |
//! | C (2) | 1 | 6.6 | 6.6 | - | 6.8 (HTTP 500) | - | - | - |
//!
//! D (3) never sent a turn: issuing stopped (2 turns unissued).
//! A and B completed (ending at 6.5 and 7.0), C failed, D truncated.
//! Latencies (last byte − sent): 2, 2, 4, 1; from the schedule: 2, 2.5, 4, 1.

use super::*;
use crate::dataset::{ClientTurn, Conversation, HistoryMessage, Role};
use crate::replay::metrics::{compute as compute_metrics, FailureReasons};
use crate::replay::scheduler::Finish;
use std::sync::Arc;

const S: u64 = 1_000_000_000;

fn ns(s: f64) -> u64 {
    (s * S as f64).round() as u64
}

#[allow(clippy::too_many_arguments)]
fn turn(
    instance: u64,
    slot: u32,
    scheduled: f64,
    sent: f64,
    first: Option<f64>,
    last: f64,
    osl: u64,
    prompt: u64,
    cached: u64,
) -> TurnRecord {
    TurnRecord {
        slot,
        instance,
        target: 0,
        kind: TurnKind::Ok,
        tracked: true,
        intended_ns: ns(scheduled),
        issued_ns: ns(sent),
        first_byte_ns: first.map(ns),
        first_token_ns: first.map(ns),
        complete_ns: ns(last),
        output_tokens: osl,
        prompt_tokens: prompt,
        cached_tokens: Some(cached),
        estimated: false,
        chunks: osl as u32,
        itl_ns: None,
        finish: Finish::Stop,
        streaming: true,
    }
}

fn traj(instance: u64, slot: u32, end: f64, completed: bool, unissued: u32) -> TrajectoryRecord {
    TrajectoryRecord {
        slot,
        instance,
        target: 0,
        start_ns: ns(1.0),
        end_ns: ns(end),
        completed,
        turns_sent: 2,
        turns_unissued: unissued,
    }
}

fn message(bytes: usize) -> HistoryMessage {
    // A JSON string of exactly `bytes` bytes, quotes included.
    let raw = format!("\"{}\"", "x".repeat(bytes - 2));
    HistoryMessage {
        role: Role::User,
        wire: serde_json::value::RawValue::from_string(raw).unwrap(),
    }
}

fn client_turn(turn: u32, history_len: usize) -> ClientTurn {
    ClientTurn {
        turn,
        history_len,
        delay_seconds: 0.0,
        overrides: Default::default(),
        expected: None,
    }
}

/// X: messages of 10, 20, 30 and 40 bytes; turn 1 sends the first two (30 bytes), turn 2
/// all four (100), of which turn 1's 30 were cached: 30 reusable of 130. Y: one turn of
/// one 10-byte message, nothing reusable. Optimum = 30 / 140.
fn dataset() -> Dataset {
    Dataset {
        path: "hand-worked.jsonl".into(),
        sha256: String::new(),
        conversations: vec![
            Arc::new(Conversation {
                id: "X".into(),
                messages: vec![message(10), message(20), message(30), message(40)],
                client_turns: vec![client_turn(1, 2), client_turn(3, 4)],
            }),
            Arc::new(Conversation {
                id: "Y".into(),
                messages: vec![message(10)],
                client_turns: vec![client_turn(1, 1)],
            }),
        ],
    }
}

fn run(slo: Option<&Slo>, gpus: Option<u32>) -> (Metrics, ByOwner) {
    let mut failed = turn(2, 0, 6.6, 6.6, None, 6.8, 0, 0, 0);
    failed.kind = TurnKind::HttpStatus;
    failed.cached_tokens = None;
    let turns = vec![
        turn(0, 0, 1.0, 1.0, Some(1.5), 3.0, 100, 50, 0),
        turn(1, 1, 1.0, 1.0, Some(3.0), 5.0, 200, 60, 0),
        turn(0, 0, 4.0, 4.5, Some(5.0), 6.5, 50, 100, 80),
        turn(1, 1, 6.0, 6.0, None, 7.0, 0, 90, 0),
        failed,
    ];
    let trajectories = vec![
        traj(0, 0, 6.5, true, 0),
        traj(1, 1, 7.0, true, 0),
        traj(2, 0, 6.8, false, 0),
        traj(3, 1, 7.0, false, 2),
    ];
    let reasons = FailureReasons::default();
    let w = Window {
        turns: &turns,
        trajectories: &trajectories,
        lags_ns: &[],
        start_ns: ns(1.0),
        stop_ns: Some(ns(7.0)),
        concurrency: 2,
        issued_after_stop: 0,
        failure_reasons: &reasons,
    };
    let m = compute_metrics(&w);
    let ds = dataset();
    let by = compute(
        &w,
        &m,
        &Context {
            dataset: &ds,
            budget: 4,
            slo,
            gpus,
        },
    );
    (m, by)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9 * b.abs().max(1.0)
}

#[test]
fn mlperf_interactivity_counts_every_completed_turns_time_even_with_no_output() {
    let (_, by) = run(None, None);
    let ml = &by.mlperf_endpoints_v1_0;
    // Σ OSL = 100 + 50 + 200 + 0 = 350 over Σ turn time 2 + 2 + 4 + 1 = 9 s (B's empty
    // second turn still took 1 s of the user's time).
    assert!(close(ml.e2e_avg_interactivity, 350.0 / 9.0), "{ml:?}");
    // TTFTs 0.5, 0.5, 2.0 (B2 sent nothing): lower p90 = index floor(0.9 · 2) = 1 → 500 ms.
    assert!(close(ml.ttft_p90_ms, 500.0), "{ml:?}");
    // 350 tokens over the window 1 s → 7 s (last tracked byte) = 6 s.
    assert!(close(ml.system_tps, 350.0 / 6.0), "{ml:?}");
    // Budget 4 over 2 conversations.
    assert_eq!(ml.trajectories_in_dataset_multiples, 2.0);
}

#[test]
fn inferencex_inverts_the_linear_p90_of_seconds_per_token() {
    let (_, by) = run(None, None);
    let ix = &by.inferencex_aiperf;
    // latency / OSL over OSL > 0: 2/100 = 0.02, 2/50 = 0.04, 4/200 = 0.02 → sorted
    // [0.02, 0.02, 0.04]. p90: rank 1.8 → 0.02 + 0.8 · 0.02 = 0.036 → 27.78 tok/s.
    // p75: rank 1.5 → 0.03 → 33.33. (The p90 of the rates 50, 25, 50 would say 50.)
    assert_eq!(ix.requests, 3);
    assert!(
        close(ix.e2e_normalized_interactivity_p90.unwrap(), 1.0 / 0.036),
        "{ix:?}"
    );
    assert!(
        close(ix.e2e_normalized_interactivity_p75.unwrap(), 1.0 / 0.03),
        "{ix:?}"
    );
}

#[test]
fn linear_percentile_matches_numpy_default() {
    // np.percentile([1, 2, 3, 4], 90) = 3.7; [10] → 10 at any p; [] → none.
    assert!(close(
        percentile_linear(&[1.0, 2.0, 3.0, 4.0], 90.0).unwrap(),
        3.7
    ));
    assert_eq!(percentile_linear(&[10.0], 75.0), Some(10.0));
    assert_eq!(percentile_linear(&[], 90.0), None);
}

#[test]
fn jobs_per_hour_count_trajectories_completed_inside_the_window() {
    let (_, by) = run(None, None);
    // A and B end at 6.5 and 7.0, inside 1 → 7 s: 2 jobs in 6 s = 1200 per hour, over 2
    // users = 600. No GPUs given: no per-GPU figure, and the reason why.
    assert_eq!(by.trtllm_jobs.jobs_completed, 2);
    assert!(close(by.trtllm_jobs.jobs_per_hour_per_user, 600.0));
    assert_eq!(by.trtllm_jobs.jobs_per_hour_per_gpu, None);
    assert!(by.trtllm_jobs.note.unwrap().contains("--gpus"));
    let (_, by) = run(None, Some(4));
    assert!(close(by.trtllm_jobs.jobs_per_hour_per_gpu.unwrap(), 300.0));
}

#[test]
fn goodput_counts_agents_and_turns_meeting_every_term() {
    let slo = Slo::parse("ttft_p90=1s,interactivity=30").unwrap();
    let (_, by) = run(Some(&slo), None);
    let g = &by.goodput;
    // Turns: A1 (TTFT 0.5, 50 tok/s) meets; A2 (25 tok/s), B1 (TTFT 2 s), B2 (no token)
    // and C1 (failed) do not: 1 of 5.
    assert_eq!((g.turns_meeting, g.turns), (1, 5), "{g:?}");
    // Agents: A (TTFTs 0.5, 0.5 → p90 0.5; 150 tokens / 4 s = 37.5) meets; B (TTFTs 2, ∞
    // → lower p90 = 2 s) does not; C failed. D sent nothing, so is no agent here: 1 of 3.
    assert_eq!((g.agents_meeting, g.agents), (1, 3), "{g:?}");
    assert_eq!(g.slo.as_deref(), Some("ttft_p90=1000ms,interactivity=30"));
    let (_, none) = run(None, None);
    assert!(none.goodput.note.is_some() && none.goodput.agents == 0);
}

#[test]
fn corrected_latency_counts_from_the_scheduled_start() {
    let (_, by) = run(None, None);
    let co = &by.coordinated_omission;
    // Sent → last byte sorted [1, 2, 2, 4]; lower p90 = index 2 → 2 s. From the schedule
    // [1, 2, 2.5, 4] (A2 was sent 0.5 s late): index 2 → 2.5 s.
    assert!(close(co.latency_ms["p90"], 2000.0), "{co:?}");
    assert!(
        close(co.latency_from_scheduled_start_ms["p90"], 2500.0),
        "{co:?}"
    );
    assert!(
        close(co.latency_from_scheduled_start_ms["p50"], 2000.0),
        "{co:?}"
    );
}

#[test]
fn every_trajectory_has_one_outcome() {
    let (_, by) = run(None, None);
    let o = &by.session_outcomes;
    assert_eq!((o.completed, o.failed, o.truncated), (2, 1, 1));
}

#[test]
fn prefix_optimum_is_the_previous_prompts_share_and_sits_beside_the_measured_hit() {
    let (_, by) = run(None, None);
    let p = &by.prefix_cache;
    assert!(close(p.optimum_hit.unwrap(), 30.0 / 140.0), "{p:?}");
    // usage: 80 cached of 50 + 100 + 60 + 90 = 300 prompt tokens.
    assert!(close(p.measured_hit.unwrap(), 80.0 / 300.0), "{p:?}");
}
