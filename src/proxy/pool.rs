//! The HTTP/1.1 connection pool of one route. A route has exactly one
//! upstream authority, so the pool is a plain stack of idle connections:
//! no keying, no hashing, no per-request channel to a pool task.
//!
//! A connection returns to the pool when the response body it carried has
//! been read to its end (or had none); a response dropped half-read closes
//! its connection. A request that could not be written on a pooled
//! connection (the upstream closed it while idle) is retried once on a new
//! connection; a request whose head was written is never resent.
//!
//! Every connection's socket writes pass its [`Wire`]: a fenced upload's
//! bytes go only while its gate lets them, whenever the client writes
//! them, and an exchange given up before its end (timed out, dropped, or
//! answered while its body was unfinished) cuts its connection: nothing
//! more of it is written, and the connection is reset.

use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use http::uri::Authority;
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::fenced_body::FencedBody;
use super::wire::{Wire, WiredTcp};

/// A connection: the client's handle on it and the gate of its writes.
struct Sender {
    send: http1::SendRequest<FencedBody>,
    wire: Arc<Wire>,
}

impl Sender {
    fn is_closed(&self) -> bool {
        self.send.is_closed() || self.wire.is_cut()
    }
}

/// An exchange under way on a connection: cuts the connection when it is
/// dropped before its end (given up, timed out, its response dropped
/// half-read).
struct Exchange {
    wire: Option<Arc<Wire>>,
}

impl Exchange {
    /// The exchange ended cleanly: the connection may serve another.
    fn finish(mut self) {
        self.wire = None;
    }
}

impl Drop for Exchange {
    fn drop(&mut self) {
        if let Some(wire) = self.wire.take() {
            wire.cut();
        }
    }
}

/// An idle raw connection (fast path): all it carried was delivered, so
/// when the pool lets it go (idle timeout, a full pool, the gateway's
/// stop) it closes cleanly (FIN), not with the reset its zero linger
/// would make.
struct IdleRaw {
    stream: Option<TcpStream>,
    since: Instant,
}

impl Drop for IdleRaw {
    fn drop(&mut self) {
        if let Some(stream) = &self.stream {
            super::sendq::close_cleanly(stream);
        }
    }
}

struct Idle {
    sender: Sender,
    since: Instant,
}

impl Idle {
    fn usable(&self, idle_timeout: Duration) -> bool {
        !self.sender.is_closed() && self.since.elapsed() < idle_timeout
    }
}

/// Idle connections to one upstream, most recently used last.
pub struct Pool {
    authority: Authority,
    /// `host:port` to connect to.
    addr: String,
    tls: Option<(tokio_rustls::TlsConnector, rustls::pki_types::ServerName<'static>)>,
    connect_timeout: Duration,
    /// See [`super::sendq::abort_on_exit`].
    stall_limit: Duration,
    idle_timeout: Duration,
    max_idle: usize,
    idle: Mutex<Vec<Idle>>,
    /// Idle raw connections of the fast path (plain `http://` only).
    raw_idle: Mutex<Vec<IdleRaw>>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").field("authority", &self.authority).finish_non_exhaustive()
    }
}

/// Why a request could not be exchanged.
#[derive(Debug)]
pub enum PoolError {
    /// No connection could be made (TCP or TLS).
    Connect(String),
    /// The exchange failed after a connection was made.
    Exchange(hyper::Error),
}

