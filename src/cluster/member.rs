//! Membership and self-fencing. The gateway holds `m/GW` on its own etcd
//! lease and keeps it alive with at most one keepalive in flight. After a
//! keepalive sent at `s` is acknowledged, etcd keeps the lease until at
//! least `s + TTL` (a leader change only extends it), so the gateway's own
//! deadline `s + TTL·(1−ε) − margin`, on the monotonic clock, always falls
//! before etcd could declare it dead and a peer's grant could skip it.
//!
//! The deadline is moved only when the watch is also proved current: after
//! each keepalive the gateway puts its acknowledgement key and waits to see
//! that very put come back on its watch (etcd 3.4's progress notifications
//! are not reliable for this). Past the deadline, or while the watch is
//! broken, the fence table refuses mutations (`not_current`) and aborts
//! uploads still streaming; the gateway rejoins with a new lease, and is
//! current again once its watch has caught up with its new member key.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp};
use tokio::time::Instant;

use super::Cluster;
use crate::error::Error;

/// ε: the share of the TTL given up to clock-rate differences.
pub(super) const EPSILON: f64 = 0.1;
/// Margin for scheduling delays between the check and the forward.
const MARGIN: Duration = Duration::from_millis(200);
/// Pause before a failed keepalive round is tried again.
const RETRY: Duration = Duration::from_millis(100);

impl Cluster {
    /// The local deadline after a keepalive sent at `sent` got `ttl`.
    pub(super) fn deadline_after(sent: Instant, ttl: Duration) -> Instant {
        (sent + ttl.mul_f64(1.0 - EPSILON)).checked_sub(MARGIN).unwrap_or(sent)
    }

    pub(super) async fn run_member(self: Arc<Self>) {
        loop {
            if self.stop.is_triggered() {
                return;
            }
            let why = tokio::select! {
                why = self.membership_term() => why,
                () = self.stop.wait() => return,
            };
            self.fences.set_not_current(why);
            self.metrics.cluster_current.set(0);
            tracing::warn!(gateway = %self.gateway_id, reason = why, "not current; rejoining the cluster");
            if let Some(old) = self.member_lease() {
                let since = self.membership.lock().unwrap_or_else(std::sync::PoisonError::into_inner).since;
                self.set_member_lease(None, 0);
                tokio::select! {
                    () = self.leave_lapsed(old, since) => {}
                    () = self.stop.wait() => return,
                }
            }
            tokio::select! {
                () = tokio::time::sleep(Duration::from_millis(200)) => {}
                () = self.stop.wait() => return,
            }
        }
    }

    /// Ends a membership that lapsed (the gateway already refuses
    /// mutations and has cut off uploads still streaming). Once every
    /// mutation admitted under it has ended, it marks its member key
    /// drained — only while that key is still the one it created, on its
    /// lease, so never after etcd expired the lease or someone deleted the
    /// key — and revokes the lease: peers then see a drained departure and
    /// their grants wait no quarantine for it, as after a clean stop. The
    /// quarantine is for requests a gateway may still have on their way to
    /// an upstream; this one knows it has none (`FenceTable::recheck`
    /// keeps a request checked just before the lapse from slipping past
    /// the count). A mutation still running after the member TTL (an
    /// upstream that hangs) leaves it undrained: peers quarantine it as
    /// before (by then etcd has expired the lease anyway).
    async fn leave_lapsed(&self, lease: i64, since: i64) {
        let idle = self.fences.wait_idle(self.member_ttl).await;
        let drained = if !idle {
            tracing::warn!(
                gateway = %self.gateway_id,
                in_flight = self.fences.inflight_total(),
                "mutations admitted before the lapse still run after the member TTL: peers quarantine this gateway"
            );
            false
        } else if since > 0 {
            self.mark_lapse_drained(lease, since).await
        } else {
            false
        };
        self.metrics.cluster_lapses.with_label_values(&[if drained { "drained" } else { "quarantined" }]).inc();
        // Peers then stop waiting for this incarnation (best effort: the
        // lease expires by itself otherwise).
        let _ = self.revoke(lease).await;
    }

