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
//!
//! Memory (issue 18): a held lease costs its key (one allocation shared
//! with the fence table), one bucket of each map (a key and a pointer), a
//! boxed [`KeyState`] of 64 bytes (16-byte lease id, interned holder,
//! times in milliseconds, the TTL and the durable bit in one word,
//! waiters and watchers behind one more pointer that is null when there
//! are none) and one 24-byte entry in the expiry
//! heap. `benches/compare/RESULTS.md` (issue 18) has the figures.

mod expiry;
mod footprint;
mod holders;
pub mod types;

pub use expiry::Sweep;
pub use footprint::Footprint;

use std::collections::VecDeque;
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{oneshot, watch, Notify};
use tokio::time::Instant;

use crate::config::{LocksConfig, MAX_TTL_MS};
use crate::error::Error;
use crate::fence::{FenceTable, Key, LeaseSlot};
use crate::metrics::Metrics;
use crate::store::{wait_durable, GrantRecord, Op, Store};

use holders::Holders;
pub use types::{validate_key, AcquireRequest, GrantView, ReleaseRequest, RenewRequest, RenewView, StatusView};
use types::{validate_ttl, LeaseId};

/// An activation shorter than this still answers the TTL asked for; a
/// longer one answers the time the grant has left.
const ACTIVATION_SLACK_MS: u64 = 50;

/// One live grant, 48 bytes: with the key state's two words, a state is
/// 64 bytes, one allocation class below the 80 it took (issue 18's memory
/// per held lease). Times are milliseconds on the authority's clock
/// ([`Authority::now_ms`]).
#[derive(Debug)]
struct Grant {
    /// Tokens start at 1: the zero niche keeps `Option<Grant>` this size.
    token: NonZeroU64,
    lease_id: LeaseId,
    /// Interned ([`Holders`]); `None`: no holder label.
    holder: Option<holders::Name>,
    deadline_ms: u64,
    /// The TTL (at most [`MAX_TTL_MS`]) and, in the top bit, whether the
    /// grant is fsynced: only then is it shown to readers (status, watch).
    /// A grant that a crash could undo must not be acted upon by anyone.
    ttl_durable: u32,
    /// When it was granted, modulo 2^32 ms (49.7 days): only for the
    /// hold-time histogram, which a longer hold sees wrapped.
    granted_ms: u32,
}

const DURABLE: u32 = 1 << 31;

impl Grant {
    fn new(token: u64, lease_id: LeaseId, holder: Option<holders::Name>, ttl_ms: u64, now_ms: u64) -> Option<Grant> {
        let mut g = Grant {
            token: NonZeroU64::new(token)?,
            lease_id,
            holder,
            deadline_ms: now_ms.saturating_add(ttl_ms),
            ttl_durable: 0,
            granted_ms: low_bits(now_ms),
        };
        g.set_ttl_ms(ttl_ms);
        Some(g)
    }

    fn token(&self) -> u64 {
        self.token.get()
    }

    fn ttl_ms(&self) -> u64 {
        u64::from(self.ttl_durable & !DURABLE)
    }

    fn set_ttl_ms(&mut self, ttl_ms: u64) {
        let ttl = u32::try_from(ttl_ms.min(MAX_TTL_MS)).unwrap_or(DURABLE - 1);
        self.ttl_durable = (self.ttl_durable & DURABLE) | ttl;
    }

    fn durable(&self) -> bool {
        self.ttl_durable & DURABLE != 0
    }

    fn set_durable(&mut self) {
        self.ttl_durable |= DURABLE;
    }

    /// How long it has been held, up to 49.7 days (then wrapped).
    fn held_ms(&self, now_ms: u64) -> u64 {
        u64::from(low_bits(now_ms).wrapping_sub(self.granted_ms))
    }

    fn holder(&self) -> &str {
        self.holder.as_deref().map_or("", String::as_str)
    }

    /// The grant as the store keeps it.
    fn record(&self) -> GrantRecord {
        GrantRecord {
            token: self.token(),
            lease_id: self.lease_id.to_hex(),
            holder: self.holder().to_string(),
            ttl_ms: self.ttl_ms(),
        }
    }
}

/// The low 32 bits of a millisecond count.
fn low_bits(ms: u64) -> u32 {
    u32::try_from(ms & u64::from(u32::MAX)).unwrap_or(0)
}

#[derive(Debug)]
struct Waiter {
    id: u64,
    wake: oneshot::Sender<()>,
}

