//! The keys of a `DeleteObjects` body, and nothing else of XML.
//!
//! A deliberately strict reader: the body must be the document S3
//! documents — an optional `<?xml …?>` declaration (plain `version`,
//! `encoding`, `standalone` values), `<Delete>` (attributes, e.g. `xmlns`,
//! with quoted values free of `<`, `>` and `&`; no other element may have
//! any), optional `<Quiet>`, and `<Object>` elements
//! holding `<Key>` and optionally `<VersionId>`, `<ETag>`,
//! `<LastModifiedTime>`, `<Size>`. Text may use the five predefined
//! entities and character references. Anything else — comments, CDATA,
//! a DOCTYPE, processing instructions, namespace prefixes, unknown
//! elements, an `<Object>` without exactly one `<Key>` — is refused, so a
//! server can never see a key this reader did not (a refused request is
//! never forwarded). Markup is read the way XML reads it where it counts:
//! a tag ends at the first `>` outside a quoted value (an outside review
//! had `<Key a=">">VICTIM</Key>` fenced as `">VICTIM` while s3s deleted
//! `VICTIM`), which is why attributes are refused where S3 has none.

use super::MAX_DELETE_KEYS;

/// The object keys a `DeleteObjects` body names, in order.
pub fn delete_keys(body: &[u8]) -> Result<Vec<String>, String> {
    let text = std::str::from_utf8(body).map_err(|_| "the body is not UTF-8")?;
    let mut r = Reader { s: text, i: 0 };
    r.skip_ws();
    if let Some(decl) = r.rest().strip_prefix("<?xml") {
        let end = decl.find("?>").ok_or("unterminated XML declaration")?;
        // Only what a declaration holds: names, `=`, quotes and plain
        // values (no `>` or `?` inside a quoted value to end it elsewhere).
        let inner = &decl[..end];
        let plain = |b: u8| b.is_ascii_alphanumeric() || b" \t\r\n=\"'._-".contains(&b);
        if !inner.starts_with([' ', '\t', '\r', '\n']) || !inner.bytes().all(plain) {
            return Err("an XML declaration other than version, encoding and standalone".into());
        }
        // The body is read as UTF-8; a server that decodes it in a declared
        // encoding reads other keys (moto deleted `…Ã©` for `…é` under
        // ISO-8859-1: outside review). Only UTF-8 may be declared.
        let compact: String = inner.chars().filter(|c| !c.is_ascii_whitespace()).collect();
        let mut declared = compact.match_indices("encoding");
        if let Some((at, _)) = declared.next() {
            let value = compact[at + "encoding".len()..].strip_prefix('=').and_then(|v| {
                let quote = v.chars().next().filter(|q| *q == '"' || *q == '\'')?;
                v[1..].split(quote).next()
            });
            if declared.next().is_some() || !value.is_some_and(|v| v.eq_ignore_ascii_case("utf-8")) {
                return Err("an XML declaration naming an encoding other than UTF-8".into());
            }
        }
        r.i += "<?xml".len() + end + 2;
    }
    r.skip_ws();
    r.open_root("Delete")?;
    let mut keys = Vec::new();
    loop {
        r.skip_ws();
        if r.rest().starts_with("</") {
            r.close("Delete")?;
            break;
        }
        let name = r.open_any()?;
        match name.as_str() {
            "Quiet" => {
                r.text()?;
                r.close("Quiet")?;
            }
            "Object" => {
                let mut key = None;
                loop {
                    r.skip_ws();
                    if r.rest().starts_with("</") {
                        r.close("Object")?;
                        break;
                    }
                    let field = r.open_any()?;
                    let value = r.text()?;
                    r.close(&field)?;
                    match field.as_str() {
                        "Key" if key.is_none() => key = Some(value),
                        "Key" => return Err("an <Object> with two <Key>s".into()),
                        "VersionId" | "ETag" | "LastModifiedTime" | "Size" => {}
                        other => return Err(format!("unexpected <{other}> in <Object>")),
                    }
                }
                let key = key.ok_or("an <Object> without <Key>")?;
                keys.push(key);
                if keys.len() > MAX_DELETE_KEYS {
                    return Err(format!("more than {MAX_DELETE_KEYS} keys"));
                }
            }
            other => return Err(format!("unexpected <{other}> in <Delete>")),
        }
    }
    r.skip_ws();
    if r.i != r.s.len() {
        return Err("content after </Delete>".into());
    }
    if keys.is_empty() {
        return Err("no <Object> to delete".into());
    }
    Ok(keys)
}

