//! The in-memory fence table: per key, the fence and the mutations in
//! flight under each token, and the embedded authority's lease state of the
//! key in the same slot (one map for both, [`LeaseSlot`]). Whether the grant
//! behind a fence is live is asked of the authority that issued it
//! ([`GrantLiveness`]), outside the slot's lock.
//!
//! Every operation takes the key's shard lock for a few instructions and
//! never across an `.await`. The compare and the registration of a request
//! as in flight are one step under that lock ([`FenceTable::admit`]), so no
//! grant can slip between a request's check and its registration: either
//! the request is registered before the fence moves (and the grant's
//! activation barrier waits for it), or it sees the new fence and is
//! refused.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use dashmap::mapref::one::{MappedRef, MappedRefMut, RefMut};
use dashmap::DashMap;
use futures_util::task::AtomicWaker;
use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;

use super::{GrantLiveness, Key, Liveness};
use crate::error::Error;
use crate::store::{FenceRecord, Op, Store};

/// How a route judges tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckPolicy {
    /// Refuse `token == fence` once its grant has ended.
    pub strict: bool,
    /// Tokens come from another authority: a higher token advances the fence.
    pub external: bool,
    /// External routes: the largest step a token may take above the fence
    /// (a token of `u64::MAX` would otherwise fence the key out for good).
    pub max_step: u64,
}

impl CheckPolicy {
    /// A route of the embedded authority.
    pub const fn embedded(strict: bool) -> CheckPolicy {
        CheckPolicy { strict, external: false, max_step: 0 }
    }
}

/// Why a token was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// `token < fence`. `superseded_for`: time since the fence last moved
    /// (a lower bound of how long this token's holder has been a zombie).
    Stale { token: u64, fence: u64, superseded_for: Duration },
    /// `token > fence` on an embedded route (or `0` on a fresh key).
    Unissued { token: u64, fence: u64 },
    /// `token == fence` but its grant was released or expired (strict).
    LeaseExpired { token: u64 },
    /// External route: `token` is more than the route's `max_token_step`
    /// above the fence.
    TooFar { token: u64, fence: u64, max_step: u64 },
    /// `token == fence` with an `X-Fencing-Sequence` not above the highest
    /// one already forwarded under this token.
    StaleSequence { token: u64, sequence: u64, last_sequence: u64 },
    /// A new key would pass the gateway's `max_fences`.
    NoRoom { limit: usize },
    /// Cluster mode: this gateway cannot prove its fences are current (its
    /// membership lease may have lapsed, or its watch may be behind).
    NotCurrent { why: &'static str },
}

impl Refusal {
    /// The client-facing error for this refusal.
    pub fn into_error(self, key: &str) -> Error {
        let key = key.to_string();
        match self {
            Refusal::Stale { token, fence, .. } => Error::StaleFencingToken { key, token, fence },
            Refusal::Unissued { token, fence } => Error::UnissuedFencingToken { key, token, fence },
            Refusal::LeaseExpired { token } => Error::LeaseExpired { key, token },
            Refusal::TooFar { token, fence, max_step } => Error::TokenStepTooLarge { key, token, fence, max_step },
            Refusal::StaleSequence { token, sequence, last_sequence } => {
                Error::StaleSequence { key, token, sequence, last_sequence }
            }
            Refusal::NoRoom { limit } => Error::FenceQuota { scope: "gateway", limit },
            Refusal::NotCurrent { why } => Error::NotCurrent(why.to_string()),
        }
    }
}

/// What [`FenceTable::admit`] decided for an admissible token.
#[derive(Debug)]
pub enum Admission {
    /// Registered as in flight; forward it while holding the guard.
    Admitted(InflightGuard),
    /// A sequenced mutation, registered as in flight: forward it (holding
    /// the guard) only once the receiver says its sequence is durable.
    AdmittedAfter(InflightGuard, oneshot::Receiver<Result<(), Error>>),
    /// External route, `token > fence` (or `token == fence` whose advance
    /// is not durable yet): call [`FenceTable::advance`].
    MustAdvance,
}

/// Shared between an in-flight mutation and the table: lets activation
/// abort an upload whose body is still streaming.
#[derive(Debug, Default)]
pub struct InflightCtl {
    aborted: AtomicBool,
    body_done: AtomicBool,
    waker: AtomicWaker,
}

impl InflightCtl {
    /// True once a newer fence aborted this upload.
    pub fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::Acquire)
    }
    /// Registers the body task to be woken on abort.
    pub fn register(&self, waker: &std::task::Waker) {
        self.waker.register(waker);
    }
    /// The whole request body reached the upstream: no longer abortable.
    pub fn mark_body_done(&self) {
        self.body_done.store(true, Ordering::Release);
    }
    /// Cuts the upload off as a newer fence would (the exchange gave up on
    /// it); false when its body had already been handed over whole.
    pub fn abort(&self) -> bool {
        self.abort_if_streaming()
    }
    fn abort_if_streaming(&self) -> bool {
        if self.body_done.load(Ordering::Acquire) {
            return false;
        }
        self.aborted.store(true, Ordering::Release);
        self.waker.wake();
        true
    }
}

struct InflightEntry {
    token: u64,
    /// Its `X-Fencing-Sequence`, if it has one.
    sequence: Option<u64>,
    id: u64,
    ctl: Arc<InflightCtl>,
}

/// Milliseconds on one process-wide monotonic clock, plus one (0 means
/// "never"): 8 bytes per slot where an `Option<Instant>` took 16.
fn clock_ms() -> u64 {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    u64::try_from(Instant::now().saturating_duration_since(epoch).as_millis()).unwrap_or(u64::MAX - 1) + 1
}

/// What a key has only while mutations are in flight on it, or once a
/// sequenced write was forwarded under its fence: boxed, so that a key
/// with none of it (nearly every key) pays one null pointer.
#[derive(Default)]
struct Rare {
    entries: Vec<InflightEntry>,
    barrier: Option<Arc<Notify>>,
    /// The highest `X-Fencing-Sequence` admitted under the fence. A raise
    /// of the fence starts a new sequence.
    sequence: Option<u64>,
}

impl Rare {
    fn is_empty(&self) -> bool {
        self.entries.is_empty() && self.barrier.is_none() && self.sequence.is_none()
    }
}

/// `Slot::state`: the slot counts against the fence quota (made for a
/// fence; a slot the authority made for a key only watched does not, until
/// a grant issues it a fence).
const COUNTED: u64 = 1 << 63;
/// `Slot::state`: the fence was set by an external authority's token: no
/// grant of this gateway stands behind it, so embedded routes never admit it.
const EXTERNAL: u64 = 1 << 62;
/// `Slot::state`: when the fence last moved ([`clock_ms`]; 0: not since the start).
const MOVED_MS: u64 = (1 << 62) - 1;

/// The embedded lease authority's state of a key, kept in the key's slot:
/// one map, one bucket and one lock for a key's fence and its grant
/// (issue 18: a second map cost ~35 bytes of buckets per held lease).
pub(crate) use crate::authority::KeyState as LeaseState;

/// A key's lease state, read-locked ([`FenceTable::lease`]).
pub(crate) type LeaseRef<'a> = MappedRef<'a, Key, Box<Slot>, LeaseState>;
/// A key's lease state, write-locked ([`FenceTable::lease_mut`]).
pub(crate) type LeaseMut<'a> = MappedRefMut<'a, Key, Box<Slot>, LeaseState>;

/// One key's fence and, if the embedded authority has anything for the
/// key, its lease state: 40 bytes (`size_of`), boxed.
#[derive(Default)]
pub(crate) struct Slot {
    /// The highest token granted or accepted: older tokens are refused.
    fence: u64,
    /// The highest fence known to be fsynced. No request is admitted with
    /// a token above it (a crash would bring back the older fence, and the
    /// token could be issued again).
    durable: u64,
    /// [`COUNTED`], [`EXTERNAL`] and [`MOVED_MS`] in one word.
    state: u64,
    rare: Option<Box<Rare>>,
    /// The embedded authority's grant, waiters and watchers of the key
    /// (null in cluster mode and for keys it has nothing for).
    lease: Option<Box<LeaseState>>,
}

impl Slot {
    fn counted(&self) -> bool {
        self.state & COUNTED != 0
    }

    /// Nothing to keep: no fence (so never issued one), nothing in flight,
    /// no lease state: a slot made for a watch that ended, or for a first
    /// fence that was refused.
    fn is_empty(&self) -> bool {
        self.fence == 0 && !self.counted() && self.rare.is_none() && self.lease.is_none()
    }

    fn external(&self) -> bool {
        self.state & EXTERNAL != 0
    }

    fn set_external(&mut self, external: bool) {
        self.state = if external { self.state | EXTERNAL } else { self.state & !EXTERNAL };
    }

    fn last_sequence(&self) -> Option<u64> {
        self.rare.as_ref().and_then(|r| r.sequence)
    }

    fn set_last_sequence(&mut self, seq: Option<u64>) {
        match (seq, self.rare.as_mut()) {
            (None, None) => {}
            (None, Some(rare)) => {
                rare.sequence = None;
                if rare.is_empty() {
                    self.rare = None;
                }
            }
            (Some(_), _) => self.rare.get_or_insert_with(Box::default).sequence = seq,
        }
    }

    /// How long ago the fence last moved (zero if not since the start).
    fn superseded_for(&self) -> Duration {
        let moved = self.state & MOVED_MS;
        if moved == 0 {
            return Duration::ZERO;
        }
        Duration::from_millis(clock_ms().saturating_sub(moved))
    }

