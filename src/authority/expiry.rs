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
//! Which time a key is in the heap for is kept in the key's own state
//! (`KeyState::scheduled_ms`), not in a second map: an entry is 16 bytes
//! (a time in milliseconds and the key, shared with the maps) in one
//! vector, with no allocation of its own. An entry whose time is not its
//! key's `scheduled_ms` was superseded by an earlier one (or its key was
//! forgotten) and is skipped when it comes due.
//!
//! The task is housekeeping, not what decides: every request that reads a
//! key judges its grant's deadline itself (acquire, renew, status, the
//! proxy's strict admission), so a grant past its deadline is over
//! whether or not the task has reached it. What waits for the task is a
//! key's waiters and watchers, and those keys have a second, small heap
//! (`urgent`) that is worked off first, at once. The rest — ending grants
//! nobody waits for, writing their released records, the gauges — is
//! done by a thread of its own at the lowest CPU priority (nice 19), one
//! slice of keys at a time, handed to it by the task: it takes the CPU the
//! requests leave idle, and on a core they saturate the scheduler's share
//! of a nice-19 thread (about 1.5% beside each busy thread at nice 0). A
//! mass expiry of 500,000 leases due in the same second used to take most
//! of the gateway's one CPU for seconds (fenced-PUT p99 ~9× its quiet
//! value); paced inside the runtime at a tenth of its time it still
//! doubled the typical p99 (see `Sweep`).

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;
use std::sync::Arc;

use tokio::sync::oneshot;

use crate::fence::Key;
use std::time::{Duration, Instant};

use super::{Authority, Ended, KeyState};
use crate::shutdown::Shutdown;

/// Most grants ended in one turn of the expiry task. A mass expiry
/// (500,000 leases due within the same second) is worked off in slices of
/// this many, with a yield to the runtime between slices, so that the
/// proxy and the lease API keep being served meanwhile: one slice costs
/// well under a millisecond, the whole backlog seconds. 32 rather than
/// 128: fenced-PUT p99 during a mass expiry of 500,000 leases 9.6 / 10.3 ms
/// vs 12.0 / 11.6 ms with 128 (interleaved runs, benches/compare/RESULTS.md).
const EXPIRE_PER_TURN: usize = 32;

/// While a backlog lasts, the task working it off inline rests this many
/// times as long as it worked: it takes at most a tenth of the runtime's
/// time (a quarter, 3, made the median 1-s slice of fenced-PUT p99 during
/// a mass expiry 1.7–2.0 ms against 1.2–1.5 ms with 9; the sweep takes ~9 s
/// instead of ~7 s).
const REST_PER_WORK: u32 = 9;

/// The niceness of the sweep thread: the lowest priority, so that a
/// request's thread waking up takes the CPU from it at once.
const SWEEP_NICE: i32 = 19;

/// Where the paced lane's work is done.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sweep {
    /// On a thread of its own at nice 19, one slice at a time (the
    /// gateway's way). Measured against `Inline` on a mass expiry of
    /// 500,000 leases under fenced PUTs: benches/compare/RESULTS.md.
    Thread,
    /// In the expiry task itself, paced to a tenth of the runtime's time
    /// (the way before; kept for tests on a paused clock, where a thread's
    /// work does not hold the clock back, and as the fallback when the
    /// thread cannot be started).
    Inline,
}

/// The sweep thread's end of the work: slices to do, each answered with
/// whether more keys are due.
struct Sweeper {
    jobs: std::sync::mpsc::Sender<(u64, oneshot::Sender<bool>)>,
}

