//! Hostile-input benchmark: how an agentrace binary holds up against hostile clients and
//! backends. Each attack runs against a fresh proxy (or replayer, or validator) started from
//! `--bin`, is bounded in count and time, and reports the process's peak RSS (`VmHWM`/`VmRSS`
//! sampled every 50 ms), open descriptors, CPU time, what the attackers got, what reached the
//! backend and the latency of a well-behaved probe client sending small requests through the
//! same proxy at a steady rate; with the machine's load at both ends, since it is shared.
//!
//! Run with `scripts/bench-hostile.sh` (or `cargo bench --bench hostile -- [flags]`). Flags:
//! `--bin PATH` (default: the release binary this bench was built with), `--compare OTHER`
//! (each attack against OTHER ("before") and `--bin` ("after") in turn, side by side with
//! their ratio), `--peer haproxy|nginx` (repeatable: the plain-HTTP attacks also against that
//! peer in front of the same backend, with agentrace's ratio to it), `--proxy-config FILE` (laid under the keys an attack sets), `--only A,B`,
//! `--json PATH`, `--scale F` (counts and sizes times F), and one flag per knob (see
//! [`Args`]). The backends run in a process of their own (this bench started again with
//! `--serve-backends`).

mod backends;
mod epp;
mod h2;
mod http1;
mod loops;
mod offline;
mod peer;
mod pool;
mod probe;
mod procfs;
mod proxy;
mod report;
mod tls;

use std::path::{Path, PathBuf};

use backends::Backends;
use report::Run;

/// Every attack, in the order they run.
const ATTACKS: [&str; 21] = [
    "session-keys",
    "big-bodies",
    "interim-storm",
    "slowloris",
    "idle-conns",
    "h2-idle-no-ack",
    "h2-rapid-reset",
    "tls-handshakes",
    "replay-endless-sse",
    "validate-long-line",
    "epp-idle-conns",
    "epp-fd-limit",
    "epp-big-bodies",
    "epp-unanswered",
    "epp-malformed",
    "epp-sequential",
    "pool-rewatch",
    "pool-bookmarks",
    "pool-metrics",
    "self-loop",
    "early-413",
];

/// Flags; each knob's default is the figure the attack's issue measured where the machine
/// allows it.
pub struct Args {
    pub bin: PathBuf,
    pub compare: Option<PathBuf>,
    /// Peer proxies (`haproxy`, `nginx`) run through the attacks that apply to them.
    pub peers: Vec<String>,
    pub proxy_config: Option<PathBuf>,
    pub only: Option<Vec<String>>,
    pub json: Option<PathBuf>,
    pub probe_rate: f64,
    pub baseline_secs: f64,
    pub session_requests: usize,
    pub session_key_kib: usize,
    pub session_conns: usize,
    pub big_conns: usize,
    pub big_body_mib: usize,
    pub storm_clients: usize,
    pub storm_watch_secs: f64,
    pub slowloris_conns: usize,
    pub slowloris_secs: f64,
    pub idle_conns: usize,
    pub idle_secs: f64,
    pub h2_idle_conns: usize,
    pub h2_idle_timeout_ms: u64,
    pub h2_idle_grace_secs: f64,
    pub reset_conns: usize,
    pub reset_batch: usize,
    pub reset_secs: f64,
    pub tls_clients: usize,
    pub tls_secs: f64,
    pub sse_secs: f64,
    pub long_line_mib: usize,
    pub validate_timeout_secs: f64,
    /// Ready pods in the `pool-*` attacks' InferencePool.
    pub pool_pods: usize,
    /// How long the `pool-*` attacks watch the picker.
    pub pool_secs: f64,
    pub loop_requests: usize,
    pub loop_idle_secs: f64,
    pub early_requests: usize,
    pub early_body_mib: usize,
}

