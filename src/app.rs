//! Wiring: from a validated [`Config`] to a running gateway — the store,
//! the fence table rebuilt from it, the authority with its restored
//! grants, the proxy, both listeners and the expiry task. Used by
//! `fencegate serve` and by in-process tests alike.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::task::JoinSet;

use crate::api::Api;
use crate::auth::Auth;
use crate::authority::Authority;
use crate::config::Config;
use crate::error::Error;
use crate::fence::FenceTable;
use crate::leases::Leases;
use crate::metrics::Metrics;
use crate::proxy::Proxy;
use crate::server::{self, FastPath, Handler, Limits};
use crate::shutdown::{self, Shutdown, Trigger};
use crate::store::{Store, SyncObserver, WriterOptions};
use crate::tls::Reloadable;

/// Re-reads certificate files on SIGHUP; open connections are untouched.
async fn reload_on_sighup(tls: Vec<Arc<Reloadable>>, stop: crate::shutdown::Shutdown) {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut hup) = signal(SignalKind::hangup()) else {
        tracing::warn!("cannot listen for SIGHUP; certificates will not be reloaded");
        return;
    };
    loop {
        tokio::select! {
            got = hup.recv() => {
                if got.is_none() {
                    return;
                }
                for t in &tls {
                    match t.reload() {
                        Ok(()) => tracing::info!("TLS certificates reloaded"),
                        Err(e) => tracing::error!(error = %e, "TLS reload failed; keeping the old certificates"),
                    }
                }
            }
            () = stop.wait() => return,
        }
    }
}

/// A running gateway.
#[derive(Debug)]
pub struct Gateway {
    /// Where the proxy listener is bound.
    pub proxy_addr: SocketAddr,
    /// Where the api listener is bound.
    pub api_addr: SocketAddr,
    /// Shared handles, for in-process tests.
    pub authority: Leases,
    pub metrics: Arc<Metrics>,
    store: Store,
    fences: Arc<FenceTable>,
    /// The longest upstream timeout of any route: how long a forwarded
    /// mutation can stay in flight.
    longest_upstream_timeout: Duration,
    trigger: Trigger,
    /// Ends the cluster's own loops (watch, acknowledgements, membership)
    /// once the drain is over: a draining member keeps acknowledging
    /// fences (after its older in-flight mutations, as always), so peers'
    /// grants do not wait for its membership to lapse.
    cluster_trigger: Trigger,
    /// Each task ends with true if it stopped cleanly (listeners: drained).
    tasks: JoinSet<bool>,
}

/// Every check a start makes before it binds a socket or opens the store
/// (so that a bad configuration never counts a boot): the configuration's
/// own ([`Config::validate`]), then what it names — the TLS certificates
/// and keys, the principals file, each route's upstream URL and kind. `check-config`
/// runs exactly this.
pub fn check(cfg: &Config) -> Result<(), Error> {
    cfg.validate().map_err(Error::Config)?;
    for (name, tls) in [("server.proxy_tls", &cfg.server.proxy_tls), ("server.api_tls", &cfg.server.api_tls)] {
        if let Some(t) = tls {
            crate::tls::server_config(t).map_err(|e| Error::Config(format!("{name}: {e}")))?;
        }
    }
    Auth::load(&cfg.auth).map_err(|e| Error::Config(format!("auth.principals_file: {e}")))?;
    for (i, r) in cfg.routes.iter().enumerate() {
        crate::proxy::upstream::UpstreamUrl::parse(&r.upstream)
            .map_err(|e| Error::Config(format!("routes[{i}].upstream: {:?}: {e}", r.upstream)))?;
        if r.kind == crate::config::RouteKindName::S3 {
            crate::proxy::s3::S3Kind::from_config(r).map_err(|e| Error::Config(format!("routes[{i}].{e}")))?;
        }
    }
    Ok(())
}

