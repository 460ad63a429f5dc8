//! Invariants of the simulated engine seen through real HTTP: prefix caching, eviction,
//! batching, preemption, time scaling, determinism, the ground-truth log and what session
//! affinity is worth. Every test runs on paused tokio time, so simulated milliseconds cost
//! no wall-clock time and results are exact.

mod support;

use std::time::Duration;

use serde_json::{json, Value};
use support::sim::*;

fn pod_chat(messages: Value, max_tokens: u64) -> Value {
    let mut b = stream_body(messages, max_tokens);
    b["ignore_eos"] = json!(true);
    b
}

/// Prefix caching: a request that repeats a long prefix reports it in `cached_tokens` and
/// gets its first token many times sooner, because cached tokens cost no prefill.
#[tokio::test(start_paused = true)]
async fn repeated_long_prefix_is_cached_and_first_token_comes_much_sooner() {
    let sim = Sim::start(test_config(), 1);
    let first = long_messages("cache", 8_000);
    let cold = chat(sim.addr(0), &stream_body(first.clone(), 4)).await;
    let mut next = first.as_array().unwrap().clone();
    next.push(json!({"role": "assistant", "content": "I will look."}));
    next.push(json!({"role": "user", "content": "Go on."}));
    let warm = chat(sim.addr(0), &stream_body(Value::Array(next), 4)).await;
    assert_eq!((cold.status, warm.status), (200, 200));
    assert_eq!(cold.cached_tokens(), 0);
    let prompt = cold.usage()["prompt_tokens"].as_u64().unwrap();
    assert!(
        warm.cached_tokens() > prompt * 9 / 10,
        "cached {} of {prompt}",
        warm.cached_tokens()
    );
    assert_eq!(warm.cached_tokens() % 16, 0, "hits are whole blocks");
    assert!(
        warm.ttft() * 5 < cold.ttft(),
        "warm {:?} vs cold {:?}",
        warm.ttft(),
        cold.ttft()
    );
    let stats = &sim.cluster.stats()[0];
    assert_eq!(stats.prefix_cache_hits, warm.cached_tokens());
    sim.stop().await;
}

/// Eviction: with a KV pool smaller than the traffic, an old prefix is evicted (LRU) and no
/// longer hits; with a large pool the same sequence hits.
#[tokio::test(start_paused = true)]
async fn small_capacity_evicts_old_prefixes_large_capacity_keeps_them() {
    async fn revisit_after_others(blocks: usize) -> u64 {
        let mut cfg = test_config();
        cfg.engine.num_gpu_blocks = blocks;
        let sim = Sim::start(cfg, 1);
        for tag in ["a", "b", "c", "d"] {
            let r = chat(sim.addr(0), &stream_body(long_messages(tag, 500), 4)).await;
            assert_eq!(r.status, 200);
        }
        let again = chat(sim.addr(0), &stream_body(long_messages("a", 500), 4)).await;
        sim.stop().await;
        again.cached_tokens()
    }
    // Only the first block, the system prompt all five requests share, survives.
    assert_eq!(revisit_after_others(64).await, 16);
    assert!(revisit_after_others(5_000).await >= 480);
}

/// Batching: the decode step grows with the batch (more experts activated, more KV read),
/// so tokens come further apart when 32 requests decode together than when one does alone.
#[tokio::test(start_paused = true)]
async fn inter_token_latency_grows_with_batch_size() {
    fn mean_gap(r: &Reply) -> Duration {
        let t = &r.frame_times;
        (t[t.len() - 3] - t[3]) / (t.len() as u32 - 6)
    }
    let sim = Sim::start(test_config(), 1);
    let alone = chat(sim.addr(0), &pod_chat(long_messages("solo", 200), 64)).await;
    let addr = sim.addr(0);
    let tasks: Vec<_> = (0..32)
        .map(|i| {
            tokio::spawn(async move {
                chat(addr, &pod_chat(long_messages(&format!("b{i}"), 200), 64)).await
            })
        })
        .collect();
    let mut batched = Vec::new();
    for t in tasks {
        batched.push(t.await.unwrap());
    }
    let single = mean_gap(&alone);
    let crowded = mean_gap(&batched[16]);
    assert!(
        crowded > single * 2,
        "batched ITL {crowded:?} vs alone {single:?}"
    );
    assert!(batched.iter().all(|r| r.usage()["completion_tokens"] == 64));
    sim.stop().await;
}

