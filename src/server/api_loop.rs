//! A small HTTP/1.1 server loop for the plain-text api listener: each
//! request is parsed once (httparse), read whole, handed to the listener's
//! [`Handler`] as an ordinary `http::Request` — the same handler the
//! general path calls, so every check, limit and error of the lease API is
//! the same — and its response written with one write.
//!
//! It takes the common request only: HTTP/1.1, a body framed by
//! `Content-Length` within the listener's body limit and 1 MiB (or none), no
//! `Transfer-Encoding`, `Upgrade` or `Expect`, `Connection` saying at most
//! `keep-alive` or `close`, headers within the listener's limit. Anything
//! else is handed, with the bytes read so far, to the general path (hyper)
//! for the rest of the connection. A client that hangs up while its request
//! waits (an acquire queued for a lock, a watch) drops the request's future,
//! as on the general path, so an abandoned waiter leaves the queue.

use bytes::{Buf, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Uri, Version};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::body::full;
use crate::error::Error;
use crate::http1::conn::{read_head_bytes, write_response, ConnLimits, Deadline, Handover, Next};
use crate::http1::wire::{range_in, reserve};
use crate::http1::{self, NotTaken};
use crate::peer::Peer;
use crate::server::Handler;
use crate::shutdown::Shutdown;

/// Bytes a client may send ahead (pipelined) while its request is served.
const MAX_AHEAD: usize = 64 * 1024;
/// Largest body this loop reads whole, whatever the listener's limit.
const MAX_BODY: u64 = 1024 * 1024;

/// One request head, checked and turned into `http` types.
struct Head {
    len: usize,
    method: Method,
    target: std::ops::Range<usize>,
    headers: Vec<(HeaderName, std::ops::Range<usize>)>,
    content_length: usize,
    close: bool,
}

enum Parsed {
    Complete(Head),
    Partial,
    /// Refused here, the connection closed ([`NotTaken::Malformed`]).
    Malformed(Error),
    General,
}

/// The shared rules of [`crate::http1::parse_request`], then names and the
/// method in `http` types and a body within `max_body` (and [`MAX_BODY`]).
/// A `Connection` naming a fencing header is hyper's to answer too.
fn parse_head(buf: &[u8], limits: ConnLimits, max_body: u64) -> Parsed {
    let mut headers = Vec::new();
    let line = http1::parse_request(buf, limits.max_header_bytes, |name, value| {
        let Ok(name) = HeaderName::from_bytes(name) else { return false };
        headers.push((name, range_in(buf, value)));
        true
    });
    let line = match line {
        Ok(line) => line,
        Err(NotTaken::Partial) => return Parsed::Partial,
        Err(NotTaken::Malformed(e)) => return Parsed::Malformed(e),
        Err(NotTaken::FencingHopByHop | NotTaken::General) => return Parsed::General,
    };
    let Ok(method) = Method::from_bytes(line.method.as_bytes()) else { return Parsed::General };
    // `100 Continue` is hyper's to send here.
    if line.content_length > max_body.min(MAX_BODY) || line.expect_continue {
        return Parsed::General;
    }
    Parsed::Complete(Head {
        len: line.len,
        method,
        target: range_in(buf, line.target.as_bytes()),
        headers,
        content_length: usize::try_from(line.content_length).unwrap_or(usize::MAX),
        close: line.close,
    })
}

