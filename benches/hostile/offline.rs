//! Attacks on the commands that read untrusted input without a proxy: the replayer against a
//! backend whose stream never ends, and the dataset validator on a file without a newline.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::json;
use tokio::time::Instant;

use crate::procfs::{self, Ended, Sampler};
use crate::report::Run;
use crate::Ctx;

/// Runs `command` until it ends or `limit` passes (then SIGKILL), sampling it meanwhile.
async fn run_bounded(mut command: Command, limit: Duration) -> (Ended, f64, bool) {
    let child = command
        .stdin(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{command:?}: {e}"));
    let pid = child.id();
    let sampler = Sampler::start(pid);
    let t0 = Instant::now();
    let mut waiter = tokio::task::spawn_blocking(move || procfs::wait_rusage(pid));
    let (ended, killed) = match tokio::time::timeout(limit, &mut waiter).await {
        Ok(ended) => (ended.unwrap(), false),
        Err(_) => {
            // Not yet reaped, so `pid` is still this child, even if it just exited.
            procfs::kill(pid, libc::SIGKILL);
            (waiter.await.unwrap(), true)
        }
    };
    let wall = t0.elapsed().as_secs_f64();
    let peaks = sampler.stop();
    drop(child);
    let ended = Ended {
        max_rss_kib: ended.max_rss_kib.max(peaks.rss_kib),
        ..ended
    };
    (ended, wall, killed)
}

/// The first two lines of a file, joined and cut to 200 characters.
fn first_lines(path: &Path) -> String {
    let text = std::fs::read(path).unwrap_or_default();
    let text = String::from_utf8_lossy(&text[..text.len().min(4096)]).into_owned();
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .take(2)
        .collect();
    lines.join(" / ").chars().take(200).collect()
}

/// The replayer, one turn, against a backend streaming SSE events without end.
pub async fn replay_endless_sse(ctx: &Ctx, bin: &Path, mut run: Run) -> Run {
    let dir = ctx.dir.path().join("replay");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let tools = json!([{"type": "function", "function": {"name": "bash",
        "description": "Execute a bash command",
        "parameters": {"type": "object",
            "properties": {"command": {"type": "string", "description": "The bash command to execute"}},
            "required": ["command"]}}}]);
    let rows = [
        json!({"conversation_id": "endless", "turn": 1, "role": "user",
               "content": "Fix the bug", "system": "You are a helpful assistant.", "tools": tools}),
        json!({"conversation_id": "endless", "turn": 2, "role": "assistant", "content": "Done."}),
    ];
    let dataset = dir.join("one.jsonl");
    let text: String = rows.iter().map(|r| format!("{r}\n")).collect();
    std::fs::write(&dataset, text).unwrap();
    let log = dir.join("replay.log");
    let limit = Duration::from_secs_f64(ctx.args.sse_secs);
    let mut command = Command::new(bin);
    command
        .arg("replay")
        .arg("--target")
        .arg(format!("http://{}", ctx.backends.sse))
        .arg("--dataset")
        .arg(&dataset)
        .arg("--out")
        .arg(dir.join("out"))
        .args([
            "--no-progress",
            "--concurrency",
            "1",
            "--num-trajectories",
            "1",
        ])
        .args(["--delays", "false", "--turn-timeout"])
        .arg(format!("{}", ctx.args.sse_secs * 10.0 + 60.0))
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(std::fs::File::create(dir.join("replay.err")).unwrap());
    let load_start = procfs::loadavg();
    let before = ctx.backends.counters().await;
    let (ended, wall, killed) = run_bounded(command, limit).await;
    let after = ctx.backends.counters().await;
    run.text(
        "replayer ended",
        if killed {
            format!("killed after {:.0} s", limit.as_secs_f64())
        } else {
            format!("{} after {wall:.1} s", ended.how)
        },
    );
    if !killed {
        run.text("replayer said", first_lines(&dir.join("replay.err")));
    }
    run.num(
        "SSE requests the backend got",
        (after.sse_requests - before.sse_requests) as f64,
        "",
    );
    let streamed_mib = (after.sse_bytes - before.sse_bytes) as f64 / (1u64 << 20) as f64;
    let peak_mib = ended.max_rss_kib as f64 / 1024.0;
    run.num("SSE streamed to the replayer", streamed_mib, "MiB");
    run.num("replayer peak RSS", peak_mib, "MiB");
    run.num(
        "replayer peak RSS per MiB streamed",
        peak_mib / streamed_mib.max(1.0),
        "MiB",
    );
    run.num("replayer CPU", ended.cpu_secs, "s");
    run.text(
        "load 1/5/15 min, start -> end",
        format!("{load_start} -> {}", procfs::loadavg()),
    );
    run
}

/// `dataset validate` on a file of one line with no end.
pub async fn validate_long_line(ctx: &Ctx, bin: &Path, mut run: Run) -> Run {
    let path = ctx.dir.path().join("long-line.jsonl");
    let mib = ctx.args.long_line_mib;
    if !path.exists() {
        let mut file = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
        file.write_all(br#"{"conversation_id":""#).unwrap();
        let block = vec![b'a'; 1 << 20];
        for _ in 0..mib {
            file.write_all(&block).unwrap();
        }
        file.flush().unwrap();
    }
    let out = ctx.dir.path().join("validate.out");
    let out_file = std::fs::File::create(&out).unwrap();
    let mut command = Command::new(bin);
    command
        .args(["dataset", "validate"])
        .arg(&path)
        .stdout(out_file.try_clone().unwrap())
        .stderr(out_file);
    let load_start = procfs::loadavg();
    let limit = Duration::from_secs_f64(ctx.args.validate_timeout_secs);
    let (ended, wall, killed) = run_bounded(command, limit).await;
    run.num(
        "file size",
        std::fs::metadata(&path).unwrap().len() as f64 / (1u64 << 20) as f64,
        "MiB",
    );
    run.text(
        "validator ended",
        if killed {
            format!("killed after {:.0} s", limit.as_secs_f64())
        } else {
            ended.how.clone()
        },
    );
    run.text("validator said", first_lines(&out));
    run.num("validator time", wall, "s");
    run.num(
        "validator peak RSS",
        ended.max_rss_kib as f64 / 1024.0,
        "MiB",
    );
    run.num("validator CPU", ended.cpu_secs, "s");
    run.text(
        "load 1/5/15 min, start -> end",
        format!("{load_start} -> {}", procfs::loadavg()),
    );
    run
}
