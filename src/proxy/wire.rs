//! An upstream connection's own writes, checked as they reach the socket.
//!
//! The HTTP client takes a request body frame by frame and buffers what
//! the socket does not accept at once (a few hundred KiB while the
//! upstream is slow to read); it writes that later, from the connection's
//! own task. A check of a frame when the client takes it therefore says
//! nothing about when its bytes go. So the socket itself is wrapped: every
//! write asks the request's [`WriteCheck`] first, under a lock that
//! [`Wire::cut`] takes too. Once a write was refused, or the exchange was
//! cut (given up, timed out, answered while its body was unfinished),
//! nothing more is written on the connection, its task is stopped and the
//! socket is reset at once, which also drops what the kernel had not
//! delivered yet.
//!
//! A request counts as sent only once the upstream's kernel has
//! acknowledged all of it ([`super::sendq`]): bytes still in the gateway's
//! send queue would reach an upstream that reads late whenever it reads.
//! So a connection whose fenced request is not delivered is never pooled,
//! and it is reset, never closed, when it goes (also when the HTTP client
//! ends it on its own error). What was delivered stays delivered: that is
//! the documented assumption of the quarantine and of the activation
//! barrier — an upstream applies what it was sent within the route's
//! upstream timeout.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::task::AbortHandle;

/// What decides whether the bytes of the request now on a connection may
/// still go.
pub trait WriteCheck: Send + Sync {
    /// True when nothing more of the request may be written; records why
    /// where the request's handler will look.
    fn refuses(&self) -> bool;
    /// True once the request has been handed to the client whole.
    fn finished(&self) -> bool;
}

#[derive(Default)]
struct State {
    check: Option<Arc<dyn WriteCheck>>,
    /// Counts the requests carried, so that an exchange cuts only the
    /// connection while it still carries that exchange's request.
    carried: u64,
    /// The request was handed over whole and the client has flushed it
    /// since: every byte of it is in the kernel.
    drained: bool,
    /// The upstream's kernel was seen to have acknowledged every byte of
    /// the request (asked once: the answer cannot change back).
    acked: bool,
    cut: bool,
    /// The socket (a second descriptor of it), while the connection is
    /// open: read for what it has delivered, reset by a cut.
    fd: Option<OwnedFd>,
}

impl State {
    /// Cuts the wire: no byte more, and what the kernel still holds is
    /// dropped now (the connection is reset).
    fn cut_now(&mut self) {
        self.cut = true;
        if let Some(fd) = &self.fd {
            super::sendq::reset(fd);
        }
    }

    /// True when nothing of the request on the wire is left to deliver:
    /// none is checked, the connection is cut or gone, or it was handed
    /// over whole and the upstream's kernel acknowledged every byte.
    fn delivered(&mut self) -> bool {
        match &self.fd {
            _ if self.check.is_none() || self.cut || self.acked => true,
            None => true,
            Some(fd) => {
                self.acked = self.drained && super::sendq::delivered(fd);
                self.acked
            }
        }
    }
}

/// One upstream connection's write gate, shared by its socket (inside the
/// HTTP client's connection task) and the exchanges that use it.
#[derive(Default)]
pub struct Wire {
    state: Mutex<State>,
    task: OnceLock<AbortHandle>,
}

impl Wire {
    /// A wire with no request on it.
    pub fn new() -> Arc<Wire> {
        Arc::new(Wire::default())
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The connection's task: stopped when the wire is cut.
    pub fn set_task(&self, task: AbortHandle) {
        if self.task.set(task).is_err() {
            tracing::debug!("an upstream connection's task was set twice");
        }
        if self.is_cut() {
            self.stop_task();
        }
    }

    /// Puts the next request's check on the wire (`None`: a request that
    /// is not checked, such as a read); returns its number for
    /// [`Wire::cut_if_carrying`].
    pub fn carry(&self, check: Option<Arc<dyn WriteCheck>>) -> u64 {
        let mut state = self.lock();
        state.check = check;
        state.drained = false;
        state.acked = false;
        state.carried += 1;
        state.carried
    }

    /// The socket the wire gates (a second descriptor of it, dropped when
    /// the connection goes).
    fn attach(&self, fd: Option<OwnedFd>) {
        self.lock().fd = fd;
    }

    /// True once the request on the wire has been handed over whole and
    /// the upstream's kernel has acknowledged all of it (or it needs no
    /// checking): the connection may carry another.
    pub fn request_delivered(&self) -> bool {
        self.lock().delivered()
    }

    /// True when request `carried` has nothing left to deliver: the wire
    /// has moved on (only a delivered request lets it), or see
    /// [`Wire::request_delivered`].
    pub fn delivered(&self, carried: u64) -> bool {
        let mut state = self.lock();
        state.carried != carried || state.delivered()
    }

    /// No byte more on this connection: returns only when no write is
    /// under way, and none starts after it; what the kernel has not
    /// delivered is dropped (reset). Stops the connection's task.
    pub fn cut(&self) {
        self.lock().cut_now();
        self.stop_task();
    }

    /// [`Wire::cut`], if the connection still carries request `carried`.
    pub fn cut_if_carrying(&self, carried: u64) {
        let mut state = self.lock();
        if state.carried != carried || state.cut {
            return;
        }
        state.cut_now();
        drop(state);
        self.stop_task();
    }

    fn stop_task(&self) {
        if let Some(task) = self.task.get() {
            task.abort();
        }
    }

    /// True once the wire has been cut.
    pub fn is_cut(&self) -> bool {
        self.lock().cut
    }
}

impl std::fmt::Debug for Wire {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wire").field("cut", &self.is_cut()).finish_non_exhaustive()
    }
}

