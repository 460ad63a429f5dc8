//! The one writer of a recorder: a dedicated thread (file I/O and compression never run on
//! the async runtime) that delta-encodes request bodies per session, writes zstd JSONL
//! segments, flushes every interval, rotates by size and age, and counts every failure.
//!
//! A record counts as written only once the flush holding it succeeded. A failed write or
//! flush (a full disk) cuts the segment back to its last good flush, or removes it when none
//! succeeded, so what was recorded before stays readable and no empty file is left; the
//! records in the lost part are counted as lost. The writer then waits, doubling the wait on
//! each failure, and tries a new segment only when a record arrives after the wait, flushing
//! at once so a disk still full costs one short-lived file per wait, never one per second.

use std::fs::File;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::bases::DeltaBases;
use super::format::{
    self, DeltaBase, DroppedRecord, EndKind, ExchangeRecord, Line, Offsets, SegmentHeader,
    StoredBody, StoredRequest, StoredResponse,
};
use super::redact::Redactor;
use super::sink::{Captured, Msg, Shared};
use super::{CaptureConfig, CaptureError};
use crate::tap::ExchangeEnd;

/// Lets `Recorder::finish` wait for the writer thread without blocking the runtime.
pub(crate) struct WriterHandle {
    done: tokio::sync::oneshot::Receiver<()>,
}

impl WriterHandle {
    /// Resolves once the writer has closed its last segment (or died).
    pub(crate) async fn join(self) {
        let _ = self.done.await;
    }
}

/// Starts the writer thread.
pub(crate) fn spawn(
    config: CaptureConfig,
    redact: Redactor,
    rx: Receiver<Msg>,
    shared: Arc<Shared>,
) -> Result<WriterHandle, CaptureError> {
    let (done_tx, done) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("capture-writer".into())
        .spawn(move || {
            Writer::new(config, redact, shared).run(rx);
            let _ = done_tx.send(());
        })
        .map_err(CaptureError::Spawn)?;
    Ok(WriterHandle { done })
}

/// The longest wait between attempts while writes keep failing (unless the flush interval is
/// longer).
const MAX_RETRY_WAIT: Duration = Duration::from_secs(30);

/// Counts the compressed bytes handed to the file.
struct CountingFile {
    file: File,
    written: u64,
}

impl Write for CountingFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.file.write(buf)?;
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

struct Segment {
    path: PathBuf,
    encoder: zstd::stream::write::Encoder<'static, CountingFile>,
    opened: Instant,
    dirty: bool,
    /// Uncompressed bytes given to the encoder since its last flush: counted in full
    /// towards the rotation size, since the compressed size is known only once flushed.
    unflushed: u64,
    /// File length at the end of the last successful flush: a failure cuts the file back to
    /// it, so the segment still decodes up to there.
    durable: u64,
    /// Exchanges (and their raw body bytes) given to the encoder since the last successful
    /// flush: counted as written once a flush succeeds, as lost if it fails.
    pending: u64,
    pending_raw: u64,
}

/// Why a record did not reach the disk; the label of `records_lost_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lost {
    /// Opening, writing or flushing the segment holding it failed.
    WriteFailed,
    /// It arrived while the writer waited after a failure.
    RetryWait,
}

struct Writer {
    config: CaptureConfig,
    shared: Arc<Shared>,
    redact: Redactor,
    tag: String,
    /// Written into every segment header, so a fleet's captures say which replica saw what.
    replica: String,
    seq: u64,
    segment: Option<Segment>,
    /// After a failed open or write, no new segment is tried before this.
    retry_at: Option<Instant>,
    /// Failures since the last successful flush: sets the wait before the next attempt.
    failures: u32,
    /// The delta bases of the open segment, within `memory_bound_bytes`.
    bases: DeltaBases,
    drops_reported: u64,
    errors_unlogged: u64,
    last_error: Option<String>,
    line: Vec<u8>,
}

