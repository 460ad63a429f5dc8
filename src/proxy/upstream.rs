//! Upstream: one request's trip to a backend with failover before the first
//! byte, and the response body that streams frame by frame while metrics and the tap watch it.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri};
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::{BodyExt, Either, Full, Limited};
use hyper::body::Incoming;
use pin_project_lite::pin_project;
use tokio::time::Instant;

use super::config::UpstreamConfig;
use super::fields::{self, OutboundFields};
use super::health;
use super::held_body::{BodyParts, HeldBody};
use super::metrics::{BackendMetrics, ClientTimeout, ErrorKind, RetryReason};
use super::pool::{PoolError, UpstreamBody, UpstreamRequest, UpstreamResponse, WorkerPool};
use super::routing::{
    fingerprint_applies, fingerprint_key, header_key, Backend, InFlight, SessionKey, Turn,
};
use super::{Inner, ProxyError};
use crate::http1::fields::{is_valid_host, put_quoted, text};
use crate::http1::{Fields, WireFields};
use crate::http_body::BoxError;
use crate::remote::{self, Trust};
use crate::tap::{ExchangeEnd, ExchangeObserver, ExchangeStart, KeySource};

/// A connection pool (one per forwarding worker, one for health probes), offering HTTP/2 and
/// HTTP/1.1 to `https` backends, verified against `upstream.ca_file`, else the platform's CA
/// store; with no `https` backend the store is not read.
pub fn connection_pool(cfg: &UpstreamConfig, any_https: bool) -> Result<WorkerPool, ProxyError> {
    let trust = match &cfg.ca_file {
        Some(path) => Trust::CaFile(path),
        None if any_https => Trust::Platform,
        None => Trust::Nothing,
    };
    let tls = remote::client_config(trust, &[b"h2", b"http/1.1"])?;
    Ok(WorkerPool::new(
        tokio_rustls::TlsConnector::from(Arc::new(tls)),
        Duration::from_millis(cfg.connect_timeout_ms),
        cfg.pool_max_idle_per_backend,
        Duration::from_secs(cfg.pool_idle_timeout_secs),
        cfg.retry_after_send,
        Duration::from_millis(cfg.stream_close_watch_ms),
    ))
}

// Names built once: inserting by `&str` parses the name on every request.
const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
const X_AGENTRACE_BACKEND: HeaderName = HeaderName::from_static("x-agentrace-backend");

/// The response body the proxy sends: a streamed upstream body, forwarded frame by frame, or a
/// small one the proxy made (errors, admin). The upstream one is boxed once per response so
/// that a local answer stays small.
pub type ProxyBody = Either<Box<ObservedBody>, Full<Bytes>>;

/// What the client is answered: status, the fields to send, and the body.
pub struct Answer {
    /// Status.
    pub status: StatusCode,
    /// The fields to send.
    pub headers: OutboundFields,
    /// The body.
    pub body: ProxyBody,
}

impl Answer {
    /// The answer as hyper sends it (HTTP/2).
    pub fn into_response(self) -> Response<ProxyBody> {
        let mut resp = Response::new(self.body);
        *resp.status_mut() = self.status;
        *resp.headers_mut() = self.headers.to_map();
        resp
    }
}

