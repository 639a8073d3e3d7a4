//! The lease API's request and response bodies (docs/lease-api.md) and the checks of
//! their bounds. Pure data: no locks, no I/O.

use serde::Deserialize;

use crate::config::LocksConfig;
use crate::error::Error;

/// Longest key, in bytes (docs/concepts.md).
pub const MAX_KEY_BYTES: usize = 512;

/// `POST /v1/locks/acquire`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AcquireRequest {
    pub key: String,
    pub ttl_ms: u64,
    #[serde(default)]
    pub wait_ms: u64,
    #[serde(default)]
    pub holder: Option<String>,
}

impl AcquireRequest {
    /// The checks every authority makes of an acquire before anything
    /// else: key, TTL, wait and holder within the configured bounds. The
    /// holder label, empty when none was given.
    pub fn validate(&self, limits: &LocksConfig) -> Result<String, Error> {
        validate_key(&self.key)?;
        validate_ttl(self.ttl_ms, limits)?;
        validate_wait(self.wait_ms, limits)?;
        let holder = self.holder.clone().unwrap_or_default();
        validate_holder(&holder, limits)?;
        Ok(holder)
    }
}

/// `POST /v1/locks/renew`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RenewRequest {
    pub key: String,
    pub lease_id: String,
    #[serde(default)]
    pub ttl_ms: Option<u64>,
}

/// `POST /v1/locks/release`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReleaseRequest {
    pub key: String,
    pub lease_id: String,
}

// The answers the lease API sends are the client crate's types, so the two
// can never disagree on a field.
pub use fencegate_client::{GrantView, RenewView, StatusView};

/// Checks a key against docs/concepts.md: UTF-8 (guaranteed by `&str`), 1–512
/// bytes, no control characters.
pub fn validate_key(key: &str) -> Result<(), Error> {
    if key.is_empty() || key.len() > MAX_KEY_BYTES {
        return Err(Error::BadRequest(format!("key must be 1 to {MAX_KEY_BYTES} bytes, got {}", key.len())));
    }
    if key.chars().any(char::is_control) {
        return Err(Error::BadRequest("key must not contain control characters".into()));
    }
    Ok(())
}

/// Checks `ttl_ms` against the configured bounds.
pub fn validate_ttl(ttl_ms: u64, limits: &LocksConfig) -> Result<(), Error> {
    if ttl_ms < limits.min_ttl_ms || ttl_ms > limits.max_ttl_ms {
        return Err(Error::BadRequest(format!(
            "ttl_ms must be between {} and {}, got {ttl_ms}",
            limits.min_ttl_ms, limits.max_ttl_ms
        )));
    }
    Ok(())
}

/// Checks `wait_ms` against the configured bound.
pub fn validate_wait(wait_ms: u64, limits: &LocksConfig) -> Result<(), Error> {
    if wait_ms > limits.max_wait_ms {
        return Err(Error::BadRequest(format!("wait_ms must be at most {}, got {wait_ms}", limits.max_wait_ms)));
    }
    Ok(())
}

/// Checks a holder label: bounded, no control characters.
pub fn validate_holder(holder: &str, limits: &LocksConfig) -> Result<(), Error> {
    if holder.len() > limits.max_holder_bytes {
        return Err(Error::BadRequest(format!("holder must be at most {} bytes", limits.max_holder_bytes)));
    }
    if holder.chars().any(char::is_control) {
        return Err(Error::BadRequest("holder must not contain control characters".into()));
    }
    Ok(())
}

/// Bytes drawn from the OS's CSPRNG 4 KiB at a time (one `getrandom` call
/// per 256 lease ids instead of one per id). Every byte is handed out once.
struct RandomPool {
    buf: [u8; 4096],
    used: usize,
}

static RANDOM: std::sync::Mutex<RandomPool> = std::sync::Mutex::new(RandomPool { buf: [0; 4096], used: 4096 });

fn random_16() -> Result<[u8; 16], Error> {
    let mut pool = RANDOM.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if pool.used + 16 > pool.buf.len() {
        getrandom::fill(&mut pool.buf).map_err(|e| Error::Internal(format!("drawing a lease id: {e}")))?;
        pool.used = 0;
    }
    let mut out = [0u8; 16];
    out.copy_from_slice(&pool.buf[pool.used..pool.used + 16]);
    // Wipe what was handed out, so the pool never holds a live id.
    let used = pool.used;
    pool.buf[used..used + 16].fill(0);
    pool.used += 16;
    Ok(out)
}

/// A lease id: 128 bits from the OS's CSPRNG, kept as 16 bytes (not as the
/// 32-character string clients see, which cost a 24-byte `String` plus a
/// heap block per lease). Its `Debug` never shows it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct LeaseId([u8; 16]);