impl Writer {
    fn new(config: CaptureConfig, redact: Redactor, shared: Arc<Shared>) -> Self {
        Writer {
            redact,
            tag: format!("{:08x}", rand::random::<u32>()),
            replica: config.replica_name(),
            seq: 0,
            segment: None,
            retry_at: None,
            failures: 0,
            bases: DeltaBases::new(Some(config.memory_bound_bytes)),
            drops_reported: 0,
            errors_unlogged: 0,
            last_error: None,
            line: Vec::with_capacity(64 * 1024),
            config,
            shared,
        }
    }

    fn run(mut self, rx: Receiver<Msg>) {
        let interval = self.config.flush_interval();
        let mut next_tick = Instant::now() + interval;
        loop {
            match rx.recv_timeout(next_tick.saturating_duration_since(Instant::now())) {
                Ok(Msg::Exchange(c)) => {
                    self.shared.wait_while_held();
                    self.exchange(c);
                    // The slot is free once the record is written, not when it is received:
                    // `queue_capacity` bounds the records waiting for the disk.
                    self.shared.slot_freed();
                }
                Ok(Msg::Close) | Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => {}
            }
            let now = Instant::now();
            if now >= next_tick {
                self.tick(now);
                next_tick = now + interval;
            }
        }
        // A record that passed the sink's `closed` check just before `Close` was sent lands
        // behind it: it is counted as dropped like those the sink refused.
        while let Ok(msg) = rx.try_recv() {
            if let Msg::Exchange(c) = msg {
                self.shared.release(c.held);
                self.shared
                    .counters
                    .records_dropped
                    .fetch_add(1, Ordering::Relaxed);
            }
        }
        self.report_drops();
        self.close_segment();
        self.log_errors();
        let c = &self.shared.counters;
        tracing::info!(
            dir = %self.config.dir.display(),
            written = c.records_written.load(Ordering::Relaxed),
            dropped = c.records_dropped.load(Ordering::Relaxed),
            lost = c.records_lost_write_failed.load(Ordering::Relaxed)
                + c.records_lost_retry_wait.load(Ordering::Relaxed),
            write_errors = c.write_errors.load(Ordering::Relaxed),
            "capture closed"
        );
    }

    /// Work due every flush interval: flush, age rotation, drop and error reports.
    fn tick(&mut self, now: Instant) {
        self.report_drops();
        self.flush();
        let age = Duration::from_secs(self.config.rotate_age_secs);
        if self
            .segment
            .as_ref()
            .is_some_and(|s| now.duration_since(s.opened) >= age)
        {
            self.close_segment();
        }
        self.log_errors();
    }

    fn exchange(&mut self, c: Box<Captured>) {
        let held = c.held;
        let raw = c.request_len as u64 + c.frame_times.iter().map(|f| f.1 as u64).sum::<u64>();
        let lost = match self.ensure_segment() {
            Err(reason) => Some(reason),
            Ok(()) => {
                let record = self.encode(&c);
                if self.write_line(&Line::Exchange(Box::new(record))) {
                    self.remember(&c);
                    if let Some(seg) = self.segment.as_mut() {
                        seg.pending += 1;
                        seg.pending_raw += raw;
                    }
                    if self.failures > 0 {
                        // A retry: learn now whether the disk takes data again, so a file
                        // that cannot be written does not outlive this call.
                        self.flush();
                    } else {
                        self.rotate_if_full();
                    }
                    None
                } else {
                    Some(Lost::WriteFailed)
                }
            }
        };
        if let Some(reason) = lost {
            self.lost(reason, 1);
        }
        drop(c);
        self.shared.release(held);
    }

    /// Counts records that will never reach the disk.
    fn lost(&mut self, reason: Lost, n: u64) {
        if n == 0 {
            return;
        }
        let counters = &self.shared.counters;
        let counter = match reason {
            Lost::WriteFailed => &counters.records_lost_write_failed,
            Lost::RetryWait => &counters.records_lost_retry_wait,
        };
        counter.fetch_add(n, Ordering::Relaxed);
        self.errors_unlogged += n;
    }

