//! agentrace against a real engine: llama.cpp's `llama-server` serving a tiny random-weight
//! model (`scripts/real-engine.sh` builds both). Every test prints a skip line and passes when
//! the artefacts are absent, so a clone without them still passes `cargo test`.
//!
//! Invariants: a replay straight at the server succeeds on every turn with the server's own
//! usage, cached tokens included, even when the next turn follows at once on a connection the
//! server closes after each stream; session affinity keeps a conversation's prefix cached where
//! round-robin loses it (more cached tokens, fewer prompt tokens processed); capture → export
//! → replay sends the captured request bodies again, field by field, and the replayer's TTFT
//! agrees with the proxy's record of the first content event; a server killed mid-run
//! costs only the turns it held; the plan's prediction stays within the bounds a loaded
//! machine allows of a real two-replica run.

mod support;

use std::sync::Arc;

use agentrace::dataset::ModelParams;
use agentrace::replay::ReplayConfig;
use serde_json::Value;
use support::engine::{artefacts, Engine};

/// Replay settings for the tiny model: 8 new tokens a turn, greedy, no salt, no delays.
fn replay_config(target: &str, concurrency: usize) -> ReplayConfig {
    ReplayConfig {
        target: target.into(),
        concurrency,
        enable_salt: false,
        inject_tool_delay: false,
        progress: false,
        model_params: Some(ModelParams {
            name: "tiny".into(),
            max_new_tokens: Some(8),
            temperature: Some(0.0),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn conversations(n: usize, turns: usize) -> Arc<agentrace::dataset::Dataset> {
    support::replay::dataset(
        (0..n)
            .map(|i| support::replay::conversation(&format!("conv-{i}"), turns, &[], "ls -la src"))
            .collect(),
    )
}

/// The first few error messages a replay logged, for assertion messages.
fn failure_reasons(out: &std::path::Path) -> Vec<String> {
    support::replay::events(out)
        .iter()
        .filter(|e| e["event_type"] == "error.generic")
        .take(3)
        .map(|e| e.to_string())
        .collect()
}

fn summary_json(out: &std::path::Path) -> Value {
    serde_json::from_slice(&std::fs::read(out.join("result_summary.json")).unwrap()).unwrap()
}

/// The prompt tokens a server has evaluated (not served from its cache), from its metrics.
async fn prompt_tokens_processed(engine: &Engine) -> f64 {
    let client = support::capture::client();
    let req = http::Request::get(format!("{}/metrics", engine.url()))
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .unwrap()
        .to_bytes();
    String::from_utf8_lossy(&body)
        .lines()
        .find_map(|l| l.strip_prefix("llamacpp:prompt_tokens_total "))
        .and_then(|v| v.trim().parse().ok())
        .expect("llama-server exports llamacpp:prompt_tokens_total")
}

// Straight at one server, turns back to back (no delays) on connections the server closes
// after each stream: every turn succeeds, token counts come from the server's usage, and its
// prefix cache shows in the cached-token share.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_straight_at_llama_server_succeeds_on_every_turn_with_its_usage() {
    let Some((server, model)) = artefacts("replay_straight_at_llama_server") else {
        return;
    };
    let engine = Engine::start(&server, &model, 2).await;
    let ds = conversations(2, 12);
    let out = tempfile::tempdir().unwrap();
    let s = agentrace::replay::run(
        replay_config(&engine.url(), 2),
        ds,
        out.path(),
        support::replay::no_shutdown(),
    )
    .await
    .unwrap();
    assert_eq!((s.turns_ok, s.failures), (24, 0), "{s:?}");
    assert!(!s.tokens_estimated, "usage missing: {s:?}");
    let cached = summary_json(out.path())["metrics"]["cached_token_ratio"]
        .as_f64()
        .expect("the server reported cached tokens");
    assert!(cached > 0.3, "cached-token share {cached}");
}

// A conversation of 120 turns sent back to back: llama-server closes the connection after
// each streamed response while advertising keep-alive, and not one turn may fail for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn back_to_back_turns_never_fail_on_a_connection_the_server_closed() {
    let Some((server, model)) = artefacts("back_to_back_turns_never_fail") else {
        return;
    };
    let engine = Engine::start(&server, &model, 1).await;
    let out = tempfile::tempdir().unwrap();
    let s = agentrace::replay::run(
        replay_config(&engine.url(), 1),
        conversations(1, 120),
        out.path(),
        support::replay::no_shutdown(),
    )
    .await
    .unwrap();
    assert_eq!((s.turns_ok, s.failures), (120, 0), "{s:?}");
}

/// Replays `ds` through a fresh proxy with `policy` in front of two fresh servers; returns
/// the cached-token share and the prompt tokens the servers evaluated.
async fn run_policy(
    server: &std::path::Path,
    model: &std::path::Path,
    policy: agentrace::proxy::config::Policy,
    ds: Arc<agentrace::dataset::Dataset>,
) -> (f64, f64) {
    let engines = [
        Engine::start(server, model, 2).await,
        Engine::start(server, model, 2).await,
    ];
    let mut config = support::capture::proxy_config(&[engines[0].addr, engines[1].addr]);
    config.affinity.policy = policy;
    let (stop, shutdown) = agentrace::shutdown::channel();
    let proxy = agentrace::proxy::start(config, shutdown).await.unwrap();
    let out = tempfile::tempdir().unwrap();
    let s = agentrace::replay::run(
        replay_config(&format!("http://{}", proxy.addr), 4),
        ds,
        out.path(),
        support::replay::no_shutdown(),
    )
    .await
    .unwrap();
    assert_eq!(
        s.failures,
        0,
        "{policy:?}: {:?}",
        failure_reasons(out.path())
    );
    stop.fire();
    proxy.join().await;
    let cached = summary_json(out.path())["metrics"]["cached_token_ratio"]
        .as_f64()
        .unwrap();
    let processed =
        prompt_tokens_processed(&engines[0]).await + prompt_tokens_processed(&engines[1]).await;
    (cached, processed)
}

// Two servers with two slots each, four conversations at once: pinned to one server, a
// conversation finds its prefix cached; sent round-robin, half its turns land where it is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn affinity_caches_more_and_evaluates_fewer_prompt_tokens_than_round_robin() {
    use agentrace::proxy::config::Policy;
    let Some((server, model)) = artefacts("affinity_caches_more") else {
        return;
    };
    let ds = conversations(4, 10);
    let (session_cached, session_processed) =
        run_policy(&server, &model, Policy::Session, ds.clone()).await;
    let (rr_cached, rr_processed) = run_policy(&server, &model, Policy::RoundRobin, ds).await;
    // Measured here: session 0.76-0.79, round-robin 0.62-0.67 (which slot llama-server
    // picks depends on timing); prompt tokens evaluated 0.55-0.6x.
    assert!(
        session_cached > rr_cached + 0.05,
        "cached share: session {session_cached:.3}, round-robin {rr_cached:.3}"
    );
    assert!(
        session_processed < rr_processed * 0.8,
        "prompt tokens evaluated: session {session_processed}, round-robin {rr_processed}"
    );
}

// Capture → export → replay against the real server: the replay sends every captured request
// body again, field by field (messages and generation settings), salt off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn captured_traffic_replays_with_the_same_request_bodies() {
    use agentrace::capture::export::{self, ExportOptions};
    let Some((server, model)) = artefacts("captured_traffic_replays") else {
        return;
    };
    let engine = Engine::start(&server, &model, 2).await;
    let dir = tempfile::tempdir().unwrap();
    let (first, second) = (dir.path().join("first"), dir.path().join("second"));

    let (stop, shutdown) = agentrace::shutdown::channel();
    let proxy = support::capture::start_proxy(
        &[engine.addr],
        Some(support::capture::config(&first)),
        shutdown,
    )
    .await;
    let url = format!("http://{}/v1/chat/completions", proxy.addr);
    let client = support::capture::client();
    support::capture::agent_session(&client, &url, "real-1", 6, &[]).await;
    stop.fire();
    proxy.join().await;

    let dataset_path = dir.path().join("export.jsonl");
    let report = export::export(&first, &dataset_path, &ExportOptions::default()).unwrap();
    assert_eq!(report.client_turns, 6, "{report:?}");
    let dataset = agentrace::dataset::load(&dataset_path, &Default::default()).unwrap();

    let (stop, shutdown) = agentrace::shutdown::channel();
    let proxy = support::capture::start_proxy(
        &[engine.addr],
        Some(support::capture::config(&second)),
        shutdown,
    )
    .await;
    let config = ReplayConfig {
        model_params: None,
        model_name: Some("m".into()),
        ..replay_config(&format!("http://{}", proxy.addr), 1)
    };
    let out = dir.path().join("replay");
    let s = agentrace::replay::run(
        config,
        Arc::new(dataset),
        &out,
        support::replay::no_shutdown(),
    )
    .await
    .unwrap();
    assert_eq!((s.turns_ok, s.failures), (6, 0), "{s:?}");
    stop.fire();
    proxy.join().await;

    let captured = support::capture::read_by_arrival(&first).exchanges;
    let replayed = support::capture::read_by_arrival(&second).exchanges;
    assert_eq!(captured.len(), replayed.len());
    for (i, (a, b)) in captured.iter().zip(&replayed).enumerate() {
        let a: Value = serde_json::from_slice(a.request_body.as_ref().unwrap()).unwrap();
        let b: Value = serde_json::from_slice(b.request_body.as_ref().unwrap()).unwrap();
        assert_eq!(a, b, "turn {i}");
    }

    // The replayer's TTFT agrees with the proxy's record of the same turn: the first content
    // event's offset from the request's arrival. The difference is the two loopback hops: not
    // negative beyond the stamps' rounding (the replayer's span contains the proxy's), and
    // within a millisecond in the quietest turn, as a loaded machine stretches some hops but a
    // wrong start or end would stretch all.
    let events = support::replay::events(&out);
    let stamps = |kind: &str| -> Vec<u64> {
        events
            .iter()
            .filter(|e| e["event_type"] == kind)
            .map(|e| e["timestamp_ns"].as_u64().unwrap())
            .collect()
    };
    let (issued, first) = (stamps("sample.issued"), stamps("sample.recv_first"));
    assert_eq!((issued.len(), first.len()), (6, 6));
    let mut gaps_us: Vec<i64> = replayed
        .iter()
        .zip(issued.iter().zip(&first))
        .map(|(e, (issued, first))| {
            let replay_us = ((first - issued) / 1000) as i64;
            let proxy_us = (first_content_offset_us(e) - e.record.t.received_us) as i64;
            replay_us - proxy_us
        })
        .collect();
    gaps_us.sort();
    assert!(
        (-100..=1_000).contains(&gaps_us[0]),
        "replay TTFT minus the proxy's, µs per turn: {gaps_us:?}"
    );
}

