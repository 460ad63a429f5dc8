//! Reader and validator: streams the JSONL (plain or zstd) line by line, each line bounded by
//! `LoadOptions::max_line_bytes`, applies every validation rule of the reference and pre-builds
//! each conversation's history.

use std::collections::HashSet;
use std::fmt;
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::sync::Arc;

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use super::lines::{LineError, Lines};
use super::{ClientTurn, Conversation, Dataset, ExpectedReply, HistoryMessage, Role};

/// How loading behaves.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Stop collecting validation errors after this many (the count of the rest is reported).
    pub max_errors: usize,
    /// A line longer than this many bytes stops the load at once (see [`super::lines`]).
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
pub fn is_zstd(path: &Path) -> bool {
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

/// A row that passed the per-row checks and waits for its conversation to end.
struct Row {
    line: usize,
    turn: i64,
    fields: Map<String, Value>,
}

impl Row {
    /// A present, non-null field (the reference treats null like a missing cell).
    fn get(&self, key: &str) -> Option<&Value> {
        self.fields.get(key).filter(|v| !v.is_null())
    }

    fn role(&self) -> Option<Role> {
        match self.get("role").and_then(Value::as_str) {
            Some("user") => Some(Role::User),
            Some("assistant") => Some(Role::Assistant),
            Some("tool") => Some(Role::Tool),
            _ => None,
        }
    }

    fn role_text(&self) -> String {
        match self.get("role") {
            Some(Value::String(s)) => format!("'{s}'"),
            Some(other) => other.to_string(),
            None => "no role".to_string(),
        }
    }

    /// An assistant row whose `tool_calls` is a non-empty list.
    fn has_tool_calls(&self) -> bool {
        matches!(self.get("tool_calls"), Some(Value::Array(a)) if !a.is_empty())
    }
}

/// The rows of the conversation being read.
struct Group {
    id: String,
    rows: Vec<Row>,
    /// A row of it was dropped by a per-row check: report, but do not build.
    damaged: bool,
}

struct Loader {
    max_errors: usize,
    errors: Vec<ValidationError>,
    total_errors: usize,
    rows_seen: usize,
    /// Every id met so far, to catch a conversation that reappears later.
    seen_ids: HashSet<String>,
    current: Option<Group>,
    /// When a conversation reappears, its stray rows are skipped until the id changes.
    skipping: Option<String>,
    conversations: Vec<Arc<Conversation>>,
}

impl Loader {
    fn new(max_errors: usize) -> Self {
        Self {
            max_errors: max_errors.max(1),
            errors: Vec::new(),
            total_errors: 0,
            rows_seen: 0,
            seen_ids: HashSet::new(),
            current: None,
            skipping: None,
            conversations: Vec::new(),
        }
    }

    fn error(
        &mut self,
        line: usize,
        id: Option<&str>,
        turn: Option<i64>,
        rule: Rule,
        message: String,
    ) {
        self.total_errors += 1;
        if self.errors.len() < self.max_errors {
            self.errors.push(ValidationError {
                line,
                conversation_id: id.map(str::to_string),
                turn,
                rule,
                message,
            });
        }
    }

    fn push_line(&mut self, line_no: usize, bytes: &[u8]) {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return;
        }
        let mut fields: Map<String, Value> = match serde_json::from_slice::<Value>(bytes) {
            Ok(Value::Object(map)) => map,
            Ok(other) => {
                let kind = json_kind(&other);
                self.error(
                    line_no,
                    None,
                    None,
                    Rule::Json,
                    format!("a row must be a JSON object, got {kind}"),
                );
                return;
            }
            Err(e) => {
                self.error(
                    line_no,
                    None,
                    None,
                    Rule::Json,
                    format!("not valid JSON: {e}"),
                );
                return;
            }
        };
        if fields.get("_type").and_then(Value::as_str) == Some("dataset_metadata") {
            return;
        }
        self.rows_seen += 1;
        let turn_value = fields.get("turn").cloned();
        let turn = turn_value.as_ref().and_then(whole_number);
        let id = match fields.remove("conversation_id") {
            Some(Value::String(s)) => s,
            other => {
                let what = match other {
                    None | Some(Value::Null) => "is missing".to_string(),
                    Some(v) => format!("must be a string, got {}", json_kind(&v)),
                };
                self.error(
                    line_no,
                    None,
                    turn,
                    Rule::ConversationId,
                    format!("'conversation_id' {what}"),
                );
                return;
            }
        };
        if let Some(problem) = id_problem(&id) {
            self.error(line_no, Some(&id), turn, Rule::ConversationId, problem);
            return;
        }

        if self.skipping.as_deref() == Some(id.as_str()) {
            return;
        }
        self.skipping = None;
        if self.current.as_ref().is_none_or(|g| g.id != id) {
            if let Some(done) = self.current.take() {
                self.finish_group(done);
            }
            if !self.seen_ids.insert(id.clone()) {
                self.error(
                    line_no,
                    Some(&id),
                    turn,
                    Rule::Grouping,
                    format!(
                        "rows for conversation '{id}' are not consecutive; all rows for a \
                         conversation must appear together in the file"
                    ),
                );
                self.skipping = Some(id);
                return;
            }
            self.current = Some(Group {
                id: id.clone(),
                rows: Vec::new(),
                damaged: false,
            });
        }
        let Some(turn) = turn else {
            let what = match &turn_value {
                None | Some(Value::Null) => "is missing".to_string(),
                Some(v) => format!("must be a whole number, got {v}"),
            };
            self.error(
                line_no,
                Some(&id),
                None,
                Rule::Turn,
                format!("'turn' {what}"),
            );
            if let Some(g) = self.current.as_mut() {
                g.damaged = true;
            }
            return;
        };
        if let Some(g) = self.current.as_mut() {
            g.rows.push(Row {
                line: line_no,
                turn,
                fields,
            });
        }
    }

    fn finish(mut self, source: &str) -> Result<Vec<Arc<Conversation>>, DatasetError> {
        if let Some(done) = self.current.take() {
            self.finish_group(done);
        }
        if self.rows_seen == 0 && self.total_errors == 0 {
            self.error(
                0,
                None,
                None,
                Rule::Empty,
                "the dataset has no rows".to_string(),
            );
        }
        if self.total_errors > 0 {
            self.errors.sort_by_key(|e| e.line);
            return Err(DatasetError::Invalid {
                path: source.to_string(),
                errors: self.errors,
                total: self.total_errors,
            });
        }
        Ok(self.conversations)
    }

    fn finish_group(&mut self, mut group: Group) {
        // Within a group file order does not matter: the reference sorts by turn.
        group.rows.sort_by_key(|r| r.turn);
        self.check_structure(&group);
        self.check_numbering(&group);
        // Once anything failed the load fails: building later conversations is wasted work.
        if self.total_errors == 0 && !group.damaged {
            let conv = build_conversation(group);
            self.conversations.push(Arc::new(conv));
        }
    }

    /// The role state machine and the shapes of each row's fields.
    fn check_structure(&mut self, group: &Group) {
        #[derive(Clone, Copy)]
        enum State {
            Start,
            User,
            Assistant {
                tool_calls: bool,
            },
            Tool,
            /// After an unknown role: accept anything next, so one bad row is one error.
            Lost,
        }
        let mut state = State::Start;
        let id = group.id.as_str();
        for row in &group.rows {
            let (line, turn) = (row.line, Some(row.turn));
            let role = row.role();
            let sequence_error = match (state, role) {
                (_, None) => Some(format!(
                    "role {} is not one of 'user', 'assistant', 'tool'",
                    row.role_text()
                )),
                (State::Lost, _) => None,
                (State::Start, Some(Role::User)) => None,
                (State::Start, Some(_)) => Some(format!(
                    "the first row of a conversation must be 'user', got {}",
                    row.role_text()
                )),
                (State::User, Some(Role::Assistant)) => None,
                (State::User, Some(_)) => Some(format!(
                    "a 'user' row must be followed by 'assistant', got {}",
                    row.role_text()
                )),
                (State::Assistant { .. }, Some(Role::Assistant)) => {
                    Some("'assistant' cannot follow 'assistant'".to_string())
                }
                (State::Assistant { tool_calls: false }, Some(Role::Tool)) => {
                    Some("a 'tool' row must follow an assistant row with tool_calls".to_string())
                }
                (State::Assistant { tool_calls: true }, Some(Role::User)) => Some(
                    "the assistant row before has tool_calls: a 'tool' result row is required \
                     first"
                        .to_string(),
                ),
                (State::Assistant { .. }, Some(_)) => None,
                (State::Tool, Some(Role::Tool)) => Some("'tool' cannot follow 'tool'".to_string()),
                (State::Tool, Some(_)) => None,
            };
            if let Some(message) = sequence_error {
                self.error(line, Some(id), turn, Rule::RoleSequence, message);
            }
            state = match role {
                None => State::Lost,
                Some(Role::User) => State::User,
                Some(Role::Assistant) => State::Assistant {
                    tool_calls: row.has_tool_calls(),
                },
                Some(Role::Tool) => State::Tool,
                Some(Role::System) => State::Lost,
            };

            if let Some(calls) = row.get("tool_calls") {
                if let Some(problem) = tool_calls_problem(calls) {
                    self.error(line, Some(id), turn, Rule::ToolCalls, problem);
                }
            }
            if let Some((rule, problem)) = content_problem(role, row) {
                self.error(line, Some(id), turn, rule, problem);
            }
        }
    }

    /// Sorted turns must be exactly `1..N`.
    fn check_numbering(&mut self, group: &Group) {
        let id = group.id.as_str();
        let mut expected = 1i64;
        let mut previous: Option<&Row> = None;
        for row in &group.rows {
            if let Some(prev) = previous.filter(|p| p.turn == row.turn) {
                self.error(
                    row.line,
                    Some(id),
                    Some(row.turn),
                    Rule::TurnNumbering,
                    format!(
                        "turn {} appears twice (lines {} and {})",
                        row.turn, prev.line, row.line
                    ),
                );
            } else if row.turn != expected {
                let message = if previous.is_none() {
                    format!("turns must start at 1, the first is {}", row.turn)
                } else {
                    format!(
                        "turns must be 1..N without gaps: turn {expected} is missing (next is {})",
                        row.turn
                    )
                };
                self.error(
                    row.line,
                    Some(id),
                    Some(row.turn),
                    Rule::TurnNumbering,
                    message,
                );
                expected = row.turn + 1;
            } else {
                expected += 1;
            }
            previous = Some(row);
        }
    }
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// `turn` as an integer: JSON integers, or floats with no fractional part (pandas writes
/// `3.0` for an integer column with gaps).
fn whole_number(v: &Value) -> Option<i64> {
    match v {
        Value::Number(n) => n.as_i64().or_else(|| {
            n.as_f64()
                .filter(|f| f.fract() == 0.0 && f.abs() < 1e15)
                .map(|f| f as i64)
        }),
        _ => None,
    }
}

/// Why an id is not usable, per the reference's grouping rule.
fn id_problem(id: &str) -> Option<String> {
    if id.is_empty() {
        return Some("'conversation_id' must be a non-empty string".to_string());
    }
    if id == "nan" {
        return Some("'conversation_id' must not be \"nan\"".to_string());
    }
    if !id.bytes().all(|b| (32..=126).contains(&b)) {
        return Some(
            "'conversation_id' must not contain non-printable or non-ASCII characters".to_string(),
        );
    }
    None
}

/// What a row of `role` lacks: user content, assistant content or calls, tool results.
fn content_problem(role: Option<Role>, row: &Row) -> Option<(Rule, String)> {
    match role {
        Some(Role::User) if !non_empty_content(row.get("content")) => Some((
            Rule::UserContent,
            "a 'user' row needs non-empty 'content'".to_string(),
        )),
        Some(Role::Assistant)
            if !non_empty_content(row.get("content")) && !row.has_tool_calls() =>
        {
            Some((
                Rule::AssistantContent,
                "an 'assistant' row needs non-empty 'content' or 'tool_calls'".to_string(),
            ))
        }
        Some(Role::Tool) => match row.get("tool_results") {
            None => Some((
                Rule::ToolResults,
                "a 'tool' row needs 'tool_results'".to_string(),
            )),
            Some(results) => tool_results_problem(results).map(|p| (Rule::ToolResults, p)),
        },
        _ => None,
    }
}

fn non_empty_content(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) => false,
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(_) => true,
    }
}

