//! Session affinity through real proxies and real backends on 127.0.0.1:0.
//!
//! Invariants: a key always reaches the same backend; two proxies with the same backend list
//! agree on every key without talking; removing a backend (reload) moves only its keys; a
//! conversation without a session header sticks by its fingerprint; a session spilled by the
//! load bound stays on its new backend; `round_robin` (affinity off) scatters a session.

mod support;

use std::collections::HashMap;
use std::time::Duration;

use support::backends::*;

async fn four_backends() -> Vec<TestBackend> {
    let mut v = Vec::new();
    for i in 0..4 {
        v.push(TestBackend::spawn(&format!("gpu-{i}")).await);
    }
    v
}

async fn placement(client: &HttpClient, proxy: &TestProxy, key: &str) -> String {
    let (status, headers, body) = fetch(
        client,
        "POST",
        &proxy.url("/v1/chat/completions"),
        &[("x-session-id", key), ("content-type", "application/json")],
        chat_body(key, 0),
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let header = served_by(&headers);
    assert_eq!(
        json["backend"],
        header.as_str(),
        "the header names the backend that answered"
    );
    header
}

async fn admin_json(client: &HttpClient, proxy: &TestProxy, path: &str) -> serde_json::Value {
    let (status, _, body) = fetch(client, "GET", &proxy.admin_url(path), &[], "").await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    serde_json::from_slice(&body).unwrap()
}

/// Every request of a session reaches the backend its first request reached.
#[tokio::test]
async fn same_key_always_reaches_the_same_backend() {
    let backends = four_backends().await;
    let proxy = start_proxy(config_for(&backends.iter().collect::<Vec<_>>())).await;
    let client = client();
    let mut used = HashMap::new();
    for i in 0..40 {
        let key = format!("session-{i}");
        let first = placement(&client, &proxy, &key).await;
        for _ in 0..3 {
            assert_eq!(placement(&client, &proxy, &key).await, first, "{key}");
        }
        *used.entry(first).or_insert(0) += 1;
    }
    assert!(
        used.len() >= 3,
        "40 sessions should use most backends: {used:?}"
    );
    proxy.shutdown().await;
}

/// Two independent proxies with the same backend list send 1,000 keys to the same backends.
#[tokio::test]
async fn two_proxies_agree_on_every_key() {
    let backends = four_backends().await;
    let refs: Vec<_> = backends.iter().collect();
    let a = start_proxy(config_for(&refs)).await;
    // The second proxy lists the backends in another order: placement depends on names only.
    let mut reversed = refs.clone();
    reversed.reverse();
    let b = start_proxy(config_for(&reversed)).await;
    let client = client();
    let mut counts: HashMap<String, usize> = HashMap::new();
    for i in 0..1000 {
        let key = format!("agent-{i:04}");
        let (x, y) = (
            placement(&client, &a, &key).await,
            placement(&client, &b, &key).await,
        );
        assert_eq!(x, y, "proxies disagree on {key}");
        *counts.entry(x).or_default() += 1;
    }
    for (name, n) in &counts {
        assert!(
            (150..=350).contains(n),
            "{name} got {n} of 1000: {counts:?}"
        );
    }
    a.shutdown().await;
    b.shutdown().await;
}

/// Reloading without one backend moves exactly the sessions it held; the others stay put.
#[tokio::test]
async fn removing_a_backend_moves_only_its_keys() {
    let backends = four_backends().await;
    let refs: Vec<_> = backends.iter().collect();
    let proxy = start_proxy(config_for(&refs)).await;
    let client = client();
    let keys: Vec<String> = (0..200).map(|i| format!("k{i}")).collect();
    let mut before = Vec::new();
    for k in &keys {
        before.push(placement(&client, &proxy, k).await);
    }
    let survivors: Vec<_> = refs
        .iter()
        .copied()
        .filter(|b| b.name() != "gpu-2")
        .collect();
    proxy.handle().reload(config_for(&survivors)).unwrap();
    assert_eq!(proxy.handle().backend_names(), ["gpu-0", "gpu-1", "gpu-3"]);
    let mut moved_to: HashMap<String, usize> = HashMap::new();
    for (k, was) in keys.iter().zip(&before) {
        let now = placement(&client, &proxy, k).await;
        if was == "gpu-2" {
            *moved_to.entry(now).or_default() += 1;
        } else {
            assert_eq!(&now, was, "{k} moved although its backend stayed");
        }
    }
    assert!(moved_to.len() >= 2, "gpu-2's sessions spread: {moved_to:?}");
    proxy.shutdown().await;
}

/// Without any session header, every turn of a conversation reaches one backend.
#[tokio::test]
async fn fingerprint_keeps_a_conversation_on_one_backend() {
    let backends = four_backends().await;
    let mut config = config_for(&backends.iter().collect::<Vec<_>>());
    // Every decision a plain hash, so the counter below is exact (starts are tested apart).
    config.affinity.context_factor = 0.0;
    let proxy = start_proxy(config).await;
    let client = client();
    let mut homes = HashMap::new();
    for conv in 0..12 {
        let conversation = format!("conv-{conv}");
        let mut seen = None;
        for turn in 0..4 {
            let (status, headers, _) = fetch(
                &client,
                "POST",
                &proxy.url("/v1/chat/completions"),
                &[("content-type", "application/json")],
                chat_body(&conversation, turn),
            )
            .await;
            assert_eq!(status, 200);
            let b = served_by(&headers);
            assert_eq!(
                seen.get_or_insert(b.clone()),
                &b,
                "{conversation} turn {turn}"
            );
        }
        homes.insert(conversation, seen.unwrap());
    }
    let distinct: std::collections::HashSet<_> = homes.values().collect();
    assert!(
        distinct.len() >= 2,
        "fingerprints are not all equal: {homes:?}"
    );
    let metrics = proxy.metrics().await;
    assert!(
        metrics.contains(
            "agentrace_affinity_decisions_total{source=\"fingerprint\",outcome=\"hash\"} 48"
        ),
        "{metrics}"
    );
    proxy.shutdown().await;
}

/// A session whose backend is above the load bound goes to its next choice, and stays there
/// after the load is gone (its cache is there now).
#[tokio::test]
async fn bounded_load_spills_then_the_session_sticks() {
    let hot = TestBackend::spawn_with(
        "hot",
        Mode::Sse {
            events: 1,
            gated: true,
            cut_after: None,
        },
    )
    .await;
    let cool = TestBackend::spawn("cool").await;
    let mut config = config_for(&[&hot, &cool]);
    // Only the in-flight bound moves sessions here, not the context new sessions bring; the
    // factor is set so the arithmetic below holds whatever the default.
    config.affinity.context_factor = 0.0;
    config.affinity.load_factor = 1.5;
    let proxy = start_proxy(config).await;
    let client = client();

    // Keys whose first choice is "hot", from the admin API.
    let mut hot_keys = Vec::new();
    for i in 0.. {
        let key = format!("key-{i}");
        let view = admin_json(&client, &proxy, &format!("/admin/sessions/{key}")).await;
        if view["rendezvous_order"][0] == "hot" {
            hot_keys.push(key);
            if hot_keys.len() == 5 {
                break;
            }
        }
    }
    // Four open streams on "hot": in flight hot=4, cool=0; bound = ceil(1.5 × 5 / 2) = 4, the
    // floor below which nothing spills.
    let mut open = Vec::new();
    for key in &hot_keys[..4] {
        let resp = send(
            &client,
            "POST",
            &proxy.url("/v1/chat/completions"),
            &[("x-session-id", key)],
            "{}",
        )
        .await;
        assert_eq!(served_by(resp.headers()), "hot");
        open.push(resp);
    }
    let spilled_key = &hot_keys[4];
    assert_eq!(
        placement(&client, &proxy, spilled_key).await,
        "cool",
        "above the bound: spill"
    );
    let view = admin_json(&client, &proxy, &format!("/admin/sessions/{spilled_key}")).await;
    assert_eq!(view["known"]["bound"], true, "{view}");
    assert_eq!(view["known"]["last_outcome"], "spill", "{view}");

    // Let the streams finish: "hot" is idle again, yet the spilled session stays on "cool".
    hot.release(4);
    for mut resp in open {
        while next_data(resp.body_mut()).await.is_some() {}
    }
    // The proxy counts a response out as its end goes to the client: read, it counts no more.
    let backends = admin_json(&client, &proxy, "/admin/backends").await;
    assert_eq!(backends["backends"][0]["in_flight"], 0, "{backends}");
    assert_eq!(placement(&client, &proxy, spilled_key).await, "cool");
    let view = admin_json(&client, &proxy, &format!("/admin/sessions/{spilled_key}")).await;
    assert_eq!(view["known"]["last_outcome"], "bound", "{view}");
    proxy.shutdown().await;
}

/// With `round_robin` (affinity off) one session's requests visit every backend.
#[tokio::test]
async fn round_robin_policy_scatters_a_session() {
    let backends = four_backends().await;
    let mut config = config_for(&backends.iter().collect::<Vec<_>>());
    config.affinity.policy = agentrace::proxy::Policy::RoundRobin;
    let proxy = start_proxy(config).await;
    let client = client();
    let mut seen = std::collections::HashSet::new();
    for _ in 0..8 {
        seen.insert(placement(&client, &proxy, "one-session").await);
    }
    assert_eq!(seen.len(), 4, "{seen:?}");
    proxy.shutdown().await;
}

/// A reload that changes `affinity.max_sessions` (and with it how the session table is laid
/// out) keeps every remembered session: 100 sessions bound away from their plain hash stay
/// bound and keep reaching the backend they were bound to, and `agentrace_bound_sessions`
/// and `agentrace_sessions` keep counting exactly the sessions the table still finds.
#[tokio::test]
async fn reload_that_changes_max_sessions_keeps_every_bound_session() {
    let a = TestBackend::spawn("a").await;
    let b = TestBackend::spawn("b").await;
    let proxy = start_proxy(config_for(&[&a, &b])).await;
    let client = client();

    // 100 keys whose first choice is "a", bound to "b" while "a" drains.
    let mut keys = Vec::new();
    for i in 0.. {
        let key = format!("bound-{i}");
        let view = admin_json(&client, &proxy, &format!("/admin/sessions/{key}")).await;
        if view["rendezvous_order"][0] == "a" {
            keys.push(key);
            if keys.len() == 100 {
                break;
            }
        }
    }
    let drain = |action: &'static str| {
        let url = proxy.admin_url(&format!("/admin/backends/a/{action}"));
        let client = client.clone();
        async move { assert_eq!(fetch(&client, "POST", &url, &[], "").await.0, 200) }
    };
    drain("drain").await;
    for key in &keys {
        assert_eq!(placement(&client, &proxy, key).await, "b", "{key}");
    }
    drain("undrain").await;

    let check = |when: String| {
        let (client, proxy, keys) = (&client, &proxy, &keys);
        async move {
            for key in keys {
                let view = admin_json(client, proxy, &format!("/admin/sessions/{key}")).await;
                assert_eq!(view["known"]["bound"], true, "{when}: {key} {view}");
                assert_eq!(view["known"]["backend"], "b", "{when}: {key} {view}");
                assert_eq!(placement(client, proxy, key).await, "b", "{when}: {key}");
            }
            let metrics = proxy.metrics().await;
            assert_eq!(
                series_value(&metrics, "agentrace_bound_sessions"),
                100,
                "{when}"
            );
            assert_eq!(series_value(&metrics, "agentrace_sessions"), 100, "{when}");
        }
    };
    check("before any reload".into()).await;
    for max_sessions in [5_000, 1_000_000, 200, 100_000] {
        let mut config = config_for(&[&a, &b]);
        config.affinity.max_sessions = max_sessions;
        proxy.handle().reload(config).unwrap();
        check(format!("after a reload to max_sessions = {max_sessions}")).await;
    }
    proxy.shutdown().await;
}

