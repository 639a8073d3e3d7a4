//! `POST /v1/locks/batch` against the real binary (docs/lease-api.md,
//! Batches): each operation answered on its own, one bad operation never
//! failing the others, the principal's prefixes checked per operation, and
//! the batch's bounds refused whole with the JSON error body.
#![allow(clippy::unwrap_used)]

use crate::common;

use common::{acquire, Gateway, Http, Opts};
use http::{Method, StatusCode};
use serde_json::{json, Value};

fn start() -> (tempfile::TempDir, Gateway) {
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(&dir.path().join("data"), Opts::default());
    (dir, gw)
}

async fn batch(http: &Http, gw: &Gateway, bearer: Option<&str>, body: Value) -> common::Reply {
    let auth = bearer.map(|t| format!("Bearer {t}"));
    let mut headers = vec![("content-type", "application/json")];
    if let Some(a) = &auth {
        headers.push(("authorization", a));
    }
    http.send(Method::POST, &gw.api_url("/v1/locks/batch"), &headers, body.to_string()).await
}

fn results(r: &common::Reply) -> Vec<Value> {
    assert_eq!(r.status, StatusCode::OK, "{:?}", String::from_utf8_lossy(&r.body));
    r.json()["results"].as_array().unwrap().clone()
}

#[tokio::test(flavor = "multi_thread")]
async fn each_operation_is_answered_on_its_own_and_a_bad_one_fails_alone() {
    let (_d, gw) = start();
    let http = Http::default();
    let held = acquire(&http, &gw.api_url(""), "b/held", 30_000, 0).await.unwrap();
    let ops = json!({"operations": [
        {"op": "acquire", "key": "b/1", "ttl_ms": 30000, "holder": "w1"},
        {"op": "acquire", "key": "b/held", "ttl_ms": 30000},
        {"op": "renew", "key": "b/held", "lease_id": held.lease_id, "ttl_ms": 20000},
        {"op": "renew", "key": "b/held", "lease_id": "0".repeat(32)},
        {"op": "release", "key": "b/held", "lease_id": "f".repeat(32)},
        {"op": "frobnicate", "key": "b/x"},
        {"op": "acquire", "key": "", "ttl_ms": 30000},
        {"op": "acquire", "key": "b/2", "ttl_ms": 1},
        {"op": "acquire", "key": "b/3", "ttl_ms": 30000, "wait_ms": 1000},
        {"op": "renew", "key": "b/held"},
        "not an object",
        {"op": "acquire", "key": "b/4", "ttl_ms": 30000},
    ]});
    let res = results(&batch(&http, &gw, None, ops).await);
    assert_eq!(res.len(), 12);
    let status = |i: usize| res[i]["status"].as_u64().unwrap();
    let code = |i: usize| res[i]["error"].as_str().unwrap_or("").to_string();
    // 0: a grant, with the single call's fields.
    assert_eq!(status(0), 200);
    assert_eq!(res[0]["key"], "b/1");
    assert_eq!(res[0]["holder"], "w1");
    assert_eq!(res[0]["lease_id"].as_str().unwrap().len(), 32);
    let t1 = res[0]["fencing_token"].as_u64().unwrap();
    assert!(t1 > held.token);
    // 1: held by someone else: 409 locked with retry_after_ms.
    assert_eq!((status(1), code(1).as_str()), (409, "locked"));
    assert!(res[1]["retry_after_ms"].as_u64().unwrap() > 0);
    // 2: renewed; 3: a wrong lease id is lost; 4: not the owner.
    assert_eq!(status(2), 200);
    assert_eq!(res[2]["fencing_token"].as_u64().unwrap(), held.token);
    assert_eq!(res[2]["ttl_ms"].as_u64().unwrap(), 20_000);
    assert_eq!((status(3), code(3).as_str()), (410, "lease_lost"));
    assert_eq!((status(4), code(4).as_str()), (409, "not_owner"));
    // 5–10: bad operations, each 400 bad_request with a message.
    for (i, r) in res.iter().enumerate().take(11).skip(5) {
        assert_eq!((status(i), code(i).as_str()), (400, "bad_request"), "{r}");
        assert!(!r["message"].as_str().unwrap().is_empty());
    }
    // 11: after all of that, still granted.
    assert_eq!(status(11), 200);
    assert!(res[11]["fencing_token"].as_u64().unwrap() > t1);
    // Effects are real: b/1 held, b/held still held by its owner, b/3 not.
    for (key, held_now) in [("b/1", true), ("b/held", true), ("b/3", false), ("b/4", true)] {
        let s = http.get(&gw.api_url(&format!("/v1/locks/status?key={key}"))).await.json();
        assert_eq!(s["held"], held_now, "{key}: {s}");
    }
    // The lease ids of a batch are the holders' own: a second batch renews
    // and releases with them.
    let id1 = res[0]["lease_id"].as_str().unwrap();
    let id4 = res[11]["lease_id"].as_str().unwrap();
    let res = results(
        &batch(
            &http,
            &gw,
            None,
            json!({"operations": [
                {"op": "renew", "key": "b/1", "lease_id": id1},
                {"op": "release", "key": "b/4", "lease_id": id4},
                {"op": "release", "key": "b/4", "lease_id": id4},
            ]}),
        )
        .await,
    );
    assert_eq!(res[0]["status"], 200);
    assert_eq!(res[1], json!({"status": 200, "key": "b/4", "released": true}));
    assert_eq!(res[2]["error"], "not_owner");
}

