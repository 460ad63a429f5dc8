//! The synthetic standard set: 490 agentic coding + 500 agentic workflow trajectories,
//! deterministic for a seed.

use std::path::{Path, PathBuf};

/// Where the replayer looks for the standard set when no dataset is given.
pub const STANDARD_SET_PATH: &str = "datasets/mlperf-agentic-990.jsonl.zst";

/// Generates the standard set at `path` unless it already exists; returns the path.
pub fn ensure_standard_set(path: &Path) -> anyhow::Result<PathBuf> {
    anyhow::bail!(
        "cannot generate {}: synthesis is not available yet",
        path.display()
    )
}
