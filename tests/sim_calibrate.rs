//! `agentrace sim calibrate` measured against the simulator itself, whose cost model is known:
//! the profile it writes gives back the parameters the simulator ran with, within the
//! tolerances stated here, and `agentrace sim --profile FILE` reads that profile.
//!
//! Tolerances (the machine is shared, so timing is noisy): TTFT base (overhead + step cost)
//! within 25 % or 3 ms, prefill per token within 15 %, decode per sequence within 20 %, the
//! fitted inter-token time at the largest batch within 15 %.

mod support;

use agentrace::sim::{profile, SimConfig};
use support::sim::Sim;

fn known() -> SimConfig {
    let mut cfg = SimConfig::default();
    let e = &mut cfg.engine;
    e.request_overhead_ms = 10.0;
    e.t_fixed_ms = 2.0;
    e.prefill_us_per_token = 100.0;
    e.attention_equal_context = 4_000.0;
    e.bandwidth_bytes_per_s = 1e12;
    e.dense_weight_bytes = 0.0;
    e.expert_weight_bytes = 0.0;
    e.kv_bytes_per_token = 1e6;
    e.decode_us_per_seq = 3_000.0;
    e.max_num_seqs = 4;
    cfg.responder.reasoning_ratio = 0.0;
    cfg
}

fn within(got: f64, want: f64, rel: f64, abs: f64) -> bool {
    (got - want).abs() <= (want.abs() * rel).max(abs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calibrating_a_sim_with_known_parameters_recovers_them() {
    let truth = known();
    let sim = Sim::start(truth.clone(), 1);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("profile.toml");
    let target = format!("http://{}", sim.addr(0));
    let status = {
        let out = out.clone();
        tokio::task::spawn_blocking(move || {
            std::process::Command::new(env!("CARGO_BIN_EXE_agentrace"))
                .args(["sim", "calibrate", "--target", &target, "--out"])
                .arg(&out)
                .args(["--max-prompt-tokens", "1024", "--max-batch", "4"])
                .args(["--max-requests", "40"])
                .stdout(std::process::Stdio::null())
                .status()
                .unwrap()
        })
        .await
        .unwrap()
    };
    sim.stop().await;
    assert!(status.success(), "sim calibrate failed: {status}");
    let text = std::fs::read_to_string(&out).unwrap();
    let got = profile::resolve(out.to_str().unwrap()).unwrap();
    let (g, t) = (&got.engine, &truth.engine);
    let cal = got.calibration.as_ref().expect("a calibration record");
    assert!(cal.requests <= 40 && cal.requests > 0, "{cal:?}");
    assert_eq!(cal.batch_max, 4, "{cal:?}");
    assert_eq!(
        g.num_gpu_blocks, t.num_gpu_blocks,
        "KV capacity read from /metrics"
    );

    let base = g.request_overhead_ms + g.t_fixed_ms;
    assert!(within(base, 12.0, 0.25, 3.0), "TTFT base {base} ms\n{text}");
    assert!(
        within(g.prefill_us_per_token, 100.0, 0.15, 0.0),
        "prefill {} µs/token\n{text}",
        g.prefill_us_per_token
    );
    assert!(
        within(g.decode_us_per_seq, 3_000.0, 0.20, 0.0),
        "decode {} µs/seq\n{text}",
        g.decode_us_per_seq
    );
    // ITL at batch 4 over 4 × 1 040 context tokens: 2 + 4 × 3 + 4 160 × 0.001 ms.
    let itl = |e: &agentrace::sim::SimConfig| {
        let e = &e.engine;
        e.t_fixed_ms
            + 4.0 * e.decode_us_per_seq / 1e3
            + 4_160.0 * e.kv_bytes_per_token / e.bandwidth_bytes_per_s * 1e3
            + e.dense_weight_bytes / e.bandwidth_bytes_per_s * 1e3
    };
    assert!(
        within(itl(&got), itl(&truth), 0.15, 0.0),
        "ITL at batch 4: {} ms, want {} ms\n{text}",
        itl(&got),
        itl(&truth)
    );
}
