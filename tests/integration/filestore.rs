//! The built-in object store, as served by `fencegate serve` on its
//! embedded defaults, plus HTTP/2 (h2c) on both listeners and graceful
//! drain.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use bytes::Bytes;
use common::{acquire, Gateway, Http, Opts};
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};

#[tokio::test(flavor = "multi_thread")]
async fn objects_round_trip_with_etags_conditions_and_token() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let gw = Gateway::start(&data, Opts::default());
    let http = Http::default();
    let g = acquire(&http, &gw.api_url(""), "docs/a.txt", 10_000, 0).await.unwrap();
    let t = g.token.to_string();
    let url = gw.proxy_url("/docs/a.txt");
    let r = http.send(Method::PUT, &url, &[("x-fencing-token", &t)], "one").await;
    assert_eq!(r.status, StatusCode::CREATED);
    let etag1 = r.headers["etag"].to_str().unwrap().to_string();
    assert_eq!(std::fs::read(data.join("objects/docs/a.txt")).unwrap(), b"one");

    let r = http.get(&url).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(&r.body[..], b"one");
    assert_eq!(r.headers["etag"].to_str().unwrap(), etag1);
    assert_eq!(r.headers["x-fencing-token"], t.as_str());

    let r = http.send(Method::GET, &url, &[("if-none-match", &etag1)], "").await;
    assert_eq!(r.status, StatusCode::NOT_MODIFIED);
    let r = http.send(Method::PUT, &url, &[("x-fencing-token", &t), ("if-none-match", "*")], "x").await;
    assert_eq!(r.status, StatusCode::PRECONDITION_FAILED);
    let r = http.send(Method::PUT, &url, &[("x-fencing-token", &t), ("if-match", "\"nope\"")], "x").await;
    assert_eq!(r.status, StatusCode::PRECONDITION_FAILED);
    assert_eq!(r.error_code(), "precondition_failed");
    let r = http.send(Method::PUT, &url, &[("x-fencing-token", &t), ("if-match", &etag1)], "two").await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(http.get(&url).await.body, Bytes::from_static(b"two"));

    // A stale writer cannot touch the object.
    let r2 = {
        common::release(&http, &gw.api_url(""), &g).await;
        acquire(&http, &gw.api_url(""), "docs/a.txt", 10_000, 0).await.unwrap()
    };
    let r = http.send(Method::PUT, &url, &[("x-fencing-token", &t)], "zombie").await;
    assert_eq!(r.error_code(), "stale_fencing_token");
    let r = http.send(Method::DELETE, &url, &[("x-fencing-token", &t)], "").await;
    assert_eq!(r.error_code(), "stale_fencing_token");
    assert_eq!(std::fs::read(data.join("objects/docs/a.txt")).unwrap(), b"two");

    let r = http.send(Method::DELETE, &url, &[("x-fencing-token", &r2.token.to_string())], "").await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    assert_eq!(http.get(&url).await.status, StatusCode::NOT_FOUND);
    assert!(!data.join("objects/docs/a.txt").exists());
    // Nothing left behind in the temp folder.
    assert_eq!(std::fs::read_dir(data.join("objects/.fencegate/tmp")).unwrap().count(), 0);
    let r = http.get(&gw.proxy_url("/.fencegate/tmp/x")).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
}

#[tokio::test(flavor = "multi_thread")]
async fn h2c_prior_knowledge_works_on_both_listeners() {
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(&dir.path().join("data"), Opts::default());
    for (addr, path, want) in [(gw.api, "/healthz", StatusCode::OK), (gw.proxy, "/missing", StatusCode::NOT_FOUND)] {
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (mut send, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream)).await.unwrap();
        tokio::spawn(conn);
        let req = Request::builder().uri(format!("http://{addr}{path}")).body(Empty::<Bytes>::new()).unwrap();
        let resp = send.send_request(req).await.unwrap();
        assert_eq!(resp.version(), http::Version::HTTP_2);
        assert_eq!(resp.status(), want, "{path}");
        let _ = resp.into_body().collect().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_drains_inflight_requests() {
    let rec = common::Recorder::start().await;
    rec.set_delay("/slow", 800);
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(&dir.path().join("data"), Opts { upstream: Some(rec.url()), ..Opts::default() });
    let http = Http::default();
    let inflight = tokio::spawn({
        let (http, url) = (http.clone(), gw.proxy_url("/slow"));
        async move { http.get(&url).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let status = tokio::task::spawn_blocking(move || gw.terminate()).await.unwrap();
    assert!(status.success());
    let r = inflight.await.unwrap();
    assert_eq!(r.status, StatusCode::OK, "the in-flight request must complete during the drain");
}
