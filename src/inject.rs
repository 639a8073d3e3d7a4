//! The header-injecting sidecar of `fencegate lock --inject`: a loopback
//! forward proxy for one child process that puts the current fencing token
//! on every request and passes it on to the gateway's proxy listener.
//!
//! It lets programs that cannot be changed (curl, a Python upload, an S3
//! SDK) be fenced: they are pointed at it through `HTTP_PROXY`-style
//! variables (absolute-form requests) or through `FENCEGATE_PROXY_URL`
//! (origin-form requests). What it must never do:
//!
//! - forward anywhere but the gateway's proxy listener: an absolute-form
//!   request for any other authority, or for `https://` (never downgraded
//!   to plain http), is refused with 403 — the token and the principal's
//!   `Proxy-Authorization` must not reach a third party;
//! - serve anyone but its child: every request must carry the per-run
//!   random secret handed to the child in the proxy URL's userinfo
//!   (`http://fencegate:SECRET@127.0.0.1:PORT`, sent by clients as
//!   `Proxy-Authorization: Basic`, or as `Authorization: Basic` by one that
//!   took the URL as its base URL); without it, 407. Another local process
//!   that finds the port cannot write with the holder's token.
//!
//! It listens on loopback only and never serves anything itself. HTTPS
//! through it (CONNECT) is refused: a token cannot be added inside a TLS
//! stream it does not terminate.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use http::uri::{Authority, Scheme};
use http::{header, HeaderMap, HeaderValue, Method, Request, Response, Uri};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

use crate::body::BoxBody;
use crate::error::Error;
use crate::proxy::headers::strip_hop_by_hop;

/// The user name in the proxy URL's userinfo (the password is the secret).
pub const PROXY_USER: &str = "fencegate";

/// A running injector; stops when dropped.
pub struct Injector {
    /// Where the child should send its requests.
    pub addr: SocketAddr,
    secret: String,
    task: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for Injector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Injector").field("addr", &self.addr).finish_non_exhaustive()
    }
}

impl Injector {
    /// The URL to hand the child (`HTTP_PROXY`, `FENCEGATE_PROXY_URL`): the
    /// injector's address with the per-run secret as its userinfo.
    pub fn proxy_url(&self) -> String {
        format!("http://{PROXY_USER}:{}@{}", self.secret, self.addr)
    }
}

impl Drop for Injector {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct State {
    client: Client<HttpConnector, BoxBody>,
    gateway: Authority,
    /// The injector's own address: a client given the injector both as
    /// its proxy (`HTTP_PROXY`) and as a base URL names it as the target.
    own: Authority,
    /// `Basic <base64(fencegate:SECRET)>`, as a client sends it.
    credentials: Vec<u8>,
    token: HeaderValue,
    proxy_auth: Option<HeaderValue>,
}

/// Starts an injector on a free loopback port. `gateway`: the gateway's
/// proxy listener (`http://host:port`), the only place requests go.
/// `bearer`: sent as `Proxy-Authorization` for routes that require a
/// principal.
///
/// Boxed at the crate boundary, like `Gateway::start`: awaited as a concrete
/// future from the binary, its async code would be compiled again there.
#[inline(never)]
pub fn start<'a>(
    gateway: &'a str,
    token: u64,
    bearer: Option<&'a str>,
) -> Pin<Box<dyn Future<Output = Result<Injector, Error>> + Send + 'a>> {
    Box::pin(start_inner(gateway, token, bearer))
}

async fn start_inner(gateway: &str, token: u64, bearer: Option<&str>) -> Result<Injector, Error> {
    let uri: Uri = gateway.parse().map_err(|e| Error::Config(format!("gateway proxy URL {gateway:?}: {e}")))?;
    if uri.scheme() != Some(&Scheme::HTTP) {
        // The injector speaks plain http to the gateway; an https:// gateway
        // would be downgraded, so it is refused instead.
        return Err(Error::Config(format!(
            "gateway proxy URL {gateway:?}: the injector forwards over plain http:// only"
        )));
    }
    let gateway = uri.authority().cloned().ok_or_else(|| Error::Config("gateway proxy URL needs a host".into()))?;
    let mut random = [0u8; 16];
    getrandom::fill(&mut random).map_err(|e| Error::Internal(format!("drawing the injector's secret: {e}")))?;
    let secret: String = random.iter().map(|b| format!("{b:02x}")).collect();
    let listener =
        TcpListener::bind(("127.0.0.1", 0)).await.map_err(|e| Error::Internal(format!("binding the injector: {e}")))?;
    let addr = listener.local_addr().map_err(|e| Error::Internal(e.to_string()))?;
    let credentials = format!("Basic {}", base64(format!("{PROXY_USER}:{secret}").as_bytes())).into_bytes();
    let own: Authority =
        addr.to_string().parse().map_err(|e| Error::Internal(format!("the injector's own address: {e}")))?;
    let state = Arc::new(State {
        client: Client::builder(TokioExecutor::new()).build_http(),
        gateway,
        own,
        credentials,
        token: HeaderValue::from(token),
        proxy_auth: bearer.and_then(|b| HeaderValue::from_str(&format!("Bearer {b}")).ok()),
    });
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { continue };
            let state = state.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let state = state.clone();
                    async move { Ok::<_, Infallible>(forward(&state, req).await) }
                });
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), svc).await;
            });
        }
    });
    Ok(Injector { addr, secret, task })
}

/// True when `header` carries the per-run credentials (compared in
/// constant time).
fn carries_secret(headers: &HeaderMap, name: &header::HeaderName, credentials: &[u8]) -> bool {
    headers.get_all(name).iter().any(|v| {
        let v = v.as_bytes().trim_ascii();
        v.len() == credentials.len() && v.iter().zip(credentials).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    })
}

