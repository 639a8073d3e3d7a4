//! Restore detection. An etcd restored from a snapshot (or replaced by a
//! new cluster) has forgotten every grant made after the snapshot; its
//! revisions, and so its tokens, go on from the snapshot's. A gateway that
//! saw those grants holds any repeat of their tokens back (its token floor,
//! `feed.rs`); one that did not — stopped, paused or cut off meanwhile —
//! cannot tell from etcd's keys alone. What it can tell is etcd's raft log:
//! a restore starts it again from a handful of entries (etcd 3.4: index =
//! number of members), while in one history the applied index only grows.
//!
//! So each gateway proves, at every load and every few seconds, the raft
//! index etcd has applied — a linearizable read on one member, then that
//! member's status: its applied index is then at least the cluster's commit
//! index when the read began, so at least any index proved before — and
//! keeps the highest (`raft_mark`, durable beside the token floor). Found
//! below the mark, etcd's log went back: the gateway records the restore
//! (durably) and from then on grants nothing, acknowledges no grant (so no
//! grant is answered by any gateway while it is a member) and admits no
//! mutation, until an operator runs `fencegate cluster raise-floor`, whose
//! write of the token offset after the restore ends it.
//!
//! A gateway with no mark (an empty data dir) or a low one (it last saw
//! etcd when its log was shorter than the restored one has grown since)
//! cannot tell by the mark. It tells by etcd alone ([`rolled_back`]): in
//! one history every raft entry raises the revision by at most one, and a
//! new cluster starts with its index above its revision, so `applied index
//! − revision` never goes below 0 and never goes down; a restore starts
//! the index again from a handful while the revision goes on from the
//! snapshot's, far below 0. `raise-floor` records that difference as it
//! saw it (`P meta/raft` = `applied/revision`, with the offset), so the
//! history after it is not taken for a restore again, while a later
//! restore — from a snapshot holding that record or not — drops below it.
//! What neither sees: a restored history whose entries that did not
//! raise the revision (failed transactions, compactions, lease grants)
//! have since made up the revisions the restore rolled back — long after
//! the restore, when `raise-floor` should have run.

use std::time::Duration;

use etcd_client::Client;

use super::Cluster;
use crate::error::Error;

/// A client of one etcd member, so that the read and the status come from
/// the same member.
#[derive(Default)]
pub(super) struct Probe {
    /// The endpoint to try next.
    next: usize,
    client: Option<Client>,
}

impl std::fmt::Debug for Probe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Probe").field("next", &self.next).finish_non_exhaustive()
    }
}

/// Why a gateway that found a restore refuses (grants, mutations).
pub(super) fn restored_refusal(floor: u64) -> String {
    format!(
        "etcd's raft log is behind what this gateway saw before, or behind etcd's own revisions by more than \
         `raise-floor` recorded (no single history has either): etcd was restored from a snapshot (or replaced), \
         tokens issued after the snapshot may be lost and granting could issue one twice; this gateway grants \
         nothing, acknowledges no grant and admits no mutation until an operator runs `fencegate cluster \
         raise-floor --to N` with N at least the highest token floor of every gateway (the token floor {floor} \
         here)"
    )
}

/// The value of a gateway's restore mark (`P r/GW`): where it found the
/// restore, and its token floor (`raise-floor` refuses a floor below it).
fn mark_value(at: i64, floor: u64) -> String {
    format!("found at revision {at} (token floor {floor})")
}

/// The token floor a restore mark's value names.
pub(super) fn floor_in_mark(value: &[u8]) -> Option<u64> {
    let v = std::str::from_utf8(value).ok()?;
    v.split("(token floor ").nth(1)?.strip_suffix(')')?.parse().ok()
}

/// `raise-floor`'s record of `applied index − revision` (`P meta/raft`):
/// `applied/revision`. Anything else reads as no record.
pub(super) fn raft_record(applied: u64, revision: i64) -> String {
    format!("{applied}/{revision}")
}

