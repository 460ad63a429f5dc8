//! The synthetic standard set: 490 agentic coding + 500 agentic workflow trajectories,
//! deterministic for a seed.
//!
//! Coding traces follow the public sample's shape and distributions (see `datasets/README.md`
//! for every distribution and its basis) with a longer context tail; workflow traces share one
//! long system prompt (an intent catalogue) and one tool set, so most request tokens are a
//! prefix shared across conversations. The generator draws from the crate's own
//! `Rng` so the bytes depend only on the seed and this crate, never on a
//! dependency's sampling algorithms.
//!
//! `rows` is what a line holds, `coding` and `workflow` the two
//! kinds of trace.

mod coding;
mod rows;
mod workflow;

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde_json::value::RawValue;

use crate::random::Rng;
use coding::{coding_conversation, coding_id, coding_tools};
use rows::Row;
use workflow::catalogue::{workflow_system_prompt, workflow_tools};
use workflow::workflow_conversation;

/// Where the replayer looks for the standard set when no dataset is given.
pub const STANDARD_SET_PATH: &str = "datasets/mlperf-agentic-990.jsonl.zst";

/// The seed of the standard set.
pub(crate) const DEFAULT_SEED: u64 = 990;

/// The zstd level of the standard set: zstd's default, fast to write and about 7× smaller.
pub(crate) const ZSTD_LEVEL: i32 = 3;

/// Bytes per estimated token: the estimate used throughout (`bytes / 4`).
pub(crate) const BYTES_PER_TOKEN: usize = 4;

/// What to generate.
#[derive(Debug, Clone)]
pub struct SynthOptions {
    /// Seeds every random choice; the same seed gives the same bytes.
    pub seed: u64,
    /// Agentic coding trajectories (ids `owner__repo-NNNNN`).
    pub coding: usize,
    /// Agentic workflow trajectories (ids `sim_NNNNNN`).
    pub workflow: usize,
}

impl Default for SynthOptions {
    /// The announced standard composition: 490 coding + 500 workflow.
    fn default() -> Self {
        Self {
            seed: DEFAULT_SEED,
            coding: 490,
            workflow: 500,
        }
    }
}

/// Generates the standard set at `path` unless it already exists; returns the path.
pub fn ensure_standard_set(path: &Path) -> anyhow::Result<PathBuf> {
    if !path.exists() {
        write_file(path, &SynthOptions::default())?;
    }
    Ok(path.to_path_buf())
}

/// Writes a synthetic set to `path` (zstd when it ends in `.zst`), atomically: a partial file
/// never appears under the final name.
pub fn write_file(path: &Path, opts: &SynthOptions) -> anyhow::Result<()> {
    use anyhow::Context as _;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    // Unique per writer, so concurrent first uses (processes or threads) never share a file;
    // they all rename the same bytes into place.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let thread = format!("{:?}", std::thread::current().id());
    let thread: String = thread.chars().filter(char::is_ascii_digit).collect();
    let tmp = path.with_extension(format!("tmp.{}.{thread}.{nanos}", std::process::id()));
    let result = (|| -> std::io::Result<()> {
        let file = File::create(&tmp)?;
        if super::load::is_zstd(path) {
            let mut enc = zstd::Encoder::new(BufWriter::with_capacity(1 << 20, file), ZSTD_LEVEL)?;
            generate(opts, &mut enc)?;
            enc.finish()?.flush()?;
        } else {
            let mut out = BufWriter::with_capacity(1 << 20, file);
            generate(opts, &mut out)?;
            out.flush()?;
        }
        Ok(())
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(anyhow::Error::new(e).context(format!("cannot write {}", path.display())));
    }
    std::fs::rename(&tmp, path)
        .with_context(|| format!("cannot move {} to {}", tmp.display(), path.display()))?;
    Ok(())
}

/// Writes the set as JSONL rows: coding conversations first, then workflow.
pub fn generate<W: Write>(opts: &SynthOptions, out: &mut W) -> std::io::Result<()> {
    let coding_tools = raw(&coding_tools());
    let workflow_tools = raw(&workflow_tools());
    let workflow_system = workflow_system_prompt();
    let mut used_ids = std::collections::HashSet::new();
    let mut line = Vec::with_capacity(1 << 16);
    let mut emit = |row: &Row<'_>, out: &mut W| -> std::io::Result<()> {
        line.clear();
        serde_json::to_writer(&mut line, row).map_err(std::io::Error::other)?;
        line.push(b'\n');
        out.write_all(&line)
    };
    for i in 0..opts.coding {
        let mut rng = Rng::for_item(opts.seed, 1, i as u64);
        let id = loop {
            let id = coding_id(&mut rng);
            if used_ids.insert(id.clone()) {
                break id;
            }
        };
        coding_conversation(&mut rng, &id, &coding_tools, |row| emit(row, out))?;
    }
    for i in 0..opts.workflow {
        let mut rng = Rng::for_item(opts.seed, 2, i as u64);
        let id = format!("sim_{:06}", i + 1);
        workflow_conversation(&mut rng, &id, &workflow_system, &workflow_tools, |row| {
            emit(row, out)
        })?;
    }
    Ok(())
}

fn raw(v: &serde_json::Value) -> Box<RawValue> {
    serde_json::value::to_raw_value(v).expect("tools encode")
}
