//! The fence feed: the mirror and the fence table loaded by one consistent
//! read at revision R, then fed by a watch from R+1 (never from "now", which
//! could skip a fence). A watch that ends, errs or is cancelled by a
//! compaction marks the gateway not current at once and reloads. Each
//! installed fence runs the local activation barrier; the highest revision
//! up to which every fence is installed and activated is acknowledged in
//! `a/GW` (coalesced: one put in flight, always the latest value).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{EventType, GetOptions, KeyValue, PutOptions, WatchOptions};

use super::mirror::{GrantEntry, GrantValue, MemberEntry};
use super::{token_of, Cluster, Kind};
use crate::error::Error;

/// The token a fence `f/KEY` names: `offset/slot` (a batched grant) or
/// `offset` (one grant per transaction), at the put's revision.
pub(super) fn fence_token(kv: &KeyValue) -> u64 {
    let v = kv.value_str().unwrap_or("").trim();
    let (o, slot) = v.split_once('/').map_or((v, None), |(o, i)| (o, Some(i)));
    let offset = o.parse::<u64>().unwrap_or(0);
    let slot = slot.map(|i| i.parse::<u64>().unwrap_or(0));
    token_of(offset, kv.mod_revision(), slot)
}

/// Keys per page of a reload (each page well under gRPC's 4 MiB).
const LOAD_PAGE: i64 = 500;

/// Grants a gateway has seen: (key, create revision, lease-id hash).
type KnownGrants = std::collections::HashSet<(String, i64, String)>;

