//! The recorder: turns what the proxy's tap reports into compact, crash-safe trajectory
//! files, and reads them back for `agentrace capture …` and replay.

pub mod cli;

use std::path::PathBuf;
use std::sync::Arc;

use crate::proxy::tap::ExchangeSink;

/// What to do when the recorder's queue is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FullPolicy {
    /// Wait for room, up to the queue's memory bound, then drop.
    Block,
    /// Drop the record at once (counted and logged).
    Drop,
}

/// The proxy's `[capture]` section.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CaptureConfig {
    /// Recording is off unless switched on (or `--capture DIR` is given).
    pub enabled: bool,
    /// Directory the segment files go to.
    pub dir: PathBuf,
}

impl Default for CaptureConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            dir: PathBuf::from("captures"),
        }
    }
}

impl CaptureConfig {
    /// Checks the section; the message names the field and the value.
    pub fn validate(&self) -> Result<(), String> {
        Ok(())
    }
}

/// Counters of a running recorder, read by the proxy's metrics endpoint.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct RecorderStats {
    /// Exchanges written to segments.
    pub records_written: u64,
    /// Records dropped because the queue was full.
    pub records_dropped: u64,
    /// Failed writes (disk full, unwritable directory).
    pub write_errors: u64,
    /// Raw bytes seen (request + response bodies).
    pub bytes_raw: u64,
    /// Compressed bytes written.
    pub bytes_stored: u64,
}

/// Why the recorder could not start.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// Recording is not available in this build.
    #[error("capture is not available yet")]
    Unavailable,
}

/// A running recorder: hand `sink` to the proxy; `finish` drains the queue and closes files.
pub struct Recorder {
    /// What the proxy reports exchanges to.
    pub sink: Arc<dyn ExchangeSink>,
}

impl Recorder {
    /// Starts the writer task for `config`.
    pub fn start(_config: &CaptureConfig) -> Result<Recorder, CaptureError> {
        Err(CaptureError::Unavailable)
    }

    /// Current counters.
    pub fn stats(&self) -> RecorderStats {
        RecorderStats::default()
    }

    /// Drains the queue, finishes the compression frame and closes the segment.
    pub async fn finish(self) {}
}
