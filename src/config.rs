//! The one configuration struct: embedded defaults, the TOML file, and the
//! `serve` flags merged on top of it, then `validate()`d.
//!
//! Every key is documented in `fencegate.example.toml`; every duration or
//! size carries its unit in its name. Unknown keys are errors, so a typo
//! never silently falls back to a default. This module is plain data and
//! its checks: the one file it reads is the config itself (`load`); the
//! files a config names (certificates, principals, the data directory) and
//! its upstream URLs are checked where they are built (`app::check`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::template::Template;

/// The whole configuration of one gateway.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// RocksDB and the built-in object store live here.
    pub data_dir: PathBuf,
    /// Proxy (data plane) listener address.
    pub listen: SocketAddr,
    /// API (control plane) listener address.
    pub api_listen: SocketAddr,
    /// Log filter when `RUST_LOG` is unset (e.g. `info`, `fencegate=debug`).
    pub log_level: String,
    /// `text` or `json`.
    pub log_format: String,
    /// Lease bounds and defaults.
    pub locks: LocksConfig,
    /// Durable store tuning.
    pub store: StoreConfig,
    /// Listener limits and shutdown.
    pub server: ServerConfig,
    /// Principals and where they are required.
    pub auth: crate::auth::AuthConfig,
    /// Proxy routes, first match wins. Empty: one catch-all route to the
    /// built-in object store in `<data_dir>/objects`.
    pub routes: Vec<RouteConfig>,
    /// Cluster mode (docs/cluster.md): the authority in an etcd cluster
    /// shared by several gateways. Absent: single-node RocksDB mode.
    pub cluster: Option<ClusterConfig>,
}

/// `[cluster]`: several gateways sharing one authority in etcd.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    /// Client URLs of the etcd members (`http://host:port` or `https://…`).
    pub etcd_endpoints: Vec<String>,
    /// This gateway's name among its peers; default: host name + ":" +
    /// proxy port. Two running gateways must never share one.
    #[serde(default)]
    pub gateway_id: Option<String>,
    /// TTL of the gateway's membership lease in etcd. etcd leases are whole
    /// seconds (rounded up here) with a floor of about 1.5 × etcd's
    /// election timeout. A gateway stops admitting mutations before it.
    #[serde(default = "default_member_ttl_ms")]
    pub member_ttl_ms: u64,
    /// Every key fencegate keeps in etcd starts with it.
    #[serde(default = "default_prefix")]
    pub prefix: String,
    /// Deadline of each etcd request (grants, renewals, keepalives).
    #[serde(default = "default_etcd_timeout_ms")]
    pub etcd_timeout_ms: u64,
    /// TLS to etcd: CA bundle (PEM) to trust.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// mTLS to etcd: client certificate chain (PEM) …
    #[serde(default)]
    pub cert_file: Option<PathBuf>,
    /// … and its private key (PEM).
    #[serde(default)]
    pub key_file: Option<PathBuf>,
}

fn default_member_ttl_ms() -> u64 {
    5_000
}
fn default_prefix() -> String {
    "/fencegate/".into()
}
fn default_etcd_timeout_ms() -> u64 {
    2_000
}

impl ClusterConfig {
    /// A cluster of these endpoints with every other setting at its default.
    pub fn with_endpoints(etcd_endpoints: Vec<String>) -> ClusterConfig {
        ClusterConfig {
            etcd_endpoints,
            gateway_id: None,
            member_ttl_ms: default_member_ttl_ms(),
            prefix: default_prefix(),
            etcd_timeout_ms: default_etcd_timeout_ms(),
            ca_file: None,
            cert_file: None,
            key_file: None,
        }
    }

    /// The gateway id: the configured one, else host name + proxy port.
    pub fn gateway_id(&self, listen: SocketAddr) -> String {
        if let Some(id) = &self.gateway_id {
            return id.clone();
        }
        let host = rustix::system::uname().nodename().to_string_lossy().into_owned();
        format!("{host}:{}", listen.port())
    }

    fn validate(&self) -> Result<(), String> {
        if self.etcd_endpoints.is_empty() {
            return Err("cluster.etcd_endpoints: at least one etcd endpoint is needed".into());
        }
        for e in &self.etcd_endpoints {
            if !(e.starts_with("http://") || e.starts_with("https://")) {
                return Err(format!("cluster.etcd_endpoints: {e:?} is not an http:// or https:// URL"));
            }
        }
        if self.member_ttl_ms < 1000 {
            return Err(format!(
                "cluster.member_ttl_ms: {} is below 1000 (etcd leases are whole seconds)",
                self.member_ttl_ms
            ));
        }
        if self.prefix.is_empty() {
            return Err("cluster.prefix: must not be empty".into());
        }
        if self.etcd_timeout_ms == 0 {
            return Err("cluster.etcd_timeout_ms: must be at least 1".into());
        }
        if let Some(id) = &self.gateway_id {
            if id.is_empty() || id.len() > 128 || id.chars().any(|c| c.is_control() || c == '/') {
                return Err(format!("cluster.gateway_id: {id:?} must be 1 to 128 bytes, no '/' or control characters"));
            }
        }
        if self.cert_file.is_some() != self.key_file.is_some() {
            return Err("cluster.cert_file and cluster.key_file: give both or neither".into());
        }
        Ok(())
    }
}

