use super::*;

fn base() -> String {
    "[[backends]]\nname = \"a\"\nurl = \"http://127.0.0.1:8000\"\n".to_string()
}

fn err(toml: &str) -> String {
    ProxyConfig::from_toml_str(toml).unwrap_err().to_string()
}

#[test]
fn defaults_match_the_documented_values() {
    let c = ProxyConfig::from_toml_str(&base()).unwrap();
    assert_eq!(c.max_request_body_bytes, 64 << 20);
    assert_eq!(c.request_body_budget_bytes, 256 << 20);
    assert_eq!(c.shutdown_grace_secs, 30);
    assert_eq!(c.listen_backlog, 4096);
    assert_eq!(c.client.max_connections, 10_000);
    assert_eq!(c.client.max_tls_handshakes, 64);
    assert_eq!(c.affinity.policy, Policy::Session);
    assert_eq!(c.affinity.load_factor, 2.0);
    assert_eq!(c.affinity.session_ttl_secs, 1800);
    assert_eq!(c.affinity.max_sessions, 1_000_000);
    assert_eq!(c.affinity.active_secs, 20.0);
    assert_eq!(c.affinity.headers, DEFAULT_SESSION_HEADERS.to_vec());
    assert!(c.affinity.fingerprint);
    assert_eq!(c.health.interval_ms, 5000);
    assert_eq!(c.health.timeout_ms, 2000);
    assert_eq!(c.health.unhealthy_threshold, 3);
    assert_eq!(c.health.healthy_threshold, 2);
    assert_eq!(c.upstream.retries, 1);
    assert_eq!(c.client.close_grace_ms, 2000);
    assert_eq!(c.client.h2_max_concurrent_streams, 200);
    assert_eq!(c.client.h2_max_cancelled_streams, 100);
    assert_eq!(c.client.h2_max_cancelled_share, 0.5);
    assert_eq!(c.admin.listen.to_string(), "127.0.0.1:9464");
    assert_eq!(c.backends[0].weight, 1.0);
}

