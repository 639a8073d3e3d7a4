//! Header handling of a good reverse proxy: hop-by-hop headers removed
//! both ways, `X-Forwarded-For/-Proto/-Host` and `Via` set, `Host`
//! preserved or rewritten. Conditional headers (`If-Match`, …) are never
//! touched: fencing adds to storage-level compare-and-set, it does not
//! replace it.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, Version};

use crate::config::HostHeader;
use crate::http1::HOP_BY_HOP;
use crate::peer::Peer;

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// The fencing token header.
pub static X_FENCING_TOKEN: HeaderName = HeaderName::from_static("x-fencing-token");

/// The optional per-grant sequence of one holder's writes.
pub static X_FENCING_SEQUENCE: HeaderName = HeaderName::from_static("x-fencing-sequence");

/// The refusal of a request whose `Connection` names a fencing header:
/// hop-by-hop removal would strip the token after the fence check, so a
/// backend that checks tokens itself would never see it. Both transports
/// refuse such a request with this one error before anything else.
pub fn fencing_header_named_hop_by_hop() -> crate::error::Error {
    crate::error::Error::BadRequest(
        "Connection must not name X-Fencing-Token or X-Fencing-Sequence: they are end-to-end headers".into(),
    )
}

/// The headers this gateway reads to decide, or writes for the upstream
/// to trust: fencing tokens and sequence, method overrides, second
/// targets, forwarding.
const OWN_HEADERS: [&str; 11] = [
    "x-fencing-token",
    "x-fencing-tokens",
    "x-fencing-sequence",
    "x-http-method-override",
    "x-http-method",
    "x-method-override",
    "x-original-url",
    "x-rewrite-url",
    "x-forwarded-for",
    "x-forwarded-host",
    "x-forwarded-proto",
];

/// Headers by which a request names another resource than its path, and
/// which backends obey: WebDAV's `Destination` (`COPY` and `MOVE` write
/// there: RFC 4918) and the URL-rewrite headers of IIS, Symfony and Zend
/// (`X-Original-URL`, `X-Rewrite-URL`: the backend serves that URL instead
/// of the request line's). The fence of the path does not cover what such
/// a mutation changes: an outside review overwrote another holder's object
/// with `COPY /mine` + `Destination: /theirs` under the token of `/mine`.
pub const SECOND_TARGETS: [&str; 3] = ["destination", "x-original-url", "x-rewrite-url"];

/// The first of [`SECOND_TARGETS`] a request carries.
pub fn second_target(h: &HeaderMap) -> Option<&'static str> {
    SECOND_TARGETS.iter().copied().find(|name| h.contains_key(*name))
}

/// The refusal of a mutation carrying a [`second_target`] on a fenced
/// HTTP route (400: the request is not one the gateway can fence).
pub fn second_target_refused(name: &str) -> crate::error::Error {
    crate::error::Error::BadRequest(format!(
        "a mutation carrying {name} changes a resource its path does not name, which this gateway cannot fence"
    ))
}

/// The first header whose name has an underscore and, read with every `_`
/// as `-`, is one of [`OWN_HEADERS`] (`X_Fencing_Token`,
/// `X-HTTP_Method-Override`). CGI, WSGI, PHP and Rack backends read both
/// spellings as one variable (`HTTP_X_FENCING_TOKEN`), so such a header
/// would reach them as one this gateway never checked or set: a `GET`
/// with `X_HTTP_Method_Override: DELETE` deleted through a read, and a
/// token the gateway did not admit reached the backend beside the one it
/// did. Both transports refuse such a request (nginx drops every header
/// with an underscore by default for the same reason); other headers
/// with underscores pass untouched.
pub fn underscore_alias(h: &HeaderMap) -> Option<&HeaderName> {
    h.keys().find(|name| {
        let n = name.as_str().as_bytes();
        n.contains(&b'_')
            && OWN_HEADERS.iter().any(|own| {
                own.len() == n.len()
                    && own.bytes().zip(n).all(|(o, c)| o == c.to_ascii_lowercase() || (o == b'-' && *c == b'_'))
            })
    })
}

