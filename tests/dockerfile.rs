//! The container image is the one the Kubernetes manifests run: its entrypoint takes their
//! `args` (the binary, so `args: ["proxy", …]` is a command line), it exposes every port
//! their containers declare, it runs as a non-root user, and its build stage runs the same
//! `cargo build` that `.ci/run` builds with, so CI catches what would break the image.
//! No container runtime is needed: the Dockerfile is read as text.

mod support;

use std::collections::BTreeSet;

use serde::Deserialize as _;

use support::docs::read;

/// Instructions of the Dockerfile as `(INSTRUCTION, arguments)`, with `\` continuations
/// joined and comments dropped.
fn instructions(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut pending = String::new();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('#') || (line.is_empty() && pending.is_empty()) {
            continue;
        }
        if let Some(head) = line.strip_suffix('\\') {
            pending.push_str(head);
            pending.push(' ');
            continue;
        }
        pending.push_str(line);
        let full = std::mem::take(&mut pending);
        if let Some((op, args)) = full.split_once(char::is_whitespace) {
            out.push((op.to_uppercase(), args.trim().to_string()));
        }
    }
    out
}

/// The instructions of the last stage (the image that ships).
fn final_stage(all: &[(String, String)]) -> &[(String, String)] {
    let start = all.iter().rposition(|(op, _)| op == "FROM").unwrap();
    &all[start..]
}

fn json_array(args: &str) -> Vec<String> {
    serde_json::from_str(args).unwrap_or_else(|e| panic!("not an exec-form array: {args}: {e}"))
}

#[test]
fn image_entrypoint_user_and_ports_fit_the_manifests() {
    let all = instructions(&read("Dockerfile"));
    let stage = final_stage(&all);
    let get = |op: &str| -> Vec<&str> {
        stage
            .iter()
            .filter(|(o, _)| o == op)
            .map(|(_, a)| a.as_str())
            .collect()
    };
    let entrypoint = json_array(get("ENTRYPOINT").last().expect("an ENTRYPOINT"));
    assert_eq!(
        entrypoint,
        ["/usr/local/bin/agentrace"],
        "the binary itself"
    );
    let user = get("USER");
    let user = user.last().expect("a USER");
    assert!(
        !user.starts_with("0") && !user.starts_with("root"),
        "non-root: {user}"
    );
    let exposed: BTreeSet<u16> = get("EXPOSE")
        .iter()
        .flat_map(|a| a.split_whitespace())
        .map(|p| p.trim_end_matches("/tcp").parse().unwrap())
        .collect();
    let copies_binary = get("COPY")
        .iter()
        .any(|a| a.starts_with("--from=") && a.ends_with(" /usr/local/bin/agentrace"));
    assert!(copies_binary, "the binary is copied from the build stage");

    let cmd = json_array(get("CMD").last().expect("a CMD"));
    let mut declared = BTreeSet::new();
    let mut images = 0;
    for file in std::fs::read_dir(support::docs::root().join("config/k8s")).unwrap() {
        let path = file.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let value = serde_yaml::Value::deserialize(doc).unwrap();
            let Some(spec) = value.get("spec").and_then(|s| s.get("template")) else {
                continue;
            };
            let containers = spec["spec"]["containers"]
                .as_sequence()
                .cloned()
                .unwrap_or_default();
            for c in containers {
                if c["image"].as_str() != Some("agentrace:latest") {
                    continue;
                }
                images += 1;
                assert!(
                    c.get("command").is_none(),
                    "{}: the manifests pass args to the entrypoint",
                    path.display()
                );
                let args: Vec<String> = serde_yaml::from_value(c["args"].clone()).unwrap();
                assert!(
                    ["proxy", "epp"].contains(&args[0].as_str()),
                    "{}: args start with a subcommand: {args:?}",
                    path.display()
                );
                if args[0] == "proxy" {
                    assert!(
                        args.starts_with(&cmd),
                        "{}: the proxy's args {args:?} start with the image's CMD {cmd:?}",
                        path.display()
                    );
                }
                for port in c["ports"].as_sequence().cloned().unwrap_or_default() {
                    declared.insert(port["containerPort"].as_u64().unwrap() as u16);
                }
            }
        }
    }
    assert!(
        images >= 3,
        "found {images} agentrace containers in config/k8s"
    );
    assert_eq!(
        exposed, declared,
        "EXPOSE lists the ports the manifests declare"
    );
}

#[test]
fn image_build_command_is_the_one_ci_runs() {
    let all = instructions(&read("Dockerfile"));
    let builds: Vec<&str> = all
        .iter()
        .filter(|(op, a)| op == "RUN" && a.starts_with("cargo build"))
        .map(|(_, a)| a.as_str())
        .collect();
    assert_eq!(
        builds.len(),
        1,
        "one cargo build in the Dockerfile: {builds:?}"
    );
    let ci = read(".ci/run");
    assert!(
        ci.lines().any(|l| l.trim() == builds[0]),
        ".ci/run does not run the image's build command `{}`",
        builds[0]
    );
    assert!(builds[0].contains("--locked") && builds[0].contains("--release"));
}

#[test]
fn build_context_leaves_out_what_the_image_does_not_need() {
    let ignore = read(".dockerignore");
    for entry in [
        ".git/",
        "target/",
        "runs/",
        "captures/*/",
        "datasets/*.jsonl*",
    ] {
        assert!(
            ignore.lines().any(|l| l.trim() == entry),
            ".dockerignore lacks {entry}"
        );
    }
}
