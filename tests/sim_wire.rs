//! Invariants of the simulator's Anthropic Messages and OpenAI Responses surfaces: each API's
//! event sequence (named SSE events, one per frame) and whole body, usage that reports the
//! prefix cache's real hit on a later turn, `previous_response_id` chains that hold on the
//! replica that created the response and fail as vLLM fails elsewhere, a bounded response
//! store, and errors in each API's own shape.

mod support;

use std::net::SocketAddr;

use agentrace::sim::SimConfig;
use serde_json::{json, Value};
use support::sim::*;

/// `(event name, data)` of each SSE event, checking each frame holds exactly one event whose
/// `event:` line names the `type` of its data.
fn named_events(r: &Reply) -> Vec<(String, Value)> {
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body()));
    assert_eq!(r.headers["content-type"], "text/event-stream");
    r.frames
        .iter()
        .map(|f| {
            let s = std::str::from_utf8(f).unwrap();
            let rest = s.strip_prefix("event: ").unwrap_or_else(|| panic!("{s:?}"));
            let (name, data) = rest.split_once("\ndata: ").unwrap();
            let data = data.strip_suffix("\n\n").unwrap_or_else(|| panic!("{s:?}"));
            assert!(!data.contains('\n'), "{s:?}");
            let v: Value = serde_json::from_str(data).unwrap();
            assert_eq!(v["type"], name, "{s:?}");
            (name.to_string(), v)
        })
        .collect()
}

fn names(events: &[(String, Value)]) -> Vec<&str> {
    events.iter().map(|(n, _)| n.as_str()).collect()
}

fn long_text(tag: &str, tokens: usize) -> String {
    let digits: String = (0..tokens).map(|i| format!("{:04}", i % 10_000)).collect();
    format!("{tag}: {digits}")
}

async fn messages(addr: SocketAddr, body: &Value) -> Reply {
    post(addr, "/v1/messages?beta=true", body).await
}

async fn responses(addr: SocketAddr, body: &Value) -> Reply {
    post(addr, "/v1/responses", body).await
}

/// Anthropic's stream: `message_start` with usage, `ping`, one text block, `message_delta`
/// with the stop reason and usage, `message_stop`; on the next turn of the same conversation
/// the prompt's cached part is reported as `cache_read_input_tokens`, and the three input
/// counts add up to the prompt either way.
#[tokio::test(start_paused = true)]
async fn messages_stream_is_anthropics_event_sequence_and_usage_shows_the_cache_hit() {
    let sim = Sim::start(test_config(), 1);
    let first_user = long_text("turn one", 600);
    let body = json!({"model": "claude-x", "max_tokens": 5, "stream": true,
        "system": "You are a coding agent.",
        "messages": [{"role": "user", "content": first_user}]});
    let r = messages(sim.addr(0), &body).await;
    let events = named_events(&r);
    let n = names(&events);
    assert_eq!(n[..3], ["message_start", "ping", "content_block_start"]);
    assert_eq!(
        n[n.len() - 3..],
        ["content_block_stop", "message_delta", "message_stop"]
    );
    let deltas: Vec<&Value> = events
        .iter()
        .filter(|(n, _)| n == "content_block_delta")
        .map(|(_, v)| v)
        .collect();
    assert_eq!(deltas.len(), 5);
    assert!(deltas.iter().all(|d| d["delta"]["type"] == "text_delta"));
    let start = &events[0].1["message"];
    assert!(start["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(start["model"], "claude-x");
    let input = |u: &Value| {
        [
            "input_tokens",
            "cache_read_input_tokens",
            "cache_creation_input_tokens",
        ]
        .iter()
        .map(|k| u[k].as_u64().unwrap())
        .sum::<u64>()
    };
    let first_prompt = input(&start["usage"]);
    assert_eq!(start["usage"]["cache_read_input_tokens"], 0);
    assert!(
        start["usage"]["cache_creation_input_tokens"]
            .as_u64()
            .unwrap()
            > 500
    );
    let end = &events[n.len() - 2].1;
    assert_eq!(end["delta"]["stop_reason"], "max_tokens");
    assert_eq!(end["usage"]["output_tokens"], 5);

    let text: String = deltas
        .iter()
        .map(|d| d["delta"]["text"].as_str().unwrap())
        .collect();
    let next = json!({"model": "claude-x", "max_tokens": 4,
        "system": "You are a coding agent.",
        "messages": [{"role": "user", "content": first_user},
                     {"role": "assistant", "content": [{"type": "text", "text": text}]},
                     {"role": "user", "content": "and now?"}]});
    let r = messages(sim.addr(0), &next).await;
    assert_eq!(r.status, 200);
    let v = r.json();
    assert_eq!(v["type"], "message");
    assert_eq!(v["content"][0]["type"], "text");
    assert_eq!(v["stop_reason"], "max_tokens");
    let u = &v["usage"];
    assert!(input(u) > first_prompt);
    let hit = u["cache_read_input_tokens"].as_u64().unwrap();
    assert!(
        hit >= first_prompt - 16 && hit < input(u),
        "second turn hit {hit} of a first prompt of {first_prompt}: {u}"
    );
    sim.stop().await;
}

fn tool() -> Value {
    json!({"name": "read_file", "description": "Read a file",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}})
}

/// A forced tool call is a `tool_use` block with schema-valid input, whole or streamed as
/// `input_json_delta`s that join into it, and the stop reason is `tool_use`. (A body that
/// differs draws a different reply, so the two are checked each on its own.)
#[tokio::test(start_paused = true)]
async fn messages_tool_use_streams_input_json_deltas_that_match_the_whole_body() {
    let sim = Sim::start(test_config(), 1);
    let mut body = json!({"model": "m", "max_tokens": 200, "tools": [tool()],
        "tool_choice": {"type": "any"},
        "messages": [{"role": "user", "content": "read main.rs"}]});
    let whole = messages(sim.addr(0), &body).await.json();
    assert_eq!(whole["stop_reason"], "tool_use");
    let call = whole["content"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["type"] == "tool_use")
        .unwrap()
        .clone();
    assert!(call["id"].as_str().unwrap().starts_with("toolu_"));
    assert_eq!(call["name"], "read_file");
    assert!(call["input"]["path"].is_string());

    body["stream"] = json!(true);
    let events = named_events(&messages(sim.addr(0), &body).await);
    let start = events
        .iter()
        .find(|(n, v)| n == "content_block_start" && v["content_block"]["type"] == "tool_use")
        .unwrap();
    assert!(start.1["content_block"]["id"]
        .as_str()
        .unwrap()
        .starts_with("toolu_"));
    let joined: String = events
        .iter()
        .filter(|(_, v)| v["delta"]["type"] == "input_json_delta")
        .map(|(_, v)| v["delta"]["partial_json"].as_str().unwrap())
        .collect();
    assert!(serde_json::from_str::<Value>(&joined).unwrap()["path"].is_string());
    let end = events.iter().find(|(n, _)| n == "message_delta").unwrap();
    assert_eq!(end.1["delta"]["stop_reason"], "tool_use");
    sim.stop().await;
}

/// Errors on `/v1/messages` come in Anthropic's shape, naming the field that is wrong.
#[tokio::test(start_paused = true)]
async fn messages_errors_are_in_anthropics_shape() {
    let sim = Sim::start(test_config(), 1);
    let r = messages(sim.addr(0), &json!({"model": "m", "max_tokens": 4})).await;
    assert_eq!(r.status, 400);
    let v = r.json();
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .starts_with("messages:"));
    let r = post(
        sim.addr(0),
        "/v1/messages",
        &json!({"messages": [{"role": "user", "content": 5}]}),
    )
    .await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["type"], "error");
    sim.stop().await;
}