    fn entries(&self) -> &[InflightEntry] {
        self.rare.as_deref().map_or(&[], |r| r.entries.as_slice())
    }

    /// Raises the fence and aborts older uploads still streaming.
    fn raise(&mut self, token: u64) {
        self.fence = token;
        self.set_last_sequence(None);
        self.state = (self.state & !MOVED_MS) | (clock_ms() & MOVED_MS);
        for e in self.entries().iter().filter(|e| e.token < token) {
            e.ctl.abort_if_streaming();
        }
    }

    /// Takes `seq` as the highest sequence under the current token, and
    /// aborts this holder's lower-numbered uploads still streaming.
    fn take_sequence(&mut self, token: u64, seq: u64) -> Result<(), Refusal> {
        if let Some(last) = self.last_sequence().filter(|l| seq <= *l) {
            return Err(Refusal::StaleSequence { token, sequence: seq, last_sequence: last });
        }
        self.set_last_sequence(Some(seq));
        for e in self.entries().iter().filter(|e| e.token == token && e.sequence.is_some_and(|s| s < seq)) {
            e.ctl.abort_if_streaming();
        }
        Ok(())
    }

    /// The store write that makes the current fence durable, with its
    /// sequence if it has one (a plain fence write would erase it).
    fn fence_op(&self, key: Key) -> Op {
        let sequence = self.last_sequence();
        if sequence.is_none() && !self.external() {
            return Op::Fence { key, token: self.fence };
        }
        let record = FenceRecord { token: self.fence, sequence, external: self.external() };
        Op::FenceWith { key, record }
    }

    fn set_entry_sequence(&mut self, id: u64, seq: u64) {
        if let Some(e) = self.rare.as_mut().and_then(|r| r.entries.iter_mut().find(|e| e.id == id)) {
            e.sequence = Some(seq);
        }
    }

    fn register(&mut self, token: u64, id: u64, total: &AtomicUsize) -> Arc<InflightCtl> {
        let ctl = Arc::new(InflightCtl::default());
        let rare = self.rare.get_or_insert_with(Box::default);
        rare.entries.push(InflightEntry { token, sequence: None, id, ctl: ctl.clone() });
        // SeqCst: see `Currency::recheck`.
        total.fetch_add(1, Ordering::SeqCst);
        ctl
    }
}

/// Bytes of a [`FenceTable`], by part ([`FenceTable::footprint`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TableFootprint {
    pub keys: usize,
    /// The map's buckets (a key pointer and a slot pointer each, plus one
    /// control byte), full or not.
    pub map: usize,
    /// The boxed slots.
    pub slots: usize,
    /// The keys' own blocks (one per key, for the fence and the grant).
    pub key_bytes: usize,
    /// In-flight registrations and stored sequences.
    pub inflight: usize,
}

/// How the activation barrier ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BarrierOutcome {
    /// Time spent waiting for older in-flight mutations.
    pub waited: Duration,
    /// The timeout passed with older mutations still in flight.
    pub overrun: bool,
}

/// Per key: the fence and the in-flight mutations.
pub struct FenceTable {
    /// Boxed: at the map's usual load (a half to seven eighths of its
    /// buckets full) an 8-byte bucket value wastes less than a 48-byte one.
    slots: DashMap<Key, Box<Slot>>,
    next_id: AtomicU64,
    /// After an unclean restart: requests the dead process forwarded may
    /// still be applied by an upstream until this instant, and this table
    /// cannot see them; every barrier lasts at least until then.
    quarantine: std::sync::OnceLock<Instant>,
    /// Registered mutations across all keys, and a wake-up for
    /// [`FenceTable::wait_idle`] when the count reaches zero.
    inflight_total: AtomicUsize,
    idle: Notify,
    /// Keys with a fence, and the most there may be ([`FenceTable::set_max_fences`]).
    fence_count: AtomicUsize,
    max_fences: AtomicUsize,
    /// The next token of the embedded authority: one sequence for every
    /// key, so a token names exactly one grant of one key. At start it is
    /// above every fence on disk (every issued token was fsynced as its
    /// key's fence before anyone saw it).
    next_token: AtomicU64,
    /// Cluster mode only: mutations are admitted only while the gateway can
    /// prove its fences are current ([`Currency`]). Off in single-node mode,
    /// where the check costs one relaxed load.
    currency: Currency,
    /// Who answers whether a grant is live (strict routes): the authority
    /// over this table, set once when it is made. Weak: the authority
    /// owns the table. Unset or gone: no grant is live (fail closed).
    liveness: std::sync::OnceLock<Weak<dyn GrantLiveness>>,
}

/// Whether this gateway's view of the fences may be trusted (cluster mode):
/// a monotonic deadline, moved forward by the membership keepalive and
/// pulled back to zero the moment the etcd watch may be behind.
#[derive(Debug)]
struct Currency {
    gated: AtomicBool,
    base: Instant,
    /// Nanoseconds after `base` until which the view is current; 0: not.
    until_ns: AtomicU64,
    /// Lapses so far ([`FenceTable::set_not_current`]): a request whose
    /// check saw one count and whose recheck sees another crossed a lapse.
    lapses: AtomicU64,
    /// Why it is not current, for the refusal's message.
    why: std::sync::Mutex<&'static str>,
}

impl Currency {
    fn new() -> Currency {
        Currency {
            gated: AtomicBool::new(false),
            base: Instant::now(),
            until_ns: AtomicU64::new(0),
            lapses: AtomicU64::new(0),
            why: std::sync::Mutex::new("the gateway has not joined its cluster yet"),
        }
    }

    /// `Err` with the reason when mutations must be refused; `Ok` with the
    /// lapse count it saw, for [`Currency::recheck`].
    fn check(&self) -> Result<u64, Refusal> {
        if !self.gated.load(Ordering::Relaxed) {
            return Ok(0);
        }
        // Read before the deadline (SeqCst: see `Currency::recheck`).
        let lapses = self.lapses.load(Ordering::SeqCst);
        let now = u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX);
        if now < self.until_ns.load(Ordering::SeqCst) {
            return Ok(lapses);
        }
        let why = *self.why.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let why = if self.until_ns.load(Ordering::Acquire) == 0 {
            why
        } else {
            "the gateway's membership lease may have lapsed (no keepalive acknowledged in time)"
        };
        Err(Refusal::NotCurrent { why })
    }

    /// The check again, after a request was registered as in flight: a
    /// lapse that [`FenceTable::set_not_current`] recorded since the
    /// check (`seen`, the lapse count the check read) refuses it — even
    /// one the gateway has already drained and rejoined after, however
    /// long this thread stalled between the check and here. Every access
    /// is `SeqCst` (the registration's add, these loads; the lapse's
    /// stores, [`FenceTable::wait_idle`]'s load): either this load sees
    /// the lapse, or the lapse's wait sees the registration. And the
    /// lapse zeroes the deadline before it counts, and the check reads
    /// the count before the deadline, so a check that already counted a
    /// lapse also saw its deadline zeroed (or a later rejoin's). A gateway
    /// that lapsed and then found nothing in flight (and told its peers
    /// so, `cluster/member.rs`) never has a request checked before the
    /// lapse still on its way.
    fn recheck(&self, seen: u64) -> Result<(), Refusal> {
        if !self.gated.load(Ordering::Relaxed) {
            return Ok(());
        }
        if self.lapses.load(Ordering::SeqCst) == seen && self.until_ns.load(Ordering::SeqCst) != 0 {
            return Ok(());
        }
        Err(Refusal::NotCurrent { why: *self.why.lock().unwrap_or_else(std::sync::PoisonError::into_inner) })
    }
}

impl std::fmt::Debug for FenceTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FenceTable").field("keys", &self.slots.len()).finish()
    }
}

impl Default for FenceTable {
    fn default() -> Self {
        FenceTable::with_slots(DashMap::new())
    }
}

impl FenceTable {
    /// An empty table.
    pub fn new() -> Arc<FenceTable> {
        Arc::new(FenceTable::default())
    }

    /// An empty table sized for `n` keys (start-up from the store).
    pub fn with_capacity(n: usize) -> Arc<FenceTable> {
        Arc::new(FenceTable::with_slots(DashMap::with_capacity(n)))
    }

    fn with_slots(slots: DashMap<Key, Box<Slot>>) -> FenceTable {
        FenceTable {
            slots,
            next_id: AtomicU64::new(1),
            quarantine: std::sync::OnceLock::new(),
            inflight_total: AtomicUsize::new(0),
            idle: Notify::new(),
            next_token: AtomicU64::new(1),
            fence_count: AtomicUsize::new(0),
            max_fences: AtomicUsize::new(usize::MAX),
            currency: Currency::new(),
            liveness: std::sync::OnceLock::new(),
        }
    }

    /// Cluster mode: from now on mutations are admitted only while
    /// [`FenceTable::set_current_until`] says the view is current.
    pub fn gate_on_currency(&self) {
        self.currency.gated.store(true, Ordering::Release);
    }

    /// Cluster mode: the view is current until `until` (a monotonic
    /// deadline derived from the last acknowledged keepalive).
    pub fn set_current_until(&self, until: Instant) {
        let ns = u64::try_from(until.saturating_duration_since(self.currency.base).as_nanos()).unwrap_or(u64::MAX);
        self.currency.until_ns.store(ns.max(1), Ordering::Release);
    }