fn parse_args() -> Args {
    let mut a = Args {
        bin: PathBuf::from(env!("CARGO_BIN_EXE_agentrace")),
        compare: None,
        peers: Vec::new(),
        proxy_config: None,
        only: None,
        json: None,
        probe_rate: 100.0,
        baseline_secs: 5.0,
        session_requests: 10_000,
        session_key_kib: 60,
        session_conns: 4,
        big_conns: 24,
        big_body_mib: 60,
        storm_clients: 4,
        storm_watch_secs: 5.0,
        slowloris_conns: 2_000,
        slowloris_secs: 40.0,
        idle_conns: 5_000,
        idle_secs: 10.0,
        h2_idle_conns: 300,
        h2_idle_timeout_ms: 1_000,
        h2_idle_grace_secs: 10.0,
        reset_conns: 4,
        reset_batch: 5,
        reset_secs: 10.0,
        tls_clients: 8,
        tls_secs: 5.0,
        sse_secs: 10.0,
        long_line_mib: 512,
        validate_timeout_secs: 120.0,
        pool_pods: 10_000,
        pool_secs: 10.0,
        loop_requests: 20,
        loop_idle_secs: 5.0,
        early_requests: 1,
        early_body_mib: 32,
    };
    let mut scale = 1.0f64;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        macro_rules! num {
            ($field:expr) => {
                $field = value().parse().unwrap_or_else(|e| panic!("{flag}: {e}"))
            };
        }
        match flag.as_str() {
            "--bench" => {}
            "--bin" => a.bin = value().into(),
            "--compare" => a.compare = Some(value().into()),
            "--peer" => a.peers.push(value()),
            "--proxy-config" => a.proxy_config = Some(value().into()),
            "--json" => a.json = Some(value().into()),
            "--only" => a.only = Some(value().split(',').map(str::to_string).collect()),
            "--scale" => num!(scale),
            "--probe-rate" => num!(a.probe_rate),
            "--baseline-secs" => num!(a.baseline_secs),
            "--session-requests" => num!(a.session_requests),
            "--session-key-kib" => num!(a.session_key_kib),
            "--session-conns" => num!(a.session_conns),
            "--big-conns" => num!(a.big_conns),
            "--big-body-mib" => num!(a.big_body_mib),
            "--storm-clients" => num!(a.storm_clients),
            "--storm-watch-secs" => num!(a.storm_watch_secs),
            "--slowloris-conns" => num!(a.slowloris_conns),
            "--slowloris-secs" => num!(a.slowloris_secs),
            "--idle-conns" => num!(a.idle_conns),
            "--idle-secs" => num!(a.idle_secs),
            "--h2-idle-conns" => num!(a.h2_idle_conns),
            "--h2-idle-timeout-ms" => num!(a.h2_idle_timeout_ms),
            "--h2-idle-grace-secs" => num!(a.h2_idle_grace_secs),
            "--reset-conns" => num!(a.reset_conns),
            "--reset-batch" => num!(a.reset_batch),
            "--reset-secs" => num!(a.reset_secs),
            "--tls-clients" => num!(a.tls_clients),
            "--tls-secs" => num!(a.tls_secs),
            "--sse-secs" => num!(a.sse_secs),
            "--long-line-mib" => num!(a.long_line_mib),
            "--validate-timeout-secs" => num!(a.validate_timeout_secs),
            "--pool-pods" => num!(a.pool_pods),
            "--pool-secs" => num!(a.pool_secs),
            "--loop-requests" => num!(a.loop_requests),
            "--loop-idle-secs" => num!(a.loop_idle_secs),
            "--early-requests" => num!(a.early_requests),
            "--early-body-mib" => num!(a.early_body_mib),
            other => panic!("unknown flag {other}"),
        }
    }
    for n in [
        &mut a.session_requests,
        &mut a.big_conns,
        &mut a.slowloris_conns,
        &mut a.idle_conns,
        &mut a.h2_idle_conns,
        &mut a.long_line_mib,
        &mut a.pool_pods,
    ] {
        *n = ((*n as f64 * scale).round() as usize).max(1);
    }
    if let Some(only) = &a.only {
        for name in only {
            assert!(
                ATTACKS.contains(&name.as_str()),
                "--only: no attack {name}; there are {}",
                ATTACKS.join(", ")
            );
        }
    }
    a
}

/// What every attack shares: the flags, the backends, a scratch directory, the TLS material.
pub struct Ctx {
    pub args: Args,
    pub backends: Backends,
    pub dir: tempfile::TempDir,
    pub tls: tls::Material,
}

impl Ctx {
    /// The proxy's config file: `--proxy-config` with `extra` (TOML) laid over it, and
    /// `backend` when the file names none (a file is validated before `--backend` replaces
    /// its backends); `None` when there is neither file nor `extra`.
    pub fn proxy_config(&self, extra: &str, backend: std::net::SocketAddr) -> Option<PathBuf> {
        if self.args.proxy_config.is_none() && extra.is_empty() {
            return None;
        }
        let mut table = match &self.args.proxy_config {
            Some(path) => std::fs::read_to_string(path)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
                .parse::<toml::Table>()
                .unwrap_or_else(|e| panic!("{}: {e}", path.display())),
            None => toml::Table::new(),
        };
        merge(&mut table, extra.parse().expect("attack config"));
        if !table.contains_key("backends") {
            let fallback = format!("[[backends]]\nname = \"bench\"\nurl = \"http://{backend}\"\n");
            merge(&mut table, fallback.parse().unwrap());
        }
        let path = self.dir.path().join("proxy.toml");
        std::fs::write(&path, toml::to_string(&table).unwrap()).unwrap();
        Some(path)
    }
}

/// Lays `over` onto `base`, table by table.
fn merge(base: &mut toml::Table, over: toml::Table) {
    for (key, value) in over {
        match (base.get_mut(&key), value) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            (Some(slot), value) => *slot = value,
            (None, value) => {
                base.insert(key, value);
            }
        }
    }
}

