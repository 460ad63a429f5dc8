//! The proxy's edges: TLS ingress, the admin API, configuration errors and SIGHUP reload.
//!
//! Invariants: TLS ingress with a self-signed certificate serves h2 and HTTP/1.1 by ALPN, and a
//! missing certificate file is an error naming it; the admin API answers without a token on
//! loopback and refuses requests without the right bearer token when one is set; draining keeps
//! known sessions and turns new ones away; a bad config exits with code 2 naming the field;
//! SIGHUP with a bad file keeps the running config, with a good file applies it.

mod support;

use std::io::Write as _;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use agentrace::proxy::config::{Secret, TlsConfig};
use agentrace::proxy::ProxyError;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use support::backends::*;
use tokio::io::{AsyncBufReadExt, BufReader};

/// TLS termination with an rcgen certificate; ALPN picks h2 or HTTP/1.1 as the client offers.
#[tokio::test]
async fn tls_ingress_serves_h2_and_http1() {
    let a = TestBackend::spawn("a").await;
    let dir = tempfile::tempdir().unwrap();
    let certified =
        rcgen::generate_simple_self_signed(vec!["localhost".to_string(), "127.0.0.1".to_string()])
            .unwrap();
    let (cert_file, key_file) = (dir.path().join("proxy.crt"), dir.path().join("proxy.key"));
    std::fs::write(&cert_file, certified.cert.pem()).unwrap();
    std::fs::write(&key_file, certified.key_pair.serialize_pem()).unwrap();
    let mut config = config_for(&[&a]);
    config.tls = Some(TlsConfig {
        cert_file,
        key_file,
    });
    let proxy = start_proxy(config).await;

    let mut roots = rustls::RootCertStore::empty();
    roots.add(certified.cert.der().clone()).unwrap();
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    for (h2, version) in [
        (true, http::Version::HTTP_2),
        (false, http::Version::HTTP_11),
    ] {
        let builder = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls.clone())
            .https_only();
        let connector = if h2 {
            builder.enable_http1().enable_http2().build()
        } else {
            builder.enable_http1().build()
        };
        let client: hyper_util::client::legacy::Client<_, Full<Bytes>> =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build(connector);
        let req = http::Request::get(format!("https://127.0.0.1:{}/v1/models", proxy.addr.port()))
            .header("x-session-id", "tls")
            .body(Full::new(Bytes::new()))
            .unwrap();
        let resp = client.request(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.version(), version);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert!(String::from_utf8_lossy(&body).contains("\"backend\":\"a\""));
    }
    let forwarded = a.last_headers().unwrap();
    assert_eq!(forwarded["x-forwarded-proto"], "https");
    proxy.shutdown().await;
}

/// A missing or unusable certificate file stops startup with an error naming the file.
#[tokio::test]
async fn bad_tls_files_are_named_at_startup() {
    let a = TestBackend::spawn("a").await;
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.crt");
    let mut config = config_for(&[&a]);
    config.tls = Some(TlsConfig {
        cert_file: missing.clone(),
        key_file: dir.path().join("missing.key"),
    });
    let (_t, shutdown) = agentrace::shutdown::channel();
    let err = agentrace::proxy::start(config.clone(), shutdown.clone())
        .await
        .err()
        .unwrap();
    assert!(err.is_config());
    assert!(
        err.to_string().contains(&missing.display().to_string()),
        "{err}"
    );

    let garbage = dir.path().join("garbage.crt");
    std::fs::write(&garbage, "not a certificate").unwrap();
    config.tls = Some(TlsConfig {
        cert_file: garbage.clone(),
        key_file: garbage.clone(),
    });
    let err = agentrace::proxy::start(config, shutdown)
        .await
        .err()
        .unwrap();
    assert!(matches!(err, ProxyError::Tls { .. }), "{err}");
    assert!(err.to_string().contains("garbage.crt"), "{err}");
}

