//! The in-memory mirror of the cluster's keys in etcd, as of the revision
//! the feed has applied. Pure data: the feed writes it (under one mutex,
//! never across an `.await`); grants, waiters and watches read it.

use std::collections::{BTreeSet, HashMap};

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

/// A grant's value in etcd. The lease id itself is never stored: only its
/// SHA-256, which renew and release compare against. A grant key has no
/// etcd lease: it ends when the gateways delete it (release, or expiry by
/// the gateways' own deadlines, see `expiry`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct GrantValue {
    /// SHA-256 of the lease id, hex.
    pub s: String,
    /// Holder label.
    pub h: String,
    /// The grant's TTL, ms.
    pub t: u64,
    /// Token offset in effect when granted.
    pub o: u64,
    /// The grant's slot in its batch (`batch`); absent in grants made one
    /// per transaction, whose token is `offset + revision`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub i: Option<u64>,
}

/// One live grant as the mirror knows it.
#[derive(Debug, Clone)]
pub(crate) struct GrantEntry {
    pub token: u64,
    /// `create_revision` of the grant key: names this grant (renew and
    /// release compare it).
    pub created: i64,
    /// `mod_revision` of its last put (the grant or its last renewal):
    /// expiry deletes the key only if it is still this one.
    pub modified: i64,
    /// When this gateway may expire it: when ITS feed first saw the last
    /// put, plus the TTL·(1 + ε). The put was committed before this
    /// gateway saw it, and the holder counts its TTL from before the
    /// commit, so this is always later than the holder's own deadline.
    pub deadline: Instant,
    pub value: GrantValue,
}

/// One live member.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MemberEntry {
    /// The membership lease: a new lease is a new incarnation.
    pub lease: i64,
    /// It announced a clean stop (nothing in flight).
    pub drained: bool,
    /// Its membership lease's TTL (in its member key's value): how long
    /// after its last proof of currency it may still admit writes.
    pub ttl: Duration,
}

/// The value of a member key: `up <TTL ms>` (its lease's granted TTL).
pub(crate) fn member_value(ttl: Duration) -> String {
    format!("up {}", ttl.as_millis())
}

/// What a member key's value says: drained, and the TTL (`fallback` for a
/// value without one: `drained`, or a plain `up` of an earlier version).
pub(crate) fn parse_member(value: &[u8], fallback: Duration) -> (bool, Duration) {
    if value == b"drained" {
        return (true, fallback);
    }
    let ttl = std::str::from_utf8(value)
        .ok()
        .and_then(|v| v.strip_prefix("up "))
        .and_then(|ms| ms.parse::<u64>().ok())
        .map_or(fallback, Duration::from_millis);
    (false, ttl)
}

/// How a member that is gone left.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Departure {
    pub lease: i64,
    pub at: Instant,
    pub drained: bool,
    /// The latest `at` of an earlier incarnation of the same gateway that
    /// left without draining, which this departure replaced: its
    /// quarantine still counts.
    pub earlier: Option<Instant>,
}

impl Departure {
    pub fn new(lease: i64, at: Instant, drained: bool) -> Departure {
        Departure { lease, at, drained, earlier: None }
    }

    /// From when this gateway id's departures are quarantined (`None`:
    /// every incarnation that left drained).
    pub fn undrained_since(&self) -> Option<Instant> {
        let own = (!self.drained).then_some(self.at);
        own.max(self.earlier)
    }
}

