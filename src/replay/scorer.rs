//! The reference's inline scorer (§17), exactly: ground truth from the dataset, the issued set
//! from `events.jsonl`, bash-executable multiset Jaccard for coding turns, intent codes for
//! workflow turns, turn-weighted mean rounded to 4 places → `scores.json`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::BufRead;
use std::path::Path;
use std::sync::OnceLock;

use regex::Regex;
use serde_json::{json, Map, Value};

use crate::dataset::{Dataset, ExpectedReply};

/// Why scoring failed.
#[derive(Debug, thiserror::Error)]
pub enum ScoreError {
    /// The events log could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
}

/// The scorer's result, `scores.json` as a JSON value plus the headline.
#[derive(Debug, Clone)]
pub struct Scores {
    /// Turn-weighted mean, or `None` when nothing was scorable.
    pub score: Option<f64>,
    /// Distinct repeat ids among issued keys.
    pub repeats: usize,
    /// `turns.missing`.
    pub missing: u64,
    /// The whole `scores.json` document.
    pub json: Value,
}

/// Ground truth keyed by (source id, client turn).
pub(crate) type Expected<'a> = HashMap<(&'a str, u32), &'a ExpectedReply>;

/// Collects the ground truth of every client turn followed by an assistant row.
pub(crate) fn expected(dataset: &Dataset) -> Expected<'_> {
    let mut map = HashMap::new();
    for conv in &dataset.conversations {
        for t in &conv.client_turns {
            if let Some(e) = &t.expected {
                map.insert((conv.id.as_str(), t.turn), e);
            }
        }
    }
    map
}

fn re(cell: &'static OnceLock<Regex>, pattern: &str) -> &'static Regex {
    cell.get_or_init(|| Regex::new(pattern).expect("static regex"))
}

fn repeat_re() -> &'static Regex {
    static R: OnceLock<Regex> = OnceLock::new();
    re(&R, r"__repeat_(\d+)$")
}

fn is_workflow(source: &str) -> bool {
    static R: OnceLock<Regex> = OnceLock::new();
    re(&R, r"^sim_\d+$").is_match(source)
}

/// `(source, repeat)` of a logical id.
pub(crate) fn split_repeat(logical: &str) -> (&str, u64) {
    match repeat_re().captures(logical) {
        Some(c) => {
            let whole = c.get(0).expect("match");
            (&logical[..whole.start()], c[1].parse().unwrap_or(u64::MAX))
        }
        None => (logical, 1),
    }
}

fn alias(exe: &str) -> Option<&'static str> {
    Some(match exe {
        "python" | "python2" | "python3" | "py" => "python",
        "pip" | "pip3" => "pip",
        "pytest" => "pytest",
        "pylint" => "pylint",
        "sphinx-build" | "sphinx-quickstart" => "sphinx",
        "cython" => "cython",
        "make" => "make",
        "conda" => "conda",
        "cat" | "less" | "more" => "cat",
        "head" => "head",
        "tail" => "tail",
        "wc" => "wc",
        "diff" => "diff",
        "grep" | "egrep" | "fgrep" | "rg" | "ag" => "grep",
        "sed" => "sed",
        "awk" | "gawk" => "awk",
        "tr" => "tr",
        "sort" => "sort",
        "uniq" => "uniq",
        "cut" => "cut",
        "ls" => "ls",
        "find" | "locate" => "find",
        "xargs" => "xargs",
        "cp" => "cp",
        "mv" => "mv",
        "rm" => "rm",
        "mkdir" => "mkdir",
        "touch" => "touch",
        "tee" => "tee",
        "source" | "." => "source",
        "which" => "which",
        "alias" => "alias",
        "unset" => "unset",
        "export" => "export",
        "git" => "git",
        "curl" | "wget" => "curl",
        "true" => "true",
        "false" => "false",
        "timeout" => "timeout",
        "date" => "date",
        "apt-get" | "apt" => "apt",
        "yum" => "yum",
        _ => return None,
    })
}

