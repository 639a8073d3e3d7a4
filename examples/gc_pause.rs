//! The story fencegate exists for, end to end against a live gateway that
//! this example starts itself (built-in object store, temporary data dir):
//!
//! writer 33 takes the lock, pauses (a GC pause, a VM freeze), its lease
//! expires; writer 34 is granted the lock and writes; writer 33 wakes up
//! and writes with its old token — and is refused at the resource.
//!
//! Run: `cargo run --example gc_pause`
#![allow(clippy::print_stdout)]

use std::time::Duration;

use bytes::Bytes;
use fencegate::config::Config;
use fencegate::Gateway;
use http::{Method, Request};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};

type Http = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

async fn call(
    http: &Http,
    method: Method,
    url: &str,
    token: Option<u64>,
    body: &str,
) -> Result<(u16, String), Box<dyn std::error::Error>> {
    let mut req = Request::builder().method(method).uri(url).header("content-type", "application/json");
    if let Some(t) = token {
        req = req.header("x-fencing-token", t.to_string());
    }
    let resp = http.request(req.body(Full::new(Bytes::from(body.to_string())))?).await?;
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await?.to_bytes();
    Ok((status, String::from_utf8_lossy(&bytes).into_owned()))
}

async fn acquire(
    http: &Http,
    api: &str,
    holder: &str,
    ttl_ms: u64,
    wait_ms: u64,
) -> Result<Value, Box<dyn std::error::Error>> {
    let body = json!({"key": "invoices/42", "ttl_ms": ttl_ms, "wait_ms": wait_ms, "holder": holder}).to_string();
    let (status, text) = call(http, Method::POST, &format!("{api}/v1/locks/acquire"), None, &body).await?;
    if status != 200 {
        return Err(format!("acquire failed: {status} {text}").into());
    }
    Ok(serde_json::from_str(&text)?)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("fencegate-gc-pause-{}", std::process::id()));
    let cfg = Config {
        data_dir: dir.clone(),
        listen: "127.0.0.1:0".parse()?,
        api_listen: "127.0.0.1:0".parse()?,
        ..Config::default()
    };
    let gw = Gateway::start(cfg).await?;
    let api = format!("http://{}", gw.api_addr);
    let object = format!("http://{}/invoices/42", gw.proxy_addr);
    let http: Http = Client::builder(TokioExecutor::new()).build_http();
    println!("gateway: api {api}, proxy http://{}", gw.proxy_addr);

    // Some history, so the tokens are the ones of the story.
    for _ in 0..32 {
        let g = acquire(&http, &api, "history", 1000, 0).await?;
        let body = json!({"key": "invoices/42", "lease_id": g["lease_id"]}).to_string();
        call(&http, Method::POST, &format!("{api}/v1/locks/release"), None, &body).await?;
    }

    let a = acquire(&http, &api, "writer-a", 1000, 0).await?;
    let token_a = a["fencing_token"].as_u64().ok_or("no token")?;
    println!("1. writer A holds invoices/42 with fencing token {token_a} (ttl 1000 ms)");
    println!("2. writer A pauses (GC, VM freeze) for 1500 ms; its lease expires");
    tokio::time::sleep(Duration::from_millis(1500)).await;

    let b = acquire(&http, &api, "writer-b", 10_000, 5000).await?;
    let token_b = b["fencing_token"].as_u64().ok_or("no token")?;
    println!("3. writer B is granted the lock with fencing token {token_b}");
    let (status, _) = call(&http, Method::PUT, &object, Some(token_b), "total: 100 (written by B)").await?;
    println!("4. writer B writes with token {token_b}: HTTP {status}");

    let (status, text) = call(&http, Method::PUT, &object, Some(token_a), "total: 0 (written by A)").await?;
    println!("5. writer A wakes up and writes with token {token_a}: HTTP {status} {text}");
    if status != 409 {
        return Err("the stale write was not refused".into());
    }

    let (status, text) = call(&http, Method::GET, &object, None, "").await?;
    println!("6. the object holds B's write: HTTP {status} {text:?}");
    if text != "total: 100 (written by B)" {
        return Err("the object does not hold B's write".into());
    }
    println!("the stale write was stopped at the resource.");
    gw.shutdown();
    gw.wait().await;
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}
