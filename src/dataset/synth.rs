//! The synthetic standard set: 490 agentic coding + 500 agentic workflow trajectories,
//! deterministic for a seed.
//!
//! Coding traces follow the public sample's shape and distributions (see `datasets/README.md`
//! for every distribution and its basis) with a longer context tail; workflow traces share one
//! long system prompt (an intent catalogue) and one tool set, so most request tokens are a
//! prefix shared across conversations. The generator uses its own small PRNG so the bytes
//! depend only on the seed and this file, never on a dependency's sampling algorithms.

use std::fmt::Write as _;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::value::RawValue;

/// Where the replayer looks for the standard set when no dataset is given.
pub const STANDARD_SET_PATH: &str = "datasets/mlperf-agentic-990.jsonl.zst";

/// The seed of the standard set.
pub const DEFAULT_SEED: u64 = 990;

/// The zstd level of the standard set: zstd's default, fast to write and about 7× smaller.
pub const ZSTD_LEVEL: i32 = 3;

/// Bytes per estimated token: the estimate used throughout (`bytes / 4`).
pub const BYTES_PER_TOKEN: usize = 4;

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

// ---------------------------------------------------------------------------------------
// Rows

/// One flat dataset row, keys in the order the public sample writes them.
#[derive(Serialize, Default)]
struct Row<'a> {
    conversation_id: &'a str,
    turn: u32,
    role: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    system: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tools: Option<&'a RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<&'a [ToolCall]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_results: Option<&'a [ToolResult]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    delay_seconds: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    intent_codes: Option<&'a [String]>,
}

#[derive(Serialize)]
struct ToolCall {
    id: String,
    #[serde(rename = "type")]
    kind: &'static str,
    function: FunctionCall,
}

#[derive(Serialize)]
struct FunctionCall {
    name: String,
    arguments: String,
}

#[derive(Serialize)]
struct ToolResult {
    tool_call_id: String,
    content: String,
}

fn call(id: String, name: &str, arguments: String) -> ToolCall {
    ToolCall {
        id,
        kind: "function",
        function: FunctionCall {
            name: name.to_string(),
            arguments,
        },
    }
}

/// Delays rounded to 5 decimals, as the sample stores them.
fn round5(x: f64) -> f64 {
    (x * 1e5).round() / 1e5
}

// ---------------------------------------------------------------------------------------
// Randomness: SplitMix64, fixed here so the output never changes with a dependency.

struct Rng(u64);

impl Rng {
    fn for_item(seed: u64, domain: u64, index: u64) -> Rng {
        let mut r = Rng(seed ^ domain.wrapping_mul(0xA076_1D64_78BD_642F));
        let mixed = r.next_u64() ^ index.wrapping_mul(0xE703_7ED1_A0B4_28DB);
        Rng(mixed)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform integer in `lo..=hi`.
    fn int(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next_u64() % (hi - lo + 1) as u64) as usize
    }

    fn chance(&mut self, p: f64) -> bool {
        self.f64() < p
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.int(0, items.len() - 1)]
    }

    /// Picks by weight from `(weight, item)` pairs.
    fn weighted<'a, T>(&mut self, items: &'a [(u32, T)]) -> &'a T {
        let total: u32 = items.iter().map(|(w, _)| w).sum();
        let mut x = (self.next_u64() % total as u64) as u32;
        for (w, item) in items {
            if x < *w {
                return item;
            }
            x -= w;
        }
        &items[items.len() - 1].1
    }

    /// Standard normal (Box–Muller).
    fn normal(&mut self) -> f64 {
        let u1 = self.f64().max(1e-12);
        let u2 = self.f64();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    /// Log-normal with the given median and log-space sigma.
    fn lognormal(&mut self, median: f64, sigma: f64) -> f64 {
        median * (sigma * self.normal()).exp()
    }

    /// Log-uniform in `[lo, hi]`.
    fn log_uniform(&mut self, lo: f64, hi: f64) -> f64 {
        (lo.ln() + self.f64() * (hi.ln() - lo.ln())).exp()
    }

    fn hex(&mut self, n: usize) -> String {
        let mut s = String::with_capacity(n);
        while s.len() < n {
            let _ = write!(s, "{:016x}", self.next_u64());
        }
        s.truncate(n);
        s
    }
}

/// The public sample's tool-row delay quantiles `(p, seconds)` (§19 of the reference notes):
/// the inverse CDF, log-linear between knots, reproduces its median, p90, p99 and tail.
const CODING_DELAY_QUANTILES: &[(f64, f64)] = &[
    (0.0, 0.038),
    (0.10, 0.049),
    (0.25, 0.054),
    (0.50, 0.063),
    (0.75, 0.206),
    (0.90, 0.479),
    (0.95, 1.05),
    (0.99, 4.13),
    (0.994, 10.0),
    (0.997, 60.0),
    (1.0, 120.1),
];

fn coding_delay(rng: &mut Rng) -> f64 {
    let p = rng.f64();
    let i = CODING_DELAY_QUANTILES
        .windows(2)
        .position(|w| p < w[1].0)
        .unwrap_or(CODING_DELAY_QUANTILES.len() - 2);
    let (p0, v0) = CODING_DELAY_QUANTILES[i];
    let (p1, v1) = CODING_DELAY_QUANTILES[i + 1];
    let t = (p - p0) / (p1 - p0);
    round5((v0.ln() + t * (v1.ln() - v0.ln())).exp())
}

// ---------------------------------------------------------------------------------------
// Coding traces

const REPOS: &[(&str, &str, &str)] = &[
    ("django", "django", "django"),
    ("astropy", "astropy", "astropy"),
    ("matplotlib", "matplotlib", "lib/matplotlib"),
    ("psf", "requests", "requests"),
    ("pydata", "xarray", "xarray"),
    ("pytest-dev", "pytest", "src/_pytest"),
    ("scikit-learn", "scikit-learn", "sklearn"),
    ("sphinx-doc", "sphinx", "sphinx"),
    ("sympy", "sympy", "sympy"),
    ("pallets", "flask", "src/flask"),
    ("pylint-dev", "pylint", "pylint"),
    ("mwaskom", "seaborn", "seaborn"),
];

/// Repo weights: django-heavy, as SWE-bench is.
const REPO_WEIGHTS: &[(u32, usize)] = &[
    (18, 0),
    (8, 1),
    (9, 2),
    (5, 3),
    (7, 4),
    (7, 5),
    (10, 6),
    (8, 7),
    (14, 8),
    (3, 9),
    (5, 10),
    (4, 11),
];

fn coding_id(rng: &mut Rng) -> String {
    let (owner, repo, _) = REPOS[*rng.weighted(REPO_WEIGHTS)];
    format!("{owner}__{repo}-{}", rng.int(1000, 27999))
}

const CODING_SYSTEM: &str = "You are a careful software engineer. You solve programming tasks by \
running shell commands in a sandboxed repository and reading their output.";

