//! The replayer's scheduling semantics against a real HTTP server of the test's own: the
//! reference acceptance list §20 items 10–17 and 21–28 (ordering, concurrency cap, slot reuse,
//! delays, timeouts and aborts, budget and repeats, routing headers, the performance window),
//! plus what agentrace adds (cancellation, warmup, clear errors, servers that close kept-alive
//! connections after each response). Timing assertions are
//! causal (this request arrived after that response ended), never tight wall-clock bounds.

mod support;

use std::time::Duration;

use agentrace::replay::{self, ReplayConfig, ReplayError};
use serde_json::Value;
use support::replay::{config, conversation, dataset, events, no_shutdown, start, Plan};

fn of_type<'a>(ev: &'a [Value], t: &str) -> Vec<&'a Value> {
    ev.iter().filter(|e| e["event_type"] == t).collect()
}

// §20.10/21/23: turn N+1 of a trajectory is sent only after turn N's response has ended, and a
// trajectory never has two requests in flight.
#[tokio::test]
async fn turns_of_a_trajectory_are_sequential_and_follow_completion() {
    let srv = start(|_| Plan {
        gap: Duration::from_millis(2),
        ..Default::default()
    })
    .await;
    let ds = dataset(vec![
        conversation("a", 4, &[], "ls"),
        conversation("b", 3, &[], "ls"),
        conversation("c", 2, &[], "ls"),
    ]);
    let out = tempfile::tempdir().unwrap();
    let s = replay::run(config(&srv.url(), 3), ds, out.path(), no_shutdown())
        .await
        .unwrap();
    assert_eq!(s.turns_ok, 9);
    let seen = srv.seen();
    assert_eq!(seen.len(), 9, "every client turn issued once");
    for sess in ["a", "b", "c"] {
        let reqs: Vec<_> = seen.iter().filter(|r| r.session == sess).collect();
        for w in reqs.windows(2) {
            assert_eq!(w[1].session_in_flight, 1, "{sess}: two requests in flight");
            let done = w[0].done_at.expect("previous response completed");
            assert!(w[1].at >= done, "{sess}: turn sent before previous ended");
        }
    }
    let ev = events(out.path());
    assert_eq!(of_type(&ev, "sample.issued").len(), 9);
    assert_eq!(of_type(&ev, "sample.recv_first").len(), 9);
    assert_eq!(of_type(&ev, "sample.complete").len(), 9);
    // Each sample's records are stamped issued <= recv_first <= complete.
    for c in of_type(&ev, "sample.complete") {
        let uuid = &c["sample_uuid"];
        let at = |t: &str| {
            ev.iter()
                .find(|e| e["event_type"] == t && &e["sample_uuid"] == uuid)
                .unwrap()["timestamp_ns"]
                .as_u64()
                .unwrap()
        };
        assert!(at("sample.issued") <= at("sample.recv_first"));
        assert!(at("sample.recv_first") <= at("sample.complete"));
        assert_eq!(c["worker_id"], 0);
        assert_eq!(c["finish_reason"], "stop");
        assert_eq!(
            c["data"],
            serde_json::json!(["TextModelOutput", ["Hello", " world"], null, null])
        );
    }
}

// §20.11/24: concurrency caps the active trajectories; at concurrency 1 the slot is reused, so
// conversation 1 ends before conversation 2 starts.
#[tokio::test]
async fn concurrency_caps_active_trajectories_and_slots_are_reused() {
    let srv = start(|_| Plan {
        gap: Duration::from_millis(1),
        ..Default::default()
    })
    .await;
    let convs = (0..20)
        .map(|i| conversation(&format!("c{i:02}"), 2, &[], "ls"))
        .collect();
    let out = tempfile::tempdir().unwrap();
    replay::run(
        config(&srv.url(), 4),
        dataset(convs),
        out.path(),
        no_shutdown(),
    )
    .await
    .unwrap();
    let seen = srv.seen();
    assert_eq!(seen.len(), 40);
    assert!(
        seen.iter().all(|r| r.in_flight <= 4),
        "more than 4 in flight"
    );
    assert!(seen.iter().any(|r| r.in_flight >= 2), "never concurrent");

    let srv = start(|_| Plan::default()).await;
    let out = tempfile::tempdir().unwrap();
    let ds = dataset(vec![
        conversation("one", 3, &[], "ls"),
        conversation("two", 2, &[], "ls"),
    ]);
    replay::run(config(&srv.url(), 1), ds, out.path(), no_shutdown())
        .await
        .unwrap();
    let order: Vec<String> = srv.seen().iter().map(|r| r.session.clone()).collect();
    assert_eq!(order, ["one", "one", "one", "two", "two"]);
}