/// Chunked prefill: a long prompt is prefilled a token budget at a time alongside running
/// decodes, so a decoding request never stalls for a whole long prefill.
#[tokio::test(start_paused = true)]
async fn long_prefill_is_chunked_and_does_not_stall_running_decodes() {
    let sim = Sim::start(test_config(), 1);
    let addr = sim.addr(0);
    let decoding =
        tokio::spawn(async move { chat(addr, &pod_chat(long_messages("short", 100), 400)).await });
    let long =
        tokio::spawn(
            async move { chat(addr, &stream_body(long_messages("long", 32_000), 4)).await },
        );
    let (decoding, long) = (decoding.await.unwrap(), long.await.unwrap());
    let gaps = decoding.frame_times.windows(2).map(|w| w[1] - w[0]);
    let worst = gaps.max().unwrap();
    assert!(
        long.ttft() > Duration::from_secs(1),
        "a 32 K prefill takes over a second: {:?}",
        long.ttft()
    );
    assert!(
        worst * 2 < long.ttft(),
        "decode stalled {worst:?} during a {:?} prefill",
        long.ttft()
    );
    assert!(
        worst > Duration::from_millis(100),
        "the decode did share steps with prefill chunks"
    );
    sim.stop().await;
}

/// Preemption: when growing sequences exhaust the KV pool, the newest is preempted and
/// recomputed later; every request still completes with its full output.
#[tokio::test(start_paused = true)]
async fn kv_exhaustion_preempts_and_every_request_still_completes() {
    let mut cfg = test_config();
    cfg.engine.num_gpu_blocks = 24;
    let sim = Sim::start(cfg, 1);
    let addr = sim.addr(0);
    let tasks: Vec<_> = (0..4)
        .map(|i| {
            tokio::spawn(async move {
                chat(addr, &pod_chat(long_messages(&format!("p{i}"), 40), 200)).await
            })
        })
        .collect();
    for t in tasks {
        let r = t.await.unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(r.usage()["completion_tokens"], 200);
        assert_eq!(r.events().last().unwrap(), "[DONE]");
    }
    let stats = &sim.cluster.stats()[0];
    assert!(stats.preemptions > 0, "{stats:?}");
    let metrics = String::from_utf8(get(addr, "/metrics").await.body()).unwrap();
    assert_eq!(
        metric(&metrics, "vllm:num_preemptions_total"),
        stats.preemptions as f64
    );
    assert_eq!(metric(&metrics, "vllm:kv_cache_usage_perc"), 0.0);
    sim.stop().await;
}

/// `time_scale`: at 0.01 the same work takes a hundredth of the time on the (tokio) clock,
/// while reported durations stay in simulated time.
#[tokio::test(start_paused = true)]
async fn time_scale_speeds_up_real_time_but_reports_simulated_time() {
    async fn run(scale: f64) -> (Duration, f64) {
        let mut cfg = test_config();
        cfg.time_scale = scale;
        let sim = Sim::start(cfg, 1);
        let r = chat(sim.addr(0), &stream_body(long_messages("scale", 8_000), 4)).await;
        let stats = sim.cluster.stats().remove(0);
        sim.stop().await;
        (r.ttft(), stats.ttft_seconds_sum)
    }
    let (real_slow, sim_slow) = run(1.0).await;
    let (real_fast, sim_fast) = run(0.01).await;
    assert!((0.2..0.26).contains(&sim_slow), "simulated TTFT {sim_slow}");
    assert!(
        (sim_fast - sim_slow).abs() < 1e-6,
        "{sim_fast} vs {sim_slow}"
    );
    assert!(real_fast * 20 < real_slow, "{real_fast:?} vs {real_slow:?}");
}

/// Determinism: the same workload on paused time gives byte-identical responses and
/// counters, and a request's answer does not depend on when it arrives.
#[tokio::test(start_paused = true)]
async fn same_workload_gives_identical_results_and_answers_do_not_depend_on_order() {
    async fn workload(reverse: bool) -> (Vec<Vec<u8>>, String) {
        let sim = Sim::start(test_config(), 2);
        let addrs = sim.cluster.addrs();
        let mut order: Vec<usize> = (0..6).collect();
        if reverse {
            order.reverse();
        }
        let tasks: Vec<_> = order
            .into_iter()
            .map(|i| {
                let addr = addrs[i % 2];
                tokio::spawn(async move {
                    let mut bodies = Vec::new();
                    let mut msgs = long_messages(&format!("d{i}"), 300 + 50 * i)
                        .as_array()
                        .unwrap()
                        .clone();
                    for turn in 0..3 {
                        let r =
                            chat(addr, &json!({"messages": msgs, "stream": turn % 2 == 0})).await;
                        bodies.push(r.body());
                        msgs.push(json!({"role": "assistant", "content": "ok"}));
                        msgs.push(json!({"role": "user", "content": format!("turn {turn}")}));
                    }
                    (i, bodies)
                })
            })
            .collect();
        let mut results = Vec::new();
        for t in tasks {
            results.push(t.await.unwrap());
        }
        results.sort_by_key(|(i, _)| *i);
        let stats = format!("{:?}", sim.cluster.stats());
        sim.stop().await;
        (results.into_iter().flat_map(|(_, b)| b).collect(), stats)
    }
    let a = workload(false).await;
    let b = workload(false).await;
    assert_eq!(a, b);
    let reversed = workload(true).await;
    let text = |body: &[u8]| -> String {
        sse_events(body)
            .iter()
            .filter_map(|e| serde_json::from_str::<Value>(e).ok())
            .filter_map(|e| {
                e["choices"][0]["delta"]["content"]
                    .as_str()
                    .map(str::to_string)
            })
            .collect()
    };
    for (x, y) in a.0.iter().zip(&reversed.0) {
        if x.starts_with(b"data:") {
            assert_eq!(text(x), text(y));
        } else {
            let (x, y): (Value, Value) = (
                serde_json::from_slice(x).unwrap(),
                serde_json::from_slice(y).unwrap(),
            );
            assert_eq!(x["choices"], y["choices"]);
        }
    }
}

