//! The authority's state machine under paused tokio time.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::{advance, sleep, Instant};

use super::*;
use crate::fence::{Admission, CheckPolicy, Refusal};
use crate::shutdown;

struct Rig {
    auth: Arc<Authority>,
    _trigger: shutdown::Trigger,
}

fn rig_with(store: Store) -> Rig {
    let metrics = Arc::new(Metrics::new().unwrap());
    let fences = FenceTable::new();
    store.for_each_fence(|k, r| fences.load_record(k, r)).unwrap();
    let auth = Authority::restore(fences, store, metrics, LocksConfig::default()).unwrap();
    let (trigger, stop) = shutdown::channel();
    tokio::spawn(auth.clone().run_expiry_with(stop, Sweep::Inline));
    Rig { auth, _trigger: trigger }
}

fn rig() -> Rig {
    rig_with(Store::memory())
}

fn acq(key: &str, ttl_ms: u64, wait_ms: u64) -> AcquireRequest {
    AcquireRequest { key: key.into(), ttl_ms, wait_ms, holder: Some("t".into()) }
}

#[tokio::test(start_paused = true)]
async fn tokens_start_at_one_and_increase() {
    let r = rig();
    let a = r.auth.acquire(acq("k", 1000, 0)).await.unwrap();
    assert_eq!(a.fencing_token, 1);
    r.auth.release(ReleaseRequest { key: "k".into(), lease_id: a.lease_id }).unwrap();
    let b = r.auth.acquire(acq("k", 1000, 0)).await.unwrap();
    assert_eq!(b.fencing_token, 2);
    // One sequence for every key: another key's first token is 3, not 1.
    let other = r.auth.acquire(acq("other", 1000, 0)).await.unwrap();
    assert_eq!(other.fencing_token, 3);
}