// §20.12, §11: an HTTP error fails the turn (ERROR + COMPLETE null), every later turn of the
// trajectory gets a synthetic ISSUED (null prompt) + ERROR + COMPLETE without any request, and
// the slot moves on. Synthetic and failed turns stay out of the latency series.
#[tokio::test]
async fn failed_turn_aborts_the_rest_with_synthetic_records() {
    let srv = start(|r| Plan {
        status: if r.session == "bad" && r.nth_in_session == 2 {
            500
        } else {
            200
        },
        ..Default::default()
    })
    .await;
    let ds = dataset(vec![
        conversation("bad", 5, &[], "ls"),
        conversation("good", 2, &[], "ls"),
    ]);
    let out = tempfile::tempdir().unwrap();
    let s = replay::run(config(&srv.url(), 1), ds, out.path(), no_shutdown())
        .await
        .unwrap();
    let seen = srv.seen();
    assert_eq!(
        seen.iter().filter(|r| r.session == "bad").count(),
        2,
        "no request after failure"
    );
    assert_eq!(
        seen.iter().filter(|r| r.session == "good").count(),
        2,
        "slot refilled"
    );
    assert_eq!(s.failures_by_kind.http_status, 1);
    assert_eq!(s.failures_by_kind.aborted, 3);
    assert_eq!(s.turns_ok, 3);

    let ev = events(out.path());
    let errors = of_type(&ev, "error.generic");
    assert_eq!(errors.len(), 4);
    assert_eq!(errors[0]["turn"], 3);
    assert_eq!(
        errors[0]["data"],
        serde_json::json!([
            "ErrorData",
            "error",
            "HTTP 500: {\"error\": \"injected failure\"}"
        ])
    );
    for (e, turn) in errors[1..].iter().zip([5, 7, 9]) {
        assert_eq!(e["turn"], turn);
        assert_eq!(
            e["data"],
            serde_json::json!([
                "ErrorData",
                "TurnAbortedByPriorFailure",
                "prior turn errored: error"
            ])
        );
        let uuid = &e["sample_uuid"];
        let issued = ev
            .iter()
            .find(|x| x["event_type"] == "sample.issued" && &x["sample_uuid"] == uuid)
            .unwrap();
        assert_eq!(
            issued["data"],
            serde_json::json!(["PromptData", null, null, null, null, null, null, null])
        );
        let complete = ev
            .iter()
            .find(|x| x["event_type"] == "sample.complete" && &x["sample_uuid"] == uuid)
            .unwrap();
        assert_eq!(complete["data"], Value::Null);
        assert!(
            complete.get("worker_id").is_none(),
            "synthetic records carry no worker_id"
        );
    }
    let summary: Value =
        serde_json::from_slice(&std::fs::read(out.path().join("result_summary.json")).unwrap())
            .unwrap();
    assert_eq!(
        summary["latency"]["count"], 3,
        "only successful turns in latency"
    );
}