#[tokio::test(flavor = "multi_thread")]
async fn operations_take_effect_in_order() {
    let (_d, gw) = start();
    let http = Http::default();
    let g = acquire(&http, &gw.api_url(""), "order/k", 30_000, 0).await.unwrap();
    // Release, then acquire the same key, in one batch: the acquire sees
    // the key free.
    let res = results(
        &batch(
            &http,
            &gw,
            None,
            json!({"operations": [
                {"op": "release", "key": "order/k", "lease_id": g.lease_id},
                {"op": "acquire", "key": "order/k", "ttl_ms": 30000},
                {"op": "acquire", "key": "order/k", "ttl_ms": 30000},
            ]}),
        )
        .await,
    );
    assert_eq!(res[0]["released"], true);
    assert_eq!(res[1]["status"], 200);
    assert!(res[1]["fencing_token"].as_u64().unwrap() > g.token);
    assert_eq!(res[2]["error"], "locked");
}

#[tokio::test(flavor = "multi_thread")]
async fn batch_limits_refuse_the_whole_batch_with_a_json_error() {
    let (_d, gw) = start();
    let http = Http::default();
    let renew = json!({"op": "renew", "key": "lim/k", "lease_id": "0".repeat(32)});
    // One operation too many: 400, nothing done.
    let ops: Vec<Value> = (0..=fencegate::api::MAX_BATCH_OPERATIONS).map(|_| renew.clone()).collect();
    let r = batch(&http, &gw, None, json!({ "operations": ops })).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.error_code(), "bad_request");
    assert!(r.json()["message"].as_str().unwrap().contains("at most"));
    // Exactly the limit: answered, each on its own.
    let ops: Vec<Value> = (0..fencegate::api::MAX_BATCH_OPERATIONS).map(|_| renew.clone()).collect();
    let res = results(&batch(&http, &gw, None, json!({ "operations": ops })).await);
    assert_eq!(res.len(), fencegate::api::MAX_BATCH_OPERATIONS);
    assert!(res.iter().all(|r| r["error"] == "lease_lost"));
    // A body above 16 × api_max_body_bytes (1 MiB): 413.
    let huge =
        json!({"operations": [{"op": "acquire", "key": "lim/k", "ttl_ms": 30000, "holder": "h".repeat(1_100_000)}]});
    let r = batch(&http, &gw, None, huge).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(r.error_code(), "payload_too_large");
    // Not the batch shape: 400.
    for body in [json!([renew]), json!({"operations": renew}), json!({"ops": []}), json!({"operations": [], "x": 1})] {
        let r = batch(&http, &gw, None, body.clone()).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(r.error_code(), "bad_request");
    }
    // The wrong method: 405.
    let r = http.get(&gw.api_url("/v1/locks/batch")).await;
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
    // Nothing was granted by the refused batches.
    let s = http.get(&gw.api_url("/v1/locks/status?key=lim/k")).await.json();
    assert_eq!(s["held"], false);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_principal_s_prefixes_apply_to_each_operation() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("principals.toml");
    std::fs::write(
        &path,
        format!(
            "[[principals]]\nname = \"billing\"\ntoken_sha256 = \"{}\"\nprefixes = [\"invoices/\"]\n",
            fencegate::auth::hash_token("billing-secret")
        ),
    )
    .unwrap();
    let cfg = format!("[auth]\nprincipals_file = \"{}\"\n", path.display());
    let gw = Gateway::start(&dir.path().join("data"), Opts { config: Some(cfg), ..Opts::default() });
    let http = Http::default();
    let ops = json!({"operations": [
        {"op": "acquire", "key": "invoices/1", "ttl_ms": 30000},
        {"op": "acquire", "key": "payroll/1", "ttl_ms": 30000},
        {"op": "release", "key": "payroll/2", "lease_id": "0".repeat(32)},
        {"op": "acquire", "key": "invoices/2", "ttl_ms": 30000},
    ]});
    // No credentials: the whole batch is 401.
    let r = batch(&http, &gw, None, ops.clone()).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert_eq!(r.error_code(), "unauthorized");
    let r = batch(&http, &gw, Some("wrong"), ops.clone()).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    // Credentials: each operation judged by its own key.
    let res = results(&batch(&http, &gw, Some("billing-secret"), ops).await);
    assert_eq!(res[0]["status"], 200);
    assert_eq!((res[1]["status"].as_u64(), res[1]["error"].as_str()), (Some(403), Some("forbidden")));
    assert_eq!((res[2]["status"].as_u64(), res[2]["error"].as_str()), (Some(403), Some("forbidden")));
    assert_eq!(res[3]["status"], 200);
}