fn non_empty_str(v: Option<&Value>) -> bool {
    matches!(v, Some(Value::String(s)) if !s.is_empty())
}

fn tool_calls_problem(calls: &Value) -> Option<String> {
    let Value::Array(list) = calls else {
        return Some(format!(
            "'tool_calls' must be a list, got {}",
            json_kind(calls)
        ));
    };
    if list.is_empty() {
        return Some("'tool_calls' must not be an empty list".to_string());
    }
    for (i, call) in list.iter().enumerate() {
        let Value::Object(call) = call else {
            return Some(format!(
                "tool_calls[{i}] must be an object, got {}",
                json_kind(call)
            ));
        };
        if !non_empty_str(call.get("id")) {
            return Some(format!("tool_calls[{i}].id must be a non-empty string"));
        }
        if call.get("type").and_then(Value::as_str) != Some("function") {
            return Some(format!("tool_calls[{i}].type must be \"function\""));
        }
        let Some(Value::Object(function)) = call.get("function") else {
            return Some(format!("tool_calls[{i}].function must be an object"));
        };
        if !non_empty_str(function.get("name")) {
            return Some(format!(
                "tool_calls[{i}].function.name must be a non-empty string"
            ));
        }
        match function.get("arguments") {
            Some(Value::String(_)) | Some(Value::Object(_)) => {}
            Some(other) => {
                return Some(format!(
                    "tool_calls[{i}].function.arguments must be a string or an object, got {}",
                    json_kind(other)
                ))
            }
            None => return Some(format!("tool_calls[{i}].function.arguments is missing")),
        }
    }
    None
}