// §20.12/15, §21.1: a turn that outlives turn_timeout_s fails as TurnTimeout, the request is
// cancelled on the server (the connection is dropped), and the rest is aborted naming the query.
#[tokio::test]
async fn timeout_cancels_the_request_on_the_server_and_aborts_the_rest() {
    let srv = start(|r| Plan {
        hang: r.nth_in_session == 2,
        ..Default::default()
    })
    .await;
    let mut cfg = config(&srv.url(), 1);
    cfg.turn_timeout_s = 0.25;
    let out = tempfile::tempdir().unwrap();
    let s = replay::run(
        cfg,
        dataset(vec![conversation("slow", 4, &[], "ls")]),
        out.path(),
        no_shutdown(),
    )
    .await
    .unwrap();
    assert_eq!(s.failures_by_kind.timeout, 1);
    assert_eq!(s.failures_by_kind.aborted, 2);
    // The server notices the hang-up the next time it writes; wait for that, bounded.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while srv.cancelled.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "server never saw the cancel"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let ev = events(out.path());
    let errors = of_type(&ev, "error.generic");
    assert_eq!(
        errors[0]["data"],
        serde_json::json!(["ErrorData", "TurnTimeout", "turn timeout after 0.25s"])
    );
    let q = errors[0]["sample_uuid"].as_str().unwrap();
    assert_eq!(
        errors[1]["data"][2],
        format!("prior turn timed out (query={q})")
    );
}

// §20.15/27, §9: delays run end-to-start from the previous response's last byte; a delayed
// first turn is awaited from the trajectory's start; with delays off nothing waits.
#[tokio::test]
async fn delays_run_end_to_start_from_the_previous_last_byte() {
    let srv = start(|_| Plan {
        gap: Duration::from_millis(10),
        ..Default::default()
    })
    .await;
    let delays = [0.05, 0.2, 0.2];
    let mut cfg = config(&srv.url(), 1);
    cfg.inject_tool_delay = true;
    let out = tempfile::tempdir().unwrap();
    let begin = tokio::time::Instant::now();
    let s = replay::run(
        cfg,
        dataset(vec![conversation("d", 3, &delays, "ls")]),
        out.path(),
        no_shutdown(),
    )
    .await
    .unwrap();
    let seen = srv.seen();
    assert!(
        seen[0].at >= begin + Duration::from_millis(50),
        "first-turn delay not awaited"
    );
    for w in seen.windows(2) {
        let gap = w[1].at - w[0].done_at.unwrap();
        assert!(
            gap >= Duration::from_millis(200),
            "delay shorter than recorded: {gap:?}"
        );
    }
    assert!(s.schedule_lag_max_us.is_finite());

    // time_scale scales the delay; delays off issue immediately.
    let mut cfg = config(&srv.url(), 1);
    cfg.inject_tool_delay = false;
    let before = srv.seen().len();
    let out = tempfile::tempdir().unwrap();
    replay::run(
        cfg,
        dataset(vec![conversation("n", 3, &[5.0, 5.0, 5.0], "ls")]),
        out.path(),
        no_shutdown(),
    )
    .await
    .unwrap();
    assert_eq!(
        srv.seen().len() - before,
        3,
        "delays off: the 5 s delays were not waited"
    );
}

// §8, §20.22: the budget assigns instances round-robin in dataset order, repeats named
// `<id>__repeat_N`, and every configured routing header carries the logical id (§6, §20.19).
#[tokio::test]
async fn budget_repeats_round_robin_and_routing_headers_carry_the_logical_id() {
    let srv = start(|_| Plan::default()).await;
    let mut cfg = config(&srv.url(), 1);
    cfg.num_trajectories = Some(5);
    cfg.routing_headers = vec!["X-Session-ID".into(), "X-SMG-Routing-Key".into()];
    let out = tempfile::tempdir().unwrap();
    let ds = dataset(vec![
        conversation("a", 1, &[], "ls"),
        conversation("b", 1, &[], "ls"),
    ]);
    replay::run(cfg, ds.clone(), out.path(), no_shutdown())
        .await
        .unwrap();
    let seen = srv.seen();
    let ids: Vec<&str> = seen.iter().map(|r| r.session.as_str()).collect();
    assert_eq!(ids, ["a", "b", "a__repeat_2", "b__repeat_2", "a__repeat_3"]);
    for r in &seen {
        let names: Vec<&str> = r.headers.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            names,
            [
                "host",
                "content-type",
                "accept",
                "x-session-id",
                "x-smg-routing-key",
                "content-length"
            ],
            "header order as the reference"
        );
        let smg = r
            .headers
            .iter()
            .find(|(k, _)| k == "x-smg-routing-key")
            .unwrap();
        assert_eq!(smg.1, r.session);
    }
    let ev = events(out.path());
    let convs: Vec<&str> = of_type(&ev, "sample.issued")
        .iter()
        .map(|e| e["conversation_id"].as_str().unwrap())
        .collect();
    assert_eq!(convs, ids, "events carry the logical id");

    let srv = start(|_| Plan::default()).await;
    let mut cfg = config(&srv.url(), 1);
    cfg.routing_headers = vec![];
    let out = tempfile::tempdir().unwrap();
    replay::run(cfg, ds, out.path(), no_shutdown())
        .await
        .unwrap();
    assert!(
        srv.seen().iter().all(|r| r.session.is_empty()),
        "no routing header expected"
    );
}

