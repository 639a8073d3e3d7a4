//! Cluster mode (docs/cluster.md): several gateways share one authority
//! kept in a real etcd cluster, through fencegate's own transactions (not
//! etcd's lock service, whose 3.4 releases can grant on an expired lease).
//!
//! What lives in etcd, under the configured prefix `P`:
//!
//! | key | value | lease | meaning |
//! |---|---|---|---|
//! | `P g/KEY` | holder, ttl, hash of the lease id, offset, slot | none | the live grant of KEY |
//! | `P f/KEY` | `offset/slot` | none | KEY's fence: `offset + mod_revision · 64 + slot` |
//! | `P q/KEY \0 ID` | empty | the waiting gateway's membership | a waiter, ordered by create revision |
//! | `P m/GW` | `up` or `drained` | GW's membership | gateway GW is a live member |
//! | `P a/GW` | revision | GW's membership | GW installed every fence up to it and finished older in-flight mutations |
//! | `P r/GW` | where GW found it | none | GW found etcd restored: no grant anywhere until `raise-floor` deletes it |
//! | `P d/GW` | a lease id | none | GW's incarnation on that lease, whose member key went before GW could mark it `drained`, had nothing in flight |
//! | `P meta/offset` | u64 | none | added to revisions (raised by `fencegate cluster raise-floor`) |
//! | `P meta/floor` | u64 | none | the `--to` of the last `raise-floor` (a restore's hold ends only for a floor at least the gateway's own) |
//! | `P meta/raft` | `applied/revision` | none | etcd's raft index and revision as the last `raise-floor` saw them (`raft.rs`) |
//! | `P meta/pad` | never written | | compared (and never found) by `raise-floor`'s padding transactions |
//!
//! Guarantees:
//! - A grant is one (sub-)transaction: create-if-absent of `g/KEY`, only
//!   when no older waiter is queued, plus the fence put; concurrent grants,
//!   renewals, releases and expiries of one gateway share one etcd
//!   transaction ([`batch`]), grants one slot each. Its token is
//!   `offset + revision · 64 + slot`: global, strictly increasing, and a
//!   slot grants one key, so a token names exactly one grant of one key.
//! - A grant key has no etcd lease: renewal puts it again (compared on its
//!   create revision), release deletes it (likewise), and the gateways
//!   expire it by their own deadlines, each counted from when their watch
//!   saw its last put, always later than the holder's ([`expiry`]).
//! - Each gateway mirrors the prefix in memory (one consistent read at R,
//!   a watch from R+1, a full reload when compaction cancels the watch) and
//!   installs fences into its [`FenceTable`]: the data path never waits on
//!   etcd.
//! - A grant is returned only once every live member acknowledged it (its
//!   `a/GW` reached the grant's revision) or its membership ended, plus a
//!   quarantine of the longest upstream timeout for a member that vanished
//!   without draining.
//! - A gateway admits mutations only while its membership keepalive is
//!   acknowledged in time and its watch is proved current ([`member`]).

mod batch;
mod etcd;
mod expiry;
mod feed;
mod floor;
mod leases;
mod member;
mod mirror;
mod raft;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};
use tokio::sync::watch;

use crate::config::{ClusterConfig, LocksConfig};
use crate::error::Error;
use crate::fence::{FenceTable, Liveness};
use crate::metrics::Metrics;
use crate::shutdown::Shutdown;

pub use floor::raise_floor;
use mirror::Mirror;

/// Key layout under the prefix (see the module doc).
#[derive(Debug, Clone)]
pub(crate) struct Keys {
    prefix: String,
}

