//! Fencing `aws-sdk-s3` calls with the `fencegate-client` crate.
//!
//! Every S3 mutation sent through a fencegate S3 route must carry the
//! holder's fencing token in `X-Fencing-Token`. The SDK offers two places
//! to add it, and this example shows both:
//!
//! * an interceptor ([`FencingToken`]) registered on the client: it adds the
//!   header in `modify_before_signing`, so the token is part of the SigV4
//!   signature (it appears in `SignedHeaders`) and nobody on the way can
//!   change it;
//! * per call, `customize().mutate_request(...)`: the SDK runs it before
//!   signing too.
//!
//! The story (the GC pause of the README, with the SDK): writer A acquires
//! `bucket/key` and writes; A stops renewing (a process frozen past its
//! TTL); B acquires the same key — a higher token — and writes; A wakes up
//! and writes with its old token. The gateway refuses A's write with 409
//! and S3's XML error body, so the SDK error carries the code
//! `StaleFencingToken` and the message; the object holds B's write.
//!
//! Environment: `FENCEGATE_URL` (the api listener, default
//! `http://127.0.0.1:7070`), `S3_ENDPOINT` (the gateway's proxy listener
//! with an S3 route, default `http://127.0.0.1:8080`),
//! `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` (the S3 server's keys),
//! `S3_BUCKET` (default `fenced-example`). Exit status 0 when every step
//! went as the story says, 1 otherwise.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use aws_sdk_s3::config::http::HttpResponse;
use aws_sdk_s3::config::interceptors::BeforeTransmitInterceptorContextMut;
use aws_sdk_s3::config::{BehaviorVersion, ConfigBag, Credentials, Intercept, Region, RuntimeComponents};
use aws_sdk_s3::error::{BoxError, ProvideErrorMetadata, SdkError};
use aws_sdk_s3::primitives::ByteStream;
use fencegate_client::{Client, FENCING_TOKEN_HEADER};

/// An interceptor that puts the current fencing token on every request the
/// client sends (reads too: a read with a stale token is refused as well,
/// so a deposed holder learns it at once). The token is shared so that the
/// holder can swap in a new grant's token without rebuilding the client;
/// 0 means "no token" (nothing is added).
#[derive(Debug, Clone, Default)]
struct FencingToken(Arc<AtomicU64>);

impl FencingToken {
    fn set(&self, token: u64) {
        self.0.store(token, Ordering::Release);
    }
}

impl Intercept for FencingToken {
    fn name(&self) -> &'static str {
        "FencingToken"
    }

    // Before signing: the header is covered by the SigV4 signature.
    fn modify_before_signing(
        &self,
        context: &mut BeforeTransmitInterceptorContextMut<'_>,
        _runtime_components: &RuntimeComponents,
        _cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let token = self.0.load(Ordering::Acquire);
        if token != 0 {
            context.request_mut().headers_mut().insert(FENCING_TOKEN_HEADER, token.to_string());
        }
        Ok(())
    }
}

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_string())
}

/// An S3 client for the gateway's S3 route: path-style addressing, static
/// keys, the fencing interceptor, and no retries (a refused write must not
/// be retried blindly; the holder decides).
fn s3_client(endpoint: &str, fencing: Option<FencingToken>) -> aws_sdk_s3::Client {
    let creds =
        Credentials::new(env_or("AWS_ACCESS_KEY_ID", ""), env_or("AWS_SECRET_ACCESS_KEY", ""), None, None, "example");
    let mut conf = aws_sdk_s3::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(endpoint)
        .force_path_style(true)
        .credentials_provider(creds)
        .retry_config(aws_sdk_s3::config::retry::RetryConfig::disabled());
    if let Some(f) = fencing {
        conf = conf.interceptor(f);
    }
    aws_sdk_s3::Client::from_conf(conf.build())
}

/// The S3 error code, message and HTTP status of a failed call: the code
/// and message come from S3's XML error body, which the gateway sends on
/// its refusals too.
fn describe<E: ProvideErrorMetadata>(err: &SdkError<E, HttpResponse>) -> (Option<String>, String, u16) {
    let status = err.raw_response().map_or(0, |r| r.status().as_u16());
    let code = err.code().map(str::to_string);
    let message = err.message().unwrap_or("").to_string();
    (code, message, status)
}

