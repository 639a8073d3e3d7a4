//! The request body on its way upstream: streamed frame by frame, never
//! buffered, counted against the route's size limit, and cut off the
//! moment a newer fence is installed while it is still streaming.
//!
//! Cutting it off (an error from `poll_frame`) makes the HTTP client drop
//! the upstream connection mid-body, so the upstream never receives a
//! complete request and cannot apply it. Once the last frame has been
//! handed over, the upload can no longer be aborted; activation then waits
//! for its response instead.
//!
//! A client's stream can carry more than its `Content-Length` said (HTTP/2
//! DATA past a declared length; the request is malformed, RFC 9113
//! §8.1.1, and h2 resets it). An upstream that is sent the declared bytes
//! has a complete request, so the frame that completes the declared
//! length is held back until the client's stream has ended: a stream that
//! turns out malformed leaves the upstream a truncated request. A declared
//! empty body is settled before the head is sent (`settle_declared_empty`).

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use tokio::sync::Notify;

use crate::body::{BoxBody, BoxError};
use crate::error::Error;
use crate::fence::{InflightCtl, InflightGuard};

use super::wire::{Wire, WriteCheck};

/// How the body ended, readable by the handler after the fact, and
/// awaitable ([`BodyOutcome::settled`]) by an exchange whose upstream
/// answered before the body had ended.
#[derive(Debug, Default)]
pub struct BodyOutcome {
    state: AtomicU8,
    settled: Notify,
    /// The upstream connection the body is going out on (a fenced
    /// upload), and the number of its request there.
    wire: Mutex<(Weak<Wire>, u64)>,
    /// The body was empty when its request was put on a connection: the
    /// head is the whole request.
    empty: AtomicBool,
}

const STREAMING: u8 = 0;
const ABORTED: u8 = 1;
const TOO_LARGE: u8 = 2;
const CLIENT_BROKE: u8 = 3;
/// Handed over whole: the last frame went upstream.
const ENDED: u8 = 4;
/// Dropped before its end by the HTTP client (the upstream answered and
/// wants no more of it, or the exchange was given up).
const DROPPED: u8 = 5;
/// Cut off because the gateway's view stopped being current (cluster
/// mode: paused or cut off past its member deadline) before a frame went.
const NOT_CURRENT: u8 = 6;
/// Cut off because the route's upstream timeout had passed before a frame
/// went (the exchange is given up; a frame sent now could be applied after
/// peers' quarantines, which count on that timeout).
const TIMED_OUT: u8 = 7;

