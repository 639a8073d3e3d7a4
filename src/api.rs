//! The control plane (api listener): the lease API of docs/lease-api.md, `/metrics`,
//! `/healthz` and `/readyz`. One small function per verb; each parses its
//! input, calls the authority, and renders JSON. Errors are rendered only
//! by `Error::into_response`.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::time::Instant;

use crate::auth::{Auth, Principal};
use crate::authority::{AcquireRequest, ReleaseRequest, RenewRequest};
use crate::body::{full, BoxBody};
use crate::error::Error;
use crate::leases::Leases;
use crate::metrics::Metrics;
use crate::peer::Peer;
use crate::shutdown::Shutdown;

mod batch;
pub use batch::{BATCH_BODY_FACTOR, MAX_BATCH_OPERATIONS};

/// What the api listener needs.
#[derive(Debug, Clone)]
pub struct Api {
    pub authority: Leases,
    pub metrics: Arc<Metrics>,
    pub max_body_bytes: u64,
    /// The deadline for a whole request body (408 after it).
    pub body_read_timeout: Duration,
    pub shutdown: Shutdown,
    pub auth: Arc<Auth>,
    /// Acquires with a wait, per principal (or client address).
    pub waiting: Arc<WaitingPerPrincipal>,
    /// Open watches, per principal (or client address).
    pub watching: Arc<WaitingPerPrincipal>,
    /// Fenced keys per principal.
    pub fences: Arc<FencesPerPrincipal>,
}

/// Counts long-lived requests (acquires with a wait, watches) per owner —
/// a principal, or the client's address when the lease API needs no
/// principal — against a bound, so that one owner cannot pin unbounded
/// memory and tasks. A slot is held by a guard, so a hang-up frees it.
#[derive(Debug, Default)]
pub struct WaitingPerPrincipal {
    counts: dashmap::DashMap<String, usize>,
    limit: usize,
}

/// One counted waiter; leaving (answer or hang-up) uncounts it.
pub struct WaitingSlot<'a> {
    owner: &'a WaitingPerPrincipal,
    name: String,
}

impl WaitingPerPrincipal {
    /// At most `limit` waiting acquires per principal.
    pub fn new(limit: usize) -> WaitingPerPrincipal {
        WaitingPerPrincipal { counts: dashmap::DashMap::new(), limit }
    }

    /// A slot for `name`, or `None` when it has `limit` already.
    fn enter(&self, name: &str) -> Option<WaitingSlot<'_>> {
        let mut n = self.counts.entry(name.to_string()).or_insert(0);
        if *n >= self.limit {
            return None;
        }
        *n += 1;
        Some(WaitingSlot { owner: self, name: name.to_string() })
    }
}

/// Fenced keys per principal, against `locks.max_fences_per_principal`:
/// at start every key on disk counts for each principal whose prefixes
/// cover it; then every new key a principal's acquire fences.
#[derive(Debug, Default)]
pub struct FencesPerPrincipal {
    counts: dashmap::DashMap<String, usize>,
    limit: usize,
}

impl FencesPerPrincipal {
    /// Counts the keys already fenced in `fences` for every principal.
    pub fn count(auth: &Auth, fences: &crate::fence::FenceTable, limit: usize) -> FencesPerPrincipal {
        let counts = dashmap::DashMap::new();
        if auth.enabled() {
            fences.for_each_key(|key| {
                for p in auth.principals() {
                    if p.may(key) {
                        *counts.entry(p.name.clone()).or_insert(0) += 1;
                    }
                }
            });
        }
        FencesPerPrincipal { counts, limit }
    }

    fn full(&self, p: &Principal) -> bool {
        self.counts.get(&p.name).is_some_and(|n| *n >= self.limit)
    }

    fn add(&self, p: &Principal) {
        *self.counts.entry(p.name.clone()).or_insert(0) += 1;
    }
}

/// Who a per-owner bound counts against: the principal, else (the lease
/// API needs none) the client's address.
fn owner_of(p: Option<&Principal>, client: &Peer) -> String {
    match p {
        Some(p) => format!("principal {}", p.name),
        None => format!("address {}", client.addr.ip()),
    }
}