    /// Opens a segment if none is open and the retry wait allows.
    fn ensure_segment(&mut self) -> Result<(), Lost> {
        if self.segment.is_some() {
            return Ok(());
        }
        if self.retry_at.is_some_and(|t| Instant::now() < t) {
            return Err(Lost::RetryWait);
        }
        self.retry_at = None;
        self.seq += 1;
        let now_ns = unix_ns();
        let name = format!(
            "{}{}-{}-{:06}{}",
            format::SEGMENT_PREFIX,
            format::compact_time(now_ns),
            self.tag,
            self.seq,
            format::SEGMENT_SUFFIX
        );
        let path = self.config.dir.join(name);
        let opened = std::fs::create_dir_all(&self.config.dir)
            .and_then(|()| File::create_new(&path))
            .and_then(|file| {
                let encoder = zstd::stream::write::Encoder::new(
                    CountingFile { file, written: 0 },
                    self.config.zstd_level,
                );
                if encoder.is_err() {
                    let _ = std::fs::remove_file(&path);
                }
                encoder
            });
        match opened {
            Ok(encoder) => {
                tracing::debug!(path = %path.display(), "capture segment opened");
                self.segment = Some(Segment {
                    path,
                    encoder,
                    opened: Instant::now(),
                    dirty: false,
                    unflushed: 0,
                    durable: 0,
                    pending: 0,
                    pending_raw: 0,
                });
                // Every segment decodes on its own: deltas never reach into a previous one.
                let bound = self.shared.memory_bound;
                self.bases = DeltaBases::new(Some(bound));
                let header = Line::Segment(SegmentHeader {
                    format: format::FORMAT.into(),
                    recorder: self.tag.clone(),
                    seq: self.seq,
                    created_unix_ns: now_ns,
                    writer: env!("CARGO_PKG_VERSION").into(),
                    replica: Some(self.replica.clone()),
                    delta_bases_bytes: Some(bound),
                });
                if self.write_line(&header) {
                    Ok(())
                } else {
                    Err(Lost::WriteFailed)
                }
            }
            Err(e) => {
                self.failed(format!("open {}: {e}", path.display()));
                Err(Lost::WriteFailed)
            }
        }
    }

    /// Appends one line to the open segment; on failure abandons the segment.
    fn write_line(&mut self, line: &Line) -> bool {
        let Some(seg) = self.segment.as_mut() else {
            return false;
        };
        self.line.clear();
        if let Err(e) = serde_json::to_writer(&mut self.line, line) {
            tracing::error!(error = %e, "capture record not serialisable");
            return false;
        }
        self.line.push(b'\n');
        match seg.encoder.write_all(&self.line) {
            Ok(()) => {
                seg.dirty = true;
                seg.unflushed += self.line.len() as u64;
                true
            }
            Err(e) => {
                let msg = format!("write {}: {e}", seg.path.display());
                self.failed(msg);
                false
            }
        }
    }

    /// Flushes the open segment; what it held then counts as written. False if it failed.
    fn flush(&mut self) -> bool {
        let Some(mut seg) = self.segment.take() else {
            return true;
        };
        if !seg.dirty {
            self.segment = Some(seg);
            return true;
        }
        match seg.encoder.flush() {
            Ok(()) => {
                seg.dirty = false;
                seg.unflushed = 0;
                self.committed(&mut seg);
                self.segment = Some(seg);
                true
            }
            Err(e) => {
                let msg = format!("flush {}: {e}", seg.path.display());
                self.abandon_with(seg, msg);
                false
            }
        }
    }