/// OpenAI's Responses stream: created, in_progress, the message item and its text part
/// opened, one `output_text.delta` per token, the `…done` events, and `response.completed`
/// (`response.incomplete` when the cap cut it) with the whole response and its usage;
/// sequence numbers count up from 0. The unstreamed body is a response object too.
#[tokio::test(start_paused = true)]
async fn responses_stream_is_openais_event_sequence_and_ends_with_the_whole_response() {
    let sim = Sim::start(test_config(), 1);
    let body = json!({"model": "gpt-x", "input": "Say something.", "max_output_tokens": 4, "stream": true});
    let events = named_events(&responses(sim.addr(0), &body).await);
    let n = names(&events);
    assert_eq!(
        n[..4],
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added"
        ]
    );
    assert_eq!(
        n[n.len() - 4..],
        [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.incomplete"
        ]
    );
    assert_eq!(
        n.iter()
            .filter(|n| **n == "response.output_text.delta")
            .count(),
        4
    );
    for (i, (_, v)) in events.iter().enumerate() {
        assert_eq!(v["sequence_number"], i as u64);
    }
    let response = &events.last().unwrap().1["response"];
    assert!(response["id"].as_str().unwrap().starts_with("resp_"));
    assert_eq!(response["status"], "incomplete");
    assert_eq!(response["model"], "gpt-x");
    let text: String = events
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .map(|(_, v)| v["delta"].as_str().unwrap())
        .collect();
    assert_eq!(response["output"][0]["content"][0]["text"], text);
    assert_eq!(response["usage"]["output_tokens"], 4);
    assert_eq!(
        response["usage"]["input_tokens_details"]["cached_tokens"],
        0
    );

    let mut plain = body.clone();
    plain["stream"] = json!(false);
    let r = responses(sim.addr(0), &plain).await;
    let v = r.json();
    assert_eq!(v["object"], "response");
    assert_eq!(v["output"][0]["type"], "message");
    assert_eq!(v["output"][0]["content"][0]["type"], "output_text");
    assert_eq!(v["usage"]["output_tokens"], 4);
    sim.stop().await;
}

