//! The picker's endpoints from an `InferencePool`, against a real HTTP server on `127.0.0.1:0`
//! playing the Kubernetes API: it serves the pool, pod lists with a resource version, and
//! watch streams (newline-delimited JSON) that replay its event log from the version asked for
//! and then carry every change the test makes. The picker is the real one, started in-process
//! with `epp.inference_pool.api_server` pointing there, and asked over real gRPC.
//!
//! Checked: endpoints follow pods becoming ready, not ready and deleted; only current
//! endpoints are placed; a `410 Gone` leads to a new list; a malformed or oversized watch line
//! is an error the watch recovers from by listing again; a changed `targetPorts` moves every
//! endpoint; the config refuses `backends` beside a pool and plain http to a non-loopback API
//! server, naming the field; over https the picker trusts the CA file and sends the token
//! file's bearer token.

mod support;

use std::collections::BTreeSet;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentrace::proxy::config::{HealthConfig, InferencePoolConfig};
use agentrace::proxy::ProxyConfig;
use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use support::epp::{self as fixture, Stream, TestEpp};
use tokio::sync::mpsc;

const NS: &str = "models";
const POOL: &str = "agentrace-models";
const SELECTOR: &str = "app.kubernetes.io/name=model-server";

type Body = BoxBody<Bytes, Infallible>;

/// What the fake API server holds.
struct State {
    rv: u64,
    pool: Value,
    pods: std::collections::BTreeMap<String, Value>,
    /// Pod watch events by resource version, replayed to a watch opened from an older one.
    pod_log: Vec<(u64, String)>,
    pool_log: Vec<(u64, String)>,
    pod_watchers: Vec<mpsc::UnboundedSender<Bytes>>,
    pool_watchers: Vec<mpsc::UnboundedSender<Bytes>>,
    pod_lists: usize,
    /// Request paths, in order.
    paths: Vec<String>,
    /// Each request's `Authorization` value, in order.
    authorizations: Vec<Option<String>>,
    /// How the API server misbehaves.
    mode: Mode,
    /// When each pod watch was opened.
    pod_watch_opens: Vec<tokio::time::Instant>,
    /// When each `410` for an expired continue token was sent.
    continue_gones: Vec<tokio::time::Instant>,
}

/// Ways an API server answers at once with nothing new.
#[derive(Clone, Copy, PartialEq, Default)]
enum Mode {
    #[default]
    Normal,
    /// Every watch ends as soon as it is opened, with no event.
    WatchClosesAtOnce,
    /// Every list page is empty and has a `continue` token.
    EmptyPagesForever,
    /// The first list page has the pods and a `continue` token, which has always expired.
    ContinueAlwaysGone,
}

/// A real HTTP server playing the Kubernetes API for one pool and its pods.
#[derive(Clone)]
struct FakeApi {
    addr: SocketAddr,
    tls: bool,
    state: Arc<Mutex<State>>,
}

fn pool_object(rv: u64, ports: &[u16]) -> Value {
    json!({"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": POOL, "namespace": NS, "resourceVersion": rv.to_string()},
        "spec": {"selector": {"matchLabels": {"app.kubernetes.io/name": "model-server"}},
            "targetPorts": ports.iter().map(|p| json!({"number": p})).collect::<Vec<_>>(),
            "endpointPickerRef": {"kind": "Service", "name": "agentrace-epp", "port": {"number": 9002}}}})
}

fn pod_object(name: &str, ip: &str, ready: bool, rv: u64) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "resourceVersion": rv.to_string(),
            "labels": {"app.kubernetes.io/name": "model-server"}},
        "status": {"phase": "Running", "podIP": ip,
            "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]}})
}

impl FakeApi {
    async fn start() -> FakeApi {
        FakeApi::start_with(None).await
    }

