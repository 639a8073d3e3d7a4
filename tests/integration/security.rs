//! Principals and key-prefix rules on both listeners, and the lease id as a
//! secret: never logged, never in metrics, never in status or watch.
#![allow(clippy::unwrap_used)]

use crate::common;

use common::{Gateway, Http, Opts, Recorder};
use http::{Method, StatusCode};
use serde_json::json;

fn principals(dir: &std::path::Path) -> std::path::PathBuf {
    let path = dir.join("principals.toml");
    let text = format!(
        "[[principals]]\nname = \"billing\"\ntoken_sha256 = \"{}\"\nprefixes = [\"invoices/\"]\n\
         [[principals]]\nname = \"ops\"\ntoken_sha256 = \"{}\"\nprefixes = [\"\"]\n",
        fencegate::auth::hash_token("billing-secret"),
        fencegate::auth::hash_token("ops-secret")
    );
    std::fs::write(&path, text).unwrap();
    path
}

async fn start(upstream: &str) -> (tempfile::TempDir, Gateway) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = format!(
        "[auth]\nprincipals_file = \"{}\"\nmetrics_principal = \"ops\"\n\
         [[routes]]\nname = \"invoices\"\nmatch = \"/{{*path}}\"\nupstream = \"{upstream}\"\nauth = true\n",
        principals(dir.path()).display()
    );
    let gw = Gateway::start(&dir.path().join("data"), Opts { config: Some(cfg), ..Opts::default() });
    (dir, gw)
}

async fn acquire_as(http: &Http, gw: &Gateway, token: Option<&str>, key: &str) -> common::Reply {
    let auth = token.map(|t| format!("Bearer {t}"));
    let mut headers = vec![("content-type", "application/json")];
    if let Some(a) = &auth {
        headers.push(("authorization", a));
    }
    let body = json!({"key": key, "ttl_ms": 30000}).to_string();
    http.send(Method::POST, &gw.api_url("/v1/locks/acquire"), &headers, body).await
}

