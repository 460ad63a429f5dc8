//! Reader and validator: streams the JSONL (plain or zstd) line by line, each line bounded by
//! `LoadOptions::max_line_bytes`, applies every validation rule of the reference and pre-builds
//! each conversation's history.
//!
//! `validate` holds the rules, `conversation` builds what a validated conversation becomes.

mod conversation;
mod validate;

use std::fmt;
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::sync::Arc;

use sha2::{Digest, Sha256};

use super::lines::{LineError, Lines};
use super::{Conversation, Dataset};
use validate::Loader;

pub(crate) use conversation::truthy;

/// How loading behaves.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Stop collecting validation errors after this many (the count of the rest is reported).
    pub max_errors: usize,
    /// A line longer than this many bytes stops the load at once (see [`DEFAULT_MAX_LINE_BYTES`](super::DEFAULT_MAX_LINE_BYTES)).
    pub max_line_bytes: usize,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            max_errors: 100,
            max_line_bytes: super::lines::DEFAULT_MAX_LINE_BYTES,
        }
    }
}

/// Which validation rule of the reference a row breaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Rule {
    /// The file holds no dataset row.
    Empty,
    /// The line is not a JSON object.
    Json,
    /// `conversation_id` is missing, not a string, empty, `"nan"` or not printable ASCII.
    ConversationId,
    /// A conversation's rows are not contiguous in the file.
    Grouping,
    /// `turn` is missing or not a whole number.
    Turn,
    /// Turns of a conversation are not exactly `1..N`.
    TurnNumbering,
    /// The role state machine (`start→user→assistant→{tool,user}`, `tool→{assistant,user}`).
    RoleSequence,
    /// A user row without non-empty `content`.
    UserContent,
    /// An assistant row with neither `content` nor `tool_calls`.
    AssistantContent,
    /// A malformed `tool_calls` list.
    ToolCalls,
    /// A malformed `tool_results` list.
    ToolResults,
}

impl Rule {
    /// The rule's short name, as printed in error lists.
    pub fn as_str(self) -> &'static str {
        match self {
            Rule::Empty => "empty",
            Rule::Json => "json",
            Rule::ConversationId => "conversation_id",
            Rule::Grouping => "grouping",
            Rule::Turn => "turn",
            Rule::TurnNumbering => "turn-numbering",
            Rule::RoleSequence => "role-sequence",
            Rule::UserContent => "user-content",
            Rule::AssistantContent => "assistant-content",
            Rule::ToolCalls => "tool_calls",
            Rule::ToolResults => "tool_results",
        }
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One broken rule, located in the file.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidationError {
    /// 1-based line of the offending row (the conversation's first line for whole-group rules;
    /// 0 when the file is empty).
    pub line: usize,
    /// The row's conversation id, when it has a usable one.
    pub conversation_id: Option<String>,
    /// The row's turn number, when it has one.
    pub turn: Option<i64>,
    /// The rule broken.
    pub rule: Rule,
    /// What exactly is wrong.
    pub message: String,
}

impl fmt::Display for ValidationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}", self.line)?;
        if let Some(id) = &self.conversation_id {
            write!(f, ", conversation {id:?}")?;
        }
        if let Some(turn) = self.turn {
            write!(f, ", turn {turn}")?;
        }
        write!(f, ": [{}] {}", self.rule, self.message)
    }
}

/// Why a dataset could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    /// The file could not be read.
    #[error("cannot read {path}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// A line is longer than [`LoadOptions::max_line_bytes`]; reading stopped there.
    #[error("{path}: {}", LineError::TooLong { line: *line, limit: *limit })]
    LineTooLong {
        /// The file.
        path: String,
        /// 1-based line number.
        line: usize,
        /// The limit in bytes.
        limit: usize,
    },
    /// The file breaks validation rules; every error found (up to the cap) is listed.
    #[error("{}", format_invalid(path, errors, *total))]
    Invalid {
        /// The file.
        path: String,
        /// The errors kept, in line order.
        errors: Vec<ValidationError>,
        /// How many errors were found in all (more than `errors.len()` when capped).
        total: usize,
    },
    /// Salting is on but a client turn has no system prompt to salt (the reference's
    /// pre-flight check).
    #[error("agentic_inference.enable_salt requires a system prompt for every conversation; conversation {conversation_id:?} turn {turn} has no system prompt; to replay such a dataset, turn salting off (--salt false, or enable_salt = false)")]
    SaltWithoutSystemPrompt {
        /// The conversation.
        conversation_id: String,
        /// Its first client turn without a system prompt.
        turn: u32,
    },
}