impl Drop for WaitingSlot<'_> {
    fn drop(&mut self) {
        // The entry goes when its count does, so owners that come and go
        // (client addresses) leave nothing behind.
        self.owner.counts.remove_if_mut(&self.name, |_, n| {
            *n = n.saturating_sub(1);
            *n == 0
        });
    }
}

impl Api {
    /// Serves one api request.
    pub async fn handle(&self, req: Request<BoxBody>, client: Peer) -> Response<BoxBody> {
        let started = Instant::now();
        let method = req.method().clone();
        let req_bytes = crate::body::content_length(req.headers());
        let (endpoint, result) = self.route(req, &client).await;
        let elapsed = started.elapsed();
        self.metrics.observe_api_request(endpoint, elapsed.as_secs_f64());
        let (response, outcome) = match result {
            Ok(r) => (r, "ok"),
            Err(e) => {
                let code = e.code();
                (e.into_response(), code)
            }
        };
        tracing::info!(
            target: "fencegate::access",
            listener = "api",
            client = %client.addr,
            method = %method,
            route = endpoint,
            status = response.status().as_u16(),
            outcome,
            duration_us = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX),
            req_bytes = req_bytes.unwrap_or(0u64),
        );
        response
    }

    async fn route(&self, req: Request<BoxBody>, client: &Peer) -> (&'static str, Result<Response<BoxBody>, Error>) {
        let method = req.method().clone();
        let (name, expected) = match req.uri().path() {
            "/v1/locks/acquire" => ("acquire", Method::POST),
            "/v1/locks/renew" => ("renew", Method::POST),
            "/v1/locks/release" => ("release", Method::POST),
            "/v1/locks/batch" => ("batch", Method::POST),
            "/v1/locks/status" => ("status", Method::GET),
            "/v1/locks/watch" => ("watch", Method::GET),
            "/metrics" => ("metrics", Method::GET),
            "/healthz" => ("healthz", Method::GET),
            "/readyz" => ("readyz", Method::GET),
            path => return ("none", Err(Error::NotFound(path.to_string()))),
        };
        let allowed = method == expected || (expected == Method::GET && method == Method::HEAD);
        if !allowed {
            return (name, Err(Error::MethodNotAllowed(method.to_string())));
        }
        // Who is asking: 401 without credentials where they are needed.
        let principal = match name {
            "metrics" | "healthz" | "readyz" => {
                if let Err(e) = self.auth.check_metrics(req.headers(), client.cert_cn.as_deref()) {
                    return (name, Err(e));
                }
                None
            }
            _ if self.auth.api_required() => {
                match self.auth.require(req.headers(), "authorization", client.cert_cn.as_deref()) {
                    Ok(p) => Some(p.clone()),
                    Err(e) => return (name, Err(e)),
                }
            }
            _ => None,
        };
        let p = principal.as_ref();
        let result = match name {
            "acquire" => self.acquire(req, p, client).await,
            "renew" => self.renew(req, p).await,
            "release" => self.release(req, p).await,
            "batch" => self.batch(req, p).await,
            "status" => self.status(req.uri().query(), p).await,
            "watch" => {
                let query = req.uri().query().map(str::to_string);
                drop(req);
                self.watch(query.as_deref(), p, client).await
            }
            "metrics" => self.metrics(),
            "healthz" => Ok(json_response(StatusCode::OK, &serde_json::json!({"status": "ok"}))),
            _ => self.readyz(),
        };
        (name, result)
    }

    async fn acquire(
        &self,
        req: Request<BoxBody>,
        p: Option<&Principal>,
        client: &Peer,
    ) -> Result<Response<BoxBody>, Error> {
        let body: AcquireRequest = self.read_json(req).await.inspect_err(|_| {
            self.metrics.lock_request("acquire", "invalid");
        })?;
        authorize(p, &body.key)?;
        // A principal (or client address) may hold only so many clients
        // waiting at once.
        let _slot = if body.wait_ms > 0 {
            let slot = self.waiting.enter(&owner_of(p, client));
            Some(slot.ok_or_else(|| Error::Locked { key: body.key.clone(), retry_after_ms: 1000 })?)
        } else {
            None
        };
        // A principal may fence only so many keys (a fence is for good).
        let new_key = self.authority.fences().fence(&body.key) == 0;
        if let Some(p) = p.filter(|p| new_key && self.fences.full(p)) {
            return Err(Error::FenceQuota { scope: "principal", limit: self.fences.limit }).inspect_err(|_| {
                tracing::warn!(principal = %p.name, "fence quota of the principal reached");
            });
        }
        let grant = self.authority.acquire(body).await?;
        if let Some(p) = p.filter(|_| new_key) {
            self.fences.add(p);
        }
        Ok(json_response(StatusCode::OK, &grant))
    }

    async fn renew(&self, req: Request<BoxBody>, p: Option<&Principal>) -> Result<Response<BoxBody>, Error> {
        let body: RenewRequest = self.read_json(req).await.inspect_err(|_| {
            self.metrics.lock_request("renew", "invalid");
        })?;
        authorize(p, &body.key)?;
        let view = self.authority.renew(body).await?;
        Ok(json_response(StatusCode::OK, &view))
    }

    async fn release(&self, req: Request<BoxBody>, p: Option<&Principal>) -> Result<Response<BoxBody>, Error> {
        let body: ReleaseRequest = self.read_json(req).await.inspect_err(|_| {
            self.metrics.lock_request("release", "invalid");
        })?;
        authorize(p, &body.key)?;
        #[derive(Serialize)]
        struct Released {
            key: String,
            released: bool,
        }
        let key = body.key.clone();
        self.authority.release(body).await?;
        Ok(json_response(StatusCode::OK, &Released { key, released: true }))
    }

    async fn status(&self, query: Option<&str>, p: Option<&Principal>) -> Result<Response<BoxBody>, Error> {
        let q = Query::parse(query)?;
        let key = q.required("key")?;
        authorize(p, &key)?;
        Ok(json_response(StatusCode::OK, &self.authority.status(&key).await?))
    }

    async fn watch(
        &self,
        query: Option<&str>,
        p: Option<&Principal>,
        client: &Peer,
    ) -> Result<Response<BoxBody>, Error> {
        let q = Query::parse(query)?;
        let key = q.required("key")?;
        authorize(p, &key)?;
        // A principal (or client address) may hold only so many watches
        // open at once; the slot goes with the request (answer or hang-up).
        let owner = owner_of(p, client);
        let Some(_slot) = self.watching.enter(&owner) else {
            return Err(Error::TooManyWatches { owner, limit: self.watching.limit });
        };
        let after = q.number("after")?.unwrap_or(0);
        let timeout_ms = q.number("timeout_ms")?.unwrap_or(30_000);
        let view = tokio::select! {
            v = self.authority.watch(&key, after, Duration::from_millis(timeout_ms)) => v?,
            () = self.shutdown.wait() => self.authority.status(&key).await?,
        };
        Ok(json_response(StatusCode::OK, &view))
    }

    /// The request's JSON body, read within the body deadline.
    async fn read_json<T: DeserializeOwned>(&self, req: Request<BoxBody>) -> Result<T, Error> {
        let timeout_ms = u64::try_from(self.body_read_timeout.as_millis()).unwrap_or(u64::MAX);
        tokio::time::timeout(self.body_read_timeout, read_json(req, self.max_body_bytes))
            .await
            .map_err(|_| Error::BodyTimeout { timeout_ms })?
    }

    fn metrics(&self) -> Result<Response<BoxBody>, Error> {
        let text = self.metrics.render().map_err(|e| Error::Internal(format!("rendering metrics: {e}")))?;
        let mut resp = Response::new(full(text));
        resp.headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"));
        Ok(resp)
    }

    fn readyz(&self) -> Result<Response<BoxBody>, Error> {
        if self.shutdown.is_triggered() {
            return Err(Error::Unavailable("shutting down".into()));
        }
        Ok(json_response(StatusCode::OK, &serde_json::json!({"status": "ready"})))
    }
}

