//! One HTTP request as the gateway streams it to the picker: its headers, its body (held to
//! its end, bounded, when the body is streamed full-duplex), the placement, and what the
//! gateway says served it.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request, ProcessingRequest, ProcessingResponse,
};
use http::Method;

use super::reply;
use super::Picker;
use crate::http1::Fields;
use crate::proxy::routing::{session_key, Commit, InFlight, Outcome, SessionKey};
use crate::tap::KeySource;

/// `BodySendMode::FULL_DUPLEX_STREAMED`: the body passes through the picker, which may hold it.
const FULL_DUPLEX: i32 = 4;

/// Request headers as the gateway sends them, names in lower case (`:method`, `:path` too).
struct Headers(Vec<(String, Vec<u8>)>);

impl Headers {
    fn from_map(map: Option<HeaderMap>) -> Self {
        let pairs = map
            .map(|m| m.headers)
            .unwrap_or_default()
            .into_iter()
            .map(|h| {
                let value = if h.raw_value.is_empty() {
                    h.value.into_bytes()
                } else {
                    h.raw_value
                };
                (h.key.to_ascii_lowercase(), value)
            })
            .collect();
        Self(pairs)
    }
}

impl Fields for Headers {
    fn pairs(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.0.iter().map(|(n, v)| (n.as_bytes(), v.as_slice()))
    }

    fn values_of<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.0
            .iter()
            .filter(move |(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_slice())
    }
}

/// Where a request was placed.
struct Placed {
    endpoint: String,
    key: Option<SessionKey>,
    /// Counted until the response is known complete (see [`Exchange::finish_response`]).
    in_flight: Option<InFlight>,
}

/// Why a request gets no endpoint: the gateway answers the client with this status.
struct Refusal {
    status: u16,
    kind: &'static str,
    message: String,
}

/// The state of one ext_proc stream.
pub(crate) struct Exchange {
    picker: Arc<Picker>,
    /// The request body passes through the picker (full-duplex streamed mode).
    hold_body: bool,
    /// The response body passes through the picker.
    echo_response_body: bool,
    /// The gateway sends the response body (or parts of it) to the picker.
    sees_response_body: bool,
    headers: Option<Headers>,
    subset: Option<Vec<String>>,
    body: Vec<u8>,
    placed: Option<Placed>,
    /// An immediate response was sent: the stream is over.
    pub(crate) done: bool,
}

impl Exchange {
    pub(crate) fn new(picker: Arc<Picker>) -> Self {
        Self {
            picker,
            hold_body: true,
            echo_response_body: false,
            sees_response_body: false,
            headers: None,
            subset: None,
            body: Vec::new(),
            placed: None,
            done: false,
        }
    }

    /// The replies to one message from the gateway, in order.
    pub(crate) fn on(&mut self, msg: ProcessingRequest) -> Vec<ProcessingResponse> {
        if let Some(config) = &msg.protocol_config {
            self.hold_body = config.request_body_mode == FULL_DUPLEX;
            self.echo_response_body = config.response_body_mode == FULL_DUPLEX;
            self.sees_response_body = config.response_body_mode != 0;
        }
        let metadata = msg.metadata_context.as_ref();
        match msg.request {
            Some(Request::RequestHeaders(h)) => {
                self.subset =
                    reply::metadata_list(metadata, reply::SUBSET_NAMESPACE, reply::SUBSET_KEY);
                self.headers = Some(Headers::from_map(h.headers));
                if h.end_of_stream || !self.hold_body {
                    self.decide().into_iter().collect()
                } else {
                    Vec::new()
                }
            }
            Some(Request::RequestBody(b)) => {
                if !self.hold_body {
                    return vec![reply::request_body_ack()];
                }
                if self.placed.is_some() {
                    return vec![reply::request_body(b.body, b.end_of_stream)];
                }
                let limit = self.picker.inner.max_request_body();
                if (self.body.len() + b.body.len()) as u64 > limit {
                    return vec![self.refuse(Refusal {
                        status: 413,
                        kind: "body_too_large",
                        message: format!("request body larger than {limit} bytes"),
                    })];
                }
                self.body.extend_from_slice(&b.body);
                if !b.end_of_stream {
                    return Vec::new();
                }
                let mut out: Vec<ProcessingResponse> = self.decide().into_iter().collect();
                if !self.done {
                    out.push(reply::request_body(std::mem::take(&mut self.body), true));
                }
                out
            }
            Some(Request::RequestTrailers(_)) => {
                let mut out = Vec::new();
                if self.placed.is_none() && !self.done {
                    out.extend(self.decide());
                    if self.done {
                        return out;
                    }
                    if self.hold_body {
                        out.push(reply::request_body(std::mem::take(&mut self.body), false));
                    }
                }
                out.push(reply::request_trailers());
                out
            }
            Some(Request::ResponseHeaders(h)) => {
                self.learn_served(metadata);
                if h.end_of_stream || !self.sees_response_body {
                    self.finish_response();
                }
                vec![reply::response_headers()]
            }
            Some(Request::ResponseBody(b)) => {
                if b.end_of_stream {
                    self.finish_response();
                }
                let body = self.echo_response_body.then_some(b.body);
                vec![reply::response_body(body, b.end_of_stream)]
            }
            Some(Request::ResponseTrailers(_)) => vec![reply::response_trailers()],
            None => Vec::new(),
        }
    }

