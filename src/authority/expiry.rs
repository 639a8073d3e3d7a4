//! The one expiry task: a min-heap of deadlines and a task that sleeps
//! until the earliest one.
//!
//! Renewals do not touch the heap: when an entry comes due, the grant's
//! real deadline is compared and, if it moved, the entry is pushed again.
//! So a heap entry is only ever a lower bound of its grant's deadline, and
//! a grant is never expired early.

use std::cmp::Reverse;
use std::sync::Arc;

use tokio::time::Instant;

use super::{Authority, Ended};
use crate::shutdown::Shutdown;

/// A grant that may be due at `.0.0`.
pub(super) type Due = Reverse<(Instant, Arc<str>, u64)>;

impl Authority {
    /// Remembers that grant `token` of `key` may expire at `at`.
    pub(super) fn schedule_expiry(&self, key: &Arc<str>, at: Instant, token: u64) {
        let Ok(mut heap) = self.expiry.lock() else {
            return;
        };
        let earliest = heap.peek().is_none_or(|Reverse((t, _, _))| at < *t);
        heap.push(Reverse((at, key.clone(), token)));
        drop(heap);
        if earliest {
            self.expiry_wake.notify_one();
        }
    }

    /// Runs until `shutdown`: expires grants whose deadline has passed.
    pub async fn run_expiry(self: Arc<Self>, shutdown: Shutdown) {
        loop {
            let next = self.expiry.lock().ok().and_then(|h| h.peek().map(|Reverse((t, _, _))| *t));
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
        let due: Vec<(Instant, Arc<str>, u64)> = {
            let Ok(mut heap) = self.expiry.lock() else {
                return;
            };
            let mut due = Vec::new();
            while heap.peek().is_some_and(|Reverse((t, _, _))| *t <= now) {
                if let Some(Reverse(entry)) = heap.pop() {
                    due.push(entry);
                }
            }
            due
        };
        for (_, key, token) in due {
            let later = {
                let Some(mut st) = self.keys.get_mut(&key) else {
                    continue;
                };
                match &st.grant {
                    Some(g) if g.token == token && g.deadline <= now => {
                        self.end_locked(&key, &mut st, Ended::Expired);
                        None
                    }
                    Some(g) if g.token == token => Some(g.deadline),
                    _ => None,
                }
            };
            match later {
                Some(deadline) => self.schedule_expiry(&key, deadline, token),
                None => self.gc(&key),
            }
        }
    }
}
