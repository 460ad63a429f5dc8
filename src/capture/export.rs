//! Turns a capture into an MLPerf agentic dataset: each session's chat requests become
//! user/tool rows, each reply an assistant row (the inline scorer's ground truth: the reply as
//! the agent echoed it in its next request, else the recorded response), and the gap between a
//! response's end and the next request's start its `delay_seconds`. Turns are sorted by
//! session through bounded spill files (`spill`) and built one session at a time,
//! so an export holds a buffer and one session, never the whole capture.

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

use super::reader::{Cut, Exchange};
use super::spill::{BaseSpill, Group, RowStore, Sorter, Spilled};
use super::CaptureError;

/// Which exchanges to export and how.
#[derive(Debug, Clone)]
pub struct ExportOptions {
    /// Only these session keys (all when empty).
    pub sessions: Vec<String>,
    /// Only exchanges started at or after this time (ns since the Unix epoch).
    pub since_unix_ns: Option<u64>,
    /// Only exchanges started before this time (ns since the Unix epoch).
    pub until_unix_ns: Option<u64>,
    /// Replace every message text by a hash-derived string of the same length, for sharing.
    pub redact_content: bool,
    /// How far apart the replicas' clocks may be (ms): a turn is held this long past its
    /// start for an earlier turn of its session that another replica stamped later.
    pub max_skew_ms: u64,
    /// Bytes the export holds in memory for the whole capture, however many replicas it
    /// reads: half for turns being sorted, a quarter for rows waiting to be written, a
    /// quarter for the replicas' delta bases; beyond its share each goes to files beside
    /// the output.
    pub sort_buffer_bytes: usize,
}

impl Default for ExportOptions {
    fn default() -> Self {
        ExportOptions {
            sessions: Vec::new(),
            since_unix_ns: None,
            until_unix_ns: None,
            redact_content: false,
            max_skew_ms: DEFAULT_MAX_SKEW_MS,
            sort_buffer_bytes: DEFAULT_SORT_BUFFER_BYTES,
        }
    }
}

/// Clocks synchronised by NTP agree within milliseconds; a second leaves a wide margin.
pub(crate) const DEFAULT_MAX_SKEW_MS: u64 = 1000;

/// Enough to export most captures without touching the disk; small beside a proxy's memory.
pub(crate) const DEFAULT_SORT_BUFFER_BYTES: usize = 64 << 20;

/// What an export wrote and what it left out.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ExportReport {
    /// The dataset written.
    pub out: PathBuf,
    /// Conversations written.
    pub conversations: usize,
    /// Rows written.
    pub rows: usize,
    /// Client (user or tool) rows: requests a replay sends.
    pub client_turns: usize,
    /// Chat exchanges used.
    pub exchanges: usize,
    /// Exchanges left out, by reason.
    pub skipped: std::collections::BTreeMap<String, u64>,
    /// Conversations whose agent sent no system message: a salted replay (the default)
    /// refuses them, so the export says so.
    pub without_system_prompt: usize,
    /// Capture directories read (one per replica).
    pub directories: usize,
    /// Turns placed before one with an earlier start time because their history is a prefix
    /// of its history: the replicas' clocks disagreed with the conversation's order.
    pub turns_ordered_by_history: u64,
    /// Sorted runs of turns written to spill files (0: everything fitted in the buffer).
    pub spill_runs: usize,
    /// The memory budget the export kept to (`sort_buffer_bytes`).
    pub buffer_bytes: usize,
    /// Most bytes held in the export's buffers: the peaks of the turns being sorted, the
    /// rows waiting and the replicas' delta bases (session keys and bodies), added up.
    pub peak_buffered_bytes: usize,
    /// Delta bases (a session's last request in a segment) kept in a spill file because
    /// their share of the budget was full.
    pub bases_spilled: u64,
    /// Most conversations whose rows were held at once: those of one session.
    pub peak_conversations_held: usize,
    /// Segments that end early.
    pub cuts: Vec<Cut>,
}

/// Exports the capture in `dir` to `out` (zstd-compressed when it ends in `.zst`).
pub fn export(dir: &Path, out: &Path, opts: &ExportOptions) -> Result<ExportReport, CaptureError> {
    export_dirs(&[dir.to_path_buf()], out, opts)
}

