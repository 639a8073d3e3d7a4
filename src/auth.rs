//! Who may do what (docs/security.md): principals authenticated by a bearer token
//! (stored only as its SHA-256, compared in constant time) or by the common
//! name of a verified mTLS client certificate; each principal may touch only
//! keys under its prefixes.
//!
//! Principals live in a file of their own (`auth.principals_file`), never
//! in the repository. On the api listener the token comes in
//! `Authorization: Bearer …`; on the proxy listener in
//! `Proxy-Authorization: Bearer …`, which is hop-by-hop and never reaches
//! the upstream (so `Authorization`, e.g. an S3 signature, passes through
//! untouched). This module decides; it renders nothing.

use std::path::{Path, PathBuf};

use http::HeaderMap;
use serde::Deserialize;

use crate::error::Error;

/// `[auth]` in the config.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// TOML file with `[[principals]]`; no file: no authentication.
    pub principals_file: Option<PathBuf>,
    /// Require a principal on the lease API (default true once a file is set).
    pub api: Option<bool>,
    /// If set, `/metrics`, `/healthz` and `/readyz` need this principal.
    pub metrics_principal: Option<String>,
}

/// One principal as written in the principals file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrincipalConfig {
    pub name: String,
    /// Hex SHA-256 of the bearer token (`fencegate hash-token TOKEN`).
    #[serde(default)]
    pub token_sha256: Option<String>,
    /// Common name of an mTLS client certificate that authenticates it.
    #[serde(default)]
    pub client_cert_cn: Option<String>,
    /// Key prefixes it may lock and write; `""` allows every key.
    pub prefixes: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PrincipalsFile {
    principals: Vec<PrincipalConfig>,
}

/// An authenticated principal.
#[derive(Debug, Clone)]
pub struct Principal {
    pub name: String,
    token_sha256: Option<[u8; 32]>,
    client_cert_cn: Option<String>,
    prefixes: Vec<String>,
}

impl Principal {
    /// True if `key` lies under one of the principal's prefixes.
    pub fn may(&self, key: &str) -> bool {
        self.prefixes.iter().any(|p| key.starts_with(p.as_str()))
    }

    /// `Ok` if the principal may touch `key`, else 403 `forbidden`.
    pub fn authorize(&self, key: &str) -> Result<(), Error> {
        if self.may(key) {
            Ok(())
        } else {
            Err(Error::Forbidden(format!("principal {} may not use {key}", self.name)))
        }
    }
}

/// The loaded principals and the rules of when they are needed.
#[derive(Debug, Clone, Default)]
pub struct Auth {
    principals: Vec<Principal>,
    api_required: bool,
    metrics_principal: Option<String>,
}

/// SHA-256 of a token, as stored in the principals file.
pub fn hash_token(token: &str) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, token.as_bytes());
    digest.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

