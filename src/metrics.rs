//! Every Prometheus handle fencegate exports, in one struct, and the text
//! rendering of `GET /metrics`.
//!
//! Names, types and labels are those of docs/metrics.md (plus the zombie
//! telemetry below them). Labels are route names and fixed outcome words
//! only — never keys, paths, tokens or lease ids — so cardinality stays
//! bounded by the configuration.

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
    TextEncoder,
};

/// Buckets from 10 µs to 2 min: resolve a fence check or an fsync as well
/// as a lock wait.
const BUCKETS: &[f64] = &[
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// Buckets for lease-scale durations (100 ms … 1 h).
const LEASE_BUCKETS: &[f64] =
    &[0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0];

/// Every metric handle. Cheap to share behind an `Arc`.
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    /// The series of every known lease API call outcome, resolved once
    /// (a label lookup per call costs more than the count).
    lock_request_series: Vec<(&'static str, &'static str, IntCounter)>,
    /// `request_duration{listener="api", route}` per api endpoint.
    api_duration_series: Vec<(&'static str, Histogram)>,
    /// `route`, `outcome`.
    pub mutations: IntCounterVec,
    /// `op`, `outcome`.
    pub lock_requests: IntCounterVec,
    pub leases_active: IntGauge,
    pub lease_expirations: IntCounter,
    pub fence_advances: IntCounter,
    /// `listener`, `route`.
    pub request_duration: HistogramVec,
    /// `route`.
    pub upstream_duration: HistogramVec,
    pub store_sync_duration: Histogram,
    pub activation_wait: Histogram,
    /// Stale writes: time since the fence last moved.
    pub stale_write_age: HistogramVec,
    /// `outcome` = granted, timeout, abandoned.
    pub lock_wait: HistogramVec,
    pub renew_margin: Histogram,
    /// Time left on a lease when renewed, as a fraction of its TTL.
    pub renew_margin_ratio: Histogram,
    pub lease_holds: Histogram,
    pub grants: IntCounter,
    /// Older uploads aborted by activation, by route.
    pub aborted_uploads: IntCounterVec,
    /// Activations that gave up waiting for older in-flight mutations.
    pub activation_overruns: IntCounter,
    /// Waiters currently queued across all keys.
    pub lock_waiters: IntGauge,
    /// Cluster mode (registered by [`Metrics::register_cluster`] in every
    /// mode): live members as this gateway's watch sees them; 0 in
    /// single-node mode.
    pub cluster_members: IntGauge,
    /// Cluster mode: 1 while this gateway can prove its fences current
    /// (always 1 in single-node mode).
    pub cluster_current: IntGauge,
    /// Cluster mode: reloads of the fences after a broken watch.
    pub cluster_resyncs: IntCounter,
    pub cluster_etcd_member: IntGaugeVec,
    pub cluster_etcd_moves: IntCounter,
    pub cluster_lapses: IntCounterVec,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

/// The api listener's endpoint names (the `route` label of its requests).
const API_ENDPOINTS: [&str; 10] =
    ["acquire", "renew", "release", "batch", "status", "watch", "metrics", "healthz", "readyz", "none"];

fn hist(name: &str, help: &str, buckets: &[f64]) -> HistogramOpts {
    HistogramOpts::new(name, help).buckets(buckets.to_vec())
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Result<Metrics, prometheus::Error> {
        let registry = Registry::new();
        let mut m = Metrics {
            lock_request_series: Vec::new(),
            api_duration_series: Vec::new(),
            mutations: IntCounterVec::new(
                Opts::new("fencegate_mutations_total", "Mutations seen by the proxy, by route and outcome."),
                &["route", "outcome"],
            )?,
            lock_requests: IntCounterVec::new(
                Opts::new("fencegate_lock_requests_total", "Lease API calls by operation and outcome."),
                &["op", "outcome"],
            )?,
            leases_active: IntGauge::new("fencegate_leases_active", "Grants currently live.")?,
            cluster_members: IntGauge::new(
                "fencegate_cluster_members",
                "Cluster mode: live gateways seen by this gateway's etcd watch.",
            )?,
            cluster_current: IntGauge::new(
                "fencegate_cluster_current",
                "Cluster mode: 1 while this gateway can prove its fences are current (else it refuses mutations).",
            )?,
            cluster_resyncs: IntCounter::new(
                "fencegate_cluster_resyncs_total",
                "Cluster mode: full reloads of the fences after the etcd watch broke.",
            )?,
            cluster_etcd_member: IntGaugeVec::new(
                Opts::new(
                    "fencegate_cluster_etcd_member",
                    "Cluster mode: 1 for the configured etcd endpoint this gateway's requests go to, 0 for the others.",
                ),
                &["endpoint"],
            )?,
            cluster_etcd_moves: IntCounter::new(
                "fencegate_cluster_etcd_moves_total",
                "Cluster mode: moves to the next etcd member after one refused, had no leader or did not answer.",
            )?,
            cluster_lapses: IntCounterVec::new(
                Opts::new(
                    "fencegate_cluster_lapses_total",
                    "Cluster mode: memberships this gateway ended without a clean stop, by outcome: drained (nothing \
                     admitted before was in flight: peers wait no quarantine) or quarantined.",
                ),
                &["outcome"],
            )?,
            lease_expirations: IntCounter::new(
                "fencegate_lease_expirations_total",
                "Grants that ended because their TTL passed without renewal.",
            )?,
            fence_advances: IntCounter::new(
                "fencegate_fence_advances_total",
                "Times a fence moved (grants and external tokens).",
            )?,
            request_duration: HistogramVec::new(
                hist("fencegate_request_duration_seconds", "Request latency by listener and route.", BUCKETS),
                &["listener", "route"],
            )?,
            upstream_duration: HistogramVec::new(
                hist("fencegate_upstream_duration_seconds", "Upstream latency until response head, by route.", BUCKETS),
                &["route"],
            )?,
            store_sync_duration: Histogram::with_opts(hist(
                "fencegate_store_sync_duration_seconds",
                "Duration of one group commit (write + fsync).",
                BUCKETS,
            ))?,
            activation_wait: Histogram::with_opts(hist(
                "fencegate_activation_wait_seconds",
                "Time a new fence waited for older in-flight mutations.",
                BUCKETS,
            ))?,
            stale_write_age: HistogramVec::new(
                hist(
                    "fencegate_stale_write_age_seconds",
                    "For each refused stale write, time since its token was superseded (at least).",
                    LEASE_BUCKETS,
                ),
                &["route"],
            )?,
            lock_wait: HistogramVec::new(
                hist("fencegate_lock_wait_seconds", "Time queued waiters waited, by outcome.", BUCKETS),
                &["outcome"],
            )?,
            renew_margin: Histogram::with_opts(hist(
                "fencegate_renew_margin_seconds",
                "Time left on a lease when it was renewed.",
                LEASE_BUCKETS,
            ))?,
            renew_margin_ratio: Histogram::with_opts(hist(
                "fencegate_renew_margin_ratio",
                "Time left on a lease when it was renewed, as a fraction of its TTL.",
                &[0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0],
            ))?,
            lease_holds: Histogram::with_opts(hist(
                "fencegate_lease_holds_seconds",
                "How long grants were held, from grant to release or expiry.",
                LEASE_BUCKETS,
            ))?,
            grants: IntCounter::new("fencegate_grants_total", "Grants issued.")?,
            aborted_uploads: IntCounterVec::new(
                Opts::new(
                    "fencegate_aborted_uploads_total",
                    "Older uploads aborted mid-body because a newer fence was installed.",
                ),
                &["route"],
            )?,
            activation_overruns: IntCounter::new(
                "fencegate_activation_overruns_total",
                "Activations that stopped waiting for older in-flight mutations at their timeout.",
            )?,
            lock_waiters: IntGauge::new("fencegate_lock_waiters", "Clients queued for a lock.")?,
            registry,
        };
        let r = &m.registry;
        r.register(Box::new(m.mutations.clone()))?;
        r.register(Box::new(m.lock_requests.clone()))?;
        r.register(Box::new(m.leases_active.clone()))?;
        r.register(Box::new(m.lease_expirations.clone()))?;
        r.register(Box::new(m.fence_advances.clone()))?;
        r.register(Box::new(m.request_duration.clone()))?;
        r.register(Box::new(m.upstream_duration.clone()))?;
        r.register(Box::new(m.store_sync_duration.clone()))?;
        r.register(Box::new(m.activation_wait.clone()))?;
        r.register(Box::new(m.stale_write_age.clone()))?;
        r.register(Box::new(m.lock_wait.clone()))?;
        r.register(Box::new(m.renew_margin.clone()))?;
        r.register(Box::new(m.lease_holds.clone()))?;
        r.register(Box::new(m.renew_margin_ratio.clone()))?;
        r.register(Box::new(m.grants.clone()))?;
        r.register(Box::new(m.aborted_uploads.clone()))?;
        r.register(Box::new(m.activation_overruns.clone()))?;
        r.register(Box::new(m.lock_waiters.clone()))?;
        // Make every lock outcome visible from the first scrape, so rate()
        // over a fresh gateway is 0 rather than absent.
        for op in ["acquire", "renew", "release"] {
            for outcome in ["ok", "locked", "lost", "not_owner", "invalid"] {
                let series = m.lock_requests.with_label_values(&[op, outcome]);
                m.lock_request_series.push((op, outcome, series));
            }
        }
        // The same for the lock wait quantiles: a fresh gateway shows 0,
        // not "No data", until somebody has waited.
        for outcome in ["granted", "timeout"] {
            m.lock_wait.with_label_values(&[outcome]);
        }
        for outcome in ["drained", "quarantined"] {
            m.cluster_lapses.with_label_values(&[outcome]);
        }
        for endpoint in API_ENDPOINTS {
            let series = m.request_duration.with_label_values(&["api", endpoint]);
            m.api_duration_series.push((endpoint, series));
        }
        Ok(m)
    }

    /// Counts one lease API call.
    pub fn lock_request(&self, op: &str, outcome: &str) {
        match self.lock_request_series.iter().find(|(o, r, _)| *o == op && *r == outcome) {
            Some((_, _, series)) => series.inc(),
            None => self.lock_requests.with_label_values(&[op, outcome]).inc(),
        }
    }

    /// Observes one api request's latency under its endpoint's name.
    pub fn observe_api_request(&self, endpoint: &str, seconds: f64) {
        match self.api_duration_series.iter().find(|(e, _)| *e == endpoint) {
            Some((_, series)) => series.observe(seconds),
            None => self.request_duration.with_label_values(&["api", endpoint]).observe(seconds),
        }
    }

    /// Registers the cluster-mode series. Called in every mode, so one
    /// dashboard serves both (single-node: members 0, current 1).
    pub fn register_cluster(&self) -> Result<(), prometheus::Error> {
        self.registry.register(Box::new(self.cluster_members.clone()))?;
        self.registry.register(Box::new(self.cluster_current.clone()))?;
        self.registry.register(Box::new(self.cluster_resyncs.clone()))?;
        self.registry.register(Box::new(self.cluster_etcd_member.clone()))?;
        self.registry.register(Box::new(self.cluster_etcd_moves.clone()))?;
        self.registry.register(Box::new(self.cluster_lapses.clone()))?;
        Ok(())
    }

    /// Pre-creates the series of one route so dashboards see zeros.
    pub fn register_route(&self, route: &str) {
        for outcome in Outcome::ALL {
            self.mutations.with_label_values(&[route, outcome.label()]);
        }
        self.aborted_uploads.with_label_values(&[route]);
        self.stale_write_age.with_label_values(&[route]);
    }

    /// One route's mutation counters, one per [`Outcome`], resolved once at
    /// start so that counting a request looks nothing up.
    pub fn mutation_counters(&self, route: &str) -> MutationCounters {
        MutationCounters(Outcome::ALL.map(|o| self.mutations.with_label_values(&[route, o.label()])))
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> Result<String, prometheus::Error> {
        let mut buf = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut buf)?;
        String::from_utf8(buf).map_err(|e| prometheus::Error::Msg(e.to_string()))
    }
}

/// What became of a mutation: the `outcome` label of
/// `fencegate_mutations_total` (docs/metrics.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Forwarded,
    Stale,
    Unissued,
    LeaseExpired,
    StaleSequence,
    QuotaExceeded,
    NotCurrent,
    MissingToken,
    MalformedToken,
    UpstreamError,
}

impl Outcome {
    /// Every outcome, in the order of [`MutationCounters`].
    pub const ALL: [Outcome; 10] = [
        Outcome::Forwarded,
        Outcome::Stale,
        Outcome::Unissued,
        Outcome::LeaseExpired,
        Outcome::StaleSequence,
        Outcome::QuotaExceeded,
        Outcome::NotCurrent,
        Outcome::MissingToken,
        Outcome::MalformedToken,
        Outcome::UpstreamError,
    ];

    /// The label value, exactly as docs/metrics.md names it.
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Forwarded => "forwarded",
            Outcome::Stale => "stale",
            Outcome::Unissued => "unissued",
            Outcome::LeaseExpired => "lease_expired",
            Outcome::StaleSequence => "stale_sequence",
            Outcome::QuotaExceeded => "quota_exceeded",
            Outcome::NotCurrent => "not_current",
            Outcome::MissingToken => "missing_token",
            Outcome::MalformedToken => "malformed_token",
            Outcome::UpstreamError => "upstream_error",
        }
    }
}

