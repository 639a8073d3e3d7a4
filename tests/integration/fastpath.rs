//! The fast paths (plain-text HTTP/1.1: the proxy's `src/proxy/fast.rs`,
//! the api listener's `src/h1.rs`) against the real binary, on raw
//! keep-alive connections: the fence check on both proxy paths and the
//! hand-over between them on one connection, pipelining, the upstream
//! framings relayed, a pooled connection the upstream closed, the access
//! log, a prompt graceful stop with idle connections, and an acquire
//! abandoned by a hang-up leaving the queue on both api paths.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::time::{Duration, Instant};

use common::{acquire, release, Gateway, Http, Opts, Recorder};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// One response as a raw client reads it.
#[derive(Debug)]
struct Raw {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Raw {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

/// A client on one raw connection, reading responses with its own parser.
struct Client {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Client {
    async fn connect(addr: std::net::SocketAddr) -> Client {
        Client { stream: TcpStream::connect(addr).await.unwrap(), buf: Vec::new() }
    }

    async fn fill(&mut self) -> bool {
        let mut chunk = [0u8; 16384];
        let n = tokio::time::timeout(Duration::from_secs(10), self.stream.read(&mut chunk))
            .await
            .expect("response within 10 s")
            .unwrap();
        self.buf.extend_from_slice(&chunk[..n]);
        n > 0
    }

    /// Reads one response; `head`: it answers a HEAD request.
    async fn read(&mut self, head: bool) -> Raw {
        let (status, headers, len) = loop {
            let mut hs = [httparse::EMPTY_HEADER; 64];
            let mut r = httparse::Response::new(&mut hs);
            if let httparse::Status::Complete(len) = r.parse(&self.buf).unwrap() {
                let headers = r
                    .headers
                    .iter()
                    .map(|h| (h.name.to_ascii_lowercase(), String::from_utf8_lossy(h.value).into_owned()))
                    .collect::<Vec<_>>();
                break (r.code.unwrap(), headers, len);
            }
            assert!(self.fill().await, "connection closed before a response head");
        };
        self.buf.drain(..len);
        let mut raw = Raw { status, headers, body: Vec::new() };
        if head || status == 204 || status == 304 {
            return raw;
        }
        if let Some(n) = raw.header("content-length").map(|v| v.parse::<usize>().unwrap()) {
            while self.buf.len() < n {
                assert!(self.fill().await, "connection closed mid-body");
            }
            raw.body = self.buf.drain(..n).collect();
        } else if raw.header("transfer-encoding") == Some("chunked") {
            loop {
                let line_end = loop {
                    if let Some(i) = self.buf.windows(2).position(|w| w == b"\r\n") {
                        break i;
                    }
                    assert!(self.fill().await);
                };
                let line = String::from_utf8(self.buf[..line_end].to_vec()).unwrap();
                let size = usize::from_str_radix(line.split(';').next().unwrap().trim(), 16).unwrap();
                self.buf.drain(..line_end + 2);
                if size == 0 {
                    // Trailers, then the empty line.
                    loop {
                        let end = loop {
                            if let Some(i) = self.buf.windows(2).position(|w| w == b"\r\n") {
                                break i;
                            }
                            assert!(self.fill().await);
                        };
                        self.buf.drain(..end + 2);
                        if end == 0 {
                            return raw;
                        }
                    }
                }
                while self.buf.len() < size + 2 {
                    assert!(self.fill().await);
                }
                raw.body.extend(self.buf.drain(..size));
                self.buf.drain(..2);
            }
        } else {
            while self.fill().await {}
            raw.body = std::mem::take(&mut self.buf);
        }
        raw
    }

