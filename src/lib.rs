//! agentrace: a session-affinity proxy, traffic recorder and MLPerf agentic replayer for
//! OpenAI-compatible LLM inference servers, with a simulated GPU backend for demos and tests.
//!
//! # Public API
//!
//! What a program embedding agentrace calls; everything else is crate-private (the
//! `unreachable_pub` lint keeps it so). `examples/` shows each in use.
//!
//! - Proxy: [`proxy::start`] with a [`proxy::ProxyConfig`] (its parts in [`proxy::config`]),
//!   or [`proxy::start_with_sink`] to receive every forwarded exchange through a
//!   [`tap::ExchangeSink`]; [`capture::Recorder`] is the sink that writes capture files.
//! - Simulator: [`sim::start`] (or [`sim::start_with_oracle`]) with a [`sim::SimConfig`].
//! - Datasets: [`dataset::load`] into a [`dataset::Dataset`]; [`dataset::RequestBuilder`]
//!   turns its turns into request bodies; [`dataset::synth`] writes the synthetic standard
//!   set and [`dataset::snapshot`] converts the reference's snapshot format.
//! - Replay: [`replay::run`] (closed loop) with a [`replay::ReplayConfig`], returning a
//!   [`replay::ReplaySummary`]; [`replay::open_loop::run`] replays a capture on its recorded
//!   clock; [`replay::sweep`] and [`replay::scorer`] are the Pareto sweep and the scorer.
//! - Captures: [`capture::reader`] reads capture directories, [`capture::export`] writes the
//!   MLPerf dataset format, [`capture::format`] is the record format itself.
//! - The endpoint picker behind a gateway: [`epp::start`].
//! - Every long-running part stops when the [`shutdown::Shutdown`] it was given fires
//!   ([`shutdown::channel`]).
//!
//! # Layout
//!
//! Each module is one stage of a data path; a reader finds a step of a request by its name.
//!
//! - `http1`: the one HTTP/1.1 codec (heads, body framing, limits) that the proxy's ingress
//!   and upstream pool and the replay client all speak through.
//! - [`proxy`]: listener → routing (session key, rendezvous affinity) → upstream (pooled
//!   client, failover), which reports each exchange to the [`tap`]; plus health checks and
//!   the admin API.
//! - [`tap`]: the seam between the proxy and the recorder: what a forwarded exchange
//!   reports, and the sink and observer traits it reports through. Both sides depend on it;
//!   neither depends on the other.
//! - [`epp`]: the endpoint picker behind a gateway (Envoy ext_proc), placing with the proxy's
//!   routing, health checks and admin API.
//! - [`capture`]: the recorder behind the proxy's tap: bounded queue, one writer task,
//!   delta-encoded zstd segments; and the readers behind `agentrace capture …`.
//! - [`dataset`]: MLPerf agentic JSONL → validated conversations → per-turn request bodies,
//!   salting, and the synthetic standard set.
//! - [`replay`]: scheduler (slots, budget, delays) → client (HTTP, SSE scan) → events log →
//!   metrics, scorer and report; plus the Pareto sweep and the open-loop replay of a capture.
//! - [`sim`]: the simulated inference server (engine loop, KV block pool, cost model, SSE).
//! - [`demo`]: composes the above in one process to show what affinity is worth.
//! - [`plan`]: composes them per replica count and policy to find what meets an SLO.
//! - [`cli`], [`shutdown`], `telemetry`: process edges shared by every command.
//! - `remote`: an http(s) server this process connects to: the one URL parser and the one
//!   TLS client configuration of the proxy's upstream, the replay client and the endpoint picker.
//! - `random`: the seeded random source of the synthetic dataset and the simulator.
//! - `sockstamp`: the kernel's receive time of socket reads, on the monotonic clock, for the
//!   proxy's arrivals and the replay client's responses.
//! - `timing`: sleeps that end on time, for the replayer's sends and the simulator's tokens.
//! - `wire`: the request APIs agents speak (Chat Completions, Anthropic Messages, OpenAI
//!   Responses), parsed alike for the proxy's routing and the recorder's export.

#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]
#![deny(unreachable_pub)]
#![deny(missing_docs)]

pub mod capture;
pub mod cli;
pub mod dataset;
pub mod demo;
pub mod epp;
pub(crate) mod http1;
pub(crate) mod http_body;
pub mod plan;
pub mod proxy;
pub(crate) mod random;
pub(crate) mod remote;
pub mod replay;
pub mod shutdown;
pub mod sim;
pub(crate) mod sockstamp;
pub mod tap;
pub(crate) mod telemetry;
pub(crate) mod timing;
pub(crate) mod wire;
