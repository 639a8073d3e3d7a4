//! Hot paths in memory: token parse, path check + key mapping, fence
//! compare-and-register, an authority acquire + release cycle, and the
//! proxy fast path's request and response head parsing.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion};
use fencegate::authority::{AcquireRequest, Authority, ReleaseRequest};
use fencegate::config::LocksConfig;
use fencegate::fence::{token::parse_one, Admission, CheckPolicy, FenceTable, GrantLiveness, Liveness};
use fencegate::http1::wire::{parse_head, parse_response, Head, Parsed, RespHead, RespParsed};
use fencegate::metrics::Metrics;
use fencegate::proxy::path::check_path;
use fencegate::store::Store;
use fencegate::template::Template;

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
    // Strict admission asks the authority whether the grant is live (a map
    // lookup there, as here).
    let live = Arc::new(LiveGrants(dashmap::DashMap::new()));
    live.0.insert("orders/777".to_string(), 5);
    let weak: std::sync::Weak<dyn GrantLiveness> = Arc::downgrade(&live) as std::sync::Weak<dyn GrantLiveness>;
    table.derive_liveness_from(weak);
    let policy = CheckPolicy::embedded(true);
    c.bench_function("fence_check_and_register", |b| {
        b.iter(|| match table.admit("orders/777", 5, policy) {
            Ok(Admission::Admitted(guard)) => drop(guard),
            _ => panic!("must be admitted"),
        })
    });
    c.bench_function("fence_check_stale", |b| b.iter(|| table.admit("orders/777", 4, policy).is_err()));

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

fn fast_path_heads(c: &mut Criterion) {
    // What wrk sends in the side-by-side harness, and what nginx answers.
    let req: &[u8] = b"PUT /bench/obj HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nContent-Type: application/octet-stream\r\n\
        X-Fencing-Token: 1\r\nContent-Length: 1024\r\n\r\n";
    let mut head = Head::default();
    assert!(matches!(parse_head(req, 65536, &mut head), Parsed::Complete));
    c.bench_function("fast_path_request_head_parse", |b| {
        b.iter(|| matches!(parse_head(std::hint::black_box(req), 65536, &mut head), Parsed::Complete))
    });
    let resp: &[u8] = b"HTTP/1.1 200 OK\r\nServer: nginx/1.22.1\r\nDate: Mon, 30 Nov 2026 19:00:00 GMT\r\n\
        Content-Type: text/plain\r\nContent-Length: 0\r\nConnection: keep-alive\r\n\r\n";
    let mut rh = RespHead::default();
    assert!(matches!(parse_response(resp, false, &mut rh), RespParsed::Complete));
    c.bench_function("fast_path_response_head_parse", |b| {
        b.iter(|| matches!(parse_response(std::hint::black_box(resp), false, &mut rh), RespParsed::Complete))
    });
}

criterion_group!(benches, hot_paths, fast_path_heads);
criterion_main!(benches);

/// Stands in for the authority: which grant of each key is live.
struct LiveGrants(dashmap::DashMap<String, u64>);

impl GrantLiveness for LiveGrants {
    fn liveness(&self, key: &str, token: u64) -> Liveness {
        self.0.get(key).is_some_and(|t| *t == token).into()
    }
}
