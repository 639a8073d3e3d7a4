//! Many leases renewed together: a [`LeaseGroup`] holds any number of
//! leases of one TTL and renews all of them with `POST /v1/locks/batch`,
//! one request per [`BATCH_LIMIT`] leases every third of the TTL, instead
//! of one renewal per lease (a worker pool holding 10,000 locks of 30 s
//! sends 10 requests every 10 s, not 1,000 a second).
//!
//! Each [`GroupLease`] keeps the guarantee of a [`super::Lease`]: `lost()`
//! resolves as soon as a renewal of it is refused **or** its local
//! monotonic deadline passes without a successful renewal, the deadline
//! being counted from the moment before the request that granted or last
//! renewed it was sent.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use http::{HeaderValue, Method};
use serde_json::{json, Value};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::views::{GrantView, RenewView};
use crate::{millis, refusal, token_header, Client, ClientError};

/// Most operations the gateway takes in one batch.
pub const BATCH_LIMIT: usize = 1_000;

impl Client {
    /// One `POST /v1/locks/batch` of at most [`BATCH_LIMIT`] operations
    /// (`{"op": "renew", "key", "lease_id"}` and the like): each operation's
    /// answer (the body on success, the error it stands for otherwise), in
    /// order. `Err` when the batch as a whole was refused or unanswered.
    pub async fn batch(&self, operations: Vec<Value>) -> Result<Vec<Result<Value, ClientError>>, ClientError> {
        let n = operations.len();
        let answer: Value =
            self.call(Method::POST, "/v1/locks/batch", Some(json!({ "operations": operations })), self.timeout).await?;
        let Some(results) = answer["results"].as_array().filter(|r| r.len() == n) else {
            return Err(ClientError::Unreachable(format!("bad answer: not {n} results")));
        };
        Ok(results
            .iter()
            .map(|r| match r["status"].as_u64() {
                Some(200) => Ok(r.clone()),
                status => Err(refusal(status.and_then(|s| u16::try_from(s).ok()).unwrap_or(0), r)),
            })
            .collect())
    }

    /// Renews many leases (`(key, lease_id)`) in batches of
    /// [`BATCH_LIMIT`]: each lease's answer, in order.
    pub async fn renew_many(
        &self,
        leases: &[(&str, &str)],
    ) -> Result<Vec<Result<RenewView, ClientError>>, ClientError> {
        let mut out = Vec::with_capacity(leases.len());
        for chunk in leases.chunks(BATCH_LIMIT) {
            let ops = chunk.iter().map(|(key, id)| json!({"op": "renew", "key": key, "lease_id": id})).collect();
            for r in self.batch(ops).await? {
                out.push(r.and_then(|v| {
                    serde_json::from_value(v).map_err(|e| ClientError::Unreachable(format!("bad answer: {e}")))
                }));
            }
        }
        Ok(out)
    }

    /// A group of leases of `ttl`, renewed together (see [`LeaseGroup`]).
    /// Call inside a tokio runtime.
    pub fn lease_group(&self, ttl: Duration) -> LeaseGroup {
        let inner = Arc::new(Inner {
            client: self.clone(),
            ttl,
            leases: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            renewals: AtomicU64::new(0),
        });
        tokio::spawn(renew_loop(Arc::downgrade(&inner)));
        LeaseGroup { inner }
    }
}

/// Leases of one TTL, renewed together by one background task, which runs
/// while the group or any of its leases is alive.
#[derive(Clone)]
pub struct LeaseGroup {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for LeaseGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseGroup").field("ttl", &self.inner.ttl).field("held", &self.len()).finish()
    }
}

struct Inner {
    client: Client,
    ttl: Duration,
    leases: Mutex<HashMap<u64, Entry>>,
    next_id: AtomicU64,
    /// Batch requests sent by the renewer.
    renewals: AtomicU64,
}

struct Entry {
    key: String,
    lease_id: String,
    /// Local deadline: before it, the gateway still holds the lease.
    deadline: Instant,
    lost: watch::Sender<bool>,
}

impl Inner {
    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Entry>> {
        self.leases.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn add(self: &Arc<Self>, grant: GrantView, sent: Instant) -> GroupLease {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = watch::channel(false);
        let entry =
            Entry { key: grant.key.clone(), lease_id: grant.lease_id.clone(), deadline: sent + self.ttl, lost: tx };
        self.entries().insert(id, entry);
        GroupLease {
            group: Arc::clone(self),
            id,
            key: grant.key,
            token: grant.fencing_token,
            lease_id: grant.lease_id,
            lost: rx,
            released: false,
        }
    }
}

impl LeaseGroup {
    /// Acquires `key` without waiting and adds it to the group.
    pub async fn acquire(&self, key: &str, holder: &str) -> Result<GroupLease, ClientError> {
        let sent = Instant::now();
        let grant = self.inner.client.acquire_once(key, self.inner.ttl, Duration::ZERO, holder).await?;
        Ok(self.inner.add(grant, sent))
    }

