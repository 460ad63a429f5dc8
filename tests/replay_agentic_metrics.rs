//! One replay against the simulator reports every agentic metric under its owner's name, in
//! `result_summary.json` and `report.txt`, consistent with the run's own counts; the hand-worked
//! formulas are unit tests in `src/replay/owners/tests.rs`.

mod support;

use agentrace::replay::{self, slo::Slo};
use agentrace::sim::{self, SimConfig};
use serde_json::Value;
use support::replay::{config, conversation, dataset, no_shutdown};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_agentic_metric_is_reported_under_its_owner_and_agrees_with_the_run() {
    let mut sim_cfg = SimConfig::from_profile(sim::DEFAULT_PROFILE).unwrap();
    sim_cfg.time_scale = 0.02;
    sim_cfg.responder.output_tokens_min = 8;
    sim_cfg.responder.output_tokens_max = 40;
    let (trigger, shutdown) = agentrace::shutdown::channel();
    let cluster = sim::start(sim_cfg, "127.0.0.1:0".parse().unwrap(), 1, shutdown).unwrap();
    let url = format!("http://{}", cluster.addrs()[0]);
    let ds = dataset(
        (0..6)
            .map(|i| conversation(&format!("agent{i}"), 3, &[], "ls"))
            .collect(),
    );
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut c = config(&url, 2);
    c.slo = Some(Slo::parse("ttft_p90=60s,interactivity=0.001").unwrap());
    c.gpus = Some(4);
    let s = replay::run(c, ds, &out, no_shutdown()).await.unwrap();
    trigger.fire();
    cluster.join().await;
    assert_eq!(s.turns_ok, 18);

    let doc: Value =
        serde_json::from_slice(&std::fs::read(out.join("result_summary.json")).unwrap()).unwrap();
    let a = &doc["agentic_metrics"];
    let m = &doc["metrics"];
    for section in [
        "mlperf_endpoints_v1_0",
        "inferencex_aiperf",
        "trtllm_jobs",
        "goodput",
        "coordinated_omission",
        "session_outcomes",
        "prefix_cache",
    ] {
        assert!(
            a[section]["definition"]
                .as_str()
                .is_some_and(|d| !d.is_empty()),
            "{section} has no definition: {a}"
        );
    }
    let ml = &a["mlperf_endpoints_v1_0"];
    assert_eq!(ml["e2e_avg_interactivity"], m["e2e_interactivity"]);
    assert_eq!(ml["trajectories_in_dataset_multiples"], 1.0);
    // Every agent finished, each an outcome; a tier every turn meets passes them all.
    let o = &a["session_outcomes"];
    assert_eq!(
        (
            o["completed"].as_u64(),
            o["failed"].as_u64(),
            o["truncated"].as_u64()
        ),
        (Some(6), Some(0), Some(0))
    );
    // Tracking stops when the first user finds nothing left to start, so the other user's
    // last turns may fall outside the window: goodput counts the tracked ones.
    let g = &a["goodput"];
    let tracked = m["turns"]["tracked_issued"].as_u64().unwrap();
    assert_eq!(g["turns"].as_u64(), Some(tracked));
    assert_eq!(g["turns_meeting"].as_u64(), Some(tracked));
    let agents = g["agents"].as_u64().unwrap();
    assert!(agents >= 5, "{g}");
    assert_eq!(g["agents_meeting"].as_u64(), Some(agents));
    let jobs = &a["trtllm_jobs"];
    let per_user = jobs["jobs_per_hour_per_user"].as_f64().unwrap();
    let per_gpu = jobs["jobs_per_hour_per_gpu"].as_f64().unwrap();
    assert!(per_user > 0.0 && (per_gpu - per_user * 2.0 / 4.0).abs() < 1e-6 * per_user);
    let ix = &a["inferencex_aiperf"];
    assert_eq!(ix["requests"], m["turns"]["tracked_ok"]);
    assert!(ix["e2e_normalized_interactivity_p90"].as_f64().unwrap() > 0.0);
    // Three turns each, each prompt extending the last: a perfect cache reuses some of it.
    let optimum = a["prefix_cache"]["optimum_hit"].as_f64().unwrap();
    assert!(optimum > 0.0 && optimum < 1.0, "{optimum}");
    let co = &a["coordinated_omission"];
    assert!(
        co["latency_from_scheduled_start_ms"]["p50"]
            .as_f64()
            .unwrap()
            >= co["latency_ms"]["p50"].as_f64().unwrap()
    );

    let text = std::fs::read_to_string(out.join("report.txt")).unwrap();
    for owner in [
        "MLPerf Endpoints v1.0",
        "InferenceX / AIPerf",
        "TensorRT-LLM jobs",
        "goodput (ttft_p90=60000ms,interactivity=0.001)  agents",
        "coordinated omission corrected",
        "completed 6 failed 0 truncated 0",
        "prefix cache",
    ] {
        assert!(text.contains(owner), "report.txt lacks {owner:?}:\n{text}");
    }
}
