//! The S3 route kind (docs/s3.md): which resources an S3 request touches,
//! and whether it mutates them, judged from the request head — or, for the
//! two operations that name their keys only in the body (`DeleteObjects`,
//! browser `PostObject`), from a bounded copy of the body.
//!
//! This module classifies; it never forwards, never admits and never
//! rewrites a byte. The request-target, `Host`, signed headers and body
//! are forwarded exactly as the client sent them (SigV4 signs them all).
//!
//! Resources: an object request's resource is `{bucket}/{key}` (or the
//! route's `resource` template over `{bucket}`, `{key}`, `{dir}`); a
//! bucket-level request's is `{bucket}` (or `bucket_resource`). The bucket
//! is the first label of `Host` under one of `base_domains`
//! (virtual-hosted style), else the first path segment (path style). The
//! key is the rest of the path, percent-decoded once, as S3 decodes it.

pub mod form;
mod serve;
pub mod tokens;
pub mod xml;

use std::borrow::Cow;

use http::{header, HeaderMap, HeaderValue, Method, Uri};

use crate::config::RouteConfig;
use crate::error::Error;
use crate::template::{Captures, Template};

/// The header naming a `CopyObject`/`UploadPartCopy` source (only read).
pub const COPY_SOURCE: &str = "x-amz-copy-source";
/// The header naming a `RenameObject` source (mutated: it disappears).
pub const RENAME_SOURCE: &str = "x-amz-rename-source";
/// The headers [`S3Kind::classify`] reads besides `Host` (and
/// `Transfer-Encoding`, which the fast path never takes): a caller that
/// classifies from a subset of a request's headers passes these.
pub const JUDGED_HEADERS: [header::HeaderName; 6] = [
    header::AUTHORIZATION,
    header::HeaderName::from_static(COPY_SOURCE),
    header::HeaderName::from_static("x-amz-target"),
    header::CONTENT_TYPE,
    header::CONTENT_LENGTH,
    header::HeaderName::from_static(RENAME_SOURCE),
];
/// Most keys one `DeleteObjects` request may name (S3's own limit).
pub const MAX_DELETE_KEYS: usize = 1000;

/// An S3 route's settings, parsed once.
#[derive(Debug, Clone)]
pub struct S3Kind {
    /// Lower-case, without a leading dot.
    base_domains: Vec<String>,
    /// Over `{bucket}`, `{key}`, `{dir}`; `None`: `{bucket}/{key}`.
    resource: Option<Template>,
    /// Over `{bucket}` (`{key}` and `{dir}` render empty).
    bucket_resource: Option<Template>,
    /// Most body bytes read before admission (DeleteObjects, PostObject).
    pub max_scanned_body_bytes: u64,
}

/// What an S3 request touches, judged from its head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum S3Plan {
    /// The keys are known from the head. `primary`: the resource logged
    /// and checked for a read; `mutated`: every resource the request
    /// changes (empty for a read; two for `RenameObject` unless a template
    /// folds them into one).
    Head { primary: String, mutated: Vec<String> },
    /// `DeleteObjects`: the keys are in the XML body.
    DeleteObjects { bucket: String },
    /// A browser `PostObject` form upload: the key is a form field.
    PostObject { bucket: String },
}

impl S3Plan {
    /// Whether the request changes state (a body-named plan always does).
    pub fn is_mutation(&self) -> bool {
        !matches!(self, S3Plan::Head { mutated, .. } if mutated.is_empty())
    }
}

/// The names an S3 resource template may use.
fn names_template() -> Result<Template, String> {
    Template::parse_match("/{bucket}/{dir}/{*key}")
}

/// Percent-decodes `raw` once (`+` stays `+`, as in an S3 path).
fn percent_decode(raw: &str) -> Result<String, String> {
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3).ok_or("truncated percent-escape")?;
            let d = |c: u8| (c as char).to_digit(16);
            let (Some(h), Some(l)) = (d(hex[0]), d(hex[1])) else {
                return Err("invalid percent-escape".into());
            };
            // Two hex digits: at most 255.
            out.push(u8::try_from(h * 16 + l).unwrap_or(0));
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| "not valid UTF-8 once decoded".to_string())
}

/// The path an S3 route's `match` is judged on: percent-decoded once, as
/// S3 decodes bucket and key, or `raw` when it does not decode.
pub fn match_path(raw: &str) -> std::borrow::Cow<'_, str> {
    if !raw.contains('%') {
        return std::borrow::Cow::Borrowed(raw);
    }
    percent_decode(raw).map_or(std::borrow::Cow::Borrowed(raw), std::borrow::Cow::Owned)
}

/// The S3 key rule of this gateway: a key with a `.` or `..` segment or an
/// empty segment other than a trailing one is refused, since
/// filesystem-backed S3 servers fold such keys into other keys (an alias
/// past the other key's fence); control characters are refused too.
pub(crate) fn check_key(key: &str) -> Result<(), String> {
    if key.chars().any(char::is_control) {
        return Err("the key contains control characters".into());
    }
    let segs: Vec<&str> = key.split('/').collect();
    let last = segs.len().saturating_sub(1);
    for (i, seg) in segs.iter().enumerate() {
        if seg.is_empty() && i != last {
            return Err("the key has an empty segment (\"//\" or a leading \"/\")".into());
        }
        if *seg == "." || *seg == ".." {
            return Err("the key has a \".\" or \"..\" segment".into());
        }
    }
    Ok(())
}

/// The subresource names of a raw query (`?uploads&partNumber=1` →
/// `uploads`, `partNumber`), percent-decoded.
fn subresources(query: Option<&str>) -> Vec<String> {
    let Some(q) = query else { return Vec::new() };
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let name = p.split_once('=').map_or(p, |(n, _)| n);
            percent_decode(name).unwrap_or_else(|_| name.to_string())
        })
        .collect()
}

/// Whether a request's body is a form (`multipart/…`), by its one
/// `Content-Type`; more than one `Content-Type` is refused.
fn is_form_post(headers: &HeaderMap) -> Result<bool, Error> {
    let mut all = headers.get_all(header::CONTENT_TYPE).iter();
    let (Some(ct), None) = (all.next(), all.next()) else {
        return if headers.contains_key(header::CONTENT_TYPE) {
            Err(Error::BadRequest("S3 request refused: more than one Content-Type".into()))
        } else {
            Ok(false)
        };
    };
    // Anything that mentions multipart is read as a form (and refused
    // unless it is a well-formed multipart/form-data one).
    Ok(String::from_utf8_lossy(ct.as_bytes()).to_ascii_lowercase().contains("multipart"))
}

