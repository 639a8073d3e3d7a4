//! The header-injecting sidecar of `fencegate lock --inject`: a loopback
//! forward proxy for one child process that puts the current fencing token
//! on every request and passes it on to the gateway.
//!
//! It lets programs that cannot be changed (curl, a Python upload, an S3
//! SDK) be fenced: they are pointed at it through `HTTP_PROXY`-style
//! variables (absolute-form requests go to the host they name) or through
//! `AWS_ENDPOINT_URL` / `FENCEGATE_PROXY_URL` (origin-form requests go to
//! the gateway's proxy listener). It never serves anything itself and
//! listens on loopback only. HTTPS through it (CONNECT) is refused: a token
//! cannot be added inside a TLS stream it does not terminate.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use http::uri::{Authority, Scheme};
use http::{HeaderValue, Method, Request, Response, Uri};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

use crate::body::BoxBody;
use crate::error::Error;
use crate::proxy::headers::strip_hop_by_hop;

/// A running injector; stops when dropped.
#[derive(Debug)]
pub struct Injector {
    /// Where the child should send its requests.
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Injector {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct State {
    client: Client<HttpConnector, BoxBody>,
    default_authority: Authority,
    token: HeaderValue,
    proxy_auth: Option<HeaderValue>,
}

/// Starts an injector on a free loopback port. `gateway`: the gateway's
/// proxy listener (`http://host:port`), where origin-form requests go.
/// `bearer`: sent as `Proxy-Authorization` for routes that require a
/// principal.
pub async fn start(gateway: &str, token: u64, bearer: Option<&str>) -> Result<Injector, Error> {
    let uri: Uri = gateway.parse().map_err(|e| Error::BadRequest(format!("gateway proxy URL {gateway:?}: {e}")))?;
    let default_authority =
        uri.authority().cloned().ok_or_else(|| Error::BadRequest("gateway proxy URL needs a host".into()))?;
    let listener =
        TcpListener::bind(("127.0.0.1", 0)).await.map_err(|e| Error::Internal(format!("binding the injector: {e}")))?;
    let addr = listener.local_addr().map_err(|e| Error::Internal(e.to_string()))?;
    let state = Arc::new(State {
        client: Client::builder(TokioExecutor::new()).build_http(),
        default_authority,
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
    Ok(Injector { addr, task })
}

async fn forward(state: &State, req: Request<Incoming>) -> Response<BoxBody> {
    if req.method() == Method::CONNECT {
        return Error::BadRequest("the injector cannot add a fencing token inside TLS (CONNECT); use http://".into())
            .into_response();
    }
    let (mut parts, body) = req.into_parts();
    let authority = parts.uri.authority().cloned().unwrap_or_else(|| state.default_authority.clone());
    let pq = parts.uri.path_and_query().map_or("/", |pq| pq.as_str()).to_string();
    let uri = match Uri::builder().scheme(Scheme::HTTP).authority(authority.clone()).path_and_query(pq).build() {
        Ok(u) => u,
        Err(e) => return Error::BadRequest(format!("request target: {e}")).into_response(),
    };
    strip_hop_by_hop(&mut parts.headers);
    parts.headers.insert(crate::client::FENCING_TOKEN_HEADER, state.token.clone());
    if let Some(auth) = &state.proxy_auth {
        parts.headers.insert(http::header::PROXY_AUTHORIZATION, auth.clone());
    }
    if !parts.headers.contains_key(http::header::HOST) {
        if let Ok(h) = HeaderValue::from_str(authority.as_str()) {
            parts.headers.insert(http::header::HOST, h);
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
