//! The lease authority: grants with TTL leases, FIFO waiters, expiry and
//! watch (docs/lease-api.md).
//!
//! Guarantees, in the manner of etcd's mutex:
//! - At most one live grant per key. A grant's fencing token is the next of
//!   one sequence for every key (so it names exactly one grant of one key),
//!   and is installed as the key's fence *before* the grant is returned,
//!   durably (fsynced through the store's group commit), and the grant's
//!   response waits until every in-flight mutation with an older token for
//!   that key has finished (activation). From then on, the old holder is
//!   refused at the resource.
//! - Waiters are served in arrival order; a release or expiry wakes only
//!   the head of the queue. A waiter that gives up (timeout or client gone)
//!   leaves the queue, passing its turn on if it had been woken.
//! - Expiry is judged on the monotonic clock by one background task.
//! - Renewal touches memory only; a restart restores live grants with their
//!   full TTL.
//!
//! Lock order: a key's authority state, then its fence slot, then the
//! expiry heap. No lock is held across an `.await`.

mod expiry;
pub mod types;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dashmap::DashMap;
use tokio::sync::{oneshot, watch, Notify};
use tokio::time::Instant;

use crate::config::LocksConfig;
use crate::error::Error;
use crate::fence::FenceTable;
use crate::metrics::Metrics;
use crate::store::{wait_durable, GrantRecord, Op, Store};

use types::{new_lease_id, secret_eq, validate_ttl};
pub use types::{validate_key, AcquireRequest, GrantView, ReleaseRequest, RenewRequest, RenewView, StatusView};

/// One live grant.
#[derive(Debug, Clone)]
struct Grant {
    token: u64,
    /// Fsynced: only then is the grant shown to readers (status, watch).
    /// A grant that a crash could undo must not be acted upon by anyone.
    durable: bool,
    lease_id: String,
    holder: String,
    ttl: Duration,
    deadline: Instant,
    granted_at: Instant,
}

#[derive(Debug)]
struct Waiter {
    id: u64,
    wake: oneshot::Sender<()>,
}

/// Everything the authority knows of one key.
#[derive(Debug)]
struct KeyState {
    grant: Option<Grant>,
    waiters: VecDeque<Waiter>,
    /// The waiter that was woken and owns the next grant.
    handoff: Option<u64>,
    /// Token of the current holder, 0 for none, for watchers; only while
    /// someone watches (see [`KeyState::publish`]).
    holder_tx: Option<watch::Sender<u64>>,
}

impl KeyState {
    fn new() -> KeyState {
        KeyState { grant: None, waiters: VecDeque::new(), handoff: None, holder_tx: None }
    }
    /// Sets the holder's token and wakes its watchers. The channel is made
    /// by the first watcher and dropped at the first change nobody watches,
    /// so grants and releases of an unwatched key touch no channel.
    fn publish(&mut self, token: u64) {
        if let Some(tx) = &self.holder_tx {
            if tx.receiver_count() == 0 {
                self.holder_tx = None;
            } else {
                tx.send_replace(token);
            }
        }
    }
    /// A watcher of the holder's token.
    fn subscribe(&mut self) -> watch::Receiver<u64> {
        if let Some(tx) = &self.holder_tx {
            return tx.subscribe();
        }
        let published = self.grant.as_ref().filter(|g| g.durable).map_or(0, |g| g.token);
        let (tx, rx) = watch::channel(published);
        self.holder_tx = Some(tx);
        rx
    }
    fn is_free(&self) -> bool {
        self.grant.is_none() && self.handoff.is_none() && self.waiters.is_empty()
    }
    fn is_idle(&self) -> bool {
        self.is_free() && self.holder_tx.as_ref().is_none_or(|tx| tx.receiver_count() == 0)
    }
    fn retry_after_ms(&self, now: Instant) -> u64 {
        self.grant.as_ref().map_or(0, |g| millis(g.deadline.saturating_duration_since(now)))
    }
}

type Issued = (u64, oneshot::Receiver<Result<(), Error>>);

/// What the first look at a key decided.
enum Step {
    Installed(Issued),
    Queued(u64, oneshot::Receiver<()>),
}

/// Why a grant ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ended {
    Released,
    Expired,
    Failed,
}

