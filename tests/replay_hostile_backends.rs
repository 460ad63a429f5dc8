//! `agentrace replay` (the binary) against backends on `127.0.0.1:0` that answer 200 with
//! something other than what was asked for.
//!
//! Invariants: a turn succeeds only on a well-formed response of the kind requested; a 200 with
//! an HTML page, an event stream without a `data:` JSON chunk, or one that ends without
//! `data: [DONE]` is a `bad_response` failure whose reason is in `report.txt`, in
//! `result_summary.json` and in the turn's `error.generic` event, and a run whose every turn
//! failed exits non-zero. A response that streams without end fails its turn once it passes
//! `max_response_bytes`, naming the cap, and its connection is dropped; the replay finishes.
//! A response whose framing breaks RFC 9112 (a chunk size that is not bare hex) is a
//! `bad_response` too, refused by the same codec as the proxy's.

mod support;

use std::path::Path;
use std::process::Output;
use std::time::Duration;

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
    tokio::time::timeout(Duration::from_secs(120), run)
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

/// How an endless stream ended: bytes written, and whether the client closed the connection.
type StreamEnd = (u64, bool);

/// A backend on `127.0.0.1:0` that answers every request with a chunked event stream of
/// valid chunks that never ends, written as fast as the client reads. As a guard for a
/// replayer without a cap, it stops writing (the response still open) after `guard` bytes.
async fn endless_backend(guard: u64) -> (String, tokio::sync::mpsc::UnboundedReceiver<StreamEnd>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                if support::raw_http1::read_raw_request(&mut stream, &mut buf)
                    .await
                    .is_none()
                {
                    return;
                }
                let head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\
                            Transfer-Encoding: chunked\r\n\r\n";
                let event = format!(
                    "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{}\"}}}}]}}\n\n",
                    "x".repeat(4000)
                );
                let chunk = format!("{:x}\r\n{event}\r\n", event.len());
                let mut written = 0u64;
                let mut closed = stream.write_all(head.as_bytes()).await.is_err();
                while !closed && written < guard {
                    closed = stream.write_all(chunk.as_bytes()).await.is_err();
                    written += chunk.len() as u64;
                }
                if !closed {
                    // Hold the response open until the client goes away.
                    let mut sink = [0u8; 1024];
                    while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
                    closed = true;
                }
                let _ = tx.send((written, closed));
            });
        }
    });
    (url, rx)
}

#[tokio::test]
async fn endless_stream_fails_its_turn_at_max_response_bytes_and_drops_the_connection() {
    const CAP: u64 = 1024 * 1024;
    const GUARD: u64 = 48 * 1024 * 1024;
    let (url, mut ends) = endless_backend(GUARD).await;
    let out = tempfile::tempdir().unwrap();
    let run = replay(
        &url,
        out.path(),
        &[
            "--max-response-bytes",
            &CAP.to_string(),
            "--turn-timeout",
            "10",
        ],
    )
    .await;
    let why = format!("response larger than max_response_bytes ({CAP} bytes)");
    assert_bad_responses(out.path(), &run, &why);
    for _ in 0..2 {
        let (written, closed) = tokio::time::timeout(Duration::from_secs(30), ends.recv())
            .await
            .expect("the stream did not end")
            .unwrap();
        assert!(closed);
        // The client hung up at the cap (plus what loopback socket buffers hold), long
        // before the guard.
        assert!(written < GUARD, "{written} bytes written");
    }
}

/// A chunk size written `+5`: hex digits only (RFC 9112 §7.1), so the response is malformed
/// however a lax parser (Rust's `from_str_radix` takes the sign) would read it. The stream
/// inside is otherwise a valid, complete one: only the framing can fail the turn.
#[tokio::test]
async fn signed_chunk_size_is_a_bad_response_not_a_turn() {
    let events = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\n\
                  data: [DONE]\n\n";
    let reply = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n\
         +{:x}\r\n{events}\r\n0\r\n\r\n",
        events.len()
    );
    let backend = RawBackend::spawn(&[reply.as_bytes()], After::KeepServing).await;
    let out = tempfile::tempdir().unwrap();
    let run = replay(&backend.url(), out.path(), &[]).await;
    assert_bad_responses(
        out.path(),
        &run,
        "malformed chunked body: a chunk size that is not hex digits",
    );
}
