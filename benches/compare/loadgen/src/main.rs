//! Load generator for `benches/compare/run.sh`.
//!
//! Subcommands (each prints exactly one JSON line on stdout):
//!
//! ```text
//! loadgen lock   SYSTEM ADDR --op cycle|renew --clients C --secs S [--prefix P]
//!                SYSTEM = fencegate | redis | etcd | etcd-txn | etcd-lock;
//!                ADDR = host:port[,host:port…] (client i uses the (i mod n)-th)
//! loadgen bigput URL --size BYTES --conns C --secs S [--token T]
//! loadgen fill   URL_PREFIX --keys N --conns C [--token T]
//! loadgen hold   API_ADDR --keys N --clients C [--prefix P] [--ttl-ms MS]
//! loadgen held   SYSTEM ADDR --keys N --clients C --secs S [--batch B] [--ttl-ms MS] [--prefix P]
//! loadgen sink   PORT
//! ```
//!
//! `lock`: closed loop, C clients, each on its own connection, for S
//! seconds after every client has connected.
//! - cycle = acquire + release of the client's own key
//!   (fencegate: POST /v1/locks/acquire, /v1/locks/release;
//!   Redis: `SET k v NX PX 30000` + Lua compare-and-delete (EVALSHA);
//!   etcd: one session lease per client granted up front, then
//!   txn `If(create_revision(k) == 0) Then Put(k, v, lease)` + deleterange,
//!   over etcd's JSON gateway;
//!   etcd-txn: the same over gRPC (etcd-client), one client connection and
//!   one session lease per client, as a careful etcd user does;
//!   etcd-lock: etcd's own lock service over gRPC, v3lock `Lock(name,
//!   session lease)` + `Unlock(key)`, one session lease per client).
//!   In cycle runs the JSON line also carries the acquire's own latency
//!   (`acquire_p50_us`, `acquire_p99_us`).
//! - renew = renewal of a lease held by the client
//!   (fencegate: /v1/locks/renew; Redis: Lua compare-and-pexpire;
//!   etcd: /v3/lease/keepalive).
//!
//! `bigput`: C connections each PUT a streamed body of BYTES (never held in
//! memory: one 256 KiB chunk repeated) to URL, back to back, for S seconds
//! (the request in flight at the deadline completes and counts).
//!
//! `fill`: PUT URL_PREFIX + key(i) for i in 0..N with X-Fencing-Token
//! (default 1): on a fencegate route with `fence_authority = "external"`
//! each PUT installs a durable fence.
//!
//! `hold`: acquires (and never releases) N leases on key(i), for i in 0..N,
//! with a 1 h TTL: live leases for the memory measurement.
//!
//! `held` (issue 18): N leases held, then work on top of them, one client
//! per connection, closed loop, SYSTEM = fencegate | redis:
//! 1. fill: the C clients acquire key(0..N) between them (fencegate:
//!    POST /v1/locks/acquire; Redis: a Lua script `SET lock:K owner NX PX`
//!    then `INCR fence:K`, one round trip, the way a careful Redis user
//!    takes a fenced lock);
//! 2. renew round: every held lease renewed once (fencegate:
//!    POST /v1/locks/batch of B renewals; Redis: B compare-and-pexpire
//!    EVALSHAs pipelined), the design's 10-second renewal round;
//! 3. mix: for S seconds, each client repeats acquire (a key of its own
//!    that nobody holds) : renew (a random lease it holds) : release (its
//!    oldest lease), one request per operation, so N leases stay held;
//!    operations/s and p50/p99 over all three, and per operation.
//!
//! `sink`: a minimal HTTP/1.1 server on 127.0.0.1:PORT that reads every
//! request body to its end, drops it, and only then answers 200 with an
//! empty body (the backend of the 64 MiB runs: unlike nginx `return 200`,
//! it never answers before the upload is complete). Runs until killed.
//!
//! key(i) = PREFIX + format!("{:08x}", (i * 2654435761) mod 2^32): a
//! bijection on 0..2^32, so distinct and random-looking; `wrk/random.lua`
//! computes the same keys.

use std::collections::HashMap;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

type B = BoxBody<Bytes, Infallible>;
type Res<T> = Result<T, String>;

fn key_of(prefix: &str, i: u64) -> String {
    format!("{prefix}{:08x}", (i.wrapping_mul(2_654_435_761)) & 0xffff_ffff)
}

// ---------------------------------------------------------------- args

struct Args {
    pos: Vec<String>,
    opts: HashMap<String, String>,
}

impl Args {
    fn parse() -> Args {
        let mut pos = Vec::new();
        let mut opts = HashMap::new();
        let mut it = std::env::args().skip(1);
        while let Some(a) = it.next() {
            if let Some(name) = a.strip_prefix("--") {
                let v = it.next().unwrap_or_default();
                opts.insert(name.to_string(), v);
            } else {
                pos.push(a);
            }
        }
        Args { pos, opts }
    }
    fn get(&self, name: &str, default: &str) -> String {
        self.opts.get(name).cloned().unwrap_or_else(|| default.to_string())
    }
    fn num(&self, name: &str, default: u64) -> u64 {
        self.opts.get(name).map(|v| parse_size(v)).unwrap_or(default)
    }
    fn secs(&self, default: f64) -> f64 {
        self.opts.get("secs").and_then(|v| v.parse().ok()).unwrap_or(default)
    }
}

fn parse_size(v: &str) -> u64 {
    let (n, mul) = if let Some(n) = v.strip_suffix("MiB") {
        (n, 1 << 20)
    } else if let Some(n) = v.strip_suffix("KiB") {
        (n, 1 << 10)
    } else if let Some(n) = v.strip_suffix("GiB") {
        (n, 1 << 30)
    } else {
        (v, 1)
    };
    n.trim().parse::<u64>().map(|n| n * mul).unwrap_or_else(|_| panic!("not a number: {v}"))
}

