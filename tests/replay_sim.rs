//! The replayer end to end against the simulator (`agentrace::sim`), in one process: metrics
//! agree with the simulator's ground-truth log, an oracle replay of the public sample scores
//! what the oracle implies, the sweep writes its Pareto files, and the CLI exits as promised.

mod support;

use std::sync::Arc;

use agentrace::replay::{self, sweep};
use agentrace::sim::{self, ResponderKind, SimConfig};
use serde_json::Value;
use support::replay::{config, conversation, dataset, no_shutdown};

/// The tests of this file run one at a time: the timing test must not share the CPU with an
/// oracle replay of the whole sample.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn sim_config(time_scale: f64) -> SimConfig {
    let mut c = SimConfig::from_profile(sim::DEFAULT_PROFILE).unwrap();
    c.time_scale = time_scale;
    c.created_base_unix = Some(0);
    c.responder.output_tokens_min = 8;
    c.responder.output_tokens_max = 40;
    c
}

fn start_sim(cfg: SimConfig) -> (sim::SimCluster, String, agentrace::shutdown::Trigger) {
    let (trigger, shutdown) = agentrace::shutdown::channel();
    let cluster = sim::start(cfg, "127.0.0.1:0".parse().unwrap(), 1, shutdown).unwrap();
    let url = format!("http://{}", cluster.addrs()[0]);
    (cluster, url, trigger)
}

fn percentile(mut v: Vec<f64>, p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((p / 100.0) * (v.len() - 1) as f64).floor() as usize]
}

// At time-scale 1 each turn's TTFT and latency as the replayer measured them agree with the
// simulator's own log: never below it (the client sends before the server receives and reads
// after it writes), and at the median no further from it than a bare request's round trip
// plus 1 ms: TTFT, latency and the first-to-last span.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turn_timings_agree_with_the_simulator_ground_truth() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace.jsonl");
    let mut cfg = sim_config(1.0);
    cfg.trace_log = Some(trace.clone());
    let (cluster, url, trigger) = start_sim(cfg);
    let ds = dataset(
        (0..8)
            .map(|i| conversation(&format!("gt{i}"), 4, &[], "ls"))
            .collect(),
    );
    let out = dir.path().join("run");
    let s = replay::run(config(&url, 2), ds, &out, no_shutdown())
        .await
        .unwrap();
    assert_eq!(s.turns_ok, 32);
    let round_trip = bare_round_trip_ms(&url).await;
    trigger.fire();
    cluster.join().await;

    let (mut ttft_diff, mut lat_diff, mut decode_diff) = (Vec::new(), Vec::new(), Vec::new());
    for t in support::truth::turn_timings(&trace, &out) {
        let (ttft, lat) = (t.client_ttft_ms, t.client_latency_ms);
        let (gt_ttft, gt_lat) = (t.server_ttft_ms, t.server_latency_ms);
        assert!(
            ttft >= gt_ttft - 0.01,
            "client TTFT {ttft} ms below the server's {gt_ttft} ms"
        );
        assert!(
            lat >= gt_lat - 0.01,
            "client latency {lat} ms below the server's {gt_lat} ms"
        );
        ttft_diff.push(ttft - gt_ttft);
        lat_diff.push(lat - gt_lat);
        decode_diff.push(((lat - ttft) - (gt_lat - gt_ttft)).abs());
    }
    assert_eq!(ttft_diff.len(), 32);
    let (t50, l50, d50) = (
        percentile(ttft_diff.clone(), 50.0),
        percentile(lat_diff.clone(), 50.0),
        percentile(decode_diff.clone(), 50.0),
    );
    println!(
        "vs ground truth: TTFT +{t50:.3} ms p50 (max {:.3}); latency +{l50:.3} ms p50 (max {:.3}); first-to-last span |diff| {d50:.3} ms p50; bare round trip {round_trip:.3} ms p50",
        percentile(ttft_diff, 100.0),
        percentile(lat_diff, 100.0)
    );
    // The simulator emits each token when it is due (precise sleeps, as the replayer's); what
    // remains is the loopback and the thread wake-ups on both sides. A bare request to the
    // same server pays the same loopback and wake-ups, less the two hand-offs between the
    // connection's task and the engine loop; how long all of them take depends on how busy
    // the machine is (0.4-1.2 ms at the median on a 2-core VM). So the bound is that round
    // trip, measured in the same run, plus 1 ms for the hand-offs: a timestamp taken at the
    // wrong event or a stream buffered anywhere costs whole token intervals, far more. The
    // median of 32 turns keeps single late wake-ups out.
    let bound = round_trip + 1.0;
    assert!(
        t50 < bound,
        "TTFT differs from ground truth by {t50} ms at the median (bound {bound} ms)"
    );
    assert!(
        l50 < bound,
        "latency differs from ground truth by {l50} ms at the median (bound {bound} ms)"
    );
    assert!(
        d50 < bound,
        "first-to-last span differs by {d50} ms at the median (bound {bound} ms)"
    );
}