impl Pool {
    /// A pool for `authority`; `tls` is the client configuration of an
    /// `https://` upstream; the connect timeout, and how long bytes sent
    /// may stay unacknowledged (the route's upstream timeout).
    pub fn new(
        authority: Authority,
        tls: Option<rustls::ClientConfig>,
        (connect_timeout, stall_limit): (Duration, Duration),
        idle_timeout: Duration,
        max_idle: usize,
    ) -> Result<Arc<Pool>, String> {
        let default_port = if tls.is_some() { 443 } else { 80 };
        let host = authority.host();
        let addr = format!("{host}:{}", authority.port_u16().unwrap_or(default_port));
        let tls = match tls {
            Some(mut config) => {
                config.alpn_protocols = vec![b"http/1.1".to_vec()];
                let name = host.trim_start_matches('[').trim_end_matches(']').to_string();
                let server_name = rustls::pki_types::ServerName::try_from(name)
                    .map_err(|e| format!("{host} is not a valid TLS server name: {e}"))?;
                Some((tokio_rustls::TlsConnector::from(Arc::new(config)), server_name))
            }
            None => None,
        };
        let pool = Arc::new(Pool {
            authority,
            addr,
            tls,
            connect_timeout,
            stall_limit,
            idle_timeout,
            max_idle,
            idle: Mutex::new(Vec::new()),
            raw_idle: Mutex::new(Vec::new()),
        });
        // Close connections idle for longer than the idle timeout even when
        // the route sees no traffic.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let weak = Arc::downgrade(&pool);
            rt.spawn(reap(weak, idle_timeout));
        }
        Ok(pool)
    }

    /// The authority every request of this pool goes to.
    pub fn authority(&self) -> &Authority {
        &self.authority
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Idle>> {
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The most recently used live idle connection, if any.
    fn checkout(&self) -> Option<Sender> {
        let mut idle = self.lock();
        while let Some(entry) = idle.pop() {
            if entry.usable(self.idle_timeout) {
                return Some(entry.sender);
            }
        }
        None
    }

    fn checkin(&self, sender: Sender) {
        if sender.is_closed() {
            return;
        }
        let mut idle = self.lock();
        if idle.len() < self.max_idle {
            idle.push(Idle { sender, since: Instant::now() });
        }
    }

    fn expire(&self) {
        let timeout = self.idle_timeout;
        self.lock().retain(|e| e.usable(timeout));
        self.raw_idle.lock().unwrap_or_else(PoisonError::into_inner).retain(|e| e.since.elapsed() < timeout);
    }

    /// True for a plain-text (`http://`) upstream: the fast path may use it.
    pub fn is_plain(&self) -> bool {
        self.tls.is_none()
    }

    /// The most recently used raw connection that is still open (fast path).
    pub fn checkout_raw(&self) -> Option<TcpStream> {
        let mut idle = self.raw_idle.lock().unwrap_or_else(PoisonError::into_inner);
        while let Some(mut entry) = idle.pop() {
            if entry.since.elapsed() < self.idle_timeout && entry.stream.as_ref().is_some_and(still_open) {
                return entry.stream.take();
            }
        }
        None
    }

    /// Gives back a raw connection whose last exchange ended cleanly.
    pub fn checkin_raw(&self, stream: TcpStream) {
        let mut idle = self.raw_idle.lock().unwrap_or_else(PoisonError::into_inner);
        if idle.len() < self.max_idle {
            idle.push(IdleRaw { stream: Some(stream), since: Instant::now() });
        }
    }

    /// A new raw TCP connection to the upstream (fast path).
    pub async fn connect_raw(&self) -> Result<TcpStream, String> {
        tokio::time::timeout(self.connect_timeout, self.tcp()).await.unwrap_or_else(|_| Err(self.timed_out()))
    }

    /// A TCP connection to the upstream, `TCP_NODELAY` set, aborted (not
    /// closed) if the process dies with it open ([`super::sendq::abort_on_exit`]).
    async fn tcp(&self) -> Result<TcpStream, String> {
        let tcp = TcpStream::connect(&self.addr).await.map_err(|e| format!("{}: {e}", self.addr))?;
        let _ = tcp.set_nodelay(true);
        super::sendq::abort_on_exit(&tcp, self.stall_limit)
            .map_err(|e| format!("{}: setting SO_LINGER / TCP_USER_TIMEOUT: {e}", self.addr))?;
        Ok(tcp)
    }

    fn timed_out(&self) -> String {
        format!("connecting to {} timed out after {} ms", self.addr, self.connect_timeout.as_millis())
    }

    async fn connect(&self) -> Result<Sender, PoolError> {
        let connect = async {
            let wire = Wire::new();
            let tcp = WiredTcp::new(self.tcp().await?, wire.clone());
            let send = match &self.tls {
                None => handshake(TokioIo::new(tcp), &wire).await?,
                Some((connector, name)) => {
                    let stream = connector
                        .connect(name.clone(), tcp)
                        .await
                        .map_err(|e| format!("TLS handshake with {}: {e}", self.addr))?;
                    handshake(TokioIo::new(stream), &wire).await?
                }
            };
            Ok::<_, String>(Sender { send, wire })
        };
        match tokio::time::timeout(self.connect_timeout, connect).await {
            Ok(Ok(sender)) => Ok(sender),
            Ok(Err(e)) => Err(PoolError::Connect(e)),
            Err(_) => Err(PoolError::Connect(self.timed_out())),
        }
    }

    /// Sends `req` (origin-form URI, `Host` set) and returns the response
    /// head; the body streams, and gives the connection back at its end.
    /// `deadline`: the exchange's (the route's upstream timeout), past
    /// which nothing undelivered of the request may go.
    pub async fn send(
        self: &Arc<Self>,
        req: Request<FencedBody>,
        deadline: Instant,
    ) -> Result<Response<PooledBody>, PoolError> {
        let mut req = req;
        let mut retried = false;
        loop {
            let (mut sender, reused) = match self.checkout() {
                Some(s) => (s, true),
                // Boxed: the TLS handshake's future is large, and a pooled
                // connection (the common case) needs none of it.
                None => (Box::pin(self.connect()).await?, false),
            };
            // From here on, this request's gate decides each write of the
            // connection, and dropping the exchange cuts it.
            req.body().put_on(&sender.wire);
            let exchange = Exchange { wire: Some(sender.wire.clone()) };
            if sender.send.ready().await.is_err() {
                if reused {
                    continue;
                }
                return Err(PoolError::Connect(format!("{}: the connection closed at once", self.addr)));
            }
            match sender.send.try_send_request(req).await {
                Ok(resp) => {
                    let pool = Arc::downgrade(self);
                    let home = Some((sender, pool));
                    return Ok(resp.map(|inner| PooledBody { inner, home, exchange: Some(exchange), deadline }));
                }
                Err(mut e) => match e.take_message() {
                    // Never written: the pooled connection had been closed
                    // by the upstream. Once more on a new connection.
                    Some(back) if reused && !retried => {
                        retried = true;
                        req = back;
                    }
                    _ => return Err(PoolError::Exchange(e.into_error())),
                },
            }
        }
    }
}

/// An idle connection is still usable when reading from it would block: no
/// end of stream, no error, no stray bytes. Costs no system call unless the
/// runtime has seen the socket become readable.
fn still_open(stream: &TcpStream) -> bool {
    let mut probe = [0u8; 1];
    matches!(stream.try_read(&mut probe), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
}

async fn handshake<I>(io: I, wire: &Wire) -> Result<http1::SendRequest<FencedBody>, String>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (sender, conn) = http1::Builder::new().handshake(io).await.map_err(|e| format!("HTTP handshake: {e}"))?;
    let task = tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "upstream connection ended with an error");
        }
    });
    wire.set_task(task.abort_handle());
    Ok(sender)
}