impl Cluster {
    /// Reloads everything under the prefix at one revision R and returns
    /// R+1, where the watch must start.
    pub(super) async fn load(&self) -> Result<i64, Error> {
        // The grants this gateway knows before the read starts: a release
        // answered while the read is under way takes its grant out of the
        // mirror at once, though the read may still show it (an outside
        // review saw such a grant flagged as made in another numbering).
        let known_before = self.known_grants();
        // etcd's raft log first: a restore found here stops this gateway
        // before anything read below is acknowledged (`raft.rs`).
        self.check_raft().await?;
        // Pages of keys, all read at the revision of the first page (one
        // consistent view however many fences there are).
        let end = self.keys.prefix_end();
        let mut start = self.keys.prefix.clone().into_bytes();
        let (mut revision, mut cluster_id) = (0, 0);
        let mut kvs = Vec::new();
        loop {
            let mut opts = GetOptions::new().with_range(end.clone()).with_limit(LOAD_PAGE);
            if revision > 0 {
                opts = opts.with_revision(revision);
            }
            let mut resp = self
                .etcd
                .call_repeatable(self.timeout * 4, "loading the fences", || {
                    let (mut kv, start, opts) = (self.etcd.kv_client(), start.clone(), opts.clone());
                    async move { kv.get(start, Some(opts)).await }
                })
                .await?;
            if revision == 0 {
                let header = resp.header().ok_or_else(|| Error::Unavailable("etcd: no response header".into()))?;
                (revision, cluster_id) = (header.revision(), header.cluster_id());
            }
            let more = resp.more();
            let page = resp.take_kvs();
            let Some(last) = page.last() else { break };
            start = last.key().to_vec();
            start.push(0);
            kvs.extend(page.into_iter().filter(|kv| self.keys.kind(kv.key()) != Kind::Other));
            if !more {
                break;
            }
        }
        let same_cluster = self.floor.cluster_id() == cluster_id;
        self.floor.observe_cluster(cluster_id, revision);
        // The grants this gateway knew before or during this read: (key,
        // create revision, lease-id hash).
        let mut known = known_before;
        let first_load = *self.applied.borrow() == 0;
        if revision < *self.applied.borrow() {
            // etcd's revisions went back (a restore, or another cluster):
            // what this gateway counted in the old numbering — its last
            // acknowledgement, its last fence, activations under way —
            // says nothing of the new one, and an acknowledgement carried
            // over would cover revisions it never saw.
            tracing::warn!(
                revision,
                seen = *self.applied.borrow(),
                "etcd's revision went back: acknowledgements start over"
            );
            *self.ack_lock.lock().await = 0;
            *self.last_fence.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = 0;
            self.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clear();
            // Grants held back stay held: they are judged by what they are.
            let mut fw = self.floor_watch.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            (fw.rev, fw.before) = (0, 0);
        }
        // The members that left since the broken watch's last revision:
        // known from a replay of the member keys (`members_left_between`),
        // each quarantined from now; when that cannot be had (the first
        // load, revisions gone back, another cluster, a restore found, the
        // replay compacted or unanswered) the load quarantines everyone.
        let prev = *self.applied.borrow();
        let left = if first_load || revision < prev || !same_cluster || self.floor.restored().is_some() {
            None
        } else {
            match self.members_left_between(prev, revision).await {
                Ok(left) => Some(left),
                Err(why) => {
                    tracing::warn!(
                        from = prev,
                        to = revision,
                        reason = %why,
                        "replaying the member keys missed failed: every grant waits one quarantine from this reload"
                    );
                    None
                }
            }
        };
        {
            let now = tokio::time::Instant::now();
            let mut m = self.lock_mirror();
            // Departures already seen keep their quarantine, as does an
            // earlier load's.
            let departed = std::mem::take(&mut m.departed);
            let drained_records = std::mem::take(&mut m.drained_records);
            let loaded_at = if left.is_some() { m.loaded_at } else { Some(now) };
            // Grants already seen keep their expiry deadline (a put seen
            // again counts from when it was first seen).
            let seen = std::mem::take(&mut m.grants);
            known.extend(seen.iter().map(|(k, g)| (k.clone(), g.created, g.value.s.clone())));
            *m = super::mirror::Mirror { departed, drained_records, loaded_at, ..Default::default() };
            m.grants = seen;
            // Left unseen: possibly by hand while running (see
            // `Mirror::remove_member`), its last proof unknown: a whole TTL
            // from now.
            for (gw, (lease, drained, ttl)) in left.unwrap_or_default() {
                if m.departed.get(&gw).is_none_or(|d| d.lease != lease) {
                    m.depart(&gw, super::mirror::Departure::new(lease, now + ttl, drained));
                }
            }
        }
        let kvs = &kvs;
        // The grants this read does not hold are gone; the others are
        // replaced by what it read (keeping a deadline of a put seen before).
        let read: std::collections::HashMap<&str, i64> = kvs
            .iter()
            .filter_map(|kv| match self.keys.kind(kv.key()) {
                Kind::Grant(k) => Some((k, kv.mod_revision())),
                _ => None,
            })
            .collect();
        self.lock_mirror().grants.retain(|k, g| read.get(k.as_str()) == Some(&g.modified));
        // The offset first: fences and grants are read with it.
        for kv in kvs {
            if self.keys.kind(kv.key()) == Kind::Offset {
                self.apply_put(kv);
            }
        }
        for kv in kvs {
            if !matches!(self.keys.kind(kv.key()), Kind::Offset | Kind::Fence(_)) {
                self.apply_put(kv);
            }
        }
        if let Some(at) = self.floor.restored() {
            let offset_rev = self.lock_mirror().offset_rev;
            if offset_rev > at {
                tracing::error!(
                    offset_revision = offset_rev,
                    restore_found_at = at,
                    "the token offset was written after the restore this gateway found, but it was read in a reload, \
                     not delivered by its watch: it does not count (a later snapshot can bring back an old \
                     raise-floor); run `fencegate cluster raise-floor` again while this gateway is up"
                );
            }
        }
        self.hold_unknown_grants_below_floor(kvs, revision, &known, first_load);
        for kv in kvs {
            if matches!(self.keys.kind(kv.key()), Kind::Fence(_)) {
                self.apply_put(kv);
            }
        }
        self.check_own_member_key(revision);
        // Nothing is in flight under a fence this read just installed that
        // a barrier must wait for beyond what `apply_put` started.
        self.applied.send_replace(revision);
        self.recompute_activated();
        Ok(revision + 1)
    }

    /// The grants in the mirror now: (key, create revision, lease-id hash).
    fn known_grants(&self) -> KnownGrants {
        self.lock_mirror().grants.iter().map(|(k, g)| (k.clone(), g.created, g.value.s.clone())).collect()
    }