    /// `seg`'s data reached the file: count its records and bytes as written.
    fn committed(&mut self, seg: &mut Segment) {
        let written = seg.encoder.get_ref().written;
        let counters = &self.shared.counters;
        counters
            .bytes_stored
            .fetch_add(written - seg.durable, Ordering::Relaxed);
        counters
            .records_written
            .fetch_add(seg.pending, Ordering::Relaxed);
        counters
            .bytes_raw
            .fetch_add(seg.pending_raw, Ordering::Relaxed);
        seg.durable = written;
        seg.pending = 0;
        seg.pending_raw = 0;
        self.failures = 0;
    }

    /// A failed open, write, flush or close: count it, log it once, abandon the segment and
    /// wait before the next attempt (the flush interval, doubled on every failure in a row).
    fn failed(&mut self, message: String) {
        if self.last_error.as_deref() != Some(message.as_str()) {
            tracing::error!(error = %message, "capture write failed; forwarding continues");
            self.last_error = Some(message);
        }
        self.shared
            .counters
            .write_errors
            .fetch_add(1, Ordering::Relaxed);
        if let Some(seg) = self.segment.take() {
            self.abandon(seg);
        }
        let interval = self.config.flush_interval();
        let wait = interval
            .saturating_mul(1u32 << self.failures.min(16))
            .min(MAX_RETRY_WAIT.max(interval));
        self.failures = self.failures.saturating_add(1);
        self.retry_at = Some(Instant::now() + wait);
    }

    /// `failed` for a segment already taken out of `self.segment`.
    fn abandon_with(&mut self, seg: Segment, message: String) {
        self.segment = Some(seg);
        self.failed(message);
    }

    /// Cuts a failed segment back to its last good flush (the frame stays readable up to
    /// there), or removes it when nothing reached it; its unflushed records are lost.
    fn abandon(&mut self, mut seg: Segment) {
        self.lost(Lost::WriteFailed, seg.pending);
        let cut = if seg.durable == 0 {
            drop(seg.encoder);
            std::fs::remove_file(&seg.path)
        } else {
            seg.encoder.get_mut().file.set_len(seg.durable)
        };
        if let Err(e) = cut {
            tracing::error!(path = %seg.path.display(), error = %e, "capture segment not cut back after a failed write");
        }
    }

    fn log_errors(&mut self) {
        if self.errors_unlogged > 0 {
            tracing::error!(
                records = self.errors_unlogged,
                error = self.last_error.as_deref().unwrap_or(""),
                "capture records lost"
            );
            self.errors_unlogged = 0;
        }
    }

    fn report_drops(&mut self) {
        let dropped = self.shared.counters.records_dropped.load(Ordering::Relaxed);
        if dropped <= self.drops_reported {
            return;
        }
        let count = dropped - self.drops_reported;
        tracing::warn!(
            count,
            total = dropped,
            "capture dropped records (queue full, memory bound or shutting down)"
        );
        self.drops_reported = dropped;
        if self.ensure_segment().is_ok() {
            self.write_line(&Line::Dropped(DroppedRecord {
                count,
                at_unix_ns: unix_ns(),
            }));
            if self.failures > 0 {
                self.flush();
            }
        }
    }

    fn rotate_if_full(&mut self) {
        if self
            .segment
            .as_ref()
            .is_some_and(|s| s.encoder.get_ref().written + s.unflushed >= self.config.rotate_bytes)
        {
            self.close_segment();
        }
    }

    /// Ends the zstd frame and syncs the file.
    fn close_segment(&mut self) {
        let Some(mut seg) = self.segment.take() else {
            return;
        };
        match seg.encoder.do_finish() {
            Ok(()) => {
                self.committed(&mut seg);
                let _ = seg.encoder.get_ref().file.sync_data();
            }
            Err(e) => {
                let msg = format!("close {}: {e}", seg.path.display());
                self.abandon_with(seg, msg);
            }
        }
    }

    /// Keeps this request body as its session's next delta base (empty when not kept whole),
    /// by the rule the reader follows too (see [`DeltaBases`]).
    fn remember(&mut self, c: &Captured) {
        let Some(key) = c.start.session_key.as_ref() else {
            return;
        };
        let body = if c.request_len == c.start.request_body.len() {
            c.start.request_body.clone()
        } else {
            Bytes::new()
        };
        self.bases.set(key, body);
    }

