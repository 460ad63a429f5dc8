//! Driving the simulated inference server from a program: start replicas on ports the system
//! picks, send them OpenAI chat completions, and read each replica's counters (requests,
//! prompt tokens, prefix-cache hits) without scraping `/metrics`.
//!
//! One conversation is sent twice to the same replica, a turn longer the second time, so
//! the second request finds its prefix in the replica's KV cache; the other replica gets a
//! different conversation.
//!
//! ```sh
//! cargo run --example drive_sim
//! ```

use agentrace::shutdown;
use agentrace::sim::{self, SimConfig};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// Sends a non-streamed chat completion to `addr` and returns the reply's text: its content,
/// or, when the reply spent its tokens thinking or calling tools, what it has instead.
async fn chat(
    client: &HttpClient,
    addr: std::net::SocketAddr,
    messages: &Value,
) -> anyhow::Result<String> {
    let body = json!({"messages": messages, "max_completion_tokens": 24});
    let request = http::Request::post(format!("http://{addr}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))?;
    let response = client.request(request).await?;
    anyhow::ensure!(
        response.status().is_success(),
        "status {}",
        response.status()
    );
    let reply: Value = serde_json::from_slice(&response.into_body().collect().await?.to_bytes())?;
    let message = &reply["choices"][0]["message"];
    let text = |field: &str| message[field].as_str().filter(|t| !t.is_empty());
    Ok(match (text("content"), text("reasoning_content")) {
        (Some(content), _) => content.to_string(),
        (None, Some(reasoning)) => format!("(reasoning) {reasoning}"),
        (None, None) => format!("(tool calls) {}", message["tool_calls"]),
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let (trigger, stop) = shutdown::channel();
    // 100x faster than real time; every duration the simulator reports stays simulated.
    let config = SimConfig {
        time_scale: 0.01,
        seed: 7,
        ..SimConfig::default()
    };
    let cluster = sim::start(config, "127.0.0.1:0".parse()?, 2, stop)?;
    let addrs = cluster.addrs();
    for (name, addr) in cluster.replica_names().iter().zip(&addrs) {
        println!("{name} listening on {addr}");
    }

    let client = Client::builder(TokioExecutor::new()).build_http();
    let system = "You are a careful assistant. ".repeat(40);
    let mut conversation = json!([
        {"role": "system", "content": system},
        {"role": "user", "content": "List three prime numbers."},
    ]);
    let first = chat(&client, addrs[0], &conversation).await?;
    println!("replica 0, turn 1: {first:?}");
    let turns = conversation.as_array_mut().expect("an array");
    turns.push(json!({"role": "assistant", "content": first}));
    turns.push(json!({"role": "user", "content": "And three more."}));
    let second = chat(&client, addrs[0], &conversation).await?;
    println!("replica 0, turn 2: {second:?}");
    let other = json!([{"role": "user", "content": "What is a KV cache?"}]);
    let third = chat(&client, addrs[1], &other).await?;
    println!("replica 1, turn 1: {third:?}");

    for s in cluster.stats() {
        println!(
            "{}: requests={} prompt_tokens={} prefix_cache_hits={} generation_tokens={}",
            s.name, s.requests, s.prompt_tokens, s.prefix_cache_hits, s.generation_tokens
        );
    }
    trigger.fire();
    cluster.join().await;
    Ok(())
}