#[tokio::test(flavor = "multi_thread")]
async fn api_needs_a_principal_whose_prefixes_cover_the_key() {
    let rec = Recorder::start().await;
    let (_d, gw) = start(&rec.url()).await;
    let http = Http::default();
    let r = acquire_as(&http, &gw, None, "invoices/1").await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert_eq!(r.error_code(), "unauthorized");
    let r = acquire_as(&http, &gw, Some("wrong"), "invoices/1").await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let r = acquire_as(&http, &gw, Some("billing-secret"), "ledger/1").await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    assert_eq!(r.error_code(), "forbidden");
    let r = acquire_as(&http, &gw, Some("billing-secret"), "invoices/1").await;
    assert_eq!(r.status, StatusCode::OK);
    // status and watch follow the same rule.
    let st = http
        .send(
            Method::GET,
            &gw.api_url("/v1/locks/status?key=ledger/1"),
            &[("authorization", "Bearer billing-secret")],
            "",
        )
        .await;
    assert_eq!(st.status, StatusCode::FORBIDDEN);
    let st = http.get(&gw.api_url("/v1/locks/status?key=invoices/1")).await;
    assert_eq!(st.status, StatusCode::UNAUTHORIZED);
    // /metrics and the health endpoints are behind their own principal here.
    assert_eq!(http.get(&gw.api_url("/metrics")).await.status, StatusCode::UNAUTHORIZED);
    let m = http.send(Method::GET, &gw.api_url("/metrics"), &[("authorization", "Bearer billing-secret")], "").await;
    assert_eq!(m.status, StatusCode::FORBIDDEN);
    let m = http.send(Method::GET, &gw.api_url("/healthz"), &[("authorization", "Bearer ops-secret")], "").await;
    assert_eq!(m.status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread")]
async fn proxy_routes_with_auth_apply_the_prefix_rule_to_the_resource() {
    let rec = Recorder::start().await;
    let (_d, gw) = start(&rec.url()).await;
    let http = Http::default();
    let g = acquire_as(&http, &gw, Some("ops-secret"), "ledger/1").await.json();
    let t = g["fencing_token"].to_string();
    // A valid token is not enough: the writer must be someone.
    let r = http.send(Method::PUT, &gw.proxy_url("/ledger/1"), &[("x-fencing-token", &t)], "x").await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let r = http
        .send(
            Method::PUT,
            &gw.proxy_url("/ledger/1"),
            &[("x-fencing-token", &t), ("proxy-authorization", "Bearer billing-secret")],
            "x",
        )
        .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    assert_eq!(rec.count(), 0);
    let r = http
        .send(
            Method::PUT,
            &gw.proxy_url("/ledger/1"),
            &[
                ("x-fencing-token", &t),
                ("proxy-authorization", "Bearer ops-secret"),
                ("authorization", "AWS4-HMAC-SHA256 sig"),
            ],
            "x",
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let seen = rec.requests();
    assert_eq!(seen.len(), 1);
    assert!(!seen[0].headers.contains_key("proxy-authorization"), "the gateway's credentials never reach the upstream");
    assert_eq!(
        seen[0].headers["authorization"], "AWS4-HMAC-SHA256 sig",
        "the client's own Authorization passes untouched"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn lease_id_is_never_logged_shown_or_exported() {
    let dir = tempfile::tempdir().unwrap();
    let rec = Recorder::start().await;
    let gw = Gateway::start(&dir.path().join("data"), Opts { upstream: Some(rec.url()), ..Opts::default() });
    let http = Http::default();
    let api = gw.api_url("");
    let g = common::acquire(&http, &api, "secret/key", 30_000, 0).await.unwrap();
    // Exercise everything that logs or reports.
    http.post_json(&format!("{api}/v1/locks/renew"), json!({"key": "secret/key", "lease_id": g.lease_id})).await;
    http.post_json(&format!("{api}/v1/locks/release"), json!({"key": "secret/key", "lease_id": "0".repeat(32)})).await;
    let status = http.get(&format!("{api}/v1/locks/status?key=secret/key")).await;
    let watch = http.get(&format!("{api}/v1/locks/watch?key=secret/key&after=0&timeout_ms=10")).await;
    http.send(Method::PUT, &gw.proxy_url("/secret/key"), &[("x-fencing-token", "999")], "x").await;
    let metrics = http.get(&gw.api_url("/metrics")).await;
    for (what, text) in [
        ("status", String::from_utf8_lossy(&status.body).into_owned()),
        ("watch", String::from_utf8_lossy(&watch.body).into_owned()),
        ("metrics", String::from_utf8_lossy(&metrics.body).into_owned()),
    ] {
        assert!(!text.contains(&g.lease_id), "lease id leaked in {what}");
        assert!(!text.contains("lease_id"), "{what} mentions lease_id");
    }
    let log_path = gw.log.clone();
    assert!(gw.terminate().success());
    let log = std::fs::read_to_string(log_path).unwrap();
    assert!(!log.is_empty(), "the gateway logged nothing to check");
    assert!(!log.contains(&g.lease_id), "lease id leaked in the log");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_principal_may_queue_only_so_many_waiters() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = format!(
        "[locks]\nmax_waiters_per_principal = 2\n[auth]\nprincipals_file = \"{}\"\n",
        principals(dir.path()).display()
    );
    let gw = Gateway::start(&dir.path().join("data"), Opts { config: Some(cfg), ..Opts::default() });
    let http = Http::default();
    assert_eq!(acquire_as(&http, &gw, Some("billing-secret"), "invoices/1").await.status, StatusCode::OK);
    let wait = |_| {
        let (http, url) = (http.clone(), gw.api_url("/v1/locks/acquire"));
        tokio::spawn(async move {
            let body = json!({"key": "invoices/1", "ttl_ms": 1000, "wait_ms": 2000}).to_string();
            let headers = [("authorization", "Bearer billing-secret")];
            http.send(Method::POST, &url, &headers, body).await
        })
    };
    let waiters: Vec<_> = (0..2).map(wait).collect();
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let asked = std::time::Instant::now();
    let third = wait(2).await.unwrap();
    assert_eq!(third.status, StatusCode::CONFLICT);
    assert!(asked.elapsed() < std::time::Duration::from_millis(1000), "the third waiter is turned away at once");
    // Another principal is not affected.
    let ops = http
        .send(
            Method::POST,
            &gw.api_url("/v1/locks/acquire"),
            &[("authorization", "Bearer ops-secret")],
            json!({"key": "invoices/1", "ttl_ms": 1000, "wait_ms": 100}).to_string(),
        )
        .await;
    assert_eq!(ops.error_code(), "locked");
    for w in waiters {
        assert_eq!(w.await.unwrap().error_code(), "locked");
    }
}

/// Watches are long-lived: one principal — or, when the lease API needs
/// no principal, one client address — may hold only so many open. More get
/// 429 at once; a watch whose client hangs up frees its slot.
#[tokio::test(flavor = "multi_thread")]
async fn a_principal_or_an_address_may_hold_only_so_many_watches() {
    let dir = tempfile::tempdir().unwrap();
    let with_auth = format!(
        "[locks]\nmax_watches_per_principal = 2\n[auth]\nprincipals_file = \"{}\"\n",
        principals(dir.path()).display()
    );
    for (name, cfg, who) in [
        ("auth", with_auth, Some("billing-secret")),
        ("no-auth", "[locks]\nmax_watches_per_principal = 2\n".to_string(), None),
    ] {
        let gw = Gateway::start(&dir.path().join(name), Opts { config: Some(cfg), ..Opts::default() });
        let http = Http::default();
        let auth = who.map(|t| format!("Bearer {t}"));
        let watch = |key: &str| {
            let (http, url) = (http.clone(), gw.api_url(&format!("/v1/locks/watch?key={key}&timeout_ms=20000")));
            let auth = auth.clone();
            tokio::spawn(async move {
                let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
                http.send(Method::GET, &url, &headers, "").await
            })
        };
        let open: Vec<_> = (0..2).map(|i| watch(&format!("invoices/w{i}"))).collect();
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        let asked = std::time::Instant::now();
        let third = watch("invoices/w2").await.unwrap();
        assert_eq!(third.status, StatusCode::TOO_MANY_REQUESTS, "{name}");
        assert_eq!(third.error_code(), "too_many_watches", "{name}");
        assert!(asked.elapsed() < std::time::Duration::from_secs(2), "{name}: turned away at once");
        if who.is_some() {
            // Another principal is not affected.
            let url = gw.api_url("/v1/locks/watch?key=x&timeout_ms=10");
            let ops = http.send(Method::GET, &url, &[("authorization", "Bearer ops-secret")], "").await;
            assert_eq!(ops.status, StatusCode::OK, "{name}");
        }
        // Clients that hang up free their slots.
        for w in open {
            w.abort();
        }
        let t = std::time::Instant::now();
        loop {
            let again = watch("invoices/w3");
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            if !again.is_finished() {
                again.abort();
                break;
            }
            let status = again.await.unwrap().status;
            assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{name}");
            assert!(t.elapsed() < std::time::Duration::from_secs(5), "{name}: hung-up watches kept their slots");
        }
    }
}

/// Every key ever fenced costs memory and disk for good: a principal may
/// fence only `max_fences_per_principal` keys (counted across restarts from
/// the keys on disk under its prefixes), the gateway only `max_fences`.
/// Keys already fenced stay usable.
#[tokio::test(flavor = "multi_thread")]
async fn fence_quotas_bound_new_keys_per_principal_and_per_gateway() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = format!(
        "[locks]\nmax_fences_per_principal = 3\n[auth]\nprincipals_file = \"{}\"\n",
        principals(dir.path()).display()
    );
    let data = dir.path().join("data");
    let opts = Opts { config: Some(cfg), ..Opts::default() };
    let acquire = |gw: &Gateway, http: &Http, who: &'static str, key: String| {
        let (http, url) = (http.clone(), gw.api_url("/v1/locks/acquire"));
        async move {
            let body = serde_json::json!({"key": key, "ttl_ms": 1000}).to_string();
            let auth = format!("Bearer {who}");
            http.send(
                Method::POST,
                &url,
                &[("authorization", auth.as_str()), ("content-type", "application/json")],
                body,
            )
            .await
        }
    };
    let gw = Gateway::start(&data, opts.clone());
    let http = Http::default();
    for i in 0..3 {
        assert_eq!(acquire(&gw, &http, "billing-secret", format!("invoices/{i}")).await.status, StatusCode::OK);
    }
    let r = acquire(&gw, &http, "billing-secret", "invoices/3".into()).await;
    assert_eq!(r.status, StatusCode::INSUFFICIENT_STORAGE);
    assert_eq!(r.error_code(), "fence_quota_exceeded");
    assert!(gw.terminate().success());
    // After a restart the count comes from the keys on disk.
    let gw = Gateway::start(&data, opts);
    let r = acquire(&gw, &http, "billing-secret", "invoices/4".into()).await;
    assert_eq!(r.error_code(), "fence_quota_exceeded", "counted again at start");
    // A key it already fenced is not refused (its lease of 1 s has ended).
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    assert_eq!(acquire(&gw, &http, "billing-secret", "invoices/0".into()).await.status, StatusCode::OK);
    // The gateway's own limit, whoever asks.
    let cfg = format!(
        "[locks]\nmax_fences_per_principal = 100\nmax_fences = 2\n[auth]\nprincipals_file = \"{}\"\n",
        principals(dir.path()).display()
    );
    let gw = Gateway::start(&dir.path().join("data2"), Opts { config: Some(cfg), ..Opts::default() });
    for i in 0..2 {
        assert_eq!(acquire(&gw, &http, "ops-secret", format!("ops/{i}")).await.status, StatusCode::OK);
    }
    let r = acquire(&gw, &http, "billing-secret", "invoices/9".into()).await;
    assert_eq!(r.status, StatusCode::INSUFFICIENT_STORAGE);
    assert!(r.json()["message"].as_str().unwrap().contains("gateway"), "{}", r.json());
}