// ---------------------------------------------------------------- http

struct Http {
    tx: SendRequest<B>,
    host: String,
}

impl Http {
    async fn connect(addr: &str) -> Res<Http> {
        let stream = TcpStream::connect(addr).await.map_err(|e| format!("connect {addr}: {e}"))?;
        let _ = stream.set_nodelay(true);
        let (tx, conn) = http1::handshake(TokioIo::new(stream)).await.map_err(|e| e.to_string())?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(Http { tx, host: addr.to_string() })
    }

    async fn send(&mut self, req: Request<B>) -> Res<(u16, Bytes)> {
        self.tx.ready().await.map_err(|e| e.to_string())?;
        let resp = self.tx.send_request(req).await.map_err(|e| e.to_string())?;
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
        Ok((status, body))
    }

    async fn post(&mut self, path: &str, body: &Value) -> Res<(u16, Value)> {
        let req = Request::post(path)
            .header("host", &self.host)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())).boxed())
            .map_err(|e| e.to_string())?;
        let (status, bytes) = self.send(req).await?;
        Ok((status, serde_json::from_slice(&bytes).unwrap_or(Value::Null)))
    }
}

/// A body of `remaining` bytes made of one chunk repeated: streamed, never
/// materialised.
struct RepeatBody {
    chunk: Bytes,
    remaining: u64,
}

impl Body for RepeatBody {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.remaining == 0 {
            return Poll::Ready(None);
        }
        let n = self.remaining.min(self.chunk.len() as u64) as usize;
        self.remaining -= n as u64;
        Poll::Ready(Some(Ok(Frame::data(self.chunk.slice(..n)))))
    }
    fn is_end_stream(&self) -> bool {
        self.remaining == 0
    }
    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.remaining)
    }
}

