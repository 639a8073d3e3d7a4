//! The fields of a browser `PostObject` upload (`multipart/form-data` to
//! `POST /bucket`), read up to the start of the file's content.
//!
//! S3 takes every field before the `file` part and ignores what follows
//! it; the object key is the `key` field. Multipart parsers differ at the
//! edges (which of two `key` fields counts, a `;` inside a quoted
//! filename, two `Content-Disposition` headers, bare-LF line ends), and a
//! server that read the form otherwise than this scan would write another
//! key than the one fenced. So the scan is strict and refuses whatever
//! another parser might read differently: the body must begin with the
//! boundary line; part headers end in CRLF only (no bare CR or LF, no
//! folded lines, no header twice); each part has exactly one
//! `Content-Disposition: form-data` with only `name` and `filename`
//! parameters, each at most once, a quoted value without backslashes;
//! field names (compared case-insensitively, as S3 does) appear once; a
//! `filename` only on the part named exactly `file`; and a key with
//! `${filename}` is refused (AWS substitutes the file's name, s3s does
//! not: the key the server writes cannot be known here). The scan reads
//! only a bounded prefix of the body; the caller forwards that prefix and
//! the rest of the body unchanged.

/// What the scan of a body prefix found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scan {
    /// The file part has not begun yet: read more.
    NeedMore,
    /// Every field before the file part (names lower-case), and where
    /// the file's content begins in the buffer scanned.
    Fields { fields: Vec<(String, String)>, content: usize },
}

/// The boundary of a `multipart/form-data` content type, read strictly:
/// `multipart/form-data` then `;`-separated parameters, each a token name,
/// `=` and a token, or a quoted string of token characters and spaces,
/// with spaces (not tabs: s3s refuses them) allowed only after a `;`, and
/// exactly one `boundary`.
/// Servers decide "is this a form" with parsers that differ on the rest
/// (s3s, with the `mime` crate, refuses `multipart/form-data ; boundary=B`,
/// which a lenient reading takes for a form: an outside review had such a
/// POST fenced as a PostObject while s3s ran it as a DeleteObjects), so
/// what is not in this grammar is no form here and the caller refuses it.
pub fn boundary(content_type: &str) -> Option<String> {
    let tchar = |c: u8| c.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&c);
    let b = content_type.as_bytes();
    let essence = b.iter().take_while(|&&c| tchar(c) || c == b'/').count();
    if !content_type[..essence].eq_ignore_ascii_case("multipart/form-data") {
        return None;
    }
    let mut j = essence;
    let mut found = None;
    while j < b.len() {
        if b[j] != b';' {
            return None;
        }
        j += 1;
        while b.get(j) == Some(&b' ') {
            j += 1;
        }
        let name_start = j;
        while b.get(j).is_some_and(|&c| tchar(c)) {
            j += 1;
        }
        let name = &content_type[name_start..j];
        if name.is_empty() || b.get(j) != Some(&b'=') {
            return None;
        }
        j += 1;
        let quoted = b.get(j) == Some(&b'"');
        let start = if quoted { j + 1 } else { j };
        j = start;
        while b.get(j).is_some_and(|&c| tchar(c) || (quoted && c == b' ')) {
            j += 1;
        }
        let value = &content_type[start..j];
        if quoted {
            if b.get(j) != Some(&b'"') {
                return None;
            }
            j += 1;
        }
        if value.is_empty() {
            return None;
        }
        if name.eq_ignore_ascii_case("boundary") {
            if found.is_some() {
                return None;
            }
            found = Some(value.to_string());
        }
    }
    found.filter(|b| b.len() <= 70)
}