/// Every validation rule, with the field it must name and the value it must show.
#[test]
fn every_validation_error_names_field_and_value() {
    let b = base();
    let cases: Vec<(String, &str)> = vec![
        (
            "max_request_body_bytes = 0\n".to_string() + &b,
            "max_request_body_bytes: must be > 0, got 0",
        ),
        (
            "request_body_budget_bytes = 1000\n".to_string() + &b,
            "request_body_budget_bytes: must be >= max_request_body_bytes (67108864), got 1000",
        ),
        (
            format!("[admin]\nlisten = \"0.0.0.0:9464\"\n{b}"),
            "admin.token: required when admin.listen is not loopback, got listen 0.0.0.0:9464",
        ),
        (
            format!("[admin]\ntoken = \"has space\"\n{b}"),
            "admin.token: must be non-empty printable ASCII",
        ),
        (
            format!("[admin]\nlisten = \"0.0.0.0:9464\"\ntoken = \" \"\n{b}"),
            "admin.token: must not be empty",
        ),
        (
            format!("listen = \"127.0.0.1:7000\"\n[admin]\nlisten = \"127.0.0.1:7000\"\n{b}"),
            "admin.listen: must differ from listen, both are 127.0.0.1:7000",
        ),
        (
            format!("[client]\nheader_timeout_ms = 0\n{b}"),
            "client.header_timeout_ms: must be > 0, got 0",
        ),
        (
            format!("[client]\nbody_timeout_ms = 0\n{b}"),
            "client.body_timeout_ms: must be > 0, got 0",
        ),
        (
            format!("[client]\nidle_timeout_ms = 0\n{b}"),
            "client.idle_timeout_ms: must be > 0, got 0",
        ),
        (
            format!("[client]\nsend_timeout_ms = 0\n{b}"),
            "client.send_timeout_ms: must be > 0, got 0",
        ),
        (
            format!("listen_backlog = 0\n{b}"),
            "listen_backlog: must be 1 to 65535, got 0",
        ),
        (
            format!("listen_backlog = 70000\n{b}"),
            "listen_backlog: must be 1 to 65535, got 70000",
        ),
        (
            format!("[client]\nmax_connections = 0\n{b}"),
            "client.max_connections: must be >= 1, got 0",
        ),
        (
            format!("[client]\nmax_tls_handshakes = 0\n{b}"),
            "client.max_tls_handshakes: must be >= 1, got 0",
        ),
        (
            format!("[client]\nclose_grace_ms = 0\n{b}"),
            "client.close_grace_ms: must be > 0, got 0",
        ),
        (
            format!("[client]\nh2_max_concurrent_streams = 0\n{b}"),
            "client.h2_max_concurrent_streams: must be > 0, got 0",
        ),
        (
            format!("[client]\nh2_max_cancelled_share = 1.5\n{b}"),
            "client.h2_max_cancelled_share: must be within 0.0..=1.0, got 1.5",
        ),
        (
            format!("[upstream]\nconnect_timeout_ms = 0\n{b}"),
            "upstream.connect_timeout_ms: must be > 0, got 0",
        ),
        (
            format!("[upstream]\nretries = 9\n{b}"),
            "upstream.retries: must be <= 8, got 9",
        ),
        (
            format!("[affinity]\nheaders = []\nfingerprint = false\n{b}"),
            "affinity.headers: must name at least one header",
        ),
        (
            format!("[affinity]\nheaders = [\"x session\"]\n{b}"),
            "affinity.headers[0]: not a valid header name, got \"x session\"",
        ),
        (
            format!("[affinity]\nload_factor = 0.5\n{b}"),
            "affinity.load_factor: must be >= 1.0 or 0, got 0.5",
        ),
        (
            format!("[affinity]\nsession_ttl_secs = 0\n{b}"),
            "affinity.session_ttl_secs: must be > 0, got 0",
        ),
        (
            format!("[affinity]\nmax_sessions = 0\n{b}"),
            "affinity.max_sessions: must be > 0, got 0",
        ),
        (
            format!("[affinity]\nactive_secs = 0\n{b}"),
            "affinity.active_secs: must be > 0 and at most session_ttl_secs, got 0",
        ),
        (
            format!("[affinity]\nsession_ttl_secs = 60\nactive_secs = 61\n{b}"),
            "affinity.active_secs: must be > 0 and at most session_ttl_secs, got 61",
        ),
        (
            format!("[affinity]\npolicy = \"random\"\n{b}"),
            "unknown variant `random`",
        ),
        (
            format!("[health]\npath = \"health\"\n{b}"),
            "health.path: must be an absolute path like /health, got \"health\"",
        ),
        (
            format!("[health]\ntimeout_ms = 0\n{b}"),
            "health.timeout_ms: must be > 0, got 0",
        ),
        (
            format!("[health]\ninterval_ms = 1000\ntimeout_ms = 2000\n{b}"),
            "health.timeout_ms: must be <= health.interval_ms (1000), got 2000",
        ),
        (
            format!("[health]\nunhealthy_threshold = 0\n{b}"),
            "health.unhealthy_threshold: must be >= 1, got 0",
        ),
        (
            format!("[health]\nhealthy_threshold = 0\n{b}"),
            "health.healthy_threshold: must be >= 1, got 0",
        ),
        (
            format!("[health]\nejection_ms = 0\n{b}"),
            "health.ejection_ms: must be > 0, got 0",
        ),
        (
            String::new(),
            "backends: at least one backend is required, got none",
        ),
        (
            format!("{b}[[backends]]\nname = \"a\"\nurl = \"http://127.0.0.1:8001\"\n"),
            "backends[1].name: duplicate name \"a\"",
        ),
        (
            "[[backends]]\nname = \"a b\"\nurl = \"http://h:1\"\n".into(),
            "backends[0].name: must be non-empty printable ASCII",
        ),
        (
            "[[backends]]\nname = \"a\"\nurl = \"ftp://h:1\"\n".into(),
            "backends[0].url: scheme must be http or https, got \"ftp://h:1\"",
        ),
        (
            "[[backends]]\nname = \"a\"\nurl = \"localhost:8000\"\n".into(),
            "backends[0].url: ",
        ),
        (
            "[[backends]]\nname = \"a\"\nurl = \"http://h:1/v1?x=1\"\n".into(),
            "backends[0].url: must not have a query",
        ),
        (
            "[[backends]]\nname = \"a\"\nurl = \"http://h:1\"\nweight = 0.0\n".into(),
            "backends[0].weight: must be > 0, got 0",
        ),
        (format!("bogus = 1\n{b}"), "unknown field `bogus`"),
        (
            format!("[affinity]\nload_factr = 2.0\n{b}"),
            "unknown field `load_factr`",
        ),
        (format!("listen = \"nowhere\"\n{b}"), "listen"),
    ];
    for (toml, expected) in cases {
        let message = err(&toml);
        assert!(
            message.contains(expected),
            "config\n{toml}\nexpected error containing {expected:?}, got {message:?}"
        );
    }
}

