//! The integration tests, one binary: each module was a test binary of its
//! own, and each of those compiled `common` and linked the gateway again
//! (about 20 CPU-seconds apiece). `cluster.rs` stays a binary of its own:
//! its tests run one at a time, each with 6 processes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../common/mod.rs"]
mod common;

mod access_log;
mod activation;
mod api;
mod batch;
mod cli;
mod clients;
mod crash;
mod dashboard_series;
mod examples;
mod fast_stream;
mod fastpath;
mod filestore;
mod hostile;
mod lease_group;
mod pool;
mod prometheus;
mod proxy;
mod restart;
mod s3;
mod s3_sdk;
mod security;
mod streaming;
mod tls;
mod undelivered;
