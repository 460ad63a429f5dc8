//! Upstream: one request's trip to a backend with failover before the first byte, answered
//! with the backend's response, whose body [`super::observed`] streams to the client; and the
//! answers the proxy makes itself (errors, refusals).

use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri, Version};
use http_body::Body as HttpBody;
use http_body_util::{BodyExt, Either, Full, Limited};
use hyper::body::Incoming;
use pin_project_lite::pin_project;
use tokio::time::Instant;

use super::continued::{self, Continued};
use super::fields::OutboundFields;
use super::forwarded::{forward_headers, ClientConn, Hop};
use super::health;
use super::held_body::{BodyParts, HeldBody};
use super::metrics::{ClientTimeout, ErrorKind, RetryReason};
use super::observed::{Exchange, ObservedBody, SessionTurn};
use super::pool::{PoolError, UpstreamRequest, UpstreamResponse};
use super::routing::{
    fingerprint_applies, fingerprint_key, header_key, Backend, Commit, InFlight, SessionKey, Turn,
};
use super::Inner;
use crate::http1::fields::{is_valid_host, text};
use crate::http1::{Fields, WireFields};
use crate::tap::{ExchangeEnd, ExchangeStart, KeySource};
use crate::wire::Api;

/// The backend's name on responses, built once: inserting by `&str` parses the name on
/// every request.
const X_AGENTRACE_BACKEND: HeaderName = HeaderName::from_static("x-agentrace-backend");

/// The response body the proxy sends: a streamed upstream body, forwarded frame by frame, or a
/// small one the proxy made (errors, admin). The upstream one is boxed once per response so
/// that a local answer stays small.
pub(crate) type ProxyBody = Either<Box<ObservedBody>, Full<Bytes>>;

/// What the client is answered: status, the fields to send, and the body.
pub(crate) struct Answer {
    /// Status.
    pub status: StatusCode,
    /// The fields to send.
    pub headers: OutboundFields,
    /// The body.
    pub body: ProxyBody,
}

impl Answer {
    /// The answer as hyper sends it (HTTP/2).
    pub(crate) fn into_response(self) -> Response<ProxyBody> {
        let mut resp = Response::new(self.body);
        *resp.status_mut() = self.status;
        *resp.headers_mut() = self.headers.to_map();
        resp
    }
}

/// A proxy-made JSON error response in the OpenAI error shape.
pub(crate) fn error_response(status: StatusCode, kind: &'static str, message: &str) -> Answer {
    let body = serde_json::json!({"error": {"message": message, "type": kind}});
    let headers = WireFields::from_pairs([
        (&b"content-type"[..], &b"application/json"[..]),
        (b"x-agentrace-error", kind.as_bytes()),
    ]);
    Answer {
        status,
        headers: OutboundFields::new(headers, &[], Vec::new()),
        body: Either::Right(Full::new(Bytes::from(body.to_string()))),
    }
}

pin_project! {
    /// An upstream attempt counted in flight on its backend. Fields drop in order, so an
    /// abandoned attempt stops counting before its connection closes: a backend that has seen
    /// the cancel never finds the proxy still counting the request. One dropped before the
    /// response head (the client went away, or reset its stream) is counted as cancelled, so
    /// `agentrace_requests_total` shows every request a backend was sent.
    struct Counted<F> {
        in_flight: Option<InFlight>,
        #[pin]
        send: F,
    }

    impl<F> PinnedDrop for Counted<F> {
        fn drop(this: Pin<&mut Self>) {
            if let Some(in_flight) = this.project().in_flight.take() {
                in_flight.backend().metrics.request_cancelled();
            }
        }
    }
}

impl<F: std::future::Future> std::future::Future for Counted<F> {
    type Output = (F::Output, InFlight);

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let out = std::task::ready!(this.send.poll(cx));
        let in_flight = this
            .in_flight
            .take()
            .expect("Counted polled after completion");
        Poll::Ready((out, in_flight))
    }
}

/// When a request started: a monotonic instant, and wall-clock nanoseconds for the recorder.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Started {
    at: Instant,
    unix_ns: u128,
}

