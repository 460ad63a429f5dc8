//! Load benchmark: wall time and peak RSS of load + validate, and of building every request
//! body, for the standard 990 set (or any dataset given as the first argument).
//!
//! `cargo bench --bench dataset_load [-- PATH] [--runs N]`. The standard set is generated at
//! `datasets/mlperf-agentic-990.jsonl.zst` when missing. Bodies are built the way a replay
//! sends them: Qwen preset, streaming with usage, salted as repeat 1, one reused buffer.

use std::io::Read;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use agentrace::dataset::synth::{ensure_standard_set, STANDARD_SET_PATH};
use agentrace::dataset::{load, LoadOptions, ModelParams, RequestBuilder, Salt};

fn main() -> anyhow::Result<()> {
    let mut path: Option<PathBuf> = None;
    let mut runs = 3usize;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--runs" => runs = args.next().and_then(|v| v.parse().ok()).unwrap_or(3).max(1),
            "--bench" => {}
            other => path = Some(PathBuf::from(other)),
        }
    }
    let path = match path {
        Some(p) => p,
        None => {
            let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(STANDARD_SET_PATH);
            let started = Instant::now();
            let existed = p.exists();
            ensure_standard_set(&p)?;
            if !existed {
                println!(
                    "generated {} in {:.2} s",
                    p.display(),
                    started.elapsed().as_secs_f64()
                );
            }
            p
        }
    };
    let stored = std::fs::metadata(&path)?.len();
    let plain = uncompressed_size(&path)?;
    println!("dataset        {}", path.display());
    println!("size           {stored} bytes stored, {plain} bytes uncompressed");

    let builder = RequestBuilder::new(
        ModelParams::preset("qwen3.6-35b-a3b").expect("preset"),
        true,
    );
    let (mut load_times, mut build_times) = (vec![], vec![]);
    let mut peak_after_load = 0;
    let (mut turns, mut body_bytes) = (0usize, 0u64);
    for run in 0..runs {
        let started = Instant::now();
        let ds = load(&path, &LoadOptions::default())?;
        load_times.push(started.elapsed());
        if run == 0 {
            peak_after_load = peak_rss_kib();
        }
        let started = Instant::now();
        let mut buf = Vec::new();
        let (mut n, mut bytes) = (0usize, 0u64);
        for conv in &ds.conversations {
            let salt = Salt::new(1, &conv.id);
            for turn in &conv.client_turns {
                buf.clear();
                builder.write_body(&mut buf, conv, turn, Some(&salt));
                bytes += buf.len() as u64;
                n += 1;
            }
        }
        build_times.push(started.elapsed());
        (turns, body_bytes) = (n, bytes);
        drop(ds);
    }
    let peak = peak_rss_kib();
    println!(
        "client turns   {turns}, request bodies {:.1} MB",
        body_bytes as f64 / 1e6
    );
    report("load+validate", &mut load_times);
    report("build bodies", &mut build_times);
    println!(
        "peak RSS       {:.1} MB after the first load, {:.1} MB overall ({:.2}x the uncompressed file)",
        peak_after_load as f64 / 1024.0,
        peak as f64 / 1024.0,
        peak as f64 * 1024.0 / plain as f64
    );
    Ok(())
}

fn report(name: &str, times: &mut [Duration]) {
    times.sort();
    println!(
        "{name:<14} best {:.3} s, median {:.3} s over {} runs",
        times[0].as_secs_f64(),
        times[times.len() / 2].as_secs_f64(),
        times.len()
    );
}

fn uncompressed_size(path: &std::path::Path) -> std::io::Result<u64> {
    let mut reader = agentrace::dataset::open_lines(path)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = reader.read(&mut buf)?;
        if n == 0 {
            return Ok(total);
        }
        total += n as u64;
    }
}

/// The process's peak resident set (VmHWM), in KiB; 0 where /proc is unavailable.
fn peak_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}
