//! The recorder: turns what the proxy's tap reports into compact, crash-safe trajectory
//! files, and reads them back for `agentrace capture …` and replay.
//!
//! Stages: `sink` (the tap's observers: small records and `Bytes` clones into a bounded
//! queue) → `writer` (one thread: per-session delta encoding, zstd segments, flush, rotation)
//! → files described by `format`; `reader` recovers them, `export` turns them into an MLPerf
//! agentic dataset, `cli` is the command. The replayer's `open_loop` replays them at their
//! recorded times.

mod apis;
mod bases;
pub(crate) mod cli;
pub mod export;
pub mod format;
pub(crate) mod merge;
pub mod reader;
pub(crate) mod redact;
pub(crate) mod sink;
mod spill;
mod turns;
pub(crate) mod writer;

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crate::tap::ExchangeSink;

/// What to do when the recorder's queue is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FullPolicy {
    /// The end of the response waits for room (that exchange only; the thread serves other
    /// connections meanwhile). An exchange whose client went away cannot wait: its record is
    /// dropped when the queue is full.
    Block,
    /// Drop the record at once (counted and logged).
    Drop,
}

pub use redact::{HeaderMode, DEFAULT_REDACTED_HEADERS, DEFAULT_REDACTED_QUERY_PARAMS};

/// The proxy's `[capture]` section.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CaptureConfig {
    /// Recording is off unless switched on (or `--capture DIR` is given).
    pub enabled: bool,
    /// Directory the segment files go to.
    pub dir: PathBuf,
    /// Records (exchanges) the queue between the proxy and the writer holds.
    pub queue_capacity: usize,
    /// Bytes of request and response bodies the recorder may hold at once (in flight and
    /// queued); beyond it records are dropped whatever the policy.
    pub memory_bound_bytes: u64,
    /// What a full queue does: `drop` the record at once, or `block`: hold back the end of
    /// that response until the writer makes room.
    pub full_policy: FullPolicy,
    /// Longest time written data stays in memory before it reaches the file (milliseconds);
    /// a killed proxy loses at most this much.
    pub flush_interval_ms: u64,
    /// A segment is closed and a new one started past this many stored bytes.
    pub rotate_bytes: u64,
    /// … or past this age (seconds). A closed segment is never written again, so a sidecar
    /// can ship it: this bounds how long a record waits before it can be shipped.
    /// `rotate_age_s`, its name in earlier versions, is still read.
    #[serde(alias = "rotate_age_s")]
    pub rotate_age_secs: u64,
    /// Name of this proxy replica, written into every segment header so the captures of a
    /// fleet can be merged and told apart; empty: the host name (in Kubernetes, the pod name).
    pub replica: String,
    /// Header name patterns whose values are stored as `REDACTED-<first 16 hex of sha256>`
    /// (case-insensitive; `*` at either end matches anything).
    pub redact_headers: Vec<String>,
    /// `deny`: every header is stored (secrets hashed); `allow`: only `content-type` and the
    /// headers matching `keep_headers`.
    pub header_mode: HeaderMode,
    /// With `header_mode = "allow"`: the header name patterns stored.
    pub keep_headers: Vec<String>,
    /// Query parameter name patterns whose values are stored as `REDACTED-<hash>`.
    pub redact_query_params: Vec<String>,
    /// zstd level of the segments (1–19).
    pub zstd_level: i32,
}

impl Default for CaptureConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            dir: PathBuf::from("captures"),
            queue_capacity: 4096,
            memory_bound_bytes: 256 * 1024 * 1024,
            full_policy: FullPolicy::Drop,
            flush_interval_ms: 1000,
            rotate_bytes: 256 * 1024 * 1024,
            rotate_age_secs: 300,
            replica: String::new(),
            redact_headers: DEFAULT_REDACTED_HEADERS
                .iter()
                .map(|h| h.to_string())
                .collect(),
            header_mode: HeaderMode::Deny,
            keep_headers: Vec::new(),
            redact_query_params: DEFAULT_REDACTED_QUERY_PARAMS
                .iter()
                .map(|h| h.to_string())
                .collect(),
            zstd_level: 3,
        }
    }
}

