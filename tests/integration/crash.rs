//! Durability against the real binary: `kill -9` at random instants during
//! a storm of acquires, restart on the same data directory, and check that
//! no token any client received is ever issued again, for its key or any
//! other (tokens are one sequence for every key).
#![allow(clippy::unwrap_used)]

use crate::common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{Gateway, Http, Opts};
use http::StatusCode;
use serde_json::json;

const KEYS: [&str; 4] = ["a", "b", "orders/1", "orders/2"];
const KILLS: usize = 24;

/// A tiny deterministic PRNG (xorshift) so the test needs no extra crate;
/// seeded from the clock, printed for reproduction.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill9_never_reuses_a_token() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1;
    println!("seed {seed}");
    let mut rng = Rng(seed);
    // Highest token each key's clients ever received, across all runs.
    let received: Arc<Mutex<HashMap<String, u64>>> = Arc::default();
    // Every token any client received, of any key: none twice.
    let every: Arc<Mutex<std::collections::HashSet<u64>>> = Arc::default();
    let mut total_grants = 0usize;
    let ports = Opts { proxy_port: Some(common::free_port()), api_port: Some(common::free_port()), ..Opts::default() };
    for round in 0..KILLS {
        let gw = Gateway::start(&data, ports.clone());
        let api = gw.api_url("");
        let http = Http::default();
        // Every key's fence covers every token handed out before the kill,
        // and the next token is greater: never a reuse.
        for key in KEYS {
            let s = http.get(&format!("{api}/v1/locks/status?key={key}")).await.json();
            let seen = received.lock().unwrap().get(key).copied().unwrap_or(0);
            let fence = s["fence"].as_u64().unwrap();
            assert!(fence >= seen, "round {round}: {key} fence {fence} < received token {seen}");
        }
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut workers = Vec::new();
        for w in 0..8 {
            let (http, api, received, stop) = (http.clone(), api.clone(), received.clone(), stop.clone());
            let every = every.clone();
            workers.push(tokio::spawn(async move {
                let mut grants = 0usize;
                let mut i = w;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    i += 1;
                    let key = KEYS[i % KEYS.len()];
                    let body = json!({"key": key, "ttl_ms": 500, "wait_ms": 200});
                    // The gateway may die mid-request: that is the point.
                    let url = format!("{api}/v1/locks/acquire");
                    let req = http.try_post_json(&url, body);
                    let Ok(Ok(r)) = tokio::time::timeout(Duration::from_secs(5), req).await else {
                        break;
                    };
                    if r.status != StatusCode::OK {
                        continue;
                    }
                    let v = r.json();
                    let token = v["fencing_token"].as_u64().unwrap();
                    {
                        let mut m = received.lock().unwrap();
                        let prev = m.entry(key.to_string()).or_insert(0);
                        assert!(token > *prev, "{key}: token {token} issued after {prev}");
                        *prev = token;
                    }
                    assert!(every.lock().unwrap().insert(token), "token {token} was issued twice (now for {key})");
                    grants += 1;
                    let lease_id = v["lease_id"].as_str().unwrap().to_string();
                    let url = format!("{api}/v1/locks/release");
                    let rel = http.try_post_json(&url, json!({"key": key, "lease_id": lease_id}));
                    if !matches!(tokio::time::timeout(Duration::from_secs(5), rel).await, Ok(Ok(_))) {
                        break;
                    }
                }
                grants
            }));
        }
        let delay = 50 + rng.next() % 400;
        tokio::time::sleep(Duration::from_millis(delay)).await;
        gw.kill9();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for w in workers {
            total_grants += w.await.unwrap();
        }
    }
    // One last start: the next token of every key is above all received.
    let gw = Gateway::start(&data, ports);
    let http = Http::default();
    let api = gw.api_url("");
    let highest = every.lock().unwrap().iter().copied().max().unwrap_or(0);
    for key in KEYS {
        let g = common::acquire(&http, &api, key, 1000, 10_000).await.unwrap();
        assert!(g.token > highest, "{key}: new token {} not above every received token ({highest})", g.token);
    }
    println!("{KILLS} kills, {total_grants} grants observed by clients");
    assert!(total_grants > KILLS, "the storm must actually have produced grants");
}