    /// Puts `drained` on this gateway's member key, only while it is the
    /// key created at `since` on `lease`; true when it did.
    async fn mark_lapse_drained(&self, lease: i64, since: i64) -> bool {
        let key = self.keys.member(&self.gateway_id);
        let txn = Txn::new()
            .when([
                Compare::create_revision(key.clone(), CompareOp::Equal, since),
                Compare::lease(key.clone(), CompareOp::Equal, lease),
            ])
            .and_then([TxnOp::put(key, "drained", Some(PutOptions::new().with_lease(lease)))]);
        // The same compare and put again is harmless.
        let marked = self.etcd.txn_repeatable(self.timeout, "marking a lapsed membership drained", txn).await;
        match marked {
            Ok(r) if r.succeeded() => {
                tracing::info!(
                    gateway = %self.gateway_id,
                    "nothing admitted before the lapse is in flight: the lapsed membership is marked drained \
                     (peers wait no quarantine for it)"
                );
                true
            }
            // The key went first (etcd expired or revoked the lease — an
            // etcd leader that was paused revokes leases it thinks expired
            // when it runs again — or it was deleted by hand): peers
            // counted a departure that is not drained. Nothing admitted
            // under it is in flight, so the same word goes in `d/GW`.
            Ok(_) => self.record_drained(lease).await,
            Err(e) => {
                tracing::warn!(gateway = %self.gateway_id, error = %e, "marking the lapsed membership drained failed");
                false
            }
        }
    }

    /// Puts `d/GW` = `lease`: the incarnation on `lease`, whose member key
    /// is gone, has nothing in flight (called only once every mutation
    /// admitted under it has ended, and with the gateway not current).
    /// Peers then count its departure drained. True when written.
    async fn record_drained(&self, lease: i64) -> bool {
        let key = self.keys.drained(&self.gateway_id);
        // The same put again is harmless.
        let put = self
            .etcd
            .call_repeatable(self.timeout, "recording a lapsed membership drained", || {
                let (mut kv, key) = (self.etcd.kv_client(), key.clone());
                async move { kv.put(key, lease.to_string(), None).await }
            })
            .await;
        match put {
            Ok(_) => {
                tracing::info!(
                    gateway = %self.gateway_id,
                    lease,
                    "the lapsed membership's key was already gone; nothing admitted under it is in flight: \
                     recorded drained (peers wait no quarantine for it)"
                );
                true
            }
            Err(e) => {
                tracing::warn!(
                    gateway = %self.gateway_id,
                    error = %e,
                    "the lapsed membership's key is gone and recording it drained failed: peers quarantine it"
                );
                false
            }
        }
    }

