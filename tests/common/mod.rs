//! Shared helpers of the integration tests: the real `fencegate` binary on
//! free loopback ports, a small HTTP client, and a recording upstream.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener as StdListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::Value;

/// A free loopback port (bound, then released), never one this process
/// handed out before: the kernel may give the same released port to two
/// binds in a row, and an etcd cluster whose two members got the same peer
/// port never forms.
pub fn free_port() -> u16 {
    static GIVEN: Mutex<Vec<u16>> = Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap();
    loop {
        let port = StdListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// The real binary, running as a child process.
pub struct Gateway {
    pub child: Child,
    pub proxy: SocketAddr,
    pub api: SocketAddr,
    pub data_dir: PathBuf,
    pub log: PathBuf,
}

/// How to start the binary.
#[derive(Clone, Default)]
pub struct Opts {
    pub upstream: Option<String>,
    pub config: Option<String>,
    pub proxy_port: Option<u16>,
    pub api_port: Option<u16>,
    /// Run the binary confined to this one CPU (`taskset`), as a
    /// one-CPU container would: the gateway then runs a current-thread
    /// runtime.
    pub one_cpu: Option<u32>,
    /// Extra environment of the child (e.g. a debug-build fault, src/fault.rs).
    pub env: Vec<(&'static str, String)>,
}

impl Gateway {
    /// Starts `fencegate serve` on `data_dir` and waits until it listens.
    /// A port picked by [`free_port`] can be taken by another process before
    /// the child binds it; the child then exits at once (before touching its
    /// data dir), and the start is retried on other ports.
    pub fn start(data_dir: &Path, opts: Opts) -> Gateway {
        let retry_ok = opts.proxy_port.is_none() || opts.api_port.is_none();
        let mut attempt = 0;
        loop {
            attempt += 1;
            let mut gw = Gateway::spawn(data_dir, &opts);
            match gw.wait_ready(Duration::from_secs(60)) {
                Ok(()) => return gw,
                Err(log) if retry_ok && attempt < 5 && log.contains("Address already in use") => {
                    let _ = gw.child.wait();
                }
                Err(log) => panic!("gateway did not come up; log:\n{log}"),
            }
        }
    }

    pub fn spawn(data_dir: &Path, opts: &Opts) -> Gateway {
        let proxy: SocketAddr = format!("127.0.0.1:{}", opts.proxy_port.unwrap_or_else(free_port)).parse().unwrap();
        // Two free ports drawn one after the other can be the same one.
        let api_port = opts.api_port.unwrap_or_else(|| loop {
            let p = free_port();
            if p != proxy.port() {
                break p;
            }
        });
        let api: SocketAddr = format!("127.0.0.1:{api_port}").parse().unwrap();
        let log = data_dir.with_extension(format!("{}.log", api.port()));
        let mut cmd = match opts.one_cpu {
            Some(cpu) => {
                let mut c = Command::new("taskset");
                c.arg("-c").arg(cpu.to_string()).arg(env!("CARGO_BIN_EXE_fencegate"));
                c
            }
            None => Command::new(env!("CARGO_BIN_EXE_fencegate")),
        };
        cmd.arg("serve")
            .arg("--data-dir")
            .arg(data_dir)
            .arg("--listen")
            .arg(proxy.to_string())
            .arg("--api-listen")
            .arg(api.to_string());
        if let Some(u) = &opts.upstream {
            cmd.arg("--upstream").arg(u);
        }
        if let Some(text) = &opts.config {
            let path = data_dir.with_extension("toml");
            std::fs::write(&path, text).unwrap();
            cmd.arg("--config").arg(path);
        }
        let logfile = std::fs::File::create(&log).unwrap();
        cmd.stdout(Stdio::null()).stderr(logfile).env("RUST_LOG", "info");
        for (k, v) in &opts.env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().expect("spawning fencegate");
        Gateway { child, proxy, api, data_dir: data_dir.to_path_buf(), log }
    }

    /// Waits until the gateway says it is serving. Its ports accept
    /// connections earlier (they are bound before the store opens, and
    /// requests made meanwhile wait in the backlog), so accepting alone does
    /// not mean the data dir is open. The log when the child exited or the
    /// limit passed.
    pub fn wait_ready(&mut self, limit: Duration) -> Result<(), String> {
        let started = Instant::now();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!("(exited: {status})\n{}", self.log_text()));
            }
            if self.log_text().contains("fencegate serving")
                && std::net::TcpStream::connect(self.api).is_ok()
                && std::net::TcpStream::connect(self.proxy).is_ok()
            {
                return Ok(());
            }
            if started.elapsed() > limit {
                return Err(format!("(not ready after {limit:?})\n{}", self.log_text()));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn api_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.api)
    }

    pub fn proxy_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.proxy)
    }

    /// SIGKILL, no goodbye.
    pub fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM and wait for a clean exit.
    pub fn terminate(mut self) -> std::process::ExitStatus {
        signal(self.child.id(), "TERM");
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(started.elapsed() < Duration::from_secs(30), "gateway did not stop on SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends a signal by name to a PID.
pub fn signal(pid: u32, name: &str) {
    let ok = Command::new("kill").arg(format!("-{name}")).arg(pid.to_string()).status().unwrap().success();
    assert!(ok, "kill -{name} {pid}");
}

/// A response, whole.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", String::from_utf8_lossy(&self.body)))
    }
    pub fn error_code(&self) -> String {
        self.json()["error"].as_str().unwrap_or("").to_string()
    }
}

