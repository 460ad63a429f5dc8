//! Real agent clients end to end: the official `anthropic` SDK (a streamed, tool-using
//! Messages loop) and the official `openai` SDK (a Responses loop chained by
//! `previous_response_id`, with function calls, streamed and unstreamed) drive the proxy
//! binary with its recorder over two simulated replicas; then the capture is exported,
//! validated and replayed, all through the binary. Invariants:
//! - every turn of a Responses chain is answered by the replica that created the previous
//!   response, and a Messages session (pinned by its conversation's fingerprint) leaves its
//!   replica only by a move the proxy counts;
//! - every turn sent is exported, under its conversation, with the right `source_api`;
//! - the exported dataset validates and replays with no failed turn.
//!
//! The SDKs come from `scripts/python-sdks.sh`; when it cannot install them the test says it
//! skipped, unless `AGENTRACE_REQUIRE_SDKS` is set (as CI sets it): then it fails.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use agentrace::sim::SimConfig;
use serde_json::Value;
use support::engine::Engine;
use support::proxy_process::ProxyProcess;
use support::sim::{test_config, Sim};

const SESSIONS: usize = 3;
const TURNS: usize = 4;

/// The SDK venv's python, or `None` (after saying so) when it cannot be installed.
fn sdk_python(test: &str) -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(root.join("scripts/python-sdks.sh"))
        .output()
        .expect("scripts/python-sdks.sh runs");
    if out.status.success() {
        return Some(PathBuf::from(String::from_utf8(out.stdout).unwrap().trim()));
    }
    let why = String::from_utf8_lossy(&out.stderr);
    let why = why.lines().last().unwrap_or("no output").to_string();
    if std::env::var_os("AGENTRACE_REQUIRE_SDKS").is_some() {
        panic!("{test}: AGENTRACE_REQUIRE_SDKS is set but the SDKs did not install: {why}");
    }
    support::skip(test, &format!("scripts/python-sdks.sh failed: {why}"));
    None
}