/// The payload of an `aws-chunked` body (`hex-size[;chunk-signature=…]`
/// CRLF data CRLF …, a zero-size chunk, then trailers), for reading only.
pub fn aws_unchunk(body: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(body.len());
    let mut rest = body;
    loop {
        let line_end = rest.windows(2).position(|w| w == b"\r\n").ok_or("a chunk header without CRLF")?;
        let header = std::str::from_utf8(&rest[..line_end]).map_err(|_| "a chunk header is not text")?;
        let (size_text, ext) = header.split_once(';').map_or((header, None), |(s, e)| (s, Some(e)));
        // 1 to 8 hex digits, nothing else (s3s reads at most 8).
        if size_text.is_empty() || size_text.len() > 8 || !size_text.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(format!("bad chunk size {:?}", size_text.chars().take(20).collect::<String>()));
        }
        // The one extension S3 defines, exactly; any other is refused.
        if let Some(ext) = ext {
            let sig = ext.strip_prefix("chunk-signature=").ok_or("a chunk extension other than chunk-signature")?;
            if sig.len() != 64 || !sig.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err("a malformed chunk-signature".into());
            }
        }
        let size = usize::from_str_radix(size_text, 16).map_err(|_| format!("bad chunk size {size_text:?}"))?;
        rest = &rest[line_end + 2..];
        if size == 0 {
            return Ok(out);
        }
        let data = rest.get(..size).ok_or("a chunk shorter than its size")?;
        out.extend_from_slice(data);
        rest = rest.get(size..).and_then(|r| r.strip_prefix(b"\r\n")).ok_or("a chunk not followed by CRLF")?;
    }
}

struct Reader<'a> {
    s: &'a str,
    i: usize,
}

impl<'a> Reader<'a> {
    fn rest(&self) -> &'a str {
        &self.s[self.i..]
    }

    fn skip_ws(&mut self) {
        let trimmed = self.rest().trim_start_matches([' ', '\t', '\r', '\n']);
        self.i = self.s.len() - trimmed.len();
    }

    /// `<Name>`: the name (a plain name, no prefix, not self-closing, no
    /// attributes: S3 puts none on the elements inside `<Delete>`).
    fn open_any(&mut self) -> Result<String, String> {
        self.open_tag(false)
    }

    /// `<want attr…>`, the document's root: attributes allowed (`xmlns`).
    fn open_root(&mut self, want: &str) -> Result<(), String> {
        let name = self.open_tag(true)?;
        if name != want {
            return Err(format!("expected <{want}>, found <{name}>"));
        }
        Ok(())
    }

    /// A start tag, read the way XML reads it: attribute values are quoted
    /// and may hold a `>`, so the tag ends at the first `>` outside them.
    /// Stricter than XML: no space around `=`, and a value holding `<`,
    /// `>` or `&` is refused.
    fn open_tag(&mut self, attributes: bool) -> Result<String, String> {
        let rest = self.rest();
        let Some(inner) = rest.strip_prefix('<') else {
            return Err("expected an element".into());
        };
        let b = inner.as_bytes();
        let mut j = b.iter().take_while(|c| c.is_ascii_alphanumeric()).count();
        let name = &inner[..j];
        let markup = || format!("unexpected markup <{}", inner.chars().take(40).collect::<String>());
        if name.is_empty() {
            return Err(markup());
        }
        let is_ws = |c: u8| matches!(c, b' ' | b'\t' | b'\r' | b'\n');
        loop {
            let spaced = b.get(j).is_some_and(|&c| is_ws(c));
            while b.get(j).is_some_and(|&c| is_ws(c)) {
                j += 1;
            }
            match b.get(j) {
                None => return Err("unterminated tag".into()),
                Some(b'>') => break,
                Some(b'/') => return Err(format!("unexpected empty element <{name}/>")),
                Some(_) if !attributes => return Err(format!("an attribute on <{name}>")),
                Some(_) if !spaced => return Err(markup()),
                Some(_) => {
                    let start = j;
                    while b.get(j).is_some_and(|&c| c.is_ascii_alphanumeric() || b":_.-".contains(&c)) {
                        j += 1;
                    }
                    let quote = match (j > start, b.get(j), b.get(j + 1)) {
                        (true, Some(b'='), Some(&q @ (b'"' | b'\''))) => q,
                        _ => return Err(format!("a malformed attribute on <{name}>")),
                    };
                    j += 2;
                    while let Some(&c) = b.get(j).filter(|&&c| c != quote) {
                        if matches!(c, b'<' | b'>' | b'&') {
                            return Err(format!("an attribute value with {:?} on <{name}>", c as char));
                        }
                        j += 1;
                    }
                    if j == b.len() {
                        return Err("unterminated attribute value".into());
                    }
                    j += 1;
                }
            }
        }
        self.i += 1 + j + 1;
        Ok(name.to_string())
    }

    fn close(&mut self, want: &str) -> Result<(), String> {
        let tag = format!("</{want}>");
        if !self.rest().starts_with(&tag) {
            return Err(format!("expected {tag}"));
        }
        self.i += tag.len();
        Ok(())
    }

    /// Text up to the next `<`, entities resolved.
    fn text(&mut self) -> Result<String, String> {
        let rest = self.rest();
        let end = rest.find('<').ok_or("unterminated text")?;
        let raw = &rest[..end];
        self.i += end;
        unescape(raw)
    }
}

