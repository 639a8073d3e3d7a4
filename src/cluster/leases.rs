//! The lease API over etcd: acquire, renew, release, status, watch, with
//! the same bodies and errors as the embedded authority (docs/lease-api.md).
//!
//! - acquire: a fresh etcd lease L, then one transaction: `g/KEY` absent,
//!   no older waiter, the offset unchanged → put `g/KEY` on L, put `f/KEY`,
//!   drop this waiter's entry (a sub-transaction of a transaction shared
//!   with the attempts queued meanwhile, see `batch`). A waiter queues
//!   `q/KEY\0ID` on its gateway's membership lease and tries again only
//!   when its mirror says the key is free and it is the oldest waiter, so a
//!   release wakes only the next waiter in the whole cluster. Then
//!   activation (every live member acknowledged) and the durable floor,
//!   before the answer. An activation over within a third of the TTL is
//!   answered at once with the time left of the lease's certain lifetime;
//!   a longer one is kept alive, read back and renewed before its answer.
//! - renew: the grant's lease-id hash compared, then one keepalive of L.
//! - release: the hash compared (with the mirror's copy, or etcd's when
//!   the mirror has not seen the grant), then L revoked (which deletes
//!   `g/KEY`).
//! - status and watch: from the mirror, which the watch keeps current.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::PutOptions;
use tokio::time::Instant;

use super::batch::Attempt;
use super::mirror::GrantValue;
use super::{call, token_of, Cluster};
use crate::authority::types::{new_lease_id, secret_eq, validate_ttl};
use crate::authority::{validate_key, AcquireRequest, GrantView, ReleaseRequest, RenewRequest, RenewView, StatusView};
use crate::error::Error;

fn sha256_hex(s: &str) -> String {
    let d = ring::digest::digest(&ring::digest::SHA256, s.as_bytes());
    d.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Deletes this acquire's waiter entry (or revokes its unanswered grant)
/// however the acquire ends, including a client that hung up.
struct Cleanup {
    cluster: Arc<Cluster>,
    /// The waiter entry and the membership lease it is put on: recorded
    /// before the put is sent, since a put that timed out may still have
    /// been applied.
    queue: Option<(String, i64)>,
    lease: Option<i64>,
}

/// How long a cleanup keeps trying (with backoff) while etcd does not answer.
const CLEANUP_FOR: Duration = Duration::from_secs(600);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let (queue, lease) = (self.queue.take(), self.lease.take());
        if queue.is_none() && lease.is_none() {
            return;
        }
        let c = self.cluster.clone();
        tokio::spawn(async move {
            let give_up = Instant::now() + CLEANUP_FOR;
            // An entry left behind would be the oldest waiter of its key
            // for as long as this gateway stays a member, and no grant of
            // the key could pass it: tried until it is gone, or gone with
            // the membership lease it lives on.
            let leave_queue = async {
                let Some((q, member)) = queue else { return };
                let mut pause = Duration::from_millis(100);
                while c.member_lease() == Some(member) && !c.stop.is_triggered() && Instant::now() < give_up {
                    let deleted = call(c.timeout, "leaving the queue", || {
                        let (mut kv, q) = (c.client.kv_client(), q.clone());
                        async move { kv.delete(q, None).await }
                    })
                    .await;
                    if deleted.is_ok() {
                        return;
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(2));
                }
            };
            // An unanswered grant would hold its key for its whole TTL.
            let end_grant = async {
                let Some(l) = lease else { return };
                let mut pause = Duration::from_millis(100);
                while !c.stop.is_triggered() && Instant::now() < give_up {
                    match c.revoke(l).await {
                        Ok(_) => return,
                        Err(e) if e.to_string().contains("not found") => return,
                        Err(_) => {}
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(2));
                }
            };
            tokio::join!(leave_queue, end_grant);
        });
    }
}

