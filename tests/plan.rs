//! `agentrace plan` end to end through the binary: a finished combination is kept and not
//! run again while its inputs are unchanged, and run again when one changes; every output
//! is written; bad flags are refused with a message naming the flag.

use std::path::Path;
use std::process::{Command, Output};

fn agentrace(args: &[&str], dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_agentrace"))
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap()
}

fn plan(dir: &Path, time_scale: &str) -> Output {
    agentrace(
        &[
            "plan",
            "--dataset",
            "ds.jsonl",
            "--replicas",
            "1..2",
            "--policies",
            "affinity,round_robin",
            "--time-scale",
            time_scale,
            "--out",
            "out",
            "--no-progress",
        ],
        dir,
    )
}

#[test]
fn a_finished_combination_is_reused_until_its_inputs_change() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let synth = agentrace(
        &[
            "dataset",
            "synth",
            "--out",
            "ds.jsonl",
            "--coding",
            "0",
            "--workflow",
            "2",
        ],
        dir,
    );
    assert!(synth.status.success(), "{synth:?}");
    let first = plan(dir, "0.02");
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    let out = dir.join("out");
    for f in ["plan.json", "report.txt", "index.html"] {
        assert!(out.join(f).is_file(), "{f} missing");
    }
    let doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("plan.json")).unwrap()).unwrap();
    assert_eq!(doc["outcomes"].as_array().unwrap().len(), 4);
    let page = std::fs::read_to_string(out.join("index.html")).unwrap();
    assert!(page.contains("<svg") && !page.contains("<script"));
    let text = String::from_utf8_lossy(&first.stdout).to_string();
    assert!(text.contains("speculative decoding"), "{text}");

    let outcome = out.join("runs/affinity-r1-kv5000/outcome.json");
    let before = std::fs::read(&outcome).unwrap();
    let again = plan(dir, "0.02");
    assert!(again.status.success());
    let text = String::from_utf8_lossy(&again.stdout).to_string();
    assert!(text.contains("4 of 4 combinations reused"), "{text}");
    assert_eq!(std::fs::read(&outcome).unwrap(), before);

    let changed = plan(dir, "0.03");
    assert!(changed.status.success());
    let text = String::from_utf8_lossy(&changed.stdout).to_string();
    assert!(!text.contains("reused"), "{text}");
}

#[test]
fn bad_plan_flags_are_refused_naming_the_flag() {
    let tmp = tempfile::tempdir().unwrap();
    for (flag, value, want) in [
        ("--replicas", "0..2", "--replicas:"),
        ("--policies", "random", "--policies:"),
        ("--slo", "ttft_p90=fast", "--slo:"),
        ("--time-scale", "0", "--time-scale:"),
    ] {
        let out = agentrace(
            &["plan", "--dataset", "none.jsonl", flag, value],
            tmp.path(),
        );
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{flag} {value}: {err}");
    }
}
