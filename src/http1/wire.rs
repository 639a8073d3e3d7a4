//! Heads on the wire, for the hand-written loops: the fast path's request
//! head (the shared rules of [`super::parse_request`] plus the proxy's own)
//! and upstream response heads, parsed once (httparse) into ranges of the
//! connection's buffer; the end of a chunked body found as it passes; and
//! the small writers both loops build heads with. No I/O here.

use std::ops::Range;

use bytes::BytesMut;
use http::{header, HeaderMap, StatusCode};

/// Each read has at least this much room (hyper's first buffer is as large).
pub(crate) const READ_RESERVE: usize = 8 * 1024;
pub(crate) const MAX_RESPONSE_HEADERS: usize = 100;

/// One parsed request head: ranges into the connection's buffer.
#[derive(Default)]
pub struct Head {
    pub(crate) len: usize,
    pub(crate) method: Range<usize>,
    pub(crate) target: Range<usize>,
    /// Headers forwarded as they came.
    pub(crate) forward: Vec<(Range<usize>, Range<usize>)>,
    pub(crate) content_length: u64,
    pub(crate) host: Option<Range<usize>>,
    pub(crate) forwarded_for: Option<Range<usize>>,
    pub(crate) via: Option<Range<usize>>,
    pub(crate) token: Option<Range<usize>>,
    pub(crate) close: bool,
    /// `Expect: 100-continue` (forwarded as it came).
    pub(crate) expect_continue: bool,
}

pub enum Parsed {
    Complete,
    Partial,
    /// Refused here with this error, the connection closed (see
    /// [`super::NotTaken::Malformed`]).
    Malformed(crate::error::Error),
    /// Not for the fast path: hand the connection over.
    General,
}

/// The offsets of `part` inside `whole` (an empty part maps to `0..0`).
pub(crate) fn range_in(whole: &[u8], part: &[u8]) -> Range<usize> {
    if part.is_empty() {
        return 0..0;
    }
    let start = (part.as_ptr() as usize).saturating_sub(whole.as_ptr() as usize);
    start..start + part.len()
}

/// 1 to 19 ASCII digits.
pub(crate) fn digits(v: &[u8]) -> Option<u64> {
    if v.is_empty() || v.len() > 19 || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(v.iter().fold(0u64, |acc, d| acc * 10 + u64::from(d - b'0')))
}

/// The non-empty elements of a comma-separated header value.
pub(crate) fn tokens(v: &[u8]) -> impl Iterator<Item = &[u8]> {
    v.split(|b| *b == b',').map(<[u8]>::trim_ascii).filter(|t| !t.is_empty())
}

/// Parses a request head for the fast path: the shared rules of
/// [`super::parse_request`], then the proxy's own as each header is read
/// (which are forwarded as they came, which are replaced by this hop's
/// values, which send the request to the general path). A target in
/// origin form and a `Host` are required.
pub fn parse_head(buf: &[u8], max_header_bytes: usize, head: &mut Head) -> Parsed {
    head.forward.clear();
    head.host = None;
    head.forwarded_for = None;
    head.via = None;
    head.token = None;
    let line = super::parse_request(buf, max_header_bytes, |name, value| {
        let is = |n: &[u8]| name.eq_ignore_ascii_case(n);
        let value = range_in(buf, value);
        let once = |slot: &mut Option<Range<usize>>| slot.replace(value.clone()).is_none();
        if is(b"host") {
            once(&mut head.host)
        } else if is(b"x-forwarded-for") {
            once(&mut head.forwarded_for)
        } else if is(b"via") {
            once(&mut head.via)
        } else if is(b"x-fencing-token") {
            once(&mut head.token)
        } else if is(b"x-fencing-sequence") {
            // A sequenced write waits for an fsync of its sequence: the
            // general path's.
            false
        } else if is(b"connection") || is(b"x-forwarded-proto") || is(b"x-forwarded-host") {
            // Rewritten by this hop (framing, its own forwarding values).
            true
        } else {
            // `Content-Length` is forwarded as it came.
            head.forward.push((range_in(buf, name), value));
            true
        }
    });
    let line = match line {
        Ok(line) => line,
        Err(super::NotTaken::Partial) => return Parsed::Partial,
        Err(super::NotTaken::Malformed(e)) => return Parsed::Malformed(e),
        // A `Connection` naming a fencing header: the general path refuses
        // it in the language of its route (S3 routes answer S3 XML).
        Err(super::NotTaken::FencingHopByHop | super::NotTaken::General) => return Parsed::General,
    };
    if !line.target.starts_with('/') || head.host.is_none() {
        return Parsed::General;
    }
    head.len = line.len;
    head.method = range_in(buf, line.method.as_bytes());
    head.target = range_in(buf, line.target.as_bytes());
    head.content_length = line.content_length;
    head.close = line.close;
    head.expect_continue = line.expect_continue;
    Parsed::Complete
}