fn coding_tools() -> serde_json::Value {
    serde_json::json!([{"type": "function", "function": {"name": "bash",
        "description": "Run a bash command in the repository sandbox",
        "parameters": {"type": "object",
            "properties": {"command": {"type": "string", "description": "The bash command to run"}},
            "required": ["command"]}}}])
}

const WORDS: &[&str] = &[
    "value",
    "field",
    "model",
    "query",
    "result",
    "index",
    "node",
    "path",
    "config",
    "option",
    "handler",
    "request",
    "response",
    "session",
    "cache",
    "token",
    "parser",
    "buffer",
    "stream",
    "record",
    "entry",
    "column",
    "array",
    "frame",
    "axis",
    "label",
    "name",
    "key",
    "item",
    "count",
    "offset",
    "limit",
    "order",
    "group",
    "filter",
    "mask",
    "shape",
    "dtype",
    "unit",
    "scale",
    "format",
    "style",
    "level",
    "state",
    "error",
    "message",
    "context",
    "target",
    "source",
    "default",
    "object",
    "instance",
    "method",
    "attr",
    "kwargs",
    "args",
    "data",
    "table",
    "schema",
    "widget",
    "form",
    "view",
    "router",
    "backend",
    "engine",
    "writer",
    "reader",
    "loader",
    "builder",
    "visitor",
    "printer",
    "expr",
    "symbol",
    "matrix",
    "vector",
    "point",
    "line",
    "figure",
    "legend",
    "color",
    "marker",
    "tick",
    "grid",
    "estimator",
    "params",
    "score",
    "sample",
    "weight",
    "feature",
    "transform",
    "pipeline",
    "fixture",
    "plugin",
    "hook",
    "report",
    "collector",
    "module",
    "package",
    "directive",
    "domain",
    "role",
];

const VERBS: &[&str] = &[
    "get",
    "set",
    "build",
    "parse",
    "check",
    "validate",
    "resolve",
    "render",
    "apply",
    "update",
    "compute",
    "load",
    "save",
    "format",
    "convert",
    "normalize",
    "merge",
    "split",
    "find",
    "register",
    "prepare",
    "handle",
    "process",
    "collect",
    "iter",
    "make",
    "create",
    "clean",
];

const SUBPACKAGES: &[&str] = &[
    "core",
    "utils",
    "models",
    "fields",
    "forms",
    "admin",
    "checks",
    "io",
    "backends",
    "parsers",
    "printing",
    "contrib",
    "base",
    "internals",
    "plotting",
    "transforms",
    "metrics",
    "compat",
    "config",
    "writers",
    "readers",
    "nodes",
    "testing",
    "ext",
    "domains",
    "api",
];

fn snake(rng: &mut Rng, parts: usize) -> String {
    let mut s = String::new();
    for i in 0..parts {
        if i > 0 {
            s.push('_');
        }
        s.push_str(rng.pick::<&str>(WORDS));
    }
    s
}

fn camel(rng: &mut Rng) -> String {
    let mut s = String::new();
    for _ in 0..rng.int(1, 3) {
        let w = rng.pick(WORDS);
        let mut chars = w.chars();
        if let Some(c) = chars.next() {
            s.push(c.to_ascii_uppercase());
            s.push_str(chars.as_str());
        }
    }
    s
}

fn func_name(rng: &mut Rng) -> String {
    let verb = *rng.pick(VERBS);
    let parts = rng.int(1, 2);
    format!("{verb}_{}", snake(rng, parts))
}

/// The per-conversation world: a repo, its files and symbols, so commands and outputs agree.
struct Project {
    package: &'static str,
    files: Vec<String>,
    symbols: Vec<String>,
    classes: Vec<String>,
}

impl Project {
    fn new(rng: &mut Rng, id: &str) -> Project {
        let package = REPOS
            .iter()
            .find(|(o, r, _)| id.starts_with(&format!("{o}__{r}-")))
            .map_or("pkg", |(_, _, p)| p);
        let files = (0..rng.int(6, 14))
            .map(|_| {
                let sub = *rng.pick(SUBPACKAGES);
                let parts = rng.int(1, 2);
                format!("{package}/{sub}/{}.py", snake(rng, parts))
            })
            .collect();
        let symbols = (0..rng.int(6, 12)).map(|_| func_name(rng)).collect();
        let classes = (0..rng.int(3, 6)).map(|_| camel(rng)).collect();
        Project {
            package,
            files,
            symbols,
            classes,
        }
    }

    fn file(&self, rng: &mut Rng) -> String {
        rng.pick(&self.files).clone()
    }

    fn symbol(&self, rng: &mut Rng) -> String {
        rng.pick(&self.symbols).clone()
    }

    fn class(&self, rng: &mut Rng) -> String {
        rng.pick(&self.classes).clone()
    }

    fn test_file(&self, rng: &mut Rng) -> String {
        format!("tests/test_{}.py", snake(rng, 1))
    }
}

/// One line of Python-looking source.
fn code_line(rng: &mut Rng, p: &Project, out: &mut String) {
    let indent = "    ".repeat(rng.int(0, 3));
    out.push_str(&indent);
    match rng.int(0, 11) {
        0 => {
            let _ = write!(
                out,
                "def {}(self, {}, {}=None):",
                p.symbol(rng),
                snake(rng, 1),
                snake(rng, 1)
            );
        }
        1 => {
            let _ = write!(out, "class {}({}):", p.class(rng), camel(rng));
        }
        2 => {
            let _ = write!(out, "return self.{}({})", p.symbol(rng), snake(rng, 1));
        }
        3 => {
            let _ = write!(out, "if {} is None:", snake(rng, 2));
        }
        4 => {
            let _ = write!(
                out,
                "{} = {}.{}({}, {})",
                snake(rng, 1),
                snake(rng, 1),
                p.symbol(rng),
                snake(rng, 1),
                rng.int(0, 64)
            );
        }
        5 => {
            let _ = write!(
                out,
                "raise {}Error(\"{} must be a {}, got %r\" % {})",
                camel(rng),
                snake(rng, 1),
                rng.pick(WORDS),
                snake(rng, 1)
            );
        }
        6 => {
            let _ = write!(out, "for {} in self.{}:", rng.pick(WORDS), snake(rng, 1));
        }
        7 => {
            let _ = write!(
                out,
                "\"\"\"{} the {} of the {}.\"\"\"",
                rng.pick(VERBS),
                rng.pick(WORDS),
                rng.pick(WORDS)
            );
        }
        8 => {
            let _ = write!(
                out,
                "from {}.{} import {}",
                p.package.replace('/', "."),
                rng.pick(SUBPACKAGES),
                p.class(rng)
            );
        }
        9 => {
            let _ = write!(
                out,
                "# {} {} before {} the {}",
                rng.pick(VERBS),
                rng.pick(WORDS),
                rng.pick(VERBS),
                rng.pick(WORDS)
            );
        }
        10 => {
            let _ = write!(
                out,
                "self.{} = {}.get(\"{}\", {})",
                snake(rng, 1),
                snake(rng, 1),
                rng.pick(WORDS),
                rng.int(0, 9)
            );
        }
        _ => {
            let _ = write!(
                out,
                "{}.append(({}, {}))",
                snake(rng, 1),
                snake(rng, 1),
                snake(rng, 1)
            );
        }
    }
    out.push('\n');
}