    async fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.unwrap();
    }
}

fn put(path: &str, token: &str, body: &str) -> Vec<u8> {
    format!(
        "PUT {path} HTTP/1.1\r\nHost: front\r\nX-Fencing-Token: {token}\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

fn config(fast: bool) -> String {
    format!("[server]\nproxy_fast_path = {fast}\n")
}

async fn gateway(upstream: &str, fast: bool) -> (tempfile::TempDir, Gateway) {
    gateway_with(upstream, config(fast)).await
}

async fn gateway_with(upstream: &str, config: String) -> (tempfile::TempDir, Gateway) {
    let dir = tempfile::tempdir().unwrap();
    let opts = Opts { upstream: Some(upstream.to_string()), config: Some(config), ..Opts::default() };
    let gw = Gateway::start(&dir.path().join("data"), opts);
    (dir, gw)
}

/// On each path, and across a hand-over from the fast path to the general
/// one on the same connection: only the holder's writes reach the upstream.
#[tokio::test(flavor = "multi_thread")]
async fn only_current_tokens_reach_the_upstream_on_both_paths() {
    for fast in [true, false] {
        let rec = Recorder::start().await;
        let (_d, gw) = gateway(&rec.url(), fast).await;
        let http = Http::default();
        let api = gw.api_url("");
        let old = acquire(&http, &api, "orders/1", 10_000, 0).await.unwrap();
        release(&http, &api, &old).await;
        let new = acquire(&http, &api, "orders/1", 10_000, 0).await.unwrap();
        let (old_t, new_t) = (old.token.to_string(), new.token.to_string());

        let mut c = Client::connect(gw.proxy).await;
        c.send(&put("/orders/1", &new_t, "first")).await;
        assert_eq!(c.read(false).await.status, 200, "fast={fast}");
        c.send(&put("/orders/1", &old_t, "stale")).await;
        let r = c.read(false).await;
        assert_eq!(r.status, 409, "fast={fast}");
        let err: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(err["error"], "stale_fencing_token");
        assert_eq!(err["fence"], new.token);
        c.send(&put("/orders/1", "999999", "unissued")).await;
        assert_eq!(c.read(false).await.status, 403, "fast={fast}");
        c.send(&put("/orders/1", &new_t, "second")).await;
        assert_eq!(c.read(false).await.status, 200, "fast={fast}");
        // A read with a stale token learns it at once (first on a new
        // connection: the fast path's own read check).
        let mut c = Client::connect(gw.proxy).await;
        c.send(format!("GET /orders/1 HTTP/1.1\r\nHost: front\r\nX-Fencing-Token: {old_t}\r\n\r\n").as_bytes()).await;
        assert_eq!(c.read(false).await.status, 409, "fast={fast}");

        let bodies: Vec<_> = rec.requests().iter().map(|s| String::from_utf8_lossy(&s.body).into_owned()).collect();
        assert_eq!(bodies, ["first", "second"], "fast={fast}");
        assert!(rec.requests().iter().all(|s| s.headers["x-fencing-token"] == new_t.as_str()));
    }
}

/// On each path, as raw bytes on the wire: a method that is not a read
/// (`MOVE`, `PURGE`, `MKCOL`, a lowercase `put`) needs a token, and a
/// mutation of a path with a trailing slash is refused; only the holder's
/// `MOVE` reaches the upstream. Each refused request opens the connection,
/// so the fast path decides it first.
#[tokio::test(flavor = "multi_thread")]
async fn unlisted_methods_and_trailing_slashes_are_refused_on_both_paths() {
    let req = |method: &str, path: &str, token: Option<&str>| {
        let token = token.map(|t| format!("X-Fencing-Token: {t}\r\n")).unwrap_or_default();
        format!("{method} {path} HTTP/1.1\r\nHost: front\r\n{token}Content-Length: 1\r\n\r\nx").into_bytes()
    };
    let error = |r: &Raw| serde_json::from_slice::<serde_json::Value>(&r.body).unwrap()["error"].clone();
    for fast in [true, false] {
        let rec = Recorder::start().await;
        let (_d, gw) = gateway(&rec.url(), fast).await;
        let http = Http::default();
        let g = acquire(&http, &gw.api_url(""), "orders/1", 10_000, 0).await.unwrap();
        let t = g.token.to_string();
        for m in ["MOVE", "PURGE", "MKCOL", "put"] {
            let mut c = Client::connect(gw.proxy).await;
            c.send(&req(m, "/orders/1", None)).await;
            let r = c.read(false).await;
            assert_eq!(r.status, 428, "{m} fast={fast}");
            assert_eq!(error(&r), "fencing_token_required", "{m} fast={fast}");
        }
        // Even with the live token of the key "orders/1/": it would write
        // the object of "orders/1" past that key's fence.
        let slash = acquire(&http, &gw.api_url(""), "orders/1/", 10_000, 0).await.unwrap().token.to_string();
        for m in ["PUT", "MOVE"] {
            let mut c = Client::connect(gw.proxy).await;
            c.send(&req(m, "/orders/1/", Some(&slash))).await;
            let r = c.read(false).await;
            assert_eq!(r.status, 400, "{m} fast={fast}");
            assert_eq!(error(&r), "bad_request", "{m} fast={fast}");
        }
        let mut c = Client::connect(gw.proxy).await;
        c.send(&req("MOVE", "/orders/1", Some(&t))).await;
        assert_eq!(c.read(false).await.status, 200, "fast={fast}");
        let seen: Vec<_> = rec.requests().iter().map(|s| (s.method.to_string(), s.path.clone())).collect();
        assert_eq!(seen, [("MOVE".to_string(), "/orders/1".to_string())], "fast={fast}");
    }
}

/// A mutation that names a second target in a header backends obey
/// (WebDAV `Destination`, `X-Original-URL`, `X-Rewrite-URL`) changes what
/// its path's fence does not cover: an outside review overwrote another
/// holder's object with `COPY /mine` + `Destination: /theirs`. Refused on
/// both paths, even with the path's live token; the upstream never sees
/// it. A read carrying one passes (unless a method override makes it a
/// mutation), and so does the plain `MOVE` of the holder.
#[tokio::test(flavor = "multi_thread")]
async fn a_mutation_naming_a_second_target_is_refused_on_both_paths() {
    let error = |r: &Raw| serde_json::from_slice::<serde_json::Value>(&r.body).unwrap()["error"].clone();
    for fast in [true, false] {
        let rec = Recorder::start().await;
        let (_d, gw) = gateway(&rec.url(), fast).await;
        let http = Http::default();
        let t = acquire(&http, &gw.api_url(""), "orders/1", 10_000, 0).await.unwrap().token;
        let _theirs = acquire(&http, &gw.api_url(""), "orders/2", 10_000, 0).await.unwrap().token;
        for (method, extra) in [
            ("COPY", "Destination: /orders/2"),
            ("MOVE", "destination: http://front/orders/2"),
            ("PUT", "X-Original-URL: /orders/2"),
            ("DELETE", "x-rewrite-url: /orders/2"),
            ("GET", "X-HTTP-Method-Override: COPY\r\nDestination: /orders/2"),
        ] {
            let mut c = Client::connect(gw.proxy).await;
            let req = format!(
                "{method} /orders/1 HTTP/1.1\r\nHost: front\r\nX-Fencing-Token: {t}\r\n{extra}\r\nContent-Length: 1\r\n\r\nx"
            );
            c.send(req.as_bytes()).await;
            let r = c.read(false).await;
            assert_eq!((r.status, error(&r)), (400, serde_json::json!("bad_request")), "{method} {extra} fast={fast}");
        }
        assert!(rec.requests().is_empty(), "fast={fast}: {:?}", rec.requests().len());
        // A read with one passes; the holder's plain MOVE too.
        for req in [
            "GET /orders/1 HTTP/1.1\r\nHost: front\r\nDestination: /orders/2\r\n\r\n".to_string(),
            format!("MOVE /orders/1 HTTP/1.1\r\nHost: front\r\nX-Fencing-Token: {t}\r\nContent-Length: 0\r\n\r\n"),
        ] {
            let mut c = Client::connect(gw.proxy).await;
            c.send(req.as_bytes()).await;
            assert_eq!(c.read(false).await.status, 200, "{req} fast={fast}");
        }
        let seen: Vec<_> = rec.requests().iter().map(|s| s.method.to_string()).collect();
        assert_eq!(seen, ["GET", "MOVE"], "fast={fast}");
    }
}

/// `Connection: X-Fencing-Token` would strip the token after the fence
/// check, so a backend that checks tokens itself would never see it: both
/// proxy paths refuse such a request (400) before it reaches the upstream.
#[tokio::test(flavor = "multi_thread")]
async fn connection_naming_a_fencing_header_is_refused_on_both_paths() {
    for fast in [true, false] {
        let rec = Recorder::start().await;
        let (_d, gw) = gateway(&rec.url(), fast).await;
        let http = Http::default();
        let g = acquire(&http, &gw.api_url(""), "orders/1", 10_000, 0).await.unwrap();
        let t = g.token.to_string();
        for connection in ["X-Fencing-Token", "keep-alive, x-fencing-sequence", "close,x-fencing-token"] {
            let mut c = Client::connect(gw.proxy).await;
            let req = format!(
                "PUT /orders/1 HTTP/1.1\r\nHost: front\r\nX-Fencing-Token: {t}\r\nX-Fencing-Sequence: 1\r\n\
                 Connection: {connection}\r\nContent-Length: 2\r\n\r\nhi"
            );
            c.send(req.as_bytes()).await;
            let r = c.read(false).await;
            assert_eq!(r.status, 400, "fast={fast} {connection}");
            let err: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
            assert_eq!(err["error"], "bad_request", "fast={fast}");
            assert!(err["message"].as_str().unwrap().contains("Connection"), "{err}");
        }
        assert_eq!(rec.count(), 0, "fast={fast}: nothing reached the upstream");
        // The same write without the hop-by-hop naming goes through.
        let mut c = Client::connect(gw.proxy).await;
        c.send(&put("/orders/1", &t, "ok")).await;
        assert_eq!(c.read(false).await.status, 200, "fast={fast}");
        assert_eq!(rec.requests()[0].headers["x-fencing-token"], t.as_str());
    }
}

/// Requests sent back to back in one write are answered in order, and the
/// upstream sees this hop's header edits.
#[tokio::test(flavor = "multi_thread")]
async fn pipelined_requests_are_answered_in_order_with_proxy_headers() {
    let rec = Recorder::start().await;
    let (_d, gw) = gateway(&rec.url(), true).await;
    let http = Http::default();
    let g = acquire(&http, &gw.api_url(""), "k", 10_000, 0).await.unwrap();
    let t = g.token.to_string();
    let mut c = Client::connect(gw.proxy).await;
    let mut all = put("/k", &t, "one");
    all.extend(put("/k", &t, "two"));
    all.extend(
        format!(
            "PUT /k?v=3 HTTP/1.1\r\nHost: front\r\nX-Fencing-Token: {t}\r\nX-Forwarded-For: 192.0.2.1\r\n\
             Via: 1.1 edge\r\nConnection: keep-alive\r\nContent-Length: 5\r\n\r\nthree"
        )
        .into_bytes(),
    );
    c.send(&all).await;
    for _ in 0..3 {
        let r = c.read(false).await;
        assert_eq!(r.status, 200);
        assert_eq!(r.body, b"stored");
        assert_eq!(r.header("via"), Some("1.1 fencegate"));
    }
    let seen = rec.requests();
    let bodies: Vec<_> = seen.iter().map(|s| s.body.clone()).collect();
    assert_eq!(bodies, ["one", "two", "three"]);
    let last = &seen[2].headers;
    assert_eq!(last["x-forwarded-for"], "192.0.2.1, 127.0.0.1");
    assert_eq!(last["via"], "1.1 edge, 1.1 fencegate");
    assert_eq!(last["x-forwarded-proto"], "http");
    assert_eq!(last["x-forwarded-host"], "front");
    assert_eq!(last["host"], "front");
    assert!(!last.contains_key("connection"));
}

/// A scripted upstream: answers each request by its path with a canned
/// response, counting connections.
async fn scripted_upstream() -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let conns = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = conns.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tokio::spawn(async move {
                let mut buf = Vec::new();
                loop {
                    // One request head (these tests send no bodies upstream).
                    let end = loop {
                        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            break i + 4;
                        }
                        let mut chunk = [0u8; 4096];
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    };
                    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
                    buf.drain(..end);
                    let path = head.split(' ').nth(1).unwrap_or("").to_string();
                    let (reply, close): (&[u8], bool) = match path.as_str() {
                        "/chunked" => (
                            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: x-hop\r\nX-Hop: secret\r\n\r\n\
                              5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n",
                            false,
                        ),
                        "/until-close" => (b"HTTP/1.0 200 OK\r\nX-Kind: close\r\n\r\nbody until close", true),
                        "/head" => (b"HTTP/1.1 200 OK\r\nContent-Length: 42\r\n\r\n", false),
                        "/nocontent" => (b"HTTP/1.1 204 No Content\r\n\r\n", false),
                        "/continue" => (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", false),
                        // Answers, then closes without saying so.
                        "/drop" => (b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\ndrop", true),
                        _ => (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nVia: 1.1 origin\r\n\r\nplain", false),
                    };
                    if s.write_all(reply).await.is_err() || close {
                        return;
                    }
                }
            });
        }
    });
    (format!("http://{addr}"), conns)
}

#[tokio::test(flavor = "multi_thread")]
async fn upstream_framings_are_relayed_and_the_connection_kept() {
    let (url, conns) = scripted_upstream().await;
    let (_d, gw) = gateway(&url, true).await;
    let mut c = Client::connect(gw.proxy).await;
    let get = |p: &str| format!("GET {p} HTTP/1.1\r\nHost: front\r\n\r\n").into_bytes();

    c.send(&get("/chunked")).await;
    let r = c.read(false).await;
    assert_eq!((r.status, r.body.as_slice()), (200, &b"hello world"[..]));
    assert_eq!(r.header("x-hop"), None, "a header named by Connection is hop-by-hop");
    assert_eq!(r.header("connection"), None);

    c.send(b"HEAD /head HTTP/1.1\r\nHost: front\r\n\r\n").await;
    let r = c.read(true).await;
    assert_eq!((r.status, r.header("content-length")), (200, Some("42")));

    c.send(&get("/nocontent")).await;
    assert_eq!(c.read(false).await.status, 204);

    c.send(&get("/continue")).await;
    let r = c.read(false).await;
    assert_eq!((r.status, r.body.as_slice()), (200, &b"ok"[..]));

    c.send(&get("/plain")).await;
    let r = c.read(false).await;
    assert_eq!(r.body, b"plain");
    assert_eq!(r.header("via"), Some("1.1 origin, 1.1 fencegate"));
    // All of the above on one upstream connection, kept alive.
    assert_eq!(conns.load(std::sync::atomic::Ordering::SeqCst), 1);

    // A body delimited by the upstream closing: relayed, then this client
    // connection is closed too (it has no other way to see the end).
    c.send(&get("/until-close")).await;
    let r = c.read(false).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("connection"), Some("close"));
    assert_eq!(r.body, b"body until close");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pooled_connection_the_upstream_closed_is_not_reused() {
    let (url, conns) = scripted_upstream().await;
    let (_d, gw) = gateway(&url, true).await;
    let mut c = Client::connect(gw.proxy).await;
    for i in 0..5 {
        c.send(b"GET /drop HTTP/1.1\r\nHost: front\r\n\r\n").await;
        let r = c.read(false).await;
        assert_eq!((r.status, r.body.as_slice()), (200, &b"drop"[..]), "request {i}");
        // Give the upstream's close time to arrive before the next request.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(conns.load(std::sync::atomic::Ordering::SeqCst), 5);
}

#[tokio::test(flavor = "multi_thread")]
async fn fast_path_requests_are_access_logged_and_idle_connections_do_not_hold_a_stop() {
    let rec = Recorder::start().await;
    let (_d, gw) = gateway(&rec.url(), true).await;
    let http = Http::default();
    let g = acquire(&http, &gw.api_url(""), "logged/key", 10_000, 0).await.unwrap();
    let mut idle = Vec::new();
    for _ in 0..3 {
        let mut c = Client::connect(gw.proxy).await;
        c.send(&put("/logged/key", &g.token.to_string(), "x")).await;
        assert_eq!(c.read(false).await.status, 200);
        idle.push(c);
    }
    // Access lines are buffered and written within a second (docs/metrics.md).
    let started = std::time::Instant::now();
    let log = loop {
        let log = gw.log_text();
        if log.lines().any(|l| l.contains("fencegate::access") && l.contains("logged/key"))
            || started.elapsed() > Duration::from_secs(5)
        {
            break log;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let line = log.lines().find(|l| l.contains("fencegate::access") && l.contains("logged/key")).expect("access line");
    for field in ["listener=\"proxy\"", "method=PUT", "status=200", "outcome=\"ok\"", "req_bytes=1"] {
        assert!(line.contains(field), "{field} in {line}");
    }
    // A busy connection: pipelined requests, always some waiting, until
    // the gateway closes it.
    let mut busy = Client::connect(gw.proxy).await;
    let batch: Vec<u8> = (0..8).flat_map(|_| put("/logged/key", &g.token.to_string(), "y")).collect();
    let busy_task = tokio::spawn(async move {
        let mut answered = 0u32;
        loop {
            if busy.stream.write_all(&batch).await.is_err() {
                return answered;
            }
            let mut hs = [0u8; 4096];
            match busy.stream.read(&mut hs).await {
                Ok(n) if n > 0 => answered += 1,
                _ => return answered,
            }
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    // SIGTERM with three idle keep-alive connections and a busy one open:
    // the gateway closes them and exits well within its 10 s grace.
    let started = Instant::now();
    let status = gw.terminate();
    assert!(status.success(), "{status}");
    assert!(started.elapsed() < Duration::from_secs(5), "stop took {:?}", started.elapsed());
    for mut c in idle {
        let mut b = [0u8; 1];
        assert_eq!(c.stream.read(&mut b).await.unwrap_or(0), 0, "idle connection closed");
    }
    assert!(busy_task.await.unwrap() > 0, "the busy connection was served until the stop");
}

/// A client that hangs up while its acquire waits in the queue leaves the
/// queue (its request's future is dropped): when the holder releases, the
/// next waiter gets the lock at once, not a lease handed to nobody.
#[tokio::test(flavor = "multi_thread")]
async fn an_acquire_abandoned_by_a_hang_up_leaves_the_queue() {
    for fast in [true, false] {
        let rec = Recorder::start().await;
        let (_d, gw) = gateway_with(&rec.url(), format!("[server]\napi_fast_path = {fast}\n")).await;
        let http = Http::default();
        let api = gw.api_url("");
        let holder = acquire(&http, &api, "queue/1", 30_000, 0).await.unwrap();
        let mut gone = Client::connect(gw.api).await;
        let body = r#"{"key":"queue/1","ttl_ms":30000,"wait_ms":20000}"#;
        let request =
            format!("POST /v1/locks/acquire HTTP/1.1\r\nHost: a\r\nContent-Length: {}\r\n\r\n{body}", body.len());
        gone.send(request.as_bytes()).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        drop(gone);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let started = Instant::now();
        let waiter = acquire(&http, &api, "queue/1", 30_000, 10_000);
        let releaser = async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            release(&http, &api, &holder).await
        };
        let (next, released) = tokio::join!(waiter, releaser);
        assert_eq!(released.status, 200, "fast={fast}");
        let next = next.unwrap_or_else(|r| panic!("fast={fast}: the next waiter got {}: {:?}", r.status, r.body));
        assert!(next.token > holder.token);
        assert!(started.elapsed() < Duration::from_secs(5), "fast={fast}: {:?}", started.elapsed());
    }
}

/// A zombie that hangs up while its write is at the upstream still holds
/// the next grant back until the upstream answered: its in-flight
/// registration ends with the upstream exchange, not with the client.
#[tokio::test(flavor = "multi_thread")]
async fn a_write_whose_client_hung_up_still_holds_back_the_next_grant() {
    for fast in [true, false] {
        let rec = Recorder::start().await;
        let (_d, gw) = gateway(&rec.url(), fast).await;
        let http = Http::default();
        let api = gw.api_url("");
        let old = acquire(&http, &api, "k", 10_000, 0).await.unwrap();
        rec.set_delay("/k", 1500);
        let started = Instant::now();
        let mut zombie = Client::connect(gw.proxy).await;
        zombie.send(&put("/k", &old.token.to_string(), "old")).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        drop(zombie);
        tokio::time::sleep(Duration::from_millis(100)).await;
        release(&http, &api, &old).await;
        let new = acquire(&http, &api, "k", 10_000, 0).await.unwrap();
        let waited = started.elapsed();
        assert!(new.token > old.token);
        assert!(
            waited >= Duration::from_millis(1400),
            "fast={fast}: granted after {waited:?}, old write still upstream"
        );
        assert_eq!(rec.count(), 1, "fast={fast}");
    }
}

/// Each fast path keeps one timer per connection and moves its deadline
/// lazily: a kept-alive connection must still be cut off once idle for the
/// header read timeout (counted from its last response, not its start),
/// and a route with a shorter upstream timeout than the request before it
/// on the same connection must still time out on time.
#[tokio::test(flavor = "multi_thread")]
async fn deadlines_move_with_each_request_on_a_kept_alive_connection() {
    let rec = Recorder::start().await;
    for fast in [true, false] {
        let config = format!(
            "[server]\nheader_read_timeout_ms = 1000\nproxy_fast_path = {fast}\napi_fast_path = {fast}\n\
             [[routes]]\nmatch = \"/slow/{{*p}}\"\nupstream = \"{u}\"\nupstream_timeout_ms = 300\n\
             [[routes]]\nmatch = \"/{{*path}}\"\nupstream = \"{u}\"\nupstream_timeout_ms = 5000\n",
            u = rec.url()
        );
        let dir = tempfile::tempdir().unwrap();
        let gw = Gateway::start(&dir.path().join("data"), Opts { config: Some(config), ..Opts::default() });
        for (addr, path) in [(gw.proxy, "/plain"), (gw.api, "/healthz")] {
            let mut c = Client::connect(addr).await;
            // Requests 400 ms apart: the connection outlives its first
            // deadline because each request moved it.
            for _ in 0..4 {
                c.send(format!("GET {path} HTTP/1.1\r\nHost: front\r\n\r\n").as_bytes()).await;
                assert_eq!(c.read(false).await.status, 200, "fast={fast} {path}");
                tokio::time::sleep(Duration::from_millis(400)).await;
            }
            let idle = Instant::now() - Duration::from_millis(400);
            while c.fill().await {}
            let waited = idle.elapsed();
            assert!(
                waited >= Duration::from_millis(900) && waited < Duration::from_secs(3),
                "fast={fast} {path}: an idle kept-alive connection was closed after {waited:?}, not ~1 s"
            );
        }
        // A 5 s route, then a 300 ms one on the same connection.
        rec.set_delay("/slow/b", 2000);
        let mut c = Client::connect(gw.proxy).await;
        c.send(b"GET /a HTTP/1.1\r\nHost: front\r\n\r\n").await;
        assert_eq!(c.read(false).await.status, 200);
        let sent = Instant::now();
        c.send(b"GET /slow/b HTTP/1.1\r\nHost: front\r\n\r\n").await;
        let r = c.read(false).await;
        assert_eq!(r.status, 504, "fast={fast}: the shorter upstream timeout did not fire");
        assert!(sent.elapsed() < Duration::from_millis(1500), "fast={fast}: 504 after {:?}", sent.elapsed());
    }
}

/// A fragment in the request-target (`PUT /orders/1#x`) must not fence one
/// key and write another: upstreams drop the fragment and write `orders/1`.
/// The fast path sees the raw target and refuses it with 400; the general
/// path's parser drops the fragment before the key is made, so there the
/// key is `orders/1` itself and the token of the key `orders/1#x` is
/// judged against `orders/1`'s fence. Either way nothing reaches the
/// upstream.
#[tokio::test(flavor = "multi_thread")]
async fn a_fragment_never_fences_one_key_and_writes_another() {
    for fast in [true, false] {
        let rec = Recorder::start().await;
        let (_d, gw) = gateway(&rec.url(), fast).await;
        let http = Http::default();
        let api = gw.api_url("");
        // orders/1 is held by someone else at a token that differs from
        // the one the confused client holds for the key "orders/1#x".
        let first = acquire(&http, &api, "orders/1", 10_000, 0).await.unwrap();
        release(&http, &api, &first).await;
        let _holder = acquire(&http, &api, "orders/1", 10_000, 0).await.unwrap();
        let alias = acquire(&http, &api, "orders/1#x", 10_000, 0).await.unwrap();
        let t = alias.token.to_string();
        for target in ["/orders/1#x", "/orders/1#"] {
            let mut c = Client::connect(gw.proxy).await;
            c.send(&put(target, &t, "through the alias")).await;
            let r = c.read(false).await;
            let err: serde_json::Value = serde_json::from_slice(&r.body).unwrap_or_else(|e| {
                panic!("fast={fast} {target}: {} {e}: {:?}", r.status, String::from_utf8_lossy(&r.body))
            });
            if fast {
                assert_eq!(r.status, 400, "{target}: {err}");
                assert_eq!(err["error"], "bad_request");
            } else {
                assert!(r.status == 409 || r.status == 403, "{target}: {} {err}", r.status);
            }
        }
        assert_eq!(rec.count(), 0, "fast={fast}: the upstream must not see a write through a fragment");
    }
}

/// Tokens are one sequence for every key: a client that holds `bkt` cannot
/// write `bkt/obj1` with its token although it once had the same number as
/// `bkt/obj1`'s. Above the other key's fence: 403; below it: 409.
#[tokio::test(flavor = "multi_thread")]
async fn a_live_token_of_one_key_is_refused_on_another_on_both_paths() {
    for fast in [true, false] {
        let rec = Recorder::start().await;
        let (_d, gw) = gateway(&rec.url(), fast).await;
        let http = Http::default();
        let api = gw.api_url("");
        let obj = acquire(&http, &api, "bkt/obj1", 10_000, 0).await.unwrap();
        let bucket = acquire(&http, &api, "bkt", 10_000, 0).await.unwrap();
        assert_ne!(obj.token, bucket.token, "tokens are unique across keys");
        let mut c = Client::connect(gw.proxy).await;
        // bkt's token is above bkt/obj1's fence: never issued for it.
        c.send(&put("/bkt/obj1", &bucket.token.to_string(), "mix-up")).await;
        let r = c.read(false).await;
        let err: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!((r.status, err["error"].as_str()), (403, Some("unissued_fencing_token")), "fast={fast}");
        // bkt/obj1's token is below bkt's fence.
        c.send(&put("/bkt", &obj.token.to_string(), "mix-up")).await;
        let r = c.read(false).await;
        let err: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!((r.status, err["error"].as_str()), (409, Some("stale_fencing_token")), "fast={fast}");
        // Each key's own token passes.
        c.send(&put("/bkt/obj1", &obj.token.to_string(), "own")).await;
        assert_eq!(c.read(false).await.status, 200, "fast={fast}");
        let bodies: Vec<_> = rec.requests().iter().map(|s| String::from_utf8_lossy(&s.body).into_owned()).collect();
        assert_eq!(bodies, ["own"], "fast={fast}");
    }
}

fn put_seq(path: &str, token: u64, seq: &str, body: &str) -> Vec<u8> {
    format!(
        "PUT {path} HTTP/1.1\r\nHost: front\r\nX-Fencing-Token: {token}\r\nX-Fencing-Sequence: {seq}\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Same-holder ordering: under one token, a write whose `X-Fencing-Sequence`
/// is not above the highest one forwarded (a delayed or retried write of
/// the holder itself) is refused with 409 `stale_sequence` and never reaches
/// the upstream; a new token starts a new sequence; requests without the
/// header behave as before. On both transports (the fast path hands a
/// sequenced request to the general path).
#[tokio::test(flavor = "multi_thread")]
async fn reordered_and_retried_sequenced_writes_are_refused_on_both_paths() {
    for fast in [true, false] {
        let rec = Recorder::start().await;
        let (_d, gw) = gateway(&rec.url(), fast).await;
        let http = Http::default();
        let api = gw.api_url("");
        let g = acquire(&http, &api, "orders/1", 10_000, 0).await.unwrap();
        let mut c = Client::connect(gw.proxy).await;
        c.send(&put_seq("/orders/1", g.token, "2", "two")).await;
        assert_eq!(c.read(false).await.status, 200, "fast={fast}");
        // The holder's own delayed write 1 arrives after 2: refused.
        c.send(&put_seq("/orders/1", g.token, "1", "one-late")).await;
        let r = c.read(false).await;
        let err: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(r.status, 409, "fast={fast}: {err}");
        assert_eq!(err["error"], "stale_sequence");
        assert_eq!(
            (err["token"].as_u64(), err["sequence"].as_u64(), err["last_sequence"].as_u64()),
            (Some(g.token), Some(1), Some(2))
        );
        // A retry of 2 is refused too; 3 passes; no header: as before.
        c.send(&put_seq("/orders/1", g.token, "2", "two-again")).await;
        assert_eq!(c.read(false).await.status, 409, "fast={fast}");
        c.send(&put_seq("/orders/1", g.token, "3", "three")).await;
        assert_eq!(c.read(false).await.status, 200, "fast={fast}");
        c.send(&put("/orders/1", &g.token.to_string(), "plain")).await;
        assert_eq!(c.read(false).await.status, 200, "fast={fast}");
        c.send(&put_seq("/orders/1", g.token, "x", "bad")).await;
        assert_eq!(c.read(false).await.status, 400, "fast={fast}");
        // A new grant starts a new sequence.
        release(&http, &api, &g).await;
        let g2 = acquire(&http, &api, "orders/1", 10_000, 0).await.unwrap();
        let mut c = Client::connect(gw.proxy).await;
        c.send(&put_seq("/orders/1", g2.token, "1", "new-one")).await;
        assert_eq!(c.read(false).await.status, 200, "fast={fast}");
        let bodies: Vec<_> = rec.requests().iter().map(|s| String::from_utf8_lossy(&s.body).into_owned()).collect();
        assert_eq!(bodies, ["two", "three", "plain", "new-one"], "fast={fast}");
        let m = String::from_utf8(http.get(&gw.api_url("/metrics")).await.body.to_vec()).unwrap();
        assert!(m.contains("outcome=\"stale_sequence\""), "fast={fast}: {m}");
    }
}

/// Review finding (LOW): on the fast path, a small upload whose body came
/// slowly was judged only once it was whole, so when a newer grant came
/// meanwhile its client learned it was stale only at the route's upstream
/// timeout (30 s here). The fast path now hands a body not whole within a
/// moment to the general path, which admits on the head and cuts the
/// upload at once when the fence moves. Nothing of it reaches the upstream.
#[tokio::test(flavor = "multi_thread")]
async fn a_slow_small_upload_cut_by_a_newer_grant_is_answered_at_once_on_both_paths() {
    for fast in [true, false] {
        let rec = Recorder::start().await;
        let (_d, gw) = gateway(&rec.url(), fast).await;
        let http = Http::default();
        let api = gw.api_url("");
        let old = acquire(&http, &api, "slow/small", 60_000, 0).await.unwrap();
        let mut c = Client::connect(gw.proxy).await;
        c.send(
            format!(
                "PUT /slow/small HTTP/1.1\r\nHost: front\r\nX-Fencing-Token: {}\r\nContent-Length: 100\r\n\r\nfirst",
                old.token
            )
            .as_bytes(),
        )
        .await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        c.send(b"more").await;
        release(&http, &api, &old).await;
        let started = Instant::now();
        let new = acquire(&http, &api, "slow/small", 60_000, 0).await.unwrap();
        assert!(new.token > old.token);
        let granted = started.elapsed();
        assert!(granted < Duration::from_secs(2), "fast={fast}: the slow upload held the grant for {granted:?}");
        let r = tokio::time::timeout(Duration::from_secs(5), c.read(false))
            .await
            .unwrap_or_else(|_| panic!("fast={fast}: no answer within 5 s of the newer grant"));
        assert_eq!(r.status, 409, "fast={fast}: {:?}", String::from_utf8_lossy(&r.body));
        // The general path may have sent the head and the first bytes on;
        // the upstream never got the request whole.
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            rec.requests().iter().all(|seen| !seen.complete),
            "fast={fast}: the cut upload reached the upstream whole"
        );
    }
}