// §20.17 (first case), §12: budget 2 at concurrency 2 and a 1-turn conv1: conv1's end stops
// tracking exactly once; conv2 continues to its last turn, outside the window. conv1's reply
// takes long enough that both first turns are issued before it ends, as in the reference,
// where the first wave is issued before any response is processed.
#[tokio::test]
async fn stop_tracking_when_the_first_slot_finds_no_trajectory_left() {
    let srv = start(|r| Plan {
        gap: if r.session == "conv2" {
            Duration::from_millis(120)
        } else {
            Duration::from_millis(60)
        },
        ..Default::default()
    })
    .await;
    let ds = dataset(vec![
        conversation("conv1", 1, &[], "ls"),
        conversation("conv2", 2, &[], "ls"),
    ]);
    let out = tempfile::tempdir().unwrap();
    let s = replay::run(config(&srv.url(), 2), ds, out.path(), no_shutdown())
        .await
        .unwrap();
    assert_eq!(srv.seen().len(), 3, "conv2 ran on to its turn 2");
    let ev = events(out.path());
    let stops = of_type(&ev, "session.stop_performance_tracking");
    assert_eq!(stops.len(), 1);
    let stop_ts = stops[0]["timestamp_ns"].as_u64().unwrap();
    let conv2_t2 = ev
        .iter()
        .find(|e| {
            e["event_type"] == "sample.issued" && e["conversation_id"] == "conv2" && e["turn"] == 3
        })
        .unwrap();
    assert!(conv2_t2["timestamp_ns"].as_u64().unwrap() > stop_ts);
    assert_eq!(s.turns_tracked, 2, "conv2's turn 2 is outside the window");
    let order: Vec<&str> = ev
        .iter()
        .filter(|e| e["event_type"].as_str().unwrap().starts_with("session."))
        .map(|e| e["event_type"].as_str().unwrap())
        .collect();
    assert_eq!(
        order,
        [
            "session.started",
            "session.start_performance_tracking",
            "session.stop_performance_tracking",
            "session.ended"
        ]
    );
}

// §20.17 (second case): with stop_issuing_on_first_user_complete, budget 3 at concurrency 2:
// conv1's end refills its slot with conv3; conv2's end stops tracking and issuing; conv3's
// pending delayed turn is cancelled and not counted as failed.
#[tokio::test]
async fn stop_issuing_refills_first_then_clears_active_trajectories() {
    let srv = start(|r| Plan {
        gap: if r.session == "conv2" {
            Duration::from_millis(40)
        } else {
            Duration::ZERO
        },
        ..Default::default()
    })
    .await;
    let ds = dataset(vec![
        conversation("conv1", 1, &[], "ls"),
        conversation("conv2", 1, &[], "ls"),
        conversation("conv3", 2, &[0.0, 30.0], "ls"),
    ]);
    let mut cfg = config(&srv.url(), 2);
    cfg.inject_tool_delay = true;
    cfg.stop_issuing_on_first_user_complete = true;
    cfg.num_trajectories = Some(3);
    let out = tempfile::tempdir().unwrap();
    let begin = tokio::time::Instant::now();
    let s = replay::run(cfg, ds, out.path(), no_shutdown())
        .await
        .unwrap();
    assert!(
        begin.elapsed() < Duration::from_secs(25),
        "the 30 s delay was not cancelled"
    );
    let sessions: std::collections::BTreeSet<String> =
        srv.seen().iter().map(|r| r.session.clone()).collect();
    assert_eq!(sessions.len(), 3, "3 trajectories issued");
    assert_eq!(
        srv.seen().iter().filter(|r| r.session == "conv3").count(),
        1
    );
    assert_eq!(s.failures, 0, "unissued turns are not failures");
    let ev = events(out.path());
    assert_eq!(of_type(&ev, "session.stop_performance_tracking").len(), 1);
    assert!(of_type(&ev, "error.generic").is_empty());
}

