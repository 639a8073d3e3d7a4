//! The durable token floor. Tokens are etcd revisions (plus an offset); an
//! etcd restored from a snapshot, or a new etcd cluster, numbers revisions
//! from lower again, and would issue tokens a second time. Each gateway
//! keeps the highest token it has seen in `<data_dir>/cluster-floor`
//! (fsynced, coalesced), with the etcd cluster id it came from. A grant is
//! refused while `offset + etcd's revision` is below the floor; the
//! operator raises the offset with `fencegate cluster raise-floor --to N`.
//!
//! Every grant waits for its token to be in the file, and every gateway
//! writes the tokens it sees, so the file is written all the time under
//! load: in place, not by a new file renamed over the old one. It holds
//! two 512-byte slots written in turn, each a record with a sequence
//! number and a checksum, and one `fdatasync` makes a write durable (no
//! file is created or renamed, no directory synced: ~0.1 ms instead of
//! ~0.6 ms per write here, and one device flush instead of three). A write
//! torn by a crash spoils at most the slot it was writing, whose value no
//! grant had waited for yet: the other slot holds the floor before it.
//! The file is created whole once (written, synced, renamed into place).
//! A floor kept by an older version in `cluster-floor.json` is carried over.
//!
//! The same file keeps the restore detection's state (`raft.rs`): the
//! highest etcd raft index this gateway proved applied (`raft_mark`), and
//! whether it found etcd's log behind it (`restored`: the etcd revision it
//! found it at), so that a restart does not forget either.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use etcd_client::{Compare, CompareOp, GetOptions, Txn, TxnOp};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::config::ClusterConfig;
use crate::error::Error;
use crate::shutdown::Shutdown;

/// The floor file's name in the data dir, and the older version's.
const FILE: &str = "cluster-floor";
const OLD_FILE: &str = "cluster-floor.json";
/// One slot: a sector, so that a slot's write never shares a sector with
/// the other slot.
const SLOT: usize = 512;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
struct Record {
    floor: u64,
    cluster_id: u64,
    #[serde(default)]
    raft_mark: u64,
    #[serde(default)]
    restored: i64,
    /// The token floor when that restore was found (what `raise-floor
    /// --to` must cover), kept so that a restart does not take the floor
    /// on disk — `raise-floor`'s own lifted fences among it — for it.
    #[serde(default)]
    restored_floor: Option<u64>,
}

/// One slot as written: the record, its sequence number (the slot with the
/// higher one is the newer), and a checksum of both.
#[derive(Debug, Serialize, Deserialize)]
struct Slot {
    seq: u64,
    floor: u64,
    cluster_id: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    raft_mark: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    restored: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    restored_floor: Option<u64>,
    check: String,
}

fn is_zero<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}

