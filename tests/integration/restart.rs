//! A live grant survives a graceful restart: it comes back with its full
//! TTL, can be renewed, and its key stays locked (docs/lease-api.md, "Restarts").
#![allow(clippy::unwrap_used)]

use crate::common;

use common::{acquire, Gateway, Http, Opts};
use http::StatusCode;
use serde_json::json;

#[tokio::test(flavor = "multi_thread")]
async fn live_grant_survives_graceful_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let http = Http::default();
    let gw = Gateway::start(&data, Opts::default());
    let api = gw.api_url("");
    let g = acquire(&http, &api, "jobs/nightly", 30_000, 0).await.unwrap();
    let other = acquire(&http, &api, "released", 30_000, 0).await.unwrap();
    common::release(&http, &api, &other).await;
    assert!(gw.terminate().success());

    let gw = Gateway::start(&data, Opts::default());
    let api = gw.api_url("");
    let s = http.get(&format!("{api}/v1/locks/status?key=jobs/nightly")).await.json();
    assert_eq!(s["held"], true);
    assert_eq!(s["fencing_token"], g.token);
    assert!(s["expires_in_ms"].as_u64().unwrap() > 29_000, "full TTL counted from the restart: {s}");
    let r =
        http.post_json(&format!("{api}/v1/locks/renew"), json!({"key": "jobs/nightly", "lease_id": g.lease_id})).await;
    assert_eq!(r.status, StatusCode::OK);
    let r = acquire(&http, &api, "jobs/nightly", 1000, 0).await.unwrap_err();
    assert_eq!(r.error_code(), "locked");
    // The released key stays free, and its next token is fresh.
    let s = http.get(&format!("{api}/v1/locks/status?key=released")).await.json();
    assert_eq!(s["held"], false);
    assert_eq!(acquire(&http, &api, "released", 1000, 0).await.unwrap().token, other.token + 1);
}

