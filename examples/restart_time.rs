//! Measures how long a gateway takes to start on a data directory holding
//! N fences (default 1,000,000): open RocksDB, rebuild the in-memory fence
//! table, restore grants, bind both listeners. Also reports the resident
//! memory the table costs.
//!
//! Run: `cargo run --release --example restart_time -- [N]`
#![allow(clippy::print_stdout)]

use std::sync::Arc;
use std::time::Instant;

use fencegate::config::Config;
use fencegate::store::{Op, Store, SyncObserver, WriterOptions};
use fencegate::Gateway;

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmRSS:")).map(str::to_string))
        .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n: u64 = std::env::args().nth(1).map(|a| a.parse()).transpose()?.unwrap_or(1_000_000);
    let dir = std::env::temp_dir().join(format!("fencegate-restart-{}", std::process::id()));
    {
        let noop: SyncObserver = Arc::new(|_, _| {});
        let store = Store::open(
            &dir,
            WriterOptions { group_commit: true, max_batch: 64, nice: 0, background_write_bytes_per_sec: 0 },
            noop,
        )?;
        let started = Instant::now();
        let mut batch = Vec::with_capacity(10_000);
        for i in 0..n {
            // Random-looking keys, as real resources are.
            let key = format!("bucket/{:016x}/object", i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            batch.push(Op::Fence { key: fencegate::fence::Key::from(key.as_str()), token: i % 1000 + 1 });
            if batch.len() == 10_000 {
                store.commit(std::mem::take(&mut batch)).await?;
            }
        }
        store.commit(batch).await?;
        println!("wrote {n} fences in {:.2} s", started.elapsed().as_secs_f64());
    }
    let before = rss_kib();
    let cfg = Config {
        data_dir: dir.clone(),
        listen: "127.0.0.1:0".parse()?,
        api_listen: "127.0.0.1:0".parse()?,
        ..Config::default()
    };
    let started = Instant::now();
    let gw = Gateway::start(cfg).await?;
    let elapsed = started.elapsed();
    let after = rss_kib();
    println!(
        "start with {n} fences: {:.3} s; resident memory +{} MiB ({} bytes per fence)",
        elapsed.as_secs_f64(),
        (after.saturating_sub(before)) / 1024,
        (after.saturating_sub(before)) * 1024 / n.max(1)
    );
    gw.shutdown();
    gw.wait().await;
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}