impl Sweeper {
    /// Starts the thread; `None` (and a warning) if it cannot be started.
    /// The thread ends when the `Sweeper` is dropped.
    fn start(auth: Arc<Authority>) -> Option<Sweeper> {
        let (jobs, rx) = std::sync::mpsc::channel::<(u64, oneshot::Sender<bool>)>();
        // The authority's clock is the runtime's (paused in tests).
        let runtime = tokio::runtime::Handle::try_current().ok();
        let started = std::thread::Builder::new().name("fencegate-sweep".into()).spawn(move || {
            let _clock = runtime.as_ref().map(tokio::runtime::Handle::enter);
            // On Linux the calling thread alone (pid 0 is the caller's thread id).
            if let Err(e) = rustix::process::setpriority_process(None, SWEEP_NICE) {
                tracing::warn!(error = %e, "could not lower the expiry sweep's priority");
            }
            while let Ok((now_ms, done)) = rx.recv() {
                let more = auth.expire_paced(now_ms, EXPIRE_PER_TURN);
                // The task may be gone (a stop): nothing to answer.
                let _ = done.send(more);
            }
        });
        match started {
            Ok(_) => Some(Sweeper { jobs }),
            Err(e) => {
                tracing::warn!(error = %e, "could not start the expiry sweep's thread; sweeping in the runtime");
                None
            }
        }
    }

    /// One slice of keys due at or before `now_ms`, done by the thread;
    /// `None` if the thread is gone.
    async fn slice(&self, now_ms: u64) -> Option<bool> {
        let (done, answer) = oneshot::channel();
        self.jobs.send((now_ms, done)).ok()?;
        answer.await.ok()
    }
}

/// When keys' grants may be due.
#[derive(Default)]
pub(super) struct Schedule {
    heap: BinaryHeap<Reverse<Due>>,
    /// Keys somebody waits for or watches, at their grant's deadline:
    /// worked off first and never paced. An entry is pushed when a waiter
    /// or watcher comes, when a key with one gets a new grant or a shorter
    /// deadline, and again when it comes due before a renewed deadline; it
    /// is dropped when it comes due for a key nobody waits for any more.
    urgent: BinaryHeap<Reverse<Due>>,
}

/// Which of the two heaps.
#[derive(Clone, Copy)]
enum Lane {
    Paced,
    Urgent,
}

impl Schedule {
    fn lane(&mut self, lane: Lane) -> &mut BinaryHeap<Reverse<Due>> {
        match lane {
            Lane::Paced => &mut self.heap,
            Lane::Urgent => &mut self.urgent,
        }
    }

    /// Pops up to `max` entries of `lane` due at or before `now_ms`; true
    /// when more are due.
    fn pop_due(&mut self, lane: Lane, now_ms: u64, max: usize) -> (Vec<Due>, bool) {
        let heap = self.lane(lane);
        let is_due = |h: &BinaryHeap<Reverse<Due>>| h.peek().is_some_and(|Reverse(d)| d.at_ms <= now_ms);
        let mut due = Vec::with_capacity(max.min(heap.len()));
        while due.len() < max && is_due(heap) {
            let Some(Reverse(entry)) = heap.pop() else { break };
            due.push(entry);
        }
        let more = is_due(heap);
        (due, more)
    }

    /// The earliest time either heap is due at.
    fn next(&self) -> Option<u64> {
        let top = |h: &BinaryHeap<Reverse<Due>>| h.peek().map(|Reverse(d)| d.at_ms);
        match (top(&self.heap), top(&self.urgent)) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

/// A heap entry: a key that may be due at `at_ms` (milliseconds on the
/// authority's clock). Ordered by the time alone: a mass expiry puts
/// hundreds of thousands of entries at the same millisecond, and ordering
/// ties by key made every step of the heap a string compare (a tenth of
/// the expiry's CPU in a profile). Which of two keys due at the same
/// millisecond ends first does not matter.
pub(super) struct Due {
    at_ms: u64,
    key: Key,
}

impl PartialEq for Due {
    fn eq(&self, other: &Due) -> bool {
        self.at_ms == other.at_ms
    }
}

impl Eq for Due {}

impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Due) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Due {
    fn cmp(&self, other: &Due) -> Ordering {
        self.at_ms.cmp(&other.at_ms)
    }
}

impl Schedule {
    /// Entries the heap has room for.
    pub(super) fn capacity(&self) -> usize {
        self.heap.capacity()
    }
}

impl Authority {
    /// Makes sure `key` (whose locked state is `st`) is looked at no later
    /// than `at_ms`.
    pub(super) fn schedule_expiry(&self, key: &Key, st: &mut KeyState, at_ms: u64) {
        if st.scheduled_ms != 0 && st.scheduled_ms <= at_ms {
            return;
        }
        // 0 means "not scheduled": a deadline at the clock's zero is
        // looked at 1 ms later (never earlier than due).
        let at_ms = at_ms.max(1);
        if self.push_due(Lane::Paced, key, at_ms) {
            st.scheduled_ms = at_ms;
        }
    }