impl Gateway {
    /// Binds both listeners, opens the store, rebuilds the fence table,
    /// restores live grants and starts serving.
    ///
    /// The future is boxed here, at the crate boundary (as is [`Gateway::wait`]'s):
    /// awaited as a concrete type from another crate (the binary, an example,
    /// a test) rustc would compile the whole gateway's async code again in that
    /// crate; behind a `dyn Future` it is compiled once, in this one.
    #[inline(never)]
    pub fn start(cfg: Config) -> Pin<Box<dyn Future<Output = Result<Gateway, Error>> + Send>> {
        Box::pin(Self::start_inner(cfg))
    }

    async fn start_inner(cfg: Config) -> Result<Gateway, Error> {
        check(&cfg)?;
        // Bind first: a port already in use must fail the start before the
        // store counts a boot (an aborted start is not an unclean stop, and
        // must not put the next start in quarantine). Connections made
        // meanwhile wait in the backlog until serving starts.
        let bind = |addr: SocketAddr| async move {
            TcpListener::bind(addr).await.map_err(|e| Error::Internal(format!("binding {addr}: {e}")))
        };
        let proxy_listener = bind(cfg.listen).await?;
        let api_listener = bind(cfg.api_listen).await?;
        let metrics = Arc::new(Metrics::new().map_err(|e| Error::Internal(format!("metrics: {e}")))?);
        let store = open_store(&cfg, &metrics)?;

        let started = std::time::Instant::now();
        let fences = FenceTable::with_capacity(store.estimated_fences());
        store.for_each_fence(|key, record| fences.load_record(key, record))?;
        fences.set_max_fences(cfg.locks.max_fences);
        let (trigger, stop) = shutdown::channel();
        let (cluster_trigger, cluster_stop) = shutdown::channel();
        let authority = start_authority(&cfg, &fences, &store, &metrics, &cluster_stop, started).await?;
        let auth = Arc::new(Auth::load(&cfg.auth)?);
        let proxy = Arc::new(Proxy::new(&cfg, authority.clone(), store.clone(), metrics.clone(), auth.clone())?);

        let longest_upstream_timeout = Duration::from_millis(longest_upstream_timeout_ms(&cfg, false));
        if !store.was_clean() {
            quarantine_after_unclean_stop(&cfg, &fences);
        }
        let proxy_addr = proxy_listener.local_addr().map_err(|e| Error::Internal(e.to_string()))?;
        let api_addr = api_listener.local_addr().map_err(|e| Error::Internal(e.to_string()))?;

        let limits = listener_limits(&cfg);
        let api = Arc::new(Api {
            authority: authority.clone(),
            metrics: metrics.clone(),
            max_body_bytes: cfg.server.api_max_body_bytes,
            body_read_timeout: Duration::from_millis(cfg.server.body_read_timeout_ms),
            shutdown: stop.clone(),
            auth: auth.clone(),
            waiting: Arc::new(crate::api::WaitingPerPrincipal::new(cfg.locks.max_waiters_per_principal)),
            watching: Arc::new(crate::api::WaitingPerPrincipal::new(cfg.locks.max_watches_per_principal)),
            fences: Arc::new(crate::api::FencesPerPrincipal::count(&auth, &fences, cfg.locks.max_fences_per_principal)),
        });
        let api_handler: Handler = Arc::new(move |req, client| {
            let api = api.clone();
            Box::pin(async move { api.handle(req, client).await })
        });
        let proxy_fast = proxy.clone();
        let proxy_handler: Handler = Arc::new(move |req, client| {
            let proxy = proxy.clone();
            Box::pin(async move { proxy.handle(req, client).await })
        });

        let proxy_tls = cfg.server.proxy_tls.clone().map(Reloadable::load).transpose()?;
        let api_tls = cfg.server.api_tls.clone().map(Reloadable::load).transpose()?;
        let mut tasks = JoinSet::new();
        let reloadables: Vec<_> = proxy_tls.iter().chain(api_tls.iter()).cloned().collect();
        if !reloadables.is_empty() {
            let stop = stop.clone();
            tasks.spawn(async move {
                reload_on_sighup(reloadables, stop).await;
                true
            });
        }
        let proxy_fast = if cfg.server.proxy_fast_path { FastPath::Proxy(proxy_fast) } else { FastPath::Off };
        let api_fast = if cfg.server.api_fast_path {
            FastPath::Handler { max_body_bytes: cfg.server.api_max_body_bytes }
        } else {
            FastPath::Off
        };
        tasks.spawn(server::serve("proxy", proxy_listener, proxy_handler, limits, proxy_tls, stop.clone(), proxy_fast));
        tasks.spawn(server::serve("api", api_listener, api_handler, limits, api_tls, stop.clone(), api_fast));
        if let Leases::Embedded(embedded) = &authority {
            let expiry = embedded.clone().run_expiry(stop);
            tasks.spawn(async move {
                expiry.await;
                true
            });
        }
        tracing::info!(proxy = %proxy_addr, api = %api_addr, data_dir = %cfg.data_dir.display(), "fencegate serving");
        Ok(Gateway {
            proxy_addr,
            api_addr,
            authority,
            metrics,
            store,
            fences,
            longest_upstream_timeout,
            trigger,
            cluster_trigger,
            tasks,
        })
    }

