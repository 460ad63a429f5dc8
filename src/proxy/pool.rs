//! Pool: each forwarding worker's keep-alive connections to the backends, driven by hyper's
//! connection-level client on the worker's own thread.
//!
//! A request takes an idle HTTP/1.1 connection (or shares the backend's HTTP/2 one), and the
//! response body hands it back when it ends. Compared with a general-purpose pooled client this
//! saves a spawned task, a shared lock and a pool-key lookup per request, which on a busy
//! proxy is a large part of its own CPU time.

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use http::header;
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Request, Response, Uri};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::{http1, http2};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::{Connection, HttpConnector};
use hyper_util::rt::TokioExecutor;
use parking_lot::Mutex;
use tokio::time::Instant;
use tower_service::Service;

use super::config::BackendUrl;

/// Why a request got no response head.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// No connection could be made (TCP, TLS or protocol handshake).
    #[error("connect: {0}")]
    Connect(String),
    /// The connection failed while the request was sent or the head awaited.
    #[error("{0}")]
    Send(#[source] hyper::Error),
    /// The request could not be put together for this backend.
    #[error("bad upstream request: {0}")]
    Request(String),
}

/// The connection a response is read from; [`Lease::release`] returns it for the next request
/// once the body has ended, and dropping it instead closes it (an unfinished HTTP/1.1 response
/// leaves the connection unusable, and closing it cancels the request on the backend).
pub struct Lease {
    send: Option<http1::SendRequest<Full<Bytes>>>,
    key: Key,
    pool: std::sync::Arc<WorkerPool>,
}

impl Lease {
    /// Hands the connection back to the pool (the response body was read to its end).
    pub fn release(mut self) {
        if let Some(send) = self.send.take() {
            self.pool.check_in(&self.key, send);
        }
    }
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct Key {
    scheme: Scheme,
    authority: Authority,
}

struct Idle {
    send: http1::SendRequest<Full<Bytes>>,
    since: Instant,
}

#[derive(Default)]
struct Slot {
    idle: Vec<Idle>,
    h2: Option<http2::SendRequest<Full<Bytes>>>,
}

/// One forwarding worker's connections, by backend. Only that worker's thread takes from it
/// (the lock is uncontended); the housekeeping task reaps it from elsewhere.
pub struct WorkerPool {
    connector: HttpsConnector<HttpConnector>,
    slots: Mutex<HashMap<Key, Slot>>,
    max_idle: usize,
    idle_timeout: Duration,
}

enum Sender {
    H1 {
        send: http1::SendRequest<Full<Bytes>>,
        reused: bool,
    },
    H2(http2::SendRequest<Full<Bytes>>),
}

impl WorkerPool {
    /// A pool that connects with `connector` and keeps up to `max_idle` idle connections per
    /// backend for at most `idle_timeout`.
    pub fn new(
        connector: HttpsConnector<HttpConnector>,
        max_idle: usize,
        idle_timeout: Duration,
    ) -> Self {
        Self {
            connector,
            slots: Mutex::new(HashMap::new()),
            max_idle,
            idle_timeout,
        }
    }

    /// Sends `req` (origin-form path, headers without `Host`) to `backend` and resolves with
    /// the response head and the lease of an HTTP/1.1 connection (none for HTTP/2). A pooled
    /// connection that turns out to be closed before the request left is replaced once by a
    /// fresh one; every other failure is returned for the caller's failover.
    pub async fn send(
        self: &std::sync::Arc<Self>,
        backend: &BackendUrl,
        path_and_query: &PathAndQuery,
        mut req: Request<Full<Bytes>>,
    ) -> Result<(Response<Incoming>, Option<Lease>), PoolError> {
        let key = Key {
            scheme: backend.scheme.clone(),
            authority: backend.authority.clone(),
        };
        let pq = if backend.base_path.is_empty() {
            path_and_query.clone()
        } else {
            format!("{}{}", backend.base_path, path_and_query)
                .parse()
                .map_err(|e| PoolError::Request(format!("bad path: {e}")))?
        };
        let mut fresh_only = false;
        loop {
            let sender = match (!fresh_only).then(|| self.check_out(&key)).flatten() {
                Some(sender) => sender,
                None => self.connect(&key).await?,
            };
            match sender {
                Sender::H2(mut send) => {
                    *req.uri_mut() = Uri::builder()
                        .scheme(key.scheme.clone())
                        .authority(key.authority.clone())
                        .path_and_query(pq.clone())
                        .build()
                        .map_err(|e| PoolError::Request(e.to_string()))?;
                    req.headers_mut().remove(header::HOST);
                    return match send.try_send_request(req).await {
                        Ok(resp) => Ok((resp, None)),
                        Err(mut e) => match e.take_message() {
                            Some(back) if !fresh_only => {
                                self.forget_h2(&key);
                                req = back;
                                fresh_only = true;
                                continue;
                            }
                            _ => Err(PoolError::Send(e.into_error())),
                        },
                    };
                }
                Sender::H1 { mut send, reused } => {
                    *req.uri_mut() = Uri::from(pq.clone());
                    req.headers_mut().insert(header::HOST, backend.host.clone());
                    match send.try_send_request(req).await {
                        Ok(resp) => {
                            let lease = Lease {
                                send: Some(send),
                                key,
                                pool: self.clone(),
                            };
                            return Ok((resp, Some(lease)));
                        }
                        Err(mut e) => match e.take_message() {
                            // The pooled connection closed before the request was written.
                            Some(back) if reused => {
                                req = back;
                                fresh_only = true;
                                continue;
                            }
                            _ => return Err(PoolError::Send(e.into_error())),
                        },
                    }
                }
            }
        }
    }

