//! Shell commands the agent runs and the tool output each returns.

use std::fmt::Write as _;

use crate::dataset::synth::coding::project::{code_line, fill, Project};
use crate::dataset::synth::coding::words::{camel, snake, WORDS};
use crate::random::Rng;

/// What a command does, which decides the shape of its output.
#[derive(Clone, Copy)]
pub(super) enum Cmd {
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
pub(super) const CMD_WEIGHTS: &[(u32, Cmd)] = &[
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

pub(super) fn pipe_tail(rng: &mut Rng) -> String {
    match rng.int(0, 5) {
        0 => format!(" | head -{}", rng.pick(&[10, 20, 30, 50])),
        1 => format!(" | tail -{}", rng.pick(&[10, 20, 30, 50])),
        _ => String::new(),
    }
}

pub(super) fn command(rng: &mut Rng, p: &Project, kind: Cmd) -> String {
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
pub(super) fn tool_output(rng: &mut Rng, p: &Project, kind: Cmd, len: usize) -> String {
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