/// Exports the captures of several replicas as one dataset: one conversation per session key
/// across all of them, turns in start order (history order where the clocks disagree with
/// it), delays across replicas, conversations in the order they first appeared. Each
/// directory may also be a directory of replica directories.
///
/// Two passes: the replicas' exchanges are read once into turns sorted by session (spilled
/// past `sort_buffer_bytes`), then each session's turns are ordered and made rows, and its
/// memory let go, before the next session's.
pub fn export_dirs(
    paths: &[PathBuf],
    out: &Path,
    opts: &ExportOptions,
) -> Result<ExportReport, CaptureError> {
    if opts.sort_buffer_bytes == 0 {
        return Err(CaptureError::Invalid(
            "sort buffer: must be at least 1 byte".into(),
        ));
    }
    let dirs = super::merge::capture_dirs(paths)?;
    let budget = Budget::split(opts.sort_buffer_bytes);
    let mut builder = Builder::new(opts.clone());
    let mut sorter = Sorter::new(out, budget.turns);
    let bases = BaseSpill::new(out, budget.bases as u64);
    let mut seq = 0u64;
    let cuts = super::merge::for_each_exchange(&dirs, Some(&bases), |e| {
        seq += 1;
        match builder.admit(e, seq) {
            Some(turn) => sorter.push(turn),
            None => Ok(()),
        }
    })?;
    let turns_peak = sorter.peak();
    let mut sorted = sorter.finish()?;
    let mut rows = RowStore::new(out, budget.rows);
    let mut window = super::turns::Window::new(opts.max_skew_ms.saturating_mul(1_000_000));
    let mut group: Option<Group> = None;
    while let Some(spilled) = sorted.next_turn()? {
        if group.as_ref() != Some(&spilled.group) {
            window.finish(&mut builder);
            builder.flush(&mut rows)?;
            group = Some(spilled.group.clone());
        }
        if let Some(turn) = builder.parse(spilled) {
            let start = turn.start_unix_ns;
            window.push(turn, start, &mut builder);
        }
    }
    window.finish(&mut builder);
    builder.flush(&mut rows)?;
    let mut report = builder.report;
    report.spill_runs = sorted.runs();
    drop(sorted);
    report.buffer_bytes = opts.sort_buffer_bytes;
    report.peak_buffered_bytes = turns_peak + rows.peak() + bases.peak() as usize;
    report.bases_spilled = bases.spilled();
    drop(bases);
    report.cuts = cuts;
    report.directories = dirs.len();
    report.turns_ordered_by_history = window.ordered_by_history;
    report.out = out.to_path_buf();
    write_out(out, |w| rows.write_ordered(w, out))?;
    Ok(report)
}

/// The export's memory budget in its three shares. Turns get the most: a larger share means
/// fewer, longer runs to merge. Rows and bases fit in a quarter each for most captures, and
/// past it cost only file reads.
struct Budget {
    turns: usize,
    rows: usize,
    bases: usize,
}

impl Budget {
    fn split(total: usize) -> Budget {
        let turns = total / 2;
        let rows = total / 4;
        Budget {
            turns,
            rows,
            bases: total - turns - rows,
        }
    }
}

/// Writes `out` (zstd-compressed when it ends in `.zst`) through a temporary file renamed
/// into place, so a failed export leaves no partial dataset behind.
fn write_out(
    out: &Path,
    fill: impl FnOnce(&mut dyn Write) -> Result<(), CaptureError>,
) -> Result<(), CaptureError> {
    let io = |e| CaptureError::io(out, e);
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(io)?;
    }
    let name = out.file_name().unwrap_or_default().to_string_lossy();
    let partial = out.with_file_name(format!(".{name}.partial-{}", std::process::id()));
    let written = (|| {
        let file = std::fs::File::create(&partial).map_err(io)?;
        let buffered = std::io::BufWriter::new(file);
        if out.extension().is_some_and(|e| e == "zst") {
            let mut w = zstd::stream::write::Encoder::new(buffered, 9).map_err(io)?;
            fill(&mut w)?;
            w.finish().map_err(io)?.flush().map_err(io)
        } else {
            let mut w = buffered;
            fill(&mut w)?;
            w.flush().map_err(io)
        }
    })();
    match written.and_then(|()| std::fs::rename(&partial, out).map_err(io)) {
        Ok(()) => Ok(()),
        Err(e) => {
            let _ = std::fs::remove_file(&partial);
            Err(e)
        }
    }
}

