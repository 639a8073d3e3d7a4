//! The fenced proxy against the real binary and a recording upstream:
//! every row of the check table (docs/proxy.md), each asserting that a refused
//! request never reached the upstream; reads; path aliases; proxy headers.
#![allow(clippy::unwrap_used)]

use crate::common;

use common::{acquire, release, Gateway, Grant, Http, Opts, Recorder};
use http::{Method, StatusCode};

async fn setup_with(config: Option<String>) -> (tempfile::TempDir, Gateway, Recorder, Http) {
    let rec = Recorder::start().await;
    let dir = tempfile::tempdir().unwrap();
    let opts = match config {
        Some(c) => Opts { config: Some(c.replace("UPSTREAM", &rec.url())), ..Opts::default() },
        None => Opts { upstream: Some(rec.url()), ..Opts::default() },
    };
    let gw = Gateway::start(&dir.path().join("data"), opts);
    (dir, gw, rec, Http::default())
}

async fn setup() -> (tempfile::TempDir, Gateway, Recorder, Http) {
    setup_with(None).await
}

async fn put(http: &Http, gw: &Gateway, path: &str, token: Option<&str>) -> common::Reply {
    let mut headers = vec![];
    if let Some(t) = token {
        headers.push(("x-fencing-token", t));
    }
    http.send(Method::PUT, &gw.proxy_url(path), &headers, "payload").await
}

