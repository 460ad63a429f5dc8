//! The per-conversation project, the source lines and prose about it, and the task prompt.

use std::fmt::Write as _;

use crate::dataset::synth::coding::words::{camel, func_name, snake, SUBPACKAGES, VERBS, WORDS};
use crate::dataset::synth::coding::REPOS;
use crate::random::Rng;

/// The per-conversation world: a repo, its files and symbols, so commands and outputs agree.
pub(super) struct Project {
    pub(super) package: &'static str,
    pub(super) files: Vec<String>,
    pub(super) symbols: Vec<String>,
    pub(super) classes: Vec<String>,
}

impl Project {
    pub(super) fn new(rng: &mut Rng, id: &str) -> Project {
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

    pub(super) fn file(&self, rng: &mut Rng) -> String {
        rng.pick(&self.files).clone()
    }

    pub(super) fn symbol(&self, rng: &mut Rng) -> String {
        rng.pick(&self.symbols).clone()
    }

    pub(super) fn class(&self, rng: &mut Rng) -> String {
        rng.pick(&self.classes).clone()
    }

    pub(super) fn test_file(&self, rng: &mut Rng) -> String {
        format!("tests/test_{}.py", snake(rng, 1))
    }
}

/// One line of Python-looking source.
pub(super) fn code_line(rng: &mut Rng, p: &Project, out: &mut String) {
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
pub(super) fn fill(out: &mut String, len: usize, mut line: impl FnMut(&mut String)) {
    let end = out.len() + len;
    while out.len() < end {
        line(out);
    }
}

/// English-looking prose about the task.
pub(super) fn sentence(rng: &mut Rng, p: &Project, out: &mut String) {
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
pub(super) fn coding_user_prompt(rng: &mut Rng, p: &Project) -> String {
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
pub(super) const CODING_INSTRUCTIONS: &str = "<instructions>
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