/// Where a conversation's rows stand in the reference's role state machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Last {
    Start,
    User,
    Tool,
    /// An assistant row; true when it carried tool calls.
    Assistant(bool),
}

struct Conversation {
    id: String,
    /// Its first turn's start: conversations are written in this order.
    first_start_unix_ns: u64,
    rows: Vec<Map<String, Value>>,
    last: Last,
    /// Tools of the first user row, which the reference propagates to later client rows.
    tools: Option<Value>,
    /// The previous request's messages; the next request must extend them.
    prev_messages: Vec<Value>,
    prev_end_unix_ns: u64,
    /// The previous response as an assistant message, not yet written as a row.
    pending_reply: Option<Value>,
    /// Closed by something the dataset format cannot express.
    closed: bool,
}

/// A chat exchange parsed for export: its request without the messages, and the messages.
pub(crate) struct Turn {
    pub key: Option<String>,
    pub id: u64,
    pub start_unix_ns: u64,
    pub end_unix_ns: u64,
    pub request: Map<String, Value>,
    pub messages: Vec<Value>,
    pub reply: Option<Value>,
}

/// Builds rows session by session.
pub(crate) struct Builder {
    opts: ExportOptions,
    /// Open conversation per session key (`None` sessions never share one).
    open: HashMap<String, usize>,
    conversations: Vec<Conversation>,
    used_ids: HashSet<String>,
    report: ExportReport,
}

impl Builder {
    /// A builder applying `opts`.
    fn new(opts: ExportOptions) -> Builder {
        Builder {
            opts,
            open: HashMap::new(),
            conversations: Vec::new(),
            used_ids: HashSet::new(),
            report: ExportReport::default(),
        }
    }

    fn skip(&mut self, reason: &str) {
        *self.report.skipped.entry(reason.to_owned()).or_default() += 1;
    }

    /// The chat turn `e` holds, if the options keep it, as it waits to be sorted by session;
    /// what is left out is counted. `seq` numbers the exchanges in reading order.
    fn admit(&mut self, e: Exchange, seq: u64) -> Option<Spilled> {
        let r = &e.record;
        let key = r.session.clone();
        if !self.opts.sessions.is_empty()
            && !key.as_ref().is_some_and(|k| self.opts.sessions.contains(k))
        {
            return None;
        }
        if self.opts.since_unix_ns.is_some_and(|t| r.start_unix_ns < t)
            || self
                .opts
                .until_unix_ns
                .is_some_and(|t| r.start_unix_ns >= t)
        {
            return None;
        }
        let api = crate::wire::Api::of_path(&r.path).filter(|_| r.method == "POST");
        let Some(api) = api else {
            self.skip("not a chat completion");
            return None;
        };
        if e.request_body.is_none() {
            self.skip("request body not recorded");
            return None;
        }
        let reply = super::apis::reply(&e)
            .map(|m| serde_json::to_vec(&m).expect("a JSON value serialises"))
            .unwrap_or_default();
        Some(Spilled {
            group: key.map_or(Group::Alone(r.id), Group::Session),
            start_unix_ns: r.start_unix_ns,
            seq,
            id: r.id,
            end_unix_ns: e.end_unix_ns(),
            body: match super::apis::chat_body(api, e.request_body.unwrap_or_default()) {
                Ok(body) => body,
                Err(why) => {
                    self.skip(why);
                    return None;
                }
            },
            reply,
        })
    }

    /// The turn a sorted exchange holds, if its request is a chat request.
    fn parse(&mut self, s: Spilled) -> Option<Turn> {
        let Ok(Value::Object(mut request)) = serde_json::from_slice::<Value>(&s.body) else {
            self.skip("request body is not a JSON object");
            return None;
        };
        let Some(Value::Array(messages)) = request.shift_remove("messages") else {
            self.skip("request has no messages");
            return None;
        };
        let key = match s.group {
            Group::Session(k) => Some(k),
            Group::Alone(_) => None,
        };
        Some(Turn {
            key,
            id: s.id,
            start_unix_ns: s.start_unix_ns,
            end_unix_ns: s.end_unix_ns,
            request,
            messages,
            reply: serde_json::from_slice(&s.reply).ok(),
        })
    }