/// A forced function call streams as a `function_call` item whose argument deltas join into
/// the item's `arguments`, and `function_call_output` answering it is read on the next turn.
#[tokio::test(start_paused = true)]
async fn responses_function_calls_stream_arguments_and_take_their_output_back() {
    let sim = Sim::start(test_config(), 1);
    let tools = json!([{"type": "function", "name": "read_file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]);
    let body = json!({"input": "read main.rs", "tools": tools, "tool_choice": "required",
        "stream": true, "max_output_tokens": 200});
    let events = named_events(&responses(sim.addr(0), &body).await);
    let done = &events.last().unwrap();
    assert_eq!(done.0, "response.completed");
    let call = done.1["response"]["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["type"] == "function_call")
        .unwrap()
        .clone();
    let joined: String = events
        .iter()
        .filter(|(n, _)| n == "response.function_call_arguments.delta")
        .map(|(_, v)| v["delta"].as_str().unwrap())
        .collect();
    assert_eq!(joined, call["arguments"].as_str().unwrap());
    assert!(serde_json::from_str::<Value>(&joined).unwrap()["path"].is_string());

    let next = json!({"previous_response_id": done.1["response"]["id"], "tools": tools,
        "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "fn main() {}"}],
        "max_output_tokens": 3});
    let r = responses(sim.addr(0), &next).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body()));
    assert!(
        r.json()["usage"]["input_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
    sim.stop().await;
}

/// `previous_response_id` continues the conversation on the replica that created the
/// response: the prompt is the whole conversation, so the prefix cache serves its earlier
/// part. On another replica the id is unknown and the request fails as vLLM fails it.
#[tokio::test(start_paused = true)]
async fn previous_response_id_chains_on_its_replica_and_fails_on_another() {
    let sim = Sim::start(test_config(), 2);
    let first = json!({"instructions": "You are a coding agent.",
        "input": long_text("first", 600), "max_output_tokens": 4});
    let r = responses(sim.addr(0), &first).await;
    assert_eq!(r.status, 200);
    let v = r.json();
    let id = v["id"].as_str().unwrap().to_string();
    let first_prompt = v["usage"]["input_tokens"].as_u64().unwrap();

    let next = json!({"instructions": "You are a coding agent.", "previous_response_id": id,
        "input": [{"role": "user", "content": "go on"}], "max_output_tokens": 4, "stream": true});
    let events = named_events(&responses(sim.addr(0), &next).await);
    let done = &events.last().unwrap().1["response"];
    assert_eq!(done["previous_response_id"], id.as_str());
    let u = &done["usage"];
    assert!(u["input_tokens"].as_u64().unwrap() > first_prompt, "{u}");
    assert!(
        u["input_tokens_details"]["cached_tokens"].as_u64().unwrap() >= first_prompt - 16,
        "{u}"
    );

    let r = responses(sim.addr(1), &next).await;
    assert_eq!(r.status, 404);
    assert_eq!(
        r.json(),
        json!({"error": {"message": format!("Response with id '{id}' not found."),
            "type": "invalid_request_error", "param": "response_id", "code": 404}})
    );
    sim.stop().await;
}

/// The store keeps at most `responses_store_max` conversations, forgetting the oldest first
/// and counting it; `store: false` keeps nothing.
#[tokio::test(start_paused = true)]
async fn response_store_bound_evicts_the_oldest_and_store_false_keeps_nothing() {
    let config = SimConfig {
        responses_store_max: 2,
        ..test_config()
    };
    let sim = Sim::start(config, 1);
    let mut ids = Vec::new();
    for i in 0..3 {
        let r = responses(
            sim.addr(0),
            &json!({"input": format!("session {i}"), "max_output_tokens": 2}),
        )
        .await;
        ids.push(r.json()["id"].as_str().unwrap().to_string());
    }
    let cont = |id: &str| json!({"previous_response_id": id, "input": "more", "max_output_tokens": 2, "store": false});
    assert_eq!(responses(sim.addr(0), &cont(&ids[0])).await.status, 404);
    assert_eq!(responses(sim.addr(0), &cont(&ids[2])).await.status, 200);
    let text = String::from_utf8(get(sim.addr(0), "/metrics").await.body()).unwrap();
    assert_eq!(metric(&text, "agentrace_sim_responses_evicted_total"), 1.0);
    assert_eq!(metric(&text, "agentrace_sim_responses_stored"), 2.0);

    let r = responses(
        sim.addr(0),
        &json!({"input": "unkept", "store": false, "max_output_tokens": 2}),
    )
    .await;
    let unkept = r.json()["id"].as_str().unwrap().to_string();
    assert_eq!(r.json()["store"], false);
    assert_eq!(responses(sim.addr(0), &cont(&unkept)).await.status, 404);
    let text = String::from_utf8(get(sim.addr(0), "/metrics").await.body()).unwrap();
    assert_eq!(metric(&text, "agentrace_sim_responses_stored"), 2.0);
    sim.stop().await;
}