/// On loopback without a token the admin API is open; `/admin/sessions` explains a placement.
#[tokio::test]
async fn admin_api_without_token_on_loopback() {
    let a = TestBackend::spawn("a").await;
    let b = TestBackend::spawn("b").await;
    let proxy = start_proxy(config_for(&[&a, &b])).await;
    let client = client();
    let (status, _, body) =
        fetch(&client, "GET", &proxy.admin_url("/admin/backends"), &[], "").await;
    assert_eq!(status, 200);
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(json["policy"], "session");
    assert_eq!(json["backends"][0]["name"], "a");
    assert_eq!(json["backends"][0]["healthy"], true);
    assert_eq!(json["backends"][1]["url"], b.url());

    let (_, h, _) = fetch(
        &client,
        "GET",
        &proxy.url("/"),
        &[("x-session-id", "who/am i")],
        "",
    )
    .await;
    let (status, _, body) = fetch(
        &client,
        "GET",
        &proxy.admin_url("/admin/sessions/who%2Fam%20i"),
        &[],
        "",
    )
    .await;
    assert_eq!(status, 200);
    let view: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(view["key"], "who/am i");
    assert_eq!(view["known"]["backend"], served_by(&h));
    assert_eq!(view["next_request"]["backend"], served_by(&h));
    assert_eq!(view["rendezvous_order"].as_array().unwrap().len(), 2);

    let (status, _, _) = fetch(
        &client,
        "POST",
        &proxy.admin_url("/admin/backends/nope/drain"),
        &[],
        "",
    )
    .await;
    assert_eq!(status, 404);
    let (status, _, body) = fetch(&client, "GET", &proxy.admin_url("/metrics"), &[], "").await;
    assert_eq!(status, 200);
    let text = String::from_utf8(body.to_vec()).unwrap();
    for series in [
        "agentrace_requests_total{backend=",
        "agentrace_upstream_latency_seconds_bucket{backend=",
        "agentrace_upstream_ttfb_seconds_bucket{backend=",
        "agentrace_in_flight{backend=",
        "agentrace_backend_healthy{backend=\"a\"} 1",
        "agentrace_affinity_decisions_total{source=\"header\",outcome=\"hash\"} 1",
        "agentrace_bound_sessions 0",
        "agentrace_retries_total{reason=\"connect\"} 0",
        "agentrace_proxy_overhead_seconds_bucket",
        "agentrace_sessions 1",
    ] {
        assert!(text.contains(series), "missing {series} in\n{text}");
    }
    proxy.shutdown().await;
}

/// With a token configured, `/admin/*` needs `Authorization: Bearer <token>`.
#[tokio::test]
async fn admin_api_requires_the_configured_token() {
    let a = TestBackend::spawn("a").await;
    let b = TestBackend::spawn("b").await;
    let mut config = config_for(&[&a, &b]);
    config.admin.token = Some(Secret("t0ken".into()));
    let proxy = start_proxy(config).await;
    let client = client();
    let url = proxy.admin_url("/admin/backends");
    let (status, headers, _) = fetch(&client, "GET", &url, &[], "").await;
    assert_eq!(status, 401);
    assert_eq!(headers["www-authenticate"], "Bearer");
    assert_eq!(
        fetch(
            &client,
            "GET",
            &url,
            &[("authorization", "Bearer wrong")],
            ""
        )
        .await
        .0,
        401
    );
    assert_eq!(
        fetch(&client, "GET", &url, &[("authorization", "t0ken")], "")
            .await
            .0,
        401
    );
    assert_eq!(
        fetch(
            &client,
            "GET",
            &url,
            &[("authorization", "Bearer t0ken")],
            ""
        )
        .await
        .0,
        200
    );
    let drain = proxy.admin_url("/admin/backends/a/drain");
    assert_eq!(fetch(&client, "POST", &drain, &[], "").await.0, 401);
    let (status, _, body) = fetch(
        &client,
        "POST",
        &drain,
        &[("authorization", "Bearer t0ken")],
        "",
    )
    .await;
    assert_eq!(status, 200);
    assert!(String::from_utf8_lossy(&body).contains("\"draining\":true"));
    assert_eq!(
        fetch(&client, "GET", &proxy.admin_url("/metrics"), &[], "")
            .await
            .0,
        200,
        "metrics stay open for scrapers"
    );
    proxy.shutdown().await;
}

