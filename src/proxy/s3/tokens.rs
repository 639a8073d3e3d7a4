//! The tokens of an S3 request: `X-Fencing-Token` for every resource it
//! touches, and `X-Fencing-Tokens` for the resources that need their own
//! (docs/s3.md).
//!
//! Tokens are unique across keys, so one token is admissible for several
//! keys only when a resource template folds them into one resource
//! (`{bucket}/{dir}`). A request that changes several resources
//! (`DeleteObjects`, `RenameObject`) names a token per resource in
//! `X-Fencing-Tokens: <resource>=<token>, <resource>=<token>, …`; the
//! resource is percent-encoded (at least `%`, `,`, `=`, whitespace,
//! control and non-ASCII characters), the token is a decimal u64. The header
//! may repeat; a resource named twice with different tokens is malformed.
//! A resource without an entry takes `X-Fencing-Token`.

use std::collections::HashMap;

use http::HeaderMap;

use crate::fence::token::{parse_one, parse_token_header, TokenError};
use crate::proxy::headers::X_FENCING_TOKEN;

/// The header of per-resource tokens.
pub const X_FENCING_TOKENS: &str = "x-fencing-tokens";

/// The parsed token headers of one request.
#[derive(Debug, Clone, Default)]
pub struct Tokens {
    default: Option<u64>,
    per_resource: HashMap<String, u64>,
    /// A malformed header: every lookup answers it.
    malformed: Option<TokenError>,
}

impl Tokens {
    /// Parses both headers. A malformed one is kept and returned by every
    /// lookup, so a mutation carrying it is refused (400) whatever resource
    /// it names.
    pub fn parse(headers: &HeaderMap) -> Tokens {
        let mut out = Tokens::default();
        match parse_token_header(headers.get_all(&X_FENCING_TOKEN)) {
            Ok(t) => out.default = t,
            Err(e) => out.malformed = Some(e),
        }
        for value in headers.get_all(X_FENCING_TOKENS) {
            for element in value.as_bytes().split(|b| *b == b',') {
                if let Err(e) = out.add(element) {
                    out.malformed.get_or_insert(e);
                }
            }
        }
        out
    }

    fn add(&mut self, element: &[u8]) -> Result<(), TokenError> {
        let text = std::str::from_utf8(element)
            .map_err(|_| TokenError::Malformed("X-Fencing-Tokens is not text".into()))?
            .trim_matches([' ', '\t']);
        if text.is_empty() {
            return Ok(());
        }
        let Some((res, tok)) = text.rsplit_once('=') else {
            return Err(TokenError::Malformed(format!("X-Fencing-Tokens: {text:?} is not resource=token")));
        };
        let token = parse_one(tok.trim_matches([' ', '\t']).as_bytes())?;
        let resource = decode(res.trim_matches([' ', '\t']))
            .ok_or_else(|| TokenError::Malformed(format!("X-Fencing-Tokens: {res:?} is not percent-encoded UTF-8")))?;
        match self.per_resource.insert(resource.clone(), token) {
            Some(prev) if prev != token => Err(TokenError::Malformed(format!(
                "X-Fencing-Tokens names {resource:?} twice with different tokens ({prev} and {token})"
            ))),
            _ => Ok(()),
        }
    }

    /// The token for `resource`: its `X-Fencing-Tokens` entry, else
    /// `X-Fencing-Token`. `Ok(None)`: none.
    pub fn for_resource(&self, resource: &str) -> Result<Option<u64>, TokenError> {
        if let Some(e) = &self.malformed {
            return Err(e.clone());
        }
        Ok(self.per_resource.get(resource).copied().or(self.default))
    }

    /// A `PostObject` form's token field, used when no `X-Fencing-Token`
    /// header came (a browser form cannot set headers).
    pub fn default_from_field(&mut self, value: &str) {
        if self.default.is_some() {
            return;
        }
        match parse_one(value.trim().as_bytes()) {
            Ok(t) => self.default = Some(t),
            Err(e) => {
                self.malformed.get_or_insert(e);
            }
        }
    }

    /// Whether the request carries any token at all (a body-named
    /// mutation without one is refused before its body is read).
    pub fn any(&self) -> bool {
        self.default.is_some() || !self.per_resource.is_empty() || self.malformed.is_some()
    }
}

/// Percent-decodes a resource of `X-Fencing-Tokens`.
fn decode(raw: &str) -> Option<String> {
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// Percent-encodes a resource for `X-Fencing-Tokens` (what clients do).
pub fn encode(resource: &str) -> String {
    let mut out = String::with_capacity(resource.len());
    for b in resource.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~/!*'()+:;@$&".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(pairs: &[(&str, &str)]) -> Tokens {
        let mut h = HeaderMap::new();
        for (n, v) in pairs {
            h.append(http::HeaderName::from_bytes(n.as_bytes()).unwrap(), v.parse().unwrap());
        }
        Tokens::parse(&h)
    }

    #[test]
    fn per_resource_tokens_override_the_default() {
        let t = tokens(&[
            ("x-fencing-token", "7"),
            ("x-fencing-tokens", "b/a%2Cb=9, b/c%3D=10"),
            ("x-fencing-tokens", "b/caf%C3%A9=11"),
        ]);
        assert_eq!(t.for_resource("b/a,b"), Ok(Some(9)));
        assert_eq!(t.for_resource("b/c="), Ok(Some(10)));
        assert_eq!(t.for_resource("b/café"), Ok(Some(11)));
        assert_eq!(t.for_resource("b/other"), Ok(Some(7)));
        assert!(t.any());
        assert!(!tokens(&[]).any());
        assert_eq!(tokens(&[]).for_resource("x"), Ok(None));
    }

    #[test]
    fn malformed_entries_refuse_every_lookup() {
        for bad in ["b/a", "b/a=x", "b/a=1, b/a=2", "b/%zz=1", "=-1"] {
            let t = tokens(&[("x-fencing-tokens", bad)]);
            assert!(t.for_resource("b/a").is_err(), "{bad}");
        }
        assert!(tokens(&[("x-fencing-token", "1, 2")]).for_resource("b/a").is_err());
    }

    #[test]
    fn encoding_round_trips() {
        for r in ["b/a,b=c d", "b/café/%", "b/plain/key.txt"] {
            let t = tokens(&[("x-fencing-tokens", &format!("{}=5", encode(r)))]);
            assert_eq!(t.for_resource(r), Ok(Some(5)), "{r}");
        }
    }
}
