//! The README shows only commands that work: every `agentrace …` command in its shell blocks
//! names a real subcommand whose `--help` lists each flag used, and every repository file it
//! points to exists.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

const README: &str = include_str!("../README.md");

/// Shell lines of the README's ```sh blocks, with `\` continuations joined.
fn shell_lines() -> Vec<String> {
    let mut lines = Vec::new();
    let mut in_sh = false;
    let mut pending = String::new();
    for line in README.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("```") {
            in_sh = !in_sh && (trimmed == "```sh" || trimmed == "```bash");
            continue;
        }
        if !in_sh {
            continue;
        }
        let code = line.split(" #").next().unwrap_or("").trim_end();
        if let Some(head) = code.strip_suffix('\\') {
            pending.push_str(head);
            pending.push(' ');
        } else {
            pending.push_str(code);
            lines.push(std::mem::take(&mut pending));
        }
    }
    lines
}

/// `(subcommand path, flags)` of every agentrace invocation in the README.
fn invocations() -> Vec<(Vec<String>, BTreeSet<String>)> {
    let mut found = Vec::new();
    for line in shell_lines() {
        for part in line.split(['|', ';', '&']) {
            let words: Vec<&str> = part.split_whitespace().collect();
            let Some(start) = words
                .iter()
                .position(|w| *w == "agentrace" || w.ends_with("/agentrace") || *w == "--")
            else {
                continue;
            };
            if words[start] == "--" && !part.contains("cargo run") {
                continue;
            }
            let rest = &words[start + 1..];
            let path: Vec<String> = rest
                .iter()
                .take_while(|w| {
                    w.chars().all(|c| c.is_ascii_lowercase() || c == '-') && !w.starts_with('-')
                })
                .take(2)
                .map(|w| w.to_string())
                .collect();
            let flags = rest
                .iter()
                .filter(|w| w.starts_with("--") && w.len() > 2)
                .map(|w| w.split('=').next().unwrap().to_string())
                .collect();
            if !path.is_empty() {
                found.push((path, flags));
            }
        }
    }
    found
}

fn help(path: &[String]) -> Option<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_agentrace"))
        .args(path)
        .arg("--help")
        .output()
        .unwrap();
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

#[test]
fn every_readme_command_and_flag_exists() {
    let invocations = invocations();
    assert!(
        invocations.len() >= 10,
        "found only {} agentrace commands in the README",
        invocations.len()
    );
    let mut problems = Vec::new();
    for (mut path, flags) in invocations {
        // A second word that is not a subcommand (an argument) falls back to the first.
        let text = match help(&path) {
            Some(text) => text,
            None => {
                path.truncate(1);
                match help(&path) {
                    Some(text) => text,
                    None => {
                        problems.push(format!("`agentrace {}` is not a command", path.join(" ")));
                        continue;
                    }
                }
            }
        };
        for flag in flags {
            if !text.contains(&format!("{flag} ")) && !text.contains(&format!("{flag}\n")) {
                problems.push(format!("`agentrace {}` has no flag {flag}", path.join(" ")));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "README drifted:\n{}",
        problems.join("\n")
    );
}

#[test]
fn every_repository_path_in_the_readme_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut missing = Vec::new();
    for word in README.split(|c: char| c.is_whitespace() || "`()[],\"'".contains(c)) {
        let word = word.trim_end_matches(['.', ':']);
        let tracked = ["config/", "scripts/", "benches/", "tests/", "src/"]
            .iter()
            .any(|p| word.starts_with(p));
        if tracked && !word.contains(['<', '*', '$']) && !root.join(word).exists() {
            missing.push(word.to_string());
        }
    }
    assert!(
        missing.is_empty(),
        "README names missing files: {missing:?}"
    );
}