/// A proxy-made JSON error response in the OpenAI error shape.
pub fn error_response(status: StatusCode, kind: &'static str, message: &str) -> Answer {
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

/// What every request of one client connection shares: who the client is, as the forwarded
/// headers say it (formatted once per connection), and which worker serves it.
pub struct ClientConn {
    /// The client's IP address, as `X-Forwarded-For` lists it.
    ip: HeaderValue,
    /// The `for=` element of `Forwarded` (IPv6 quoted and bracketed).
    forwarded_for: String,
    /// Whether the client connected with TLS.
    tls: bool,
    /// The forwarding worker (and so the upstream pool) serving the connection.
    worker: usize,
}

impl ClientConn {
    /// The shared view of a connection from `peer`.
    pub fn new(peer: SocketAddr, tls: bool, worker: usize) -> Self {
        let ip = peer.ip();
        Self {
            // An IP address is always a valid header value.
            ip: HeaderValue::from_str(&ip.to_string())
                .unwrap_or(HeaderValue::from_static("unknown")),
            forwarded_for: if ip.is_ipv6() {
                format!("for=\"[{ip}]\"")
            } else {
                format!("for={ip}")
            },
            tls,
            worker,
        }
    }
}

/// When a request started: a monotonic instant, and wall-clock nanoseconds for the recorder.
#[derive(Debug, Clone, Copy)]
pub struct Started {
    at: Instant,
    unix_ns: u128,
}

impl Started {
    /// Now; the wall clock is read only when a recorder will want it.
    pub fn now(inner: &Inner) -> Self {
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
    pub fn arrived(inner: &Inner, unix_ns: Option<u128>) -> Self {
        match unix_ns.and_then(|ns| Some((super::arrival::instant_of(ns)?, ns))) {
            Some((at, unix_ns)) if inner.sink.is_some() => Self { at, unix_ns },
            _ => Self::now(inner),
        }
    }
}

/// Handles one request that hyper parsed (HTTP/2 ingress): reads its body within the limit,
/// then [`forward`]s it.
pub async fn handle(
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
        body,
    };
    forward(&inner, req, &client, started).await
}

/// A whole client request, as [`forward`] takes it.
pub struct ClientRequest {
    /// Method.
    pub method: Method,
    /// Request target.
    pub uri: Uri,
    /// Header fields as received.
    pub headers: WireFields,
    /// The whole body.
    pub body: HeldBody,
}

/// Bodies up to this size are fingerprinted on the worker that received them; parsing a
/// larger one would hold up every other connection on that worker, so it runs on a
/// blocking thread instead.
const INLINE_FINGERPRINT_BYTES: usize = 256 * 1024;

/// The fingerprint key of a chat body. A body of several parts is parsed from a joined copy,
/// counted against the body budget and dropped once hashed: without room for it, no key.
async fn body_fingerprint(inner: &Arc<Inner>, body: &HeldBody, turn: Turn) -> Option<SessionKey> {
    fn key(inner: &Inner, body: &HeldBody, turn: Turn) -> Option<SessionKey> {
        let mut copy = inner.body_budget.charge();
        fingerprint_key(&body.contiguous(&mut copy)?, turn)
    }
    if body.len() <= INLINE_FINGERPRINT_BYTES {
        return key(inner, body, turn);
    }
    let (inner, body) = (inner.clone(), body.clone());
    tokio::task::spawn_blocking(move || key(&inner, &body, turn))
        .await
        .ok()
        .flatten()
}

/// Forwards one whole request: routes it by its session key, sends it with failover before
/// the first response byte (as far as [`WorkerPool::may_resend`] allows), and answers with
/// the backend's response, whose body streams through frame by frame while the metrics and
/// the recorder watch it.
pub async fn forward(
    inner: &Arc<Inner>,
    mut req: ClientRequest,
    client: &ClientConn,
    started: Started,
) -> Answer {
    let body = std::mem::take(&mut req.body);
    let answer = forward_held(inner, req, &body, client, started).await;
    body.release().await;
    answer
}

/// [`forward`] with the body borrowed, so that it is released once the request is done
/// without holding up the worker.
async fn forward_held(
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
        ..
    } = req;
    let pool = inner.router.pool();
    let path_and_query = uri
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/"));
    let turn = body.turn();
    let key = match header_key(&headers, &pool.affinity.headers, turn) {
        Some(key) => Some(key),
        None if fingerprint_applies(pool.affinity.fingerprint, &method, path_and_query.path()) => {
            body_fingerprint(inner, body, turn).await
        }
        None => None,
    };
    let key_source = key.as_ref().map_or(KeySource::None, |k| k.source);
    // The recorder keeps the request as the client sent it; the forwarded copy is edited.
    let recorded_headers = inner.sink.as_ref().map(|_| headers.to_map());
    let declare_length =
        !body.is_empty() || headers.has("content-length") || headers.has("transfer-encoding");
    let headers = forward_headers(headers, &uri, client);
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

    let upstream_pool = inner.worker_pools.read()[client.worker].clone();
    let retries = inner.retries.load(Ordering::Relaxed) as usize;
    let mut tried: Vec<usize> = Vec::new();
    let mut overhead = Duration::ZERO;

    let (backend, in_flight, response, sent_at) = loop {
        let Some(decision) = inner.router.route(&pool, key.as_ref(), &tried, true) else {
            return refuse(
                inner,
                StatusCode::SERVICE_UNAVAILABLE,
                "no_backend",
                "no backend is available",
            );
        };
        inner.metrics.decision(key_source, decision.outcome);
        let backend = pool.backends[decision.index].clone();
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
        };
        let attempt = Counted {
            in_flight: Some(InFlight::new(backend.clone())),
            send: upstream_pool.send(&backend.url, request),
        };
        match attempt.await {
            (Ok(resp), in_flight) => break (backend, in_flight, resp, sent_at),
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
                health::on_error(&backend, kind, &pool.health);
                tried.push(decision.index);
                let resend = upstream_pool.may_resend(&e, &method);
                if resend && tried.len() <= retries && tried.len() < pool.backends.len() {
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
                    let mut observer = sink.start(exchange(&backend));
                    std::future::poll_fn(|cx| observer.poll_ready(cx)).await;
                    observer.end(ExchangeEnd::UpstreamError(cause.clone()), Instant::now());
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
    let UpstreamResponse {
        status,
        headers,
        body: incoming,
    } = response;
    health::on_response(&backend, status, &pool.health);
    backend.metrics.request(status);
    let named = backend.name_header.iter();
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
        let mut observer = sink.start(exchange(&backend));
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
    let mut observed = ObservedBody {
        inner: incoming,
        pending,
        ended: false,
        exchange: Some(Exchange {
            backend,
            _in_flight: in_flight,
            observer,
            sent_at,
            got_first_byte: false,
            sse,
            at_event_boundary: true,
        }),
    };
    if empty {
        // No body to poll (204, 304, HEAD, length 0): the exchange is complete already.
        if let Some(observer) = observed.exchange.as_mut().and_then(|e| e.observer.as_mut()) {
            std::future::poll_fn(|cx| observer.poll_ready(cx)).await;
        }
        if let Some(exchange) = observed.exchange.take() {
            BackendMetrics::observe(
                &exchange.backend.metrics.ttfb,
                head_at.duration_since(sent_at),
            );
            exchange.finish(ExchangeEnd::Complete);
        }
    }
    inner
        .metrics
        .overhead
        .record((overhead + head_at.elapsed()).as_secs_f64());
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
pub fn refuse(inner: &Inner, status: StatusCode, kind: &'static str, message: &str) -> Answer {
    inner.metrics.refused(status);
    error_response(status, kind, message)
}

/// The methods the proxy forwards, as a 405 must list them (RFC 9110 §15.5.6); extension
/// methods are forwarded too, only `CONNECT` is not.
const ALLOWED_METHODS: HeaderValue =
    HeaderValue::from_static("GET, HEAD, POST, PUT, DELETE, OPTIONS, TRACE, PATCH");

/// The answer to `CONNECT`: the proxy forwards requests and opens no tunnels.
pub fn refuse_connect(inner: &Inner) -> Answer {
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
pub fn too_large(inner: &Inner, limit: u64) -> Answer {
    refuse(
        inner,
        StatusCode::PAYLOAD_TOO_LARGE,
        "request_too_large",
        &format!("request body exceeds max_request_body_bytes ({limit})"),
    )
}

/// The answer to a request body that would take the bodies held by all requests past
/// `request_body_budget_bytes`: the client may send it again shortly.
pub fn over_budget(inner: &Inner) -> Answer {
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

/// Fields of a request the proxy sets from elsewhere: `Host` from the backend URL,
/// `Content-Length` from the body sent, and `Expect`, which the proxy answered itself.
const REQUEST_REPLACED: &[&str] = &["host", "content-length", "expect"];

/// Client headers minus hop-by-hop ones, plus `X-Forwarded-*` and `Forwarded`.
fn forward_headers(h: WireFields, uri: &Uri, client: &ClientConn) -> OutboundFields {
    let added = proxy_fields(&h, uri, client);
    OutboundFields::new(h, REQUEST_REPLACED, added)
}

/// `X-Forwarded-For`, `-Proto` and `-Host` and `Forwarded`, each continuing what `h` says.
/// Every line of an earlier `X-Forwarded-For` or `Forwarded` is continued, in order; a chain
/// with a line that cannot be continued safely (not text; for `Forwarded`, not a well-formed
/// list) is replaced by this hop's element alone. The host is the target's authority (an
/// absolute-form target, HTTP/2's `:authority`), else `Host` (RFC 9112 §3.2.2), and is written
/// only when it is a valid host: quoted in `Forwarded`, and in `X-Forwarded-Host` only without a
/// comma, which there would read as a second hop.
fn proxy_fields(h: &WireFields, uri: &Uri, client: &ClientConn) -> Vec<(HeaderName, HeaderValue)> {
    // One pass over the names finds every field read below.
    let (mut xff, mut forwarded_prev, mut xfh, mut host) = (false, false, false, None);
    for (name, value) in h.pairs() {
        let is = |known: &str| name.eq_ignore_ascii_case(known.as_bytes());
        match name.len() {
            4 if is("host") => host = host.or(Some(value)),
            9 if is("forwarded") => forwarded_prev = true,
            15 if is("x-forwarded-for") => xff = true,
            16 if is("x-forwarded-host") => xfh = true,
            _ => {}
        }
    }
    let host = match uri.authority() {
        Some(authority) => Some(authority.as_str().as_bytes()),
        None => host,
    }
    .filter(|host| is_valid_host(host));
    let proto = if client.tls { "https" } else { "http" };
    let mut added = Vec::with_capacity(4);
    let xff = if xff {
        let mut list = bytes::BytesMut::with_capacity(64);
        put_earlier_hops(&mut list, h.values_of("x-forwarded-for"), |line| {
            text(line).is_some()
        });
        list.extend_from_slice(client.ip.as_bytes());
        HeaderValue::from_maybe_shared(list.freeze()).ok()
    } else {
        Some(client.ip.clone())
    };
    if let Some(v) = xff {
        added.push((X_FORWARDED_FOR, v));
    }
    added.push((X_FORWARDED_PROTO, HeaderValue::from_static(proto)));
    // Built where the header value will live: one allocation.
    let mut forwarded = bytes::BytesMut::with_capacity(96);
    if forwarded_prev {
        put_earlier_hops(
            &mut forwarded,
            h.values_of("forwarded"),
            fields::is_forwarded_list,
        );
    }
    forwarded.extend_from_slice(client.forwarded_for.as_bytes());
    forwarded.extend_from_slice(b";proto=");
    forwarded.extend_from_slice(proto.as_bytes());
    if let Some(host) = host {
        forwarded.extend_from_slice(b";host=");
        put_quoted(&mut forwarded, host);
        if !xfh && !host.contains(&b',') {
            if let Ok(v) = HeaderValue::from_bytes(host) {
                added.push((X_FORWARDED_HOST, v));
            }
        }
    }
    if let Ok(v) = HeaderValue::from_maybe_shared(forwarded.freeze()) {
        added.push((header::FORWARDED, v));
    }
    added
}

/// Appends the lines of a list field an earlier hop wrote, in order, each followed by `, ` so
/// that this hop's element comes next; appends nothing if any line is not `valid`.
fn put_earlier_hops<'a>(
    out: &mut bytes::BytesMut,
    lines: impl Iterator<Item = &'a [u8]>,
    valid: impl Fn(&[u8]) -> bool,
) {
    let start = out.len();
    for line in lines {
        let line = line.trim_ascii();
        if line.is_empty() {
            continue;
        }
        if !valid(line) {
            out.truncate(start);
            return;
        }
        out.extend_from_slice(line);
        out.extend_from_slice(b", ");
    }
}

/// What an in-progress response carries besides its bytes; dropping it ends the exchange.
struct Exchange {
    backend: Arc<Backend>,
    _in_flight: InFlight,
    observer: Option<Box<dyn ExchangeObserver>>,
    sent_at: Instant,
    got_first_byte: bool,
    sse: bool,
    at_event_boundary: bool,
}

impl Exchange {
    fn finish(mut self, end: ExchangeEnd) {
        let now = Instant::now();
        BackendMetrics::observe(
            &self.backend.metrics.latency,
            now.duration_since(self.sent_at),
        );
        if let Some(observer) = self.observer.take() {
            observer.end(end, now);
        }
    }
}

impl Drop for Exchange {
    fn drop(&mut self) {
        // Reached only when the body is dropped before its end: the client went away.
        if let Some(observer) = self.observer.take() {
            observer.end(ExchangeEnd::ClientGone, Instant::now());
        }
    }
}

pin_project! {
    /// The upstream body, forwarded frame by frame as it arrives: nothing is buffered, and it
    /// polls upstream only when the client connection polls it, so backpressure holds. Dropping
    /// it (client gone) drops the upstream body, which closes that upstream connection and so
    /// cancels the request on the backend.
    pub struct ObservedBody {
        // First, so that dropped early it ends the exchange before the connection closes.
        exchange: Option<Exchange>,
        // A frame read ahead of the head (bodies of known length), forwarded first; also the
        // last frame while the observer is not ready for the end.
        pending: Option<Result<Frame<Bytes>, BoxError>>,
        // The inner body ended while the observer was not ready for the end.
        ended: bool,
        #[pin]
        inner: UpstreamBody,
    }
}

impl HttpBody for ObservedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut this = self.project();
        let Some(exchange) = this.exchange.as_mut() else {
            return Poll::Ready(None);
        };
        let item = match this.pending.take() {
            Some(item) => Some(item),
            None if *this.ended => None,
            None => std::task::ready!(this.inner.as_mut().poll_frame(cx)),
        };
        // The exchange ends with this item: a recorder that waits for room (`full_policy =
        // "block"`) holds it back here, slowing this response only, never the thread.
        let last = match &item {
            Some(Ok(_)) => this.inner.is_end_stream(),
            _ => true,
        };
        if last {
            if let Some(observer) = exchange.observer.as_mut() {
                if observer.poll_ready(cx).is_pending() {
                    match item {
                        Some(item) => *this.pending = Some(item),
                        None => *this.ended = true,
                    }
                    return Poll::Pending;
                }
            }
        }
        match item {
            Some(Ok(frame)) => {
                if let Some(data) = frame.data_ref() {
                    if !exchange.got_first_byte && !data.is_empty() {
                        exchange.got_first_byte = true;
                        BackendMetrics::observe(
                            &exchange.backend.metrics.ttfb,
                            exchange.sent_at.elapsed(),
                        );
                    }
                    if exchange.sse && !data.is_empty() {
                        exchange.at_event_boundary = data.ends_with(b"\n\n");
                    }
                    if let Some(observer) = exchange.observer.as_mut() {
                        observer.response_frame(data, Instant::now());
                    }
                }
                // A body of known length ends with its last byte: hyper stops polling there
                // (it never asks for the `None`), so the exchange ends here.
                if this.inner.is_end_stream() {
                    if let Some(exchange) = this.exchange.take() {
                        exchange.finish(ExchangeEnd::Complete);
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            None => {
                let exchange = this.exchange.take().expect("checked above");
                if !exchange.got_first_byte {
                    BackendMetrics::observe(
                        &exchange.backend.metrics.ttfb,
                        exchange.sent_at.elapsed(),
                    );
                }
                exchange.finish(ExchangeEnd::Complete);
                Poll::Ready(None)
            }
            Some(Err(e)) => {
                let mut exchange = this.exchange.take().expect("checked above");
                let cause = crate::telemetry::error_chain(&*e);
                exchange.backend.metrics.error(ErrorKind::Stream);
                tracing::warn!(backend = %exchange.backend.name, error = %cause, sse = exchange.sse, "upstream failed mid-response; ending the response");
                let sse = exchange.sse;
                let boundary = exchange.at_event_boundary;
                let message = format!(
                    "backend {} failed mid-stream: {cause}",
                    exchange.backend.name
                );
                if sse {
                    let event = sse_error_event(&message, boundary);
                    if let Some(observer) = exchange.observer.as_mut() {
                        observer.response_frame(&event, Instant::now());
                    }
                    exchange.finish(ExchangeEnd::UpstreamError(cause));
                    Poll::Ready(Some(Ok(Frame::data(event))))
                } else {
                    exchange.finish(ExchangeEnd::UpstreamError(cause));
                    Poll::Ready(Some(Err(message.into())))
                }
            }
        }
    }

    /// Ends only after the inner body said so through `poll_frame`, so the exchange is always
    /// finished there (and never mistaken for a client that went away).
    fn is_end_stream(&self) -> bool {
        self.exchange.is_none() && self.pending.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        let ahead = match &self.pending {
            Some(Ok(frame)) => frame.data_ref().map_or(0, |d| d.len() as u64),
            _ => 0,
        };
        let inner = self.inner.size_hint();
        let mut hint = SizeHint::new();
        hint.set_lower(inner.lower() + ahead);
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper + ahead);
        }
        hint
    }
}

/// The SSE event that ends a stream cut by the backend; starts with a blank line when the cut
/// fell inside an event, so the error is never glued onto a partial one.
fn sse_error_event(message: &str, at_boundary: bool) -> Bytes {
    let payload = serde_json::json!({"error": {"message": message, "type": "upstream_error"}});
    let prefix = if at_boundary { "" } else { "\n\n" };
    Bytes::from(format!("{prefix}data: {payload}\n\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forwarded_headers_append_the_peer() {
        let mut h = HeaderMap::new();
        h.insert("host", "proxy.local".parse().unwrap());
        h.insert("x-forwarded-for", "10.0.0.1".parse().unwrap());
        let out = forward_headers(
            WireFields::from_map(&h),
            &Uri::from_static("/"),
            &ClientConn::new("192.0.2.7:5000".parse().unwrap(), false, 0),
        )
        .to_map();
        assert_eq!(out["x-forwarded-for"], "10.0.0.1, 192.0.2.7");
        assert_eq!(
            out["forwarded"],
            "for=192.0.2.7;proto=http;host=\"proxy.local\""
        );
        assert_eq!(out["x-forwarded-host"], "proxy.local");
        assert!(!out.contains_key("host"));
    }

    #[test]
    fn forwarded_headers_keep_earlier_hops_and_drop_what_the_proxy_redoes() {
        let mut h = HeaderMap::new();
        h.insert("host", "proxy.local".parse().unwrap());
        h.insert("forwarded", "for=10.0.0.1".parse().unwrap());
        h.insert("x-forwarded-host", "origin.example".parse().unwrap());
        h.insert("expect", "100-continue".parse().unwrap());
        h.insert("content-length", "2".parse().unwrap());
        h.insert("te", "trailers".parse().unwrap());
        h.insert("x-session-id", "s1".parse().unwrap());
        let out = forward_headers(
            WireFields::from_map(&h),
            &Uri::from_static("/"),
            &ClientConn::new("[2001:db8::1]:5000".parse().unwrap(), true, 0),
        )
        .to_map();
        assert_eq!(
            out["forwarded"],
            "for=10.0.0.1, for=\"[2001:db8::1]\";proto=https;host=\"proxy.local\""
        );
        assert_eq!(out["x-forwarded-host"], "origin.example");
        assert_eq!(out["x-forwarded-for"], "2001:db8::1");
        assert_eq!(out["x-forwarded-proto"], "https");
        for gone in ["expect", "content-length", "te", "host"] {
            assert!(!out.contains_key(gone), "{gone} was forwarded: {out:?}");
        }
        assert_eq!(out["x-session-id"], "s1");
    }

    #[test]
    fn forwarded_wire_fields_drop_hop_by_hop_names_in_any_case_and_keep_the_rest_as_sent() {
        let mut raw = bytes::BytesMut::from(
            &b"POST /v1/chat/completions HTTP/1.1\r\nHOST: proxy.local\r\n\
               Connection: Keep-Alive, X-Private\r\nX-PRIVATE: 1\r\nKeep-Alive: timeout=5\r\n\
               Expect: 100-continue\r\nContent-Length: 0\r\nX-Forwarded-For: 10.0.0.1\r\n\
               X-Session-Id: s1\r\n\r\n"[..],
        );
        let head = crate::http1::parse_request(&mut raw).unwrap().unwrap();
        let out = forward_headers(
            head.headers,
            &Uri::from_static("/"),
            &ClientConn::new("192.0.2.7:5000".parse().unwrap(), false, 0),
        );
        let names: Vec<&[u8]> = out.pairs().map(|(name, _)| name).collect();
        assert_eq!(
            names,
            [
                &b"X-Session-Id"[..],
                b"x-forwarded-for",
                b"x-forwarded-proto",
                b"x-forwarded-host",
                b"forwarded"
            ]
        );
        let map = out.to_map();
        assert_eq!(map["x-forwarded-for"], "10.0.0.1, 192.0.2.7");
        assert_eq!(map["x-forwarded-host"], "proxy.local");
        assert_eq!(
            map["forwarded"],
            "for=192.0.2.7;proto=http;host=\"proxy.local\""
        );
    }

    fn forwarded_for(pairs: &[(&str, &str)], uri: &'static str) -> HeaderMap {
        let fields =
            WireFields::from_pairs(pairs.iter().map(|(n, v)| (n.as_bytes(), v.as_bytes())));
        forward_headers(
            fields,
            &Uri::from_static(uri),
            &ClientConn::new("192.0.2.7:5000".parse().unwrap(), false, 0),
        )
        .to_map()
    }

    /// Nothing a client sends can add an element to `Forwarded` or a host to
    /// `X-Forwarded-Host`: a host that is not one is left out, and the host is quoted.
    #[test]
    fn client_values_cannot_inject_forwarded_elements() {
        // As HTTP/2 could hand it over, had the head not been refused.
        let out = forwarded_for(&[("host", "a\";for=6.6.6.6;x=\"")], "/");
        assert_eq!(out["forwarded"], "for=192.0.2.7;proto=http");
        assert!(!out.contains_key("x-forwarded-host"), "{out:?}");
        // Sub-delimiters are valid in a host, and stay inside the quotes.
        let out = forwarded_for(&[("host", "a;for=6.6.6.6,b")], "/");
        assert_eq!(
            out["forwarded"],
            "for=192.0.2.7;proto=http;host=\"a;for=6.6.6.6,b\""
        );
        assert!(
            !out.contains_key("x-forwarded-host"),
            "a comma would read as a second hop: {out:?}"
        );
        // An earlier Forwarded with an open quote would swallow this hop's element.
        let out = forwarded_for(&[("host", "p"), ("forwarded", "for=6.6.6.6;x=\"")], "/");
        assert_eq!(out["forwarded"], "for=192.0.2.7;proto=http;host=\"p\"");
    }

    /// Every line of an earlier hop's list is continued, in order.
    #[test]
    fn several_forwarding_lines_are_combined() {
        let out = forwarded_for(
            &[
                ("host", "p"),
                ("x-forwarded-for", "10.0.0.1"),
                ("forwarded", "for=10.0.0.1"),
                ("X-Forwarded-For", "10.0.0.2, 10.0.0.3"),
                ("Forwarded", "for=10.0.0.2;proto=https"),
            ],
            "/",
        );
        assert_eq!(
            out["x-forwarded-for"],
            "10.0.0.1, 10.0.0.2, 10.0.0.3, 192.0.2.7"
        );
        assert_eq!(
            out["forwarded"],
            "for=10.0.0.1, for=10.0.0.2;proto=https, for=192.0.2.7;proto=http;host=\"p\""
        );
        assert_eq!(out.get_all("x-forwarded-for").iter().count(), 1);
        assert_eq!(out.get_all("forwarded").iter().count(), 1);
    }

    /// An absolute-form target (or HTTP/2's `:authority`) names the host, not `Host`.
    #[test]
    fn the_target_authority_governs_over_host() {
        let out = forwarded_for(&[("host", "other.test")], "http://origin.test:8080/v1");
        assert_eq!(out["x-forwarded-host"], "origin.test:8080");
        assert_eq!(
            out["forwarded"],
            "for=192.0.2.7;proto=http;host=\"origin.test:8080\""
        );
    }

    #[test]
    fn sse_error_event_is_a_complete_event() {
        let e = sse_error_event("boom \"x\"", true);
        let text = std::str::from_utf8(&e).unwrap();
        assert!(text.starts_with("data: {"));
        assert!(text.ends_with("\n\n"));
        let json: serde_json::Value =
            serde_json::from_str(text.trim_start_matches("data: ").trim()).unwrap();
        assert_eq!(json["error"]["type"], "upstream_error");
        assert!(sse_error_event("x", false).starts_with(b"\n\ndata: "));
    }
}