    fn encode(&self, c: &Captured) -> ExchangeRecord {
        let base = c.start.session_key.as_ref().and_then(|k| self.bases.get(k));
        encode(c, base, &self.redact)
    }
}

fn unix_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

fn micros(from: tokio::time::Instant, at: tokio::time::Instant) -> u64 {
    at.saturating_duration_since(from).as_micros() as u64
}

/// Builds the stored record of one exchange; `base` is the session's previous body.
pub(crate) fn encode(c: &Captured, base: Option<&Bytes>, redact: &Redactor) -> ExchangeRecord {
    let s = &c.start;
    let body = &s.request_body;
    let complete_request = c.request_len == body.len();
    let request_body = if !complete_request {
        StoredBody {
            len: c.request_len as u64,
            ..StoredBody::default()
        }
    } else {
        match base
            .filter(|b| !b.is_empty())
            .and_then(|b| Some((b, format::diff(b, body)?)))
        {
            Some((prev, (prefix, suffix))) => {
                let mut stored = StoredBody {
                    len: body.len() as u64,
                    base: Some(DeltaBase {
                        prefix_len: prefix as u64,
                        prefix_sha256: format::short_sha256(&prev[..prefix]),
                        suffix_len: suffix as u64,
                    }),
                    ..StoredBody::default()
                };
                stored.set_bytes(&body[prefix..body.len() - suffix]);
                stored
            }
            None => StoredBody::whole(body),
        }
    };
    let start = s.started_at;
    let response = c.head.as_ref().map(|(status, head_headers, _)| {
        let mut frame_us = Vec::with_capacity(c.frame_times.len());
        let mut prev = start;
        for (at, _) in &c.frame_times {
            frame_us.push(micros(prev, *at));
            prev = prev.max(*at);
        }
        let bytes: Vec<u8> = c.frames.concat();
        let sse = head_headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim_start().starts_with("text/event-stream"));
        let event_frames = if sse && c.drop_reason.is_none() {
            sse_event_frames(&c.frames)
        } else {
            Vec::new()
        };
        let total: usize = c.frame_times.iter().map(|f| f.1).sum();
        let body = if c.drop_reason.is_some() && bytes.len() != total {
            StoredBody {
                len: total as u64,
                ..StoredBody::default()
            }
        } else {
            StoredBody::whole(&bytes)
        };
        StoredResponse {
            status: status.as_u16(),
            headers: redact.headers(head_headers),
            body,
            frame_us,
            frame_len: c.frame_times.iter().map(|f| f.1 as u64).collect(),
            event_frames,
        }
    });
    let (end, error) = match &c.end {
        ExchangeEnd::Complete => (EndKind::Complete, None),
        ExchangeEnd::UpstreamError(e) => (EndKind::UpstreamError, Some(e.clone())),
        ExchangeEnd::ClientGone => (EndKind::ClientGone, None),
    };
    ExchangeRecord {
        id: c.id,
        session: s.session_key.clone(),
        key_source: s.key_source,
        backend: s.backend.clone(),
        start_unix_ns: s.started_unix_ns as u64,
        method: s.method.as_str().to_owned(),
        path: redact.path(&s.path_and_query),
        t: Offsets {
            received_us: micros(start, s.request_received_at),
            head_us: c.head.as_ref().map(|h| micros(start, h.2)),
            first_byte_us: c.frame_times.first().map(|f| micros(start, f.0)),
            first_token_us: first_token_us(c, start),
            end_us: micros(start, c.end_at),
        },
        request: StoredRequest {
            headers: redact.headers(&s.request_headers),
            body: request_body,
        },
        response,
        end,
        error,
        complete: c.drop_reason.is_none(),
        drop_reason: c.drop_reason.map(str::to_owned),
    }
}

