//! The Rust client's `LeaseGroup` against the real binary: thousands of
//! leases kept alive past their TTL by a few batch requests, and a lease
//! whose renewal is refused signalled lost while the others stay held.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::{Gateway, Http, Opts};
use fencegate::client::{Client, ClientError, BATCH_LIMIT};

fn leases_active(metrics: &str) -> u64 {
    let line = metrics.lines().find(|l| l.starts_with("fencegate_leases_active ")).unwrap();
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_group_renews_thousands_of_leases_in_a_few_batches() {
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(&dir.path().join("data"), Opts::default());
    let client = Client::new(&gw.api_url("")).unwrap();
    let ttl = Duration::from_millis(1_500);
    let group = client.lease_group(ttl);
    const N: usize = 2_500;
    // One key is held by someone else: its acquire fails alone.
    let other = client.acquire_once("pool/7", Duration::from_secs(60), Duration::ZERO, "other").await.unwrap();
    let keys: Vec<String> = (0..N).map(|i| format!("pool/{i}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let results = group.acquire_many(&refs, "worker").await.unwrap();
    assert_eq!(results.len(), N);
    assert!(matches!(results[7], Err(ClientError::Locked { .. })), "{:?}", results[7]);
    let mut held: Vec<_> = results.into_iter().filter_map(Result::ok).collect();
    assert_eq!(held.len(), N - 1);
    assert_eq!(group.len(), N - 1);
    // Another party releases one of them with its lease id: the group's
    // next renewal of it is refused, and only that lease is lost.
    let victim = held.remove(3);
    client.release(victim.key(), victim.lease_id()).await.unwrap();
    // Three TTLs: every lease renewed several times.
    tokio::time::sleep(ttl * 3).await;
    assert!(victim.is_lost());
    assert!(held.iter().all(|l| !l.is_lost()), "a lease of the group was lost");
    let http = Http::default();
    let metrics = String::from_utf8(http.get(&gw.api_url("/metrics")).await.body.to_vec()).unwrap();
    assert_eq!(leases_active(&metrics), (N - 2 + 1) as u64, "the group's leases and the other holder's");
    // About 3 renewal rounds a TTL, ceil(2,498 / 1,000) = 3 requests a
    // round: a few dozen requests, not one per lease per round.
    let requests = group.renewal_requests();
    let rounds = 9;
    assert!(requests >= 3, "{requests} batch requests");
    assert!(requests <= ((rounds + 2) * N.div_ceil(BATCH_LIMIT)) as u64, "{requests} batch requests");
    // Every token still works at the gateway: the status of a sample.
    for l in held.iter().step_by(250) {
        let s = client.status(l.key()).await.unwrap();
        assert_eq!(s.fencing_token, Some(l.token()));
    }
    // Releasing through the group ends the lease at the gateway.
    let first = held.remove(0);
    let key = first.key().to_string();
    first.release().await.unwrap();
    assert!(!client.status(&key).await.unwrap().held);
    assert_eq!(group.len(), N - 3);
    drop(other);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_group_lease_is_lost_when_renewals_cannot_reach_the_gateway() {
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(&dir.path().join("data"), Opts::default());
    let client = Client::new(&gw.api_url("")).unwrap();
    let ttl = Duration::from_millis(900);
    let group = client.lease_group(ttl);
    let lease = group.acquire("gone/1", "w").await.unwrap();
    let started = std::time::Instant::now();
    gw.kill9();
    // The local deadline passes without a renewal: lost within the TTL
    // (plus scheduling slack), not later.
    tokio::time::timeout(Duration::from_secs(5), lease.lost()).await.unwrap();
    assert!(started.elapsed() < ttl + Duration::from_millis(500), "{:?}", started.elapsed());
}
