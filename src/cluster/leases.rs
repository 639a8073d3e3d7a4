//! The lease API over etcd: acquire, renew, release, status, watch, with
//! the same bodies and errors as the embedded authority (docs/lease-api.md).
//!
//! - acquire: one transaction: `g/KEY` absent, no older waiter, the
//!   offset unchanged → put `g/KEY` (no etcd lease), put `f/KEY`, drop
//!   this waiter's entry (a sub-transaction of a transaction shared with
//!   the operations queued meanwhile, see `batch`). A waiter queues
//!   `q/KEY\0ID` on its gateway's membership lease and tries again only
//!   when its mirror says the key is free and it is the oldest waiter, so a
//!   release wakes only the next waiter in the whole cluster. Then
//!   activation (every live member acknowledged) and the durable floor,
//!   before the answer. An activation over within a third of the TTL is
//!   answered at once with the time left of the grant's certain lifetime;
//!   a longer one is renewed meanwhile and once more before its answer.
//! - renew: the grant's lease-id hash compared (with the mirror's copy, or
//!   etcd's when the mirror has not seen the grant), then `g/KEY` put again
//!   if its create revision is still the grant's (shared transaction).
//! - release: the hash compared likewise, then `g/KEY` deleted if its
//!   create revision is still the grant's (shared transaction).
//! - status and watch: from the mirror, which the watch keeps current
//!   (the time left from this gateway's expiry deadline).

use std::sync::Arc;
use std::time::Duration;

use etcd_client::PutOptions;
use tokio::time::Instant;

use super::batch::{Attempt, Granting, Orphan};
use super::mirror::GrantValue;
use super::{token_of, Cluster};
use crate::authority::types::{new_lease_id, secret_eq, validate_ttl};
use crate::authority::{validate_key, AcquireRequest, GrantView, ReleaseRequest, RenewRequest, RenewView, StatusView};
use crate::error::Error;

/// The shortest TTL a grant gets in cluster mode: its answer counts from
/// before the grant transaction, less ε and a 200 ms margin (the
/// membership deadline's), which leave a shorter TTL little or nothing to
/// answer with. (etcd's own lease floor on default settings, which grants
/// had when each had an etcd lease.)
const MIN_GRANT_TTL_MS: u64 = 2000;