fn cut_error() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionAborted, "the fenced request was cut off before these bytes went")
}

/// A TCP connection to an upstream whose every write passes its [`Wire`].
/// Under TLS it sits below the TLS layer, so what TLS buffers is checked
/// when it is written too.
pub struct WiredTcp {
    tcp: TcpStream,
    wire: Arc<Wire>,
}

impl WiredTcp {
    /// Wraps `tcp`; `wire` gates its writes.
    pub fn new(tcp: TcpStream, wire: Arc<Wire>) -> WiredTcp {
        wire.attach(tcp.as_fd().try_clone_to_owned().ok());
        WiredTcp { tcp, wire }
    }

    /// Writes with `write` if the wire lets the bytes go: checked and
    /// written under the wire's lock, so a cut never overlaps a write.
    fn gated<T>(
        self: Pin<&mut Self>,
        write: impl FnOnce(Pin<&mut TcpStream>) -> Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        let this = self.get_mut();
        let mut state = this.wire.lock();
        if state.cut {
            return Poll::Ready(Err(cut_error()));
        }
        if state.check.as_ref().is_some_and(|c| c.refuses()) {
            state.cut_now();
            drop(state);
            this.wire.stop_task();
            return Poll::Ready(Err(cut_error()));
        }
        write(Pin::new(&mut this.tcp))
    }
}

impl AsyncRead for WiredTcp {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.wire.is_cut() {
            return Poll::Ready(Err(cut_error()));
        }
        Pin::new(&mut this.tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for WiredTcp {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.gated(|tcp| tcp.poll_write(cx, buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.gated(|tcp| tcp.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    /// The HTTP client flushes its socket only once its own buffer is
    /// empty: a flush after the request was handed over whole means all
    /// of it has been written.
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let mut state = this.wire.lock();
        if !state.drained && state.check.as_ref().is_some_and(|c| c.finished()) {
            state.drained = true;
        }
        drop(state);
        Pin::new(&mut this.tcp).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_shutdown(cx)
    }
}

impl Drop for WiredTcp {
    fn drop(&mut self) {
        // A cut connection, or one whose fenced request is not delivered
        // (the HTTP client gave the connection up on its own error, the
        // upstream answered without reading all of it), is reset, not
        // closed: the kernel drops what it still holds of the request
        // instead of sending it on.
        let mut state = self.wire.lock();
        if state.cut || !state.delivered() {
            super::sendq::reset(&self.tcp);
        } else {
            super::sendq::close_cleanly(&self.tcp);
        }
        state.fd = None;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    struct Flag {
        refuse: AtomicBool,
    }

    impl WriteCheck for Flag {
        fn refuses(&self) -> bool {
            self.refuse.load(Ordering::Acquire)
        }
        fn finished(&self) -> bool {
            false
        }
    }

    async fn pair() -> (WiredTcp, TcpStream, Arc<Wire>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (client, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let wire = Wire::new();
        (WiredTcp::new(client.unwrap(), wire.clone()), accepted.unwrap().0, wire)
    }

    #[tokio::test]
    async fn a_refused_write_sends_nothing_and_cuts_the_wire_for_good() {
        let (mut wired, mut peer, wire) = pair().await;
        let flag = Arc::new(Flag { refuse: AtomicBool::new(false) });
        wire.carry(Some(flag.clone()));
        wired.write_all(b"first").await.unwrap();
        let mut first = [0u8; 5];
        peer.read_exact(&mut first).await.unwrap();
        assert_eq!(&first, b"first");
        flag.refuse.store(true, Ordering::Release);
        assert!(wired.write_all(b"second").await.is_err());
        flag.refuse.store(false, Ordering::Release);
        assert!(wired.write_all(b"third").await.is_err(), "a cut wire stays cut");
        assert!(wire.is_cut());
        drop(wired);
        let mut rest = [0u8; 16];
        let after = peer.read(&mut rest).await;
        assert!(matches!(after, Ok(0) | Err(_)), "nothing after the refusal: {after:?}");
    }

    #[tokio::test]
    async fn a_cut_wire_refuses_writes_and_reads_and_an_unchecked_one_writes() {
        let (mut wired, mut peer, wire) = pair().await;
        wire.carry(None);
        assert!(wire.request_delivered());
        wired.write_all(b"read").await.unwrap();
        let mut four = [0u8; 4];
        peer.read_exact(&mut four).await.unwrap();
        wire.cut();
        assert!(wired.write_all(b"more").await.is_err());
        let mut buf = [0u8; 1];
        assert!(wired.read(&mut buf).await.is_err());
    }
}
