//! Route templates: the `match` path template and the `resource` key
//! template of a `[[routes]]` entry.
//!
//! `match` is `/`-separated: literal segments, `{name}` (one segment) and a
//! final `{*name}` (the rest, possibly empty). `resource` is text with
//! `{name}` references to the match's names. Templates are parsed once at
//! start; matching works on already-checked, decoded segments.

use std::collections::HashMap;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Literal(String),
    Param(String),
    Rest(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Text(String),
    Var(String),
}

/// A parsed `match` or `resource` template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    parts: Vec<Part>,
    pieces: Vec<Piece>,
}

/// The names a match captured, borrowed from the request's segments.
pub type Captures = HashMap<String, String>;

fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

impl Template {
    /// Parses a `match` template.
    pub fn parse_match(text: &str) -> Result<Template, String> {
        let Some(rest) = text.strip_prefix('/') else {
            return Err("must start with \"/\"".into());
        };
        let segments: Vec<&str> = if rest.is_empty() { Vec::new() } else { rest.split('/').collect() };
        let mut parts = Vec::new();
        let mut names = std::collections::HashSet::new();
        for (i, seg) in segments.iter().enumerate() {
            let part = if let Some(inner) = seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
                if let Some(name) = inner.strip_prefix('*') {
                    if i + 1 != segments.len() {
                        return Err(format!("{{*{name}}} must be the last segment"));
                    }
                    Part::Rest(name.to_string())
                } else {
                    Part::Param(inner.to_string())
                }
            } else if seg.contains('{') || seg.contains('}') {
                return Err(format!("segment {seg:?} mixes text and braces"));
            } else if seg.is_empty() {
                return Err("empty segment".into());
            } else {
                Part::Literal((*seg).to_string())
            };
            if let Part::Param(n) | Part::Rest(n) = &part {
                if !valid_name(n) {
                    return Err(format!("{n:?} is not a valid name ([A-Za-z_][A-Za-z0-9_]*)"));
                }
                if !names.insert(n.clone()) {
                    return Err(format!("name {n:?} is used twice"));
                }
            }
            parts.push(part);
        }
        Ok(Template { parts, pieces: Vec::new() })
    }

    /// Parses a `resource` template against the names of `matcher`.
    pub fn parse_resource(text: &str, matcher: &Template) -> Result<Template, String> {
        let mut pieces = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            match rest.find('{') {
                Some(0) => {
                    let Some(end) = rest.find('}') else {
                        return Err("unclosed \"{\"".into());
                    };
                    let name = &rest[1..end];
                    if !matcher.names().any(|n| n == name) {
                        return Err(format!("{{{name}}} is not a name of the match template"));
                    }
                    pieces.push(Piece::Var(name.to_string()));
                    rest = &rest[end + 1..];
                }
                Some(i) => {
                    pieces.push(Piece::Text(rest[..i].to_string()));
                    rest = &rest[i..];
                }
                None => {
                    pieces.push(Piece::Text(rest.to_string()));
                    rest = "";
                }
            }
            if let Some(Piece::Text(t)) = pieces.last() {
                if t.contains('}') {
                    return Err("unmatched \"}\"".into());
                }
            }
        }
        if pieces.is_empty() {
            return Err("must not be empty".into());
        }
        Ok(Template { parts: Vec::new(), pieces })
    }

    fn names(&self) -> impl Iterator<Item = &str> {
        self.parts.iter().filter_map(|p| match p {
            Part::Param(n) | Part::Rest(n) => Some(n.as_str()),
            Part::Literal(_) => None,
        })
    }

    /// Matches decoded path segments; `None` when the route does not apply.
    pub fn matches(&self, segments: &[&str]) -> Option<Captures> {
        let mut caps = Captures::new();
        self.walk(segments, Some(&mut caps)).then_some(caps)
    }

    /// True when the segments match (no captures are built).
    pub fn is_match(&self, segments: &[&str]) -> bool {
        self.walk(segments, None)
    }

    fn walk(&self, segments: &[&str], mut caps: Option<&mut Captures>) -> bool {
        let mut i = 0;
        for part in &self.parts {
            match part {
                Part::Literal(l) => {
                    if segments.get(i) != Some(&l.as_str()) {
                        return false;
                    }
                    i += 1;
                }
                Part::Param(n) => {
                    let Some(seg) = segments.get(i) else {
                        return false;
                    };
                    if seg.is_empty() {
                        return false;
                    }
                    if let Some(caps) = caps.as_deref_mut() {
                        caps.insert(n.clone(), (*seg).to_string());
                    }
                    i += 1;
                }
                Part::Rest(n) => {
                    if let Some(caps) = caps.as_deref_mut() {
                        caps.insert(n.clone(), segments[i.min(segments.len())..].join("/"));
                    }
                    i = segments.len();
                }
            }
        }
        i == segments.len()
    }

    /// Renders a resource template with the captures of a match.
    pub fn render(&self, caps: &Captures) -> String {
        let mut out = String::new();
        for piece in &self.pieces {
            match piece {
                Piece::Text(t) => out.push_str(t),
                Piece::Var(v) => out.push_str(caps.get(v).map_or("", String::as_str)),
            }
        }
        out
    }
}

/// One element of a [`KeyShape`]: a class of characters, once or repeated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    Char(char),
    /// Any character but `/` (within one path segment).
    NotSlash,
    /// Any character.
    Any,
}

impl Class {
    fn meets(self, other: Class) -> bool {
        match (self, other) {
            (Class::Char(a), Class::Char(b)) => a == b,
            (Class::Char(c), Class::NotSlash) | (Class::NotSlash, Class::Char(c)) => c != '/',
            _ => true,
        }
    }
}

