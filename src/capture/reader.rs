//! Reads capture segments back: every complete record of a segment, even one whose writer was
//! killed mid-frame (the cut is reported, not fatal), with request bodies rebuilt from their
//! per-session deltas. The bases those deltas refer to are forgotten by the rule the writer
//! followed (`bases::DeltaBases`), so a segment reads within the bound its header records.

use bytes::Bytes;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use super::bases::DeltaBases;
use super::format::{self, DroppedRecord, ExchangeRecord, Line, SegmentHeader, StoredBody};
use super::spill::BaseSpill;
use super::CaptureError;

/// One exchange with its bodies rebuilt.
#[derive(Debug, Clone)]
pub struct Exchange {
    /// The record as stored (its request body may be a delta).
    pub record: ExchangeRecord,
    /// The whole request body; `None` when the recorder left it out (`complete: false`).
    pub request_body: Option<Vec<u8>>,
    /// The whole response body; `None` when left out or when no response arrived.
    pub response_body: Option<Vec<u8>>,
}

impl Exchange {
    /// Offset of each forwarded response frame from the start (µs).
    pub fn frame_offsets_us(&self) -> Vec<u64> {
        let Some(r) = &self.record.response else {
            return Vec::new();
        };
        r.frame_us
            .iter()
            .scan(0u64, |t, d| {
                *t += d;
                Some(*t)
            })
            .collect()
    }

    /// Offset of each SSE event from the start (µs): when the frame completing it arrived.
    pub fn event_offsets_us(&self) -> Vec<u64> {
        let Some(r) = &self.record.response else {
            return Vec::new();
        };
        let frames = self.frame_offsets_us();
        let mut idx = 0u64;
        r.event_frames
            .iter()
            .filter_map(|d| {
                idx += d;
                frames.get(idx as usize).copied()
            })
            .collect()
    }

    /// Wall-clock end (ns since the Unix epoch).
    pub fn end_unix_ns(&self) -> u64 {
        self.record.start_unix_ns + self.record.t.end_us * 1000
    }

    /// The record with both bodies stored whole, as `capture cat` prints it.
    pub fn expanded(&self) -> ExchangeRecord {
        let mut r = self.record.clone();
        if let Some(body) = &self.request_body {
            r.request.body = StoredBody::whole(body);
        }
        if let (Some(resp), Some(body)) = (r.response.as_mut(), &self.response_body) {
            resp.body = StoredBody::whole(body);
        }
        r
    }
}

/// One line of a segment, decoded.
#[derive(Debug, Clone)]
pub enum Entry {
    /// The segment's header.
    Segment(SegmentHeader),
    /// An exchange.
    Exchange(Box<Exchange>),
    /// Records the recorder dropped.
    Dropped(DroppedRecord),
}

/// Where a segment stops being readable, and why.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Cut {
    /// The segment.
    pub segment: PathBuf,
    /// Complete lines read before the cut (the header line included).
    pub records: u64,
    /// What was found there.
    pub reason: String,
}

impl std::fmt::Display for Cut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: cut after {} complete lines: {}",
            self.segment.display(),
            self.records,
            self.reason
        )
    }
}

/// The segment files of `dir`, in name (= time) order.
pub fn segments(dir: &Path) -> Result<Vec<PathBuf>, CaptureError> {
    let entries = std::fs::read_dir(dir).map_err(|e| CaptureError::io(dir, e))?;
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| CaptureError::io(dir, e))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(format::SEGMENT_PREFIX) && name.ends_with(format::SEGMENT_SUFFIX) {
            out.push(entry.path());
        }
    }
    out.sort();
    Ok(out)
}

/// Streams the lines of one segment.
pub struct SegmentReader {
    path: PathBuf,
    lines: BufReader<zstd::stream::read::Decoder<'static, BufReader<File>>>,
    bases: DeltaBases,
    /// Where an export keeps the bases beyond its memory budget.
    spill: Option<BaseSpill>,
    records: u64,
    buf: Vec<u8>,
    cut: Option<Cut>,
    /// A failure of the spill file: not the segment's fault, so not a cut; it ends the read.
    failed: Option<CaptureError>,
    done: bool,
}