/// After `kill -9`, requests the dead process forwarded may still be applied
/// by an HTTP upstream until its route's timeout: a new grant must wait that
/// out. After a clean stop it need not.
#[tokio::test(flavor = "multi_thread")]
async fn grant_after_kill9_waits_out_the_dead_process_requests() {
    let rec = common::Recorder::start().await;
    rec.set_delay("/q/1", 1200);
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let cfg = format!("[[routes]]\nmatch = \"/{{*path}}\"\nupstream = \"{}\"\nupstream_timeout_ms = 1500\n", rec.url());
    let opts = Opts { config: Some(cfg), ..Opts::default() };
    let http = Http::default();
    let gw = Gateway::start(&data, opts.clone());
    let old = acquire(&http, &gw.api_url(""), "q/1", 300, 0).await.unwrap();
    // A write forwarded into a slow upstream, then the gateway dies.
    let write = tokio::spawn({
        let (http, url, t) = (http.clone(), gw.proxy_url("/q/1"), old.token.to_string());
        async move { http.try_send(http::Method::PUT, &url, &[("x-fencing-token", &t)], "old").await }
    });
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    gw.kill9();
    let _ = write.await;
    let gw = Gateway::start(&data, opts.clone());
    let booted = std::time::Instant::now();
    let new = acquire(&http, &gw.api_url(""), "q/1", 5000, 5000).await.unwrap();
    let granted = std::time::Instant::now();
    assert_eq!(new.token, old.token + 1);
    assert!(
        granted.duration_since(booted) >= std::time::Duration::from_millis(1200),
        "the grant must wait out the quarantine"
    );
    // (Without the quarantine the grant would come as soon as the restored
    // 300 ms lease ran out.)
    // A clean stop needs no quarantine.
    assert!(gw.terminate().success());
    let gw = Gateway::start(&data, opts);
    let started = std::time::Instant::now();
    let after_clean = acquire(&http, &gw.api_url(""), "q/2", 1000, 0).await.unwrap();
    assert!(started.elapsed() < std::time::Duration::from_millis(500));
    // One sequence for every key: above every token issued before.
    assert_eq!(after_clean.token, new.token + 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_start_that_cannot_bind_leaves_no_unclean_stop_behind() {
    let rec = common::Recorder::start().await;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let cfg = format!("[[routes]]\nmatch = \"/{{*path}}\"\nupstream = \"{}\"\nupstream_timeout_ms = 3000\n", rec.url());
    let http = Http::default();
    // A first, clean life, so the data dir exists.
    let gw = Gateway::start(&data, Opts { config: Some(cfg.clone()), ..Opts::default() });
    assert!(gw.terminate().success());
    // Then a start on a port somebody else holds: it must fail before it
    // touches the store.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let failed = std::process::Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .args(["serve", "--data-dir"])
        .arg(&data)
        .args(["--listen", &format!("127.0.0.1:{port}"), "--api-listen", &format!("127.0.0.1:{}", common::free_port())])
        .output()
        .unwrap();
    assert!(!failed.status.success());
    assert!(String::from_utf8_lossy(&failed.stderr).contains("Address already in use"));
    drop(taken);
    // The next start is clean: no quarantine, a grant comes at once.
    let gw = Gateway::start(&data, Opts { config: Some(cfg), ..Opts::default() });
    let started = std::time::Instant::now();
    acquire(&http, &gw.api_url(""), "after/failed-start", 1000, 0).await.unwrap();
    assert!(started.elapsed() < std::time::Duration::from_millis(1000), "the failed start left a quarantine");
    assert!(!gw.log_text().contains("did not stop cleanly"), "{}", gw.log_text());
}

/// A clean stop must not be recorded while a mutation is still in flight to
/// the upstream (its client may have given up long ago: the exchange runs
/// on). Otherwise the next start has no quarantine, a new holder is granted
/// at once, and the old holder's write is applied after the new one's.
#[tokio::test(flavor = "multi_thread")]
async fn a_clean_stop_waits_for_a_write_still_in_flight_upstream() {
    let rec = common::Recorder::start().await;
    // Both paths are the one resource "q": the old write goes to the slow
    // one, which applies it 3 s after it arrived, whatever the client does.
    rec.set_delay("/q/slow", 3000);
    rec.apply_even_if_abandoned("/q/slow");
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let cfg = format!(
        "[[routes]]\nmatch = \"/{{k}}/{{*rest}}\"\nresource = \"{{k}}\"\nupstream = \"{}\"\nupstream_timeout_ms = 6000\n",
        rec.url()
    );
    let opts = Opts { config: Some(cfg), ..Opts::default() };
    let http = Http::default();
    let gw = Gateway::start(&data, opts.clone());
    let old = acquire(&http, &gw.api_url(""), "q", 30_000, 0).await.unwrap();
    let body = "o".repeat(70_000);
    let (slow_url, old_token) = (gw.proxy_url("/q/slow"), old.token.to_string());
    let headers = [("x-fencing-token", old_token.as_str())];
    let write = http.try_send(http::Method::PUT, &slow_url, &headers, body);
    // The client gives up; the gateway's exchange goes on.
    assert!(tokio::time::timeout(std::time::Duration::from_millis(500), write).await.is_err());
    common::release(&http, &gw.api_url(""), &old).await;
    let stopping = std::time::Instant::now();
    assert!(gw.terminate().success());
    let stop_took = stopping.elapsed();

    let gw = Gateway::start(&data, opts);
    let new = acquire(&http, &gw.api_url(""), "q", 30_000, 10_000).await.unwrap();
    let (fast_url, new_token) = (gw.proxy_url("/q/fast"), new.token.to_string());
    let r = http.send(http::Method::PUT, &fast_url, &[("x-fencing-token", &new_token)], "new").await;
    assert_eq!(r.status, http::StatusCode::OK);
    // Let the old write land if it is still on its way.
    tokio::time::sleep(std::time::Duration::from_millis(3500)).await;
    let order: Vec<String> = rec.requests().iter().map(|s| s.path.clone()).collect();
    let old_at = order.iter().position(|p| p == "/q/slow");
    let new_at = order.iter().position(|p| p == "/q/fast").expect("the new write landed");
    assert!(
        old_at.is_none_or(|o| o < new_at),
        "the old holder's write was applied after the new holder's: {order:?} (stop took {stop_took:?})"
    );
    assert!(stop_took >= std::time::Duration::from_millis(1500), "the stop waited for the write: {stop_took:?}");
}
