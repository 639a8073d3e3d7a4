//! Fenced writes from an ordinary HTTP client: reqwest, with the lease taken
//! through `fencegate::client` and its token attached with
//! [`fencegate::client::Lease::header`]. Runs against a gateway it starts
//! itself (built-in object store, temporary data dir).
//!
//! Writer A holds `reports/daily`, stops renewing (a long pause), and its
//! lease runs out; writer B is granted the key and writes; A's late write,
//! sent by reqwest exactly like its first one, is refused with HTTP 409 and
//! the JSON error body, and the object keeps B's content.
//!
//! Run: `cargo run --example reqwest_writer`
#![allow(clippy::print_stdout)]

use std::time::Duration;

use fencegate::client::Client;
use fencegate::config::Config;
use fencegate::Gateway;

/// One fenced PUT with reqwest: the lease supplies the header.
async fn put(
    http: &reqwest::Client,
    url: &str,
    lease_header: (http::HeaderName, http::HeaderValue),
    body: &'static str,
) -> Result<(u16, String), reqwest::Error> {
    let (name, value) = lease_header;
    let resp = http.put(url).header(name, value).body(body).send().await?;
    let status = resp.status().as_u16();
    Ok((status, resp.text().await?))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("fencegate-reqwest-{}", std::process::id()));
    let cfg = Config {
        data_dir: dir.clone(),
        listen: "127.0.0.1:0".parse()?,
        api_listen: "127.0.0.1:0".parse()?,
        ..Config::default()
    };
    let gw = Gateway::start(cfg).await?;
    let locks = Client::new(&format!("http://{}", gw.api_addr))?;
    let object = format!("http://{}/reports/daily", gw.proxy_addr);
    let http = reqwest::Client::builder().timeout(Duration::from_secs(10)).build()?;
    println!("gateway: api http://{}, proxy http://{}", gw.api_addr, gw.proxy_addr);

    let ttl = Duration::from_millis(600);
    let a = locks.acquire_as("reports/daily", ttl, Duration::ZERO, "writer-a").await?;
    let a_header = a.header();
    println!("1. writer A holds reports/daily with fencing token {}", a.token());
    let (status, _) = put(&http, &object, a.header(), "draft by A").await?;
    println!("2. writer A writes with reqwest: HTTP {status}");
    if status != 201 && status != 200 {
        return Err(format!("A's first write failed: HTTP {status}").into());
    }

    // A stops renewing (GC pause, frozen VM); B waits in the queue and is
    // granted the key once A's lease runs out.
    a.abandon();
    println!("3. writer A pauses; its lease runs out after {} ms", ttl.as_millis());
    let b = locks.acquire_as("reports/daily", Duration::from_secs(10), Duration::from_secs(5), "writer-b").await?;
    println!("4. writer B is granted reports/daily with fencing token {}", b.token());
    let (status, _) = put(&http, &object, b.header(), "final by B").await?;
    println!("5. writer B writes with reqwest: HTTP {status}");

    let (status, text) = put(&http, &object, a_header, "late overwrite by A").await?;
    println!("6. writer A wakes up and writes again: HTTP {status} {text}");
    if status != 409 || !text.contains("stale_fencing_token") {
        return Err("the late write was not refused".into());
    }

    let stored = http.get(&object).send().await?.text().await?;
    println!("7. the object holds: {stored:?}");
    if stored != "final by B" {
        return Err("the object does not hold B's write".into());
    }
    b.release().await?;
    println!("the late write from reqwest was stopped at the resource.");
    gw.shutdown();
    gw.wait().await;
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}
