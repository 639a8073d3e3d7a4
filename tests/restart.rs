//! A live grant survives a graceful restart: it comes back with its full
//! TTL, can be renewed, and its key stays locked (SPEC 3, "Restart").
#![allow(clippy::unwrap_used)]

mod common;

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
