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

/// Reads and discards up to `max_bytes` of a body we are refusing, for at
/// most `limit`, so that the client gets to read our answer: a server that
/// closes a connection with unread request bytes makes the kernel reset it,
/// and the client may then never see the response (a lingering close).
pub async fn drain(mut body: BoxBody, max_bytes: u64, limit: std::time::Duration) {
    let read = async {
        let mut seen = 0u64;
        while let Some(Ok(frame)) = body.frame().await {
            if let Some(d) = frame.data_ref() {
                seen += d.len() as u64;
                if seen > max_bytes {
                    break;
                }
            }
        }
    };
    let _ = tokio::time::timeout(limit, read).await;
}

/// Bodies up to this size are read to their end before a 413.
pub const DRAIN_MAX_BYTES: u64 = 8 << 20;

/// A JSON response body.
pub fn json(value: &serde_json::Value) -> BoxBody {
    full(value.to_string())
}
