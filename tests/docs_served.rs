//! The metrics and admin API references cannot drift from what the proxy serves: a real proxy
//! with a backend and the recorder on serves one request, and the series (name and type) its
//! `/metrics` describes are exactly the rows of `docs/src/reference/metrics.md`; every route
//! of `docs/src/reference/admin-api.md` answers, and a route the page does not list is 404.

mod support;

use std::collections::BTreeSet;

use support::backends::*;

const PAGE: &str = include_str!("../docs/src/reference/metrics.md");

/// `(name, type)` of every row of the page's first table whose first cell is a series.
fn documented() -> BTreeSet<(String, String)> {
    PAGE.lines()
        .filter(|l| l.starts_with("| `agentrace_"))
        .map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            (cells[1].trim_matches('`').to_string(), cells[2].to_string())
        })
        .collect()
}

/// `(name, type)` of every `# TYPE` line the proxy serves.
fn served(metrics: &str) -> BTreeSet<(String, String)> {
    metrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            Some((words.next()?.to_string(), words.next()?.to_string()))
        })
        .collect()
}

#[tokio::test]
async fn metrics_reference_lists_exactly_the_served_series() {
    let backend = TestBackend::spawn("a").await;
    let capture = tempfile::tempdir().unwrap();
    let mut config = config_for(&[&backend]);
    config.capture.enabled = true;
    config.capture.dir = capture.path().to_path_buf();
    let proxy = start_proxy(config).await;
    let (status, _, _) = fetch(
        &client(),
        "POST",
        &proxy.url("/v1/chat/completions"),
        &[("x-session-id", "s1"), ("content-type", "application/json")],
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
    )
    .await;
    assert_eq!(status, 200);
    let metrics = proxy.metrics().await;
    let served = served(&metrics);
    let documented = documented();
    let missing: Vec<_> = served.difference(&documented).collect();
    let extra: Vec<_> = documented.difference(&served).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "docs/src/reference/metrics.md drifted from /metrics\n\
         served but not documented (name, type): {missing:?}\n\
         documented but not served: {extra:?}"
    );
    proxy.shutdown().await;
}

const ADMIN_PAGE: &str = include_str!("../docs/src/reference/admin-api.md");

/// `(method, path)` of every row of the admin API table.
fn admin_routes() -> Vec<(String, String)> {
    ADMIN_PAGE
        .lines()
        .filter(|l| l.starts_with("| `"))
        .filter_map(|l| {
            let route = l.split('`').nth(1)?;
            let (method, path) = route.split_once(' ')?;
            Some((method.to_string(), path.to_string()))
        })
        .collect()
}

#[tokio::test]
async fn admin_reference_lists_the_routes_that_answer() {
    let backend = TestBackend::spawn("a").await;
    let proxy = start_proxy(config_for(&[&backend])).await;
    let routes = admin_routes();
    assert!(routes.len() >= 6, "{routes:?}");
    for (method, path) in routes {
        let path = path.replace("{name}", "a").replace("{key}", "s1");
        let (status, _, body) = fetch(&client(), &method, &proxy.admin_url(&path), &[], "").await;
        assert!(
            status.is_success(),
            "documented `{method} {path}` answered {status}: {}",
            String::from_utf8_lossy(&body)
        );
    }
    for (method, path) in [
        ("GET", "/admin/unlisted"),
        ("POST", "/admin/backends/a/restart"),
    ] {
        let (status, _, _) = fetch(&client(), method, &proxy.admin_url(path), &[], "").await;
        assert_eq!(
            status, 404,
            "`{method} {path}` is not on the page, so it must not answer"
        );
    }
    proxy.shutdown().await;
}