/// Every request on an S3 route, read or not, must be an S3 request by
/// every reading a server behind it may make. Servers that host several
/// AWS services on one port (moto) pick the service from the
/// `Authorization` credential scope, from `X-Amz-Target`, from an unsigned
/// form-encoded body or from an unsigned `/<service>_<region>/` path, and
/// whatever the method: an outside review wrote S3 keys in a held bucket
/// through a `GET` signed for Logs (`CreateExportTask`) and Firehose, and
/// deleted an SQS queue through an `Authorization` whose scope was not
/// after `Credential=`. So, on every method:
/// - no access point or S3 Control host (moto swapped in the access
///   point's bucket even in path-style mode), and no first path segment
///   that servers route to another API ([`OTHER_APIS`]);
/// - at most one `Authorization`, and only in S3's forms: SigV4
///   (`AWS4-HMAC-SHA256` or SigV4a `AWS4-ECDSA-P256-SHA256`, then
///   `Credential=<scope>` with service `s3`, `SignedHeaders=…`,
///   `Signature=…`) or SigV2 (`AWS <key>:<signature>`); and the scope moto
///   reads (the second word before the first comma, if it splits into five
///   `/` parts) must name `s3` as well;
/// - a credential scope's region is one lower-case DNS label
///   ([`check_region`]);
/// - no presigned `X-Amz-Credential` for another service;
/// - no `Action` query parameter (S3 has none; moto runs it);
/// - no `X-Amz-Target` (S3 never sends one);
/// - no body on `GET`, `HEAD` or `OPTIONS`;
/// - unsigned (no `Authorization`): no `application/x-www-form-urlencoded`
///   body, no `.well-known/jwks.json` or `.well-known/openid-configuration`
///   key, and no `_` in a first path segment that a `/` follows (all read
///   on the decoded path, as servers route by it).
///
/// A body on a read sent without `Content-Length` (HTTP/2 DATA frames) is
/// refused where the request is served (`Proxy::handle_s3`).
fn s3_only(method: &Method, headers: &HeaderMap, uri: &Uri) -> Result<(), Error> {
    let bad = |m: &str| Error::BadRequest(format!("S3 request refused: {m}"));
    let contains = |hay: &[u8], needle: &[u8]| hay.windows(needle.len()).any(|w| w.eq_ignore_ascii_case(needle));
    let hosts = headers.get_all(header::HOST).iter().map(HeaderValue::as_bytes);
    for host in hosts.chain(uri.authority().map(|a| a.as_str().as_bytes())) {
        if contains(host, b"s3-accesspoint") || contains(host, b"s3-control") {
            return Err(bad("an access point or S3 Control host names a bucket this gateway cannot see"));
        }
    }
    // Only ASCII in the request-target: SDKs percent-encode every other
    // byte, and servers read raw ones in other charsets (moto reads the
    // request line as Latin-1: a raw UTF-8 key was fenced as one key and
    // written as another, an outside review overwrote a held key so).
    if !uri.path().is_ascii() || !uri.query().unwrap_or("").is_ascii() {
        return Err(bad("the request-target holds a raw non-ASCII byte (percent-encode it)"));
    }
    // The path as servers route by it: decoded (`%2F` too).
    let decoded = match uri.path() {
        p if p.contains('%') => Cow::Owned(percent_decode(p).map_err(|e| bad(&format!("path: {e}")))?),
        p => Cow::Borrowed(p),
    };
    let rest = decoded.trim_start_matches('/');
    let (first, after_first) = rest.split_once('/').map_or((rest, false), |(f, _)| (f, true));
    // `s` starts with `p`, whatever the case.
    let starts = |s: &str, p: &str| s.get(..p.len()).is_some_and(|f| f.eq_ignore_ascii_case(p));
    if OTHER_APIS.iter().any(|p| starts(first, p)) {
        return Err(bad(&format!("/{first}/ is another API than S3 on some servers")));
    }
    // moto answers these paths itself (instance metadata, its admin app),
    // before it looks at anything else: a write there was answered 200 and
    // never applied (outside review).
    if OTHER_PATHS.iter().any(|p| starts(rest, p)) || rest.eq_ignore_ascii_case("favicon.ico") {
        return Err(bad(&format!("/{rest} is another API than S3 on some servers")));
    }
    // moto runs a query-protocol action (`?Action=`) of whatever service
    // it picked, on any method; S3 has no such parameter.
    let query = uri.query().unwrap_or("");
    let action = |n: &str| {
        // Decoded only when it has an escape (no allocation otherwise).
        if n.contains('%') {
            percent_decode(n).is_ok_and(|n| n.eq_ignore_ascii_case("action"))
        } else {
            n.eq_ignore_ascii_case("action")
        }
    };
    if query.split('&').any(|p| p.split('=').next().is_some_and(action)) {
        return Err(bad("the query names an Action (another AWS service's; S3 has none)"));
    }
    if headers.contains_key("x-amz-target") {
        return Err(bad("X-Amz-Target names an action of another AWS service (S3 never sends it)"));
    }
    let mut auths = headers.get_all(header::AUTHORIZATION).iter();
    let signed = match (auths.next(), auths.next()) {
        (None, _) => false,
        (Some(v), None) => {
            let v = v.to_str().map_err(|_| bad("Authorization is not text"))?;
            check_authorization(v).map_err(|m| bad(&m))?;
            true
        }
        (Some(_), Some(_)) => return Err(bad("more than one Authorization")),
    };
    let presigned = query.split('&').filter_map(|p| {
        let (n, v) = p.split_once('=')?;
        n.eq_ignore_ascii_case("x-amz-credential").then(|| percent_decode(v).unwrap_or_default())
    });
    for scope in presigned {
        // `AK/20260101/us-east-1/s3/aws4_request`: the service is the
        // next-to-last part, the region the one before.
        let mut parts = scope.rsplit('/').skip(1);
        let service = parts.next().unwrap_or("");
        if service != "s3" {
            return Err(bad(&format!("presigned for the service {service:?}, not s3")));
        }
        check_region(parts.next().unwrap_or("")).map_err(|m| bad(&m))?;
    }
    if matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS) {
        let length = headers.get(header::CONTENT_LENGTH).map(|v| v.as_bytes());
        if headers.contains_key(header::TRANSFER_ENCODING) || length.is_some_and(|l| l != b"0") {
            return Err(bad(&format!(
                "a {method} request carries no body (servers read one as another service's action)"
            )));
        }
    }
    if !signed {
        let form = headers.get_all(header::CONTENT_TYPE).iter().any(|ct| {
            ct.as_bytes().trim_ascii_start().to_ascii_lowercase().starts_with(b"application/x-www-form-urlencoded")
        });
        if form {
            return Err(bad(
                "a request without Authorization may not carry an application/x-www-form-urlencoded body (servers \
                 read an AWS Query action from it): send it with another Content-Type (application/octet-stream)",
            ));
        }
        // moto sends `/.well-known/jwks.json` and
        // `/.well-known/openid-configuration` to Cognito, whatever the
        // method: a write there was answered 200 and never applied.
        let trimmed = decoded.trim_end_matches('/');
        if trimmed.ends_with("/.well-known/jwks.json") || trimmed.ends_with("/.well-known/openid-configuration") {
            return Err(bad("an unsigned request to a .well-known key is another service's on some servers"));
        }
        if first.contains('_') && after_first {
            return Err(bad(&format!(
                "an unsigned request's first path segment may not hold \"_\" (servers route /<service>_<region>/ \
                 to another service): {first:?}"
            )));
        }
    }
    Ok(())
}