/// Appends lines made by `line` until `out` grows by at least `len` bytes.
fn fill(out: &mut String, len: usize, mut line: impl FnMut(&mut String)) {
    let end = out.len() + len;
    while out.len() < end {
        line(out);
    }
}

/// English-looking prose about the task.
fn sentence(rng: &mut Rng, p: &Project, out: &mut String) {
    let sym = p.symbol(rng);
    let file = p.file(rng);
    let cls = p.class(rng);
    let s = match rng.int(0, 11) {
        0 => format!("Let me look at how `{sym}` is defined in `{file}`."),
        1 => format!(
            "The issue seems to be in `{cls}.{sym}`, which does not handle the {} case.",
            rng.pick(WORDS)
        ),
        2 => format!(
            "Now I understand the problem: `{sym}` returns the {} instead of the {}.",
            rng.pick(WORDS),
            rng.pick(WORDS)
        ),
        3 => "Let me create a script to reproduce the issue first.".to_string(),
        4 => format!("I need to check where `{sym}` is called from."),
        5 => format!(
            "The fix should be minimal: pass the {} through to `{cls}`.",
            rng.pick(WORDS)
        ),
        6 => "Let me run the existing tests to make sure nothing else breaks.".to_string(),
        7 => format!(
            "Good, the change works. Let me also verify the edge case where the {} is empty.",
            rng.pick(WORDS)
        ),
        8 => format!("Looking at lines around the definition in `{file}`."),
        9 => format!(
            "This confirms the bug: the {} is lost when `{sym}` is called twice.",
            rng.pick(WORDS)
        ),
        10 => "The output is truncated; let me narrow the search.".to_string(),
        _ => format!(
            "I should update `{file}` so that `{cls}` keeps the original {}.",
            rng.pick(WORDS)
        ),
    };
    if !out.is_empty() && !out.ends_with('\n') {
        out.push(if rng.chance(0.2) { '\n' } else { ' ' });
        if out.ends_with('\n') {
            out.push('\n');
        }
    }
    out.push_str(&s);
}

/// The mini-swe-agent style task prompt: a PR description, then the fixed instructions.
fn coding_user_prompt(rng: &mut Rng, p: &Project) -> String {
    let mut s = String::with_capacity(16 * 1024);
    s.push_str("<pr_description>\nConsider the following PR description:\n");
    let _ = writeln!(
        s,
        "{}.{} {} the {} when {} is {}",
        p.class(rng),
        p.symbol(rng),
        rng.pick(&["drops", "ignores", "misreports", "duplicates", "loses"]),
        rng.pick(WORDS),
        rng.pick(WORDS),
        rng.pick(&[
            "empty",
            "None",
            "a subclass",
            "nested",
            "unicode",
            "negative"
        ])
    );
    s.push_str("Description\n\t\n");
    // Issue bodies: log-normal around 2 K chars, so with the instructions the prompt
    // matches the sample (4.7–14.7 K chars, median 6 K).
    let body = (rng.lognormal(2_000.0, 0.6) as usize).clamp(800, 10_000);
    let start = s.len();
    while s.len() - start < body {
        if rng.chance(0.25) {
            s.push_str("\n```python\n");
            let mut block = String::new();
            fill(&mut block, rng.int(120, 600), |o| code_line(rng, p, o));
            s.push_str(&block);
            s.push_str("```\n");
        } else {
            let mut para = String::new();
            for _ in 0..rng.int(2, 5) {
                sentence(rng, p, &mut para);
            }
            s.push_str(&para);
            s.push('\n');
        }
    }
    s.push_str("\n</pr_description>\n\n");
    s.push_str(CODING_INSTRUCTIONS);
    s
}

/// The fixed instructions that follow every PR description (our own wording of the
/// mini-swe-agent template's structure, about the sample's 4.5 K chars).
const CODING_INSTRUCTIONS: &str = "<instructions>
# Task Instructions

## Overview

You are a software engineer working in a terminal. Change the non-test source files in the
current directory so that the behaviour described in the PR description is fixed, in a way
that is general and consistent with the rest of the codebase.
<IMPORTANT>Think first, then issue AT LEAST ONE command, read its result, and continue.</IMPORTANT>

For each response:

1. Explain your reasoning in a THOUGHT section: what you know and what you will do next
2. Issue one or more bash tool calls

## Boundaries

- CHANGE: regular source files under /testbed (the working directory of every command)
- DO NOT CHANGE: tests, or configuration such as pyproject.toml and setup.cfg

## Suggested workflow

1. Find and read the code that is relevant to the PR description
2. Write a small script that reproduces the problem
3. Edit the source to fix it
4. Run the script again to confirm the fix
5. Think about edge cases and check them too

## How commands run

1. You issue at least one command
2. The environment runs each command in a fresh subshell
3. You read the output
4. You decide on the next command(s)

Every response must contain:

1. **Reasoning** that explains the step
2. At least one tool call with a command

**REQUIREMENTS:**

- Include your reasoning with every response.
- Include AT LEAST ONE bash tool call. Several calls in one response are fine when the
  commands are independent (for example, searching several files at once).
- Directory and environment variable changes do not persist between commands. Prefix a
  command with `cd /path && ...` or write a script when you need a specific directory.
- Avoid interactive tools: no vi, nano or less. Page through long files with `sed -n`,
  `head` and `tail`, and edit with `sed -i` or a heredoc.

## Useful command patterns

### Create a file
```bash
cat <<'EOF' > newfile.py
import numpy as np
print(np.arange(3))
EOF
```

### Edit a file in place
```bash
# replace every occurrence
sed -i 's/old_string/new_string/g' filename.py

# replace only the first occurrence
sed -i '0,/old_string/s//new_string/' filename.py

# replace on one line
sed -i '42s/old_string/new_string/' filename.py

# replace a range of lines
sed -i '10,20s/old_string/new_string/g' filename.py
```

### Look at a file
```bash
# with line numbers
nl -ba filename.py | sed -n '10,20p'
```

### Other commands
Any non-interactive command works: python, pip, git, grep, find and so on. Install what
you need with pip when it is missing.

## Submitting

When the work is done you MUST submit it as a git patch, in this order and with separate
commands:

Step 1: write the patch
Run `git diff -- path/to/changed_file1 path/to/changed_file2 > patch.txt` naming only the
source files you changed. Do NOT commit.

<IMPORTANT>
The patch must contain only the source files you changed to fix the issue. Leave out:

