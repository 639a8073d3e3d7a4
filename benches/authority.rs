//! Hot paths in memory: token parse, path check + key mapping, fence
//! compare-and-register, and an authority acquire + release cycle.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion};
use fencegate::authority::{AcquireRequest, Authority, ReleaseRequest};
use fencegate::config::LocksConfig;
use fencegate::fence::{token::parse_one, Admission, CheckPolicy, FenceTable};
use fencegate::metrics::Metrics;
use fencegate::proxy::path::check_path;
use fencegate::proxy::template::Template;
use fencegate::store::Store;

fn hot_paths(c: &mut Criterion) {
    c.bench_function("token_parse", |b| b.iter(|| parse_one(std::hint::black_box(b"18446744073709551"))));
    c.bench_function("path_check", |b| b.iter(|| check_path(std::hint::black_box("/orders/12345/lines/7%20x"))));
    // Path check + key mapping as a route does it: decode, match the
    // `match` template, render the `resource` template.
    let matcher = Template::parse_match("/orders/{id}/{*rest}").unwrap();
    let resource = Template::parse_resource("orders/{id}", &matcher).unwrap();
    c.bench_function("path_check_and_key_mapping", |b| {
        b.iter(|| {
            let checked = check_path(std::hint::black_box("/orders/12345/lines/7%20x")).unwrap();
            let segments = checked.segments();
            let caps = matcher.matches(&segments).unwrap();
            resource.render(&caps)
        })
    });

    let table = FenceTable::new();
    for i in 0..100_000u64 {
        table.load(&format!("orders/{i}"), 5);
    }
    table.set_live("orders/777", 5, true);
    let policy = CheckPolicy { strict: true, external: false };
    c.bench_function("fence_check_and_register", |b| {
        b.iter(|| match table.check("orders/777", 5, policy) {
            Ok(Admission::Admitted(guard)) => drop(guard),
            _ => panic!("must be admitted"),
        })
    });
    c.bench_function("fence_check_stale", |b| b.iter(|| table.check("orders/777", 4, policy).is_err()));

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let metrics = Arc::new(Metrics::new().unwrap());
    let auth = Authority::restore(FenceTable::new(), Store::memory(), metrics, LocksConfig::default()).unwrap();
    c.bench_function("authority_acquire_release_in_memory", |b| {
        b.iter(|| {
            rt.block_on(async {
                let g = auth
                    .acquire(AcquireRequest { key: "k".into(), ttl_ms: 1000, wait_ms: 0, holder: None })
                    .await
                    .unwrap();
                auth.release(ReleaseRequest { key: "k".into(), lease_id: g.lease_id }).unwrap();
            })
        })
    });
}

criterion_group!(benches, hot_paths);
criterion_main!(benches);