/// The store writes its log over recycled files once the first ones were
/// switched out (16 MiB). A `kill -9` then leaves a log whose tail holds
/// older records of the same keys; the restart must read only what this
/// life wrote. Long keys and holders fill the log in a few seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill9_after_log_files_were_recycled_keeps_every_received_token() {
    const WORKERS: usize = 32;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let ports = Opts { proxy_port: Some(common::free_port()), api_port: Some(common::free_port()), ..Opts::default() };
    let keys: Vec<String> = (0..WORKERS).map(|w| format!("recycled/{w:02}/{}", "k".repeat(490))).collect();
    let received: Arc<Mutex<HashMap<String, u64>>> = Arc::default();
    let gw = Gateway::start(&data, ports.clone());
    let api = gw.api_url("");
    let http = Http::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut workers = Vec::new();
    for key in keys.clone() {
        let (http, api, received, stop) = (http.clone(), api.clone(), received.clone(), stop.clone());
        workers.push(tokio::spawn(async move {
            let holder = "h".repeat(256);
            let (acquire_url, release_url) = (format!("{api}/v1/locks/acquire"), format!("{api}/v1/locks/release"));
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let body = json!({"key": key, "ttl_ms": 5000, "wait_ms": 1000, "holder": holder});
                let req = http.try_post_json(&acquire_url, body);
                let Ok(Ok(r)) = tokio::time::timeout(Duration::from_secs(5), req).await else { break };
                assert_eq!(r.status, StatusCode::OK, "{}", r.error_code());
                let v = r.json();
                received.lock().unwrap().insert(key.clone(), v["fencing_token"].as_u64().unwrap());
                let release = json!({"key": key, "lease_id": v["lease_id"]});
                let rel = http.try_post_json(&release_url, release);
                if !matches!(tokio::time::timeout(Duration::from_secs(5), rel).await, Ok(Ok(_))) {
                    break;
                }
            }
        }));
    }
    // RocksDB's info log names each reuse of a log file.
    let info = data.join("db").join("LOG");
    let started = std::time::Instant::now();
    while !std::fs::read_to_string(&info).unwrap_or_default().contains("from recycle list") {
        assert!(started.elapsed() < Duration::from_secs(120), "no log file was recycled within 120 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let reused_after = started.elapsed();
    tokio::time::sleep(Duration::from_millis(300)).await;
    gw.kill9();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for w in workers {
        w.await.unwrap();
    }
    let gw = Gateway::start(&data, ports);
    let api = gw.api_url("");
    let received = received.lock().unwrap().clone();
    assert_eq!(received.len(), WORKERS, "every worker was granted its key");
    let mut total = 0;
    for key in &keys {
        let s = http.get(&format!("{api}/v1/locks/status?key={key}")).await.json();
        let fence = s["fence"].as_u64().unwrap();
        assert!(fence >= received[key], "{key}: fence {fence} below the received token {}", received[key]);
        total += received[key];
    }
    println!("a log file was reused after {reused_after:?}; {total} grants received before the kill");
}

/// The highest sequence is fsynced before its write is forwarded: after
/// `kill -9` between sequenced writes, a lower or equal sequence under the
/// same token is still refused.
#[tokio::test(flavor = "multi_thread")]
async fn kill9_between_sequenced_writes_loses_no_ordering() {
    let rec = common::Recorder::start().await;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let opts = Opts { upstream: Some(rec.url()), ..Opts::default() };
    let http = Http::default();
    let gw = Gateway::start(&data, opts.clone());
    let g = common::acquire(&http, &gw.api_url(""), "seq/1", 60_000, 0).await.unwrap();
    let t = g.token.to_string();
    for n in 1..=5 {
        let seq = n.to_string();
        let r = http
            .send(
                http::Method::PUT,
                &gw.proxy_url("/seq/1"),
                &[("x-fencing-token", &t), ("x-fencing-sequence", &seq)],
                "w",
            )
            .await;
        assert_eq!(r.status, StatusCode::OK);
    }
    gw.kill9();
    let gw = Gateway::start(&data, opts);
    for seq in ["5", "4", "1"] {
        let r = http
            .send(
                http::Method::PUT,
                &gw.proxy_url("/seq/1"),
                &[("x-fencing-token", &t), ("x-fencing-sequence", seq)],
                "late",
            )
            .await;
        assert_eq!(r.status, StatusCode::CONFLICT, "sequence {seq} after the restart");
        assert_eq!(r.error_code(), "stale_sequence");
    }
    let r = http
        .send(
            http::Method::PUT,
            &gw.proxy_url("/seq/1"),
            &[("x-fencing-token", &t), ("x-fencing-sequence", "6")],
            "next",
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(rec.count(), 6);
}

/// After `kill -9`, a write the dead process forwarded may still be applied;
/// a higher sequence of the same holder must not overtake it: sequenced
/// writes wait out the quarantine as grants do.
#[tokio::test(flavor = "multi_thread")]
async fn a_higher_sequence_after_kill9_waits_for_the_dead_process_writes() {
    let rec = common::Recorder::start().await;
    rec.set_delay("/q/slow", 2500);
    rec.apply_even_if_abandoned("/q/slow");
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let cfg = format!(
        "[[routes]]\nmatch = \"/{{k}}/{{*rest}}\"\nresource = \"{{k}}\"\nupstream = \"{}\"\nupstream_timeout_ms = 3500\n",
        rec.url()
    );
    let opts = Opts { config: Some(cfg), ..Opts::default() };
    let http = Http::default();
    let gw = Gateway::start(&data, opts.clone());
    let g = common::acquire(&http, &gw.api_url(""), "q", 60_000, 0).await.unwrap();
    let t = g.token.to_string();
    let (slow, t2) = (gw.proxy_url("/q/slow"), t.clone());
    let http2 = http.clone();
    let first = tokio::spawn(async move {
        let headers = [("x-fencing-token", t2.as_str()), ("x-fencing-sequence", "42")];
        http2.try_send(http::Method::PUT, &slow, &headers, "42").await
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    gw.kill9();
    let _ = first.await;
    let gw = Gateway::start(&data, opts);
    let headers = [("x-fencing-token", t.as_str()), ("x-fencing-sequence", "43")];
    let r = http.send(http::Method::PUT, &gw.proxy_url("/q/fast"), &headers, "43").await;
    assert_eq!(r.status, StatusCode::OK);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let order: Vec<String> = rec.requests().iter().map(|s| s.path.clone()).collect();
    assert_eq!(order, ["/q/slow", "/q/fast"], "43 overtook 42, which the dead process had forwarded");
}
