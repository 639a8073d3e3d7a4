//! Upstream kinds behind one forwarding path: `http://` and `https://` (a
//! per-route pool of HTTP/1.1 connections, [`super::pool`]) and `file://`
//! (the built-in object store). Both take the same
//! checked request with a [`FencedBody`] and answer a response head; the
//! fence check has already happened in `proxy::handle` and is not repeated
//! or bypassed here.

use std::path::PathBuf;
use std::time::Duration;

use std::sync::Arc;

use http::uri::{Authority, PathAndQuery, Scheme};
use http::{HeaderValue, Request, Response, Uri};

use super::fenced_body::FencedBody;
use super::filestore::FileStore;
use super::pool::{Pool, PoolError};
use crate::error::Error;

/// A parsed `upstream` setting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpstreamUrl {
    /// `http://authority[/prefix]` or `https://…` (`tls`).
    Http { tls: bool, authority: Authority, prefix: String },
    /// `file://DIR`.
    File { dir: PathBuf },
}

impl UpstreamUrl {
    /// Parses and checks an upstream URL.
    pub fn parse(text: &str) -> Result<UpstreamUrl, String> {
        if let Some(dir) = text.strip_prefix("file://") {
            if dir.is_empty() {
                return Err("file:// needs a directory".into());
            }
            return Ok(UpstreamUrl::File { dir: PathBuf::from(dir) });
        }
        let uri: Uri = text.parse().map_err(|e| format!("not a URL: {e}"))?;
        let tls = match uri.scheme() {
            Some(s) if *s == Scheme::HTTP => false,
            Some(s) if *s == Scheme::HTTPS => true,
            _ => return Err("scheme must be http://, https:// or file://".into()),
        };
        let authority = uri.authority().cloned().ok_or("missing host")?;
        if authority.as_str().contains('@') {
            return Err("credentials in the URL are not allowed".into());
        }
        if uri.query().is_some() {
            return Err("a query is not allowed".into());
        }
        let prefix = uri.path().trim_end_matches('/').to_string();
        Ok(UpstreamUrl::Http { tls, authority, prefix })
    }
}

/// The request body type every upstream receives.
pub type UpstreamRequest = Request<FencedBody>;

/// A connected upstream of one route.
#[derive(Clone)]
#[allow(clippy::large_enum_variant)] // one per route, built once
pub enum Upstream {
    /// A pool of HTTP/1.1 connections to one authority.
    Http { pool: Arc<Pool>, scheme: Scheme, host: Option<HeaderValue>, prefix: String },
    /// The built-in object store.
    File(FileStore),
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Upstream::Http { scheme, pool, prefix, .. } => write!(f, "{scheme}://{}{prefix}", pool.authority()),
            Upstream::File(s) => write!(f, "{s:?}"),
        }
    }
}

impl Upstream {
    /// Builds the client (or opens the store) of one route; `timeouts`:
    /// its connect and upstream timeouts.
    pub fn connect(
        url: &UpstreamUrl,
        timeouts: (Duration, Duration),
        tls: &crate::tls::TlsFiles,
    ) -> Result<Upstream, Error> {
        match url {
            UpstreamUrl::Http { tls: use_tls, authority, prefix } => {
                let tls_config = if *use_tls { Some(crate::tls::client_config(tls)?) } else { None };
                let pool = Pool::new(authority.clone(), tls_config, timeouts, Duration::from_secs(60), 256)
                    .map_err(Error::Config)?;
                let scheme = if *use_tls { Scheme::HTTPS } else { Scheme::HTTP };
                let host = HeaderValue::from_str(authority.as_str()).ok();
                Ok(Upstream::Http { pool, scheme, host, prefix: prefix.clone() })
            }
            UpstreamUrl::File { dir } => Ok(Upstream::File(FileStore::open(dir)?)),
        }
    }

    /// The pool, path prefix and `Host` of a plain-text HTTP upstream: what
    /// the fast path needs. `None` for `https://` and the file store.
    pub fn plain_http(&self) -> Option<(&Arc<Pool>, &str, Option<&HeaderValue>)> {
        match self {
            Upstream::Http { pool, prefix, host, .. } if pool.is_plain() => Some((pool, prefix, host.as_ref())),
            _ => None,
        }
    }