/// Serves a plain-text api connection until it ends (`None`) or needs the
/// general path (`Some`).
pub async fn serve_conn(
    handler: &Handler,
    mut stream: TcpStream,
    client: &Peer,
    limits: ConnLimits,
    max_body: u64,
    shutdown: &Shutdown,
) -> Option<Handover> {
    let stop = shutdown.wait();
    tokio::pin!(stop);
    let mut buf = BytesMut::with_capacity(8 * 1024);
    let mut out = Vec::with_capacity(1024);
    let mut deadline = Deadline::new(Instant::now() + limits.header_read_timeout);
    loop {
        match serve_one(handler, &mut stream, client, limits, max_body, &mut stop, &mut buf, &mut out, &mut deadline)
            .await
        {
            // A stop closes a busy connection after its current response.
            Next::KeepAlive if !shutdown.is_triggered() => {}
            Next::KeepAlive | Next::Close => {
                let _ = stream.shutdown().await;
                return None;
            }
            Next::Gone => return None,
            Next::General => return Some(Handover { stream, buffered: buf }),
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn serve_one(
    handler: &Handler,
    stream: &mut TcpStream,
    client: &Peer,
    limits: ConnLimits,
    max_body: u64,
    stop: &mut std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
    buf: &mut BytesMut,
    out: &mut Vec<u8>,
    deadline: &mut Deadline,
) -> Next {
    // 1. The head, within the header read timeout (which also bounds an
    //    idle keep-alive connection, as on the general path).
    deadline.set(Instant::now() + limits.header_read_timeout);
    let head = loop {
        if !buf.is_empty() {
            match parse_head(buf, limits, max_body) {
                Parsed::Complete(head) => break head,
                Parsed::General => return Next::General,
                Parsed::Malformed(e) => {
                    return write_response(stream, e.into_response(), false, true, out, limits.send_timeout).await
                }
                Parsed::Partial => {}
            }
        }
        if let Some(end) = read_head_bytes(stream, buf, deadline, stop).await {
            return end;
        }
    };
    // 2. The body (within the limit checked above), under one deadline for
    //    the whole of it: a client that trickles it is answered 408 and
    //    closed, never handed on (the general path would wait for it anew).
    let need = head.len.saturating_add(head.content_length);
    if buf.len() < need {
        deadline.set(Instant::now() + limits.body_read_timeout);
    }
    while buf.len() < need {
        reserve(buf);
        match deadline.within(stream.read_buf(buf)).await {
            Some(Ok(n)) if n > 0 => {}
            Some(_) => return Next::Gone,
            None => {
                let timeout_ms = u64::try_from(limits.body_read_timeout.as_millis()).unwrap_or(u64::MAX);
                let late = Error::BodyTimeout { timeout_ms }.into_response();
                return write_response(stream, late, false, true, out, limits.send_timeout).await;
            }
        }
    }
    // 3. The request in `http` types, sharing one copy of its bytes.
    let bytes = Bytes::copy_from_slice(&buf[..need]);
    let Ok(uri) = Uri::from_maybe_shared(bytes.slice(head.target.clone())) else { return Next::General };
    let mut headers = HeaderMap::with_capacity(head.headers.len());
    for (name, value) in head.headers {
        let Ok(value) = HeaderValue::from_maybe_shared(bytes.slice(value)) else { return Next::General };
        headers.append(name, value);
    }
    buf.advance(need);
    let head_request = head.method == Method::HEAD;
    let close = head.close;
    let mut req = Request::new(full(bytes.slice(head.len..need)));
    *req.method_mut() = head.method;
    *req.uri_mut() = uri;
    *req.version_mut() = Version::HTTP_11;
    *req.headers_mut() = headers;

    // 4. The handler; a client that hangs up meanwhile drops its future.
    let mut fut = handler(req, client.clone());
    let resp = loop {
        reserve(buf);
        tokio::select! {
            biased;
            r = &mut fut => break r,
            n = stream.read_buf(buf), if buf.len() < MAX_AHEAD => match n {
                Ok(n) if n > 0 => {}
                _ => return Next::Gone,
            },
        }
    };
    drop(fut);

    // 5. The response in one write.
    write_response(stream, resp, head_request, close, out, limits.send_timeout).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const LIMITS: ConnLimits = ConnLimits {
        max_header_bytes: 1024,
        header_read_timeout: Duration::from_secs(1),
        body_read_timeout: Duration::from_secs(1),
        send_timeout: Duration::from_secs(1),
    };

    #[test]
    fn plain_requests_are_taken_and_others_handed_over() {
        let raw = b"POST /v1/locks/renew HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\n{}";
        let Parsed::Complete(h) = parse_head(raw, LIMITS, 100) else { panic!("not taken") };
        assert_eq!((h.method, h.content_length, h.close, h.headers.len()), (Method::POST, 2, false, 3));
        assert_eq!(&raw[h.target], b"/v1/locks/renew");
        for raw in [
            &b"POST /x HTTP/1.0\r\n\r\n"[..],
            b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"POST /x HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n",
            b"POST /x HTTP/1.1\r\nContent-Length: 101\r\n\r\n",
            b"POST /x HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n",
            b"GET /x HTTP/1.1\r\nConnection: upgrade\r\nUpgrade: h2c\r\n\r\n",
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        ] {
            assert!(matches!(parse_head(raw, LIMITS, 100), Parsed::General), "{:?}", String::from_utf8_lossy(raw));
        }
        for raw in [
            &b"POST /x HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n"[..],
            b"POST /x HTTP/1.1\r\nTransfer-Encoding: identity\r\n\r\n",
            b"POST /x HTTP/1.1\r\nHost : a\r\n\r\n",
        ] {
            assert!(matches!(parse_head(raw, LIMITS, 100), Parsed::Malformed(_)), "{:?}", String::from_utf8_lossy(raw));
        }
        assert!(matches!(parse_head(b"GET /x HTTP/1.1\r\nHost: a\r\n", LIMITS, 100), Parsed::Partial));
    }
}
