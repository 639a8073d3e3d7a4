//! The fast path of the plain-text proxy listener: HTTP/1.1 parsed once,
//! forwarded as head bytes with edits over a pooled raw TCP connection.
//!
//! It takes the common request only: HTTP/1.1, a `Host`, a body framed by
//! `Content-Length` (or none) within the route's limit, no
//! `Transfer-Encoding`, `Upgrade`, `Expect` but `100-continue`, or
//! hop-by-hop header besides `Connection: keep-alive|close`, headers within
//! the listener's limit, a
//! route that uses the embedded authority, needs no principal and forwards to
//! a plain `http://` upstream (on an S3 route, a request whose head names its
//! one resource: `Proxy::fast_route`), and a request the fence check admits. The
//! check is the general path's own ([`Proxy::admit`], around
//! [`FenceTable::admit`](crate::fence::FenceTable::admit), the one atomic
//! compare-and-register), made before a byte goes upstream.
//!
//! The phases, in order: the head (within the header read timeout), the
//! route and key, the whole body (small, within the route's timeout), the
//! admission, the exchange with the upstream, the relay of its answer. A
//! body larger than [`MAX_FAST_BODY`], or one whose client waits for
//! `100 Continue`, is not read before the admission: admitted on the head
//! (as the general path admits an upload), it streams upstream as it comes
//! in the exchange, every write under the upload's gate, in this one task
//! (one read, one write: no hand-off between tasks per piece).
//! Everything else — and every refusal of the admission — is handed over
//! with the bytes read so far to the general path (hyper,
//! [`super::Proxy::handle`]), which decides it afresh and serves the rest of
//! the connection. So the fast path forwards only what the general path
//! would forward, and answers the forwarding failures (timeout, connect,
//! exchange, a fence that moved before the body was sent) with the same
//! errors and metrics. It refuses by itself only what hyper would never
//! show the general path: a request-target with a `#` fragment (400,
//! before routing).

use std::time::Duration;

