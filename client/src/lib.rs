//! The Rust client of the lease API: one-shot calls, a [`Lease`] that
//! renews itself and says when it is lost, a [`LeaseGroup`] that renews
//! many leases in batches (`group`), leader election on top, and a
//! helper that puts the fencing token on a request.
//!
//! What a [`Lease`] guarantees: `lost()` resolves as soon as a renewal is
//! refused **or** the local monotonic deadline passes without a successful
//! renewal. That deadline is counted from the moment *before* the acquire
//! (or renew) request was sent, so the client always underestimates what
//! it has left: when the gateway still thinks the lease is live, so does
//! the client, never the other way round. It does not make the lease safe
//! by itself — a paused process cannot notice anything — which is why every
//! write carries the token and the gateway checks it.
//!
//! A crate of its own: a service that only locks and attaches tokens
//! depends on this one and compiles neither the gateway nor RocksDB. The
//! gateway re-exports it as `fencegate::client`.

use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use tokio::sync::watch;
use tokio::time::Instant;

mod group;
mod tls;
mod views;

pub use group::{GroupLease, LeaseGroup, BATCH_LIMIT};
pub use tls::{client_config, TlsFiles};
pub use views::{GrantView, RenewView, StatusView};

/// The header every fenced mutation carries.
pub const FENCING_TOKEN_HEADER: &str = "x-fencing-token";

/// The optional header that orders one holder's own writes.
pub const FENCING_SEQUENCE_HEADER: &str = "x-fencing-sequence";

/// Why a call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClientError {
    /// The key is held and the wait ran out.
    #[error("locked; retry in {retry_after_ms} ms")]
    Locked { retry_after_ms: u64 },
    /// The lease is unknown, expired, released or superseded.
    #[error("lease lost")]
    LeaseLost,
    /// Release by someone who does not hold the key.
    #[error("not the owner")]
    NotOwner,
    /// The gateway could not be reached or did not answer.
    #[error("gateway unreachable: {0}")]
    Unreachable(String),
    /// Any other refusal, with the gateway's code and message.
    #[error("{status} {code}: {message}")]
    Api { status: u16, code: String, message: String },
}

/// A client of one gateway's api listener.
#[derive(Clone)]
pub struct Client {
    base: String,
    http: hyper_util::client::legacy::Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>,
    bearer: Option<String>,
    timeout: Duration,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").field("base", &self.base).finish_non_exhaustive()
    }
}

/// Puts the fencing token on a request (any body type).
pub fn with_token<B>(req: &mut Request<B>, token: u64) {
    let (name, value) = token_header(token);
    req.headers_mut().insert(name, value);
}

/// The `X-Fencing-Token` header as a name/value pair, for HTTP clients that
/// take `http` types (reqwest's `RequestBuilder::header`, tower, ureq):
/// `builder.header(name, value)`.
pub fn token_header(token: u64) -> (http::HeaderName, HeaderValue) {
    (http::HeaderName::from_static(FENCING_TOKEN_HEADER), HeaderValue::from(token))
}

/// The `X-Fencing-Sequence` header as a name/value pair.
pub fn sequence_header(sequence: u64) -> (http::HeaderName, HeaderValue) {
    (http::HeaderName::from_static(FENCING_SEQUENCE_HEADER), HeaderValue::from(sequence))
}

impl Client {
    /// A client for `url`, e.g. `http://127.0.0.1:7070`.
    /// `https://` URLs use the system roots; see [`Client::with_tls`].
    pub fn new(url: &str) -> Result<Client, ClientError> {
        Client::with_tls(url, &TlsFiles::default())
    }

