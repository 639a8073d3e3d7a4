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

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;

use tokio::time::Instant;

use super::{Authority, Ended};
use crate::shutdown::Shutdown;

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
                () = sleep => self.expire_due(Instant::now()),
                () = self.expiry_wake.notified() => {}
                () = shutdown.wait() => return,
            }
        }
    }

    /// Ends every grant whose deadline is at or before `now`.
    pub(super) fn expire_due(&self, now: Instant) {
        let due: Vec<Arc<str>> = {
            let Ok(mut s) = self.expiry.lock() else {
                return;
            };
            let mut due = Vec::new();
            while s.heap.peek().is_some_and(|Reverse((t, _))| *t <= now) {
                let Some(Reverse((t, key))) = s.heap.pop() else { break };
                if s.at.get(&key) == Some(&t) {
                    s.at.remove(&key);
                    due.push(key);
                }
            }
            due
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
    }

    /// Keys in the expiry schedule (for tests).
    #[cfg(test)]
    pub(super) fn scheduled(&self) -> (usize, usize) {
        self.expiry.lock().map_or((0, 0), |s| (s.heap.len(), s.at.len()))
    }
}