impl Started {
    /// Now; the wall clock is read only when a recorder will want it.
    pub(crate) fn now(inner: &Inner) -> Self {
        let unix_ns = inner.sink.as_ref().map_or(0, |_| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
        });
        Self {
            at: Instant::now(),
            unix_ns,
        }
    }

    /// When the request's first byte reached the host (kernel time, see [`super::arrival`]),
    /// if known and believable; else now.
    pub(crate) fn arrived(inner: &Inner, unix_ns: Option<u128>) -> Self {
        match unix_ns.and_then(|ns| Some((super::arrival::instant_of(ns)?, ns))) {
            Some((at, unix_ns)) if inner.sink.is_some() => Self { at, unix_ns },
            _ => Self::now(inner),
        }
    }
}

/// Handles one request that hyper parsed (HTTP/2 ingress): reads its body within the limit,
/// then [`forward`]s it.
pub(crate) async fn handle(
    inner: Arc<Inner>,
    req: Request<Incoming>,
    client: Arc<ClientConn>,
) -> Response<ProxyBody> {
    if let Some(refused) = refused_head(&inner, &req) {
        return refused.into_response();
    }
    read_and_forward(inner, req, client).await.into_response()
}

/// The answer to an HTTP/2 request whose head HTTP/1.1 ingress would refuse too: `CONNECT`
/// (405), an `:authority` or `Host` that is not a valid host, or more than one `Host` (400).
fn refused_head(inner: &Inner, req: &Request<Incoming>) -> Option<Answer> {
    if req.method() == Method::CONNECT {
        return Some(refuse_connect(inner));
    }
    let authority_ok = req
        .uri()
        .authority()
        .is_none_or(|a| is_valid_host(a.as_str().as_bytes()));
    let mut hosts = req.headers().get_all(header::HOST).iter();
    let host_ok = match (hosts.next(), hosts.next()) {
        (None, _) => true,
        (Some(host), None) => is_valid_host(host.as_bytes()),
        (Some(_), Some(_)) => false,
    };
    (!(authority_ok && host_ok)).then(|| {
        refuse(
            inner,
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "invalid :authority or Host (one host[:port] is expected)",
        )
    })
}

async fn read_and_forward(
    inner: Arc<Inner>,
    req: Request<Incoming>,
    client: Arc<ClientConn>,
) -> Answer {
    let started = Started::now(&inner);
    let (parts, body) = req.into_parts();
    let limit = inner.max_request_body;
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit) {
        return too_large(&inner, limit);
    }
    // Frame by frame, so that a body that stops arriving is refused like an HTTP/1.1 one,
    // and each frame is counted against the body budget as it arrives. Held until the request
    // has been forwarded: the end of this function.
    let mut charge = inner.body_budget.charge();
    let mut body = Limited::new(body, limit as usize);
    // Copied into parts as frames arrive, so the frames (and the HTTP/2 connection's buffers
    // under them) are let go at once.
    let most = usize::try_from(declared.unwrap_or(limit)).unwrap_or(usize::MAX);
    let mut gathered = BodyParts::new(most);
    loop {
        match tokio::time::timeout(inner.client_limits.body, body.frame()).await {
            Ok(None) => break,
            Ok(Some(Ok(frame))) => {
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                if !gathered.push(&data, &mut charge) {
                    return over_budget(&inner);
                }
            }
            Ok(Some(Err(e))) if e.is::<http_body_util::LengthLimitError>() => {
                return too_large(&inner, limit)
            }
            Ok(Some(Err(e))) => {
                return refuse(
                    &inner,
                    StatusCode::BAD_REQUEST,
                    "invalid_request_error",
                    &format!("could not read the request body: {e}"),
                )
            }
            Err(_) => {
                inner.metrics.client_timeout(ClientTimeout::Body);
                return refuse(
                    &inner,
                    StatusCode::REQUEST_TIMEOUT,
                    "invalid_request_error",
                    "request body not received in time",
                );
            }
        }
    }
    let body = gathered.finish();
    let req = ClientRequest {
        headers: WireFields::from_h2_request(&parts.headers),
        method: parts.method,
        uri: parts.uri,
        version: parts.version,
    };
    let answer = forward(&inner, req, &body, &client, started).await;
    body.release().await;
    answer
}

/// A client request as [`forward`] takes it: the head, with the body held apart by the caller.
pub(crate) struct ClientRequest {
    /// Method.
    pub method: Method,
    /// Request target.
    pub uri: Uri,
    /// Header fields as received.
    pub headers: WireFields,
    /// The protocol version it came in, as `Via` names it.
    pub version: Version,
}