/// Checks an `Authorization` value is one of S3's forms and signed for
/// `s3` by every reading (see [`s3_only`]); `Err`: why not.
fn check_authorization(v: &str) -> Result<(), String> {
    // The reading of servers that pick a service from the header (moto):
    // the second word before the first comma, when it splits into five
    // `/` parts, names the service in its fourth.
    let before_comma = v.split(',').next().unwrap_or("");
    if let Some(word) = before_comma.split_whitespace().nth(1).filter(|w| w.matches('/').count() == 4) {
        let mut parts = word.split('/').skip(2);
        let (region, service) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
        if !service.eq_ignore_ascii_case("s3") {
            return Err(format!("Authorization names the service {service:?}, not s3"));
        }
        check_region(region)?;
    }
    let (scheme, rest) = v.split_once(' ').ok_or("Authorization has no credentials")?;
    match scheme {
        "AWS" => {
            // SigV2: `AWS <access key>:<signature>`.
            let ok = rest.split_once(':').is_some_and(|(key, sig)| {
                !key.is_empty()
                    && !sig.is_empty()
                    && key.bytes().all(|c| c.is_ascii_graphic() && c != b':' && c != b',')
                    && sig.bytes().all(|c| c.is_ascii_graphic() && c != b',')
            });
            if ok {
                return Ok(());
            }
            Err("a SigV2 Authorization is `AWS <access key>:<signature>`".into())
        }
        "AWS4-HMAC-SHA256" | "AWS4-ECDSA-P256-SHA256" => {
            let form = "a SigV4 Authorization is `AWS4-HMAC-SHA256 Credential=<key>/<date>/<region>/s3/aws4_request, \
                        SignedHeaders=<names>, Signature=<hex>`";
            let mut fields = rest.split(',').map(|f| f.trim_start_matches(' '));
            let (Some(cred), Some(signed), Some(sig), None) =
                (fields.next(), fields.next(), fields.next(), fields.next())
            else {
                return Err(form.into());
            };
            let plain = |s: &str| !s.is_empty() && s.bytes().all(|c| c.is_ascii_graphic() && c != b',' && c != b'=');
            let scope = cred.strip_prefix("Credential=").filter(|s| plain(s)).ok_or(form)?;
            let ok = signed.strip_prefix("SignedHeaders=").is_some_and(plain)
                && sig.strip_prefix("Signature=").is_some_and(plain);
            if !ok {
                return Err(form.into());
            }
            // `<key>/<date>/<region>/s3/aws4_request` (SigV4a: no region).
            let parts: Vec<&str> = scope.split('/').collect();
            let n = if scheme == "AWS4-HMAC-SHA256" { 5 } else { 4 };
            if parts.len() != n || parts[n - 1] != "aws4_request" {
                return Err(form.into());
            }
            if parts[n - 2] != "s3" {
                return Err(format!("signed for the service {:?}, not s3", parts[n - 2]));
            }
            if n == 5 {
                check_region(parts[2])?;
            }
            Ok(())
        }
        _ => Err(format!("Authorization scheme {scheme:?} is not one of S3's (AWS4-HMAC-SHA256, AWS)")),
    }
}

/// A credential scope's region: one DNS label (AWS's `us-east-1`, and
/// the custom regions of S3-compatible stores: `auto`, `nyc3`, `garage`).
/// moto picks a backend by matching `s3.<region>.amazonaws.com` against
/// every service's host pattern: a region with a dot (`kinesis.us-east-1`,
/// `ddb.us-east-1`) or one naming a service's endpoint (`elasticmapreduce`)
/// reached Kinesis, DynamoDB, AppSync and EMR in an outside review.
fn check_region(region: &str) -> Result<(), String> {
    let label = !region.is_empty()
        && region.len() <= 63
        && region.bytes().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-');
    if !label || region == "elasticmapreduce" {
        return Err(format!(
            "the credential scope's region {region:?} is not one lower-case DNS label (some servers pick another \
             service by it)"
        ));
    }
    Ok(())
}

/// First path segments that S3-compatible servers route to other APIs:
/// moto's admin app (any segment that starts so: moto matches a prefix;
/// `POST /moto-api/reset` wiped every bucket through an S3 route in an
/// outside review) and the S3 Control API.
const OTHER_APIS: [&str; 2] = ["moto-api", "v20180820"];

/// Path prefixes (without the leading `/`) that moto serves from its
/// instance metadata service, whatever the method and signature.
const OTHER_PATHS: [&str; 2] = ["latest/api/", "latest/meta-data/"];

/// Object subresources whose POST reads and changes nothing.
const READ_ONLY_POSTS: [&str; 2] = ["select", "select-type"];

impl S3Kind {
    /// Parses and checks the S3 settings of a route.
    pub fn from_config(rc: &RouteConfig) -> Result<S3Kind, String> {
        let names = names_template()?;
        let resource =
            rc.resource.as_deref().map(|r| Template::parse_resource(r, &names)).transpose().map_err(|e| {
                format!("resource: {e} (an s3 route's resource template may use {{bucket}}, {{key}} and {{dir}})")
            })?;
        let bucket_resource = rc
            .bucket_resource
            .as_deref()
            .map(|r| {
                let t = Template::parse_resource(r, &names)?;
                if t.render(&Captures::new()).len() == r.len() {
                    return Err("must name {bucket}".to_string());
                }
                Ok(t)
            })
            .transpose()
            .map_err(|e| format!("bucket_resource: {e}"))?;
        let mut base_domains = Vec::new();
        for d in &rc.base_domains {
            let d = d.trim_start_matches('.').to_ascii_lowercase();
            if d.is_empty() || d.contains(['/', ':', ' ']) {
                return Err(format!("base_domains: {d:?} is not a domain name"));
            }
            base_domains.push(d);
        }
        if rc.forward_fencing_token.eq(&false) {
            return Err("forward_fencing_token: an s3 route forwards X-Fencing-Token (it may be signed)".into());
        }
        if rc.host_header == crate::config::HostHeader::Rewrite {
            return Err("host_header: an s3 route preserves Host (SigV4 signs it)".into());
        }
        if let Ok(crate::proxy::upstream::UpstreamUrl::Http { prefix, .. }) =
            crate::proxy::upstream::UpstreamUrl::parse(&rc.upstream)
        {
            if !prefix.is_empty() {
                return Err("upstream: an s3 route's upstream has no path prefix (SigV4 signs the path)".into());
            }
        }
        if rc.upstream.starts_with("file://") {
            return Err("upstream: an s3 route needs an http:// or https:// S3-compatible server".into());
        }
        if rc.max_scanned_body_bytes == 0 {
            return Err("max_scanned_body_bytes: must be at least 1".into());
        }
        Ok(S3Kind { base_domains, resource, bucket_resource, max_scanned_body_bytes: rc.max_scanned_body_bytes })
    }

