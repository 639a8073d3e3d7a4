//! `X-Fencing-Token` parsing: arbitrary bytes, split on `\n` into one or
//! several header values (a `\n` can never be inside a header value), fed to
//! `parse_token_header`; every piece is also fed to `parse_one`.
//!
//! Properties checked against an independent model of SPEC 4:
//! - `parse_one` accepts exactly 1..=20 ASCII digits that fit in a u64, and
//!   `n.to_string()` parses back to `n`;
//! - `parse_token_header` is `Ok(None)` only for no value at all, `Ok(Some(n))`
//!   exactly when every comma-separated element (OWS-trimmed) is `n`;
//! - several header lines mean the same as one comma-joined line;
//! - nothing panics.
#![no_main]

use fencegate::fence::parse_token_header;
use fencegate::fence::token::parse_one;
use http::{HeaderMap, HeaderValue};
use libfuzzer_sys::fuzz_target;

const NAME: &str = "x-fencing-token";

/// The model of one element: `Some(n)` iff valid.
fn model_one(b: &[u8]) -> Option<u64> {
    if b.is_empty() || b.len() > 20 || !b.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(b).ok()?.parse::<u64>().ok()
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

/// The model of the whole header: `Err(())` when malformed or disagreeing.
fn model_header(values: &[&[u8]]) -> Result<Option<u64>, ()> {
    let mut found = None;
    for v in values {
        for el in v.split(|b| *b == b',') {
            let n = model_one(trim_ows(el)).ok_or(())?;
            if found.is_some_and(|f| f != n) {
                return Err(());
            }
            found = Some(n);
        }
    }
    Ok(found)
}

fn check_one(bytes: &[u8]) {
    let got = parse_one(bytes);
    assert_eq!(got.clone().ok(), model_one(bytes), "parse_one({:?})", String::from_utf8_lossy(bytes));
    if let Ok(n) = got {
        let text = n.to_string();
        assert_eq!(parse_one(text.as_bytes()), Ok(n), "round trip of {n}");
        // Leading zeros are the only other spelling.
        let stripped = bytes.iter().position(|b| *b != b'0').map_or(&b"0"[..], |i| &bytes[i..]);
        assert_eq!(stripped, text.as_bytes());
    }
}

fuzz_target!(|data: &[u8]| {
    check_one(data);

    let pieces: Vec<&[u8]> = data.split(|b| *b == b'\n').collect();
    let mut values: Vec<&[u8]> = Vec::new();
    let mut map = HeaderMap::new();
    for p in &pieces {
        check_one(p);
        check_one(trim_ows(p));
        // Skip what can never be a header value.
        if let Ok(v) = HeaderValue::from_bytes(p) {
            map.append(NAME, v);
            values.push(p);
        }
    }

    let got = parse_token_header(map.get_all(NAME));
    let got_ok = got.clone().ok();
    let want = model_header(&values);
    assert_eq!(got.is_ok(), want.is_ok(), "values {values:?}: got {got:?}, model {want:?}");
    if let Ok(n) = &got {
        assert_eq!(Some(*n), want.ok(), "values {values:?}");
        assert_eq!(n.is_none(), values.is_empty());
    }

    // One comma-joined line means the same as several lines (RFC 9110 5.3).
    if values.len() > 1 {
        let joined = values.join(&b","[..]);
        if let Ok(v) = HeaderValue::from_bytes(&joined) {
            let mut one = HeaderMap::new();
            one.insert(NAME, v);
            let got_one = parse_token_header(one.get_all(NAME));
            assert_eq!(got_one.ok(), got_ok, "joined {:?}", String::from_utf8_lossy(&joined));
        }
    }

    // Other headers never count.
    let mut other = map.clone();
    other.append("x-fencing-tokens", HeaderValue::from_static("1"));
    other.append("fencing-token", HeaderValue::from_static("2"));
    assert_eq!(parse_token_header(other.get_all(NAME)).ok(), got_ok);
});
