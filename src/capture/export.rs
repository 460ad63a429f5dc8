//! Turns a capture into an MLPerf agentic dataset.