/// The longest TTL a grant can have: 2^31 − 1 ms (24.8 days). A grant
/// keeps its TTL in 31 bits (issue 18: 64 bytes of state per held lease).
pub const MAX_TTL_MS: u64 = (1 << 31) - 1;

/// Bounds of the lease API (docs/lease-api.md).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LocksConfig {
    /// Shortest lease a client may ask for.
    pub min_ttl_ms: u64,
    /// Longest lease a client may ask for.
    pub max_ttl_ms: u64,
    /// Longest a client may wait in the queue for a key.
    pub max_wait_ms: u64,
    /// Longest `watch` long-poll.
    pub max_watch_timeout_ms: u64,
    /// Longest `holder` string, in bytes.
    pub max_holder_bytes: usize,
    /// Most clients queued on one key at once (429-free: more get `locked`).
    pub max_waiters_per_key: usize,
    /// Most acquires with a wait one principal (or, when the lease API
    /// needs no principal, one client address) may have queued at once.
    pub max_waiters_per_principal: usize,
    /// Most watches one principal (or, when the lease API needs no
    /// principal, one client address) may have open at once.
    pub max_watches_per_principal: usize,
    /// Most keys with a fence in the whole gateway; a grant or external
    /// advance on one more is refused (507 `fence_quota_exceeded`). A fence
    /// costs ~100-250 bytes of memory and disk for good.
    pub max_fences: usize,
    /// Most fenced keys under one principal's prefixes that the lease API
    /// lets it create (counted from the keys on disk at start).
    pub max_fences_per_principal: usize,
    /// Longest a grant waits at activation for older in-flight mutations
    /// before it is returned anyway (they are then counted as overrun).
    pub activation_timeout_ms: u64,
}

/// RocksDB settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    /// Share one fsync among all writes queued at once (group commit).
    /// `false` fsyncs every write on its own (for benchmarks only).
    pub group_commit: bool,
    /// Most writes folded into one group commit.
    pub max_batch: usize,
    /// Niceness of the writer thread (0 to 19; 0 leaves it as started).
    /// A nicer writer does not preempt the request threads the moment a
    /// commit is queued or an fsync returns: they go on serving, more
    /// commits queue meanwhile, and each fsync carries more of them.
    pub writer_nice: i32,
    /// Bytes a second RocksDB's flushes and compactions may write (its rate
    /// limiter; 0: no bound). The log's own writes and fsyncs are never
    /// limited. Spread out, the background writes of a mass expiry's
    /// compaction disturb the fsyncs of grants and fences less.
    pub background_write_bytes_per_sec: u64,
}

/// Listener settings shared by both listeners.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Largest JSON body accepted by the lease API.
    pub api_max_body_bytes: u64,
    /// Largest total size of request headers (431 above it).
    pub max_header_bytes: usize,
    /// How long a client may take to send its request headers.
    pub header_read_timeout_ms: u64,
    /// How long a client may take to send a whole lease API request body,
    /// counted from the end of its headers (408 and the connection closed
    /// after it).
    pub body_read_timeout_ms: u64,
    /// How long graceful shutdown waits for in-flight requests.
    pub shutdown_grace_ms: u64,
    /// A connection served by hyper (HTTP/2, TLS, what the fast paths hand
    /// over) with no request in flight for this long is closed: HTTP/2
    /// peers that answer PINGs were otherwise kept for ever.
    pub idle_timeout_ms: u64,
    /// Most connections open at once per listener.
    pub max_connections: usize,
    /// Most connections open at once per listener from one client address
    /// (default 5,000, half the default `max_connections`, so one address
    /// cannot take a whole listener; 0: no per-address bound). Beyond it a
    /// new connection is closed at once.
    pub max_connections_per_address: usize,
    /// TLS on the proxy listener (plain text when absent).
    pub proxy_tls: Option<crate::tls::TlsSettings>,
    /// TLS on the api listener (plain text when absent).
    pub api_tls: Option<crate::tls::TlsSettings>,
    /// Serve plain-text HTTP/1.1 proxy requests on the fast path (requests
    /// it does not take still go to the general path). `false`: the
    /// general path only.
    pub proxy_fast_path: bool,
    /// Serve plain-text HTTP/1.1 lease API requests with the small
    /// HTTP/1.1 loop (others still go to the general path). `false`: the
    /// general path only.
    pub api_fast_path: bool,
}

