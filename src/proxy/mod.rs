//! The fenced reverse proxy (docs/proxy.md). One request's life, and the only
//! path that forwards a mutation:
//!
//! 1. `route`   — the path is checked (no aliases) and decoded, matched to
//!    a route, and mapped to a resource key; the method is classified once
//!    ([`Route::is_mutation`]: all but the route's read methods) and a
//!    mutation's trailing slash refused where the upstream folds it;
//!    on an S3 route ([`s3`]) the keys come from bucket, key, subresource
//!    and headers instead — for `DeleteObjects`/`PostObject` from a bounded
//!    copy of the body — and a request that changes several keys is
//!    admitted for all of them or none ([`FenceTable::admit_all`]);
//! 2. `admit`   — the token is parsed and compared with the key's fence;
//!    an admissible mutation is registered as in flight in the same atomic
//!    step (external routes first advance the fence durably and wait for
//!    older in-flight mutations);
//! 3. `forward` — headers are prepared and the body is streamed to the
//!    upstream, cut off if a newer fence arrives while it still streams;
//! 4. the in-flight guard drops when the upstream has answered;
//! 5. any refusal is rendered by `error`.

pub mod fast;
pub mod fenced_body;
pub mod filestore;
pub mod headers;
pub mod held_body;
pub mod path;
pub mod pool;
pub mod s3;
pub mod sendq;
pub mod upstream;
pub mod wire;

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use http::{Method, Request, Response};
use tokio::time::Instant;

use crate::auth::Auth;
use crate::authority::validate_key;
use crate::body::{content_length, BoxBody};
use crate::config::{Config, FenceAuthority, HostHeader, RouteKindName, TrailingSlash};
use crate::error::Error;
use crate::fence::token::TokenError;
use crate::fence::{parse_token_header, Admission, CheckPolicy, FenceTable, InflightCtl, InflightGuard, Refusal};
use crate::leases::Leases;
use crate::metrics::{Metrics, MutationCounters, Outcome};
use crate::peer::Peer;
use crate::store::{wait_durable, Store};
use crate::template::Template;
use fenced_body::{BodyOutcome, FencedBody, Unsettled};
use headers::{X_FENCING_SEQUENCE, X_FENCING_TOKEN};
use s3::S3Kind;
use upstream::{SendError, Upstream, UpstreamUrl};

/// How a route turns a request into the keys it touches: the route kind
/// seam. The kind classifies; the one admission decision
/// ([`Proxy::admit`] / [`FenceTable::admit`], or
/// [`FenceTable::admit_all`] for several keys) and the one forwarding path
/// stay the proxy's.
#[derive(Debug)]
enum Kind {
    /// Path templates: the key from the checked path and the `resource`
    /// template; mutations by method; the fast path may take it; the
    /// request-target goes upstream behind the upstream's prefix.
    Http { resource: Option<Template> },
    /// An S3-compatible store (docs/s3.md): keys from `Host`, path, query
    /// and — for `DeleteObjects` and `PostObject` — a bounded copy of the
    /// body; the general path only; the request-target, `Host` and body
    /// forwarded byte for byte; errors as S3 XML.
    S3(S3Kind),
}

/// What the fast path checks a request it takes on ([`Proxy::fast_route`]).
struct FastRoute<'s, 'c> {
    route: &'s Route,
    key: Cow<'c, str>,
    mutation: bool,
    /// An S3 route: a read is not judged by its token (see `handle_s3`).
    s3: bool,
}

/// The route a request path selected.
enum Selected<'s, 'c> {
    Http(&'s Route, Cow<'c, str>, &'c path::CheckedPath),
    S3(&'s Route, &'s S3Kind),
}

/// One configured route, ready to serve.
#[derive(Debug)]
pub struct Route {
    pub name: String,
    matcher: Template,
    kind: Kind,
    upstream: Upstream,
    /// The methods forwarded as reads; see [`Route::is_mutation`].
    read_methods: Vec<Method>,
    trailing_slash: TrailingSlash,
    policy: CheckPolicy,
    enforce: bool,
    upstream_timeout: Duration,
    max_body_bytes: u64,
    forward_token: bool,
    host_header: HostHeader,
    auth: bool,
    /// This route's series, resolved once (not per request).
    request_duration: prometheus::Histogram,
    upstream_duration: prometheus::Histogram,
    /// `fencegate_mutations_total` of this route, one counter per outcome.
    mutations: MutationCounters,
}

/// Headers by which a client asks the upstream to treat a request as
/// another method (see [`Route::is_mutation_request`]).
pub const METHOD_OVERRIDES: [&str; 3] = ["x-http-method-override", "x-http-method", "x-method-override"];

impl Route {
    /// Whether `method` is a mutation on this route: every method that is
    /// not one of its read methods, compared exactly (methods are
    /// case-sensitive, so `put` is not `PUT` and not a read either), and
    /// unknown or extension methods (`MOVE`, `PURGE`, …) included. The one
    /// classification both transports and the mutation metrics use:
    /// a method nobody listed fails safe, as a write that needs a token.
    pub fn is_mutation(&self, method: &Method) -> bool {
        !self.read_methods.contains(method)
    }

    /// [`Route::is_mutation`] for a request: its method, or a method
    /// override header (`X-HTTP-Method-Override`, `X-HTTP-Method`,
    /// `X-Method-Override`, which some backends and frameworks obey) naming
    /// a method that is not a read of this route. A read that asks the
    /// upstream to act as a `DELETE` is a mutation.
    pub fn is_mutation_request(&self, method: &Method, headers: &http::HeaderMap) -> bool {
        self.is_mutation(method)
            || METHOD_OVERRIDES
                .iter()
                .flat_map(|name| headers.get_all(*name))
                .any(|v| Method::from_bytes(v.as_bytes().trim_ascii()).map_or(true, |m| self.is_mutation(&m)))
    }

