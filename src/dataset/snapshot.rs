//! Snapshot converter: the reference's snapshot JSONL (one full `messages` array per line,
//! the last snapshot of a conversation wins) into flat dataset rows, as
//! `scripts/convert_agentic_snapshot.py` does.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, BufWriter, Write};
use std::path::Path;

use anyhow::Context as _;
use serde_json::{json, Map, Value};

/// What a conversion produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConvertSummary {
    /// Snapshot lines read (sentinel rows excluded).
    pub snapshots: usize,
    /// Conversations written.
    pub conversations: usize,
    /// Flat rows written.
    pub rows: usize,
}

/// Converts the snapshot file `input` into a flat dataset at `out` (`.zst` compresses); a
/// line longer than `max_line_bytes` stops it.
pub fn convert_file(
    input: &Path,
    out: &Path,
    max_line_bytes: usize,
) -> anyhow::Result<ConvertSummary> {
    let reader = super::load::open_lines(input)
        .with_context(|| format!("cannot open {}", input.display()))?;
    let file = File::create(out).with_context(|| format!("cannot create {}", out.display()))?;
    let summary = if super::load::is_zstd(out) {
        let mut enc = zstd::Encoder::new(BufWriter::new(file), 3)?;
        let s = convert(
            reader,
            &mut enc,
            &input.display().to_string(),
            max_line_bytes,
        )?;
        enc.finish()?.flush()?;
        s
    } else {
        let mut w = BufWriter::new(file);
        let s = convert(reader, &mut w, &input.display().to_string(), max_line_bytes)?;
        w.flush()?;
        s
    };
    Ok(summary)
}

/// Converts snapshot lines from `reader` into flat rows written to `out`; conversations come
/// out in the order they first appear, each from its last snapshot.
pub fn convert<R: BufRead, W: Write>(
    reader: R,
    out: &mut W,
    source: &str,
    max_line_bytes: usize,
) -> anyhow::Result<ConvertSummary> {
    let mut order: Vec<String> = Vec::new();
    let mut last: HashMap<String, (Vec<Value>, Option<Value>)> = HashMap::new();
    let mut snapshots = 0;
    let mut lines = super::lines::Lines::new(reader, max_line_bytes);
    while let Some((line_no, line)) = lines
        .next_line()
        .map_err(|e| anyhow::anyhow!("{source}: {e}"))?
    {
        if line.trim_ascii().is_empty() {
            continue;
        }
        let mut v: Map<String, Value> = serde_json::from_slice(line)
            .with_context(|| format!("{source}: line {line_no}: not a JSON object"))?;
        if v.contains_key("_type") {
            continue;
        }
        snapshots += 1;
        let id = match v.remove("conversation_id") {
            Some(Value::String(s)) => s,
            _ => anyhow::bail!(
                "{source}: line {}: 'conversation_id' must be a string",
                line_no
            ),
        };
        let messages = match v.remove("messages") {
            Some(Value::Array(m)) => m,
            _ => anyhow::bail!("{source}: line {line_no}: 'messages' must be a list"),
        };
        let tools = v.remove("tools").filter(|t| !t.is_null());
        if !last.contains_key(&id) {
            order.push(id.clone());
        }
        last.insert(id, (messages, tools));
    }
    let mut rows = 0;
    for id in &order {
        let (messages, tools) = &last[id];
        for row in flatten(id, messages, tools.as_ref()) {
            serde_json::to_writer(&mut *out, &row)?;
            out.write_all(b"\n")?;
            rows += 1;
        }
    }
    Ok(ConvertSummary {
        snapshots,
        conversations: order.len(),
        rows,
    })
}

fn role(m: &Value) -> &str {
    m.get("role").and_then(Value::as_str).unwrap_or("")
}

/// One conversation's messages as flat rows: the system message goes onto the first user
/// row, consecutive user messages are joined with a blank line, consecutive tool messages
/// become one `tool_results` row, `tools` goes on every client row, turns are 1..N.
fn flatten(id: &str, messages: &[Value], tools: Option<&Value>) -> Vec<Value> {
    let mut system: Option<String> = None;
    let mut rows: Vec<Value> = Vec::new();
    let mut i = 0;
    while i < messages.len() {
        let r = role(&messages[i]);
        let mut j = i + 1;
        if r == "user" || r == "tool" || r == "system" {
            while j < messages.len() && role(&messages[j]) == r {
                j += 1;
            }
        }
        let run = &messages[i..j];
        let turn = rows.len() + 1;
        match r {
            "system" => {
                if system.is_none() {
                    system = run[0]
                        .get("content")
                        .and_then(Value::as_str)
                        .map(str::to_string);
                }
            }
            "user" => {
                let content: Vec<String> = run
                    .iter()
                    .filter_map(|m| m.get("content").and_then(Value::as_str))
                    .map(str::to_string)
                    .collect();
                let mut row = json!({"conversation_id": id, "turn": turn, "role": "user",
                                     "content": content.join("\n\n")});
                if let Some(s) = system.take() {
                    row["system"] = Value::String(s);
                }
                if let Some(t) = tools {
                    row["tools"] = t.clone();
                }
                rows.push(row);
            }
            "tool" => {
                let results: Vec<Value> = run
                    .iter()
                    .map(|m| {
                        json!({"tool_call_id": m.get("tool_call_id").cloned().unwrap_or(Value::Null),
                               "content": m.get("content").cloned().unwrap_or(Value::Null)})
                    })
                    .collect();
                let mut row = json!({"conversation_id": id, "turn": turn, "role": "tool",
                                     "tool_results": results});
                if let Some(t) = tools {
                    row["tools"] = t.clone();
                }
                rows.push(row);
            }
            _ => {
                let mut row = json!({"conversation_id": id, "turn": turn, "role": r});
                let m = &run[0];
                for key in [
                    "content",
                    "reasoning_content",
                    "tool_calls",
                    "name",
                    "intent_codes",
                ] {
                    if let Some(v) = m.get(key).filter(|v| !v.is_null()) {
                        row[key] = v.clone();
                    }
                }
                rows.push(row);
            }
        }
        i = j;
    }
    rows
}
