//! The crate's one error enum and the one place where an HTTP status and a
//! JSON `error` code are chosen for it (docs/errors.md).
//!
//! Variants are grouped by who is at fault: the client (4xx), the upstream
//! (502/504) or fencegate itself (5xx). Every variant maps to exactly one
//! status and one code. Clients get the short JSON body
//! `{"error": "<code>", "message": "<human text>"}`; the full cause goes to
//! one log line where the error is produced.

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use serde_json::json;

use crate::body::{full, BoxBody};

/// Everything that can make fencegate refuse or fail a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    // ---- the client's fault -------------------------------------------
    /// Input that does not parse or is out of bounds.
    #[error("{0}")]
    BadRequest(String),
    /// No route or API endpoint at this path.
    #[error("no such endpoint: {0}")]
    NotFound(String),
    /// The endpoint exists but not for this method.
    #[error("method {0} is not allowed here")]
    MethodNotAllowed(String),
    /// A request body above the configured limit.
    #[error("request body is larger than {limit_bytes} bytes")]
    PayloadTooLarge { limit_bytes: u64 },
    /// Request headers above the configured limit.
    #[error("request headers are larger than {limit_bytes} bytes")]
    HeadersTooLarge { limit_bytes: u64 },
    /// More request headers than the HTTP/1.1 parser takes.
    #[error("more than {limit} request headers")]
    TooManyHeaders { limit: usize },
    /// The key is held by someone else and `wait_ms` ran out.
    #[error("{key} is locked; retry in {retry_after_ms} ms")]
    Locked { key: String, retry_after_ms: u64 },
    /// Renew with a lease that is unknown, expired, released or superseded.
    #[error("lease for {key} is no longer held")]
    LeaseLost { key: String },
    /// Release with a lease id that does not hold the key.
    #[error("lease does not hold {key}")]
    NotOwner { key: String },
    /// A mutation without `X-Fencing-Token`.
    #[error("this request changes {key} and needs an X-Fencing-Token header")]
    FencingTokenRequired { key: String },
    /// `X-Fencing-Token` present but not one decimal u64.
    #[error("X-Fencing-Token is malformed: {0}")]
    MalformedFencingToken(String),
    /// A token older than the fence: its holder was superseded.
    #[error("fencing token {token} for {key} is stale: the fence is at {fence}")]
    StaleFencingToken { key: String, token: u64, fence: u64 },
    /// A token above the fence that this gateway never issued for this key.
    #[error("fencing token {token} was never issued for {key} (fence is at {fence})")]
    UnissuedFencingToken { key: String, token: u64, fence: u64 },
    /// `X-Fencing-Sequence` not above the highest one forwarded under the
    /// same token: a holder's own delayed or retried write.
    #[error(
        "X-Fencing-Sequence {sequence} for {key} under token {token} is not above the last forwarded one ({last_sequence})"
    )]
    StaleSequence { key: String, token: u64, sequence: u64, last_sequence: u64 },
    /// A new key would pass a fence quota (`max_fences`): every key ever
    /// fenced costs memory and disk for good.
    #[error("no fence for a new key: the {scope} holds its limit of {limit} fenced keys")]
    FenceQuota { scope: &'static str, limit: usize },
    /// External route: a token too far above the fence to be believed.
    #[error(
        "fencing token {token} for {key} is more than max_token_step ({max_step}) above the fence {fence}: refused"
    )]
    TokenStepTooLarge { key: String, token: u64, fence: u64, max_step: u64 },
    /// The token is the current fence but its grant was released or expired.
    #[error("the lease behind fencing token {token} for {key} has ended")]
    LeaseExpired { key: String, token: u64 },
    /// No or unknown credentials.
    #[error("authentication required")]
    Unauthorized,
    /// The `lock --inject` proxy was used without its per-run secret.
    #[error("this proxy serves only the command it was started for: proxy credentials required")]
    ProxyAuthRequired,
    /// The client took longer than the configured deadline to send its
    /// request body.
    #[error("the request body did not arrive within {timeout_ms} ms")]
    BodyTimeout { timeout_ms: u64 },
    /// A conditional request (`If-Match`, `If-None-Match`) did not hold.
    #[error("precondition failed: {0}")]
    PreconditionFailed(String),
    /// One principal (or client address) has as many watches open as it
    /// may.
    #[error("{owner} already has {limit} watches open")]
    TooManyWatches { owner: String, limit: usize },
    /// Credentials valid, but not for this key.
    #[error("not allowed: {0}")]
    Forbidden(String),

    // ---- the upstream's fault -----------------------------------------
    /// The upstream could not be reached or broke the exchange.
    #[error("upstream unavailable: {0}")]
    UpstreamUnavailable(String),
    /// The upstream did not answer within the route's timeout.
    #[error("upstream did not answer within {timeout_ms} ms")]
    UpstreamTimeout { timeout_ms: u64 },

    // ---- fencegate's own fault ----------------------------------------
    /// The durable store failed; nothing was acknowledged.
    #[error("storage failure: {0}")]
    Store(String),
    /// The gateway is shutting down or not ready.
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// Cluster mode: this gateway cannot prove its fences are current, so
    /// it refuses mutations until it has resynchronised (docs/cluster.md).
    #[error("this gateway cannot prove its fences are current: {0}; retry, or use another gateway")]
    NotCurrent(String),
    /// Anything else that is a bug or an environment failure.
    #[error("internal error: {0}")]
    Internal(String),

    // ---- the operator's: start-up and reload ----------------------------
    /// A configuration that does not hold, or a file it names that cannot be
    /// read or parsed (certificates, principals): `serve` and `check-config`
    /// stop with it, a SIGHUP reload keeps the old files. Never a request's
    /// answer; its status and code exist only so that every variant has one.
    #[error("{0}")]
    Config(String),
}