    /// Acquires many keys in batches (no waiting): each key's lease or
    /// why it was not granted, in order.
    pub async fn acquire_many(
        &self,
        keys: &[&str],
        holder: &str,
    ) -> Result<Vec<Result<GroupLease, ClientError>>, ClientError> {
        let mut out = Vec::with_capacity(keys.len());
        let ttl_ms = millis(self.inner.ttl);
        for chunk in keys.chunks(BATCH_LIMIT) {
            let ops = chunk
                .iter()
                .map(|key| json!({"op": "acquire", "key": key, "ttl_ms": ttl_ms, "holder": holder}))
                .collect();
            let sent = Instant::now();
            for r in self.inner.client.batch(ops).await? {
                out.push(r.and_then(|v| {
                    let grant: GrantView =
                        serde_json::from_value(v).map_err(|e| ClientError::Unreachable(format!("bad answer: {e}")))?;
                    Ok(self.inner.add(grant, sent))
                }));
            }
        }
        Ok(out)
    }

    /// Leases held (not yet released, dropped or lost).
    pub fn len(&self) -> usize {
        self.inner.entries().len()
    }

    /// True when the group holds no lease.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Batch requests the group has sent to renew its leases so far.
    pub fn renewal_requests(&self) -> u64 {
        self.inner.renewals.load(Ordering::Relaxed)
    }
}

/// One lease of a [`LeaseGroup`]. Its `Debug` never shows the lease id.
pub struct GroupLease {
    group: Arc<Inner>,
    id: u64,
    key: String,
    token: u64,
    lease_id: String,
    lost: watch::Receiver<bool>,
    released: bool,
}

impl std::fmt::Debug for GroupLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupLease")
            .field("key", &self.key)
            .field("token", &self.token)
            .field("lease_id", &"<redacted>")
            .field("lost", &self.is_lost())
            .finish_non_exhaustive()
    }
}

impl GroupLease {
    /// The fencing token: put it on every write (`X-Fencing-Token`).
    pub fn token(&self) -> u64 {
        self.token
    }

    /// The `X-Fencing-Token` header carrying this lease's token.
    pub fn header(&self) -> (http::HeaderName, HeaderValue) {
        token_header(self.token)
    }

    /// The key held.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The lease id: the bearer secret of renew and release.
    pub fn lease_id(&self) -> &str {
        &self.lease_id
    }

    /// True once the lease is known lost.
    pub fn is_lost(&self) -> bool {
        *self.lost.borrow() || self.lost.has_changed().is_err()
    }

    /// Resolves when the lease is lost: a renewal was refused, or the local
    /// deadline passed without a successful renewal.
    pub async fn lost(&self) {
        let mut rx = self.lost.clone();
        let _ = rx.wait_for(|lost| *lost).await;
    }

    /// Stops renewing this lease and releases the key.
    pub async fn release(mut self) -> Result<(), ClientError> {
        self.released = true;
        self.group.entries().remove(&self.id);
        self.group.client.release(&self.key, &self.lease_id).await
    }

    /// Stops renewing without releasing: the lease runs out at its TTL.
    pub fn abandon(mut self) {
        self.released = true;
        self.group.entries().remove(&self.id);
    }
}

impl Drop for GroupLease {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        self.group.entries().remove(&self.id);
        // Best effort: release in the background if a runtime is there.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let (client, key, id) = (self.group.client.clone(), self.key.clone(), self.lease_id.clone());
            rt.spawn(async move {
                let _ = client.release(&key, &id).await;
            });
        }
    }
}

/// Every third of the TTL, renews every lease of the group in batches;
/// signals a lease lost when its renewal is refused or its deadline passes.
/// Ends when the group and all its leases are gone.
async fn renew_loop(group: Weak<Inner>) {
    let Some(ttl) = group.upgrade().map(|g| g.ttl) else {
        return;
    };
    let period = ttl / 3;
    let mut next = Instant::now() + period;
    loop {
        // Wake for the next round, or for the earliest deadline if one
        // comes first (renewals are failing): it is then signalled lost.
        let wake = {
            let Some(g) = group.upgrade() else {
                return;
            };
            let earliest = g.entries().values().map(|e| e.deadline).min();
            earliest.map_or(next, |d| d.min(next))
        };
        tokio::time::sleep_until(wake).await;
        let Some(g) = group.upgrade() else {
            return;
        };
        let now = Instant::now();
        g.entries().retain(|_, e| {
            let live = e.deadline > now;
            if !live {
                let _ = e.lost.send(true);
            }
            live
        });
        if now < next {
            continue;
        }
        let batch: Vec<(u64, String, String)> =
            g.entries().iter().map(|(id, e)| (*id, e.key.clone(), e.lease_id.clone())).collect();
        let mut failed = false;
        for chunk in batch.chunks(BATCH_LIMIT) {
            let sent = Instant::now();
            let pairs: Vec<(&str, &str)> = chunk.iter().map(|(_, k, l)| (k.as_str(), l.as_str())).collect();
            g.renewals.fetch_add(1, Ordering::Relaxed);
            match tokio::time::timeout(period, g.client.renew_many(&pairs)).await {
                Ok(Ok(results)) => {
                    let mut entries = g.entries();
                    for ((id, _, _), r) in chunk.iter().zip(results) {
                        match r {
                            Ok(_) => {
                                if let Some(e) = entries.get_mut(id) {
                                    e.deadline = sent + ttl;
                                }
                            }
                            Err(ClientError::LeaseLost) => {
                                if let Some(e) = entries.remove(id) {
                                    let _ = e.lost.send(true);
                                }
                            }
                            Err(_) => failed = true,
                        }
                    }
                }
                // Unreachable, slow or refused as a whole: try again soon.
                Ok(Err(_)) | Err(_) => failed = true,
            }
        }
        next = Instant::now() + if failed { (period / 4).max(Duration::from_millis(20)) } else { period };
    }
}