/// The active context the proxy counts on its only backend, from `/metrics`.
async fn active_context(proxy: &TestProxy) -> f64 {
    support::sim::metric(
        &proxy.metrics().await,
        "agentrace_backend_active_context_bytes",
    )
}

/// A session counts in its backend's active context while a turn is in flight, however much
/// longer than `affinity.active_secs` the turn runs, and leaves it once a window has passed
/// after the turn ended: the forwarding path marks each turn's start and end in the table.
#[tokio::test]
async fn a_turn_in_flight_holds_its_context_past_the_active_window_until_it_ends() {
    let slow = TestBackend::spawn_with(
        "slow",
        Mode::Sse {
            events: 1,
            gated: true,
            cut_after: None,
        },
    )
    .await;
    let mut config = config_for(&[&slow]);
    config.affinity.active_secs = 0.2;
    let proxy = start_proxy(config).await;
    let client = client();
    let body = chat_body("long-turn", 0);
    let bytes = body.len() as f64;
    let mut resp = send(
        &client,
        "POST",
        &proxy.url("/v1/chat/completions"),
        &[
            ("x-session-id", "long-turn"),
            ("content-type", "application/json"),
        ],
        body,
    )
    .await;
    assert_eq!(resp.status(), 200);

    // The response has begun and is held: let five active windows pass.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        active_context(&proxy).await,
        bytes,
        "a turn in flight for 5 windows still counts its request on the backend"
    );

    slow.release(1);
    while next_data(resp.body_mut()).await.is_some() {}
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while active_context(&proxy).await != 0.0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the ended turn's session still counts 10 s after a 0.2 s window"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    proxy.shutdown().await;
}