/// Bodies up to this size are fingerprinted on the worker that received them; parsing a
/// larger one would hold up every other connection on that worker, so it runs on a
/// blocking thread instead.
const INLINE_FINGERPRINT_BYTES: usize = 256 * 1024;

/// The fingerprint key of a chat body. A body of several parts is parsed from a joined copy,
/// counted against the body budget and dropped once hashed: without room for it, no key.
async fn body_fingerprint(
    inner: &Arc<Inner>,
    body: &HeldBody,
    api: Api,
    turn: Turn,
) -> Option<SessionKey> {
    fn key(inner: &Inner, body: &HeldBody, api: Api, turn: Turn) -> Option<SessionKey> {
        let mut copy = inner.body_budget.charge();
        fingerprint_key(api, &body.contiguous(&mut copy)?, turn)
    }
    if body.len() <= INLINE_FINGERPRINT_BYTES {
        return key(inner, body, api, turn);
    }
    let (inner, body) = (inner.clone(), body.clone());
    tokio::task::spawn_blocking(move || key(&inner, &body, api, turn))
        .await
        .ok()
        .flatten()
}

/// Forwards one whole request: routes it by its session key, sends it with failover before
/// the first response byte (as far as [`WorkerPool::may_resend`] allows), and answers with
/// the backend's response, whose body streams through frame by frame while the metrics and
/// the recorder watch it. The body is borrowed: the caller releases it
/// ([`HeldBody::release`]) once the answer is in. Awaiting this from a wrapper that held
/// the body would copy the whole of this future into the wrapper's, a few KiB a request.
///
/// [`WorkerPool::may_resend`]: super::pool::WorkerPool::may_resend
pub(crate) async fn forward(
    inner: &Arc<Inner>,
    req: ClientRequest,
    body: &HeldBody,
    client: &ClientConn,
    started: Started,
) -> Answer {
    let request_received_at = Instant::now();
    let ClientRequest {
        method,
        uri,
        headers,
        version,
    } = req;
    let view = inner.workers.get(client.worker);
    let pool = &view.pool;
    let path_and_query = uri
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/"));
    let turn = body.turn();
    let api = Api::of_path(path_and_query.path());
    let continued = Continued::of(api, body, &inner.router.response_ids);
    let key = match header_key(&headers, &pool.affinity.headers, turn) {
        Some(key) => Some(key),
        None => match continued.as_ref().and_then(|c| c.session_key(turn)) {
            Some(key) => Some(key),
            None => {
                match fingerprint_applies(pool.affinity.fingerprint, &method, path_and_query.path())
                {
                    Some(api) => body_fingerprint(inner, body, api, turn).await,
                    None => None,
                }
            }
        },
    };
    let pinned = match &continued {
        Some(c) => match c.backend(pool) {
            Some(index) => Some(index),
            None => {
                let answer = c.gone();
                inner.metrics.refused(answer.status);
                return answer;
            }
        },
        None => None,
    };
    let key_source = key.as_ref().map_or(KeySource::None, |k| k.source);
    // The recorder keeps the request as the client sent it; the forwarded copy is edited.
    let recorded_headers = inner.sink.as_ref().map(|_| headers.to_map());
    let declare_length =
        !body.is_empty() || headers.has("content-length") || headers.has("transfer-encoding");
    let hop = Hop {
        via: &inner.via,
        version,
    };
    let headers = match forward_headers(headers, &uri, client, hop) {
        Ok(headers) => headers,
        Err(looped_at) => return looped(inner, &looped_at.host),
    };
    // What the recorder learns of this exchange, for the backend that answers (or failed last).
    let exchange = |backend: &Backend| {
        exchange_start(
            &key,
            key_source,
            backend,
            started,
            request_received_at,
            &method,
            recorded_headers.as_ref(),
            &path_and_query,
            body,
        )
    };

    let upstream_pool = &view.upstream;
    let retries = inner.retries.load(Ordering::Relaxed) as usize;
    let mut tried: Vec<usize> = Vec::new();
    let mut overhead = Duration::ZERO;

    let (index, in_flight, turn, response, sent_at) = loop {
        let decision = match pinned {
            Some(i) => Some(inner.router.route_to(pool, i, key.as_ref(), Commit::Turn)),
            None => inner.router.route(pool, key.as_ref(), &tried, Commit::Turn),
        };
        let Some(decision) = decision else {
            return refuse(
                inner,
                StatusCode::SERVICE_UNAVAILABLE,
                "no_backend",
                "no backend is available",
            );
        };
        inner.metrics.routed(key_source, &decision);
        // Borrowed from the worker's view; the one clone is the in-flight count's.
        let backend = &pool.backends[decision.index];
        let sent_at = Instant::now();
        if tried.is_empty() {
            overhead = sent_at.duration_since(request_received_at);
        }
        let request = UpstreamRequest {
            method: &method,
            path_and_query: &path_and_query,
            headers: &headers,
            body,
            declare_length,
            sent_at,
        };
        let turn = SessionTurn::start(&view, decision.session, api);
        let attempt = Counted {
            in_flight: Some(InFlight::new(backend.clone())),
            send: upstream_pool.send(&backend.url, request),
        };
        match attempt.await {
            (Ok(resp), in_flight) => break (decision.index, in_flight, turn, resp, sent_at),
            (Err(PoolError::Request(e)), _) => {
                return refuse(inner, StatusCode::BAD_REQUEST, "invalid_request_error", &e);
            }
            (Err(e), _) => {
                let kind = match e {
                    PoolError::Connect { .. } => ErrorKind::Connect,
                    _ => ErrorKind::Send,
                };
                let cause = crate::telemetry::error_chain(&e);
                backend.metrics.error(kind);
                health::on_error(backend, kind, &pool.health);
                tried.push(decision.index);
                let resend = upstream_pool.may_resend(&e, &method);
                let again = resend && pinned.is_none();
                if again && tried.len() <= retries && tried.len() < pool.backends.len() {
                    inner.metrics.retry(retry_reason(&e));
                    tracing::warn!(backend = %backend.name, error = %cause, kind = kind.as_str(), "upstream failed before the response; retrying on the next choice");
                    continue;
                }
                if resend {
                    tracing::warn!(backend = %backend.name, error = %cause, kind = kind.as_str(), "upstream failed before the response; giving up");
                } else {
                    tracing::warn!(backend = %backend.name, error = %cause, kind = kind.as_str(), "upstream failed after the request reached it; not sending it again");
                }
                if let Some(sink) = &inner.sink {
                    let mut observer = sink.start(exchange(backend));
                    std::future::poll_fn(|cx| observer.poll_ready(cx)).await;
                    observer.end(ExchangeEnd::UpstreamError(cause.clone()), Instant::now());
                }
                if let Some(c) = &continued {
                    let answer = c.unavailable(&cause);
                    inner.metrics.refused(answer.status);
                    return answer;
                }
                return refuse(
                    inner,
                    StatusCode::BAD_GATEWAY,
                    "upstream_error",
                    &format!("backend {} failed: {cause}", backend.name),
                );
            }
        }
    };

    let head_at = Instant::now();
    let backend = in_flight.backend();
    let UpstreamResponse {
        status,
        headers,
        body: incoming,
    } = response;
    health::on_response(backend, status, &pool.health);
    backend.metrics.request(status);
    let named = view.name_headers[index].iter();
    let added = named.map(|v| (X_AGENTRACE_BACKEND, v.clone())).collect();
    let headers = OutboundFields::new(headers, &[], added);
    let declared_length = headers.has("content-length");
    // An error event can be appended only to a stream without a declared length.
    let sse = !declared_length
        && headers
            .first("content-type")
            .and_then(text)
            .is_some_and(|v| v.starts_with("text/event-stream"));

    let observer = inner.sink.as_ref().map(|sink| {
        let mut observer = sink.start(exchange(backend));
        observer.response_head(status, &headers.to_map(), head_at);
        observer
    });
    // For a body of known length (a plain JSON answer), take its first frame before
    // answering: it is normally in the same packet as the head, and the client then gets head
    // and body in one write instead of two. Streams (no length) are answered at once.
    let mut incoming = incoming;
    let mut pending = None;
    if declared_length && !incoming.is_end_stream() {
        pending = incoming.frame().await;
    }
    let empty = pending.is_none() && incoming.is_end_stream();
    let learner = continued::learner(
        api,
        status,
        &inner.router.response_ids,
        backend,
        key.as_ref(),
    );
    let exchange =
        Exchange::new(in_flight, turn, observer, sent_at, sse).learning_response_id(learner);
    let mut observed = ObservedBody::new(incoming, pending, exchange);
    if empty {
        // No body to poll (204, 304, HEAD, length 0): the exchange is complete already.
        observed.complete_at_head(head_at).await;
    }
    inner.metrics.overhead(overhead + head_at.elapsed());
    Answer {
        status,
        headers,
        body: Either::Left(Box::new(observed)),
    }
}