    /// Adds one prepared turn (in session order).
    pub(crate) fn add_turn(&mut self, turn: Turn) {
        let Turn {
            key,
            id,
            start_unix_ns,
            end_unix_ns,
            request,
            messages,
            reply,
        } = turn;
        self.report.exchanges += 1;

        let idx = key.as_ref().and_then(|k| self.open.get(k).copied());
        if let Some(c) = idx.map(|i| &mut self.conversations[i]) {
            if !c.closed && c.prev_messages == messages {
                // A retry of the previous request: its reply replaces the earlier one.
                if reply.is_some() {
                    c.pending_reply = reply;
                }
                c.prev_end_unix_ns = end_unix_ns;
                return self.skip("retry of the previous request");
            }
        }
        let extends = idx.is_some_and(|i| {
            let c = &self.conversations[i];
            !c.closed
                && messages.len() > c.prev_messages.len()
                && messages.starts_with(&c.prev_messages)
        });
        let idx = match (idx, extends) {
            (Some(i), true) => {
                let c = &mut self.conversations[i];
                let mut new = &messages[c.prev_messages.len()..];
                let echoed = match new.first() {
                    Some(m) if role(m) == "assistant" => {
                        new = &new[1..];
                        Some(m.clone())
                    }
                    _ => None,
                };
                let delay = start_unix_ns.saturating_sub(c.prev_end_unix_ns) as f64 / 1e9;
                // The reply as the agent sent it back wins over the recorded response: it is
                // what the following tool results refer to, and what a replay must resend.
                let recorded = c.pending_reply.take();
                if let Some(answer) = echoed.or(recorded) {
                    c.push_message(&answer);
                }
                c.push_messages(new, &request, Some(delay));
                i
            }
            _ => {
                if let Some(i) = idx {
                    self.conversations[i].close();
                }
                let base = match &key {
                    Some(k) => sanitize(k),
                    None => format!("exchange-{id}"),
                };
                let id = unique(&mut self.used_ids, &base);
                let mut c = Conversation {
                    id,
                    first_start_unix_ns: start_unix_ns,
                    rows: Vec::new(),
                    last: Last::Start,
                    tools: None,
                    prev_messages: Vec::new(),
                    prev_end_unix_ns: 0,
                    pending_reply: None,
                    closed: false,
                };
                let mut rest = &messages[..];
                let mut system = None;
                if let Some(first) = rest.first().filter(|m| role(m) == "system") {
                    system = first
                        .get("content")
                        .and_then(Value::as_str)
                        .map(str::to_owned);
                    rest = &rest[1..];
                }
                c.push_messages(rest, &request, None);
                if let (Some(s), Some(first)) = (system, c.rows.first_mut()) {
                    first.insert("system".into(), Value::String(s));
                }
                self.conversations.push(c);
                let i = self.conversations.len() - 1;
                if let Some(k) = &key {
                    self.open.insert(k.clone(), i);
                }
                i
            }
        };
        let c = &mut self.conversations[idx];
        c.prev_messages = messages;
        c.prev_end_unix_ns = end_unix_ns;
        c.pending_reply = reply;
        if key.is_none() {
            c.close();
        }
    }

    /// Hands the rows of every conversation held (one session's) to `store` and lets them
    /// go: the next turn is of another session.
    fn flush(&mut self, store: &mut RowStore) -> Result<(), CaptureError> {
        self.report.peak_conversations_held = self
            .report
            .peak_conversations_held
            .max(self.conversations.len());
        self.open.clear();
        let mut lines = Vec::new();
        for mut c in self.conversations.drain(..) {
            c.close();
            if c.rows.is_empty() {
                continue;
            }
            self.report.conversations += 1;
            if !c.rows.first().is_some_and(|r| r.contains_key("system")) {
                self.report.without_system_prompt += 1;
            }
            lines.clear();
            for (turn, mut row) in c.rows.drain(..).enumerate() {
                let mut out = Map::new();
                out.insert("conversation_id".into(), Value::String(c.id.clone()));
                out.insert("turn".into(), json!(turn + 1));
                if matches!(
                    row.get("role").and_then(Value::as_str),
                    Some("user" | "tool")
                ) {
                    self.report.client_turns += 1;
                }
                if self.opts.redact_content {
                    redact_row(&mut row);
                }
                out.extend(row);
                serde_json::to_writer(&mut lines, &out).expect("a JSON value serialises");
                lines.push(b'\n');
                self.report.rows += 1;
            }
            store.add(c.first_start_unix_ns, &lines)?;
        }
        Ok(())
    }
}

