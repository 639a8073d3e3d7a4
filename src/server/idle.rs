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
//! its connection.
//!
//! A response the client stops taking (an HTTP/2 stream it opens no window
//! for, an HTTP/1.1 reader that stopped) would keep its request in flight
//! for ever: a connection with a response body that has waited on the
//! client for the same timeout is closed too (nginx's `send_timeout`, a
//! bound between two writes, not on the whole). Waiting is counted in
//! pieces of at most [`PIECE`] bytes, so a slow but steady reader of a
//! large frame is not taken for a stalled one. The fast paths bound their
//! writes the same way (`http1::conn::send`).

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use bytes::Bytes;
use futures_util::task::AtomicWaker;
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
    /// The response bodies of the connection, each with how long it has
    /// waited on the client.
    bodies: Mutex<Vec<Arc<Waits>>>,
    /// An HTTP/1 response body failed part-way: the connection must end
    /// with a reset, not a close, so that the client cannot take what it
    /// got for the whole answer (a close-delimited one would look
    /// complete).
    cut: AtomicBool,
    /// An HTTP/1 request was answered before its body had been read to its
    /// end: if the connection closes after that answer, it closes with a
    /// lingering close (`Rewind::poll_shutdown` in the server).
    unread: AtomicBool,
}

impl Activity {
    pub fn new() -> Arc<Activity> {
        Arc::new(Activity {
            start: Instant::now(),
            in_flight: AtomicUsize::new(0),
            last_ms: AtomicU64::new(0),
            bodies: Mutex::new(Vec::new()),
            cut: AtomicBool::new(false),
            unread: AtomicBool::new(false),
        })
    }

    /// Marks the request being answered as one whose body was not read to
    /// its end ([`EndSeen`]).
    pub fn left_body_unread(&self) {
        self.unread.store(true, Ordering::Release);
    }

    /// True if the connection's last HTTP/1 answer left its request's body
    /// unread: closing it must read and drop what the client still sends.
    pub fn body_left_unread(&self) -> bool {
        self.unread.load(Ordering::Acquire)
    }

    /// True once an HTTP/1 response body of the connection failed
    /// part-way ([`Tracked::resets_on_error`]).
    pub fn answer_cut(&self) -> bool {
        self.cut.load(Ordering::Acquire)
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Counts from now, for the idle timeout, as if an exchange had just
    /// ended.
    pub fn touch(&self) {
        self.last_ms.store(self.now_ms(), Ordering::Relaxed);
    }

    fn bodies(&self) -> std::sync::MutexGuard<'_, Vec<Arc<Waits>>> {
        self.bodies.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The longest any response body has waited on the client. Per body:
    /// on HTTP/2 other streams moving (a small request now and then) must
    /// not keep a stalled one, and the upstream connection behind it, for
    /// ever.
    fn longest_wait(&self, now: Instant) -> Option<Duration> {
        self.bodies().iter().filter_map(|w| w.waited(now)).max()
    }

    /// A request head arrived: in flight until the guard is dropped —
    /// with the [`Tracked`] body of its response, or with the request's
    /// future if it never answered (a stream the client reset).
    pub fn begin(self: &Arc<Self>) -> InFlight {
        self.unread.store(false, Ordering::Release);
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.touch();
        InFlight(self.clone())
    }

    /// Resolves once nothing has been in flight for `timeout` (idle), or
    /// some response body has waited on the client that long (stalled).
    pub async fn quiet_for(&self, timeout: Duration) -> Quiet {
        loop {
            let now = Instant::now();
            if self.in_flight.load(Ordering::Acquire) == 0 {
                let due = self.start + Duration::from_millis(self.last_ms.load(Ordering::Relaxed)) + timeout;
                if now >= due {
                    return Quiet::Idle;
                }
                tokio::time::sleep_until(due).await;
                continue;
            }
            // Busy: stalled once a body has waited `timeout`; look again
            // when the longest wait would reach it (a body that starts
            // waiting later is seen within two timeouts).
            match self.longest_wait(now) {
                Some(waited) if waited >= timeout => return Quiet::Stalled,
                Some(waited) => tokio::time::sleep(timeout - waited).await,
                None => tokio::time::sleep(timeout).await,
            }
        }
    }
}

/// Why a connection is to be closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quiet {
    /// Nothing in flight: close it gracefully (an HTTP/2 GOAWAY, so a
    /// request the client sends meanwhile is known not to be processed).
    Idle,
    /// Its responses wait on a client that takes none of them: drop it.
    Stalled,
}

