//! `agentrace demo --quick` is the newcomer's first command and the suite runs it: with the
//! same trajectories and the same simulated replicas, session affinity must beat round-robin
//! on the prefix-cache hit rate by a clear margin, and every output file must exist and parse.

use std::path::Path;

use agentrace::dataset::synth::{write_file, SynthOptions};
use agentrace::demo::{run_into, DemoArgs};

fn quick_args(dataset: &Path, out: &Path) -> DemoArgs {
    DemoArgs {
        quick: true,
        replicas: 4,
        concurrency: None,
        trajectories: None,
        kv_tokens: None,
        time_scale: None,
        sweep: None,
        load_factor: 1.25,
        dataset: Some(dataset.to_path_buf()),
        out: out.to_path_buf(),
        no_progress: true,
    }
}

fn parse_json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quick_demo_shows_affinity_beating_round_robin_and_writes_every_output() {
    let tmp = tempfile::tempdir().unwrap();
    let dataset = tmp.path().join("set.jsonl.zst");
    write_file(
        &dataset,
        &SynthOptions {
            seed: 7,
            coding: 16,
            workflow: 16,
        },
    )
    .unwrap();
    let out = tmp.path().join("demo");
    let result = run_into(&quick_args(&dataset, &out), &out).await.unwrap();

    let [affinity, round_robin] = &result.runs[..] else {
        panic!("expected two runs, got {}", result.runs.len());
    };
    assert_eq!(affinity.label, "affinity");
    assert_eq!(round_robin.label, "round-robin");
    assert!(affinity.turns_ok > 0 && round_robin.turns_ok > 0);
    assert!(
        affinity.prefix_cache_hit_rate >= round_robin.prefix_cache_hit_rate + 0.15,
        "affinity hit rate {:.3} does not clearly beat round-robin {:.3}",
        affinity.prefix_cache_hit_rate,
        round_robin.prefix_cache_hit_rate
    );

    for run in ["affinity", "round-robin"] {
        let dir = out.join(run);
        for file in ["result_summary.json", "scores.json"] {
            parse_json(&dir.join(file));
        }
        let events = std::fs::read_to_string(dir.join("events.jsonl")).unwrap();
        assert!(events.lines().count() > 0);
        for line in events.lines() {
            serde_json::from_str::<serde_json::Value>(line).unwrap();
        }
        assert!(!std::fs::read_to_string(dir.join("report.txt"))
            .unwrap()
            .is_empty());
        let segments = std::fs::read_dir(dir.join("captures")).unwrap().count();
        assert!(segments > 0, "{run}: no capture segment written");
    }
    let demo = parse_json(&out.join("demo.json"));
    assert_eq!(demo["runs"].as_array().map(Vec::len), Some(2));
    assert!(demo["ratios"]["prefix-cache hit rate"].as_f64().unwrap() > 1.0);
    let svg = std::fs::read_to_string(out.join("pareto.svg")).unwrap();
    assert!(svg.contains("<svg") && svg.trim_end().ends_with("</svg>"));
    let html = std::fs::read_to_string(out.join("index.html")).unwrap();
    assert!(html.contains("prefix-cache hit rate") && html.contains("<svg"));

    // One time base on the page: the table's rates are the replays' wall-clock rates times the
    // time scale, and the embedded plot says it is in simulated time; the sweep's own plot,
    // beside its wall-clock reports, says wall clock.
    let scale = demo["plan"]["time_scale"].as_f64().unwrap();
    let wall = parse_json(&out.join("affinity").join("result_summary.json"));
    let wall_tps = wall["headline"]["system_tps"].as_f64().unwrap();
    assert!(
        (affinity.system_tps - wall_tps * scale).abs() <= 1e-6 * wall_tps.max(1.0),
        "page {} vs wall {wall_tps} x {scale}",
        affinity.system_tps
    );
    assert!(html.contains("Time base: simulated time"));
    assert!(svg.contains("output tokens/s, simulated time"), "{svg}");
    let sweep_svg = std::fs::read_to_string(out.join("sweep").join("pareto.svg")).unwrap();
    assert!(sweep_svg.contains("output tokens/s, wall clock"));
    // Where a verdict is shown, a failing gate is named with its value and rule.
    for run in &result.runs {
        let verdict = run
            .gates_verdict
            .as_deref()
            .expect("the Qwen preset has gates");
        assert!(
            verdict == "PASS" || verdict.starts_with("FAIL: ") && verdict.contains(" not "),
            "{verdict}"
        );
        let shown = verdict.replace('>', "&gt;").replace('<', "&lt;");
        assert!(
            html.contains(&format!("{} gates: {shown}", run.label)),
            "{verdict}"
        );
    }
    if !svg.contains("PASS") {
        assert!(
            svg.contains("fails: "),
            "a failing point without its reason: {svg}"
        );
    }
}
