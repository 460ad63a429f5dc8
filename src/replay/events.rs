//! `events.jsonl` in the reference's record shapes (§14), written by one writer thread so that
//! serialising, hashing and disk I/O never run on a slot's task.

use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use serde::Serialize;

use super::config::LogPrompts;
use super::decode::ModelOutput;

/// What an ISSUED record says about the prompt.
#[derive(Debug)]
pub(crate) enum Prompt {
    /// A skipped (aborted) turn: every field null.
    Skipped,
    /// A sent request: a compact reference, or (with `--log-prompts full`) the whole prompt.
    Body {
        /// Source conversation id (without the repeat suffix).
        source: Arc<str>,
        /// Number of messages sent.
        messages: usize,
        /// Body length in bytes.
        body_len: usize,
        /// [`fingerprint`] of the body as sent.
        fingerprint: u64,
        /// With `--log-prompts full`: the body (for `tools` and `chat_template_kwargs`) and
        /// the history in the reference's form.
        full: Option<(Bytes, Vec<u8>)>,
    },
}

/// A fast 64-bit fingerprint of a request body (not cryptographic): it identifies which bytes
/// were sent without hashing megabytes per second on the writer thread.
pub(crate) fn fingerprint(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ bytes.len() as u64;
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        let w = u64::from_le_bytes(c.try_into().expect("8 bytes"));
        h = (h.rotate_left(5) ^ w).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
    for &b in chunks.remainder() {
        h = (h.rotate_left(5) ^ u64::from(b)).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
    h ^ (h >> 29)
}

/// The system monotonic clock (`CLOCK_MONOTONIC`, what Python's `time.monotonic_ns()` reads)
/// at `at`, in ns: the clock read now, less the time elapsed since `at`. `None` only if `at`
/// lies before the clock's zero, which a real instant never does.
pub(crate) fn monotonic_ns(at: std::time::Instant) -> Option<u64> {
    let elapsed = at.elapsed();
    let now = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    let now_ns = u64::try_from(now.tv_sec)
        .ok()?
        .checked_mul(1_000_000_000)?
        .checked_add(u64::try_from(now.tv_nsec).ok()?)?;
    now_ns.checked_sub(u64::try_from(elapsed.as_nanos()).ok()?)
}

/// One line of `events.jsonl`.
#[derive(Debug)]
pub(crate) enum Record {
    /// `session.*`.
    Session {
        /// `started`, `start_performance_tracking`, `stop_performance_tracking`, `ended`.
        name: &'static str,
        /// Nanoseconds since the run's epoch.
        ts: u64,
    },
    /// `sample.issued`.
    Issued {
        /// Timestamp.
        ts: u64,
        /// 32 hex chars.
        uuid: Uuid,
        /// Logical conversation id.
        conv: Arc<str>,
        /// Dataset turn.
        turn: u32,
        /// The prompt.
        prompt: Prompt,
    },
    /// `sample.recv_first` / `sample.recv_non_first`.
    Recv {
        /// Timestamp.
        ts: u64,
        /// Sample.
        uuid: Uuid,
        /// Logical conversation id.
        conv: Arc<str>,
        /// Dataset turn.
        turn: u32,
        /// First chunk or a later one.
        first: bool,
    },
    /// `sample.complete`.
    Complete {
        /// Timestamp.
        ts: u64,
        /// Sample.
        uuid: Uuid,
        /// Logical conversation id.
        conv: Arc<str>,
        /// Dataset turn.
        turn: u32,
        /// The output; `None` writes `data: null` (failed, timed out or skipped).
        output: Option<Box<ModelOutput>>,
        /// Finish reason of a successful response.
        finish_reason: Option<String>,
        /// Whether the record came back from a real exchange (writes `worker_id: 0`).
        from_worker: bool,
    },
    /// `error.generic`.
    Error {
        /// Timestamp.
        ts: u64,
        /// Sample.
        uuid: Uuid,
        /// Logical conversation id.
        conv: Arc<str>,
        /// Dataset turn.
        turn: u32,
        /// `error`, `TurnTimeout`, `TurnAbortedByPriorFailure`, …
        error_type: String,
        /// Human message.
        message: String,
    },
}

/// A sample UUID: 128 random bits written as 32 lowercase hex chars.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Uuid(pub u128);

impl Uuid {
    /// A fresh random (v4-shaped) id.
    pub(crate) fn random<R: rand::Rng>(rng: &mut R) -> Uuid {
        let mut v: u128 = rng.gen();
        v = (v & !(0xf << 76)) | (0x4 << 76);
        v = (v & !(0x3 << 62)) | (0x2 << 62);
        Uuid(v)
    }
}

impl std::fmt::Display for Uuid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// Why the log could not be written.
#[derive(Debug, thiserror::Error)]
pub(crate) enum EventsError {
    /// Creating or writing the file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
}

/// The sending side, cloned into every slot.
#[derive(Debug, Clone)]
pub(crate) struct EventSink {
    tx: Option<tokio::sync::mpsc::Sender<Record>>,
}

impl EventSink {
    /// A sink that drops everything (warmup).
    pub(crate) fn disabled() -> Self {
        Self { tx: None }
    }

    /// Queues a record; waits only when the writer is 16 K records behind (records hold no
    /// request bodies unless prompts are logged in full, so the queue stays small).
    pub(crate) async fn send(&self, record: Record) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(record).await;
        }
    }
}

