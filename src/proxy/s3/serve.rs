//! An S3 route's request, from classification to the proxy's one
//! admission and forwarding path.
//!
//! The S3 kind says which resources a request touches ([`S3Kind::classify`],
//! and for `DeleteObjects`/`PostObject` a bounded copy of the body); then a
//! request that changes at most one resource goes through
//! [`Proxy::admit_and_forward`] exactly as on an HTTP route, and one that
//! changes several through [`Proxy::admit_all_and_forward`]:
//! [`FenceTable::admit_all`](crate::fence::FenceTable::admit_all), every key
//! admissible and registered or the whole request refused. Nothing here
//! forwards by itself, and nothing changes a byte of what is forwarded.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{header, Method, Request, Response};
use http_body_util::BodyExt;

use super::form::{self, Scan};
use super::tokens::Tokens;
use super::{xml, S3Kind, S3Plan};
use crate::authority::validate_key;
use crate::body::BoxBody;
use crate::error::Error;
use crate::fence::token::TokenError;
use crate::fence::{Admission, InflightGuard};
use crate::metrics::Outcome;
use crate::peer::Peer;
use crate::proxy::headers::X_FENCING_SEQUENCE;
use crate::proxy::{ErrorReply, Proxy, Route, Seen};

/// How long a client may take to send the part of a body read before
/// admission (the keys of `DeleteObjects`, the fields of `PostObject`).
const SCAN_TIMEOUT: Duration = Duration::from_secs(30);

