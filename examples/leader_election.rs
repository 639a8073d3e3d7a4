//! Leader election with fencing, against a gateway this example starts:
//! three candidates campaign for `leader/reports`; the leader writes the
//! report through the gateway with its term as the fencing token; then it
//! "dies" (stops renewing, as a crashed or frozen process would); another
//! candidate is elected within one TTL; the deposed leader's late write is
//! refused.
//!
//! Run: `cargo run --example leader_election`
#![allow(clippy::print_stdout)]

use std::time::{Duration, Instant};

use bytes::Bytes;
use fencegate::client::{with_token, Client};
use fencegate::config::Config;
use fencegate::Gateway;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::rt::TokioExecutor;

type Http = HttpClient<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

async fn write(http: &Http, url: &str, term: u64, body: &str) -> Result<(u16, String), Box<dyn std::error::Error>> {
    let mut req = Request::put(url).body(Full::new(Bytes::from(body.to_string())))?;
    with_token(&mut req, term);
    let resp = http.request(req).await?;
    let status = resp.status().as_u16();
    let text = String::from_utf8_lossy(&resp.into_body().collect().await?.to_bytes()).into_owned();
    Ok((status, text))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("fencegate-election-{}", std::process::id()));
    let cfg = Config {
        data_dir: dir.clone(),
        listen: "127.0.0.1:0".parse()?,
        api_listen: "127.0.0.1:0".parse()?,
        ..Config::default()
    };
    let gw = Gateway::start(cfg).await?;
    let api = format!("http://{}", gw.api_addr);
    let report = format!("http://{}/leader/reports", gw.proxy_addr);
    let http: Http = HttpClient::builder(TokioExecutor::new()).build_http();
    let ttl = Duration::from_millis(1000);

    let client = Client::new(&api)?;
    let first = client.campaign("leader/reports", "candidate-1", ttl).await?;
    println!("candidate-1 elected, term {}", first.term());
    // Two standbys campaign in the background.
    let mut standbys = Vec::new();
    for name in ["candidate-2", "candidate-3"] {
        let c = client.clone();
        standbys.push(tokio::spawn(async move {
            let l = c.campaign("leader/reports", name, ttl).await;
            (name, l, Instant::now())
        }));
    }
    let (status, _) = write(&http, &report, first.term(), "report by candidate-1").await?;
    println!("candidate-1 writes the report with term {}: HTTP {status}", first.term());

    // The leader dies: its renewals stop, as a frozen process's would.
    let old_term = first.term();
    let died = Instant::now();
    first.abandon();
    println!("candidate-1 stops renewing (frozen)");
    let (name, leadership, elected_at) = loop {
        let mut finished = None;
        for (i, s) in standbys.iter().enumerate() {
            if s.is_finished() {
                finished = Some(i);
            }
        }
        if let Some(i) = finished {
            let (name, l, at) = standbys.swap_remove(i).await?;
            break (name, l?, at);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let failover = elected_at.duration_since(died);
    println!("{name} elected, term {}, {} ms after the leader froze", leadership.term(), failover.as_millis());
    if failover > ttl + ttl / 3 + Duration::from_millis(300) {
        return Err(format!("failover took {failover:?}").into());
    }
    let (status, _) = write(&http, &report, leadership.term(), &format!("report by {name}")).await?;
    println!("{name} writes the report with term {}: HTTP {status}", leadership.term());
    let (status, text) = write(&http, &report, old_term, "late report by candidate-1").await?;
    println!("candidate-1 wakes up and writes with term {old_term}: HTTP {status} {text}");
    if status != 409 {
        return Err("the deposed leader's write was not refused".into());
    }
    leadership.resign().await?;
    for s in standbys {
        s.abort();
    }
    gw.shutdown();
    gw.wait().await;
    let _ = std::fs::remove_dir_all(dir);
    println!("the deposed leader's write was stopped at the resource.");
    Ok(())
}