/// Normalised bash actions of one command string (§17.4 steps 3–7).
pub(crate) fn command_actions(command: &str) -> Vec<&'static str> {
    static QUOTED: OnceLock<Regex> = OnceLock::new();
    static STAGES: OnceLock<Regex> = OnceLock::new();
    static ASSIGN: OnceLock<Regex> = OnceLock::new();
    static VERSION: OnceLock<Regex> = OnceLock::new();
    let quoted = re(&QUOTED, r#"'[^']*'|"(?:[^"\\]|\\.)*"|`[^`]*`"#);
    let stages = re(&STAGES, r"\|\||\||&&|;|\n");
    let assign = re(&ASSIGN, r"^[A-Za-z_][A-Za-z0-9_]*=");
    let version = re(&VERSION, r"\.\d+(\.\d+)?$");
    let stripped = quoted.replace_all(command, " ");
    let mut out = Vec::new();
    for stage in stages.split(&stripped) {
        let mut tokens = stage.split_whitespace().peekable();
        while let Some(tok) = tokens.peek() {
            if assign.is_match(tok)
                || matches!(*tok, "env" | "time" | "nice" | "sudo" | "exec" | "command")
            {
                tokens.next();
            } else {
                break;
            }
        }
        let Some(first) = tokens.next() else { continue };
        let exe = first.rsplit('/').next().unwrap_or(first).to_lowercase();
        let exe = version.replace(&exe, "");
        if let Some(a) = alias(&exe) {
            out.push(a);
        }
    }
    out
}

/// Bash actions of a list of tool calls (§17.4 `_bash_actions`).
pub(crate) fn bash_actions(tool_calls: Option<&Value>) -> Vec<&'static str> {
    let mut out = Vec::new();
    let Some(Value::Array(calls)) = tool_calls else {
        return out;
    };
    for call in calls {
        let Some(func) = call.get("function") else {
            continue;
        };
        if func.get("name").and_then(Value::as_str) != Some("bash") {
            continue;
        }
        let args = match func.get("arguments") {
            Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
                Ok(v) => v,
                Err(_) => continue,
            },
            Some(v) => v.clone(),
            None => continue,
        };
        let Value::Object(args) = args else { continue };
        let command = args
            .get("command")
            .filter(|v| truthy(v))
            .or_else(|| args.get("cmd"));
        if let Some(Value::String(cmd)) = command {
            out.extend(command_actions(cmd));
        }
    }
    out
}

fn truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

/// The model's intent code (§17.4 workflow turns).
pub(crate) fn model_intent(reasoning: Option<&str>, content: Option<&str>) -> Option<String> {
    static EXPLICIT: OnceLock<Regex> = OnceLock::new();
    static BARE: OnceLock<Regex> = OnceLock::new();
    let explicit = re(&EXPLICIT, r"(?i)\bintent:\s*(I\d{3})\b");
    let bare = re(&BARE, r"\bI(\d{3})\b");
    let fields = [reasoning, content];
    for f in fields.iter().flatten() {
        if let Some(c) = explicit.captures(f) {
            return Some(c[1].to_uppercase());
        }
    }
    for f in fields.iter().flatten() {
        if let Some(c) = bare.captures_iter(f).last() {
            return Some(format!("I{}", &c[1]));
        }
    }
    None
}

fn multiset_jaccard(gt: &[&str], model: &[&str]) -> f64 {
    let mut counts: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    for a in gt {
        counts.entry(a).or_default().0 += 1;
    }
    for a in model {
        counts.entry(a).or_default().1 += 1;
    }
    let (mut inter, mut union) = (0u64, 0u64);
    for (g, m) in counts.values() {
        inter += g.min(m);
        union += g.max(m);
    }
    if union == 0 {
        0.0
    } else {
        inter as f64 / union as f64
    }
}

/// Python's `round(x, 4)` (correctly rounded on the binary value).
pub(crate) fn round4(x: f64) -> f64 {
    format!("{x:.4}").parse().unwrap_or(x)
}

/// A model turn assembled from a `TextModelOutput`.
#[derive(Debug, Clone, Default)]
struct ModelTurn {
    content: Option<String>,
    reasoning: Option<String>,
    tool_calls: Option<Value>,
}

fn join_text(v: &Value) -> Option<String> {
    match v {
        Value::Null => None,
        Value::String(s) => Some(s.clone()),
        Value::Array(parts) => Some(
            parts
                .iter()
                .filter_map(|p| p.as_str())
                .collect::<Vec<_>>()
                .concat(),
        ),
        other => Some(other.to_string()),
    }
}

