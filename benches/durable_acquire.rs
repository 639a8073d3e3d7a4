//! Durable acquires per second on RocksDB with fsync: group commit versus
//! one fsync per write, for 1, 8 and 64 concurrent clients. Each client
//! acquires and releases its own key in a loop (no contention), so the
//! difference is the store alone.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use fencegate::authority::{AcquireRequest, Authority, ReleaseRequest};
use fencegate::config::LocksConfig;
use fencegate::fence::FenceTable;
use fencegate::metrics::Metrics;
use fencegate::store::{Store, SyncObserver, WriterOptions};

fn authority(dir: &std::path::Path, group_commit: bool) -> Arc<Authority> {
    let noop: SyncObserver = Arc::new(|_, _| {});
    let store = Store::open(dir, WriterOptions { group_commit, max_batch: 1024, nice: 10 }, noop).unwrap();
    let metrics = Arc::new(Metrics::new().unwrap());
    Authority::restore(FenceTable::new(), store, metrics, LocksConfig::default()).unwrap()
}

async fn run(auth: &Arc<Authority>, clients: usize, per_client: u64) -> Duration {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..clients {
        let auth = auth.clone();
        tasks.push(tokio::spawn(async move {
            let key = format!("bench/{c}");
            for _ in 0..per_client {
                let g = auth
                    .acquire(AcquireRequest { key: key.clone(), ttl_ms: 10_000, wait_ms: 0, holder: None })
                    .await
                    .unwrap();
                auth.release(ReleaseRequest { key: key.clone(), lease_id: g.lease_id }).unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    started.elapsed()
}

fn durable(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let mut group = c.benchmark_group("durable_acquire");
    group.sample_size(10).measurement_time(Duration::from_secs(4)).warm_up_time(Duration::from_millis(500));
    for group_commit in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let auth = authority(dir.path(), group_commit);
        let mode = if group_commit { "group_commit" } else { "fsync_each" };
        for clients in [1usize, 8, 64] {
            group.throughput(Throughput::Elements(clients as u64));
            group.bench_with_input(BenchmarkId::new(mode, clients), &clients, |b, &clients| {
                // One iteration = one acquire (+ release) by each client.
                b.iter_custom(|iters| rt.block_on(run(&auth, clients, iters)));
            });
        }
    }
    group.finish();
}

criterion_group!(benches, durable);
criterion_main!(benches);