fn tool_results_problem(results: &Value) -> Option<String> {
    let Value::Array(list) = results else {
        return Some(format!(
            "'tool_results' must be a list, got {}",
            json_kind(results)
        ));
    };
    if list.is_empty() {
        return Some("'tool_results' must not be an empty list".to_string());
    }
    for (i, result) in list.iter().enumerate() {
        let Value::Object(result) = result else {
            return Some(format!(
                "tool_results[{i}] must be an object, got {}",
                json_kind(result)
            ));
        };
        if !non_empty_str(result.get("tool_call_id")) {
            return Some(format!(
                "tool_results[{i}].tool_call_id must be a non-empty string"
            ));
        }
        if !result.contains_key("content") {
            return Some(format!("tool_results[{i}] needs a 'content' key"));
        }
    }
    None
}

/// Row keys that become request fields, in the reference body's field order (the three
/// max-token aliases sit where `max_completion_tokens` goes).
pub(crate) const REQUEST_KEYS: &[&str] = &[
    "model",
    "temperature",
    "max_new_tokens",
    "max_completion_tokens",
    "max_tokens",
    "stream",
    "seed",
    "top_p",
    "top_k",
    "repetition_penalty",
    "n",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "user",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "tool_choice",
];

/// Turns a validated, turn-sorted group into its history and client turns (§3, §4).
fn build_conversation(group: Group) -> Conversation {
    let rows = group.rows;
    if rows.is_empty() {
        return Conversation {
            id: group.id,
            messages: Vec::new(),
            client_turns: Vec::new(),
        };
    }
    let mut messages: Vec<HistoryMessage> = Vec::with_capacity(rows.len() + 4);
    if let Some(system) = rows.iter().find_map(|r| {
        r.get("system")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
    }) {
        messages.push(HistoryMessage::new(
            Role::System,
            &WireMessage {
                role: "system",
                content: Some(&Value::String(system.to_string())),
                ..WireMessage::default()
            },
        ));
    }

    // What the first user row propagates to the conversation's other client rows (§4.2):
    // `model` and `max_completion_tokens` are always filled from the model parameters first,
    // so only `max_new_tokens`, `tools` and a `stream: true` ever reach other rows. `tools`
    // (often tens of KB, on every row of converted files) is kept once, on the first turn,
    // and applied by `Conversation::request_field`.
    let first_tools = rows[0].get("tools").cloned();
    let propagated: Vec<(&str, Value)> = ["max_new_tokens", "stream"]
        .into_iter()
        .filter_map(|k| rows[0].get(k).map(|v| (k, v.clone())))
        .filter(|(k, v)| *k != "stream" || truthy(v))
        .collect();

    // Pass 1: every message's wire form, and each client row's history length.
    let mut history_lens = Vec::with_capacity(rows.len());
    for row in &rows {
        let role = row.role().unwrap_or(Role::User);
        match row.get("tool_results") {
            Some(Value::Array(results)) => {
                for result in results {
                    messages.push(HistoryMessage::new(
                        Role::Tool,
                        &WireMessage {
                            role: "tool",
                            content: result.get("content").filter(|v| !v.is_null()),
                            tool_call_id: result.get("tool_call_id"),
                            ..WireMessage::default()
                        },
                    ));
                }
            }
            _ => {
                let role_name = match role {
                    Role::System => "system",
                    Role::User => "user",
                    Role::Assistant => "assistant",
                    Role::Tool => "tool",
                };
                messages.push(HistoryMessage::new(
                    role,
                    &WireMessage {
                        role: role_name,
                        content: row.get("content"),
                        name: row.get("name"),
                        tool_calls: row.get("tool_calls"),
                        tool_call_id: None,
                        reasoning_content: row.get("reasoning_content"),
                    },
                ));
            }
        }
        history_lens.push(messages.len());
    }

    // Pass 2: client turns, moving request fields and replies out of the rows.
    let mut rows = rows;
    let mut client_turns = Vec::new();
    for i in 0..rows.len() {
        if rows[i].role() == Some(Role::Assistant) {
            continue;
        }
        let expected = match rows.get_mut(i + 1) {
            // An assistant row is one message: the last one its pass-1 length counts.
            Some(next) if next.role() == Some(Role::Assistant) => {
                Some(expected_reply(next, history_lens[i + 1] - 1))
            }
            _ => None,
        };
        let row = &mut rows[i];
        let mut overrides = Map::new();
        for key in REQUEST_KEYS {
            match row.fields.remove(*key).filter(|v| !v.is_null()) {
                Some(v) if *key == "tools" && i > 0 && Some(&v) == first_tools.as_ref() => {}
                Some(v) => {
                    overrides.insert((*key).to_string(), v);
                }
                None if i > 0 => {
                    if let Some((_, v)) = propagated.iter().find(|(k, _)| k == key) {
                        overrides.insert((*key).to_string(), v.clone());
                    }
                }
                None => {}
            }
        }
        client_turns.push(ClientTurn {
            turn: row.turn as u32,
            history_len: history_lens[i],
            delay_seconds: row
                .get("delay_seconds")
                .and_then(Value::as_f64)
                .filter(|d| *d > 0.0 && d.is_finite())
                .unwrap_or(0.0),
            overrides,
            expected,
        });
    }
    messages.shrink_to_fit();
    client_turns.shrink_to_fit();
    Conversation {
        id: group.id,
        messages,
        client_turns,
    }
}

