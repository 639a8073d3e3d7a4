//! Hostile input against the real binary. After each attack: the gateway
//! answers /healthz, the fences and grants it held are intact, and no
//! refused request reached the upstream.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{acquire, release, Gateway, Grant, Http, Opts, Recorder};
use http::{Method, Request, StatusCode};
use http_body_util::Empty;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

struct Rig {
    _dir: tempfile::TempDir,
    gw: Gateway,
    rec: Recorder,
    http: Http,
    held: Grant,
}

async fn rig() -> Rig {
    let rec = Recorder::start().await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = "[server]\nheader_read_timeout_ms = 1000\nmax_header_bytes = 8192\n\
               [[routes]]\nmatch = \"/{*path}\"\nupstream = \"UP\"\nmax_body_bytes = 1048576\n"
        .replace("UP", &rec.url());
    let gw = Gateway::start(&dir.path().join("data"), Opts { config: Some(cfg), ..Opts::default() });
    let http = Http::default();
    let held = acquire(&http, &gw.api_url(""), "held/key", 600_000, 0).await.unwrap();
    Rig { _dir: dir, gw, rec, http, held }
}

impl Rig {
    /// Healthy, the held grant intact, the upstream untouched.
    async fn still_fine(&self, upstream_requests: usize) {
        let h =
            tokio::time::timeout(Duration::from_secs(5), self.http.get(&self.gw.api_url("/healthz"))).await.unwrap();
        assert_eq!(h.status, StatusCode::OK);
        let s = self.http.get(&self.gw.api_url("/v1/locks/status?key=held/key")).await.json();
        assert_eq!(s["held"], true);
        assert_eq!(s["fencing_token"], self.held.token);
        assert_eq!(s["fence"], self.held.token);
        assert_eq!(self.rec.count(), upstream_requests, "a refused request reached the upstream");
    }
}

