//! A session never loses its cache by accident: through the proxy with its default settings,
//! sessions driven turn after turn by closed-loop clients stay on one backend, whatever the
//! load, unless the proxy has evidence that moving costs less than staying; and every move is
//! counted with its reason. The backends are plain HTTP servers answering after a delay, with
//! no `/metrics` (no KV size) and, unless a test says so, no `usage`.

mod support;

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use support::backends::{client, fetch, served_by, start_proxy, TestProxy};
use tokio::net::TcpListener;

/// A backend answering every POST with a small chat completion after its delay; with `usage`,
/// the completion reports the prompt's tokens (a token per 4 body bytes) and, as cached, the
/// previous prompt of the same session on this backend.
struct Plain {
    addr: SocketAddr,
    name: String,
    delay_ms: Arc<AtomicU64>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Plain {
    async fn spawn(name: &str, delay_ms: u64, usage: bool) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let delay = Arc::new(AtomicU64::new(delay_ms));
        let prompts: Arc<Mutex<HashMap<String, u64>>> = Arc::default();
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        let d = delay.clone();
        tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            loop {
                tokio::select! {
                    _ = &mut stopped => break,
                    Ok((stream, _)) = listener.accept() => {
                        let (d, prompts) = (d.clone(), prompts.clone());
                        conns.spawn(async move {
                            let svc = service_fn(move |req| {
                                answer(req, d.clone(), prompts.clone(), usage)
                            });
                            let _ = hyper::server::conn::http1::Builder::new()
                                .serve_connection(TokioIo::new(stream), svc)
                                .await;
                        });
                    }
                }
            }
            conns.abort_all();
        });
        Self {
            addr,
            name: name.to_string(),
            delay_ms: delay,
            stop: Some(stop),
        }
    }
}

