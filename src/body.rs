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

/// The body length a message's head declares (`Content-Length`), if it
/// parses.
pub fn content_length(h: &http::HeaderMap) -> Option<u64> {
    h.get(http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok())
}

/// Bodies up to this size are read to their end before a 413.
pub const DRAIN_MAX_BYTES: u64 = 8 << 20;

/// A JSON response body.
pub fn json(value: &serde_json::Value) -> BoxBody {
    full(value.to_string())
}

/// `body` with every data frame shown to `check` before it is passed on:
/// the first `Err` ends the body with that error instead of the frame, so
/// what comes after it never goes further.
pub fn checked<F>(body: BoxBody, check: F) -> BoxBody
where
    F: FnMut(&[u8]) -> Result<(), String> + Send + Unpin + 'static,
{
    Checked { body, check, failed: false }.boxed_unsync()
}

struct Checked<F> {
    body: BoxBody,
    check: F,
    failed: bool,
}

impl<F> http_body::Body for Checked<F>
where
    F: FnMut(&[u8]) -> Result<(), String> + Send + Unpin + 'static,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        if self.failed || self.body.is_end_stream() {
            return std::task::Poll::Ready(None);
        }
        let polled = std::pin::Pin::new(&mut self.body).poll_frame(cx);
        if let std::task::Poll::Ready(Some(Ok(frame))) = &polled {
            if let Some(data) = frame.data_ref() {
                if let Err(e) = (self.check)(data) {
                    self.failed = true;
                    return std::task::Poll::Ready(Some(Err(e.into())));
                }
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.failed || self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// A body of `prefix` (bytes already read from `rest`'s stream) followed
/// by the rest of that stream, frames and trailers unchanged.
pub fn prefixed(prefix: Bytes, rest: BoxBody) -> BoxBody {
    Prefixed { prefix: Some(prefix).filter(|p| !p.is_empty()), rest }.boxed_unsync()
}

struct Prefixed {
    prefix: Option<Bytes>,
    rest: BoxBody,
}

impl http_body::Body for Prefixed {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        if let Some(p) = self.prefix.take() {
            return std::task::Poll::Ready(Some(Ok(http_body::Frame::data(p))));
        }
        // A stream already at its end is not polled again (some panic).
        if self.rest.is_end_stream() {
            return std::task::Poll::Ready(None);
        }
        std::pin::Pin::new(&mut self.rest).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_none() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        let rest = self.rest.size_hint();
        let extra = self.prefix.as_ref().map_or(0, |p| p.len() as u64);
        let mut hint = http_body::SizeHint::new();
        // Upper first: a lower bound above the upper one panics.
        if let Some(u) = rest.upper() {
            hint.set_upper(u.saturating_add(extra));
        }
        hint.set_lower(rest.lower().saturating_add(extra));
        hint
    }
}
