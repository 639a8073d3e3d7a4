//! The lease API's answers, as the gateway sends them and this client
//! reads them (the gateway uses these very types).

use serde::{Deserialize, Serialize};

/// A grant as its holder receives it. The only answer that carries the
/// lease id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrantView {
    pub key: String,
    pub fencing_token: u64,
    pub lease_id: String,
    pub ttl_ms: u64,
    pub holder: String,
}

/// Answer to a renewal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RenewView {
    pub key: String,
    pub fencing_token: u64,
    pub ttl_ms: u64,
}

/// Status of a key, for anyone allowed to see it: never the lease id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusView {
    pub key: String,
    pub fence: u64,
    pub held: bool,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub fencing_token: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub holder: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub expires_in_ms: Option<u64>,
}

impl StatusView {
    /// The status of a key nobody holds, with its current fence.
    pub fn free(key: &str, fence: u64) -> StatusView {
        StatusView { key: key.to_string(), fence, held: false, fencing_token: None, holder: None, expires_in_ms: None }
    }
}
