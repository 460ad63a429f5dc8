//! The affinity proxy: pins each agent session to one backend and streams responses through.
//!
//! Stages: `listener` (accept, TLS) → `routing` (session key, rendezvous pick, bindings) →
//! `upstream` (pooled client, failover) → `tap` (frame observers for the recorder);
//! `health` and `admin` run beside them.

pub mod cli;
pub mod tap;