/// `Ok` without authentication; else the principal must own the key.
fn authorize(p: Option<&Principal>, key: &str) -> Result<(), Error> {
    p.map_or(Ok(()), |p| p.authorize(key))
}

/// A JSON response with the given status.
pub fn json_response<T: Serialize>(status: StatusCode, value: &T) -> Response<BoxBody> {
    let bytes = serde_json::to_vec(value).unwrap_or_else(|_| b"{}".to_vec());
    let mut resp = Response::new(full(Bytes::from(bytes)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

/// Reads a JSON body of at most `limit` bytes: 413 above it, 400 when it
/// does not parse or does not have the expected fields.
async fn read_json<T: DeserializeOwned>(req: Request<BoxBody>, limit: u64) -> Result<T, Error> {
    let too_large = Error::PayloadTooLarge { limit_bytes: limit };
    let declared = crate::body::content_length(req.headers());
    if declared.is_some_and(|n| n > limit) {
        crate::body::drain(req.into_body(), crate::body::DRAIN_MAX_BYTES, Duration::from_secs(2)).await;
        return Err(too_large);
    }
    let mut body = req.into_body();
    let mut bytes = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| Error::BadRequest(format!("reading the request body: {e}")))?;
        if let Ok(data) = frame.into_data() {
            if bytes.len() as u64 + data.len() as u64 > limit {
                return Err(too_large);
            }
            bytes.extend_from_slice(&data);
        }
    }
    // Only a JSON object: serde would also take an array of the fields.
    // (Parsed straight into T, so a duplicated field is an error too.)
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(Error::BadRequest("the body must be a JSON object".into()));
    }
    serde_json::from_slice(&bytes).map_err(|e| Error::BadRequest(format!("invalid JSON body: {e}")))
}

