//! HTTP/1.1 on the wire, for the two loops that parse it themselves: the
//! proxy's fast path ([`crate::proxy::fast`]) and the api listener's loop
//! ([`crate::server`]). Everything else goes through hyper.
//!
//! Owns what both loops must agree on: the hop-by-hop header names (also
//! used by the general path's header rules), the one request-head parser
//! with its rules for what a loop may take itself ([`parse_request`]),
//! response heads and chunked framing ([`wire`]), and the
//! connection-level deadlines, reads and writes ([`conn`]). No routing and
//! no fencing here.

pub mod conn;
pub mod wire;

use crate::error::Error;

/// The hop-by-hop headers of RFC 9110 §7.6.1 besides `Connection` itself
/// (and whatever a `Connection` header names), plus the non-standard ones
/// proxies treat the same way. A proxy never forwards them either way.
pub const HOP_BY_HOP: [&str; 8] = [
    "te",
    "transfer-encoding",
    "upgrade",
    "trailer",
    "proxy-authorization",
    "proxy-authenticate",
    "keep-alive",
    "proxy-connection",
];

/// Request headers the hand-written loops leave to hyper: the hop-by-hop
/// ones, `Expect` (but one `Expect: 100-continue`, which [`parse_request`]
/// reports for a loop that answers it) and `HTTP2-Settings` (an h2c
/// upgrade).
pub(crate) fn leaves_to_hyper(name: &[u8]) -> bool {
    name.eq_ignore_ascii_case(b"expect")
        || name.eq_ignore_ascii_case(b"http2-settings")
        || HOP_BY_HOP.iter().any(|h| name.eq_ignore_ascii_case(h.as_bytes()))
}

/// The most request headers either loop parses; more go to hyper.
pub(crate) const MAX_REQUEST_HEADERS: usize = 64;

/// The most request headers hyper takes (its default): a head with more is
/// refused by the loops themselves, with the JSON body.
pub(crate) const HYPER_MAX_REQUEST_HEADERS: usize = 100;

/// A request head parsed by [`parse_request`]: its length and what both
/// loops need, borrowed from the connection's buffer.
pub(crate) struct RequestLine<'b> {
    pub(crate) len: usize,
    pub(crate) method: &'b str,
    pub(crate) target: &'b str,
    /// 0 without a `Content-Length`.
    pub(crate) content_length: u64,
    /// `Connection: close`.
    pub(crate) close: bool,
    /// One `Expect: 100-continue` (shown to `each` like any header); a loop
    /// that does not answer it hands the request over.
    pub(crate) expect_continue: bool,
}

/// Why [`parse_request`] did not give a head.
pub(crate) enum NotTaken {
    /// More bytes are needed (and allowed).
    Partial,
    /// `Connection` names a fencing header (see
    /// [`crate::proxy::headers::fencing_header_named_hop_by_hop`]).
    FencingHopByHop,
    /// A head no HTTP/1.1 server may take: it does not parse, its
    /// `Content-Length` is invalid, its `Transfer-Encoding` does not end in
    /// `chunked`, or it has more headers than hyper takes. Refused by the
    /// loop with this JSON error and the connection closed (its framing
    /// cannot be trusted); hyper would answer with a bare status.
    Malformed(Error),
    /// Not for a hand-written loop: hand the connection to hyper.
    General,
}

