use std::time::Duration;

use super::*;
use crate::proxy::config::{AffinityConfig, BackendUrl, HealthConfig};
use crate::proxy::routing::{AffinitySettings, Backend};

fn render(m: &ProxyMetrics, backends: Vec<BackendMetrics>) -> String {
    let pool = Pool {
        backends: backends
            .into_iter()
            .map(|b| {
                let url = BackendUrl::parse("http://127.0.0.1:1").unwrap();
                Arc::new(Backend::new(&b.name.clone(), url, 1.0, b))
            })
            .collect(),
        affinity: AffinitySettings::from_config(&AffinityConfig::default()),
        health: HealthConfig::default(),
    };
    m.render(&pool, &SessionTable::new(16, Duration::from_secs(60)), None)
}

/// The values of every line of `series` (name and labels, exactly) in `text`.
fn values<'a>(text: &'a str, series: &str) -> Vec<&'a str> {
    text.lines()
        .filter_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .collect()
}

#[test]
fn a_backend_built_again_under_its_name_counts_on_in_one_series() {
    let m = ProxyMetrics::new();
    let first = m.backend("a");
    first.request(http::StatusCode::OK);
    first.latency(Duration::from_millis(2));
    // A reload that changes the URL builds the backend again, under the same name.
    let again = m.backend("a");
    again.request(http::StatusCode::OK);
    again.ttfb(Duration::from_millis(1));
    let text = render(&m, vec![again]);
    let ok = "agentrace_requests_total{backend=\"a\",status=\"200\"}";
    assert_eq!(values(&text, ok), ["2"]);
    let latency = "agentrace_upstream_latency_seconds_count{backend=\"a\"}";
    assert_eq!(values(&text, latency), ["1"]);
    let ttfb = "agentrace_upstream_ttfb_seconds_count{backend=\"a\"}";
    assert_eq!(values(&text, ttfb), ["1"]);
    let families = text
        .matches("# TYPE agentrace_upstream_ttfb_seconds ")
        .count();
    assert_eq!(families, 1, "{text}");
}

#[test]
fn decisions_and_overhead_counted_on_other_threads_reach_the_exposition() {
    let m = ProxyMetrics::new();
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..250 {
                    m.decision(KeySource::Header, Outcome::Hash);
                    m.overhead(Duration::from_micros(7));
                }
            });
        }
    });
    let text = render(&m, Vec::new());
    let decisions = "agentrace_affinity_decisions_total{source=\"header\",outcome=\"hash\"}";
    assert_eq!(values(&text, decisions), ["1000"]);
    let bucket = "agentrace_proxy_overhead_seconds_bucket{le=\"0.00001\"}";
    assert_eq!(values(&text, bucket), ["1000"]);
    assert_eq!(
        values(&text, "agentrace_proxy_overhead_seconds_count"),
        ["1000"]
    );
}

#[test]
fn a_backend_dropped_from_the_configuration_lets_its_series_go_keeping_its_200s() {
    let m = ProxyMetrics::new();
    let gone = m.backend("gone");
    gone.request(http::StatusCode::OK);
    gone.latency(Duration::from_millis(3));
    let stays = m.backend("stays");
    stays.request(http::StatusCode::OK);
    // No render between the 200 and the reload: the drop itself hands the count on.
    m.keep_backends(["stays"]);
    let text = render(&m, vec![stays.clone()]);
    let ok = "agentrace_requests_total{backend=\"gone\",status=\"200\"}";
    assert_eq!(values(&text, ok), ["1"]);
    let latency =
        |name: &str| format!("agentrace_upstream_latency_seconds_count{{backend=\"{name}\"}}");
    assert!(values(&text, &latency("gone")).is_empty(), "{text}");
    assert_eq!(values(&text, &latency("stays")), ["0"]);
    let back = m.backend("gone");
    back.request(http::StatusCode::OK);
    let text = render(&m, vec![stays, back]);
    assert_eq!(values(&text, ok), ["2"]);
    assert_eq!(values(&text, &latency("gone")), ["0"]);
}
