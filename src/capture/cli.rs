//! `agentrace capture …`: list, summarise, print and export captures.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;

use super::export::{self, ExportOptions};
use super::format::{self, parse_time};
use super::merge;
use super::reader::{self, Entry, SegmentReader};

/// Subcommands of `agentrace capture`.
#[derive(Debug, clap::Subcommand)]
pub(crate) enum CaptureCommand {
    /// List the segment files of capture directories, with the replica that wrote each.
    Ls {
        /// Capture directories (one per replica), or a directory of replica directories.
        #[arg(required = true, num_args = 1..)]
        dirs: Vec<PathBuf>,
    },
    /// Sessions, exchanges, bytes raw vs stored, time span, backends, replicas, dropped records.
    Stats {
        /// Capture directories (one per replica), or a directory of replica directories.
        #[arg(required = true, num_args = 1..)]
        dirs: Vec<PathBuf>,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Print the records as JSONL with every body whole; several replicas' records merged by
    /// end time.
    Cat {
        /// Capture directories (one per replica), or a directory of replica directories.
        #[arg(required = true, num_args = 1..)]
        dirs: Vec<PathBuf>,
        /// Only this session key.
        #[arg(long)]
        session: Option<String>,
    },
    /// Write an MLPerf agentic dataset (`.jsonl`, or `.jsonl.zst`) from a capture; the
    /// captures of several replicas are merged into one conversation per session key.
    Export {
        /// Capture directories (one per replica), or a directory of replica directories.
        #[arg(required = true, num_args = 1..)]
        dirs: Vec<PathBuf>,
        /// The dataset file to write.
        #[arg(long)]
        out: PathBuf,
        /// Only these session keys (repeatable).
        #[arg(long = "session")]
        sessions: Vec<String>,
        /// Only exchanges started at or after this time (Unix seconds or RFC 3339 UTC).
        #[arg(long)]
        since: Option<String>,
        /// Only exchanges started before this time (Unix seconds or RFC 3339 UTC).
        #[arg(long)]
        until: Option<String>,
        /// Replace message texts by hashes of the same length, for sharing.
        #[arg(long)]
        redact_content: bool,
        /// How far apart the replicas' clocks may be, in ms: turns are ordered by their
        /// history's growth where start times within this disagree with it.
        #[arg(long, default_value_t = export::DEFAULT_MAX_SKEW_MS)]
        max_skew_ms: u64,
        /// MiB the whole export holds in memory, however many replicas it reads: turns being
        /// sorted, rows waiting and the replicas' delta bases share it; beyond their shares
        /// they go to spill files beside --out, so memory stays bounded however large the
        /// capture or the fleet.
        #[arg(long, default_value_t = (export::DEFAULT_SORT_BUFFER_BYTES >> 20) as u64,
              value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
        sort_buffer_mb: u64,
    },
}

/// Runs one capture subcommand.
pub(crate) async fn run(cmd: CaptureCommand) -> anyhow::Result<ExitCode> {
    // Reading and decompressing is blocking work: keep it off the runtime's threads.
    tokio::task::spawn_blocking(move || run_blocking(cmd)).await?
}

fn run_blocking(cmd: CaptureCommand) -> anyhow::Result<ExitCode> {
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let result = match cmd {
        CaptureCommand::Ls { dirs } => ls(&dirs, &mut out),
        CaptureCommand::Stats { dirs, json } => {
            let stats = stats(&dirs)?;
            if json {
                serde_json::to_writer_pretty(&mut out, &stats)?;
                writeln!(out)?;
            } else {
                stats.print(&mut out)?;
            }
            Ok(())
        }
        CaptureCommand::Cat { dirs, session } => cat(&dirs, session.as_deref(), &mut out),
        CaptureCommand::Export {
            dirs,
            out: path,
            sessions,
            since,
            until,
            redact_content,
            max_skew_ms,
            sort_buffer_mb,
        } => {
            let time = |flag: &str, v: Option<String>| -> anyhow::Result<Option<u64>> {
                v.map(|t| parse_time(&t).map_err(|e| anyhow::anyhow!("--{flag}: {e}")))
                    .transpose()
            };
            let opts = ExportOptions {
                sessions,
                since_unix_ns: time("since", since)?,
                until_unix_ns: time("until", until)?,
                redact_content,
                max_skew_ms,
                sort_buffer_bytes: (sort_buffer_mb as usize) << 20,
            };
            let report = export::export_dirs(&dirs, &path, &opts)?;
            for cut in &report.cuts {
                tracing::warn!("{cut}");
            }
            writeln!(
                out,
                "wrote {}: {} conversations, {} rows, {} client turns from {} exchanges",
                path.display(),
                report.conversations,
                report.rows,
                report.client_turns,
                report.exchanges
            )?;
            if report.directories > 1 {
                writeln!(
                    out,
                    "  merged {} capture directories; {} turns ordered by their history where \
                     the replicas' clocks disagreed",
                    report.directories, report.turns_ordered_by_history
                )?;
            }
            for (reason, n) in &report.skipped {
                writeln!(out, "  left out {n}: {reason}")?;
            }
            if report.without_system_prompt > 0 {
                writeln!(
                    out,
                    "  {} conversations have no system prompt: replay them with --salt false \
                     (salting, on by default, needs one)",
                    report.without_system_prompt
                )?;
            }
            Ok(())
        }
    };
    match result {
        Err(e) if is_broken_pipe(&e) => Ok(ExitCode::SUCCESS),
        Err(e) => Err(e),
        Ok(()) => {
            out.flush().ok();
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

fn ls(paths: &[PathBuf], out: &mut impl Write) -> anyhow::Result<()> {
    let dirs = merge::capture_dirs(paths)?;
    for dir in &dirs {
        if dirs.len() > 1 {
            writeln!(out, "{}:", dir.display())?;
        }
        ls_dir(dir, out)?;
    }
    Ok(())
}

fn ls_dir(dir: &Path, out: &mut impl Write) -> anyhow::Result<()> {
    let segments = reader::segments(dir)?;
    if segments.is_empty() {
        writeln!(out, "no segments in {}", dir.display())?;
    }
    for path in segments {
        let size = std::fs::metadata(&path)
            .with_context(|| path.display().to_string())?
            .len();
        let mut r = SegmentReader::open(&path)?;
        let (mut exchanges, mut dropped) = (0u64, 0u64);
        let mut span: Option<(u64, u64)> = None;
        let mut replica = String::from(UNNAMED_REPLICA);
        for entry in r.by_ref() {
            match entry {
                Entry::Segment(h) => replica = replica_of(&h),
                Entry::Exchange(e) => {
                    exchanges += 1;
                    let (s, t) = (e.record.start_unix_ns, e.end_unix_ns());
                    span = Some(span.map_or((s, t), |(a, b)| (a.min(s), b.max(t))));
                }
                Entry::Dropped(d) => dropped += d.count,
            }
        }
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        let span = span.map_or("-".to_owned(), |(a, b)| {
            format!("{} .. {}", format::rfc3339(a), format::rfc3339(b))
        });
        let status = r.cut().map_or("ok".to_owned(), |c| {
            format!("cut after {} lines: {}", c.records, c.reason)
        });
        writeln!(
            out,
            "{name}  replica {replica}  {size} bytes  {exchanges} exchanges  {dropped} dropped  \
             {span}  {status}"
        )?;
    }
    Ok(())
}

/// How segments written before replicas were named show their replica.
const UNNAMED_REPLICA: &str = "-";

fn replica_of(h: &format::SegmentHeader) -> String {
    h.replica.clone().unwrap_or_else(|| UNNAMED_REPLICA.into())
}

/// What `capture stats` reports.
#[derive(Debug, Default, serde::Serialize)]
pub(crate) struct CaptureStats {
    /// Segment files.
    pub segments: usize,
    /// Distinct session keys.
    pub sessions: usize,
    /// Exchanges read.
    pub exchanges: u64,
    /// Exchanges without a session key.
    pub keyless_exchanges: u64,
    /// Exchanges stored without part of their payload.
    pub incomplete_exchanges: u64,
    /// Records the recorder reported dropped.
    pub dropped_records: u64,
    /// Request plus response body bytes, as they passed through.
    pub bytes_raw: u64,
    /// Bytes of the segment files.
    pub bytes_stored: u64,
    /// `bytes_stored / bytes_raw`.
    pub stored_ratio: f64,
    /// First exchange start (RFC 3339).
    pub first_start: Option<String>,
    /// Last exchange end (RFC 3339).
    pub last_end: Option<String>,
    /// Seconds between them.
    pub span_seconds: f64,
    /// Capture directories read.
    pub directories: usize,
    /// Exchanges per replica (`-` for segments that name none).
    pub replicas: BTreeMap<String, u64>,
    /// Exchanges per backend.
    pub backends: BTreeMap<String, u64>,
    /// Exchanges per response status (`none` when no response arrived).
    pub statuses: BTreeMap<String, u64>,
    /// Segments that end early.
    pub cuts: Vec<reader::Cut>,
}

impl CaptureStats {
    fn print(&self, out: &mut impl Write) -> std::io::Result<()> {
        writeln!(out, "segments        {}", self.segments)?;
        writeln!(out, "sessions        {}", self.sessions)?;
        writeln!(
            out,
            "exchanges       {} ({} without session key, {} incomplete)",
            self.exchanges, self.keyless_exchanges, self.incomplete_exchanges
        )?;
        writeln!(out, "dropped records {}", self.dropped_records)?;
        writeln!(
            out,
            "bytes           {} raw, {} stored ({:.2}%)",
            self.bytes_raw,
            self.bytes_stored,
            self.stored_ratio * 100.0
        )?;
        writeln!(
            out,
            "time span       {} .. {} ({:.3} s)",
            self.first_start.as_deref().unwrap_or("-"),
            self.last_end.as_deref().unwrap_or("-"),
            self.span_seconds
        )?;
        let join = |m: &BTreeMap<String, u64>| {
            m.iter()
                .map(|(k, v)| format!("{k}: {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        writeln!(
            out,
            "replicas        {} ({} directories)",
            join(&self.replicas),
            self.directories
        )?;
        writeln!(out, "backends        {}", join(&self.backends))?;
        writeln!(out, "statuses        {}", join(&self.statuses))?;
        for cut in &self.cuts {
            writeln!(out, "cut             {cut}")?;
        }
        Ok(())
    }
}

/// Summarises the captures in `paths` (one per replica, or directories of them).
pub(crate) fn stats(paths: &[PathBuf]) -> anyhow::Result<CaptureStats> {
    let dirs = merge::capture_dirs(paths)?;
    let mut s = CaptureStats {
        directories: dirs.len(),
        ..CaptureStats::default()
    };
    let mut sessions = BTreeSet::new();
    let mut span: Option<(u64, u64)> = None;
    for dir in &dirs {
        for path in reader::segments(dir)? {
            s.segments += 1;
            s.bytes_stored += std::fs::metadata(&path)
                .with_context(|| path.display().to_string())?
                .len();
        }
    }
    let mut replica = String::from(UNNAMED_REPLICA);
    s.cuts = merge::for_each(&dirs, |_, entry| {
        match entry {
            Entry::Segment(h) => replica = replica_of(&h),
            Entry::Exchange(e) => {
                *s.replicas.entry(replica.clone()).or_default() += 1;
                let r = &e.record;
                s.exchanges += 1;
                match &r.session {
                    Some(k) => {
                        sessions.insert(k.clone());
                    }
                    None => s.keyless_exchanges += 1,
                }
                s.incomplete_exchanges += u64::from(!r.complete);
                s.bytes_raw += r.request.body.len + r.response.as_ref().map_or(0, |x| x.body.len);
                *s.backends.entry(r.backend.clone()).or_default() += 1;
                let status = r
                    .response
                    .as_ref()
                    .map_or("none".to_owned(), |x| x.status.to_string());
                *s.statuses.entry(status).or_default() += 1;
                let (a, b) = (r.start_unix_ns, e.end_unix_ns());
                span = Some(span.map_or((a, b), |(x, y)| (x.min(a), y.max(b))));
            }
            Entry::Dropped(d) => s.dropped_records += d.count,
        }
        Ok(())
    })?;
    s.sessions = sessions.len();
    if s.bytes_raw > 0 {
        s.stored_ratio = s.bytes_stored as f64 / s.bytes_raw as f64;
    }
    if let Some((a, b)) = span {
        s.first_start = Some(format::rfc3339(a));
        s.last_end = Some(format::rfc3339(b));
        s.span_seconds = b.saturating_sub(a) as f64 / 1e9;
    }
    Ok(s)
}

fn cat(paths: &[PathBuf], session: Option<&str>, out: &mut impl Write) -> anyhow::Result<()> {
    let dirs = merge::capture_dirs(paths)?;
    let mut printed = 0u64;
    let write_err = |e: std::io::Error| super::CaptureError::io(Path::new("<stdout>"), e);
    let cuts = merge::for_each_exchange(&dirs, None, |e| {
        if session.is_none() || e.record.session.as_deref() == session {
            printed += 1;
            let line = format::Line::Exchange(Box::new(e.expanded()));
            serde_json::to_writer(&mut *out, &line).map_err(|e| write_err(e.into()))?;
            out.write_all(b"\n").map_err(write_err)?;
        }
        Ok(())
    })?;
    for cut in cuts {
        tracing::warn!("{cut}");
    }
    // An empty answer to a named session is more likely a typo than a fact worth exit 0.
    if let (Some(key), 0) = (session, printed) {
        anyhow::bail!("{}: no exchange of session {key:?}", merge::names(paths));
    }
    Ok(())
}
