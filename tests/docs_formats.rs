//! The file-format references show files the code accepts: the dataset format page's example
//! passes `agentrace dataset validate`, and every JSON example on the capture format page is
//! JSON (its body examples after their `//` notes are stripped).

mod support;

use std::process::Command;

use support::docs::read;

/// The contents of each ```json block of a page.
fn json_blocks(page: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in page.lines() {
        match (&mut current, line.trim_start()) {
            (None, "```json") => current = Some(String::new()),
            (Some(_), "```") => blocks.push(current.take().unwrap()),
            (Some(block), _) => {
                block.push_str(line);
                block.push('\n');
            }
            _ => {}
        }
    }
    blocks
}

#[test]
fn dataset_format_example_is_a_valid_dataset() {
    let blocks = json_blocks(&read("docs/src/reference/dataset-format.md"));
    assert_eq!(blocks.len(), 1, "one example dataset on the page");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("example.jsonl");
    std::fs::write(&path, &blocks[0]).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_agentrace"))
        .args(["dataset", "validate"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the page's example is not a valid dataset:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn capture_format_examples_are_json() {
    let blocks = json_blocks(&read("docs/src/reference/capture-format.md"));
    assert!(
        !blocks.is_empty(),
        "the capture format page shows its lines"
    );
    for block in blocks {
        for line in block.lines().filter(|l| !l.trim().is_empty()) {
            let json = line.split("  //").next().unwrap().trim();
            let json = json.replace('…', "");
            serde_json::from_str::<serde_json::Value>(&json)
                .unwrap_or_else(|e| panic!("not JSON: {line}: {e}"));
        }
    }
}
