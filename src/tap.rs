//! The seam between the proxy's data path and the recorder: the proxy reports what passes
//! through it to an [`ExchangeSink`], which must never block a thread. The one way a sink
//! may slow forwarding is [`ExchangeObserver::poll_ready`], which holds back the end of one
//! response on that response's own task.

use std::task::{Context, Poll};

use bytes::Bytes;
use tokio::time::Instant;

/// Where an exchange's session key came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeySource {
    /// One of the configured affinity headers.
    Header,
    /// The conversation fingerprint of a chat-completions body.
    Fingerprint,
    /// No key: routed to the least-loaded backend.
    None,
}

/// What is known about an exchange once its request body has been received in full.
#[derive(Debug, Clone)]
pub struct ExchangeStart {
    /// The session key, if any.
    pub session_key: Option<String>,
    /// Where the key came from.
    pub key_source: KeySource,
    /// Name of the backend the request is sent to (after any failover).
    pub backend: String,
    /// Wall-clock time the request started, in nanoseconds since the Unix epoch.
    pub started_unix_ns: u128,
    /// Monotonic instant the request started (its first byte was accepted).
    pub started_at: Instant,
    /// Monotonic instant the request body was fully received.
    pub request_received_at: Instant,
    /// HTTP method.
    pub method: http::Method,
    /// Path and query as sent by the client.
    pub path_and_query: String,
    /// Request headers as received from the client (the sink redacts secrets).
    pub request_headers: http::HeaderMap,
    /// The whole request body (a refcounted handle, not a copy).
    pub request_body: Bytes,
}

/// How an exchange ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExchangeEnd {
    /// The response body ended normally.
    Complete,
    /// The upstream failed after response bytes reached the client.
    UpstreamError(String),
    /// The client went away before the response ended.
    ClientGone,
}

/// Receives the exchanges of one proxy. Implementations must return quickly: they run on the
/// forwarding path.
pub trait ExchangeSink: Send + Sync + 'static {
    /// Called once per exchange when the request is about to be sent upstream; the returned
    /// observer follows the response.
    fn start(&self, start: ExchangeStart) -> Box<dyn ExchangeObserver>;
}

/// Follows one exchange's response. Every method must be cheap and non-blocking.
pub trait ExchangeObserver: Send + 'static {
    /// Polled before `end` where the exchange can still wait (the response body's last poll):
    /// `Pending` holds back the end of this response until the observer has room for its
    /// record, and wakes `cx` then. Always ready unless the sink chose to wait (the
    /// recorder's `full_policy = "block"`). An exchange that ends without it (client gone)
    /// cannot wait, and its observer must not.
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<()> {
        Poll::Ready(())
    }
    /// The response head arrived from the backend.
    fn response_head(&mut self, status: http::StatusCode, headers: &http::HeaderMap, at: Instant);
    /// A response body frame was forwarded to the client (a refcount bump, not a copy).
    fn response_frame(&mut self, data: &Bytes, at: Instant);
    /// The exchange ended; called exactly once (also when dropped early, by the proxy).
    fn end(self: Box<Self>, end: ExchangeEnd, at: Instant);
}