async fn raw(addr: std::net::SocketAddr, bytes: &[u8]) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn malformed_json_of_many_shapes() {
    let r = rig().await;
    let url = r.gw.api_url("/v1/locks/acquire");
    let deep = "[".repeat(100_000);
    let shapes: Vec<Vec<u8>> = vec![
        b"{".to_vec(),
        b"}".to_vec(),
        b"null".to_vec(),
        b"\"string\"".to_vec(),
        b"{\"key\": {\"nested\": 1}, \"ttl_ms\": 1000}".to_vec(),
        b"{\"key\": \"k\", \"ttl_ms\": 18446744073709551616}".to_vec(),
        b"{\"key\": \"k\", \"ttl_ms\": 1000, \"key\": \"dup\"}".to_vec(),
        deep.into_bytes(),
        b"{\"key\": \"\xff\xfe\", \"ttl_ms\": 1000}".to_vec(),
        b"{\"key\": \"held/key\\u0000\", \"ttl_ms\": 1000}".to_vec(),
        vec![0u8; 1000],
    ];
    for body in shapes {
        let resp = r.http.send(Method::POST, &url, &[], body.clone()).await;
        assert!(
            resp.status.is_client_error(),
            "{:?}: {}",
            String::from_utf8_lossy(&body[..body.len().min(40)]),
            resp.status
        );
        assert!(resp.json()["error"].is_string());
    }
    r.still_fine(0).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_paths_and_invalid_utf8() {
    let r = rig().await;
    let t = r.held.token.to_string();
    for path in ["/held/%ff", "/held/%c3%28", "/held/../key", "/held%2fkey", "/held//key"] {
        let resp = r.http.send(Method::PUT, &r.gw.proxy_url(path), &[("x-fencing-token", &t)], "x").await;
        assert_eq!(resp.status, StatusCode::BAD_REQUEST, "{path}");
        assert_eq!(resp.error_code(), "bad_request");
    }
    // Raw bytes no URI parser accepts: refused with a 4xx before any route.
    let answer =
        raw(r.gw.proxy, b"PUT /held/\xff\xfe HTTP/1.1\r\nhost: x\r\nx-fencing-token: 1\r\ncontent-length: 1\r\n\r\nx")
            .await;
    assert!(answer.starts_with("HTTP/1.1 4"), "{answer}");
    let answer = raw(r.gw.api, b"GARBAGE\r\n\r\n").await;
    assert!(answer.starts_with("HTTP/1.1 4"), "{answer}");
    r.still_fine(0).await;
}

/// Heads the HTTP layer refuses (they do not parse, their framing is
/// invalid, or they carry more headers than it takes) get the JSON error on
/// both plain-text listeners, like every other bad input, and the
/// connection is closed. None reaches the upstream.
#[tokio::test(flavor = "multi_thread")]
async fn malformed_heads_get_the_json_error_on_both_listeners() {
    let r = rig().await;
    let t = r.held.token.to_string();
    let many: String = (0..101).map(|i| format!("x-h{i}: v\r\n")).collect();
    let cases: Vec<(String, &str)> = vec![
        (format!("PUT /held/key HTTP/1.1\r\nhost: x\r\nx-fencing-token: {t}\r\nx-bad: a\0b\r\n\r\n"), "400"),
        (format!("PUT /held/key HTTP/1.1\r\nhost : x\r\nx-fencing-token: {t}\r\n\r\n"), "400"),
        (format!("PUT /held/key HTTP/1.1\r\nhost: x\r\nx-fencing-token: {t}\r\nx-f: a\r\n b\r\n\r\n"), "400"),
        (format!("PUT /held/key HTTP/1.2\r\nhost: x\r\nx-fencing-token: {t}\r\n\r\n"), "400"),
        (format!("PUT /held/key HTTP/1.1\r\nhost: x\r\nx-fencing-token: {t}\r\ncontent-length: +1\r\n\r\nx"), "400"),
        (
            format!("PUT /held/key HTTP/1.1\r\nhost: x\r\nx-fencing-token: {t}\r\ncontent-length: 1, 1\r\n\r\nx"),
            "400",
        ),
        (
            format!("PUT /held/key HTTP/1.1\r\nhost: x\r\nx-fencing-token: {t}\r\ntransfer-encoding: identity\r\n\r\nx"),
            "400",
        ),
        (
            format!(
                "PUT /held/key HTTP/1.1\r\nhost: x\r\nx-fencing-token: {t}\r\ntransfer-encoding: chunked, identity\r\n\r\n"
            ),
            "400",
        ),
        (format!("PUT /held/key HTTP/1.1\r\nhost: x\r\nx-fencing-token: {t}\r\n{many}\r\n"), "431"),
        // RFC 9112 §6.1: faulty framing in HTTP/1.0 (outside review, LOW:
        // hyper's answer had an empty body).
        (
            format!("PUT /held/key HTTP/1.0\r\nhost: x\r\nx-fencing-token: {t}\r\ntransfer-encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n"),
            "400",
        ),
        ("GET /held/key HTTP/1.0\r\nhost: x\r\ntransfer-encoding: gzip\r\n\r\n".to_string(), "400"),
    ];
    for addr in [r.gw.proxy, r.gw.api] {
        for (head, status) in &cases {
            let answer = raw(addr, head.as_bytes()).await;
            let shown = &answer[..answer.len().min(200)];
            assert!(answer.starts_with(&format!("HTTP/1.1 {status}")), "{head:?} on {addr}: {shown}");
            let body = answer.split("\r\n\r\n").nth(1).unwrap_or("");
            let v: serde_json::Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{head:?}: {e}: {shown}"));
            let code = if *status == "431" { "headers_too_large" } else { "bad_request" };
            assert_eq!(v["error"], code, "{head:?} on {addr}");
        }
    }
    r.still_fine(0).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn oversized_headers_and_bodies() {
    let r = rig().await;
    let t = r.held.token.to_string();
    let big = "v".repeat(9000);
    for url in [r.gw.api_url("/healthz"), r.gw.proxy_url("/held/key")] {
        let resp = r.http.send(Method::GET, &url, &[("x-big", &big)], "").await;
        assert_eq!(resp.status, StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
        assert_eq!(resp.error_code(), "headers_too_large");
    }
    // Far above every limit: still a 431, from the HTTP layer itself.
    let huge = "v".repeat(200_000);
    let answer = raw(r.gw.proxy, format!("GET / HTTP/1.1\r\nhost: x\r\nx-huge: {huge}\r\n\r\n").as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 431"), "{}", &answer[..answer.len().min(80)]);
    // A body over the route's limit: declared, and streamed without a length.
    let resp =
        r.http.send(Method::PUT, &r.gw.proxy_url("/held/key"), &[("x-fencing-token", &t)], vec![b'x'; 2 << 20]).await;
    assert_eq!(resp.status, StatusCode::PAYLOAD_TOO_LARGE);
    let chunked =
        format!("PUT /held/key HTTP/1.1\r\nhost: x\r\nx-fencing-token: {t}\r\ntransfer-encoding: chunked\r\n\r\n");
    let mut s = tokio::net::TcpStream::connect(r.gw.proxy).await.unwrap();
    s.write_all(chunked.as_bytes()).await.unwrap();
    let chunk = vec![b'y'; 65536];
    for _ in 0..20 {
        if s.write_all(format!("{:x}\r\n", chunk.len()).as_bytes()).await.is_err() {
            break;
        }
        if s.write_all(&chunk).await.is_err() || s.write_all(b"\r\n").await.is_err() {
            break;
        }
    }
    let mut out = vec![0u8; 512];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut out)).await.unwrap().unwrap_or(0);
    assert!(String::from_utf8_lossy(&out[..n]).starts_with("HTTP/1.1 413"), "{}", String::from_utf8_lossy(&out[..n]));
    drop(s);
    // The upstream may log the cut-off request a moment later: let it.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(r.rec.requests().iter().all(|s| !s.complete), "an over-limit body must never arrive whole");
    let incomplete = r.rec.count();
    r.still_fine(incomplete).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn slowloris_on_both_listeners_is_cut_off() {
    let r = rig().await;
    for addr in [r.gw.api, r.gw.proxy] {
        let started = Instant::now();
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n").await.unwrap();
        // One header byte every 200 ms: never finishing.
        let mut closed = false;
        for _ in 0..50 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            if s.write_all(b"x").await.is_err() {
                closed = true;
                break;
            }
            let mut buf = [0u8; 256];
            if let Ok(Ok(n)) = tokio::time::timeout(Duration::from_millis(1), s.read(&mut buf)).await {
                if n == 0 || buf.starts_with(b"HTTP/1.1 408") {
                    closed = true;
                    break;
                }
            }
        }
        assert!(closed, "a slow client must be cut off");
        assert!(started.elapsed() < Duration::from_secs(5), "cut off after the header timeout (1 s)");
    }
    r.still_fine(0).await;
}

/// What became of a connection that trickled its request body.
#[derive(Debug, PartialEq)]
enum Trickle {
    /// Answered 408 with the JSON error, after this long.
    TimedOut(Duration),
    /// Closed without an answer, after this long.
    Closed(Duration),
    /// Still open when the test stopped waiting.
    StillOpen,
}

/// Sends a request head, then one body byte every 200 ms, never finishing.
async fn trickle(addr: std::net::SocketAddr, chunked: bool) -> Trickle {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let framing = if chunked { "transfer-encoding: chunked" } else { "content-length: 100" };
    let head =
        format!("POST /v1/locks/acquire HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{framing}\r\n\r\n");
    s.write_all(head.as_bytes()).await.unwrap();
    let started = Instant::now();
    let mut got = Vec::new();
    while started.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let byte: &[u8] = if chunked { b"1\r\n{\r\n" } else { b"{" };
        let wrote = s.write_all(byte).await.is_ok();
        let mut buf = [0u8; 1024];
        match tokio::time::timeout(Duration::from_millis(1), s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => {
                let text = String::from_utf8_lossy(&got);
                if text.starts_with("HTTP/1.1 408") {
                    assert!(text.contains("\"error\":\"request_timeout\""), "{text}");
                    return Trickle::TimedOut(started.elapsed());
                }
                return Trickle::Closed(started.elapsed());
            }
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Err(_) if !wrote => return Trickle::Closed(started.elapsed()),
            Err(_) => {}
        }
    }
    Trickle::StillOpen
}

/// Connections that trickle a lease API body (one byte every 200 ms, with
/// a Content-Length or chunked, on the HTTP/1.1 loop and on the general
/// path) take every connection slot of the api listener: each is cut off
/// at the body deadline (408 JSON, then closed), and /healthz answers again
/// within it.
#[tokio::test(flavor = "multi_thread")]
async fn slow_bodies_on_the_api_listener_are_cut_off_at_the_deadline() {
    for fast in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let cfg = format!(
            "[server]\nmax_connections = 4\nheader_read_timeout_ms = 5000\nbody_read_timeout_ms = 1000\n\
             api_fast_path = {fast}\n"
        );
        let gw = Gateway::start(&dir.path().join("data"), Opts { config: Some(cfg), ..Opts::default() });
        let tricklers: Vec<_> = (0..4).map(|i| tokio::spawn(trickle(gw.api, i % 2 == 1))).collect();
        tokio::time::sleep(Duration::from_millis(300)).await;
        // Every slot is taken; /healthz waits in the backlog until the
        // deadline frees one.
        let asked = Instant::now();
        let http = Http::default();
        let h = tokio::time::timeout(Duration::from_secs(5), http.get(&gw.api_url("/healthz"))).await;
        assert_eq!(h.expect("/healthz must answer once the slow bodies are cut off").status, StatusCode::OK);
        assert!(asked.elapsed() < Duration::from_secs(3), "fast={fast}: /healthz took {:?}", asked.elapsed());
        for t in tricklers {
            match t.await.unwrap() {
                Trickle::TimedOut(after) | Trickle::Closed(after) => {
                    assert!(after < Duration::from_millis(2500), "fast={fast}: cut off only after {after:?}")
                }
                Trickle::StillOpen => panic!("fast={fast}: a body trickled for 10 s without being cut off"),
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn thousands_of_idle_connections() {
    let r = rig().await;
    let mut idle = Vec::new();
    for i in 0..3000 {
        let addr = if i % 2 == 0 { r.gw.api } else { r.gw.proxy };
        idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
    }
    r.still_fine(0).await;
    drop(idle);
}

#[tokio::test(flavor = "multi_thread")]
async fn request_closed_mid_body_never_reaches_the_upstream_whole() {
    let r = rig().await;
    let t = r.held.token.to_string();
    for _ in 0..20 {
        let mut s = tokio::net::TcpStream::connect(r.gw.proxy).await.unwrap();
        let head =
            format!("PUT /held/key HTTP/1.1\r\nhost: x\r\nx-fencing-token: {t}\r\ncontent-length: 100000\r\n\r\n");
        s.write_all(head.as_bytes()).await.unwrap();
        s.write_all(&[b'z'; 1000]).await.unwrap();
        drop(s);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(r.rec.requests().iter().all(|s| !s.complete), "a truncated body must never arrive whole");
    // Nothing is left registered in flight: a new grant is not held up.
    let api = r.gw.api_url("");
    let other = acquire(&r.http, &api, "held/other", 1000, 0).await.unwrap();
    assert!(other.token >= 1);
    let n = r.rec.count();
    r.still_fine(n).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn h2_rapid_reset_does_not_hurt() {
    let r = rig().await;
    let stream = tokio::net::TcpStream::connect(r.gw.proxy).await.unwrap();
    let (send, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream)).await.unwrap();
    let conn = tokio::spawn(conn);
    let started = Instant::now();
    for i in 0..5000 {
        let mut send = send.clone();
        if send.ready().await.is_err() {
            break; // the server may close an abusive connection: fine
        }
        let req = Request::get(format!("http://x/held/key?{i}")).body(Empty::<Bytes>::new()).unwrap();
        // Start the request and drop it at once: RST_STREAM.
        let fut = send.send_request(req);
        drop(fut);
        if started.elapsed() > Duration::from_secs(10) {
            break;
        }
    }
    conn.abort();
    // Reads may have reached the upstream; that is allowed. Health and state
    // are what matter. A read forwarded just before its reset is counted
    // when the upstream has answered it: wait until the count settles.
    let mut n = r.rec.count();
    let settling = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let m = r.rec.count();
        if m == n || settling.elapsed() > Duration::from_secs(10) {
            break;
        }
        n = m;
    }
    assert!(r.rec.requests().iter().all(|s| s.method == Method::GET));
    r.still_fine(n).await;
}

/// `[server] max_connections_per_address`: one client address cannot hold
/// the whole listener; a connection beyond the bound is closed at once and
/// the address gets its slots back as its connections close.
#[tokio::test(flavor = "multi_thread")]
async fn one_address_may_hold_only_so_many_connections() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = "[server]\nmax_connections_per_address = 2\n".to_string();
    let gw = Gateway::start(&dir.path().join("data"), Opts { config: Some(cfg), ..Opts::default() });
    // The start-up check's own connections must have closed first.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let mut open = Vec::new();
    for _ in 0..2 {
        // Each answered once: both are open and counted.
        let mut c = tokio::net::TcpStream::connect(gw.api).await.unwrap();
        c.write_all(b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n").await.unwrap();
        let mut buf = [0u8; 256];
        let n = tokio::time::timeout(Duration::from_secs(5), c.read(&mut buf)).await.unwrap().unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{:?}", String::from_utf8_lossy(&buf[..n]));
        open.push(c);
    }
    let (idle1, idle2) = (open.remove(0), open.remove(0));
    let mut third = tokio::net::TcpStream::connect(gw.api).await.unwrap();
    third.write_all(b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n").await.ok();
    let mut buf = [0u8; 256];
    let n = tokio::time::timeout(Duration::from_secs(5), third.read(&mut buf)).await.unwrap().unwrap_or(0);
    assert_eq!(n, 0, "the third connection is closed unanswered: {:?}", String::from_utf8_lossy(&buf[..n]));
    drop((idle1, idle2));
    let started = Instant::now();
    loop {
        let http = Http::default();
        if let Ok(r) = http.try_send(Method::GET, &gw.api_url("/healthz"), &[], Bytes::new()).await {
            assert_eq!(r.status, StatusCode::OK);
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(5), "slots came back when the connections closed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// How long until the gateway closes a connection that sent `bytes` and
/// then nothing more (None: still open after 6 s).
async fn closed_after(addr: std::net::SocketAddr, bytes: &[u8]) -> Option<Duration> {
    let started = Instant::now();
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    let mut out = Vec::new();
    match tokio::time::timeout(Duration::from_secs(6), s.read_to_end(&mut out)).await {
        Ok(_) => Some(started.elapsed()),
        Err(_) => None,
    }
}

/// hyper-util's protocol detection reads the first bytes of a connection
/// with no timer: the gateway bounds them by the header read timeout (1 s
/// here), on both listeners, with the fast paths on and off. Otherwise a
/// client that sends a part of the HTTP/2 preface, or nothing, holds a
/// connection slot for ever, and a few such sockets lock every client out.
#[tokio::test(flavor = "multi_thread")]
async fn a_connection_that_never_says_which_protocol_it_speaks_is_closed() {
    for fast in [true, false] {
        let cfg = format!(
            "[server]\nheader_read_timeout_ms = 1000\nproxy_fast_path = {fast}\napi_fast_path = {fast}\n\
             max_connections = 4\n"
        );
        let dir = tempfile::tempdir().unwrap();
        let gw = Gateway::start(&dir.path().join("data"), Opts { config: Some(cfg), ..Opts::default() });
        for addr in [gw.api, gw.proxy] {
            for bytes in [&b"PRI * HTTP/2.0\r\n\r\n"[..], b"PRI * HTTP/2", b"P", b""] {
                let took = closed_after(addr, bytes).await;
                let took = took.unwrap_or_else(|| panic!("fast={fast} {addr} {bytes:?}: still open after 6 s"));
                assert!(took >= Duration::from_millis(800), "fast={fast} {bytes:?}: closed after {took:?}");
            }
            // Four silent sockets (the listener's whole bound) do not lock
            // a client out for longer than the timeout.
            let mut silent = Vec::new();
            for _ in 0..4 {
                silent.push(tokio::net::TcpStream::connect(addr).await.unwrap());
            }
            let http = Http::default();
            let h = tokio::time::timeout(Duration::from_secs(5), http.get(&format!("http://{}/healthz", gw.api)))
                .await
                .unwrap_or_else(|_| panic!("fast={fast}: locked out by silent connections"));
            assert_eq!(h.status, StatusCode::OK);
        }
    }
}

/// An HTTP/2 connection that answers PINGs but has no request in flight
/// for `idle_timeout_ms` is closed (hyper has no idle timeout: four such
/// clients held a listener of `max_connections = 4` for ever), and one
/// whose request is in flight — a `watch` longer than the timeout — is not.
#[tokio::test(flavor = "multi_thread")]
async fn idle_h2_connections_are_closed_and_busy_ones_are_not() {
    let cfg = "[server]\nidle_timeout_ms = 1000\nmax_connections = 4\n";
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(&dir.path().join("data"), Opts { config: Some(cfg.into()), ..Opts::default() });
    let h2 = |addr| async move {
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (send, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream)).await.unwrap();
        (send, tokio::spawn(conn))
    };
    // A watch of 2.5 s on an h2 connection: the connection outlives the
    // 1 s idle timeout while the request is in flight.
    let (mut send, conn) = h2(gw.api).await;
    send.ready().await.unwrap();
    let req = Request::get("http://x/v1/locks/watch?key=idle/k&after=0&timeout_ms=2500").body(Empty::<Bytes>::new());
    let started = Instant::now();
    let resp = send.send_request(req.unwrap()).await.expect("the watch was cut");
    assert_eq!(resp.status(), StatusCode::OK);
    assert!(started.elapsed() >= Duration::from_millis(2_400), "{:?}", started.elapsed());
    // Then idle: closed about a timeout after the exchange ended.
    let ended = Instant::now();
    tokio::time::timeout(Duration::from_secs(5), conn).await.expect("idle h2 connection still open after 5 s").ok();
    let took = ended.elapsed();
    assert!(took >= Duration::from_millis(900), "closed after {took:?}");
    // Four idle h2 connections (the listener's whole bound) do not lock a
    // client out for longer than the timeout.
    let mut idle = Vec::new();
    for _ in 0..4 {
        idle.push(h2(gw.api).await);
    }
    let http = Http::default();
    let started = Instant::now();
    let got = loop {
        match tokio::time::timeout(Duration::from_millis(500), http.get(&gw.api_url("/healthz"))).await {
            Ok(r) => break r,
            Err(_) => assert!(started.elapsed() < Duration::from_secs(5), "locked out by idle h2 connections"),
        }
    };
    assert_eq!(got.status, StatusCode::OK);
    for (_, c) in idle {
        tokio::time::timeout(Duration::from_secs(5), c).await.expect("an idle h2 connection stayed open").ok();
    }
}

/// A client that shuts its write side after its request (`nc -N`) gets its
/// answer on the fast path (the general path treats it as a hang-up: hyper
/// cannot tell the two apart, and a hang-up must drop an abandoned acquire
/// from its queue); a chunked body that cannot be parsed is the request's
/// fault (400), not the upstream's.
#[tokio::test(flavor = "multi_thread")]
async fn half_closed_requests_and_broken_chunked_bodies() {
    let rec = Recorder::start().await;
    for fast in [true, false] {
        let cfg = format!(
            "[server]\nproxy_fast_path = {fast}\n[[routes]]\nmatch = \"/{{*path}}\"\nupstream = \"{}\"\n",
            rec.url()
        );
        let dir = tempfile::tempdir().unwrap();
        let gw = Gateway::start(&dir.path().join("data"), Opts { config: Some(cfg), ..Opts::default() });
        let http = Http::default();
        let g = acquire(&http, &gw.api_url(""), "k", 600_000, 0).await.unwrap();
        let complete = || rec.requests().iter().filter(|r| r.complete).count();
        let before = complete();
        let mut s = tokio::net::TcpStream::connect(gw.proxy).await.unwrap();
        let req = format!("PUT /k HTTP/1.1\r\nHost: x\r\nX-Fencing-Token: {}\r\nContent-Length: 2\r\n\r\nok", g.token);
        s.write_all(req.as_bytes()).await.unwrap();
        s.shutdown().await.unwrap();
        let mut out = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
        let out = String::from_utf8_lossy(&out);
        if fast {
            assert!(out.starts_with("HTTP/1.1 200"), "a half-closed request got {out:?}");
            assert_eq!(complete(), before + 1);
        } else {
            // A hang-up: dropped before or after its exchange began, as any
            // client that goes away (never applied twice). An exchange that
            // began may still reach the upstream after the client saw the
            // close: its fate settles before the next count is taken.
            tokio::time::sleep(Duration::from_millis(1000)).await;
            assert!(complete() <= before + 1);
        }
        let before = complete();

        let req = format!(
            "PUT /k HTTP/1.1\r\nHost: x\r\nX-Fencing-Token: {}\r\nTransfer-Encoding: chunked\r\n\r\n\
             2\r\nok\r\nffffffffffffffffff\r\n",
            g.token
        );
        let out = raw(gw.proxy, req.as_bytes()).await;
        assert!(out.starts_with("HTTP/1.1 400"), "fast={fast}: a broken chunked body got {out:?}");
        assert!(out.contains("\"bad_request\""), "fast={fast}: {out}");
        assert_eq!(complete(), before, "fast={fast}: a truncated body reached the upstream whole");
    }
}

/// One frame as the gateway sent it: type, flags, stream, payload.
pub(crate) type RawFrame = (u8, u8, u32, Vec<u8>);

/// A raw HTTP/2 stream (id 1), so that a stream can say one thing in its
/// `content-length` and carry another in its DATA frames, or end with a
/// reset (no HTTP/2 client library sends either). HEADERS with literal
/// fields (no Huffman), never with END_STREAM.
pub(crate) struct RawH2 {
    s: tokio::net::TcpStream,
    buf: Vec<u8>,
}

fn h2_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// The first whole frame in `buf`, taken out of it.
fn take_frame(buf: &mut Vec<u8>) -> Option<RawFrame> {
    if buf.len() < 9 {
        return None;
    }
    let len = (usize::from(buf[0]) << 16) | (usize::from(buf[1]) << 8) | usize::from(buf[2]);
    if buf.len() < 9 + len {
        return None;
    }
    let stream = u32::from_be_bytes([buf[5], buf[6], buf[7], buf[8]]) & 0x7fff_ffff;
    let frame = (buf[3], buf[4], stream, buf[9..9 + len].to_vec());
    buf.drain(..9 + len);
    Some(frame)
}

/// An HPACK block of literal fields (no Huffman, no indexing).
fn header_block(fields: &[(&str, &str)]) -> Vec<u8> {
    let mut block = Vec::new();
    for (name, value) in fields {
        assert!(name.len() < 127 && value.len() < 127);
        block.push(0x00); // literal without indexing, new name
        block.push(name.len() as u8);
        block.extend_from_slice(name.as_bytes());
        block.push(value.len() as u8);
        block.extend_from_slice(value.as_bytes());
    }
    block
}

impl RawH2 {
    pub(crate) async fn open(addr: std::net::SocketAddr, fields: &[(&str, &str)]) -> RawH2 {
        RawH2::open_with(addr, &[], fields).await
    }

    /// `settings`: the payload of the client's SETTINGS frame.
    pub(crate) async fn open_with(addr: std::net::SocketAddr, settings: &[u8], fields: &[(&str, &str)]) -> RawH2 {
        let block = header_block(fields);
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        out.extend(h2_frame(0x4, 0, 0, settings)); // SETTINGS
        out.extend(h2_frame(0x1, 0x4, 1, &block)); // HEADERS, END_HEADERS, not END_STREAM
        s.write_all(&out).await.unwrap();
        RawH2 { s, buf: Vec::new() }
    }

    /// DATA on stream 1, with END_STREAM if `end`.
    pub(crate) async fn data(&mut self, d: &[u8], end: bool) {
        self.s.write_all(&h2_frame(0x0, u8::from(end), 1, d)).await.unwrap();
    }

    /// Trailers on stream 1 (HEADERS with END_STREAM).
    pub(crate) async fn trailers(&mut self, fields: &[(&str, &str)]) {
        self.s.write_all(&h2_frame(0x1, 0x5, 1, &header_block(fields))).await.unwrap();
    }

    /// RST_STREAM on stream 1 with `code` (0: NO_ERROR).
    pub(crate) async fn reset(&mut self, code: u32) {
        self.s.write_all(&h2_frame(0x3, 0, 1, &code.to_be_bytes())).await.unwrap();
    }

    /// The frames the gateway sent on stream 1 until it ended the stream
    /// (or `limit`).
    pub(crate) async fn answer(&mut self, limit: Duration) -> Vec<RawFrame> {
        let mut got = Vec::new();
        let deadline = Instant::now() + limit;
        loop {
            while let Some((kind, flags, stream, payload)) = take_frame(&mut self.buf) {
                if kind == 0x4 && flags & 0x1 == 0 {
                    self.s.write_all(&h2_frame(0x4, 0x1, 0, &[])).await.unwrap();
                    // SETTINGS ACK
                }
                let ended = stream == 1 && (kind == 0x3 || (flags & 0x1 == 1 && (kind == 0x0 || kind == 0x1)));
                let gone = kind == 0x7;
                if stream == 1 || gone {
                    got.push((kind, flags, stream, payload));
                }
                if ended || gone {
                    return got;
                }
            }
            let mut chunk = [0u8; 4096];
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.s.read(&mut chunk)).await {
                Ok(Ok(n)) if n > 0 => self.buf.extend_from_slice(&chunk[..n]),
                _ => return got,
            }
        }
    }
}

/// One raw exchange: HEADERS, then one DATA frame per item of `data`, the
/// last with END_STREAM; what the gateway sent on the stream within 3 s.
async fn h2_raw(addr: std::net::SocketAddr, fields: &[(&str, &str)], data: &[&[u8]]) -> Vec<RawFrame> {
    let mut h2 = RawH2::open(addr, fields).await;
    for (i, d) in data.iter().enumerate() {
        h2.data(d, i + 1 == data.len()).await;
    }
    h2.answer(Duration::from_secs(3)).await
}

/// The first byte of a HEADERS block from hyper: 0x88 is `:status 200`
/// from HPACK's static table.
pub(crate) fn answered_200(frames: &[RawFrame]) -> bool {
    frames.iter().any(|(kind, _, _, payload)| *kind == 0x1 && payload.first() == Some(&0x88))
}

/// An HTTP/2 request whose DATA goes past its `content-length` is
/// malformed (RFC 9113 §8.1.1) and must not be forwarded. The gateway must
/// not send the upstream the declared bytes as a complete request before it
/// knows the stream ended where it said: a declared-empty body is read to
/// its end before the head is sent, and the frame that completes a declared
/// length is held until the end of the stream. Well-formed streams that
/// end with an empty DATA frame still pass, byte for byte.
#[tokio::test(flavor = "multi_thread")]
async fn an_h2_body_longer_than_its_content_length_never_reaches_the_upstream_whole() {
    let r = rig().await;
    let t = r.held.token.to_string();
    let fields = |cl: &'static str| {
        vec![
            (":method", "PUT"),
            (":scheme", "http"),
            (":path", "/held/key"),
            (":authority", "x"),
            ("content-length", cl),
            ("x-fencing-token", t.as_str()),
        ]
    };
    // (what, content-length, DATA frames, the body the upstream applies)
    type Case = (&'static str, &'static str, &'static [&'static [u8]], Option<&'static [u8]>);
    let cases: [Case; 5] = [
        ("empty declared, bytes sent", "0", &[b"WORLD"], None),
        ("five declared, six sent", "5", &[b"HELLO", b"X"], None),
        ("five declared, six sent at once", "5", &[b"HELLOX"], None),
        ("empty declared, empty DATA ends it", "0", &[b""], Some(b"")),
        ("five declared, empty DATA ends it", "5", &[b"HELLO", b""], Some(b"HELLO")),
    ];
    for (what, cl, data, applied) in cases {
        let before = r.rec.count();
        let frames = h2_raw(r.gw.proxy, &fields(cl), data).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let seen: Vec<_> = r.rec.requests().into_iter().skip(before).collect();
        let whole: Vec<_> = seen.iter().filter(|s| s.complete).collect();
        match applied {
            None => {
                assert!(whole.is_empty(), "{what}: the upstream got a complete request {:?}", whole[0].body);
                assert!(!answered_200(&frames), "{what}: the client was told it succeeded: {frames:?}");
            }
            Some(body) => {
                assert!(answered_200(&frames), "{what}: not answered 200: {frames:?}");
                assert_eq!(whole.len(), 1, "{what}: forwarded once");
                assert_eq!(whole[0].body, Bytes::from_static(body), "{what}");
            }
        }
    }
    r.still_fine(r.rec.count()).await;
}

/// The request fields of a raw HTTP/2 PUT of `path` with `token`.
fn put_fields<'a>(path: &'a str, content_length: Option<&'a str>, token: &'a str) -> Vec<(&'a str, &'a str)> {
    let mut f = vec![(":method", "PUT"), (":scheme", "http"), (":path", path), (":authority", "x")];
    if let Some(cl) = content_length {
        f.push(("content-length", cl));
    }
    f.push(("x-fencing-token", token));
    f
}

/// A declared-empty HTTP/2 PUT whose stream stays open is waited for
/// through the fence: a new grant of its key cuts it off at once (the
/// grant is not held up until the upstream timeout), and when its client
/// ends the stream later, nothing reaches the upstream.
#[tokio::test(flavor = "multi_thread")]
async fn a_declared_empty_h2_body_left_open_is_cut_off_by_a_new_grant() {
    let rec = Recorder::start().await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = format!(
        "[[routes]]\nmatch = \"/{{*path}}\"\nupstream = \"{}\"\nupstream_timeout_ms = 20000\n\n\
         [locks]\nactivation_timeout_ms = 30000\n",
        rec.url()
    );
    let gw = Gateway::start(&dir.path().join("data"), Opts { config: Some(cfg), ..Opts::default() });
    let http = Http::default();
    let api = gw.api_url("");
    let old = acquire(&http, &api, "open/key", 600_000, 0).await.unwrap();
    let t = old.token.to_string();
    let mut h2 = RawH2::open(gw.proxy, &put_fields("/open/key", Some("0"), &t)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    common::release(&http, &api, &old).await;
    let asked = Instant::now();
    let new = acquire(&http, &api, "open/key", 600_000, 0).await.unwrap();
    assert!(asked.elapsed() < Duration::from_secs(5), "the grant waited {:?} for the open stream", asked.elapsed());
    h2.data(b"", true).await;
    let frames = h2.answer(Duration::from_secs(3)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!answered_200(&frames), "the cut-off write was answered 200: {frames:?}");
    assert_eq!(rec.count(), 0, "the old holder's write reached the upstream: {:?}", rec.requests()[0].headers);
    // The new holder writes.
    let r =
        http.send(Method::PUT, &gw.proxy_url("/open/key"), &[("x-fencing-token", &new.token.to_string())], "v").await;
    assert_eq!(r.status, StatusCode::OK);
}

/// hyper ends an HTTP/2 request body that the client reset with NO_ERROR
/// as if it were complete; the gateway takes only END_STREAM as the end: a
/// reset upload never reaches the upstream (or the built-in store) whole,
/// with or without a length, nor is answered 200.
#[tokio::test(flavor = "multi_thread")]
async fn an_h2_upload_reset_with_no_error_before_its_length_is_not_forwarded_whole() {
    let r = rig().await;
    let t = r.held.token.to_string();
    // Short of its length; all of it but reset instead of ended; no
    // length at all (forwarded chunked: only the end of the stream can
    // say it is whole).
    for (length, sent) in [(Some("5"), &b"hel"[..]), (Some("5"), &b"hello"[..]), (None, &b"hel"[..])] {
        let mut h2 = RawH2::open(r.gw.proxy, &put_fields("/held/key", length, &t)).await;
        h2.data(sent, false).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        h2.reset(0).await;
        let frames = h2.answer(Duration::from_secs(2)).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!answered_200(&frames), "{length:?} {sent:?}: {frames:?}");
        let whole: Vec<_> = r.rec.requests().into_iter().filter(|s| s.complete).collect();
        assert!(whole.is_empty(), "{length:?}: a truncated upload arrived whole: {:?}", whole[0].body);
    }
    r.still_fine(r.rec.count()).await;
    // The built-in store reads the body itself: the object keeps its
    // old content.
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(&dir.path().join("data"), Opts::default());
    let http = Http::default();
    let g = acquire(&http, &gw.api_url(""), "obj", 600_000, 0).await.unwrap();
    let t = g.token.to_string();
    let put = http.send(Method::PUT, &gw.proxy_url("/obj"), &[("x-fencing-token", &t)], "GOOD-CONTENT").await;
    assert!(put.status.is_success(), "{}", put.status);
    for length in [Some("5"), None] {
        let mut h2 = RawH2::open(gw.proxy, &put_fields("/obj", length, &t)).await;
        h2.data(b"NEW", false).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        h2.reset(0).await;
        let frames = h2.answer(Duration::from_secs(2)).await;
        assert!(!answered_200(&frames), "{frames:?}");
        tokio::time::sleep(Duration::from_millis(300)).await;
        let got = http.get(&gw.proxy_url("/obj")).await;
        assert_eq!(got.body, Bytes::from_static(b"GOOD-CONTENT"), "{length:?}: a truncated upload replaced the object");
    }
}

/// A gateway whose idle timeout is 1 s, its built-in file store holding
/// `size` bytes at `/big`, and an HTTP/2 GET of it sent by a client that
/// opens no flow-control window for its streams
/// (SETTINGS_INITIAL_WINDOW_SIZE = 0: no stream may send DATA yet).
async fn windowless_download(dir: &std::path::Path, size: usize) -> (Gateway, RawH2) {
    let cfg = "[server]\nidle_timeout_ms = 1000\n";
    let gw = Gateway::start(&dir.join("data"), Opts { config: Some(cfg.into()), ..Opts::default() });
    let http = Http::default();
    let g = acquire(&http, &gw.api_url(""), "big", 600_000, 0).await.unwrap();
    let token = g.token.to_string();
    let put = http.send(Method::PUT, &gw.proxy_url("/big"), &[("x-fencing-token", &token)], vec![b'z'; size]).await;
    assert!(put.status.is_success(), "{}", put.status);
    let no_window = [0x00, 0x04, 0, 0, 0, 0];
    let get = [(":method", "GET"), (":scheme", "http"), (":path", "/big"), (":authority", "x")];
    let mut h2 = RawH2::open_with(gw.proxy, &no_window, &get).await;
    h2.data(b"", true).await;
    (gw, h2)
}

/// A response the client never takes (an h2 client that opens no
/// flow-control window for it) does not keep its connection, nor a slot of
/// the listener, for ever: closed about one idle timeout after the body
/// stalled (nginx's `send_timeout`), though the request is in flight.
#[tokio::test(flavor = "multi_thread")]
async fn a_response_the_client_never_takes_does_not_hold_its_connection() {
    let dir = tempfile::tempdir().unwrap();
    let (_gw, mut h2) = windowless_download(dir.path(), 256 * 1024).await;
    let started = Instant::now();
    // The head arrives, no DATA can; then the connection must close.
    let mut closed = false;
    let mut chunk = [0u8; 4096];
    while started.elapsed() < Duration::from_secs(6) {
        match tokio::time::timeout(Duration::from_millis(500), h2.s.read(&mut chunk)).await {
            Ok(Ok(0)) | Ok(Err(_)) => {
                closed = true;
                break;
            }
            _ => {}
        }
    }
    let took = started.elapsed();
    assert!(closed, "a stalled response kept its connection for {took:?}");
    assert!(took >= Duration::from_millis(900), "closed after {took:?}, before the timeout");
}

impl RawH2 {
    /// WINDOW_UPDATE of `increment` on stream 1 and on the connection;
    /// false if the connection is gone.
    async fn open_window(&mut self, increment: u32) -> bool {
        let mut out = h2_frame(0x8, 0, 1, &increment.to_be_bytes());
        out.extend(h2_frame(0x8, 0, 0, &increment.to_be_bytes()));
        self.s.write_all(&out).await.is_ok()
    }
}

/// The other side of the stall close: a client that reads a large download
/// slowly but steadily keeps it. The built-in file store hands the gateway
/// 64 KiB frames; this client opens 16 KiB of window every 400 ms, so each
/// such frame takes 1.6 s to go out, more than the 1 s timeout. Counted per
/// frame, the download was cut after its first frame; counted per piece
/// the client took, it completes.
#[tokio::test(flavor = "multi_thread")]
async fn a_slow_but_steady_h2_reader_of_large_frames_gets_the_whole_download() {
    let dir = tempfile::tempdir().unwrap();
    let size = 200 * 1024;
    let (_gw, mut h2) = windowless_download(dir.path(), size).await;
    let started = Instant::now();
    let (mut received, mut ended, mut closed) = (0usize, false, false);
    while !ended && !closed && started.elapsed() < Duration::from_secs(30) {
        let frames = h2.answer(Duration::from_millis(400)).await;
        for (kind, flags, _, payload) in &frames {
            match kind {
                0x0 => {
                    received += payload.len();
                    ended |= flags & 0x1 == 1;
                }
                0x3 | 0x7 => closed = true,
                _ => {}
            }
        }
        if !ended && !closed {
            closed = !h2.open_window(16 * 1024).await;
        }
    }
    assert!(!closed, "the download was cut after {received} of {size} bytes ({:?})", started.elapsed());
    assert!(ended && received == size, "{received} of {size} bytes, ended: {ended}, in {:?}", started.elapsed());
}

/// An upstream that answers every request on a connection with `size`
/// bytes (a `Content-Length` body, sent 64 KiB at a time with a pause
/// between): a large download.
async fn big_upstream(size: usize) -> String {
    big_upstream_framed(size, false).await
}

/// [`big_upstream`]; `close`: the body's end is the connection's
/// (no `Content-Length`).
async fn big_upstream_framed(size: usize, close: bool) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                let body = vec![b'z'; size];
                loop {
                    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                        match s.read(&mut chunk).await {
                            Ok(n) if n > 0 => buf.extend_from_slice(&chunk[..n]),
                            _ => return,
                        }
                    }
                    buf.clear();
                    let head = if close {
                        "HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n".to_string()
                    } else {
                        format!("HTTP/1.1 200 OK\r\nContent-Length: {size}\r\n\r\n")
                    };
                    if s.write_all(head.as_bytes()).await.is_err() {
                        return;
                    }
                    // In pieces with pauses: the gateway's reads of the
                    // upstream often find nothing yet (`Pending`).
                    for piece in body.chunks(64 * 1024) {
                        if s.write_all(piece).await.is_err() {
                            return;
                        }
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                    if close {
                        return;
                    }
                }
            });
        }
    });
    format!("http://{addr}")
}