async fn run() -> Result<(), String> {
    let api = env_or("FENCEGATE_URL", "http://127.0.0.1:7070");
    let endpoint = env_or("S3_ENDPOINT", "http://127.0.0.1:8080");
    let bucket = env_or("S3_BUCKET", "fenced-example");
    let key = "report.txt";
    let locks = Client::new(&api).map_err(|e| format!("client for {api}: {e}"))?;

    // Creating the bucket is a bucket-level mutation: its resource is the
    // bucket name. A one-off call, so the token goes on per call with
    // customize().mutate_request.
    let plain = s3_client(&endpoint, None);
    let bucket_lease = locks
        .acquire_as(&bucket, Duration::from_secs(10), Duration::from_secs(5), "setup")
        .await
        .map_err(|e| format!("acquire {bucket}: {e}"))?;
    let token = bucket_lease.token();
    plain
        .create_bucket()
        .bucket(&bucket)
        .customize()
        .mutate_request(move |req| {
            req.headers_mut().insert(FENCING_TOKEN_HEADER, token.to_string());
        })
        .send()
        .await
        .map_err(|e| format!("CreateBucket: {:?}", describe(&e)))?;
    bucket_lease.release().await.map_err(|e| format!("release {bucket}: {e}"))?;
    println!("CreateBucket {bucket} with token {token} (customize().mutate_request) -> ok");

    // Writer A: a short lease, and an S3 client whose interceptor puts A's
    // token on every request.
    let resource = format!("{bucket}/{key}");
    let ttl = Duration::from_millis(600);
    let lease_a = locks
        .acquire_as(&resource, ttl, Duration::from_secs(5), "writer-a")
        .await
        .map_err(|e| format!("A acquire: {e}"))?;
    let fencing_a = FencingToken::default();
    fencing_a.set(lease_a.token());
    let s3_a = s3_client(&endpoint, Some(fencing_a.clone()));
    let token_a = lease_a.token();
    s3_a.put_object()
        .bucket(&bucket)
        .key(key)
        .body(ByteStream::from_static(b"A's first draft"))
        .send()
        .await
        .map_err(|e| format!("A's first PutObject: {:?}", describe(&e)))?;
    println!("A (token {token_a}) PutObject -> ok");

    // A freezes: it stops renewing, and its lease runs out.
    lease_a.abandon();
    tokio::time::sleep(ttl + Duration::from_millis(300)).await;

    // B takes over with a higher token and writes.
    let lease_b = locks
        .acquire_as(&resource, Duration::from_secs(10), Duration::from_secs(5), "writer-b")
        .await
        .map_err(|e| format!("B acquire: {e}"))?;
    let token_b = lease_b.token();
    let fencing_b = FencingToken::default();
    fencing_b.set(token_b);
    let s3_b = s3_client(&endpoint, Some(fencing_b));
    s3_b.put_object()
        .bucket(&bucket)
        .key(key)
        .body(ByteStream::from_static(b"B's final report"))
        .send()
        .await
        .map_err(|e| format!("B's PutObject: {:?}", describe(&e)))?;
    println!("B (token {token_b}) PutObject -> ok");

    // A wakes up and writes with the token it still holds.
    let stale =
        s3_a.put_object().bucket(&bucket).key(key).body(ByteStream::from_static(b"A's stale overwrite")).send().await;
    let err = match stale {
        Ok(_) => return Err(format!("A's stale PutObject (token {token_a}) was accepted")),
        Err(e) => e,
    };
    let (code, message, status) = describe(&err);
    println!("A (token {token_a}) PutObject -> HTTP {status} {} ({message})", code.as_deref().unwrap_or("?"));
    if code.as_deref() != Some("StaleFencingToken") || status != 409 {
        return Err(format!("expected 409 StaleFencingToken, got {status} {code:?}: {err:?}"));
    }

    // The object is B's.
    let got = s3_b
        .get_object()
        .bucket(&bucket)
        .key(key)
        .send()
        .await
        .map_err(|e| format!("GetObject: {:?}", describe(&e)))?;
    let body = got.body.collect().await.map_err(|e| format!("reading the object: {e}"))?.into_bytes();
    let text = String::from_utf8_lossy(&body).into_owned();
    println!("the object holds: {text:?}");
    lease_b.release().await.map_err(|e| format!("B release: {e}"))?;
    if text != "B's final report" {
        return Err(format!("the object should be B's write, it is {text:?}"));
    }
    Ok(())
}

#[tokio::main]
async fn main() {
    if let Err(e) = run().await {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