fn unescape(raw: &str) -> Result<String, String> {
    if raw.contains('\r') {
        // XML folds a raw CR (and CRLF) into LF: a key sent that way is
        // read differently by a conforming server. Refused.
        return Err("a raw carriage return in text".into());
    }
    let mut out = String::with_capacity(raw.len());
    let mut rest = raw;
    while let Some(amp) = rest.find('&') {
        out.push_str(&rest[..amp]);
        let after = &rest[amp + 1..];
        let semi = after.find(';').ok_or("unterminated entity")?;
        let name = &after[..semi];
        let c = match name {
            "amp" => '&',
            "lt" => '<',
            "gt" => '>',
            "quot" => '"',
            "apos" => '\'',
            _ => {
                let code = if let Some(hex) = name.strip_prefix("#x").or_else(|| name.strip_prefix("#X")) {
                    u32::from_str_radix(hex, 16).ok()
                } else if let Some(dec) = name.strip_prefix('#') {
                    dec.parse().ok()
                } else {
                    None
                };
                code.and_then(char::from_u32).ok_or_else(|| format!("unknown entity &{name};"))?
            }
        };
        out.push(c);
        rest = &after[semi + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_documented_body_gives_its_keys() {
        let body = br#"<?xml version="1.0" encoding="UTF-8"?>
<Delete xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Quiet>true</Quiet>
  <Object><Key>a/b.txt</Key></Object>
  <Object><Key>x &amp; y&#x2F;&lt;z&gt;</Key><VersionId>v1</VersionId></Object>
</Delete>"#;
        assert_eq!(delete_keys(body).unwrap(), vec!["a/b.txt".to_string(), "x & y/<z>".to_string()]);
    }

    #[test]
    fn the_root_s_attributes_are_read_quote_aware() {
        for ok in [
            "<Delete xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\"><Object><Key>k</Key></Object></Delete>",
            "<Delete xmlns='http://s3.amazonaws.com/doc/2006-03-01/' a=\"b\"><Object><Key>k</Key></Object></Delete>",
            "<?xml version='1.0' encoding=\"utf-8\" standalone=\"yes\"?>\n<Delete\n xmlns=\"u\" ><Object><Key>k</Key></Object></Delete>",
            "<?xml version=\"1.0\" encoding = 'UTF-8'?><Delete><Object><Key>k</Key></Object></Delete>",
        ] {
            assert_eq!(delete_keys(ok.as_bytes()).unwrap(), vec!["k".to_string()], "{ok}");
        }
    }

    #[test]
    fn anything_unexpected_is_refused() {
        for bad in [
            "",
            "<Delete></Delete>",
            "<Delete><Object></Object></Delete>",
            "<Delete><Object><Key>a</Key><Key>b</Key></Object></Delete>",
            "<Delete><!-- c --><Object><Key>a</Key></Object></Delete>",
            "<Delete><Object><Key><![CDATA[a]]></Key></Object></Delete>",
            "<!DOCTYPE x><Delete><Object><Key>a</Key></Object></Delete>",
            "<Delete><Object><s3:Key>a</s3:Key></Object></Delete>",
            "<Delete><Object><Key>a</Key><Other>1</Other></Object></Delete>",
            "<Delete><Object><Key>&bogus;</Key></Object></Delete>",
            "<Delete><Object><Key>a</Key></Object></Delete><Delete/>",
            "<Delete><Object><Key>a</Key></Object>",
            "<Delete><Object><Key/></Object></Delete>",
            // A `>` inside a quoted value does not end the tag (XML), and
            // only <Delete> may have attributes (outside review, F1).
            "<Delete><Object><Key a=\">\">VICTIM</Key></Object></Delete>",
            "<Delete><Object><Key a='>mine/'>VICTIM</Key></Object></Delete>",
            "<Delete><Object a=\"1\"><Key>a</Key></Object></Delete>",
            "<Delete><Quiet a=\"1\">true</Quiet><Object><Key>a</Key></Object></Delete>",
            "<Delete x=\">\"><Object><Key>a</Key></Object></Delete>",
            "<Delete x=\"<\"><Object><Key>a</Key></Object></Delete>",
            "<Delete x=\"&amp;\"><Object><Key>a</Key></Object></Delete>",
            "<Delete x=\"a><Object><Key>a</Key></Object></Delete>",
            "<Delete x = \"a\"><Object><Key>a</Key></Object></Delete>",
            "<Delete x=a><Object><Key>a</Key></Object></Delete>",
            "<Delete\"x\"><Object><Key>a</Key></Object></Delete>",
            "<?xml version=\"1.0?>\"?><Delete><Object><Key>a</Key></Object></Delete>",
            "<?xml version=\"1.0\" x=\"<\"?><Delete><Object><Key>a</Key></Object></Delete>",
            "<?xmlfoo?><Delete><Object><Key>a</Key></Object></Delete>",
            "<?xml version=\"1.0\" encoding=\"ISO-8859-1\"?><Delete><Object><Key>a</Key></Object></Delete>",
            "<?xml version=\"1.0\" encoding='windows-1252'?><Delete><Object><Key>a</Key></Object></Delete>",
            "<?xml version=\"1.0\" encoding=\"utf-8\" encoding=\"koi8-r\"?><Delete><Object><Key>a</Key></Object></Delete>",
            "<?xml version=\"1.0\" encoding=utf-8?><Delete><Object><Key>a</Key></Object></Delete>",
        ] {
            assert!(delete_keys(bad.as_bytes()).is_err(), "{bad}");
        }
    }

    #[test]
    fn no_input_makes_it_panic() {
        // Every prefix of a valid body, and bytes from a small PRNG mixed
        // into markup-looking text: errors, never a panic.
        let valid =
            "<?xml version=\"1.0\"?><Delete><Object><Key>é&amp;&#x41;</Key><VersionId>v</VersionId></Object></Delete>";
        for cut in 0..=valid.len() {
            let _ = delete_keys(&valid.as_bytes()[..cut]);
        }
        let alphabet = "<>/&;#x?! DeleteObjectKey=\"éab\r\n";
        let chars: Vec<char> = alphabet.chars().collect();
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..20_000 {
            let len = (seed % 48) as usize;
            let mut s = String::new();
            for _ in 0..len {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                s.push(chars[(seed % chars.len() as u64) as usize]);
            }
            let _ = delete_keys(s.as_bytes());
            let _ = delete_keys(format!("<Delete><Object><Key>{s}</Key></Object></Delete>").as_bytes());
        }
    }

    #[test]
    fn aws_chunked_bodies_are_read_through_their_framing() {
        let body = b"<Delete><Object><Key>a</Key></Object></Delete>";
        let sig = "ab".repeat(32);
        let framed = [
            format!("{:x};chunk-signature={sig}\r\n", 10).into_bytes(),
            body[..10].to_vec(),
            b"\r\n".to_vec(),
            format!("{:x};chunk-signature={sig}\r\n", body.len() - 10).into_bytes(),
            body[10..].to_vec(),
            format!("\r\n0;chunk-signature={sig}\r\nx-amz-checksum-crc32:AAAA\r\n\r\n").into_bytes(),
        ]
        .concat();
        assert_eq!(aws_unchunk(&framed).unwrap(), body.to_vec());
        assert_eq!(delete_keys(&aws_unchunk(&framed).unwrap()).unwrap(), vec!["a".to_string()]);
        for bad in [&b"zz\r\n"[..], b"5\r\nab", b"2\r\nabc\r\n0\r\n", b"", b"1\r\n"] {
            assert!(aws_unchunk(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn chunk_sizes_and_extensions_are_read_strictly() {
        // The reviewer's body: an extension hiding an element from this
        // reader that a server reading the raw bytes would see.
        let hidden =
            b"29\r\n<Delete><Object><Key>mine</Key></Object>\r\n9;a=<Object><Key>victim</Key></Object>\r\n</Delete>\r\n0\r\n\r\n";
        assert!(aws_unchunk(hidden).is_err());
        for bad in [
            &b"+1\r\na\r\n0\r\n\r\n"[..],
            b" 1\r\na\r\n0\r\n\r\n",
            b"1 \r\na\r\n0\r\n\r\n",
            b"000000001\r\na\r\n0\r\n\r\n",
            b"1;chunk-signature=abc\r\na\r\n0\r\n\r\n",
            b"1;chunk-signature\r\na\r\n0\r\n\r\n",
            b";\r\n",
        ] {
            assert!(aws_unchunk(bad).is_err(), "{bad:?}");
        }
        assert_eq!(aws_unchunk(b"00000001\r\na\r\n0\r\n\r\n").unwrap(), b"a".to_vec());
    }

    #[test]
    fn at_most_a_thousand_keys() {
        let body = |n: usize| {
            let objects: String = (0..n).map(|i| format!("<Object><Key>k{i}</Key></Object>")).collect();
            format!("<Delete>{objects}</Delete>")
        };
        assert_eq!(delete_keys(body(1000).as_bytes()).unwrap().len(), 1000);
        assert!(delete_keys(body(1001).as_bytes()).is_err());
    }
}