/// What an etcd key under the prefix is.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Kind<'a> {
    Grant(&'a str),
    Fence(&'a str),
    Queue(&'a str),
    Member(&'a str),
    Ack(&'a str),
    /// A gateway found etcd restored (`raft.rs`): no grant anywhere until
    /// `raise-floor` deletes it.
    Restored(&'a str),
    /// A gateway's word that an incarnation of it whose member key went
    /// before it could mark it (value: that incarnation's lease) has
    /// nothing in flight (`member.rs`, `leave_lapsed`).
    Drained(&'a str),
    Offset,
    Other,
}

impl Keys {
    pub(crate) fn new(prefix: &str) -> Keys {
        Keys { prefix: prefix.to_string() }
    }
    fn grant(&self, key: &str) -> String {
        format!("{}g/{key}", self.prefix)
    }
    fn fence(&self, key: &str) -> String {
        format!("{}f/{key}", self.prefix)
    }
    /// Lock keys have no control characters, so `\0` ends the key part.
    fn queue_prefix(&self, key: &str) -> String {
        format!("{}q/{key}\0", self.prefix)
    }
    fn member(&self, gw: &str) -> String {
        format!("{}m/{gw}", self.prefix)
    }
    fn ack(&self, gw: &str) -> String {
        format!("{}a/{gw}", self.prefix)
    }
    fn drained(&self, gw: &str) -> String {
        format!("{}d/{gw}", self.prefix)
    }
    fn restored(&self, gw: &str) -> String {
        format!("{}r/{gw}", self.prefix)
    }
    pub(crate) fn restored_prefix(&self) -> String {
        format!("{}r/", self.prefix)
    }
    /// The end of the range of every key under the prefix (exclusive).
    fn prefix_end(&self) -> Vec<u8> {
        let mut end = self.prefix.clone().into_bytes();
        if let Some(last) = end.last_mut() {
            *last = last.saturating_add(1);
        }
        end
    }
    pub(crate) fn offset(&self) -> String {
        format!("{}meta/offset", self.prefix)
    }
    fn raft_record(&self) -> String {
        format!("{}meta/raft", self.prefix)
    }
    /// A key never written: the compare of `raise-floor`'s padding
    /// transactions (`floor::pad_raft_log`).
    fn raft_pad(&self) -> String {
        format!("{}meta/pad", self.prefix)
    }
    /// The floor (`--to`) of the last `raise-floor`, written with the offset.
    fn raised_to(&self) -> String {
        format!("{}meta/floor", self.prefix)
    }
    /// Classifies an etcd key (bytes from a peer: anything not UTF-8 or
    /// outside the layout is `Other` and ignored).
    fn kind<'a>(&self, raw: &'a [u8]) -> Kind<'a> {
        let Ok(s) = std::str::from_utf8(raw) else { return Kind::Other };
        let Some(rest) = s.strip_prefix(self.prefix.as_str()) else { return Kind::Other };
        if let Some(k) = rest.strip_prefix("g/") {
            Kind::Grant(k)
        } else if let Some(k) = rest.strip_prefix("f/") {
            Kind::Fence(k)
        } else if let Some(k) = rest.strip_prefix("q/") {
            k.split_once('\0').map_or(Kind::Other, |(key, _)| Kind::Queue(key))
        } else if let Some(g) = rest.strip_prefix("m/") {
            Kind::Member(g)
        } else if let Some(g) = rest.strip_prefix("a/") {
            Kind::Ack(g)
        } else if let Some(g) = rest.strip_prefix("r/") {
            Kind::Restored(g)
        } else if let Some(g) = rest.strip_prefix("d/") {
            Kind::Drained(g)
        } else if rest == "meta/offset" {
            Kind::Offset
        } else {
            Kind::Other
        }
    }
}

/// An etcd failure as the client sees it: 503, fail closed.
fn unavailable(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Unavailable(format!("etcd: {what}: {e}"))
}

/// Whether an etcd request certainly never reached etcd's state machine,
/// so asking again cannot apply it twice: the connection the client picked
/// was refused (a member down or restarting: the client's balancer keeps
/// handing out its endpoint), or the member answered that it has no leader
/// (with `require_leader`, checked before the request is handled).
fn never_applied(e: &etcd_client::Error) -> bool {
    let m = e.to_string();
    m.contains("tcp connect error") || m.contains("error trying to connect") || m.contains("etcdserver: no leader")
}

/// A revision as a number (revisions are positive).
fn rev_u64(rev: i64) -> u64 {
    u64::try_from(rev).unwrap_or(0)
}

/// Grants per shared grant transaction: each has its own slot, so tokens
/// are `offset + revision · TOKEN_SLOTS + slot` (see `batch`).
pub(crate) const TOKEN_SLOTS: u64 = 64;

/// The token of a grant (or fence) written at `rev` in `slot` of its
/// batch with `offset`; `None`: written alone (before batching), token
/// `offset + rev`, always below every batched token of a later revision.
fn token_of(offset: u64, rev: i64, slot: Option<u64>) -> u64 {
    match slot {
        Some(i) => {
            offset.saturating_add(rev_u64(rev).saturating_mul(TOKEN_SLOTS)).saturating_add(i.min(TOKEN_SLOTS - 1))
        }
        None => offset.saturating_add(rev_u64(rev)),
    }
}

/// Connects a client to the configured endpoints (TLS if configured).
pub async fn connect(cfg: &ClusterConfig) -> Result<Client, Error> {
    let mut opts = ConnectOptions::new()
        .with_connect_timeout(Duration::from_millis(cfg.etcd_timeout_ms))
        // HTTP/2 pings no more often than etcd accepts: a server on its
        // defaults (`--grpc-keepalive-min-time` 5 s, no pings without a
        // stream) answers more frequent ones with GOAWAY "too_many_pings",
        // failing the requests in flight on that connection. A member that
        // hangs is found by each request's own deadline anyway.
        .with_keep_alive(Duration::from_secs(6), Duration::from_millis(cfg.etcd_timeout_ms))
        .with_keep_alive_while_idle(false)
        // A member without a leader refuses instead of serving stale data.
        .with_require_leader(true);
    if cfg.ca_file.is_some() || cfg.cert_file.is_some() {
        let mut tls = etcd_client::TlsOptions::new();
        if let Some(ca) = &cfg.ca_file {
            let pem = std::fs::read(ca).map_err(|e| Error::Internal(format!("reading {}: {e}", ca.display())))?;
            tls = tls.ca_certificate(etcd_client::Certificate::from_pem(pem));
        }
        if let (Some(c), Some(k)) = (&cfg.cert_file, &cfg.key_file) {
            let cert = std::fs::read(c).map_err(|e| Error::Internal(format!("reading {}: {e}", c.display())))?;
            let key = std::fs::read(k).map_err(|e| Error::Internal(format!("reading {}: {e}", k.display())))?;
            tls = tls.identity(etcd_client::Identity::from_pem(cert, key));
        }
        opts = opts.with_tls(tls);
    }
    let connect = Client::connect(&cfg.etcd_endpoints, Some(opts));
    match tokio::time::timeout(Duration::from_millis(cfg.etcd_timeout_ms), connect).await {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => Err(unavailable("connecting", e)),
        Err(_) => Err(Error::Unavailable("etcd: connecting: timed out".into())),
    }
}

/// This gateway's membership: the etcd lease its `m/` and `a/` keys live on.
#[derive(Debug, Default, Clone)]
struct Membership {
    lease: Option<i64>,
    /// The value of its member key (`mirror::member_value`).
    value: String,
    /// The revision that created this gateway's membership key under
    /// `lease` (0: not a member).
    since: i64,
}

impl crate::fence::GrantLiveness for Cluster {
    /// Live: this gateway's mirror of etcd holds `key`'s grant with `token`
    /// and this gateway's expiry deadline for it has not passed (a grant
    /// ends when a gateway deletes it, and the watch deletes it here).
    ///
    /// Past that deadline with the grant still in the mirror, this gateway
    /// cannot tell an expired grant (its delete not seen yet) from a renewed
    /// one (the renewal's put not seen yet, e.g. while etcd elects a leader):
    /// unsure, refused as `not_current`, never admitted.
    fn liveness(&self, key: &str, token: u64) -> Liveness {
        // The deadline is part of self-fencing (a gateway cut from etcd sees
        // no release and no expiry): the nemesis self-test's gateway that
        // does not self-fence (debug builds only) trusts its view as it is.
        let now = tokio::time::Instant::now();
        let trust_view = crate::fault::enabled(crate::fault::Fault::NoSelfFencing);
        match self.lock_mirror().grants.get(key) {
            Some(g) if g.token == token && (trust_view || g.deadline > now) => Liveness::Live,
            Some(g) if g.token == token => Liveness::Unsure(
                "this gateway's deadline for the grant has passed and it has seen neither a renewal nor the \
                 grant's end yet",
            ),
            _ => Liveness::Ended,
        }
    }
}

/// The token floor as the watch delivers grants: the floor before the
/// revision being applied, and the grants held back (revision → keys).
#[derive(Debug, Default)]
pub(super) struct FloorWatch {
    rev: i64,
    before: u64,
    /// Per create revision, the keys held back with their grant's lease-id
    /// hash (empty: not known, any grant of the key at that revision).
    held: std::collections::BTreeMap<i64, Vec<(String, String)>>,
    /// Held grants the watch delivered (key, the grant's exact value) that
    /// this gateway has yet to end itself ([`Cluster::end_held`]).
    to_end: Vec<(String, Vec<u8>)>,
}

/// The cluster-mode authority of one gateway.
pub struct Cluster {
    /// etcd, one member at a time.
    etcd: etcd::Etcd,
    keys: Keys,
    gateway_id: String,
    fences: Arc<FenceTable>,
    metrics: Arc<Metrics>,
    limits: LocksConfig,
    /// Deadline of each etcd request.
    timeout: Duration,
    member_ttl: Duration,
    /// How long a request forwarded by a gateway that vanished without
    /// draining may still be applied: the longest upstream timeout.
    quarantine: Duration,
    mirror: Mutex<Mirror>,
    /// Highest revision the feed has applied; changes wake local waiters,
    /// watchers and activations.
    applied: watch::Sender<i64>,
    /// Wakes the acknowledgement writer.
    ack_kick: Arc<tokio::sync::Notify>,
    /// Revisions of fences whose local activation barrier still runs.
    pending: Arc<Mutex<std::collections::BTreeSet<i64>>>,
    /// The last fence revision applied.
    last_fence: Mutex<i64>,
    /// Grants whose tokens were not above the token floor (`feed.rs`,
    /// `check_against_floor`).
    floor_watch: Mutex<FloorWatch>,
    membership: Mutex<Membership>,
    /// The watch is running and was loaded from a consistent read.
    feed_ok: AtomicBool,
    /// Counts the feed's watches; the membership round names the one that
    /// missed a write etcd acknowledged ([`Cluster::watch_missed`]).
    watch_count: std::sync::atomic::AtomicU64,
    watch_stalled: std::sync::atomic::AtomicU64,
    watch_stall_kick: tokio::sync::Notify,
    ack_lock: tokio::sync::Mutex<i64>,
    /// A shared transaction is in flight (`batch.rs`): an acknowledgement
    /// goes with the next one rather than in a request of its own.
    batching: AtomicBool,
    floor: Arc<floor::Floor>,
    /// The membership lease whose `m/GW` key was deleted under it (by
    /// hand): that membership is over; wakes the membership loop.
    member_lost: std::sync::atomic::AtomicI64,
    member_lost_kick: tokio::sync::Notify,
    /// Wakes the membership loop for a round now: the watch was reloaded,
    /// and the gateway is current again only once a round proves it.
    round_kick: tokio::sync::Notify,
    /// Grants, renewals, releases and expiries waiting for the next shared
    /// transaction.
    batches: batch::Queue,
    /// The etcd configuration (the restore detection's probe connects to
    /// one member at a time with it).
    cfg: ClusterConfig,
    probe: tokio::sync::Mutex<raft::Probe>,
    stop: Shutdown,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster").field("gateway_id", &self.gateway_id).finish_non_exhaustive()
    }
}

/// What [`Cluster::start`] needs beyond the config.
#[derive(Debug)]
pub struct Start {
    pub cfg: ClusterConfig,
    pub gateway_id: String,
    pub fences: Arc<FenceTable>,
    pub metrics: Arc<Metrics>,
    pub limits: LocksConfig,
    pub quarantine: Duration,
    pub data_dir: std::path::PathBuf,
    pub stop: Shutdown,
}

impl Cluster {
    /// Connects, loads the fences at a consistent revision, starts the
    /// watch, the membership and the acknowledgements. Mutations are
    /// refused (`not_current`) until the gateway has joined.
    pub async fn start(s: Start) -> Result<Arc<Cluster>, Error> {
        let etcd = etcd::Etcd::connect(&s.cfg, &s.gateway_id, s.metrics.clone()).await?;
        let floor = Arc::new(floor::Floor::open(&s.data_dir)?);
        crate::fault::announce();
        // The fault `no-self-fencing` (nemesis self-test only, debug builds,
        // src/fault.rs) admits mutations whatever the membership and the
        // watch say.
        if !crate::fault::enabled(crate::fault::Fault::NoSelfFencing) {
            s.fences.gate_on_currency();
        }
        s.fences.set_not_current("the gateway has not joined its cluster yet");
        let (batches, batch_rx) = tokio::sync::mpsc::unbounded_channel();
        let cluster = Arc::new(Cluster {
            etcd,
            keys: Keys::new(&s.cfg.prefix),
            gateway_id: s.gateway_id,
            fences: s.fences,
            metrics: s.metrics,
            limits: s.limits,
            timeout: Duration::from_millis(s.cfg.etcd_timeout_ms),
            member_ttl: Duration::from_millis(s.cfg.member_ttl_ms),
            quarantine: s.quarantine,
            mirror: Mutex::new(Mirror::default()),
            applied: watch::channel(0).0,
            ack_kick: Arc::default(),
            pending: Arc::default(),
            last_fence: Mutex::new(0),
            floor_watch: Mutex::default(),
            membership: Mutex::default(),
            feed_ok: AtomicBool::new(false),
            watch_count: std::sync::atomic::AtomicU64::new(0),
            watch_stalled: std::sync::atomic::AtomicU64::new(0),
            watch_stall_kick: tokio::sync::Notify::new(),
            ack_lock: tokio::sync::Mutex::new(0),
            batching: AtomicBool::new(false),
            floor,
            member_lost: std::sync::atomic::AtomicI64::new(0),
            member_lost_kick: tokio::sync::Notify::new(),
            round_kick: tokio::sync::Notify::new(),
            batches,
            probe: tokio::sync::Mutex::default(),
            cfg: s.cfg.clone(),
            stop: s.stop,
        });
        // Strict routes ask the mirror whether a grant is live.
        let liveness: std::sync::Weak<dyn crate::fence::GrantLiveness> =
            Arc::downgrade(&cluster) as std::sync::Weak<dyn crate::fence::GrantLiveness>;
        cluster.fences.derive_liveness_from(liveness);
        // The first load is part of the start: an unreachable etcd fails it
        // loudly instead of serving nothing.
        cluster.etcd.prefer_leader(cluster.timeout / 4).await;
        cluster.wait_for_id_free().await?;
        let watch_from = cluster.load().await?;
        tokio::spawn(cluster.clone().run_feed(watch_from));
        tokio::spawn(cluster.clone().narrow_first_quarantine(watch_from - 1));
        tokio::spawn(cluster.clone().run_member());
        tokio::spawn(cluster.clone().run_acks());
        tokio::spawn(cluster.clone().run_batches(batch_rx));
        tokio::spawn(cluster.clone().run_expiry());
        tokio::spawn(cluster.clone().run_raft_check((cluster.member_ttl / 2).max(Duration::from_secs(1))));
        tokio::spawn(cluster.clone().run_leader_preference((cluster.member_ttl / 2).max(Duration::from_secs(1))));
        tokio::spawn(cluster.floor.clone().run(cluster.stop.clone()));
        tracing::info!(gateway = %cluster.gateway_id, revision = watch_from - 1, "cluster mode: fences loaded from etcd");
        Ok(cluster)
    }

    /// Keeps the gateway's etcd requests on the leader (`etcd.rs`,
    /// `prefer_leader`), checked every `every`.
    async fn run_leader_preference(self: Arc<Self>, every: Duration) {
        loop {
            tokio::select! {
                () = tokio::time::sleep(every) => {}
                () = self.stop.wait() => return,
            }
            self.etcd.prefer_leader(self.timeout / 4).await;
        }
    }

    /// The fence table this gateway admits mutations with.
    pub fn fences(&self) -> &Arc<FenceTable> {
        &self.fences
    }

    /// This gateway's id among its peers.
    pub fn gateway_id(&self) -> &str {
        &self.gateway_id
    }

    fn lock_mirror(&self) -> std::sync::MutexGuard<'_, Mirror> {
        self.mirror.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn member_lease(&self) -> Option<i64> {
        self.membership.lock().unwrap_or_else(std::sync::PoisonError::into_inner).lease
    }

    fn member_value(&self) -> String {
        self.membership.lock().unwrap_or_else(std::sync::PoisonError::into_inner).value.clone()
    }

    fn set_member_value(&self, value: String) {
        self.membership.lock().unwrap_or_else(std::sync::PoisonError::into_inner).value = value;
    }

    fn set_member_lease(&self, lease: Option<i64>, since: i64) {
        let mut m = self.membership.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        m.lease = lease;
        m.since = if lease.is_some() { since } else { 0 };
    }

    /// Whether this gateway has been a member, under its current lease and
    /// without a lapse it could not see, since before revision `rev`: then
    /// a grant made at `rev` waits for its acknowledgement (every gateway
    /// that saw its membership key counts it), so it was never answered
    /// without it.
    fn member_before(&self, rev: i64) -> bool {
        let since = self.membership.lock().unwrap_or_else(std::sync::PoisonError::into_inner).since;
        since > 0 && since < rev && self.fences.is_current()
    }

    /// Revokes an etcd lease (ending every key on it).
    async fn revoke(&self, lease: i64) -> Result<etcd_client::LeaseRevokeResponse, Error> {
        self.etcd
            .call_repeatable(self.timeout, "revoking", || {
                let mut leases = self.etcd.lease_client();
                async move { leases.revoke(lease).await }
            })
            .await
    }

    fn feed_is_ok(&self) -> bool {
        self.feed_ok.load(Ordering::Acquire)
    }

    /// A clean stop: marks this member drained (no peer waits a quarantine
    /// for it) and ends its membership. Called once nothing is in flight.
    pub async fn leave(&self) {
        let Some(lease) = self.member_lease() else { return };
        let key = self.keys.member(&self.gateway_id);
        let _ = self
            .etcd
            .call_repeatable(self.timeout, "leaving", || {
                let (mut kv, key) = (self.etcd.kv_client(), key.clone());
                async move { kv.put(key, "drained", Some(etcd_client::PutOptions::new().with_lease(lease))).await }
            })
            .await;
        let _ = self.revoke(lease).await;
        self.set_member_lease(None, 0);
        tracing::info!(gateway = %self.gateway_id, "left the cluster");
    }
}