impl CaptureConfig {
    /// Checks the section; the message names the field and the value.
    pub fn validate(&self) -> Result<(), String> {
        if self.dir.as_os_str().is_empty() {
            return Err("capture.dir: must not be empty".into());
        }
        if self.queue_capacity == 0 {
            return Err("capture.queue_capacity: must be >= 1, got 0".into());
        }
        if self.memory_bound_bytes < 1024 {
            return Err(format!(
                "capture.memory_bound_bytes: must be >= 1024, got {}",
                self.memory_bound_bytes
            ));
        }
        if self.flush_interval_ms == 0 || self.flush_interval_ms > 60_000 {
            return Err(format!(
                "capture.flush_interval_ms: must be in 1..=60000, got {}",
                self.flush_interval_ms
            ));
        }
        if self.rotate_bytes < 4096 {
            return Err(format!(
                "capture.rotate_bytes: must be >= 4096, got {}",
                self.rotate_bytes
            ));
        }
        if self.rotate_age_secs == 0 {
            return Err("capture.rotate_age_secs: must be >= 1, got 0".into());
        }
        if self.replica.len() > 128
            || self
                .replica
                .chars()
                .any(|c| !(c.is_ascii_graphic()) || c == '/' || c == '\\')
        {
            return Err(format!(
                "capture.replica: must be at most 128 printable ASCII characters without \
                 spaces or slashes, got {:?}",
                self.replica
            ));
        }
        if self.header_mode == HeaderMode::Deny && !self.keep_headers.is_empty() {
            return Err(
                "capture.keep_headers: applies only with capture.header_mode = \"allow\"".into(),
            );
        }
        self.redactor()?;
        if !(1..=19).contains(&self.zstd_level) {
            return Err(format!(
                "capture.zstd_level: must be in 1..=19, got {}",
                self.zstd_level
            ));
        }
        Ok(())
    }

    /// The compiled redaction settings; the error names the field and the bad pattern.
    pub(crate) fn redactor(&self) -> Result<redact::Redactor, String> {
        redact::Redactor::new(
            self.header_mode,
            &self.redact_headers,
            &self.keep_headers,
            &self.redact_query_params,
        )
    }

    /// The replica name segments carry: `replica`, else the host name, else `unknown`.
    pub fn replica_name(&self) -> String {
        if !self.replica.is_empty() {
            return self.replica.clone();
        }
        host_name().unwrap_or_else(|| "unknown".into())
    }

    /// The flush interval as a duration.
    pub fn flush_interval(&self) -> Duration {
        Duration::from_millis(self.flush_interval_ms)
    }
}

/// The machine's host name (the kernel's, as `hostname` prints it; `HOSTNAME` elsewhere).
fn host_name() -> Option<String> {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())?;
    let name = name.trim();
    (!name.is_empty()).then(|| name.to_owned())
}

/// Counters of a running recorder, read by the proxy's metrics endpoint.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct RecorderStats {
    /// Exchanges in segments: counted once the flush holding them succeeded.
    pub records_written: u64,
    /// Records dropped before the writer (queue full, memory bound, shutting down); noted in
    /// the capture's `dropped` lines.
    pub records_dropped: u64,
    /// Records lost because opening, writing or flushing their segment failed.
    pub records_lost_write_failed: u64,
    /// Records lost because they arrived while the writer waited to retry after a failure.
    pub records_lost_retry_wait: u64,
    /// Failed segment opens, writes, flushes and closes (disk full, unwritable directory).
    pub write_errors: u64,
    /// Raw body bytes (request + response) of the records written.
    pub bytes_raw: u64,
    /// Compressed bytes of the segments, up to their last successful flush.
    pub bytes_stored: u64,
}

/// Why the recorder could not start, or a capture could not be read.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// The `[capture]` section is invalid.
    #[error("{0}")]
    Config(String),
    /// A file or directory could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// A capture file holds something that is not a valid record.
    #[error("{path}: record {record}: {message}")]
    Format {
        /// The segment.
        path: String,
        /// 1-based record (line) number in the decompressed segment.
        record: u64,
        /// What is wrong.
        message: String,
    },
    /// The writer thread could not be started.
    #[error("cannot start the capture writer: {0}")]
    Spawn(std::io::Error),
    /// A bad argument to a capture command.
    #[error("{0}")]
    Invalid(String),
    /// An HTTP client failure outside any one request (open-loop replay set-up).
    #[error("{0}")]
    Http(String),
}

