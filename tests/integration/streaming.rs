//! Bodies are streamed, never buffered: a 1 GiB PUT through the real
//! binary keeps the gateway's peak RSS under 64 MiB, and every byte
//! arrives.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use common::{acquire, Gateway, Http, Opts};
use http::{Request, Response};
use http_body::Frame;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};

const TOTAL: u64 = 1 << 30;
const CHUNK: usize = 256 * 1024;

/// An upstream that counts the bytes it receives and discards them.
async fn sink() -> (std::net::SocketAddr, Arc<AtomicU64>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let received = Arc::new(AtomicU64::new(0));
    let counter = received.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let counter = counter.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                    let counter = counter.clone();
                    async move {
                        let mut body = req.into_body();
                        while let Some(Ok(frame)) = body.frame().await {
                            if let Some(d) = frame.data_ref() {
                                counter.fetch_add(d.len() as u64, Ordering::Relaxed);
                            }
                        }
                        Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), svc).await;
            });
        }
    });
    (addr, received)
}

fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn one_gib_put_streams_with_bounded_memory() {
    let (addr, received) = sink().await;
    let dir = tempfile::tempdir().unwrap();
    let gw =
        Gateway::start(&dir.path().join("data"), Opts { upstream: Some(format!("http://{addr}")), ..Opts::default() });
    let http = Http::default();
    let g = acquire(&http, &gw.api_url(""), "big/object", 60_000, 0).await.unwrap();
    let chunk = Bytes::from(vec![b'x'; CHUNK]);
    let stream = futures_util::stream::unfold(0u64, move |sent| {
        let chunk = chunk.clone();
        async move { (sent < TOTAL).then(|| (Ok::<_, std::io::Error>(Frame::data(chunk)), sent + CHUNK as u64)) }
    });
    let client = Client::builder(TokioExecutor::new()).build_http();
    let req = Request::put(gw.proxy_url("/big/object"))
        .header("x-fencing-token", g.token.to_string())
        .header("content-length", TOTAL.to_string())
        .body(StreamBody::new(Box::pin(stream)))
        .unwrap();
    let started = std::time::Instant::now();
    let resp = client.request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let secs = started.elapsed().as_secs_f64();
    assert_eq!(received.load(Ordering::Relaxed), TOTAL, "every byte must arrive");
    let peak = peak_rss_kib(gw.child.id());
    println!("1 GiB PUT through fencegate: {:.0} MiB/s, gateway peak RSS {} MiB", 1024.0 / secs, peak / 1024);
    assert!(peak < 64 * 1024, "peak RSS {peak} KiB");
    // The gateway runs without transparent huge pages (src/main.rs: with
    // them, 64 MiB uploads to an S3 route peaked over 64 MiB). Kernels
    // since 5.0 show the flag; this one must.
    let status = std::fs::read_to_string(format!("/proc/{}/status", gw.child.id())).unwrap();
    let thp = status.lines().find(|l| l.starts_with("THP_enabled:")).expect("the kernel shows THP_enabled");
    assert_eq!(thp.split_whitespace().nth(1), Some("0"), "transparent huge pages still on: {thp}");
}
