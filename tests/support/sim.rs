//! Fixtures for the sim tests: a cluster on `127.0.0.1:0`, a tiny HTTP/1 client that keeps
//! the body's frames, SSE parsing and request builders.

use std::net::SocketAddr;

use agentrace::shutdown::{self, Trigger};
use agentrace::sim::{self, SimCluster, SimConfig};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};
use tokio::time::Instant;

/// A running cluster and the trigger that stops it.
pub struct Sim {
    pub cluster: SimCluster,
    trigger: Trigger,
}

impl Sim {
    /// Starts `replicas` replicas of `config` on ephemeral ports.
    pub fn start(config: SimConfig, replicas: usize) -> Sim {
        let (trigger, shutdown) = shutdown::channel();
        let cluster = sim::start(config, "127.0.0.1:0".parse().unwrap(), replicas, shutdown)
            .expect("sim starts");
        Sim { cluster, trigger }
    }

    /// Wraps a cluster started another way.
    pub fn from_parts(cluster: SimCluster, trigger: Trigger) -> Sim {
        Sim { cluster, trigger }
    }

    /// Address of replica `i`.
    pub fn addr(&self, i: usize) -> SocketAddr {
        self.cluster.addrs()[i]
    }

    /// Stops the cluster and waits for it.
    pub async fn stop(self) {
        self.trigger.fire();
        self.cluster.join().await;
    }
}

/// A config for tests: the default profile, fixed `created`, short synthetic replies.
pub fn test_config() -> SimConfig {
    SimConfig {
        created_base_unix: Some(1_700_000_000),
        seed: 7,
        ..SimConfig::default()
    }
}

/// A response with its body frames as received.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub frames: Vec<Bytes>,
    /// When each frame arrived (tokio clock).
    pub frame_times: Vec<Instant>,
    /// Set when the body ended with an error (connection cut).
    pub body_error: Option<String>,
    pub sent_at: Instant,
}

impl Reply {
    pub fn body(&self) -> Vec<u8> {
        self.frames.concat()
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body()).expect("JSON body")
    }

    pub fn pod(&self) -> String {
        self.headers
            .get("x-inference-pod")
            .expect("x-inference-pod")
            .to_str()
            .unwrap()
            .to_string()
    }

    /// The `data:` payloads of an SSE body, in order.
    pub fn events(&self) -> Vec<String> {
        sse_events(&self.body())
    }

    /// Parsed JSON events (everything but `[DONE]`).
    pub fn json_events(&self) -> Vec<Value> {
        self.events()
            .iter()
            .filter(|e| *e != "[DONE]")
            .map(|e| serde_json::from_str(e).unwrap())
            .collect()
    }

    /// The usage object of a stream's usage chunk or of a JSON body.
    pub fn usage(&self) -> Value {
        if self
            .headers
            .get("content-type")
            .is_some_and(|v| v == "text/event-stream")
        {
            self.json_events()
                .into_iter()
                .rev()
                .find_map(|e| e.get("usage").filter(|u| !u.is_null()).cloned())
                .expect("usage chunk")
        } else {
            self.json()["usage"].clone()
        }
    }

    pub fn cached_tokens(&self) -> u64 {
        self.usage()["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    }

    /// Time from sending to the first frame carrying a content, reasoning or tool delta.
    pub fn ttft(&self) -> std::time::Duration {
        let i = self
            .frames
            .iter()
            .position(|f| {
                let s = String::from_utf8_lossy(f);
                s.contains("\"content\":\"") && !s.contains("\"role\"")
                    || s.contains("reasoning_content")
                    || s.contains("tool_calls")
            })
            .expect("a token frame");
        self.frame_times[i] - self.sent_at
    }
}

/// `data:` payloads of an SSE text.
pub fn sse_events(body: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(body)
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: ").map(str::to_string))
        .collect()
}

/// Sends one request on a fresh connection and reads the whole response frame by frame.
pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Vec<u8>,
    headers: &[(&str, &str)],
) -> Reply {
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .expect("handshake");
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut req = http::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .header("host", addr.to_string())
        .header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let sent_at = Instant::now();
    let resp = sender
        .send_request(req.body(Full::new(Bytes::from(body))).unwrap())
        .await
        .expect("response");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let mut body = resp.into_body();
    let (mut frames, mut frame_times, mut body_error) = (Vec::new(), Vec::new(), None);
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(f) => {
                if let Ok(data) = f.into_data() {
                    frames.push(data);
                    frame_times.push(Instant::now());
                }
            }
            Err(e) => {
                body_error = Some(e.to_string());
                break;
            }
        }
    }
    Reply {
        status,
        headers,
        frames,
        frame_times,
        body_error,
        sent_at,
    }
}

pub async fn post(addr: SocketAddr, path: &str, body: &Value) -> Reply {
    request(addr, "POST", path, serde_json::to_vec(body).unwrap(), &[]).await
}

pub async fn get(addr: SocketAddr, path: &str) -> Reply {
    request(addr, "GET", path, Vec::new(), &[]).await
}

pub async fn chat(addr: SocketAddr, body: &Value) -> Reply {
    post(addr, "/v1/chat/completions", body).await
}

/// A streaming chat body with usage, for `messages`, capped at `max_tokens`.
pub fn stream_body(messages: Value, max_tokens: u64) -> Value {
    json!({"model": "m", "messages": messages, "stream": true, "stream_options": {"include_usage": true},
        "max_completion_tokens": max_tokens})
}

/// A system prompt and one user message of about `tokens` pseudo-tokens, distinct per `tag`.
pub fn long_messages(tag: &str, tokens: usize) -> Value {
    let text: String = (0..tokens)
        .map(|i| format!("{:04}", (i * 7 + tag.len()) % 10_000))
        .collect();
    json!([{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": format!("{tag}: {text}")}])
}

/// Value of a Prometheus sample (`name{…} value`) in a `/metrics` text.
pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("metric {name} missing"))
}