// §20.16/22/26/28, §5, §10: on the wire the system prompt carries the reference's two salts
// (repeat 2 → `ba75`), the messages array grows turn over turn, `tools` is in every payload,
// `delay_seconds` never is, and usage is requested. With `--log-prompts full` ISSUED records
// carry that same salted history; by default a compact reference with the body's hash.
#[tokio::test]
async fn salted_growing_history_with_tools_goes_on_the_wire() {
    let srv = start(|_| Plan::default()).await;
    let mut cfg = config(&srv.url(), 1);
    cfg.enable_salt = true;
    cfg.inject_tool_delay = true;
    cfg.time_scale = 0.01;
    cfg.num_trajectories = Some(2);
    cfg.log_prompts = replay::LogPrompts::Full;
    let out = tempfile::tempdir().unwrap();
    let ds = dataset(vec![conversation(
        "django__django-16899",
        3,
        &[0.0, 0.5, 0.5],
        "ls",
    )]);
    replay::run(cfg, ds.clone(), out.path(), no_shutdown())
        .await
        .unwrap();
    let seen = srv.seen();
    assert_eq!(seen.len(), 6);
    let bodies: Vec<Value> = seen
        .iter()
        .map(|r| serde_json::from_slice(&r.body).unwrap())
        .collect();
    for (i, b) in bodies.iter().enumerate() {
        let repeat_salt = if i < 3 { "4461" } else { "ba75" };
        assert_eq!(
            b["messages"][0]["content"],
            format!("[salt: {repeat_salt}]\n\nYou are a test.\n\n[salt: edc0]")
        );
        assert_eq!(
            b["messages"].as_array().unwrap().len(),
            [2, 4, 6][i % 3],
            "history grows"
        );
        assert!(b["tools"].is_array(), "tools in every payload");
        assert_eq!(b["stream"], true);
        assert_eq!(b["stream_options"]["include_usage"], true);
        let text = String::from_utf8_lossy(&seen[i].body).to_string();
        assert!(!text.contains("delay_seconds"));
    }
    let ev = events(out.path());
    let issued = of_type(&ev, "sample.issued");
    assert_eq!(
        issued[0]["data"][3][0]["content"],
        bodies[0]["messages"][0]["content"]
    );
    assert_eq!(issued[0]["data"][4], bodies[0]["tools"]);

    let srv = start(|_| Plan::default()).await;
    let mut cfg = config(&srv.url(), 1);
    cfg.enable_salt = true;
    let out = tempfile::tempdir().unwrap();
    replay::run(cfg, ds, out.path(), no_shutdown())
        .await
        .unwrap();
    let ev = events(out.path());
    let text = of_type(&ev, "sample.issued")[1]["data"][1]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        text.starts_with(
            "agentrace-compact source=django__django-16899 turn=3 messages=4 body_bytes="
        ),
        "{text}"
    );
    assert_eq!(of_type(&ev, "sample.issued")[1]["data"][3], Value::Null);
}

// Warmup (§21.6): warmup trajectories run first under their own ids, and nothing of them
// reaches events.jsonl or the metrics.
#[tokio::test]
async fn warmup_trajectories_run_first_and_are_excluded() {
    let srv = start(|_| Plan::default()).await;
    let mut cfg = config(&srv.url(), 1);
    cfg.warmup_trajectories = 2;
    let out = tempfile::tempdir().unwrap();
    let ds = dataset(vec![
        conversation("a", 2, &[], "ls"),
        conversation("b", 1, &[], "ls"),
    ]);
    let s = replay::run(cfg, ds, out.path(), no_shutdown())
        .await
        .unwrap();
    let ids: Vec<String> = srv.seen().iter().map(|r| r.session.clone()).collect();
    assert_eq!(
        ids,
        ["a__warmup_1", "a__warmup_1", "b__warmup_2", "a", "a", "b"]
    );
    assert_eq!(s.turns_issued, 3);
    let ev = events(out.path());
    assert!(ev
        .iter()
        .all(|e| !e["conversation_id"].as_str().unwrap().contains("warmup")));
}

