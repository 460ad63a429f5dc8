//! The picker's endpoints from a Kubernetes `InferencePool` (`inference.networking.k8s.io/v1`):
//! read the pool's `selector.matchLabels` and `targetPorts`, list the pods the selector
//! matches, then follow both the pods and the pool through watches. A pod is an endpoint
//! (`podIP:port` for each target port) while it has an IP, runs, is Ready and is not being
//! deleted. Every change of the endpoint set is handed to `apply`.
//!
//! A watch that ends is reopened from the last resource version (after a growing delay when
//! it ended soon without news); `410 Gone` and a changed selector or port list start over from
//! a list; any other error is logged with its cause and retried after a growing delay, the
//! last endpoints staying in place meanwhile. Pods are kept by name, so an event costs what
//! its pod costs; a new endpoint set is built only when the ready set changed.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::time::Duration;

use serde::Deserialize;
use tokio::time::Instant;

use super::backoff::Backoff;
use super::kube::{
    encode, ApiClient, KubeError, StatusObject, WatchEvent, WatchStream, WATCH_SECONDS,
};
use super::pool_metrics::{BackoffCase, RelistReason, WatchMetrics};
use crate::proxy::config::{api_server_url, BackendConfig, InferencePoolConfig};
use crate::remote::ServerUrl;
use crate::shutdown::Shutdown;

/// Pods asked for per list page.
const LIST_PAGE_PODS: usize = 100;
const BACKOFF_MIN: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// A session or watch that ran this long was healthy: the next retry starts from `BACKOFF_MIN`.
const HEALTHY_AFTER: Duration = Duration::from_secs(30);
/// Pod changes within this long are published as one endpoint set: a rollout of thousands of
/// pods rebuilds the set a few times a second, not once per event.
const PUBLISH_EVERY: Duration = Duration::from_millis(100);
/// Events handled before the watch yields to placement when they arrive faster than it reads.
const YIELD_EVERY: u32 = 64;