    /// Cluster mode: the view is not current (`why`) until the next
    /// [`FenceTable::set_current_until`]. Uploads still streaming are
    /// aborted: a forward whose body has not been sent must not complete
    /// on a view that may be stale.
    pub fn set_not_current(&self, why: &'static str) {
        *self.currency.why.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = why;
        self.currency.until_ns.store(0, Ordering::SeqCst);
        // After the deadline is zeroed (see `Currency::recheck`).
        self.currency.lapses.fetch_add(1, Ordering::SeqCst);
        self.abort_streaming();
    }

    /// True when mutations may be admitted (always, outside cluster mode).
    pub fn is_current(&self) -> bool {
        self.currency.check().is_ok()
    }

    /// Aborts every admitted upload whose body is still streaming.
    pub fn abort_streaming(&self) {
        for slot in &self.slots {
            for e in slot.entries() {
                e.ctl.abort_if_streaming();
            }
        }
    }

    /// The authority that answers whether a grant is live (set once; a
    /// second call is ignored).
    pub fn derive_liveness_from(&self, source: Weak<dyn GrantLiveness>) {
        let _ = self.liveness.set(source);
    }

    /// Whether the grant behind `token` is live, as its authority says
    /// (ended when there is no authority).
    fn grant_liveness(&self, key: &str, token: u64) -> Liveness {
        self.liveness.get().and_then(Weak::upgrade).map_or(Liveness::Ended, |source| source.liveness(key, token))
    }

    /// Cluster mode: installs a fence the shared authority issued (read
    /// from etcd, so durable). Raises the fence if `token` is above it
    /// (aborting older uploads still streaming). A fence never moves down:
    /// after an etcd restore a lower stored fence is ignored. Refused only
    /// by the fence quota.
    pub fn install(&self, key: &str, token: u64) -> Result<(), Error> {
        let mut slot = self.slot_or_new(key).map_err(|limit| Error::FenceQuota { scope: "gateway", limit })?;
        if token > slot.fence {
            slot.raise(token);
            slot.set_external(false);
        }
        if slot.fence > slot.durable {
            slot.durable = slot.fence;
        }
        drop(slot);
        self.next_token.fetch_max(token.saturating_add(1), Ordering::AcqRel);
        Ok(())
    }

    /// The most keys that may have a fence: a grant or an external advance
    /// that would fence one more key is refused beyond it. A fence can
    /// never be forgotten while a holder of an older token may still write
    /// (the oldest token would pass again), so growth is bounded here,
    /// before it happens.
    pub fn set_max_fences(&self, max: usize) {
        self.max_fences.store(max, Ordering::Release);
    }

    /// Calls `f` for every key with a fence (start-up accounting).
    pub fn for_each_key(&self, mut f: impl FnMut(&str)) {
        for slot in self.slots.iter().filter(|s| s.counted()) {
            f(slot.key());
        }
    }