fn expected_reply(row: &mut Row, message: usize) -> ExpectedReply {
    ExpectedReply {
        turn: row.turn as u32,
        message,
        tool_calls: row
            .fields
            .remove("tool_calls")
            .filter(|v| !v.is_null())
            .and_then(|v| serde_json::value::to_raw_value(&v).ok()),
        intent_codes: row
            .get("intent_codes")
            .and_then(Value::as_array)
            .map(|codes| {
                codes
                    .iter()
                    .filter_map(Value::as_str)
                    .map(str::to_string)
                    .collect()
            }),
    }
}

/// Python truthiness of a JSON value, as the reference's `a or b` chains see it.
pub(crate) fn truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

/// A message in the wire's key order (`role, content, name, tool_calls, tool_call_id,
/// reasoning_content`) with nulls omitted, as the reference's `ChatMessage` encodes it.
#[derive(Default, serde::Serialize)]
pub(crate) struct WireMessage<'a> {
    pub role: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<&'a Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<&'a Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<&'a Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<&'a Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<&'a Value>,
}

impl HistoryMessage {
    pub(crate) fn new(role: Role, msg: &WireMessage<'_>) -> Self {
        // Serialising our own struct cannot fail: every field is plain JSON.
        let wire = serde_json::value::to_raw_value(msg).expect("a message encodes as JSON");
        HistoryMessage { role, wire }
    }
}
