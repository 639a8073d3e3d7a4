//! Parsing of `X-Fencing-Token` (docs/proxy.md): exactly one decimal u64.
//!
//! The header may appear several times or as a comma-separated list (HTTP
//! list syntax, optional whitespace around commas); all values must be the
//! same number. An empty value, a sign, inner whitespace, a non-ASCII digit
//! or an overflow is malformed.

use http::header::GetAll;
use http::HeaderValue;

/// True for the names fencing reads (`X-Fencing-Token`,
/// `X-Fencing-Sequence`), in any case. (S3 routes' `X-Fencing-Tokens` is
/// read before hop-by-hop removal too; a `Connection` naming it only keeps
/// it from the upstream.)
pub fn is_fencing_header(name: &[u8]) -> bool {
    name.eq_ignore_ascii_case(b"x-fencing-token") || name.eq_ignore_ascii_case(b"x-fencing-sequence")
}

/// Why a token header was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenError {
    /// Not a decimal u64, or values that disagree.
    Malformed(String),
}

/// Parses every `X-Fencing-Token` value of a request. `Ok(None)`: absent.
pub fn parse_token_header(values: GetAll<'_, HeaderValue>) -> Result<Option<u64>, TokenError> {
    parse_token_values(values.iter().map(HeaderValue::as_bytes))
}

/// [`parse_token_header`] over raw header values.
pub fn parse_token_values<'a>(values: impl IntoIterator<Item = &'a [u8]>) -> Result<Option<u64>, TokenError> {
    let mut found: Option<u64> = None;
    for value in values {
        for element in value.split(|b| *b == b',') {
            let token = parse_one(trim_ows(element))?;
            match found {
                Some(prev) if prev != token => {
                    return Err(TokenError::Malformed(format!("several disagreeing values ({prev} and {token})")))
                }
                _ => found = Some(token),
            }
        }
    }
    Ok(found)
}

/// Parses one element: 1 to 20 ASCII digits that fit in a u64.
pub fn parse_one(bytes: &[u8]) -> Result<u64, TokenError> {
    if bytes.is_empty() {
        return Err(TokenError::Malformed("empty value".into()));
    }
    if bytes.len() > 20 || !bytes.iter().all(u8::is_ascii_digit) {
        return Err(TokenError::Malformed(format!(
            "{:?} is not a decimal unsigned 64-bit integer",
            String::from_utf8_lossy(&bytes[..bytes.len().min(40)])
        )));
    }
    bytes.iter().try_fold(0u64, |acc, d| {
        acc.checked_mul(10)
            .and_then(|v| v.checked_add(u64::from(d - b'0')))
            .ok_or_else(|| TokenError::Malformed("value does not fit in 64 bits".into()))
    })
}

fn trim_ows(mut b: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = b {
        b = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = b {
        b = rest;
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderMap;

    fn parse(values: &[&[u8]]) -> Result<Option<u64>, TokenError> {
        let mut h = HeaderMap::new();
        for v in values {
            h.append("x-fencing-token", HeaderValue::from_bytes(v).unwrap());
        }
        parse_token_header(h.get_all("x-fencing-token"))
    }

    #[test]
    fn absent_is_none() {
        assert_eq!(parse(&[]), Ok(None));
    }

    #[test]
    fn plain_decimal_parses() {
        assert_eq!(parse(&[b"34"]), Ok(Some(34)));
        assert_eq!(parse(&[b"18446744073709551615"]), Ok(Some(u64::MAX)));
        assert_eq!(parse(&[b"0"]), Ok(Some(0)));
    }

    #[test]
    fn agreeing_repeats_are_one_value() {
        assert_eq!(parse(&[b"7", b"7"]), Ok(Some(7)));
        assert_eq!(parse(&[b"7, 7"]), Ok(Some(7)));
    }

    #[test]
    fn malformed_values_are_refused() {
        for bad in [
            &b""[..],
            b"+1",
            b"-1",
            b"1 2",
            b"0x10",
            b"1.0",
            b"abc",
            b"18446744073709551616",
            b"99999999999999999999999",
            b"7,",
            b",7",
            b"1e3",
        ] {
            assert!(parse(&[bad]).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn disagreeing_values_are_refused() {
        assert!(parse(&[b"7", b"8"]).is_err());
        assert!(parse(&[b"7,8"]).is_err());
    }
}
