//! Coding traces: mini-swe-agent style conversations over a synthetic Python project.

mod commands;
mod project;
mod words;

use serde_json::value::RawValue;

use crate::dataset::synth::coding::commands::{command, tool_output, Cmd, CMD_WEIGHTS};
use crate::dataset::synth::coding::project::{coding_user_prompt, sentence, Project};
use crate::dataset::synth::rows::{call, round5, Row, ToolResult};
use crate::dataset::synth::BYTES_PER_TOKEN;
use crate::random::Rng;

/// The public sample's tool-row delay quantiles `(p, seconds)` (§19 of the reference notes):
/// the inverse CDF, log-linear between knots, reproduces its median, p90, p99 and tail.
pub(super) const CODING_DELAY_QUANTILES: &[(f64, f64)] = &[
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

pub(super) fn coding_delay(rng: &mut Rng) -> f64 {
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

pub(super) const REPOS: &[(&str, &str, &str)] = &[
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
pub(super) const REPO_WEIGHTS: &[(u32, usize)] = &[
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

pub(super) fn coding_id(rng: &mut Rng) -> String {
    let (owner, repo, _) = REPOS[*rng.weighted(REPO_WEIGHTS)];
    format!("{owner}__{repo}-{}", rng.int(1000, 27999))
}

pub(super) const CODING_SYSTEM: &str =
    "You are a careful software engineer. You solve programming tasks by \
running shell commands in a sandboxed repository and reading their output.";

pub(super) fn coding_tools() -> serde_json::Value {
    serde_json::json!([{"type": "function", "function": {"name": "bash",
        "description": "Run a bash command in the repository sandbox",
        "parameters": {"type": "object",
            "properties": {"command": {"type": "string", "description": "The bash command to run"}},
            "required": ["command"]}}}])
}

/// Context classes of coding traces: `(weight, min bytes, max bytes, tool-output median)`.
/// The regular class reproduces the sample (63–122 K bytes per conversation, tool-output
/// median 417 chars); medium and long add the tail that stresses KV capacity, the long class
/// reaching 100 K–200 K estimated tokens (400–800 K bytes).
pub(super) const CONTEXT_CLASSES: &[(u32, (usize, usize, f64))] = &[
    (55, (60_000, 130_000, 420.0)),
    (30, (140_000, 400_000, 1_000.0)),
    (15, (400_000, 790_000, 1_800.0)),
];

/// The longest prompt a coding trace may reach, in bytes (200 K estimated tokens).
pub(super) const CODING_MAX_PROMPT_BYTES: usize = 200_000 * BYTES_PER_TOKEN;

/// Wire bytes a message adds to every later prompt (content plus JSON framing).
pub(super) fn approx_wire(parts: &[&str]) -> usize {
    parts.iter().map(|p| p.len() + p.len() / 16).sum::<usize>() + 48
}

pub(super) fn coding_conversation(
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