fn split_url(url: &str) -> Res<(String, String)> {
    let rest = url.strip_prefix("http://").ok_or("URL must start with http://")?;
    let (addr, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    Ok((addr.to_string(), path.to_string()))
}

// ---------------------------------------------------------------- redis

struct Redis {
    io: BufReader<TcpStream>,
}

#[derive(Debug)]
#[allow(dead_code)] // read through Debug in error messages
enum Reply {
    Simple(String),
    Int(i64),
    Bulk(Option<Vec<u8>>),
    Err(String),
}

impl Redis {
    async fn connect(addr: &str) -> Res<Redis> {
        let stream = TcpStream::connect(addr).await.map_err(|e| format!("connect {addr}: {e}"))?;
        let _ = stream.set_nodelay(true);
        Ok(Redis { io: BufReader::new(stream) })
    }

    async fn cmd(&mut self, args: &[&[u8]]) -> Res<Reply> {
        let mut buf = Vec::with_capacity(128);
        buf.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
        for a in args {
            buf.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
            buf.extend_from_slice(a);
            buf.extend_from_slice(b"\r\n");
        }
        self.io.get_mut().write_all(&buf).await.map_err(|e| e.to_string())?;
        self.read_reply().await
    }

    async fn read_reply(&mut self) -> Res<Reply> {
        let mut line = String::new();
        self.io.read_line(&mut line).await.map_err(|e| e.to_string())?;
        let line = line.trim_end_matches("\r\n");
        let (kind, rest) = line.split_at(1.min(line.len()));
        match kind {
            "+" => Ok(Reply::Simple(rest.to_string())),
            "-" => Ok(Reply::Err(rest.to_string())),
            ":" => Ok(Reply::Int(rest.parse().map_err(|_| format!("bad int {rest}"))?)),
            "$" => {
                let n: i64 = rest.parse().map_err(|_| format!("bad bulk len {rest}"))?;
                if n < 0 {
                    return Ok(Reply::Bulk(None));
                }
                let mut data = vec![0u8; n as usize + 2];
                self.io.read_exact(&mut data).await.map_err(|e| e.to_string())?;
                data.truncate(n as usize);
                Ok(Reply::Bulk(Some(data)))
            }
            _ => Err(format!("unexpected reply {line:?}")),
        }
    }

    async fn load(&mut self, script: &str) -> Res<String> {
        match self.cmd(&[b"SCRIPT", b"LOAD", script.as_bytes()]).await? {
            Reply::Bulk(Some(sha)) => Ok(String::from_utf8_lossy(&sha).into_owned()),
            other => Err(format!("SCRIPT LOAD: {other:?}")),
        }
    }
}

const REDIS_RELEASE: &str =
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end";
const REDIS_RENEW: &str =
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end";

// ---------------------------------------------------------------- etcd

fn b64(input: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(input.len().div_ceil(3) * 4);
    for c in input.chunks(3) {
        let b = [c[0], *c.get(1).unwrap_or(&0), *c.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        out.push(T[(n >> 18) as usize & 63] as char);
        out.push(T[(n >> 12) as usize & 63] as char);
        out.push(if c.len() > 1 { T[(n >> 6) as usize & 63] as char } else { '=' });
        out.push(if c.len() > 2 { T[n as usize & 63] as char } else { '=' });
    }
    out
}

// ---------------------------------------------------------------- lock

/// One client's state for one system.
enum LockClient {
    Fencegate {
        http: Http,
        key: String,
        lease: Option<String>,
    },
    Redis {
        r: Redis,
        key: Vec<u8>,
        release: String,
        renew: String,
        val: Vec<u8>,
    },
    Etcd {
        http: Http,
        key: String,
        lease: String,
    },
    EtcdTxn {
        kv: etcd_client::KvClient,
        leases: etcd_client::LeaseClient,
        key: String,
        lease: i64,
    },
    EtcdLock {
        lock: etcd_client::LockClient,
        leases: etcd_client::LeaseClient,
        name: String,
        lease: i64,
        held: Option<Vec<u8>>,
    },
}

/// A gRPC session to one etcd endpoint with a session lease of 60 s.
async fn etcd_session(addr: &str) -> Res<(etcd_client::Client, i64)> {
    let url = if addr.contains("://") { addr.to_string() } else { format!("http://{addr}") };
    let client = etcd_client::Client::connect([url], None).await.map_err(|e| format!("etcd connect {addr}: {e}"))?;
    let lease = client.lease_client().grant(60, None).await.map_err(|e| format!("etcd lease grant: {e}"))?.id();
    Ok((client, lease))
}

impl LockClient {
    async fn new(system: &str, addrs: &str, prefix: &str, id: usize) -> Res<LockClient> {
        let key = format!("{prefix}{id}");
        let list: Vec<&str> = addrs.split(',').filter(|a| !a.is_empty()).collect();
        let addr = *list.get(id % list.len().max(1)).ok_or("no address")?;
        match system {
            "fencegate" => Ok(LockClient::Fencegate { http: Http::connect(addr).await?, key, lease: None }),
            "redis" => {
                let mut r = Redis::connect(addr).await?;
                let release = r.load(REDIS_RELEASE).await?;
                let renew = r.load(REDIS_RENEW).await?;
                Ok(LockClient::Redis { r, key: key.into_bytes(), release, renew, val: Vec::new() })
            }
            "etcd" => {
                let mut http = Http::connect(addr).await?;
                let (st, v) = http.post("/v3/lease/grant", &json!({"TTL": "60"})).await?;
                let lease = v["ID"].as_str().map(str::to_string).or_else(|| v["ID"].as_i64().map(|n| n.to_string()));
                match (st, lease) {
                    (200, Some(lease)) => Ok(LockClient::Etcd { http, key: b64(key.as_bytes()), lease }),
                    _ => Err(format!("etcd lease grant: {st} {v}")),
                }
            }
            "etcd-txn" => {
                let (client, lease) = etcd_session(addr).await?;
                Ok(LockClient::EtcdTxn { kv: client.kv_client(), leases: client.lease_client(), key, lease })
            }
            "etcd-lock" => {
                let (client, lease) = etcd_session(addr).await?;
                Ok(LockClient::EtcdLock {
                    lock: client.lock_client(),
                    leases: client.lease_client(),
                    name: key,
                    lease,
                    held: None,
                })
            }
            other => Err(format!("unknown system {other}")),
        }
    }

    async fn acquire(&mut self, n: u64) -> Res<()> {
        match self {
            LockClient::Fencegate { http, key, lease } => {
                let (st, v) = http.post("/v1/locks/acquire", &json!({"key": key, "ttl_ms": 30000})).await?;
                match (st, v["lease_id"].as_str(), v["fencing_token"].as_u64()) {
                    (200, Some(id), Some(_)) => {
                        *lease = Some(id.to_string());
                        Ok(())
                    }
                    _ => Err(format!("acquire: {st} {v}")),
                }
            }
            LockClient::Redis { r, key, val, .. } => {
                *val = format!("v{n}").into_bytes();
                match r.cmd(&[b"SET", key, val, b"NX", b"PX", b"30000"]).await? {
                    Reply::Simple(s) if s == "OK" => Ok(()),
                    other => Err(format!("SET NX: {other:?}")),
                }
            }
            LockClient::Etcd { http, key, lease } => {
                let body = json!({
                    "compare": [{"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
                    "success": [{"request_put": {"key": key, "value": b64(format!("v{n}").as_bytes()), "lease": lease}}],
                });
                let (st, v) = http.post("/v3/kv/txn", &body).await?;
                if st == 200 && v["succeeded"].as_bool() == Some(true) {
                    Ok(())
                } else {
                    Err(format!("etcd txn: {st} {v}"))
                }
            }
            LockClient::EtcdTxn { kv, key, lease, .. } => {
                use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
                let txn = Txn::new()
                    .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
                    .and_then([TxnOp::put(key.as_str(), format!("v{n}"), Some(PutOptions::new().with_lease(*lease)))]);
                match kv.txn(txn).await {
                    Ok(r) if r.succeeded() => Ok(()),
                    Ok(_) => Err("etcd txn: the key exists".into()),
                    Err(e) => Err(format!("etcd txn: {e}")),
                }
            }
            LockClient::EtcdLock { lock, name, lease, held, .. } => {
                let opts = etcd_client::LockOptions::new().with_lease(*lease);
                match lock.lock(name.as_str(), Some(opts)).await {
                    Ok(r) => {
                        *held = Some(r.key().to_vec());
                        Ok(())
                    }
                    Err(e) => Err(format!("etcd lock: {e}")),
                }
            }
        }
    }

    async fn release(&mut self) -> Res<()> {
        match self {
            LockClient::Fencegate { http, key, lease } => {
                let id = lease.take().unwrap_or_default();
                let (st, v) = http.post("/v1/locks/release", &json!({"key": key, "lease_id": id})).await?;
                if st == 200 {
                    Ok(())
                } else {
                    Err(format!("release: {st} {v}"))
                }
            }
            LockClient::Redis { r, key, val, release, .. } => {
                match r.cmd(&[b"EVALSHA", release.as_bytes(), b"1", key, val]).await? {
                    Reply::Int(1) => Ok(()),
                    other => Err(format!("compare-and-delete: {other:?}")),
                }
            }
            LockClient::Etcd { http, key, .. } => {
                let (st, v) = http.post("/v3/kv/deleterange", &json!({"key": key})).await?;
                if st == 200 && v["deleted"].as_str().unwrap_or("0") == "1" {
                    Ok(())
                } else {
                    Err(format!("etcd deleterange: {st} {v}"))
                }
            }
            LockClient::EtcdTxn { kv, key, .. } => match kv.delete(key.as_str(), None).await {
                Ok(r) if r.deleted() == 1 => Ok(()),
                Ok(r) => Err(format!("etcd delete: deleted {}", r.deleted())),
                Err(e) => Err(format!("etcd delete: {e}")),
            },
            LockClient::EtcdLock { lock, held, .. } => {
                let key = held.take().ok_or("etcd unlock: nothing held")?;
                lock.unlock(key).await.map(|_| ()).map_err(|e| format!("etcd unlock: {e}"))
            }
        }
    }

    async fn renew(&mut self) -> Res<()> {
        match self {
            LockClient::Fencegate { http, key, lease } => {
                let id = lease.clone().unwrap_or_default();
                let (st, v) = http.post("/v1/locks/renew", &json!({"key": key, "lease_id": id})).await?;
                if st == 200 {
                    Ok(())
                } else {
                    Err(format!("renew: {st} {v}"))
                }
            }
            LockClient::Redis { r, key, val, renew, .. } => {
                match r.cmd(&[b"EVALSHA", renew.as_bytes(), b"1", key, val, b"30000"]).await? {
                    Reply::Int(1) => Ok(()),
                    other => Err(format!("compare-and-pexpire: {other:?}")),
                }
            }
            LockClient::Etcd { http, lease, .. } => {
                let (st, v) = http.post("/v3/lease/keepalive", &json!({"ID": lease})).await?;
                if st == 200 && v["result"]["TTL"].as_str().is_some_and(|t| t != "0") {
                    Ok(())
                } else {
                    Err(format!("etcd keepalive: {st} {v}"))
                }
            }
            LockClient::EtcdTxn { leases, lease, .. } | LockClient::EtcdLock { leases, lease, .. } => {
                let (mut keeper, mut stream) =
                    leases.keep_alive(*lease).await.map_err(|e| format!("etcd keepalive: {e}"))?;
                keeper.keep_alive().await.map_err(|e| format!("etcd keepalive: {e}"))?;
                match stream.message().await {
                    Ok(Some(r)) if r.ttl() > 0 => Ok(()),
                    other => Err(format!("etcd keepalive: {other:?}")),
                }
            }
        }
    }
}

impl LockClient {
    /// Leaves nothing behind: releases a lease still held (renew runs) and
    /// revokes etcd's session lease.
    async fn close(&mut self, holding: bool) {
        if holding {
            let _ = self.release().await;
        }
        match self {
            LockClient::Etcd { http, lease, .. } => {
                let _ = http.post("/v3/lease/revoke", &json!({"ID": lease})).await;
            }
            LockClient::EtcdTxn { leases, lease, .. } | LockClient::EtcdLock { leases, lease, .. } => {
                let _ = leases.revoke(*lease).await;
            }
            _ => {}
        }
    }
}

struct Tally {
    ops: u64,
    errors: u64,
    first_error: Option<String>,
    lat_us: Vec<u32>,
    /// Acquire latency alone (cycle runs).
    acq_us: Vec<u32>,
}

fn pct(sorted: &[u32], p: f64) -> u32 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

async fn lock_cmd(args: &Args) -> Res<Value> {
    let system = args.pos.get(1).ok_or("lock SYSTEM ADDR")?.clone();
    let addr = args.pos.get(2).ok_or("lock SYSTEM ADDR")?.clone();
    let op = args.get("op", "cycle");
    let clients = args.num("clients", 1) as usize;
    let secs = args.secs(5.0);
    let prefix = args.get("prefix", &format!("lg/{}/{op}/", std::process::id()));
    let mut conns = Vec::with_capacity(clients);
    for id in 0..clients {
        let mut c = LockClient::new(&system, &addr, &prefix, id).await?;
        if op == "renew" {
            c.acquire(0).await?;
        }
        conns.push(c);
    }
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for mut c in conns {
        let op = op.clone();
        tasks.push(tokio::spawn(async move {
            let mut t = Tally {
                ops: 0,
                errors: 0,
                first_error: None,
                lat_us: Vec::with_capacity(1 << 16),
                acq_us: Vec::with_capacity(1 << 16),
            };
            let mut n = 0u64;
            while Instant::now() < deadline {
                n += 1;
                let t0 = Instant::now();
                let r = if op == "renew" {
                    c.renew().await
                } else {
                    match c.acquire(n).await {
                        Ok(()) => {
                            t.acq_us.push(t0.elapsed().as_micros().min(u32::MAX as u128) as u32);
                            c.release().await
                        }
                        Err(e) => Err(e),
                    }
                };
                match r {
                    Ok(()) => {
                        t.ops += 1;
                        t.lat_us.push(t0.elapsed().as_micros().min(u32::MAX as u128) as u32);
                    }
                    Err(e) => {
                        t.errors += 1;
                        if t.first_error.is_none() {
                            t.first_error = Some(e);
                        }
                        if t.errors > 1000 {
                            break;
                        }
                    }
                }
            }
            c.close(op == "renew").await;
            t
        }));
    }
    let mut total = Tally { ops: 0, errors: 0, first_error: None, lat_us: Vec::new(), acq_us: Vec::new() };
    for task in tasks {
        let t = task.await.map_err(|e| e.to_string())?;
        total.ops += t.ops;
        total.errors += t.errors;
        if total.first_error.is_none() {
            total.first_error = t.first_error;
        }
        total.lat_us.extend(t.lat_us);
        total.acq_us.extend(t.acq_us);
    }
    let elapsed = start.elapsed().as_secs_f64();
    total.lat_us.sort_unstable();
    total.acq_us.sort_unstable();
    Ok(json!({
        "cmd": "lock", "system": system, "op": op, "clients": clients,
        "ops": total.ops, "secs": elapsed, "ops_per_s": total.ops as f64 / elapsed,
        "p50_us": pct(&total.lat_us, 0.5), "p99_us": pct(&total.lat_us, 0.99),
        "acquire_p50_us": pct(&total.acq_us, 0.5), "acquire_p99_us": pct(&total.acq_us, 0.99),
        "errors": total.errors, "first_error": total.first_error,
    }))
}

// ---------------------------------------------------------------- bigput

async fn bigput_cmd(args: &Args) -> Res<Value> {
    let url = args.pos.get(1).ok_or("bigput URL")?.clone();
    let (addr, path) = split_url(&url)?;
    let size = args.num("size", 64 << 20);
    let conns = args.num("conns", 1) as usize;
    let secs = args.secs(5.0);
    let token = args.opts.get("token").cloned();
    let chunk = Bytes::from(vec![b'x'; 256 << 10]);
    let mut https = Vec::new();
    for _ in 0..conns {
        https.push(Http::connect(&addr).await?);
    }
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for mut h in https {
        let (path, token, chunk) = (path.clone(), token.clone(), chunk.clone());
        tasks.push(tokio::spawn(async move {
            let (mut bytes, mut reqs, mut errors, mut first_error, mut lat) = (0u64, 0u64, 0u64, None, Vec::new());
            while Instant::now() < deadline {
                let mut b = Request::put(path.as_str()).header("host", &h.host).header("content-length", size);
                if let Some(t) = &token {
                    b = b.header("x-fencing-token", t.as_str());
                }
                let req = b.body(RepeatBody { chunk: chunk.clone(), remaining: size }.boxed()).expect("request");
                let t0 = Instant::now();
                match h.send(req).await {
                    Ok((st, _)) if (200..300).contains(&st) => {
                        bytes += size;
                        reqs += 1;
                        lat.push(t0.elapsed().as_secs_f64());
                    }
                    Ok((st, body)) => {
                        errors += 1;
                        first_error.get_or_insert(format!("{st} {}", String::from_utf8_lossy(&body)));
                        break;
                    }
                    Err(e) => {
                        errors += 1;
                        first_error.get_or_insert(e);
                        break;
                    }
                }
            }
            // The last response may have come before its body was all sent
            // (nginx `return 200` answers early and discards the rest): the
            // run ends when the connection is idle again.
            let _ = h.tx.ready().await;
            (bytes, reqs, errors, first_error, lat)
        }));
    }
    let (mut bytes, mut reqs, mut errors, mut first_error, mut lat) = (0u64, 0u64, 0u64, None, Vec::new());
    for t in tasks {
        let (b, r, e, f, l) = t.await.map_err(|e| e.to_string())?;
        bytes += b;
        reqs += r;
        errors += e;
        if first_error.is_none() {
            first_error = f;
        }
        lat.extend(l);
    }
    let elapsed = start.elapsed().as_secs_f64();
    lat.sort_by(f64::total_cmp);
    let median = lat.get(lat.len() / 2).copied().unwrap_or(0.0);
    Ok(json!({
        "cmd": "bigput", "url": url, "size": size, "conns": conns, "requests": reqs, "bytes": bytes,
        "secs": elapsed, "mib_per_s": bytes as f64 / elapsed / (1u64 << 20) as f64,
        "median_request_s": median, "errors": errors, "first_error": first_error,
    }))
}

// ---------------------------------------------------------------- fill / hold

async fn parallel_keys<F, Fut>(n: u64, conns: usize, addr: &str, f: F) -> Res<(u64, u64, Option<String>, f64)>
where
    F: Fn(Http, Arc<AtomicU64>) -> Fut,
    Fut: std::future::Future<Output = (u64, u64, Option<String>)> + Send + 'static,
{
    let next = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..conns.min(n.max(1) as usize) {
        let h = Http::connect(addr).await?;
        tasks.push(tokio::spawn(f(h, next.clone())));
    }
    let (mut ok, mut errors, mut first) = (0, 0, None);
    for t in tasks {
        let (o, e, f) = t.await.map_err(|e| e.to_string())?;
        ok += o;
        errors += e;
        if first.is_none() {
            first = f;
        }
    }
    Ok((ok, errors, first, start.elapsed().as_secs_f64()))
}

async fn fill_cmd(args: &Args) -> Res<Value> {
    let url = args.pos.get(1).ok_or("fill URL_PREFIX")?.clone();
    let (addr, prefix) = split_url(&url)?;
    let n = args.num("keys", 1);
    let conns = args.num("conns", 64) as usize;
    let token = args.get("token", "1");
    let (ok, errors, first, secs) = parallel_keys(n, conns, &addr, |mut h, next| {
        let (prefix, token) = (prefix.clone(), token.clone());
        async move {
            let (mut ok, mut errors, mut first) = (0u64, 0u64, None);
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break;
                }
                let req = Request::put(key_of(&prefix, i))
                    .header("host", &h.host)
                    .header("x-fencing-token", token.as_str())
                    .body(Full::new(Bytes::from_static(b"x")).boxed())
                    .expect("request");
                match h.send(req).await {
                    Ok((st, _)) if (200..300).contains(&st) => ok += 1,
                    Ok((st, body)) => {
                        errors += 1;
                        first.get_or_insert(format!("{st} {}", String::from_utf8_lossy(&body)));
                    }
                    Err(e) => {
                        errors += 1;
                        first.get_or_insert(e);
                        break;
                    }
                }
            }
            (ok, errors, first)
        }
    })
    .await?;
    Ok(json!({"cmd": "fill", "keys": n, "ok": ok, "errors": errors, "first_error": first, "secs": secs,
              "per_s": ok as f64 / secs}))
}

async fn hold_cmd(args: &Args) -> Res<Value> {
    let addr = args.pos.get(1).ok_or("hold API_ADDR")?.clone();
    let n = args.num("keys", 1);
    let conns = args.num("clients", 64) as usize;
    let prefix = args.get("prefix", "hold/");
    let ttl = args.num("ttl-ms", 3_600_000);
    let (ok, errors, first, secs) = parallel_keys(n, conns, &addr, |mut h, next| {
        let prefix = prefix.clone();
        async move {
            let (mut ok, mut errors, mut first) = (0u64, 0u64, None);
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break;
                }
                match h.post("/v1/locks/acquire", &json!({"key": key_of(&prefix, i), "ttl_ms": ttl})).await {
                    Ok((200, _)) => ok += 1,
                    Ok((st, v)) => {
                        errors += 1;
                        first.get_or_insert(format!("{st} {v}"));
                    }
                    Err(e) => {
                        errors += 1;
                        first.get_or_insert(e);
                        break;
                    }
                }
            }
            (ok, errors, first)
        }
    })
    .await?;
    Ok(json!({"cmd": "hold", "keys": n, "ok": ok, "errors": errors, "first_error": first, "secs": secs,
              "per_s": ok as f64 / secs}))
}

