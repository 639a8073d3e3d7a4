//! Expiry of grants by the gateways themselves. A grant key has no etcd
//! lease of its own (one `LeaseGrant` and one `LeaseRevoke` per grant,
//! which etcd cannot batch, bounded the cycle rate): it lives until it is
//! released or a gateway deletes it here.
//!
//! Every gateway keeps, per grant in its mirror, a deadline: when ITS feed
//! first delivered the grant's last put (the grant, or its last renewal)
//! plus the TTL · (1 + ε). That put was committed before any gateway saw
//! it, and the holder counts its TTL from before the commit (the acquire
//! from before its grant transaction was sent, the client from before its
//! renew), so every gateway's deadline falls after the holder's own —
//! whatever gateway computes it, after a reload too (a read is later than
//! the commit it shows).
//!
//! One gateway expires: the lowest `gateway_id` among the live members
//! its mirror shows ([`Mirror::expirer`](super::mirror::Mirror::expirer));
//! when it departs, the next takes over at once with its own deadlines.
//! Every other gateway expires too, but only grants overdue by more than
//! the member TTL (an expirer that is alive but cannot reach etcd, or whose
//! departure is not seen yet). Each expiry is a sub-transaction of the
//! gateway's shared transaction: `If(mod_revision(g/KEY) == the put it
//! timed) Then delete g/KEY`, so a renewal committed first always wins, and
//! two gateways expiring the same grant only repeat a compare.
//!
//! This module must never delete a grant whose last put it has not timed.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::batch::Op;
use super::member::EPSILON;
use super::Cluster;

/// How often the expiry loop looks again with nothing due (a member that
/// became the expirer, a grant that appeared).
const IDLE: Duration = Duration::from_millis(250);

/// A grant's expiry deadline for a put first seen at `seen`.
pub(super) fn deadline_from(seen: Instant, ttl_ms: u64) -> Instant {
    seen + Duration::from_millis(ttl_ms).mul_f64(1.0 + EPSILON)
}

impl Cluster {
    /// The expiry loop of this gateway.
    pub(super) async fn run_expiry(self: Arc<Self>) {
        // Puts already asked to be deleted: lock key → mod_revision.
        let mut tried: HashMap<String, i64> = HashMap::new();
        loop {
            let (due, next) = self.due_grants(&mut tried);
            if !due.is_empty() {
                self.expire(due, &mut tried).await;
            }
            let wake = next.min(Instant::now() + IDLE);
            tokio::select! {
                () = tokio::time::sleep_until(wake) => {}
                () = self.stop.wait() => return,
            }
        }
    }

    /// The grants this gateway expires now, and when to look next.
    fn due_grants(&self, tried: &mut HashMap<String, i64>) -> (Vec<(String, i64)>, Instant) {
        let now = Instant::now();
        let mut next = now + IDLE;
        if !self.feed_is_ok() {
            return (Vec::new(), next);
        }
        let m = self.lock_mirror();
        // The expirer at its deadlines; every other gateway one member TTL
        // later, should the expirer not do it.
        let grace = if m.expirer() == Some(self.gateway_id.as_str()) { Duration::ZERO } else { self.member_ttl };
        tried.retain(|k, rev| m.grants.get(k).is_some_and(|g| g.modified == *rev));
        let mut due = Vec::new();
        for (key, g) in &m.grants {
            let at = g.deadline + grace;
            if tried.contains_key(key) {
                continue;
            }
            if at <= now {
                due.push((key.clone(), g.modified));
            } else {
                next = next.min(at);
            }
        }
        (due, next)
    }

    /// Deletes each of `due` if its last put is still the one timed; all
    /// of them in this gateway's next shared transaction(s).
    async fn expire(&self, due: Vec<(String, i64)>, tried: &mut HashMap<String, i64>) {
        let mut answers = Vec::with_capacity(due.len());
        for (key, modified) in due {
            let (reply, answer) = tokio::sync::oneshot::channel();
            if self.batches.send(Op::Expire { key: key.clone(), modified, reply }).is_err() {
                return;
            }
            tried.insert(key.clone(), modified);
            answers.push((key, answer));
        }
        for (key, answer) in answers {
            match answer.await {
                // Deleted, or renewed (or ended) first: either way done with
                // this put; the feed shows what happened.
                Ok(Ok(deleted)) => {
                    if deleted {
                        tracing::debug!(key = %key, "grant expired");
                    }
                }
                // Unknown (etcd unreachable): asked again at the next look.
                _ => {
                    tried.remove(&key);
                }
            }
        }
    }
}