/// Scans `buf` (a prefix of the body) for the fields before the file part.
pub fn scan(buf: &[u8], boundary: &str) -> Result<Scan, String> {
    let delim = format!("--{boundary}");
    if buf.len() < delim.len() {
        return if delim.as_bytes().starts_with(buf) { Ok(Scan::NeedMore) } else { Err(not_first()) };
    }
    if !buf.starts_with(delim.as_bytes()) {
        return Err(not_first());
    }
    let mut at = delim.len();
    let mut fields: Vec<(String, String)> = Vec::new();
    loop {
        let rest = &buf[at..];
        if rest.len() < 2 {
            return Ok(Scan::NeedMore);
        }
        if rest.starts_with(b"--") {
            return Err("the form has no file part".into());
        }
        let Some(rest) = rest.strip_prefix(b"\r\n") else {
            return Err("malformed multipart boundary line".into());
        };
        let head_end = find(rest, b"\r\n\r\n");
        // Bare CR or LF in the part's headers: another parser may end
        // them elsewhere.
        let head_region = &rest[..head_end.unwrap_or(rest.len())];
        check_crlf(head_region)?;
        let Some(head_end) = head_end else {
            return Ok(Scan::NeedMore);
        };
        let head = std::str::from_utf8(&rest[..head_end]).map_err(|_| "part headers are not UTF-8")?;
        let (name, filename) = part_head(head)?;
        let lower = name.to_ascii_lowercase();
        if lower == "file" && name != "file" {
            return Err(format!("a part named {name:?}: the file part is named \"file\""));
        }
        if fields.iter().any(|(n, _)| *n == lower) {
            return Err(format!("the field {name:?} appears twice"));
        }
        // The key's field exactly `key`: moto reads names case-sensitively
        // (an outside review had `KEY` fenced and a later `key` written).
        if lower == "key" && name != "key" {
            return Err(format!("a part named {name:?}: the object key's field is named \"key\""));
        }
        if name == "file" {
            let content = buf.len() - rest.len() + head_end + 4;
            return Ok(Scan::Fields { fields, content });
        }
        if filename.is_some() {
            return Err(format!("the part {name:?} has a filename but is not the file part"));
        }
        let body_start = head_end + 4;
        let close = format!("\r\n{delim}");
        let Some(len) = find(&rest[body_start..], close.as_bytes()) else {
            return Ok(Scan::NeedMore);
        };
        let value = std::str::from_utf8(&rest[body_start..body_start + len]).map_err(|_| "a field is not UTF-8")?;
        // Another parser ends a part at a bare LF or CR before the
        // delimiter too (werkzeug, so moto): a value holding one would
        // hide a part (outside review: a second `key` inside a field).
        if value.contains(&format!("\n{delim}")) || value.contains(&format!("\r{delim}")) {
            return Err(format!("the field {name:?} holds its form's boundary after a line break"));
        }
        fields.push((lower, value.to_string()));
        at = buf.len() - rest.len() + body_start + len + close.len();
    }
}

/// Watches the bytes of a form from its file's content on: the next
/// delimiter must close the form (`--boundary--`). S3 ignores fields after
/// the file part, but other servers read them (moto took a `key` field
/// after the file for the object's key), and the scan above stops at the
/// file: a part after it makes [`AfterFile::feed`] fail, and the caller
/// cuts the upload off there (the upstream never gets it whole).
#[derive(Debug)]
pub struct AfterFile {
    delim: Vec<u8>,
    /// Bytes still to skip (the fields, read by [`scan`]).
    skip: usize,
    /// The end of what was fed, kept to find a delimiter split across feeds.
    tail: Vec<u8>,
    closed: bool,
}

impl AfterFile {
    /// For a form with `boundary` whose file content begins `content`
    /// bytes into the body.
    pub fn new(boundary: &str, content: usize) -> AfterFile {
        AfterFile { delim: format!("--{boundary}").into_bytes(), skip: content, tail: Vec::new(), closed: false }
    }

