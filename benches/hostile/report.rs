//! One attack's measures against one binary, printed as a Markdown table (side by side with
//! the other binary's in `--compare` mode) and written as JSON.

use serde_json::{json, Value};

/// A measure's value: a number with its unit, or words (statuses, outcomes).
#[derive(Debug, Clone)]
pub enum Measure {
    Num(f64, &'static str),
    Text(String),
}

/// One attack against one binary.
#[derive(Debug, Clone)]
pub struct Run {
    pub attack: String,
    /// `before`/`after` in `--compare` mode, else `agentrace`; a peer's name for a peer.
    pub label: String,
    pub binary: String,
    pub rows: Vec<(String, Measure)>,
}

impl Run {
    pub fn new(attack: &str, label: &str, binary: &str) -> Run {
        Run {
            attack: attack.into(),
            label: label.into(),
            binary: binary.into(),
            rows: Vec::new(),
        }
    }

    pub fn num(&mut self, name: &str, value: f64, unit: &'static str) {
        self.rows.push((name.into(), Measure::Num(value, unit)));
    }

    pub fn text(&mut self, name: &str, value: impl Into<String>) {
        self.rows.push((name.into(), Measure::Text(value.into())));
    }

    pub fn to_json(&self) -> Value {
        let rows: Vec<Value> = self
            .rows
            .iter()
            .map(|(name, m)| match m {
                Measure::Num(v, unit) if v.is_finite() => {
                    json!({"name": name, "value": v, "unit": unit})
                }
                Measure::Num(_, unit) => json!({"name": name, "value": null, "unit": unit}),
                Measure::Text(t) => json!({"name": name, "text": t}),
            })
            .collect();
        json!({"attack": self.attack, "label": self.label, "binary": self.binary, "rows": rows})
    }
}

/// A number as the tables show it: fewer decimals as it grows, `-` when there is none.
pub fn fmt_num(v: f64) -> String {
    if !v.is_finite() {
        "-".into()
    } else if v.abs() >= 100.0 || v == v.trunc() {
        with_thousands(v.round() as i64)
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn with_thousands(n: i64) -> String {
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 {
        format!("-{out}")
    } else {
        out
    }
}

fn cell(m: Option<&Measure>) -> String {
    match m {
        Some(Measure::Num(v, _)) => fmt_num(*v),
        Some(Measure::Text(t)) => t.clone(),
        None => "".into(),
    }
}

/// The run the ratios are of: `after` in `--compare` mode, else the agentrace run.
fn subject(runs: &[Run]) -> Option<usize> {
    runs.iter()
        .position(|r| r.label == "after")
        .or_else(|| runs.iter().position(|r| r.label == "agentrace"))
}

/// Prints one attack's table: a column per run, and the subject's ratio to every other run
/// (after/before, agentrace/peer) for the numbers.
pub fn print_table(title: &str, runs: &[Run]) {
    println!("\n### {title}\n");
    let mut header = String::from("| measure |");
    let mut rule = String::from("|---|");
    for r in runs {
        header.push_str(&format!(" {} |", r.label));
        rule.push_str("---:|");
    }
    let subject = subject(runs);
    let others: Vec<usize> = match subject {
        Some(s) => (0..runs.len()).filter(|&k| k != s).collect(),
        None => Vec::new(),
    };
    for &k in &others {
        let s = subject.unwrap_or_default();
        header.push_str(&format!(" {}/{} |", runs[s].label, runs[k].label));
        rule.push_str("---:|");
    }
    println!("{header}\n{rule}");
    let mut names: Vec<&String> = Vec::new();
    for r in runs {
        for (name, _) in &r.rows {
            if !names.contains(&name) {
                names.push(name);
            }
        }
    }
    for name in names {
        let measures: Vec<Option<&Measure>> = runs
            .iter()
            .map(|r| r.rows.iter().find(|(n, _)| n == name).map(|(_, m)| m))
            .collect();
        let unit = measures.iter().find_map(|m| match m {
            Some(Measure::Num(_, u)) if !u.is_empty() => Some(*u),
            _ => None,
        });
        let mut line = match unit {
            Some(u) => format!("| {name} ({u}) |"),
            None => format!("| {name} |"),
        };
        for m in &measures {
            line.push_str(&format!(" {} |", cell(*m)));
        }
        for &k in &others {
            let s = subject.unwrap_or_default();
            match (measures[k], measures[s]) {
                (Some(Measure::Num(a, _)), Some(Measure::Num(b, _))) => {
                    let ratio = if *a != 0.0 { b / a } else { f64::NAN };
                    line.push_str(&format!(" {} |", ratio_cell(ratio)));
                }
                _ => line.push_str(" |"),
            }
        }
        println!("{line}");
    }
}

fn ratio_cell(r: f64) -> String {
    if !r.is_finite() {
        "-".into()
    } else if r >= 10.0 {
        format!("{r:.0}")
    } else {
        format!("{r:.2}")
    }
}