/// Where an accepted request goes: always the gateway. `Err`: a target
/// that is not the gateway's proxy listener (or the injector itself, as
/// a base URL) over plain http.
fn target(state: &State, uri: &Uri) -> Result<Uri, Error> {
    if let Some(authority) = uri.authority() {
        if uri.scheme() != Some(&Scheme::HTTP) {
            return Err(Error::Forbidden(format!(
                "the injector forwards only to the gateway's proxy listener http://{}; {uri} is not it (and \
                 https is never downgraded to http)",
                state.gateway
            )));
        }
        if !same_authority(authority, &state.gateway) && !same_authority(authority, &state.own) {
            return Err(Error::Forbidden(format!(
                "the injector forwards only to the gateway's proxy listener http://{}, not to {authority}",
                state.gateway
            )));
        }
    }
    let pq = uri.path_and_query().map_or("/", |pq| pq.as_str());
    Uri::builder()
        .scheme(Scheme::HTTP)
        .authority(state.gateway.clone())
        .path_and_query(pq)
        .build()
        .map_err(|e| Error::BadRequest(format!("request target: {e}")))
}

/// Host compared without case, the port with http's default (80).
fn same_authority(a: &Authority, b: &Authority) -> bool {
    a.host().eq_ignore_ascii_case(b.host()) && a.port_u16().unwrap_or(80) == b.port_u16().unwrap_or(80)
}

async fn forward(state: &State, req: Request<Incoming>) -> Response<BoxBody> {
    let (mut parts, body) = req.into_parts();
    // 1. Only the child: the secret as proxy credentials, or as the
    //    credentials of a base URL (then they are the injector's, removed).
    let by_proxy = carries_secret(&parts.headers, &header::PROXY_AUTHORIZATION, &state.credentials);
    if !by_proxy {
        if !carries_secret(&parts.headers, &header::AUTHORIZATION, &state.credentials) {
            return Error::ProxyAuthRequired.into_response();
        }
        parts.headers.remove(header::AUTHORIZATION);
    }
    if parts.method == Method::CONNECT {
        return Error::BadRequest("the injector cannot add a fencing token inside TLS (CONNECT); use http://".into())
            .into_response();
    }
    // 2. Only the gateway.
    let uri = match target(state, &parts.uri) {
        Ok(u) => u,
        Err(e) => return e.into_response(),
    };
    strip_hop_by_hop(&mut parts.headers);
    parts.headers.insert(crate::client::FENCING_TOKEN_HEADER, state.token.clone());
    if let Some(auth) = &state.proxy_auth {
        parts.headers.insert(header::PROXY_AUTHORIZATION, auth.clone());
    }
    if !parts.headers.contains_key(header::HOST) {
        if let Ok(h) = HeaderValue::from_str(state.gateway.as_str()) {
            parts.headers.insert(header::HOST, h);
        }
    }
    parts.uri = uri;
    parts.version = http::Version::HTTP_11;
    let req = Request::from_parts(parts, body.map_err(Into::into).boxed_unsync());
    match state.client.request(req).await {
        Ok(resp) => resp.map(|b| b.map_err(Into::into).boxed_unsync()),
        Err(e) => Error::UpstreamUnavailable(format!("forwarding to the gateway: {e}")).into_response(),
    }
}

/// Standard base64 with padding (RFC 4648), for Basic credentials.
fn base64(input: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(input.len().div_ceil(3) * 4);
    for chunk in input.chunks(3) {
        let b = [chunk[0], chunk.get(1).copied().unwrap_or(0), chunk.get(2).copied().unwrap_or(0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_rfc_4648() {
        for (plain, encoded) in
            [("", ""), ("f", "Zg=="), ("fo", "Zm8="), ("foo", "Zm9v"), ("foob", "Zm9vYg=="), ("fooba", "Zm9vYmE=")]
        {
            assert_eq!(base64(plain.as_bytes()), encoded);
        }
        assert_eq!(base64(b"Aladdin:open sesame"), "QWxhZGRpbjpvcGVuIHNlc2FtZQ==");
    }

    #[test]
    fn authorities_compare_without_case_and_with_the_default_port() {
        let a = |s: &str| s.parse::<Authority>().unwrap();
        assert!(same_authority(&a("GW.local:80"), &a("gw.local")));
        assert!(!same_authority(&a("127.0.0.1:8081"), &a("127.0.0.1:8080")));
        assert!(!same_authority(&a("localhost:8080"), &a("127.0.0.1:8080")));
    }

    #[test]
    fn only_the_gateway_or_the_injector_itself_are_targets() {
        let a = |s: &str| s.parse::<Authority>().unwrap();
        let state = State {
            client: Client::builder(TokioExecutor::new()).build_http(),
            gateway: a("127.0.0.1:8080"),
            own: a("127.0.0.1:40000"),
            credentials: Vec::new(),
            token: HeaderValue::from(1u64),
            proxy_auth: None,
        };
        let u = |s: &str| s.parse::<Uri>().unwrap();
        for ok in ["/k", "http://127.0.0.1:8080/k", "http://127.0.0.1:40000/k"] {
            assert_eq!(target(&state, &u(ok)).unwrap().to_string(), "http://127.0.0.1:8080/k", "{ok}");
        }
        for bad in ["http://127.0.0.1:9/k", "https://127.0.0.1:8080/k", "http://example.com/k"] {
            assert!(target(&state, &u(bad)).is_err(), "{bad}");
        }
    }
}
