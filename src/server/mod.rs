//! Listeners: accept, TLS handshake (rustls, ALPN h2/http1.1, optional
//! mTLS), serve HTTP/1.1 and HTTP/2 (h2c prior knowledge in plain text) with
//! hyper-util's auto builder, bound the number of connections, and drain
//! gracefully on shutdown. This module knows nothing of leases or fences:
//! it hands each request to a handler.

mod api_loop;
mod idle;

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use http_body_util::BodyExt;
use hyper::body::{Body as _, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::body::BoxBody;
use crate::error::Error;
use crate::http1::conn::{ConnLimits, Handover};
use crate::peer::Peer;
use crate::proxy::fast;
use crate::proxy::Proxy;
use crate::shutdown::Shutdown;
use crate::tls::{subject_cn, Reloadable};
use tokio_rustls::TlsAcceptor;

/// A boxed response future.
pub type ResponseFuture = Pin<Box<dyn Future<Output = Response<BoxBody>> + Send>>;

/// What serves each request of a listener.
pub type Handler = Arc<dyn Fn(Request<BoxBody>, Peer) -> ResponseFuture + Send + Sync>;

/// Listener limits.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_connections: usize,
    /// Most connections open at once from one client address (0: no
    /// per-address bound).
    pub max_connections_per_address: usize,
    pub max_header_bytes: usize,
    pub header_read_timeout: Duration,
    pub body_read_timeout: Duration,
    pub shutdown_grace: Duration,
    /// A connection served by hyper (HTTP/2, TLS, what the fast paths hand
    /// over) with no request in flight for this long is closed.
    pub idle_timeout: Duration,
}

/// Open connections per client address, against a bound (0: none).
struct PerAddress {
    open: dashmap::DashMap<std::net::IpAddr, usize>,
    limit: usize,
}

/// One open connection of an address; dropping it uncounts it.
struct AddressSlot {
    owner: Arc<PerAddress>,
    ip: std::net::IpAddr,
}

impl PerAddress {
    fn enter(self: &Arc<Self>, ip: std::net::IpAddr) -> Option<Option<AddressSlot>> {
        if self.limit == 0 {
            return Some(None);
        }
        let mut n = self.open.entry(ip).or_insert(0);
        if *n >= self.limit {
            return None;
        }
        *n += 1;
        Some(Some(AddressSlot { owner: self.clone(), ip }))
    }
}

impl Drop for AddressSlot {
    fn drop(&mut self) {
        self.owner.open.remove_if_mut(&self.ip, |_, n| {
            *n = n.saturating_sub(1);
            *n == 0
        });
    }
}

async fn serve_conn<I>(
    ctx: &Listener,
    watcher: hyper_util::server::graceful::Watcher,
    io: I,
    client: Peer,
    activity: Arc<idle::Activity>,
) where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (name, limits, handler) = (ctx.name, ctx.limits, ctx.handler.clone());
    let addr = client.addr;
    let tracker = activity.clone();
    let service = service_fn(move |req: Request<Incoming>| {
        let exchange = tracker.begin();
        let h1 = req.version() < hyper::Version::HTTP_2;
        let header_bytes: usize = req.headers().iter().map(|(k, v)| k.as_str().len() + v.len() + 4).sum();
        // An HTTP/1 request body still coming: whether it is read to its end.
        let mut ended = None;
        let fut = if header_bytes > limits.max_header_bytes {
            let limit_bytes = limits.max_header_bytes as u64;
            ended = (h1 && !req.body().is_end_stream()).then(|| Arc::new(AtomicBool::new(false)));
            Box::pin(async move { Error::HeadersTooLarge { limit_bytes }.into_response() })
        } else {
            let req = req.map(|b| {
                let b = b.map_err(Into::into).boxed_unsync();
                if h1 && !b.is_end_stream() {
                    let (watched, end) = idle::EndSeen::new(b);
                    ended = Some(end);
                    watched.boxed_unsync()
                } else {
                    b
                }
            });
            handler(req, client.clone())
        };
        let activity = tracker.clone();
        async move {
            let response = fut.await;
            if ended.is_some_and(|e| !e.load(Ordering::Acquire)) {
                // Answered before its body was read to its end (a refusal on
                // the head, an upstream that answered early): the body was
                // dropped with the request. One turn of the connection task
                // lets hyper see that first: it takes what has already come
                // (a small body sent whole keeps its connection) or stops
                // reading, and then writes this answer with `Connection:
                // close` — the client learns the connection ends, and the
                // close lingers (`Rewind::poll_shutdown`).
                activity.left_body_unread();
                tokio::task::yield_now().await;
            }
            Ok::<_, Infallible>(response.map(|b| {
                let body = idle::Tracked::new(b, exchange);
                if h1 {
                    body.resets_on_error()
                } else {
                    body
                }
            }))
        }
    });
    let conn = ctx.builder.serve_connection(io, service);
    tokio::pin!(conn);
    // Held until the connection ends: the listener's drain waits for it.
    let _watcher = watcher;
    // A graceful close was started (a stop, or the connection was idle).
    let mut graceful = false;
    loop {
        tokio::select! {
            ended = conn.as_mut() => {
                if let Err(e) = ended {
                    tracing::debug!(listener = name, client = %addr, error = %e, "connection ended with an error");
                }
                return;
            }
            () = ctx.shutdown.wait(), if !graceful => {
                conn.as_mut().graceful_shutdown();
                graceful = true;
            }
            quiet = activity.quiet_for(limits.idle_timeout) => match quiet {
                // Nothing in flight: an HTTP/2 client is told by GOAWAY
                // which of its requests were taken, so one it sent at this
                // moment can be retried safely; an HTTP/1.1 connection
                // closes at once. A request taken meanwhile runs to its
                // end; the connection is dropped only once nothing has
                // been in flight for another timeout.
                idle::Quiet::Idle if !graceful => {
                    tracing::debug!(listener = name, client = %addr, "idle connection: closing");
                    conn.as_mut().graceful_shutdown();
                    graceful = true;
                    activity.touch();
                }
                idle::Quiet::Idle => {
                    tracing::debug!(listener = name, client = %addr, "idle connection closed");
                    return;
                }
                idle::Quiet::Stalled => {
                    tracing::debug!(listener = name, client = %addr, "stalled connection closed");
                    return;
                }
            },
        }
    }
}