    /// Pushes `key` at `at_ms` (at least 1) into `lane`, waking the task if
    /// that is now the earliest time; false if the schedule is unusable.
    fn push_due(&self, lane: Lane, key: &Key, at_ms: u64) -> bool {
        let Ok(mut s) = self.expiry.lock() else {
            return false;
        };
        let earliest = s.next().is_none_or(|next| at_ms < next);
        s.lane(lane).push(Reverse(Due { at_ms, key: key.clone() }));
        drop(s);
        if earliest {
            self.expiry_wake.notify_one();
        }
        true
    }

    /// Makes sure `key`'s grant is ended at its deadline however far
    /// behind the paced heap is: called with the key's state locked when
    /// somebody starts waiting for or watching it, and when such a key gets
    /// a new grant or a shorter deadline. Nothing to do without a grant (a
    /// waiter that was handed the key pushes it when it installs its own).
    pub(super) fn schedule_urgent(&self, key: &Key, st: &mut KeyState) {
        let Some(at_ms) = st.grant.as_ref().map(|g| g.deadline_ms.max(1)) else {
            return;
        };
        let Some(q) = st.queue.as_mut() else {
            return;
        };
        // One entry per key: 4 million one-off watches of a renewed key
        // used to leave 4 million entries, pushed again at every deadline.
        if q.urgent_ms != 0 && q.urgent_ms <= at_ms {
            return;
        }
        if self.push_due(Lane::Urgent, key, at_ms) {
            q.urgent_ms = at_ms;
        }
    }

    /// Runs until `shutdown`: expires grants whose deadline has passed,
    /// the paced lane on a sweep thread at the lowest priority.
    pub async fn run_expiry(self: Arc<Self>, shutdown: Shutdown) {
        self.run_expiry_with(shutdown, Sweep::Thread).await;
    }

