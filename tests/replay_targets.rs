//! `agentrace replay` with several `--target`s and no router in front: each conversation is
//! kept on one endpoint (the simulators' own request logs say where every turn went), both
//! endpoints get work, and the per-target figures of `report.txt` and `result_summary.json`
//! add up to the run's totals. A list of targets in the config is read and checked, and an
//! unreachable one of several is named before any dataset is generated.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use agentrace::replay::ReplayConfig;
use agentrace::sim::{self, SimCluster, SimConfig};
use serde_json::Value;
use support::dataset::{coding_conversation, write_rows};

/// One simulator on `127.0.0.1:0` that logs every finished request to `trace`.
fn start_sim(trace: &Path) -> (SimCluster, String, agentrace::shutdown::Trigger) {
    let mut cfg = SimConfig::from_profile(sim::DEFAULT_PROFILE).unwrap();
    cfg.time_scale = 0.01;
    cfg.created_base_unix = Some(0);
    cfg.responder.output_tokens_min = 8;
    cfg.responder.output_tokens_max = 40;
    cfg.trace_log = Some(trace.to_path_buf());
    let (trigger, shutdown) = agentrace::shutdown::channel();
    let cluster = sim::start(cfg, "127.0.0.1:0".parse().unwrap(), 1, shutdown).unwrap();
    let url = format!("http://{}", cluster.addrs()[0]);
    (cluster, url, trigger)
}

/// session id → requests the simulator finished for it.
fn sessions(trace: &Path) -> BTreeMap<String, u64> {
    let mut seen = BTreeMap::new();
    for line in std::fs::read_to_string(trace).unwrap().lines() {
        let v: Value = serde_json::from_str(line).unwrap();
        let session = v["session"].as_str().expect("session in trace").to_string();
        *seen.entry(session).or_default() += 1;
    }
    seen
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"))
}

// Two simulators, two `--target`s, six conversations of four turns: every conversation's
// turns all reached one simulator, conversation k the k-th mod 2, each simulator served
// three, and each target's figures (turns, tokens, rate) sum to the run's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_conversation_stays_on_one_target_and_per_target_figures_sum_to_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let (trace_a, trace_b) = (dir.path().join("a.jsonl"), dir.path().join("b.jsonl"));
    let (sim_a, url_a, stop_a) = start_sim(&trace_a);
    let (sim_b, url_b, stop_b) = start_sim(&trace_b);
    let rows: Vec<Value> = (0..6)
        .flat_map(|i| coding_conversation(&format!("c{i}"), 3))
        .collect();
    let dataset = write_rows(dir.path(), "d.jsonl", &rows);
    let out = dir.path().join("run");
    let run = tokio::process::Command::new(env!("CARGO_BIN_EXE_agentrace"))
        .args(["replay", "--no-progress", "--delays", "false"])
        .args(["--concurrency", "3", "--target", &url_a, "--target", &url_b])
        .arg("--dataset")
        .arg(&dataset)
        .arg("--out")
        .arg(&out)
        .kill_on_drop(true)
        .output();
    let run = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("replay did not finish")
        .unwrap();
    // Stopping the simulators flushes their logs.
    stop_a.fire();
    stop_b.fire();
    sim_a.join().await;
    sim_b.join().await;
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&run.stderr)
    );

    let (a, b) = (sessions(&trace_a), sessions(&trace_b));
    let keys = |m: &BTreeMap<String, u64>| m.keys().cloned().collect::<BTreeSet<_>>();
    let want = |ids: [usize; 3]| ids.map(|i| format!("c{i}")).into_iter().collect();
    assert_eq!(keys(&a), want([0, 2, 4]), "sessions at target A");
    assert_eq!(keys(&b), want([1, 3, 5]), "sessions at target B");
    for (session, n) in a.iter().chain(&b) {
        assert_eq!(*n, 4, "{session}: every turn at the one target");
    }

    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("result_summary.json")).unwrap())
            .unwrap();
    let per = summary["per_target"]["targets"].as_array().unwrap();
    assert_eq!(per.len(), 2, "{per:?}");
    assert_eq!(per[0]["target"], url_a.as_str());
    assert_eq!(per[1]["target"], url_b.as_str());
    assert_eq!(u(&per[0]["turns_completed"]), a.values().sum::<u64>());
    assert_eq!(u(&per[1]["turns_completed"]), b.values().sum::<u64>());
    let m = &summary["metrics"];
    let sum = |key: &str| per.iter().map(|t| u(&t[key])).sum::<u64>();
    assert_eq!(sum("turns_completed"), u(&m["turns"]["ok"]));
    assert_eq!(sum("turns_failed"), u(&m["turns"]["failed"]));
    assert_eq!(sum("turns_tracked"), u(&m["turns"]["tracked_ok"]));
    assert_eq!(sum("trajectories"), u(&m["trajectories_started"]));
    assert_eq!(
        sum("output_tokens") as f64,
        m["output_sequence_lengths"]["total"].as_f64().unwrap()
    );
    let tps: f64 = per
        .iter()
        .map(|t| t["tokens_per_s"].as_f64().unwrap())
        .sum();
    let total_tps = summary["tps"].as_f64().unwrap();
    assert!(
        (tps - total_tps).abs() < 1e-6 * total_tps.max(1.0),
        "{tps} vs {total_tps}"
    );
    for t in per {
        assert!(u(&t["turns_completed"]) > 0, "{t}");
        let (p50, p90) = (t["ttft_p50_ms"].as_f64(), t["ttft_p90_ms"].as_f64());
        assert!(p50.is_some_and(|v| v > 0.0) && p90 >= p50, "{t}");
    }
    assert_eq!(summary["target"], serde_json::json!([url_a, url_b]));

    let report = std::fs::read_to_string(out.join("report.txt")).unwrap();
    assert!(report.contains("per target"), "{report}");
    for t in per {
        let line = report
            .lines()
            .find(|l| l.trim_start().starts_with(t["target"].as_str().unwrap()))
            .unwrap_or_else(|| panic!("no line for {t} in\n{report}"));
        let cols: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(cols[2], t["turns_completed"].to_string(), "{line}");
        assert_eq!(cols[4], t["output_tokens"].to_string(), "{line}");
    }
    assert_eq!(stdout, report, "the report is printed");
}