    /// A client with its own CA bundle and/or a client certificate (mTLS).
    pub fn with_tls(url: &str, tls: &TlsFiles) -> Result<Client, ClientError> {
        let uri: Uri = url.parse().map_err(|e| ClientError::Unreachable(format!("bad URL {url:?}: {e}")))?;
        if !matches!(uri.scheme_str(), Some("http" | "https")) {
            return Err(ClientError::Unreachable(format!("URL {url:?} needs http:// or https://")));
        }
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_secs(5)));
        connector.enforce_http(false);
        let config = client_config(tls).map_err(ClientError::Unreachable)?;
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(config)
            .https_or_http()
            .enable_http1()
            .wrap_connector(connector);
        let http = hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build(https);
        Ok(Client { base: url.trim_end_matches('/').to_string(), http, bearer: None, timeout: Duration::from_secs(10) })
    }

    /// Sends `Authorization: Bearer TOKEN` with every call.
    pub fn with_bearer(mut self, token: impl Into<String>) -> Client {
        self.bearer = Some(token.into());
        self
    }

    /// The api listener's base URL.
    pub fn url(&self) -> &str {
        &self.base
    }

    async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
        timeout: Duration,
    ) -> Result<T, ClientError> {
        let mut req = Request::builder().method(method).uri(format!("{}{path}", self.base));
        if let Some(b) = &self.bearer {
            req = req.header(header::AUTHORIZATION, format!("Bearer {b}"));
        }
        let bytes = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
        let req = req
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(bytes))
            .map_err(|e| ClientError::Unreachable(format!("building the request: {e}")))?;
        let exchange = async {
            let resp = self.http.request(req).await.map_err(|e| ClientError::Unreachable(e.to_string()))?;
            let status = resp.status();
            let body = resp.into_body().collect().await.map_err(|e| ClientError::Unreachable(e.to_string()))?;
            Ok::<_, ClientError>((status, body.to_bytes()))
        };
        let (status, body) = tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| ClientError::Unreachable(format!("no answer within {} ms", timeout.as_millis())))??;
        if status == StatusCode::OK {
            return serde_json::from_slice(&body).map_err(|e| ClientError::Unreachable(format!("bad answer: {e}")));
        }
        let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        Err(refusal(status.as_u16(), &v))
    }

    /// One acquire call, no renewal.
    pub async fn acquire_once(
        &self,
        key: &str,
        ttl: Duration,
        wait: Duration,
        holder: &str,
    ) -> Result<GrantView, ClientError> {
        let body = json!({"key": key, "ttl_ms": millis(ttl), "wait_ms": millis(wait), "holder": holder});
        self.call(Method::POST, "/v1/locks/acquire", Some(body), self.timeout + wait).await
    }

    /// One renew call. `ttl`: a new TTL, or `None` to keep it.
    pub async fn renew(&self, key: &str, lease_id: &str, ttl: Option<Duration>) -> Result<RenewView, ClientError> {
        let mut body = json!({"key": key, "lease_id": lease_id});
        if let Some(t) = ttl {
            body["ttl_ms"] = json!(millis(t));
        }
        self.call(Method::POST, "/v1/locks/renew", Some(body), self.timeout).await
    }

    /// One release call.
    pub async fn release(&self, key: &str, lease_id: &str) -> Result<(), ClientError> {
        let body = json!({"key": key, "lease_id": lease_id});
        self.call::<Value>(Method::POST, "/v1/locks/release", Some(body), self.timeout).await.map(|_| ())
    }

    /// The key's fence and holder.
    pub async fn status(&self, key: &str) -> Result<StatusView, ClientError> {
        self.call(Method::GET, &format!("/v1/locks/status?key={}", encode(key)), None, self.timeout).await
    }

    /// Long-polls until the holder's token differs from `after`.
    pub async fn watch(&self, key: &str, after: u64, timeout: Duration) -> Result<StatusView, ClientError> {
        let path = format!("/v1/locks/watch?key={}&after={after}&timeout_ms={}", encode(key), millis(timeout));
        self.call(Method::GET, &path, None, self.timeout + timeout).await
    }

    /// Acquires `key` (waiting up to `wait`) and keeps it renewed every
    /// `ttl / 3` until released, dropped or lost.
    pub async fn acquire(&self, key: &str, ttl: Duration, wait: Duration) -> Result<Lease, ClientError> {
        self.acquire_as(key, ttl, wait, "").await
    }

    /// [`Client::acquire`] with a holder label.
    pub async fn acquire_as(
        &self,
        key: &str,
        ttl: Duration,
        wait: Duration,
        holder: &str,
    ) -> Result<Lease, ClientError> {
        // The local deadline starts before the request is sent: the grant
        // cannot have been made earlier, so the client never overestimates.
        let sent = Instant::now();
        let grant = self.acquire_once(key, ttl, wait, holder).await?;
        // After a wait in the queue, `sent` may be long before the grant;
        // renew at once to move the local deadline up to a fresh bound.
        Ok(Lease::start(self.clone(), grant, ttl, sent, !wait.is_zero()))
    }

    /// Campaigns for leadership of `name`: resolves when elected.
    pub async fn campaign(&self, name: &str, candidate: &str, ttl: Duration) -> Result<Leadership, ClientError> {
        loop {
            match self.acquire_as(name, ttl, Duration::from_secs(60), candidate).await {
                Ok(lease) => return Ok(Leadership { lease }),
                Err(ClientError::Locked { .. }) => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// The leaders of `name` as they change: each item is the status after
    /// a change of holder (`held == false` while nobody leads).
    pub fn observe(
        &self,
        name: &str,
    ) -> impl futures_util::Stream<Item = Result<StatusView, ClientError>> + Send + 'static {
        let client = self.clone();
        let name = name.to_string();
        futures_util::stream::unfold(None::<u64>, move |after| {
            let (client, name) = (client.clone(), name.clone());
            async move {
                loop {
                    let result = match after {
                        None => client.status(&name).await,
                        Some(a) => client.watch(&name, a, Duration::from_secs(30)).await,
                    };
                    match result {
                        Ok(s) => {
                            let token = s.fencing_token.unwrap_or(0);
                            if after == Some(token) {
                                continue; // a timeout without change
                            }
                            return Some((Ok(s), Some(token)));
                        }
                        Err(e) => return Some((Err(e), after)),
                    }
                }
            }
        })
    }
}

/// The error a refusal's status and JSON body stand for.
fn refusal(status: u16, v: &Value) -> ClientError {
    let code = v["error"].as_str().unwrap_or("").to_string();
    match code.as_str() {
        "locked" => ClientError::Locked { retry_after_ms: v["retry_after_ms"].as_u64().unwrap_or(0) },
        "lease_lost" => ClientError::LeaseLost,
        "not_owner" => ClientError::NotOwner,
        _ => ClientError::Api { status, code, message: v["message"].as_str().unwrap_or("").to_string() },
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b'/' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A held lock that renews itself in the background. Its `Debug` never
/// shows the lease id (the bearer secret of renew and release).
pub struct Lease {
    client: Client,
    key: String,
    token: u64,
    lease_id: String,
    lost: watch::Receiver<bool>,
    renewer: tokio::task::JoinHandle<()>,
    released: bool,
    /// The last `X-Fencing-Sequence` handed out (see [`Lease::sequenced`]).
    sequence: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("client", &self.client)
            .field("key", &self.key)
            .field("token", &self.token)
            .field("lease_id", &"<redacted>")
            .field("lost", &*self.lost.borrow())
            .field("released", &self.released)
            .finish_non_exhaustive()
    }
}

impl Lease {
    fn start(client: Client, grant: GrantView, ttl: Duration, sent: Instant, renew_now: bool) -> Lease {
        let (tx, rx) = watch::channel(false);
        let renewer = tokio::spawn(renew_loop(
            client.clone(),
            grant.key.clone(),
            grant.lease_id.clone(),
            ttl,
            sent,
            renew_now,
            tx,
        ));
        Lease {
            client,
            key: grant.key,
            token: grant.fencing_token,
            lease_id: grant.lease_id,
            lost: rx,
            renewer,
            released: false,
            sequence: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// The fencing token: put it on every write (`X-Fencing-Token`).
    pub fn token(&self) -> u64 {
        self.token
    }

    /// The `X-Fencing-Token` header carrying this lease's token; see
    /// [`token_header`].
    pub fn header(&self) -> (http::HeaderName, HeaderValue) {
        token_header(self.token)
    }

    /// The next `X-Fencing-Sequence` of this lease: 1, 2, 3, … Number a
    /// write once and send every retry of it with the same number; the
    /// gateway then refuses the write if a later-numbered one was already
    /// forwarded (409 `stale_sequence`), so a delayed or retried write of
    /// this holder never lands after a newer one.
    pub fn next_sequence(&self) -> u64 {
        self.sequence.fetch_add(1, std::sync::atomic::Ordering::AcqRel) + 1
    }

    /// Both headers of a sequenced write: this lease's token and its next
    /// sequence (see [`Lease::next_sequence`]).
    pub fn sequenced(&self) -> [(http::HeaderName, HeaderValue); 2] {
        [token_header(self.token), sequence_header(self.next_sequence())]
    }

    /// The key held.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The lease id: the bearer secret of renew and release. Keep it to
    /// yourself; it is needed only to hand the lease to another process.
    pub fn lease_id(&self) -> &str {
        &self.lease_id
    }

    /// True once the lease is known lost.
    pub fn is_lost(&self) -> bool {
        *self.lost.borrow()
    }

    /// Resolves when the lease is lost: a renewal was refused, or the local
    /// deadline passed without a successful renewal.
    pub async fn lost(&self) {
        let mut rx = self.lost.clone();
        let _ = rx.wait_for(|lost| *lost).await;
    }

    /// Stops renewing without releasing: the lease runs out at its TTL, as
    /// if this process had died or frozen (tests, examples, hand-overs).
    pub fn abandon(mut self) {
        self.released = true;
        self.renewer.abort();
    }

    /// Stops renewing and releases the key.
    pub async fn release(mut self) -> Result<(), ClientError> {
        self.released = true;
        self.renewer.abort();
        self.client.release(&self.key, &self.lease_id).await
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.renewer.abort();
        if self.released {
            return;
        }
        // Best effort: release in the background if a runtime is there.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let (client, key, id) = (self.client.clone(), self.key.clone(), self.lease_id.clone());
            rt.spawn(async move {
                let _ = client.release(&key, &id).await;
            });
        }
    }
}

async fn renew_loop(
    client: Client,
    key: String,
    lease_id: String,
    ttl: Duration,
    sent: Instant,
    renew_now: bool,
    lost: watch::Sender<bool>,
) {
    let mut deadline = sent + ttl;
    let period = ttl / 3;
    let mut next = sent + period;
    if renew_now {
        let sent = Instant::now();
        match tokio::time::timeout(ttl, client.renew(&key, &lease_id, None)).await {
            Ok(Ok(_)) => {
                deadline = sent + ttl;
                next = sent + period;
            }
            Ok(Err(ClientError::LeaseLost)) | Err(_) => {
                let _ = lost.send(true);
                return;
            }
            Ok(Err(_)) => {}
        }
    }
    loop {
        tokio::select! {
            () = tokio::time::sleep_until(deadline) => {
                let _ = lost.send(true);
                return;
            }
            () = tokio::time::sleep_until(next) => {}
        }
        let sent = Instant::now();
        let attempt = tokio::time::timeout_at(deadline, client.renew(&key, &lease_id, None)).await;
        match attempt {
            Ok(Ok(_)) => {
                deadline = sent + ttl;
                next = sent + period;
            }
            Ok(Err(ClientError::LeaseLost)) => {
                let _ = lost.send(true);
                return;
            }
            // Unreachable or slow: try again soon, until the deadline.
            Ok(Err(_)) => next = Instant::now() + (period / 4).max(Duration::from_millis(20)),
            Err(_) => {
                let _ = lost.send(true);
                return;
            }
        }
    }
}

/// Leadership of an election: the term is the fencing token.
#[derive(Debug)]
pub struct Leadership {
    lease: Lease,
}

impl Leadership {
    /// The term: strictly increasing across leaders of one election.
    pub fn term(&self) -> u64 {
        self.lease.token()
    }
    /// The election's name.
    pub fn name(&self) -> &str {
        self.lease.key()
    }
    /// Resolves when leadership is lost.
    pub async fn lost(&self) {
        self.lease.lost().await;
    }
    /// True once leadership is known lost.
    pub fn is_lost(&self) -> bool {
        self.lease.is_lost()
    }
    /// Stops renewing without resigning, as a crashed leader would.
    pub fn abandon(self) {
        self.lease.abandon();
    }

    /// Steps down.
    pub async fn resign(self) -> Result<(), ClientError> {
        self.lease.release().await
    }
}
