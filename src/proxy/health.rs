//! Health: active probes with hysteresis, and passive ejection from what the data path sees.
//!
//! A backend leaves the pool after `unhealthy_threshold` failed probes in a row, or at once on a
//! connect error, or after `eject_after_5xx` consecutive 5xx responses. With probes on it comes
//! back only after `healthy_threshold` good probes in a row; with them off, after `ejection_ms`.
//! In-flight counters are never touched here.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::uri::PathAndQuery;
use http::{HeaderValue, Method, StatusCode};
use http_body_util::{BodyExt, Limited};

use super::capacity;
use super::config::{BackendUrl, HealthConfig};
use super::fields::OutboundFields;
use super::held_body::HeldBody;
use super::metrics::ErrorKind;
use super::pool::{PoolError, UpstreamRequest, UpstreamResponse, WorkerPool};
use super::routing::{Backend, HealthCounters};
use super::Inner;
use crate::http1::WireFields;
use crate::shutdown::Shutdown;

/// Probes every backend of the current pool each interval until `stop` fires.
pub(crate) async fn run(inner: Arc<Inner>, mut stop: Shutdown) {
    let mut next = tokio::time::Instant::now();
    loop {
        let pool = inner.router.pool();
        let cfg = pool.health.clone();
        if cfg.interval_ms == 0 {
            // No probes: time brings ejected backends back. Look again within one ejection
            // period (an ejection may come meanwhile) and at least each second, in case a
            // reload turns probes on.
            let now = Instant::now();
            let step = Duration::from_millis(cfg.ejection_ms).min(Duration::from_secs(1));
            let due = readmit_ejected(&pool.backends, &cfg, now);
            next = due.map_or(now + step, |due| due.min(now + step)).into();
        } else {
            let connections = inner.probe_pool.read().clone();
            let via = inner.via.entry(http::Version::HTTP_11);
            let probes = pool
                .backends
                .iter()
                .map(|b| probe(&connections, b.clone(), &cfg, via));
            futures_util::future::join_all(probes).await;
            next += Duration::from_millis(cfg.interval_ms);
        }
        let now = tokio::time::Instant::now();
        if next < now {
            next = now;
        }
        tokio::select! {
            _ = stop.wait() => return,
            _ = tokio::time::sleep_until(next) => {}
        }
    }
}

/// Probes one backend. A probe carries the proxy's `Via` entry, so a backend that is the proxy
/// itself (or leads back to it) answers 508 and is taken out, the log saying why.
async fn probe(
    connections: &Arc<WorkerPool>,
    backend: Arc<Backend>,
    cfg: &HealthConfig,
    via: &HeaderValue,
) {
    let result = async {
        let path: PathAndQuery = cfg
            .path
            .parse()
            .map_err(|e| format!("bad probe path {}: {e}", cfg.path))?;
        let resp = get(connections, &backend.url, &path, via)
            .await
            .map_err(|e| e.to_string())?;
        // Read the small body so the connection can be reused.
        let _ = resp.body.collect().await;
        if resp.status.is_success() {
            Ok(())
        } else if resp.status == StatusCode::LOOP_DETECTED {
            Err(
                "status 508 Loop Detected: the probe came back to this proxy, so the backend \
                 is this proxy itself or leads back to it"
                    .to_string(),
            )
        } else {
            Err(format!("status {}", resp.status))
        }
    };
    let outcome = match tokio::time::timeout(Duration::from_millis(cfg.timeout_ms), result).await {
        Ok(r) => r,
        Err(_) => Err(format!("no answer within {} ms", cfg.timeout_ms)),
    };
    let healthy = outcome.is_ok();
    record_probe(&backend, outcome, cfg);
    // Apart from the probe, so a slow answer about the cache never fails one.
    if healthy && backend.kv_cache.asking() {
        learn_kv_cache(
            connections,
            &backend,
            Duration::from_millis(cfg.timeout_ms),
            via,
        )
        .await;
    }
}

