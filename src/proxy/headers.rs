//! Header handling of a good reverse proxy: hop-by-hop headers removed
//! both ways, `X-Forwarded-For/-Proto/-Host` and `Via` set, `Host`
//! preserved or rewritten. Conditional headers (`If-Match`, …) are never
//! touched: fencing adds to storage-level compare-and-set, it does not
//! replace it.

use std::net::SocketAddr;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, Version};

use crate::config::HostHeader;

/// Headers that describe one connection, not the message (RFC 9110 7.6.1).
const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Who sent the request, as the listener saw it.
#[derive(Debug, Clone)]
pub struct ClientInfo {
    pub addr: SocketAddr,
    pub tls: bool,
    /// Common name of the verified client certificate (mTLS).
    pub peer_cn: Option<std::sync::Arc<str>>,
}

/// The fencing token header.
pub static X_FENCING_TOKEN: HeaderName = HeaderName::from_static("x-fencing-token");

/// Removes `Connection`, every header it names, and the fixed hop-by-hop set.
pub fn strip_hop_by_hop(h: &mut HeaderMap) {
    let named: Vec<HeaderName> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for n in named {
        h.remove(n);
    }
    for n in HOP_BY_HOP {
        h.remove(n);
    }
}

fn via_value(v: Version) -> HeaderValue {
    HeaderValue::from_static(match v {
        Version::HTTP_2 => "2 fencegate",
        Version::HTTP_10 => "1.0 fencegate",
        _ => "1.1 fencegate",
    })
}

fn append_list(h: &mut HeaderMap, name: HeaderName, item: &str) {
    let joined = match h.get(&name).and_then(|v| v.to_str().ok()) {
        Some(prev) if !prev.is_empty() => format!("{prev}, {item}"),
        _ => item.to_string(),
    };
    if let Ok(v) = HeaderValue::from_str(&joined) {
        h.insert(name, v);
    }
}

/// Prepares a request for the upstream.
pub fn prepare_request<B>(
    req: &mut Request<B>,
    client: &ClientInfo,
    host_mode: HostHeader,
    upstream_host: Option<HeaderValue>,
    forward_token: bool,
) {
    let version = req.version();
    let original_host = req
        .headers()
        .get(header::HOST)
        .cloned()
        .or_else(|| req.uri().authority().and_then(|a| HeaderValue::from_str(a.as_str()).ok()));
    let h = req.headers_mut();
    strip_hop_by_hop(h);
    append_list(h, HeaderName::from_static("x-forwarded-for"), &client.addr.ip().to_string());
    h.insert(
        HeaderName::from_static("x-forwarded-proto"),
        HeaderValue::from_static(if client.tls { "https" } else { "http" }),
    );
    if let Some(host) = &original_host {
        h.insert(HeaderName::from_static("x-forwarded-host"), host.clone());
    }
    let via = via_value(version);
    append_list(h, header::VIA, via.to_str().unwrap_or("1.1 fencegate"));
    match (host_mode, upstream_host) {
        (HostHeader::Rewrite, Some(up)) => {
            h.insert(header::HOST, up);
        }
        _ => {
            if let Some(host) = original_host {
                h.insert(header::HOST, host);
            }
        }
    }
    if !forward_token {
        h.remove(&X_FENCING_TOKEN);
    }
}

/// Prepares an upstream response for the client.
pub fn prepare_response<B>(resp: &mut Response<B>) {
    let version = resp.version();
    let h = resp.headers_mut();
    strip_hop_by_hop(h);
    let via = via_value(version);
    append_list(h, header::VIA, via.to_str().unwrap_or("1.1 fencegate"));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client() -> ClientInfo {
        ClientInfo { addr: "10.1.2.3:5555".parse().unwrap(), tls: false, peer_cn: None }
    }

    #[test]
    fn hop_by_hop_headers_are_removed() {
        let mut req = Request::builder()
            .header("connection", "close, x-secret")
            .header("x-secret", "1")
            .header("keep-alive", "timeout=5")
            .header("te", "trailers")
            .header("upgrade", "websocket")
            .header("proxy-authorization", "x")
            .header("if-match", "\"e\"")
            .header("host", "front")
            .body(())
            .unwrap();
        prepare_request(&mut req, &client(), HostHeader::Preserve, None, true);
        let h = req.headers();
        for gone in ["connection", "x-secret", "keep-alive", "te", "upgrade", "proxy-authorization"] {
            assert!(!h.contains_key(gone), "{gone}");
        }
        assert_eq!(h["if-match"], "\"e\"");
        assert_eq!(h["host"], "front");
        assert_eq!(h["x-forwarded-host"], "front");
        assert_eq!(h["x-forwarded-for"], "10.1.2.3");
        assert_eq!(h["x-forwarded-proto"], "http");
        assert_eq!(h["via"], "1.1 fencegate");
    }

    #[test]
    fn forwarded_for_is_appended() {
        let mut req = Request::builder().header("x-forwarded-for", "1.1.1.1").body(()).unwrap();
        prepare_request(&mut req, &client(), HostHeader::Preserve, None, true);
        assert_eq!(req.headers()["x-forwarded-for"], "1.1.1.1, 10.1.2.3");
    }

    #[test]
    fn host_rewrite_and_token_removal() {
        let mut req = Request::builder().header("host", "front").header("x-fencing-token", "5").body(()).unwrap();
        let up = HeaderValue::from_static("127.0.0.1:9000");
        prepare_request(&mut req, &client(), HostHeader::Rewrite, Some(up), false);
        assert_eq!(req.headers()["host"], "127.0.0.1:9000");
        assert!(!req.headers().contains_key("x-fencing-token"));
    }
}