impl Proxy {
    pub(in crate::proxy) async fn handle_s3<'a>(
        &'a self,
        route: &'a Route,
        s3: &S3Kind,
        req: Request<BoxBody>,
        client: &Peer,
        seen: &mut Seen<'a>,
    ) -> Result<Response<BoxBody>, ErrorReply> {
        let plan = s3.classify(req.method(), req.uri(), req.headers())?;
        // A read's body without `Content-Length` or `Transfer-Encoding`
        // (which `classify` judges): HTTP/2 DATA frames. A server that
        // hosts several services runs a body on a read as another
        // service's action (an outside review: an h2c `OPTIONS` with a
        // JSON body reached DynamoDB, whose export wrote keys in a held
        // bucket). Read to its end first: only an empty one passes.
        let read = matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS);
        let declared_empty = req.headers().get(header::CONTENT_LENGTH).is_some_and(|v| v.as_bytes() == b"0");
        let req = if read && !declared_empty && !http_body::Body::is_end_stream(req.body()) {
            read_without_body(req).await?
        } else {
            req
        };
        let mut tokens = Tokens::parse(req.headers());
        let (req, primary, mutated) = match plan {
            S3Plan::Head { primary, mutated } => (req, primary, mutated),
            S3Plan::DeleteObjects { bucket } => {
                let resource = s3.bucket_resource(&bucket);
                self.token_before_body(route, &resource, &tokens, client)?;
                let (req, body) = read_whole(req, s3.max_scanned_body_bytes).await?;
                // The bytes forwarded stay the original ones; only the
                // reading here looks through an aws-chunked framing.
                let aws_chunked =
                    aws_chunked(req.headers()).map_err(|e| Error::BadRequest(format!("DeleteObjects refused: {e}")))?;
                let decoded;
                let body = if aws_chunked {
                    // s3s reads through the framing only for a SigV4
                    // `Authorization` header; signed otherwise (SigV2, a
                    // presigned URL) it parses the framed bytes as XML, and
                    // a chunk header lands inside a key (outside review).
                    if !sigv4_header_signed(req.headers()) {
                        return Err(Error::BadRequest(
                            "DeleteObjects refused: an aws-chunked body needs an `Authorization: AWS4-HMAC-SHA256` \
                             header (servers read it otherwise without one)"
                                .into(),
                        )
                        .into());
                    }
                    decoded = xml::aws_unchunk(&body)
                        .map_err(|e| Error::BadRequest(format!("DeleteObjects refused: its aws-chunked body: {e}")))?;
                    &decoded[..]
                } else {
                    &body[..]
                };
                let keys = xml::delete_keys(body)
                    .map_err(|e| Error::BadRequest(format!("DeleteObjects refused: its XML body: {e}")))?;
                let mut mutated = Vec::with_capacity(keys.len());
                for key in keys {
                    super::check_key(&key)
                        .map_err(|e| Error::BadRequest(format!("DeleteObjects refused: key {key:?}: {e}")))?;
                    let r = s3.object_resource(&bucket, &key);
                    if !mutated.contains(&r) {
                        mutated.push(r);
                    }
                }
                (req, resource, mutated)
            }
            S3Plan::PostObject { bucket } => {
                // A browser form is never aws-chunked; a server that would
                // read it through that framing sees other fields.
                if aws_chunked(req.headers()).map_err(|e| Error::BadRequest(format!("PostObject refused: {e}")))? {
                    return Err(Error::BadRequest("PostObject refused: an aws-chunked form".into()).into());
                }
                let (req, fields) = read_form(req, s3.max_scanned_body_bytes).await?;
                let key =
                    form::object_key(&fields).map_err(|e| Error::BadRequest(format!("PostObject refused: {e}")))?;
                super::check_key(&key).map_err(|e| Error::BadRequest(format!("PostObject refused: key: {e}")))?;
                if let Some((_, t)) = fields.iter().find(|(n, _)| n == form::TOKEN_FIELD) {
                    tokens.default_from_field(t);
                }
                let resource = s3.object_resource(&bucket, &key);
                (req, resource.clone(), vec![resource])
            }
        };
        if seen.log {
            seen.key = Some(primary.clone());
        }
        if route.auth {
            let principal = self.auth.require(req.headers(), "proxy-authorization", client.cert_cn.as_deref())?;
            for key in if mutated.is_empty() { std::slice::from_ref(&primary) } else { &mutated[..] } {
                principal.authorize(key)?;
            }
        }
        match &mutated[..] {
            // Reads are not judged by their token on S3 routes: SDK hooks add
            // the holder's token to every call, and a token of one key says
            // nothing about another key's fence (tokens are one sequence
            // across keys). A deposed writer learns of it on its next write.
            [] => self.admit_and_forward(route, &primary, "", false, Ok(None), req, client).await,
            [one] => self.admit_and_forward(route, one, "", true, tokens.for_resource(one), req, client).await,
            _ => Box::pin(self.admit_all_and_forward(route, &mutated, &tokens, req, client)).await,
        }
    }

    /// A body-named mutation without any token is refused on its head,
    /// before its body is read (and before a `100 Continue`).
    fn token_before_body(
        &self,
        route: &Route,
        resource: &str,
        tokens: &Tokens,
        client: &Peer,
    ) -> Result<(), ErrorReply> {
        if tokens.any() || !route.enforce {
            return Ok(());
        }
        let error = Error::FencingTokenRequired { key: resource.to_string() };
        self.refuse_or_shadow(route, resource, None, ErrorReply { error, outcome: Some(Outcome::MissingToken) }, client)
    }

    /// The admission of a request that changes several resources, then the
    /// one forwarding path: every resource's token must be admissible and
    /// every resource is registered in flight (all or none, in sorted
    /// order), or the whole request is refused and nothing is forwarded.
    pub(in crate::proxy) async fn admit_all_and_forward(
        &self,
        route: &Route,
        mutated: &[String],
        tokens: &Tokens,
        req: Request<BoxBody>,
        client: &Peer,
    ) -> Result<Response<BoxBody>, ErrorReply> {
        if req.headers().contains_key(&X_FENCING_SEQUENCE) {
            return Err(Error::BadRequest(
                "X-Fencing-Sequence orders the writes of one key: a request that changes several keys cannot carry it"
                    .into(),
            )
            .into());
        }
        let mut pairs: Vec<(&str, u64)> = Vec::with_capacity(mutated.len());
        for key in mutated {
            validate_key(key)?;
            match tokens.for_resource(key) {
                Ok(Some(t)) => pairs.push((key, t)),
                Ok(None) => {
                    let error = Error::FencingTokenRequired { key: key.clone() };
                    self.refuse_or_shadow(
                        route,
                        key,
                        None,
                        ErrorReply { error, outcome: Some(Outcome::MissingToken) },
                        client,
                    )?;
                }
                Err(TokenError::Malformed(m)) => {
                    let error = Error::MalformedFencingToken(m);
                    let refused = ErrorReply { error, outcome: Some(Outcome::MalformedToken) };
                    self.refuse_or_shadow(route, key, None, refused, client)?;
                }
            }
        }
        let mut guards: Vec<InflightGuard> = Vec::with_capacity(pairs.len());
        match self.fences().admit_all(&pairs, route.policy) {
            Ok(admitted) => {
                for (i, admission) in admitted {
                    let (key, token) = pairs[i];
                    match admission {
                        Admission::Admitted(g) => guards.push(g),
                        // `check` takes no sequence: never this.
                        Admission::AdmittedAfter(..) => {
                            return Err(Error::Internal("a sequenced admission without a sequence".into()).into())
                        }
                        Admission::MustAdvance => {
                            match self.fences().advance(key, token, None, route.policy, &self.store) {
                                Ok((g, durable)) => guards.push(self.activate(route, key, token, g, durable).await?),
                                Err(refusal) => {
                                    // Every other registration ends here.
                                    guards.clear();
                                    self.refuse_fenced(route, key, token, refusal, client)?;
                                    break;
                                }
                            }
                        }
                    }
                }
            }
            Err((i, refusal)) => {
                let (key, token) = pairs[i];
                // Enforcing: refused here. Shadow: forwarded unregistered.
                self.refuse_fenced(route, key, token, refusal, client)?;
            }
        }
        if route.policy.external && !guards.is_empty() {
            // As for one key: another request may be advancing to these
            // very tokens; wait as it does, then make sure none moved on.
            let mut current = Vec::with_capacity(guards.len());
            for g in guards {
                let key = g.key().to_string();
                Box::pin(self.fences().barrier(&key, g.token(), route.upstream_timeout)).await;
                if let Some(g) = self.still_current(route, &key, g, client)? {
                    current.push(g);
                }
            }
            guards = current;
        }
        let first = mutated.first().map_or("", String::as_str);
        let token = pairs.first().map(|p| p.1);
        Box::pin(self.forward(route, first, "", true, req, client, guards, token)).await
    }
}