/// The median time of 32 `GET /health` requests to `url`, spaced as turns are, so the
/// machine's cores idle between them as they do between a replay's requests.
async fn bare_round_trip_ms(url: &str) -> f64 {
    let client = support::backends::client();
    let health = format!("{url}/health");
    let mut times = Vec::new();
    for _ in 0..32 {
        let started = std::time::Instant::now();
        let (status, _, _) = support::backends::fetch(&client, "GET", &health, &[], "").await;
        times.push(started.elapsed().as_secs_f64() * 1000.0);
        assert!(status.is_success(), "GET {health}: {status}");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    percentile(times, 50.0)
}

// The oracle answers the recorded reply with probability `oracle_accuracy` and a wrong command
// otherwise: on the public sample (salted, delays on, time-scaled) accuracy 1.0 scores exactly
// 1.0 with every scorable turn observed and the one `echo` turn excluded; 0.7 scores ≈ 0.7.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oracle_replay_of_the_public_sample_scores_what_the_oracle_implies() {
    let _serial = SERIAL.lock().await;
    let Some(sample) = support::dataset::sample_path(
        "oracle_replay_of_the_public_sample_scores_what_the_oracle_implies",
    ) else {
        return;
    };
    let ds = Arc::new(agentrace::dataset::load(&sample, &Default::default()).unwrap());
    for (accuracy, lo, hi) in [(1.0, 1.0, 1.0), (0.7, 0.65, 0.75)] {
        let mut cfg = sim_config(0.002);
        cfg.responder.kind = ResponderKind::Oracle;
        cfg.responder.oracle_accuracy = accuracy;
        cfg.responder.oracle_dataset = Some(sample.clone());
        let oracle = Arc::new(sim::Oracle::new(ds.clone()).unwrap());
        let (trigger, shutdown) = agentrace::shutdown::channel();
        let cluster = sim::start_with_oracle(
            cfg,
            "127.0.0.1:0".parse().unwrap(),
            1,
            shutdown,
            Some(oracle),
        )
        .unwrap();
        let url = format!("http://{}", cluster.addrs()[0]);
        let mut rc = config(&url, 20);
        // Long enough that no recorded reply is cut before its tool call.
        rc.model_params = Some(agentrace::dataset::ModelParams {
            max_new_tokens: Some(16_384),
            ..Default::default()
        });
        rc.enable_salt = true;
        rc.inject_tool_delay = true;
        rc.time_scale = 0.002;
        let out = tempfile::tempdir().unwrap();
        let s = replay::run(rc, ds.clone(), out.path(), no_shutdown())
            .await
            .unwrap();
        trigger.fire();
        cluster.join().await;
        let score = s.accuracy.unwrap();
        assert!(
            (lo..=hi).contains(&score),
            "oracle {accuracy}: scored {score}"
        );
        let scores: Value =
            serde_json::from_slice(&std::fs::read(out.path().join("scores.json")).unwrap())
                .unwrap();
        assert_eq!(scores["turns"]["issued"], 1007);
        assert_eq!(scores["turns"]["expected"], 1006);
        assert_eq!(scores["turns"]["missing"], 0);
        assert_eq!(
            scores["excluded_turns"][0]["conversation_id"],
            "astropy__astropy-12907"
        );
        assert_eq!(s.failures, 0);
    }
}

