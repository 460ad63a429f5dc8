//! Admin listener: `/metrics` for Prometheus and a small JSON API to inspect backends and
//! sessions and to drain a backend.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde_json::json;
use tokio::net::TcpListener;
use tokio::task::JoinSet;

use super::routing::{Pool, SessionKey};
use super::Inner;
use crate::shutdown::Shutdown;
use crate::tap::KeySource;

/// Serves the admin API until `stop` fires.
pub(crate) async fn serve(tcp: TcpListener, inner: Arc<Inner>, mut stop: Shutdown) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            _ = stop.wait() => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = tcp.accept() => match accepted {
                Ok((stream, _)) => {
                    let inner = inner.clone();
                    connections.spawn(async move {
                        let service = service_fn(move |req| {
                            let inner = inner.clone();
                            async move { Ok::<_, Infallible>(route(&inner, req)) }
                        });
                        let _ = hyper::server::conn::http1::Builder::new()
                            .serve_connection(TokioIo::new(stream), service)
                            .await;
                    });
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

type AdminResponse = Response<Full<Bytes>>;

fn respond(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> AdminResponse {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    r
}

fn json_response(status: StatusCode, value: serde_json::Value) -> AdminResponse {
    respond(status, "application/json", value.to_string())
}

fn error(status: StatusCode, message: &str) -> AdminResponse {
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

fn authorized(inner: &Inner, req: &Request<Incoming>) -> bool {
    let config = inner.config.lock();
    let Some(token) = &config.admin.token else {
        return true;
    };
    req.headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| bearer_token(v.as_bytes()))
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

fn route(inner: &Inner, req: Request<Incoming>) -> AdminResponse {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    if path == "/metrics" && method == Method::GET {
        let pool = inner.router.pool();
        let stats = inner.recorder.lock().as_ref().map(|r| r.stats());
        inner.metrics.body_bytes_held(inner.body_budget.held());
        let text = inner.metrics.render(&pool, &inner.router.sessions, stats);
        return respond(StatusCode::OK, "text/plain; version=0.0.4", text);
    }
    if path == "/health" && method == Method::GET {
        return respond(StatusCode::OK, "text/plain", "ok\n");
    }
    let Some(rest) = path.strip_prefix("/admin/") else {
        return error(StatusCode::NOT_FOUND, "unknown path");
    };
    if !authorized(inner, &req) {
        let mut r = error(StatusCode::UNAUTHORIZED, "a valid bearer token is required");
        r.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static("Bearer"),
        );
        return r;
    }
    let pool = inner.router.pool();
    let segments: Vec<&str> = rest.split('/').collect();
    match (&method, segments.as_slice()) {
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
    let decision = inner.router.route(pool, Some(&k), &[], false);
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