impl BodyOutcome {
    /// A newer fence cut the upload off.
    pub fn aborted(&self) -> bool {
        self.state.load(Ordering::Acquire) == ABORTED
    }
    /// The body passed the route's size limit.
    pub fn too_large(&self) -> bool {
        self.state.load(Ordering::Acquire) == TOO_LARGE
    }
    /// The client's own body failed: malformed chunked framing, or the
    /// client went away mid-body. A fault of the request, not the upstream.
    pub fn client_broke(&self) -> bool {
        self.state.load(Ordering::Acquire) == CLIENT_BROKE
    }
    /// The gateway stopped being current while the body streamed.
    pub fn not_current(&self) -> bool {
        self.state.load(Ordering::Acquire) == NOT_CURRENT
    }
    /// The route's upstream timeout passed while the body streamed.
    pub fn timed_out(&self) -> bool {
        self.state.load(Ordering::Acquire) == TIMED_OUT
    }
    /// The body stopped with an error (any of the above).
    pub fn cut(&self) -> bool {
        matches!(self.state.load(Ordering::Acquire), ABORTED | TOO_LARGE | CLIENT_BROKE | NOT_CURRENT | TIMED_OUT)
    }
    /// False only when the upstream is known to lack part of the request:
    /// the gateway cut the body, or the HTTP client dropped it (the
    /// upstream broke the exchange mid-upload) before the last declared
    /// byte, or a chunked body before its end (its trailers are its end).
    /// A body whose declared bytes all went counts as whole even if the
    /// client's stream had more to say (HTTP/2 trailers, which an HTTP/1.1
    /// request with a length cannot carry): the upstream may apply it.
    pub fn handed_over(&self) -> bool {
        !self.cut() && (self.empty.load(Ordering::Acquire) || self.state.load(Ordering::Acquire) != DROPPED)
    }
    /// True once the body has ended, been cut, or been dropped.
    pub fn settled_now(&self) -> bool {
        self.state.load(Ordering::Acquire) != STREAMING
    }
    /// Waits until the body has ended, been cut, or been dropped. One
    /// waiter at a time (the exchange).
    pub async fn settled(&self) {
        while self.state.load(Ordering::Acquire) == STREAMING {
            // `notify_one` keeps a permit when nobody waits yet: no wake-up
            // is lost between the load and the wait.
            self.settled.notified().await;
        }
    }
    fn set(&self, v: u8) {
        self.state.store(v, Ordering::Release);
        self.settled.notify_one();
    }
    /// The connection the request goes out on, if it is still open, and
    /// the request's number there.
    fn on_wire(&self) -> (Option<Arc<Wire>>, u64) {
        let at = self.wire.lock().unwrap_or_else(PoisonError::into_inner);
        (at.0.upgrade(), at.1)
    }
    /// Nothing more of the request reaches the upstream: the connection
    /// it goes out on is cut, if that still carries it (the exchange is
    /// given up).
    pub fn cut_wire(&self) {
        if let (Some(wire), carried) = self.on_wire() {
            wire.cut_if_carrying(carried);
        }
    }
    /// True when nothing of the request is left for the upstream's kernel
    /// to take: all of it acknowledged, or its connection cut or gone
    /// (a connection that goes with a request undelivered is reset).
    pub fn delivered_now(&self) -> bool {
        match self.on_wire() {
            (Some(wire), carried) => wire.delivered(carried),
            (None, _) => true,
        }
    }
    /// Records why the connection's writes were refused, unless the body
    /// already failed for a reason of its own.
    fn set_refused(&self, v: u8) {
        let mut now = self.state.load(Ordering::Acquire);
        while matches!(now, STREAMING | ENDED | DROPPED) {
            match self.state.compare_exchange(now, v, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    self.settled.notify_one();
                    return;
                }
                Err(actual) => now = actual,
            }
        }
    }
    fn set_if_streaming(&self, v: u8) {
        if self.state.compare_exchange(STREAMING, v, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            self.settled.notify_one();
        }
    }
}

/// The error a cut-off body reports to the HTTP client or the file store.
#[derive(Debug, thiserror::Error)]
pub enum BodyCut {
    #[error("upload aborted: a newer fencing token was granted for this resource")]
    Superseded,
    #[error("request body is larger than {0} bytes")]
    TooLarge(u64),
    #[error("upload cut off: the gateway stopped being current (its view of the fences may be stale)")]
    NotCurrent,
    #[error("upload cut off: the upstream timeout passed while its body streamed")]
    TimedOut,
}

/// What every frame of a fenced upload is checked against right before it
/// goes: the gateway's currency (cluster mode; always current otherwise)
/// and the route's upstream deadline. A gateway paused mid-upload past its
/// member deadline, whose peers then granted the key anew, finds both
/// passed when it runs again — before any task of it could mark it not
/// current — and sends nothing more.
pub struct Gate {
    pub fences: Arc<crate::fence::FenceTable>,
    pub deadline: tokio::time::Instant,
}

impl Gate {
    fn check(&self) -> Result<(), (u8, BodyCut)> {
        if !self.fences.is_current() {
            return Err((NOT_CURRENT, BodyCut::NotCurrent));
        }
        if tokio::time::Instant::now() >= self.deadline {
            return Err((TIMED_OUT, BodyCut::TimedOut));
        }
        Ok(())
    }
}

