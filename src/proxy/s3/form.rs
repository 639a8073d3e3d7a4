//! The fields of a browser `PostObject` upload (`multipart/form-data` to
//! `POST /bucket`), read up to the start of the file's content.
//!
//! S3 takes every field before the `file` part and ignores what follows
//! it; the object key is the `key` field with `${filename}` replaced by the
//! file part's filename. Field names are compared case-insensitively, as
//! S3 does. The scan reads only a bounded prefix of the body; the caller
//! forwards that prefix and the rest of the body unchanged.

/// What the scan of a body prefix found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scan {
    /// The file part has not begun yet: read more.
    NeedMore,
    /// Every field before the file part, and the file's name.
    Fields { fields: Vec<(String, String)>, filename: String },
}

/// The boundary of a `multipart/form-data` content type.
pub fn boundary(content_type: &str) -> Option<String> {
    let mut parts = content_type.split(';');
    if !parts.next()?.trim().eq_ignore_ascii_case("multipart/form-data") {
        return None;
    }
    parts
        .find_map(|p| {
            let (n, v) = p.trim().split_once('=')?;
            n.trim().eq_ignore_ascii_case("boundary").then(|| v.trim().trim_matches('"').to_string())
        })
        .filter(|b| !b.is_empty() && b.len() <= 70)
}

/// Scans `buf` (a prefix of the body) for the fields before the file part.
pub fn scan(buf: &[u8], boundary: &str) -> Result<Scan, String> {
    let delim = format!("--{boundary}");
    let Some(first) = find(buf, delim.as_bytes()) else {
        return Ok(Scan::NeedMore);
    };
    let mut at = first + delim.len();
    let mut fields = Vec::new();
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
        let Some(head_end) = find(rest, b"\r\n\r\n") else {
            return Ok(Scan::NeedMore);
        };
        let head = std::str::from_utf8(&rest[..head_end]).map_err(|_| "part headers are not UTF-8")?;
        let (name, filename) = disposition(head)?;
        if name.eq_ignore_ascii_case("file") {
            return Ok(Scan::Fields { fields, filename: filename.unwrap_or_default() });
        }
        let body_start = head_end + 4;
        let close = format!("\r\n{delim}");
        let Some(len) = find(&rest[body_start..], close.as_bytes()) else {
            return Ok(Scan::NeedMore);
        };
        let value = std::str::from_utf8(&rest[body_start..body_start + len]).map_err(|_| "a field is not UTF-8")?;
        fields.push((name.to_ascii_lowercase(), value.to_string()));
        at = buf.len() - rest.len() + body_start + len + close.len();
    }
}

/// The `name` and `filename` of a part's `Content-Disposition: form-data`.
fn disposition(head: &str) -> Result<(String, Option<String>), String> {
    let line = head
        .split("\r\n")
        .find_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.trim().eq_ignore_ascii_case("content-disposition").then_some(v)
        })
        .ok_or("a part without Content-Disposition")?;
    let mut name = None;
    let mut filename = None;
    for p in line.split(';').skip(1) {
        let Some((n, v)) = p.trim().split_once('=') else { continue };
        let v = v.trim();
        let v = v.strip_prefix('"').and_then(|v| v.strip_suffix('"')).unwrap_or(v).to_string();
        match n.trim().to_ascii_lowercase().as_str() {
            "name" => name = Some(v),
            "filename" => filename = Some(v),
            _ => {}
        }
    }
    Ok((name.ok_or("a part without a name")?, filename))
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The object key of a scanned form: the `key` field, `${filename}`
/// replaced.
pub fn object_key(fields: &[(String, String)], filename: &str) -> Option<String> {
    let key = fields.iter().find(|(n, _)| n == "key")?.1.replace("${filename}", filename);
    (!key.is_empty()).then_some(key)
}

/// The form field that may carry the token (S3 ignores `x-ignore-` fields,
/// so a signed policy need not list it).
pub const TOKEN_FIELD: &str = "x-ignore-fencing-token";

#[cfg(test)]
mod tests {
    use super::*;

    const FORM: &str = "--XyZ\r\nContent-Disposition: form-data; name=\"key\"\r\n\r\nuploads/${filename}\r\n\
        --XyZ\r\nContent-Disposition: form-data; name=\"X-Ignore-Fencing-Token\"\r\n\r\n42\r\n\
        --XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"cat.jpg\"\r\nContent-Type: image/jpeg\r\n\r\nJPEGDATA\r\n--XyZ--\r\n";

    #[test]
    fn fields_before_the_file_and_the_key() {
        assert_eq!(boundary("multipart/form-data; boundary=XyZ").as_deref(), Some("XyZ"));
        assert_eq!(boundary("multipart/form-data; boundary=\"a b\"").as_deref(), Some("a b"));
        assert_eq!(boundary("text/plain"), None);
        let Scan::Fields { fields, filename } = scan(FORM.as_bytes(), "XyZ").unwrap() else { panic!() };
        assert_eq!(filename, "cat.jpg");
        assert_eq!(object_key(&fields, &filename).as_deref(), Some("uploads/cat.jpg"));
        assert_eq!(fields.iter().find(|(n, _)| n == TOKEN_FIELD).map(|(_, v)| v.as_str()), Some("42"));
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
            "--XyZ--",
            "\u{e9}--XyZ\r\n",
        ] {
            let _ = scan(junk.as_bytes(), "XyZ");
        }
        assert_eq!(boundary("multipart/form-data; boundary="), None);
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
        assert_eq!(object_key(&[], "x"), None);
    }
}