    /// Places the request (once its body, if held, is complete): the destination reply, or
    /// an immediate refusal.
    fn decide(&mut self) -> Option<ProcessingResponse> {
        if self.placed.is_some() || self.done {
            return None;
        }
        match self.place() {
            Ok(placed) => {
                let reply = reply::destination(&placed.endpoint);
                self.placed = Some(placed);
                Some(reply)
            }
            Err(refusal) => Some(self.refuse(refusal)),
        }
    }

    fn refuse(&mut self, refusal: Refusal) -> ProcessingResponse {
        self.done = true;
        self.body = Vec::new();
        if let Ok(status) = http::StatusCode::from_u16(refusal.status) {
            self.picker.inner.metrics().refused(status);
        }
        reply::immediate(refusal.status, refusal.kind, &refusal.message)
    }

    fn place(&self) -> Result<Placed, Refusal> {
        let inner = &self.picker.inner;
        let router = inner.router();
        let pool = router.pool();
        let empty = Headers(Vec::new());
        let headers = self.headers.as_ref().unwrap_or(&empty);
        let method = headers
            .first(":method")
            .and_then(|m| Method::from_bytes(m).ok())
            .unwrap_or(Method::GET);
        let path = headers.first(":path").unwrap_or(b"/");
        let path = String::from_utf8_lossy(path);
        let path = path.split('?').next().unwrap_or("/");
        let key = session_key(
            headers,
            &pool.affinity.headers,
            pool.affinity.fingerprint,
            &method,
            path,
            &self.body,
        );

        // The subset hint: endpoints outside it are as good as tried already.
        let excluded: Vec<usize> = match &self.subset {
            None => Vec::new(),
            Some(list) => (0..pool.backends.len())
                .filter(|&i| {
                    let endpoint = pool.backends[i].url.server.authority.as_str();
                    !list.iter().any(|e| e == endpoint)
                })
                .collect(),
        };
        let candidates = || {
            (0..pool.backends.len())
                .filter(|i| !excluded.contains(i))
                .map(|i| &pool.backends[i])
        };
        let unavailable = |message: &str| Refusal {
            status: 503,
            kind: "no_endpoint",
            message: message.to_string(),
        };
        if !candidates().any(|b| b.healthy.load(Ordering::Relaxed)) {
            return Err(unavailable("no endpoint is available"));
        }
        let shed = self.picker.shed_in_flight.load(Ordering::Relaxed);
        if shed > 0
            && candidates()
                .filter(|b| b.takes_new())
                .all(|b| b.in_flight.load(Ordering::Relaxed) >= shed)
        {
            return Err(Refusal {
                status: 429,
                kind: "shed",
                message: format!("every endpoint has {shed} requests in flight"),
            });
        }
        let decision = router
            .route(&pool, key.as_ref(), &excluded, Commit::Placement)
            .ok_or_else(|| unavailable("no endpoint is available"))?;
        let backend = &pool.backends[decision.index];
        // The router sends somewhere when nothing is healthy; a picker cannot retry, so no.
        if !backend.healthy.load(Ordering::Relaxed) {
            return Err(unavailable("no endpoint is available"));
        }
        let source = key.as_ref().map_or(KeySource::None, |k| k.source);
        inner.metrics().routed(source, &decision);
        Ok(Placed {
            endpoint: backend.url.server.authority.as_str().to_string(),
            key,
            in_flight: Some(InFlight::new(backend.clone())),
        })
    }

    /// The gateway says another endpoint than the one picked served the request (it went down
    /// the list, or retried): the session continues there, where its cache now is.
    fn learn_served(&mut self, metadata: Option<&Metadata>) {
        let Some(served) = reply::metadata_string(metadata, reply::LB_NAMESPACE, reply::SERVED_KEY)
        else {
            return;
        };
        let Some(placed) = self.placed.as_mut() else {
            return;
        };
        let served = served.split(',').next().unwrap_or("").trim();
        if served == placed.endpoint {
            return;
        }
        let router = self.picker.inner.router();
        let pool = router.pool();
        let Some(backend) = pool
            .backends
            .iter()
            .find(|b| b.url.server.authority.as_str() == served)
        else {
            return;
        };
        if let Some(key) = &placed.key {
            let id = router.sessions.id(key);
            router.sessions.put(
                id,
                backend,
                true,
                Outcome::Failover,
                key.turn.context_bytes,
                tokio::time::Instant::now(),
            );
        }
        placed.endpoint = served.to_string();
        if placed.in_flight.is_some() {
            placed.in_flight = Some(InFlight::new(backend.clone()));
        }
    }

    /// The last the picker will see of the response: the request no longer counts in flight.
    /// That is the response head when the gateway sends no body (so sequential requests see
    /// each other's ends, as through the proxy), else the body's end; at the latest, the end of
    /// the stream.
    fn finish_response(&mut self) {
        if let Some(placed) = self.placed.as_mut() {
            placed.in_flight = None;
        }
    }
}