/// Ground-truth log: one line per request with the timings and token counts the server
/// really used, consistent with the usage it reported.
#[tokio::test(start_paused = true)]
async fn trace_log_has_one_consistent_line_per_request() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trace.jsonl");
    let mut cfg = test_config();
    cfg.trace_log = Some(path.clone());
    let sim = Sim::start(cfg, 1);
    let mut usages = Vec::new();
    for i in 0..3 {
        let r = request(
            sim.addr(0),
            "POST",
            "/v1/chat/completions",
            serde_json::to_vec(&stream_body(long_messages("log", 1000 + i), 8)).unwrap(),
            &[("x-session-id", "s-1")],
        )
        .await;
        usages.push(r.usage());
    }
    sim.stop().await;
    let lines: Vec<Value> = std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3);
    for (line, usage) in lines.iter().zip(&usages) {
        assert_eq!(line["session"], "s-1");
        assert_eq!(line["replica"], "sim-0");
        assert_eq!(line["prompt_tokens"], usage["prompt_tokens"]);
        assert_eq!(
            line["cached_tokens"],
            usage["prompt_tokens_details"]["cached_tokens"]
        );
        assert_eq!(line["output_tokens"], usage["completion_tokens"]);
        let t = |k: &str| line[k].as_f64().unwrap();
        assert!(t("arrival_s") <= t("scheduled_s") && t("scheduled_s") < t("first_token_s"));
        assert!(t("first_token_s") <= t("finish_s") && t("queue_wait_s") >= 0.0);
    }
    assert!(lines[1]["cached_tokens"].as_u64().unwrap() > 0);
}

/// What affinity is worth (simulated-backend doc §12): sessions pinned to one replica keep
/// their prefixes cached; spreading each session's turns over the replicas thrashes a KV
/// pool that cannot hold every session, which costs hit rate and TTFT.
#[tokio::test(start_paused = true)]
async fn pinned_sessions_hit_the_prefix_cache_round_robin_thrashes() {
    async fn replay(pinned: bool) -> (f64, f64) {
        let mut cfg = test_config();
        cfg.engine.num_gpu_blocks = 2_000;
        let sim = Sim::start(cfg, 4);
        let addrs = sim.cluster.addrs();
        let tasks: Vec<_> = (0..8)
            .map(|s| {
                let addrs = addrs.clone();
                tokio::spawn(async move {
                    let mut msgs = long_messages(&format!("session-{s}"), 3_000)
                        .as_array()
                        .unwrap()
                        .clone();
                    let mut ttft = Vec::new();
                    for turn in 0..10 {
                        let replica = if pinned { s % 4 } else { (s + turn) % 4 };
                        let r = chat(addrs[replica], &stream_body(Value::Array(msgs.clone()), 16))
                            .await;
                        assert_eq!(r.status, 200);
                        ttft.push(r.ttft());
                        msgs.push(
                            json!({"role": "assistant", "content": format!("step {turn} done")}),
                        );
                        let out = long_messages(&format!("s{s}t{turn}"), 600)[1]["content"].clone();
                        msgs.push(json!({"role": "tool", "content": out, "tool_call_id": "c"}));
                    }
                    ttft
                })
            })
            .collect();
        let mut ttfts = Vec::new();
        for t in tasks {
            ttfts.extend(t.await.unwrap());
        }
        let stats = sim.cluster.stats();
        sim.stop().await;
        let hits: u64 = stats.iter().map(|s| s.prefix_cache_hits).sum();
        let queries: u64 = stats.iter().map(|s| s.prefix_cache_queries).sum();
        let mean_ttft = ttfts.iter().map(Duration::as_secs_f64).sum::<f64>() / ttfts.len() as f64;
        (hits as f64 / queries as f64, mean_ttft)
    }
    let (pinned_hit, pinned_ttft) = replay(true).await;
    let (rr_hit, rr_ttft) = replay(false).await;
    assert!(pinned_hit >= 0.85, "pinned hit rate {pinned_hit}");
    assert!(rr_hit <= 0.6, "round-robin hit rate {rr_hit}");
    assert!(
        rr_ttft >= 2.0 * pinned_ttft,
        "TTFT {rr_ttft} vs {pinned_ttft}"
    );
}