    /// The resource of object `key` in `bucket`.
    pub fn object_resource(&self, bucket: &str, key: &str) -> String {
        match &self.resource {
            None => format!("{bucket}/{key}"),
            Some(t) => {
                let dir = key.rsplit_once('/').map_or("", |(d, _)| d);
                let caps: Captures = [("bucket", bucket), ("key", key), ("dir", dir)]
                    .into_iter()
                    .map(|(n, v)| (n.to_string(), v.to_string()))
                    .collect();
                t.render(&caps)
            }
        }
    }

    /// The resource of a bucket-level request.
    pub fn bucket_resource(&self, bucket: &str) -> String {
        match &self.bucket_resource {
            None => bucket.to_string(),
            Some(t) => {
                let caps: Captures = [("bucket".to_string(), bucket.to_string())].into_iter().collect();
                t.render(&caps)
            }
        }
    }

    /// The bucket named by a virtual-hosted `Host`, if any.
    fn host_bucket(&self, headers: &HeaderMap, uri: &Uri) -> Option<String> {
        if self.base_domains.is_empty() {
            return None;
        }
        let host = match headers.get(header::HOST).and_then(|h| h.to_str().ok()) {
            Some(h) => h.to_string(),
            None => uri.authority()?.as_str().to_string(),
        };
        // Without the port (an IPv6 literal has no base domain anyway).
        let host = host.rsplit_once(':').map_or(host.as_str(), |(h, p)| {
            if p.bytes().all(|b| b.is_ascii_digit()) {
                h
            } else {
                host.as_str()
            }
        });
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        self.base_domains.iter().find_map(|d| {
            let bucket = host.strip_suffix(d.as_str())?.strip_suffix('.')?;
            (!bucket.is_empty()).then(|| bucket.to_string())
        })
    }