    /// Takes the next bytes of the body; `Err` at a part after the file.
    pub fn feed(&mut self, data: &[u8]) -> Result<(), String> {
        let skipped = self.skip.min(data.len());
        self.skip -= skipped;
        let data = &data[skipped..];
        if self.closed || data.is_empty() {
            return Ok(());
        }
        let mut seen = std::mem::take(&mut self.tail);
        seen.extend_from_slice(data);
        // The first delimiter after the file decides: `--boundary` after a
        // line break, CRLF or (as werkzeug, so moto, also reads it) a bare
        // LF or CR.
        let mut from = 0;
        while let Some(at) = find(&seen[from..], &self.delim).map(|i| from + i) {
            from = at + 1;
            if !(at > 0 && matches!(seen[at - 1], b'\n' | b'\r')) {
                continue;
            }
            let after = at + self.delim.len();
            match seen.get(after..after + 2) {
                Some(b"--") => {
                    self.closed = true;
                    return Ok(());
                }
                Some(_) => return Err("a part after the file part".into()),
                None => break,
            }
        }
        let keep = self.delim.len() + 2;
        self.tail = seen[seen.len().saturating_sub(keep)..].to_vec();
        Ok(())
    }
}

fn not_first() -> String {
    "the form must begin with its boundary line".into()
}

/// Every CR is followed by LF and every LF preceded by CR.
fn check_crlf(region: &[u8]) -> Result<(), String> {
    for (i, b) in region.iter().enumerate() {
        let ok = match b {
            b'\r' => region.get(i + 1).is_none_or(|n| *n == b'\n'),
            b'\n' => i > 0 && region[i - 1] == b'\r',
            _ => true,
        };
        if !ok {
            return Err("a part header line not ended by CRLF".into());
        }
    }
    Ok(())
}

/// The `name` and `filename` of a part, from its headers: exactly one
/// well-formed `Content-Disposition: form-data`, no header twice, no
/// folded line.
fn part_head(head: &str) -> Result<(String, Option<String>), String> {
    let mut seen: Vec<String> = Vec::new();
    let mut disposition = None;
    for line in head.split("\r\n") {
        if line.starts_with([' ', '\t']) {
            return Err("a folded part header line".into());
        }
        let (n, v) = line.split_once(':').ok_or("a part header line without a colon")?;
        if n.is_empty() || !n.bytes().all(is_token_byte) {
            return Err(format!("a malformed part header name {:?}", n.chars().take(40).collect::<String>()));
        }
        let n = n.to_ascii_lowercase();
        if seen.contains(&n) {
            return Err(format!("the part header {n:?} appears twice"));
        }
        if n == "content-disposition" {
            disposition = Some(v);
        }
        seen.push(n);
    }
    disposition_params(disposition.ok_or("a part without Content-Disposition")?)
}

fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// `form-data; name="…"[; filename="…"]`, quoted-string aware.
fn disposition_params(value: &str) -> Result<(String, Option<String>), String> {
    let bad = |m: &str| format!("Content-Disposition: {m}");
    let v = value.trim_matches([' ', '\t']);
    let (kind, mut rest) = v.split_once(';').ok_or_else(|| bad("no parameters"))?;
    if !kind.trim_matches([' ', '\t']).eq_ignore_ascii_case("form-data") {
        return Err(bad("not form-data"));
    }
    let mut name = None;
    let mut filename = None;
    loop {
        rest = rest.trim_start_matches([' ', '\t']);
        let (pname, after) = rest.split_once('=').ok_or_else(|| bad("a parameter without a value"))?;
        let pname = pname.trim_end_matches([' ', '\t']);
        if pname.is_empty() || !pname.bytes().all(is_token_byte) {
            return Err(bad("a malformed parameter name"));
        }
        let after = after.trim_start_matches([' ', '\t']);
        let (pvalue, tail) = if let Some(q) = after.strip_prefix('"') {
            let end = q.find('"').ok_or_else(|| bad("an unterminated quoted value"))?;
            let inner = &q[..end];
            if inner.contains(['\\', '\r', '\n']) {
                return Err(bad("a quoted value with a backslash or a line break"));
            }
            (inner.to_string(), &q[end + 1..])
        } else {
            let end = after.find([';', ' ', '\t']).unwrap_or(after.len());
            let token = &after[..end];
            if token.is_empty() || !token.bytes().all(is_token_byte) {
                return Err(bad("a malformed parameter value"));
            }
            (token.to_string(), &after[end..])
        };
        let slot = match pname.to_ascii_lowercase().as_str() {
            "name" => &mut name,
            "filename" => &mut filename,
            _ => return Err(bad("a parameter other than name and filename")),
        };
        if slot.replace(pvalue).is_some() {
            return Err(bad("a parameter given twice"));
        }
        let tail = tail.trim_start_matches([' ', '\t']);
        if tail.is_empty() {
            break;
        }
        rest = tail.strip_prefix(';').ok_or_else(|| bad("text after a parameter value"))?;
        if rest.trim_matches([' ', '\t']).is_empty() {
            return Err(bad("a trailing \";\""));
        }
    }
    Ok((name.ok_or_else(|| bad("no name"))?, filename))
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The object key of a scanned form: its one `key` field. A key naming
/// `${filename}` is refused (AWS replaces it with the file's name, s3s
/// does not).
pub fn object_key(fields: &[(String, String)]) -> Result<String, String> {
    let key = &fields.iter().find(|(n, _)| n == "key").ok_or("the form has no key field")?.1;
    if key.is_empty() {
        return Err("the key field is empty".into());
    }
    if key.contains("${filename}") {
        return Err("a key with ${filename}: whether the server replaces it cannot be known".into());
    }
    Ok(key.clone())
}

/// The form field that may carry the token (S3 ignores `x-ignore-` fields,
/// so a signed policy need not list it).
pub const TOKEN_FIELD: &str = "x-ignore-fencing-token";

#[cfg(test)]
mod tests {
    use super::*;

    const FORM: &str = "--XyZ\r\nContent-Disposition: form-data; name=\"key\"\r\n\r\nuploads/cat.jpg\r\n\
        --XyZ\r\nContent-Disposition: form-data; name=\"X-Ignore-Fencing-Token\"\r\n\r\n42\r\n\
        --XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"cat.jpg\"\r\nContent-Type: image/jpeg\r\n\r\nJPEGDATA\r\n--XyZ--\r\n";

    #[test]
    fn fields_before_the_file_and_the_key() {
        assert_eq!(boundary("multipart/form-data; boundary=XyZ").as_deref(), Some("XyZ"));
        assert_eq!(boundary("multipart/form-data; boundary=\"a b\"").as_deref(), Some("a b"));
        assert_eq!(boundary("text/plain"), None);
        assert_eq!(boundary("multipart/form-data; boundary=a; boundary=b"), None);
        assert_eq!(boundary("multipart/form-data; boundary=\"a;b\""), None);
        assert_eq!(boundary("multipart/form-data; boundary=\"ab"), None);
        let Scan::Fields { fields, .. } = scan(FORM.as_bytes(), "XyZ").unwrap() else { panic!() };
        assert_eq!(object_key(&fields).as_deref(), Ok("uploads/cat.jpg"));
        assert_eq!(fields.iter().find(|(n, _)| n == TOKEN_FIELD).map(|(_, v)| v.as_str()), Some("42"));
    }

    #[test]
    fn a_part_after_the_file_part_is_seen_wherever_the_body_is_split() {
        let (head, rest) = FORM.split_at(FORM.find("JPEGDATA").unwrap());
        let Scan::Fields { content, .. } = scan(FORM.as_bytes(), "XyZ").unwrap() else { panic!() };
        assert_eq!(content, head.len());
        let late_key = "JPEGDATA\r\n--XyZ\r\nContent-Disposition: form-data; name=\"key\"\r\n\r\nvictim\r\n--XyZ--\r\n";
        let bare_lf = late_key.replacen("\r\n--XyZ\r\n", "\n--XyZ\r\n", 1);
        let bare_cr = late_key.replacen("\r\n--XyZ\r\n", "\r--XyZ\r\n", 1);
        let mid_line = "JPEG--XyZDATA\r\n--XyZ--\r\n";
        for (body, fine) in [
            (format!("{head}{rest}"), true),
            (format!("{head}{mid_line}"), true),
            (format!("{head}{late_key}"), false),
            (format!("{head}{bare_lf}"), false),
            (format!("{head}{bare_cr}"), false),
        ] {
            for cut in 0..body.len() {
                let mut w = AfterFile::new("XyZ", content);
                let r = w.feed(&body.as_bytes()[..cut]).and_then(|()| w.feed(&body.as_bytes()[cut..]));
                assert_eq!(r.is_ok(), fine, "cut at {cut}");
            }
        }
        // A field value that holds the boundary after a bare LF or CR: a
        // part werkzeug (so moto) sees and this scan would not.
        for brk in ["\n", "\r"] {
            let hidden = FORM.replacen(
                "--XyZ\r\nContent-Disposition: form-data; name=\"key\"",
                &format!("--XyZ\r\nContent-Disposition: form-data; name=\"x-amz-meta-a\"\r\n\r\nz{brk}--XyZ\r\nContent-Disposition: form-data; name=\"k2\"\r\n\r\nvictim\r\n--XyZ\r\nContent-Disposition: form-data; name=\"key\""),
                1,
            );
            assert!(hidden.contains("victim"), "{hidden}");
            assert!(scan(hidden.as_bytes(), "XyZ").is_err(), "{brk:?}");
        }
        // The fields before the file are skipped, whatever they hold.
        let mut w = AfterFile::new("XyZ", content);
        assert!(w.feed(FORM.as_bytes()).is_ok());
    }

    #[test]
    fn no_input_makes_it_panic() {
        for cut in 0..=FORM.len() {
            let _ = scan(&FORM.as_bytes()[..cut], "XyZ");
            let _ = scan(&FORM.as_bytes()[cut..], "XyZ");
        }
        for junk in [
            "--XyZ",
            "--XyZ\r\n\r\n\r\n",
            "--XyZ\r\nContent-Disposition: form-data\r\n\r\n",
            "--XyZ\r\nContent-Disposition: form-data; name=\"\r\n\r\n",
            "--XyZ\r\nContent-Disposition: form-data; =\r\n\r\n",
            "--XyZ\r\nContent-Disposition: ;;;\r\n\r\n",
            "--XyZ--",
            "\u{e9}--XyZ\r\n",
        ] {
            let _ = scan(junk.as_bytes(), "XyZ");
        }
        assert_eq!(boundary("multipart/form-data; boundary="), None);
        // Only the strict grammar (outside review, F2: what s3s's `mime`
        // refuses must not be a form here either).
        for bad in [
            "multipart/form-data ; boundary=B",
            "multipart/form-data; boundary = B",
            "multipart/form-data; boundary =B",
            "multipart/form-data; boundary= B",
            "multipart/form-data; boundary=B; x=\"a",
            "multipart/form-data; boundary=B; a=b c",
            "multipart/form-data; boundary=B; @=1",
            "multipart/form-data; boundary=B; x=a\"b",
            "multipart/form-data; boundary=B;x=(a)",
            "multipart/form-data; boundary=B; =x",
            "multipart/form-data; boundary=B; x=",
            "multipart/form-data; boundary=B;",
            "multipart/form-data; boundary=B ",
            "multipart/form-data;; boundary=B",
            " multipart/form-data; boundary=B",
            "multipart/form-data; boundary=B, text/xml",
            "multipart/form-data; boundary=\"a\\\"b\"",
            "multipart/form-data; boundary=\"\"",
            "multipart/mixed; boundary=B",
            "multipart/form-data;\tboundary=B",
        ] {
            assert_eq!(boundary(bad), None, "{bad}");
        }
        for (ok, want) in [
            ("multipart/form-data; boundary=B", "B"),
            ("Multipart/Form-Data;boundary=B", "B"),
            (
                "multipart/form-data; charset=utf-8; boundary=----WebKitFormBoundary7MA4YWxkTrZu0gW",
                "----WebKitFormBoundary7MA4YWxkTrZu0gW",
            ),
            ("multipart/form-data;  boundary=\"a b\"", "a b"),
        ] {
            assert_eq!(boundary(ok).as_deref(), Some(want), "{ok}");
        }
    }

    #[test]
    fn a_prefix_needs_more_and_a_form_without_file_is_refused() {
        let end = FORM.find("JPEG").unwrap();
        for cut in [0, 5, 30, 60, 100, end - 3] {
            assert_eq!(scan(&FORM.as_bytes()[..cut], "XyZ").unwrap(), Scan::NeedMore, "{cut}");
        }
        assert!(matches!(scan(&FORM.as_bytes()[..end], "XyZ").unwrap(), Scan::Fields { .. }));
        let no_file = "--b\r\nContent-Disposition: form-data; name=\"key\"\r\n\r\nk\r\n--b--\r\n";
        assert!(scan(no_file.as_bytes(), "b").is_err());
        assert!(object_key(&[]).is_err());
    }

    fn part(head: &str, value: &str) -> String {
        format!("--b\r\n{head}\r\n\r\n{value}\r\n")
    }

    const FILE: &str = "--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f\"\r\n\r\nDATA\r\n--b--\r\n";

    #[test]
    fn forms_another_parser_may_read_otherwise_are_refused() {
        let key = |k: &str| part("Content-Disposition: form-data; name=\"key\"", k);
        let refused = [
            // (a) two key fields (any case): which one counts differs.
            format!("{}{}{FILE}", key("mine"), key("victim")),
            format!("{}{}{FILE}", key("mine"), part("Content-Disposition: form-data; name=\"KEY\"", "victim")),
            // (b) a `;` inside a quoted filename is not a parameter.
            format!(
                "{}{}{FILE}",
                key("mine"),
                part("Content-Disposition: form-data; name=\"x\"; filename=\"a;name=file;\"", "v")
            ),
            // (c) two Content-Disposition headers in one part.
            format!(
                "{}{FILE}",
                part(
                    "Content-Disposition: form-data; name=\"key\"\r\nContent-Disposition: form-data; name=\"x\"",
                    "victim"
                )
            ),
            // (d) part headers ended by a bare LF.
            format!("{}--b\r\nContent-Disposition: form-data; name=\"key\"\n\nvictim\r\n{FILE}", key("mine")),
            format!("{}--b\r\nContent-Disposition: form-data; name=\"key\"\r\n\nvictim\r\n{FILE}", key("mine")),
            // Other ambiguities.
            format!("preamble\r\n{}{FILE}", key("mine")),
            format!("{}{FILE}", part("Content-Disposition: form-data; name=\"key\"; name=\"x\"", "k")),
            format!("{}{FILE}", part("Content-Disposition: form-data; name=\"k\\\"ey\"", "k")),
            format!("{}{FILE}", part("Content-Disposition: form-data; name*=UTF-8''key", "k")),
            format!("{}{FILE}", part("Content-Disposition: form-data; name=\"key\";", "k")),
            format!("{}{FILE}", part("Content-Disposition: attachment; name=\"key\"", "k")),
            format!("{}{FILE}", part("Content-Disposition: form-data; name=\"key\"\r\n folded", "k")),
            format!("{}{}", key("k"), FILE.replace("name=\"file\"", "name=\"File\"")),
            format!("{}{}", key("k"), FILE.replace("name=\"file\"", "name=\"file\"; name=\"key\"")),
        ];
        for form in refused {
            assert!(scan(form.as_bytes(), "b").is_err(), "{form:?}");
        }
        let fine = format!("{}{FILE}", key("mine"));
        let Scan::Fields { fields, .. } = scan(fine.as_bytes(), "b").unwrap() else { panic!() };
        assert_eq!(object_key(&fields).as_deref(), Ok("mine"));
        let unquoted = format!("{}{FILE}", part("content-disposition:form-data;name=key", "k2"));
        let Scan::Fields { fields, .. } = scan(unquoted.as_bytes(), "b").unwrap() else { panic!() };
        assert_eq!(object_key(&fields).as_deref(), Ok("k2"));
    }

    #[test]
    fn a_key_naming_the_filename_is_refused() {
        let form = format!("{}{FILE}", part("Content-Disposition: form-data; name=\"key\"", "up/${filename}"));
        let Scan::Fields { fields, .. } = scan(form.as_bytes(), "b").unwrap() else { panic!() };
        assert!(object_key(&fields).is_err());
    }
}