/// A fenced upload's [`Gate`] together with what else stops it (a newer
/// fence), as the upstream connection asks it before each of its writes
/// ([`super::wire`]): the frames the HTTP client took while the gate was
/// open may reach the socket much later.
pub struct UploadGate {
    gate: Gate,
    ctl: Option<Arc<InflightCtl>>,
    outcome: Arc<BodyOutcome>,
}

impl UploadGate {
    fn refusal(&self) -> Option<(u8, BodyCut)> {
        if self.ctl.as_ref().is_some_and(|c| c.is_aborted()) {
            return Some((ABORTED, BodyCut::Superseded));
        }
        self.gate.check().err()
    }
}

impl WriteCheck for UploadGate {
    fn refuses(&self) -> bool {
        match self.refusal() {
            Some((state, _)) => {
                self.outcome.set_refused(state);
                true
            }
            None => false,
        }
    }
    fn finished(&self) -> bool {
        self.outcome.empty.load(Ordering::Acquire) || self.outcome.state.load(Ordering::Acquire) == ENDED
    }
}

/// Whether a request body that has just given its last frame (`None`)
/// really ended there: an HTTP/2 body only with END_STREAM (hyper also
/// ends one that the client reset with NO_ERROR, a request cut short), and
/// any body only at its declared length.
pub fn ended_whole(h2: bool, inner: &BoxBody, declared: Option<u64>, seen: u64) -> Result<(), &'static str> {
    if declared.is_some_and(|d| seen < d) {
        return Err("the request body ended before its Content-Length");
    }
    if h2 && !inner.is_end_stream() {
        return Err("the client reset the request's stream");
    }
    Ok(())
}

/// Why a declared-empty body could not be settled.
#[derive(Debug)]
pub enum Unsettled {
    /// The body stopped with an error: aborted by a newer fence, or the
    /// client's stream broke; `BodyOutcome` says which.
    Cut(String),
    /// The request is refused as it is (bytes in it, or too slow).
    Refused(Error),
}

/// A request body guarded by a fence and a size limit.
pub struct FencedBody {
    inner: BoxBody,
    ctl: Option<Arc<InflightCtl>>,
    limit: u64,
    seen: u64,
    outcome: Arc<BodyOutcome>,
    done: bool,
    /// The length the request declared (its `Content-Length`), if any.
    declared: Option<u64>,
    /// Bytes handed to the HTTP client so far.
    handed: u64,
    /// The frame that completed the declared length, held until the
    /// client's stream ends.
    held: Option<Frame<Bytes>>,
    /// The request's in-flight registrations, kept while its body streams:
    /// an upstream that answers before the body has ended (the exchange is
    /// over for the proxy) may still receive the rest and apply it, so a
    /// newer fence must still cut it off, and activation wait for it.
    _hold: Option<Arc<Vec<InflightGuard>>>,
    /// The inner body is an HTTP/2 request's: its end is real only when
    /// `is_end_stream()` says so (END_STREAM received). hyper also ends it
    /// when the client resets the stream with NO_ERROR, which is a request
    /// cut short, not a complete one.
    h2: bool,
    /// Checked before every frame goes ([`Gate`]), and by the upstream
    /// connection before each write; fenced uploads only.
    gate: Option<Arc<UploadGate>>,
}

impl FencedBody {
    /// Wraps `inner`. `hold`: the in-flight registrations of a fenced
    /// mutation that a newer fence cuts off (None for reads and in shadow
    /// mode), ended no earlier than this body; the first one's fence cuts
    /// it. `h2`: `inner` is an HTTP/2 request's body (see the field).
    pub fn new(
        inner: BoxBody,
        hold: Option<Arc<Vec<InflightGuard>>>,
        limit: u64,
        h2: bool,
    ) -> (FencedBody, Arc<BodyOutcome>) {
        let ctl = hold.as_ref().and_then(|g| g.first()).map(|g| g.ctl().clone());
        let outcome = Arc::new(BodyOutcome::default());
        let declared = inner.size_hint().exact();
        let body = FencedBody {
            inner,
            ctl,
            limit,
            seen: 0,
            outcome: outcome.clone(),
            done: false,
            declared,
            handed: 0,
            held: None,
            _hold: hold,
            h2,
            gate: None,
        };
        (body, outcome)
    }