fn format_invalid(path: &str, errors: &[ValidationError], total: usize) -> String {
    let mut out = format!(
        "{path}: {total} validation error{}",
        if total == 1 { "" } else { "s" }
    );
    if total > errors.len() {
        out.push_str(&format!(
            " (first {} shown, {} more not listed)",
            errors.len(),
            total - errors.len()
        ));
    }
    for e in errors {
        out.push_str("\n  ");
        out.push_str(&e.to_string());
    }
    out
}

impl DatasetError {
    /// The validation errors, when that is why loading failed.
    pub fn validation_errors(&self) -> &[ValidationError] {
        match self {
            DatasetError::Invalid { errors, .. } => errors,
            _ => &[],
        }
    }
}

/// Loads and validates a dataset file: `.zst` files are decompressed on the fly.
pub fn load(path: &Path, opts: &LoadOptions) -> Result<Dataset, DatasetError> {
    let display = path.display().to_string();
    let io_err = |source: std::io::Error| DatasetError::Io {
        path: display.clone(),
        source,
    };
    let file = File::open(path).map_err(io_err)?;
    let mut hashing = HashingReader::new(file);
    let conversations = if is_zstd(path) {
        let decoder = zstd::Decoder::new(hashing).map_err(io_err)?;
        let mut reader = BufReader::with_capacity(1 << 20, decoder);
        let conversations = load_reader(&mut reader, &display, opts)?;
        hashing = reader.into_inner().finish().into_inner();
        conversations
    } else {
        let mut reader = BufReader::with_capacity(1 << 20, hashing);
        let conversations = load_reader(&mut reader, &display, opts)?;
        hashing = reader.into_inner();
        conversations
    };
    // The decoder may stop at the end of the last frame: hash whatever follows too.
    std::io::copy(&mut hashing, &mut std::io::sink()).map_err(io_err)?;
    Ok(Dataset {
        path: path.to_path_buf(),
        sha256: hex::encode(hashing.hasher.finalize()),
        conversations,
    })
}

/// Whether `path` names a zstd-compressed file.
pub(crate) fn is_zstd(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "zst")
}

/// Opens a dataset file for line reading, decompressing `.zst` on the fly.
pub fn open_lines(path: &Path) -> std::io::Result<Box<dyn BufRead>> {
    let file = File::open(path)?;
    Ok(if is_zstd(path) {
        Box::new(BufReader::with_capacity(1 << 20, zstd::Decoder::new(file)?))
    } else {
        Box::new(BufReader::with_capacity(1 << 20, file))
    })
}

/// Passes bytes through while hashing them, so the SHA-256 of the stored file costs no
/// second read.
struct HashingReader<R> {
    inner: R,
    hasher: Sha256,
}

impl<R> HashingReader<R> {
    fn new(inner: R) -> Self {
        Self {
            inner,
            hasher: Sha256::new(),
        }
    }
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
}

/// Loads and validates JSONL rows from any line reader; `source` names it in errors.
pub fn load_reader<R: BufRead>(
    reader: &mut R,
    source: &str,
    opts: &LoadOptions,
) -> Result<Vec<Arc<Conversation>>, DatasetError> {
    let mut loader = Loader::new(opts.max_errors);
    let mut lines = Lines::new(reader, opts.max_line_bytes);
    loop {
        match lines.next_line() {
            Ok(Some((line_no, line))) => loader.push_line(line_no, line),
            Ok(None) => break,
            Err(LineError::Io { source: e, .. }) => {
                return Err(DatasetError::Io {
                    path: source.to_string(),
                    source: e,
                })
            }
            Err(LineError::TooLong { line, limit }) => {
                return Err(DatasetError::LineTooLong {
                    path: source.to_string(),
                    line,
                    limit,
                })
            }
        }
    }
    loader.finish(source)
}