/// The checksum of a slot; a slot without restore-detection state is
/// checked as an older version wrote it, so both read each other's files.
fn check_of(seq: u64, r: Record) -> String {
    let text = match (r.raft_mark, r.restored, r.restored_floor) {
        (0, 0, None) => format!("{seq}/{}/{}", r.floor, r.cluster_id),
        (mark, restored, None) => format!("{seq}/{}/{}/{mark}/{restored}", r.floor, r.cluster_id),
        (mark, restored, Some(at)) => format!("{seq}/{}/{}/{mark}/{restored}/{at}", r.floor, r.cluster_id),
    };
    let d = ring::digest::digest(&ring::digest::SHA256, text.as_bytes());
    d.as_ref()[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// A slot's bytes: its JSON, padded with spaces, ending in a newline.
fn encode(seq: u64, r: Record) -> Result<Vec<u8>, String> {
    let slot = Slot {
        seq,
        floor: r.floor,
        cluster_id: r.cluster_id,
        raft_mark: r.raft_mark,
        restored: r.restored,
        restored_floor: r.restored_floor,
        check: check_of(seq, r),
    };
    let mut bytes = serde_json::to_vec(&slot).map_err(|e| e.to_string())?;
    if bytes.len() >= SLOT {
        return Err("a floor record longer than its slot".into());
    }
    bytes.resize(SLOT - 1, b' ');
    bytes.push(b'\n');
    Ok(bytes)
}

/// The record a slot holds, if it is whole (parses, checksum right).
fn decode(bytes: &[u8]) -> Option<(u64, Record)> {
    let slot: Slot = serde_json::from_slice(bytes.trim_ascii()).ok()?;
    let record = Record {
        floor: slot.floor,
        cluster_id: slot.cluster_id,
        raft_mark: slot.raft_mark,
        restored: slot.restored,
        restored_floor: slot.restored_floor,
    };
    (check_of(slot.seq, record) == slot.check).then_some((slot.seq, record))
}

/// The newest whole slot of a floor file's contents; `None` when neither is.
fn newest(bytes: &[u8]) -> Option<(u64, Record)> {
    bytes.chunks(SLOT).take(2).filter_map(decode).max_by_key(|(seq, _)| *seq)
}

/// The floor file, open for writes in place.
#[derive(Debug)]
struct File {
    file: std::fs::File,
    /// Sequence number of the last slot written.
    seq: u64,
}

impl File {
    /// Opens the floor file in `dir`, creating it whole (from the older
    /// version's file, if any) when there is none. Fails when the file is
    /// there but neither slot is whole: that is not a torn write, and a
    /// floor of 0 would let tokens repeat.
    fn open(dir: &Path) -> Result<(File, Record), Error> {
        let path = dir.join(FILE);
        let store_err = |what: &str, e: std::io::Error| Error::Store(format!("{what} {}: {e}", path.display()));
        match std::fs::read(&path) {
            Ok(bytes) => {
                let (seq, mut record) = newest(&bytes).ok_or_else(|| {
                    Error::Store(format!(
                        "{} holds no whole floor record (damaged?): refusing to start with a floor of 0; restore it, \
                         or remove it and raise the floor with `fencegate cluster raise-floor`",
                        path.display()
                    ))
                })?;
                let file = std::fs::OpenOptions::new().write(true).open(&path).map_err(|e| store_err("opening", e))?;
                let mut file = File { file, seq };
                // An older version's file beside it (written by that version
                // after a downgrade, say): the higher floor wins, kept in
                // the new file before the old one goes.
                let old_path = dir.join(OLD_FILE);
                if old_path.exists() {
                    let old = read_old(&old_path)?;
                    if old.floor > record.floor {
                        record = Record { floor: old.floor, cluster_id: old.cluster_id, ..record };
                        file.write(record).map_err(Error::Store)?;
                    }
                    let _ = std::fs::remove_file(&old_path);
                }
                Ok((file, record))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let record = read_old(&dir.join(OLD_FILE))?;
                let tmp = dir.join(format!("{FILE}.tmp"));
                let mut bytes = encode(0, record).map_err(Error::Store)?;
                bytes.extend(encode(1, record).map_err(Error::Store)?);
                std::fs::write(&tmp, &bytes).map_err(|e| store_err("creating", e))?;
                let file = std::fs::OpenOptions::new().write(true).open(&tmp).map_err(|e| store_err("opening", e))?;
                file.sync_all().map_err(|e| store_err("syncing", e))?;
                std::fs::rename(&tmp, &path).map_err(|e| store_err("renaming into", e))?;
                std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(|e| store_err("syncing the dir of", e))?;
                // The old file's floor is in the new one now, durably.
                let _ = std::fs::remove_file(dir.join(OLD_FILE));
                Ok((File { file, seq: 1 }, record))
            }
            Err(e) => Err(store_err("reading", e)),
        }
    }

    /// Writes `record` over the older slot and syncs it.
    fn write(&mut self, record: Record) -> Result<(), String> {
        let seq = self.seq + 1;
        let bytes = encode(seq, record)?;
        let at = (seq % 2) * SLOT as u64;
        self.file.write_all_at(&bytes, at).map_err(|e| format!("writing the floor: {e}"))?;
        self.file.sync_data().map_err(|e| format!("syncing the floor: {e}"))?;
        self.seq = seq;
        Ok(())
    }
}

/// The floor an older version kept (0 when there is none).
fn read_old(path: &Path) -> Result<Record, Error> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice::<Record>(&bytes)
            .map_err(|e| Error::Store(format!("{} does not parse: {e}", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Record::default()),
        Err(e) => Err(Error::Store(format!("reading {}: {e}", path.display()))),
    }
}

/// The floor of one gateway.
#[derive(Debug)]
pub(super) struct Floor {
    path: PathBuf,
    file: Arc<Mutex<File>>,
    highest: watch::Sender<u64>,
    persisted: watch::Sender<u64>,
    cluster_id: Mutex<u64>,
    /// The restore detection's state (`raft.rs`).
    raft: Mutex<Raft>,
}

/// What the restore detection keeps: the highest raft index proved
/// applied, and the etcd revision at which etcd's log was found behind it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Raft {
    pub(super) mark: u64,
    pub(super) restored: Option<i64>,
    /// The revision of the offset write that last ended a restore here
    /// (not kept on disk: a process started later reads past it). A
    /// measurement read before it may have missed that `raise-floor`'s
    /// record, so its rolled-back verdict is not taken.
    pub(super) ended_at: i64,
    /// The token floor when the restore was found (after a restart: the
    /// floor on disk): what `raise-floor --to` must cover. Tokens seen
    /// since — `raise-floor`'s own lifted fences among them — are above it.
    pub(super) floor_at: u64,
}

impl Raft {
    /// The file's record of this state with `floor` and `cluster_id`.
    fn record(self, floor: u64, cluster_id: u64) -> Record {
        Record {
            floor,
            cluster_id,
            raft_mark: self.mark,
            restored: self.restored.unwrap_or(0),
            restored_floor: self.restored.map(|_| self.floor_at),
        }
    }
}

impl Floor {
    /// Reads the floor kept in `dir` (0 when there is none yet).
    pub(super) fn open(dir: &Path) -> Result<Floor, Error> {
        std::fs::create_dir_all(dir).map_err(|e| Error::Store(format!("creating {}: {e}", dir.display())))?;
        let (file, record) = File::open(dir)?;
        Ok(Floor {
            path: dir.join(FILE),
            file: Arc::new(Mutex::new(file)),
            highest: watch::channel(record.floor).0,
            persisted: watch::channel(record.floor).0,
            cluster_id: Mutex::new(record.cluster_id),
            raft: Mutex::new(Raft {
                mark: record.raft_mark,
                restored: (record.restored != 0).then_some(record.restored),
                ended_at: 0,
                // An older version's file has no such floor: the floor
                // on disk, as before.
                floor_at: record.restored_floor.unwrap_or(record.floor),
            }),
        })
    }

    fn lock_raft(&self) -> std::sync::MutexGuard<'_, Raft> {
        self.raft.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The restore detection's state.
    pub(super) fn raft(&self) -> Raft {
        *self.lock_raft()
    }

    /// The token floor when the recorded restore was found.
    pub(super) fn floor_at_restore(&self) -> u64 {
        self.lock_raft().floor_at
    }

    /// The etcd revision at which etcd's log was found behind this
    /// gateway's mark, while no operator has raised the floor since.
    pub(super) fn restored(&self) -> Option<i64> {
        self.lock_raft().restored
    }

    /// etcd's applied raft index `applied`, proved by a linearizable read
    /// at `revision` on the member that reported it; `rolled_back`: that
    /// read found etcd's history rolled back by a restore whatever this
    /// gateway saw before ([`super::raft::rolled_back`]). Returns true when this finds
    /// etcd's log behind the mark, or rolled back, (a restore) for the
    /// first time; otherwise raises the mark. While a restore is recorded
    /// the mark stays as it is (the old log's), and the recorded revision
    /// only goes down (a second restore).
    pub(super) fn observe_raft(&self, applied: u64, revision: i64, rolled_back: bool) -> bool {
        let mut r = self.lock_raft();
        let before = *r;
        let found = match r.restored {
            Some(at) => {
                r.restored = Some(at.min(revision));
                false
            }
            None if applied < r.mark || (rolled_back && revision >= r.ended_at) => {
                r.restored = Some(revision);
                r.floor_at = self.get();
                true
            }
            None => {
                r.mark = applied;
                false
            }
        };
        let changed = *r != before;
        drop(r);
        if changed {
            // Persisted with the floor (coalesced).
            self.highest.send_modify(|_| {});
        }
        found
    }

    /// A restore found another way (`feed.rs`: a new process's first read
    /// found etcd's numbering behind its floor) at `revision`: recorded as
    /// [`Floor::observe_raft`] records one. True when newly recorded.
    pub(super) fn note_restore(&self, revision: i64) -> bool {
        let mut r = self.lock_raft();
        if r.restored.is_some() {
            return false;
        }
        r.restored = Some(revision);
        r.floor_at = self.get();
        drop(r);
        self.highest.send_modify(|_| {});
        true
    }

    /// The token offset was written at revision `rev` (an operator's
    /// `raise-floor`): after a recorded restore, the operator has raised
    /// the floor since, so the restore is over and the mark starts again
    /// from the new log. Returns true when that ended a recorded restore.
    pub(super) fn offset_written(&self, rev: i64) -> bool {
        let mut r = self.lock_raft();
        match r.restored {
            Some(at) if rev > at => {
                *r = Raft { ended_at: rev, ..Raft::default() };
                drop(r);
                self.highest.send_modify(|_| {});
                true
            }
            _ => false,
        }
    }
    /// The highest token seen.
    pub(super) fn get(&self) -> u64 {
        *self.highest.borrow()
    }

    /// A token was seen (issued here or installed from the watch).
    pub(super) fn raise(&self, token: u64) {
        self.highest.send_if_modified(|h| {
            if token > *h {
                *h = token;
                true
            } else {
                false
            }
        });
    }

    /// The etcd cluster id last recorded (0: none yet).
    pub(super) fn cluster_id(&self) -> u64 {
        *self.cluster_id.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records the etcd cluster id; logs when it changed (a restore or a
    /// new cluster) and the revision is below the floor.
    pub(super) fn observe_cluster(&self, cluster_id: u64, revision: i64) {
        let mut id = self.cluster_id.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if *id != cluster_id {
            if *id != 0 {
                tracing::warn!(
                    old = *id,
                    new = cluster_id,
                    revision,
                    floor = self.get(),
                    "the etcd cluster id changed (restore or new cluster): grants wait until its revisions are \
                     above the token floor"
                );
            }
            *id = cluster_id;
            // Persist the new id with the floor.
            self.highest.send_modify(|_| {});
        }
    }

    /// Waits until the floor on disk covers `token`.
    pub(super) async fn wait_persisted(&self, token: u64) -> Result<(), Error> {
        let mut rx = self.persisted.subscribe();
        rx.wait_for(|p| *p >= token)
            .await
            .map(|_| ())
            .map_err(|_| Error::Store("the token floor writer stopped".into()))
    }

    /// Writes the floor whenever it rises (one write in flight; the
    /// latest value).
    pub(super) async fn run(self: Arc<Self>, stop: Shutdown) {
        let mut rx = self.highest.subscribe();
        loop {
            let floor = *rx.borrow_and_update();
            let cluster_id = *self.cluster_id.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let record = self.raft().record(floor, cluster_id);
            let file = self.file.clone();
            let written = tokio::task::spawn_blocking(move || {
                file.lock().unwrap_or_else(std::sync::PoisonError::into_inner).write(record)
            })
            .await;
            match written {
                Ok(Ok(())) => {
                    self.persisted.send_if_modified(|p| {
                        let up = floor > *p;
                        *p = (*p).max(floor);
                        up
                    });
                }
                Ok(Err(e)) => {
                    tracing::error!(path = %self.path.display(), error = %e, "writing the token floor failed; grants wait")
                }
                Err(e) => tracing::error!(error = %e, "the token floor writer panicked"),
            }
            tokio::select! {
                changed = rx.changed() => if changed.is_err() { return },
                () = stop.wait() => return,
            }
        }
    }
}

/// What `raise-floor` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Raised {
    /// The token offset now in etcd.
    pub offset: u64,
    /// Grants not above the floor that it ended ([`end_restored_history`]).
    pub grants_ended: usize,
    /// Fences not above the floor that it raised.
    pub fences_raised: usize,
    /// Raft entries it added before recording etcd's raft index
    /// ([`pad_raft_log`]).
    pub raft_padded: u64,
}

/// Padding transactions in flight at once (etcd's raft batches them).
const PAD_AT_ONCE: u64 = 64;

/// Adds `entries` entries to etcd's raft log that raise no revision, so
/// that the record `raise-floor` then writes (`P meta/raft`, the applied
/// index minus the revision, `raft.rs`) stands that far above what a
/// restore of any later backup starts from. Without it, a backup taken
/// right after a recovery holds a record only a few entries above its own
/// restored start (the entries between the earlier restore and its
/// `raise-floor`): as few revision-less entries on the restored cluster —
/// two leader moves, measured by an outside review — hid the restore from
/// a gateway on an empty data dir. With it, it takes `entries` of them.
/// Each is a transaction whose compare never holds (a key's version is
/// never negative) and that writes in its other branch, so etcd orders it
/// through raft, applies it as failed and makes no revision. Returns how
/// many it added. Only when the operator asks (`--raft-pad`): the raft log
/// is etcd's, so the padding hides as long a restore that another
/// deployment on the same etcd has not been raised for — one nothing in
/// etcd can show (outside reviews: a nested prefix, a deployment newer than
/// the backup; docs/cluster.md). Run after the offset write, so that a run
/// cut short hides nothing of its own prefix's restore.
async fn pad_raft_log(client: &etcd_client::Client, keys: &super::Keys, entries: u64) -> Result<u64, Error> {
    let next = std::sync::atomic::AtomicU64::new(0);
    let key = keys.raft_pad();
    let worker = || async {
        let mut kv = client.kv_client();
        let mut added = 0_u64;
        while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < entries {
            let txn = Txn::new().when([Compare::version(key.as_str(), CompareOp::Less, 0)]).and_then([TxnOp::put(
                key.as_str(),
                "",
                None,
            )]);
            let done = kv.txn(txn).await.map_err(|e| super::unavailable("padding etcd's raft log", e))?;
            if done.succeeded() {
                return Err(Error::Internal("a padding transaction's compare held: etcd answered wrongly".into()));
            }
            added += 1;
        }
        Ok::<u64, Error>(added)
    };
    let added = futures_util::future::try_join_all((0..PAD_AT_ONCE.min(entries)).map(|_| worker())).await?;
    Ok(added.iter().sum())
}

/// The operator's command after an etcd restore: ends the grants and
/// raises the fences a snapshot brought back ([`end_restored_history`]),
/// then raises the token offset so that every token issued from now on is
/// above `to`. Never lowers the offset; always writes it (see below).
pub async fn raise_floor(cfg: &ClusterConfig, to: u64, pad: u64) -> Result<Raised, Error> {
    let client = super::connect(cfg).await?;
    let keys = super::Keys::new(&cfg.prefix);
    let mut kv = client.kv_client();
    let (mut grants_ended, mut fences_raised) = (0, 0);
    // Gateways that found the restore name their floors in their marks: a
    // floor below one leaves grants and fences that gateway saw issued
    // before the restore live (outside review: a superseded holder wrote
    // again through a gateway that could not tell).
    let marks = kv
        .get(keys.restored_prefix(), Some(GetOptions::new().with_prefix()))
        .await
        .map_err(|e| super::unavailable("reading the restore marks", e))?;
    for mark in marks.kvs() {
        if let Some(floor) = super::raft::floor_in_mark(mark.value()).filter(|f| *f > to) {
            let gw = String::from_utf8_lossy(mark.key()).into_owned();
            return Err(Error::BadRequest(format!(
                "{gw}: that gateway found etcd restored with token floor {floor}, above --to {to}: grants and fences \
                 issued before the restore would stay live; run again with --to {floor} or higher (the highest floor of \
                 every gateway)"
            )));
        }
    }
    let mut maintenance = client.maintenance_client();
    for _ in 0..16 {
        // etcd's raft index, then (a linearizable read, later) the
        // revision: their difference is at most the history's here, so
        // the gateways never take the history after this for a restore
        // (`raft.rs`, `rolled_back`).
        let applied = maintenance
            .status()
            .await
            .map_err(|e| super::unavailable("reading the raft index", e))?
            .raft_applied_index();
        let resp = kv
            .get(keys.offset(), Some(GetOptions::new()))
            .await
            .map_err(|e| super::unavailable("reading the offset", e))?;
        let revision = resp.header().map_or(0, |h| h.revision());
        let (old, old_rev) = match resp.kvs().first() {
            Some(kv) => {
                let v =
                    kv.value_str().ok().and_then(|v| v.trim().parse::<u64>().ok()).ok_or_else(|| {
                        Error::Internal("the token offset in etcd does not parse; fix it by hand".into())
                    })?;
                (v, kv.mod_revision())
            }
            None => (0, 0),
        };
        // The next transaction's revision is above `revision`, and its
        // tokens are at least `offset + (revision + 1) · TOKEN_SLOTS`.
        let needed = to.saturating_sub(super::rev_u64(revision).saturating_mul(super::TOKEN_SLOTS)).max(old);
        // Before the offset (whose write ends the restore marks' hold):
        // what a snapshot brought back of the history before `to`.
        let (grants, fences) = end_restored_history(&mut kv, &keys, to, needed).await?;
        grants_ended += grants;
        fences_raised += fences;
        // Written even when it is high enough already: gateways that found
        // etcd's log behind them (a restore, `raft.rs`) take a write of the
        // offset after that as the operator's word that the floor was
        // raised past every token issued before it.
        let txn = Txn::new().when([Compare::mod_revision(keys.offset(), CompareOp::Equal, old_rev)]).and_then([
            TxnOp::put(keys.raised_to(), to.to_string(), None),
            TxnOp::put(keys.offset(), needed.to_string(), None),
            TxnOp::put(keys.raft_record(), super::raft::raft_record(applied, revision), None),
            // The marks of gateways that found a restore (`raft.rs`).
            TxnOp::delete(keys.restored_prefix(), Some(etcd_client::DeleteOptions::new().with_prefix())),
        ]);
        let done = kv.txn(txn).await.map_err(|e| super::unavailable("raising the offset", e))?;
        if done.succeeded() {
            // Only now, the restore ended for this prefix: padding before
            // this write, cut short (interrupted, etcd lost), would have
            // hidden the restore it was run for (outside review).
            let written = done.header().map_or(0, |h| h.revision());
            let raft_padded = pad_raft_log(&client, &keys, pad).await?;
            if raft_padded > 0 {
                record_after_padding(&mut kv, &mut maintenance, &keys, written).await?;
            }
            return Ok(Raised { offset: needed, grants_ended, fences_raised, raft_padded });
        }
    }
    Err(Error::Unavailable("the token offset kept changing; try again".into()))
}

/// After the padding: `P meta/raft` measured again (the index first, then
/// the revision), written only while the offset and the record are the
/// ones this run wrote at `written` (a later `raise-floor` wrote its own).
async fn record_after_padding(
    kv: &mut etcd_client::KvClient,
    maintenance: &mut etcd_client::MaintenanceClient,
    keys: &super::Keys,
    written: i64,
) -> Result<(), Error> {
    let applied =
        maintenance.status().await.map_err(|e| super::unavailable("reading the raft index", e))?.raft_applied_index();
    let read = kv.get(keys.raft_record(), None).await.map_err(|e| super::unavailable("reading the record", e))?;
    let revision = read.header().map_or(0, |h| h.revision());
    let txn = Txn::new()
        .when([
            Compare::mod_revision(keys.offset(), CompareOp::Equal, written),
            Compare::mod_revision(keys.raft_record(), CompareOp::Equal, written),
        ])
        .and_then([TxnOp::put(keys.raft_record(), super::raft::raft_record(applied, revision), None)]);
    kv.txn(txn).await.map_err(|e| super::unavailable("recording the raft index", e))?;
    Ok(())
}

/// Sub-transactions per transaction of [`end_restored_history`] (one
/// compare and one write each; etcd's `--max-txn-ops` is 128).
const CLEANUP_BATCH: usize = 50;

/// A snapshot restore brings back the grants and fences of its time: a
/// grant released (or expired) since, whose holder was superseded, is live
/// again, and its key's fence is back at that grant's token — a gateway
/// that loads this view (started after the restore) would renew it and
/// admit the old holder's writes (an outside review landed such writes
/// after the newer holder's, with the documented procedure followed). So
/// `raise-floor` ends every grant whose token is not above `to` (issued
/// before the floor: in the history the restore lost, it may have been
/// superseded) and puts every fence not above `to` again with the new
/// offset `needed`, which moves it above `to` (a fence's token is its
/// value's offset + its revision · 64 + slot, and every revision from now
/// on is above the one `needed` was computed at). The old holders' tokens
/// are then stale everywhere; they acquire again. Grants and fences above
/// `to` (made after an earlier `raise-floor`) are left alone, so running
/// it twice changes nothing the second time. Each change compares the
/// revision it read, so a key written meanwhile is left as it is.
/// Returns how many grants it ended and fences it raised.
async fn end_restored_history(
    kv: &mut etcd_client::KvClient,
    keys: &super::Keys,
    to: u64,
    needed: u64,
) -> Result<(usize, usize), Error> {
    let mut subs: Vec<TxnOp> = Vec::new();
    // Whether each sub-transaction of `subs` ends a grant (else raises a fence).
    let mut is_grant: Vec<bool> = Vec::new();
    let (mut grants, mut fences) = (0_usize, 0_usize);
    let mut start = keys.prefix.clone().into_bytes();
    let end = keys.prefix_end();
    let mut revision = 0;
    loop {
        let mut opts = GetOptions::new().with_range(end.clone()).with_limit(500);
        if revision > 0 {
            opts = opts.with_revision(revision);
        }
        let mut resp =
            kv.get(start.clone(), Some(opts)).await.map_err(|e| super::unavailable("reading the keys", e))?;
        if revision == 0 {
            revision = resp.header().map_or(0, |h| h.revision());
        }
        let more = resp.more();
        let page = resp.take_kvs();
        let Some(last) = page.last() else { break };
        start = last.key().to_vec();
        start.push(0);
        for item in &page {
            match keys.kind(item.key()) {
                super::Kind::Grant(_) => {
                    let token = serde_json::from_slice::<super::mirror::GrantValue>(item.value())
                        .map_or(0, |v| super::token_of(v.o, item.create_revision(), v.i));
                    if token <= to {
                        subs.push(TxnOp::txn(
                            Txn::new()
                                .when([Compare::create_revision(item.key(), CompareOp::Equal, item.create_revision())])
                                .and_then([TxnOp::delete(item.key(), None)]),
                        ));
                        is_grant.push(true);
                    }
                }
                super::Kind::Fence(_) if super::feed::fence_token(item) <= to => {
                    subs.push(TxnOp::txn(
                        Txn::new()
                            .when([Compare::mod_revision(item.key(), CompareOp::Equal, item.mod_revision())])
                            .and_then([TxnOp::put(item.key(), format!("{needed}/0"), None)]),
                    ));
                    is_grant.push(false);
                }
                _ => {}
            }
            if subs.len() >= CLEANUP_BATCH {
                let batch = Txn::new().and_then(std::mem::take(&mut subs));
                let done =
                    kv.txn(batch).await.map_err(|e| super::unavailable("ending restored grants and fences", e))?;
                let (g, f) = applied(&done, &std::mem::take(&mut is_grant));
                (grants, fences) = (grants + g, fences + f);
            }
        }
        if !more {
            break;
        }
    }
    if !subs.is_empty() {
        let done = kv
            .txn(Txn::new().and_then(subs))
            .await
            .map_err(|e| super::unavailable("ending restored grants and fences", e))?;
        let (g, f) = applied(&done, &is_grant);
        (grants, fences) = (grants + g, fences + f);
    }
    Ok((grants, fences))
}

/// The grants ended and fences raised by one transaction of
/// [`end_restored_history`]: its sub-transactions whose compare held
/// (a key written meanwhile is left alone, and not counted).
fn applied(done: &etcd_client::TxnResponse, is_grant: &[bool]) -> (usize, usize) {
    let mut counts = (0, 0);
    for (op, grant) in done.op_responses().iter().zip(is_grant) {
        if let etcd_client::TxnOpResponse::Txn(t) = op {
            if t.succeeded() {
                if *grant {
                    counts.0 += 1;
                } else {
                    counts.1 += 1;
                }
            }
        }
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn floor_in(dir: &Path) -> Record {
        let f = Floor::open(dir).expect("open");
        let cluster_id = *f.cluster_id.lock().expect("lock");
        f.raft().record(f.get(), cluster_id)
    }

    fn write(dir: &Path, floor: u64, cluster_id: u64) {
        let (mut file, _) = File::open(dir).expect("open");
        file.write(Record { floor, cluster_id, ..Record::default() }).expect("write");
    }

    #[test]
    fn the_floor_is_read_back_after_each_write() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(floor_in(dir.path()), Record::default());
        for floor in [5, 6, 1_000, u64::MAX] {
            write(dir.path(), floor, 42);
            assert_eq!(floor_in(dir.path()), Record { floor, cluster_id: 42, ..Record::default() });
        }
        assert_eq!(std::fs::metadata(dir.path().join(FILE)).expect("stat").len(), 2 * SLOT as u64);
    }

    #[test]
    fn a_torn_write_leaves_the_floor_before_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut file, _) = File::open(dir.path()).expect("open");
        file.write(Record { floor: 10, cluster_id: 1, ..Record::default() }).expect("write");
        file.write(Record { floor: 20, cluster_id: 1, ..Record::default() }).expect("write");
        // The next write goes to the slot holding 10; a crash tears it.
        let at = ((file.seq + 1) % 2) * SLOT as u64;
        let mut torn = encode(file.seq + 1, Record { floor: 30, cluster_id: 1, ..Record::default() }).expect("encode");
        torn[20..].fill(0);
        file.file.write_all_at(&torn, at).expect("tear");
        assert_eq!(floor_in(dir.path()).floor, 20);
        // Whole again, it wins.
        file.write(Record { floor: 30, cluster_id: 1, ..Record::default() }).expect("write");
        assert_eq!(floor_in(dir.path()).floor, 30);
    }

    #[test]
    fn a_floor_file_with_no_whole_slot_refuses_to_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        write(dir.path(), 7, 1);
        let path = dir.path().join(FILE);
        let mut bytes = std::fs::read(&path).expect("read");
        // A changed digit in each slot: the checksums no longer match.
        for slot in bytes.chunks_mut(SLOT) {
            let i = slot.iter().position(|b| b.is_ascii_digit()).expect("digit");
            slot[i] = if slot[i] == b'9' { b'8' } else { slot[i] + 1 };
        }
        std::fs::write(&path, &bytes).expect("write");
        let err = Floor::open(dir.path()).expect_err("must refuse");
        assert!(err.to_string().contains("no whole floor record"), "{err}");
    }

    #[test]
    fn beside_the_new_file_an_older_versions_higher_floor_wins() {
        let dir = tempfile::tempdir().expect("tempdir");
        write(dir.path(), 5, 1);
        std::fs::write(dir.path().join(OLD_FILE), br#"{"floor":999,"cluster_id":2}"#).expect("write");
        assert_eq!(floor_in(dir.path()), Record { floor: 999, cluster_id: 2, ..Record::default() });
        assert!(!dir.path().join(OLD_FILE).exists());
        assert_eq!(floor_in(dir.path()), Record { floor: 999, cluster_id: 2, ..Record::default() });
        // A lower one does not lower it.
        std::fs::write(dir.path().join(OLD_FILE), br#"{"floor":7,"cluster_id":2}"#).expect("write");
        assert_eq!(floor_in(dir.path()).floor, 999);
    }

    #[test]
    fn an_older_versions_floor_is_carried_over() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join(OLD_FILE), br#"{"floor":77,"cluster_id":5}"#).expect("write");
        assert_eq!(floor_in(dir.path()), Record { floor: 77, cluster_id: 5, ..Record::default() });
        assert!(!dir.path().join(OLD_FILE).exists());
        assert_eq!(floor_in(dir.path()), Record { floor: 77, cluster_id: 5, ..Record::default() });
    }

    #[test]
    fn the_restore_detection_state_is_kept_and_an_older_slot_still_reads() {
        let dir = tempfile::tempdir().expect("tempdir");
        let r = Record { floor: 9, cluster_id: 3, raft_mark: 1_000, restored: 77, restored_floor: Some(5) };
        write(dir.path(), 9, 3);
        // A slot as an older version wrote it (no restore fields) reads back.
        assert_eq!(floor_in(dir.path()), Record { floor: 9, cluster_id: 3, ..Record::default() });
        let (mut file, _) = File::open(dir.path()).expect("open");
        file.write(r).expect("write");
        assert_eq!(floor_in(dir.path()), r);
        // The state is under the checksum: a changed mark spoils the slot.
        let path = dir.path().join(FILE);
        let text = std::fs::read_to_string(&path).expect("read");
        std::fs::write(&path, text.replace("\"raft_mark\":1000", "\"raft_mark\":1")).expect("write");
        assert_eq!(floor_in(dir.path()), Record { floor: 9, cluster_id: 3, ..Record::default() });
    }

    #[test]
    fn a_log_behind_the_mark_is_a_restore_until_the_offset_is_written_after_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = Floor::open(dir.path()).expect("open");
        assert!(!f.observe_raft(500, 40, false));
        assert!(!f.observe_raft(400 + 100, 41, false), "the same index again is not behind");
        assert_eq!(f.raft().mark, 500);
        assert!(f.observe_raft(7, 30, false), "a log behind the mark is a restore");
        assert_eq!(f.restored(), Some(30));
        assert!(!f.observe_raft(9_000, 35, false), "found once; the mark stays");
        assert_eq!(f.raft().mark, 500);
        assert!(!f.observe_raft(8, 20, false));
        assert_eq!(f.restored(), Some(20), "a second restore lowers the revision found at");
        assert!(!f.offset_written(20), "an offset written before it does not end it");
        assert!(f.offset_written(21));
        assert_eq!(f.restored(), None);
        assert!(!f.observe_raft(8, 22, false), "the mark starts again from the new log");
        assert_eq!(f.raft().mark, 8);
    }

    #[test]
    fn a_rolled_back_history_is_a_restore_without_a_mark_but_not_when_read_before_the_raise_floor_that_ended_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = Floor::open(dir.path()).expect("open");
        assert_eq!(f.raft().mark, 0, "an empty data dir has no mark");
        assert!(f.observe_raft(7, 5_000, true), "found by etcd alone");
        assert_eq!(f.restored(), Some(5_000));
        assert!(f.offset_written(5_010));
        // A measurement read before that raise-floor (it could not see its
        // record) does not find the same restore again; one read at or
        // after it does (its record was in the read).
        assert!(!f.observe_raft(9, 5_009, true));
        assert_eq!(f.restored(), None);
        assert!(f.observe_raft(12, 5_010, true));
        assert_eq!(f.restored(), Some(5_010));
    }

    #[test]
    fn a_restore_keeps_the_floor_it_was_found_at_whatever_is_seen_after() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = Floor::open(dir.path()).expect("open");
        f.raise(7_360);
        assert!(f.observe_raft(6, 14, true));
        // `raise-floor`'s own lifted fences, installed from the watch.
        f.raise(7_424);
        assert_eq!(f.get(), 7_424);
        assert_eq!(f.floor_at_restore(), 7_360, "what `raise-floor --to` must cover");
        assert!(!f.observe_raft(7, 20, true), "found once");
        assert_eq!(f.floor_at_restore(), 7_360);
        assert!(f.offset_written(30));
        assert_eq!(f.floor_at_restore(), 0);
    }

    /// Outside review (LOW): after a restart the floor a restore was found
    /// at was the floor on disk, `raise-floor`'s own lifted fence among it,
    /// so the procedure's second `raise-floor --to` (the first's floor) was
    /// refused. It is kept in the file now; an older file has none.
    #[test]
    fn a_restart_keeps_the_floor_a_restore_was_found_at() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut file, _) = File::open(dir.path()).expect("open");
        let found = Record { floor: 7_424, cluster_id: 1, raft_mark: 40, restored: 14, restored_floor: Some(7_360) };
        file.write(found).expect("write");
        let f = Floor::open(dir.path()).expect("reopen");
        assert_eq!(f.get(), 7_424);
        assert_eq!(f.restored(), Some(14));
        assert_eq!(f.floor_at_restore(), 7_360);
        assert_eq!(floor_in(dir.path()), found);
        // As an older version wrote it: the floor on disk.
        file.write(Record { restored_floor: None, ..found }).expect("write");
        assert_eq!(Floor::open(dir.path()).expect("reopen").floor_at_restore(), 7_424);
        // A floor of 0 found is kept as 0.
        file.write(Record { restored_floor: Some(0), ..found }).expect("write");
        assert_eq!(Floor::open(dir.path()).expect("reopen").floor_at_restore(), 0);
    }
}
