//! Activation: a grant installs the new fence at once and returns only
//! after older in-flight mutations finished; an older upload still
//! streaming its body is cut off; and under continual hand-overs the
//! upstream never applies tokens out of order.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{acquire, release, Gateway, Http, Opts, Recorder};
use http::{Method, StatusCode};
use http_body::Frame;

async fn setup() -> (tempfile::TempDir, Gateway, Recorder, Http) {
    let rec = Recorder::start().await;
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(&dir.path().join("data"), Opts { upstream: Some(rec.url()), ..Opts::default() });
    (dir, gw, rec, Http::default())
}

#[tokio::test(flavor = "multi_thread")]
async fn grant_returns_only_after_the_older_inflight_write_finished() {
    let (_d, gw, rec, http) = setup().await;
    let api = gw.api_url("");
    let old = acquire(&http, &api, "k", 300, 0).await.unwrap();
    rec.set_delay("/k", 1500);
    let started = Instant::now();
    let slow_write = tokio::spawn({
        let (http, url, t) = (http.clone(), gw.proxy_url("/k"), old.token.to_string());
        async move { http.send(Method::PUT, &url, &[("x-fencing-token", &t)], "old").await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The old lease expires at 300 ms; a new holder asks at once after.
    let new = tokio::spawn({
        let (http, api) = (http.clone(), api.clone());
        async move {
            let g = acquire(&http, &api, "k", 5000, 5000).await.unwrap();
            (g, Instant::now())
        }
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    // The fence moved before the grant returned: the old holder is out.
    let r = http.send(Method::PUT, &gw.proxy_url("/k"), &[("x-fencing-token", &old.token.to_string())], "late").await;
    assert_eq!(r.error_code(), "stale_fencing_token");
    assert!(!new.is_finished(), "the grant must wait for the older in-flight write");
    let (g, granted_at) = new.await.unwrap();
    assert_eq!(g.token, old.token + 1);
    assert!(granted_at.duration_since(started) >= Duration::from_millis(1400));
    assert_eq!(slow_write.await.unwrap().status, StatusCode::OK);
    assert_eq!(rec.count(), 1, "the old write was applied before the new grant; the late one never");
    let m = String::from_utf8(http.get(&gw.api_url("/metrics")).await.body.to_vec()).unwrap();
    assert!(m.contains("fencegate_activation_wait_seconds_count 2"), "{m}");
}

/// Review finding: an activation that outlasts the new grant's TTL (an
/// older write in flight for longer) answered the expired grant with its
/// full TTL while another client could already take the key. It is not
/// answered now (503), and a grant that is answered promises only the time
/// it has left.
#[tokio::test(flavor = "multi_thread")]
async fn a_grant_that_expires_during_activation_is_not_answered() {
    let (_d, gw, rec, http) = setup().await;
    let api = gw.api_url("");
    let old = acquire(&http, &api, "short", 300, 0).await.unwrap();
    rec.set_delay("/short", 2000);
    let slow_write = tokio::spawn({
        let (http, url, t) = (http.clone(), gw.proxy_url("/short"), old.token.to_string());
        async move { http.send(Method::PUT, &url, &[("x-fencing-token", &t)], "old").await }
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    // Its TTL (500 ms) runs out while activation waits for the 2 s write.
    let url = format!("{api}/v1/locks/acquire");
    let body = serde_json::json!({"key": "short", "ttl_ms": 500, "wait_ms": 0, "holder": "b"});
    let r = http.post_json(&url, body).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{:?}", String::from_utf8_lossy(&r.body));
    assert!(String::from_utf8_lossy(&r.body).contains("expired while its activation waited"));
    assert_eq!(slow_write.await.unwrap().status, StatusCode::OK);
    // Long enough: answered, promising no more than its TTL.
    let body = serde_json::json!({"key": "short", "ttl_ms": 5000, "wait_ms": 0, "holder": "b"});
    let r = http.post_json(&url, body).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", String::from_utf8_lossy(&r.body));
    let ttl = r.json()["ttl_ms"].as_u64().unwrap();
    assert!(ttl > 0 && ttl <= 5000, "{ttl}");
}

#[tokio::test(flavor = "multi_thread")]
async fn older_upload_still_streaming_is_aborted_by_a_new_grant() {
    let (_d, gw, rec, http) = setup().await;
    let api = gw.api_url("");
    let old = acquire(&http, &api, "big", 10_000, 0).await.unwrap();
    let common::StreamedUpload { body: tx, response: upload } =
        common::start_streamed_upload(&gw.proxy_url("/big"), old.token).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    release(&http, &api, &old).await;
    let started = Instant::now();
    let new = acquire(&http, &api, "big", 10_000, 0).await.unwrap();
    assert!(started.elapsed() < Duration::from_secs(2), "the abort must free the barrier promptly");
    assert_eq!(new.token, old.token + 1);
    let resp = upload.await.unwrap().unwrap();
    let reply = common::collect(resp).await;
    assert_eq!(reply.status, StatusCode::CONFLICT);
    assert_eq!(reply.error_code(), "stale_fencing_token");
    drop(tx);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(rec.requests().iter().all(|s| !s.complete), "the upstream must never get the whole body");
    let m = String::from_utf8(http.get(&gw.api_url("/metrics")).await.body.to_vec()).unwrap();
    assert!(m.contains("fencegate_aborted_uploads_total{route=\"default\"} 1"), "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tokens_never_decrease_in_applied_order_under_handovers() {
    let (_d, gw, rec, http) = setup().await;
    let api = gw.api_url("");
    const RESOURCES: [&str; 3] = ["r0", "r1", "r2"];
    for r in RESOURCES {
        rec.set_delay(&format!("/{r}"), 3);
    }
    let mut writers = Vec::new();
    for w in 0..8u64 {
        let (http, api, proxy) = (http.clone(), api.clone(), gw.proxy_url(""));
        writers.push(tokio::spawn(async move {
            let (mut forwarded, mut refused) = (0u32, 0u32);
            for round in 0..40u64 {
                let key = RESOURCES[((w + round) % 3) as usize];
                let Ok(g) = acquire(&http, &api, key, 150, 2000).await else {
                    continue;
                };
                let t = g.token.to_string();
                for i in 0..6u64 {
                    // Some writers pause past their TTL: zombies.
                    if (w + round + i) % 7 == 0 {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    let r = http
                        .send(
                            Method::PUT,
                            &format!("{proxy}/{key}"),
                            &[("x-fencing-token", &t)],
                            format!("{w}:{round}:{i}"),
                        )
                        .await;
                    match r.status {
                        StatusCode::OK => forwarded += 1,
                        StatusCode::CONFLICT => refused += 1,
                        other => panic!("unexpected {other}"),
                    }
                }
                if round % 2 == 0 {
                    release(&http, &api, &g).await;
                }
            }
            (forwarded, refused)
        }));
    }
    let (mut forwarded, mut refused) = (0, 0);
    for w in writers {
        let (f, r) = w.await.unwrap();
        forwarded += f;
        refused += r;
    }
    let mut last: HashMap<String, u64> = HashMap::new();
    let applied = rec.requests();
    for s in &applied {
        let t: u64 = s.headers["x-fencing-token"].to_str().unwrap().parse().unwrap();
        let prev = last.entry(s.path.clone()).or_insert(0);
        assert!(t >= *prev, "{}: token {t} applied after {prev}", s.path);
        *prev = t;
    }
    println!("{forwarded} forwarded, {refused} refused, {} applied", applied.len());
    assert_eq!(applied.len(), forwarded as usize);
    assert!(forwarded > 500, "too few writes to mean anything: {forwarded}");
    assert!(refused > 0, "zombies must have been refused");
}

/// Shadow mode reports and never refuses: an older upload still streaming
/// when a new grant arrives is not cut off; the grant waits for it, and
/// the upstream gets the whole body.
#[tokio::test(flavor = "multi_thread")]
async fn in_shadow_mode_an_older_upload_still_streaming_is_not_cut_off() {
    let rec = Recorder::start().await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = format!("[[routes]]\nmatch = \"/{{*path}}\"\nupstream = \"{}\"\nenforce = false\n", rec.url());
    let gw = Gateway::start(&dir.path().join("data"), Opts { config: Some(cfg), ..Opts::default() });
    let http = Http::default();
    let api = gw.api_url("");
    let old = acquire(&http, &api, "big", 10_000, 0).await.unwrap();
    let common::StreamedUpload { body: tx, response: upload } =
        common::start_streamed_upload(&gw.proxy_url("/big"), old.token).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    release(&http, &api, &old).await;
    let grant = tokio::spawn({
        let (http, api) = (http.clone(), api.clone());
        async move { acquire(&http, &api, "big", 10_000, 0).await.unwrap() }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!grant.is_finished(), "the grant waits for the write in flight");
    tx.send(Ok(Frame::data(Bytes::from_static(b"end")))).await.unwrap();
    drop(tx);
    let reply = common::collect(upload.await.unwrap().unwrap()).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", String::from_utf8_lossy(&reply.body));
    let new = grant.await.unwrap();
    assert_eq!(new.token, old.token + 1);
    let seen = rec.requests();
    assert_eq!(seen.len(), 1);
    assert!(seen[0].complete && seen[0].body.len() == 64 * 1024 + 3, "the upstream got the whole body");
}

/// An upstream that accepts and does not read until told to, with a small
/// receive buffer; then it reads what reaches it until the connection
/// ends. Reports the bytes it got and how the connection ended.
struct StalledUpstream {
    url: String,
    go: tokio::sync::watch::Sender<bool>,
    got: tokio::task::JoinHandle<(usize, String)>,
}

impl StalledUpstream {
    async fn start() -> StalledUpstream {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(64 * 1024).unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener = socket.listen(16).unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (go, mut gate) = tokio::sync::watch::channel(false);
        let got = tokio::spawn(async move {
            use tokio::io::AsyncReadExt;
            let (mut conn, _) = listener.accept().await.unwrap();
            gate.wait_for(|go| *go).await.unwrap();
            let mut buf = vec![0u8; 64 * 1024];
            let mut total = 0usize;
            let ended = loop {
                match tokio::time::timeout(Duration::from_secs(5), conn.read(&mut buf)).await {
                    Ok(Ok(0)) => break "closed".to_string(),
                    Ok(Ok(n)) => total += n,
                    Ok(Err(e)) => break format!("error: {e}"),
                    Err(_) => break "still open after 5 s".to_string(),
                }
            };
            (total, ended)
        });
        StalledUpstream { url, go, got }
    }

    /// Lets it read; what it got once the connection ended.
    async fn read_what_comes(self) -> (usize, String) {
        self.go.send(true).unwrap();
        self.got.await.unwrap()
    }
}

/// Streams up to 64 MiB into `tx` as fast as the gateway takes it (the
/// upload backs up once the upstream stops reading); bounded in time.
fn pump(tx: tokio::sync::mpsc::Sender<Result<Frame<Bytes>, std::io::Error>>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let chunk = Bytes::from(vec![b'b'; 64 * 1024]);
        let until = Instant::now() + Duration::from_secs(20);
        for _ in 0..1024 {
            let sent = tokio::time::timeout_at(until.into(), tx.send(Ok(Frame::data(chunk.clone())))).await;
            if !matches!(sent, Ok(Ok(()))) {
                return;
            }
        }
    })
}

fn stalled_gateway(dir: &tempfile::TempDir, upstream: &str) -> Gateway {
    let cfg = format!("[[routes]]\nmatch = \"/{{*path}}\"\nupstream = \"{upstream}\"\nupstream_timeout_ms = 3000\n");
    Gateway::start(&dir.path().join("data"), Opts { config: Some(cfg), ..Opts::default() })
}

/// Review finding: the HTTP client took the frames of a fenced upload
/// while its gate was open and buffered them while the upstream did not
/// read; they went out later — after a newer grant — and the body, stuck
/// in the client, kept the older upload registered, so the newer grant
/// waited for the activation timeout. Now every write to the upstream
/// socket asks the upload's gate: the newer grant cuts the connection at
/// once (reset: the kernel drops what it still holds), and the upstream,
/// reading late, gets no more than its own receive buffer held.
#[tokio::test(flavor = "multi_thread")]
async fn a_newer_grant_cuts_an_upload_the_upstream_has_not_read() {
    let up = StalledUpstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let gw = stalled_gateway(&dir, &up.url);
    let http = Http::default();
    let api = gw.api_url("");
    let old = acquire(&http, &api, "slow", 10_000, 0).await.unwrap();
    let common::StreamedUpload { body: tx, response: upload } =
        common::start_streamed_upload(&gw.proxy_url("/slow"), old.token).await;
    let pumping = pump(tx);
    // Long enough for the client and the kernel to fill their buffers.
    tokio::time::sleep(Duration::from_millis(700)).await;
    release(&http, &api, &old).await;
    let started = Instant::now();
    let new = acquire(&http, &api, "slow", 10_000, 0).await.unwrap();
    let took = started.elapsed();
    assert_eq!(new.token, old.token + 1);
    assert!(took < Duration::from_secs(2), "the stuck upload held the newer grant for {took:?}");
    let reply = common::collect(upload.await.unwrap().unwrap()).await;
    assert_eq!(reply.error_code(), "stale_fencing_token", "{:?}", String::from_utf8_lossy(&reply.body));
    let (got, ended) = up.read_what_comes().await;
    assert!(got < 256 * 1024, "{got} bytes reached the upstream after the cut ({ended})");
    assert!(!ended.contains("still open"), "the cut connection stayed open: {ended}");
    pumping.abort();
}

/// The other way out of the same stall: the route's upstream timeout. The
/// client gets its 504, and nothing the HTTP client still held goes out
/// afterwards (the connection is reset, not left to drain when the
/// upstream reads again).
#[tokio::test(flavor = "multi_thread")]
async fn an_upload_the_upstream_has_not_read_goes_no_further_after_its_timeout() {
    let up = StalledUpstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let gw = stalled_gateway(&dir, &up.url);
    let http = Http::default();
    let api = gw.api_url("");
    let old = acquire(&http, &api, "late", 30_000, 0).await.unwrap();
    let common::StreamedUpload { body: tx, response: upload } =
        common::start_streamed_upload(&gw.proxy_url("/late"), old.token).await;
    let pumping = pump(tx);
    let started = Instant::now();
    let reply = common::collect(upload.await.unwrap().unwrap()).await;
    let took = started.elapsed();
    assert_eq!(reply.status, StatusCode::GATEWAY_TIMEOUT, "{:?}", String::from_utf8_lossy(&reply.body));
    assert!(took < Duration::from_secs(6), "answered after {took:?}");
    // The same holder's next grant of the key is not held up either.
    release(&http, &api, &old).await;
    let again = Instant::now();
    acquire(&http, &api, "late", 10_000, 0).await.unwrap();
    assert!(again.elapsed() < Duration::from_secs(2), "the timed-out upload held the grant {:?}", again.elapsed());
    let (got, ended) = up.read_what_comes().await;
    assert!(got < 256 * 1024, "{got} bytes reached the upstream after the timeout ({ended})");
    assert!(!ended.contains("still open"), "the cut connection stayed open: {ended}");
    pumping.abort();
}
