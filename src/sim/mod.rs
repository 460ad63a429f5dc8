//! The simulated inference server: an OpenAI-compatible HTTP surface over an engine loop with
//! continuous batching, a block-based KV cache with prefix caching and a cost model.

pub mod cli;
