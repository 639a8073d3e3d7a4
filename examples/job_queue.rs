//! Workers take per-job locks and process jobs idempotently; a worker that
//! pauses mid-job loses its lock, another worker redoes the job, and the
//! paused worker's late result is refused. A lock alone is "efficiency"
//! (no two workers usually do the same job); the fence makes it
//! "correctness" (a late result can never overwrite a newer one).
//!
//! Run: `cargo run --example job_queue`
#![allow(clippy::print_stdout)]

use std::time::Duration;

use bytes::Bytes;
use fencegate::client::{with_token, Client, ClientError};
use fencegate::config::Config;
use fencegate::Gateway;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::rt::TokioExecutor;

type Http = HttpClient<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

async fn put(
    http: &Http,
    url: &str,
    token: u64,
    body: String,
) -> Result<u16, Box<dyn std::error::Error + Send + Sync>> {
    let mut req = Request::put(url).body(Full::new(Bytes::from(body)))?;
    with_token(&mut req, token);
    let resp = http.request(req).await?;
    let status = resp.status().as_u16();
    let _ = resp.into_body().collect().await?;
    Ok(status)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let dir = std::env::temp_dir().join(format!("fencegate-jobs-{}", std::process::id()));
    let cfg = Config {
        data_dir: dir.clone(),
        listen: "127.0.0.1:0".parse()?,
        api_listen: "127.0.0.1:0".parse()?,
        ..Config::default()
    };
    let gw = Gateway::start(cfg).await?;
    let api = format!("http://{}", gw.api_addr);
    let proxy = format!("http://{}", gw.proxy_addr);
    let http: Http = HttpClient::builder(TokioExecutor::new()).build_http();
    let client = Client::new(&api)?;
    let ttl = Duration::from_millis(500);

    let mut workers = Vec::new();
    for w in 0..3u32 {
        let (client, http, proxy) = (client.clone(), http.clone(), proxy.clone());
        workers.push(tokio::spawn(async move {
            let mut log = Vec::new();
            for job in 0..6u32 {
                let key = format!("jobs/{job}/result");
                let lease = match client.acquire_as(&key, ttl, Duration::from_secs(3), &format!("worker-{w}")).await {
                    Ok(l) => l,
                    Err(ClientError::Locked { .. }) => continue,
                    Err(e) => return Err(e.to_string()),
                };
                let token = lease.token();
                // Worker 1 freezes on job 2 for longer than its TTL.
                if w == 1 && job == 2 {
                    lease.abandon(); // a frozen process renews nothing
                    tokio::time::sleep(Duration::from_millis(1200)).await;
                    let status =
                        put(&http, &format!("{proxy}/{key}"), token, format!("job {job} by worker {w} (late)"))
                            .await
                            .map_err(|e| e.to_string())?;
                    log.push(format!("worker {w} job {job} token {token}: late result -> HTTP {status}"));
                    continue;
                }
                let status = put(&http, &format!("{proxy}/{key}"), token, format!("job {job} by worker {w}"))
                    .await
                    .map_err(|e| e.to_string())?;
                log.push(format!("worker {w} job {job} token {token}: result -> HTTP {status}"));
                // Done: the lock is released (Drop would do it too).
                let _ = lease.release().await;
            }
            Ok::<_, String>(log)
        }));
    }
    let mut late_refused = false;
    for w in workers {
        for line in w.await?? {
            println!("{line}");
            if line.contains("(late)") || line.contains("late result -> HTTP 409") {
                late_refused |= line.ends_with("HTTP 409");
            }
        }
    }
    if !late_refused {
        return Err("the paused worker's late result was not refused".into());
    }
    println!("the paused worker's late result was refused.");
    gw.shutdown();
    gw.wait().await;
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}
