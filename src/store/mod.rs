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

#[cfg(feature = "rocksdb")]
mod rocks;

use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use crate::error::Error;
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

#[cfg_attr(not(feature = "rocksdb"), allow(dead_code))]
struct Commit {
    ops: Vec<Op>,
    done: Option<oneshot::Sender<Result<(), Error>>>,
}

/// What the writer reports of each fsync, for metrics.
pub type SyncObserver = Arc<dyn Fn(std::time::Duration, usize) + Send + Sync>;

/// Handle to the open store and its writer thread. Cheap to clone.
#[derive(Clone)]
pub struct Store {
    inner: Inner,
}

#[derive(Clone)]
enum Inner {
    #[cfg(feature = "rocksdb")]
    Rocks(Arc<rocks::Rocks>),
    /// Not durable: for tests of the state machine under paused time,
    /// where a real fsync would let the paused clock jump ahead.
    Memory(Arc<std::sync::Mutex<MemoryStore>>),
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
    /// Niceness the writer thread sets itself (0: left as started).
    pub nice: i32,
}

impl Store {
    /// Opens (or creates) the database under `dir` and starts the writer.
    /// Counts one more boot, durably, before returning.
    #[cfg(feature = "rocksdb")]
    pub fn open(dir: &Path, writer: WriterOptions, observe: SyncObserver) -> Result<Store, Error> {
        Ok(Store { inner: Inner::Rocks(Arc::new(rocks::Rocks::open(dir, writer, observe)?)) })
    }

    /// Built without RocksDB: there is no durable store.
    #[cfg(not(feature = "rocksdb"))]
    pub fn open(_dir: &Path, _writer: WriterOptions, _observe: SyncObserver) -> Result<Store, Error> {
        Err(Error::Store("this build has no RocksDB (feature `rocksdb` is off)".into()))
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
            #[cfg(feature = "rocksdb")]
            Inner::Rocks(r) => r.send(Commit { ops, done: Some(done) }),
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
            #[cfg(feature = "rocksdb")]
            Inner::Rocks(r) => r.send(Commit { ops, done: None }),
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
        match &self.inner {
            #[cfg(feature = "rocksdb")]
            Inner::Rocks(r) => r.for_each_fence(&mut f),
            Inner::Memory(m) => {
                let m = m.lock().map_err(|_| Error::Store("memory store poisoned".into()))?;
                m.fences.iter().for_each(|(k, t)| f(k, *t));
                Ok(())
            }
        }
    }

    /// An estimate of the number of fences (to size the table).
    pub fn estimated_fences(&self) -> usize {
        match &self.inner {
            #[cfg(feature = "rocksdb")]
            Inner::Rocks(r) => r.estimated_fences(),
            Inner::Memory(m) => m.lock().map_or(0, |m| m.fences.len()),
        }
    }

    /// Every stored grant.
    pub fn grants(&self) -> Result<Vec<(String, GrantRecord)>, Error> {
        match &self.inner {
            #[cfg(feature = "rocksdb")]
            Inner::Rocks(r) => r.grants(),
            Inner::Memory(m) => {
                let m = m.lock().map_err(|_| Error::Store("memory store poisoned".into()))?;
                Ok(m.grants.iter().map(|(k, g)| (k.clone(), g.clone())).collect())
            }
        }
    }

    /// True if the previous process on this data directory stopped
    /// cleanly (drained), or there was none.
    pub fn was_clean(&self) -> bool {
        match &self.inner {
            #[cfg(feature = "rocksdb")]
            Inner::Rocks(r) => r.was_clean(),
            Inner::Memory(_) => true,
        }
    }

    /// Records durably that this process drained and stops cleanly. Queued
    /// lazy writes (releases, expiries) are written first: an empty durable
    /// commit lands after everything queued before it.
    pub async fn mark_clean(&self) -> Result<(), Error> {
        self.commit(Vec::new()).await?;
        match &self.inner {
            #[cfg(feature = "rocksdb")]
            Inner::Rocks(r) => r.mark_clean(),
            Inner::Memory(_) => Ok(()),
        }
    }

    /// How many times this data directory has been opened, this time included.
    pub fn boots(&self) -> Result<u64, Error> {
        match &self.inner {
            #[cfg(feature = "rocksdb")]
            Inner::Rocks(r) => r.boots(),
            Inner::Memory(_) => Ok(1),
        }
    }
}

/// Waits for a receiver from [`Store::submit`].
pub async fn wait_durable(rx: oneshot::Receiver<Result<(), Error>>) -> Result<(), Error> {
    match rx.await {
        Ok(result) => result,
        Err(_) => Err(Error::Store("the store writer stopped".into())),
    }
}

#[cfg_attr(not(feature = "rocksdb"), allow(dead_code))]
fn decode_u64(v: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(v.try_into().ok()?))
}
