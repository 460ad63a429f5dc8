//! Body types and small constructors shared by the proxy, the simulator and the replayer.

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Empty, Full};

/// The boxed body every server in the crate answers with.
pub type Body = BoxBody<Bytes, BoxError>;

/// Boxed error for streamed bodies whose source varies (upstream, channel, timeout).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A body with all its bytes known up front.
pub fn full(data: impl Into<Bytes>) -> Body {
    Full::new(data.into())
        .map_err(|never| match never {})
        .boxed()
}

/// An empty body.
pub fn empty() -> Body {
    Empty::<Bytes>::new()
        .map_err(|never| match never {})
        .boxed()
}

/// A JSON response body from any serializable value.
pub fn json<T: serde::Serialize>(value: &T) -> Body {
    full(serde_json::to_vec(value).unwrap_or_else(|_| b"null".to_vec()))
}