impl Drop for Plain {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

async fn answer(
    req: Request<Incoming>,
    delay_ms: Arc<AtomicU64>,
    prompts: Arc<Mutex<HashMap<String, u64>>>,
    usage: bool,
) -> Result<Response<Full<Bytes>>, hyper::Error> {
    if req.method() != http::Method::POST {
        let not_found = Response::builder().status(StatusCode::NOT_FOUND);
        return Ok(not_found.body(Full::new(Bytes::new())).unwrap());
    }
    let session = req
        .headers()
        .get("x-session-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let body = req.into_body().collect().await?.to_bytes();
    tokio::time::sleep(Duration::from_millis(delay_ms.load(Ordering::Relaxed))).await;
    let mut json = serde_json::json!({"id": "x", "object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "done"}, "finish_reason": "stop"}
    ]});
    if usage {
        let prompt = body.len() as u64 / 4;
        let cached = prompts.lock().insert(session, prompt).unwrap_or(0);
        json["usage"] = serde_json::json!({"prompt_tokens": prompt, "completion_tokens": 1,
            "prompt_tokens_details": {"cached_tokens": cached}});
    }
    let resp = Response::builder().header("content-type", "application/json");
    Ok(resp.body(Full::new(Bytes::from(json.to_string()))).unwrap())
}

/// Turn `turn` of session `session`: the whole conversation so far, growing each turn.
fn turn_body(session: &str, turn: usize) -> String {
    let mut messages = vec![
        serde_json::json!({"role": "system", "content": "You are a coding agent."}),
        serde_json::json!({"role": "user", "content": format!("task {session}: {}", "fix the build ".repeat(40))}),
    ];
    for t in 0..turn {
        let step = format!("step {t}: {}", "read a file ".repeat(30));
        let result = format!("result {t}: {}", "a line of output ".repeat(60));
        messages.push(serde_json::json!({"role": "assistant", "content": step}));
        messages.push(serde_json::json!({"role": "user", "content": result}));
    }
    serde_json::json!({"model": "m", "messages": messages}).to_string()
}

/// Which backend answered each turn of each session, by session.
type Served = Vec<(String, Vec<String>)>;

/// `clients` closed-loop clients, each driving one session after another through `turns`
/// turns until `sessions` have started; with `fresh_connections`, every turn opens a new
/// connection.
async fn drive(
    proxy: &TestProxy,
    clients: usize,
    sessions: usize,
    turns: usize,
    fresh_connections: bool,
) -> Served {
    let url = proxy.url("/v1/chat/completions");
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..clients {
        let (url, next) = (url.clone(), next.clone());
        tasks.spawn(async move {
            let mut http = client();
            let mut served = Vec::new();
            loop {
                let s = next.fetch_add(1, Ordering::Relaxed);
                if s >= sessions as u64 {
                    break;
                }
                let session = format!("session-{s}");
                let mut backends = Vec::new();
                for t in 0..turns {
                    if fresh_connections {
                        http = client();
                    }
                    let headers = [("x-session-id", session.as_str())];
                    let (status, headers, _) =
                        fetch(&http, "POST", &url, &headers, turn_body(&session, t)).await;
                    assert_eq!(status, 200, "{session} turn {t}");
                    backends.push(served_by(&headers));
                }
                served.push((session, backends));
            }
            served
        });
    }
    let mut all = Vec::new();
    while let Some(done) = tasks.join_next().await {
        all.extend(done.unwrap());
    }
    all
}

/// The sessions answered by more than one backend, with the backends in turn order.
fn moved(served: &Served) -> Vec<&(String, Vec<String>)> {
    served
        .iter()
        .filter(|(_, b)| b.iter().collect::<BTreeSet<_>>().len() > 1)
        .collect()
}

async fn moves(proxy: &TestProxy, reason: &str) -> u64 {
    let series = format!("agentrace_affinity_moves_total{{reason=\"{reason}\"}}");
    proxy.counter(&series).await
}

async fn all_moves(proxy: &TestProxy) -> u64 {
    let mut total = 0;
    for reason in ["failed", "removed", "cache_lost", "queue_wait"] {
        total += moves(proxy, reason).await;
    }
    total
}

/// Four plain backends answering in `delays_ms`, behind a proxy with default settings.
async fn fleet(delays_ms: [u64; 4], usage: bool) -> (Vec<Plain>, TestProxy) {
    let mut backends = Vec::new();
    for (i, d) in delays_ms.into_iter().enumerate() {
        backends.push(Plain::spawn(&format!("b{i}"), d, usage).await);
    }
    let mut toml = String::from(
        "listen = \"127.0.0.1:0\"\n[admin]\nlisten = \"127.0.0.1:0\"\n[health]\ninterval_ms = 0\n",
    );
    for b in &backends {
        toml.push_str(&format!(
            "[[backends]]\nname = \"{}\"\nurl = \"http://{}\"\n",
            b.name, b.addr
        ));
    }
    let config = agentrace::proxy::ProxyConfig::from_toml_str(&toml).unwrap();
    (backends, start_proxy(config).await)
}

/// Sessions driven through six turns or more by `clients` clients stay on one backend each,
/// and the proxy counts no move. The backends answer in tens of milliseconds, each at its own
/// pace (as replicas on different hardware do), so the slower ones carry more of the clients
/// at any moment: load alone, which is no evidence, must not move a session.
async fn sessions_stay_put(clients: usize, sessions: usize, fresh_connections: bool) {
    let (_backends, proxy) = fleet([10, 20, 40, 80], false).await;
    let served = drive(&proxy, clients, sessions, 6, fresh_connections).await;
    assert_eq!(served.len(), sessions);
    let moved = moved(&served);
    assert!(
        moved.is_empty(),
        "{} of {} sessions touched a second backend: {:?}",
        moved.len(),
        served.len(),
        &moved[..moved.len().min(5)]
    );
    assert_eq!(all_moves(&proxy).await, 0);
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_sequential_client_never_moves_its_sessions() {
    sessions_stay_put(1, 24, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_clients_never_move_their_sessions() {
    sessions_stay_put(8, 96, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_clients_never_move_their_sessions() {
    sessions_stay_put(64, 192, false).await;
}

/// One backend slowed twentyfold while the others stay fast, and no usage reported: the slow
/// backend fills to the load bound and new sessions then start elsewhere, so it starts far
/// fewer than hashing alone would give it, while the sessions it holds stay (a slow answer is
/// no evidence that a full prefill elsewhere is cheaper), and nothing is counted as a move.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slowed_backend_gets_fewer_new_sessions_and_keeps_its_own() {
    let (backends, proxy) = fleet([30, 30, 30, 30], false).await;
    backends[3].delay_ms.store(600, Ordering::Relaxed);
    let served = drive(&proxy, 12, 72, 4, false).await;
    let moved = moved(&served);
    assert!(moved.is_empty(), "moved without evidence: {moved:?}");
    assert_eq!(all_moves(&proxy).await, 0);
    // New sessions spilled off the slow backend.
    let http = client();
    let mut hashed_slow = 0;
    let mut started_slow = 0;
    for (session, backends) in &served {
        let (_, _, view) = fetch(
            &http,
            "GET",
            &proxy.admin_url(&format!("/admin/sessions/{session}")),
            &[],
            "",
        )
        .await;
        let view: serde_json::Value = serde_json::from_slice(&view).unwrap();
        let first_choice = view["rendezvous_order"][0].as_str().unwrap().to_string();
        hashed_slow += usize::from(first_choice == "b3");
        started_slow += usize::from(backends[0] == "b3");
    }
    let spills = proxy
        .counter("agentrace_affinity_decisions_total{source=\"header\",outcome=\"spill\"}")
        .await;
    assert!(spills > 0, "no new session avoided the slow backend");
    assert!(
        2 * started_slow < hashed_slow,
        "{started_slow} sessions started on the slow backend, {hashed_slow} hashed there"
    );
    proxy.shutdown().await;
}

/// The same slowed backend, now with usage reported: the proxy learns each backend's queue
/// wait and prefill rate from the answers, and sessions held by the slow backend move, once,
/// to a fast one, each move counted as `queue_wait`; no session on a fast backend moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_longer_than_a_prefill_elsewhere_moves_sessions_with_the_reason_counted() {
    let (backends, proxy) = fleet([30, 30, 30, 30], true).await;
    backends[3].delay_ms.store(600, Ordering::Relaxed);
    let served = drive(&proxy, 12, 48, 6, false).await;
    let moved = moved(&served);
    assert!(!moved.is_empty(), "no session left the slow backend");
    for (session, b) in &moved {
        assert_eq!(b[0], "b3", "{session} left a fast backend: {b:?}");
        let away = b.iter().position(|x| x != "b3").unwrap();
        assert!(
            b[away..].iter().all(|x| x == &b[away]),
            "{session} moved more than once: {b:?}"
        );
    }
    assert_eq!(moves(&proxy, "queue_wait").await, moved.len() as u64);
    assert_eq!(all_moves(&proxy).await, moved.len() as u64);
    proxy.shutdown().await;
}
