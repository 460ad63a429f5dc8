//! Health: active probes with hysteresis, and passive ejection from what the data path sees.
//!
//! A backend leaves the pool after `unhealthy_threshold` failed probes in a row, or at once on a
//! connect error, or after `eject_after_5xx` consecutive 5xx responses; it comes back only after
//! `healthy_threshold` good probes in a row. In-flight counters are never touched here.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full};

use super::config::HealthConfig;
use super::metrics::ErrorKind;
use super::routing::Backend;
use super::Inner;
use crate::shutdown::Shutdown;

/// Probes every backend of the current pool each interval until `stop` fires.
pub async fn run(inner: Arc<Inner>, mut stop: Shutdown) {
    let mut next = tokio::time::Instant::now();
    loop {
        let pool = inner.router.pool();
        let cfg = pool.health.clone();
        if cfg.interval_ms == 0 {
            // Active checks off; look again later in case a reload turns them on.
            next += Duration::from_secs(1);
        } else {
            let client = inner.client.read().clone();
            let probes = pool
                .backends
                .iter()
                .map(|b| probe(&client, b.clone(), &cfg));
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

async fn probe(
    client: &super::upstream::UpstreamClient,
    backend: Arc<Backend>,
    cfg: &HealthConfig,
) {
    let uri = format!("{}{}", backend.url, cfg.path);
    let result = async {
        let uri: Uri = uri.parse().map_err(|e| format!("bad probe URI: {e}"))?;
        let req = Request::get(uri)
            .body(Full::new(Bytes::new()))
            .map_err(|e| e.to_string())?;
        let resp = client.request(req).await.map_err(|e| e.to_string())?;
        let status = resp.status();
        // Read the small body so the connection can be reused.
        let _ = resp.into_body().collect().await;
        if status.is_success() {
            Ok(())
        } else {
            Err(format!("status {status}"))
        }
    };
    let outcome = match tokio::time::timeout(Duration::from_millis(cfg.timeout_ms), result).await {
        Ok(r) => r,
        Err(_) => Err(format!("no answer within {} ms", cfg.timeout_ms)),
    };
    record_probe(&backend, outcome, cfg);
}

/// Applies one probe result with hysteresis.
pub fn record_probe(backend: &Backend, outcome: Result<(), String>, cfg: &HealthConfig) {
    let mut c = backend.health.lock();
    match outcome {
        Ok(()) => {
            c.probe_failures = 0;
            c.probe_successes = c.probe_successes.saturating_add(1);
            if !backend.healthy.load(Ordering::Relaxed)
                && c.probe_successes >= cfg.healthy_threshold
            {
                backend.consecutive_5xx.store(0, Ordering::Relaxed);
                backend.healthy.store(true, Ordering::Relaxed);
                tracing::info!(backend = %backend.name, "backend healthy again");
            }
        }
        Err(why) => {
            c.probe_successes = 0;
            c.probe_failures = c.probe_failures.saturating_add(1);
            if backend.healthy.load(Ordering::Relaxed)
                && c.probe_failures >= cfg.unhealthy_threshold
            {
                backend.healthy.store(false, Ordering::Relaxed);
                tracing::warn!(backend = %backend.name, reason = %why, failures = c.probe_failures, "backend unhealthy: health checks failed");
            }
        }
    }
}

/// Passive ejection works only with active checks on, since only probes bring a backend back.
fn eject(backend: &Backend, why: &str) {
    if backend.healthy.swap(false, Ordering::Relaxed) {
        backend.health.lock().probe_successes = 0;
        tracing::warn!(backend = %backend.name, reason = why, "backend ejected");
    }
}

/// A request to the backend failed before any response.
pub fn on_error(backend: &Backend, kind: ErrorKind, cfg: &HealthConfig) {
    if cfg.interval_ms == 0 {
        return;
    }
    match kind {
        ErrorKind::Connect => eject(backend, "connect error"),
        _ => on_failure_status(backend, cfg, "request failed"),
    }
}

/// A response head arrived: 5xx in a row eject, anything else resets the count.
pub fn on_response(backend: &Backend, status: StatusCode, cfg: &HealthConfig) {
    if status.is_server_error() {
        if cfg.interval_ms > 0 {
            on_failure_status(backend, cfg, "consecutive 5xx responses");
        }
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
