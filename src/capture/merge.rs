//! The captures of a fleet read as one: several directories (one per proxy replica, or a
//! directory of replica directories), each recorder's segments one stream, the streams merged
//! by exchange end time. Only each stream's next exchange is held, so reading a fleet costs
//! the memory of reading one replica.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::path::{Path, PathBuf};

use super::format;
use super::reader::{self, Capture, Cut, Entry, Exchange, SegmentReader};
use super::spill::BaseSpill;
use super::CaptureError;

/// The paths as one text, for messages.
pub(crate) fn names(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The capture directories `paths` name: a path holding segments is one; a path holding none
/// stands for its sub-directories that hold segments (a directory of replica directories),
/// or, when it has none either, for itself (an empty capture).
pub(crate) fn capture_dirs(paths: &[PathBuf]) -> Result<Vec<PathBuf>, CaptureError> {
    let mut out = Vec::new();
    for path in paths {
        if !reader::segments(path)?.is_empty() {
            out.push(path.clone());
            continue;
        }
        let mut subdirs = Vec::new();
        for entry in std::fs::read_dir(path).map_err(|e| CaptureError::io(path, e))? {
            let entry = entry.map_err(|e| CaptureError::io(path, e))?;
            let sub = entry.path();
            if sub.is_dir() && !reader::segments(&sub)?.is_empty() {
                subdirs.push(sub);
            }
        }
        subdirs.sort();
        if subdirs.is_empty() {
            out.push(path.clone());
        }
        out.extend(subdirs);
    }
    Ok(out)
}

/// `(recorder tag, sequence number)` from a segment's file name
/// (`capture-<time>-<tag>-<seq>.jsonl.zst`); `None` for a name not of that form.
fn recorder_and_seq(path: &Path) -> Option<(String, u64)> {
    let name = path.file_name()?.to_str()?;
    let rest = name
        .strip_prefix(format::SEGMENT_PREFIX)?
        .strip_suffix(format::SEGMENT_SUFFIX)?;
    let (rest, seq) = rest.rsplit_once('-')?;
    let (_time, tag) = rest.split_once('-')?;
    Some((tag.to_owned(), seq.parse().ok()?))
}

/// The segments of `dirs` as streams: one per recorder instance within a directory, in its
/// writing order (several proxies may share a directory; a restart starts a new recorder).
fn streams(dirs: &[PathBuf]) -> Result<Vec<VecDeque<PathBuf>>, CaptureError> {
    let mut out = Vec::new();
    for dir in dirs {
        let mut by_recorder: std::collections::BTreeMap<String, Vec<(u64, PathBuf)>> =
            Default::default();
        for path in reader::segments(dir)? {
            let (tag, seq) = recorder_and_seq(&path).unwrap_or_else(|| {
                // An unusual name: a stream of its own.
                (path.display().to_string(), 0)
            });
            by_recorder.entry(tag).or_default().push((seq, path));
        }
        for (_, mut segments) in by_recorder {
            segments.sort();
            out.push(segments.into_iter().map(|(_, p)| p).collect());
        }
    }
    Ok(out)
}

/// Calls `f` for every entry of every segment of `dirs`, directory by directory, in file
/// order; returns the cuts. For summaries that need no order across replicas.
pub(crate) fn for_each(
    dirs: &[PathBuf],
    mut f: impl FnMut(&Path, Entry) -> Result<(), CaptureError>,
) -> Result<Vec<Cut>, CaptureError> {
    let mut cuts = Vec::new();
    for dir in dirs {
        cuts.extend(reader::for_each(dir, &mut f)?);
    }
    Ok(cuts)
}

/// One recorder's segments, read one exchange at a time.
struct Stream {
    segments: VecDeque<PathBuf>,
    reader: Option<SegmentReader>,
    spill: Option<BaseSpill>,
}

impl Stream {
    fn next(&mut self, cuts: &mut Vec<Cut>) -> Result<Option<Exchange>, CaptureError> {
        loop {
            if let Some(r) = self.reader.as_mut() {
                for entry in r.by_ref() {
                    if let Entry::Exchange(e) = entry {
                        return Ok(Some(*e));
                    }
                }
                if let Some(e) = r.take_failure() {
                    return Err(e);
                }
                cuts.extend(r.cut().cloned());
                self.reader = None;
            }
            match self.segments.pop_front() {
                Some(path) => {
                    let r = SegmentReader::open(&path)?;
                    self.reader = Some(match &self.spill {
                        Some(spill) => r.spilling_bases(spill.clone()),
                        None => r,
                    });
                }
                None => return Ok(None),
            }
        }
    }
}

/// Calls `f` for every exchange of `dirs` in end-time order across replicas (each recorder
/// writes its exchanges as they end, so each stream is already in that order); returns the
/// cuts. Holds one exchange per stream at a time, and each open segment's delta bases: all
/// of them in memory, or through `spill` within one budget for every stream.
pub(crate) fn for_each_exchange(
    dirs: &[PathBuf],
    spill: Option<&BaseSpill>,
    mut f: impl FnMut(Exchange) -> Result<(), CaptureError>,
) -> Result<Vec<Cut>, CaptureError> {
    let mut cuts = Vec::new();
    let mut streams: Vec<Stream> = streams(dirs)?
        .into_iter()
        .map(|segments| Stream {
            segments,
            reader: None,
            spill: spill.cloned(),
        })
        .collect();
    let mut heads: Vec<Option<Exchange>> = Vec::with_capacity(streams.len());
    let mut heap = BinaryHeap::new();
    for (i, s) in streams.iter_mut().enumerate() {
        let head = s.next(&mut cuts)?;
        if let Some(e) = &head {
            heap.push(Reverse((e.end_unix_ns(), i)));
        }
        heads.push(head);
    }
    while let Some(Reverse((_, i))) = heap.pop() {
        let e = heads[i].take().expect("a stream in the heap has a head");
        let next = streams[i].next(&mut cuts)?;
        if let Some(n) = &next {
            heap.push(Reverse((n.end_unix_ns(), i)));
        }
        heads[i] = next;
        f(e)?;
    }
    Ok(cuts)
}

/// Reads every capture of `paths` into memory (as [`reader::read_dir`] does for one).
pub(crate) fn read_all(paths: &[PathBuf]) -> Result<Capture, CaptureError> {
    let dirs = capture_dirs(paths)?;
    let mut capture = Capture::default();
    for dir in &dirs {
        capture.segments.extend(reader::segments(dir)?);
    }
    capture.cuts = for_each(&dirs, |_, entry| {
        capture.add(entry);
        Ok(())
    })?;
    Ok(capture)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_names_give_their_recorder_and_sequence() {
        let p = Path::new("/x/capture-20261129T170627.123Z-3fa01c9e-000012.jsonl.zst");
        assert_eq!(recorder_and_seq(p), Some(("3fa01c9e".into(), 12)));
        assert_eq!(recorder_and_seq(Path::new("capture-x.jsonl.zst")), None);
    }

    #[test]
    fn a_directory_of_replica_directories_stands_for_them() {
        let root = tempfile::tempdir().unwrap();
        let name = "capture-20261129T170627.123Z-3fa01c9e-000001.jsonl.zst";
        for pod in ["pod-b", "pod-a"] {
            std::fs::create_dir_all(root.path().join(pod)).unwrap();
            std::fs::write(root.path().join(pod).join(name), b"").unwrap();
        }
        std::fs::create_dir_all(root.path().join("empty")).unwrap();
        let dirs = capture_dirs(&[root.path().to_path_buf()]).unwrap();
        assert_eq!(
            dirs,
            vec![root.path().join("pod-a"), root.path().join("pod-b")]
        );
        let direct = capture_dirs(&[root.path().join("pod-a")]).unwrap();
        assert_eq!(direct, vec![root.path().join("pod-a")]);
        assert!(capture_dirs(&[root.path().join("missing")]).is_err());
    }
}