#[derive(Debug, Default)]
pub(crate) struct Mirror {
    pub offset: u64,
    /// `mod_revision` of the offset key (0: absent).
    pub offset_rev: i64,
    /// Gateways that found etcd restored (their `r/GW` keys).
    pub restored: std::collections::BTreeSet<String>,
    pub grants: HashMap<String, GrantEntry>,
    /// Waiters per key, by create revision.
    pub queues: HashMap<String, BTreeSet<i64>>,
    /// etcd key of each waiter entry → (lock key, create revision).
    pub queue_index: HashMap<Vec<u8>, (String, i64)>,
    pub members: HashMap<String, MemberEntry>,
    pub departed: HashMap<String, Departure>,
    /// The `d/GW` records: the last incarnation (lease) of each gateway
    /// that said it left drained after its member key went.
    pub drained_records: HashMap<String, i64>,
    pub acks: HashMap<String, i64>,
    /// When this gateway's feed last saw each member put its
    /// acknowledgement key or its member key. A member extends its own
    /// deadline only by a proof of currency that puts its acknowledgement
    /// after the keepalive it counts from, so it stops admitting before
    /// this instant + its TTL, whatever ends its membership key.
    pub seen_at: HashMap<String, Instant>,
    /// When this view was (re)loaded by a full read: a member that left
    /// just before it is not among `departed`, so every grant answered
    /// here waits one quarantine from this moment.
    pub loaded_at: Option<Instant>,
}

impl Mirror {
    /// True when nobody holds `key` and `mine` is the oldest waiter (or,
    /// for `None`, nobody waits).
    pub fn may_take(&self, key: &str, mine: Option<i64>) -> bool {
        if self.grants.contains_key(key) {
            return false;
        }
        let first = self.queues.get(key).and_then(|q| q.first().copied());
        first == mine
    }

    /// The gateway that expires grants: the lowest `gateway_id` among the
    /// live members not draining, as this mirror sees them. Two gateways
    /// that both believe they are it only repeat each other's compares.
    pub fn expirer(&self) -> Option<&str> {
        self.members.iter().filter(|(_, m)| !m.drained).map(|(gw, _)| gw.as_str()).min()
    }

    /// The current holder's token of `key`, 0 for none.
    pub fn holder_token(&self, key: &str) -> u64 {
        self.grants.get(key).map_or(0, |g| g.token)
    }

    pub fn add_waiter(&mut self, raw: &[u8], key: &str, rev: i64) {
        self.queues.entry(key.to_string()).or_default().insert(rev);
        self.queue_index.insert(raw.to_vec(), (key.to_string(), rev));
    }

    pub fn remove_waiter(&mut self, raw: &[u8]) {
        if let Some((key, rev)) = self.queue_index.remove(raw) {
            if let Some(q) = self.queues.get_mut(&key) {
                q.remove(&rev);
                if q.is_empty() {
                    self.queues.remove(&key);
                }
            }
        }
    }

    /// A member key went away: its lease expired, or it was revoked or
    /// the key deleted by hand — then the member may be running still,
    /// unaware (its watch stalled, or itself paused), and admitting until
    /// its own deadline. Its departure counts from when that deadline has
    /// surely passed: the last time it was seen proving itself plus its
    /// TTL (for an expired lease, about now). Returns the lease it was on.
    pub fn remove_member(&mut self, gw: &str) -> Option<i64> {
        let now = Instant::now();
        let seen = self.seen_at.remove(gw);
        let lease = self.members.remove(gw).map(|m| {
            let stopped_by = seen.map_or(now + m.ttl, |s| s + m.ttl).max(now);
            self.depart(gw, Departure::new(m.lease, stopped_by, m.drained));
            m.lease
        });
        self.acks.remove(gw);
        lease
    }

    /// Records a departure; drained also when the gateway's `d/GW` record
    /// names that incarnation. An earlier incarnation of the same id that
    /// left without draining keeps its quarantine (outside review: one
    /// killed with a write in flight, restarted under its id and stopped
    /// cleanly, had its quarantine replaced by the clean stop's, and the
    /// write landed after the next holder's).
    pub fn depart(&mut self, gw: &str, mut d: Departure) {
        d.drained |= self.drained_records.get(gw) == Some(&d.lease);
        if let Some(old) = self.departed.get(gw) {
            let kept = if old.lease == d.lease { old.earlier } else { old.undrained_since() };
            d.earlier = d.earlier.max(kept);
        }
        self.departed.insert(gw.to_string(), d);
    }