// --log-chunks: one `sample.recv_non_first` per streamed delta after the first, stamped in
// order between RECV_FIRST and COMPLETE; without it, none.
#[tokio::test]
async fn log_chunks_records_every_later_chunk_in_time_order() {
    let srv = start(|_| Plan {
        content: vec!["a".into(), "b".into(), "c".into(), "d".into()],
        gap: Duration::from_millis(1),
        ..Default::default()
    })
    .await;
    for log_chunks in [false, true] {
        let mut cfg = config(&srv.url(), 1);
        cfg.log_chunks = log_chunks;
        let out = tempfile::tempdir().unwrap();
        replay::run(
            cfg,
            dataset(vec![conversation("a", 2, &[], "ls")]),
            out.path(),
            no_shutdown(),
        )
        .await
        .unwrap();
        let ev = events(out.path());
        let later = of_type(&ev, "sample.recv_non_first");
        assert_eq!(later.len(), if log_chunks { 6 } else { 0 });
        for c in of_type(&ev, "sample.complete") {
            let uuid = &c["sample_uuid"];
            let ts: Vec<u64> = ev
                .iter()
                .filter(|e| &e["sample_uuid"] == uuid)
                .map(|e| e["timestamp_ns"].as_u64().unwrap())
                .collect();
            assert!(
                ts.windows(2).all(|w| w[0] <= w[1]),
                "records of a sample out of time order"
            );
        }
    }
}

// Usage absent: token counts are estimated and labelled so in the summary and the report.
#[tokio::test]
async fn missing_usage_is_estimated_and_labelled() {
    let srv = start(|_| Plan {
        usage: false,
        ..Default::default()
    })
    .await;
    let out = tempfile::tempdir().unwrap();
    let s = replay::run(
        config(&srv.url(), 1),
        dataset(vec![conversation("a", 2, &[], "ls")]),
        out.path(),
        no_shutdown(),
    )
    .await
    .unwrap();
    assert!(s.tokens_estimated);
    let report = std::fs::read_to_string(out.path().join("report.txt")).unwrap();
    assert!(report.contains("(estimated)"), "{report}");
}

// Bad inputs give clear errors: an unreachable target, an invalid config (field and value
// named, `max_response_bytes` and `dataset_max_line_bytes` among them), unknown TOML keys,
// an invalid routing header name.
#[tokio::test]
async fn bad_inputs_give_errors_that_name_the_problem() {
    let (_refusing, dead) = support::refusing_address();
    let out = tempfile::tempdir().unwrap();
    let err = replay::run(
        config(&dead, 1),
        dataset(vec![conversation("a", 1, &[], "ls")]),
        out.path(),
        no_shutdown(),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, ReplayError::Unreachable { .. }), "{err}");
    assert!(err.to_string().contains("unreachable"), "{err}");

    let mut cfg = config("http://127.0.0.1:9", 0);
    let msg = cfg.validate().unwrap_err().to_string();
    assert_eq!(msg, "concurrency: must be >= 1, got 0");
    cfg.concurrency = 1;
    cfg.routing_headers = vec!["bad header".into()];
    let msg = cfg.validate().unwrap_err().to_string();
    assert!(
        msg.starts_with("routing_headers:") && msg.contains("bad header"),
        "{msg}"
    );
    cfg.routing_headers = vec![];
    cfg.turn_timeout_s = 0.0;
    assert_eq!(
        cfg.validate().unwrap_err().to_string(),
        "turn_timeout_s: must be > 0, got 0"
    );
    cfg.turn_timeout_s = 1.0;
    cfg.max_response_bytes = 100;
    assert_eq!(
        cfg.validate().unwrap_err().to_string(),
        "max_response_bytes: must be >= 4096, got 100"
    );
    cfg.max_response_bytes = 1 << 20;
    cfg.dataset_max_line_bytes = 10;
    assert_eq!(
        cfg.validate().unwrap_err().to_string(),
        "dataset_max_line_bytes: must be >= 1024, got 10"
    );

    let msg = ReplayConfig::from_toml("target = \"http://x\"\nconcurrencyy = 3\n")
        .unwrap_err()
        .to_string();
    assert!(msg.contains("concurrencyy"), "{msg}");

    // Salting needs a system prompt in every conversation (reference §10 pre-flight).
    let srv = start(|_| Plan::default()).await;
    let mut conv = conversation("nosys", 1, &[], "ls");
    conv.messages.remove(0);
    conv.client_turns[0].history_len -= 1;
    let mut cfg = config(&srv.url(), 1);
    cfg.enable_salt = true;
    let err = replay::run(cfg, dataset(vec![conv]), out.path(), no_shutdown())
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("requires a system prompt")
            && err.contains("nosys")
            && err.contains("--salt false"),
        "{err}"
    );
    assert!(
        srv.seen().is_empty(),
        "nothing sent before the pre-flight passed"
    );
}