    /// On a route with `base_domains`, the `Host` of a mutation must be
    /// one whose bucket is beyond doubt: an IP literal, exactly a base
    /// domain (path style), or exactly `bucket.base` in lower case. S3
    /// servers take any other domain name for a bucket of its own (CNAME
    /// style) and match base domains case-sensitively, so `Host: victim`
    /// or `Host: b.S3.TEST` would write another bucket than the one fenced.
    fn check_host(&self, headers: &HeaderMap, uri: &Uri) -> Result<(), Error> {
        if self.base_domains.is_empty() {
            return Ok(());
        }
        let bad = |m: String| Error::BadRequest(format!("S3 request refused: {m}"));
        let mut hosts = headers.get_all(header::HOST).iter();
        let host = match (hosts.next(), hosts.next()) {
            (Some(h), None) => h.to_str().map_err(|_| bad("Host is not text".into()))?.to_string(),
            (None, _) => uri.authority().map(|a| a.as_str().to_string()).ok_or_else(|| bad("no Host".into()))?,
            (Some(_), Some(_)) => return Err(bad("more than one Host".into())),
        };
        let name = if let Some(v6) = host.strip_prefix('[') {
            let (addr, port) = v6.split_once(']').ok_or_else(|| bad(format!("Host {host:?} is malformed")))?;
            let port_ok = port.is_empty()
                || port.strip_prefix(':').is_some_and(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()));
            if addr.parse::<std::net::Ipv6Addr>().is_ok() && port_ok {
                return Ok(());
            }
            return Err(bad(format!("Host {host:?} is malformed")));
        } else {
            match host.split_once(':') {
                Some((h, p)) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => h,
                Some(_) => return Err(bad(format!("Host {host:?} is malformed"))),
                None => host.as_str(),
            }
        };
        if name.parse::<std::net::Ipv4Addr>().is_ok() {
            return Ok(());
        }
        let exact = self.base_domains.iter().any(|d| {
            name == d
                || name.strip_suffix(d.as_str()).and_then(|b| b.strip_suffix('.')).is_some_and(|b| {
                    // One DNS label: servers disagree on where a dotted
                    // bucket ends (moto takes the first label), and moto
                    // reads a host that starts with `localhost` or
                    // `localstack` as path style (outside review: `Host:
                    // localhost.x.s3.test` was fenced as bucket
                    // `localhost.x` while moto wrote the path's bucket).
                    !b.is_empty()
                        && b.bytes().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
                        && !b.starts_with("localhost")
                        && !b.starts_with("localstack")
                })
        });
        if exact {
            return Ok(());
        }
        Err(bad(format!(
            "Host {name:?} is neither an IP address, a base domain, nor a lower-case bucket.base-domain (an S3 \
             server would take it for another bucket)"
        )))
    }

    /// The bucket and decoded key of a request (`None`: no bucket, a
    /// service-level request such as `ListBuckets`; key `""`: bucket-level).
    pub fn locate(&self, uri: &Uri, headers: &HeaderMap) -> Result<Option<(String, String)>, Error> {
        let bad = |m: String| Error::BadRequest(format!("S3 request refused: {m}"));
        let raw = uri.path();
        let rest = raw.strip_prefix('/').ok_or_else(|| bad("the path must start with \"/\"".into()))?;
        let (bucket, raw_key) = match self.host_bucket(headers, uri) {
            Some(b) => (b, rest),
            None => {
                let (b, k) = rest.split_once('/').unwrap_or((rest, ""));
                // S3's bucket characters never need an escape, and servers
                // disagree on decoding one: moto took `/enc%62` for a bucket
                // named `enc%62` while it was fenced as `encb` (outside
                // review).
                if b.contains('%') {
                    return Err(bad(format!("a bucket name is never percent-encoded: {b:?}")));
                }
                (b.to_string(), k)
            }
        };
        if bucket.is_empty() {
            return Ok(None);
        }
        // S3's bucket characters (with the upper case and `_` of legacy
        // names), nothing else: servers cut a path segment at `;` or read
        // `%3F` decoded (moto took `/mbkt;x` for bucket `mbkt`, an outside
        // review deleted its keys under a lock on `mbkt;x/…`).
        let bucket_char = |c: u8| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'-' | b'_');
        if bucket.len() > 255 || !bucket.bytes().all(bucket_char) || bucket == "." || bucket == ".." {
            return Err(bad(format!("{bucket:?} is not a bucket name")));
        }
        let key = percent_decode(raw_key).map_err(|e| bad(format!("key: {e}")))?;
        if !key.is_empty() {
            check_key(&key).map_err(bad)?;
        }
        Ok(Some((bucket, key)))
    }

    /// Classifies a request head: the S3 operation's resources and whether
    /// it mutates them, by method, subresource and headers. Every method
    /// but `GET`, `HEAD` and `OPTIONS` mutates, except `POST ?select`
    /// (SelectObjectContent) which only reads; an unknown subresource on
    /// `PUT`, `POST` or `DELETE` is a mutation. Any request, a read too,
    /// that some server would take for another service's is refused
    /// ([`s3_only`]).
    pub fn classify(&self, method: &Method, uri: &Uri, headers: &HeaderMap) -> Result<S3Plan, Error> {
        let read = matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS);
        let subs = subresources(uri.query());
        s3_only(method, headers, uri)?;
        if !read {
            self.check_host(headers, uri)?;
        }
        if *method == Method::POST && is_form_post(headers)? {
            // Servers disagree on a form POST with a query: s3s takes it
            // for PostObject whatever the query, moto reads `?delete` first
            // (a DeleteObjects of the keys in the file part: an outside
            // review deleted a key fenced by another holder that way). So
            // a form POST with any query is refused, as is one that names
            // a key; a browser's PostObject has neither.
            if uri.query().is_some() {
                return Err(Error::BadRequest(
                    "S3 request refused: a multipart/form-data POST (PostObject) carries no query: servers read \
                     one with `?delete` or another subresource as a different operation"
                        .into(),
                ));
            }
            return match self.locate(uri, headers)? {
                Some((bucket, key)) if key.is_empty() => Ok(S3Plan::PostObject { bucket }),
                _ => Err(Error::BadRequest(
                    "S3 request refused: a multipart/form-data POST goes to a bucket (PostObject), never to a key"
                        .into(),
                )),
            };
        }
        let Some((bucket, key)) = self.locate(uri, headers)? else {
            if read {
                return Ok(S3Plan::Head { primary: String::new(), mutated: Vec::new() });
            }
            return Err(Error::BadRequest(
                "S3 request refused: a request that changes state must name a bucket".into(),
            ));
        };
        if key.is_empty() {
            let resource = self.bucket_resource(&bucket);
            if read {
                return Ok(S3Plan::Head { primary: resource, mutated: Vec::new() });
            }
            if *method == Method::POST && subs.iter().any(|s| s == "delete") {
                return Ok(S3Plan::DeleteObjects { bucket });
            }
            if *method == Method::POST && subs.is_empty() {
                return Ok(S3Plan::PostObject { bucket });
            }
            return Ok(S3Plan::Head { primary: resource.clone(), mutated: vec![resource] });
        }
        let resource = self.object_resource(&bucket, &key);
        if read || (*method == Method::POST && !subs.is_empty() && subs.iter().all(|s| READ_ONLY_POSTS.contains(&&**s)))
        {
            return Ok(S3Plan::Head { primary: resource, mutated: Vec::new() });
        }
        // A key ending in `/`: filesystem servers (s3s-fs) write a copy or
        // a multipart upload to it into the key without the `/`, a
        // resource this request is not fenced on (an outside review
        // overwrote a held key so). Only a plain PutObject and a
        // DeleteObject, which they keep to the directory, may name one.
        if key.ends_with('/') {
            let plain = subs.is_empty()
                && (*method == Method::DELETE || (*method == Method::PUT && !headers.contains_key(COPY_SOURCE)));
            if !plain {
                return Err(Error::BadRequest(
                    "S3 request refused: a key ending in \"/\" takes only a plain PutObject or DeleteObject \
                     (filesystem servers write a copy or an upload to it into the key without the \"/\")"
                        .into(),
                ));
            }
        }
        let mut mutated = vec![resource.clone()];
        if *method == Method::PUT && subs.iter().any(|s| s == "renameObject") {
            // The source key disappears: it is mutated too.
            let Some(src) = headers.get(RENAME_SOURCE) else {
                return Err(Error::BadRequest("S3 request refused: RenameObject without x-amz-rename-source".into()));
            };
            let src = src.to_str().map_err(|_| Error::BadRequest("x-amz-rename-source is not text".into()))?;
            let (src_bucket, src_key) = self.source(src, &bucket)?;
            let src_res = self.object_resource(&src_bucket, &src_key);
            if !mutated.contains(&src_res) {
                mutated.push(src_res);
            }
        }
        Ok(S3Plan::Head { primary: resource, mutated })
    }

    /// A `x-amz-rename-source` value: `[/]bucket/key` (URL-encoded, an
    /// optional `?versionId=` dropped) or a bare key in `bucket`.
    fn source(&self, value: &str, bucket: &str) -> Result<(String, String), Error> {
        let bad = |m: &str| Error::BadRequest(format!("x-amz-rename-source refused: {m}"));
        let value = value.split_once('?').map_or(value, |(v, _)| v);
        let decoded = percent_decode(value).map_err(|e| bad(&e))?;
        let path = decoded.strip_prefix('/').unwrap_or(&decoded);
        let (b, k) = match path.split_once('/') {
            Some((b, k)) if b == bucket => (b.to_string(), k.to_string()),
            _ => (bucket.to_string(), path.to_string()),
        };
        if k.is_empty() {
            return Err(bad("no key"));
        }
        check_key(&k).map_err(|e| bad(&e))?;
        Ok((b, k))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(extra: &str) -> S3Kind {
        let text = format!("kind = \"s3\"\nupstream = \"http://127.0.0.1:9\"\n{extra}");
        let rc: RouteConfig = toml::from_str(&text).unwrap();
        S3Kind::from_config(&rc).unwrap()
    }

    fn plan(k: &S3Kind, method: &str, target: &str, headers: &[(&str, &str)]) -> Result<S3Plan, Error> {
        let mut h = HeaderMap::new();
        for (n, v) in headers {
            h.append(http::HeaderName::from_bytes(n.as_bytes()).unwrap(), v.parse().unwrap());
        }
        k.classify(&Method::from_bytes(method.as_bytes()).unwrap(), &target.parse().unwrap(), &h)
    }

    fn head(primary: &str, mutated: &[&str]) -> S3Plan {
        S3Plan::Head { primary: primary.into(), mutated: mutated.iter().map(|s| s.to_string()).collect() }
    }

    #[test]
    fn object_writes_mutate_their_key_and_reads_do_not() {
        let k = kind("");
        assert_eq!(plan(&k, "PUT", "/b/a/c.txt", &[]).unwrap(), head("b/a/c.txt", &["b/a/c.txt"]));
        assert_eq!(plan(&k, "GET", "/b/a/c.txt", &[]).unwrap(), head("b/a/c.txt", &[]));
        assert_eq!(plan(&k, "HEAD", "/b/x", &[]).unwrap(), head("b/x", &[]));
        for target in [
            "/b/k?uploads",
            "/b/k?uploadId=1",
            "/b/k?partNumber=1&uploadId=1",
            "/b/k?tagging",
            "/b/k?acl",
            "/b/k?retention",
            "/b/k?legal-hold",
            "/b/k?restore",
            "/b/k?whatever-new",
        ] {
            for m in ["PUT", "POST", "DELETE"] {
                assert_eq!(plan(&k, m, target, &[]).unwrap(), head("b/k", &["b/k"]), "{m} {target}");
            }
        }
        assert_eq!(plan(&k, "POST", "/b/k?select&select-type=2", &[]).unwrap(), head("b/k", &[]));
        assert_eq!(plan(&k, "put", "/b/k", &[]).unwrap(), head("b/k", &["b/k"]), "unknown methods mutate");
    }

    #[test]
    fn copy_mutates_the_destination_only_and_rename_both_keys() {
        let k = kind("");
        let copy = plan(&k, "PUT", "/b/dst", &[("x-amz-copy-source", "/b/src")]).unwrap();
        assert_eq!(copy, head("b/dst", &["b/dst"]));
        let part = plan(&k, "PUT", "/b/dst?partNumber=2&uploadId=u", &[("x-amz-copy-source", "b/src")]).unwrap();
        assert_eq!(part, head("b/dst", &["b/dst"]));
        let rename = plan(&k, "PUT", "/b/dst?renameObject", &[("x-amz-rename-source", "/b/s%20rc")]).unwrap();
        assert_eq!(rename, head("b/dst", &["b/dst", "b/s rc"]));
        assert!(plan(&k, "PUT", "/b/dst?renameObject", &[]).is_err());
    }

    #[test]
    fn bucket_requests_use_the_bucket_resource() {
        let k = kind("");
        assert_eq!(plan(&k, "PUT", "/b", &[]).unwrap(), head("b", &["b"]));
        assert_eq!(plan(&k, "PUT", "/b/", &[]).unwrap(), head("b", &["b"]));
        assert_eq!(plan(&k, "DELETE", "/b", &[]).unwrap(), head("b", &["b"]));
        assert_eq!(plan(&k, "PUT", "/b?versioning", &[]).unwrap(), head("b", &["b"]));
        assert_eq!(plan(&k, "GET", "/b?list-type=2", &[]).unwrap(), head("b", &[]));
        assert_eq!(plan(&k, "POST", "/b?delete", &[]).unwrap(), S3Plan::DeleteObjects { bucket: "b".into() });
        assert_eq!(plan(&k, "POST", "/b", &[]).unwrap(), S3Plan::PostObject { bucket: "b".into() });
        assert_eq!(plan(&k, "GET", "/", &[]).unwrap(), head("", &[]));
        assert!(plan(&k, "PUT", "/", &[]).is_err(), "a mutation names a bucket");
        let k = kind("bucket_resource = \"buckets/{bucket}\"");
        assert_eq!(plan(&k, "PUT", "/b", &[]).unwrap(), head("buckets/b", &["buckets/b"]));
    }

    #[test]
    fn odd_requests_are_refused_or_classified_never_a_panic() {
        let k = kind("base_domains = [\"s3.test\"]");
        let targets =
            ["/", "//", "/%", "/%e", "/%C3", "/b/%C3%28", "/b?%zz", "/b?=", "/b?&&", "/b/k?renameObject", "/%2F/k"];
        let hosts = ["[::1]:80", ":80", ".", "s3.test", ".s3.test", "b.s3.test.", "e.s3.test:x", ""];
        for t in targets {
            for h in hosts {
                for m in ["GET", "PUT", "POST", "DELETE", "MOVE"] {
                    let headers = [("host", h), ("x-amz-rename-source", "%zz")];
                    let _ = plan(&k, m, t, &headers);
                }
            }
        }
    }

    #[test]
    fn requests_for_other_apis_than_s3_are_refused() {
        let k = kind("");
        let v4 = |service: &str| {
            format!("AWS4-HMAC-SHA256 Credential=AK/20260101/us-east-1/{service}/aws4_request, SignedHeaders=host, Signature=0")
        };
        let s3 = v4("s3");
        for ok in [
            s3.as_str(),
            "AWS4-HMAC-SHA256 Credential=AK/20260101/us-east-1/s3/aws4_request,SignedHeaders=host;x-amz-date,Signature=ab",
            "AWS4-ECDSA-P256-SHA256 Credential=AK/20260101/s3/aws4_request, SignedHeaders=host, Signature=3045",
            "AWS AK:c2lnbmF0dXJl",
            "AWS AK:a/b+c=",
        ] {
            for method in ["PUT", "GET", "HEAD", "DELETE"] {
                assert!(plan(&k, method, "/bkt/k", &[("authorization", ok)]).is_ok(), "{method} {ok}");
            }
        }
        let sqs = v4("sqs");
        let region = |r: &str| {
            format!("AWS4-HMAC-SHA256 Credential=AK/20260101/{r}/s3/aws4_request, SignedHeaders=host, Signature=0")
        };
        let (kinesis, emr) = (region("kinesis.us-east-1"), region("elasticmapreduce"));
        for ok in ["auto", "nyc3", "garage", "eu-west-2"] {
            assert!(plan(&k, "PUT", "/bkt/k", &[("authorization", &region(ok))]).is_ok(), "{ok}");
        }
        assert!(plan(&k, "PUT", "/latest/other", &[("authorization", &s3)]).is_ok());
        // Signed, the same keys are S3's.
        assert!(plan(&k, "PUT", "/bkt/.well-known/jwks.json", &[("authorization", &s3)]).is_ok());
        let logs_get = [("authorization", v4("logs")), ("x-amz-target", "Logs_20140328.CreateExportTask".into())];
        let logs_get: Vec<(&str, &str)> = logs_get.iter().map(|(n, v)| (*n, v.as_str())).collect();
        for (target, headers) in [
            ("/moto-api/reset", vec![]),
            ("/moto-apix/reset", vec![]),
            ("/MOTO-API/reset", vec![]),
            ("/moto%2Dapi/reset", vec![]),
            ("/v20180820/accesspoint/ap", vec![]),
            ("/bkt/k", vec![("host", "ap-123456789012.s3-accesspoint.us-east-1.amazonaws.com")]),
            ("/bkt/k", vec![("host", "123456789012.S3-Control.us-east-1.amazonaws.com")]),
            ("/bkt/k", vec![("authorization", sqs.as_str())]),
            ("/bkt/k?X-Amz-Credential=AK%2F20260101%2Fus-east-1%2Fiam%2Faws4_request", vec![]),
            // A read with another service's action (outside review: a GET
            // signed for Logs wrote `aws-logs-write-test` in a held bucket).
            ("/", logs_get.clone()),
            ("/bkt/k", vec![("x-amz-target", "AWSCognitoIdentityService.DeleteIdentityPool")]),
            // The scope is not after `Credential=`: moto reads the second
            // word (outside review: an SQS queue deleted).
            ("/bkt/k", vec![("authorization", "AWS4-HMAC-SHA256 AK/20260101/us-east-1/sqs/aws4_request, SignedHeaders=host, Signature=0")]),
            ("/bkt/k", vec![("authorization", "AWS4-HMAC-SHA256 AK/20260101/us-east-1/sqs/aws4_request Credential=AK/20260101/us-east-1/s3/aws4_request, SignedHeaders=host, Signature=0")]),
            ("/bkt/k", vec![("authorization", "AWS AK/20260101/us-east-1/sqs/aws4_request:sig")]),
            ("/bkt/k", vec![("authorization", "AWS AK:ab/20260101/us-east-1/sqs/x")]),
            // Other forms of the header.
            ("/bkt/k", vec![("authorization", "AWS4-HMAC-SHA256 Credential=AK/20260101/us-east-1/s3/aws4_request")]),
            ("/bkt/k", vec![("authorization", "AWS4-HMAC-SHA256 Credential=AK/x/20260101/us-east-1/s3/aws4_request, SignedHeaders=host, Signature=0")]),
            ("/bkt/k", vec![("authorization", "AWS4-HMAC-SHA256 Credential=AK/20260101/us-east-1/s3/aws4_request, SignedHeaders=host, Signature=0, X=1")]),
            ("/bkt/k", vec![("authorization", "aws4-hmac-sha256 Credential=AK/20260101/us-east-1/s3/aws4_request, SignedHeaders=host, Signature=0")]),
            ("/bkt/k", vec![("authorization", "Bearer abc")]),
            ("/bkt/k", vec![("authorization", "AWS AK")]),
            ("/bkt/k", vec![("authorization", "")]),
            ("/bkt/k", vec![("authorization", s3.as_str()), ("authorization", s3.as_str())]),
            // Unsigned: a form-encoded body is an AWS Query action, and
            // `/<service>_<region>/` a service.
            ("/bkt/k", vec![("content-type", "application/x-www-form-urlencoded")]),
            ("/sqs_us-east-1/", vec![]),
            ("/sqs_us-east-1/k", vec![]),
            ("/bkt_x/", vec![]),
            // moto routes by the decoded path (outside review).
            ("/glacier_us-east-1%2Fvaults%2Fv", vec![]),
            // A region moto matches against another service's host.
            ("/bkt/k", vec![("authorization", kinesis.as_str())]),
            ("/bkt/k", vec![("authorization", emr.as_str())]),
            ("/bkt/k", vec![("authorization", "AWS AK:ab/20260101/kinesis.us-east-1/s3/x")]),
            ("/bkt/k?X-Amz-Credential=AK%2F20260101%2Fddb.us-east-1%2Fs3%2Faws4_request", vec![]),
            // A query-protocol action, on any service moto picked.
            ("/bkt/k?Action=DeleteStream", vec![("authorization", s3.as_str())]),
            ("/bkt/k?x=1&action", vec![("authorization", s3.as_str())]),
            // Cognito's paths to moto, unsigned (a write answered 200 and
            // never applied).
            ("/bkt/.well-known/jwks.json", vec![]),
            ("/bkt/a/.well-known/openid-configuration/", vec![]),
            ("/bkt/%2Ewell-known/jwks.json", vec![]),
            // Raw UTF-8 in the target: moto reads it as Latin-1.
            ("/bkt/\u{861}", vec![("authorization", s3.as_str())]),
            ("/bkt/k?tagging&\u{e9}", vec![("authorization", s3.as_str())]),
            // moto's instance metadata and admin app, signed or not.
            ("/latest/api/token", vec![("authorization", s3.as_str())]),
            ("/latest/meta-data/ami-id", vec![("authorization", s3.as_str())]),
            ("/Latest/Meta-Data/iam", vec![]),
            ("/latest%2Fapi%2Ftoken", vec![]),
            ("/favicon.ico", vec![("authorization", s3.as_str())]),
            ("/bkt/k?%41ction=DeleteStream", vec![("authorization", s3.as_str())]),
        ] {
            for method in ["PUT", "DELETE", "GET", "HEAD", "OPTIONS"] {
                assert!(plan(&k, method, target, &headers).is_err(), "{method} {target} {headers:?}");
            }
        }
        // A body on a read: refused, whatever it says.
        for method in ["GET", "HEAD", "OPTIONS"] {
            assert!(plan(&k, method, "/bkt/k", &[("content-length", "0")]).is_ok(), "{method}");
            assert!(plan(&k, method, "/bkt/k", &[("content-length", "2")]).is_err(), "{method}");
            assert!(plan(&k, method, "/bkt/k", &[("transfer-encoding", "chunked")]).is_err(), "{method}");
        }
        assert!(plan(&k, "PUT", "/bkt/k", &[("content-length", "2")]).is_ok());
        // moto routes `/<service>_<region>/…` only with a `/` after it.
        assert!(plan(&k, "GET", "/bkt_x", &[]).is_ok());
        // Signed for s3, a form-encoded body and a `_` are S3's own.
        for (target, ct) in [("/bkt/k", "application/x-www-form-urlencoded"), ("/sqs_us-east-1/k", "text/plain")] {
            assert!(plan(&k, "PUT", target, &[("authorization", &s3), ("content-type", ct)]).is_ok(), "{target}");
        }
    }

    #[test]
    fn a_key_ending_in_a_slash_takes_only_a_plain_put_or_delete() {
        let k = kind("");
        assert_eq!(plan(&k, "PUT", "/bkt/V/", &[]).unwrap(), head("bkt/V/", &["bkt/V/"]));
        assert_eq!(plan(&k, "DELETE", "/bkt/V/", &[]).unwrap(), head("bkt/V/", &["bkt/V/"]));
        assert!(plan(&k, "GET", "/bkt/V/", &[]).is_ok());
        // s3s-fs wrote these into `bkt/V` (outside review).
        for (method, target, headers) in [
            ("PUT", "/bkt/V/", vec![(COPY_SOURCE, "/bkt/src")]),
            ("PUT", "/bkt/V/?partNumber=1&uploadId=u", vec![]),
            ("PUT", "/bkt/V/?partNumber=1&uploadId=u", vec![(COPY_SOURCE, "/bkt/src")]),
            ("POST", "/bkt/V/?uploads", vec![]),
            ("POST", "/bkt/V/?uploadId=u", vec![]),
            ("PUT", "/bkt/V/?tagging", vec![]),
        ] {
            assert!(plan(&k, method, target, &headers).is_err(), "{method} {target} {headers:?}");
        }
    }

    #[test]
    fn bucket_names_hold_to_s3_s_characters() {
        let k = kind("");
        let s3 = [("authorization", "AWS AK:c2ln")];
        for ok in ["/bkt/k", "/B_legacy.x-1/k", "/bkt/%6B"] {
            assert!(plan(&k, "PUT", ok, &s3).is_ok(), "{ok}");
        }
        // moto does not decode the bucket segment (outside review).
        for method in ["PUT", "GET", "DELETE"] {
            for bad in ["/bk%74/k", "/enc%62", "/%62kt/"] {
                assert!(plan(&k, method, bad, &s3).is_err(), "{method} {bad}");
            }
        }
        // moto cuts `;…` off a segment and reads `%3F` decoded (review).
        for bad in ["/bkt;x/k", "/bkt%3Bx/k", "/bkt;x?delete", "/b%3Fdelete%26/k", "/b%20c/k", "/b&c/k", "/b=c/k"] {
            assert!(plan(&k, "PUT", bad, &[]).is_err(), "{bad}");
            assert!(plan(&k, "POST", bad, &[("content-type", "text/xml")]).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_form_post_to_a_bucket_is_a_post_object_and_one_with_a_query_is_refused() {
        let k = kind("");
        let form = [("content-type", "multipart/form-data; boundary=b")];
        for target in ["/b", "/b/"] {
            assert_eq!(plan(&k, "POST", target, &form).unwrap(), S3Plan::PostObject { bucket: "b".into() }, "{target}");
        }
        // moto reads `?delete` before the form, s3s the form first: an
        // outside review deleted another holder's key through the gap.
        for target in ["/b?", "/b?x", "/b?delete", "/b?select&select-type=2", "/b?uploads", "/b/?delete"] {
            assert!(plan(&k, "POST", target, &form).is_err(), "{target}");
        }
        let odd = [("content-type", "Multipart/Form-Data;boundary=b")];
        assert_eq!(plan(&k, "POST", "/b", &odd).unwrap(), S3Plan::PostObject { bucket: "b".into() });
        assert!(plan(&k, "POST", "/b?delete", &odd).is_err());
        let lenient = [("content-type", "multipart/form-data ; boundary=b")];
        assert!(plan(&k, "POST", "/b?delete", &lenient).is_err());
        assert!(plan(&k, "POST", "/b/k?select&select-type=2", &form).is_err(), "a form POST to a key");
        assert!(plan(&k, "POST", "/", &form).is_err());
        let two = [("content-type", "text/xml"), ("content-type", "multipart/form-data; boundary=b")];
        assert!(plan(&k, "POST", "/b?delete", &two).is_err());
        assert_eq!(
            plan(&k, "POST", "/b?delete", &[("content-type", "text/xml")]).unwrap(),
            S3Plan::DeleteObjects { bucket: "b".into() }
        );
    }

    #[test]
    fn keys_are_decoded_once_as_s3_decodes_them() {
        let k = kind("");
        assert_eq!(plan(&k, "PUT", "/b/a%2Fb+c%25", &[]).unwrap(), head("b/a/b+c%", &["b/a/b+c%"]));
        assert_eq!(plan(&k, "PUT", "/b/caf%C3%A9", &[]).unwrap(), head("b/café", &["b/café"]));
        assert_eq!(plan(&k, "PUT", "/b/dir/", &[]).unwrap(), head("b/dir/", &["b/dir/"]));
        for bad in ["/b/a/../c", "/b/a/%2e%2e/c", "/b/./c", "/b/a//c", "/b/%ff", "/b/a%0a", "/b/%zz", "/b/%2Fa"] {
            assert!(plan(&k, "PUT", bad, &[]).is_err(), "{bad}");
        }
    }

    #[test]
    fn virtual_hosted_buckets_come_from_host() {
        let k = kind("base_domains = [\"s3.example.internal\"]");
        let h = [("host", "photos.s3.example.internal:8080")];
        assert_eq!(plan(&k, "PUT", "/a/b.jpg", &h).unwrap(), head("photos/a/b.jpg", &["photos/a/b.jpg"]));
        assert_eq!(plan(&k, "PUT", "/", &h).unwrap(), head("photos", &["photos"]));
        // A dotted bucket is refused for a mutation (servers disagree on
        // where it ends: path style serves it) and read as one bucket.
        let h = [("host", "my.bucket.s3.example.internal")];
        assert!(plan(&k, "DELETE", "/k", &h).is_err());
        assert_eq!(plan(&k, "GET", "/k", &h).unwrap(), head("my.bucket/k", &[]));
        // A read is located the same way whatever the case.
        let h = [("host", "My.Bucket.S3.example.internal")];
        assert_eq!(plan(&k, "GET", "/k", &h).unwrap(), head("my.bucket/k", &[]));
        // Any other host: path style.
        let h = [("host", "127.0.0.1:8080")];
        assert_eq!(plan(&k, "PUT", "/b/k", &h).unwrap(), head("b/k", &["b/k"]));
        let h = [("host", "s3.example.internal")];
        assert_eq!(plan(&k, "PUT", "/b/k", &h).unwrap(), head("b/k", &["b/k"]));
        let h = [("host", "[::1]:9000")];
        assert_eq!(plan(&k, "PUT", "/b/k", &h).unwrap(), head("b/k", &["b/k"]));
    }

    #[test]
    fn a_mutation_whose_host_an_s3_server_may_read_as_another_bucket_is_refused() {
        let k = kind("base_domains = [\"s3.test\"]");
        for host in [
            "victimbkt",
            "victimbkt:9000",
            "localhost",
            "mine.S3.TEST",
            "S3.TEST",
            "mine.s3.test.",
            "Mine.s3.test",
            "other.domain",
            ".s3.test",
            "a..b.s3.test",
            "127.0.0.1:x",
            "[::1",
            // Where a dotted bucket ends, servers disagree; moto reads
            // hosts that start with localhost/localstack as path style.
            "my.bucket-1.s3.test:9000",
            "localhost.x.s3.test",
            "localhost.s3.test",
            "localstack-1.s3.test",
            "127.0.0.1.s3.test",
            "host.docker.internal.s3.test",
        ] {
            for m in ["PUT", "DELETE", "POST"] {
                assert!(plan(&k, m, "/bkt/k", &[("host", host)]).is_err(), "{m} {host}");
            }
            assert!(plan(&k, "GET", "/bkt/k", &[("host", host)]).is_ok(), "reads are not judged by Host: {host}");
        }
        assert!(plan(&k, "PUT", "/bkt/k", &[("host", "127.0.0.1"), ("host", "127.0.0.1")]).is_err());
        for host in ["127.0.0.1:9000", "s3.test", "s3.test:80", "mine.s3.test", "bucket-1.s3.test:9000", "[::1]"] {
            assert!(plan(&k, "PUT", "/bkt/k", &[("host", host)]).is_ok(), "{host}");
        }
        // Without base_domains nothing is judged by Host (docs/s3.md: the
        // upstream must then be path-style only).
        assert!(plan(&kind(""), "PUT", "/bkt/k", &[("host", "victimbkt")]).is_ok());
    }

    #[test]
    fn routes_match_the_decoded_path() {
        assert_eq!(match_path("/bk%74/victim"), "/bkt/victim");
        assert_eq!(match_path("/bkt/a%2Fb"), "/bkt/a/b");
        assert_eq!(match_path("/bkt/%zz"), "/bkt/%zz");
        assert_eq!(match_path("/bkt/k"), "/bkt/k");
    }

    #[test]
    fn templates_fence_a_prefix() {
        let k = kind("resource = \"{bucket}/{dir}\"");
        assert_eq!(plan(&k, "PUT", "/b/logs/2026/x", &[]).unwrap(), head("b/logs/2026", &["b/logs/2026"]));
        let rename = plan(&k, "PUT", "/b/d/x?renameObject", &[("x-amz-rename-source", "/b/d/y")]).unwrap();
        assert_eq!(rename, head("b/d", &["b/d"]), "one resource when the template folds both keys");
    }

    #[test]
    fn bad_settings_are_refused() {
        for extra in [
            "resource = \"{nope}\"",
            "bucket_resource = \"fixed\"",
            "base_domains = [\"a/b\"]",
            "forward_fencing_token = false",
            "host_header = \"rewrite\"",
        ] {
            let text = format!("kind = \"s3\"\nupstream = \"http://127.0.0.1:9\"\n{extra}");
            let rc: RouteConfig = toml::from_str(&text).unwrap();
            assert!(S3Kind::from_config(&rc).is_err(), "{extra}");
        }
        let rc: RouteConfig = toml::from_str("kind = \"s3\"\nupstream = \"http://127.0.0.1:9/base\"\n").unwrap();
        assert!(S3Kind::from_config(&rc).is_err());
    }
}
