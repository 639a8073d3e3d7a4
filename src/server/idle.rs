//! Closes a hyper-served connection that has had no request in flight for
//! the listener's idle timeout (`server.idle_timeout_ms`).
//!
//! HTTP/2 keeps a connection open for as long as its peer answers PINGs,
//! and hyper has no idle timeout of its own: a client that opens an h2
//! connection, answers a PING every 30 s and never sends a request held
//! its connection (and a slot of the listener's `max_connections`) for
//! ever, so a handful of them locked every other client out. nginx closes
//! such a connection after `keepalive_timeout` (75 s); so does this. A
//! request counts as in flight from its head until its response body has
//! ended or was dropped, so a long poll (`watch`) or a long download keeps
//! its connection; the close happens only with nothing in flight, so it
//! cuts no exchange.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::time::Instant;

use crate::body::{BoxBody, BoxError};

/// What a connection has in flight, and since when it has had nothing.
pub struct Activity {
    start: Instant,
    in_flight: AtomicUsize,
    /// Milliseconds from `start` to the last request head or the last end
    /// of a response body.
    last_ms: AtomicU64,
}

impl Activity {
    pub fn new() -> Arc<Activity> {
        Arc::new(Activity { start: Instant::now(), in_flight: AtomicUsize::new(0), last_ms: AtomicU64::new(0) })
    }

    fn touch(&self) {
        let ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    /// A request head arrived: in flight until the guard is dropped —
    /// with the [`Tracked`] body of its response, or with the request's
    /// future if it never answered (a stream the client reset).
    pub fn begin(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.touch();
        InFlight(self.clone())
    }

    /// Resolves once nothing has been in flight for `timeout`.
    pub async fn idle_for(&self, timeout: Duration) {
        loop {
            let last = self.start + Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
            let due = last + timeout;
            if Instant::now() >= due {
                if self.in_flight.load(Ordering::Acquire) == 0 {
                    return;
                }
                // Busy: look again one timeout later (the end of the
                // exchange moves `last`).
                tokio::time::sleep(timeout).await;
            } else {
                tokio::time::sleep_until(due).await;
            }
        }
    }
}

/// One request in flight on a connection, until dropped.
pub struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.touch();
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its request in flight until it is dropped.
pub struct Tracked {
    inner: BoxBody,
    _in_flight: InFlight,
}

impl Tracked {
    pub fn new(inner: BoxBody, in_flight: InFlight) -> Tracked {
        Tracked { inner, _in_flight: in_flight }
    }
}

impl Body for Tracked {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Empty};

    #[tokio::test(start_paused = true)]
    async fn idle_only_after_the_last_exchange_ended_a_timeout_ago() {
        let a = Activity::new();
        let t = Duration::from_secs(75);
        let body = Tracked::new(Empty::new().map_err(|e| match e {}).boxed_unsync(), a.begin());
        tokio::time::sleep(Duration::from_secs(200)).await;
        // In flight for 200 s: not idle.
        assert!(tokio::time::timeout(Duration::from_secs(1), a.idle_for(t)).await.is_err());
        drop(body);
        let ended = Instant::now();
        a.idle_for(t).await;
        let waited = ended.elapsed();
        assert!(waited >= t && waited <= t + Duration::from_secs(1), "{waited:?}");
    }

    /// A request whose future is dropped before it answered (an h2 stream
    /// the client reset) is no longer in flight: otherwise one reset
    /// request would keep its connection from ever being idle.
    #[tokio::test(start_paused = true)]
    async fn a_request_dropped_before_its_answer_is_not_in_flight() {
        let a = Activity::new();
        let t = Duration::from_secs(75);
        let fut = {
            let exchange = a.begin();
            async move {
                std::future::pending::<()>().await;
                drop(exchange);
            }
        };
        drop(fut);
        let started = Instant::now();
        tokio::time::timeout(Duration::from_secs(80), a.idle_for(t)).await.expect("never idle");
        assert!(started.elapsed() <= t + Duration::from_secs(1));
    }
}