    /// Whether refusals on this route are rendered as S3 XML errors.
    pub fn is_s3(&self) -> bool {
        matches!(self.kind, Kind::S3(_))
    }

    /// The path rule's half that depends on the route: on a route whose
    /// upstream folds `a/` into `a` (`trailing_slash = "refuse"`, the
    /// default), a mutation of a path with a trailing slash is refused, as
    /// it would write the object of the key without the slash past that
    /// key's fence. Reads of such paths (listings) pass.
    pub(crate) fn check_trailing_slash(&self, checked: &path::CheckedPath, mutation: bool) -> Result<(), Error> {
        if mutation && self.trailing_slash == TrailingSlash::Refuse && checked.has_trailing_slash() {
            return Err(Error::BadRequest(
                "path refused: a trailing slash on a mutation names the same upstream object as the path without it \
                 (a route whose upstream keeps them apart sets trailing_slash = \"distinct\")"
                    .into(),
            ));
        }
        Ok(())
    }
}

/// The data plane.
#[derive(Debug)]
pub struct Proxy {
    routes: Vec<Route>,
    auth: Arc<Auth>,
    authority: Leases,
    store: Store,
    metrics: Arc<Metrics>,
}

/// One access log line of the proxy listener, whichever transport served
/// the request.
struct AccessLine<'a> {
    client: &'a Peer,
    method: &'a Method,
    path: &'a str,
    route: &'a str,
    resource: &'a str,
    status: u16,
    outcome: &'a str,
    elapsed: Duration,
    req_bytes: u64,
    resp_bytes: u64,
}

impl AccessLine<'_> {
    fn write(&self) {
        use crate::logbuf::Field;
        let duration_us = u64::try_from(self.elapsed.as_micros()).unwrap_or(u64::MAX);
        let fast = crate::logbuf::write_access(&[
            ("listener", Field::Str("proxy")),
            ("client", Field::Addr(&self.client.addr)),
            ("method", Field::Raw(self.method.as_str())),
            ("path", Field::Str(self.path)),
            ("route", Field::Str(self.route)),
            ("resource", Field::Str(self.resource)),
            ("status", Field::U64(self.status.into())),
            ("outcome", Field::Str(self.outcome)),
            ("duration_us", Field::U64(duration_us)),
            ("req_bytes", Field::U64(self.req_bytes)),
            ("resp_bytes", Field::U64(self.resp_bytes)),
        ]);
        if fast {
            return;
        }
        tracing::info!(
            target: "fencegate::access",
            listener = "proxy",
            client = %self.client.addr,
            method = %self.method,
            path = %self.path,
            route = self.route,
            resource = self.resource,
            status = self.status,
            outcome = self.outcome,
            duration_us,
            req_bytes = self.req_bytes,
            resp_bytes = self.resp_bytes,
        );
    }
}

/// What [`Proxy::admit`] decided.
enum Admit {
    /// Forward; a mutation carries its in-flight registration.
    Forward(Option<InflightGuard>),
    /// A sequenced mutation: forward once its sequence is durable.
    ForwardAfter(InflightGuard, tokio::sync::oneshot::Receiver<Result<(), Error>>),
    /// An external route's token above the fence: advance the fence
    /// durably (with the sequence, if any), then forward.
    Advance(u64, Option<u64>),
    /// A mutation's token refused by the fence check: refused on an
    /// enforcing route, forwarded unregistered in shadow mode (and audited
    /// either way).
    Fenced(u64, Refusal),
    /// A token absent (mutations) or malformed: as [`Admit::Fenced`].
    NoToken(ErrorReply),
    /// Refused in every mode.
    Reject(ErrorReply),
}

/// A refused or failed request: the error and the mutation outcome word.
struct ErrorReply {
    error: Error,
    outcome: Option<Outcome>,
}

impl From<Error> for ErrorReply {
    fn from(error: Error) -> ErrorReply {
        ErrorReply { error, outcome: None }
    }
}

/// What the access log learns of a request on its way.
#[derive(Default)]
struct Seen<'a> {
    /// The access log is on: keep the key for it.
    log: bool,
    route: Option<&'a Route>,
    key: Option<String>,
}

fn outcome_of(r: &Refusal) -> Outcome {
    match r {
        Refusal::Stale { .. } => Outcome::Stale,
        Refusal::Unissued { .. } | Refusal::TooFar { .. } => Outcome::Unissued,
        Refusal::StaleSequence { .. } => Outcome::StaleSequence,
        Refusal::LeaseExpired { .. } => Outcome::LeaseExpired,
        Refusal::NoRoom { .. } => Outcome::QuotaExceeded,
        Refusal::NotCurrent { .. } => Outcome::NotCurrent,
    }
}