/// A stream that first gives back bytes already read from it (what the
/// proxy's fast path, or [`sniff`], read before hyper took the connection).
struct Rewind<S: Resettable> {
    prefix: bytes::BytesMut,
    inner: S,
    /// The connection's activity: a response cut part-way ends it with a
    /// reset ([`idle::Activity::answer_cut`]).
    activity: Arc<idle::Activity>,
    /// The lingering close's deadline, once it has begun.
    linger: Option<Pin<Box<tokio::time::Sleep>>>,
    /// The write side has been shut.
    shut: bool,
}

impl<S: Resettable> Rewind<S> {
    fn new(prefix: bytes::BytesMut, inner: S, activity: Arc<idle::Activity>) -> Rewind<S> {
        Rewind { prefix, inner, activity, linger: None, shut: false }
    }
}

/// How long a connection closed after an answer that left its request's
/// body unread goes on reading (and dropping) what the client still sends
/// (nginx's `lingering_time`, 30 s there). A server that closes with
/// unread bytes makes its kernel answer them with a reset, and a reset can
/// destroy the answer before the client has read it; a client that writes
/// its whole body before it reads (most do) then sees a broken pipe
/// instead of the refusal. Bounded: a client that neither stops sending
/// nor closes holds its slot for this long at most.
const LINGER: Duration = Duration::from_secs(5);

/// A client connection that can be made to end with a TCP reset.
trait Resettable {
    fn reset_on_close(&self);
}

impl Resettable for tokio::net::TcpStream {
    fn reset_on_close(&self) {
        let _ = self.set_zero_linger();
    }
}

impl Resettable for tokio_rustls::server::TlsStream<tokio::net::TcpStream> {
    fn reset_on_close(&self) {
        self.get_ref().0.reset_on_close();
    }
}

impl<S: Resettable> Drop for Rewind<S> {
    fn drop(&mut self) {
        if self.activity.answer_cut() {
            self.inner.reset_on_close();
        }
    }
}

/// The HTTP/2 connection preface (RFC 9113 §3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Reads until the bytes in `buffered` tell HTTP/1.1 from HTTP/2 (they
/// differ from the HTTP/2 preface, or hold all of it), within `limit`.
/// hyper-util's auto builder reads these bytes with no timer of its own:
/// without this, a client that sends nothing, or a part of the preface,
/// would hold its connection (and a slot of the listener) for ever. After
/// it, hyper's own timers bound the connection (the header read timeout on
/// HTTP/1.1, PINGs on HTTP/2). False: close the connection (timed out, or
/// it ended before saying anything usable).
async fn sniff<S: tokio::io::AsyncRead + Unpin>(
    stream: &mut S,
    buffered: &mut bytes::BytesMut,
    limit: Duration,
) -> bool {
    use tokio::io::AsyncReadExt;
    let decided = |b: &[u8]| {
        let n = b.len().min(H2_PREFACE.len());
        n == H2_PREFACE.len() || b[..n] != H2_PREFACE[..n]
    };
    let read = async {
        while !decided(buffered) {
            buffered.reserve(H2_PREFACE.len());
            match stream.read_buf(buffered).await {
                Ok(0) | Err(_) => return false,
                Ok(_) => {}
            }
        }
        true
    };
    tokio::time::timeout(limit, read).await.unwrap_or(false)
}

