//! A response body that keeps its request's in-flight registrations until
//! it has ended (S3 routes).
//!
//! S3 answers `CompleteMultipartUpload`, `CopyObject` and `UploadPartCopy`
//! with `200` at once, sends whitespace while the operation runs, and
//! applies it at the end of the body: the response head says nothing about
//! whether the write has been applied. So on an S3 route a registered
//! mutation stays in flight until its response body ends, or until the
//! route's upstream timeout (counted from the start of the exchange)
//! passes, so a grant's activation is never held longer than that.
//!
//! The deadline has a timer of its own: hyper stops reading a body while
//! its write to the client is blocked (a paused client that stopped
//! reading a large answer), so a deadline looked at only when the body is
//! read would never come. At the deadline the upstream's body is dropped
//! (its connection cut), the registrations end, and the client's next read
//! of the body fails. A body the upstream cut short keeps its registrations
//! to the deadline (the upstream may still apply the write); a body the
//! client stops reading is drained here, up to the same deadline, before
//! the registrations end.

use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use tokio::task::AbortHandle;
use tokio::time::Instant;

use crate::body::{BoxBody, BoxError};
use crate::fence::InflightGuard;

/// The error a response body cut off by its deadline reports.
#[derive(Debug, thiserror::Error)]
#[error("the upstream's response body did not end within the route's upstream timeout")]
pub struct BodyDeadline;

/// What the body and its deadline timer share.
struct Held {
    inner: Option<BoxBody>,
    guards: Option<Arc<Vec<InflightGuard>>>,
    /// The deadline passed with the body unfinished: its next read fails.
    cut: bool,
    /// The task reading the body, woken when the deadline cuts it.
    waker: Option<Waker>,
}

/// A response body holding in-flight registrations until it ends.
pub struct HeldBody {
    held: Arc<Mutex<Held>>,
    deadline: Instant,
    timer: Option<AbortHandle>,
}

fn lock(held: &Mutex<Held>) -> MutexGuard<'_, Held> {
    held.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl HeldBody {
    /// Wraps `inner`; `guards` end when it ends, is dropped (after draining
    /// it), or at `deadline` (also when it failed earlier). Must be called
    /// on the runtime (it starts the deadline's timer).
    pub fn new(inner: BoxBody, guards: Arc<Vec<InflightGuard>>, deadline: Instant) -> HeldBody {
        let held = Arc::new(Mutex::new(Held { inner: Some(inner), guards: Some(guards), cut: false, waker: None }));
        let at_deadline = held.clone();
        let timer = tokio::spawn(async move {
            tokio::time::sleep_until(deadline).await;
            let (inner, guards, waker) = {
                let mut h = lock(&at_deadline);
                h.cut = h.inner.is_some();
                (h.inner.take(), h.guards.take(), h.waker.take())
            };
            // Outside the lock: dropping the upstream's body cuts its
            // connection, and the registrations' ends wake grants.
            drop(inner);
            drop(guards);
            if let Some(w) = waker {
                w.wake();
            }
        });
        HeldBody { held, deadline, timer: Some(timer.abort_handle()) }
    }

    /// The body ended: the registrations end now and the timer is not
    /// needed any more.
    fn ended(&mut self, h: &mut Held) -> Option<Arc<Vec<InflightGuard>>> {
        h.inner = None;
        if let Some(t) = self.timer.take() {
            t.abort();
        }
        h.guards.take()
    }
}

impl Body for HeldBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let held = this.held.clone();
        let mut h = lock(&held);
        if std::mem::take(&mut h.cut) {
            return Poll::Ready(Some(Err(Box::new(BodyDeadline))));
        }
        let Some(inner) = h.inner.as_mut() else {
            return Poll::Ready(None);
        };
        let polled = Pin::new(inner).poll_frame(cx);
        let mut ended = None;
        let out = match polled {
            Poll::Ready(Some(Ok(frame))) => {
                if h.inner.as_ref().is_some_and(Body::is_end_stream) {
                    ended = this.ended(&mut h);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                // Cut short by the upstream: it may still apply the write,
                // so the registrations stay until the deadline's timer.
                h.inner = None;
                Poll::Ready(Some(Err(e)))
            }
            Poll::Ready(None) => {
                ended = this.ended(&mut h);
                Poll::Ready(None)
            }
            Poll::Pending => {
                if !h.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                    h.waker = Some(cx.waker().clone());
                }
                Poll::Pending
            }
        };
        drop(h);
        drop(ended);
        out
    }

    fn is_end_stream(&self) -> bool {
        let h = lock(&self.held);
        !h.cut && h.inner.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        lock(&self.held).inner.as_ref().map_or_else(|| SizeHint::with_exact(0), Body::size_hint)
    }
}

impl Drop for HeldBody {
    fn drop(&mut self) {
        let (inner, guards) = {
            let mut h = lock(&self.held);
            if h.inner.is_none() {
                // Ended (the timer is gone), or failed (the timer ends the
                // registrations at the deadline), or cut by the timer.
                return;
            }
            (h.inner.take(), h.guards.take())
        };
        if let Some(t) = self.timer.take() {
            t.abort();
        }
        let (Some(mut inner), Some(guards)) = (inner, guards) else { return };
        // The client went away mid-body: the upstream may still be
        // applying the write. Read the rest of its answer (up to the
        // deadline) before the registrations end.
        let deadline = self.deadline;
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let drain = async {
                    while let Some(frame) = inner.frame().await {
                        if frame.is_err() {
                            // Cut short by the upstream: it may still apply
                            // the write, so the hold lasts to the deadline.
                            drop(inner);
                            return std::future::pending::<()>().await;
                        }
                    }
                };
                let _ = tokio::time::timeout_at(deadline, drain).await;
                drop(guards);
            });
        }
    }
}
