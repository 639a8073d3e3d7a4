//! Review findings: a fenced request whose bytes sat in the gateway's own
//! send queue when its exchange ended — answered early (the upstream
//! answered on the head and stopped reading), failed (a garbage status
//! line) or timed out — was closed with a FIN or put back in the pool,
//! and the kernel delivered the whole stale request to the upstream after
//! a newer holder's grant. A request now counts as sent only once the
//! upstream's kernel has acknowledged all of it; until then it stays in
//! flight, and a connection given up with bytes undelivered is reset.
//!
//! Each case: an upstream with a 4 KiB receive buffer does what the case
//! says, then stops reading. The old holder's request is answered (or
//! fails), the lock is released and granted anew, and only then does the
//! upstream read what reaches it: no more than its own kernel held.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::common::{acquire, release, Gateway, Http, Opts};

#[derive(Clone, Copy, Debug)]
enum Misbehaves {
    /// Reads the head, answers `200` at once, reads no more.
    AnswersEarly,
    /// Reads the head, answers with a garbage status line, reads no more.
    AnswersGarbage,
    /// Reads nothing and answers nothing (the exchange times out).
    Stalls,
}

/// The upstream of one case: reports how many bytes it read once let go.
struct Upstream {
    addr: String,
    go: tokio::sync::watch::Sender<bool>,
    got: tokio::task::JoinHandle<(usize, String)>,
}

impl Upstream {
    async fn start(how: Misbehaves) -> Upstream {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener: TcpListener = socket.listen(16).unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (go, mut gate) = tokio::sync::watch::channel(false);
        let got = tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut head = Vec::new();
            if !matches!(how, Misbehaves::Stalls) {
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && head.len() < 16 * 1024 {
                    if conn.read(&mut byte).await.unwrap_or(0) == 0 {
                        break;
                    }
                    head.push(byte[0]);
                }
                let answer: &[u8] = match how {
                    Misbehaves::AnswersEarly => b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
                    _ => b"garbage, not HTTP\r\n\r\n",
                };
                conn.write_all(answer).await.unwrap();
            }
            gate.wait_for(|go| *go).await.unwrap();
            let mut buf = vec![0u8; 64 * 1024];
            let mut total = 0usize;
            let ended = loop {
                match tokio::time::timeout(Duration::from_secs(3), conn.read(&mut buf)).await {
                    Ok(Ok(0)) => break "closed".to_string(),
                    Ok(Ok(n)) => total += n,
                    Ok(Err(e)) => break format!("error: {e}"),
                    Err(_) => break "still open after 3 s".to_string(),
                }
            };
            (total, ended)
        });
        Upstream { addr, go, got }
    }

    async fn read_what_comes(self) -> (usize, String) {
        self.go.send(true).unwrap();
        self.got.await.unwrap()
    }
}

/// A PUT of `size` bytes with `token`, sent whole by a raw client; the
/// status line of the answer.
async fn put(proxy: &str, token: u64, size: usize) -> String {
    let mut conn = TcpStream::connect(proxy).await.unwrap();
    let head = format!(
        "PUT /doc HTTP/1.1\r\nHost: gw\r\nX-Fencing-Token: {token}\r\nContent-Length: {size}\r\nConnection: close\r\n\r\n"
    );
    let mut request = head.into_bytes();
    request.extend(std::iter::repeat_n(b'o', size));
    let (mut rd, mut wr) = conn.split();
    let write = async {
        let _ = wr.write_all(&request).await;
    };
    let read = async {
        let mut answer = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(15), rd.read_to_end(&mut answer)).await;
        answer
    };
    let (_, answer) = tokio::join!(write, read);
    let text = String::from_utf8_lossy(&answer);
    text.lines().next().unwrap_or("").to_string()
}