// Every shipped config parses and validates (the API key variable aside).
#[test]
fn shipped_configs_parse_and_validate() {
    for name in ["replay-qwen.toml", "replay-kimi.toml"] {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("config")
            .join(name);
        let mut cfg = ReplayConfig::from_file(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
        cfg.target = "http://backend.invalid:8000".into();
        cfg.api_key_env = None;
        cfg.validate().unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(cfg.gates().is_some(), "{name}: gates from the preset");
        assert!(
            cfg.enable_salt && cfg.inject_tool_delay && !cfg.stop_issuing_on_first_user_complete
        );
        // The official configs claim the official budget rule: a multiple of the file's count.
        assert!(cfg.official_rules, "{name}");
        assert_eq!(
            cfg.check_budget(613).unwrap(),
            613,
            "one pass over the 613-set"
        );
        cfg.num_trajectories = Some(16);
        let e = cfg.check_budget(990).unwrap_err().to_string();
        assert!(
            e.starts_with("num_trajectories:") && e.contains("990"),
            "{e}"
        );
        cfg.num_trajectories = Some(1980);
        assert_eq!(cfg.check_budget(990).unwrap(), 1980);
        assert!(cfg.budget_rule(990).starts_with("official"));
        cfg.official_rules = false;
        cfg.num_trajectories = Some(16);
        assert_eq!(cfg.check_budget(990).unwrap(), 16, "no claim, no rule");
    }
}

/// `payload` as one HTTP/1.1 chunk.
fn chunk(payload: &str) -> Vec<u8> {
    format!("{:x}\r\n{payload}\r\n", payload.len()).into_bytes()
}

// A server that advertises keep-alive but closes each connection after one streamed response
// (as llama-server does): the replayer's next turn, sent at once on that connection, goes
// again on a new one; no turn fails and the trajectory is not aborted.
#[tokio::test]
async fn a_kept_alive_connection_the_server_closed_never_fails_a_turn() {
    use support::raw_http1::{After, RawBackend};
    let head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\
        Keep-Alive: timeout=5, max=100\r\nTransfer-Encoding: chunked\r\n\r\n"
        .to_vec();
    let events = [
        chunk("data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"ok\"},\"finish_reason\":null}]}\n\n"),
        chunk("data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":1}}\n\n"),
        chunk("data: [DONE]\n\n"),
        b"0\r\n\r\n".to_vec(),
    ];
    let mut reply: Vec<&[u8]> = vec![&head];
    reply.extend(events.iter().map(Vec::as_slice));
    let backend = RawBackend::spawn(&reply, After::DropTheNext).await;
    let out = tempfile::tempdir().unwrap();
    let s = replay::run(
        config(&backend.url(), 1),
        dataset(vec![conversation("closing", 20, &[], "ls")]),
        out.path(),
        no_shutdown(),
    )
    .await
    .unwrap();
    assert_eq!((s.turns_ok, s.failures), (20, 0), "{s:?}");
    assert_eq!(backend.answered(), 20);
    assert!(backend.accepted() >= 20, "one connection per answered turn");
}