impl Conversation {
    /// Writes the last recorded reply and stops taking rows.
    fn close(&mut self) {
        if let Some(reply) = self.pending_reply.take() {
            if !self.closed {
                self.push_message(&reply);
            }
        }
        self.closed = true;
    }

    /// Appends messages as rows, grouping consecutive user messages (joined by a blank line)
    /// and consecutive tool messages (one row of `tool_results`), as the reference converter.
    /// Client rows carry the `request`'s tools and generation settings.
    fn push_messages(
        &mut self,
        messages: &[Value],
        request: &Map<String, Value>,
        delay: Option<f64>,
    ) {
        let mut i = 0;
        let mut delay = delay;
        while i < messages.len() && !self.closed {
            let r = role(&messages[i]);
            let mut j = i + 1;
            if r == "user" || r == "tool" {
                while j < messages.len() && role(&messages[j]) == r {
                    j += 1;
                }
            }
            let group = &messages[i..j];
            let row = match r {
                "user" => user_row(group),
                "tool" => tool_row(group),
                _ => None,
            };
            match row {
                Some(row) => self.push_row(row, Some(request), delay.take()),
                None if r == "assistant" => self.push_message(&messages[i]),
                None => self.closed = true,
            }
            i = j;
        }
    }

    /// Appends one assistant message as a row.
    fn push_message(&mut self, message: &Value) {
        match assistant_row(message) {
            Some(row) => self.push_row(row, None, None),
            None => self.closed = true,
        }
    }

    /// Appends one row; `request` is the one a client row was sent in, `None` for replies.
    fn push_row(
        &mut self,
        mut row: Map<String, Value>,
        request: Option<&Map<String, Value>>,
        delay: Option<f64>,
    ) {
        if self.closed {
            return;
        }
        let r = row.get("role").and_then(Value::as_str).unwrap_or("");
        let next = match (self.last, r) {
            (Last::Start, "user") => Last::User,
            (Last::User, "assistant") | (Last::Tool, "assistant") => {
                Last::Assistant(row.contains_key("tool_calls"))
            }
            (Last::Assistant(true), "tool") => Last::Tool,
            (Last::Assistant(false), "user") | (Last::Tool, "user") => Last::User,
            _ => {
                // The dataset format cannot express this order: end the conversation here.
                self.closed = true;
                return;
            }
        };
        if let Some(request) = request {
            if let Some(t) = request.get("tools") {
                match (&self.tools, self.last) {
                    (None, Last::Start) => {
                        self.tools = Some(t.clone());
                        row.insert("tools".into(), t.clone());
                    }
                    (Some(first), _) if first == t => {}
                    _ => {
                        row.insert("tools".into(), t.clone());
                    }
                }
            }
            for (key, v) in request {
                if is_generation_setting(key) && !v.is_null() {
                    row.insert(key.clone(), v.clone());
                }
            }
            super::apis::mark_row(&mut row, request);
            if let Some(d) = delay.filter(|d| *d > 0.0) {
                row.insert("delay_seconds".into(), json!((d * 1e6).round() / 1e6));
            }
        }
        self.last = next;
        self.rows.push(row);
    }
}

/// Whether a request field goes on its client rows as a per-row override: every field the
/// dataset format reads from a row, so a replay asks for what the agent asked for (a capture
/// of `max_completion_tokens: 32` must not replay at the default 1,024). `model` is left out:
/// it names the deployment, which the replay's `--model-name` chooses; `tools` has its own
/// first-row rule.
fn is_generation_setting(key: &str) -> bool {
    key != "model" && key != "tools" && crate::dataset::request::request_keys().any(|k| k == key)
}