/// How a route's tokens come to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FenceAuthority {
    /// Tokens are granted by this gateway's lease API.
    Embedded,
    /// Tokens come from elsewhere; a higher one advances the fence.
    External,
}

/// What to send as `Host` upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HostHeader {
    /// Send the client's Host unchanged (needed for SigV4-signed requests).
    Preserve,
    /// Send the upstream's own authority.
    Rewrite,
}

/// Whether a route's upstream tells `a/` from `a` (the path rule, docs/proxy.md).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TrailingSlash {
    /// The upstream folds `a/` into `a` (most file and object servers,
    /// the built-in store): a mutation of a path with a trailing slash
    /// would write the object of another key, so it is refused with 400.
    #[default]
    Refuse,
    /// The upstream keeps `a/` as an object of its own (S3: `dir/` is a
    /// key): a trailing slash is one more character of the key.
    Distinct,
}

/// One `[[routes]]` entry (docs/proxy.md).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// Name used in metrics and logs; default `route<N>`.
    #[serde(default)]
    pub name: Option<String>,
    /// Path template: literal segments, `{name}` segments, a final `{*rest}`.
    /// Required on `http` routes; `s3` routes default to every path.
    #[serde(rename = "match", default)]
    pub match_path: String,
    /// Resource key template over the match's names; default: the path
    /// without its leading `/`.
    #[serde(default)]
    pub resource: Option<String>,
    /// `http://host:port[/prefix]`, `https://…` or `file://DIR`.
    pub upstream: String,
    /// The methods forwarded as reads (no token needed; a stale one is
    /// still refused). Every other method, unknown and extension methods
    /// and other spellings (`put`) included, is a mutation: fail safe.
    #[serde(default = "default_read_methods")]
    pub read_methods: Vec<String>,
    /// The removed key `mutating_methods`: present only to refuse it with
    /// a hint naming `read_methods` (a list of mutations fails open).
    #[serde(default, rename = "mutating_methods", deserialize_with = "refuse_mutating_methods")]
    #[expect(dead_code, reason = "never read: parsing the removed key fails with its hint")]
    removed_mutating_methods: Removed,
    /// Whether the upstream keeps `a/` and `a` apart: `refuse` (default)
    /// or `distinct`.
    #[serde(default)]
    pub trailing_slash: TrailingSlash,
    /// `embedded` (default) or `external`.
    #[serde(default = "default_authority")]
    pub fence_authority: FenceAuthority,
    /// `external` routes: the largest step a token may take above the
    /// key's fence; beyond it 403 (a token near `u64::MAX` would otherwise
    /// fence the key out for good).
    #[serde(default = "default_max_token_step")]
    pub max_token_step: u64,
    /// Refuse a token equal to the fence whose grant has ended.
    #[serde(default = "default_true")]
    pub strict: bool,
    /// `false` = shadow mode: count and log refusals, forward anyway.
    #[serde(default = "default_true")]
    pub enforce: bool,
    /// Whole-exchange timeout until the upstream's response head.
    #[serde(default = "default_upstream_timeout_ms")]
    pub upstream_timeout_ms: u64,
    /// TCP connect timeout to the upstream.
    #[serde(default = "default_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// Largest request body forwarded (413 above it).
    #[serde(default = "default_max_body_bytes")]
    pub max_body_bytes: u64,
    /// Forward `X-Fencing-Token` to the upstream.
    #[serde(default = "default_true")]
    pub forward_fencing_token: bool,
    /// `preserve` (default) or `rewrite`.
    #[serde(default = "default_host")]
    pub host_header: HostHeader,
    /// `https://` upstreams: PEM CA bundle to trust (default: system roots).
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// `https://` upstreams that want mTLS: client certificate chain (PEM).
    #[serde(default)]
    pub client_cert_file: Option<PathBuf>,
    /// … and its private key (PEM).
    #[serde(default)]
    pub client_key_file: Option<PathBuf>,
    /// Require a principal (`Proxy-Authorization: Bearer …` or an mTLS
    /// client certificate) whose prefixes cover the resource key.
    #[serde(default)]
    pub auth: bool,
    /// `http` (default: path templates) or `s3` (an S3-compatible object
    /// store, docs/s3.md).
    #[serde(default)]
    pub kind: RouteKindName,
    /// `s3` routes: the domains under which the bucket is the first label
    /// of `Host` (virtual-hosted style: `bucket.s3.example.internal`).
    #[serde(default)]
    pub base_domains: Vec<String>,
    /// `s3` routes: the resource of a bucket-level request (create,
    /// delete, configuration); names: `{bucket}`. Default `{bucket}`.
    #[serde(default)]
    pub bucket_resource: Option<String>,
    /// `s3` routes: the most bytes of a body read before admission to find
    /// the keys it names (`DeleteObjects` XML, `PostObject` form fields up to
    /// the file); above it the request is refused (413).
    #[serde(default = "default_max_scanned_body_bytes")]
    pub max_scanned_body_bytes: u64,
    /// Cluster mode: this route's upstream is local to each gateway on
    /// purpose (a `file://` store per gateway). Without it a `file://`
    /// route is refused in cluster mode.
    #[serde(default)]
    pub per_gateway: bool,
}

