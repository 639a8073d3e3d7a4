//! Path checking: a request path becomes a resource key only if it has
//! exactly one spelling.
//!
//! The rule (also in the README): the path is percent-decoded once; the
//! result must be valid UTF-8 without control characters; it must not
//! contain `\` (raw or encoded) nor an encoded `/`; no segment may be empty
//! (`//`) except a single trailing one, and no segment may be `.` or `..`
//! (in any encoding). Anything else is refused with 400, so that no alias
//! of a fenced resource reaches the upstream under another key. The rule's
//! one route-dependent part, a trailing slash on a mutation, is checked
//! once the route is known (refused unless the route's upstream keeps
//! `a/` and `a` apart: `trailing_slash = "distinct"`).

/// The checked, decoded form of a request path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckedPath {
    /// Decoded path without its leading `/`.
    pub decoded: String,
}

impl CheckedPath {
    /// Whether the path ends in `/` after at least one segment (`/` alone,
    /// the root, does not count): on most upstreams `a/` is the object
    /// `a`, so a route refuses such mutations unless its upstream keeps
    /// them apart (`Route::check_trailing_slash`).
    pub fn has_trailing_slash(&self) -> bool {
        self.decoded.ends_with('/')
    }

    /// The decoded segments (a trailing slash gives a final empty one).
    pub fn segments(&self) -> Vec<&str> {
        if self.decoded.is_empty() {
            Vec::new()
        } else {
            self.decoded.split('/').collect()
        }
    }
}

/// Checks and decodes a request path (`uri.path()`, without the query).
pub fn check_path(raw: &str) -> Result<CheckedPath, String> {
    let Some(rest) = raw.strip_prefix('/') else {
        return Err("path must start with \"/\"".into());
    };
    let bytes = rest.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'%' {
            let hex = bytes.get(i + 1..i + 3).ok_or("truncated percent-escape")?;
            let v = decode_hex(hex).ok_or("invalid percent-escape")?;
            if v == b'/' {
                return Err("encoded \"/\" (%2F) is not allowed".into());
            }
            if v == b'\\' {
                return Err("encoded \"\\\" (%5C) is not allowed".into());
            }
            out.push(v);
            i += 3;
        } else {
            if b == b'\\' {
                return Err("\"\\\" is not allowed in paths".into());
            }
            if b == b'#' {
                return Err("a request-target may not carry a fragment (\"#\")".into());
            }
            out.push(b);
            i += 1;
        }
    }
    let decoded = String::from_utf8(out).map_err(|_| "path is not valid UTF-8 once decoded")?;
    if decoded.chars().any(char::is_control) {
        return Err("path contains control characters".into());
    }
    if !decoded.is_empty() {
        let segs: Vec<&str> = decoded.split('/').collect();
        let last = segs.len() - 1;
        for (i, seg) in segs.iter().enumerate() {
            if seg.is_empty() && i != last {
                return Err("empty path segment (\"//\") is not allowed".into());
            }
            if *seg == "." || *seg == ".." {
                return Err("\".\" and \"..\" segments are not allowed".into());
            }
        }
    }
    Ok(CheckedPath { decoded })
}

fn decode_hex(hex: &[u8]) -> Option<u8> {
    let d = |c: u8| (c as char).to_digit(16);
    u8::try_from(d(hex[0])? * 16 + d(hex[1])?).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_paths_decode() {
        assert_eq!(check_path("/orders/42").unwrap().decoded, "orders/42");
        assert_eq!(check_path("/a%20b").unwrap().decoded, "a b");
        assert_eq!(check_path("/%41").unwrap().decoded, check_path("/A").unwrap().decoded);
        assert_eq!(check_path("/").unwrap().decoded, "");
        assert_eq!(check_path("/dir/").unwrap().segments(), vec!["dir", ""]);
        assert!(check_path("/dir/").unwrap().has_trailing_slash());
        assert!(check_path("/dir%2F").is_err());
        assert!(!check_path("/dir").unwrap().has_trailing_slash());
        assert!(!check_path("/").unwrap().has_trailing_slash());
    }

    #[test]
    fn aliases_are_refused() {
        for bad in [
            "/a/../b",
            "/a/./b",
            "/..",
            "/.",
            "/a//b",
            "//a",
            "/a%2Fb",
            "/a%2fb",
            "/a%5Cb",
            "/a\\b",
            "/%2e%2e/x",
            "/%2E/x",
            "/a/%2e",
            "/%ff",
            "/%c0%af",
            "/a%00b",
            "/a%0a",
            "/%zz",
            "/%4",
            "/orders/1#x",
            "/orders/1#",
            "x",
            "*",
        ] {
            assert!(check_path(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn utf8_keys_are_fine() {
        assert_eq!(check_path("/caf%C3%A9").unwrap().decoded, "café");
    }
}