/// The authentication scheme is case-insensitive (RFC 9110 §11.1): `bearer`, `BEARER` and any
/// other casing of `Bearer` carry the token, with one or more spaces before it; the token
/// itself is compared exactly.
#[tokio::test]
async fn admin_bearer_scheme_is_case_insensitive() {
    let a = TestBackend::spawn("a").await;
    let mut config = config_for(&[&a]);
    config.admin.token = Some(Secret("t0ken".into()));
    let proxy = start_proxy(config).await;
    let client = client();
    let url = proxy.admin_url("/admin/backends");
    for accepted in [
        "Bearer t0ken",
        "bearer t0ken",
        "BEARER t0ken",
        "bEaReR t0ken",
        "Bearer   t0ken",
    ] {
        let (status, _, _) = fetch(&client, "GET", &url, &[("authorization", accepted)], "").await;
        assert_eq!(status, 200, "{accepted:?} carries the right token");
    }
    for refused in [
        "bearer T0KEN",
        "bearert0ken",
        "Bearers t0ken",
        "Basic t0ken",
        "bearer",
    ] {
        let (status, _, _) = fetch(&client, "GET", &url, &[("authorization", refused)], "").await;
        assert_eq!(status, 401, "{refused:?} must not authorize");
    }
    proxy.shutdown().await;
}

/// Draining a backend: its known sessions finish there, new sessions go elsewhere; undrain
/// lets new sessions in again.
#[tokio::test]
async fn draining_keeps_known_sessions_and_refuses_new_ones() {
    let a = TestBackend::spawn("a").await;
    let b = TestBackend::spawn("b").await;
    let proxy = start_proxy(config_for(&[&a, &b])).await;
    let client = client();
    let place = |key: String| {
        let client = client.clone();
        let url = proxy.url("/v1/chat/completions");
        async move {
            served_by(
                &fetch(&client, "POST", &url, &[("x-session-id", &key)], "{}")
                    .await
                    .1,
            )
        }
    };
    let mut on_a = Vec::new();
    for i in 0..20 {
        let key = format!("known-{i}");
        if place(key.clone()).await == "a" {
            on_a.push(key);
        }
    }
    assert!(!on_a.is_empty());
    let (status, _, body) = fetch(
        &client,
        "POST",
        &proxy.admin_url("/admin/backends/a/drain"),
        &[],
        "",
    )
    .await;
    assert_eq!(status, 200);
    let state: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(state["draining"], true);
    for key in &on_a {
        assert_eq!(
            place(key.clone()).await,
            "a",
            "known session {key} stays while draining"
        );
    }
    for i in 0..30 {
        assert_eq!(
            place(format!("new-{i}")).await,
            "b",
            "new sessions avoid a draining backend"
        );
    }
    fetch(
        &client,
        "POST",
        &proxy.admin_url("/admin/backends/a/undrain"),
        &[],
        "",
    )
    .await;
    let mut reached_a = false;
    for i in 0..30 {
        reached_a |= place(format!("later-{i}")).await == "a";
    }
    assert!(reached_a);
    proxy.shutdown().await;
}

fn write_config(path: &std::path::Path, body: &str) {
    let mut f = std::fs::File::create(path).unwrap();
    f.write_all(body.as_bytes()).unwrap();
    f.sync_all().unwrap();
}

fn proxy_toml(backends: &[&TestBackend], extra: &str) -> String {
    let mut s = format!(
        "listen = \"127.0.0.1:0\"\n[admin]\nlisten = \"127.0.0.1:0\"\n[health]\ninterval_ms = 0\n{extra}\n"
    );
    for b in backends {
        s.push_str(&format!(
            "[[backends]]\nname = \"{}\"\nurl = \"{}\"\n",
            b.name(),
            b.url()
        ));
    }
    s
}