#[tokio::test(flavor = "multi_thread")]
async fn missing_token_is_428_before_upstream() {
    let (_d, gw, rec, http) = setup().await;
    for m in [Method::PUT, Method::POST, Method::PATCH, Method::DELETE] {
        let r = http.send(m.clone(), &gw.proxy_url("/orders/1"), &[], "x").await;
        assert_eq!(r.status, StatusCode::PRECONDITION_REQUIRED, "{m}");
        assert_eq!(r.error_code(), "fencing_token_required");
    }
    assert_eq!(rec.count(), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn malformed_token_is_400_before_upstream() {
    let (_d, gw, rec, http) = setup().await;
    let g = acquire(&http, &gw.api_url(""), "orders/1", 10_000, 0).await.unwrap();
    let t = g.token.to_string();
    let bad = ["", "+1", "-1", "1 2", "0x1", "1.0", "abc", "18446744073709551616", "1,2"];
    for v in bad {
        let r = put(&http, &gw, "/orders/1", Some(v)).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{v:?}");
        assert_eq!(r.error_code(), "malformed_fencing_token", "{v:?}");
    }
    // Two header lines that disagree.
    let r = http
        .send(Method::PUT, &gw.proxy_url("/orders/1"), &[("x-fencing-token", &t), ("x-fencing-token", "999")], "x")
        .await;
    assert_eq!(r.error_code(), "malformed_fencing_token");
    assert_eq!(rec.count(), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn stale_token_is_409_with_token_and_fence_before_upstream() {
    let (_d, gw, rec, http) = setup().await;
    let api = gw.api_url("");
    let old = acquire(&http, &api, "orders/1", 10_000, 0).await.unwrap();
    release(&http, &api, &old).await;
    let new = acquire(&http, &api, "orders/1", 10_000, 0).await.unwrap();
    let r = put(&http, &gw, "/orders/1", Some(&old.token.to_string())).await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    assert_eq!(r.error_code(), "stale_fencing_token");
    assert_eq!(r.json()["token"], old.token);
    assert_eq!(r.json()["fence"], new.token);
    assert_eq!(rec.count(), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn unissued_token_is_403_and_cannot_fence_out_the_holder() {
    let (_d, gw, rec, http) = setup().await;
    let api = gw.api_url("");
    let g = acquire(&http, &api, "orders/1", 10_000, 0).await.unwrap();
    let other = acquire(&http, &api, "orders/2", 10_000, 0).await.unwrap();
    let other2 = {
        release(&http, &api, &other).await;
        acquire(&http, &api, "orders/2", 10_000, 0).await.unwrap()
    };
    for t in ["999999", &u64::MAX.to_string(), &other2.token.to_string()] {
        let r = put(&http, &gw, "/orders/1", Some(t)).await;
        assert_eq!(r.status, StatusCode::FORBIDDEN, "{t}");
        assert_eq!(r.error_code(), "unissued_fencing_token");
    }
    // Fresh key, nothing ever issued.
    let r = put(&http, &gw, "/fresh", Some("1")).await;
    assert_eq!(r.error_code(), "unissued_fencing_token");
    assert_eq!(rec.count(), 0);
    // The holder was not fenced out by the made-up numbers.
    let r = put(&http, &gw, "/orders/1", Some(&g.token.to_string())).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(rec.count(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn ended_grant_is_409_lease_expired_on_strict_routes() {
    let (_d, gw, rec, http) = setup().await;
    let api = gw.api_url("");
    let g = acquire(&http, &api, "released", 10_000, 0).await.unwrap();
    release(&http, &api, &g).await;
    let r = put(&http, &gw, "/released", Some(&g.token.to_string())).await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    assert_eq!(r.error_code(), "lease_expired");
    let e = acquire(&http, &api, "expired", 150, 0).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let r = put(&http, &gw, "/expired", Some(&e.token.to_string())).await;
    assert_eq!(r.error_code(), "lease_expired");
    assert_eq!(rec.count(), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn non_strict_route_accepts_the_last_token_after_its_lease_ended() {
    let cfg = r#"
[[routes]]
match = "/{*path}"
upstream = "UPSTREAM"
strict = false
"#;
    let (_d, gw, rec, http) = setup_with(Some(cfg.into())).await;
    let api = gw.api_url("");
    let g = acquire(&http, &api, "k", 10_000, 0).await.unwrap();
    release(&http, &api, &g).await;
    let r = put(&http, &gw, "/k", Some(&g.token.to_string())).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(rec.count(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn current_token_is_forwarded_with_proxy_headers() {
    let (_d, gw, rec, http) = setup().await;
    let g = acquire(&http, &gw.api_url(""), "orders/1", 10_000, 0).await.unwrap();
    let t = g.token.to_string();
    let r = http
        .send(
            Method::PUT,
            &gw.proxy_url("/orders/1?x=1"),
            &[
                ("x-fencing-token", &t),
                ("connection", "keep-alive, x-hop"),
                ("x-hop", "secret"),
                ("te", "trailers"),
                ("if-match", "\"abc\""),
                ("x-forwarded-for", "192.0.2.9"),
            ],
            "payload",
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(&r.body[..], b"stored");
    assert!(r.headers["via"].to_str().unwrap().contains("fencegate"));
    let seen = rec.requests();
    assert_eq!(seen.len(), 1);
    let s = &seen[0];
    assert_eq!(s.method, Method::PUT);
    assert_eq!(s.path, "/orders/1");
    assert_eq!(&s.body[..], b"payload");
    assert_eq!(s.headers["x-fencing-token"], t.as_str());
    assert_eq!(s.headers["if-match"], "\"abc\"");
    assert_eq!(s.headers["x-forwarded-for"], "192.0.2.9, 127.0.0.1");
    assert_eq!(s.headers["x-forwarded-proto"], "http");
    assert_eq!(s.headers["x-forwarded-host"], gw.proxy.to_string().as_str());
    assert_eq!(s.headers["host"], gw.proxy.to_string().as_str());
    assert!(s.headers["via"].to_str().unwrap().contains("fencegate"));
    assert!(!s.headers.contains_key("x-hop"));
    assert!(!s.headers.contains_key("te"));
}

#[tokio::test(flavor = "multi_thread")]
async fn reads_pass_but_a_stale_read_learns_it() {
    let (_d, gw, rec, http) = setup().await;
    let api = gw.api_url("");
    let r = http.get(&gw.proxy_url("/orders/1")).await;
    assert_eq!(r.status, StatusCode::OK);
    let old = acquire(&http, &api, "orders/1", 10_000, 0).await.unwrap();
    release(&http, &api, &old).await;
    acquire(&http, &api, "orders/1", 10_000, 0).await.unwrap();
    let r =
        http.send(Method::GET, &gw.proxy_url("/orders/1"), &[("x-fencing-token", &old.token.to_string())], "").await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    assert_eq!(r.error_code(), "stale_fencing_token");
    assert_eq!(rec.count(), 1, "only the token-less read reached the upstream");
}

/// One request on a connection of its own (`Connection: close`). The fast
/// path keeps a connection only until it hands it to the general path, so
/// each request here reaches the transport under test first.
async fn alone(http: &Http, m: Method, url: &str, headers: &[(&str, &str)], body: &'static str) -> common::Reply {
    let mut headers = headers.to_vec();
    headers.push(("connection", "close"));
    http.send(m, url, &headers, body).await
}

/// A catch-all route to the recorder, and `/s3/…` to an upstream that
/// keeps `dir/` apart from `dir`, on the fast path or the general one.
fn transport_config(fast: bool) -> String {
    format!(
        r#"
[server]
proxy_fast_path = {fast}

[[routes]]
name = "s3"
match = "/s3/{{*key}}"
upstream = "UPSTREAM"
trailing_slash = "distinct"

[[routes]]
name = "main"
match = "/{{*path}}"
upstream = "UPSTREAM"
"#
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn path_aliases_are_refused_before_upstream() {
    for fast in [true, false] {
        let (_d, gw, rec, http) = setup_with(Some(transport_config(fast))).await;
        let api = gw.api_url("");
        let g = acquire(&http, &api, "orders/1", 10_000, 0).await.unwrap();
        let t = g.token.to_string();
        for path in [
            "/orders/x/../1",
            "/orders/./1",
            "/orders//1",
            "/orders%2F1",
            "/orders%2f1",
            "/orders/%2e%2e/1",
            "/orders%5C1",
            "/orders/1%00",
            "/orders/%ff",
            "/orders/%zz",
        ] {
            let r = alone(&http, Method::PUT, &gw.proxy_url(path), &[("x-fencing-token", &t)], "x").await;
            assert_eq!(r.status, StatusCode::BAD_REQUEST, "{path} fast={fast}");
            assert_eq!(r.error_code(), "bad_request", "{path} fast={fast}");
        }
        // A trailing slash is a second key ("orders/1/") for the same
        // upstream object: refused on mutations, whatever the token (the
        // holder of "orders/1/" must not write "orders/1" past its fence).
        let slash = acquire(&http, &api, "orders/1/", 10_000, 0).await.unwrap();
        for (m, token) in [
            (Method::PUT, &t),
            (Method::PUT, &slash.token.to_string()),
            (Method::DELETE, &slash.token.to_string()),
            (Method::POST, &t),
            (Method::from_bytes(b"MOVE").unwrap(), &t),
        ] {
            let r = alone(&http, m.clone(), &gw.proxy_url("/orders/1/"), &[("x-fencing-token", token)], "x").await;
            assert_eq!(r.status, StatusCode::BAD_REQUEST, "{m} {token} fast={fast}");
            assert_eq!(r.error_code(), "bad_request", "{m} fast={fast}");
            assert!(r.json()["message"].as_str().unwrap().contains("trailing slash"), "{m} fast={fast}");
        }
        // Encoded, the slash is refused by the path rule itself.
        let r = alone(&http, Method::PUT, &gw.proxy_url("/orders/1%2F"), &[("x-fencing-token", &t)], "x").await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "fast={fast}");
        assert_eq!(rec.count(), 0, "fast={fast}");
        // One spelling of the same key: %31 is "1".
        let r = alone(&http, Method::PUT, &gw.proxy_url("/orders/%31"), &[("x-fencing-token", &t)], "x").await;
        assert_eq!(r.status, StatusCode::OK, "fast={fast}");
        // Reads of a trailing-slash path (listings) pass.
        assert_eq!(
            alone(&http, Method::GET, &gw.proxy_url("/orders/"), &[], "").await.status,
            StatusCode::OK,
            "fast={fast}"
        );
        // A route whose upstream keeps "dir/" apart takes it as its own key.
        let dir = acquire(&http, &api, "s3/dir/", 10_000, 0).await.unwrap();
        let r =
            alone(&http, Method::PUT, &gw.proxy_url("/s3/dir/"), &[("x-fencing-token", &dir.token.to_string())], "x")
                .await;
        assert_eq!(r.status, StatusCode::OK, "fast={fast}");
        let r = alone(&http, Method::PUT, &gw.proxy_url("/s3/dir/"), &[], "x").await;
        assert_eq!(r.error_code(), "fencing_token_required", "fast={fast}");
        let paths: Vec<_> = rec.requests().iter().map(|s| s.path.clone()).collect();
        assert_eq!(paths.len(), 3, "fast={fast}: {paths:?}");
        assert_eq!(paths[1..], ["/orders/", "/s3/dir/"], "fast={fast}");
    }
}

/// A gateway on one transport (fast path or general) in front of the
/// recorder, with `orders/1` granted, released and granted again: the
/// first grant (its token now stale) and the current one.
async fn superseded(fast: bool) -> (tempfile::TempDir, Gateway, Recorder, Http, Grant, Grant) {
    let (d, gw, rec, http) = setup_with(Some(transport_config(fast))).await;
    let api = gw.api_url("");
    let old = acquire(&http, &api, "orders/1", 10_000, 0).await.unwrap();
    release(&http, &api, &old).await;
    let new = acquire(&http, &api, "orders/1", 10_000, 0).await.unwrap();
    (d, gw, rec, http, old, new)
}

/// Every method that is not a read method of the route is a mutation:
/// WebDAV's and other extension methods, and other spellings of the
/// standard ones (methods are case-sensitive; some backends fold them).
#[tokio::test(flavor = "multi_thread")]
async fn unlisted_methods_are_mutations_on_both_transports() {
    let methods = ["MOVE", "COPY", "PROPPATCH", "MKCOL", "LOCK", "UNLOCK", "PURGE", "TRACE", "put", "Delete", "get"];
    for fast in [true, false] {
        let (_d, gw, rec, http, old, new) = superseded(fast).await;
        let url = gw.proxy_url("/orders/1");
        for name in methods {
            let m = Method::from_bytes(name.as_bytes()).unwrap();
            let r = alone(&http, m.clone(), &url, &[], "x").await;
            assert_eq!(r.status, StatusCode::PRECONDITION_REQUIRED, "{name} fast={fast}");
            assert_eq!(r.error_code(), "fencing_token_required", "{name} fast={fast}");
            let r = alone(&http, m.clone(), &url, &[("x-fencing-token", &old.token.to_string())], "x").await;
            assert_eq!(r.status, StatusCode::CONFLICT, "{name} fast={fast}");
            assert_eq!(r.error_code(), "stale_fencing_token", "{name} fast={fast}");
            // Above the fence: a read would pass, a mutation is refused.
            let r = alone(&http, m, &url, &[("x-fencing-token", "999999")], "x").await;
            assert_eq!(r.status, StatusCode::FORBIDDEN, "{name} fast={fast}");
            assert_eq!(r.error_code(), "unissued_fencing_token", "{name} fast={fast}");
        }
        assert_eq!(rec.count(), 0, "fast={fast}: {:?}", rec.requests());
        // The holder's own MOVE and lowercase put go through, as mutations.
        let t = new.token.to_string();
        for name in ["MOVE", "put"] {
            let m = Method::from_bytes(name.as_bytes()).unwrap();
            let r = alone(&http, m, &url, &[("x-fencing-token", &t)], "x").await;
            assert_eq!(r.status, StatusCode::OK, "{name} fast={fast}");
        }
        // Reads still pass without a token.
        for m in [Method::GET, Method::HEAD, Method::OPTIONS] {
            assert_eq!(alone(&http, m.clone(), &url, &[], "").await.status, StatusCode::OK, "{m} fast={fast}");
        }
        let seen: Vec<_> = rec.requests().iter().map(|s| s.method.to_string()).collect();
        assert_eq!(seen, ["MOVE", "put", "GET", "HEAD", "OPTIONS"], "fast={fast}");
        let m = String::from_utf8(http.get(&gw.api_url("/metrics")).await.body.to_vec()).unwrap();
        let n = methods.len();
        assert!(
            m.contains(&format!("fencegate_mutations_total{{outcome=\"missing_token\",route=\"main\"}} {n}")),
            "{m}"
        );
        assert!(m.contains(&format!("fencegate_mutations_total{{outcome=\"stale\",route=\"main\"}} {n}")), "{m}");
        assert!(m.contains("fencegate_mutations_total{outcome=\"forwarded\",route=\"main\"} 2"), "{m}");
    }
}

/// A read that carries a method override naming a mutation (some backends
/// obey `X-HTTP-Method-Override` and its kin) is a mutation: without a
/// token, or with a stale one, it is refused and never reaches the upstream.
/// An override naming a read stays a read.
#[tokio::test(flavor = "multi_thread")]
async fn a_method_override_naming_a_mutation_is_a_mutation_on_both_transports() {
    for fast in [true, false] {
        let (_d, gw, rec, http, old, new) = superseded(fast).await;
        let url = gw.proxy_url("/orders/1");
        let stale = old.token.to_string();
        for name in ["X-HTTP-Method-Override", "x-http-method", "X-Method-Override"] {
            for value in ["DELETE", "PUT", "patch", "", "not a method"] {
                let r = alone(&http, Method::GET, &url, &[(name, value)], "").await;
                assert_eq!(r.error_code(), "fencing_token_required", "{name}: {value} fast={fast}");
                let r = alone(&http, Method::GET, &url, &[(name, value), ("x-fencing-token", &stale)], "").await;
                assert_eq!(r.error_code(), "stale_fencing_token", "{name}: {value} fast={fast}");
            }
        }
        assert_eq!(rec.count(), 0, "fast={fast}: {:?}", rec.requests());
        let t = new.token.to_string();
        let r =
            alone(&http, Method::GET, &url, &[("X-HTTP-Method-Override", "DELETE"), ("x-fencing-token", &t)], "").await;
        assert_eq!(r.status, StatusCode::OK, "fast={fast}");
        let r = alone(&http, Method::GET, &url, &[("X-HTTP-Method-Override", "HEAD")], "").await;
        assert_eq!(r.status, StatusCode::OK, "an override naming a read stays a read; fast={fast}");
        assert_eq!(rec.count(), 2, "fast={fast}");
    }
}

/// A header that backends reading `_` as `-` (CGI, WSGI, PHP, Rack) would
/// take for one of the gateway's own is refused with 400 on both
/// transports, for reads and writes, and never reaches the upstream: an
/// underscore spelling of a method override made a read act as a
/// `DELETE` unfenced, and one of the token header put a token the gateway
/// never admitted beside the one it did. Other underscore headers pass.
#[tokio::test(flavor = "multi_thread")]
async fn underscore_spellings_of_the_gateways_headers_are_refused_on_both_transports() {
    for fast in [true, false] {
        let (_d, gw, rec, http, _old, new) = superseded(fast).await;
        let url = gw.proxy_url("/orders/1");
        let t = new.token.to_string();
        let aliases = [
            ("X_HTTP_Method_Override", "DELETE"),
            ("X-HTTP_Method-Override", "delete"),
            ("x_http_method", "DELETE"),
            ("X_Method_Override", "PUT"),
            ("X_Fencing_Token", "999999"),
            ("x_fencing_sequence", "7"),
            ("X_Forwarded_For", "10.9.9.9"),
        ];
        for (name, value) in aliases {
            let r = alone(&http, Method::GET, &url, &[(name, value)], "").await;
            assert_eq!(r.status, StatusCode::BAD_REQUEST, "GET {name} fast={fast}");
            assert_eq!(r.error_code(), "bad_request", "GET {name} fast={fast}");
            let r = alone(&http, Method::PUT, &url, &[("x-fencing-token", &t), (name, value)], "x").await;
            assert_eq!(r.status, StatusCode::BAD_REQUEST, "PUT {name} fast={fast}");
        }
        assert_eq!(rec.count(), 0, "fast={fast}: {:?}", rec.requests());
        let r = alone(&http, Method::GET, &url, &[("X_Request_Id", "abc")], "").await;
        assert_eq!(r.status, StatusCode::OK, "an underscore header of nobody's passes; fast={fast}");
        let r = alone(&http, Method::PUT, &url, &[("x-fencing-token", &t), ("x_trace", "1")], "x").await;
        assert_eq!(r.status, StatusCode::OK, "fast={fast}");
        assert_eq!(rec.count(), 2, "fast={fast}");
    }
}

/// A route that lists more reads forwards them without a token; the old
/// key `mutating_methods` is refused with a hint naming `read_methods`.
#[tokio::test(flavor = "multi_thread")]
async fn read_methods_are_configurable_and_mutating_methods_is_refused() {
    let cfg = r#"
[[routes]]
match = "/{*path}"
upstream = "UPSTREAM"
read_methods = ["GET", "HEAD", "OPTIONS", "PROPFIND", "REPORT"]
"#;
    let (_d, gw, rec, http) = setup_with(Some(cfg.into())).await;
    let url = gw.proxy_url("/dav/a");
    for name in ["PROPFIND", "REPORT"] {
        let r = http.send(Method::from_bytes(name.as_bytes()).unwrap(), &url, &[], "").await;
        assert_eq!(r.status, StatusCode::OK, "{name}");
    }
    for name in ["PROPPATCH", "propfind"] {
        let r = http.send(Method::from_bytes(name.as_bytes()).unwrap(), &url, &[], "").await;
        assert_eq!(r.error_code(), "fencing_token_required", "{name}");
    }
    assert_eq!(rec.count(), 2);

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("old.toml");
    std::fs::write(
        &file,
        "[[routes]]\nmatch = \"/{*p}\"\nupstream = \"http://127.0.0.1:9\"\nmutating_methods = [\"PUT\"]\n",
    )
    .unwrap();
    let out =
        std::process::Command::new(env!("CARGO_BIN_EXE_fencegate")).arg("check-config").arg(&file).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("mutating_methods was removed") && text.contains("read_methods"), "{text}");
}

#[tokio::test(flavor = "multi_thread")]
async fn templates_map_paths_to_resource_keys() {
    let cfg = r#"
[[routes]]
name = "orders"
match = "/orders/{id}/{*rest}"
resource = "orders/{id}"
upstream = "UPSTREAM"
"#;
    let (_d, gw, rec, http) = setup_with(Some(cfg.into())).await;
    let g = acquire(&http, &gw.api_url(""), "orders/7", 10_000, 0).await.unwrap();
    let t = g.token.to_string();
    let r = http.send(Method::PUT, &gw.proxy_url("/orders/7/lines/3"), &[("x-fencing-token", &t)], "x").await;
    assert_eq!(r.status, StatusCode::OK);
    let r = http.send(Method::PUT, &gw.proxy_url("/orders/8/lines/3"), &[("x-fencing-token", &t)], "x").await;
    assert_eq!(r.error_code(), "unissued_fencing_token");
    let r = http.get(&gw.proxy_url("/elsewhere")).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(rec.count(), 1);
    let m = String::from_utf8(http.get(&gw.api_url("/metrics")).await.body.to_vec()).unwrap();
    assert!(m.contains("fencegate_mutations_total{outcome=\"forwarded\",route=\"orders\"} 1"), "{m}");
    assert!(m.contains("fencegate_mutations_total{outcome=\"unissued\",route=\"orders\"} 1"));
}

#[tokio::test(flavor = "multi_thread")]
async fn external_authority_advances_the_fence() {
    let cfg = r#"
[[routes]]
match = "/{*path}"
upstream = "UPSTREAM"
fence_authority = "external"
"#;
    let (_d, gw, rec, http) = setup_with(Some(cfg.into())).await;
    assert_eq!(put(&http, &gw, "/k", Some("100")).await.status, StatusCode::OK);
    assert_eq!(put(&http, &gw, "/k", Some("100")).await.status, StatusCode::OK);
    assert_eq!(put(&http, &gw, "/k", Some("250")).await.status, StatusCode::OK);
    let r = put(&http, &gw, "/k", Some("100")).await;
    assert_eq!(r.error_code(), "stale_fencing_token");
    assert_eq!(r.json()["fence"], 250);
    assert_eq!(rec.count(), 3);
    let s = http.get(&gw.api_url("/v1/locks/status?key=k")).await.json();
    assert_eq!(s["fence"], 250);
}

/// One request with token u64::MAX must not fence a key out for good: an
/// external token more than `max_token_step` above the fence is refused.
#[tokio::test(flavor = "multi_thread")]
async fn external_tokens_too_far_above_the_fence_are_refused() {
    let cfg = r#"
[[routes]]
match = "/{*path}"
upstream = "UPSTREAM"
fence_authority = "external"
max_token_step = 1000
"#;
    let (_d, gw, rec, http) = setup_with(Some(cfg.into())).await;
    let r = put(&http, &gw, "/k", Some("18446744073709551615")).await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    assert_eq!(r.error_code(), "unissued_fencing_token");
    assert_eq!(r.json()["max_token_step"], 1000);
    assert_eq!(put(&http, &gw, "/k", Some("1001")).await.status, StatusCode::FORBIDDEN, "fresh key: fence 0");
    assert_eq!(put(&http, &gw, "/k", Some("1000")).await.status, StatusCode::OK);
    assert_eq!(put(&http, &gw, "/k", Some("2000")).await.status, StatusCode::OK);
    assert_eq!(put(&http, &gw, "/k", Some("3001")).await.status, StatusCode::FORBIDDEN);
    let s = http.get(&gw.api_url("/v1/locks/status?key=k")).await.json();
    assert_eq!(s["fence"], 2000);
    assert_eq!(rec.count(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn shadow_mode_counts_but_forwards() {
    let cfg = r#"
[[routes]]
name = "legacy"
match = "/{*path}"
upstream = "UPSTREAM"
enforce = false
"#;
    let (_d, gw, rec, http) = setup_with(Some(cfg.into())).await;
    assert_eq!(put(&http, &gw, "/k", None).await.status, StatusCode::OK);
    assert_eq!(put(&http, &gw, "/k", Some("77")).await.status, StatusCode::OK);
    assert_eq!(rec.count(), 2);
    let m = String::from_utf8(http.get(&gw.api_url("/metrics")).await.body.to_vec()).unwrap();
    assert!(m.contains("fencegate_mutations_total{outcome=\"missing_token\",route=\"legacy\"} 1"), "{m}");
    assert!(m.contains("fencegate_mutations_total{outcome=\"unissued\",route=\"legacy\"} 1"));
}

#[tokio::test(flavor = "multi_thread")]
async fn upstream_down_is_502_and_slow_is_504() {
    let port = common::free_port();
    let cfg = format!(
        r#"
[[routes]]
match = "/down/{{*p}}"
upstream = "http://127.0.0.1:{port}"
[[routes]]
match = "/{{*path}}"
upstream = "UPSTREAM"
upstream_timeout_ms = 300
"#
    );
    let (_d, gw, rec, http) = setup_with(Some(cfg)).await;
    let r = http.get(&gw.proxy_url("/down/x")).await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY);
    assert_eq!(r.error_code(), "upstream_unavailable");
    rec.set_delay("/slow", 2000);
    let r = http.get(&gw.proxy_url("/slow")).await;
    assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(r.error_code(), "upstream_timeout");
}

#[tokio::test(flavor = "multi_thread")]
async fn declared_body_over_the_route_limit_is_413() {
    let cfg = r#"
[[routes]]
match = "/{*path}"
upstream = "UPSTREAM"
max_body_bytes = 10
"#;
    let (_d, gw, rec, http) = setup_with(Some(cfg.into())).await;
    let g = acquire(&http, &gw.api_url(""), "k", 10_000, 0).await.unwrap();
    let r = http
        .send(Method::PUT, &gw.proxy_url("/k"), &[("x-fencing-token", &g.token.to_string())], "0123456789ABC")
        .await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(r.error_code(), "payload_too_large");
    assert_eq!(rec.count(), 0);
}

/// External route: a request that waited for older in-flight mutations is
/// re-checked against the fence before it is forwarded. Without that, 101
/// (waiting for 100's slow exchange) was forwarded after 102's barrier had
/// given up on it, and landed after 102.
#[tokio::test(flavor = "multi_thread")]
async fn an_external_request_that_waited_is_refused_if_the_fence_moved_meanwhile() {
    let cfg = r#"
[[routes]]
match = "/{k}/{*rest}"
resource = "{k}"
upstream = "UPSTREAM"
fence_authority = "external"
upstream_timeout_ms = 3000
"#;
    let (_d, gw, rec, http) = setup_with(Some(cfg.into())).await;
    rec.set_delay("/x/slow", 2000);
    rec.set_delay("/x/older", 2000);
    let send = |path: &'static str, token: &'static str| {
        let (http, url) = (http.clone(), gw.proxy_url(path));
        tokio::spawn(async move { http.send(Method::PUT, &url, &[("x-fencing-token", token)], "w").await })
    };
    let first = send("/x/slow", "100");
    tokio::time::sleep(std::time::Duration::from_millis(150)).await;
    let older = send("/x/older", "101");
    tokio::time::sleep(std::time::Duration::from_millis(150)).await;
    let newer = send("/x/newer", "102");
    assert_eq!(first.await.unwrap().status, StatusCode::OK);
    assert_eq!(newer.await.unwrap().status, StatusCode::OK);
    let r = older.await.unwrap();
    assert_eq!(r.status, StatusCode::CONFLICT, "101 must not be forwarded once 102 moved the fence");
    assert_eq!(r.error_code(), "stale_fencing_token");
    let order: Vec<String> = rec.requests().iter().map(|s| s.path.clone()).collect();
    assert_eq!(order, ["/x/slow", "/x/newer"]);
}

/// The quarantine after `kill -9` covers every HTTP upstream, however its
/// scheme is spelled (`HTTP://` too).
#[tokio::test(flavor = "multi_thread")]
async fn an_upper_case_http_upstream_is_quarantined_after_kill9() {
    let rec = Recorder::start().await;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let up = rec.url().replace("http://", "HTTP://");
    let cfg = format!("[[routes]]\nmatch = \"/{{*path}}\"\nupstream = \"{up}\"\nupstream_timeout_ms = 1500\n");
    let opts = Opts { config: Some(cfg), ..Opts::default() };
    let gw = Gateway::start(&data, opts.clone());
    gw.kill9();
    let gw = Gateway::start(&data, opts);
    assert!(gw.log_text().contains("did not stop cleanly"), "{}", gw.log_text());
}
