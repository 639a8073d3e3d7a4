//! Configuration: arbitrary UTF-8 text as a TOML config file.
//!
//! `Config::from_toml` must never panic; when it accepts, `validate()`,
//! `effective_routes()` and every `route_name()` must not panic either.
//! `validate()` may read files named in the config (TLS PEMs, the
//! principals file); inputs naming `/dev`, `/proc` or `/sys` are skipped so
//! that a path like `/dev/zero` or `/dev/stdin` cannot hang the fuzzer.
#![no_main]

use fencegate::Config;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|text: &str| {
    if text.contains("/dev") || text.contains("/proc") || text.contains("/sys") {
        return;
    }
    let Ok(cfg) = Config::from_toml(text) else { return };
    let valid = cfg.validate();
    let routes = cfg.effective_routes();
    assert!(!routes.is_empty());
    if cfg.routes.is_empty() {
        assert_eq!(routes.len(), 1);
    } else {
        assert_eq!(routes.len(), cfg.routes.len());
    }
    for (i, r) in routes.iter().enumerate() {
        assert!(!r.route_name(i).is_empty() || r.name.as_deref() == Some(""));
    }
    if valid.is_ok() {
        // What validate() promises.
        assert!(cfg.locks.min_ttl_ms >= 1 && cfg.locks.max_ttl_ms >= cfg.locks.min_ttl_ms);
        assert!(cfg.locks.max_waiters_per_key >= 1 && cfg.store.max_batch >= 1);
        assert!(cfg.server.max_header_bytes >= 1024);
        for r in &cfg.routes {
            let m = fencegate::proxy::template::Template::parse_match(&r.match_path).expect("validated match");
            if let Some(res) = &r.resource {
                fencegate::proxy::template::Template::parse_resource(res, &m).expect("validated resource");
            }
            fencegate::proxy::upstream::UpstreamUrl::parse(&r.upstream).expect("validated upstream");
        }
    }
});