/// A gateway in front of [`big_upstream`], its idle timeout 1 s, and a GET
/// sent on a connection whose receive buffer is small.
async fn h1_download(dir: &std::path::Path, size: usize, fast: bool) -> (Gateway, tokio::net::TcpStream) {
    let cfg = format!("[server]\nidle_timeout_ms = 1000\nproxy_fast_path = {fast}\n");
    let upstream = Some(big_upstream(size).await);
    let gw = Gateway::start(&dir.join("data"), Opts { config: Some(cfg), upstream, ..Opts::default() });
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(16 * 1024).unwrap();
    let mut s = socket.connect(gw.proxy).await.unwrap();
    s.write_all(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    (gw, s)
}

/// Reads what is left on `s` within `limit`: the byte count, and whether the
/// gateway ended the connection (EOF or reset) before `want` bytes came.
async fn drain(s: &mut tokio::net::TcpStream, want: usize, limit: Duration) -> (usize, bool) {
    let deadline = Instant::now() + limit;
    let (mut n, mut chunk) = (0usize, vec![0u8; 64 * 1024]);
    while n < want {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, s.read(&mut chunk)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return (n, true),
            Ok(Ok(k)) => n += k,
            Err(_) => break,
        }
    }
    (n, false)
}

/// An HTTP/1.1 client that asks for a large response and stops reading
/// does not hold its connection (and the upstream connection behind it)
/// for ever: once it has taken nothing for the idle timeout the gateway
/// closes it (nginx's `send_timeout`), on the fast path and on hyper.
#[tokio::test(flavor = "multi_thread")]
async fn an_h1_client_that_stops_reading_a_download_is_closed() {
    let size = 16 * 1024 * 1024;
    for fast in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let (_gw, mut s) = h1_download(dir.path(), size, fast).await;
        // Stop reading long enough for the gateway to give up on us.
        tokio::time::sleep(Duration::from_secs(4)).await;
        let (got, closed) = drain(&mut s, size, Duration::from_secs(20)).await;
        assert!(closed && got < size, "fast={fast}: a client that stopped reading kept its download ({got} bytes)");
    }
}