fn main() {
    if std::env::args().nth(1).as_deref() == Some(backends::SERVE_FLAG) {
        backends::serve();
    }
    let args = parse_args();
    let nofile = procfs::raise_nofile_limit();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(run(args, nofile));
}

async fn run(args: Args, nofile: u64) {
    for bin in std::iter::once(&args.bin).chain(&args.compare) {
        assert!(
            bin.is_file(),
            "{} is missing (cargo build --release)",
            bin.display()
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let ctx = Ctx {
        backends: Backends::start().await,
        tls: tls::Material::generate(dir.path()),
        dir,
        args,
    };
    let peers: Vec<(&str, PathBuf)> = ctx
        .args
        .peers
        .iter()
        .map(|name| (name.as_str(), peer::find(name)))
        .collect();
    let mut binaries: Vec<(&str, &Path)> = match &ctx.args.compare {
        Some(other) => vec![
            ("before", other.as_path()),
            ("after", ctx.args.bin.as_path()),
        ],
        None => vec![("agentrace", ctx.args.bin.as_path())],
    };
    binaries.extend(peers.iter().map(|(name, path)| (*name, path.as_path())));
    println!("# Hostile-input benchmark\n");
    for (label, bin) in &binaries {
        println!("- {label}: {}", bin.display());
    }
    println!(
        "- {} cores, RLIMIT_NOFILE {nofile}, load at start {}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        procfs::loadavg()
    );
    let mut all: Vec<Run> = Vec::new();
    let selected: Vec<&str> = std::iter::once("baseline")
        .chain(ATTACKS.iter().copied().filter(|a| {
            ctx.args
                .only
                .as_ref()
                .is_none_or(|o| o.iter().any(|n| n == a))
        }))
        .collect();
    for (i, attack) in selected.iter().enumerate() {
        // Alternate which binary goes first, so neither always meets the warmer machine.
        let mut order: Vec<usize> = (0..binaries.len()).collect();
        if i % 2 == 1 {
            order.reverse();
        }
        let mut runs = vec![None; binaries.len()];
        for k in order {
            let (label, bin) = binaries[k];
            if peer::of(bin).is_some() && !peer::ATTACKS.contains(attack) {
                continue;
            }
            let run = Run::new(attack, label, &bin.display().to_string());
            runs[k] = Some(run_attack(&ctx, attack, bin, run).await);
        }
        let runs: Vec<Run> = runs.into_iter().flatten().collect();
        report::print_table(&title(attack, &ctx.args), &runs);
        all.extend(runs);
        if let Some(path) = &ctx.args.json {
            write_json(path, &ctx.args, &all);
        }
    }
    println!("\nload at end {}", procfs::loadavg());
}

async fn run_attack(ctx: &Ctx, attack: &str, bin: &Path, run: Run) -> Run {
    match attack {
        "baseline" => http1::baseline(ctx, bin, run).await,
        "session-keys" => http1::session_keys(ctx, bin, run).await,
        "big-bodies" => http1::big_bodies(ctx, bin, run).await,
        "interim-storm" => http1::interim_storm(ctx, bin, run).await,
        "slowloris" => http1::slowloris(ctx, bin, run).await,
        "idle-conns" => http1::idle_conns(ctx, bin, run).await,
        "h2-idle-no-ack" => h2::idle_no_ack(ctx, bin, run).await,
        "h2-rapid-reset" => h2::rapid_reset(ctx, bin, run).await,
        "tls-handshakes" => tls::handshakes(ctx, bin, run).await,
        "replay-endless-sse" => offline::replay_endless_sse(ctx, bin, run).await,
        "validate-long-line" => offline::validate_long_line(ctx, bin, run).await,
        "epp-idle-conns" => epp::idle_conns(ctx, bin, run).await,
        "epp-fd-limit" => epp::fd_limit(ctx, bin, run).await,
        "epp-big-bodies" => epp::big_bodies(ctx, bin, run).await,
        "epp-unanswered" => {
            // The branch point has no epp.in_flight_max_ms (and refuses unknown keys).
            let knows = run.label != "before";
            epp::unanswered(ctx, bin, run, knows).await
        }
        "epp-malformed" => epp::malformed(ctx, bin, run).await,
        "epp-sequential" => epp::sequential(ctx, bin, run).await,
        "pool-rewatch" => pool::rewatch(ctx, bin, run).await,
        "pool-bookmarks" => pool::bookmarks(ctx, bin, run).await,
        "pool-metrics" => pool::metrics(ctx, bin, run).await,
        "self-loop" => loops::self_loop(ctx, bin, run).await,
        "early-413" => loops::early_413(ctx, bin, run).await,
        other => unreachable!("attack {other}"),
    }
}

fn title(attack: &str, a: &Args) -> String {
    match attack {
        "baseline" => format!("baseline: the probe alone, {} s at {} req/s", a.baseline_secs, a.probe_rate),
        "session-keys" => format!(
            "session-keys: {} requests, each with a unique {} KiB X-Session-ID, over {} keep-alive connections",
            report::fmt_num(a.session_requests as f64), a.session_key_kib, a.session_conns
        ),
        "big-bodies" => format!(
            "big-bodies: {} connections each POSTing a {} MiB chat completion at full speed",
            a.big_conns, a.big_body_mib
        ),
        "interim-storm" => format!(
            "interim-storm: a backend answering endless 100 Continue; {} clients each leave after 100 ms; then {} s watched",
            a.storm_clients, a.storm_watch_secs
        ),
        "slowloris" => format!(
            "slowloris: {} connections sending a request head one byte a second, for {} s",
            report::fmt_num(a.slowloris_conns as f64), a.slowloris_secs
        ),
        "idle-conns" => format!(
            "idle-conns: {} connections opened at once, held idle {} s",
            report::fmt_num(a.idle_conns as f64), a.idle_secs
        ),
        "h2-idle-no-ack" => format!(
            "h2-idle-no-ack: {} h2c connections that never acknowledge a PING, client.idle_timeout_ms = {}, watched {} s past it",
            report::fmt_num(a.h2_idle_conns as f64), a.h2_idle_timeout_ms, a.h2_idle_grace_secs
        ),
        "h2-rapid-reset" => format!(
            "h2-rapid-reset: {} h2c connections sending chat completions in batches of {}, each reset 2-5 ms later, for {} s",
            a.reset_conns, a.reset_batch, a.reset_secs
        ),
        "tls-handshakes" => format!(
            "tls-handshakes: {} clients making full TLS handshakes (no resumption) for {} s; the probe over TLS",
            a.tls_clients, a.tls_secs
        ),
        "replay-endless-sse" => format!(
            "replay-endless-sse: the replayer against a backend streaming SSE events without end, stopped after {} s",
            a.sse_secs
        ),
        "validate-long-line" => format!(
            "validate-long-line: dataset validate on a {} MiB file without a newline",
            a.long_line_mib
        ),
        "epp-idle-conns" => format!(
            "epp-idle-conns: {} connections to the picker's gRPC port, held idle {} s",
            report::fmt_num(a.idle_conns as f64), a.idle_secs
        ),
        "epp-fd-limit" => "epp-fd-limit: the picker under RLIMIT_NOFILE 256, 400 connections opened, 5 s watched".to_string(),
        "epp-big-bodies" => format!(
            "epp-big-bodies: 8 ext_proc streams each sending a {} MiB body (full-duplex, 1 MiB chunks), held open",
            a.big_body_mib
        ),
        "epp-unanswered" => "epp-unanswered: 400 streams placed and never answered (after: epp.in_flight_max_ms = 5000)".to_string(),
        "epp-malformed" => "epp-malformed: seven kinds of malformed ext_proc message over raw HTTP/2".to_string(),
        "epp-sequential" => "epp-sequential: 200 sequential ext_proc exchanges from a client that does not re-arm TCP_QUICKACK".to_string(),
        "pool-rewatch" => format!(
            "pool-rewatch: epp over an InferencePool whose API server ends every watch at once, watched {} s",
            a.pool_secs
        ),
        "pool-bookmarks" => format!(
            "pool-bookmarks: epp over {} ready pods; a placement probe at {} req/s for {} s quiet, then {} s of a BOOKMARK storm",
            report::fmt_num(a.pool_pods as f64), a.probe_rate, a.pool_secs / 2.0, a.pool_secs
        ),
        "pool-metrics" => format!(
            "pool-metrics: epp over {} ready pods, /metrics scraped 3 times",
            report::fmt_num(a.pool_pods as f64)
        ),
        "self-loop" => format!(
            "self-loop: a proxy whose backend is itself, {} concurrent requests, then {} s of its health probes alone",
            a.loop_requests, a.loop_idle_secs
        ),
        "early-413" => format!(
            "early-413: {} clients each POSTing {} MiB to a backend that answers 413 before reading the body, then closes",
            a.early_requests, a.early_body_mib
        ),
        _ => attack.to_string(),
    }
}

fn write_json(path: &Path, args: &Args, runs: &[Run]) {
    let doc = serde_json::json!({
        "bin": args.bin.display().to_string(),
        "compare": args.compare.as_ref().map(|p| p.display().to_string()),
        "peers": args.peers,
        "command": std::env::args().collect::<Vec<_>>(),
        "runs": runs.iter().map(Run::to_json).collect::<Vec<_>>(),
    });
    std::fs::write(path, serde_json::to_string_pretty(&doc).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}