impl std::fmt::Debug for LeaseId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LeaseId(..)")
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

impl LeaseId {
    /// A fresh id.
    pub fn new() -> Result<LeaseId, Error> {
        random_16().map(LeaseId)
    }

    /// As clients see it: 32 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        let mut out = String::with_capacity(32);
        for b in self.0 {
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 0x0f)]));
        }
        out
    }

    /// The id written as `text` (32 lowercase hex digits, as [`LeaseId::to_hex`]
    /// writes it), `None` for anything else. Takes the same time whatever
    /// the digits are.
    pub fn parse(text: &str) -> Option<LeaseId> {
        let bytes = text.as_bytes();
        if bytes.len() != 32 {
            return None;
        }
        let mut out = [0u8; 16];
        let mut bad = 0u8;
        for (i, pair) in bytes.chunks_exact(2).enumerate() {
            let (hi, hi_bad) = hex_digit(pair[0]);
            let (lo, lo_bad) = hex_digit(pair[1]);
            bad |= hi_bad | lo_bad;
            out[i] = (hi << 4) | lo;
        }
        (bad == 0).then_some(LeaseId(out))
    }

    /// True when a client's `text` names this id; compares in time
    /// independent of where they differ.
    pub fn matches(&self, text: &str) -> bool {
        let Some(other) = LeaseId::parse(text) else {
            return false;
        };
        self.0.iter().zip(other.0).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }
}

/// The value of one lowercase hex digit, and 1 in the second place when
/// `c` is none (no branch on the digit's value).
fn hex_digit(c: u8) -> (u8, u8) {
    let digit = c.wrapping_sub(b'0');
    let letter = c.wrapping_sub(b'a');
    let is_digit = u8::from(digit < 10);
    let is_letter = u8::from(letter < 6);
    let value = (digit & is_digit.wrapping_neg()) | (letter.wrapping_add(10) & is_letter.wrapping_neg());
    (value, (is_digit | is_letter) ^ 1)
}

/// A fresh lease id: 128 bits from the OS's CSPRNG, as 32 hex digits.
pub fn new_lease_id() -> Result<String, Error> {
    LeaseId::new().map(|id| id.to_hex())
}

/// Compares two secrets in time independent of where they differ.
pub fn secret_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_bounded_and_printable() {
        assert!(validate_key("orders/1").is_ok());
        assert!(validate_key(&"k".repeat(512)).is_ok());
        assert!(validate_key("").is_err());
        assert!(validate_key(&"k".repeat(513)).is_err());
        assert!(validate_key("a\nb").is_err());
        assert!(validate_key("a\u{7f}").is_err());
    }

    #[test]
    fn lease_ids_are_128_bit_and_distinct() {
        let a = new_lease_id().unwrap();
        let b = new_lease_id().unwrap();
        assert_eq!(a.len(), 32);
        assert_ne!(a, b);
    }

    #[test]
    fn lease_ids_round_trip_and_match_only_their_own_text() {
        let id = LeaseId::new().unwrap();
        let hex = id.to_hex();
        assert_eq!(LeaseId::parse(&hex), Some(id));
        assert!(id.matches(&hex));
        let mut other = hex.clone().into_bytes();
        other[31] = if other[31] == b'0' { b'1' } else { b'0' };
        assert!(!id.matches(std::str::from_utf8(&other).unwrap()));
        // Only what to_hex writes: 32 lowercase hex digits.
        assert!(!id.matches(&hex.to_uppercase()) || hex.chars().all(|c| c.is_ascii_digit()));
        assert!(!id.matches(&hex[..31]));
        assert!(!id.matches(&format!("{hex}0")));
        assert!(!id.matches(""));
        assert_eq!(LeaseId::parse("0123456789abcdef0123456789abcdeg"), None);
        assert_eq!(LeaseId::parse("0123456789abcdef0123456789abcde/"), None);
        assert_eq!(LeaseId::parse("0123456789abcdef0123456789abcde:"), None);
        assert_eq!(LeaseId::parse("0123456789abcdef0123456789abcde`").map(|_| ()), None);
        assert_eq!(
            LeaseId::parse("ffffffffffffffffffffffffffffffff").map(|i| i.to_hex()).as_deref(),
            Some("ffffffffffffffffffffffffffffffff")
        );
        assert!(!format!("{id:?}").contains(&hex), "Debug must not show the secret");
    }

    #[test]
    fn secret_eq_matches_only_equal() {
        assert!(secret_eq("abc", "abc"));
        assert!(!secret_eq("abc", "abd"));
        assert!(!secret_eq("abc", "ab"));
    }
}
