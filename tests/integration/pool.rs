//! The per-route upstream connection pool, against a raw TCP upstream that
//! counts connections and requests: connections are reused, a connection
//! the upstream closed while idle is never used for a request, a response
//! abandoned half-read does not poison the pool, and a pooled connection
//! serves HEAD and bodies alike.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{acquire, Gateway, Http, Opts};
use http::Method;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// How the raw upstream treats a connection.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// Keep-alive, any number of requests.
    KeepAlive,
    /// Answer one request as if keep-alive (no `Connection: close`), then
    /// close 20 ms later: the pooled connection dies while idle.
    OneThenClose,
}

struct Upstream {
    port: u16,
    connections: Arc<AtomicUsize>,
    requests: Arc<AtomicUsize>,
}

/// Reads one request head (and its Content-Length body); None at EOF.
async fn read_request(s: &mut TcpStream, buf: &mut Vec<u8>) -> Option<(String, usize)> {
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_string();
            let len = head
                .lines()
                .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().to_string()))
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or(0);
            while buf.len() < end + 4 + len {
                let mut chunk = [0u8; 8192];
                let n = s.read(&mut chunk).await.ok()?;
                if n == 0 {
                    return None;
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            buf.drain(..end + 4 + len);
            return Some((head, len));
        }
        let mut chunk = [0u8; 8192];
        let n = s.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

async fn upstream(mode: Mode) -> Upstream {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let connections = Arc::new(AtomicUsize::new(0));
    let requests = Arc::new(AtomicUsize::new(0));
    let (c, r) = (connections.clone(), requests.clone());
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            c.fetch_add(1, Ordering::SeqCst);
            let r = r.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                while let Some((head, _)) = read_request(&mut s, &mut buf).await {
                    r.fetch_add(1, Ordering::SeqCst);
                    let big = head.contains("/big");
                    let resp = if head.starts_with("HEAD") {
                        "HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n".to_string()
                    } else if big {
                        // 4 MiB: more than the client will read.
                        "HTTP/1.1 200 OK\r\ncontent-length: 4194304\r\n\r\n".to_string()
                    } else {
                        "HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello".to_string()
                    };
                    if s.write_all(resp.as_bytes()).await.is_err() {
                        return;
                    }
                    if big {
                        let chunk = vec![b'x'; 65536];
                        for _ in 0..64 {
                            if s.write_all(&chunk).await.is_err() {
                                return;
                            }
                        }
                    }
                    if mode == Mode::OneThenClose {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        return;
                    }
                }
            });
        }
    });
    Upstream { port, connections, requests }
}

fn start(up: &Upstream) -> (tempfile::TempDir, Gateway) {
    start_with(up, None)
}