/// A bad config file exits with code 2 and a message naming the field and value.
#[tokio::test]
async fn bad_config_exits_with_code_2() {
    let a = TestBackend::spawn("a").await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("proxy.toml");
    write_config(&path, &proxy_toml(&[&a], "[affinity]\nload_factor = 0.5"));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_agentrace"))
        .args(["proxy", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("affinity.load_factor: must be >= 1.0 or 0, got 0.5"),
        "{stderr}"
    );

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_agentrace"))
        .args(["proxy", "--backend", "backend.invalid:8000"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // An unknown policy is refused with the values there are.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_agentrace"))
        .args(["proxy", "--policy", "sticky"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("possible values: session, round_robin, least_loaded"),
        "{stderr}"
    );
}

struct Child {
    child: tokio::process::Child,
    stderr: tokio::io::Lines<BufReader<tokio::process::ChildStderr>>,
    addr: String,
    admin: String,
}

async fn spawn_proxy(args: &[&std::ffi::OsStr]) -> Child {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_agentrace"));
    command
        .args(["--log-format", "json", "proxy"])
        .args(args)
        .stderr(Stdio::piped());
    let mut proxy = support::proxy_process::ProxyProcess::start(command).await;
    let stderr = BufReader::new(proxy.child.stderr.take().unwrap()).lines();
    Child {
        child: proxy.child,
        stderr,
        addr: proxy.addr,
        admin: proxy.admin,
    }
}

impl Child {
    fn signal(&self, sig: &str) {
        let pid = self.child.id().unwrap().to_string();
        let status = std::process::Command::new("kill")
            .args([sig, &pid])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Reads log lines until one contains `needle` (20 s deadline).
    async fn wait_log(&mut self, needle: &str) -> String {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let line = tokio::time::timeout_at(deadline, self.stderr.next_line())
                .await
                .unwrap_or_else(|_| panic!("no log line containing {needle:?}"))
                .unwrap()
                .expect("stderr open");
            if line.contains(needle) {
                return line;
            }
        }
    }
}

async fn backend_names(client: &HttpClient, admin: &str) -> Vec<String> {
    let body = fetch(
        client,
        "GET",
        &format!("http://{admin}/admin/backends"),
        &[],
        "",
    )
    .await
    .2;
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    json["backends"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["name"].as_str().unwrap().to_string())
        .collect()
}

/// SIGHUP with an invalid file is refused (logged) and the running config stays; SIGHUP with
/// a valid file swaps the backends in; SIGTERM exits 0.
#[tokio::test]
async fn sighup_reload_keeps_the_old_config_when_the_new_one_is_bad() {
    let a = TestBackend::spawn("a").await;
    let b = TestBackend::spawn("b").await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("proxy.toml");
    write_config(&path, &proxy_toml(&[&a], ""));
    let mut proxy = spawn_proxy(&["--config".as_ref(), path.as_os_str()]).await;
    let client = client();
    assert_eq!(backend_names(&client, &proxy.admin).await, ["a"]);

    write_config(
        &path,
        &proxy_toml(&[&a, &b], "[affinity]\nload_factor = 0.5"),
    );
    proxy.signal("-HUP");
    let line = proxy.wait_log("reload refused").await;
    assert!(line.contains("affinity.load_factor"), "{line}");
    assert!(
        !line.contains('\x1b'),
        "a log written to a pipe carries no colour codes: {line:?}"
    );
    assert_eq!(
        backend_names(&client, &proxy.admin).await,
        ["a"],
        "the running config stays"
    );
    let (status, h, _) = fetch(
        &client,
        "GET",
        &format!("http://{}/v1/models", proxy.addr),
        &[],
        "",
    )
    .await;
    assert_eq!((status.as_u16(), served_by(&h).as_str()), (200, "a"));

    write_config(&path, &proxy_toml(&[&a, &b], ""));
    proxy.signal("-HUP");
    proxy.wait_log("configuration reloaded").await;
    assert_eq!(backend_names(&client, &proxy.admin).await, ["a", "b"]);
    let metrics = fetch(
        &client,
        "GET",
        &format!("http://{}/metrics", proxy.admin),
        &[],
        "",
    )
    .await
    .2;
    let metrics = String::from_utf8(metrics.to_vec()).unwrap();
    assert!(
        metrics.contains("agentrace_config_reloads_total{result=\"refused\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("agentrace_config_reloads_total{result=\"ok\"} 1"),
        "{metrics}"
    );

    proxy.signal("-TERM");
    let status = tokio::time::timeout(Duration::from_secs(20), proxy.child.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(0));
}

/// The quick form without a file: `--listen` and repeated `--backend`.
#[tokio::test]
async fn flags_alone_start_a_proxy() {
    let a = TestBackend::spawn("a").await;
    let b = TestBackend::spawn("b").await;
    let named = format!("second={}", b.url());
    let mut proxy = spawn_proxy(&[
        "--listen".as_ref(),
        "127.0.0.1:0".as_ref(),
        "--admin-listen".as_ref(),
        "127.0.0.1:0".as_ref(),
        "--backend".as_ref(),
        a.url().as_ref(),
        "--backend".as_ref(),
        named.as_ref(),
    ])
    .await;
    let client = client();
    assert_eq!(
        backend_names(&client, &proxy.admin).await,
        [a.addr.to_string(), "second".to_string()]
    );
    let (status, _, _) = fetch(
        &client,
        "GET",
        &format!("http://{}/v1/models", proxy.addr),
        &[("x-session-id", "f")],
        "",
    )
    .await;
    assert_eq!(status, 200);
    proxy.signal("-INT");
    let status = tokio::time::timeout(Duration::from_secs(20), proxy.child.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(0));
}

// The admin listener speaks through the crate's HTTP/1.1 codec: requests on one connection are
// answered in turn, HEAD gets a head only, and what the codec refuses (a head past its bound, a
// body the admin API will not read) is answered with its status and the connection closed.
#[tokio::test]
async fn admin_listener_keeps_alive_and_refuses_oversized_heads_and_bodies() {
    use support::raw_http1::Client as Raw;
    let a = TestBackend::spawn("a").await;
    let proxy = start_proxy(config_for(&[&a])).await;

    let mut raw = Raw::connect(proxy.admin).await;
    raw.send("GET /health HTTP/1.1\r\nhost: x\r\n\r\nHEAD /health HTTP/1.1\r\nhost: x\r\n\r\n")
        .await;
    let first = raw.reply().await;
    assert_eq!((first.status, &first.body[..]), (200, &b"ok\n"[..]));
    let second = raw.reply_to(true).await;
    assert_eq!(second.status, 200);
    assert_eq!(second.header("content-length").as_deref(), Some("3"));
    raw.send("GET /admin/backends HTTP/1.1\r\nhost: x\r\n\r\n")
        .await;
    assert_eq!(raw.reply().await.json()["backends"][0]["name"], "a");

    let mut raw = Raw::connect(proxy.admin).await;
    let long = "x".repeat(128 * 1024);
    raw.send(format!(
        "GET /metrics HTTP/1.1\r\nhost: x\r\nx-long: {long}\r\n\r\n"
    ))
    .await;
    let refused = raw.reply().await;
    assert_eq!(refused.status, 431, "{}", refused.head);
    assert!(
        !raw.fill().await,
        "the connection is closed after a refusal"
    );

    let mut raw = Raw::connect(proxy.admin).await;
    raw.send(
        "POST /admin/backends/a/drain HTTP/1.1\r\nhost: x\r\ncontent-length: 10000000\r\n\r\n",
    )
    .await;
    let refused = raw.reply().await;
    assert_eq!(refused.status, 413, "{}", refused.head);
    assert!(
        !raw.fill().await,
        "the connection is closed after a refusal"
    );
    let mut raw = Raw::connect(proxy.admin).await;
    raw.send("GET /admin/backends HTTP/1.1\r\nhost: x\r\n\r\n")
        .await;
    assert_eq!(
        raw.reply().await.json()["backends"][0]["draining"],
        false,
        "a refused request does nothing"
    );
}