/// Whether a request carries one `Authorization` header of SigV4
/// (`AWS4-HMAC-SHA256 …`) and no presigned signature in its query.
fn sigv4_header_signed(headers: &http::HeaderMap) -> bool {
    let mut all = headers.get_all(header::AUTHORIZATION).iter();
    matches!((all.next(), all.next()), (Some(v), None) if v.as_bytes().starts_with(b"AWS4-HMAC-SHA256 "))
}

/// Whether a body is aws-chunked. A server may decide it from
/// `Content-Encoding: aws-chunked` or from `x-amz-content-sha256:
/// STREAMING-…` (s3s reads the latter): the two must agree, and each may
/// appear once, or the request is refused — a body read one way here and
/// another way upstream could name other keys.
fn aws_chunked(headers: &http::HeaderMap) -> Result<bool, String> {
    let mut encodings = headers.get_all(header::CONTENT_ENCODING).iter();
    let encoded = match (encodings.next(), encodings.next()) {
        (None, _) => false,
        (Some(v), None) => {
            let v = v.to_str().map_err(|_| "Content-Encoding is not text")?;
            v.split(',').any(|e| e.trim().eq_ignore_ascii_case("aws-chunked"))
        }
        (Some(_), Some(_)) => return Err("more than one Content-Encoding".into()),
    };
    let mut hashes = headers.get_all("x-amz-content-sha256").iter();
    let streaming = match (hashes.next(), hashes.next()) {
        (None, _) => false,
        (Some(v), None) => {
            let v = v.to_str().map_err(|_| "x-amz-content-sha256 is not text")?.trim();
            let prefix = v.get(..10);
            // Servers compare it case-sensitively, or may not: any other
            // spelling is refused.
            if prefix.is_some_and(|p| p.eq_ignore_ascii_case("STREAMING-") && p != "STREAMING-") {
                return Err("x-amz-content-sha256: STREAMING- in another case".into());
            }
            prefix == Some("STREAMING-")
        }
        (Some(_), Some(_)) => return Err("more than one x-amz-content-sha256".into()),
    };
    if encoded != streaming {
        return Err("Content-Encoding: aws-chunked and x-amz-content-sha256: STREAMING-… must come together".into());
    }
    Ok(encoded)
}

