//! The connection-level pieces both HTTP/1.1 loops share (the proxy's fast
//! path and the api listener's loop): handing a connection over to hyper,
//! the listener limits they apply themselves, one timer per deadline kind
//! per connection, reading head bytes, writing a response made here.

use std::time::Duration;

use bytes::BytesMut;
use http_body_util::BodyExt;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::wire::{encode_response, reserve};

/// A connection the fast path hands to the general path: the stream and
/// every byte read from it that no response has consumed yet.
pub struct Handover {
    pub stream: TcpStream,
    pub buffered: BytesMut,
}

/// The listener limits the fast path applies itself.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    pub max_header_bytes: usize,
    pub header_read_timeout: Duration,
    /// The api fast loop's deadline for a whole request body.
    pub body_read_timeout: Duration,
    /// How long a response may wait on a client that takes none of it
    /// (the listener's `idle_timeout_ms`; see [`send`]).
    pub send_timeout: Duration,
}

/// How a request on a connection of one of these loops ended.
pub(crate) enum Next {
    KeepAlive,
    /// Finish the connection cleanly.
    Close,
    /// The connection is broken or timed out.
    Gone,
    General,
}

/// A connection's deadline of one kind (reading a head, an upstream
/// exchange), moved request after request without a timer operation per
/// request. A new or reset timer wakes the runtime's I/O driver (a system
/// call) whenever no timer was pending when the driver last parked, which
/// under load was almost every request. So one timer is armed for the
/// connection's life; a later deadline only moves a field, and when the
/// timer fires early it is re-armed for the current deadline: one timer
/// operation per timeout period, not per request.
pub(crate) struct Deadline {
    timer: std::pin::Pin<Box<tokio::time::Sleep>>,
    at: Instant,
}

impl Deadline {
    pub(crate) fn new(at: Instant) -> Deadline {
        Deadline { timer: Box::pin(tokio::time::sleep_until(at)), at }
    }

    /// Moves the deadline. Only a deadline earlier than the armed timer
    /// (a route with a shorter timeout) re-arms it now.
    pub(crate) fn set(&mut self, at: Instant) {
        if at < self.timer.deadline() {
            self.timer.as_mut().reset(at);
        }
        self.at = at;
    }

    /// Resolves once the current deadline has passed.
    pub(crate) async fn passed(&mut self) {
        loop {
            self.timer.as_mut().await;
            if Instant::now() >= self.at {
                return;
            }
            self.timer.as_mut().reset(self.at);
        }
    }

    /// `fut`, unless the deadline passes first (`None`). The timer is
    /// polled outside the task's cooperative budget: a peer that keeps
    /// `fut` busy (an upstream flooding `102 Processing`) exhausts the
    /// budget on every poll, and a budgeted timer would then never fire.
    pub(crate) async fn within<T>(&mut self, fut: impl std::future::Future<Output = T>) -> Option<T> {
        tokio::select! {
            biased;
            r = fut => Some(r),
            () = tokio::task::unconstrained(self.passed()) => None,
        }
    }
}

/// Reads more bytes of a request head before the deadline. While nothing
/// of a request has arrived the connection is idle, and a stop closes it.
/// `Some`: how the connection ends instead.
pub(crate) async fn read_head_bytes(
    stream: &mut TcpStream,
    buf: &mut BytesMut,
    deadline: &mut Deadline,
    stop: &mut std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
) -> Option<Next> {
    reserve(buf);
    let read = if buf.is_empty() {
        tokio::select! {
            r = deadline.within(stream.read_buf(buf)) => r,
            () = stop.as_mut() => return Some(Next::Close),
        }
    } else {
        deadline.within(stream.read_buf(buf)).await
    };
    match read {
        Some(Ok(n)) if n > 0 => None,
        _ => Some(Next::Gone),
    }
}

/// Writes a response made here (see [`encode_response`]) in one write.
pub(crate) async fn write_response(
    stream: &mut TcpStream,
    resp: http::Response<crate::body::BoxBody>,
    head_request: bool,
    close: bool,
    out: &mut Vec<u8>,
    send_timeout: Duration,
) -> Next {
    let (parts, body) = resp.into_parts();
    let Ok(body) = body.collect().await.map(http_body_util::Collected::to_bytes) else { return Next::Gone };
    encode_response(out, parts.status, &parts.headers, &body, head_request, close);
    if send(stream, out, send_timeout).await.is_err() {
        return Next::Gone;
    }
    if close {
        Next::Close
    } else {
        Next::KeepAlive
    }
}

/// Writes all of `buf` to the client, unless the client takes none of it
/// for `stall` (an error then): nginx's `send_timeout`, a bound between
/// two writes that make progress, not on the whole. Without it a client
/// that asks for a large response and stops reading held its connection,
/// a slot of the listener and an upstream connection for ever. No timer
/// while the socket takes the bytes at once (the usual case).
pub(crate) async fn send(stream: &TcpStream, mut buf: &[u8], stall: Duration) -> std::io::Result<()> {
    while !buf.is_empty() {
        match stream.try_write(buf) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if tokio::time::timeout(stall, stream.writable()).await.is_err() {
                    return Err(std::io::ErrorKind::TimedOut.into());
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A future that is always ready for more (a peer flooding interim
    /// answers) uses up the task's budget on every poll; the deadline must
    /// still pass. With the timer inside the budget this never returned.
    #[tokio::test]
    async fn a_deadline_passes_while_the_future_keeps_using_up_the_budget() {
        let mut deadline = Deadline::new(Instant::now() + Duration::from_millis(50));
        let busy = async {
            loop {
                tokio::task::consume_budget().await;
            }
        };
        let ended = tokio::time::timeout(Duration::from_secs(5), deadline.within(busy)).await;
        assert!(matches!(ended, Ok(None)), "the deadline passed: within() gave None");
    }
}