// One of two targets down: the run stops at once naming that one (not the live one), before
// the standard set would be generated, and leaves nothing behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_one_of_several_targets_is_named_before_any_dataset_is_generated() {
    let dir = tempfile::tempdir().unwrap();
    let (sim_a, live, stop) = start_sim(&dir.path().join("a.jsonl"));
    let (_refusing, dead) = support::refusing_address();
    let cwd = tempfile::tempdir().unwrap();
    let o = tokio::process::Command::new(env!("CARGO_BIN_EXE_agentrace"))
        .current_dir(cwd.path())
        .args(["replay", "--no-progress", "--out", "runs/x"])
        .args(["--target", &live, "--target", &dead])
        .output()
        .await
        .unwrap();
    stop.fire();
    sim_a.join().await;
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("target {dead} is unreachable")),
        "{err}"
    );
    assert!(!err.contains(&format!("{live} is unreachable")), "{err}");
    let left: Vec<_> = std::fs::read_dir(cwd.path()).unwrap().collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

fn invalid(toml: &str) -> String {
    match ReplayConfig::from_toml(toml).map(|c| c.validate()) {
        Ok(Ok(())) => panic!("accepted: {toml}"),
        Ok(Err(e)) | Err(e) => e.to_string(),
    }
}

// `target` is one URL or a list; an empty list, a URL listed twice, a bad URL or a value of
// another type is refused with a message that names the field.
#[test]
fn target_is_one_url_or_a_list_and_a_bad_list_is_named() {
    let one = ReplayConfig::from_toml("target = \"http://127.0.0.1:9\"").unwrap();
    one.validate().unwrap();
    assert_eq!(
        one.target.iter().collect::<Vec<_>>(),
        ["http://127.0.0.1:9"]
    );
    let two =
        ReplayConfig::from_toml("target = [\"http://127.0.0.1:9\", \"http://127.0.0.1:10/v\"]")
            .unwrap();
    two.validate().unwrap();
    assert_eq!(two.target.len(), 2);
    // One stays a string when written back, several a list.
    assert_eq!(
        serde_json::to_value(&one).unwrap()["target"],
        "http://127.0.0.1:9"
    );
    assert_eq!(
        serde_json::to_value(&two).unwrap()["target"][1],
        "http://127.0.0.1:10/v"
    );

    let empty = invalid("target = []");
    assert!(empty.starts_with("target: must be set"), "{empty}");
    let twice = invalid("target = [\"http://127.0.0.1:9\", \"http://127.0.0.1:9/\"]");
    assert!(
        twice.starts_with("target: ") && twice.contains("listed twice"),
        "{twice}"
    );
    let bad = invalid("target = [\"http://127.0.0.1:9\", \"ftp://x\"]");
    assert!(
        bad.starts_with("target: ") && bad.contains("ftp://x"),
        "{bad}"
    );
    let number = invalid("target = 5");
    assert!(
        number.contains("target") && number.contains("a URL or a list of URLs"),
        "{number}"
    );
    let unknown = invalid("target = \"http://127.0.0.1:9\"\ntargets = []");
    assert!(unknown.contains("unknown field `targets`"), "{unknown}");
}