/// ... while one that reads slowly but steadily (32 KiB every 100 ms,
/// against a 1 s timeout) gets the whole of it.
#[tokio::test(flavor = "multi_thread")]
async fn a_slow_but_steady_h1_reader_gets_the_whole_download() {
    let size = 1024 * 1024;
    for fast in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let (_gw, mut s) = h1_download(dir.path(), size, fast).await;
        let (mut n, mut chunk) = (0usize, vec![0u8; 32 * 1024]);
        let started = Instant::now();
        let mut closed = false;
        while n < size && started.elapsed() < Duration::from_secs(60) {
            tokio::time::sleep(Duration::from_millis(100)).await;
            match tokio::time::timeout(Duration::from_secs(5), s.read(&mut chunk)).await {
                Ok(Ok(0)) | Ok(Err(_)) => {
                    closed = true;
                    break;
                }
                Ok(Ok(k)) => n += k,
                Err(_) => break,
            }
        }
        assert!(
            n >= size,
            "fast={fast}: {n} bytes of {size}+head before {}",
            if closed { "a close" } else { "the end" }
        );
    }
}

/// An idle HTTP/2 connection is closed with a GOAWAY (NO_ERROR), not a bare
/// close: a client that sends a request at that moment learns from the
/// GOAWAY's last stream id that it was not processed, and may send it again
/// on a new connection (a bare close leaves it not knowing whether a PUT
/// was applied).
#[tokio::test(flavor = "multi_thread")]
async fn an_idle_h2_connection_is_closed_with_a_goaway() {
    let cfg = "[server]\nidle_timeout_ms = 1000\n";
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(&dir.path().join("data"), Opts { config: Some(cfg.into()), ..Opts::default() });
    for addr in [gw.proxy, gw.api] {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        out.extend(h2_frame(0x4, 0, 0, &[])); // SETTINGS
        s.write_all(&out).await.unwrap();
        let started = Instant::now();
        let (mut buf, mut chunk) = (Vec::new(), [0u8; 4096]);
        let mut goaway = None;
        let closed = loop {
            while let Some((kind, flags, _, payload)) = take_frame(&mut buf) {
                match (kind, flags & 0x1) {
                    (0x4, 0) => s.write_all(&h2_frame(0x4, 0x1, 0, &[])).await.unwrap(), // SETTINGS ACK
                    (0x6, 0) => {
                        let _ = s.write_all(&h2_frame(0x6, 0x1, 0, &payload)).await;
                        // PING ACK
                    }
                    (0x7, _) => goaway = Some(u32::from_be_bytes([payload[4], payload[5], payload[6], payload[7]])),
                    _ => {}
                }
            }
            match tokio::time::timeout(Duration::from_secs(15), s.read(&mut chunk)).await {
                Ok(Ok(n)) if n > 0 => buf.extend_from_slice(&chunk[..n]),
                Ok(_) => break true,
                Err(_) => break false,
            }
        };
        let took = started.elapsed();
        assert!(closed, "{addr}: an idle h2 connection was still open after {took:?}");
        assert!(took >= Duration::from_millis(900), "{addr}: closed after {took:?}, before the timeout");
        assert_eq!(goaway, Some(0), "{addr}: closed without a GOAWAY (NO_ERROR) after {took:?}");
    }
}