/// A parsed query string.
struct Query(Vec<(String, String)>);

impl Query {
    fn parse(q: Option<&str>) -> Result<Query, Error> {
        let mut out = Vec::new();
        for pair in q.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let k = decode_component(k)?;
            if out.iter().any(|(seen, _)| *seen == k) {
                // Which one counts would be a guess (`status?key=a&key=b`).
                let k: String = k.chars().take(64).collect();
                return Err(Error::BadRequest(format!("query parameter {k} is given more than once")));
            }
            out.push((k, decode_component(v)?));
        }
        Ok(Query(out))
    }

    fn get(&self, name: &str) -> Option<&str> {
        self.0.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    fn required(&self, name: &str) -> Result<String, Error> {
        self.get(name)
            .map(str::to_string)
            .ok_or_else(|| Error::BadRequest(format!("query parameter {name} is required")))
    }

    fn number(&self, name: &str) -> Result<Option<u64>, Error> {
        self.get(name)
            .map(|v| {
                crate::fence::token::parse_one(v.as_bytes())
                    .map_err(|_| Error::BadRequest(format!("query parameter {name} must be an unsigned integer")))
            })
            .transpose()
    }
}

/// Percent-decodes a query component (`+` is a space).
fn decode_component(s: &str) -> Result<String, Error> {
    let bad = || Error::BadRequest("query string is not valid percent-encoded UTF-8".into());
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let hex = b.get(i + 1..i + 3).ok_or_else(bad)?;
                let text = std::str::from_utf8(hex).map_err(|_| bad())?;
                out.push(u8::from_str_radix(text, 16).map_err(|_| bad())?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| bad())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_components_decode() {
        let q = Query::parse(Some("key=orders%2F1&after=3&x")).unwrap();
        assert_eq!(q.get("key"), Some("orders/1"));
        assert_eq!(q.number("after").unwrap(), Some(3));
        assert!(Query::parse(Some("key=%zz")).is_err());
        assert!(Query::parse(Some("key=%ff")).is_err());
        assert!(Query::parse(Some("after=-1")).unwrap().number("after").is_err());
        assert!(Query::parse(Some("key=a&key=b")).is_err(), "a repeated parameter is ambiguous");
        assert!(Query::parse(Some("key=a&k%65y=b")).is_err(), "also when encoded differently");
    }
}