async fn case(how: Misbehaves, size: usize) {
    let up = Upstream::start(how).await;
    let dir = tempfile::tempdir().unwrap();
    let cfg =
        format!("[[routes]]\nmatch = \"/{{*path}}\"\nupstream = \"http://{}\"\nupstream_timeout_ms = 1500\n", up.addr);
    let gw = Gateway::start(&dir.path().join("data"), Opts { config: Some(cfg), ..Opts::default() });
    let http = Http::default();
    let api = gw.api_url("");
    let old = acquire(&http, &api, "doc", 30_000, 0).await.unwrap();
    let proxy = gw.proxy_url("").trim_start_matches("http://").to_string();
    let status = put(&proxy, old.token, size).await;
    let expected = match how {
        Misbehaves::AnswersEarly => "200",
        Misbehaves::AnswersGarbage => "502",
        Misbehaves::Stalls => "504",
    };
    assert!(status.contains(expected), "{how:?} {size}: {status}");
    release(&http, &api, &old).await;
    let new = acquire(&http, &api, "doc", 30_000, 10_000).await.unwrap();
    assert_eq!(new.token, old.token + 1);
    // The newer holder has its grant: from here on, nothing of the old
    // request may reach the upstream but what its own kernel had taken.
    let (got, ended) = up.read_what_comes().await;
    assert!(
        got < 24 * 1024,
        "{how:?} {size}: {got} bytes of the stale request reached the upstream after the newer grant ({ended})"
    );
    assert!(!ended.contains("still open"), "{how:?} {size}: the connection stayed open: {ended}");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_early_answer_on_the_fast_path_leaves_nothing_to_deliver_after_a_newer_grant() {
    case(Misbehaves::AnswersEarly, 60_000).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_early_answer_on_the_general_path_leaves_nothing_to_deliver_after_a_newer_grant() {
    case(Misbehaves::AnswersEarly, 300_000).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_garbage_answer_on_the_fast_path_resets_the_undelivered_request() {
    case(Misbehaves::AnswersGarbage, 60_000).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_garbage_answer_on_the_general_path_resets_the_undelivered_request() {
    case(Misbehaves::AnswersGarbage, 300_000).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_timeout_on_the_fast_path_resets_the_undelivered_request() {
    case(Misbehaves::Stalls, 60_000).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_timeout_on_the_general_path_resets_the_undelivered_request() {
    case(Misbehaves::Stalls, 300_000).await;
}

/// A gateway forwarding to `upstream` with a 10 s upstream timeout.
fn gateway_to(upstream: &str, dir: &std::path::Path) -> Gateway {
    let cfg =
        format!("[[routes]]\nmatch = \"/{{*path}}\"\nupstream = \"http://{upstream}\"\nupstream_timeout_ms = 10000\n");
    Gateway::start(&dir.join("data"), Opts { config: Some(cfg), ..Opts::default() })
}

/// Review finding: the upstream answered `200` on the head and read the
/// rest slowly; the client was told 200, and the gateway then reset the
/// connection (the HTTP client ended it once the answer was read, the rest
/// of the request still in the send queue): the write the client was told
/// of never reached the upstream whole. A connection answered before its
/// request was delivered is now kept open until it is (or the deadline).
async fn answered_early_then_read_slowly(size: usize) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener: TcpListener = socket.listen(16).unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let reader = tokio::spawn(async move {
        let (mut conn, _) = listener.accept().await.unwrap();
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") && head.len() < 16 * 1024 {
            if conn.read(&mut byte).await.unwrap_or(0) == 0 {
                break;
            }
            head.push(byte[0]);
        }
        conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n").await.unwrap();
        // 4 KiB every 5 ms: the body arrives well after the answer.
        let mut buf = vec![0u8; 4096];
        let mut total = 0usize;
        loop {
            tokio::time::sleep(Duration::from_millis(5)).await;
            match tokio::time::timeout(Duration::from_secs(5), conn.read(&mut buf)).await {
                Ok(Ok(n)) if n > 0 => total += n,
                _ => break,
            }
            if total >= size {
                break;
            }
        }
        total
    });
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway_to(&addr, dir.path());
    let http = Http::default();
    let lease = acquire(&http, &gw.api_url(""), "doc", 30_000, 0).await.unwrap();
    let proxy = gw.proxy_url("").trim_start_matches("http://").to_string();
    let status = put(&proxy, lease.token, size).await;
    assert!(status.contains("200"), "{size}: {status}");
    let got = tokio::time::timeout(Duration::from_secs(30), reader).await.unwrap().unwrap();
    assert_eq!(got, size, "the client was told 200, the upstream got {got} of {size} bytes");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_early_answer_read_slowly_on_the_fast_path_is_delivered_whole() {
    answered_early_then_read_slowly(40_000).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_early_answer_read_slowly_on_the_general_path_is_delivered_whole() {
    answered_early_then_read_slowly(300_000).await;
}

/// Review finding: a gateway killed (`kill -9`) with a request in its send
/// queue left the socket to the kernel, which closed it with a FIN and went
/// on delivering the queue whenever the upstream read — after the dead
/// gateway's quarantine had let a newer holder write. Upstream sockets
/// have zero linger now: the kernel resets them when the process dies.
#[tokio::test(flavor = "multi_thread")]
async fn a_killed_gateway_s_send_queue_is_dropped_not_delivered() {
    let up = Upstream::start(Misbehaves::Stalls).await;
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway_to(&up.addr, dir.path());
    let http = Http::default();
    let lease = acquire(&http, &gw.api_url(""), "doc", 30_000, 0).await.unwrap();
    let proxy = gw.proxy_url("").trim_start_matches("http://").to_string();
    let writer = tokio::spawn(async move { put(&proxy, lease.token, 300_000).await });
    // Long enough for the body to fill the gateway's send queue.
    tokio::time::sleep(Duration::from_millis(700)).await;
    gw.kill9();
    let (got, ended) = up.read_what_comes().await;
    assert!(got < 24 * 1024, "{got} bytes of the dead gateway's request reached the upstream after it died ({ended})");
    let _ = writer.await;
}