/// The kind of a route: how a request becomes the keys it touches.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RouteKindName {
    /// Path templates (`match`, `resource`); mutations by method.
    #[default]
    Http,
    /// An S3-compatible object store (docs/s3.md).
    S3,
}

fn default_max_scanned_body_bytes() -> u64 {
    2 * 1024 * 1024
}

fn default_read_methods() -> Vec<String> {
    ["GET", "HEAD", "OPTIONS"].map(String::from).to_vec()
}

/// The hint a configuration with the removed `mutating_methods` gets.
const MUTATING_METHODS_REMOVED: &str = "mutating_methods was removed: a route now lists its read methods \
     instead, as read_methods (default [\"GET\", \"HEAD\", \"OPTIONS\"]), and every other method, unknown ones \
     included, is a mutation that needs a token; delete mutating_methods, or list the reads in read_methods";

/// The value of a removed key: never present (deserializing one fails).
#[derive(Debug, Clone, Copy, Default)]
struct Removed;

fn refuse_mutating_methods<'de, D: serde::Deserializer<'de>>(_: D) -> Result<Removed, D::Error> {
    Err(serde::de::Error::custom(MUTATING_METHODS_REMOVED))
}
fn default_max_token_step() -> u64 {
    1_000_000_000_000
}
fn default_authority() -> FenceAuthority {
    FenceAuthority::Embedded
}
fn default_true() -> bool {
    true
}
fn default_upstream_timeout_ms() -> u64 {
    30_000
}
fn default_connect_timeout_ms() -> u64 {
    2_000
}
fn default_max_body_bytes() -> u64 {
    5 * 1024 * 1024 * 1024
}
fn default_host() -> HostHeader {
    HostHeader::Preserve
}

impl Default for Config {
    fn default() -> Self {
        Config {
            data_dir: PathBuf::from("./fencegate-data"),
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            api_listen: SocketAddr::from(([127, 0, 0, 1], 7070)),
            log_level: "info".into(),
            log_format: "text".into(),
            locks: LocksConfig::default(),
            store: StoreConfig::default(),
            server: ServerConfig::default(),
            auth: crate::auth::AuthConfig::default(),
            routes: Vec::new(),
            cluster: None,
        }
    }
}

impl Default for LocksConfig {
    fn default() -> Self {
        LocksConfig {
            min_ttl_ms: 100,
            max_ttl_ms: 3_600_000,
            max_wait_ms: 300_000,
            max_watch_timeout_ms: 300_000,
            max_holder_bytes: 256,
            max_waiters_per_key: 1024,
            max_waiters_per_principal: 256,
            max_watches_per_principal: 256,
            max_fences: 10_000_000,
            max_fences_per_principal: 1_000_000,
            activation_timeout_ms: 60_000,
        }
    }
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig { group_commit: true, max_batch: 1024, writer_nice: 10, background_write_bytes_per_sec: 16 << 20 }
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            api_max_body_bytes: 64 * 1024,
            max_header_bytes: 64 * 1024,
            header_read_timeout_ms: 10_000,
            body_read_timeout_ms: 10_000,
            shutdown_grace_ms: 10_000,
            idle_timeout_ms: 75_000,
            max_connections: 10_000,
            max_connections_per_address: 5_000,
            proxy_tls: None,
            api_tls: None,
            proxy_fast_path: true,
            api_fast_path: true,
        }
    }
}

/// The `serve` flags (docs/running.md); each one that is set overrides the file.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub data_dir: Option<PathBuf>,
    pub listen: Option<SocketAddr>,
    pub api_listen: Option<SocketAddr>,
    pub upstream: Option<String>,
    pub log_level: Option<String>,
    pub log_format: Option<String>,
    /// `--etcd URL[,URL…]`: cluster mode with these etcd endpoints.
    pub etcd: Option<Vec<String>>,
}

impl Config {
    /// Parses TOML text; errors name the key and the line.
    pub fn from_toml(text: &str) -> Result<Config, String> {
        toml::from_str(text).map_err(|e| e.to_string())
    }