    /// Checks `gate` before every frame goes upstream.
    #[must_use]
    pub fn gated(mut self, gate: Gate) -> FencedBody {
        let ctl = self.ctl.clone();
        self.gate = Some(Arc::new(UploadGate { gate, ctl, outcome: self.outcome.clone() }));
        self
    }

    /// Puts this body's request on the upstream connection `wire`: a
    /// fenced upload's gate then decides each of its writes, and giving
    /// the exchange up can cut it ([`BodyOutcome::cut_wire`]).
    pub fn put_on(&self, wire: &Arc<Wire>) {
        let Some(gate) = &self.gate else {
            wire.carry(None);
            return;
        };
        // No frame to give (an empty body): the head is the whole request.
        if self.is_end_stream() {
            self.outcome.empty.store(true, Ordering::Release);
        }
        let carried = wire.carry(Some(gate.clone() as Arc<dyn WriteCheck>));
        *self.outcome.wire.lock().unwrap_or_else(PoisonError::into_inner) = (Arc::downgrade(wire), carried);
    }

    /// Cuts the body off when the gate says no ([`Gate`]): checked right
    /// before every frame, and the end, goes upstream.
    fn gate_refuses(&mut self) -> Option<BoxError> {
        let (state, cut) = self.gate.as_ref()?.gate.check().err()?;
        self.held = None;
        self.outcome.set(state);
        self.done = true;
        Some(Box::new(cut))
    }

    /// A body that declared itself empty (`Content-Length: 0`) while its
    /// stream goes on (HTTP/2 HEADERS without END_STREAM) is read to its
    /// end before anything is sent upstream, which would take the bare head
    /// for a complete request. It is read through this body, so a newer
    /// fence cuts it off while it waits as it cuts off any upload. A frame
    /// with bytes in it makes the request malformed: 400, nothing
    /// forwarded. Any other body is given back untouched.
    pub async fn settle_declared_empty(mut self, limit: Duration) -> Result<FencedBody, Unsettled> {
        if self.declared != Some(0) || self.inner.is_end_stream() {
            return Ok(self);
        }
        let read = async {
            while let Some(frame) = self.frame().await {
                let frame = frame.map_err(|e| Unsettled::Cut(e.to_string()))?;
                if frame.data_ref().is_some_and(|d| !d.is_empty()) {
                    let e = Error::BadRequest("the request body is longer than its Content-Length".into());
                    return Err(Unsettled::Refused(e));
                }
            }
            Ok(())
        };
        match tokio::time::timeout(limit, read).await {
            Ok(Ok(())) => Ok(self),
            Ok(Err(e)) => Err(e),
            Err(_) => {
                let timeout_ms = u64::try_from(limit.as_millis()).unwrap_or(u64::MAX);
                Err(Unsettled::Refused(Error::BodyTimeout { timeout_ms }))
            }
        }
    }

    fn finish(&mut self) {
        self.done = true;
        if let Some(ctl) = &self.ctl {
            ctl.mark_body_done();
        }
        self.outcome.set_if_streaming(ENDED);
    }
}

impl Drop for FencedBody {
    fn drop(&mut self) {
        // Every declared byte went (what the client's stream still held,
        // trailers, cannot go on a request with a length): the upstream
        // has the whole request.
        if self.outcome.state.load(Ordering::Acquire) == STREAMING && self.declared == Some(self.handed) {
            self.finish();
        }
        self.outcome.set_if_streaming(DROPPED);
    }
}