/// When the frame completing a stream's first token event was forwarded.
fn first_token_us(c: &Captured, start: tokio::time::Instant) -> Option<u64> {
    let sse = c.head.as_ref()?.1.get(http::header::CONTENT_TYPE)?;
    if !sse
        .as_bytes()
        .trim_ascii_start()
        .starts_with(b"text/event-stream")
    {
        return None;
    }
    let frame = crate::wire::sse::first_token_frame(&c.frames)?;
    c.frame_times.get(frame).map(|f| micros(start, f.0))
}

/// For each SSE event, the index of the frame whose bytes completed it (a blank line ends an
/// event), delta-coded against the previous event's frame index.
fn sse_event_frames(frames: &[Bytes]) -> Vec<u64> {
    let mut out = Vec::new();
    let mut line_len = 0usize;
    let mut event_open = false;
    let mut last = 0u64;
    for (i, frame) in frames.iter().enumerate() {
        for &b in frame.iter() {
            match b {
                b'\n' => {
                    if line_len == 0 {
                        if event_open {
                            out.push(i as u64 - last);
                            last = i as u64;
                            event_open = false;
                        }
                    } else {
                        event_open = true;
                    }
                    line_len = 0;
                }
                b'\r' => {}
                _ => line_len += 1,
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The delta bases the writer keeps per session stay within `memory_bound_bytes` with
    /// their keys counted: a client that sends a new 60 KiB session key with every small
    /// request cannot grow them past the bound.
    #[test]
    fn session_bases_count_their_keys_against_the_memory_bound() {
        let config = CaptureConfig {
            memory_bound_bytes: 1024 * 1024,
            ..CaptureConfig::default()
        };
        let (queue, _rx) = super::super::sink::queue(&config);
        let redact = config.redactor().unwrap();
        let mut writer = Writer::new(config, redact, queue.shared);
        let now = tokio::time::Instant::now();
        for i in 0..100 {
            let mut key = format!("{i:08}-");
            key.extend(std::iter::repeat_n('k', 60 * 1024 - key.len()));
            let body = Bytes::from_static(b"{}");
            writer.remember(&Captured {
                id: i,
                start: crate::tap::ExchangeStart {
                    session_key: Some(key),
                    key_source: crate::tap::KeySource::Header,
                    backend: "a".into(),
                    started_unix_ns: 0,
                    started_at: now,
                    request_received_at: now,
                    method: http::Method::POST,
                    path_and_query: "/v1/chat/completions".into(),
                    request_headers: http::HeaderMap::new(),
                    request_body: body.clone(),
                },
                request_len: body.len(),
                head: None,
                frame_times: Vec::new(),
                frames: Vec::new(),
                end: ExchangeEnd::Complete,
                end_at: now,
                drop_reason: None,
                held: 0,
            });
        }
        let kept = writer.bases.bytes();
        assert!(kept <= 1024 * 1024, "{kept} bytes of session bases kept");
        assert!(kept >= 16 * (60 * 1024 + 2), "{kept}: too few kept");
        assert!(writer
            .bases
            .contains(&format!("{:08}-{}", 99, "k".repeat(60 * 1024 - 9))));
    }

    #[test]
    fn sse_events_are_stamped_with_the_frame_that_completes_them() {
        let frames: Vec<Bytes> = vec![
            Bytes::from_static(b"data: {\"a\":1}\n\n"),
            Bytes::from_static(b"data: {\"a\""),
            Bytes::from_static(b":2}\n"),
            Bytes::from_static(b"\ndata: x\r\n\r\ndata: y\n\n"),
            Bytes::from_static(b": comment only\n\ndata: [DONE]\n\n"),
        ];
        // Events complete in frames 0, 3, 3, 3, 4, 4 (the comment block counts as one).
        assert_eq!(sse_event_frames(&frames), vec![0, 3, 0, 0, 1, 0]);
    }
}
