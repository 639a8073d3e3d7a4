//! Durable acquires per second on RocksDB with fsync: group commit versus
//! one fsync per write, for 1, 8 and 64 concurrent clients. Each client
//! acquires and releases its own key in a loop (no contention), so the
//! difference is the store alone. Then the price of same-holder ordering:
//! a fenced write's admission without `X-Fencing-Sequence` (memory only)
//! against one with it (its sequence fsynced before it may be forwarded),
//! for 1 and 64 concurrent writers on their own keys.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use fencegate::authority::{AcquireRequest, Authority, ReleaseRequest};
use fencegate::config::LocksConfig;
use fencegate::fence::{Admission, CheckPolicy, FenceTable, GrantLiveness, Liveness};
use fencegate::metrics::Metrics;
use fencegate::store::{wait_durable, Store, SyncObserver, WriterOptions};

fn authority(dir: &std::path::Path, group_commit: bool) -> Arc<Authority> {
    let noop: SyncObserver = Arc::new(|_, _| {});
    let store = Store::open(
        dir,
        WriterOptions { group_commit, max_batch: 1024, nice: 10, background_write_bytes_per_sec: 0 },
        noop,
    )
    .unwrap();
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

/// One writer's admissions on its own key: `sequenced` waits for the
/// fsync of each sequence, as the proxy does before forwarding.
async fn admit(table: &Arc<FenceTable>, store: &Store, key: &str, token: u64, sequenced: bool, n: u64, from: u64) {
    let policy = CheckPolicy::embedded(true);
    for i in 0..n {
        let admission = if sequenced {
            table.admit_sequenced(key, token, from + i, policy, store)
        } else {
            table.admit(key, token, policy)
        };
        match admission {
            Ok(Admission::Admitted(guard)) => drop(guard),
            Ok(Admission::AdmittedAfter(guard, durable)) => {
                wait_durable(durable).await.unwrap();
                drop(guard);
            }
            _ => panic!("must be admitted"),
        }
    }
}

fn sequenced(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let mut group = c.benchmark_group("fenced_write_admission");
    group.sample_size(10).measurement_time(Duration::from_secs(4)).warm_up_time(Duration::from_millis(500));
    let dir = tempfile::tempdir().unwrap();
    let noop: SyncObserver = Arc::new(|_, _| {});
    let store = Store::open(
        dir.path(),
        WriterOptions { group_commit: true, max_batch: 1024, nice: 10, background_write_bytes_per_sec: 0 },
        noop,
    )
    .unwrap();
    let table = FenceTable::new();
    // Strict admission asks the authority whether the grant is live (a map
    // lookup there, as here).
    let live = Arc::new(LiveGrants(dashmap::DashMap::new()));
    let weak: std::sync::Weak<dyn GrantLiveness> = Arc::downgrade(&live) as std::sync::Weak<dyn GrantLiveness>;
    table.derive_liveness_from(weak);
    for c in 0..64 {
        let key = format!("bench/{c}");
        table.load(&key, 5);
        live.0.insert(key, 5);
    }
    let next = Arc::new(std::sync::atomic::AtomicU64::new(1));
    for sequenced in [false, true] {
        let mode = if sequenced { "sequenced_fsync" } else { "unsequenced" };
        for clients in [1usize, 64] {
            group.throughput(Throughput::Elements(clients as u64));
            group.bench_with_input(BenchmarkId::new(mode, clients), &clients, |b, &clients| {
                b.iter_custom(|iters| {
                    // Sequences only grow across iterations: every one is admitted.
                    let from = next.fetch_add(iters, std::sync::atomic::Ordering::Relaxed);
                    rt.block_on(async {
                        let started = Instant::now();
                        let mut tasks = Vec::new();
                        for c in 0..clients {
                            let (table, store) = (table.clone(), store.clone());
                            tasks.push(tokio::spawn(async move {
                                admit(&table, &store, &format!("bench/{c}"), 5, sequenced, iters, from).await;
                            }));
                        }
                        for t in tasks {
                            t.await.unwrap();
                        }
                        started.elapsed()
                    })
                });
            });
        }
    }
    group.finish();
}

criterion_group!(benches, durable, sequenced);
criterion_main!(benches);

/// Stands in for the authority: which grant of each key is live.
struct LiveGrants(dashmap::DashMap<String, u64>);

impl GrantLiveness for LiveGrants {
    fn liveness(&self, key: &str, token: u64) -> Liveness {
        self.0.get(key).is_some_and(|t| *t == token).into()
    }
}
