//! Reader and validator: streams the JSONL (plain or zstd), applies every validation rule of
//! the reference and pre-builds each conversation's history.

use std::path::Path;

use super::Dataset;

/// How loading behaves.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Stop collecting validation errors after this many (the count of the rest is reported).
    pub max_errors: usize,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self { max_errors: 100 }
    }
}

/// Why a dataset could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
}

/// Loads and validates a dataset file.
pub fn load(path: &Path, _opts: &LoadOptions) -> Result<Dataset, DatasetError> {
    Err(DatasetError::Io {
        path: path.display().to_string(),
        source: std::io::Error::other("dataset loading is not available yet"),
    })
}