// ---------------------------------------------------------------- held

const REDIS_ACQUIRE: &str = "if redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then \
     return redis.call('incr', KEYS[2]) else return 0 end";

/// A 128-bit owner value (hex) from a counter: distinct, not secret (a
/// benchmark's Redis owner).
fn owner_of(n: u64) -> String {
    let mix = |mut z: u64| {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    format!("{:016x}{:016x}", mix(n), mix(n ^ 0x5555_5555_5555_5555))
}

/// One client of `held`: its connection and the leases it holds.
enum HeldConn {
    Fencegate(Http),
    Redis { r: Redis, acquire: String, renew: String, release: String },
}

struct Holder {
    conn: HeldConn,
    /// (key, lease id or Redis owner), oldest first.
    held: std::collections::VecDeque<(String, String)>,
    /// Keys of this client that nobody holds.
    free: std::collections::VecDeque<String>,
    ttl_ms: u64,
    n: u64,
    rng: u64,
}

impl Holder {
    fn rand(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }

    async fn acquire(&mut self, key: String) -> Res<()> {
        self.n += 1;
        let ttl = self.ttl_ms;
        let secret = match &mut self.conn {
            HeldConn::Fencegate(h) => {
                let (st, v) = h.post("/v1/locks/acquire", &json!({"key": key, "ttl_ms": ttl})).await?;
                match (st, v["lease_id"].as_str()) {
                    (200, Some(id)) => id.to_string(),
                    _ => return Err(format!("acquire {key}: {st} {v}")),
                }
            }
            HeldConn::Redis { r, acquire, .. } => {
                let owner = owner_of(self.n ^ (self.rng << 20));
                let (lk, fk) = (format!("lock:{key}"), format!("fence:{key}"));
                let ttl = ttl.to_string();
                let args: [&[u8]; 7] = [
                    b"EVALSHA",
                    acquire.as_bytes(),
                    b"2",
                    lk.as_bytes(),
                    fk.as_bytes(),
                    owner.as_bytes(),
                    ttl.as_bytes(),
                ];
                match r.cmd(&args).await? {
                    Reply::Int(t) if t > 0 => owner,
                    other => return Err(format!("acquire {key}: {other:?}")),
                }
            }
        };
        self.held.push_back((key, secret));
        Ok(())
    }

    async fn renew(&mut self, i: usize) -> Res<()> {
        let (key, secret) = self.held.get(i).cloned().ok_or("renew: nothing held")?;
        let ttl = self.ttl_ms;
        match &mut self.conn {
            HeldConn::Fencegate(h) => {
                let (st, v) = h.post("/v1/locks/renew", &json!({"key": key, "lease_id": secret})).await?;
                if st == 200 {
                    Ok(())
                } else {
                    Err(format!("renew {key}: {st} {v}"))
                }
            }
            HeldConn::Redis { r, renew, .. } => {
                let (lk, ttl) = (format!("lock:{key}"), ttl.to_string());
                let args: [&[u8]; 6] =
                    [b"EVALSHA", renew.as_bytes(), b"1", lk.as_bytes(), secret.as_bytes(), ttl.as_bytes()];
                match r.cmd(&args).await? {
                    Reply::Int(1) => Ok(()),
                    other => Err(format!("renew {key}: {other:?}")),
                }
            }
        }
    }

    async fn release_oldest(&mut self) -> Res<()> {
        let (key, secret) = self.held.pop_front().ok_or("release: nothing held")?;
        let r = match &mut self.conn {
            HeldConn::Fencegate(h) => {
                let (st, v) = h.post("/v1/locks/release", &json!({"key": key, "lease_id": secret})).await?;
                if st == 200 {
                    Ok(())
                } else {
                    Err(format!("release {key}: {st} {v}"))
                }
            }
            HeldConn::Redis { r, release, .. } => {
                let lk = format!("lock:{key}");
                let args: [&[u8]; 5] = [b"EVALSHA", release.as_bytes(), b"1", lk.as_bytes(), secret.as_bytes()];
                match r.cmd(&args).await? {
                    Reply::Int(1) => Ok(()),
                    other => Err(format!("release {key}: {other:?}")),
                }
            }
        };
        self.free.push_back(key);
        r
    }

    /// Renews every held lease once, `batch` per request (fencegate) or
    /// per pipelined write (Redis). Returns the renewals that failed.
    async fn renew_all(&mut self, batch: usize) -> Res<u64> {
        let ttl = self.ttl_ms;
        let mut failed = 0;
        let leases: Vec<(String, String)> = self.held.iter().cloned().collect();
        for chunk in leases.chunks(batch.max(1)) {
            match &mut self.conn {
                HeldConn::Fencegate(h) => {
                    let ops: Vec<Value> =
                        chunk.iter().map(|(k, id)| json!({"op": "renew", "key": k, "lease_id": id})).collect();
                    let (st, v) = h.post("/v1/locks/batch", &json!({ "operations": ops })).await?;
                    let results = v["results"].as_array().filter(|r| st == 200 && r.len() == chunk.len());
                    let Some(results) = results else {
                        return Err(format!("batch: {st} {v}"));
                    };
                    failed += results.iter().filter(|r| r["status"] != 200).count() as u64;
                }
                HeldConn::Redis { r, renew, .. } => {
                    let ttl = ttl.to_string();
                    let mut buf = Vec::with_capacity(chunk.len() * 128);
                    for (k, owner) in chunk {
                        let lk = format!("lock:{k}");
                        let args: [&[u8]; 6] =
                            [b"EVALSHA", renew.as_bytes(), b"1", lk.as_bytes(), owner.as_bytes(), ttl.as_bytes()];
                        buf.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
                        for a in args {
                            buf.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
                            buf.extend_from_slice(a);
                            buf.extend_from_slice(b"\r\n");
                        }
                    }
                    r.io.get_mut().write_all(&buf).await.map_err(|e| e.to_string())?;
                    for _ in chunk {
                        if !matches!(r.read_reply().await?, Reply::Int(1)) {
                            failed += 1;
                        }
                    }
                }
            }
        }
        Ok(failed)
    }
}

async fn held_cmd(args: &Args) -> Res<Value> {
    let system = args.pos.get(1).ok_or("held SYSTEM ADDR")?.clone();
    let addr = args.pos.get(2).ok_or("held SYSTEM ADDR")?.clone();
    let n = args.num("keys", 10_000);
    let clients = args.num("clients", 64) as usize;
    let secs = args.secs(5.0);
    let batch = args.num("batch", 1000) as usize;
    let ttl_ms = args.num("ttl-ms", 900_000);
    let prefix = args.get("prefix", "held/");
    const FREE_PER_CLIENT: u64 = 16;
    let mut holders = Vec::with_capacity(clients);
    for c in 0..clients {
        let conn = match system.as_str() {
            "fencegate" => HeldConn::Fencegate(Http::connect(&addr).await?),
            "redis" => {
                let mut r = Redis::connect(&addr).await?;
                let acquire = r.load(REDIS_ACQUIRE).await?;
                let renew = r.load(REDIS_RENEW).await?;
                let release = r.load(REDIS_RELEASE).await?;
                HeldConn::Redis { r, acquire, renew, release }
            }
            other => return Err(format!("unknown system {other}")),
        };
        let free = (0..FREE_PER_CLIENT).map(|j| key_of(&prefix, n + c as u64 * FREE_PER_CLIENT + j)).collect();
        holders.push(Holder {
            conn,
            held: std::collections::VecDeque::new(),
            free,
            ttl_ms,
            n: c as u64 * 1_000_000_000,
            rng: 0x2545_F491_4F6C_DD1D ^ (c as u64 + 1).wrapping_mul(0x9E37_79B9),
        });
    }

    // 1. Fill.
    let start = Instant::now();
    let mut tasks = Vec::new();
    for (c, mut h) in holders.into_iter().enumerate() {
        let prefix = prefix.clone();
        tasks.push(tokio::spawn(async move {
            let mut i = c as u64;
            while i < n {
                h.acquire(key_of(&prefix, i)).await?;
                i += clients as u64;
            }
            Ok::<_, String>(h)
        }));
    }
    let mut holders = Vec::new();
    for t in tasks {
        holders.push(t.await.map_err(|e| e.to_string())??);
    }
    let fill_secs = start.elapsed().as_secs_f64();

    // 2. One renewal round over every held lease.
    let start = Instant::now();
    let mut tasks = Vec::new();
    for mut h in holders {
        tasks.push(tokio::spawn(async move {
            let failed = h.renew_all(batch).await?;
            Ok::<_, String>((h, failed))
        }));
    }
    let mut holders = Vec::new();
    let mut renew_failed = 0;
    for t in tasks {
        let (h, f) = t.await.map_err(|e| e.to_string())??;
        renew_failed += f;
        holders.push(h);
    }
    let renew_secs = start.elapsed().as_secs_f64();

    // 3. The 1 : 1 : 1 mix: closed loop, then open loop at each offered rate.
    let (holders, closed) = mix(holders, secs, None).await?;
    let mut holders = holders;
    let mut open = Vec::new();
    for rate in args.get("rates", "").split(',').filter(|r| !r.is_empty()) {
        let rate: f64 = rate.parse().map_err(|_| format!("--rates: not a number: {rate}"))?;
        let (h, v) = mix(holders, secs, Some(rate)).await?;
        holders = h;
        open.push(v);
    }
    let still_held: usize = holders.iter().map(|h| h.held.len()).sum();
    Ok(json!({
        "cmd": "held", "system": system, "keys": n, "clients": clients, "batch": batch,
        "fill": {"secs": fill_secs, "per_s": n as f64 / fill_secs},
        "renew_round": {"renewals": n, "secs": renew_secs, "per_s": n as f64 / renew_secs, "failed": renew_failed},
        "mix": closed, "open_loop": open, "held_after": still_held,
    }))
}

/// `secs` of acquire : renew : release at 1 : 1 : 1, every client in
/// turn. `rate`: `None` is closed loop (each client sends its next
/// operation when the last is answered); `Some(r)` is open loop at `r`
/// operations a second in all: each client has a fixed schedule, and an
/// operation's latency counts from when it was due, not from when it was
/// sent (a server that falls behind is charged the queue it built).
async fn mix(holders: Vec<Holder>, secs: f64, rate: Option<f64>) -> Res<(Vec<Holder>, Value)> {
    let clients = holders.len().max(1);
    let interval = rate.map(|r| Duration::from_secs_f64(clients as f64 / r.max(1.0)));
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for (c, mut h) in holders.into_iter().enumerate() {
        tasks.push(tokio::spawn(async move {
            let mut lat: [Vec<u32>; 3] = [Vec::new(), Vec::new(), Vec::new()];
            let (mut errors, mut first, mut late) = (0u64, None::<String>, 0u64);
            // Clients' schedules are spread over one interval.
            let mut due = interval.map(|i| start + i.mul_f64(c as f64 / clients as f64));
            'run: while Instant::now() < deadline {
                for (op, op_lat) in lat.iter_mut().enumerate() {
                    let t0 = match (due, interval) {
                        (Some(at), Some(i)) => {
                            if at >= deadline {
                                break 'run;
                            }
                            if Instant::now() < at {
                                tokio::time::sleep_until(at.into()).await;
                            } else if Instant::now() > at + i {
                                late += 1;
                            }
                            due = Some(at + i);
                            at
                        }
                        _ => Instant::now(),
                    };
                    let r = match op {
                        0 => match h.free.pop_front() {
                            Some(k) => h.acquire(k).await,
                            None => Err("no free key".into()),
                        },
                        1 => {
                            let i = (h.rand() % h.held.len().max(1) as u64) as usize;
                            h.renew(i).await
                        }
                        _ => h.release_oldest().await,
                    };
                    match r {
                        Ok(()) => op_lat.push(t0.elapsed().as_micros().min(u32::MAX as u128) as u32),
                        Err(e) => {
                            errors += 1;
                            first.get_or_insert(e);
                        }
                    }
                }
                if errors > 100 {
                    break;
                }
            }
            (h, lat, errors, first, late)
        }));
    }
    let mut holders = Vec::new();
    let mut lat: [Vec<u32>; 3] = [Vec::new(), Vec::new(), Vec::new()];
    let (mut errors, mut first, mut late) = (0u64, None::<String>, 0u64);
    for t in tasks {
        let (h, l, e, f, lt) = t.await.map_err(|e| e.to_string())?;
        holders.push(h);
        for (all, mine) in lat.iter_mut().zip(l) {
            all.extend(mine);
        }
        errors += e;
        late += lt;
        if first.is_none() {
            first = f;
        }
    }
    let mix_secs = start.elapsed().as_secs_f64();
    let mut all: Vec<u32> = lat.iter().flatten().copied().collect();
    all.sort_unstable();
    for l in lat.iter_mut() {
        l.sort_unstable();
    }
    let per_op = |i: usize| json!({"ops": lat[i].len(), "p50_us": pct(&lat[i], 0.5), "p99_us": pct(&lat[i], 0.99)});
    let v = json!({"offered_per_s": rate, "secs": mix_secs, "ops": all.len(), "ops_per_s": all.len() as f64 / mix_secs,
                   "p50_us": pct(&all, 0.5), "p99_us": pct(&all, 0.99),
                   "acquire": per_op(0), "renew": per_op(1), "release": per_op(2),
                   "sent_more_than_one_interval_late": late,
                   "errors": errors, "first_error": first});
    Ok((holders, v))
}

