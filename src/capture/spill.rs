//! The spill files of an export, so that its memory is bounded by one budget plus one
//! session, not by the capture or the number of replicas: turns are sorted by session in runs
//! of at most their share of the budget (spilled next to the output), then merged back one
//! session at a time; the rows built from them are kept (in memory up to their share, then
//! on disk) until they are written in the order their conversations first appeared; and the
//! delta bases every replica's reader keeps (each session's last request, 10s of KiB per
//! session) stay in memory up to their share, beyond it in a file.

use std::collections::BinaryHeap;
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use bytes::Bytes;

use super::CaptureError;

/// Which turns belong together: those of a session key, or a keyless exchange alone.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Group {
    Session(String),
    Alone(u64),
}

/// A chat exchange as the export keeps it between reading the capture and building rows.
#[derive(Debug)]
pub(crate) struct Spilled {
    pub group: Group,
    pub start_unix_ns: u64,
    /// Reading order, for turns of a session stamped with the same start.
    pub seq: u64,
    /// The exchange's id.
    pub id: u64,
    pub end_unix_ns: u64,
    /// The whole request body.
    pub body: Vec<u8>,
    /// The recorded reply (an assistant message) as JSON; empty when there is none.
    pub reply: Vec<u8>,
}

impl Spilled {
    fn order(&self) -> (&Group, u64, u64) {
        (&self.group, self.start_unix_ns, self.seq)
    }

    /// Bytes it holds, as the buffer counts them.
    fn size(&self) -> usize {
        let key = match &self.group {
            Group::Session(k) => k.len(),
            Group::Alone(_) => 0,
        };
        std::mem::size_of::<Spilled>() + key + self.body.len() + self.reply.len()
    }

    fn write_to(&self, w: &mut impl Write) -> std::io::Result<()> {
        match &self.group {
            Group::Session(k) => {
                w.write_all(&[0])?;
                put_bytes(w, k.as_bytes())?;
            }
            Group::Alone(id) => {
                w.write_all(&[1])?;
                w.write_all(&id.to_le_bytes())?;
            }
        }
        for n in [self.start_unix_ns, self.seq, self.id, self.end_unix_ns] {
            w.write_all(&n.to_le_bytes())?;
        }
        put_bytes(w, &self.body)?;
        put_bytes(w, &self.reply)
    }

    /// The next record of a run; `None` at its end.
    fn read_from(r: &mut impl Read) -> std::io::Result<Option<Spilled>> {
        let mut tag = [0u8; 1];
        if r.read(&mut tag)? == 0 {
            return Ok(None);
        }
        let group = match tag[0] {
            0 => Group::Session(
                String::from_utf8(get_bytes(r)?)
                    .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?,
            ),
            _ => Group::Alone(get_u64(r)?),
        };
        Ok(Some(Spilled {
            group,
            start_unix_ns: get_u64(r)?,
            seq: get_u64(r)?,
            id: get_u64(r)?,
            end_unix_ns: get_u64(r)?,
            body: get_bytes(r)?,
            reply: get_bytes(r)?,
        }))
    }
}

fn put_bytes(w: &mut impl Write, b: &[u8]) -> std::io::Result<()> {
    w.write_all(&(b.len() as u64).to_le_bytes())?;
    w.write_all(b)
}

fn get_u64(r: &mut impl Read) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