/// The set of resource keys a route can produce, as a small regular
/// expression (`{id}`: one or more characters but `/`; `{*rest}`: any
/// characters). Only for configuration checks, never on the data path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyShape(Vec<(Class, bool)>);

impl KeyShape {
    /// The keys of a route: its resource template over its match, or
    /// (none) the matched path without its leading `/`.
    pub fn of(matcher: &Template, resource: Option<&Template>) -> KeyShape {
        let mut out = Vec::new();
        let var = |out: &mut Vec<(Class, bool)>, rest: bool| {
            if rest {
                out.push((Class::Any, true));
            } else {
                out.push((Class::NotSlash, false));
                out.push((Class::NotSlash, true));
            }
        };
        match resource {
            Some(r) => {
                for piece in &r.pieces {
                    match piece {
                        Piece::Text(t) => out.extend(t.chars().map(|c| (Class::Char(c), false))),
                        Piece::Var(v) => {
                            let rest = matcher.parts.iter().any(|p| matches!(p, Part::Rest(n) if n == v));
                            var(&mut out, rest);
                        }
                    }
                }
            }
            None => {
                for (i, part) in matcher.parts.iter().enumerate() {
                    if i > 0 {
                        out.push((Class::Char('/'), false));
                    }
                    match part {
                        Part::Literal(l) => out.extend(l.chars().map(|c| (Class::Char(c), false))),
                        Part::Param(_) => var(&mut out, false),
                        Part::Rest(_) => var(&mut out, true),
                    }
                }
            }
        }
        KeyShape(out)
    }

    /// True when some key is produced by both shapes (a walk over the
    /// product of the two expressions).
    pub fn overlaps(&self, other: &KeyShape) -> bool {
        let (a, b) = (&self.0, &other.0);
        let mut seen = std::collections::HashSet::new();
        let mut todo = vec![(0usize, 0usize)];
        while let Some((i, j)) = todo.pop() {
            if !seen.insert((i, j)) {
                continue;
            }
            if i == a.len() && j == b.len() {
                return true;
            }
            // A repeated class may also be skipped.
            if a.get(i).is_some_and(|x| x.1) {
                todo.push((i + 1, j));
            }
            if b.get(j).is_some_and(|y| y.1) {
                todo.push((i, j + 1));
            }
            if let (Some(x), Some(y)) = (a.get(i), b.get(j)) {
                if x.0.meets(y.0) {
                    todo.push((if x.1 { i } else { i + 1 }, if y.1 { j } else { j + 1 }));
                }
            }
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_and_rest_segments_capture() {
        let m = Template::parse_match("/orders/{id}/{*rest}").unwrap();
        let caps = m.matches(&["orders", "42", "lines", "7"]).unwrap();
        assert_eq!(caps["id"], "42");
        assert_eq!(caps["rest"], "lines/7");
        let r = Template::parse_resource("orders/{id}", &m).unwrap();
        assert_eq!(r.render(&caps), "orders/42");
        assert!(m.matches(&["order", "42"]).is_none());
    }

    #[test]
    fn catch_all_matches_everything() {
        let m = Template::parse_match("/{*path}").unwrap();
        assert_eq!(m.matches(&["a", "b"]).unwrap()["path"], "a/b");
        assert_eq!(m.matches(&[]).unwrap()["path"], "");
    }

    #[test]
    fn exact_templates_need_every_segment() {
        let m = Template::parse_match("/a/{x}").unwrap();
        assert!(m.matches(&["a"]).is_none());
        assert!(m.matches(&["a", "1", "2"]).is_none());
        assert!(m.matches(&["a", "1"]).is_some());
        for segs in [&["a"][..], &["a", "1", "2"], &["a", "1"], &["a", ""], &["b", "1"]] {
            assert_eq!(m.is_match(segs), m.matches(segs).is_some(), "{segs:?}");
        }
    }

    #[test]
    fn bad_templates_are_refused() {
        for bad in ["a/b", "/{*r}/x", "/x{y}", "/{1a}", "/{a}/{a}", "/a//b"] {
            assert!(Template::parse_match(bad).is_err(), "{bad}");
        }
        let m = Template::parse_match("/{id}").unwrap();
        for bad in ["{nope}", "x/{id", "x}", ""] {
            assert!(Template::parse_resource(bad, &m).is_err(), "{bad}");
        }
    }

    fn shape(m: &str, r: Option<&str>) -> KeyShape {
        let m = Template::parse_match(m).unwrap();
        let r = r.map(|r| Template::parse_resource(r, &m).unwrap());
        KeyShape::of(&m, r.as_ref())
    }

    #[test]
    fn key_shapes_overlap_when_some_key_is_in_both() {
        let invoices = shape("/invoices/{*rest}", None);
        assert!(shape("/{*path}", None).overlaps(&invoices), "a catch-all covers every key");
        assert!(shape("/{a}/{b}", None).overlaps(&invoices));
        assert!(shape("/legacy/{id}", Some("invoices/{id}")).overlaps(&invoices));
        assert!(!shape("/orders/{*rest}", None).overlaps(&invoices));
        assert!(!shape("/invoices", None).overlaps(&shape("/invoices/{id}", None)));
        assert!(!shape("/{id}", None).overlaps(&shape("/a/{id}", None)), "one segment never holds a slash");
        assert!(shape("/x/{*rest}", Some("inv{rest}")).overlaps(&shape("/invoices/{id}", Some("invoices/{id}"))));
        assert!(!shape("/x/{id}", Some("inv{id}")).overlaps(&shape("/invoices/{id}", None)), "{{id}} holds no slash");
    }
}
