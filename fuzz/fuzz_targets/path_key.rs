//! Path checking and key mapping: arbitrary text as a request path.
//!
//! For an accepted path, the rule of `proxy::path` must hold on the decoded
//! form: no `\`, no control characters, no `.` or `..` segment, no empty
//! segment except a single trailing one; `segments()` joins back to it; and
//! it has exactly one meaning whatever the spelling: re-encoding every byte
//! (except `/`) as `%XX` gives the same key, and, when the decoded form has
//! no `%`, using it raw does too. Then the routes' templates match as a
//! small model says and render the expected resource keys.
//!
//! For any path, an independent model of the rule must agree on accept or
//! refuse and on the decoded form.
#![no_main]

use fencegate::proxy::path::check_path;
use fencegate::proxy::template::Template;
use libfuzzer_sys::fuzz_target;

/// Independent model: `Some(decoded)` iff the path is acceptable.
fn model(raw: &str) -> Option<String> {
    let rest = raw.strip_prefix('/')?;
    let b = rest.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let h = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            if !h.bytes().all(|c| c.is_ascii_hexdigit()) {
                return None;
            }
            let v = u8::from_str_radix(h, 16).ok()?;
            if v == b'/' || v == b'\\' {
                return None;
            }
            out.push(v);
            i += 3;
        } else {
            if b[i] == b'\\' {
                return None;
            }
            out.push(b[i]);
            i += 1;
        }
    }
    let d = String::from_utf8(out).ok()?;
    if d.chars().any(char::is_control) {
        return None;
    }
    if !d.is_empty() {
        let segs: Vec<&str> = d.split('/').collect();
        for (i, s) in segs.iter().enumerate() {
            if (s.is_empty() && i + 1 != segs.len()) || *s == "." || *s == ".." {
                return None;
            }
        }
    }
    Some(d)
}

fn encode_all(decoded: &str) -> String {
    let mut s = String::from("/");
    for b in decoded.bytes() {
        if b == b'/' {
            s.push('/');
        } else {
            s.push_str(&format!("%{b:02X}"));
        }
    }
    s
}

fuzz_target!(|raw: &str| {
    let got = check_path(raw);
    let want = model(raw);
    assert_eq!(got.as_ref().ok().map(|p| p.decoded.clone()), want, "check_path({raw:?}) = {got:?}");
    let Ok(p) = got else { return };

    let d = &p.decoded;
    assert!(raw.starts_with('/'));
    assert!(!d.contains('\\'), "{d:?}");
    assert!(!d.chars().any(char::is_control), "{d:?}");
    assert!(!d.starts_with('/'), "{d:?}");
    let segs = p.segments();
    assert_eq!(segs.is_empty(), d.is_empty());
    assert_eq!(segs.join("/"), *d);
    for (i, s) in segs.iter().enumerate() {
        assert!(*s != "." && *s != "..", "{d:?}");
        assert!(!s.is_empty() || i + 1 == segs.len(), "empty segment in {d:?}");
    }

    // One key, whatever the spelling.
    let enc = encode_all(d);
    assert_eq!(check_path(&enc).map(|p| p.decoded), Ok(d.clone()), "re-encoded {enc:?}");
    // `enc` is only `/`, `%` and upper-case hex digits: lower-case escapes too.
    let lower = enc.to_ascii_lowercase();
    assert_eq!(check_path(&lower).map(|p| p.decoded), Ok(d.clone()), "lower-case escapes {lower:?}");
    if !d.contains('%') {
        assert_eq!(check_path(&format!("/{d}")).map(|p| p.decoded), Ok(d.clone()), "raw decoded");
    }

    // The catch-all route: everything, keyed by the whole path.
    let all = Template::parse_match("/{*path}").expect("catch-all template");
    let caps = all.matches(&segs).expect("catch-all matches everything");
    assert_eq!(caps["path"], *d);
    let res = Template::parse_resource("{path}", &all).expect("resource template");
    assert_eq!(res.render(&caps), *d);

    // A named route.
    let orders = Template::parse_match("/orders/{id}/{*rest}").expect("orders template");
    let expect = segs.len() >= 2 && segs[0] == "orders" && !segs[1].is_empty();
    match orders.matches(&segs) {
        Some(c) => {
            assert!(expect, "orders matched {segs:?}");
            assert_eq!(c["id"], segs[1]);
            assert_eq!(c["rest"], segs[2..].join("/"));
            let key = Template::parse_resource("orders/{id}", &orders).expect("orders resource").render(&c);
            assert_eq!(key, format!("orders/{}", segs[1]));
            let both = Template::parse_resource("o-{id}:{rest}", &orders).expect("resource").render(&c);
            assert_eq!(both, format!("o-{}:{}", c["id"], c["rest"]));
        }
        None => assert!(!expect, "orders did not match {segs:?}"),
    }

    // An exact route: two segments, the second non-empty.
    let exact = Template::parse_match("/a/{x}").expect("exact template");
    let expect = segs.len() == 2 && segs[0] == "a" && !segs[1].is_empty();
    assert_eq!(exact.matches(&segs).is_some(), expect, "{segs:?}");
});