/// Whether etcd's history was rolled back by a restore (module doc): the
/// applied index `applied` proved after a linearizable read at `revision`
/// (so at least the index of the entry that made that revision, and the
/// difference is at least the history's there) is below the revision by
/// more than `record` (`raise-floor`'s, measured so that it is at most the
/// history's difference when it ran) allows, or below it at all when there
/// is no record. A record above 0 (a history never restored, or one with
/// fewer revisions than `raise-floor` padded) raises the bar above 0: the
/// difference only grows in one history, so it is never below the record
/// there (an earlier version kept the bar at 0, which let a restore of a
/// small history's backup taken after a padded `raise-floor` pass).
pub(super) fn rolled_back(applied: u64, revision: i64, record: Option<&[u8]>) -> bool {
    let gap = |a: u64, r: i64| i128::from(a) - i128::from(r);
    let recorded = record.and_then(|v| {
        let (a, r) = std::str::from_utf8(v).ok()?.trim().split_once('/')?;
        Some(gap(a.parse().ok()?, r.parse().ok()?))
    });
    gap(applied, revision) < recorded.unwrap_or(0)
}

impl Cluster {
    /// The applied raft index of one member, the revision of a
    /// linearizable read on it just before, and `raise-floor`'s record read
    /// by it: `(applied, revision, record)`.
    async fn measure_raft(&self) -> Result<(u64, i64, Option<Vec<u8>>), Error> {
        let mut probe = self.probe.lock().await;
        let endpoints = &self.cfg.etcd_endpoints;
        let mut last = Error::Unavailable("etcd: no endpoint configured".into());
        for _ in 0..endpoints.len().max(1) {
            let client = match probe.client.take() {
                Some(c) => c,
                None => {
                    let i = probe.next % endpoints.len().max(1);
                    probe.next = i + 1;
                    match super::etcd::Etcd::connect_member(&self.cfg, i).await {
                        Ok(c) => c,
                        Err(e) => {
                            last = e;
                            continue;
                        }
                    }
                }
            };
            match self.measure_on(&client).await {
                Ok(m) => {
                    probe.client = Some(client);
                    return Ok(m);
                }
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    async fn measure_on(&self, client: &Client) -> Result<(u64, i64, Option<Vec<u8>>), Error> {
        let timeout = |what: &'static str| move |_| Error::Unavailable(format!("etcd: {what}: no answer in time"));
        let read = tokio::time::timeout(self.timeout, client.kv_client().get(self.keys.raft_record(), None))
            .await
            .map_err(timeout("reading for the raft index"))?
            .map_err(|e| super::unavailable("reading for the raft index", e))?;
        let header = read.header().ok_or_else(|| Error::Unavailable("etcd: no response header".into()))?;
        let (member, revision) = (header.member_id(), header.revision());
        let record = read.kvs().first().map(|kv| kv.value().to_vec());
        let status = tokio::time::timeout(self.timeout, client.maintenance_client().status())
            .await
            .map_err(timeout("reading the raft index"))?
            .map_err(|e| super::unavailable("reading the raft index", e))?;
        match status.header() {
            Some(h) if h.member_id() == member => Ok((status.raft_applied_index(), revision, record)),
            _ => Err(Error::Unavailable("etcd: the raft index came from another member".into())),
        }
    }

    /// Proves etcd's applied raft index and compares it with the mark
    /// (module doc). A restore found stops this gateway at once.
    pub(super) async fn check_raft(&self) -> Result<(), Error> {
        if crate::fault::enabled(crate::fault::Fault::NoRestoreDetection) {
            return Ok(());
        }
        let (applied, revision, record) = self.measure_raft().await?;
        let mark = self.floor.raft().mark;
        let before = self.floor.restored();
        let rolled_back = rolled_back(applied, revision, record.as_deref());
        if self.floor.observe_raft(applied, revision, rolled_back) {
            tracing::error!(applied, mark, revision, rolled_back, "etcd's raft log went back");
            self.stop_for_restore(
                revision,
                "etcd was restored (its raft log is behind this gateway's); waiting for raise-floor",
            );
        }
        if let Some(at) = self.floor.restored() {
            // Its mark in etcd, without a lease: every gateway refuses to
            // answer grants while it is there, whatever becomes of this
            // one's membership (it lapses under etcd faults, a clean stop
            // leaves drained). Put again at every check: a later restore
            // may have taken it away. `raise-floor` deletes it.
            // Only while the offset is as this gateway last saw it: a mark
            // put just after a `raise-floor` this gateway has not seen yet
            // would outlive it and block every grant.
            // The floor it had when it found the restore: the one
            // `raise-floor --to` must cover (tokens seen since, among them
            // `raise-floor`'s own lifted fences, are above it; an outside
            // review had a correct re-run refused on such a floor).
            let value = mark_value(at, self.floor.floor_at_restore());
            let offset_rev = self.lock_mirror().offset_rev;
            let txn = etcd_client::Txn::new()
                .when([etcd_client::Compare::mod_revision(
                    self.keys.offset(),
                    etcd_client::CompareOp::Equal,
                    offset_rev,
                )])
                .and_then([etcd_client::TxnOp::put(self.keys.restored(&self.gateway_id), value, None)]);
            let put = self.etcd.txn(self.timeout, "marking the restore", txn).await;
            if let Err(e) = put {
                tracing::warn!(error = %e, "marking the restore in etcd failed; trying again at the next check");
                if before.is_none() {
                    return Err(e);
                }
            }
            // A `raise-floor` that ended the restore between the check
            // above and the offset revision read for the compare (outside
            // review, from the code): the mark would outlive it, and hold
            // every gateway with nobody left to delete it. The watch ends
            // the restore before it moves `offset_rev`, so a put that
            // compared the new offset finds the restore ended here.
            if self.floor.restored().is_none() {
                let key = self.keys.restored(&self.gateway_id);
                let deleted = self.etcd.delete_repeatable(self.timeout, "deleting a late restore mark", &key).await;
                if let Err(e) = deleted {
                    tracing::error!(error = %e, "a restore mark put after raise-floor could not be deleted: delete it by hand");
                }
            }
        }
        Ok(())
    }

    /// Why no grant may be answered now: this gateway, or another (its
    /// `r/GW` key), found etcd restored and no `raise-floor` has run since.
    pub(super) fn restore_blocks_grants(&self) -> Option<String> {
        if let Some(why) = self.restored_refusal() {
            return Some(why);
        }
        let m = self.lock_mirror();
        if m.restored.is_empty() {
            return None;
        }
        let names = m.restored.iter().take(5).cloned().collect::<Vec<_>>().join(", ");
        Some(format!(
            "etcd was restored from a snapshot (or replaced): gateway(s) {names} found its raft log behind what they \
             saw, and tokens issued after the snapshot may be lost; no gateway answers a grant until an operator runs \
             `fencegate cluster raise-floor --to N` with N at least the highest token floor of every gateway (their \
             logs and `<data_dir>/cluster-floor` name theirs)"
        ))
    }

    /// The watch delivered a write of the token offset at `rev`: after a
    /// restore this gateway found, that is the operator's `raise-floor`,
    /// and the restore is over. Only a write the watch delivers counts —
    /// one read in a full load may be an old one that a later snapshot
    /// brought back (review finding: a second restore from a newer snapshot
    /// holding an earlier `raise-floor` ended the first restore's refusal).
    pub(super) fn offset_written(&self, kv: &etcd_client::KeyValue, raised_to: Option<u64>) {
        let rev = kv.mod_revision();
        if self.floor.restored().is_none() {
            return;
        }
        // The floor the operator gave (`--to`, `P meta/floor` in the same
        // transaction) must cover this gateway's own: the grants and
        // fences `raise-floor` ended and lifted are those not above it.
        // (The tokens from now on can pass this floor by etcd's revisions
        // alone, so that check below is not enough: found by a test that
        // took longer between the restore and a low `raise-floor`.)
        let floor = self.floor.floor_at_restore();
        if raised_to.is_none_or(|to| to < floor) {
            tracing::error!(
                revision = rev,
                raised_to = raised_to.unwrap_or(0),
                floor,
                "raise-floor ran with --to below this gateway's token floor (or by a version that does not record \
                 it): the restore's hold stays; run `fencegate cluster raise-floor --to {floor}` (or higher)",
                floor = floor
            );
            return;
        }
        // Only a floor raised past this gateway's own ends its hold: a
        // `raise-floor --to` below it (a floor copied from a gateway that
        // saw fewer tokens) leaves grants and fences between the two in
        // etcd, which this gateway knows were issued before the restore
        // (outside review: such a run let a superseded holder renew and
        // write again). Tokens from now on are at least offset + (rev + 1)·64.
        let offset = kv.value_str().ok().and_then(|v| v.trim().parse::<u64>().ok()).unwrap_or(0);
        let next = super::token_of(offset, rev.saturating_add(1), Some(0));
        let floor = self.floor.get();
        if next <= floor {
            tracing::error!(
                revision = rev,
                offset,
                floor,
                "raise-floor ran with --to below this gateway's token floor: the restore's hold stays; run \
                 `fencegate cluster raise-floor --to {floor}` (or higher)",
                floor = floor
            );
            return;
        }
        if self.floor.offset_written(rev) {
            tracing::warn!(
                revision = rev,
                "the token offset was written after the restore this gateway found (raise-floor): it grants, \
                 acknowledges and admits again"
            );
            self.recompute_activated();
            self.member_lost_kick.notify_one();
        }
    }

    /// A restore found by the token floor at a new process's first read
    /// (`feed.rs`): recorded and acted on as one found by the raft log.
    pub(super) fn restore_found(&self, revision: i64) {
        if crate::fault::enabled(crate::fault::Fault::NoRestoreDetection) || !self.floor.note_restore(revision) {
            return;
        }
        self.stop_for_restore(
            revision,
            "etcd was restored (its numbering is behind this gateway's token floor); waiting for raise-floor",
        );
    }

    /// A restore just recorded (at `revision`): no mutation admitted from
    /// now on, until `raise-floor` (`offset_written`).
    fn stop_for_restore(&self, revision: i64, why: &'static str) {
        self.fences.set_not_current(why);
        self.metrics.cluster_current.set(0);
        let floor = self.floor.floor_at_restore();
        tracing::error!(revision, floor, "{}", restored_refusal(floor));
    }

    /// A restore stands: found by this gateway, or marked in etcd by
    /// another (no mutation admitted, no grant answered).
    pub(super) fn restore_stands(&self) -> bool {
        self.floor.restored().is_some() || !self.lock_mirror().restored.is_empty()
    }

    /// Why this gateway refuses while a restore is recorded.
    pub(super) fn restored_refusal(&self) -> Option<String> {
        self.floor.restored().map(|_| restored_refusal(self.floor.floor_at_restore()))
    }

    /// Keeps the mark recent: proves the raft index every `every`.
    pub(super) async fn run_raft_check(self: std::sync::Arc<Self>, every: Duration) {
        loop {
            tokio::select! {
                () = tokio::time::sleep(every) => {}
                () = self.stop.wait() => return,
            }
            if let Err(e) = self.check_raft().await {
                tracing::debug!(error = %e, "proving etcd's raft index failed; trying again later");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{raft_record, rolled_back};

    #[test]
    fn a_history_is_rolled_back_when_its_index_falls_below_its_revision_or_below_raise_floor_s_record() {
        // One history: the index is above the revision (a new cluster
        // starts so, and no entry raises the revision by more than one).
        assert!(!rolled_back(204, 201, None));
        assert!(!rolled_back(201, 201, None));
        // A restore: the index starts again from a handful.
        assert!(rolled_back(4, 201, None));
        // After `raise-floor` recorded that: the history goes on; entries
        // that raise no revision (failed transactions) only raise it.
        let record = raft_record(4, 201);
        assert!(!rolled_back(4, 201, Some(record.as_bytes())));
        assert!(!rolled_back(60, 240, Some(record.as_bytes())));
        // A later restore, from a snapshot holding that record: below it.
        assert!(rolled_back(5, 230, Some(record.as_bytes())));
        // A record above 0 (raise-floor on a history never restored, or
        // padded past a small history's revisions) is the bar: the
        // difference only grows from it; a restore of a backup holding it
        // starts below it. One that does not parse is none.
        let padded = raft_record(10_300, 100);
        assert!(!rolled_back(10_300, 100, Some(padded.as_bytes())));
        assert!(!rolled_back(10_400, 150, Some(padded.as_bytes())));
        assert!(rolled_back(304, 100, Some(padded.as_bytes())));
        assert!(rolled_back(10, 10, Some(raft_record(300, 100).as_bytes())));
        assert!(rolled_back(4, 201, Some(b"junk")));
        assert!(rolled_back(4, 201, Some(b"-9999999/1")));
    }

    #[test]
    fn a_restore_mark_names_its_gateway_s_floor() {
        assert_eq!(super::floor_in_mark(super::mark_value(120, 7_744).as_bytes()), Some(7_744));
        assert_eq!(super::floor_in_mark(b"by hand"), None);
    }
}