/// Merges tool-call deltas by `index` as the reference (`merge_tool_calls`).
fn merge_tool_calls(v: &Value) -> Option<Value> {
    let Value::Array(items) = v else { return None };
    let mut merged: BTreeMap<i64, Map<String, Value>> = BTreeMap::new();
    let mut deltas: Vec<&Value> = Vec::new();
    for item in items {
        match item {
            Value::Array(inner) => deltas.extend(inner.iter()),
            other => deltas.push(other),
        }
    }
    for (pos, d) in deltas.iter().enumerate() {
        let idx = d.get("index").and_then(Value::as_i64).unwrap_or(pos as i64);
        let entry = merged.entry(idx).or_insert_with(|| {
            let mut m = Map::new();
            m.insert("type".into(), json!("function"));
            m.insert("function".into(), json!({"arguments": ""}));
            m
        });
        for key in ["id", "type"] {
            if let Some(Value::String(s)) = d.get(key) {
                if !s.is_empty() {
                    entry.insert(key.into(), json!(s));
                }
            }
        }
        if let Some(f) = d.get("function") {
            let func = entry
                .get_mut("function")
                .and_then(Value::as_object_mut)
                .expect("function object");
            if let Some(Value::String(name)) = f.get("name") {
                if !name.is_empty() {
                    func.insert("name".into(), json!(name));
                }
            }
            match f.get("arguments") {
                Some(Value::String(a)) if !a.is_empty() => {
                    let prev = func
                        .get("arguments")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string();
                    func.insert("arguments".into(), json!(prev + a));
                }
                Some(obj @ Value::Object(_)) => {
                    func.insert("arguments".into(), obj.clone());
                }
                _ => {}
            }
        }
    }
    if merged.is_empty() {
        return None;
    }
    Some(Value::Array(
        merged.into_values().map(Value::Object).collect(),
    ))
}

fn model_turn(data: &Value) -> Option<ModelTurn> {
    let arr = data.as_array()?;
    if arr.first()?.as_str()? != "TextModelOutput" {
        return None;
    }
    let get = |i: usize| arr.get(i).unwrap_or(&Value::Null);
    Some(ModelTurn {
        content: Some(join_text(get(1)).unwrap_or_default()),
        reasoning: join_text(get(2)),
        tool_calls: merge_tool_calls(get(3)),
    })
}

#[derive(serde::Deserialize)]
struct Line {
    event_type: String,
    #[serde(default)]
    sample_uuid: String,
    #[serde(default)]
    conversation_id: String,
    #[serde(default)]
    turn: Option<u32>,
    #[serde(default)]
    data: Value,
}

/// Scores `events.jsonl` against the dataset's ground truth.
pub fn score_events(path: &Path, dataset: &Dataset) -> Result<Scores, ScoreError> {
    let file = std::fs::File::open(path).map_err(|source| ScoreError::Io {
        path: path.display().to_string(),
        source,
    })?;
    let exp = expected(dataset);
    let mut issued: BTreeMap<(String, u64, u32), Vec<String>> = BTreeMap::new();
    let mut outputs: HashMap<String, Option<ModelTurn>> = HashMap::new();
    for line in std::io::BufReader::new(file).lines() {
        let line = line.map_err(|source| ScoreError::Io {
            path: path.display().to_string(),
            source,
        })?;
        let Ok(rec) = serde_json::from_str::<Line>(&line) else {
            continue;
        };
        let Some(turn) = rec.turn else { continue };
        if rec.conversation_id.is_empty() {
            continue;
        }
        match rec.event_type.as_str() {
            "sample.issued" => {
                let (source, repeat) = split_repeat(&rec.conversation_id);
                if exp.contains_key(&(source, turn)) {
                    issued
                        .entry((source.to_string(), repeat, turn))
                        .or_default()
                        .push(rec.sample_uuid);
                }
            }
            "sample.complete" => {
                let out = model_turn(&rec.data);
                let slot = outputs.entry(rec.sample_uuid).or_insert(None);
                if out.is_some() {
                    *slot = out;
                }
            }
            _ => {}
        }
    }
    Ok(score_issued(&issued, &outputs, &exp))
}