/// A close-delimited download (the upstream marks its end by closing) cut
/// short by the gateway — here a client that stopped reading — ends with a
/// reset, not a FIN: a FIN would end it as if it were whole.
#[tokio::test(flavor = "multi_thread")]
async fn a_close_delimited_download_cut_short_ends_with_a_reset() {
    let size = 16 * 1024 * 1024;
    let cfg = "[server]\nidle_timeout_ms = 1000\n".to_string();
    let upstream = Some(big_upstream_framed(size, true).await);
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(&dir.path().join("data"), Opts { config: Some(cfg), upstream, ..Opts::default() });
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(16 * 1024).unwrap();
    let mut s = socket.connect(gw.proxy).await.unwrap();
    s.write_all(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let (mut n, mut chunk) = (0usize, vec![0u8; 64 * 1024]);
    let end = loop {
        match tokio::time::timeout(Duration::from_secs(20), s.read(&mut chunk)).await {
            Ok(Ok(0)) => break "a clean end (FIN)",
            Ok(Ok(k)) => n += k,
            Ok(Err(_)) => break "a reset",
            Err(_) => break "nothing for 20 s",
        }
    };
    assert!(n < size, "the whole body came ({n} bytes): the client was not cut");
    assert_eq!(end, "a reset", "a cut close-delimited download ended with {end} after {n} bytes");
}

/// Other streams of the connection that keep moving (a HEAD every 300 ms,
/// which needs no window) do not keep a stalled stream — and the upstream
/// connection behind it — for ever: the stall is judged per response.
#[tokio::test(flavor = "multi_thread")]
async fn a_stalled_h2_stream_is_not_kept_by_other_streams_that_move() {
    let dir = tempfile::tempdir().unwrap();
    let (_gw, mut h2) = windowless_download(dir.path(), 256 * 1024).await;
    let head = header_block(&[(":method", "HEAD"), (":scheme", "http"), (":path", "/big"), (":authority", "x")]);
    let started = Instant::now();
    let mut stream = 3u32;
    let mut closed = false;
    while !closed && started.elapsed() < Duration::from_secs(8) {
        // HEADERS with END_STREAM and END_HEADERS on a new stream.
        closed = h2.s.write_all(&h2_frame(0x1, 0x5, stream, &head)).await.is_err();
        stream += 2;
        let mut chunk = [0u8; 16 * 1024];
        let until = Instant::now() + Duration::from_millis(300);
        while !closed && Instant::now() < until {
            match tokio::time::timeout(until - Instant::now(), h2.s.read(&mut chunk)).await {
                Ok(Ok(0)) | Ok(Err(_)) => closed = true,
                _ => {}
            }
        }
    }
    let took = started.elapsed();
    assert!(closed, "a stalled stream was kept for {took:?} by {} other requests", (stream - 3) / 2);
    assert!(took >= Duration::from_millis(900), "closed after {took:?}, before the timeout");
}

/// Reads from `s` into `buf` until `buf` holds `end`; false when the
/// stream ends or fails first.
async fn read_until(s: &mut tokio::net::TcpStream, buf: &mut Vec<u8>, end: &[u8]) -> bool {
    let mut chunk = [0u8; 4096];
    while !buf.windows(end.len()).any(|w| w == end) {
        match s.read(&mut chunk).await {
            Ok(n) if n > 0 => buf.extend_from_slice(&chunk[..n]),
            _ => return false,
        }
    }
    true
}

/// An upstream that answers `200` (a two-byte body) as soon as it has a request's head, then
/// reads the chunked body; it records each body's fate: complete (its last
/// chunk came) or not.
async fn early_answering_upstream() -> (String, Arc<Mutex<Vec<bool>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let fates: Arc<Mutex<Vec<bool>>> = Arc::default();
    let record = fates.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let record = record.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                if !read_until(&mut s, &mut buf, b"\r\n\r\n").await {
                    return;
                }
                if s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok").await.is_err() {
                    return;
                }
                let complete = read_until(&mut s, &mut buf, b"0\r\n\r\n").await;
                record.lock().unwrap().push(complete);
            });
        }
    });
    (format!("http://{addr}"), fates)
}