/// A pooled HTTP/1.1 client.
#[derive(Clone)]
pub struct Http(Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>);

impl Default for Http {
    fn default() -> Self {
        Http(Client::builder(TokioExecutor::new()).build_http())
    }
}

impl Http {
    pub async fn send(&self, method: Method, url: &str, headers: &[(&str, &str)], body: impl Into<Bytes>) -> Reply {
        self.try_send(method, url, headers, body).await.expect("request failed")
    }

    /// Like `send`, but a transport failure is an `Err`, not a panic.
    pub async fn try_send(
        &self,
        method: Method,
        url: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Result<Reply, String> {
        let mut b = Request::builder().method(method).uri(url);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        let resp = self.0.request(b.body(Full::new(body.into())).unwrap()).await.map_err(|e| e.to_string())?;
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
        Ok(Reply { status: parts.status, headers: parts.headers, body })
    }

    pub async fn try_post_json(&self, url: &str, body: Value) -> Result<Reply, String> {
        self.try_send(Method::POST, url, &[("content-type", "application/json")], body.to_string()).await
    }

    pub async fn post_json(&self, url: &str, body: Value) -> Reply {
        self.send(Method::POST, url, &[("content-type", "application/json")], body.to_string()).await
    }

    pub async fn get(&self, url: &str) -> Reply {
        self.send(Method::GET, url, &[], Bytes::new()).await
    }
}

pub async fn collect<B>(resp: Response<B>) -> Reply
where
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.expect("reading body").to_bytes();
    Reply { status: parts.status, headers: parts.headers, body }
}

/// A grant as the API returns it.
#[derive(Debug, Clone)]
pub struct Grant {
    pub key: String,
    pub token: u64,
    pub lease_id: String,
}

pub async fn acquire(http: &Http, gw_api: &str, key: &str, ttl_ms: u64, wait_ms: u64) -> Result<Grant, Reply> {
    let r = http
        .post_json(
            &format!("{gw_api}/v1/locks/acquire"),
            serde_json::json!({"key": key, "ttl_ms": ttl_ms, "wait_ms": wait_ms, "holder": "test"}),
        )
        .await;
    if r.status != StatusCode::OK {
        return Err(r);
    }
    let v = r.json();
    Ok(Grant {
        key: key.to_string(),
        token: v["fencing_token"].as_u64().unwrap(),
        lease_id: v["lease_id"].as_str().unwrap().to_string(),
    })
}

pub async fn release(http: &Http, gw_api: &str, g: &Grant) -> Reply {
    http.post_json(&format!("{gw_api}/v1/locks/release"), serde_json::json!({"key": g.key, "lease_id": g.lease_id}))
        .await
}

