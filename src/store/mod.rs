//! The durable store: RocksDB with three column families, and the one
//! group-commit writer through which every fsynced write goes.
//!
//! - `fences`   key → highest token granted or accepted (u64, big-endian).
//!   The fences together are the token counter: tokens are one sequence
//!   for every key, and a start continues it above the highest fence here
//!   (every issued token was fsynced as its key's fence before anyone saw
//!   it), so a token is never reused, for its key or another.
//! - `grants`   key → the key's last grant, live or released (see
//!   [`encode_grant`]). A release overwrites the record with a released
//!   one of the same length instead of deleting it, so that RocksDB
//!   updates it in place in the memtable; compactions drop released
//!   records.
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

use crate::fence::Key;

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
    Fence { key: Key, token: u64 },
    /// Record `key`'s live grant.
    Grant { key: Key, record: GrantRecord },
    /// Forget `key`'s grant (released or expired). `ended` is the grant
    /// that ends: the released record written in its place has its length.
    DropGrant { key: Key, ended: GrantRecord },
    /// Set `key`'s fence with what is known of it: the highest
    /// `X-Fencing-Sequence` admitted under it, and whether an external
    /// authority set it (one value: a later plain fence write of the key
    /// starts a new sequence and is the embedded authority's).
    FenceWith { key: Key, record: FenceRecord },
}

/// One stored fence: the token and, if a sequenced write was forwarded
/// under it, the highest sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FenceRecord {
    pub token: u64,
    pub sequence: Option<u64>,
    /// Set by an external authority's token (no grant of this gateway's
    /// stands behind it: embedded routes never admit it).
    pub external: bool,
}

impl FenceRecord {
    /// A plain embedded fence.
    pub fn embedded(token: u64) -> FenceRecord {
        FenceRecord { token, sequence: None, external: false }
    }

    /// The `fences` value: the token (8 bytes, big-endian), then the
    /// sequence (8 more) if any, then one byte 1 if external.
    #[cfg_attr(not(feature = "rocksdb"), allow(dead_code))]
    fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.token.to_be_bytes());
        if let Some(seq) = self.sequence {
            out.extend_from_slice(&seq.to_be_bytes());
        }
        if self.external {
            out.push(1);
        }
    }
}

/// Bytes the store holds in memory, by kind ([`Store::memory_usage`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreMemory {
    /// Memtables of every column family (RocksDB's `size-all-mem-tables`).
    pub memtables: u64,
    /// Block caches in use.
    pub block_cache: u64,
    /// Index and filter blocks of open tables, outside the cache.
    pub table_readers: u64,
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
    fences: std::collections::BTreeMap<String, FenceRecord>,
    grants: std::collections::BTreeMap<String, GrantRecord>,
    /// Tests of what may be seen before an fsync: acknowledgements are
    /// held back while set (see [`Store::hold_acks`]).
    hold: bool,
    held: Vec<oneshot::Sender<Result<(), Error>>>,
}

impl MemoryStore {
    fn apply(&mut self, ops: Vec<Op>) {
        for op in ops {
            match op {
                Op::Fence { key, token } => {
                    self.fences.insert(key.to_string(), FenceRecord::embedded(token));
                }
                Op::FenceWith { key, record } => {
                    self.fences.insert(key.to_string(), record);
                }
                Op::Grant { key, record } => {
                    self.grants.insert(key.to_string(), record);
                }
                Op::DropGrant { key, .. } => {
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
    /// Bytes a second RocksDB's flushes and compactions may write (0: no
    /// bound; `[store] background_write_bytes_per_sec`).
    pub background_write_bytes_per_sec: u64,
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
                    if m.hold {
                        m.held.push(done);
                    } else {
                        let _ = done.send(Ok(()));
                    }
                }
            }
        }
        rx
    }

