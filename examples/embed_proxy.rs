//! Embedding the proxy in a program of your own, with your own exchange sink in place of the
//! recorder: here one that sums up each exchange and hands the summary to the program.
//!
//! A simulated backend and the proxy start on ports the system picks; one streamed chat
//! completion goes through the proxy; the program prints what the client received and what the
//! sink observed, then shuts both down.
//!
//! ```sh
//! cargo run --example embed_proxy
//! ```

use std::sync::Arc;
use std::time::Duration;

use agentrace::proxy::{self, ProxyConfig};
use agentrace::shutdown;
use agentrace::sim::{self, SimConfig};
use agentrace::tap::{ExchangeEnd, ExchangeObserver, ExchangeSink, ExchangeStart};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// What the sink learns of one exchange, once it has ended.
#[derive(Debug)]
struct Summary {
    session: Option<String>,
    backend: String,
    status: Option<u16>,
    frames: usize,
    bytes: usize,
    first_byte_after: Option<Duration>,
    end: ExchangeEnd,
}

/// The sink runs on the forwarding path, so it must never block: each summary is handed over
/// with `try_send` on a bounded channel, and dropped if the program is not keeping up.
struct SummarySink {
    summaries: mpsc::Sender<Summary>,
}

impl ExchangeSink for SummarySink {
    fn start(&self, start: ExchangeStart) -> Box<dyn ExchangeObserver> {
        Box::new(Watch {
            started_at: start.started_at,
            summary: Summary {
                session: start.session_key,
                backend: start.backend,
                status: None,
                frames: 0,
                bytes: 0,
                first_byte_after: None,
                end: ExchangeEnd::Complete,
            },
            summaries: self.summaries.clone(),
        })
    }
}

/// Follows one response; every method only updates counters.
struct Watch {
    started_at: Instant,
    summary: Summary,
    summaries: mpsc::Sender<Summary>,
}

impl ExchangeObserver for Watch {
    fn response_head(&mut self, status: http::StatusCode, _: &http::HeaderMap, _: Instant) {
        self.summary.status = Some(status.as_u16());
    }

    fn response_frame(&mut self, data: &Bytes, at: Instant) {
        if self.summary.first_byte_after.is_none() && !data.is_empty() {
            self.summary.first_byte_after = Some(at.duration_since(self.started_at));
        }
        self.summary.frames += 1;
        self.summary.bytes += data.len();
    }

    fn end(mut self: Box<Self>, end: ExchangeEnd, _: Instant) {
        self.summary.end = end;
        let _ = self.summaries.try_send(self.summary);
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let (trigger, stop) = shutdown::channel();

    // A simulated inference server, 20x faster than real time, as the only backend.
    let sim_config = SimConfig {
        time_scale: 0.05,
        ..SimConfig::default()
    };
    let model = sim_config.model.clone();
    let backend = sim::start(sim_config, "127.0.0.1:0".parse()?, 1, stop.clone())?;
    let backend_url = format!("http://{}", backend.addrs()[0]);

    let config = ProxyConfig::from_toml_str(&format!(
        "listen = \"127.0.0.1:0\"\n\
         [admin]\nlisten = \"127.0.0.1:0\"\n\
         [[backends]]\nname = \"sim\"\nurl = \"{backend_url}\"\n"
    ))?;
    let (summaries, mut summaries_rx) = mpsc::channel(64);
    let sink = Arc::new(SummarySink { summaries });
    let proxy = proxy::start_with_sink(config, stop, sink).await?;
    println!("proxy listening on {} (backend {backend_url})", proxy.addr);

    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let body = serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_completion_tokens": 16,
        "stream": true,
    });
    let request = http::Request::post(format!("http://{}/v1/chat/completions", proxy.addr))
        .header("content-type", "application/json")
        .header("x-session-id", "example-session")
        .body(Full::new(Bytes::from(body.to_string())))?;
    let response = client.request(request).await?;
    let status = response.status();
    let received = response.into_body().collect().await?.to_bytes();
    let events = received
        .split(|&b| b == b'\n')
        .filter(|line| line.starts_with(b"data: "))
        .count();
    println!(
        "client: status {} and {} bytes in {events} SSE events",
        status.as_u16(),
        received.len()
    );

    let summary = summaries_rx
        .recv()
        .await
        .ok_or_else(|| anyhow::anyhow!("the sink reported no exchange"))?;
    println!(
        "sink: session={} backend={} status={} frames={} bytes={} first_byte_ms={:.1} end={:?}",
        summary.session.as_deref().unwrap_or("-"),
        summary.backend,
        summary.status.map_or("-".to_string(), |s| s.to_string()),
        summary.frames,
        summary.bytes,
        summary
            .first_byte_after
            .map_or(f64::NAN, |d| d.as_secs_f64() * 1e3),
        summary.end,
    );

    trigger.fire();
    proxy.join().await;
    backend.join().await;
    Ok(())
}
