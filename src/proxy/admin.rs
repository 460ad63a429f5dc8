//! Admin listener: `/metrics` for Prometheus and a small JSON API to inspect backends and
//! sessions and to drain a backend. It speaks HTTP/1.1 through the crate's codec, as the
//! forwarding path does: heads bounded by `MAX_HEAD`, bodies (which no endpoint takes) read
//! and dropped up to `MAX_BODY`, a client stalled for `IDLE_TIMEOUT` closed.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{Method, StatusCode, Version};
use serde_json::json;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use super::routing::{Commit, Pool, SessionKey};
use super::Inner;
use crate::http1::{self, BodyDecoder, Decoded, Fields, H1Error, OutFraming, RequestHead};
use crate::shutdown::Shutdown;
use crate::tap::KeySource;

/// A client that takes longer than this to send a request head or body, or to take an
/// answer, is closed: a stalled client holds no task for good.
const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// The most request body bytes read and dropped; no admin endpoint takes a body.
const MAX_BODY: u64 = 64 * 1024;

/// Serves the admin API until `stop` fires.
pub(crate) async fn serve(tcp: TcpListener, inner: Arc<Inner>, mut stop: Shutdown) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            _ = stop.wait() => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = tcp.accept() => match accepted {
                Ok((stream, _)) => {
                    connections.spawn(serve_connection(stream, inner.clone(), IDLE_TIMEOUT));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "admin accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        }
    }
    connections.abort_all();
}

/// Answers the requests of one connection in turn until the client closes it, asks to, or
/// sends something the codec refuses (answered with its status, then closed); a step that
/// takes longer than `idle` closes it.
async fn serve_connection(mut io: TcpStream, inner: Arc<Inner>, idle: Duration) {
    let mut buf = BytesMut::with_capacity(8 * 1024);
    loop {
        let head = match tokio::time::timeout(idle, read_head(&mut io, &mut buf)).await {
            Ok(Ok(Some(head))) => head,
            Ok(Err(e)) => {
                let reply = error(e.status(), &e.to_string());
                let write = write_reply(&mut io, reply, Version::HTTP_11, true, false);
                if let Ok(Ok(())) = tokio::time::timeout(idle, write).await {
                    close_gracefully(io).await;
                }
                return;
            }
            Ok(Ok(None)) | Err(_) => return,
        };
        let mut close = !head.keep_alive;
        let body = drop_body(&mut io, &mut buf, head.framing);
        let reply = match tokio::time::timeout(idle, body).await {
            Ok(Ok(())) => route(&inner, &head),
            Ok(Err(refusal)) => {
                close = true;
                refusal
            }
            Err(_) => return,
        };
        let head_only = head.method == Method::HEAD;
        let write = write_reply(&mut io, reply, head.version, close, head_only);
        if !matches!(tokio::time::timeout(idle, write).await, Ok(Ok(()))) {
            return;
        }
        if close {
            close_gracefully(io).await;
            return;
        }
    }
}