/// A backend that states no KV cache size at any of the paths engines use (a chat completion on
/// every path) or has none of them (404) is asked at each once, not on every health probe; one
/// whose answers fail (500) is asked for a bounded number of probes, then taken as unknown.
#[tokio::test]
async fn a_backend_without_a_kv_cache_size_is_asked_for_it_once() {
    // The paths asked: /metrics, /get_server_info, /props, /slots.
    const PATHS: u64 = 4;
    // Probes with a failed answer before the size is taken as unknown.
    const FAILED_ROUNDS: u64 = 5;
    for (mode, asked) in [
        (Mode::Json, PATHS),
        (Mode::Status(404), PATHS),
        (Mode::Status(500), PATHS * FAILED_ROUNDS),
    ] {
        let plain = TestBackend::spawn_with("plain", mode.clone()).await;
        let mut config = config_for(&[&plain]);
        config.health.interval_ms = 20;
        config.health.timeout_ms = 20;
        let proxy = start_proxy(config).await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while plain.probes() < 2 * FAILED_ROUNDS {
            assert!(
                tokio::time::Instant::now() < deadline,
                "10 probes did not come in 10 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(plain.hits(), asked, "{mode:?}: requests other than probes");
        let backends = admin_json(&client(), &proxy, "/admin/backends").await;
        assert_eq!(backends["backends"][0]["kv_cache_tokens"], 0, "{backends}");
        assert_eq!(
            backends["backends"][0]["kv_cache_source"], "unknown",
            "{backends}"
        );
        proxy.shutdown().await;
    }
}