- test and reproduction scripts
- helper scripts or tools you wrote
- installation, build, packaging or configuration files, unless the issue is about them
- binary or compiled files
</IMPORTANT>

Step 2: check the patch
Read patch.txt and make sure it holds only the intended changes with `--- a/` and `+++ b/`
headers.

Step 3: submit (use EXACTLY this command)

```bash
echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat patch.txt
```

A command that exits with a non-zero status does not submit.

<CRITICAL>
- Writing or reading the patch and submitting it MUST be separate commands (never joined with &&).
- If you change patch.txt after checking it, check it again before you submit.
- After submitting you cannot run any more commands for this task.
</CRITICAL>
</instructions>";

/// What a command does, which decides the shape of its output.
#[derive(Clone, Copy)]
enum Cmd {
    SedView,
    SedEdit,
    Grep,
    CdRun,
    Cat,
    Heredoc,
    Python,
    PythonInline,
    Pip,
    Git,
    Find,
    Echo,
    Ls,
    PythonPath,
    Rm,
    Head,
    Which,
}

/// First-token mix of the sample's commands (counts from the public sample: sed 207 —
/// about half views, half edits —, grep 156, cd 155, cat 110, python 162, pip 53, git 48,
/// PYTHONPATH= 30, find 30, echo 21, ls 18, rm 8, head 7, which 4).
const CMD_WEIGHTS: &[(u32, Cmd)] = &[
    (110, Cmd::SedView),
    (97, Cmd::SedEdit),
    (156, Cmd::Grep),
    (155, Cmd::CdRun),
    (80, Cmd::Cat),
    (30, Cmd::Heredoc),
    (95, Cmd::Python),
    (67, Cmd::PythonInline),
    (53, Cmd::Pip),
    (48, Cmd::Git),
    (30, Cmd::Find),
    (21, Cmd::Echo),
    (18, Cmd::Ls),
    (30, Cmd::PythonPath),
    (8, Cmd::Rm),
    (7, Cmd::Head),
    (4, Cmd::Which),
];

fn pipe_tail(rng: &mut Rng) -> String {
    match rng.int(0, 5) {
        0 => format!(" | head -{}", rng.pick(&[10, 20, 30, 50])),
        1 => format!(" | tail -{}", rng.pick(&[10, 20, 30, 50])),
        _ => String::new(),
    }
}

fn command(rng: &mut Rng, p: &Project, kind: Cmd) -> String {
    let file = p.file(rng);
    let sym = p.symbol(rng);
    match kind {
        Cmd::SedView => {
            let a = rng.int(1, 900);
            format!("sed -n '{a},{}p' {file}", a + rng.int(20, 120))
        }
        Cmd::SedEdit => format!(
            "sed -i 's/{sym}({})/{sym}({}, {})/' {file}",
            rng.pick(WORDS),
            rng.pick(WORDS),
            rng.pick(WORDS)
        ),
        Cmd::Grep => match rng.int(0, 2) {
            0 => format!("grep -rn \"{sym}\" {}/{}", p.package, pipe_tail(rng)),
            1 => format!("grep -n \"def {sym}\\|class {}\" {file}", p.class(rng)),
            _ => format!(
                "grep -rn \"{}\" --include=\"*.py\" .{}",
                p.class(rng),
                pipe_tail(rng)
            ),
        },
        Cmd::CdRun => match rng.int(0, 3) {
            0 => "cd /testbed && python reproduce.py".to_string(),
            1 => format!(
                "cd /testbed && python -m pytest {} -x -q{}",
                p.test_file(rng),
                pipe_tail(rng)
            ),
            2 => "cd /testbed && git diff".to_string(),
            _ => format!("cd /testbed && grep -rn \"{sym}\" {}", p.package),
        },
        Cmd::Cat => format!("cat {file}{}", pipe_tail(rng)),
        Cmd::Heredoc => {
            let mut body = String::new();
            fill(&mut body, rng.int(150, 900), |o| code_line(rng, p, o));
            format!("cat <<'EOF' > reproduce.py\n{body}EOF")
        }
        Cmd::Python => format!(
            "python {}",
            rng.pick(&["reproduce.py", "test_fix.py", "check.py"])
        ),
        Cmd::PythonInline => {
            let mut body = String::new();
            fill(&mut body, rng.int(60, 500), |o| code_line(rng, p, o));
            format!("python3 -c \"\n{}\"", body.replace('"', "'"))
        }
        Cmd::Pip => match rng.int(0, 2) {
            0 => "cd /testbed && pip install -e . -q".to_string(),
            1 => format!("pip show {}", p.package.rsplit('/').next().unwrap_or("pkg")),
            _ => format!(
                "pip install {} -q",
                rng.pick(&["pytest", "numpy", "scipy", "docutils"])
            ),
        },
        Cmd::Git => match rng.int(0, 2) {
            0 => "git diff".to_string(),
            1 => "git status".to_string(),
            _ => format!("git log --oneline -5 -- {file}"),
        },
        Cmd::Find => format!(
            "find . -name \"*.py\" | xargs grep -l \"{sym}\"{}",
            pipe_tail(rng)
        ),
        Cmd::Echo => format!("echo \"{sym} = None\" >> {file}"),
        Cmd::Ls => format!("ls -la {}", file.rsplit_once('/').map_or(".", |(d, _)| d)),
        Cmd::PythonPath => format!("PYTHONPATH=$(pwd) python -m pytest {} -q", p.test_file(rng)),
        Cmd::Rm => "rm -f reproduce.py test_fix.py".to_string(),
        Cmd::Head => format!("head -{} {file}", rng.pick(&[40, 60, 100])),
        Cmd::Which => "which python".to_string(),
    }
}