    /// Served over TLS with this acceptor when given one.
    async fn start_with(tls: Option<tokio_rustls::TlsAcceptor>) -> FakeApi {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let api = FakeApi {
            addr: listener.local_addr().unwrap(),
            tls: tls.is_some(),
            state: Arc::new(Mutex::new(State {
                rv: 10,
                pool: pool_object(10, &[8000]),
                pods: Default::default(),
                pod_log: Vec::new(),
                pool_log: Vec::new(),
                pod_watchers: Vec::new(),
                pool_watchers: Vec::new(),
                pod_lists: 0,
                paths: Vec::new(),
                authorizations: Vec::new(),
                mode: Mode::Normal,
                pod_watch_opens: Vec::new(),
                continue_gones: Vec::new(),
            })),
        };
        let server = api.clone();
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let api = server.clone();
                let tls = tls.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let api = api.clone();
                        async move { Ok::<_, Infallible>(api.answer(req)) }
                    });
                    let http1 = hyper::server::conn::http1::Builder::new();
                    match tls {
                        None => {
                            let _ = http1.serve_connection(TokioIo::new(tcp), service).await;
                        }
                        Some(tls) => {
                            let Ok(tls) = tls.accept(tcp).await else {
                                return;
                            };
                            let _ = http1.serve_connection(TokioIo::new(tls), service).await;
                        }
                    }
                });
            }
        });
        api
    }

    fn url(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    fn authorizations(&self) -> Vec<Option<String>> {
        self.state.lock().unwrap().authorizations.clone()
    }

    fn answer(&self, req: hyper::Request<Incoming>) -> hyper::Response<Body> {
        let uri = req.uri().clone();
        let path = uri.path();
        let query = uri.query().unwrap_or("");
        let param = |name: &str| {
            query
                .split('&')
                .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
                .map(|v| v.to_string())
        };
        let mut s = self.state.lock().unwrap();
        s.paths.push(uri.to_string());
        let authorization = req.headers().get("authorization");
        s.authorizations
            .push(authorization.map(|v| v.to_str().unwrap().to_string()));
        let pools = format!("/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools");
        let pods = format!("/api/v1/namespaces/{NS}/pods");
        let watch = param("watch").as_deref() == Some("true");
        let from: u64 = param("resourceVersion")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        if path == format!("{pools}/{POOL}") {
            return json_reply(200, &s.pool);
        }
        if watch && s.mode == Mode::WatchClosesAtOnce {
            if path == pods {
                s.pod_watch_opens.push(tokio::time::Instant::now());
            }
            return hyper::Response::new(Full::new(Bytes::new()).boxed());
        }
        if path == pools && watch {
            let (tx, body) = stream_body();
            for (_, line) in s.pool_log.iter().filter(|(rv, _)| *rv > from) {
                let _ = tx.send(Bytes::from(line.clone()));
            }
            s.pool_watchers.push(tx);
            return streaming(body);
        }
        if path == pods {
            let expected = SELECTOR.replace('/', "%2F").replace('=', "%3D");
            if param("labelSelector").as_deref() != Some(expected.as_str()) {
                return json_reply(
                    400,
                    &json!({"kind": "Status", "code": 400, "message": "bad labelSelector"}),
                );
            }
            if watch {
                let (tx, body) = stream_body();
                for (_, line) in s.pod_log.iter().filter(|(rv, _)| *rv > from) {
                    let _ = tx.send(Bytes::from(line.clone()));
                }
                s.pod_watchers.push(tx);
                return streaming(body);
            }
            s.pod_lists += 1;
            let has_token = param("continue").is_some();
            match s.mode {
                Mode::EmptyPagesForever => {
                    let page = json!({"kind": "PodList", "metadata": {"resourceVersion": "",
                        "continue": format!("c{}", s.pod_lists)}, "items": []});
                    return json_reply(200, &page);
                }
                Mode::ContinueAlwaysGone if has_token => {
                    s.continue_gones.push(tokio::time::Instant::now());
                    return json_reply(
                        410,
                        &json!({"kind": "Status", "code": 410, "message": "continue token expired"}),
                    );
                }
                Mode::ContinueAlwaysGone => {
                    let page = json!({"kind": "PodList", "metadata": {"resourceVersion": "",
                        "continue": "next"}, "items": s.pods.values().cloned().collect::<Vec<_>>()});
                    return json_reply(200, &page);
                }
                _ => {}
            }
            let list = json!({"apiVersion": "v1", "kind": "PodList",
                "metadata": {"resourceVersion": s.rv.to_string()},
                "items": s.pods.values().cloned().collect::<Vec<_>>()});
            return json_reply(200, &list);
        }
        json_reply(
            404,
            &json!({"kind": "Status", "code": 404, "message": format!("no {path}")}),
        )
    }

    /// A pod is created or changes; its watch event goes out.
    fn pod(&self, name: &str, ip: &str, ready: bool) {
        let mut s = self.state.lock().unwrap();
        s.rv += 1;
        let rv = s.rv;
        let object = pod_object(name, ip, ready, rv);
        let kind = if s.pods.contains_key(name) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        s.pods.insert(name.to_string(), object.clone());
        let line = format!("{}\n", json!({"type": kind, "object": object}));
        s.pod_log.push((rv, line.clone()));
        send(&mut s.pod_watchers, line);
    }

    fn delete(&self, name: &str) {
        let mut s = self.state.lock().unwrap();
        s.rv += 1;
        let rv = s.rv;
        let mut object = s.pods.remove(name).expect("the pod exists");
        object["metadata"]["resourceVersion"] = rv.to_string().into();
        let line = format!("{}\n", json!({"type": "DELETED", "object": object}));
        s.pod_log.push((rv, line.clone()));
        send(&mut s.pod_watchers, line);
    }

    /// The history is compacted: a pod vanished without an event any watch could replay, and
    /// the open pod watches get `410 Gone` and are closed.
    fn compact_and_expire(&self, vanished: &str) {
        let mut s = self.state.lock().unwrap();
        s.rv += 1;
        s.pods.remove(vanished);
        s.pod_log.clear();
        let line = format!(
            "{}\n",
            json!({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                "message": "too old resource version", "reason": "Expired", "code": 410}})
        );
        send(&mut s.pod_watchers, line);
        s.pod_watchers.clear();
    }

    /// Sends raw bytes on the open pod watches.
    fn raw(&self, bytes: Vec<u8>) {
        let mut s = self.state.lock().unwrap();
        s.pod_watchers
            .retain(|tx| tx.send(Bytes::from(bytes.clone())).is_ok());
    }

    /// `n` BOOKMARK events on the open pod watches, at the current resource version.
    fn bookmarks(&self, n: usize) {
        let s = self.state.lock().unwrap();
        let line = format!(
            "{}\n",
            json!({"type": "BOOKMARK", "object": {"kind": "Pod", "apiVersion": "v1",
                "metadata": {"resourceVersion": s.rv.to_string()}}})
        );
        let storm = line.repeat(n);
        for tx in &s.pod_watchers {
            let _ = tx.send(Bytes::from(storm.clone()));
        }
    }

    fn set_mode(&self, mode: Mode) {
        self.state.lock().unwrap().mode = mode;
    }

    fn set_ports(&self, ports: &[u16]) {
        let mut s = self.state.lock().unwrap();
        s.rv += 1;
        let rv = s.rv;
        s.pool = pool_object(rv, ports);
        let line = format!("{}\n", json!({"type": "MODIFIED", "object": s.pool}));
        s.pool_log.push((rv, line.clone()));
        send(&mut s.pool_watchers, line);
    }

    fn pod_lists(&self) -> usize {
        self.state.lock().unwrap().pod_lists
    }

    fn open_pod_watches(&self) -> usize {
        let mut s = self.state.lock().unwrap();
        s.pod_watchers.retain(|tx| !tx.is_closed());
        s.pod_watchers.len()
    }
}

