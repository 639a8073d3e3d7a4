//! The lease API over a real socket, against the real binary: every status
//! and error code of the lease API (docs/lease-api.md).
#![allow(clippy::unwrap_used)]

use crate::common;

use common::{acquire, release, Gateway, Http, Opts};
use http::{Method, StatusCode};
use serde_json::json;

fn start() -> (tempfile::TempDir, Gateway) {
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(&dir.path().join("data"), Opts::default());
    (dir, gw)
}

#[tokio::test(flavor = "multi_thread")]
async fn acquire_renew_release_status_round_trip() {
    let (_d, gw) = start();
    let http = Http::default();
    let api = gw.api_url("");
    let r = http
        .post_json(&format!("{api}/v1/locks/acquire"), json!({"key": "orders/1", "ttl_ms": 5000, "holder": "w1"}))
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.headers["content-type"], "application/json");
    let g = r.json();
    assert_eq!(g["key"], "orders/1");
    assert_eq!(g["fencing_token"], 1);
    assert_eq!(g["ttl_ms"], 5000);
    assert_eq!(g["holder"], "w1");
    let lease_id = g["lease_id"].as_str().unwrap().to_string();
    assert_eq!(lease_id.len(), 32, "128-bit lease id as hex");

    let s = http.get(&format!("{api}/v1/locks/status?key=orders%2F1")).await.json();
    assert_eq!(s["fence"], 1);
    assert_eq!(s["held"], true);
    assert_eq!(s["fencing_token"], 1);
    assert_eq!(s["holder"], "w1");
    assert!(s["expires_in_ms"].as_u64().unwrap() <= 5000);
    assert!(s.get("lease_id").is_none(), "status must never show the lease id");

    let r = http
        .post_json(&format!("{api}/v1/locks/renew"), json!({"key": "orders/1", "lease_id": lease_id, "ttl_ms": 8000}))
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json(), json!({"key": "orders/1", "fencing_token": 1, "ttl_ms": 8000}));

    let r = http.post_json(&format!("{api}/v1/locks/release"), json!({"key": "orders/1", "lease_id": lease_id})).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json(), json!({"key": "orders/1", "released": true}));

    let s = http.get(&format!("{api}/v1/locks/status?key=orders/1")).await.json();
    assert_eq!(s, json!({"key": "orders/1", "fence": 1, "held": false}));
}

#[tokio::test(flavor = "multi_thread")]
async fn locked_answer_has_retry_after() {
    let (_d, gw) = start();
    let http = Http::default();
    let api = gw.api_url("");
    acquire(&http, &api, "k", 10_000, 0).await.unwrap();
    let r = acquire(&http, &api, "k", 1000, 0).await.unwrap_err();
    assert_eq!(r.status, StatusCode::CONFLICT);
    assert_eq!(r.error_code(), "locked");
    let retry = r.json()["retry_after_ms"].as_u64().unwrap();
    assert!(retry > 9000 && retry <= 10_000, "{retry}");
    assert_eq!(r.headers["retry-after"], "10");
    // With wait_ms, the 409 comes once the wait has passed.
    let started = std::time::Instant::now();
    let r = acquire(&http, &api, "k", 1000, 300).await.unwrap_err();
    assert_eq!(r.error_code(), "locked");
    assert!(started.elapsed() >= std::time::Duration::from_millis(300));
}