/// How an upstream response body is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    Empty,
    Length(u64),
    Chunked,
    /// Until the upstream closes.
    Close,
}

/// One parsed response head.
#[derive(Default)]
pub struct RespHead {
    pub(crate) len: usize,
    pub(crate) status: u16,
    pub(crate) http10: bool,
    pub(crate) reason: Range<usize>,
    pub(crate) forward: Vec<(Range<usize>, Range<usize>)>,
    pub(crate) length: Option<(Range<usize>, Range<usize>)>,
    pub(crate) via: Option<Range<usize>>,
    pub(crate) framing: Option<Framing>,
    pub(crate) reusable: bool,
}

pub enum RespParsed {
    Complete,
    Partial,
    Bad(&'static str),
}

pub fn parse_response(buf: &[u8], head_request: bool, out: &mut RespHead) -> RespParsed {
    let mut headers = [httparse::EMPTY_HEADER; MAX_RESPONSE_HEADERS];
    let mut resp = httparse::Response::new(&mut headers);
    let len = match resp.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return RespParsed::Partial,
        Err(_) => return RespParsed::Bad("malformed response head"),
    };
    let (Some(status), Some(version)) = (resp.code, resp.version) else {
        return RespParsed::Bad("malformed status line");
    };
    out.len = len;
    out.status = status;
    out.http10 = version == 0;
    out.reason = range_in(buf, resp.reason.unwrap_or("").as_bytes());
    out.forward.clear();
    out.length = None;
    out.via = None;
    let mut close = out.http10;
    let mut length: Option<u64> = None;
    let mut chunked: Option<bool> = None;
    // Names listed in `Connection` are hop-by-hop too.
    let named = |name: &[u8]| {
        resp.headers
            .iter()
            .filter(|h| h.name.eq_ignore_ascii_case("connection"))
            .any(|h| tokens(h.value).any(|t| t.eq_ignore_ascii_case(name) && !t.eq_ignore_ascii_case(b"close")))
    };
    for h in resp.headers.iter() {
        let name = h.name.as_bytes();
        let is = |n: &[u8]| name.eq_ignore_ascii_case(n);
        if is(b"content-length") {
            match (digits(h.value), length) {
                (Some(v), None) => length = Some(v),
                (Some(v), Some(prev)) if v == prev => continue,
                _ => return RespParsed::Bad("invalid content-length"),
            }
            out.length = Some((range_in(buf, name), range_in(buf, h.value)));
        } else if is(b"transfer-encoding") {
            chunked = Some(tokens(h.value).last().is_some_and(|t| t.eq_ignore_ascii_case(b"chunked")));
        } else if is(b"connection") {
            if tokens(h.value).any(|t| t.eq_ignore_ascii_case(b"close")) {
                close = true;
            } else if out.http10 && tokens(h.value).any(|t| t.eq_ignore_ascii_case(b"keep-alive")) {
                close = false;
            }
        } else if is(b"via") {
            if out.via.is_none() {
                out.via = Some(range_in(buf, h.value));
            }
        } else if !super::HOP_BY_HOP.iter().any(|n| is(n.as_bytes())) && !named(name) {
            out.forward.push((range_in(buf, name), range_in(buf, h.value)));
        }
    }
    let framing = if head_request || status == 204 || status == 304 || (100..200).contains(&status) {
        Framing::Empty
    } else {
        match (chunked, length) {
            (Some(true), _) => Framing::Chunked,
            (Some(false), _) => Framing::Close,
            (None, Some(n)) => Framing::Length(n),
            (None, None) => Framing::Close,
        }
    };
    if framing == Framing::Chunked {
        // Transfer-Encoding wins over Content-Length (RFC 9112 6.3).
        out.length = None;
    }
    out.framing = Some(framing);
    out.reusable = !close && framing != Framing::Close && chunked != Some(false);
    RespParsed::Complete
}

