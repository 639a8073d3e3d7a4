//! Lease API bodies: arbitrary bytes as the JSON of acquire, renew and
//! release, then the bound checks with the default `[locks]` limits.
//!
//! Nothing may panic; each validator must agree with a model of its bound
//! (SPEC 1 and 3), and a typed parse implies valid JSON.
#![no_main]

use fencegate::authority::types::{validate_holder, validate_key, validate_ttl, validate_wait, MAX_KEY_BYTES};
use fencegate::authority::{AcquireRequest, ReleaseRequest, RenewRequest};
use fencegate::config::LocksConfig;
use libfuzzer_sys::fuzz_target;

fn key_ok(key: &str) -> bool {
    let ok = validate_key(key).is_ok();
    let model = !key.is_empty() && key.len() <= MAX_KEY_BYTES && !key.chars().any(char::is_control);
    assert_eq!(ok, model, "validate_key({key:?})");
    ok
}

fn ttl_ok(ttl: u64, l: &LocksConfig) {
    assert_eq!(validate_ttl(ttl, l).is_ok(), (l.min_ttl_ms..=l.max_ttl_ms).contains(&ttl), "ttl {ttl}");
}

/// A typed parse implies valid JSON. (serde's derived structs also accept
/// the array form, e.g. `["k", 1000]` as an acquire body; that is allowed
/// here, not asserted against.)
fn object(data: &[u8]) {
    let v: serde_json::Value = serde_json::from_slice(data).expect("a typed parse is valid JSON");
    assert!(v.is_object() || v.is_array(), "{v}");
}

fuzz_target!(|data: &[u8]| {
    let limits = LocksConfig::default();

    if let Ok(req) = serde_json::from_slice::<AcquireRequest>(data) {
        object(data);
        key_ok(&req.key);
        ttl_ok(req.ttl_ms, &limits);
        assert_eq!(validate_wait(req.wait_ms, &limits).is_ok(), req.wait_ms <= limits.max_wait_ms);
        if let Some(h) = &req.holder {
            let model = h.len() <= limits.max_holder_bytes && !h.chars().any(char::is_control);
            assert_eq!(validate_holder(h, &limits).is_ok(), model, "holder {h:?}");
        }
    }

    if let Ok(req) = serde_json::from_slice::<RenewRequest>(data) {
        object(data);
        key_ok(&req.key);
        if let Some(t) = req.ttl_ms {
            ttl_ok(t, &limits);
        }
        let _ = validate_holder(&req.lease_id, &limits);
    }

    if let Ok(req) = serde_json::from_slice::<ReleaseRequest>(data) {
        object(data);
        key_ok(&req.key);
        // Every release body is also a renew body without a ttl.
        let renew = serde_json::from_slice::<RenewRequest>(data).expect("release body parses as renew");
        assert_eq!((renew.key, renew.lease_id, renew.ttl_ms), (req.key, req.lease_id, None));
    }
});