    /// Reads and parses a config file.
    pub fn load(path: &Path) -> Result<Config, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
        Config::from_toml(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Applies the command-line flags on top of the file.
    pub fn apply(&mut self, o: Overrides) {
        if let Some(d) = o.data_dir {
            self.data_dir = d;
        }
        if let Some(l) = o.listen {
            self.listen = l;
        }
        if let Some(l) = o.api_listen {
            self.api_listen = l;
        }
        if let Some(l) = o.log_level {
            self.log_level = l;
        }
        if let Some(f) = o.log_format {
            self.log_format = f;
        }
        if let Some(u) = o.upstream {
            self.routes = vec![RouteConfig::catch_all(u)];
        }
        if let Some(endpoints) = o.etcd {
            match &mut self.cluster {
                Some(c) => c.etcd_endpoints = endpoints,
                None => self.cluster = Some(ClusterConfig::with_endpoints(endpoints)),
            }
        }
    }

    /// The routes actually served: the configured ones, or the embedded
    /// default catch-all to `<data_dir>/objects`.
    pub fn effective_routes(&self) -> Vec<RouteConfig> {
        if self.routes.is_empty() {
            let dir = self.data_dir.join("objects");
            vec![RouteConfig::catch_all(format!("file://{}", dir.display()))]
        } else {
            self.routes.clone()
        }
    }

    /// Checks everything serde cannot that needs nothing but the values:
    /// bounds, names, templates, how settings combine. The message names
    /// the key that is wrong and why. What a value names — certificate and
    /// principal files, upstream URLs — is checked where it is built
    /// (`app::check`, run by `serve` before it binds and by `check-config`).
    pub fn validate(&self) -> Result<(), String> {
        let l = &self.locks;
        if l.min_ttl_ms == 0 {
            return Err("locks.min_ttl_ms: must be at least 1".into());
        }
        if l.max_ttl_ms > MAX_TTL_MS {
            return Err(format!("locks.max_ttl_ms: at most {MAX_TTL_MS} (24.8 days), got {}", l.max_ttl_ms));
        }
        if l.max_ttl_ms < l.min_ttl_ms {
            return Err(format!("locks.max_ttl_ms: {} is below locks.min_ttl_ms {}", l.max_ttl_ms, l.min_ttl_ms));
        }
        if l.max_waiters_per_key == 0 {
            return Err("locks.max_waiters_per_key: must be at least 1".into());
        }
        if l.max_fences == 0 || l.max_fences_per_principal == 0 {
            return Err("locks.max_fences and locks.max_fences_per_principal: must be at least 1".into());
        }
        if l.max_waiters_per_principal == 0 || l.max_watches_per_principal == 0 {
            return Err(
                "locks.max_waiters_per_principal and locks.max_watches_per_principal: must be at least 1".into()
            );
        }
        if self.server.header_read_timeout_ms == 0 || self.server.body_read_timeout_ms == 0 {
            return Err("server.header_read_timeout_ms and server.body_read_timeout_ms: must be at least 1".into());
        }
        if self.server.idle_timeout_ms == 0 {
            return Err("server.idle_timeout_ms: must be at least 1".into());
        }
        if self.store.max_batch == 0 {
            return Err("store.max_batch: must be at least 1".into());
        }
        if !(0..=19).contains(&self.store.writer_nice) {
            return Err(format!("store.writer_nice: {} is not between 0 and 19", self.store.writer_nice));
        }
        if !matches!(self.log_format.as_str(), "text" | "json") {
            return Err(format!("log_format: {:?} is neither \"text\" nor \"json\"", self.log_format));
        }
        if self.server.max_header_bytes < 1024 {
            return Err("server.max_header_bytes: must be at least 1024".into());
        }
        if self.routes.iter().any(|r| r.auth) && self.auth.principals_file.is_none() {
            return Err("routes[].auth = true needs auth.principals_file".into());
        }
        if self.listen == self.api_listen && self.listen.port() != 0 {
            return Err(format!("listen and api_listen are both {}", self.listen));
        }
        if let Some(c) = &self.cluster {
            c.validate()?;
            // The built-in store keeps objects on this gateway's disk: other
            // gateways of the cluster would fence writes to a different copy.
            for (i, r) in self.effective_routes().iter().enumerate() {
                if r.upstream.to_ascii_lowercase().starts_with("file://") && !r.per_gateway {
                    let at =
                        if self.routes.is_empty() { "the default route".to_string() } else { format!("routes[{i}]") };
                    return Err(format!(
                        "{at}: a file:// upstream is local to one gateway, but cluster mode fences the same \
                         resources on every gateway: give an upstream the gateways share, or set per_gateway = true \
                         on the route if each gateway serving its own copy is what you want"
                    ));
                }
            }
        }
        let mut names = std::collections::HashSet::new();
        for (i, r) in self.routes.iter().enumerate() {
            let at = format!("routes[{i}]");
            r.validate().map_err(|e| format!("{at}.{e}"))?;
            // The activation barrier gives up after activation_timeout_ms;
            // an older mutation is certain to be over only after its
            // route's upstream timeout. The barrier must outlast it.
            if r.upstream_timeout_ms >= l.activation_timeout_ms {
                return Err(format!(
                    "{at}.upstream_timeout_ms: {} must be below locks.activation_timeout_ms ({}), or a new holder \
                     could be answered while an older holder's write is still in flight",
                    r.upstream_timeout_ms, l.activation_timeout_ms
                ));
            }
            if !names.insert(r.route_name(i)) {
                return Err(format!("{at}.name: {:?} is used twice", r.route_name(i)));
            }
        }
        Ok(())
    }
}

impl Config {
    /// What is valid but probably not meant: today, a route without `auth`
    /// whose keys an `auth = true` route also produces (its requests move
    /// the same fences without a principal). Best effort: judged from the
    /// templates alone. `check-config` prints these; `serve` logs them.
    pub fn warnings(&self) -> Vec<String> {
        let shape = |r: &RouteConfig| {
            if r.kind == RouteKindName::S3 {
                // Keys come from Host and the path: every key is possible.
                return Some(crate::template::KeyShape::of(&Template::parse_match("/{*k}").ok()?, None));
            }
            let m = Template::parse_match(&r.match_path).ok()?;
            let res = match &r.resource {
                Some(t) => Some(Template::parse_resource(t, &m).ok()?),
                None => None,
            };
            Some(crate::template::KeyShape::of(&m, res.as_ref()))
        };
        let shapes: Vec<_> = self.routes.iter().map(shape).collect();
        let mut out = Vec::new();
        for (i, open) in self.routes.iter().enumerate().filter(|(_, r)| !r.auth) {
            for (j, guarded) in self.routes.iter().enumerate().filter(|(_, r)| r.auth) {
                if let (Some(Some(a)), Some(Some(b))) = (shapes.get(i), shapes.get(j)) {
                    if a.overlaps(b) {
                        out.push(format!(
                            "routes[{i}] ({}) has no auth but produces keys that routes[{j}] ({}, auth = true) \
                             also produces: a client without a principal can move their fences there",
                            open.route_name(i),
                            guarded.route_name(j)
                        ));
                    }
                }
            }
        }
        if let Some(p) = self.cluster.as_ref().map(|c| &c.prefix).filter(|p| !p.ends_with('/')) {
            out.push(format!(
                "cluster.prefix {p:?} does not end in '/': the keys of a deployment on a prefix that starts \
                 with it (\"{p}-b/\") are under it too, and `raise-floor --raft-pad` counts them as this \
                 deployment's; end it in '/'"
            ));
        }
        out
    }
}

impl RouteConfig {
    /// `--upstream URL` (docs/running.md): everything, keyed by the path.
    pub fn catch_all(upstream: String) -> RouteConfig {
        RouteConfig {
            name: Some("default".into()),
            match_path: "/{*path}".into(),
            resource: None,
            upstream,
            read_methods: default_read_methods(),
            removed_mutating_methods: Removed,
            trailing_slash: TrailingSlash::Refuse,
            fence_authority: FenceAuthority::Embedded,
            max_token_step: default_max_token_step(),
            strict: true,
            enforce: true,
            upstream_timeout_ms: default_upstream_timeout_ms(),
            connect_timeout_ms: default_connect_timeout_ms(),
            max_body_bytes: default_max_body_bytes(),
            forward_fencing_token: true,
            host_header: HostHeader::Preserve,
            ca_file: None,
            client_cert_file: None,
            client_key_file: None,
            auth: false,
            kind: RouteKindName::Http,
            base_domains: Vec::new(),
            bucket_resource: None,
            max_scanned_body_bytes: default_max_scanned_body_bytes(),
            per_gateway: false,
        }
    }

