//! `POST /v1/locks/batch`: many acquire, renew and release operations in
//! one request, each answered on its own (docs/lease-api.md, Batches).
//!
//! Contracts:
//! - Each operation is the single call of the same name: the same checks
//!   (key, bounds, the principal's prefixes, the fence quota), the same
//!   effect, the same metrics, and as its answer the status and JSON body
//!   the single call would have returned. One bad operation never fails
//!   the others.
//! - Operations take effect in the order given; acquires wait for their
//!   fsync together (one group commit for the batch, not one per grant).
//! - A batch never waits in a queue: an acquire with `wait_ms` above 0 is
//!   refused (400) on its own.
//! - Bounded: at most [`MAX_BATCH_OPERATIONS`] operations and a body of
//!   at most [`BATCH_BODY_FACTOR`] × `api_max_body_bytes`; beyond either,
//!   the whole batch is refused with 400 / 413 and nothing is done.

use std::future::Future;
use std::task::Poll;

use futures_util::future::{join_all, Either};
use http::{Request, Response, StatusCode};
use serde::Deserialize;
use serde_json::{json, Value};

use super::{authorize, json_response, Api};
use crate::auth::Principal;
use crate::authority::{AcquireRequest, ReleaseRequest, RenewRequest};
use crate::body::BoxBody;
use crate::error::Error;

/// Most operations in one batch.
pub const MAX_BATCH_OPERATIONS: usize = 1_000;

/// A batch body may be this many times `api_max_body_bytes` (1 MiB with
/// the default 64 KiB): room for [`MAX_BATCH_OPERATIONS`] renewals.
pub const BATCH_BODY_FACTOR: u64 = 16;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchRequest {
    operations: Vec<OpFields>,
}

/// One operation's fields as written. Not a plain `Value`: a JSON object
/// read into one keeps the last of two equal names, where the single call
/// (parsed straight into its struct) refuses a field given twice. The
/// first name given twice is kept, so the operation is refused alone.
struct OpFields {
    fields: Result<serde_json::Map<String, Value>, Error>,
}

impl<'de> Deserialize<'de> for OpFields {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<OpFields, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = OpFields;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an operation object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<OpFields, A::Error> {
                let mut fields = serde_json::Map::new();
                let mut twice = None;
                while let Some((k, v)) = map.next_entry::<String, Value>()? {
                    if fields.contains_key(&k) && twice.is_none() {
                        twice = Some(k.chars().take(64).collect::<String>());
                    }
                    fields.insert(k, v);
                }
                let fields = match twice {
                    Some(name) => Err(Error::BadRequest(format!("field {name:?} is given more than once"))),
                    None => Ok(fields),
                };
                Ok(OpFields { fields })
            }
            // Anything but an object is refused as that operation's own error.
            fn visit_bool<E>(self, _: bool) -> Result<OpFields, E> {
                Ok(OpFields::not_an_object())
            }
            fn visit_i64<E>(self, _: i64) -> Result<OpFields, E> {
                Ok(OpFields::not_an_object())
            }
            fn visit_u64<E>(self, _: u64) -> Result<OpFields, E> {
                Ok(OpFields::not_an_object())
            }
            fn visit_f64<E>(self, _: f64) -> Result<OpFields, E> {
                Ok(OpFields::not_an_object())
            }
            fn visit_str<E>(self, _: &str) -> Result<OpFields, E> {
                Ok(OpFields::not_an_object())
            }
            fn visit_unit<E>(self) -> Result<OpFields, E> {
                Ok(OpFields::not_an_object())
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<OpFields, A::Error> {
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(OpFields::not_an_object())
            }
        }
        d.deserialize_any(Visit)
    }
}

impl OpFields {
    fn not_an_object() -> OpFields {
        OpFields { fields: Err(Error::BadRequest("an operation must be a JSON object".into())) }
    }
}

/// One operation, parsed (or why it could not be).
enum Op {
    Acquire(AcquireRequest),
    Renew(RenewRequest),
    Release(ReleaseRequest),
    Invalid(Error),
}