fn sha256_hex(s: &str) -> String {
    let d = ring::digest::digest(&ring::digest::SHA256, s.as_bytes());
    d.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Deletes this acquire's waiter entry (and ends its unanswered grant)
/// however the acquire ends, including a client that hung up.
struct Cleanup {
    cluster: Arc<Cluster>,
    /// The waiter entry and the membership lease it is put on: recorded
    /// before the put is sent, since a put that timed out may still have
    /// been applied.
    queue: Option<(String, i64)>,
    /// A grant committed for this acquire and not answered yet.
    orphan: Orphan,
}

/// How long a cleanup keeps trying (with backoff) while etcd does not answer.
const CLEANUP_FOR: Duration = Duration::from_secs(600);

impl Drop for Cleanup {
    fn drop(&mut self) {
        // Ends the grant (through the shared transaction) unless answered.
        self.orphan.abandon(&self.cluster.batches);
        let Some((q, member)) = self.queue.take() else { return };
        let c = self.cluster.clone();
        tokio::spawn(async move {
            // An entry left behind would be the oldest waiter of its key
            // for as long as this gateway stays a member, and no grant of
            // the key could pass it: tried until it is gone, or gone with
            // the membership lease it lives on.
            let give_up = Instant::now() + CLEANUP_FOR;
            let mut pause = Duration::from_millis(100);
            while c.member_lease() == Some(member) && !c.stop.is_triggered() && Instant::now() < give_up {
                let deleted = c.etcd.delete_repeatable(c.timeout, "leaving the queue", &q).await;
                if deleted.is_ok() {
                    return;
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
            }
        });
    }
}

/// A grant just made by [`Cluster::try_grant`], not yet activated.
struct Granted {
    token: u64,
    /// The revision of the granting transaction (the grant's create revision).
    revision: i64,
    /// The grant's value as written (renewals put it again).
    value: Vec<u8>,
    /// When its transaction was handed to the batcher: every gateway's
    /// expiry deadline falls after `sent + TTL`.
    sent: Instant,
}

/// Aborts its task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Cluster {
    /// `POST /v1/locks/acquire` in cluster mode.
    pub async fn acquire(self: &Arc<Self>, req: AcquireRequest) -> Result<GrantView, Error> {
        let result = self.acquire_inner(req).await;
        let outcome = match &result {
            Ok(_) => Some("ok"),
            Err(Error::Locked { .. }) => Some("locked"),
            Err(Error::BadRequest(_)) => Some("invalid"),
            Err(_) => None,
        };
        if let Some(o) = outcome {
            self.metrics.lock_request("acquire", o);
        }
        result
    }

    async fn acquire_inner(self: &Arc<Self>, req: AcquireRequest) -> Result<GrantView, Error> {
        let holder = req.validate(&self.limits)?;
        let started = Instant::now();
        let wait_until = started + Duration::from_millis(req.wait_ms);
        let lease_id = new_lease_id()?;
        let secret = sha256_hex(&lease_id);
        let granted_ms = req.ttl_ms.max(MIN_GRANT_TTL_MS);
        let key = req.key.as_str();
        let mut cleanup = Cleanup { cluster: self.clone(), queue: None, orphan: Orphan::default() };
        let mut mine: Option<i64> = None;
        let mut applied = self.applied.subscribe();
        let mut first = true;
        let granted = loop {
            let may_try = first || self.lock_mirror().may_take(key, mine);
            first = false;
            if may_try {
                let queued = cleanup.queue.as_ref().map(|(q, _)| q.as_str()).zip(mine);
                if let Some(g) = self.try_grant(key, &holder, &secret, granted_ms, queued, &cleanup.orphan).await? {
                    break g;
                }
            }
            if req.wait_ms == 0 {
                return Err(self.locked(key));
            }
            if mine.is_none() {
                let (qkey, member) = self.new_waiter_entry(key)?;
                cleanup.queue = Some((qkey.clone(), member));
                mine = Some(self.enqueue(&qkey, member).await?);
                continue;
            }
            if let Some(q) = mine {
                let gone =
                    *applied.borrow() >= q && !self.lock_mirror().queues.get(key).is_some_and(|s| s.contains(&q));
                if gone {
                    return Err(Error::Unavailable(
                        "this gateway's membership ended while the acquire waited; retry".into(),
                    ));
                }
            }
            if tokio::time::timeout_at(wait_until, applied.changed()).await.is_err() {
                return Err(self.locked(key));
            }
        };
        // The grant exists; it is this acquire's to lose until answered
        // (`cleanup.orphan` ends it on every path that does not answer).
        cleanup.queue = None;
        let token = granted.token;
        let ttl = Duration::from_millis(granted_ms);
        // The client's TTL counts from the answer: the gateway renews the
        // grant while activation waits (ended on any return).
        let _keeper = self.renew_while_activating(key, granted.revision, &granted.value, granted_ms);
        let activation = Instant::now();
        let waited = self.activate(granted.revision).await;
        self.metrics.activation_wait.observe(activation.elapsed().as_secs_f64());
        self.metrics.grants.inc();
        waited?;
        self.floor.raise(token);
        tokio::time::timeout(self.timeout, self.floor.wait_persisted(token))
            .await
            .map_err(|_| Error::Store("the token floor was not written in time".into()))??;
        // The common case: activation took a small part of the TTL. No
        // gateway expires the grant before its feed saw the grant's put plus
        // TTL·(1 + ε), and the put was committed after `sent`; fencegate
        // deletes a grant otherwise only on its holder's release. So up to
        // `safe_until` — the same ε and margin as the gateway's own
        // membership deadline — the grant lives. The answer carries the
        // time left to `safe_until`, counted from the answer, and costs no
        // further etcd round trip.
        let safe_until = Self::deadline_after(granted.sent, ttl);
        let left = safe_until.saturating_duration_since(Instant::now());
        let still_mine = self.lock_mirror().grants.get(key).is_some_and(|g| g.token == token);
        if still_mine && left.as_millis() * 3 >= u128::from(granted_ms) * 2 {
            cleanup.orphan.answered();
            return Ok(GrantView { key: req.key, fencing_token: token, lease_id, ttl_ms: millis(left), holder });
        }
        // Activation took long (the renewals kept the grant meanwhile, but a
        // renewal may have failed and the grant expired): one renewal now,
        // which succeeds only if the grant is still this one, and the answer
        // counts from before it.
        let sent = Instant::now();
        if !self.renew_grant(key, granted.revision, granted.value.clone()).await? {
            return Err(Error::Unavailable(
                "the grant ended while it was being activated: it expired (a renewal failed), or a gateway ended it \
                 as a token not above its token floor (etcd restored or replaced: see that gateway's log); retry"
                    .into(),
            ));
        }
        let left = Self::deadline_after(sent, ttl).saturating_duration_since(Instant::now());
        cleanup.orphan.answered();
        Ok(GrantView { key: req.key, fencing_token: token, lease_id, ttl_ms: millis(left), holder })
    }

    /// Renews the new grant every third of its TTL until the returned guard
    /// is dropped.
    fn renew_while_activating(self: &Arc<Self>, key: &str, created: i64, value: &[u8], granted_ms: u64) -> AbortOnDrop {
        let (c, key, value) = (self.clone(), key.to_string(), value.to_vec());
        let period = Duration::from_millis((granted_ms / 3).max(100));
        AbortOnDrop(tokio::spawn(async move {
            // The grant was just written: the first renewal is due only a
            // third of its TTL later (an activation that ends sooner costs
            // none).
            loop {
                tokio::time::sleep(period).await;
                if !matches!(c.renew_grant(&key, created, value.clone()).await, Ok(true)) {
                    return;
                }
            }
        }))
    }

    fn locked(&self, key: &str) -> Error {
        let retry_after_ms = self.lock_mirror().grants.get(key).map_or(1000, |g| g.value.t);
        Error::Locked { key: key.to_string(), retry_after_ms }
    }

    /// One attempt: the grant on success, `None` when the key is taken or
    /// an older waiter is queued. `queued`: this acquire's waiter entry and
    /// its revision. `orphan` receives the committed grant from the batch,
    /// so that an acquire dropped at any point (its client hung up while
    /// the shared transaction was in flight) or failing below ends the
    /// grant made for nobody at once instead of at its TTL.
    async fn try_grant(
        &self,
        key: &str,
        holder: &str,
        secret: &str,
        granted_ms: u64,
        queued: Option<(&str, i64)>,
        orphan: &Orphan,
    ) -> Result<Option<Granted>, Error> {
        // `raise-floor` moving the offset fails the attempts of the shared
        // transaction in flight (nothing granted): tried again once this
        // gateway's mirror holds the offset's new write, within the etcd
        // timeout (a review found the acquire answered 503 inside its own
        // wait window).
        let give_up = Instant::now() + self.timeout;
        let mut applied = self.applied.subscribe();
        let (committed, sent, floor) = loop {
            if let Some(why) = self.restore_blocks_grants() {
                return Err(Error::Unavailable(why));
            }
            let sent = Instant::now();
            // Every token seen before this transaction was committed earlier
            // in etcd's history, so its revision is above them all — unless
            // that history was rolled back (a restore, a new cluster).
            let floor = self.floor.get();
            // The transaction itself is shared with the other attempts
            // queued meanwhile on this gateway (group commit, see `batch`).
            let (reply, answer) = tokio::sync::oneshot::channel();
            let attempt = Attempt {
                key: key.to_string(),
                secret: secret.to_string(),
                holder: holder.to_string(),
                granted_ms,
                queued: queued.map(|(q, r)| (q.to_string(), r)),
                orphan: orphan.clone(),
                reply,
            };
            // On an unknown outcome the batch itself ends such a grant.
            match self.grant_in_batch(attempt, answer).await? {
                Granting::Committed(c) => break (c, sent, floor),
                Granting::Taken => return Ok(None),
                Granting::OffsetMoved(read_at) => {
                    // Again once the mirror has the offset's new write.
                    while self.lock_mirror().offset_rev == read_at {
                        if !matches!(tokio::time::timeout_at(give_up, applied.changed()).await, Ok(Ok(()))) {
                            return Err(Error::Unavailable(
                                "the token offset moved while granting (`raise-floor` ran) and this gateway's watch \
                                 has not caught up: nothing was granted; retry"
                                    .into(),
                            ));
                        }
                    }
                }
            }
        };
        let (rev, offset) = (committed.revision, committed.offset);
        let token = token_of(offset, rev, Some(committed.slot));
        if token == u64::MAX {
            // `token_of` saturates: every token past the end of the space
            // reads as u64::MAX, so it can name no grant alone (a batch of
            // several would all get it). The grant is ended by `orphan`.
            return Err(Error::Unavailable(format!(
                "the token space is exhausted (etcd revision {rev} with offset {offset} reaches u64::MAX): no token \
                 can be issued without repeating one; the token floor was raised too far"
            )));
        }
        if token <= floor {
            // Withdrawn before anyone saw it: `orphan` ends the grant.
            return Err(Error::Unavailable(format!(
                "etcd's revision {rev} (token {token} with offset {offset}) is not above the token floor {floor}: \
                 etcd was restored or replaced, and granting now could issue a token twice; an operator must run \
                 `fencegate cluster raise-floor --to {floor}`"
            )));
        }
        Ok(Some(Granted { token, revision: rev, value: committed.value, sent }))
    }

    /// A new waiter entry's key for `key`, and the membership lease it
    /// goes on.
    fn new_waiter_entry(&self, key: &str) -> Result<(String, i64), Error> {
        let Some(member) = self.member_lease() else {
            return Err(Error::Unavailable("this gateway has not joined its cluster; retry".into()));
        };
        let id = new_lease_id()?;
        Ok((format!("{}{}-{}", self.keys.queue_prefix(key), self.gateway_id, &id[..16]), member))
    }

    /// Puts the waiter entry `qkey` on the membership lease `member`;
    /// returns its create revision (its place in the queue).
    async fn enqueue(&self, qkey: &str, member: i64) -> Result<i64, Error> {
        let resp = self
            .etcd
            .call(self.timeout, "queueing", || {
                let (mut kv, qkey) = (self.etcd.kv_client(), qkey.to_string());
                async move { kv.put(qkey, "", Some(PutOptions::new().with_lease(member))).await }
            })
            .await?;
        Ok(resp.header().map_or(0, |h| h.revision()))
    }
}

impl Cluster {
    /// The grant of `key` the caller's lease id names: from this gateway's
    /// mirror when it holds the key with the id's hash (the hash is of a
    /// random id, so the grant there is this one), else as etcd has it now
    /// (a consistent read). Its value, create revision and token.
    async fn find_grant(&self, key: &str, lease_id: &str) -> Result<Option<(GrantValue, i64, u64)>, Error> {
        let hashed = sha256_hex(lease_id);
        let known = self
            .lock_mirror()
            .grants
            .get(key)
            .filter(|g| secret_eq(&g.value.s, &hashed))
            .map(|g| (g.value.clone(), g.created, g.token));
        match known {
            Some(k) => Ok(Some(k)),
            None => self.own_grant(key, lease_id).await,
        }
    }

    /// The grant of `key` as etcd has it now (a consistent read), if its
    /// lease id hashes to the stored one.
    async fn own_grant(&self, key: &str, lease_id: &str) -> Result<Option<(GrantValue, i64, u64)>, Error> {
        let resp = self
            .etcd
            .call_repeatable(self.timeout, "reading a grant", || {
                let (mut kv, gkey) = (self.etcd.kv_client(), self.keys.grant(key));
                async move { kv.get(gkey, None).await }
            })
            .await?;
        let Some(found) = resp.kvs().first() else { return Ok(None) };
        let Ok(value) = serde_json::from_slice::<GrantValue>(found.value()) else { return Ok(None) };
        if !secret_eq(&value.s, &sha256_hex(lease_id)) {
            return Ok(None);
        }
        let token = token_of(value.o, found.create_revision(), value.i);
        Ok(Some((value, found.create_revision(), token)))
    }

    /// `POST /v1/locks/renew`: `g/KEY` put again if it is still this grant
    /// (its create revision), which restarts every gateway's expiry
    /// deadline. A renewal extends by the grant's TTL (`ttl_ms` in the
    /// answer); a `ttl_ms` in the request is checked but does not change it.
    pub async fn renew(&self, req: RenewRequest) -> Result<RenewView, Error> {
        let result = self.renew_inner(req).await;
        let outcome = match &result {
            Ok(_) => Some("ok"),
            Err(Error::LeaseLost { .. }) => Some("lost"),
            Err(Error::BadRequest(_)) => Some("invalid"),
            Err(_) => None,
        };
        if let Some(o) = outcome {
            self.metrics.lock_request("renew", o);
        }
        result
    }

    async fn renew_inner(&self, req: RenewRequest) -> Result<RenewView, Error> {
        validate_key(&req.key)?;
        if let Some(ttl_ms) = req.ttl_ms {
            validate_ttl(ttl_ms, &self.limits)?;
        }
        let lost = || Error::LeaseLost { key: req.key.clone() };
        // While a restore stands (found here or by a peer), every grant in
        // etcd is of before it — brought back by the snapshot, perhaps
        // superseded in the history it lost — and `raise-floor` will end
        // it: none is renewed.
        if let Some(why) = self.restore_blocks_grants() {
            return Err(Error::Unavailable(why));
        }
        let Some((value, created, token)) = self.find_grant(&req.key, &req.lease_id).await? else {
            return Err(lost());
        };
        let bytes = serde_json::to_vec(&value).map_err(|e| Error::Internal(format!("encoding a grant: {e}")))?;
        let sent = Instant::now();
        if !self.renew_grant(&req.key, created, bytes).await? {
            return Err(lost());
        }
        // Every gateway's expiry deadline for the new put counts from when
        // it saw the put, after `sent`, plus TTL·1.1. The answer promises
        // only what is certain from `sent` (the same ε and margin as an
        // acquire's answer and the membership), counted from the answer: a
        // renewal answered late (a paused gateway, a slow etcd) promises
        // less, never a full TTL the grant may no longer have.
        let left = Self::deadline_after(sent, Duration::from_millis(value.t)).saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::Unavailable(
                "the renewal was committed but answered too late to promise any time; renew again".into(),
            ));
        }
        Ok(RenewView { key: req.key, fencing_token: token, ttl_ms: millis(left) })
    }

    /// `POST /v1/locks/release`: deletes `g/KEY` if it is still this grant
    /// (its create revision).
    pub async fn release(&self, req: ReleaseRequest) -> Result<(), Error> {
        let result = self.release_inner(&req).await;
        let outcome = match &result {
            Ok(()) => Some("ok"),
            Err(Error::NotOwner { .. }) => Some("not_owner"),
            Err(Error::BadRequest(_)) => Some("invalid"),
            Err(_) => None,
        };
        if let Some(o) = outcome {
            self.metrics.lock_request("release", o);
        }
        result
    }

    async fn release_inner(&self, req: &ReleaseRequest) -> Result<(), Error> {
        validate_key(&req.key)?;
        let not_owner = || Error::NotOwner { key: req.key.clone() };
        // The stored hash is of the grant's random lease id, so the grant
        // found is this one: deleting it by its create revision ends exactly
        // this grant, or finds it already ended.
        let Some((_, created, _)) = self.find_grant(&req.key, &req.lease_id).await? else {
            return Err(not_owner());
        };
        if !self.end_grant(&req.key, created).await? {
            return Err(not_owner());
        }
        // Gone from this gateway's view at once, before the answer: a
        // strict write under it through this gateway is refused from now
        // on, not only once the watch delivers the delete (the outside
        // review saw writes sent within 0.2 ms of the answer forwarded).
        let mut m = self.lock_mirror();
        if m.grants.get(&req.key).is_some_and(|g| g.created == created) {
            m.grants.remove(&req.key);
        }
        Ok(())
    }

    /// `GET /v1/locks/status` from this gateway's mirror; the time left is
    /// to this gateway's expiry deadline, never above the TTL.
    pub async fn status(&self, key: &str) -> Result<StatusView, Error> {
        validate_key(key)?;
        let fence = self.fences.durable_fence(key);
        let grant = self.lock_mirror().grants.get(key).cloned();
        let Some(g) = grant else {
            return Ok(StatusView::free(key, fence));
        };
        let left = millis(g.deadline.saturating_duration_since(Instant::now())).min(g.value.t);
        Ok(StatusView {
            key: key.to_string(),
            fence: fence.max(g.token),
            held: true,
            fencing_token: Some(g.token),
            holder: Some(g.value.h.clone()),
            expires_in_ms: Some(left),
        })
    }

    /// `GET /v1/locks/watch`: until the holder's token differs from
    /// `after` (0: no holder), as this gateway's watch sees it.
    pub async fn watch(&self, key: &str, after: u64, timeout: Duration) -> Result<StatusView, Error> {
        validate_key(key)?;
        let timeout = timeout.min(Duration::from_millis(self.limits.max_watch_timeout_ms));
        let mut rx = self.applied.subscribe();
        let changed = rx.wait_for(|_| self.lock_mirror().holder_token(key) != after);
        let _ = tokio::time::timeout(timeout, changed).await;
        self.status(key).await
    }

    /// The holder label of `key`'s live grant, for audit lines.
    pub fn holder_of(&self, key: &str) -> String {
        self.lock_mirror().grants.get(key).map(|g| g.value.h.clone()).unwrap_or_default()
    }

    /// Activation across gateways: returns once every member that was live
    /// when this gateway's watch reached `rev` has acknowledged `rev`, or
    /// has gone (drained, or its quarantine — the longest upstream timeout
    /// after its departure — is over), and the quarantine of every member
    /// that vanished without draining before it is over too.
    async fn activate(&self, rev: i64) -> Result<(), Error> {
        let deadline = Instant::now() + Duration::from_millis(self.limits.activation_timeout_ms);
        let mut rx = self.applied.subscribe();
        if tokio::time::timeout_at(deadline, rx.wait_for(|a| *a >= rev)).await.is_err() {
            return Err(Error::Unavailable("this gateway's etcd watch did not deliver its own grant in time".into()));
        }
        let members: Vec<(String, i64)> =
            self.lock_mirror().members.iter().map(|(gw, m)| (gw.clone(), m.lease)).collect();
        loop {
            // A restore found meanwhile by any gateway: not answered.
            if let Some(why) = self.restore_blocks_grants() {
                return Err(Error::Unavailable(why));
            }
            let (missing, quarantine_until) = {
                let m = self.lock_mirror();
                let mut missing: Vec<&str> = Vec::new();
                // A member that vanished without draining shortly before
                // this grant may still have requests on their way to an
                // upstream: its quarantine counts too.
                let mut until: Option<Instant> =
                    m.departed.values().filter_map(|d| d.undrained_since()).map(|at| at + self.quarantine).max();
                // A member that left before this gateway's last full read
                // is unknown here: one quarantine from that read.
                until = until.max(m.loaded_at.map(|t| t + self.quarantine));
                for (gw, lease) in &members {
                    match m.members.get(gw) {
                        // A member that marked itself drained still counts
                        // until its key goes (it revokes its lease right
                        // after): a `drained` put by hand, which cannot be
                        // told from its own, must not let a grant skip a
                        // gateway that still runs (review finding).
                        Some(e) if e.lease == *lease => {
                            if m.acks.get(gw).copied().unwrap_or(0) < rev {
                                missing.push(gw);
                            }
                        }
                        _ => {
                            let left = match m.departed.get(gw) {
                                Some(d) if d.lease == *lease && d.drained => None,
                                Some(d) if d.lease == *lease => Some(d.at + self.quarantine),
                                // Replaced by a new incarnation unseen: from now.
                                _ => Some(Instant::now() + self.quarantine),
                            };
                            until = until.max(left);
                        }
                    }
                }
                (missing, until)
            };
            if missing.is_empty() {
                if let Some(u) = quarantine_until {
                    if u > deadline {
                        return Err(Error::Unavailable(
                            "a quarantine (a gateway left without draining, or this gateway reloaded its view of the cluster) \
                             outlasts activation_timeout_ms; retry".into(),
                        ));
                    }
                    if u > Instant::now() {
                        // Looked at again every 100 ms: a quarantine can
                        // be lifted meanwhile (the first load's, once the
                        // member history is known whole).
                        tokio::time::sleep_until(u.min(Instant::now() + Duration::from_millis(100))).await;
                        continue;
                    }
                }
                return Ok(());
            }
            if tokio::time::timeout_at(deadline, rx.changed()).await.is_err() {
                return Err(Error::Unavailable(not_acknowledged(&missing)));
            }
        }
    }
}