/// One request as the recording upstream received it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: Method,
    pub path: String,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub complete: bool,
}

/// An HTTP upstream that records every request it receives (and whether
/// its body arrived whole), with an optional delay before answering.
#[derive(Clone)]
pub struct Recorder {
    pub addr: SocketAddr,
    pub seen: Arc<Mutex<Vec<Seen>>>,
    pub delay_ms: Arc<Mutex<HashMap<String, u64>>>,
    /// Paths whose delayed writes are applied (recorded) even when the
    /// gateway's connection closed meanwhile, as a backend that commits
    /// what it received whole does.
    pub detached: Arc<Mutex<std::collections::HashSet<String>>>,
}

impl Recorder {
    pub async fn start() -> Recorder {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
        let delay_ms: Arc<Mutex<HashMap<String, u64>>> = Arc::default();
        let detached: Arc<Mutex<std::collections::HashSet<String>>> = Arc::default();
        let rec = Recorder { addr, seen: seen.clone(), delay_ms: delay_ms.clone(), detached: detached.clone() };
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let seen = seen.clone();
                let delay_ms = delay_ms.clone();
                let detached = detached.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                        let seen = seen.clone();
                        let delay_ms = delay_ms.clone();
                        let detached = detached.clone();
                        async move {
                            let (parts, body) = req.into_parts();
                            let path = parts.uri.path().to_string();
                            let (body, complete) = match body.collect().await {
                                Ok(c) => (c.to_bytes(), true),
                                Err(_) => (Bytes::new(), false),
                            };
                            let delay = delay_ms.lock().unwrap().get(&path).copied();
                            let detach = detached.lock().unwrap().contains(&path);
                            let record = Seen { method: parts.method, path, headers: parts.headers, body, complete };
                            let apply = async move {
                                if let Some(ms) = delay {
                                    tokio::time::sleep(Duration::from_millis(ms)).await;
                                }
                                seen.lock().unwrap().push(record);
                            };
                            if detach {
                                // Applied even if this exchange is dropped.
                                let _ = tokio::spawn(apply).await;
                            } else {
                                apply.await;
                            }
                            Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from_static(b"stored"))))
                        }
                    });
                    let _ =
                        hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), svc).await;
                });
            }
        });
        rec
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn count(&self) -> usize {
        self.seen.lock().unwrap().len()
    }

    pub fn requests(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    pub fn set_delay(&self, path: &str, ms: u64) {
        self.delay_ms.lock().unwrap().insert(path.to_string(), ms);
    }

    /// Writes to `path` are applied even when the gateway hangs up first.
    pub fn apply_even_if_abandoned(&self, path: &str) {
        self.detached.lock().unwrap().insert(path.to_string());
    }
}

/// A PUT to `url` under `token` whose body the test feeds itself: it keeps
/// streaming until `body` is dropped (an upload still in flight).
pub struct StreamedUpload {
    pub body: tokio::sync::mpsc::Sender<Result<http_body::Frame<Bytes>, std::io::Error>>,
    pub response: tokio::task::JoinHandle<Result<Response<hyper::body::Incoming>, hyper_util::client::legacy::Error>>,
}

/// Starts a [`StreamedUpload`] and sends its first 64 KiB.
pub async fn start_streamed_upload(url: &str, token: u64) -> StreamedUpload {
    let (body, rx) = tokio::sync::mpsc::channel::<Result<http_body::Frame<Bytes>, std::io::Error>>(4);
    let stream = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|x| (x, rx)) });
    let client = Client::builder(TokioExecutor::new()).build_http();
    let req = Request::put(url)
        .header("x-fencing-token", token.to_string())
        .body(http_body_util::StreamBody::new(Box::pin(stream)))
        .unwrap();
    let response = tokio::spawn(client.request(req));
    body.send(Ok(http_body::Frame::data(Bytes::from(vec![b'a'; 64 * 1024])))).await.unwrap();
    StreamedUpload { body, response }
}