/// The lease authority of one gateway.
pub struct Authority {
    keys: DashMap<Arc<str>, KeyState>,
    fences: Arc<FenceTable>,
    store: Store,
    metrics: Arc<Metrics>,
    limits: LocksConfig,
    expiry: Mutex<expiry::Schedule>,
    expiry_wake: Notify,
    next_waiter: AtomicU64,
}

impl std::fmt::Debug for Authority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authority").field("keys", &self.keys.len()).finish()
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Authority {
    /// An authority over `fences`, persisting to `store`, and restoring the
    /// grants the store holds: each one whose token is still its key's
    /// fence comes back live with its full TTL counted from now.
    pub fn restore(
        fences: Arc<FenceTable>,
        store: Store,
        metrics: Arc<Metrics>,
        limits: LocksConfig,
    ) -> Result<Arc<Authority>, Error> {
        let auth = Arc::new(Authority {
            keys: DashMap::new(),
            fences,
            store,
            metrics,
            limits,
            expiry: Mutex::default(),
            expiry_wake: Notify::new(),
            next_waiter: AtomicU64::new(1),
        });
        let now = Instant::now();
        for (key, rec) in auth.store.grants()? {
            if auth.fences.fence(&key) != rec.token {
                // A newer fence exists: the grant was superseded.
                continue;
            }
            let ttl = Duration::from_millis(rec.ttl_ms);
            let key: Arc<str> = Arc::from(key.as_str());
            let mut st = KeyState::new();
            st.publish(rec.token);
            st.grant = Some(Grant {
                token: rec.token,
                durable: true,
                lease_id: rec.lease_id,
                holder: rec.holder,
                ttl,
                deadline: now + ttl,
                granted_at: now,
            });
            auth.fences.set_live(&key, rec.token, true);
            auth.schedule_expiry(&key, now + ttl);
            auth.metrics.leases_active.inc();
            auth.keys.insert(key, st);
        }
        Ok(auth)
    }

    /// The fence table this authority installs fences into.
    pub fn fences(&self) -> &Arc<FenceTable> {
        &self.fences
    }

    /// Number of live grants.
    pub fn live_grants(&self) -> usize {
        self.keys.iter().filter(|e| e.grant.is_some()).count()
    }

    /// Acquires `req.key`, waiting up to `wait_ms` in FIFO order.
    pub async fn acquire(self: &Arc<Self>, req: AcquireRequest) -> Result<GrantView, Error> {
        let result = self.acquire_inner(req).await;
        let outcome = match &result {
            Ok(_) => "ok",
            Err(Error::Locked { .. }) => "locked",
            Err(Error::BadRequest(_)) => "invalid",
            Err(_) => "error",
        };
        if outcome != "error" {
            self.metrics.lock_request("acquire", outcome);
        }
        result
    }

    async fn acquire_inner(self: &Arc<Self>, req: AcquireRequest) -> Result<GrantView, Error> {
        let holder = req.validate(&self.limits)?;
        let started = Instant::now();
        let ttl = Duration::from_millis(req.ttl_ms);
        let lease_id = new_lease_id()?;
        let key: Arc<str> = Arc::from(req.key.as_str());

        // Take the lock at once, or join the queue.
        let step = {
            let mut st = self.keys.entry(key.clone()).or_insert_with(KeyState::new);
            self.expire_if_due(&key, &mut st, started);
            if st.is_free() {
                Step::Installed(self.install(&key, &mut st, &lease_id, &holder, ttl)?)
            } else if req.wait_ms == 0 || st.waiters.len() >= self.limits.max_waiters_per_key {
                let retry_after_ms = st.retry_after_ms(started);
                return Err(Error::Locked { key: req.key, retry_after_ms });
            } else {
                let id = self.next_waiter.fetch_add(1, Ordering::Relaxed);
                let (wake, rx) = oneshot::channel();
                st.waiters.push_back(Waiter { id, wake });
                self.metrics.lock_waiters.inc();
                Step::Queued(id, rx)
            }
        };
        let (token, durable) = match step {
            Step::Installed(issued) => issued,
            Step::Queued(id, rx) => {
                let mut guard = WaiterGuard { auth: self, key: key.clone(), id, armed: true };
                let woken = tokio::time::timeout_at(started + Duration::from_millis(req.wait_ms), rx).await;
                let waited = started.elapsed().as_secs_f64();
                if !matches!(woken, Ok(Ok(()))) {
                    drop(guard);
                    self.metrics.lock_wait.with_label_values(&["timeout"]).observe(waited);
                    let retry_after_ms = self.keys.get(&key).map_or(0, |st| st.retry_after_ms(Instant::now()));
                    self.gc(&key);
                    return Err(Error::Locked { key: req.key, retry_after_ms });
                }
                let mut st = self.keys.entry(key.clone()).or_insert_with(KeyState::new);
                if st.handoff != Some(id) {
                    return Err(Error::Internal(format!("waiter on {key} woken without the hand-off")));
                }
                st.handoff = None;
                guard.armed = false;
                self.metrics.lock_wait.with_label_values(&["granted"]).observe(waited);
                self.install(&key, &mut st, &lease_id, &holder, ttl)?
            }
        };

        // From here until the answer is handed over, a dropped future (the
        // client hung up) ends the grant instead of leaving it for its TTL.
        let mut orphan = OrphanGuard { auth: self, key: key.clone(), token, armed: true };
        // Durable before anyone sees the token.
        if let Err(e) = wait_durable(durable).await {
            tracing::error!(key = %key, token, error = %e, "grant not durable; withdrawn");
            orphan.armed = false;
            self.end(&key, token, Ended::Failed);
            return Err(e);
        }
        self.publish_durable(&key, token);
        // Activation: older in-flight mutations finish (or are aborted)
        // before the new holder hears it holds the lock.
        let timeout = Duration::from_millis(self.limits.activation_timeout_ms);
        let outcome = self.fences.barrier(&key, token, timeout).await;
        self.metrics.activation_wait.observe(outcome.waited.as_secs_f64());
        if outcome.overrun {
            self.metrics.activation_overruns.inc();
            tracing::warn!(key = %key, token, "activation gave up waiting for older in-flight mutations");
        }
        orphan.armed = false;
        Ok(GrantView { key: req.key, fencing_token: token, lease_id, ttl_ms: req.ttl_ms, holder })
    }

    /// The grant `token` of `key` is fsynced: readers may see it now.
    fn publish_durable(&self, key: &Arc<str>, token: u64) {
        self.fences.mark_durable(key, token);
        if let Some(mut st) = self.keys.get_mut(key) {
            if let Some(g) = st.grant.as_mut().filter(|g| g.token == token) {
                g.durable = true;
                st.publish(token);
            }
        }
    }

    /// Issues the next token to a new grant. Caller holds the key's state
    /// and has checked that it is free (or handed off to it).
    fn install(
        &self,
        key: &Arc<str>,
        st: &mut KeyState,
        lease_id: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<Issued, Error> {
        let ttl_ms = millis(ttl);
        let (token, durable) = self.fences.issue(key, &self.store, |k, token| {
            let record = GrantRecord { token, lease_id: lease_id.to_string(), holder: holder.to_string(), ttl_ms };
            vec![Op::Fence { key: k.clone(), token }, Op::Grant { key: k.clone(), record }]
        })?;
        let now = Instant::now();
        st.grant = Some(Grant {
            token,
            durable: false,
            lease_id: lease_id.to_string(),
            holder: holder.to_string(),
            ttl,
            deadline: now + ttl,
            granted_at: now,
        });
        // Published to watchers only once durable (see `publish_durable`).
        self.schedule_expiry(key, now + ttl);
        self.metrics.grants.inc();
        self.metrics.fence_advances.inc();
        self.metrics.leases_active.inc();
        Ok((token, durable))
    }

    /// Extends a live lease by its TTL (or a new one). Memory only.
    pub fn renew(&self, req: RenewRequest) -> Result<RenewView, Error> {
        let result = self.renew_inner(req);
        let outcome = match &result {
            Ok(_) => "ok",
            Err(Error::LeaseLost { .. }) => "lost",
            Err(_) => "invalid",
        };
        self.metrics.lock_request("renew", outcome);
        result
    }

    fn renew_inner(&self, req: RenewRequest) -> Result<RenewView, Error> {
        validate_key(&req.key)?;
        if let Some(ttl_ms) = req.ttl_ms {
            validate_ttl(ttl_ms, &self.limits)?;
        }
        let lost = || Error::LeaseLost { key: req.key.clone() };
        let Some(mut st) = self.keys.get_mut(req.key.as_str()) else {
            return Err(lost());
        };
        let key = st.key().clone();
        let now = Instant::now();
        self.expire_if_due(&key, &mut st, now);
        let Some(grant) = st.grant.as_mut() else {
            return Err(lost());
        };
        if !secret_eq(&grant.lease_id, &req.lease_id) {
            return Err(lost());
        }
        let margin = grant.deadline.saturating_duration_since(now).as_secs_f64();
        self.metrics.renew_margin.observe(margin);
        self.metrics.renew_margin_ratio.observe(margin / grant.ttl.as_secs_f64().max(f64::EPSILON));
        if let Some(ttl_ms) = req.ttl_ms {
            let ttl = Duration::from_millis(ttl_ms);
            if ttl != grant.ttl {
                grant.ttl = ttl;
                // The restart TTL follows; no fsync needed (a restart
                // restores *some* full TTL either way).
                let record = GrantRecord {
                    token: grant.token,
                    lease_id: grant.lease_id.clone(),
                    holder: grant.holder.clone(),
                    ttl_ms,
                };
                self.store.submit_lazy(vec![Op::Grant { key: key.clone(), record }]);
            }
        }
        let deadline = now + grant.ttl;
        let sooner = deadline < grant.deadline;
        grant.deadline = deadline;
        if sooner {
            // A shorter TTL: the key's entry may lie after the new deadline.
            self.schedule_expiry(&key, deadline);
        }
        Ok(RenewView { key: req.key, fencing_token: grant.token, ttl_ms: millis(grant.ttl) })
    }

    /// Ends a grant at its holder's request; wakes the head waiter.
    pub fn release(&self, req: ReleaseRequest) -> Result<(), Error> {
        let result = self.release_inner(&req);
        let outcome = match &result {
            Ok(()) => "ok",
            Err(Error::NotOwner { .. }) => "not_owner",
            Err(_) => "invalid",
        };
        self.metrics.lock_request("release", outcome);
        if result.is_ok() {
            self.gc(&req.key);
        }
        result
    }

    fn release_inner(&self, req: &ReleaseRequest) -> Result<(), Error> {
        validate_key(&req.key)?;
        let not_owner = || Error::NotOwner { key: req.key.clone() };
        let Some(mut st) = self.keys.get_mut(req.key.as_str()) else {
            return Err(not_owner());
        };
        let key = st.key().clone();
        match &st.grant {
            Some(g) if secret_eq(&g.lease_id, &req.lease_id) => {
                self.end_locked(&key, &mut st, Ended::Released);
                Ok(())
            }
            _ => Err(not_owner()),
        }
    }

    /// The key's fence and current holder. Never the lease id.
    pub fn status(&self, key: &str) -> Result<StatusView, Error> {
        validate_key(key)?;
        // Only what is fsynced: a crash now must not take back what a
        // reader was shown.
        let fence = self.fences.durable_fence(key);
        let now = Instant::now();
        let grant = self.keys.get(key).and_then(|st| st.grant.clone()).filter(|g| g.durable && g.deadline > now);
        Ok(match grant {
            Some(g) => StatusView {
                key: key.to_string(),
                fence,
                held: true,
                fencing_token: Some(g.token),
                holder: Some(g.holder),
                expires_in_ms: Some(millis(g.deadline - now)),
            },
            None => StatusView::free(key, fence),
        })
    }

    /// Long-polls until the holder's token differs from `after` (0: no
    /// holder) or `timeout` passes; answers the status either way.
    pub async fn watch(&self, key: &str, after: u64, timeout: Duration) -> Result<StatusView, Error> {
        validate_key(key)?;
        let timeout = timeout.min(Duration::from_millis(self.limits.max_watch_timeout_ms));
        // The guard unsubscribes and forgets the key's state however the
        // watch ends, including a client that hung up (the future dropped).
        let mut w = WatchGuard {
            auth: self,
            key,
            rx: Some(self.keys.entry(Arc::from(key)).or_insert_with(KeyState::new).subscribe()),
        };
        let deadline = Instant::now() + timeout;
        if let Some(rx) = w.rx.as_mut() {
            loop {
                if *rx.borrow_and_update() != after {
                    break;
                }
                match tokio::time::timeout_at(deadline, rx.changed()).await {
                    Ok(Ok(())) => continue,
                    _ => break,
                }
            }
        }
        drop(w);
        self.status(key)
    }

    /// Ends grant `token` of `key` if it is still the current one.
    fn end(&self, key: &str, token: u64, why: Ended) {
        let Some(mut st) = self.keys.get_mut(key) else {
            return;
        };
        if st.grant.as_ref().is_some_and(|g| g.token == token) {
            let key = st.key().clone();
            self.end_locked(&key, &mut st, why);
        }
    }

    fn expire_if_due(&self, key: &Arc<str>, st: &mut KeyState, now: Instant) {
        if st.grant.as_ref().is_some_and(|g| g.deadline <= now) {
            self.end_locked(key, st, Ended::Expired);
        }
    }

    /// Ends the current grant of a locked state and wakes the next waiter.
    fn end_locked(&self, key: &Arc<str>, st: &mut KeyState, why: Ended) {
        let Some(grant) = st.grant.take() else { return };
        let was_published = grant.durable;
        self.fences.set_live(key, grant.token, false);
        self.metrics.leases_active.dec();
        self.metrics.lease_holds.observe(grant.granted_at.elapsed().as_secs_f64());
        match why {
            Ended::Expired => {
                self.metrics.lease_expirations.inc();
                tracing::info!(key = %key, token = grant.token, holder = %grant.holder, "lease expired");
            }
            Ended::Released => tracing::debug!(key = %key, token = grant.token, "lease released"),
            Ended::Failed => {}
        }
        let Grant { token, lease_id, holder, ttl, .. } = grant;
        let ended = GrantRecord { token, lease_id, holder, ttl_ms: millis(ttl) };
        self.store.submit_lazy(vec![Op::DropGrant { key: key.clone(), ended }]);
        if was_published {
            st.publish(0);
        }
        self.wake_next(st);
    }

    /// Hands the key to the first waiter still listening.
    fn wake_next(&self, st: &mut KeyState) {
        while let Some(w) = st.waiters.pop_front() {
            self.metrics.lock_waiters.dec();
            if w.wake.send(()).is_ok() {
                st.handoff = Some(w.id);
                return;
            }
        }
    }

    /// Drops the state of a key nobody holds, waits for or watches.
    fn gc(&self, key: &str) {
        self.keys.remove_if(key, |_, st| st.is_idle());
    }
}

/// A watch's subscription: dropping it (the watch ended, or its client hung
/// up and the future was dropped) unsubscribes and forgets the key's state
/// if nobody else holds, waits for or watches it.
struct WatchGuard<'a> {
    auth: &'a Authority,
    key: &'a str,
    rx: Option<watch::Receiver<u64>>,
}