/// Why activation gave up, naming the gateways that did not acknowledge
/// (the first few): an operator must know which one holds the cluster up.
fn not_acknowledged(missing: &[&str]) -> String {
    const NAMED: usize = 5;
    let mut names = missing.iter().take(NAMED).copied().collect::<Vec<_>>().join(", ");
    if missing.len() > NAMED {
        names.push_str(&format!(" and {} more", missing.len() - NAMED));
    }
    format!(
        "{} gateway(s) did not acknowledge the grant within activation_timeout_ms: {names}. A gateway paused or cut \
         off from etcd counts until its membership lease expires; one whose token floor is not below this grant's \
         token, or that found etcd restored (its raft log behind what it saw), holds it back until `fencegate \
         cluster raise-floor` (its log says so; see docs/cluster.md)",
        missing.len()
    )
}

#[cfg(test)]
mod tests {
    use super::not_acknowledged;

    #[test]
    fn an_activation_failure_names_the_gateways_that_did_not_acknowledge() {
        let one = not_acknowledged(&["gw3"]);
        assert!(
            one.starts_with("1 gateway(s) did not acknowledge the grant within activation_timeout_ms: gw3."),
            "{one}"
        );
        let many = not_acknowledged(&["a", "b", "c", "d", "e", "f", "g"]);
        assert!(
            many.starts_with(
                "7 gateway(s) did not acknowledge the grant within activation_timeout_ms: a, b, c, d, e and 2 more."
            ),
            "{many}"
        );
    }
}
