//! Where sessions go, through a real proxy in front of a simulated cluster.
//!
//! Invariants: when hashing piles sessions onto one replica (hash luck), starting each new
//! session where the least active context is held keeps their prefixes cached, by a clear
//! margin in prefix-cache hit rate over plain rendezvous hashing on the same keys and traffic;
//! and when sessions that started together outgrow their replica, moving each whose cache the
//! replica evicted (as the usage in its responses tells) to where less is held wins back a
//! clear margin too.

mod support;

use agentrace::proxy::config::ProxyConfig;
use serde_json::{json, Value};
use support::backends::{client, fetch, start_proxy, HttpClient, TestProxy};
use support::sim::{test_config, Sim};

const REPLICAS: usize = 4;
const SESSIONS: usize = 8;
/// Pseudo-tokens each user message adds (4 bytes each, as the simulator counts).
const TURN_TOKENS: usize = 300;

fn proxy_config(sim: &Sim, affinity: &str) -> ProxyConfig {
    let mut toml = format!(
        "listen = \"127.0.0.1:0\"\n[admin]\nlisten = \"127.0.0.1:0\"\n[health]\ninterval_ms = 0\n[affinity]\n{affinity}\n"
    );
    for i in 0..REPLICAS {
        toml.push_str(&format!(
            "[[backends]]\nname = \"replica-{i}\"\nurl = \"http://{}\"\n",
            sim.addr(i)
        ));
    }
    ProxyConfig::from_toml_str(&toml).unwrap()
}

/// Session keys whose first rendezvous choice is `replica-0`, as the proxy's admin API ranks them.
async fn keys_homed_on_one_replica(client: &HttpClient, proxy: &TestProxy) -> Vec<String> {
    let mut keys = Vec::new();
    for i in 0.. {
        let key = format!("agent-{i}");
        let (status, _, body) = fetch(
            client,
            "GET",
            &proxy.admin_url(&format!("/admin/sessions/{key}")),
            &[],
            "",
        )
        .await;
        assert_eq!(status, 200);
        let view: Value = serde_json::from_slice(&body).unwrap();
        if view["rendezvous_order"][0] == "replica-0" {
            keys.push(key);
            if keys.len() == SESSIONS {
                return keys;
            }
        }
    }
    unreachable!()
}

/// A user message of `TURN_TOKENS` pseudo-tokens, distinct per session and turn.
fn user_text(session: usize, turn: usize) -> String {
    (0..TURN_TOKENS)
        .map(|i| format!("{:04}", (i * 7919 + session * 104_729 + turn * 31) % 10_000))
        .collect()
}

/// Runs every session for `turns` turns, interleaved (turn 1 of all, then turn 2, ...), and
/// returns the share of prompt tokens the replicas served from their prefix caches.
async fn cached_share(affinity: &str, turns: usize) -> f64 {
    let mut config = test_config();
    config.time_scale = 0.001;
    // 3,200 tokens each: two sessions' full contexts fit, eight do not.
    config.engine.num_gpu_blocks = 200;
    let sim = Sim::start(config, REPLICAS);
    let proxy = start_proxy(proxy_config(&sim, affinity)).await;
    let client = client();
    let keys = keys_homed_on_one_replica(&client, &proxy).await;
    let mut conversations: Vec<Vec<Value>> = (0..SESSIONS)
        .map(|_| vec![json!({"role": "system", "content": "You are a coding agent."})])
        .collect();
    let (mut prompt, mut cached) = (0u64, 0u64);
    for turn in 0..turns {
        for (s, key) in keys.iter().enumerate() {
            let messages = &mut conversations[s];
            messages.push(json!({"role": "user", "content": user_text(s, turn)}));
            let body = json!({"model": "m", "messages": messages, "max_tokens": 8});
            let (status, _, reply) = fetch(
                &client,
                "POST",
                &proxy.url("/v1/chat/completions"),
                &[("x-session-id", key), ("content-type", "application/json")],
                serde_json::to_vec(&body).unwrap(),
            )
            .await;
            assert_eq!(status, 200, "{}", String::from_utf8_lossy(&reply));
            let reply: Value = serde_json::from_slice(&reply).unwrap();
            let usage = &reply["usage"];
            prompt += usage["prompt_tokens"].as_u64().unwrap();
            cached += usage["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0);
            let answer = reply["choices"][0]["message"]["content"].clone();
            messages.push(json!({"role": "assistant", "content": answer}));
        }
    }
    proxy.shutdown().await;
    sim.stop().await;
    cached as f64 / prompt as f64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_sessions_start_where_context_is_light_and_stay_cached() {
    let hashed = cached_share("context_factor = 0\nchoices = 1\nlost_cache_share = 0", 4).await;
    let placed = cached_share("lost_cache_share = 0", 4).await;
    println!("cached share of prompt tokens: plain hashing {hashed:.3}, placement {placed:.3}");
    assert!(
        placed >= hashed + 0.25,
        "placement {placed:.3} should beat plain hashing {hashed:.3} by 0.25"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_whose_cache_was_evicted_move_where_less_is_held() {
    // Every session starts on the same replica (plain hashing, keys homed there): by the
    // second turn their contexts outgrow it and it evicts them in turn.
    let stay = cached_share("context_factor = 0\nchoices = 1\nlost_cache_share = 0", 6).await;
    let moved = cached_share("context_factor = 0\nchoices = 1\nlost_cache_share = 0.5", 6).await;
    println!("cached share of prompt tokens: staying {stay:.3}, moving lost caches {moved:.3}");
    assert!(
        moved >= stay + 0.2,
        "moving lost caches {moved:.3} should beat staying {stay:.3} by 0.2"
    );
}

/// Bounded load needs each backend's KV cache size: the proxy reads it from every replica's
/// `/metrics` (`vllm:cache_config_info`, blocks × block size) after a good health probe, and
/// shows it per backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_backends_kv_cache_size_is_read_from_its_metrics() {
    let mut config = test_config();
    config.engine.num_gpu_blocks = 200;
    let tokens = (config.engine.num_gpu_blocks * config.engine.block_size) as u64;
    let sim = Sim::start(config, REPLICAS);
    let mut proxy_config = proxy_config(&sim, "");
    proxy_config.health.interval_ms = 200;
    proxy_config.health.timeout_ms = 200;
    let proxy = start_proxy(proxy_config).await;
    let client = client();
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let (status, _, body) =
            fetch(&client, "GET", &proxy.admin_url("/admin/backends"), &[], "").await;
        assert_eq!(status, 200);
        let view: Value = serde_json::from_slice(&body).unwrap();
        let sizes: Vec<u64> = view["backends"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["kv_cache_tokens"].as_u64().unwrap())
            .collect();
        if sizes.iter().all(|&s| s == tokens) {
            break;
        }
        assert!(
            sizes.iter().all(|&s| s == 0 || s == tokens),
            "read {sizes:?}, the replicas hold {tokens} tokens each"
        );
        assert!(
            tokio::time::Instant::now() < deadline,
            "after 10 s the proxy knows {sizes:?} of {tokens} tokens each"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    proxy.shutdown().await;
    sim.stop().await;
}