/// When the proxy forwarded a response's first event with content (µs from the exchange's
/// start), from its recorded body and event offsets.
fn first_content_offset_us(e: &agentrace::capture::reader::Exchange) -> u64 {
    let body = String::from_utf8_lossy(e.response_body.as_deref().unwrap()).into_owned();
    let index = body
        .split("\n\n")
        .position(|event| {
            let Some(json) = event.trim().strip_prefix("data: ") else {
                return false;
            };
            let Ok(v) = serde_json::from_str::<Value>(json) else {
                return false;
            };
            let delta = &v["choices"][0]["delta"];
            ["content", "reasoning_content"]
                .iter()
                .any(|k| delta[k].as_str().is_some_and(|t| !t.is_empty()))
                || delta["tool_calls"].is_array()
        })
        .expect("a content event");
    e.event_offsets_us()[index]
}

// One of two servers killed while a replay runs through the proxy: its conversations move to
// the other server and the run completes; the only failed turns are those in flight on it
// (and the rest of their trajectories, aborted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_mid_run_costs_only_its_turns_in_flight() {
    let Some((server, model)) = artefacts("a_server_killed_mid_run") else {
        return;
    };
    let mut doomed = Engine::start(&server, &model, 2).await;
    let survivor = Engine::start(&server, &model, 2).await;
    let config = support::capture::proxy_config(&[doomed.addr, survivor.addr]);
    let (stop, shutdown) = agentrace::shutdown::channel();
    let proxy = agentrace::proxy::start(config, shutdown).await.unwrap();
    let metrics_url = format!("http://{}/metrics", proxy.admin_addr);
    let replay = tokio::spawn({
        let target = format!("http://{}", proxy.addr);
        async move {
            let out = tempfile::tempdir().unwrap();
            agentrace::replay::run(
                replay_config(&target, 4),
                conversations(4, 15),
                out.path(),
                support::replay::no_shutdown(),
            )
            .await
            .unwrap()
        }
    });
    // Kill the first server once it has answered some turns.
    let client = support::capture::client();
    let doomed_name = "b0";
    loop {
        let req = http::Request::get(&metrics_url)
            .body(http_body_util::Full::new(bytes::Bytes::new()))
            .unwrap();
        let body = http_body_util::BodyExt::collect(client.request(req).await.unwrap().into_body())
            .await
            .unwrap()
            .to_bytes();
        let served: f64 = String::from_utf8_lossy(&body)
            .lines()
            .filter(|l| {
                l.starts_with("agentrace_upstream_latency_seconds_count")
                    && l.contains(&format!("backend=\"{doomed_name}\""))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        if served >= 8.0 || replay.is_finished() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    doomed.kill();
    let s = replay.await.unwrap();
    stop.fire();
    proxy.join().await;
    assert_eq!(s.turns_issued, 60, "{s:?}");
    // A request the server held when it died cannot be sent again (it may have been generating);
    // its trajectory then aborts, as the reference does. At most two were held: its two slots.
    let f = &s.failures_by_kind;
    assert_eq!(f.interrupted, 0, "{f:?}");
    let in_flight = f.http_status + f.transport + f.timeout + f.bad_response;
    assert!(
        in_flight <= 2,
        "failures beyond the two slots in flight: {f:?}"
    );
    // Every other failure is a later turn of one of those trajectories (14 at most each), so
    // the other trajectories of the four ran all their 15 turns.
    assert!(f.aborted <= 14 * in_flight, "{f:?}");
    assert_eq!(s.turns_ok + s.failures, 60, "{s:?}");
    assert!(s.turns_ok >= 15 * (4 - in_flight), "{s:?}");
}

/// The proxy's view of its backends, from its admin API.
async fn admin_backends(admin: std::net::SocketAddr) -> Value {
    let client = support::capture::client();
    let req = http::Request::get(format!("http://{admin}/admin/backends"))
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .unwrap()
        .to_bytes();
    serde_json::from_slice(&body).unwrap()
}

// Two servers with four slots each and eight conversations at once through the proxy: the
// proxy reads each server's KV cache size from its /props (context per slot × slots) before
// the first turn, and with it no turn of a session goes anywhere but where the session's
// earlier turns went, as the captured exchanges show.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_concurrency_8_the_kv_size_comes_from_props_and_no_session_moves() {
    const SLOTS: usize = 4;
    let Some((server, model)) = artefacts("at_concurrency_8_no_session_moves") else {
        return;
    };
    let engines = [
        Engine::start(&server, &model, SLOTS).await,
        Engine::start(&server, &model, SLOTS).await,
    ];
    let dir = tempfile::tempdir().unwrap();
    let capture = dir.path().join("capture");
    let mut config = support::capture::proxy_config(&[engines[0].addr, engines[1].addr]);
    config.capture = support::capture::config(&capture);
    config.health.interval_ms = 500;
    config.health.timeout_ms = 500;
    // A probe slowed by a loaded machine must not eject a server: moves are the subject here.
    config.health.unhealthy_threshold = 1_000;
    let (stop, shutdown) = agentrace::shutdown::channel();
    let proxy = agentrace::proxy::start(config, shutdown).await.unwrap();

    // Engine::start gives each slot 8192 tokens of context.
    let per_server = 8192 * SLOTS as u64;
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let view = admin_backends(proxy.admin_addr).await;
        let backends = view["backends"].as_array().unwrap();
        let known = backends.iter().all(|b| {
            b["kv_cache_tokens"] == per_server && b["kv_cache_source"] == "llama.cpp /props"
        });
        if known {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "after 20 s the proxy does not know the servers hold {per_server} tokens each: {view}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }

    let out = tempfile::tempdir().unwrap();
    let s = agentrace::replay::run(
        replay_config(&format!("http://{}", proxy.addr), 8),
        conversations(8, 8),
        out.path(),
        support::replay::no_shutdown(),
    )
    .await
    .unwrap();
    assert_eq!(
        (s.turns_ok, s.failures),
        (64, 0),
        "{:?}",
        failure_reasons(out.path())
    );
    stop.fire();
    proxy.join().await;

    let exchanges = support::capture::read_by_arrival(&capture).exchanges;
    assert_eq!(exchanges.len(), 64);
    let mut home = std::collections::HashMap::new();
    let mut moves = Vec::new();
    for e in &exchanges {
        let session = e
            .record
            .session
            .clone()
            .expect("the replayer names each session");
        let backend = e.record.backend.clone();
        if let Some(before) = home.insert(session.clone(), backend.clone()) {
            if before != backend {
                moves.push(format!("{session}: {before} -> {backend}"));
            }
        }
    }
    assert_eq!(home.len(), 8);
    assert!(moves.is_empty(), "sessions moved: {moves:?}");
}

/// Runs the binary in `dir`; panics with its stderr when it fails.
fn agentrace_in(dir: &std::path::Path, args: &[&str]) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_agentrace"))
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "agentrace {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Workflow conversations cut for the tiny model (system prompts to 1500 characters, no tool
/// schemas), every turn asking for `max_new` tokens: with `--ignore-eos` on the servers and
/// the simulated replicas cutting the longer recorded replies, outputs match in length.
fn short_workflow(dir: &std::path::Path, conversations: usize, max_new: u64) {
    agentrace_in(
        dir,
        &[
            "dataset",
            "synth",
            "--coding",
            "0",
            "--workflow",
            &conversations.to_string(),
            "--out",
            "raw.jsonl",
        ],
    );
    let raw = std::fs::read_to_string(dir.join("raw.jsonl")).unwrap();
    let mut out = String::new();
    for line in raw.lines() {
        let mut row: Value = serde_json::from_str(line).unwrap();
        let row_map = row.as_object_mut().unwrap();
        if let Some(Value::String(system)) = row_map.get_mut("system") {
            *system = system.chars().take(1500).collect();
        }
        row_map.remove("tools");
        if row_map.get("role") == Some(&Value::from("user")) {
            row_map.insert("max_new_tokens".into(), Value::from(max_new));
        }
        out.push_str(&row.to_string());
        out.push('\n');
    }
    std::fs::write(dir.join("ds.jsonl"), out).unwrap();
}

// The plan's prediction against reality, small: calibrate one llama-server, plan two replicas
// under session affinity at time scale 1, then replay the same dataset (same users, delays and
// salt) through the real proxy in front of two fresh servers. Held here, on a loaded 2-core
// machine: the prefix-cache hit (the replay's cached-token share on both sides) within 0.13
// (measured 0.07-0.11: llama-server re-renders the history through its chat template and
// keeps one cache per slot) and system tokens/s within 35 % (measured 14-22 %: the recorded
// think and tool times set the pace on both sides). TTFT and the per-user rate are not within
// any useful bound on the tiny model (the plan is 4-12x optimistic, see
// docs/src/sim/plan.md): only their direction is held, the plan never slower than reality.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_plan_predicts_a_real_two_replica_run_within_its_bounds() {
    use agentrace::proxy::config::Policy;
    let Some((server, model)) = artefacts("the_plan_predicts_a_real_run") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let conversations = 2;
    short_workflow(dir, conversations, 8);
    {
        let engine = Engine::start_with(&server, &model, 2, &["--ignore-eos"]).await;
        let url = engine.url();
        let dir = dir.to_path_buf();
        tokio::task::spawn_blocking(move || {
            agentrace_in(
                &dir,
                &[
                    "sim",
                    "calibrate",
                    "--target",
                    &url,
                    "--model",
                    "tiny",
                    "--max-prompt-tokens",
                    "1024",
                    "--out",
                    "profile.toml",
                ],
            )
        })
        .await
        .unwrap();
    }
    let plan_dir = dir.to_path_buf();
    tokio::task::spawn_blocking(move || {
        agentrace_in(
            &plan_dir,
            &[
                "plan",
                "--dataset",
                "ds.jsonl",
                "--profile",
                "profile.toml",
                "--replicas",
                "2",
                "--policies",
                "affinity",
                "--time-scale",
                "1",
                "--no-progress",
                "--out",
                "plan",
            ],
        )
    })
    .await
    .unwrap();
    let plan: Value =
        serde_json::from_slice(&std::fs::read(dir.join("plan/plan.json")).unwrap()).unwrap();
    let predicted = &plan["outcomes"][0];

    let engines = [
        Engine::start_with(&server, &model, 2, &["--ignore-eos"]).await,
        Engine::start_with(&server, &model, 2, &["--ignore-eos"]).await,
    ];
    let mut config = support::capture::proxy_config(&[engines[0].addr, engines[1].addr]);
    config.affinity.policy = Policy::Session;
    let (stop, shutdown) = agentrace::shutdown::channel();
    let proxy = agentrace::proxy::start(config, shutdown).await.unwrap();
    let out = dir.join("real");
    let ds = agentrace::dataset::load(
        &dir.join("ds.jsonl"),
        &agentrace::dataset::LoadOptions::default(),
    )
    .unwrap();
    let s = agentrace::replay::run(
        ReplayConfig {
            target: format!("http://{}", proxy.addr).into(),
            concurrency: conversations,
            enable_salt: true,
            inject_tool_delay: true,
            progress: false,
            model_params: Some(ModelParams {
                name: "tiny".into(),
                temperature: Some(0.0),
                ..Default::default()
            }),
            ..Default::default()
        },
        Arc::new(ds),
        &out,
        support::replay::no_shutdown(),
    )
    .await
    .unwrap();
    stop.fire();
    proxy.join().await;
    assert_eq!(s.failures, 0, "{:?}", failure_reasons(&out));
    let real = summary_json(&out);
    let real_hit = real["metrics"]["cached_token_ratio"].as_f64().unwrap();
    let pairs = [
        (
            "prefix-cache hit",
            predicted["prefix_cache_hit_rate"].as_f64().unwrap(),
            real_hit,
        ),
        (
            "system tokens/s",
            predicted["system_tps"].as_f64().unwrap(),
            s.system_tps,
        ),
        (
            "per-user tokens/s",
            predicted["interactivity"].as_f64().unwrap(),
            s.e2e_interactivity,
        ),
        (
            "TTFT p50 ms",
            predicted["ttft_p50_ms"].as_f64().unwrap(),
            s.ttft_p50_ms,
        ),
    ];
    let table: Vec<String> = pairs
        .iter()
        .map(|(name, p, r)| format!("{name}: plan {p:.3}, real {r:.3}"))
        .collect();
    eprintln!("{}", table.join("; "));
    let (_, p_hit, _) = pairs[0];
    assert!((p_hit - real_hit).abs() <= 0.13, "{table:?}");
    let (_, p_tps, r_tps) = pairs[1];
    assert!((p_tps / r_tps - 1.0).abs() <= 0.35, "{table:?}");
    let (_, p_user, r_user) = pairs[2];
    assert!(p_user >= r_user * 0.85, "{table:?}");
    let (_, p_ttft, r_ttft) = pairs[3];
    assert!(p_ttft <= r_ttft * 1.15, "{table:?}");
}
