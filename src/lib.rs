//! fencegate — a fenced storage gateway.
//!
//! A lock gives liveness; the fence at the resource gives safety. fencegate
//! bundles a lease authority with a durable table of the highest fencing
//! token per resource, and refuses every mutation that carries a
//! superseded token before it reaches the protected backend.
//!
//! Module map (a request's life runs top to bottom):
//!
//! | module | owns |
//! |---|---|
//! | [`config`] | the one `Config`: defaults, TOML, `serve` flags, `validate()` |
//! | [`template`] | the route `match` and `resource` template language (parsed once, used by config checks and the proxy) |
//! | [`server`] | listeners: accept, TLS/mTLS, HTTP/1.1 + h2, connection limits, graceful drain; the api listener's small HTTP/1.1 loop |
//! | [`http1`] | HTTP/1.1 on the wire for the two hand-written loops: hop-by-hop names, the one request-head parser, response heads, deadlines |
//! | [`tls`] | rustls configs from PEM, SIGHUP reload, client certificate names |
//! | [`peer`] | who is at the other end of a connection (address, TLS, certificate name) |
//! | [`proxy`] | routes and their kinds (http path templates, s3), path checks and key mapping, the fence check, forwarding (fast path and general), upstreams (http, file) |
//! | [`fence`] | token parsing, the in-memory fence table, in-flight tracking, the activation barrier |
//! | [`leases`] | the lease service the api and the proxy hold: the embedded authority or the cluster's, behind one enum |
//! | [`authority`] | the embedded authority: grants, FIFO waiters, expiry, watch |
//! | [`cluster`] | cluster mode: the authority in etcd, the fence feed, membership and self-fencing |
//! | [`store`] | RocksDB: fences, grants, counters; group commit of fsyncs |
//! | [`auth`] | principals: bearer tokens (hashed) or client certificates, key-prefix rules |
//! | [`api`] | lease API handlers, `/metrics`, `/healthz`, `/readyz` |
//! | [`metrics`] | every Prometheus handle |
//! | [`fault`] | deliberately broken variants for the nemesis self-tests: debug builds only, named in an environment variable |
//! | [`inject`] | the token-injecting loopback proxy of `fencegate lock --inject` |
//! | [`client`] | the Rust client (the `fencegate-client` crate, re-exported): auto-renewing leases, leader election, the token header |
//! | [`error`] | the error enum: the one place statuses and JSON bodies are chosen |
//! | [`app`] | wiring a `Config` into a running [`app::Gateway`] |
//! | [`shutdown`] | the one shutdown signal |
//! | [`logbuf`] | the log writer: access lines buffered off the request path, nothing lost at a clean stop |

pub mod api;
pub mod app;
pub mod auth;
pub mod authority;
pub mod body;
pub mod client;
pub mod cluster;
pub mod config;
pub mod error;
pub mod fault;
pub mod fence;
pub mod http1;
pub mod inject;
pub mod leases;
pub mod logbuf;
pub mod metrics;
pub mod peer;
pub mod proxy;
pub mod server;
pub mod shutdown;
pub mod store;
pub mod template;
pub mod tls;

pub use app::Gateway;
pub use config::Config;
pub use error::Error;