impl CaptureError {
    pub(crate) fn io(path: &std::path::Path, source: std::io::Error) -> Self {
        CaptureError::Io {
            path: path.display().to_string(),
            source,
        }
    }
}

/// A running recorder: hand `sink` to the proxy; `finish` drains the queue and closes files.
pub struct Recorder {
    /// What the proxy reports exchanges to.
    pub sink: Arc<dyn ExchangeSink>,
    shared: Arc<sink::Shared>,
    writer: writer::WriterHandle,
}

impl Recorder {
    /// Starts the writer thread for `config`. An unwritable directory does not fail here:
    /// the writer counts and logs every failed write and keeps retrying, so the proxy keeps
    /// forwarding.
    pub fn start(config: &CaptureConfig) -> Result<Recorder, CaptureError> {
        config.validate().map_err(CaptureError::Config)?;
        let redact = config.redactor().map_err(CaptureError::Config)?;
        let (queue, rx) = sink::queue(config);
        let shared = queue.shared.clone();
        let writer = writer::spawn(config.clone(), redact, rx, shared.clone())?;
        Ok(Recorder {
            sink: Arc::new(sink::RecorderSink::new(config, queue)),
            shared,
            writer,
        })
    }

    /// Current counters.
    pub fn stats(&self) -> RecorderStats {
        let c = &self.shared.counters;
        RecorderStats {
            records_written: c.records_written.load(Ordering::Relaxed),
            records_dropped: c.records_dropped.load(Ordering::Relaxed),
            records_lost_write_failed: c.records_lost_write_failed.load(Ordering::Relaxed),
            records_lost_retry_wait: c.records_lost_retry_wait.load(Ordering::Relaxed),
            write_errors: c.write_errors.load(Ordering::Relaxed),
            bytes_raw: c.bytes_raw.load(Ordering::Relaxed),
            bytes_stored: c.bytes_stored.load(Ordering::Relaxed),
        }
    }

    /// Drains the queue, finishes the compression frame and closes the segment. Exchanges
    /// still in flight (their observer not yet ended) are not waited for.
    pub async fn finish(self) {
        let Recorder {
            sink,
            shared,
            writer,
        } = self;
        drop(sink);
        shared.close();
        writer.join().await;
    }

    /// For tests: while the returned guard lives, the writer takes no record off the queue,
    /// as a writer stuck on a slow disk would; the queue then fills and the full policy acts.
    #[doc(hidden)]
    pub fn hold_writer(&self) -> WriterHold {
        *self.shared.hold.lock() = true;
        WriterHold {
            shared: self.shared.clone(),
        }
    }
}

/// Keeps the writer from taking records until dropped (see [`Recorder::hold_writer`]).
#[doc(hidden)]
pub struct WriterHold {
    shared: Arc<sink::Shared>,
}

