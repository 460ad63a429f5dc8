//! Shared fixtures for the integration tests: real servers on `127.0.0.1:0`, never mocks.
//! Each test binary uses a subset, so unused items are expected here.
#![allow(dead_code)]

pub mod backends;
pub mod capture;
pub mod dataset;
pub mod engine;
pub mod envoy;
pub mod epp;
pub mod proxy_process;
pub mod raw_h2;
pub mod raw_http1;
pub mod replay;
pub mod sim;
pub mod truth;