// ---------------------------------------------------------------- sink

async fn sink_cmd(args: &Args) -> Res<Value> {
    let port: u16 = args.pos.get(1).and_then(|p| p.parse().ok()).ok_or("sink PORT")?;
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await.map_err(|e| e.to_string())?;
    loop {
        let (stream, _) = listener.accept().await.map_err(|e| e.to_string())?;
        let _ = stream.set_nodelay(true);
        tokio::spawn(async move {
            let service = hyper::service::service_fn(|req: Request<hyper::body::Incoming>| async move {
                let mut body = req.into_body();
                while let Some(frame) = body.frame().await {
                    frame?;
                }
                Ok::<_, hyper::Error>(hyper::Response::new(Full::new(Bytes::new())))
            });
            let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
        });
    }
}

// ---------------------------------------------------------------- main

fn main() {
    let args = Args::parse();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let result = rt.block_on(async {
        match args.pos.first().map(String::as_str) {
            Some("lock") => lock_cmd(&args).await,
            Some("bigput") => bigput_cmd(&args).await,
            Some("fill") => fill_cmd(&args).await,
            Some("hold") => hold_cmd(&args).await,
            Some("held") => held_cmd(&args).await,
            Some("sink") => sink_cmd(&args).await,
            _ => Err("usage: loadgen lock|bigput|fill|hold|sink … (see the source's header)".to_string()),
        }
    });
    match result {
        Ok(v) => println!("{v}"),
        Err(e) => {
            eprintln!("loadgen: {e}");
            std::process::exit(1);
        }
    }
}