/// The writer thread and its file.
#[derive(Debug)]
pub(crate) struct EventWriter {
    handle: std::thread::JoinHandle<Result<u64, EventsError>>,
}

impl EventWriter {
    /// Creates `path` and starts the writer; `zero` is added to every timestamp (the
    /// system monotonic clock at the run's process-local 0, or 0 to keep it local).
    pub(crate) fn start(
        path: &Path,
        prompts: LogPrompts,
        zero: u64,
    ) -> Result<(Self, EventSink), EventsError> {
        let file = std::fs::File::create(path).map_err(|source| EventsError::Io {
            path: path.display().to_string(),
            source,
        })?;
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Record>(16_384);
        let display = path.display().to_string();
        let handle = std::thread::Builder::new()
            .name("agentrace-events".into())
            .spawn(move || {
                let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
                let mut lines = 0u64;
                let mut line = Vec::with_capacity(4096);
                while let Some(record) = rx.blocking_recv() {
                    line.clear();
                    encode_at(&record, prompts, zero, &mut line);
                    line.push(b'\n');
                    out.write_all(&line).map_err(|source| EventsError::Io {
                        path: display.clone(),
                        source,
                    })?;
                    lines += 1;
                }
                out.flush().map_err(|source| EventsError::Io {
                    path: display.clone(),
                    source,
                })?;
                Ok(lines)
            })
            .map_err(|source| EventsError::Io {
                path: path.display().to_string(),
                source,
            })?;
        Ok((Self { handle }, EventSink { tx: Some(tx) }))
    }

    /// Waits until every sink is dropped and the file is flushed; returns the line count.
    pub(crate) async fn finish(self) -> Result<u64, EventsError> {
        tokio::task::spawn_blocking(move || {
            self.handle.join().unwrap_or_else(|_| {
                Err(EventsError::Io {
                    path: "events.jsonl".into(),
                    source: std::io::Error::other("writer thread panicked"),
                })
            })
        })
        .await
        .unwrap_or_else(|e| {
            Err(EventsError::Io {
                path: "events.jsonl".into(),
                source: std::io::Error::other(e.to_string()),
            })
        })
    }
}

#[derive(Serialize)]
struct Head<'a> {
    event_type: &'a str,
    timestamp_ns: u64,
    sample_uuid: &'a str,
    conversation_id: &'a str,
    turn: Option<u32>,
}

fn head(out: &mut Vec<u8>, event_type: &str, ts: u64, uuid: &str, conv: &str, turn: Option<u32>) {
    let _ = serde_json::to_writer(
        &mut *out,
        &Head {
            event_type,
            timestamp_ns: ts,
            sample_uuid: uuid,
            conversation_id: conv,
            turn,
        },
    );
    out.pop(); // reopen the object for `data` and the optional keys
    out.extend_from_slice(b",\"data\":");
}

/// Serialises one record exactly in the reference's key order.
#[cfg(test)]
pub(crate) fn encode(record: &Record, prompts: LogPrompts, out: &mut Vec<u8>) {
    encode_at(record, prompts, 0, out);
}