fn send(watchers: &mut Vec<mpsc::UnboundedSender<Bytes>>, line: String) {
    watchers.retain(|tx| tx.send(Bytes::from(line.clone())).is_ok());
}

fn stream_body() -> (mpsc::UnboundedSender<Bytes>, mpsc::UnboundedReceiver<Bytes>) {
    mpsc::unbounded_channel()
}

fn streaming(rx: mpsc::UnboundedReceiver<Bytes>) -> hyper::Response<Body> {
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, Infallible>(Frame::data(b)), rx))
    });
    hyper::Response::builder()
        .header("content-type", "application/json")
        .body(StreamBody::new(stream).boxed())
        .unwrap()
}

fn json_reply(status: u16, value: &Value) -> hyper::Response<Body> {
    hyper::Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(value.to_string())).boxed())
        .unwrap()
}

/// A picker over the fake API's pool; no active health probes (the pod IPs are not real).
async fn picker(api: &FakeApi, max_event_bytes: usize) -> TestEpp {
    let files = ("/nonexistent/token".into(), "/nonexistent/ca.crt".into());
    picker_with(api, max_event_bytes, files).await
}

/// [`picker`] reading the token and the CA from these files.
async fn picker_with(
    api: &FakeApi,
    max_event_bytes: usize,
    (token_file, ca_file): (std::path::PathBuf, std::path::PathBuf),
) -> TestEpp {
    let mut config = ProxyConfig::default();
    config.admin.listen = "127.0.0.1:0".parse().unwrap();
    config.health = HealthConfig {
        interval_ms: 0,
        ..HealthConfig::default()
    };
    config.epp.inference_pool = Some(InferencePoolConfig {
        name: POOL.into(),
        namespace: Some(NS.into()),
        api_server: Some(api.url()),
        token_file,
        ca_file,
        max_pods: 1000,
        max_event_bytes,
    });
    fixture::start(config).await
}