/// Why a line could not be decoded: the segment's content (a cut), or the spill file.
enum DecodeError {
    Segment(String),
    Spill(CaptureError),
}

impl From<String> for DecodeError {
    fn from(e: String) -> Self {
        DecodeError::Segment(e)
    }
}

impl From<&str> for DecodeError {
    fn from(e: &str) -> Self {
        DecodeError::Segment(e.to_owned())
    }
}

impl SegmentReader {
    /// Opens a segment.
    pub fn open(path: &Path) -> Result<SegmentReader, CaptureError> {
        let file = File::open(path).map_err(|e| CaptureError::io(path, e))?;
        let decoder =
            zstd::stream::read::Decoder::new(file).map_err(|e| CaptureError::io(path, e))?;
        Ok(SegmentReader {
            path: path.to_path_buf(),
            lines: BufReader::with_capacity(256 * 1024, decoder),
            bases: DeltaBases::new(None),
            spill: None,
            records: 0,
            buf: Vec::new(),
            cut: None,
            failed: None,
            done: false,
        })
    }

    /// Keeps the delta bases through `spill`: in memory within the export's budget for
    /// them, beyond it in the spill's file.
    pub(crate) fn spilling_bases(mut self, spill: BaseSpill) -> SegmentReader {
        self.bases = DeltaBases::with_spill(None, Some(spill.clone()));
        self.spill = Some(spill);
        self
    }

    /// The spill file's failure that ended the read early, if one did.
    pub(crate) fn take_failure(&mut self) -> Option<CaptureError> {
        self.failed.take()
    }

    /// Bytes held to rebuild the deltas still to come (session keys plus previous request
    /// bodies): within the header's `delta_bases_bytes` when it has one, as the writer's were.
    pub fn base_bytes(&self) -> u64 {
        self.bases.bytes()
    }

    /// Where the segment stopped being readable, once iteration has ended there.
    pub fn cut(&self) -> Option<&Cut> {
        self.cut.as_ref()
    }

    fn stop(&mut self, reason: String) -> Option<Entry> {
        self.done = true;
        self.cut = Some(Cut {
            segment: self.path.clone(),
            records: self.records,
            reason,
        });
        None
    }

    fn decode(&mut self, line: Line) -> Result<Entry, DecodeError> {
        match line {
            Line::Segment(h) => {
                if self.records != 0 {
                    return Err("a second segment header".into());
                }
                if h.format != format::FORMAT {
                    return Err(format!(
                        "format {:?} is not the supported {:?}",
                        h.format,
                        format::FORMAT
                    )
                    .into());
                }
                self.bases = DeltaBases::with_spill(h.delta_bases_bytes, self.spill.clone());
                Ok(Entry::Segment(h))
            }
            _ if self.records == 0 => Err("the segment does not start with its header".into()),
            Line::Dropped(d) => Ok(Entry::Dropped(d)),
            Line::Exchange(record) => {
                let request_body = self.rebuild_request(&record)?;
                let response_body = match &record.response {
                    Some(r) if has_bytes(&r.body) => Some(r.body.stored_bytes()?),
                    _ => None,
                };
                Ok(Entry::Exchange(Box::new(Exchange {
                    record: *record,
                    request_body,
                    response_body,
                })))
            }
        }
    }