/// `GET path` on a backend, with no header of a client's; only the proxy's `Via` entry.
async fn get(
    connections: &Arc<WorkerPool>,
    url: &BackendUrl,
    path: &PathAndQuery,
    via: &HeaderValue,
) -> Result<UpstreamResponse, PoolError> {
    let added = vec![(http::header::VIA, via.clone())];
    let headers = OutboundFields::new(WireFields::default(), &[], added);
    let req = UpstreamRequest {
        method: &Method::GET,
        path_and_query: path,
        headers: &headers,
        body: &HeldBody::default(),
        declare_length: false,
        sent_at: tokio::time::Instant::now(),
    };
    connections.send(url, req).await
}

/// Asks a healthy backend for its KV cache size where each engine states it
/// ([`capacity::KV_PATHS`], in turn, each within `timeout`), until one answer does; logs once
/// when none can.
async fn learn_kv_cache(
    connections: &Arc<WorkerPool>,
    backend: &Backend,
    timeout: Duration,
    via: &HeaderValue,
) {
    let (mut failed, mut not_yet) = (false, false);
    for i in 0..capacity::KV_PATHS.len() {
        if !backend.kv_cache.ask(i) {
            continue;
        }
        let answer = tokio::time::timeout(timeout, ask_kv_cache(connections, backend, i, via));
        match answer.await.unwrap_or(Answer::Failed) {
            Answer::Failed => failed = true,
            Answer::Said(capacity::Reading::NotYet) => not_yet = true,
            Answer::Said(capacity::Reading::Silent) => backend.kv_cache.silent(i),
            Answer::Said(capacity::Reading::Size(tokens, source)) => {
                backend.kv_cache_tokens.store(tokens, Ordering::Relaxed);
                backend.kv_cache.stated(source);
                tracing::info!(backend = %backend.name, tokens, source = source.as_str(), "KV cache size read from the engine");
                return;
            }
        }
    }
    if backend.kv_cache.round_ended(failed, not_yet) {
        tracing::warn!(backend = %backend.name, paths = ?capacity::KV_PATHS, "KV cache size unknown: the engine states it at none of these paths; placement treats it as unknown (affinity.kv_cache_tokens sets it)");
    }
}

/// What one path of a backend said about its KV cache.
enum Answer {
    /// An answer, stating the size or not.
    Said(capacity::Reading),
    /// No answer worth keeping (a 5xx, a broken or oversized body): ask again.
    Failed,
}

/// `GET KV_PATHS[path]` on `backend`, and what its answer states.
async fn ask_kv_cache(
    connections: &Arc<WorkerPool>,
    backend: &Backend,
    path: usize,
    via: &HeaderValue,
) -> Answer {
    let uri = PathAndQuery::from_static(capacity::KV_PATHS[path]);
    let Ok(resp) = get(connections, &backend.url, &uri, via).await else {
        return Answer::Failed;
    };
    // 501 is llama-server's answer for an endpoint it was started without: that is final.
    if resp.status.is_server_error() && resp.status != StatusCode::NOT_IMPLEMENTED {
        return Answer::Failed;
    }
    // Read in full (bounded) either way, so the connection can be reused.
    let Ok(body) = Limited::new(resp.body, capacity::MAX_ANSWER_BYTES)
        .collect()
        .await
    else {
        return Answer::Failed;
    };
    if !resp.status.is_success() {
        return Answer::Said(capacity::Reading::Silent);
    }
    Answer::Said(capacity::read(path, &body.to_bytes()))
}