#[test]
fn zero_load_factor_turns_the_bound_off_and_is_accepted() {
    let c = ProxyConfig::from_toml_str(&format!("[affinity]\nload_factor = 0\n{}", base()));
    assert_eq!(c.unwrap().affinity.load_factor, 0.0);
}

/// Whole seconds, as configs have always given it, and fractions, for replays that
/// compress time, both load.
#[test]
fn active_window_takes_whole_and_fractional_seconds() {
    for (text, secs) in [("20", 20.0), ("0.4", 0.4)] {
        let c =
            ProxyConfig::from_toml_str(&format!("[affinity]\nactive_secs = {text}\n{}", base()));
        assert_eq!(c.unwrap().affinity.active_secs, secs);
    }
}

#[test]
fn non_loopback_admin_with_token_is_accepted_and_token_is_redacted() {
    let c = ProxyConfig::from_toml_str(&format!(
        "[admin]\nlisten = \"0.0.0.0:9464\"\ntoken = \"s3cret\"\n{}",
        base()
    ))
    .unwrap();
    assert!(!format!("{c:?}").contains("s3cret"));
}

#[test]
fn token_file_stands_in_for_the_token_and_is_read_at_resolution() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("token");
    std::fs::write(&path, "from-secret\n").unwrap();
    let text = format!(
        "[admin]\nlisten = \"0.0.0.0:9464\"\ntoken_file = {:?}\n{}",
        path.display().to_string(),
        base()
    );
    let mut c = ProxyConfig::from_toml_str(&text).unwrap();
    c.resolve_token_file().unwrap();
    assert_eq!(c.admin.token, Some(Secret("from-secret".into())));
    c.validate().unwrap();

    let both = format!("[admin]\ntoken = \"t\"\ntoken_file = \"/x\"\n{}", base());
    let e = ProxyConfig::from_toml_str(&both).unwrap_err().to_string();
    assert!(
        e.contains("admin.token_file: set admin.token or admin.token_file, not both"),
        "{e}"
    );

    let mut missing = ProxyConfig::from_toml_str(&format!(
        "[admin]\ntoken_file = \"/nonexistent/admin-token\"\n{}",
        base()
    ))
    .unwrap();
    let e = missing.resolve_token_file().unwrap_err().to_string();
    assert!(
        e.starts_with("admin.token_file: cannot read /nonexistent/admin-token"),
        "{e}"
    );
}

#[test]
fn missing_file_error_names_the_file() {
    let e = ProxyConfig::load("/nonexistent/agentrace.toml").unwrap_err();
    assert!(e.to_string().contains("/nonexistent/agentrace.toml"), "{e}");
}

#[test]
fn backend_url_keeps_base_path_without_trailing_slash() {
    let u = BackendUrl::parse("https://api.example.com:8443/v2/").unwrap();
    assert_eq!(u.server.path, "/v2");
    assert_eq!(u.to_string(), "https://api.example.com:8443/v2");
    assert_eq!(&*u.origin, "https://api.example.com:8443");
    assert_eq!(u.host, "api.example.com:8443");
    assert_eq!(BackendUrl::parse("http://h:1").unwrap().server.path, "");
}

#[test]
fn example_config_file_loads() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/config/proxy.toml");
    let c = ProxyConfig::load(path).unwrap_or_else(|e| panic!("{e}"));
    assert!(c.backends.len() >= 2);
}