impl Drop for WatchGuard<'_> {
    fn drop(&mut self) {
        drop(self.rx.take());
        self.auth.gc(self.key);
    }
}

/// A grant installed for an acquire whose answer was not handed over yet:
/// if the acquire's future is dropped (its client hung up), the grant is
/// ended at once instead of being held by nobody for its whole TTL.
struct OrphanGuard<'a> {
    auth: &'a Authority,
    key: Arc<str>,
    token: u64,
    armed: bool,
}

impl Drop for OrphanGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            tracing::info!(key = %self.key, token = self.token, "acquire abandoned by its client; grant released");
            self.auth.end(&self.key, self.token, Ended::Released);
            self.auth.gc(&self.key);
        }
    }
}

/// Removes a waiter that gave up; passes its turn on if it had one.
struct WaiterGuard<'a> {
    auth: &'a Authority,
    key: Arc<str>,
    id: u64,
    armed: bool,
}

impl Drop for WaiterGuard<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Some(mut st) = self.auth.keys.get_mut(&self.key) else {
            return;
        };
        if st.handoff == Some(self.id) {
            st.handoff = None;
            self.auth.wake_next(&mut st);
        } else if let Some(pos) = st.waiters.iter().position(|w| w.id == self.id) {
            st.waiters.remove(pos);
            self.auth.metrics.lock_waiters.dec();
        }
    }
}

#[cfg(test)]
mod tests;