    fn rebuild_request(&mut self, record: &ExchangeRecord) -> Result<Option<Vec<u8>>, DecodeError> {
        let stored = &record.request.body;
        if !has_bytes(stored) {
            // The writer kept an empty base for it: so does the reader, to forget the same.
            if let Some(key) = &record.session {
                self.bases
                    .try_set(key, Bytes::new())
                    .map_err(DecodeError::Spill)?;
            }
            return Ok(None);
        }
        let middle = stored.stored_bytes()?;
        let body = match &stored.base {
            None => middle,
            Some(base) => {
                let prev = match &record.session {
                    Some(k) => self.bases.fetch(k).map_err(DecodeError::Spill)?,
                    None => None,
                }
                .ok_or("delta without a previous request of its session")?;
                format::patch(&prev, base, &middle)?
            }
        };
        if body.len() as u64 != stored.len {
            return Err(format!(
                "request body rebuilt to {} bytes, the record says {}",
                body.len(),
                stored.len
            )
            .into());
        }
        if let Some(key) = &record.session {
            self.bases
                .try_set(key, Bytes::from(body.clone()))
                .map_err(DecodeError::Spill)?;
        }
        Ok(Some(body))
    }
}

/// True when the body's bytes were kept (an empty body counts as kept).
fn has_bytes(body: &StoredBody) -> bool {
    body.len == 0 || body.text.is_some() || body.hex.is_some() || body.base.is_some()
}

impl Iterator for SegmentReader {
    type Item = Entry;

    fn next(&mut self) -> Option<Entry> {
        if self.done {
            return None;
        }
        self.buf.clear();
        match self.lines.read_until(b'\n', &mut self.buf) {
            Ok(0) => {
                self.done = true;
                None
            }
            Ok(_) if self.buf.last() != Some(&b'\n') => self.stop(format!(
                "the last record is incomplete ({} bytes without a line end)",
                self.buf.len()
            )),
            Ok(_) => {
                let line: Line = match serde_json::from_slice(&self.buf) {
                    Ok(l) => l,
                    Err(e) => return self.stop(format!("record {}: {e}", self.records + 1)),
                };
                match self.decode(line) {
                    Ok(entry) => {
                        self.records += 1;
                        Some(entry)
                    }
                    Err(DecodeError::Segment(e)) => {
                        self.stop(format!("record {}: {e}", self.records + 1))
                    }
                    Err(DecodeError::Spill(e)) => {
                        self.done = true;
                        self.failed = Some(e);
                        None
                    }
                }
            }
            Err(e) => self.stop(format!(
                "ends inside a compression frame ({e}): still being written, \
                 or its writer stopped without closing it"
            )),
        }
    }
}

/// Everything readable in a capture directory.
#[derive(Debug, Default)]
pub struct Capture {
    /// Exchanges in file order: the order they ended in, which is not always the order
    /// their requests started in (sort by `record.id` or `record.start_unix_ns` for that).
    pub exchanges: Vec<Exchange>,
    /// Records the recorder reported dropped.
    pub dropped: u64,
    /// Segments read.
    pub segments: Vec<PathBuf>,
    /// Segments that end early.
    pub cuts: Vec<Cut>,
}

/// Calls `f` for every entry of every segment of `dir`, in order; returns the cuts.
pub fn for_each(
    dir: &Path,
    mut f: impl FnMut(&Path, Entry) -> Result<(), CaptureError>,
) -> Result<Vec<Cut>, CaptureError> {
    let mut cuts = Vec::new();
    for path in segments(dir)? {
        let mut reader = SegmentReader::open(&path)?;
        for entry in reader.by_ref() {
            f(&path, entry)?;
        }
        if let Some(cut) = reader.cut() {
            cuts.push(cut.clone());
        }
    }
    Ok(cuts)
}

/// Reads a whole capture directory into memory.
pub fn read_dir(dir: &Path) -> Result<Capture, CaptureError> {
    let mut capture = Capture {
        segments: segments(dir)?,
        ..Capture::default()
    };
    capture.cuts = for_each(dir, |_, entry| {
        capture.add(entry);
        Ok(())
    })?;
    Ok(capture)
}

impl Capture {
    /// Keeps an exchange, counts a drop; segment headers are listed in `segments` already.
    pub(crate) fn add(&mut self, entry: Entry) {
        match entry {
            Entry::Exchange(e) => self.exchanges.push(*e),
            Entry::Dropped(d) => self.dropped += d.count,
            Entry::Segment(_) => {}
        }
    }
}