/// One route's `fencegate_mutations_total` counters, one per [`Outcome`].
#[derive(Debug, Clone)]
pub struct MutationCounters([IntCounter; 10]);

impl MutationCounters {
    /// Counts one mutation with this outcome.
    pub fn inc(&self, outcome: Outcome) {
        // `ALL` lists the variants in declaration order, so the
        // discriminant is the index.
        self.0[outcome as usize].inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcome_counters_are_indexed_by_declaration_order() {
        for (i, o) in Outcome::ALL.into_iter().enumerate() {
            assert_eq!(o as usize, i, "{o:?}");
        }
        let m = Metrics::new().unwrap();
        m.register_route("r");
        let counters = m.mutation_counters("r");
        counters.inc(Outcome::Stale);
        let text = m.render().unwrap();
        assert!(text.contains("fencegate_mutations_total{outcome=\"stale\",route=\"r\"} 1"), "{text}");
    }

    #[test]
    fn spec_metric_names_are_exported() {
        let m = Metrics::new().unwrap();
        m.register_route("default");
        m.store_sync_duration.observe(0.001);
        m.activation_wait.observe(0.0);
        m.request_duration.with_label_values(&["api", "acquire"]).observe(0.001);
        m.upstream_duration.with_label_values(&["default"]).observe(0.001);
        let text = m.render().unwrap();
        for name in [
            "fencegate_mutations_total",
            "fencegate_lock_requests_total",
            "fencegate_leases_active",
            "fencegate_lease_expirations_total",
            "fencegate_fence_advances_total",
            "fencegate_request_duration_seconds_bucket",
            "fencegate_upstream_duration_seconds_bucket",
            "fencegate_store_sync_duration_seconds_bucket",
            "fencegate_activation_wait_seconds_bucket",
        ] {
            assert!(text.contains(name), "{name} missing");
        }
        assert!(text.contains("# TYPE fencegate_mutations_total counter"));
        assert!(text.contains("# TYPE fencegate_leases_active gauge"));
    }
}
