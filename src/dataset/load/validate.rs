//! Validation: the per-row and per-conversation rules of the reference, applied as rows
//! stream in, with a bounded list of what failed.

use std::collections::HashSet;
use std::sync::Arc;

use serde_json::{Map, Value};

use crate::dataset::load::conversation::build_conversation;
use crate::dataset::load::{DatasetError, Rule, ValidationError};
use crate::dataset::{Conversation, Role};

/// A row that passed the per-row checks and waits for its conversation to end.
pub(super) struct Row {
    pub(super) line: usize,
    pub(super) turn: i64,
    pub(super) fields: Map<String, Value>,
}

impl Row {
    /// A present, non-null field (the reference treats null like a missing cell).
    pub(super) fn get(&self, key: &str) -> Option<&Value> {
        self.fields.get(key).filter(|v| !v.is_null())
    }

    pub(super) fn role(&self) -> Option<Role> {
        match self.get("role").and_then(Value::as_str) {
            Some("user") => Some(Role::User),
            Some("assistant") => Some(Role::Assistant),
            Some("tool") => Some(Role::Tool),
            _ => None,
        }
    }

    pub(super) fn role_text(&self) -> String {
        match self.get("role") {
            Some(Value::String(s)) => format!("'{s}'"),
            Some(other) => other.to_string(),
            None => "no role".to_string(),
        }
    }

    /// An assistant row whose `tool_calls` is a non-empty list.
    pub(super) fn has_tool_calls(&self) -> bool {
        matches!(self.get("tool_calls"), Some(Value::Array(a)) if !a.is_empty())
    }
}

/// The rows of the conversation being read.
pub(super) struct Group {
    pub(super) id: String,
    pub(super) rows: Vec<Row>,
    /// A row of it was dropped by a per-row check: report, but do not build.
    pub(super) damaged: bool,
}

pub(super) struct Loader {
    pub(super) max_errors: usize,
    pub(super) errors: Vec<ValidationError>,
    pub(super) total_errors: usize,
    pub(super) rows_seen: usize,
    /// Every id met so far, to catch a conversation that reappears later.
    pub(super) seen_ids: HashSet<String>,
    pub(super) current: Option<Group>,
    /// When a conversation reappears, its stray rows are skipped until the id changes.
    pub(super) skipping: Option<String>,
    pub(super) conversations: Vec<Arc<Conversation>>,
}

impl Loader {
    pub(super) fn new(max_errors: usize) -> Self {
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

    pub(super) fn error(
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

    pub(super) fn push_line(&mut self, line_no: usize, bytes: &[u8]) {
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

    pub(super) fn finish(mut self, source: &str) -> Result<Vec<Arc<Conversation>>, DatasetError> {
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

    pub(super) fn finish_group(&mut self, mut group: Group) {
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
    pub(super) fn check_structure(&mut self, group: &Group) {
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
    pub(super) fn check_numbering(&mut self, group: &Group) {
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

pub(super) fn json_kind(v: &Value) -> &'static str {
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
pub(super) fn whole_number(v: &Value) -> Option<i64> {
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
pub(super) fn id_problem(id: &str) -> Option<String> {
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
pub(super) fn content_problem(role: Option<Role>, row: &Row) -> Option<(Rule, String)> {
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

pub(super) fn non_empty_content(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) => false,
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(_) => true,
    }
}

pub(super) fn non_empty_str(v: Option<&Value>) -> bool {
    matches!(v, Some(Value::String(s)) if !s.is_empty())
}

pub(super) fn tool_calls_problem(calls: &Value) -> Option<String> {
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

pub(super) fn tool_results_problem(results: &Value) -> Option<String> {
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