    /// The slot of `key`, made if the quota allows one more (and counted
    /// if the authority made it for a watch).
    fn slot_or_new(&self, key: &str) -> Result<RefMut<'_, Key, Box<Slot>>, usize> {
        if let Some(mut slot) = self.slots.get_mut(key) {
            self.count(&mut slot)?;
            return Ok(slot);
        }
        match self.slots.entry(Key::from(key)) {
            dashmap::Entry::Occupied(o) => {
                let mut slot = o.into_ref();
                self.count(&mut slot)?;
                Ok(slot)
            }
            dashmap::Entry::Vacant(v) => {
                self.take_quota()?;
                Ok(v.insert(Box::new(Slot { state: COUNTED, ..Slot::default() })))
            }
        }
    }

    /// Counts `slot` against the fence quota if it is not yet (a slot the
    /// authority made for a watch, about to get a fence).
    fn count(&self, slot: &mut Slot) -> Result<(), usize> {
        if !slot.counted() {
            self.take_quota()?;
            slot.state |= COUNTED;
        }
        Ok(())
    }

    /// A slot counted for a fence that it did not get (refused, or no
    /// token left): its unit of the quota goes back, and the slot too if
    /// it holds nothing else (review finding: each failed first issue kept
    /// its unit until a restart).
    fn give_back(&self, mut slot: RefMut<'_, Key, Box<Slot>>) {
        self.uncount_unfenced(&mut slot);
        if slot.is_empty() {
            let key = slot.key().clone();
            drop(slot);
            self.slots.remove_if(&key, |_, s| s.is_empty());
        }
    }

    fn uncount_unfenced(&self, slot: &mut Slot) {
        if slot.fence == 0 && slot.counted() {
            slot.state &= !COUNTED;
            self.fence_count.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// One more key with a fence, if the quota allows it.
    fn take_quota(&self) -> Result<(), usize> {
        let max = self.max_fences.load(Ordering::Acquire);
        if self.fence_count.fetch_add(1, Ordering::AcqRel) >= max {
            self.fence_count.fetch_sub(1, Ordering::AcqRel);
            return Err(max);
        }
        Ok(())
    }

    /// What the table holds in memory, by part (an account from the sizes
    /// of its types and its maps' capacities; allocator rounding aside).
    /// Walks every key: for diagnostics and benchmarks, not a hot path.
    pub fn footprint(&self) -> TableFootprint {
        let bucket = std::mem::size_of::<(Key, Box<Slot>)>() + 1;
        let mut key_bytes = 0;
        let mut inflight = 0;
        for slot in &self.slots {
            // A `Key`'s block: its length, its count and the bytes.
            key_bytes += 16 + slot.key().len();
            if let Some(r) = &slot.rare {
                inflight += std::mem::size_of::<Rare>() + r.entries.capacity() * std::mem::size_of::<InflightEntry>();
            }
        }
        TableFootprint {
            keys: self.slots.len(),
            map: self.slots.capacity() * bucket,
            slots: self.slots.len() * std::mem::size_of::<Slot>(),
            key_bytes,
            inflight,
        }
    }

    /// After an unclean restart: every activation barrier lasts at least
    /// until `until` (set once, at start).
    pub fn set_quarantine(&self, until: Instant) {
        let _ = self.quarantine.set(until);
    }

    /// Installs a fence read from the store at start (durable, not live);
    /// the next token issued is above it.
    pub fn load(&self, key: &str, fence: u64) {
        let slot = Box::new(Slot { fence, durable: fence, state: COUNTED, ..Slot::default() });
        if self.slots.insert(Key::from(key), slot).is_none() {
            self.fence_count.fetch_add(1, Ordering::AcqRel);
        }
        self.next_token.fetch_max(fence.saturating_add(1), Ordering::AcqRel);
    }

    /// Installs a stored fence with its highest sequence, if any.
    pub fn load_record(&self, key: &str, record: FenceRecord) {
        self.load(key, record.token);
        if let Some(mut slot) = self.slots.get_mut(key) {
            slot.set_last_sequence(record.sequence);
            slot.set_external(record.external);
        }
    }

    /// Takes the next token of the one sequence, above `fence` (a key whose
    /// fence an external route raised past the sequence).
    fn take_token(&self, fence: u64) -> Option<u64> {
        let floor = fence.checked_add(1)?;
        let mut current = self.next_token.load(Ordering::Acquire);
        loop {
            let token = current.max(floor);
            let next = token.checked_add(1)?;
            match self.next_token.compare_exchange_weak(current, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Some(token),
                Err(seen) => current = seen,
            }
        }
    }

    /// Number of keys with a fence.
    pub fn len(&self) -> usize {
        self.fence_count.load(Ordering::Acquire)
    }

    /// True when no key has a fence.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The current fence of `key` (0: never fenced).
    pub fn fence(&self, key: &str) -> u64 {
        self.slots.get(key).map_or(0, |s| s.fence)
    }

    /// The highest `X-Fencing-Sequence` taken under `key`'s current fence.
    pub fn last_sequence(&self, key: &str) -> Option<u64> {
        self.slots.get(key).and_then(|s| s.last_sequence())
    }

    /// The highest fence of `key` known to be fsynced: what a crash now
    /// would leave, and all that readers (status, watch) are shown.
    pub fn durable_fence(&self, key: &str) -> u64 {
        self.slots.get(key).map_or(0, |s| s.durable)
    }

    /// Records that the store has fsynced `key`'s fence at `token` (and,
    /// since the store writes each key in order, every fence before it).
    pub fn mark_durable(&self, key: &str, token: u64) {
        if let Some(mut slot) = self.slots.get_mut(key) {
            if token <= slot.fence && token > slot.durable {
                slot.durable = token;
            }
        }
    }

    /// The fence check of docs/proxy.md and, when it passes, the registration of
    /// the request as in flight — one atomic step per key.
    pub fn admit(self: &Arc<Self>, key: &str, token: u64, policy: CheckPolicy) -> Result<Admission, Refusal> {
        let lapses = self.currency.check()?;
        // Asked before the slot is locked: the authority takes its own lock
        // and, when it grants, takes this table's (never the other way
        // round). A grant that ends between this answer and the admission
        // is no different from one that ends just after it.
        let live = if !policy.strict || policy.external { Liveness::Live } else { self.grant_liveness(key, token) };
        let Some(mut slot) = self.slots.get_mut(key) else {
            // Never fenced: fence 0. Nothing was ever issued for this key.
            if policy.external && token > 0 {
                return check_step(token, 0, policy).map(|()| Admission::MustAdvance);
            }
            return Err(Refusal::Unissued { token, fence: 0 });
        };
        let fence = slot.fence;
        if token < fence {
            let superseded_for = slot.superseded_for();
            return Err(Refusal::Stale { token, fence, superseded_for });
        }
        if token > fence {
            if policy.external {
                return check_step(token, fence, policy).map(|()| Admission::MustAdvance);
            }
            return Err(Refusal::Unissued { token, fence });
        }
        if fence == 0 || (slot.external() && !policy.external) {
            // An external authority's token: this gateway issued no grant
            // for it, so on an embedded route it is unissued here (it may
            // well be another key's embedded token).
            return Err(Refusal::Unissued { token, fence });
        }
        if token > slot.durable {
            // The fence moved to this token but its fsync is pending: a
            // crash now would bring back the older fence. External routes
            // wait for it; on embedded ones nobody was told this token yet.
            if policy.external {
                return Ok(Admission::MustAdvance);
            }
            return Err(Refusal::Unissued { token, fence: slot.durable });
        }
        match live {
            Liveness::Live => {}
            Liveness::Ended => return Err(Refusal::LeaseExpired { token }),
            Liveness::Unsure(why) => return Err(Refusal::NotCurrent { why }),
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let ctl = slot.register(token, id, &self.inflight_total);
        let key = slot.key().clone();
        drop(slot);
        let guard = InflightGuard { table: self.clone(), key, token, sequence: None, id, ctl };
        // Dropping the guard takes the registration back.
        self.currency.recheck(lapses)?;
        Ok(Admission::Admitted(guard))
    }

    /// All-or-nothing admission of a request that changes several keys
    /// (`DeleteObjects`, `RenameObject`): each `(key, token)` is checked
    /// and registered as in flight as by [`FenceTable::admit`] — one atomic
    /// step per key — in sorted key order (duplicates once). If any key is
    /// refused, every registration already made is dropped before this
    /// returns and the refusal is returned with that key's index: the
    /// request is forwarded with every key registered, or not at all. A
    /// registration that is dropped again only ever delays a grant's
    /// barrier; it never lets an older token through.
    ///
    /// External routes: a key whose token must first advance the fence is
    /// returned as [`Admission::MustAdvance`] for the caller to advance.
    pub fn admit_all(
        self: &Arc<Self>,
        keys: &[(&str, u64)],
        policy: CheckPolicy,
    ) -> Result<Vec<(usize, Admission)>, (usize, Refusal)> {
        let mut order: Vec<usize> = (0..keys.len()).collect();
        order.sort_by(|a, b| keys[*a].0.cmp(keys[*b].0));
        order.dedup_by(|a, b| keys[*a].0 == keys[*b].0);
        let mut admitted = Vec::with_capacity(order.len());
        for i in order {
            let (key, token) = keys[i];
            match self.admit(key, token, policy) {
                Ok(a) => admitted.push((i, a)),
                // `admitted` drops here: every registration is undone.
                Err(refusal) => return Err((i, refusal)),
            }
        }
        Ok(admitted)
    }

    /// [`FenceTable::admit`] for a mutation that carries `X-Fencing-Sequence:
    /// sequence`: admissible only if the sequence is above the highest one
    /// forwarded under the current token, which it then becomes — in memory
    /// at once (so a later request with a lower sequence is refused even
    /// while this one waits) and durably before the request may be
    /// forwarded: the receiver of [`Admission::AdmittedAfter`] resolves once
    /// the store has fsynced it. A request whose token must first advance
    /// the fence (external routes) gets [`Admission::MustAdvance`] and
    /// passes its sequence to [`FenceTable::advance`].
    pub fn admit_sequenced(
        self: &Arc<Self>,
        key: &str,
        token: u64,
        sequence: u64,
        policy: CheckPolicy,
        store: &Store,
    ) -> Result<Admission, Refusal> {
        // The token rules first, exactly as for an unsequenced request.
        let guard = match self.admit(key, token, policy)? {
            Admission::Admitted(guard) => guard,
            other => return Ok(other),
        };
        let Some(mut slot) = self.slots.get_mut(key) else {
            return Err(Refusal::Unissued { token, fence: 0 });
        };
        if slot.fence != token {
            // The fence moved between the two steps: as if it had moved
            // just before the check.
            let superseded_for = slot.superseded_for();
            return Err(Refusal::Stale { token, fence: slot.fence, superseded_for });
        }
        slot.take_sequence(token, sequence)?;
        slot.set_entry_sequence(guard.id, sequence);
        let durable = store.submit(vec![slot.fence_op(slot.key().clone())]);
        drop(slot);
        let mut guard = guard;
        guard.sequence = Some(sequence);
        Ok(Admission::AdmittedAfter(guard, durable))
    }

    /// External authority: raises the fence of `key` to `token`, submits it
    /// to the store (while the slot is locked, so per-key durable order is
    /// in-memory order), and registers the request as in flight. The caller
    /// must wait for the returned receiver (durability), report it with
    /// [`FenceTable::mark_durable`], and then wait for
    /// [`FenceTable::barrier`] before forwarding.
    ///
    /// A token equal to a fence whose fsync is still pending submits the
    /// same fence again: the store writes a key's fences in order, so this
    /// request's own receiver resolves only once that fence is durable.
    #[allow(clippy::type_complexity)]
    pub fn advance(
        self: &Arc<Self>,
        key: &str,
        token: u64,
        sequence: Option<u64>,
        policy: CheckPolicy,
        store: &Store,
    ) -> Result<(InflightGuard, Option<oneshot::Receiver<Result<(), Error>>>), Refusal> {
        let lapses = self.currency.check()?;
        let mut slot = self.slot_or_new(key).map_err(|limit| Refusal::NoRoom { limit })?;
        if token < slot.fence {
            let superseded_for = slot.superseded_for();
            return Err(Refusal::Stale { token, fence: slot.fence, superseded_for });
        }
        if token > slot.fence {
            if let Err(refusal) = check_step(token, slot.fence, policy) {
                self.give_back(slot);
                return Err(refusal);
            }
            // No lease stands behind an external token: a strict embedded
            // route on the same key refuses it (lease_expired), and the
            // embedded sequence moves past it, so no grant of another key
            // is ever issued this number.
            slot.raise(token);
            slot.set_external(true);
            self.next_token.fetch_max(token.saturating_add(1), Ordering::AcqRel);
        }
        if let Some(seq) = sequence {
            slot.take_sequence(token, seq)?;
        }
        let key_ref = slot.key().clone();
        // The fence's record carries its sequence, if any: a plain fence
        // write here would erase a sequence another request just took.
        let durable = (sequence.is_some() || token > slot.durable).then(|| store.submit(vec![slot.fence_op(key_ref)]));
        let key_arc = slot.key().clone();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let ctl = slot.register(token, id, &self.inflight_total);
        if let Some(seq) = sequence {
            slot.set_entry_sequence(id, seq);
        }
        drop(slot);
        let guard = InflightGuard { table: self.clone(), key: key_arc, token, sequence, id, ctl };
        // Dropping the guard takes the registration back.
        self.currency.recheck(lapses)?;
        Ok((guard, durable))
    }

    /// Embedded authority: issues the next token of the one sequence (above
    /// `key`'s fence), installs it as the fence, aborts older uploads
    /// still streaming, and submits `ops(token)` to the store under the
    /// slot lock. Tokens are unique across keys, so `token == fence` proves
    /// a token was issued for this key.
    pub fn issue(
        &self,
        key: &str,
        store: &Store,
        ops: impl FnOnce(&Key, u64) -> Vec<Op>,
    ) -> Result<(u64, oneshot::Receiver<Result<(), Error>>), Error> {
        let mut slot = self.slot_or_new(key).map_err(|limit| Error::FenceQuota { scope: "gateway", limit })?;
        let issued = self.issue_locked(&mut slot, store, ops);
        if issued.is_err() {
            self.give_back(slot);
        }
        issued
    }

    /// [`FenceTable::issue`] on a slot already locked and counted.
    fn issue_locked(
        &self,
        slot: &mut RefMut<'_, Key, Box<Slot>>,
        store: &Store,
        ops: impl FnOnce(&Key, u64) -> Vec<Op>,
    ) -> Result<(u64, oneshot::Receiver<Result<(), Error>>), Error> {
        let Some(token) = self.take_token(slot.fence) else {
            self.uncount_unfenced(slot);
            return Err(Error::Internal("token space exhausted".into()));
        };
        slot.raise(token);
        slot.set_external(false);
        let durable = store.submit(ops(slot.key(), token));
        Ok((token, durable))
    }

    /// The activation barrier: waits until no mutation with a token older
    /// than `token` is in flight for `key`, or `timeout` passes.
    pub async fn barrier(&self, key: &str, token: u64, timeout: Duration) -> BarrierOutcome {
        self.barrier_for(key, token, None, timeout).await
    }

    /// [`FenceTable::barrier`] for a sequenced mutation: it also waits for
    /// the same holder's lower-numbered mutations still in flight (same
    /// token, lower `X-Fencing-Sequence`), so a holder's writes reach the
    /// upstream in the order of their numbers. After an unclean restart it
    /// waits out the quarantine too: writes the dead process forwarded
    /// cannot be seen here.
    pub async fn barrier_for(&self, key: &str, token: u64, sequence: Option<u64>, timeout: Duration) -> BarrierOutcome {
        let older = move |e: &InflightEntry| {
            e.token < token || (e.token == token && sequence.is_some_and(|n| e.sequence.is_some_and(|s| s < n)))
        };
        let started = Instant::now();
        if let Some(until) = self.quarantine.get().copied().filter(|u| *u > started) {
            // Never cut short by `timeout`: what the dead process forwarded
            // is invisible here, and the quarantine is the only wait for it
            // (it is finite: the longest upstream timeout from the start).
            tokio::time::sleep_until(until).await;
        }
        let deadline = Instant::now() + timeout;
        loop {
            let notify = {
                let Some(mut slot) = self.slots.get_mut(key) else {
                    break;
                };
                if !slot.entries().iter().any(older) {
                    break;
                }
                let rare = slot.rare.get_or_insert_with(Box::default);
                rare.barrier.get_or_insert_with(|| Arc::new(Notify::new())).clone()
            };
            let notified = notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            // Re-check after enabling: a guard may have dropped in between.
            if !self.slots.get(key).is_some_and(|s| s.entries().iter().any(older)) {
                break;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return BarrierOutcome { waited: started.elapsed(), overrun: true };
            }
        }
        BarrierOutcome { waited: started.elapsed(), overrun: false }
    }

    /// Number of mutations in flight on `key` (tests and status).
    pub fn inflight(&self, key: &str) -> usize {
        self.slots.get(key).map_or(0, |s| s.entries().len())
    }

    /// Number of mutations in flight on every key.
    pub fn inflight_total(&self) -> usize {
        // SeqCst: see `Currency::recheck`.
        self.inflight_total.load(Ordering::SeqCst)
    }

    /// Waits until no mutation is in flight on any key, or `timeout`
    /// passes; true when none is. A clean stop must not be recorded while
    /// an upstream may still apply a forwarded mutation.
    pub async fn wait_idle(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.inflight_total() == 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.inflight_total() == 0;
            }
        }
    }

    fn finish(&self, key: &str, id: u64) {
        if let Some(mut slot) = self.slots.get_mut(key) {
            let Some(rare) = slot.rare.as_mut() else { return };
            let before = rare.entries.len();
            rare.entries.retain(|e| e.id != id);
            if rare.entries.len() < before && self.inflight_total.fetch_sub(1, Ordering::AcqRel) == 1 {
                self.idle.notify_waiters();
            }
            if let Some(n) = &rare.barrier {
                n.notify_waiters();
            }
            if rare.entries.is_empty() {
                rare.barrier = None;
                // Give the memory back: across a million keys touched
                // once each, kept capacity is ~100 bytes per key.
                rare.entries = Vec::new();
                if rare.is_empty() {
                    slot.rare = None;
                }
            }
        }
    }
}