use bytes::{Buf, BytesMut};
use http::{Method, StatusCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::headers::SECOND_TARGETS;
use super::pool::Pool;
use super::s3::tokens::X_FENCING_TOKENS;
use super::{path, AccessLine, Admit, FastRoute, Proxy, Route, METHOD_OVERRIDES};
use crate::config::HostHeader;
use crate::error::Error;
use crate::fence::token::parse_token_values;
use crate::fence::InflightGuard;
use crate::http1::conn::{read_head_bytes, send, write_response, ConnLimits, Deadline, Handover, Next};
use crate::http1::wire::{
    digits, parse_head, parse_response, push_decimal, push_header, push_list, reserve, ChunkScanner, Framing, Head,
    Parsed, RespHead, RespParsed, READ_RESERVE,
};
use crate::metrics::Outcome;
use crate::peer::Peer;
use crate::shutdown::Shutdown;

/// Largest request body the fast path reads whole before the admission;
/// larger ones are admitted on their head and streamed ([`Streamed`]).
pub const MAX_FAST_BODY: u64 = 64 * 1024;
/// The most of a streamed request body read from the client at a time
/// (and held per connection while it streams). Measured (docs/s3.md):
/// 64 KiB and 256 KiB relay 64 MiB PutObject to s3s-fs alike, 256 KiB is
/// ~1.2x as fast into a sink that takes bytes as fast as they come.
const STREAM_PIECE: usize = 256 * 1024;
/// The first piece of a streamed body; it doubles (up to
/// [`STREAM_PIECE`]) each time a read fills it, as hyper's read buffer
/// grows, so a client that trickles its body holds no more than this.
const STREAM_FIRST_PIECE: usize = 16 * 1024;
const MAX_RESPONSE_HEAD: usize = 64 * 1024;
/// Room for relaying a large response body; buffers grown past
/// [`SHRINK_ABOVE`] are given back after the request.
const RELAY_RESERVE: usize = 64 * 1024;
const SHRINK_ABOVE: usize = 128 * 1024;

/// Why forwarding failed after admission.
enum Failure {
    Connect(String),
    Exchange(String),
    /// The exchange broke after the whole request had been written (no
    /// answer, a malformed one, a reset): the upstream may still apply it.
    AfterSent(String),
    /// A newer fence arrived before the body was sent.
    Aborted,
    /// Cluster mode: the gateway's view stopped being current (its member
    /// deadline passed: paused, cut off) before the request was sent.
    NotCurrent,
    /// The route's upstream timeout passed before the request was sent.
    TimedOut,
    /// A streamed body ended (or broke) before its `Content-Length`: the
    /// upstream got a truncated request.
    ClientBroke,
}

/// A request body streamed upstream after its head (phase 5).
struct Streamed {
    /// Body bytes still to come from the client.
    remaining: u64,
    /// The client sent `Expect: 100-continue`: answered once the head has
    /// gone upstream (so a refused upload never sends its body).
    expect: bool,
    send_timeout: Duration,
    /// The upstream gave its final answer (in `rbuf`/`resp`) while the body
    /// was still streaming: `Some(true)` a success, after which the body
    /// went on to its end (the upstream reads on); `Some(false)` anything
    /// else, which ended the streaming.
    early: Option<bool>,
}

/// Per-connection buffers and deadlines, reused request after request.
struct Conn {
    buf: BytesMut,
    head: Head,
    out: Vec<u8>,
    rbuf: BytesMut,
    resp: RespHead,
    /// The header read timeout.
    head_deadline: Deadline,
    /// The route's upstream timeout (the body's arrival and the exchange).
    upstream_deadline: Deadline,
}

/// Serves a plain-text connection until it ends (`None`) or needs the
/// general path (`Some`).
pub async fn serve_conn(
    proxy: &Proxy,
    mut stream: TcpStream,
    client: &Peer,
    limits: ConnLimits,
    shutdown: &Shutdown,
) -> Option<Handover> {
    // One shutdown future for the connection's life (a new one per request
    // would register a new waiter each time).
    let stop = shutdown.wait();
    tokio::pin!(stop);
    let mut c = Conn {
        buf: BytesMut::with_capacity(READ_RESERVE),
        head: Head::default(),
        out: Vec::with_capacity(4096),
        rbuf: BytesMut::with_capacity(READ_RESERVE),
        resp: RespHead::default(),
        // Each request moves both to its own deadline (re-arming the timer
        // only for an earlier one); the header timeout is just a start.
        head_deadline: Deadline::new(Instant::now() + limits.header_read_timeout),
        upstream_deadline: Deadline::new(Instant::now() + limits.header_read_timeout),
    };
    loop {
        let next = serve_one(proxy, &mut stream, client, limits, &mut stop, &mut c).await;
        // Keep an idle connection small.
        if c.rbuf.capacity() > SHRINK_ABOVE {
            c.rbuf = BytesMut::with_capacity(READ_RESERVE);
        }
        if c.buf.is_empty() && c.buf.capacity() > SHRINK_ABOVE {
            c.buf = BytesMut::with_capacity(READ_RESERVE);
        }
        match next {
            // A stop closes a busy connection after its current response,
            // as hyper's graceful shutdown does.
            Next::KeepAlive if !shutdown.is_triggered() => {}
            Next::KeepAlive | Next::Close => {
                let _ = stream.shutdown().await;
                return None;
            }
            Next::Gone => return None,
            Next::General => return Some(Handover { stream, buffered: c.buf }),
        }
    }
}

async fn serve_one(
    proxy: &Proxy,
    stream: &mut TcpStream,
    client: &Peer,
    limits: ConnLimits,
    stop: &mut std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
    c: &mut Conn,
) -> Next {
    // 1. The head, within the header read timeout (which also bounds an
    //    idle keep-alive connection, as on the general path).
    if let Some(end) = read_request_head(proxy, stream, limits, stop, c).await {
        return end;
    }
    let started = Instant::now();

    // 2. Route; anything the fast path does not take goes to the general path.
    let checked = match checked_target(&c.buf, &c.head) {
        Ok(Some(checked)) => checked,
        Ok(None) => return Next::General,
        Err(error) => {
            // Refused before routing; an S3 route's refusals still speak S3.
            let target = String::from_utf8_lossy(&c.buf[c.head.target.clone()]);
            let response = if proxy.selects_s3(&target) { error.into_s3_response() } else { error.into_response() };
            return write_response(stream, response, false, true, &mut c.out, limits.send_timeout).await;
        }
    };
    let Some(Taken { route, key, method, mutation, s3, pool, prefix, upstream_host, log, streamed }) =
        take(proxy, c, &checked)
    else {
        return Next::General;
    };
    let head_request = method == Method::HEAD;
    let head = &c.head;

    // 3. A small body whole before the admission; a streamed one's bytes
    //    read with the head go with it, the rest in phase 5.
    let body_len = usize::try_from(head.content_length).unwrap_or(usize::MAX);
    let need = head.len + if streamed { body_len.min(c.buf.len() - head.len) } else { body_len };
    let deadline = started + route.upstream_timeout;
    c.upstream_deadline.set(deadline);
    if !streamed {
        if let Some(end) = read_small_body(stream, c, need).await {
            return end;
        }
    }
    let head = &c.head;

    // 4. Admission: the general path's own decision; any outcome but
    //    "forward" goes to the general path, which decides afresh.
    let parsed = parse_token_values(head.token.clone().map(|r| &c.buf[r]));
    let token = parsed.as_ref().ok().copied().flatten();
    // Sequenced requests never come here (see `wire::parse_head`).
    // S3 routes judge no read by its token (the general path's rule).
    let judged = if s3 && !mutation { Ok(None) } else { parsed };
    let guard: Option<InflightGuard> = match proxy.admit(route, &key, mutation, judged, Ok(None)) {
        Admit::Forward(guard) => guard,
        _ => return Next::General,
    };

    // 5. The upstream request: the head with this hop's edits, then the body.
    let upstream_host = match (route.host_header, upstream_host) {
        (HostHeader::Rewrite, Some(up)) => Some(up.as_bytes()),
        _ => None,
    };
    encode_upstream_request(&c.buf, head, need, prefix, upstream_host, client, route.forward_token, &mut c.out);
    let client_close = head.close;
    let mut body = streamed.then(|| Streamed {
        remaining: head.content_length - (need - head.len) as u64,
        expect: head.expect_continue,
        send_timeout: limits.send_timeout,
        early: None,
    });

    let sent = c
        .upstream_deadline
        .within(exchange(
            pool,
            &c.out,
            guard.as_ref(),
            proxy.fences(),
            deadline,
            head_request,
            &mut c.rbuf,
            &mut c.resp,
            body.as_mut().map(|b| (&mut *stream, b)),
        ))
        .await;
    // Admission took well under a microsecond: the request's start is the
    // upstream exchange's start too (one clock read less per request).
    let elapsed = started.elapsed().as_secs_f64();
    route.upstream_duration.observe(elapsed);
    // Answered while its body streamed and then sent whole: the upstream
    // may read, and apply, the rest after answering, so the registration
    // stays until the route's deadline, and the connection open that long
    // (the rest may still be in the send queue; the pool's connections
    // close with a reset), then what is undelivered is dropped (the general
    // path's rule). Answered early and not sent whole (the upstream refused
    // it, or it was cut off): the upstream never gets it whole, nothing to
    // wait for.
    let early = body.as_ref().and_then(|b| b.early);
    let guard = match (early, guard, &sent) {
        (Some(true), Some(g), Some(Ok(up))) => {
            keep_open_until(deadline, g, up);
            None
        }
        (Some(_), _, _) => None,
        (None, g, _) => g,
    };
    // A streamed body not read to its end leaves the client's connection
    // mid-request: it is closed after the answer.
    let client_close = client_close || (streamed && !matches!(sent, Some(Ok(_))));
    // The upstream has answered (or failed): no longer in flight — unless
    // it answered before its kernel had taken the whole request.
    // On an S3 route a mutation stays in flight until its response body
    // ends (S3 answers `CopyObject` with 200 and applies it at the end of
    // the body: `held_body.rs`), or the deadline.
    let (guard, body_guard) = match &sent {
        Some(Ok(up)) if s3 && mutation && super::sendq::delivered(up) => (None, guard),
        _ => (guard, None),
    };
    let held = hold_if_undelivered(guard, &sent, deadline);
    c.buf.advance(need);
    let upstream = match sent {
        Some(Ok(up)) => up,
        failed => {
            let failure = failed.map(|r| r.err());
            // The client's own broken body is not a mutation's outcome (as
            // on the general path).
            let counted = mutation && !matches!(failure, Some(Some(Failure::ClientBroke)));
            let error = forward_failure(proxy, route, &key, token, failure);
            let seen = Admitted { client, method: &method, route, key: &key, started, log };
            return reply_error(&seen, counted, error, stream, client_close, limits.send_timeout).await;
        }
    };
    if mutation {
        route.mutations.inc(Outcome::Forwarded);
    }
    route.request_duration.observe(elapsed);
    if let Some(access) = &log {
        let resp_bytes = match c.resp.length.clone() {
            Some((_, v)) => digits(&c.rbuf[v]).unwrap_or(0),
            None => 0,
        };
        let seen = Admitted { client, method: &method, route, key: &key, started, log: None };
        access.write(&seen, c.resp.status, "ok", resp_bytes);
    }

    // 6. The response: its head with this hop's edits, then the body as it comes.
    if early == Some(false) {
        // The streaming ended with this answer: the upstream has a
        // truncated request (the rest of it is dropped by a reset when the
        // connection goes), the client an unread rest (its connection is
        // closed after the answer).
        let _ = upstream.set_zero_linger();
        return relay_response(stream, upstream, None, true, c, limits.send_timeout).await;
    }
    let pool = (!held && early.is_none()).then_some(&**pool);
    let Some(body_guard) = body_guard else {
        return relay_response(stream, upstream, pool, client_close, c, limits.send_timeout).await;
    };
    let relayed =
        tokio::time::timeout_at(deadline, relay_response(stream, upstream, pool, client_close, c, limits.send_timeout))
            .await;
    match relayed {
        // The body was relayed to its end: applied.
        Ok(next @ (Next::KeepAlive | Next::Close)) => {
            drop(body_guard);
            next
        }
        // Cut short (the client stopped reading, the upstream broke): the
        // upstream may still apply it, so it stays in flight until the
        // deadline.
        Ok(next) => {
            super::hold_until(deadline, body_guard);
            next
        }
        // The deadline: the response is cut off with a reset (a FIN could
        // end a close-delimited body as if it were whole).
        Err(_) => {
            let _ = stream.set_zero_linger();
            drop(body_guard);
            Next::Gone
        }
    }
}

/// A fenced request answered before the upstream's kernel had acknowledged
/// all of it (the upstream answers on the head and reads on, or not at
/// all): the rest, still in the gateway's send queue, may be applied after
/// the answer. Its registration is kept until the route's upstream
/// deadline, as for an early answer on the general path; then whatever is
/// still undelivered is dropped by a reset. A second descriptor keeps the
/// socket open until then (closing the first does not send a FIN); true
/// when held (the connection is not reused).
fn hold_if_undelivered(
    guard: Option<InflightGuard>,
    sent: &Option<Result<TcpStream, Failure>>,
    deadline: Instant,
) -> bool {
    let Some(guard) = guard else { return false };
    let upstream = match sent {
        Some(Ok(upstream)) => upstream,
        // Written whole, then no answer (a reset, a close, a malformed
        // head): the upstream may still apply it until the deadline.
        Some(Err(Failure::AfterSent(_))) => {
            super::hold_until(deadline, guard);
            return true;
        }
        _ => return false,
    };
    if super::sendq::delivered(upstream) {
        return false;
    }
    keep_open_until(deadline, guard, upstream);
    true
}

/// Keeps `upstream` open (a second descriptor) and `guard` registered
/// until `deadline`, then drops by a reset whatever the upstream's kernel
/// has still not acknowledged.
fn keep_open_until(deadline: Instant, guard: InflightGuard, upstream: &TcpStream) {
    let fd = match std::os::fd::AsFd::as_fd(upstream).try_clone_to_owned() {
        Ok(fd) => fd,
        Err(e) => {
            // Cannot keep the socket: drop what it holds now instead.
            tracing::debug!(error = %e, "could not keep an undelivered upstream connection");
            super::sendq::reset(upstream);
            super::hold_until(deadline, guard);
            return;
        }
    };
    tokio::spawn(async move {
        tokio::time::sleep_until(deadline).await;
        if !super::sendq::delivered(&fd) {
            super::sendq::reset(&fd);
        }
        drop(guard);
    });
}

/// An upstream connection a request was written to: reset when dropped
/// (a failed or timed-out exchange) if the upstream's kernel has not
/// acknowledged all of it, so the kernel drops the rest instead of
/// delivering it after the failure, and after a newer grant.
struct Unanswered(Option<TcpStream>);

impl Unanswered {
    fn answered(&mut self) -> Option<TcpStream> {
        self.0.take()
    }
    fn get(&mut self) -> Option<&mut TcpStream> {
        self.0.as_mut()
    }
}

impl Drop for Unanswered {
    fn drop(&mut self) {
        if let Some(upstream) = &self.0 {
            if !super::sendq::delivered(upstream) {
                super::sendq::reset(upstream);
            }
        }
    }
}

/// What phase 2 decided the fast path takes.
struct Taken<'p, 'c> {
    route: &'p Route,
    key: std::borrow::Cow<'c, str>,
    method: Method,
    mutation: bool,
    /// An S3 route: a read is not judged by its token.
    s3: bool,
    pool: &'p std::sync::Arc<Pool>,
    prefix: &'p str,
    upstream_host: Option<&'p http::HeaderValue>,
    log: Option<Access>,
    /// The body is admitted on the head and streamed ([`Streamed`]).
    streamed: bool,
}

/// Phase 2's first half: the request-target's path, checked. `Ok(None)`:
/// the general path decides (not UTF-8, not a valid path and query, a
/// path the check refuses: it refuses in the language of its route).
/// `Err`: a fragment, which only this path can see (below).
fn checked_target(buf: &[u8], head: &Head) -> Result<Option<path::CheckedPath>, Error> {
    if buf[head.target.clone()].contains(&b'#') {
        // A fragment has no place in an origin-form request-target (RFC
        // 9112 3.2.1). Upstreams that drop it would write another key than
        // the one fenced here; the general path's parser drops it before
        // the key is made, so only this path can see it: refuse here.
        return Err(Error::BadRequest("path refused: a request-target may not carry a fragment (\"#\")".into()));
    }
    let Ok(target) = std::str::from_utf8(&buf[head.target.clone()]) else { return Ok(None) };
    if http::uri::PathAndQuery::try_from(target).is_err() {
        return Ok(None);
    }
    Ok(path::check_path(path_of(target)).ok())
}

/// The path of a request-target (without its query).
fn path_of(target: &str) -> &str {
    target.split_once('?').map_or(target, |(p, _)| p)
}

/// Phase 2's second half: the route and key, and whether the fast path
/// takes the request. `None`: the general path serves it.
fn take<'p, 'c>(proxy: &'p Proxy, c: &Conn, checked: &'c path::CheckedPath) -> Option<Taken<'p, 'c>> {
    let head = &c.head;
    let target = std::str::from_utf8(&c.buf[head.target.clone()]).ok()?;
    let path_only = path_of(target);
    let method = Method::from_bytes(&c.buf[head.method.clone()]).ok()?;
    let host = &c.buf[head.host.clone()?];
    // An S3 route classifies from the headers it judges, as they came.
    let s3_headers = || {
        let mut h = http::HeaderMap::new();
        h.insert(http::header::HOST, http::HeaderValue::from_bytes(host).ok()?);
        for (n, v) in &head.forward {
            let name = &c.buf[n.clone()];
            if let Some(j) = super::s3::JUDGED_HEADERS.iter().find(|j| name.eq_ignore_ascii_case(j.as_str().as_bytes()))
            {
                h.append(j.clone(), http::HeaderValue::from_bytes(&c.buf[v.clone()]).ok()?);
            }
        }
        Some(h)
    };
    let FastRoute { route, key, mutation, s3 } = proxy.fast_route(target, path_only, &method, s3_headers, checked)?;
    // A header name with an underscore may be an alias of one of ours
    // (`headers::underscore_alias`): the general path decides. So it does
    // per-resource tokens (`X-Fencing-Tokens`, S3 routes) and a second
    // target (`Destination`: `headers::second_target`).
    if head.forward.iter().any(|(n, _)| {
        let name = &c.buf[n.clone()];
        name.contains(&b'_')
            || name.eq_ignore_ascii_case(X_FENCING_TOKENS.as_bytes())
            || SECOND_TARGETS.iter().any(|t| name.eq_ignore_ascii_case(t.as_bytes()))
    }) {
        return None;
    }
    // A read carrying a method override is judged by the general path
    // (`Route::is_mutation_request`).
    if !mutation
        && head
            .forward
            .iter()
            .any(|(n, _)| METHOD_OVERRIDES.iter().any(|o| c.buf[n.clone()].eq_ignore_ascii_case(o.as_bytes())))
    {
        return None;
    }
    let (pool, prefix, upstream_host) = route.upstream.plain_http()?;
    if route.auth || route.policy.external || head.content_length > route.max_body_bytes {
        return None;
    }
    let streamed = head.content_length > MAX_FAST_BODY || (head.expect_continue && head.content_length > 0);
    // The access log's fields are gathered only when it is on.
    let log = tracing::enabled!(target: "fencegate::access", tracing::Level::INFO)
        .then(|| Access { path: path_only.to_string(), req_bytes: head.content_length });
    Some(Taken { route, key, method, mutation, s3, pool, prefix, upstream_host, log, streamed })
}

/// Phase 6: the response head with this hop's edits, then the body as it
/// comes; the upstream connection goes back to the pool if it is clean.
async fn relay_response(
    stream: &mut TcpStream,
    mut upstream: TcpStream,
    pool: Option<&Pool>,
    client_close: bool,
    c: &mut Conn,
    send_timeout: Duration,
) -> Next {
    let resp = &c.resp;
    let framing = resp.framing.unwrap_or(Framing::Close);
    let close = client_close || framing == Framing::Close;
    encode_response_head(&c.rbuf, resp, framing, close, &mut c.out);
    let reusable = resp.reusable;
    let body_start = resp.len;
    match relay(stream, &mut upstream, framing, &mut c.out, &mut c.rbuf, body_start, send_timeout).await {
        Relayed::Done { upstream_clean } => {
            if let Some(pool) = pool.filter(|_| reusable && upstream_clean) {
                pool.checkin_raw(upstream);
            }
        }
        // Cut short (the upstream failed mid-body, the client stalled).
        // A close-delimited response ends with a reset: a FIN would end it
        // as if it were whole. Other framings tell a short body themselves,
        // and a FIN lets the client have what its socket already holds.
        Relayed::Broken => {
            if framing == Framing::Close {
                let _ = stream.set_zero_linger();
            }
            return Next::Gone;
        }
    }
    if close {
        Next::Close
    } else {
        Next::KeepAlive
    }
}

/// Phase 1: reads until a whole request head is parsed into `c.head`.
/// `Some`: how the connection goes on instead — handed over (also a
/// `Connection` naming a fencing header: the general path refuses it in
/// the language of its route), gone, or closed after a malformed head.
async fn read_request_head(
    proxy: &Proxy,
    stream: &mut TcpStream,
    limits: ConnLimits,
    stop: &mut std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
    c: &mut Conn,
) -> Option<Next> {
    c.head_deadline.set(Instant::now() + limits.header_read_timeout);
    loop {
        if !c.buf.is_empty() {
            match parse_head(&c.buf, limits.max_header_bytes, &mut c.head) {
                Parsed::Complete => return None,
                Parsed::General => return Some(Next::General),
                Parsed::Malformed(e) => {
                    // An S3 route's refusals speak S3, this one too (an
                    // outside review saw JSON for a malformed length).
                    let s3 = request_line_target(&c.buf).is_some_and(|t| proxy.selects_s3(t));
                    let response = if s3 { e.into_s3_response() } else { e.into_response() };
                    return Some(write_response(stream, response, false, true, &mut c.out, limits.send_timeout).await);
                }
                Parsed::Partial => {}
            }
        }
        if let Some(end) = read_head_bytes(stream, &mut c.buf, &mut c.head_deadline, stop).await {
            return Some(end);
        }
    }
}

/// The request-target of a head's request line, when it has one (a head
/// refused as malformed may still name its route).
fn request_line_target(buf: &[u8]) -> Option<&str> {
    let line = buf.split(|b| *b == b'\n').next()?;
    std::str::from_utf8(line.split(|b| *b == b' ').nth(1)?).ok()
}

/// Phase 3: reads the rest of a small body (`need` bytes of head and body
/// in all) within [`SMALL_BODY_WAIT`] and the route's timeout. A slow body
/// goes to the general path, which reads the rest and decides.
async fn read_small_body(stream: &mut TcpStream, c: &mut Conn, need: usize) -> Option<Next> {
    if c.buf.len() >= need {
        return None;
    }
    let give_up = Instant::now() + SMALL_BODY_WAIT;
    while c.buf.len() < need {
        reserve(&mut c.buf);
        match tokio::time::timeout_at(give_up, c.upstream_deadline.within(stream.read_buf(&mut c.buf))).await {
            Ok(Some(Ok(n))) if n > 0 => {}
            Ok(Some(_)) => return Some(Next::Gone),
            Ok(None) | Err(_) => return Some(Next::General),
        }
    }
    None
}

/// How long the fast path waits for the rest of a small body after its
/// head before it hands the request to the general path. That path admits
/// on the head and streams the body under the upload's gate, so a newer
/// grant cuts a slow upload (409 at once) where the fast path, which
/// admits only a whole request, would have waited for the body or the
/// route's upstream timeout. A small body on a live connection comes in
/// well under this.
const SMALL_BODY_WAIT: Duration = Duration::from_millis(250);

/// Phase 5: the upstream request into `out` — the request line with the
/// route's prefix, the forwarded headers, this hop's `Host` (the
/// upstream's when the route rewrites it), `X-Forwarded-*`, `Via`, the
/// token when the route forwards it, then the body (`buf[head.len..need]`).
#[allow(clippy::too_many_arguments)]
fn encode_upstream_request(
    buf: &[u8],
    head: &Head,
    need: usize,
    prefix: &str,
    upstream_host: Option<&[u8]>,
    client: &Peer,
    forward_token: bool,
    out: &mut Vec<u8>,
) {
    out.clear();
    out.extend_from_slice(&buf[head.method.clone()]);
    out.push(b' ');
    out.extend_from_slice(prefix.as_bytes());
    out.extend_from_slice(&buf[head.target.clone()]);
    out.extend_from_slice(b" HTTP/1.1\r\n");
    for (name, value) in &head.forward {
        push_header(out, &buf[name.clone()], &buf[value.clone()]);
    }
    let original_host = head.host.clone().map(|r| &buf[r]).unwrap_or_default();
    push_header(out, b"host", upstream_host.unwrap_or(original_host));
    push_list(out, b"x-forwarded-for", head.forwarded_for.clone().map(|r| &buf[r]), client.forwarded_for.as_bytes());
    push_header(out, b"x-forwarded-proto", b"http");
    push_header(out, b"x-forwarded-host", original_host);
    push_list(out, b"via", head.via.clone().map(|r| &buf[r]), b"1.1 fencegate");
    if forward_token {
        if let Some(r) = head.token.clone() {
            push_header(out, b"x-fencing-token", &buf[r]);
        }
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(&buf[head.len..need]);
}

/// The error and outcome of a forward that failed after admission
/// (`None`: the route's timeout passed), as the general path gives them.
fn forward_failure(
    proxy: &Proxy,
    route: &Route,
    key: &str,
    token: Option<u64>,
    failed: Option<Option<Failure>>,
) -> (Error, Outcome) {
    match failed {
        Some(Some(Failure::Connect(e))) => {
            tracing::warn!(route = %route.name, error = %e, "upstream connect failed");
            (Error::UpstreamUnavailable("could not connect to the upstream".into()), Outcome::UpstreamError)
        }
        Some(Some(Failure::Exchange(e) | Failure::AfterSent(e))) => {
            tracing::warn!(route = %route.name, error = %e, "upstream exchange failed");
            (Error::UpstreamUnavailable("the upstream exchange failed".into()), Outcome::UpstreamError)
        }
        Some(Some(Failure::Aborted)) => {
            proxy.metrics.aborted_uploads.with_label_values(&[&route.name]).inc();
            let (token, fence) = (token.unwrap_or(0), proxy.fences().fence(key));
            if fence <= token && !proxy.fences().is_current() {
                // Not a newer fence: the gateway stopped being current
                // (which aborts every unsent forward) after admitting it.
                return (
                    Error::NotCurrent("the gateway stopped being current before the request was sent upstream".into()),
                    Outcome::NotCurrent,
                );
            }
            (Error::StaleFencingToken { key: key.to_string(), token, fence }, Outcome::Stale)
        }
        Some(Some(Failure::NotCurrent)) => (
            Error::NotCurrent("the gateway stopped being current before the request was sent upstream".into()),
            Outcome::NotCurrent,
        ),
        Some(Some(Failure::ClientBroke)) => {
            (Error::BadRequest("the request body is malformed or ended early".into()), Outcome::UpstreamError)
        }
        Some(Some(Failure::TimedOut)) | Some(None) | None => {
            let timeout_ms = u64::try_from(route.upstream_timeout.as_millis()).unwrap_or(u64::MAX);
            (Error::UpstreamTimeout { timeout_ms }, Outcome::UpstreamError)
        }
    }
}

/// Phase 6: the response head for the client into `out` — status line
/// (the canonical reason when the upstream gave none), the forwarded
/// headers, framing, `Via`, `Connection: close` when closing.
fn encode_response_head(rbuf: &[u8], resp: &RespHead, framing: Framing, close: bool, out: &mut Vec<u8>) {
    out.clear();
    out.extend_from_slice(b"HTTP/1.1 ");
    let reason = &rbuf[resp.reason.clone()];
    let reason = if reason.is_empty() {
        StatusCode::from_u16(resp.status).ok().and_then(|s| s.canonical_reason()).unwrap_or("").as_bytes()
    } else {
        reason
    };
    push_decimal(out, usize::from(resp.status));
    out.push(b' ');
    out.extend_from_slice(reason);
    out.extend_from_slice(b"\r\n");
    for (name, value) in &resp.forward {
        push_header(out, &rbuf[name.clone()], &rbuf[value.clone()]);
    }
    if let Some((name, value)) = &resp.length {
        push_header(out, &rbuf[name.clone()], &rbuf[value.clone()]);
    }
    if framing == Framing::Chunked {
        push_header(out, b"transfer-encoding", b"chunked");
    }
    let via: &[u8] = if resp.http10 { b"1.0 fencegate" } else { b"1.1 fencegate" };
    push_list(out, b"via", resp.via.clone().map(|r| &rbuf[r]), via);
    if close {
        push_header(out, b"connection", b"close");
    }
    out.extend_from_slice(b"\r\n");
}

/// Why a request was not written whole.
enum Unsent {
    Refused(Failure),
    Io(std::io::Error),
}

/// Writes `request` whole. A fenced request's every write goes only while
/// it may: not cut off by a newer fence, the gateway current (a gateway
/// paused after admitting may have been counted out by its peers, and a
/// newer holder's write applied), the route's upstream deadline not
/// passed — checked right before each write, also when a slow upstream
/// makes the request go in several.
async fn write_gated(upstream: &TcpStream, mut request: &[u8], gate: Option<Gate<'_>>) -> Result<(), Unsent> {
    while !request.is_empty() {
        tokio::select! {
            biased;
            () = aborted(gate) => return Err(Unsent::Refused(Failure::Aborted)),
            ready = upstream.writable() => ready.map_err(Unsent::Io)?,
        }
        if let Some(refused) = gate_refuses(gate) {
            return Err(Unsent::Refused(refused));
        }
        match upstream.try_write(request) {
            Ok(0) => return Err(Unsent::Io(std::io::ErrorKind::WriteZero.into())),
            Ok(n) => request = &request[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(Unsent::Io(e)),
        }
    }
    Ok(())
}

/// What a fenced request's every write is checked against: its
/// registration (a newer fence aborts it), the gateway's currency, the
/// route's upstream deadline.
type Gate<'a> = (&'a InflightGuard, &'a crate::fence::FenceTable, Instant);

/// Why `gate` refuses a write now, if it does.
fn gate_refuses(gate: Option<Gate<'_>>) -> Option<Failure> {
    let (guard, fences, deadline) = gate?;
    if guard.ctl().is_aborted() {
        Some(Failure::Aborted)
    } else if !fences.is_current() {
        Some(Failure::NotCurrent)
    } else if Instant::now() >= deadline {
        Some(Failure::TimedOut)
    } else {
        None
    }
}

/// Ready once a newer fence aborted the gated request (the gateway
/// stopping being current aborts it too), so that a write waiting for the
/// upstream, or a body waiting for the client, is cut off at once and the
/// activation that aborted it does not wait for either. Never without a
/// gate.
async fn aborted(gate: Option<Gate<'_>>) {
    let Some((guard, _, _)) = gate else { return std::future::pending().await };
    std::future::poll_fn(|cx| {
        guard.ctl().register(cx.waker());
        if guard.ctl().is_aborted() {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
}

/// Phase 5: sends the request (a streamed body after its head, see
/// [`stream_body`]) and reads the response head into `rbuf` / `resp`.
#[allow(clippy::too_many_arguments)]
async fn exchange(
    pool: &Pool,
    request: &[u8],
    guard: Option<&InflightGuard>,
    fences: &crate::fence::FenceTable,
    deadline: Instant,
    head_request: bool,
    rbuf: &mut BytesMut,
    resp: &mut RespHead,
    mut body: Option<(&mut TcpStream, &mut Streamed)>,
) -> Result<TcpStream, Failure> {
    let gate = guard.map(|g| (g, fences, deadline));
    rbuf.clear();
    let mut retried = false;
    let mut upstream = loop {
        let (upstream, reused) = match pool.checkout_raw() {
            Some(s) => (s, true),
            None => (Box::pin(pool.connect_raw()).await.map_err(Failure::Connect)?, false),
        };
        match write_gated(&upstream, request, gate).await {
            Ok(()) => break Unanswered(Some(upstream)),
            Err(Unsent::Refused(failure)) => {
                // Reset: the kernel drops what it still holds of it.
                super::sendq::reset(&upstream);
                return Err(failure);
            }
            // The pooled connection had been closed by the upstream: once
            // more on a new one (nothing of it can have been applied).
            Err(Unsent::Io(_)) if reused && !retried => retried = true,
            Err(Unsent::Io(e)) => {
                super::sendq::reset(&upstream);
                return Err(Failure::Exchange(format!("writing the request: {e}")));
            }
        }
    };
    if let Some((client, body)) = body.as_mut() {
        let Some(tcp) = upstream.get() else { return Err(Failure::Exchange("the connection was lost".into())) };
        if body.expect && body.remaining > 0 {
            // The head went: the upload is admitted and on its way — unless
            // a newer fence came meanwhile (no `100 Continue` for a stale
            // writer), also while a client that reads nothing holds it.
            let continued = match gate_refuses(gate) {
                Some(refused) => Err(refused),
                None => tokio::select! {
                    biased;
                    () = aborted(gate) => Err(Failure::Aborted),
                    sent = send(client, b"HTTP/1.1 100 Continue\r\n\r\n", body.send_timeout) => {
                        sent.map_err(|_| Failure::ClientBroke)
                    }
                },
            };
            if let Err(failure) = continued {
                super::sendq::reset(&*tcp);
                return Err(failure);
            }
        }
        if let Err(unsent) = stream_body(tcp, client, body, gate, head_request, rbuf, resp).await {
            super::sendq::reset(&*tcp);
            return Err(match unsent {
                Unsent::Refused(failure) => failure,
                Unsent::Io(e) => Failure::Exchange(format!("writing the request: {e}")),
            });
        }
    }
    let early = body.and_then(|(_, b)| b.early);
    // An early refusal ended the body: not sent whole, so not done.
    if let (Some(g), false) = (guard, early == Some(false)) {
        g.ctl().mark_body_done();
    }
    if early.is_some() {
        // The answer is in `rbuf`/`resp` already.
        return upstream.answered().ok_or_else(|| Failure::Exchange("the connection was lost".into()));
    }
    read_response_head(&mut upstream, head_request, rbuf, resp).await.map_err(Failure::AfterSent)
}

/// Phase 5 of a streamed body: the rest of the client's body, read as it
/// comes (up to [`STREAM_PIECE`] at a time, never past its `Content-Length`) and
/// written upstream, every write under `gate` as in [`write_gated`]; a newer
/// fence cuts it off while it waits on either side. The upstream is watched
/// meanwhile: interim answers (`100 Continue` to a forwarded `Expect`) are
/// skipped; a final one is kept in `rbuf`/`resp` and ends the streaming,
/// unless it is a success: then the body goes on to its end (the upstream
/// reads on, and its success tells of a write only once it had all of it).
async fn stream_body(
    upstream: &TcpStream,
    client: &mut TcpStream,
    body: &mut Streamed,
    gate: Option<Gate<'_>>,
    head_request: bool,
    rbuf: &mut BytesMut,
    resp: &mut RespHead,
) -> Result<(), Unsent> {
    let mut piece = vec![0u8; usize::try_from(body.remaining).unwrap_or(usize::MAX).min(STREAM_FIRST_PIECE)];
    // `piece[sent..read]` is read from the client and not yet written.
    let (mut sent, mut read) = (0, 0);
    let mut filled = false;
    loop {
        if sent == read && body.remaining == 0 {
            return Ok(());
        }
        if filled && sent == read {
            piece.resize((piece.len() * 2).min(STREAM_PIECE), 0);
            filled = false;
        }
        let want = usize::try_from(body.remaining).unwrap_or(usize::MAX).min(piece.len());
        tokio::select! {
            biased;
            () = aborted(gate) => return Err(Unsent::Refused(Failure::Aborted)),
            ready = upstream.readable(), if body.early.is_none() => {
                ready.map_err(Unsent::Io)?;
                match answer_while_streaming(upstream, head_request, rbuf, resp)? {
                    Some(true) => body.early = Some(true),
                    Some(false) => {
                        body.early = Some(false);
                        return Ok(());
                    }
                    None => {}
                }
            }
            ready = upstream.writable(), if sent < read => {
                ready.map_err(Unsent::Io)?;
                if let Some(refused) = gate_refuses(gate) {
                    return Err(Unsent::Refused(refused));
                }
                match upstream.try_write(&piece[sent..read]) {
                    Ok(0) => return Err(Unsent::Io(std::io::ErrorKind::WriteZero.into())),
                    Ok(n) => sent += n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(Unsent::Io(e)),
                }
            }
            got = client.read(&mut piece[..want]), if sent == read && body.remaining > 0 => match got {
                Ok(n) if n > 0 => {
                    (sent, read) = (0, n);
                    body.remaining -= n as u64;
                    filled = n == piece.len() && n < STREAM_PIECE;
                }
                _ => return Err(Unsent::Refused(Failure::ClientBroke)),
            },
        }
    }
}

/// What the upstream said while the body streamed: `None` nothing final
/// yet (no bytes, part of a head, an interim answer skipped), `Some(ok)` a
/// final answer, parsed into `resp` (`ok`: a success). An end of stream, an
/// error or a head that cannot be one is a failed exchange: the upstream
/// had only part of the request.
fn answer_while_streaming(
    upstream: &TcpStream,
    head_request: bool,
    rbuf: &mut BytesMut,
    resp: &mut RespHead,
) -> Result<Option<bool>, Unsent> {
    let broke = |why: String| Unsent::Refused(Failure::Exchange(why));
    reserve(rbuf);
    match upstream.try_read_buf(rbuf) {
        Ok(0) => return Err(broke("the upstream closed the connection before it had the whole request".into())),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(None),
        Err(e) => return Err(broke(format!("reading the response: {e}"))),
    }
    match final_head(rbuf, head_request, resp) {
        Ok(true) => Ok(Some((200..300).contains(&resp.status))),
        Ok(false) => Ok(None),
        Err(why) => Err(broke(why)),
    }
}

/// Parses the upstream's final response head in `rbuf` into `resp`:
/// `Ok(true)` when it is there, `Ok(false)` when more bytes are needed.
/// Interim answers (`100 Continue` to a forwarded `Expect`, or unasked) are
/// skipped; a `101`, a head too large or one that does not parse is the
/// error.
fn final_head(rbuf: &mut BytesMut, head_request: bool, resp: &mut RespHead) -> Result<bool, String> {
    loop {
        if rbuf.is_empty() {
            return Ok(false);
        }
        match parse_response(rbuf, head_request, resp) {
            RespParsed::Complete if (100..200).contains(&resp.status) && resp.status != 101 => rbuf.advance(resp.len),
            RespParsed::Complete if resp.status == 101 => return Err("unexpected 101 Switching Protocols".into()),
            RespParsed::Complete => return Ok(true),
            RespParsed::Partial if rbuf.len() <= MAX_RESPONSE_HEAD => return Ok(false),
            RespParsed::Partial => return Err("response head too large".into()),
            RespParsed::Bad(why) => return Err(why.into()),
        }
    }
}

/// Reads the response head of a request written whole.
async fn read_response_head(
    upstream: &mut Unanswered,
    head_request: bool,
    rbuf: &mut BytesMut,
    resp: &mut RespHead,
) -> Result<TcpStream, String> {
    loop {
        if final_head(rbuf, head_request, resp)? {
            return upstream.answered().ok_or_else(|| "the connection was lost".into());
        }
        reserve(rbuf);
        let Some(tcp) = upstream.get() else {
            return Err("the connection was lost".into());
        };
        match tcp.read_buf(rbuf).await {
            Ok(0) => return Err("the upstream closed the connection before answering".into()),
            Ok(_) => {}
            Err(e) => return Err(format!("reading the response: {e}")),
        }
    }
}

enum Relayed {
    /// The client has the whole response; `upstream_clean`: the upstream
    /// connection is at a message boundary with nothing extra read.
    Done { upstream_clean: bool },
    /// Either side broke off: close the client connection.
    Broken,
}

/// Replaces `rbuf`'s contents with the upstream's next bytes; `None` on an
/// error, `Some(0)` at its end of stream.
async fn refill(upstream: &mut TcpStream, rbuf: &mut BytesMut) -> Option<usize> {
    rbuf.clear();
    reserve(rbuf);
    upstream.read_buf(rbuf).await.ok()
}

/// Writes the response head in `out`, then the body from `rbuf[body_start..]`
/// and the upstream, framed as `framing`.
async fn relay(
    client: &mut TcpStream,
    upstream: &mut TcpStream,
    framing: Framing,
    out: &mut Vec<u8>,
    rbuf: &mut BytesMut,
    body_start: usize,
    stall: Duration,
) -> Relayed {
    rbuf.advance(body_start);
    let large = match framing {
        Framing::Empty => false,
        Framing::Length(total) => total > (READ_RESERVE as u64),
        Framing::Chunked | Framing::Close => true,
    };
    if large {
        rbuf.reserve(RELAY_RESERVE);
    }
    match framing {
        Framing::Empty => {
            let clean = rbuf.is_empty();
            if send(client, out, stall).await.is_err() {
                return Relayed::Broken;
            }
            Relayed::Done { upstream_clean: clean }
        }
        Framing::Length(total) => {
            let first = usize::try_from(total).unwrap_or(usize::MAX).min(rbuf.len());
            out.extend_from_slice(&rbuf[..first]);
            let extra = rbuf.len() > first;
            if send(client, out, stall).await.is_err() {
                return Relayed::Broken;
            }
            let mut left = total - first as u64;
            while left > 0 {
                if refill(upstream, rbuf).await.is_none_or(|n| n == 0) {
                    return Relayed::Broken;
                }
                let take = usize::try_from(left).unwrap_or(usize::MAX).min(rbuf.len());
                if send(client, &rbuf[..take], stall).await.is_err() {
                    return Relayed::Broken;
                }
                left -= take as u64;
                if rbuf.len() > take {
                    return Relayed::Done { upstream_clean: false };
                }
            }
            Relayed::Done { upstream_clean: !extra }
        }
        Framing::Chunked => {
            let mut scanner = ChunkScanner::default();
            let mut pending_head = true;
            loop {
                let (take, done) = match scanner.feed(rbuf) {
                    Ok(Some(n)) => (n, true),
                    Ok(None) => (rbuf.len(), false),
                    Err(()) => return Relayed::Broken,
                };
                let written = if pending_head {
                    pending_head = false;
                    out.extend_from_slice(&rbuf[..take]);
                    send(client, out, stall).await
                } else {
                    send(client, &rbuf[..take], stall).await
                };
                if written.is_err() {
                    return Relayed::Broken;
                }
                if done {
                    return Relayed::Done { upstream_clean: rbuf.len() == take };
                }
                if refill(upstream, rbuf).await.is_none_or(|n| n == 0) {
                    return Relayed::Broken;
                }
            }
        }
        Framing::Close => {
            out.extend_from_slice(rbuf);
            if send(client, out, stall).await.is_err() {
                return Relayed::Broken;
            }
            loop {
                match refill(upstream, rbuf).await {
                    Some(0) => return Relayed::Done { upstream_clean: false },
                    Some(_) if send(client, rbuf, stall).await.is_ok() => {}
                    _ => return Relayed::Broken,
                }
            }
        }
    }
}

/// The access log's fields of a request, gathered only when it is on.
struct Access {
    path: String,
    req_bytes: u64,
}

/// What is known of a request once it was admitted.
struct Admitted<'a> {
    client: &'a Peer,
    method: &'a Method,
    route: &'a Route,
    key: &'a str,
    started: Instant,
    log: Option<Access>,
}

impl Access {
    /// The general path's access line.
    fn write(&self, seen: &Admitted<'_>, status: u16, outcome: &str, resp_bytes: u64) {
        AccessLine {
            client: seen.client,
            method: seen.method,
            path: &self.path,
            route: &seen.route.name,
            resource: seen.key,
            status,
            outcome,
            elapsed: seen.started.elapsed(),
            req_bytes: self.req_bytes,
            resp_bytes,
        }
        .write();
    }
}

/// Answers a forwarding failure with the general path's error and metrics.
async fn reply_error(
    seen: &Admitted<'_>,
    mutation: bool,
    (error, outcome): (Error, Outcome),
    stream: &mut TcpStream,
    close: bool,
    send_timeout: Duration,
) -> Next {
    let route = seen.route;
    if mutation {
        route.mutations.inc(outcome);
    }
    route.request_duration.observe(seen.started.elapsed().as_secs_f64());
    if let Some(access) = &seen.log {
        access.write(seen, error.status().as_u16(), error.code(), 0);
    }
    let head_request = *seen.method == Method::HEAD;
    // An S3 route's failures speak S3 XML, as on the general path.
    let response = if route.is_s3() { error.into_s3_response() } else { error.into_response() };
    write_response(stream, response, head_request, close, &mut Vec::new(), send_timeout).await
}