/// The bytes of a frame (0 for trailers).
fn data_len(frame: &Frame<Bytes>) -> u64 {
    frame.data_ref().map_or(0, |d| d.len() as u64)
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
        loop {
            match Pin::new(&mut self.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    if let Some(data) = frame.data_ref() {
                        if self.held.is_some() && data.is_empty() {
                            continue; // an empty DATA frame before the end of the stream
                        }
                        self.seen = self.seen.saturating_add(data.len() as u64);
                        if self.seen > self.limit {
                            self.outcome.set(TOO_LARGE);
                            self.done = true;
                            return Poll::Ready(Some(Err(Box::new(BodyCut::TooLarge(self.limit)))));
                        }
                    }
                    if self.held.is_none()
                        && frame.is_data()
                        && self.declared == Some(self.seen)
                        && !self.inner.is_end_stream()
                    {
                        self.held = Some(frame);
                        continue;
                    }
                    if let Some(cut) = self.gate_refuses() {
                        return Poll::Ready(Some(Err(cut)));
                    }
                    if let Some(held) = self.held.take() {
                        // Trailers after the declared bytes: the stream is
                        // well formed so far; hand both over in order.
                        self.held = Some(frame);
                        self.handed += data_len(&held);
                        return Poll::Ready(Some(Ok(held)));
                    }
                    // Trailers are a body's last frame, whatever the inner
                    // body says of its end (hyper's HTTP/1.1 body never
                    // says it after them).
                    if self.inner.is_end_stream() || frame.is_trailers() {
                        self.finish();
                    }
                    self.handed += data_len(&frame);
                    return Poll::Ready(Some(Ok(frame)));
                }
                Poll::Ready(None) => {
                    if let Err(cut) = ended_whole(self.h2, &self.inner, self.declared, self.seen) {
                        self.held = None;
                        self.outcome.set(CLIENT_BROKE);
                        self.done = true;
                        return Poll::Ready(Some(Err(cut.into())));
                    }
                    if let Some(cut) = self.gate_refuses() {
                        return Poll::Ready(Some(Err(cut)));
                    }
                    if let Some(held) = self.held.take() {
                        self.finish();
                        self.handed += data_len(&held);
                        return Poll::Ready(Some(Ok(held)));
                    }
                    self.finish();
                    return Poll::Ready(None);
                }
                Poll::Ready(Some(Err(e))) => {
                    self.held = None;
                    self.outcome.set(CLIENT_BROKE);
                    self.done = true;
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    /// Not while cut off (or while the gate would cut it): hyper would end
    /// the request (the last chunk) without asking for a frame, and a
    /// client's END_STREAM that came after a newer fence would complete a
    /// stale write.
    fn is_end_stream(&self) -> bool {
        let aborted = self.ctl.as_ref().is_some_and(|c| c.is_aborted());
        let gated_off = self.gate.as_ref().is_some_and(|g| g.gate.check().is_err());
        self.done || (self.held.is_none() && !aborted && !gated_off && self.inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use http::HeaderMap;

    use super::*;

    /// A client body as hyper gives an HTTP/2 one: an exact size hint from
    /// its `content-length`, the end of the stream known only after the
    /// last frame was taken (`None` items: the stream is still open there,
    /// a poll returns Pending once and then goes on).
    struct Client {
        frames: VecDeque<Option<Result<Frame<Bytes>, BoxError>>>,
        declared: u64,
        ended: bool,
    }

    impl Body for Client {
        type Data = Bytes;
        type Error = BoxError;
        fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            match self.frames.pop_front() {
                Some(Some(f)) => Poll::Ready(Some(f)),
                Some(None) => {
                    cx.waker().wake_by_ref();
                    Poll::Pending
                }
                None => {
                    self.ended = true;
                    Poll::Ready(None)
                }
            }
        }
        fn is_end_stream(&self) -> bool {
            self.ended
        }
        fn size_hint(&self) -> SizeHint {
            SizeHint::with_exact(self.declared)
        }
    }

    fn client(declared: u64, frames: Vec<Option<Result<Frame<Bytes>, BoxError>>>) -> BoxBody {
        Client { frames: frames.into(), declared, ended: false }.boxed_unsync()
    }

    fn data(b: &'static [u8]) -> Option<Result<Frame<Bytes>, BoxError>> {
        Some(Ok(Frame::data(Bytes::from_static(b))))
    }

    /// Everything the fenced body hands on, in order, until its end or
    /// its first error.
    async fn handed_on(body: BoxBody) -> (Vec<Frame<Bytes>>, Option<String>) {
        let (mut fenced, _) = FencedBody::new(body, None, 1 << 20, false);
        let mut out = Vec::new();
        while let Some(f) = fenced.frame().await {
            match f {
                Ok(f) => out.push(f),
                Err(e) => return (out, Some(e.to_string())),
            }
        }
        (out, None)
    }

    #[tokio::test]
    async fn the_frame_completing_the_declared_length_waits_for_the_end_of_the_stream() {
        // Well formed, the end after a pause: every byte, in order.
        let (out, err) = handed_on(client(5, vec![data(b"HEL"), data(b"LO"), None, data(b"")])).await;
        assert!(err.is_none());
        let bytes: Vec<u8> = out.iter().filter_map(|f| f.data_ref()).flat_map(|d| d.to_vec()).collect();
        assert_eq!(bytes, b"HELLO");
        // Trailers after the declared bytes: both handed on, data first.
        let mut trailers = HeaderMap::new();
        trailers.insert("x-checksum", http::HeaderValue::from_static("1"));
        let (out, err) = handed_on(client(5, vec![data(b"HELLO"), Some(Ok(Frame::trailers(trailers)))])).await;
        assert!(err.is_none());
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].data_ref().map(|d| d.as_ref()), Some(&b"HELLO"[..]));
        assert!(out[1].is_trailers());
        // The stream fails after the declared bytes (h2: DATA past the
        // content-length): the last bytes are never handed on.
        let broken: BoxError = "content-length exceeded".into();
        let (out, err) = handed_on(client(5, vec![data(b"HEL"), data(b"LO"), Some(Err(broken))])).await;
        assert_eq!(err.as_deref(), Some("content-length exceeded"));
        let bytes: Vec<u8> = out.iter().filter_map(|f| f.data_ref()).flat_map(|d| d.to_vec()).collect();
        assert_eq!(bytes, b"HEL", "the frame completing the length was held back");
    }

    #[tokio::test]
    async fn a_declared_empty_body_is_settled_before_anything_is_sent() {
        let limit = Duration::from_secs(1);
        let settle = |body: BoxBody, hold: Option<Arc<Vec<InflightGuard>>>| async move {
            let (fenced, outcome) = FencedBody::new(body, hold, 1 << 20, false);
            (fenced.settle_declared_empty(limit).await, outcome)
        };
        let (ok, _) = settle(client(0, vec![None, data(b"")]), None).await;
        assert!(ok.is_ok_and(|b| b.is_end_stream()));
        let (bad, _) = settle(client(0, vec![data(b"WORLD")]), None).await;
        assert!(matches!(bad, Err(Unsettled::Refused(Error::BadRequest(_)))));
        let broken: BoxError = "reset".into();
        let (bad, outcome) = settle(client(0, vec![Some(Err(broken))]), None).await;
        assert!(matches!(bad, Err(Unsettled::Cut(_))) && outcome.client_broke());
        // A body with a length, or one already ended, is given back as is.
        let (streaming, _) = settle(client(5, vec![data(b"HELLO")]), None).await;
        assert!(streaming.is_ok_and(|b| b.size_hint().exact() == Some(5)));
    }

    #[tokio::test]
    async fn the_outcome_settles_when_the_body_ends_breaks_or_is_dropped() {
        let within = Duration::from_secs(2);
        // Ended whole: settled, not cut.
        let (mut fenced, outcome) = FencedBody::new(client(5, vec![data(b"HELLO")]), None, 1 << 20, false);
        let waiter = tokio::spawn({
            let outcome = outcome.clone();
            async move { outcome.settled().await }
        });
        while fenced.frame().await.is_some() {}
        tokio::time::timeout(within, waiter).await.unwrap().unwrap();
        assert!(!outcome.cut());
        // Broken: settled, cut.
        let broken: BoxError = "reset".into();
        let (mut fenced, outcome) = FencedBody::new(client(5, vec![Some(Err(broken))]), None, 1 << 20, false);
        assert!(fenced.frame().await.is_some_and(|f| f.is_err()));
        tokio::time::timeout(within, outcome.settled()).await.unwrap();
        assert!(outcome.cut() && outcome.client_broke());
        // Dropped before its end (the upstream wanted no more): settled,
        // not cut. Still streaming: not settled.
        let (fenced, outcome) = FencedBody::new(client(5, vec![data(b"HE"), None]), None, 1 << 20, false);
        assert!(tokio::time::timeout(Duration::from_millis(50), outcome.settled()).await.is_err());
        drop(fenced);
        tokio::time::timeout(within, outcome.settled()).await.unwrap();
        assert!(!outcome.cut());
    }

    #[tokio::test]
    async fn a_body_that_ends_short_of_its_content_length_is_an_error() {
        // hyper ends an HTTP/2 body reset with NO_ERROR as if complete.
        let (out, err) = handed_on(client(5, vec![data(b"HEL")])).await;
        assert_eq!(err.as_deref(), Some("the request body ended before its Content-Length"));
        let bytes: Vec<u8> = out.iter().filter_map(|f| f.data_ref()).flat_map(|d| d.to_vec()).collect();
        assert_eq!(bytes, b"HEL");
    }

    /// Review finding: a gateway paused (SIGSTOP) mid-upload past its
    /// member deadline forwarded the rest of the body when it ran again,
    /// before any of its tasks marked it not current, and the upstream
    /// applied it after a newer holder's write. Every frame is now checked
    /// against the gateway's currency and the upstream deadline right
    /// before it goes.
    #[tokio::test]
    async fn a_gated_upload_sends_nothing_once_the_gateway_is_not_current_or_past_its_deadline() {
        let far = tokio::time::Instant::now() + Duration::from_secs(60);
        // Cluster mode, current until a deadline that then passes (as it
        // does over a pause): the next frame is cut off, nothing more goes.
        let fences = crate::fence::FenceTable::new();
        fences.gate_on_currency();
        fences.set_current_until(tokio::time::Instant::now() + Duration::from_millis(300));
        let gate = Gate { fences: fences.clone(), deadline: far };
        let (fenced, outcome) = FencedBody::new(client(5, vec![data(b"HE"), None, data(b"LLO")]), None, 1 << 20, false);
        let mut fenced = fenced.gated(gate);
        assert_eq!(
            fenced.frame().await.and_then(|f| f.ok()).and_then(|f| f.into_data().ok()).as_deref(),
            Some(&b"HE"[..])
        );
        tokio::time::sleep(Duration::from_millis(350)).await;
        assert!(!fenced.is_end_stream());
        let cut = fenced.frame().await.expect("an error, not the end");
        assert!(cut.is_err_and(|e| e.to_string().contains("stopped being current")));
        assert!(outcome.not_current() && outcome.cut());
        assert!(fenced.frame().await.is_none(), "nothing after the cut");
        // Current, but past the route's upstream deadline: cut off too,
        // even the frame that ends the body.
        fences.set_current_until(far);
        let gate = Gate { fences: fences.clone(), deadline: tokio::time::Instant::now() };
        let (fenced, outcome) = FencedBody::new(client(5, vec![data(b"HELLO")]), None, 1 << 20, false);
        let mut fenced = fenced.gated(gate);
        assert!(fenced.frame().await.is_some_and(|f| f.is_err()));
        assert!(outcome.timed_out());
        // Current and in time: everything goes.
        let gate = Gate { fences, deadline: far };
        let (fenced, outcome) = FencedBody::new(client(5, vec![data(b"HEL"), data(b"LO")]), None, 1 << 20, false);
        let mut fenced = fenced.gated(gate);
        let mut bytes = Vec::new();
        while let Some(f) = fenced.frame().await {
            bytes.extend_from_slice(f.expect("no cut").data_ref().expect("data"));
        }
        assert_eq!(bytes, b"HELLO");
        assert!(!outcome.cut());
    }
}