/// Waits (up to 10 s) until the picker's endpoints are `want`.
async fn wait_endpoints(epp: &TestEpp, want: &[&str]) {
    let want: BTreeSet<String> = want.iter().map(|s| s.to_string()).collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let got: BTreeSet<String> = epp.handle.endpoints().into_iter().collect();
        if got == want {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "endpoints are {got:?}, expected {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(tokio::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The endpoints 24 sessions are placed on.
async fn placements(epp: &TestEpp) -> BTreeSet<String> {
    let body =
        serde_json::to_vec(&json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
            .unwrap();
    let mut seen = BTreeSet::new();
    for s in 0..24 {
        let mut stream = Stream::open(epp.addr()).await;
        let picked = stream
            .request(&[("x-session-id", &format!("s{s}"))], &body, None)
            .await
            .expect("placed");
        seen.insert(picked);
    }
    seen
}

#[tokio::test]
async fn endpoints_follow_pods_becoming_ready_not_ready_and_deleted_and_only_they_are_placed() {
    let api = FakeApi::start().await;
    api.pod("m-0", "10.0.0.10", true);
    api.pod("m-1", "10.0.0.11", false);
    let epp = picker(&api, 1024 * 1024).await;
    wait_endpoints(&epp, &["10.0.0.10:8000"]).await;
    wait_until("the pod watch is open", || api.open_pod_watches() == 1).await;

    api.pod("m-1", "10.0.0.11", true);
    api.pod("m-2", "10.0.0.12", true);
    wait_endpoints(
        &epp,
        &["10.0.0.10:8000", "10.0.0.11:8000", "10.0.0.12:8000"],
    )
    .await;
    assert_eq!(
        placements(&epp).await.len(),
        3,
        "24 sessions spread over the three ready pods"
    );

    api.delete("m-1");
    api.pod("m-2", "10.0.0.12", false);
    wait_endpoints(&epp, &["10.0.0.10:8000"]).await;
    let picked = placements(&epp).await;
    assert_eq!(
        picked,
        BTreeSet::from(["10.0.0.10:8000".to_string()]),
        "a deleted or unready pod gets nothing"
    );

    api.delete("m-0");
    wait_endpoints(&epp, &[]).await;
    let mut stream = Stream::open(epp.addr()).await;
    assert_eq!(
        stream.request(&[("x-session-id", "s")], b"{}", None).await,
        Err(503),
        "no ready pod: 503"
    );
    assert_eq!(api.pod_lists(), 1, "one list, then the watch alone");
    let metrics = epp.metrics().await;
    assert!(
        !metrics.contains("agentrace_config_reloads_total{result=\"ok\"} 1"),
        "pod changes are not configuration reloads: {metrics}"
    );
    epp.stop().await;
}

#[tokio::test]
async fn a_410_gone_leads_to_a_fresh_list_and_the_watch_goes_on() {
    let api = FakeApi::start().await;
    api.pod("m-0", "10.0.0.10", true);
    api.pod("m-1", "10.0.0.11", true);
    let epp = picker(&api, 1024 * 1024).await;
    wait_endpoints(&epp, &["10.0.0.10:8000", "10.0.0.11:8000"]).await;
    wait_until("the pod watch is open", || api.open_pod_watches() == 1).await;

    // m-1 disappears in history no watch can replay: only a new list can show it.
    api.compact_and_expire("m-1");
    wait_endpoints(&epp, &["10.0.0.10:8000"]).await;
    assert_eq!(api.pod_lists(), 2, "410 Gone: listed again");

    wait_until("the pod watch is open again", || {
        api.open_pod_watches() == 1
    })
    .await;
    api.pod("m-2", "10.0.0.12", true);
    wait_endpoints(&epp, &["10.0.0.10:8000", "10.0.0.12:8000"]).await;
    epp.stop().await;
}

#[tokio::test]
async fn a_malformed_or_oversized_watch_line_is_an_error_the_watch_recovers_from() {
    let api = FakeApi::start().await;
    api.pod("m-0", "10.0.0.10", true);
    let epp = picker(&api, 4096).await;
    wait_endpoints(&epp, &["10.0.0.10:8000"]).await;
    wait_until("the pod watch is open", || api.open_pod_watches() == 1).await;

    api.raw(b"{\"type\": \"ADDED\", \"object\": {\"metadata\": \n".to_vec());
    wait_until("a new list after the malformed line", || {
        api.pod_lists() == 2
    })
    .await;
    wait_until("the pod watch is open again", || {
        api.open_pod_watches() == 1
    })
    .await;
    api.pod("m-1", "10.0.0.11", true);
    wait_endpoints(&epp, &["10.0.0.10:8000", "10.0.0.11:8000"]).await;

    // 64 KiB without a newline, against a 4 KiB bound: refused before it is all held.
    api.raw(vec![b'x'; 64 * 1024]);
    wait_until("a new list after the oversized line", || {
        api.pod_lists() == 3
    })
    .await;
    wait_until("the pod watch is open again", || {
        api.open_pod_watches() == 1
    })
    .await;
    api.delete("m-0");
    wait_endpoints(&epp, &["10.0.0.11:8000"]).await;
    assert_eq!(
        placements(&epp).await,
        BTreeSet::from(["10.0.0.11:8000".to_string()]),
        "the picker still places, on the current endpoints only"
    );
    epp.stop().await;
}

#[tokio::test]
async fn a_changed_target_port_moves_every_endpoint() {
    let api = FakeApi::start().await;
    api.pod("m-0", "10.0.0.10", true);
    api.pod("m-1", "10.0.0.11", true);
    let epp = picker(&api, 1024 * 1024).await;
    wait_endpoints(&epp, &["10.0.0.10:8000", "10.0.0.11:8000"]).await;
    wait_until("the pool watch is open", || {
        api.state
            .lock()
            .unwrap()
            .pool_watchers
            .iter()
            .any(|t| !t.is_closed())
    })
    .await;
    api.set_ports(&[8001, 8002]);
    wait_endpoints(
        &epp,
        &[
            "10.0.0.10:8001",
            "10.0.0.10:8002",
            "10.0.0.11:8001",
            "10.0.0.11:8002",
        ],
    )
    .await;
    epp.stop().await;
}

#[test]
fn a_pool_with_static_backends_or_plain_http_to_a_remote_api_server_is_refused_naming_the_field() {
    let pool = "[epp.inference_pool]\nname = \"agentrace-models\"\nnamespace = \"models\"\n";
    let both = format!("{pool}[[backends]]\nname = \"a\"\nurl = \"http://10.0.0.1:8000\"\n");
    let config = ProxyConfig::from_toml_str(&both).unwrap();
    let err = agentrace::epp::check_source(&config)
        .unwrap_err()
        .to_string();
    assert!(err.contains("backends: must be empty"), "{err}");

    let remote = format!("{pool}api_server = \"http://10.1.2.3:6443\"\n");
    let err = ProxyConfig::from_toml_str(&remote).unwrap_err().to_string();
    assert!(err.contains("epp.inference_pool.api_server"), "{err}");
    let bad_name = "[epp.inference_pool]\nname = \"Models_A\"\n";
    let err = ProxyConfig::from_toml_str(bad_name)
        .unwrap_err()
        .to_string();
    assert!(err.contains("epp.inference_pool.name"), "{err}");
    let unknown = format!("{pool}selector = \"x\"\n");
    let err = ProxyConfig::from_toml_str(&unknown)
        .unwrap_err()
        .to_string();
    assert!(err.contains("selector"), "{err}");

    // A pool alone is a valid picker config, and not one the proxy can forward with.
    let config = ProxyConfig::from_toml_str(pool).unwrap();
    assert!(config.backends.is_empty());
}

#[tokio::test]
async fn over_https_the_watch_trusts_the_ca_file_and_sends_the_token_files_token() {
    let cert = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()]).unwrap();
    let (cert_pem, key_pem) = (cert.cert.pem(), cert.key_pair.serialize_pem());
    let dir = tempfile::tempdir().unwrap();
    let (token_file, ca_file) = (dir.path().join("token"), dir.path().join("ca.crt"));
    std::fs::write(&token_file, "t0ken-1\n").unwrap();
    std::fs::write(&ca_file, &cert_pem).unwrap();
    let tls = support::backends::tls_acceptor(&cert_pem, &key_pem, &[b"http/1.1"]);
    let api = FakeApi::start_with(Some(tls)).await;
    api.pod("m-0", "10.0.0.10", true);
    let epp = picker_with(&api, 1024 * 1024, (token_file.clone(), ca_file)).await;
    wait_endpoints(&epp, &["10.0.0.10:8000"]).await;
    wait_until("the pod watch is open", || api.open_pod_watches() == 1).await;

    // The watch streams over TLS as over plain http.
    api.pod("m-1", "10.0.0.11", true);
    wait_endpoints(&epp, &["10.0.0.10:8000", "10.0.0.11:8000"]).await;
    let seen = api.authorizations();
    assert!(
        seen.len() >= 3,
        "the pool, a pod list and watches: {seen:?}"
    );
    assert!(
        seen.iter().all(|a| a.as_deref() == Some("Bearer t0ken-1")),
        "every request carries the token file's token: {seen:?}"
    );
    epp.stop().await;
}

/// The value of the exposition line `series` (name and labels exactly), if there is one.
fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map(|v| v.parse().unwrap())
}

