//! The closed-loop replayer: scheduler (slots, budget, delays) → client (HTTP, SSE scan) →
//! events log → metrics, inline scorer and report; and the Pareto sweep.

pub mod cli;