/// Sends FIN and reads what the client still sends, for a while, before closing: closing
/// with unread bytes would reset the connection and could destroy the answer in flight.
async fn close_gracefully(mut io: TcpStream) {
    let _ = io.shutdown().await;
    let drain = async {
        let mut sink = [0u8; 16 * 1024];
        let mut left = 1024 * 1024;
        while left > 0 {
            match tokio::io::AsyncReadExt::read(&mut io, &mut sink).await {
                Ok(0) | Err(_) => return,
                Ok(n) => left -= n.min(left),
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), drain).await;
}

/// The next request head, or `None` when the client closed between requests.
async fn read_head(io: &mut TcpStream, buf: &mut BytesMut) -> Result<Option<RequestHead>, H1Error> {
    loop {
        if let Some(head) = http1::parse_request(buf)? {
            return Ok(Some(head));
        }
        match http1::read_some(io, buf).await {
            Ok(0) if buf.is_empty() => return Ok(None),
            Ok(0) | Err(_) => return Err(H1Error::Incomplete),
            Ok(_) => {}
        }
    }
}

/// Reads the request body and drops it; a body past [`MAX_BODY`] gets 413 and a framing
/// fault the codec's status.
async fn drop_body(
    io: &mut TcpStream,
    buf: &mut BytesMut,
    framing: http1::Framing,
) -> Result<(), AdminReply> {
    let too_large = || {
        error(
            StatusCode::PAYLOAD_TOO_LARGE,
            &format!("the admin API takes no request body (read at most {MAX_BODY} bytes)"),
        )
    };
    let refused = |e: H1Error| error(e.status(), &e.to_string());
    if matches!(framing, http1::Framing::Length(n) if n > MAX_BODY) {
        return Err(too_large());
    }
    let mut decoder = BodyDecoder::new(framing);
    let (mut seen, mut eof) = (0u64, false);
    loop {
        match decoder.decode(buf, eof).map_err(refused)? {
            Decoded::Done => return Ok(()),
            Decoded::Data(data) => {
                seen += data.len() as u64;
                if seen > MAX_BODY {
                    return Err(too_large());
                }
            }
            Decoded::NeedMore => {
                let read = http1::read_some(io, buf).await;
                eof = read.map_err(|_| refused(H1Error::Incomplete))? == 0;
            }
        }
    }
}

/// What an admin request is answered with.
struct AdminReply {
    status: StatusCode,
    content_type: &'static str,
    body: Bytes,
    /// Sent with 401: the scheme the client must use.
    challenge: bool,
}

async fn write_reply(
    io: &mut TcpStream,
    reply: AdminReply,
    version: Version,
    close: bool,
    head_only: bool,
) -> std::io::Result<()> {
    let length = reply.body.len().to_string();
    let mut fields: Vec<(&[u8], &[u8])> = vec![
        (b"content-type", reply.content_type.as_bytes()),
        (b"content-length", length.as_bytes()),
    ];
    if reply.challenge {
        fields.push((b"www-authenticate", b"Bearer"));
    }
    let mut out = Vec::with_capacity(256 + reply.body.len());
    let keep_alive_10 = version == Version::HTTP_10 && !close;
    http1::put_response_head(
        &mut out,
        reply.status,
        fields,
        OutFraming::AsIs,
        close,
        keep_alive_10,
    );
    if !head_only {
        out.extend_from_slice(&reply.body);
    }
    io.write_all(&out).await
}

fn respond(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> AdminReply {
    AdminReply {
        status,
        content_type,
        body: body.into(),
        challenge: false,
    }
}

fn json_response(status: StatusCode, value: serde_json::Value) -> AdminReply {
    respond(status, "application/json", value.to_string())
}

fn error(status: StatusCode, message: &str) -> AdminReply {
    json_response(status, json!({"error": {"message": message}}))
}

/// Constant-time comparison, so response timing does not reveal how much of a token matched.
fn token_matches(given: &[u8], expected: &[u8]) -> bool {
    given.len() == expected.len()
        && given
            .iter()
            .zip(expected)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

fn authorized(inner: &Inner, head: &RequestHead) -> bool {
    let config = inner.config.lock();
    let Some(token) = &config.admin.token else {
        return true;
    };
    head.headers
        .first("authorization")
        .and_then(bearer_token)
        .is_some_and(|given| token_matches(given, token.0.as_bytes()))
}

/// The credentials of `Bearer <token>`: the scheme is matched in any case and one or more
/// spaces may follow it (RFC 9110 §11.1: `credentials = auth-scheme [ 1*SP token68 ]`, the
/// scheme case-insensitive), so `bearer` and `BEARER` work as clients send them.
fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    const SCHEME: &[u8] = b"bearer";
    let (scheme, rest) = value.split_at_checked(SCHEME.len())?;
    if !scheme.eq_ignore_ascii_case(SCHEME) || rest.first() != Some(&b' ') {
        return None;
    }
    Some(rest.trim_ascii())
}

fn route(inner: &Inner, head: &RequestHead) -> AdminReply {
    let path = head.uri.path();
    // HEAD is answered as GET; the connection writes the head alone.
    let method = match head.method {
        Method::HEAD => &Method::GET,
        ref other => other,
    };
    if path == "/metrics" && method == Method::GET {
        let pool = inner.router.pool();
        let stats = inner.recorder.lock().as_ref().map(|r| r.stats());
        inner.metrics.body_bytes_held(inner.body_budget.held());
        let mut text = inner.metrics.render(&pool, &inner.router.sessions, stats);
        inner.router.response_ids.render(&mut text);
        return respond(StatusCode::OK, "text/plain; version=0.0.4", text);
    }
    if path == "/health" && method == Method::GET {
        return respond(StatusCode::OK, "text/plain", "ok\n");
    }
    let Some(rest) = path.strip_prefix("/admin/") else {
        return error(StatusCode::NOT_FOUND, "unknown path");
    };
    if !authorized(inner, head) {
        return AdminReply {
            challenge: true,
            ..error(StatusCode::UNAUTHORIZED, "a valid bearer token is required")
        };
    }
    let pool = inner.router.pool();
    let segments: Vec<&str> = rest.split('/').collect();
    match (method, segments.as_slice()) {
        (&Method::GET, ["backends"]) => json_response(StatusCode::OK, backends_json(&pool)),
        (&Method::POST, ["backends", name, action @ ("drain" | "undrain")]) => {
            let name = percent_decode(name);
            let Some(backend) = pool.backend(&name) else {
                return error(StatusCode::NOT_FOUND, &format!("no backend named {name:?}"));
            };
            let drain = *action == "drain";
            backend.draining.store(drain, Ordering::Relaxed);
            tracing::info!(backend = %name, draining = drain, "drain state changed by the admin API");
            json_response(StatusCode::OK, backend_json(backend))
        }
        (&Method::GET, ["sessions", key]) if !key.is_empty() => json_response(
            StatusCode::OK,
            session_json(inner, &pool, percent_decode(key)),
        ),
        _ => error(StatusCode::NOT_FOUND, "unknown admin path or method"),
    }
}

fn backend_json(b: &super::routing::Backend) -> serde_json::Value {
    json!({
        "name": &*b.name,
        "url": b.url.to_string(),
        "weight": b.weight,
        "healthy": b.healthy.load(Ordering::Relaxed),
        "draining": b.draining.load(Ordering::Relaxed),
        "in_flight": b.in_flight.load(Ordering::Relaxed),
        "sessions": b.sessions.load(Ordering::Relaxed).max(0),
        "active_context_bytes": b.active_bytes.load(Ordering::Relaxed).max(0),
        // 0 until the backend's engine states it.
        "kv_cache_tokens": b.kv_cache_tokens.load(Ordering::Relaxed),
        // Which answer stated it; "unknown" when the engine states it nowhere.
        "kv_cache_source": b.kv_cache.source(),
        "bytes_per_token": b.bytes_per_token(),
    })
}

fn backends_json(pool: &Pool) -> serde_json::Value {
    json!({
        "policy": pool.affinity.policy,
        "backends": pool.backends.iter().map(|b| backend_json(b)).collect::<Vec<_>>(),
    })
}

/// Where a key goes now and why, without touching the session table.
fn session_json(inner: &Inner, pool: &Pool, key: String) -> serde_json::Value {
    let k = SessionKey::new(key, KeySource::Header);
    let ranking: Vec<&str> = pool
        .ranking(k.hash)
        .into_iter()
        .map(|i| &*pool.backends[i].name)
        .collect();
    let decision = inner.router.route(pool, Some(&k), &[], Commit::Nothing);
    json!({
        "key": k.text,
        "rendezvous_order": ranking,
        "known": inner.router.sessions.view(inner.router.sessions.id(&k)),
        "next_request": decision.map(|d| json!({
            "backend": &*pool.backends[d.index].name,
            "outcome": d.outcome,
        })),
    })
}

/// Decodes `%XX` escapes in a path segment (keys may contain `/` or spaces).
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = |b: u8| (b as char).to_digit(16);
            if let (Some(hi), Some(lo)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                out.push((hi * 16 + lo) as u8);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client that stops mid-request holds its connection for the idle timeout, not for good.
    #[tokio::test]
    async fn a_client_stalled_mid_request_is_closed_after_the_idle_timeout() {
        use tokio::io::AsyncReadExt;
        let config = crate::proxy::config::ProxyConfig::from_toml_str(
            "listen = \"127.0.0.1:0\"\n[admin]\nlisten = \"127.0.0.1:0\"\n[health]\ninterval_ms = 0\n\
             [[backends]]\nname = \"a\"\nurl = \"http://127.0.0.1:9\"\n",
        )
        .unwrap();
        let (stop, shutdown) = crate::shutdown::channel();
        let proxy = crate::proxy::start(config, shutdown).await.unwrap();
        let idle = Duration::from_millis(200);
        let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
        for stalled in [
            &b"GET /metrics HTTP/1.1\r\nhost: x\r\n"[..],
            &b"POST /admin/backends/a/drain HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\nabc"[..],
        ] {
            let mut client = TcpStream::connect(tcp.local_addr().unwrap()).await.unwrap();
            let (served, _) = tcp.accept().await.unwrap();
            tokio::spawn(serve_connection(served, proxy.inner.clone(), idle));
            client.write_all(stalled).await.unwrap();
            let since = std::time::Instant::now();
            let mut rest = Vec::new();
            let read = tokio::time::timeout(idle * 10, client.read_to_end(&mut rest)).await;
            assert!(
                matches!(read, Ok(Ok(0))),
                "still open or answered: {read:?} {rest:?}"
            );
            let waited = since.elapsed();
            assert!(
                waited >= idle && waited < idle * 10,
                "closed after {waited:?}"
            );
        }
        let drained = proxy.inner.router.pool().backends[0]
            .draining
            .load(Ordering::Relaxed);
        assert!(!drained, "a stalled request does nothing");
        stop.fire();
        proxy.join().await;
    }

    #[test]
    fn percent_decoding_handles_escapes_and_leaves_the_rest() {
        assert_eq!(percent_decode("a%2Fb%20c"), "a/b c");
        assert_eq!(percent_decode("plain"), "plain");
        assert_eq!(percent_decode("bad%zz"), "bad%zz");
        assert_eq!(percent_decode("end%2"), "end%2");
        assert_eq!(percent_decode("end%41"), "endA");
    }

    #[test]
    fn bearer_scheme_matches_in_any_case_and_needs_a_space() {
        assert_eq!(bearer_token(b"Bearer abc"), Some(&b"abc"[..]));
        assert_eq!(bearer_token(b"bEARER  abc "), Some(&b"abc"[..]));
        assert_eq!(bearer_token(b"Bearerabc"), None);
        assert_eq!(bearer_token(b"Basic abc"), None);
        assert_eq!(bearer_token(b"Bear"), None);
    }

    #[test]
    fn token_comparison_requires_exact_match() {
        assert!(token_matches(b"abc", b"abc"));
        assert!(!token_matches(b"abd", b"abc"));
        assert!(!token_matches(b"ab", b"abc"));
    }
}