impl<S: tokio::io::AsyncRead + Unpin + Resettable> tokio::io::AsyncRead for Rewind<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            buf.put_slice(&self.prefix.split_to(n));
            return std::task::Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Resettable> tokio::io::AsyncWrite for Rewind<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    /// A FIN after the last answer; then, if that answer left its
    /// request's body unread, a lingering close: what the client still
    /// sends is read and dropped until it closes too, or for [`LINGER`].
    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        if !self.shut {
            std::task::ready!(Pin::new(&mut self.inner).poll_shutdown(cx))?;
            self.shut = true;
        }
        if !self.activity.body_left_unread() {
            return Poll::Ready(Ok(()));
        }
        let mut scratch = [0u8; 16 * 1024];
        loop {
            let linger = self.linger.get_or_insert_with(|| Box::pin(tokio::time::sleep(LINGER)));
            if linger.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Ok(()));
            }
            let mut buf = tokio::io::ReadBuf::new(&mut scratch);
            match tokio::io::AsyncRead::poll_read(self.as_mut(), cx, &mut buf) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(())) if !buf.filled().is_empty() => {}
                // The client closed too (or broke off): done.
                Poll::Ready(_) => return Poll::Ready(Ok(())),
            }
        }
    }
}

/// What serves a plain-text connection first; it hands the connection to
/// the general path (hyper) when a request needs it.
#[derive(Clone)]
pub enum FastPath {
    /// Hyper serves every connection.
    Off,
    /// The proxy's forwarding fast path ([`crate::proxy::fast`]).
    Proxy(Arc<Proxy>),
    /// The small HTTP/1.1 loop in front of the listener's own handler
    /// ([`api_loop`]); bodies above `max_body_bytes` go to the general path.
    Handler { max_body_bytes: u64 },
}

/// Serves `listener` until `shutdown`, then drains open connections for
/// up to `limits.shutdown_grace`. True if every connection drained.
pub async fn serve(
    name: &'static str,
    listener: TcpListener,
    handler: Handler,
    limits: Limits,
    tls: Option<Arc<Reloadable>>,
    shutdown: Shutdown,
    fast: FastPath,
) -> bool {
    let builder = hyper_builder(limits);
    let listener_ctx = Arc::new(Listener { name, handler, builder, tls, fast, shutdown: shutdown.clone(), limits });
    let graceful = GracefulShutdown::new();
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let per_address = Arc::new(PerAddress { open: dashmap::DashMap::new(), limit: limits.max_connections_per_address });
    loop {
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break },
            () = shutdown.wait() => break,
        };
        let (stream, addr) = tokio::select! {
            r = listener.accept() => match r {
                Ok(pair) => pair,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(listener = name, error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = shutdown.wait() => break,
        };
        let Some(address_slot) = per_address.enter(addr.ip()) else {
            // Closed at once: one address may not take the whole listener.
            tracing::debug!(listener = name, client = %addr, "connection refused: too many from this address");
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let ctx = listener_ctx.clone();
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            // Counted against its address and the listener for as long as
            // it is open.
            let _address_slot = address_slot;
            serve_accepted(&ctx, stream, addr, watcher).await;
            drop(permit);
        });
    }
    drop(listener);
    drain(name, graceful, &slots, limits).await
}

/// What every connection of one listener shares.
struct Listener {
    name: &'static str,
    handler: Handler,
    builder: auto::Builder<TokioExecutor>,
    tls: Option<Arc<Reloadable>>,
    fast: FastPath,
    shutdown: Shutdown,
    limits: Limits,
}

/// The largest read hyper makes of a request body on an HTTP/1.1
/// connection it serves (its read buffer grows to this only while reads
/// fill it, so small requests keep an 8 KiB buffer). 64 MiB PUTs streamed
/// to an upstream at 4 connections, fencegate on one core: 1,390–1,440
/// MiB/s with 128 KiB reads (the limit before, twice `max_header_bytes`),
/// 1,950–2,330 with 512 KiB, interleaved on the same machine; peak RSS 43
/// vs 53 MiB (1 MiB reads: 2,500 MiB/s but 68 MiB, above the 64 MiB the
/// harness allows). benches/compare/RESULTS.md, section 2.
const BODY_READ_MAX: usize = 512 * 1024;

