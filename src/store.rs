//! The durable store: RocksDB with three column families, and the one
//! group-commit writer through which every fsynced write goes.
//!
//! - `fences`   key → highest token granted or accepted (u64, big-endian).
//!   The fence doubles as the per-key token counter: the next embedded
//!   grant is `fence + 1`, so a token is never reused.
//! - `grants`   key → the live grant (JSON [`GrantRecord`]); deleted on
//!   release and expiry.
//! - `counters` global counters (`boots`: how many times this data
//!   directory was opened).
//!
//! Contract: a write submitted with [`Store::submit`] is acknowledged only
//! after the WAL holding it was fsynced. Writes are applied in submission
//! order, so a caller that submits while holding a per-key lock gets a
//! per-key durable order equal to its in-memory order. The writer thread
//! folds everything queued into one `WriteBatch` with one fsync (group
//! commit); it never blocks a tokio worker. This module knows nothing of
//! HTTP, leases or waiters.

use std::path::Path;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Instant;

use rocksdb::{ColumnFamilyDescriptor, IteratorMode, Options, WriteBatch, WriteOptions, DB};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use crate::error::Error;

const CF_FENCES: &str = "fences";
const CF_GRANTS: &str = "grants";
const CF_COUNTERS: &str = "counters";

/// A live grant as it is kept on disk. The TTL, not an absolute time, is
/// stored: after a restart the grant comes back with its full TTL.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrantRecord {
    pub token: u64,
    pub lease_id: String,
    pub holder: String,
    pub ttl_ms: u64,
}

/// One write to the store.
#[derive(Debug, Clone)]
pub enum Op {
    /// Set `key`'s fence to `token`. Callers only ever raise a fence.
    Fence { key: Arc<str>, token: u64 },
    /// Record `key`'s live grant.
    Grant { key: Arc<str>, record: GrantRecord },
    /// Forget `key`'s grant (released or expired).
    DropGrant { key: Arc<str> },
}

struct Commit {
    ops: Vec<Op>,
    done: Option<oneshot::Sender<Result<(), Error>>>,
}

/// What the writer reports of each fsync, for metrics.
pub type SyncObserver = Arc<dyn Fn(std::time::Duration, usize) + Send + Sync>;

/// Handle to the open database and its writer thread. Cheap to clone.
#[derive(Clone)]
pub struct Store {
    inner: Inner,
}

#[derive(Clone)]
enum Inner {
    Rocks(Arc<Rocks>),
    /// Not durable: for tests of the state machine under paused time,
    /// where a real fsync would let the paused clock jump ahead.
    Memory(Arc<std::sync::Mutex<MemoryStore>>),
}

/// The open database and its writer. Dropping the last handle closes the
/// queue, lets the writer finish what was queued, and joins it, so the
/// database is closed (and its lock released) when the drop returns.
struct Rocks {
    db: Arc<DB>,
    tx: Option<mpsc::Sender<Commit>>,
    writer: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Rocks {
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

#[derive(Default)]
struct MemoryStore {
    fences: std::collections::BTreeMap<String, u64>,
    grants: std::collections::BTreeMap<String, GrantRecord>,
}

impl MemoryStore {
    fn apply(&mut self, ops: Vec<Op>) {
        for op in ops {
            match op {
                Op::Fence { key, token } => {
                    self.fences.insert(key.to_string(), token);
                }
                Op::Grant { key, record } => {
                    self.grants.insert(key.to_string(), record);
                }
                Op::DropGrant { key } => {
                    self.grants.remove(&*key);
                }
            }
        }
    }
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").finish_non_exhaustive()
    }
}

/// Tuning of the writer.
#[derive(Debug, Clone, Copy)]
pub struct WriterOptions {
    /// Fold queued writes into one fsync.
    pub group_commit: bool,
    /// Most commits folded into one batch.
    pub max_batch: usize,
}

impl Store {
    /// Opens (or creates) the database under `dir` and starts the writer.
    /// Counts one more boot, durably, before returning.
    pub fn open(dir: &Path, writer: WriterOptions, observe: SyncObserver) -> Result<Store, Error> {
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
        bump_boots(&db)?;
        let (tx, rx) = mpsc::channel::<Commit>();
        let writer_db = db.clone();
        let handle = std::thread::Builder::new()
            .name("fencegate-store-writer".into())
            .spawn(move || writer_loop(&writer_db, &rx, writer, &observe))
            .map_err(|e| Error::Store(format!("starting the store writer: {e}")))?;
        let rocks = Rocks { db, tx: Some(tx), writer: Some(handle) };
        Ok(Store { inner: Inner::Rocks(Arc::new(rocks)) })
    }

    /// A store that keeps everything in memory and acknowledges at once.
    /// Not durable; for tests only.
    pub fn memory() -> Store {
        Store { inner: Inner::Memory(Arc::default()) }
    }