/// Waits (up to 20 s) until `series` on `/metrics` reaches `at_least`.
async fn wait_metric(epp: &TestEpp, series: &str, at_least: f64) -> String {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let text = epp.metrics().await;
        if metric(&text, series).is_some_and(|v| v >= at_least) {
            return text;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{series} never reached {at_least}: {text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// How long the `n`th of `times` came after the first, once there are `n`.
async fn span_of(
    api: &FakeApi,
    n: usize,
    times: fn(&State) -> &Vec<tokio::time::Instant>,
) -> Duration {
    wait_until_for(Duration::from_secs(20), &format!("{n} requests"), || {
        times(&api.state.lock().unwrap()).len() >= n
    })
    .await;
    let s = api.state.lock().unwrap();
    let t = times(&s);
    t[n - 1] - t[0]
}

async fn wait_until_for(limit: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + limit;
    while !done() {
        assert!(tokio::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

// Each backoff waits half to all of its step; the steps double from 200 ms, so the 2nd to
// 5th attempts come at least 100 + 200 + 400 + 800 ms after the first.
const FOUR_STEPS_AT_LEAST: Duration = Duration::from_millis(1_500);

#[tokio::test]
async fn a_watch_the_api_server_ends_at_once_is_reopened_after_growing_delays_and_counted() {
    let api = FakeApi::start().await;
    api.pod("m-0", "10.0.0.10", true);
    api.set_mode(Mode::WatchClosesAtOnce);
    let epp = picker(&api, 1024 * 1024).await;
    wait_endpoints(&epp, &["10.0.0.10:8000"]).await;
    let span = span_of(&api, 5, |s| &s.pod_watch_opens).await;
    assert!(
        span >= FOUR_STEPS_AT_LEAST,
        "5 pod watches in {span:?}: reopened without backing off"
    );
    wait_metric(
        &epp,
        "agentrace_epp_pool_backoffs_total{after=\"watch_ended_early\"}",
        4.0,
    )
    .await;
    assert_eq!(
        api.pod_lists(),
        1,
        "an empty watch is reopened, not relisted"
    );
    epp.stop().await;
}

#[tokio::test]
async fn empty_list_pages_with_a_continue_token_are_followed_after_growing_delays() {
    let api = FakeApi::start().await;
    api.pod("m-0", "10.0.0.10", true);
    api.set_mode(Mode::EmptyPagesForever);
    let epp = picker(&api, 1024 * 1024).await;
    let started = tokio::time::Instant::now();
    wait_until_for(Duration::from_secs(20), "5 list pages", || {
        api.pod_lists() >= 5
    })
    .await;
    let span = started.elapsed();
    assert!(
        span >= FOUR_STEPS_AT_LEAST,
        "5 empty pages in {span:?}: followed without backing off"
    );
    wait_metric(
        &epp,
        "agentrace_epp_pool_backoffs_total{after=\"empty_list_page\"}",
        4.0,
    )
    .await;
    epp.stop().await;
}

#[tokio::test]
async fn a_list_whose_continue_token_always_expires_starts_over_after_growing_delays() {
    let api = FakeApi::start().await;
    api.pod("m-0", "10.0.0.10", true);
    api.set_mode(Mode::ContinueAlwaysGone);
    let epp = picker(&api, 1024 * 1024).await;
    let span = span_of(&api, 5, |s| &s.continue_gones).await;
    assert!(
        span >= FOUR_STEPS_AT_LEAST,
        "5 expired continue tokens in {span:?}: listed again without backing off"
    );
    wait_metric(
        &epp,
        "agentrace_epp_pool_backoffs_total{after=\"continue_expired\"}",
        4.0,
    )
    .await;
    epp.stop().await;
}

#[tokio::test]
async fn a_bookmark_or_an_unchanged_pod_publishes_no_endpoint_set_and_events_are_counted_by_type() {
    let api = FakeApi::start().await;
    api.pod("m-0", "10.0.0.10", true);
    api.pod("m-1", "10.0.0.11", true);
    let epp = picker(&api, 1024 * 1024).await;
    wait_endpoints(&epp, &["10.0.0.10:8000", "10.0.0.11:8000"]).await;
    wait_until("the pod watch is open", || api.open_pod_watches() == 1).await;

    api.bookmarks(2_000);
    // A new resource version, the same readiness and IP.
    api.pod("m-0", "10.0.0.10", true);
    let text = wait_metric(
        &epp,
        "agentrace_epp_pool_watch_events_total{type=\"MODIFIED\"}",
        1.0,
    )
    .await;
    let bookmarks = "agentrace_epp_pool_watch_events_total{type=\"BOOKMARK\"}";
    assert_eq!(metric(&text, bookmarks), Some(2_000.0), "{text}");
    let sets = "agentrace_epp_pool_endpoint_sets_total";
    assert_eq!(
        metric(&text, sets),
        Some(1.0),
        "only the listed set: {text}"
    );
    assert_eq!(metric(&text, "agentrace_epp_pool_endpoints"), Some(2.0));
    let age = metric(&text, "agentrace_epp_pool_last_success_age_seconds").unwrap();
    assert!(age < 5.0, "the watch just delivered events: {age}");
    let relists = "agentrace_epp_pool_relists_total{reason=\"expired\"}";
    assert_eq!(metric(&text, relists), Some(0.0));

    api.pod("m-1", "10.0.0.11", false);
    wait_endpoints(&epp, &["10.0.0.10:8000"]).await;
    let text = wait_metric(&epp, sets, 2.0).await;
    assert_eq!(metric(&text, "agentrace_epp_pool_endpoints"), Some(1.0));

    api.compact_and_expire("m-1");
    wait_metric(&epp, relists, 1.0).await;
    epp.stop().await;
}

#[tokio::test]
async fn readiness_is_not_serving_until_a_ready_endpoint_is_known_and_again_when_none_is() {
    use tonic_health::pb::health_check_response::ServingStatus;
    let api = FakeApi::start().await;
    api.pod("m-0", "10.0.0.10", false);
    let epp = picker(&api, 1024 * 1024).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", epp.addr()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let client = tonic_health::pb::health_client::HealthClient::new(channel);
    let status = |service: &'static str| {
        let mut client = client.clone();
        async move {
            let request = tonic_health::pb::HealthCheckRequest {
                service: service.into(),
            };
            client.check(request).await.unwrap().into_inner().status
        }
    };
    let wait_readiness = |want: ServingStatus| async move {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let got = status("readiness").await;
            if got == want as i32 {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "readiness is {got}, expected {want:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    assert_eq!(
        status("readiness").await,
        ServingStatus::NotServing as i32,
        "no endpoint known yet"
    );
    assert_eq!(status("liveness").await, ServingStatus::Serving as i32);
    wait_until("the pod watch is open", || api.open_pod_watches() == 1).await;
    assert_eq!(
        status("readiness").await,
        ServingStatus::NotServing as i32,
        "the pool is listed and has no ready pod"
    );

    api.pod("m-0", "10.0.0.10", true);
    wait_readiness(ServingStatus::Serving).await;
    api.delete("m-0");
    wait_endpoints(&epp, &[]).await;
    wait_readiness(ServingStatus::NotServing).await;
    epp.stop().await;
}

#[tokio::test]
async fn past_admin_max_backend_series_endpoints_share_the_other_series_on_metrics() {
    let api = FakeApi::start().await;
    let pods = 300;
    for i in 0..pods {
        api.pod(
            &format!("m-{i}"),
            &format!("10.0.{}.{}", i / 200, i % 200 + 1),
            true,
        );
    }
    let epp = picker(&api, 1024 * 1024).await;
    wait_until_for(Duration::from_secs(20), "300 endpoints", || {
        epp.handle.endpoints().len() == pods
    })
    .await;
    let text = epp.metrics().await;
    let labels: BTreeSet<&str> = text
        .lines()
        .filter(|l| l.starts_with("agentrace_backend_healthy{"))
        .filter_map(|l| l.split('"').nth(1))
        .collect();
    assert_eq!(
        labels.len(),
        256 + 1,
        "256 endpoints with series of their own and _other: {labels:?}"
    );
    assert!(labels.contains("_other"));
    let healthy: f64 = text
        .lines()
        .filter(|l| l.starts_with("agentrace_backend_healthy{"))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum();
    assert_eq!(healthy, pods as f64, "_other sums its endpoints' gauges");
    epp.stop().await;
}
