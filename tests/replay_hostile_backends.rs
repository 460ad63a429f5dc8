//! `agentrace replay` (the binary) against backends on `127.0.0.1:0` that answer 200 with
//! something other than what was asked for.
//!
//! Invariants: a turn succeeds only on a well-formed response of the kind requested; a 200 with
//! an HTML page, an event stream without a `data:` JSON chunk, or one that ends without
//! `data: [DONE]` is a `bad_response` failure whose reason is in `report.txt`, in
//! `result_summary.json` and in the turn's `error.generic` event, and a run whose every turn
//! failed exits non-zero.

mod support;

use std::path::Path;
use std::process::Output;

use serde_json::Value;
use support::dataset::{coding_conversation, write_rows};
use support::raw_http1::{After, RawBackend};

/// Runs `agentrace replay` on a two-conversation dataset against `target`.
async fn replay(target: &str, out: &Path, extra: &[&str]) -> Output {
    let data = tempfile::tempdir().unwrap();
    let mut rows = coding_conversation("c1", 2);
    rows.extend(coding_conversation("c2", 1));
    let dataset = write_rows(data.path(), "d.jsonl", &rows);
    let run = tokio::process::Command::new(env!("CARGO_BIN_EXE_agentrace"))
        .args([
            "replay",
            "--no-progress",
            "--delays",
            "false",
            "--target",
            target,
        ])
        .arg("--dataset")
        .arg(&dataset)
        .arg("--out")
        .arg(out)
        .args(extra)
        .kill_on_drop(true)
        .output();
    tokio::time::timeout(std::time::Duration::from_secs(120), run)
        .await
        .expect("replay did not finish")
        .unwrap()
}

fn response(content_type: &str, body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// The run failed as a whole, every sent turn is a `bad_response` naming `why`, and the
/// reason is in each of the outputs.
fn assert_bad_responses(out: &Path, run: &Output, why: &str) {
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success(), "exit {}: {stderr}", run.status);
    let report = std::fs::read_to_string(out.join("report.txt")).unwrap();
    let line = report
        .lines()
        .find(|l| l.contains("bad_response: "))
        .unwrap_or_else(|| panic!("no bad_response reason in report.txt:\n{report}"));
    assert!(line.contains(why), "{line:?} does not say {why:?}");
    assert!(report.contains("ok 0"), "{report}");

    let summary: Value =
        serde_json::from_slice(&std::fs::read(out.join("result_summary.json")).unwrap()).unwrap();
    let failures = &summary["headline"]["failures_by_kind"];
    assert_eq!(failures["bad_response"], 2, "{failures}");
    let reasons = summary["metrics"]["failure_reasons"].as_array().unwrap();
    assert!(
        reasons
            .iter()
            .any(|r| r["kind"] == "bad_response" && r["reason"].as_str().unwrap().contains(why)),
        "{reasons:?}"
    );

    let errors: Vec<Value> = support::replay::events(out)
        .into_iter()
        .filter(|e| e["event_type"] == "error.generic" && e["data"][1] == "error")
        .collect();
    assert_eq!(errors.len(), 2, "{errors:?}");
    for e in &errors {
        assert!(e["data"][2].as_str().unwrap().contains(why), "{e}");
    }
}

#[tokio::test]
async fn html_page_with_status_200_is_a_bad_response_not_a_turn() {
    let page = "<!DOCTYPE html>\n<html><body>\n\n<h1>502 Bad Gateway</h1>\n\n</body></html>\n";
    let backend = RawBackend::spawn(&[&response("text/html", page)], After::KeepServing).await;
    let out = tempfile::tempdir().unwrap();
    let run = replay(&backend.url(), out.path(), &[]).await;
    assert_bad_responses(
        out.path(),
        &run,
        "a stream was asked for, got content-type \"text/html\"",
    );
}

#[tokio::test]
async fn event_stream_without_a_data_chunk_is_a_bad_response() {
    let garbage = "event: ping\n\n: keep-alive\n\nhello world\n\nretry: 10\n\n";
    let backend = RawBackend::spawn(
        &[&response("text/event-stream", garbage)],
        After::KeepServing,
    )
    .await;
    let out = tempfile::tempdir().unwrap();
    let run = replay(&backend.url(), out.path(), &[]).await;
    assert_bad_responses(out.path(), &run, "no data: event with a JSON chunk");
}

#[tokio::test]
async fn event_stream_that_ends_without_done_is_a_bad_response() {
    let cut = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}]}\n\n\
               data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo\"}}]}\n\n";
    let backend = RawBackend::spawn(
        &[&response("text/event-stream; charset=utf-8", cut)],
        After::KeepServing,
    )
    .await;
    let out = tempfile::tempdir().unwrap();
    let run = replay(&backend.url(), out.path(), &[]).await;
    assert_bad_responses(
        out.path(),
        &run,
        "the stream ended without data: [DONE] after 2 chunks",
    );
}
