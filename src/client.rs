//! The Rust client of the lease API lives in its own crate,
//! `fencegate-client` (`client/`), so that a service that only locks and
//! attaches tokens compiles neither the gateway nor RocksDB. Re-exported
//! here as `fencegate::client` for the binary and existing users.

pub use fencegate_client::*;