#[tokio::test(start_paused = true)]
async fn held_key_is_locked_with_retry_after() {
    let r = rig();
    r.auth.acquire(acq("k", 5000, 0)).await.unwrap();
    advance(Duration::from_millis(1000)).await;
    match r.auth.acquire(acq("k", 1000, 0)).await {
        Err(Error::Locked { retry_after_ms, .. }) => assert_eq!(retry_after_ms, 4000),
        other => panic!("{other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn lease_expires_after_ttl_and_fence_stays() {
    let r = rig();
    let a = r.auth.acquire(acq("k", 1000, 0)).await.unwrap();
    sleep(Duration::from_millis(999)).await;
    assert!(r.auth.status("k").unwrap().held);
    sleep(Duration::from_millis(2)).await;
    let s = r.auth.status("k").unwrap();
    assert!(!s.held);
    assert_eq!(s.fence, a.fencing_token);
    let lost = r.auth.renew(RenewRequest { key: "k".into(), lease_id: a.lease_id, ttl_ms: None });
    assert!(matches!(lost, Err(Error::LeaseLost { .. })));
    assert_eq!(r.auth.metrics.lease_expirations.get(), 1);
}

#[tokio::test(start_paused = true)]
async fn renew_extends_the_lease() {
    let r = rig();
    let a = r.auth.acquire(acq("k", 1000, 0)).await.unwrap();
    for _ in 0..5 {
        sleep(Duration::from_millis(600)).await;
        let v = r.auth.renew(RenewRequest { key: "k".into(), lease_id: a.lease_id.clone(), ttl_ms: None }).unwrap();
        assert_eq!(v.fencing_token, a.fencing_token);
    }
    // 3 s after the grant with a 1 s TTL: still held thanks to renewals.
    assert!(r.auth.status("k").unwrap().held);
    sleep(Duration::from_millis(1001)).await;
    assert!(!r.auth.status("k").unwrap().held);
}

#[tokio::test(start_paused = true)]
async fn renew_with_new_ttl_changes_it() {
    let r = rig();
    let a = r.auth.acquire(acq("k", 1000, 0)).await.unwrap();
    let v = r.auth.renew(RenewRequest { key: "k".into(), lease_id: a.lease_id.clone(), ttl_ms: Some(5000) }).unwrap();
    assert_eq!(v.ttl_ms, 5000);
    sleep(Duration::from_millis(4000)).await;
    assert!(r.auth.status("k").unwrap().held);
}

#[tokio::test(start_paused = true)]
async fn release_by_non_owner_is_refused() {
    let r = rig();
    let a = r.auth.acquire(acq("k", 1000, 0)).await.unwrap();
    let wrong = r.auth.release(ReleaseRequest { key: "k".into(), lease_id: "0".repeat(32) });
    assert!(matches!(wrong, Err(Error::NotOwner { .. })));
    let nothing = r.auth.release(ReleaseRequest { key: "nope".into(), lease_id: a.lease_id.clone() });
    assert!(matches!(nothing, Err(Error::NotOwner { .. })));
    assert!(r.auth.status("k").unwrap().held);
    r.auth.release(ReleaseRequest { key: "k".into(), lease_id: a.lease_id.clone() }).unwrap();
    // Released twice: no longer the owner.
    let again = r.auth.release(ReleaseRequest { key: "k".into(), lease_id: a.lease_id });
    assert!(matches!(again, Err(Error::NotOwner { .. })));
}

#[tokio::test(start_paused = true)]
async fn waiters_are_served_in_fifo_order() {
    let r = rig();
    let first = r.auth.acquire(acq("k", 10_000, 0)).await.unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for i in 0..5u64 {
        let auth = r.auth.clone();
        let tx = tx.clone();
        tokio::spawn(async move {
            let g = auth.acquire(acq("k", 10_000, 60_000)).await.unwrap();
            tx.send((i, g.fencing_token)).unwrap();
            auth.release(ReleaseRequest { key: "k".into(), lease_id: g.lease_id }).unwrap();
        });
        // Let each join the queue before the next arrives.
        sleep(Duration::from_millis(10)).await;
    }
    r.auth.release(ReleaseRequest { key: "k".into(), lease_id: first.lease_id }).unwrap();
    let mut order = Vec::new();
    for _ in 0..5 {
        order.push(rx.recv().await.unwrap());
    }
    assert_eq!(order, vec![(0, 2), (1, 3), (2, 4), (3, 5), (4, 6)]);
}

#[tokio::test(start_paused = true)]
async fn expiry_wakes_only_the_head_waiter() {
    let r = rig();
    r.auth.acquire(acq("k", 1000, 0)).await.unwrap();
    let a = tokio::spawn({
        let auth = r.auth.clone();
        async move { auth.acquire(acq("k", 5000, 10_000)).await }
    });
    sleep(Duration::from_millis(10)).await;
    let b = tokio::spawn({
        let auth = r.auth.clone();
        async move { auth.acquire(acq("k", 5000, 10_000)).await }
    });
    sleep(Duration::from_millis(1100)).await;
    assert!(a.is_finished(), "head waiter should hold the key after expiry");
    assert!(!b.is_finished(), "second waiter must still wait");
    assert_eq!(a.await.unwrap().unwrap().fencing_token, 2);
    b.abort();
}

#[tokio::test(start_paused = true)]
async fn waiter_that_times_out_leaves_the_queue() {
    let r = rig();
    let held = r.auth.acquire(acq("k", 10_000, 0)).await.unwrap();
    let started = Instant::now();
    let timed_out = r.auth.acquire(acq("k", 1000, 500)).await;
    assert!(matches!(timed_out, Err(Error::Locked { .. })));
    assert!(started.elapsed() >= Duration::from_millis(500));
    assert_eq!(r.auth.fences.lease("k").unwrap().waiter_count(), 0);
    // A later waiter is served right after the release.
    let later = tokio::spawn({
        let auth = r.auth.clone();
        async move { auth.acquire(acq("k", 1000, 5000)).await }
    });
    sleep(Duration::from_millis(10)).await;
    r.auth.release(ReleaseRequest { key: "k".into(), lease_id: held.lease_id }).unwrap();
    assert_eq!(later.await.unwrap().unwrap().fencing_token, 2);
}

#[tokio::test(start_paused = true)]
async fn abandoned_waiter_passes_its_turn_on() {
    let r = rig();
    let held = r.auth.acquire(acq("k", 10_000, 0)).await.unwrap();
    let gone = tokio::spawn({
        let auth = r.auth.clone();
        async move { auth.acquire(acq("k", 1000, 60_000)).await }
    });
    sleep(Duration::from_millis(10)).await;
    let next = tokio::spawn({
        let auth = r.auth.clone();
        async move { auth.acquire(acq("k", 1000, 60_000)).await }
    });
    sleep(Duration::from_millis(10)).await;
    gone.abort(); // the client hung up
    sleep(Duration::from_millis(10)).await;
    r.auth.release(ReleaseRequest { key: "k".into(), lease_id: held.lease_id }).unwrap();
    assert_eq!(next.await.unwrap().unwrap().fencing_token, 2);
}

#[tokio::test(start_paused = true)]
async fn watch_wakes_on_grant_and_on_release() {
    let r = rig();
    let w = tokio::spawn({
        let auth = r.auth.clone();
        async move { auth.watch("k", 0, Duration::from_secs(30)).await }
    });
    sleep(Duration::from_millis(100)).await;
    assert!(!w.is_finished());
    let started = Instant::now();
    let g = r.auth.acquire(acq("k", 10_000, 0)).await.unwrap();
    let s = w.await.unwrap().unwrap();
    assert!(started.elapsed() < Duration::from_millis(10));
    assert_eq!(s.fencing_token, Some(g.fencing_token));
    let w2 = tokio::spawn({
        let auth = r.auth.clone();
        async move { auth.watch("k", 1, Duration::from_secs(30)).await }
    });
    sleep(Duration::from_millis(100)).await;
    assert!(!w2.is_finished());
    r.auth.release(ReleaseRequest { key: "k".into(), lease_id: g.lease_id }).unwrap();
    let s = w2.await.unwrap().unwrap();
    assert!(!s.held);
    assert_eq!(s.fence, 1);
}

#[tokio::test(start_paused = true)]
async fn watch_returns_at_timeout_without_change() {
    let r = rig();
    let started = Instant::now();
    let s = r.auth.watch("k", 0, Duration::from_millis(700)).await.unwrap();
    assert!(!s.held);
    assert_eq!(started.elapsed(), Duration::from_millis(700));
}

#[tokio::test(start_paused = true)]
async fn grant_waits_for_older_inflight_mutation() {
    let r = rig();
    let a = r.auth.acquire(acq("k", 1000, 0)).await.unwrap();
    let policy = CheckPolicy::embedded(true);
    let Ok(Admission::Admitted(inflight)) = r.auth.fences().admit("k", a.fencing_token, policy) else {
        panic!("current token must be admitted")
    };
    sleep(Duration::from_millis(1001)).await; // a's lease expires mid-write
    let b = tokio::spawn({
        let auth = r.auth.clone();
        async move { auth.acquire(acq("k", 1000, 0)).await }
    });
    sleep(Duration::from_millis(300)).await;
    assert!(!b.is_finished(), "grant must wait for the older in-flight write");
    // The fence already moved: a's later writes are refused.
    assert!(r.auth.fences().admit("k", a.fencing_token, policy).is_err());
    drop(inflight);
    let b = b.await.unwrap().unwrap();
    assert_eq!(b.fencing_token, 2);
}

#[tokio::test(start_paused = true)]
async fn live_grant_comes_back_with_full_ttl_after_restart() {
    let store = Store::memory();
    let a = {
        let r = rig_with(store.clone());
        let a = r.auth.acquire(acq("k", 2000, 0)).await.unwrap();
        sleep(Duration::from_millis(1500)).await;
        a
    };
    let r = rig_with(store);
    let s = r.auth.status("k").unwrap();
    assert!(s.held);
    assert_eq!(s.expires_in_ms, Some(2000));
    r.auth.renew(RenewRequest { key: "k".into(), lease_id: a.lease_id, ttl_ms: None }).unwrap();
    assert!(matches!(r.auth.acquire(acq("k", 1000, 0)).await, Err(Error::Locked { .. })));
}

#[tokio::test(start_paused = true)]
async fn bounds_are_enforced() {
    let r = rig();
    for bad in [acq("k", 99, 0), acq("k", 3_600_001, 0), acq("k", 1000, 300_001), acq("", 1000, 0)] {
        assert!(matches!(r.auth.acquire(bad).await, Err(Error::BadRequest(_))));
    }
    let bad_holder = AcquireRequest { key: "k".into(), ttl_ms: 1000, wait_ms: 0, holder: Some("a\u{0}".into()) };
    assert!(matches!(r.auth.acquire(bad_holder).await, Err(Error::BadRequest(_))));
}

#[tokio::test(start_paused = true)]
async fn a_renewal_with_a_shorter_ttl_expires_on_the_new_deadline() {
    let r = rig();
    let held = r.auth.acquire(acq("k", 60_000, 0)).await.unwrap();
    let waiter = tokio::spawn({
        let auth = r.auth.clone();
        async move { auth.acquire(acq("k", 1000, 30_000)).await }
    });
    sleep(Duration::from_millis(10)).await;
    r.auth.renew(RenewRequest { key: "k".into(), lease_id: held.lease_id, ttl_ms: Some(1000) }).unwrap();
    sleep(Duration::from_millis(1100)).await;
    assert!(waiter.is_finished(), "the waiter still waits for the 60 s deadline the renewal replaced");
    assert_eq!(waiter.await.unwrap().unwrap().fencing_token, 2);
}

#[tokio::test(start_paused = true)]
async fn the_expiry_schedule_holds_one_entry_per_key_not_per_grant() {
    let r = rig();
    for _ in 0..1000 {
        let g = r.auth.acquire(acq("churn", 30_000, 0)).await.unwrap();
        r.auth.release(ReleaseRequest { key: "churn".into(), lease_id: g.lease_id }).unwrap();
    }
    let last = r.auth.acquire(acq("churn", 30_000, 0)).await.unwrap();
    assert_eq!(r.auth.scheduled(), 1);
    // The one entry still expires the last grant on time.
    sleep(Duration::from_millis(30_100)).await;
    assert!(r.auth.fences.lease("churn").is_none_or(|st| st.grant.is_none()), "the last grant outlived its TTL");
    assert_eq!(r.auth.fences.fence("churn"), last.fencing_token);
}

#[tokio::test(start_paused = true)]
async fn a_watcher_after_unwatched_changes_sees_the_current_holder() {
    let r = rig();
    let g1 = r.auth.acquire(acq("k", 10_000, 0)).await.unwrap();
    // A watcher comes and goes; then changes happen while nobody watches.
    let s = r.auth.watch("k", g1.fencing_token, Duration::from_millis(50)).await.unwrap();
    assert_eq!(s.fencing_token, Some(g1.fencing_token));
    r.auth.release(ReleaseRequest { key: "k".into(), lease_id: g1.lease_id }).unwrap();
    let g2 = r.auth.acquire(acq("k", 10_000, 0)).await.unwrap();
    // A new watcher of the old token learns of the new holder at once...
    let started = Instant::now();
    let s = r.auth.watch("k", g1.fencing_token, Duration::from_secs(30)).await.unwrap();
    assert!(started.elapsed() < Duration::from_millis(10));
    assert_eq!(s.fencing_token, Some(g2.fencing_token));
    // ...and one of the current token is woken by the next change.
    let w = tokio::spawn({
        let auth = r.auth.clone();
        async move { auth.watch("k", g2.fencing_token, Duration::from_secs(30)).await }
    });
    sleep(Duration::from_millis(100)).await;
    assert!(!w.is_finished());
    r.auth.release(ReleaseRequest { key: "k".into(), lease_id: g2.lease_id }).unwrap();
    assert!(!w.await.unwrap().unwrap().held);
}

#[tokio::test(start_paused = true)]
async fn a_grant_is_shown_to_readers_only_once_durable() {
    let store = Store::memory();
    let r = rig_with(store.clone());
    let first = r.auth.acquire(acq("k", 10_000, 0)).await.unwrap();
    r.auth.release(ReleaseRequest { key: "k".into(), lease_id: first.lease_id }).unwrap();
    store.hold_acks();
    let auth = r.auth.clone();
    let pending = tokio::spawn(async move { auth.acquire(acq("k", 10_000, 0)).await });
    let auth = r.auth.clone();
    let watcher = tokio::spawn(async move { auth.watch("k", 0, Duration::from_secs(5)).await });
    sleep(Duration::from_millis(100)).await;
    // Installed in memory, not fsynced: a crash now re-issues token 2.
    let st = r.auth.status("k").unwrap();
    assert!(!st.held, "{st:?}");
    assert_eq!(st.fence, 1, "status shows only the durable fence");
    assert!(!watcher.is_finished(), "a watcher must not see a grant a crash could undo");
    store.release_acks(Ok(()));
    let granted = pending.await.unwrap().unwrap();
    assert_eq!(granted.fencing_token, 2);
    let seen = watcher.await.unwrap().unwrap();
    assert_eq!(seen.fencing_token, Some(2));
    assert_eq!(r.auth.status("k").unwrap().fence, 2);
}

#[tokio::test(start_paused = true)]
async fn an_acquire_dropped_before_its_answer_releases_its_grant() {
    let store = Store::memory();
    let r = rig_with(store.clone());
    store.hold_acks();
    let auth = r.auth.clone();
    let abandoned = tokio::spawn(async move { auth.acquire(acq("k", 30_000, 0)).await });
    sleep(Duration::from_millis(50)).await;
    // The client hangs up while the grant waits for its fsync.
    abandoned.abort();
    let _ = abandoned.await;
    store.release_acks(Ok(()));
    // Without the guard the key stays held by nobody for 30 s.
    let next = r.auth.acquire(acq("k", 1000, 0)).await.unwrap();
    assert_eq!(next.fencing_token, 2);
}

#[tokio::test(start_paused = true)]
async fn an_abandoned_watch_leaves_no_state_behind() {
    let r = rig();
    for i in 0..100 {
        let auth = r.auth.clone();
        let w = tokio::spawn(async move { auth.watch(&format!("w/{i}"), 0, Duration::from_secs(60)).await });
        sleep(Duration::from_millis(1)).await;
        w.abort();
        let _ = w.await;
    }
    assert_eq!(r.auth.state_count(), 0, "hung-up watches must not keep their keys");
    assert_eq!(r.auth.fences.slot_count(), 0, "nor the slots made for them (the keys have no fence)");
}

#[tokio::test(start_paused = true)]
async fn a_failed_grant_fsync_withdraws_the_grant() {
    let store = Store::memory();
    let r = rig_with(store.clone());
    store.hold_acks();
    let auth = r.auth.clone();
    let pending = tokio::spawn(async move { auth.acquire(acq("k", 30_000, 0)).await });
    sleep(Duration::from_millis(50)).await;
    store.release_acks(Err(Error::Store("injected fsync failure".into())));
    assert!(matches!(pending.await.unwrap(), Err(Error::Store(_))));
    assert!(!r.auth.status("k").unwrap().held);
    assert_eq!(r.auth.status("k").unwrap().fence, 0);
}

#[tokio::test(start_paused = true)]
async fn a_lease_never_ends_before_its_full_ttl_whatever_the_clock_fraction() {
    let r = rig();
    // Start mid-millisecond: the deadline rounds up, never down.
    advance(Duration::from_micros(500)).await;
    let g = r.auth.acquire(acq("frac", 100, 0)).await.unwrap();
    advance(Duration::from_micros(99_999)).await;
    assert!(r.auth.status("frac").unwrap().held, "ended before 100 ms had passed");
    assert!(r.auth.renew(RenewRequest { key: "frac".into(), lease_id: g.lease_id.clone(), ttl_ms: None }).is_ok());
    advance(Duration::from_micros(99_999)).await;
    assert!(r.auth.status("frac").unwrap().held, "ended before 100 ms had passed since the renewal");
    advance(Duration::from_millis(2)).await;
    assert!(!r.auth.status("frac").unwrap().held);
    assert!(r.auth.renew(RenewRequest { key: "frac".into(), lease_id: g.lease_id, ttl_ms: None }).is_err());
}

#[tokio::test(start_paused = true)]
async fn a_released_key_is_forgotten_once_its_expiry_entry_comes_due() {
    let r = rig();
    let g = r.auth.acquire(acq("gone", 1_000, 0)).await.unwrap();
    r.auth.release(ReleaseRequest { key: "gone".into(), lease_id: g.lease_id }).unwrap();
    // Kept while its heap entry is pending (a new grant would reuse it) ...
    assert_eq!(r.auth.state_count(), 1);
    assert_eq!(r.auth.scheduled(), 1);
    sleep(Duration::from_millis(1_001)).await;
    // ... and forgotten when it comes due.
    assert_eq!(r.auth.state_count(), 0);
    assert_eq!(r.auth.scheduled(), 0);
    assert_eq!(r.auth.metrics.lease_expirations.get(), 0, "a released lease does not expire");
}

#[tokio::test(start_paused = true)]
async fn leases_due_in_the_same_millisecond_and_renewed_ones_among_them() {
    let r = rig();
    let mut leases = Vec::new();
    for i in 0..1_000 {
        leases.push(r.auth.acquire(acq(&format!("same/{i}"), 1_000, 0)).await.unwrap());
    }
    // Every tenth is renewed halfway: its entry comes due at 1 s, finds a
    // later deadline and moves to 1.5 s.
    sleep(Duration::from_millis(500)).await;
    for g in leases.iter().step_by(10) {
        r.auth.renew(RenewRequest { key: g.key.clone(), lease_id: g.lease_id.clone(), ttl_ms: None }).unwrap();
    }
    // 900 due at once are a backlog, worked off paced (a few ms of the
    // paused clock); the renewed ones are due 400 ms later.
    sleep(Duration::from_millis(600)).await;
    assert_eq!(r.auth.metrics.leases_active.get(), 100);
    assert_eq!(r.auth.metrics.lease_expirations.get(), 900);
    assert_eq!(r.auth.scheduled(), 100, "the renewed ones, once each");
    sleep(Duration::from_millis(500)).await;
    assert_eq!(r.auth.metrics.leases_active.get(), 0);
    assert_eq!(r.auth.metrics.lease_expirations.get(), 1_000);
    assert_eq!(r.auth.state_count(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_shorter_ttl_moves_the_lease_earlier_and_the_old_entry_is_skipped() {
    let r = rig();
    let g = r.auth.acquire(acq("short", 60_000, 0)).await.unwrap();
    r.auth.renew(RenewRequest { key: "short".into(), lease_id: g.lease_id, ttl_ms: Some(1_000) }).unwrap();
    assert_eq!(r.auth.scheduled(), 2, "the earlier entry is added, the later one left to be skipped");
    sleep(Duration::from_millis(1_001)).await;
    assert!(!r.auth.status("short").unwrap().held);
    // A new grant on the key before the stale 60 s entry comes due: that
    // entry must not end it (its own entry is at 121 s).
    let next = r.auth.acquire(acq("short", 120_000, 0)).await.unwrap();
    sleep(Duration::from_millis(59_100)).await;
    assert!(r.auth.status("short").unwrap().held, "the stale entry ended a later grant");
    assert_eq!(r.auth.status("short").unwrap().fencing_token, Some(next.fencing_token));
    assert_eq!(r.auth.scheduled(), 1);
    sleep(Duration::from_millis(61_000)).await;
    assert!(!r.auth.status("short").unwrap().held);
    assert_eq!(r.auth.scheduled(), 0);
    assert_eq!(r.auth.state_count(), 0);
}

#[tokio::test(start_paused = true)]
async fn holders_are_stored_once_and_forgotten_with_their_last_grant() {
    let r = rig();
    let a = r.auth.acquire(AcquireRequest {
        key: "h/1".into(),
        ttl_ms: 1_000,
        wait_ms: 0,
        holder: Some("worker-7".into()),
    });
    let a = a.await.unwrap();
    let b = r.auth.acquire(AcquireRequest {
        key: "h/2".into(),
        ttl_ms: 5_000,
        wait_ms: 0,
        holder: Some("worker-7".into()),
    });
    let b = b.await.unwrap();
    let c =
        r.auth.acquire(AcquireRequest { key: "h/3".into(), ttl_ms: 5_000, wait_ms: 0, holder: None }).await.unwrap();
    assert_eq!(r.auth.holders.len(), 1, "one copy of worker-7, none for no holder");
    assert_eq!(r.auth.status("h/2").unwrap().holder.as_deref(), Some("worker-7"));
    assert_eq!(r.auth.status("h/3").unwrap().holder.as_deref(), Some(""));
    assert_eq!(a.holder, "worker-7");
    sleep(Duration::from_millis(1_001)).await; // h/1 expires
    assert_eq!(r.auth.holders.len(), 1, "h/2 still holds it");
    r.auth.release(ReleaseRequest { key: "h/2".into(), lease_id: b.lease_id }).unwrap();
    assert_eq!(r.auth.holders.len(), 0);
    r.auth.release(ReleaseRequest { key: "h/3".into(), lease_id: c.lease_id }).unwrap();
}

#[test]
fn per_key_state_stays_small() {
    // The figures docs/durability.md and RESULTS.md count with.
    // 64 bytes: one allocation class below 80 (mimalloc's classes go
    // 48, 56, 64, 80): a grant's TTL, durable bit and grant time in one
    // word, and the token's zero niche for `Option<Grant>`.
    assert_eq!(std::mem::size_of::<KeyState>(), 64);
    assert_eq!(std::mem::size_of::<(Key, Box<KeyState>)>(), 16);
    assert_eq!(std::mem::size_of::<std::cmp::Reverse<expiry::Due>>(), 16);
}

/// Issue 18: what a held lease costs, by part, on the RocksDB store with
/// 100,000 leases held (`cargo test --lib memory_per_held_lease -- --nocapture`
/// prints the account; `FOOTPRINT_KEYS=500000` for another N). Every part is bounded per lease, so a field or a
/// map added to the per-key path shows up here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_per_held_lease_by_part() {
    let dir = tempfile::tempdir().unwrap();
    let noop: crate::store::SyncObserver = Arc::new(|_, _| {});
    let writer =
        crate::store::WriterOptions { group_commit: true, max_batch: 4096, nice: 0, background_write_bytes_per_sec: 0 };
    let store = Store::open(dir.path(), writer, noop).unwrap();
    let metrics = Arc::new(Metrics::new().unwrap());
    let auth = Authority::restore(FenceTable::new(), store, metrics, LocksConfig::default()).unwrap();
    // FOOTPRINT_KEYS=500000 for the benchmark's scale (the maps' load, and
    // so their bytes per key, depends on N).
    let n: usize = std::env::var("FOOTPRINT_KEYS").ok().and_then(|v| v.parse().ok()).unwrap_or(100_000);
    let n = n.div_ceil(1_000) * 1_000;
    // 1,000 acquires at a time share one fsync (group commit).
    for round in 0..n / 1_000 {
        let mut set = tokio::task::JoinSet::new();
        for i in 0..1_000 {
            let auth = auth.clone();
            let key = format!("held/{:08x}", ((round * 1_000 + i) as u64).wrapping_mul(2_654_435_761) & 0xffff_ffff);
            set.spawn(
                async move { auth.acquire(AcquireRequest { key, ttl_ms: 900_000, wait_ms: 0, holder: None }).await },
            );
        }
        while let Some(r) = set.join_next().await {
            r.unwrap().unwrap();
        }
    }
    let f = auth.footprint();
    println!("{}", f.report());
    assert_eq!(f.keys, n);
    assert_eq!(f.fences.keys, n);
    let per = |b: usize| b / n;
    // Structures: one bucket of the one map, one boxed state and slot, one
    // key block, one heap entry.
    assert!(per(f.authority_states) <= 64 && per(f.fences.slots) <= 40, "{}", f.report());
    assert!(per(f.fences.key_bytes) <= 16 + 13, "the key is stored once: {}", f.report());
    assert!(per(f.expiry) <= 2 * 16, "{}", f.report());
    assert_eq!((f.queues, f.holders, f.fences.inflight), (0, 0, 0), "nobody waits, watches or writes");
    // RocksDB's memtables stay within their write buffers, whatever N.
    assert!(f.store.memtables <= 20 << 20, "{}", f.report());
}

#[tokio::test(start_paused = true)]
async fn time_left_is_never_above_the_ttl_mid_millisecond() {
    let r = rig();
    for (i, micros) in [0u64, 1, 300, 999].into_iter().enumerate() {
        tokio::time::advance(Duration::from_micros(micros)).await;
        let key = format!("mid/{i}");
        let g = r.auth.acquire(acq(&key, 500, 0)).await.unwrap();
        let left = r.auth.status(&key).unwrap().expires_in_ms.unwrap();
        assert!(left <= 500, "{micros} µs into a millisecond: {left} ms left of a 500 ms lease");
        assert!(left >= 499, "{micros} µs: {left}");
        r.auth.release(ReleaseRequest { key, lease_id: g.lease_id }).unwrap();
    }
}

/// A strict route refuses a token whose grant's deadline has passed, at
/// once, although nothing has ended the grant yet (here no expiry task runs
/// at all; under a mass expiry the task can be seconds behind): liveness is
/// the authority's deadline, asked at admission, not a copy in the fence
/// table that the expiry task clears when it gets there.
#[tokio::test(start_paused = true)]
async fn a_strict_route_refuses_a_grant_past_its_deadline_before_the_expiry_task_ends_it() {
    let metrics = Arc::new(Metrics::new().unwrap());
    let fences = FenceTable::new();
    let auth = Authority::restore(fences.clone(), Store::memory(), metrics.clone(), LocksConfig::default()).unwrap();
    let g = auth.acquire(acq("k", 1000, 0)).await.unwrap();
    let strict = CheckPolicy::embedded(true);
    assert!(matches!(fences.admit("k", g.fencing_token, strict), Ok(Admission::Admitted(_))));
    advance(Duration::from_millis(999)).await;
    assert!(matches!(fences.admit("k", g.fencing_token, strict), Ok(Admission::Admitted(_))), "live until its TTL");
    advance(Duration::from_millis(1)).await;
    assert!(matches!(fences.admit("k", g.fencing_token, strict), Err(Refusal::LeaseExpired { .. })));
    assert_eq!(metrics.leases_active.get(), 1, "the grant was not ended (no expiry task ran)");
    // A non-strict route still admits the fence's own token.
    assert!(matches!(fences.admit("k", g.fencing_token, CheckPolicy::embedded(false)), Ok(Admission::Admitted(_))));
    // A renewal before the deadline keeps it live past the first deadline.
    let h = auth.acquire(acq("r", 1000, 0)).await.unwrap();
    advance(Duration::from_millis(900)).await;
    auth.renew(RenewRequest { key: "r".into(), lease_id: h.lease_id.clone(), ttl_ms: None }).unwrap();
    advance(Duration::from_millis(500)).await;
    assert!(matches!(fences.admit("r", h.fencing_token, strict), Ok(Admission::Admitted(_))));
    // A release ends it at once.
    auth.release(ReleaseRequest { key: "r".into(), lease_id: h.lease_id }).unwrap();
    assert!(matches!(fences.admit("r", h.fencing_token, strict), Err(Refusal::LeaseExpired { .. })));
}

/// A grant whose key's fence an external route raised past its token is
/// over: its renewal answers lease_lost (its writes would all be refused as
/// stale), and the key can be granted again, above that fence.
#[tokio::test(start_paused = true)]
async fn a_grant_superseded_by_an_external_fence_is_lost_on_renewal() {
    let r = rig();
    let g = r.auth.acquire(acq("k", 10_000, 0)).await.unwrap();
    r.auth.fences().install("k", g.fencing_token + 5).unwrap();
    let renewed = r.auth.renew(RenewRequest { key: "k".into(), lease_id: g.lease_id, ttl_ms: None });
    assert!(matches!(renewed, Err(Error::LeaseLost { .. })), "{renewed:?}");
    let next = r.auth.acquire(acq("k", 10_000, 0)).await.unwrap();
    assert!(next.fencing_token > g.fencing_token + 5);
}

/// A grant whose deadline passed before a clean stop, not yet reached by
/// the expiry task (here none runs), is ended at the stop: the restart
/// does not bring back a lease the gateway had already refused as expired.
/// A grant still live at the stop comes back.
#[tokio::test(start_paused = true)]
async fn a_grant_past_its_deadline_at_a_clean_stop_does_not_come_back() {
    let store = Store::memory();
    {
        let metrics = Arc::new(Metrics::new().unwrap());
        let auth = Authority::restore(FenceTable::new(), store.clone(), metrics, LocksConfig::default()).unwrap();
        auth.acquire(acq("overdue", 1000, 0)).await.unwrap();
        auth.acquire(acq("live", 60_000, 0)).await.unwrap();
        advance(Duration::from_millis(1500)).await;
        assert!(!auth.status("overdue").unwrap().held, "past its deadline: not held");
        auth.end_overdue();
        store.mark_clean().await.unwrap();
    }
    let r = rig_with(store);
    assert!(!r.auth.status("overdue").unwrap().held, "an expired lease came back after the clean stop");
    assert!(r.auth.status("live").unwrap().held);
}

/// A mass expiry is worked off paced (a quarter of the runtime's time),
/// but a waiter and a watcher of a key whose grant is due behind the
/// whole backlog are served first: their keys are in the urgent heap. The
/// first slice of the sweep after the deadlines ends both keys' grants
/// (without the urgent heap it ends 32 of the backlog, due earlier).
#[tokio::test(start_paused = true)]
async fn waiters_and_watchers_are_not_behind_a_mass_expiry() {
    let metrics = Arc::new(Metrics::new().unwrap());
    // No expiry task: this test runs its slices itself.
    let auth = Authority::restore(FenceTable::new(), Store::memory(), metrics, LocksConfig::default()).unwrap();
    let n = 2_000;
    for i in 0..n {
        auth.acquire(acq(&format!("mass/{i}"), 1_000, 0)).await.unwrap();
    }
    // Due 1 ms after all of them: last in the paced heap.
    let held = auth.acquire(acq("wanted", 1_001, 0)).await.unwrap();
    let watched = auth.acquire(acq("watched", 1_001, 0)).await.unwrap();
    let waiter = {
        let auth = auth.clone();
        tokio::spawn(async move { auth.acquire(acq("wanted", 1_000, 60_000)).await })
    };
    let watcher = {
        let auth = auth.clone();
        tokio::spawn(async move { auth.watch("watched", watched.fencing_token, Duration::from_secs(60)).await })
    };
    tokio::task::yield_now().await;
    advance(Duration::from_millis(1_001)).await;
    assert!(auth.expire_some(auth.now_ms(), 32), "the backlog is left for later slices");
    let granted = tokio::time::timeout(Duration::from_millis(1), waiter).await;
    let g = granted.expect("the waiter was not served by the first slice").unwrap().unwrap();
    assert!(g.fencing_token > held.fencing_token);
    let told = tokio::time::timeout(Duration::from_millis(1), watcher).await;
    assert!(!told.expect("the watcher was not told by the first slice").unwrap().unwrap().held);
    assert!(auth.metrics.lease_expirations.get() <= 2 + 32);
    while auth.expire_some(auth.now_ms(), 32) {}
    assert_eq!(auth.metrics.lease_expirations.get(), n as u64 + 2);
}

/// The paced sweep (an expiry task that rests between slices) still ends
/// every lease of a mass expiry, and a waiter behind it is granted at once.
#[tokio::test(start_paused = true)]
async fn a_paced_mass_expiry_ends_every_lease() {
    let r = rig();
    let n = 5_000;
    for i in 0..n {
        r.auth.acquire(acq(&format!("mass/{i}"), 1_000, 0)).await.unwrap();
    }
    let held = r.auth.acquire(acq("wanted", 1_001, 0)).await.unwrap();
    let g = r.auth.acquire(acq("wanted", 1_000, 60_000)).await.unwrap();
    assert!(g.fencing_token > held.fencing_token);
    sleep(Duration::from_secs(30)).await;
    // The backlog, the first holder and the waiter's own grant.
    assert_eq!(r.auth.metrics.lease_expirations.get(), n as u64 + 2);
    assert_eq!(r.auth.metrics.leases_active.get(), 0);
    assert_eq!(r.auth.state_count(), 0);
}

/// However many waiters and watches a key gets, it has one entry in the
/// urgent heap: 4 million one-off watches of a renewed key used to leave
/// 4 million entries, all pushed again at every deadline (an outside
/// review measured 75% CPU and stalls past a renewing holder's margin).
#[tokio::test(start_paused = true)]
async fn a_key_has_one_urgent_entry_however_many_watch_it() {
    let metrics = Arc::new(Metrics::new().unwrap());
    let auth = Authority::restore(FenceTable::new(), Store::memory(), metrics, LocksConfig::default()).unwrap();
    let g = auth.acquire(acq("hot", 10_000, 0)).await.unwrap();
    for _ in 0..1_000 {
        let s = auth.watch("hot", g.fencing_token, Duration::from_millis(1)).await.unwrap();
        assert!(s.held);
    }
    // One watch stays; the holder renews past the deadline.
    let watcher = {
        let auth = auth.clone();
        tokio::spawn(async move { auth.watch("hot", g.fencing_token, Duration::from_secs(60)).await })
    };
    tokio::task::yield_now().await;
    assert_eq!(auth.scheduled_urgent(), 1);
    advance(Duration::from_millis(5_000)).await;
    auth.renew(RenewRequest { key: "hot".into(), lease_id: g.lease_id.clone(), ttl_ms: None }).unwrap();
    advance(Duration::from_millis(5_000)).await;
    auth.expire_some(auth.now_ms(), 32);
    assert_eq!(auth.scheduled_urgent(), 1, "pushed again once, at the renewed deadline");
    assert!(auth.status("hot").unwrap().held);
    watcher.abort();
}

/// A lease past its deadline is over for release and watch too, whether
/// or not the expiry task has swept it: release answers not_owner, and a
/// watch waiting for "nobody holds it" to change is not woken at once by
/// the old token.
#[tokio::test(start_paused = true)]
async fn release_and_watch_judge_the_deadline_themselves() {
    let metrics = Arc::new(Metrics::new().unwrap());
    // No expiry task: nothing is swept.
    let auth = Authority::restore(FenceTable::new(), Store::memory(), metrics, LocksConfig::default()).unwrap();
    let a = auth.acquire(acq("gone", 1_000, 0)).await.unwrap();
    let b = auth.acquire(acq("watched", 1_000, 0)).await.unwrap();
    advance(Duration::from_millis(1_001)).await;
    match auth.release(ReleaseRequest { key: "gone".into(), lease_id: a.lease_id }) {
        Err(Error::NotOwner { .. }) => {}
        other => panic!("release of an expired lease: {other:?}"),
    }
    assert_eq!(auth.metrics.lease_expirations.get(), 1, "ended as an expiry, not a release");
    let started = Instant::now();
    let s = auth.watch("watched", 0, Duration::from_millis(300)).await.unwrap();
    assert!(!s.held);
    assert!(started.elapsed() >= Duration::from_millis(300), "woken at once by token {}", b.fencing_token);
}

#[test]
fn a_mass_expiry_logs_a_hundred_lines_a_second_and_sums_up_the_rest() {
    let mut b = LineBudget::default();
    let own: usize = (0..1_000).map(|_| b.take(7)).filter(|(earlier, one)| *earlier == 0 && *one).count();
    assert_eq!(own, EXPIRY_LINES_PER_SEC as usize, "lines of their own in one second");
    // The next second sums up the 900 left, and logs its first one.
    assert_eq!(b.take(8), (1_000 - u64::from(EXPIRY_LINES_PER_SEC), true));
    for _ in 0..150 {
        b.take(8);
    }
    // What the expiry task's flush writes once the backlog is done.
    assert_eq!(std::mem::take(&mut b.skipped), 51);
    assert_eq!(b.take(9), (0, true), "nothing left to sum up after a flush");
}