/// One request in flight on a connection, until dropped.
pub struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.touch();
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its request in flight until it is dropped,
/// and tells its connection when it waits on the client.
pub struct Tracked {
    inner: BoxBody,
    _in_flight: InFlight,
    waits: Arc<Waits>,
    /// The waker the inner body is polled with ([`Waits`]).
    waker: Waker,
    /// What is left of a data frame larger than [`PIECE`].
    rest: Bytes,
    /// An error of the inner body marks the connection cut (HTTP/1).
    resets: bool,
}

/// Whether a response body waits on the client. It does from the moment
/// it has something for hyper — it handed over a frame, or its inner body,
/// having answered `Pending`, woke — until hyper asks for the next frame.
/// The wake-up counts: hyper asks a body for a frame only when it can send
/// one (HTTP/1.1: room in its write buffer), so a body whose upstream was
/// slower than its client for a moment answered `Pending`, and would never
/// be asked again once the client stopped reading.
struct Waits {
    /// The connection's `Activity::start`.
    start: Instant,
    /// Milliseconds from `start`, plus one, since it waits on the client;
    /// 0: not waiting.
    since_ms: AtomicU64,
    /// The inner body answered `Pending` and has not woken since.
    pending: AtomicBool,
    /// The body was dropped: a late wake-up counts nothing.
    closed: AtomicBool,
    /// hyper's waker, woken when the inner body wakes.
    hyper: AtomicWaker,
}

impl Waits {
    fn set(&self, waiting: bool) {
        if waiting {
            let now = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX - 1) + 1;
            // Waiting already: it waits since then.
            let _ = self.since_ms.compare_exchange(0, now, Ordering::SeqCst, Ordering::SeqCst);
        } else {
            self.since_ms.store(0, Ordering::SeqCst);
        }
    }

    /// How long it has waited on the client, if it does.
    fn waited(&self, now: Instant) -> Option<Duration> {
        let since = self.since_ms.load(Ordering::SeqCst);
        (since != 0).then(|| now.saturating_duration_since(self.start + Duration::from_millis(since - 1)))
    }
}

impl Wake for Waits {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if self.pending.swap(false, Ordering::SeqCst) {
            self.set(true);
            // Dropped meanwhile: undo (see `Drop for Tracked`).
            if self.closed.load(Ordering::SeqCst) {
                self.set(false);
            }
        }
        self.hyper.wake();
    }
}

/// The most of a response body handed to hyper at a time. hyper asks for
/// the next frame once the last one is on its way (HTTP/2: the client's
/// window covers it; HTTP/1.1: its write buffer has room), so a client
/// that reads slowly but steadily asks for a piece at least every
/// `PIECE` bytes it takes; a whole large frame (a file store read, an
/// upstream's buffer) would count as one long wait, and the stall close
/// would cut that client.
const PIECE: usize = 16 * 1024;

impl Tracked {
    pub fn new(inner: BoxBody, in_flight: InFlight) -> Tracked {
        let waits = Arc::new(Waits {
            start: in_flight.0.start,
            since_ms: AtomicU64::new(0),
            pending: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            hyper: AtomicWaker::new(),
        });
        let waker = Waker::from(waits.clone());
        in_flight.0.bodies().push(waits.clone());
        Tracked { inner, _in_flight: in_flight, waits, waker, rest: Bytes::new(), resets: false }
    }

    /// An error of the body (an upstream that cut its answer, a held
    /// answer past its deadline) ends the connection with a reset: on
    /// HTTP/1 the connection is the only way to tell the client that the
    /// answer is not whole. (HTTP/2 resets the stream by itself.)
    pub fn resets_on_error(mut self) -> Tracked {
        self.resets = true;
        self
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.waits.closed.store(true, Ordering::SeqCst);
        self.waits.set(false);
        self._in_flight.0.bodies().retain(|w| !Arc::ptr_eq(w, &self.waits));
    }
}

impl Body for Tracked {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.waits.set(false);
        let frame = if self.rest.is_empty() {
            let this = &mut *self;
            this.waits.hyper.register(cx.waker());
            this.waits.pending.store(true, Ordering::SeqCst);
            let polled = Pin::new(&mut this.inner).poll_frame(&mut Context::from_waker(&this.waker));
            if polled.is_pending() {
                return Poll::Pending;
            }
            this.waits.pending.store(false, Ordering::SeqCst);
            match polled {
                Poll::Ready(Some(Ok(frame))) => frame,
                Poll::Ready(Some(Err(e))) => {
                    if this.resets {
                        this._in_flight.0.cut.store(true, Ordering::Release);
                    }
                    return Poll::Ready(Some(Err(e)));
                }
                other => return other,
            }
        } else {
            Frame::data(std::mem::take(&mut self.rest))
        };
        let frame = match frame.into_data() {
            Ok(mut data) => {
                if data.len() > PIECE {
                    self.rest = data.split_off(PIECE);
                }
                Frame::data(data)
            }
            Err(frame) => frame,
        };
        self.waits.set(true);
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.rest.is_empty() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let inner = self.inner.size_hint();
        let rest = self.rest.len() as u64;
        let mut hint = SizeHint::new();
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper.saturating_add(rest));
        }
        hint.set_lower(inner.lower().saturating_add(rest));
        hint
    }
}