impl Proxy {
    /// Builds every route of `cfg` (effective routes: the configured ones
    /// or the embedded default).
    pub fn new(
        cfg: &Config,
        authority: Leases,
        store: Store,
        metrics: Arc<Metrics>,
        auth: Arc<Auth>,
    ) -> Result<Proxy, Error> {
        let mut routes = Vec::new();
        for (i, rc) in cfg.effective_routes().iter().enumerate() {
            let bad = |e: String| Error::Internal(format!("routes[{i}]: {e}"));
            let matcher = Template::parse_match(rc.effective_match()).map_err(bad)?;
            let kind = match rc.kind {
                RouteKindName::Http => Kind::Http {
                    resource: rc
                        .resource
                        .as_deref()
                        .map(|r| Template::parse_resource(r, &matcher))
                        .transpose()
                        .map_err(bad)?,
                },
                RouteKindName::S3 => Kind::S3(S3Kind::from_config(rc).map_err(bad)?),
            };
            let url = UpstreamUrl::parse(&rc.upstream).map_err(bad)?;
            let tls = crate::tls::TlsFiles {
                ca_file: rc.ca_file.clone(),
                client_cert_file: rc.client_cert_file.clone(),
                client_key_file: rc.client_key_file.clone(),
            };
            let timeouts =
                (Duration::from_millis(rc.connect_timeout_ms), Duration::from_millis(rc.upstream_timeout_ms));
            let upstream = Upstream::connect(&url, timeouts, &tls)?;
            let read_methods = rc
                .read_methods
                .iter()
                .map(|m| Method::from_bytes(m.as_bytes()).map_err(|e| bad(format!("read_methods: {m:?}: {e}"))))
                .collect::<Result<_, _>>()?;
            let name = rc.route_name(i);
            metrics.register_route(&name);
            routes.push(Route {
                request_duration: metrics.request_duration.with_label_values(&["proxy", &name]),
                upstream_duration: metrics.upstream_duration.with_label_values(&[&name]),
                mutations: metrics.mutation_counters(&name),
                name,
                matcher,
                kind,
                upstream,
                read_methods,
                trailing_slash: rc.trailing_slash,
                policy: CheckPolicy {
                    strict: rc.strict,
                    external: rc.fence_authority == FenceAuthority::External,
                    max_step: rc.max_token_step,
                },
                enforce: rc.enforce,
                upstream_timeout: Duration::from_millis(rc.upstream_timeout_ms),
                max_body_bytes: rc.max_body_bytes,
                forward_token: rc.forward_fencing_token,
                host_header: rc.host_header,
                auth: rc.auth,
            });
        }
        if routes.iter().any(|r: &Route| r.auth) && !auth.enabled() {
            return Err(Error::Config("a route has auth = true but auth.principals_file is not set".into()));
        }
        Ok(Proxy { routes, authority, store, metrics, auth })
    }

    /// The fence table of the authority this proxy serves (embedded or
    /// cluster): the one table every admission decision reads.
    fn fences(&self) -> &Arc<FenceTable> {
        self.authority.fences()
    }

    /// Serves one proxied request. Never panics on client input; every
    /// refusal is a JSON error response. Writes one access log line.
    pub async fn handle(&self, req: Request<BoxBody>, client: Peer) -> Response<BoxBody> {
        let started = Instant::now();
        // The access log's fields are gathered only when it is on.
        let log = tracing::enabled!(target: "fencegate::access", tracing::Level::INFO);
        let logged = log.then(|| (req.method().clone(), req.uri().path().to_string(), content_length(req.headers())));
        let mut seen = Seen { log, ..Seen::default() };
        let result = self.handle_inner(req, &client, &mut seen).await;
        let (response, code) = match result {
            Ok(resp) => (resp, "ok"),
            Err(refused) => {
                if let (Some(route), Some(outcome)) = (seen.route, refused.outcome) {
                    route.mutations.inc(outcome);
                }
                let code = refused.error.code();
                match seen.route {
                    Some(route) if route.is_s3() => (refused.error.into_s3_response(), code),
                    _ => (refused.error.into_response(), code),
                }
            }
        };
        let elapsed = started.elapsed();
        match seen.route {
            Some(route) => route.request_duration.observe(elapsed.as_secs_f64()),
            None => self.metrics.request_duration.with_label_values(&["proxy", "none"]).observe(elapsed.as_secs_f64()),
        }
        let Some((method, path, req_bytes)) = logged else {
            return response;
        };
        AccessLine {
            client: &client,
            method: &method,
            path: &path,
            route: seen.route.map_or("none", |r| r.name.as_str()),
            resource: seen.key.as_deref().unwrap_or(""),
            status: response.status().as_u16(),
            outcome: code,
            elapsed,
            req_bytes: req_bytes.unwrap_or(0),
            resp_bytes: content_length(response.headers()).unwrap_or(0),
        }
        .write();
        response
    }

    /// The first route that takes a request path, first match wins: HTTP
    /// routes match the checked path (`None`: it failed the path rule, so
    /// no HTTP route takes it), S3 routes the path percent-decoded once, as
    /// S3 reads bucket and key (`/bk%74/k` is bucket `bkt`), or the raw
    /// path if it does not decode (the S3 kind then refuses it). S3 keys
    /// are not held to the path rule; the S3 kind checks its own.
    fn select<'s, 'c>(&'s self, raw: &str, checked: Option<&'c path::CheckedPath>) -> Option<Selected<'s, 'c>> {
        let segments = checked.map(path::CheckedPath::segments);
        let mut s3_path: Option<Cow<'_, str>> = None;
        for r in &self.routes {
            match &r.kind {
                Kind::Http { resource } => {
                    let (Some(checked), Some(segments)) = (checked, segments.as_deref()) else { continue };
                    // Captures are built only for a route with a resource template.
                    match resource {
                        Some(t) => {
                            if let Some(caps) = r.matcher.matches(segments) {
                                return Some(Selected::Http(r, Cow::Owned(t.render(&caps)), checked));
                            }
                        }
                        None => {
                            if r.matcher.is_match(segments) {
                                return Some(Selected::Http(r, Cow::Borrowed(checked.decoded.as_str()), checked));
                            }
                        }
                    }
                }
                Kind::S3(s3) => {
                    let path = s3_path.get_or_insert_with(|| s3::match_path(raw));
                    let rest = path.strip_prefix('/').unwrap_or(path);
                    let segs: Vec<&str> = if rest.is_empty() { Vec::new() } else { rest.split('/').collect() };
                    if r.matcher.is_match(&segs) {
                        return Some(Selected::S3(r, s3));
                    }
                }
            }
        }
        None
    }

