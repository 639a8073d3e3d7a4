//! The durable token floor. Tokens are etcd revisions (plus an offset); an
//! etcd restored from a snapshot, or a new etcd cluster, numbers revisions
//! from lower again, and would issue tokens a second time. Each gateway
//! keeps the highest token it has seen in `<data_dir>/cluster-floor.json`
//! (fsynced, coalesced), with the etcd cluster id it came from. A grant is
//! refused while `offset + etcd's revision` is below the floor; the
//! operator raises the offset with `fencegate cluster raise-floor --to N`.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use etcd_client::{Compare, CompareOp, GetOptions, Txn, TxnOp};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::config::ClusterConfig;
use crate::error::Error;
use crate::shutdown::Shutdown;

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
struct Record {
    floor: u64,
    cluster_id: u64,
}

/// The floor of one gateway.
#[derive(Debug)]
pub(super) struct Floor {
    path: PathBuf,
    highest: watch::Sender<u64>,
    persisted: watch::Sender<u64>,
    cluster_id: Mutex<u64>,
}

impl Floor {
    /// Reads the floor kept in `dir` (0 when there is none yet).
    pub(super) fn open(dir: &Path) -> Result<Floor, Error> {
        std::fs::create_dir_all(dir).map_err(|e| Error::Store(format!("creating {}: {e}", dir.display())))?;
        let path = dir.join("cluster-floor.json");
        let record = match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice::<Record>(&bytes)
                .map_err(|e| Error::Store(format!("{} does not parse: {e}", path.display())))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Record::default(),
            Err(e) => return Err(Error::Store(format!("reading {}: {e}", path.display()))),
        };
        Ok(Floor {
            path,
            highest: watch::channel(record.floor).0,
            persisted: watch::channel(record.floor).0,
            cluster_id: Mutex::new(record.cluster_id),
        })
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
    pub(super) async fn run(self: std::sync::Arc<Self>, stop: Shutdown) {
        let mut rx = self.highest.subscribe();
        loop {
            let floor = *rx.borrow_and_update();
            let cluster_id = *self.cluster_id.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let path = self.path.clone();
            let record = Record { floor, cluster_id };
            let written = tokio::task::spawn_blocking(move || write_atomically(&path, &record)).await;
            match written {
                Ok(Ok(())) => {
                    self.persisted.send_if_modified(|p| {
                        let up = floor > *p;
                        *p = (*p).max(floor);
                        up
                    });
                }
                Ok(Err(e)) => tracing::error!(error = %e, "writing the token floor failed; grants wait"),
                Err(e) => tracing::error!(error = %e, "the token floor writer panicked"),
            }
            tokio::select! {
                changed = rx.changed() => if changed.is_err() { return },
                () = stop.wait() => return,
            }
        }
    }
}

fn write_atomically(path: &Path, record: &Record) -> Result<(), String> {
    use std::io::Write;
    let tmp = path.with_extension("json.tmp");
    let bytes = serde_json::to_vec(record).map_err(|e| e.to_string())?;
    let mut f = std::fs::File::create(&tmp).map_err(|e| format!("creating {}: {e}", tmp.display()))?;
    f.write_all(&bytes).map_err(|e| e.to_string())?;
    f.sync_all().map_err(|e| e.to_string())?;
    std::fs::rename(&tmp, path).map_err(|e| e.to_string())?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// The operator's command after an etcd restore: raises the token offset
/// so that every token issued from now on is above `to`. Returns the new
/// offset. Never lowers it.
pub async fn raise_floor(cfg: &ClusterConfig, to: u64) -> Result<u64, Error> {
    let client = super::connect(cfg).await?;
    let keys = super::Keys::new(&cfg.prefix);
    let mut kv = client.kv_client();
    for _ in 0..16 {
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
        let needed = to.saturating_sub(super::rev_u64(revision).saturating_mul(super::TOKEN_SLOTS));
        if needed <= old {
            return Ok(old);
        }
        let txn = Txn::new()
            .when([Compare::mod_revision(keys.offset(), CompareOp::Equal, old_rev)])
            .and_then([TxnOp::put(keys.offset(), needed.to_string(), None)]);
        let done = kv.txn(txn).await.map_err(|e| super::unavailable("raising the offset", e))?;
        if done.succeeded() {
            return Ok(needed);
        }
    }
    Err(Error::Unavailable("the token offset kept changing; try again".into()))
}
