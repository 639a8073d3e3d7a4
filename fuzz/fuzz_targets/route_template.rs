//! Route templates: arbitrary UTF-8 text read as
//! `MATCH \0 RESOURCE [\0 SEGMENT]...` (a plain format, so the seeds in
//! `fuzz/seeds/route_template` are readable).
//!
//! When `parse_match` accepts, a small model built from the text itself
//! (literal / `{name}` / final `{*name}`) must agree with `matches` on any
//! segments, and a witness path built from the template must match. When
//! `parse_resource` accepts too, rendering with every name bound to
//! `{name}` must give the resource text back, and rendering real captures
//! must not panic.
#![no_main]

use fencegate::proxy::template::{Captures, Template};
use libfuzzer_sys::fuzz_target;

enum P<'a> {
    Lit(&'a str),
    Param(&'a str),
    Rest(&'a str),
}

/// Reads an accepted match template back as parts (the text is known good).
fn parts(text: &str) -> Vec<P<'_>> {
    let rest = text.strip_prefix('/').expect("accepted templates start with /");
    if rest.is_empty() {
        return Vec::new();
    }
    rest.split('/')
        .map(|s| match s.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
            Some(inner) => match inner.strip_prefix('*') {
                Some(n) => P::Rest(n),
                None => P::Param(inner),
            },
            None => P::Lit(s),
        })
        .collect()
}

fn model_match(parts: &[P<'_>], segs: &[&str]) -> Option<Captures> {
    let mut caps = Captures::new();
    let mut i = 0;
    for p in parts {
        match p {
            P::Lit(l) => {
                if segs.get(i) != Some(l) {
                    return None;
                }
                i += 1;
            }
            P::Param(n) => {
                let s = segs.get(i).filter(|s| !s.is_empty())?;
                caps.insert((*n).to_string(), (*s).to_string());
                i += 1;
            }
            P::Rest(n) => {
                caps.insert((*n).to_string(), segs[i..].join("/"));
                i = segs.len();
            }
        }
    }
    (i == segs.len()).then_some(caps)
}

fn valid_name(n: &str) -> bool {
    let mut c = n.chars();
    matches!(c.next(), Some(f) if f.is_ascii_alphabetic() || f == '_')
        && c.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fuzz_target!(|text: &str| {
    let mut fields = text.split('\0');
    let match_text = fields.next().unwrap_or("");
    let resource_text = fields.next().unwrap_or("");
    let segs: Vec<&str> = fields.collect();
    let Ok(m) = Template::parse_match(match_text) else {
        // Refused: still parse the resource text against a fixed matcher.
        if let Ok(fixed) = Template::parse_match("/{a}/{*b}") {
            let _ = Template::parse_resource(resource_text, &fixed);
        }
        return;
    };
    let parts = parts(match_text);
    for (i, p) in parts.iter().enumerate() {
        match p {
            P::Lit(l) => assert!(!l.is_empty() && !l.contains('{') && !l.contains('}'), "{match_text:?}"),
            P::Param(n) => assert!(valid_name(n), "{match_text:?}"),
            P::Rest(n) => assert!(valid_name(n) && i + 1 == parts.len(), "{match_text:?}"),
        }
    }

    // Arbitrary segments: implementation and model agree.
    let got = m.matches(&segs);
    assert_eq!(got, model_match(&parts, &segs), "{match_text:?} on {segs:?}");
    let with_empty: Vec<&str> = segs.iter().copied().chain([""]).collect();
    assert_eq!(m.matches(&with_empty), model_match(&parts, &with_empty));

    // A witness path built from the template matches.
    let mut witness = Vec::new();
    for p in &parts {
        match p {
            P::Lit(l) => witness.push(*l),
            P::Param(_) => witness.push("v"),
            P::Rest(_) => witness.extend(["r1", "r2"]),
        }
    }
    let wcaps = m.matches(&witness).expect("the witness path matches");
    for p in &parts {
        match p {
            P::Lit(_) => {}
            P::Param(n) => assert_eq!(wcaps[*n], "v"),
            P::Rest(n) => assert_eq!(wcaps[*n], "r1/r2"),
        }
    }

    let Ok(r) = Template::parse_resource(resource_text, &m) else { return };
    assert!(!resource_text.is_empty());
    // Binding each name to its own reference gives the text back.
    let mut names = Captures::new();
    for p in &parts {
        if let P::Param(n) | P::Rest(n) = p {
            names.insert((*n).to_string(), format!("{{{n}}}"));
        }
    }
    assert_eq!(r.render(&names), resource_text, "{match_text:?} / {resource_text:?}");
    let _ = r.render(&wcaps);
    let _ = r.render(&Captures::new());
    if let Some(c) = &got {
        let _ = r.render(c);
    }
});