/// The refusal of a request carrying an [`underscore_alias`].
pub fn underscore_alias_refused(name: &HeaderName) -> crate::error::Error {
    crate::error::Error::BadRequest(format!(
        "header {name} is refused: backends that read '_' as '-' would take it for {}, which this gateway did not \
         check; send it with dashes",
        name.as_str().replace('_', "-")
    ))
}

/// True when `Transfer-Encoding` names a coding besides `chunked`
/// (`gzip, chunked`): the server takes the chunked framing off and leaves
/// the rest coded, so the request would go upstream re-framed with its
/// coding lost, and an upstream would keep the coded bytes as the body.
/// Refused (nginx answers 501).
pub fn other_transfer_coding(h: &HeaderMap) -> bool {
    h.get_all(header::TRANSFER_ENCODING).iter().any(|v| {
        v.as_bytes().split(|b| *b == b',').map(<[u8]>::trim_ascii).any(|t| !t.eq_ignore_ascii_case(b"chunked"))
    })
}

/// True when a `Connection` header names a fencing header.
pub fn connection_names_fencing_header(h: &HeaderMap) -> bool {
    h.get_all(header::CONNECTION)
        .iter()
        .any(|v| v.as_bytes().split(|b| *b == b',').any(|t| crate::fence::token::is_fencing_header(t.trim_ascii())))
}

/// Removes `Connection`, every header it names, and the fixed hop-by-hop set.
pub fn strip_hop_by_hop(h: &mut HeaderMap) {
    // One pass over the names finds what is there; the common cases (none
    // of them, or just `Connection: keep-alive`) allocate nothing.
    let mut present = 0u16;
    let mut connection = false;
    for name in h.keys() {
        if *name == header::CONNECTION {
            connection = true;
        } else if let Some(i) = HOP_BY_HOP.iter().position(|f| name.as_str() == *f) {
            present |= 1 << i;
        }
    }
    if connection {
        let mut named: Vec<HeaderName> = Vec::new();
        for value in h.get_all(header::CONNECTION) {
            let Ok(text) = value.to_str() else { continue };
            for token in text.split(',').map(str::trim) {
                // `close` is an option, `keep-alive` one of the fixed set.
                if token.is_empty() || token.eq_ignore_ascii_case("close") || token.eq_ignore_ascii_case("keep-alive") {
                    continue;
                }
                if let Ok(n) = HeaderName::from_bytes(token.as_bytes()) {
                    named.push(n);
                }
            }
        }
        for n in named {
            h.remove(n);
        }
        h.remove(header::CONNECTION);
    }
    for (i, name) in HOP_BY_HOP.iter().enumerate() {
        if present & (1 << i) != 0 {
            h.remove(*name);
        }
    }
}

static VIA_2: HeaderValue = HeaderValue::from_static("2 fencegate");
static VIA_10: HeaderValue = HeaderValue::from_static("1.0 fencegate");
static VIA_11: HeaderValue = HeaderValue::from_static("1.1 fencegate");

fn via_value(v: Version) -> &'static HeaderValue {
    match v {
        Version::HTTP_2 => &VIA_2,
        Version::HTTP_10 => &VIA_10,
        _ => &VIA_11,
    }
}

/// Appends `item` to a comma-separated list header (one value, as nginx
/// and HAProxy send them); sets it when absent.
fn append_list(h: &mut HeaderMap, name: &HeaderName, item: &HeaderValue) {
    let joined = match h.get(name) {
        Some(prev) if !prev.is_empty() => {
            let mut v = Vec::with_capacity(prev.len() + 2 + item.len());
            v.extend_from_slice(prev.as_bytes());
            v.extend_from_slice(b", ");
            v.extend_from_slice(item.as_bytes());
            match HeaderValue::from_bytes(&v) {
                Ok(v) => v,
                Err(_) => return,
            }
        }
        _ => item.clone(),
    };
    h.insert(name, joined);
}