    /// Starts graceful shutdown.
    pub fn shutdown(&self) {
        self.trigger.trigger();
    }

    /// Waits until every listener has drained, every task has ended and no
    /// mutation is in flight to an upstream, then records the clean stop (a
    /// next start needs no quarantine).
    ///
    /// Connections are not the whole story: a registered mutation's
    /// exchange outlives its client (it runs as its own task), so a client
    /// that gave up leaves a write the upstream may still apply. The stop
    /// is clean only once every such registration has ended — waited for
    /// up to the longest upstream timeout; cut short, the stop is not
    /// recorded as clean and the next start quarantines.
    #[inline(never)]
    pub fn wait(self) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(self.wait_inner())
    }

    async fn wait_inner(mut self) {
        let mut clean = true;
        while let Some(done) = self.tasks.join_next().await {
            clean &= done.unwrap_or(false);
        }
        let inflight = self.fences.inflight_total();
        if inflight > 0 {
            tracing::info!(inflight, "waiting for mutations still in flight to an upstream");
        }
        // A little beyond the timeout: the exchange that times out drops
        // its registration just after it.
        let bound = self.longest_upstream_timeout + Duration::from_millis(500);
        if !self.fences.wait_idle(bound).await {
            tracing::warn!(
                inflight = self.fences.inflight_total(),
                "mutations still in flight at the stop: not recorded as clean"
            );
            clean = false;
        }
        match &self.authority {
            // Peers need not quarantine a member that drained.
            Leases::Cluster(c) if clean => c.leave().await,
            Leases::Cluster(_) => {}
            // Ended before the clean stop is written: a restart must not
            // bring back a lease already refused as expired.
            Leases::Embedded(a) => a.end_overdue(),
        }
        self.cluster_trigger.trigger();
        if !clean {
            tracing::warn!("not every request drained: the next start will wait out the upstream timeout");
        } else if let Err(e) = self.store.mark_clean().await {
            tracing::error!(error = %e, "could not record the clean stop");
        }
    }
}

/// The store, with its fsync times observed by the metrics.
fn open_store(cfg: &Config, metrics: &Metrics) -> Result<Store, Error> {
    let sync_hist = metrics.store_sync_duration.clone();
    let observe: SyncObserver = Arc::new(move |d, _n| sync_hist.observe(d.as_secs_f64()));
    let writer = WriterOptions {
        group_commit: cfg.store.group_commit,
        max_batch: cfg.store.max_batch,
        nice: cfg.store.writer_nice,
        background_write_bytes_per_sec: cfg.store.background_write_bytes_per_sec,
    };
    Store::open(&cfg.data_dir, writer, observe)
}