    /// The route of a request the fast path may take, the resource its
    /// fence check is made on and whether it mutates it; `None` sends the
    /// request to the general path, which selects the same route again.
    ///
    /// An HTTP route: the key of its path, mutation by method (the caller
    /// hands method overrides to the general path). An S3 route: only a
    /// request whose head names its one resource, classified by the S3
    /// kind exactly as the general path classifies it — `GET`, `HEAD`,
    /// `PUT`, `DELETE` of one object or bucket (`RenameObject`, which
    /// changes two, is refused by the classification here for want of its
    /// source header and decided by the general path). `s3_headers`: the
    /// request's headers the S3 kind judges ([`s3::JUDGED_HEADERS`] and its
    /// one `Host`), made only for an S3 route; `None` hands the request
    /// over. The caller hands `X-Fencing-Tokens` (per resource tokens) to
    /// the general path.
    fn fast_route<'s, 'c>(
        &'s self,
        target: &str,
        path_only: &str,
        method: &Method,
        s3_headers: impl FnOnce() -> Option<http::HeaderMap>,
        checked: &'c path::CheckedPath,
    ) -> Option<FastRoute<'s, 'c>> {
        match self.select(path_only, Some(checked))? {
            Selected::Http(route, key, _) => {
                let mutation = route.is_mutation(method);
                route.check_trailing_slash(checked, mutation).ok()?;
                Some(FastRoute { route, key, mutation, s3: false })
            }
            Selected::S3(route, s3) => {
                if !matches!(*method, Method::GET | Method::HEAD | Method::PUT | Method::DELETE) {
                    return None;
                }
                let uri = http::Uri::try_from(target).ok()?;
                let headers = s3_headers()?;
                let s3::S3Plan::Head { primary, mut mutated } = s3.classify(method, &uri, &headers).ok()? else {
                    return None;
                };
                let (key, mutation) = match mutated.len() {
                    0 => (primary, false),
                    1 => (mutated.pop()?, true),
                    _ => return None,
                };
                Some(FastRoute { route, key: Cow::Owned(key), mutation, s3: true })
            }
        }
    }

    /// Whether a request-target as sent (a fragment, a query and all)
    /// selects an S3 route: a refusal made before routing then speaks S3.
    fn selects_s3(&self, target: &str) -> bool {
        let target = target.split_once('#').map_or(target, |(t, _)| t);
        let path = target.split_once('?').map_or(target, |(p, _)| p);
        let checked = path::check_path(path);
        matches!(self.select(path, checked.as_ref().ok()), Some(Selected::S3(..)))
    }