/// Applies one probe result with hysteresis.
pub(crate) fn record_probe(backend: &Backend, outcome: Result<(), String>, cfg: &HealthConfig) {
    let mut c = backend.health.lock();
    match outcome {
        Ok(()) => {
            c.probe_failures = 0;
            c.probe_successes = c.probe_successes.saturating_add(1);
            if !backend.healthy.load(Ordering::Relaxed)
                && c.probe_successes >= cfg.healthy_threshold
            {
                bring_back(backend, &mut c);
                tracing::info!(backend = %backend.name, "backend healthy again");
            }
        }
        Err(why) => {
            c.probe_successes = 0;
            c.probe_failures = c.probe_failures.saturating_add(1);
            if backend.healthy.load(Ordering::Relaxed)
                && c.probe_failures >= cfg.unhealthy_threshold
            {
                take_out(backend, &mut c);
                tracing::warn!(backend = %backend.name, reason = %why, failures = c.probe_failures, "backend unhealthy: health checks failed");
            }
        }
    }
}

/// `take_out` and `bring_back` are the only writers of `healthy`, each under the backend's health
/// lock, so a backend that is out always has the time it went out.
fn take_out(backend: &Backend, c: &mut HealthCounters) {
    c.probe_successes = 0;
    c.out_since = Some(Instant::now());
    backend.healthy.store(false, Ordering::Relaxed);
}

/// Returns a backend to the pool with a clean slate: no 5xx run, no failed probes.
fn bring_back(backend: &Backend, c: &mut HealthCounters) {
    c.out_since = None;
    c.probe_failures = 0;
    backend.consecutive_5xx.store(0, Ordering::Relaxed);
    backend.healthy.store(true, Ordering::Relaxed);
}

/// With probes off, returns each backend that has been out for `ejection_ms` to the pool, and
/// gives the earliest time another one is due. The period counts from when the backend went
/// out, also when probes took it out before a reload turned them off.
fn readmit_ejected(backends: &[Arc<Backend>], cfg: &HealthConfig, now: Instant) -> Option<Instant> {
    let period = Duration::from_millis(cfg.ejection_ms);
    let mut next: Option<Instant> = None;
    for backend in backends {
        if backend.healthy.load(Ordering::Relaxed) {
            continue;
        }
        let mut c = backend.health.lock();
        // A backend marked out some other way starts its period now, so none stays out for ever.
        let due = *c.out_since.get_or_insert(now) + period;
        if due <= now {
            bring_back(backend, &mut c);
            tracing::info!(backend = %backend.name, ejection_ms = cfg.ejection_ms, "backend takes requests again after its ejection period");
        } else {
            next = Some(next.map_or(due, |n| n.min(due)));
        }
    }
    next
}

fn eject(backend: &Backend, why: &str) {
    let mut c = backend.health.lock();
    if backend.healthy.load(Ordering::Relaxed) {
        take_out(backend, &mut c);
        tracing::warn!(backend = %backend.name, reason = why, "backend ejected");
    }
}

/// A request to the backend failed before any response.
pub(crate) fn on_error(backend: &Backend, kind: ErrorKind, cfg: &HealthConfig) {
    match kind {
        ErrorKind::Connect => eject(backend, "connect error"),
        _ => on_failure_status(backend, cfg, "request failed"),
    }
}

/// A response head arrived: 5xx in a row eject, anything else resets the count.
pub(crate) fn on_response(backend: &Backend, status: StatusCode, cfg: &HealthConfig) {
    if status.is_server_error() {
        on_failure_status(backend, cfg, "consecutive 5xx responses");
    } else if backend.consecutive_5xx.load(Ordering::Relaxed) != 0 {
        backend.consecutive_5xx.store(0, Ordering::Relaxed);
    }
}

