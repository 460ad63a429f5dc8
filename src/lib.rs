//! agentrace: a session-affinity proxy, traffic recorder and MLPerf agentic replayer for
//! OpenAI-compatible LLM inference servers, with a simulated GPU backend for demos and tests.
//!
//! # Layout
//!
//! Each module is one stage of a data path; a reader finds a step of a request by its name.
//!
//! - [`http1`]: the one HTTP/1.1 codec (heads, body framing, limits) that the proxy's ingress
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
//! - [`cli`], [`shutdown`], [`telemetry`]: process edges shared by every command.
//! - [`remote`]: an http(s) server this process connects to: the one URL parser and the one
//!   TLS client configuration of the proxy's upstream, the replay client and the endpoint picker.
//! - [`random`]: the seeded random source of the synthetic dataset and the simulator.
//! - [`timing`]: sleeps that end on time, for the replayer's sends and the simulator's tokens.

#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]

pub mod capture;
pub mod cli;
pub mod dataset;
pub mod demo;
pub mod epp;
pub mod http1;
pub mod http_body;
pub mod proxy;
pub mod random;
pub mod remote;
pub mod replay;
pub mod shutdown;
pub mod sim;
pub mod tap;
pub mod telemetry;
pub mod timing;