    /// The authority to send as `Host` when the route rewrites it.
    pub fn host(&self) -> Option<HeaderValue> {
        match self {
            Upstream::Http { host, .. } => host.clone(),
            Upstream::File(_) => None,
        }
    }

    /// Sends the request and returns the upstream's response head with
    /// its body still streaming, or [`SendError::Timeout`] once `timeout`
    /// passed. `key_path`: the checked, decoded path (the file store's
    /// object name).
    ///
    /// The file store's timeout covers receiving the body and waiting for
    /// the object, never its commit: once the rename has begun it runs to
    /// its end before this returns, so a caller that holds an in-flight
    /// registration until then never lets it go while a write may still
    /// be applied.
    pub async fn send(
        &self,
        req: UpstreamRequest,
        key_path: &str,
        token: Option<u64>,
        timeout: std::time::Duration,
    ) -> Result<Response<crate::body::BoxBody>, SendError> {
        let deadline = tokio::time::Instant::now() + timeout;
        match self {
            Upstream::Http { .. } => tokio::time::timeout_at(deadline, self.send_http(req, deadline))
                .await
                .map_err(|_| SendError::Timeout)?,
            // Boxed, so the HTTP path's future does not carry the file
            // store's (larger) state.
            Upstream::File(store) => {
                Box::pin(store.handle(req, key_path, token, deadline)).await.map_err(|e| match e {
                    Error::UpstreamTimeout { .. } => SendError::Timeout,
                    e => SendError::Refused(e),
                })
            }
        }
    }

    async fn send_http(
        &self,
        mut req: UpstreamRequest,
        deadline: tokio::time::Instant,
    ) -> Result<Response<crate::body::BoxBody>, SendError> {
        match self {
            Upstream::Http { pool, prefix, .. } => {
                // Origin-form: the upstream sees `/prefix/path?query`.
                let pq = req.uri().path_and_query().map_or("/", PathAndQuery::as_str);
                let pq = if prefix.is_empty() {
                    PathAndQuery::try_from(pq)
                } else {
                    PathAndQuery::try_from(format!("{prefix}{pq}"))
                }
                .map_err(|e| SendError::Other(format!("building upstream URI: {e}")))?;
                *req.uri_mut() = Uri::from(pq);
                *req.version_mut() = http::Version::HTTP_11;
                let resp = pool.send(req, deadline).await.map_err(|e| match e {
                    PoolError::Connect(e) => SendError::Connect(e),
                    PoolError::Exchange(e) => SendError::Other(error_chain(&e)),
                })?;
                use http_body_util::BodyExt;
                Ok(resp.map(|b| b.map_err(Into::into).boxed_unsync()))
            }
            Upstream::File(_) => Err(SendError::Other("not an HTTP upstream".into())),
        }
    }
}

/// How sending upstream failed.
#[derive(Debug)]
pub enum SendError {
    /// Could not connect.
    Connect(String),
    /// The exchange broke (including a body cut off by us).
    Other(String),
    /// The built-in store refused with a client-facing error.
    Refused(Error),
    /// No answer within the route's timeout.
    Timeout,
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        out.push_str(": ");
        out.push_str(&s.to_string());
        cur = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_urls_parse() {
        assert_eq!(
            UpstreamUrl::parse("http://127.0.0.1:9000/base/").unwrap(),
            UpstreamUrl::Http { tls: false, authority: "127.0.0.1:9000".parse().unwrap(), prefix: "/base".into() }
        );
        assert!(matches!(UpstreamUrl::parse("file:///tmp/x").unwrap(), UpstreamUrl::File { .. }));
        assert!(matches!(UpstreamUrl::parse("https://h:8443").unwrap(), UpstreamUrl::Http { tls: true, .. }));
        for bad in ["ftp://x", "127.0.0.1:80", "http://u:p@h/", "http://h/?q=1", "file://"] {
            assert!(UpstreamUrl::parse(bad).is_err(), "{bad}");
        }
    }
}