/// A grant just made by [`Cluster::try_grant`], not yet activated.
struct Granted {
    token: u64,
    /// The revision of the granting transaction.
    revision: i64,
    /// The TTL etcd granted the lease, in ms.
    granted_ms: u64,
    lease: i64,
    /// When the lease was asked for: etcd keeps it at least until
    /// `lease_sent + TTL`.
    lease_sent: Instant,
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
        let ttl_s = i64::try_from(req.ttl_ms.div_ceil(1000)).unwrap_or(i64::MAX);
        let key = req.key.as_str();
        let mut cleanup = Cleanup { cluster: self.clone(), queue: None, lease: None };
        let mut mine: Option<i64> = None;
        let mut applied = self.applied.subscribe();
        let mut first = true;
        let (token, txn_rev, granted_ms, etcd_lease, lease_sent) = loop {
            let may_try = first || self.lock_mirror().may_take(key, mine);
            first = false;
            if may_try {
                let queued = cleanup.queue.as_ref().map(|(q, _)| q.as_str()).zip(mine);
                if let Some(g) = self.try_grant(key, &holder, &secret, ttl_s, queued, &mut cleanup.lease).await? {
                    break (g.token, g.revision, g.granted_ms, g.lease, g.lease_sent);
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
        // The grant exists; it is this acquire's to lose until answered.
        cleanup.queue = None;
        // The client's TTL counts from the answer: the gateway keeps the
        // grant's lease alive while activation waits (ended on any return).
        let _keeper = self.keep_alive_while_activating(etcd_lease, granted_ms);
        let activation = Instant::now();
        let waited = self.activate(txn_rev).await;
        self.metrics.activation_wait.observe(activation.elapsed().as_secs_f64());
        self.metrics.grants.inc();
        waited?;
        self.floor.raise(token);
        tokio::time::timeout(self.timeout, self.floor.wait_persisted(token))
            .await
            .map_err(|_| Error::Store("the token floor was not written in time".into()))??;
        // The common case: activation took a small part of the TTL. etcd
        // keeps a lease at least TTL from when its grant was asked for (a
        // leader change only extends it), so up to `safe_until` — the same
        // ε and margin as the gateway's own membership deadline — the lease
        // lives, and the grant key on it with it: fencegate deletes a grant
        // key only by ending its lease. The answer then carries the time
        // left to `safe_until`, counted from the answer, and costs no
        // further etcd round trip (no read-back, no keepalive).
        let safe_until = Self::deadline_after(lease_sent, Duration::from_millis(granted_ms));
        let left = safe_until.saturating_duration_since(Instant::now());
        let still_mine = self.lock_mirror().grants.get(key).is_some_and(|g| g.lease == etcd_lease && g.token == token);
        if still_mine && left.as_millis() * 3 >= u128::from(granted_ms) * 2 {
            cleanup.lease = None;
            return Ok(GrantView { key: req.key, fencing_token: token, lease_id, ttl_ms: millis(left), holder });
        }
        // Activation may have outlasted the grant's own lease, and another
        // acquire may then hold the key: answer only a grant that is still
        // this one in etcd (a consistent read; the key goes with its lease).
        match self.own_grant(key, &lease_id).await? {
            Some((_, l, t)) if l == etcd_lease && t == token => {}
            _ => {
                return Err(Error::Unavailable(
                    "the grant's lease ended while the grant was being activated (its keepalive failed); retry".into(),
                ))
            }
        }
        // One last keepalive: the full TTL from now.
        let _ = call(self.timeout, "renewing the new grant", || {
            let mut leases = self.client.lease_client();
            async move { leases.keep_alive(etcd_lease).await }
        })
        .await;
        cleanup.lease = None;
        Ok(GrantView { key: req.key, fencing_token: token, lease_id, ttl_ms: granted_ms, holder })
    }

    /// Keeps `lease` alive every third of its TTL until the returned guard
    /// is dropped.
    fn keep_alive_while_activating(&self, lease: i64, granted_ms: u64) -> AbortOnDrop {
        let client = self.client.clone();
        let period = Duration::from_millis((granted_ms / 3).max(300));
        AbortOnDrop(tokio::spawn(async move {
            // The lease was just granted with its full TTL: the first
            // keepalive is due only a third of it later (an activation that
            // ends sooner costs no keepalive stream at all).
            tokio::time::sleep(period).await;
            let mut leases = client.lease_client();
            let Ok((mut keeper, mut stream)) = leases.keep_alive(lease).await else { return };
            loop {
                tokio::time::sleep(period).await;
                if keeper.keep_alive().await.is_err() || !matches!(stream.message().await, Ok(Some(_))) {
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
    /// its revision. `unanswered` holds the attempt's etcd lease from the
    /// moment it exists until the attempt has ended it itself: an acquire
    /// dropped meanwhile (its client hung up while the shared transaction
    /// was in flight) then revokes it, which ends a grant made for nobody
    /// at once instead of at its TTL.
    async fn try_grant(
        &self,
        key: &str,
        holder: &str,
        secret: &str,
        ttl_s: i64,
        queued: Option<(&str, i64)>,
        unanswered: &mut Option<i64>,
    ) -> Result<Option<Granted>, Error> {
        let lease_sent = Instant::now();
        let grant = call(self.timeout, "granting a lease", || {
            let mut leases = self.client.lease_client();
            async move { leases.grant(ttl_s, None).await }
        })
        .await?;
        let lease = grant.id();
        *unanswered = Some(lease);
        let granted_ms = u64::try_from(grant.ttl()).unwrap_or(0).saturating_mul(1000);
        // Every token seen before this transaction was committed earlier in
        // etcd's history, so its revision is above them all — unless that
        // history was rolled back (a restore, a new cluster).
        let floor = self.floor.get();
        // The transaction itself is shared with the other attempts queued
        // meanwhile on this gateway (group commit, see `batch`).
        let (reply, answer) = tokio::sync::oneshot::channel();
        let attempt = Attempt {
            key: key.to_string(),
            secret: secret.to_string(),
            holder: holder.to_string(),
            granted_ms,
            lease,
            queued: queued.map(|(q, r)| (q.to_string(), r)),
            reply,
        };
        let committed = match self.grant_in_batch(attempt, answer).await {
            Ok(Some(c)) => c,
            Ok(None) => {
                if self.revoke(lease).await.is_ok() {
                    *unanswered = None;
                }
                return Ok(None);
            }
            Err(e) => {
                // Unknown outcome: the lease, if granted, is revoked, which
                // ends such a grant at once.
                if self.revoke(lease).await.is_ok() {
                    *unanswered = None;
                }
                return Err(e);
            }
        };
        let (rev, offset) = (committed.revision, committed.offset);
        let token = token_of(offset, rev, Some(committed.slot));
        if token == u64::MAX {
            // `token_of` saturates: every token past the end of the space
            // reads as u64::MAX, so it can name no grant alone (a batch of
            // several would all get it).
            if self.revoke(lease).await.is_ok() {
                *unanswered = None;
            }
            return Err(Error::Unavailable(format!(
                "the token space is exhausted (etcd revision {rev} with offset {offset} reaches u64::MAX): no token \
                 can be issued without repeating one; the token floor was raised too far"
            )));
        }
        if token <= floor {
            // Withdrawn before anyone saw it: revoking ends the grant.
            if self.revoke(lease).await.is_ok() {
                *unanswered = None;
            }
            return Err(Error::Unavailable(format!(
                "etcd's revision {rev} (token {token} with offset {offset}) is not above the token floor {floor}: \
                 etcd was restored or replaced, and granting now could issue a token twice; an operator must run \
                 `fencegate cluster raise-floor --to {floor}`"
            )));
        }
        Ok(Some(Granted { token, revision: rev, granted_ms, lease, lease_sent }))
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
        let resp = call(self.timeout, "queueing", || {
            let (mut kv, qkey) = (self.client.kv_client(), qkey.to_string());
            async move { kv.put(qkey, "", Some(PutOptions::new().with_lease(member))).await }
        })
        .await?;
        Ok(resp.header().map_or(0, |h| h.revision()))
    }
}

impl Cluster {
    /// The grant of `key` as etcd has it now (a consistent read), if its
    /// lease id hashes to the stored one.
    async fn own_grant(&self, key: &str, lease_id: &str) -> Result<Option<(GrantValue, i64, u64)>, Error> {
        let resp = call(self.timeout, "reading a grant", || {
            let (mut kv, gkey) = (self.client.kv_client(), self.keys.grant(key));
            async move { kv.get(gkey, None).await }
        })
        .await?;
        let Some(found) = resp.kvs().first() else { return Ok(None) };
        let Ok(value) = serde_json::from_slice::<GrantValue>(found.value()) else { return Ok(None) };
        if !secret_eq(&value.s, &sha256_hex(lease_id)) {
            return Ok(None);
        }
        let token = token_of(value.o, found.create_revision(), value.i);
        Ok(Some((value, found.lease(), token)))
    }

    /// `POST /v1/locks/renew`: one keepalive of the grant's etcd lease. An
    /// etcd lease's TTL is fixed when it is granted, so a renewal always
    /// extends by the granted TTL (`ttl_ms` in the answer), whatever it asks.
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
        let Some((value, lease, token)) = self.own_grant(&req.key, &req.lease_id).await? else {
            return Err(lost());
        };
        let renewed = call(self.timeout, "renewing", || {
            let mut leases = self.client.lease_client();
            async move {
                match leases.keep_alive(lease).await {
                    // Gone: an answer, not a failure of the request.
                    Err(etcd_client::Error::LeaseKeepAliveError(m)) if m.contains("not found") => Ok(false),
                    Err(e) => Err(e),
                    Ok(_) => Ok(true),
                }
            }
        })
        .await?;
        if renewed {
            Ok(RenewView { key: req.key, fencing_token: token, ttl_ms: value.t })
        } else {
            Err(lost())
        }
    }

    /// `POST /v1/locks/release`: revokes the grant's etcd lease, which
    /// deletes the grant key in the same step.
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
        // One lease per grant, and the stored hash is of that grant's
        // random lease id: when this gateway's mirror holds the key with a
        // matching hash, its lease is this grant's, and revoking it ends
        // exactly this grant (or answers "not found" if it has ended) — no
        // consistent read first. Otherwise (the mirror has not seen the
        // grant yet, or saw a different one) etcd is asked.
        let hashed = sha256_hex(&req.lease_id);
        let known = self.lock_mirror().grants.get(&req.key).filter(|g| secret_eq(&g.value.s, &hashed)).map(|g| g.lease);
        let lease = match known {
            Some(l) => l,
            None => match self.own_grant(&req.key, &req.lease_id).await? {
                Some((_, l, _)) => l,
                None => return Err(not_owner()),
            },
        };
        let revoked = call(self.timeout, "releasing", || {
            let mut leases = self.client.lease_client();
            async move {
                match leases.revoke(lease).await {
                    // Gone: an answer, not a failure of the request.
                    Err(e) if e.to_string().contains("not found") => Ok(false),
                    Err(e) => Err(e),
                    Ok(_) => Ok(true),
                }
            }
        })
        .await?;
        if revoked {
            Ok(())
        } else {
            Err(not_owner())
        }
    }

    /// `GET /v1/locks/status` from this gateway's mirror, with the lease's
    /// remaining time asked of etcd.
    pub async fn status(&self, key: &str) -> Result<StatusView, Error> {
        validate_key(key)?;
        let fence = self.fences.durable_fence(key);
        let grant = self.lock_mirror().grants.get(key).cloned();
        let Some(g) = grant else {
            return Ok(StatusView::free(key, fence));
        };
        let ttl = call(self.timeout, "reading a lease", || {
            let mut leases = self.client.lease_client();
            async move { leases.time_to_live(g.lease, None).await }
        })
        .await?;
        let left = u64::try_from(ttl.ttl()).unwrap_or(0).saturating_mul(1000);
        Ok(StatusView {
            key: key.to_string(),
            fence: fence.max(g.token),
            held: ttl.ttl() > 0,
            fencing_token: (ttl.ttl() > 0).then_some(g.token),
            holder: (ttl.ttl() > 0).then_some(g.value.h.clone()),
            expires_in_ms: (ttl.ttl() > 0).then_some(left),
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
            let (missing, quarantine_until) = {
                let m = self.lock_mirror();
                let mut missing = 0usize;
                // A member that vanished without draining shortly before
                // this grant may still have requests on their way to an
                // upstream: its quarantine counts too.
                let mut until: Option<Instant> =
                    m.departed.values().filter(|d| !d.drained).map(|d| d.at + self.quarantine).max();
                // A member that left before this gateway's last full read
                // is unknown here: one quarantine from that read.
                until = until.max(m.loaded_at.map(|t| t + self.quarantine));
                for (gw, lease) in &members {
                    match m.members.get(gw) {
                        Some(e) if e.lease == *lease => {
                            if !e.drained && m.acks.get(gw).copied().unwrap_or(0) < rev {
                                missing += 1;
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
            if missing == 0 {
                if let Some(u) = quarantine_until {
                    if u > deadline {
                        return Err(Error::Unavailable(
                            "a quarantine (a gateway left without draining, or this gateway reloaded its view of the cluster) \
                             outlasts activation_timeout_ms; retry".into(),
                        ));
                    }
                    tokio::time::sleep_until(u).await;
                }
                return Ok(());
            }
            if tokio::time::timeout_at(deadline, rx.changed()).await.is_err() {
                return Err(Error::Unavailable(format!(
                    "{missing} gateway(s) did not acknowledge the grant within activation_timeout_ms"
                )));
            }
        }
    }
}