// A simulator too small for the requests: the report gives the refusal once with its count
// and the flag that fixes it, and both failure counts say what they count and agree with
// result_summary.json.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_refusals_are_reported_by_reason_with_the_fix_and_both_failure_counts_named() {
    let _serial = SERIAL.lock().await;
    let mut cfg = sim_config(0.01);
    cfg.engine.num_gpu_blocks = 2;
    let (cluster, url, trigger) = start_sim(cfg);
    let ds = dataset(
        (0..8)
            .map(|i| conversation(&format!("k{i}"), 3, &[], "ls"))
            .collect(),
    );
    let out = tempfile::tempdir().unwrap();
    let before = clock_monotonic_ns();
    let s = replay::run(config(&url, 4), ds, out.path(), no_shutdown())
        .await
        .unwrap();
    let after = clock_monotonic_ns();
    trigger.fire();
    cluster.join().await;
    assert_eq!(s.turns_ok, 0);
    let report = std::fs::read_to_string(out.path().join("report.txt")).unwrap();
    let summary: Value =
        serde_json::from_slice(&std::fs::read(out.path().join("result_summary.json")).unwrap())
            .unwrap();
    let reason_line = report
        .lines()
        .find(|l| l.contains("KV capacity"))
        .unwrap_or_else(|| panic!("no KV refusal in:\n{report}"));
    assert!(
        reason_line.trim_start().starts_with("8 http_status:"),
        "one reason for the 8 refused first turns: {reason_line}"
    );
    assert!(reason_line.contains("--num-gpu-blocks"), "{reason_line}");
    let failed = summary["n_samples_failed"].as_u64().unwrap();
    let all = summary["headline"]["failures"].as_u64().unwrap();
    assert_eq!(all, 24, "8 refused + 16 aborted");
    assert!(
        report.contains(&format!("failures      {all} of 24 turns"))
            && report.contains(&format!("inside the window {failed} of")),
        "{report}"
    );
    let counts = &summary["failure_counts"];
    assert_eq!(counts["n_samples_failed"]["count"], failed);
    assert_eq!(counts["headline.failures"]["count"], all);
    assert!(counts["n_samples_failed"]["counts"]
        .as_str()
        .unwrap()
        .contains("window"));
    assert_eq!(counts["top_reasons"][0]["count"], 8);

    // events.jsonl is on CLOCK_MONOTONIC, read here independently of the replayer; the
    // process-local zero it started from is in result_summary.json.
    let started = support::replay::events(out.path())[0].clone();
    assert_eq!(started["event_type"], "session.started");
    let zero = started["timestamp_ns"].as_u64().unwrap();
    assert!(
        before <= zero && zero <= after,
        "{before} <= {zero} <= {after}"
    );
    assert_eq!(summary["clock"]["process_local_zero_monotonic_ns"], zero);
}

/// `clock_gettime(CLOCK_MONOTONIC)`, what Python's `time.monotonic_ns()` returns.
fn clock_monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    assert_eq!(rc, 0);
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

// A 4-point sweep writes pareto.json (points, frontier, placement checks) and pareto.svg with
// every point labelled by its concurrency; the frontier is the non-dominated set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweep_writes_the_pareto_files() {
    let _serial = SERIAL.lock().await;
    let (cluster, url, trigger) = start_sim(sim_config(0.01));
    let ds = dataset(
        (0..8)
            .map(|i| conversation(&format!("s{i}"), 3, &[], "ls"))
            .collect(),
    );
    let out = tempfile::tempdir().unwrap();
    let points = sweep::run(
        config(&url, 1),
        &[1, 2, 4, 8],
        ds,
        out.path(),
        no_shutdown(),
    )
    .await
    .unwrap();
    trigger.fire();
    cluster.join().await;
    assert_eq!(points.len(), 4);
    for p in &points {
        let dominated = points.iter().any(|o| {
            o.system_tps >= p.system_tps
                && o.e2e_interactivity >= p.e2e_interactivity
                && (o.system_tps > p.system_tps || o.e2e_interactivity > p.e2e_interactivity)
        });
        assert_eq!(p.on_frontier, !dominated, "c={}", p.concurrency);
        assert!(out
            .path()
            .join(format!("c{}", p.concurrency))
            .join("report.txt")
            .exists());
    }
    let pareto: Value =
        serde_json::from_slice(&std::fs::read(out.path().join("pareto.json")).unwrap()).unwrap();
    assert_eq!(pareto["points"].as_array().unwrap().len(), 4);
    assert_eq!(
        pareto["placement_checks"][0]["pass"], false,
        "4 points < the 7 required"
    );
    let svg = std::fs::read_to_string(out.path().join("pareto.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    for c in [1, 2, 4, 8] {
        assert!(svg.contains(&format!(">c={c}<")), "label for c={c}");
    }
    // The mean output length of tracked turns and of all completed turns, side by side, and
    // which one the gate uses.
    let c1: Value = serde_json::from_slice(
        &std::fs::read(out.path().join("c1").join("result_summary.json")).unwrap(),
    )
    .unwrap();
    assert!(c1["osl_mean"]["tracked"].as_f64().unwrap() > 0.0);
    assert!(c1["osl_mean"]["all_completed"].as_f64().unwrap() > 0.0);
    assert!(c1["osl_mean"]["gate_uses"]
        .as_str()
        .unwrap()
        .starts_with("tracked"));
    assert!(c1["budget_rule"].as_str().unwrap().starts_with("none"));
    let c1_report = std::fs::read_to_string(out.path().join("c1").join("report.txt")).unwrap();
    assert!(c1_report.contains("tracked (the gate's)"), "{c1_report}");
    // No gates in this run: no verdict anywhere, not a PASS beside nothing measured.
    assert!(points.iter().all(|p| p.verdict.is_none()));
    assert!(!svg.contains("PASS") && !svg.contains("FAIL"), "{svg}");
    assert!(
        svg.contains("output tokens/s, wall clock"),
        "the axes name their time base"
    );

    // With gates, a failing point says which gate fails and why, on the chart itself; the
    // chart's rates and axis labels follow the time base asked for.
    let gates = [
        replay::Gate {
            name: "inline_accuracy",
            value: Some(0.9),
            rule: ">= 0.5586".into(),
            pass: true,
        },
        replay::Gate {
            name: "osl_per_turn_mean",
            value: Some(24.0),
            rule: "355-434 tokens".into(),
            pass: false,
        },
    ];
    let verdict = replay::verdict(&gates).unwrap();
    assert_eq!(
        verdict,
        "FAIL: osl_per_turn_mean 24.0000 not 355-434 tokens"
    );
    assert_eq!(replay::verdict(&gates[..1]).unwrap(), "PASS");
    assert_eq!(replay::verdict(&[]), None);
    let mut gated = points.clone();
    for p in &mut gated {
        p.verdict = Some(verdict.clone());
    }
    let simulated = sweep::svg(
        &gated,
        sweep::TimeBase {
            rate_factor: 0.05,
            label: "simulated time",
        },
    );
    assert!(
        simulated.contains("c=1 FAIL (osl_per_turn_mean)"),
        "{simulated}"
    );
    assert!(
        simulated.contains("fails: osl_per_turn_mean 24.0000 not 355-434 tokens"),
        "{simulated}"
    );
    assert!(simulated.contains("output tokens/s, simulated time"));
}