/// Why a watch session stopped with an error.
#[derive(Debug, thiserror::Error)]
pub(crate) enum WatchError {
    /// The API server could not be reached or answered badly.
    #[error(transparent)]
    Kube(#[from] KubeError),
    /// The pool's spec is not one the picker can use.
    #[error("InferencePool {pool}: {reason}")]
    Pool { pool: String, reason: String },
    /// More pods match than `max_pods`.
    #[error("InferencePool {pool}: more than epp.inference_pool.max_pods ({max}) pods match its selector")]
    TooManyPods { pool: String, max: usize },
    /// The API server sent an `ERROR` event.
    #[error("{what}: the API server reported an error: {message}")]
    Event { what: &'static str, message: String },
}

/// Where the pool is, resolved at start (namespace file, service environment).
#[derive(Debug, Clone)]
pub(crate) struct Target {
    pub server: ServerUrl,
    pub namespace: String,
    pub config: InferencePoolConfig,
}

impl Target {
    /// Fills in the namespace and the API server the config leaves out, from the pod's
    /// service account and the service environment; the error names the field.
    pub(crate) fn resolve(config: &InferencePoolConfig) -> Result<Self, String> {
        let namespace = match &config.namespace {
            Some(ns) => ns.clone(),
            None => {
                let path = std::path::Path::new(crate::proxy::config::SERVICE_ACCOUNT_DIR)
                    .join("namespace");
                let text = std::fs::read_to_string(&path).map_err(|e| {
                    format!(
                        "epp.inference_pool.namespace: not set, and the pod's namespace cannot be read from {}: {e}",
                        path.display()
                    )
                })?;
                text.trim().to_string()
            }
        };
        let url = match &config.api_server {
            Some(url) => url.clone(),
            None => {
                let var = |name: &str| {
                    std::env::var(name).map_err(|_| {
                        format!("epp.inference_pool.api_server: not set, and {name} is not in the environment (not in a cluster?)")
                    })
                };
                let host = var("KUBERNETES_SERVICE_HOST")?;
                let port = var("KUBERNETES_SERVICE_PORT")?;
                let host = if host.contains(':') {
                    format!("[{host}]")
                } else {
                    host
                };
                format!("https://{host}:{port}")
            }
        };
        let server = api_server_url(&url)
            .map_err(|why| format!("epp.inference_pool.api_server: {why}, got {url:?}"))?;
        Ok(Self {
            server,
            namespace,
            config: config.clone(),
        })
    }

    fn pool_name(&self) -> String {
        format!("{}/{}", self.namespace, self.config.name)
    }

    fn pool_path(&self) -> String {
        format!(
            "/apis/inference.networking.k8s.io/v1/namespaces/{}/inferencepools/{}",
            self.namespace, self.config.name
        )
    }

    fn pool_watch_path(&self, rv: &str) -> String {
        format!(
            "/apis/inference.networking.k8s.io/v1/namespaces/{}/inferencepools?fieldSelector={}&{}",
            self.namespace,
            encode(&format!("metadata.name={}", self.config.name)),
            watch_params(rv)
        )
    }

    fn pods_path(&self, selector: &str) -> String {
        format!(
            "/api/v1/namespaces/{}/pods?labelSelector={}",
            self.namespace,
            encode(selector)
        )
    }
}

fn watch_params(rv: &str) -> String {
    format!(
        "watch=true&resourceVersion={}&allowWatchBookmarks=true&timeoutSeconds={WATCH_SECONDS}",
        encode(rv)
    )
}

/// The parts of a Kubernetes object's metadata the watch reads.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Meta {
    #[serde(default)]
    name: String,
    #[serde(default)]
    resource_version: String,
    #[serde(default)]
    deletion_timestamp: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct InferencePool {
    #[serde(default)]
    metadata: Meta,
    spec: PoolSpecJson,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct PoolSpecJson {
    selector: Selector,
    target_ports: Vec<Port>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Selector {
    #[serde(default)]
    match_labels: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize)]
struct Port {
    number: u32,
}

/// What the pods are selected by and where they listen.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PoolSpec {
    /// `k=v,k=v`, sorted.
    selector: String,
    ports: Vec<u16>,
}

impl PoolSpec {
    fn of(pool: &InferencePool, name: &str) -> Result<Self, WatchError> {
        let bad = |reason: String| WatchError::Pool {
            pool: name.to_string(),
            reason,
        };
        let labels = &pool.spec.selector.match_labels;
        if labels.is_empty() {
            return Err(bad(
                "spec.selector.matchLabels is empty (it would select every pod)".into(),
            ));
        }
        let selector = labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",");
        let mut ports = Vec::new();
        for p in &pool.spec.target_ports {
            match u16::try_from(p.number) {
                Ok(n) if n > 0 => ports.push(n),
                _ => return Err(bad(format!("spec.targetPorts: {} is not a port", p.number))),
            }
        }
        if ports.is_empty() {
            return Err(bad("spec.targetPorts is empty".into()));
        }
        ports.sort_unstable();
        ports.dedup();
        Ok(Self { selector, ports })
    }
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Pod {
    #[serde(default)]
    metadata: Meta,
    #[serde(default)]
    status: PodStatus,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct PodStatus {
    #[serde(rename = "podIP", default)]
    pod_ip: Option<String>,
    #[serde(default)]
    phase: Option<String>,
    #[serde(default)]
    conditions: Vec<Condition>,
}

#[derive(Debug, Deserialize)]
struct Condition {
    #[serde(rename = "type")]
    kind: String,
    status: String,
}

impl Pod {
    /// The pod's IP when it can take requests: running, Ready, not being deleted.
    fn ready_ip(&self) -> Option<IpAddr> {
        let s = &self.status;
        let ready = s
            .conditions
            .iter()
            .any(|c| c.kind == "Ready" && c.status == "True");
        if self.metadata.deletion_timestamp.is_some()
            || s.phase.as_deref() != Some("Running")
            || !ready
        {
            return None;
        }
        s.pod_ip.as_deref()?.parse().ok()
    }
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct PodList {
    #[serde(default)]
    metadata: ListMeta,
    #[serde(default)]
    items: Vec<Pod>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ListMeta {
    #[serde(default)]
    resource_version: String,
    #[serde(default, rename = "continue")]
    continue_token: Option<String>,
}

/// The pods the selector matches: name → IP when ready.
type Pods = HashMap<String, Option<IpAddr>>;

/// The endpoints of `pods`, sorted: one per ready pod and target port, named `pod:port`.
fn endpoints(pods: &Pods, ports: &[u16]) -> Vec<BackendConfig> {
    let mut list: Vec<BackendConfig> = pods
        .iter()
        .filter_map(|(name, ip)| Some((name, (*ip)?)))
        .flat_map(|(name, ip)| {
            ports.iter().map(move |port| BackendConfig {
                name: format!("{name}:{port}"),
                url: format!("http://{}", std::net::SocketAddr::new(ip, *port)),
                weight: 1.0,
            })
        })
        .collect();
    list.sort_by(|a, b| a.name.cmp(&b.name));
    list
}

/// A session ended without an error: start over from a list.
enum Relist {
    Expired,
    PoolChanged,
}

impl Relist {
    fn why(&self) -> &'static str {
        match self {
            Relist::Expired => "the resource version expired (410 Gone)",
            Relist::PoolChanged => "the pool's selector or ports changed",
        }
    }
}

/// Follows the pool until `shutdown` fires, handing every new endpoint set to `apply`.
pub(crate) async fn run(
    target: Target,
    apply: impl Fn(Vec<BackendConfig>) + Send,
    metrics: WatchMetrics,
    mut shutdown: Shutdown,
) {
    let m = &metrics;
    let mut last: Option<Vec<BackendConfig>> = None;
    let mut publish = |list: Vec<BackendConfig>| {
        if last.as_ref() != Some(&list) {
            tracing::info!(pool = %target.pool_name(), endpoints = list.len(), "InferencePool endpoints changed");
            m.published(list.len());
            last = Some(list.clone());
            apply(list);
        }
    };
    let mut backoff = Backoff::new(BACKOFF_MIN, BACKOFF_MAX);
    loop {
        let started = Instant::now();
        let result = tokio::select! {
            _ = shutdown.wait() => return,
            r = session(&target, &mut publish, m) => r,
        };
        if started.elapsed() >= HEALTHY_AFTER {
            backoff.reset();
        }
        let delay = backoff.next_delay();
        m.backoff(BackoffCase::SessionEnded);
        match result {
            Err(WatchError::Kube(e)) if e.is_gone() => {
                m.relist(RelistReason::Expired);
                tracing::info!(pool = %target.pool_name(), reason = %e, retry_in = ?delay, "listing the pool's pods again")
            }
            Ok(relist) => {
                m.relist(match relist {
                    Relist::Expired => RelistReason::Expired,
                    Relist::PoolChanged => RelistReason::PoolChanged,
                });
                tracing::info!(pool = %target.pool_name(), reason = relist.why(), retry_in = ?delay, "listing the pool's pods again")
            }
            Err(e) => {
                m.error();
                m.relist(RelistReason::Error);
                tracing::warn!(pool = %target.pool_name(), error = %e, retry_in = ?delay, "InferencePool watch failed; keeping the last endpoints")
            }
        }
        tokio::select! {
            _ = shutdown.wait() => return,
            _ = tokio::time::sleep(delay) => {}
        }
    }
}

/// One pass: read the pool, list its pods, then follow both watches until something needs a
/// fresh list.
async fn session(
    target: &Target,
    publish: &mut impl FnMut(Vec<BackendConfig>),
    m: &WatchMetrics,
) -> Result<Relist, WatchError> {
    let c = &target.config;
    let client = ApiClient::new(
        target.server.clone(),
        &c.ca_file,
        &c.token_file,
        c.max_event_bytes,
    )?;
    let name = target.pool_name();
    let pool: InferencePool = client.get(&target.pool_path(), c.max_event_bytes).await?;
    let spec = PoolSpec::of(&pool, &name)?;
    let pool_rv = pool.metadata.resource_version;

    let (pods, pods_rv) = list_pods(&client, target, &spec.selector, m).await?;
    m.success();
    publish(endpoints(&pods, &spec.ports));

    let pool_watch = Follow::new(&client, m, pool_rv, |rv| target.pool_watch_path(rv));
    let pods_path = target.pods_path(&spec.selector);
    let pod_watch = Follow::new(&client, m, pods_rv, |rv| {
        format!("{pods_path}&{}", watch_params(rv))
    });
    tokio::select! {
        r = follow_pool(pool_watch, &spec, &name) => r,
        r = follow_pods(pod_watch, pods, &spec, &name, c.max_pods, publish) => r,
    }
}

/// The pool's watch: its spec must stay the one the pods were listed for.
async fn follow_pool(
    mut watch: Follow<'_, impl Fn(&str) -> String>,
    spec: &PoolSpec,
    name: &str,
) -> Result<Relist, WatchError> {
    loop {
        let event = watch.next().await?;
        match event.kind.as_str() {
            "ADDED" | "MODIFIED" => {
                let pool: InferencePool = object(&event, "InferencePool")?;
                watch.rv = pool.metadata.resource_version.clone();
                if PoolSpec::of(&pool, name)? != *spec {
                    return Ok(Relist::PoolChanged);
                }
            }
            "BOOKMARK" => {
                watch.rv = object::<Bookmark>(&event, "bookmark")?
                    .metadata
                    .resource_version
            }
            "DELETED" => {
                return Err(WatchError::Pool {
                    pool: name.to_string(),
                    reason: "deleted".into(),
                })
            }
            "ERROR" => return gone_or_error(&event, "InferencePool watch"),
            _ => {}
        }
    }
}

/// The pods' watch: each event updates its pod alone; a new endpoint set is built and
/// published only when a pod's readiness or IP changed, at most every `PUBLISH_EVERY`.
async fn follow_pods(
    mut watch: Follow<'_, impl Fn(&str) -> String>,
    mut pods: Pods,
    spec: &PoolSpec,
    name: &str,
    max_pods: usize,
    publish: &mut impl FnMut(Vec<BackendConfig>),
) -> Result<Relist, WatchError> {
    let mut changed = false;
    let mut published_at = Instant::now();
    let mut handled: u32 = 0;
    loop {
        let event = tokio::select! {
            biased;
            _ = tokio::time::sleep_until(published_at + PUBLISH_EVERY), if changed => {
                publish(endpoints(&pods, &spec.ports));
                (changed, published_at) = (false, Instant::now());
                continue;
            }
            event = watch.next() => event?,
        };
        match event.kind.as_str() {
            "ADDED" | "MODIFIED" => {
                let pod: Pod = object(&event, "pod")?;
                watch.rv = pod.metadata.resource_version.clone();
                if !pods.contains_key(&pod.metadata.name) && pods.len() >= max_pods {
                    return Err(WatchError::TooManyPods {
                        pool: name.to_string(),
                        max: max_pods,
                    });
                }
                let ip = pod.ready_ip();
                changed |= pods.insert(pod.metadata.name, ip).flatten() != ip;
            }
            "DELETED" => {
                let pod: Pod = object(&event, "pod")?;
                watch.rv = pod.metadata.resource_version;
                changed |= pods.remove(&pod.metadata.name).flatten().is_some();
            }
            "BOOKMARK" => {
                watch.rv = object::<Bookmark>(&event, "bookmark")?
                    .metadata
                    .resource_version
            }
            "ERROR" => return gone_or_error(&event, "pod watch"),
            _ => {}
        }
        // Events already buffered never wait on the socket: let placement run between them.
        handled = handled.wrapping_add(1);
        if handled % YIELD_EVERY == 0 {
            tokio::task::yield_now().await;
        }
    }
}

/// One watch kept open: reopened from the last resource version when the API server ends it,
/// at once after progress, after a growing delay when it ended soon with nothing new.
struct Follow<'a, P> {
    client: &'a ApiClient,
    m: &'a WatchMetrics,
    /// The path of a watch from a resource version.
    path: P,
    /// The resource version to go on from; the caller moves it with each event.
    rv: String,
    stream: Option<WatchStream>,
    /// `rv` and the time when the stream opened.
    opened: (String, Instant),
    backoff: Backoff,
    /// Not before this is the watch opened again.
    reopen_at: Instant,
}

impl<'a, P: Fn(&str) -> String> Follow<'a, P> {
    fn new(client: &'a ApiClient, m: &'a WatchMetrics, rv: String, path: P) -> Self {
        Self {
            client,
            m,
            path,
            opened: (rv.clone(), Instant::now()),
            rv,
            stream: None,
            backoff: Backoff::new(BACKOFF_MIN, BACKOFF_MAX),
            reopen_at: Instant::now(),
        }
    }

    /// The next event. Cancel-safe: a cancelled open is retried, a cancelled delay resumed.
    async fn next(&mut self) -> Result<WatchEvent, WatchError> {
        loop {
            let stream = match &mut self.stream {
                Some(stream) => stream,
                None => {
                    tokio::time::sleep_until(self.reopen_at).await;
                    let stream = self.client.watch(&(self.path)(&self.rv)).await?;
                    self.opened = (self.rv.clone(), Instant::now());
                    self.stream.insert(stream)
                }
            };
            if let Some(event) = stream.next().await? {
                self.m.event(&event.kind);
                return Ok(event);
            }
            self.stream = None;
            let (rv, at) = &self.opened;
            if *rv != self.rv || at.elapsed() >= HEALTHY_AFTER {
                self.backoff.reset();
                continue;
            }
            let delay = self.backoff.next_delay();
            self.m.backoff(BackoffCase::WatchEndedEarly);
            tracing::info!(rv = %self.rv, retry_in = ?delay, "the API server ended a watch without a change; reopening it after a delay");
            self.reopen_at = Instant::now() + delay;
        }
    }
}

/// A `BOOKMARK` event's object: only its resource version matters.
#[derive(Debug, Deserialize)]
struct Bookmark {
    #[serde(default)]
    metadata: Meta,
}

fn object<T: serde::de::DeserializeOwned>(event: &WatchEvent, what: &str) -> Result<T, WatchError> {
    serde_json::from_str(event.object.get()).map_err(|e| {
        KubeError::Json {
            what: format!("{} event: {what}", event.kind),
            reason: e.to_string(),
        }
        .into()
    })
}

/// An `ERROR` event: `410` means the resource version expired (list again); anything else
/// is an error.
fn gone_or_error(event: &WatchEvent, what: &'static str) -> Result<Relist, WatchError> {
    let status: StatusObject = object(event, "Status")?;
    if status.code == 410 {
        return Ok(Relist::Expired);
    }
    Err(WatchError::Event {
        what,
        message: format!("{} {}", status.code, status.message),
    })
}

/// Lists the matching pods page by page; the resource version to watch from is the list's.
/// An empty page that still has a `continue` token, or an expired token (the list starts
/// over), is followed after a growing delay.
async fn list_pods(
    client: &ApiClient,
    target: &Target,
    selector: &str,
    m: &WatchMetrics,
) -> Result<(Pods, String), WatchError> {
    let c = &target.config;
    let mut pods = Pods::new();
    let mut token: Option<String> = None;
    let mut backoff = Backoff::new(BACKOFF_MIN, BACKOFF_MAX);
    let mut wait = |case: BackoffCase| {
        let delay = backoff.next_delay();
        m.backoff(case);
        tracing::info!(pool = %target.pool_name(), after = ?case, retry_in = ?delay, "listing the pool's pods: the API server gave nothing; asking again after a delay");
        tokio::time::sleep(delay)
    };
    // A page holds up to LIST_PAGE_PODS pods of at most max_event_bytes each.
    let page_limit = c.max_event_bytes.saturating_mul(LIST_PAGE_PODS);
    loop {
        let mut path = format!("{}&limit={LIST_PAGE_PODS}", target.pods_path(selector));
        if let Some(t) = &token {
            path.push_str(&format!("&continue={}", encode(t)));
        }
        let page: PodList = match client.get(&path, page_limit).await {
            // The continue token expired between pages: start the list again.
            Err(e) if e.is_gone() && token.is_some() => {
                pods.clear();
                token = None;
                wait(BackoffCase::ContinueExpired).await;
                continue;
            }
            r => r?,
        };
        let empty = page.items.is_empty();
        for pod in page.items {
            if pods.len() >= c.max_pods {
                return Err(WatchError::TooManyPods {
                    pool: target.pool_name(),
                    max: c.max_pods,
                });
            }
            let ip = pod.ready_ip();
            pods.insert(pod.metadata.name, ip);
        }
        match page.metadata.continue_token.filter(|t| !t.is_empty()) {
            Some(t) => {
                if empty {
                    wait(BackoffCase::EmptyListPage).await;
                }
                token = Some(t);
            }
            None => return Ok((pods, page.metadata.resource_version)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(json: serde_json::Value) -> Pod {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn only_a_running_ready_undeleted_pod_with_an_ip_is_an_endpoint() {
        let ready = serde_json::json!({"metadata": {"name": "a"}, "status": {"podIP": "10.0.0.1",
            "phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}});
        assert_eq!(
            pod(ready.clone()).ready_ip(),
            Some("10.0.0.1".parse().unwrap())
        );
        let mut v = ready.clone();
        v["status"]["conditions"][0]["status"] = "False".into();
        assert_eq!(pod(v).ready_ip(), None, "not ready");
        let mut v = ready.clone();
        v["status"]["phase"] = "Pending".into();
        assert_eq!(pod(v).ready_ip(), None, "not running");
        let mut v = ready.clone();
        v["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z".into();
        assert_eq!(pod(v).ready_ip(), None, "being deleted");
        let mut v = ready;
        v["status"]["podIP"] = serde_json::Value::Null;
        assert_eq!(pod(v).ready_ip(), None, "no IP");
    }

    #[test]
    fn each_ready_pod_is_an_endpoint_at_every_target_port() {
        let pods: Pods = [
            ("b".to_string(), Some("10.0.0.2".parse().unwrap())),
            ("a".to_string(), Some("10.0.0.1".parse().unwrap())),
            ("c".to_string(), None),
        ]
        .into();
        let urls: Vec<String> = endpoints(&pods, &[8000, 8001])
            .into_iter()
            .map(|b| format!("{}={}", b.name, b.url))
            .collect();
        assert_eq!(
            urls,
            [
                "a:8000=http://10.0.0.1:8000",
                "a:8001=http://10.0.0.1:8001",
                "b:8000=http://10.0.0.2:8000",
                "b:8001=http://10.0.0.2:8001"
            ]
        );
    }
}