    /// The most recently used idle connection that is still open and ready, or the backend's
    /// HTTP/2 connection.
    fn check_out(&self, key: &Key) -> Option<Sender> {
        let mut slots = self.slots.lock();
        let slot = slots.get_mut(key)?;
        if let Some(h2) = &slot.h2 {
            if !h2.is_closed() {
                return Some(Sender::H2(h2.clone()));
            }
            slot.h2 = None;
        }
        let now = Instant::now();
        let settled = |i: &Idle| i.send.is_ready() || i.send.is_closed();
        // Connections still finishing their previous response stay for a later request.
        while let Some(pos) = slot.idle.iter().rposition(settled) {
            let idle = slot.idle.remove(pos);
            if self.keeps(&idle, now) {
                return Some(Sender::H1 {
                    send: idle.send,
                    reused: true,
                });
            }
        }
        None
    }

    /// Whether an idle connection is still worth keeping: open, and not idle past the timeout.
    fn keeps(&self, idle: &Idle, now: Instant) -> bool {
        !idle.send.is_closed() && now.duration_since(idle.since) <= self.idle_timeout
    }

    fn check_in(&self, key: &Key, send: http1::SendRequest<Full<Bytes>>) {
        if send.is_closed() {
            return;
        }
        let mut slots = self.slots.lock();
        let slot = slots.entry(key.clone()).or_default();
        if slot.idle.len() < self.max_idle {
            slot.idle.push(Idle {
                send,
                since: Instant::now(),
            });
        }
    }

    fn forget_h2(&self, key: &Key) {
        if let Some(slot) = self.slots.lock().get_mut(key) {
            slot.h2 = None;
        }
    }

    /// Opens a connection (TLS with ALPN for `https`) and starts its task on this thread.
    async fn connect(&self, key: &Key) -> Result<Sender, PoolError> {
        let uri = Uri::builder()
            .scheme(key.scheme.clone())
            .authority(key.authority.clone())
            .path_and_query("/")
            .build()
            .map_err(|e| PoolError::Request(e.to_string()))?;
        let mut connector = self.connector.clone();
        let stream = connector
            .call(uri)
            .await
            .map_err(|e| PoolError::Connect(crate::telemetry::error_chain(&*e)))?;
        let h2 = stream.connected().is_negotiated_h2();
        let io = stream;
        let handshake_err = |e: hyper::Error| PoolError::Connect(crate::telemetry::error_chain(&e));
        if h2 {
            let (send, conn) = http2::handshake(TokioExecutor::new(), io)
                .await
                .map_err(handshake_err)?;
            tokio::spawn(async move {
                if let Err(e) = conn.await {
                    tracing::debug!(error = %e, "upstream HTTP/2 connection ended");
                }
            });
            self.slots.lock().entry(key.clone()).or_default().h2 = Some(send.clone());
            Ok(Sender::H2(send))
        } else {
            let (send, conn) = http1::handshake(io).await.map_err(handshake_err)?;
            tokio::spawn(async move {
                if let Err(e) = conn.await {
                    tracing::debug!(error = %e, "upstream connection ended");
                }
            });
            Ok(Sender::H1 {
                send,
                reused: false,
            })
        }
    }

    /// Drops connections idle for longer than the timeout or closed by the backend.
    pub fn reap(&self) {
        let now = Instant::now();
        let mut slots = self.slots.lock();
        for slot in slots.values_mut() {
            slot.idle.retain(|i| self.keeps(i, now));
            if slot.h2.as_ref().is_some_and(|h| h.is_closed()) {
                slot.h2 = None;
            }
        }
        slots.retain(|_, s| !s.idle.is_empty() || s.h2.is_some());
    }
}
