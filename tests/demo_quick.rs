//! `agentrace demo --quick` is the newcomer's first command and the suite runs it: with the
//! same trajectories and the same simulated replicas, session affinity must beat round-robin
//! on the prefix-cache hit rate by a clear margin, and every output file must exist and parse;
//! its `index.html` must render in a real browser with every figure and link.

#[path = "support/browser.rs"]
mod browser;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use agentrace::dataset::synth::{write_file, SynthOptions};
use agentrace::demo::{run_into, DemoArgs, DemoResult};

fn quick_args(dataset: &Path, out: &Path) -> DemoArgs {
    DemoArgs {
        quick: true,
        replicas: 4,
        concurrency: None,
        trajectories: None,
        kv_tokens: None,
        time_scale: None,
        sweep: None,
        load_factor: 2.0,
        dataset: Some(dataset.to_path_buf()),
        out: out.to_path_buf(),
        no_progress: true,
    }
}

fn parse_json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// One quick demo for every test of this file: its output directory and result.
fn quick_demo() -> &'static (PathBuf, DemoResult) {
    static DEMO: OnceLock<(PathBuf, DemoResult)> = OnceLock::new();
    DEMO.get_or_init(|| {
        // Kept for the whole test binary, which the OS cleans with its temp directory.
        let tmp = tempfile::tempdir().unwrap().keep();
        let dataset = tmp.join("set.jsonl.zst");
        write_file(
            &dataset,
            &SynthOptions {
                seed: 7,
                coding: 16,
                workflow: 16,
            },
        )
        .unwrap();
        let out = tmp.join("demo");
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let result = runtime
            .block_on(run_into(&quick_args(&dataset, &out), &out))
            .unwrap();
        (out, result)
    })
}

#[test]
fn quick_demo_shows_affinity_beating_round_robin_and_writes_every_output() {
    let (out, result) = quick_demo();

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
    // Per-user progress over time accounts for every output token of each user.
    let users = wall["metrics"]["per_user"]["users"].as_array().unwrap();
    assert!(!users.is_empty());
    for u in users {
        let over_time: u64 = u["output_tokens_over_time"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .sum();
        assert_eq!(over_time, u["output_tokens"].as_u64().unwrap(), "{u}");
    }
    assert!(svg.contains("output tokens/s, simulated time"), "{svg}");
    for policy in ["affinity", "round-robin"] {
        let sweep_svg =
            std::fs::read_to_string(out.join("sweep").join(policy).join("pareto.svg")).unwrap();
        assert!(sweep_svg.contains("output tokens/s, wall clock"));
    }
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
    // A failing point names why, on the page's chart and on each sweep's own.
    if result
        .sweeps
        .iter()
        .any(|(_, ps)| ps.iter().any(|p| !p.gates_pass))
    {
        assert!(
            svg.contains("fails: "),
            "a failing point without its reason: {svg}"
        );
    }
}

/// Chromium, or a visible skip line when it is not installed.
fn browser_or_skip(test: &str) -> Option<PathBuf> {
    let found = browser::chromium();
    if found.is_none() {
        eprintln!(
            "SKIP {test}: no chromium on PATH (Debian: apt-get install -y chromium; or set AGENTRACE_CHROMIUM)"
        );
    }
    found
}

#[test]
fn demo_page_renders_in_chromium_with_its_table_every_figure_and_link_and_no_console_message() {
    let Some(chromium) = browser_or_skip("demo page in chromium") else {
        return;
    };
    let (out, _) = quick_demo();
    let page = out.join("index.html");
    let shot = out.join("index.png");
    let rendered = browser::render(&chromium, &page, &shot, (1280, 4000));
    let problems = browser::problems(&page, &rendered);
    assert!(problems.is_empty(), "{problems:#?}");
    // The metrics table and the plan's table.
    assert_eq!(
        rendered.dom.matches("<table").count(),
        2,
        "{}",
        rendered.dom
    );
    // Pareto, TTFT, one progress panel per policy, hit rate per replica: each drawn, each
    // naming its time base where it has a time axis.
    let svgs = rendered.dom.matches("<svg").count();
    assert_eq!(svgs, 5, "{}", rendered.dom);
    assert!(rendered.dom.matches("simulated time)").count() >= 6);
    let links = browser::attributes(&rendered.dom, "href");
    assert!(links.len() >= 9, "links: {links:?}");
    assert_eq!(rendered.screenshot_size, (1280, 4000));
}

#[test]
fn browser_check_catches_a_script_error_and_a_broken_link() {
    let Some(chromium) = browser_or_skip("browser check") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("here.txt"), "x").unwrap();
    let page = dir.path().join("bad.html");
    std::fs::write(
        &page,
        "<!doctype html><html><body><a href=\"here.txt\">ok</a> <a href=\"gone.txt\">gone</a>\
         <script>noSuchFunction();</script></body></html>",
    )
    .unwrap();
    let rendered = browser::render(&chromium, &page, &dir.path().join("bad.png"), (400, 300));
    let problems = browser::problems(&page, &rendered);
    assert_eq!(problems.len(), 2, "{problems:#?}");
    assert!(problems[0].starts_with("console: ") && problems[0].contains("noSuchFunction"));
    assert_eq!(problems[1], "broken link: gone.txt");
}