/// A read whose body was not at its end on its head (HTTP/2: DATA frames
/// may follow, an empty one ending the stream too), read to its end within
/// [`SCAN_TIMEOUT`]: a byte of data or a trailer refuses it, an empty end
/// passes it on with no body.
async fn read_without_body(req: Request<BoxBody>) -> Result<Request<BoxBody>, Error> {
    let (parts, mut body) = req.into_parts();
    let read = async {
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| Error::BadRequest(format!("reading the request body: {e}")))?;
            if frame.data_ref().is_none_or(|d| !d.is_empty()) {
                return Err(Error::BadRequest(format!(
                    "S3 request refused: a {} request carries no body (servers read one as another service's action)",
                    parts.method
                )));
            }
        }
        Ok(())
    };
    match tokio::time::timeout(SCAN_TIMEOUT, read).await {
        Ok(Ok(())) => Ok(Request::from_parts(parts, crate::body::empty())),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(Error::BodyTimeout { timeout_ms: 30_000 }),
    }
}

/// Reads a whole body of at most `limit` bytes (413 above it) and gives
/// back the request with the very same bytes as its body.
async fn read_whole(req: Request<BoxBody>, limit: u64) -> Result<(Request<BoxBody>, Bytes), ErrorReply> {
    let (parts, mut body) = req.into_parts();
    let declared = crate::body::content_length(&parts.headers);
    if declared > Some(limit) {
        return Err(Error::PayloadTooLarge { limit_bytes: limit }.into());
    }
    let mut buf = BytesMut::new();
    let read = async {
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| Error::BadRequest(format!("reading the request body: {e}")))?;
            if let Some(d) = frame.data_ref() {
                buf.extend_from_slice(d);
                if buf.len() as u64 > limit {
                    return Err(Error::PayloadTooLarge { limit_bytes: limit });
                }
            }
        }
        Ok(())
    };
    match tokio::time::timeout(SCAN_TIMEOUT, read).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(e.into()),
        Err(_) => return Err(Error::BodyTimeout { timeout_ms: 30_000 }.into()),
    }
    // Forwarded from memory: whether the client's stream really ended is
    // judged here, as `FencedBody` judges a streamed body.
    let h2 = parts.version == http::Version::HTTP_2;
    crate::proxy::fenced_body::ended_whole(h2, &body, declared, buf.len() as u64)
        .map_err(|cut| Error::BadRequest(cut.into()))?;
    let bytes = buf.freeze();
    Ok((Request::from_parts(parts, crate::body::full(bytes.clone())), bytes))
}