/// The embedded authority's view of the table: a key's lease state lives
/// in its slot, under the slot's lock, beside the fence a grant issues.
impl FenceTable {
    /// `key`'s slot, write-locked, made if absent (fence 0, outside the
    /// fence quota until a grant issues it a fence).
    pub(crate) fn lease_slot(&self, key: &str) -> LeaseSlot<'_> {
        if let Some(slot) = self.slots.get_mut(key) {
            return LeaseSlot { table: self, slot };
        }
        LeaseSlot { table: self, slot: self.slots.entry(Key::from(key)).or_default() }
    }

    /// `key`'s slot, write-locked, if it has one.
    pub(crate) fn existing_lease_slot(&self, key: &str) -> Option<LeaseSlot<'_>> {
        self.slots.get_mut(key).map(|slot| LeaseSlot { table: self, slot })
    }

    /// `key`'s lease state, write-locked, if it has one.
    pub(crate) fn lease_mut(&self, key: &str) -> Option<LeaseMut<'_>> {
        self.slots.get_mut(key)?.try_map(|s| s.lease.as_deref_mut()).ok()
    }

    /// `key`'s lease state, read-locked, if it has one.
    pub(crate) fn lease(&self, key: &str) -> Option<LeaseRef<'_>> {
        self.slots.get(key)?.try_map(|s| s.lease.as_deref()).ok()
    }

    /// Drops `key`'s lease state if `idle` says it holds nothing, and the
    /// slot with it if the slot holds nothing else (a key only watched).
    pub(crate) fn forget_lease_if(&self, key: &str, idle: impl FnOnce(&LeaseState) -> bool) {
        self.update_lease_then_forget_if(key, |_| true, idle);
    }

    /// Calls `f` with `key`'s lease state write-locked, if it has one; if
    /// `f` returns true, then drops the state if `idle` says it holds
    /// nothing, and the slot with it if the slot holds nothing else. One
    /// lookup of the key for both (the expiry task ends 500,000 grants in
    /// a mass expiry: a second lookup per key was a third of its map work).
    pub(crate) fn update_lease_then_forget_if(
        &self,
        key: &str,
        f: impl FnOnce(&mut LeaseState) -> bool,
        idle: impl FnOnce(&LeaseState) -> bool,
    ) {
        let empty = {
            let Some(mut slot) = self.slots.get_mut(key) else {
                return;
            };
            if let Some(st) = slot.lease.as_deref_mut() {
                if !f(st) {
                    return;
                }
            }
            if slot.lease.as_deref().is_some_and(idle) {
                slot.lease = None;
            }
            slot.is_empty()
        };
        if empty {
            self.slots.remove_if(key, |_, s| s.is_empty());
        }
    }

    /// Slots in the map, with or without a fence (for tests).
    #[cfg(test)]
    pub(crate) fn slot_count(&self) -> usize {
        self.slots.len()
    }

    /// Calls `f` for every key's lease state (read-locked, a shard at a time).
    pub(crate) fn for_each_lease(&self, mut f: impl FnMut(&Key, &LeaseState)) {
        for slot in &self.slots {
            if let Some(st) = slot.lease.as_deref() {
                f(slot.key(), st);
            }
        }
    }
}

/// A key's slot write-locked for the embedded authority: its lease state
/// and its fence under one lock ([`FenceTable::lease_slot`]).
pub(crate) struct LeaseSlot<'a> {
    table: &'a FenceTable,
    slot: RefMut<'a, Key, Box<Slot>>,
}

impl LeaseSlot<'_> {
    /// The map's copy of the key.
    pub(crate) fn key(&self) -> &Key {
        self.slot.key()
    }

    /// The key's fence (0: never fenced).
    pub(crate) fn fence(&self) -> u64 {
        self.slot.fence
    }

    /// The key's lease state, made if it has none.
    pub(crate) fn state(&mut self) -> &mut LeaseState {
        self.slot.lease.get_or_insert_with(|| Box::new(LeaseState::new()))
    }

    /// The key's lease state, if it has one.
    pub(crate) fn state_mut(&mut self) -> Option<&mut LeaseState> {
        self.slot.lease.as_deref_mut()
    }

    /// [`FenceTable::issue`] under this lock: the next token, installed as
    /// the fence, `ops(token)` submitted to the store. Refused by the fence
    /// quota for a key that had no fence.
    pub(crate) fn issue(
        &mut self,
        store: &Store,
        ops: impl FnOnce(&Key, u64) -> Vec<Op>,
    ) -> Result<(u64, oneshot::Receiver<Result<(), Error>>), Error> {
        let table = self.table;
        table.count(&mut self.slot).map_err(|limit| Error::FenceQuota { scope: "gateway", limit })?;
        table.issue_locked(&mut self.slot, store, ops)
    }

    /// [`FenceTable::mark_durable`] under this lock.
    pub(crate) fn mark_durable(&mut self, token: u64) {
        if token <= self.slot.fence && token > self.slot.durable {
            self.slot.durable = token;
        }
    }
}

/// External routes: a token more than `max_step` above the fence is refused.
fn check_step(token: u64, fence: u64, policy: CheckPolicy) -> Result<(), Refusal> {
    if token - fence > policy.max_step {
        return Err(Refusal::TooFar { token, fence, max_step: policy.max_step });
    }
    Ok(())
}

/// A mutation registered as in flight. Dropping it (when the upstream has
/// answered, or the request failed) lets activation barriers proceed.
pub struct InflightGuard {
    table: Arc<FenceTable>,
    key: Key,
    token: u64,
    sequence: Option<u64>,
    id: u64,
    ctl: Arc<InflightCtl>,
}

impl std::fmt::Debug for InflightGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InflightGuard").field("key", &self.key).field("token", &self.token).finish()
    }
}

