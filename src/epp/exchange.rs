//! One HTTP request as the gateway streams it to the picker: its headers, its body (held to
//! its end, bounded, when the body is streamed full-duplex), the placement, and what the
//! gateway says served it.

use std::ops::Deref;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request, ProcessingRequest, ProcessingResponse,
};
use http::Method;

use super::reply;
use super::selection::Selection;
use super::Picker;
use crate::http1::Fields;
use crate::proxy::budget::{BodyBudget, Charge};
use crate::proxy::routing::{
    header_key, session_key, Commit, InFlight, Outcome, Pool, SessionKey, Turn,
};
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

/// A message the gateway may not send: the stream ends with `INVALID_ARGUMENT`.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Malformed {
    /// A `ProcessingRequest` with none of its phases set.
    #[error("ProcessingRequest with no request phase set")]
    NoPhase,
    /// A request body or trailers before the request headers.
    #[error("{0} before the request headers")]
    BeforeHeaders(&'static str),
    /// Request headers twice on one stream (one stream is one HTTP request).
    #[error("request headers twice on one stream")]
    HeadersTwice,
}

/// The picker's way to the proxy's body budget, kept alive by the exchange charging it.
pub(crate) struct Budget(Arc<Picker>);

/// A held body's charge, handed on with the reply carrying the body: the bytes count until
/// the gRPC server takes that reply to send.
pub(crate) type HeldCharge = Charge<Budget>;

impl Deref for Budget {
    type Target = BodyBudget;

    fn deref(&self) -> &BodyBudget {
        self.0.inner.body_budget()
    }
}