/// The tool output for a command: `<returncode>`, then `<output>` shaped like the command's
/// result, about `len` bytes long.
fn tool_output(rng: &mut Rng, p: &Project, kind: Cmd, len: usize) -> String {
    // The sample's return codes: 86 % 0, 12 % 1, the rest 2 or 4.
    let rc = *rng.weighted(&[(860u32, 0u32), (122, 1), (12, 2), (5, 4)]);
    let mut s = String::with_capacity(len + 64);
    let _ = write!(s, "<returncode>{rc}</returncode>\n<output>\n");
    let start = s.len();
    match kind {
        Cmd::SedEdit | Cmd::Echo | Cmd::Rm | Cmd::Heredoc => {}
        Cmd::Grep | Cmd::Find => fill(&mut s, len, |o| {
            let _ = write!(o, "./{}:{}:", p.file(rng), rng.int(1, 2400));
            code_line(rng, p, o);
        }),
        Cmd::Ls => fill(&mut s, len.min(2000), |o| {
            let _ = writeln!(
                o,
                "-rw-r--r-- 1 root root {:>6} Jan {:>2} 12:{:02} {}.py",
                rng.int(200, 90000),
                rng.int(1, 28),
                rng.int(0, 59),
                snake(rng, 1)
            );
        }),
        Cmd::Pip | Cmd::Which => {
            let _ = writeln!(
                s,
                "Successfully installed {}-{}.{}.{}",
                p.package.rsplit('/').next().unwrap_or("pkg"),
                rng.int(0, 5),
                rng.int(0, 20),
                rng.int(0, 9)
            );
        }
        Cmd::Git => fill(&mut s, len, |o| {
            if rng.chance(0.1) {
                let f = p.file(rng);
                let _ = writeln!(o, "diff --git a/{f} b/{f}\n--- a/{f}\n+++ b/{f}");
                let _ = writeln!(o, "@@ -{0},7 +{0},8 @@", rng.int(1, 900));
            }
            o.push(*rng.pick(&[' ', ' ', ' ', '+', '-']));
            code_line(rng, p, o);
        }),
        Cmd::CdRun | Cmd::Python | Cmd::PythonInline | Cmd::PythonPath if rc != 0 => {
            s.push_str("Traceback (most recent call last):\n");
            fill(&mut s, len, |o| {
                let _ = writeln!(
                    o,
                    "  File \"/testbed/{}\", line {}, in {}",
                    p.file(rng),
                    rng.int(1, 2400),
                    p.symbol(rng)
                );
                o.push_str("    ");
                code_line(rng, p, o);
            });
            let _ = writeln!(
                s,
                "{}Error: {} {} is not {}",
                camel(rng),
                rng.pick(WORDS),
                rng.pick(WORDS),
                rng.pick(WORDS)
            );
        }
        Cmd::CdRun | Cmd::Python | Cmd::PythonInline | Cmd::PythonPath => {
            fill(&mut s, len, |o| match rng.int(0, 3) {
                0 => {
                    let _ = writeln!(o, "{}: {:?}", rng.pick(WORDS), rng.int(0, 10_000));
                }
                1 => {
                    let _ = writeln!(o, "{}::test_{} PASSED", p.test_file(rng), snake(rng, 2));
                }
                _ => code_line(rng, p, o),
            })
        }
        Cmd::SedView | Cmd::Cat | Cmd::Head => fill(&mut s, len, |o| code_line(rng, p, o)),
    }
    // mini-swe-agent shortens very long outputs; so does this generator.
    if s.len() > start + len + 200 {
        let mut cut = start + len;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('\n');
    }
    s.push_str("</output>");
    s
}

/// Context classes of coding traces: `(weight, min bytes, max bytes, tool-output median)`.
/// The regular class reproduces the sample (63–122 K bytes per conversation, tool-output
/// median 417 chars); medium and long add the tail that stresses KV capacity, the long class
/// reaching 100 K–200 K estimated tokens (400–800 K bytes).
const CONTEXT_CLASSES: &[(u32, (usize, usize, f64))] = &[
    (55, (60_000, 130_000, 420.0)),
    (30, (140_000, 400_000, 1_000.0)),
    (15, (400_000, 790_000, 1_800.0)),
];

/// The longest prompt a coding trace may reach, in bytes (200 K estimated tokens).
const CODING_MAX_PROMPT_BYTES: usize = 200_000 * BYTES_PER_TOKEN;

/// Wire bytes a message adds to every later prompt (content plus JSON framing).
fn approx_wire(parts: &[&str]) -> usize {
    parts.iter().map(|p| p.len() + p.len() / 16).sum::<usize>() + 48
}