impl InflightGuard {
    /// The token this mutation carries.
    pub fn token(&self) -> u64 {
        self.token
    }
    /// The key it is registered under.
    pub fn key(&self) -> &str {
        &self.key
    }
    /// Its `X-Fencing-Sequence`, if it has one.
    pub fn sequence(&self) -> Option<u64> {
        self.sequence
    }
    /// The abort control shared with the table.
    pub fn ctl(&self) -> &Arc<InflightCtl> {
        &self.ctl
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.table.finish(&self.key, self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STRICT: CheckPolicy = CheckPolicy::embedded(true);
    const LAX: CheckPolicy = CheckPolicy::embedded(false);
    const EXT: CheckPolicy = CheckPolicy { strict: true, external: true, max_step: 1000 };

    /// The grants an authority would report live, per table (a test's
    /// stand-in for the authority; kept for the whole test run).
    #[derive(Default)]
    struct TestGrants(std::sync::Mutex<std::collections::HashMap<String, u64>>);

    impl GrantLiveness for TestGrants {
        fn liveness(&self, key: &str, token: u64) -> Liveness {
            (self.0.lock().unwrap().get(key) == Some(&token)).into()
        }
    }

    type Sources = std::sync::Mutex<std::collections::HashMap<usize, Arc<TestGrants>>>;
    static SOURCES: std::sync::LazyLock<Sources> = std::sync::LazyLock::new(Sources::default);

    /// A table whose strict checks ask a [`TestGrants`] of its own.
    fn new_table() -> Arc<FenceTable> {
        let t = FenceTable::new();
        let grants = Arc::new(TestGrants::default());
        let weak: Weak<dyn GrantLiveness> = Arc::downgrade(&grants) as Weak<dyn GrantLiveness>;
        t.derive_liveness_from(weak);
        SOURCES.lock().unwrap().insert(Arc::as_ptr(&t) as usize, grants);
        t
    }

    /// What the authority would say: `key`'s grant of `token` is live or not.
    fn set_live(t: &Arc<FenceTable>, key: &str, token: u64, live: bool) {
        let grants = SOURCES.lock().unwrap().get(&(Arc::as_ptr(t) as usize)).cloned().unwrap();
        let mut g = grants.0.lock().unwrap();
        if live {
            g.insert(key.to_string(), token);
        } else if g.get(key) == Some(&token) {
            g.remove(key);
        }
    }

    fn table_with(key: &str, fence: u64, live: bool) -> Arc<FenceTable> {
        let t = new_table();
        t.load(key, fence);
        set_live(&t, key, fence, live);
        t
    }

    #[test]
    fn several_keys_are_admitted_all_or_none() {
        let t = table_with("a", 5, true);
        t.load("b", 7);
        set_live(&t, "b", 7, true);
        let Ok(all) = t.admit_all(&[("b", 7), ("a", 5), ("b", 7)], STRICT) else { panic!() };
        assert_eq!(all.len(), 2, "a key named twice is registered once");
        assert_eq!((t.inflight("a"), t.inflight("b")), (1, 1));
        drop(all);
        // One stale key among several: none stays registered.
        match t.admit_all(&[("a", 5), ("b", 6)], STRICT) {
            Err((1, Refusal::Stale { token: 6, fence: 7, .. })) => {}
            other => panic!("{other:?}"),
        }
        assert_eq!((t.inflight("a"), t.inflight("b")), (0, 0));
        assert!(matches!(t.admit_all(&[("a", 5), ("c", 5)], STRICT), Err((1, Refusal::Unissued { .. }))));
        assert_eq!(t.inflight_total(), 0);
    }

    #[test]
    fn a_gateway_that_is_not_current_refuses_mutations_until_it_is_again() {
        let t = table_with("k", 5, true);
        assert!(t.is_current(), "single-node mode is always current");
        t.gate_on_currency();
        assert!(matches!(t.admit("k", 5, STRICT), Err(Refusal::NotCurrent { .. })));
        t.set_current_until(Instant::now() + Duration::from_secs(60));
        assert!(matches!(t.admit("k", 5, STRICT), Ok(Admission::Admitted(_))));
        t.set_not_current("watch broken");
        match t.admit("k", 5, STRICT) {
            Err(Refusal::NotCurrent { why }) => assert_eq!(why, "watch broken"),
            other => panic!("{other:?}"),
        }
        // A deadline in the past is not current either.
        t.set_current_until(Instant::now());
        assert!(matches!(t.admit("k", 5, STRICT), Err(Refusal::NotCurrent { .. })));
    }

    /// The authority's answer, asked between an admission's check and its
    /// registration, stands in for a thread stalled there while the
    /// gateway lapsed, found nothing in flight, drained and rejoined.
    struct LapsesWhileAsked(std::sync::Mutex<Weak<FenceTable>>);

    impl GrantLiveness for LapsesWhileAsked {
        fn liveness(&self, _key: &str, _token: u64) -> Liveness {
            if let Some(t) = self.0.lock().unwrap().upgrade() {
                t.set_not_current("lapsed");
                assert_eq!(t.inflight_total(), 0, "the lapse finds nothing in flight");
                t.set_current_until(Instant::now() + Duration::from_secs(60));
            }
            Liveness::Live
        }
    }

    #[test]
    fn a_request_checked_before_a_lapse_the_gateway_drained_and_rejoined_after_is_refused() {
        let t = FenceTable::new();
        t.load("k", 5);
        let source = Arc::new(LapsesWhileAsked(std::sync::Mutex::new(Arc::downgrade(&t))));
        t.derive_liveness_from(Arc::downgrade(&source) as Weak<dyn GrantLiveness>);
        t.gate_on_currency();
        t.set_current_until(Instant::now() + Duration::from_secs(60));
        assert!(
            matches!(t.admit("k", 5, STRICT), Err(Refusal::NotCurrent { .. })),
            "checked under the old membership, registered under the new one"
        );
        assert_eq!(t.inflight_total(), 0, "the refused registration is taken back");
        // The next request is checked under the new membership.
        *source.0.lock().unwrap() = Weak::new();
        assert!(matches!(t.admit("k", 5, STRICT), Ok(Admission::Admitted(_))));
    }

    #[test]
    fn losing_currency_aborts_uploads_still_streaming() {
        let t = table_with("k", 5, true);
        let Ok(Admission::Admitted(g)) = t.admit("k", 5, STRICT) else { panic!() };
        t.gate_on_currency();
        t.set_not_current("lapsed");
        assert!(g.ctl().is_aborted());
    }

    #[test]
    fn installed_fences_only_rise_and_liveness_is_the_authoritys() {
        let t = new_table();
        t.install("k", 10).unwrap();
        set_live(&t, "k", 10, true);
        assert_eq!((t.fence("k"), t.durable_fence("k")), (10, 10));
        assert!(matches!(t.admit("k", 10, STRICT), Ok(Admission::Admitted(_))));
        let Ok(Admission::Admitted(old)) = t.admit("k", 10, STRICT) else { panic!() };
        t.install("k", 7).unwrap();
        assert_eq!(t.fence("k"), 10, "a restored lower fence is ignored");
        t.install("k", 12).unwrap();
        assert!(old.ctl().is_aborted(), "a newer fence aborts older uploads");
        assert!(matches!(t.admit("k", 12, STRICT), Err(Refusal::LeaseExpired { .. })));
        set_live(&t, "k", 12, true);
        assert!(matches!(t.admit("k", 12, STRICT), Ok(Admission::Admitted(_))));
        assert!(matches!(t.admit("k", 12, STRICT), Ok(Admission::Admitted(_))));
        assert!(matches!(t.admit("k", 10, STRICT), Err(Refusal::Stale { .. })));
    }

    #[test]
    fn stale_token_is_refused_with_fence() {
        let t = table_with("k", 34, true);
        match t.admit("k", 33, STRICT) {
            Err(Refusal::Stale { token: 33, fence: 34, .. }) => {}
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn token_above_fence_is_unissued_on_embedded_routes() {
        let t = table_with("k", 34, true);
        assert!(matches!(t.admit("k", 35, STRICT), Err(Refusal::Unissued { token: 35, fence: 34 })));
        assert!(matches!(t.admit("fresh", 1, STRICT), Err(Refusal::Unissued { fence: 0, .. })));
        assert!(matches!(t.admit("fresh", 0, LAX), Err(Refusal::Unissued { fence: 0, .. })));
    }

    #[test]
    fn ended_grant_is_refused_only_when_strict() {
        let t = table_with("k", 5, false);
        assert!(matches!(t.admit("k", 5, STRICT), Err(Refusal::LeaseExpired { token: 5 })));
        assert!(matches!(t.admit("k", 5, LAX), Ok(Admission::Admitted(_))));
    }

    #[test]
    fn live_current_token_is_admitted_and_registered() {
        let t = table_with("k", 5, true);
        let Ok(Admission::Admitted(g)) = t.admit("k", 5, STRICT) else { panic!() };
        assert_eq!(t.inflight("k"), 1);
        drop(g);
        assert_eq!(t.inflight("k"), 0);
    }

    #[test]
    fn external_higher_token_must_advance() {
        let t = table_with("k", 5, false);
        let ext = EXT;
        assert!(matches!(t.admit("k", 9, ext), Ok(Admission::MustAdvance)));
        assert!(matches!(t.admit("new", 1, ext), Ok(Admission::MustAdvance)));
        assert!(matches!(t.admit("k", 5, ext), Ok(Admission::Admitted(_))));
    }

    #[test]
    fn a_slot_is_40_bytes_and_its_flags_and_time_do_not_clobber_each_other() {
        assert_eq!(std::mem::size_of::<Slot>(), 40);
        assert_eq!(std::mem::size_of::<(Key, Box<Slot>)>(), 16);
        let mut s = Slot { state: COUNTED, ..Slot::default() };
        assert_eq!(s.superseded_for(), Duration::ZERO, "never moved");
        s.set_external(true);
        s.raise(3);
        assert!(s.external());
        assert_ne!(s.state & MOVED_MS, 0);
        assert!(s.superseded_for() < Duration::from_secs(5));
        s.set_external(false);
        assert!(!s.external());
        assert_ne!(s.state & MOVED_MS, 0, "the time survives the flags");
        assert!(s.counted(), "the quota's flag survives the others");
        // A sequence lives in the rare part, which goes when nothing is in it.
        assert!(s.rare.is_none());
        s.set_last_sequence(Some(4));
        assert_eq!(s.last_sequence(), Some(4));
        s.set_last_sequence(None);
        assert!(s.rare.is_none());
    }

    #[test]
    fn a_key_with_nothing_in_flight_keeps_no_rare_part() {
        let t = table_with("k", 5, true);
        let Ok(Admission::Admitted(g)) = t.admit("k", 5, STRICT) else { panic!() };
        assert!(t.slots.get("k").unwrap().rare.is_some());
        drop(g);
        assert!(t.slots.get("k").unwrap().rare.is_none());
        // A stored sequence keeps it after its request finished.
        let store = Store::memory();
        let Ok(Admission::AdmittedAfter(g, _)) = t.admit_sequenced("k", 5, 1, STRICT, &store) else { panic!() };
        drop(g);
        assert_eq!(t.slots.get("k").unwrap().last_sequence(), Some(1));
        assert_eq!(t.inflight("k"), 0);
    }

    #[test]
    fn a_slot_made_for_a_lease_state_counts_as_a_fence_only_once_issued() {
        let store = Store::memory();
        let t = new_table();
        t.set_max_fences(1);
        // A watch's state: a slot with fence 0, outside the quota, refused
        // like a key never fenced, and gone once the state is.
        t.lease_slot("watched").state();
        assert_eq!((t.len(), t.slot_count(), t.fence("watched")), (0, 1, 0));
        assert!(matches!(t.admit("watched", 0, LAX), Err(Refusal::Unissued { .. })));
        t.forget_lease_if("watched", |_| true);
        assert_eq!(t.slot_count(), 0);
        // Issued through the lease slot: counted, and the quota applies.
        let mut slot = t.lease_slot("a");
        slot.state();
        let (token, _rx) = slot.issue(&store, |k, token| vec![Op::Fence { key: k.clone(), token }]).unwrap();
        drop(slot);
        assert_eq!((t.len(), t.fence("a")), (1, token));
        let mut slot = t.lease_slot("b");
        slot.state();
        let refused = slot.issue(&store, |k, token| vec![Op::Fence { key: k.clone(), token }]);
        assert!(matches!(refused, Err(Error::FenceQuota { limit: 1, .. })));
        drop(slot);
        // A fenced key keeps its slot when its lease state goes.
        t.forget_lease_if("a", |_| true);
        t.forget_lease_if("b", |_| true);
        assert_eq!((t.len(), t.slot_count(), t.fence("a")), (1, 1, token));
        assert!(t.lease("a").is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn barrier_waits_for_older_inflight_only() {
        let t = table_with("k", 5, true);
        let Ok(Admission::Admitted(old)) = t.admit("k", 5, STRICT) else { panic!() };
        // A newer fence: the barrier for 6 must wait for the token-5 mutation.
        t.slots.get_mut("k").unwrap().raise(6);
        let t2 = t.clone();
        let waiter = tokio::spawn(async move { t2.barrier("k", 6, Duration::from_secs(10)).await });
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!waiter.is_finished());
        drop(old);
        let outcome = waiter.await.unwrap();
        assert!(!outcome.overrun);
        assert!(outcome.waited >= Duration::from_millis(200));
    }

    #[tokio::test(start_paused = true)]
    async fn barrier_gives_up_at_timeout() {
        let t = table_with("k", 5, true);
        let Ok(Admission::Admitted(_old)) = t.admit("k", 5, STRICT) else { panic!() };
        let outcome = t.barrier("k", 6, Duration::from_secs(1)).await;
        assert!(outcome.overrun);
    }

    #[test]
    fn raising_the_fence_aborts_streaming_uploads_but_not_finished_ones() {
        let t = table_with("k", 5, true);
        let Ok(Admission::Admitted(streaming)) = t.admit("k", 5, STRICT) else { panic!() };
        let Ok(Admission::Admitted(sent)) = t.admit("k", 5, STRICT) else { panic!() };
        sent.ctl().mark_body_done();
        t.slots.get_mut("k").unwrap().raise(6);
        assert!(streaming.ctl().is_aborted());
        assert!(!sent.ctl().is_aborted());
    }

    #[tokio::test]
    async fn external_token_is_not_admitted_before_its_fence_is_durable() {
        let store = Store::memory();
        let t = table_with("k", 5, false);
        store.hold_acks();
        // The first request raises the fence to 9; its fsync is pending.
        let (_first, rx) = t.advance("k", 9, None, EXT, &store).unwrap();
        assert!(rx.is_some());
        assert_eq!(t.fence("k"), 9);
        assert_eq!(t.durable_fence("k"), 5);
        // A second request with the same token must wait for durability
        // too, not pass on the barrier alone.
        assert!(matches!(t.admit("k", 9, EXT), Ok(Admission::MustAdvance)));
        let (_second, rx2) = t.advance("k", 9, None, EXT, &store).unwrap();
        let mut rx2 = rx2.expect("the second request waits for its own fsync");
        assert!(rx2.try_recv().is_err());
        // Older tokens stay refused meanwhile.
        assert!(matches!(t.admit("k", 8, EXT), Err(Refusal::Stale { fence: 9, .. })));
        store.release_acks(Ok(()));
        assert!(matches!(rx2.await, Ok(Ok(()))));
        t.mark_durable("k", 9);
        assert_eq!(t.durable_fence("k"), 9);
        assert!(matches!(t.admit("k", 9, EXT), Ok(Admission::Admitted(_))));
    }

    #[test]
    fn embedded_token_above_the_durable_fence_is_unissued() {
        let store = Store::memory();
        store.hold_acks();
        let t = table_with("k", 5, true);
        let (token, _rx) = t.issue("k", &store, |k, token| vec![Op::Fence { key: k.clone(), token }]).unwrap();
        assert_eq!(token, 6, "above every loaded fence");
        // Not fsynced yet: nobody was told 6, and a crash would re-issue it.
        assert!(matches!(t.admit("k", 6, LAX), Err(Refusal::Unissued { token: 6, fence: 5 })));
        t.mark_durable("k", 6);
        assert!(matches!(t.admit("k", 6, LAX), Ok(Admission::Admitted(_))));
    }

    #[test]
    fn external_tokens_beyond_the_step_are_refused() {
        let store = Store::memory();
        let t = table_with("k", 5, false);
        assert!(matches!(t.admit("k", u64::MAX, EXT), Err(Refusal::TooFar { fence: 5, max_step: 1000, .. })));
        assert!(matches!(t.admit("fresh", 1001, EXT), Err(Refusal::TooFar { fence: 0, .. })));
        assert!(matches!(t.admit("fresh", 1000, EXT), Ok(Admission::MustAdvance)));
        assert!(matches!(t.advance("k", 1006, None, EXT, &store), Err(Refusal::TooFar { .. })));
        assert_eq!(t.fence("k"), 5);
        assert!(t.advance("k", 1005, None, EXT, &store).is_ok());
    }

    #[test]
    fn a_first_fence_refused_gives_its_quota_unit_back() {
        let store = Store::memory();
        let t = new_table();
        t.set_max_fences(2);
        // An external route's step refused on new keys, again and again.
        for i in 0..5 {
            let refused = t.advance(&format!("far/{i}"), 1001, None, EXT, &store);
            assert!(matches!(refused, Err(Refusal::TooFar { .. })));
        }
        assert_eq!((t.len(), t.slot_count()), (0, 0));
        // The token space exhausted (an external token at its end): every
        // issue on a new key fails, and none keeps a unit.
        t.load("end", u64::MAX - 1);
        for i in 0..5 {
            let failed = t.issue(&format!("new/{i}"), &store, |k, token| vec![Op::Fence { key: k.clone(), token }]);
            assert!(matches!(failed, Err(Error::Internal(_))));
            let mut slot = t.lease_slot(&format!("lease/{i}"));
            slot.state();
            let failed = slot.issue(&store, |k, token| vec![Op::Fence { key: k.clone(), token }]);
            assert!(matches!(failed, Err(Error::Internal(_))));
            drop(slot);
            t.forget_lease_if(&format!("lease/{i}"), |_| true);
        }
        assert_eq!((t.len(), t.slot_count()), (1, 1));
        // The one unit left is still there for an external fence.
        assert!(t.advance("near", 10, None, EXT, &store).is_ok());
        assert_eq!(t.len(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn wait_idle_waits_for_every_key_and_gives_up_at_its_bound() {
        let t = table_with("a", 5, true);
        t.load("b", 7);
        set_live(&t, "b", 7, true);
        let Ok(Admission::Admitted(ga)) = t.admit("a", 5, STRICT) else { panic!() };
        let Ok(Admission::Admitted(gb)) = t.admit("b", 7, STRICT) else { panic!() };
        assert_eq!(t.inflight_total(), 2);
        assert!(!t.wait_idle(Duration::from_secs(1)).await, "cut short while two are in flight");
        let t2 = t.clone();
        let waiter = tokio::spawn(async move { t2.wait_idle(Duration::from_secs(10)).await });
        drop(ga);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!waiter.is_finished());
        drop(gb);
        assert!(waiter.await.unwrap());
        assert_eq!(t.inflight_total(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn the_quarantine_is_not_cut_short_by_the_barrier_timeout() {
        let t = table_with("k", 5, true);
        t.set_quarantine(Instant::now() + Duration::from_secs(5));
        let started = Instant::now();
        let outcome = t.barrier("k", 6, Duration::from_secs(1)).await;
        assert!(started.elapsed() >= Duration::from_secs(5), "{:?}", started.elapsed());
        assert!(!outcome.overrun);
    }

    #[test]
    fn tokens_are_one_sequence_across_keys_and_above_every_fence() {
        let store = Store::memory();
        let t = new_table();
        t.load("a", 3);
        t.load("b", 7);
        let issue = |key: &str| t.issue(key, &store, |k, token| vec![Op::Fence { key: k.clone(), token }]).unwrap().0;
        assert_eq!(issue("a"), 8, "above every fence on disk, not a's own");
        assert_eq!(issue("c"), 9);
        assert_eq!(issue("a"), 10);
        // A key whose fence an external route raised past the sequence.
        t.load("x", 100);
        assert_eq!(issue("x"), 101);
        assert_eq!(issue("b"), 102);
    }

    #[test]
    fn a_live_token_of_one_key_is_never_admitted_on_another() {
        let store = Store::memory();
        let t = new_table();
        let mut tokens = Vec::new();
        for key in ["bkt", "bkt/obj1", "bkt/obj2"] {
            let (token, _rx) = t.issue(key, &store, |k, token| vec![Op::Fence { key: k.clone(), token }]).unwrap();
            t.mark_durable(key, token);
            set_live(&t, key, token, true);
            tokens.push((key, token));
        }
        for (key, _) in &tokens {
            for (other, token) in &tokens {
                let admitted = matches!(t.admit(key, *token, STRICT), Ok(Admission::Admitted(_)));
                assert_eq!(admitted, key == other, "token of {other} on {key}");
            }
        }
    }

    #[test]
    fn concurrent_issues_never_share_a_token() {
        let store = Store::memory();
        let t = new_table();
        t.load("x", 50);
        let seen = std::sync::Mutex::new(std::collections::HashSet::new());
        std::thread::scope(|s| {
            for i in 0..4 {
                let (t, store, seen) = (&t, &store, &seen);
                s.spawn(move || {
                    for n in 0..500 {
                        let key = if n % 7 == 0 { "x".to_string() } else { format!("k{i}/{n}") };
                        let (token, _rx) =
                            t.issue(&key, store, |k, token| vec![Op::Fence { key: k.clone(), token }]).unwrap();
                        assert!(seen.lock().unwrap().insert(token), "token {token} issued twice");
                    }
                });
            }
        });
        assert_eq!(seen.lock().unwrap().len(), 2000);
    }

    #[tokio::test]
    async fn a_sequence_not_above_the_last_forwarded_one_is_refused() {
        let store = Store::memory();
        let t = table_with("k", 5, true);
        let admit = |seq: u64| t.admit_sequenced("k", 5, seq, STRICT, &store);
        let Ok(Admission::AdmittedAfter(_g, rx)) = admit(3) else { panic!() };
        assert!(matches!(rx.await, Ok(Ok(()))));
        assert!(matches!(admit(3), Err(Refusal::StaleSequence { sequence: 3, last_sequence: 3, .. })));
        assert!(matches!(admit(2), Err(Refusal::StaleSequence { sequence: 2, last_sequence: 3, .. })));
        assert!(matches!(admit(10), Ok(Admission::AdmittedAfter(..))));
        // A stale token is refused as stale, whatever its sequence.
        assert!(matches!(t.admit_sequenced("k", 4, 99, STRICT, &store), Err(Refusal::Stale { .. })));
        // A new token starts a new sequence.
        t.slots.get_mut("k").unwrap().raise(6);
        set_live(&t, "k", 6, true);
        t.mark_durable("k", 6);
        assert!(matches!(t.admit_sequenced("k", 6, 0, STRICT, &store), Ok(Admission::AdmittedAfter(..))));
    }

    #[test]
    fn a_stored_sequence_comes_back_with_its_fence() {
        let t = new_table();
        t.load_record("k", FenceRecord { token: 5, sequence: Some(7), external: false });
        set_live(&t, "k", 5, true);
        let store = Store::memory();
        assert!(matches!(
            t.admit_sequenced("k", 5, 7, STRICT, &store),
            Err(Refusal::StaleSequence { last_sequence: 7, .. })
        ));
        assert!(matches!(t.admit_sequenced("k", 5, 8, STRICT, &store), Ok(Admission::AdmittedAfter(..))));
    }

    #[tokio::test]
    async fn external_sequences_advance_with_the_fence() {
        let store = Store::memory();
        let t = table_with("k", 5, false);
        let (_g, rx) = t.advance("k", 9, Some(1), EXT, &store).unwrap();
        assert!(matches!(rx.unwrap().await, Ok(Ok(()))));
        t.mark_durable("k", 9);
        assert!(matches!(t.advance("k", 9, Some(1), EXT, &store), Err(Refusal::StaleSequence { .. })));
        assert!(t.advance("k", 9, Some(2), EXT, &store).is_ok());
    }

    #[test]
    fn an_external_token_is_never_issued_again_nor_live_for_embedded_routes() {
        let store = Store::memory();
        let t = new_table();
        let (_g, _rx) = t.advance("e", 3, None, EXT, &store).unwrap();
        t.mark_durable("e", 3);
        let issue = |key: &str| t.issue(key, &store, |k, token| vec![Op::Fence { key: k.clone(), token }]).unwrap().0;
        assert_eq!(issue("b"), 4, "the sequence moved past the external token");
        // No grant of this gateway behind token 3 on "e": embedded routes refuse it.
        assert!(matches!(t.admit("e", 3, STRICT), Err(Refusal::Unissued { token: 3, .. })));
    }

    #[test]
    fn new_keys_beyond_max_fences_are_refused_and_known_ones_still_work() {
        let store = Store::memory();
        let t = new_table();
        t.load("a", 3);
        t.set_max_fences(2);
        let issue = |key: &str| t.issue(key, &store, |k, token| vec![Op::Fence { key: k.clone(), token }]);
        assert!(issue("b").is_ok());
        assert!(matches!(issue("c"), Err(Error::FenceQuota { limit: 2, .. })));
        assert!(matches!(t.advance("d", 5, None, EXT, &store), Err(Refusal::NoRoom { limit: 2 })));
        assert!(issue("a").is_ok(), "a key with a fence is never refused");
        assert_eq!(t.len(), 2);
    }

    #[test]
    fn the_highest_sequence_is_taken_once_even_at_u64_max() {
        let store = Store::memory();
        let t = table_with("k", 5, true);
        assert!(matches!(t.admit_sequenced("k", 5, u64::MAX, STRICT, &store), Ok(Admission::AdmittedAfter(..))));
        assert!(matches!(
            t.admit_sequenced("k", 5, u64::MAX, STRICT, &store),
            Err(Refusal::StaleSequence { last_sequence: u64::MAX, .. })
        ));
    }

    #[tokio::test]
    async fn an_unsequenced_external_request_keeps_the_stored_sequence() {
        let store = Store::memory();
        let t = table_with("k", 5, false);
        store.hold_acks();
        let (_a, _rx) = t.advance("k", 9, Some(9), EXT, &store).unwrap();
        // Same token, no sequence, while the fence's fsync is pending.
        let (_b, _rx2) = t.advance("k", 9, None, EXT, &store).unwrap();
        store.release_acks(Ok(()));
        let mut seen = Vec::new();
        store.for_each_fence(|k, r| seen.push((k.to_string(), r))).unwrap();
        assert_eq!(seen, vec![("k".to_string(), FenceRecord { token: 9, sequence: Some(9), external: true })]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_higher_sequence_waits_for_the_lower_ones_in_flight_and_aborts_their_uploads() {
        let store = Store::memory();
        let t = table_with("k", 5, true);
        let Ok(Admission::AdmittedAfter(sent, _)) = t.admit_sequenced("k", 5, 1, STRICT, &store) else { panic!() };
        sent.ctl().mark_body_done();
        let Ok(Admission::AdmittedAfter(streaming, _)) = t.admit_sequenced("k", 5, 2, STRICT, &store) else { panic!() };
        let Ok(Admission::AdmittedAfter(third, _)) = t.admit_sequenced("k", 5, 3, STRICT, &store) else { panic!() };
        assert!(streaming.ctl().is_aborted(), "2 was still streaming when 3 came");
        assert!(!sent.ctl().is_aborted(), "1 was sent whole: waited for, not aborted");
        let t2 = t.clone();
        let waiter = tokio::spawn(async move { t2.barrier_for("k", 5, Some(3), Duration::from_secs(10)).await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(streaming);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!waiter.is_finished(), "3 waits for 1");
        drop(sent);
        assert!(!waiter.await.unwrap().overrun);
        drop(third);
        // Unsequenced writes of the same token are not waited for.
        let Ok(Admission::Admitted(_plain)) = t.admit("k", 5, STRICT) else { panic!() };
        assert!(!t.barrier_for("k", 5, Some(4), Duration::from_secs(1)).await.overrun);
    }

    #[test]
    fn an_external_fence_is_never_admitted_on_an_embedded_route_even_lax_or_after_restart() {
        let store = Store::memory();
        let t = new_table();
        let (_g, _rx) = t.advance("mx", 5, None, EXT, &store).unwrap();
        t.mark_durable("mx", 5);
        assert!(matches!(t.admit("mx", 5, LAX), Err(Refusal::Unissued { token: 5, .. })));
        assert!(matches!(t.admit("mx", 5, EXT), Ok(Admission::Admitted(_))));
        // As a restart reads it back.
        let mut records = Vec::new();
        store.for_each_fence(|k, r| records.push((k.to_string(), r))).unwrap();
        let restarted = FenceTable::new();
        for (k, r) in records {
            restarted.load_record(&k, r);
        }
        assert!(matches!(restarted.admit("mx", 5, LAX), Err(Refusal::Unissued { .. })));
        // A grant of this gateway on the key makes it embedded again.
        let (token, _rx) = restarted.issue("mx", &store, |k, token| vec![Op::Fence { key: k.clone(), token }]).unwrap();
        restarted.mark_durable("mx", token);
        assert!(matches!(restarted.admit("mx", token, LAX), Ok(Admission::Admitted(_))));
    }
}