fn parse_hex32(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl Auth {
    /// Loads `cfg.principals_file` (none: authentication off).
    pub fn load(cfg: &AuthConfig) -> Result<Auth, Error> {
        let Some(path) = &cfg.principals_file else { return Ok(Auth::default()) };
        let auth = Auth::from_file(path, cfg)?;
        Ok(auth)
    }

    fn from_file(path: &Path, cfg: &AuthConfig) -> Result<Auth, Error> {
        let text =
            std::fs::read_to_string(path).map_err(|e| Error::Config(format!("reading {}: {e}", path.display())))?;
        Auth::from_toml(&text, cfg).map_err(|e| Error::Config(format!("{}: {e}", path.display())))
    }

    /// Parses a principals file's text.
    pub fn from_toml(text: &str, cfg: &AuthConfig) -> Result<Auth, String> {
        let file: PrincipalsFile = toml::from_str(text).map_err(|e| e.to_string())?;
        let mut principals = Vec::new();
        for (i, p) in file.principals.into_iter().enumerate() {
            let token_sha256 = match &p.token_sha256 {
                Some(h) => Some(parse_hex32(h).ok_or(format!("principals[{i}].token_sha256: not 64 hex digits"))?),
                None => None,
            };
            if token_sha256.is_none() && p.client_cert_cn.is_none() {
                return Err(format!("principals[{i}]: needs token_sha256 or client_cert_cn"));
            }
            // Prefixes match by `starts_with`: "invoices" would also cover
            // "invoicesX-payroll/1". Only whole path segments are allowed.
            if let Some(bad) = p.prefixes.iter().find(|x| !x.is_empty() && !x.ends_with('/')) {
                return Err(format!(
                    "principals[{i}] ({}).prefixes: {bad:?} must be empty (every key) or end in \"/\"",
                    p.name
                ));
            }
            principals.push(Principal {
                name: p.name,
                token_sha256,
                client_cert_cn: p.client_cert_cn,
                prefixes: p.prefixes,
            });
        }
        // A principals file with nobody in it would turn authentication
        // off without a word (`enabled()` is false): refuse it instead.
        if principals.is_empty() {
            return Err("principals: the list is empty, so nobody could authenticate and authentication \
                        would be off; add a principal, or remove auth.principals_file to run without auth"
                .into());
        }
        if let Some(m) = &cfg.metrics_principal {
            if !principals.iter().any(|p| &p.name == m) {
                return Err(format!("auth.metrics_principal: no principal named {m:?}"));
            }
        }
        Ok(Auth { principals, api_required: cfg.api.unwrap_or(true), metrics_principal: cfg.metrics_principal.clone() })
    }

    /// Every configured principal.
    pub fn principals(&self) -> &[Principal] {
        &self.principals
    }

    /// True when principals are configured at all.
    pub fn enabled(&self) -> bool {
        !self.principals.is_empty()
    }

    /// True when the lease API needs a principal.
    pub fn api_required(&self) -> bool {
        self.enabled() && self.api_required
    }

    /// The principal behind a request: a bearer token in `header` (checked
    /// against every principal in constant time), else the client
    /// certificate's CN. `Ok(None)`: no credentials at all. A token that
    /// matches nobody is 401.
    pub fn authenticate(
        &self,
        headers: &HeaderMap,
        header: &str,
        cert_cn: Option<&str>,
    ) -> Result<Option<&Principal>, Error> {
        if let Some(value) = headers.get(header) {
            let token = value.to_str().ok().and_then(|v| v.strip_prefix("Bearer ")).ok_or(Error::Unauthorized)?;
            let digest = ring::digest::digest(&ring::digest::SHA256, token.trim().as_bytes());
            let mut found = None;
            for p in &self.principals {
                if let Some(h) = &p.token_sha256 {
                    if ct_eq(h, digest.as_ref()) {
                        found = Some(p);
                    }
                }
            }
            return found.map(Some).ok_or(Error::Unauthorized);
        }
        if let Some(cn) = cert_cn {
            return Ok(self.principals.iter().find(|p| p.client_cert_cn.as_deref() == Some(cn)));
        }
        Ok(None)
    }

    /// A principal is required: 401 without one.
    pub fn require(&self, headers: &HeaderMap, header: &str, cert_cn: Option<&str>) -> Result<&Principal, Error> {
        self.authenticate(headers, header, cert_cn)?.ok_or(Error::Unauthorized)
    }

    /// Checks the rule for `/metrics`, `/healthz`, `/readyz`.
    pub fn check_metrics(&self, headers: &HeaderMap, cert_cn: Option<&str>) -> Result<(), Error> {
        let Some(name) = &self.metrics_principal else { return Ok(()) };
        let p = self.require(headers, "authorization", cert_cn)?;
        if &p.name == name {
            Ok(())
        } else {
            Err(Error::Forbidden(format!("principal {} may not read metrics", p.name)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn auth() -> Auth {
        let text = format!(
            "[[principals]]\nname = \"billing\"\ntoken_sha256 = \"{}\"\nprefixes = [\"invoices/\"]\n\
             [[principals]]\nname = \"ops\"\nclient_cert_cn = \"ops-box\"\nprefixes = [\"\"]\n",
            hash_token("s3cret")
        );
        Auth::from_toml(&text, &AuthConfig::default()).unwrap()
    }

    fn client(cn: Option<&str>) -> Option<&str> {
        cn
    }

    fn bearer(token: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("authorization", format!("Bearer {token}").parse().unwrap());
        h
    }

    #[test]
    fn bearer_token_finds_its_principal() {
        let a = auth();
        let p = a.require(&bearer("s3cret"), "authorization", client(None)).unwrap();
        assert_eq!(p.name, "billing");
        assert!(p.may("invoices/42"));
        assert!(!p.may("ledger/1"));
        assert!(matches!(p.authorize("ledger/1"), Err(Error::Forbidden(_))));
    }

    #[test]
    fn wrong_or_missing_credentials_are_401() {
        let a = auth();
        assert_eq!(a.require(&bearer("nope"), "authorization", client(None)).unwrap_err(), Error::Unauthorized);
        assert_eq!(a.require(&HeaderMap::new(), "authorization", client(None)).unwrap_err(), Error::Unauthorized);
        let mut basic = HeaderMap::new();
        basic.insert("authorization", "Basic eA==".parse().unwrap());
        assert_eq!(a.require(&basic, "authorization", client(None)).unwrap_err(), Error::Unauthorized);
    }

    #[test]
    fn client_certificate_cn_finds_its_principal() {
        let a = auth();
        assert_eq!(a.require(&HeaderMap::new(), "authorization", client(Some("ops-box"))).unwrap().name, "ops");
        assert!(a.require(&HeaderMap::new(), "authorization", client(Some("other"))).is_err());
    }

    #[test]
    fn bad_files_are_refused() {
        let cfg = AuthConfig::default();
        assert!(Auth::from_toml("[[principals]]\nname = \"x\"\nprefixes = []\n", &cfg).is_err());
        assert!(Auth::from_toml("[[principals]]\nname = \"x\"\ntoken_sha256 = \"zz\"\nprefixes = []\n", &cfg).is_err());
        let empty = Auth::from_toml("principals = []\n", &cfg).unwrap_err();
        assert!(empty.contains("empty"), "{empty}");
        let m = AuthConfig { metrics_principal: Some("ghost".into()), ..AuthConfig::default() };
        let text = format!("[[principals]]\nname = \"x\"\ntoken_sha256 = \"{}\"\nprefixes = []\n", hash_token("t"));
        assert!(Auth::from_toml(&text, &m).is_err());
    }

    #[test]
    fn prefixes_must_be_empty_or_end_in_a_slash() {
        let cfg = AuthConfig::default();
        let file = |prefix: &str| {
            format!(
                "[[principals]]\nname = \"billing\"\ntoken_sha256 = \"{}\"\nprefixes = [\"{prefix}\"]\n",
                hash_token("t")
            )
        };
        let err = Auth::from_toml(&file("invoices"), &cfg).unwrap_err();
        assert!(err.contains("billing") && err.contains("\"invoices\""), "{err}");
        for ok in ["", "invoices/", "a/b/"] {
            assert!(Auth::from_toml(&file(ok), &cfg).is_ok(), "{ok}");
        }
        let a = Auth::from_toml(&file("invoices/"), &cfg).unwrap();
        let p = a.require(&bearer("t"), "authorization", client(None)).unwrap();
        assert!(p.may("invoices/7"));
        assert!(!p.may("invoicesX-payroll/1"));
    }
}