fn role(m: &Value) -> &str {
    m.get("role").and_then(Value::as_str).unwrap_or("")
}

/// Message text: a string, or the text parts of a content array.
fn text(content: Option<&Value>) -> Option<String> {
    match content? {
        Value::String(s) => Some(s.clone()),
        Value::Array(parts) => {
            let texts: Option<Vec<&str>> = parts
                .iter()
                .map(|p| p.get("text").and_then(Value::as_str))
                .collect();
            texts.map(|t| t.concat())
        }
        _ => None,
    }
}

fn user_row(group: &[Value]) -> Option<Map<String, Value>> {
    let parts: Option<Vec<String>> = group.iter().map(|m| text(m.get("content"))).collect();
    let content = parts?.join("\n\n");
    if content.is_empty() {
        return None;
    }
    let mut row = Map::new();
    row.insert("role".into(), json!("user"));
    row.insert("content".into(), Value::String(content));
    Some(row)
}

fn tool_row(group: &[Value]) -> Option<Map<String, Value>> {
    let results: Option<Vec<Value>> = group
        .iter()
        .map(|m| {
            let id = m.get("tool_call_id").and_then(Value::as_str)?;
            let content = m.get("content").cloned().unwrap_or(Value::Null);
            (!id.is_empty()).then(|| json!({"tool_call_id": id, "content": content}))
        })
        .collect();
    let mut row = Map::new();
    row.insert("role".into(), json!("tool"));
    row.insert("tool_results".into(), Value::Array(results?));
    Some(row)
}

fn assistant_row(m: &Value) -> Option<Map<String, Value>> {
    let mut row = Map::new();
    row.insert("role".into(), json!("assistant"));
    let content = text(m.get("content")).filter(|c| !c.is_empty());
    let calls = m
        .get("tool_calls")
        .and_then(Value::as_array)
        .filter(|c| !c.is_empty())
        .cloned();
    if content.is_none() && calls.is_none() {
        return None;
    }
    if let Some(c) = content {
        row.insert("content".into(), Value::String(c));
    }
    if let Some(calls) = calls {
        let valid = calls.iter().all(|c| {
            c.get("id")
                .and_then(Value::as_str)
                .is_some_and(|s| !s.is_empty())
                && c.pointer("/function/name")
                    .and_then(Value::as_str)
                    .is_some_and(|s| !s.is_empty())
        });
        if !valid {
            return None;
        }
        let calls = calls
            .iter()
            .map(|c| {
                let args = c
                    .pointer("/function/arguments")
                    .cloned()
                    .unwrap_or(json!(""));
                json!({"id": c["id"], "type": "function",
                       "function": {"name": c["function"]["name"], "arguments": args}})
            })
            .collect();
        row.insert("tool_calls".into(), Value::Array(calls));
    }
    let reasoning = m
        .get("reasoning_content")
        .or_else(|| m.get("reasoning"))
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty());
    if let Some(r) = reasoning {
        row.insert("reasoning_content".into(), json!(r));
    }
    Some(row)
}

/// The assistant message of a recorded response: the JSON body's `choices[0].message`, or the
/// SSE deltas of `choices[0]` merged as the reference client merges them.
pub(crate) fn response_message(e: &Exchange) -> Option<Value> {
    let resp = e.record.response.as_ref()?;
    if !(200..300).contains(&resp.status) || !e.record.complete {
        return None;
    }
    let body = e.response_body.as_deref()?;
    let is_sse = resp.headers.iter().any(|(k, v)| {
        k.eq_ignore_ascii_case("content-type") && v.trim_start().starts_with("text/event-stream")
    });
    if !is_sse {
        let v: Value = serde_json::from_slice(body).ok()?;
        let m = v.pointer("/choices/0/message")?;
        let mut out = Map::new();
        out.insert("role".into(), json!("assistant"));
        for key in ["content", "tool_calls", "reasoning_content", "reasoning"] {
            if let Some(x) = m.get(key).filter(|x| !x.is_null()) {
                out.insert(key.into(), x.clone());
            }
        }
        return Some(Value::Object(out));
    }
    assistant_from_sse(body)
}

