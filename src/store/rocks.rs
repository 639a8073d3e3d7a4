//! The RocksDB backend of the store (feature `rocksdb`, on by default):
//! three column families and the one group-commit writer thread. See the
//! parent module for the contract.

use std::path::Path;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Instant;

use rocksdb::{ColumnFamilyDescriptor, IteratorMode, Options, WriteBatch, WriteOptions, DB};

use super::{decode_u64, Commit, GrantRecord, Op, SyncObserver, WriterOptions};
use crate::error::Error;

const CF_FENCES: &str = "fences";
const CF_GRANTS: &str = "grants";
const CF_COUNTERS: &str = "counters";

/// The open database and its writer. Dropping the last handle closes the
/// queue, lets the writer finish what was queued, and joins it, so the
/// database is closed (and its lock released) when the drop returns.
pub(super) struct Rocks {
    db: Arc<DB>,
    tx: Option<mpsc::Sender<Commit>>,
    writer: Option<std::thread::JoinHandle<()>>,
    was_clean: bool,
}

impl Drop for Rocks {
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

impl Rocks {
    /// Opens (or creates) the database, counts a boot, starts the writer.
    pub(super) fn open(dir: &Path, writer: WriterOptions, observe: SyncObserver) -> Result<Rocks, Error> {
        std::fs::create_dir_all(dir).map_err(|e| Error::Store(format!("creating {}: {e}", dir.display())))?;
        let mut opts = Options::default();
        opts.create_if_missing(true);
        opts.create_missing_column_families(true);
        // Fences are tiny and read once at start; keep RocksDB's own
        // memory and background work small on a 2-core machine.
        opts.set_max_background_jobs(2);
        opts.set_keep_log_file_num(4);
        let cfs = [CF_FENCES, CF_GRANTS, CF_COUNTERS].map(|name| ColumnFamilyDescriptor::new(name, Options::default()));
        let db = DB::open_cf_descriptors(&opts, dir.join("db"), cfs)
            .map_err(|e| Error::Store(format!("opening RocksDB in {}: {e}", dir.display())))?;
        let db = Arc::new(db);
        let was_clean = bump_boots(&db)?;
        let (tx, rx) = mpsc::channel::<Commit>();
        let writer_db = db.clone();
        let handle = std::thread::Builder::new()
            .name("fencegate-store-writer".into())
            .spawn(move || writer_loop(&writer_db, &rx, writer, &observe))
            .map_err(|e| Error::Store(format!("starting the store writer: {e}")))?;
        Ok(Rocks { db, tx: Some(tx), writer: Some(handle), was_clean })
    }

    /// True if the previous process stopped cleanly (or there was none).
    pub(super) fn was_clean(&self) -> bool {
        self.was_clean
    }

    /// Records, durably, that this process drained and stopped cleanly.
    /// The memtables are flushed first, so that the next start reads
    /// sorted tables instead of replaying the log.
    pub(super) fn mark_clean(&self) -> Result<(), Error> {
        for name in [CF_FENCES, CF_GRANTS] {
            let handle = cf(&self.db, name)?;
            if let Err(e) = self.db.flush_cf(handle) {
                // Not fatal: the log still holds everything.
                tracing::warn!(error = %e, cf = name, "flushing at stop failed");
            }
        }
        let cf = cf(&self.db, CF_COUNTERS)?;
        let mut wo = WriteOptions::default();
        wo.set_sync(true);
        let mut batch = WriteBatch::default();
        batch.put_cf(cf, b"clean", 1u64.to_be_bytes());
        self.db.write_opt(batch, &wo).map_err(|e| Error::Store(format!("writing the clean-stop mark: {e}")))
    }

    /// Hands a commit to the writer. A send error means the writer is
    /// gone; the dropped sender then resolves the caller with an error.
    pub(super) fn send(&self, commit: Commit) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(commit);
        }
    }

    pub(super) fn for_each_fence(&self, f: &mut dyn FnMut(&str, u64)) -> Result<(), Error> {
        let db = &self.db;
        let cf = cf(db, CF_FENCES)?;
        for item in db.iterator_cf(cf, IteratorMode::Start) {
            let (k, v) = item.map_err(|e| Error::Store(format!("reading fences: {e}")))?;
            let key = std::str::from_utf8(&k).map_err(|_| Error::Store("reading fences: a key is not UTF-8".into()))?;
            let token = decode_u64(&v).ok_or_else(|| Error::Store(format!("reading fence of {key}: bad value")))?;
            f(key, token);
        }
        Ok(())
    }

    pub(super) fn estimated_fences(&self) -> usize {
        let Ok(cf) = cf(&self.db, CF_FENCES) else {
            return 0;
        };
        self.db
            .property_int_value_cf(cf, "rocksdb.estimate-num-keys")
            .ok()
            .flatten()
            .map_or(0, |n| usize::try_from(n).unwrap_or(0))
    }

    pub(super) fn grants(&self) -> Result<Vec<(String, GrantRecord)>, Error> {
        let db = &self.db;
        let cf = cf(db, CF_GRANTS)?;
        let mut out = Vec::new();
        for item in db.iterator_cf(cf, IteratorMode::Start) {
            let (k, v) = item.map_err(|e| Error::Store(format!("reading grants: {e}")))?;
            let key =
                String::from_utf8(k.to_vec()).map_err(|_| Error::Store("reading grants: a key is not UTF-8".into()))?;
            let record: GrantRecord =
                serde_json::from_slice(&v).map_err(|e| Error::Store(format!("reading grant of {key}: {e}")))?;
            out.push((key, record));
        }
        Ok(out)
    }

    pub(super) fn boots(&self) -> Result<u64, Error> {
        let db = &self.db;
        let cf = cf(db, CF_COUNTERS)?;
        let v = db.get_cf(cf, b"boots").map_err(|e| Error::Store(format!("reading boots: {e}")))?;
        Ok(v.as_deref().and_then(decode_u64).unwrap_or(0))
    }
}