impl Error {
    /// The one HTTP status of this error.
    pub fn status(&self) -> StatusCode {
        match self {
            Error::BadRequest(_) | Error::MalformedFencingToken(_) => StatusCode::BAD_REQUEST,
            Error::NotFound(_) => StatusCode::NOT_FOUND,
            Error::PreconditionFailed(_) => StatusCode::PRECONDITION_FAILED,
            Error::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            Error::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Error::HeadersTooLarge { .. } | Error::TooManyHeaders { .. } => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            Error::Locked { .. }
            | Error::NotOwner { .. }
            | Error::StaleFencingToken { .. }
            | Error::StaleSequence { .. }
            | Error::LeaseExpired { .. } => StatusCode::CONFLICT,
            Error::LeaseLost { .. } => StatusCode::GONE,
            Error::FencingTokenRequired { .. } => StatusCode::PRECONDITION_REQUIRED,
            Error::UnissuedFencingToken { .. } | Error::TokenStepTooLarge { .. } | Error::Forbidden(_) => {
                StatusCode::FORBIDDEN
            }
            Error::Unauthorized => StatusCode::UNAUTHORIZED,
            Error::TooManyWatches { .. } => StatusCode::TOO_MANY_REQUESTS,
            Error::ProxyAuthRequired => StatusCode::PROXY_AUTHENTICATION_REQUIRED,
            Error::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            Error::UpstreamUnavailable(_) => StatusCode::BAD_GATEWAY,
            Error::UpstreamTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            Error::Store(_) | Error::Internal(_) | Error::Config(_) => StatusCode::INTERNAL_SERVER_ERROR,
            Error::FenceQuota { .. } => StatusCode::INSUFFICIENT_STORAGE,
            Error::Unavailable(_) | Error::NotCurrent(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The one `error` code of this error, exactly as docs/errors.md names it.
    pub fn code(&self) -> &'static str {
        match self {
            Error::BadRequest(_) => "bad_request",
            Error::NotFound(_) => "not_found",
            Error::PreconditionFailed(_) => "precondition_failed",
            Error::MethodNotAllowed(_) => "method_not_allowed",
            Error::PayloadTooLarge { .. } => "payload_too_large",
            Error::HeadersTooLarge { .. } | Error::TooManyHeaders { .. } => "headers_too_large",
            Error::Locked { .. } => "locked",
            Error::LeaseLost { .. } => "lease_lost",
            Error::NotOwner { .. } => "not_owner",
            Error::FencingTokenRequired { .. } => "fencing_token_required",
            Error::MalformedFencingToken(_) => "malformed_fencing_token",
            Error::StaleFencingToken { .. } => "stale_fencing_token",
            Error::UnissuedFencingToken { .. } | Error::TokenStepTooLarge { .. } => "unissued_fencing_token",
            Error::LeaseExpired { .. } => "lease_expired",
            Error::StaleSequence { .. } => "stale_sequence",
            Error::Unauthorized => "unauthorized",
            Error::TooManyWatches { .. } => "too_many_watches",
            Error::ProxyAuthRequired => "proxy_authentication_required",
            Error::BodyTimeout { .. } => "request_timeout",
            Error::Forbidden(_) => "forbidden",
            Error::UpstreamUnavailable(_) => "upstream_unavailable",
            Error::UpstreamTimeout { .. } => "upstream_timeout",
            Error::Store(_) => "store_error",
            Error::FenceQuota { .. } => "fence_quota_exceeded",
            Error::Unavailable(_) => "unavailable",
            Error::NotCurrent(_) => "not_current",
            Error::Internal(_) => "internal",
            Error::Config(_) => "config_error",
        }
    }

    /// The JSON body: `error`, `message`, and the fields a client acts on.
    pub fn body(&self) -> serde_json::Value {
        let mut body = json!({ "error": self.code(), "message": self.to_string() });
        match self {
            Error::Locked { retry_after_ms, .. } => {
                body["retry_after_ms"] = json!(retry_after_ms);
            }
            Error::StaleFencingToken { token, fence, .. } | Error::UnissuedFencingToken { token, fence, .. } => {
                body["token"] = json!(token);
                body["fence"] = json!(fence);
            }
            Error::StaleSequence { token, sequence, last_sequence, .. } => {
                body["token"] = json!(token);
                body["sequence"] = json!(sequence);
                body["last_sequence"] = json!(last_sequence);
            }
            Error::TokenStepTooLarge { token, fence, max_step, .. } => {
                body["token"] = json!(token);
                body["fence"] = json!(fence);
                body["max_token_step"] = json!(max_step);
            }
            Error::LeaseExpired { token, .. } => {
                body["token"] = json!(token);
            }
            _ => {}
        }
        body
    }

    /// Renders the error as the response a client receives.
    pub fn into_response(self) -> Response<BoxBody> {
        let status = self.status();
        let bytes = Bytes::from(self.body().to_string());
        let mut response = Response::new(full(bytes));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if let Error::Locked { retry_after_ms, .. } = &self {
            // Retry-After is in whole seconds; round up so a client never
            // comes back before the lease could have ended.
            let secs = retry_after_ms.div_ceil(1000).max(1);
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if let Error::TooManyWatches { .. } = &self {
            headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if let Error::ProxyAuthRequired = &self {
            headers.insert(
                header::PROXY_AUTHENTICATE,
                HeaderValue::from_static("Basic realm=\"fencegate lock --inject\""),
            );
        }
        if let Error::BodyTimeout { .. } = &self {
            // The rest of the body may still be on its way: not reusable.
            headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        response
    }
}

impl Error {
    /// The code of S3's XML error body on S3 routes (docs/s3.md): the JSON
    /// `error` code in S3's spelling (`stale_fencing_token` →
    /// `StaleFencingToken`), so the two always name the same cause.
    pub fn s3_code(&self) -> String {
        camel(self.code())
    }

    /// The S3 XML error body: `Code`, `Message`, and every field of the
    /// JSON body in S3's spelling (`token` → `Token`, `last_sequence` →
    /// `LastSequence`), plus `FencegateError`, the JSON code.
    pub fn s3_body(&self) -> String {
        let mut out = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error>");
        let mut field = |name: &str, value: &str| {
            out.push_str(&format!("<{name}>{}</{name}>", xml_escape(value)));
        };
        field("Code", &self.s3_code());
        field("Message", &self.to_string());
        if let serde_json::Value::Object(map) = self.body() {
            for (k, v) in map {
                if k == "error" || k == "message" {
                    continue;
                }
                let text = match &v {
                    serde_json::Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                field(&camel(&k), &text);
            }
        }
        field("FencegateError", self.code());
        out.push_str("</Error>");
        out
    }

    /// [`Error::into_response`] with S3's XML error body: the same status
    /// and headers (`Retry-After`, …), the body for S3 SDKs.
    pub fn into_s3_response(self) -> Response<BoxBody> {
        let body = self.s3_body();
        let mut response = self.into_response();
        response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/xml"));
        *response.body_mut() = full(body);
        response
    }
}

fn camel(snake: &str) -> String {
    snake
        .split('_')
        .map(|w| {
            let mut c = w.chars();
            c.next().map_or(String::new(), |f| f.to_ascii_uppercase().to_string() + c.as_str())
        })
        .collect()
}

fn xml_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c if c.is_control() && !matches!(c, '\t' | '\n') => out.push_str(&format!("&#x{:X};", u32::from(c))),
            c => out.push(c),
        }
    }
    out
}

/// Shorthand for results whose error is the crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_variant_has_spec_status_and_code() {
        let cases = [
            (Error::FencingTokenRequired { key: "k".into() }, 428, "fencing_token_required"),
            (Error::MalformedFencingToken("x".into()), 400, "malformed_fencing_token"),
            (Error::StaleFencingToken { key: "k".into(), token: 1, fence: 2 }, 409, "stale_fencing_token"),
            (Error::UnissuedFencingToken { key: "k".into(), token: 9, fence: 2 }, 403, "unissued_fencing_token"),
            (Error::LeaseExpired { key: "k".into(), token: 2 }, 409, "lease_expired"),
            (Error::FenceQuota { scope: "gateway", limit: 5 }, 507, "fence_quota_exceeded"),
            (Error::StaleSequence { key: "k".into(), token: 2, sequence: 3, last_sequence: 4 }, 409, "stale_sequence"),
            (
                Error::TokenStepTooLarge { key: "k".into(), token: u64::MAX, fence: 2, max_step: 10 },
                403,
                "unissued_fencing_token",
            ),
            (Error::Locked { key: "k".into(), retry_after_ms: 1500 }, 409, "locked"),
            (Error::LeaseLost { key: "k".into() }, 410, "lease_lost"),
            (Error::NotOwner { key: "k".into() }, 409, "not_owner"),
            (Error::UpstreamUnavailable("x".into()), 502, "upstream_unavailable"),
            (Error::UpstreamTimeout { timeout_ms: 5 }, 504, "upstream_timeout"),
            (Error::PayloadTooLarge { limit_bytes: 5 }, 413, "payload_too_large"),
            (Error::HeadersTooLarge { limit_bytes: 5 }, 431, "headers_too_large"),
            (Error::TooManyHeaders { limit: 100 }, 431, "headers_too_large"),
            (Error::ProxyAuthRequired, 407, "proxy_authentication_required"),
            (Error::TooManyWatches { owner: "p".into(), limit: 1 }, 429, "too_many_watches"),
            (Error::BodyTimeout { timeout_ms: 5 }, 408, "request_timeout"),
            (Error::Config("x".into()), 500, "config_error"),
            (Error::NotCurrent("x".into()), 503, "not_current"),
            (Error::Unavailable("x".into()), 503, "unavailable"),
        ];
        for (err, status, code) in cases {
            assert_eq!(err.status().as_u16(), status, "{err:?}");
            assert_eq!(err.code(), code);
            assert_eq!(err.body()["error"], code);
        }
    }

    #[test]
    fn s3_errors_carry_the_spec_codes_and_the_json_fields() {
        let cases = [
            (Error::StaleFencingToken { key: "b/k".into(), token: 3, fence: 4 }, "StaleFencingToken"),
            (Error::UnissuedFencingToken { key: "b/k".into(), token: 9, fence: 4 }, "UnissuedFencingToken"),
            (Error::LeaseExpired { key: "b/k".into(), token: 4 }, "LeaseExpired"),
            (Error::FencingTokenRequired { key: "b/k".into() }, "FencingTokenRequired"),
            (Error::MalformedFencingToken("x".into()), "MalformedFencingToken"),
            (Error::StaleSequence { key: "k".into(), token: 2, sequence: 3, last_sequence: 4 }, "StaleSequence"),
        ];
        for (err, code) in cases {
            assert_eq!(err.s3_code(), code);
            let body = err.s3_body();
            assert!(body.contains(&format!("<Code>{code}</Code>")), "{body}");
            assert!(body.contains(&format!("<FencegateError>{}</FencegateError>", err.code())), "{body}");
            let status = err.status();
            let resp = err.into_s3_response();
            assert_eq!(resp.status(), status);
            assert_eq!(resp.headers()[header::CONTENT_TYPE], "application/xml");
        }
        let body = Error::StaleSequence { key: "a<&>".into(), token: 2, sequence: 3, last_sequence: 4 }.s3_body();
        for f in ["<Token>2</Token>", "<Sequence>3</Sequence>", "<LastSequence>4</LastSequence>"] {
            assert!(body.contains(f), "{body}");
        }
        assert!(body.contains("a&lt;&amp;&gt;"), "{body}");
        let body = Error::StaleFencingToken { key: "k".into(), token: 3, fence: 4 }.s3_body();
        assert!(body.contains("<Fence>4</Fence>") && body.contains("<Token>3</Token>"), "{body}");
    }

    #[test]
    fn locked_response_carries_retry_after_rounded_up() {
        let resp = Error::Locked { key: "k".into(), retry_after_ms: 1500 }.into_response();
        assert_eq!(resp.headers()[header::RETRY_AFTER], "2");
    }

    #[test]
    fn stale_body_names_token_and_fence() {
        let body = Error::StaleFencingToken { key: "k".into(), token: 33, fence: 34 }.body();
        assert_eq!(body["token"], 33);
        assert_eq!(body["fence"], 34);
    }
}