/// Merges the `choices[0]` deltas of an SSE chat-completions stream into one assistant
/// message (content and reasoning concatenated, tool calls merged by index).
pub fn assistant_from_sse(body: &[u8]) -> Option<Value> {
    let text = std::str::from_utf8(body).ok()?;
    let mut content = String::new();
    let mut reasoning = String::new();
    let mut calls: std::collections::BTreeMap<u64, Map<String, Value>> = Default::default();
    for line in text.lines() {
        let Some(data) = line.strip_prefix("data:") else {
            continue;
        };
        let Ok(chunk) = serde_json::from_str::<Value>(data.trim()) else {
            continue;
        };
        let Some(delta) = chunk.pointer("/choices/0/delta") else {
            continue;
        };
        if let Some(s) = delta.get("content").and_then(Value::as_str) {
            content.push_str(s);
        }
        if let Some(s) = delta
            .get("reasoning_content")
            .or_else(|| delta.get("reasoning"))
            .and_then(Value::as_str)
        {
            reasoning.push_str(s);
        }
        for tc in delta
            .get("tool_calls")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let index = tc.get("index").and_then(Value::as_u64).unwrap_or(0);
            let call = calls.entry(index).or_insert_with(|| {
                let mut m = Map::new();
                m.insert("id".into(), json!(""));
                m.insert("type".into(), json!("function"));
                m.insert("function".into(), json!({"name": "", "arguments": ""}));
                m
            });
            for key in ["id", "type"] {
                if let Some(s) = tc
                    .get(key)
                    .and_then(Value::as_str)
                    .filter(|s| !s.is_empty())
                {
                    call.insert(key.into(), json!(s));
                }
            }
            let f = call.get_mut("function").and_then(Value::as_object_mut)?;
            if let Some(s) = tc
                .pointer("/function/name")
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
            {
                f.insert("name".into(), json!(s));
            }
            if let Some(s) = tc.pointer("/function/arguments").and_then(Value::as_str) {
                let mut args = f
                    .get("arguments")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_owned();
                args.push_str(s);
                f.insert("arguments".into(), json!(args));
            }
        }
    }
    let mut out = Map::new();
    out.insert("role".into(), json!("assistant"));
    if !content.is_empty() {
        out.insert("content".into(), json!(content));
    }
    if !calls.is_empty() {
        out.insert(
            "tool_calls".into(),
            Value::Array(calls.into_values().map(Value::Object).collect()),
        );
    }
    if !reasoning.is_empty() {
        out.insert("reasoning_content".into(), json!(reasoning));
    }
    Some(Value::Object(out))
}

/// A conversation id from a session key: only ASCII 32..126 is allowed, others become `_`.
pub(crate) fn sanitize(key: &str) -> String {
    let s: String = key
        .chars()
        .map(|c| if (' '..='~').contains(&c) { c } else { '_' })
        .collect();
    if s.trim().is_empty() || s == "nan" {
        format!(
            "session-{}",
            &super::format::short_sha256(key.as_bytes())[..8]
        )
    } else {
        s
    }
}

fn unique(used: &mut HashSet<String>, base: &str) -> String {
    let mut id = base.to_owned();
    let mut n = 2;
    while used.contains(&id) {
        id = format!("{base}-{n}");
        n += 1;
    }
    used.insert(id.clone());
    id
}

/// A string of the same length in characters as `s`, derived from its hash: equal texts stay
/// equal, lengths (and so token counts, roughly) are kept, the words are gone.
pub(crate) fn mask(s: &str) -> String {
    let digest = super::format::short_sha256(s.as_bytes());
    digest.chars().cycle().take(s.chars().count()).collect()
}

fn redact_row(row: &mut Map<String, Value>) {
    for key in ["content", "system", "reasoning_content"] {
        if let Some(Value::String(s)) = row.get_mut(key) {
            *s = mask(s);
        }
    }
    if let Some(Value::Array(results)) = row.get_mut("tool_results") {
        for r in results {
            if let Some(Value::String(s)) = r.get_mut("content") {
                *s = mask(s);
            }
        }
    }
    if let Some(Value::Array(calls)) = row.get_mut("tool_calls") {
        for c in calls {
            if let Some(Value::String(s)) = c.pointer_mut("/function/arguments") {
                *s = mask(s);
            }
        }
    }
}