/// Reads a `PostObject` form up to its file part (at most `limit` bytes)
/// and gives back the request whose body is the bytes read followed by
/// the rest of the original body, unchanged.
async fn read_form(req: Request<BoxBody>, limit: u64) -> Result<(Request<BoxBody>, Vec<(String, String)>), ErrorReply> {
    let bad = |m: String| -> ErrorReply { Error::BadRequest(format!("PostObject refused: {m}")).into() };
    let content_type = req.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    let Some(boundary) = form::boundary(content_type) else {
        return Err(bad("a POST to a bucket must be a multipart/form-data upload whose Content-Type reads \
             `multipart/form-data; boundary=…` (token parameters, no space before `;` or around `=`)"
            .into()));
    };
    let (parts, mut body) = req.into_parts();
    let mut buf = BytesMut::new();
    let read = async {
        loop {
            match form::scan(&buf, &boundary) {
                Ok(Scan::Fields { fields, content }) => return Ok((fields, content)),
                Ok(Scan::NeedMore) => {}
                Err(e) => return Err(bad(e)),
            }
            if buf.len() as u64 > limit {
                return Err(Error::PayloadTooLarge { limit_bytes: limit }.into());
            }
            match body.frame().await {
                Some(Ok(frame)) => {
                    if let Some(d) = frame.data_ref() {
                        buf.extend_from_slice(d);
                    }
                }
                Some(Err(e)) => return Err(bad(format!("reading the request body: {e}"))),
                None => return Err(bad("the body ended before the file part".into())),
            }
        }
    };
    let (fields, content) = match tokio::time::timeout(SCAN_TIMEOUT, read).await {
        Ok(r) => r?,
        Err(_) => return Err(Error::BodyTimeout { timeout_ms: 30_000 }.into()),
    };
    // The fields after the file part, which this scan does not read, must
    // not exist: the upload is cut off at one (`form::AfterFile`).
    let mut after = form::AfterFile::new(&boundary, content);
    if let Err(e) = after.feed(&buf) {
        return Err(bad(e));
    }
    let body = crate::body::prefixed(buf.freeze(), crate::body::checked(body, move |d| after.feed(d)));
    Ok((Request::from_parts(parts, body), fields))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_read_body_is_given_back_byte_for_byte() {
        let req = Request::builder().body(crate::body::full("<Delete/>")).unwrap();
        let Ok((req, bytes)) = read_whole(req, 100).await else { panic!("refused") };
        assert_eq!(&bytes[..], b"<Delete/>");
        let again = req.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(again, bytes);
        let big = Request::builder().body(crate::body::full(vec![b'x'; 101])).unwrap();
        assert!(read_whole(big, 100).await.is_err());
    }

    fn headers(pairs: &[(&str, &str)]) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        for (n, v) in pairs {
            h.append(http::HeaderName::from_bytes(n.as_bytes()).unwrap(), v.parse().unwrap());
        }
        h
    }

    #[test]
    fn aws_chunked_only_when_both_headers_say_so() {
        let sha = "x-amz-content-sha256";
        assert_eq!(aws_chunked(&headers(&[])), Ok(false));
        assert_eq!(aws_chunked(&headers(&[(sha, "UNSIGNED-PAYLOAD")])), Ok(false));
        let both = [("content-encoding", "aws-chunked"), (sha, "STREAMING-UNSIGNED-PAYLOAD-TRAILER")];
        assert_eq!(aws_chunked(&headers(&both)), Ok(true));
        // One without the other: the gateway and the server would disagree.
        assert!(aws_chunked(&headers(&[("content-encoding", "aws-chunked"), (sha, "UNSIGNED-PAYLOAD")])).is_err());
        assert!(aws_chunked(&headers(&[("content-encoding", "aws-chunked")])).is_err());
        assert!(aws_chunked(&headers(&[(sha, "STREAMING-AWS4-HMAC-SHA256-PAYLOAD")])).is_err());
        let twice = [("content-encoding", "aws-chunked"), ("content-encoding", "gzip"), (sha, "STREAMING-X")];
        assert!(aws_chunked(&headers(&twice)).is_err());
        let lower = [("content-encoding", "aws-chunked"), (sha, "streaming-UNSIGNED-PAYLOAD-TRAILER")];
        assert!(aws_chunked(&headers(&lower)).is_err());
        assert!(aws_chunked(&headers(&[(sha, "Streaming-x")])).is_err());
    }
}