    /// A `d/GW` record: the incarnation on `lease` left drained (its
    /// departure, seen before or after, waits no quarantine).
    pub fn drained_record(&mut self, gw: &str, lease: i64) {
        self.drained_records.insert(gw.to_string(), lease);
        if let Some(d) = self.departed.get_mut(gw).filter(|d| d.lease == lease) {
            d.drained = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_oldest_waiter_may_take_a_free_key() {
        let mut m = Mirror::default();
        assert!(m.may_take("k", None));
        m.add_waiter(b"q1", "k", 10);
        m.add_waiter(b"q2", "k", 12);
        assert!(!m.may_take("k", None));
        assert!(m.may_take("k", Some(10)));
        assert!(!m.may_take("k", Some(12)));
        m.remove_waiter(b"q1");
        assert!(m.may_take("k", Some(12)));
        m.remove_waiter(b"q2");
        assert!(m.queues.is_empty() && m.queue_index.is_empty());
    }

    #[test]
    fn a_member_key_that_goes_counts_as_departed_only_once_its_deadline_surely_passed() {
        let mut m = Mirror::default();
        let ttl = Duration::from_secs(5);
        m.members.insert("seen".into(), MemberEntry { lease: 1, drained: false, ttl });
        m.members.insert("unseen".into(), MemberEntry { lease: 2, drained: false, ttl });
        let before = Instant::now();
        m.seen_at.insert("seen".into(), before);
        m.remove_member("seen");
        m.remove_member("unseen");
        let at = |gw: &str| m.departed[gw].at;
        assert!(at("seen") >= before + ttl, "its last proof plus its TTL");
        assert!(at("unseen") >= before + ttl, "never seen proving: from now");
        assert!(m.seen_at.is_empty());
        assert_eq!(parse_member(member_value(ttl).as_bytes(), Duration::ZERO), (false, ttl));
        assert_eq!(parse_member(b"up", ttl), (false, ttl));
        assert_eq!(parse_member(b"drained", ttl), (true, ttl));
    }

    #[test]
    fn the_expirer_is_the_lowest_live_member_not_draining() {
        let mut m = Mirror::default();
        assert_eq!(m.expirer(), None);
        let ttl = Duration::from_secs(2);
        m.members.insert("gw1".into(), MemberEntry { lease: 1, drained: false, ttl });
        m.members.insert("gw0".into(), MemberEntry { lease: 2, drained: true, ttl });
        m.members.insert("gw2".into(), MemberEntry { lease: 3, drained: false, ttl });
        assert_eq!(m.expirer(), Some("gw1"));
        m.remove_member("gw1");
        assert_eq!(m.expirer(), Some("gw2"));
    }

    #[test]
    fn a_clean_stop_of_a_restarted_gateway_keeps_the_quarantine_of_the_incarnation_that_died() {
        let mut m = Mirror::default();
        let t0 = Instant::now();
        m.depart("gw", Departure::new(1, t0, false));
        m.depart("gw", Departure::new(2, t0 + Duration::from_secs(1), true));
        assert_eq!(m.departed["gw"].lease, 2);
        assert_eq!(m.departed["gw"].undrained_since(), Some(t0), "the killed incarnation's quarantine is gone");
        // Its `d/GW` record, and the same departure seen again, keep it too.
        m.drained_record("gw", 2);
        m.depart("gw", Departure::new(2, t0 + Duration::from_secs(2), true));
        assert_eq!(m.departed["gw"].undrained_since(), Some(t0));
        // A third incarnation that dies: the latest of the two counts.
        let t3 = t0 + Duration::from_secs(3);
        m.depart("gw", Departure::new(3, t3, false));
        assert_eq!(m.departed["gw"].undrained_since(), Some(t3));
        // Only drained incarnations: none.
        m.departed.clear();
        m.depart("gw", Departure::new(4, t0, true));
        m.depart("gw", Departure::new(5, t3, true));
        assert_eq!(m.departed["gw"].undrained_since(), None);
    }
}