/// An upstream that answers before it has the whole body (the exchange is
/// over for the proxy) may still receive the rest and apply it: the
/// request stays in flight while its body streams, so a newer grant cuts
/// it off — also when all that comes after the grant is the end of the
/// stream (HTTP/2 END_STREAM on an empty DATA frame, or the last chunk).
/// And the client is not told of a write that was not applied: the
/// upstream's early `200` waits for the body's end, and a body cut off by
/// the newer grant is answered `409 stale_fencing_token` instead. Without
/// a newer grant the `200` comes once the body has ended.
#[tokio::test(flavor = "multi_thread")]
async fn an_upload_answered_early_is_still_cut_off_by_a_newer_grant() {
    let (upstream, fates) = early_answering_upstream().await;
    let http = Http::default();
    for (what, fast) in [("h1 fast path on", true), ("h1 fast path off", false), ("h2", true)] {
        for (rest, newer_grant) in [(&b"world"[..], true), (b"", true), (b"world", false)] {
            let case = format!("{what}, rest {:?}, newer grant {newer_grant}", String::from_utf8_lossy(rest));
            let cfg = format!("[server]\nproxy_fast_path = {fast}\n");
            let dir = tempfile::tempdir().unwrap();
            let opts = Opts { config: Some(cfg), upstream: Some(upstream.clone()), ..Opts::default() };
            let gw = Gateway::start(&dir.path().join("data"), opts);
            let api = gw.api_url("");
            let t1 = acquire(&http, &api, "early", 600_000, 0).await.unwrap();
            let before = fates.lock().unwrap().len();
            let token = t1.token.to_string();
            // The upload starts; the upstream answers 200 at once, which
            // the client must not have while its body streams.
            let mut h1 = None;
            let mut h2 = None;
            if what == "h2" {
                let fields = [
                    (":method", "PUT"),
                    (":scheme", "http"),
                    (":path", "/early"),
                    (":authority", "x"),
                    ("x-fencing-token", &token),
                ];
                let mut c = RawH2::open(gw.proxy, &fields).await;
                c.data(b"hello", false).await;
                let answer = c.answer(Duration::from_millis(700)).await;
                assert!(!answer.iter().any(|f| f.0 == 0x1), "{case}: answered while the body streams: {answer:?}");
                h2 = Some(c);
            } else {
                let mut s = tokio::net::TcpStream::connect(gw.proxy).await.unwrap();
                let head = format!(
                    "PUT /early HTTP/1.1\r\nHost: x\r\nX-Fencing-Token: {token}\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"
                );
                s.write_all(head.as_bytes()).await.unwrap();
                let mut got = [0u8; 1024];
                let early = tokio::time::timeout(Duration::from_millis(700), s.read(&mut got)).await;
                assert!(early.is_err(), "{case}: answered while the body streams: {early:?}");
                h1 = Some(s);
            }
            if newer_grant {
                release(&http, &api, &t1).await;
                let t2 = acquire(&http, &api, "early", 600_000, 0).await.unwrap();
                assert!(t2.token > t1.token);
            }
            // Then the rest of the upload, and its end; the answer.
            let answer: Vec<u8> = if let Some(c) = h2.as_mut() {
                if !rest.is_empty() {
                    c.data(rest, false).await;
                }
                c.data(b"", true).await;
                let frames = c.answer(Duration::from_secs(5)).await;
                if !newer_grant {
                    assert!(answered_200(&frames), "{case}: {frames:?}");
                }
                frames.into_iter().filter(|f| f.0 == 0x0).flat_map(|f| f.3).collect()
            } else {
                let s = h1.as_mut().unwrap();
                let tail =
                    if rest.is_empty() { "0\r\n\r\n".to_string() } else { "5\r\nworld\r\n0\r\n\r\n".to_string() };
                let _ = s.write_all(tail.as_bytes()).await;
                let mut got = vec![0u8; 4096];
                let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut got)).await.unwrap().unwrap_or(0);
                got.truncate(n);
                let status = if newer_grant { &b"HTTP/1.1 409"[..] } else { b"HTTP/1.1 200" };
                assert!(got.starts_with(status), "{case}: {:?}", String::from_utf8_lossy(&got));
                got
            };
            let text = String::from_utf8_lossy(&answer).to_string();
            tokio::time::sleep(Duration::from_millis(300)).await;
            let seen: Vec<bool> = fates.lock().unwrap()[before..].to_vec();
            if newer_grant {
                assert!(!seen.contains(&true), "{case}: the stale upload reached the upstream whole ({seen:?})");
                assert!(text.contains("stale_fencing_token"), "{case}: told {text:?}");
            } else {
                assert_eq!(seen, vec![true], "{case}: the upload reached the upstream whole");
                assert!(text.ends_with("ok"), "{case}: the upstream's answer: {text:?}");
            }
        }
    }
}