/// A field given twice in one operation is refused, as the single call
/// refuses it (a JSON object read loosely would take the last one and
/// grant a key the caller may not have meant); the other operations of the
/// batch are served. A repeated query parameter is refused too.
#[tokio::test(flavor = "multi_thread")]
async fn a_field_given_twice_fails_its_operation_alone() {
    let (_d, gw) = start();
    let http = Http::default();
    let body = r#"{"operations": [
        {"op": "acquire", "key": "dup/a", "key": "dup/b", "ttl_ms": 30000},
        {"op": "acquire", "key": "dup/c", "ttl_ms": 30000},
        {"op": "acquire", "op": "release", "key": "dup/d", "ttl_ms": 30000}
    ]}"#;
    let r =
        http.send(Method::POST, &gw.api_url("/v1/locks/batch"), &[("content-type", "application/json")], body).await;
    let res = results(&r);
    assert_eq!(res[0]["status"], 400, "{}", res[0]);
    assert!(res[0]["message"].as_str().unwrap().contains("more than once"), "{}", res[0]);
    assert_eq!(res[1]["status"], 200);
    assert_eq!(res[2]["status"], 400, "{}", res[2]);
    for (key, held) in [("dup/a", false), ("dup/b", false), ("dup/c", true), ("dup/d", false)] {
        let s = http.get(&gw.api_url(&format!("/v1/locks/status?key={key}"))).await.json();
        assert_eq!(s["held"], held, "{key}: {s}");
    }
    // The single call refuses the same body.
    let single = http
        .send(
            Method::POST,
            &gw.api_url("/v1/locks/acquire"),
            &[("content-type", "application/json")],
            r#"{"key": "dup/a", "key": "dup/b", "ttl_ms": 30000}"#,
        )
        .await;
    assert_eq!(single.status, StatusCode::BAD_REQUEST);
    let s = http.get(&gw.api_url("/v1/locks/status?key=dup/c&key=dup/a")).await;
    assert_eq!(s.status, StatusCode::BAD_REQUEST);
    assert_eq!(s.error_code(), "bad_request");
}
