//! The README and the book show only commands that work: every `agentrace …` command in their
//! shell blocks (and every example in `--help`, through the generated CLI reference) names a
//! real subcommand whose `--help` lists each flag used, and every repository file they point
//! to exists. The README stays short and names nothing a user does not have.

mod support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use support::docs::{book_pages, read};

/// Shell lines of a page's ```sh blocks, with `\` continuations joined.
fn shell_lines(text: &str) -> Vec<String> {
    let mut lines = Vec::new();
    let mut in_sh = false;
    let mut pending = String::new();
    for line in text.lines() {
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

/// The examples each subcommand's `--help` shows, as the CLI reference page renders them.
fn help_examples(cli_page: &str) -> Vec<String> {
    cli_page
        .lines()
        .filter_map(|l| l.strip_prefix("  agentrace "))
        .map(|rest| format!("agentrace {rest}"))
        .collect()
}

/// `(subcommand path, flags)` of every agentrace invocation in `lines`.
fn invocations(lines: &[String]) -> Vec<(Vec<String>, BTreeSet<String>)> {
    let mut found = Vec::new();
    for line in lines {
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

/// Every problem with the commands of one page.
fn check_commands(name: &str, lines: &[String]) -> Vec<String> {
    let mut problems = Vec::new();
    for (mut path, flags) in invocations(lines) {
        // A second word that is not a subcommand (an argument) falls back to the first.
        let text = match help(&path) {
            Some(text) => text,
            None => {
                path.truncate(1);
                match help(&path) {
                    Some(text) => text,
                    None => {
                        problems.push(format!(
                            "{name}: `agentrace {}` is not a command",
                            path.join(" ")
                        ));
                        continue;
                    }
                }
            }
        };
        for flag in flags {
            if !text.contains(&format!("{flag} ")) && !text.contains(&format!("{flag}\n")) {
                problems.push(format!(
                    "{name}: `agentrace {}` has no flag {flag}",
                    path.join(" ")
                ));
            }
        }
    }
    problems
}

fn pages() -> Vec<(PathBuf, String)> {
    let mut pages = vec![(PathBuf::from("README.md"), read("README.md"))];
    pages.extend(book_pages());
    pages
}

#[test]
fn every_documented_command_and_flag_exists() {
    let mut problems = Vec::new();
    let mut total = 0;
    for (path, text) in pages() {
        let lines = shell_lines(&text);
        total += invocations(&lines).len();
        problems.extend(check_commands(&path.display().to_string(), &lines));
    }
    assert!(
        total >= 40,
        "found only {total} agentrace commands in the docs"
    );
    assert!(
        problems.is_empty(),
        "docs drifted:\n{}",
        problems.join("\n")
    );
}

#[test]
fn every_help_example_names_real_flags() {
    let examples = help_examples(&read("docs/src/reference/cli.md"));
    assert!(examples.len() >= 10, "only {} examples", examples.len());
    let problems = check_commands("--help examples", &examples);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn every_repository_path_in_the_docs_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut missing = Vec::new();
    for (page, text) in pages() {
        for word in text.split(|c: char| c.is_whitespace() || "`()[],\"'=".contains(c)) {
            let word = word.trim_end_matches(['.', ':', ';']);
            let tracked = [
                "config/",
                "scripts/",
                "benches/",
                "tests/",
                "src/",
                "examples/",
            ]
            .iter()
            .any(|p| word.starts_with(p));
            if tracked && !word.contains(['<', '*', '$', '{']) && !root.join(word).exists() {
                missing.push(format!("{}: {word}", page.display()));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "the docs name missing files: {missing:#?}"
    );
}

#[test]
fn readme_is_short_and_names_nothing_users_lack() {
    let readme = read("README.md");
    let lines = readme.lines().count();
    assert!(
        lines <= 250,
        "README.md has {lines} lines; the limit is 250 (move detail into docs/src/)"
    );
    assert!(
        !readme.contains("../shared"),
        "README.md names ../shared, which users do not have"
    );
}
