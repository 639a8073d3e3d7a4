//! The gateway's connection to etcd: one member at a time (the *pinned*
//! member), left for the next one in the configured list as soon as it
//! refuses a connection, answers that it has no leader, or does not answer
//! within a request's deadline.
//!
//! Why not the etcd client's own balancer over every endpoint: it picks a
//! member at random for each request and counts every connection as equally
//! loaded, so a member that hangs with its connection open (a paused
//! process, a disk stall, a paused VM) keeps getting its share of the
//! requests, each given up only at its deadline. Keepalives, lease grants
//! and watch starts landing there made every gateway of a cluster lapse
//! while the rest of the quorum answered (review finding F2: all grants
//! stopped for a 20 s follower stall and 24–30 s after it).
//!
//! Each gateway starts on a member chosen by its id, so that several
//! gateways spread their requests over the members.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, KvClient, LeaseClient, Txn, TxnResponse, WatchClient};

use super::{never_applied, unavailable};
use crate::config::ClusterConfig;
use crate::error::Error;
use crate::metrics::Metrics;

/// The member requests go to now.
#[derive(Clone)]
struct Pinned {
    /// Index into the configured endpoints.
    member: usize,
    /// Counts moves; a failure reported for an older turn moves nothing.
    turn: u64,
    client: Client,
}

/// A connection to one etcd member at a time (module doc).
pub(crate) struct Etcd {
    cfg: ClusterConfig,
    metrics: Arc<Metrics>,
    pinned: std::sync::Mutex<Pinned>,
    /// The current turn, for streams open on a member (a watch, the
    /// keepalive) to follow a move made by another request.
    moved: tokio::sync::watch::Sender<u64>,
    /// A client of each endpoint for [`Etcd::prefer_leader`]'s status
    /// requests (made on first use).
    probes: tokio::sync::Mutex<Vec<Option<Client>>>,
}

impl std::fmt::Debug for Etcd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = self.lock();
        f.debug_struct("Etcd").field("member", &p.member).field("turn", &p.turn).finish_non_exhaustive()
    }
}

/// `fencegate_cluster_etcd_member`: 1 for endpoint number `member`, 0 for
/// the others.
fn show_member(metrics: &Metrics, cfg: &ClusterConfig, member: usize) {
    for (i, e) in cfg.etcd_endpoints.iter().enumerate() {
        metrics.cluster_etcd_member.with_label_values(&[e.as_str()]).set(i64::from(i == member));
    }
}

/// Whether an answer to a request proves the member should be left.
fn leave_member(e: &etcd_client::Error) -> bool {
    never_applied(e) || e.to_string().contains("transport error")
}

