//! Who is at the other end of an accepted connection: its address, whether
//! it came over TLS, the name in its verified client certificate. Built
//! once per connection by the listener (`server`), read by everything a
//! request passes through (authentication, forwarding headers, the access
//! log). Depends on nothing else of the crate.

use std::net::SocketAddr;

use http::HeaderValue;

/// Who sent the request, as the listener saw it.
#[derive(Debug, Clone)]
pub struct Peer {
    pub addr: SocketAddr,
    pub tls: bool,
    /// Common name of the verified client certificate (mTLS).
    pub cert_cn: Option<std::sync::Arc<str>>,
    /// The client's address as an `X-Forwarded-For` item, rendered once
    /// per connection.
    pub forwarded_for: HeaderValue,
}

impl Peer {
    /// The client of one accepted connection.
    pub fn new(addr: SocketAddr, tls: bool, cert_cn: Option<std::sync::Arc<str>>) -> Peer {
        let forwarded_for =
            HeaderValue::from_str(&addr.ip().to_string()).unwrap_or(HeaderValue::from_static("unknown"));
        Peer { addr, tls, cert_cn, forwarded_for }
    }
}