/// Prepares a request for the upstream.
pub fn prepare_request<B>(
    req: &mut Request<B>,
    client: &Peer,
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
    append_list(h, &X_FORWARDED_FOR, &client.forwarded_for);
    h.insert(&X_FORWARDED_PROTO, HeaderValue::from_static(if client.tls { "https" } else { "http" }));
    if let Some(host) = &original_host {
        h.insert(&X_FORWARDED_HOST, host.clone());
    }
    append_list(h, &header::VIA, via_value(version));
    match (host_mode, upstream_host) {
        (HostHeader::Rewrite, Some(up)) => {
            h.insert(header::HOST, up);
        }
        // Preserved; a request that named no host at all (HTTP/1.0)
        // gets the upstream's, since HTTP/1.1 requires one.
        (_, up) => {
            if let Some(host) = original_host.or(up) {
                h.insert(header::HOST, host);
            }
        }
    }
    if !forward_token {
        h.remove(&X_FENCING_TOKEN);
        h.remove(&X_FENCING_SEQUENCE);
    }
}

/// Prepares an upstream response for the client.
pub fn prepare_response<B>(resp: &mut Response<B>) {
    let version = resp.version();
    let h = resp.headers_mut();
    strip_hop_by_hop(h);
    append_list(h, &header::VIA, via_value(version));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client() -> Peer {
        Peer::new("10.1.2.3:5555".parse().unwrap(), false, None)
    }

    #[test]
    fn hop_by_hop_headers_are_removed() {
        let mut req = Request::builder()
            .header("connection", "close, x-secret, Keep-Alive")
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
    fn each_fixed_hop_by_hop_header_is_removed_without_a_connection_header() {
        for name in [
            "te",
            "transfer-encoding",
            "upgrade",
            "trailer",
            "proxy-authorization",
            "proxy-authenticate",
            "keep-alive",
            "proxy-connection",
        ] {
            let mut h = HeaderMap::new();
            h.insert(HeaderName::from_static(name), HeaderValue::from_static("x"));
            h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
            strip_hop_by_hop(&mut h);
            assert!(!h.contains_key(name), "{name}");
            assert!(h.contains_key(header::CONTENT_TYPE));
        }
    }

    #[test]
    fn forwarded_for_and_via_are_appended_to_earlier_values() {
        let mut req = Request::builder().header("via", "1.1 edge").body(()).unwrap();
        prepare_request(&mut req, &client(), HostHeader::Preserve, None, true);
        assert_eq!(req.headers()["via"], "1.1 edge, 1.1 fencegate");
    }

    #[test]
    fn forwarded_for_is_appended() {
        let mut req = Request::builder().header("x-forwarded-for", "1.1.1.1").body(()).unwrap();
        prepare_request(&mut req, &client(), HostHeader::Preserve, None, true);
        assert_eq!(req.headers()["x-forwarded-for"], "1.1.1.1, 10.1.2.3");
    }

    #[test]
    fn a_request_without_any_host_gets_the_upstreams() {
        let mut req = Request::builder().uri("/x").body(()).unwrap();
        let up = HeaderValue::from_static("127.0.0.1:9000");
        prepare_request(&mut req, &client(), HostHeader::Preserve, Some(up), true);
        assert_eq!(req.headers()["host"], "127.0.0.1:9000");
        assert!(!req.headers().contains_key("x-forwarded-host"));
    }

    #[test]
    fn host_rewrite_and_token_removal() {
        let mut req = Request::builder().header("host", "front").header("x-fencing-token", "5").body(()).unwrap();
        let up = HeaderValue::from_static("127.0.0.1:9000");
        prepare_request(&mut req, &client(), HostHeader::Rewrite, Some(up), false);
        assert_eq!(req.headers()["host"], "127.0.0.1:9000");
        assert!(!req.headers().contains_key("x-fencing-token"));
    }

    #[test]
    fn connection_naming_a_fencing_header_is_detected() {
        for v in ["x-fencing-token", "close, X-Fencing-Token", "keep-alive,x-fencing-sequence "] {
            let mut h = HeaderMap::new();
            h.insert(header::CONNECTION, HeaderValue::from_str(v).unwrap());
            assert!(connection_names_fencing_header(&h), "{v}");
        }
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, HeaderValue::from_static("close, x-fencing-tokens"));
        assert!(!connection_names_fencing_header(&h));
    }
}