/// The lease service: the embedded authority restored from the store, or
/// (cluster mode) the etcd authority after joining the cluster.
async fn start_authority(
    cfg: &Config,
    fences: &Arc<FenceTable>,
    store: &Store,
    metrics: &Arc<Metrics>,
    stop: &Shutdown,
    started: std::time::Instant,
) -> Result<Leases, Error> {
    // The cluster series exist in every mode, so one dashboard fits both
    // (docs/metrics.md): a single node is never a member and always current.
    metrics.register_cluster().map_err(|e| Error::Internal(format!("metrics: {e}")))?;
    let authority = match &cfg.cluster {
        None => {
            metrics.cluster_current.set(1);
            let authority = Authority::restore(fences.clone(), store.clone(), metrics.clone(), cfg.locks.clone())?;
            tracing::info!(
                fences = fences.len(),
                live_grants = authority.live_grants(),
                boots = store.boots()?,
                elapsed_ms = started.elapsed().as_millis() as u64,
                "fence table rebuilt from the store"
            );
            Leases::Embedded(authority)
        }
        Some(cluster) => {
            let longest = longest_upstream_timeout_ms(cfg, false);
            let start = crate::cluster::Start {
                cfg: cluster.clone(),
                gateway_id: cluster.gateway_id(cfg.listen),
                fences: fences.clone(),
                metrics: metrics.clone(),
                limits: cfg.locks.clone(),
                // A little beyond the timeout: the exchange that times
                // out is over just after it.
                quarantine: Duration::from_millis(longest + 500),
                data_dir: cfg.data_dir.clone(),
                stop: stop.clone(),
            };
            Leases::Cluster(crate::cluster::Cluster::start(start).await?)
        }
    };
    Ok(authority)
}

/// The longest `upstream_timeout_ms` of any route (`http_only`: of routes
/// to an HTTP upstream, parsed, not matched as text: `HTTP://` is one too).
fn longest_upstream_timeout_ms(cfg: &Config, http_only: bool) -> u64 {
    cfg.effective_routes()
        .iter()
        .filter(|r| {
            !http_only
                || matches!(
                    crate::proxy::upstream::UpstreamUrl::parse(&r.upstream),
                    Ok(crate::proxy::upstream::UpstreamUrl::Http { .. })
                )
        })
        .map(|r| r.upstream_timeout_ms)
        .max()
        .unwrap_or(0)
}

/// The previous process died: requests it forwarded to an HTTP upstream
/// may be applied for up to that route's timeout, so new grants and fence
/// advances wait until then.
fn quarantine_after_unclean_stop(cfg: &Config, fences: &FenceTable) {
    let longest = longest_upstream_timeout_ms(cfg, true);
    if longest > 0 {
        fences.set_quarantine(tokio::time::Instant::now() + Duration::from_millis(longest));
        tracing::warn!(
            quarantine_ms = longest,
            "the previous process did not stop cleanly: new grants and fence advances wait until its \
             forwarded requests can no longer be applied"
        );
    }
}

/// The listeners' limits from `[server]`.
fn listener_limits(cfg: &Config) -> Limits {
    Limits {
        max_connections: cfg.server.max_connections,
        max_connections_per_address: cfg.server.max_connections_per_address,
        max_header_bytes: cfg.server.max_header_bytes,
        header_read_timeout: Duration::from_millis(cfg.server.header_read_timeout_ms),
        body_read_timeout: Duration::from_millis(cfg.server.body_read_timeout_ms),
        shutdown_grace: Duration::from_millis(cfg.server.shutdown_grace_ms),
        idle_timeout: Duration::from_millis(cfg.server.idle_timeout_ms),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_upstream_scheme_is_refused_before_anything_is_bound() {
        let text = "[[routes]]\nmatch = \"/{*p}\"\nupstream = \"ftp://x\"\n";
        let cfg = Config::from_toml(text).unwrap();
        cfg.validate().unwrap();
        let err = check(&cfg).unwrap_err().to_string();
        assert!(err.starts_with("routes[0].upstream"), "{err}");
    }
}
