//! The lease service: the five calls the lease API makes (acquire, renew,
//! release, status, watch), answered by one of two authorities — the
//! embedded one (RocksDB, this gateway alone) or the shared one in etcd
//! (cluster mode). The API and the proxy hold a [`Leases`] and never know
//! which one they run on; both install fences into the same
//! [`FenceTable`], whose one admission decision the proxy acts on.

use std::sync::Arc;
use std::time::Duration;

use crate::authority::{AcquireRequest, Authority, GrantView, ReleaseRequest, RenewRequest, RenewView, StatusView};
use crate::cluster::Cluster;
use crate::error::Error;
use crate::fence::FenceTable;

/// The authority a gateway runs on.
#[derive(Debug, Clone)]
pub enum Leases {
    /// Single-node mode: grants in memory, fences fsynced in RocksDB.
    Embedded(Arc<Authority>),
    /// Cluster mode: grants and fences in etcd, shared with other gateways.
    Cluster(Arc<Cluster>),
}

impl Leases {
    /// The fence table this authority installs fences into.
    pub fn fences(&self) -> &Arc<FenceTable> {
        match self {
            Leases::Embedded(a) => a.fences(),
            Leases::Cluster(c) => c.fences(),
        }
    }

    /// Acquires a key, waiting up to `wait_ms` in FIFO order.
    pub async fn acquire(&self, req: AcquireRequest) -> Result<GrantView, Error> {
        match self {
            Leases::Embedded(a) => a.acquire(req).await,
            Leases::Cluster(c) => c.acquire(req).await,
        }
    }

    /// Extends a live lease.
    pub async fn renew(&self, req: RenewRequest) -> Result<RenewView, Error> {
        match self {
            Leases::Embedded(a) => a.renew(req),
            Leases::Cluster(c) => c.renew(req).await,
        }
    }

    /// Ends a grant at its holder's request.
    pub async fn release(&self, req: ReleaseRequest) -> Result<(), Error> {
        match self {
            Leases::Embedded(a) => a.release(req),
            Leases::Cluster(c) => c.release(req).await,
        }
    }

    /// The key's fence and current holder.
    pub async fn status(&self, key: &str) -> Result<StatusView, Error> {
        match self {
            Leases::Embedded(a) => a.status(key),
            Leases::Cluster(c) => c.status(key).await,
        }
    }

    /// Long-polls until the holder's token differs from `after`.
    pub async fn watch(&self, key: &str, after: u64, timeout: Duration) -> Result<StatusView, Error> {
        match self {
            Leases::Embedded(a) => a.watch(key, after, timeout).await,
            Leases::Cluster(c) => c.watch(key, after, timeout).await,
        }
    }

    /// The current holder's label (empty when none), for audit lines.
    pub fn holder_of(&self, key: &str) -> String {
        match self {
            Leases::Embedded(a) => a.status(key).ok().and_then(|s| s.holder).unwrap_or_default(),
            Leases::Cluster(c) => c.holder_of(key),
        }
    }
}
