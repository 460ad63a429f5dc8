//! Body types and small constructors shared by the proxy, the simulator and the replayer.

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full};

/// The boxed body every server in the crate answers with.
pub(crate) type Body = BoxBody<Bytes, BoxError>;

/// Boxed error for streamed bodies whose source varies (upstream, channel, timeout).
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A body with all its bytes known up front.
pub(crate) fn full(data: impl Into<Bytes>) -> Body {
    Full::new(data.into())
        .map_err(|never| match never {})
        .boxed()
}

/// A JSON response body from any serializable value.
pub(crate) fn json<T: serde::Serialize>(value: &T) -> Body {
    full(serde_json::to_vec(value).unwrap_or_else(|_| b"null".to_vec()))
}