    /// The `match` template in force: the configured one, or every path on
    /// an `s3` route that names none.
    pub fn effective_match(&self) -> &str {
        if self.match_path.is_empty() && self.kind == RouteKindName::S3 {
            "/{*path}"
        } else {
            &self.match_path
        }
    }

    /// The name in metrics and logs.
    pub fn route_name(&self, index: usize) -> String {
        self.name.clone().unwrap_or_else(|| format!("route{index}"))
    }

    fn validate(&self) -> Result<(), String> {
        if let Some(n) = &self.name {
            let ok = !n.is_empty()
                && n.len() <= 64
                && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
            if !ok {
                return Err(format!("name: {n:?} must be 1-64 of [A-Za-z0-9_-]"));
            }
        }
        if self.match_path.is_empty() && self.kind == RouteKindName::Http {
            return Err("match: required on an http route (a path template such as \"/{*path}\")".into());
        }
        let matcher = Template::parse_match(self.effective_match())
            .map_err(|e| format!("match: {:?}: {e}", self.effective_match()))?;
        // An s3 route's own settings are checked where its kind is built
        // (`app::check`).
        if self.kind != RouteKindName::S3 {
            if let Some(res) = &self.resource {
                Template::parse_resource(res, &matcher).map_err(|e| format!("resource: {res:?}: {e}"))?;
            }
            if !self.base_domains.is_empty() || self.bucket_resource.is_some() {
                return Err("base_domains, bucket_resource: only for kind = \"s3\" routes".into());
            }
        }
        for m in &self.read_methods {
            // Methods are case-sensitive and some backends fold them: an
            // entry like "put" would let a write pass as a read.
            if http::Method::from_bytes(m.as_bytes()).is_err() || m.to_ascii_uppercase() != *m {
                return Err(format!("read_methods: {m:?} is not an upper-case HTTP method"));
            }
        }
        if self.trailing_slash == TrailingSlash::Distinct && self.upstream.starts_with("file://") {
            return Err(
                "trailing_slash: \"distinct\" does not fit a file:// upstream: the built-in store has no object \
                 whose name ends in \"/\""
                    .into(),
            );
        }
        if self.upstream_timeout_ms == 0 {
            return Err("upstream_timeout_ms: must be at least 1".into());
        }
        if self.connect_timeout_ms == 0 {
            return Err("connect_timeout_ms: must be at least 1".into());
        }
        if self.max_token_step == 0 {
            return Err("max_token_step: must be at least 1".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_is_the_embedded_defaults() {
        let c = Config::from_toml("").unwrap();
        assert_eq!(c.listen.to_string(), "127.0.0.1:8080");
        assert_eq!(c.api_listen.to_string(), "127.0.0.1:7070");
        assert_eq!(c.data_dir, PathBuf::from("./fencegate-data"));
        c.validate().unwrap();
        let routes = c.effective_routes();
        assert_eq!(routes.len(), 1);
        assert!(routes[0].upstream.starts_with("file://"));
    }

    #[test]
    fn unknown_key_is_named() {
        let err = Config::from_toml("[locks]\nmax_ttl = 5\n").unwrap_err();
        assert!(err.contains("max_ttl"), "{err}");
    }

    #[test]
    fn s3_routes_default_their_match_and_refuse_what_breaks_signatures() {
        // The example file's commented S3 route, uncommented, is valid.
        let example = include_str!("../fencegate.example.toml");
        let start = example.find("# [[routes]]\n# name = \"s3\"").unwrap();
        let block: String = example[start..]
            .lines()
            .take_while(|l| l.starts_with('#'))
            .map(|l| l.trim_start_matches("# ").to_string() + "\n")
            .collect();
        let c: Config = toml::from_str(&block).unwrap();
        crate::app::check(&c).unwrap();
        assert_eq!(c.routes[0].kind, RouteKindName::S3);
        let bare: Config = toml::from_str("[[routes]]\nkind = \"s3\"\nupstream = \"http://127.0.0.1:9\"\n").unwrap();
        bare.validate().unwrap();
        assert_eq!(bare.routes[0].effective_match(), "/{*path}");
        for (extra, key) in [
            ("host_header = \"rewrite\"", "host_header"),
            ("forward_fencing_token = false", "forward_fencing_token"),
            ("base_domains = [\"a b\"]", "base_domains"),
        ] {
            let text = format!("[[routes]]\nkind = \"s3\"\nupstream = \"http://127.0.0.1:9\"\n{extra}\n");
            let err = crate::app::check(&toml::from_str::<Config>(&text).unwrap()).unwrap_err().to_string();
            assert!(err.contains(key), "{err}");
        }
        let http_no_match: Config = toml::from_str("[[routes]]\nupstream = \"http://127.0.0.1:9\"\n").unwrap();
        assert!(http_no_match.validate().unwrap_err().contains("match"));
        let http_domains: Config = toml::from_str(
            "[[routes]]\nmatch = \"/{*p}\"\nupstream = \"http://127.0.0.1:9\"\nbase_domains = [\"x\"]\n",
        )
        .unwrap();
        assert!(http_domains.validate().is_err());
    }

    #[test]
    fn bad_route_names_the_key() {
        let text = r#"
[[routes]]
match = "/a/{id}"
resource = "a/{nope}"
upstream = "http://127.0.0.1:9"
"#;
        let c = Config::from_toml(text).unwrap();
        let err = c.validate().unwrap_err();
        assert!(err.starts_with("routes[0].resource"), "{err}");
    }

    #[test]
    fn flags_override_the_file() {
        let mut c = Config::from_toml("listen = \"127.0.0.1:1\"").unwrap();
        c.apply(Overrides {
            listen: Some("127.0.0.1:2".parse().unwrap()),
            upstream: Some("http://127.0.0.1:9000".into()),
            ..Default::default()
        });
        assert_eq!(c.listen.port(), 2);
        assert_eq!(c.routes.len(), 1);
        assert_eq!(c.routes[0].match_path, "/{*path}");
    }

    #[test]
    fn upstream_timeout_must_be_below_the_activation_timeout() {
        let text = "[locks]\nactivation_timeout_ms = 5000\n[[routes]]\nmatch = \"/{*p}\"\nupstream = \"http://127.0.0.1:9\"\nupstream_timeout_ms = 5000\n";
        let err = Config::from_toml(text).unwrap().validate().unwrap_err();
        assert!(err.starts_with("routes[0].upstream_timeout_ms"), "{err}");
        assert!(err.contains("locks.activation_timeout_ms"), "{err}");
        let ok = text.replace("upstream_timeout_ms = 5000", "upstream_timeout_ms = 4999");
        Config::from_toml(&ok).unwrap().validate().unwrap();
    }

    #[test]
    fn ttl_bounds_must_be_ordered() {
        let c = Config::from_toml("[locks]\nmin_ttl_ms = 10\nmax_ttl_ms = 5\n").unwrap();
        assert!(c.validate().unwrap_err().starts_with("locks.max_ttl_ms"));
        let c = Config::from_toml("[locks]\nmax_ttl_ms = 2147483648\n").unwrap();
        assert!(c.validate().unwrap_err().starts_with("locks.max_ttl_ms: at most 2147483647"));
        let c = Config::from_toml("[locks]\nmax_ttl_ms = 2147483647\n").unwrap();
        assert!(c.validate().is_ok());
    }

    #[test]
    fn mutating_methods_is_refused_with_a_hint_naming_read_methods() {
        let text = "[[routes]]\nmatch = \"/{*p}\"\nupstream = \"http://127.0.0.1:9\"\nmutating_methods = [\"PUT\"]\n";
        let err = Config::from_toml(text).unwrap_err();
        assert!(err.contains("mutating_methods was removed"), "{err}");
        assert!(err.contains("read_methods"), "{err}");
        assert!(err.contains("line 4"), "{err}");
    }

    #[test]
    fn read_methods_default_to_get_head_options_and_must_be_upper_case() {
        let c = Config::from_toml("[[routes]]\nmatch = \"/{*p}\"\nupstream = \"http://127.0.0.1:9\"\n").unwrap();
        assert_eq!(c.routes[0].read_methods, ["GET", "HEAD", "OPTIONS"]);
        assert_eq!(c.routes[0].trailing_slash, TrailingSlash::Refuse);
        c.validate().unwrap();
        let text = "[[routes]]\nmatch = \"/{*p}\"\nupstream = \"http://127.0.0.1:9\"\nread_methods = [\"GET\", \"propfind\"]\n";
        let err = Config::from_toml(text).unwrap().validate().unwrap_err();
        assert!(err.starts_with("routes[0].read_methods"), "{err}");
    }

    #[test]
    fn trailing_slash_distinct_is_for_http_upstreams_only() {
        let route =
            |up: &str| format!("[[routes]]\nmatch = \"/{{*p}}\"\nupstream = \"{up}\"\ntrailing_slash = \"distinct\"\n");
        let c = Config::from_toml(&route("http://127.0.0.1:9")).unwrap();
        assert_eq!(c.routes[0].trailing_slash, TrailingSlash::Distinct);
        c.validate().unwrap();
        let err = Config::from_toml(&route("file:///tmp/x")).unwrap().validate().unwrap_err();
        assert!(err.starts_with("routes[0].trailing_slash"), "{err}");
        assert!(Config::from_toml(&route("http://127.0.0.1:9").replace("distinct", "keep")).is_err());
    }

    #[test]
    fn open_route_over_auth_keys_is_warned_about() {
        let text = r#"
[auth]
[[routes]]
match = "/invoices/{*rest}"
upstream = "http://127.0.0.1:9"
auth = true
[[routes]]
match = "/orders/{*rest}"
upstream = "http://127.0.0.1:9"
[[routes]]
name = "rest"
match = "/{*path}"
upstream = "http://127.0.0.1:9"
"#;
        let c = Config::from_toml(text).unwrap();
        let w = c.warnings();
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].starts_with("routes[2] (rest)") && w[0].contains("routes[0]"), "{w:?}");
    }

    #[test]
    fn a_cluster_prefix_without_a_trailing_slash_is_warned_about() {
        let cluster =
            |prefix: &str| format!("[cluster]\netcd_endpoints = [\"http://127.0.0.1:2379\"]\nprefix = \"{prefix}\"\n");
        let w = Config::from_toml(&cluster("/fencegate")).unwrap().warnings();
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].starts_with("cluster.prefix \"/fencegate\" does not end in '/'"), "{w:?}");
        assert!(Config::from_toml(&cluster("/fencegate/")).unwrap().warnings().is_empty());
    }
}