    /// Memory store only (tests): from now on, hold every acknowledgement
    /// back, as a slow fsync would, until [`Store::release_acks`].
    pub fn hold_acks(&self) {
        if let Inner::Memory(m) = &self.inner {
            if let Ok(mut m) = m.lock() {
                m.hold = true;
            }
        }
    }

    /// Memory store only (tests): answers every held acknowledgement with
    /// success (`Ok`) or the given failure, and stops holding.
    pub fn release_acks(&self, outcome: Result<(), Error>) {
        if let Inner::Memory(m) = &self.inner {
            if let Ok(mut m) = m.lock() {
                m.hold = false;
                for done in m.held.drain(..) {
                    let _ = done.send(outcome.clone());
                }
            }
        }
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
    pub fn for_each_fence(&self, mut f: impl FnMut(&str, FenceRecord)) -> Result<(), Error> {
        match &self.inner {
            #[cfg(feature = "rocksdb")]
            Inner::Rocks(r) => r.for_each_fence(&mut f),
            Inner::Memory(m) => {
                let m = m.lock().map_err(|_| Error::Store("memory store poisoned".into()))?;
                m.fences.iter().for_each(|(k, r)| f(k, *r));
                Ok(())
            }
        }
    }

    /// What the store holds in memory (RocksDB's memtables and caches;
    /// zero for the memory store, which is for tests).
    pub fn memory_usage(&self) -> StoreMemory {
        match &self.inner {
            #[cfg(feature = "rocksdb")]
            Inner::Rocks(r) => r.memory(),
            Inner::Memory(_) => StoreMemory::default(),
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

    /// Every live grant (released ones are skipped).
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

/// A `fences` value (see [`FenceRecord::encode`]).
#[cfg_attr(not(feature = "rocksdb"), allow(dead_code))]
fn decode_fence(v: &[u8]) -> Option<FenceRecord> {
    let (body, external) = match v.len() {
        9 | 17 if v[v.len() - 1] == 1 => (&v[..v.len() - 1], true),
        8 | 16 => (v, false),
        _ => return None,
    };
    let token = decode_u64(&body[..8])?;
    let sequence = if body.len() == 16 { Some(decode_u64(&body[8..])?) } else { None };
    Some(FenceRecord { token, sequence, external })
}

/// First byte of a `grants` value: the grant is live.
const GRANT_LIVE: u8 = 1;
/// First byte of a `grants` value: the grant was released or expired.
#[cfg_attr(not(feature = "rocksdb"), allow(dead_code))]
const GRANT_RELEASED: u8 = 0;
/// State byte, token, TTL, the lease id's length.
const GRANT_HEAD: usize = 1 + 8 + 8 + 2;

/// Appends the `grants` value of `record` to `out`: a state byte
/// ([`GRANT_LIVE`] or [`GRANT_RELEASED`]), the token and the TTL in
/// milliseconds (u64 big-endian), the lease id's length (u16 big-endian)
/// and bytes, then the holder's bytes. A grant and its released record
/// have the same length, and so do consecutive grants of one holder: the
/// memtable overwrites them in place instead of growing by an entry per
/// write.
#[cfg_attr(not(feature = "rocksdb"), allow(dead_code))]
fn encode_grant(record: &GrantRecord, live: bool, out: &mut Vec<u8>) -> Result<(), Error> {
    let lease_len = u16::try_from(record.lease_id.len()).map_err(|_| {
        Error::Store(format!("a lease id of {} bytes does not fit a grant record", record.lease_id.len()))
    })?;
    out.reserve(GRANT_HEAD + record.lease_id.len() + record.holder.len());
    out.push(if live { GRANT_LIVE } else { GRANT_RELEASED });
    out.extend_from_slice(&record.token.to_be_bytes());
    out.extend_from_slice(&record.ttl_ms.to_be_bytes());
    out.extend_from_slice(&lease_len.to_be_bytes());
    out.extend_from_slice(record.lease_id.as_bytes());
    out.extend_from_slice(record.holder.as_bytes());
    Ok(())
}

/// Reads a `grants` value: `Some` for a live grant, `None` for a released
/// one. Values written before [`encode_grant`] existed are JSON objects
/// of live grants.
#[cfg_attr(not(feature = "rocksdb"), allow(dead_code))]
fn decode_grant(v: &[u8]) -> Result<Option<GrantRecord>, String> {
    let u64_at = |at: usize| v.get(at..at + 8).and_then(decode_u64);
    match v.first() {
        Some(b'{') => serde_json::from_slice(v).map(Some).map_err(|e| e.to_string()),
        Some(&state @ (GRANT_LIVE | GRANT_RELEASED)) => {
            let (Some(token), Some(ttl_ms), Some(len)) = (u64_at(1), u64_at(9), v.get(17..GRANT_HEAD)) else {
                return Err(format!("a grant record of {} bytes is too short", v.len()));
            };
            let lease_end = GRANT_HEAD + usize::from(u16::from_be_bytes([len[0], len[1]]));
            let (Some(lease_id), Some(holder)) = (v.get(GRANT_HEAD..lease_end), v.get(lease_end..)) else {
                return Err("a grant record's lease id runs past its end".into());
            };
            if state == GRANT_RELEASED {
                return Ok(None);
            }
            let text = |b: &[u8], what: &str| String::from_utf8(b.to_vec()).map_err(|_| format!("{what} is not UTF-8"));
            Ok(Some(GrantRecord {
                token,
                lease_id: text(lease_id, "a lease id")?,
                holder: text(holder, "a holder")?,
                ttl_ms,
            }))
        }
        Some(other) => Err(format!("unknown grant record format {other:#04x}")),
        None => Err("an empty grant record".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::{decode_grant, encode_grant, GrantRecord, GRANT_HEAD};

    fn record(holder: &str) -> GrantRecord {
        GrantRecord {
            token: 42,
            lease_id: "0123456789abcdef0123456789abcdef".into(),
            holder: holder.into(),
            ttl_ms: 30_000,
        }
    }

    #[test]
    fn a_grant_record_round_trips_and_its_release_has_its_length() {
        let live = record("worker-7");
        let (mut a, mut b) = (Vec::new(), Vec::new());
        encode_grant(&live, true, &mut a).unwrap();
        encode_grant(&live, false, &mut b).unwrap();
        assert_eq!(decode_grant(&a), Ok(Some(live.clone())));
        assert_eq!(decode_grant(&b), Ok(None));
        assert_eq!(a.len(), b.len(), "the released record overwrites the live one in place");
        let mut next = Vec::new();
        encode_grant(&GrantRecord { token: 43, lease_id: "f".repeat(32), ..live }, true, &mut next).unwrap();
        assert_eq!(next.len(), a.len(), "the same holder's next grant fits the same slot");
    }

    #[test]
    fn grant_records_written_as_json_still_read() {
        let live = record("");
        let json = serde_json::to_vec(&live).unwrap();
        assert_eq!(decode_grant(&json), Ok(Some(live)));
    }

    #[test]
    fn damaged_grant_records_are_errors_not_panics() {
        let mut good = Vec::new();
        encode_grant(&record("h"), true, &mut good).unwrap();
        // Cut anywhere before the holder: an error (a cut holder is just shorter).
        for cut in 0..GRANT_HEAD + 32 {
            assert!(decode_grant(&good[..cut]).is_err(), "cut at {cut}");
        }
        assert!(decode_grant(&[7, 0, 0]).is_err());
        let mut bad = good.clone();
        let last = bad.len() - 1;
        bad[last] = 0xff;
        assert!(decode_grant(&bad).is_err(), "a holder that is not UTF-8");
        assert!(decode_grant(b"{not json").is_err());
        let long = GrantRecord { lease_id: "x".repeat(70_000), ..record("h") };
        assert!(encode_grant(&long, true, &mut Vec::new()).is_err());
    }
}
