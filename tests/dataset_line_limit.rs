//! Dataset lines are bounded (`max_line_bytes`): every place a dataset is read (`dataset
//! validate`, `load`, snapshot conversion, `agentrace replay`) stops at the first line longer
//! than the limit, naming the line and the limit, without reading the rest of that line; a
//! real dataset loads under the default limit and under one just above its longest line.

mod support;

use std::io::Write as _;
use std::path::Path;
use std::time::Duration;

use agentrace::dataset::DEFAULT_MAX_LINE_BYTES;
use agentrace::dataset::{load, DatasetError, LoadOptions};
use support::dataset::{coding_conversation, jsonl, sample_path, write_file, write_rows};

/// Two valid rows, then a line of `len` bytes, then a valid row.
fn text_with_long_third_line(len: usize) -> String {
    let rows = coding_conversation("c", 1);
    let mut text = jsonl(&rows[..2]);
    text.push_str(&"x".repeat(len));
    text.push('\n');
    text.push_str(&jsonl(&rows[2..]));
    text
}

// `dataset validate` reading a line that never ends (a FIFO fed without a newline) stops at
// the limit, says which line and which limit, and exits 1: it does not wait for the line's
// end, and the writer is cut off after little more than the limit and the read buffer.
#[tokio::test]
async fn validate_stops_at_an_endless_line_and_names_it() {
    const LIMIT: usize = 64 * 1024;
    const GUARD: u64 = 64 * 1024 * 1024;
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("endless.jsonl");
    let c_path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
    let writer_path = fifo.clone();
    let writer = std::thread::spawn(move || {
        let mut pipe = std::fs::OpenOptions::new()
            .write(true)
            .open(&writer_path)
            .unwrap();
        let rows = coding_conversation("c", 1);
        pipe.write_all(jsonl(&rows[..2]).as_bytes()).unwrap();
        let block = vec![b'x'; 64 * 1024];
        let mut written = 0u64;
        // Without a line limit the reader would take all of it; the guard ends the line then.
        while written < GUARD {
            if pipe.write_all(&block).is_err() {
                return (written, true);
            }
            written += block.len() as u64;
        }
        (written, false)
    });
    let run = tokio::process::Command::new(env!("CARGO_BIN_EXE_agentrace"))
        .args([
            "dataset",
            "validate",
            "--max-line-bytes",
            &LIMIT.to_string(),
        ])
        .arg(&fifo)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("validate did not finish")
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "line 3 is longer than {LIMIT} bytes, the line-length limit"
        )),
        "{stderr}"
    );
    let (written, cut_off) = writer.join().unwrap();
    assert!(cut_off, "the whole {written}-byte line was read");
    assert!(written < 8 * 1024 * 1024, "{written} bytes taken");
}

// The library's `load` gives the line and the limit in a dedicated error.
#[test]
fn load_reports_the_long_line_and_the_limit() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["d.jsonl", "d.jsonl.zst"] {
        let path = write_file(dir.path(), name, &text_with_long_third_line(5000));
        let opts = LoadOptions {
            max_line_bytes: 4096,
            ..LoadOptions::default()
        };
        match load(&path, &opts) {
            Err(e @ DatasetError::LineTooLong { .. }) => {
                assert!(
                    matches!(
                        e,
                        DatasetError::LineTooLong {
                            line: 3,
                            limit: 4096,
                            ..
                        }
                    ),
                    "{e}"
                );
                let msg = e.to_string();
                assert!(
                    msg.contains(name) && msg.contains("line 3 is longer than 4096 bytes"),
                    "{msg}"
                );
            }
            other => panic!("{name}: {other:?}"),
        }
        // At the limit exactly, the line is read (and then rejected as a row, not for length).
        let at_limit = write_file(dir.path(), name, &text_with_long_third_line(4096));
        match load(&at_limit, &opts) {
            Err(DatasetError::Invalid { errors, .. }) => assert_eq!(errors[0].line, 3),
            other => panic!("{name}: {other:?}"),
        }
    }
}

// Snapshot conversion reads through the same bounded reader.
#[test]
fn snapshot_conversion_stops_at_a_long_line() {
    let text = format!(
        "{}\n{}\n",
        serde_json::json!({"conversation_id": "a", "messages": []}),
        "y".repeat(300)
    );
    let mut out = Vec::new();
    let err = agentrace::dataset::snapshot::convert(
        std::io::Cursor::new(text.into_bytes()),
        &mut out,
        "snap.jsonl",
        256,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("snap.jsonl: line 2 is longer than 256 bytes"),
        "{err}"
    );
}

// Replay loads its dataset with `dataset_max_line_bytes` and refuses it before sending.
#[tokio::test]
async fn replay_refuses_a_dataset_line_over_its_limit() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_file(dir.path(), "d.jsonl", &text_with_long_third_line(5000));
    // A target that accepts connections, as replay checks it before loading the dataset;
    // nothing is ever sent to it.
    let target = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", target.local_addr().unwrap());
    let run = tokio::process::Command::new(env!("CARGO_BIN_EXE_agentrace"))
        .args(["replay", "--no-progress", "--target", &url])
        .args(["--dataset-max-line-bytes", "4096", "--dataset"])
        .arg(&path)
        .arg("--out")
        .arg(dir.path().join("out"))
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("replay did not finish")
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("line 3 is longer than 4096 bytes"),
        "{stderr}"
    );
}

// Normal datasets load: small rows under a small limit, and the public sample under the
// default and under a limit just above its longest line (15,682 bytes).
#[test]
fn normal_datasets_load_within_the_limit() {
    let dir = tempfile::tempdir().unwrap();
    let mut rows = coding_conversation("a", 3);
    rows.extend(coding_conversation("b", 2));
    let path = write_rows(dir.path(), "d.jsonl", &rows);
    let small = LoadOptions {
        max_line_bytes: 1024,
        ..LoadOptions::default()
    };
    assert_eq!(load(&path, &small).unwrap().conversations.len(), 2);
    assert_eq!(
        LoadOptions::default().max_line_bytes,
        DEFAULT_MAX_LINE_BYTES
    );

    let Some(sample) = sample_path("normal_datasets_load_within_the_limit") else {
        return;
    };
    assert_eq!(longest_line(&sample), 15_682);
    for max_line_bytes in [DEFAULT_MAX_LINE_BYTES, 16 * 1024] {
        let opts = LoadOptions {
            max_line_bytes,
            ..LoadOptions::default()
        };
        assert_eq!(load(&sample, &opts).unwrap().client_turn_count(), 1007);
    }
}

fn longest_line(path: &Path) -> usize {
    std::fs::read(path)
        .unwrap()
        .split(|b| *b == b'\n')
        .map(<[u8]>::len)
        .max()
        .unwrap()
}