    async fn handle_inner<'a>(
        &'a self,
        req: Request<BoxBody>,
        client: &Peer,
        seen: &mut Seen<'a>,
    ) -> Result<Response<BoxBody>, ErrorReply> {
        // 0. The route (nothing acts on it yet): its refusals speak its
        //    kind's language (S3 routes answer S3 XML errors).
        let checked = path::check_path(req.uri().path());
        let selected = self.select(req.uri().path(), checked.as_ref().ok());
        if let Some(Selected::Http(route, ..) | Selected::S3(route, _)) = &selected {
            seen.route = Some(*route);
        }
        // 1. A `Connection` that names a fencing header would strip it
        //    after the check below: refused before anything else.
        if headers::connection_names_fencing_header(req.headers()) {
            return Err(headers::fencing_header_named_hop_by_hop().into());
        }
        //    So does a header that backends may read as one of ours.
        if let Some(name) = headers::underscore_alias(req.headers()) {
            return Err(headers::underscore_alias_refused(name).into());
        }
        //    A transfer coding the gateway would drop on the way.
        if headers::other_transfer_coding(req.headers()) {
            let why = "Transfer-Encoding may only be chunked: other codings would not reach the upstream";
            return Err(Error::BadRequest(why.into()).into());
        }
        let (route, key, checked) = match selected {
            Some(Selected::Http(route, key, checked)) => (route, key, checked),
            Some(Selected::S3(route, s3)) => {
                return Box::pin(self.handle_s3(route, s3, req, client, seen)).await;
            }
            None => {
                return Err(match checked {
                    Err(msg) => Error::BadRequest(format!("path refused: {msg}")),
                    Ok(_) => Error::NotFound(format!("no route for {}", req.uri().path())),
                }
                .into())
            }
        };
        if seen.log {
            seen.key = Some(key.to_string());
        }
        let mutation = route.is_mutation_request(req.method(), req.headers());
        route.check_trailing_slash(checked, mutation)?;
        // In shadow mode too, as the path rule: a second target may be
        // another route's, enforced (outside review: a shadow route's COPY
        // overwrote an enforced route's object without a token).
        if mutation {
            if let Some(name) = headers::second_target(req.headers()) {
                return Err(headers::second_target_refused(name).into());
            }
        }
        if route.auth {
            // Proxy-Authorization is hop-by-hop: it never reaches the upstream.
            let principal = self.auth.require(req.headers(), "proxy-authorization", client.cert_cn.as_deref())?;
            principal.authorize(&key)?;
        }
        let parsed = parse_token_header(req.headers().get_all(&X_FENCING_TOKEN));
        self.admit_and_forward(route, &key, &checked.decoded, mutation, parsed, req, client).await
    }

    /// The fence check of docs/proxy.md for one request: the one decision both
    /// transports act on (the general path below, and [`fast`] for plain
    /// HTTP/1.1, which forwards only on [`Admit::Forward`] and hands every
    /// other outcome to the general path). An admissible mutation is
    /// registered as in flight in the same atomic step
    /// ([`FenceTable::admit`]).
    fn admit(
        &self,
        route: &Route,
        key: &str,
        mutation: bool,
        token: Result<Option<u64>, TokenError>,
        sequence: Result<Option<u64>, TokenError>,
    ) -> Admit {
        let (token, sequence) = match (token, sequence) {
            (Ok(t), Ok(s)) => (t, s),
            (Err(TokenError::Malformed(m)), _) => {
                let refused = ErrorReply {
                    error: Error::MalformedFencingToken(m),
                    outcome: mutation.then_some(Outcome::MalformedToken),
                };
                return Admit::NoToken(refused);
            }
            (_, Err(TokenError::Malformed(m))) => {
                let error = Error::MalformedFencingToken(format!("X-Fencing-Sequence: {m}"));
                return Admit::NoToken(ErrorReply { error, outcome: mutation.then_some(Outcome::MalformedToken) });
            }
        };
        if !mutation {
            // A read with a stale token learns it at once.
            if let Some(t) = token {
                let fence = self.fences().fence(key);
                if t < fence && route.enforce {
                    let error = Error::StaleFencingToken { key: key.to_string(), token: t, fence };
                    return Admit::Reject(ErrorReply { error, outcome: None });
                }
            }
            return Admit::Forward(None);
        }
        if let Err(error) = validate_key(key) {
            return Admit::Reject(ErrorReply { error, outcome: None });
        }
        let Some(token) = token else {
            let refused = ErrorReply {
                error: Error::FencingTokenRequired { key: key.to_string() },
                outcome: Some(Outcome::MissingToken),
            };
            return Admit::NoToken(refused);
        };
        let admission = match sequence {
            None => self.fences().admit(key, token, route.policy),
            Some(seq) => self.fences().admit_sequenced(key, token, seq, route.policy, &self.store),
        };
        match admission {
            Ok(Admission::Admitted(guard)) => Admit::Forward(Some(guard)),
            Ok(Admission::AdmittedAfter(guard, durable)) => Admit::ForwardAfter(guard, durable),
            Ok(Admission::MustAdvance) => Admit::Advance(token, sequence),
            Err(refusal) => Admit::Fenced(token, refusal),
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn admit_and_forward(
        &self,
        route: &Route,
        key: &str,
        object: &str,
        mutation: bool,
        parsed: Result<Option<u64>, TokenError>,
        req: Request<BoxBody>,
        client: &Peer,
    ) -> Result<Response<BoxBody>, ErrorReply> {
        // 2. admit
        let token = parsed.as_ref().ok().copied().flatten();
        let sequence = parse_token_header(req.headers().get_all(&X_FENCING_SEQUENCE));
        let guard = match self.admit(route, key, mutation, parsed, sequence) {
            Admit::Forward(Some(guard)) if route.policy.external => {
                // Another request may be advancing to this very token:
                // wait, as it does, for older in-flight mutations.
                Box::pin(self.fences().barrier(key, guard.token(), route.upstream_timeout)).await;
                self.still_current(route, key, guard, client)?
            }
            Admit::Forward(guard) => guard,
            Admit::ForwardAfter(guard, durable) => {
                if let Err(e) = wait_durable(durable).await {
                    // The sequence stays taken in memory: a retry needs a
                    // higher one (never a lower one landing late).
                    tracing::error!(key = %key, error = %e, "sequence not durable; request refused");
                    return Err(e.into());
                }
                // After the older writes of this holder (lower numbers, and
                // after an unclean restart the quarantine): in order.
                let (t, n) = (guard.token(), guard.sequence());
                Box::pin(self.fences().barrier_for(key, t, n, route.upstream_timeout)).await;
                self.still_current(route, key, guard, client)?
            }
            Admit::Advance(token, sequence) => {
                match self.fences().advance(key, token, sequence, route.policy, &self.store) {
                    // Boxed: the rarer path, kept out of the common future.
                    Ok((guard, durable)) => {
                        let guard = Box::pin(self.activate(route, key, token, guard, durable)).await?;
                        self.still_current(route, key, guard, client)?
                    }
                    Err(refusal) => self.refuse_fenced(route, key, token, refusal, client)?,
                }
            }
            Admit::Reject(refused) => return Err(refused),
            // Enforcing: refused here. Shadow: forwarded unregistered.
            Admit::Fenced(token, refusal) => self.refuse_fenced(route, key, token, refusal, client)?,
            Admit::NoToken(refused) => {
                self.refuse_or_shadow(route, key, None, refused, client)?;
                None
            }
        };
        // 3. forward
        // Boxed once here: every caller above then carries a pointer, not
        // the forwarding state (kilobytes, copied at each level otherwise).
        Box::pin(self.forward(route, key, object, mutation, req, client, guard.into_iter().collect(), token)).await
    }

    /// An external route's new token: durable first, then the barrier on
    /// older in-flight mutations.
    async fn activate(
        &self,
        route: &Route,
        key: &str,
        token: u64,
        guard: InflightGuard,
        durable: Option<tokio::sync::oneshot::Receiver<Result<(), Error>>>,
    ) -> Result<InflightGuard, ErrorReply> {
        if let Some(rx) = durable {
            if let Err(e) = wait_durable(rx).await {
                // The fence stays raised in memory (older tokens are still
                // refused) but no request with this token is forwarded
                // until a later attempt makes it durable.
                tracing::error!(key = %key, token, error = %e, "fence advance not durable; request refused");
                return Err(e.into());
            }
            self.fences().mark_durable(key, token);
            self.metrics.fence_advances.inc();
        }
        let outcome = self.fences().barrier_for(key, token, guard.sequence(), route.upstream_timeout).await;
        self.metrics.activation_wait.observe(outcome.waited.as_secs_f64());
        if outcome.overrun {
            self.metrics.activation_overruns.inc();
        }
        Ok(guard)
    }

    /// After a wait (a barrier, an fsync), the fence may have moved past
    /// the request's token: it is then refused as stale instead of being
    /// forwarded behind the newer holder's back (a newer barrier may
    /// already have given up on it).
    fn still_current(
        &self,
        route: &Route,
        key: &str,
        guard: InflightGuard,
        client: &Peer,
    ) -> Result<Option<InflightGuard>, ErrorReply> {
        let fence = self.fences().fence(key);
        let token = guard.token();
        if !self.fences().is_current() {
            // Cluster mode: the view went stale while this request waited.
            drop(guard);
            let why = "the gateway's view may have gone stale while the request waited";
            return self.refuse_fenced(route, key, token, Refusal::NotCurrent { why }, client);
        }
        if fence <= token {
            return Ok(Some(guard));
        }
        drop(guard);
        self.refuse_fenced(route, key, token, Refusal::Stale { token, fence, superseded_for: Duration::ZERO }, client)
    }

    fn refuse_fenced(
        &self,
        route: &Route,
        key: &str,
        token: u64,
        refusal: Refusal,
        client: &Peer,
    ) -> Result<Option<InflightGuard>, ErrorReply> {
        if let Refusal::Stale { superseded_for, .. } = &refusal {
            self.metrics.stale_write_age.with_label_values(&[&route.name]).observe(superseded_for.as_secs_f64());
        }
        let outcome = outcome_of(&refusal);
        let refused = ErrorReply { error: refusal.into_error(key), outcome: Some(outcome) };
        self.refuse_or_shadow(route, key, Some(token), refused, client).map(|()| None)
    }

    /// Logs a would-be refusal; returns it when the route enforces, or
    /// counts it and lets the request through in shadow mode.
    fn refuse_or_shadow(
        &self,
        route: &Route,
        key: &str,
        token: Option<u64>,
        refused: ErrorReply,
        client: &Peer,
    ) -> Result<(), ErrorReply> {
        let fence = self.fences().fence(key);
        let holder = self.authority.holder_of(key);
        tracing::warn!(
            target: "fencegate::audit",
            route = %route.name,
            resource = %key,
            token = ?token,
            fence,
            holder = %holder,
            client = %client.addr,
            refusal = refused.error.code(),
            enforced = route.enforce,
            "mutation refused"
        );
        if route.enforce {
            return Err(refused);
        }
        if let Some(outcome) = refused.outcome {
            route.mutations.inc(outcome);
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    async fn forward(
        &self,
        route: &Route,
        key: &str,
        object: &str,
        mutation: bool,
        req: Request<BoxBody>,
        client: &Peer,
        guards: Vec<InflightGuard>,
        token: Option<u64>,
    ) -> Result<Response<BoxBody>, ErrorReply> {
        if content_length(req.headers()).is_some_and(|len| len > route.max_body_bytes) {
            Box::pin(crate::body::drain(req.into_body(), crate::body::DRAIN_MAX_BYTES, Duration::from_secs(2))).await;
            return Err(Error::PayloadTooLarge { limit_bytes: route.max_body_bytes }.into());
        }
        let (parts, body) = req.into_parts();
        // A body still streaming is cut off when the fence of (the first
        // of) its keys moves; the bodies of several-key requests are
        // already read whole. Not in shadow mode, which reports and never
        // refuses: there activation waits for the body (bounded by the
        // upstream timeout) as for any write in flight.
        let h2 = parts.version == http::Version::HTTP_2;
        let stamp = Stamp { token, sequence: guards.first().and_then(InflightGuard::sequence) };
        let guards = Arc::new(guards);
        // Held by the body only where a newer grant cuts it: in shadow
        // mode nothing would end the hold but the body itself, and
        // activation would wait for a whole slow upload.
        let hold = (route.enforce && !guards.is_empty()).then(|| guards.clone());
        let hold_is_set = hold.is_some();
        let (mut body, body_outcome) = FencedBody::new(body, hold, route.max_body_bytes, h2);
        if hold_is_set {
            // Every frame of a fenced upload goes only while this gateway
            // is current and within the route's upstream timeout.
            let deadline = tokio::time::Instant::now() + route.upstream_timeout;
            body = body.gated(fenced_body::Gate { fences: self.fences().clone(), deadline });
        }
        let body = match body.settle_declared_empty(route.upstream_timeout).await {
            Ok(body) => body,
            Err(Unsettled::Refused(error)) => return Err(error.into()),
            Err(Unsettled::Cut(e)) => {
                return Err(self.failed_exchange(route, key, mutation, stamp, &body_outcome, SendError::Other(e)))
            }
        };
        let mut up = Request::from_parts(parts, body);
        headers::prepare_request(&mut up, client, route.host_header, route.upstream.host(), route.forward_token);
        // A fenced request whose body has no frame to check (an empty body:
        // the head is the whole request) is checked here, once more, right
        // before it is handed to the upstream client.
        if hold_is_set && !self.fences().is_current() {
            let error =
                Error::NotCurrent("the gateway stopped being current before the request was sent upstream".into());
            return Err(ErrorReply { error, outcome: mutation.then_some(Outcome::NotCurrent) });
        }
        let started = Instant::now();
        let held = hold_is_set.then(|| body_outcome.clone());
        let sent = exchange(route, up, object, token, guards, held).await;
        route.upstream_duration.observe(started.elapsed().as_secs_f64());
        match sent {
            Ok(mut resp) => {
                headers::prepare_response(&mut resp);
                if mutation {
                    route.mutations.inc(Outcome::Forwarded);
                }
                Ok(resp)
            }
            Err(e) => Err(self.failed_exchange(route, key, mutation, stamp, &body_outcome, e)),
        }
    }

    /// The reply to an exchange that did not bring back a response: a body
    /// cut off by a newer fence is a stale write, one past the route's
    /// limit is too large, anything else is the upstream's failure.
    fn failed_exchange(
        &self,
        route: &Route,
        key: &str,
        mutation: bool,
        stamp: Stamp,
        body_outcome: &BodyOutcome,
        failure: SendError,
    ) -> ErrorReply {
        let outcome_word = |o: Outcome| mutation.then_some(o);
        let cut_short = |fallback: Error| -> ErrorReply {
            if body_outcome.aborted() {
                self.metrics.aborted_uploads.with_label_values(&[&route.name]).inc();
                // The fence moved past this token while its body streamed —
                // or, under the same token, the holder's own higher
                // sequence: the upstream got a truncated request and cannot
                // apply it.
                let (key, token) = (key.to_string(), stamp.token.unwrap_or(0));
                let fence = self.fences().fence(&key);
                let last = self.fences().last_sequence(&key);
                return match (stamp.sequence, last) {
                    (Some(sequence), Some(last_sequence)) if fence == token && last_sequence > sequence => {
                        let error = Error::StaleSequence { key, token, sequence, last_sequence };
                        ErrorReply { error, outcome: outcome_word(Outcome::StaleSequence) }
                    }
                    // Neither: the gateway stopped being current (which
                    // aborts every upload still streaming) — not stale.
                    _ if fence <= token && !self.fences().is_current() => ErrorReply {
                        error: Error::NotCurrent(
                            "the gateway stopped being current while the body streamed; the upload was cut off".into(),
                        ),
                        outcome: outcome_word(Outcome::NotCurrent),
                    },
                    _ => ErrorReply {
                        error: Error::StaleFencingToken { key, token, fence },
                        outcome: outcome_word(Outcome::Stale),
                    },
                };
            }
            if body_outcome.too_large() {
                return Error::PayloadTooLarge { limit_bytes: route.max_body_bytes }.into();
            }
            if body_outcome.not_current() {
                self.metrics.aborted_uploads.with_label_values(&[&route.name]).inc();
                let error = Error::NotCurrent(
                    "the gateway stopped being current while the body streamed; the upload was cut off".into(),
                );
                return ErrorReply { error, outcome: outcome_word(Outcome::NotCurrent) };
            }
            if body_outcome.timed_out() {
                self.metrics.aborted_uploads.with_label_values(&[&route.name]).inc();
                let timeout_ms = u64::try_from(route.upstream_timeout.as_millis()).unwrap_or(u64::MAX);
                return ErrorReply {
                    error: Error::UpstreamTimeout { timeout_ms },
                    outcome: outcome_word(Outcome::UpstreamError),
                };
            }
            if body_outcome.client_broke() {
                // The upstream got a truncated request: nothing applied,
                // and the fault is the request's (docs/errors.md).
                return Error::BadRequest("the request body is malformed or ended early".into()).into();
            }
            ErrorReply { error: fallback, outcome: outcome_word(Outcome::UpstreamError) }
        };
        match failure {
            SendError::Timeout => ErrorReply {
                error: Error::UpstreamTimeout {
                    timeout_ms: u64::try_from(route.upstream_timeout.as_millis()).unwrap_or(u64::MAX),
                },
                outcome: outcome_word(Outcome::UpstreamError),
            },
            SendError::Connect(e) => {
                tracing::warn!(route = %route.name, error = %e, "upstream connect failed");
                cut_short(Error::UpstreamUnavailable("could not connect to the upstream".into()))
            }
            SendError::Other(e) => {
                tracing::warn!(route = %route.name, error = %e, "upstream exchange failed");
                cut_short(Error::UpstreamUnavailable("the upstream exchange failed".into()))
            }
            SendError::Refused(e) => {
                let mut refused = cut_short(e);
                if refused.outcome == Some(Outcome::UpstreamError) && refused.error.status().is_client_error() {
                    // The store answered the client's request (404, 412):
                    // it was forwarded, just not applied.
                    refused.outcome = outcome_word(Outcome::Forwarded);
                }
                refused
            }
        }
    }
}

/// What a forwarded mutation carried: its token and its sequence, if any.
#[derive(Debug, Clone, Copy)]
struct Stamp {
    token: Option<u64>,
    sequence: Option<u64>,
}

/// Sends `up` to the route's upstream. A registered mutation's exchange
/// runs as its own task, which ends the registration (docs/proxy.md, "in flight")
/// only when the upstream has answered or failed — also when the client
/// hangs up meanwhile and the caller's future is dropped: activation must
/// still wait for a write the upstream may yet apply. The request body
/// holds the registration too ([`FencedBody`]), until it has ended: an
/// upstream may answer before it has read the whole body.
///
/// On an S3 route the registration ends only with the response body (or
/// the route's upstream timeout): S3 answers some writes `200` at once and
/// applies them at the body's end.
async fn exchange(
    route: &Route,
    up: Request<FencedBody>,
    object: &str,
    token: Option<u64>,
    guards: Arc<Vec<InflightGuard>>,
    held: Option<Arc<BodyOutcome>>,
) -> Result<Response<BoxBody>, SendError> {
    if guards.is_empty() {
        return route.upstream.send(up, object, token, route.upstream_timeout).await;
    }
    let (upstream, object, timeout) = (route.upstream.clone(), object.to_string(), route.upstream_timeout);
    let hold_body = route.is_s3();
    let outcome = held.clone();
    let task = tokio::spawn(async move {
        let deadline = tokio::time::Instant::now() + timeout;
        let sent = match upstream.send(up, &object, token, timeout).await {
            // A registered mutation never asks for an upgrade: an upstream
            // switching protocols on it broke the exchange (and may still
            // apply the write), as an unparseable answer does.
            Ok(resp) if resp.status() == http::StatusCode::SWITCHING_PROTOCOLS => {
                Err(SendError::Other("unexpected 101 Switching Protocols on a fenced mutation".into()))
            }
            sent => sent,
        };
        // Answered while the body still streamed, or before the upstream's
        // kernel had taken all of it (it was in the gateway's send queue):
        // this upstream answers before it has read a request whole, so what
        // it has not read yet may still be applied after the answer (see
        // `answer_after_body`).
        let early = held.as_ref().filter(|b| !b.settled_now() || !b.delivered_now()).cloned();
        let sent = match (sent, held) {
            (Ok(resp), Some(body)) if resp.status().is_success() => {
                let ctl = guards.first().map(|g| g.ctl().clone());
                answer_after_body(resp, &body, ctl.as_deref(), deadline).await
            }
            (sent, _) => sent,
        };
        if let Some(body) = early {
            // Until the deadline, or until the body is cut off (then the
            // upstream never gets it whole: nothing left to wait for).
            tokio::spawn(async move {
                let cut = async {
                    body.settled().await;
                    if !body.cut() {
                        std::future::pending::<()>().await;
                    }
                };
                tokio::select! {
                    // Nothing of it goes after the deadline: the upstream
                    // connection is cut (a body stuck in the HTTP client
                    // would otherwise keep its registration).
                    _ = tokio::time::sleep_until(deadline) => body.cut_wire(),
                    _ = cut => {}
                }
                drop(guards);
            });
            return sent;
        }
        match sent {
            Ok(resp) if hold_body => Ok(resp.map(|b| BoxBody::new(held_body::HeldBody::new(b, guards, deadline)))),
            // The exchange broke after the whole request had gone (no
            // answer, a malformed one, a reset): the upstream may still
            // apply it within the upstream timeout, so it stays in flight
            // until then, as an unanswered one does. A request not handed
            // over whole (cut by the gateway, or dropped part-way when the
            // upstream broke off mid-upload) cannot be applied.
            Err(SendError::Other(e)) if outcome.as_ref().is_none_or(|b| b.handed_over()) => {
                hold_until(deadline, guards);
                Err(SendError::Other(e))
            }
            sent => {
                drop(guards);
                sent
            }
        }
    });
    match task.await {
        Ok(sent) => sent,
        Err(e) => Err(SendError::Other(format!("the exchange task failed: {e}"))),
    }
}

/// Keeps `held` (in-flight registrations) until `deadline`, then ends it:
/// for a write the upstream may still apply although the exchange is over.
fn hold_until<T: Send + 'static>(deadline: tokio::time::Instant, held: T) {
    tokio::spawn(async move {
        tokio::time::sleep_until(deadline).await;
        drop(held);
    });
}

/// A success that the upstream gave before the request body had ended (it
/// answers on the head and reads on) is passed on only once the body has
/// ended: until then the upload can still be cut off — by a newer grant,
/// the size limit or the client's own stream breaking — and the upstream
/// then never gets the whole request, so its `2xx` would tell the client
/// of a write that was not applied. A cut body makes the exchange fail as
/// any cut upload does (`409 stale_fencing_token` for a newer grant); a
/// body still streaming at the route's upstream timeout is cut off here
/// (so the upstream never gets it whole either) and the exchange fails as
/// a timeout. The whole answer waits, its body too: a complete answer
/// (a small body, or an empty chunked one) is a success the client keeps
/// whatever comes after it. The cost: an upstream that answers a fenced
/// write as it reads it (an echo, a full-duplex stream) waits for us to
/// read its answer, stops reading, and the exchange times out. Answers
/// other than `2xx` are passed on at once: none tells of an applied write.
///
/// Whatever the answer, an exchange answered while its body streamed keeps
/// its registrations until the upstream timeout (from the exchange's start):
/// the upstream may read, and apply, the end of the body after answering,
/// so a newer grant must wait for that as for any write in flight.
async fn answer_after_body(
    resp: Response<BoxBody>,
    body: &BodyOutcome,
    ctl: Option<&InflightCtl>,
    deadline: tokio::time::Instant,
) -> Result<Response<BoxBody>, SendError> {
    match tokio::time::timeout_at(deadline, body.settled()).await {
        Err(_) => {
            if let Some(ctl) = ctl {
                ctl.abort();
            }
            body.cut_wire();
            Err(SendError::Timeout)
        }
        Ok(()) if body.cut() => {
            Err(SendError::Other("the request body was cut off after the upstream had answered".into()))
        }
        Ok(()) => Ok(resp),
    }
}