    /// Queues `ops` for the next group commit and returns at once. The
    /// receiver resolves once they are fsynced. Non-blocking, so it may be
    /// called while holding a per-key lock (which is what keeps per-key
    /// durable order equal to in-memory order).
    pub fn submit(&self, ops: Vec<Op>) -> oneshot::Receiver<Result<(), Error>> {
        let (done, rx) = oneshot::channel();
        match &self.inner {
            // A send error means the writer thread is gone; the dropped
            // sender then resolves the receiver with an error.
            Inner::Rocks(r) => {
                if let Some(tx) = &r.tx {
                    let _ = tx.send(Commit { ops, done: Some(done) });
                }
            }
            Inner::Memory(m) => {
                if let Ok(mut m) = m.lock() {
                    m.apply(ops);
                    let _ = done.send(Ok(()));
                }
            }
        }
        rx
    }

    /// Queues `ops` without waiting for them: they ride along with the next
    /// fsync. For writes whose loss a restart tolerates (a release).
    pub fn submit_lazy(&self, ops: Vec<Op>) {
        match &self.inner {
            Inner::Rocks(r) => {
                if let Some(tx) = &r.tx {
                    let _ = tx.send(Commit { ops, done: None });
                }
            }
            Inner::Memory(m) => {
                if let Ok(mut m) = m.lock() {
                    m.apply(ops);
                }
            }
        }
    }

    /// Submits and waits for durability.
    pub async fn commit(&self, ops: Vec<Op>) -> Result<(), Error> {
        wait_durable(self.submit(ops)).await
    }

    /// Calls `f` for every stored fence, in key order.
    pub fn for_each_fence(&self, mut f: impl FnMut(&str, u64)) -> Result<(), Error> {
        let db = match &self.inner {
            Inner::Rocks(r) => &r.db,
            Inner::Memory(m) => {
                let m = m.lock().map_err(|_| Error::Store("memory store poisoned".into()))?;
                m.fences.iter().for_each(|(k, t)| f(k, *t));
                return Ok(());
            }
        };
        let cf = cf(db, CF_FENCES)?;
        for item in db.iterator_cf(cf, IteratorMode::Start) {
            let (k, v) = item.map_err(|e| Error::Store(format!("reading fences: {e}")))?;
            let key = std::str::from_utf8(&k).map_err(|_| Error::Store("reading fences: a key is not UTF-8".into()))?;
            let token = decode_u64(&v).ok_or_else(|| Error::Store(format!("reading fence of {key}: bad value")))?;
            f(key, token);
        }
        Ok(())
    }

    /// RocksDB's estimate of the number of fences (to size the table).
    pub fn estimated_fences(&self) -> usize {
        let Inner::Rocks(r) = &self.inner else {
            return 0;
        };
        let Ok(cf) = cf(&r.db, CF_FENCES) else {
            return 0;
        };
        r.db.property_int_value_cf(cf, "rocksdb.estimate-num-keys")
            .ok()
            .flatten()
            .map_or(0, |n| usize::try_from(n).unwrap_or(0))
    }

    /// Every stored grant.
    pub fn grants(&self) -> Result<Vec<(String, GrantRecord)>, Error> {
        let db = match &self.inner {
            Inner::Rocks(r) => &r.db,
            Inner::Memory(m) => {
                let m = m.lock().map_err(|_| Error::Store("memory store poisoned".into()))?;
                return Ok(m.grants.iter().map(|(k, g)| (k.clone(), g.clone())).collect());
            }
        };
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

    /// How many times this data directory has been opened, this time included.
    pub fn boots(&self) -> Result<u64, Error> {
        let Inner::Rocks(r) = &self.inner else {
            return Ok(1);
        };
        let db = &r.db;
        let cf = cf(db, CF_COUNTERS)?;
        let v = db.get_cf(cf, b"boots").map_err(|e| Error::Store(format!("reading boots: {e}")))?;
        Ok(v.as_deref().and_then(decode_u64).unwrap_or(0))
    }
}

fn cf<'a>(db: &'a DB, name: &str) -> Result<&'a rocksdb::ColumnFamily, Error> {
    db.cf_handle(name).ok_or_else(|| Error::Store(format!("column family {name} missing")))
}

/// Waits for a receiver from [`Store::submit`].
pub async fn wait_durable(rx: oneshot::Receiver<Result<(), Error>>) -> Result<(), Error> {
    match rx.await {
        Ok(result) => result,
        Err(_) => Err(Error::Store("the store writer stopped".into())),
    }
}

fn bump_boots(db: &DB) -> Result<(), Error> {
    let cf = cf(db, CF_COUNTERS)?;
    let old = db.get_cf(cf, b"boots").map_err(|e| Error::Store(format!("reading boots: {e}")))?;
    let boots = old.as_deref().and_then(decode_u64).unwrap_or(0) + 1;
    let mut wo = WriteOptions::default();
    wo.set_sync(true);
    let mut batch = WriteBatch::default();
    batch.put_cf(cf, b"boots", boots.to_be_bytes());
    db.write_opt(batch, &wo).map_err(|e| Error::Store(format!("writing boots: {e}")))
}

fn decode_u64(v: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(v.try_into().ok()?))
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
    use super::*;

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