/// Why a failed request is sent again, as the retry counter labels it.
fn retry_reason(e: &PoolError) -> RetryReason {
    match e {
        PoolError::Connect { .. } => RetryReason::Connect,
        PoolError::NotSent(_) => RetryReason::NotSent,
        _ => RetryReason::AfterSend,
    }
}

/// A request answered by the proxy itself, counted by status.
pub(crate) fn refuse(
    inner: &Inner,
    status: StatusCode,
    kind: &'static str,
    message: &str,
) -> Answer {
    inner.metrics.refused(status);
    error_response(status, kind, message)
}

/// The answer to a request that came back to this proxy instance: forwarding it again would
/// loop until some limit broke (RFC 9110 §7.6.3, RFC 5842 §7.2).
fn looped(inner: &Inner, host: &str) -> Answer {
    inner.metrics.loop_refused();
    inner.via.log_loop(host);
    refuse(
        inner,
        StatusCode::LOOP_DETECTED,
        "loop_detected",
        &format!(
            "the request came back to this proxy ({} in its Via): a backend points at the proxy, directly or through another proxy",
            inner.via.name()
        ),
    )
}

/// The methods the proxy forwards, as a 405 must list them (RFC 9110 §15.5.6); extension
/// methods are forwarded too, only `CONNECT` is not.
const ALLOWED_METHODS: HeaderValue =
    HeaderValue::from_static("GET, HEAD, POST, PUT, DELETE, OPTIONS, TRACE, PATCH");