fn score_issued(
    issued: &BTreeMap<(String, u64, u32), Vec<String>>,
    outputs: &HashMap<String, Option<ModelTurn>>,
    exp: &Expected<'_>,
) -> Scores {
    let mut per_turn = Vec::new();
    let mut excluded = Vec::new();
    let mut excluded_seen = BTreeSet::new();
    let (mut n_expected, mut observed, mut scored) = (0u64, 0u64, 0u64);
    let mut sum = 0.0;
    let mut domains: BTreeMap<&str, (f64, u64)> = BTreeMap::new();
    let repeats: BTreeSet<u64> = issued.keys().map(|k| k.1).collect();
    for ((source, repeat, turn), uuids) in issued {
        let gt = exp[&(source.as_str(), *turn)];
        let workflow = is_workflow(source);
        let domain = if workflow { "workflow" } else { "coding" };
        let gt_intents: BTreeSet<String> = gt
            .intent_codes
            .iter()
            .flatten()
            .filter(|c| !c.is_empty())
            .map(|c| c.to_uppercase())
            .collect();
        let gt_calls = gt.tool_calls_value();
        let gt_actions = bash_actions(gt_calls.as_ref());
        let scorable = if workflow {
            !gt_intents.is_empty()
        } else {
            !gt_actions.is_empty()
        };
        if !scorable {
            if excluded_seen.insert((source.clone(), gt.turn)) {
                excluded.push(json!({"conversation_id": source, "turn": gt.turn, "domain": domain, "exclude_reason": "no ground truth"}));
            }
            continue;
        }
        n_expected += 1;
        let out = uuids
            .iter()
            .find_map(|u| outputs.get(u).and_then(|o| o.as_ref()));
        let mut row = Map::new();
        row.insert("conversation_id".into(), json!(source));
        row.insert("repeat".into(), json!(repeat));
        row.insert("turn".into(), json!(gt.turn));
        row.insert("domain".into(), json!(domain));
        if out.is_none() {
            row.insert("missing".into(), json!(true));
        } else {
            observed += 1;
        }
        let score = if workflow {
            let intent =
                out.and_then(|o| model_intent(o.reasoning.as_deref(), o.content.as_deref()));
            row.insert("gt_intents".into(), json!(gt_intents));
            let s = match &intent {
                Some(i) if gt_intents.contains(i) => 1.0,
                _ => 0.0,
            };
            row.insert("model_intent".into(), json!(intent));
            s
        } else {
            let model_actions = out.map_or_else(Vec::new, |o| bash_actions(o.tool_calls.as_ref()));
            let s = if model_actions.is_empty() {
                0.0
            } else {
                multiset_jaccard(&gt_actions, &model_actions)
            };
            row.insert("gt_actions".into(), json!(gt_actions));
            row.insert("model_actions".into(), json!(model_actions));
            s
        };
        let score = round4(score);
        row.insert("score".into(), json!(score));
        per_turn.push(Value::Object(row));
        scored += 1;
        sum += score;
        let d = domains.entry(domain).or_default();
        d.0 += score;
        d.1 += 1;
    }
    let final_score = (scored > 0).then(|| round4(sum / scored as f64));
    let mut doc = Map::new();
    doc.insert("score".into(), json!(final_score));
    doc.insert(
        "turns".into(),
        json!({"issued": issued.len(), "expected": n_expected, "observed": observed,
               "missing": n_expected - observed, "scored": scored}),
    );
    let mut dom = Map::new();
    for name in ["coding", "workflow"] {
        if let Some((s, n)) = domains.get(name) {
            dom.insert(
                name.into(),
                json!({"score": round4(s / *n as f64), "scored": n}),
            );
        }
    }
    doc.insert("domains".into(), Value::Object(dom));
    doc.insert("per_turn".into(), Value::Array(per_turn));
    if !excluded.is_empty() {
        doc.insert("excluded_turns".into(), Value::Array(excluded));
    }
    Scores {
        score: final_score,
        repeats: repeats.len(),
        missing: n_expected - observed,
        json: Value::Object(doc),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pipeline_counts_only_the_first_word_of_each_stage() {
        assert_eq!(
            command_actions(r#"find . -name "*.py" | xargs grep -l "x" | head -20"#),
            vec!["find", "xargs", "head"]
        );
        assert_eq!(
            command_actions("cd /testbed && FOO=1 sudo python3.11 -c 'import x; y' || echo no"),
            vec!["python"]
        );
        assert_eq!(
            command_actions("cat <<EOF > f.py\nimport os\nprint(1)\nEOF"),
            vec!["cat"]
        );
        assert_eq!(command_actions("/usr/bin/GREP x & ls"), vec!["grep"]);
    }

    #[test]
    fn intent_prefers_explicit_marker_then_last_bare_code() {
        assert_eq!(
            model_intent(Some("think I001"), Some("intent: i057")),
            Some("I057".into())
        );
        assert_eq!(
            model_intent(Some("I001 then I002"), Some("I003")),
            Some("I002".into())
        );
        assert_eq!(model_intent(None, Some("nothing")), None);
    }

    #[test]
    fn round4_matches_python() {
        assert_eq!(round4(2.0 / 3.0), 0.6667);
        assert_eq!(round4(0.125), 0.125);
        assert_eq!(round4(1.0 / 6.0), 0.1667);
    }
}
