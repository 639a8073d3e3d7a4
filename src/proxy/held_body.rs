//! A response body that keeps its request's in-flight registrations until
//! it has ended (S3 routes).
//!
//! S3 answers `CompleteMultipartUpload`, `CopyObject` and `UploadPartCopy`
//! with `200` at once, sends whitespace while the operation runs, and
//! applies it at the end of the body: the response head says nothing about
//! whether the write has been applied. So on an S3 route a registered
//! mutation stays in flight until its response body ends — or fails, or
//! the route's upstream timeout (counted from the start of the exchange)
//! passes, so a grant's activation is never held longer than that. A body
//! the client stops reading is drained here, up to the same deadline,
//! before the registrations end.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use tokio::time::{Instant, Sleep};

use crate::body::{BoxBody, BoxError};
use crate::fence::InflightGuard;

/// The error a response body cut off by its deadline reports.
#[derive(Debug, thiserror::Error)]
#[error("the upstream's response body did not end within the route's upstream timeout")]
pub struct BodyDeadline;

/// A response body holding in-flight registrations until it ends.
pub struct HeldBody {
    inner: Option<BoxBody>,
    guards: Option<Arc<Vec<InflightGuard>>>,
    deadline: Instant,
    sleep: Pin<Box<Sleep>>,
}

impl HeldBody {
    /// Wraps `inner`; `guards` end when it ends, fails, is dropped (after
    /// draining it), or at `deadline`.
    pub fn new(inner: BoxBody, guards: Arc<Vec<InflightGuard>>, deadline: Instant) -> HeldBody {
        let sleep = Box::pin(tokio::time::sleep_until(deadline));
        HeldBody { inner: Some(inner), guards: Some(guards), deadline, sleep }
    }

    fn release(&mut self) {
        self.inner = None;
        self.guards = None;
    }
}

impl Body for HeldBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        match Pin::new(inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if this.inner.as_ref().is_some_and(Body::is_end_stream) {
                    this.release();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                this.release();
                Poll::Ready(Some(Err(e)))
            }
            Poll::Ready(None) => {
                this.release();
                Poll::Ready(None)
            }
            Poll::Pending => {
                if this.sleep.as_mut().poll(cx).is_ready() {
                    this.release();
                    return Poll::Ready(Some(Err(Box::new(BodyDeadline))));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.as_ref().map_or_else(|| SizeHint::with_exact(0), Body::size_hint)
    }
}

impl Drop for HeldBody {
    fn drop(&mut self) {
        let Some(mut inner) = self.inner.take() else { return };
        let Some(guards) = self.guards.take().filter(|g| !g.is_empty()) else { return };
        // The client went away mid-body: the upstream may still be
        // applying the write. Read the rest of its answer (up to the
        // deadline) before the registrations end.
        let deadline = self.deadline;
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let drain = async {
                    while let Some(frame) = inner.frame().await {
                        if frame.is_err() {
                            break;
                        }
                    }
                };
                let _ = tokio::time::timeout_at(deadline, drain).await;
                drop(guards);
            });
        }
    }
}