impl Drop for WriterHold {
    fn drop(&mut self) {
        *self.shared.hold.lock() = false;
        self.shared.hold_changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_config_is_valid_and_off() {
        let c = CaptureConfig::default();
        assert!(!c.enabled);
        assert_eq!(c.validate(), Ok(()));
        assert_eq!(c.flush_interval(), Duration::from_secs(1));
        assert_eq!((c.rotate_bytes, c.rotate_age_secs), (256 << 20, 300));
        assert!(!c.replica_name().is_empty());
        assert_eq!(c.redact_headers.len(), DEFAULT_REDACTED_HEADERS.len());
        assert_eq!(c.header_mode, HeaderMode::Deny);
    }

    #[test]
    fn invalid_values_are_named_with_their_field_and_value() {
        let bad = |f: fn(&mut CaptureConfig), want: &str| {
            let mut c = CaptureConfig::default();
            f(&mut c);
            let msg = c.validate().unwrap_err();
            assert!(msg.contains(want), "{msg:?} does not mention {want:?}");
        };
        bad(
            |c| c.queue_capacity = 0,
            "queue_capacity: must be >= 1, got 0",
        );
        bad(
            |c| c.flush_interval_ms = 0,
            "capture.flush_interval_ms: must be in 1..=60000, got 0",
        );
        bad(
            |c| c.rotate_bytes = 10,
            "capture.rotate_bytes: must be >= 4096, got 10",
        );
        bad(
            |c| c.memory_bound_bytes = 1,
            "capture.memory_bound_bytes: must be >= 1024, got 1",
        );
        bad(
            |c| c.zstd_level = 22,
            "capture.zstd_level: must be in 1..=19, got 22",
        );
        bad(
            |c| c.redact_headers.push("bad header".into()),
            "capture.redact_headers: not a name, or a name with `*` at its start or end: \"bad header\"",
        );
        bad(
            |c| c.redact_query_params.push("a=b".into()),
            "capture.redact_query_params: not a name",
        );
        bad(
            |c| c.keep_headers.push("x-session-id".into()),
            "capture.keep_headers: applies only with capture.header_mode = \"allow\"",
        );
        bad(|c| c.dir = PathBuf::new(), "dir: must not be empty");
        bad(
            |c| c.replica = "pod 1".into(),
            "capture.replica: must be at most 128",
        );
        bad(
            |c| c.replica = "a/b".into(),
            "capture.replica: must be at most 128",
        );
    }

    #[test]
    fn config_section_parses_strictly() {
        let c: CaptureConfig =
            toml::from_str("enabled = true\ndir = \"/tmp/c\"\nfull_policy = \"block\"\n").unwrap();
        assert_eq!(c.full_policy, FullPolicy::Block);
        assert_eq!(c.queue_capacity, CaptureConfig::default().queue_capacity);
        let err = toml::from_str::<CaptureConfig>("flush_interval = 5\n").unwrap_err();
        assert!(err.to_string().contains("flush_interval"), "{err}");
    }

    #[test]
    fn rotate_age_secs_is_the_key_and_the_old_name_still_reads() {
        let c: CaptureConfig = toml::from_str("rotate_age_secs = 60\n").unwrap();
        assert_eq!(c.rotate_age_secs, 60);
        let old: CaptureConfig = toml::from_str("rotate_age_s = 61\n").unwrap();
        assert_eq!(old.rotate_age_secs, 61);
        let err = toml::from_str::<CaptureConfig>("rotate_age = 60\n").unwrap_err();
        assert!(err.to_string().contains("rotate_age_secs"), "{err}");
        let zero = CaptureConfig {
            rotate_age_secs: 0,
            ..CaptureConfig::default()
        };
        assert!(zero
            .validate()
            .unwrap_err()
            .starts_with("capture.rotate_age_secs:"));
    }

    #[tokio::test]
    async fn held_bytes_return_to_zero_once_records_are_written_or_cut() {
        use crate::tap::{ExchangeEnd, ExchangeStart, KeySource};
        let dir = tempfile::tempdir().unwrap();
        let rec = Recorder::start(&CaptureConfig {
            enabled: true,
            dir: dir.path().to_path_buf(),
            memory_bound_bytes: 100_000,
            ..CaptureConfig::default()
        })
        .unwrap();
        let frame = bytes::Bytes::from(vec![b'x'; 7_000]);
        for frames in [3, 40] {
            let now = tokio::time::Instant::now();
            let mut obs = rec.sink.start(ExchangeStart {
                session_key: Some("s".into()),
                key_source: KeySource::Header,
                backend: "b".into(),
                started_unix_ns: 0,
                started_at: now,
                request_received_at: now,
                method: http::Method::POST,
                path_and_query: "/".into(),
                request_headers: http::HeaderMap::new(),
                request_body: bytes::Bytes::from_static(b"{}"),
            });
            obs.response_head(http::StatusCode::OK, &http::HeaderMap::new(), now);
            for _ in 0..frames {
                obs.response_frame(&frame, now);
            }
            obs.end(ExchangeEnd::Complete, now);
        }
        let shared = rec.shared.clone();
        rec.finish().await;
        assert_eq!(shared.held_bytes.load(Ordering::Relaxed), 0);
        let back = reader::read_dir(dir.path()).unwrap().exchanges;
        assert!(back[0].record.complete && !back[1].record.complete);
        assert_eq!(back[1].request_body.as_deref(), Some(&b"{}"[..]));
    }
}