fn cf<'a>(db: &'a DB, name: &str) -> Result<&'a rocksdb::ColumnFamily, Error> {
    db.cf_handle(name).ok_or_else(|| Error::Store(format!("column family {name} missing")))
}

/// Counts a boot and clears the clean-stop mark, in one synced write.
/// Returns whether the previous process stopped cleanly (or there was
/// none): its mark was set, or this is the first boot.
fn bump_boots(db: &DB) -> Result<bool, Error> {
    let cf = cf(db, CF_COUNTERS)?;
    let old = db.get_cf(cf, b"boots").map_err(|e| Error::Store(format!("reading boots: {e}")))?;
    let old_boots = old.as_deref().and_then(decode_u64).unwrap_or(0);
    let clean = db.get_cf(cf, b"clean").map_err(|e| Error::Store(format!("reading the clean mark: {e}")))?;
    let was_clean = old_boots == 0 || clean.as_deref().and_then(decode_u64) == Some(1);
    let mut wo = WriteOptions::default();
    wo.set_sync(true);
    let mut batch = WriteBatch::default();
    batch.put_cf(cf, b"boots", (old_boots + 1).to_be_bytes());
    batch.put_cf(cf, b"clean", 0u64.to_be_bytes());
    db.write_opt(batch, &wo).map_err(|e| Error::Store(format!("writing boots: {e}")))?;
    Ok(was_clean)
}

/// The single writer: waits for work, drains what is queued (up to
/// `max_batch`), writes it as one batch with one fsync, answers everyone.
fn writer_loop(db: &DB, rx: &mpsc::Receiver<Commit>, opts: WriterOptions, observe: &SyncObserver) {
    let mut wo = WriteOptions::default();
    wo.set_sync(true);
    let limit = if opts.group_commit { opts.max_batch.max(1) } else { 1 };
    while let Ok(first) = rx.recv() {
        let mut group = vec![first];
        while group.len() < limit {
            match rx.try_recv() {
                Ok(c) => group.push(c),
                Err(_) => break,
            }
        }
        let result = write_group(db, &group, &wo, observe);
        for commit in group {
            if let Some(done) = commit.done {
                let _ = done.send(result.clone());
            }
        }
    }
}

fn write_group(db: &DB, group: &[Commit], wo: &WriteOptions, observe: &SyncObserver) -> Result<(), Error> {
    let (Some(fences), Some(grants)) = (db.cf_handle(CF_FENCES), db.cf_handle(CF_GRANTS)) else {
        return Err(Error::Store("column families missing".into()));
    };
    let mut batch = WriteBatch::default();
    for op in group.iter().flat_map(|c| c.ops.iter()) {
        match op {
            Op::Fence { key, token } => batch.put_cf(fences, key.as_bytes(), token.to_be_bytes()),
            Op::Grant { key, record } => {
                let value =
                    serde_json::to_vec(record).map_err(|e| Error::Store(format!("encoding grant of {key}: {e}")))?;
                batch.put_cf(grants, key.as_bytes(), value);
            }
            Op::DropGrant { key } => batch.delete_cf(grants, key.as_bytes()),
        }
    }
    let started = Instant::now();
    let result =
        db.write_opt(batch, wo).map_err(|e| Error::Store(format!("writing {} ops with fsync: {e}", group.len())));
    observe(started.elapsed(), group.len());
    if let Err(e) = &result {
        tracing::error!(error = %e, "group commit failed");
    }
    result
}

#[cfg(test)]
mod tests {
    use super::super::{GrantRecord, Op, Store, SyncObserver, WriterOptions};
    use std::path::Path;
    use std::sync::Arc;

    fn open(dir: &Path) -> Store {
        let noop: SyncObserver = Arc::new(|_, _| {});
        Store::open(dir, WriterOptions { group_commit: true, max_batch: 64 }, noop).unwrap()
    }

    #[tokio::test]
    async fn fences_and_grants_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = open(dir.path());
            let key: Arc<str> = Arc::from("orders/1");
            let record = GrantRecord { token: 7, lease_id: "x".into(), holder: "h".into(), ttl_ms: 500 };
            s.commit(vec![Op::Fence { key: key.clone(), token: 7 }, Op::Grant { key: key.clone(), record }])
                .await
                .unwrap();
            s.commit(vec![Op::Fence { key: Arc::from("b"), token: 3 }]).await.unwrap();
        }
        let s = open(dir.path());
        let mut seen = Vec::new();
        s.for_each_fence(|k, t| seen.push((k.to_string(), t))).unwrap();
        assert_eq!(seen, vec![("b".to_string(), 3), ("orders/1".to_string(), 7)]);
        let grants = s.grants().unwrap();
        assert_eq!(grants.len(), 1);
        assert_eq!(grants[0].1.token, 7);
        assert_eq!(s.boots().unwrap(), 2);
    }

    #[tokio::test]
    async fn dropped_grant_is_gone_after_reopen() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = open(dir.path());
            let key: Arc<str> = Arc::from("k");
            let record = GrantRecord { token: 1, lease_id: "x".into(), holder: String::new(), ttl_ms: 500 };
            s.commit(vec![Op::Grant { key: key.clone(), record }]).await.unwrap();
            s.commit(vec![Op::DropGrant { key }]).await.unwrap();
        }
        assert!(open(dir.path()).grants().unwrap().is_empty());
    }
}