    /// One membership: join, then keep alive until it cannot be proved.
    /// Returns why it ended.
    async fn membership_term(&self) -> &'static str {
        let ttl_s = i64::try_from(self.member_ttl.as_millis().div_ceil(1000)).unwrap_or(i64::MAX);
        let sent = Instant::now();
        let (lease, granted) = match self.join(ttl_s).await {
            Ok(j) => j,
            Err(e) => {
                tracing::warn!(error = %e, "joining the cluster failed");
                return "the gateway cannot reach etcd to join its cluster";
            }
        };
        let interval = granted / 3;
        let mut deadline = Self::deadline_after(sent, granted);
        // The keepalive stream, and the turn of the member it is open on.
        let mut keeper = None;
        let mut keeper_turn = self.etcd.turn();
        // The join itself is the first round: prove the watch current.
        let mut next_deadline = Some(deadline);
        loop {
            // A round that failed (a keepalive or the proof unanswered: a
            // member down, an election) is tried again soon, not a third
            // of the TTL later: two failures in a row must not cost the
            // membership while the rest of the quorum answers.
            let mut failed = true;
            if let Some(d) = next_deadline.take() {
                if self.restore_stands() {
                    // A restore found (`raft.rs`), here or by another
                    // gateway (its `r/GW` mark): the membership is kept
                    // (peers then wait for the finder's acknowledgement,
                    // which never comes, so no grant is answered anywhere),
                    // and the gateway is never current. Letting it lapse
                    // would make it a departure that peers only quarantine
                    // (review finding: a rejoin every ~2 s let grants through).
                    deadline = d;
                    failed = false;
                    self.metrics.cluster_current.set(0);
                } else if self.prove_current(d).await
                    && self.member_lost.load(std::sync::atomic::Ordering::Acquire) != lease
                {
                    deadline = d;
                    failed = false;
                    self.fences.set_current_until(d);
                    self.metrics.cluster_current.set(1);
                    // A restore found, or a mark seen, while it proved
                    // (after the check above): not current after all.
                    if self.restore_stands() {
                        self.fences.set_not_current("etcd was found restored; waiting for raise-floor");
                        self.metrics.cluster_current.set(0);
                    }
                }
            }
            let pause = if failed { RETRY.min(interval) } else { interval };
            let wake = (Instant::now() + pause).min(deadline);
            tokio::select! {
                () = tokio::time::sleep_until(wake) => {}
                () = self.member_lost_kick.notified() => {}
                () = self.round_kick.notified() => {}
            }
            if self.member_lost.load(std::sync::atomic::Ordering::Acquire) == lease {
                return "this gateway's membership key was deleted from etcd";
            }
            if Instant::now() >= deadline {
                return "the gateway's membership lease may have lapsed (no keepalive acknowledged in time)";
            }
            // One keepalive in flight, bounded by the deadline. Opening
            // the stream sends the first one and reads its answer.
            let sent = Instant::now();
            // A healthy quorum answers a keepalive in milliseconds; one
            // that hangs (its member paused) is given up after half a
            // period and sent again on another connection.
            let budget = deadline.saturating_duration_since(sent).min(self.timeout).min(interval / 2);
            // A stream open on a member that other requests left (it
            // refused or hung) is opened again on the current one.
            if keeper_turn != self.etcd.turn() {
                keeper = None;
            }
            if keeper.is_none() {
                keeper_turn = self.etcd.turn();
            }
            let round = async {
                match keeper.as_mut() {
                    None => {
                        let (k, stream) = self.etcd.lease_client().keep_alive(lease).await?;
                        keeper = Some((k, stream));
                        Ok(Some(granted))
                    }
                    Some((k, stream)) => {
                        k.keep_alive().await?;
                        Ok::<_, etcd_client::Error>(
                            stream.message().await?.map(|r| Duration::from_secs(u64::try_from(r.ttl()).unwrap_or(0))),
                        )
                    }
                }
            };
            match tokio::time::timeout(budget, round).await {
                Ok(Ok(Some(ttl))) if !ttl.is_zero() => next_deadline = Some(Self::deadline_after(sent, ttl)),
                Ok(Ok(Some(_))) => return "the gateway's membership lease expired in etcd",
                Ok(Err(etcd_client::Error::LeaseKeepAliveError(m))) if m.contains("not found") => {
                    return "the gateway's membership lease expired in etcd";
                }
                _ => {
                    // Unanswered in time, refused, or the stream broke: the
                    // next round opens a stream on the next member (the one
                    // it was on may hang with its connection open).
                    keeper = None;
                    self.etcd.move_on(keeper_turn).await;
                }
            }
        }
    }

    /// Grants the membership lease and creates `m/GW` on it, only if no
    /// incarnation of this id holds it: an earlier incarnation (crashed and
    /// restarted before its lease expired) must be seen to leave by every
    /// peer, which then quarantines it, before this one joins.
    async fn join(&self, ttl_s: i64) -> Result<(i64, Duration), Error> {
        let grant = self
            .etcd
            .call_repeatable(self.timeout, "granting the membership lease", || {
                let mut leases = self.etcd.lease_client();
                async move { leases.grant(ttl_s, None).await }
            })
            .await?;
        let lease = grant.id();
        let granted = Duration::from_secs(u64::try_from(grant.ttl()).unwrap_or(0));
        let key = self.keys.member(&self.gateway_id);
        // Peers count this gateway departed only a whole TTL after they
        // last saw it prove itself (`Mirror::remove_member`): they read the
        // TTL here.
        let value = super::mirror::member_value(granted);
        self.set_member_value(value.clone());
        let txn = Txn::new()
            .when(vec![Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then(vec![TxnOp::put(key, value, Some(PutOptions::new().with_lease(lease)))]);
        let created = self.etcd.txn(self.timeout, "joining", txn).await;
        let (created, since) = match created {
            Ok(r) => (r.succeeded(), r.header().map_or(0, |h| h.revision())),
            Err(e) => {
                let _ = self.revoke(lease).await;
                return Err(e);
            }
        };
        if !created {
            let _ = self.revoke(lease).await;
            return Err(Error::Unavailable(format!(
                "etcd: joining: `m/{}` is still held by an earlier incarnation (or another gateway with this id)",
                self.gateway_id
            )));
        }
        self.set_member_lease(Some(lease), since);
        tracing::info!(gateway = %self.gateway_id, lease, ttl_ms = granted.as_millis() as u64, "joined the cluster");
        Ok((lease, granted))
    }

    /// At start: waits for an earlier incarnation's member key to go (its
    /// lease expires within the member TTL; peers then quarantine it). A key
    /// still renewed after twice the member TTL is another live gateway
    /// with the same id: the start fails.
    pub(super) async fn wait_for_id_free(&self) -> Result<(), Error> {
        let limit = Instant::now() + self.member_ttl * 2 + self.timeout;
        let mut logged = false;
        loop {
            let resp = self
                .etcd
                .call_repeatable(self.timeout, "reading the member key", || {
                    let (mut kv, key) = (self.etcd.kv_client(), self.keys.member(&self.gateway_id));
                    async move { kv.get(key, Some(GetOptions::new().with_keys_only())).await }
                })
                .await?;
            if resp.kvs().is_empty() {
                return Ok(());
            }
            if Instant::now() >= limit {
                return Err(Error::Config(format!(
                    "gateway_id `{}` is in use by another live gateway of this cluster (its membership key is still \
                     renewed after twice the member TTL): every gateway needs its own gateway_id",
                    self.gateway_id
                )));
            }
            if !logged {
                tracing::warn!(gateway = %self.gateway_id, "an earlier incarnation of this gateway_id is still a member; waiting for it to expire");
                logged = true;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Puts this gateway's acknowledgement and waits (until `deadline`) to
    /// see it come back on the watch: then every event before it has been
    /// applied here.
    async fn prove_current(&self, deadline: Instant) -> bool {
        if !self.feed_is_ok() || self.floor.restored().is_some() {
            return false;
        }
        let watch = self.watch_count.load(std::sync::atomic::Ordering::Acquire);
        let Ok(rev) = self.write_ack().await else { return false };
        let mut rx = self.applied.subscribe();
        // A watch delivers a write etcd acknowledged within milliseconds;
        // one that has not within half the etcd timeout sits on a member
        // that hangs (or lags far behind): the feed starts again on the
        // next member, and the next round proves the new watch.
        let stall = (Instant::now() + self.timeout / 2).min(deadline);
        let seen = tokio::time::timeout_at(stall, rx.wait_for(|applied| *applied >= rev)).await;
        if matches!(seen, Ok(Ok(_))) {
            return self.feed_is_ok();
        }
        if self.feed_is_ok() && self.watch_count.load(std::sync::atomic::Ordering::Acquire) == watch {
            self.watch_missed(watch);
        }
        false
    }

    /// The feed's watch number `watch` missed a write: it is ended (the
    /// feed reloads and watches again on the next member).
    fn watch_missed(&self, watch: u64) {
        tracing::warn!(gateway = %self.gateway_id, "the etcd watch missed this gateway's acknowledgement; watching again");
        self.watch_stalled.store(watch, std::sync::atomic::Ordering::Release);
        self.watch_stall_kick.notify_one();
    }
}

/// The members that left in a span of etcd's history: member id →
/// (the lease it was on, whether it had drained first, its TTL).
pub(super) type Left = std::collections::HashMap<String, (i64, bool, Duration)>;

impl Cluster {
    /// This gateway's membership lease, waited for until `until` (a
    /// gateway joining or rejoining); `None` past it or at a stop.
    async fn wait_for_membership(&self, until: Instant) -> Option<i64> {
        loop {
            if let Some(lease) = self.member_lease() {
                return Some(lease);
            }
            if Instant::now() >= until || self.stop.is_triggered() {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The first load quarantines everyone (it cannot know who left before
    /// it). Once this gateway is a member, the member keys' history is
    /// replayed from etcd's first revision up to that load's `loaded`
    /// revision: when it is there whole (a cluster never compacted, e.g. a
    /// new one), only the members that left in it without draining are
    /// quarantined, and the blanket quarantine is lifted. Otherwise it
    /// stays (one quarantine from the first load).
    pub(super) async fn narrow_first_quarantine(self: std::sync::Arc<Self>, loaded: i64) {
        let Some(first) = self.lock_mirror().loaded_at else { return };
        if self.wait_for_membership(Instant::now() + self.member_ttl * 2 + self.timeout * 4).await.is_none() {
            return;
        }
        let left = match self.members_left_between(0, loaded).await {
            Ok(left) => left,
            Err(why) => {
                tracing::info!(reason = %why, "the member history is not whole: the first load's quarantine stays");
                return;
            }
        };
        let mut m = self.lock_mirror();
        // A later full read without a replay set a quarantine of its own.
        if m.loaded_at != Some(first) {
            return;
        }
        for (gw, (lease, drained, ttl)) in left {
            if m.departed.get(&gw).is_none_or(|d| d.lease != lease) {
                m.depart(&gw, super::mirror::Departure::new(lease, first + ttl, drained));
            }
        }
        m.loaded_at = None;
        tracing::info!(
            "the member history since etcd's first revision is known: the first load's blanket quarantine is lifted"
        );
    }

    /// Every member key deleted after revision `from` (the last this
    /// gateway's broken watch applied) up to at least `to` (its reload's
    /// read): a reload that knows them needs no blanket quarantine for
    /// members that left unseen. Replays the member prefix from `from + 1`
    /// and, to know where the replay has reached (etcd 3.4's progress
    /// notifications are not reliable), puts this gateway's own member key
    /// again (same value, same lease, only while it still holds it) and
    /// reads until that put comes back. `None` when the replay cannot be
    /// had whole within the etcd timeout (compacted, not a member, etcd
    /// away): the caller then quarantines everyone.
    pub(super) async fn members_left_between(&self, from: i64, to: i64) -> Result<Left, String> {
        // A gateway that lapsed may be rejoining while its feed reloads:
        // its new membership is waited for a little.
        let Some(lease) = self.wait_for_membership(Instant::now() + self.timeout).await else {
            return Err("not a member".to_string());
        };
        let prefix = format!("{}m/", self.keys.prefix);
        let key = self.keys.member(&self.gateway_id);
        let replay = async {
            let opts = etcd_client::WatchOptions::new().with_prefix().with_start_revision(from + 1).with_prev_key();
            // Asked again on the next member while one refuses or hangs
            // (the whole replay has a deadline).
            let (mut stream, _) = self
                .etcd
                .call_repeatable_on(self.timeout, "replaying the members", || {
                    let (mut client, opts) = (self.etcd.watch_client(), opts.clone());
                    let prefix = prefix.clone();
                    async move { client.watch(prefix, Some(opts)).await }
                })
                .await
                .map_err(|e| format!("watching: {e}"))?;
            let value = self.member_value();
            let txn = Txn::new()
                .when([
                    Compare::lease(key.clone(), CompareOp::Equal, lease),
                    Compare::value(key.clone(), CompareOp::Equal, value.clone()),
                ])
                .and_then([TxnOp::put(key.clone(), value, Some(PutOptions::new().with_lease(lease)))]);
            let marked =
                self.etcd.txn(self.timeout, "marking the replay", txn).await.map_err(|e| format!("marking: {e}"))?;
            if !marked.succeeded() {
                return Err("this gateway's member key is no longer its own".to_string());
            }
            let until = marked.header().map_or(0, |h| h.revision());
            if until <= to {
                return Err(format!("the mark's revision {until} is not past the read's {to}"));
            }
            let mut left = Left::new();
            loop {
                let msg = stream.message().await.map_err(|e| format!("replaying: {e}"))?.ok_or("the replay ended")?;
                if msg.canceled() {
                    return Err(format!("the replay was cancelled (compacted at {})", msg.compact_revision()));
                }
                for ev in msg.events() {
                    let Some(kv) = ev.kv() else { continue };
                    if ev.event_type() == etcd_client::EventType::Delete {
                        if let super::Kind::Member(gw) = self.keys.kind(kv.key()) {
                            let prev = ev.prev_kv();
                            let (drained, ttl) = prev.map_or((false, self.member_ttl), |p| {
                                super::mirror::parse_member(p.value(), self.member_ttl)
                            });
                            let lease = prev.map_or(0, etcd_client::KeyValue::lease);
                            // An incarnation that crashed keeps its
                            // quarantine even when a later one drained.
                            let e = left.entry(gw.to_string()).or_insert((lease, drained, ttl));
                            *e = (lease, e.1 && drained, e.2.max(ttl));
                        }
                    }
                    if kv.mod_revision() >= until {
                        return Ok(left);
                    }
                }
            }
        };
        // As long as the load's own read may take.
        let budget = self.timeout * 4;
        tokio::time::timeout(budget, replay).await.map_err(|_| format!("no end within {} ms", budget.as_millis()))?
    }
}