impl Etcd {
    /// Connects to the member that `seed` (the gateway id) picks. The
    /// connection itself is made by the first request.
    pub(crate) async fn connect(cfg: &ClusterConfig, seed: &str, metrics: Arc<Metrics>) -> Result<Etcd, Error> {
        let n = cfg.etcd_endpoints.len().max(1);
        let first = usize::try_from(seed.bytes().fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b))))
            .unwrap_or(0)
            % n;
        let client = Self::connect_member(cfg, first).await?;
        show_member(&metrics, cfg, first);
        let pinned = std::sync::Mutex::new(Pinned { member: first, turn: 0, client });
        let probes = tokio::sync::Mutex::new(vec![None; n]);
        Ok(Etcd { cfg: cfg.clone(), metrics, pinned, moved: tokio::sync::watch::channel(0).0, probes })
    }

    /// A client of the configured endpoint number `member` only.
    pub(super) async fn connect_member(cfg: &ClusterConfig, member: usize) -> Result<Client, Error> {
        let one = ClusterConfig {
            etcd_endpoints: cfg.etcd_endpoints.get(member).cloned().into_iter().collect(),
            ..cfg.clone()
        };
        super::connect(&one).await
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pinned> {
        self.pinned.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The current turn (pass it to [`Etcd::move_on`] when a request made
    /// with this turn's client fails).
    pub(crate) fn turn(&self) -> u64 {
        self.lock().turn
    }

    /// Resolves once requests go to another member than in `turn`.
    pub(crate) async fn moved_from(&self, turn: u64) {
        let mut rx = self.moved.subscribe();
        // The sender lives as long as `self`: an error cannot happen here.
        let _ = rx.wait_for(|t| *t != turn).await;
    }

    pub(crate) fn kv_client(&self) -> KvClient {
        self.lock().client.kv_client()
    }

    pub(crate) fn lease_client(&self) -> LeaseClient {
        self.lock().client.lease_client()
    }

    pub(crate) fn watch_client(&self) -> WatchClient {
        self.lock().client.watch_client()
    }

    /// The member of `turn` failed: requests go to the next member from
    /// now on (no-op when another failure moved on already).
    pub(crate) async fn move_on(&self, turn: u64) {
        let n = self.cfg.etcd_endpoints.len();
        let next = {
            let p = self.lock();
            // With one endpoint there is nowhere to go: requests are asked
            // again on it, and a watch that broke is reloaded.
            if p.turn != turn || n < 2 {
                return;
            }
            (p.member + 1) % n
        };
        self.move_to(turn, next, "etcd: moving to the next member").await;
    }

    /// Sends the requests to endpoint `next` from now on, unless the
    /// member changed since `turn`.
    async fn move_to(&self, turn: u64, next: usize, why: &'static str) {
        // Connecting makes no request (the first request connects), so it
        // fails only on a configuration it already accepted at start.
        let client = match Self::connect_member(&self.cfg, next).await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "etcd: cannot prepare a client of another member");
                return;
            }
        };
        let mut p = self.lock();
        if p.turn == turn {
            tracing::info!(
                from = %self.cfg.etcd_endpoints.get(p.member).map_or("", String::as_str),
                to = %self.cfg.etcd_endpoints.get(next).map_or("", String::as_str),
                "{why}"
            );
            show_member(&self.metrics, &self.cfg, next);
            self.metrics.cluster_etcd_moves.inc();
            *p = Pinned { member: next, turn: turn + 1, client };
            drop(p);
            self.moved.send_replace(turn + 1);
        }
    }

    /// Asks every endpoint's status (each within `timeout`) and sends the
    /// requests to the leader from now on, if one answered that it leads
    /// and it is not the member in use: a follower forwards every write to
    /// the leader (and asks it for every linearizable read), which costs
    /// the members CPU and a round trip per request.
    pub(crate) async fn prefer_leader(&self, timeout: Duration) {
        let mut probes = self.probes.lock().await;
        let mut leader = None;
        for (i, slot) in probes.iter_mut().enumerate() {
            if slot.is_none() {
                *slot = Self::connect_member(&self.cfg, i).await.ok();
            }
            let Some(c) = slot.as_ref() else { continue };
            let mut m = c.maintenance_client();
            match tokio::time::timeout(timeout, m.status()).await {
                Ok(Ok(st)) => {
                    let me = st.header().map_or(0, |h| h.member_id());
                    if me != 0 && st.leader() == me {
                        leader = Some(i);
                    }
                }
                // A fresh connection next time (one given up may be stuck).
                Ok(Err(_)) | Err(_) => *slot = None,
            }
        }
        drop(probes);
        let Some(next) = leader else { return };
        let turn = {
            let p = self.lock();
            if p.member == next {
                return;
            }
            p.turn
        };
        self.move_to(turn, next, "etcd: moving to the leader").await;
    }

    /// One etcd request, within `timeout` in all: `attempt` makes it (with
    /// a client handle of its own, cheap to clone), and is called again,
    /// on the next member, while the answer proves that the request was
    /// never applied. Any other error, and the deadline, are answered as
    /// 503 (fail closed); a request unanswered moves to the next member
    /// for the requests after it (it may have been applied: not repeated).
    pub(crate) async fn call<T, Fut>(
        &self,
        timeout: Duration,
        what: &str,
        attempt: impl FnMut() -> Fut,
    ) -> Result<T, Error>
    where
        Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
    {
        self.call_on(timeout, what, None, attempt).await.map(|(r, _)| r)
    }

    /// Like [`Etcd::call`] for a request that changes nothing in etcd (a
    /// read, a watch start) or whose repetition is harmless (an
    /// acknowledgement, a revocation): each attempt has a share of the
    /// deadline, and one unanswered is asked again on the next member.
    pub(crate) async fn call_repeatable<T, Fut>(
        &self,
        timeout: Duration,
        what: &str,
        attempt: impl FnMut() -> Fut,
    ) -> Result<T, Error>
    where
        Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
    {
        self.call_repeatable_on(timeout, what, attempt).await.map(|(r, _)| r)
    }

    /// Deletes `key` ([`Etcd::call_repeatable`]: a delete asked again is
    /// harmless).
    pub(crate) async fn delete_repeatable(&self, timeout: Duration, what: &str, key: &str) -> Result<(), Error> {
        self.call_repeatable(timeout, what, || {
            let (mut kv, key) = (self.kv_client(), key.to_string());
            async move { kv.delete(key, None).await }
        })
        .await
        .map(|_| ())
    }

    /// [`Etcd::call_repeatable`], with the turn that answered.
    pub(crate) async fn call_repeatable_on<T, Fut>(
        &self,
        timeout: Duration,
        what: &str,
        attempt: impl FnMut() -> Fut,
    ) -> Result<(T, u64), Error>
    where
        Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
    {
        let share = (timeout / 4).max(Duration::from_millis(250)).min(timeout);
        self.call_on(timeout, what, Some(share), attempt).await
    }

    /// One transaction through [`Etcd::call`]: never sent again after an
    /// unanswered attempt (it may have been applied).
    pub(crate) async fn txn(&self, timeout: Duration, what: &str, txn: Txn) -> Result<TxnResponse, Error> {
        self.call(timeout, what, || {
            let (mut kv, txn) = (self.kv_client(), txn.clone());
            async move { kv.txn(txn).await }
        })
        .await
    }

    /// One transaction whose repetition is harmless (the same compares and
    /// writes applied twice leave what once does), through
    /// [`Etcd::call_repeatable`].
    pub(crate) async fn txn_repeatable(&self, timeout: Duration, what: &str, txn: Txn) -> Result<TxnResponse, Error> {
        self.call_repeatable(timeout, what, || {
            let (mut kv, txn) = (self.kv_client(), txn.clone());
            async move { kv.txn(txn).await }
        })
        .await
    }

    async fn call_on<T, Fut>(
        &self,
        timeout: Duration,
        what: &str,
        share: Option<Duration>,
        mut attempt: impl FnMut() -> Fut,
    ) -> Result<(T, u64), Error>
    where
        Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
    {
        let deadline = tokio::time::Instant::now() + timeout;
        let no_answer = || Error::Unavailable(format!("etcd: {what}: no answer within {} ms", timeout.as_millis()));
        let members = self.cfg.etcd_endpoints.len().max(1);
        let mut moves = 0;
        let mut pause = Duration::from_millis(10);
        loop {
            let turn = self.turn();
            let until = share.map_or(deadline, |s| (tokio::time::Instant::now() + s).min(deadline));
            match tokio::time::timeout_at(until, attempt()).await {
                Ok(Ok(r)) => return Ok((r, turn)),
                Ok(Err(e)) if never_applied(&e) => {
                    self.move_on(turn).await;
                    moves += 1;
                    // Every member tried: a pause before the next round.
                    if moves % members == 0 {
                        if tokio::time::Instant::now() + pause >= deadline {
                            return Err(unavailable(what, e));
                        }
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(Duration::from_millis(100));
                    }
                }
                Ok(Err(e)) => {
                    if leave_member(&e) {
                        self.move_on(turn).await;
                    }
                    return Err(unavailable(what, e));
                }
                Err(_) => {
                    self.move_on(turn).await;
                    if share.is_none() || tokio::time::Instant::now() >= deadline {
                        return Err(no_answer());
                    }
                    moves += 1;
                }
            }
        }
    }
}
