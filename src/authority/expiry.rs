//! The one expiry task: a min-heap of times at which a key's grant may be
//! due, and a task that sleeps until the earliest one.
//!
//! Each key is in the heap at most once. Renewals and new grants of a key
//! that is already there do not touch the heap: when its entry comes due,
//! the grant's real deadline is compared and, if it lies later, the key is
//! pushed again for it. So an entry is only ever a lower bound of its
//! key's deadline, a grant is never expired early, and the heap holds one
//! entry per key with a recent grant, not one per grant (a key acquired
//! and released 50,000 times a second with a 30 s TTL used to leave 1.5
//! million entries behind).
//!
//! Due grants are ended in slices of `EXPIRE_PER_TURN` (256) with a yield to
//! the runtime between slices: 500,000 leases due in the same second used
//! to hold the gateway's thread for about a second (no request answered);
//! now they share it with requests while they are worked off.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;

use tokio::time::Instant;

use super::{Authority, Ended};
use crate::shutdown::Shutdown;

/// Most grants ended in one turn of the expiry task. A mass expiry
/// (500,000 leases due within the same second) is worked off in slices of
/// this many, with a yield to the runtime between slices, so that the
/// proxy and the lease API keep being served meanwhile: one slice costs
/// milliseconds, the whole backlog seconds.
const EXPIRE_PER_TURN: usize = 256;

/// When keys' grants may be due.
#[derive(Default)]
pub(super) struct Schedule {
    heap: BinaryHeap<Reverse<(Instant, Arc<str>)>>,
    /// The time each key is in the heap for. A heap entry whose time is
    /// not its key's time here was superseded by an earlier one: skipped.
    at: HashMap<Arc<str>, Instant>,
}

impl Authority {
    /// Makes sure `key` is looked at no later than `at`.
    pub(super) fn schedule_expiry(&self, key: &Arc<str>, at: Instant) {
        let Ok(mut s) = self.expiry.lock() else {
            return;
        };
        if s.at.get(key).is_some_and(|t| *t <= at) {
            return;
        }
        let earliest = s.heap.peek().is_none_or(|Reverse((t, _))| at < *t);
        s.heap.push(Reverse((at, key.clone())));
        s.at.insert(key.clone(), at);
        drop(s);
        if earliest {
            self.expiry_wake.notify_one();
        }
    }

    /// Runs until `shutdown`: expires grants whose deadline has passed.
    pub async fn run_expiry(self: Arc<Self>, shutdown: Shutdown) {
        loop {
            let next = self.expiry.lock().ok().and_then(|s| s.heap.peek().map(|Reverse((t, _))| *t));
            let sleep = async {
                match next {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = sleep => {
                    while self.expire_some(Instant::now(), EXPIRE_PER_TURN) {
                        if shutdown.is_triggered() {
                            return;
                        }
                        tokio::task::yield_now().await;
                    }
                }
                () = self.expiry_wake.notified() => {}
                () = shutdown.wait() => return,
            }
        }
    }

    /// Ends up to `max` grants whose deadline is at or before `now`; true
    /// when more keys are due.
    fn expire_some(&self, now: Instant, max: usize) -> bool {
        let (due, more): (Vec<Arc<str>>, bool) = {
            let Ok(mut s) = self.expiry.lock() else {
                return false;
            };
            let mut due = Vec::new();
            while due.len() < max && s.heap.peek().is_some_and(|Reverse((t, _))| *t <= now) {
                let Some(Reverse((t, key))) = s.heap.pop() else { break };
                if s.at.get(&key) == Some(&t) {
                    s.at.remove(&key);
                    due.push(key);
                }
            }
            let more = s.heap.peek().is_some_and(|Reverse((t, _))| *t <= now);
            (due, more)
        };
        for key in due {
            let later = {
                let Some(mut st) = self.keys.get_mut(&key) else {
                    continue;
                };
                match &st.grant {
                    Some(g) if g.deadline <= now => {
                        self.end_locked(&key, &mut st, Ended::Expired);
                        None
                    }
                    Some(g) => Some(g.deadline),
                    None => None,
                }
            };
            match later {
                Some(deadline) => self.schedule_expiry(&key, deadline),
                None => self.gc(&key),
            }
        }
        more
    }

    /// Keys in the expiry schedule (for tests).
    #[cfg(test)]
    pub(super) fn scheduled(&self) -> (usize, usize) {
        self.expiry.lock().map_or((0, 0), |s| (s.heap.len(), s.at.len()))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use super::*;
    use crate::authority::AcquireRequest;
    use crate::config::LocksConfig;
    use crate::fence::FenceTable;
    use crate::metrics::Metrics;
    use crate::store::Store;

    /// Thousands of leases due at the same instant are ended in slices:
    /// another task on the same (current-thread) runtime runs between
    /// slices, and every lease has ended at the end.
    #[tokio::test(start_paused = true)]
    async fn a_mass_expiry_yields_to_other_tasks_and_ends_every_lease() {
        let metrics = Arc::new(Metrics::new().unwrap());
        let auth =
            Authority::restore(FenceTable::new(), Store::memory(), metrics.clone(), LocksConfig::default()).unwrap();
        let n = 5 * EXPIRE_PER_TURN + 7;
        for i in 0..n {
            let req = AcquireRequest { key: format!("mass/{i}"), ttl_ms: 1_000, wait_ms: 0, holder: None };
            auth.acquire(req).await.unwrap();
        }
        assert_eq!(metrics.leases_active.get(), n as i64);
        let (trigger, stop) = crate::shutdown::channel();
        let expiry = tokio::spawn(auth.clone().run_expiry(stop));
        // A task that notes whether it ran while leases were still live.
        let ran_midway = Arc::new(AtomicBool::new(false));
        tokio::time::sleep(Duration::from_millis(1_000)).await;
        let probe = {
            let (ran, metrics) = (ran_midway.clone(), metrics.clone());
            tokio::spawn(async move {
                for _ in 0..n {
                    let live = metrics.leases_active.get();
                    if live > 0 && live < n as i64 {
                        ran.store(true, Ordering::SeqCst);
                    }
                    tokio::task::yield_now().await;
                }
            })
        };
        tokio::time::sleep(Duration::from_millis(10)).await;
        probe.await.unwrap();
        assert_eq!(metrics.leases_active.get(), 0);
        assert_eq!(metrics.lease_expirations.get(), n as u64);
        assert!(ran_midway.load(Ordering::SeqCst), "the expiry held the runtime for the whole backlog");
        trigger.trigger();
        expiry.await.unwrap();
    }
}