/// Parses one HTTP/1.1 request head (httparse) with the rules both loops
/// share: HTTP/1.1 only; headers within `max_header_bytes` and
/// [`MAX_REQUEST_HEADERS`]; at most one `Content-Length`, 1–19 digits;
/// `Connection` saying at most `close` or `keep-alive`; at most one
/// `Expect`, saying `100-continue`; nothing else of [`leaves_to_hyper`]. Every other header — `Content-Length` and
/// `Connection` included — is shown to `each(name, value)`, which says
/// whether the loop can take it (`false`: hand over). The order of the
/// checks is the order of the headers, so the first reason to hand over
/// wins; a `Connection` naming a fencing header is reported wherever it is.
pub(crate) fn parse_request<'b>(
    buf: &'b [u8],
    max_header_bytes: usize,
    mut each: impl FnMut(&'b [u8], &'b [u8]) -> bool,
) -> Result<RequestLine<'b>, NotTaken> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_REQUEST_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let len = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if buf.len() <= max_header_bytes => return Err(NotTaken::Partial),
        Ok(httparse::Status::Partial) => return Err(NotTaken::General),
        Err(httparse::Error::TooManyHeaders) => return Err(too_many_headers(buf)),
        // An HTTP/2 connection preface is hyper's.
        Err(_) if buf.starts_with(b"PRI ") => return Err(NotTaken::General),
        Err(e) => return Err(malformed(format!("the request head does not parse: {e}"))),
    };
    // RFC 9112 §6.1: an HTTP/1.0 request with Transfer-Encoding has faulty
    // framing. hyper refuses it with an empty body; the JSON error here.
    if req.version == Some(0) && req.headers.iter().any(|h| h.name.eq_ignore_ascii_case("transfer-encoding")) {
        return Err(malformed("an HTTP/1.0 request must not carry Transfer-Encoding".into()));
    }
    let (Some(method), Some(target), Some(1)) = (req.method, req.path, req.version) else {
        return Err(NotTaken::General);
    };
    let mut line = RequestLine { len, method, target, content_length: 0, close: false, expect_continue: false };
    let mut seen_length = false;
    let mut last_coding: Option<&[u8]> = None;
    let mut total = 0usize;
    let mut taken = true;
    for h in req.headers.iter() {
        total += h.name.len() + h.value.len() + 4;
        let name = h.name.as_bytes();
        if name.eq_ignore_ascii_case(b"content-length") {
            match wire::digits(h.value) {
                Some(n) if !seen_length => line.content_length = n,
                // The same length twice: hyper's to judge.
                Some(n) if n == line.content_length => taken = false,
                _ => return Err(malformed("Content-Length must be given once, as 1 to 19 digits".into())),
            }
            seen_length = true;
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            if let Some(last) = wire::tokens(h.value).last() {
                last_coding = Some(last);
            }
            taken = false;
        } else if name.eq_ignore_ascii_case(b"connection") {
            for t in wire::tokens(h.value) {
                if crate::fence::token::is_fencing_header(t) {
                    return Err(NotTaken::FencingHopByHop);
                }
                if t.eq_ignore_ascii_case(b"close") {
                    line.close = true;
                } else if !t.eq_ignore_ascii_case(b"keep-alive") {
                    taken = false;
                }
            }
        } else if name.eq_ignore_ascii_case(b"expect") {
            // Only one, and only the expectation HTTP/1.1 defines (RFC
            // 9110 §10.1.1); hyper answers any other with 417.
            if line.expect_continue || !h.value.eq_ignore_ascii_case(b"100-continue") {
                taken = false;
            }
            line.expect_continue = true;
        } else if leaves_to_hyper(name) {
            taken = false;
        }
        taken = taken && each(name, h.value);
    }
    // RFC 9112 §6.3: a request whose final transfer coding is not chunked
    // has no reliable framing.
    if last_coding.is_some_and(|c| !c.eq_ignore_ascii_case(b"chunked")) {
        return Err(malformed("Transfer-Encoding must end in chunked".into()));
    }
    if !taken || total > max_header_bytes {
        return Err(NotTaken::General);
    }
    Ok(line)
}

fn malformed(why: String) -> NotTaken {
    NotTaken::Malformed(Error::BadRequest(why))
}

/// A head with more than [`MAX_REQUEST_HEADERS`] headers: hyper's if it has
/// no more than hyper takes, refused here (431) otherwise.
fn too_many_headers(buf: &[u8]) -> NotTaken {
    let mut headers = [httparse::EMPTY_HEADER; HYPER_MAX_REQUEST_HEADERS];
    match httparse::Request::new(&mut headers).parse(buf) {
        Err(httparse::Error::TooManyHeaders) => {
            NotTaken::Malformed(Error::TooManyHeaders { limit: HYPER_MAX_REQUEST_HEADERS })
        }
        _ => NotTaken::General,
    }
}