/// Where a request was placed.
struct Placed {
    endpoint: String,
    /// When it was placed: it counts in flight until `epp.in_flight_max_ms` after, at most.
    at: tokio::time::Instant,
    /// The endpoints the gateway was given for this request: the only ones it may report
    /// as having served it.
    offered: Vec<String>,
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

/// The answer to a body over `max_request_body_bytes`.
fn too_large(limit: u64) -> Refusal {
    Refusal {
        status: 413,
        kind: "body_too_large",
        message: format!("request body larger than {limit} bytes"),
    }
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
    /// The held body as the gateway sent it: each chunk stays the allocation it arrived in,
    /// so the memory held is what the budget counts.
    body: Vec<Vec<u8>>,
    body_len: usize,
    /// The held body's bytes (and its joined copy) against `request_body_budget_bytes`.
    charge: HeldCharge,
    /// The charge of a body just put in a reply, for the caller to send along with it.
    pub(crate) handed_on: Option<HeldCharge>,
    placed: Option<Placed>,
    /// An immediate response was sent: the stream is over.
    pub(crate) done: bool,
}

impl Exchange {
    pub(crate) fn new(picker: Arc<Picker>) -> Self {
        Self {
            charge: Charge::on(Budget(picker.clone())),
            handed_on: None,
            body_len: 0,
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

    /// The replies to one message from the gateway, in order; a message out of protocol ends
    /// the stream.
    pub(crate) fn on(
        &mut self,
        msg: ProcessingRequest,
    ) -> Result<Vec<ProcessingResponse>, Malformed> {
        match &msg.request {
            None => return Err(Malformed::NoPhase),
            Some(Request::RequestHeaders(_)) if self.headers.is_some() => {
                return Err(Malformed::HeadersTwice)
            }
            Some(Request::RequestBody(_)) if self.headers.is_none() => {
                return Err(Malformed::BeforeHeaders("request body"))
            }
            Some(Request::RequestTrailers(_)) if self.headers.is_none() => {
                return Err(Malformed::BeforeHeaders("request trailers"))
            }
            _ => {}
        }
        Ok(self.reply(msg))
    }

    fn reply(&mut self, msg: ProcessingRequest) -> Vec<ProcessingResponse> {
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
                if let Some(refusal) = self.declared_too_large() {
                    return vec![self.refuse(refusal)];
                }
                if h.end_of_stream || !self.hold_body {
                    let key = self.key_from_headers();
                    return self.decide_with(key).into_iter().collect();
                }
                match self.early_key() {
                    Some(key) => self.decide_with(Some(key)).into_iter().collect(),
                    None => Vec::new(),
                }
            }
            Some(Request::RequestBody(b)) => {
                if !self.hold_body {
                    return vec![reply::request_body_ack()];
                }
                let limit = self.picker.inner.max_request_body();
                if (self.body_len + b.body.len()) as u64 > limit {
                    return vec![self.refuse(too_large(limit))];
                }
                if self.placed.is_some() {
                    // Placed at the headers: each chunk goes straight back, counted, not held.
                    self.body_len += b.body.len();
                    return vec![reply::request_body(b.body, b.end_of_stream)];
                }
                if !self.charge.try_add(b.body.len() as u64) {
                    return vec![self.over_budget()];
                }
                if !b.body.is_empty() {
                    self.body_len += b.body.len();
                    self.body.push(b.body);
                }
                if !b.end_of_stream {
                    return Vec::new();
                }
                let Some(body) = self.join_body() else {
                    return vec![self.over_budget()];
                };
                let mut out: Vec<ProcessingResponse> = self.decide(&body).into_iter().collect();
                if !self.done {
                    out.push(reply::request_body(body, true));
                    self.hand_on_body();
                }
                out
            }
            Some(Request::RequestTrailers(_)) => {
                let mut out = Vec::new();
                if self.placed.is_none() && !self.done {
                    let Some(body) = self.join_body() else {
                        return vec![self.over_budget()];
                    };
                    out.extend(self.decide(&body));
                    if self.done {
                        return out;
                    }
                    if self.hold_body {
                        out.push(reply::request_body(body, false));
                    }
                    self.hand_on_body();
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
    fn decide(&mut self, body: &[u8]) -> Option<ProcessingResponse> {
        if self.placed.is_some() || self.done {
            return None;
        }
        let key = self.key_from_body(body);
        self.decide_with(key)
    }

    /// Places the request under `key`: the destination reply, or an immediate refusal.
    fn decide_with(&mut self, key: Option<SessionKey>) -> Option<ProcessingResponse> {
        if self.placed.is_some() || self.done {
            return None;
        }
        match self.place(key) {
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
        self.release_body();
        if let Ok(status) = http::StatusCode::from_u16(refusal.status) {
            self.picker.inner.metrics().refused(status);
        }
        reply::immediate(refusal.status, refusal.kind, &refusal.message)
    }

    /// The answer when held bodies are at `request_body_budget_bytes`: the proxy's, a `503`
    /// the client may retry shortly.
    fn over_budget(&mut self) -> ProcessingResponse {
        self.picker.inner.metrics().body_budget_refused();
        let message = format!(
            "request bodies held by the proxy are at request_body_budget_bytes ({}); retry shortly",
            self.picker.inner.body_budget().limit()
        );
        let mut reply = self.refuse(Refusal {
            status: 503,
            kind: "overloaded",
            message,
        });
        reply::add_retry_after(&mut reply, crate::proxy::budget::RETRY_AFTER_SECS);
        reply
    }

    /// The held body in one piece: the chunk itself when it came in one, else a copy counted
    /// against the budget (None without room for it).
    fn join_body(&mut self) -> Option<Vec<u8>> {
        if self.body.len() <= 1 {
            return Some(self.body.pop().unwrap_or_default());
        }
        if !self.charge.try_add(self.body_len as u64) {
            return None;
        }
        let mut joined = Vec::with_capacity(self.body_len);
        for chunk in self.body.drain(..) {
            joined.extend_from_slice(&chunk);
        }
        Some(joined)
    }

    /// The body went into a reply: its charge goes with it.
    fn hand_on_body(&mut self) {
        let fresh = Charge::on(Budget(self.picker.clone()));
        self.handed_on = Some(std::mem::replace(&mut self.charge, fresh));
        self.body = Vec::new();
        self.body_len = 0;
    }

    /// The body is refused: nothing held counts against the budget any more.
    fn release_body(&mut self) {
        self.body = Vec::new();
        self.body_len = 0;
        self.charge = Charge::on(Budget(self.picker.clone()));
    }

    /// The request's headers (none before they came).
    fn headers(&self) -> &Headers {
        static NONE: Headers = Headers(Vec::new());
        self.headers.as_ref().unwrap_or(&NONE)
    }

    /// The session key as the proxy finds it: a header, else the body's fingerprint.
    fn key_from_body(&self, body: &[u8]) -> Option<SessionKey> {
        let router = self.picker.inner.router();
        let pool = router.pool();
        let headers = self.headers();
        let method = headers
            .first(":method")
            .and_then(|m| Method::from_bytes(m).ok())
            .unwrap_or(Method::GET);
        let path = headers.first(":path").unwrap_or(b"/");
        let path = String::from_utf8_lossy(path);
        let path = path.split('?').next().unwrap_or("/");
        session_key(
            headers,
            &pool.affinity.headers,
            pool.affinity.fingerprint,
            &method,
            path,
            body,
        )
    }

    /// The header session key, with the turn the headers tell: the declared body length
    /// (what the body would count, so the placement weighs the same bytes).
    fn key_from_headers(&self) -> Option<SessionKey> {
        let turn = Turn {
            context_bytes: self.declared_length().unwrap_or(0),
            continues: false,
        };
        let pool = self.picker.inner.router().pool();
        header_key(self.headers(), &pool.affinity.headers, turn)
    }

    /// The key of a request that can be placed at its headers, before its body, exactly where
    /// the body would have placed it: a header key of a session the table knows (placement
    /// reads whether a conversation continues only for sessions it does not know), with its
    /// body length declared. A new session, or a body of unknown length, waits for the body.
    fn early_key(&self) -> Option<SessionKey> {
        self.declared_length()?;
        let key = self.key_from_headers()?;
        let router = self.picker.inner.router();
        let pool = router.pool();
        let id = router.sessions.id(&key);
        let known = router
            .sessions
            .slot(id, tokio::time::Instant::now())
            .known(&pool.backends)
            .is_some();
        known.then_some(key)
    }

    /// The body length the request declares (`content-length`), if it declares one.
    fn declared_length(&self) -> Option<u64> {
        let value = self.headers().first("content-length")?;
        std::str::from_utf8(value).ok()?.trim().parse().ok()
    }

    /// A declared body over `max_request_body_bytes` is refused at once, as the proxy does.
    fn declared_too_large(&self) -> Option<Refusal> {
        let limit = self.picker.inner.max_request_body();
        self.declared_length()
            .filter(|&n| n > limit)
            .map(|_| too_large(limit))
    }

    fn place(&self, key: Option<SessionKey>) -> Result<Placed, Refusal> {
        let inner = &self.picker.inner;
        let router = inner.router();
        let pool = router.pool();

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
        let excluded = self.selected(self.headers(), &pool, excluded)?;
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
        let endpoint = backend.url.server.authority.as_str().to_string();
        Ok(Placed {
            at: tokio::time::Instant::now(),
            offered: vec![endpoint.clone()],
            endpoint,
            key,
            in_flight: Some(InFlight::new(backend.clone())),
        })
    }

    /// With `epp.selection_header` set and present, also excludes the endpoints it does not
    /// name. Naming none of those left is a `429`, as the conformance suite expects of a
    /// request the picker drops.
    fn selected(
        &self,
        headers: &Headers,
        pool: &Pool,
        mut excluded: Vec<usize>,
    ) -> Result<Vec<usize>, Refusal> {
        let Some(name) = self.picker.selection_header.as_deref() else {
            return Ok(excluded);
        };
        let Some(selection) = headers.first(name).and_then(Selection::parse) else {
            return Ok(excluded);
        };
        let allowed: Vec<usize> = (0..pool.backends.len())
            .filter(|i| !excluded.contains(i))
            .collect();
        let unnamed: Vec<usize> = allowed
            .iter()
            .copied()
            .filter(|&i| !selection.names(pool.backends[i].url.server.authority.as_str()))
            .collect();
        // No endpoint allowed at all (an empty subset) stays the protocol's 503.
        if !allowed.is_empty() && unnamed.len() == allowed.len() {
            return Err(Refusal {
                status: 429,
                kind: "not_selected",
                message: format!("{name} names no endpoint of the pool"),
            });
        }
        excluded.extend(unnamed);
        Ok(excluded)
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
        // Only the gateway knows what served, but anyone who can open a stream can say so:
        // a session moves only to an endpoint this stream was offered.
        if !placed.offered.iter().any(|e| e == served) {
            self.picker
                .inner
                .metrics()
                .epp_refused("served_not_offered");
            tracing::debug!(served, offered = ?placed.offered, "served endpoint ignored: not offered for this stream");
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

    /// When the request stops counting in flight even if the gateway never says it ended.
    pub(crate) fn in_flight_until(
        &self,
        longest: std::time::Duration,
    ) -> Option<tokio::time::Instant> {
        let placed = self.placed.as_ref()?;
        placed.in_flight.as_ref()?;
        Some(placed.at + longest)
    }

    /// The request has counted in flight for `epp.in_flight_max_ms`: it stops counting.
    pub(crate) fn expire_in_flight(&mut self) {
        if let Some(placed) = self.placed.as_mut() {
            if placed.in_flight.take().is_some() {
                self.picker.inner.metrics().epp_refused("in_flight_expired");
                tracing::debug!(endpoint = %placed.endpoint, "request counted in flight past epp.in_flight_max_ms: no longer counted");
            }
        }
    }
}