/// hyper's HTTP/1.1 and HTTP/2 settings from the listener limits.
fn hyper_builder(limits: Limits) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        // No half_close: hyper cannot tell a client that shut only its
        // write side (`nc -N`) from one that hung up, and a hang-up must
        // drop the request's future (an abandoned acquire leaves the
        // queue). A half-closed request is treated as a hang-up here.
        // hyper's own hard limit sits above ours, so that most oversized
        // headers get our JSON 431 rather than hyper's bare one. It is
        // also the largest read of a body, see [`BODY_READ_MAX`].
        .max_buf_size(limits.max_header_bytes.saturating_mul(2).max(BODY_READ_MAX));
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(limits.max_header_bytes.saturating_mul(2)).unwrap_or(u32::MAX))
        .max_concurrent_streams(256)
        // Dead h2 peers are found by PING; idle HTTP/1.1 connections are
        // closed by the header read timeout, which also runs between
        // keep-alive requests.
        .keep_alive_interval(Some(Duration::from_secs(30)))
        .keep_alive_timeout(Duration::from_secs(10));
    builder
}

/// One accepted connection until it ends: plain text through the
/// listener's hand-written loop first (if any) and hyper for what it hands
/// over; TLS through the handshake (bounded by the header read timeout),
/// its client certificate's name, then hyper.
async fn serve_accepted(
    ctx: &Listener,
    stream: tokio::net::TcpStream,
    addr: std::net::SocketAddr,
    watcher: hyper_util::server::graceful::Watcher,
) {
    let (name, limits) = (ctx.name, ctx.limits);
    let Some(config) = ctx.tls.as_ref().and_then(|t| t.current()) else {
        let client = Peer::new(addr, false, None);
        let conn_limits = ConnLimits {
            max_header_bytes: limits.max_header_bytes,
            header_read_timeout: limits.header_read_timeout,
            body_read_timeout: limits.body_read_timeout,
            send_timeout: limits.idle_timeout,
        };
        let handover = match &ctx.fast {
            FastPath::Off => Some(Handover { stream, buffered: bytes::BytesMut::new() }),
            FastPath::Proxy(proxy) => fast::serve_conn(proxy, stream, &client, conn_limits, &ctx.shutdown).await,
            FastPath::Handler { max_body_bytes } => {
                api_loop::serve_conn(&ctx.handler, stream, &client, conn_limits, *max_body_bytes, &ctx.shutdown).await
            }
        };
        let Some(mut h) = handover else { return };
        if !sniff(&mut h.stream, &mut h.buffered, limits.header_read_timeout).await {
            return;
        }
        let activity = idle::Activity::new();
        let io = Rewind::new(h.buffered, h.stream, activity.clone());
        serve_conn(ctx, watcher, TokioIo::new(io), client, activity).await;
        return;
    };
    let accept = TlsAcceptor::from(config).accept(stream);
    match tokio::time::timeout(limits.header_read_timeout, accept).await {
        Ok(Ok(mut tls_stream)) => {
            let mut buffered = bytes::BytesMut::new();
            if !sniff(&mut tls_stream, &mut buffered, limits.header_read_timeout).await {
                return;
            }
            let cert_cn = tls_stream
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|certs| certs.first())
                .and_then(|c| subject_cn(c))
                .map(Arc::from);
            let client = Peer::new(addr, true, cert_cn);
            let activity = idle::Activity::new();
            let io = TokioIo::new(Rewind::new(buffered, tls_stream, activity.clone()));
            serve_conn(ctx, watcher, io, client, activity).await;
        }
        Ok(Err(e)) => tracing::debug!(listener = name, client = %addr, error = %e, "TLS handshake failed"),
        Err(_) => tracing::debug!(listener = name, client = %addr, "TLS handshake timed out"),
    }
}

/// After the listener closed: every connection task holds a slot until it
/// ends, whichever path served it; hyper's connections are told to finish
/// first. `false` when the shutdown grace passed with connections open.
async fn drain(name: &'static str, graceful: GracefulShutdown, slots: &Semaphore, limits: Limits) -> bool {
    tracing::info!(listener = name, "draining connections");
    let all_slots = u32::try_from(limits.max_connections.max(1)).unwrap_or(u32::MAX);
    let drained = async {
        graceful.shutdown().await;
        let _ = slots.acquire_many(all_slots).await;
    };
    tokio::select! {
        () = drained => {
            tracing::info!(listener = name, "all connections drained");
            true
        }
        () = tokio::time::sleep(limits.shutdown_grace) => {
            tracing::warn!(listener = name, "shutdown grace passed with connections still open");
            false
        }
    }
}