async fn reap(pool: Weak<Pool>, every: Duration) {
    let every = every.max(Duration::from_secs(1));
    loop {
        tokio::time::sleep(every).await;
        match pool.upgrade() {
            Some(p) => p.expire(),
            None => return,
        }
    }
}

/// Keeps a connection whose request was answered before it was delivered
/// open until the upstream's kernel has acknowledged all of it (then it
/// closes cleanly), it is cut (a newer grant, the exchange's own deadline
/// task), or `deadline` passes (then what is left is dropped by a reset).
/// Asked every few milliseconds at first, then less often.
async fn deliver_or_cut(sender: Sender, deadline: Instant) {
    let mut every = Duration::from_millis(1);
    loop {
        if sender.wire.is_cut() || sender.wire.request_delivered() {
            return;
        }
        if Instant::now() >= deadline {
            sender.wire.cut();
            return;
        }
        tokio::time::sleep(every.min(deadline.saturating_duration_since(Instant::now()))).await;
        every = (every * 2).min(Duration::from_millis(50));
    }
}

/// An upstream response body that gives its connection back to the pool
/// once read to the end.
pub struct PooledBody {
    inner: Incoming,
    home: Option<(Sender, Weak<Pool>)>,
    /// Dropped (cutting the connection) unless the response ends cleanly
    /// with its request handed over whole.
    exchange: Option<Exchange>,
    /// The exchange's deadline: what is undelivered then is dropped.
    deadline: Instant,
}

impl PooledBody {
    fn go_home(&mut self) {
        let Some((sender, pool)) = self.home.take() else {
            return;
        };
        if let Some(exchange) = self.exchange.take() {
            exchange.finish();
        }
        // Answered before its request was delivered (the upstream answers
        // as it reads, or before it reads): the connection is not reused,
        // and it is kept open until the upstream's kernel has taken the
        // rest (a client told of a success must not see its write cut off
        // by the gateway closing the connection) or the deadline, which
        // drops what is left.
        if !sender.wire.request_delivered() {
            tokio::spawn(deliver_or_cut(sender, self.deadline));
            return;
        }
        sender.wire.carry(None);
        if let Some(pool) = pool.upgrade() {
            pool.checkin(sender);
        }
    }
}

impl Body for PooledBody {
    type Data = bytes::Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => self.go_home(),
            Poll::Ready(Some(Err(_))) => {
                self.home = None;
                self.exchange = None;
            }
            _ => {}
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

impl Drop for PooledBody {
    fn drop(&mut self) {
        // A body with nothing left (HEAD, 204, 304, or read to the end)
        // leaves a reusable connection; a half-read one does not.
        if self.inner.is_end_stream() {
            self.go_home();
        }
    }
}
