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
//! | [`server`] | listeners: accept, TLS/mTLS, HTTP/1.1 + h2, connection limits, graceful drain |
//! | [`h1`] | the api listener's small HTTP/1.1 loop in front of its handler (hyper for the rest) |
//! | [`tls`] | rustls configs from PEM, SIGHUP reload, client certificate names |
//! | [`proxy`] | routes, path checks and key mapping, the fence check, forwarding (fast path and general), upstreams (http, file) |
//! | [`fence`] | token parsing, the in-memory fence table, in-flight tracking, the activation barrier |
//! | [`authority`] | the lease service ([`authority::Leases`]); the embedded authority: grants, FIFO waiters, expiry, watch |
//! | [`cluster`] | cluster mode: the authority in etcd, the fence feed, membership and self-fencing |
//! | [`store`] | RocksDB: fences, grants, counters; group commit of fsyncs |
//! | [`auth`] | principals: bearer tokens (hashed) or client certificates, key-prefix rules |
//! | [`api`] | lease API handlers, `/metrics`, `/healthz`, `/readyz` |
//! | [`metrics`] | every Prometheus handle |
//! | [`inject`] | the token-injecting loopback proxy of `fencegate lock --inject` |
//! | [`client`] | the Rust client: auto-renewing leases, leader election, the token header |
//! | [`error`] | the error enum: the one place statuses and JSON bodies are chosen |
//! | [`app`] | wiring a `Config` into a running [`app::Gateway`] |
//! | [`shutdown`] | the one shutdown signal |

pub mod api;
pub mod app;
pub mod auth;
pub mod authority;
pub mod body;
pub mod client;
pub mod cluster;
pub mod config;
pub mod error;
pub mod fence;
pub mod h1;
pub mod inject;
pub mod metrics;
pub mod proxy;
pub mod server;
pub mod shutdown;
pub mod store;
pub mod tls;

pub use app::Gateway;
pub use config::Config;
pub use error::Error;