/// Finds the end of a chunked body in the bytes that pass through.
#[derive(Debug, Default)]
pub(crate) struct ChunkScanner {
    state: ChunkState,
    size: u64,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ChunkState {
    #[default]
    Size,
    Ext,
    SizeLf,
    Data,
    DataCr,
    DataLf,
    /// At the start of a trailer line (after the last chunk).
    TrailerStart,
    TrailerLine,
    TrailerLf,
    EndLf,
}

impl ChunkScanner {
    /// The byte a state waits for, then the next state.
    fn expect(&mut self, got: u8, want: u8, next: ChunkState) -> Result<(), ()> {
        if got != want {
            return Err(());
        }
        self.state = next;
        Ok(())
    }

    /// Feeds `data`; `Ok(Some(n))` when the body ends after `n` of its bytes.
    pub(crate) fn feed(&mut self, data: &[u8]) -> Result<Option<usize>, ()> {
        let mut i = 0;
        while i < data.len() {
            let b = data[i];
            match self.state {
                ChunkState::Size => match b {
                    b'0'..=b'9' | b'a'..=b'f' | b'A'..=b'F' => {
                        let d = u64::from(match b {
                            b'0'..=b'9' => b - b'0',
                            b'a'..=b'f' => b - b'a' + 10,
                            _ => b - b'A' + 10,
                        });
                        self.size = self.size.checked_mul(16).and_then(|s| s.checked_add(d)).ok_or(())?;
                    }
                    b';' | b' ' | b'\t' => self.state = ChunkState::Ext,
                    b'\r' => self.state = ChunkState::SizeLf,
                    _ => return Err(()),
                },
                ChunkState::Ext => match b {
                    b'\r' => self.state = ChunkState::SizeLf,
                    b'\n' => return Err(()),
                    _ => {}
                },
                ChunkState::SizeLf => {
                    let next = if self.size == 0 { ChunkState::TrailerStart } else { ChunkState::Data };
                    self.expect(b, b'\n', next)?;
                }
                ChunkState::Data => {
                    let take = usize::try_from(self.size).unwrap_or(usize::MAX).min(data.len() - i);
                    self.size -= take as u64;
                    i += take;
                    if self.size == 0 {
                        self.state = ChunkState::DataCr;
                    }
                    continue;
                }
                ChunkState::DataCr => self.expect(b, b'\r', ChunkState::DataLf)?,
                ChunkState::DataLf => self.expect(b, b'\n', ChunkState::Size)?,
                ChunkState::TrailerStart => match b {
                    b'\r' => self.state = ChunkState::EndLf,
                    _ => self.state = ChunkState::TrailerLine,
                },
                ChunkState::TrailerLine => {
                    if b == b'\r' {
                        self.state = ChunkState::TrailerLf;
                    }
                }
                ChunkState::TrailerLf => self.expect(b, b'\n', ChunkState::TrailerStart)?,
                ChunkState::EndLf => {
                    if b != b'\n' {
                        return Err(());
                    }
                    return Ok(Some(i + 1));
                }
            }
            i += 1;
        }
        Ok(None)
    }
}

/// At least 1 KiB of room for the next read.
pub(crate) fn reserve(buf: &mut BytesMut) {
    if buf.capacity() - buf.len() < 1024 {
        buf.reserve(READ_RESERVE);
    }
}

/// `name: value` and its line end.
pub(crate) fn push_header(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// `name: [earlier, ]item` — list headers are appended to, as nginx does.
pub(crate) fn push_list(out: &mut Vec<u8>, name: &[u8], earlier: Option<&[u8]>, item: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    if let Some(e) = earlier.filter(|e| !e.is_empty()) {
        out.extend_from_slice(e);
        out.extend_from_slice(b", ");
    }
    out.extend_from_slice(item);
    out.extend_from_slice(b"\r\n");
}

/// Appends `n` in decimal (no allocation per response).
pub(crate) fn push_decimal(out: &mut Vec<u8>, mut n: usize) {
    let mut digits = [0u8; 20];
    let mut start = digits.len();
    loop {
        start -= 1;
        digits[start] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 || start == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[start..]);
}

/// The `Date` header's value, formatted once per second per thread.
pub(crate) fn date_now() -> [u8; 29] {
    use std::cell::Cell;
    use std::time::{SystemTime, UNIX_EPOCH};
    thread_local! {
        static CACHED: Cell<(u64, [u8; 29])> = const { Cell::new((u64::MAX, [0; 29])) };
    }
    let now = SystemTime::now();
    let secs = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    CACHED.with(|c| {
        let (at, text) = c.get();
        if at == secs {
            return text;
        }
        let mut fresh = [0u8; 29];
        let formatted = httpdate::fmt_http_date(now);
        if formatted.len() == fresh.len() {
            fresh.copy_from_slice(formatted.as_bytes());
        }
        c.set((secs, fresh));
        fresh
    })
}

/// A response made here (the api's answers, the fast path's errors) as
/// HTTP/1.1 bytes: status line, its headers (framing and `Connection` are
/// this function's), `Date` when absent, `Content-Length`, `Connection:
/// close` when closing, then the body — none for HEAD, 1xx, 204 and 304.
pub(crate) fn encode_response(
    out: &mut Vec<u8>,
    status: StatusCode,
    headers: &HeaderMap,
    body: &[u8],
    head_request: bool,
    close: bool,
) {
    out.clear();
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    for (name, value) in headers {
        if name != header::CONTENT_LENGTH && name != header::TRANSFER_ENCODING && name != header::CONNECTION {
            push_header(out, name.as_str().as_bytes(), value.as_bytes());
        }
    }
    if !headers.contains_key(header::DATE) {
        push_header(out, b"date", &date_now());
    }
    let bodiless = status.is_informational() || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED;
    if !bodiless {
        out.extend_from_slice(b"content-length: ");
        push_decimal(out, body.len());
        out.extend_from_slice(b"\r\n");
    }
    if close {
        push_header(out, b"connection", b"close");
    }
    out.extend_from_slice(b"\r\n");
    if !bodiless && !head_request {
        out.extend_from_slice(body);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(raw: &str) -> (Parsed, Head) {
        let mut h = Head::default();
        let p = parse_head(raw.as_bytes(), 64 * 1024, &mut h);
        (p, h)
    }

    #[test]
    fn a_plain_request_head_is_taken_and_split() {
        let raw = "PUT /a/b?x=1 HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\nX-Fencing-Token: 7\r\nConnection: keep-alive\r\nX-Other: o\r\n\r\nabc";
        let (p, h) = head(raw);
        assert!(matches!(p, Parsed::Complete));
        assert_eq!(&raw[h.method.clone()], "PUT");
        assert_eq!(&raw[h.target.clone()], "/a/b?x=1");
        assert_eq!(h.content_length, 3);
        assert_eq!(&raw[h.token.clone().unwrap()], "7");
        assert_eq!(&raw[h.host.clone().unwrap()], "h");
        assert_eq!(h.len, raw.len() - 3);
        let names: Vec<&str> = h.forward.iter().map(|(n, _)| &raw[n.clone()]).collect();
        assert_eq!(names, ["Content-Length", "X-Other"]);
        assert!(!h.close);
    }

    #[test]
    fn one_expect_100_continue_is_taken_and_forwarded() {
        let raw = "PUT /a HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\nexpect: 100-Continue\r\n\r\n";
        let (p, h) = head(raw);
        assert!(matches!(p, Parsed::Complete));
        assert!(h.expect_continue);
        let names: Vec<&str> = h.forward.iter().map(|(n, _)| &raw[n.clone()]).collect();
        assert_eq!(names, ["Content-Length", "expect"]);
        let (_, h) = head("PUT /a HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\n\r\n");
        assert!(!h.expect_continue);
    }

    #[test]
    fn unusual_requests_go_to_the_general_path() {
        for raw in [
            "PUT /a HTTP/1.0\r\nHost: h\r\n\r\n",
            "PUT /a HTTP/1.1\r\n\r\n",
            "PUT /a HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n",
            "PUT /a HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\n",
            "PUT /a HTTP/1.1\r\nHost: h\r\nX-Fencing-Token: 1\r\nX-Fencing-Token: 1\r\n\r\n",
            "PUT /a HTTP/1.1\r\nHost: h\r\nConnection: x-secret\r\n\r\n",
            "PUT /a HTTP/1.1\r\nHost: h\r\nExpect: 100-continue, x\r\n\r\n",
            "PUT /a HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\nExpect: 100-continue\r\n\r\n",
            "PUT /a HTTP/1.1\r\nHost: h\r\nExpect: 200-ok\r\n\r\n",
            "PUT /a HTTP/1.1\r\nHost: h\r\nUpgrade: websocket\r\n\r\n",
            "PUT /a HTTP/1.1\r\nHost: h\r\nProxy-Authorization: x\r\n\r\n",
            "PUT http://h/a HTTP/1.1\r\nHost: h\r\n\r\n",
            "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
            "PRI * HTTP/2",
            "PUT /a HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
            "PUT /a HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n",
        ] {
            assert!(matches!(head(raw).0, Parsed::General), "{raw:?}");
        }
        // More headers than the fast path parses, fewer than hyper takes.
        let many: String = (0..90).map(|i| format!("X-H{i}: v\r\n")).collect();
        assert!(matches!(head(&format!("GET /a HTTP/1.1\r\nHost: h\r\n{many}\r\n")).0, Parsed::General));
        assert!(matches!(head("PUT /a HTTP/1.1\r\nHost: h\r\n").0, Parsed::Partial));
        let mut h = Head::default();
        let big = format!("GET / HTTP/1.1\r\nHost: h\r\nX-Big: {}\r\n\r\n", "a".repeat(100));
        assert!(matches!(parse_head(big.as_bytes(), 64, &mut h), Parsed::General));
    }

    /// Heads hyper would refuse with a bare status are refused here, with
    /// the JSON error: 400 for what does not parse or has no reliable
    /// framing, 431 for more headers than hyper takes.
    #[test]
    fn malformed_heads_are_refused_with_the_json_error() {
        let many: String = (0..101).map(|i| format!("X-H{i}: v\r\n")).collect();
        let too_many = format!("GET /a HTTP/1.1\r\nHost: h\r\n{many}\r\n");
        for (raw, status) in [
            ("PUT /a HTTP/1.1\r\nHost h\r\n\r\n", 400),
            ("PUT /a HTTP/1.1\r\nHost : h\r\n\r\n", 400),
            ("PUT /a HTTP/1.1\r\nHost: h\r\nX: a\0b\r\n\r\n", 400),
            ("PUT /a HTTP/1.1\r\nHost: h\r\nX: a\r\n b\r\n\r\n", 400),
            ("PUT /a HTTP/1.2\r\nHost: h\r\n\r\n", 400),
            ("PUT  /a HTTP/1.1\r\nHost: h\r\n\r\n", 400),
            ("PUT /a HTTP/1.1\r\nHost: h\r\nContent-Length: +3\r\n\r\n", 400),
            ("PUT /a HTTP/1.1\r\nHost: h\r\nContent-Length: 1, 1\r\n\r\n", 400),
            ("PUT /a HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400),
            ("PUT /a HTTP/1.1\r\nHost: h\r\nContent-Length: 12345678901234567890\r\n\r\n", 400),
            ("PUT /a HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: identity\r\n\r\n", 400),
            ("PUT /a HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked, identity\r\n\r\n", 400),
            ("PUT /a HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: xchunked\r\n\r\n", 400),
            ("PUT /a HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: gzip\r\n\r\n", 400),
            (too_many.as_str(), 431),
        ] {
            match head(raw).0 {
                Parsed::Malformed(e) => assert_eq!(e.status().as_u16(), status, "{raw:?}"),
                _ => panic!("not refused: {raw:?}"),
            }
        }
    }

    #[test]
    fn connection_naming_a_fencing_header_goes_to_the_general_path() {
        for raw in [
            "PUT /a HTTP/1.1\r\nHost: h\r\nX-Fencing-Token: 1\r\nConnection: X-Fencing-Token\r\n\r\n",
            "PUT /a HTTP/1.1\r\nHost: h\r\nConnection: close, x-fencing-sequence\r\n\r\n",
        ] {
            assert!(matches!(head(raw).0, Parsed::General), "{raw:?}");
        }
    }

    #[test]
    fn response_framing_and_hop_by_hop_headers() {
        let mut r = RespHead::default();
        let raw = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: x-hop\r\nX-Hop: 1\r\nKeep-Alive: 5\r\nETag: \"e\"\r\n\r\nok";
        assert!(matches!(parse_response(raw.as_bytes(), false, &mut r), RespParsed::Complete));
        assert_eq!(r.framing, Some(Framing::Length(2)));
        assert!(r.reusable);
        let names: Vec<&str> = r.forward.iter().map(|(n, _)| &raw[n.clone()]).collect();
        assert_eq!(names, ["ETag"]);

        let raw = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 9\r\n\r\n";
        assert!(matches!(parse_response(raw.as_bytes(), false, &mut r), RespParsed::Complete));
        assert_eq!(r.framing, Some(Framing::Chunked));
        assert!(r.length.is_none());

        let raw = "HTTP/1.0 200 OK\r\n\r\nrest";
        assert!(matches!(parse_response(raw.as_bytes(), false, &mut r), RespParsed::Complete));
        assert_eq!(r.framing, Some(Framing::Close));
        assert!(!r.reusable);

        let raw = "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n";
        assert!(matches!(parse_response(raw.as_bytes(), true, &mut r), RespParsed::Complete));
        assert_eq!(r.framing, Some(Framing::Empty));

        let raw = "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n";
        assert!(matches!(parse_response(raw.as_bytes(), false, &mut r), RespParsed::Bad(_)));
    }

    #[test]
    fn the_chunk_scanner_finds_the_end_across_reads() {
        let body = b"4;ext=1\r\nwiki\r\n5\r\npedia\r\n0\r\nX-Trailer: t\r\n\r\nNEXT";
        let end = body.len() - 4;
        for split in 0..body.len() {
            let mut s = ChunkScanner::default();
            let found = match s.feed(&body[..split]).unwrap() {
                Some(n) => n,
                None => split + s.feed(&body[split..]).unwrap().unwrap(),
            };
            assert_eq!(found, end, "split at {split}");
        }
        let mut s = ChunkScanner::default();
        assert_eq!(s.feed(b"0\r\n\r\n").unwrap(), Some(5));
        assert!(ChunkScanner::default().feed(b"zz\r\n").is_err());
        assert!(ChunkScanner::default().feed(b"2\r\nabX").is_err());
    }

    #[test]
    fn decimals() {
        for n in [0usize, 7, 10, 65_536, usize::MAX] {
            let mut out = Vec::new();
            push_decimal(&mut out, n);
            assert_eq!(out, n.to_string().into_bytes());
        }
    }

    #[test]
    fn the_date_is_an_http_date() {
        let d = date_now();
        let text = std::str::from_utf8(&d).unwrap();
        assert!(httpdate::parse_http_date(text).is_ok(), "{text}");
    }

    #[test]
    fn a_local_response_is_framed_here() {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
        headers.insert(header::CONTENT_LENGTH, http::HeaderValue::from_static("999"));
        let mut out = Vec::new();
        encode_response(&mut out, StatusCode::CONFLICT, &headers, b"{}", false, true);
        let text = String::from_utf8(out.clone()).unwrap();
        assert!(text.starts_with("HTTP/1.1 409 Conflict\r\n"), "{text}");
        for line in ["content-type: application/json\r\n", "content-length: 2\r\n", "connection: close\r\n", "date: "] {
            assert!(text.contains(line), "{line} in {text}");
        }
        assert!(!text.contains("999") && text.ends_with("\r\n\r\n{}"), "{text}");
        encode_response(&mut out, StatusCode::OK, &headers, b"{}", true, false);
        assert!(String::from_utf8(out).unwrap().ends_with("content-length: 2\r\n\r\n"));
    }
}