/// The same with the holder's own next write: a higher `X-Fencing-Sequence`
/// cuts off its lower-numbered upload still streaming, whose early `200`
/// then never reaches the client: it is told `409 stale_sequence` (the
/// fence did not move, its own later write overtook it).
#[tokio::test(flavor = "multi_thread")]
async fn an_upload_answered_early_and_overtaken_by_its_holders_next_sequence_is_told_so() {
    let (upstream, fates) = early_answering_upstream().await;
    let http = Http::default();
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(&dir.path().join("data"), Opts { upstream: Some(upstream), ..Opts::default() });
    let t = acquire(&http, &gw.api_url(""), "early", 600_000, 0).await.unwrap().token;
    let put = |seq: u64, body: &str| {
        format!("PUT /early HTTP/1.1\r\nHost: x\r\nX-Fencing-Token: {t}\r\nX-Fencing-Sequence: {seq}\r\nTransfer-Encoding: chunked\r\n\r\n{body}")
    };
    let mut first = tokio::net::TcpStream::connect(gw.proxy).await.unwrap();
    first.write_all(put(1, "5\r\nhello\r\n").as_bytes()).await.unwrap();
    let mut got = vec![0u8; 4096];
    let early = tokio::time::timeout(Duration::from_millis(500), first.read(&mut got)).await;
    assert!(early.is_err(), "answered while the body streams: {early:?}");
    // The holder's next write, whole: applied, answered 200.
    let mut second = tokio::net::TcpStream::connect(gw.proxy).await.unwrap();
    second.write_all(put(2, "5\r\nworld\r\n0\r\n\r\n").as_bytes()).await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(5), second.read(&mut got)).await.unwrap().unwrap();
    assert!(got[..n].starts_with(b"HTTP/1.1 200"), "{:?}", String::from_utf8_lossy(&got[..n]));
    // The first one's end comes late: cut off, and told why.
    let _ = first.write_all(b"5\r\nlater\r\n0\r\n\r\n").await;
    let n = tokio::time::timeout(Duration::from_secs(5), first.read(&mut got)).await.unwrap().unwrap_or(0);
    let answer = String::from_utf8_lossy(&got[..n]).to_string();
    assert!(answer.starts_with("HTTP/1.1 409") && answer.contains("stale_sequence"), "{answer}");
    assert!(answer.contains("\"last_sequence\":2"), "{answer}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut seen = fates.lock().unwrap().clone();
    seen.sort();
    assert_eq!(seen, vec![false, true], "only the second write reached the upstream whole");
}

/// An upstream that answered before it had the whole body may read the
/// rest, and apply it, after its answer: the exchange stays in flight
/// until the route's upstream timeout, so a newer grant waits for it and
/// the newer holder's write comes after it. Here the upstream answers the
/// first write on its head, and reads its body a second later; the second
/// (newer) write it takes at once.
#[tokio::test(flavor = "multi_thread")]
async fn a_write_answered_early_and_read_late_still_comes_before_the_next_holders() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let applied: Arc<Mutex<Vec<String>>> = Arc::default();
    let record = applied.clone();
    let first = Arc::new(std::sync::atomic::AtomicBool::new(true));
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let (record, first) = (record.clone(), first.clone());
            tokio::spawn(async move {
                let mut buf = Vec::new();
                if !read_until(&mut s, &mut buf, b"\r\n\r\n").await {
                    return;
                }
                let slow = first.swap(false, std::sync::atomic::Ordering::SeqCst);
                if s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n").await.is_err() {
                    return;
                }
                if slow {
                    tokio::time::sleep(Duration::from_millis(1500)).await;
                }
                if !read_until(&mut s, &mut buf, b"0\r\n\r\n").await {
                    return;
                }
                let text = String::from_utf8_lossy(&buf).to_lowercase();
                let token = text.split("x-fencing-token: ").nth(1).and_then(|t| t.split("\r\n").next()).unwrap_or("?");
                record.lock().unwrap().push(token.to_string());
            });
        }
    });
    let http = Http::default();
    let cfg = format!(
        "[locks]\nactivation_timeout_ms = 20000\n[[routes]]\nmatch = \"/{{*path}}\"\nupstream = \"http://{addr}\"\nupstream_timeout_ms = 4000\n"
    );
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(&dir.path().join("data"), Opts { config: Some(cfg), ..Opts::default() });
    let api = gw.api_url("");
    let t1 = acquire(&http, &api, "late", 600_000, 0).await.unwrap();
    let put = |t: u64| {
        format!(
            "PUT /late HTTP/1.1\r\nHost: x\r\nX-Fencing-Token: {t}\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"
        )
    };
    let mut c = tokio::net::TcpStream::connect(gw.proxy).await.unwrap();
    c.write_all(put(t1.token).as_bytes()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    c.write_all(b"0\r\n\r\n").await.unwrap();
    let mut got = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(5), c.read(&mut got)).await.unwrap().unwrap();
    assert!(got[..n].starts_with(b"HTTP/1.1 200"), "{:?}", String::from_utf8_lossy(&got[..n]));
    // The next holder: granted only once the first write may no longer land.
    release(&http, &api, &t1).await;
    let t2 = acquire(&http, &api, "late", 600_000, 0).await.unwrap();
    let mut c2 = tokio::net::TcpStream::connect(gw.proxy).await.unwrap();
    c2.write_all(format!("{}0\r\n\r\n", put(t2.token)).as_bytes()).await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(5), c2.read(&mut got)).await.unwrap().unwrap();
    assert!(got[..n].starts_with(b"HTTP/1.1 200"), "{:?}", String::from_utf8_lossy(&got[..n]));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let order = applied.lock().unwrap().clone();
    assert_eq!(order, vec![t1.token.to_string(), t2.token.to_string()], "applied in grant order");
}

/// An upload whose early `200` is held past the route's upstream timeout is
/// answered 504 — and cut off then, so that the upstream never gets it
/// whole: a client that retries on the 504 must not write twice.
#[tokio::test(flavor = "multi_thread")]
async fn an_early_answer_held_past_the_upstream_timeout_cuts_the_upload_off() {
    let (upstream, fates) = early_answering_upstream().await;
    let http = Http::default();
    let cfg = format!("[[routes]]\nmatch = \"/{{*path}}\"\nupstream = \"{upstream}\"\nupstream_timeout_ms = 1000\n");
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(&dir.path().join("data"), Opts { config: Some(cfg), ..Opts::default() });
    let t = acquire(&http, &gw.api_url(""), "slow", 600_000, 0).await.unwrap().token;
    let mut c = tokio::net::TcpStream::connect(gw.proxy).await.unwrap();
    let head = format!(
        "PUT /slow HTTP/1.1\r\nHost: x\r\nX-Fencing-Token: {t}\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"
    );
    c.write_all(head.as_bytes()).await.unwrap();
    let mut got = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(5), c.read(&mut got)).await.unwrap().unwrap();
    let answer = String::from_utf8_lossy(&got[..n]).to_string();
    assert!(answer.starts_with("HTTP/1.1 504") && answer.contains("upstream_timeout"), "{answer}");
    // The rest of the body, after the answer: it must not complete the upload.
    let _ = c.write_all(b"5\r\nworld\r\n0\r\n\r\n").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let seen = fates.lock().unwrap().clone();
    assert_eq!(seen, vec![false], "the upload reached the upstream whole after its 504");
}

