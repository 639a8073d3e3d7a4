//! Body types shared by both listeners: one boxed body for every response,
//! and helpers to build small ones. Nothing here buffers a streamed body.

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full};

/// The error type carried by every body fencegate produces or forwards.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The one response body type of both listeners.
pub type BoxBody = http_body_util::combinators::UnsyncBoxBody<Bytes, BoxError>;

/// A body holding `bytes` whole.
pub fn full(bytes: impl Into<Bytes>) -> BoxBody {
    Full::new(bytes.into()).map_err(|never| match never {}).boxed_unsync()
}

/// An empty body.
pub fn empty() -> BoxBody {
    Empty::<Bytes>::new().map_err(|never| match never {}).boxed_unsync()
}

/// A JSON response body.
pub fn json(value: &serde_json::Value) -> BoxBody {
    full(value.to_string())
}