fn on_failure_status(backend: &Backend, cfg: &HealthConfig, why: &str) {
    if cfg.eject_after_5xx == 0 {
        return;
    }
    if backend.consecutive_5xx.fetch_add(1, Ordering::Relaxed) + 1 >= cfg.eject_after_5xx {
        eject(backend, why);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::config::BackendUrl;
    use crate::proxy::metrics::ProxyMetrics;

    fn backends(names: &[&str]) -> Vec<Arc<Backend>> {
        let metrics = ProxyMetrics::new();
        names
            .iter()
            .map(|n| {
                let url = BackendUrl::parse("http://127.0.0.1:1").unwrap();
                Arc::new(Backend::new(n, url, 1.0, metrics.backend(n)))
            })
            .collect()
    }

    fn without_probes(ejection_ms: u64) -> HealthConfig {
        HealthConfig {
            interval_ms: 0,
            ejection_ms,
            ..HealthConfig::default()
        }
    }

    fn healthy(b: &Backend) -> bool {
        b.healthy.load(Ordering::Relaxed)
    }

    #[test]
    fn without_probes_an_ejected_backend_returns_after_the_ejection_period_and_not_before() {
        let cfg = without_probes(1_000);
        let pool = backends(&["a", "b"]);
        on_error(&pool[0], ErrorKind::Connect, &cfg);
        assert!(!healthy(&pool[0]), "a connect error ejects without probes");
        let out_since = pool[0].health.lock().out_since.unwrap();
        let period = Duration::from_millis(1_000);

        let almost = out_since + period - Duration::from_millis(1);
        assert_eq!(
            readmit_ejected(&pool, &cfg, almost),
            Some(out_since + period)
        );
        assert!(!healthy(&pool[0]), "still out 1 ms before the period ends");

        assert_eq!(readmit_ejected(&pool, &cfg, out_since + period), None);
        assert!(healthy(&pool[0]) && healthy(&pool[1]));
        assert_eq!(pool[0].health.lock().out_since, None);
    }

    #[test]
    fn a_readmitted_backend_needs_the_full_5xx_run_again_to_be_ejected() {
        let cfg = HealthConfig {
            eject_after_5xx: 2,
            ..without_probes(10)
        };
        let pool = backends(&["a"]);
        for _ in 0..2 {
            on_response(&pool[0], StatusCode::SERVICE_UNAVAILABLE, &cfg);
        }
        assert!(!healthy(&pool[0]), "two 5xx in a row eject");
        let out_since = pool[0].health.lock().out_since.unwrap();
        readmit_ejected(&pool, &cfg, out_since + Duration::from_millis(10));
        assert!(healthy(&pool[0]));
        on_response(&pool[0], StatusCode::SERVICE_UNAVAILABLE, &cfg);
        assert!(
            healthy(&pool[0]),
            "one 5xx after coming back is not a run of two"
        );
    }

    #[test]
    fn a_backend_probes_took_out_before_probes_were_turned_off_still_comes_back() {
        let probing = HealthConfig {
            interval_ms: 1_000,
            unhealthy_threshold: 1,
            ..HealthConfig::default()
        };
        let pool = backends(&["a"]);
        record_probe(&pool[0], Err("status 503".into()), &probing);
        assert!(!healthy(&pool[0]));
        let out_since = pool[0].health.lock().out_since.unwrap();

        // A reload turns probes off: the period counts from when the probes took it out.
        let cfg = without_probes(500);
        let due = out_since + Duration::from_millis(500);
        assert_eq!(readmit_ejected(&pool, &cfg, out_since), Some(due));
        readmit_ejected(&pool, &cfg, due);
        assert!(healthy(&pool[0]));
    }

    #[test]
    fn with_probes_on_only_good_probes_in_a_row_bring_a_backend_back() {
        let probing = HealthConfig {
            interval_ms: 1_000,
            healthy_threshold: 2,
            ..HealthConfig::default()
        };
        let pool = backends(&["a"]);
        on_error(&pool[0], ErrorKind::Connect, &probing);
        assert!(!healthy(&pool[0]));
        record_probe(&pool[0], Ok(()), &probing);
        assert!(!healthy(&pool[0]), "one good probe is not enough");
        record_probe(&pool[0], Ok(()), &probing);
        assert!(healthy(&pool[0]));
        assert_eq!(pool[0].health.lock().out_since, None);
    }
}