    /// Applies one put (load or watch event) to the mirror and the table.
    fn apply_put(&self, kv: &KeyValue) {
        match self.keys.kind(kv.key()) {
            Kind::Offset => {
                let Some(offset) = kv.value_str().ok().and_then(|v| v.trim().parse::<u64>().ok()) else {
                    tracing::error!("etcd: the token offset does not parse; ignored");
                    return;
                };
                let mut m = self.lock_mirror();
                m.offset = m.offset.max(offset);
                m.offset_rev = kv.mod_revision();
            }
            Kind::Grant(key) => {
                let Ok(value) = serde_json::from_slice::<GrantValue>(kv.value()) else {
                    tracing::error!(key, "etcd: a grant's value does not parse; ignored");
                    return;
                };
                let token = token_of(value.o, kv.create_revision(), value.i);
                let (created, modified) = (kv.create_revision(), kv.mod_revision());
                let mut m = self.lock_mirror();
                if crate::fault::enabled(crate::fault::Fault::StaleExpiryView)
                    && m.grants.get(key).is_some_and(|g| g.created == created)
                {
                    // Test only (src/fault.rs): a renewal not seen here.
                    return;
                }
                // The deadline counts from when this gateway first saw this
                // very put (a reload keeps what was seen before it).
                let seen = m.grants.get(key).filter(|g| g.modified == modified).map(|g| g.deadline);
                let deadline =
                    seen.unwrap_or_else(|| super::expiry::deadline_from(tokio::time::Instant::now(), value.t));
                m.grants.insert(key.to_string(), GrantEntry { token, created, modified, deadline, value });
            }
            Kind::Fence(key) => {
                let token = fence_token(kv);
                if let Err(e) = self.fences.install(key, token) {
                    // A fence that cannot be installed must not be acknowledged.
                    tracing::error!(key, token, error = %e, "cannot install a fence; this gateway stops admitting");
                    self.fences.set_not_current("a fence from etcd could not be installed (fence quota)");
                    self.metrics.cluster_current.set(0);
                    self.feed_ok.store(false, Ordering::Release);
                    return;
                }
                self.floor.raise(token);
                self.start_activation(key, token, kv.mod_revision());
            }
            Kind::Queue(key) => self.lock_mirror().add_waiter(kv.key(), key, kv.create_revision()),
            Kind::Member(gw) => {
                let mut m = self.lock_mirror();
                // A drained value keeps the TTL its `up` value named, and a
                // put never lowers the TTL recorded (review finding: a hand
                // re-put of `up 1` under the member's lease made its
                // departure count from 1 ms after its last proof).
                let known = m.members.get(gw).map(|e| e.ttl);
                let (drained, ttl) = super::mirror::parse_member(kv.value(), known.unwrap_or(self.member_ttl));
                let ttl = known.map_or(ttl, |k| k.max(ttl));
                m.members.insert(gw.to_string(), MemberEntry { lease: kv.lease(), drained, ttl });
                m.seen_at.insert(gw.to_string(), tokio::time::Instant::now());
                self.metrics.cluster_members.set(i64::try_from(m.members.len()).unwrap_or(i64::MAX));
            }
            Kind::Ack(gw) => {
                if let Some(rev) = kv.value_str().ok().and_then(|v| v.parse::<i64>().ok()) {
                    let mut m = self.lock_mirror();
                    m.seen_at.insert(gw.to_string(), tokio::time::Instant::now());
                    let e = m.acks.entry(gw.to_string()).or_insert(0);
                    *e = (*e).max(rev);
                }
            }
            Kind::Restored(gw) => {
                // Another gateway found etcd restored: what a snapshot
                // brought back here may be superseded by history the
                // restore lost, so nothing is admitted anywhere until
                // `raise-floor` deletes the mark (outside review: a
                // gateway that could not tell admitted a superseded
                // holder's write after a `raise-floor` below the finder's
                // floor). The membership loop keeps it not current.
                if self.lock_mirror().restored.insert(gw.to_string()) {
                    self.fences.set_not_current(
                        "a gateway found etcd restored from a snapshot: no mutation is admitted until `fencegate \
                         cluster raise-floor` runs",
                    );
                    self.metrics.cluster_current.set(0);
                }
            }
            Kind::Drained(gw) => {
                if let Some(lease) = kv.value_str().ok().and_then(|v| v.trim().parse::<i64>().ok()) {
                    self.lock_mirror().drained_record(gw, lease);
                }
            }
            Kind::Other => {}
        }
    }