/// A request body that records whether it was read to its end.
pub struct EndSeen {
    inner: BoxBody,
    ended: Arc<AtomicBool>,
}

impl EndSeen {
    /// `inner`, and the flag it sets once its end has been read.
    pub fn new(inner: BoxBody) -> (EndSeen, Arc<AtomicBool>) {
        let ended = Arc::new(AtomicBool::new(false));
        (EndSeen { inner, ended: ended.clone() }, ended)
    }
}

impl Body for EndSeen {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None))
            || (matches!(polled, Poll::Ready(Some(Ok(_)))) && self.inner.is_end_stream())
        {
            self.ended.store(true, Ordering::Release);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
impl Activity {
    /// Response bodies waiting on the client now.
    fn waiting(&self) -> usize {
        let now = Instant::now();
        self.bodies().iter().filter(|w| w.waited(now).is_some()).count()
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
        assert!(tokio::time::timeout(Duration::from_secs(1), a.quiet_for(t)).await.is_err());
        drop(body);
        let ended = Instant::now();
        assert_eq!(a.quiet_for(t).await, Quiet::Idle);
        let waited = ended.elapsed();
        assert!(waited >= t && waited <= t + Duration::from_secs(1), "{waited:?}");
    }

    /// A response body whose frame the client never takes (no h2 window,
    /// an h1 reader that stopped) is stalled: its connection is closed
    /// after the timeout though the request is in flight. A body waiting
    /// on its upstream (Pending) is not, nor one the client keeps reading.
    #[tokio::test(start_paused = true)]
    async fn a_response_stalled_on_the_client_does_not_keep_its_connection() {
        let t = Duration::from_secs(75);
        let a = Activity::new();
        let frames =
            futures_util::stream::iter((0..100).map(|_| Ok::<_, BoxError>(Frame::data(Bytes::from_static(b"x")))));
        let mut body = Tracked::new(http_body_util::StreamBody::new(frames).boxed_unsync(), a.begin());
        let started = Instant::now();
        // The client keeps reading for 200 s: not idle.
        let mut stopped = Instant::now();
        for _ in 0..20 {
            assert!(body.frame().await.is_some());
            stopped = Instant::now();
            assert!(tokio::time::timeout(Duration::from_secs(10), a.quiet_for(t)).await.is_err());
        }
        // Then it stops taking frames: closed about one timeout after the
        // last frame it took.
        let quiet = tokio::time::timeout(10 * t, a.quiet_for(t)).await.expect("a stalled response kept its connection");
        assert_eq!(quiet, Quiet::Stalled);
        let waited = stopped.elapsed();
        assert!(waited >= t && waited <= 2 * t, "{waited:?} after {:?}", started.elapsed());
        drop(body);
        // A body waiting on its upstream is busy, not stalled.
        let a = Activity::new();
        let (_tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(1);
        let upstream = http_body_util::StreamBody::new(tokio_stream_from(rx));
        let mut body = Tracked::new(upstream.boxed_unsync(), a.begin());
        assert!(tokio::time::timeout(Duration::from_secs(1), body.frame()).await.is_err());
        assert!(tokio::time::timeout(Duration::from_secs(300), a.quiet_for(t)).await.is_err());
        drop(body);
    }

    /// A large data frame goes to hyper in pieces of at most [`PIECE`]
    /// bytes, so that a client reading it slowly asks for each piece well
    /// within the timeout; the body ends, and is sized, as before.
    #[tokio::test(start_paused = true)]
    async fn a_large_frame_goes_out_in_pieces_a_slow_reader_keeps_taking() {
        let t = Duration::from_secs(75);
        let a = Activity::new();
        let big = Bytes::from(vec![7u8; 4 * PIECE + 5]);
        let inner = http_body_util::Full::new(big.clone()).map_err(|e| match e {}).boxed_unsync();
        let mut body = Tracked::new(inner, a.begin());
        assert_eq!(body.size_hint().exact(), Some(big.len() as u64));
        let mut got = Vec::new();
        let mut sizes = Vec::new();
        while let Some(frame) = body.frame().await {
            let data = frame.expect("frame").into_data().expect("data");
            sizes.push(data.len());
            got.extend_from_slice(&data);
            if got.len() < big.len() {
                assert!(!body.is_end_stream());
                assert_eq!(body.size_hint().exact(), Some((big.len() - got.len()) as u64));
            }
            // The client takes a piece every 60 s, within the timeout.
            assert!(tokio::time::timeout(Duration::from_secs(60), a.quiet_for(t)).await.is_err());
        }
        assert_eq!(sizes, [PIECE, PIECE, PIECE, PIECE, 5]);
        assert_eq!(got, big);
        assert!(body.is_end_stream());
    }

    /// A body whose upstream was slower than its client for a moment
    /// answered `Pending`; when the upstream's data comes and hyper does
    /// not ask for it (an HTTP/1.1 client that stopped reading: no room in
    /// hyper's write buffer), the body waits on the client from then on.
    #[tokio::test(start_paused = true)]
    async fn a_body_that_woke_with_data_nobody_asks_for_is_stalled() {
        let t = Duration::from_secs(75);
        let a = Activity::new();
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(1);
        let upstream = http_body_util::StreamBody::new(tokio_stream_from(rx));
        let mut body = Tracked::new(upstream.boxed_unsync(), a.begin());
        let mut cx = Context::from_waker(futures_util::task::noop_waker_ref());
        assert!(Pin::new(&mut body).poll_frame(&mut cx).is_pending());
        // Waiting on the upstream for 200 s: busy, not stalled.
        assert!(tokio::time::timeout(Duration::from_secs(200), a.quiet_for(t)).await.is_err());
        // The upstream's data comes; nobody asks for it.
        tx.send(Ok(Frame::data(Bytes::from_static(b"late")))).await.expect("send");
        let woke = Instant::now();
        let quiet = tokio::time::timeout(3 * t, a.quiet_for(t)).await.expect("a body nobody polls kept its connection");
        assert_eq!(quiet, Quiet::Stalled);
        assert!(woke.elapsed() >= t, "stalled after {:?}", woke.elapsed());
        // Asked at last: not waiting any more, and a later wake-up after
        // the body is gone counts nothing.
        assert!(Pin::new(&mut body).poll_frame(&mut cx).is_ready());
        assert_eq!(a.waiting(), 1, "it handed over a frame");
        assert!(Pin::new(&mut body).poll_frame(&mut cx).is_pending());
        assert_eq!(a.waiting(), 0);
        drop(body);
        drop(tx);
        assert_eq!(a.waiting(), 0);
    }

    /// Per body: another response of the connection that keeps moving
    /// (on HTTP/2, a small request now and then) does not keep a stalled
    /// one, and the upstream connection behind it, for ever.
    #[tokio::test(start_paused = true)]
    async fn a_stalled_body_is_not_kept_by_another_that_moves() {
        let t = Duration::from_secs(75);
        let a = Activity::new();
        let frames = || {
            let items = (0..100).map(|_| Ok::<_, BoxError>(Frame::data(Bytes::from_static(b"x"))));
            http_body_util::StreamBody::new(futures_util::stream::iter(items)).boxed_unsync()
        };
        let mut stalled = Tracked::new(frames(), a.begin());
        let mut moving = Tracked::new(frames(), a.begin());
        assert!(stalled.frame().await.is_some());
        let started = Instant::now();
        let quiet = tokio::time::timeout(3 * t, async {
            tokio::select! {
                quiet = a.quiet_for(t) => quiet,
                () = async {
                    loop {
                        tokio::time::sleep(Duration::from_secs(10)).await;
                        assert!(moving.frame().await.is_some());
                    }
                } => unreachable!(),
            }
        })
        .await
        .expect("a stalled body was kept by another that moves");
        assert_eq!(quiet, Quiet::Stalled);
        assert!(started.elapsed() >= t, "{:?}", started.elapsed());
    }

    fn tokio_stream_from<T: Send + 'static>(
        mut rx: tokio::sync::mpsc::Receiver<T>,
    ) -> impl futures_util::Stream<Item = T> + Send {
        futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
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
        let quiet = tokio::time::timeout(Duration::from_secs(80), a.quiet_for(t)).await.expect("never idle");
        assert_eq!(quiet, Quiet::Idle);
        assert!(started.elapsed() <= t + Duration::from_secs(1));
    }
}