/// A request the client sends as the idle close begins (after the first
/// GOAWAY, before it answered its PING) is taken, so it must be answered:
/// the connection is not dropped while it runs, though it runs longer than
/// the header timeout (here the upstream takes 3 s, the timeout is 2 s).
/// Dropped, the client would have a write applied and reported failed.
#[tokio::test(flavor = "multi_thread")]
async fn a_request_taken_during_the_idle_close_is_answered() {
    let rec = Recorder::start().await;
    rec.set_delay("/slow", 3000);
    let cfg = format!(
        "[server]\nidle_timeout_ms = 1000\nheader_read_timeout_ms = 2000\n[[routes]]\nmatch = \"/{{*path}}\"\nupstream = \"{}\"\n",
        rec.url()
    );
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(&dir.path().join("data"), Opts { config: Some(cfg), ..Opts::default() });
    let g = acquire(&Http::default(), &gw.api_url(""), "slow", 600_000, 0).await.unwrap();
    let token = g.token.to_string();
    let mut s = tokio::net::TcpStream::connect(gw.proxy).await.unwrap();
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    out.extend(h2_frame(0x4, 0, 0, &[]));
    s.write_all(&out).await.unwrap();
    let put = header_block(&[
        (":method", "PUT"),
        (":scheme", "http"),
        (":path", "/slow"),
        (":authority", "x"),
        ("x-fencing-token", &token),
    ]);
    let (mut buf, mut chunk) = (Vec::new(), [0u8; 4096]);
    let (mut sent, mut answered, mut pings) = (false, false, Vec::new());
    let started = Instant::now();
    while !answered && started.elapsed() < Duration::from_secs(10) {
        while let Some((kind, flags, stream, payload)) = take_frame(&mut buf) {
            match (kind, flags & 0x1) {
                (0x4, 0) => s.write_all(&h2_frame(0x4, 0x1, 0, &[])).await.unwrap(),
                // The first GOAWAY of the idle close: the request goes now,
                // and the PING is answered only after it.
                (0x7, _) if !sent => {
                    let mut req = h2_frame(0x1, 0x4, 1, &put);
                    req.extend(h2_frame(0x0, 0x1, 1, b"late"));
                    s.write_all(&req).await.unwrap();
                    sent = true;
                }
                (0x6, 0) => pings.push(payload),
                (0x1, _) if stream == 1 => answered = payload.first() == Some(&0x88),
                _ => {}
            }
        }
        for p in pings.drain(..) {
            let _ = s.write_all(&h2_frame(0x6, 0x1, 0, &p)).await;
        }
        match tokio::time::timeout(Duration::from_millis(500), s.read(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => buf.extend_from_slice(&chunk[..n]),
            Ok(_) => break,
            Err(_) => {}
        }
    }
    assert!(sent, "no GOAWAY came");
    let applied = rec.requests().iter().any(|r| r.path == "/slow" && r.complete);
    assert!(answered, "a request taken during the idle close got no answer (applied upstream: {applied})");
}

/// In shadow mode nothing cuts a stale upload, so its body does not hold
/// the next grant either: an upload answered early whose client is still
/// sending does not keep a new grant waiting (it waited for the whole
/// upload, up to the activation timeout).
#[tokio::test(flavor = "multi_thread")]
async fn in_shadow_mode_an_upload_answered_early_does_not_hold_the_next_grant() {
    let (upstream, _fates) = early_answering_upstream().await;
    let http = Http::default();
    let cfg = format!(
        "[locks]\nactivation_timeout_ms = 20000\n[[routes]]\nmatch = \"/{{*path}}\"\nupstream = \"{upstream}\"\nenforce = false\nupstream_timeout_ms = 3000\n"
    );
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(&dir.path().join("data"), Opts { config: Some(cfg), ..Opts::default() });
    let api = gw.api_url("");
    let t1 = acquire(&http, &api, "early", 600_000, 0).await.unwrap();
    let mut s = tokio::net::TcpStream::connect(gw.proxy).await.unwrap();
    let head = format!(
        "PUT /early HTTP/1.1\r\nHost: x\r\nX-Fencing-Token: {}\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
        t1.token
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let mut got = [0u8; 1024];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut got)).await.unwrap().unwrap();
    assert!(got[..n].starts_with(b"HTTP/1.1 200"), "{:?}", String::from_utf8_lossy(&got[..n]));
    // The upload goes on (the client never ends it); a newer grant comes.
    release(&http, &api, &t1).await;
    let started = Instant::now();
    let t2 = acquire(&http, &api, "early", 600_000, 0).await.unwrap();
    let took = started.elapsed();
    assert!(t2.token > t1.token);
    assert!(took < Duration::from_secs(2), "the new grant waited {took:?} for a shadow-mode upload");
    drop(s);
}

/// Reads one response (head, then a `Content-Length` body) off `s`.
async fn read_response(s: &mut tokio::net::TcpStream) -> String {
    let mut buf = Vec::new();
    let whole = tokio::time::timeout(Duration::from_secs(5), async {
        if !read_until(s, &mut buf, b"\r\n\r\n").await {
            return;
        }
        let text = String::from_utf8_lossy(&buf).to_ascii_lowercase();
        let head_len = text.find("\r\n\r\n").unwrap() + 4;
        let length = text
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or(0);
        let mut chunk = [0u8; 4096];
        while buf.len() < head_len + length {
            match s.read(&mut chunk).await {
                Ok(n) if n > 0 => buf.extend_from_slice(&chunk[..n]),
                _ => return,
            }
        }
    })
    .await;
    assert!(whole.is_ok(), "no whole response within 5 s: {:?}", String::from_utf8_lossy(&buf));
    String::from_utf8_lossy(&buf).into_owned()
}

/// How a connection ended after the gateway's last answer: a FIN (what a
/// client that reads on after writing must see) or a reset.
async fn ends_with_fin(s: &mut tokio::net::TcpStream) -> Result<(), String> {
    let mut rest = Vec::new();
    match tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut rest)).await {
        Ok(Ok(_)) if rest.is_empty() => Ok(()),
        Ok(Ok(_)) => Err(format!("more bytes after the answer: {:?}", String::from_utf8_lossy(&rest))),
        Ok(Err(e)) => Err(format!("the connection ended with {e}")),
        Err(_) => Err("the connection was not closed within 10 s".into()),
    }
}

/// A mutation refused on its head while its body is still coming (here a
/// missing token, 1 MiB): the answer says `Connection: close` (RFC 9112
/// §9.6), and the gateway reads and drops what the client goes on sending
/// before it closes (a lingering close, as nginx's), so a client that
/// writes its whole body before reading gets the answer and a FIN — not a
/// broken pipe, and not a reset that can destroy the answer unread. A body
/// that came whole with its head keeps the connection.
#[tokio::test(flavor = "multi_thread")]
async fn a_mutation_refused_before_its_body_is_read_closes_its_connection_cleanly() {
    let r = rig().await;
    const BODY: usize = 1024 * 1024;
    let head = format!("PUT /held/key HTTP/1.1\r\nHost: x\r\nContent-Length: {BODY}\r\n\r\n");

    // 1. Head and body written whole before reading.
    let s = tokio::net::TcpStream::connect(r.gw.proxy).await.unwrap();
    let (mut rd, mut wr) = s.into_split();
    let head1 = head.clone();
    let writer = tokio::spawn(async move {
        wr.write_all(head1.as_bytes()).await?;
        wr.write_all(&vec![b'x'; BODY]).await?;
        wr.flush().await?;
        Ok::<_, std::io::Error>(wr)
    });
    let mut got = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), rd.read_to_end(&mut got)).await;
    let written = writer.await.unwrap();
    let out = String::from_utf8_lossy(&got).to_ascii_lowercase();
    assert!(out.starts_with("http/1.1 428"), "a mutation with no token got {out:?}");
    assert!(out.contains("\r\nconnection: close\r\n"), "closing without saying so: {out:?}");
    assert!(written.is_ok(), "the client could not send its whole body: {:?}", written.err());
    assert!(matches!(read, Ok(Ok(_))), "the connection did not end with a FIN: {read:?}");

    // 2. The head alone: the answer comes before any body byte is sent;
    //    the body sent after it is taken and dropped, then a FIN.
    for expect in ["", "Expect: 100-continue\r\n"] {
        let mut s = tokio::net::TcpStream::connect(r.gw.proxy).await.unwrap();
        let head2 = head.replace("\r\n\r\n", &format!("\r\n{expect}\r\n"));
        s.write_all(head2.as_bytes()).await.unwrap();
        let out = read_response(&mut s).await.to_ascii_lowercase();
        assert!(out.starts_with("http/1.1 428"), "{expect:?}: {out:?}");
        assert!(!out.contains("100 continue"), "{expect:?}: a refused upload was told to go on: {out:?}");
        assert!(out.contains("\r\nconnection: close\r\n"), "{expect:?}: closing without saying so: {out:?}");
        // In pieces, as a client on a slower network would: a reset from a
        // gateway that stopped reading comes back while it writes.
        let piece = vec![b'x'; 64 * 1024];
        let sent = tokio::time::timeout(Duration::from_secs(5), async {
            for _ in 0..BODY / piece.len() {
                s.write_all(&piece).await?;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            Ok::<_, std::io::Error>(())
        })
        .await;
        assert!(matches!(sent, Ok(Ok(()))), "{expect:?}: the body after the answer: {sent:?}");
        ends_with_fin(&mut s).await.unwrap_or_else(|e| panic!("{expect:?}: {e}"));
    }

    // 3. A small body that came whole with its head: the connection stays.
    let mut s = tokio::net::TcpStream::connect(r.gw.proxy).await.unwrap();
    s.write_all(b"PUT /held/key HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n0123456789").await.unwrap();
    let out = read_response(&mut s).await.to_ascii_lowercase();
    assert!(out.starts_with("http/1.1 428"), "{out:?}");
    assert!(!out.contains("connection: close"), "a small refused body cost its connection: {out:?}");
    s.write_all(b"GET /healthz-through HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    let out = read_response(&mut s).await;
    assert!(out.starts_with("HTTP/1.1 200"), "the next request on the kept connection got {out:?}");
    r.still_fine(1).await;
}