    /// This gateway's own member key went while its lease lives: peers
    /// count it departed (they no longer wait for its acknowledgements), so
    /// it stops admitting at once (aborting uploads) and rejoins.
    fn lose_membership(&self, lease: i64) {
        self.fences.set_not_current("this gateway's membership key was deleted from etcd; rejoining");
        self.metrics.cluster_current.set(0);
        self.member_lost.store(lease, Ordering::Release);
        self.member_lost_kick.notify_one();
    }

    /// After a full read at `revision`: the delete of this gateway's own
    /// member key can fall between a broken watch's last event and the
    /// read, where no watch delivers it. A key created at or before the
    /// read (the join's revision) that the read does not hold, or holds
    /// under another lease, was deleted: as if the watch had said so.
    fn check_own_member_key(&self, revision: i64) {
        let (lease, since) = {
            let m = self.membership.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            (m.lease, m.since)
        };
        let Some(lease) = lease else {
            return;
        };
        if since == 0 || since > revision {
            return;
        }
        let read = self.lock_mirror().members.get(&self.gateway_id).map(|m| m.lease);
        if read != Some(lease) {
            tracing::warn!(
                gateway = %self.gateway_id,
                lease,
                revision,
                "this gateway's membership key is not in the full read (deleted while its watch was broken): rejoining"
            );
            self.lose_membership(lease);
        }
    }

    fn apply_delete(&self, raw: &[u8]) {
        match self.keys.kind(raw) {
            Kind::Grant(key) => {
                self.lock_mirror().grants.remove(key);
            }
            Kind::Queue(_) => self.lock_mirror().remove_waiter(raw),
            Kind::Member(gw) => {
                let removed = {
                    let mut m = self.lock_mirror();
                    let removed = m.remove_member(gw);
                    self.metrics.cluster_members.set(i64::try_from(m.members.len()).unwrap_or(i64::MAX));
                    removed
                };
                // This gateway's own key went while its lease lives (deleted
                // by hand): peers count it departed, so it stops admitting
                // at once (aborting uploads) and rejoins.
                if gw == self.gateway_id && removed.is_some() && removed == self.member_lease() {
                    self.lose_membership(removed.unwrap_or(0));
                }
            }
            Kind::Ack(gw) => {
                self.lock_mirror().acks.remove(gw);
            }
            // Fences and the offset are never deleted by fencegate.
            Kind::Restored(gw) => {
                let mut m = self.lock_mirror();
                if m.restored.remove(gw) && m.restored.is_empty() {
                    drop(m);
                    // Current again at the next proof, not a round later.
                    self.member_lost_kick.notify_one();
                }
            }
            // A drained record stays known (fencegate never deletes one).
            Kind::Fence(_) | Kind::Offset | Kind::Drained(_) | Kind::Other => {}
        }
    }

