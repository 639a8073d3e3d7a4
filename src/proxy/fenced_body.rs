//! The request body on its way upstream: streamed frame by frame, never
//! buffered, counted against the route's size limit, and cut off the
//! moment a newer fence is installed while it is still streaming.
//!
//! Cutting it off (an error from `poll_frame`) makes the HTTP client drop
//! the upstream connection mid-body, so the upstream never receives a
//! complete request and cannot apply it. Once the last frame has been
//! handed over, the upload can no longer be aborted; activation then waits
//! for its response instead.

use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

use crate::body::{BoxBody, BoxError};
use crate::fence::InflightCtl;

/// Why the body stopped early, readable by the handler after the fact.
#[derive(Debug, Default)]
pub struct BodyOutcome(AtomicU8);

const ABORTED: u8 = 1;
const TOO_LARGE: u8 = 2;
const CLIENT_BROKE: u8 = 3;

impl BodyOutcome {
    /// A newer fence cut the upload off.
    pub fn aborted(&self) -> bool {
        self.0.load(Ordering::Acquire) == ABORTED
    }
    /// The body passed the route's size limit.
    pub fn too_large(&self) -> bool {
        self.0.load(Ordering::Acquire) == TOO_LARGE
    }
    /// The client's own body failed: malformed chunked framing, or the
    /// client went away mid-body. A fault of the request, not the upstream.
    pub fn client_broke(&self) -> bool {
        self.0.load(Ordering::Acquire) == CLIENT_BROKE
    }
    fn set(&self, v: u8) {
        self.0.store(v, Ordering::Release);
    }
}

/// The error a cut-off body reports to the HTTP client or the file store.
#[derive(Debug, thiserror::Error)]
pub enum BodyCut {
    #[error("upload aborted: a newer fencing token was granted for this resource")]
    Superseded,
    #[error("request body is larger than {0} bytes")]
    TooLarge(u64),
}

/// A request body guarded by a fence and a size limit.
pub struct FencedBody {
    inner: BoxBody,
    ctl: Option<Arc<InflightCtl>>,
    limit: u64,
    seen: u64,
    outcome: Arc<BodyOutcome>,
    done: bool,
}

impl FencedBody {
    /// Wraps `inner`. `ctl`: the in-flight registration of a fenced
    /// mutation (None for reads).
    pub fn new(inner: BoxBody, ctl: Option<Arc<InflightCtl>>, limit: u64) -> (FencedBody, Arc<BodyOutcome>) {
        let outcome = Arc::new(BodyOutcome::default());
        let body = FencedBody { inner, ctl, limit, seen: 0, outcome: outcome.clone(), done: false };
        (body, outcome)
    }

    fn finish(&mut self) {
        self.done = true;
        if let Some(ctl) = &self.ctl {
            ctl.mark_body_done();
        }
    }
}

impl Body for FencedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.done {
            return Poll::Ready(None);
        }
        if let Some(ctl) = &self.ctl {
            ctl.register(cx.waker());
            if ctl.is_aborted() {
                self.outcome.set(ABORTED);
                self.done = true;
                return Poll::Ready(Some(Err(Box::new(BodyCut::Superseded))));
            }
        }
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    self.seen = self.seen.saturating_add(data.len() as u64);
                    if self.seen > self.limit {
                        self.outcome.set(TOO_LARGE);
                        self.done = true;
                        return Poll::Ready(Some(Err(Box::new(BodyCut::TooLarge(self.limit)))));
                    }
                }
                if self.inner.is_end_stream() {
                    self.finish();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => {
                self.finish();
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => {
                self.outcome.set(CLIENT_BROKE);
                self.done = true;
                Poll::Ready(Some(Err(e)))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
