//! The access log against the real binary: lines are buffered off the
//! request path (docs/metrics.md, Logs), yet a clean stop loses none of
//! them, and lines that are not access lines are written at once.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::{Duration, Instant};

use common::{acquire, Gateway, Http, Opts, Recorder};
use http::{Method, StatusCode};

fn proxy_access_lines(log: &str, path: &str) -> usize {
    log.lines()
        .filter(|l| l.contains("fencegate::access") && l.contains("listener=\"proxy\"") && l.contains(path))
        .count()
}

#[tokio::test(flavor = "multi_thread")]
async fn n_requests_then_sigterm_leave_n_access_lines() {
    let rec = Recorder::start().await;
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(&dir.path().join("data"), Opts { upstream: Some(rec.url()), ..Opts::default() });
    let http = Http::default();
    let g = acquire(&http, &gw.api_url(""), "logged/many", 60_000, 0).await.unwrap();
    let token = g.token.to_string();
    const N: usize = 1_000;
    // Eight connections at a time, the fenced PUT of the benchmarks.
    let mut tasks = Vec::new();
    for c in 0..8 {
        let (http, url, token) = (http.clone(), gw.proxy_url("/logged/many"), token.clone());
        tasks.push(tokio::spawn(async move {
            for _ in (c..N).step_by(8) {
                let r = http.send(Method::PUT, &url, &[("x-fencing-token", &token)], vec![b'x'; 1024]).await;
                assert_eq!(r.status, StatusCode::OK);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(rec.count(), N);
    let log = gw.log.clone();
    let status = gw.terminate();
    assert!(status.success(), "{status}");
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(proxy_access_lines(&text, "/logged/many"), N, "one access line per request after SIGTERM");
    // The order of lines is kept: the stop line comes after every access line.
    let lines: Vec<&str> = text.lines().collect();
    let last_access = lines.iter().rposition(|l| l.contains("fencegate::access")).unwrap();
    let stopped = lines.iter().position(|l| l.contains("fencegate stopped")).unwrap();
    assert!(stopped > last_access, "access lines after the stop line:\n{text}");
}

#[tokio::test(flavor = "multi_thread")]
async fn access_lines_reach_the_log_within_the_flush_interval_and_audit_lines_at_once() {
    let rec = Recorder::start().await;
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(&dir.path().join("data"), Opts { upstream: Some(rec.url()), ..Opts::default() });
    let http = Http::default();
    let g = acquire(&http, &gw.api_url(""), "logged/one", 60_000, 0).await.unwrap();
    // A refused write: its audit line (a warning) is in the log when the
    // response arrives.
    let stale = (g.token - 1).to_string();
    let r = http.send(Method::PUT, &gw.proxy_url("/logged/one"), &[("x-fencing-token", &stale)], "x").await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    assert!(gw.log_text().lines().any(|l| l.contains("fencegate::audit")), "{}", gw.log_text());
    // One quiet access line: written by the interval (1 s), with no more
    // traffic to fill the buffer.
    let r =
        http.send(Method::PUT, &gw.proxy_url("/logged/one"), &[("x-fencing-token", &g.token.to_string())], "x").await;
    assert_eq!(r.status, StatusCode::OK);
    let started = Instant::now();
    while proxy_access_lines(&gw.log_text(), "/logged/one") < 2 {
        assert!(started.elapsed() < Duration::from_secs(5), "access line not written:\n{}", gw.log_text());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
