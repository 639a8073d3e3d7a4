//! What the authority, its fence table and its store hold in memory per
//! held lease, by part: an account from the sizes of the types and the
//! maps' capacities (allocator rounding aside), plus RocksDB's own figures.
//! For diagnostics and the benchmarks (issue 18); walks every key.

use std::mem::size_of;

use super::{Authority, KeyState, Queue};
use crate::fence::Key;
use crate::fence::TableFootprint;
use crate::store::StoreMemory;

/// Bytes by part. `keys` is the number of keys with a lease state (they
/// live in the fence table's slots: the map's buckets are counted there).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Footprint {
    pub keys: usize,
    /// The boxed per-key states (the grant inside).
    pub authority_states: usize,
    /// Waiter queues and watch channels (only keys that have them).
    pub queues: usize,
    /// The expiry heap's vector, full or not.
    pub expiry: usize,
    /// Interned holder names.
    pub holders: usize,
    pub fences: TableFootprint,
    pub store: StoreMemory,
}

impl Footprint {
    /// Everything, in bytes.
    pub fn total(&self) -> usize {
        let store = self.store.memtables + self.store.block_cache + self.store.table_readers;
        self.authority_states
            + self.queues
            + self.expiry
            + self.holders
            + self.fences.map
            + self.fences.slots
            + self.fences.key_bytes
            + self.fences.inflight
            + usize::try_from(store).unwrap_or(usize::MAX)
    }

    /// One line per part, in bytes per key with a lease state.
    pub fn report(&self) -> String {
        let n = self.keys.max(1) as f64;
        let per = |b: usize| b as f64 / n;
        let store = |b: u64| b as f64 / n;
        format!(
            "keys {}: states {:.1} B, queues {:.1} B, expiry heap {:.1} B, holders {:.1} B, \
             fence map {:.1} B, fence slots {:.1} B, keys {:.1} B, in flight {:.1} B, \
             memtables {:.1} B, block cache {:.1} B, table readers {:.1} B; total {:.1} B per key",
            self.keys,
            per(self.authority_states),
            per(self.queues),
            per(self.expiry),
            per(self.holders),
            per(self.fences.map),
            per(self.fences.slots),
            per(self.fences.key_bytes),
            per(self.fences.inflight),
            store(self.store.memtables),
            store(self.store.block_cache),
            store(self.store.table_readers),
            per(self.total()),
        )
    }
}

impl Authority {
    /// What this authority, its fence table and its store hold, by part.
    pub fn footprint(&self) -> Footprint {
        let mut queues = 0;
        let mut keys = 0;
        self.fences.for_each_lease(|_, st| {
            keys += 1;
            if let Some(q) = &st.queue {
                queues += size_of::<Queue>() + q.waiters.capacity() * size_of::<super::Waiter>();
            }
        });
        let expiry = self.expiry.lock().map_or(0, |s| s.capacity() * size_of::<(u64, Key)>());
        Footprint {
            keys,
            authority_states: keys * size_of::<KeyState>(),
            queues,
            expiry,
            holders: self.holders.bytes(),
            fences: self.fences.footprint(),
            store: self.store.memory_usage(),
        }
    }
}