fn coding_conversation(
    rng: &mut Rng,
    id: &str,
    tools: &RawValue,
    mut emit: impl FnMut(&Row<'_>) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let p = Project::new(rng, id);
    let &(lo, hi, tool_median) = rng.weighted(CONTEXT_CLASSES);
    let target = rng.log_uniform(lo as f64, hi as f64) as usize;
    let user = coding_user_prompt(rng, &p);
    let mut context = approx_wire(&[CODING_SYSTEM, &user]) + tools.get().len();
    emit(&Row {
        conversation_id: id,
        turn: 1,
        role: "user",
        content: Some(&user),
        system: Some(CODING_SYSTEM),
        tools: Some(tools),
        ..Row::default()
    })?;
    let mut turn = 2;
    let mut call_no = 0;
    loop {
        let finishing = context >= target;
        // Reasoning: the sample's median 107 chars, p90 885, max 12.6 K.
        let reasoning_len = (rng.lognormal(107.0, 1.6) as usize).clamp(15, 12_000);
        let mut reasoning = String::new();
        while reasoning.len() < reasoning_len {
            sentence(rng, &p, &mut reasoning);
        }
        // 0.5 % of the sample's assistant turns run two commands in parallel.
        let n_calls = if !finishing && rng.chance(0.005) {
            2
        } else {
            1
        };
        let mut calls = Vec::with_capacity(n_calls);
        let mut kinds = Vec::with_capacity(n_calls);
        for _ in 0..n_calls {
            let (kind, cmd) = if finishing {
                (
                    Cmd::Echo,
                    "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat patch.txt".to_string(),
                )
            } else {
                let kind = *rng.weighted(CMD_WEIGHTS);
                (kind, command(rng, &p, kind))
            };
            let arguments = format!(
                "{{\"command\": {}}}",
                serde_json::to_string(&cmd).expect("a string encodes")
            );
            calls.push(call(format!("functions.bash:{call_no}"), "bash", arguments));
            kinds.push(kind);
            call_no += 1;
        }
        context += approx_wire(&[&reasoning])
            + calls
                .iter()
                .map(|c| c.function.arguments.len() + 90)
                .sum::<usize>();
        emit(&Row {
            conversation_id: id,
            turn,
            role: "assistant",
            reasoning_content: Some(&reasoning),
            tool_calls: Some(&calls),
            ..Row::default()
        })?;
        turn += 1;
        if finishing {
            return Ok(());
        }
        let mut results = Vec::with_capacity(n_calls);
        for (c, kind) in calls.iter().zip(kinds) {
            let room = CODING_MAX_PROMPT_BYTES.saturating_sub(context + 4_000);
            // Tool output: the sample's log-normal shape (sigma 1.25), capped at 10 K chars
            // like mini-swe-agent's truncation, scaled per context class.
            let len = (rng.lognormal(tool_median, 1.25) as usize).clamp(20, 10_000.min(room));
            let content = tool_output(rng, &p, kind, len);
            context += approx_wire(&[&content]);
            results.push(ToolResult {
                tool_call_id: c.id.clone(),
                content,
            });
        }
        emit(&Row {
            conversation_id: id,
            turn,
            role: "tool",
            tool_results: Some(&results),
            delay_seconds: Some(coding_delay(rng)),
            ..Row::default()
        })?;
        turn += 1;
    }
}

// ---------------------------------------------------------------------------------------
// Workflow traces

/// Intent catalogue size: codes I000..I119.
const INTENTS: usize = 120;

const INTENT_AREAS: &[&str] = &[
    "Pickup",
    "Delivery",
    "Tracking",
    "Billing",
    "Returns",
    "Account",
    "Damage",
    "Customs",
    "Address",
    "Scheduling",
    "Driver",
    "Warehouse",
];

const INTENT_ISSUES: &[&str] = &[
    "Delay",
    "Missed Window",
    "Wrong Status",
    "Charge Dispute",
    "Cancellation",
    "Change Request",
    "Lost Item",
    "Partial Shipment",
    "Proof Request",
    "Escalation",
];

/// The catalogue's names; I000, I057 and I058 carry the names the reference scorer's
/// comments give them.
fn intent_name(code: usize) -> String {
    match code {
        0 => "Greeting and Identification".to_string(),
        57 => "Pickup Delay".to_string(),
        58 => "Marked Picked Up But Not Collected".to_string(),
        c => format!(
            "{} {}",
            INTENT_AREAS[c % INTENT_AREAS.len()],
            INTENT_ISSUES[(c / INTENT_AREAS.len()) % INTENT_ISSUES.len()]
        ),
    }
}

/// A function tool: name, description, `(parameter, JSON type)` pairs.
type ToolSpec = (
    &'static str,
    &'static str,
    &'static [(&'static str, &'static str)],
);

const WORKFLOW_TOOLS: &[ToolSpec] = &[
    (
        "get_customer_profile",
        "Look up a customer by account id or email.",
        &[("account_id", "string"), ("email", "string")],
    ),
    (
        "lookup_order",
        "Fetch an order with its items, addresses and payment state.",
        &[("order_id", "string")],
    ),
    (
        "get_shipment_status",
        "Current status and carrier of a shipment.",
        &[("shipment_id", "string")],
    ),
    (
        "get_tracking_events",
        "Scan events of a shipment, newest first.",
        &[("shipment_id", "string"), ("limit", "integer")],
    ),
    (
        "get_pickup_booking",
        "The pickup booking of an order: window, driver, state.",
        &[("order_id", "string")],
    ),
    (
        "reschedule_pickup",
        "Book a new pickup window for an order.",
        &[
            ("order_id", "string"),
            ("window_start", "string"),
            ("window_end", "string"),
        ],
    ),
    (
        "check_driver_location",
        "Last known position and ETA of a driver.",
        &[("driver_id", "string")],
    ),
    (
        "update_delivery_address",
        "Change the delivery address of an undelivered shipment.",
        &[("shipment_id", "string"), ("address", "string")],
    ),
    (
        "issue_refund",
        "Refund all or part of an order.",
        &[
            ("order_id", "string"),
            ("amount", "number"),
            ("reason", "string"),
        ],
    ),
    (
        "create_support_ticket",
        "Open a ticket for a team that must act later.",
        &[
            ("order_id", "string"),
            ("category", "string"),
            ("summary", "string"),
        ],
    ),
    (
        "escalate_to_human",
        "Hand the conversation to a human agent.",
        &[("reason", "string"), ("priority", "string")],
    ),
    (
        "send_customer_notification",
        "Send an SMS or e-mail to the customer.",
        &[
            ("account_id", "string"),
            ("channel", "string"),
            ("message", "string"),
        ],
    ),
    (
        "search_knowledge_base",
        "Search internal policy articles.",
        &[("query", "string")],
    ),
];

fn workflow_tools() -> serde_json::Value {
    let tools: Vec<serde_json::Value> = WORKFLOW_TOOLS
        .iter()
        .map(|(name, description, params)| {
            let properties: serde_json::Map<String, serde_json::Value> = params
                .iter()
                .map(|(p, ty)| ((*p).to_string(), serde_json::json!({"type": ty})))
                .collect();
            let required: Vec<&str> = params.iter().take(1).map(|(p, _)| *p).collect();
            serde_json::json!({"type": "function", "function": {"name": name,
                "description": description,
                "parameters": {"type": "object", "properties": properties, "required": required}}})
        })
        .collect();
    serde_json::Value::Array(tools)
}

/// The shared system prompt: role, policies, and the intent catalogue with handling notes.
fn workflow_system_prompt() -> String {
    let mut rng = Rng(0x005E_ED0F_1A7E);
    let mut s = String::with_capacity(48 * 1024);
    s.push_str(
        "You are the customer-support agent of Parcelway, a regional parcel and freight carrier. \
You help senders and recipients with pickups, deliveries, tracking, billing, returns and \
account questions, using the tools you are given. Be accurate, brief and polite.\n\n\
# Rules\n\
1. Identify the customer before you disclose or change anything: an account id, or the \
e-mail plus the order id.\n\
2. Look facts up with the tools; never guess a status, a date or an amount.\n\
3. Every reply to the customer starts with one line `intent: IXXX`, the catalogue code that \
best describes the customer's latest request, followed by your message.\n\
4. Refunds above 200.00 EUR, legal threats and safety issues go to a human \
(escalate_to_human).\n\
5. Confirm any change (address, window, refund) back to the customer with its new value.\n\
6. Do not promise delivery times the tracking data does not support.\n\n\
# Intent catalogue\n\
Classify the customer's latest request with exactly one code. Handling notes say which \
tools to use and what to tell the customer.\n\n",
    );
    let handling = [
        "Check the booking with get_pickup_booking and the driver with check_driver_location.",
        "Read the tracking events and compare them with the promised window.",
        "Open the order with lookup_order and confirm the items and the amounts.",
        "Search the knowledge base for the policy before you answer.",
        "If the customer asks for money back, apply the refund policy and use issue_refund.",
        "When the carrier must act later, open a ticket with create_support_ticket.",
        "Offer a new window with reschedule_pickup and confirm it back to the customer.",
        "Verify the new address format before update_delivery_address.",
    ];
    let outcomes = [
        "Tell the customer the next concrete step and when it happens.",
        "Quote the scan time and location exactly as the tool returns them.",
        "Never blame the driver; state facts and the remedy.",
        "Send a notification with the ticket number when one is created.",
        "If data is missing or contradictory, escalate to a human agent.",
    ];
    for code in 0..INTENTS {
        let name = intent_name(code);
        let _ = write!(
            s,
            "I{code:03} — {name}: the customer's request is about {} ({}). ",
            name.to_lowercase(),
            match code {
                0 => "a greeting, or the customer gives their name, account or order so you can identify them".to_string(),
                57 => "the booked pickup window has passed and the parcel is still with the sender".to_string(),
                58 => "tracking says the parcel was picked up, but the sender still has it".to_string(),
                _ => format!(
                    "{} {} reported by the {}",
                    rng.pick(&["a", "an unexpected", "a repeated", "a disputed"]),
                    rng.pick(WORKFLOW_NOUNS),
                    rng.pick(&["sender", "recipient", "business account", "marketplace seller"])
                ),
            }
        );
        let _ = writeln!(s, "{} {}", rng.pick(&handling), rng.pick(&outcomes));
    }
    s.push_str(
        "\n# Style\nWrite plain sentences. Give order ids, dates and amounts exactly. When you \
call a tool, do not write to the customer in the same message. End every reply with a \
question only when you need information from the customer.\n",
    );
    s
}

const WORKFLOW_NOUNS: &[&str] = &[
    "status mismatch",
    "missing scan",
    "late driver",
    "double charge",
    "damaged box",
    "wrong address",
    "customs hold",
    "failed delivery attempt",
    "label error",
    "lost parcel",
    "duplicate pickup",
    "missing refund",
    "password reset",
    "invoice copy",
    "weight surcharge",
];

const FIRST_NAMES: &[&str] = &[
    "Dana", "Lee", "Amira", "Jonas", "Priya", "Marco", "Sofia", "Tomasz", "Keiko", "Olu", "Ines",
    "Mateo", "Hana", "Erik", "Zanele", "Ravi",
];

const LAST_NAMES: &[&str] = &[
    "Ortiz",
    "Nguyen",
    "Haddad",
    "Becker",
    "Rao",
    "Rossi",
    "Silva",
    "Nowak",
    "Sato",
    "Adeyemi",
    "Moreau",
    "Fernandez",
    "Kim",
    "Larsen",
    "Dlamini",
    "Iyer",
];

/// The tools a request of intent `code` typically needs.
fn tools_for(code: usize, rng: &mut Rng) -> Vec<usize> {
    let primary = match code {
        0 => 0,
        57 | 58 => 4,
        c => [1, 2, 3, 4, 7, 8, 9, 12][c % 8],
    };
    let mut tools = vec![primary];
    if code == 57 || code == 58 || rng.chance(0.4) {
        let second = match code {
            57 => 6,
            58 => 3,
            _ => *rng.pick(&[2, 3, 5, 6, 9, 10, 11, 12]),
        };
        if second != primary {
            tools.push(second);
        }
    }
    tools
}

fn tool_arguments(rng: &mut Rng, tool: usize, ctx: &WorkflowCtx) -> String {
    let (_, _, params) = WORKFLOW_TOOLS[tool];
    let mut args = serde_json::Map::new();
    for (i, (name, ty)) in params.iter().enumerate() {
        if i > 0 && rng.chance(0.5) {
            continue;
        }
        let v = match (*name, *ty) {
            ("account_id", _) => ctx.account.clone().into(),
            ("email", _) => ctx.email.clone().into(),
            ("order_id", _) => ctx.order.clone().into(),
            ("shipment_id", _) => ctx.shipment.clone().into(),
            ("driver_id", _) => format!("DRV-{}", rng.int(1000, 9999)).into(),
            ("limit", _) => serde_json::Value::from(rng.int(5, 20)),
            ("amount", _) => serde_json::Value::from((rng.int(500, 25_000) as f64) / 100.0),
            ("window_start", _) => {
                format!("2026-08-{:02}T{:02}:00:00", rng.int(1, 28), rng.int(8, 14)).into()
            }
            ("window_end", _) => {
                format!("2026-08-{:02}T{:02}:00:00", rng.int(1, 28), rng.int(15, 19)).into()
            }
            ("address", _) => format!(
                "{} {} Street, {}",
                rng.int(1, 200),
                rng.pick(LAST_NAMES),
                rng.pick(&["Lyon", "Leeds", "Porto", "Graz"])
            )
            .into(),
            ("priority", _) => (*rng.pick(&["normal", "high"])).into(),
            ("channel", _) => (*rng.pick(&["sms", "email"])).into(),
            (_, _) => ctx.topic.clone().into(),
        };
        args.insert((*name).to_string(), v);
    }
    serde_json::Value::Object(args).to_string()
}

fn tool_result(rng: &mut Rng, tool: usize, ctx: &WorkflowCtx) -> String {
    let (name, _, _) = WORKFLOW_TOOLS[tool];
    let mut v = serde_json::json!({"ok": true, "tool": name, "order_id": ctx.order});
    let obj = v.as_object_mut().expect("an object");
    let statuses = [
        "booked",
        "in_transit",
        "out_for_delivery",
        "delivered",
        "exception",
        "picked_up",
    ];
    match name {
        "get_customer_profile" => {
            obj.insert("account_id".into(), ctx.account.clone().into());
            obj.insert("name".into(), ctx.name.clone().into());
            obj.insert(
                "tier".into(),
                (*rng.pick(&["standard", "business", "premium"])).into(),
            );
            obj.insert("open_orders".into(), rng.int(0, 6).into());
        }
        "get_tracking_events" => {
            let events: Vec<serde_json::Value> = (0..rng.int(2, 9))
                .map(|i| {
                    serde_json::json!({"time": format!("2026-08-{:02}T{:02}:{:02}:00Z", 10 + i, rng.int(6, 21), rng.int(0, 59)),
                        "location": rng.pick(&["Lyon hub", "Leeds depot", "Porto sort center", "Graz van 14"]),
                        "status": rng.pick(&statuses)})
                })
                .collect();
            obj.insert("events".into(), events.into());
        }
        _ => {
            obj.insert("status".into(), (*rng.pick(&statuses)).into());
            obj.insert(
                "updated_at".into(),
                format!(
                    "2026-08-{:02}T{:02}:{:02}:00Z",
                    rng.int(1, 28),
                    rng.int(6, 21),
                    rng.int(0, 59)
                )
                .into(),
            );
            if rng.chance(0.5) {
                obj.insert(
                    "note".into(),
                    format!(
                        "{} reported at {}",
                        rng.pick(WORKFLOW_NOUNS),
                        rng.pick(&["pickup", "the hub", "delivery", "billing"])
                    )
                    .into(),
                );
            }
            if rng.chance(0.3) {
                obj.insert(
                    "amount_eur".into(),
                    ((rng.int(500, 30_000) as f64) / 100.0).into(),
                );
            }
        }
    }
    v.to_string()
}

struct WorkflowCtx {
    name: String,
    account: String,
    email: String,
    order: String,
    shipment: String,
    topic: String,
}

/// Think time before a user turn: log-normal, median 6 s, capped at 90 s (an assumption:
/// no public workflow trace gives it).
fn think_time(rng: &mut Rng) -> f64 {
    round5(rng.lognormal(6.0, 0.8).clamp(0.5, 90.0))
}

/// Tool latency before a tool turn: log-normal, median 0.25 s.
fn tool_latency(rng: &mut Rng) -> f64 {
    round5(rng.lognormal(0.25, 0.7).clamp(0.02, 10.0))
}

fn workflow_conversation(
    rng: &mut Rng,
    id: &str,
    system: &str,
    tools: &RawValue,
    mut emit: impl FnMut(&Row<'_>) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let first = rng.pick(FIRST_NAMES);
    let last = rng.pick(LAST_NAMES);
    let ctx = WorkflowCtx {
        name: format!("{first} {last}"),
        account: format!("ACC-{}", rng.int(100_000, 999_999)),
        email: format!(
            "{}.{}@example.com",
            first.to_lowercase(),
            last.to_lowercase()
        ),
        order: format!("ORD-{}", rng.int(10_000_000, 99_999_999)),
        shipment: format!("SHP-{}", rng.hex(10).to_uppercase()),
        topic: rng.pick(WORKFLOW_NOUNS).to_string(),
    };
    // The requests of this conversation: most open with identification (I000), then 1–5
    // problems; I057 → I058 is a common follow-up pair.
    let mut intents = Vec::new();
    if rng.chance(0.75) {
        intents.push(0);
    }
    let problems = rng.int(1, 5);
    while intents.iter().filter(|c| **c != 0).count() < problems {
        let code = if rng.chance(0.12) {
            57
        } else {
            rng.int(1, INTENTS - 1)
        };
        if !intents.contains(&code) {
            intents.push(code);
            if code == 57 && rng.chance(0.6) && !intents.contains(&58) {
                intents.push(58);
            }
        }
    }

    let mut turn = 1;
    let mut cumulative: Vec<String> = Vec::new();
    let mut call_no = 0;
    for (k, &code) in intents.iter().enumerate() {
        let message = customer_message(rng, code, &ctx, k == 0);
        emit(&Row {
            conversation_id: id,
            turn,
            role: "user",
            content: Some(&message),
            system: (turn == 1).then_some(system),
            tools: (turn == 1).then_some(tools),
            delay_seconds: (turn > 1).then(|| think_time(rng)),
            ..Row::default()
        })?;
        turn += 1;
        // Tool rounds before the reply: 0–2, each with 1–2 calls.
        let planned = tools_for(code, rng);
        let rounds = if code == 0 && rng.chance(0.5) {
            0
        } else {
            planned.len().min(rng.int(1, 2))
        };
        for round in 0..rounds {
            let parallel = round + 1 == rounds && planned.len() > rounds && rng.chance(0.5);
            let picked: Vec<usize> = if parallel {
                planned[round..].to_vec()
            } else {
                vec![planned[round]]
            };
            let calls: Vec<ToolCall> = picked
                .iter()
                .map(|&t| {
                    call_no += 1;
                    call(
                        format!("call_{}", rng.hex(24)),
                        WORKFLOW_TOOLS[t].0,
                        tool_arguments(rng, t, &ctx),
                    )
                })
                .collect();
            let reasoning = rng.chance(0.6).then(|| {
                format!(
                    "The customer asks about {}; I need {} first.",
                    intent_name(code).to_lowercase(),
                    picked
                        .iter()
                        .map(|&t| WORKFLOW_TOOLS[t].0)
                        .collect::<Vec<_>>()
                        .join(" and ")
                )
            });
            emit(&Row {
                conversation_id: id,
                turn,
                role: "assistant",
                reasoning_content: reasoning.as_deref(),
                tool_calls: Some(&calls),
                ..Row::default()
            })?;
            turn += 1;
            let results: Vec<ToolResult> = calls
                .iter()
                .zip(&picked)
                .map(|(c, &t)| ToolResult {
                    tool_call_id: c.id.clone(),
                    content: tool_result(rng, t, &ctx),
                })
                .collect();
            emit(&Row {
                conversation_id: id,
                turn,
                role: "tool",
                tool_results: Some(&results),
                delay_seconds: Some(tool_latency(rng)),
                ..Row::default()
            })?;
            turn += 1;
        }
        cumulative.push(format!("I{code:03}"));
        let reply = agent_reply(rng, code, &ctx);
        let reasoning = rng.chance(0.5).then(|| {
            format!(
                "This matches the catalogue entry {} for the latest request.",
                intent_name(code)
            )
        });
        emit(&Row {
            conversation_id: id,
            turn,
            role: "assistant",
            content: Some(&reply),
            reasoning_content: reasoning.as_deref(),
            intent_codes: Some(&cumulative),
            ..Row::default()
        })?;
        turn += 1;
    }
    Ok(())
}

fn customer_message(rng: &mut Rng, code: usize, ctx: &WorkflowCtx, first: bool) -> String {
    let mut s = String::new();
    if first {
        let _ = write!(
            s,
            "{} ",
            rng.pick(&["Hi,", "Hello,", "Good morning,", "Hey there,"])
        );
    }
    match code {
        0 => {
            let _ = write!(
                s,
                "this is {}, account {} ({}). I have a question about order {}.",
                ctx.name, ctx.account, ctx.email, ctx.order
            );
        }
        57 => {
            let _ = write!(
                s,
                "my pickup for order {} was booked for this morning between {} and {}, and nobody came. The parcel is still here.",
                ctx.order,
                rng.int(8, 10),
                rng.int(11, 13)
            );
        }
        58 => {
            s.push_str("Also, the tracking page now says the parcel was picked up, but it is sitting right here on my desk. How can it be picked up?");
        }
        c => {
            let _ = write!(
                s,
                "{} it's about {}: {} on order {}. {}",
                rng.pick(&[
                    "Another thing,",
                    "Next,",
                    "One more question:",
                    "Can you help,"
                ]),
                intent_name(c).to_lowercase(),
                rng.pick(WORKFLOW_NOUNS),
                ctx.order,
                rng.pick(&[
                    "What can you do about it?",
                    "This is the second time this happens.",
                    "I need this sorted today.",
                    "Please check and tell me what happened.",
                ])
            );
        }
    }
    s
}

fn agent_reply(rng: &mut Rng, code: usize, ctx: &WorkflowCtx) -> String {
    let mut s = format!("intent: I{code:03}\n");
    let body = match code {
        0 => format!("Thank you, {}. I found your account {}. How can I help with order {}?", ctx.name, ctx.account, ctx.order),
        57 => format!(
            "I'm sorry the driver did not come. The pickup for {} was still open in our system; I have booked a new window tomorrow between {}:00 and {}:00 and you will get an SMS when the driver is on the way.",
            ctx.order,
            rng.int(8, 11),
            rng.int(12, 16)
        ),
        58 => format!(
            "You are right, the scan was recorded by mistake. I have opened ticket TCK-{} so the status of {} is corrected, and the new pickup stays booked.",
            rng.int(100_000, 999_999),
            ctx.shipment
        ),
        c => format!(
            "I checked {} for {}. {} I have noted this on your account{}.",
            ctx.order,
            intent_name(c).to_lowercase(),
            rng.pick(&[
                "The records show the issue on our side.",
                "The latest scan is consistent with what you describe.",
                "Our policy covers this case.",
                "The carrier confirmed the details.",
            ]),
            rng.pick(&["", " and sent you a confirmation e-mail", " and opened a ticket for the hub team"])
        ),
    };
    s.push_str(&body);
    s
}