/// Runs one loop script (with `options` after its positional arguments) and returns its
/// per-turn JSON lines.
async fn run_loop(python: &Path, script: &str, base_url: &str, options: &[&str]) -> Vec<Value> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/sdk")
        .join(script);
    let run = tokio::process::Command::new(python)
        .arg(path)
        .arg(base_url)
        .arg(SESSIONS.to_string())
        .arg(TURNS.to_string())
        .args(options)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .unwrap_or_else(|_| panic!("{script} did not finish within 120 s"))
        .unwrap();
    assert!(
        out.status.success(),
        "{script} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The binary with `args`, which must succeed; its standard output.
fn agentrace(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_agentrace"))
        .args(args)
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "agentrace {args:?}:\n{said}");
    said
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_agent_loops_stay_on_one_replica_and_export_every_turn() {
    let test = "sdk_agent_loops_stay_on_one_replica_and_export_every_turn";
    let Some(python) = sdk_python(test) else {
        return;
    };
    let sim = Sim::start(
        SimConfig {
            time_scale: 0.01,
            ..test_config()
        },
        2,
    );
    let dir = tempfile::tempdir().unwrap();
    let capture = dir.path().join("capture");
    let backends: Vec<String> = (0..2)
        .map(|i| format!("sim-{i}=http://{}", sim.addr(i)))
        .collect();
    let proxy = ProxyProcess::spawn(&[
        "--backend",
        &backends[0],
        "--backend",
        &backends[1],
        "--capture",
        capture.to_str().unwrap(),
    ])
    .await;
    let base = format!("http://{}", proxy.addr);
    let mut turns = run_loop(&python, "anthropic_loop.py", &base, &[]).await;
    turns.extend(
        run_loop(
            &python,
            "openai_responses_loop.py",
            &format!("{base}/v1"),
            &[],
        )
        .await,
    );
    assert_eq!(turns.len(), 2 * SESSIONS * TURNS);
    let failed: Vec<&Value> = turns.iter().filter(|t| t.get("failed").is_some()).collect();
    assert!(failed.is_empty(), "turns that failed: {failed:?}");

    let mut pods: BTreeMap<(String, u64), BTreeSet<String>> = BTreeMap::new();
    for t in &turns {
        let key = (
            t["api"].as_str().unwrap().to_string(),
            t["session"].as_u64().unwrap(),
        );
        pods.entry(key)
            .or_default()
            .insert(t["pod"].as_str().unwrap().to_string());
    }
    let admin = support::sim::get(proxy.admin.parse().unwrap(), "/metrics").await;
    let metrics = String::from_utf8(admin.body()).unwrap();
    let moved = |reason: &str| -> usize {
        let line = format!("agentrace_affinity_moves_total{{reason=\"{reason}\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(line.as_str()))
            .map_or(0, |v| v.parse().unwrap())
    };
    // A Responses chain must stay where its responses are stored, or its next turn fails; a
    // Messages session, on an idle pool with no cache lost and no backend failing, has no
    // reason to leave the cache it built.
    for ((api, session), on) in &pods {
        assert_eq!(on.len(), 1, "{api} session {session} went to {on:?}");
    }
    for reason in ["cache_lost", "failed", "removed", "queue_wait"] {
        assert_eq!(moved(reason), 0, "a session moved for {reason}");
    }
    assert!(turns.iter().any(|t| t["tool_use"] == true));
    assert!(turns.iter().any(|t| t["function_calls"].as_u64() > Some(0)));

    stop_proxy(proxy).await;
    let dataset = dir.path().join("agents.jsonl");
    export_and_validate(&capture, &dataset);
    // The captured sessions replay in each agent's own wire as well as in chat.
    for api in ["chat", "messages", "responses"] {
        replay_without_failure(
            &dataset,
            &format!("http://{}", sim.addr(0)),
            dir.path(),
            api,
        );
    }
    sim.stop().await;
}

// The same two loops against two real llama-servers (tiny random-weight model). llama-server
// keeps no responses and refuses `previous_response_id` with 400, so the Responses loop sends
// its whole input every turn; it cannot build the grammar that a forced tool choice needs for
// this model's vocabulary (400 again), so no turn forces a call, and as the model never
// emits one the loops fabricate every tool exchange. Its Messages stream leaves out
// `message_start` when the first sampled token is an incomplete UTF-8 piece (it sends no event
// for that token, and only the event of token one carries `message_start`), which the SDK
// cannot assemble; the random model samples such byte tokens often, so the servers never
// sample a byte token above 0x7F. llama-server sends no replica header: which server
// answered comes from the capture's records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_agent_loops_against_llama_server_keep_sessions_on_one_server_and_export_every_turn() {
    let test = "sdk_agent_loops_against_llama_server";
    let Some((server, model)) = support::engine::artefacts(test) else {
        return;
    };
    let Some(python) = sdk_python(test) else {
        return;
    };
    // A server-wide grammar would do too, but a request with tools replaces it.
    let ascii: Vec<String> = (0x80..=0xFF)
        .flat_map(|b| ["--logit-bias".to_string(), format!("{}-inf", byte_token(b))])
        .collect();
    let ascii: Vec<&str> = ascii.iter().map(String::as_str).collect();
    let engines = [
        Engine::start_with(&server, &model, 2, &ascii).await,
        Engine::start_with(&server, &model, 2, &ascii).await,
    ];
    let dir = tempfile::tempdir().unwrap();
    let capture = dir.path().join("capture");
    let backends: Vec<String> = engines
        .iter()
        .enumerate()
        .map(|(i, e)| format!("llama-{i}={}", e.url()))
        .collect();
    let proxy = ProxyProcess::spawn(&[
        "--backend",
        &backends[0],
        "--backend",
        &backends[1],
        "--capture",
        capture.to_str().unwrap(),
    ])
    .await;
    let base = format!("http://{}", proxy.addr);
    let no_force = ["--no-forced-tools"];
    let mut turns = run_loop(&python, "anthropic_loop.py", &base, &no_force).await;
    let responses = format!("{base}/v1");
    let stateless = ["--stateless", "--no-forced-tools"];
    turns.extend(run_loop(&python, "openai_responses_loop.py", &responses, &stateless).await);
    assert_eq!(turns.len(), 2 * SESSIONS * TURNS);
    let failed: Vec<&Value> = turns.iter().filter(|t| t.get("failed").is_some()).collect();
    assert!(failed.is_empty(), "turns that failed: {failed:?}");
    stop_proxy(proxy).await;

    // Per API: each proxy session key on one server, one key per conversation, and a
    // first-token stamp on every streamed turn.
    let records = support::capture::read_all(&capture);
    for (path, api) in [("/v1/messages", "messages"), ("/v1/responses", "responses")] {
        let mut on: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        let mut streamed = 0;
        for e in records.iter().filter(|e| e.record.path == path) {
            let r = &e.record;
            assert_eq!(
                r.response.as_ref().map(|r| r.status),
                Some(200),
                "{api} {r:?}"
            );
            let session = r.session.clone().expect("every turn has a session key");
            on.entry(session).or_default().insert(r.backend.clone());
            let body: Value = serde_json::from_slice(e.request_body.as_ref().unwrap()).unwrap();
            if body["stream"] == true {
                streamed += 1;
                assert!(r.t.first_token_us.is_some(), "{api}: no first token: {r:?}");
            }
        }
        assert_eq!(on.len(), SESSIONS, "{api}: session keys {on:?}");
        assert!(on.values().all(|b| b.len() == 1), "{api} moved: {on:?}");
        let expected = if api == "messages" {
            TURNS
        } else {
            TURNS.div_ceil(2)
        };
        assert_eq!(streamed, SESSIONS * expected, "{api}: streamed turns");
    }

    let dataset = dir.path().join("agents.jsonl");
    export_and_validate(&capture, &dataset);
    for api in ["chat", "messages", "responses"] {
        replay_without_failure(&dataset, &engines[0].url(), dir.path(), api);
    }
}

/// The tiny model's token for byte `b`: `scripts/tiny_gguf.py` puts its five special tokens
/// first, then the 256 bytes in order.
fn byte_token(b: u32) -> u32 {
    5 + b
}

/// SIGTERM to the proxy, which must drain and let the recorder finish its files.
async fn stop_proxy(proxy: ProxyProcess) {
    let killed = Command::new("kill")
        .args(["-TERM", &proxy.pid.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let mut child = proxy.child;
    tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .expect("the proxy exits within 30 s of SIGTERM")
        .unwrap();
}

/// `capture export` of every turn sent by both loops, each under its conversation with the
/// right `source_api` and with its reply, then `dataset validate`.
fn export_and_validate(capture: &Path, dataset: &Path) {
    let exported = agentrace(&[
        "capture",
        "export",
        capture.to_str().unwrap(),
        "--out",
        dataset.to_str().unwrap(),
    ]);
    assert!(
        exported.contains(&format!("{} client turns", 2 * SESSIONS * TURNS)),
        "{exported}"
    );
    let rows: Vec<Value> = std::fs::read_to_string(dataset)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for api in ["messages", "responses"] {
        let of_api: Vec<&Value> = rows.iter().filter(|r| r["source_api"] == api).collect();
        let conversations: BTreeSet<&str> = of_api
            .iter()
            .map(|r| r["conversation_id"].as_str().unwrap())
            .collect();
        assert_eq!(conversations.len(), SESSIONS, "{api}: {conversations:?}");
        // Client rows carry the API; each is one turn sent, and each has its reply.
        assert_eq!(of_api.len(), SESSIONS * TURNS, "{api}: turns exported");
        let replies = rows
            .iter()
            .filter(|r| r["role"] == "assistant")
            .filter(|r| conversations.contains(r["conversation_id"].as_str().unwrap()))
            .count();
        assert_eq!(replies, SESSIONS * TURNS, "{api}: replies exported");
    }
    let validated = agentrace(&["dataset", "validate", dataset.to_str().unwrap()]);
    assert!(validated.contains("valid"), "{validated}");
}

/// `agentrace replay --api api` of `dataset` at `target`: every turn of both loops ok, none
/// failed.
fn replay_without_failure(dataset: &Path, target: &str, dir: &Path, api: &str) {
    let out = dir.join(format!("replay-{api}"));
    let run = Command::new(env!("CARGO_BIN_EXE_agentrace"))
        .args(["replay", "--no-progress", "--api", api, "--dataset"])
        .arg(dataset)
        .args(["--target", target, "--out"])
        .arg(&out)
        .output()
        .unwrap();
    let replayed = String::from_utf8_lossy(&run.stdout);
    let errors: Vec<Value> = support::replay::events(&out)
        .into_iter()
        .filter(|e| e["event_type"] == "error.generic")
        .take(3)
        .collect();
    let said = format!(
        "{replayed}{}\nfirst errors: {errors:?}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(run.status.success(), "replay:\n{said}");
    let issued = 2 * SESSIONS * TURNS;
    assert!(
        replayed.contains(&format!("issued {issued} ok {issued} ")),
        "{said}"
    );
    assert!(
        replayed.contains(&format!("failures      0 of {issued} turns")),
        "{said}"
    );
}