    /// Runs until `shutdown`: expires grants whose deadline has passed,
    /// the paced lane where `sweep` says.
    pub async fn run_expiry_with(self: Arc<Self>, shutdown: Shutdown, sweep: Sweep) {
        let mut sweeper = match sweep {
            Sweep::Thread => Sweeper::start(self.clone()),
            Sweep::Inline => None,
        };
        loop {
            let next = self.expiry.lock().ok().and_then(|s| s.next());
            let sleep = async {
                match next {
                    Some(at) => tokio::time::sleep_until(self.instant_at(at)).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = sleep => {
                    // Work owed as rest, paid in sleeps of at least the
                    // timer's 1 ms; yields in between.
                    let mut rest = Duration::ZERO;
                    loop {
                        if let Some(thread) = &sweeper {
                            // The urgent lane here, at once; the paced one
                            // on the thread, a slice at a time (the
                            // urgent lane waits at most one slice).
                            let now_ms = self.now_ms();
                            self.expire_urgent(now_ms);
                            match thread.slice(now_ms).await {
                                Some(true) if !shutdown.is_triggered() => continue,
                                Some(true) => return,
                                Some(false) => {
                                    self.flush_expiry_lines();
                                    break;
                                }
                                None => {
                                    tracing::warn!("the expiry sweep's thread is gone; sweeping in the runtime");
                                    sweeper = None;
                                }
                            }
                        }
                        let started = Instant::now();
                        if !self.expire_some(self.now_ms(), EXPIRE_PER_TURN) {
                            self.flush_expiry_lines();
                            break;
                        }
                        if shutdown.is_triggered() {
                            return;
                        }
                        rest += started.elapsed() * REST_PER_WORK;
                        if rest >= Duration::from_millis(1) {
                            // The timer sleeps at least this long.
                            tokio::time::sleep(rest).await;
                            rest = Duration::ZERO;
                        } else {
                            tokio::task::yield_now().await;
                        }
                    }
                }
                () = self.expiry_wake.notified() => {}
                () = shutdown.wait() => return,
            }
        }
    }

    /// At a clean stop, once nothing is served any more: ends every grant
    /// whose deadline has passed, so that its drop record is written before
    /// the clean stop is. A restart restores each stored grant with a full
    /// TTL; without this, a lease the gateway had already refused as
    /// expired (the expiry task was behind) came back live.
    pub fn end_overdue(&self) {
        while self.expire_some(self.now_ms(), EXPIRE_PER_TURN) {}
    }

    /// Ends up to `max` grants whose deadline is at or before `now_ms`;
    /// true when more keys are due.
    pub(super) fn expire_some(&self, now_ms: u64, max: usize) -> bool {
        self.expire_urgent(now_ms);
        self.expire_paced(now_ms, max)
    }

    /// Ends up to `max` grants of the paced lane whose deadline is at or
    /// before `now_ms`; true when more keys are due.
    fn expire_paced(&self, now_ms: u64, max: usize) -> bool {
        let Ok((due, more)) = self.expiry.lock().map(|mut s| s.pop_due(Lane::Paced, now_ms, max)) else {
            return false;
        };
        for Due { at_ms, key } in due {
            // One lookup: the key's state is ended and, if nothing is left
            // of it, forgotten under the same lock.
            let update = |st: &mut KeyState| {
                if st.scheduled_ms != at_ms {
                    // Superseded by an earlier entry, or the key was
                    // forgotten and made again since.
                    return false;
                }
                st.scheduled_ms = 0;
                match st.grant.as_ref().map(|g| g.deadline_ms) {
                    Some(deadline) if deadline <= now_ms => {
                        self.end_locked(&key, st, Ended::Expired);
                        true
                    }
                    Some(deadline) => {
                        self.schedule_expiry(&key, st, deadline);
                        false
                    }
                    None => true,
                }
            };
            self.fences.update_lease_then_forget_if(&key, update, KeyState::is_idle);
        }
        more
    }

    /// Ends the grants of waited-for and watched keys whose deadline is at
    /// or before `now_ms` (one entry per such key, plus superseded ones,
    /// skipped), and pushes again a key whose grant was renewed past it
    /// while somebody still waits for it.
    fn expire_urgent(&self, now_ms: u64) {
        let Ok((due, _)) = self.expiry.lock().map(|mut s| s.pop_due(Lane::Urgent, now_ms, usize::MAX)) else {
            return;
        };
        for Due { at_ms, key } in due {
            let Some(mut st) = self.fences.lease_mut(&key) else {
                continue;
            };
            match st.queue.as_mut() {
                // The key's current entry: it leaves the heap.
                Some(q) if q.urgent_ms == at_ms => q.urgent_ms = 0,
                // Superseded, or nobody waits or watches any more.
                _ => continue,
            }
            match st.grant.as_ref().map(|g| g.deadline_ms) {
                Some(deadline) if deadline <= now_ms => self.end_locked(&key, &mut st, Ended::Expired),
                // Renewed: still waited for, still urgent.
                Some(_) => self.schedule_urgent(&key, &mut st),
                None => {}
            }
            // The key stays in the paced heap (`scheduled_ms`), which
            // forgets it when its entry comes due.
        }
    }

    /// Entries in the urgent heap (for tests).
    #[cfg(test)]
    pub(super) fn scheduled_urgent(&self) -> usize {
        self.expiry.lock().map_or(0, |s| s.urgent.len())
    }

    /// Entries in the expiry heap (for tests).
    #[cfg(test)]
    pub(super) fn scheduled(&self) -> usize {
        self.expiry.lock().map_or(0, |s| s.heap.len())
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
        let expiry = tokio::spawn(auth.clone().run_expiry_with(stop, Sweep::Inline));
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

    /// The gateway's sweep, on the real clock: the paced lane is worked
    /// off by a thread of its own at nice 19 (the runtime's thread keeps
    /// its niceness), every lease of a mass expiry ends, and a waiter
    /// behind the backlog is granted by the urgent lane, before the backlog
    /// is done.
    #[tokio::test]
    async fn the_sweep_thread_at_nice_19_ends_every_lease_and_the_waiter_goes_first() {
        let metrics = Arc::new(Metrics::new().unwrap());
        let auth =
            Authority::restore(FenceTable::new(), Store::memory(), metrics.clone(), LocksConfig::default()).unwrap();
        let nice = |stat: &str| -> Option<i32> { stat.rsplit_once(')')?.1.split_whitespace().nth(16)?.parse().ok() };
        let own = nice(&std::fs::read_to_string("/proc/thread-self/stat").unwrap()).unwrap();
        let n = 20_000;
        let mut leases = Vec::with_capacity(n);
        for i in 0..n {
            let req = AcquireRequest { key: format!("mass/{i}"), ttl_ms: 60_000, wait_ms: 0, holder: None };
            leases.push((format!("mass/{i}"), auth.acquire(req).await.unwrap().lease_id));
        }
        let held = auth
            .acquire(AcquireRequest { key: "wanted".into(), ttl_ms: 60_000, wait_ms: 0, holder: None })
            .await
            .unwrap();
        // Every deadline at the same instant whatever the time the acquires
        // took (renewals with a TTL to that instant), the waited-for key's
        // 2 ms after: the whole backlog is due before it.
        let at = auth.now_ms() + 2_000;
        let renew = |key: String, lease_id: String, at: u64| {
            let ttl_ms = Some(at.saturating_sub(auth.now_ms()).max(1));
            auth.renew(crate::authority::RenewRequest { key, lease_id, ttl_ms }).unwrap();
        };
        for (key, lease_id) in leases {
            renew(key, lease_id, at);
        }
        renew("wanted".into(), held.lease_id.clone(), at + 2);
        let (trigger, stop) = crate::shutdown::channel();
        let expiry = tokio::spawn(auth.clone().run_expiry(stop));
        let waiter = {
            let auth = auth.clone();
            tokio::spawn(async move {
                auth.acquire(AcquireRequest { key: "wanted".into(), ttl_ms: 60_000, wait_ms: 60_000, holder: None })
                    .await
            })
        };
        let g = tokio::time::timeout(Duration::from_secs(30), waiter).await.unwrap().unwrap().unwrap();
        assert!(g.fencing_token > held.fencing_token);
        let swept_when_granted = metrics.lease_expirations.get();
        let sweepers: Vec<i32> = std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| {
                let path = t.ok()?.path();
                let comm = std::fs::read_to_string(path.join("comm")).ok()?;
                (comm.trim() == "fencegate-sweep").then(|| nice(&std::fs::read_to_string(path.join("stat")).ok()?))?
            })
            .collect();
        assert_eq!(sweepers, vec![SWEEP_NICE], "one sweep thread, at nice 19");
        assert_eq!(nice(&std::fs::read_to_string("/proc/thread-self/stat").unwrap()), Some(own));
        for _ in 0..600 {
            if metrics.leases_active.get() == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(metrics.leases_active.get(), 1, "only the waiter's grant is left");
        assert_eq!(metrics.lease_expirations.get(), n as u64 + 1);
        assert!(swept_when_granted < n as u64, "the waiter was granted only after the whole backlog");
        assert_eq!(auth.state_count(), 1);
        trigger.trigger();
        expiry.await.unwrap();
    }
}