/// [`encode`] with every `timestamp_ns` moved by `zero`: the clock reading at the run's
/// process-local 0, so that the file is on the system monotonic clock.
pub(crate) fn encode_at(record: &Record, prompts: LogPrompts, zero: u64, out: &mut Vec<u8>) {
    match record {
        Record::Session { name, ts } => {
            head(out, &format!("session.{name}"), *ts + zero, "", "", None);
            out.extend_from_slice(b"null}");
        }
        Record::Issued {
            ts,
            uuid,
            conv,
            turn,
            prompt,
        } => {
            head(
                out,
                "sample.issued",
                *ts + zero,
                &uuid.to_string(),
                conv,
                Some(*turn),
            );
            match prompt {
                Prompt::Skipped => {
                    out.extend_from_slice(b"[\"PromptData\",null,null,null,null,null,null,null]")
                }
                Prompt::Body {
                    source,
                    messages,
                    body_len,
                    fingerprint,
                    full,
                } => match (prompts, full) {
                    (LogPrompts::Full, Some((body, history))) if !history.is_empty() => {
                        #[derive(serde::Deserialize)]
                        struct Extra {
                            tools: Option<Box<serde_json::value::RawValue>>,
                            chat_template_kwargs: Option<Box<serde_json::value::RawValue>>,
                        }
                        let extra: Option<Extra> = serde_json::from_slice(body).ok();
                        let raw = |v: Option<&Box<serde_json::value::RawValue>>| {
                            v.map_or("null".to_string(), |r| r.get().to_string())
                        };
                        out.extend_from_slice(b"[\"PromptData\",null,null,");
                        out.extend_from_slice(history);
                        out.push(b',');
                        out.extend_from_slice(
                            raw(extra.as_ref().and_then(|e| e.tools.as_ref())).as_bytes(),
                        );
                        out.push(b',');
                        out.extend_from_slice(
                            raw(extra.as_ref().and_then(|e| e.chat_template_kwargs.as_ref()))
                                .as_bytes(),
                        );
                        out.extend_from_slice(b",null,null]");
                    }
                    _ => {
                        let text = format!(
                            "agentrace-compact source={source} turn={turn} messages={messages} body_bytes={body_len} body_fp64={fingerprint:016x}"
                        );
                        out.extend_from_slice(b"[\"PromptData\",");
                        let _ = serde_json::to_writer(&mut *out, &text);
                        out.extend_from_slice(b",null,null,null,null,null,null]");
                    }
                },
            }
            out.push(b'}');
        }
        Record::Recv {
            ts,
            uuid,
            conv,
            turn,
            first,
        } => {
            let name = if *first {
                "sample.recv_first"
            } else {
                "sample.recv_non_first"
            };
            head(out, name, *ts + zero, &uuid.to_string(), conv, Some(*turn));
            out.extend_from_slice(b"null}");
        }
        Record::Complete {
            ts,
            uuid,
            conv,
            turn,
            output,
            finish_reason,
            from_worker,
        } => {
            head(
                out,
                "sample.complete",
                *ts + zero,
                &uuid.to_string(),
                conv,
                Some(*turn),
            );
            match output {
                Some(o) => {
                    let _ = serde_json::to_writer(&mut *out, &o.to_json());
                }
                None => out.extend_from_slice(b"null"),
            }
            if let Some(fr) = finish_reason {
                out.extend_from_slice(b",\"finish_reason\":");
                let _ = serde_json::to_writer(&mut *out, fr);
            }
            if *from_worker {
                out.extend_from_slice(b",\"worker_id\":0");
            }
            out.push(b'}');
        }
        Record::Error {
            ts,
            uuid,
            conv,
            turn,
            error_type,
            message,
        } => {
            head(
                out,
                "error.generic",
                *ts + zero,
                &uuid.to_string(),
                conv,
                Some(*turn),
            );
            let _ = serde_json::to_writer(&mut *out, &("ErrorData", error_type, message));
            out.push(b'}');
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(r: &Record) -> String {
        let mut v = Vec::new();
        encode(r, LogPrompts::Compact, &mut v);
        String::from_utf8(v).unwrap()
    }

    #[test]
    fn session_and_error_lines_match_the_reference_shape() {
        assert_eq!(
            line(&Record::Session {
                name: "started",
                ts: 5
            }),
            r#"{"event_type":"session.started","timestamp_ns":5,"sample_uuid":"","conversation_id":"","turn":null,"data":null}"#
        );
        assert_eq!(
            line(&Record::Error {
                ts: 7,
                uuid: Uuid(0xc11198fcdb4f4503af44918f0343c2e6),
                conv: "psf__requests-1921".into(),
                turn: 3,
                error_type: "error".into(),
                message: "HTTP 500: {\"error\": \"injected failure\"}".into(),
            }),
            r#"{"event_type":"error.generic","timestamp_ns":7,"sample_uuid":"c11198fcdb4f4503af44918f0343c2e6","conversation_id":"psf__requests-1921","turn":3,"data":["ErrorData","error","HTTP 500: {\"error\": \"injected failure\"}"]}"#
        );
        assert_eq!(
            line(&Record::Issued {
                ts: 1,
                uuid: Uuid(1),
                conv: "c__repeat_2".into(),
                turn: 5,
                prompt: Prompt::Skipped
            }),
            r#"{"event_type":"sample.issued","timestamp_ns":1,"sample_uuid":"00000000000000000000000000000001","conversation_id":"c__repeat_2","turn":5,"data":["PromptData",null,null,null,null,null,null,null]}"#
        );
    }
}