/// Reads one operation: an object with `"op"` and the fields of the
/// single call's body.
fn parse(op: OpFields, metrics: &crate::metrics::Metrics) -> Op {
    let mut fields = match op.fields {
        Ok(fields) => fields,
        Err(e) => return Op::Invalid(e),
    };
    let name = match fields.remove("op") {
        Some(Value::String(s)) => s,
        _ => return Op::Invalid(Error::BadRequest("an operation needs \"op\": acquire, renew or release".into())),
    };
    let rest = Value::Object(fields);
    let invalid = |e: serde_json::Error| {
        metrics.lock_request(&name, "invalid");
        Op::Invalid(Error::BadRequest(format!("invalid {name} operation: {e}")))
    };
    match name.as_str() {
        "acquire" => serde_json::from_value(rest).map_or_else(invalid, Op::Acquire),
        "renew" => serde_json::from_value(rest).map_or_else(invalid, Op::Renew),
        "release" => serde_json::from_value(rest).map_or_else(invalid, Op::Release),
        other => Op::Invalid(Error::BadRequest(format!(
            "unknown op {:?}: acquire, renew or release",
            other.chars().take(64).collect::<String>()
        ))),
    }
}

/// The answer to one operation: its status and its body, as the single
/// call would have had them.
fn answer(result: Result<Value, Error>) -> Value {
    match result {
        Ok(mut body) => {
            body["status"] = json!(200);
            body
        }
        Err(e) => {
            let mut body = e.body();
            body["status"] = json!(e.status().as_u16());
            body
        }
    }
}

impl Api {
    pub(super) async fn batch(&self, req: Request<BoxBody>, p: Option<&Principal>) -> Result<Response<BoxBody>, Error> {
        let limit = self.max_body_bytes.saturating_mul(BATCH_BODY_FACTOR);
        let timeout_ms = u64::try_from(self.body_read_timeout.as_millis()).unwrap_or(u64::MAX);
        let body: BatchRequest = tokio::time::timeout(self.body_read_timeout, super::read_json(req, limit))
            .await
            .map_err(|_| Error::BodyTimeout { timeout_ms })??;
        if body.operations.len() > MAX_BATCH_OPERATIONS {
            return Err(Error::BadRequest(format!(
                "a batch holds at most {MAX_BATCH_OPERATIONS} operations, got {}",
                body.operations.len()
            )));
        }
        // Every operation is started in order: each takes effect (a grant
        // is installed, a renewal or release applied) before the next one
        // starts, and the acquires then wait for their fsync together.
        let mut started = Vec::with_capacity(body.operations.len());
        for op in body.operations {
            let op = parse(op, &self.metrics);
            let mut fut = Box::pin(async move { answer(self.run(op, p).await) });
            // Poll once, now: the operation takes effect before the next
            // one is looked at; an acquire stops at its fsync.
            let first = std::future::poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await;
            started.push(match first {
                Poll::Ready(a) => Either::Left(std::future::ready(a)),
                Poll::Pending => Either::Right(fut),
            });
        }
        let answers = join_all(started).await;
        Ok(json_response(StatusCode::OK, &json!({ "results": answers })))
    }

    async fn run(&self, op: Op, p: Option<&Principal>) -> Result<Value, Error> {
        let to_value = |v: Result<Value, serde_json::Error>| v.map_err(|e| Error::Internal(format!("rendering: {e}")));
        match op {
            Op::Invalid(e) => Err(e),
            Op::Acquire(body) => {
                authorize(p, &body.key)?;
                if body.wait_ms > 0 {
                    self.metrics.lock_request("acquire", "invalid");
                    return Err(Error::BadRequest("an acquire in a batch does not wait: wait_ms must be 0".into()));
                }
                // The fence quota of the principal, as for a single acquire.
                let new_key = self.authority.fences().fence(&body.key) == 0;
                if p.is_some_and(|p| new_key && self.fences.full(p)) {
                    return Err(Error::FenceQuota { scope: "principal", limit: self.fences.limit });
                }
                let grant = self.authority.acquire(body).await?;
                if let Some(p) = p.filter(|_| new_key) {
                    self.fences.add(p);
                }
                to_value(serde_json::to_value(grant))
            }
            Op::Renew(body) => {
                authorize(p, &body.key)?;
                to_value(serde_json::to_value(self.authority.renew(body).await?))
            }
            Op::Release(body) => {
                authorize(p, &body.key)?;
                let key = body.key.clone();
                self.authority.release(body).await?;
                Ok(json!({ "key": key, "released": true }))
            }
        }
    }
}