fn start_with(up: &Upstream, one_cpu: Option<u32>) -> (tempfile::TempDir, Gateway) {
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(
        &dir.path().join("data"),
        Opts { upstream: Some(format!("http://127.0.0.1:{}", up.port)), one_cpu, ..Opts::default() },
    );
    (dir, gw)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_gateway_confined_to_one_cpu_fences_and_pools() {
    // One CPU: the binary runs tokio's current-thread scheduler.
    let up = upstream(Mode::KeepAlive).await;
    let (_dir, gw) = start_with(&up, Some(0));
    let http = Http::default();
    let old = acquire(&http, &gw.api_url(""), "one-cpu", 200, 0).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let new = acquire(&http, &gw.api_url(""), "one-cpu", 60_000, 0).await.unwrap();
    let stale =
        http.send(Method::PUT, &gw.proxy_url("/one-cpu"), &[("x-fencing-token", &old.token.to_string())], "x").await;
    assert_eq!(stale.status.as_u16(), 409);
    assert_eq!(stale.error_code(), "stale_fencing_token");
    assert_eq!(up.requests.load(Ordering::SeqCst), 0, "the stale write reached the upstream");
    let token = new.token.to_string();
    let writes = (0..50).map(|_| {
        let (http, url, token) = (http.clone(), gw.proxy_url("/one-cpu"), token.clone());
        tokio::spawn(async move { http.send(Method::PUT, &url, &[("x-fencing-token", &token)], "x").await.status })
    });
    for w in writes {
        assert_eq!(w.await.unwrap().as_u16(), 200);
    }
    assert_eq!(up.requests.load(Ordering::SeqCst), 50);
}

#[tokio::test(flavor = "multi_thread")]
async fn sequential_requests_reuse_one_upstream_connection() {
    let up = upstream(Mode::KeepAlive).await;
    let (_dir, gw) = start(&up);
    let http = Http::default();
    let g = acquire(&http, &gw.api_url(""), "pooled", 60_000, 0).await.unwrap();
    let token = g.token.to_string();
    for i in 0..20 {
        let method = if i % 5 == 4 { Method::HEAD } else { Method::PUT };
        let r = http.send(method, &gw.proxy_url("/pooled"), &[("x-fencing-token", &token)], "body").await;
        assert_eq!(r.status.as_u16(), 200, "request {i}: {:?}", r.body);
    }
    assert_eq!(up.requests.load(Ordering::SeqCst), 20);
    let conns = up.connections.load(Ordering::SeqCst);
    assert!(conns <= 2, "20 sequential requests took {conns} upstream connections");
}

/// The general path's pool (bodies above the fast path's limit; HTTP/2
/// requests): a fenced upload's connection goes back to the pool once its
/// request was written out whole (the connection's write gate saw the
/// flush after the end of the body), and so does a fenced request with an
/// empty body (its head is the whole request).
#[tokio::test(flavor = "multi_thread")]
async fn fenced_uploads_on_the_general_path_reuse_their_upstream_connection() {
    let up = upstream(Mode::KeepAlive).await;
    let (_dir, gw) = start(&up);
    let http = Http::default();
    let g = acquire(&http, &gw.api_url(""), "general", 60_000, 0).await.unwrap();
    let token = g.token.to_string();
    let big = vec![b'u'; 200 * 1024];
    for i in 0..10 {
        let r = http.send(Method::PUT, &gw.proxy_url("/general"), &[("x-fencing-token", &token)], big.clone()).await;
        assert_eq!(r.status.as_u16(), 200, "upload {i}: {:?}", r.body);
    }
    let h2 = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .http2_only(true)
        .build_http::<http_body_util::Full<bytes::Bytes>>();
    for i in 0..10 {
        let req = http::Request::delete(gw.proxy_url("/general"))
            .header("x-fencing-token", &token)
            .body(http_body_util::Full::new(bytes::Bytes::new()))
            .unwrap();
        let r = common::collect(h2.request(req).await.unwrap()).await;
        assert_eq!(r.status.as_u16(), 200, "delete {i}: {:?}", r.body);
    }
    assert_eq!(up.requests.load(Ordering::SeqCst), 20);
    let conns = up.connections.load(Ordering::SeqCst);
    assert!(conns <= 2, "20 sequential fenced requests took {conns} upstream connections");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_connection_closed_while_idle_is_not_used() {
    let up = upstream(Mode::OneThenClose).await;
    let (_dir, gw) = start(&up);
    let http = Http::default();
    let g = acquire(&http, &gw.api_url(""), "closing", 60_000, 0).await.unwrap();
    let token = g.token.to_string();
    for i in 0..8 {
        let r = http.send(Method::PUT, &gw.proxy_url("/closing"), &[("x-fencing-token", &token)], "body").await;
        assert_eq!(r.status.as_u16(), 200, "request {i}: {:?} (a dead pooled connection was used)", r.body);
        // Long enough for the upstream's close to arrive while idle.
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    assert_eq!(up.requests.load(Ordering::SeqCst), 8);
    assert_eq!(up.connections.load(Ordering::SeqCst), 8);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_response_abandoned_half_read_does_not_poison_the_pool() {
    let up = upstream(Mode::KeepAlive).await;
    let (_dir, gw) = start(&up);
    // A raw client reads the head of a 4 MiB answer and hangs up.
    for _ in 0..3 {
        let mut s = TcpStream::connect(gw.proxy).await.unwrap();
        s.write_all(b"GET /big HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
        let mut first = [0u8; 1024];
        let n = s.read(&mut first).await.unwrap();
        assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"));
        drop(s);
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let http = Http::default();
    for i in 0..5 {
        let r = http.get(&gw.proxy_url("/small")).await;
        assert_eq!(r.status.as_u16(), 200, "request {i} after abandoned bodies: {:?}", r.body);
        assert_eq!(&r.body[..], b"hello");
    }
}