#[tokio::test(flavor = "multi_thread")]
async fn waiter_gets_the_lock_on_release() {
    let (_d, gw) = start();
    let http = Http::default();
    let api = gw.api_url("");
    let first = acquire(&http, &api, "k", 10_000, 0).await.unwrap();
    let waiter = tokio::spawn({
        let (http, api) = (http.clone(), api.clone());
        async move { acquire(&http, &api, "k", 1000, 10_000).await }
    });
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert!(!waiter.is_finished());
    assert_eq!(release(&http, &api, &first).await.status, StatusCode::OK);
    let second = waiter.await.unwrap().unwrap();
    assert_eq!(second.token, 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn renew_of_lost_lease_is_410_and_release_by_stranger_is_409() {
    let (_d, gw) = start();
    let http = Http::default();
    let api = gw.api_url("");
    let g = acquire(&http, &api, "k", 200, 0).await.unwrap();
    let stranger =
        http.post_json(&format!("{api}/v1/locks/release"), json!({"key": "k", "lease_id": "00".repeat(16)})).await;
    assert_eq!(stranger.status, StatusCode::CONFLICT);
    assert_eq!(stranger.error_code(), "not_owner");
    tokio::time::sleep(std::time::Duration::from_millis(400)).await;
    let r = http.post_json(&format!("{api}/v1/locks/renew"), json!({"key": "k", "lease_id": g.lease_id})).await;
    assert_eq!(r.status, StatusCode::GONE);
    assert_eq!(r.error_code(), "lease_lost");
    let unknown = http.post_json(&format!("{api}/v1/locks/renew"), json!({"key": "nokey", "lease_id": "x"})).await;
    assert_eq!(unknown.status, StatusCode::GONE);
    // Superseded: a new holder; the old lease id is lost.
    let g2 = acquire(&http, &api, "k", 5000, 0).await.unwrap();
    assert_eq!(g2.token, 2);
    let r = http.post_json(&format!("{api}/v1/locks/renew"), json!({"key": "k", "lease_id": g.lease_id})).await;
    assert_eq!(r.error_code(), "lease_lost");
    let r = release(&http, &api, &g).await;
    assert_eq!(r.error_code(), "not_owner");
}

#[tokio::test(flavor = "multi_thread")]
async fn watch_answers_when_the_holder_changes() {
    let (_d, gw) = start();
    let http = Http::default();
    let api = gw.api_url("");
    let w = tokio::spawn({
        let (http, api) = (http.clone(), api.clone());
        async move { http.get(&format!("{api}/v1/locks/watch?key=k&after=0&timeout_ms=10000")).await }
    });
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert!(!w.is_finished());
    let g = acquire(&http, &api, "k", 5000, 0).await.unwrap();
    let r = w.await.unwrap();
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json()["fencing_token"], g.token);
    // Unchanged: answers at the timeout with the same status.
    let started = std::time::Instant::now();
    let r = http.get(&format!("{api}/v1/locks/watch?key=k&after={}&timeout_ms=300", g.token)).await;
    assert!(started.elapsed() >= std::time::Duration::from_millis(300));
    assert_eq!(r.json()["fencing_token"], g.token);
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_input_gets_400_with_json_error() {
    let (_d, gw) = start();
    let http = Http::default();
    let url = gw.api_url("/v1/locks/acquire");
    let cases = [
        json!({"key": "k", "ttl_ms": 99}),
        json!({"key": "k", "ttl_ms": 3_600_001}),
        json!({"key": "k", "ttl_ms": 1000, "wait_ms": 300_001}),
        json!({"key": "", "ttl_ms": 1000}),
        json!({"key": "k".repeat(513), "ttl_ms": 1000}),
        json!({"key": "a\u{1}b", "ttl_ms": 1000}),
        json!({"key": "k", "ttl_ms": -5}),
        json!({"key": "k", "ttl_ms": "1000"}),
        json!({"key": "k"}),
        json!({"key": "k", "ttl_ms": 1000, "unknown": 1}),
        json!({"key": "k", "ttl_ms": 1000, "holder": "x".repeat(300)}),
        json!([1, 2]),
        json!(["k", 1000]),
    ];
    for body in cases {
        let r = http.post_json(&url, body.clone()).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(r.error_code(), "bad_request", "{body}");
        assert!(r.json()["message"].as_str().is_some_and(|m| !m.is_empty()));
    }
    for raw in ["", "{", "not json", "{\"key\": \"k\", \"ttl_ms\": 1e400}", "\u{0}"] {
        let r = http.send(Method::POST, &url, &[], raw.to_string()).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{raw:?}");
        assert_eq!(r.error_code(), "bad_request");
    }
    let r = http.send(Method::POST, &url, &[], vec![0xffu8, 0xfe, 0x00]).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    for q in ["", "?key=", "?key=%zz", "?key=%ff"] {
        let r = http.get(&gw.api_url(&format!("/v1/locks/status{q}"))).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{q}");
        assert_eq!(r.error_code(), "bad_request");
    }
    let r = http.get(&gw.api_url("/v1/locks/watch?key=k&after=x")).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
}

#[tokio::test(flavor = "multi_thread")]
async fn oversized_body_is_413_and_unknown_paths_404_405() {
    let (_d, gw) = start();
    let http = Http::default();
    let big = format!("{{\"key\": \"k\", \"ttl_ms\": 1000, \"holder\": \"{}\"}}", "x".repeat(70_000));
    let r = http.send(Method::POST, &gw.api_url("/v1/locks/acquire"), &[], big).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(r.error_code(), "payload_too_large");
    let r = http.get(&gw.api_url("/v1/nope")).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(r.error_code(), "not_found");
    let r = http.get(&gw.api_url("/v1/locks/acquire")).await;
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(r.error_code(), "method_not_allowed");
}

#[tokio::test(flavor = "multi_thread")]
async fn health_ready_and_metrics_answer() {
    let (_d, gw) = start();
    let http = Http::default();
    assert_eq!(http.get(&gw.api_url("/healthz")).await.status, StatusCode::OK);
    assert_eq!(http.get(&gw.api_url("/readyz")).await.status, StatusCode::OK);
    acquire(&http, &gw.api_url(""), "k", 1000, 0).await.unwrap();
    let m = http.get(&gw.api_url("/metrics")).await;
    let text = String::from_utf8(m.body.to_vec()).unwrap();
    assert!(text.contains("fencegate_lock_requests_total{op=\"acquire\",outcome=\"ok\"} 1"), "{text}");
    assert!(text.contains("fencegate_leases_active 1"));
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_stops_the_gateway_cleanly() {
    let (_d, gw) = start();
    let status = gw.terminate();
    assert!(status.success(), "{status:?}");
}