/// The answer to `CONNECT`: the proxy forwards requests and opens no tunnels.
pub(crate) fn refuse_connect(inner: &Inner) -> Answer {
    let mut answer = refuse(
        inner,
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        "CONNECT is not supported: the proxy opens no tunnels",
    );
    answer.headers.set(header::ALLOW, ALLOWED_METHODS);
    answer
}

/// The answer to a request body over `max_request_body_bytes`.
pub(crate) fn too_large(inner: &Inner, limit: u64) -> Answer {
    refuse(
        inner,
        StatusCode::PAYLOAD_TOO_LARGE,
        "request_too_large",
        &format!("request body exceeds max_request_body_bytes ({limit})"),
    )
}

/// The answer to a request body that would take the bodies held by all requests past
/// `request_body_budget_bytes`: the client may send it again shortly.
pub(crate) fn over_budget(inner: &Inner) -> Answer {
    inner.metrics.body_budget_refused();
    let mut answer = refuse(
        inner,
        StatusCode::SERVICE_UNAVAILABLE,
        "overloaded",
        &format!(
            "request bodies held by the proxy are at request_body_budget_bytes ({}); retry shortly",
            inner.body_budget.limit()
        ),
    );
    answer.headers.set(
        header::RETRY_AFTER,
        HeaderValue::from(super::budget::RETRY_AFTER_SECS),
    );
    answer
}

#[allow(clippy::too_many_arguments)]
fn exchange_start(
    key: &Option<super::routing::SessionKey>,
    key_source: KeySource,
    backend: &Backend,
    started: Started,
    request_received_at: Instant,
    method: &http::Method,
    request_headers: Option<&HeaderMap>,
    path_and_query: &http::uri::PathAndQuery,
    body: &HeldBody,
) -> ExchangeStart {
    // The recorder keeps the body in one piece; joined only when recording.
    let request_body = body.single().cloned().unwrap_or_else(|| {
        let mut joined = BytesMut::with_capacity(body.len());
        body.parts().for_each(|p| joined.extend_from_slice(p));
        joined.freeze()
    });
    ExchangeStart {
        session_key: key.as_ref().map(|k| k.text.clone()),
        key_source,
        backend: backend.name.to_string(),
        started_unix_ns: started.unix_ns,
        started_at: started.at,
        request_received_at,
        method: method.clone(),
        path_and_query: path_and_query.as_str().to_string(),
        request_headers: request_headers.cloned().unwrap_or_default(),
        request_body,
    }
}