// The CLI: an unreachable target and a bad config exit non-zero with a message naming the
// problem; a run where every turn fails exits 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_exit_codes_name_the_problem() {
    let _serial = SERIAL.lock().await;
    let bin = env!("CARGO_BIN_EXE_agentrace");
    let out = tempfile::tempdir().unwrap();
    // Twenty small conversations, as many as the public sample has: the official config's
    // budget rule below counts them.
    let rows: Vec<Value> = (0..20)
        .flat_map(|i| support::dataset::coding_conversation(&format!("conv-{i:02}"), 1))
        .collect();
    let dataset = support::dataset::write_rows(out.path(), "twenty.jsonl", &rows);
    let (_refusing, dead) = support::refusing_address();
    let run = |args: &[&str]| {
        let o = std::process::Command::new(bin)
            .args(["replay", "--no-progress", "--dataset"])
            .arg(&dataset)
            .arg("--out")
            .arg(out.path())
            .args(args)
            .output()
            .unwrap();
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stderr).to_string(),
        )
    };
    let (code, err) = run(&["--target", &dead]);
    assert_eq!(code, Some(1));
    assert!(err.contains("unreachable"), "{err}");

    let (code, err) = run(&["--target", "http://127.0.0.1:1", "--concurrency", "0"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("concurrency: must be >= 1, got 0"), "{err}");

    let cfg_path = out.path().join("bad.toml");
    std::fs::write(
        &cfg_path,
        "target = \"http://127.0.0.1:1\"\nturn_timeout = 3\n",
    )
    .unwrap();
    let (code, err) = run(&["--config", cfg_path.to_str().unwrap()]);
    assert_eq!(code, Some(2));
    assert!(
        err.contains("turn_timeout") && err.contains("bad.toml"),
        "{err}"
    );

    let mut cfg = sim_config(0.001);
    cfg.faults.fail_rate = 1.0;
    let (cluster, url, trigger) = start_sim(cfg);
    let (code, err) = run(&[
        "--target",
        &url,
        "--num-trajectories",
        "2",
        "--delays",
        "false",
    ]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("every turn failed"), "{err}");

    // A run that claims an official config keeps its budget rule: 16 of the sample's 20
    // trajectories is refused as a configuration error; one pass is not.
    let official = concat!(env!("CARGO_MANIFEST_DIR"), "/config/replay-qwen.toml");
    let (code, err) = run(&[
        "--config",
        official,
        "--target",
        &url,
        "--num-trajectories",
        "16",
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("num_trajectories") && err.contains("multiple of the dataset's 20"),
        "{err}"
    );
    trigger.fire();
    cluster.join().await;
}

// An unreachable target is named at once, before the standard set would be generated into
// the working directory, and no output directory is left behind.
#[test]
fn an_unreachable_target_is_named_before_any_dataset_is_generated() {
    let cwd = tempfile::tempdir().unwrap();
    let (_refusing, dead) = support::refusing_address();
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_agentrace"))
        .current_dir(cwd.path())
        .args([
            "replay",
            "--no-progress",
            "--out",
            "runs/x",
            "--target",
            &dead,
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("unreachable") && err.contains(&dead), "{err}");
    let left: Vec<_> = std::fs::read_dir(cwd.path()).unwrap().collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}
