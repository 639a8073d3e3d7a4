//! Access lines formatted here rather than by `tracing_subscriber`: the
//! same bytes (its text format without colours, or its JSON format), at a
//! fraction of the cost, handed to the log writer's buffer.

use std::io::Write;
use std::sync::Arc;

use super::{LogWriter, Shared, ACCESS_TARGET};

/// One field of an access line.
#[derive(Clone, Copy)]
pub enum Field<'a> {
    /// A string, quoted (`name="value"`), as `tracing` records a `&str`.
    Str(&'a str),
    /// A value shown with `Display`, unquoted (`tracing`'s `%value`).
    Display(&'a dyn std::fmt::Display),
    /// A string shown unquoted (`%value` of a `&str`).
    Raw(&'a str),
    /// A socket address, unquoted (`%addr`), written without `fmt`.
    Addr(&'a std::net::SocketAddr),
    /// A number.
    U64(u64),
}

/// Where [`write_access`] puts lines, once [`install_access`] was called.
static ACCESS: std::sync::OnceLock<(Arc<Shared>, bool)> = std::sync::OnceLock::new();

/// From now on [`write_access`] formats access lines itself, in the text
/// format (`json == false`, without colours) or the JSON format of
/// `tracing_subscriber`'s formatter, and hands them to `writer`'s buffer.
/// Formatting through `tracing_subscriber` costs ~18,000 instructions a line
/// (its field visitor and `fmt` machinery), most of an access line's cost;
/// this costs a small fraction of it and writes the same bytes.
pub fn install_access(writer: &LogWriter, json: bool) {
    let _ = ACCESS.set((Arc::clone(&writer.shared), json));
}

/// Writes one access line (target [`ACCESS_TARGET`], level INFO) if
/// [`install_access`] was called; false otherwise, and the caller logs it
/// through `tracing`. The caller checks that the access log is enabled.
pub fn write_access(fields: &[(&str, Field<'_>)]) -> bool {
    let Some((shared, json)) = ACCESS.get() else {
        return false;
    };
    LINE.with(|line| {
        let mut line = line.borrow_mut();
        line.clear();
        if *json {
            json_line(&mut line, fields);
        } else {
            text_line(&mut line, fields);
        }
        shared.append(&line, false);
    });
    true
}

thread_local! {
    /// The line being formatted, reused.
    static LINE: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Decimal digits of `n`, without `fmt`.
fn push_u64(out: &mut Vec<u8>, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        // n % 10 < 10: the cast cannot truncate.
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[i..]);
}

/// `n` as exactly `width` digits (zero-padded; `n` fits).
fn push_padded(out: &mut Vec<u8>, n: u64, width: usize) {
    let mut digits = [b'0'; 20];
    let mut n = n;
    for d in digits[..width].iter_mut().rev() {
        *d = b'0' + (n % 10) as u8;
        n /= 10;
    }
    out.extend_from_slice(&digits[..width]);
}

fn push_addr(out: &mut Vec<u8>, addr: &std::net::SocketAddr) {
    match addr {
        std::net::SocketAddr::V4(v4) => {
            for (i, octet) in v4.ip().octets().iter().enumerate() {
                if i > 0 {
                    out.push(b'.');
                }
                push_u64(out, u64::from(*octet));
            }
            out.push(b':');
            push_u64(out, u64::from(v4.port()));
        }
        v6 => {
            let _ = write!(out, "{v6}");
        }
    }
}

thread_local! {
    /// The second of the last timestamp and its `YYYY-MM-DDTHH:MM:SS.`.
    static SECOND: std::cell::Cell<(u64, [u8; 20])> = const { std::cell::Cell::new((u64::MAX, [0; 20])) };
}

/// `2026-12-01T08:43:02.856124Z`, as `tracing_subscriber` writes it.
fn timestamp(out: &mut Vec<u8>) {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let secs = now.as_secs();
    let (cached, prefix) = SECOND.get();
    if cached == secs {
        out.extend_from_slice(&prefix);
        push_padded(out, u64::from(now.subsec_micros()), 6);
        out.push(b'Z');
        return;
    }
    let start = out.len();
    let (days, sod) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    let _ = write!(out, "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.", sod / 3_600, sod / 60 % 60, sod % 60);
    if let Ok(prefix) = <[u8; 20]>::try_from(&out[start..]) {
        SECOND.set((secs, prefix));
    }
    push_padded(out, u64::from(now.subsec_micros()), 6);
    out.push(b'Z');
}

/// A string as Rust's `Debug` writes it (what `tracing` does for a `&str`).
fn debug_str(out: &mut Vec<u8>, s: &str) {
    if s.bytes().all(|b| (0x20..0x7f).contains(&b) && b != b'"' && b != b'\\') {
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
    } else {
        let _ = write!(out, "{s:?}");
    }
}

fn text_line(out: &mut Vec<u8>, fields: &[(&str, Field<'_>)]) {
    timestamp(out);
    out.extend_from_slice(b"  INFO ");
    out.extend_from_slice(ACCESS_TARGET.as_bytes());
    out.push(b':');
    for (name, value) in fields {
        out.push(b' ');
        out.extend_from_slice(name.as_bytes());
        out.push(b'=');
        match value {
            Field::Str(s) => debug_str(out, s),
            Field::Display(d) => {
                let _ = write!(out, "{d}");
            }
            Field::Raw(s) => out.extend_from_slice(s.as_bytes()),
            Field::Addr(a) => push_addr(out, a),
            Field::U64(n) => push_u64(out, *n),
        }
    }
    out.push(b'\n');
}

fn json_line(out: &mut Vec<u8>, fields: &[(&str, Field<'_>)]) {
    out.extend_from_slice(b"{\"timestamp\":\"");
    timestamp(out);
    out.extend_from_slice(b"\",\"level\":\"INFO\",\"fields\":{");
    for (i, (name, value)) in fields.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        let _ = serde_json::to_writer(&mut *out, name);
        out.push(b':');
        let _ = match value {
            Field::Str(s) => serde_json::to_writer(&mut *out, s),
            Field::Display(d) => serde_json::to_writer(&mut *out, &d.to_string()),
            Field::Raw(s) => serde_json::to_writer(&mut *out, s),
            Field::Addr(a) => serde_json::to_writer(&mut *out, &a.to_string()),
            Field::U64(n) => serde_json::to_writer(&mut *out, n),
        };
    }
    out.extend_from_slice(b"},\"target\":\"");
    out.extend_from_slice(ACCESS_TARGET.as_bytes());
    out.extend_from_slice(b"\"}\n");
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::logbuf::start;
    use crate::logbuf::tests::{limits, Sink};

    /// The fast access line is byte for byte what `tracing_subscriber`
    /// writes for the same event (its timestamp aside), text and JSON.
    #[test]
    fn access_lines_are_formatted_as_tracing_formats_them() {
        let addr: std::net::SocketAddr = "127.0.0.1:4242".parse().unwrap();
        let method = http::Method::PUT;
        let odd = "/a b/\"quoted\"\\back\tslash/é\u{1}";
        for json in [false, true] {
            let sink = Sink::default();
            let (w, mut guard) = start(Box::new(sink.clone()), limits(1 << 20, 4 << 20, 60_000));
            let sub = tracing_subscriber::fmt().with_writer(w.clone()).with_ansi(false);
            let dispatch =
                if json { tracing::Dispatch::new(sub.json().finish()) } else { tracing::Dispatch::new(sub.finish()) };
            for path in ["/orders/1", odd] {
                tracing::dispatcher::with_default(&dispatch, || {
                    tracing::info!(
                        target: "fencegate::access",
                        listener = "proxy",
                        client = %addr,
                        method = %method,
                        path = path,
                        status = 200u16,
                        duration_us = 1234u64,
                        shown = %addr.port(),
                    );
                });
            }
            guard.close();
            let theirs = sink.text();
            let mut ours = Vec::new();
            for path in ["/orders/1", odd] {
                let fields = [
                    ("listener", Field::Str("proxy")),
                    ("client", Field::Addr(&addr)),
                    ("method", Field::Raw(method.as_str())),
                    ("path", Field::Str(path)),
                    ("status", Field::U64(200)),
                    ("duration_us", Field::U64(1234)),
                    ("shown", Field::Display(&addr.port())),
                ];
                if json {
                    json_line(&mut ours, &fields);
                } else {
                    text_line(&mut ours, &fields);
                }
            }
            let ours = String::from_utf8(ours).unwrap();
            // Timestamps: same shape, different instants.
            let strip = |t: &str| -> Vec<String> {
                t.lines()
                    .map(|l| {
                        let at = l.find("2026").or_else(|| l.find("20")).unwrap();
                        assert_eq!(&l[at + 26..at + 27], "Z", "{l}");
                        format!("{}{}", &l[..at], &l[at + 27..])
                    })
                    .collect()
            };
            assert_eq!(strip(&ours), strip(&theirs), "json = {json}\nours:   {ours}\ntheirs: {theirs}");
        }
    }
}