    /// The local half of activation for a fence at `rev`: older in-flight
    /// mutations of `key` on this gateway finish (or are aborted) before
    /// `rev` is acknowledged.
    fn start_activation(&self, key: &str, token: u64, rev: i64) {
        // `rev` is pending before `last_fence` reaches it: `ack_target`
        // (other tasks) reads both, and in the other order could see the
        // new `last_fence` with nothing pending yet and acknowledge `rev`
        // while an older mutation of `key` is still on its way upstream.
        let waits = self.fences.inflight(key) != 0;
        if waits {
            self.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(rev);
        }
        {
            let mut last = self.last_fence.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            *last = (*last).max(rev);
        }
        if !waits {
            return;
        }
        let fences = self.fences.clone();
        let key = key.to_string();
        let timeout = Duration::from_millis(self.limits.activation_timeout_ms);
        let kick = self.ack_kick.clone();
        let pending = self.pending.clone();
        tokio::spawn(async move {
            let outcome = fences.barrier(&key, token, timeout).await;
            if outcome.overrun {
                tracing::warn!(key = %key, token, "activation gave up waiting for older in-flight mutations");
            }
            pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&rev);
            // Wakes the ack writer (the value is recomputed there).
            kick.notify_one();
        });
    }

    /// The revision this gateway may acknowledge: every fence up to it is
    /// installed and its older in-flight mutations are over.
    pub(super) fn ack_target(&self) -> i64 {
        let last = *self.last_fence.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let first = self.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner).first().copied();
        let held = self.first_held_back();
        match first.into_iter().chain(held).min() {
            Some(p) => (p - 1).min(last),
            None => last,
        }
    }

    /// A grant the watch delivered (its fence `key` at `rev`, `token`):
    /// held back, never acknowledged here, when its token is not above
    /// this gateway's token floor as it stood before that revision. In one
    /// history tokens only grow with revisions, so such a token was issued
    /// before: etcd was restored or replaced, and a gateway that missed the
    /// tokens issued since (stopped, paused, cut off; its own floor lower)
    /// is granting again below them. Without this gateway's acknowledgement
    /// no grant at or after that revision is answered, anywhere; the hold
    /// ends when the grant is gone. The grant's own put (same key and
    /// revision, earlier in `events`, the same watch response) is looked
    /// up only when the grant is held: when this gateway was a current
    /// member since before that revision, the grant waits for its
    /// acknowledgement and was never answered, and it ends that very grant
    /// itself ([`Cluster::end_held`]).
    fn check_against_floor(&self, key: &str, rev: i64, token: u64, events: &[etcd_client::Event]) {
        let mut fw = self.floor_watch.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if rev != fw.rev {
            fw.rev = rev;
            fw.before = self.floor.get();
        }
        if token > fw.before {
            return;
        }
        tracing::error!(
            key,
            token,
            revision = rev,
            floor = fw.before,
            "a grant's token is not above this gateway's token floor: etcd was restored or replaced and a gateway \
             that missed the tokens issued since is granting again; no grant is acknowledged here until it is gone \
             (run `fencegate cluster raise-floor --to {floor}`)",
            floor = fw.before
        );
        let grant = events
            .iter()
            .filter_map(etcd_client::Event::kv)
            .find(|g| g.mod_revision() == rev && matches!(self.keys.kind(g.key()), Kind::Grant(k) if k == key));
        let lease_hash =
            grant.and_then(|g| serde_json::from_slice::<GrantValue>(g.value()).ok()).map(|v| v.s).unwrap_or_default();
        fw.held.entry(rev).or_default().push((key.to_string(), lease_hash));
        // Ended here only if it cannot have been answered: this gateway was
        // a member, current, since before it (a gateway paused past its
        // member TTL gets the grants made meanwhile from its watch too).
        if let Some(g) = grant.filter(|_| self.member_before(rev)) {
            fw.to_end.push((key.to_string(), g.value().to_vec()));
        }
    }

    /// [`Cluster::check_against_floor`] for a full read at `revision`: a
    /// grant read whose token is not above this gateway's floor and that
    /// it did not know before (its key, create revision and lease-id hash)
    /// was made in another numbering (etcd restored or replaced) by a
    /// gateway with a lower floor — in one history, a grant made while this
    /// gateway's watch was down has a token above every token it had seen:
    /// held back as if the watch had delivered it. A gateway that comes back
    /// through a full read (paused, cut off) must not acknowledge it either.
    /// On the first read of a process nothing was known before: then only
    /// while etcd is behind the floor (every token it could issue now is at
    /// or below it) — once etcd's revisions have passed the floor, a new
    /// process cannot tell a repeated token from an old grant it saw in its
    /// previous life.
    fn hold_unknown_grants_below_floor(&self, kvs: &[KeyValue], revision: i64, known: &KnownGrants, first_load: bool) {
        let floor = self.floor.get();
        let offset = self.lock_mirror().offset;
        if first_load {
            if floor < token_of(offset, revision, Some(super::TOKEN_SLOTS - 1)) {
                return;
            }
            // In one history etcd's numbering is never behind a token this
            // gateway saw: etcd was restored or replaced. The grants and
            // fences read are of the snapshot's time — a grant released
            // since, whose holder was superseded, reads live, and its
            // key's fence is back at that holder's token — and a new
            // process remembers no later fence. So, as when the raft log
            // is found behind (`raft.rs`), it admits nothing until
            // `raise-floor` (which ends those grants and raises those
            // fences) — an outside review landed writes under such a grant
            // with nobody running `raise-floor`.
            self.restore_found(revision);
        }
        for kv in kvs {
            let Kind::Grant(key) = self.keys.kind(kv.key()) else { continue };
            let Ok(value) = serde_json::from_slice::<GrantValue>(kv.value()) else { continue };
            let token = token_of(value.o, kv.create_revision(), value.i);
            if token > floor || known.contains(&(key.to_string(), kv.create_revision(), value.s.clone())) {
                continue;
            }
            tracing::error!(
                key,
                token,
                revision = kv.create_revision(),
                floor,
                "a grant read from etcd has a token not above this gateway's token floor and was not seen before: \
                 etcd was restored or replaced; no grant is acknowledged here until it is gone"
            );
            let mut fw = self.floor_watch.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            // Held back only, never ended here: it may have been answered
            // while this gateway was away (not a member, so not waited for).
            fw.held.entry(kv.create_revision()).or_default().push((key.to_string(), value.s.clone()));
        }
    }

    /// The lowest revision held back by [`Cluster::check_against_floor`]
    /// whose grant still exists in the mirror (those gone are dropped): the
    /// same key, create revision and lease-id hash — a grant of another
    /// history at the same revision is not the one held back.
    fn first_held_back(&self) -> Option<i64> {
        let mut fw = self.floor_watch.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if fw.held.is_empty() {
            return None;
        }
        let m = self.lock_mirror();
        fw.held.retain(|rev, keys| {
            keys.iter()
                .any(|(k, s)| m.grants.get(k).is_some_and(|g| g.created == *rev && (s.is_empty() || g.value.s == *s)))
        });
        fw.held.keys().next().copied()
    }

    /// Wakes the ack writer: the ack target may have moved.
    pub(super) fn recompute_activated(&self) {
        self.ack_kick.notify_one();
    }

    /// Feeds the mirror from the watch; reloads after any break (a move
    /// to another etcd member only starts the watch again there).
    pub(super) async fn run_feed(self: Arc<Self>, mut from: i64) {
        let mut backoff = Duration::from_millis(100);
        loop {
            if self.stop.is_triggered() {
                return;
            }
            self.feed_ok.store(true, Ordering::Release);
            let watched = tokio::time::Instant::now();
            let end = tokio::select! {
                end = self.watch_from(from) => end,
                () = self.stop.wait() => return,
            };
            // A move to another member reloads as a break does: the watch
            // is not resumed from the revision after the last one applied,
            // for the member moved to may serve another history — etcd
            // restored from a snapshot while the gateway was paused: every
            // member restarted, so the broken watch and a move come
            // together, and a watch resumed in the old numbering skipped
            // the new history's fences at revisions this gateway had seen
            // (`a_gateway_whose_etcd_was_restored_under_it_reads_the_new_history_in_full`
            // admitted a stale write that way once the lapse, 2026-12-05,
            // sent its etcd request before the watch read its error).
            let moved = matches!(end, WatchEnd::Moved);
            let why = match end {
                WatchEnd::Moved => "this gateway's etcd requests moved to another member".to_string(),
                WatchEnd::Broken(why) => why,
            };
            self.feed_ok.store(false, Ordering::Release);
            self.fences.set_not_current("the gateway's etcd watch may be behind; resynchronising");
            self.metrics.cluster_current.set(0);
            self.metrics.cluster_resyncs.inc();
            tracing::warn!(gateway = %self.gateway_id, reason = %why, "etcd watch broken; reloading");
            // A watch that lasted is reloaded at once (the gateway refuses
            // mutations until then: an etcd member lost costs its watchers
            // one consistent read); one that broke soon after it started,
            // and every failed reload, waits a growing pause.
            let mut pause = !moved && watched.elapsed() < Duration::from_secs(1);
            loop {
                if pause {
                    tokio::select! {
                        () = tokio::time::sleep(backoff) => {}
                        () = self.stop.wait() => return,
                    }
                }
                pause = true;
                match self.load().await {
                    Ok(next) => {
                        from = next;
                        backoff = Duration::from_millis(100);
                        // Current again after the next membership round
                        // (its proof comes back on the new watch): now,
                        // not a third of the member TTL later.
                        self.round_kick.notify_one();
                        break;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "reloading from etcd failed; retrying");
                        backoff = (backoff * 2).min(Duration::from_secs(2));
                    }
                }
            }
        }
    }

    /// Watches from `from` until the watch breaks (why) or the gateway's
    /// etcd requests moved to another member.
    async fn watch_from(&self, from: i64) -> WatchEnd {
        // A start refused by a dead member (the client's balancer keeps
        // handing out its endpoint) is tried again on another within the
        // timeout: no event was received, so starting at `from` later is
        // the same watch, and the gateway stays as current as it is in the
        // moment between a reload and its watch.
        let opts = WatchOptions::new().with_prefix().with_start_revision(from);
        let start = self.etcd.call_repeatable_on(self.timeout, "starting the watch", || {
            let mut client = self.etcd.watch_client();
            let opts = opts.clone();
            async move { client.watch(self.keys.prefix.as_str(), Some(opts)).await }
        });
        let (mut stream, turn) = match start.await {
            Ok(s) => s,
            Err(e) => return WatchEnd::Broken(e.to_string()),
        };
        let this = self.watch_count.fetch_add(1, Ordering::AcqRel) + 1;
        loop {
            let next = tokio::select! {
                next = stream.message() => next,
                () = self.watch_stall_kick.notified() => {
                    if self.watch_stalled.load(Ordering::Acquire) != this {
                        continue;
                    }
                    // Its member may hang with the connection open: the
                    // reload and the next watch go to the next member.
                    self.etcd.move_on(turn).await;
                    return WatchEnd::Broken(
                        "the watch did not deliver a write etcd had acknowledged (its member may hang)".into(),
                    );
                }
                // The gateway's requests went to another member (this one
                // refused or hung, or the leader is elsewhere): the watch
                // follows them.
                () = self.etcd.moved_from(turn) => return WatchEnd::Moved,
            };
            let msg = match next {
                Ok(Some(m)) => m,
                Ok(None) => return WatchEnd::Broken("the watch stream ended".into()),
                Err(e) => return WatchEnd::Broken(format!("watch error: {e}")),
            };
            if msg.canceled() {
                if msg.compact_revision() > 0 {
                    return WatchEnd::Broken(format!("compacted at revision {}", msg.compact_revision()));
                }
                return WatchEnd::Broken(format!("watch cancelled: {}", msg.cancel_reason()));
            }
            let mut last = 0;
            for ev in msg.events() {
                let Some(kv) = ev.kv() else { continue };
                match ev.event_type() {
                    EventType::Put => {
                        match self.keys.kind(kv.key()) {
                            Kind::Fence(key) => {
                                self.check_against_floor(key, kv.mod_revision(), fence_token(kv), msg.events())
                            }
                            Kind::Offset => {
                                // The floor it was raised to: written in
                                // the same transaction, so at the same
                                // revision, in the same response.
                                let floor_key = self.keys.raised_to();
                                let to = msg
                                    .events()
                                    .iter()
                                    .filter_map(etcd_client::Event::kv)
                                    .find(|o| o.key() == floor_key.as_bytes() && o.mod_revision() == kv.mod_revision())
                                    .and_then(|o| o.value_str().ok()?.trim().parse::<u64>().ok());
                                self.offset_written(kv, to);
                            }
                            _ => {}
                        }
                        self.apply_put(kv);
                    }
                    EventType::Delete => self.apply_delete(kv.key()),
                }
                last = last.max(kv.mod_revision());
            }
            if last > 0 {
                self.applied.send_modify(|v| *v = (*v).max(last));
                self.recompute_activated();
            }
        }
    }

    /// Writes `a/GW` whenever the activated revision moves (coalesced).
    pub(super) async fn run_acks(self: Arc<Self>) {
        loop {
            tokio::select! {
                () = self.ack_kick.notified() => {}
                () = self.stop.wait() => return,
            }
            let to_end =
                std::mem::take(&mut self.floor_watch.lock().unwrap_or_else(std::sync::PoisonError::into_inner).to_end);
            if !to_end.is_empty() {
                tokio::spawn(self.clone().end_held(to_end));
            }
            let written = *self.ack_lock.lock().await;
            if self.ack_target() > written {
                // While a shared transaction is in flight (the gateway is
                // busy granting and releasing), in the next one, with the
                // grants, renewals and releases that go out with it: one
                // etcd proposal for all. Otherwise at once, in a request of
                // its own: a grant that comes meanwhile does not wait
                // behind it (one client cycling, 3 gateways: acquire p50
                // 4.9 ms in a run with every acknowledgement in the shared
                // transaction, 3.2-3.7 ms in runs without, the same day;
                // docs/cluster.md). A failure is retried by the next kick
                // or heartbeat.
                let _ = if self.batching.load(Ordering::Acquire) {
                    self.ack_in_batch().await
                } else {
                    self.write_ack().await.map(|_| true)
                };
            }
        }
    }

    /// Ends grants the watch delivered that are held back below this
    /// gateway's token floor ([`Cluster::check_against_floor`]): their
    /// tokens were issued before (or an operator's `raise-floor` put them
    /// below the floor) and they wait for this gateway's acknowledgement,
    /// so none was answered; left until it expires, one would hold every
    /// later grant of the cluster back for its TTL × 1.1 — when the gateway
    /// that made it died, nobody else would end it. Each ends only if its
    /// value is still the one held back (the value holds the grant's random
    /// lease-id hash: a grant of another history at the same revision, after
    /// a second restore, is not touched). Grants held back from a full read
    /// are never ended here (they may have been answered meanwhile).
    async fn end_held(self: Arc<Self>, grants: Vec<(String, Vec<u8>)>) {
        for (key, value) in grants {
            match self.end_grant_by_value(&key, value).await {
                Ok(ended) => {
                    tracing::warn!(key, ended, "a grant held back below this gateway's token floor was ended here")
                }
                Err(e) => tracing::warn!(
                    key,
                    error = %e,
                    "ending a grant held back below the token floor failed; it holds grants back until it expires"
                ),
            }
        }
    }

    /// What this gateway's acknowledgement would put now, after `last`
    /// (read under the ack lock), and the member lease it goes on.
    pub(super) fn ack_to_write(&self, last: i64) -> Result<(i64, i64), Error> {
        if let Some(why) = self.restored_refusal() {
            return Err(Error::Unavailable(why));
        }
        let Some(lease) = self.member_lease() else {
            return Err(Error::Unavailable("not a member".into()));
        };
        // Acknowledgements only go up — but never over a grant held back
        // (`check_against_floor`): one written in an old numbering before
        // a restore would otherwise cover it.
        let target = if self.first_held_back().is_some() { self.ack_target() } else { self.ack_target().max(last) };
        Ok((target, lease))
    }

    /// Puts the current ack target on the membership lease, in a request
    /// of its own (the membership's proof needs the put's revision; the
    /// ack writer sends its puts with the shared transaction instead,
    /// `batch.rs`); returns the put's revision. Serialised, so acks only
    /// ever go up.
    pub(super) async fn write_ack(&self) -> Result<i64, Error> {
        let mut last = self.ack_lock.lock().await;
        let (target, lease) = self.ack_to_write(*last)?;
        let resp = self
            .etcd
            .call_repeatable(self.timeout, "acknowledging", || {
                let (mut kv, key) = (self.etcd.kv_client(), self.keys.ack(&self.gateway_id));
                async move { kv.put(key, target.to_string(), Some(PutOptions::new().with_lease(lease))).await }
            })
            .await?;
        *last = target;
        Ok(resp.header().map_or(0, |h| h.revision()))
    }
}

/// How a watch ended.
enum WatchEnd {
    /// It broke: the gateway reloads everything.
    Broken(String),
    /// The gateway's etcd requests moved to another member: the watch goes
    /// on there.
    Moved,
}