fn get_bytes(r: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let len = get_u64(r)?;
    let mut b = Vec::new();
    r.take(len).read_to_end(&mut b)?;
    if b.len() as u64 != len {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    Ok(b)
}

/// A directory of spill files beside the output (not in `/tmp`, which may be memory), made
/// when first needed and removed with everything in it when dropped.
struct SpillDir {
    path: PathBuf,
    made: bool,
}

impl SpillDir {
    fn new(out: &Path, what: &str) -> SpillDir {
        let name = out.file_name().unwrap_or_default().to_string_lossy();
        let path = out.with_file_name(format!(".{name}.{what}-{}", std::process::id()));
        SpillDir { path, made: false }
    }

    fn create(&mut self, name: &str) -> Result<(PathBuf, File), CaptureError> {
        if !self.made {
            std::fs::create_dir_all(&self.path).map_err(|e| CaptureError::io(&self.path, e))?;
            self.made = true;
        }
        let path = self.path.join(name);
        let file = File::create(&path).map_err(|e| CaptureError::io(&path, e))?;
        Ok((path, file))
    }
}

impl Drop for SpillDir {
    fn drop(&mut self) {
        if self.made {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// Turns in, turns out sorted by `(group, start, seq)`, holding at most `budget` bytes.
pub(crate) struct Sorter {
    dir: SpillDir,
    budget: usize,
    held: usize,
    /// Most bytes held at once, for the export's report.
    peak: usize,
    buf: Vec<Spilled>,
    runs: Vec<PathBuf>,
    /// Run files made so far (spilled from the buffer or merged from other runs).
    files: usize,
    /// Runs spilled from the buffer.
    spilled: usize,
}

/// Most runs read at once: each open run holds a zstd decoder's window and a read buffer
/// (about 0.6 MiB), so a capture many times the budget is merged in passes of this many runs
/// rather than with one decoder per run, which would grow with the capture.
const MAX_OPEN_RUNS: usize = 16;

impl Sorter {
    /// A sorter for the export to `out`, holding up to `budget` bytes of turns.
    pub(super) fn new(out: &Path, budget: usize) -> Sorter {
        Sorter {
            dir: SpillDir::new(out, "turns"),
            budget,
            held: 0,
            peak: 0,
            buf: Vec::new(),
            runs: Vec::new(),
            files: 0,
            spilled: 0,
        }
    }

    /// Takes one turn; when it would take the buffer past the budget, the buffer goes to disk
    /// as a sorted run first (and a turn larger than the whole budget goes as a run of its
    /// own), so the buffer never holds more than the budget.
    pub(super) fn push(&mut self, turn: Spilled) -> Result<(), CaptureError> {
        let size = turn.size();
        if self.held + size > self.budget && !self.buf.is_empty() {
            self.spill()?;
        }
        self.held += size;
        self.buf.push(turn);
        if self.held > self.budget {
            self.spill()?;
        }
        self.peak = self.peak.max(self.held);
        Ok(())
    }

    /// Most bytes of turns held at once.
    pub(super) fn peak(&self) -> usize {
        self.peak
    }

    fn spill(&mut self) -> Result<(), CaptureError> {
        self.buf.sort_unstable_by(|a, b| a.order().cmp(&b.order()));
        let turns = std::mem::take(&mut self.buf).into_iter().map(Ok);
        let path = self.write_run(turns)?;
        self.held = 0;
        self.spilled += 1;
        self.runs.push(path);
        Ok(())
    }

    /// Writes sorted turns to a new run file.
    fn write_run(
        &mut self,
        turns: impl Iterator<Item = Result<Spilled, CaptureError>>,
    ) -> Result<PathBuf, CaptureError> {
        let (path, file) = self.dir.create(&format!("run-{:06}.zst", self.files))?;
        self.files += 1;
        let io = |e| CaptureError::io(&path, e);
        // Level 1: a run is read once, soon; the session's turns side by side compress well.
        let mut w = zstd::stream::write::Encoder::new(BufWriter::new(file), 1).map_err(io)?;
        for turn in turns {
            turn?.write_to(&mut w).map_err(io)?;
        }
        w.finish().map_err(io)?.flush().map_err(io)?;
        Ok(path)
    }

    /// Every turn taken, in order. Runs spilled from the buffer: [`Sorted::runs`].
    pub(super) fn finish(mut self) -> Result<Sorted, CaptureError> {
        // Merge passes until the runs left, and the buffer, can be read at once.
        while self.runs.len() >= MAX_OPEN_RUNS {
            let group: Vec<PathBuf> = self.runs.drain(..MAX_OPEN_RUNS).collect();
            let mut merged = Sorted::open(&group, Vec::new(), None, 0)?;
            let path = self.write_run(std::iter::from_fn(|| merged.next_turn().transpose()))?;
            drop(merged);
            for old in &group {
                let _ = std::fs::remove_file(old);
            }
            self.runs.push(path);
        }
        self.buf.sort_unstable_by(|a, b| a.order().cmp(&b.order()));
        let memory = std::mem::take(&mut self.buf);
        Sorted::open(&self.runs, memory, Some(self.dir), self.spilled)
    }
}

enum Source {
    Memory(std::vec::IntoIter<Spilled>),
    Run(
        PathBuf,
        BufReader<zstd::stream::read::Decoder<'static, BufReader<File>>>,
    ),
}

/// The head of one source, ordered so that the heap's top is the least turn.
struct Head(Spilled, usize);

impl PartialEq for Head {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == std::cmp::Ordering::Equal
    }
}
impl Eq for Head {}
impl PartialOrd for Head {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Head {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other.0.order().cmp(&self.0.order())
    }
}

/// The sorted turns: the runs merged, one turn of each held at a time.
pub(crate) struct Sorted {
    sources: Vec<Source>,
    heap: BinaryHeap<Head>,
    runs: usize,
    _dir: Option<SpillDir>,
}

impl Sorted {
    /// The turns of the run files `paths` and of `memory` (sorted) merged; `dir`, when
    /// given, is removed when they have been read.
    fn open(
        paths: &[PathBuf],
        memory: Vec<Spilled>,
        dir: Option<SpillDir>,
        runs: usize,
    ) -> Result<Sorted, CaptureError> {
        let mut sources = Vec::new();
        for path in paths {
            let file = File::open(path).map_err(|e| CaptureError::io(path, e))?;
            let decoder =
                zstd::stream::read::Decoder::new(file).map_err(|e| CaptureError::io(path, e))?;
            sources.push(Source::Run(path.clone(), BufReader::new(decoder)));
        }
        sources.push(Source::Memory(memory.into_iter()));
        let mut sorted = Sorted {
            heap: BinaryHeap::with_capacity(sources.len()),
            sources,
            runs,
            _dir: dir,
        };
        for i in 0..sorted.sources.len() {
            sorted.refill(i)?;
        }
        Ok(sorted)
    }

    /// Runs that were written to disk (0 when every turn fitted in the buffer).
    pub(super) fn runs(&self) -> usize {
        self.runs
    }

    fn refill(&mut self, i: usize) -> Result<(), CaptureError> {
        let next = match &mut self.sources[i] {
            Source::Memory(it) => it.next(),
            Source::Run(path, r) => Spilled::read_from(r).map_err(|e| CaptureError::io(path, e))?,
        };
        if let Some(turn) = next {
            self.heap.push(Head(turn, i));
        }
        Ok(())
    }

    /// The next turn in `(group, start, seq)` order.
    pub(super) fn next_turn(&mut self) -> Result<Option<Spilled>, CaptureError> {
        let Some(Head(turn, i)) = self.heap.pop() else {
            return Ok(None);
        };
        self.refill(i)?;
        Ok(Some(turn))
    }
}

/// Rows of finished conversations, written out at the end in the order the conversations
/// first appeared; held in memory up to a budget, then in a file.
pub(crate) struct RowStore {
    dir: SpillDir,
    budget: usize,
    mem: Vec<u8>,
    file: Option<(PathBuf, BufWriter<File>)>,
    len: u64,
    /// `(first start, conversation number, offset, length)` per conversation.
    index: Vec<(u64, u64, u64, u64)>,
    /// Most bytes of rows held in memory at once, for the export's report.
    peak: usize,
}

impl RowStore {
    /// A store for the export to `out`, holding up to `budget` bytes of rows in memory.
    pub(super) fn new(out: &Path, budget: usize) -> RowStore {
        RowStore {
            dir: SpillDir::new(out, "rows"),
            budget,
            mem: Vec::new(),
            file: None,
            len: 0,
            index: Vec::new(),
            peak: 0,
        }
    }

    /// Most bytes of rows held in memory at once.
    pub(super) fn peak(&self) -> usize {
        self.peak
    }

    /// Keeps one conversation's rows (JSON lines), which started at `first_start_unix_ns`.
    pub(super) fn add(
        &mut self,
        first_start_unix_ns: u64,
        rows: &[u8],
    ) -> Result<(), CaptureError> {
        let n = self.index.len() as u64;
        self.index
            .push((first_start_unix_ns, n, self.len, rows.len() as u64));
        self.len += rows.len() as u64;
        if self.file.is_none() && self.mem.len() + rows.len() > self.budget {
            let (path, file) = self.dir.create("rows.jsonl")?;
            let mut w = BufWriter::new(file);
            w.write_all(&self.mem)
                .map_err(|e| CaptureError::io(&path, e))?;
            self.mem = Vec::new();
            self.file = Some((path, w));
        }
        match &mut self.file {
            Some((path, w)) => w.write_all(rows).map_err(|e| CaptureError::io(path, e)),
            None => {
                self.mem.extend_from_slice(rows);
                self.peak = self.peak.max(self.mem.len());
                Ok(())
            }
        }
    }

    /// Writes every conversation's rows to `w`, in order of first appearance.
    pub(super) fn write_ordered(
        mut self,
        w: &mut dyn Write,
        out: &Path,
    ) -> Result<(), CaptureError> {
        self.index.sort_unstable();
        let Some((path, file)) = self.file.take() else {
            for &(_, _, at, len) in &self.index {
                let range = at as usize..(at + len) as usize;
                w.write_all(&self.mem[range])
                    .map_err(|e| CaptureError::io(out, e))?;
            }
            return Ok(());
        };
        let io = |e| CaptureError::io(&path, e);
        file.into_inner().map_err(|e| io(e.into_error()))?;
        let mut file = File::open(&path).map_err(io)?;
        let mut buf = Vec::new();
        for &(_, _, at, len) in &self.index {
            buf.resize(len as usize, 0);
            file.seek(SeekFrom::Start(at)).map_err(io)?;
            file.read_exact(&mut buf).map_err(io)?;
            w.write_all(&buf).map_err(|e| CaptureError::io(out, e))?;
        }
        Ok(())
    }
}

/// Where a delta base is kept: in memory, or in the export's base file (a slot of it).
#[derive(Debug, Clone)]
pub(crate) enum Kept {
    Memory(Bytes),
    Slot(usize),
}

/// The delta bases of every replica's reader, kept in memory up to one budget for them all
/// and beyond it in a file beside the output: a fleet's readers each keep the last request of
/// every session of their segment (up to the recorder's own bound, 256 MiB by default), so
/// without this an export of R replicas would hold R times that, growing with the sessions.
/// Shared by the readers of one export (one thread; the lock is never contended).
#[derive(Clone)]
pub(crate) struct BaseSpill(Arc<Mutex<BaseFile>>);

struct BaseFile {
    dir: SpillDir,
    file: Option<(PathBuf, File)>,
    /// Files made so far, for the name of the next one (compaction makes a new file).
    files: u64,
    budget: u64,
    held: u64,
    peak: u64,
    /// Bases written to the file.
    spilled: u64,
    /// `(offset, length)` per slot; a freed slot is listed in `free` for reuse.
    slots: Vec<(u64, u64)>,
    free: Vec<usize>,
    /// Bytes written to the file, and those of them in slots still in use.
    end: u64,
    live: u64,
}

/// Below this many dead bytes the base file is not worth compacting.
const BASE_FILE_SLACK: u64 = 64 << 20;

impl BaseSpill {
    /// Bases for the export to `out`, holding up to `budget` bytes in memory.
    pub(super) fn new(out: &Path, budget: u64) -> BaseSpill {
        BaseSpill(Arc::new(Mutex::new(BaseFile {
            dir: SpillDir::new(out, "bases"),
            file: None,
            files: 0,
            budget,
            held: 0,
            peak: 0,
            spilled: 0,
            slots: Vec::new(),
            free: Vec::new(),
            end: 0,
            live: 0,
        })))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BaseFile> {
        // A panic while holding it ends the export anyway; the counts are still usable.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts `n` bytes that stay in memory whatever the budget (a session key).
    pub(crate) fn hold(&self, n: u64) {
        let mut f = self.lock();
        f.held += n;
        f.peak = f.peak.max(f.held);
    }

    /// Stops counting `n` bytes held in memory.
    pub(crate) fn unhold(&self, n: u64) {
        let mut f = self.lock();
        f.held = f.held.saturating_sub(n);
    }

    /// Keeps `body` in memory when the budget has room for it, else in the file.
    pub(crate) fn keep(&self, body: Bytes) -> Result<Kept, CaptureError> {
        let mut f = self.lock();
        let len = body.len() as u64;
        if f.held + len <= f.budget {
            f.held += len;
            f.peak = f.peak.max(f.held);
            return Ok(Kept::Memory(body));
        }
        f.write(&body)
            .map(Kept::Slot)
            .map_err(|e| CaptureError::io(&f.dir.path, e))
    }

    /// The body kept in `slot`.
    pub(crate) fn read(&self, slot: usize) -> Result<Bytes, CaptureError> {
        let mut f = self.lock();
        let (at, len) = f.slots[slot];
        let mut buf = vec![0; len as usize];
        let read = match f.file.as_mut() {
            Some((_, file)) => file
                .seek(SeekFrom::Start(at))
                .and_then(|_| file.read_exact(&mut buf)),
            None => Err(std::io::ErrorKind::NotFound.into()),
        };
        read.map_err(|e| CaptureError::io(&f.dir.path, e))?;
        Ok(Bytes::from(buf))
    }

    /// Lets go of a kept body.
    pub(crate) fn release(&self, kept: &Kept) {
        let mut f = self.lock();
        match kept {
            Kept::Memory(b) => f.held = f.held.saturating_sub(b.len() as u64),
            Kept::Slot(slot) => {
                f.live -= f.slots[*slot].1;
                f.slots[*slot] = (0, 0);
                f.free.push(*slot);
            }
        }
    }

    /// Most bytes held in memory at once (keys and bodies).
    pub(super) fn peak(&self) -> u64 {
        self.lock().peak
    }

    /// Bases written to the file.
    pub(super) fn spilled(&self) -> u64 {
        self.lock().spilled
    }
}

impl BaseFile {
    fn write(&mut self, body: &[u8]) -> std::io::Result<usize> {
        if self.end - self.live > BASE_FILE_SLACK.max(self.live) {
            self.compact()?;
        }
        if self.file.is_none() {
            self.file = Some(self.create()?);
        }
        let (_, file) = self.file.as_mut().expect("just made");
        file.seek(SeekFrom::Start(self.end))?;
        file.write_all(body)?;
        let entry = (self.end, body.len() as u64);
        self.end += entry.1;
        self.live += entry.1;
        self.spilled += 1;
        Ok(match self.free.pop() {
            Some(slot) => {
                self.slots[slot] = entry;
                slot
            }
            None => {
                self.slots.push(entry);
                self.slots.len() - 1
            }
        })
    }

    fn create(&mut self) -> std::io::Result<(PathBuf, File)> {
        std::fs::create_dir_all(&self.dir.path)?;
        self.dir.made = true;
        let path = self.dir.path.join(format!("bases-{:06}", self.files));
        self.files += 1;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)?;
        Ok((path, file))
    }

    /// Copies the slots in use to a new file, so that the file holds at most twice the bases
    /// it keeps (plus the slack) however often they are replaced.
    fn compact(&mut self) -> std::io::Result<()> {
        let Some((old_path, mut old)) = self.file.take() else {
            return Ok(());
        };
        let (path, file) = self.create()?;
        let mut w = BufWriter::new(file);
        let mut end = 0;
        let mut buf = Vec::new();
        for slot in 0..self.slots.len() {
            let (at, len) = self.slots[slot];
            if len == 0 {
                continue;
            }
            buf.resize(len as usize, 0);
            old.seek(SeekFrom::Start(at))?;
            old.read_exact(&mut buf)?;
            w.write_all(&buf)?;
            self.slots[slot] = (end, len);
            end += len;
        }
        let file = w.into_inner().map_err(|e| e.into_error())?;
        drop(old);
        let _ = std::fs::remove_file(&old_path);
        self.file = Some((path, file));
        self.end = end;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turn(key: &str, start: u64, seq: u64) -> Spilled {
        Spilled {
            group: Group::Session(key.into()),
            start_unix_ns: start,
            seq,
            id: seq,
            end_unix_ns: start + 1,
            body: vec![b'x'; 100],
            reply: b"{}".to_vec(),
        }
    }

    #[test]
    fn turns_come_back_by_session_then_start_across_spilled_runs() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out.jsonl");
        let mut sorter = Sorter::new(&out, 1000);
        let mut seq = 0;
        for start in (0..20).rev() {
            for key in ["b", "a", "c"] {
                seq += 1;
                sorter.push(turn(key, start, seq)).unwrap();
            }
        }
        sorter
            .push(Spilled {
                group: Group::Alone(7),
                ..turn("", 5, 99)
            })
            .unwrap();
        let mut sorted = sorter.finish().unwrap();
        assert!(sorted.runs() > 3, "{}", sorted.runs());
        let mut got = Vec::new();
        while let Some(t) = sorted.next_turn().unwrap() {
            assert_eq!(t.body.len(), 100);
            got.push((t.group, t.start_unix_ns));
        }
        let mut want: Vec<(Group, u64)> = ["a", "b", "c"]
            .iter()
            .flat_map(|k| (0..20).map(|s| (Group::Session(k.to_string()), s)))
            .collect();
        want.push((Group::Alone(7), 5));
        assert_eq!(got, want);
        let spill = out.with_file_name(format!(".out.jsonl.turns-{}", std::process::id()));
        assert!(spill.exists());
        drop(sorted);
        assert!(!spill.exists(), "the spill directory is removed");
    }

    #[test]
    fn many_runs_are_merged_in_passes_and_still_come_back_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out.jsonl");
        // Each turn takes its own run: 3 x 40 runs, several passes' worth.
        let mut sorter = Sorter::new(&out, 100);
        let mut seq = 0;
        for start in (0..40).rev() {
            for key in ["b", "a", "c"] {
                seq += 1;
                sorter.push(turn(key, start, seq)).unwrap();
            }
        }
        let spilled = out.with_file_name(format!(".out.jsonl.turns-{}", std::process::id()));
        let mut sorted = sorter.finish().unwrap();
        assert_eq!(sorted.runs(), 120);
        assert!(
            sorted.sources.len() <= MAX_OPEN_RUNS,
            "{} runs open at once",
            sorted.sources.len()
        );
        assert!(std::fs::read_dir(&spilled).unwrap().count() <= MAX_OPEN_RUNS);
        let mut got = Vec::new();
        while let Some(t) = sorted.next_turn().unwrap() {
            got.push((t.group, t.start_unix_ns));
        }
        let want: Vec<(Group, u64)> = ["a", "b", "c"]
            .iter()
            .flat_map(|k| (0..40).map(|s| (Group::Session(k.to_string()), s)))
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn rows_come_out_in_order_of_first_appearance_from_memory_or_file() {
        for budget in [1 << 20, 10] {
            let dir = tempfile::tempdir().unwrap();
            let out = dir.path().join("out.jsonl");
            let mut store = RowStore::new(&out, budget);
            store.add(30, b"c1\nc2\n").unwrap();
            store.add(10, b"a1\n").unwrap();
            store.add(20, b"b1\n").unwrap();
            store.add(10, b"a'1\n").unwrap();
            let mut w = Vec::new();
            store.write_ordered(&mut w, &out).unwrap();
            assert_eq!(w, b"a1\na'1\nb1\nc1\nc2\n", "budget {budget}");
        }
    }
}