/// What a key has only while somebody waits for it or watches it: boxed
/// behind one pointer, null for nearly every held key.
#[derive(Debug, Default)]
struct Queue {
    waiters: VecDeque<Waiter>,
    /// The waiter that was woken and owns the next grant.
    handoff: Option<u64>,
    /// Token of the current holder, 0 for none, for watchers; only while
    /// someone watches (see [`KeyState::publish`]).
    holder_tx: Option<watch::Sender<u64>>,
    /// The time this key is in the urgent expiry heap for (0: not in it);
    /// an entry with another time was superseded and is skipped. One entry
    /// per key, however many waiters and watches come (`expiry.rs`).
    urgent_ms: u64,
}

/// Everything the authority knows of one key: kept in the key's slot of
/// the fence table (one map for both, see [`crate::fence`]'s `LeaseSlot`).
#[derive(Debug)]
pub(crate) struct KeyState {
    grant: Option<Grant>,
    /// The time this key is in the expiry heap for (0: not in it). A heap
    /// entry with another time was superseded: skipped (`expiry.rs`).
    scheduled_ms: u64,
    queue: Option<Box<Queue>>,
}

impl KeyState {
    pub(crate) fn new() -> KeyState {
        KeyState { grant: None, scheduled_ms: 0, queue: None }
    }
    fn queue_mut(&mut self) -> &mut Queue {
        self.queue.get_or_insert_with(Box::default)
    }
    /// Drops the queue once it holds nothing.
    fn tidy(&mut self) {
        if self.queue.as_ref().is_some_and(|q| q.waiters.is_empty() && q.handoff.is_none() && q.holder_tx.is_none()) {
            self.queue = None;
        }
    }
    fn handoff(&self) -> Option<u64> {
        self.queue.as_ref().and_then(|q| q.handoff)
    }
    fn waiter_count(&self) -> usize {
        self.queue.as_ref().map_or(0, |q| q.waiters.len())
    }
    /// Sets the holder's token and wakes its watchers. The channel is made
    /// by the first watcher and dropped at the first change nobody watches,
    /// so grants and releases of an unwatched key touch no channel.
    fn publish(&mut self, token: u64) {
        if let Some(q) = self.queue.as_mut() {
            if let Some(tx) = &q.holder_tx {
                if tx.receiver_count() == 0 {
                    q.holder_tx = None;
                } else {
                    tx.send_replace(token);
                }
            }
        }
        self.tidy();
    }
    /// A watcher of the holder's token.
    fn subscribe(&mut self) -> watch::Receiver<u64> {
        let published = self.grant.as_ref().filter(|g| g.durable()).map_or(0, Grant::token);
        let q = self.queue_mut();
        if let Some(tx) = &q.holder_tx {
            return tx.subscribe();
        }
        let (tx, rx) = watch::channel(published);
        q.holder_tx = Some(tx);
        rx
    }
    fn is_free(&self) -> bool {
        self.grant.is_none() && self.handoff().is_none() && self.waiter_count() == 0
    }
    /// Nothing to keep: free, not in the expiry heap (a key released and
    /// acquired again keeps its one entry there), and nobody watching.
    fn is_idle(&self) -> bool {
        self.is_free()
            && self.scheduled_ms == 0
            && self.queue.as_ref().and_then(|q| q.holder_tx.as_ref()).is_none_or(|tx| tx.receiver_count() == 0)
    }
    /// Time left of the grant, counted from `now_up` (now rounded up, as
    /// deadlines are): never above the TTL, as `status` counts.
    fn retry_after_ms(&self, now_up: u64) -> u64 {
        self.grant.as_ref().map_or(0, |g| g.deadline_ms.saturating_sub(now_up))
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
    /// Its key's fence moved past its token (an external route).
    Superseded,
}

/// The lease authority of one gateway. Its per-key states live in the
/// fence table's slots ([`FenceTable::lease_slot`]): a key's grant and its
/// fence under one lock, one bucket per key.
pub struct Authority {
    fences: Arc<FenceTable>,
    holders: Holders,
    /// The zero of [`Authority::now_ms`].
    base: Instant,
    store: Store,
    metrics: Arc<Metrics>,
    limits: LocksConfig,
    expiry: Mutex<expiry::Schedule>,
    expiry_wake: Notify,
    next_waiter: AtomicU64,
    /// "lease expired" lines of the current second ([`Authority::log_expired`]).
    expiry_lines: Mutex<LineBudget>,
}

/// Individual "lease expired" lines per second at most: past it, the
/// second's expirations are summed up in one line. 500,000 leases expiring
/// at once wrote 500,000 lines at the default level (`info`).
const EXPIRY_LINES_PER_SEC: u32 = 100;

#[derive(Debug, Default)]
struct LineBudget {
    /// The second (of the authority's clock) the counts are for.
    second: u64,
    logged: u32,
    skipped: u64,
}

impl LineBudget {
    /// One more expiry in `second`: the count of an earlier second's
    /// expirations not logged one by one (to sum up now; 0: none), and
    /// whether this one gets its own line.
    fn take(&mut self, second: u64) -> (u64, bool) {
        let mut earlier = 0;
        if self.second != second {
            earlier = std::mem::take(self).skipped;
            self.second = second;
        }
        if self.logged < EXPIRY_LINES_PER_SEC {
            self.logged += 1;
            (earlier, true)
        } else {
            self.skipped += 1;
            (earlier, false)
        }
    }
}

impl crate::fence::GrantLiveness for Authority {
    /// Live: `key`'s grant has `token` and its deadline has not passed —
    /// whether or not the expiry task has reached it yet.
    fn liveness(&self, key: &str, token: u64) -> crate::fence::Liveness {
        let now_ms = self.now_ms();
        self.fences
            .lease(key)
            .is_some_and(|st| st.grant.as_ref().is_some_and(|g| g.token() == token && g.deadline_ms > now_ms))
            .into()
    }
}

impl std::fmt::Debug for Authority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authority").field("fences", &self.fences).finish()
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
            fences,
            holders: Holders::default(),
            base: Instant::now(),
            store,
            metrics,
            limits,
            expiry: Mutex::default(),
            expiry_wake: Notify::new(),
            next_waiter: AtomicU64::new(1),
            expiry_lines: Mutex::default(),
        });
        // Strict routes ask this authority whether a grant is live.
        let liveness: std::sync::Weak<dyn crate::fence::GrantLiveness> =
            Arc::downgrade(&auth) as std::sync::Weak<dyn crate::fence::GrantLiveness>;
        auth.fences.derive_liveness_from(liveness);
        let now = auth.deadline_base();
        for (key, rec) in auth.store.grants()? {
            let Some(lease_id) = LeaseId::parse(&rec.lease_id) else {
                // Only this gateway writes lease ids, always in this form:
                // a record that is not is left to lapse.
                tracing::warn!(key = %key, token = rec.token, "stored grant with a malformed lease id; not restored");
                continue;
            };
            // Live again if its token is still the fence (else a newer
            // fence superseded it).
            let Some(mut slot) = auth.fences.existing_lease_slot(&key).filter(|s| s.fence() == rec.token) else {
                continue;
            };
            let Some(mut grant) = Grant::new(rec.token, lease_id, auth.holders.intern(&rec.holder), rec.ttl_ms, now)
            else {
                tracing::warn!(key = %key, "stored grant with token 0; not restored");
                continue;
            };
            grant.set_durable();
            let deadline_ms = grant.deadline_ms;
            let key = slot.key().clone();
            let st = slot.state();
            st.grant = Some(grant);
            auth.schedule_expiry(&key, st, deadline_ms);
            auth.metrics.leases_active.inc();
        }
        Ok(auth)
    }

    /// Milliseconds since this authority was made, rounded down: a grant
    /// is due when its deadline is at or before this.
    fn now_ms(&self) -> u64 {
        millis(self.base.elapsed())
    }

    /// The time a new deadline counts from: now, rounded up, so that a
    /// lease never ends before its full TTL has passed.
    fn deadline_base(&self) -> u64 {
        let elapsed = self.base.elapsed();
        let floor = millis(elapsed);
        if elapsed.subsec_nanos() % 1_000_000 == 0 {
            floor
        } else {
            floor.saturating_add(1)
        }
    }

    /// The instant of `ms` on this authority's clock (a TTL read from disk
    /// may be anything: past what an `Instant` can hold is "in a year").
    fn instant_at(&self, ms: u64) -> Instant {
        self.base
            .checked_add(Duration::from_millis(ms))
            .unwrap_or_else(|| Instant::now() + Duration::from_secs(365 * 24 * 3600))
    }

    /// The fence table this authority installs fences into.
    pub fn fences(&self) -> &Arc<FenceTable> {
        &self.fences
    }

    /// Number of live grants.
    pub fn live_grants(&self) -> usize {
        let mut n = 0;
        self.fences.for_each_lease(|_, st| n += usize::from(st.grant.is_some()));
        n
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
        let lease_id = LeaseId::new()?;

        // Take the lock at once, or join the queue.
        let (key, step) = {
            let mut slot = self.fences.lease_slot(&req.key);
            // The map's copy of the key (one for the fence and the grant).
            let key = slot.key().clone();
            let now_ms = self.now_ms();
            self.expire_if_due(&key, slot.state(), now_ms);
            if slot.state().is_free() {
                let issued = self.install(&mut slot, lease_id, &holder, req.ttl_ms);
                if issued.is_err() {
                    // Nothing was installed: a slot made for this acquire
                    // (no fence: the quota refused it) is not kept.
                    drop(slot);
                    self.gc(&key);
                }
                (key, Step::Installed(issued?))
            } else if req.wait_ms == 0 || slot.state().waiter_count() >= self.limits.max_waiters_per_key {
                let retry_after_ms = slot.state().retry_after_ms(self.deadline_base());
                return Err(Error::Locked { key: req.key, retry_after_ms });
            } else {
                let st = slot.state();
                let id = self.next_waiter.fetch_add(1, Ordering::Relaxed);
                let (wake, rx) = oneshot::channel();
                st.queue_mut().waiters.push_back(Waiter { id, wake });
                self.metrics.lock_waiters.inc();
                self.schedule_urgent(&key, st);
                (key, Step::Queued(id, rx))
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
                    let retry_after_ms =
                        self.fences.lease(&key).map_or(0, |st| st.retry_after_ms(self.deadline_base()));
                    self.gc(&key);
                    return Err(Error::Locked { key: req.key, retry_after_ms });
                }
                let mut slot = self.fences.lease_slot(&key);
                let st = slot.state();
                if st.handoff() != Some(id) {
                    return Err(Error::Internal(format!("waiter on {key} woken without the hand-off")));
                }
                st.queue_mut().handoff = None;
                st.tidy();
                guard.armed = false;
                self.metrics.lock_wait.with_label_values(&["granted"]).observe(waited);
                let issued = self.install(&mut slot, lease_id, &holder, req.ttl_ms);
                if issued.is_err() {
                    // No token was issued (the key has a fence, so not the
                    // quota: the token space): the turn passes on.
                    self.wake_next(slot.state());
                }
                issued?
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
        // Answered only if it is still the client's: activation may outlast
        // the TTL (review finding: an expired grant was answered with its
        // full TTL while another client already held the key). The answer
        // promises only the time left.
        let now = self.deadline_base();
        let left = self
            .fences
            .lease(&key)
            .and_then(|st| st.grant.as_ref().filter(|g| g.token() == token).map(|g| g.deadline_ms.saturating_sub(now)));
        let ttl_ms = match left {
            // No wait worth the name: the TTL asked for, as always.
            Some(ms) if ms + ACTIVATION_SLACK_MS >= req.ttl_ms => req.ttl_ms,
            Some(ms) if ms > 0 => ms,
            _ => {
                return Err(Error::Unavailable(format!(
                    "the grant of {key} expired while its activation waited for older in-flight mutations (longer \
                     than its ttl_ms {}); it was not answered: retry, with a longer ttl_ms if this repeats",
                    req.ttl_ms
                )))
            }
        };
        Ok(GrantView { key: req.key, fencing_token: token, lease_id: lease_id.to_hex(), ttl_ms, holder })
    }

    /// The grant `token` of `key` is fsynced: readers may see it now.
    fn publish_durable(&self, key: &Key, token: u64) {
        // The slot has a fence (this grant's), so it is never forgotten.
        let Some(mut slot) = self.fences.existing_lease_slot(key) else {
            return;
        };
        slot.mark_durable(token);
        if let Some(st) = slot.state_mut() {
            if let Some(g) = st.grant.as_mut().filter(|g| g.token() == token) {
                g.set_durable();
                st.publish(token);
            }
        }
    }

    /// Issues the next token to a new grant. Caller holds the key's state
    /// and has checked that it is free (or handed off to it).
    fn install(&self, slot: &mut LeaseSlot<'_>, lease_id: LeaseId, holder: &str, ttl_ms: u64) -> Result<Issued, Error> {
        let (token, durable) = slot.issue(&self.store, |k, token| {
            let record = GrantRecord { token, lease_id: lease_id.to_hex(), holder: holder.to_string(), ttl_ms };
            vec![Op::Fence { key: k.clone(), token }, Op::Grant { key: k.clone(), record }]
        })?;
        let now = self.deadline_base();
        let grant = Grant::new(token, lease_id, self.holders.intern(holder), ttl_ms, now)
            .ok_or_else(|| Error::Internal("the fence table issued token 0".into()))?;
        let deadline_ms = grant.deadline_ms;
        let key = slot.key().clone();
        let st = slot.state();
        st.grant = Some(grant);
        // Published to watchers only once durable (see `publish_durable`).
        self.schedule_expiry(&key, st, deadline_ms);
        self.schedule_urgent(&key, st);
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
        let Some(mut slot) = self.fences.existing_lease_slot(req.key.as_str()) else {
            return Err(lost());
        };
        let key = slot.key().clone();
        let fence = slot.fence();
        let now_ms = self.now_ms();
        let Some(st) = slot.state_mut() else {
            return Err(lost());
        };
        self.expire_if_due(&key, st, now_ms);
        let Some(grant) = st.grant.as_mut() else {
            return Err(lost());
        };
        if !grant.lease_id.matches(&req.lease_id) {
            return Err(lost());
        }
        if fence > grant.token() {
            // An external route on this key raised its fence past the
            // grant: every write under it is refused as stale, so the grant
            // is over (and the key free for a grant above that fence).
            self.end_locked(&key, st, Ended::Superseded);
            return Err(lost());
        }
        let Some(grant) = st.grant.as_mut() else {
            return Err(lost());
        };
        let margin_ms = grant.deadline_ms.saturating_sub(now_ms);
        let margin = Duration::from_millis(margin_ms).as_secs_f64();
        self.metrics.renew_margin.observe(margin);
        self.metrics.renew_margin_ratio.observe(margin_ms as f64 / (grant.ttl_ms() as f64).max(f64::EPSILON));
        if let Some(ttl_ms) = req.ttl_ms {
            if ttl_ms != grant.ttl_ms() {
                grant.set_ttl_ms(ttl_ms);
                // The restart TTL follows; no fsync needed (a restart
                // restores *some* full TTL either way).
                self.store.submit_lazy(vec![Op::Grant { key: key.clone(), record: grant.record() }]);
            }
        }
        let deadline_ms = self.deadline_base().saturating_add(grant.ttl_ms());
        let sooner = deadline_ms < grant.deadline_ms;
        grant.deadline_ms = deadline_ms;
        let (token, ttl_ms) = (grant.token(), grant.ttl_ms());
        if sooner {
            // A shorter TTL: the key's entries may lie after the new deadline.
            self.schedule_expiry(&key, st, deadline_ms);
            self.schedule_urgent(&key, st);
        }
        Ok(RenewView { key: req.key, fencing_token: token, ttl_ms })
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
        let Some(mut st) = self.fences.lease_mut(req.key.as_str()) else {
            return Err(not_owner());
        };
        let key = st.key().clone();
        // A lease past its deadline is over, swept or not: not the
        // caller's to release any more.
        self.expire_if_due(&key, &mut st, self.now_ms());
        match &st.grant {
            Some(g) if g.lease_id.matches(&req.lease_id) => {
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
        let now_ms = self.now_ms();
        // Time left counts from now rounded up, as deadlines do: a
        // client's estimate is never above the truth (never TTL + 1).
        let now_up = self.deadline_base();
        // Copied out under the key's lock: the interned holder name is
        // never cloned outside a grant (see `Holders::release`).
        let held = self.fences.lease(key).and_then(|st| {
            st.grant
                .as_ref()
                .filter(|g| g.durable() && g.deadline_ms > now_ms)
                .map(|g| (g.token(), g.holder().to_string(), g.deadline_ms.saturating_sub(now_up)))
        });
        Ok(match held {
            Some((token, holder, expires_in_ms)) => StatusView {
                key: key.to_string(),
                fence,
                held: true,
                fencing_token: Some(token),
                holder: Some(holder),
                expires_in_ms: Some(expires_in_ms),
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
        let rx = {
            let mut slot = self.fences.lease_slot(key);
            let key = slot.key().clone();
            let st = slot.state();
            // A grant past its deadline is over, swept or not: a watcher
            // must not be told of its token as the holder's.
            self.expire_if_due(&key, st, self.now_ms());
            let rx = st.subscribe();
            self.schedule_urgent(&key, st);
            rx
        };
        let mut w = WatchGuard { auth: self, key, rx: Some(rx) };
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
        let Some(mut st) = self.fences.lease_mut(key) else {
            return;
        };
        if st.grant.as_ref().is_some_and(|g| g.token() == token) {
            let key = st.key().clone();
            self.end_locked(&key, &mut st, why);
        }
    }

    fn expire_if_due(&self, key: &Key, st: &mut KeyState, now_ms: u64) {
        if st.grant.as_ref().is_some_and(|g| g.deadline_ms <= now_ms) {
            self.end_locked(key, st, Ended::Expired);
        }
    }

    /// Ends the current grant of a locked state and wakes the next waiter.
    fn end_locked(&self, key: &Key, st: &mut KeyState, why: Ended) {
        let Some(grant) = st.grant.take() else { return };
        let was_published = grant.durable();
        self.metrics.leases_active.dec();
        let held_ms = grant.held_ms(self.now_ms());
        self.metrics.lease_holds.observe(Duration::from_millis(held_ms).as_secs_f64());
        match why {
            Ended::Expired => {
                self.metrics.lease_expirations.inc();
                self.log_expired(key, grant.token(), grant.holder());
            }
            Ended::Released => tracing::debug!(key = %key, token = grant.token(), "lease released"),
            Ended::Superseded => {
                tracing::info!(key = %key, token = grant.token(), "lease superseded by a higher fence (external token)");
            }
            Ended::Failed => {}
        }
        let ended = grant.record();
        self.holders.release(grant.holder);
        self.store.submit_lazy(vec![Op::DropGrant { key: key.clone(), ended }]);
        if was_published {
            st.publish(0);
        }
        self.wake_next(st);
    }

    /// Logs a lease's expiry, up to [`EXPIRY_LINES_PER_SEC`] a second;
    /// the rest of that second's are counted for one summary line.
    fn log_expired(&self, key: &str, token: u64, holder: &str) {
        if !tracing::enabled!(tracing::Level::INFO) {
            return;
        }
        let (earlier, this_one) = self.expiry_lines.lock().map_or((0, false), |mut b| b.take(self.now_ms() / 1000));
        Self::log_skipped(earlier);
        if this_one {
            tracing::info!(key = %key, token, holder = %holder, "lease expired");
        }
    }

    /// Logs the summary of the expirations not logged one by one, if any
    /// (the expiry task calls it when a backlog is worked off).
    pub(crate) fn flush_expiry_lines(&self) {
        let skipped = self.expiry_lines.lock().map_or(0, |mut b| std::mem::take(&mut b.skipped));
        Self::log_skipped(skipped);
    }

    fn log_skipped(skipped: u64) {
        if skipped > 0 {
            tracing::info!(
                leases = skipped,
                "more leases expired within a second, not logged one by one \
                 (fencegate_lease_expirations_total counts every one)"
            );
        }
    }

    /// Hands the key to the first waiter still listening.
    fn wake_next(&self, st: &mut KeyState) {
        let Some(q) = st.queue.as_mut() else { return };
        while let Some(w) = q.waiters.pop_front() {
            self.metrics.lock_waiters.dec();
            if w.wake.send(()).is_ok() {
                q.handoff = Some(w.id);
                return;
            }
        }
        st.tidy();
    }

    /// Keys with a lease state (for tests).
    #[cfg(test)]
    fn state_count(&self) -> usize {
        let mut n = 0;
        self.fences.for_each_lease(|_, _| n += 1);
        n
    }

    /// Drops the state of a key nobody holds, waits for or watches.
    fn gc(&self, key: &str) {
        self.fences.forget_lease_if(key, KeyState::is_idle);
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
    key: Key,
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
    key: Key,
    id: u64,
    armed: bool,
}

impl Drop for WaiterGuard<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Some(mut st) = self.auth.fences.lease_mut(&self.key) else {
            return;
        };
        if st.handoff() == Some(self.id) {
            st.queue_mut().handoff = None;
            self.auth.wake_next(&mut st);
        } else if let Some(q) = st.queue.as_mut() {
            if let Some(pos) = q.waiters.iter().position(|w| w.id == self.id) {
                q.waiters.remove(pos);
                self.auth.metrics.lock_waiters.dec();
            }
        }
        st.tidy();
    }
}

#[cfg(test)]
mod tests;
